"""The self-distillation tests' peers, loaded once: lightly 1.6's loss files (from their
files: its package imports torchvision) and DINOv2's ``dinov2.loss``, with the skip marks
that name why one is missing; torch's default dtype for a block (the peers' mask weights)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import pytest
import torch

from flashcl.bench.peers import lightly_ssl_losses

peer, WHY = lightly_ssl_losses()
needs_lightly = pytest.mark.skipif(peer is None, reason=f"lightly's losses: {WHY}")
try:
    import dinov2.loss as dv2
except ImportError as e:  # pragma: no cover - the suite installs it
    dv2, DV2_WHY = None, str(e)
else:
    DV2_WHY = ""
needs_dinov2 = pytest.mark.skipif(dv2 is None, reason=f"dinov2 not importable: {DV2_WHY}")


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """torch's default dtype set for a block: DINOv2's and lightly's mask weights (1 / an
    integer count) take it, float64 for the comparisons."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)
