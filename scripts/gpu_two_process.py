"""Two processes sharing one CUDA GPU (gloo), for the losses whose across-process path
takes the Triton kernels (``backend="auto"``): each rank's value and gradient against
one process on the concatenated batch, and the per-rank time of a forward + backward
beside one process's on the whole batch (a development tool: one GPU cannot show
several GPUs' speed; this checks the gathered path on real kernels).

    python scripts/gpu_two_process.py --out rows.jsonl

Prints one JSON row per case (and appends it to ``--out``); exit status 1 if a case
differs. Uneven shards (the ranks hold 3/8 and 5/8 of the batch)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flashcl

Loss = Callable[..., torch.Tensor]

CASES: Dict[str, Loss] = {
    "supcon": lambda x, y, lab, **kw: flashcl.supcon_loss(x, lab, temperature=0.1, **kw),
    "info_nce": lambda x, y, lab, **kw: flashcl.info_nce_loss(x, y, temperature=0.05, **kw),
    "clip": lambda x, y, lab, **kw: flashcl.clip_loss(x, y, 14.0, **kw),
    "nt_xent": lambda x, y, lab, **kw: flashcl.nt_xent_loss(x, y, temperature=0.1, **kw),
}
#: (B, D, dtype, tolerance relative to the value's and the gradient's largest magnitude)
SHAPES = [(2048, 256, torch.float32, 2e-4), (32768, 768, torch.bfloat16, 2e-2)]


def _data(b: int, d: int, dtype: torch.dtype) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(b + d)
    x = torch.randn(b, d, generator=g).to("cuda", dtype)
    y = torch.randn(b, d, generator=g).to("cuda", dtype)
    labels = torch.randint(0, max(2, b // 4), (b,), generator=g).cuda()
    return [x, y, labels]


def _step(fn: Loss, x: torch.Tensor, y: torch.Tensor, lab: torch.Tensor, **kw: Any) -> Any:
    leaves = [x.detach().clone().requires_grad_(True), y.detach().clone().requires_grad_(True)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    loss = fn(*leaves, lab, **kw)
    grads = torch.autograd.grad(loss.float(), leaves, allow_unused=True)
    torch.cuda.synchronize()
    return loss.detach().float(), grads, time.perf_counter() - t0


def _split(b: int) -> List[int]:
    first = 3 * b // 8
    return [first, b - first]


def _worker(rank: int, world: int, rendezvous: str, out: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{rendezvous}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    torch.cuda.set_device(0)
    rows: List[Dict[str, Any]] = []
    for b, d, dtype, _ in SHAPES:
        x, y, lab = _data(b, d, dtype)
        sizes = _split(b)
        lo = sum(sizes[:rank])
        part = slice(lo, lo + sizes[rank])
        for name, fn in CASES.items():
            row: Dict[str, Any] = {"case": name, "B": b, "D": d, "dtype": str(dtype).split(".")[-1], "rank": rank}
            try:
                kw = {"process_group": dist.group.WORLD, "grad_scale": "sum"}
                _step(fn, x[part], y[part], lab[part], **kw)  # warm-up: compilation, autotuning
                dist.barrier()
                value, grads, secs = _step(fn, x[part], y[part], lab[part], **kw)
                total = value.clone()
                dist.all_reduce(total)
                row.update(value=float(total), rank_s=secs, grads=[None if g is None else g.cpu() for g in grads])
            except Exception as e:  # reported, the other cases go on
                row.update(error=f"{type(e).__name__}: {str(e)[:300]}")
            rows.append(row)
    torch.save(rows, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="append the JSON rows to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    world = 2
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _worker, args=(world, os.path.join(tmp, "rendezvous"), tmp), nprocs=world, start_method="spawn"
        )
        ranks = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(world)]
    for i, (b, d, dtype, tol) in enumerate(SHAPES):
        x, y, lab = _data(b, d, dtype)
        sizes = _split(b)
        for j, fn in enumerate(CASES.values()):
            got = [r[i * len(CASES) + j] for r in ranks]
            row: Dict[str, Any] = {k: got[0][k] for k in ("case", "B", "D", "dtype")}
            row["world"] = world
            errors = [g["error"] for g in got if "error" in g]
            if errors:
                row.update(status="error", error=errors[0])
                failed += 1
            else:
                _step(fn, x, y, lab)  # warm-up
                want, want_grads, one_s = _step(fn, x, y, lab)
                err = abs(got[0]["value"] - float(want)) / max(1.0, abs(float(want)))
                for k, w in enumerate(want_grads):
                    if w is None:
                        continue
                    scale = float(w.abs().max()) or 1.0
                    for r in range(world):
                        lo = sum(sizes[:r])
                        mine = got[r]["grads"][k]
                        part = w[lo : lo + sizes[r]].float().cpu()
                        diff = part if mine is None else (mine.float() - part)
                        err = max(err, float(diff.abs().max()) / scale)
                ok = err <= tol
                failed += not ok
                row.update(
                    status="ok" if ok else "DIFFERS",
                    max_rel_error=err,
                    tolerance=tol,
                    one_process_s=one_s,
                    rank_s=[g["rank_s"] for g in got],
                    shards=sizes,
                )
            line = json.dumps(row)
            print(line, flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(line + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
