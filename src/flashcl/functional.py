"""The loss functions, by the names they have always had here; each lives in the
module of its family (:mod:`flashcl.supcon`, :mod:`flashcl.nt_xent`,
:mod:`flashcl.info_nce`, :mod:`flashcl.clip`, :mod:`flashcl.gist`,
:mod:`flashcl.neighbor`), beside its Module twin; the backends are described in
:mod:`flashcl.dispatch`."""

from __future__ import annotations

from .backends import AUTO_TILED_MIN_ENTRIES
from .clip import clip_loss, siglip_loss, siglip_problem
from .dispatch import Scalar, matryoshka_core, run_core
from .gist import gist_loss
from .info_nce import info_nce_loss
from .neighbor import neighbor_loss, sample_neighbors
from .nt_xent import nt_xent_loss
from .supcon import supcon_loss

__all__ = [
    "supcon_loss",
    "nt_xent_loss",
    "info_nce_loss",
    "clip_loss",
    "siglip_loss",
    "gist_loss",
    "neighbor_loss",
    "sample_neighbors",
    "run_core",
    "matryoshka_core",
    "siglip_problem",
    "Scalar",
    "AUTO_TILED_MIN_ENTRIES",
]
