"""Backend names, the ``auto`` rule, and the driver each name runs a problem with.

* ``"dense"``: the whole score matrix, differentiated by autograd
  (:func:`flashcl.engine.dense_values`); memory O(M N).
* ``"tiled"``: blocks of rows (:class:`flashcl.tiled.RowBlocks`), or for
  self-contrast the upper panels only (:class:`flashcl.panels.UpperPanels`);
  for float16/bfloat16 on CUDA, stripes of rows through tensor-core GEMMs
  (:class:`flashcl.stripes.Stripes`); memory O((M + N) D + block x N).
  float32 GEMMs follow torch's TF32 switch (IEEE by default).
* ``"triton"``: Triton kernels (:class:`flashcl.triton.driver.TritonDriver`), CUDA
  (on a CPU only under Triton's interpreter, for tests).
* ``"reference"``: the per-anchor loops of :mod:`flashcl.reference` (not a driver:
  the losses in :mod:`flashcl.functional` call it directly); the tests' oracle.
* ``"auto"``: see :func:`resolve`.
"""

from __future__ import annotations

import importlib.util
from typing import Optional

import torch
from torch import Tensor

from . import engine
from .engine import Driver, Problem, ReduceWeights
from .panels import UpperPanels
from .stripes import Stripes
from .tiled import RowBlocks, auto_block
from .triton import DTYPES as TRITON_DTYPES
from .utils import compute_dtype

__all__ = ["AUTO_TILED_MIN_ENTRIES", "AUTO_TRITON_MAX_WIDTH", "resolve", "driver", "run"]

#: ``backend="auto"`` switches from dense to tiled at this many score-matrix
#: entries (M x N). Measured on the 2-core CPU (``flashcl bench --suite simcse``,
#: D = 768): at B = 256 both took 4.7-4.8 ms; at B = 1024 (2^20 entries) tiled
#: took 33 ms and dense 59 ms, and above that tiled's memory stays O(B).
AUTO_TILED_MIN_ENTRIES = 1 << 20


#: On CUDA, ``auto`` takes the Triton kernels up to this embedding width and the
#: tiled backend's stripes of cuBLAS GEMMs above it. Provisional, from the H200 run
#: of the previous kernels (whole-width tiles; docs/bench/gpu-report.md): 2.7-4.4x
#: the three cuBLAS GEMMs at D = 256 but 17-23x at D = 768, where GEMMs on row
#: stripes cost about 1.5x by the estimate in the GPU notes. The crossover of the
#: present kernels (a loop over D) and the stripes has not been measured on a GPU.
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
    embedding at most :data:`AUTO_TRITON_MAX_WIDTH` wide; else ``"tiled"`` from
    :data:`AUTO_TILED_MIN_ENTRIES` score entries, ``"dense"`` below. Any other name
    is returned as is."""
    if backend != "auto":
        return backend
    if (
        device.type == "cuda"
        and kernel is not None
        and dtype in TRITON_DTYPES
        and width <= AUTO_TRITON_MAX_WIDTH
        and importlib.util.find_spec("triton") is not None
    ):
        return "triton"
    return "tiled" if entries >= AUTO_TILED_MIN_ENTRIES else "dense"


def _self_contrast(k: Optional[Tensor], problem: Problem) -> bool:
    return k is None and problem.offset == 0 and problem.head.symmetric_tiles


def _stripes(device_type: str, dtype: torch.dtype) -> bool:
    """Half precision on CUDA: the tiled backend's tensor-core stripes."""
    return device_type == "cuda" and dtype in (torch.float16, torch.bfloat16)


def driver(
    name: str, problem: Problem, k: Optional[Tensor], device_type: str, dtype: torch.dtype = torch.float32
) -> Optional[Driver]:
    """The driver for backend ``name`` (None: the dense formula)."""
    if name == "dense":
        return None
    if name == "tiled":
        if _stripes(device_type, dtype):
            return Stripes()
        return UpperPanels(device_type) if _self_contrast(k, problem) else RowBlocks(device_type)
    if name == "triton":
        from .triton import availability

        ok, why = availability(device_type)
        if not ok:
            raise ValueError(f"backend='triton' is not usable here: {why}")
        from .triton.driver import TritonDriver

        return TritonDriver(problem.head)
    raise ValueError(f"backend {name!r} does not run engine problems")


def run(
    q: Tensor,
    k: Optional[Tensor],
    scale: Tensor,
    problem: Problem,
    name: str,
    reduce_weights: ReduceWeights,
    block_size: Optional[int],
    param: Optional[Tensor] = None,
) -> Tensor:
    """:func:`flashcl.engine.run` with backend ``name``'s driver; ``block_size=None``
    picks the rows per block (:func:`flashcl.tiled.auto_block`); ``param``: the
    head's learnable scalar, if it has one."""
    m = q.shape[0]
    n = m if k is None else k.shape[0]
    chosen = driver(name, problem, k, q.device.type, q.dtype)
    block = block_size or auto_block(
        m, n, compute_dtype(q.dtype), self_contrast=isinstance(chosen, UpperPanels), device_type=q.device.type
    )
    return engine.run(q, k, scale, problem, chosen, reduce_weights, block, param)
