"""Triton GPU kernels for the core (``backend="triton"``), imported lazily.

The package imports and works without Triton or a GPU; this subpackage is only
loaded when the triton backend is asked for. On a CPU the kernels run under
Triton's interpreter when ``TRITON_INTERPRET=1`` is set (slow: for tests).
"""
from __future__ import annotations

import importlib.util
import os
from typing import Tuple

import torch

# The widest embedding the kernels take (a Q and a K tile of the whole width must
# fit in an H100/H200's 227 KiB of shared memory): float32 tiles take twice the bytes.
MAX_WIDTH = {torch.float32: 1024, torch.float16: 2048, torch.bfloat16: 2048}


def availability(device_type: str) -> Tuple[bool, str]:
    """(usable here, why not)."""
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed (pip install flashcl[triton])"
    if device_type == "cuda":
        return True, ""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True, ""
    return False, (f"the triton backend runs on CUDA tensors (got {device_type}); on a CPU only under "
                   "Triton's interpreter (TRITON_INTERPRET=1, for tests)")
