"""A run's decisions: "the same command" as the same options once parsed, each split's features
extracted once at the end, and --device's mistakes as one line (tiny runs of the harness
script)."""

import json

import pytest
import torch

import common
from helpers import harness_module, smoke_args, stop_in_epoch
from test_common import fails_with

harness = harness_module()  # the README's first quick-start script
SMALL = ["--proj-hidden", "32", "--linear-epochs", "0"]


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


def test_the_end_of_a_run_decodes_each_image_once(tiny_folder, tmp_path, monkeypatch):
    """One epoch on a streamed folder (4 steps of 16 of its 72 images): the last epoch's kNN
    monitor and results.json share their features, each evaluation image decoded once."""
    decoded = []
    real = common.ImageFiles.__getitem__

    def counted(self, i):
        decoded.append(i)
        return real(self, i)

    monkeypatch.setattr(common.ImageFiles, "__getitem__", counted)
    harness.main(smoke_args(tiny_folder, tmp_path / "a", "--linear-epochs", "3"))
    assert len(decoded) == 64 + 72 + 18


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
    """Under torchrun each process takes its LOCAL_RANK's GPU: `--device cuda:1` (every rank on one
    GPU) and a LOCAL_RANK past the GPUs are one line each, before any process group."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", local_rank)
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    args = harness.parse_args(["--device", device, "--batch-size", "8"])
    with pytest.raises(common.UserError, match=message):
        common.setup(args)
