"""--compile compiles the network and common.Augment (the losses stay eager). Here, on the CPU, the
augmentation torch.compile (inductor, dynamic=False) makes equals the eager one within TOLERANCE,
at tiny sizes, for each method file's quick-start recipes. A compile costs tens of seconds of CPU,
so a method file whose recipes use only ops another's compiled recipes ran is covered by that
compile. Dynamo's caches are reset after the file."""
import functools
import importlib

import pytest
import torch

import common
from helpers import QUICK_START, ctx_for

CPU = ctx_for()
# Absolute, on normalised views (std 0.25 here). Measured: 1.7e-6 (a float32 rounding of a pixel,
# times 4); a crop box or a coin that came out otherwise would differ by whole pixels.
TOLERANCE = 1e-5


@pytest.fixture(autouse=True, scope="module")
def reset_dynamo():
    yield
    torch._dynamo.reset()


def recipes(method):
    """The method file's recipes at its quick start's image size."""
    module = importlib.import_module(method)
    args = module.parse_args([*QUICK_START[method], "--out", "/nonexistent"])
    args.image_size = 20  # --dataset textures
    return module.recipes(args)


def ops(method):
    """The ops the method's recipes run."""
    used = {"crop"}
    for r in recipes(method):
        used |= {name for name, on in (
            ("flip", r.flip_p > 0), ("jitter", r.jitter_p > 0 and any(r.jitter[:3])),
            ("hue", r.jitter_p > 0 and r.jitter[3] > 0), ("grey", r.gray_p > 0),
            ("blur", r.blur_p > 0), ("solarize", r.solarize_p > 0)) if on}
    return used


def compiled_by(method):
    """The method file whose compile covers `method`'s ops: the first, most ops first."""
    by_size = sorted(QUICK_START, key=lambda m: (-len(ops(m)), m))
    return next(m for m in by_size if ops(method) <= ops(m))


@functools.lru_cache(maxsize=None)
def largest_difference(method):
    """The views of 4 images of 10 px (8 px out) from the same generator seed, compiled (every op
    after the draws) and eager -> max |compiled - eager|."""
    augment = common.Augment(recipes(method), 8, (0.5,) * 3, (0.25,) * 3, CPU)
    images = torch.randint(0, 256, (4, 3, 10, 10), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(augment, dynamic=False)(images, torch.Generator().manual_seed(1))
    eager = augment(images, torch.Generator().manual_seed(1))
    assert len(compiled) == len(eager) == len(recipes(method))
    return max(float((c - e).abs().max()) for c, e in zip(compiled, eager))


@pytest.mark.rule("compiled-recipes")
@pytest.mark.parametrize("method", sorted(QUICK_START))
def test_compiled_augmentation_equals_eager_for_each_method_files_recipes(method):
    """The method file's ops, compiled by itself or by the method file that covers them, give
    the eager views within TOLERANCE."""
    assert largest_difference(compiled_by(method)) <= TOLERANCE


def test_the_online_probe_leaves_the_compiled_network_one_graph():
    """moco_simmoco_simco.py under --compile with its online probes on (its default): the probes
    take the backbone's features from the encoder's output, so dynamo captures the network as one
    graph, with no break and no second graph across steps."""
    import moco_simmoco_simco as mss
    from torch._dynamo.testing import CompileCounter

    args = mss.parse_args([*QUICK_START["moco_simmoco_simco"], "--width", "4", "--out", "/none"])
    model = mss.Encoder("resnet18", 4, 8, 16, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    counter = CompileCounter()
    net = torch.compile(model, backend=counter)
    for step in range(2):
        views = [torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(step + v))
                 for v in range(2)]
        _, _, features = mss.train_step(net, optimizer, views, args, CPU)
        assert features[0].shape == (8, model.backbone.out_dim)
    assert counter.frame_count == 1, counter.frame_count
