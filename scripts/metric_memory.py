"""Peak memory and time of Multi-Similarity with its miner at large batches, float32,
forward + backward, beyond the inputs and their gradient (as autograd leaves it), in this
process after a small warm-up call (the process's one-time costs, MKL's workspace and the
thread pools, not counted): labels of 8 samples per class on average. With ``flex``, the
same loss written as a flex call (the miner an ``exclude`` of the row statistics); a
fourth argument: its rows per block (default: the flex loss's own choice).

    python scripts/metric_memory.py 65536 512
    python scripts/metric_memory.py 65536 512 flex
    python scripts/metric_memory.py 32768 512 flex 128
"""

from __future__ import annotations

import sys
import time
from typing import Optional

import torch

import flashcl
from flashcl.tools.procmem import reset_peak, status_mb

BLOCK: Optional[int] = None


def _flex(x: torch.Tensor, y: torch.Tensor, backend: str) -> torch.Tensor:
    return flashcl.flex_loss(
        x,
        rows={"y": y},
        positive=lambda a, b: a.y == b.y,
        exclude=lambda a, b, s: torch.where(a.y == b.y, s >= a.hardest_negative + 0.1, s <= a.hardest_positive - 0.1),
        kind="multi_similarity",
        temperature=1.0,
        backend=backend,
        block_size=BLOCK,
    )


def main() -> None:
    global BLOCK
    b, d = int(sys.argv[1]), int(sys.argv[2])
    flex = sys.argv[3:4] == ["flex"]
    BLOCK = int(sys.argv[4]) if len(sys.argv) > 4 else None
    loss_fn = _flex if flex else lambda x, y, backend: flashcl.multi_similarity_loss(x, y, backend=backend)
    g = torch.Generator().manual_seed(0)
    warm = torch.randn(64, d, generator=g).requires_grad_(True)
    block, BLOCK = BLOCK, None
    loss_fn(warm, torch.randint(0, 8, (64,), generator=g), "tiled").backward()
    BLOCK = block
    x = torch.randn(b, d, generator=g).requires_grad_(True)
    y = torch.randint(0, max(1, b // 8), (b,), generator=g)
    base = reset_peak()
    start = time.perf_counter()
    loss = loss_fn(x, y, "tiled")
    loss.backward()  # the gradient becomes x.grad as autograd returns it (no copy)
    seconds = time.perf_counter() - start
    peak = status_mb("VmHWM") - base - x.numel() * 4 / 2**20
    one = b * b * 4 / 2**20
    name = "Multi-Similarity with its miner" + (" (flex)" if flex else "")
    print(
        f"{name}, B = {b:,}, D = {d}: loss {float(loss.detach()):.6f}, {seconds:.1f} s, "
        f"peak {peak:.0f} MB beyond the inputs and their gradient (one float32 B x B matrix: {one:.0f} MB)"
    )


if __name__ == "__main__":
    main()
