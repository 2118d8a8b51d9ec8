"""The flashcl calls :func:`flashcl.doctor` tries as replacements of a user's loss:
one family of calls per kind of inputs (a square score matrix; embeddings and int
labels, with class weights or not; two embedding matrices, with a score per pair or
not), each with the parameters users write, printed with the names of the user's
function's own parameters so that the call runs as printed inside it."""

from __future__ import annotations

import functools
import random
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..losses.clip import clip_loss
from ..losses.contrastive import contrastive_loss
from ..losses.cosent import cosent_loss
from ..losses.flex import FlexPairSum, flex_loss
from ..losses.info_nce import info_nce_loss
from ..losses.margin import arcface_loss, cosface_loss
from ..losses.neighbor import neighbor_loss
from ..losses.nt_xent import nt_xent_loss
from ..losses.rank_n_contrast import rank_n_contrast_loss
from ..losses.supcon import supcon_loss
from ..losses.triplet import triplet_loss

__all__ = ["Candidate", "candidates", "families", "flex_template"]

_TEMPERATURES = (0.05, 0.07, 0.1, 0.2, 0.5, 1.0)


_TRIPLET_MARGINS = (0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)
_COSENT_SCALES = (1.0, 5.0, 10.0, 16.0, 20.0, 30.0, 32.0, 50.0, 64.0)
_MARGIN_SCALES = (10.0, 16.0, 30.0, 32.0, 64.0)
_COSFACE_MARGINS = (0.1, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5)
_ARCFACE_MARGINS = (0.1, 0.2, 0.3, 0.4, 0.5)
#: the negatives' margins of the pair sums (pytorch-metric-learning's default 1; Hadsell's often 1 or 2)
_PAIR_MARGINS = (0.2, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 5.0)
#: Rank-N-Contrast's temperatures (the published default 2)
_RNC_TEMPERATURES = (0.1, 0.5, 1.0, 2.0, 3.0, 5.0)

Candidate = Tuple[str, Callable[[], Tensor]]
#: how a family names an input in the call it prints: the user's parameter, or a default
Namer = Callable[[Tensor, str], str]


def _words(values: Sequence[float]) -> str:
    return ", ".join(f"{v:g}" for v in values)


def _show(value: Any) -> str:
    """An option as the printed call writes it: short, and exactly the value called with."""
    if isinstance(value, float) and float(f"{value:g}") == value:
        return f"{value:g}"
    return repr(value)


def _call(fn: Callable[..., Tensor], inputs: Sequence[Tuple[str, Any]], **options: Any) -> Candidate:
    """``fn`` on ``inputs`` (each as the printed call writes it, and its value) with the
    keyword ``options``: the call printed and the call made from the same values."""
    written = [w for w, _ in inputs] + [f"{k}={_show(v)}" for k, v in options.items()]
    return f"flashcl.{fn.__name__}({', '.join(written)})", functools.partial(fn, *(v for _, v in inputs), **options)


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
                    out.append(_call(neighbor_loss, [(scores, x), (how, nb)], exclude_diagonal=excl, reduction=red))
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
    inputs = [(name(e, "embeddings"), e), (name(y, "labels"), y)]
    out: List[Candidate] = []
    for t in _TEMPERATURES:
        for pos, inc in [(p, i) for p in ("mean", "sum") for i in (False, True)] + [("lse", False)]:
            for red in ("mean", "sum"):
                options = dict(temperature=t, positives=pos, include_self=inc, reduction=red)
                out.append(_call(supcon_loss, inputs, **options))
    words = (
        f"supcon_loss at temperatures {_words(_TEMPERATURES)}, positives mean / sum (include_self or not) / lse "
        "(SupCon's L_in), mean / sum"
    )
    return words, out


def _contrastive(inputs: Sequence[Any], seed: int, name: Namer) -> Optional[Tuple[str, List[Candidate]]]:
    """The classic contrastive loss as pytorch-metric-learning computes it: hinges on the
    distances of positive and negative pairs, each set's mean over its non-zero terms or
    over its pairs, or the sum."""
    pair = _labelled(inputs)
    if pair is None:
        return None
    e, y = pair
    inputs = [(name(e, "embeddings"), e), (name(y, "labels"), y)]
    out: List[Candidate] = []
    for m in _PAIR_MARGINS:
        for distance in ("euclidean", "squared"):
            for normalize in (True, False):
                for red in ("mean_nonzero", "mean", "sum"):
                    options = dict(neg_margin=m, distance=distance, normalize=normalize, reduction=red)
                    out.append(_call(contrastive_loss, inputs, **options))
    words = (
        f"contrastive_loss (pytorch-metric-learning's ContrastiveLoss) at margins {_words(_PAIR_MARGINS)}, "
        "euclidean / squared distances, normalised or not, the mean over non-zero terms / mean / sum"
    )
    return words, out


def _rank_n_contrast(inputs: Sequence[Any], seed: int, name: Namer) -> Optional[Tuple[str, List[Candidate]]]:
    """Rank-N-Contrast: features (B, D), or (B, V, D) views as the published code takes
    them, and a regression target per sample (B,) or (B, K)."""
    tensors = [t for t in inputs if isinstance(t, Tensor)]
    if len(tensors) != 2 or not all(t.is_floating_point() for t in tensors):
        return None
    f, y = tensors
    if f.dim() not in (2, 3) or y.dim() not in (1, 2) or y.shape[0] != f.shape[0] or y.requires_grad:
        return None
    if f.dim() == 2 and y.dim() == 2 and y.shape[1] == f.shape[1]:
        return None  # two towers of one width, not features and targets
    inputs = [(name(f, "features"), f), (name(y, "labels"), y)]
    out: List[Candidate] = []
    for t in _RNC_TEMPERATURES:
        for red in ("mean", "sum"):
            out.append(_call(rank_n_contrast_loss, inputs, temperature=t, reduction=red))
    return f"rank_n_contrast_loss at temperatures {_words(_RNC_TEMPERATURES)}, mean / sum", out


def _triplet(inputs: Sequence[Any], seed: int, name: Namer) -> Optional[Tuple[str, List[Candidate]]]:
    pair = _labelled(inputs)
    if pair is None:
        return None
    e, y = pair
    inputs = [(name(e, "embeddings"), e), (name(y, "labels"), y)]
    out: List[Candidate] = []
    # the soft margin printed only where it is taken
    settings: List[Dict[str, Any]] = [
        dict(margin=m, mining=mining) for m in _TRIPLET_MARGINS for mining in ("all", "hard", "semi-hard")
    ]
    settings += [dict(margin=0.0, mining=mining, soft_margin=True) for mining in ("hard", "semi-hard")]
    for setting in settings:
        for distance in ("euclidean", "squared", "cosine"):
            for normalize in (False, True):
                for red in ("mean", "sum"):
                    options = dict(setting, distance=distance, normalize=normalize, reduction=red)
                    out.append(_call(triplet_loss, inputs, **options))
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
    nw = name(w, "class_weights")
    if w.shape[1] == e.shape[1]:
        weights.append((nw, w))
    if w.shape[0] == e.shape[1]:
        weights.append((f"{nw}.T", w.T))
    if not weights:
        return None
    out: List[Candidate] = []
    for weight in weights:
        inputs = [(name(e, "embeddings"), e), (name(y, "labels"), y), weight]
        for scale in _MARGIN_SCALES:
            for red in ("mean", "sum"):
                for m in _COSFACE_MARGINS:
                    out.append(_call(cosface_loss, inputs, margin=m, scale=scale, reduction=red))
                for m in _ARCFACE_MARGINS:
                    for easy in (False, True):
                        out.append(_call(arcface_loss, inputs, margin=m, scale=scale, easy_margin=easy, reduction=red))
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
    out: List[Candidate] = []
    for t in _TEMPERATURES:
        if a.shape == b.shape:
            out.append(_call(nt_xent_loss, [(name(a, "z1"), a), (name(b, "z2"), b)], temperature=t))
            out.append(_call(clip_loss, [(name(a, "image"), a), (name(b, "text"), b)], logit_scale=1 / t))
        out.append(_call(info_nce_loss, [(name(a, "query"), a), (name(b, "keys"), b)], temperature=t))
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
    inputs = [(name(a, "a"), a), (name(b, "b"), b), (name(y, "scores"), y)]
    out: List[Candidate] = []
    for scale in _COSENT_SCALES:
        for similarity in ("cosine", "angle"):
            out.append(_call(cosent_loss, inputs, scale=scale, similarity=similarity))
    return f"cosent_loss at scales {_words(_COSENT_SCALES)}, cosine or AnglE's angle similarity", out


_WINDOWS = (0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)


class _Field(NamedTuple):
    field: str  # the name the views carry it by (an identifier)
    written: str  # the user's name for it
    t: Tensor


class _FlexLayout(NamedTuple):
    """A flex call's inputs: the anchors ``q``, the keys ``k`` (None: self-contrast), the
    per-sample fields of ``rows=`` and of ``cols=`` (two towers of one length: the same
    fields in both, so that ``b`` reads them too)."""

    q: Tensor
    k: Optional[Tensor]
    rows: List[_Field]
    cols: List[_Field]


def _flex_layout(inputs: Sequence[Any], name: Namer) -> Optional[_FlexLayout]:
    """The embeddings (the first 2-D floating input; a second one of the same width: the
    keys) and every other per-sample tensor as a field of the anchors (and, where the keys
    are as many, of the keys), or None for inputs a flex loss does not take (a square
    score matrix alone, no embeddings)."""
    tensors = [t for t in inputs if isinstance(t, Tensor)]
    matrices = [t for t in tensors if t.is_floating_point() and t.dim() == 2]
    if not matrices or (len(tensors) == 1 and matrices[0].shape[0] == matrices[0].shape[1]):
        return None
    q = next((t for t in matrices if t.requires_grad), matrices[0])
    k = next((t for t in matrices if t is not q and t.shape[1] == q.shape[1]), None)
    rows: List[_Field] = []
    cols: List[_Field] = []

    def field(t: Tensor, default: str) -> _Field:
        written = name(t, default)
        return _Field(written if written.isidentifier() else default, written, t)

    for i, t in enumerate(tensors):
        if t is q or t is k or t.dim() == 0:
            continue
        if t.shape[0] == q.shape[0]:
            rows.append(field(t, f"x{i}"))
            if k is not None and k.shape[0] == q.shape[0]:
                cols.append(rows[-1])
        elif k is not None and t.shape[0] == k.shape[0]:
            cols.append(field(t, f"k{i}"))
    return _FlexLayout(q, k, rows, cols)


def _positive_forms(layout: _FlexLayout) -> Tuple[List[Tuple[str, bool]], str]:
    """The positives a flex call may take from the first field of the anchors (and its
    namesake of the keys): ``[(code, weighted)]`` and, in words, what was tried. Equal
    labels; a window on a number (several widths); a shared label of multi-hot labels,
    or their Jaccard similarity as weights; soft labels' dot product as weights."""
    if not layout.rows:
        return [], "no per-sample data: the diagonal (two towers) or nothing to infer (self-contrast)"
    f = layout.rows[0]
    other = f.field if layout.k is None or f in layout.cols else (layout.cols[0].field if layout.cols else None)
    if other is None:
        return [], f"the keys carry no data to compare with {f.written}"
    a, b, t = f"a.{f.field}", f"b.{other}", f.t
    if t.dim() == 1 and not t.is_floating_point():
        return [(f"{a} == {b}", False)], f"equal {f.written}"
    if t.dim() == 1:
        forms = [(f"({a} - {b}).abs() <= {w:g}", False) for w in _WINDOWS]
        return forms, f"a window |{a} - {b}| <= w on {f.written}, w = {_words(_WINDOWS)}"
    if t.dim() == 2 and not t.is_floating_point():
        return [
            (f"({a} & {b}).any(-1)", False),
            (f"({a} & {b}).sum(-1) / ({a} | {b}).sum(-1).clamp_min(1)", True),
        ], f"a shared label of the multi-hot {f.written}, or their Jaccard similarity as weights"
    if t.dim() == 2:
        return [(f"({a} * {b}).sum(-1)", True)], f"the dot product of the soft labels {f.written} as weights"
    return [], f"{f.written} has {t.dim()} dimensions: write the positive yourself"


def _namespace(layout: _FlexLayout, name: Namer) -> Dict[str, Any]:
    """The names a printed call reads, bound to the inputs (``args[i]``: the i-th of a
    tuple ``args``), with ``flashcl`` and ``torch``."""
    # the printed call's ``flashcl.flex_loss``: the function itself (the package is what imports this module)
    ns: Dict[str, Any] = {"flashcl": SimpleNamespace(flex_loss=flex_loss, FlexPairSum=FlexPairSum), "torch": torch}
    starred: Dict[str, Dict[int, Tensor]] = {}
    pairs = [(layout.q, name(layout.q, "embeddings"))]
    pairs += [] if layout.k is None else [(layout.k, name(layout.k, "keys"))]
    pairs += [(f.t, f.written) for f in layout.rows + layout.cols]
    for t, written in pairs:
        if written.isidentifier():
            ns[written] = t
        else:  # "args[i]"
            base, index = written[:-1].split("[", 1)
            starred.setdefault(base, {})[int(index)] = t
    for base, items in starred.items():
        ns[base] = tuple(items.get(i) for i in range(max(items) + 1))
    return ns


def _flex_call(layout: _FlexLayout, name: Namer, options: str, sep: str = " ") -> str:
    """``flashcl.flex_loss(...)`` in the user's names with ``options`` (keyword text)."""
    parts = [name(layout.q, "embeddings")]
    if layout.k is not None:
        parts.append(name(layout.k, "keys"))
    if layout.rows:
        parts.append("rows={" + ", ".join(f'"{f.field}": {f.written}' for f in layout.rows) + "}")
    if layout.cols:
        parts.append("cols={" + ", ".join(f'"{f.field}": {f.written}' for f in layout.cols) + "}")
    return "flashcl.flex_loss(" + ("," + sep).join(parts + [options]) + ")"


def _flex(inputs: Sequence[Any], seed: int, name: Namer) -> Optional[Tuple[str, List[Candidate]]]:
    """Flex calls whose positives come from the per-sample data (its first field): each
    positive form with the positives' modes, temperatures, normalised or not, and the
    reductions (the mean over the anchors with positives, the sum, the sum over the
    batch's size); each built by evaluating the printed call, so that it runs as printed."""
    layout = _flex_layout(inputs, name)
    if layout is None:
        return None
    forms, words = _positive_forms(layout)
    if not forms:
        return None
    ns = _namespace(layout, name)
    n = f"{name(layout.q, 'embeddings')}.shape[0]"
    modes = [("weighted_mean", False), ("mean", False)] if forms[0][1] else [("mean", False), ("sum", False)]
    if layout.k is None:
        modes.append(("mean", True))
    if not forms[0][1]:
        modes.append(("lse", False))  # the positives' probability mass (the soft nearest-neighbour loss)
    out: List[Candidate] = []

    def add(options: str, tail: str = "") -> None:
        call = _flex_call(layout, name, options) + tail
        out.append((call, eval(f"lambda: {call}", ns)))  # noqa: S307 - the printed call, as printed

    for code, weighted in forms:
        for positives, include_self in [("weighted_mean", False)] if weighted else modes:
            for t in _TEMPERATURES:
                for normalize in (True, False):
                    for red, tail in (("mean", ""), ("sum", ""), ("sum", f" / {n}")):
                        add(
                            f"positive=lambda a, b: {code}, positives='{positives}', "
                            + ("include_self=True, " if include_self else "")
                            + f"temperature={t}, normalize={normalize}, reduction='{red}'",
                            tail,
                        )
    temps = _words(_TEMPERATURES)
    words = f"flex_loss with positives from {words}, at temperatures {temps}, normalised or not"
    if not layout.rows[0].t.is_floating_point():  # labels: Hadsell's squared contrastive loss as a pair sum
        code = forms[0][0]
        tails = (
            ("mean", ""),
            ("sum", ""),
            ("sum", f" / {n}"),
            ("sum", f" / {n} ** 2"),
            ("sum", f" / ({n} * ({n} - 1))"),
        )
        for half in ("", "0.5 * "):
            for m in _PAIR_MARGINS:
                for normalize in (True, False):
                    for red, tail in tails:
                        add(
                            f"positive=lambda a, b: {code}, kind=flashcl.FlexPairSum(distance='euclidean'), "
                            f"pos_mod=lambda d, a, b: {half}d.pow(2), "
                            f"neg_mod=lambda d, a, b: {half}({m:g} - d).relu().pow(2), "
                            f"temperature=1.0, normalize={normalize}, reduction='{red}'",
                            tail,
                        )
        words += (
            "; Hadsell's squared contrastive loss (d^2 on positives, relu(m - d)^2 on the others, halved or not, "
            f"the rows normalised or not) as a pair sum at margins {_words(_PAIR_MARGINS)}, the mean of each set, the "
            "sum, over n, n^2 or n(n - 1)"
        )
    return words, out


#: every family the doctor tries, each on the inputs it takes (flex last: a built-in is named first)
_FAMILIES = (_neighbor, _supcon, _contrastive, _triplet, _margin, _two_towers, _cosent, _rank_n_contrast, _flex)


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
    """The loss as a :func:`flashcl.flex_loss` call in the user's names, to fill in where
    no call the doctor tried matched: the embeddings (the first 2-D floating input; a
    second one of the same width: the keys), every other per-sample tensor as a field of
    ``rows=`` (and of ``cols=`` where the keys are as many), a first positive function
    from the first field, and comments that say what could not be inferred. None for
    inputs a flex loss does not take (a square score matrix alone, no embeddings)."""
    name = _namer(inputs, names)
    layout = _flex_layout(inputs, name)
    if layout is None:
        return None
    forms, words = _positive_forms(layout)
    lines = ["flashcl.flex_loss(", f"    {name(layout.q, 'embeddings')},"]
    if layout.k is not None:
        lines.append(f"    {name(layout.k, 'keys')},")
    if layout.rows:
        lines.append("    rows={" + ", ".join(f'"{f.field}": {f.written}' for f in layout.rows) + "},")
    if layout.cols:
        lines.append("    cols={" + ", ".join(f'"{f.field}": {f.written}' for f in layout.cols) + "},")
    if forms:
        lines.append(f"    positive=lambda a, b: {forms[0][0]},  # could not infer: tried {words}")
    elif layout.k is None:
        lines.append(f"    positive=lambda a, b: ...,  # which pairs are positives? ({words})")
    else:
        lines.append("    # positive: the diagonal (a.index == b.index) unless given")
    lines += [
        "    exclude=None,  # pairs out of every set: lambda a, b: ... (duplicates, false negatives)",
        f"    temperature=0.1,  # could not infer: tried {_words(_TEMPERATURES)} with each positive above",
        ")",
    ]
    return "\n".join(lines)
