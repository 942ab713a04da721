#!/usr/bin/env bash
# One-command GPU check: the throughput table of every method, a short pre-training on generated
# images, a 2-process torchrun run of every method when 2 or more GPUs are visible (NCCL,
# SyncBatchNorm, the all-gathers), then the test suite. Ends with a summary in Markdown to paste
# into benchmarks/README.md. Installs nothing, needs no network.
#
#   bash benchmarks/gpu_check.sh                      # CUDA machine: about 6-8 minutes in all
#   GPU_CHECK_DEVICE=cpu bash benchmarks/gpu_check.sh # dry run of every part on a CPU, tiny sizes
#
# Environment:
#   GPU_CHECK_DEVICE   cuda (default) or cpu; cpu = dry run: tiny sizes, torchrun with gloo
#   GPU_CHECK_BATCH    batch of the table and the pre-training (default 512)
#   GPU_CHECK_BUDGET   seconds for the whole check (default 480 on cuda, 1800 on cpu); each part
#                      gets at most what is left, the tests at least 60 s
#   GPU_CHECK_COMPILE  1: add a --compile table (its time-out or failure does not stop the rest)
#   GPU_CHECK_DIST     0: skip the torchrun runs; 1: run them (default: when >= 2 GPUs, or cpu)
#   GPU_CHECK_SKIP_TESTS  1: skip pytest
#   GPU_CHECK_OUT      output folder (default runs/gpu_check-<time>)
#   PYTHON             interpreter (default: python, else python3)
set -uo pipefail  # no -e: a part that fails or times out is reported and the others still run

cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$(command -v python || command -v python3 || true)}
if [[ -z "$PYTHON" ]]; then
  echo "error: neither python nor python3 is on PATH; set PYTHON" >&2
  exit 2
fi
DEVICE=${GPU_CHECK_DEVICE:-cuda}
BATCH=${GPU_CHECK_BATCH:-512}
OUT=${GPU_CHECK_OUT:-runs/gpu_check-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TORCH_HOME="$OUT/torch_home"  # nothing is fetched

if [[ "$DEVICE" == cuda ]]; then
  GPUS=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
  if [[ "$GPUS" == 0 ]]; then
    echo "error: no CUDA GPU visible to $PYTHON; CPU dry run: GPU_CHECK_DEVICE=cpu bash $0" >&2
    exit 2
  fi
  BUDGET=${GPU_CHECK_BUDGET:-480}
  TABLE_ARGS=(--batch-size "$BATCH" --steps 20)
  IMAGES=2500 SIZE=32
  TRAIN_ARGS=(--image-size 32 --batch-size "$BATCH" --epochs 5 --linear-epochs 20 --workers 8)
  DIST_ARGS=(--image-size 32 --batch-size 256 --epochs 2 --linear-epochs 5 --workers 4)
  TABLE_LIMIT=180 COMPILE_LIMIT=240 TRAIN_LIMIT=120 DIST_LIMIT=90
  DIST=${GPU_CHECK_DIST:-$([[ "$GPUS" -ge 2 ]] && echo 1 || echo 0)}
else  # dry run: every part at tiny sizes, the 2-process runs on gloo
  GPUS=0
  BUDGET=${GPU_CHECK_BUDGET:-1800}
  TABLE_ARGS=(--width 8 --step-image-size 16 --batch-size 32 --steps 2 --warmup 1
              --loss-batches 256 512 --aug-batch 256 --pil-images 1024 --reps 1)
  IMAGES=64 SIZE=16
  TRAIN_ARGS=(--width 8 --image-size 16 --batch-size 32 --epochs 2 --linear-epochs 2 --workers 2)
  DIST_ARGS=(--width 8 --image-size 16 --batch-size 32 --epochs 1 --linear-epochs 2 --workers 1)
  TABLE_LIMIT=600 COMPILE_LIMIT=600 TRAIN_LIMIT=300 DIST_LIMIT=300
  DIST=${GPU_CHECK_DIST:-1}
fi
START=$(date +%s)
DEADLINE=$(( START + BUDGET ))
STATUS=()  # one line per part, for the summary

# part NAME LIMIT COMMAND...: run COMMAND under `timeout` (LIMIT, or what is left of the budget,
# at least MIN_LIMIT), stdout to $OUT/NAME.log, stderr to $OUT/NAME.err, both also to the screen;
# note "NAME: ok | FAILED | TIMED OUT, seconds" for the summary. Returns COMMAND's status.
MIN_LIMIT=30
part() {
  local name=$1 limit=$2 left t0 rc took state
  shift 2
  left=$(( DEADLINE - $(date +%s) ))
  (( left < limit )) && limit=$left
  (( limit < MIN_LIMIT )) && limit=$MIN_LIMIT
  echo; echo "=== $name ($(date +%T), limit ${limit} s)"
  t0=$(date +%s)
  { timeout -k 10 "$limit" "$@" 2> >(tee "$OUT/$name.err" >&2); } | tee "$OUT/$name.log"
  rc=${PIPESTATUS[0]}
  took=$(( $(date +%s) - t0 ))
  case $rc in
    0) state=ok ;;
    124|137) state="TIMED OUT (limit ${limit} s)" ;;
    *) state="FAILED (exit $rc; see $OUT/$name.err)" ;;
  esac
  STATUS+=("$name: $state, ${took} s")
  return "$rc"
}

echo "=== environment"
{
  echo "date: $(date -u +'%Y-%m-%d %H:%M UTC')"
  if git rev-parse --short HEAD >/dev/null 2>&1; then
    changed=$(git diff --quiet HEAD -- || echo ' + uncommitted changes')
    echo "git: $(git rev-parse --short HEAD)$changed"
  fi
  if [[ "$DEVICE" == cuda ]]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null \
      | sed 's/^/gpu: /' || echo "nvidia-smi: n/a"
  else
    echo "device: cpu ($(nproc) cores) -- DRY RUN, no GPU figure"
  fi
  "$PYTHON" -c "import sys, torch, torchvision; print('python', sys.version.split()[0], 'torch', \
torch.__version__, 'torchvision', torchvision.__version__, 'cuda', torch.version.cuda, \
'visible GPUs', torch.cuda.device_count())"
} | tee "$OUT/environment.txt"

part table "$TABLE_LIMIT" "$PYTHON" benchmarks/throughput.py --device "$DEVICE" "${TABLE_ARGS[@]}"

if [[ "${GPU_CHECK_COMPILE:-0}" == 1 ]]; then  # step rows only; may take minutes to compile
  part table_compile "$COMPILE_LIMIT" "$PYTHON" benchmarks/throughput.py --device "$DEVICE" \
    "${TABLE_ARGS[@]}" --compile --skip aug loss
fi

part data 60 "$PYTHON" - "$OUT/data" "$IMAGES" "$SIZE" <<'EOF'
"""An image folder of two classes, noise tinted red or blue, so that kNN has something to find."""
import os, sys
import numpy as np
from PIL import Image
root, n, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = np.random.default_rng(0)
for split, count in (("train", n), ("val", max(n // 5, 20))):
    for label, tint in enumerate(((1.0, 0.4, 0.4), (0.4, 0.4, 1.0))):
        folder = os.path.join(root, split, f"class{label}")
        os.makedirs(folder, exist_ok=True)
        for i in range(count // 2):
            pixels = rng.random((size, size, 3)) * np.array(tint) * 255
            Image.fromarray(pixels.astype(np.uint8)).save(os.path.join(folder, f"{i}.png"))
print(f"wrote {root}: {n} train and {max(n // 5, 20)} val images of {size} px")
EOF

FOLDER=(--dataset imagefolder --data-dir "$OUT/data" --device "$DEVICE" --eval-every 1)
part pretrain "$TRAIN_LIMIT" "$PYTHON" simclr_dcl.py "${FOLDER[@]}" --loss dcl \
  --out "$OUT/pretrain" "${TRAIN_ARGS[@]}"

# two processes, one GPU each (gloo on the CPU dry run): DDP, global BatchNorm, the losses'
# all-gathers, the pairing across ranks (GSG) and the queue / support set of every rank's keys
DIST_RUNS=("simclr_dcl simclr_dcl.py --loss dcl"
           "mocov2_symmetric moco_simmoco_simco.py --method mocov2 --symmetric"
           "simco moco_simmoco_simco.py --method simco"
           "byol_guided simsiam_byol_gsg.py --method byol --stopgrad guided"
           "nnclr_dcl nnclr_dcl.py --loss dcl")
if [[ "$DIST" == 1 ]]; then
  for run in "${DIST_RUNS[@]}"; do
    read -r name script options <<< "$run"
    # shellcheck disable=SC2086  # $options: the run's own options, split on purpose
    OMP_NUM_THREADS=1 part "dist_$name" "$DIST_LIMIT" "$PYTHON" -m torch.distributed.run \
      --standalone --nproc_per_node=2 "$script" $options "${FOLDER[@]}" "${DIST_ARGS[@]}" \
      --out "$OUT/dist_$name"
  done
else
  STATUS+=("torchrun runs: skipped ($GPUS GPU(s) visible; GPU_CHECK_DIST=1 forces them)")
fi

if [[ "${GPU_CHECK_SKIP_TESTS:-0}" == 1 ]]; then
  STATUS+=("tests: skipped (GPU_CHECK_SKIP_TESTS=1)")
else
  MIN_LIMIT=60 part tests 1500 "$PYTHON" -m pytest -x -q -p no:cacheprovider
fi
TOTAL=$(( $(date +%s) - START ))

echo; echo "=== summary (paste into benchmarks/README.md)"
"$PYTHON" - "$OUT" "$DEVICE" "$TOTAL" "${STATUS[@]}" > "$OUT/summary.md" <<'EOF'
import glob, json, os, sys
out, device, total, status = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
env = dict(line.split(": ", 1) for line in open(os.path.join(out, "environment.txt")).read()
           .splitlines() if ": " in line)
title = env.get("gpu", "CPU DRY RUN (no GPU figure)") if device == "cuda" else env["device"]
print(f"#### {title}: {env['date']}, git {env.get('git', 'n/a')}")
print(f"\n`bash benchmarks/gpu_check.sh`{' (GPU_CHECK_DEVICE=cpu)' * (device == 'cpu')}: "
      f"{total} s in all. {[l for l in open(os.path.join(out, 'environment.txt'))][-1].strip()}")


def lines(name):
    path = os.path.join(out, name + ".log")
    return open(path).read().splitlines() if os.path.exists(path) else []


for name in ("table", "table_compile"):
    table = [l for l in lines(name) if l.startswith(("|", "#"))]
    if table:
        print()
        print("\n".join(table))


def epochs(run):
    path = os.path.join(out, run, "metrics.jsonl")
    return [json.loads(l) for l in open(path)] if os.path.exists(path) else []


def results(run):
    path = os.path.join(out, run, "results.json")
    return json.load(open(path)) if os.path.exists(path) else {}


if epochs("pretrain"):
    print("\nPre-training on the generated image folder, one process (simclr_dcl.py --loss dcl):\n")
    for r in epochs("pretrain"):
        knn = f", kNN top-1 {r['knn_top1']:.1f}%" if "knn_top1" in r else ""
        print(f"- epoch {r['epoch']}: {r['images_per_s']:,.0f} img/s, loss {r['loss']:.4f}{knn}")
    final = results("pretrain")
    if final:
        print(f"- final: kNN top-1 {final['knn_top1']:.1f}%, linear top-1 "
              f"{final.get('linear_top1', float('nan')):.1f}%")
runs = sorted(glob.glob(os.path.join(out, "dist_*", "config.json")))
if runs:
    print("\nTwo processes (torchrun --nproc_per_node=2) on the generated image folder:\n")
    print("| run | world | last epoch: loss | img/s | kNN top-1 | final linear top-1 |")
    print("|---|---|---|---|---|---|")
    for config in runs:
        run = os.path.basename(os.path.dirname(config))
        world = json.load(open(config))["world_size"]
        last, final = (epochs(run) or [{}])[-1], results(run)
        cells = [f"{last['loss']:.4f}" if "loss" in last else "-",
                 f"{last['images_per_s']:,.0f}" if "images_per_s" in last else "-",
                 f"{final['knn_top1']:.1f}%" if "knn_top1" in final else "-",
                 f"{final['linear_top1']:.1f}%" if "linear_top1" in final else "-"]
        print(f"| {run[5:]} | {world} | " + " | ".join(cells) + " |")
tests = [l for l in lines("tests") if l.strip()]
print("\nParts:\n")
print("\n".join(f"- {s}" for s in status))
if tests:
    print(f"- pytest: {tests[-1].strip()}")
EOF
cat "$OUT/summary.md"
echo; echo "(written to $OUT/summary.md)"
FAILED=$(printf '%s\n' "${STATUS[@]}" | grep -c 'FAILED\|TIMED OUT')
exit $(( FAILED > 0 ))
