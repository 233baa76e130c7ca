#!/usr/bin/env bash
# The checks a session lent a GPU runs in one call (issue 41), records under $OUT (default /tmp/otb_gpu):
#   env.txt                  the GPU, driver, torch, transformers, triton, the commit
#   grad_norms.jsonl         benchmarks/grad_norms.py --gpu: one-pass norms vs the ordinary pass (wall, paired, busy)
#   cuda_tests.log/.jsonl    tests/test_cuda_paths.py and the compiled fused proxy's CUDA tests; their measurements
#   grad_norms_before.jsonl  the norms cases again with the otb_ref in $OTB_REF_BEFORE (e.g. the previous commit's
#                            package), when that folder exists: a fix measured against its baseline in one call
#   gpu_train_step.jsonl     with GENERATION_05B=1: gpu_train_step.py's 0.5B generation cases (GENERATION_CASES,
#                            default: qwen05b_eos_reachable_drop then qwen05b_eos_reachable); with
#                            TRAIN_STEP_VARIANT=micro32 (say): that train_step variant (MFU under three counts)
#   decode_breakdown.jsonl   with DECODE=1: gpu_train_paths.py --only decode (a 0.5B decode step, part by part)
#   grad_norms_profile.jsonl with PROFILE=1: the first case's profile (device and host time, launches, syncs)
# Options: NORMS_ONLY / BEFORE_ONLY (full | chunked; BEFORE_ONLY defaults to chunked), NORMS_PAIRS (default 7).
# Time: the stages run in this order (issue 41's priority), each under its own limit (NORMS_TIMEOUT 240,
# TESTS_TIMEOUT 120, BEFORE_TIMEOUT 200, GENERATION_TIMEOUT 400, DECODE_TIMEOUT 120, PROFILE_TIMEOUT 90,
# TRAIN_STEP_TIMEOUT 200 seconds) and all under one deadline, BUDGET seconds from the start (default 540: a device
# command runs 600 s at most): a stage gets the smaller of its limit and what is left, and is skipped with under
# 30 s left. The exit status is the number of stages that failed, timed out or were skipped.
# Usage (from the repository root, on the GPU machine): OTB_REF_COMMIT=$(git rev-parse HEAD) benchmarks/gpu_device_checks.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/otb_gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
DEADLINE=$((SECONDS + ${BUDGET:-540}))
FAILED=0

# limit NAME SECONDS: sets LIMIT to the seconds the stage NAME may take now (0, counted and said, under 30 s left)
limit() {
    local left=$((DEADLINE - SECONDS))
    if ((left < 30)); then
        echo "gpu_device_checks: $1 skipped, ${left} s left of BUDGET" >&2
        FAILED=$((FAILED + 1))
        LIMIT=0
    elif (($2 < left)); then LIMIT=$2; else LIMIT=$left; fi
}

# stage NAME SECONDS COMMAND...: run COMMAND under the stage's limit; count a failure or a timeout
stage() {
    local name=$1 status
    limit "$1" "$2"
    shift 2
    ((LIMIT > 0)) || return 0
    timeout "$LIMIT" "$@"
    status=$?
    if ((status != 0)); then
        echo "gpu_device_checks: $name exited $status (124: its time ran out)" >&2
        FAILED=$((FAILED + 1))
    fi
}

{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)"
    echo "commit ${OTB_REF_COMMIT:-unknown}, $(date -u +%Y-%m-%dT%H:%MZ)"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
NORMS=(--gpu --loop-rows 2 --pairs "${NORMS_PAIRS:-7}")
stage norms "${NORMS_TIMEOUT:-240}" python3 benchmarks/grad_norms.py "${NORMS[@]}" ${NORMS_ONLY:+--only $NORMS_ONLY} \
    > "$OUT/grad_norms.jsonl"
cat "$OUT/grad_norms.jsonl"
# The machine's transformers/torch may warn of deprecations the CI versions do not: reported, not failed, here.
OTB_REF_RECORDS=$OUT/cuda_tests.jsonl stage tests "${TESTS_TIMEOUT:-120}" python3 -m pytest -q -p no:cacheprovider -rs \
    -W "default::DeprecationWarning" -W "default::FutureWarning" \
    tests/test_cuda_paths.py tests/test_otb_ref/test_proxy_fused.py -k "cuda" > "$OUT/cuda_tests.log" 2>&1
tail -n 25 "$OUT/cuda_tests.log"
if [ -d "${OTB_REF_BEFORE:-/nonexistent}/otb_ref" ]; then
    PYTHONPATH=$OTB_REF_BEFORE:$PWD stage before "${BEFORE_TIMEOUT:-200}" python3 benchmarks/grad_norms.py "${NORMS[@]}" \
        --only "${BEFORE_ONLY:-chunked}" > "$OUT/grad_norms_before.jsonl"
    cat "$OUT/grad_norms_before.jsonl"
fi
# Item 3's generation at the 0.5B shape (V = 151,936, EOS reachable, mixed prompt lengths), when asked for.
if [ -n "${GENERATION_05B:-}" ]; then
    cases=${GENERATION_CASES:-qwen05b_eos_reachable_drop qwen05b_eos_reachable}  # the new one first
    limit generation "${GENERATION_TIMEOUT:-400}"
    seconds=$LIMIT
    if ((seconds > 0)); then
        # shellcheck disable=SC2086 # the cases are words
        stage generation "$seconds" python3 benchmarks/gpu_train_step.py --only generation --generation $cases \
            --case-timeout "$(((seconds - 15) / $(echo "$cases" | wc -w)))" --out "$OUT/gpu_train_step.jsonl" \
            > "$OUT/generation.log" 2>&1
        grep '^{' "$OUT/generation.log"
    fi
fi
# Where a 0.5B decode step's time goes (decoder, float64/float32 sampler, EOS test), when asked for.
if [ -n "${DECODE:-}" ]; then
    stage decode "${DECODE_TIMEOUT:-120}" python3 benchmarks/gpu_train_paths.py --only decode > "$OUT/decode_breakdown.jsonl"
    cat "$OUT/decode_breakdown.jsonl"
fi
# The one-pass norms' profile (device time, host time, launches and syncs of the first case), when asked for.
if [ -n "${PROFILE:-}" ]; then
    stage profile "${PROFILE_TIMEOUT:-90}" python3 benchmarks/grad_norms.py --gpu --profile > "$OUT/grad_norms_profile.jsonl"
fi
# Item 3's update MFU under three counts (6N, PaLM, torchtitan): one train_step variant, when asked for.
if [ -n "${TRAIN_STEP_VARIANT:-}" ]; then
    limit train_step "${TRAIN_STEP_TIMEOUT:-200}"
    seconds=$LIMIT
    if ((seconds > 0)); then
        stage train_step "$seconds" python3 benchmarks/gpu_train_step.py --only train_step \
            --variants "$TRAIN_STEP_VARIANT" --case-timeout "$((seconds - 20))" --out "$OUT/gpu_train_step.jsonl" \
            > "$OUT/train_step.log" 2>&1
        grep '^{' "$OUT/train_step.log"
    fi
fi
echo "gpu_device_checks: $FAILED stage(s) failed, timed out or skipped; $((DEADLINE - SECONDS)) s of BUDGET left"
exit "$FAILED"
