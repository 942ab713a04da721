#!/usr/bin/env bash
# The GPU check in one command; benchmarks/gpu_check.py does the work (its docstring lists the
# parts). Installs nothing, needs no network. The summary (Markdown) is printed last and written
# to $GPU_CHECK_OUT/summary.md beside each part's log and rows.
#
#   bash benchmarks/gpu_check.sh                       # one CUDA GPU: about 5 minutes
#   GPU_CHECK_DEVICE=cpu bash benchmarks/gpu_check.sh  # dry run of every part, tiny sizes
#   bash benchmarks/gpu_check.sh --compile --with-tests  # + the optional parts (gpu_check.py -h)
#
# Environment: GPU_CHECK_DEVICE (cuda, the default, or cpu), GPU_CHECK_OUT (the output folder;
# default runs/gpu_check-<time>), PYTHON (the interpreter; default python3, else python: the
# first that imports torch and torchvision).
set -uo pipefail
cd "$(dirname "$0")/.."
for candidate in ${PYTHON:-} python3 python; do
  if command -v "$candidate" >/dev/null && "$candidate" -c "import torch, torchvision" 2>/dev/null
  then
    PYTHONUNBUFFERED=1 exec "$candidate" benchmarks/gpu_check.py "$@"
  fi
done
echo "error: neither python3 nor python imports torch and torchvision here; set PYTHON" >&2
exit 2
