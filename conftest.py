"""pytest set-up for the whole checkout: the Triton interpreter switch (before
anything imports triton) and the names the docstring examples use."""

from __future__ import annotations

import os
from typing import Any, Dict

import pytest
import torch

if not torch.cuda.is_available():
    # Triton reads this when it is first imported, and some libraries the tests use
    # (transformers, via sentence-transformers) import it: set it before any of them.
    # Without CUDA the kernels can only run under the interpreter (tests/test_triton.py).
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True, scope="session")
def _doctest_names(doctest_namespace: Dict[str, Any]) -> None:
    import flashcl

    doctest_namespace.update(torch=torch, flashcl=flashcl)
