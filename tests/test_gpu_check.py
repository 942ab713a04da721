"""benchmarks/gpu_check.py on the CPU: its dry run at the tiniest sizes passes every part and
writes a summary; its step comparison fails a deliberately wrong step; a hanging part is ended at
its time limit. (Its CUDA-only pieces, events, the profiler and set_sync_debug_mode, need a GPU.)"""

import argparse
import json
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import gpu_check  # noqa: E402


def rows(out, part):
    return [json.loads(line) for line in open(os.path.join(out, f"{part}.jsonl"))]


def test_dry_run_passes_every_part_and_writes_the_summary(tmp_path):
    """The check's own parts at the tiny sizes, in this process: exit 0, a row per method in each
    part, the float32 step equal to the CPU's within tolerance (oneDNN off on the 'device' side),
    regions that add up to the step's wall time, with the forward, backward and optimiser
    marks seen; and the 2-process part's one-process losses."""
    out = str(tmp_path / "check")
    assert gpu_check.main(["--device", "cpu", "--preset", "tiny", "--in-process", "--dist", "off",
                           "--out", out]) == 0
    checked = rows(out, "correctness")
    assert [r["method"] for r in checked] == list(gpu_check.CHECKED)
    assert all(r["ok"] and r["float32"]["errors"]["start"] == 0 for r in checked)
    epochs = rows(out, "epoch")
    assert [r["method"] for r in epochs] == list(gpu_check.METHODS)
    assert all(r["epoch_s"] > 0 and r["knn_top1"] is not None for r in epochs)
    steps = rows(out, "regions") + rows(out, "small")
    assert len(steps) == len(gpu_check.METHODS) * (1 + len(gpu_check.PRESETS["tiny"].small_batches))
    for r in steps:
        assert math.isclose(sum(r["host_ms"].values()), r["step_ms"], rel_tol=0.05), r
        assert min(r["host_ms"][g] for g in ("forward", "backward", "optimizer")) > 0, r
    summary = open(os.path.join(out, "summary.md")).read()
    for title in ("**Correctness**", "**Epoch**", "**Where the time goes**", "**Small batches**"):
        assert title in summary
    o = argparse.Namespace(device="cpu")
    losses, results = gpu_check.first_losses("simco", o, gpu_check.PRESETS["tiny"], str(tmp_path))
    assert len(losses) == gpu_check.PRESETS["tiny"].dist_steps and "knn_top1" in results


def test_the_step_comparison_fails_when_one_side_is_wrong():
    """CPU against CPU, the 'device' step given noise on its first view: float32 must fail, on
    the loss and on the update, by far more than its tolerance."""
    o = argparse.Namespace(device="cpu")
    row = gpu_check.check_method("mocov2", o, gpu_check.PRESETS["tiny"], perturb=True)
    errors, tolerance = row["float32"]["errors"], gpu_check.TOLERANCES["float32"]
    assert not row["ok"] and "loss" in row["float32"]["failed"]
    assert errors["loss"] > 10 * tolerance["loss"]
    assert errors["update net.params"] > 10 * tolerance["update"]


def test_a_hanging_part_is_ended_at_its_limit(tmp_path):
    """run_limited ends a command (and its process group) at its time limit and says so."""
    child = tmp_path / "child.pid"
    command = [sys.executable, "-c", "import os, subprocess, sys, time; "
               f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
               f"open({str(child)!r}, 'w').write(str(p.pid)); time.sleep(60)"]
    start = time.monotonic()
    state, seconds = gpu_check.run_limited(command, str(tmp_path / "part.log"), 2)
    assert state.startswith("TIMED OUT") and seconds < 20 and time.monotonic() - start < 20
    pid = int(child.read_text())
    time.sleep(0.2)
    assert not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read().split()[2]
