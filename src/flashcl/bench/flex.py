"""Flex losses' workloads and suite (``flashcl bench --suite flex``): a loss written as
functions of each pair (:func:`flashcl.flex_loss`) against the built-in it equals (timed
alternately in one process), against the matrix products it cannot avoid, with a block
mask against the full visit, against the dense formula written with masks as users write
it without flashcl, and its memory at a batch of 65,536.

Inputs: float32 rows (B, D) unless a case names a ``dtype``, the leaves (their gradients not counted in the peak);
temperature 0.1.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.nn.functional as F

import flashcl

from .workloads import Step, case_device, case_generator, stepper

__all__ = ["flex_workload", "WORKLOADS", "flex"]

Case = Dict[str, Any]
T = 0.1


def _supcon(p: Dict[str, Any], x: torch.Tensor, g: torch.Generator) -> Callable[[], torch.Tensor]:
    """SupCon with class labels (B / 8 classes): built-in, flex, or the dense masked formula."""
    b, impl = x.shape[0], p["impl"]
    y = torch.randint(0, max(1, b // 8), (b,), generator=g).to(x.device)
    if impl == "builtin":
        return lambda: flashcl.supcon_loss(x, y, temperature=T, backend="tiled")
    if impl == "flex":
        return lambda: flashcl.flex_loss(
            x, rows={"y": y}, positive=lambda a, c: a.y == c.y, symmetric=p.get("symmetric", False), backend="tiled"
        )

    def dense() -> torch.Tensor:  # as written without flashcl: the B x B logits and masks
        z = F.normalize(x, dim=-1)
        logits = z @ z.T / T
        eye = torch.eye(b, dtype=torch.bool, device=x.device)
        pos = (y.unsqueeze(0) == y.unsqueeze(1)) & ~eye
        log_prob = logits - torch.logsumexp(logits.masked_fill(eye, float("-inf")), 1, keepdim=True)
        per_row = -(log_prob * pos).sum(1) / pos.sum(1).clamp_min(1)
        return per_row[pos.any(1)].mean()

    return dense


def _info_nce(p: Dict[str, Any], x: torch.Tensor, k: torch.Tensor, g: torch.Generator) -> Callable[[], torch.Tensor]:
    """InfoNCE whose keys of the query's label (B / 8 labels), other than its own, are
    left out as false negatives: built-in, flex, or the dense masked formula."""
    b, impl = x.shape[0], p["impl"]
    y = torch.randint(0, max(1, b // 8), (b,), generator=g).to(x.device)
    if impl == "builtin":
        return lambda: flashcl.info_nce_loss(x, k, temperature=T, query_labels=y, key_labels=y, backend="tiled")
    if impl == "flex":
        return lambda: flashcl.flex_loss(
            x,
            k,
            rows={"y": y},
            cols={"y": y},
            exclude=lambda a, c: (a.y == c.y) & (a.index != c.index),
            backend="tiled",
        )

    def dense() -> torch.Tensor:
        logits = F.normalize(x, dim=-1) @ F.normalize(k, dim=-1).T / T
        eye = torch.eye(b, dtype=torch.bool, device=x.device)
        logits = logits.masked_fill((y.unsqueeze(0) == y.unsqueeze(1)) & ~eye, float("-inf"))
        return F.cross_entropy(logits, torch.arange(b, device=x.device))

    return dense


def _window(p: Dict[str, Any], x: torch.Tensor, g: torch.Generator) -> Callable[[], torch.Tensor]:
    """Time-window contrast over a sorted sequence (one sample per time step): positives
    within 2 steps, negatives within ``window`` steps, the rest left out; ``duplicates``:
    the same document's samples (4 each) outside the positives left out too. ``impl``:
    ``flex`` (every tile), ``flex-blocks`` (the tiles of the window only), ``dense``."""
    b, impl, w = x.shape[0], p["impl"], float(p["window"])
    t = torch.arange(b, dtype=torch.float32, device=x.device)
    doc = torch.randint(0, max(1, b // 4), (b,), generator=g).to(x.device)
    dup = bool(p.get("duplicates"))

    def exclude(a: Any, c: Any) -> torch.Tensor:
        far = (a.t - c.t).abs() > w
        return far | ((a.doc == c.doc) & ((a.t - c.t).abs() > 2)) if dup else far

    rows = {"t": t, "doc": doc}
    if impl in ("flex", "flex-blocks"):
        mask = flashcl.BlockMask.from_sorted(t, max_distance=w, block_size=256) if impl == "flex-blocks" else None
        return lambda: flashcl.flex_loss(
            x,
            rows=rows,
            positive=lambda a, c: (a.t - c.t).abs() <= 2,
            exclude=exclude,
            block_mask=mask,
            backend="tiled",
        )

    def dense() -> torch.Tensor:
        z = F.normalize(x, dim=-1)
        logits = z @ z.T / T
        dt = (t.unsqueeze(1) - t.unsqueeze(0)).abs()
        eye = torch.eye(b, dtype=torch.bool, device=x.device)
        out = eye | (dt > w)
        if dup:
            out = out | ((doc.unsqueeze(1) == doc.unsqueeze(0)) & (dt > 2))
        pos = (dt <= 2) & ~out
        log_prob = logits - torch.logsumexp(logits.masked_fill(out, float("-inf")), 1, keepdim=True)
        per_row = -(log_prob * pos).sum(1) / pos.sum(1).clamp_min(1)
        return per_row[pos.any(1)].mean()

    return dense


def flex_workload(p: Dict[str, Any]) -> Tuple[Step, int]:
    """A flex loss or what it is compared with, forward + backward: ``loss`` in
    ``supcon`` / ``info_nce`` / ``window``, ``impl`` in ``builtin`` / ``flex`` /
    ``flex-blocks`` / ``dense``; ``dtype`` the rows' (float32 unless given)."""
    b, d, dev = p["B"], p["D"], case_device(p)
    dtype = getattr(torch, p.get("dtype", "float32"))
    g = case_generator(p)
    x = torch.randn(b, d, generator=g).to(dev, dtype).requires_grad_(True)
    leaves = [x]
    if p["loss"] == "supcon":
        fn = _supcon(p, x, g)
    elif p["loss"] == "info_nce":
        k = torch.randn(b, d, generator=g).to(dev, dtype).requires_grad_(True)
        leaves.append(k)
        fn = _info_nce(p, x, k, g)
    else:
        fn = _window(p, x, g)
    return stepper(fn, leaves, dev), sum(v.numel() * v.element_size() for v in leaves)


WORKLOADS = {"flex": flex_workload}


def flex(mode: str, device: str) -> List[Case]:
    """Flex losses at B = 8,192, D = 768 against the built-in they equal (SupCon with
    symmetric panels, InfoNCE with false negatives left out) and against the three
    matrix products; a time window with a block mask against the full visit (B = 20,480,
    D = 256, 1/16 of the tiles); the dense masked formulas; the memory at B = 65,536."""
    b, d = {"quick": (512, 64), "default": (8192, 768), "full": (8192, 768)}[mode]
    wb, wd = {"quick": (2048, 32), "default": (20480, 256), "full": (20480, 256)}[mode]
    big = {"quick": 4096, "default": 65536, "full": 65536}[mode]
    gemm = {"workload": "gemm3", "params": {"B": b, "D": d, "device": device}}
    cases: List[Case] = []

    def case(group: str, label: str, params: Dict[str, Any], **extra: Any) -> None:
        cases.append(
            {
                "group": group,
                "label": label,
                "workload": "flex",
                "repeats": extra.pop("repeats", 3),
                "cap_s": extra.pop("cap_s", 600.0),
                "params": {"device": device, **params},
                **extra,
            }
        )

    for loss, sym in (("supcon", True), ("info_nce", False)):
        builtin = {"workload": "flex", "params": {"B": b, "D": d, "loss": loss, "impl": "builtin", "device": device}}
        flex_params = {"B": b, "D": d, "loss": loss, "impl": "flex", "symmetric": sym}
        name = "SupCon (labels, symmetric=True)" if loss == "supcon" else "InfoNCE, false negatives out"
        case(f"flex / built-in, {name}, B = {b}, D = {d}", "flex", flex_params, bound=builtin)
        case(f"flex / three GEMMs, {name}, B = {b}, D = {d}", "flex", flex_params, bound=gemm)
    case(
        f"flex / three GEMMs, SupCon (labels, every tile), B = {b}, D = {d}",
        "flex",
        {"B": b, "D": d, "loss": "supcon", "impl": "flex", "symmetric": False},
        bound=gemm,
    )
    # a window of 1.5 tiles each side keeps 5 of 80 tiles per row block (1/16) at B = 20,480
    window = 384 if mode != "quick" else 96
    full_params = {"B": wb, "D": wd, "loss": "window", "window": window, "impl": "flex", "device": device}
    full = {"workload": "flex", "params": full_params}
    case(
        f"time window (|dt| <= {window}): block mask / every tile, B = {wb}, D = {wd}",
        "flex-blocks",
        {"B": wb, "D": wd, "loss": "window", "window": window, "impl": "flex-blocks"},
        bound=full,
    )
    for loss in ("supcon", "info_nce", "window"):
        sizes = (256, 1024) if mode == "quick" else (2048, 8192, 16384)
        for size in sizes:
            for impl in ("flex", "dense"):
                params = {"B": size, "D": 256 if mode != "quick" else 32, "loss": loss, "impl": impl}
                if loss == "window":
                    params.update(window=size // 16, duplicates=True)
                case(
                    f"{loss} as flex / the dense masked formula, D = {params['D']}",
                    impl,
                    params,
                    x="B",
                    repeats=1,
                    stop_after_fail=True,
                )
    case(
        f"memory: time-window positives, same-document negatives out, every tile, D = {wd}",
        "flex",
        {"B": big, "D": wd, "loss": "window", "window": big, "duplicates": True, "impl": "flex"},
        x="B",
        repeats=0,
        cap_s=1800.0,
    )
    return cases
