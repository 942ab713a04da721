"""Helpers shared by the tests (and benchmarks/speed.py): which method files exist and how each
runs small (QUICK_START, from the README), main() run here with its train_step watched
(run_main), generated ImageFolders, the real scripts in a subprocess (python or torchrun), a test
function in 2 gloo processes, and checks of run folders."""

import collections
import contextlib
import importlib
import io
import json
import os
import socket
import subprocess
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
# Every method file, found by itself: each top-level .py but common.py.
METHODS = tuple(sorted(name[:-3] for name in os.listdir(ROOT)
                       if name.endswith(".py") and name != "common.py"))


def readme_quick_start():
    """The README's quick start: T's options, and the lines after T's two."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    lines = text[text.index("## Quick start"):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("T="))
    t = " ".join(lines[start:start + 2]).split('"')[1].replace("\\", "").split()
    return t, lines[start + 2:]


def quick_start():
    """{method file: its options in the README's quick start}: T, then its line's own: the one
    place that says how each method runs small, for every test and benchmark of "each method"."""
    t, lines = readme_quick_start()
    runs = {}
    for line in lines:
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
    """module.main(argv) in this process, its train_step watched: before(i, args, kwargs) may
    return other (args, kwargs) for the i-th call (from 1), after(i, args, kwargs, result) sees it
    done; main ends after `steps` calls (None: when it ends). `data`, a common.Data, stands in for
    the data set. The names are put back, and any progress bar closed, after -> the calls."""
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


class OpNames(TorchDispatchMode):
    """The ops dispatched inside the block, counted by name (`aten.add`, `c10d.allreduce_`)."""

    def __init__(self):
        super().__init__()
        self.names = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def modules_of(args, kwargs):
    """The nn.Modules a train_step call was given (its networks, queue, support set)."""
    import torch.nn as nn

    return [v for v in [*args, *kwargs.values()] if isinstance(v, nn.Module)]


class FailingWrites(io.FileIO):
    """A file that common.py opens for writing, whose write(data) calls `fail(write, data)` with
    its real write."""

    def __init__(self, path, mode, fail):
        super().__init__(path, mode)
        self.fail = fail

    def write(self, data):
        return self.fail(super().write, data)


def tiny_image_folder(root, classes=3, train_per_class=24, val_per_class=6, height=20, width=24,
                      seed=0):
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
                image = to_pil_image(image.clamp(0, 255).to(torch.uint8))
                image.save(os.path.join(folder, f"{i}.png"))
    return root


def smoke_args(data_dir, out, *extra):
    """The tiny-CPU option set: width 8, 16 px images, small batch, a short linear probe."""
    return ["--dataset", "imagefolder", "--data-dir", str(data_dir), "--image-size", "16",
            "--width", "8", "--epochs", "1", "--batch-size", "16", "--device", "cpu",
            "--linear-epochs", "2", "--workers", "0", "--out", str(out), *extra]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([ROOT, TESTS]))
    env.pop("WORLD_SIZE", None)
    env.pop("RANK", None)
    return env


def torchrun(nproc, nodes=1, node=0, port=None):
    """The torchrun launcher of `nproc` processes (node `node` of `nodes` on this machine, all
    meeting at `port`; a free one by default)."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
            f"--nnodes={nodes}", f"--node_rank={node}", f"--master_port={port or free_port()}",
            "--master_addr=127.0.0.1"]


def run_script(script, args, nproc=1, timeout=600):
    """Run ROOT/script as `python` (nproc=1) or under torchrun; returns the CompletedProcess."""
    launcher = [sys.executable] if nproc == 1 else torchrun(nproc)
    return subprocess.run(launcher + [os.path.join(ROOT, script), *map(str, args)], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=timeout)


def run_ok(script, args, nproc=1):
    """run_script, which must succeed: its output's end is the failure's message."""
    done = run_script(script, args, nproc)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def run_distributed(module, function, tmp_path, *args, nproc=2, timeout=600):
    """Run tests/<module>.py:<function>(*args) in `nproc` gloo processes (args as strings);
    returns each rank's result."""
    out = os.path.join(str(tmp_path), f"{function}.result")
    worker = os.path.join(TESTS, "dist_worker.py")
    command = torchrun(nproc) + [worker, module, function, out, *map(str, args)]
    done = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [torch.load(f"{out}.{rank}", weights_only=False) for rank in range(nproc)]


@contextlib.contextmanager
def float64():
    """Default dtype float64 inside the block."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def identity(name, left_name, left, right_name, right, rtol=1e-5, atol=1e-12):
    """A paper's identity, left == right (tensors) as torch.testing.assert_close holds it, its
    two sides and their largest difference printed first (`pytest -s` shows the line)."""

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
    out = str(out)
    files = {"config.json", "metrics.jsonl", "checkpoint.pt", "backbone.pt", "results.json"}
    assert files <= set(os.listdir(out))
    config = json.load(open(os.path.join(out, "config.json")))
    lines = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    epochs = config["args"]["epochs"] if epochs is None else epochs
    assert [line["epoch"] for line in lines] == list(range(1, epochs + 1))
    results = json.load(open(os.path.join(out, "results.json")))
    assert {"knn_top1", "knn_k1_top1"} <= results.keys()
    return config, lines, results


def stop_in_epoch(epoch, argv, script=HARNESS):
    """SCRIPT's main(argv) stopped as epoch `epoch` (from 1) begins its first step (4 steps an
    epoch: the tiny folder's 72 images, batch 16), as a kill would stop it: the checkpoint of
    epoch `epoch` - 1 kept. In this process (run_main)."""
    def before(step, args, kwargs):
        if step > (epoch - 1) * 4:
            raise Stop

    taken = run_main(importlib.import_module(script), argv, before=before)
    assert taken > (epoch - 1) * 4, f"{script} ended before epoch {epoch}"


def flat_tensors(state, prefix=""):
    """{path: tensor} of every tensor in nested dicts, lists and tuples (a checkpoint's)."""
    if torch.is_tensor(state):
        return {prefix: state}
    if not isinstance(state, (dict, list, tuple)):
        return {}
    items = state.items() if isinstance(state, dict) else enumerate(state)
    return {k: t for key, v in items for k, t in flat_tensors(v, f"{prefix}/{key}").items()}


def same_run(a, b):
    """Two finished run folders alike: results.json (but the command's --out), backbone.pt's and
    the last checkpoint's tensors, every epoch's loss."""
    results = [json.loads((run / "results.json").read_text()) for run in (a, b)]
    commands = [r.pop("command").split(" --out ") for r in results]
    assert commands[0][0] == commands[1][0] and results[0] == results[1]
    for name in ("backbone.pt", "checkpoint.pt"):
        x = flat_tensors(torch.load(a / name, weights_only=True))
        y = flat_tensors(torch.load(b / name, weights_only=True))
        assert x.keys() == y.keys() and len(x) > 50, name
        assert all(torch.equal(x[k], y[k]) for k in x), name
    losses = [[json.loads(line)["loss"] for line in open(run / "metrics.jsonl")] for run in (a, b)]
    assert losses[0] == losses[1] and len(losses[0]) == 2


def ctx_for(rank=0, world=1, amp=False):
    """The common.Context of rank `rank` of `world` processes on the CPU (local rank 0)."""
    import common

    return common.Context(rank, world, 0, torch.device("cpu"), amp)


def harness_module():
    """The harness script's module."""
    return importlib.import_module(HARNESS)


def small_network(width=4, image_size=8, hidden=16, dim=8):
    """A ResNet-18 and a projector with batch norm (Linear-BN-ReLU-Linear), as the methods build
    theirs."""
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
