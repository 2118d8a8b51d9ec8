"""Peak memory and time of the engine's prototype cross-entropy (engine/prototypes.py)
at iBOT's size: B student rows one to one with B teacher rows, K prototypes, D wide,
float32, the first forward + backward, beyond the inputs, their gradients and the
prototypes' gradient (formed before the peak is reset, as autograd leaves them).

    python scripts/prototype_memory.py 16384 65536 256 softmax
    python scripts/prototype_memory.py 16384 65536 256 sinkhorn
"""

from __future__ import annotations

import sys
import time

import torch

from flashcl.engine.prototypes import (
    PrototypeCrossEntropy,
    auto_prototype_block,
    sinkhorn_targets,
    softmax_targets,
    unit_rows,
)
from flashcl.tools.procmem import reset_peak, status_mb


def main() -> None:
    b, k, d = (int(v) for v in sys.argv[1:4])
    kind = sys.argv[4] if len(sys.argv) > 4 else "softmax"
    g = torch.Generator().manual_seed(0)
    x = torch.randn(b, d, generator=g).requires_grad_(True)
    w = torch.randn(k, d, generator=g).requires_grad_(True)
    y, wt = torch.randn(b, d, generator=g), torch.randn(k, d, generator=g)
    x.grad, w.grad = torch.zeros_like(x), torch.zeros_like(w)  # the gradients' own memory, before the peak
    block = auto_prototype_block(b, k)
    base = reset_peak()
    start = time.perf_counter()
    xh, wh = unit_rows(x, True)[0], unit_rows(w, True)[0]
    yh, wth = unit_rows(y, True)[0], unit_rows(wt, True)[0]
    if kind == "sinkhorn":
        targets = sinkhorn_targets(yh, wth, 1 / 0.04, 3, block)
    else:
        targets = softmax_targets(yh, wth, torch.zeros(k), 1 / 0.04, block)
    loss = PrototypeCrossEntropy.apply(xh, wh, targets, 1 / 0.1, block).mean()
    loss.backward()
    seconds = time.perf_counter() - start
    peak = status_mb("VmHWM") - base
    one = b * k * 4 / 2**20
    print(
        f"B = {b:,}, K = {k:,}, D = {d}, {kind} targets, block {block}: loss {float(loss.detach()):.4f}, "
        f"{seconds:.1f} s, peak {peak:.0f} MB beyond the inputs and gradients (one B x K float32 tensor: "
        f"{one:.0f} MB)"
    )


if __name__ == "__main__":
    main()
