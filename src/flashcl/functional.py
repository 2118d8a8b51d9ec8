"""The loss functions, each from the module of its family (:mod:`flashcl.losses.supcon`,
:mod:`flashcl.losses.nt_xent`, :mod:`flashcl.losses.info_nce`, ...), where it registers itself
(:mod:`flashcl.registry`): every registered loss is here; the backends are
described in :mod:`flashcl.runner`."""

from __future__ import annotations

import sys
from typing import Any, List

from . import registry
from .checks import Scalar
from .losses.neighbor import sample_neighbors
from .runner import AUTO_TILED_MIN_ENTRIES, matryoshka_core, run_core
from .runner import sigmoid_problem as siglip_problem

__all__: List[str] = [
    "sample_neighbors",
    "run_core",
    "matryoshka_core",
    "siglip_problem",
    "Scalar",
    "AUTO_TILED_MIN_ENTRIES",
]
registry.publish(sys.modules[__name__], ("function",))


def __getattr__(name: str) -> Any:
    """A registered loss function (typed for static checkers; normally set by publish)."""
    return registry.lookup(__name__, name, ("function",))
