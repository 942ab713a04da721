"""The draws behind the augmentation, read back from what each image comes out as: every image
tosses its own coin for each op with the Recipe's probability, the jitter factors, hue shift,
blur sigma and crop box cover their whole ranges, each epoch draws its own order and views, and
a non-finite loss stops the run. Each op is isolated on an image that shows what it did, with
mean 0 and std 1 so the views are pixel values in [0, 1]."""

import math

import pytest
import torch

import common
from common import Augment, Recipe
from helpers import ctx_for

ONE_PROCESS = ctx_for()
BATCHES, BATCH = 8, 500  # 4,000 images a draw, in batches of 500
# no crop, flip or colour: each test turns on the one op it reads
NO_OPS = dict(crop_scale=(1.0, 1.0), crop_ratio=(1.0, 1.0), flip_p=0.0, jitter=(0, 0, 0, 0),
              gray_p=0.0)


def only(**ops):
    """A Recipe that applies `ops` and nothing else."""
    return Recipe(**{**NO_OPS, **ops})


def views(recipe, image, batches=BATCHES, batch=BATCH, seed=0):
    """`batches` views of `batch` copies of `image` (uint8 (3, S, S)), drawn one batch after the
    other from one generator -> float (batches, batch, 3, S, S) in [0, 1]. The copies go in
    pre-cropped (b, 1, 3, S, S) unless the recipe crops."""
    crops = recipe.crop_scale != (1.0, 1.0) or recipe.flip_p > 0
    x = image.expand(batch, *image.shape)
    x = x if crops else x.unsqueeze(1)
    augment = Augment([recipe], image.shape[-1], (0.0,) * 3, (1.0,) * 3, ONE_PROCESS)
    generator = torch.Generator().manual_seed(seed)
    return torch.stack([augment(x, generator)[0] for _ in range(batches)])


def colour(*rgb, size=8):
    """A constant uint8 image (3, S, S)."""
    return torch.tensor(rgb, dtype=torch.uint8).view(3, 1, 1).expand(3, size, size).clone()


def assert_drawn_per_image_with_probability(happened, p):
    """happened: bool (batches, batch). Its count is binomial(n, p) within 4.5 standard
    deviations, and (0 < p < 1) every batch has images with the op and images without."""
    n, count = happened.numel(), int(happened.sum())
    assert abs(count - n * p) <= 4.5 * math.sqrt(n * p * (1 - p)), (count, n * p)
    if 0 < p < 1:
        per_batch = happened.sum(1)
        assert ((per_batch > 0) & (per_batch < happened.shape[1])).all(), per_batch.tolist()


def assert_uniform_over(values, low, high):
    """Draws of U(low, high): inside the range, reaching both ends, half on each side of the
    middle (binomial, 4.5 standard deviations)."""
    n, span = len(values), high - low
    assert values.min() >= low - 1e-4 * span and values.max() <= high + 1e-4 * span
    assert values.min() < low + 0.02 * span and values.max() > high - 0.02 * span
    below = int((values < (low + high) / 2).sum())
    assert abs(below - n / 2) <= 4.5 * math.sqrt(n / 4), (below, n / 2)


# ---- one coin per image and op
DOT = torch.zeros(3, 32, 32, dtype=torch.uint8)
DOT[:, 16, 16] = 255  # a white dot on black: its centre dims when blurred (kernel 3 px at 32 px)
LIGHT_BLUE = colour(60, 90, 120)  # brightened 1.4 times, still below 255: no clamping


def jittered(v):
    return (v != LIGHT_BLUE.float() / 255).flatten(2).any(2)


def greyed(v):
    return (v[:, :, 0] == v[:, :, 1]).all((2, 3)) & (v[:, :, 1] == v[:, :, 2]).all((2, 3))


def blurred(v):
    return v[:, :, 0, 16, 16] < 1 - 1e-4


def solarized(v):
    return v.amax((2, 3, 4)) < 0.5  # every channel >= 0.5 before: inverted


COIN_OPS = {  # op -> (its recipe with probability p, an image that shows it, whether a view does)
    "jitter": (lambda p: only(jitter=(0.4, 0, 0, 0), jitter_p=p), LIGHT_BLUE, jittered),
    "grayscale": (lambda p: only(gray_p=p), colour(200, 60, 30), greyed),
    "blur": (lambda p: only(blur_p=p, blur_sigma=(0.5, 2.0)), DOT, blurred),
    "solarize": (lambda p: only(solarize_p=p), colour(200, 150, 250), solarized),
}


@pytest.mark.parametrize("op, p", [("jitter", 0.8), ("grayscale", 0.2), ("blur", 0.5),
                                   ("solarize", 0.3)])
def test_each_image_tosses_its_own_coin_for_an_op_with_the_recipes_probability(op, p):
    """Over 8 batches of 500 copies of one image, the share that comes out with the op is its p,
    and in every batch some copies have it and some do not (torchvision.transforms.v2 on a batch
    draws once for all)."""
    recipe, image, happened = COIN_OPS[op]
    assert_drawn_per_image_with_probability(happened(views(recipe(p), image)), p)


def test_grey_and_solarize_coins_are_independent_and_new_each_batch():
    """P(grey and solarized) = P(grey) P(solarized) = 1/4, and batch after batch the coins
    differ."""
    recipe = only(gray_p=0.5, solarize_p=0.5)
    v = views(recipe, colour(200, 150, 250))  # its grey, 176, is solarized too
    grey, solar = greyed(v), solarized(v)
    assert_drawn_per_image_with_probability(grey, 0.5)
    assert_drawn_per_image_with_probability(solar, 0.5)
    assert_drawn_per_image_with_probability(grey & solar, 0.25)
    assert not (grey[0] == grey[1]).all() and not (solar[0] == solar[1]).all()


# ---- the ranges of the draws
def test_brightness_factor_is_uniform_on_both_sides_of_one():
    """Brightness 0.4 scales a constant image by f ~ U(0.6, 1.4); the 20% not jittered keep
    f = 1."""
    v = views(only(jitter=(0.4, 0, 0, 0), jitter_p=0.8), LIGHT_BLUE)
    f = (v[:, :, :, 0, 0] / (LIGHT_BLUE[:, 0, 0].float() / 255)).flatten(0, 1)  # (n, 3)
    assert torch.allclose(f, f[:, :1].expand_as(f), atol=1e-5)  # one factor for the 3 channels
    f = f[:, 0]
    kept = (f - 1).abs() < 1e-6
    assert_drawn_per_image_with_probability(~kept.view(BATCHES, BATCH), 0.8)
    assert_uniform_over(f[~kept], 0.6, 1.4)


def test_contrast_factor_is_uniform_on_both_sides_of_one():
    """Contrast 0.4 scales the gap between two greys (80 above, 120 below) by f ~ U(0.6, 1.4)."""
    image = colour(80, 80, 80, size=8)
    image[:, 4:] = 120
    v = views(only(jitter=(0, 0.4, 0, 0), jitter_p=1.0), image)
    f = ((v[:, :, 0, 4, 0] - v[:, :, 0, 0, 0]) / (40 / 255)).flatten()
    assert_uniform_over(f, 0.6, 1.4)


def test_saturation_factor_is_uniform_on_both_sides_of_one():
    """Saturation 0.4 scales a colour's distance from its grey by f ~ U(0.6, 1.4)."""
    image = colour(140, 100, 60)
    v = views(only(jitter=(0, 0, 0.4, 0), jitter_p=1.0), image)
    grey = common.grayscale(image.float() / 255)[0, 0, 0]
    red = v[:, :, 0, 0, 0] - common.grayscale(v.flatten(0, 1)).view(BATCHES, BATCH, -1)[:, :, 0]
    f = (red / (image[0, 0, 0] / 255 - grey)).flatten()
    assert_uniform_over(f, 0.6, 1.4)


def test_jitter_factors_above_strength_one_are_clipped_at_zero_as_torchvision():
    """Strength 1.5 draws f ~ U(max(0, 1 - 1.5), 1 + 1.5) = U(0, 2.5), as torchvision's
    ColorJitter clips its range at 0: never negative. Read from contrast (two greys) and
    brightness (a dark red channel, 2.5 times 60 still below 255)."""
    image = colour(80, 80, 80, size=8)
    image[:, 4:] = 120
    v = views(only(jitter=(0, 1.5, 0, 0), jitter_p=1.0), image)
    assert_uniform_over(((v[:, :, 0, 4, 0] - v[:, :, 0, 0, 0]) / (40 / 255)).flatten(), 0, 2.5)
    v = views(only(jitter=(1.5, 0, 0, 0), jitter_p=1.0), LIGHT_BLUE)
    assert_uniform_over((v[:, :, 0, 0, 0] / (60 / 255)).flatten(), 0, 2.5)


def test_hue_shift_is_uniform_over_both_directions():
    """Hue 0.1 turns red (200, 40, 40) by t ~ U(-0.1, 0.1) of a turn: towards yellow (green
    rises) for t > 0, towards magenta (blue rises) for t < 0; 6 t = (G - B) / (R - min)."""
    v = views(only(jitter=(0, 0, 0, 0.1), jitter_p=1.0), colour(200, 40, 40))
    r, g, b = v[:, :, :, 0, 0].flatten(0, 1).unbind(1)
    t = (g - b) / (6 * (r - torch.minimum(g, b)))
    assert_uniform_over(t, -0.1, 0.1)


def test_blur_sigma_is_uniform_over_its_range():
    """Sigma read back from a blurred dot's centre (through gaussian_blur on a fine grid of
    sigmas) is uniform over (0.5, 2.0)."""
    v = views(only(blur_p=1.0, blur_sigma=(0.5, 2.0)), DOT)
    centre = v[:, :, 0, 16, 16].flatten()
    grid = torch.linspace(0.45, 2.05, 1601)
    kernel = (32 // 10) | 1  # Augment's: odd, about 10% of the image
    dots = DOT[:1].float().div(255).expand(len(grid), 3, 32, 32)
    reference = common.gaussian_blur(dots, grid, kernel)[:, 0, 16, 16]  # falls with sigma
    sigma = grid[(centre[:, None] - reference[None]).abs().argmin(1)]
    assert_uniform_over(sigma, 0.5, 2.0)


RAMPS = torch.stack([torch.arange(32).view(1, 32).expand(32, 32) * 8,  # red: 8 x
                     torch.arange(32).view(32, 1).expand(32, 32) * 8,  # green: 8 y
                     torch.zeros(32, 32, dtype=torch.long)]).to(torch.uint8)


def crop_widths_heights_flips(v):
    """Each view of RAMPS (32 px out) -> the box's width and height in input pixels, and whether
    it was mirrored: bilinear sampling keeps the ramps linear, so 16 output pixels apart (inside
    the box) the red ramp moves by 8 * w / 2 and the green by 8 * h / 2, out of 255."""
    v = v.flatten(0, 1) * 255
    dx = v[:, 0, 16, 24] - v[:, 0, 16, 8]
    dy = v[:, 1, 24, 16] - v[:, 1, 8, 16]
    return dx.abs() / 4, dy.abs() / 4, dx < 0


@pytest.mark.parametrize("flip_p", [0.0, 0.3])
def test_crop_box_honours_scale_and_ratio_and_mirrors_with_flip_p(flip_p):
    """Augment's crops of a 32 x 32 image with crop_scale (0.25, 0.5) and crop_ratio (1/2, 1)
    cover both ranges, end to end (w and h are whole pixels, so both move a little past them);
    each image is mirrored with probability flip_p."""
    recipe = only(crop_scale=(0.25, 0.5), crop_ratio=(1 / 2, 1), flip_p=flip_p)
    w, h, flipped = crop_widths_heights_flips(views(recipe, RAMPS))
    assert torch.allclose(w, w.round(), atol=1e-3) and torch.allclose(h, h.round(), atol=1e-3)
    area, ratio = w * h / 32 ** 2, w / h
    assert area.min() > 0.25 * 0.85 and area.max() < 0.5 * 1.15
    assert area.min() < 0.27 and area.max() > 0.47
    assert ratio.min() > 1 / 2 * 0.9 and ratio.max() < 1 / 0.9
    assert ratio.min() < 0.55 and ratio.max() > 0.9
    assert_drawn_per_image_with_probability(flipped.view(BATCHES, BATCH), flip_p)


# ---- draws epoch by epoch
def held_data(n=64, size=8):
    """A held train set whose label is the image's index, so a batch's labels are its order."""
    images = torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(0))
    return common.Data(train=images, train_labels=torch.arange(n), eval_train=None,
                       eval_test=None, num_classes=n, image_size=size, mean=(0.0,) * 3,
                       std=(1.0,) * 3)


def epoch_draws(seed, epoch):
    """(seed, epoch) -> the epoch's order of the train set (its batches' labels) and its two
    views of the train set's first 16 images."""
    data = held_data()
    order, generator = common.epoch_generators(seed, epoch)
    labels = torch.cat([labels for _, labels in common.train_batches(data, 16, order, ONE_PROCESS)])
    augment = Augment([Recipe(), Recipe(blur_p=0.5)], 8, data.mean, data.std, ONE_PROCESS)
    return labels, augment(data.train[:16], generator)


def test_each_epoch_draws_its_own_order_and_views_and_the_same_epoch_the_same_ones():
    """A resumed epoch draws as the uninterrupted one did; another epoch, or another seed, draws
    another order and other views."""
    order, augmented = epoch_draws(seed=0, epoch=3)
    assert sorted(order.tolist()) == list(range(64))  # each image once
    again_order, again_augmented = epoch_draws(seed=0, epoch=3)
    assert torch.equal(order, again_order)
    assert all(torch.equal(a, b) for a, b in zip(augmented, again_augmented))
    for other in (dict(seed=0, epoch=4), dict(seed=1, epoch=3)):
        other_order, other_augmented = epoch_draws(**other)
        assert not torch.equal(order, other_order), other
        assert all(not torch.equal(a, b) for a, b in zip(augmented, other_augmented)), other


def test_no_two_generators_of_a_run_share_a_stream():
    """Over 50 epochs the order and augmentation generators of every epoch start with draws of
    their own. Both are the CPU's, whatever the device (a GPU's torch.rand lays out a large draw
    by its number of SMs)."""
    firsts = []
    for epoch in range(50):
        for generator in common.epoch_generators(0, epoch):
            assert generator.device.type == "cpu"
            firsts.append(tuple(torch.rand(4, generator=generator).tolist()))
    assert len(set(firsts)) == len(firsts)


def test_no_call_reseeds_a_generator_it_does_not_put_back(tmp_path, monkeypatch):
    """A streamed image's crops and a linear probe's initial weights come from a seeded CPU
    generator inside fork_rng(devices=[]), which puts back the CPU's generator only
    (torch.manual_seed would reseed every GPU's too, for good): the weights those
    torch.manual_seed gave, the crops the same for the same seed and image."""
    from PIL import Image

    Image.new("RGB", (24, 20), (200, 30, 60)).save(tmp_path / "image.png")
    seeded = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", seeded.append)
    state = torch.get_rng_state()
    files = common.ImageFiles([(str(tmp_path / "image.png"), 0)], 16, crops=2)
    files.seed = 5
    crops = files[0][0]
    layer = common.linear_classifier(8, 3, torch.device("cpu"), seed=7)
    assert seeded == [] and torch.equal(torch.get_rng_state(), state)
    assert crops.shape == (2, 3, 16, 16) and torch.equal(files[0][0], crops)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        expected = torch.nn.Linear(8, 3)
    assert torch.equal(layer.weight, expected.weight) and torch.equal(layer.bias, expected.bias)


# ---- the epoch log
def bare_run(epochs_done):
    """A Run with only what check_finite reads: the epochs done."""
    run = object.__new__(common.Run)
    run.epoch = epochs_done
    return run


STATES = {"model": {"w": torch.ones(3)}, "optimizer": {"state": {0: {"buf": torch.zeros(3)}}}}


@pytest.mark.parametrize("loss", [float("nan"), float("inf"), float("-inf")])
def test_a_loss_that_is_not_finite_stops_the_run(loss):
    with pytest.raises(common.UserError, match=f"the loss became {loss} in epoch 2; epoch 1's "
                                               f"checkpoint is kept"):
        bare_run(1).check_finite({"loss": loss, "epoch": 2}, STATES)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_state_that_is_not_finite_stops_the_run_however_deep(bad):
    """A momentum buffer deep in the optimizer's state_dict, the loss finite."""
    states = {"model": STATES["model"], "optimizer": {"state": {0: {"buf": torch.tensor([bad])}}}}
    with pytest.raises(common.UserError, match="the weights became non-finite in epoch 1; no "
                                               "checkpoint was written"):
        bare_run(0).check_finite({"loss": 1.0, "epoch": 1}, states)


def test_a_finite_loss_goes_on():
    bare_run(0).check_finite({"loss": 1e30, "epoch": 1}, STATES)
    bare_run(3).check_finite({"loss": -3.0, "epoch": 4}, STATES)


@pytest.mark.parametrize("default", [torch.float64, torch.bfloat16])
def test_the_views_do_not_depend_on_the_default_dtype(default):
    """A student checking an identity in float64 sets the default dtype; Augment (every op on)
    draws in float32 whatever the default and gives the same float32 views."""
    recipe = Recipe(jitter_p=1.0, gray_p=0.5, blur_p=0.5, solarize_p=0.5)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (6, 3, 12, 12), dtype=torch.uint8, generator=g)
    augment = Augment([recipe] * 2, 8, (0.5,) * 3, (0.25,) * 3, ONE_PROCESS)
    expected = augment(x, torch.Generator().manual_seed(1))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        augment = Augment([recipe] * 2, 8, (0.5,) * 3, (0.25,) * 3, ONE_PROCESS)
        got = augment(x, torch.Generator().manual_seed(1))
    finally:
        torch.set_default_dtype(previous)
    for view, reference in zip(got, expected):
        torch.testing.assert_close(view, reference, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype, atol", [(torch.float64, 1e-5), (torch.float16, 1e-2),
                                         (torch.bfloat16, 8e-2)])
def test_each_op_keeps_its_images_dtype(dtype, atol):
    """The colour jitter (hue included), the blur and the crop take float images of any precision,
    with factors drawn in float32, and return that dtype, within a few of its roundings of the
    float32 result at hue's scale, 6 (measured: float16 5.3e-3, bfloat16 5.0e-2, float64
    6.6e-7)."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(6, 3, 12, 12, generator=g)
    f = torch.rand(6, generator=g) + 0.5  # (6,)
    ops = {"jitter": lambda x: common.colour_jitter(x, f, f, f, f - 1),
           "blur": lambda x: common.gaussian_blur(x, f, 5),
           "crop": lambda x: common.resized_crop_flip(x, f, f, 2 * f + 4, 3 * f + 4, f > 1, 8)}
    for name, op in ops.items():
        y = op(x.to(dtype))
        assert y.dtype == dtype, name
        torch.testing.assert_close(y.float(), op(x), rtol=0, atol=atol, msg=name)
