"""Nothing is lost, whatever happens to a run: one process owns a run folder (a lock), every file
in it is written whole or not at all, a full disk, a damaged file or Ctrl-C is one line, and an
interrupted run resumes to the same results (tiny runs of simclr_dcl.py on CPU)."""

import argparse
import errno
import json
import multiprocessing
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

import common
import simclr_dcl
from helpers import FailingWrites, check_run_folder, smoke_args
from test_common import fails_with
from test_runs import flat_tensors

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


def script(argv, stderr, before=None):
    """simclr_dcl.py as its __main__ runs it (common.run), in a separate process forked from this
    one (no second import of torch), its stderr into the file `stderr`; `before()` runs first."""
    def main():
        sys.stdout, sys.stderr = open(os.devnull, "w"), open(stderr, "w", buffering=1)
        if before:
            before()
        common.run(lambda: simclr_dcl.main([str(a) for a in argv]))

    process = multiprocessing.get_context("fork").Process(target=main)
    process.start()
    return process


def wait_before_saving(go):
    """In the process: epoch 1 waits for the file `go` before its checkpoint (the folder held)."""
    def patch():
        real = common.save_checkpoint

        def save(*args):
            while not os.path.exists(go):
                time.sleep(0.02)
            real(*args)
        common.save_checkpoint = save
    return patch


def test_a_run_folder_is_held_by_one_process(tiny_folder, stopped_run, tmp_path):
    """Two runs started together into one --out, and two --resume of one run at once: in each
    pair one stops with exit status 2 and one error line naming the process that holds the
    folder, and the folder holds the other's run alone (its config, one line per epoch, its
    backbone = its checkpoint's, no eval-*.json)."""
    go = tmp_path / "go"
    new, resumed = tmp_path / "new", copy_of(stopped_run, tmp_path, "resumed")
    argvs = [smoke_args(tiny_folder, new, "--seed", seed, *SMALL) for seed in "12"]
    argvs += [["--resume", resumed]] * 2
    errs = [tmp_path / f"err{i}" for i in range(4)]
    runs = [script(argv, err, wait_before_saving(go)) for argv, err in zip(argvs, errs)]
    pairs = [(runs[0], runs[1]), (runs[2], runs[3])]
    deadline = time.time() + 120  # the runs wait: in each pair the one refused must end alone
    while time.time() < deadline and not all(a.exitcode or b.exitcode for a, b in pairs):
        time.sleep(0.05)
    go.touch()
    for run in runs:
        run.join(timeout=300)
    for i, (folder, pair) in enumerate(zip((new, resumed), pairs)):
        codes = [run.exitcode for run in pair]
        assert sorted(codes) == [0, 2], [errs[2 * i + j].read_text()[-2000:] for j in (0, 1)]
        winner, refused = pair[codes.index(0)], 2 * i + codes.index(2)
        assert shown_lines(errs[refused].read_text()) == [
            f"error: {folder} is in use by process {winner.pid} on {socket.gethostname()}: a run "
            f"or --resume of it is going on; wait for it to end (or stop it), then try again"]
        config, _, _ = check_run_folder(folder)  # one metrics line per epoch
        if folder == new:  # the config of the run that trained here
            assert config["args"]["seed"] == int(argvs[runs.index(winner)][-len(SMALL) - 1])
        checkpoint = torch.load(folder / "checkpoint.pt", weights_only=True)["model"]
        backbone = torch.load(folder / "backbone.pt", weights_only=True)
        assert all(torch.equal(backbone[k], checkpoint[f"backbone.{k}"]) for k in backbone)
        assert not [n for n in os.listdir(folder) if n.startswith("eval-") or n.endswith(".tmp")]


def test_ctrl_c_mid_epoch_is_one_line_and_the_resume_is_exact(tiny_folder, tmp_path):
    """SIGINT in the second of 2 epochs: one line `interrupted; continue with --resume RUN`,
    exit status 130, no temp file; the resume (which the dead run's lock does not block) ends
    with every checkpoint tensor and loss of an uninterrupted run. (SIGTERM, a scheduler's:
    test_preemption.py.)"""
    argv = lambda out: smoke_args(tiny_folder, out, "--epochs", "2", *SMALL)  # noqa: E731
    simclr_dcl.main(argv(tmp_path / "straight"))
    straight = torch.load(tmp_path / "straight" / "checkpoint.pt", weights_only=True)
    out = tmp_path / "SIGINT"

    def signal_in_step_6():  # epoch 2's second step (4 steps an epoch)
        real, steps = simclr_dcl.train_step, []

        def step(*args):
            steps.append(1)
            if len(steps) == 6:
                os.kill(os.getpid(), signal.SIGINT)
            return real(*args)
        simclr_dcl.train_step = step

    err = tmp_path / "SIGINT.err"
    run = script(argv(out), err, signal_in_step_6)
    run.join(timeout=300)
    assert run.exitcode == 130, err.read_text()[-2000:]
    assert shown_lines(err.read_text()) == [f"interrupted; continue with --resume {out}"]
    assert not temp_files(out) and len(open(out / "metrics.jsonl").readlines()) == 1
    simclr_dcl.main(["--resume", str(out)])
    resumed = torch.load(out / "checkpoint.pt", weights_only=True)
    a, b = flat_tensors(straight), flat_tensors(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    losses = [[json.loads(line)["loss"] for line in open(run / "metrics.jsonl")]
              for run in (tmp_path / "straight", out)]
    assert losses[0] == losses[1]


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
        real = common.save_checkpoint
        monkeypatch.setattr(common, "save_checkpoint", lambda *a: saves.append(1) or (
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


GONE = object()  # an option removed from config.json


@pytest.mark.parametrize("args, argv, message", [
    ({"temperature": GONE}, [], "--temperature is missing, which the command line reads as 0.1"),
    ({"epochs": "2"}, [], '--epochs is "2", which the command line reads as 2'),
    ({"temperature": 0.2}, [], "--temperature is 0.2, which the command line reads as 0.1"),
    ({}, ["--epochs", "2.5"], "argument --epochs: invalid int value: '2.5'"),
    ({}, ["--epochs", "-3"], "argument --epochs: must be 0 or a positive integer, got -3"),
    ({}, ["--crop-scale", "1", "0.5"], "--crop-scale 1.0 0.5: need 0 < MIN <= MAX <= 1"),
    ({}, ["--loss", "dcl2"], "argument --loss: invalid choice: 'dcl2'"),
    ({}, ["--symmetric"], "unrecognized arguments: --symmetric"),
    ([], None, "--dataset is missing, which the command line reads as \"imagefolder\""),
    (None, None, "no readable config.json with its command line"),  # config.json is `null`
], ids=["missing", "string", "default-changed", "float", "negative", "crop", "choice", "unknown",
        "list", "null"])
def test_a_saved_config_is_checked_as_the_command_line_is(stopped_run, tmp_path, capsys, args,
                                                          argv, message):
    """config.json on --resume: its recorded command line is parsed again and must give the
    recorded options. A missing option, one that reads otherwise now (a default changed since the
    run), a value the parser refuses and no options at all are one line each."""
    run = copy_of(stopped_run, tmp_path)
    config = json.load(open(run / "config.json"))
    if isinstance(args, dict):
        config["args"].update(args)
        config["args"] = {k: v for k, v in config["args"].items() if v is not GONE}
        config["argv"] += argv
    else:
        config = None if args is None else {**config, "args": args}
    (run / "config.json").write_text(json.dumps(config))
    fails_with(["--resume", str(run)], capsys, message)
    assert (run / "metrics.jsonl").read_bytes() == (stopped_run / "metrics.jsonl").read_bytes()


@pytest.mark.parametrize("checkpoint, message", [
    (torch.zeros(3), "does not fit this run or is unreadable (AttributeError"),
    ({"model": {}}, "does not fit this run (states missing: optimizer; left over: none)"),
    ({"epoch": 1}, "does not fit this run (states missing: model, optimizer; left over: none)"),
], ids=["tensor", "model-only", "epoch-only"])
def test_a_checkpoint_of_the_wrong_structure_is_one_error_line(stopped_run, tmp_path, capsys,
                                                               checkpoint, message):
    """A checkpoint.pt that loads but is not a dict with the epochs done and every state."""
    run = copy_of(stopped_run, tmp_path)
    torch.save(checkpoint, run / "checkpoint.pt")
    fails_with(["--resume", str(run)], capsys, f"{run / 'checkpoint.pt'} {message}")


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
