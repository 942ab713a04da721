"""Nothing is lost, whatever happens to a run: one process owns a run folder (a lock), every file
in it is written whole or not at all, a full disk or a damaged file is one line, and an
interrupted run resumes to the same results (tiny runs of simclr_dcl.py on CPU; signals:
test_preemption.py)."""

import argparse
import errno
import json
import os
import re
import shutil
import socket
import subprocess

import pytest
import torch

import common
import simclr_dcl
from helpers import FailingWrites, check_run_folder, run_script, smoke_args
from test_common import fails_with

SMALL = ["--proj-hidden", "32", "--linear-epochs", "0"]  # a 1.5 MB checkpoint


@pytest.fixture(scope="module")
def stopped_run(tiny_folder, tmp_path_factory):
    """A 2-epoch run stopped after epoch 1 (tests copy it: this process holds its lock)."""
    out = tmp_path_factory.mktemp("stopped") / "run"
    simclr_dcl.main(smoke_args(tiny_folder, out, "--epochs", "2", "--stop-after", "1", *SMALL))
    return out


def copy_of(run, tmp_path, name="run"):
    return shutil.copytree(run, tmp_path / name)


def temp_files(folder):
    return [name for name in os.listdir(folder) if name.endswith(".tmp")]


def shown_lines(text):
    """The lines written besides the progress bars (which a terminal shows on one line, cleared
    at the end of the epoch) and the start-up warnings (smoke runs end within the warm-up)."""
    lines = [line.split("\r")[-1] for line in text.split("\n")]
    return [line for line in lines if line.strip() and not re.match(r"epoch \d+/\d+: |warning: ",
                                                                     line)]


def test_a_run_folder_is_held_by_one_process(tiny_folder, stopped_run, tmp_path):
    """While this process holds a run folder (its .lock), a new run into it and a --resume of it
    each stop with exit status 2 and one error line naming the holder; nothing in the folder
    changes. Released, the --resume goes on."""
    run = copy_of(stopped_run, tmp_path)
    new = tmp_path / "new"
    new.mkdir()
    for folder in (run, new):
        common.hold_run_folder(str(folder))
    try:
        before = {p.name: p.read_bytes() for p in run.iterdir() if p.name != ".lock"}
        holder = f"{os.getpid()} on {socket.gethostname()}"
        for folder, argv in ((new, smoke_args(tiny_folder, new, *SMALL)),
                             (run, ["--resume", run])):
            done = run_script("simclr_dcl.py", argv)
            assert done.returncode == 2, done.stderr[-2000:]
            assert shown_lines(done.stderr) == [
                f"error: {folder} is in use by process {holder}: a run or --resume of it is "
                f"going on; wait for it to end (or stop it), then try again"]
        assert {p.name: p.read_bytes() for p in run.iterdir() if p.name != ".lock"} == before
        assert os.listdir(new) == [".lock"]
    finally:
        for folder in (run, new):
            common.LOCKS.pop(os.path.realpath(folder)).close()
    done = run_script("simclr_dcl.py", ["--resume", run])
    assert done.returncode == 0, done.stderr[-2000:]
    check_run_folder(run, epochs=2)


def test_a_streamed_run_stopped_and_resumed_evaluates_as_an_uninterrupted_one(
    tiny_folder, tmp_path
):
    """--stream, 2 epochs straight and 1 + --resume 1: the same results.json. The probe drew its
    bias from the global RNG, which each DataLoader advances: the resumed run's had run fewer."""
    argv = ["--stream", "--epochs", "2", "--linear-epochs", "2", "--proj-hidden", "32"]
    simclr_dcl.main(smoke_args(tiny_folder, tmp_path / "straight", *argv))
    simclr_dcl.main(smoke_args(tiny_folder, tmp_path / "split", *argv, "--stop-after", "1"))
    simclr_dcl.main(["--resume", str(tmp_path / "split")])
    results = [json.load(open(tmp_path / run / "results.json")) for run in ("straight", "split")]
    assert results[0] == results[1] and "linear_top1" in results[0]


def full_disk(file, data):
    """Every write fails as on a full disk."""
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def fill_disk_for(monkeypatch, name):
    """Writes to files named `name` (or its temp file) fail with ENOSPC, as common.py opens them."""
    def opener(path, mode="r", *args, **kwargs):
        file = open(path, mode, *args, **kwargs)
        writes = any(m in mode for m in "wax+")
        return FailingWrites(file, full_disk) if writes and os.path.basename(path).startswith(name) else file
    monkeypatch.setattr(common, "open", opener, raising=False)


def test_a_failed_write_keeps_the_previous_metrics_and_no_partial_results(
    tiny_folder, stopped_run, tmp_path, monkeypatch, capsys
):
    """A write that fails while the resume rewrites metrics.jsonl leaves it as it was (it was
    truncated first); one that fails while results.json is written leaves no 0-byte results.json
    (a resume then finishes the run, not 'evaluates it again'). One error line, no temp file."""
    run = copy_of(stopped_run, tmp_path)
    with open(run / "metrics.jsonl", "a") as f:  # epoch 2 logged, its checkpoint not saved
        f.write('{"epoch": 2, "loss": 0.0}\n')
    before = (run / "metrics.jsonl").read_bytes()
    fill_disk_for(monkeypatch, "metrics.jsonl")
    fails_with(["--resume", str(run)], capsys, f"cannot write {run / 'metrics.jsonl'} (No space "
               f"left on device); the last good checkpoint is kept: continue with --resume {run}")
    assert (run / "metrics.jsonl").read_bytes() == before and not temp_files(run)

    fill_disk_for(monkeypatch, "results.json")
    fails_with(smoke_args(tiny_folder, tmp_path / "new", *SMALL), capsys, "results.json (No space")
    assert not (tmp_path / "new" / "results.json").exists() and not temp_files(tmp_path / "new")
    monkeypatch.undo()
    simclr_dcl.main(["--resume", str(tmp_path / "new")])
    check_run_folder(tmp_path / "new", epochs=1)
    assert not [name for name in os.listdir(tmp_path / "new") if name.startswith("eval-")]


def test_a_full_disk_is_one_error_line_and_leaves_no_temp_file(tiny_folder, tmp_path, capsys,
                                                               monkeypatch):
    """On a 2 MB tmpfs (where this user may mount one; else an injected ENOSPC) epoch 1's 1.5 MB
    checkpoint fits and epoch 2's does not: one line, epoch 1's checkpoint kept, no *.tmp."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)],
                             capture_output=True).returncode == 0
    if not mounted:  # the second checkpoint.pt's writes fail
        saves = []
        real = common.Run.save
        monkeypatch.setattr(common.Run, "save", lambda *a: saves.append(1) or (
            fill_disk_for(monkeypatch, "checkpoint.pt") if len(saves) == 2 else None) or real(*a))
    try:
        out = disk / "run"
        fails_with(smoke_args(tiny_folder, out, "--epochs", "2", *SMALL), capsys,
                   f"cannot write {out / 'checkpoint.pt'} (No space left on device); the last "
                   f"good checkpoint is kept: continue with --resume {out}")
        assert not temp_files(out)
        assert torch.load(out / "checkpoint.pt", weights_only=True)["epoch"] == 1
    finally:
        if mounted:  # lazily: this process still holds the run's lock file open
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


def test_resume_takes_the_checkpoints_options_and_any_given_replace_them(stopped_run, tmp_path,
                                                                       capsys):
    """--resume RUN alone: the options RUN's checkpoint keeps (its 32-wide projector, not the
    default 2048, so its states load); an option given beside it replaces the kept one
    (--epochs 3: a third epoch). A run of another script, or a folder without a checkpoint of
    this project, is one error line."""
    run = copy_of(stopped_run, tmp_path)
    simclr_dcl.main(["--resume", str(run), "--epochs", "3"])
    _, lines, _ = check_run_folder(run, epochs=3)
    assert torch.load(run / "checkpoint.pt", weights_only=True)["args"]["proj_hidden"] == 32
    with pytest.raises(SystemExit) as exit_info:
        import nnclr_dcl
        common.run(lambda: nnclr_dcl.main(["--resume", str(run)]))
    assert exit_info.value.code == 2
    assert "that run was made by simclr_dcl.py, not nnclr_dcl.py" in capsys.readouterr().err
    fails_with(["--resume", str(tmp_path)], capsys, "no checkpoint of this project to resume")


@pytest.mark.parametrize("checkpoint, message", [
    (torch.zeros(3), ": no checkpoint of this project to resume (AttributeError)"),
    ({"model": {}}, ": no checkpoint of this project to resume (KeyError)"),
], ids=["tensor", "model-only"])
def test_a_checkpoint_of_the_wrong_structure_is_one_error_line(stopped_run, tmp_path, capsys,
                                                               checkpoint, message):
    """A checkpoint.pt that loads but is not a dict with the epochs done and every state."""
    run = copy_of(stopped_run, tmp_path)
    torch.save(checkpoint, run / "checkpoint.pt")
    fails_with(["--resume", str(run)], capsys, f"{run / 'checkpoint.pt'}{message}")


@pytest.mark.parametrize("change, message", [
    (lambda c: c.pop("optimizer"), "(states missing: optimizer; left over: none)"),
    (lambda c: c.update(queue={}), "(states missing: none; left over: queue)"),
    (lambda c: c.pop("epoch"), "or is unreadable (KeyError: 'epoch')"),
], ids=["missing", "left-over", "no-epoch"])
def test_a_checkpoint_state_missing_or_left_over_is_named(stopped_run, tmp_path, capsys,
                                                          change, message):
    """A real checkpoint.pt with one of the run's states taken out, or with a state the run does
    not have: one error line naming it (not a bare KeyError, nor a state silently dropped)."""
    run = copy_of(stopped_run, tmp_path)
    checkpoint = torch.load(run / "checkpoint.pt", weights_only=True)
    change(checkpoint)
    torch.save(checkpoint, run / "checkpoint.pt")
    fails_with(["--resume", str(run)], capsys,
               f"{run / 'checkpoint.pt'} does not fit this run {message}")


def method_parser(**defaults):
    """A method file's parser that sets only `defaults` of those add_common_args leaves to it."""
    parser = argparse.ArgumentParser()
    common.add_common_args(parser)
    parser.set_defaults(**defaults)
    return parser


@pytest.mark.parametrize("defaults, argv, missing", [
    ({}, [], "batch_size, epochs, lr, wd, warmup_epochs, crop_scale"),
    ({"epochs": 1, "wd": 0.0, "warmup_epochs": 0}, ["--batch-size", "8", "--lr", "0.1"],
     "batch_size, lr, crop_scale"),
], ids=["none", "some"])
def test_a_method_file_without_a_shared_default_is_named(tmp_path, capsys, defaults, argv,
                                                         missing):
    """A method file that forgets to set_defaults a shared option add_common_args leaves None:
    one error line naming each missing default and where to set it, exit status 2 (not a
    TypeError in setup). A value on the command line does not stand in: the file is wrong."""
    def main():
        parser = method_parser(**defaults)
        args = common.parse_args(parser, argv + ["--out", tmp_path / "run"], "demo")
        common.setup(args)

    with pytest.raises(SystemExit) as exit_info:
        common.run(main)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: demo.py sets no default for {missing}: give each in its "
        f"parser.set_defaults(...)"]
    assert not (tmp_path / "run").exists()


def test_a_finished_run_rebuilds_a_missing_backbone(stopped_run, tmp_path):
    """backbone.pt deleted from a finished run: its --resume writes it again, the same weights."""
    run = copy_of(stopped_run, tmp_path)
    simclr_dcl.main(["--resume", str(run)])
    weights = torch.load(run / "backbone.pt", weights_only=True)
    os.remove(run / "backbone.pt")
    simclr_dcl.main(["--resume", str(run)])
    again = torch.load(run / "backbone.pt", weights_only=True)
    assert weights.keys() == again.keys()
    assert all(torch.equal(weights[k], again[k]) for k in weights)


def test_a_mid_epoch_checkpoint_of_another_device_type_is_one_line(stopped_run, tmp_path,
                                                                    capsys):
    """A checkpoint written within an epoch on CUDA keeps a CUDA generator's state, which the
    CPU's cannot take: its resume with --device cpu stops with one line naming --device cuda,
    not every rank's traceback."""
    run = copy_of(stopped_run, tmp_path)
    checkpoint = torch.load(run / "checkpoint.pt", weights_only=True)
    state = torch.Generator().get_state()
    checkpoint.update(step=1, device="cuda", generators=[state, state[:16]],
                      meter=dict(steps=1, lr=0.1, sums={"loss": torch.ones(1)}))
    torch.save(checkpoint, run / "checkpoint.pt")
    fails_with(["--resume", str(run)], capsys, f"{run / 'checkpoint.pt'} stopped in epoch 2 on "
               f"cuda; continue it with --device cuda")


def test_an_nccl_error_keeps_its_own_words_in_the_one_line(capsys):
    """A DistBackendError (NCCL's set-up or transport) is one error line with its own first
    line, not 'another process stopped'; a peer that closed its connection is that line."""
    def nccl():
        raise torch.distributed.DistBackendError(
            "NCCL error in: ProcessGroupNCCL.cpp:1, unhandled system error\nmore detail")

    def peer():
        raise RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:5")

    for main, line in ((nccl, "error: DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1, "
                              "unhandled system error"),
                       (peer, "error: another process of this run stopped (Connection closed "
                              "by peer); the last checkpoint is kept: continue with --resume")):
        with pytest.raises(SystemExit) as exit_info:
            common.run(main)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith(line), err
