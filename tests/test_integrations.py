"""The pytorch-metric-learning adapters against the originals they replace: every
argument PML's classes take, PML's wrappers, and PML's answers on degenerate batches."""

from __future__ import annotations

import warnings
from typing import Any, Callable, List, Optional

import pytest
import torch

from helpers import assert_close

pml_losses = pytest.importorskip("pytorch_metric_learning.losses", reason="pytorch-metric-learning not installed")
from pytorch_metric_learning import distances, miners, reducers, regularizers  # noqa: E402

from flashcl.integrations import pytorch_metric_learning as adapters  # noqa: E402

TOL = (1e-10, 1e-10)
NAMES = ["NTXentLoss", "SupConLoss"]


def _data(b: int = 20, n_ref: int = 15, classes: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(b, 8, dtype=torch.float64, generator=g),
        torch.randint(0, classes, (b,), generator=g),
        torch.randn(n_ref, 8, dtype=torch.float64, generator=g),
        torch.randint(0, classes, (n_ref,), generator=g),
    )


def _run(make: Callable[[], Any], call: Callable[..., torch.Tensor], emb: torch.Tensor, ref: torch.Tensor):
    """(loss, grads of the two float inputs, warnings) of call(loss_fn, emb, ref)."""
    x, y = emb.clone().requires_grad_(True), ref.clone().requires_grad_(True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = call(make(), x, y)
    (loss * 1.7).backward()
    return loss.detach(), [x.grad, y.grad], [str(w.message) for w in caught]


def _compare(
    name: str,
    call: Callable[..., torch.Tensor],
    what: str,
    *,
    fallback: Optional[str] = None,
    data: Optional[tuple] = None,
    block_size: Optional[int] = None,
    **kwargs: Any,
) -> None:
    emb, labels, ref, ref_labels = data or _data()
    expected = _run(
        lambda: getattr(pml_losses, name)(**kwargs), lambda f, x, y: call(f, x, y, labels, ref_labels), emb, ref
    )
    got = _run(
        lambda: getattr(adapters, name)(block_size=block_size, **kwargs),
        lambda f, x, y: call(f, x, y, labels, ref_labels),
        emb,
        ref,
    )
    assert_close(got[0], expected[0], f"{name} {what}: loss", *TOL)
    for i, (a, e) in enumerate(zip(got[1], expected[1])):
        if e is None:
            assert a is None or float(a.abs().max()) == 0.0, f"{name} {what}: input {i} gets a gradient"
        else:
            assert_close(a, e, f"{name} {what}: grad of input {i}", *TOL)
    flashcl_warnings = [w for w in got[2] if w.startswith("flashcl")]
    if fallback is None:
        assert not flashcl_warnings, flashcl_warnings
    else:
        assert flashcl_warnings and all(fallback in w for w in flashcl_warnings), flashcl_warnings


@pytest.mark.parametrize("b,classes,block", [(40, 5, 7), (33, 3, 100), (20, 20, 1), (16, 2, 5)])
@pytest.mark.parametrize("name", NAMES)
def test_bare_call_equals_pml(name: str, b: int, classes: int, block: int) -> None:
    _compare(
        name,
        lambda f, x, y, lab, rl: f(x, lab),
        "bare",
        data=_data(b, 4, classes, seed=b + classes),
        temperature=0.1,
        block_size=block,
    )


@pytest.mark.parametrize("name", NAMES)
def test_ref_emb_equals_pml(name: str) -> None:
    _compare(name, lambda f, x, y, lab, rl: f(x, lab, ref_emb=y, ref_labels=rl), "ref_emb")
    # ref_labels *is* labels: PML removes the diagonal from the pairs, as for a batch against itself
    _compare(name, lambda f, x, y, lab, rl: f(x, lab, ref_emb=x * 0.5 + y[:1], ref_labels=lab), "ref_labels is labels")


@pytest.mark.parametrize("name", NAMES)
def test_distances_equal_pml(name: str) -> None:
    _compare(
        name,
        lambda f, x, y, lab, rl: f(x * 0.3, lab),
        "dot product",
        distance=distances.DotProductSimilarity(normalize_embeddings=False),
    )
    _compare(
        name,
        lambda f, x, y, lab, rl: f(x, lab),
        "cosine without normalising",
        distance=distances.CosineSimilarity(),
        temperature=0.5,
    )
    _compare(
        name,
        lambda f, x, y, lab, rl: f(x, lab),
        "Lp distance",
        fallback="distance=LpDistance",
        distance=distances.LpDistance(),
    )


@pytest.mark.parametrize("name", NAMES)
def test_reducers_and_regularizers_equal_pml(name: str) -> None:
    pair_fallback = "needs every pair's loss" if name == "NTXentLoss" else None
    _compare(name, lambda f, x, y, lab, rl: f(x, lab), "MeanReducer", reducer=reducers.MeanReducer())
    _compare(
        name, lambda f, x, y, lab, rl: f(x, lab), "SumReducer", fallback=pair_fallback, reducer=reducers.SumReducer()
    )
    _compare(
        name,
        lambda f, x, y, lab, rl: f(x, lab),
        "AvgNonZeroReducer",
        fallback=pair_fallback,
        reducer=reducers.AvgNonZeroReducer(),
    )
    _compare(
        name, lambda f, x, y, lab, rl: f(x, lab), "LpRegularizer", embedding_regularizer=regularizers.LpRegularizer()
    )


@pytest.mark.parametrize("name", NAMES)
def test_miner_pairs_run_pml_with_a_warning(name: str) -> None:
    _compare(
        name,
        lambda f, x, y, lab, rl: f(x, lab, miners.MultiSimilarityMiner()(x, lab)),
        "miner",
        fallback="indices_tuple",
    )


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("name", NAMES)
def test_inside_self_supervised_loss(name: str, symmetric: bool) -> None:
    emb, labels, ref, ref_labels = _data()
    results = []
    for module in (pml_losses, adapters):
        results.append(
            _run(
                lambda m=module: pml_losses.SelfSupervisedLoss(getattr(m, name)(), symmetric=symmetric),
                lambda f, x, y: f(x, x * 0.5 + y[:1]),
                emb,
                ref,
            )
        )
    (e, eg, _), (g, gg, w) = results
    assert_close(g, e, f"SelfSupervisedLoss({name})", *TOL)
    assert_close(gg[0], eg[0], f"SelfSupervisedLoss({name}) grad", *TOL)
    assert not [m for m in w if m.startswith("flashcl")]


@pytest.mark.parametrize("name", NAMES)
def test_inside_cross_batch_memory(name: str) -> None:
    """CrossBatchMemory calls the loss with five positional arguments (its pairs as
    indices_tuple): PML computes them, with a warning, over several steps of a full queue."""
    emb, labels, ref, _ = _data(b=24)

    def steps(f: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return sum(f(x[i : i + 6], labels[i : i + 6]) for i in range(0, 24, 6))

    results = [
        _run(lambda m=m: pml_losses.CrossBatchMemory(getattr(m, name)(), 8, memory_size=14).double(), steps, emb, ref)
        for m in (pml_losses, adapters)
    ]
    (e, eg, _), (g, gg, w) = results
    assert_close(g, e, f"CrossBatchMemory({name})", *TOL)
    assert_close(gg[0], eg[0], f"CrossBatchMemory({name}) grad", *TOL)
    assert any("indices_tuple" in m for m in w)


@pytest.mark.parametrize("labels", [[0], [3, 3], [1, 1, 1, 1, 1], [0, 1, 2]], ids=["one", "pair", "same", "distinct"])
@pytest.mark.parametrize("name", NAMES)
def test_degenerate_batches_give_pmls_zero(name: str, labels: List[int]) -> None:
    """A batch of one (the last of an epoch) or without a negative pair: PML returns 0."""
    lab = torch.tensor(labels)
    emb = torch.randn(len(labels), 4, requires_grad=True)
    loss = getattr(adapters, name)()(emb, lab)
    expected = getattr(pml_losses, name)()(emb.detach().clone().requires_grad_(True), lab)
    loss.backward()
    assert float(loss.detach()) == float(expected.detach()) == 0.0
    assert emb.grad is not None and torch.equal(emb.grad, torch.zeros_like(emb))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", NAMES)
def test_half_precision_comes_back_in_the_input_dtype(name: str, dtype: torch.dtype) -> None:
    emb, labels, _, _ = _data()
    got = getattr(adapters, name)()(emb.to(dtype), labels)
    assert got.dtype == dtype
    expected = getattr(pml_losses, name)()(emb.to(dtype).double(), labels)
    assert_close(got, expected, f"{name} {dtype}", 0.0, 1e-2)


@pytest.mark.parametrize("name", NAMES)
def test_second_derivatives_equal_pml(name: str) -> None:
    emb, labels, _, _ = _data(b=10)
    out = []
    for module in (pml_losses, adapters):
        x = emb.clone().requires_grad_(True)
        loss = getattr(module, name)()(x, labels)
        (g,) = torch.autograd.grad(loss, x, create_graph=True)
        out.append(torch.autograd.grad(loss + (g**2).sum(), x)[0])
    assert_close(out[1], out[0], f"{name}: gradient penalty", 1e-8, 1e-8)  # PML: log(p + tiny)


def test_pml_ntxent_without_any_pair_is_zero() -> None:
    emb = torch.randn(5, 3, requires_grad=True)
    loss = adapters.NTXentLoss()(emb, torch.arange(5))
    loss.backward()
    assert float(loss.detach()) == 0.0 and torch.equal(emb.grad, torch.zeros_like(emb))


def test_bad_options_are_refused() -> None:
    with pytest.raises(ValueError, match="backend"):
        adapters.SupConLoss(backend="gpu")
    with pytest.raises(ValueError, match="block_size"):
        adapters.NTXentLoss(block_size=0)
    with pytest.raises(ValueError, match="ref_emb"):
        adapters.SupConLoss()(
            torch.randn(4, 3),
            torch.tensor([0, 0, 1, 1]),
            ref_emb=torch.randn(4, 2),
            ref_labels=torch.tensor([0, 1, 0, 1]),
        )


@pytest.mark.parametrize("backend", ["auto", "dense", "tiled"])
def test_ntxent_takes_the_backend_its_docstring_promises(backend: str) -> None:
    emb, labels, _, _ = _data()
    want = _run(lambda: pml_losses.NTXentLoss(temperature=0.2), lambda f, x, y: f(x, labels), emb, emb)
    got = _run(lambda: adapters.NTXentLoss(temperature=0.2, backend=backend), lambda f, x, y: f(x, labels), emb, emb)
    assert_close(got[0], want[0], f"backend={backend}: loss", *TOL)
    assert_close(got[1][0], want[1][0], f"backend={backend}: gradient", *TOL)
    assert not [w for w in got[2] if w.startswith("flashcl")]


@pytest.mark.parametrize(
    "name",
    ["SupConLoss", "NTXentLoss", "CosFaceLoss", "ArcFaceLoss", "SubCenterArcFaceLoss", "TripletMarginLoss"],
)
def test_every_adapter_checks_flashcl_options_when_made(name: str) -> None:
    kwargs = {"num_classes": 3, "embedding_size": 4} if "Face" in name else {}
    cls = getattr(adapters, name)
    with pytest.raises(ValueError, match="backend must be one of"):
        cls(backend="fast", **kwargs)
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="block_size must be a positive int"):
            cls(block_size=bad, **kwargs)
    loss = cls(backend="tiled", block_size=4, **kwargs)
    assert (loss.backend, loss.block_size) == ("tiled", 4)
