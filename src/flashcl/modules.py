"""The loss Modules, each from the module of its family beside its function, where
it registers itself (:mod:`flashcl.registry`): every registered Module twin is here,
all on :class:`flashcl.base.LossModule`."""

from __future__ import annotations

import sys
from typing import Any, List

from . import registry

__all__: List[str] = []
registry.publish(sys.modules[__name__], ("module",))


def __getattr__(name: str) -> Any:
    """A registered Module twin (typed for static checkers; normally set by publish)."""
    return registry.lookup(__name__, name, ("module",))
