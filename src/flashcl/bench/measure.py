"""Runs a workload in a child process, with a time cap and an optional memory limit."""
from __future__ import annotations

import json
import subprocess
import sys
from typing import Any, Dict, Optional


def measure(workload: str, params: Dict[str, Any], *, repeats: int = 2, cap_s: float = 600.0,
            mem_limit_mb: Optional[int] = None, threads: Optional[int] = None,
            bound: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Returns the child's figures, or ``{"status": "capped"}`` past ``cap_s``,
    ``{"status": "oom"}`` past the memory limit, ``{"status": "error"}`` otherwise.
    ``bound`` (``{"workload", "params"}``) is timed in the same child, alternating
    with the case, and ``ratio`` = best case time / best bound time."""
    spec = {"workload": workload, "params": params, "repeats": repeats, "mem_limit_mb": mem_limit_mb,
            "threads": threads, "bound": bound}
    try:
        proc = subprocess.run([sys.executable, "-m", "flashcl.bench.child", json.dumps(spec)],
                              capture_output=True, text=True, timeout=cap_s)
    except subprocess.TimeoutExpired:
        return {"status": "capped", "cap_s": cap_s}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""]
        if proc.returncode < 0 or "memory" in tail[0].lower():
            return {"status": "oom", "error": tail[0][:300]}
        return {"status": "error", "error": tail[0][:300]}
    return json.loads(lines[-1])
