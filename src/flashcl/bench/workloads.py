"""The measured workloads: each builds its inputs, then returns a step that runs
forward and backward once and returns the loss value.

A workload is ``name(params) -> (step, extra_bytes)``: ``extra_bytes`` is the
size of what the step must allocate anyway (the inputs' gradient), reported so
that "peak above inputs and gradient" can be read off.
"""
from __future__ import annotations

import random
from typing import Any, Callable, Dict, Tuple

import torch
import torch.nn.functional as F

import flashcl

Step = Callable[[], float]
Workload = Callable[[Dict[str, Any]], Tuple[Step, int]]


def _gen(params: Dict[str, Any]) -> torch.Generator:
    return torch.Generator().manual_seed(int(params.get("seed", 0)))


def gemm3(p: Dict[str, Any]) -> Tuple[Step, int]:
    """The three GEMMs no exact contrastive loss over B x D embeddings can avoid:
    S = E E^T, dQ = G E, dK = G^T E (torch.mm into preallocated outputs)."""
    b, d = p["B"], p["D"]
    g = _gen(p)
    e = torch.randn(b, d, generator=g)
    s = torch.empty(b, b)
    grad = torch.rand(b, b, generator=g)
    o1, o2 = torch.empty(b, d), torch.empty(b, d)

    def step() -> float:
        torch.mm(e, e.T, out=s)
        torch.mm(grad, e, out=o1)
        torch.mm(grad.T, e, out=o2)
        return 0.0
    return step, 0


def _seed2_vectorized(embeddings: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
    """The second seed's vectorized_supervised_simcse_loss, as written there."""
    batch_size = embeddings.size(0)
    embeddings = F.normalize(embeddings, p=2, dim=1)
    sim_matrix = torch.matmul(embeddings, embeddings.T) / temperature
    pos_mask = (labels.unsqueeze(0) == labels.unsqueeze(1)) & ~torch.eye(batch_size, dtype=torch.bool)
    pos_sim_sum = (sim_matrix * pos_mask).sum(dim=1)
    log_denominator = torch.logsumexp(sim_matrix, dim=1)
    return (-pos_sim_sum + log_denominator).mean()


def supcon(p: Dict[str, Any]) -> Tuple[Step, int]:
    """SupCon over B x D embeddings with C classes, by implementation ``impl``."""
    b, d, impl = p["B"], p["D"], p["impl"]
    g = _gen(p)
    e = torch.randn(b, d, generator=g).requires_grad_(True)
    labels = torch.randint(0, p.get("classes", 5), (b,), generator=g)
    t = p.get("temperature", 0.05 if p.get("seed2") else 0.1)
    if impl.startswith("flashcl-"):
        backend = impl.split("-", 1)[1]
        kw = dict(positives="sum", include_self=True) if p.get("seed2") else {}
        fn = lambda: flashcl.supcon_loss(e, labels, temperature=t, backend=backend, **kw)  # noqa: E731
    elif impl == "seed2-vectorized":
        fn = lambda: _seed2_vectorized(e, labels, t)  # noqa: E731
    elif impl == "pml":
        from pytorch_metric_learning.losses import SupConLoss
        pml = SupConLoss(temperature=t)
        fn = lambda: pml(e, labels)  # noqa: E731
    else:
        raise ValueError(f"unknown supcon impl {impl!r}")

    def step() -> float:
        e.grad = None
        loss = fn()
        loss.backward()
        return float(loss.detach())
    return step, b * d * 4


def clip(p: Dict[str, Any]) -> Tuple[Step, int]:
    """The symmetric CLIP loss over two B x D towers."""
    b, d, impl = p["B"], p["D"], p["impl"]
    g = _gen(p)
    img = torch.randn(b, d, generator=g).requires_grad_(True)
    txt = torch.randn(b, d, generator=g).requires_grad_(True)
    scale = torch.tensor(1 / 0.07)
    if impl.startswith("flashcl-"):
        backend = impl.split("-", 1)[1]
        fn = lambda: flashcl.clip_loss(img, txt, scale, backend=backend)  # noqa: E731
    elif impl == "torch-ce":
        def fn() -> torch.Tensor:
            logits = scale * F.normalize(img, dim=1) @ F.normalize(txt, dim=1).T
            labels = torch.arange(b)
            return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
    else:
        raise ValueError(f"unknown clip impl {impl!r}")

    def step() -> float:
        img.grad = txt.grad = None
        loss = fn()
        loss.backward()
        return float(loss.detach())
    return step, 2 * b * d * 4


def neighbor(p: Dict[str, Any]) -> Tuple[Step, int]:
    """The first seed's loss on an n x n score matrix, k sampled columns per row."""
    n, k, impl = p["n"], p["k"], p["impl"]
    g = _gen(p)
    x = torch.randn(n, n, generator=g).requires_grad_(True)
    rng = random.Random(0)
    indices = torch.tensor([[rng.randrange(0, n) for _ in range(k)] for _ in range(n)])

    if impl == "seed-program":
        def fn() -> torch.Tensor:
            r = random.Random(0)
            row_sum = torch.sum(torch.exp(x), dim=1) - torch.exp(torch.diagonal(x, 0))
            y = torch.zeros((n, k))
            for i in range(n):
                for j in range(k):
                    y[i][j] = x[i][r.randrange(0, n)]
            return torch.sum(-torch.log(torch.exp(y) / row_sum.view(-1, 1)))
    elif impl == "gather-fix":
        def fn() -> torch.Tensor:
            row_sum = torch.sum(torch.exp(x), dim=1) - torch.exp(torch.diagonal(x, 0))
            y = x.gather(1, indices)
            return torch.sum(-torch.log(torch.exp(y) / row_sum.view(-1, 1)))
    elif impl == "log-form":
        def fn() -> torch.Tensor:
            row_sum = torch.sum(torch.exp(x), dim=1) - torch.exp(torch.diagonal(x, 0))
            y = x.gather(1, indices)
            return torch.sum(-(y - torch.log(row_sum).view(-1, 1)))
    elif impl == "stable-logsumexp":
        def fn() -> torch.Tensor:
            lse = torch.logsumexp(x.masked_fill(torch.eye(n, dtype=torch.bool), float("-inf")), 1)
            return (k * lse - x.gather(1, indices).sum(1)).sum()
    elif impl.startswith("flashcl-"):
        backend = impl.split("-", 1)[1]
        fn = lambda: flashcl.neighbor_loss(x, indices, backend=backend)  # noqa: E731
    else:
        raise ValueError(f"unknown neighbor impl {impl!r}")

    def step() -> float:
        x.grad = None
        loss = fn()
        loss.backward()
        return float(loss.detach())
    return step, n * n * 4


WORKLOADS: Dict[str, Workload] = {"gemm3": gemm3, "supcon": supcon, "clip": clip, "neighbor": neighbor}
