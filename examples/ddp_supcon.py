"""Train a tiny encoder with SupCon across processes: DistributedDataParallel +
flashcl.distributed (gloo on CPU, NCCL on GPUs).

    python examples/ddp_supcon.py                  # spawns 2 local processes itself
    torchrun --nproc_per_node 2 examples/ddp_supcon.py

Each process draws its own shard of a synthetic labelled data set (Gaussian
clusters in 32-D), embeds it with a small MLP wrapped in DDP, and computes the
SupCon loss over the global batch (positives and negatives from every rank).
With ``grad_scale="ddp"`` DDP's gradient averaging gives exactly the gradient
of the loss over the concatenated batch. Rank 0 prints the loss and, at the
end, the k-NN accuracy of the embedding on held-out points.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import flashcl


def make_data(n: int, classes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, 32, generator=torch.Generator().manual_seed(1234)) * 2.0
    labels = torch.randint(0, classes, (n,), generator=g)
    return centres[labels] + torch.randn(n, 32, generator=g) * 4.0, labels


def knn_accuracy(train_x: torch.Tensor, train_y: torch.Tensor, test_x: torch.Tensor, test_y: torch.Tensor) -> float:
    sims = nn.functional.normalize(test_x, dim=1) @ nn.functional.normalize(train_x, dim=1).T
    pred = train_y[sims.topk(5, dim=1).indices].mode(dim=1).values
    return float((pred == test_y).float().mean())


def train(rank: int, world: int, args: argparse.Namespace) -> None:
    if not dist.is_initialized():
        # rendezvous through a file: no free port to pick, so no race for one
        dist.init_process_group(
            "gloo",
            init_method=f"file://{args.rendezvous}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=120),
        )
    torch.manual_seed(0)  # the same initial weights on every rank
    torch.set_num_threads(1)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16)))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(args.steps):
        # uneven shards on purpose: rank r draws batch + 8 r samples
        x, y = make_data(args.batch + 8 * rank, 10, seed=1000 * step + rank)
        loss = flashcl.supcon_loss(model(x), y, temperature=0.2, process_group=dist.group.WORLD, strategy=args.strategy)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % max(1, args.steps // 10) == 0 or step == args.steps - 1:
            # each rank returned world x its share: the mean over ranks is the global loss
            total = loss.detach().clone()
            dist.all_reduce(total)
            if rank == 0:
                print(f"step {step:4d}  global loss {float(total) / world:.4f}", flush=True)
    if rank == 0:
        with torch.no_grad():
            tx, ty = make_data(2000, 10, seed=-1 % 2**31)
            qx, qy = make_data(1000, 10, seed=-2 % 2**31)
            raw = knn_accuracy(tx, ty, qx, qy)
            learned = knn_accuracy(model(tx), ty, model(qx), qy)
        print(f"k-NN accuracy on held-out points: raw inputs {raw:.3f}, learned embedding {learned:.3f}", flush=True)
    # The DDP module holds the process group: free it before tearing the group down, on
    # every rank together. A gloo group whose last reference goes during interpreter
    # shutdown can abort the process ("terminate called without an active exception").
    del model, opt
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2, help="processes to spawn when not under torchrun")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=128, help="per-rank batch (rank r adds 8 r)")
    p.add_argument("--strategy", choices=["all_gather", "ring"], default="all_gather")
    args = p.parse_args()
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
        train(dist.get_rank(), dist.get_world_size(), args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        args.rendezvous = os.path.join(tmp, "rendezvous")
        mp.spawn(train, args=(args.world, args), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
