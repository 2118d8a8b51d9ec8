"""Cached-embedding training steps (GradCache): a batch far larger than the
encoder's activations allow, with the gradient of a full-batch step.

Once the loss needs O(B) memory, the encoder's activations are what limit the
batch: B inputs through a transformer keep B sets of activations for the
backward pass. :func:`cached_step` takes the step in three stages (Gao et al.,
2021, "Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup"):

1. embed every chunk of ``chunk_size`` inputs without a graph (the random state
   of each chunk is recorded: dropout);
2. compute the loss on the whole batch of embeddings, and its gradient with
   respect to them (a flashcl loss: O(B D) memory);
3. embed each chunk again, with its graph and the same random state, and
   backpropagate its slice of that gradient into the encoder.

Memory: the activations of one chunk, plus the B x D embeddings and their
gradient; time: one more forward pass of the encoder. Parameter gradients
equal those of one step over the whole batch whose encoder runs chunk by chunk
(the same dropout draws).

Batch normalisation sees one chunk at a time (its batch statistics are the
chunk's, as in any chunked forward pass); its running statistics are updated
once per chunk, by the first pass, as a forward pass over the chunks would
update them: the second pass leaves them as the first left them. A tower whose
parameters are all frozen (LiT's locked image tower) is embedded once and not
backpropagated.

Under :class:`~torch.nn.parallel.DistributedDataParallel`, every chunk's backward
but the encoder's last runs under ``no_sync()``, so the gradients are reduced
once; the loss is then a loss across processes (``process_group=``), which sees
every rank's embeddings. Under ``fully_shard`` (FSDP2) every forward pass gathers
the parameters with a collective, so every rank must embed the same number of
chunks (a ValueError on every rank otherwise); the gradients are reduce-scattered
after each chunk's backward, which keeps them sharded.
"""

from __future__ import annotations

import contextlib
import copy
from collections import UserDict
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import get_device_states, set_device_states

__all__ = ["cached_step", "split_batch"]

Encoder = Callable[[Any], Tensor]


def _tensors(x: Any) -> List[Tensor]:
    """Every tensor in a (nested) batch."""
    if isinstance(x, Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    if isinstance(x, (Mapping, UserDict)):
        return [t for item in x.values() for t in _tensors(item)]
    return []


def _batch_size(x: Any) -> int:
    tensors = [t for t in _tensors(x) if t.dim() > 0]
    if not tensors:
        raise TypeError(
            f"cannot find the batch in an input of type {type(x).__name__}: pass tensors, lists, "
            "tuples or dicts of tensors (batch first), or split_fn="
        )
    return int(tensors[0].shape[0])


def split_batch(x: Any, chunk_size: int, batch_size: Optional[int] = None) -> List[Any]:
    """Splits a batch along its first dimension into chunks of ``chunk_size`` rows:
    a tensor, or lists, tuples and dicts (``BatchEncoding`` too) of them, nested;
    entries that are not batch-first tensors (a non-tensor option, a 0-dim tensor,
    a tensor of another length) are repeated in every chunk.

    Args:
        x: the batch.
        chunk_size: rows per chunk (the last one may be smaller).
        batch_size: the batch's length (default: the first tensor's).

    Shape:
        - x: tensors of (B, ...)
        - output: ceil(B / chunk_size) batches of the same structure

    Examples::

        >>> chunks = split_batch({"input_ids": torch.zeros(5, 3), "mask": torch.ones(5, 3)}, 2)
        >>> [c["input_ids"].shape[0] for c in chunks]
        [2, 2, 1]
    """
    b = _batch_size(x) if batch_size is None else batch_size
    starts = list(range(0, b, chunk_size))

    def take(item: Any, start: int) -> Any:
        if isinstance(item, Tensor):
            return item[start : start + chunk_size] if item.dim() > 0 and item.shape[0] == b else item
        if isinstance(item, tuple) and hasattr(item, "_fields"):  # a namedtuple
            return type(item)(*(take(v, start) for v in item))
        if isinstance(item, (list, tuple)):
            return type(item)(take(v, start) for v in item)
        if isinstance(item, UserDict):  # BatchEncoding: keep its class and attributes
            out = copy.copy(item)
            out.data = {k: take(v, start) for k, v in item.data.items()}
            return out
        if isinstance(item, Mapping):
            return {k: take(v, start) for k, v in item.items()}
        return item

    return [take(x, s) for s in starts]


class _RandomState:
    """The CPU and CUDA random states at a chunk's first pass, to replay them."""

    def __init__(self, inputs: Any) -> None:
        self.cpu = torch.get_rng_state()
        self.devices, self.states = get_device_states(*_tensors(inputs))

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        with torch.random.fork_rng(devices=self.devices):
            torch.set_rng_state(self.cpu)
            set_device_states(self.devices, self.states)
            yield


def _fresh(x: Any) -> Any:
    """A shallow copy of a dict-like chunk: encoders that write their outputs into
    their input dict (sentence-transformers' modules do) must not leave them,
    graph and all, in the chunks kept for the second pass."""
    return copy.copy(x) if isinstance(x, (dict, UserDict)) else x


def _call(encode: Encoder, x: Any, output: Optional[Callable[[Any], Tensor]]) -> Tensor:
    out = encode(_fresh(x))
    if output is not None:
        out = output(out)
    if not isinstance(out, Tensor) or out.dim() < 1:
        raise TypeError(
            f"the encoder must return the embeddings, a (chunk, D) tensor (or pass output= to take them "
            f"from its output), got {type(out).__name__}"
        )
    return out


def cached_step(
    encoder: Union[Encoder, Sequence[Encoder]],
    inputs: Sequence[Any],
    loss_fn: Callable[..., Tensor],
    chunk_size: Union[int, Sequence[int]],
    *,
    output: Optional[Callable[[Any], Tensor]] = None,
    split_fn: Optional[Callable[[Any, int], List[Any]]] = None,
    scaler: Optional[Any] = None,
    **loss_kwargs: Any,
) -> Tensor:
    """One training step's backward pass over a batch embedded chunk by chunk
    (GradCache): the encoder's parameters receive the gradient of
    ``loss_fn(*embeddings, **loss_kwargs)`` over the whole batch, while only one
    chunk's activations are held at a time.

    Call it where ``loss.backward()`` would be, then step the optimizer.

    Args:
        encoder: a callable (an ``nn.Module``) from one chunk of an input to its
            embeddings, or one per input (the two towers of CLIP).
        inputs: one batch per tower (queries, documents, ...): tensors, or lists,
            tuples and dicts of them with the batch first (see :func:`split_batch`).
        loss_fn: the loss on the whole batch's embeddings, one tensor per input, in
            order: any flashcl loss (with ``process_group=`` under DDP or FSDP),
            e.g. ``lambda q, d: flashcl.info_nce_loss(q, d, temperature=0.05)``.
        chunk_size: rows per encoder pass (one per input, or one for all).
        output: takes the embeddings from the encoder's output (e.g.
            ``lambda out: out["sentence_embedding"]``); default: the output itself.
        split_fn: ``split_fn(batch, chunk_size) -> list of chunks``, for inputs
            :func:`split_batch` does not handle.
        scaler: a ``torch.amp.GradScaler`` for mixed precision: the loss is scaled
            before its gradient is taken (unscale and step as usual afterwards).
        **loss_kwargs: passed to ``loss_fn`` (labels, extra tensors).

    Returns:
        The loss (detached).

    Shape:
        - inputs: B rows each (towers may differ in B)
        - the embeddings given to ``loss_fn``: (B, ...) per input: (B, D) sentence embeddings,
          or (B, L, D) token embeddings (late interaction, :func:`flashcl.maxsim_loss`,
          with the masks passed as keyword arguments)
        - output: the loss's shape (a scalar)

    Examples::

        >>> encoder = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.1), torch.nn.Linear(32, 8))
        >>> queries, docs = torch.randn(64, 16), torch.randn(64, 16)
        >>> loss = flashcl.cached_step(encoder, [queries, docs],
        ...                            lambda q, d: flashcl.info_nce_loss(q, d, temperature=0.05), chunk_size=16)
        >>> all(p.grad is not None for p in encoder.parameters())
        True
    """
    if isinstance(inputs, (Tensor, Mapping)) or not isinstance(inputs, Sequence) or len(inputs) == 0:
        raise TypeError("inputs must be a list with one batch per tower, e.g. [queries] or [queries, documents]")
    k = len(inputs)
    encoders: List[Encoder] = list(encoder) if isinstance(encoder, (list, tuple)) else [encoder] * k  # type: ignore[list-item]
    if len(encoders) != k:
        raise ValueError(f"got {len(encoders)} encoders for {k} inputs: pass one, or one per input")
    if isinstance(chunk_size, (int, float, Tensor)) or not isinstance(chunk_size, Sequence):
        sizes = [chunk_size] * k
    else:
        sizes = list(chunk_size)
    if len(sizes) != k or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in sizes):
        raise ValueError(f"chunk_size must be a positive int, or one per input, got {chunk_size!r}")
    split = split_fn or (lambda x, c: split_batch(x, c))
    chunks = [split(x, c) for x, c in zip(inputs, sizes)]

    _same_chunk_counts_when_sharded(encoders, chunks)

    # 1. every chunk without a graph, its random state recorded
    states: List[List[_RandomState]] = []
    offsets: List[List[int]] = []  # each chunk's first row in its input's embeddings
    embeddings: List[Tensor] = []
    with torch.no_grad():
        for enc, parts in zip(encoders, chunks):
            states.append([])
            offsets.append([])
            outs: List[Tensor] = []
            for part in parts:
                states[-1].append(_RandomState(part))
                offsets[-1].append(sum(o.shape[0] for o in outs))
                outs.append(_call(enc, part, output))
            embeddings.append(torch.cat(outs))

    # 2. the loss on the whole batch, and its gradient w.r.t. the embeddings
    leaves = [e.detach().requires_grad_(True) for e in embeddings]
    with torch.enable_grad():
        loss = loss_fn(*leaves, **loss_kwargs)
        if not isinstance(loss, Tensor) or not loss.requires_grad:
            raise ValueError("loss_fn must return a tensor that depends on the embeddings it is given")
        if loss.numel() != 1:
            raise ValueError(
                f"loss_fn must return a scalar loss, got shape {tuple(loss.shape)} (reduce it, e.g. reduction='mean')"
            )
        (scaler.scale(loss) if scaler is not None else loss).backward()

    # 3. every chunk again with its graph and random state, backpropagating its slice;
    # a DistributedDataParallel encoder reduces its gradients on its last chunk only
    # (a frozen tower, LiT's, has nothing to backpropagate into)
    jobs: List[Tuple[int, int]] = [
        (t, c)
        for t in range(k)
        for c in range(len(chunks[t]))
        if leaves[t].grad is not None and _trainable(encoders[t])
    ]
    last: Dict[int, int] = {}
    for j, (t, _) in enumerate(jobs):
        last[id(encoders[t])] = j
    # BatchNorm's running statistics were updated by the first pass, once per chunk;
    # the second pass (the same chunks again) must not update them again
    with _running_stats_kept([encoders[t] for t, _ in jobs]):
        for j, (t, c) in enumerate(jobs):
            enc = encoders[t]
            sync = isinstance(enc, nn.parallel.DistributedDataParallel) and last[id(enc)] != j
            grad = leaves[t].grad
            assert grad is not None
            with enc.no_sync() if sync else contextlib.nullcontext():  # type: ignore[attr-defined]
                with states[t][c].replay():
                    out = _call(enc, chunks[t][c], output)
                if not out.requires_grad:  # a callable whose parameters are all frozen
                    continue
                start = offsets[t][c]
                out.backward(grad[start : start + out.shape[0]])
    return loss.detach()


def _same_chunk_counts_when_sharded(encoders: Sequence[Encoder], chunks: Sequence[Sequence[Any]]) -> None:
    """Under ``fully_shard`` each forward pass is a collective of the encoder that
    makes it: every rank must make as many through each sharded encoder; a ValueError
    on every rank, not a hang, when they would not (per encoder: totals can agree
    while the passes of two towers go out of step)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return
    import torch.distributed as dist

    passes: Dict[int, int] = {}  # per sharded encoder (one module may embed several inputs)
    for enc, parts in zip(encoders, chunks):
        if isinstance(enc, FSDPModule):
            passes[id(enc)] = passes.get(id(enc), 0) + len(parts)
    if not passes or not (dist.is_available() and dist.is_initialized()):
        return
    device = next((p.device for enc in encoders if isinstance(enc, nn.Module) for p in enc.parameters()), None)

    def spread(values: List[int]) -> Tuple[List[int], List[int]]:
        """Each value's smallest and largest over the ranks (one all-reduce)."""
        t = torch.tensor(values + [-v for v in values], dtype=torch.int64)
        if device is not None and device.type == "cuda":
            t = t.to(device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        n = len(values)
        return [-int(v) for v in t[n:]], [int(v) for v in t[:n]]

    (fewest_encoders,), (most_encoders,) = spread([len(passes)])
    if fewest_encoders != most_encoders:
        raise ValueError(
            f"cached_step under fully_shard: every rank must pass the same sharded encoders; the ranks "
            f"pass {fewest_encoders} to {most_encoders}"
        )
    fewest, most = spread(list(passes.values()))
    if fewest != most:
        which = ", ".join(f"encoder {i}: {lo} to {hi}" for i, (lo, hi) in enumerate(zip(fewest, most)) if lo != hi)
        raise ValueError(
            f"cached_step under fully_shard: every rank must embed the same number of chunks with each "
            f"sharded encoder (each forward pass gathers its parameters with a collective); the ranks make "
            f"{which}: give every rank a batch with as many chunks per input (the local batch size over "
            "chunk_size, rounded up)"
        )


def _trainable(encoder: Encoder) -> bool:
    """False for a module none of whose parameters requires a gradient (a frozen tower)."""
    if isinstance(encoder, nn.Module):
        return any(p.requires_grad for p in encoder.parameters())
    return True


@contextlib.contextmanager
def _running_stats_kept(encoders: Sequence[Encoder]) -> Iterator[None]:
    """The running statistics (and batch counts) of every batch-norm layer of the
    encoders restored, in place, when the block ends."""
    layers = {
        id(m): m
        for enc in encoders
        if isinstance(enc, nn.Module)
        for m in enc.modules()
        if getattr(m, "track_running_stats", False) and isinstance(getattr(m, "running_mean", None), Tensor)
    }
    saved: List[Tuple[Tensor, Tensor]] = []
    for m in layers.values():
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            buf = getattr(m, name, None)
            if isinstance(buf, Tensor):
                saved.append((buf, buf.clone()))
    try:
        yield
    finally:
        with torch.no_grad():
            for buf, value in saved:
                buf.copy_(value)
