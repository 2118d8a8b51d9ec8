"""Block masks for flex losses: the tiles of the score matrix worth visiting.

Where a flex loss leaves most pairs out of every set (negatives only within a time window, a
graph's neighbourhood, a document), whole tiles of the score matrix contribute nothing. A
:class:`BlockMask` names the tiles that may hold a contributing pair, so that the tiled
backend visits only those, in the forward and the backward (as FlexAttention's
``BlockMask``). Build one from the same ``exclude`` function the loss takes
(:func:`flex_block_mask`, which evaluates it tile by tile, never forming the M x N mask),
from sorted keys (:meth:`BlockMask.from_sorted`: timestamps, sorted labels), or from your
own per-block summaries (``BlockMask(keep, block_size)``).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

import torch
from torch import Tensor

from .flex_head import View, tile_result

__all__ = ["BlockMask", "flex_block_mask"]


class BlockMask:
    """The tiles of a flex loss's (M, N) score matrix that may hold a pair that is not
    excluded: ``keep[I, J]`` for rows ``I * block_size:(I + 1) * block_size`` and the
    same columns. A tile it leaves out must hold only pairs that ``exclude`` (or the self
    pair) leaves out of every set: the tiled backend skips it on that promise, the dense
    and reference backends check it and raise a ``ValueError`` naming a pair that breaks it.

    Args:
        keep: (ceil(M / block_size), ceil(N / block_size)) bool.
        block_size: rows and columns per tile; the tiled backend's block size.

    Shape:
        - keep: (ceil(M / block_size), ceil(N / block_size))

    Examples::

        >>> keep = torch.eye(4, dtype=torch.bool)  # 4 x 4 tiles: only the diagonal ones
        >>> mask = flashcl.BlockMask(keep, block_size=16)
        >>> mask.density
        0.25
    """

    def __init__(self, keep: Tensor, block_size: int) -> None:
        if not isinstance(keep, Tensor) or keep.dtype != torch.bool or keep.dim() != 2:
            raise TypeError(f"keep must be a 2-D bool tensor (row blocks x column blocks), got {_describe(keep)}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.keep = keep.detach().to("cpu").clone()
        self.block_size = block_size

    @property
    def density(self) -> float:
        """The fraction of the tiles visited."""
        return float(self.keep.float().mean()) if self.keep.numel() else 0.0

    def __repr__(self) -> str:
        r, c = self.keep.shape
        return f"BlockMask({r} x {c} tiles of {self.block_size}, density {self.density:.3g})"

    @classmethod
    def from_sorted(
        cls, row_key: Tensor, col_key: Optional[Tensor] = None, *, max_distance: float, block_size: int = 256
    ) -> BlockMask:
        """The tiles where some pair's keys are within ``max_distance``, for keys sorted in
        non-decreasing order (timestamps, sorted labels with ``max_distance=0``): the mask of
        ``exclude=lambda a, b: (a.t - b.t).abs() > max_distance`` from each tile's range of
        keys, in O(tiles) work.

        Args:
            row_key: (M,) the anchors' keys, sorted.
            col_key: (N,) the keys' keys, sorted; None: ``row_key`` (self-contrast).
            max_distance: the largest ``|row_key[i] - col_key[j]|`` of a pair kept.
            block_size: rows and columns per tile.

        Shape:
            - row_key: (M,); col_key: (N,)

        Examples::

            >>> t = torch.arange(1024.0)  # one sample per second, in order
            >>> mask = flashcl.BlockMask.from_sorted(t, max_distance=5.0, block_size=128)
            >>> mask.keep.sum().item()  # the diagonal tiles and their neighbours
            22
        """
        col_key = row_key if col_key is None else col_key
        lo_r, hi_r = _block_ranges(row_key, "row_key", block_size)
        lo_c, hi_c = _block_ranges(col_key, "col_key", block_size)
        gap = torch.maximum(lo_c.unsqueeze(0) - hi_r.unsqueeze(1), lo_r.unsqueeze(1) - hi_c.unsqueeze(0))
        return cls(gap <= max_distance, block_size)


def _describe(x: Any) -> str:
    if isinstance(x, Tensor):
        return f"a {x.dim()}-D {x.dtype} tensor"
    return type(x).__name__


def _block_ranges(key: Tensor, name: str, block: int) -> Any:
    """Each block's (first, last) key of a sorted 1-D key."""
    if not isinstance(key, Tensor) or key.dim() != 1 or key.is_complex():
        raise TypeError(f"{name} must be a 1-D real tensor, got {_describe(key)}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block_size must be a positive int, got {block!r}")
    k = key.detach().to("cpu", torch.float64)
    if k.numel() > 1 and bool((k[1:] < k[:-1]).any()):
        raise ValueError(f"{name} must be sorted in non-decreasing order (from_sorted reads each tile's range)")
    starts = torch.arange(0, k.numel(), block)
    ends = torch.clamp(starts + block, max=k.numel()) - 1
    return k[starts], k[ends]


@torch.no_grad()
def flex_block_mask(
    exclude: Callable[..., Any],
    m: int,
    n: Optional[int] = None,
    *,
    rows: Optional[Dict[str, Tensor]] = None,
    cols: Optional[Dict[str, Tensor]] = None,
    include_self: bool = False,
    block_size: int = 256,
) -> BlockMask:
    """The block mask of a flex loss's ``exclude`` function (as FlexAttention's
    ``create_block_mask``): ``exclude(a, b)`` is called on each row block against every
    column, as the loss calls it, and a tile is kept unless every pair in it is excluded
    (or is the self pair, for self-contrast without ``include_self``). O(block_size x N)
    memory; its time is that of calling ``exclude`` on every pair once, without the
    scores: worth it when the mask serves several steps, or to check a hand-made mask.

    Args:
        exclude: the loss's ``exclude(a, b)`` (one that reads the scores cannot be
            evaluated without them).
        m: the anchors' count.
        n: the keys' count; None: self-contrast (the keys are the anchors).
        rows: the anchors' data, as the loss's ``rows=``.
        cols: the keys' data (two towers), as the loss's ``cols=``.
        include_self: as the loss's (self-contrast): the self pair is not excluded.
        block_size: rows and columns per tile.

    Shape:
        - rows: fields (m, ...); cols: fields (n, ...); output keep: (ceil(m / block_size),
          ceil(n / block_size))

    Examples::

        >>> t = torch.rand(512).sort().values * 100
        >>> mask = flashcl.flex_block_mask(lambda a, b: (a.t - b.t).abs() > 2.0, 512,
        ...                                rows={"t": t}, block_size=64)
        >>> mask.keep.shape
        torch.Size([8, 8])
    """
    from .flex_head import takes_scores

    if not callable(exclude):
        raise TypeError(f"exclude must be a function of (a, b), got {type(exclude).__name__}")
    if takes_scores(exclude):
        raise ValueError("exclude reads the scores (a, b, s): a block mask cannot be made without them")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    own = n is None
    n_ = m if n is None else n
    for count, label in ((m, "m"), (n_, "n")):
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"{label} must be a non-negative int, got {count!r}")
    row_data = dict(rows or {})
    col_data = row_data if own else dict(cols or {})
    for data, count, label in ((row_data, m, "rows"), (col_data, n_, "cols")):
        for key, value in data.items():
            if not isinstance(value, Tensor) or value.dim() == 0 or value.shape[0] != count:
                raise ValueError(f"{label}[{key!r}] must hold one entry per sample ({count})")
    device = next(iter(row_data.values())).device if row_data else torch.device("cpu")
    rb, cb = -(-m // block_size), -(-n_ // block_size)
    keep = torch.zeros(rb, cb, dtype=torch.bool)
    like = torch.empty(0, device=device)
    for i in range(rb):
        r0, r1 = i * block_size, min((i + 1) * block_size, m)
        a = View(row_data, r0, r1, 0, "a", "the anchors' data (rows=)", "a")
        b = View(col_data, 0, n_, 0, "b", "the keys' data (cols=)", "b")
        out = tile_result(exclude(a, b), "exclude", r1 - r0, n_, like, "bool").clone()
        if own and not include_self:
            out.diagonal(offset=r0).fill_(True)
        pad = cb * block_size - n_
        if pad:
            out = torch.cat([out, torch.ones(r1 - r0, pad, dtype=torch.bool, device=out.device)], 1)
        keep[i] = ~out.view(r1 - r0, cb, block_size).all(2).all(0).cpu()
    return BlockMask(keep, block_size)
