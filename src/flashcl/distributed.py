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
(``flashcl.supcon_loss(..., process_group=dist.group.WORLD)``, or a group of some of
the ranks); this module holds the collectives the losses use, for losses composed
by hand.

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

from .parallel import collectives
from .parallel.collectives import *  # noqa: F403  (the collectives, for losses composed by hand)

__all__ = list(collectives.__all__)
