"""flashcl's own options on a peer library's loss class: ``backend`` and ``block_size``,
checked when the loss is made (a bad value is refused there, not at its first call) and
part of its configuration (sentence-transformers writes ``get_config_dict`` into the
model card and the saved training arguments)."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from .. import checks

__all__ = ["FlashclOptions"]


class FlashclOptions:
    """A mixin for the drop-ins: :meth:`set_flashcl_options` checks and stores the options
    (``backends``: those the loss takes; ``config_keys``: those it has), and
    :meth:`get_config_dict` adds them to the peer's configuration. The class-level
    defaults serve instances made without ``__init__`` (as a peer's own tests make them)."""

    backend: str = "auto"
    block_size: Optional[int] = None
    backends: Tuple[str, ...] = checks.BACKENDS
    config_keys: Tuple[str, ...] = ("backend", "block_size")

    def set_flashcl_options(self, backend: str = "auto", block_size: Optional[int] = None) -> None:
        self.backend = checks.check_choice(backend, "backend", self.backends)
        checks.check_block(block_size)
        self.block_size = block_size

    def get_config_dict(self) -> Dict[str, Any]:
        parent = getattr(super(), "get_config_dict", None)
        config = dict(parent()) if parent is not None else {}
        config.update({key: getattr(self, key) for key in self.config_keys})
        return config
