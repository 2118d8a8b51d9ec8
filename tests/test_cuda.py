"""Every backend on a CUDA device against the float64 reference on the CPU: the
dense and tiled backends (plain torch ops) in float64 and float32, the Triton
kernels compiled for the GPU (not the interpreter) in float32, half precision
no worse than dense, and embeddings as wide as real models' (D = 768).
Skipped where no CUDA device is present (CI has none)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import flashcl
from helpers import CASES, TOL, Case, compare_to_reference, make_cases

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

# scores of ~1e3: float32 rounding alone exceeds the float32 tolerance (float64 covers them)
LARGE_SCORES = ("supcon_tiny_temperature", "clip_large_scale", "info_nce_tiny_temperature")
EMBEDDING = sorted(n for n, c in CASES.items() if c.fn is not flashcl.neighbor_loss and c.kernels)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("backend", ["dense", "tiled"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_torch_backends_on_cuda_float64(name: str, backend: str, reduction: str) -> None:
    compare_to_reference(CASES[name], backend, reduction, torch.float64, *TOL[torch.float64], device="cuda")


@pytest.mark.parametrize("backend", ["dense", "tiled"])
@pytest.mark.parametrize("name", sorted(n for n in CASES if n not in LARGE_SCORES))
def test_torch_backends_on_cuda_float32(name: str, backend: str) -> None:
    compare_to_reference(CASES[name], backend, "mean", torch.float32, *TOL[torch.float32], device="cuda")


@needs_triton
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("name", [n for n in EMBEDDING if n not in LARGE_SCORES])
def test_triton_compiled_float32(name: str, reduction: str) -> None:
    compare_to_reference(CASES[name], "triton", reduction, torch.float32, *TOL[torch.float32], device="cuda")


@needs_triton
@pytest.mark.parametrize("scale", [9, 40])
def test_triton_compiled_across_many_tiles(scale: int) -> None:
    # batches of 117..520 rows: several row and column tiles, the last ones partial
    for case in make_cases(seed=5, scale=scale):
        if case.fn is flashcl.neighbor_loss or case.name in LARGE_SCORES or not case.kernels:
            continue
        compare_to_reference(case, "triton", "mean", torch.float32, *TOL[torch.float32], device="cuda")


def _wide_cases(d: int) -> list:
    g = torch.Generator().manual_seed(11)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    labels = torch.randint(0, 5, (150,), generator=g)
    return [
        Case("supcon_wide", flashcl.supcon_loss, [r(150, d)], [labels], {"temperature": 0.1}, "temperature"),
        Case("clip_wide", flashcl.clip_loss, [r(130, d), r(130, d)], [], {"logit_scale": 14.0}, "logit_scale"),
        Case(
            "info_nce_hard_wide",
            flashcl.info_nce_loss,
            [r(100, d), r(170, d)],
            [torch.randint(0, 170, (100,), generator=g)],
            {"temperature": 0.05},
        ),
    ]


WIDTHS = [64, 256, 768, 1000, 2048, 4096]


@pytest.mark.parametrize("backend", ["tiled", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("d", WIDTHS)
def test_wide_embeddings_float32(backend: str, d: int) -> None:
    """IEEE float32 (torch's default matmul precision): the stripes' and the kernels'
    float32 GEMMs against the float64 reference."""
    assert torch.get_float32_matmul_precision() == "highest"
    for case in _wide_cases(d):
        compare_to_reference(case, backend, "mean", torch.float32, *TOL[torch.float32], device="cuda")


@pytest.mark.parametrize("backend", ["tiled", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", WIDTHS)
def test_wide_embeddings_half_no_worse_than_dense(d: int, dtype: torch.dtype, backend: str) -> None:
    """float16 / bfloat16 through tensor cores (the tiled backend's stripes, the
    kernels): error against the float64 reference on the rounded inputs no worse
    than the dense backend's in the same dtype."""
    for case in _wide_cases(d):
        rounded = Case(
            case.name, case.fn, [t.to(dtype).double() for t in case.tensors], case.extra, case.kwargs, case.scalar_kw
        )
        ref_loss, ref_grads = rounded.run("reference", "mean", torch.float64)
        errs = {}
        for name in ("dense", backend):
            loss, grads = rounded.run(name, "mean", dtype, device="cuda")
            errs[name] = [float((loss.double() - ref_loss).abs())] + [
                float((g.double() - r).abs().max()) for g, r in zip(grads, ref_grads)
            ]
        margin = 2e-3 if dtype == torch.float16 else 2e-2
        for i, (e, ed) in enumerate(zip(errs[backend], errs["dense"])):
            assert e <= 1.5 * ed + margin, f"{case.name}/D={d}/{backend}: output {i}: {e:.3g} vs dense {ed:.3g}"


@pytest.mark.parametrize("backend", ["tiled", pytest.param("triton", marks=needs_triton)])
def test_deterministic_on_cuda(backend: str) -> None:
    case = _wide_cases(768)[1]
    first = case.run(backend, "mean", torch.bfloat16, device="cuda")
    again = case.run(backend, "mean", torch.bfloat16, device="cuda")
    assert torch.equal(first[0], again[0]) and all(torch.equal(a, b) for a, b in zip(first[1], again[1]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["supcon", "clip", "info_nce_hard_neg", "nt_xent"])
def test_half_precision_no_worse_than_dense(name: str, dtype: torch.dtype) -> None:
    case = CASES[name]
    rounded = Case(
        case.name,
        case.fn,
        [t.to(dtype).to(torch.float64) for t in case.tensors],
        case.extra,
        case.kwargs,
        case.scalar_kw,
    )
    ref_loss, ref_grads = rounded.run("reference", "mean", torch.float64)
    backends = ["dense", "tiled"] + (["triton"] if importlib.util.find_spec("triton") else [])
    errs = {}
    for backend in backends:
        loss, grads = rounded.run(backend, "mean", dtype, device="cuda")
        assert all(g.dtype == dtype for g in grads[: len(case.tensors)])
        errs[backend] = [float((loss.double() - ref_loss).abs())] + [
            float((g.double() - r).abs().max()) for g, r in zip(grads, ref_grads)
        ]
    margin = 2e-3 if dtype == torch.float16 else 2e-2
    for backend in backends[1:]:
        for i, (e, ed) in enumerate(zip(errs[backend], errs["dense"])):
            assert e <= 1.5 * ed + margin, f"{name}/{dtype}/{backend}: output {i}: {e:.3g} vs dense {ed:.3g}"


@needs_triton
def test_triton_large_batch_bfloat16_matches_float64() -> None:
    # 4096 x 4096 scores in 64-wide tiles: the kernels' loops at length, bf16 inputs accumulated in float32
    g = torch.Generator().manual_seed(3)
    e = torch.randn(4096, 256, generator=g)
    labels = torch.randint(0, 50, (4096,), generator=g)
    eb = e.to("cuda", torch.bfloat16).requires_grad_(True)
    loss = flashcl.supcon_loss(eb, labels.cuda(), temperature=0.1, backend="triton")
    loss.backward()
    e64 = eb.detach().double().requires_grad_(True)
    ref = flashcl.supcon_loss(e64, labels.cuda(), temperature=0.1, backend="dense")
    ref.backward()
    assert abs(float(loss.detach()) - float(ref.detach())) < 1e-3 * abs(float(ref.detach()))
    assert eb.grad is not None and e64.grad is not None
    rel = float((eb.grad.double() - e64.grad).norm() / e64.grad.norm())
    assert rel < 2e-2, rel


@needs_triton
def test_auto_on_cuda() -> None:
    from flashcl.backends import AUTO_TRITON_MAX_WIDTH, resolve

    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert resolve("auto", 10**8, torch.device("cuda"), dtype, AUTO_TRITON_MAX_WIDTH) == "triton"
        assert resolve("auto", 10**8, torch.device("cuda"), dtype, AUTO_TRITON_MAX_WIDTH + 1) == "tiled"
    assert resolve("auto", 10**8, torch.device("cuda"), torch.float64, 64) == "tiled"
    # half precision narrower than 64: the stripes (the kernels read out of bounds there on an H200)
    assert resolve("auto", 10**8, torch.device("cuda"), torch.bfloat16, 24) == "tiled"
    assert resolve("auto", 10**8, torch.device("cuda"), torch.float32, 24) == "triton"


def test_neighbor_loss_tiled_on_cuda_adds_no_matrix_beyond_the_gradient() -> None:
    n = 4096
    x = torch.randn(n, n, device="cuda", requires_grad=True)
    idx = flashcl.sample_neighbors(n, 2, generator=torch.Generator().manual_seed(0)).cuda()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    flashcl.neighbor_loss(x, idx, backend="tiled").backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    matrix = n * n * 4
    assert extra <= 1.05 * matrix, f"peak {extra / matrix:.2f}x the matrix"
    ref = flashcl.neighbor_loss(x.detach().double().cpu(), idx.cpu(), backend="dense")
    got = flashcl.neighbor_loss(x.detach(), idx, backend="tiled")
    assert abs(float(got) - float(ref)) <= 1e-5 * abs(float(ref))


@needs_triton
@pytest.mark.parametrize("kernels", [False, True])
@pytest.mark.parametrize("name", ["supcon", "info_nce_hard_neg", "nt_xent", "siglip", "clip"])
def test_stripes_eager_and_fused_bfloat16_no_worse_than_dense(name: str, kernels: bool) -> None:
    """The stripes with their element-wise work eager and by the fused stripe kernels
    (flashcl.triton.stripe), in bfloat16 on the device: loss and every gradient (the
    temperature's, a sum over every pair, included) no worse than the dense backend's."""
    from flashcl.engine import engine
    from flashcl.engine.stripes import Stripes

    case = CASES[name]
    dtype = torch.bfloat16
    rounded = Case(
        case.name, case.fn, [t.to(dtype).double() for t in case.tensors], case.extra, case.kwargs, case.scalar_kw
    )
    ref_loss, ref_grads = rounded.run("reference", "mean", torch.float64)
    dense = rounded.run("dense", "mean", dtype, device="cuda")
    run = engine.run
    engine.run = lambda q, k, s, p, d, w, blk, param=(): run(q, k, s, p, Stripes(kernels=kernels), w, 5, param)
    try:
        got = rounded.run("tiled", "mean", dtype, device="cuda")
    finally:
        engine.run = run
    for i, (a, d, r) in enumerate(zip([got[0]] + got[1], [dense[0]] + dense[1], [ref_loss] + ref_grads)):
        e, ed = float((a.double() - r).abs().max()), float((d.double() - r).abs().max())
        assert e <= 1.5 * ed + 2e-2, f"{name}/kernels={kernels}: output {i}: {e:.3g} vs dense {ed:.3g}"
