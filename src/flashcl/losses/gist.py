"""GISTEmbed: a guide model removes in-batch false negatives: :func:`gist_loss` and
:class:`GistLoss`."""

from __future__ import annotations

from typing import Any, Callable, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from .. import backends, checks, parallel, reference, runner
from ..backends import Source
from ..base import LossModule, shared_docs
from ..checks import Example, Scalar, check_keys, example_rows, scale_dtype
from ..compiled import compiles
from ..core import Exclusions, Tile, compute_dtype
from ..engine.engine import autocast_off
from ..runner import unit_rows


def _guide_mask(gq: Tensor, gk: Tensor, threshold: Tensor, diagonal: Optional[bool]) -> Callable[[Tile], Tensor]:
    """The tile mask of candidates whose guide similarity exceeds the row's threshold;
    column ``i`` of row ``i`` (``i + offset``: this process's first row in the global
    batch) is ``diagonal``: kept (False: the row's positive), masked (True: the row
    itself, an anchor among the anchors or a positive among the positives, never its
    own negative) or left to the guide (None: the negatives)."""

    def mask(tile: Tile) -> Tensor:
        out = (gq[tile.r0 : tile.r1] @ gk[tile.c0 : tile.c1].T) > threshold[tile.r0 : tile.r1].unsqueeze(1)
        if diagonal is not None:
            tile.self_diagonal(out).fill_(diagonal)
        return out

    return mask


@shared_docs
@compiles()
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
    process_group: Any = None,
    strategy: str = "all_gather",
    grad_scale: str = "ddp",
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

    the candidates being ``p_j`` (``p_i`` always kept), ``a_j`` (``contrast_anchors``;
    never ``a_i`` itself), ``n_j`` (``negative``), and from the positive's side
    ``s(p_i, p_j)`` (``contrast_positives``; never ``p_i`` itself), each kept when its
    guide similarity is ``<= t_i``. This is sentence-transformers' ``GISTEmbedLoss``
    (>= 6.3, which never counts a text as its own negative; 6.2 kept it when a
    negative margin let it pass the guide's threshold) on embeddings, without the
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
        @process_group@

    Shape:
        - anchor, positive: (B, D); negative: (K, D); guide: (B, G), (B, G)[, (K, G)]
        - output: scalar, or (B,) with ``reduction="none"``

    Examples::

        >>> a, p, n = torch.randn(4, 16), torch.randn(4, 16), torch.randn(4, 16)
        >>> ga, gp, gn = torch.randn(4, 8), torch.randn(4, 8), torch.randn(4, 8)
        >>> loss = flashcl.gist_loss(a, p, guide=(ga, gp), temperature=0.05)
        >>> loss = flashcl.gist_loss(a, p, n, guide=(ga, gp, gn), margin=0.1, margin_strategy="relative")
    """
    anchor, positive = checks.validate_pair(anchor, positive, "anchor", "positive", process_group is not None)
    if negative is not None:
        negative = check_keys(negative, "negative", anchor, process_group is not None)
    for flag, flag_name in ((contrast_anchors, "contrast_anchors"), (contrast_positives, "contrast_positives")):
        checks.check_bool(flag, flag_name)
    checks.check_choice(margin_strategy, "margin_strategy", ("absolute", "relative"))
    opts = checks.Options(True, reduction, backend, block_size, process_group, strategy, grad_scale)
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or margin != margin:
        raise ValueError(f"margin must be a float, got {margin!r}")
    if not isinstance(guide, (tuple, list)) or len(guide) != (2 if negative is None else 3):
        raise ValueError(
            "guide must hold the guide model's embeddings of each input: (anchor, positive)"
            + ("" if negative is None else ", negative")
            + f"; got {type(guide).__name__}"
            + (f" of {len(guide)}" if isinstance(guide, (tuple, list)) else "")
        )
    names = ("guide[0] (anchor)", "guide[1] (positive)", "guide[2] (negative)")
    guides = [
        checks.check_float_tensor(g, names[t], (2,), process_group is not None).detach() for t, g in enumerate(guide)
    ]
    for t, (g, x) in enumerate(zip(guides, (anchor, positive, negative))):
        assert x is not None
        if g.shape[0] != x.shape[0] or g.shape[1] != guides[0].shape[1]:
            raise ValueError(
                f"{names[t]} must have shape ({x.shape[0]}, {guides[0].shape[1]}) (one row per input "
                f"row, the guide's width), got {tuple(g.shape)}"
            )
        checks.same_device(g, anchor, names[t], "anchor")
    scale = 1.0 / checks.check_positive_scalar(temperature, "temperature", anchor.device, scale_dtype(anchor))
    return _gist(
        anchor,
        positive,
        negative,
        guides,
        scale,
        float(margin),
        margin_strategy == "relative",
        contrast_anchors,
        contrast_positives,
        opts,
    )


def _gist(
    anchor: Tensor,
    positive: Tensor,
    negative: Optional[Tensor],
    guides: List[Tensor],
    scale: Tensor,
    margin: float,
    relative: bool,
    contrast_anchors: bool,
    contrast_positives: bool,
    opts: checks.Options,
) -> Tensor:
    """:func:`gist_loss`'s body, one process being a world of one: each rank's anchors
    against every rank's candidates of each set (:mod:`flashcl.distributed`; the
    guide's embeddings, without gradient, gathered with them)."""
    group = opts.process_group
    positives = parallel.columns(positive, opts.strategy, group)
    b = anchor.shape[0]
    k = 0 if negative is None else negative.shape[0]
    entries = b * (positives.total * (1 + int(contrast_anchors) + int(contrast_positives)) + k)

    def formula() -> Tensor:
        every = None
        if group is not None:  # the oracle on every rank's candidates
            sets = [parallel.columns(x, "all_gather", group) for x in (anchor, positive)]
            if negative is not None:
                sets.append(parallel.columns(negative, "all_gather", group))
            cands: List[Optional[Tensor]] = [c.keys for c in sets] + [None] * (3 - len(sets))
            g_cands: List[Optional[Tensor]] = [c.gather(g) for c, g in zip(sets, guides)]
            every = (cands, g_cands + [None] * (3 - len(g_cands)), sets[1].offset)
        return reference.gist_rows(
            anchor, positive, negative, guides, scale, margin, relative, contrast_anchors, contrast_positives, every
        )

    def engine() -> Tensor:
        return gist_rows(
            anchor,
            positive,
            negative,
            guides,
            scale,
            margin,
            relative,
            contrast_anchors,
            contrast_positives,
            name,
            opts.block_size,
            # one process: each part against its keys directly (through a Source it measured
            # 15-25% slower at B = 2048, D = 128)
            None
            if group is None
            else lambda keys: positives if keys is positive else parallel.columns(keys, opts.strategy, group),
        )

    # the guide's masks have no Triton kernel
    impls = {"reference": formula, "dense": engine, "tiled": engine}
    name = backends.pick_name(opts.backend, tuple(impls), entries, anchor, "gist_loss", source=positives)
    rows_of = impls[name]
    with autocast_off(anchor.device.type):
        rows = rows_of()
    return runner.reduce(rows, torch.ones_like(rows), opts.reduction, opts.grad_scale, positives)


class Gathered(NamedTuple):
    """Candidates gathered by the caller for :func:`gist_rows`: every process's
    positives (with their gradient) and negatives, the guide's embeddings of both,
    and this process's first row among them."""

    positive: Tensor
    negative: Optional[Tensor]
    guide_positive: Tensor
    guide_negative: Optional[Tensor]
    offset: int


def gist_rows(
    anchor: Tensor,
    positive: Tensor,
    negative: Optional[Tensor],
    guides: List[Tensor],
    scale: Tensor,
    margin: float,
    relative: bool,
    contrast_anchors: bool,
    contrast_positives: bool,
    backend: str,
    block_size: Optional[int],
    across: Optional[Callable[[Tensor], Source]] = None,
    gathered: Optional[Gathered] = None,
) -> Tensor:
    """GIST's per-anchor losses on ``backend`` (``"dense"`` or ``"tiled"``; ``"auto"``
    chooses on the anchors and the candidates given), each a logsumexp over tiles per
    candidate set; with ``across`` (``keys -> their global columns``), the
    candidates are the global batch's (across processes; the guide's embeddings,
    without gradient, gathered). With ``gathered``, the positive and negative
    candidates (and their guides) are those rows, gathered by the caller, and the
    anchors are this process's only (sentence-transformers' ``gather_across_devices``)."""
    p_all, n_all, offset = positive, negative, 0
    if gathered is not None:
        p_all, n_all, offset = gathered.positive, gathered.negative, gathered.offset
    if backend == "auto":  # :func:`gist_loss` chose on the global batch; a caller's gathered candidates here
        b = anchor.shape[0]
        cands = p_all.shape[0] * (1 + int(contrast_positives)) + b * int(contrast_anchors)
        entries = b * (cands + (0 if n_all is None else n_all.shape[0]))
        backend = backends.pick_name(backend, ("dense", "tiled"), entries, anchor, "gist_rows", kernel=None)
    ga, gp = unit_rows(guides[0], True), unit_rows(guides[1], True)
    gn = None if negative is None else unit_rows(guides[2], True)
    g_pos = (ga * gp).sum(1)
    threshold = g_pos - (g_pos.abs() * margin if relative else margin)
    dtype = compute_dtype(anchor.dtype)

    def part(q: Tensor, keys: Tensor, gq: Tensor, gk: Tensor, diagonal: Optional[bool], offset: int = 0) -> Tensor:
        cols = backends.Source(keys, offset, [keys.shape[0]]) if across is None else across(keys)
        mask = _guide_mask(gq, cols.gather(gk), threshold, diagonal)
        return runner.row_lse(q, cols, scale, True, backend, block_size, Exclusions(fn=mask))

    gp_all, gn_all = gp, gn
    if gathered is not None:
        gp_all = unit_rows(gathered.guide_positive, True)
        gn_all = None if gathered.guide_negative is None else unit_rows(gathered.guide_negative, True)
    lse = part(anchor, p_all, ga, gp_all, False, offset)  # the positive kept
    if contrast_anchors:  # never the anchor itself
        lse = torch.logaddexp(lse, part(anchor, anchor, ga, ga, True))
    if contrast_positives:  # never the positive itself
        lse = torch.logaddexp(lse, part(positive, p_all, gp, gp_all, True, offset))
    if n_all is not None:
        assert gn_all is not None
        lse = torch.logaddexp(lse, part(anchor, n_all, ga, gn_all, None))
    pos = (unit_rows(anchor, True) * unit_rows(positive, True)).sum(1)
    return lse - scale.to(dtype) * pos


class GistLoss(LossModule):
    """Module form of :func:`gist_loss`: the model's embeddings and the guide's are
    given to the call.

    Examples::

        >>> a, p, ga, gp = torch.randn(4, 16), torch.randn(4, 16), torch.randn(4, 8), torch.randn(4, 8)
        >>> loss = flashcl.GistLoss(temperature=0.05)(a, p, guide=(ga, gp))
    """

    def __init__(
        self,
        temperature: Scalar = 0.01,
        margin: float = 0.0,
        margin_strategy: str = "absolute",
        contrast_anchors: bool = True,
        contrast_positives: bool = True,
        reduction: str = "mean",
        backend: str = "auto",
        block_size: Optional[int] = None,
        process_group: Any = None,
        strategy: str = "all_gather",
        grad_scale: str = "ddp",
    ) -> None:
        super().__init__(**self.given(locals()))

    def forward(
        self, anchor: Tensor, positive: Tensor, negative: Optional[Tensor] = None, *, guide: Tuple[Tensor, ...]
    ) -> Tensor:
        return gist_loss(anchor, positive, negative, guide=guide, **self.loss_options())


def _example_gist(g: torch.Generator) -> Example:
    return Example(
        (example_rows(g, 19, 24), example_rows(g, 19, 24)),
        {"guide": (example_rows(g, 19, 8), example_rows(g, 19, 8)), "temperature": 0.05},
    )


#: ``flashcl check``'s call of each loss of this module (:class:`flashcl.checks.Example`)
EXAMPLES = {
    "gist_loss": _example_gist,
}
