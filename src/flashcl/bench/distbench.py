"""The ``dist`` suite: flashcl.distributed across processes on one machine (gloo
on 127.0.0.1), per-rank time and peak memory for the all_gather and ring strategies."""

from __future__ import annotations

import datetime
import json
import os
import tempfile
import time
from typing import Any, Callable, Dict, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..tools.procmem import reset_peak, status_mb


def _rank_main(rank: int, world: int, params: Dict[str, Any], out_dir: str) -> None:
    import flashcl

    # rendezvous through a file: no port to pick, so no race for one
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(out_dir, 'rendezvous')}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=3600),  # a rank of the 10M-class margin suite computes for minutes
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    b, d = params["B"], params["D"]
    g = torch.Generator().manual_seed(rank)
    if params.get("loss") == "margin":
        step, local, grad_bytes = _margin_step(rank, world, params, g)
    else:
        local = b // world + (1 if rank < b % world else 0)
        emb = torch.randn(local, d, generator=g).requires_grad_(True)
        labels = torch.randint(0, 5, (local,), generator=g)
        grad_bytes = local * d * 4

        def step() -> float:
            emb.grad = None
            loss = flashcl.supcon_loss(emb, labels, process_group=dist.group.WORLD, strategy=params["strategy"])
            loss.backward()
            return float(loss.detach())

    dist.barrier()
    base = reset_peak()
    t0 = time.perf_counter()
    loss = step()
    first = time.perf_counter() - t0
    peak = (status_mb("VmHWM") or 0.0) - (base or 0.0)
    times = []
    for _ in range(int(params.get("repeats", 1))):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(
            {
                "loss": loss,
                "first_s": first,
                "time_s": min(times or [first]),
                "peak_mb": peak,
                "grad_mb": grad_bytes / 2**20,
                "local": local,
            },
            f,
        )
    dist.barrier()  # every rank leaves the group together (a gloo rank leaving early can abort at exit)
    dist.destroy_process_group()


def _margin_step(
    rank: int, world: int, params: Dict[str, Any], g: torch.Generator
) -> Tuple[Callable[[], float], int, int]:
    """ArcFace over ``C`` classes with ``B`` embeddings per rank: ``impl`` ``sharded``
    (each rank holds its slice of the classes, ``shard_classes=True``) or
    ``replicated`` (each rank holds all of W, as a DDP parameter). Returns the step,
    the local batch and the bytes of what the step must hold anyway beyond the
    weights: the weights' gradient and the embeddings'."""
    import flashcl

    b, d, c = params["B"], params["D"], params["C"]
    sharded = params["impl"] == "sharded"
    mine = c // world + (1 if rank < c % world else 0) if sharded else c
    # replicated: the same W on every rank, as a DDP parameter holds it
    w = torch.randn(mine, d, generator=g if sharded else torch.Generator().manual_seed(12345)).requires_grad_(True)
    emb = torch.randn(b, d, generator=g).requires_grad_(True)
    labels = torch.randint(0, c, (b,), generator=g)

    def step() -> float:
        emb.grad = w.grad = None
        loss = flashcl.arcface_loss(emb, labels, w, shard_classes=sharded, process_group=dist.group.WORLD)
        loss.backward()
        return float(loss.detach())

    return step, b, (w.numel() + emb.numel()) * 4


def measure_dist(params: Dict[str, Any], cap_s: float) -> Dict[str, Any]:
    """Runs ``params["world"]`` processes; returns the slowest rank's time, the
    largest per-rank peak, and every rank's figures (``per_rank``)."""
    world = int(params["world"])
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(
            _rank_main, args=(world, params, out_dir), nprocs=world, join=False, start_method="spawn"
        )
        deadline = time.monotonic() + cap_s
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    for proc in ctx.processes:
                        proc.kill()
                    return {"status": "capped", "cap_s": cap_s}
        except mp.ProcessRaisedException as e:
            status = "oom" if "memory" in str(e).lower() else "error"
            return {"status": status, "error": str(e).strip().splitlines()[-1][:300]}
        except mp.ProcessExitedException as e:
            # killed by a signal (the kernel's out-of-memory killer sends SIGKILL): out of memory
            status = "oom" if e.signal_name == "SIGKILL" else "error"
            return {"status": status, "error": str(e)[:300]}
        ranks = []
        for r in range(world):
            with open(os.path.join(out_dir, f"{r}.json")) as f:
                ranks.append(json.load(f))
    slowest = max(ranks, key=lambda x: x["time_s"])
    return {
        "status": "ok",
        "loss": sum(x["loss"] for x in ranks) / world,
        "first_s": slowest["first_s"],
        "time_s": slowest["time_s"],
        "fwd_s": slowest["time_s"],
        "bwd_s": 0.0,
        "peak_mb": max(x["peak_mb"] for x in ranks),
        "grad_mb": max(x["grad_mb"] for x in ranks),
        "steady_peak_mb": None,
        "per_rank": ranks,
    }
