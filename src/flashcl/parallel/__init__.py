"""Losses across processes: the collectives, the column source over every rank
(:mod:`flashcl.parallel.collectives`) and the ring driver (:mod:`flashcl.parallel.ring`)."""

from .collectives import *  # noqa: F403
from .collectives import __all__ as __all__
