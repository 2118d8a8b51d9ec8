"""Property tests: random shapes, labels and options; dense and tiled equal the reference."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashcl
from helpers import TOL, assert_close

ATOL, RTOL = TOL[torch.float64]


def _grads(fn, tensors, **kw):
    ts = [t.clone().requires_grad_(True) for t in tensors]
    loss = fn(ts)
    w = torch.linspace(0.5, 1.5, loss.numel(), dtype=loss.dtype).reshape(loss.shape)
    grads = torch.autograd.grad((loss * w).sum(), ts)
    return loss.detach(), grads


def _check(fn_of_backend, tensors, label):
    ref = _grads(lambda ts: fn_of_backend(ts, "reference"), tensors)
    for backend in ("dense", "tiled"):
        got = _grads(lambda ts, backend=backend: fn_of_backend(ts, backend), tensors)
        assert_close(got[0], ref[0], f"{label}/{backend}: loss", ATOL, RTOL)
        for i, (a, e) in enumerate(zip(got[1], ref[1])):
            assert_close(a, e, f"{label}/{backend}: grad {i}", ATOL, RTOL)


@settings(max_examples=25, deadline=None)
@given(
    b=st.integers(2, 24),
    d=st.integers(1, 9),
    classes=st.integers(1, 8),
    views=st.integers(1, 3),
    positives=st.sampled_from(["mean", "sum"]),
    include_self=st.booleans(),
    reduction=st.sampled_from(["mean", "sum", "none"]),
    block=st.integers(1, 30),
    seed=st.integers(0, 10_000),
)
def test_supcon_random(b, d, classes, views, positives, include_self, reduction, block, seed):
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(b, views, d, generator=g, dtype=torch.float64)
    labels = torch.randint(0, classes, (b,), generator=g) * 7 - 3  # arbitrary, negative ids too
    _check(
        lambda ts, be: flashcl.supcon_loss(
            ts[0],
            labels,
            temperature=0.3,
            positives=positives,
            include_self=include_self,
            reduction=reduction,
            backend=be,
            block_size=block,
        ),
        [emb],
        "supcon",
    )


@settings(max_examples=25, deadline=None)
@given(
    b=st.integers(1, 16),
    extra=st.integers(0, 10),
    d=st.integers(1, 9),
    block=st.integers(1, 20),
    reduction=st.sampled_from(["mean", "sum", "none"]),
    seed=st.integers(0, 10_000),
)
def test_info_nce_and_clip_random(b, extra, d, block, reduction, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, d, generator=g, dtype=torch.float64)
    k = torch.randn(b + extra, d, generator=g, dtype=torch.float64)
    pos = torch.randint(0, b + extra, (b,), generator=g)
    _check(
        lambda ts, be: flashcl.info_nce_loss(ts[0], ts[1], pos, reduction=reduction, backend=be, block_size=block),
        [q, k],
        "info_nce",
    )
    _check(
        lambda ts, be: flashcl.clip_loss(ts[0], ts[1], 3.0, reduction=reduction, backend=be, block_size=block),
        [q, k[:b]],
        "clip",
    )


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(2, 20),
    k=st.integers(1, 4),
    exclude=st.booleans(),
    block=st.integers(1, 25),
    reduction=st.sampled_from(["mean", "sum", "none"]),
    seed=st.integers(0, 10_000),
)
def test_neighbor_random(n, k, exclude, block, reduction, seed):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(n, n, generator=g, dtype=torch.float64) * 5
    nb = flashcl.sample_neighbors(n, k, generator=g)
    _check(
        lambda ts, be: flashcl.neighbor_loss(
            ts[0], nb, exclude_diagonal=exclude, reduction=reduction, backend=be, block_size=block
        ),
        [s],
        "neighbor",
    )
