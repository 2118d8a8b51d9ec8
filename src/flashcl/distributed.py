"""The same exact losses over a batch spread across processes (``torch.distributed``).

Each rank passes its local batch; the loss is the loss over the global batch
(the ranks' batches concatenated in rank order), with positives and negatives
from every rank. Strategy ``"all_gather"``: the candidates are gathered with an
autograd-aware collective (uneven batch sizes allowed), then the tiled core runs
local anchor rows against the global candidate columns, so no rank ever holds
the global score matrix, only the global embeddings.

Gradient convention (``grad_scale``):

* ``"ddp"`` (default): each rank returns ``world_size x`` its share of the global
  loss (for ``reduction="mean"``: its anchors' terms over the global number of
  anchors). The mean of the returned values over ranks is the global loss, and
  DistributedDataParallel's gradient averaging (sum over ranks / world_size)
  then gives exactly the single-process gradient of the global loss, for the
  model and for a learnable temperature alike. The embeddings' gradient on each
  rank is ``world_size x`` the single-process gradient's rows of that rank.
* ``"sum"``: each rank returns its share; the sum over ranks is the global loss
  and each rank's embeddings' gradient equals the single-process gradient's
  rows of that rank. A replicated learnable temperature then needs its
  gradient summed over ranks (``all_reduce``), not averaged.

Every call first checks, with one small collective, that all ranks called the
same loss with the same options, embedding dim and dtype; a mismatch raises a
``ValueError`` on every rank instead of hanging in a later collective. The
collectives use the process group's timeout (``init_process_group(timeout=...)``).
"""
from __future__ import annotations

import hashlib
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from . import checks
from .functional import Scalar
from .core import CoreSpec, autocast_off, compute_dtype
from .tiled import TiledCore, _panel, auto_block

__all__ = ["supcon_loss", "nt_xent_loss", "info_nce_loss", "clip_loss"]

_GRAD_SCALES = ("ddp", "sum")
_STRATEGIES = ("all_gather", "ring")


def _world(group: Any) -> Tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("flashcl.distributed needs an initialised process group (torch.distributed."
                           "init_process_group); for one process use the flashcl.* losses")
    return dist.get_rank(group), dist.get_world_size(group)


def _check_same_call(signature: str, device: torch.device, group: Any) -> None:
    """All ranks must make the same call: compare a digest of its signature."""
    digest = int(hashlib.sha256(signature.encode()).hexdigest()[:12], 16)
    mine = torch.tensor([digest], dtype=torch.int64, device=device)
    _, world = _world(group)
    everyone = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    if any(int(t) != digest for t in everyone):
        raise ValueError(f"flashcl.distributed: the ranks made different calls (loss, options, embedding dim "
                         f"or dtype differ); this rank's call: {signature}")


def _sizes(n: int, device: torch.device, group: Any) -> List[int]:
    _, world = _world(group)
    mine = torch.tensor([n], dtype=torch.int64, device=device)
    everyone = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    return [int(t) for t in everyone]


def _gather_rows(x: Tensor, sizes: List[int], group: Any) -> Tensor:
    """Every rank's rows concatenated in rank order (uneven counts: padded to the
    largest for the collective, then trimmed)."""
    padded = x.new_zeros((max(sizes),) + tuple(x.shape[1:]))
    padded[:x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[:n] for p, n in zip(parts, sizes)])


class _AllGather(torch.autograd.Function):
    """:func:`_gather_rows` with a gradient: backward sums over ranks the
    gradients of this rank's rows."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, sizes: List[int], group: Any) -> Tensor:
        ctx.sizes, ctx.group, ctx.rank = sizes, group, _world(group)[0]
        return _gather_rows(x, sizes, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor):  # type: ignore[override]
        _no_double_backward()
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        start = sum(ctx.sizes[:ctx.rank])
        return grad[start:start + ctx.sizes[ctx.rank]], None, None


def _no_double_backward() -> None:
    if torch.is_grad_enabled():
        raise RuntimeError(
            "flashcl.distributed does not compute second derivatives (backward with create_graph=True, as a "
            "gradient penalty or a Hessian-vector product needs): its collectives' gradients have no graph. "
            "The single-process losses (flashcl.supcon_loss, ...) compute them on every backend.")


def _all_gather_plain(x: Tensor, group: Any) -> Tensor:
    return _gather_rows(x, _sizes(x.shape[0], x.device, group), group)


def _global_count(n: Tensor, group: Any) -> Tensor:
    n = n.clone()
    dist.all_reduce(n, op=dist.ReduceOp.SUM, group=group)
    return n


def _candidates(k_local: Tensor, strategy: str, group: Any) -> Tuple[Tensor, int, List[int]]:
    """(the candidates this rank computes against, this rank's first global column,
    every rank's candidate count): all of them gathered, or only its own (ring)."""
    rank, _ = _world(group)
    sizes = _sizes(k_local.shape[0], k_local.device, group)
    offset = sum(sizes[:rank])
    if strategy == "ring":
        return k_local, offset, sizes
    return _AllGather.apply(k_local, sizes, group), offset, sizes


def _run(q: Tensor, k: Tensor, scale: Tensor, spec: CoreSpec, reduction: str, grad_scale: str,
         block_size: Optional[int], group: Any, valid_weight: Optional[Tensor] = None,
         ring_sizes: Optional[List[int]] = None) -> Tensor:
    """Local rows of the core against global columns, reduced with the global count.
    ``ring_sizes``: k is this rank's block only and the others come round the ring."""
    with autocast_off(q.device.type):
        return _run_now(q, k, scale, spec, reduction, grad_scale, block_size, group, valid_weight, ring_sizes)


def _run_now(q: Tensor, k: Tensor, scale: Tensor, spec: CoreSpec, reduction: str, grad_scale: str,
             block_size: Optional[int], group: Any, valid_weight: Optional[Tensor],
             ring_sizes: Optional[List[int]]) -> Tensor:
    _, world = _world(group)
    m, n = q.shape[0], k.shape[0]
    dtype = compute_dtype(q.dtype)
    block = block_size or auto_block(m, n, dtype)
    factor = float(world) if grad_scale == "ddp" else 1.0
    per_row = None
    if ring_sizes is not None:
        qn, kn = q.to(dtype), k.to(dtype)
        if spec.normalize:
            qn = torch.nn.functional.normalize(qn, dim=1)
            kn = qn if k is q else torch.nn.functional.normalize(kn, dim=1)
        ring_block = block_size or auto_block(m, max(ring_sizes), dtype, self_contrast=True)
        per_row = _RingCore.apply(qn, kn, scale.to(dtype), spec, ring_sizes, group, ring_block)
    if reduction == "none":
        return per_row if per_row is not None else TiledCore.apply(q, k, scale, spec, None, block)
    valid = spec.valid_rows(m).to(device=q.device, dtype=dtype)
    if reduction == "mean":
        total = _global_count(valid.sum().reshape(1), group).clamp_min(1)
        r = valid * (factor / total)
    else:
        r = valid * factor
    if valid_weight is not None:
        r = r * valid_weight
    if per_row is not None:
        return (r * per_row).sum()
    return TiledCore.apply(q, k, scale, spec, (r, None), block)


def _check(grad_scale: str, strategy: str) -> None:
    checks.check_choice(grad_scale, "grad_scale", _GRAD_SCALES)
    checks.check_choice(strategy, "strategy", _STRATEGIES)


def supcon_loss(embeddings: Tensor, labels: Tensor, *, temperature: Scalar = 0.1, positives: str = "mean",
                include_self: bool = False, normalize: bool = True, reduction: str = "mean",
                grad_scale: str = "ddp", strategy: str = "all_gather",
                group: Any = None, block_size: Optional[int] = None) -> Tensor:
    """:func:`flashcl.supcon_loss` over the global batch (see the module docstring).

    Args:
        embeddings: (B_rank, D) this rank's samples (batch sizes may differ by rank).
        labels: (B_rank,) their labels; positives are found on every rank.
        grad_scale: ``"ddp"`` (default) or ``"sum"``; see the module docstring.
        group: the process group (default: the world).
        other arguments: as :func:`flashcl.supcon_loss`.

    Shape:
        - embeddings: (B_rank, D); labels: (B_rank,)
        - output: scalar, or (B_rank,) with ``reduction="none"``

    Examples::

        >>> # in each of the processes of an initialised group:
        >>> loss = flashcl.distributed.supcon_loss(local_emb, local_labels)
    """
    embeddings, labels = checks.validate_labelled(embeddings, labels)
    checks.check_choice(positives, "positives", ("mean", "sum"))
    checks.check_bool(include_self, "include_self")
    checks.check_bool(normalize, "normalize")
    checks.check_choice(reduction, "reduction", checks.REDUCTIONS)
    checks.check_block(block_size)
    _check(grad_scale, strategy)
    scale = 1.0 / checks.check_positive_scalar(temperature, "temperature", embeddings.device,
                                            compute_dtype(embeddings.dtype))
    _check_same_call(f"supcon|{embeddings.shape[1]}|{embeddings.dtype}|{positives}|{include_self}|{normalize}|"
                     f"{reduction}|{grad_scale}|{strategy}|{float(scale.detach()):.12g}", embeddings.device, group)
    return _supcon_core(embeddings, labels, scale, positives, include_self, normalize, reduction, grad_scale,
                        block_size, group, strategy)


def _supcon_core(embeddings: Tensor, labels: Tensor, scale: Tensor, positives: str, include_self: bool,
                 normalize: bool, reduction: str, grad_scale: str, block_size: Optional[int], group: Any,
                 strategy: str) -> Tensor:
    k, offset, sizes = _candidates(embeddings, strategy, group)
    all_labels = _all_gather_plain(labels.long(), group)
    if all_labels.shape[0] < 2 and not include_self:
        raise ValueError("supcon_loss needs at least 2 samples in the global batch when include_self=False")
    uniq, ids = torch.unique(all_labels, return_inverse=True)
    ids = ids.reshape(-1)
    spec = CoreSpec(exclude_self=not include_self, self_pairs=True, offset=offset,
                    row_labels=ids[offset:offset + embeddings.shape[0]], col_labels=ids,
                    num_classes=int(uniq.numel()), pos_mode=positives, normalize=normalize)
    return _run(embeddings, k, scale, spec, reduction, grad_scale, block_size, group,
                ring_sizes=sizes if strategy == "ring" else None)


def nt_xent_loss(z1: Tensor, z2: Tensor, *, temperature: Scalar = 0.07, normalize: bool = True,
                 reduction: str = "mean", grad_scale: str = "ddp", strategy: str = "all_gather",
                group: Any = None,
                 block_size: Optional[int] = None) -> Tensor:
    """:func:`flashcl.nt_xent_loss` over the global batch: every view of every rank is
    a negative; ``z1[i]`` and ``z2[i]`` of the same rank are a pair.

    Shape:
        - z1, z2: (N_rank, D)
        - output: scalar, or (2 N_rank,) with ``reduction="none"`` (rows of z1, then z2)

    Examples::

        >>> loss = flashcl.distributed.nt_xent_loss(view1, view2, temperature=0.5)
    """
    z1, z2 = checks.validate_pair(z1, z2, "z1", "z2")
    checks.check_bool(normalize, "normalize")
    checks.check_choice(reduction, "reduction", checks.REDUCTIONS)
    checks.check_block(block_size)
    _check(grad_scale, strategy)
    scale = 1.0 / checks.check_positive_scalar(temperature, "temperature", z1.device, compute_dtype(z1.dtype))
    _check_same_call(f"nt_xent|{z1.shape[1]}|{z1.dtype}|{normalize}|{reduction}|{grad_scale}|{strategy}|"
                     f"{float(scale.detach()):.12g}", z1.device, group)
    n = z1.shape[0]
    pair_offset = sum(_sizes(n, z1.device, group)[:_world(group)[0]])
    ids = (torch.arange(n, device=z1.device) + pair_offset).repeat(2)
    return _supcon_core(torch.cat([z1, z2]), ids, scale, "sum", False, normalize, reduction, grad_scale,
                        block_size, group, strategy)


def info_nce_loss(query: Tensor, keys: Tensor, positive_index: Optional[Tensor] = None, *,
                  temperature: Scalar = 0.05, normalize: bool = True, reduction: str = "mean",
                  grad_scale: str = "ddp", strategy: str = "all_gather",
                group: Any = None, block_size: Optional[int] = None) -> Tensor:
    """:func:`flashcl.info_nce_loss` over the global batch: each query is scored
    against the keys of every rank; ``positive_index`` indexes this rank's keys.

    Shape:
        - query: (B_rank, D); keys: (N_rank, D); positive_index: (B_rank,) into this rank's keys
        - output: scalar, or (B_rank,) with ``reduction="none"``

    Examples::

        >>> loss = flashcl.distributed.info_nce_loss(q_local, docs_local)
    """
    index = checks.validate_info_nce(query, keys, positive_index)
    checks.check_bool(normalize, "normalize")
    checks.check_choice(reduction, "reduction", checks.REDUCTIONS)
    checks.check_block(block_size)
    _check(grad_scale, strategy)
    scale = 1.0 / checks.check_positive_scalar(temperature, "temperature", query.device, compute_dtype(query.dtype))
    _check_same_call(f"info_nce|{query.shape[1]}|{query.dtype}|{normalize}|{reduction}|{grad_scale}|{strategy}|"
                     f"{float(scale.detach()):.12g}", query.device, group)
    k, offset, sizes = _candidates(keys, strategy, group)
    spec = CoreSpec(index=(index.long() + offset).unsqueeze(1), pos_mode="sum", normalize=normalize)
    return _run(query, k, scale, spec, reduction, grad_scale, block_size, group,
                ring_sizes=sizes if strategy == "ring" else None)


def clip_loss(image_embeds: Tensor, text_embeds: Tensor, logit_scale: Scalar, *, normalize: bool = True,
              reduction: str = "mean", grad_scale: str = "ddp", strategy: str = "all_gather",
                group: Any = None,
              block_size: Optional[int] = None) -> Tensor:
    """:func:`flashcl.clip_loss` over the global batch: both directions against
    the image and text towers of every rank (open_clip's ``gather_with_grad=True``,
    ``local_loss=True`` arrangement, exact).

    Shape:
        - image_embeds, text_embeds: (B_rank, D)
        - output: scalar, or (B_rank,) with ``reduction="none"``

    Examples::

        >>> loss = flashcl.distributed.clip_loss(img_local, txt_local, model.logit_scale.exp())
    """
    image_embeds, text_embeds = checks.validate_pair(image_embeds, text_embeds, "image_embeds", "text_embeds")
    checks.check_bool(normalize, "normalize")
    checks.check_choice(reduction, "reduction", checks.REDUCTIONS)
    checks.check_block(block_size)
    _check(grad_scale, strategy)
    scale = checks.check_positive_scalar(logit_scale, "logit_scale", image_embeds.device,
                                      compute_dtype(image_embeds.dtype))
    _check_same_call(f"clip|{image_embeds.shape[1]}|{image_embeds.dtype}|{normalize}|{reduction}|{grad_scale}|{strategy}|"
                     f"{float(scale.detach()):.12g}", image_embeds.device, group)
    all_text, offset, sizes = _candidates(text_embeds, strategy, group)
    all_image, _, _ = _candidates(image_embeds, strategy, group)
    ring = sizes if strategy == "ring" else None
    b = image_embeds.shape[0]
    index = (torch.arange(b, device=image_embeds.device) + offset).unsqueeze(1)
    spec = CoreSpec(index=index, pos_mode="sum", normalize=normalize)
    if reduction == "none":
        rows = _run(image_embeds, all_text, scale, spec, "none", grad_scale, block_size, group, ring_sizes=ring)
        cols = _run(text_embeds, all_image, scale, spec, "none", grad_scale, block_size, group, ring_sizes=ring)
        return 0.5 * (rows + cols)
    half = torch.full((b,), 0.5, dtype=compute_dtype(image_embeds.dtype), device=image_embeds.device)
    return (_run(image_embeds, all_text, scale, spec, reduction, grad_scale, block_size, group, half, ring)
            + _run(text_embeds, all_image, scale, spec, reduction, grad_scale, block_size, group, half, ring))


# ----------------------------------------------------------------------------- ring

def _peer(group: Any, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _ring_pass(tensors: List[Tensor], shapes: List[Tuple[int, ...]], group: Any) -> List[Tensor]:
    """Send ``tensors`` to the next rank, receive tensors of ``shapes`` from the previous."""
    rank, world = _world(group)
    if world == 1:  # the ring is this rank alone
        return list(tensors)
    nxt, prv = _peer(group, (rank + 1) % world), _peer(group, (rank - 1) % world)
    incoming = [tensors[0].new_empty(shape) for shape in shapes]
    ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, t, prv, group) for t in incoming]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return incoming


class _RingCore(torch.autograd.Function):
    """Row losses of local anchors against the candidates of every rank, with the
    candidate blocks passed around the ring (as Inf-CL does): no rank holds more
    than its own rows and one visiting block. Backward passes each block again,
    with its gradient accumulator travelling along and arriving back at its owner.

    ``apply(q, k, scale, spec, sizes, group, block)``: q (M, D) and k (n_rank, D)
    already normalised; ``spec`` is the core's spec in global column indices
    (offset = this rank's first column; labels: local row ids, global column ids).
    Returns the per-row losses (M,).
    """

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, scale: Tensor, spec: CoreSpec, sizes: List[int],
                group: Any, block: int) -> Tensor:
        rank, world = _world(group)
        s = float(scale)
        m = q.shape[0]
        starts = [sum(sizes[:i]) for i in range(world)]
        lse = q.new_full((m,), float("-inf"))
        raw_pos = q.new_zeros(m)
        current = k.detach()
        buf = q.new_empty(min(block, m) * max(sizes))  # one score buffer for every block
        for step in range(world):
            owner = (rank - step) % world
            _ring_lse_block(q.detach(), current, s, spec, starts[owner], lse, raw_pos, block, buf)
            if step < world - 1:
                nxt = (owner - 1) % world
                (current,) = _ring_pass([current], [(sizes[nxt], k.shape[1])], group)
        raw_pos += _label_positive_raw(q.detach(), k.detach(), spec, group)
        c, a = spec.weights(m, q.dtype)
        ctx.save_for_backward(q, k, scale, lse, raw_pos)
        ctx.spec, ctx.sizes, ctx.group, ctx.block = spec, sizes, group, block
        return c * lse - a * (s * raw_pos)

    @staticmethod
    def backward(ctx: Any, grad: Tensor):  # type: ignore[override]
        _no_double_backward()
        with autocast_off(grad.device.type):
            return _RingCore._backward(ctx, grad)

    @staticmethod
    def _backward(ctx: Any, grad: Tensor) -> Tuple[Optional[Tensor], ...]:
        q, k, scale, lse, raw_pos = ctx.saved_tensors
        spec, sizes, group, block = ctx.spec, ctx.sizes, ctx.group, ctx.block
        rank, world = _world(group)
        s = float(scale)
        m = q.shape[0]
        starts = [sum(sizes[:i]) for i in range(world)]
        c, a = spec.weights(m, q.dtype)
        g_lse, w_pos = grad * c, grad * a
        qd = q.detach()
        dq = torch.zeros_like(qd)
        current, dk_travel = k.detach(), torch.zeros_like(k)
        dscale = qd.new_zeros(())
        buf = qd.new_empty(min(block, m) * max(sizes))
        for step in range(world):
            owner = (rank - step) % world
            dscale += _ring_grad_block(qd, current, s, spec, starts[owner], lse, g_lse, w_pos, dq, dk_travel,
                                       block, buf)
            nxt = (owner - 1) % world
            # the block goes on; after the last step its gradient arrives home
            shape = (sizes[nxt], k.shape[1])
            current, dk_travel = _ring_pass([current, dk_travel], [shape, shape], group)
        dk = dk_travel
        dscale += _label_positive_grad_(qd, k.detach(), s, spec, w_pos, dq, dk, group)
        dscale = dscale - (w_pos * raw_pos).sum()
        need_q, need_k, need_s = ctx.needs_input_grad[:3]
        return (dq if need_q else None, dk if need_k else None, dscale.to(scale.dtype) if need_s else None,
                None, None, None, None)


def _ring_lse_block(q: Tensor, kb: Tensor, s: float, spec: CoreSpec, col0: int, lse: Tensor, raw_pos: Tensor,
                    block: int, buf: Tensor) -> None:
    """Merges the partial row LSE of q against the candidate block kb (global columns
    [col0, col0 + len)) into lse, and adds index positives found in it to raw_pos."""
    n = kb.shape[0]
    for r0 in range(0, q.shape[0], block):
        r1 = min(r0 + block, q.shape[0])
        sc = torch.mm(q[r0:r1] * s, kb.T, out=_panel(buf, r1 - r0, n))
        if spec.exclude_self:
            sc.diagonal(offset=r0 + spec.offset - col0).fill_(float("-inf"))
        torch.logaddexp(lse[r0:r1], torch.logsumexp(sc, dim=1), out=lse[r0:r1])
    if spec.index is not None:
        local = spec.index - col0
        inside = (local >= 0) & (local < n)
        rows, t = inside.nonzero(as_tuple=True)
        if rows.numel():
            raw_pos.index_add_(0, rows, (q[rows] * kb[local[rows, t]]).sum(1))


def _ring_grad_block(q: Tensor, kb: Tensor, s: float, spec: CoreSpec, col0: int, lse: Tensor, g_lse: Tensor,
                     w_pos: Tensor, dq: Tensor, dkb: Tensor, block: int, buf: Tensor) -> Tensor:
    """The block's share of the gradient: LSE terms and index positives in it.
    Returns its part of sum_ij G_ij q_i.k_j."""
    n = kb.shape[0]
    dscale = q.new_zeros(())
    for r0 in range(0, q.shape[0], block):
        r1 = min(r0 + block, q.shape[0])
        g = torch.mm(q[r0:r1] * s, kb.T, out=_panel(buf, r1 - r0, n))
        if spec.exclude_self:
            g.diagonal(offset=r0 + spec.offset - col0).fill_(float("-inf"))
        g.sub_(lse[r0:r1].unsqueeze(1)).exp_().mul_(g_lse[r0:r1].unsqueeze(1))
        gk = g @ kb
        dscale += (gk * q[r0:r1]).sum()
        dq[r0:r1].add_(gk, alpha=s)
        dkb.addmm_(g.T, q[r0:r1], alpha=s)
    if spec.index is not None:
        local = spec.index - col0
        inside = (local >= 0) & (local < n)
        rows, t = inside.nonzero(as_tuple=True)
        if rows.numel():
            w = (w_pos[rows] * s).unsqueeze(1)
            dq.index_add_(0, rows, -w * kb[local[rows, t]])
            dkb.index_add_(0, local[rows, t], -w * q[rows])
    return dscale


def _global_class_sums(x: Tensor, ids: Tensor, num_classes: int, group: Any, weight: Optional[Tensor] = None) -> Tensor:
    out = x.new_zeros(num_classes, x.shape[1])
    out.index_add_(0, ids, x if weight is None else x * weight.unsqueeze(1))
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


def _label_positive_raw(q: Tensor, k: Tensor, spec: CoreSpec, group: Any) -> Tensor:
    """sum over same-label candidates of every rank, from all-reduced class sums
    (this rank's candidates are its anchors: self pairs are local)."""
    if spec.index is not None:
        return q.new_zeros(q.shape[0])
    assert spec.row_labels is not None and spec.col_labels is not None
    mine = spec.col_labels[spec.offset:spec.offset + k.shape[0]]
    sums = _global_class_sums(k, mine, spec.num_classes, group)
    out = (q * sums[spec.row_labels]).sum(1)
    if spec.self_pairs:
        out = out - (q * k).sum(1)
    return out


def _label_positive_grad_(q: Tensor, k: Tensor, s: float, spec: CoreSpec, w: Tensor, dq: Tensor, dk: Tensor,
                          group: Any) -> Tensor:
    if spec.index is not None:
        return q.new_zeros(())
    assert spec.row_labels is not None and spec.col_labels is not None
    mine = spec.col_labels[spec.offset:spec.offset + k.shape[0]]
    k_sums = _global_class_sums(k, mine, spec.num_classes, group)
    wq_sums = _global_class_sums(q, spec.row_labels, spec.num_classes, group, weight=w)
    dq.sub_(k_sums[spec.row_labels] * (w * s).unsqueeze(1))
    dk.sub_(wq_sums[mine], alpha=s)
    if spec.self_pairs:
        dq.add_(k * (w * s).unsqueeze(1))
        dk.add_(q * (w * s).unsqueeze(1))
    return q.new_zeros(())
