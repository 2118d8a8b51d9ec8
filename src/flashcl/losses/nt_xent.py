"""NT-Xent (SimCLR, unsupervised SimCSE) and its estimators: :func:`nt_xent_loss` and
:class:`NTXentLoss`."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from .. import backends, checks, parallel, reference, runner
from ..base import PML_ADAPTERS, LossModule, reject_pml_call, shared_docs
from ..checks import Example, Scalar, example_rows
from ..compiled import compiles
from ..core import CoreSpec, Exclusions, compute_dtype
from ..engine.engine import Problem, autocast_off
from ..runner import unit_rows
from .family_heads import DebiasedHead


@shared_docs
@compiles(rows=lambda z1: (2 * z1.shape[0],))
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
    process_group: Any = None,
    strategy: str = "all_gather",
    grad_scale: str = "ddp",
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
        @process_group@
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
    z1, z2 = checks.validate_pair(z1, z2, "z1", "z2", process_group is not None)
    opts = checks.Options(normalize, reduction, backend, block_size, process_group, strategy, grad_scale)
    checks.check_choice(estimator, "estimator", ("standard", "debiased", "hard"))
    checks.check_bool(decoupled, "decoupled")
    if weighting is not None:
        checks.check_choice(weighting, "weighting", ("vmf",))
        if not decoupled:
            raise ValueError("weighting='vmf' weighs the positive of the decoupled loss: pass decoupled=True")
    for value, name, low, high in (
        (tau_plus, "tau_plus", 0.0, 1.0),
        (beta, "beta", 0.0, float("inf")),
        (sigma, "sigma", 0.0, float("inf")),
    ):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (low <= value < high):
            raise ValueError(f"{name} must be a float in [{low}, {high}), got {value!r}")
    if sigma <= 0:
        raise ValueError(f"sigma must be > 0, got {sigma!r}")
    if estimator != "standard" and decoupled:
        raise ValueError(
            "the debiased and hard estimators reweigh the negatives of the standard denominator: "
            "use them with decoupled=False"
        )
    scale = 1.0 / checks.check_positive_scalar(temperature, "temperature", z1.device, compute_dtype(z1.dtype))
    return _nt_xent(z1, z2, scale, opts, decoupled, weighting, float(sigma), estimator, float(tau_plus), float(beta))


def _nt_xent(
    z1: Tensor,
    z2: Tensor,
    scale: Tensor,
    opts: checks.Options,
    decoupled: bool,
    weighting: Optional[str],
    sigma: float,
    estimator: str,
    tau_plus: float,
    beta: float,
) -> Tensor:
    """:func:`nt_xent_loss`'s body, one process being a world of one: each rank's rows
    ``[z1; z2]`` against every rank's (:mod:`flashcl.distributed`); the negatives are
    counted (and, with ``weighting="vmf"``, the pairs weighed) over the global batch."""
    n = z1.shape[0]
    z = torch.cat([z1, z2])
    standard = estimator == "standard"
    # the estimators score the rows against every view as a second tensor, not the symmetric path
    cols = parallel.columns(z, opts.strategy, opts.process_group, own=standard)
    if cols.total < 4 and decoupled:
        raise ValueError(
            "decoupled=True needs at least 2 pairs (across processes: in the global batch): with one pair the "
            "denominator without the positive is empty (the loss would be -inf)"
        )
    if cols.total < 4 and not standard:
        raise ValueError(
            "the debiased and hard estimators need at least 2 pairs (2 negatives per anchor; across processes: "
            "in the global batch)"
        )
    partner = (torch.arange(2 * n, device=z.device) + n) % (2 * n) + cols.offset
    dtype = compute_dtype(z.dtype)
    if not standard:
        beta_ = 0.0 if estimator == "debiased" else beta

        def formula() -> Tensor:
            with autocast_off(z.device.type):
                rows = reference.nt_xent_estimator(
                    z, partner, scale, tau_plus, beta_, opts.normalize, cols.keys, cols.offset
                )
            return runner.reduce(rows, torch.ones_like(rows), opts.reduction, opts.grad_scale, cols)

        def engine() -> Tensor:
            head = DebiasedHead(partner, tau_plus, beta_, cols.total - 2, float(scale.detach()), offset=cols.offset)
            r = runner.share(opts.reduction, opts.grad_scale, cols, torch.ones(2 * n, dtype=dtype, device=z.device))
            weights = None if r is None else (r, None)
            problem = Problem(head, (), opts.normalize, cols.offset)
            return cols.run(z, scale, problem, weights, opts.block_size, backend=name)[0]

        impls = {"reference": formula, "dense": engine, "tiled": engine, "triton": engine}
        entries = z.shape[0] * cols.total
        name = backends.pick_name(
            opts.backend, tuple(impls), entries, z, f"nt_xent_loss(estimator={estimator!r})", source=cols, kernel=None
        )
        return impls[name]()
    index = partner.unsqueeze(1)
    weight: Optional[Tensor] = None
    exclude: Optional[Exclusions] = None
    if decoupled:
        exclude = Exclusions(index=index)
        if weighting == "vmf":  # the positives' weights from a softmax over every rank's pairs
            with torch.no_grad():
                sim = (unit_rows(z1.detach(), True) * unit_rows(z2.detach(), True)).sum(1) / sigma
                every = cols.rows_of_every_rank(sim)
                w = 2.0 - every.shape[0] * torch.exp(sim - torch.logsumexp(every, dim=0))
            weight = torch.cat([w, w]).to(dtype)
    spec = CoreSpec(
        exclude_self=True,
        self_pairs=True,
        offset=cols.offset,
        index=index,
        pos_mode="sum",
        normalize=opts.normalize,
        exclude=exclude,
        positive_weight=weight,
    )
    return runner.run(z, cols, scale, spec, opts)


class NTXentLoss(LossModule):
    """Module form of :func:`nt_xent_loss`.

    Examples::

        >>> loss = flashcl.NTXentLoss(temperature=0.5)(torch.randn(4, 16), torch.randn(4, 16))
    """

    def __init__(
        self,
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
        process_group: Any = None,
        strategy: str = "all_gather",
        grad_scale: str = "ddp",
    ) -> None:
        super().__init__(**self.given(locals()))

    def forward(self, z1: Tensor, z2: Tensor, **pml: Any) -> Tensor:
        reject_pml_call("NTXentLoss", pml)
        if isinstance(z2, Tensor) and z2.dim() == 1 and not z2.is_floating_point():
            raise TypeError(
                "flashcl.NTXentLoss takes two views (z1, z2) of the same samples, got labels as the "
                f"second argument: pytorch-metric-learning's NTXentLoss(embeddings, labels) is "
                f"{PML_ADAPTERS}.NTXentLoss"
            )
        return nt_xent_loss(z1, z2, **self.loss_options())


def _example_nt_xent(g: torch.Generator) -> Example:
    return Example((example_rows(g, 29, 24), example_rows(g, 29, 24)), {"temperature": 0.2})


#: ``flashcl check``'s call of each loss of this module (:class:`flashcl.checks.Example`)
EXAMPLES = {
    "nt_xent_loss": _example_nt_xent,
}
