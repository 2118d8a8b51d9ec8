#!/usr/bin/env bash
# The checks that need a CUDA GPU (a development tool), in two stages that each fit one short
# run: `scripts/device_check.sh checks`, then `scripts/device_check.sh bench` (no argument:
# both). Every step writes its rows to $OUT as it goes, so a run stopped part-way keeps them.
# checks:
#   env.txt: the GPU, torch, triton;
#   check.txt: flashcl check --device cuda (every loss's backends and dtypes against the
#     float64 reference, as a user runs it);
#   pytest.txt: tests/test_cuda.py (every backend and dtype on the GPU against the float64
#     reference, D in {64, 256, 768, 1000, 2048, 4096}, two processes sharing the GPU);
#   kernel-stats.jsonl: registers, spills and wgmma of the compiled Triton kernels;
#   configs.jsonl / configs.json: the Triton launch configurations, timed.
# bench:
#   gpu/rows.jsonl, report.md: flashcl bench --suite gpu (triton, the tiled backend's
#     tensor-core stripes, Inf-CL, open_clip, against the cuBLAS GEMMs);
#   two-process.jsonl: scripts/gpu_two_process.py (two ranks on one GPU against one process);
#   losses/rows.jsonl, report.md: flashcl bench --suite gpu-losses (a batch of 1,048,576,
#     flex losses, queue, Matryoshka, GIST, late interaction, DINO / iBOT, CosFace).
# Peers missing on the GPU machine travel as wheels in .whl/ (installed with --no-deps into
# /tmp/site). Time limits per step (seconds): CHECK_S, TEST_S, STATS_S, CONFIG_S, BENCH_S,
# TWO_S, LOSSES_S.
set -u
export PYTHONUNBUFFERED=1
stage="${1:-all}"
out="${OUT:-device-out}"
mkdir -p "$out"
cd "$(dirname "$0")/.."
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee -a "$out/env.txt"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
fi
export PYTHONPATH="$PWD/src:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
step() {  # name, seconds, command...
  local name=$1 limit=$2
  shift 2
  local t0 rc
  t0=$(date +%s)
  timeout "$limit" "$@"
  rc=$?
  echo "$name: $(( $(date +%s) - t0 )) s (limit $limit, exit $rc)" | tee -a "$out/steps.txt"
}
slim() {  # a bench folder: results.json once written (the report is printed; at most 8 files come back)
  [ -f "$1/results.json" ] && rm -f "$1/rows.jsonl" "$1/report.md" "$1"/*.png
}
if [ "$stage" = checks ] || [ "$stage" = all ]; then
  step check "${CHECK_S:-70}" bash -c "python3 -m flashcl check --device cuda > '$out/check.txt' 2>&1; \
    tail -5 '$out/check.txt'; grep -E 'FAIL|error|fallback' '$out/check.txt' | head -30"
  step tests "${TEST_S:-130}" bash -c "python3 -m pytest tests/test_cuda.py -q -p no:cacheprovider -n 4 \
    --maxfail=30 -rfE 2>&1 | tee '$out/pytest.txt' | tail -40"
  step stats "${STATS_S:-30}" python3 scripts/triton_kernel_stats.py --out "$out/kernel-stats.jsonl"
  step configs "${CONFIG_S:-55}" bash -c "python3 scripts/triton_configs.py --budget ${CONFIG_BUDGET_S:-45} \
    --json '$out/configs.json' 2>&1 | tee '$out/configs.jsonl' | tail -20"
fi
if [ "$stage" = bench ] || [ "$stage" = all ]; then
  step bench "${BENCH_S:-150}" bash -c "python3 -m flashcl bench --suite gpu --device cuda --cap 30 \
    --out '$out/gpu' 2>&1 | grep -v 'case/s' | tail -30"
  slim "$out/gpu"
  step two "${TWO_S:-40}" python3 scripts/gpu_two_process.py --out "$out/two-process.jsonl"
  step losses "${LOSSES_S:-150}" bash -c "python3 -m flashcl bench --suite gpu-losses --device cuda \
    --out '$out/losses' 2>&1 | grep -v 'case/s' | tail -45"
  slim "$out/losses"
fi
