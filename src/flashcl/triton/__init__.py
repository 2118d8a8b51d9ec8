"""Triton GPU kernels for the core (``backend="triton"``), imported lazily.

The package imports and works without Triton or a GPU; this subpackage is only
loaded when the triton backend is asked for. On a CPU the kernels run under
Triton's interpreter when ``TRITON_INTERPRET=1`` is set (slow: for tests).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Optional, Tuple

import torch

#: The dtypes the kernels take.
DTYPES = (torch.float32, torch.float16, torch.bfloat16)

#: Half-precision embeddings narrower than this are not given to the kernels: on an H200
#: (Triton 3.6, CUDA 13) the gradient kernel's transposed half-precision tile product read
#: shared memory out of bounds at D = 6 and D = 24 (compute-sanitizer: "Invalid __shared__
#: read" in dk_kernel; an illegal memory access, or a wrong dQ at B = 9), while every width
#: from 64 up (64, 256, 768, 1000, 2048, 4096) and float32 at any width matched the float64
#: reference (tests/test_cuda.py). ``auto`` takes the tiled backend there; ``backend="triton"``
#: computes such a call with the tiled backend, with one warning.
HALF_MIN_WIDTH = 64


def availability(device_type: str) -> Tuple[bool, str]:
    """(usable here, why not)."""
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed (pip install flashcl[triton])"
    if device_type == "cuda":
        return True, ""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True, ""
    return False, (
        f"the triton backend runs on CUDA tensors (got {device_type}); on a CPU only under "
        "Triton's interpreter (TRITON_INTERPRET=1, for tests)"
    )


def failure() -> Optional[str]:
    """The cause of the kernels' failure on this device in this process (then every
    Triton call is computed by the tiled backend), or None: none failed, or the
    kernels were not used."""
    import sys

    driver = sys.modules.get(f"{__name__}.driver")
    return None if driver is None else getattr(driver, "_FAILED", None)
