"""The Triton kernels under Triton's CPU interpreter (TRITON_INTERPRET=1), float32
and half precision, against the float64 reference: loss and every gradient."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

import flashcl
from helpers import CASES, TOL, Case, compare_to_reference, make_cases

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (pip install flashcl[triton]): its kernels cannot be tested here",
                allow_module_level=True)

if torch.cuda.is_available():
    pytest.skip("a CUDA device is present: the compiled kernels are tested by tests/test_cuda.py",
                allow_module_level=True)
# conftest sets it before anything imports triton; a run that set it to 0 is refused here
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("TRITON_INTERPRET is not 1: the interpreter tests need it set before triton is imported",
                allow_module_level=True)

EMBEDDING_CASES = sorted(name for name, c in CASES.items() if c.fn is not flashcl.neighbor_loss
                         and name not in ("supcon_tiny_temperature", "clip_large_scale", "info_nce_tiny_temperature"))


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("name", EMBEDDING_CASES)
def test_triton_float32_matches_reference(name: str, reduction: str) -> None:
    compare_to_reference(CASES[name], "triton", reduction, torch.float32, *TOL[torch.float32])


def test_triton_sizes_across_several_tiles() -> None:
    # batches of 117 and 126 rows: two 64-row tiles, the last one partial
    for case in make_cases(seed=5, scale=9):
        if case.fn is flashcl.neighbor_loss or case.name.endswith(("tiny_temperature", "large_scale")):
            continue
        compare_to_reference(case, "triton", "mean", torch.float32, *TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["supcon", "clip", "info_nce_hard_neg"])
def test_triton_half_precision_no_worse_than_dense(name: str, dtype: torch.dtype) -> None:
    case = CASES[name]
    rounded = Case(case.name, case.fn, [t.to(dtype).to(torch.float64) for t in case.tensors], case.extra,
                   case.kwargs, case.scalar_kw)
    ref_loss, ref_grads = rounded.run("reference", "mean", torch.float64)
    errs = {}
    for backend in ("dense", "triton"):
        loss, grads = rounded.run(backend, "mean", dtype)
        assert all(g.dtype == dtype for g in grads[:len(case.tensors)])
        errs[backend] = [float((loss.double() - ref_loss).abs())] + [
            float((g.double() - r).abs().max()) for g, r in zip(grads, ref_grads)]
    margin = 2e-3 if dtype == torch.float16 else 2e-2
    for i, (et, ed) in enumerate(zip(errs["triton"], errs["dense"])):
        assert et <= 1.5 * ed + margin, f"{name}/{dtype}: output {i}: triton {et:.3g} vs dense {ed:.3g}"


def test_triton_rejects_float64_and_the_score_matrix_loss() -> None:
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        flashcl.supcon_loss(torch.randn(4, 3, dtype=torch.float64), torch.tensor([0, 0, 1, 1]), backend="triton")
    with pytest.raises(ValueError, match="neighbor_loss"):
        flashcl.neighbor_loss(torch.randn(4, 4), torch.zeros(4, 1, dtype=torch.long), backend="triton")


def test_triton_refuses_embeddings_wider_than_its_tiles() -> None:
    with pytest.raises(ValueError, match="up to 1024 wide"):
        flashcl.supcon_loss(torch.randn(4, 1025), torch.tensor([0, 0, 1, 1]), backend="triton")
    with pytest.raises(ValueError, match="up to 2048 wide"):
        flashcl.clip_loss(torch.randn(4, 2049).half(), torch.randn(4, 2049).half(), 10.0, backend="triton")


def test_triton_on_cpu_without_the_interpreter_is_refused(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA"):
        flashcl.supcon_loss(torch.randn(4, 3), torch.tensor([0, 0, 1, 1]), backend="triton")
