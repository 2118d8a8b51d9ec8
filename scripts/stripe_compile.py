"""A stripe's element-wise work three ways, on this machine: the softmax head's hand-written
eager pass (``SoftmaxHead.rows_fused``: InfoNCE's rows, the pivot taken in, the anchor's
own column out), the same stripe function written in plain torch operations and compiled
by ``torch.compile`` (inductor: C++ on the CPU, Triton on CUDA), and that function's
gradient by ``torch.func.grad_and_value``, compiled (the route a head without a kernel of
its own would take). Best of ``repeats`` after the first call; the compile time printed
apart.

    python scripts/stripe_compile.py 512 8192 [repeats]
"""

from __future__ import annotations

import sys
import time
from typing import Callable, Tuple

import torch
from torch import Tensor

from flashcl.engine.heads import SoftmaxHead, Tile


def _best(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def stripe_rows(s: Tensor, pivot: Tensor, r0: int, g: Tensor) -> Tuple[Tensor, Tensor]:
    """The softmax head's complete rows, written plainly: each row's logsumexp with its
    pivot taken in and the anchor's own column out, and ``G = g softmax`` without the pivot
    (whose gradient goes through the positive term)."""
    b, n = s.shape
    cols = torch.arange(n, device=s.device)
    rows = torch.arange(b, device=s.device) + r0
    out = (cols[None, :] == rows[:, None]) | (cols[None, :] == pivot[:, None])
    z = s.masked_fill(out, float("-inf"))
    lse_without = torch.logsumexp(z, 1)
    p = s.gather(1, pivot[:, None]).squeeze(1)
    lse = p + torch.nn.functional.softplus(lse_without - p)
    return lse, torch.exp(z - lse[:, None]) * g[:, None]


def stripe_loss(s: Tensor, pivot: Tensor, r0: int, g: Tensor) -> Tensor:
    """The same rows' loss, ``g (LSE - s_pivot)`` summed: its gradient by autograd is ``G``
    less the pivots' part."""
    lse, _ = stripe_rows(s.detach(), pivot, r0, g)
    b, n = s.shape
    cols = torch.arange(n, device=s.device)
    rows = torch.arange(b, device=s.device) + r0
    z = s.masked_fill(cols[None, :] == rows[:, None], float("-inf"))
    return (g * (torch.logsumexp(z, 1) - s.gather(1, pivot[:, None]).squeeze(1))).sum()


def main() -> None:
    b, n = int(sys.argv[1]), int(sys.argv[2])
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 10
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(b, n, generator=gen) * 5
    r0 = 3
    pivot = (torch.arange(b) + r0 + 1) % n
    g = torch.rand(b, generator=gen)

    head = SoftmaxHead(torch.ones(b), exclude_self=True, pivot=(pivot, torch.ones(b)))
    work = torch.empty_like(scores)

    def eager() -> None:
        st = head.state(b, n, scores, None)
        head.prepare(st, (scores.gather(1, pivot[:, None]).squeeze(1), None))
        head.rows_fused(work.copy_(scores), Tile(0, b, 0, n, r0), st, g)

    plain = lambda: stripe_rows(scores, pivot, r0, g)  # noqa: E731
    start = time.perf_counter()
    compiled = torch.compile(stripe_rows, dynamic=False)
    compiled(scores, pivot, r0, g)
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    graded = torch.compile(torch.func.grad_and_value(stripe_loss), dynamic=False)
    graded(scores, pivot, r0, g)
    grad_compile_s = time.perf_counter() - start
    rows = {
        "eager, hand-written (SoftmaxHead.rows_fused)": _best(eager, repeats),
        "eager, plain torch": _best(plain, repeats),
        "torch.compile of the plain function": _best(lambda: compiled(scores, pivot, r0, g), repeats),
        "torch.compile of torch.func.grad_and_value": _best(lambda: graded(scores, pivot, r0, g), repeats),
    }
    print(f"a stripe of {b} x {n} float32 scores, {torch.get_num_threads()} threads, best of {repeats}:")
    for name, seconds in rows.items():
        print(f"  {name:<48} {seconds * 1e3:8.2f} ms")
    print(f"  compile time: {compile_s:.1f} s (plain), {grad_compile_s:.1f} s (grad_and_value)")


if __name__ == "__main__":
    main()
