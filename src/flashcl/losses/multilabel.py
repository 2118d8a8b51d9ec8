"""Multi-label SupCon: positives weighted by the Jaccard similarity of multi-hot label
sets, formed tile by tile from the label rows (never B x B; the head:
:class:`flashcl.losses.family_heads.JaccardHead`): the body of
:func:`flashcl.supcon_loss` with (B, C) labels."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import backends, checks, parallel, runner
from ..backends import auto_block
from ..core import compute_dtype
from ..engine.engine import Problem, autocast_off
from ..reference.families import multilabel_rows as _reference
from .family_heads import JaccardHead, jaccard_row_weights

__all__ = ["multilabel_supcon"]


def check_multi_hot(labels: Tensor, like: Tensor, name: str) -> Tensor:
    """(B, C) multi-hot labels (bool or 0/1) as the compute dtype."""
    if labels.dim() != 2 or labels.shape[0] != like.shape[0]:
        raise ValueError(
            f"{name} must be (B,) class ids or (B, C) multi-hot sets with B = {like.shape[0]}, got "
            f"shape {tuple(labels.shape)}"
        )
    checks.same_device(labels, like, name, "embeddings")
    if labels.dtype != torch.bool and not bool(((labels == 0) | (labels == 1)).all()):
        raise ValueError(f"{name} of shape (B, C) must be multi-hot: 0/1 or bool entries")
    return labels.to(compute_dtype(like.dtype))


def multilabel_supcon(
    embeddings: Tensor,
    labels: Tensor,
    scale: Tensor,
    threshold: float,
    positives: str,
    include_self: bool,
    opts: checks.Options,
    ref: Optional[Tensor],
    ref_labels: Optional[Tensor],
) -> Tensor:
    """:func:`flashcl.supcon_loss` with (B, C) multi-hot labels (checked by the caller
    but for the labels' values); ``embeddings`` (B, D) or (B, V, D)."""
    b = embeddings.shape[0]
    views = 1 if embeddings.dim() == 2 else embeddings.shape[1]
    flat = (
        embeddings
        if views == 1 and embeddings.dim() == 2
        else embeddings.transpose(0, 1).reshape(b * views, embeddings.shape[-1])
    )
    y = check_multi_hot(labels, embeddings, "labels").repeat(views, 1)
    y_ref = None
    if ref is not None:
        if ref_labels is None:
            raise ValueError("ref_labels is None: the keys of ref need their label sets")
        y_ref = check_multi_hot(ref_labels, ref, "ref_labels")
        if y_ref.shape[1] != y.shape[1]:
            raise ValueError(f"ref_labels must have the labels' {y.shape[1]} classes, got {y_ref.shape[1]}")
    out = _multilabel(flat, y, ref, y_ref, scale, threshold, positives, include_self, opts)
    if opts.reduction == "none" and embeddings.dim() == 3:
        out = out.reshape(views, b).T
    return out


def _multilabel(
    flat: Tensor,
    y: Tensor,
    ref: Optional[Tensor],
    ref_labels: Optional[Tensor],
    scale: Tensor,
    threshold: float,
    positives: str,
    include_self: bool,
    opts: checks.Options,
) -> Tensor:
    """Multi-label SupCon's body, one process being a world of one: this rank's rows
    against every rank's (and the queue's keys once)."""
    cols = parallel.columns(flat, opts.strategy, opts.process_group, shared=ref)
    yk = cols.gather(y, ref_labels)
    if cols.total - cols.shared < 2 and not include_self and ref is None:
        raise ValueError(
            "supcon_loss needs at least 2 samples when include_self=False (across processes: in the global batch)"
        )
    dtype = compute_dtype(flat.dtype)

    def formula() -> Tensor:
        rows, valid = _reference(
            flat, cols.keys, y, yk, scale, threshold, positives, include_self, opts.normalize, cols.offset
        )
        return runner.reduce(rows, valid, opts.reduction, opts.grad_scale, cols)

    def engine() -> Tensor:
        block = auto_block(y.shape[0], yk.shape[0], dtype)
        c, a, valid_b = jaccard_row_weights(y, yk, threshold, positives, cols.offset, block, dtype)
        head = JaccardHead(y, yk, threshold, c, a, not include_self, cols.offset)
        valid = valid_b.to(dtype)
        r = runner.share(opts.reduction, opts.grad_scale, cols, valid)
        weights = None if r is None else (r, None)
        problem = Problem(head, (), opts.normalize, cols.offset)
        return cols.run(flat, scale, problem, weights, opts.block_size, backend=name)[0]

    impls = {"reference": formula, "dense": engine, "tiled": engine}
    name = backends.pick_name(
        opts.backend, tuple(impls), flat.shape[0] * cols.total, flat, "multi-label supcon_loss", source=cols
    )
    run = impls[name]
    with autocast_off(flat.device.type):
        return run()
