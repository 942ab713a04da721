"""common.py: augmentation against torchvision, evaluation, schedule, distribute, checkpoints, and
every bad-input case (run through the harness script, helpers.HARNESS)."""

import io
import itertools
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torchvision.transforms.functional as TF

import common
from common import Augment, Recipe
from helpers import (HARNESS, METHODS, FailingWrites, OpNames, _env, check_run_folder, ctx_for,
                     harness_module, run_distributed, run_script, smoke_args, stop_in_epoch)

harness = harness_module()  # the README's first quick-start script

ONE = torch.ones(4)  # a colour_jitter factor that leaves every image unchanged


def images(b=4, h=24, w=28, seed=0):
    return torch.rand(b, 3, h, w, generator=torch.Generator().manual_seed(seed))


# ---- augmentation ops


@pytest.mark.parametrize("op, tv_op, factors", [
    (lambda x, f: common.colour_jitter(x, f, ONE, ONE), TF.adjust_brightness, [0.6, 1.0, 1.3, 1.4]),
    (lambda x, f: common.colour_jitter(x, ONE, f, ONE), TF.adjust_contrast, [0.6, 1.0, 1.2, 1.4]),
    (lambda x, f: common.colour_jitter(x, ONE, ONE, f), TF.adjust_saturation, [0.0, 0.6, 1.0, 1.4]),
    (common.adjust_hue, TF.adjust_hue, [-0.1, -0.03, 0.05, 0.1])])
def test_colour_op_with_per_sample_factor_matches_torchvision(op, tv_op, factors):
    """Row i of the batched op equals torchvision's functional op on image i with factor i."""
    x = images()
    out = op(x, torch.tensor(factors))
    for i, f in enumerate(factors):
        torch.testing.assert_close(out[i], tv_op(x[i], f), rtol=1e-5, atol=2e-6,
                                   msg=lambda m: f"{f}: {m}")


TV_JITTER_OPS = (TF.adjust_brightness, TF.adjust_contrast, TF.adjust_saturation, TF.adjust_hue)


def test_colour_jitter_in_each_of_the_24_orders_matches_torchvision():
    """Image i takes the i-th of the 24 orders of (brightness, contrast, saturation, hue), with
    its own factors: row i equals torchvision's four functional ops applied in that order."""
    orders = list(itertools.permutations(range(4)))
    g = torch.Generator().manual_seed(0)
    x = images(24, 12, 10)
    factors = [0.6 + 0.8 * torch.rand(24, generator=g) for _ in range(3)]
    factors.append(0.2 * torch.rand(24, generator=g) - 0.1)  # hue, in turns
    out = common.colour_jitter(x, *factors, order=torch.tensor(orders))
    for i, order in enumerate(orders):
        expect = x[i]
        for op in order:
            expect = TV_JITTER_OPS[op](expect, float(factors[op][i]))
        torch.testing.assert_close(out[i], expect, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{order}: {m}")


def test_every_colour_jitter_order_is_drawn_with_frequency_one_in_24(monkeypatch):
    """Augment draws each image's order of the four ops, as ColorJitter does: over 12,000 images
    each of the 24 orders occurs about 500 times (chi-square, 23 degrees of freedom, below its
    99.99th percentile 56)."""
    drawn, colour_jitter = [], common.colour_jitter

    def recording_jitter(x, brightness, contrast, saturation, hue=None, order=None):
        drawn.append(order)
        return colour_jitter(x, brightness, contrast, saturation, hue, order)

    monkeypatch.setattr(common, "colour_jitter", recording_jitter)
    augment = Augment([Recipe(jitter_p=1.0)], 4, (0.5,) * 3, (0.5,) * 3, ctx_for())
    x = (images(2000, 4, 4) * 255).to(torch.uint8)
    generator = torch.Generator().manual_seed(0)
    for _ in range(6):
        augment(x, generator)
    assert all(order is not None for order in drawn)
    orders = torch.cat(drawn)
    assert (orders.sort(1).values == torch.arange(4)).all()  # each row a permutation
    codes = (orders * torch.tensor([64, 16, 4, 1])).sum(1)
    counts = torch.tensor([int((codes == c).sum()) for c in codes.unique()])
    assert len(counts) == 24
    expected = len(orders) / 24
    chi_square = float(((counts - expected) ** 2 / expected).sum())
    assert chi_square < 56, (chi_square, counts.tolist())


def test_solarize_and_blur_match_torchvision():
    """Augment's solarize and normalize are torchvision's: a view solarized with p=1 is the same
    view unsolarized, then solarized and standardised by torchvision image by image; the blur is
    torchvision's gaussian_blur with each image's sigma."""
    x = (images(4, 16, 16) * 255).to(torch.uint8)
    plain = Recipe(crop_scale=(1.0, 1.0), crop_ratio=(1.0, 1.0), flip_p=0, jitter_p=0, gray_p=0)
    solarize = Recipe(**{**vars(plain), "solarize_p": 1.0})
    mean, std = (0.4, 0.5, 0.6), (0.2, 0.25, 0.3)

    def view(recipe, mean=(0.0,) * 3, std=(1.0,) * 3):
        return Augment([recipe], 16, mean, std, ctx_for())(x, torch.Generator().manual_seed(0))[0]

    unsolarized = view(plain)
    solarized = view(solarize)
    standardised = view(solarize, mean, std)
    for i in range(4):
        expect = TF.solarize(unsolarized[i], 0.5)
        torch.testing.assert_close(solarized[i], expect, rtol=0, atol=0)
        torch.testing.assert_close(standardised[i], TF.normalize(expect, mean, std), rtol=1e-5,
                                   atol=1e-6)
    x = images()
    sigmas = [0.3, 0.9, 1.5, 2.0]
    blurred = common.gaussian_blur(x, torch.tensor(sigmas), 7)
    for i, s in enumerate(sigmas):
        torch.testing.assert_close(blurred[i], TF.gaussian_blur(x[i], [7, 7], [s, s]), rtol=1e-5,
                                   atol=1e-6, msg=lambda m: f"{s}: {m}")


def test_resized_crop_and_flip_match_torchvision():
    """One grid_sample per batch equals torchvision's resized_crop (bilinear, no antialias) per
    image, mirrored by hflip where asked. Downscaling boxes compare exactly; an upscaling box
    compares away from its 1-pixel rim (torchvision clamps to the crop's edge, grid_sample to the
    image's)."""
    x = images(4, 40, 36)
    top, left = torch.tensor([0.0, 3, 10, 5]), torch.tensor([0.0, 7, 2, 20])
    h, w = torch.tensor([40.0, 20, 30, 16]), torch.tensor([36.0, 24, 17, 16])
    flip = torch.tensor([False, True, False, True])
    out = common.resized_crop_flip(x, top, left, h, w, flip, 16)
    for i in range(4):
        box = [int(t[i]) for t in (top, left, h, w)]
        expect = TF.resized_crop(x[i], *box, [16, 16], antialias=False)
        expect = TF.hflip(expect) if flip[i] else expect
        torch.testing.assert_close(out[i], expect, rtol=1e-5, atol=1e-5, msg=lambda m: f"{i}: {m}")
    box = [torch.tensor([float(v)]) for v in (8, 9, 10, 12)]
    up = common.resized_crop_flip(x[:1], *box, torch.tensor([False]), 24)
    expect = TF.resized_crop(x[0], 8, 9, 10, 12, [24, 24], antialias=False)
    torch.testing.assert_close(up[0, :, 2:-2, 2:-2], expect[:, 2:-2, 2:-2], rtol=1e-5, atol=1e-5)


def test_crop_boxes_respect_scale_and_ratio_ranges():
    g = torch.Generator().manual_seed(0)
    rand = lambda shape: torch.rand(shape, generator=g)
    top, left, h, w = common.sample_crop_boxes(rand, 4000, 32, 40, (0.2, 0.9), (3 / 4, 4 / 3))
    assert (top >= 0).all() and (left >= 0).all()
    assert (top + h <= 32).all() and (left + w <= 40).all()
    area = h * w / (32 * 40)
    # w and h are rounded to whole pixels, which moves the area and ratio slightly past the range
    assert area.min() > 0.2 * 0.85 and area.max() < 0.9 * 1.15
    assert area.min() < 0.23 and area.max() > 0.85  # the whole range is used
    ratio = w / h
    assert ratio.min() > 0.75 * 0.9 and ratio.max() < 4 / 3 / 0.9
    assert len(set(zip(top.tolist(), left.tolist()))) > 200  # positions vary


def test_crop_falls_back_to_centre_crop_when_no_draw_fits():
    """A 4x40 strip can fit no box of ratio 3/4..4/3 with area >= 90%: torchvision's fallback."""
    g = torch.Generator().manual_seed(0)
    rand = lambda shape: torch.rand(shape, generator=g)  # noqa: E731
    top, left, h, w = common.sample_crop_boxes(rand, 5, 4, 40, (0.9, 1.0), (3 / 4, 4 / 3))
    assert (h == 4).all() and (w == round(4 * 4 / 3)).all() and (left == (40 - w) // 2).all()


def test_ranks_augment_their_rows_exactly_as_one_process(monkeypatch):
    """Parameters are drawn for the global batch and sliced, so rank 0 + rank 1 == one process
    (Augment reads the rank from torch.distributed, simulated here, not from its Context)."""
    x = (images(8, 20, 20) * 255).to(torch.uint8)
    recipes = [Recipe(blur_p=0.5), Recipe(solarize_p=0.5)]
    augment = Augment(recipes, 16, (0.5,) * 3, (0.25,) * 3, ctx_for())
    single = augment(x, torch.Generator().manual_seed(1))
    parts = []
    monkeypatch.setattr(common, "world_size", lambda: 2)
    for r in range(2):
        monkeypatch.setattr(common, "rank", lambda: r)
        parts.append(augment(x[4 * r : 4 * r + 4], torch.Generator().manual_seed(1)))
    for v in range(2):
        torch.testing.assert_close(torch.cat([parts[0][v], parts[1][v]]), single[v], rtol=0, atol=0)


# ---- evaluation


def toy_features(n, classes=5, d=32, seed=0, shuffle_labels=False):
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, d, generator=g) * 3
    labels = torch.randint(0, classes, (n,), generator=g)
    features = centres[labels] + torch.randn(n, d, generator=g)
    if shuffle_labels:
        labels = torch.randint(0, classes, (n,), generator=g)
    return nn.functional.normalize(features, dim=1), labels


def test_knn_and_linear_probe_solve_separable_features():
    features, labels = toy_features(1400, seed=10)
    train_f, test_f = features.split([1000, 400])
    train_y, test_y = labels.split([1000, 400])
    assert common.knn_accuracy(train_f, train_y, test_f, test_y, 5, k=200, t=0.1) > 99
    assert common.knn_accuracy(train_f, train_y, test_f, test_y, 5, k=1, t=0.1) > 99
    assert common.linear_probe(train_f, train_y, test_f, test_y, 5, 20) > 99


def test_knn_and_linear_probe_are_at_chance_on_random_labels():
    features, labels = toy_features(2000, shuffle_labels=True, seed=11)
    train_f, test_f = features.split(1000)
    train_y, test_y = labels.split(1000)
    assert common.knn_accuracy(train_f, train_y, test_f, test_y, 5, k=200, t=0.1) < 28
    assert common.linear_probe(train_f, train_y, test_f, test_y, 5, 20) < 28


def test_learning_rate_warms_up_then_follows_the_cosine():
    lr = lambda step, schedule="cosine": common.learning_rate(step, 100, 10, 1.0, schedule)
    assert [round(lr(s), 6) for s in (0, 4, 9)] == [0.1, 0.5, 1.0]
    assert abs(lr(55) - 0.5) < 1e-9 and lr(100) < 1e-9 and lr(80) < lr(30)
    assert lr(70, "constant") == 1.0


# ---- distribute


def _worker_optimisers_before_and_after_distribute():
    """A convolution + BatchNorm stepped once under DDP, its optimiser built before
    common.distribute and, from the same initial state, after it -> both state_dicts."""
    rows = slice(4 * common.rank(), 4 * common.rank() + 4)
    torch.manual_seed(0)
    x = torch.randn(8, 3, 6, 6)[rows]
    weights = torch.randn(8, 4, 4, 4)[rows]  # the global loss, split by rows
    states = {}
    for built in ("before", "after"):
        torch.manual_seed(1)
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
        if built == "before":
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        net = common.distribute(model, ctx_for(common.rank(), 2))
        if built == "after":
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        (net(x) * weights).sum().backward()
        optimizer.step()
        states[built] = {k: v.clone() for k, v in model.state_dict().items()}
    return states


def test_distribute_keeps_the_parameters_an_optimiser_already_holds(tmp_path):
    """Under 2 processes common.distribute, which makes every BatchNorm a GlobalBatchNorm, keeps
    the module's Parameters: an optimiser built before it takes the step one built after it
    takes, the BatchNorm's weight and bias moved from their initial 1 and 0."""
    for rank in run_distributed("test_common", "_worker_optimisers_before_and_after_distribute",
                                tmp_path):
        assert rank["before"].keys() == rank["after"].keys()
        for key, value in rank["after"].items():
            assert torch.equal(rank["before"][key], value), key
        assert not torch.equal(rank["before"]["1.weight"], torch.ones(4))
        assert not torch.equal(rank["before"]["1.bias"], torch.zeros(4))


def test_the_ddp_keyword_for_buffers_is_the_one_its_signature_has(monkeypatch):
    """DDP's keyword that turns off the buffers' broadcast is taken from its signature:
    forward_sync_buffers where DDP has it, else broadcast_buffers (a pre-release such as 2.14.0a0
    sorts below 2.14 but has the new name)."""
    from torch.torch_version import TorchVersion

    given = []

    class New:  # torch 2.14's
        def __init__(self, module, device_ids=None, forward_sync_buffers=None):
            given.append({"forward_sync_buffers": forward_sync_buffers})

    class Old:  # torch 2.11's
        def __init__(self, module, device_ids=None, broadcast_buffers=True):
            given.append({"broadcast_buffers": broadcast_buffers})

    monkeypatch.setattr(torch, "__version__", TorchVersion("2.14.0a0"))
    for ddp in (New, Old):
        monkeypatch.setattr(nn.parallel, "DistributedDataParallel", ddp)
        common.distribute(nn.Linear(2, 2), ctx_for(0, 2))
    assert given == [{"forward_sync_buffers": False}, {"broadcast_buffers": False}]


# ---- checkpoints


def test_crash_mid_save_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    path = str(tmp_path / "checkpoint.pt")
    common.write_atomic(path, {"epoch": 1, "w": torch.ones(3)})

    def half_then_ctrl_c(write, data):  # half the bytes land, then Ctrl-C
        write(data[:len(data) // 2])
        raise KeyboardInterrupt

    def crashing_open(path, mode):  # the file common.py writes to
        return FailingWrites(path, mode, half_then_ctrl_c)

    monkeypatch.setattr(common, "open", crashing_open, raising=False)
    with pytest.raises(KeyboardInterrupt):
        common.write_atomic(path, {"epoch": 2, "w": torch.zeros(3)})
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["checkpoint.pt"]  # no temp file left
    kept = torch.load(path)
    assert kept["epoch"] == 1 and torch.equal(kept["w"], torch.ones(3))


# ---- bad input


def fails_with(argv, capsys, message):
    """Run the harness script as its __main__ does: one 'error:' line, exit status 2, no
    traceback."""
    with pytest.raises(SystemExit) as exit_info:
        common.run(lambda: harness.main(argv))
    assert exit_info.value.code == 2
    # the lines a terminal shows: a progress bar that was cleared (by "\r") does not count, nor
    # a start-up warning (smoke runs end within the warm-up)
    err = [line.split("\r")[-1] for line in capsys.readouterr().err.strip().split("\n")]
    err = [line for line in err if not line.startswith("warning: ")]
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    return err[0]


def test_missing_data_directory(tmp_path, capsys):
    fails_with(smoke_args(tmp_path / "nowhere", tmp_path / "out"), capsys, "No such file")


def test_empty_data_directory(tmp_path, capsys):
    for split in ("train", "val"):
        os.makedirs(tmp_path / "data" / split)
    fails_with(smoke_args(tmp_path / "data", tmp_path / "out"), capsys,
               "Couldn't find any class folder")


def test_cifar10_without_network_or_local_copy_is_one_line_and_no_run_folder(tmp_path, capsys,
                                                                            monkeypatch):
    """CIFAR-10 neither in --data-dir nor downloadable: one line naming the file to put there, and
    runs/ (no --out given) is left as it was."""
    monkeypatch.chdir(tmp_path)
    for proxy in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.setenv(proxy, "http://127.0.0.1:9")  # no download, even where a network exists
    fails_with(["--dataset", "cifar10", "--data-dir", str(tmp_path / "d"), "--device", "cpu"],
               capsys, "could not be downloaded: put cifar-10-python.tar.gz")
    assert not (tmp_path / "runs").exists()


def test_batch_of_one_per_process(tiny_folder, tmp_path, capsys):
    fails_with(smoke_args(tiny_folder, tmp_path, "--batch-size", "1"), capsys,
               "at least 2 images per process")


def test_runs_started_in_the_same_second_get_their_own_default_folders(tmp_path):
    """Without --out, two runs launched together (a sweep with `&`) get folders of their own."""
    code = ("import time; time.strftime = lambda *a: '20260101-000000'; import common, "
            f"{HARNESS} as harness; args = harness.parse_args(['--device', 'cpu']); "
            "common.setup(args); print(args.out)")
    runs = [subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, env=_env(),
                             stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [run.communicate(timeout=120)[0].strip() for run in runs]
    assert all(out.startswith(os.path.join("runs", f"{HARNESS}-20260101-000000")) for out in outs)
    assert outs[0] != outs[1], outs


def test_an_unreadable_image_is_named(tiny_folder, tmp_path, capsys):
    shutil.copytree(tiny_folder, tmp_path / "data")
    bad = tmp_path / "data" / "train" / "class1" / "3.png"
    bad.write_bytes(b"not a png")
    for workers in ("0", "2"):  # in this process, and in DataLoader workers
        out = tmp_path / f"out{workers}"
        fails_with(smoke_args(tmp_path / "data", out, "--workers", workers), capsys, str(bad))


def test_class_folders_that_differ_between_train_and_val_are_named(tiny_folder, tmp_path, capsys):
    shutil.copytree(tiny_folder, tmp_path / "data")
    shutil.copytree(tmp_path / "data" / "val" / "class0", tmp_path / "data" / "val" / "extra")
    fails_with(smoke_args(tmp_path / "data", tmp_path / "o"), capsys, "extra only in one")


def test_unknown_dataset_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        harness.main(["--dataset", "mnist"])
    assert exit_info.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_scripts_print_one_line_and_no_traceback(tiny_folder, tmp_path):
    """The real script as `python` (missing data) and under torchrun (batch not divisible by 2):
    our 'error:' line, a non-zero exit, no traceback from our code (torchrun adds its own
    report)."""
    one = run_script(f"{HARNESS}.py", smoke_args(tmp_path / "nowhere", tmp_path / "o1"))
    assert one.returncode == 2 and one.stderr.strip().startswith("error: ")
    assert "Traceback" not in one.stderr and len(one.stderr.strip().splitlines()) == 1
    argv = smoke_args(tiny_folder, tmp_path / "o2", "--batch-size", "15")
    two = run_script(f"{HARNESS}.py", argv, nproc=2)
    assert two.returncode != 0
    assert "error: --batch-size 15 must be a multiple of the 2 processes" in two.stderr
    assert f'{HARNESS}.py", line' not in two.stderr and 'common.py", line' not in two.stderr


def test_option_values_that_cannot_run_are_refused(tiny_folder, tmp_path, capsys):
    for option in (["--wd", "-1"], ["--lr", "inf"], ["--seed", str(2**40)]):
        with pytest.raises(SystemExit) as exit_info:
            harness.parse_args(smoke_args(tiny_folder, tmp_path, *option))
        assert exit_info.value.code == 2
        assert f"argument {option[0]}: must be" in capsys.readouterr().err
    for scale in (["1", "0.5"], ["0", "1"]):
        with pytest.raises(SystemExit) as exit_info:
            harness.parse_args(smoke_args(tiny_folder, tmp_path, "--crop-scale", *scale))
        assert exit_info.value.code == 2
        assert "--crop-scale" in capsys.readouterr().err.splitlines()[-1]
    (tmp_path / "a_file").write_text("")
    fails_with(smoke_args(tiny_folder, tmp_path / "a_file"), capsys,
               f"cannot write {tmp_path / 'a_file' / 'metrics.jsonl'} (File exists)")


def test_a_run_killed_between_logging_and_saving_an_epoch_logs_it_once(tiny_folder, tmp_path):
    argv = smoke_args(tiny_folder, tmp_path, "--epochs", "2", "--linear-epochs", "0")
    stop_in_epoch(2, argv)
    with open(tmp_path / "metrics.jsonl", "a") as f:  # epoch 2 logged, its checkpoint not saved
        f.write('{"epoch": 2, "loss": 0.0}\n{"epoch": 3, "lo')  # and half a line after it
    harness.main(argv)
    _, lines, _ = check_run_folder(tmp_path, epochs=2)
    assert lines[1]["loss"] != 0.0


def test_limit_train_keeps_every_class_of_an_image_folder(tiny_folder, tmp_path):
    """Image folders list their files class by class: --limit-train spreads over them."""
    args = harness.parse_args(smoke_args(tiny_folder, tmp_path, "--limit-train", "16"))
    data = common.load_data(args, ctx_for())
    assert len(data) == 16 and data.train_labels.bincount().tolist() == [6, 5, 5]


# ---- what a run says


@pytest.mark.rule("run-folder")
@pytest.mark.parametrize("script", METHODS)
def test_the_start_up_line_and_results_name_the_run(script, tmp_path, capsys):
    """The first line printed: run folder, data set, training images, classes, image size,
    device, processes; results.json names the command and the epochs trained. An untrained run
    (--epochs 0) still writes every file of a run folder, metrics.jsonl empty: tools that read run
    folders (benchmarks/compare.py) find the same files in every one."""
    module = __import__(script)
    out = tmp_path / "run"
    argv = ["--dataset", "textures", "--width", "8", "--epochs", "0", "--device", "cpu",
            "--linear-epochs", "0", "--out", str(out)]
    module.main(argv)
    first = capsys.readouterr().out.splitlines()[0]
    assert first == (f"run {out}  data textures  train 2000  classes 5  "
                     f"image 20 px  device cpu  processes 1")
    assert {"config.json", "metrics.jsonl", "backbone.pt", "results.json"} <= set(os.listdir(out))
    assert (out / "metrics.jsonl").read_text() == ""
    results = json.loads((out / "results.json").read_text())
    assert results["command"] == " ".join([f"{script}.py", *argv]) and results["epochs"] == 0


@pytest.mark.rule("help")
@pytest.mark.parametrize("script", METHODS)
def test_help_shows_one_default_per_option(script, capsys):
    """Each option of the script's --help names its default at most once (an option whose help
    text gives its own default gets no second "(default: None)" from argparse)."""
    with pytest.raises(SystemExit):
        __import__(script).parse_args(["--help"])
    options = capsys.readouterr().out.split("\n  -")[1:]  # each option's entry
    twice = [o.split()[0] for o in options if o.lower().count("default") > 1]
    assert not twice, (script, twice)


class Terminal(io.StringIO):
    """A stderr that says it is a terminal, as a user's shell is."""

    def isatty(self):
        return True


def test_the_bar_moves_every_step_of_a_short_epoch_and_shows_the_loss_of_20_steps_before(
        monkeypatch):
    """An epoch of 6 steps shows each step's images as it ends; a long one moves every 20 steps,
    and shows the mean loss as it was 20 steps before, copied to the host meanwhile (read on the
    host, a GPU's loss makes the host wait for the device): at step 40 of losses 1, 2, ..., 40,
    the mean of steps 1-20, 10.5, not today's 20.5."""
    monkeypatch.setattr(sys, "stderr", Terminal())
    short = common.EpochMeter(ctx_for(), 0, 1, 6, 8)
    short.update(0.1, loss=torch.tensor(1.0))
    assert short.bar.n == 8
    short.summary()
    meter = common.EpochMeter(ctx_for(), 0, 1, 400, 8)
    seen = []
    for step in range(1, 41):
        meter.update(0.1, loss=torch.tensor(float(step)))
        seen.append(meter.bar.n)
        if step == 20:
            assert "loss" not in meter.bar.postfix
    assert seen[:20] == [0] * 19 + [160] and "loss=10.5000" in meter.bar.postfix
    meter.summary()


def test_the_final_evaluation_shows_its_progress(tiny_folder, tmp_path, capsys):
    """The kNN monitor's feature passes and the final linear probe's epochs each show a progress
    bar (on ImageNet they take hours)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "stderr", Terminal())
        harness.main(smoke_args(tiny_folder, tmp_path / "tty", "--linear-epochs", "2"))
        err = sys.stderr.getvalue()
    assert "features:" in err and "linear probe:" in err and "epoch 1/1" in err


def test_a_log_piped_to_a_file_gets_the_epoch_lines_and_no_bars(tiny_folder, tmp_path, capsys):
    """Not on a terminal (stderr captured, as a file is), no progress bar redraws: the epoch line
    and the final lines alone."""
    harness.main(smoke_args(tiny_folder, tmp_path, "--linear-epochs", "2"))
    out, err = capsys.readouterr()
    assert "it/s" not in err and "features:" not in err and "epoch 1/1" not in err
    assert "epoch 1  loss " in out and "final: " in out


def test_the_epoch_meter_takes_numbers_sums_them_on_the_host_and_needs_the_loss():
    """meter.update(lr, loss, **diagnostics): tensors or plain numbers; a number (BYOL's tau) is
    summed on the host (made into a tensor on a GPU, it is a copy the host waits for:
    aten.lift_fresh on the CPU); no loss is a TypeError at the call, not some steps later."""
    meter = common.EpochMeter(ctx_for(), 0, 1, 2, 8)
    loss = torch.tensor(1.0)
    hits = torch.tensor(5)
    with OpNames() as ops:
        meter.update(0.1, loss=loss, hits=3, ema=0.99)
        meter.update(0.1, 2.0, hits=hits, ema=0.99)
    assert not [name for name in ops.names if "lift_fresh" in name], ops.names
    record = meter.summary()
    assert record["loss"] == 1.5 and record["hits"] == 4.0
    assert record["ema"] == pytest.approx(0.99)
    with pytest.raises(TypeError):
        common.EpochMeter(ctx_for(), 0, 1, 2, 8).update(0.1, hits=1)
