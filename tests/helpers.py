"""Helpers shared by the tests (and benchmarks/speed.py): which method files exist and how each
runs small (QUICK_START, from the README), a script's main() run in this process with its
train_step watched (run_main), generated ImageFolders, running the real scripts in a subprocess
(plain python or torchrun), and running a test function in 2 gloo processes."""

import contextlib
import importlib
import os
import socket
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
# Every method file, found by itself: each top-level .py but common.py
# (a fifth method is in every structural test without a list to edit).
METHODS = tuple(sorted(name[:-3] for name in os.listdir(ROOT)
                       if name.endswith(".py") and name != "common.py"))


def quick_start():
    """{method file: its options in the README's quick start}: T, then its line's own. This is
    the one place that says how each method runs small: every test and benchmark of "each method"
    reads it (tests/test_readme.py checks that every method file has its line)."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    lines = text[text.index("## Quick start"):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("T="))
    t = " ".join(lines[start:start + 2]).split('"')[1].replace("\\", "").split()
    runs = {}
    for line in lines[start + 2:]:
        words = line.split("#")[0].split()
        if len(words) > 2 and words[0] == "python" and words[2] == "$T":
            runs[words[1][:-3]] = t + words[3:]
        elif not line.strip() or not line.startswith(" "):
            break
    return runs


QUICK_START = quick_start()
# The script the harness's tests run (the run folder, faults, data): the quick start's first
HARNESS = next(iter(QUICK_START))
# A method's quick start made tiny for a test: 2 epochs of 4 steps, a narrow network. Its
# --proj-hidden and --proj-dim are the README's T's, which every quick-start line passes.
TINY = ["--limit-train", "64", "--batch-size", "16", "--width", "4", "--proj-hidden", "16",
        "--proj-dim", "8", "--epochs", "2", "--warmup-epochs", "1", "--knn-k", "10",
        "--linear-epochs", "0", "--device", "cpu", "--workers", "0"]


def tiny(method, *more):
    """Method file `method`'s quick start, made tiny (TINY), then `more`."""
    return [*QUICK_START[method], *TINY, *map(str, more)]


class Stop(Exception):
    """Ends a main() run by run_main once it has taken the steps asked."""


def run_main(module, argv, before=None, after=None, steps=None, data=None):
    """module.main(argv) in this process as its user runs it, its train_step watched: before(i,
    args, kwargs) may return other (args, kwargs) for the i-th call (from 1), after(i, args,
    kwargs, result) sees it done; main ends after `steps` calls (None: when it ends). `data`, a
    common.Data, stands in for the data set (common.load_data). The names are put back, and any
    progress bar closed, after."""
    import common
    from tqdm import tqdm

    real_step, real_load, calls = module.train_step, common.load_data, []

    def train_step(*args, **kwargs):
        calls.append(1)
        if before is not None:
            args, kwargs = before(len(calls), args, kwargs) or (args, kwargs)
        result = real_step(*args, **kwargs)
        if after is not None:
            after(len(calls), args, kwargs, result)
        if steps is not None and len(calls) >= steps:
            raise Stop
        return result

    def load_data(args, ctx, crops=2):
        args.image_size = data.image_size
        return data

    module.train_step = train_step
    if data is not None:
        common.load_data = load_data
    try:
        module.main([str(a) for a in argv])
    except Stop:
        pass
    finally:
        module.train_step = real_step
        common.load_data = real_load
        for bar in list(tqdm._instances):
            bar.close()
    return len(calls)


def modules_of(args, kwargs):
    """The nn.Modules a train_step call was given (its networks, queue, support set)."""
    import torch.nn as nn

    return [v for v in [*args, *kwargs.values()] if isinstance(v, nn.Module)]


class FailingWrites:
    """A file that common.py opens for writing, whose write(data) calls `fail(file, data)`."""

    def __init__(self, file, fail):
        self.file, self.fail = file, fail

    def __enter__(self):
        return self

    def __exit__(self, *exception):
        self.file.close()

    def __getattr__(self, name):
        return getattr(self.file, name)

    def write(self, data):
        return self.fail(self.file, data)


def tiny_image_folder(
    root, classes=3, train_per_class=24, val_per_class=6, height=20, width=24, seed=0
):
    """Write DATA/{train,val}/class<c>/<i>.png: noisy images whose dominant colour is the class."""
    from torchvision.transforms.functional import to_pil_image

    generator = torch.Generator().manual_seed(seed)
    for split, count in (("train", train_per_class), ("val", val_per_class)):
        for c in range(classes):
            folder = os.path.join(root, split, f"class{c}")
            os.makedirs(folder, exist_ok=True)
            for i in range(count):
                image = torch.rand(3, height, width, generator=generator) * 90
                image[c % 3] += 150
                to_pil_image(image.clamp(0, 255).to(torch.uint8)).save(
                    os.path.join(folder, f"{i}.png")
                )
    return root


def smoke_args(data_dir, out, *extra):
    """The tiny-CPU option set: width 8, 16 px images, small batch, a short linear probe."""
    return [
        "--dataset",
        "imagefolder",
        "--data-dir",
        str(data_dir),
        "--image-size",
        "16",
        "--width",
        "8",
        "--epochs",
        "1",
        "--batch-size",
        "16",
        "--device",
        "cpu",
        "--linear-epochs",
        "2",
        "--workers",
        "0",
        "--out",
        str(out),
        *extra,
    ]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([ROOT, TESTS]))
    env.pop("WORLD_SIZE", None)
    env.pop("RANK", None)
    return env


def torchrun(nproc):
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        f"--master_port={free_port()}",
        "--master_addr=127.0.0.1",
    ]


def run_script(script, args, nproc=1, timeout=600):
    """Run ROOT/script as `python` (nproc=1) or under torchrun; returns the CompletedProcess."""
    launcher = [sys.executable] if nproc == 1 else torchrun(nproc)
    return subprocess.run(
        launcher + [os.path.join(ROOT, script), *map(str, args)],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_distributed(module, function, tmp_path, *args, nproc=2, timeout=600):
    """Run tests/<module>.py:<function>(*args) in `nproc` gloo processes (args as strings);
    returns each rank's result."""
    out = os.path.join(str(tmp_path), f"{function}.result")
    worker = os.path.join(TESTS, "dist_worker.py")
    command = torchrun(nproc) + [worker, module, function, out, *map(str, args)]
    done = subprocess.run(
        command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [torch.load(f"{out}.{rank}", weights_only=False) for rank in range(nproc)]


@contextlib.contextmanager
def float64():
    """Default dtype float64 inside the block (identities and 1-vs-2-process checks are exact
    there)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def identity(name, left_name, left, right_name, right, rtol=1e-5, atol=1e-12):
    """A paper's identity, left == right (tensors) as torch.testing.assert_close holds it, its
    two sides and their largest difference printed first: `pytest -s` shows the line, a failure
    shows it too, and otherwise pytest keeps it."""

    def first(t):
        values = ", ".join(f"{v:.4g}" for v in t.flatten()[:3].tolist())
        return f"[{values}{', ...' if t.numel() > 3 else ''}]"

    gap = (left - right).abs().max().item()
    print(f"{name}: {left_name} {first(left)} = {right_name} {first(right)}, "
          f"largest difference {gap:.1e}")
    torch.testing.assert_close(left, right, rtol=rtol, atol=atol)


def check_run_folder(out, epochs=None):
    """A finished run's folder: its files, one metrics line per epoch (rank 0 alone writes),
    the final kNN (k=200, k=1) and probe -> (config, metrics lines, results)."""
    import json

    out = str(out)
    assert {"config.json", "metrics.jsonl", "checkpoint.pt", "backbone.pt", "results.json"} <= set(
        os.listdir(out)
    )
    config = json.load(open(os.path.join(out, "config.json")))
    lines = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    epochs = config["args"]["epochs"] if epochs is None else epochs
    assert [line["epoch"] for line in lines] == list(range(1, epochs + 1))
    results = json.load(open(os.path.join(out, "results.json")))
    assert {"knn_top1", "knn_k1_top1"} <= results.keys()
    return config, lines, results


def texture_image_folder(root, seed=0):
    """common.texture_images(seed) written as DATA/{train,val}/<texture>/<i>.png (lossless: read
    back, the images of --dataset textures --seed SEED, in ImageFolder's order)."""
    from PIL import Image

    import common

    for split, (images, labels) in zip(("train", "val"), common.texture_images(seed)):
        for name in common.TEXTURES:
            os.makedirs(os.path.join(root, split, name), exist_ok=True)
        for i, (image, label) in enumerate(zip(images.permute(0, 2, 3, 1).numpy(), labels)):
            path = os.path.join(root, split, common.TEXTURES[label], f"{i}.png")
            Image.fromarray(image).save(path)
    return root


def stop_in_epoch(epoch, argv, script=HARNESS):
    """SCRIPT's main(argv) stopped as epoch `epoch` (from 1) begins its first step (4 steps an
    epoch: the tiny folder's 72 images, batch 16), as a kill would stop it: the checkpoint of
    epoch `epoch` - 1 kept. In this process: the script's train_step is put back after."""
    module = importlib.import_module(script)
    real = module.train_step
    steps = []

    def train_step(*args, **kwargs):
        steps.append(1)
        if len(steps) > (epoch - 1) * 4:
            raise Stop
        return real(*args, **kwargs)

    module.train_step = train_step
    try:
        module.main(argv)
    except Stop:
        pass
    else:
        raise AssertionError(f"{script} ended before epoch {epoch}")
    finally:
        module.train_step = real


def harness_module():
    """The harness script's module."""
    return importlib.import_module(HARNESS)


def small_network(width=4, image_size=8, hidden=16, dim=8):
    """A ResNet-18 and a projector with batch norm (Linear-BN-ReLU-Linear), as the methods build
    theirs: what common's tests train (LARS, the global BatchNorm, the probes)."""
    import torch.nn as nn

    import common

    class Network(nn.Module):
        def __init__(self):
            super().__init__()
            self.backbone = common.ResNet("resnet18", width, image_size)
            self.projector = nn.Sequential(
                nn.Linear(self.backbone.out_dim, hidden, bias=False), nn.BatchNorm1d(hidden),
                nn.ReLU(), nn.Linear(hidden, dim))

        def forward(self, x):
            return self.projector(self.backbone(x))

    return Network()


def global_batch_loss(z):
    """A loss over the global batch, as the contrastive ones are: each rank's unit rows against
    every rank's (gathered with their gradient), log-sum-exp -> the mean over this rank's rows."""
    import torch.nn.functional as F

    import common

    z = F.normalize(common.float32(z), dim=1)
    return (z @ common.gather_with_grad(z).T / 0.1).logsumexp(1).mean()
