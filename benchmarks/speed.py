"""Speed of every method file on this device, in Markdown tables: does the device wait?

Each method file is measured through its own main() (tests/helpers.run_main watches its
train_step), as the README's quick start names it, on uint8 images held on the device in
CIFAR-10's shape: a fifth script gets its row with nothing edited here. One row per method: images/s
of the real loop (the schedule, common.Augment with the file's recipes, its train_step, the
online probes, the progress bar) beside the bare network step (the network calls a step made,
replayed on the same views, a trivial loss, backward, the optimiser): their ratio is the
pipeline's efficiency, target >= 0.9 on a GPU; the GPU's busy fraction over a few steps
(torch.profiler); one epoch's seconds and its kNN monitor's; host-device syncs a step
(torch.cuda.set_sync_debug_mode("warn"); target 0); peak GPU memory. With --compile, the same
rows again with the script's --compile. A sync, a recompile or a loop slower than half the
bare step is said in a line of its own. Then what the host dispatches (aten ops a step, counted
with a TorchDispatchMode: on a GPU each is a kernel launch) at 1 process and 2, and two
baselines: common.Augment against torchvision's per-image PIL pipeline, common.LARS's step
against torch.optim.SGD's. Last, on CUDA, common.GlobalBatchNorm's fused kernels against
nn.BatchNorm2d and nn.SyncBatchNorm's kernels in a ResNet (--rows batchnorm: those alone).

    python benchmarks/speed.py --device cuda --compile  # real size: w64, 32 px, batch 256/512
    python benchmarks/speed.py --device cpu             # small preset: w8, 16 px, 1,024 images
    python benchmarks/speed.py --device cpu --methods nnclr_dcl --out speed.md
"""
import argparse
import contextlib
import datetime
import gc
import importlib
import inspect
import io
import json
import os
import platform
import resource
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from PIL import Image
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
import common  # noqa: E402
from helpers import QUICK_START, modules_of, run_main  # noqa: E402


@dataclass
class Preset:
    width: int  # ResNet-18 base width
    image: int  # image side
    batch: int  # global batch; 0: each script's own default (256, GSG 512)
    train: int  # the epoch's images (each trained on once; then the kNN bank)
    test: int  # the kNN monitor's test images
    warmup: int  # untimed loop steps first (cuDNN's autotuning, a compile)
    sync_steps: int  # then loop steps counted under set_sync_debug_mode (CUDA only)
    timed: int  # then the timed loop steps
    aug_images: int  # images through each augmentation pipeline
    small: bool  # the quick start's heads, queue and support set (else each script's defaults)


PRESETS = {"cuda": Preset(64, 32, 0, 50000, 10000, 10, 3, 40, 20000, False),
           "cpu": Preset(8, 16, 64, 1024, 256, 2, 0, 8, 2000, True)}


def command(method, preset, device, out, *more):
    """The method's command line at the preset: its quick start's own options (the small
    preset) or its defaults, at the preset's width and batch, one epoch."""
    argv = [*(QUICK_START[method] if preset.small else []), "--width", str(preset.width),
            "--epochs", "1", "--warmup-epochs", "0", "--eval-every", "1", "--linear-epochs",
            "0", "--device", device, "--workers", "0", "--out", out]
    batch = ["--batch-size", str(preset.batch)] if preset.batch else []
    return [*argv, *batch, *more]


def held_data(preset, device):
    """What common.load_data returns for CIFAR-10, with random uint8 images: the train split
    doubles as the kNN bank (as CIFAR's does), the test split apart; held on the device."""
    n, s, g = preset.train + preset.test, preset.image, torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (n, 3, s, s), dtype=torch.uint8, generator=g).to(device)
    labels = torch.randint(0, 10, (n,), generator=g).to(device)
    train = images[:preset.train], labels[:preset.train]
    return common.Data(*train, train, (images[preset.train:], labels[preset.train:]), 10, s,
                       *common.STATS["cifar10"])


# ------------------------------------------------------------------------------ a step's networks
def arguments(train_step, args, kwargs):
    """A train_step call's arguments by parameter name."""
    return inspect.signature(train_step).bind(*args, **kwargs).arguments


class Recorder:
    """The outermost calls of the given modules while it records: [(module, inputs, gradient
    on)] (a network called inside another is part of that call)."""

    def __init__(self, modules):
        self.calls, self.depth = [], 0
        self.handles = [h for m in modules for h in (
            m.register_forward_pre_hook(self.enter), m.register_forward_hook(self.leave))]

    def enter(self, module, inputs):
        if self.depth == 0:
            self.calls.append((module, inputs, torch.is_grad_enabled()))
        self.depth += 1

    def leave(self, module, inputs, output):
        self.depth -= 1

    def stop(self):  # no hook left to keep the model alive into the next row
        for handle in self.handles:
            handle.remove()
        return self.calls


def bare_step(calls, optimizer, ctx):
    """The recorded network calls on the same views, a trivial loss, backward, the optimiser: the
    step without augmentation, the method's loss or its bookkeeping (EMA, queue, support set)."""
    with ctx.autocast():
        outputs = []
        for module, inputs, grad in calls:
            with torch.set_grad_enabled(grad):
                outputs.append(module(*inputs))
    loss = sum(t.float().mean() for t in tensors(outputs) if t.requires_grad)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


def tensors(x):
    """Every tensor in nested lists and tuples (the networks' outputs)."""
    if torch.is_tensor(x):
        return [x]
    return [t for item in x for t in tensors(item)] if isinstance(x, (list, tuple)) else []


# ------------------------------------------------------------------------------ measuring
def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_per_call(fn, device, calls):
    """Mean wall time of `calls` calls after one untimed call, the device's work included."""
    fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync(device)
    return (time.perf_counter() - start) / calls


def compiled_graphs():
    """Graphs torch.compile has made so far in this process (a later one: a recompile)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def method_row(method, preset, data, device, compile_=False):
    """One epoch of the method's main() on `data`, its steps timed from inside -> row."""
    module = importlib.import_module(method)
    train_step = module.train_step
    cuda = device.type == "cuda"
    if cuda:  # the earlier rows' models are gone: this row's peak is its own
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    first_timed = preset.warmup + preset.sync_steps
    s = {"syncs": []}  # what the steps leave: times, counts, the last call

    def after(i, args, kwargs, result):
        if i == 1:  # the second step's network calls, for the bare step
            s["recorder"] = Recorder(modules_of(args, kwargs))
        if i == 2:
            s["calls"], s["call"] = s["recorder"].stop(), arguments(train_step, args, kwargs)
        if cuda and i == preset.warmup and preset.sync_steps:
            s["caught"] = warnings.catch_warnings(record=True)
            s["warnings"] = s["caught"].__enter__()
            warnings.simplefilter("always")  # every sync, not once per line
            torch.cuda.set_sync_debug_mode("warn")
        if cuda and i == first_timed and preset.sync_steps:
            torch.cuda.set_sync_debug_mode(0)
            s["caught"].__exit__(None, None, None)
            syncs = sum("synchroniz" in str(w.message) for w in s["warnings"])
            s["syncs"] = [syncs / preset.sync_steps]
        if i == first_timed:
            sync(device)
            s["graphs"], s["start"] = compiled_graphs(), time.perf_counter()
        if i == first_timed + preset.timed:
            sync(device)
            s["end"], s["regraphs"] = time.perf_counter(), compiled_graphs() - s["graphs"]
            if cuda:  # the GPU's busy time over 5 more steps
                s["profiler"] = torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CUDA])
                s["profiler"].start()
                s["profiled"] = time.perf_counter()
        if cuda and i == first_timed + preset.timed + 5:
            sync(device)
            wall = time.perf_counter() - s["profiled"]
            s["profiler"].stop()
            kernels = [e for e in s["profiler"].events()
                       if e.device_type == torch.autograd.DeviceType.CUDA]
            busy = sum(e.device_time_total for e in kernels) / 1e6  # us
            s["busy"] = min(1.0, busy / wall)

    monitor, knn = common.Run.monitor, []

    def timed_monitor(*args, **kwargs):  # the epoch's kNN monitor: features, then the vote
        start = time.perf_counter()
        result = monitor(*args, **kwargs)
        knn.append(time.perf_counter() - start)
        return result

    with tempfile.TemporaryDirectory() as out, contextlib.ExitStack() as undo:
        common.Run.monitor = timed_monitor
        undo.callback(setattr, common.Run, "monitor", monitor)
        if cuda:  # the progress bar on, as on a terminal: its cost and syncs counted
            hide_bar = common.hide_bar
            common.hide_bar = lambda rank: rank != 0
            undo.callback(setattr, common, "hide_bar", hide_bar)
        more = ["--compile"] if compile_ else []
        undo.enter_context(contextlib.redirect_stdout(io.StringIO()))  # main()'s lines
        run_main(module, command(method, preset, device.type, out, *more), after=after, data=data)
        with open(os.path.join(out, "metrics.jsonl")) as f:
            record = json.loads(f.readline())
    call = s["call"]
    batch, ctx = call["args"].batch_size, call["ctx"]
    timed_s = s["end"] - s["start"]
    bare_s = seconds_per_call(lambda: bare_step(s["calls"], call["optimizer"], ctx), device, 10)
    return {"method": method + " --compile" * compile_, "batch": batch, "views": len(call["views"]),
            "loop": preset.timed * batch / timed_s, "bare": batch / bare_s,
            "busy": s.get("busy"), "epoch_s": record["seconds"], "knn_s": knn[0],
            "syncs": s["syncs"][0] if s["syncs"] else None, "regraphs": s["regraphs"],
            "memory": torch.cuda.max_memory_allocated(device) / 2 ** 30 if cuda else None}


# ------------------------------------------------------------------------------ what the host dispatches
# a step of two 4 px images: dispatch is all that costs
DISPATCH = Preset(4, 4, 2, 8, 4, 0, 0, 0, 0, True)


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched inside the block: what a GPU launches a kernel for (views
    and other metadata ops included, which launch none: an upper bound)."""

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.collectives = 0  # of which c10d's (all_gather, all_reduce, ...)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.collectives += str(func.overloadpacket).startswith("c10d.")
        return func(*args, **(kwargs or {}))


def ops_in(fn):
    """The aten ops one call of fn dispatches."""
    with OpCounter() as counter:
        fn()
    return counter.ops


def dispatch_steps(method, ctx_device, batch=DISPATCH.batch, folder=None):
    """The method's main() at `batch` images of 4 px, stopped after its second step ->
    its views and that step's parts to replay: common.Augment (the file's recipes), train_step,
    the bare step. Its run folder: in `folder` (every rank's), or a temporary one."""
    module = importlib.import_module(method)
    s = {}
    augment_call = common.Augment.__call__

    def augment(self, x, generator):  # the step's augmentation, to replay
        s["augment"] = (self, x, generator)
        return augment_call(self, x, generator)

    def after(i, args, kwargs, result):
        if i == 1:
            s["recorder"] = Recorder(modules_of(args, kwargs))
        else:
            s["calls"], s["call"] = s["recorder"].stop(), (args, kwargs)

    data = held_data(DISPATCH, ctx_device)
    temporary = tempfile.TemporaryDirectory() if folder is None else contextlib.nullcontext(folder)
    with temporary as out, contextlib.ExitStack() as undo:
        out = os.path.join(out, method)
        common.Augment.__call__ = augment
        undo.callback(setattr, common.Augment, "__call__", augment_call)
        argv = command(method, DISPATCH, ctx_device.type, out, "--batch-size", batch)
        undo.enter_context(contextlib.redirect_stdout(io.StringIO()))  # main()'s lines
        run_main(module, argv, after=after, steps=2, data=data)
    args, kwargs = s["call"]
    bound = arguments(module.train_step, args, kwargs)
    aug, x, generator = s["augment"]
    return len(bound["views"]), {
        "augment": lambda: augment_call(aug, x, generator),
        "step": lambda: module.train_step(*args, **kwargs),
        "bare": lambda: bare_step(s["calls"], bound["optimizer"], bound["ctx"])}


def dispatch_row(method, device):
    """The ops one step of the method dispatches in common.Augment, in train_step beyond the bare
    network step (the loss, diagnostics and bookkeeping: EMA, queue, support set) and in the bare
    step; then each one's host ms a step -> row."""
    views, steps = dispatch_steps(method, device)
    ops = {k: ops_in(fn) for k, fn in steps.items()}
    ms = {k: 1e3 * seconds_per_call(fn, device, 10) for k, fn in steps.items()}
    return {"method": method, "views": views, "ops": ops, "ms": ms}


def two_process_worker(rank, port, methods, out):
    """Rank `rank` of 2 gloo processes on the CPU (each method's main() joins their group):
    each method's train_step ops (a rank's, after a first step) with GlobalBatchNorm, the
    gathers and DDP; rank 0 saves {method: (ops, collectives)} to `out`."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    ops = {}
    for method in methods:
        steps = dispatch_steps(method, torch.device("cpu"), 2 * DISPATCH.batch,
                               os.path.dirname(out))[1]
        with OpCounter() as counter:
            steps["step"]()
        ops[method] = counter.ops, counter.collectives
    if rank == 0:
        torch.save(ops, out)
    dist.destroy_process_group()


def two_process_ops(methods):
    """{method: (train_step ops of a rank at 2 processes, of which collectives)}, counted in 2
    gloo processes on the CPU whatever the device: the global BatchNorm's CPU path (autograd
    through plain arithmetic) dispatches more ops a layer than CUDA's fused kernels."""
    with socket.socket() as s:  # a free port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "ops.pt")
        torch.multiprocessing.spawn(two_process_worker, (port, methods, out), nprocs=2)
        return torch.load(out)


# ------------------------------------------------------------------------------ baselines
class PilImages(torch.utils.data.Dataset):
    """Images as torchvision serves CIFAR: uint8 HWC array -> PIL image -> `transform`."""

    def __init__(self, images, transform):
        self.images, self.transform = images, transform

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return self.transform(Image.fromarray(self.images[i]))


def augmentation_rates(preset, ctx):
    """images/s of common.Augment (SimCLR's CIFAR recipe, one view, batches of 512 on the device)
    and of torchvision's per-image PIL pipeline for the same recipe in DataLoader workers, one per
    core, on the same number of images (the workers' start not timed) -> (ours, PIL, workers)."""
    import torchvision.transforms as T
    n, s, r, (mean, std) = preset.aug_images, preset.image, common.Recipe(), common.STATS["cifar10"]
    images = torch.randint(0, 256, (n, 3, s, s), dtype=torch.uint8)
    augment = common.Augment([r], s, mean, std, ctx)
    batches = images.to(ctx.device).split(512)
    generator = torch.Generator(ctx.device).manual_seed(0)
    ours = n / seconds_per_call(lambda: [augment(b, generator) for b in batches], ctx.device, 1)
    transform = T.Compose([
        T.RandomResizedCrop(s, scale=r.crop_scale, ratio=r.crop_ratio), T.RandomHorizontalFlip(),
        T.RandomApply([T.ColorJitter(*r.jitter)], p=r.jitter_p), T.RandomGrayscale(r.gray_p),
        T.ToTensor(), T.Normalize(mean, std)])
    workers = os.cpu_count() or 1
    loader = torch.utils.data.DataLoader(PilImages(images.permute(0, 2, 3, 1).numpy(), transform),
                                         batch_size=256, num_workers=workers,
                                         persistent_workers=True)
    next(iter(loader))  # the workers started
    start = time.perf_counter()
    count = sum(len(x) for x in loader)
    return ours, count / (time.perf_counter() - start), workers


def optimizer_step_ms(preset, ctx):
    """ms per step of common.LARS (eta 0.02, clipped, no trust ratio or weight decay on
    batch-norm and bias: NNCLR's) and of torch.optim.SGD (momentum 0.9, weight decay on all), on
    ResNet-18's parameters with fixed random gradients -> (LARS, SGD)."""
    model = common.ResNet("resnet18", preset.width, preset.image).to(ctx.device)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    times = []
    for name in ("lars", "sgd"):
        args = argparse.Namespace(optimizer=name, wd=5e-4, lars_eta=0.02, lars_clip=True)
        optimizer = common.pretraining_optimizer(model.parameters(), args, 0.1)
        times.append(1e3 * seconds_per_call(optimizer.step, ctx.device, 20))
    return times


# ------------------------------------------------------------------------------ global BatchNorm
BATCHNORM_NETWORKS = [("resnet18", 32, 256), ("resnet50", 224, 128)]  # arch, px, batch (a GPU's)


class SyncBatchNormKernels(torch.nn.BatchNorm2d):
    """nn.SyncBatchNorm's autograd Function (its kernels, its all_gather and all_reduce, its
    empty-rank mask, which makes the host wait) at a world of 1, where nn.SyncBatchNorm itself
    falls back to nn.BatchNorm2d's kernels."""

    def forward(self, x):
        return torch.nn.modules._functions.SyncBatchNorm.apply(
            x, self.weight, self.bias, self.running_mean, self.running_var, self.eps,
            self.momentum, dist.group.WORLD, 1)


class PlainGlobalBatchNorm(common.GlobalBatchNorm):
    """common.GlobalBatchNorm's CPU path (plain arithmetic, autograd through the gather) on the
    GPU: what the fused kernels save."""

    def forward(self, x):
        return common.global_batch_norm(x, self) if self.training else super().forward(x)


BATCHNORMS = {"nn.BatchNorm2d (cuDNN)": torch.nn.BatchNorm2d,
              "nn.SyncBatchNorm's kernels": SyncBatchNormKernels,
              "GlobalBatchNorm, fused kernels": common.GlobalBatchNorm,
              "GlobalBatchNorm, plain arithmetic (the CPU's)": PlainGlobalBatchNorm}


def batchnorm_row(arch, image, batch, kind, ctx):
    """ms a forward and backward (bf16 autocast where native, channels_last, a mean as the
    loss) of a ResNet whose every BatchNorm is `kind`, at one process, and its peak memory."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(ctx.device)
    net = common.ResNet(arch, 64, image).to(ctx.device, memory_format=torch.channels_last)
    for m in net.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.__class__ = BATCHNORMS[kind]
    x = torch.randn(batch, 3, image, image, device=ctx.device)
    x = x.contiguous(memory_format=torch.channels_last)

    def step():
        with ctx.autocast():
            loss = net(x).float().mean()
        loss.backward()
    ms = 1e3 * seconds_per_call(step, ctx.device, 20)
    return ms, torch.cuda.max_memory_allocated(ctx.device) / 2 ** 30


def batchnorm_rows(ctx, say):
    """The BatchNorm table, or on the CPU the line saying why there is none."""
    if ctx.device.type != "cuda":
        say("", "No global BatchNorm rows: its fused kernels and nn.SyncBatchNorm's run on CUDA "
            "only.")
        return
    say("", "Global BatchNorm at one process (a forward and backward, bf16 where native, "
        "channels_last): ms a step and peak memory. nn.SyncBatchNorm's kernels run through "
        "their all_gather, all_reduce and host wait at a world of 1; GlobalBatchNorm skips its "
        "collectives there.", "",
        markdown_row(["network, a GPU's batch", *BATCHNORMS]), "|---" * (len(BATCHNORMS) + 1) + "|")
    started = not dist.is_initialized()  # nn.SyncBatchNorm's Function needs a process group
    if started:
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                device_id=ctx.device)
    try:
        for arch, image, batch in BATCHNORM_NETWORKS:
            cells = []
            for kind in BATCHNORMS:
                try:
                    cells.append("{:.1f} ms, {:.2f} GiB".format(
                        *batchnorm_row(arch, image, batch, kind, ctx)))
                except Exception as error:  # one that fails says why, the others are measured
                    cells.append(f"{type(error).__name__}: {error}"[:80])
            say(markdown_row([f"{arch}, {image} px, {batch}", *cells]))
    finally:
        if started:
            dist.destroy_process_group()


# ------------------------------------------------------------------------------ the tables
def markdown_row(cells):
    return "| " + " | ".join(map(str, cells)) + " |"


def number(x, digits=0, unit=""):
    return "n/a" if x is None else f"{x:,.{digits}f}{unit}"


def warnings_of(r):
    """One line for each thing a row found wrong."""
    found = []
    if r["syncs"]:
        found.append(f"{r['syncs']:.1f} host syncs a step: the host waits for the GPU")
    if r["regraphs"]:
        found.append(f"{r['regraphs']} graphs compiled in the timed steps: a recompile")
    if r["loop"] < 0.5 * r["bare"]:
        found.append(f"the loop runs at {r['loop'] / r['bare']:.2f} of the bare step's speed "
                     f"(slower than 2x the bare network step)")
    return [f"warning: {r['method']}: {text}" for text in found]


def method_tables(o, preset, ctx, say):
    """The method files' rows, the ops they dispatch at 1 process and 2, the two baselines."""
    say("", f"Each script's main(), ResNet-18 w{preset.width}, {preset.image} px, "
        f"{preset.train:,} + {preset.test:,} uint8 images held on the device, bf16 autocast "
        f"{'on' if ctx.amp else 'off'}.", "",
        markdown_row(["method", "batch", "views", "real loop img/s", "bare step img/s", "ratio",
                      "GPU busy", f"epoch s ({preset.train:,} img)", "kNN s", "syncs / step",
                      "peak memory"]), "|" + "---|" * 11)
    data = held_data(preset, ctx.device)
    found = []
    measured = []  # a script that cannot be built gets a line saying why, no row
    for method in o.methods:
        for compile_ in (False, True) if o.compile else (False,):
            try:
                r = method_row(method, preset, data, ctx.device, compile_)
            except Exception as error:  # its main() is not the others' shape
                say(f"{method}: not measured, {type(error).__name__}: {error}")
                break
            measured += [method] * (not compile_)
            say(markdown_row([r["method"], r["batch"], r["views"], number(r["loop"]),
                              number(r["bare"]), f"{r['loop'] / r['bare']:.2f}",
                              number(r["busy"], 2), f"{r['epoch_s']:.1f}", f"{r['knn_s']:.1f}",
                              number(r["syncs"], 1), number(r["memory"], 2, " GiB")]))
            found += warnings_of(r)
    say("", *(found or ["No host sync, recompile or slow loop found."]))
    say("", "Ops one step dispatches (aten ops, `TorchDispatchMode`) and host ms a step, at "
        f"{DISPATCH.batch} images of {DISPATCH.image} px (the counts do not depend on the size); "
        "the rest: train_step beyond the bare network step.", "",
        markdown_row(["method", "views", "augmentation ops (a view)", "rest ops", "bare step ops",
                      "(augmentation + train_step) / bare", "augmentation ms", "train_step ms",
                      "bare step ms"]), "|" + "---|" * 9)
    one_process = {}
    for method in measured:
        r = dispatch_row(method, ctx.device)
        ops, ms = r["ops"], r["ms"]
        one_process[method] = ops["step"]
        say(markdown_row([method, r["views"], f"{ops['augment']:,} ({ops['augment'] / r['views']:.0f})",
                          number(ops["step"] - ops["bare"]), number(ops["bare"]),
                          f"{(ops['augment'] + ops['step']) / ops['bare']:.2f}",
                          f"{ms['augment']:.2f}", f"{ms['step']:.2f}", f"{ms['bare']:.2f}"]))
    say("", "The same train_step at 2 processes: a rank's ops, with the global BatchNorm, the "
        "gathers and DDP's all-reduce (2 gloo processes on the CPU, whatever the device; the "
        "CPU's global BatchNorm dispatches more ops a layer than CUDA's fused kernels).", "",
        markdown_row(["method", "train_step ops, 1 process", "2 processes", "ratio",
                      "collectives, 2 processes"]), "|---|---|---|---|---|")
    for method, (ops, collectives) in two_process_ops(measured).items():
        say(markdown_row([method, number(one_process[method]), number(ops),
                          f"{ops / one_process[method]:.2f}", collectives]))
    ours, pil, workers = augmentation_rates(preset, ctx)
    lars, sgd = optimizer_step_ms(preset, ctx)
    say("", markdown_row(["baseline", "ours", "theirs", "ratio"]), "|---|---|---|---|",
        markdown_row([f"augmentation, SimCLR's recipe, {preset.image} px, "
                      f"{preset.aug_images:,} images", f"common.Augment {ours:,.0f} img/s",
                      f"torchvision PIL, {workers} workers {pil:,.0f} img/s",
                      f"{ours / pil:.1f}x"]),
        markdown_row([f"optimiser step, ResNet-18 w{preset.width}", f"common.LARS {lars:.2f} ms",
                      f"torch.optim.SGD {sgd:.2f} ms", f"{lars / sgd:.1f}x"]))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=list(PRESETS), default="cuda" if torch.cuda.is_available()
                   else "cpu", help="the device and its preset")
    p.add_argument("--methods", nargs="+", choices=list(QUICK_START), default=list(QUICK_START),
                   help="the method files (rows), as the README's quick start names them")
    p.add_argument("--compile", action="store_true", help="each row again with --compile")
    p.add_argument("--out", help="also write the tables (Markdown) to this file")
    p.add_argument("--rows", choices=["all", "methods", "batchnorm"], default="all",
                   help="methods: all but the global BatchNorm's; batchnorm: those alone")
    o = p.parse_args(argv)
    started, preset = time.perf_counter(), PRESETS[o.device]
    if o.device == "cpu":  # one thread: on a shared CPU a descheduled second thread stalls every
        torch.set_num_threads(1)  # small operator (measured: 2 threads 10-40x slower, load 5)
    # this process's device as every script's: cuDNN's autotuner, bf16 where native (common.setup)
    ctx = common.setup(argparse.Namespace(batch_size=2, device=o.device, amp=None, out=""))
    device = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else \
        f"CPU {platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} thread(s)"
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip() or "n/a"
    lines = []

    def say(*new):  # printed as measured: a run stopped early keeps what it measured
        print("\n".join(new), flush=True)
        lines.extend(new)
    say(f"#### speed.py: {device}, {datetime.datetime.now():%Y-%m-%d %H:%M}, torch "
        f"{torch.__version__}, git {commit}", "",
        f"`python benchmarks/speed.py {' '.join(sys.argv[1:] if argv is None else argv)}`.")
    if o.rows != "batchnorm":
        method_tables(o, preset, ctx, say)
    if o.rows != "methods":
        batchnorm_rows(ctx, say)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    say("", f"{time.perf_counter() - started:.0f} s in all; peak RSS of the process {rss:.2f} "
        f"GiB; load average {os.getloadavg()[0]:.1f}.")
    if o.out:
        with open(o.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
