"""Peak memory and time of a flex loss at large batches, float32, forward + backward,
beyond the inputs and their gradient (as autograd leaves it), in this process after a
small warm-up call (the process's one-time costs, MKL's workspace and the thread pools,
not counted; the first call's figure is printed too): a softmax loss whose positives are
a time window and whose negatives leave out the same document's other samples (the
dense mask alone would be B x B bytes).

    python scripts/flex_memory.py 65536 256
"""

from __future__ import annotations

import sys
import time

import torch

import flashcl
from flashcl.tools.procmem import reset_peak, status_mb


def call(x: torch.Tensor, t: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
    return flashcl.flex_loss(
        x,
        rows={"t": t, "doc": doc},
        positive=lambda a, b: (a.t - b.t).abs() <= 1.0,
        exclude=lambda a, b: (a.doc == b.doc) & ((a.t - b.t).abs() > 1.0),
        backend="tiled",
    )


def main() -> None:
    b, d = int(sys.argv[1]), int(sys.argv[2])
    g = torch.Generator().manual_seed(0)
    x = torch.randn(b, d, generator=g).requires_grad_(True)
    t = torch.rand(b, generator=g) * b / 8  # timestamps, about 8 samples per time unit
    doc = torch.randint(0, b // 4, (b,), generator=g)  # about 4 samples per document
    small = x[:512].detach().clone().requires_grad_(True)
    first = reset_peak()
    call(small, t[:512], doc[:512]).backward()
    first_peak = status_mb("VmHWM") - first
    base = reset_peak()
    start = time.perf_counter()
    loss = call(x, t, doc)
    loss.backward()  # the gradient becomes .grad as autograd returns it (no copy)
    seconds = time.perf_counter() - start
    peak = status_mb("VmHWM") - base - x.numel() * 4 / 2**20
    print(
        f"flex loss (time-window positives, same-document negatives out), B = {b:,}, D = {d}: "
        f"{seconds:.1f} s, peak {peak:.0f} MB beyond the inputs and their gradient "
        f"(the warm-up call at B = 512: {first_peak:.0f} MB of one-time costs; a dense bool mask alone "
        f"would be {b * b / 2**20:,.0f} MB), loss {float(loss.detach()):.4f}"
    )


if __name__ == "__main__":
    main()
