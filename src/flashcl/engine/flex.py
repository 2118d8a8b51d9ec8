"""The flex head: a loss written as small functions of each pair, on the engine's tiles.

A flex loss is the masked softmax (or the sigmoid loss over pairs) whose positives, exclusions,
score changes and denominator weights come from the user's functions, evaluated on each tile
the drivers visit (:mod:`flashcl.engine.tiled`, :mod:`flashcl.engine.panels`, the ring), never
on the M x N matrix. The functions take two :class:`View` objects: ``a``, the tile's anchors
(each field of the per-anchor data shaped (R, 1, ...), ``a.index`` their global positions),
and ``b``, its keys ((1, C, ...)); they return tensors that broadcast to the tile, (R, C).

With ``s`` the scaled scores and ``s' = score_mod(s, a, b)``, ``m = positive(a, b)`` (0 where
``exclude`` or the self pair leaves a pair out of every set) and ``w = weight(a, b)``:

* ``kind="softmax"``: ``L_i = LSE_{j in Den(i)} (s'_ij + log w_ij)``, ``P_i = sum_j m_ij s'_ij``;
  the row's loss ``c_i L_i - a_i P_i`` with ``(c_i, a_i)`` from ``positives``: ``"mean"``
  ``(M_i / n_i, 1 / n_i)``, ``"weighted_mean"`` ``(1, 1 / M_i)``, ``"pairs"`` ``(M_i, 1)``,
  ``"sum"`` ``(1, 1)`` (``M_i = sum_j m_ij``, ``n_i`` the positives' count). A row with no
  positive (but in ``"sum"``) or an empty denominator contributes 0 and is not counted.
  ``dL/ds'_ij = c_i w_ij exp(s'_ij - L_i) - a_i m_ij``, taken through ``score_mod`` by autograd
  on the tile (and into the tensors it captures).
* ``kind="sigmoid"``: each pair's ``w_ij [m_ij softplus(-t_ij) + (1 - m_ij) softplus(t_ij)]``,
  ``t = s' + bias``; ``dL/dt = w (sigmoid(t) - m)``.

Every row's statistics complete in one visit of its tiles: one reduction pass; a block of
complete rows forms its gradient in the same visit (three GEMMs).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .heads import Head, Tile, mask_self_, softplus

__all__ = ["View", "FlexFunctions", "FlexHead", "KINDS", "POSITIVES", "captured_tensors", "takes_scores"]

KINDS = ("softmax", "sigmoid")
POSITIVES = ("mean", "weighted_mean", "pairs", "sum")

Fn = Callable[..., Any]


class View:
    """A tile's anchors (``a``) or keys (``b``): the per-sample data's fields as attributes,
    each shaped (R, 1, ...) for the anchors and (1, C, ...) for the keys, and ``index``, their
    global positions (an int64 tensor of the same layout)."""

    __slots__ = ("_data", "_lo", "_hi", "_base", "_side", "_cache", "_owner", "_role")

    def __init__(self, data: Dict[str, Tensor], lo: int, hi: int, base: int, side: str, owner: str, role: str) -> None:
        # side: "a" lays the samples along the tile's rows (R, 1, ...), "b" along its columns (1, C, ...)
        self._data, self._lo, self._hi, self._base, self._side = data, lo, hi, base, side
        self._cache: Dict[str, Tensor] = {}
        self._owner, self._role = owner, role  # for the errors: "the anchors' data (rows=)", "a"

    def _shape(self, x: Tensor) -> Tensor:
        return x.unsqueeze(1) if self._side == "a" else x.unsqueeze(0)

    @property
    def index(self) -> Tensor:
        got = self._cache.get("index")
        if got is None:
            device = next(iter(self._data.values())).device if self._data else None
            got = self._shape(torch.arange(self._lo + self._base, self._hi + self._base, device=device))
            self._cache["index"] = got
        return got

    def __getattr__(self, name: str) -> Tensor:
        if name.startswith("_"):
            raise AttributeError(name)
        got = self._cache.get(name)
        if got is not None:
            return got
        if name not in self._data:
            fields = ", ".join(sorted(self._data)) or "none"
            raise AttributeError(
                f"{self._role}.{name}: no field {name!r} in {self._owner} (its fields: {fields}; every view has .index)"
            )
        got = self._shape(self._data[name][self._lo : self._hi])
        self._cache[name] = got
        return got


def takes_scores(fn: Fn) -> bool:
    """Whether ``exclude`` takes the tile's scores as a third argument."""
    try:
        params = [
            p
            for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
        ]
    except (TypeError, ValueError):  # a builtin without a signature: two arguments
        return False
    return any(p.kind == p.VAR_POSITIONAL for p in params) or len(params) >= 3


class FlexFunctions:
    """The user's functions of a flex loss and their options, checked: ``positive``,
    ``exclude`` (``exclude_scores``: it takes the scores), ``score_mod``, ``weight``."""

    def __init__(
        self,
        positive: Optional[Fn],
        exclude: Optional[Fn],
        score_mod: Optional[Fn],
        weight: Optional[Fn],
    ) -> None:
        self.positive, self.exclude, self.score_mod, self.weight = positive, exclude, score_mod, weight
        self.exclude_scores = exclude is not None and takes_scores(exclude)


def _tile_result(value: Any, name: str, rows: int, cols: int, like: Tensor, kind: str) -> Tensor:
    """A function's result checked against the tile: a tensor on the scores' device that
    broadcasts to (rows, cols) by torch's rules, of the dtype its role takes (``kind``:
    ``"bool"``, ``"weight"`` (bool or floating), ``"float"``); returned broadcast (a view)."""
    if not isinstance(value, Tensor):
        if kind == "float" or isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must return a tensor, got {type(value).__name__}")
        value = torch.tensor(float(value), dtype=like.dtype, device=like.device)
    if value.device != like.device:
        raise ValueError(f"{name} returned a tensor on {value.device}; the scores are on {like.device}")
    if kind == "bool" and value.dtype != torch.bool:
        raise TypeError(f"{name} must return a bool tensor (True: left out), got {value.dtype}")
    if kind == "weight" and value.dtype != torch.bool and not value.is_floating_point():
        raise TypeError(f"{name} must return a bool or floating tensor, got {value.dtype}")
    if kind == "float" and not value.is_floating_point():
        raise TypeError(f"{name} must return a floating tensor, got {value.dtype}")
    try:
        shape = torch.broadcast_shapes(value.shape, (rows, cols))
    except RuntimeError:
        shape = None
    if shape != (rows, cols):
        raise ValueError(
            f"{name} returned shape {tuple(value.shape)}, which does not broadcast to the tile ({rows}, {cols}) "
            "(a's fields are (R, 1, ...), b's (1, C, ...): reduce a field's trailing dimensions)"
        )
    return value.expand(rows, cols)


def captured_tensors(fn: Optional[Fn], probe: Callable[[Fn], Tensor]) -> Tuple[Tensor, ...]:
    """The leaf tensors requiring grad that ``fn``'s result depends on beyond its own
    arguments (a learnable margin it captures): ``probe(fn)`` calls it on a small tile
    whose scores require grad; the leaves are found in the result's graph."""
    if fn is None:
        return ()
    with torch.enable_grad():
        out = probe(fn)
    if not isinstance(out, Tensor) or out.grad_fn is None:
        return ()
    found: List[Tensor] = []
    seen, stack = set(), [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)  # an AccumulateGrad: a leaf
        if isinstance(variable, Tensor) and not getattr(variable, "_flex_probe", False):
            if all(variable is not f for f in found):
                found.append(variable)
        stack.extend(n for n, _ in node.next_functions if n is not None)
    return tuple(found)


class _FlexState:
    """A flex head's accumulators: each row's logsumexp, the positives' score sum,
    weight sum and count (softmax); each row's loss sum (sigmoid); the gradients of the
    captured tensors and the bias."""

    def __init__(self, m: int, like: Tensor, n_params: int, kind: str) -> None:
        def vec(k: int, fill: float = 0.0) -> Tensor:
            return like.new_full((k,), fill)

        # the sigmoid kind's rows are sums of its pairs' terms; the softmax kind's logsumexps
        self.row = vec(m, float("-inf") if kind == "softmax" else 0.0)
        self.pos, self.msum, self.cnt = vec(m), vec(m), vec(m)
        self.g_row: Optional[Tensor] = None
        self.ca: Optional[Tuple[Tensor, Tensor]] = None  # rows' (c, a), once reduced
        self.param_grads: List[Optional[Tensor]] = [None] * n_params


class FlexHead(Head):
    """The flex loss as an engine head (see the module docstring).

    Args:
        kind: ``"softmax"`` | ``"sigmoid"``.
        positives: the softmax kind's ``"mean"`` | ``"weighted_mean"`` | ``"pairs"`` | ``"sum"``.
        fns: the user's functions.
        rows: the data of the tile rows' samples, this process's (M).
        cols: the data of the tile columns' samples, every column of the problem (N; across
            processes every rank's).
        row_base: the global position of anchor 0.
        own: self-contrast: the pair ``(i, i + offset)`` is the anchor itself, never a positive.
        exclude_self: leave that pair out of the denominator too (not ``include_self``).
        offset: the column of anchor 0 (self-contrast).
        swapped: the tile's rows are the keys and its columns the anchors (the column
            direction of ``both_directions``): the functions are called as ``f(b, a)``, so
            that they see every pair as ``(anchor, key)``.
        symmetric: the functions give the same answers for ``(a, b)`` and ``(b, a)`` and the
            keys are the anchors (self-contrast): the symmetric panels may be visited.
        bias: the sigmoid kind's bias (a float; its gradient when ``learn_bias``).
        learn_bias: the bias is the first of the head's parameters.
        captured: the tensors ``score_mod`` captures that require grad (the head's
            parameters after the bias).
    """

    def __init__(
        self,
        kind: str,
        positives: str,
        fns: FlexFunctions,
        rows: Dict[str, Tensor],
        cols: Dict[str, Tensor],
        row_base: int = 0,
        own: bool = False,
        exclude_self: bool = False,
        offset: int = 0,
        swapped: bool = False,
        symmetric: bool = False,
        bias: float = 0.0,
        learn_bias: bool = False,
        captured: Tuple[Tensor, ...] = (),
    ) -> None:
        self.kind, self.positives, self.fns = kind, positives, fns
        self.rows, self.cols, self.row_base = rows, cols, row_base
        self.own, self.exclude_self, self.offset, self.swapped = own, exclude_self, offset, swapped
        self.symmetric_tiles = symmetric
        self.bias, self.learn_bias, self.captured = bias, learn_bias, captured
        self.n_params = int(learn_bias) + len(captured)
        #: each row's validity once reduced: the rows a "mean" counts
        self.valid_rows: Optional[Tensor] = None

    # ------------------------------------------------------------------ a tile's terms
    def _views(self, tile: Tile) -> Tuple[View, View]:
        """The functions' ``(a, b)``: the tile's rows and columns, or, swapped, its columns
        (the anchors, shaped (1, C, ...)) and its rows (the keys, (R, 1, ...))."""
        if self.swapped:
            a = View(self.cols, tile.c0, tile.c1, 0, "b", "the anchors' data (rows=)", "a")
            b = View(self.rows, tile.r0, tile.r1, self.row_base, "a", "the keys' data (cols=)", "b")
            return a, b
        a = View(self.rows, tile.r0, tile.r1, self.row_base, "a", "the anchors' data (rows=)", "a")
        b = View(self.cols, tile.c0, tile.c1, 0, "b", "the keys' data (cols=)", "b")
        return a, b

    def _terms(
        self, s: Tensor, tile: Tile, grad: bool = False
    ) -> Tuple[Tensor, Tensor, Optional[Tensor], Tensor, Optional[Tensor], Optional[Tensor]]:
        """The tile's ``(out, m, logw, sp, s_leaf, sp_graph)``: the pairs out of every set
        (bool), the positives' weights (0 where out), the log weights (None: all 1), the
        modified scores (detached) and, with ``grad``, the scores as a leaf and the modified
        scores on its graph (for the backward through ``score_mod``)."""
        r, c = s.shape
        a, b = self._views(tile)
        fns = self.fns
        out, m, logw = self._sets(s, tile, a, b)
        s_leaf = sp_graph = None
        if fns.score_mod is None:
            sp = s
        elif grad:
            with torch.enable_grad():
                s_leaf = s.detach().clone().requires_grad_(True)
                sp_graph = _tile_result(fns.score_mod(s_leaf, a, b), "score_mod", r, c, s, "float")
            sp = sp_graph.detach()
        else:
            with torch.no_grad():
                sp = _tile_result(fns.score_mod(s, a, b), "score_mod", r, c, s, "float")
        return out, m, logw, sp, s_leaf, sp_graph

    def _sets(self, s: Tensor, tile: Tile, a: View, b: View) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        """The tile's pairs out of every set (the self pair unless ``include_self``, and
        ``exclude``'s), the positives' weights (0 where out, and on the self pair) and
        the log denominator weights (None: all 1), checked."""
        r, c = s.shape
        fns = self.fns
        out = torch.zeros((r, c), dtype=torch.bool, device=s.device)
        if self.exclude_self:
            mask_self_(out, tile, True)  # type: ignore[arg-type]
        if fns.exclude is not None:
            args = (a, b, s.detach()) if fns.exclude_scores else (a, b)
            out = out | _tile_result(fns.exclude(*args), "exclude", r, c, s, "bool")
        if fns.positive is not None:
            m = _tile_result(fns.positive(a, b), "positive", r, c, s, "weight")
        else:  # two towers: the diagonal
            m = a.index == b.index
        if m.dtype != torch.bool and bool((m < 0).any()):
            raise ValueError("positive returned a negative weight: positives are bool, or weights >= 0 (0: none)")
        zero = torch.zeros((), dtype=s.dtype, device=s.device)
        m = torch.where(out, zero, m.to(s.dtype))
        if self.own and not self.exclude_self:  # the self pair in the denominator, never a positive
            m = m.clone()
            mask_self_(m, tile, 0.0)
        logw = None
        if fns.weight is not None:
            w = _tile_result(fns.weight(a, b), "weight", r, c, s, "weight").to(s.dtype)
            if bool((w < 0).any()):
                raise ValueError("weight returned a negative weight: weights are >= 0 (0: out of the denominator)")
            logw = torch.log(w)
        return out, m, logw

    def _z(self, sp: Tensor, out: Tensor, logw: Optional[Tensor], m: Tensor) -> Tensor:
        """The denominator's terms ``s' + log w`` (``-inf`` for the pairs out of it); a
        positive whose modified score is ``-inf`` is an error."""
        if self.kind == "softmax" and self.fns.score_mod is not None and bool((torch.isneginf(sp) & (m > 0)).any()):
            raise ValueError("score_mod returned -inf on a positive pair: a positive must stay in the denominator")
        z = sp if logw is None else sp + logw
        return torch.where(out, torch.full((), float("-inf"), dtype=sp.dtype, device=sp.device), z)

    # ------------------------------------------------------------------ reduction
    def state(self, m: int, n: int, like: Tensor, bound: Optional[float]) -> _FlexState:
        return _FlexState(m, like, self.n_params, self.kind)

    def reduce(self, s: Tensor, tile: Tile, st: _FlexState, p: int = 0) -> None:
        out, m, logw, sp, _, _ = self._terms(s, tile)
        self._accumulate(st, tile, out, m, logw, sp)

    def _accumulate(
        self, st: _FlexState, tile: Tile, out: Tensor, m: Tensor, logw: Optional[Tensor], sp: Tensor
    ) -> None:
        """A tile's terms into the rows' accumulators."""
        rows = slice(tile.r0, tile.r1)
        if self.kind == "sigmoid":
            st.row[rows] += self._pair_losses(sp, out, logw, m).sum(1)
            return
        z = self._z(sp, out, logw, m)
        mp = torch.where(m > 0, m * sp, torch.zeros((), dtype=sp.dtype, device=sp.device))
        st.row[rows] = torch.logaddexp(st.row[rows], torch.logsumexp(z, 1))
        st.pos[rows] += mp.sum(1)
        st.msum[rows] += m.sum(1)
        st.cnt[rows] += (m > 0).sum(1).to(st.cnt.dtype)

    def _pair_losses(self, sp: Tensor, out: Tensor, logw: Optional[Tensor], m: Tensor) -> Tensor:
        """The sigmoid kind's per-pair terms ``w [m softplus(-t) + (1 - m) softplus(t)]``."""
        t = sp + self.bias
        terms = m * softplus(-t) + (1 - m) * softplus(t)
        if logw is not None:
            terms = terms * torch.exp(logw)
        return torch.where(out, torch.zeros((), dtype=terms.dtype, device=terms.device), terms)

    @staticmethod
    def _weights(positives: str, lse: Tensor, msum: Tensor, cnt: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """``(c, a, valid)`` of each row from its positives' weight sum and count."""
        has = cnt > 0
        zero = torch.zeros_like(msum)
        if positives == "mean":
            c = torch.where(has, msum / cnt.clamp_min(1), zero)
            a = torch.where(has, 1.0 / cnt.clamp_min(1), zero)
        elif positives == "weighted_mean":
            has = has & (msum > 0)
            c = has.to(msum.dtype)
            a = torch.where(has, 1.0 / torch.where(has, msum, torch.ones_like(msum)), zero)
        elif positives == "pairs":
            c, a = msum, has.to(msum.dtype)
        else:  # "sum": every row with a denominator
            has = torch.ones_like(has)
            c, a = torch.ones_like(msum), torch.ones_like(msum)
        valid = has & torch.isfinite(lse)
        return torch.where(valid, c, zero), torch.where(valid, a, zero), valid

    def finish(self, st: _FlexState, p: int = 0) -> None:
        if self.kind == "sigmoid":
            self.valid_rows = torch.ones_like(st.row, dtype=torch.bool)
            return
        c, a, valid = self._weights(self.positives, st.row, st.msum, st.cnt)
        st.ca, self.valid_rows = (c, a), valid

    def values(self, st: _FlexState) -> Tuple[Tensor, Optional[Tensor]]:
        if self.kind == "sigmoid":
            return st.row, None
        assert st.ca is not None
        c, a = st.ca
        zero = torch.zeros((), dtype=st.row.dtype, device=st.row.device)
        return torch.where(c > 0, c * st.row, zero) - a * st.pos, None

    # ------------------------------------------------------------------ gradient
    def begin_grad(self, st: _FlexState, g_row: Tensor, g_col: Optional[Tensor]) -> None:
        st.g_row = g_row

    def _tile_grad(self, s: Tensor, tile: Tile, st: _FlexState, g_row: Tensor, terms: Any = None) -> Tensor:
        """``dL/ds`` of the tile, weighted by the rows' upstream gradients, through
        ``score_mod`` (the captured tensors' gradients added to the state's); ``terms``:
        the tile's terms when already formed (with their graph)."""
        rows = slice(tile.r0, tile.r1)
        if terms is None:
            terms = self._terms(s, tile, grad=self.fns.score_mod is not None)
        out, m, logw, sp, s_leaf, sp_graph = terms
        gr = g_row[rows].unsqueeze(1)
        zero = torch.zeros((), dtype=s.dtype, device=s.device)
        if self.kind == "sigmoid":
            g = torch.sigmoid(sp + self.bias) - m
            if logw is not None:
                g = g * torch.exp(logw)
            g = torch.where(out, zero, g) * gr
            if self.learn_bias:
                _add(st.param_grads, 0, g.sum())
        else:
            assert st.ca is not None
            c, a = st.ca
            z = self._z(sp, out, logw, m)
            g = torch.exp(z - st.row[rows].unsqueeze(1)) * (c[rows] * g_row[rows]).unsqueeze(1)
            g = g - m * (a[rows] * g_row[rows]).unsqueeze(1)
            g = torch.where(out, zero, g)  # a pair out of every set: no gradient (a NaN there stays out)
        if sp_graph is None:
            return g
        assert s_leaf is not None
        first = int(self.learn_bias)
        grads = torch.autograd.grad(
            sp_graph, [s_leaf, *self.captured], g, retain_graph=bool(self.captured), allow_unused=True
        )
        for i, gp in enumerate(grads[1:]):
            if gp is not None:
                _add(st.param_grads, first + i, gp)
        return grads[0] if grads[0] is not None else torch.zeros_like(s)

    def grad(self, s: Tensor, tile: Tile, st: _FlexState, buf: Optional[Tensor] = None) -> Tensor:
        assert st.g_row is not None
        return s.copy_(self._tile_grad(s, tile, st, st.g_row))

    def rows_fused(self, s: Tensor, tile: Tile, st: _FlexState, g_row: Optional[Tensor]) -> Optional[Tensor]:
        rows = slice(tile.r0, tile.r1)
        terms = self._terms(s, tile, grad=g_row is not None and self.fns.score_mod is not None)
        self._accumulate(st, tile, *terms[:4])
        if self.valid_rows is None:
            self.valid_rows = torch.ones_like(st.row, dtype=torch.bool)
        if self.kind == "softmax":
            c, a, valid = self._weights(self.positives, st.row[rows], st.msum[rows], st.cnt[rows])
            if st.ca is None:
                st.ca = (torch.zeros_like(st.row), torch.zeros_like(st.row))
            st.ca[0][rows], st.ca[1][rows] = c, a
            self.valid_rows[rows] = valid
        if g_row is None:
            return None
        return s.copy_(self._tile_grad(s, tile, st, g_row, terms))

    def param_grads(self, st: _FlexState, n: int) -> Tuple[Optional[Tensor], ...]:
        return tuple(st.param_grads[:n]) + (None,) * (n - len(st.param_grads))

    # ------------------------------------------------------------------ dense form
    def dense(self, s: Tensor, tile: Tile, params: Tuple[Tensor, ...] = ()) -> Tuple[Tensor, Optional[Tensor]]:
        """The losses from the whole score matrix by differentiable torch ops (the dense
        backend; second derivatives); the captured tensors enter through ``score_mod``."""
        r, c = s.shape
        a, b = self._views(tile)
        fns = self.fns
        out, m, logw = self._sets(s, tile, a, b)
        sp = s if fns.score_mod is None else _tile_result(fns.score_mod(s, a, b), "score_mod", r, c, s, "float")
        zero = torch.zeros((), dtype=s.dtype, device=s.device)
        if self.kind == "sigmoid":
            bias = params[0].to(s.dtype) if self.learn_bias and params else self.bias
            t = sp + bias
            terms = m * softplus(-t) + (1 - m) * softplus(t)
            if logw is not None:
                terms = terms * torch.exp(logw)
            rows_loss = torch.where(out, zero, terms).sum(1)
            self.valid_rows = torch.ones(r, dtype=torch.bool, device=s.device)
            return rows_loss, None
        z = self._z(sp, out, logw, m.detach())
        mp = torch.where(m > 0, m * sp, zero)
        lse = _safe_logsumexp(z, 1)
        c_, a_, valid = self._weights(self.positives, lse.detach(), m.sum(1), (m > 0).sum(1).to(s.dtype))
        self.valid_rows = valid
        return torch.where(valid, c_ * torch.where(valid, lse, zero) - a_ * mp.sum(1), zero), None


def _safe_logsumexp(t: Tensor, dim: int) -> Tensor:
    """``torch.logsumexp`` whose gradient stays finite where every entry is ``-inf``."""
    empty = torch.isneginf(t).all(dim, keepdim=True)
    return torch.logsumexp(t.masked_fill(empty, 0.0), dim).masked_fill(empty.squeeze(dim), float("-inf"))


def _add(grads: List[Optional[Tensor]], i: int, g: Tensor) -> None:
    grads[i] = g.detach().clone() if grads[i] is None else grads[i] + g.detach()  # type: ignore[operator]


def stack_fields(fields: Sequence[Dict[str, Tensor]]) -> Dict[str, Tensor]:
    """Several data dicts of the same fields, joined along the samples."""
    return {k: torch.cat([f[k] for f in fields]) for k in fields[0]} if fields else {}
