"""--compile compiles the network, common.Augment and the loss train_step calls (the lines in each
main()). Here, on the CPU, the augmentations and losses torch.compile (inductor, dynamic=False)
makes equal the eager ones within TOLERANCE, at tiny sizes: one compile per recipe set and one
for every loss together, forward and backward. SimCLR's and MoCo's recipes are the same (one
compile); GSG's four views of one recipe run their ops too (another crop scale), so they are not
compiled again: each compile costs 13-40 s of CPU. With a cold inductor cache the file spends
about 100 s of CPU, most of it in the C++ compiler (2 shared cores); with a warm one, about 10 s.
"""
import pytest
import torch
import torch.nn.functional as F

import common
import moco_simmoco_simco as mss
import nnclr_dcl
import simclr_dcl
import simsiam_byol_gsg as gsg

CPU = common.Context(0, 1, 0, torch.device("cpu"), "", False)
# Absolute, on normalised views (std 0.25 here), losses and gradients. Measured: views 1.7e-6 (a
# float32 rounding of a pixel, times 4), losses 4.8e-7, gradients 3.6e-7; a crop box or a coin
# that came out otherwise would differ by whole pixels.
TOLERANCE = 1e-5


@pytest.mark.parametrize("module", [simclr_dcl, mss, nnclr_dcl])
def test_compiled_augmentation_equals_eager_for_each_scripts_recipes(module):
    """The views of 4 images of 10 px (8 px out) from the same generator seed: the uniforms are
    drawn eagerly (a graph break: the generator), every op after them compiled."""
    args = module.parse_args([])
    args.image_size = 8
    augment = common.Augment(module.recipes(args), 8, (0.5,) * 3, (0.25,) * 3, CPU)
    images = torch.randint(0, 256, (4, 3, 10, 10), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(augment, dynamic=False)(images, torch.Generator().manual_seed(1))
    eager = augment(images, torch.Generator().manual_seed(1))
    assert len(compiled) == len(module.recipes(args))
    assert len(eager) == len(compiled)
    for c, e in zip(compiled, eager):
        torch.testing.assert_close(c, e, rtol=0, atol=TOLERANCE)


def leaves(count, rows=4, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, dim, generator=g).requires_grad_() for _ in range(count)]


def unit_rows(rows, dim=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(rows, dim, generator=g), dim=1)


def every_loss(x):
    """Each script's loss as its train_step calls it (its defaults), on inputs of its own
    (x: name -> (4, 8) leaves; MoCo v2 with a 16-key queue, NNCLR with a 16-row support set)
    -> name -> the loss."""
    queue = x["support"][:, :8]
    return {
        "simclr-dcl": simclr_dcl.contrastive_loss(*x["simclr-dcl"], 0.1, "dcl"),
        "mocov2": mss.dual_temperature_loss(*x["mocov2"], 0.2, 0.2, queue)[0],
        "simco": mss.dual_temperature_loss(*x["simco"], 0.1, 1.0)[0],
        "simsiam-symmetric": gsg.symmetric_loss(*x["simsiam-symmetric"]),
        "simsiam-guided": gsg.guided_stopgrad_loss(*x["simsiam-guided"])[0],
        "nnclr-dcl": nnclr_dcl.nnclr_loss(*x["nnclr-dcl"], x["support"], 0.2, "dcl"),
    }


def test_compiled_losses_and_their_gradients_equal_eager():
    """Every script's loss compiled in one graph (and its backward in one), against eager on the
    same inputs: each loss and the gradient of each of its inputs within TOLERANCE. The inputs of
    two losses are apart, so the gradient of their sum is each one's own."""
    counts = {"simclr-dcl": 2, "mocov2": 2, "simco": 2, "simsiam-symmetric": 4,
              "simsiam-guided": 8, "nnclr-dcl": 4}
    x = {name: leaves(n, seed=i) for i, (name, n) in enumerate(counts.items())}
    x["support"] = unit_rows(16)
    results = []
    for fn in (torch.compile(every_loss, dynamic=False), every_loss):
        losses = fn(x)
        inputs = [t for name in counts for t in x[name]]
        grads = torch.autograd.grad(sum(losses.values()), inputs, allow_unused=True)
        results.append((losses, [torch.zeros_like(t) if g is None else g
                                 for t, g in zip(inputs, grads)]))
    (compiled, compiled_grads), (eager, eager_grads) = results
    for name in counts:
        torch.testing.assert_close(compiled[name], eager[name], rtol=0, atol=TOLERANCE,
                                   msg=lambda m: f"{name}: {m}")
    for c, e in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(c, e, rtol=0, atol=TOLERANCE)
