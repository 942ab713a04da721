"""A run survives its scheduler: a lost process in epoch 2 of a 2-process run loses only that epoch,
and the same command then ends as an uninterrupted run, bit for bit; a finished run or another
command changes nothing in the folder (each method file killed at one process:
tests/test_each_method.py)."""

import os
import subprocess
import sys

import pytest
import torch

import common
from helpers import HARNESS, ROOT, _env, harness_module, run_ok, same_run, tiny, torchrun
from test_common import fails_with

harness = harness_module()  # the README's first quick-start script

KILLER = os.path.join(ROOT, "tests", "kill_at_step.py")


def command(script, out, *more):
    """The script's quick start made tiny (helpers.tiny: 2 epochs of 4 steps), then `more`."""
    return [*tiny(script, *more), "--out", str(out)]


def killed(script, argv, rank, call, nproc=1):
    """SCRIPT.py ARGV (as tests/kill_at_step.py runs it: the same command), its rank RANK killed
    (SIGKILL) as it enters its call-th train_step; 1 or 2 processes."""
    launcher = [sys.executable] if nproc == 1 else torchrun(nproc)
    return subprocess.run(launcher + [KILLER, script, str(rank), str(call)] + list(map(str, argv)),
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)


def test_two_processes_killed_in_epoch_2_continue_bit_for_bit(tmp_path):
    """torchrun, 2 processes: rank 1 killed (SIGKILL, a lost node) in epoch 2's third step ends
    the run; epoch 1's checkpoint is kept, and the same command then ends as an uninterrupted
    2-process run, bit for bit."""
    run_ok(f"{HARNESS}.py", command(HARNESS, tmp_path / "straight"), nproc=2)
    out = tmp_path / "run"
    argv = command(HARNESS, out)
    assert killed(HARNESS, argv, 1, 7, nproc=2).returncode != 0
    assert torch.load(out / "checkpoint.pt", weights_only=True)["epoch"] == 1
    again = run_ok(f"{HARNESS}.py", argv, nproc=2)
    assert f"continuing {out} from epoch 2" in again.stdout
    same_run(tmp_path / "straight", out)


def test_a_finished_run_or_another_command_change_nothing_in_the_folder(tmp_path, capsys):
    """In a finished run's folder: another command line (another seed; another script) is refused
    with one line naming the run's command and what differs, exit status 2; the same command says
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
    with pytest.raises(SystemExit) as exit_info:
        common.run(lambda: nnclr_dcl.main(argv))
    assert exit_info.value.code == 2
    assert "not nnclr_dcl.py's" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        common.run(lambda: harness.main(argv))
    assert exit_info.value.code == 0
    assert capsys.readouterr().err.splitlines() == [f"{out} is finished (results.json)"]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
