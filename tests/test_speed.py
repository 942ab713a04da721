"""benchmarks/speed.py on the CPU at the smallest sizes. Without a GPU this is what keeps its
`training` (which tests/test_cuda.py builds every step with) in step with the method files."""
import os
import sys

import torch

import common
from helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import speed  # noqa: E402

TINY = speed.Preset(4, 8, 8, 32, 16, 1, 0, 64, speed.SMALL_HEADS)  # 4 steps of 8 images
CPU = common.Context(0, 1, 0, torch.device("cpu"), "", False)


def test_the_tables_have_a_row_per_method_and_the_two_baselines(tmp_path, monkeypatch):
    """main() at the tiny preset writes one row per method (positive rates, no sync count or GPU
    memory on a CPU) and the augmentation and optimiser rows."""
    monkeypatch.setitem(speed.PRESETS, "cpu", TINY)
    out = tmp_path / "speed.md"
    speed.main(["--device", "cpu", "--out", str(out)])
    rows = [line.split(" | ") for line in out.read_text().splitlines() if line.startswith("| ")]
    methods = {r[0][2:]: r for r in rows if r[0][2:] in speed.METHODS}
    assert list(methods) == list(speed.METHODS)
    for cells in methods.values():
        assert float(cells[3].replace(",", "")) > 0 and float(cells[5]) > 0
        assert cells[7:] == ["n/a", "n/a |"]
    assert [r[0][2:] for r in rows[-2:]] == ["augmentation, SimCLR's recipe, 8 px, 64 images",
                                             "optimiser step, ResNet-18 w4"]


def test_the_bare_step_replays_the_networks_the_real_step_called():
    """BYOL + GSG: the online network once on the four crops, with gradient, then the momentum
    encoder on each crop without; MoCo v2: the query network on view 1 with gradient and on view
    2 without (its BatchNorm and probes), the key encoder on each view without. The queue is never
    called."""
    data = speed.held_data(TINY, CPU.device)
    for name, expected in (("byol-gsg", [("net", 4, True)] + [("target", 1, False)] * 4),
                           ("mocov2", [("net", 1, True), ("net", 1, False)] + [("key_encoder", 1, False)] * 2)):
        mod, options = speed.METHODS[name]
        t = speed.training(mod, [*options, "--width", "4", "--batch-size", "8",
                                 *speed.SMALL_HEADS[mod]], CPU, 8)
        views = common.Augment(mod.recipes(t.args), 8, data.mean, data.std, CPU)(
            data.train[:8], torch.Generator().manual_seed(0))
        calls = speed.recorded_step(t, views, data.train_labels[:8], torch.Generator())
        names = {id(m): n for n, m in t.modules.items()}
        assert [(names[id(m)], len(inputs), grad) for m, inputs, grad in calls] == expected
        assert all(x is v for x, v in zip(calls[0][1], views))  # the very views of the step
