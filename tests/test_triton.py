"""The Triton kernels under Triton's CPU interpreter (TRITON_INTERPRET=1), float32
and half precision, against the float64 reference: loss and every gradient."""

from __future__ import annotations

import importlib.util
import os
from typing import Any, List, Tuple

import pytest
import torch

import flashcl
from flashcl.triton.driver import Config
from helpers import CASES, TOL, Case, assert_close, compare_to_reference, make_cases

if importlib.util.find_spec("triton") is None:
    pytest.skip(
        "triton is not installed (pip install flashcl[triton]): its kernels cannot be tested here",
        allow_module_level=True,
    )

if torch.cuda.is_available():
    pytest.skip(
        "a CUDA device is present: the compiled kernels are tested by tests/test_cuda.py", allow_module_level=True
    )
# conftest sets it before anything imports triton; a run that set it to 0 is refused here
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "TRITON_INTERPRET is not 1: the interpreter tests need it set before triton is imported",
        allow_module_level=True,
    )

EMBEDDING_CASES = sorted(
    name
    for name, c in CASES.items()
    if c.fn is not flashcl.neighbor_loss
    and c.kernels
    and name not in ("supcon_tiny_temperature", "clip_large_scale", "info_nce_tiny_temperature")
)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("name", EMBEDDING_CASES)
def test_triton_float32_matches_reference(name: str, reduction: str) -> None:
    compare_to_reference(CASES[name], "triton", reduction, torch.float32, *TOL[torch.float32])


def test_triton_sizes_across_several_tiles() -> None:
    # batches of 117 and 126 rows: two 64-row tiles, the last one partial
    for case in make_cases(seed=5, scale=9):
        if (
            case.fn is flashcl.neighbor_loss
            or not case.kernels
            or case.name.endswith(("tiny_temperature", "large_scale"))
        ):
            continue
        compare_to_reference(case, "triton", "mean", torch.float32, *TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["supcon", "clip", "info_nce_hard_neg"])
def test_triton_half_precision_no_worse_than_dense(name: str, dtype: torch.dtype) -> None:
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
    errs = {}
    for backend in ("dense", "triton"):
        loss, grads = rounded.run(backend, "mean", dtype)
        assert all(g.dtype == dtype for g in grads[: len(case.tensors)])
        errs[backend] = [float((loss.double() - ref_loss).abs())] + [
            float((g.double() - r).abs().max()) for g, r in zip(grads, ref_grads)
        ]
    margin = 2e-3 if dtype == torch.float16 else 2e-2
    for i, (et, ed) in enumerate(zip(errs["triton"], errs["dense"])):
        assert et <= 1.5 * ed + margin, f"{name}/{dtype}: output {i}: triton {et:.3g} vs dense {ed:.3g}"


def test_triton_rejects_float64_and_the_score_matrix_loss() -> None:
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        flashcl.supcon_loss(torch.randn(4, 3, dtype=torch.float64), torch.tensor([0, 0, 1, 1]), backend="triton")
    with pytest.raises(ValueError, match="neighbor_loss"):
        flashcl.neighbor_loss(torch.randn(4, 4), torch.zeros(4, 1, dtype=torch.long), backend="triton")


def _ragged_cases(d: int, seed: int) -> list:
    """Every embedding loss at sizes that are multiples of no tile. At D = 1 the rows
    are not normalised (normalised, every row is +-1 and the loss is flat)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    labels = torch.randint(0, 4, (37,), generator=g)
    cases = [
        Case("supcon", flashcl.supcon_loss, [r(37, d)], [labels], {"temperature": 0.3}, "temperature"),
        Case(
            "supcon_sum_self",
            flashcl.supcon_loss,
            [r(37, d)],
            [labels],
            {"temperature": 0.2, "positives": "sum", "include_self": True},
        ),
        Case("nt_xent", flashcl.nt_xent_loss, [r(19, d), r(19, d)], [], {"temperature": 0.4}, "temperature"),
        Case(
            "info_nce_hard_neg",
            flashcl.info_nce_loss,
            [r(23, d), r(41, d)],
            [torch.randint(0, 41, (23,), generator=g)],
            {"temperature": 0.2},
            "temperature",
        ),
        Case("clip", flashcl.clip_loss, [r(29, d), r(29, d)], [], {"logit_scale": 5.0}, "logit_scale"),
        Case(
            "clip_unnormalized",
            flashcl.clip_loss,
            [0.3 * r(29, d), 0.3 * r(29, d)],
            [],
            {"logit_scale": 2.0, "normalize": False},
        ),
    ]
    if d == 1:
        for case in cases:
            case.kwargs["normalize"] = False
    return cases


# tiles of 16 x 32 rows, the embedding in chunks of 16 (64 at D = 300), gradients in
# chunks of 16 dims (128): several of each, the last ones partial
SMALL = Config(block_m=16, block_n=32, block_k=16, block_do=16, num_warps=4, num_stages=1)
WIDE = Config(block_m=16, block_n=32, block_k=64, block_do=128, num_warps=4, num_stages=1)


@pytest.mark.parametrize(
    "d,config",
    # D = 300 under the interpreter takes ~13 s: with the slow cases (D = 33 has partial chunks too)
    [(1, SMALL), (33, SMALL), pytest.param(300, WIDE, marks=pytest.mark.slow)],
)
def test_injected_small_tiles_at_ragged_sizes(d: int, config: Config) -> None:
    """Against the float64 reference, within the float32 tolerance or 8x the
    dense backend's own float32 error, whichever is larger (at D = 1 normalised rows
    are +-1, the loss is flat, and the normalisation's backward cancels in float32)."""
    for case in _ragged_cases(d, seed=d):
        for reduction in ("mean", "none"):
            ref_loss, ref_grads = case.run("reference", reduction, torch.float64)
            dense_loss, dense_grads = case.run("dense", reduction, torch.float32)
            loss, grads = _run_with_config(case, reduction, torch.float32, config)
            for i, (a, e, de) in enumerate(zip([loss] + grads, [ref_loss] + ref_grads, [dense_loss] + dense_grads)):
                atol = max(TOL[torch.float32][0], 8 * float((de.double() - e).abs().max()))
                assert_close(a, e, f"{case.name}/D={d}/{reduction}: output {i}", atol, TOL[torch.float32][1])


def _run_with_config(case: Case, reduction: str, dtype: torch.dtype, config: Config):
    """The case through the triton driver with an injected launch configuration."""
    from flashcl.triton import driver as tcore

    original = tcore.default_config
    tcore.default_config = lambda d, dt: config
    try:
        return case.run("triton", reduction, dtype)
    finally:
        tcore.default_config = original


def test_deterministic() -> None:
    """The same inputs give bitwise the same loss and gradients (no atomics)."""
    for case in _ragged_cases(33, seed=3)[:5]:
        first = _run_with_config(case, "mean", torch.float32, SMALL)
        again = _run_with_config(case, "mean", torch.float32, SMALL)
        assert torch.equal(first[0], again[0]), case.name
        assert all(torch.equal(a, b) for a, b in zip(first[1], again[1])), case.name


def test_any_width() -> None:
    """No width limit: D = 1030 runs (the gradient kernels take it in output chunks)."""
    for case in _ragged_cases(1030, seed=1)[:4]:
        compare_to_reference(case, "triton", "mean", torch.float32, *TOL[torch.float32])


def test_triton_on_cpu_without_the_interpreter_is_refused(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA"):
        flashcl.supcon_loss(torch.randn(4, 3), torch.tensor([0, 0, 1, 1]), backend="triton")


class _FailingKernel:
    """A kernel whose launch fails as on a GPU with too little shared memory."""

    def __getitem__(self, grid):  # noqa: ANN001, ANN204
        def launch(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            from triton.runtime.errors import OutOfResources

            raise OutOfResources(232448, 101376, "shared memory")

        return launch


@pytest.mark.parametrize("failing", ["lse_kernel", "dq_kernel"], ids=["forward", "backward"])
def test_a_kernel_that_fails_falls_back_to_tiled_with_one_warning(failing: str, monkeypatch) -> None:
    """A Triton kernel that cannot launch on the user's GPU (here: too little shared
    memory, in the forward's kernel or only in the backward's): the call is computed by
    the tiled backend, one RuntimeWarning names the cause, later calls fall back at once
    without another, and the values and gradients are the reference's."""
    import warnings

    import flashcl.triton.driver as driver
    from flashcl.engine import engine

    monkeypatch.setattr(driver, failing, _FailingKernel())
    monkeypatch.setattr(driver, "_FAILED", None)
    monkeypatch.setattr(engine, "_WARNED_FAILURES", set())
    for name in ("supcon", "clip"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            # "none": the gradient in autograd's backward (the recomputation falls back there)
            reduction = "none" if failing == "dq_kernel" else "mean"
            compare_to_reference(CASES[name], "triton", reduction, torch.float32, *TOL[torch.float32])
        messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        if name == "supcon":
            assert len(messages) == 1, messages
            assert "OutOfResources" in messages[0] and "shared memory" in messages[0] and "tiled" in messages[0]
        else:  # the same cause: no second warning, and no second try of the kernels
            assert messages == [], messages
    assert driver._FAILED is not None and "OutOfResources" in driver._FAILED


def test_flashcl_check_marks_every_fallen_back_row(monkeypatch) -> None:
    """``flashcl check`` on a device whose kernels fail: every Triton row is 'fallback'
    with the cause (the first row warned, the later ones fell back at once), none FAIL."""
    import flashcl.triton.driver as driver
    from flashcl.engine import engine
    from flashcl.tools.selfcheck import run_checks

    monkeypatch.setattr(driver, "lse_kernel", _FailingKernel())
    monkeypatch.setattr(driver, "_FAILED", None)
    monkeypatch.setattr(engine, "_WARNED_FAILURES", set())
    rows = run_checks("cpu", [torch.float32], ["supcon_loss", "clip_loss"], backends=("tiled", "triton"))
    triton_rows = [r for r in rows if r.backend == "triton"]
    assert [r.status for r in triton_rows] == ["fallback", "fallback"], triton_rows
    assert all("OutOfResources" in r.note for r in triton_rows), [r.note for r in triton_rows]
    assert all(r.status == "pass" for r in rows if r.backend == "tiled")


def test_narrow_half_precision_is_computed_by_the_tiled_backend(monkeypatch) -> None:
    """Half-precision embeddings narrower than 64, which the kernels read out of bounds
    on an H200: ``backend="triton"`` computes the call with the tiled backend (one warning
    naming the cause, the tiled backend's values and gradients), the kernels stay in use
    for other calls (float32 at the same width), and ``auto`` picks the tiled backend."""
    import warnings

    import flashcl.triton.driver as driver
    from flashcl.backends import resolve
    from flashcl.engine import engine

    monkeypatch.setattr(driver, "_interpreted", lambda: False)  # as on a GPU
    monkeypatch.setattr(driver, "_FAILED", None)
    monkeypatch.setattr(engine, "_WARNED_FAILURES", set())
    case = CASES["info_nce_hard_neg"]
    for reduction in ("mean", "none"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = case.run("triton", reduction, torch.float16)
        want = case.run("tiled", reduction, torch.float16)
        for a, e in zip([got[0], *got[1]], [want[0], *want[1]]):
            assert torch.equal(a, e)
        messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert len(messages) == (1 if reduction == "mean" else 0), messages  # one warning per cause
        assert all("narrower than 64" in m and "tiled" in m for m in messages), messages
    assert driver._FAILED is None  # not a failure of the kernels: they still serve other calls
    cuda = torch.device("cuda")
    for dtype in (torch.float16, torch.bfloat16):
        assert resolve("auto", 10**8, cuda, dtype, 63) == "tiled"
        assert resolve("auto", 10**8, cuda, dtype, 64) == "triton"
    assert resolve("auto", 10**8, cuda, torch.float32, 6) == "triton"


# ----------------------------------------------------------------------------- the fused stripe kernels

STRIPE_CASES = sorted(
    name
    for name, c in CASES.items()
    if c.fn is not flashcl.neighbor_loss and not name.endswith(("tiny_temperature", "large_scale"))
)
#: the cases whose heads the stripe kernels compute: those the Triton backend's kernels compute
#: (the masked softmax and the softplus head), rows only (CLIP's columns take the eager stripes)
STRIPE_KERNEL_CASES = {name for name in STRIPE_CASES if CASES[name].kernels and CASES[name].fn is not flashcl.clip_loss}


def _with_stripe_kernels(case: Case, reduction: str, dtype: torch.dtype, block: int) -> Tuple[Any, List[str]]:
    """The case on the stripes with the fused kernels asked for (blocks of ``block`` rows),
    and the kernels that ran."""
    from flashcl.engine import engine
    from flashcl.engine.stripes import Stripes
    from flashcl.triton import stripe

    ran: List[str] = []
    originals = {name: getattr(stripe, name) for name in ("softmax_rows", "softmax_grad", "softplus_rows")}

    def counted(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            ran.append(name)
            return originals[name](*args, **kwargs)

        return call

    run = engine.run

    def with_kernels(q, k, scale, problem, driver, reduce_weights, blk, *params):  # noqa: ANN001
        return run(q, k, scale, problem, Stripes(kernels=True), reduce_weights, block, *params)

    try:
        for name in originals:
            setattr(stripe, name, counted(name))
        engine.run = with_kernels
        return case.run("tiled", reduction, dtype), ran
    finally:
        engine.run = run
        for name, fn in originals.items():
            setattr(stripe, name, fn)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("name", STRIPE_CASES)
def test_stripe_kernels_float32_match_reference(name: str, reduction: str) -> None:
    """Every embedding loss on the stripes with the fused kernels (ragged blocks of 4 rows)
    equals the float64 reference, loss and every gradient; the kernels ran where the head
    has them (a fused forward pass, and with reduction="none" the backward's second pass)."""
    want_loss, want_grads = CASES[name].run("reference", reduction, torch.float64)
    (loss, grads), ran = _with_stripe_kernels(CASES[name], reduction, torch.float32, 4)
    assert bool(ran) == (name in STRIPE_KERNEL_CASES), (name, sorted(set(ran)))
    assert_close(loss, want_loss, f"{name}/{reduction}: loss", *TOL[torch.float32])
    for i, (a, e) in enumerate(zip(grads, want_grads)):
        assert_close(a, e, f"{name}/{reduction}: grad {i}", *TOL[torch.float32])


@pytest.mark.parametrize("name", ["info_nce_hard_neg", "supcon", "siglip", "nt_xent"])
def test_stripe_kernels_bfloat16_no_worse_than_dense(name: str) -> None:
    """bfloat16 inputs: the kernels' G'' written in bfloat16 once; the loss and the
    embeddings' gradients against the float64 reference on the same rounded inputs no worse
    than the dense backend's. (The interpreter truncates float32 to bfloat16 where a GPU
    rounds to nearest: a bias of half an ulp on every entry, which a sum over every pair, the
    temperature's gradient, shows; tests/test_cuda.py checks it on the device.)"""
    case = CASES[name]
    dtype = torch.bfloat16
    tensors = [t.to(dtype).to(torch.float64) for t in case.tensors]
    rounded = Case(case.name, case.fn, tensors, case.extra, case.kwargs, case.scalar_kw)
    ref_loss, ref_grads = rounded.run("reference", "mean", torch.float64)
    dense = rounded.run("dense", "mean", dtype)
    (loss, grads), ran = _with_stripe_kernels(rounded, "mean", dtype, 5)
    assert ran
    outputs = zip([loss] + grads, [dense[0]] + dense[1], [ref_loss] + ref_grads)
    for i, (s_out, d_out, r_out) in list(enumerate(outputs))[: 1 + len(tensors)]:
        es = float((s_out.double() - r_out).abs().max())
        ed = float((d_out.double() - r_out).abs().max())
        assert es <= 1.5 * ed + 1e-2, f"{name}: output {i}: stripe kernels {es:.3g} vs dense {ed:.3g}"


def test_stripe_softmax_kernels_against_torch() -> None:
    """The two softmax kernels alone on a ragged stripe (3 column blocks and a remainder):
    the row logsumexps with the anchor and an indexed column out (a row with none left:
    -inf), and G'' = coef exp(s - lse) ik (0 where out) in float32 and in bfloat16 within an
    ulp of torch's rounding (the interpreter truncates)."""
    from flashcl.triton import stripe

    g = torch.Generator().manual_seed(1)
    b, n, r0, off = 6, 3 * stripe.BLOCK_N + 37, 3, 1
    p = torch.randn(b, n, generator=g)
    iq, ik = torch.rand(b, generator=g) + 0.5, torch.rand(n, generator=g) + 0.5
    excl = torch.full((r0 + b,), -1, dtype=torch.int64)
    excl[r0 + 1], excl[r0 + 4] = 2000, 5
    scale = 2.5
    s = scale * iq[:, None].double() * ik[None, :].double() * p.double()
    out = torch.zeros(b, n, dtype=torch.bool)
    for i in range(b):
        out[i, r0 + i + off] = True
        if int(excl[r0 + i]) >= 0:
            out[i, int(excl[r0 + i])] = True
    lse = stripe.softmax_rows(p, iq, ik, scale, r0, True, off, excl)
    want = torch.logsumexp(s.masked_fill(out, float("-inf")), 1)
    assert_close(lse, want, "lse", 1e-5, 1e-6)
    coef = torch.rand(b, generator=g)
    want_g = (coef[:, None].double() * torch.exp(s - want[:, None]) * ik[None, :].double()).masked_fill(out, 0.0)
    g32 = stripe.softmax_grad(p, iq, ik, scale, r0, True, off, excl, lse, coef, torch.empty(b, n))
    assert_close(g32, want_g, "G'' float32", 1e-6, 1e-5)
    g16 = stripe.softmax_grad(p, iq, ik, scale, r0, True, off, excl, lse, coef, torch.empty(b, n, dtype=torch.bfloat16))
    ulp = want_g.abs().float() * 2.0**-7 + 1e-30
    assert bool(((g16.double() - want_g).abs() <= ulp).all())
    one = stripe.softmax_rows(p[:, :1], iq, ik[:1], scale, 0, True, -1, None)  # row 1's only column is itself
    assert torch.isneginf(one[1]) and bool(torch.isfinite(one[[0, 2, 3, 4, 5]]).all())


def test_stripe_softplus_kernel_against_torch() -> None:
    from flashcl.triton import stripe

    g = torch.Generator().manual_seed(2)
    b, n = 5, 2 * stripe.BLOCK_N + 11
    p = 3.0 * torch.randn(b, n, generator=g)
    iq, ik = torch.rand(b, generator=g) + 0.5, torch.rand(n, generator=g) + 0.5
    t = 4.0 * iq[:, None].double() * ik[None, :].double() * p.double() - 1.5
    coef = torch.rand(b, generator=g)
    out = torch.empty(b, n)
    sp, sig = stripe.softplus_rows(p, iq, ik, 4.0, -1.5, coef, out)
    assert_close(sp, torch.nn.functional.softplus(t).sum(1), "softplus sums", 1e-4, 1e-5)
    assert_close(sig, torch.sigmoid(t).sum(1), "sigmoid sums", 1e-4, 1e-5)
    assert_close(out, coef[:, None].double() * torch.sigmoid(t) * ik[None, :].double(), "G''", 1e-6, 1e-5)
