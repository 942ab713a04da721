"""Speed of every method file on this device, in one Markdown table: does the device wait?

One row per method: images/s of the real loop (uint8 images held on the device, common.Augment
with the file's recipes, the lr schedule, the file's own train_step) beside the bare network step
(the same network calls on the same views, a trivial loss, backward, optimiser: their ratio is the
pipeline's efficiency, target >= 0.9 on a GPU); one epoch's seconds on CIFAR-10's shape (the
cuda preset; the cpu preset's few images), kNN monitor (common.evaluate) included; host-device
syncs per loop step (CUDA: torch.cuda.set_sync_debug_mode("warn"); target 0); peak GPU memory.
Then what the host dispatches: per method, the aten ops one step calls (counted with a
TorchDispatchMode: on a GPU each is a kernel launch) in common.Augment, in the rest of train_step
beyond the bare network step, and in the bare step, and their host ms at a size where dispatch is
all that costs (two 4 px images a step); then train_step's ops at 2 processes beside 1 (the
global BatchNorm, the gathers, DDP). Below it: common.Augment against torchvision's per-image
PIL pipeline, and common.LARS's step against torch.optim.SGD's on the same ResNet-18.

    python benchmarks/speed.py --device cuda                # real size: w64, 32 px, batch 256/512
    python benchmarks/speed.py --device cpu                 # small preset: w8, 16 px, 1,024 images
    python benchmarks/speed.py --device cpu --methods simco nnclr-dcl --out speed.md
"""
import argparse
import contextlib
import datetime
import gc
import os
import platform
import resource
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import common  # noqa: E402
import moco_simmoco_simco as mss  # noqa: E402
import nnclr_dcl  # noqa: E402
import simclr_dcl  # noqa: E402
import simsiam_byol_gsg as gsg  # noqa: E402

METHODS = {  # row -> (method file, its options); one row per method file at least
    "simclr-dcl": (simclr_dcl, ["--loss", "dcl"]),
    "mocov2": (mss, ["--method", "mocov2"]),
    "simco": (mss, ["--method", "simco"]),
    "simsiam-gsg": (gsg, ["--method", "simsiam", "--stopgrad", "guided"]),
    "byol-gsg": (gsg, ["--method", "byol", "--stopgrad", "guided"]),
    "nnclr-dcl": (nnclr_dcl, ["--loss", "dcl"]),
}
# the cpu preset's heads, queue and support set (the defaults' 65,536 rows and 2,048-wide heads
# would outweigh a width-8 ResNet); tests/test_cuda.py uses them too
SMALL_HEADS = {simclr_dcl: ["--proj-hidden", "64", "--proj-dim", "32"],
               mss: ["--proj-hidden", "64", "--proj-dim", "32", "--queue-size", "1024"],
               gsg: ["--proj-hidden", "64", "--proj-dim", "32", "--pred-hidden", "16"],
               nnclr_dcl: ["--proj-hidden", "64", "--proj-dim", "32", "--pred-hidden", "64",
                           "--support-size", "1024"]}


@dataclass
class Preset:
    width: int  # ResNet-18 base width
    image: int  # image side
    batch: int  # global batch; 0: each method's own default (256, GSG 512)
    train: int  # the epoch's images (each trained on once; then the kNN bank)
    test: int  # the kNN monitor's test images
    warmup: int  # untimed loop steps first (cuDNN's autotuning)
    sync_steps: int  # then loop steps counted under set_sync_debug_mode (CUDA only), untimed
    aug_images: int  # images through each augmentation pipeline
    heads: dict = field(default_factory=dict)  # method file -> options


PRESETS = {"cuda": Preset(64, 32, 0, 50000, 10000, 5, 3, 20000),
           "cpu": Preset(8, 16, 64, 1024, 256, 2, 0, 2000, SMALL_HEADS)}


# ------------------------------------------------------------------------------ one method's step
@dataclass
class Training:
    """A method's model, optimiser and state, built as its main() builds them, and its real step."""
    args: argparse.Namespace
    modules: dict  # name -> nn.Module: every parameter and buffer a step may change
    backbone: nn.Module
    optimizer: torch.optim.Optimizer
    step: object  # step(views, labels, order) -> loss: train_step; order: the epoch's CPU generator


def training(mod, argv, ctx, image_size):
    """Method file `mod` with options `argv` on ctx.device, from seed 0 (built on the CPU, then
    moved: the same weights on every device and process)."""
    args = mod.parse_args(argv)
    args.image_size = image_size
    torch.manual_seed(args.seed)
    lr, s = args.lr * args.batch_size / 256, image_size
    if mod is simclr_dcl:
        model = simclr_dcl.SimCLR(args.arch, args.width, s, args.proj_hidden, args.proj_dim)
        net = common.distribute(model.to(ctx.device), ctx)
        optimizer = common.pretraining_optimizer(model.parameters(), args, ctx, lr)
        return Training(args, {"net": model}, model.backbone, optimizer,
                        lambda views, labels, order: simclr_dcl.train_step(
                            net, optimizer, views, args, ctx)[0])
    if mod is mss:
        model = mss.Encoder(args.arch, args.width, s, args.proj_hidden, args.proj_dim)
        model = model.to(ctx.device)
        key_encoder = mss.momentum_encoder(model, ctx) if args.method != "simco" else None
        queues = nn.ModuleList(mss.KeyQueue(args.queue_size, args.proj_dim, args.seed + i)
                               for i in range(1 + args.symmetric)).to(ctx.device) \
            if args.method == "mocov2" else None
        net = common.distribute(model, ctx)
        optimizer = common.pretraining_optimizer(model.parameters(), args, ctx, lr)
        modules = {"net": model, "key_encoder": key_encoder, "queues": queues}
        return Training(args, {k: m for k, m in modules.items() if m is not None}, model.backbone,
                        optimizer, lambda views, labels, order: mss.train_step(
                            net, optimizer, views, args, ctx, key_encoder, queues)[0])
    if mod is gsg:
        model = gsg.SiameseNet(args.arch, args.width, s, args.proj_hidden, args.proj_dim,
                               args.pred_hidden, not args.no_predictor, args.proj_layers)
        model = model.to(ctx.device)
        target = gsg.momentum_encoder(model.encoder, ctx) if args.method == "byol" else None
        net = common.distribute(model, ctx)
        groups = [{"params": model.encoder.parameters(), "fix_lr": False},
                  {"params": model.predictor.parameters(), "fix_lr": args.fix_pred_lr}]
        optimizer = common.pretraining_optimizer(groups, args, ctx, lr)

        def step(views, labels, order):
            pairing = gsg.draw_pairing(args.batch_size, args.stopgrad, order, ctx)
            return gsg.train_step(net, optimizer, views, args, ctx, pairing=pairing,
                                  target=target, online=model.encoder, tau=args.ema)[0]
        modules = {"net": model, **({"target": target} if target is not None else {})}
        return Training(args, modules, model.encoder.backbone, optimizer, step)
    model = nnclr_dcl.NNCLR(args.arch, args.width, s, args.proj_hidden, args.proj_dim,
                            args.pred_hidden)
    net = common.distribute(model.to(ctx.device), ctx)
    optimizer = common.pretraining_optimizer(model.parameters(), args, ctx, lr)
    support_set = nnclr_dcl.SupportSet(args.support_size, args.proj_dim, args.seed).to(ctx.device)
    return Training(args, {"net": model, "support_set": support_set}, model.backbone, optimizer,
                    lambda views, labels, order: nnclr_dcl.train_step(
                        net, optimizer, views, args, ctx, labels, support_set)[0])


def recorded_step(t, views, labels, order):
    """One real step, noting each call of its networks: [(module, inputs, gradient on)]."""
    calls = []
    handles = [m.register_forward_pre_hook(
        lambda module, inputs: calls.append((module, inputs, torch.is_grad_enabled())))
        for m in t.modules.values()]  # the queues and the support set are never called
    try:
        t.step(views, labels, order)
    finally:
        for handle in handles:  # no hook left to keep the model alive into the next row
            handle.remove()
    return calls


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


@contextlib.contextmanager
def counting_syncs(counts):
    """Count the host-device synchronisations inside the block into `counts` (CUDA)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every synchronisation, not once per line
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(0)
    counts.append(sum("synchroniz" in str(w.message) for w in caught))


def held_data(preset, device):
    """What common.load_data returns for CIFAR-10, with random uint8 images: the train split
    doubles as the kNN bank (as CIFAR's does), the test split apart; held on the device."""
    n, s, g = preset.train + preset.test, preset.image, torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (n, 3, s, s), dtype=torch.uint8, generator=g).to(device)
    labels = torch.randint(0, 10, (n,), generator=g).to(device)
    train = images[:preset.train], labels[:preset.train]
    return common.Data(*train, train, (images[preset.train:], labels[preset.train:]), 10, s,
                       *common.STATS["cifar10"])


def method_row(name, preset, data, ctx):
    """One epoch of method `name`'s real loop, then its kNN monitor, then the bare step -> row."""
    mod, options = METHODS[name]
    cuda = ctx.device.type == "cuda"
    if cuda:  # the earlier rows' models are gone: this row's peak is its own
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(ctx.device)
    argv = [*options, "--width", str(preset.width), *preset.heads.get(mod, []),
            *(["--batch-size", str(preset.batch)] if preset.batch else [])]
    t = training(mod, argv, ctx, preset.image)
    batch, calls, syncs = t.args.batch_size, None, []
    augment = common.Augment(mod.recipes(t.args), preset.image, data.mean, data.std, ctx)
    steps, peak_lr = len(data) // batch, t.args.lr * batch / 256
    first_timed = preset.warmup + preset.sync_steps
    half = min(steps - first_timed, 20) // 2  # bare steps before the timed loop steps and after
    order, generator = common.epoch_generators(t.args.seed, 0, ctx.device)
    start = time.perf_counter()
    for i, (images, labels) in enumerate(common.train_batches(data, batch, order, ctx)):
        if i == first_timed:  # (a load that drifts favours neither side)
            sync(ctx.device)
            paused = time.perf_counter()
            bare_s = seconds_per_call(lambda: bare_step(calls, t.optimizer, ctx), ctx.device, half)
            timed_start = time.perf_counter()
            start += timed_start - paused  # the bare steps are no part of the epoch
        counted = cuda and preset.warmup <= i < first_timed
        with counting_syncs(syncs) if counted else contextlib.nullcontext():
            for group in t.optimizer.param_groups:
                group["lr"] = common.learning_rate(i, steps, 0, peak_lr)
            views = augment(images, generator)
            if i == 0:  # a warm-up step: note its network calls for the bare step
                calls = recorded_step(t, views, labels, order)
            else:
                t.step(views, labels, order)
    sync(ctx.device)
    end = time.perf_counter()
    common.evaluate(t.backbone, data, ctx, t.args)  # the kNN monitor
    sync(ctx.device)
    knn_s = time.perf_counter() - end
    bare_s += seconds_per_call(lambda: bare_step(calls, t.optimizer, ctx), ctx.device, half)
    loop_rate = (steps - first_timed) * batch / (end - timed_start)
    return {"method": name, "batch": batch, "views": len(views), "loop": loop_rate,
            "bare": 2 * batch / bare_s, "epoch_s": end - start + knn_s, "knn_s": knn_s,
            "syncs": sum(syncs) / len(syncs) if syncs else None,
            "memory": torch.cuda.max_memory_allocated(ctx.device) / 2 ** 30 if cuda else None}


# ------------------------------------------------------------------------------ what the host dispatches
# a step of two 4 px images: dispatch is all that costs
DISPATCH_BATCH = 2
DISPATCH_IMAGE = 4


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched inside the block: what a GPU launches a kernel for (views
    and other metadata ops included, which launch none: an upper bound)."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def ops_in(fn):
    """The aten ops one call of fn dispatches."""
    with OpCounter() as counter:
        fn()
    return counter.ops


def dispatch_steps(name, preset, ctx):
    """Method `name` (the preset's width and heads) on this process's DISPATCH_BATCH images of
    DISPATCH_IMAGE px, after a first step (which makes the optimiser's state) -> its views and
    one step's calls: common.Augment (the file's recipes), train_step, the bare step (the same
    network calls, a trivial loss, backward, the optimiser)."""
    mod, options = METHODS[name]
    argv = [*options, "--width", str(preset.width), *preset.heads.get(mod, []),
            "--batch-size", str(DISPATCH_BATCH * ctx.world)]
    t = training(mod, argv, ctx, DISPATCH_IMAGE)
    mean, std = common.STATS["cifar10"]
    augment = common.Augment(mod.recipes(t.args), DISPATCH_IMAGE, mean, std, ctx)
    g = torch.Generator().manual_seed(0)
    shape = (DISPATCH_BATCH, 3, DISPATCH_IMAGE, DISPATCH_IMAGE)
    images = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).to(ctx.device)
    labels = torch.randint(0, 10, (DISPATCH_BATCH,), generator=g).to(ctx.device)
    order, generator = common.epoch_generators(t.args.seed, 0, ctx.device)
    views = augment(images, generator)
    calls = recorded_step(t, views, labels, order)
    return len(views), {"augment": lambda: augment(images, generator),
                        "step": lambda: t.step(views, labels, order),
                        "bare": lambda: bare_step(calls, t.optimizer, ctx)}


def dispatch_row(name, preset, ctx):
    """The ops one step of method `name` dispatches in common.Augment, in train_step beyond the
    bare network step (the loss, diagnostics and bookkeeping: EMA, queue, support set) and in the
    bare step; then each one's host ms a step -> row."""
    views, steps = dispatch_steps(name, preset, ctx)
    ops = {k: ops_in(fn) for k, fn in steps.items()}
    ms = {k: 1e3 * seconds_per_call(fn, ctx.device, 10) for k, fn in steps.items()}
    return {"method": name, "views": views, "ops": ops, "ms": ms}


def two_process_worker(rank, port, names, preset, out):
    """Rank `rank` of 2 gloo processes on the CPU: each method's train_step ops (a rank's, after a
    first step) with GlobalBatchNorm, the gathers and DDP; rank 0 saves {name: ops} to `out`."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    ctx = common.Context(rank, 2, 0, torch.device("cpu"), "", False)
    preset.heads = {sys.modules[mod]: argv for mod, argv in preset.heads.items()}
    ops = {name: ops_in(dispatch_steps(name, preset, ctx)[1]["step"]) for name in names}
    if rank == 0:
        torch.save(ops, out)
    dist.destroy_process_group()


def two_process_ops(names, preset):
    """{name: train_step ops of a rank at 2 processes}, counted in 2 gloo processes on the CPU
    whatever the device: the ops dispatched do not depend on it."""
    with socket.socket() as s:  # a free port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "ops.pt")
        # the heads by module name: a module cannot be pickled
        heads = {mod.__name__: argv for mod, argv in preset.heads.items()}
        preset = replace(preset, heads=heads)
        torch.multiprocessing.spawn(two_process_worker, (port, names, preset, out), nprocs=2)
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
    """ms per step of common.LARS (nnclr_dcl.py's: eta 0.02, clipped, no trust ratio or weight
    decay on batch-norm and bias) and of torch.optim.SGD (momentum 0.9, weight decay on all, as
    --optimizer sgd), on ResNet-18's parameters with fixed random gradients -> (LARS, SGD)."""
    model = common.ResNet("resnet18", preset.width, preset.image).to(ctx.device)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    times = []
    for name in ("lars", "sgd"):
        args = argparse.Namespace(optimizer=name, wd=5e-4, lars_eta=0.02, lars_clip=True)
        optimizer = common.pretraining_optimizer(model.parameters(), args, ctx, 0.1)
        times.append(1e3 * seconds_per_call(optimizer.step, ctx.device, 20))
    return times


# ------------------------------------------------------------------------------ the table
def markdown_row(cells):
    return "| " + " | ".join(map(str, cells)) + " |"


def number(x, digits=0, unit=""):
    return "n/a" if x is None else f"{x:,.{digits}f}{unit}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=list(PRESETS), default="cuda" if torch.cuda.is_available()
                   else "cpu", help="the device and its preset")
    p.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS),
                   help="rows")
    p.add_argument("--out", help="also write the tables (Markdown) to this file")
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
        f"`python benchmarks/speed.py {' '.join(sys.argv[1:] if argv is None else argv)}`: "
        f"ResNet-18 w{preset.width}, {preset.image} px, {preset.train:,} + {preset.test:,} uint8 "
        f"images held on the device, bf16 autocast {'on' if ctx.amp else 'off'}.", "",
        markdown_row(["method", "batch", "views", "real loop img/s", "bare step img/s", "ratio",
                      f"epoch s ({preset.train:,} img; kNN s)", "syncs / step", "peak memory"]),
        "|" + "---|" * 9)
    data = held_data(preset, ctx.device)
    for name in o.methods:
        r = method_row(name, preset, data, ctx)
        say(markdown_row([name, r["batch"], r["views"], number(r["loop"]), number(r["bare"]),
                          f"{r['loop'] / r['bare']:.2f}", f"{r['epoch_s']:.1f} ({r['knn_s']:.1f})",
                          number(r["syncs"], 1), number(r["memory"], 2, " GiB")]))
    say("", f"Ops one step dispatches (aten ops, `TorchDispatchMode`) and host ms a step, at "
        f"{DISPATCH_BATCH} images of {DISPATCH_IMAGE} px (the counts do not depend on the size); "
        f"the rest: train_step beyond the bare network step.", "",
        markdown_row(["method", "views", "augmentation ops (a view)", "rest ops", "bare step ops",
                      "(augmentation + train_step) / bare", "augmentation ms", "train_step ms",
                      "bare step ms"]), "|" + "---|" * 9)
    one_process = {}
    for name in o.methods:
        r = dispatch_row(name, preset, ctx)
        ops = r["ops"]
        one_process[name] = ops["step"]
        ms = r["ms"]
        say(markdown_row([name, r["views"], f"{ops['augment']:,} ({ops['augment'] / r['views']:.0f})",
                          number(ops["step"] - ops["bare"]), number(ops["bare"]),
                          f"{(ops['augment'] + ops['step']) / ops['bare']:.2f}",
                          f"{ms['augment']:.2f}", f"{ms['step']:.2f}", f"{ms['bare']:.2f}"]))
    say("", "The same train_step at 2 processes: a rank's ops, with the global BatchNorm, the "
        "gathers and DDP's all-reduce (2 gloo processes on the CPU, whatever the device: the ops "
        "do not depend on it).", "",
        markdown_row(["method", "train_step ops, 1 process", "2 processes", "ratio"]),
        "|---|---|---|---|")
    for name, ops in two_process_ops(o.methods, preset).items():
        say(markdown_row([name, number(one_process[name]), number(ops),
                          f"{ops / one_process[name]:.2f}"]))
    ours, pil, workers = augmentation_rates(preset, ctx)
    lars, sgd = optimizer_step_ms(preset, ctx)
    say("", markdown_row(["baseline", "ours", "theirs", "ratio"]), "|---|---|---|---|",
        markdown_row([f"augmentation, SimCLR's recipe, {preset.image} px, "
                      f"{preset.aug_images:,} images", f"common.Augment {ours:,.0f} img/s",
                      f"torchvision PIL, {workers} workers {pil:,.0f} img/s",
                      f"{ours / pil:.1f}x"]),
        markdown_row([f"optimiser step, ResNet-18 w{preset.width}", f"common.LARS {lars:.2f} ms",
                      f"torch.optim.SGD {sgd:.2f} ms", f"{lars / sgd:.1f}x"]))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    say("", f"{time.perf_counter() - started:.0f} s in all; peak RSS of the process {rss:.2f} "
        f"GiB; load average {os.getloadavg()[0]:.1f}.")
    if o.out:
        with open(o.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
