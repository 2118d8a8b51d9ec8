"""Runs one workload in this (fresh) process and prints one JSON line.

Figures: time of the first call, the best forward+backward time of the repeats
and its forward part; the peak memory of the first call above what was in use
before it (``peak_mb``: on the CPU resident memory, which includes one-time
costs such as MKL's GEMM workspace, ~15 MB at B = 8192; on CUDA the caching
allocator's peak), and of the last repeat above what was in use before it
(``steady_peak_mb``: what a training step adds once the process is warm).
With a ``bound``, the bound is timed alternately with the case in this same
process and ``ratio`` = best case time / best bound time.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from ..tools.procmem import reset_peak, status_mb


class _Memory:
    """Peak memory above a baseline: resident memory on the CPU, the caching
    allocator's peak on CUDA."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")

    def reset(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            return torch.cuda.memory_allocated() / 2**20
        return reset_peak() or 0.0

    def peak(self) -> float:
        if self.cuda:
            return torch.cuda.max_memory_allocated() / 2**20
        return status_mb("VmHWM") or 0.0


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, MemoryError) or "memory" in str(e).lower()


def run_spec(spec: Dict[str, Any], ready: Optional[Callable[[], None]] = None) -> Dict[str, Any]:
    """Runs the case described by ``spec`` (see :func:`flashcl.bench.measure.measure`).
    ``ready`` is called once the case is set up (its imports done, its inputs built),
    right before its first timed call: the parent's time cap counts from there."""
    from . import flex, late, ssl
    from .workloads import WORKLOADS as CORE
    from .workloads import NotInstalled

    WORKLOADS = {**CORE, **late.WORKLOADS, **ssl.WORKLOADS, **flex.WORKLOADS}

    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    params = spec["params"]
    mem = _Memory(params.get("device", "cpu"))
    try:
        step, grad_bytes = WORKLOADS[spec["workload"]](params)
    except NotInstalled as e:
        return {"status": "not installed", "error": str(e)[:300]}
    if ready is not None:
        ready()
    if spec.get("mem_limit_mb") and not mem.cuda:
        in_use = int((status_mb("VmSize") or 0.0) * 2**20)
        resource.setrlimit(resource.RLIMIT_AS, (in_use + int(spec["mem_limit_mb"]) * 2**20, resource.RLIM_INFINITY))
    try:
        before = mem.reset()
        t0 = time.perf_counter()
        loss, fwd = step()
        first = time.perf_counter() - t0
        peak = mem.peak() - before
        times = [(first, fwd)]
        steady: Optional[float] = None
        bound_step: Optional[Callable[[], Tuple[float, float]]] = None
        if spec.get("bound"):
            bound_step, _ = WORKLOADS[spec["bound"]["workload"]](spec["bound"]["params"])
            bound_step()
        bound_times = []
        for _ in range(int(spec.get("repeats", 1))):
            if bound_step is not None:
                t0 = time.perf_counter()
                bound_step()
                bound_times.append(time.perf_counter() - t0)
            base = mem.reset()
            t0 = time.perf_counter()
            _, fwd = step()
            times.append((time.perf_counter() - t0, fwd))
            steady = mem.peak() - base
    except (MemoryError, RuntimeError) as e:
        if not _is_oom(e):
            raise
        return {"status": "oom", "error": str(e)[:300]}
    best, best_fwd = min(times)
    out: Dict[str, Any] = {
        "status": "ok",
        "loss": loss,
        "first_s": first,
        "time_s": best,
        "fwd_s": best_fwd,
        "bwd_s": best - best_fwd,
        "peak_mb": peak,
        "steady_peak_mb": steady,
        "grad_mb": grad_bytes / 2**20,
    }
    if bound_times:
        out["bound_s"] = min(bound_times)
        out["ratio"] = best / min(bound_times)
    return out


if __name__ == "__main__":
    print(json.dumps(run_spec(json.loads(sys.argv[1]))))
