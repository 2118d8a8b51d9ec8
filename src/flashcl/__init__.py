"""flashcl: exact, numerically stable, O(batch)-memory contrastive losses for PyTorch."""

import sys as _sys
from typing import Any as _Any

# the families (each registers its loss and its Module twin: flashcl.registry); their
# names imported here as well, so that static checkers see them
from . import distributed, metrics, registry
from .cached import cached_step
from .clip import ClipLoss, SigLipLoss, clip_loss, siglip_loss
from .cosent import CoSENTLoss, cosent_loss
from .distill import DistillLoss, distill_loss
from .doctor import doctor
from .gist import GistLoss, gist_loss
from .info_nce import InfoNCELoss, info_nce_loss
from .margin import ArcFaceLoss, CosFaceLoss, arcface_loss, cosface_loss
from .memory import MemoryBank
from .neighbor import NeighborLoss, neighbor_loss, sample_neighbors
from .nt_xent import NTXentLoss, nt_xent_loss
from .runner import AUTO_TILED_MIN_ENTRIES
from .scale import LogitScale
from .supcon import SupConLoss, supcon_loss
from .triplet import TripletLoss, triplet_loss

__version__ = "0.2.0.dev0"

#: every registered loss and Module twin (flashcl.registry.publish adds them, also
#: those registered later), then the tools
__all__ = [
    "sample_neighbors",
    "MemoryBank",
    "LogitScale",
    "cached_step",
    "AUTO_TILED_MIN_ENTRIES",
    "doctor",
    "distributed",
    "metrics",
]
registry.publish(_sys.modules[__name__], ("function", "module"))


def __getattr__(name: str) -> _Any:
    """A loss or Module registered after import (typed for static checkers)."""
    return registry.lookup(__name__, name, ("function", "module"))
