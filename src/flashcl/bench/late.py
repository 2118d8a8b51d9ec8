"""Late interaction's workloads (``flashcl bench --suite late-interaction``): the
ColBERT contrastive loss on token embeddings, by flashcl and by the peers' own loss
classes, and the one GEMM of every query token against every document token that
bounds it.

Inputs: B queries of ``Lq`` tokens and B documents of ``Ld`` tokens, width ``D``,
unit token embeddings with padding of random lengths (masks for flashcl and pylate,
zeroed tokens for colpali-engine, as its models give them), temperature 0.02.
"""

from __future__ import annotations

import importlib
import time
from typing import Any, Dict, Tuple

import torch
import torch.nn.functional as F

import flashcl

from . import peers
from .workloads import NotInstalled, Step, case_device, case_generator, stepper, sync

__all__ = ["token_gemm", "late_interaction", "WORKLOADS"]

TEMPERATURE = 0.02


def token_gemm(p: Dict[str, Any]) -> Tuple[Step, int]:
    """One (B Lq) x (B Ld) x D product into a preallocated output: the token scores
    no exact late-interaction loss can skip forming (once)."""
    b, lq, ld, d, dev = p["B"], p["Lq"], p["Ld"], p["D"], case_device(p)
    g = case_generator(p)
    q = torch.randn(b * lq, d, generator=g).to(dev)
    k = torch.randn(b * ld, d, generator=g).to(dev)
    out = torch.empty(b * lq, b * ld, device=dev)

    def step() -> Tuple[float, float]:
        sync(dev)
        t0 = time.perf_counter()
        torch.mm(q, k.T, out=out)
        sync(dev)
        return 0.0, time.perf_counter() - t0

    return step, 0


class _Given(torch.nn.Module):
    """A pylate "model" that returns the token embeddings the features carry."""

    skiplist: list = []
    do_query_expansion = False

    def forward(self, features: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        return {"token_embeddings": features["embeddings"]}


def late_interaction(p: Dict[str, Any]) -> Tuple[Step, int]:
    """The ColBERT contrastive loss (in-batch negatives) forward + backward. ``impl``:
    ``flashcl-tiled`` / ``flashcl-dense`` (:func:`flashcl.maxsim_loss`), ``pylate``
    (``pylate.losses.Contrastive``), ``colpali-engine`` (``ColbertLoss``),
    ``flashcl-pylate`` / ``flashcl-colpali`` (flashcl's drop-ins of those two), and on
    CUDA ``late-interaction-kernels`` / ``flash-maxsim`` (those packages' differentiable
    MaxSim scores, then the cross-entropy pylate takes of them); ``dtype`` the tokens'
    (float32 unless given)."""
    b, lq, ld, d, impl, dev = p["B"], p["Lq"], p["Ld"], p["D"], p["impl"], case_device(p)
    g = case_generator(p)
    dtype = getattr(torch, p.get("dtype", "float32"))
    q = F.normalize(torch.randn(b, lq, d, generator=g), dim=-1).to(dev, dtype).requires_grad_(True)
    k = F.normalize(torch.randn(b, ld, d, generator=g), dim=-1).to(dev, dtype).requires_grad_(True)
    qm = (torch.arange(lq) < torch.randint(lq // 2, lq + 1, (b, 1), generator=g)).to(dev)
    km = (torch.arange(ld) < torch.randint(ld // 4, ld + 1, (b, 1), generator=g)).to(dev)
    if impl in ("flashcl-tiled", "flashcl-dense"):
        backend = impl.split("-", 1)[1]

        def fn() -> torch.Tensor:
            return flashcl.maxsim_loss(q, k, query_mask=qm, doc_mask=km, temperature=TEMPERATURE, backend=backend)

    elif impl in ("pylate", "flashcl-pylate"):
        try:
            name = "pylate.losses" if impl == "pylate" else "flashcl.integrations.pylate"
            losses: Any = importlib.import_module(name)
        except ImportError as e:
            raise NotInstalled(f"pylate not installed ({e})") from e
        loss = losses.Contrastive(_Given(), temperature=TEMPERATURE)
        ids = [torch.full(m.shape, 100, device=dev) for m in (qm, km)]
        features = [
            {"input_ids": i, "attention_mask": m.long(), "embeddings": x} for i, m, x in zip(ids, (qm, km), (q, k))
        ]
        fn = lambda: loss(features)  # noqa: E731
    elif impl in ("colpali-engine", "flashcl-colpali"):
        module: Any = importlib.import_module("flashcl.integrations.colpali")
        if impl == "colpali-engine":
            module, why = peers.colpali_loss_module()
            if module is None:
                raise NotInstalled(why)
        colbert = module.ColbertLoss(temperature=TEMPERATURE, normalize_scores=False)
        fn = lambda: colbert(q * qm.unsqueeze(-1), k * km.unsqueeze(-1))  # noqa: E731
    elif impl in ("late-interaction-kernels", "flash-maxsim"):
        if dev.type != "cuda":
            raise NotInstalled(f"{impl} runs on CUDA only")
        try:
            if impl == "late-interaction-kernels":
                from late_interaction_kernels import maxsim

                score = lambda: maxsim(q, k, qm, km)  # noqa: E731
            else:
                from flash_maxsim import flash_maxsim_batched_train

                # the masks are prefixes (the tokens of each text, then padding): given as lengths
                q_len, k_len = qm.sum(1).int(), km.sum(1).int()
                score = lambda: flash_maxsim_batched_train(q, k, doc_lengths=k_len, query_lengths=q_len)  # noqa: E731
        except ImportError as e:
            raise NotInstalled(f"{impl} not installed ({e})") from e

        def fn() -> torch.Tensor:
            try:
                s = score()
            except Exception as e:  # the kernel refusing these inputs
                raise NotInstalled(f"{impl}: {type(e).__name__}: {str(e)[:120]}") from e
            return F.cross_entropy(s.float() / TEMPERATURE, torch.arange(b, device=dev))

    else:
        raise ValueError(f"unknown late_interaction impl {impl!r}")
    return stepper(fn, [q, k], dev), (q.numel() + k.numel()) * q.element_size()


WORKLOADS = {"token_gemm": token_gemm, "late_interaction": late_interaction}
