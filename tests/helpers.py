"""Helpers shared by the tests: a tiny generated ImageFolder, running the real scripts in a
subprocess (plain python or torchrun), and running a test function in 2 gloo processes."""

import contextlib
import os
import socket
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")


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


TEXTURES = ("horizontal_stripes", "vertical_stripes", "checkerboard", "dots", "rings")


def texture_image_folder(root, train_per_class=400, val_per_class=100, size=20, seed=0):
    """Write DATA/{train,val}/<texture>/<i>.png, one class per texture in TEXTURES.

    Each image is a two-tone texture (random period 4.5-6.5 px, random phase; rings around a random
    centre inside the image) in two fixed colours, either one as foreground, plus pixel noise.
    Within a class, images differ about as much as two augmentations of one image do (shift, zoom,
    colour), so instance discrimination must learn the texture; colour says nothing about the
    class, so an untrained network (whose pooled features mostly follow colour) is near chance.
    Vectorised: 2,500 images in about a second.
    """
    from PIL import Image

    generator = torch.Generator().manual_seed(seed)
    u = lambda *shape: torch.rand(*shape, generator=generator)
    colours = torch.tensor([[0.85, 0.75, 0.25], [0.2, 0.25, 0.6]]).view(2, 3, 1, 1)  # yellow, blue
    for split, count in (("train", train_per_class), ("val", val_per_class)):
        n = count * len(TEXTURES)
        label = torch.arange(n) % len(TEXTURES)  # (n,)
        period = (4.5 + 2 * u(n)).view(n, 1, 1)
        shift_y, shift_x = (period * u(n, 1, 1), period * u(n, 1, 1))
        centre_y, centre_x = (size * (0.2 + 0.6 * u(n, 1, 1)), size * (0.2 + 0.6 * u(n, 1, 1)))
        y, x = torch.meshgrid(
            torch.arange(size).float(), torch.arange(size).float(), indexing="ij"
        )  # (S, S)
        wave = lambda t: torch.sin(2 * torch.pi * t / period)  # (n, S, S)
        dy = torch.remainder(y + shift_y, period) - period / 2
        dx = torch.remainder(x + shift_x, period) - period / 2
        patterns = torch.stack(
            [
                wave(y + shift_y) > 0,
                wave(x + shift_x) > 0,
                wave(y + shift_y) * wave(x + shift_x) > 0,
                dy**2 + dx**2 < (0.3 * period) ** 2,
                wave(((y - centre_y) ** 2 + (x - centre_x) ** 2).sqrt()) > 0,
            ]
        )  # (classes, n, S, S)
        mask = patterns[label, torch.arange(n)].unsqueeze(1).float()  # (n, 1, S, S)
        first = torch.randint(2, (n,), generator=generator)  # which colour is the foreground
        images = mask * colours[first] + (1 - mask) * colours[1 - first]
        images = images + 0.08 * torch.randn(n, 3, size, size, generator=generator)  # (n, 3, S, S)
        pixels = (
            (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
        )  # (n, S, S, 3)
        for name in TEXTURES:
            os.makedirs(os.path.join(root, split, name), exist_ok=True)
        for i in range(n):
            Image.fromarray(pixels[i]).save(
                os.path.join(root, split, TEXTURES[label[i]], f"{i}.png")
            )
    return root
