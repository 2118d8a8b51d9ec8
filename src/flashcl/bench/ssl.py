"""Self-distillation's workloads and suite (``flashcl bench --suite ssl``): DINO and
iBOT over K prototypes by :func:`flashcl.dino_loss` (tiled, dense) and by the logits
a head forms fed to lightly's and DINOv2's losses (and to flashcl's lightly drop-ins),
KoLeo tiled and dense; the fused loss against the GEMMs it cannot avoid, timed
alternately in one process.

Inputs: the student's and teacher's bottleneck rows (S and T views of B images),
the prototypes (K, D) and the teacher's EMA copy, float32; teacher temperature 0.04,
student 0.1; the student's rows and prototypes are the leaves (their gradients are
the inputs' gradients, not counted in the peak).
"""

from __future__ import annotations

import importlib
import time
from typing import Any, Dict, List, Tuple

import torch
import torch.nn.functional as F

import flashcl

from ..losses.prototype_targets import auto_prototype_block
from . import peers
from .workloads import NotInstalled, Step, case_device, case_generator, stepper, sync

__all__ = ["prototype_gemms", "self_distill", "koleo", "WORKLOADS", "ssl"]

Case = Dict[str, Any]


def prototype_gemms(p: Dict[str, Any]) -> Tuple[Step, int]:
    """The GEMMs an exact loss over K prototypes cannot avoid, a block of prototypes
    at a time into preallocated buffers: the student's logits, its rows' gradient and
    the prototypes' gradient, and ``teacher_passes`` passes of the teacher's logits
    (the fewest an exact loss in O(B + K) memory makes: 1 for centred softmax targets,
    each row's softmax complete in a block of rows; iterations + 1 for DINOv2's
    Sinkhorn-Knopp, whose every iteration needs every logit, then the targets)."""
    m, n, k, d, dev = p["rows"], p["teacher_rows"], p["K"], p["D"], case_device(p)
    g = case_generator(p)
    x, y = torch.randn(m, d, generator=g).to(dev), torch.randn(n, d, generator=g).to(dev)
    w = torch.randn(k, d, generator=g).to(dev)
    block = auto_prototype_block(max(m, n), k)
    buf, tbuf = torch.empty(m, block, device=dev), torch.empty(n, block, device=dev)
    dx, dw = torch.zeros(m, d, device=dev), torch.empty(k, d, device=dev)

    def step() -> Tuple[float, float]:
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(int(p["teacher_passes"])):
            for k0 in range(0, k, block):
                k1 = min(k0 + block, k)
                torch.mm(y, w[k0:k1].T, out=tbuf[:, : k1 - k0])
        for k0 in range(0, k, block):
            k1 = min(k0 + block, k)
            z = torch.mm(x, w[k0:k1].T, out=buf[:, : k1 - k0])
            dx.addmm_(z, w[k0:k1])
            torch.mm(z.T, x, out=dw[k0:k1])
        sync(dev)
        return 0.0, time.perf_counter() - t0

    return step, 0


def self_distill(p: Dict[str, Any]) -> Tuple[Step, int]:
    """DINO (S student and T teacher views of B images, the same crop left out) or iBOT
    (S = T = 1: B masked patches), forward + backward. ``impl``: ``flashcl-tiled`` /
    ``flashcl-dense`` (:func:`flashcl.dino_loss` on the rows), ``lightly`` /
    ``dinov2`` (the head's logits, then their loss), ``flashcl-lightly`` (the logits,
    then flashcl's lightly drop-in)."""
    b, s, t, k, d, impl, dev = p["B"], p["S"], p["T"], p["K"], p["D"], p["impl"], case_device(p)
    targets = p.get("targets", "softmax")
    g = case_generator(p)
    dtype = getattr(torch, p.get("dtype", "float32"))
    x = torch.randn(s, b, d, generator=g).to(dev, dtype).requires_grad_(True)
    w = torch.randn(k, d, generator=g).to(dev, dtype).requires_grad_(True)
    y, wt = torch.randn(t, b, d, generator=g).to(dev, dtype), torch.randn(k, d, generator=g).to(dev, dtype)
    pairs = "cross" if s > 1 else "all"
    if impl.startswith("flashcl-") and impl != "flashcl-lightly":
        backend = impl.split("-", 1)[1]

        def fn() -> torch.Tensor:
            return flashcl.dino_loss(x, y, w, teacher_prototypes=wt, targets=targets, pairs=pairs, backend=backend)

        return stepper(fn, [x, w], dev), (x.numel() + w.numel()) * x.element_size()
    if targets != "softmax" and impl != "dinov2":
        raise NotInstalled(f"{impl} has no Sinkhorn-Knopp targets")

    def logits(rows: torch.Tensor, protos: torch.Tensor) -> torch.Tensor:
        return F.normalize(rows, dim=-1) @ F.normalize(protos, dim=-1).T

    if impl in ("lightly", "flashcl-lightly"):
        module: Any = importlib.import_module("flashcl.integrations.lightly")
        if impl == "lightly":
            module, why = peers.lightly_ssl_losses()
            if module is None:
                raise NotInstalled(why)
        if s == 1:
            loss_fn = module.IBOTPatchLoss(output_dim=k).to(dev)
            mask = torch.ones(b, 1, 1, dtype=torch.bool, device=dev)
            fn = lambda: loss_fn(logits(y[0], wt).detach(), logits(x[0], w), mask)  # noqa: E731
        else:
            dino = module.DINOLoss(output_dim=k).to(dev)
            fn = lambda: dino([logits(v, wt).detach() for v in y], [logits(v, w) for v in x])  # noqa: E731
    elif impl == "dinov2":
        dino2 = _dinov2().DINOLoss(k).to(dev)

        def fn() -> torch.Tensor:
            with torch.no_grad():
                t_logits = logits(y.reshape(t * b, d), wt)
                if targets == "sinkhorn":
                    q = dino2.sinkhorn_knopp_teacher(t_logits, 0.04)
                else:
                    q = dino2.softmax_center_teacher(t_logits, 0.04)
            views = list(q.view(t, b, k))
            if s == 1:
                return dino2([logits(x[0], w)], views)
            # as DINOv2's training step pairs them: each student view with the other crops' teacher views
            total = sum(dino2([logits(v, w)], [q for j, q in enumerate(views) if j != i]) for i, v in enumerate(x))
            return total / (s * t - min(s, t))

    else:
        raise ValueError(f"unknown self_distill impl {impl!r}")
    return stepper(fn, [x, w], dev), (x.numel() + w.numel()) * x.element_size()


def _dinov2() -> Any:
    """The DINOv2 repository's ``dinov2.loss`` (its files need only torch)."""
    try:
        return importlib.import_module("dinov2.loss")
    except ImportError as e:
        raise NotInstalled(f"dinov2 not importable ({e})") from e


def koleo(p: Dict[str, Any]) -> Tuple[Step, int]:
    """KoLeo forward + backward: ``flashcl-tiled`` / ``flashcl-dense``
    (:func:`flashcl.koleo_loss`), ``dinov2`` / ``lightly`` (their KoLeoLoss: B x B products)."""
    b, d, impl, dev = p["B"], p["D"], p["impl"], case_device(p)
    x = torch.randn(b, d, generator=case_generator(p)).to(dev).requires_grad_(True)
    if impl.startswith("flashcl-"):
        backend = impl.split("-", 1)[1]
        return stepper(lambda: flashcl.koleo_loss(x, backend=backend), [x], dev), x.numel() * 4
    if impl == "dinov2":
        loss_fn = _dinov2().KoLeoLoss()
    else:
        module, why = peers.lightly_ssl_losses()
        if module is None:
            raise NotInstalled(why)
        loss_fn = module.KoLeoLoss()
    return stepper(lambda: loss_fn(x), [x], dev), x.numel() * 4


WORKLOADS = {"prototype_gemms": prototype_gemms, "self_distill": self_distill, "koleo": koleo}


def ssl(mode: str, device: str) -> List[Case]:
    """Self-distillation over prototypes (K = 65,536, D = 256 at full size): iBOT's
    masked patches and DINO's 2 + 10 views of B images, by flashcl's fused loss and
    by the logits fed to lightly's and DINOv2's losses, B up to where those run out
    of memory; the fused loss against its GEMMs (alternating in one process) for
    iBOT and DINO; KoLeo tiled and dense."""
    k, d = {"quick": (512, 32), "default": (65536, 256), "full": (65536, 256)}[mode]
    patches = {"quick": (64,), "default": (1024, 4096, 16384), "full": (1024, 4096, 16384)}[mode]
    images = {"quick": (16,), "default": (128, 1024), "full": (128, 1024)}[mode]
    koleo_sizes = {"quick": (256,), "default": (16384, 65536), "full": (16384, 65536)}[mode]
    cases: List[Case] = []
    # the fused loss against its GEMMs: iBOT's patches (one student and one teacher view) and
    # DINO's 2 + 10 views of B images (the student's products over 10 B rows, the teacher's over 2 B)
    bounded = [("iBOT", 1, 1, patches[-1]), ("DINO 2 + 10 views", 10, 2, images[-1])]
    for name, s, t, b in bounded:
        for targets in ("softmax", "sinkhorn"):
            passes = 1 if targets == "softmax" else 1 + 3
            cases.append(
                {
                    "group": f"{name} fused / its GEMMs, B = {b}, K = {k}, D = {d}",
                    "label": f"flashcl-tiled ({targets})",
                    "workload": "self_distill",
                    "bound": {
                        "workload": "prototype_gemms",
                        "params": {
                            "rows": s * b,
                            "teacher_rows": t * b,
                            "K": k,
                            "D": d,
                            "teacher_passes": passes,
                            "device": device,
                        },
                    },
                    "repeats": 2,
                    "cap_s": 900.0,
                    "params": {"B": b, "S": s, "T": t, "K": k, "D": d, "targets": targets, "impl": "flashcl-tiled"},
                }
            )
    shapes = [("iBOT masked patches", 1, 1, patches), ("DINO, 2 teacher and 10 student views", 10, 2, images)]
    for name, s, t, sizes in shapes:
        for targets in ("softmax", "sinkhorn"):
            impls = ["flashcl-tiled", "flashcl-dense", "dinov2"]
            if targets == "softmax":
                impls += ["lightly", "flashcl-lightly"]
            for b in sizes:
                for impl in impls:
                    cases.append(
                        {
                            "group": f"{name}, {targets} targets, K = {k}, D = {d}",
                            "label": impl,
                            "workload": "self_distill",
                            "repeats": 1,
                            "cap_s": 900.0,
                            "stop_after_fail": True,
                            "params": {"B": b, "S": s, "T": t, "K": k, "D": d, "targets": targets, "impl": impl},
                        }
                    )
    for b in koleo_sizes:
        for impl in ("flashcl-tiled", "flashcl-dense", "dinov2", "lightly"):
            cases.append(
                {
                    "group": f"KoLeo, D = {d}",
                    "label": impl,
                    "workload": "koleo",
                    "repeats": 1,
                    "cap_s": 600.0,
                    "stop_after_fail": True,
                    "params": {"B": b, "D": d, "impl": impl},
                }
            )
    return cases
