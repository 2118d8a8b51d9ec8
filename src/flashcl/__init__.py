"""flashcl: exact, numerically stable, O(batch)-memory contrastive losses for PyTorch."""

from types import ModuleType as _ModuleType

# the public names: this list is __all__ (below) and the API reference's pages (docs/hooks);
# a new family adds its line here
from . import distributed
from .backends import AUTO_TILED_MIN_ENTRIES
from .losses.circle import CircleLoss, circle_loss
from .losses.class_shards import sample_classes
from .losses.clip import ClipLoss, SigLipLoss, clip_loss, siglip_loss
from .losses.contrastive import ContrastiveLoss, contrastive_loss
from .losses.cosent import CoSENTLoss, cosent_loss
from .losses.distill import DistillLoss, distill_loss
from .losses.flex import FlexCircle, FlexLoss, FlexMultiSimilarity, FlexPairSum, flex_dense_mask, flex_loss
from .losses.flex_blocks import BlockMask, flex_block_mask
from .losses.gist import GistLoss, gist_loss
from .losses.info_nce import InfoNCELoss, info_nce_loss
from .losses.koleo import KoLeoLoss, koleo_loss
from .losses.margin import ArcFaceLoss, CosFaceLoss, arcface_loss, cosface_loss
from .losses.maxsim import MaxSimDistillLoss, MaxSimLoss, maxsim_distill_loss, maxsim_loss, maxsim_scores
from .losses.multi_similarity import MultiSimilarityLoss, multi_similarity_loss
from .losses.neighbor import NeighborLoss, neighbor_loss, sample_neighbors
from .losses.nt_xent import NTXentLoss, nt_xent_loss
from .losses.proxy_anchor import ProxyAnchorLoss, proxy_anchor_loss
from .losses.rank_n_contrast import RankNContrastLoss, rank_n_contrast_loss
from .losses.self_distill import DINOLoss, dino_loss, prototype_center
from .losses.supcon import SupConLoss, supcon_loss
from .losses.swav import SwAVLoss, swav_loss
from .losses.triplet import TripletLoss, triplet_loss
from .tools.doctor import doctor
from .training import metrics
from .training.cached import cached_step
from .training.memory import MemoryBank
from .training.scale import LogitScale

__version__ = "0.2.0.dev0"

#: every name imported above: the losses, their Module twins and the tools
__all__ = [
    _name
    for _name, _value in list(globals().items())
    if not _name.startswith("_") and (not isinstance(_value, _ModuleType) or _name in ("distributed", "metrics"))
]
