"""Runs one workload in this (fresh) process and prints one JSON line:
time of the first call and the best of the repeats; the peak resident memory
of the first call above what was resident before it (``peak_mb``: includes
one-time costs such as MKL's GEMM workspace, ~15 MB at B = 8192), and of the
last repeat above what was resident before it (``steady_peak_mb``: what a
training step adds once the process is warm; memory the allocator kept from
the earlier calls is reused and not counted again)."""
from __future__ import annotations

import json
import resource
import sys
import time

import torch


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def main() -> None:
    spec = json.loads(sys.argv[1])
    from .workloads import WORKLOADS

    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    step, grad_bytes = WORKLOADS[spec["workload"]](spec["params"])
    if spec.get("mem_limit_mb"):
        in_use = _status_kb("VmSize") * 1024
        limit = in_use + int(spec["mem_limit_mb"]) * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current resident size
    before = _status_kb("VmRSS")
    try:
        t0 = time.perf_counter()
        loss = step()
        first = time.perf_counter() - t0
        peak = _status_kb("VmHWM") - before
        times = [first]
        steady = None
        # The bound (e.g. the GEMMs the loss cannot avoid) is timed in this same
        # process, alternating with the case, so that both see the same machine.
        bound_step = None
        if spec.get("bound"):
            bound_step, _ = WORKLOADS[spec["bound"]["workload"]](spec["bound"]["params"])
            bound_step()
        bound_times = []
        for _ in range(int(spec.get("repeats", 1))):
            if bound_step is not None:
                t0 = time.perf_counter()
                bound_step()
                bound_times.append(time.perf_counter() - t0)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            before_repeat = _status_kb("VmRSS")
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
            steady = (_status_kb("VmHWM") - before_repeat) / 1024
    except (MemoryError, RuntimeError) as e:  # RuntimeError: torch's "can't allocate memory"
        if "memory" not in str(e).lower() and not isinstance(e, MemoryError):
            raise
        print(json.dumps({"status": "oom", "error": str(e)[:300]}))
        return
    out = {"status": "ok", "loss": loss, "first_s": first, "time_s": min(times),
           "peak_mb": peak / 1024, "steady_peak_mb": steady, "grad_mb": grad_bytes / 2**20}
    if bound_times:
        out["bound_s"] = min(bound_times)
        out["ratio"] = out["time_s"] / out["bound_s"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
