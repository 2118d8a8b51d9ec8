"""``MemoryBank``: a fixed-size FIFO queue of embeddings (and labels) without gradient,
the keys of queue-based losses (MoCo's negatives, cross-batch memory).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .. import checks

__all__ = ["MemoryBank"]


class MemoryBank(nn.Module):
    """A FIFO of the last ``size`` embeddings pushed (and their labels), detached.

    Entries are overwritten oldest first, in the order pushed, as pytorch-metric-
    learning's ``CrossBatchMemory`` does; ``state_dict`` holds the entries, their
    labels and the queue's position, so that a bank restored from a checkpoint
    holds the same keys in the same order; the losses treat the keys as a set, so
    their order in the buffer does not matter. In an initialised process group,
    :meth:`push` enqueues the global batch (every rank's rows, in rank order,
    uneven batches allowed), so that every rank holds the same queue.

    Args:
        size: the number of entries kept.
        dim: the embedding width.
        labels: keep a class id per entry (True, the default), a multi-hot label
            set of ``labels`` classes per entry (an int C >= 2: multi-label SupCon's
            queue), or none (False).
        dtype, device: of the buffers (default float32, CPU; ``.to()`` moves them).
        group: the process group whose batches are enqueued (default: the world,
            when one is initialised; else this process alone).

    Shape:
        - push: embeddings (B, dim), labels (B,) (or (B, C) multi-hot); returns (B,)
          int64 slots of this process's rows
        - keys(): (min(pushed, size), dim) embeddings and (min(pushed, size),) labels
          (or (min(pushed, size), C) bool)

    Examples::

        >>> bank = flashcl.MemoryBank(size=8, dim=4)
        >>> emb, labels = torch.randn(3, 4, requires_grad=True), torch.tensor([0, 1, 0])
        >>> slots = bank.push(emb, labels)   # the queue now holds this batch too
        >>> keys, key_labels = bank.keys()
        >>> loss = flashcl.supcon_loss(emb, labels, ref=keys, ref_labels=key_labels, ref_self=slots)
        >>> loss.backward()
    """

    embeddings: Tensor
    labels: Optional[Tensor]

    def __init__(
        self,
        size: int,
        dim: int,
        labels: Union[bool, int] = True,
        dtype: torch.dtype = torch.float32,
        device: Optional[torch.device] = None,
        group: Any = None,
    ) -> None:
        super().__init__()
        for value, name in ((size, "size"), (dim, "dim")):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(labels, bool) and not (isinstance(labels, int) and labels >= 2):
            raise ValueError(f"labels must be True, False or a number of classes >= 2 (multi-hot sets), got {labels!r}")
        self.size, self.dim, self.group = size, dim, group
        #: classes of the multi-hot label sets, or None (class ids, or no labels)
        self.classes = None if isinstance(labels, bool) else labels
        self.register_buffer("embeddings", torch.zeros(size, dim, dtype=dtype, device=device))
        if self.classes is not None:
            self.register_buffer("labels", torch.zeros(size, self.classes, dtype=torch.bool, device=device))
        else:
            self.register_buffer("labels", torch.zeros(size, dtype=torch.int64, device=device) if labels else None)
        self.position = 0  # the next slot to write
        self.count = 0  # entries filled so far (<= size)
        self._lent = False  # keys() handed out views of the buffers since the last push

    def get_extra_state(self) -> Dict[str, int]:
        """The queue's position and fill count, saved in ``state_dict`` with the buffers."""
        return {"position": self.position, "count": self.count}

    def set_extra_state(self, state: Dict[str, int]) -> None:
        position, count = int(state["position"]), int(state["count"])
        if not (0 <= position < self.size and 0 <= count <= self.size):
            raise ValueError(
                f"a MemoryBank state with position {position} and count {count} does not fit a bank of size {self.size}"
            )
        self.position, self.count = position, count
        self._lent = False

    def _global(self, embeddings: Tensor, labels: Optional[Tensor]) -> Tuple[Tensor, Optional[Tensor], int]:
        """(every rank's rows in rank order, their labels, this rank's first row)."""
        if not (dist.is_available() and dist.is_initialized()):
            return embeddings, labels, 0
        rank, world = dist.get_rank(self.group), dist.get_world_size(self.group)
        n = torch.tensor([embeddings.shape[0]], device=embeddings.device)
        sizes = [torch.zeros_like(n) for _ in range(world)]
        dist.all_gather(sizes, n, group=self.group)
        counts = [int(s) for s in sizes]

        def gather(x: Tensor) -> Tensor:
            padded = x.new_zeros((max(counts),) + tuple(x.shape[1:]))
            padded[: x.shape[0]] = x
            parts = [torch.empty_like(padded) for _ in counts]
            dist.all_gather(parts, padded, group=self.group)
            return torch.cat([p[:c] for p, c in zip(parts, counts)])

        return gather(embeddings), None if labels is None else gather(labels), sum(counts[:rank])

    def _checked_labels(self, embeddings: Tensor, labels: Tensor) -> Tensor:
        if self.classes is None:
            return checks.validate_labelled(embeddings, labels)[1]
        if not isinstance(labels, Tensor) or tuple(labels.shape) != (embeddings.shape[0], self.classes):
            shape = tuple(labels.shape) if isinstance(labels, Tensor) else type(labels).__name__
            raise ValueError(
                f"labels must be ({embeddings.shape[0]}, {self.classes}) multi-hot sets (the bank's "
                f"classes), got {shape}"
            )
        if labels.dtype != torch.bool and not bool(((labels == 0) | (labels == 1)).all()):
            raise ValueError("labels must be multi-hot: 0/1 or bool entries")
        checks.same_device(labels, embeddings, "labels", "embeddings")
        return labels.bool()

    @torch.no_grad()
    def push(self, embeddings: Tensor, labels: Optional[Tensor] = None) -> Tensor:
        """Enqueues the batch (detached; in a process group, the global batch) over the
        oldest entries; returns the slots of this process's rows."""
        embeddings = checks.check_float_tensor(embeddings, "embeddings", (2,))
        if embeddings.shape[1] != self.dim:
            raise ValueError(f"embeddings must be {self.dim} wide (the bank's dim), got {embeddings.shape[1]}")
        if self.labels is not None:
            if labels is None:
                raise ValueError("labels is None, but the bank keeps a label per entry (labels=True)")
            labels = self._checked_labels(embeddings, labels)
        elif labels is not None:
            raise ValueError("the bank keeps no labels (labels=False): pass labels=None")
        rows, row_labels, first = self._global(embeddings.detach(), labels)
        b = rows.shape[0]
        if b > self.size:
            raise ValueError(f"a batch of {b} rows does not fit a bank of size {self.size}")
        slots = (torch.arange(b, device=self.embeddings.device) + self.position) % self.size
        if self._lent:
            # keys() handed out views that a loss may have saved for its backward
            # (MoCo's order: loss, push, backward): write into fresh buffers and
            # leave those views as they were
            self.embeddings = self.embeddings.clone()
            if self.labels is not None:
                self.labels = self.labels.clone()
            self._lent = False
        self.embeddings[slots] = rows.to(self.embeddings)
        if self.labels is not None:
            assert row_labels is not None
            self.labels[slots] = row_labels.to(self.labels)
        self.position = (self.position + b) % self.size
        self.count = min(self.size, self.count + b)
        return slots[first : first + embeddings.shape[0]]

    def keys(self) -> Tuple[Tensor, Optional[Tensor]]:
        """The filled entries and their labels: views of the buffers, which a later
        :meth:`push` leaves unchanged (it then writes into a copy), so that a loss
        computed from them can be backpropagated after the push."""
        n = self.count
        self._lent = True
        return self.embeddings[:n], None if self.labels is None else self.labels[:n]

    def reset(self) -> None:
        """Empties the bank."""
        self.position = self.count = 0
