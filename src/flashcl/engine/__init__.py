"""The engine: one masked-softmax (or softplus) head per loss family
(:mod:`~flashcl.engine.heads`), its positive terms (:mod:`~flashcl.engine.positives`)
and the drivers that visit the score matrix tile by tile (blocks of rows, symmetric
panels, tensor-core stripes), behind one autograd Function
(:mod:`~flashcl.engine.engine`)."""

from .engine import *  # noqa: F403
from .engine import __all__ as __all__
