"""What every loss Module shares: :class:`LossModule` stores a loss's options and
passes them to its function; the guards that turn a peer library's call into an
error that names the drop-in to use."""
from __future__ import annotations

from typing import Any, Dict

from torch import nn

__all__ = ["LossModule", "reject_pml_call", "reject_open_clip_keywords"]

PML_ADAPTERS = "flashcl.integrations.pytorch_metric_learning"
OPEN_CLIP_KEYWORDS = ("local_loss", "gather_with_grad", "cache_labels", "rank", "world_size", "use_horovod",
                      "dist_impl")


class LossModule(nn.Module):
    """Base of the loss Modules (as torch.nn's ``_Loss``): the keyword options of the
    loss's function, stored as attributes (change them between calls as on any
    Module) and given back by :meth:`loss_options` for each call. A learnable
    temperature or logit scale stays the caller's: pass it to the call, or pass a
    tensor at construction (kept as given; an ``nn.Parameter`` is registered)."""

    def __init__(self, **options: Any) -> None:
        super().__init__()
        self._option_names = tuple(options)
        for name, value in options.items():
            setattr(self, name, value)

    def loss_options(self) -> Dict[str, Any]:
        """The stored options, as the function's keyword arguments."""
        return {name: getattr(self, name) for name in self._option_names}

    def extra_repr(self) -> str:
        return ", ".join(f"{name}={getattr(self, name)!r}" for name in self._option_names)


def reject_pml_call(name: str, extra: Dict[str, Any]) -> None:
    """A pytorch-metric-learning-style call (``indices_tuple``, ``ref_emb``) to a flashcl module."""
    if extra:
        raise TypeError(f"flashcl.{name} got {', '.join(sorted(extra))}: pytorch-metric-learning's call "
                        f"loss(embeddings, labels, indices_tuple=None, ref_emb=None, ref_labels=None) is taken by "
                        f"{PML_ADAPTERS}.{name}, a drop-in subclass of PML's class")


def reject_open_clip_keywords(name: str, extra: Dict[str, Any]) -> None:
    """open_clip's constructor keywords given to a flashcl module."""
    if not extra:
        return
    known = [k for k in extra if k in OPEN_CLIP_KEYWORDS]
    if known:
        fn = "clip_loss" if name == "ClipLoss" else "siglip_loss"
        raise TypeError(f"flashcl.{name} got open_clip's constructor keywords {', '.join(sorted(known))}: "
                        f"flashcl.{name} computes one process's batch; across processes, "
                        f"flashcl.distributed.{fn} computes the exact loss over every rank's batch (what "
                        "open_clip's gather_with_grad=True, local_loss=False computes), with no B x B logits")
    raise TypeError(f"flashcl.{name}() got unexpected keyword arguments {', '.join(sorted(extra))}")
