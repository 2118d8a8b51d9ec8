"""Optional peer libraries, loaded where installed; None (with the reason) where not."""
from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Any, Optional, Tuple


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
