"""flashcl: exact, numerically stable, O(batch)-memory contrastive losses for PyTorch."""

import importlib as _importlib
import importlib.abc as _abc
import importlib.util as _util
import sys as _sys
from typing import Any as _Any
from typing import Optional as _Optional

# the families (each registers its loss and its Module twin: flashcl.registry); their
# names imported here as well, so that static checkers see them
from . import distributed, registry
from .losses.class_shards import sample_classes
from .losses.clip import ClipLoss, SigLipLoss, clip_loss, siglip_loss
from .losses.cosent import CoSENTLoss, cosent_loss
from .losses.distill import DistillLoss, distill_loss
from .losses.flex import FlexLoss, flex_dense_mask, flex_loss
from .losses.flex_blocks import BlockMask, flex_block_mask
from .losses.gist import GistLoss, gist_loss
from .losses.info_nce import InfoNCELoss, info_nce_loss
from .losses.koleo import KoLeoLoss, koleo_loss
from .losses.margin import ArcFaceLoss, CosFaceLoss, arcface_loss, cosface_loss
from .losses.maxsim import MaxSimDistillLoss, MaxSimLoss, maxsim_distill_loss, maxsim_loss, maxsim_scores
from .losses.neighbor import NeighborLoss, neighbor_loss, sample_neighbors
from .losses.nt_xent import NTXentLoss, nt_xent_loss
from .losses.self_distill import DINOLoss, dino_loss, prototype_center
from .losses.supcon import SupConLoss, supcon_loss
from .losses.swav import SwAVLoss, swav_loss
from .losses.triplet import TripletLoss, triplet_loss
from .runner import AUTO_TILED_MIN_ENTRIES
from .tools.doctor import doctor
from .training import metrics
from .training.cached import cached_step
from .training.memory import MemoryBank
from .training.scale import LogitScale

#: where each module of the flat layout went (``flashcl.heads`` is
#: ``flashcl.engine.heads``, ``flashcl.backends`` is part of ``flashcl.runner``): the
#: old import paths keep working
MOVED = {
    **{name: f"flashcl.losses.{name}" for name in ("clip", "cosent", "distill", "gist", "info_nce", "margin")},
    **{name: f"flashcl.losses.{name}" for name in ("multilabel", "neighbor", "nt_xent", "supcon", "triplet")},
    **{name: f"flashcl.engine.{name}" for name in ("heads", "positives", "tiled", "panels", "stripes", "scores")},
    **{name: f"flashcl.engine.{name}" for name in ("threads", "matryoshka")},
    "estimators": "flashcl.engine.family_heads",
    **{name: f"flashcl.training.{name}" for name in ("memory", "cached", "scale", "metrics")},
    **{name: "flashcl.runner" for name in ("backends", "reduction")},
    "lowering": "flashcl.engine.positives",
    "dispatch": "flashcl.checks",  # its checks; its runner functions are flashcl.functional's
    "utils": "flashcl.engine.engine",
    "tile": "flashcl.core",
    "ring": "flashcl.parallel.ring",
    "procmem": "flashcl.tools.procmem",
    "doctor": "flashcl.tools.doctor",
    "doctor_families": "flashcl.tools.families",
}


class _Moved(_abc.MetaPathFinder, _abc.Loader):
    """Imports ``flashcl.<old name>`` as the module it became (see :data:`MOVED`)."""

    def find_spec(self, fullname: str, path: _Any, target: _Any = None) -> _Optional[_Any]:
        prefix, _, name = fullname.partition(".")
        if prefix != "flashcl" or name not in MOVED:
            return None
        return _util.spec_from_loader(fullname, self)

    def create_module(self, spec: _Any) -> _Any:
        module = _importlib.import_module(MOVED[spec.name.partition(".")[2]])
        spec.loader_state = module.__spec__  # the import machinery sets the alias's spec on it
        return module

    def exec_module(self, module: _Any) -> None:
        module.__spec__ = module.__spec__.loader_state


if not any(isinstance(f, _Moved) for f in _sys.meta_path):
    _sys.meta_path.append(_Moved())
for _old, _new in MOVED.items():  # those loaded already: no import sets them over a name (flashcl.doctor)
    if _new in _sys.modules:
        _sys.modules.setdefault(f"flashcl.{_old}", _sys.modules[_new])


__version__ = "0.2.0.dev0"

#: every registered loss and Module twin (flashcl.registry.publish adds them, also
#: those registered later), then the tools
__all__ = [
    "sample_neighbors",
    "maxsim_scores",
    "sample_classes",
    "prototype_center",
    "flex_dense_mask",
    "flex_block_mask",
    "BlockMask",
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
    """A loss or Module registered after import (typed for static checkers), or a
    module by its old name (:data:`MOVED`)."""
    if name in MOVED:
        return _importlib.import_module(MOVED[name])
    return registry.lookup(__name__, name, ("function", "module"))
