"""What every loss Module shares: :class:`LossModule` stores a loss's options and
passes them to its function; the guards that turn a peer library's call into an
error that names the drop-in to use."""

from __future__ import annotations

from typing import Any, Callable, Dict, TypeVar

from torch import nn

F = TypeVar("F", bound=Callable[..., Any])

#: Argument descriptions that several losses share, written once: a docstring
#: names one as ``@name@`` on a line of its own (:func:`shared_docs` fills it in).
DOCS: Dict[str, str] = {
    "prototype_options": """backend: ``"auto"`` (default: ``"tiled"`` from :data:`flashcl.AUTO_TILED_MIN_ENTRIES`
    logits, ``"dense"`` below) | ``"tiled"`` (blocks: no rows x K, or B x B, tensor) |
    ``"dense"`` (the whole matrix, as lightly and DINOv2 write it) | ``"reference"``
    (one row at a time; the tests' oracle). No Triton kernel: ``"triton"`` is an error.
block_size: sets the tiled backend's blocks: blocks of images, every view's rows of
    them, against every prototype, each of as many entries as ``block_size``
    prototypes against every row (Sinkhorn-Knopp's scalings take blocks of
    ``block_size`` prototypes; KoLeo: rows per block); None picks one.
process_group: None (default: this process's rows) or a process group of
    ``torch.distributed``: the loss over every rank's rows (local batch sizes may
    differ; a rank may have none), the prototypes replicated; the sums over the rows (Sinkhorn-Knopp's, the
    center's) all-reduced, as DINOv2 does.
grad_scale: across processes, ``"ddp"`` (default: each rank returns world size x its
    share, so that DistributedDataParallel's averaging gives the one-process
    gradient) | ``"sum"`` (each rank's share).""",
    "backend": """backend: ``"auto"`` (default: ``"triton"`` for CUDA tensors up to D = 256 when
    Triton is installed, else ``"tiled"`` from 2^20 score entries, ``"dense"`` below) |
    ``"reference"`` (per-anchor loops) | ``"dense"`` (the B x B matrix) |
    ``"tiled"`` (row blocks, O(B) memory) | ``"triton"`` (GPU kernels).
block_size: rows per block of the tiled backend; None picks one.""",
    "matryoshka": """matryoshka_dims: prefix widths ``d_m`` of the embeddings (Matryoshka
    representation learning): the loss becomes ``sum_m w_m loss(x[..., :d_m])``,
    each width normalised on its own, all widths in one pass on the tiled
    backend. Default: None (the full width only).
matryoshka_weights: the weights ``w_m`` (default 1 each).""",
    "margin_args": """embeddings: (B, D) (normalised inside).
labels: (B,) class indices in ``[0, C)``.
class_weights: (C, D) the class proxies, like ``nn.Linear(D, C).weight``
    (normalised inside); its gradient is formed block by block.
scale: ``s``, a float or a (learnable) 0-dim tensor. Default: 64.
reduction: ``"mean"`` | ``"sum"`` | ``"none"``.
backend: ``"auto"`` | ``"tiled"`` (blocks of classes) | ``"dense"`` (the B x C
    logits) | ``"reference"`` (row by row).
block_size: classes per block of the tiled backend; None picks one (a B x
    block tile of about 16 MB).""",
    "proxies": """subcenters: ``k`` proxies per class (sub-center ArcFace): rows ``c k .. c k + k - 1``
    of ``class_weights`` are class ``c``'s (pytorch-metric-learning's order), the
    closest one gives the class's cosine (its gradient goes to it alone). Default: 1.
shard_classes: with ``process_group``: ``class_weights`` is this rank's contiguous
    slice of the classes (rank 0 the first ``C_0``, rank 1 the next ``C_1``, ...; any
    sizes; a rank may hold none: a (0, D) slice), ``labels`` are global class ids; the
    loss is the margin softmax of every rank's embeddings over all classes, each
    rank's weight gradient its slice's exact gradient. As for every loss with a
    process group, ``grad_scale="ddp"`` returns world size x this rank's share (here
    the global loss on every rank) and the embeddings the global loss's gradient
    times the world size (DDP's averaging of the encoder then gives the global
    batch's); ``"sum"`` returns this rank's share (the sum over the ranks is the loss)
    and a learnable scale its share of the gradient. Tiled backend. Default: False.
classes: (K,) sorted indices of the classes kept this step (sampled classes,
    insightface's Partial FC; :func:`flashcl.sample_classes` draws them): the softmax
    runs over those classes of ``class_weights`` (this rank's slice, sharded); every
    labelled class must be kept. Default: None (every class).""",
    "process_group": """process_group: None (default: this process's inputs) or a process group of
    ``torch.distributed``: the loss over the concatenation of every rank's inputs in
    rank order (local batch sizes may differ; a rank may have none, (0, D) inputs: it
    takes part with nothing of its own), as :mod:`flashcl.distributed` computes it;
    every rank calls with the same options. Keys that every rank holds alike (a
    queue: ``ref=``, ``negatives=``, :func:`flashcl.flex_loss`'s keys without gradient)
    enter the global loss once; ranks that pass different options or such keys get
    a ValueError each.
strategy: across processes, ``"all_gather"`` (the candidates gathered with an
    autograd-aware collective) | ``"ring"`` (candidate blocks passed around a ring:
    no rank holds the global batch). Every option takes both.
grad_scale: across processes, ``"ddp"`` (default: each rank returns world size x
    its share, so that DistributedDataParallel's averaging gives the
    single-process gradient) | ``"sum"`` (each rank's share).""",
}


def shared_docs(fn: F) -> F:
    """Fills the ``@name@`` lines of ``fn``'s docstring with :data:`DOCS`, indented as the line."""
    doc = fn.__doc__ or ""
    lines = []
    for line in doc.split("\n"):
        key = line.strip()
        if key.startswith("@") and key.endswith("@") and key[1:-1] in DOCS:
            indent = line[: len(line) - len(line.lstrip())]
            lines += [indent + part for part in DOCS[key[1:-1]].split("\n")]
        else:
            lines.append(line)
    fn.__doc__ = "\n".join(lines)
    inner = getattr(fn, "__wrapped__", None)  # a wrapper's function (torch.compile's operator) shows the same text
    while inner is not None:
        inner.__doc__ = fn.__doc__
        inner = getattr(inner, "__wrapped__", None)
    return fn


__all__ = ["LossModule", "reject_pml_call", "reject_open_clip_keywords", "peer_import_error", "shared_docs", "DOCS"]

PML_ADAPTERS = "flashcl.integrations.pytorch_metric_learning"
OPEN_CLIP_KEYWORDS = (
    "local_loss",
    "gather_with_grad",
    "cache_labels",
    "rank",
    "world_size",
    "use_horovod",
    "dist_impl",
)


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

    @staticmethod
    def given(local: Dict[str, Any], *leave_out: str) -> Dict[str, Any]:
        """A twin's options from its constructor's ``locals()``: its named arguments
        (``self``, the ``super()`` cell and the names in ``leave_out``, such as a
        ``**kwargs`` catch-all, left out), so that a twin's constructor is its
        signature and one line: ``super().__init__(**self.given(locals()))``."""
        skip = {"self", "__class__", *leave_out}
        return {name: value for name, value in local.items() if name not in skip}

    def loss_options(self) -> Dict[str, Any]:
        """The stored options, as the function's keyword arguments."""
        return {name: getattr(self, name) for name in self._option_names}

    def extra_repr(self) -> str:
        return ", ".join(f"{name}={getattr(self, name)!r}" for name in self._option_names)


def reject_pml_call(name: str, extra: Dict[str, Any]) -> None:
    """A pytorch-metric-learning-style call (``indices_tuple``, ``ref_emb``) to a flashcl module."""
    if extra:
        raise TypeError(
            f"flashcl.{name} got {', '.join(sorted(extra))}: pytorch-metric-learning's call "
            f"loss(embeddings, labels, indices_tuple=None, ref_emb=None, ref_labels=None) is taken by "
            f"{PML_ADAPTERS}.{name}, a drop-in subclass of PML's class"
        )


def reject_open_clip_keywords(name: str, extra: Dict[str, Any]) -> None:
    """open_clip's constructor keywords given to a flashcl module."""
    if not extra:
        return
    known = [k for k in extra if k in OPEN_CLIP_KEYWORDS]
    if known:
        fn = "clip_loss" if name == "ClipLoss" else "siglip_loss"
        raise TypeError(
            f"flashcl.{name} got open_clip's constructor keywords {', '.join(sorted(known))}: "
            f"flashcl.{name} computes one process's batch; across processes, "
            f"flashcl.distributed.{fn} computes the exact loss over every rank's batch (what "
            "open_clip's gather_with_grad=True, local_loss=False computes), with no B x B logits"
        )
    raise TypeError(f"flashcl.{name}() got unexpected keyword arguments {', '.join(sorted(extra))}")


def peer_import_error(integration: str, package: str, module: str, error: ImportError) -> ImportError:
    """The error an integration raises when its peer cannot be imported: the peer is
    missing (``module``, installed as ``package``), or it is there and one of its own
    imports failed (a dependency of the peer missing or broken), named as such."""
    missing = getattr(error, "name", None) or ""
    if missing.split(".")[0] == module:
        return ImportError(f"flashcl.integrations.{integration} needs {package} (pip install {package})")
    hint = f" (pip install {missing.split('.')[0]})" if missing else ""
    return ImportError(
        f"flashcl.integrations.{integration} needs {package}, which is installed but failed to import: "
        f"{type(error).__name__}: {error}{hint}"
    )
