#!/usr/bin/env bash
# The checks that need a CUDA GPU (a development tool), under 8 minutes with the default limits,
# in the order of priority (a run cut short keeps what came first): `scripts/device_check.sh
# checks`, then `scripts/device_check.sh bench` (no argument: both; `extra`: the Triton launch
# configurations and kernel statistics, two ranks on one GPU). Every step writes its rows to
# $OUT as it goes, so a run stopped part-way keeps them.
# checks (about 3 minutes):
#   env.txt: the GPU, torch, triton;
#   check.txt: flashcl check --device cuda (every loss's backends and dtypes against the
#     float64 reference, as a user runs it; half precision narrower than the kernels take is
#     guarded);
#   pytest.txt: tests/test_cuda.py (every backend and dtype on the GPU against the float64
#     reference, D in {64, 256, 768, 1000, 2048, 4096}, the stripes eager and with the fused
#     stripe kernels, two processes sharing the GPU);
# bench (about 5 minutes):
#   gpu/rows.jsonl, report.md: flashcl bench --suite gpu (the stripes with the fused stripe
#     kernels and eager, the Triton kernels, Inf-CL, open_clip, against the cuBLAS GEMMs,
#     B in {32,768, 131,072}, D in {768, 4096, 256, 1024});
#   losses/rows.jsonl, report.md: flashcl bench --suite gpu-losses (a batch of 1,048,576,
#     flex losses against the built-ins, queue, Matryoshka, GIST, late interaction, DINO /
#     iBOT, CosFace).
# extra:
#   kernel-stats.jsonl: registers, spills and wgmma of the compiled Triton kernels;
#   configs.jsonl / configs.json: the Triton launch configurations, timed;
#   two-process.jsonl: scripts/gpu_two_process.py (two ranks on one GPU against one process).
# Peers missing on the GPU machine travel as wheels in .whl/ (installed with --no-deps into
# /tmp/site). Time limits per step (seconds): CHECK_S, TEST_S, BENCH_S, LOSSES_S, STATS_S,
# CONFIG_S, TWO_S.
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
  step check "${CHECK_S:-60}" bash -c "python3 -m flashcl check --device cuda > '$out/check.txt' 2>&1; \
    tail -5 '$out/check.txt'; grep -E 'FAIL|error|fallback' '$out/check.txt' | head -30"
  step tests "${TEST_S:-120}" bash -c "python3 -m pytest tests/test_cuda.py -q -p no:cacheprovider -n 4 \
    --maxfail=30 -rfE 2>&1 | tee '$out/pytest.txt' | tail -40"
fi
if [ "$stage" = bench ] || [ "$stage" = all ]; then
  step bench "${BENCH_S:-200}" bash -c "python3 -m flashcl bench --suite gpu --device cuda --cap 30 \
    --out '$out/gpu' 2>&1 | grep -v 'case/s' | tail -40"
  slim "$out/gpu"
  step losses "${LOSSES_S:-90}" bash -c "python3 -m flashcl bench --suite gpu-losses --device cuda \
    --out '$out/losses' 2>&1 | grep -v 'case/s' | tail -45"
  slim "$out/losses"
fi
if [ "$stage" = extra ]; then
  step stats "${STATS_S:-30}" python3 scripts/triton_kernel_stats.py --out "$out/kernel-stats.jsonl"
  step configs "${CONFIG_S:-55}" bash -c "python3 scripts/triton_configs.py --budget ${CONFIG_BUDGET_S:-45} \
    --json '$out/configs.json' 2>&1 | tee '$out/configs.jsonl' | tail -20"
  step two "${TWO_S:-40}" python3 scripts/gpu_two_process.py --out "$out/two-process.jsonl"
fi
