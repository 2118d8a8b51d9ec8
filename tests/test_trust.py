"""Corners of the newer features where an answer could be silently wrong: each test
here failed before its fix."""

from __future__ import annotations

import random
from typing import Any, Callable, List

import pytest
import torch

import flashcl


def _matryoshka_inputs(b: int, d: int) -> List[torch.Tensor]:
    """Rows whose first coordinates are tiny: the worst case for narrow prefixes."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(b, d, generator=g, dtype=torch.float64)
    x[: b // 8, :2] *= 1e-4
    y = torch.randn(b, d, generator=g, dtype=torch.float64)
    y[b // 2 : b // 2 + b // 8, :2] *= 1e-4
    return [x, y]


_MATRYOSHKA_LOSSES: List[Any] = [
    ("supcon", lambda x, y, **kw: flashcl.supcon_loss(x, torch.arange(x.shape[0]) % 7, **kw)),
    ("info_nce", lambda x, y, **kw: flashcl.info_nce_loss(x, y, temperature=0.05, **kw)),
    ("clip", lambda x, y, **kw: flashcl.clip_loss(x, y, logit_scale=20.0, **kw)),
]


@pytest.mark.parametrize("dims", [[1, 8], [2, 8], [1, 2, 8, 32]])
@pytest.mark.parametrize("name,fn", _MATRYOSHKA_LOSSES, ids=[n for n, _ in _MATRYOSHKA_LOSSES])
def test_matryoshka_narrow_width_gradient_float32(name: str, fn: Callable[..., torch.Tensor], dims: List[int]) -> None:
    """Every width's gradient in float32 no worse than the dense backend's (a width of
    1 is the sign of a coordinate: its gradient is zero, not float32 noise)."""
    inputs = _matryoshka_inputs(512, 32)

    def grads(dtype: torch.dtype, backend: str) -> torch.Tensor:
        xs = [t.detach().to(dtype).clone().requires_grad_(True) for t in inputs]
        fn(*xs, matryoshka_dims=dims, backend=backend).backward()
        return torch.cat([t.grad for t in xs if t.grad is not None]).double()

    exact = grads(torch.float64, "dense")
    err_dense = float((grads(torch.float32, "dense") - exact).abs().max())
    for backend in ("tiled", "auto"):
        err = float((grads(torch.float32, backend) - exact).abs().max())
        assert err <= err_dense + 1e-6 * float(exact.abs().max()), (backend, err, err_dense)


@pytest.mark.parametrize("backend", ["reference", "dense", "tiled"])
def test_gist_relative_margin_with_negative_guide_similarity(backend: str) -> None:
    """``margin_strategy="relative"`` keeps candidates whose guide similarity is at most
    ``g - |g| margin``, sentence-transformers' rule, also where the guide's positive
    similarity ``g`` is negative (there ``g (1 - margin)`` would be another set)."""
    from flashcl.bench.peers import sentence_transformers_gist

    fn, why = sentence_transformers_gist(temperature=0.05, margin=0.3, margin_strategy="relative")
    if fn is None:
        pytest.skip(why)
    g = torch.Generator().manual_seed(5)
    b = 16
    a, p = torch.randn(b, 12, generator=g, dtype=torch.float64), torch.randn(b, 12, generator=g, dtype=torch.float64)
    ga = torch.randn(b, 6, generator=g, dtype=torch.float64)
    gp = -ga + 0.7 * torch.randn(b, 6, generator=g, dtype=torch.float64)  # negative positive similarities
    g_pos = torch.nn.functional.cosine_similarity(ga, gp)
    assert bool((g_pos < 0).all())
    # candidates between g - |g| margin and g (1 - margin) exist: the two rules differ here
    sims = torch.nn.functional.normalize(ga, dim=1) @ torch.nn.functional.normalize(gp, dim=1).T
    lo, hi = (g_pos - g_pos.abs() * 0.3).unsqueeze(1), (g_pos * 0.7).unsqueeze(1)
    assert bool(((sims > lo) & (sims <= hi)).any())

    def grads(fn_: Callable[..., torch.Tensor]) -> List[torch.Tensor]:
        xs = [a.clone().requires_grad_(True), p.clone().requires_grad_(True)]
        loss = fn_(*xs)
        loss.backward()
        return [loss.detach()] + [x.grad for x in xs]

    ours = grads(
        lambda x, y: flashcl.gist_loss(
            x, y, guide=(ga, gp), temperature=0.05, margin=0.3, margin_strategy="relative", backend=backend
        )
    )
    peer = grads(lambda x, y: fn([x, y], [ga, gp]))
    for got, want in zip(ours, peer):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


def test_decoupled_with_one_pair_is_an_error() -> None:
    z1, z2 = torch.randn(1, 8), torch.randn(1, 8)
    with pytest.raises(ValueError, match="decoupled=True needs at least 2 pairs"):
        flashcl.nt_xent_loss(z1, z2, decoupled=True)
    with pytest.raises(ValueError, match="decoupled=True needs at least 2 pairs"):
        flashcl.NTXentLoss(decoupled=True)(z1, z2)
    assert torch.isfinite(flashcl.nt_xent_loss(torch.randn(2, 8), torch.randn(2, 8), decoupled=True))


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_matryoshka_weights_must_be_finite(bad: float) -> None:
    e, y = torch.randn(6, 8), torch.tensor([0, 0, 1, 1, 2, 2])
    with pytest.raises(ValueError, match="matryoshka_weights must be finite"):
        flashcl.supcon_loss(e, y, matryoshka_dims=[4, 8], matryoshka_weights=[1.0, bad])


def test_memory_bank_state_dict_round_trip() -> None:
    g = torch.Generator().manual_seed(0)
    bank = flashcl.MemoryBank(size=7, dim=4)
    for _ in range(3):  # wraps around: position 5, full
        bank.push(torch.randn(4, 4, generator=g), torch.randint(0, 3, (4,), generator=g))
    restored = flashcl.MemoryBank(size=7, dim=4)
    restored.load_state_dict(bank.state_dict())
    for got, want in zip(restored.keys(), bank.keys()):
        assert torch.equal(got, want)
    batch, labels = torch.randn(3, 4, generator=g), torch.tensor([0, 1, 2])
    assert torch.equal(restored.push(batch, labels), bank.push(batch, labels))
    for got, want in zip(restored.keys(), bank.keys()):
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="does not fit a bank of size 2"):
        flashcl.MemoryBank(size=2, dim=4).load_state_dict(bank.state_dict(), strict=False)


@pytest.mark.parametrize("backend", ["dense", "tiled"])
@pytest.mark.parametrize("loss_name", ["info_nce", "supcon"])
def test_memory_bank_moco_order_loss_push_backward(loss_name: str, backend: str) -> None:
    """The documented order (loss, push, backward) gives the gradient of the loss
    against the keys the loss saw; the views handed out are not overwritten."""
    g = torch.Generator().manual_seed(1)
    bank = flashcl.MemoryBank(size=6, dim=5)
    bank.push(torch.randn(6, 5, generator=g), torch.randint(0, 3, (6,), generator=g))
    q, k, y = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g), torch.tensor([0, 1, 2])
    queue_before = [t.clone() for t in bank.keys()]

    def loss_of(x: torch.Tensor, keys: torch.Tensor, key_labels: torch.Tensor) -> torch.Tensor:
        if loss_name == "info_nce":
            return flashcl.info_nce_loss(x, k, negatives=keys, temperature=0.2, backend=backend)
        return flashcl.supcon_loss(x, y, ref=keys, ref_labels=key_labels, backend=backend)

    expected_q = q.clone().requires_grad_(True)
    loss_of(expected_q, *queue_before).backward()
    got_q = q.clone().requires_grad_(True)
    loss = loss_of(got_q, *bank.keys())
    bank.push(torch.randn(3, 5, generator=g), y)  # overwrites half the queue
    loss.backward()
    torch.testing.assert_close(got_q.grad, expected_q.grad)
    assert not torch.equal(bank.keys()[0], queue_before[0])


def _bn_encoder() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 4))


def test_cached_step_updates_batch_norm_once_per_chunk() -> None:
    """Running statistics as a forward pass over the same chunks leaves them."""
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(12, 6, generator=g), torch.randn(12, 6, generator=g)
    cached, plain = _bn_encoder(), _bn_encoder()
    flashcl.cached_step(cached, [x, y], lambda q, d: flashcl.info_nce_loss(q, d), chunk_size=4)
    with torch.no_grad():
        for part in list(x.split(4)) + list(y.split(4)):
            plain(part)
    bn, want = cached[1], plain[1]
    assert int(bn.num_batches_tracked) == 6 == int(want.num_batches_tracked)
    torch.testing.assert_close(bn.running_mean, want.running_mean)
    torch.testing.assert_close(bn.running_var, want.running_var)


def test_cached_step_trains_one_tower_with_the_other_frozen() -> None:
    """LiT: a locked image tower, a trained text tower; the text tower's gradient
    equals a full-batch step's."""
    g = torch.Generator().manual_seed(3)
    images, texts = (
        torch.randn(10, 6, generator=g, dtype=torch.float64),
        torch.randn(10, 5, generator=g, dtype=torch.float64),
    )
    torch.manual_seed(1)
    image_tower = torch.nn.Linear(6, 4).double().requires_grad_(False)
    text_tower = torch.nn.Linear(5, 4).double()

    def loss_fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return flashcl.clip_loss(a, b, logit_scale=10.0)

    flashcl.cached_step([image_tower, text_tower], [images, texts], loss_fn, chunk_size=3)
    got = [p.grad.clone() for p in text_tower.parameters()]
    text_tower.zero_grad()
    loss_fn(image_tower(images), text_tower(texts)).backward()
    for a, b in zip(got, text_tower.parameters()):
        torch.testing.assert_close(a, b.grad)
    assert all(p.grad is None for p in image_tower.parameters())


def test_cached_step_bad_arguments_name_them() -> None:
    enc = torch.nn.Linear(4, 3)
    x = torch.randn(6, 4)
    with pytest.raises(ValueError, match="chunk_size"):
        flashcl.cached_step(enc, [x], lambda e: flashcl.supcon_loss(e, torch.arange(6) % 2), chunk_size=2.5)
    with pytest.raises(ValueError, match="loss_fn must return a scalar"):
        flashcl.cached_step(
            enc, [x], lambda e: flashcl.supcon_loss(e, torch.arange(6) % 2, reduction="none"), chunk_size=2
        )


def test_pml_supcon_adapter_equals_pml_on_random_cases() -> None:
    """2000 small random calls (sizes, widths, labels, temperatures down to 0.01,
    cosine and unnormalised dot products, with and without ref_emb) in float32,
    under PML's default reducer: the adapter's value and gradient equal PML's,
    including which anchors PML's AvgNonZeroReducer counts."""
    pytest.importorskip("pytorch_metric_learning")

    from pytorch_metric_learning import distances, losses

    from flashcl.integrations.pytorch_metric_learning import SupConLoss

    rng = random.Random(0)
    for trial in range(2000):
        g = torch.Generator().manual_seed(trial)
        b, d = rng.randint(2, 10), rng.randint(1, 6)
        t = rng.choice([0.01, 0.05, 0.1, 0.5, 1.0])
        dist = rng.choice([distances.CosineSimilarity, distances.DotProductSimilarity])
        scale = rng.choice([1.0, 3.0, 10.0])
        e = torch.randn(b, d, generator=g) * scale
        y = torch.randint(0, rng.randint(1, 4), (b,), generator=g)
        kw: dict = {}
        if rng.random() < 0.5:
            n = rng.randint(1, 8)
            kw = {
                "ref_emb": torch.randn(n, d, generator=g) * scale,
                "ref_labels": torch.randint(0, 3, (n,), generator=g),
            }
        results = []
        for cls, dtype in (
            (losses.SupConLoss, torch.float32),
            (SupConLoss, torch.float32),
            (losses.SupConLoss, torch.float64),
        ):
            x = e.to(dtype).clone().requires_grad_(True)
            args = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in kw.items()}
            loss = cls(temperature=t, distance=dist())(x, y, **args)
            if loss.requires_grad:
                loss.backward()
            results.append((loss.detach(), torch.zeros_like(x) if x.grad is None else x.grad))
        (want, want_grad), (got, got_grad), (exact, exact_grad) = results
        where = f"case {trial}: B={b} D={d} t={t} {dist.__name__} scale={scale} ref={bool(kw)}"
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m, w=where: f"{w}: loss: {m}")
        # float32 rounding of s / t, amplified by 1 / t below t = 0.1: how far two float32 sums of the
        # same terms may differ on two CPUs (their vector widths order the sums differently)
        tol = 1e-5 * max(1.0, float(want_grad.abs().max())) * max(1.0, 0.1 / t)
        if abs(float(want) - float(exact)) < 1e-4:
            # PML counts the same anchors in float64: the gradient no further from
            # float64 than PML's own float32 one (at D = 1 a normalised gradient is
            # all rounding)
            err, err_pml = ((g.double() - exact_grad).abs().max().item() for g in (got_grad, want_grad))
            assert err <= err_pml + tol, f"{where}: grad error {err:.3g}, PML's {err_pml:.3g}"
        else:  # float32 and float64 count other anchors: PML's float32 gradient, to float32 rounding of s / t
            torch.testing.assert_close(
                got_grad, want_grad, rtol=1e-3, atol=10 * tol, msg=lambda m, w=where: f"{w}: grad: {m}"
            )


def test_pml_supcon_adapter_counts_anchors_as_pml_does() -> None:
    """Eight near-one-hot embeddings at temperature 0.05 in float32: PML's loss of the
    anchors whose positive dominates is exactly 0 and its reducer leaves them out."""
    pytest.importorskip("pytorch_metric_learning")
    from pytorch_metric_learning import losses

    from flashcl.integrations.pytorch_metric_learning import SupConLoss

    g = torch.Generator().manual_seed(0)
    labels = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    e = torch.zeros(8, 8)
    e[torch.arange(8), labels * 2] = 1.0
    e = e + 0.02 * torch.randn(8, 8, generator=g)
    e[::2] += 0.3 * torch.randn(4, 8, generator=g)  # one anchor of each pair is not easy
    results = []
    for cls in (losses.SupConLoss, SupConLoss):
        x = e.clone().requires_grad_(True)
        loss = cls(temperature=0.05)(x, labels)
        loss.backward()
        results.append((loss.detach(), x.grad))
    torch.testing.assert_close(results[1][0], results[0][0])
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-4, atol=1e-5)
    per_anchor = flashcl.supcon_loss(e, labels, temperature=0.05, reduction="none")
    assert float(per_anchor.min()) < 1e-6 < float(per_anchor.max())  # some anchors are easy, some not


def _masked_key_cases() -> List[Any]:
    """(name, fn(query, keys) -> per-row losses, index of a key every row excludes)."""
    g = torch.Generator().manual_seed(7)
    b, extra = 6, 3
    labels = torch.arange(b) % 3
    # info_nce with key_labels, duplicates="mask": hard negative b + 1 carries every query's label
    key_labels = torch.cat([labels, torch.tensor([5, 0, 6])])
    query_labels = torch.zeros(b, dtype=torch.long)
    ga, gp = torch.randn(b, 4, generator=g, dtype=torch.float64), torch.randn(b, 4, generator=g, dtype=torch.float64)
    gn = torch.randn(extra, 4, generator=g, dtype=torch.float64)

    def info(q: torch.Tensor, k: torch.Tensor, backend: str) -> torch.Tensor:
        return flashcl.info_nce_loss(
            q,
            k,
            temperature=0.1,
            query_labels=query_labels,
            key_labels=torch.cat([query_labels, key_labels[b:]]),
            duplicates="mask",
            reduction="none",
            backend=backend,
        )

    def gist(q: torch.Tensor, k: torch.Tensor, backend: str) -> torch.Tensor:
        # margin 2: every candidate but the positive is above the threshold, the negatives too
        return flashcl.gist_loss(
            q,
            k[:b],
            k[b:],
            guide=(ga, gp, gn),
            margin=2.0,
            contrast_anchors=False,
            contrast_positives=False,
            reduction="none",
            backend=backend,
        )

    return [("info_nce_duplicates_mask", info, b + 1), ("gist", gist, b + 1)]


@pytest.mark.parametrize("backend", ["dense", "tiled"])
@pytest.mark.parametrize("case", _masked_key_cases(), ids=lambda c: c[0])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nan_in_an_excluded_key_reaches_no_value_and_no_gradient(case: Any, backend: str, bad: float) -> None:
    _, fn, j = case
    g = torch.Generator().manual_seed(8)
    q = torch.randn(6, 5, generator=g, dtype=torch.float64)
    k = torch.randn(9, 5, generator=g, dtype=torch.float64)
    upstream = torch.rand(6, generator=g, dtype=torch.float64)
    poisoned = k.clone()
    poisoned[j, 2] = bad
    results = []
    for keys in (k, poisoned):
        qq, kk = q.clone().requires_grad_(True), keys.clone().requires_grad_(True)
        rows = fn(qq, kk, backend)
        (rows * upstream).sum().backward()
        results.append((rows.detach(), qq.grad, kk.grad))
    (want, want_q, want_k), (got, got_q, got_k) = results
    others = torch.arange(9) != j
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_q, want_q)
    torch.testing.assert_close(got_k[others], want_k[others])


def test_pml_style_calls_name_the_adapter() -> None:
    e, y = torch.randn(6, 4), torch.tensor([0, 0, 1, 1, 2, 2])
    adapter = "flashcl.integrations.pytorch_metric_learning"
    with pytest.raises(TypeError, match=f"{adapter}.SupConLoss"):
        flashcl.SupConLoss()(e, y, indices_tuple=(torch.tensor([0]), torch.tensor([1])))
    with pytest.raises(TypeError, match=f"{adapter}.SupConLoss"):
        flashcl.SupConLoss()(e, y, (torch.tensor([0]), torch.tensor([1]), torch.tensor([0]), torch.tensor([2])))
    with pytest.raises(TypeError, match=f"{adapter}.SupConLoss"):
        flashcl.SupConLoss()(e, y, ref_emb=e, ref_labels=y)
    with pytest.raises(TypeError, match=f"{adapter}.NTXentLoss"):
        flashcl.NTXentLoss()(e, y)
    with pytest.raises(TypeError, match=f"{adapter}.NTXentLoss"):
        flashcl.NTXentLoss()(e, e, indices_tuple=None)


@pytest.mark.parametrize(
    "cls,keyword",
    [
        (flashcl.ClipLoss, "gather_with_grad"),
        (flashcl.ClipLoss, "local_loss"),
        (flashcl.ClipLoss, "use_horovod"),
        (flashcl.SigLipLoss, "dist_impl"),
        (flashcl.SigLipLoss, "rank"),
    ],
)
def test_open_clip_constructor_keywords_name_what_to_use(cls: Any, keyword: str) -> None:
    with pytest.raises(TypeError, match=f"open_clip's constructor keywords {keyword}.*flashcl.distributed"):
        cls(**{keyword: True})
    with pytest.raises(TypeError, match="unexpected keyword arguments temprature"):
        cls(temprature=0.1)


def test_a_logit_scale_below_one_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import warnings

    monkeypatch.setattr(flashcl.checks, "_warned_small_scale", False)
    img, txt = torch.randn(4, 8), torch.randn(4, 8)
    with pytest.warns(UserWarning, match="logit_scale=0.07 is below 1"):
        flashcl.clip_loss(img, txt, logit_scale=0.07)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flashcl.clip_loss(img, txt, logit_scale=0.07)  # once
        flashcl.siglip_loss(img, txt, logit_scale=10.0, logit_bias=-10.0)
