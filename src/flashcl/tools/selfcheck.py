"""``flashcl check``: every loss's backends on your device and dtypes, at small sizes,
against the float64 reference computed on the CPU: a table of pass / the largest
error / the time, and a non-zero exit status on a mismatch. A GPU, a driver or a
Triton version that no test of the project ran on is checked where it will train.

Each row runs one loss (a typical configuration: labels with several positives,
hard negatives) on one backend and dtype: the value and the gradient of every
floating input, each compared with the reference's by its largest error relative
to the reference's largest magnitude. The reference of a row takes the inputs as
the row gives them (rounded to its dtype, then computed in float64), so that a row
measures the backend's arithmetic, not the rounding of its inputs (which would
move a mined triplet, say). A row passes within its dtype's tolerance (the
gradient's own rounding to that dtype, and float32 accumulation), or, in half
precision, within twice the dense backend's error in that dtype. A backend
that a loss does not have, or that the device cannot run (Triton on a CPU), is
``n/a``; a Triton kernel that fails on the device and falls back to the tiled
backend is ``fallback``, with the cause.

    >>> rows = run_checks("cpu", [torch.float32], losses=["supcon_loss"])
    >>> sorted({r.backend for r in rows}), all(r.status in ("pass", "n/a") for r in rows)
    (['dense', 'tiled', 'triton'], True)
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .. import functional
from ..triton import failure

__all__ = ["Check", "Row", "CHECKS", "TOLERANCE", "run_checks", "format_row", "HEADER"]

#: the largest error a row may have, relative to the reference's largest magnitude
TOLERANCE = {torch.float64: 1e-9, torch.float32: 2e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}
BACKENDS = ("dense", "tiled", "triton")


@dataclass
class Check:
    """One loss's call: ``make(generator) -> (float inputs, other inputs, keywords)``."""

    loss: str
    make: Callable[[torch.Generator], Tuple[List[Tensor], List[Any], Dict[str, Any]]]


@dataclass
class Row:
    loss: str
    backend: str
    dtype: str
    status: str  # "pass" | "FAIL" | "error" | "n/a" | "fallback"
    error: Optional[float] = None
    tolerance: Optional[float] = None
    ms: Optional[float] = None
    note: str = ""


def _r(g: torch.Generator, *shape: int) -> Tensor:
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _labels(g: torch.Generator, n: int, classes: int) -> Tensor:
    return torch.randint(0, classes, (n,), generator=g)


#: every registered loss, at small odd sizes
CHECKS = [
    Check("supcon_loss", lambda g: ([_r(g, 37, 24)], [_labels(g, 37, 5)], {"temperature": 0.1})),
    Check("nt_xent_loss", lambda g: ([_r(g, 29, 24), _r(g, 29, 24)], [], {"temperature": 0.2})),
    Check(
        "info_nce_loss",
        lambda g: ([_r(g, 23, 24), _r(g, 41, 24)], [torch.randint(0, 41, (23,), generator=g)], {"temperature": 0.05}),
    ),
    Check("clip_loss", lambda g: ([_r(g, 31, 24), _r(g, 31, 24)], [14.0], {})),
    Check("siglip_loss", lambda g: ([_r(g, 31, 24), _r(g, 31, 24)], [10.0, -5.0], {})),
    Check(
        "gist_loss",
        lambda g: ([_r(g, 19, 24), _r(g, 19, 24)], [], {"guide": (_r(g, 19, 8), _r(g, 19, 8)), "temperature": 0.05}),
    ),
    Check(
        "neighbor_loss",
        lambda g: ([_r(g, 33, 33)], [torch.randint(0, 33, (33, 3), generator=g)], {}),
    ),
    Check(
        "distill_loss",
        lambda g: (
            [_r(g, 21, 24), _r(g, 27, 24)],
            [_r(g, 21, 16), _r(g, 27, 16)],
            {"scale": 10.0, "teacher_scale": 20.0},
        ),
    ),
    Check("cosent_loss", lambda g: ([_r(g, 25, 24), _r(g, 25, 24)], [torch.rand(25, generator=g)], {"scale": 20.0})),
    Check("triplet_loss", lambda g: ([_r(g, 30, 24)], [_labels(g, 30, 4)], {"margin": 0.5, "mining": "semi-hard"})),
    Check("cosface_loss", lambda g: ([_r(g, 26, 24), _r(g, 57, 24)], [_labels(g, 26, 57)], {"scale": 30.0})),
    Check("arcface_loss", lambda g: ([_r(g, 26, 24), _r(g, 57, 24)], [_labels(g, 26, 57)], {"scale": 30.0})),
    Check("maxsim_loss", lambda g: ([_r(g, 6, 5, 16), _r(g, 9, 7, 16)], [], {"temperature": 0.5})),
    Check("maxsim_distill_loss", lambda g: ([_r(g, 5, 4, 16), _r(g, 5, 3, 6, 16)], [_r(g, 5, 3)], {})),
    # (student views, prototypes), the teacher's views without gradient
    Check("dino_loss", lambda g: ([_r(g, 3, 9, 24), _r(g, 301, 24)], [_r(g, 2, 9, 24)], {"pairs": "cross"})),
    Check("swav_loss", lambda g: ([_r(g, 3, 11, 24), _r(g, 97, 24)], [], {"high_resolution": 2})),
    Check("koleo_loss", lambda g: ([_r(g, 41, 24)], [], {})),
    Check(
        "flex_loss",
        lambda g: (
            [_r(g, 37, 24)],
            [],
            {
                "rows": {"t": _labels(g, 37, 12), "doc": _labels(g, 37, 30)},
                "positive": lambda a, b: (a.t - b.t).abs() <= 1,
                "exclude": lambda a, b: (a.doc == b.doc) & ((a.t - b.t).abs() > 1),
                "score_mod": lambda s, a, b: s - 0.2 * ((a.t - b.t).abs() <= 1),
                "temperature": 0.2,
            },
        ),
    ),
]


def _each(fn: Callable[[Any], Any], v: Any) -> Any:
    """``fn`` on a keyword's tensors: each of a tuple, each value of a dict (a flex loss's
    per-sample data), else the value itself."""
    if isinstance(v, tuple):
        return tuple(fn(t) for t in v)
    if isinstance(v, dict):
        return {name: fn(t) for name, t in v.items()}
    return fn(v)


def _call(check: Check, floats: List[Tensor], others: List[Any], kw: Dict[str, Any], backend: str) -> Tensor:
    """The loss on these inputs (labels, guides, a teacher's rows in the floats' order)."""
    fn = getattr(functional, check.loss)
    args: List[Any] = list(floats)
    if check.loss in ("cosface_loss", "arcface_loss", "dino_loss"):  # (embeddings, labels / teacher, weights)
        args = [floats[0], others[0], floats[1]]
    else:
        args += others
    return fn(*args, backend=backend, **kw)


def _run(
    check: Check, backend: str, dtype: torch.dtype, device: str, seed: int, rounded: Optional[torch.dtype] = None
) -> Tuple[Tensor, List[Tensor], float]:
    """(value, every floating input's gradient, forward + backward seconds of a warm call);
    ``rounded``: the inputs first rounded to that dtype (the reference of a row in it)."""
    floats, others, kw = check.make(torch.Generator().manual_seed(seed))
    if rounded is not None:

        def as_given(x: Any) -> Any:
            return x.to(rounded).double() if isinstance(x, Tensor) and x.is_floating_point() else x

        floats, others = [as_given(x) for x in floats], [as_given(x) for x in others]
        kw = {k: _each(as_given, v) for k, v in kw.items()}

    def move(x: Any) -> Any:
        """A floating tensor to the device in the row's dtype, another to the device."""
        if not isinstance(x, Tensor):
            return x
        return x.to(device=device, dtype=dtype) if x.is_floating_point() else x.to(device)

    def once() -> Tuple[Tensor, List[Tensor]]:
        leaves = [move(x).requires_grad_(True) for x in floats]
        rest = [move(x) for x in others]  # labels to the device, a teacher's rows in the dtype
        extra = {k: _each(move, v) for k, v in kw.items()}
        value = _call(check, leaves, rest, extra, backend)
        grads = torch.autograd.grad(value, leaves)
        return value.detach(), list(grads)

    once()  # first call: compilation, caches
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    value, grads = once()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return value, grads, time.perf_counter() - start


def _error(got: Tuple[Tensor, List[Tensor]], want: Tuple[Tensor, List[Tensor]]) -> float:
    """The largest error of the value and of every gradient, each relative to the
    reference's largest magnitude (NaN or inf: infinite)."""
    worst = 0.0
    for a, e in zip([got[0], *got[1]], [want[0], *want[1]]):
        a64 = a.detach().double().cpu()
        if not bool(torch.isfinite(a64).all()):
            return float("inf")
        scale = max(float(e.abs().max()) if e.numel() else 0.0, 1e-12)
        worst = max(worst, float((a64 - e).abs().max()) / scale if e.numel() else 0.0)
    return worst


def _why_not(e: Exception) -> str:
    return str(e).split("\n")[0][:100]


def run_checks(
    device: str,
    dtypes: Sequence[torch.dtype],
    losses: Optional[Sequence[str]] = None,
    backends: Sequence[str] = BACKENDS,
    seed: int = 0,
    report: Optional[Callable[[Row], None]] = None,
) -> List[Row]:
    """Every check of ``losses`` (default: all) on ``backends`` and ``dtypes`` on
    ``device`` against the float64 reference on the CPU; ``report`` is called with
    each row as it is made (a printout that keeps the rows before a crash)."""
    chosen = [c for c in CHECKS if losses is None or c.loss in losses]
    unknown = set(losses or ()) - {c.loss for c in CHECKS}
    if unknown:
        raise ValueError(f"unknown loss(es) {sorted(unknown)}: choose from {[c.loss for c in CHECKS]}")
    rows: List[Row] = []
    for check in chosen:
        for dtype in dtypes:
            value, grads, _ = _run(check, "reference", torch.float64, "cpu", seed, rounded=dtype)
            want = (value, grads)
            dense_error: Optional[float] = None
            for backend in backends:
                name = str(dtype).replace("torch.", "")
                try:
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        v, g, seconds = _run(check, backend, dtype, device, seed)
                except (ValueError, TypeError) as e:  # the backend is refused for this loss or device
                    row = Row(check.loss, backend, name, "n/a", note=_why_not(e))
                except Exception as e:  # noqa: BLE001 - a crash is a row of the table, not the end of it
                    row = Row(check.loss, backend, name, "error", note=f"{type(e).__name__}: {_why_not(e)}")
                else:
                    err = _error((v, g), want)
                    tol = TOLERANCE[dtype]
                    if dtype in (torch.float16, torch.bfloat16) and dense_error is not None:
                        tol = max(tol, 2 * dense_error)  # no worse than the dense backend in the same dtype
                    if backend == "dense":
                        dense_error = err
                    fell_back = [str(w.message) for w in caught if "instead" in str(w.message)]
                    if backend == "triton" and not fell_back and failure() is not None:
                        fell_back = [f"the Triton kernels failed earlier in this run ({failure()}); tiled instead"]
                    status = "pass" if err <= tol else "FAIL"
                    if fell_back and status == "pass":
                        status = "fallback"
                    note = fell_back[0] if fell_back else ""
                    row = Row(check.loss, backend, name, status, err, tol, 1e3 * seconds, note)
                rows.append(row)
                if report is not None:
                    report(row)
    return rows


HEADER = f"{'loss':<22}{'backend':<9}{'dtype':<10}{'status':<10}{'max error':>11}{'tolerance':>11}{'ms':>9}  note"


def format_row(row: Row) -> str:
    def num(x: Optional[float], fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    return (
        f"{row.loss:<22}{row.backend:<9}{row.dtype:<10}{row.status:<10}{num(row.error, '.2e'):>11}"
        f"{num(row.tolerance, '.0e'):>11}{num(row.ms, '.1f'):>9}  {row.note}"
    ).rstrip()
