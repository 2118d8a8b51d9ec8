"""The pair-sum kind (pytorch-metric-learning's ContrastiveLoss written as flashcl.contrastive_loss)
on the tiled backend, float32, forward + backward, the best of 5, each timed alternately in this
process with the three GEMMs every exact loss over B x D embeddings makes, and with PML's own
ContrastiveLoss where it fits; then, in a fresh measure, the peak memory beyond the inputs and
their gradient (the process's one-time costs taken by a small call first):

    python scripts/pair_sum_ratio.py 8192 768          # the ratios
    python scripts/pair_sum_ratio.py 65536 512 memory [compiled|eager]  # the peak memory of one call
"""

from __future__ import annotations

import sys
import time
from typing import Callable, List

import torch

import flashcl
from flashcl.losses import flex as flex_module
from flashcl.tools.procmem import reset_peak, status_mb


def _best(fns: List[Callable[[], None]], repeats: int = 5) -> List[float]:
    for f in fns:
        f()
    times = [[] for _ in fns]  # type: List[List[float]]
    for _ in range(repeats):
        for i, f in enumerate(fns):
            t0 = time.perf_counter()
            f()
            times[i].append(time.perf_counter() - t0)
    return [min(t) for t in times]


def main() -> None:
    b, d = int(sys.argv[1]), int(sys.argv[2])
    g = torch.Generator().manual_seed(0)
    e = torch.randn(b, d, generator=g)
    labels = torch.randint(0, 100, (b,), generator=g)

    def ours(reduction: str) -> Callable[[], None]:
        def call() -> None:
            x = e.clone().requires_grad_(True)
            flashcl.contrastive_loss(x, labels, reduction=reduction, backend="tiled").backward()

        return call

    if len(sys.argv) > 3 and sys.argv[3] == "memory":
        # warm-up at 4,096 rows (2^24 pairs: the compiled tiles), so that the compiler's own
        # code and caches (process memory, once per process) are not counted as the loss's
        compiled = None if len(sys.argv) <= 4 else sys.argv[4] == "compiled"
        if compiled is not None:  # the default route's threshold, moved for this measure
            flex_module.COMPILE_FROM = 0 if compiled else b * b + 1
        small = e[:4096].clone().requires_grad_(True)
        flashcl.contrastive_loss(small, labels[:4096], backend="tiled").backward()
        del small
        x = e.clone().requires_grad_(True)
        base = reset_peak() or 0.0
        t0 = time.perf_counter()
        loss = flashcl.contrastive_loss(x, labels, backend="tiled")
        loss.backward()
        seconds = time.perf_counter() - t0
        peak = (status_mb("VmHWM") or 0.0) - base - x.numel() * 4 / 2**20
        route = {None: "default", True: "compiled", False: "eager"}[compiled]
        print(
            f"contrastive_loss, B = {b:,}, D = {d}, float32, tiled ({route} tiles): {seconds:.1f} s, peak "
            f"{peak:.0f} MB beyond the inputs and their gradient (a B x B float32 distance matrix alone: "
            f"{b * b * 4 / 2**20:,.0f} MB)"
        )
        return
    s, grad = torch.empty(b, b), torch.rand(b, b, generator=g)
    o1, o2 = torch.empty(b, d), torch.empty(b, d)

    def gemm3() -> None:
        torch.mm(e, e.T, out=s)
        torch.mm(grad, e, out=o1)
        torch.mm(grad.T, e, out=o2)

    fns = [ours("sum"), ours("mean_nonzero"), gemm3]
    names = ["pair sum, reduction='sum' (fused)", "PML's default, 'mean_nonzero' (counted first)"]
    if "--pml" in sys.argv:
        from pytorch_metric_learning import losses

        pml = losses.ContrastiveLoss()

        def theirs() -> None:
            x = e.clone().requires_grad_(True)
            pml(x, labels).backward()

        fns.append(theirs)
    times = _best(fns)
    bound = times[2]
    print(f"B = {b:,}, D = {d}, float32, the three GEMMs {bound:.3f} s:")
    for name, t in zip(names, times[:2]):
        print(f"  {name}: {t:.3f} s = {t / bound:.2f}x")
    if "--pml" in sys.argv:
        print(f"  pytorch-metric-learning ContrastiveLoss: {times[3]:.3f} s = {times[3] / bound:.2f}x")


if __name__ == "__main__":
    main()
