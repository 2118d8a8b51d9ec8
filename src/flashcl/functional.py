"""The public loss functions: validate -> build the core's spec -> choose a backend -> reduce.

Every loss here is one configuration of the masked-softmax core of
:mod:`flashcl.core`::

    loss_i = c_i * LSE_{j in Den(i)} s_ij  -  a_i * sum_{j in Pos(i)} m_ij * s_ij

Backends (argument ``backend``):

* ``"reference"``: per-anchor loops, as a loss is first written by hand. Slow; the tests' oracle.
* ``"dense"``: vectorised, materialises the M x N score matrix.
* ``"tiled"``: blocks of rows, O((M + N) D + block x N) memory, exact.
* ``"triton"``: the tiled algorithm in Triton kernels (CUDA; on a CPU only
  under Triton's interpreter, ``TRITON_INTERPRET=1``, for tests).
* ``"auto"``: ``"triton"`` for CUDA tensors when Triton is importable, the
  dtype is float32/float16/bfloat16 and the embedding at most
  :data:`flashcl.backends.AUTO_TRITON_MAX_WIDTH` (256) wide; else ``"tiled"``
  (on CUDA in half precision: stripes of tensor-core GEMMs) when the score
  matrix has at least :data:`AUTO_TILED_MIN_ENTRIES` entries (M x N),
  ``"dense"`` below; the neighbour loss, whose score matrix is given, always
  uses ``"tiled"`` (it allocates nothing of the matrix's size but the gradient
  itself).

Inputs in float16/bfloat16 are computed with float32 accumulation and the loss
is returned in float32; gradients come back in the input's dtype. A 0-dim
temperature (or logit scale) in a lower precision than the embeddings is
promoted to theirs; its gradient comes back in its own dtype.

Under ``torch.autocast`` the losses run with autocast disabled, in the dtype of
the embeddings they are given (float32 accumulation for half precision), as
torch's own losses do; call ``backward()`` after the autocast region, as torch
recommends (flashcl's own backward passes run without autocast either way).

Second derivatives (``backward(create_graph=True)``: gradient penalties,
Hessian-vector products) are exact on every backend: the tiled and triton
backends compute them through the dense formula, whose memory is O(M N) on that
path only. :mod:`flashcl.distributed` raises a clear error instead.
"""
from __future__ import annotations

import warnings
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from . import backends, checks, dense, matryoshka, reference
from .backends import AUTO_TILED_MIN_ENTRIES
from .core import CoreSpec
from .engine import Problem
from .heads import DebiasedHead, Exclusions, SoftmaxHead, SoftplusHead, Tile
from .linear import Linear, Positives
from .scores import TiledScores, auto_scores_block
from .utils import autocast_off, compute_dtype, normalize_rows

__all__ = [
    "supcon_loss",
    "nt_xent_loss",
    "info_nce_loss",
    "clip_loss",
    "siglip_loss",
    "gist_loss",
    "neighbor_loss",
    "sample_neighbors",
    "run_core",
    "AUTO_TILED_MIN_ENTRIES",
]

Scalar = Union[float, Tensor]

_REDUCTIONS = checks.REDUCTIONS
_BACKENDS = checks.BACKENDS

_SCORE_BACKENDS: Dict[str, Callable[[Tensor, CoreSpec], Tensor]] = {
    "reference": reference.scores_loss,
    "dense": dense.scores_loss,
}


def _scale_dtype(x: Tensor) -> torch.dtype:
    return compute_dtype(x.dtype)


# --------------------------------------------------------------------------- dispatch

def _reduce_weights(spec: CoreSpec, m: int, reduction: str, dtype: torch.dtype,
                    device: torch.device) -> Tuple[Tensor, Optional[Tensor]]:
    """(r, u) with loss = sum r * row_loss + sum u * col_loss, for a scalar reduction."""
    if spec.symmetric:
        w = 0.5 / m if reduction == "mean" else 0.5
        full = torch.full((m,), w, dtype=dtype, device=device)
        return full, full
    if reduction == "sum":
        return torch.ones(m, dtype=dtype, device=device), None
    valid = spec.valid_rows(m).to(device=device, dtype=dtype)
    return valid / valid.sum().clamp_min(1), None


def _reduce(row: Tensor, col: Optional[Tensor], spec: CoreSpec, reduction: str) -> Tensor:
    if reduction == "none":
        return row if col is None else 0.5 * (row + col)
    r, u = _reduce_weights(spec, row.shape[0], reduction, row.dtype, row.device)
    out = (r * row).sum()
    if col is not None:
        assert u is not None
        out = out + (u * col).sum()
    return out


def run_core(q: Tensor, k: Optional[Tensor], scale: Tensor, spec: CoreSpec, reduction: str = "mean",
             backend: str = "auto", block_size: Optional[int] = None) -> Tensor:
    """The masked-softmax core (:class:`flashcl.core.CoreSpec`) on embeddings,
    reduced: the entry point that every loss here (and the integrations) goes
    through. ``k=None`` means the candidates are the anchors; ``scale`` is a
    0-dim tensor (1 / temperature).

    Args:
        q: (M, D) anchors. k: (N, D) candidates, or None.
        scale: 0-dim floating tensor; a learnable one gets its gradient.
        spec: the core's configuration.
        reduction: ``"mean"`` (over the rows :meth:`CoreSpec.valid_rows` keeps) |
            ``"sum"`` | ``"none"`` (per-row losses; for ``spec.symmetric`` the mean
            of each row's and its column's).
        backend: ``"auto"`` | ``"reference"`` | ``"dense"`` | ``"tiled"`` | ``"triton"``
            (see :mod:`flashcl.backends`).
        block_size: rows per block of the tiled backend; None picks one.
    """
    m = q.shape[0]
    n = m if k is None else k.shape[0]
    dtype = compute_dtype(q.dtype)
    problem = spec.problem(m, n, dtype)
    name = backends.resolve(backend, m * n, q.device, q.dtype, q.shape[-1], kernel=problem.head.kernel)
    if name == "reference":
        with autocast_off(q.device.type):
            row, col = reference.core_loss(q, k, scale, spec)
        return _reduce(row, col, spec, reduction)
    weights = None if reduction == "none" else _reduce_weights(spec, m, reduction, dtype, q.device)
    out = backends.run(q, k, scale, problem, name, weights, block_size)
    if reduction == "none":
        return _reduce(out[:m], out[m:] if spec.symmetric else None, spec, "none")
    return out


def _core(q: Tensor, k: Optional[Tensor], scale: Tensor, spec: CoreSpec, reduction: str, backend: str,
          block_size: Optional[int], dims: object, weights: object) -> Tensor:
    """:func:`run_core`, or :func:`matryoshka_core` with ``matryoshka_dims``."""
    if dims is None:
        if weights is not None:
            raise ValueError("matryoshka_weights needs matryoshka_dims")
        return run_core(q, k, scale, spec, reduction, backend, block_size)
    return matryoshka_core(q, k, scale, spec, dims, weights, reduction, backend, block_size)


def _no_matryoshka(dims: object, weights: object, what: str) -> None:
    if dims is not None or weights is not None:
        raise ValueError(f"matryoshka_dims does not combine with {what}")


def matryoshka_core(q: Tensor, k: Optional[Tensor], scale: Tensor, spec: CoreSpec, dims: object, weights: object,
                    reduction: str = "mean", backend: str = "auto", block_size: Optional[int] = None) -> Tensor:
    """``sum_m w_m run_core(q[:, :d_m], k[:, :d_m], ...)``: the core at every prefix
    width ``d_m`` of the embeddings (Matryoshka), each width normalised on its own.
    The tiled backend computes every width in one pass over per-segment partial
    scores (:mod:`flashcl.matryoshka`); ``"reference"`` and ``"dense"`` make one
    call per width."""
    ds, ws = matryoshka.check_dims(dims, weights, q.shape[-1])
    m = q.shape[0]
    n = m if k is None else k.shape[0]
    problem = spec.problem(m, n, compute_dtype(q.dtype))
    name = backends.resolve(backend, m * n, q.device, q.dtype, q.shape[-1], kernel=None)
    if name == "triton":
        raise ValueError("matryoshka_dims has no Triton kernel: use backend='tiled' (one pass over every width) "
                         "or 'auto'")
    if name in ("reference", "dense"):
        total: Optional[Tensor] = None
        for d, w in zip(ds, ws):
            part = w * run_core(q[:, :d], None if k is None else k[:, :d], scale, spec, reduction, name, block_size)
            total = part if total is None else total + part
        assert total is not None
        return total
    dtype = compute_dtype(q.dtype)
    with autocast_off(q.device.type):
        qc = q.to(dtype)
        kc = None if k is None else k.to(dtype)
        aq = matryoshka.prefix_scales(qc, ds, spec.normalize)
        ak = aq if kc is None else matryoshka.prefix_scales(kc, ds, spec.normalize)
        sc = scale.to(dtype)
        out: Optional[Tensor] = None
        if reduction != "none" and not problem.head.has_columns:
            # a scalar: the heads' weighted rows in one call (its gradient formed in the
            # same pass), then each width's positive terms
            r, _ = _reduce_weights(spec, m, reduction, dtype, q.device)
            weights_t = torch.tensor(ws, dtype=dtype, device=q.device).unsqueeze(1) * r.unsqueeze(0)
            out = matryoshka.head_values(qc, kc, aq, ak, scale, problem, ds, block_size, weights_t)
            zeros = torch.zeros(m, dtype=dtype, device=q.device)
            for i, d in enumerate(ds):
                rows, _ = matryoshka.linear_terms(qc, kc, aq, ak, sc, problem, i, d, zeros, None)
                out = out + (weights_t[i] * rows).sum()
            return out
        values = matryoshka.head_values(qc, kc, aq, ak, scale, problem, ds, block_size)
        for i, (d, w) in enumerate(zip(ds, ws)):
            rows = values[i, :m]
            cols = values[i, m:] if problem.head.has_columns else None
            rows, cols = matryoshka.linear_terms(qc, kc, aq, ak, sc, problem, i, d, rows, cols)
            part = w * _reduce(rows, cols, spec, reduction)
            out = part if out is None else out + part
    assert out is not None
    return out


def _dense_ids(labels: Tensor) -> Tuple[Tensor, int]:
    uniq, ids = torch.unique(labels, return_inverse=True)
    return ids.reshape(-1), int(uniq.numel())


# --------------------------------------------------------------------------- losses

def _ids(*label_sets: Tensor) -> Tuple[List[Tensor], int]:
    """Dense class ids over several label tensors at once (one id space)."""
    uniq, ids = torch.unique(torch.cat([x.reshape(-1) for x in label_sets]), return_inverse=True)
    out, start = [], 0
    for x in label_sets:
        out.append(ids[start:start + x.numel()])
        start += x.numel()
    return out, int(uniq.numel())


_warned_small_scale = False


def _warn_small_logit_scale(scale: Tensor) -> None:
    """Warns once when a logit scale is below 1: the multiplier is meant (open_clip
    passes ``logit_scale.exp()``, about 14 to 100), not its log nor a temperature."""
    global _warned_small_scale
    if not _warned_small_scale and float(scale) < 1.0:
        _warned_small_scale = True
        warnings.warn(f"logit_scale={float(scale):.4g} is below 1: it multiplies the cosine similarities (1 / "
                      "temperature; open_clip passes model.logit_scale.exp()). Pass the multiplier, not its log "
                      "nor a temperature. (This warning is shown once.)", stacklevel=3)


def _row_lse(q: Tensor, k: Optional[Tensor], scale: Tensor, head: SoftmaxHead, normalize: bool, name: str,
             block_size: Optional[int]) -> Tensor:
    """Each row's logsumexp over its denominator (the head's exclusions), (M,),
    differentiable: one part of a loss composed of several candidate sets."""
    return backends.run(q, k, scale, Problem(head, (), normalize), name, None, block_size)


def _unit(x: Tensor, normalize: bool) -> Tensor:
    x = x.to(compute_dtype(x.dtype))
    return normalize_rows(x) if normalize else x


def _reduce_rows(rows: Tensor, valid: Tensor, reduction: str) -> Tensor:
    if reduction == "none":
        return rows
    if reduction == "sum":
        return rows.sum()
    return (rows * valid).sum() / valid.sum().clamp_min(1)


def _check_keys(keys: object, name: str, like: Tensor) -> Tensor:
    keys = checks.check_float_tensor(keys, name, (2,))
    if keys.shape[1] != like.shape[-1]:
        raise ValueError(f"{name} must be {like.shape[-1]} wide (the embeddings' width), got {keys.shape[1]}")
    if keys.dtype != like.dtype:
        raise TypeError(f"{name} must have the embeddings' dtype {like.dtype}, got {keys.dtype}")
    checks.same_device(keys, like, name, "embeddings")
    return keys


def _supcon_with_ref(embeddings: Tensor, labels: Tensor, scale: Tensor, positives: str, include_self: bool,
                     normalize: bool, reduction: str, backend: str, block_size: Optional[int],
                     ref: Optional[Tensor], ref_labels: Optional[Tensor], ref_self: Optional[Tensor]) -> Tensor:
    """:func:`supcon_loss` with keys without gradient (see its ``ref`` arguments)."""
    if embeddings.dim() != 2:
        raise ValueError(f"ref takes 2-D embeddings (B, D), got shape {tuple(embeddings.shape)}")
    if ref is None:
        raise ValueError("ref_labels / ref_self need ref (the keys)")
    ref = _check_keys(ref, "ref", embeddings).detach()
    if ref_labels is None:
        raise ValueError("ref_labels is None: the keys of ref need their labels")
    ref, ref_labels = checks.validate_labelled(ref, ref_labels, names=("ref", "ref_labels"))
    b, n = embeddings.shape[0], ref.shape[0]
    (row_ids, col_ids), num_classes = _ids(labels, ref_labels)
    dtype = compute_dtype(embeddings.dtype)
    if ref_self is not None:
        ref_self = checks.check_index_tensor(ref_self, "ref_self")
        if ref_self.shape != (b,):
            raise ValueError(f"ref_self must have shape ({b},), got {tuple(ref_self.shape)}")
        checks.same_device(ref_self, embeddings, "ref_self", "embeddings")
        if bool(((ref_self < -1) | (ref_self >= n)).any()):
            raise ValueError(f"ref_self values must be rows of ref in [0, {n}), or -1")
        spec = CoreSpec(exclude_self=not include_self, self_pairs=True, row_labels=row_ids, col_labels=col_ids,
                        num_classes=num_classes, pos_mode=positives, normalize=normalize, self_index=ref_self.long())
        return run_core(embeddings, ref, scale, spec, reduction, backend, block_size)
    name = backends.resolve(backend, b * (b + n), embeddings.device, embeddings.dtype, embeddings.shape[1])
    if name == "reference":
        with autocast_off(embeddings.device.type):
            rows, valid = reference.supcon_with_keys(embeddings, labels, ref, ref_labels, scale, positives,
                                                     include_self, normalize)
        return _reduce_rows(rows, valid, reduction)
    with autocast_off(embeddings.device.type):
        own = Positives(row_labels=row_ids, col_labels=row_ids, num_classes=num_classes, self_pairs=True)
        keys = Positives(row_labels=row_ids, col_labels=col_ids, num_classes=num_classes)
        ones = torch.ones(b, dtype=dtype, device=embeddings.device)
        lse = torch.logaddexp(
            _row_lse(embeddings, None, scale, SoftmaxHead(ones, exclude_self=not include_self), normalize, name,
                     block_size),
            _row_lse(embeddings, ref, scale, SoftmaxHead(ones), normalize, name, block_size))
        q, r = _unit(embeddings, normalize), _unit(ref, normalize)
        pos = own.sums(q, q) + keys.sums(q, r)
        counts = (own.counts(b, b) + keys.counts(b, n)).to(dtype)
        if positives == "mean":
            valid = counts > 0
            rows = torch.where(valid, lse - scale.to(dtype) * pos / counts.clamp_min(1), torch.zeros_like(lse))
        else:
            valid = torch.ones_like(counts, dtype=torch.bool)
            rows = lse - scale.to(dtype) * pos
        return _reduce_rows(rows, valid.to(dtype), reduction)


def supcon_loss(
    embeddings: Tensor,
    labels: Tensor,
    *,
    temperature: Scalar = 0.1,
    positives: str = "mean",
    include_self: bool = False,
    normalize: bool = True,
    reduction: str = "mean",
    backend: str = "auto",
    block_size: Optional[int] = None,
    ref: Optional[Tensor] = None,
    ref_labels: Optional[Tensor] = None,
    ref_self: Optional[Tensor] = None,
    matryoshka_dims: Optional[Sequence[int]] = None,
    matryoshka_weights: Optional[Sequence[float]] = None,
) -> Tensor:
    r"""Supervised contrastive loss: samples with the same label are positives.

    With ``s_ij = z_i . z_j / temperature`` (``z`` the L2-normalised embeddings)
    and ``P(i) = {j != i : y_j = y_i}``, the loss of anchor ``i`` is::

        positives="mean":  LSE_{j in Den(i)} s_ij - (1/|P(i)|) sum_{p in P(i)} s_ip
        positives="sum":   LSE_{j in Den(i)} s_ij - sum_{p in P(i)} s_ip

    where ``Den(i)`` is every sample but ``i`` (``include_self=False``) or every
    sample (``include_self=True``). The defaults are SupCon's ``L_out`` (Khosla
    et al., 2020). ``positives="sum", include_self=True, temperature=0.05`` is
    the supervised SimCSE loss as it is commonly written (every same-label
    sample's score subtracted from a logsumexp over the whole batch, self
    included), every anchor counted.

    With ``positives="mean"``, anchors without any positive have an undefined
    term: their per-anchor loss is 0 and ``reduction="mean"`` averages over the
    other anchors only; if no anchor has a positive, the loss is 0 with a zero
    gradient (never NaN). A batch whose samples all share one label (no
    negative) keeps the formula's value, which is positive;
    pytorch-metric-learning's ``SupConLoss`` returns 0 there, and so does
    :class:`flashcl.integrations.pytorch_metric_learning.SupConLoss`.

    Args:
        embeddings: (B, D), or (B, V, D) for V views of each sample that share
            its label (SupContrast's convention: the B * V views are all anchors).
        labels: (B,) integer class labels.
        temperature: float or 0-dim tensor (a learnable temperature gets its
            gradient). Default: 0.1.
        positives: ``"mean"`` (default) or ``"sum"`` over each anchor's positives.
        include_self: keep ``j = i`` in the denominator. Default: False.
        normalize: L2-normalise the embeddings first. Default: True.
        reduction: ``"mean"`` | ``"sum"`` | ``"none"`` (per-anchor losses).
        backend: ``"auto"`` (default: ``"triton"`` for CUDA tensors up to D = 256 when
            Triton is installed, else ``"tiled"`` from 2^20 score entries, ``"dense"`` below) |
            ``"reference"`` (per-anchor loops) | ``"dense"`` (the B x B matrix) |
            ``"tiled"`` (row blocks, O(B) memory) | ``"triton"`` (GPU kernels).
        block_size: rows per block of the tiled backend; None picks one.

        ref: (N, D) keys without gradient (a queue, :class:`flashcl.MemoryBank`):
            each anchor is contrasted with the batch itself and with these keys
            (same label: positive). Requires ``ref_labels``; 2-D embeddings.
        ref_labels: (N,) the keys' labels.
        ref_self: (B,) the row of ``ref`` that holds each anchor itself, for a queue
            that already holds the current batch (:meth:`flashcl.MemoryBank.push`
            returns them): then the anchors are contrasted with ``ref`` only, each
            anchor's own entry left out (pytorch-metric-learning's
            ``CrossBatchMemory``); -1 for an anchor not in it.
        matryoshka_dims: prefix widths ``d_m`` of the embeddings (Matryoshka
            representation learning): the loss becomes ``sum_m w_m loss(x[..., :d_m])``,
            each width normalised on its own, all widths in one pass on the tiled
            backend. Default: None (the full width only).
        matryoshka_weights: the weights ``w_m`` (default 1 each).

    Shape:
        - embeddings: (B, D) or (B, V, D)
        - labels: (B,); ref: (N, D); ref_labels: (N,); ref_self: (B,)
        - output: scalar, or (B,) / (B, V) with ``reduction="none"``

    Examples::

        >>> emb = torch.randn(8, 16, requires_grad=True)
        >>> labels = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> loss = flashcl.supcon_loss(emb, labels, temperature=0.1)
        >>> loss.backward()
    """
    embeddings, labels = checks.validate_labelled(embeddings, labels, (2, 3))
    checks.check_choice(positives, "positives", ("mean", "sum"))
    checks.check_bool(include_self, "include_self")
    checks.check_bool(normalize, "normalize")
    checks.check_choice(reduction, "reduction", _REDUCTIONS)
    checks.check_choice(backend, "backend", _BACKENDS)
    checks.check_block(block_size)
    b = embeddings.shape[0]
    scale = 1.0 / checks.check_positive_scalar(temperature, "temperature", embeddings.device, _scale_dtype(embeddings))
    if ref is not None or ref_labels is not None or ref_self is not None:
        _no_matryoshka(matryoshka_dims, matryoshka_weights, "ref (keys without gradient)")
        return _supcon_with_ref(embeddings, labels, scale, positives, include_self, normalize, reduction, backend,
                                block_size, ref, ref_labels, ref_self)
    views = 1
    flat = embeddings
    if embeddings.dim() == 3:
        views = embeddings.shape[1]
        if views == 0:
            raise ValueError(f"embeddings must have at least one view, got shape {tuple(embeddings.shape)}")
        flat = embeddings.transpose(0, 1).reshape(b * views, embeddings.shape[2])
    if flat.shape[0] < 2 and not include_self:
        raise ValueError("supcon_loss needs at least 2 samples (views) when include_self=False: "
                         "the denominator of a single sample is empty")
    ids, num_classes = _dense_ids(labels)
    ids = ids.repeat(views)
    spec = CoreSpec(exclude_self=not include_self, self_pairs=True, row_labels=ids, col_labels=ids,
                    num_classes=num_classes, pos_mode=positives, normalize=normalize)
    out = _core(flat, None, scale, spec, reduction, backend, block_size, matryoshka_dims, matryoshka_weights)
    if reduction == "none" and embeddings.dim() == 3:
        out = out.reshape(views, b).T
    return out


def nt_xent_loss(
    z1: Tensor,
    z2: Tensor,
    *,
    temperature: Scalar = 0.07,
    normalize: bool = True,
    reduction: str = "mean",
    backend: str = "auto",
    block_size: Optional[int] = None,
    estimator: str = "standard",
    tau_plus: float = 0.1,
    beta: float = 1.0,
    decoupled: bool = False,
    weighting: Optional[str] = None,
    sigma: float = 0.5,
) -> Tensor:
    r"""NT-Xent (SimCLR; unsupervised SimCSE): two views, each other's positive.

    The 2N views ``z = cat(z1, z2)`` are all anchors; anchor ``i``'s positive is
    its other view ``p(i) = (i + N) mod 2N`` and its denominator every other view::

        loss_i = LSE_{j != i} s_ij - s_{i p(i)},   s_ij = z_i . z_j / temperature

    Equal to :func:`supcon_loss` with the pair ids as labels. Variants for the
    negatives that are not (false negatives, too easy negatives):

    * ``estimator="debiased"`` (Chuang et al., 2020) and ``"hard"`` (Robinson et
      al., 2021, importance weights ``e^{beta s}`` on the negatives): with the ``N =
      2N_pairs - 2`` negatives ``n`` of anchor ``i`` and ``R_i = N sum_n e^{(beta+1) s_in}
      / sum_n e^{beta s_in}`` (``beta = 0`` for "debiased")::

          Ng_i   = max((R_i - tau_plus N e^{s_ip}) / (1 - tau_plus), N e^{-1/temperature})  # bound: a constant
          loss_i = -log(e^{s_ip} / (e^{s_ip} + Ng_i))

      computed as logsumexps, finite where the formula in exp space overflows.
    * ``decoupled=True`` (Yeh et al., 2022, DCL): the positive leaves the
      denominator: ``loss_i = LSE_{j != i, p(i)} s_ij - w_i s_{i p(i)}``, with
      ``weighting="vmf"`` (DCLW) ``w_i = 2 - N_pairs softmax_pairs(z1_k . z2_k / sigma)``
      (without gradient), else ``w_i = 1``.

    Args:
        z1, z2: (N, D) the two views; ``z1[i]`` and ``z2[i]`` are a pair.
        temperature: float or 0-dim tensor. Default: 0.07.
        normalize: L2-normalise first. Default: True.
        reduction: ``"mean"`` | ``"sum"`` | ``"none"``.
        backend: ``"auto"`` (default: ``"triton"`` for CUDA tensors up to D = 256 when
            Triton is installed, else ``"tiled"`` from 2^20 score entries, ``"dense"`` below) |
            ``"reference"`` (per-anchor loops) | ``"dense"`` (the B x B matrix) |
            ``"tiled"`` (row blocks, O(B) memory) | ``"triton"`` (GPU kernels; not
            for the debiased and hard estimators).
        block_size: rows per block of the tiled backend; None picks one.
        estimator: ``"standard"`` | ``"debiased"`` | ``"hard"``.
        tau_plus: the class prior of a false negative, in [0, 1). Default: 0.1.
        beta: the hardness of ``"hard"``, >= 0. Default: 1.0.
        decoupled: the positive out of the denominator. Default: False.
        weighting: ``None`` | ``"vmf"`` (decoupled only).
        sigma: the vMF weighting's scale. Default: 0.5.

    Shape:
        - z1, z2: (N, D)
        - output: scalar, or (2N,) with ``reduction="none"`` (rows of z1, then z2)

    Examples::

        >>> z1, z2 = torch.randn(4, 16), torch.randn(4, 16)
        >>> loss = flashcl.nt_xent_loss(z1, z2, temperature=0.5)
        >>> loss = flashcl.nt_xent_loss(z1, z2, temperature=0.5, estimator="hard", tau_plus=0.1, beta=1.0)
        >>> loss = flashcl.nt_xent_loss(z1, z2, temperature=0.5, decoupled=True, weighting="vmf")
    """
    z1, z2 = checks.validate_pair(z1, z2, "z1", "z2")
    checks.check_bool(normalize, "normalize")
    checks.check_choice(reduction, "reduction", _REDUCTIONS)
    checks.check_choice(backend, "backend", _BACKENDS)
    checks.check_block(block_size)
    checks.check_choice(estimator, "estimator", ("standard", "debiased", "hard"))
    checks.check_bool(decoupled, "decoupled")
    if weighting is not None:
        checks.check_choice(weighting, "weighting", ("vmf",))
        if not decoupled:
            raise ValueError("weighting='vmf' weighs the positive of the decoupled loss: pass decoupled=True")
    for value, name, low, high in ((tau_plus, "tau_plus", 0.0, 1.0), (beta, "beta", 0.0, float("inf")),
                                   (sigma, "sigma", 0.0, float("inf"))):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (low <= value < high):
            raise ValueError(f"{name} must be a float in [{low}, {high}), got {value!r}")
    if sigma <= 0:
        raise ValueError(f"sigma must be > 0, got {sigma!r}")
    if estimator != "standard" and decoupled:
        raise ValueError("the debiased and hard estimators reweigh the negatives of the standard denominator: "
                         "use them with decoupled=False")
    scale = 1.0 / checks.check_positive_scalar(temperature, "temperature", z1.device, _scale_dtype(z1))
    n = z1.shape[0]
    if estimator != "standard" and n < 2:
        raise ValueError("the debiased and hard estimators need at least 2 pairs (2 negatives per anchor)")
    if decoupled and n < 2:
        raise ValueError("decoupled=True needs at least 2 pairs: with one pair the denominator without the "
                         "positive is empty (the loss would be -inf)")
    z = torch.cat([z1, z2])
    partner = (torch.arange(2 * n, device=z.device) + n) % (2 * n)
    index = partner.unsqueeze(1)
    if estimator == "standard" and not decoupled:
        spec = CoreSpec(exclude_self=True, self_pairs=True, index=index, pos_mode="sum", normalize=normalize)
        return run_core(z, None, scale, spec, reduction, backend, block_size)
    dtype = compute_dtype(z.dtype)
    if decoupled:
        weight = None
        if weighting == "vmf":
            with torch.no_grad():
                sim = (_unit(z1.detach(), True) * _unit(z2.detach(), True)).sum(1) / sigma
                w = 2.0 - n * torch.softmax(sim, dim=0)
            weight = torch.cat([w, w]).to(dtype)
        spec = CoreSpec(exclude_self=True, self_pairs=True, index=index, pos_mode="sum", normalize=normalize,
                        exclude=Exclusions(index=index), positive_weight=weight)
        return run_core(z, None, scale, spec, reduction, backend, block_size)
    beta_ = 0.0 if estimator == "debiased" else float(beta)
    name = backends.resolve(backend, 4 * n * n, z.device, z.dtype, z.shape[1], kernel=None)
    if name == "reference":
        with autocast_off(z.device.type):
            rows = reference.nt_xent_estimator(z, partner, scale, float(tau_plus), beta_, normalize)
        return _reduce_rows(rows, torch.ones_like(rows), reduction)
    head = DebiasedHead(partner, float(tau_plus), beta_, 2 * n - 2, float(scale.detach()))
    weights = None
    if reduction != "none":
        weights = (torch.full((2 * n,), 1.0 / (2 * n) if reduction == "mean" else 1.0, dtype=dtype,
                              device=z.device), None)
    # the rows against every view: the candidates as a second tensor, not the symmetric path
    return backends.run(z, z, scale, Problem(head, (), normalize), name, weights, block_size)


def _same_label_mask(q_ids: Tensor, k_ids: Tensor, index: Tensor) -> Callable[[Tile], Tensor]:
    """The tile mask of keys that share the query's label, the positive excepted."""
    def mask(tile: Tile) -> Tensor:
        same = q_ids[tile.r0:tile.r1].unsqueeze(1) == k_ids[tile.c0:tile.c1].unsqueeze(0)
        cols = torch.arange(tile.c0, tile.c1, device=same.device).unsqueeze(0)
        return same & (cols != index[tile.r0:tile.r1].unsqueeze(1))
    return mask


def _info_nce_with_negatives(query: Tensor, keys: Tensor, negatives: Tensor, scale: Tensor, spec: CoreSpec,
                             in_batch: bool, reduction: str, backend: str, block_size: Optional[int]) -> Tensor:
    """InfoNCE whose denominators also hold ``negatives`` (no gradient): the keys' part
    and the negatives' part, each a logsumexp over tiles, merged per row."""
    b, n, k = query.shape[0], keys.shape[0], negatives.shape[0]
    masks_from_data = spec.exclude is not None and spec.exclude.fn is not None
    name = backends.resolve(backend, b * (n + k), query.device, query.dtype, query.shape[1],
                            kernel=None if masks_from_data else "softmax")
    dtype = compute_dtype(query.dtype)
    if name == "reference":
        with autocast_off(query.device.type):
            rows, valid = reference.info_nce_with_negatives(query, keys, negatives, scale, spec, in_batch)
        return _reduce_rows(rows, valid, reduction)
    with autocast_off(query.device.type):
        q, kk = _unit(query, spec.normalize), _unit(keys, spec.normalize)
        pos_spec = spec.positives()
        pos = pos_spec.sums(q, kk)
        counts = pos_spec.counts(b, n).to(dtype)
        ones = torch.ones(b, dtype=dtype, device=query.device)
        lse_neg = _row_lse(query, negatives, scale, SoftmaxHead(ones), spec.normalize, name, block_size)
        if in_batch:
            lse_keys = _row_lse(query, keys, scale, SoftmaxHead(ones, exclude=spec.exclude), spec.normalize, name,
                                block_size)
        else:  # MoCo: the keys' part is each query's positive alone
            lse_keys = scale.to(dtype) * pos
        lse = torch.logaddexp(lse_keys, lse_neg)
        a = 1.0 / counts.clamp_min(1) if spec.pos_mode == "mean" else torch.ones_like(counts)
        rows = lse - scale.to(dtype) * a * pos
        return _reduce_rows(rows, (counts > 0).to(dtype), reduction)


def info_nce_loss(
    query: Tensor,
    keys: Tensor,
    positive_index: Optional[Tensor] = None,
    *,
    temperature: Scalar = 0.05,
    normalize: bool = True,
    reduction: str = "mean",
    backend: str = "auto",
    block_size: Optional[int] = None,
    negatives: Optional[Tensor] = None,
    in_batch_negatives: bool = True,
    query_labels: Optional[Tensor] = None,
    key_labels: Optional[Tensor] = None,
    duplicates: str = "mask",
    matryoshka_dims: Optional[Sequence[int]] = None,
    matryoshka_weights: Optional[Sequence[float]] = None,
) -> Tensor:
    r"""InfoNCE with in-batch negatives and optional extra hard negatives.

    Row ``i`` of ``query`` is scored against every row of ``keys``; its positive
    is ``keys[positive_index[i]]`` (default ``i``); rows of ``keys`` past B are
    extra (hard) negatives. Exactly::

        F.cross_entropy(q_hat @ k_hat.T / temperature, positive_index)

    with ``q_hat, k_hat`` the L2-normalised rows, without the B x N matrix on
    the tiled backend.

    Args:
        query: (B, D).
        keys: (N, D), N >= B.
        positive_index: (B,) integer column of each row's positive; default arange(B).
        temperature: float or 0-dim tensor. Default: 0.05.
        normalize: L2-normalise first. Default: True.
        reduction: ``"mean"`` | ``"sum"`` | ``"none"``.
        backend: ``"auto"`` (default: ``"triton"`` for CUDA tensors up to D = 256 when
            Triton is installed, else ``"tiled"`` from 2^20 score entries, ``"dense"`` below) |
            ``"reference"`` (per-anchor loops) | ``"dense"`` (the B x B matrix) |
            ``"tiled"`` (row blocks, O(B) memory) | ``"triton"`` (GPU kernels).
        block_size: rows per block of the tiled backend; None picks one.

        negatives: (K, D) more negatives without gradient (a queue,
            :class:`flashcl.MemoryBank`: MoCo's), in every row's denominator.
        in_batch_negatives: the rows of ``keys`` other than a query's positive are
            its negatives. Default: True. False (with ``negatives``) is MoCo's loss:
            each query against its own key and the queue only.
        query_labels, key_labels: (B,) and (N,) labels, both or neither: keys that
            share a query's label are not its negatives (a duplicate, a same-class
            text). The positive must share its query's label.
        duplicates: what becomes of those keys: ``"mask"`` (default): left out of
            the denominator; ``"positive"``: positives, the loss subtracting the mean
            of the positives' scores (as SupCon).
        matryoshka_dims: prefix widths ``d_m`` of the embeddings (Matryoshka
            representation learning): the loss becomes ``sum_m w_m loss(x[..., :d_m])``,
            each width normalised on its own, all widths in one pass on the tiled
            backend. Default: None (the full width only).
        matryoshka_weights: the weights ``w_m`` (default 1 each).

    Shape:
        - query: (B, D); keys: (N, D); positive_index: (B,); negatives: (K, D);
          query_labels: (B,); key_labels: (N,)
        - output: scalar, or (B,) with ``reduction="none"``

    Examples::

        >>> q, docs = torch.randn(4, 16), torch.randn(12, 16)  # 8 hard negatives
        >>> loss = flashcl.info_nce_loss(q, docs, temperature=0.05)
        >>> loss = flashcl.info_nce_loss(q, docs, temperature=0.05, matryoshka_dims=[16, 8, 4])
    """
    index = checks.validate_info_nce(query, keys, positive_index)
    checks.check_bool(normalize, "normalize")
    checks.check_choice(reduction, "reduction", _REDUCTIONS)
    checks.check_choice(backend, "backend", _BACKENDS)
    checks.check_block(block_size)
    scale = 1.0 / checks.check_positive_scalar(temperature, "temperature", query.device, _scale_dtype(query))
    checks.check_bool(in_batch_negatives, "in_batch_negatives")
    checks.check_choice(duplicates, "duplicates", ("mask", "positive"))
    index = index.long()
    spec = CoreSpec(index=index.unsqueeze(1), pos_mode="sum", normalize=normalize)
    if (query_labels is None) != (key_labels is None):
        raise ValueError("query_labels and key_labels go together: pass both or neither")
    if query_labels is not None:
        _, query_labels = checks.validate_labelled(query, query_labels, names=("query", "query_labels"))
        _, key_labels = checks.validate_labelled(keys, key_labels, names=("keys", "key_labels"))
        (q_ids, k_ids), num_classes = _ids(query_labels, key_labels)
        if bool((k_ids[index] != q_ids).any()):
            raise ValueError("each query's positive key must share its label (key_labels[positive_index] == "
                             "query_labels)")
        if duplicates == "positive":
            spec = CoreSpec(row_labels=q_ids, col_labels=k_ids, num_classes=num_classes, pos_mode="mean",
                            normalize=normalize)
        else:
            spec = CoreSpec(index=index.unsqueeze(1), pos_mode="sum", normalize=normalize,
                            exclude=Exclusions(fn=_same_label_mask(q_ids, k_ids, index)))
    if not in_batch_negatives and negatives is None:
        raise ValueError("in_batch_negatives=False leaves each query its positive alone: pass negatives")
    if not in_batch_negatives and query_labels is not None:
        raise ValueError("in_batch_negatives=False takes no labels (each query's keys are its positive only)")
    if negatives is None:
        return _core(query, keys, scale, spec, reduction, backend, block_size, matryoshka_dims, matryoshka_weights)
    _no_matryoshka(matryoshka_dims, matryoshka_weights, "negatives (keys without gradient)")
    negatives = _check_keys(negatives, "negatives", query).detach()
    return _info_nce_with_negatives(query, keys, negatives, scale, spec, in_batch_negatives, reduction, backend,
                                    block_size)


def _guide_mask(gq: Tensor, gk: Tensor, threshold: Tensor, keep_positive: bool) -> Callable[[Tile], Tensor]:
    """The tile mask of candidates whose guide similarity exceeds the row's threshold
    (the positive, column ``i`` of row ``i``, kept when ``keep_positive``)."""
    def mask(tile: Tile) -> Tensor:
        out = (gq[tile.r0:tile.r1] @ gk[tile.c0:tile.c1].T) > threshold[tile.r0:tile.r1].unsqueeze(1)
        if keep_positive:
            out.diagonal(offset=tile.r0 - tile.c0).fill_(False)
        return out
    return mask


def gist_loss(
    anchor: Tensor,
    positive: Tensor,
    negative: Optional[Tensor] = None,
    *,
    guide: Tuple[Tensor, ...],
    temperature: Scalar = 0.01,
    margin: float = 0.0,
    margin_strategy: str = "absolute",
    contrast_anchors: bool = True,
    contrast_positives: bool = True,
    reduction: str = "mean",
    backend: str = "auto",
    block_size: Optional[int] = None,
) -> Tensor:
    r"""GISTEmbed (Solatorio, 2024): InfoNCE over in-batch candidates from which a
    guide model removes the false negatives.

    A text's in-batch "negatives" often include paraphrases of its positive. A
    second, frozen model (the guide) scores every pair; a candidate whose guide
    similarity to the anchor exceeds the guide similarity of the anchor's own
    positive (minus a margin) leaves the denominator. With cosine similarities
    ``s``, guide similarities ``g`` and ``t_i = g(a_i, p_i) - margin`` (``"relative"``:
    ``- |g(a_i, p_i)| margin``)::

        loss_i = LSE over the kept candidates of s / temperature - s(a_i, p_i) / temperature

    the candidates being ``p_j`` (``p_i`` always kept), ``a_j`` (``contrast_anchors``),
    ``n_j`` (``negative``), and from the positive's side ``s(p_i, p_j)``
    (``contrast_positives``), each kept when its guide similarity is ``<= t_i``.
    This is sentence-transformers' ``GISTEmbedLoss`` (6.x) on embeddings, without the
    B x B x D broadcast and B x B matrices: the guide's similarities are computed
    tile by tile with the scores.

    Args:
        anchor, positive: (B, D) the model's embeddings of the pairs.
        negative: (K, D) the model's embeddings of hard negatives, or None.
        guide: the guide model's embeddings of the same texts, ``(anchor, positive)``
            or ``(anchor, positive, negative)`` (any width of their own, no gradient).
        temperature: the softmax temperature. Default: 0.01.
        margin: the margin of the false-negative filter. Default: 0.0.
        margin_strategy: ``"absolute"`` (default) | ``"relative"``.
        contrast_anchors: anchors are each other's candidates. Default: True.
        contrast_positives: positives are each other's candidates. Default: True.
        reduction: ``"mean"`` | ``"sum"`` | ``"none"``.
        backend: ``"auto"`` | ``"reference"`` | ``"dense"`` | ``"tiled"`` (the guide's
            masks have no Triton kernel).
        block_size: rows per block of the tiled backend; None picks one.

    Shape:
        - anchor, positive: (B, D); negative: (K, D); guide: (B, G), (B, G)[, (K, G)]
        - output: scalar, or (B,) with ``reduction="none"``

    Examples::

        >>> a, p, n = torch.randn(4, 16), torch.randn(4, 16), torch.randn(4, 16)
        >>> ga, gp, gn = torch.randn(4, 8), torch.randn(4, 8), torch.randn(4, 8)
        >>> loss = flashcl.gist_loss(a, p, guide=(ga, gp), temperature=0.05)
        >>> loss = flashcl.gist_loss(a, p, n, guide=(ga, gp, gn), margin=0.1, margin_strategy="relative")
    """
    anchor, positive = checks.validate_pair(anchor, positive, "anchor", "positive")
    if negative is not None:
        negative = _check_keys(negative, "negative", anchor)
    for flag, flag_name in ((contrast_anchors, "contrast_anchors"), (contrast_positives, "contrast_positives")):
        checks.check_bool(flag, flag_name)
    checks.check_choice(margin_strategy, "margin_strategy", ("absolute", "relative"))
    checks.check_choice(reduction, "reduction", _REDUCTIONS)
    checks.check_choice(backend, "backend", _BACKENDS)
    checks.check_block(block_size)
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or margin != margin:
        raise ValueError(f"margin must be a float, got {margin!r}")
    if not isinstance(guide, (tuple, list)) or len(guide) != (2 if negative is None else 3):
        raise ValueError("guide must hold the guide model's embeddings of each input: (anchor, positive)"
                         + ("" if negative is None else ", negative") + f"; got {type(guide).__name__}"
                         + (f" of {len(guide)}" if isinstance(guide, (tuple, list)) else ""))
    names = ("guide[0] (anchor)", "guide[1] (positive)", "guide[2] (negative)")
    guides = [checks.check_float_tensor(g, names[t], (2,)).detach() for t, g in enumerate(guide)]
    for t, (g, x) in enumerate(zip(guides, (anchor, positive, negative))):
        assert x is not None
        if g.shape[0] != x.shape[0] or g.shape[1] != guides[0].shape[1]:
            raise ValueError(f"{names[t]} must have shape ({x.shape[0]}, {guides[0].shape[1]}) (one row per input "
                             f"row, the guide's width), got {tuple(g.shape)}")
        checks.same_device(g, anchor, names[t], "anchor")
    if backend == "triton":
        raise ValueError("the guide's masks have no Triton kernel: use backend='tiled'")
    scale = 1.0 / checks.check_positive_scalar(temperature, "temperature", anchor.device, _scale_dtype(anchor))
    b = anchor.shape[0]
    k = 0 if negative is None else negative.shape[0]
    entries = b * (b * (1 + int(contrast_anchors) + int(contrast_positives)) + k)
    name = backends.resolve(backend, entries, anchor.device, anchor.dtype, anchor.shape[1], kernel=None)
    relative = margin_strategy == "relative"
    with autocast_off(anchor.device.type):
        if name == "reference":
            rows = reference.gist_rows(anchor, positive, negative, guides, scale, float(margin), relative,
                                       contrast_anchors, contrast_positives)
            return _reduce_rows(rows, torch.ones_like(rows), reduction)
        ga, gp = _unit(guides[0], True), _unit(guides[1], True)
        g_pos = (ga * gp).sum(1)
        threshold = g_pos - (g_pos.abs() * margin if relative else margin)
        dtype = compute_dtype(anchor.dtype)
        ones = torch.ones(b, dtype=dtype, device=anchor.device)

        def part(q: Tensor, keys: Tensor, gq: Tensor, gk: Tensor, keep_positive: bool) -> Tensor:
            head = SoftmaxHead(ones, exclude=Exclusions(fn=_guide_mask(gq, gk, threshold, keep_positive)))
            return _row_lse(q, keys, scale, head, True, name, block_size)

        lse = part(anchor, positive, ga, gp, True)
        if contrast_anchors:
            lse = torch.logaddexp(lse, part(anchor, anchor, ga, ga, False))
        if contrast_positives:
            lse = torch.logaddexp(lse, part(positive, positive, gp, gp, False))
        if negative is not None:
            lse = torch.logaddexp(lse, part(anchor, negative, ga, _unit(guides[2], True), False))
        pos = (_unit(anchor, True) * _unit(positive, True)).sum(1)
        rows = lse - scale.to(dtype) * pos
    return _reduce_rows(rows, torch.ones_like(rows), reduction)


def clip_loss(
    image_embeds: Tensor,
    text_embeds: Tensor,
    logit_scale: Scalar,
    logit_bias: Optional[Scalar] = None,
    *,
    labels: Optional[Tensor] = None,
    normalize: bool = True,
    reduction: str = "mean",
    backend: str = "auto",
    block_size: Optional[int] = None,
    matryoshka_dims: Optional[Sequence[int]] = None,
    matryoshka_weights: Optional[Sequence[float]] = None,
) -> Tensor:
    r"""The symmetric CLIP loss (open_clip's ``ClipLoss`` on one process).

    With ``logits = logit_scale * image_hat @ text_hat.T`` (B x B), the mean of
    the image->text and text->image cross-entropies with the diagonal as targets::

        (F.cross_entropy(logits, arange(B)) + F.cross_entropy(logits.T, arange(B))) / 2

    With ``labels``, every image-text pair of the same label is a positive in both
    directions (duplicate captions, same-class pairs), with uniform soft targets
    over each row's (and column's) positives::

        (F.cross_entropy(logits, P / P.sum(1)) + F.cross_entropy(logits.T, P.T / P.T.sum(1))) / 2,
        P = labels[:, None] == labels[None, :]

    without labels, the loss above bit for bit. ``logit_bias`` (open_clip's biased
    variant) is accepted: a constant added to every logit leaves both
    cross-entropies unchanged, and a learnable bias gets its gradient, 0.

    Args:
        image_embeds: (B, D).
        text_embeds: (B, D).
        logit_scale: the multiplier (not its log), a float or a 0-dim tensor
            (learnable: it gets its gradient). open_clip passes
            ``model.logit_scale.exp()``.
        logit_bias: a float, a 0-dim tensor, or None.
        labels: (B,) integer labels of the pairs, or None (the diagonal).
        normalize: L2-normalise first. Default: True.
        reduction: ``"mean"`` | ``"sum"`` | ``"none"`` (per pair: the mean of its
            row and column terms).
        backend: ``"auto"`` (default: ``"triton"`` for CUDA tensors up to D = 256 when
            Triton is installed, else ``"tiled"`` from 2^20 score entries, ``"dense"`` below) |
            ``"reference"`` (per-anchor loops) | ``"dense"`` (the B x B matrix) |
            ``"tiled"`` (row blocks, O(B) memory) | ``"triton"`` (GPU kernels).
        block_size: rows per block of the tiled backend; None picks one.
        matryoshka_dims: prefix widths ``d_m`` of the embeddings (Matryoshka
            representation learning): the loss becomes ``sum_m w_m loss(x[..., :d_m])``,
            each width normalised on its own, all widths in one pass on the tiled
            backend. Default: None (the full width only).
        matryoshka_weights: the weights ``w_m`` (default 1 each).

    Shape:
        - image_embeds, text_embeds: (B, D); labels: (B,)
        - output: scalar, or (B,) with ``reduction="none"``

    Examples::

        >>> img, txt = torch.randn(4, 16), torch.randn(4, 16)
        >>> loss = flashcl.clip_loss(img, txt, logit_scale=100.0)
        >>> loss = flashcl.clip_loss(img, txt, 100.0, labels=torch.tensor([0, 1, 1, 2]))
    """
    image_embeds, text_embeds = checks.validate_pair(image_embeds, text_embeds, "image_embeds", "text_embeds")
    checks.check_bool(normalize, "normalize")
    checks.check_choice(reduction, "reduction", _REDUCTIONS)
    checks.check_choice(backend, "backend", _BACKENDS)
    checks.check_block(block_size)
    dtype = _scale_dtype(image_embeds)
    scale = checks.check_positive_scalar(logit_scale, "logit_scale", image_embeds.device, dtype)
    _warn_small_logit_scale(scale)
    bias = None if logit_bias is None else checks.check_real_scalar(logit_bias, "logit_bias", image_embeds.device,
                                                                    dtype)
    b = image_embeds.shape[0]
    if labels is None:
        index = torch.arange(b, device=image_embeds.device).unsqueeze(1)
        spec = CoreSpec(index=index, pos_mode="sum", symmetric=True, normalize=normalize)
    else:
        _, labels = checks.validate_labelled(image_embeds, labels, names=("image_embeds", "labels"))
        ids, num_classes = _dense_ids(labels)
        spec = CoreSpec(row_labels=ids, col_labels=ids, num_classes=num_classes, pos_mode="mean", symmetric=True,
                        normalize=normalize)
    loss = _core(image_embeds, text_embeds, scale, spec, reduction, backend, block_size, matryoshka_dims,
                 matryoshka_weights)
    if bias is not None and bias.requires_grad:
        loss = loss + 0.0 * bias  # the bias's gradient: exactly 0, as the formula's
    return loss


def siglip_problem(b: int, n: int, labels: Optional[Tensor], device: torch.device, dtype: torch.dtype,
                    bias: float, normalize: bool, offset: int = 0,
                    col_labels: Optional[Tensor] = None) -> Problem:
    """SigLIP as an engine problem (b image rows, n text columns): the softplus head
    and the positive term. Positives:
    the diagonal (image ``i`` and text ``i + offset``), or, with labels, every pair
    of the same label (``col_labels``: the texts' labels, default ``labels``)."""
    if labels is None:
        pos = Positives(index=(torch.arange(b, device=device) + offset).unsqueeze(1))
    else:
        cols = labels if col_labels is None else col_labels
        uniq, ids = torch.unique(torch.cat([labels, cols]), return_inverse=True)
        pos = Positives(row_labels=ids[:b], col_labels=ids[b:], num_classes=int(uniq.numel()))
    counts = pos.counts(b, n)
    head = SoftplusHead(bias, counts)
    return Problem(head, (Linear(pos, torch.ones(b, dtype=dtype, device=device)),), normalize)


def siglip_loss(
    image_embeds: Tensor,
    text_embeds: Tensor,
    logit_scale: Scalar,
    logit_bias: Scalar,
    *,
    labels: Optional[Tensor] = None,
    normalize: bool = False,
    reduction: str = "mean",
    backend: str = "auto",
    block_size: Optional[int] = None,
) -> Tensor:
    r"""The sigmoid loss of SigLIP (Zhai et al., 2023; open_clip's ``SigLipLoss`` on one process).

    Every image-text pair is its own binary classification: with
    ``logits = logit_scale * image @ text.T + logit_bias`` (B x B) and ``z_ij = +1``
    on the matching pairs (the diagonal), -1 elsewhere::

        loss = -sum_ij log sigmoid(z_ij * logits_ij) / B

    computed without the B x B matrix on the tiled and triton backends: memory
    O(B D), the gradient formed in the same pass as the loss. With ``labels``, every
    image-text pair of the same label is a positive (several captions of one image,
    same-class pairs).

    Args:
        image_embeds: (B, D). open_clip passes normalised features.
        text_embeds: (B, D).
        logit_scale: the multiplier (not its log), a float or a 0-dim tensor
            (learnable: it gets its gradient); open_clip passes ``logit_scale.exp()``.
        logit_bias: the bias, a float or a 0-dim tensor (learnable).
        labels: (B,) integer labels of the pairs, or None (the diagonal).
        normalize: L2-normalise the embeddings first. Default: False (open_clip's).
        reduction: ``"mean"`` (the sum over pairs divided by B, as open_clip) |
            ``"sum"`` | ``"none"`` (per image: the sum over its row of pairs).
        backend: ``"auto"`` (``"triton"`` for CUDA tensors up to D = 256 when Triton is
            installed, else ``"tiled"`` from 2^20 pairs, ``"dense"`` below) |
            ``"reference"`` (per-image loops) | ``"dense"`` (the B x B logits) |
            ``"tiled"`` (row blocks, O(B) memory) | ``"triton"`` (GPU kernels).
        block_size: rows per block of the tiled backend; None picks one.

    Shape:
        - image_embeds, text_embeds: (B, D); labels: (B,)
        - output: scalar, or (B,) with ``reduction="none"``

    Examples::

        >>> img = torch.nn.functional.normalize(torch.randn(8, 16), dim=1)
        >>> txt = torch.nn.functional.normalize(torch.randn(8, 16), dim=1)
        >>> loss = flashcl.siglip_loss(img, txt, logit_scale=10.0, logit_bias=-10.0)
    """
    image_embeds, text_embeds = checks.validate_pair(image_embeds, text_embeds, "image_embeds", "text_embeds")
    checks.check_bool(normalize, "normalize")
    checks.check_choice(reduction, "reduction", _REDUCTIONS)
    checks.check_choice(backend, "backend", _BACKENDS)
    checks.check_block(block_size)
    dtype = _scale_dtype(image_embeds)
    scale = checks.check_positive_scalar(logit_scale, "logit_scale", image_embeds.device, dtype)
    _warn_small_logit_scale(scale)
    bias = checks.check_real_scalar(logit_bias, "logit_bias", image_embeds.device, dtype)
    b = image_embeds.shape[0]
    if labels is not None:
        _, labels = checks.validate_labelled(image_embeds, labels, names=("image_embeds", "labels"))
        labels = labels.long()
    name = backends.resolve(backend, b * b, image_embeds.device, image_embeds.dtype, image_embeds.shape[1],
                            kernel="softplus")
    if name == "reference":
        with autocast_off(image_embeds.device.type):
            rows = reference.siglip_loss(image_embeds, text_embeds, scale, bias, labels, normalize)
        return rows if reduction == "none" else (rows.sum() / b if reduction == "mean" else rows.sum())
    problem = siglip_problem(b, b, labels, image_embeds.device, dtype, float(bias.detach()), normalize)
    weights = None
    if reduction != "none":
        weights = (torch.full((b,), 1.0 / b if reduction == "mean" else 1.0, dtype=dtype,
                              device=image_embeds.device), None)
    return backends.run(image_embeds, text_embeds, scale, problem, name, weights, block_size, param=bias)


def neighbor_loss(
    scores: Tensor,
    neighbors: Tensor,
    *,
    exclude_diagonal: bool = True,
    reduction: str = "sum",
    backend: str = "auto",
    block_size: Optional[int] = None,
) -> Tensor:
    r"""The "sampled neighbours" contrastive loss on a given n x n score matrix.

    Every row ``i`` has k positive columns ``neighbors[i]`` (repeats and the
    diagonal allowed), each its own cross-entropy term against the row's
    denominator (every column but ``i`` when ``exclude_diagonal``)::

        loss_i = sum_t ( LSE_{c != i} scores[i, c] - scores[i, neighbors[i, t]] )

    computed as a masked logsumexp, so scores up to 1e4 in magnitude stay
    finite (``log(exp(x) / (sum(exp(x)) - exp(diag)))`` overflows past ~88 in
    float32). It is the loss of ``-log(exp(y) / row_sum)`` over neighbours copied
    element by element in Python loops, whose backward takes tens of seconds at
    n = 2000; here it takes milliseconds, with the same value and gradient for the
    same sampled indices.

    Args:
        scores: (n, n) floating score matrix.
        neighbors: (n, k) integer column indices, ``0 <= neighbors < n``.
        exclude_diagonal: drop column ``i`` from row ``i``'s denominator. Default: True.
        reduction: ``"sum"`` (default), ``"mean"`` (over the n rows) or
            ``"none"`` (per-row sums over the row's k neighbours).
        backend: ``"auto"`` | ``"reference"`` | ``"dense"`` | ``"tiled"`` (no
            ``"triton"``: the matrix is given, there are no embeddings to tile);
            ``"auto"`` is tiled, whose only n x n allocation is the gradient.
        block_size: rows per block of the tiled backend; None picks one.

    Shape:
        - scores: (n, n); neighbors: (n, k)
        - output: scalar, or (n,) with ``reduction="none"``

    Examples::

        >>> scores = torch.randn(100, 100, requires_grad=True)
        >>> nb = flashcl.sample_neighbors(100, 2)
        >>> flashcl.neighbor_loss(scores, nb).backward()
    """
    checks.check_float_tensor(scores, "scores", (2,))
    neighbors = checks.check_index_tensor(neighbors, "neighbors")
    checks.check_bool(exclude_diagonal, "exclude_diagonal")
    checks.check_choice(reduction, "reduction", _REDUCTIONS)
    checks.check_choice(backend, "backend", _BACKENDS)
    checks.check_block(block_size)
    n = scores.shape[0]
    if scores.shape[1] != n:
        raise ValueError(f"scores must be square (n, n), got shape {tuple(scores.shape)}")
    if neighbors.dim() != 2 or neighbors.shape[0] != n or neighbors.shape[1] < 1:
        raise ValueError(f"neighbors must be 2-D of shape ({n}, k) with k >= 1, got shape {tuple(neighbors.shape)}")
    checks.same_device(neighbors, scores, "neighbors", "scores")
    if bool(((neighbors < 0) | (neighbors >= n)).any()):
        raise ValueError(f"neighbors values must be column indices in [0, {n})")
    if exclude_diagonal and n < 2:
        raise ValueError("neighbor_loss needs n >= 2 when exclude_diagonal=True: the denominator would be empty")
    spec = CoreSpec(exclude_self=exclude_diagonal, index=neighbors.long(), pos_mode="pairs", normalize=False)
    name = "tiled" if backend == "auto" else backend
    if name == "triton":
        raise ValueError("backend='triton' is for losses of embeddings; neighbor_loss takes a score matrix "
                         "that already exists: use backend='tiled' (its only n x n allocation is the gradient)")
    with autocast_off(scores.device.type):
        return _run_scores(scores, spec, name, reduction, block_size)


def _run_scores(scores: Tensor, spec: CoreSpec, name: str, reduction: str, block_size: Optional[int]) -> Tensor:
    n = scores.shape[0]
    if name != "tiled":
        return _reduce(_SCORE_BACKENDS[name](scores, spec), None, spec, reduction)
    dtype = compute_dtype(scores.dtype)
    block = block_size or auto_scores_block(n)
    if reduction == "none":
        return TiledScores.apply(scores, spec, None, block)
    r, _ = _reduce_weights(spec, n, reduction, dtype, scores.device)
    return TiledScores.apply(scores, spec, r, block)


def sample_neighbors(
    n: int,
    k: int,
    *,
    generator: Optional[torch.Generator] = None,
    device: Optional[Union[str, torch.device]] = None,
    exclude_self: bool = False,
) -> Tensor:
    """k uniformly sampled columns per row, vectorised (``random.randrange`` in a loop, at once).

    Args:
        n: number of rows (and of columns to sample from).
        k: samples per row, with replacement (repeats possible).
        generator: optional ``torch.Generator`` for reproducible draws.
        device: where the result lives. Default: CPU.
        exclude_self: never draw column ``i`` for row ``i``. Default: False.

    Shape:
        - output: (n, k) int64

    Examples::

        >>> nb = flashcl.sample_neighbors(5, 2, generator=torch.Generator().manual_seed(0))
        >>> nb.shape
        torch.Size([5, 2])
    """
    for value, name in ((n, "n"), (k, "k")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    checks.check_bool(exclude_self, "exclude_self")
    if exclude_self and n < 2:
        raise ValueError("sample_neighbors with exclude_self=True needs n >= 2")
    gen_device = generator.device if generator is not None else None
    dev = torch.device(device) if device is not None else (gen_device or torch.device("cpu"))
    high = n - 1 if exclude_self else n
    draw = torch.randint(0, high, (n, k), generator=generator, device=gen_device or dev).to(dev)
    if exclude_self:
        draw += (draw >= torch.arange(n, device=dev).unsqueeze(1)).long()
    return draw
