"""Runs one case in a child process, with a time cap and an optional memory limit.

Children come from a fork server that has imported torch and flashcl but run
no torch compute: each case gets a fresh address space without paying torch's
import again, and no OpenMP/MKL thread pool is forked mid-use (forking the
caller itself hangs the child when the caller has already computed with torch,
as a test session has).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
from typing import Any, Dict, Optional


def _target(spec: Dict[str, Any], conn: Any) -> None:
    from .child import run_spec

    try:
        conn.send(json.dumps(run_spec(spec, ready=lambda: conn.send(_READY))))
    except BaseException as e:  # report, never hang the parent
        conn.send(json.dumps({"status": "error", "error": f"{type(e).__name__}: {str(e)[:300]}"}))
    finally:
        conn.close()


_CTX: Optional[Any] = None
# the child's word that its set-up (imports, inputs) is done and the timed calls begin
_READY = '{"status": "ready"}'
# a case's set-up (a peer's import on a slow disk, its inputs) is not its time: it has
# this long of its own before the cap starts
SETUP_S = 300.0


def _context() -> Any:
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "flashcl", "flashcl.bench.child", "flashcl.bench.workloads"])
    return _CTX


def measure(
    workload: str,
    params: Dict[str, Any],
    *,
    repeats: int = 2,
    cap_s: float = 600.0,
    mem_limit_mb: Optional[int] = None,
    threads: Optional[int] = None,
    bound: Optional[Dict[str, Any]] = None,
) -> Dict[str, Any]:
    """Figures of one case (see :mod:`flashcl.bench.child`), or ``{"status":
    "capped"}`` when its timed calls run past ``cap_s`` (counted from the end of its
    set-up: the child's start, its imports and its inputs have ``SETUP_S`` of their
    own), ``"oom"`` past the memory limit (or when the child is killed),
    ``"not installed"``, ``"error"``. ``bound`` (``{"workload", "params"}``) is timed
    alternately with the case in the same child; then ``ratio`` = best case time / best
    bound time."""
    spec = {
        "workload": workload,
        "params": params,
        "repeats": repeats,
        "mem_limit_mb": mem_limit_mb,
        "threads": threads,
        "bound": bound,
    }
    ctx = _context()
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_target, args=(spec, child), daemon=True)
    proc.start()
    child.close()
    result: Optional[str] = None
    answered = False
    # poll is also True when the child died: recv then raises EOFError
    phase = "set-up"
    for limit in (max(SETUP_S, cap_s), cap_s):
        answered = parent.poll(limit)
        if not answered:
            break
        phase = "timed calls"
        try:
            result = parent.recv()
        except EOFError:
            result = None
        if result != _READY:
            break
    if proc.is_alive():
        proc.join(5 if answered else 0)
    if proc.is_alive():
        os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    if not answered:
        return {"status": "capped", "cap_s": cap_s, "error": f"stopped in its {phase}"}
    if result is None:  # died without a word: the kernel's OOM killer, or a crash
        status = "oom" if proc.exitcode == -signal.SIGKILL else "error"
        return {"status": status, "error": f"child exited with {proc.exitcode}"}
    return json.loads(result)
