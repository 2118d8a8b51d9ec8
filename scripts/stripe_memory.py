"""Peak memory and time of InfoNCE (two towers, the diagonal's positives) forward + backward,
beyond the inputs and their gradients (as autograd leaves them), in this process after a small
warm-up call (the process's one-time costs not counted), on the tiled backend, in the dtype
given: the figure behind "memory at a million rows" (the GPU run's InfoNCE at B = 1,048,576
takes the same driver in bfloat16).

    python scripts/stripe_memory.py 16384 768 bfloat16 [block_size]
"""

from __future__ import annotations

import sys
import time

import torch

import flashcl
from flashcl.tools.procmem import reset_peak, status_mb


def main() -> None:
    b, d = int(sys.argv[1]), int(sys.argv[2])
    dtype = getattr(torch, sys.argv[3] if len(sys.argv) > 3 else "float32")
    block = int(sys.argv[4]) if len(sys.argv) > 4 else None
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, d, generator=g).to(dtype).requires_grad_(True)
    k = torch.randn(b, d, generator=g).to(dtype).requires_grad_(True)

    def call(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return flashcl.info_nce_loss(x, y, temperature=0.05, backend="tiled", block_size=block)

    small = [t[:512].detach().clone().requires_grad_(True) for t in (q, k)]
    first = reset_peak()
    call(*small).backward()
    first_peak = (status_mb("VmHWM") or 0.0) - (first or 0.0)
    base = reset_peak()
    start = time.perf_counter()
    loss = call(q, k)
    loss.backward()  # the gradients become .grad as autograd returns them (no copy)
    seconds = time.perf_counter() - start
    grads = sum(t.numel() * t.element_size() for t in (q, k)) / 2**20
    peak = (status_mb("VmHWM") or 0.0) - (base or 0.0) - grads
    print(
        f"InfoNCE, B = {b:,}, D = {d}, {str(dtype).replace('torch.', '')}, tiled: {seconds:.2f} s, "
        f"peak {peak:.0f} MB beyond the inputs and their gradients ({grads:.0f} MB of gradients; the warm-up "
        f"call at B = 512: {first_peak:.0f} MB of one-time costs), loss {float(loss.detach()):.4f}"
    )


if __name__ == "__main__":
    main()
