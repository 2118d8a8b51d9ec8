"""mkdocs hook: the math of the pages and the docstrings (``$$ ... $$``, ``\\( ... \\)``,
marked by pymdownx.arithmatex) rendered to MathML when the site is built, so that the
pages need no script from elsewhere to show it."""

from __future__ import annotations

import html
import re
from typing import Any

from latex2mathml.converter import convert

_BLOCK = re.compile(r'<div class="arithmatex">\s*\\\[(.*?)\\\]\s*</div>', re.S)
_INLINE = re.compile(r'<span class="arithmatex">\\\((.*?)\\\)</span>', re.S)


def _mathml(tex: str, display: str) -> str:
    return convert(html.unescape(tex).strip(), display=display)


def on_page_content(content: str, **kwargs: Any) -> str:
    content = _BLOCK.sub(lambda m: _mathml(m.group(1), "block"), content)
    return _INLINE.sub(lambda m: _mathml(m.group(1), "inline"), content)
