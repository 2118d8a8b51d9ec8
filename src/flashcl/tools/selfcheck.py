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

import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..checks import Example
from ..triton import failure

__all__ = ["Row", "examples", "TOLERANCE", "run_checks", "format_row", "HEADER"]

#: the largest error a row may have, relative to the reference's largest magnitude
TOLERANCE = {torch.float64: 1e-9, torch.float32: 2e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}
BACKENDS = ("dense", "tiled", "triton")


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


def examples() -> Dict[str, Callable[[torch.Generator], Example]]:
    """Every public loss's :class:`~flashcl.checks.Example` (its family module's
    ``EXAMPLES``), by name; a public loss without one is an error."""
    import flashcl

    out: Dict[str, Callable[[torch.Generator], Example]] = {}
    for name in flashcl.__all__:
        if name.endswith("_loss"):
            module = sys.modules[getattr(flashcl, name).__module__]
            make = getattr(module, "EXAMPLES", {}).get(name)
            if make is None:
                raise LookupError(f"{module.__name__} gives no EXAMPLES[{name!r}] for flashcl check")
            out[name] = make
    return out


def _each(fn: Callable[[Any], Any], v: Any) -> Any:
    """``fn`` on a keyword's tensors: each of a tuple, each value of a dict (a flex loss's
    per-sample data), else the value itself."""
    if isinstance(v, tuple):
        return tuple(fn(t) for t in v)
    if isinstance(v, dict):
        return {name: fn(t) for name, t in v.items()}
    return fn(v)


def _run(
    name: str, backend: str, dtype: torch.dtype, device: str, seed: int, rounded: Optional[torch.dtype] = None
) -> Tuple[Tensor, List[Tensor], float]:
    """(value, every leaf's gradient, forward + backward seconds of a warm call) of the
    loss ``name`` on its example; ``rounded``: the inputs first rounded to that dtype
    (the reference of a row in it)."""
    import flashcl

    fn = getattr(sys.modules[getattr(flashcl, name).__module__], name)  # looked up per call: a patched one counts
    example = examples()[name](torch.Generator().manual_seed(seed))
    args, kw = list(example.args), dict(example.kwargs)
    leaves = example.leaves
    if leaves is None:
        leaves = tuple(i for i, a in enumerate(args) if isinstance(a, Tensor) and a.is_floating_point())
    if rounded is not None:

        def as_given(x: Any) -> Any:
            return x.to(rounded).double() if isinstance(x, Tensor) and x.is_floating_point() else x

        args = [as_given(x) for x in args]
        kw = {k: _each(as_given, v) for k, v in kw.items()}

    def move(x: Any) -> Any:
        """A floating tensor to the device in the row's dtype, another to the device."""
        if not isinstance(x, Tensor):
            return x
        return x.to(device=device, dtype=dtype) if x.is_floating_point() else x.to(device)

    def once() -> Tuple[Tensor, List[Tensor]]:
        moved = [move(x) for x in args]  # labels to the device, a teacher's rows in the dtype
        for i in leaves:
            moved[i].requires_grad_(True)
        extra = {k: _each(move, v) for k, v in kw.items()}
        value = fn(*moved, backend=backend, **extra)
        grads = torch.autograd.grad(value, [moved[i] for i in leaves])
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
    every = list(examples())
    chosen = [name for name in every if losses is None or name in losses]
    unknown = set(losses or ()) - set(every)
    if unknown:
        raise ValueError(f"unknown loss(es) {sorted(unknown)}: choose from {every}")
    rows: List[Row] = []
    for name in chosen:
        for dtype in dtypes:
            value, grads, _ = _run(name, "reference", torch.float64, "cpu", seed, rounded=dtype)
            want = (value, grads)
            dense_error: Optional[float] = None
            for backend in backends:
                dname = str(dtype).replace("torch.", "")
                try:
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        v, g, seconds = _run(name, backend, dtype, device, seed)
                except (ValueError, TypeError) as e:  # the backend is refused for this loss or device
                    row = Row(name, backend, dname, "n/a", note=_why_not(e))
                except Exception as e:  # noqa: BLE001 - a crash is a row of the table, not the end of it
                    row = Row(name, backend, dname, "error", note=f"{type(e).__name__}: {_why_not(e)}")
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
                    row = Row(name, backend, dname, status, err, tol, 1e3 * seconds, note)
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
