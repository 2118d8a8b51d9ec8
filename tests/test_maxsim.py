"""Late interaction: maxsim_loss on every backend against the token-score einsum as
pylate and colpali-engine write it, with masks, ties, half precision, bad inputs and
2 and 3 processes."""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

import pytest
import torch
import torch.distributed as dist

import flashcl
from helpers import assert_close, close_group, init_gloo, spawn

BACKENDS = ("reference", "dense", "tiled")


def peer_formula(
    q: torch.Tensor,
    d: torch.Tensor,
    qmask: Optional[torch.Tensor],
    dmask: Optional[torch.Tensor],
    temperature: Any,
    normalize: bool = False,
    smooth: Optional[float] = None,
    index: Optional[torch.Tensor] = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """The loss written as the peers write it: the (B, N, Lq, Ld) token scores by
    einsum, padding document tokens at -inf before the max, padding query tokens
    zeroed, summed (or averaged) over the query tokens, cross-entropy."""
    s = torch.einsum("ash,bth->abst", q, d)
    if dmask is not None:
        s = s.masked_fill(~dmask[None, :, None, :], float("-inf"))
    m = s.amax(dim=3) if smooth is None else smooth * torch.logsumexp(s / smooth, dim=3)
    if qmask is not None:
        m = m * qmask[:, None, :].to(m.dtype)
    scores = m.sum(2)
    if normalize:
        count = qmask.sum(1, keepdim=True) if qmask is not None else torch.full((q.shape[0], 1), q.shape[1])
        scores = scores / count.to(scores.dtype)
    target = torch.arange(q.shape[0]) if index is None else index
    return torch.nn.functional.cross_entropy(scores / temperature, target, reduction=reduction)


def _data(b: int = 3, n: int = 5, lq: int = 4, ld: int = 6, dim: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, lq, dim, dtype=torch.float64, generator=g)
    d = torch.randn(n, ld, dim, dtype=torch.float64, generator=g)
    # padding of different lengths: each row keeps a prefix of its tokens
    qmask = torch.arange(lq).unsqueeze(0) < torch.randint(1, lq + 1, (b, 1), generator=g)
    dmask = torch.arange(ld).unsqueeze(0) < torch.randint(1, ld + 1, (n, 1), generator=g)
    return q, d, qmask, dmask


OPTIONS = [
    {},
    {"normalize_scores": True},
    {"smooth_max": 0.3},
    {"smooth_max": 0.3, "normalize_scores": True},
    {"reduction": "sum"},
    {"reduction": "none"},
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "default")
@pytest.mark.parametrize("masks", [True, False], ids=["masks", "no-masks"])
def test_equals_the_token_score_einsum(backend: str, options: Dict[str, Any], masks: bool) -> None:
    q, d, qmask, dmask = _data()
    if not masks:
        qmask = dmask = None
    t = torch.tensor(0.5, dtype=torch.float64)
    leaves = [q.clone().requires_grad_(), d.clone().requires_grad_(), t.clone().requires_grad_()]
    want = peer_formula(
        *leaves[:2],
        qmask,
        dmask,
        leaves[2],
        options.get("normalize_scores", False),
        options.get("smooth_max"),
        reduction=options.get("reduction", "mean"),
    )
    mine = [x.detach().clone().requires_grad_() for x in leaves]
    got = flashcl.maxsim_loss(
        mine[0],
        mine[1],
        query_mask=qmask,
        doc_mask=dmask,
        temperature=mine[2],
        backend=backend,
        block_size=2,
        **options,
    )
    assert_close(got, want, "value", 1e-12, 1e-10)
    out = torch.ones_like(want) if want.dim() else torch.tensor(1.0, dtype=torch.float64)
    for a, b, name in zip(torch.autograd.grad(got, mine, out), torch.autograd.grad(want, leaves, out), "qdt"):
        assert_close(a, b, f"grad {name}", 1e-12, 1e-10)


@pytest.mark.parametrize("backend", BACKENDS)
def test_hard_negatives_one_query_and_positive_index(backend: str) -> None:
    q, d, qmask, dmask = _data(b=1, n=7)
    want = peer_formula(q, d, qmask, dmask, 0.1)
    got = flashcl.maxsim_loss(q, d, query_mask=qmask, doc_mask=dmask, temperature=0.1, backend=backend)
    assert_close(got, want, "B = 1, N = 7", 1e-12, 1e-10)
    q, d, qmask, dmask = _data(b=3, n=6)
    index = torch.tensor([4, 0, 2])
    want = peer_formula(q, d, qmask, dmask, 0.1, index=index)
    got = flashcl.maxsim_loss(q, d, index, query_mask=qmask, doc_mask=dmask, temperature=0.1, backend=backend)
    assert_close(got, want, "positive_index", 1e-12, 1e-10)


def test_a_padding_token_never_wins_the_max() -> None:
    # the padded token of every document is the best match of every query token by far
    q, d, _, _ = _data(b=2, n=3, ld=4)
    d = d.clone()
    d[:, 3] = 100.0 * q.mean((0, 1))
    dmask = torch.ones(3, 4, dtype=torch.bool)
    dmask[:, 3] = False
    want = peer_formula(q, d[:, :3], None, None, 1.0)
    for backend in BACKENDS:
        dd = d.clone().requires_grad_()
        got = flashcl.maxsim_loss(q, dd, doc_mask=dmask, backend=backend)
        assert_close(got, want, f"{backend}: padding excluded", 1e-12, 1e-10)
        got.backward()
        assert float(dd.grad[:, 3].abs().max()) == 0.0, backend


def test_ties_tiled_gives_one_token_dense_spreads() -> None:
    """Two identical document tokens tie for every query token's max: the dense
    backend splits each pair's gradient equally between them, the tiled backend
    gives it to the first; the loss and the sum over the tied tokens agree."""
    q, d, _, _ = _data(b=2, n=2, ld=3)
    d = d.clone()
    d[:, 1] = d[:, 0]
    d[:, 2] = -10.0 * d[:, 0].abs()  # never the max
    grads = {}
    for backend in ("dense", "tiled"):
        dd = d.clone().requires_grad_()
        loss = flashcl.maxsim_loss(q, dd, backend=backend)
        loss.backward()
        grads[backend] = (loss.detach(), dd.grad)
    assert_close(grads["tiled"][0], grads["dense"][0], "loss", 1e-12, 1e-12)
    dense, tiled = grads["dense"][1], grads["tiled"][1]
    assert_close(dense[:, 0], dense[:, 1], "dense: equal halves", 1e-12, 1e-12)
    assert_close(tiled[:, 0], dense[:, 0] + dense[:, 1], "tiled: the first token takes both", 1e-12, 1e-12)
    assert float(tiled[:, 1].abs().max()) == 0.0
    assert float(dense[:, 0].abs().max()) > 0.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_accumulates_in_float32(dtype: torch.dtype) -> None:
    q, d, qmask, dmask = _data(b=4, n=6, lq=5, ld=7, dim=16)
    want = peer_formula(q, d, qmask, dmask, 0.5)
    qh, dh = q.to(dtype).requires_grad_(), d.to(dtype).requires_grad_()
    got = flashcl.maxsim_loss(qh, dh, query_mask=qmask, doc_mask=dmask, temperature=0.5, backend="tiled")
    assert got.dtype == torch.float32
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    assert_close(got, want, f"{dtype} value", tol, tol)
    got.backward()
    assert qh.grad.dtype == dtype and dh.grad.dtype == dtype


def test_inputs_are_not_modified_and_the_module_twin_agrees() -> None:
    q, d, qmask, dmask = _data()
    copies = [x.clone() for x in (q, d, qmask, dmask)]
    fn = flashcl.maxsim_loss(q, d, query_mask=qmask, doc_mask=dmask, temperature=0.2, backend="tiled")
    mod = flashcl.MaxSimLoss(temperature=0.2, backend="tiled")(q, d, qmask, dmask)
    assert_close(mod, fn, "module", 0.0, 0.0)
    for a, b in zip((q, d, qmask, dmask), copies):
        assert torch.equal(a, b)


def test_second_derivatives_through_the_dense_form() -> None:
    q, d, qmask, dmask = _data(b=2, n=3)
    grads = {}
    for backend in ("dense", "tiled"):
        qq = q.clone().requires_grad_()
        loss = flashcl.maxsim_loss(qq, d, query_mask=qmask, doc_mask=dmask, smooth_max=0.5, backend=backend)
        (g,) = torch.autograd.grad(loss, qq, create_graph=True)
        grads[backend] = torch.autograd.grad((g * g).sum(), qq)[0]
    assert_close(grads["tiled"], grads["dense"], "Hessian-vector product", 1e-10, 1e-8)


NONE_Q, NONE_D = torch.zeros(3, 4, dtype=torch.bool), torch.zeros(5, 6, dtype=torch.bool)

BAD = [
    ("query", lambda q, d: flashcl.maxsim_loss(q[0], d), ValueError),
    ("docs must be", lambda q, d: flashcl.maxsim_loss(q, d[..., :4]), ValueError),
    ("dtype", lambda q, d: flashcl.maxsim_loss(q, d.float()), TypeError),
    ("at least B", lambda q, d: flashcl.maxsim_loss(q, d[:2]), ValueError),
    ("no real token", lambda q, d: flashcl.maxsim_loss(q, d, doc_mask=torch.zeros(5, 6, dtype=torch.bool)), ValueError),
    (
        "no real token",
        lambda q, d: flashcl.maxsim_loss(q, d, query_mask=torch.zeros(3, 4, dtype=torch.bool)),
        ValueError,
    ),
    (
        "doc_mask must have shape",
        lambda q, d: flashcl.maxsim_loss(q, d, doc_mask=torch.ones(5, 5, dtype=torch.bool)),
        ValueError,
    ),
    ("0/1", lambda q, d: flashcl.maxsim_loss(q, d, doc_mask=torch.full((5, 6), 0.5)), ValueError),
    ("smooth_max", lambda q, d: flashcl.maxsim_loss(q, d, smooth_max=0.0), ValueError),
    ("smooth_max", lambda q, d: flashcl.maxsim_loss(q, d, smooth_max=True), ValueError),
    ("positive_index", lambda q, d: flashcl.maxsim_loss(q, d, torch.tensor([0, 1, 5])), ValueError),
    ("temperature", lambda q, d: flashcl.maxsim_loss(q, d, temperature=0.0), ValueError),
    ("Triton", lambda q, d: flashcl.maxsim_loss(q, d, backend="triton"), ValueError),
    ("strategy", lambda q, d: flashcl.maxsim_loss(q, d, strategy="tree"), ValueError),
    ("normalize_scores", lambda q, d: flashcl.maxsim_loss(q, d, normalize_scores="yes"), TypeError),
]


@pytest.mark.parametrize("match, call, error", BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD)])
def test_bad_inputs_are_clear_errors(match: str, call: Any, error: type) -> None:
    q, d, _, _ = _data()
    with pytest.raises(error, match=match):
        call(q, d)


SIZES = {2: ([2, 3], [3, 4]), 3: ([2, 1, 3], [3, 1, 4])}


def _shards(world: int):
    q_sizes, d_sizes = SIZES[world]
    q, d, qmask, dmask = _data(b=sum(q_sizes), n=sum(d_sizes), seed=world)
    return q, d, qmask, dmask, q_sizes, d_sizes


def _worker(rank: int, world: int, out_dir: str) -> None:
    init_gloo(rank, world, out_dir)
    q, d, qmask, dmask, q_sizes, d_sizes = _shards(world)
    qs, ds = slice(sum(q_sizes[:rank]), sum(q_sizes[: rank + 1])), slice(sum(d_sizes[:rank]), sum(d_sizes[: rank + 1]))
    results: Dict[Any, Any] = {}
    for backend, strategy in [(b, "all_gather") for b in BACKENDS] + [(b, "ring") for b in BACKENDS]:
        for options in ({}, {"smooth_max": 0.3, "normalize_scores": True}):
            qq, dd = q[qs].clone().requires_grad_(), d[ds].clone().requires_grad_()
            loss = flashcl.maxsim_loss(
                qq,
                dd,
                query_mask=qmask[qs],
                doc_mask=dmask[ds],
                temperature=0.5,
                backend=backend,
                process_group=dist.group.WORLD,
                strategy=strategy,
                grad_scale="sum",
                **options,
            )
            loss.backward()
            results[(backend, strategy, str(options))] = (loss.detach(), qq.grad, dd.grad)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    close_group()


@pytest.mark.parametrize("world", [2, 3])
def test_across_processes_equals_one_process(world: int, tmp_path) -> None:
    spawn(_worker, args=(world, str(tmp_path)), nprocs=world, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    q, d, qmask, dmask, q_sizes, d_sizes = _shards(world)
    # each rank's query i has its own document i: the global positive is that rank's offset + i
    index = torch.cat([torch.arange(b) + sum(d_sizes[:r]) for r, b in enumerate(q_sizes)])
    for options in ({}, {"smooth_max": 0.3, "normalize_scores": True}):
        qq, dd = q.clone().requires_grad_(), d.clone().requires_grad_()
        want = peer_formula(
            qq, dd, qmask, dmask, 0.5, options.get("normalize_scores", False), options.get("smooth_max"), index
        )
        gq, gd = torch.autograd.grad(want, (qq, dd))
        for backend, strategy in [(b, s) for b in BACKENDS for s in ("all_gather", "ring")]:
            got: List[Any] = [r[(backend, strategy, str(options))] for r in ranks]
            what = f"{backend} {strategy} {options}"
            assert_close(sum(v for v, _, _ in got), want, f"{what}: value", 1e-12, 1e-10)
            for r in range(world):
                qs = slice(sum(q_sizes[:r]), sum(q_sizes[: r + 1]))
                ds = slice(sum(d_sizes[:r]), sum(d_sizes[: r + 1]))
                assert_close(got[r][1], gq[qs], f"{what}: rank {r} query grad", 1e-12, 1e-10)
                assert_close(got[r][2], gd[ds], f"{what}: rank {r} docs grad", 1e-12, 1e-10)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("smooth", [None, 0.3])
def test_nan_in_padding_changes_nothing_and_strided_inputs_work(backend: str, smooth: Optional[float]) -> None:
    q, d, qmask, dmask = _data(b=3, n=5, lq=5, ld=6)
    want = peer_formula(q.requires_grad_(), d.requires_grad_(), qmask, dmask, 0.5, smooth=smooth)
    gq, gd = torch.autograd.grad(want, (q, d))
    q2, d2 = q.detach().clone(), d.detach().clone()
    q2[~qmask] = float("nan")
    d2[~dmask] = float("inf")
    # non-contiguous views of the same values: tokens and dims transposed back
    q2 = q2.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
    d2 = d2.transpose(0, 1).contiguous().transpose(0, 1).requires_grad_()
    got = flashcl.maxsim_loss(
        q2, d2, query_mask=qmask, doc_mask=dmask, temperature=0.5, smooth_max=smooth, backend=backend
    )
    assert_close(got, want, "value", 1e-12, 1e-10)
    got.backward()
    assert_close(q2.grad[qmask], gq[qmask], "real query tokens' grad", 1e-12, 1e-10)
    assert_close(d2.grad[dmask], gd[dmask], "real document tokens' grad", 1e-12, 1e-10)
    assert float(q2.grad[~qmask].abs().max()) == 0.0 and float(d2.grad[~dmask].abs().max()) == 0.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_query_losses_take_any_upstream_gradient(backend: str) -> None:
    q, d, qmask, dmask = _data(b=4, n=6)
    w = torch.tensor([0.5, -2.0, 3.0, 0.0], dtype=torch.float64)
    leaves = [q.clone().requires_grad_(), d.clone().requires_grad_()]
    want = (peer_formula(*leaves, qmask, dmask, 0.3, reduction="none") * w).sum()
    mine = [x.detach().clone().requires_grad_() for x in leaves]
    got = flashcl.maxsim_loss(
        *mine, query_mask=qmask, doc_mask=dmask, temperature=0.3, reduction="none", backend=backend
    )
    (got * w).sum().backward()
    for a, b in zip(mine, torch.autograd.grad(want, leaves)):
        assert_close(a.grad, b, "grad", 1e-12, 1e-10)


@pytest.mark.parametrize("backend", BACKENDS)
def test_width_one_extreme_temperature_and_frozen_documents(backend: str) -> None:
    q, d, qmask, dmask = _data(b=3, n=4, dim=1)
    for t in (1e-3, 1e3):
        qq = q.clone().requires_grad_()
        want = peer_formula(qq, d, qmask, dmask, t)
        (gq,) = torch.autograd.grad(want, qq)
        mine = q.clone().requires_grad_()  # the documents frozen: no gradient asked for them
        got = flashcl.maxsim_loss(mine, d, query_mask=qmask, doc_mask=dmask, temperature=t, backend=backend)
        got.backward()
        assert_close(got, want, f"D = 1, temperature {t}", 1e-12, 1e-10)
        assert_close(mine.grad, gq, f"D = 1, temperature {t}: query grad", 1e-12, 1e-10)
        assert d.grad is None
