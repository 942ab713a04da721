"""benchmarks/linear_eval.py, the authors' probes on a finished run: the backbone bit-identical,
2 processes as one, a batch they do not divide, and RUN/linear_NAME.json."""
import json
import os
import sys

import pytest
import torch

import common
from helpers import (ROOT, check_run_folder, ctx_for, harness_module, run_distributed, run_ok,
                     smoke_args)

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import linear_eval  # noqa: E402


def streamed(folder):
    """The tiny folder, streamed: 72 training, 18 validation images."""
    args = harness_module().parse_args(smoke_args(folder, "unused"))
    data = common.load_data(args, ctx_for())
    assert data.streaming
    return data


def probe(data, ctx, protocol="moco", backbone=None):
    """linear_eval() for 2 epochs (on a width-8 ResNet-18 from seed 0 unless given) -> (the
    classifier's state, top-1 %)."""
    if backbone is None:
        torch.manual_seed(0)
        backbone = common.ResNet("resnet18", 8, 16)
    made = []
    make = common.linear_classifier
    common.linear_classifier = lambda *a, **k: made.append(make(*a, **k)) or made[-1]
    try:
        test = common.extract_features(backbone, data.eval_test, data, ctx, unit=False)
        top1 = linear_eval.linear_eval(backbone, data, ctx, protocol, test, 2)
    finally:
        common.linear_classifier = make
    return {k: v.detach().clone() for k, v in made[0].state_dict().items()}, top1


def _worker(folder):
    return probe(streamed(folder), ctx_for(common.rank(), 2))


def test_the_streamed_probe_on_two_processes_equals_one(tiny_folder, tmp_path):
    """The moco protocol on a streamed folder trains the same classifier on 2 ranks as on one:
    each rank crops its rows as one process would, and the gradient is the global batch's mean."""
    ranks = run_distributed("test_linear_eval", "_worker", tmp_path, tiny_folder)
    single, top1 = probe(streamed(tiny_folder), ctx_for())
    for classifier, rank_top1 in ranks:
        assert rank_top1 == top1
        for key, value in single.items():
            assert torch.allclose(classifier[key], value, rtol=1e-4, atol=1e-4), key
    start = common.linear_classifier(64, 3, "cpu", 0, std=0.01).weight  # width 8: 64 features
    assert (single["weight"] - start).abs().max() > 1e-2


def test_every_protocol_leaves_the_backbone_bit_identical(tiny_folder):
    """After each protocol's probe on a backbone in train mode, every parameter and BatchNorm
    buffer (running mean/var, num_batches_tracked) is bit-identical."""
    data = streamed(tiny_folder)
    backbone = common.ResNet("resnet18", 8, 16)
    before = {k: v.clone() for k, v in backbone.state_dict().items()}
    for protocol in linear_eval.PROTOCOLS:
        probe(data, ctx_for(), protocol, backbone.train())
        for key, value in backbone.state_dict().items():
            assert torch.equal(before[key], value), (protocol, key)


def test_a_batch_the_processes_do_not_divide_still_runs(tiny_folder):
    """Rank 0 of 5: the batch, the 72 training images, becomes 70, 14 images a process; the
    top-1 counts rank 0's 4 of the 18 validation images."""
    _, top1 = probe(streamed(tiny_folder), ctx_for(0, 5), "gsg-cifar")
    correct = top1 * 4 / 100
    assert abs(correct - round(correct)) < 1e-9


@pytest.fixture(scope="module")
def finished_run(tiny_folder, tmp_path_factory):
    """The harness script's tiny run on the streamed folder, finished."""
    out = tmp_path_factory.mktemp("run")
    harness_module().main(smoke_args(tiny_folder, out))
    return out


def test_a_finished_streamed_run_gets_its_linear_json(finished_run, monkeypatch):
    """A streamed run, its fixed probe too; main() on it decodes the 18 validation images once
    and a crop of each training image an epoch, and writes linear_gsg-cifar.json, whose top-1
    counts the 18."""
    _, _, results = check_run_folder(finished_run, epochs=1)
    assert 0 <= results["linear_top1"] <= 100
    decoded = []
    real = common.ImageFiles.__getitem__
    monkeypatch.setattr(common.ImageFiles, "__getitem__",
                        lambda self, i: decoded.append(i) or real(self, i))
    linear_eval.main([str(finished_run), "--protocol", "gsg-cifar", "--epochs", "2"])
    assert len(decoded) == 18 + 2 * 72
    saved = json.load(open(finished_run / "linear_gsg-cifar.json"))
    assert (saved["protocol"], saved["epochs"]) == ("gsg-cifar", 2)
    correct = saved["linear_top1"] * 18 / 100
    assert abs(correct - round(correct)) < 1e-9


def test_the_command_on_a_finished_run_writes_linear_moco_json(finished_run):
    """`python benchmarks/linear_eval.py RUN --protocol moco --epochs 1`, a process of its own,
    writes RUN/linear_moco.json and says so."""
    argv = [finished_run, "--protocol", "moco", "--epochs", 1]
    done = run_ok("benchmarks/linear_eval.py", argv)
    path = finished_run / "linear_moco.json"
    saved = json.load(open(path))
    assert (saved["protocol"], saved["epochs"]) == ("moco", 1)
    assert 0 <= saved["linear_top1"] <= 100 and f"written to {path}" in done.stdout
