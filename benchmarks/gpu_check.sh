#!/usr/bin/env bash
# The GPU check, in parts (benchmarks/README.md, "On a GPU machine"):
#
#     bash benchmarks/gpu_check.sh LOGS
#
# Each part runs under its own time limit and writes LOGS/PART.log; a part that fails or runs
# out of time stops nothing after it. LOGS/summary.txt gets a line a part; the exit status is 1
# if any part failed. The limits sum to 450 s, so one short GPU session decides: the global
# BatchNorm first (what 8 GPUs run, checked on one), the compile tests last (the first a time
# limit would cut). PYTHON names the interpreter (default: python). Without a CUDA GPU every
# test skips, saying why, and the speed parts say that they did not run.
set -u
logs=${1:?usage: bash benchmarks/gpu_check.sh LOG_FOLDER}
mkdir -p "$logs"
cd "$(dirname "$0")/.."
python=${PYTHON:-python}
status=0

part() {  # NAME LIMIT_S COMMAND...: COMMAND's output to LOGS/NAME.log, its outcome to the summary
    local name=$1 limit=$2 start=$SECONDS code outcome
    shift 2
    timeout --kill-after=10 "$limit" "$@" > "$logs/$name.log" 2>&1
    code=$?
    case $code in
        0) outcome=passed ;;
        124 | 137) outcome="out of time ($limit s)" ;;
        *) outcome="failed (exit status $code)" ;;
    esac
    [ "$code" -eq 0 ] || status=1
    printf '%-14s %-28s %4d s  %s: %s\n' "$name" "$outcome" $((SECONDS - start)) \
        "$logs/$name.log" "$(tail -n 1 "$logs/$name.log")" | tee -a "$logs/summary.txt"
}

echo "GPU check, $(date '+%Y-%m-%d %H:%M'), git $(git rev-parse --short HEAD 2>/dev/null)" \
    | tee "$logs/summary.txt"
# 1. The global BatchNorm's CUDA path: at one process, and as one rank of two on one GPU (the
#    2-GPU tests: skipped on one GPU, saying so).
part batchnorm-tests 45 "$python" -m pytest -q -rs tests/test_cuda.py -k batchnorm
# 2. Each method's CUDA step against its CPU step, each main() for a short run on CUDA (host
#    syncs), a streamed folder, a continued run, the augmentation.
part cuda-tests 120 "$python" -m pytest -q -rs tests/test_cuda.py -k "not batchnorm and not compiled"
if "$python" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
    # 3. speed.py's method rows, ops tables and baselines; 4. its global BatchNorm rows.
    part speed 120 "$python" benchmarks/speed.py --device cuda --rows methods \
        --out "$logs/speed.md"
    part batchnorm 45 "$python" benchmarks/speed.py --device cuda --rows batchnorm \
        --out "$logs/batchnorm.md"
else
    echo "speed, batchnorm: not run, no CUDA GPU (torch.cuda.is_available() is False)" \
        | tee -a "$logs/summary.txt"
fi
# 5. The compile tests: each method's --compile run against eager, and the blur above 64 px.
part compile-tests 120 "$python" -m pytest -q -rs tests/test_cuda.py -k compiled
exit $status
