"""The intra-op thread count of a CPU driver's block loops, chosen by measuring.

A driver's loop runs many short parallel regions (a GEMM and a few element-wise
passes per block). On a quiet machine every core serves each region; when another
process keeps a core busy (data-loader workers do), each region waits at its
barrier for a thread that the scheduler has set aside, and the loop can take
several times longer than on one thread (SupCon, B = 4096, D = 256 on 2 cores
with one busy process: 0.46-0.78 s on 2 threads, 0.30 s on one).

So the loops time their blocks: per kind of loop (a driver's forward or backward
pass) and thread count, a running estimate of the time per unit of work (score
entries); a loop uses one thread only when that estimate is clearly lower (under
0.8x: a quiet machine, where one thread takes about twice as long, never shows
it), else the process's thread count. The other setting is timed again on two
blocks of every :data:`PROBE_EVERY`-th loop, so that the choice follows the load
as it comes and goes. The first block of a loop (buffers, warm-up) is not timed.
The thread count is restored when the loop ends.
"""

from __future__ import annotations

import time
from typing import Callable, Dict, Iterator, Optional, Sequence, Tuple

import torch

__all__ = ["blocks", "MIN_BLOCKS", "PROBE_EVERY"]

#: blocks a loop needs before it times anything (block 0 warms up, then two probes)
MIN_BLOCKS = 6
#: every this many loops of a kind, two blocks run with the other thread count
PROBE_EVERY = 8
#: weight of the newest block in a running estimate
_NEW = 0.3


class _Estimates:
    def __init__(self) -> None:
        self.per_unit: Dict[int, float] = {}
        self.loops = 0

    def best(self, full: int) -> int:
        one, many = self.per_unit.get(1), self.per_unit.get(full)
        return 1 if one is not None and many is not None and one < 0.8 * many else full

    def add(self, threads: int, per_unit: float) -> None:
        old = self.per_unit.get(threads)
        self.per_unit[threads] = per_unit if old is None else (1 - _NEW) * old + _NEW * per_unit


_STATE: Dict[Tuple[str, int], _Estimates] = {}


def blocks(kind: str, starts: Sequence[int], work: Callable[[int], float], device_type: str) -> Iterator[int]:
    """Yields ``starts``, the loop's body running between two yields, with the
    thread count chosen as the module docstring says. ``kind`` names the loop
    (blocks of one kind cost alike per unit of work); ``work(start)``: the block's
    amount of work."""
    full = torch.get_num_threads()
    if device_type != "cpu" or full == 1 or len(starts) < MIN_BLOCKS:
        yield from starts
        return
    est = _STATE.setdefault((kind, full), _Estimates())
    est.loops += 1
    use = est.best(full)
    other = full if use == 1 else 1
    probe = other not in est.per_unit or est.loops % PROBE_EVERY == 0
    current: Optional[int] = None
    try:
        for i, start in enumerate(starts):
            threads = other if probe and i in (1, 2) else use
            if threads != current:
                torch.set_num_threads(threads)
                current = threads
            t0 = time.perf_counter()
            yield start
            if i > 0:
                est.add(threads, (time.perf_counter() - t0) / max(work(start), 1.0))
    finally:
        torch.set_num_threads(full)
