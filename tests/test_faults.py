"""Nothing is lost, whatever happens to a run: every file in a run folder is written whole or not
at all, a full disk or a damaged file is one line, no checkpoint holds a non-finite tensor (tiny
runs of the harness script; kills: test_preemption.py)."""

import errno
import json
import math
import os
import re
import shutil
import subprocess

import pytest
import torch

import common
from helpers import (FailingWrites, check_run_folder, flat_tensors, harness_module, smoke_args,
                     stop_in_epoch)
from test_common import fails_with

harness = harness_module()  # the README's first quick-start script

SMALL = ["--proj-hidden", "32", "--linear-epochs", "0"]  # a 1.5 MB checkpoint


@pytest.fixture(scope="module")
def stopped_run(tiny_folder, tmp_path_factory):
    """A 2-epoch run stopped in epoch 2 (tests copy it)."""
    out = tmp_path_factory.mktemp("stopped") / "run"
    stop_in_epoch(2, smoke_args(tiny_folder, out, "--epochs", "2", *SMALL))
    return out


def copy_of(run, tmp_path, name="run"):
    return shutil.copytree(run, tmp_path / name)


def temp_files(folder):
    return [name for name in os.listdir(folder) if name.endswith(".tmp")]


@pytest.mark.parametrize("change", [
    lambda c: b"not a checkpoint", lambda c: torch.zeros(3), lambda c: {"model": c["model"]},
    lambda c: {**c, "optimizer": {}}], ids=["corrupt", "tensor", "model-only", "empty-optimizer"])
def test_a_corrupt_or_mismatched_checkpoint_is_one_error_line(stopped_run, tiny_folder, tmp_path,
                                                              capsys, change, recwarn):
    """A checkpoint.pt that is no checkpoint, or loads but lacks a state of this run: one line, and
    no warning from torch about how it was read."""
    run = copy_of(stopped_run, tmp_path)
    changed = change(torch.load(run / "checkpoint.pt", weights_only=True))
    if isinstance(changed, bytes):
        (run / "checkpoint.pt").write_bytes(changed)
    else:
        torch.save(changed, run / "checkpoint.pt")
    fails_with(smoke_args(tiny_folder, run, "--epochs", "2", *SMALL), capsys,
               f"{run / 'checkpoint.pt'} does not fit this run or is unreadable (")
    assert not [str(w.message) for w in recwarn]


def full_disk(write, data):
    """Every write fails as on a full disk."""
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def fill_disk_for(monkeypatch, name):
    """Writes to files named `name` (or its temp file) fail with ENOSPC, as common.py opens them."""
    def opener(path, mode="r", *args, **kwargs):
        if any(m in mode for m in "wax+") and os.path.basename(path).startswith(name):
            return FailingWrites(path, mode, full_disk)
        return open(path, mode, *args, **kwargs)
    monkeypatch.setattr(common, "open", opener, raising=False)


def test_a_failed_results_write_leaves_none_and_the_same_command_finishes(
        tiny_folder, tmp_path, monkeypatch, capsys):
    """A failed write of results.json is one error line and leaves neither a 0-byte results.json
    (the run is not taken as finished) nor a temp file: the same command then writes it."""
    argv = smoke_args(tiny_folder, tmp_path / "run", *SMALL)
    fill_disk_for(monkeypatch, "results.json")
    fails_with(argv, capsys, "results.json (No space")
    assert not (tmp_path / "run" / "results.json").exists()
    assert not temp_files(tmp_path / "run")
    monkeypatch.undo()
    harness.main(argv)
    check_run_folder(tmp_path / "run", epochs=1)


def test_a_full_disk_is_one_error_line_and_leaves_no_temp_file(tiny_folder, tmp_path, capsys,
                                                               monkeypatch):
    """On a 2 MB tmpfs (where this user may mount one; else an injected ENOSPC) epoch 1's 1.5 MB
    checkpoint fits and epoch 2's does not: one line, epoch 1's checkpoint kept, no *.tmp."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)],
                             capture_output=True).returncode == 0
    if not mounted:  # epoch 2's checkpoint.pt fails
        real = common.Run.end_epoch

        def end_epoch(run, record):
            if record["epoch"] == 2:
                fill_disk_for(monkeypatch, "checkpoint.pt")
            return real(run, record)

        monkeypatch.setattr(common.Run, "end_epoch", end_epoch)
    try:
        out = disk / "run"
        fails_with(smoke_args(tiny_folder, out, "--epochs", "2", *SMALL), capsys,
                   f"cannot write {out / 'checkpoint.pt'} (No space left on device); what was "
                   f"written before is kept")
        assert not temp_files(out)
        assert torch.load(out / "checkpoint.pt", weights_only=True)["epoch"] == 1
    finally:
        if mounted:
            subprocess.run(["umount", "--lazy", str(disk)], check=True)


def test_a_damaged_png_that_pillow_rejects_with_a_syntax_error_is_named(tiny_folder, tmp_path):
    """Pillow raises SyntaxError ('broken PNG file'), not OSError, for a PNG whose image-data
    chunk is longer than its length field says."""
    from PIL import Image

    data = bytearray(open(os.path.join(tiny_folder, "train", "class0", "0.png"), "rb").read())
    at = data.index(b"IDAT")
    data[at - 4:at] = (int.from_bytes(data[at - 4:at], "big") - 20).to_bytes(4, "big")
    bad = tmp_path / "bad.png"
    bad.write_bytes(data)
    with pytest.raises(SyntaxError):
        Image.open(bad).convert("RGB")
    with pytest.raises(common.UserError, match=f"unreadable image {bad} \\(SyntaxError\\)"):
        common.ImageFiles([(str(bad), 0)], 16)[0]


def non_finite(path):
    """The names of checkpoint.pt's tensors that hold a NaN or an infinity."""
    checkpoint = torch.load(path, weights_only=True)
    return [n for n, t in flat_tensors(checkpoint).items()
            if t.is_floating_point() and not t.isfinite().all()]


def test_a_loss_that_becomes_nan_writes_no_checkpoint_and_the_same_command_starts_again(
        tiny_folder, tmp_path, capsys, monkeypatch):
    """A NaN loss in epoch 1: one true line (which epoch, that no checkpoint was written, what to
    try), exit status 2, and no checkpoint.pt; the same command then runs in that folder (its
    metrics.jsonl starts empty)."""
    out = tmp_path / "run"
    argv = smoke_args(tiny_folder, out, *SMALL)
    real = harness.train_step

    def nan_loss(*args, **kwargs):
        loss, *more = real(*args, **kwargs)
        return (loss * float("nan"), *more)

    monkeypatch.setattr(harness, "train_step", nan_loss)
    fails_with(argv, capsys, "error: the loss became nan in epoch 1; no checkpoint was written. "
               "Lower --lr, check --wd and the temperatures, or try --no-amp, in a new --out")
    assert not (out / "checkpoint.pt").exists()
    monkeypatch.undo()
    harness.main(argv)
    check_run_folder(out, epochs=1)


def test_weights_that_become_non_finite_in_a_finite_epoch_keep_the_last_checkpoint(
    tiny_folder, tmp_path, capsys
):
    """The last step of epoch 2 leaves a weight infinite (its loss was finite): the run stops with
    one line naming epoch 1's checkpoint as kept, which holds no non-finite tensor."""
    real = harness.train_step
    steps = []

    def train_step(net, optimizer, views, args, ctx):
        result = real(net, optimizer, views, args, ctx)
        steps.append(1)
        if len(steps) == 8:  # epoch 2's last step: an overflow in its update
            with torch.no_grad():
                next(net.parameters())[0].fill_(math.inf)
        return result

    out = tmp_path / "run"
    harness.train_step = train_step
    try:
        fails_with(smoke_args(tiny_folder, out, "--epochs", "3", *SMALL), capsys,
                   "error: the weights became non-finite in epoch 2; epoch 1's checkpoint is "
                   "kept. Lower --lr")
    finally:
        harness.train_step = real
    assert torch.load(out / "checkpoint.pt", weights_only=True)["epoch"] == 1
    assert not non_finite(out / "checkpoint.pt")
    assert [json.loads(line)["epoch"] for line in open(out / "metrics.jsonl")] == [1]


def test_a_bug_keeps_its_traceback():
    """An exception that is no UserError (a bug, or torch's own) goes through common.run,
    traceback and all."""
    def main():
        raise OSError(errno.EIO, "a bug's own error")

    with pytest.raises(OSError, match=re.escape("a bug's own error")):
        common.run(main)
