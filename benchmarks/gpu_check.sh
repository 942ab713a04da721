#!/usr/bin/env bash
# One-command GPU check: the throughput table for every method, a short pre-training on generated
# images, then the test suite; ends with a summary to paste into the README's "Speed" section.
# Needs one CUDA GPU, this repository's Python environment and no network; installs nothing.
#
#   bash benchmarks/gpu_check.sh                               # on the GPU machine (about 5-8 minutes + tests)
#   GPU_CHECK_DEVICE=cpu GPU_CHECK_TINY=1 bash benchmarks/gpu_check.sh   # dry run of every part on a CPU
#
# Environment: GPU_CHECK_DEVICE (cuda), GPU_CHECK_BATCH (512), GPU_CHECK_COMPILE=1 adds a --compile
# table, GPU_CHECK_TINY=1 shrinks everything, GPU_CHECK_SKIP_TESTS=1 skips pytest, GPU_CHECK_OUT (runs/gpu_check-<time>), PYTHON (python).
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
BATCH=${GPU_CHECK_BATCH:-512}
OUT=${GPU_CHECK_OUT:-runs/gpu_check-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TORCH_HOME="$OUT/torch_home"  # nothing is fetched

if [[ "${GPU_CHECK_TINY:-0}" == 1 ]]; then  # CPU dry run: every part, tiny sizes
  TABLE_ARGS=(--width 8 --step-image-size 16 --batch-size 32 --steps 2 --warmup 1 --loss-batches 256 512
              --aug-batch 256 --pil-images 1024 --reps 1)
  TRAIN_IMAGES=64; TRAIN_ARGS=(--width 8 --image-size 16 --batch-size 32 --epochs 2 --linear-epochs 2 --workers 2)
  TABLE_LIMIT=600; TRAIN_LIMIT=300
else
  TABLE_ARGS=(--batch-size "$BATCH" --steps 20)
  TRAIN_IMAGES=2500; TRAIN_ARGS=(--image-size 32 --batch-size "$BATCH" --epochs 5 --linear-epochs 20 --workers 8)
  TABLE_LIMIT=300; TRAIN_LIMIT=150
fi

step() { echo; echo "=== $* ($(date +%T))"; }
START=$(date +%s)

step "environment"
{
  echo "date: $(date -u +'%Y-%m-%d %H:%M UTC')"
  if git rev-parse --short HEAD >/dev/null 2>&1; then
    echo "git: $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- || echo ' (with uncommitted changes)')"
  else
    echo "git: n/a"
  fi
  if [[ "$DEVICE" == cuda ]]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi: n/a"
  fi
  "$PYTHON" -c "import torch, torchvision; print('torch', torch.__version__, 'torchvision', torchvision.__version__, \
'cuda available', torch.cuda.is_available())"
} | tee "$OUT/environment.txt"
if [[ "$DEVICE" == cuda ]]; then
  "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || { echo "error: no CUDA GPU visible; for a CPU dry run use GPU_CHECK_DEVICE=cpu GPU_CHECK_TINY=1" >&2; exit 2; }
fi

step "throughput table: every method, batch $BATCH, bf16 autocast + channels_last on CUDA"
timeout "$TABLE_LIMIT" "$PYTHON" benchmarks/throughput.py --device "$DEVICE" "${TABLE_ARGS[@]}" | tee "$OUT/table.md"

if [[ "${GPU_CHECK_COMPILE:-0}" == 1 ]]; then
  step "throughput table with --compile (step rows only)"
  timeout "$TABLE_LIMIT" "$PYTHON" benchmarks/throughput.py --device "$DEVICE" "${TABLE_ARGS[@]}" --compile \
    --skip aug loss | tee "$OUT/table_compile.md"
fi

step "generated image folder ($TRAIN_IMAGES train images, 2 classes)"
"$PYTHON" - "$OUT/data" "$TRAIN_IMAGES" <<'EOF'
"""Two classes of 32 px PNGs: noise tinted red or blue, so kNN has something to find."""
import os, sys
import numpy as np
from PIL import Image
root, n = sys.argv[1], int(sys.argv[2])
rng = np.random.default_rng(0)
for split, count in (("train", n), ("val", max(n // 5, 20))):
    for label, tint in enumerate(((1.0, 0.4, 0.4), (0.4, 0.4, 1.0))):
        folder = os.path.join(root, split, f"class{label}")
        os.makedirs(folder, exist_ok=True)
        for i in range(count // 2):
            pixels = rng.random((32, 32, 3)) * np.array(tint) * 255
            Image.fromarray(pixels.astype(np.uint8)).save(os.path.join(folder, f"{i}.png"))
print("wrote", root)
EOF

step "short pre-training: simclr_dcl.py on the generated folder"
timeout "$TRAIN_LIMIT" "$PYTHON" simclr_dcl.py --dataset imagefolder --data-dir "$OUT/data" --device "$DEVICE" \
  --loss dcl --eval-every 1 --out "$OUT/pretrain" "${TRAIN_ARGS[@]}" 2>&1 | tail -n 20
ELAPSED=$(( $(date +%s) - START ))
echo "table + pre-training: ${ELAPSED} s (target: under 480 s)"

step "test suite"
if [[ "${GPU_CHECK_SKIP_TESTS:-0}" == 1 ]]; then
  echo "skipped (GPU_CHECK_SKIP_TESTS=1)" > "$OUT/pytest.txt"; TESTS=0
else
  set +e
  timeout 1500 "$PYTHON" -m pytest -x -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest.txt" | tail -n 5
  TESTS=${PIPESTATUS[0]}
  set -e
fi

step "summary (paste into README, section Speed)"
{
  echo "GPU check: $(paste -sd ';' "$OUT/environment.txt")"
  echo "Command: bash benchmarks/gpu_check.sh   (table + pre-training took ${ELAPSED} s)"
  echo
  grep -v '^# peak RSS' "$OUT/table.md"
  [[ -f "$OUT/table_compile.md" ]] && { echo; grep '^| step\|^| part\|^|---' "$OUT/table_compile.md"; }
  echo
  echo "Pre-training on generated images (simclr_dcl.py --loss dcl, ${TRAIN_ARGS[*]}):"
  "$PYTHON" - "$OUT/pretrain" <<'EOF'
import json, os, sys
out = sys.argv[1]
for line in open(os.path.join(out, "metrics.jsonl")):
    r = json.loads(line)
    print(f"  epoch {r['epoch']}: {r['images_per_s']:,.0f} img/s, loss {r['loss']:.4f}"
          + (f", kNN top-1 {r['knn_top1']:.1f}%" if 'knn_top1' in r else ""))
results = json.load(open(os.path.join(out, "results.json")))
print("  final (%):", ", ".join(f"{k} {v:.1f}" for k, v in results.items() if isinstance(v, float)))
EOF
  echo "Tests: $(tail -n 1 "$OUT/pytest.txt") (exit status $TESTS)"
} | tee "$OUT/summary.md"
exit "$TESTS"
