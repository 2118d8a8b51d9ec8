"""Input checks shared by every public entry point (functional, distributed, the
integrations): each raises a ``TypeError`` or ``ValueError`` that names the
argument, before any compute.

Examples::

    >>> from flashcl import checks
    >>> checks.check_bool(True, "normalize")
    True
    >>> checks.check_choice("mean", "reduction", checks.REDUCTIONS)
    'mean'
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from .core import compute_dtype

__all__ = [
    "REDUCTIONS",
    "BACKENDS",
    "check_bool",
    "check_choice",
    "check_float_tensor",
    "check_index_tensor",
    "check_positive_scalar",
    "check_real_scalar",
    "check_block",
    "check_dims",
    "same_device",
    "validate_pair",
    "validate_labelled",
    "validate_info_nce",
    "Example",
    "example_rows",
    "example_labels",
]

#: The reductions every loss takes.
REDUCTIONS = ("mean", "sum", "none")
#: The backends every embedding loss takes (``"auto"`` picks one; see :mod:`flashcl.runner`).
BACKENDS = ("auto", "reference", "dense", "tiled", "triton")
STRATEGIES = ("all_gather", "ring")
GRAD_SCALES = ("ddp", "sum")


Scalar = Union[float, Tensor]


class Example(NamedTuple):
    """A loss's call at small odd sizes (``flashcl check``, :mod:`flashcl.tools.selfcheck`,
    compares every backend's value and gradients on it with the reference's): ``args``
    in the call's order, ``kwargs``, and ``leaves``, the positions in ``args`` of the
    inputs whose gradients are compared (None: every floating tensor). A family module
    gives one per loss in its ``EXAMPLES``, a function of a ``torch.Generator``."""

    args: Tuple[Any, ...]
    kwargs: Dict[str, Any]
    leaves: Optional[Tuple[int, ...]] = None


def example_rows(g: torch.Generator, *shape: int) -> Tensor:
    """Standard normal float64 entries of ``shape`` from ``g`` (an :class:`Example`'s rows)."""
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def example_labels(g: torch.Generator, n: int, classes: int) -> Tensor:
    """``n`` labels in ``0 .. classes - 1`` from ``g`` (an :class:`Example`'s labels)."""
    return torch.randint(0, classes, (n,), generator=g)


@dataclass(frozen=True)
class Options:
    """The options every loss takes, checked in one place when made: a loss calls
    ``Options(normalize, reduction, backend, block_size, process_group, strategy,
    grad_scale)`` and every bad value gets an error that names its argument. The
    bodies of the losses across processes take it whole; its ``repr`` (the process
    group left out) is part of what every rank must call alike.

    Attributes:
        normalize: L2-normalise the embeddings first.
        reduction: ``"mean"`` | ``"sum"`` | ``"none"``.
        backend: ``"auto"`` | ``"reference"`` | ``"dense"`` | ``"tiled"`` | ``"triton"``
            (on one process and across processes alike).
        block_size: rows per block of the tiled backend; None picks one.
        process_group: None (this process's inputs) or a process group.
        strategy: across processes, ``"all_gather"`` | ``"ring"``.
        grad_scale: across processes, ``"ddp"`` | ``"sum"``.
    """

    normalize: bool = True
    reduction: str = "mean"
    backend: str = "auto"
    block_size: Optional[int] = None
    process_group: Any = field(default=None, repr=False, compare=False)
    strategy: str = "all_gather"
    grad_scale: str = "ddp"

    def __post_init__(self) -> None:
        check_bool(self.normalize, "normalize")
        check_choice(self.reduction, "reduction", REDUCTIONS)
        check_choice(self.backend, "backend", BACKENDS)
        check_block(self.block_size)
        check_choice(self.strategy, "strategy", STRATEGIES)
        check_choice(self.grad_scale, "grad_scale", GRAD_SCALES)


def check_bool(value: object, name: str) -> bool:
    """``value`` if it is a ``bool``; a ``TypeError`` otherwise (``"False"`` is not False)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def check_choice(value: object, name: str, choices: Sequence[str]) -> str:
    """``value`` if it is one of ``choices``; a ``ValueError`` otherwise."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")
    return value


def check_float_tensor(x: object, name: str, ndims: Tuple[int, ...], empty: bool = False) -> Tensor:
    """A floating-point tensor with one of the dimensionalities ``ndims``, non-empty
    (``empty``: no rows allowed, as a rank's empty slice of the classes)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be floating point, got dtype {x.dtype}")
    if x.dim() not in ndims:
        shapes = " or ".join(f"{d}-D" for d in ndims)
        raise ValueError(f"{name} must be {shapes}, got shape {tuple(x.shape)}")
    if (x.numel() == 0 and not (empty and x.shape[0] == 0)) or (x.shape[0] == 0 and not empty):
        raise ValueError(f"{name} must not be empty, got shape {tuple(x.shape)}")
    return x


def check_index_tensor(x: object, name: str) -> Tensor:
    """An integer tensor (not bool, not floating point)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype == torch.bool or x.is_floating_point() or x.is_complex():
        raise TypeError(f"{name} must be an integer tensor, got dtype {x.dtype}")
    return x


def _scalar(value: object, name: str, device: torch.device, dtype: torch.dtype) -> Tuple[Tensor, float]:
    """(a 0-dim tensor in at least ``dtype``'s precision, its value)."""
    if isinstance(value, Tensor):
        if value.dim() != 0 and value.numel() != 1:
            raise ValueError(f"{name} must be a float or a 0-dim tensor, got shape {tuple(value.shape)}")
        if not value.is_floating_point():
            raise TypeError(f"{name} tensor must be floating point, got dtype {value.dtype}")
        # A float16 temperature with float32 embeddings is inverted in float32, not
        # float16; autograd casts its gradient back to the tensor's own dtype.
        tensor = value.reshape(()).to(torch.promote_types(value.dtype, dtype))
        return tensor, float(value.detach())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return torch.tensor(float(value), dtype=dtype, device=device), float(value)
    raise TypeError(f"{name} must be a float or a 0-dim tensor, got {type(value).__name__}")


def check_positive_scalar(value: object, name: str, device: torch.device, dtype: torch.dtype) -> Tensor:
    """A float or a 0-dim floating tensor, finite and > 0; returned as a 0-dim tensor
    in at least ``dtype``'s precision (a tensor keeps its autograd history)."""
    tensor, v = _scalar(value, name, device, dtype)
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name} must be finite and > 0, got {v}")
    return tensor


def check_real_scalar(value: object, name: str, device: torch.device, dtype: torch.dtype) -> Tensor:
    """A float or a 0-dim floating tensor, finite; returned as :func:`check_positive_scalar` does."""
    tensor, v = _scalar(value, name, device, dtype)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {v}")
    return tensor


def number(value: object, name: str, positive: bool = False) -> float:
    """A hyperparameter as a float: a Python number or a 0-dim tensor without gradient,
    finite (and > 0 with ``positive``); a ValueError that names it otherwise."""
    if isinstance(value, Tensor):
        if value.dim() != 0 or value.requires_grad:
            raise ValueError(f"{name} must be a number (or a 0-dim tensor without gradient), got {value!r}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v) or (positive and v <= 0):
        raise ValueError(f"{name} must be finite{' and > 0' if positive else ''}, got {v}")
    return v


def optional_number(value: object, name: str, positive: bool = False) -> Optional[float]:
    """:func:`number`, or None for None."""
    return None if value is None else number(value, name, positive)


def check_block(block_size: Optional[int], name: str = "block_size") -> None:
    """None or a positive int."""
    if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1):
        raise ValueError(f"{name} must be a positive int or None, got {block_size!r}")


def same_device(x: Tensor, ref: Tensor, name: str, ref_name: str) -> None:
    """A ``ValueError`` when ``x`` and ``ref`` live on different devices."""
    if x.device != ref.device:
        raise ValueError(f"{name} is on {x.device} but {ref_name} is on {ref.device}")


def validate_pair(a: object, b: object, name_a: str, name_b: str, empty: bool = False) -> Tuple[Tensor, Tensor]:
    """Two (B, D) floating tensors of the same shape, dtype and device (``empty``: B may be
    0, a rank with no rows of its own across processes)."""
    a = check_float_tensor(a, name_a, (2,), empty)
    b = check_float_tensor(b, name_b, (2,), empty)
    if a.shape != b.shape:
        raise ValueError(f"{name_a} and {name_b} must have the same shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise TypeError(f"{name_a} and {name_b} must have the same dtype, got {a.dtype} and {b.dtype}")
    same_device(b, a, name_b, name_a)
    return a, b


def validate_labelled(
    embeddings: object,
    labels: object,
    ndims: Tuple[int, ...] = (2,),
    names: Tuple[str, str] = ("embeddings", "labels"),
    empty: bool = False,
) -> Tuple[Tensor, Tensor]:
    """Floating embeddings (B, ...) and integer labels (B,) on the same device (``empty``:
    B may be 0, a rank with no rows of its own across processes)."""
    emb_name, lab_name = names
    embeddings = check_float_tensor(embeddings, emb_name, ndims, empty)
    labels = check_index_tensor(labels, lab_name)
    b = embeddings.shape[0]
    if labels.dim() != 1 or labels.shape[0] != b:
        raise ValueError(
            f"{lab_name} must be 1-D of length {b} (the batch size of {emb_name}), got shape {tuple(labels.shape)}"
        )
    same_device(labels, embeddings, lab_name, emb_name)
    return embeddings, labels


def validate_info_nce(query: object, keys: object, positive_index: Optional[Tensor], empty: bool = False) -> Tensor:
    """Checks query (B, D), keys (N, D) and the positives; returns the index (B,)
    (``empty``: B and N may be 0, a rank with no rows of its own across processes)."""
    query = check_float_tensor(query, "query", (2,), empty)
    keys = check_float_tensor(keys, "keys", (2,), empty)
    b, n = query.shape[0], keys.shape[0]
    if keys.shape[1] != query.shape[1]:
        raise ValueError(f"query and keys must have the same embedding dim, got {query.shape[1]} and {keys.shape[1]}")
    if keys.dtype != query.dtype:
        raise TypeError(f"query and keys must have the same dtype, got {query.dtype} and {keys.dtype}")
    same_device(keys, query, "keys", "query")
    if positive_index is None:
        if n < b:
            raise ValueError(
                f"keys must have at least as many rows as query when positive_index is None, got {n} < {b}"
            )
        return torch.arange(b, device=query.device)
    index = check_index_tensor(positive_index, "positive_index")
    if index.dim() != 1 or index.shape[0] != b:
        raise ValueError(f"positive_index must be 1-D of length {b}, got shape {tuple(index.shape)}")
    same_device(index, query, "positive_index", "query")
    if bool(((index < 0) | (index >= n)).any()):
        raise ValueError(f"positive_index values must be in [0, {n}) (rows of keys)")
    return index


def scale_dtype(x: Tensor) -> torch.dtype:
    return compute_dtype(x.dtype)


def no_matryoshka(dims: object, weights: object, what: str) -> None:
    if dims is not None or weights is not None:
        raise ValueError(f"matryoshka_dims does not combine with {what}")


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


def check_keys(keys: object, name: str, like: Tensor, empty: bool = False) -> Tensor:
    keys = check_float_tensor(keys, name, (2,), empty)
    if keys.shape[1] != like.shape[-1]:
        raise ValueError(f"{name} must be {like.shape[-1]} wide (the embeddings' width), got {keys.shape[1]}")
    if keys.dtype != like.dtype:
        raise TypeError(f"{name} must have the embeddings' dtype {like.dtype}, got {keys.dtype}")
    same_device(keys, like, name, "embeddings")
    return keys


def check_smoothing(value: object) -> float:
    """``label_smoothing``: a float in [0, 1)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0.0 <= value < 1.0):
        raise ValueError(f"label_smoothing must be a float in [0, 1), got {value!r}")
    return float(value)


def check_dims(dims: object, weights: object, width: int) -> Tuple[List[int], List[float]]:
    """The prefix widths, ascending, and their weights (default 1 each), checked."""
    if isinstance(dims, (int, Tensor)) or not isinstance(dims, Sequence) or len(dims) == 0:
        raise ValueError(f"matryoshka_dims must be a non-empty list of widths, got {dims!r}")
    ds = list(dims)
    for d in ds:
        if isinstance(d, bool) or not isinstance(d, int) or not 1 <= d <= width:
            raise ValueError(f"matryoshka_dims must be ints in [1, {width}] (the embedding width), got {dims!r}")
    if len(set(ds)) != len(ds):
        raise ValueError(f"matryoshka_dims must not repeat a width, got {dims!r}")
    if weights is None:
        ws = [1.0] * len(ds)
    else:
        if isinstance(weights, (int, float, Tensor)) or not isinstance(weights, Sequence) or len(weights) != len(ds):
            raise ValueError(
                f"matryoshka_weights must be a list with one weight per width ({len(ds)}), got {weights!r}"
            )
        ws = []
        for w in weights:
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
                raise ValueError(f"matryoshka_weights must be finite numbers, got {weights!r}")
            ws.append(float(w))
    order = sorted(range(len(ds)), key=lambda i: ds[i])
    return [ds[i] for i in order], [ws[i] for i in order]
