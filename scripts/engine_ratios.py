"""SupCon, CLIP and InfoNCE on the tiled backend (D = 768) and the sampled-neighbours loss
(n = 20,000, k = 2), forward + backward, float32, the best of 5, each timed alternately in
this process with what it is compared to: the three GEMMs every exact loss over B x D
embeddings makes (S = E E^T, G E, G^T E into preallocated outputs) and, for InfoNCE, torch's
chunked ``F.linear_cross_entropy`` too. Public calls only, so that two trees compare side by
side, one process each, alternately:

    PYTHONPATH=/path/to/other/tree/src python scripts/engine_ratios.py 8192
    python scripts/engine_ratios.py 8192

``--freed``: a 24 MB tensor is freed before timing, as a training step frees its
activations. On glibc the freed mapping raises the threshold under which the allocator
serves blocks from its heap, so that the losses' block buffers (a few MB) stop costing page
faults at every call: without it, a process that runs a loss alone measures those faults.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, List, Optional

import torch
import torch.nn.functional as F

import flashcl

D = 768


def best(f: Callable[[], None], other: Optional[Callable[[], None]], repeats: int = 5) -> str:
    f()
    if other is not None:
        other()
    mine: List[float] = []
    theirs: List[float] = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        mine.append(time.perf_counter() - t0)
        if other is not None:
            t0 = time.perf_counter()
            other()
            theirs.append(time.perf_counter() - t0)
    if other is None:
        return f"{min(mine):.3f} s"
    return f"{min(mine):.3f} s / {min(theirs):.3f} s = {min(mine) / min(theirs):.2f}x"


def main() -> None:
    b = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 8192
    g = torch.Generator().manual_seed(0)
    e = torch.randn(b, D, generator=g)
    s, grad = torch.empty(b, b), torch.rand(b, b, generator=g)
    o1, o2 = torch.empty(b, D), torch.empty(b, D)

    def gemm3() -> None:
        torch.mm(e, e.T, out=s)
        torch.mm(grad, e, out=o1)
        torch.mm(grad.T, e, out=o2)

    labels = torch.randint(0, 5, (b,), generator=g)
    a, k = torch.randn(b, D, generator=g), torch.randn(b, D, generator=g)
    target = torch.arange(b)

    def supcon() -> None:
        flashcl.supcon_loss(e.clone().requires_grad_(True), labels, temperature=0.1, backend="tiled").backward()

    def clip() -> None:
        x, y = a.clone().requires_grad_(True), k.clone().requires_grad_(True)
        flashcl.clip_loss(x, y, logit_scale=1 / 0.07, backend="tiled").backward()

    def info_nce() -> None:
        x, y = a.clone().requires_grad_(True), k.clone().requires_grad_(True)
        flashcl.info_nce_loss(x, y, temperature=0.05, backend="tiled").backward()

    def chunked_ce() -> None:
        x, y = a.clone().requires_grad_(True), k.clone().requires_grad_(True)
        opts = torch.nn.LinearCrossEntropyOptions()
        F.linear_cross_entropy(F.normalize(x, dim=1) / 0.05, F.normalize(y, dim=1), target, options=opts).backward()

    n = 20000
    scores = torch.randn(n, n, generator=g).requires_grad_(True)
    neighbors = flashcl.sample_neighbors(n, 2)

    def neighbor() -> None:
        scores.grad = None
        flashcl.neighbor_loss(scores, neighbors, backend="tiled").backward()

    if "--freed" in sys.argv:
        freed = torch.ones(3 << 20, dtype=torch.float64)
        del freed
    print(
        f"B = {b:,}, D = {D}: SupCon {best(supcon, gemm3)} (the three GEMMs); CLIP {best(clip, gemm3)}; "
        f"InfoNCE {best(info_nce, chunked_ce)} (F.linear_cross_entropy, chunked), {best(info_nce, gemm3)} "
        f"(the three GEMMs); neighbour loss, n = {n:,}: {best(neighbor, None)}"
    )


if __name__ == "__main__":
    main()
