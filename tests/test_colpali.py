"""flashcl.integrations.colpali against colpali-engine's own late_interaction_losses.py
(loaded from its file, its pure-torch scoring), float64: every loss, every constructor
option (temperature, normalize_scores, use_smooth_max, pos_aware_negative_filtering,
in_batch_term_weight, tau, filter_threshold, filter_factor), offset into gathered
documents, zero padding of different lengths, B = 1, every backend: the value and
the gradients of the raw token embeddings (before the padding is zeroed)."""

from __future__ import annotations

import warnings
from typing import Any, Dict

import pytest
import torch
import torch.nn.functional as F

from flashcl.bench.peers import colpali_loss_module
from flashcl.integrations import colpali as ours
from helpers import assert_close

peer, WHY = colpali_loss_module()
pytestmark = pytest.mark.skipif(peer is None, reason=f"colpali-engine's losses: {WHY}")

BACKENDS = ("reference", "dense", "tiled")


def tokens(shape, seed: int) -> tuple:
    """Normalised token embeddings with zero padding of different lengths: (raw, mask)."""
    g = torch.Generator().manual_seed(seed)
    raw = F.normalize(torch.randn(*shape, dtype=torch.float64, generator=g), dim=-1)
    lengths = torch.randint(1, shape[-2] + 1, shape[:-2] + (1,), generator=g)
    return raw, torch.arange(shape[-2]) < lengths


def run_loss(loss: Any, inputs: list, masks: list, offset: int) -> tuple:
    leaves = [x.clone().requires_grad_() for x in inputs]
    padded = [x * m.unsqueeze(-1).to(x.dtype) for x, m in zip(leaves, masks)]  # as the models zero padding
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        value = loss(*padded, offset=offset)
    return value.detach(), torch.autograd.grad(value, leaves)


CLASSES = ["ColbertLoss", "ColbertNegativeCELoss", "ColbertPairwiseCELoss", "ColbertPairwiseNegativeCELoss"]
CLASSES.append("ColbertSigmoidLoss")
OPTIONS = [
    {},
    {"normalize_scores": False, "temperature": 0.5},
    {"use_smooth_max": True, "tau": 0.3},
    {"use_smooth_max": True, "normalize_scores": False, "tau": 0.05},
    {"pos_aware_negative_filtering": True, "filter_threshold": 0.6, "filter_factor": 0.25},
    {"temperature": 0.1, "normalize_scores": False, "pos_aware_negative_filtering": True},
    {"in_batch_term_weight": 0.0},
    {"in_batch_term_weight": 1.0, "use_smooth_max": True},
]


def cases():
    for name in CLASSES:
        for i, options in enumerate(OPTIONS):
            if "in_batch_term_weight" in options and "Negative" not in name:
                continue
            for backend in BACKENDS:
                yield pytest.param(name, options, backend, id=f"{name}-{i}-{backend}")


@pytest.mark.parametrize("name, options, backend", list(cases()))
def test_equals_colpali_engine(name: str, options: Dict[str, Any], backend: str) -> None:
    b, n, lq, ld, dim = 3, 5, 4, 6, 8
    sigmoid = name == "ColbertSigmoidLoss"
    offset = 0 if sigmoid else 1  # this process's first positive among gathered documents
    q, qm = tokens((b, lq, dim), 0)
    d, dm = tokens((b if sigmoid else n, ld, dim), 1)
    inputs, masks = [q, d], [qm, dm]
    if "Negative" in name:
        neg, negm = tokens((b, 2, ld + 1, dim), 2)
        inputs.append(neg)
        masks.append(negm)
    want = run_loss(getattr(peer, name)(**options), inputs, masks, offset)
    got = run_loss(getattr(ours, name)(**options, backend=backend, block_size=2), inputs, masks, offset)
    assert_close(got[0], want[0], f"{name} {options} value", 1e-12, 1e-10)
    for i, (a, w) in enumerate(zip(got[1], want[1])):
        assert_close(a, w, f"{name} {options} grad {i}", 1e-12, 1e-10)


@pytest.mark.parametrize("name", CLASSES)
def test_one_query_and_the_defaults(name: str) -> None:
    if name in ("ColbertPairwiseCELoss", "ColbertSigmoidLoss"):
        b = 2  # the pairwise loss needs a negative in the batch; the sigmoid loss is square
    else:
        b = 1
    q, qm = tokens((b, 3, 8), 3)
    d, dm = tokens((b if name == "ColbertSigmoidLoss" else 4, 5, 8), 4)
    inputs, masks = [q, d], [qm, dm]
    if "Negative" in name:
        neg, negm = tokens((b, 3, 5, 8), 5)
        inputs.append(neg)
        masks.append(negm)
    want = run_loss(getattr(peer, name)(), inputs, masks, 0)
    got = run_loss(getattr(ours, name)(), inputs, masks, 0)
    assert_close(got[0], want[0], f"{name} value", 1e-12, 1e-10)
    for a, w in zip(got[1], want[1]):
        assert_close(a, w, f"{name} grad", 1e-12, 1e-10)


def test_out_of_bounds_scores_warn_and_bad_options_raise() -> None:
    q, d = torch.randn(2, 3, 8, dtype=torch.float64) * 5, torch.randn(2, 4, 8, dtype=torch.float64) * 5
    with pytest.warns(UserWarning, match="out of bounds"):
        ours.ColbertLoss()(q, d)
    with pytest.raises(ValueError, match="in_batch_term_weight"):
        ours.ColbertNegativeCELoss(in_batch_term_weight=1.5)
    with pytest.raises(ValueError, match="tau"):
        ours.ColbertLoss(tau=0.0)


@pytest.mark.parametrize("name", CLASSES)
def test_signatures_spell_out_the_peers_parameters_and_the_dtype_is_the_peers(name: str) -> None:
    """Every constructor lists colpali-engine's parameters by name, in its order, with its
    defaults (then flashcl's keyword-only backend, block_size); bfloat16 and float16
    inputs give a loss of colpali-engine's dtype (theirs; float32 for the sigmoid loss,
    whose float32 mask promotes it), within its own rounding of the float64 value."""
    import inspect

    theirs = inspect.signature(getattr(peer, name).__init__).parameters
    mine = inspect.signature(getattr(ours, name).__init__).parameters
    assert [p for p in mine if mine[p].kind != inspect.Parameter.KEYWORD_ONLY] == list(theirs), name
    assert all(mine[p].default == theirs[p].default for p in theirs if p != "self"), name
    assert [p for p in mine if mine[p].kind == inspect.Parameter.KEYWORD_ONLY] == ["backend", "block_size"]
    b = 2
    q, qm = tokens((b, 3, 8), 6)
    d, dm = tokens((b, 5, 8), 7)
    inputs, masks = [q, d], [qm, dm]
    if "Negative" in name:
        neg, negm = tokens((b, 2, 5, 8), 8)
        inputs.append(neg)
        masks.append(negm)
    exact = run_loss(getattr(peer, name)(), inputs, masks, 0)[0]
    for dtype in (torch.bfloat16, torch.float16):
        low = [x.to(dtype) for x in inputs]
        want = run_loss(getattr(peer, name)(), low, masks, 0)
        got = run_loss(getattr(ours, name)(backend="tiled"), low, masks, 0)
        assert got[0].dtype == want[0].dtype, (name, dtype)
        assert want[0].dtype == (torch.float32 if name == "ColbertSigmoidLoss" else dtype)
        peer_error = float((want[0].double() - exact).abs())
        assert float((got[0].double() - exact).abs()) <= peer_error + 2 * torch.finfo(dtype).eps * float(exact.abs())
        assert all(g.dtype == dtype and bool(torch.isfinite(g).all()) for g in got[1])


@pytest.mark.parametrize("name", CLASSES)
def test_flashcl_options_are_checked_when_made(name: str) -> None:
    cls = getattr(ours, name)
    with pytest.raises(ValueError, match="backend must be one of"):
        cls(backend="triton")
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        cls(block_size=0)
