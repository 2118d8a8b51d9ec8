#!/usr/bin/env bash
# The checks that need a CUDA GPU, as one run (a development tool):
#   1. tests/test_cuda.py: every backend on the GPU against the float64 reference;
#   2. scripts/triton_configs.py: the Triton launch configurations, timed;
#   3. flashcl bench --suite gpu --device cuda: triton, tiled, dense, open_clip and
#      Inf-CL against cuBLAS, bfloat16.
# Peers missing on the GPU machine travel as wheels in .whl/ (installed with
# --no-deps into /tmp/site). Results go to $OUT (default ./device-out).
set -u
export PYTHONUNBUFFERED=1
out="${OUT:-device-out}"
mkdir -p "$out"
cd "$(dirname "$0")/.."
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$out/env.txt"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
fi
export PYTHONPATH="$PWD/src:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
t0=$(date +%s)
timeout "${TEST_S:-170}" python3 -m pytest tests/test_cuda.py -q -p no:cacheprovider --maxfail=8 2>&1 \
  | tail -40 | tee "$out/pytest.txt"
echo "tests: $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
timeout "${CONFIG_S:-130}" python3 scripts/triton_configs.py --budget "${CONFIG_BUDGET_S:-100}" \
  --json "$out/configs.json" 2>&1 | tail -40
echo "configs: $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
timeout "${BENCH_S:-270}" python3 -m flashcl bench --suite gpu --device cuda --cap 40 --out "$out/bench" 2>&1 \
  | tail -60
echo "bench: $(( $(date +%s) - t0 )) s"
