"""No step builds a tensor from Python data (DESIGN section 3). On a
GPU each such tensor is a blocking host-to-device copy: the host
waits for its GPU every step, and with 8 GPUs every host waits for
the slowest. The CPU sees the same line as one aten.lift_fresh."""
import collections
import os
import sys

import pytest
import torch

import common
import moco_simmoco_simco as mss
import nnclr_dcl
import simclr_dcl
import simsiam_byol_gsg as gsg
from helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import speed  # noqa: E402

CPU = common.Context(0, 1, 0, torch.device("cpu"), "", False)
# every method file, and each train_step path of its own
# (a second queue, no key encoder, GSG's pairs, DCLW)
STEPS = {
    "simclr-dclw": (simclr_dcl, ["--loss", "dclw"]),
    "mocov2-symmetric": (mss, ["--method", "mocov2", "--symmetric"]),
    "simco": (mss, ["--method", "simco"]),
    "simsiam-gsg": (gsg, ["--method", "simsiam", "--stopgrad", "guided"]),
    "byol-random": (gsg, ["--method", "byol", "--stopgrad", "random"]),
    "nnclr-dcl": (nnclr_dcl, ["--loss", "dcl"]),
}
# torch.tensor, as_tensor and new_tensor of Python data, on the CPU
# (on CUDA the copy that follows is a second op). A Python number
# given to an op (scalar_tensor) is no copy: CUDA's kernels take it
# as an argument.
FROM_PYTHON_DATA = {"lift_fresh", "lift_fresh_copy"}


class OpNames(speed.OpCounter):
    """speed.py's counter, by op name."""

    def __init__(self):
        super().__init__()
        self.names = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names[func.overloadpacket.__name__] += 1
        return super().__torch_dispatch__(func, types, args, kwargs)


@pytest.mark.parametrize("name", STEPS)
def test_no_step_builds_a_tensor_from_python_data(name):
    """The second step of each method as its main() runs it (built
    by speed.training: its augmentation, GSG's pairs, train_step
    with loss, optimiser, EMA, queue, support set), tiny: no
    aten.lift_fresh. Seen failing before colour_jitter's grey
    weights stopped being a new tensor each call (one a step)."""
    mod, options = STEPS[name]
    argv = [*options, "--width", "4", "--batch-size", "8",
            *speed.SMALL_HEADS[mod]]
    t = speed.training(mod, argv, CPU, 8)
    stats = common.STATS["cifar10"]
    augment = common.Augment(mod.recipes(t.args), 8, *stats, CPU)
    order, views = common.epoch_generators(0, 0, CPU.device)
    g = torch.Generator().manual_seed(0)
    images = torch.randint(
        0, 256, (8, 3, 8, 8), dtype=torch.uint8, generator=g)
    labels = torch.randint(0, 10, (8,), generator=g)
    t.step(augment(images, views), labels, order)  # the optimiser's state
    with OpNames() as counter:
        t.step(augment(images, views), labels, order)
    made = {k: counter.names[k] for k in FROM_PYTHON_DATA}
    assert sum(made.values()) == 0, made
