"""A run survives its scheduler: a checkpoint at each epoch's end; a lost process in epoch 2 of a
2-process run loses only that epoch, and the same command then continues to the end of an
uninterrupted run, bit for bit; a finished run, another command, or --resume with another
option changes nothing in the folder. Each method file stopped by each signal:
tests/test_each_method.py. The runs are real processes (no fork of this one)."""

import json
import os
import subprocess
import sys

import pytest
import torch

import common
from helpers import HARNESS, ROOT, _env, harness_module, tiny, torchrun
from test_common import fails_with
from test_runs import flat_tensors

# 64 images, batch 16: 4 steps an epoch, 2 epochs
harness = harness_module()  # the README's first quick-start script

SIGNALLED = os.path.join(ROOT, "tests", "signal_at_step.py")


def command(script, out, *more):
    """The script's quick start made tiny (helpers.tiny: 2 epochs of 4 steps), then `more`."""
    return [*tiny(script, *more), "--out", str(out)]


def signalled(script, argv, rank, call, name, nproc=1):
    """SCRIPT.py ARGV (as tests/signal_at_step.py runs it: the same command), which sends
    SIG<name> to rank RANK as it enters its call-th train_step; 1 or 2 processes."""
    launcher = [sys.executable] if nproc == 1 else torchrun(nproc)
    wrapper = [SIGNALLED, script, str(rank), str(call), name]
    return subprocess.run(launcher + wrapper + [str(a) for a in argv], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)


def same_run(a, b):
    """Two finished run folders alike: results.json (but the command's --out), backbone.pt's and
    the last checkpoint's tensors, every epoch's loss."""
    results = [json.loads((run / "results.json").read_text()) for run in (a, b)]
    commands = [r.pop("command").split(" --out ") for r in results]
    assert commands[0][0] == commands[1][0] and results[0] == results[1]
    for name in ("backbone.pt", "checkpoint.pt"):
        x = flat_tensors(torch.load(a / name, weights_only=True))
        y = flat_tensors(torch.load(b / name, weights_only=True))
        assert x.keys() == y.keys() and len(x) > 10, name
        assert all(torch.equal(x[k], y[k]) for k in x), name
    losses = [[json.loads(line)["loss"] for line in open(run / "metrics.jsonl")] for run in (a, b)]
    assert losses[0] == losses[1] and len(losses[0]) == 2


def errors(text):
    return [line for line in text.splitlines() if line.startswith(("error", "stopped"))]


def test_two_processes_killed_in_epoch_2_continue_bit_for_bit(tmp_path):
    """torchrun, 2 processes: rank 1 killed (SIGKILL, a lost node) in epoch 2's third step ends
    the run with a non-zero status; epoch 1's checkpoint is kept, and the same command then ends
    as an uninterrupted 2-process run, bit for bit."""
    script = os.path.join(ROOT, f"{HARNESS}.py")
    straight = subprocess.run(
        torchrun(2) + [script] + command(HARNESS, tmp_path / "straight"),
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert straight.returncode == 0, straight.stderr[-3000:]
    out = tmp_path / "run"
    argv = command(HARNESS, out)
    kill = signalled(HARNESS, argv, 1, 7, "KILL", nproc=2)
    assert kill.returncode != 0
    assert torch.load(out / "checkpoint.pt", weights_only=True)["epoch"] == 1
    again = subprocess.run(torchrun(2) + [script] + argv,
                           cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"continuing {out} from epoch 2" in again.stdout
    same_run(tmp_path / "straight", out)


def test_a_finished_run_another_command_or_option_change_nothing_in_the_folder(tmp_path, capsys):
    """In a finished run's folder: another command line (another seed; another script) is refused
    with one line naming the run's command and what differs; --resume with an option beside it (--epochs 4, which would
    extend the schedule) is one line, exit status 2; the same command, and --resume alone, say
    that the run is finished, exit status 0. Nothing in the folder changes."""
    import nnclr_dcl
    
    out = tmp_path / "run"
    argv = command(HARNESS, out)
    harness.main(argv)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    line = fails_with(command(HARNESS, out, "--seed", "1"), capsys,
                      f"--out {out} holds the run of `{HARNESS}.py ")
    assert "not this command's (its --seed)" in line and line.count(f"{HARNESS}.py") == 1
    assert "run that command again to continue it" in line
    fails_with(["--resume", out, "--epochs", "4"], capsys,
               f"--resume {out} continues that run as it was started, with no other option; "
               f"to train it otherwise, start a new --out")
    with pytest.raises(SystemExit) as exit_info:
        common.run(lambda: nnclr_dcl.main(argv))
    assert exit_info.value.code == 2
    assert "not nnclr_dcl.py's" in capsys.readouterr().err
    for again in (argv, ["--resume", out]):
        with pytest.raises(SystemExit) as exit_info:
            common.run(lambda: harness.main(again))
        assert exit_info.value.code == 0
        assert capsys.readouterr().err.splitlines() == [f"{out} is finished (results.json)"]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
