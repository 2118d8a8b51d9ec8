"""The loss Modules, by the names they have always had here; each lives in the
module of its family beside its function, all on :class:`flashcl.base.LossModule`."""

from __future__ import annotations

from .clip import ClipLoss, SigLipLoss
from .gist import GistLoss
from .info_nce import InfoNCELoss
from .neighbor import NeighborLoss
from .nt_xent import NTXentLoss
from .supcon import SupConLoss

__all__ = ["SupConLoss", "NTXentLoss", "InfoNCELoss", "ClipLoss", "SigLipLoss", "GistLoss", "NeighborLoss"]
