#!/usr/bin/env bash
# The package as users install it: builds the wheel and the sdist, checks both with
# twine, checks the wheel's contents (the package, py.typed, the licence; no tests),
# then installs the wheel into a fresh virtual environment that has only torch and
# runs the README's quickstart and `flashcl --help` there, outside the checkout.
# Called by `./run.sh test` (and `./run.sh package`).
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-.venv/bin/python}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$py" -m build --outdir "$work/dist" . > "$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
"$py" -m twine check --strict "$work"/dist/*
"$py" - "$work"/dist/*.whl <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
need = ["flashcl/__init__.py", "flashcl/py.typed", "flashcl/triton/kernels.py", "flashcl/integrations/open_clip.py"]
need += [f"flashcl/{p}/__init__.py" for p in ("losses", "engine", "parallel", "training", "tools")]
missing = [n for n in need if n not in names]
licences = [n for n in names if n.endswith((".dist-info/LICENSE", ".dist-info/licenses/LICENSE"))]
assert not missing, f"the wheel lacks {missing}"
assert licences, "the wheel carries no LICENSE"
assert not any(n.startswith("tests/") for n in names), "the wheel carries the tests"
print(f"wheel: {len(names)} files, py.typed and {licences[0]} included")
PY
base=$("$py" -c "import sys; print(getattr(sys, '_base_executable', sys.executable))")
"$base" -m venv "$work/venv"
torch_version=$("$py" -c "import torch; print(torch.__version__.split('+')[0])")
"$work/venv/bin/python" -m pip install -q "torch==$torch_version"
"$work/venv/bin/python" -m pip install -q "$work"/dist/*.whl
# the README's quickstart: its first python block, run where no source tree is on the path
"$py" - README.md > "$work/quickstart.py" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
print(re.search(r"## Quickstart.*?```python\n(.*?)```", text, re.S).group(1))
PY
(cd "$work" && "$work/venv/bin/python" quickstart.py && "$work/venv/bin/flashcl" --help > /dev/null)
"$work/venv/bin/python" -c "import flashcl, pathlib; p = pathlib.Path(flashcl.__file__); assert 'site-packages' in str(p), p; assert (p.parent / 'py.typed').exists(); print('fresh environment: flashcl', flashcl.__version__, 'from', p.parent)"
