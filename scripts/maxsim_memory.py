"""Late interaction's memory and time on the CPU: ``maxsim_loss`` (tiled) at B = N
documents, Lq = 32, Ld = 128, D = 128, float32: the peak resident memory of a
forward + backward beyond the token embeddings and their gradients (the first call,
one-time costs included: a later call's buffers hide in memory the allocator kept),
and with ``gemm`` the time against one GEMM of every query token against every
document token, alternating in one process.

    python scripts/maxsim_memory.py 512 gemm
    python scripts/maxsim_memory.py 4096
"""

from __future__ import annotations

import sys
import time

import torch

import flashcl
from flashcl.tools.procmem import reset_peak, status_mb


def main() -> None:
    torch.manual_seed(0)
    b = int(sys.argv[1])
    lq, ld, dim = 32, 128, 128
    q = torch.randn(b, lq, dim, requires_grad=True)
    d = torch.randn(b, ld, dim, requires_grad=True)
    qm, dm = torch.ones(b, lq, dtype=torch.bool), torch.ones(b, ld, dtype=torch.bool)

    def step() -> None:
        loss = flashcl.maxsim_loss(
            q, d, query_mask=qm, doc_mask=dm, temperature=0.05, normalize_scores=True, backend="tiled"
        )
        loss.backward()

    # the first call, as the benchmark's first-call peak: what a fresh process holds on top
    # of the inputs (one-time costs such as the GEMM workspace included); freed memory the
    # allocator keeps would hide a second call's buffers from the resident size
    base = reset_peak()
    t = time.perf_counter()
    step()
    took = time.perf_counter() - t
    peak = status_mb("VmHWM")
    if base is None or peak is None:
        raise SystemExit("needs Linux's /proc/self/status")
    grads = (q.numel() + d.numel()) * q.element_size() / 2**20
    print(f"B = N = {b}: fwd+bwd {took:.3f} s, peak beyond the inputs and their gradients {peak - base - grads:.1f} MB")
    if len(sys.argv) > 2 and sys.argv[2] == "gemm":
        a, k = q.detach().reshape(b * lq, dim), d.detach().reshape(b * ld, dim)
        out = torch.empty(b * lq, b * ld)
        gemm, loss_t = [], []
        for _ in range(3):
            t = time.perf_counter()
            torch.mm(a, k.T, out=out)
            gemm.append(time.perf_counter() - t)
            q.grad = d.grad = None
            t = time.perf_counter()
            step()
            loss_t.append(time.perf_counter() - t)
        print(
            f"one (B Lq) x (N Ld) x D GEMM {min(gemm):.3f} s; maxsim fwd+bwd {min(loss_t):.3f} s = "
            f"{min(loss_t) / min(gemm):.2f}x"
        )


if __name__ == "__main__":
    main()
