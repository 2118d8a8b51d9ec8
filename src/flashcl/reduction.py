"""Reductions of per-row (and per-column) losses to what a loss returns: the
weights of a scalar reduction, formed in one place for every loss."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import lowering
from .core import CoreSpec


def reduce_weights(
    spec: CoreSpec, m: int, reduction: str, dtype: torch.dtype, device: torch.device
) -> Tuple[Tensor, Optional[Tensor]]:
    """(r, u) with loss = sum r * row_loss + sum u * col_loss, for a scalar reduction."""
    if spec.both_directions:
        w = 0.5 / m if reduction == "mean" else 0.5
        full = torch.full((m,), w, dtype=dtype, device=device)
        return full, full
    if reduction == "sum":
        return torch.ones(m, dtype=dtype, device=device), None
    valid = lowering.valid_rows(spec, m).to(device=device, dtype=dtype)
    return valid / valid.sum().clamp_min(1), None


def reduce_core(row: Tensor, col: Optional[Tensor], spec: CoreSpec, reduction: str) -> Tensor:
    if reduction == "none":
        return row if col is None else 0.5 * (row + col)
    r, u = reduce_weights(spec, row.shape[0], reduction, row.dtype, row.device)
    out = (r * row).sum()
    if col is not None:
        assert u is not None
        out = out + (u * col).sum()
    return out


def reduce_rows(rows: Tensor, valid: Tensor, reduction: str) -> Tensor:
    """Per-row losses reduced: ``"mean"`` over the rows that ``valid`` (0/1) keeps."""
    if reduction == "none":
        return rows
    if reduction == "sum":
        return rows.sum()
    return (rows * valid).sum() / valid.sum().clamp_min(1)
