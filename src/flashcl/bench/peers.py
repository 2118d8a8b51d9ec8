"""Optional peer libraries, loaded where installed; None (with the reason) where not."""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Any, Dict, Optional, Tuple


def pml_losses() -> Tuple[Optional[Any], str]:
    """pytorch-metric-learning's ``losses`` module."""
    try:
        return importlib.import_module("pytorch_metric_learning.losses"), ""
    except ImportError as e:
        return None, f"pytorch-metric-learning not installed ({e})"


def open_clip_loss_module() -> Tuple[Optional[Any], str]:
    """open_clip's ``loss.py``, loaded from its file: the package's ``__init__``
    needs torchvision, which does not import beside the CPU torch here, but the
    loss module needs only torch."""
    spec = importlib.util.find_spec("open_clip")
    if spec is None or not spec.submodule_search_locations:
        return None, "open_clip_torch not installed"
    path = os.path.join(list(spec.submodule_search_locations)[0], "loss.py")
    if not os.path.exists(path):
        return None, f"open_clip has no loss.py at {path}"
    file_spec = importlib.util.spec_from_file_location("_open_clip_loss", path)
    assert file_spec is not None and file_spec.loader is not None
    module = importlib.util.module_from_spec(file_spec)
    try:
        file_spec.loader.exec_module(module)
    except ImportError as e:
        return None, f"open_clip's loss.py does not import here ({e})"
    return module, ""


def sentence_transformers_losses() -> Tuple[Optional[Any], str]:
    try:
        try:  # sentence-transformers >= 6; the top-level ``losses`` is a deprecated alias there
            return importlib.import_module("sentence_transformers.sentence_transformer.losses"), ""
        except ImportError:
            return importlib.import_module("sentence_transformers.losses"), ""
    except Exception as e:  # ImportError, or a broken optional dependency
        return None, f"sentence-transformers not importable ({type(e).__name__}: {str(e)[:80]})"


def sentence_transformers_gist(**config: Any) -> Tuple[Optional[Any], str]:
    """sentence-transformers' ``GISTEmbedLoss`` as a function of embeddings,
    ``fn(embeddings, guide_embeddings) -> loss``: its own ``forward`` (masks,
    cross-entropy) with the model and guide passes replaced by the given tensors.
    ``config``: temperature, margin, margin_strategy, contrast_anchors, contrast_positives."""
    try:
        module = importlib.import_module("sentence_transformers.sentence_transformer.losses.gist_embed")
    except Exception as e:  # ImportError, a broken optional dependency, sentence-transformers < 6
        return None, f"sentence-transformers >= 6 not importable ({type(e).__name__}: {str(e)[:80]})"
    import torch

    def fn(embeddings: Any, guides: Any) -> Any:
        loss = module.GISTEmbedLoss.__new__(module.GISTEmbedLoss)
        torch.nn.Module.__init__(loss)
        loss.model = loss.guide = None
        loss.temperature = config.get("temperature", 0.01)
        loss.similarity_fct = torch.nn.CosineSimilarity(dim=-1)
        loss.margin_strategy = config.get("margin_strategy", "absolute")
        loss.margin = config.get("margin", 0.0)
        loss.contrast_anchors = config.get("contrast_anchors", True)
        loss.contrast_positives = config.get("contrast_positives", True)
        loss.gather_across_devices = False
        loss.must_retokenize = False
        loss.cross_entropy_loss = torch.nn.CrossEntropyLoss()
        passes = iter([list(embeddings), list(guides)])
        original = getattr(module, "embed_columns")  # noqa: B009 - a module attribute replaced for the call
        setattr(module, "embed_columns", lambda model, features: next(passes))  # noqa: B010
        try:
            return loss.forward([{} for _ in embeddings], None)
        finally:
            setattr(module, "embed_columns", original)  # noqa: B010

    return fn, ""


def _load(name: str, path: str) -> Any:
    """The module in the file ``path``, loaded as ``name`` (not entered in sys.modules)."""
    file_spec = importlib.util.spec_from_file_location(name, path)
    assert file_spec is not None and file_spec.loader is not None
    module = importlib.util.module_from_spec(file_spec)
    file_spec.loader.exec_module(module)
    return module


def _restore(saved: Dict[str, Any]) -> None:
    """sys.modules' entries as they were (None: absent) before a peer's files were loaded."""
    import sys

    for name, module in saved.items():
        if module is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = module


def colpali_loss_module() -> Tuple[Optional[Any], str]:
    """colpali-engine's ``loss/late_interaction_losses.py``, loaded from its file with
    its ``utils/maxsim.py`` (the package's ``__init__`` imports its models, whose image
    processors need torchvision; the losses need only torch), on its pure-torch
    scoring path (``COLPALI_SCORES_BACKEND="torch"``; its kernel path needs a GPU)."""
    import sys
    import types

    spec = importlib.util.find_spec("colpali_engine")
    if spec is None or not spec.submodule_search_locations:
        return None, "colpali-engine not installed"
    root = list(spec.submodule_search_locations)[0]
    paths = {
        name: os.path.join(root, *name.split(".")[1:]) + ".py"
        for name in ("x.utils.maxsim", "x.loss.late_interaction_losses")
    }
    if not all(os.path.exists(p) for p in paths.values()):
        return None, f"colpali-engine has no {' / '.join(paths.values())}"

    names = ("colpali_engine", "colpali_engine.utils", "colpali_engine.utils.maxsim")
    saved = {name: sys.modules.get(name) for name in names}
    try:
        maxsim = _load("_colpali_maxsim", paths["x.utils.maxsim"])
        maxsim._resolve_backend = lambda: "torch"
        for name in names[:2]:  # the packages as bare namespaces while the losses import
            sys.modules[name] = types.ModuleType(name)
        sys.modules[names[2]] = maxsim
        return _load("_colpali_losses", paths["x.loss.late_interaction_losses"]), ""
    except ImportError as e:
        return None, f"colpali-engine's losses do not import here ({e})"
    finally:
        _restore(saved)


def lightly_ssl_losses() -> Tuple[Optional[Any], str]:
    """lightly's self-distillation losses (``DINOLoss``, ``IBOTPatchLoss``, ``IBOTPlusPlusPatchLoss``, ``KoLeoLoss``,
    ``SwaVLoss``), each loaded from its file with ``models/modules/center.py`` (the
    package's ``loss`` and ``models`` import torchvision; these files need only torch),
    as one namespace."""
    import sys
    import types

    spec = importlib.util.find_spec("lightly")
    if spec is None or not spec.submodule_search_locations:
        return None, "lightly not installed"
    root = list(spec.submodule_search_locations)[0]
    files = {
        "center": os.path.join(root, "models", "modules", "center.py"),
        **{
            name: os.path.join(root, "loss", f"{name}.py")
            for name in ("dino_loss", "ibot_loss", "koleo_loss", "swav_loss")
        },
    }
    if not all(os.path.exists(p) for p in files.values()):
        return None, f"lightly has no {' / '.join(files.values())}"

    names = ("lightly", "lightly.models", "lightly.models.modules", "lightly.models.modules.center")
    saved = {name: sys.modules.get(name) for name in names}
    try:
        center = _load("_lightly_center", files["center"])
        for name in names[:3]:  # the packages as bare namespaces while the losses import
            sys.modules[name] = types.ModuleType(name)
        sys.modules[names[2]].center = center  # type: ignore[attr-defined]
        sys.modules[names[3]] = center
        out = types.SimpleNamespace(center=center)
        for name in ("dino_loss", "ibot_loss", "koleo_loss", "swav_loss"):
            module = _load(f"_lightly_{name}", files[name])
            for attr in ("DINOLoss", "IBOTPatchLoss", "IBOTPlusPlusPatchLoss", "KoLeoLoss", "SwaVLoss", "sinkhorn"):
                if hasattr(module, attr):
                    setattr(out, attr, getattr(module, attr))
        return out, ""
    except ImportError as e:
        return None, f"lightly's losses do not import here ({e})"
    finally:
        _restore(saved)


def lightly_heads() -> Tuple[Optional[Any], str]:
    """lightly's ``models/modules/heads.py`` (``DINOProjectionHead``,
    ``DINOv2ProjectionHead``, ...), loaded from its file with its one import of
    ``lightly.models.utils`` (which needs torchvision) standing in for by the two
    functions the heads call, torch's ``trunc_normal_`` for its copy of it and its
    ``normalize_weight``."""
    import sys
    import types

    import torch

    spec = importlib.util.find_spec("lightly")
    if spec is None or not spec.submodule_search_locations:
        return None, "lightly not installed"
    path = os.path.join(list(spec.submodule_search_locations)[0], "models", "modules", "heads.py")
    if not os.path.exists(path):
        return None, f"lightly has no {path}"
    utils = types.ModuleType("lightly.models.utils")
    utils._no_grad_trunc_normal = lambda tensor, mean, std, a, b: torch.nn.init.trunc_normal_(  # type: ignore[attr-defined]
        tensor, mean, std, a, b
    )
    utils.normalize_weight = lambda weight, dim=1, keepdim=True: weight.div_(  # type: ignore[attr-defined]
        torch.norm(weight, dim=dim, keepdim=keepdim)
    )
    names = ("lightly", "lightly.models", "lightly.models.utils")
    saved = {name: sys.modules.get(name) for name in names}
    try:
        for name in names[:2]:  # the packages as bare namespaces while the heads import
            sys.modules[name] = types.ModuleType(name)
        sys.modules[names[1]].utils = utils  # type: ignore[attr-defined]
        sys.modules[names[2]] = utils
        return _load("_lightly_heads", path), ""
    except ImportError as e:
        return None, f"lightly's heads do not import here ({e})"
    finally:
        _restore(saved)
