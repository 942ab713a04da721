"""--compile compiles the network and common.Augment (the lines in each main(); the losses stay
eager, as written). Here, on the CPU, the augmentation torch.compile (inductor, dynamic=False)
makes equals the eager one within TOLERANCE, at tiny sizes, for NNCLR's recipes, whose ops
include every other script's (GSG's four views of one recipe too, at another crop scale): each
compile costs tens of seconds of CPU, most of it in the C++ compiler. Dynamo's caches are reset
after the file: no compiled function is left to a later test."""
import pytest
import torch

import common
import nnclr_dcl

CPU = common.Context(0, 1, 0, torch.device("cpu"), "", False)
# Absolute, on normalised views (std 0.25 here). Measured: 1.7e-6 (a float32 rounding of a pixel,
# times 4); a crop box or a coin that came out otherwise would differ by whole pixels.
TOLERANCE = 1e-5


@pytest.fixture(autouse=True, scope="module")
def reset_dynamo():
    yield
    torch._dynamo.reset()


# NNCLR's two recipes run every op SimCLR's and MoCo's do (crop, flip, jitter, grayscale) and
# solarize too: one compile (tens of seconds of CPU) covers the three scripts.
@pytest.mark.parametrize("module", [nnclr_dcl])
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
