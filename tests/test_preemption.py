"""A cluster job survives its scheduler (issue 37): the same command run again continues its run
folder; SIGTERM or SIGUSR1 writes a checkpoint at the step reached and exits 75; a killed process,
or a lost rank under torchrun, loses only what came after the last checkpoint; and the run then
ends bit for bit as one never stopped (CPU, generated textures, tiny nets)."""

import importlib
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys

import pytest
import torch

import common
from helpers import ROOT, _env, free_port, torchrun
from test_common import fails_with
from test_faults import shown_lines
from test_runs import flat_tensors

# 64 images, batch 16: 4 steps an epoch (each of 2 processes: 8 images a step)
TINY = ["--dataset", "textures", "--limit-train", "64", "--batch-size", "16", "--width", "4",
        "--epochs", "2", "--warmup-epochs", "1", "--proj-hidden", "16", "--proj-dim", "8",
        "--knn-k", "10", "--linear-epochs", "0", "--device", "cpu", "--workers", "0"]
# each script with its own state: a queue, an EMA target and GSG's pairings, a support set
OWN = {
    "simclr_dcl": ["--loss", "dclw"],
    "moco_simmoco_simco": ["--method", "mocov2", "--symmetric", "--queue-size", "24"],
    "simsiam_byol_gsg": ["--method", "byol", "--stopgrad", "random", "--pred-hidden", "8"],
    "nnclr_dcl": ["--support-size", "24", "--pred-hidden", "8"],
}


def command(script, out, *more):
    return [*TINY, *OWN[script], *more, "--out", str(out)]


def forked(script, argv, err, call=0, name="", world=1):
    """SCRIPT's main(argv) under common.run in `world` processes forked from this one (no second
    import of torch), joined as torchrun joins its workers; rank r's stderr into `err`.r. Rank 0
    sends itself SIG<name> as it enters its call-th train_step. Returns each rank's status."""
    port = free_port()

    def main(rank):
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        sys.stdout = open(os.devnull, "w")
        sys.stderr = open(f"{err}.{rank}", "w", buffering=1)
        module = importlib.import_module(script)
        real, calls = module.train_step, []

        def train_step(*args, **kwargs):
            calls.append(1)
            if len(calls) == call and rank == 0:
                os.kill(os.getpid(), getattr(signal, f"SIG{name}"))
            return real(*args, **kwargs)
        module.train_step = train_step
        common.run(lambda: module.main(argv))

    fork = multiprocessing.get_context("fork")
    processes = [fork.Process(target=main, args=(rank,)) for rank in range(world)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=300)
    return [process.exitcode for process in processes]


def same_run(a, b):
    """Two finished run folders alike: results.json byte for byte, backbone.pt's and the last
    checkpoint's tensors, every epoch's loss."""
    assert (a / "results.json").read_bytes() == (b / "results.json").read_bytes()
    for name in ("backbone.pt", "checkpoint.pt"):
        x = flat_tensors(torch.load(a / name, weights_only=True))
        y = flat_tensors(torch.load(b / name, weights_only=True))
        assert x.keys() == y.keys() and len(x) > 10, name
        assert all(torch.equal(x[k], y[k]) for k in x), name
    losses = [[json.loads(line)["loss"] for line in open(run / "metrics.jsonl")] for run in (a, b)]
    assert losses[0] == losses[1] and len(losses[0]) == 2


# script, the signal, the train_step call it comes in (4 a epoch), the checkpoint it leaves
STOPS = [
    ("simclr_dcl", "KILL", 6, (1, None)),  # in epoch 2: epoch 1's checkpoint
    ("simsiam_byol_gsg", "TERM", 6, (1, 2)),  # epoch 2, step 2
    ("moco_simmoco_simco", "USR1", 4, (0, 4)),  # epoch 1's last step
    ("nnclr_dcl", "TERM", 1, (0, 1)),  # the first step
]


@pytest.mark.parametrize("script, name, call, saved", STOPS, ids=[s[0] for s in STOPS])
def test_a_stopped_run_continues_with_the_same_command_bit_for_bit(tmp_path, capsys, script,
                                                                   name, call, saved):
    """One process stopped mid-run, then the same command again: SIGKILL loses the epoch in
    progress; SIGTERM or SIGUSR1 ends the step, writes checkpoint.pt with the epochs done and
    the steps of the next, prints one line and exits 75. The same command then continues (and
    says so) and ends as an uninterrupted run: results.json, backbone.pt, the checkpoint's
    tensors and every loss."""
    module = importlib.import_module(script)
    module.main(command(script, tmp_path / "straight"))
    out = tmp_path / "stopped"
    err = tmp_path / "err"
    code, = forked(script, command(script, out), err, call, name)
    checkpoint = torch.load(out / "checkpoint.pt", weights_only=True)
    assert (checkpoint["epoch"], checkpoint.get("step")) == saved
    if name == "KILL":
        assert code == -9
    else:
        epoch, step = saved
        text = open(f"{err}.0").read()
        assert code == 75, text[-2000:]
        assert shown_lines(text) == [
            f"preempted (SIG{name}) in epoch {epoch + 1} at step {step} of 4: checkpoint.pt "
            f"written; run the same command again to continue"]
    capsys.readouterr()
    module.main(command(script, out))
    epoch, step = saved
    assert f"continuing {out} from epoch {epoch + 1} step {step or 0} (the same command)" in (
        capsys.readouterr().out)
    same_run(tmp_path / "straight", out)


def test_a_finished_run_and_another_command_change_nothing_in_the_folder(tmp_path, capsys):
    """The same command in a finished run's folder: one line, exit status 0, nothing trained
    (a requeued job that had finished succeeds at once). Another command line there (another
    seed; another script) is refused with one line naming both, nothing in the folder changed."""
    import nnclr_dcl
    import simclr_dcl

    out = tmp_path / "run"
    argv = command("simclr_dcl", out, "--stop-after", "1")
    simclr_dcl.main(argv)
    other = command("simclr_dcl", out, "--stop-after", "1", "--seed", "1")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    line = fails_with(other, capsys, f"--out {out} holds the run of `simclr_dcl.py ")
    assert f"--seed 1 --out {out}`" in line and line.count("simclr_dcl.py") == 2
    assert "run that command again to continue it" in line and f"--resume {out}" in line
    with pytest.raises(SystemExit) as exit_info:
        common.run(lambda: nnclr_dcl.main(argv))
    assert exit_info.value.code == 2
    assert "`nnclr_dcl.py " in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    simclr_dcl.main(command("simclr_dcl", out, "--stop-after", "1"))  # epoch 2, to the end
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        common.run(lambda: simclr_dcl.main(argv))
    assert exit_info.value.code == 0
    assert shown_lines(capsys.readouterr().err) == [
        f"{out} is finished (results.json); --resume {out} evaluates it again"]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def torchrun_script(args, wrapper=()):
    """simclr_dcl.py ARGS (or tests/signal_at_step.py simclr_dcl WRAPPER ARGS, the same command)
    under torchrun, 2 processes."""
    script = [os.path.join(ROOT, "tests", "signal_at_step.py"), "simclr_dcl", *wrapper]
    if not wrapper:
        script = [os.path.join(ROOT, "simclr_dcl.py")]
    return subprocess.run(torchrun(2) + script + [str(a) for a in args], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)


def test_two_processes_stop_together_and_a_lost_rank_costs_only_its_epoch(tmp_path):
    """2 processes: SIGTERM to rank 0 alone in epoch 1's third step stops both ranks after it
    (one line, exit status 75, the checkpoint at step 3). Under torchrun, the same command
    continues, and rank 1 killed (SIGKILL) in epoch 2 makes rank 0 end with one error line naming
    the command to run again, no traceback of ours (torchrun SIGTERMs it too); the same command
    then ends as an uninterrupted 2-process run, bit for bit."""
    assert forked("simclr_dcl", command("simclr_dcl", tmp_path / "straight"), tmp_path / "e",
                  world=2) == [0, 0]
    out = tmp_path / "run"
    argv = command("simclr_dcl", out)
    assert forked("simclr_dcl", argv, tmp_path / "err", 3, "TERM", world=2) == [75, 75]
    assert [shown_lines(open(f"{tmp_path / 'err'}.{rank}").read()) for rank in (0, 1)] == [
        ["preempted (SIGTERM) in epoch 1 at step 3 of 4: checkpoint.pt written; run the same "
         "command again to continue"], []]
    checkpoint = torch.load(out / "checkpoint.pt", weights_only=True)
    assert (checkpoint["epoch"], checkpoint["step"]) == (0, 3)
    kill = torchrun_script(argv, ["1", "3", "KILL"])  # epoch 1's 4th step, epoch 2's 1st, 2nd
    assert kill.returncode != 0
    assert f"continuing {out} from epoch 1 step 3 (the same command)" in kill.stdout
    errors = [line for line in kill.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and re.fullmatch(
        r"error: another process of this run stopped \(Connection (reset|closed) by peer\); "
        r"the last checkpoint is kept: run the same command again to continue", errors[0]
    ), kill.stderr[-3000:]
    assert 'common.py", line' not in kill.stderr
    checkpoint = torch.load(out / "checkpoint.pt", weights_only=True)
    assert checkpoint["epoch"] == 1 and "step" not in checkpoint  # none from a half-done step
    again = torchrun_script(argv)
    assert again.returncode == 0, again.stderr[-3000:]
    same_run(tmp_path / "straight", out)
