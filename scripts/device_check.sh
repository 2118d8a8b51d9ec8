#!/usr/bin/env bash
# The checks that need a CUDA GPU, as one run under 8 minutes (a development tool).
# Every step writes its rows to $OUT as it goes, so a run stopped part-way keeps them:
#   1. env.txt: the GPU, torch, triton;
#   2. pytest.txt: tests/test_cuda.py (every backend and dtype on the GPU against the
#      float64 reference, D in {64, 256, 768, 1000, 2048, 4096});
#   3. kernel-stats.jsonl: registers, spills and wgmma of the compiled Triton kernels;
#   4. configs.jsonl / configs.json: the Triton launch configurations, timed;
#   5. bench/rows.jsonl, report.md, gpu.png: flashcl bench --suite gpu (triton, the tiled
#      backend's tensor-core stripes, Inf-CL, open_clip, against the cuBLAS GEMMs).
# Peers missing on the GPU machine travel as wheels in .whl/ (installed with
# --no-deps into /tmp/site). Time limits per step: TEST_S, STATS_S, CONFIG_S, BENCH_S.
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
step() {  # name, seconds, command...
  local name=$1 limit=$2
  shift 2
  local t0
  t0=$(date +%s)
  timeout "$limit" "$@"
  echo "$name: $(( $(date +%s) - t0 )) s (limit $limit)" | tee -a "$out/steps.txt"
}
step tests "${TEST_S:-150}" bash -c "python3 -m pytest tests/test_cuda.py -q -p no:cacheprovider --maxfail=20 \
  2>&1 | tee '$out/pytest.txt' | tail -40"
step stats "${STATS_S:-40}" python3 scripts/triton_kernel_stats.py --out "$out/kernel-stats.jsonl"
step configs "${CONFIG_S:-70}" bash -c "python3 scripts/triton_configs.py --budget ${CONFIG_BUDGET_S:-55} \
  --json '$out/configs.json' 2>&1 | tee '$out/configs.jsonl' | tail -20"
step bench "${BENCH_S:-190}" python3 -m flashcl bench --suite gpu --device cuda --cap 30 --out "$out/bench"
tail -60 "$out/bench/report.md" 2>/dev/null || tail -20 "$out/bench/rows.jsonl"
