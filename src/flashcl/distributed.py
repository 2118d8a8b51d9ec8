"""The same exact losses over a batch spread across processes (``torch.distributed``).

Each rank passes its local batch; the loss is the loss over the global batch
(the ranks' batches concatenated in rank order), with positives and negatives
from every rank. Strategy ``"all_gather"``: the candidates are gathered with an
autograd-aware collective (uneven batch sizes allowed), then the tiled core runs
local anchor rows against the global candidate columns, so no rank ever holds
the global score matrix, only the global embeddings. Strategy ``"ring"``: each
rank keeps its own candidates and the blocks travel round the ranks (as Inf-CL
does), so that a rank holds its block and one visiting block. Keys without
gradient that every rank holds alike (a :class:`flashcl.MemoryBank`'s queue)
join rank 0's block and enter the global loss once.

Every loss takes it through its ``process_group=`` argument
(``flashcl.supcon_loss(..., process_group=group)``); the functions of this module
with the losses' names are that call with ``group`` (default: the world).

Gradient convention (``grad_scale``):

* ``"ddp"`` (default): each rank returns ``world_size x`` its share of the global
  loss (for ``reduction="mean"``: its anchors' terms over the global number of
  anchors). The mean of the returned values over ranks is the global loss, and
  DistributedDataParallel's gradient averaging (sum over ranks / world_size)
  then gives exactly the single-process gradient of the global loss, for the
  model and for a learnable temperature alike. The embeddings' gradient on each
  rank is ``world_size x`` the single-process gradient's rows of that rank.
* ``"sum"``: each rank returns its share; the sum over ranks is the global loss
  and each rank's embeddings' gradient equals the single-process gradient's
  rows of that rank. A replicated learnable temperature then needs its
  gradient summed over ranks (``all_reduce``), not averaged.

Every call first checks, with one small collective, that all ranks called the
same loss with the same options, embedding dim and dtype; a mismatch raises a
``ValueError`` on every rank instead of hanging in a later collective. The
collectives use the process group's timeout (``init_process_group(timeout=...)``).
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional

import torch.distributed as dist
from torch import Tensor

from . import registry
from .parallel import collectives
from .parallel.collectives import *  # noqa: F403  (the collectives, for losses composed by hand)

#: the collectives, and the alias of every registered loss that takes process_group
#: (flashcl.registry)
__all__ = list(collectives.__all__)


#: stands for the world before any process group exists: the losses check their
#: options first, then raise the error that names the missing group
_NO_GROUP_YET = object()


def world_group(group: Any) -> Any:
    """``group``, or the world for None."""
    if group is not None:
        return group
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else _NO_GROUP_YET


def _alias(name: str) -> Callable[..., Tensor]:
    def loss(*args: Any, group: Any = None, **options: Any) -> Tensor:
        return registry.functions()[name](*args, process_group=world_group(group), **options)

    loss.__name__ = loss.__qualname__ = name
    loss.__doc__ = f""":func:`flashcl.{name}` over the global batch: ``flashcl.{name}(..., process_group=group)``
    with the world for ``group=None``; every option of :func:`flashcl.{name}` (see its
    ``process_group``, ``strategy`` and ``grad_scale``, and this module's docstring).

    Args:
        group: the process group (default: the world).
        other arguments: as :func:`flashcl.{name}`.

    Examples::

        >>> # in each process of an initialised group (not run here):
        >>> loss = flashcl.distributed.{name}(...)  # doctest: +SKIP
    """
    return loss


def _alias_of(name: str, fn: Callable[..., Tensor]) -> Optional[Callable[..., Tensor]]:
    return _alias(name) if registry.takes_process_group(fn) else None


registry.publish(sys.modules[__name__], ("function",), _alias_of)


def __getattr__(name: str) -> Callable[..., Tensor]:
    """The alias of a registered loss that takes ``process_group`` (typed for static
    checkers; normally set by :func:`flashcl.registry.publish`)."""
    fn = registry.functions().get(name)
    if fn is None or not registry.takes_process_group(fn):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return _alias(name)
