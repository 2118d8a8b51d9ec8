"""The flashcl calls :func:`flashcl.doctor` tries as replacements of a user's loss:
one family of calls per kind of inputs (a square score matrix; embeddings and int
labels, with class weights or not; two embedding matrices, with a score per pair or
not), each with the parameters users write, printed with the names of the user's
function's own parameters so that the call runs as printed inside it."""

from __future__ import annotations

import functools
import random
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..losses.clip import clip_loss
from ..losses.cosent import cosent_loss
from ..losses.info_nce import info_nce_loss
from ..losses.margin import arcface_loss, cosface_loss
from ..losses.neighbor import neighbor_loss
from ..losses.nt_xent import nt_xent_loss
from ..losses.supcon import supcon_loss
from ..losses.triplet import triplet_loss

__all__ = ["Candidate", "candidates", "families", "flex_template"]

_TEMPERATURES = (0.05, 0.07, 0.1, 0.2, 0.5, 1.0)


_TRIPLET_MARGINS = (0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)
_COSENT_SCALES = (1.0, 5.0, 10.0, 16.0, 20.0, 30.0, 32.0, 50.0, 64.0)
_MARGIN_SCALES = (10.0, 16.0, 30.0, 32.0, 64.0)
_COSFACE_MARGINS = (0.1, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5)
_ARCFACE_MARGINS = (0.1, 0.2, 0.3, 0.4, 0.5)

Candidate = Tuple[str, Callable[[], Tensor]]
#: how a family names an input in the call it prints: the user's parameter, or a default
Namer = Callable[[Tensor, str], str]


def _words(values: Sequence[float]) -> str:
    return ", ".join(f"{v:g}" for v in values)


def _namer(inputs: Sequence[Any], names: Optional[Sequence[str]]) -> Namer:
    """The name of each input in the user's function (``names``, by position), else the
    family's own word for it."""

    def name(t: Tensor, default: str) -> str:
        for x, n in zip(inputs, names or ()):
            if x is t:
                return n
        return default

    return name


def _split(inputs: Sequence[Any]) -> Tuple[List[Tensor], List[Tensor]]:
    tensors = [t for t in inputs if isinstance(t, Tensor)]
    return [t for t in tensors if t.is_floating_point()], [t for t in tensors if not t.is_floating_point()]


def _neighbor(inputs: Sequence[Any], seed: int, name: Namer) -> Optional[Tuple[str, List[Candidate]]]:
    floats, ints = _split(inputs)
    if not (len(floats) == 1 and floats[0].dim() == 2 and floats[0].shape[0] == floats[0].shape[1] and not ints):
        return None
    x = floats[0]
    n = x.shape[0]
    scores = name(x, "scores")
    out: List[Candidate] = []
    for k in (1, 2, 3, 4, 5):
        # the neighbours the user's function drew, replayed from the same seed
        random.seed(seed)
        nb_py = torch.tensor([[random.randrange(0, n) for _ in range(k)] for _ in range(n)])
        torch.manual_seed(seed)
        nb_t = torch.randint(0, n, (n, k))
        rows = f"{scores}.shape[0]"
        drawn = (  # the neighbours drawn as the user's code draws them, at any size
            (nb_py, f"torch.tensor([[random.randrange(0, {rows}) for _ in range({k})] for _ in range({rows})])"),
            (nb_t, f"torch.randint(0, {rows}, ({rows}, {k}))"),
        )
        for nb, how in drawn:
            for excl in (True, False):
                for red in ("sum", "mean"):
                    call = f"flashcl.neighbor_loss({scores}, {how}, exclude_diagonal={excl}, reduction='{red}')"
                    fn = functools.partial(neighbor_loss, x, nb, exclude_diagonal=excl, reduction=red)
                    out.append((call, fn))
    words = (
        "neighbor_loss with k = 1..5 neighbours drawn by random.randrange or torch.randint, diagonal "
        "excluded or not, sum or mean"
    )
    return words, out


def _labelled(inputs: Sequence[Any]) -> Optional[Tuple[Tensor, Tensor]]:
    floats, ints = _split(inputs)
    if len(floats) == 1 and floats[0].dim() == 2 and len(ints) == 1 and ints[0].dim() == 1:
        return floats[0], ints[0]
    return None


def _supcon(inputs: Sequence[Any], seed: int, name: Namer) -> Optional[Tuple[str, List[Candidate]]]:
    pair = _labelled(inputs)
    if pair is None:
        return None
    e, y = pair
    ne, ny = name(e, "embeddings"), name(y, "labels")
    out: List[Candidate] = []
    for t in _TEMPERATURES:
        for pos in ("mean", "sum"):
            for inc in (False, True):
                for red in ("mean", "sum"):
                    call = (
                        f"flashcl.supcon_loss({ne}, {ny}, temperature={t}, positives='{pos}', "
                        f"include_self={inc}, reduction='{red}')"
                    )
                    fn = functools.partial(
                        supcon_loss, e, y, temperature=t, positives=pos, include_self=inc, reduction=red
                    )
                    out.append((call, fn))
    words = f"supcon_loss at temperatures {_words(_TEMPERATURES)}, positives mean / sum, include_self, mean / sum"
    return words, out


def _triplet(inputs: Sequence[Any], seed: int, name: Namer) -> Optional[Tuple[str, List[Candidate]]]:
    pair = _labelled(inputs)
    if pair is None:
        return None
    e, y = pair
    ne, ny = name(e, "embeddings"), name(y, "labels")
    out: List[Candidate] = []
    settings = [(m, mining, False) for m in _TRIPLET_MARGINS for mining in ("all", "hard", "semi-hard")]
    settings += [(0.0, mining, True) for mining in ("hard", "semi-hard")]
    for margin, mining, soft in settings:
        for distance in ("euclidean", "squared", "cosine"):
            for normalize in (False, True):
                for red in ("mean", "sum"):
                    call = (
                        f"flashcl.triplet_loss({ne}, {ny}, margin={margin:g}, mining='{mining}'"
                        + (", soft_margin=True" if soft else "")
                        + f", distance='{distance}', normalize={normalize}, reduction='{red}')"
                    )
                    fn = functools.partial(
                        triplet_loss,
                        e,
                        y,
                        margin=margin,
                        mining=mining,
                        soft_margin=soft,
                        distance=distance,
                        normalize=normalize,
                        reduction=red,
                    )
                    out.append((call, fn))
    words = (
        f"triplet_loss batch-all / batch-hard / semi-hard at margins {_words(_TRIPLET_MARGINS)} (and the soft "
        "margin), euclidean / squared / cosine distances, normalised or not, mean / sum"
    )
    return words, out


def _margin(inputs: Sequence[Any], seed: int, name: Namer) -> Optional[Tuple[str, List[Candidate]]]:
    """CosFace / ArcFace: embeddings (B, D), int labels and a class-weight matrix,
    (C, D) or, as pytorch-metric-learning holds it, (D, C)."""
    floats, ints = _split(inputs)
    if not (len(floats) == 2 and all(f.dim() == 2 for f in floats) and len(ints) == 1 and ints[0].dim() == 1):
        return None
    e, w = floats
    y = ints[0]
    if e.shape[0] != y.shape[0]:
        return None
    weights = []
    ne, ny, nw = name(e, "embeddings"), name(y, "labels"), name(w, "class_weights")
    if w.shape[1] == e.shape[1]:
        weights.append((nw, w))
    if w.shape[0] == e.shape[1]:
        weights.append((f"{nw}.T", w.T))
    if not weights:
        return None
    out: List[Candidate] = []
    for written, cw in weights:
        for scale in _MARGIN_SCALES:
            for red in ("mean", "sum"):
                for m in _COSFACE_MARGINS:
                    call = (
                        f"flashcl.cosface_loss({ne}, {ny}, {written}, margin={m}, scale={scale:g}, reduction='{red}')"
                    )
                    fn = functools.partial(cosface_loss, e, y, cw, margin=m, scale=scale, reduction=red)
                    out.append((call, fn))
                for m in _ARCFACE_MARGINS:
                    for easy in (False, True):
                        call = (
                            f"flashcl.arcface_loss({ne}, {ny}, {written}, margin={m}, scale={scale:g}, "
                            f"easy_margin={easy}, reduction='{red}')"
                        )
                        fn = functools.partial(
                            arcface_loss, e, y, cw, margin=m, scale=scale, easy_margin=easy, reduction=red
                        )
                        out.append((call, fn))
    words = (
        f"cosface_loss at margins {_words(_COSFACE_MARGINS)} and arcface_loss at margins "
        f"{_words(_ARCFACE_MARGINS)} (radians, easy_margin or not), scales {_words(_MARGIN_SCALES)}, the class "
        "weights as (C, D) or (D, C), mean / sum"
    )
    return words, out


def _two_towers(inputs: Sequence[Any], seed: int, name: Namer) -> Optional[Tuple[str, List[Candidate]]]:
    floats, ints = _split(inputs)
    if not (len(floats) == 2 and all(f.dim() == 2 for f in floats) and not ints):
        return None
    a, b = floats
    na, nb = name(a, "z1"), name(b, "z2")
    out: List[Candidate] = []
    for t in _TEMPERATURES:
        if a.shape == b.shape:
            out.append(
                (
                    f"flashcl.nt_xent_loss({na}, {nb}, temperature={t})",
                    functools.partial(nt_xent_loss, a, b, temperature=t),
                )
            )
            out.append(
                (
                    f"flashcl.clip_loss({name(a, 'image')}, {name(b, 'text')}, logit_scale={1 / t:g})",
                    functools.partial(clip_loss, a, b, 1 / t),
                )
            )
        out.append(
            (
                f"flashcl.info_nce_loss({name(a, 'query')}, {name(b, 'keys')}, temperature={t})",
                functools.partial(info_nce_loss, a, b, temperature=t),
            )
        )
    temps = _words(_TEMPERATURES)
    words = (
        f"nt_xent_loss and clip_loss (logit_scale = 1 / t) at temperatures t = {temps}; " if a.shape == b.shape else ""
    ) + (f"info_nce_loss at temperatures {temps}")
    return words, out


def _cosent(inputs: Sequence[Any], seed: int, name: Namer) -> Optional[Tuple[str, List[Candidate]]]:
    """CoSENT / AnglE: the two sides of each pair (B, D) and a score per pair (float
    or int labels)."""
    tensors = [t for t in inputs if isinstance(t, Tensor)]
    sides = [t for t in tensors if t.is_floating_point() and t.dim() == 2]
    scores = [t for t in tensors if t.dim() == 1]
    if not (len(sides) == 2 and sides[0].shape == sides[1].shape and len(scores) == 1 and len(tensors) == 3):
        return None
    a, b = sides
    y = scores[0]
    if y.shape[0] != a.shape[0]:
        return None
    out: List[Candidate] = []
    for scale in _COSENT_SCALES:
        for similarity in ("cosine", "angle"):
            call = (
                f"flashcl.cosent_loss({name(a, 'a')}, {name(b, 'b')}, {name(y, 'scores')}, scale={scale:g}, "
                f"similarity='{similarity}')"
            )
            out.append((call, functools.partial(cosent_loss, a, b, y, scale=scale, similarity=similarity)))
    return f"cosent_loss at scales {_words(_COSENT_SCALES)}, cosine or AnglE's angle similarity", out


#: every family the doctor tries, each on the inputs it takes
_FAMILIES = (_neighbor, _supcon, _triplet, _margin, _two_towers, _cosent)


def families(inputs: Sequence[Any]) -> List[str]:
    """The candidate families :func:`candidates` tries on inputs of this kind, in words."""
    name = _namer(inputs, None)
    out = [found[0] for found in (family(inputs, 0, name) for family in _FAMILIES) if found is not None]
    if not out:
        out.append(
            "no built-in: they take one square score matrix; embeddings and int labels (and class weights); "
            "two embedding matrices (and a score per pair). A flex loss takes embeddings with any per-sample data"
        )
    return out


def candidates(inputs: Sequence[Any], seed: int, names: Optional[Sequence[str]] = None) -> List[Candidate]:
    """flashcl calls that may compute the same loss on these inputs (the same list,
    in the same order, for inputs of any size), each printed with ``names`` (the
    user's function's parameters, by position) for the inputs: it runs as printed
    inside that function (``flashcl``, ``torch`` and, for drawn neighbours, ``random``
    imported)."""
    out: List[Candidate] = []
    name = _namer(inputs, names)
    for family in _FAMILIES:
        found = family(inputs, seed, name)
        if found is not None:
            out += found[1]
    return out


def flex_template(inputs: Sequence[Any], names: Optional[Sequence[str]] = None) -> Optional[str]:
    """The loss as a :func:`flashcl.flex_loss` call in the user's names, to fill in: the
    embeddings (the first 2-D floating input; a second one of the same width: the
    keys), every other per-sample tensor as a field of ``rows=`` (the anchors') or
    ``cols=`` (the keys'), and a positive function from the first field (equality of an
    integer field, a window on a floating one). None for inputs a flex loss does not
    take (a square score matrix alone, no embeddings)."""
    name = _namer(inputs, names)
    tensors = [t for t in inputs if isinstance(t, Tensor)]
    matrices = [t for t in tensors if t.is_floating_point() and t.dim() == 2]
    if not matrices or (len(tensors) == 1 and matrices[0].shape[0] == matrices[0].shape[1]):
        return None
    q = matrices[0]
    k = next((t for t in matrices[1:] if t.shape[1] == q.shape[1]), None)
    rows, cols = [], []
    for t in tensors:
        if t is q or t is k or t.dim() == 0:
            continue
        if t.shape[0] == q.shape[0]:
            rows.append(t)
        elif k is not None and t.shape[0] == k.shape[0]:
            cols.append(t)

    def field(t: Tensor, default: str) -> str:
        written = name(t, default)
        return written if written.isidentifier() else default

    row_fields = [(field(t, f"x{i}"), name(t, f"x{i}"), t) for i, t in enumerate(rows)]
    col_fields = [(field(t, f"k{i}"), name(t, f"k{i}"), t) for i, t in enumerate(cols)]
    lines = ["flashcl.flex_loss(", f"    {name(q, 'embeddings')},"]
    if k is not None:
        lines.append(f"    {name(k, 'keys')},")
    if row_fields:
        lines.append("    rows={" + ", ".join(f'"{f}": {w}' for f, w, _ in row_fields) + "},")
    if col_fields:
        lines.append("    cols={" + ", ".join(f'"{f}": {w}' for f, w, _ in col_fields) + "},")
    if row_fields:
        f, _, t = row_fields[0]
        other = next((g for g, _, _ in col_fields), f) if k is not None else f
        if t.is_floating_point():
            test = f"(a.{f} - b.{other}).abs() <= 1.0"
        else:
            test = f"a.{f} == b.{other}"
        lines.append(f"    positive=lambda a, b: {test},  # the positives: bool, or weights >= 0")
    elif k is None:
        lines.append("    positive=lambda a, b: ...,  # the positives of each pair (a: anchors, b: keys)")
    else:
        lines.append("    # positive: the diagonal (a.index == b.index) unless given")
    lines += [
        "    exclude=None,  # pairs out of every set: lambda a, b: ... (duplicates, false negatives)",
        "    temperature=0.1,",
        ")",
    ]
    return "\n".join(lines)
