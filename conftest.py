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


if os.environ.get("PYTEST_XDIST_WORKER"):
    # the suite's workers share the machine's cores (pytest -n): one thread each, not one per core each
    torch.set_num_threads(1)


def _missing(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is None


# the examples in an integration's docstrings need its peer library: without it
# (a set-up with the test tools only, as ./run.sh test-floor's) they are not collected
collect_ignore = [
    path
    for path, peer in (
        ("src/flashcl/integrations/pytorch_metric_learning.py", "pytorch_metric_learning"),
        ("src/flashcl/integrations/sentence_transformers.py", "sentence_transformers"),
    )
    if _missing(peer)
]


@pytest.fixture(autouse=True, scope="session")
def _doctest_names(doctest_namespace: Dict[str, Any]) -> None:
    import flashcl

    doctest_namespace.update(torch=torch, flashcl=flashcl)
