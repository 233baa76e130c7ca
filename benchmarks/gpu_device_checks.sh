#!/usr/bin/env bash
# The checks a session lent a GPU runs in one call (issue 41, items 1-2), records under $OUT (default /tmp/otb_gpu):
#   env.txt                  the GPU, driver, torch, transformers, triton
#   grad_norms.jsonl         benchmarks/grad_norms.py --gpu: one-pass norms vs the ordinary pass (wall and GPU-busy)
#   cuda_tests.log/.jsonl    tests/test_cuda_paths.py and the compiled fused proxy's CUDA tests; their measurements
#   grad_norms_before.jsonl  the chunked-head cases again with the otb_ref in $OTB_REF_BEFORE (e.g. the previous
#                            commit's package), when that folder exists: a fix measured against its baseline in one run
#   gpu_train_step.jsonl     with GENERATION_05B=1: benchmarks/gpu_train_step.py's 0.5B generation case (EOS reachable);
#                            with TRAIN_STEP_VARIANT=micro32 (say): that train_step variant (MFU under three counts)
#   decode_breakdown.jsonl   with DECODE=1: gpu_train_paths.py --only decode (a 0.5B decode step, part by part)
#   grad_norms_profile.jsonl with PROFILE=1: the first case's profile (device and host time, launches, syncs)
# NORMS_ONLY / BEFORE_ONLY (full | chunked) pick the norms cases of each run (BEFORE_ONLY defaults to chunked).
# In priority order (issue 41); each stage has its own timeout (NORMS_TIMEOUT, TESTS_TIMEOUT, GENERATION_TIMEOUT, in
# seconds) so that one stuck stage cannot eat a lease of 15 minutes.
# Usage (from the repository root, on the GPU machine): OTB_REF_COMMIT=$(git rev-parse HEAD) benchmarks/gpu_device_checks.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/otb_gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)"
    echo "commit ${OTB_REF_COMMIT:-unknown}, $(date -u +%Y-%m-%dT%H:%MZ)"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
timeout "${NORMS_TIMEOUT:-300}" python3 benchmarks/grad_norms.py --gpu --loop-rows 2 --pairs "${NORMS_PAIRS:-7}" ${NORMS_ONLY:+--only $NORMS_ONLY} \
    2>&1 | tee "$OUT/grad_norms.jsonl"
# The machine's transformers/torch may warn of deprecations the CI versions do not: reported, not failed, here.
OTB_REF_RECORDS=$OUT/cuda_tests.jsonl timeout "${TESTS_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -rs \
    -W "default::DeprecationWarning" -W "default::FutureWarning" \
    tests/test_cuda_paths.py tests/test_otb_ref/test_proxy_fused.py -k "cuda" 2>&1 | tee "$OUT/cuda_tests.log"
if [ -d "${OTB_REF_BEFORE:-/nonexistent}/otb_ref" ]; then
    PYTHONPATH=$OTB_REF_BEFORE:$PWD timeout "${BEFORE_TIMEOUT:-200}" python3 benchmarks/grad_norms.py --gpu \
        --only "${BEFORE_ONLY:-chunked}" --loop-rows 2 2>&1 | tee "$OUT/grad_norms_before.jsonl"
fi
# Item 3's generation at the 0.5B shape (V = 151,936, EOS reachable, mixed prompt lengths), when asked for.
if [ -n "${GENERATION_05B:-}" ]; then
    cases=${GENERATION_CASES:-qwen05b_eos_reachable_drop qwen05b_eos_reachable}  # the new one first
    n=$(echo "$cases" | wc -w)
    timeout "${GENERATION_TIMEOUT:-400}" python3 benchmarks/gpu_train_step.py --only generation \
        --generation $cases --case-timeout "$(( (${GENERATION_TIMEOUT:-400} - 15) / n ))" \
        --out "$OUT/gpu_train_step.jsonl" 2>&1 | tail -n 20
fi
# Where a 0.5B decode step's time goes (decoder, float64/float32 sampler, bookkeeping), when asked for.
if [ -n "${DECODE:-}" ]; then
    timeout "${DECODE_TIMEOUT:-120}" python3 benchmarks/gpu_train_paths.py --only decode 2>&1 | tee "$OUT/decode_breakdown.jsonl"
fi
# The one-pass norms' profile (device time, host time, launches and syncs of the first case), when asked for.
if [ -n "${PROFILE:-}" ]; then
    timeout "${PROFILE_TIMEOUT:-60}" python3 benchmarks/grad_norms.py --gpu --profile > "$OUT/grad_norms_profile.jsonl" 2>&1
fi
# Item 3's update MFU under three counts (6N, PaLM, torchtitan): one train_step variant, when asked for.
if [ -n "${TRAIN_STEP_VARIANT:-}" ]; then
    timeout "${TRAIN_STEP_TIMEOUT:-200}" python3 benchmarks/gpu_train_step.py --only train_step \
        --variants "$TRAIN_STEP_VARIANT" --case-timeout "$((${TRAIN_STEP_TIMEOUT:-200} - 20))" \
        --out "$OUT/gpu_train_step.jsonl" 2>&1 | tail -n 20
fi
