"""The metric-learning families against pytorch-metric-learning's own classes, float64:
the largest absolute difference of the loss and of the embeddings' (and proxies')
gradient, on each backend in one process, and on 2 and 3 gloo processes (uneven batches,
a rank with no rows of its own on 3; both strategies, ``grad_scale="sum"``: the ranks'
values summed and their gradient rows joined) against PML on the concatenated batch.

    python scripts/metric_equality.py            # from the project's root, its venv active
"""

from __future__ import annotations

import os
import pathlib
import sys
import tempfile
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from pytorch_metric_learning import losses, miners

import flashcl

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))
from helpers import close_group, init_gloo  # noqa: E402

F64 = torch.float64
B, D, C = 48, 12, 6
SIZES = {2: [29, 19], 3: [21, 0, 27]}
ALPHA, MARGIN = 32.0, 0.1


def data() -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, D, dtype=F64, generator=g)
    y = torch.randint(0, C, (B,), generator=g)
    proxies = torch.randn(C, D, dtype=F64, generator=g)
    return x, y, proxies


def pml(name: str, x: torch.Tensor, y: torch.Tensor, proxies: torch.Tensor) -> torch.Tensor:
    """PML's loss of the case (its proxies set to ``proxies``)."""
    if name == "Multi-Similarity + miner":
        return losses.MultiSimilarityLoss()(x, y, miners.MultiSimilarityMiner(0.1)(x, y))
    if name == "Multi-Similarity":
        return losses.MultiSimilarityLoss()(x, y)
    if name == "Circle":
        return losses.CircleLoss()(x, y)
    loss = losses.ProxyAnchorLoss(C, D, margin=MARGIN, alpha=ALPHA).double()
    del loss.proxies  # the proxies given (a leaf of the caller's), not a parameter of its own
    loss.proxies = proxies
    return loss(x, y)


def ours(name: str, x: torch.Tensor, y: torch.Tensor, proxies: torch.Tensor, **kw: Any) -> torch.Tensor:
    if name == "Multi-Similarity + miner":
        return flashcl.multi_similarity_loss(x, y, epsilon=0.1, **kw)
    if name == "Multi-Similarity":
        return flashcl.multi_similarity_loss(x, y, epsilon=None, **kw)
    if name == "Circle":
        return flashcl.circle_loss(x, y, **kw)
    return flashcl.proxy_anchor_loss(x, y, proxies, margin=MARGIN, alpha=ALPHA, **kw)


def flex(name: str, x: torch.Tensor, y: torch.Tensor, backend: str) -> torch.Tensor:
    """The same losses as flex calls (the two-set kinds; the miner an exclusion)."""
    mined = name.endswith("miner")

    def exclude(a: Any, b: Any, s: torch.Tensor) -> torch.Tensor:
        return torch.where(a.y == b.y, s >= a.hardest_negative + 0.1, s <= a.hardest_positive - 0.1)

    return flashcl.flex_loss(
        x,
        rows={"y": y},
        positive=lambda a, b: a.y == b.y,
        exclude=exclude if mined else None,
        kind="circle" if name == "Circle" else "multi_similarity",
        temperature=1.0,
        backend=backend,
    )


CASES = ["Multi-Similarity", "Multi-Similarity + miner", "Circle", "Proxy-Anchor"]


def grads(fn: Callable[..., torch.Tensor], leaves: List[torch.Tensor]) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    leaves = [t.detach().clone().requires_grad_(True) for t in leaves]
    value = fn(*leaves)
    got = torch.autograd.grad(value, leaves, allow_unused=True)
    return value.detach(), [torch.zeros_like(t) if g is None else g for g, t in zip(got, leaves)]


def gap(a: Tuple[torch.Tensor, List[torch.Tensor]], b: Tuple[torch.Tensor, List[torch.Tensor]]) -> float:
    return max([float((a[0] - b[0]).abs())] + [float((u - v).abs().max()) for u, v in zip(a[1], b[1])])


def worker(rank: int, world: int, out_dir: str) -> None:
    init_gloo(rank, world, out_dir)
    x, y, proxies = data()
    sizes = SIZES[world]
    mine = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    out: Dict[Any, Any] = {}
    for strategy in ("all_gather", "ring"):
        for name in CASES:
            kw = dict(process_group=dist.group.WORLD, strategy=strategy, grad_scale="sum")

            def call(v: torch.Tensor, p: torch.Tensor, name: str = name, kw: Dict[str, Any] = kw) -> torch.Tensor:
                return ours(name, v, y[mine], p, **kw)

            out[(strategy, name)] = grads(call, [x[mine], proxies])
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    close_group()


def main() -> None:
    x, y, proxies = data()
    print(
        "| case | " + " | ".join(["reference", "dense", "tiled", "flex (tiled)", "2 processes", "3 processes"]) + " |"
    )
    print("|---" * 7 + "|")
    across: Dict[int, Dict[Any, Any]] = {}
    for world in (2, 3):
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(worker, args=(world, tmp), nprocs=world, join=True)
            ranks = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(world)]
        across[world] = {
            key: (
                sum(r[key][0] for r in ranks),
                [torch.cat([r[key][1][0] for r in ranks]), sum(r[key][1][1] for r in ranks)],
            )
            for key in ranks[0]
        }
    for name in CASES:
        want = grads(lambda v, p, n=name: pml(n, v, y, p), [x, proxies])
        cells = []
        for backend in ("reference", "dense", "tiled"):
            cells.append(gap(grads(lambda v, p, n=name, bk=backend: ours(n, v, y, p, backend=bk), [x, proxies]), want))
        if name == "Proxy-Anchor":
            cells.append(float("nan"))
        else:
            cells.append(gap(grads(lambda v, p, n=name: flex(n, v, y, "tiled") + 0 * p.sum(), [x, proxies]), want))
        for world in (2, 3):
            cells.append(max(gap(across[world][(s, name)], want) for s in ("all_gather", "ring")))
        print(f"| {name} | " + " | ".join("n/a" if c != c else f"{c:.1e}" for c in cells) + " |")


if __name__ == "__main__":
    main()
