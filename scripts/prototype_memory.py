"""Peak memory and time of the engine's prototype cross-entropy (engine/prototypes.py)
at iBOT's size: B student rows one to one with B teacher rows, K prototypes, D wide,
float32, the first forward + backward, beyond the inputs, the rows' gradient and the
prototypes' gradient (as autograd leaves them: the tensors the backward returns).

    python scripts/prototype_memory.py 16384 65536 256 softmax
    python scripts/prototype_memory.py 16384 65536 256 sinkhorn
"""

from __future__ import annotations

import sys
import time

import torch

from flashcl.engine.prototypes import (
    PrototypeCrossEntropy,
    Prototypes,
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
    block = auto_prototype_block(b, k)
    base = reset_peak()
    start = time.perf_counter()
    yh = unit_rows(y, True)[0]
    teacher = Prototypes(wt, True)
    if kind == "sinkhorn":
        targets = sinkhorn_targets(yh, teacher, 1 / 0.04, 3, block)
    else:
        targets = softmax_targets(yh, teacher, torch.zeros(k), 1 / 0.04, block)
    loss = PrototypeCrossEntropy.apply(x, w, targets, 1 / 0.1, block, True).mean()
    loss.backward()  # the gradients become .grad as autograd returns them (no copy)
    seconds = time.perf_counter() - start
    grads = (x.numel() + w.numel()) * 4 / 2**20
    peak = status_mb("VmHWM") - base - grads
    one = b * k * 4 / 2**20
    print(
        f"B = {b:,}, K = {k:,}, D = {d}, {kind} targets, block {block}: loss {float(loss.detach()):.4f}, "
        f"{seconds:.1f} s, peak {peak:.0f} MB beyond the inputs and gradients (one B x K float32 tensor: "
        f"{one:.0f} MB)"
    )


if __name__ == "__main__":
    main()
