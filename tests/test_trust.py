"""Corners of the newer features where an answer could be silently wrong: each test
here failed before its fix."""
from __future__ import annotations

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
    y[b // 2: b // 2 + b // 8, :2] *= 1e-4
    return [x, y]


_MATRYOSHKA_LOSSES: List[Any] = [
    ("supcon", lambda x, y, **kw: flashcl.supcon_loss(x, torch.arange(x.shape[0]) % 7, **kw)),
    ("info_nce", lambda x, y, **kw: flashcl.info_nce_loss(x, y, temperature=0.05, **kw)),
    ("clip", lambda x, y, **kw: flashcl.clip_loss(x, y, logit_scale=20.0, **kw)),
]


@pytest.mark.parametrize("dims", [[1, 8], [2, 8], [1, 2, 8, 32]])
@pytest.mark.parametrize("name,fn", _MATRYOSHKA_LOSSES, ids=[n for n, _ in _MATRYOSHKA_LOSSES])
def test_matryoshka_narrow_width_gradient_float32(name: str, fn: Callable[..., torch.Tensor], dims: List[int]
                                                  ) -> None:
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

    ours = grads(lambda x, y: flashcl.gist_loss(x, y, guide=(ga, gp), temperature=0.05, margin=0.3,
                                                margin_strategy="relative", backend=backend))
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
    images, texts = torch.randn(10, 6, generator=g, dtype=torch.float64), torch.randn(10, 5, generator=g,
                                                                                       dtype=torch.float64)
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
        flashcl.cached_step(enc, [x], lambda e: flashcl.supcon_loss(e, torch.arange(6) % 2, reduction="none"),
                            chunk_size=2)
