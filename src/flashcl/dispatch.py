"""From a loss's configuration to a backend: :func:`run_core` (one call of the
core), :func:`matryoshka_core` (every prefix width), :func:`row_lse` (one part of a
loss made of several candidate sets), and the checks and helpers the losses share.

Every loss is one configuration of the masked-softmax core of
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
from typing import Any, List, Optional, Tuple, Union

import torch
from torch import Tensor

from . import backends, checks, distributed
from .engine import Problem
from .heads import SoftmaxHead
from .runner import matryoshka_core as matryoshka_core
from .runner import run_core as run_core
from .runner import run_with_widths as run_with_widths
from .utils import compute_dtype, normalize_rows

Scalar = Union[float, Tensor]


def scale_dtype(x: Tensor) -> torch.dtype:
    return compute_dtype(x.dtype)


def no_matryoshka(dims: object, weights: object, what: str) -> None:
    if dims is not None or weights is not None:
        raise ValueError(f"matryoshka_dims does not combine with {what}")


def dense_ids(labels: Tensor) -> Tuple[Tensor, int]:
    uniq, ids = torch.unique(labels, return_inverse=True)
    return ids.reshape(-1), int(uniq.numel())


def class_ids(*label_sets: Tensor) -> Tuple[List[Tensor], int]:
    """Dense class ids over several label tensors at once (one id space)."""
    uniq, ids = torch.unique(torch.cat([x.reshape(-1) for x in label_sets]), return_inverse=True)
    out, start = [], 0
    for x in label_sets:
        out.append(ids[start : start + x.numel()])
        start += x.numel()
    return out, int(uniq.numel())


_warned_small_scale = False


def warn_small_logit_scale(scale: Tensor) -> None:
    """Warns once when a logit scale is below 1: the multiplier is meant (open_clip
    passes ``logit_scale.exp()``, about 14 to 100), not its log nor a temperature."""
    global _warned_small_scale
    if not _warned_small_scale and float(scale.detach()) < 1.0:
        _warned_small_scale = True
        warnings.warn(
            f"logit_scale={float(scale):.4g} is below 1: it multiplies the cosine similarities (1 / "
            "temperature; open_clip passes model.logit_scale.exp()). Pass the multiplier, not its log "
            "nor a temperature. (This warning is shown once.)",
            stacklevel=3,
        )


def row_lse(
    q: Tensor,
    k: Optional[Tensor],
    scale: Tensor,
    head: SoftmaxHead,
    normalize: bool,
    name: str,
    block_size: Optional[int],
    offset: int = 0,
) -> Tensor:
    """Each row's logsumexp over its denominator (the head's exclusions), (M,),
    differentiable: one part of a loss composed of several candidate sets
    (``offset``: the column of row 0, as the head's)."""
    return backends.run(q, k, scale, Problem(head, (), normalize, offset), name, None, block_size)


def unit_rows(x: Tensor, normalize: bool) -> Tensor:
    x = x.to(compute_dtype(x.dtype))
    return normalize_rows(x) if normalize else x


def check_keys(keys: object, name: str, like: Tensor) -> Tensor:
    keys = checks.check_float_tensor(keys, name, (2,))
    if keys.shape[1] != like.shape[-1]:
        raise ValueError(f"{name} must be {like.shape[-1]} wide (the embeddings' width), got {keys.shape[1]}")
    if keys.dtype != like.dtype:
        raise TypeError(f"{name} must have the embeddings' dtype {like.dtype}, got {keys.dtype}")
    checks.same_device(keys, like, name, "embeddings")
    return keys


def check_smoothing(value: object) -> float:
    """``label_smoothing``: a float in [0, 1)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0.0 <= value < 1.0):
        raise ValueError(f"label_smoothing must be a float in [0, 1), got {value!r}")
    return float(value)


def smoothing_rows(
    q: Tensor,
    keys: Tensor,
    index: Tensor,
    scale: Tensor,
    normalize: bool,
    extra: Optional[Tensor] = None,
    group: Any = None,
) -> Tensor:
    """Per row ``s_it - mean_j s_ij`` over every column (the keys of every rank of
    ``group``, then ``extra`` once), by a mean key in O((M + N) D): label smoothing
    ``eps`` adds ``eps`` times it to the cross-entropy, since
    ``(1 - eps) CE + eps mean_j (-log p_ij) = CE + eps (s_it - mean_j s_ij)``."""
    qn, kn = unit_rows(q, normalize), unit_rows(keys, normalize)
    total, count = kn.sum(0), kn.shape[0]
    if group is not None:
        sums, _ = distributed.all_gather_with_grad(total.unsqueeze(0), group)
        total, count = sums.sum(0), sum(distributed.row_counts(count, q.device, group))
    if extra is not None:
        total, count = total + unit_rows(extra, normalize).sum(0), count + extra.shape[0]
    return scale.to(qn.dtype) * ((qn * kn[index]).sum(1) - qn @ (total / count))
