"""Per-rank peak memory and time of triplet_loss across gloo processes on one machine,
strategy "ring" against "all_gather": B rows per rank, D wide, C classes, each rank's
peak resident memory during its first forward + backward beyond what it held before
(its rows, its labels).

    python scripts/triplet_ring_memory.py 8192 128 64 2 semi-hard
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flashcl
from flashcl.tools.procmem import reset_peak, status_mb


def _worker(rank: int, world: int, path: str, b: int, d: int, c: int, mining: str, strategy: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(b, d, generator=g).requires_grad_(True)
    labels = torch.randint(0, c, (b,), generator=g)
    dist.barrier()
    base = reset_peak()
    start = time.perf_counter()
    loss = flashcl.triplet_loss(
        x, labels, margin=0.2, mining=mining, process_group=dist.group.WORLD, strategy=strategy, grad_scale="sum"
    )
    loss.backward()
    seconds = time.perf_counter() - start
    peak = status_mb("VmHWM") - base
    with open(f"{out}.{rank}", "w") as f:
        f.write(f"{peak:.0f} {seconds:.1f} {float(loss.detach()):.6f}")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    b, d, c, world = (int(v) for v in sys.argv[1:5])
    mining = sys.argv[5] if len(sys.argv) > 5 else "all"
    for strategy in ("all_gather", "ring"):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result")
            args = (world, os.path.join(tmp, "rendezvous"), b, d, c, mining, strategy, out)
            mp.start_processes(_worker, args=args, nprocs=world, start_method="spawn")
            rows = [open(f"{out}.{r}").read().split() for r in range(world)]
        peaks = ", ".join(f"{r[0]} MB" for r in rows)
        print(
            f"{strategy:<10} {mining}: B = {b} per rank x {world}, D = {d}, {c} classes: peak beyond the inputs "
            f"{peaks}; {max(float(r[1]) for r in rows):.1f} s; loss share of rank 0 {rows[0][2]}"
        )


if __name__ == "__main__":
    main()
