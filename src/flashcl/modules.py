"""``nn.Module`` wrappers: each stores its configuration and calls the function.

A learnable temperature or logit scale stays the caller's: pass it to the
module's call, or pass a tensor at construction (it is kept as given).
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Union

from torch import Tensor, nn

from . import functional as F

Scalar = Union[float, Tensor]

_PML = "flashcl.integrations.pytorch_metric_learning"
_OPEN_CLIP_KEYWORDS = ("local_loss", "gather_with_grad", "cache_labels", "rank", "world_size", "use_horovod",
                       "dist_impl")


def _pml_call(name: str, extra: Dict[str, Any]) -> None:
    """A pytorch-metric-learning-style call (``indices_tuple``, ``ref_emb``) to a flashcl module."""
    if extra:
        raise TypeError(f"flashcl.{name} got {', '.join(sorted(extra))}: pytorch-metric-learning's call "
                        f"loss(embeddings, labels, indices_tuple=None, ref_emb=None, ref_labels=None) is taken by "
                        f"{_PML}.{name}, a drop-in subclass of PML's class")


def _open_clip_constructor(name: str, extra: Dict[str, Any]) -> None:
    """open_clip's constructor keywords given to a flashcl module."""
    if not extra:
        return
    known = [k for k in extra if k in _OPEN_CLIP_KEYWORDS]
    if known:
        fn = "clip_loss" if name == "ClipLoss" else "siglip_loss"
        raise TypeError(f"flashcl.{name} got open_clip's constructor keywords {', '.join(sorted(known))}: "
                        f"flashcl.{name} computes one process's batch; across processes, "
                        f"flashcl.distributed.{fn} computes the exact loss over every rank's batch (what "
                        "open_clip's gather_with_grad=True, local_loss=False computes), with no B x B logits")
    raise TypeError(f"flashcl.{name}() got unexpected keyword arguments {', '.join(sorted(extra))}")


class SupConLoss(nn.Module):
    """Module form of :func:`flashcl.supcon_loss`; see it for the math and arguments.

    Examples::

        >>> loss_fn = flashcl.SupConLoss(temperature=0.1)
        >>> loss = loss_fn(torch.randn(8, 16), torch.randint(0, 3, (8,)))
    """

    def __init__(self, temperature: Scalar = 0.1, positives: str = "mean", include_self: bool = False,
                 normalize: bool = True, reduction: str = "mean", backend: str = "auto",
                 block_size: Optional[int] = None, matryoshka_dims: Optional[Sequence[int]] = None,
                 matryoshka_weights: Optional[Sequence[float]] = None) -> None:
        super().__init__()
        self.temperature, self.positives, self.include_self = temperature, positives, include_self
        self.normalize, self.reduction, self.backend, self.block_size = normalize, reduction, backend, block_size
        self.matryoshka_dims, self.matryoshka_weights = matryoshka_dims, matryoshka_weights

    def forward(self, embeddings: Tensor, labels: Tensor, ref: Optional[Tensor] = None,
                ref_labels: Optional[Tensor] = None, ref_self: Optional[Tensor] = None, **pml: Any) -> Tensor:
        if isinstance(ref, tuple):  # PML's third positional argument: a miner's indices_tuple
            pml["indices_tuple"] = ref
        _pml_call("SupConLoss", pml)
        return F.supcon_loss(embeddings, labels, temperature=self.temperature, positives=self.positives,
                             include_self=self.include_self, normalize=self.normalize,
                             reduction=self.reduction, backend=self.backend, block_size=self.block_size,
                             ref=ref, ref_labels=ref_labels, ref_self=ref_self,
                             matryoshka_dims=self.matryoshka_dims, matryoshka_weights=self.matryoshka_weights)


class NTXentLoss(nn.Module):
    """Module form of :func:`flashcl.nt_xent_loss`.

    Examples::

        >>> loss = flashcl.NTXentLoss(temperature=0.5)(torch.randn(4, 16), torch.randn(4, 16))
    """

    def __init__(self, temperature: Scalar = 0.07, normalize: bool = True, reduction: str = "mean",
                 backend: str = "auto", block_size: Optional[int] = None, estimator: str = "standard",
                 tau_plus: float = 0.1, beta: float = 1.0, decoupled: bool = False, weighting: Optional[str] = None,
                 sigma: float = 0.5) -> None:
        super().__init__()
        self.temperature, self.normalize, self.reduction = temperature, normalize, reduction
        self.backend, self.block_size = backend, block_size
        self.estimator, self.tau_plus, self.beta = estimator, tau_plus, beta
        self.decoupled, self.weighting, self.sigma = decoupled, weighting, sigma

    def forward(self, z1: Tensor, z2: Tensor, **pml: Any) -> Tensor:
        _pml_call("NTXentLoss", pml)
        if isinstance(z2, Tensor) and z2.dim() == 1 and not z2.is_floating_point():
            raise TypeError("flashcl.NTXentLoss takes two views (z1, z2) of the same samples, got labels as the "
                            f"second argument: pytorch-metric-learning's NTXentLoss(embeddings, labels) is "
                            f"{_PML}.NTXentLoss")
        return F.nt_xent_loss(z1, z2, temperature=self.temperature, normalize=self.normalize,
                              reduction=self.reduction, backend=self.backend, block_size=self.block_size,
                              estimator=self.estimator, tau_plus=self.tau_plus, beta=self.beta,
                              decoupled=self.decoupled, weighting=self.weighting, sigma=self.sigma)


class InfoNCELoss(nn.Module):
    """Module form of :func:`flashcl.info_nce_loss`.

    Examples::

        >>> loss = flashcl.InfoNCELoss(temperature=0.05)(torch.randn(4, 16), torch.randn(6, 16))
    """

    def __init__(self, temperature: Scalar = 0.05, normalize: bool = True, reduction: str = "mean",
                 backend: str = "auto", block_size: Optional[int] = None, in_batch_negatives: bool = True,
                 duplicates: str = "mask", matryoshka_dims: Optional[Sequence[int]] = None,
                 matryoshka_weights: Optional[Sequence[float]] = None) -> None:
        super().__init__()
        self.temperature, self.normalize, self.reduction = temperature, normalize, reduction
        self.backend, self.block_size = backend, block_size
        self.in_batch_negatives, self.duplicates = in_batch_negatives, duplicates
        self.matryoshka_dims, self.matryoshka_weights = matryoshka_dims, matryoshka_weights

    def forward(self, query: Tensor, keys: Tensor, positive_index: Optional[Tensor] = None,
                negatives: Optional[Tensor] = None, query_labels: Optional[Tensor] = None,
                key_labels: Optional[Tensor] = None) -> Tensor:
        return F.info_nce_loss(query, keys, positive_index, temperature=self.temperature,
                               normalize=self.normalize, reduction=self.reduction, backend=self.backend,
                               block_size=self.block_size, negatives=negatives,
                               in_batch_negatives=self.in_batch_negatives, query_labels=query_labels,
                               key_labels=key_labels, duplicates=self.duplicates,
                               matryoshka_dims=self.matryoshka_dims, matryoshka_weights=self.matryoshka_weights)


class ClipLoss(nn.Module):
    """Module form of :func:`flashcl.clip_loss`; called as open_clip's ``ClipLoss`` is:
    ``loss_fn(image_features, text_features, logit_scale, logit_bias=None, output_dict=False)``
    (plus ``labels=`` for several positives per image).

    Examples::

        >>> loss = flashcl.ClipLoss()(torch.randn(4, 16), torch.randn(4, 16), 100.0)
    """

    def __init__(self, normalize: bool = True, reduction: str = "mean", backend: str = "auto",
                 block_size: Optional[int] = None, matryoshka_dims: Optional[Sequence[int]] = None,
                 matryoshka_weights: Optional[Sequence[float]] = None, **open_clip: Any) -> None:
        _open_clip_constructor("ClipLoss", open_clip)
        super().__init__()
        self.normalize, self.reduction, self.backend, self.block_size = normalize, reduction, backend, block_size
        self.matryoshka_dims, self.matryoshka_weights = matryoshka_dims, matryoshka_weights

    def forward(self, image_features: Tensor, text_features: Tensor, logit_scale: Scalar,
                logit_bias: Optional[Scalar] = None, output_dict: bool = False,
                labels: Optional[Tensor] = None) -> Union[Tensor, Dict[str, Tensor]]:
        loss = F.clip_loss(image_features, text_features, logit_scale, logit_bias, labels=labels,
                           normalize=self.normalize, reduction=self.reduction, backend=self.backend,
                           block_size=self.block_size, matryoshka_dims=self.matryoshka_dims,
                           matryoshka_weights=self.matryoshka_weights)
        return {"contrastive_loss": loss} if output_dict else loss


class SigLipLoss(nn.Module):
    """Module form of :func:`flashcl.siglip_loss`; called as open_clip's ``SigLipLoss``
    is: ``loss_fn(image_features, text_features, logit_scale, logit_bias)``
    (``output_dict=True`` returns ``{"contrastive_loss": loss}``, as open_clip).
    Across processes: :func:`flashcl.distributed.siglip_loss`.

    Examples::

        >>> loss = flashcl.SigLipLoss()(torch.randn(4, 16), torch.randn(4, 16), 10.0, -10.0)
    """

    def __init__(self, normalize: bool = False, reduction: str = "mean", backend: str = "auto",
                 block_size: Optional[int] = None, **open_clip: Any) -> None:
        _open_clip_constructor("SigLipLoss", open_clip)
        super().__init__()
        self.normalize, self.reduction, self.backend, self.block_size = normalize, reduction, backend, block_size

    def forward(self, image_features: Tensor, text_features: Tensor, logit_scale: Scalar, logit_bias: Scalar,
                labels: Optional[Tensor] = None, output_dict: bool = False) -> Union[Tensor, Dict[str, Tensor]]:
        loss = F.siglip_loss(image_features, text_features, logit_scale, logit_bias, labels=labels,
                             normalize=self.normalize, reduction=self.reduction, backend=self.backend,
                             block_size=self.block_size)
        return {"contrastive_loss": loss} if output_dict else loss


class NeighborLoss(nn.Module):
    """Module form of :func:`flashcl.neighbor_loss`.

    Examples::

        >>> scores = torch.randn(10, 10)
        >>> loss = flashcl.NeighborLoss()(scores, flashcl.sample_neighbors(10, 2))
    """

    def __init__(self, exclude_diagonal: bool = True, reduction: str = "sum", backend: str = "auto",
                 block_size: Optional[int] = None) -> None:
        super().__init__()
        self.exclude_diagonal, self.reduction, self.backend, self.block_size = (
            exclude_diagonal, reduction, backend, block_size)

    def forward(self, scores: Tensor, neighbors: Tensor) -> Tensor:
        return F.neighbor_loss(scores, neighbors, exclude_diagonal=self.exclude_diagonal,
                               reduction=self.reduction, backend=self.backend, block_size=self.block_size)
