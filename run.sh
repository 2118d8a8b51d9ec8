#!/usr/bin/env bash
# Sets up .venv (torch 2.13.0 CPU when no torch is installed, then flashcl with
# its extras) and runs the benchmark (`./run.sh bench [args]`) or the linter and
# the tests (`./run.sh test [pytest args]`).
set -euo pipefail
cd "$(dirname "$0")"
venv="${FLASHCL_VENV:-.venv}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
py="$venv/bin/python"
# A plain torch requirement with no torch present would pull a multi-GB CUDA
# build; `pip install torch==2.13.0` takes the CPU build where the index provides one, and torch>=2.4 accepts it.
"$py" -c "import torch" 2>/dev/null || "$py" -m pip install -q torch==2.13.0
"$py" -m pip install -q -e ".[test,integrations,bench,triton]"
# open_clip's loss module is a peer in the benchmark and an oracle in the tests;
# its package depends on torchvision, which does not import beside a CPU-only torch
# build, so it is installed without dependencies (optional: skipped if unavailable).
"$py" -c "import open_clip" 2>/dev/null || "$py" -m pip install -q --no-deps open_clip_torch \
  || echo "open_clip_torch not installed: its benchmark and test cases will say so"
cmd="${1:-test}"
shift || true
case "$cmd" in
  test) "$py" -m ruff check src tests examples scripts conftest.py && exec "$py" -m pytest "$@" ;;
  bench) exec "$py" -m flashcl bench "$@" ;;
  *) echo "usage: ./run.sh test|bench [args]" >&2; exit 2 ;;
esac
