"""The prototype loss (iBOT's shape: one student and one teacher view of B rows) against
the matrix products an exact loss in O(B + K) memory cannot avoid, timed alternately in
one process, float32, forward + backward: the student's logits, the rows' gradient and
the prototypes' gradient, and the teacher's logits once (centred softmax targets) or
1 + iterations times (Sinkhorn-Knopp's 3 iterations, each needing every logit).

    python scripts/prototype_bound.py 16384 65536 256 softmax
    python scripts/prototype_bound.py 16384 65536 256 sinkhorn
"""

from __future__ import annotations

import sys
import time

import torch

import flashcl
from flashcl.bench.ssl import prototype_gemms


def main() -> None:
    b, k, d = (int(v) for v in sys.argv[1:4])
    targets = sys.argv[4] if len(sys.argv) > 4 else "softmax"
    repeats = int(sys.argv[5]) if len(sys.argv) > 5 else 2
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, b, d, generator=g).requires_grad_(True)
    w = torch.randn(k, d, generator=g).requires_grad_(True)
    y, wt = torch.randn(1, b, d, generator=g), torch.randn(k, d, generator=g)
    center = torch.zeros(k) if targets == "softmax" else None

    def loss() -> float:
        x.grad = w.grad = None
        start = time.perf_counter()
        value = flashcl.dino_loss(
            x, y, w, teacher_prototypes=wt, targets=targets, center=center, pairs="all", backend="tiled"
        )
        value.backward()
        return time.perf_counter() - start

    passes = 1 if targets == "softmax" else 1 + 3
    bound, _ = prototype_gemms({"rows": b, "teacher_rows": b, "K": k, "D": d, "teacher_passes": passes})
    loss(), bound()  # warm-up
    ours, theirs = [], []
    for _ in range(repeats):  # alternately
        ours.append(loss())
        theirs.append(bound()[1])
    print(
        f"B = {b:,}, K = {k:,}, D = {d}, {targets} targets: loss {min(ours):.2f} s, the products "
        f"({3 + passes} of B x K) {min(theirs):.2f} s: {min(ours) / min(theirs):.2f}x "
        f"(every run: {[round(t, 2) for t in ours]} / {[round(t, 2) for t in theirs]})"
    )


if __name__ == "__main__":
    main()
