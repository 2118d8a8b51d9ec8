"""The public API: published formulas, equivalences, input validation, stability, no mutation."""

from __future__ import annotations

import importlib.util
import math
from typing import Any, Callable, Dict

import pytest
import torch
import torch.nn.functional as F

import flashcl
from helpers import CASES, Case, assert_close

ALL_BACKENDS = ("reference", "dense", "tiled", "auto")
F64 = dict(dtype=torch.float64)


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), **F64)


# ----------------------------------------------------------------------------- published formulas


def supcon_pair_loop(emb: torch.Tensor, labels: torch.Tensor, t: float) -> torch.Tensor:
    """Khosla et al. 2020, eq. 2 (L_out), written as plain loops over explicit pairs."""
    z = F.normalize(emb, dim=1)
    b = z.shape[0]
    total, anchors = 0.0, 0
    for i in range(b):
        positives = [p for p in range(b) if p != i and labels[p] == labels[i]]
        if not positives:
            continue
        den = sum(math.exp(float(z[i] @ z[a]) / t) for a in range(b) if a != i)
        total += -sum(math.log(math.exp(float(z[i] @ z[p]) / t) / den) for p in positives) / len(positives)
        anchors += 1
    return torch.tensor(total / anchors, **F64)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_supcon_matches_published_formula(backend: str) -> None:
    emb, labels = _rand(14, 5), torch.tensor([0, 1, 2, 0, 1, 2, 0, 3, 1, 1, 4, 2, 2, 0])
    got = flashcl.supcon_loss(emb, labels, temperature=0.2, backend=backend)
    assert_close(got, supcon_pair_loop(emb, labels, 0.2), "supcon vs eq. 2", 1e-10, 1e-10)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_supcon_matches_pytorch_metric_learning(backend: str) -> None:
    losses = pytest.importorskip("pytorch_metric_learning.losses", reason="pytorch-metric-learning not installed")
    emb, labels = _rand(40, 8, seed=2), torch.randint(0, 6, (40,), generator=torch.Generator().manual_seed(3))
    e1, e2 = emb.clone().requires_grad_(True), emb.clone().requires_grad_(True)
    expected = losses.SupConLoss(temperature=0.1)(e1, labels)
    expected.backward()
    got = flashcl.supcon_loss(e2, labels, temperature=0.1, backend=backend)
    got.backward()
    assert_close(got, expected, "vs PML SupConLoss", 1e-9, 1e-9)
    assert_close(e2.grad, e1.grad, "grad vs PML SupConLoss", 1e-9, 1e-9)


def test_supcon_views_follow_supcontrast_convention() -> None:
    """(B, V, D) equals the (B*V, D) batch of views concatenated view-major, labels repeated."""
    emb, labels = _rand(6, 2, 4), torch.tensor([0, 1, 0, 2, 1, 1])
    flat = torch.cat(torch.unbind(emb, dim=1), dim=0)
    assert_close(flashcl.supcon_loss(emb, labels), flashcl.supcon_loss(flat, labels.repeat(2)), "views", 1e-12, 1e-12)
    none = flashcl.supcon_loss(emb, labels, reduction="none")
    assert none.shape == (6, 2)
    assert_close(
        none.T.reshape(-1),
        flashcl.supcon_loss(flat, labels.repeat(2), reduction="none"),
        "per-view losses",
        1e-12,
        1e-12,
    )


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_nt_xent_equals_supcon_with_pair_ids(backend: str) -> None:
    z1, z2 = _rand(7, 5, seed=1), _rand(7, 5, seed=2)
    got = flashcl.nt_xent_loss(z1, z2, temperature=0.3, backend=backend, reduction="none")
    ids = torch.arange(7).repeat(2)
    expected = flashcl.supcon_loss(torch.cat([z1, z2]), ids, temperature=0.3, backend="reference", reduction="none")
    assert_close(got, expected, "nt_xent vs supcon", 1e-10, 1e-10)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_info_nce_equals_cross_entropy(backend: str) -> None:
    q, k = _rand(6, 5, seed=1), _rand(15, 5, seed=2)
    pos = torch.tensor([0, 14, 3, 3, 7, 5])
    logits = F.normalize(q, dim=1) @ F.normalize(k, dim=1).T / 0.05
    for red in ("mean", "sum", "none"):
        got = flashcl.info_nce_loss(q, k, pos, temperature=0.05, reduction=red, backend=backend)
        assert_close(got, F.cross_entropy(logits, pos, reduction=red), f"info_nce {red}", 1e-10, 1e-10)
    default = flashcl.info_nce_loss(q, k, backend=backend)
    assert_close(default, F.cross_entropy(logits, torch.arange(6)), "default positives", 1e-10, 1e-10)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_clip_equals_open_clip_formula(backend: str) -> None:
    img, txt = _rand(9, 6, seed=4), _rand(9, 6, seed=5)
    scale = torch.tensor(math.log(1 / 0.07), **F64).exp()
    # open_clip.loss.ClipLoss on one process: logits_per_image = logit_scale * image @ text.T
    ih, th = F.normalize(img, dim=-1), F.normalize(txt, dim=-1)
    logits = scale * ih @ th.T
    labels = torch.arange(9)
    expected = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
    assert_close(flashcl.clip_loss(img, txt, scale, backend=backend), expected, "clip", 1e-10, 1e-10)
    assert_close(flashcl.ClipLoss(backend=backend)(img, txt, scale), expected, "ClipLoss module", 1e-10, 1e-10)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_clip_equals_open_clip(backend: str) -> None:
    from flashcl.bench.peers import open_clip_loss_module

    module, why = open_clip_loss_module()
    if module is None:
        pytest.skip(why)
    img, txt = _rand(12, 6, seed=7), _rand(12, 6, seed=8)
    i1, t1 = img.clone().requires_grad_(True), txt.clone().requires_grad_(True)
    s1 = torch.tensor(14.3, **F64, requires_grad=True)
    expected = module.ClipLoss()(F.normalize(i1, dim=-1), F.normalize(t1, dim=-1), s1)
    expected.backward()
    i2, t2 = img.clone().requires_grad_(True), txt.clone().requires_grad_(True)
    s2 = torch.tensor(14.3, **F64, requires_grad=True)
    got = flashcl.ClipLoss(backend=backend)(i2, t2, s2)
    got.backward()
    assert_close(got, expected, "vs open_clip ClipLoss", 1e-10, 1e-10)
    for a, e, what in ((i2.grad, i1.grad, "image"), (t2.grad, t1.grad, "text"), (s2.grad, s1.grad, "scale")):
        assert_close(a, e, f"grad {what} vs open_clip", 1e-10, 1e-10)


def test_modules_call_the_functions() -> None:
    emb, labels = _rand(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    z1, z2 = _rand(5, 4, seed=1), _rand(5, 4, seed=2)
    s, nb = _rand(6, 6), flashcl.sample_neighbors(6, 2, generator=torch.Generator().manual_seed(0))
    pairs = [
        (
            flashcl.SupConLoss(temperature=0.3, positives="sum")(emb, labels),
            flashcl.supcon_loss(emb, labels, temperature=0.3, positives="sum"),
        ),
        (flashcl.NTXentLoss(temperature=0.4)(z1, z2), flashcl.nt_xent_loss(z1, z2, temperature=0.4)),
        (flashcl.InfoNCELoss(reduction="sum")(z1, z2), flashcl.info_nce_loss(z1, z2, reduction="sum")),
        (flashcl.NeighborLoss(reduction="mean")(s, nb), flashcl.neighbor_loss(s, nb, reduction="mean")),
    ]
    for i, (a, b) in enumerate(pairs):
        assert_close(a, b, f"module {i}", 0, 0)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_learnable_temperature_gradient(backend: str) -> None:
    """d loss / d t from flashcl equals the one autograd gets through the plain formula."""
    emb, labels = _rand(10, 4), torch.tensor([0, 1, 0, 1, 2, 2, 0, 1, 3, 3])
    t1 = torch.tensor(0.25, **F64, requires_grad=True)
    flashcl.supcon_loss(emb, labels, temperature=t1, backend=backend).backward()
    t2 = torch.tensor(0.25, **F64, requires_grad=True)
    z = F.normalize(emb, dim=1)
    s = z @ z.T / t2
    eye = torch.eye(10, dtype=torch.bool)
    lse = torch.logsumexp(s.masked_fill(eye, -math.inf), 1)
    pos = (labels[:, None] == labels[None, :]) & ~eye
    loss = (lse - (s * pos).sum(1) / pos.sum(1)).mean()
    loss.backward()
    assert_close(t1.grad, t2.grad, "d loss / d temperature", 1e-10, 1e-10)


# ----------------------------------------------------------------------------- anchors without positives


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_no_anchor_has_a_positive_gives_zero_not_nan(backend: str) -> None:
    emb = _rand(6, 4).requires_grad_(True)
    loss = flashcl.supcon_loss(emb, torch.arange(6), backend=backend)
    loss.backward()
    assert float(loss.detach()) == 0.0
    assert torch.equal(emb.grad, torch.zeros_like(emb))


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_anchors_without_positive_are_left_out_of_the_mean(backend: str) -> None:
    emb, labels = _rand(7, 4), torch.tensor([0, 0, 1, 1, 1, 5, 6])
    per = flashcl.supcon_loss(emb, labels, reduction="none", backend=backend)
    assert torch.equal(per[5:], torch.zeros(2, **F64))
    assert_close(flashcl.supcon_loss(emb, labels, backend=backend), per[:5].mean(), "mean over 5", 1e-12, 1e-12)


# ----------------------------------------------------------------------------- stability


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_scores_of_1e4_stay_finite_and_exact(backend: str) -> None:
    emb, labels = _rand(12, 4, seed=6) * 50.0, torch.tensor([0, 1, 2] * 4)  # scores up to ~1e4
    assert float((emb @ emb.T).abs().max()) > 5e3
    e32 = emb.float().requires_grad_(True)
    loss = flashcl.supcon_loss(e32, labels, temperature=1.0, normalize=False, backend=backend)
    loss.backward()
    expected = flashcl.supcon_loss(emb, labels, temperature=1.0, normalize=False, backend="reference")
    assert torch.isfinite(loss) and torch.isfinite(e32.grad).all()
    assert_close(loss, expected, "loss at 1e4", 0.0, 1e-5)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_nan_input_propagates(backend: str) -> None:
    emb = _rand(6, 4)
    emb[2, 1] = float("nan")
    emb.requires_grad_(True)
    loss = flashcl.supcon_loss(emb, torch.tensor([0, 0, 1, 1, 2, 2]), backend=backend)
    loss.backward()
    assert torch.isnan(loss)
    s = _rand(5, 5)
    s[1, 3] = float("nan")
    assert torch.isnan(flashcl.neighbor_loss(s, torch.ones(5, 1, dtype=torch.long), backend=backend))


# ----------------------------------------------------------------------------- no mutation


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_inputs_are_never_modified(case: Case, backend: str) -> None:
    inputs = [t.clone().requires_grad_(True) for t in case.tensors]
    extra = [e.clone() for e in case.extra]
    kwargs = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in case.kwargs.items()}
    keys = [v for v in kwargs.values() if isinstance(v, torch.Tensor)]  # keys without gradient, labels
    snapshot = [t.detach().clone() for t in inputs] + [e.clone() for e in extra + keys]
    for red in ("mean", "none"):
        loss = case.fn(*inputs, *extra, backend=backend, reduction=red, **kwargs)
        loss.sum().backward()
    for before, after in zip(snapshot, [t.detach() for t in inputs] + extra + keys):
        assert torch.equal(before, after), f"{case.name}: an input was modified"


# ----------------------------------------------------------------------------- bad input

E = _rand(4, 3)
L = torch.tensor([0, 1, 0, 1])
S = _rand(4, 4)
NB = torch.tensor([[1], [2], [3], [0]])

BAD: Dict[str, Any] = {
    "labels length": (lambda: flashcl.supcon_loss(E, torch.tensor([0, 1, 0])), ValueError, "labels"),
    "labels 2-D": (lambda: flashcl.supcon_loss(E, L[:, None]), ValueError, "labels"),
    "labels float": (lambda: flashcl.supcon_loss(E, L.float()), TypeError, "labels"),
    "labels bool": (lambda: flashcl.supcon_loss(E, L.bool()), TypeError, "labels"),
    "embeddings 1-D": (lambda: flashcl.supcon_loss(E[0], L[:1]), ValueError, "embeddings"),
    "embeddings 4-D": (lambda: flashcl.supcon_loss(E[:, None, None], L), ValueError, "embeddings"),
    "embeddings int": (lambda: flashcl.supcon_loss(L[:, None].expand(4, 3), L), TypeError, "embeddings"),
    "embeddings list": (lambda: flashcl.supcon_loss([[1.0]], L), TypeError, "embeddings"),
    "empty batch": (lambda: flashcl.supcon_loss(E[:0], L[:0]), ValueError, "empty"),
    "single sample": (lambda: flashcl.supcon_loss(E[:1], L[:1]), ValueError, "at least 2"),
    "temperature 0": (lambda: flashcl.supcon_loss(E, L, temperature=0.0), ValueError, "temperature"),
    "temperature < 0": (lambda: flashcl.nt_xent_loss(E, E, temperature=-1.0), ValueError, "temperature"),
    "temperature nan": (lambda: flashcl.info_nce_loss(E, E, temperature=float("nan")), ValueError, "temperature"),
    "temperature inf": (lambda: flashcl.supcon_loss(E, L, temperature=float("inf")), ValueError, "temperature"),
    "temperature tensor 0": (
        lambda: flashcl.supcon_loss(E, L, temperature=torch.tensor(0.0)),
        ValueError,
        "temperature",
    ),
    "temperature vector": (lambda: flashcl.supcon_loss(E, L, temperature=torch.ones(2)), ValueError, "temperature"),
    "temperature str": (lambda: flashcl.supcon_loss(E, L, temperature="0.1"), TypeError, "temperature"),
    "logit_scale 0": (lambda: flashcl.clip_loss(E, E, 0.0), ValueError, "logit_scale"),
    "logit_scale < 0": (lambda: flashcl.clip_loss(E, E, torch.tensor(-2.0)), ValueError, "logit_scale"),
    "clip shapes": (lambda: flashcl.clip_loss(E, E[:3], 1.0), ValueError, "same shape"),
    "nt_xent shapes": (lambda: flashcl.nt_xent_loss(E, E[:, :2]), ValueError, "same shape"),
    "nt_xent dtypes": (lambda: flashcl.nt_xent_loss(E, E.float()), TypeError, "dtype"),
    "info_nce dim": (lambda: flashcl.info_nce_loss(E, E[:, :2]), ValueError, "embedding dim"),
    "info_nce fewer keys": (lambda: flashcl.info_nce_loss(E, E[:2]), ValueError, "at least as many"),
    "positive_index range": (
        lambda: flashcl.info_nce_loss(E, E, torch.tensor([0, 1, 2, 4])),
        ValueError,
        "positive_index",
    ),
    "positive_index length": (lambda: flashcl.info_nce_loss(E, E, torch.tensor([0, 1])), ValueError, "positive_index"),
    "positive_index float": (lambda: flashcl.info_nce_loss(E, E, torch.zeros(4)), TypeError, "positive_index"),
    "neighbors range": (lambda: flashcl.neighbor_loss(S, NB + 1), ValueError, "neighbors"),
    "neighbors negative": (lambda: flashcl.neighbor_loss(S, NB - 1), ValueError, "neighbors"),
    "neighbors float": (lambda: flashcl.neighbor_loss(S, NB.float()), TypeError, "neighbors"),
    "neighbors rows": (lambda: flashcl.neighbor_loss(S, NB[:3]), ValueError, "neighbors"),
    "neighbors 1-D": (lambda: flashcl.neighbor_loss(S, NB[:, 0]), ValueError, "neighbors"),
    "scores not square": (lambda: flashcl.neighbor_loss(S[:, :3], NB % 3), ValueError, "square"),
    "reduction": (lambda: flashcl.supcon_loss(E, L, reduction="avg"), ValueError, "reduction"),
    "backend": (lambda: flashcl.supcon_loss(E, L, backend="cuda"), ValueError, "backend"),
    "positives": (lambda: flashcl.supcon_loss(E, L, positives="max"), ValueError, "positives"),
    "block_size": (lambda: flashcl.supcon_loss(E, L, block_size=0), ValueError, "block_size"),
    "sample n": (lambda: flashcl.sample_neighbors(0, 2), ValueError, "n"),
    "sample k": (lambda: flashcl.sample_neighbors(3, 0), ValueError, "k"),
    "sample exclude_self n=1": (lambda: flashcl.sample_neighbors(1, 1, exclude_self=True), ValueError, "n >= 2"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_input_raises_clear_error(name: str) -> None:
    call, exc, words = BAD[name]
    with pytest.raises(exc, match=words):
        call()


# ----------------------------------------------------------------------------- sample_neighbors


def test_sample_neighbors() -> None:
    a = flashcl.sample_neighbors(50, 3, generator=torch.Generator().manual_seed(5))
    b = flashcl.sample_neighbors(50, 3, generator=torch.Generator().manual_seed(5))
    assert a.shape == (50, 3) and a.dtype == torch.int64 and torch.equal(a, b)
    assert int(a.min()) >= 0 and int(a.max()) < 50
    c = flashcl.sample_neighbors(50, 40, exclude_self=True, generator=torch.Generator().manual_seed(1))
    assert not (c == torch.arange(50)[:, None]).any()
    assert int(c.max()) == 49 and int(c.min()) == 0, "exclude_self still reaches both ends"


def test_every_callable_has_a_docstring_with_sections() -> None:
    fns: Dict[str, Callable[..., Any]] = {
        n: getattr(flashcl, n) for n in flashcl.__all__ if callable(getattr(flashcl, n))
    }
    for name, fn in fns.items():
        doc = fn.__doc__ or ""
        assert "Examples::" in doc, f"{name} has no Examples"
        if not isinstance(fn, type):
            assert "Args:" in doc and "Shape:" in doc, f"{name} lacks Args/Shape"


def test_case_table_covers_every_loss() -> None:
    covered = {c.fn.__name__ for c in CASES.values()}
    assert covered == {
        "supcon_loss",
        "nt_xent_loss",
        "info_nce_loss",
        "clip_loss",
        "siglip_loss",
        "gist_loss",
        "neighbor_loss",
    }


def test_auto_backend_rule() -> None:
    from flashcl.backends import resolve as _resolve_backend

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert _resolve_backend("auto", (1 << 20) - 1, cpu, torch.float32) == "dense"
    assert _resolve_backend("auto", 1 << 20, cpu, torch.float32) == "tiled"
    assert _resolve_backend("dense", 1 << 30, cpu, torch.float32) == "dense"
    # float64 never goes to the kernels, whatever the device
    assert _resolve_backend("auto", 1 << 20, cuda, torch.float64) == "tiled"
    # the kernels up to AUTO_TRITON_MAX_WIDTH on CUDA, the tiled backend's stripes above
    from flashcl.backends import AUTO_TRITON_MAX_WIDTH as w

    if importlib.util.find_spec("triton") is not None:
        assert _resolve_backend("auto", 1 << 20, cuda, torch.float32, w) == "triton"
        assert _resolve_backend("auto", 1 << 20, cuda, torch.bfloat16, w) == "triton"
    assert _resolve_backend("auto", 1 << 20, cuda, torch.float32, w + 1) == "tiled"
    assert _resolve_backend("auto", 1 << 20, cuda, torch.float16, 4096) == "tiled"
