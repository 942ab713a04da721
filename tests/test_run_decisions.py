"""A run's decisions, as a cluster sees them: made once by rank 0 and followed by every rank (a
rank that does not see rank 0's folder stops every rank with one line), "the same command" as the
same options once parsed, no git needed, each split's features extracted once at the end, a
signal to the whole process group with DataLoader workers running, and --device's mistakes as one
line (tiny runs of the harness script on CPU)."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

import common
from helpers import (HARNESS, ROOT, _env, harness_module, smoke_args, stop_in_epoch,
                     texture_image_folder, torchrun)
from test_common import fails_with
from test_runs import _torchrun_node

harness = harness_module()  # the README's first quick-start script
SMALL = ["--proj-hidden", "32", "--linear-epochs", "0"]


def error_lines(*texts):
    return [line for text in texts for line in text.splitlines()
            if line.startswith(("error", "stopped"))]


def test_a_run_needs_no_git(tiny_folder, tmp_path):
    """With no `git` on the PATH (a slim container) the run trains; config.json records no
    commit. Where git answers, it records the commit."""
    env = dict(_env(), PATH=str(tmp_path / "empty"))
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, f"{HARNESS}.py"),
         *map(str, smoke_args(tiny_folder, out, "--epochs", "0", *SMALL))],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    config = json.loads((out / "config.json").read_text())
    assert "git_commit" not in config["versions"]
    assert (out / "results.json").exists()


def test_the_same_options_once_parsed_are_the_same_command(tiny_folder, tmp_path, capsys):
    """A run started with `--out=X` continues with `--out X/`, its options in another order and
    other --workers; another value of a trained option is refused with one line naming it."""
    out = tmp_path / "run"
    argv = smoke_args(tiny_folder, out, "--epochs", "2", *SMALL)
    i = argv.index("--out")
    stop_in_epoch(2, argv[:i] + [f"--out={out}"] + argv[i + 2:])
    capsys.readouterr()
    rest = argv[:i] + argv[i + 2:]
    options = dict(zip(rest[::2], rest[1::2]))  # the last of each, as argparse takes it
    again = ["--out", f"{out}/", *sum(reversed(options.items()), ()), "--workers", "1"]
    harness.main(again)
    assert f"continuing {out}/ from epoch 2" in capsys.readouterr().out
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in lines] == [1, 2]
    line = fails_with([*argv, "--lr", "0.1"], capsys, "holds the run of")
    assert line.endswith("not this command's (its --lr): run that command again to continue it,"
                         " or choose another --out")


def test_resume_takes_this_machines_workers_and_device(tiny_folder, tmp_path, capsys):
    """--resume RUN with --workers and --device, which change nothing a run trains, continues
    RUN (before, a --workers other than the machine's default was refused)."""
    out = tmp_path / "run"
    stop_in_epoch(2, smoke_args(tiny_folder, out, "--epochs", "2", *SMALL))
    capsys.readouterr()
    harness.main(["--resume", str(out), "--workers", "1", "--device", "cpu"])
    assert f"continuing {out} from epoch 2" in capsys.readouterr().out
    assert (out / "results.json").exists()


def _node_commands(folder, outs, port):
    return [[*_torchrun_node(n, port), os.path.join(ROOT, f"{HARNESS}.py"),
             *map(str, smoke_args(folder, outs[n], "--epochs", "2", *SMALL))]
            for n in range(2)]


@pytest.mark.parametrize("node_0_holds", ["nothing", "a stopped run"])
def test_a_rank_that_does_not_see_rank_0s_folder_stops_every_rank(tiny_folder, tmp_path,
                                                                  node_0_holds):
    """Two torchrun "nodes" on this machine, each with its own --out (a disk only its node
    sees): every rank stops, one line names the cause, and rank 0's folder is left as it was
    (before, with a checkpoint in node 0's folder, rank 0 continued while rank 1 started afresh,
    and gloo aborted)."""
    from helpers import free_port

    outs = [tmp_path / "node0" / "run", tmp_path / "node1" / "run"]
    if node_0_holds == "a stopped run":
        argv = smoke_args(tiny_folder, outs[0], "--epochs", "2", *SMALL)
        stop_in_epoch(2, argv)
    before = sorted(os.listdir(outs[0])) if outs[0].exists() else []
    nodes = [subprocess.Popen(command, cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for command in _node_commands(tiny_folder, outs, free_port())]
    outputs = [node.communicate(timeout=300) for node in nodes]
    assert all(node.returncode != 0 for node in nodes), outputs
    stderr = outputs[0][1] + outputs[1][1]
    lines = error_lines(stderr)
    assert len(lines) == 1 and "every node sees" in lines[0], stderr[-3000:]
    assert "[rank" not in stderr, stderr[-3000:]  # no rank's traceback (torchrun prints its own)
    if before:
        assert sorted(os.listdir(outs[0])) == before


def test_the_end_of_a_run_decodes_each_image_once(tiny_folder, tmp_path, monkeypatch):
    """One epoch on a streamed folder (72 training, 18 validation images; 4 steps of 16): the
    last epoch's kNN monitor and results.json share their features, so each evaluation image is
    decoded once."""
    decoded = []
    real = common.ImageFiles.__getitem__

    def counted(self, i):
        decoded.append(i)
        return real(self, i)

    monkeypatch.setattr(common.ImageFiles, "__getitem__", counted)
    harness.main(smoke_args(tiny_folder, tmp_path / "a", "--linear-epochs", "3"))
    assert len(decoded) == 64 + 72 + 18


@pytest.mark.parametrize("nproc", [1, 2])
def test_sigterm_to_the_process_group_with_workers_is_one_line(tmp_path, nproc):
    """SIGTERM to every process of the job at once (as Slurm ends a job step) while 2
    DataLoader workers a process decode a streamed folder: the run's one line, no worker's or
    rank's traceback (torchrun prints its own), exit status 143 at 1 process. Before: "DataLoader
    worker (pid N) is killed by signal" tracebacks, and torchrun's second SIGTERM broke a rank's
    ending."""
    folder = texture_image_folder(str(tmp_path / "data"))
    argv = smoke_args(folder, tmp_path / "run", "--workers", "2", *SMALL)
    launcher = [sys.executable] if nproc == 1 else torchrun(nproc)
    wrapper = [os.path.join(ROOT, "tests", "signal_at_step.py"), HARNESS, "0", "3",
               "TERM-JOB"]
    done = subprocess.run([*launcher, *wrapper, *map(str, argv)], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300, )
    stderr = done.stderr
    # torchrun's own traceback (its SignalException) is torchrun's; a rank's would be here
    ours = stderr.split("torch.distributed.elastic.multiprocessing.api.SignalException")[0]
    for sign in ("DataLoader worker", "KeyboardInterrupt", "Exception ignored", "[rank"):
        assert sign not in ours, stderr[-3000:]
    if nproc == 1:
        assert "Traceback" not in stderr, stderr[-3000:]
    lines = error_lines(stderr)
    assert len(lines) == 1 and lines[0].startswith("stopped (SIGTERM)"), stderr[-3000:]
    if nproc == 1:
        assert done.returncode == 128 + signal.SIGTERM
    else:
        assert done.returncode != 0


def test_a_device_that_does_not_exist_is_one_line(tiny_folder, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        harness.parse_args(["--device", "foo"])
    assert exit_info.value.code == 2
    assert "--device" in capsys.readouterr().err
    if not torch.cuda.is_available():
        argv = smoke_args(tiny_folder, tmp_path / "run")
        fails_with([*argv, "--device", "cuda"], capsys, "no GPU")


@pytest.mark.parametrize("device, local_rank, gpus, message", [
    ("cuda:1", "1", 2, "LOCAL_RANK"),  # torchrun: an explicit index is refused
    ("cuda", "2", 2, "LOCAL_RANK 2"),  # a local rank without its GPU
])
def test_torchrun_takes_each_local_ranks_gpu(monkeypatch, device, local_rank, gpus, message):
    """Under torchrun each process takes its LOCAL_RANK's GPU: `--device cuda:1` would bind every
    rank to one GPU, and a LOCAL_RANK past the GPUs has none; each is one line, before any
    process group."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", local_rank)
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    args = harness.parse_args(["--device", device, "--batch-size", "8"])
    with pytest.raises(common.UserError, match=message):
        common.setup(args)
