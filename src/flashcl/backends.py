"""Where an engine problem runs: the column source of one process (:class:`Source`;
:class:`flashcl.parallel.Columns` is the same across processes), the backend a call
takes (:func:`resolve`, :func:`pick_name`, :func:`pick`: decided here alone, the
thresholds as data), its driver and rows per block (:func:`driver`,
:func:`auto_block`), and the one run of a problem on them (:func:`run_problem`).

Backends (argument ``backend``):

* ``"reference"``: per-anchor loops, as a loss is first written by hand. Slow; the tests' oracle.
* ``"dense"``: vectorised, materialises the M x N score matrix.
* ``"tiled"``: blocks of rows, O((M + N) D + block x N) memory, exact.
* ``"triton"``: the tiled algorithm in Triton kernels (CUDA; on a CPU only
  under Triton's interpreter, ``TRITON_INTERPRET=1``, for tests).
* ``"auto"``: ``"triton"`` for CUDA tensors when Triton is importable, the
  dtype is float32/float16/bfloat16 and the embedding at most
  :data:`flashcl.runner.AUTO_TRITON_MAX_WIDTH` (256) wide (half precision: at least
  :data:`flashcl.triton.HALF_MIN_WIDTH`, 64); else ``"tiled"``
  (on CUDA in half precision: stripes of tensor-core GEMMs) when the score
  matrix has at least :data:`AUTO_TILED_MIN_ENTRIES` entries (M x N),
  ``"dense"`` below; the neighbour loss, whose score matrix is given, always
  uses ``"tiled"`` (it allocates nothing of the matrix's size but the gradient
  itself).

"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, replace
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .core import compute_dtype
from .engine import engine
from .engine.columns import ColumnBlocks
from .engine.engine import Driver, Problem, ReduceWeights
from .engine.panels import UpperPanels
from .engine.stripes import Stripes
from .engine.tiled import RowBlocks
from .triton import DTYPES as TRITON_DTYPES
from .triton import HALF_MIN_WIDTH as TRITON_HALF_MIN_WIDTH

__all__ = [
    "Source",
    "local",
    "AUTO_TILED_MIN_ENTRIES",
    "AUTO_TRITON_MAX_WIDTH",
    "ENGINE_BACKENDS",
    "resolve",
    "pick",
    "pick_name",
    "driver",
    "auto_block",
    "run_problem",
    "solve",
]


@dataclass
class Source:
    """The candidates a call scores its anchor rows against; this class: one process
    (a world of one). :class:`flashcl.distributed.Columns` is the same across
    processes.

    Attributes:
        keys: the candidates' rows (the anchors themselves when ``own``).
        offset: the anchors' first column in the global order (0 for one process).
        sizes: each rank's block size (one block for one process).
        ring: the blocks travel round the ranks (strategy ``"ring"``).
        group: the process group; None for one process.
        shared: the number of shared keys (a queue) at the end of rank 0's block.
        own: the keys are the anchor rows themselves (self-contrast: the drivers
            visit the symmetric upper panels).
    """

    keys: Tensor
    offset: int
    sizes: List[int]
    ring: bool = False
    group: Any = None
    shared: int = 0
    own: bool = False

    @property
    def total(self) -> int:
        """Columns of the global score matrix."""
        return sum(self.sizes)

    def class_ids(self, labels: Tensor, shared: Optional[Tensor] = None) -> Tuple[Tensor, int]:
        """Dense class ids (from 0) of every column's label (:meth:`gather` of the
        labels, ``shared``: the shared keys'), and the number of classes."""
        uniq, ids = torch.unique(self.gather(labels, shared), return_inverse=True)
        return ids.reshape(-1), int(uniq.numel())

    def gather(self, x: Tensor, shared: Optional[Tensor] = None) -> Tensor:
        """Per-column rows of ``x`` (one per key of this block; no gradient: labels,
        a guide's embeddings) in the columns' order; ``shared``: those of the shared
        keys."""
        if (shared is None) != (self.shared == 0) or (shared is not None and shared.shape[0] != self.shared):
            raise ValueError("the shared keys' rows must come with the shared keys")
        return x.detach() if shared is None else torch.cat([x.detach(), shared.to(x.dtype)])

    def narrow(self, width: int) -> Source:
        """The same columns with the keys' first ``width`` coordinates (Matryoshka)."""
        return replace(self, keys=self.keys[:, :width])

    def run(
        self,
        q: Tensor,
        scale: Tensor,
        problem: Problem,
        weights: Any,
        block_size: Optional[int],
        params: Sequence[Tensor] = (),
        backend: str = "tiled",
    ) -> Tuple[Tensor, Tuple[Tensor, ...]]:
        """``problem``'s losses of the rows ``q`` against these columns on ``backend``, and
        the results its head reports (:class:`~flashcl.engine.heads.ReportingHead`; none
        for another)."""
        k = None if self.own else self.keys
        return run_problem(q, k, scale, problem, backend, weights, block_size, params)

    def count(self, n: Tensor) -> Tensor:
        """``n`` summed over the ranks (a world of one: ``n``)."""
        return n

    def rows_of_every_rank(self, x: Tensor) -> Tensor:
        """Every rank's rows of ``x`` in rank order, without gradient (a world of one: ``x``)."""
        return x.detach()

    def factor(self, grad_scale: str) -> float:
        """The factor each rank's share is returned with (``grad_scale``); 1 for one process."""
        return 1.0


def local(keys: Tensor, shared: Optional[Tensor] = None, own: bool = False) -> Source:
    """One process's source: ``keys`` (``own``: the anchors themselves), then
    ``shared`` keys without gradient."""
    if shared is None:
        return Source(keys, 0, [keys.shape[0]], own=own)
    joined = torch.cat([keys, shared.detach().to(keys.dtype)])
    return Source(joined, 0, [joined.shape[0]], shared=shared.shape[0])


#: ``backend="auto"`` switches from dense to tiled at this many score-matrix
#: entries (M x N). Measured on the 2-core CPU (``flashcl bench --suite simcse``,
#: D = 768): at B = 256 both took 4.7-4.8 ms; at B = 1024 (2^20 entries) tiled
#: took 33 ms and dense 59 ms, and above that tiled's memory stays O(B).
AUTO_TILED_MIN_ENTRIES = 1 << 20


#: On CUDA, ``auto`` takes the Triton kernels up to this embedding width and the
#: tiled backend's stripes of cuBLAS GEMMs above it (half precision narrower than
#: :data:`flashcl.triton.HALF_MIN_WIDTH`: the stripes too). Measured on an H200,
#: bfloat16, B = 32,768 (``flashcl bench --suite gpu --device cuda``,
#: docs/bench/gpu-report.md), forward + backward: at D = 256 the kernels took 18-22 ms
#: (SupCon, InfoNCE, CLIP, SigLIP) and the stripes 43-69 ms; at D = 768 the kernels
#: 78-102 ms and the stripes 50-76 ms; at D = 1024 and 4096 the stripes won by 2-20x.
AUTO_TRITON_MAX_WIDTH = 256


def resolve(
    backend: str,
    entries: int,
    device: torch.device,
    dtype: torch.dtype,
    width: int = 0,
    kernel: Optional[str] = "softmax",
) -> str:
    """The backend ``"auto"`` stands for: ``"triton"`` for CUDA tensors when Triton is
    importable, the head has kernels (``kernel``), the dtype is one they take and the
    embedding at most :data:`AUTO_TRITON_MAX_WIDTH` wide (and, in half precision, at least
    :data:`flashcl.triton.HALF_MIN_WIDTH`); else ``"tiled"`` from
    :data:`AUTO_TILED_MIN_ENTRIES` score entries, ``"dense"`` below. Any other name
    is returned as is."""
    if backend != "auto":
        return backend
    if (
        device.type == "cuda"
        and kernel is not None
        and dtype in TRITON_DTYPES
        and width <= AUTO_TRITON_MAX_WIDTH
        and (dtype == torch.float32 or width >= TRITON_HALF_MIN_WIDTH)
        and importlib.util.find_spec("triton") is not None
    ):
        return "triton"
    return "tiled" if entries >= AUTO_TILED_MIN_ENTRIES else "dense"


#: the backends the engine's problems run on (:func:`run`)
ENGINE_BACKENDS = ("reference", "dense", "tiled", "triton")

#: ``kernel`` of :func:`pick_name` left out: the softmax kernels where the family has ``"triton"``
_FROM_NAMES = "from names"


def pick_name(
    backend: str,
    names: Sequence[str],
    entries: int,
    x: Optional[Tensor],
    family: str,
    auto: Optional[str] = None,
    min_tiled: Optional[int] = None,
    source: Optional[Source] = None,
    kernel: Optional[str] = _FROM_NAMES,
) -> str:
    """The backend among ``names`` (those a family computes with) that ``backend``
    stands for, decided here alone: round the ring (``source.ring``) only the tiled core;
    ``"auto"`` is the family's fixed choice ``auto`` where it has one, else ``"tiled"``
    from ``min_tiled`` entries (the family's own threshold), else :func:`resolve` from
    ``entries`` (the call's score entries) and ``x``'s device, dtype and width, the Triton
    kernels only for a head that has them (``kernel``: ``"softmax"``, ``"softplus"`` or
    None; left out: the softmax kernels where ``names`` has ``"triton"``). A backend the
    family lacks is a ValueError that names those it has."""
    if source is not None and source.ring:
        if backend not in ("auto", "tiled"):
            raise ValueError(
                f"backend={backend!r} with strategy='ring': the blocks travel round the ranks through "
                "the tiled core; pass backend='auto' or 'tiled', or strategy='all_gather'"
            )
        name = "tiled"
    elif backend != "auto":
        name = backend
    elif auto is not None:
        name = auto
    elif (min_tiled is not None and "triton" not in names) or x is None:
        name = "tiled" if entries >= (min_tiled or AUTO_TILED_MIN_ENTRIES) else "dense"
    else:
        if kernel == _FROM_NAMES:
            kernel = "softmax" if "triton" in names else None
        name = resolve(backend, entries, x.device, x.dtype, x.shape[-1], kernel=kernel)
    if name not in names:
        missing = "no Triton kernel" if name == "triton" else f"no {name!r} implementation"
        raise ValueError(f"{family} has {missing}: backend={backend!r}; it takes one of {('auto', *names)}")
    return name


def pick(
    backend: str,
    impls: Mapping[str, Callable[..., Any]],
    entries: int,
    x: Tensor,
    family: str,
    auto: Optional[str] = None,
    min_tiled: Optional[int] = None,
    source: Optional[Source] = None,
    kernel: Optional[str] = _FROM_NAMES,
) -> Callable[..., Any]:
    """A family's implementation for ``backend``: ``impls`` maps the backends the family
    computes with (``"reference"``, ``"dense"``, ``"tiled"``, ``"triton"``) to its
    implementation of each (a family hands its implementations to the runner, which
    picks, resolves ``"auto"`` and refuses what the family lacks, in this one place:
    :func:`pick_name`)."""
    return impls[pick_name(backend, tuple(impls), entries, x, family, auto, min_tiled, source, kernel)]


def _self_contrast(k: Optional[Tensor], problem: Problem) -> bool:
    return k is None and problem.offset == 0 and problem.head.symmetric_tiles


def _stripes(device_type: str, dtype: torch.dtype, self_contrast: bool = False) -> bool:
    """Half precision: the tiled backend's stripes, tensor-core GEMMs on CUDA; elsewhere
    (the GEMMs emulated) for all but the symmetric self-contrast panels. The stripes
    take the embeddings as given and write dQ once in their dtype (InfoNCE in
    bfloat16 at B = 16,384, D = 768 on the 2-core CPU: 64-91 MB beyond the inputs and
    their gradients against the row blocks' 199-207 MB, in about the same time, 2.0-2.1 s
    against 1.9-2.4 s at 8,192); the upper panels compute 2/3 of the products (SupCon
    in bfloat16 at 8,192: 1.5 s against the stripes' 2.6 s)."""
    half = dtype in (torch.float16, torch.bfloat16)
    return half and (device_type == "cuda" or not self_contrast)


#: the tiled backend's drivers for a family of one tile layout, by the layout's name (data the
#: family hands over): ``"lazy rows"``, row blocks that never copy the normalised rows (a K x D
#: table of prototypes); ``"columns"``, blocks of columns against every row in two visits (a
#: margin softmax's classes)
LAYOUTS: Mapping[str, Callable[[str], Driver]] = {
    "lazy rows": lambda device_type: RowBlocks(device_type, lazy=True),
    "columns": ColumnBlocks,
}


def layout_driver(layout: str, device_type: str) -> Driver:
    """The driver of the tiled backend's ``layout`` (:data:`LAYOUTS`) on ``device_type``."""
    if layout not in LAYOUTS:
        raise ValueError(f"no tile layout {layout!r} (the tiled backend's are {', '.join(LAYOUTS)})")
    return LAYOUTS[layout](device_type)


def driver(
    name: str, problem: Problem, k: Optional[Tensor], device_type: str, dtype: torch.dtype = torch.float32
) -> Optional[Driver]:
    """The driver for backend ``name`` (None: the dense formula)."""
    if name == "dense":
        return None
    if name == "tiled":
        symmetric = _self_contrast(k, problem)
        if _stripes(device_type, dtype, symmetric):
            return Stripes()
        return UpperPanels(device_type) if symmetric else RowBlocks(device_type)
    if name == "triton":
        from .triton import availability

        ok, why = availability(device_type)
        if not ok:
            raise ValueError(f"backend='triton' is not usable here: {why}")
        from .triton.driver import TritonDriver

        # where the kernels fail on the device: the tiled backend, with a warning (never a crashed step)
        return TritonDriver(problem.head, fallback=driver("tiled", problem, k, device_type, dtype))
    raise ValueError(f"backend {name!r} does not run engine problems")


def auto_block(
    m: int, n: int, dtype: torch.dtype = torch.float32, self_contrast: bool = False, device_type: str = "cpu"
) -> int:
    """Rows per block, from measurements on the 2-core CPU at B = 8192, D = 768.

    Self-contrast (SupCon, NT-Xent: the symmetric upper-panel path): buffers
    near 8 MB, at least 128 rows. Its GEMM work is already two thirds of the
    unsymmetric path's, 256-row panels ran as fast as 512 (0.82-0.94x of the
    three-GEMM bound) with half the buffer memory.
    Otherwise (CLIP, InfoNCE): buffers near 16 MB, at least 256 rows: the block
    GEMMs (inner dimension = block rows for ``G^T Q_blk``) lose ~30% of their
    speed at 256 rows and CLIP went from ~1.65x to ~1.4x of the bound at 512.
    On CUDA the stripes' GEMMs want many rows and device memory is large: 256 MB
    of score buffer per stripe, at least 64 rows (at a million keys: 64 rows, 384 MB
    with the stripe's ``G''``, beside the keys' 3 GB gradient accumulator at D = 768;
    provisional: not yet timed on a GPU).
    """
    if device_type == "cuda":
        budget, floor = 256 * 2**20, 64
    else:
        budget, floor = (8 * 2**20, 128) if self_contrast else (16 * 2**20, 256)
    itemsize = torch.empty((), dtype=dtype).element_size()
    rows = max(budget // max(1, n * itemsize), floor)
    return int(max(1, min(m, rows)))


def run_problem(
    q: Tensor,
    k: Optional[Tensor],
    scale: Tensor,
    problem: Problem,
    name: str,
    reduce_weights: ReduceWeights,
    block_size: Optional[int],
    params: Sequence[Tensor] = (),
) -> Tuple[Tensor, Tuple[Tensor, ...]]:
    """:func:`flashcl.engine.run` with backend ``name``'s driver: the losses and what
    the head reports; ``block_size=None`` picks the rows per block (:func:`auto_block`);
    ``params``: the head's learnable tensors, if it has any."""
    m = q.shape[0]
    n = m if k is None else k.shape[0]
    chosen = driver(name, problem, k, q.device.type, q.dtype)
    block = block_size or auto_block(
        m, n, compute_dtype(q.dtype), self_contrast=isinstance(chosen, UpperPanels), device_type=q.device.type
    )
    return engine.run(q, k, scale, problem, chosen, reduce_weights, block, params)


def solve(
    q: Tensor,
    source: Source,
    scale: Tensor,
    problem: Problem,
    weights: ReduceWeights,
    opts: Any,
    family: str,
    oracle: Callable[[], Tuple[Tensor, Tuple[Tensor, ...]]],
    x: Optional[Tensor] = None,
    auto: Optional[str] = None,
) -> Tuple[Tensor, Tuple[Tensor, ...]]:
    """A family's problem (the rows ``q`` against ``source``) on the backend
    ``opts.backend`` stands for among ``"reference"``, ``"dense"`` and ``"tiled"``
    (:func:`pick_name`, from ``x``'s device and dtype, default ``q``'s): the family's
    ``oracle`` (its per-row losses by per-anchor loops, and what the head reports, as
    its loops find them) for ``"reference"``, else the engine (:meth:`Source.run`).
    ``weights``: a scalar reduction's ``(r, None)`` (None: the per-row losses);
    ``auto``: the family's fixed choice for ``"auto"``, if it has one. Returns the
    losses and the results a :class:`~flashcl.engine.heads.ReportingHead` reports
    (none for another)."""
    like = q if x is None else x
    names = ("reference", "dense", "tiled")
    name = pick_name(opts.backend, names, q.shape[0] * source.total, like, family, auto, source=source)
    if name == "reference":
        rows, found = oracle()
        return (rows if weights is None else (weights[0] * rows).sum()), found
    return source.run(q, scale, problem, weights, opts.block_size, backend=name)
