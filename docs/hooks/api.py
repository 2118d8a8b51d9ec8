"""mkdocs hook: the API reference's lists of losses and Modules follow from the
package's public names (``flashcl.__all__``, the import list of ``flashcl/__init__.py``):
a page's line ``<!-- public: losses -->`` becomes a ``::: flashcl.<name>`` entry for
every public function or class of a loss family (``flashcl.losses``) that is not a
Module, ``<!-- public: modules -->`` one for every loss Module, in the import list's
order (family by family)."""

from __future__ import annotations

import re
from typing import Any, List

_MARK = re.compile(r"^<!-- public: (losses|modules) -->$", re.M)


def _names(kind: str) -> List[str]:
    import flashcl
    from flashcl.base import LossModule

    out = []
    for name in flashcl.__all__:
        obj = getattr(flashcl, name)
        if not str(getattr(obj, "__module__", "")).startswith("flashcl.losses."):
            continue
        is_module = isinstance(obj, type) and issubclass(obj, LossModule)
        if is_module == (kind == "modules"):
            out.append(name)
    return out


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    return _MARK.sub(lambda m: "\n\n".join(f"::: flashcl.{n}" for n in _names(m.group(1))), markdown)
