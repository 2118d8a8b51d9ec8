"""Losses across processes launched as users launch multi-machine jobs, checked
against one process on the concatenated batch (float64): run under torchrun, e.g.
two launchers standing in for two machines of two processes each:

    torchrun --nnodes 2 --nproc_per_node 2 --node_rank 0 --rdzv_backend c10d \\
        --rdzv_endpoint 127.0.0.1:29531 scripts/torchrun_check.py &
    torchrun --nnodes 2 --nproc_per_node 2 --node_rank 1 --rdzv_backend c10d \\
        --rdzv_endpoint 127.0.0.1:29531 scripts/torchrun_check.py

Every rank prints one line per case (rank, case, strategy, the largest error of the
value and of its rows' gradient) and exits with status 1 if any case differs.
The ranks' batches are uneven (rank r holds 3 + 2 r rows)."""

from __future__ import annotations

import gc
import sys
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist

import flashcl

TOL = 1e-9


def _batch(world: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, List[int]]:
    sizes = [3 + 2 * r for r in range(world)]
    g = torch.Generator().manual_seed(world)
    n = sum(sizes)
    return (
        torch.randn(n, 8, dtype=torch.float64, generator=g),
        torch.randn(n, 8, dtype=torch.float64, generator=g),
        torch.randint(0, 3, (n,), generator=g),
        sizes,
    )


def _cases() -> Dict[str, Callable[..., torch.Tensor]]:
    """name -> loss(x, y, labels, **kw): every case a loss of the whole batch."""
    cases: Dict[str, Callable[..., torch.Tensor]] = {
        "supcon": lambda x, y, lab, **kw: flashcl.supcon_loss(x, lab, temperature=0.2, **kw),
        "info_nce": lambda x, y, lab, **kw: flashcl.info_nce_loss(x, y, temperature=0.1, **kw),
        "clip": lambda x, y, lab, **kw: flashcl.clip_loss(x, y, 10.0, **kw),
        "siglip": lambda x, y, lab, **kw: flashcl.siglip_loss(x, y, 5.0, -2.0, **kw),
    }
    for mining in ("all", "hard", "semi-hard"):
        cases[f"triplet {mining}"] = lambda x, y, lab, m=mining, **kw: flashcl.triplet_loss(
            x, lab, margin=0.5, mining=m, **kw
        )
    cases["multi-similarity"] = lambda x, y, lab, **kw: flashcl.multi_similarity_loss(x, lab, **kw)
    cases["circle"] = lambda x, y, lab, **kw: flashcl.circle_loss(x, lab, **kw)
    cases["flex, mined"] = lambda x, y, lab, **kw: flashcl.flex_loss(
        x,
        rows={"y": lab},
        positive=lambda a, b: a.y == b.y,
        exclude=lambda a, b, s: torch.where(a.y == b.y, s >= a.hardest_negative + 0.1, s <= a.hardest_positive - 0.1),
        kind="multi_similarity",
        temperature=1.0,
        **kw,
    )
    return cases


def _ddp_step(x: torch.Tensor, labels: torch.Tensor, rows: slice, rank: int, world: int) -> int:
    """A DDP step: the encoder's gradient, DDP-averaged, equals one process's (1 if not)."""
    torch.manual_seed(0)
    encoder = torch.nn.Linear(8, 8).double()
    reference = [p.detach().clone() for p in encoder.parameters()]
    flashcl.supcon_loss(encoder(x), labels, temperature=0.2).backward()
    want: Any = [p.grad.clone() for p in encoder.parameters()]
    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8).double())
    assert all(torch.equal(a, b) for a, b in zip(ddp.parameters(), reference))
    flashcl.supcon_loss(ddp(x[rows]), labels[rows], temperature=0.2, process_group=dist.group.WORLD).backward()
    err = max(float((p.grad - w).abs().max()) for p, w in zip(ddp.parameters(), want))
    print(
        f"rank {rank}/{world} {'DDP step (supcon)':<18} {'all_gather':<10} max error {err:.1e} "
        f"{'ok' if err <= TOL else 'DIFFERS'}",
        flush=True,
    )
    return int(err > TOL)


def main() -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y, labels, sizes = _batch(world)
    rows = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    failed = 0
    for name, loss in _cases().items():
        whole = [x.clone().requires_grad_(True), y.clone().requires_grad_(True)]
        want = loss(*whole, labels, backend="reference")
        want_grads = torch.autograd.grad(want, whole, allow_unused=True)
        for strategy in ("all_gather", "ring"):
            mine = [x[rows].clone().requires_grad_(True), y[rows].clone().requires_grad_(True)]
            got = loss(*mine, labels[rows], process_group=dist.group.WORLD, strategy=strategy, grad_scale="sum")
            grads = torch.autograd.grad(got, mine, allow_unused=True)
            total = got.detach().clone()
            dist.all_reduce(total)  # the ranks' shares add up to the loss
            err = abs(float(total) - float(want))
            for a, e in zip(grads, want_grads):
                if e is not None:
                    err = max(err, float((torch.zeros_like(e[rows]) if a is None else a - e[rows]).abs().max()))
            ok = err <= TOL * max(1.0, abs(float(want)))
            failed += not ok
            verdict = "ok" if ok else "DIFFERS"
            print(f"rank {rank}/{world} {name:<18} {strategy:<10} max error {err:.1e} {verdict}", flush=True)
    failed += _ddp_step(x, labels, rows, rank, world)
    # the DDP module is gone before the group is (its reducer holds the group: freed later,
    # while a peer's last barrier is still being torn down, the two threads deadlocked)
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
