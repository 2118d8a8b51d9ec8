"""Peak memory and time of the prototype losses at the sizes self-distillation trains
with, float32, the first forward + backward, beyond the inputs, the student's rows'
gradient and the prototypes' gradient (as autograd leaves them: the tensors the
backward returns), in this process (one case per run: the peak is the process's).

    python scripts/prototype_memory.py ibot 16384 65536 256 softmax
    python scripts/prototype_memory.py ibot 16384 65536 256 sinkhorn
    python scripts/prototype_memory.py dino 1024 65536 256 softmax     # 2 teacher, 10 student views
    python scripts/prototype_memory.py dino 1024 65536 256 sinkhorn
    python scripts/prototype_memory.py koleo 65536 256
"""

from __future__ import annotations

import sys
import time

import torch

import flashcl
from flashcl.tools.procmem import reset_peak, status_mb


def main() -> None:
    kind = sys.argv[1]
    g = torch.Generator().manual_seed(0)
    if kind == "koleo":
        b, d = int(sys.argv[2]), int(sys.argv[3])
        x = torch.randn(b, d, generator=g).requires_grad_(True)
        leaves, what = [x], f"KoLeo, B = {b:,}, D = {d}"
        one = b * b * 4 / 2**20
        base = reset_peak()
        start = time.perf_counter()
        loss = flashcl.koleo_loss(x, backend="tiled")
    else:
        b, k, d = (int(v) for v in sys.argv[2:5])
        targets = sys.argv[5] if len(sys.argv) > 5 else "softmax"
        s, t = (1, 1) if kind == "ibot" else (10, 2)
        x = torch.randn(s, b, d, generator=g).requires_grad_(True)
        w = torch.randn(k, d, generator=g).requires_grad_(True)
        y, wt = torch.randn(t, b, d, generator=g), torch.randn(k, d, generator=g)
        leaves = [x, w]
        what = f"{kind}: {t} teacher and {s} student views of B = {b:,}, K = {k:,}, D = {d}, {targets} targets"
        one = s * b * k * 4 / 2**20
        base = reset_peak()
        start = time.perf_counter()
        loss = flashcl.dino_loss(
            x,
            y,
            w,
            teacher_prototypes=wt,
            targets=targets,
            center=torch.zeros(k) if targets == "softmax" else None,
            pairs="cross" if s > 1 else "all",
            backend="tiled",
        )
    loss.backward()  # the gradients become .grad as autograd returns them (no copy)
    seconds = time.perf_counter() - start
    grads = sum(v.numel() for v in leaves) * 4 / 2**20
    peak = status_mb("VmHWM") - base - grads
    print(
        f"{what}: loss {float(loss.detach()):.4f}, {seconds:.1f} s, peak {peak:.0f} MB beyond the inputs and "
        f"gradients (one float32 score matrix: {one:.0f} MB)"
    )


if __name__ == "__main__":
    main()
