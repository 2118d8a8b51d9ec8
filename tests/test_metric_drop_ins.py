"""flashcl's pytorch-metric-learning drop-ins for Multi-Similarity (and its miner) and
Circle loss: the same constructors and calls as PML's classes, equal to them in float64
(values and gradients, PML's reducers), the miner's output read by PML's own loss, and
PML's own miners' pairs (any miner) computed by flashcl over exactly those pairs."""

from __future__ import annotations

import warnings
from typing import Any, Callable

import pytest
import torch

pml = pytest.importorskip("pytorch_metric_learning")
from pytorch_metric_learning import losses, miners, reducers  # noqa: E402

from flashcl.integrations import pytorch_metric_learning as ours  # noqa: E402
from helpers import assert_close  # noqa: E402

TOL = (1e-10, 1e-9)


def _data(seed: int = 0) -> Any:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(30, 6, dtype=torch.float64, generator=g), torch.randint(0, 4, (30,), generator=g)


def _same(peer: Callable[[torch.Tensor], torch.Tensor], drop_in: Callable[[torch.Tensor], torch.Tensor]) -> None:
    x, _ = _data()
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    want, got = peer(xa), drop_in(xb)
    scale = max(1.0, float(want.detach().abs()))
    assert_close(got / scale, want / scale, "value", *TOL)
    ga, gb = torch.autograd.grad(want, xa)[0], torch.autograd.grad(got, xb)[0]
    assert_close(gb / scale, ga / scale, "grad", *TOL)


@pytest.mark.parametrize("reducer", [None, reducers.SumReducer, reducers.AvgNonZeroReducer])
def test_multi_similarity_equals_pml(reducer: Any) -> None:
    _, y = _data()
    kw = {} if reducer is None else {"reducer": reducer()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # computed by flashcl, no fallback
        _same(lambda v: losses.MultiSimilarityLoss(**kw)(v, y), lambda v: ours.MultiSimilarityLoss(**kw)(v, y))
        _same(
            lambda v: losses.MultiSimilarityLoss(alpha=3, beta=30, base=0.2, **kw)(
                v, y, miners.MultiSimilarityMiner(0.2)(v, y)
            ),
            lambda v: ours.MultiSimilarityLoss(alpha=3, beta=30, base=0.2, **kw)(
                v, y, ours.MultiSimilarityMiner(0.2)(v, y)
            ),
        )


def test_the_miners_output_reads_as_pmls_pairs() -> None:
    x, y = _data(1)
    mined = ours.MultiSimilarityMiner(0.1)(x, y)
    assert isinstance(mined, ours.MinedPairs) and len(mined) == 4
    for a, b in zip(mined, miners.MultiSimilarityMiner(0.1)(x, y)):
        assert torch.equal(a, b)
    _same(
        lambda v: losses.MultiSimilarityLoss()(v, y, miners.MultiSimilarityMiner(0.1)(v, y)),
        lambda v: losses.MultiSimilarityLoss()(v, y, ours.MultiSimilarityMiner(0.1)(v, y)),
    )


MINERS = {
    "multi-similarity": lambda: miners.MultiSimilarityMiner(0.1),
    "triplets": lambda: miners.TripletMarginMiner(0.2),
    "pair margins": lambda: miners.PairMarginMiner(0.2, 0.5),
    "batch hard": lambda: miners.BatchHardMiner(),
}
LOSSES = {
    "multi-similarity": (
        lambda: losses.MultiSimilarityLoss(3.0, 40.0, 0.4),
        ours.MultiSimilarityLoss,
        (3.0, 40.0, 0.4),
    ),
    "circle": (lambda: losses.CircleLoss(0.25, 64.0), ours.CircleLoss, (0.25, 64.0)),
}


@pytest.mark.parametrize("miner", sorted(MINERS))
@pytest.mark.parametrize("loss", sorted(LOSSES))
@pytest.mark.parametrize("backend", ["reference", "dense", "tiled"])
@pytest.mark.parametrize("labels", [True, False])
def test_the_pairs_of_pmls_own_miners_equal_pml(miner: str, loss: str, backend: str, labels: bool) -> None:
    """PML's own ``indices_tuple`` (pairs or triplets), with or without labels: the
    loss over exactly those pairs, computed by flashcl (no warning), equal to PML's."""
    _, y = _data()
    peer, drop_in, args = LOSSES[loss]
    mine = MINERS[miner]()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _same(
            lambda v: peer()(v, y if labels else None, mine(v, y)),
            lambda v: drop_in(*args, backend=backend, block_size=7)(v, y if labels else None, mine(v, y)),
        )


@pytest.mark.parametrize("loss", sorted(LOSSES))
@pytest.mark.parametrize("backend", ["reference", "dense", "tiled"])
@pytest.mark.parametrize("mined", [False, True])
def test_ref_emb_equals_pml(loss: str, backend: str, mined: bool) -> None:
    """``ref_emb`` / ``ref_labels``: every pair of a row and a reference (or a miner's pairs
    of them), as PML."""
    _, y = _data()
    g = torch.Generator().manual_seed(3)
    ref, ref_y = torch.randn(23, 6, dtype=torch.float64, generator=g), torch.randint(0, 4, (23,), generator=g)
    peer, drop_in, args = LOSSES[loss]
    mine = miners.MultiSimilarityMiner(0.1)

    def call(fn: Any, v: torch.Tensor) -> torch.Tensor:
        pairs = mine(v, y, ref, ref_y) if mined else None
        return fn(v, y, pairs, ref, ref_y)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _same(lambda v: call(peer(), v), lambda v: call(drop_in(*args, backend=backend, block_size=7), v))
    one = torch.zeros(1, dtype=torch.long)  # one row, one reference of its label: PML's rule gives 0
    x, _ = _data()
    for fn in (peer(), drop_in(*args)):
        assert float(fn(x[:1], one, None, ref[:1], one)) == 0.0


def test_circle_takes_flashcls_miner_and_edge_lists_as_pml() -> None:
    _, y = _data()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _same(
            lambda v: losses.CircleLoss()(v, y, miners.MultiSimilarityMiner(0.1)(v, y)),
            lambda v: ours.CircleLoss()(v, y, ours.MultiSimilarityMiner(0.1)(v, y)),
        )
    one, none = torch.tensor([0]), torch.tensor([], dtype=torch.long)
    for lists in ((one, one + 1, one, one + 2), (none, none, none, none), (one, one + 1, none, none)):
        for peer, drop_in in (
            (losses.CircleLoss(), ours.CircleLoss()),
            (losses.MultiSimilarityLoss(), ours.MultiSimilarityLoss()),
        ):
            _same(lambda v, f=peer, t=lists: f(v, y, t), lambda v, f=drop_in, t=lists: f(v, y, t))  # type: ignore[misc]


def test_lists_flashcl_does_not_compute_are_pmls_with_a_warning() -> None:
    _, y = _data()
    a = torch.tensor([0, 1])
    with pytest.warns(UserWarning, match="pairs a sample with itself"):
        _same(
            lambda v: losses.MultiSimilarityLoss()(v, y, (a, a, a, a + 1)),
            lambda v: ours.MultiSimilarityLoss()(v, y, (a, a, a, a + 1)),
        )
    x, _ = _data()
    both = (a, a + 1, a, a + 1)
    with pytest.warns(UserWarning, match="both positive and negative"), pytest.raises(AssertionError):
        ours.CircleLoss()(x, y, both)  # PML refuses a pair in both sets


@pytest.mark.parametrize("m,gamma", [(0.4, 80), (0.25, 256)])
def test_circle_equals_pml(m: float, gamma: float) -> None:
    _, y = _data()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _same(lambda v: losses.CircleLoss(m=m, gamma=gamma)(v, y), lambda v: ours.CircleLoss(m=m, gamma=gamma)(v, y))


@pytest.mark.parametrize("miner", [*sorted(MINERS), "flashcl's"])
@pytest.mark.parametrize("backend", ["reference", "dense", "tiled"])
def test_proxy_anchor_with_a_miners_weights_equals_pml(miner: str, backend: str) -> None:
    """PML weighs each row's terms by its share of the miner's indices; computed by flashcl."""
    x, y = _data(4)
    mine = ours.MultiSimilarityMiner(0.1) if miner == "flashcl's" else MINERS[miner]()
    torch.manual_seed(0)
    peer = losses.ProxyAnchorLoss(5, 6, margin=0.2, alpha=16).double()
    torch.manual_seed(0)
    drop_in = ours.ProxyAnchorLoss(5, 6, margin=0.2, alpha=16, backend=backend, block_size=7).double()
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    want = peer(xa, y, miners.MultiSimilarityMiner(0.1)(xa, y) if miner == "flashcl's" else mine(xa, y))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = drop_in(xb, y, mine(xb, y))
    assert_close(got, want, "value", *TOL)
    ga = torch.autograd.grad(want, [xa, peer.proxies])
    gb = torch.autograd.grad(got, [xb, drop_in.proxies])
    for a, b, name in zip(gb, ga, ("rows", "proxies")):
        assert_close(a, b, name, *TOL)


@pytest.mark.parametrize("regularizer", [False, True])
def test_proxy_anchor_equals_pml_with_its_proxies(regularizer: bool) -> None:
    from pytorch_metric_learning import regularizers

    x, y = _data(2)
    kw = {"weight_regularizer": regularizers.LpRegularizer()} if regularizer else {}
    torch.manual_seed(0)
    peer = losses.ProxyAnchorLoss(4, 6, margin=0.2, alpha=16, **kw)
    torch.manual_seed(0)
    mine = ours.ProxyAnchorLoss(4, 6, margin=0.2, alpha=16, **kw)
    assert torch.equal(mine.proxies, peer.proxies)  # initialised as PML's
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = mine(xb, y)
    want = peer(xa, y)
    assert mine.proxies.dtype == torch.float64  # cast as PML's
    assert_close(got, want, "value", *TOL)
    ga = torch.autograd.grad(want, [xa, peer.proxies])
    gb = torch.autograd.grad(got, [xb, mine.proxies])
    for a, b, name in zip(gb, ga, ("rows", "proxies")):
        assert_close(a, b, name, *TOL)
    with pytest.warns(UserWarning, match="reducer"):
        ours.ProxyAnchorLoss(4, 6, reducer=reducers.MeanReducer())(x, y)
