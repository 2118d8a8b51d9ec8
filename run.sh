#!/usr/bin/env bash
# Sets up .venv (torch 2.13.0 CPU when no torch is installed, then flashcl with the
# extras the command needs) and runs the benchmark (`./run.sh bench [args]`) or the
# linter and the tests (`./run.sh test [pytest args]`).
set -euo pipefail
cd "$(dirname "$0")"
venv="${FLASHCL_VENV:-.venv}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
py="$venv/bin/python"
# A plain torch requirement with no torch present would pull a multi-GB CUDA
# build; `pip install torch==2.13.0` takes the CPU build where the index provides one, and torch>=2.4 accepts it.
"$py" -c "import torch" 2>/dev/null || "$py" -m pip install -q torch==2.13.0
cmd="${1:-test}"
shift || true
# What each command needs: the default benchmark only its peers and plots (bench);
# the suites that train a sentence encoder (train, beyond) or run on a GPU (gpu)
# add their extras when asked for; the tests take every peer they compare with.
case "$cmd" in
  test) extras="test,integrations,bench,triton" ;;
  bench)
    extras="bench"
    case " $* " in *" --full "*|*train*|*beyond*) extras="$extras,integrations" ;; esac
    case " $* " in *gpu*|*cuda*) extras="$extras,triton" ;; esac
    ;;
  *) echo "usage: ./run.sh test|bench [args]" >&2; exit 2 ;;
esac
"$py" -m pip install -q -e ".[$extras]"
# open_clip's loss module is a peer in the benchmark and an oracle in the tests;
# its package depends on torchvision, which does not import beside a CPU-only torch
# build, so it is installed without dependencies (optional: skipped if unavailable).
"$py" -c "import open_clip" 2>/dev/null || "$py" -m pip install -q --no-deps open_clip_torch \
  || echo "open_clip_torch not installed: its benchmark and test cases will say so"
case "$cmd" in
  test) "$py" -m ruff check src tests examples scripts conftest.py && "$py" -m mypy && exec "$py" -m pytest "$@" ;;
  bench) exec "$py" -m flashcl bench "$@" ;;
esac
