"""flashcl: exact, numerically stable, O(batch)-memory contrastive losses for PyTorch."""

from . import distributed, metrics
from .cached import cached_step
from .cosent import CoSENTLoss, cosent_loss
from .distill import DistillLoss, distill_loss
from .doctor import doctor
from .functional import (
    AUTO_TILED_MIN_ENTRIES,
    clip_loss,
    gist_loss,
    info_nce_loss,
    neighbor_loss,
    nt_xent_loss,
    sample_neighbors,
    siglip_loss,
    supcon_loss,
)
from .margin import ArcFaceLoss, CosFaceLoss, arcface_loss, cosface_loss
from .memory import MemoryBank
from .modules import ClipLoss, GistLoss, InfoNCELoss, NeighborLoss, NTXentLoss, SigLipLoss, SupConLoss
from .scale import LogitScale
from .triplet import TripletLoss, triplet_loss

__version__ = "0.2.0.dev0"

__all__ = [
    "supcon_loss",
    "nt_xent_loss",
    "info_nce_loss",
    "clip_loss",
    "siglip_loss",
    "gist_loss",
    "neighbor_loss",
    "distill_loss",
    "cosent_loss",
    "triplet_loss",
    "cosface_loss",
    "arcface_loss",
    "sample_neighbors",
    "SupConLoss",
    "NTXentLoss",
    "InfoNCELoss",
    "ClipLoss",
    "SigLipLoss",
    "GistLoss",
    "NeighborLoss",
    "DistillLoss",
    "CoSENTLoss",
    "TripletLoss",
    "CosFaceLoss",
    "ArcFaceLoss",
    "MemoryBank",
    "LogitScale",
    "cached_step",
    "AUTO_TILED_MIN_ENTRIES",
    "doctor",
    "distributed",
    "metrics",
]
