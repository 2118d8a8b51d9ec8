#!/usr/bin/env bash
# Sets up .venv (torch 2.13.0 CPU when no torch is installed, then flashcl with the
# extras the command needs) and runs the benchmark (`./run.sh bench [args]`) or the
# linter and the tests (`./run.sh test [pytest args]`).
# `./run.sh test-floor [pytest args]` runs the tests on the declared floor (Python 3.9,
# torch 2.4.1) in .venv-floor: a python3.9 on PATH or pyenv's, and a download of torch.
# `./run.sh package` builds the wheel and the sdist and installs the wheel into a fresh
# environment (scripts/check_package.sh); `./run.sh docs` builds the documentation
# site into site/ (mkdocs, strict). CI (.ci/run) runs the package check after the tests.
set -euo pipefail
cd "$(dirname "$0")"
cmd="${1:-test}"
shift || true
base_python=python3
torch_pin=torch==2.13.0
venv="${FLASHCL_VENV:-.venv}"
if [ "$cmd" = test-floor ]; then
  venv=.venv-floor
  torch_pin=torch==2.4.1
  # a pyenv shim named python3.9 may fail to run: take an interpreter that answers
  base_python=""
  for candidate in python3.9 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.9*/bin/python3.9; do
    if "$candidate" -c "import sys; assert sys.version_info[:2] == (3, 9)" 2>/dev/null; then
      base_python="$candidate"; break
    fi
  done
  [ -n "$base_python" ] || { echo "test-floor needs a python3.9 (on PATH or in pyenv)" >&2; exit 2; }
fi
[ -x "$venv/bin/python" ] || "$base_python" -m venv "$venv"
py="$venv/bin/python"
# A plain torch requirement with no torch present would pull a multi-GB CUDA
# build; `pip install torch==2.13.0` takes the CPU build where the index provides one, and torch>=2.4 accepts it.
"$py" -c "import torch" 2>/dev/null || "$py" -m pip install -q "$torch_pin"
# What each command needs: the default benchmark only its peers and plots (bench);
# the suites that train a sentence encoder (train, beyond) or run on a GPU (gpu)
# add their extras when asked for; the tests take every peer they compare with.
case "$cmd" in
  test) extras="test,integrations,bench,triton,docs" ;;
  package) extras="test" ;;
  docs) extras="docs" ;;
  test-floor)  # the package, its test tools and the benchmark peers; numpy 1 beside torch 2.4
    "$py" -m pip install -q -e ".[test,bench]" "numpy<2"
    exec "$py" -m pytest -p no:cacheprovider "$@" ;;
  bench)
    extras="bench"
    case " $* " in *" --full "*|*train*|*beyond*) extras="$extras,integrations" ;; esac
    case " $* " in *gpu*|*cuda*) extras="$extras,triton" ;; esac
    ;;
  *) echo "usage: ./run.sh test|test-floor|bench|package|docs [args]" >&2; exit 2 ;;
esac
"$py" -m pip install -q -e ".[$extras]"
# Peers whose loss files serve as oracles in the tests and as peers in the benchmark, installed
# without their dependencies, in one pip call for those missing (optional: each one that cannot
# be installed is named, and its benchmark and test cases say so):
# - open_clip: its package depends on torchvision, which does not import beside a CPU-only torch
#   build; its loss module needs only torch.
# - pylate and colpali-engine (late interaction, the tests and the late-interaction benchmark):
#   their packages pin older sentence-transformers / transformers and pull torchvision; their
#   losses need only torch and what the integrations extra brings.
# - lightly and DINOv2 (self-distillation, the tests and the ssl benchmark): their packages import
#   torchvision (lightly) or pin old torch (dinov2); their loss files need only torch.
peers="open_clip:open_clip_torch pylate:pylate==1.6.0 colpali_engine:colpali-engine==0.3.18"
if [ "$cmd" = test ] || case " $* " in *ssl*|*" --full "*) true ;; *) false ;; esac; then
  peers="$peers lightly:lightly==1.6.0 dinov2:dinov2==0.0.1.dev2"
fi
missing=$("$py" -c "
import importlib.util as u, sys
print(' '.join(r for m, r in (p.split(':', 1) for p in sys.argv[1:]) if u.find_spec(m) is None))
" $peers)
if [ -n "$missing" ]; then
  # shellcheck disable=SC2086
  "$py" -m pip install -q --no-deps $missing 2>/dev/null || for req in $missing; do
    "$py" -m pip install -q --no-deps "$req" || echo "$req not installed: its benchmark and test cases will say so"
  done
fi
case "$cmd" in
  test)
    "$py" -m ruff check src tests examples scripts conftest.py
    "$py" -m ruff format --check src tests examples scripts conftest.py
    # the type check beside the suite (it keeps one core busy for about a minute while the
    # workers start and collect); its report follows the suite's and fails the command
    typecheck=$(mktemp)
    "$py" -m mypy >"$typecheck" 2>&1 &
    mypy_pid=$!
    # the suite on every core (pytest-xdist), a test file's tests in one worker (its module fixtures
    # built once); the documentation site's strict build is one of its tests (tests/test_docs_site.py)
    status=0
    "$py" -m pytest -n auto --dist loadfile "$@" || status=$?
    mypy_status=0
    wait "$mypy_pid" || mypy_status=$?
    cat "$typecheck"
    rm -f "$typecheck"
    [ "$mypy_status" = 0 ] || { echo "mypy failed" >&2; [ "$status" != 0 ] || status=$mypy_status; }
    exit "$status" ;;
  package) PYTHON="$py" exec bash scripts/check_package.sh ;;
  docs) NO_MKDOCS_2_WARNING=1 exec "$py" -m mkdocs build --strict "$@" ;;
  bench) exec "$py" -m flashcl bench "$@" ;;
esac
