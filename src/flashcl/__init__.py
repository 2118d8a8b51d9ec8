"""flashcl: exact, numerically stable, O(batch)-memory contrastive losses for PyTorch."""
from . import distributed
from .doctor import doctor
from .functional import (
    AUTO_TILED_MIN_ENTRIES,
    clip_loss,
    info_nce_loss,
    neighbor_loss,
    nt_xent_loss,
    sample_neighbors,
    supcon_loss,
)
from .modules import ClipLoss, InfoNCELoss, NeighborLoss, NTXentLoss, SupConLoss

__version__ = "0.1.0"

__all__ = [
    "supcon_loss",
    "nt_xent_loss",
    "info_nce_loss",
    "clip_loss",
    "neighbor_loss",
    "sample_neighbors",
    "SupConLoss",
    "NTXentLoss",
    "InfoNCELoss",
    "ClipLoss",
    "NeighborLoss",
    "AUTO_TILED_MIN_ENTRIES",
    "doctor",
    "distributed",
]
