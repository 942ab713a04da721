"""Throughput benchmark: does the device ever wait? One table, every figure from this run.

Rows of the table (benchmarks/README.md explains them at length):
  aug   images/s of common.Augment with simclr_dcl.py's recipe (batched, per-sample parameters)
        vs torchvision's per-image PIL pipeline for the same recipe, one DataLoader worker per core.
  step  images/s of each method file's own main() loop, run on random uint8 images held on the
        device: the file's Augment, train_step (with its queue, support set, EMA, pairing), the
        lr schedule and the step's scalars, nothing copied. baseline: the BARE step, the same
        network calls that train_step made (replayed) + backward of a trivial loss + SGD. ratio =
        real / bare (1.0: augmentation, loss and bookkeeping cost nothing). `loss share`: the
        file's loss function, forward + backward on the inputs it got in a real step, as a share
        of the real step. `peak mem`: torch.cuda.max_memory_allocated over the timed steps.
  loss  each loss's forward + backward at batch B, D = 128, vs ONE (2B x D) @ (D x 2B) matmul
        forward; `matmul floor` is the matmul work the loss cannot avoid, in that unit.

    python benchmarks/throughput.py --device cpu --width 16 --step-image-size 16     # small CPU run
    python benchmarks/throughput.py --device cpu --skip aug loss --steps 2 --warmup 1  # real size
    python benchmarks/throughput.py --device cuda --batch-size 512                   # one GPU
    python benchmarks/throughput.py --device cuda --method simco byol-gsg --compile  # a subset
"""
import argparse
import contextlib
import ctypes
import datetime
import functools
import gc
import importlib
import inspect
import os
import platform
import resource
import sys
import tempfile
import time
import traceback

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import common  # noqa: E402

# name -> (method file, its options); the batch is the file's own default unless --batch-size
METHODS = {
    "simclr-dcl": ("simclr_dcl", ["--loss", "dcl"]),
    "mocov2": ("moco_simmoco_simco", ["--method", "mocov2"]),
    "simmoco": ("moco_simmoco_simco", ["--method", "simmoco"]),
    "simco": ("moco_simmoco_simco", ["--method", "simco"]),
    "simsiam-gsg": ("simsiam_byol_gsg", ["--method", "simsiam", "--stopgrad", "guided"]),
    "byol-gsg": ("simsiam_byol_gsg", ["--method", "byol", "--stopgrad", "guided"]),
    "nnclr-dcl": ("nnclr_dcl", ["--loss", "dcl"]),
}
# the public loss functions the method files' train_step call (the loss-share column times them)
LOSSES = ("contrastive_loss", "dual_temperature_loss", "symmetric_loss", "guided_stopgrad_loss",
          "nnclr_loss")
CIFAR_MEAN, CIFAR_STD = common.STATS["cifar10"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu")
    a("--method", nargs="+", default=["all"], choices=["all", *METHODS], help="step rows")
    a("--batch-size", type=int, help="step rows: global batch (default: each method's own)")
    a("--arch", default="resnet18", choices=["resnet18", "resnet34", "resnet50"])
    a("--width", type=int, default=64, help="ResNet base width of the step rows")
    a("--step-image-size", type=int, default=32, help="image side of the step rows")
    a("--steps", type=int, default=10, help="timed steps per method (after --warmup)")
    a("--warmup", type=int, default=None, help="untimed steps first (default 2, 5 with --compile)")
    a("--compile", action="store_true", help="pass --compile to the method files")
    a("--online-probe", action=argparse.BooleanOptionalAction,
      help="pass --online-probe / --no-online-probe (default: each file's own); the step rows "
           "say the probe's share of the step")
    a("--no-amp", action="store_true", help="CUDA: float32 instead of bf16 autocast")
    a("--aug-batch", type=int, default=1024, help="images per call of the batched augmentation")
    a("--aug-image-size", type=int, default=32, help="augmentation rows: image side (CIFAR: 32)")
    a("--pil-images", type=int, help="images through the PIL pipeline (default 3000 per core)")
    a("--loss-batches", type=int, nargs="*", default=[256, 512, 1024, 2048, 4096])
    a("--loss-dim", type=int, default=128)
    a("--reps", type=int, default=3, help="timed repetitions of a loss / augmentation (best kept)")
    a("--skip", nargs="*", default=[], choices=["aug", "step", "loss"])
    a("--glibc-default-malloc", action="store_true",
      help="CPU: leave glibc returning each large freed block to the OS (see reuse_freed_memory)")
    args = p.parse_args(argv)
    args.method = list(METHODS) if "all" in args.method else args.method
    args.warmup = (5 if args.compile else 2) if args.warmup is None else args.warmup
    if args.warmup < 1 or args.steps < 1:
        p.error("--warmup and --steps must be at least 1 (the last warm-up step is recorded)")
    return args


def reuse_freed_memory():
    """CPU: let freed tensors' memory be reused, as PyTorch's CUDA caching allocator does on a GPU.

    glibc's malloc gives each block over 32 MB its own mmap and returns it to the OS when freed, so
    every such tensor (MoCo v2's (256, 65537) logits are 67 MB) page-faults its memory in again:
    on this project's CPU that doubled MoCo v2's loss (about 190 -> 80 ms) and slowed its step by
    a third. PyTorch's performance tuning guide recommends jemalloc or tcmalloc on CPU for the same
    reason; mallopt does it without a library. Returns whether glibc took the settings.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's malloc.h
    return bool(libc.mallopt(m_mmap_threshold, 2 ** 30)
                and libc.mallopt(m_trim_threshold, 2 ** 31 - 1))


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_time(fn, device, reps):
    """Best wall time of `reps` calls after one untimed call (host and device both finished)."""
    fn()
    best = float("inf")
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def row(part, what, batch="", ours="", baseline="", ratio="", floor="", share="", memory=""):
    return (part, what, batch, ours, baseline, ratio, floor, share, memory)


# ------------------------------------------------------------------------------ augmentation

class PilImages(torch.utils.data.Dataset):
    """CIFAR as torchvision serves it: uint8 HWC array -> PIL image -> the per-image transform."""

    def __init__(self, images, transform):
        self.images, self.transform = images, transform

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        from PIL import Image
        return self.transform(Image.fromarray(self.images[i])), 0


def pil_rate(recipe, size, n, workers):
    """images/s of torchvision's per-image (v1, PIL) transforms for `recipe` in a DataLoader."""
    import torchvision.transforms as T
    r = recipe
    transform = T.Compose([
        T.RandomResizedCrop(size, scale=r.crop_scale, ratio=r.crop_ratio),
        T.RandomHorizontalFlip(r.flip_p), T.RandomApply([T.ColorJitter(*r.jitter)], p=r.jitter_p),
        T.RandomGrayscale(r.gray_p), T.ToTensor(), T.Normalize(CIFAR_MEAN, CIFAR_STD)])
    images = torch.randint(0, 256, (n, size, size, 3), dtype=torch.uint8).numpy()
    loader = torch.utils.data.DataLoader(PilImages(images, transform), batch_size=256,
                                         num_workers=workers, persistent_workers=workers > 0)
    for _ in loader:  # start the workers (not timed)
        break
    start = time.perf_counter()
    count = sum(len(x) for x, _ in loader)
    return count / (time.perf_counter() - start)


def augmentation_rows(args, ctx):
    import simclr_dcl
    cores, s, b = os.cpu_count() or 1, args.aug_image_size, args.aug_batch
    options = simclr_dcl.parse_args(["--out", os.path.join(ctx.out, "aug")])
    options.image_size = s  # as main() sets it from the data
    recipe = simclr_dcl.recipes(options)[0]  # one view
    assert recipe.blur_p == 0 and recipe.solarize_p == 0, "the PIL baseline has no blur/solarise"
    augment = common.Augment([recipe], s, CIFAR_MEAN, CIFAR_STD, ctx)
    images = torch.randint(0, 256, (b, 3, s, s), dtype=torch.uint8, device=ctx.device)
    generator = torch.Generator(ctx.device).manual_seed(0)
    ours = b / best_time(lambda: augment(images, generator), ctx.device, args.reps)
    pil = pil_rate(recipe, s, args.pil_images or 3000 * cores, cores)
    where = f"{torch.get_num_threads()} threads" if ctx.device.type == "cpu" else str(ctx.device)
    return [row("aug", f"simclr_dcl recipe (hue, no blur), {s} px, one view; ours on {where} "
                       f"vs PIL in {cores} workers", b, f"{ours:,.0f} img/s", f"{pil:,.0f} img/s",
                f"{ours / pil:.1f}x")]


# ------------------------------------------------------------------------------ training steps

class StopMain(Exception):
    """Raised inside a method file's main() loop once the timed steps are done."""


def detached_copy(x):
    """A tensor argument as a fresh leaf (needing a gradient if the original did); else x."""
    if isinstance(x, torch.Tensor):
        return x.detach().clone().requires_grad_(x.requires_grad)
    return x


def tensors(x):
    """Every tensor in nested lists / tuples (a network's outputs)."""
    if isinstance(x, torch.Tensor):
        return [x]
    return [t for item in x for t in tensors(item)] if isinstance(x, (list, tuple)) else []


class StepProbe:
    """Stands in for a method file's `train_step` and loss functions while its own main() runs.

    Every call goes through unchanged. Call `warmup - 1` (untimed) also records the network calls
    train_step makes (for the bare step) and copies the loss functions' inputs (for the loss
    share); calls `warmup` .. `warmup + steps` delimit `steps` whole loop iterations; then the
    probe stops main() with StopMain. The bare steps are timed half just before that window,
    half after it, so that a machine whose load drifts (a shared CPU) biases neither side.
    """

    def __init__(self, mod, warmup, steps):
        self.train_step, self.warmup, self.steps = mod.train_step, warmup, steps
        self.losses = {name: self.recording_loss(getattr(mod, name))
                       for name in LOSSES if hasattr(mod, name)}
        self.calls, self.recording, self.bare_seconds = 0, False, 0.0
        self.network_calls, self.loss_calls = [], []

    def recording_loss(self, loss_fn):
        @functools.wraps(loss_fn)
        def loss(*args, **kwargs):
            if self.recording:
                self.loss_calls.append((loss_fn, [detached_copy(a) for a in args],
                                        {k: detached_copy(v) for k, v in kwargs.items()}))
            return loss_fn(*args, **kwargs)
        return loss

    def step(self, *args, **kwargs):
        inputs = inspect.signature(self.train_step).bind(*args, **kwargs).arguments
        ctx = self.ctx = inputs["ctx"]
        if self.calls == self.warmup + self.steps:
            sync(ctx.device)
            self.seconds = (time.perf_counter() - self.start) / self.steps
            raise StopMain
        if self.calls == self.warmup:
            self.time_bare_steps(self.steps - self.steps // 2)
            if ctx.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(ctx.device)
            self.start = time.perf_counter()
        self.recording = self.calls == self.warmup - 1
        hooks = self.record_networks(inputs) if self.recording else []
        try:
            out = self.train_step(*args, **kwargs)
        finally:
            self.recording = False
            for hook in hooks:
                hook.remove()
        if self.calls == self.warmup - 1:
            self.optimizer, self.views = inputs["optimizer"], len(inputs["views"])
            self.batch = len(inputs["views"][0]) * ctx.world
        self.calls += 1
        return out

    def record_networks(self, inputs):
        """Hooks that note each call of the networks train_step was given: the trained one (its
        first argument) and any other one that is not part of it (BYOL's target, MoCo's keys)."""
        modules = [m for m in inputs.values() if isinstance(m, nn.Module)]
        inside = {id(m) for m in modules[0].modules()}  # e.g. the online encoder, for the EMA

        def note(module, args):
            self.network_calls.append((module, args, torch.is_grad_enabled()))
        return [m.register_forward_pre_hook(note) for m in modules
                if m is modules[0] or id(m) not in inside]

    def time_bare_steps(self, n):
        sync(self.ctx.device)
        start = time.perf_counter()
        for _ in range(n):
            self.bare_step()
        sync(self.ctx.device)
        self.bare_seconds += time.perf_counter() - start

    def bare_step(self):
        """The recorded network calls, a trivial loss on their outputs, backward and SGD."""
        with self.ctx.autocast():
            outputs = []
            for module, args, grad in self.network_calls:
                with torch.set_grad_enabled(grad):
                    outputs.append(module(*args))
        loss = sum(t.float().mean() for t in tensors(outputs) if t.requires_grad)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()

    def loss_step(self):
        """Forward + backward of every loss call of the recorded step, on copies of its inputs."""
        for loss_fn, args, kwargs in self.loss_calls:
            for t in [*args, *kwargs.values()]:
                if isinstance(t, torch.Tensor):
                    t.grad = None
            out = loss_fn(*args, **kwargs)
            (out[0] if isinstance(out, tuple) else out).backward()  # (loss, stats) or loss


def synthetic_data(n, size, device):
    """What common.load_data returns for CIFAR, with random uint8 images of side `size`."""
    images = torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, device=device)
    labels = torch.randint(0, 10, (n,), device=device)
    return common.Data(images, labels, (images, labels), (images[:100], labels[:100]), 10, size,
                       CIFAR_MEAN, CIFAR_STD)


def measure_step(name, args, out):
    """Run the method file's main() on synthetic data under a StepProbe -> its table row."""
    module_name, options = METHODS[name]
    mod = importlib.import_module(module_name)
    argv = [*options, "--arch", args.arch, "--width", str(args.width), "--device", args.device,
            "--out", os.path.join(out, name), "--linear-epochs", "0"]
    argv += ["--batch-size", str(args.batch_size)] if args.batch_size else []
    argv += ["--compile"] if args.compile else []
    argv += [] if args.online_probe is None else [
        "--online-probe" if args.online_probe else "--no-online-probe"]
    argv += ["--no-amp"] if args.no_amp else []
    batch = mod.parse_args(argv).batch_size
    n = (args.warmup + args.steps + 1) * batch  # one epoch holds every step main() takes
    probe = StepProbe(mod, args.warmup, args.steps)
    online_seconds, online_step = [0.0], common.OnlineProbe.step

    def timed_online_step(self, *a, **k):  # the online probe's share of the timed steps
        sync(probe.ctx.device)
        start = time.perf_counter()
        online_step(self, *a, **k)
        sync(probe.ctx.device)
        if args.warmup < probe.calls <= args.warmup + args.steps:  # after a timed train_step
            online_seconds[0] += time.perf_counter() - start
    with contextlib.ExitStack() as stack:  # main() calls these through module attributes
        stack.enter_context(replaced(common.OnlineProbe, "step", timed_online_step))
        stack.enter_context(replaced(common, "load_data", lambda a, ctx, crops=2: synthetic_data(
            n, args.step_image_size, ctx.device)))
        stack.enter_context(replaced(mod, "train_step", probe.step))
        for loss_name, loss in probe.losses.items():
            stack.enter_context(replaced(mod, loss_name, loss))
        try:
            mod.main(argv)
        except StopMain:
            pass
        else:
            raise RuntimeError(f"{module_name}.main() returned before {probe.calls} steps")
    if not probe.network_calls or not probe.loss_calls:  # e.g. a loss function renamed
        raise RuntimeError(f"{module_name}.train_step called no network or none of {LOSSES}")
    device = probe.ctx.device
    memory = (f"{torch.cuda.max_memory_allocated(device) / 2 ** 30:.2f} GiB"
              if device.type == "cuda" else "n/a")
    probe.time_bare_steps(args.steps // 2)  # the other half is timed before the real steps
    bare = probe.bare_seconds / args.steps
    loss = best_time(probe.loss_step, device, args.reps)
    what = (f"{name} ({args.arch} w{args.width}, {args.step_image_size} px, "
            f"{probe.views} views)")
    if online_seconds[0]:
        what += f", online probe {100 * online_seconds[0] / args.steps / probe.seconds:.2f}%"
    return row("step", what, probe.batch, f"{probe.batch / probe.seconds:,.1f} img/s",
               f"{probe.batch / bare:,.1f} img/s (bare)", f"{bare / probe.seconds:.2f}", "",
               f"{100 * loss / probe.seconds:.2f}%", memory)


@contextlib.contextmanager
def replaced(owner, name, value):
    """owner.name = value for the duration of the block."""
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


def step_rows(args, ctx):
    for name in args.method:
        try:
            yield measure_step(name, args, ctx.out)
        except Exception as error:  # report the others; the exit status says one failed
            traceback.print_exc()
            yield row("step", name, "", f"FAILED: {type(error).__name__}: {error}"[:90])
            args.failed = True
        if ctx.device.type == "cuda":
            gc.collect()  # the last method's model and optimizer: not counted in the next's peak
            torch.cuda.empty_cache()


# ------------------------------------------------------------------------------ losses vs matmul

def loss_rows(args, ctx):
    import moco_simmoco_simco as dt
    import nnclr_dcl
    import simclr_dcl
    import simsiam_byol_gsg as gsg
    d, device, k, q = args.loss_dim, ctx.device, 65536, 16384
    queue = F.normalize(torch.randn(k, d, device=device), dim=1)
    support = F.normalize(torch.randn(q, d, device=device), dim=1)

    def contrastive(name):
        return lambda z1, z2: simclr_dcl.contrastive_loss(z1, z2, 0.1, name)

    def guided(z1, z2):  # z1, z2 stand for both crops' predictions; image i's partner is i - 1
        r = torch.arange(len(z1), device=device).roll(1)
        return gsg.guided_stopgrad_loss(z1, z2, z1[r], z2[r], *(z.detach() for z in
                                                                 (z1, z2, z1[r], z2[r])))[0]
    # name -> (loss, floor): the matmul work it cannot avoid, in units of one (2B x D) @ (D x 2B)
    losses = {f"simclr {n}": (contrastive(n), lambda b: 3) for n in ("infonce", "dcl", "dclw")}
    losses["simco (DT, symmetric)"] = (lambda z1, z2: (dt.dual_temperature_loss(z1, z2)[0]
                                                       + dt.dual_temperature_loss(z2, z1)[0]) / 2,
                                       lambda b: 1.5)
    losses["simmoco (DT, key detached)"] = (
        lambda z1, z2: dt.dual_temperature_loss(z1, z2.detach())[0], lambda b: 0.5)
    losses[f"mocov2 (InfoNCE, queue K={k})"] = (  # (B x K) forward + gradient of q
        lambda z1, z2: dt.dual_temperature_loss(z1, z2.detach(), 0.1, 0.1, queue)[0],
        lambda b: 2 * k / (4 * b))
    losses["gsg guided (simsiam/byol)"] = (guided, lambda b: 0)
    losses["symmetric (simsiam/byol)"] = (
        lambda z1, z2: gsg.symmetric_loss(z1, z2, z2.detach(), z1.detach()), lambda b: 0)
    losses[f"nnclr dcl (support {q})"] = (  # lookup + two (B x B) products
        lambda z1, z2: nnclr_dcl.nnclr_loss(z1.detach(), z2.detach(), z1, z2, support, 0.1,
                                            "dcl"), lambda b: q / (2 * b) + 1.5)
    for b in args.loss_batches:
        z = torch.randn(2 * b, d, device=device)
        mm = best_time(lambda: z @ z.T, device, max(args.reps, 5))
        g = torch.Generator(device).manual_seed(0)
        z1 = torch.randn(b, d, device=device, generator=g).requires_grad_()
        z2 = (z1.detach() + torch.randn(b, d, device=device, generator=g)).requires_grad_()
        for name, (loss_fn, floor) in losses.items():
            def run():
                z1.grad = z2.grad = None
                loss_fn(z1, z2).backward()
            t = best_time(run, device, args.reps)
            yield row("loss", name, b, f"{t * 1e3:.2f} ms", f"{mm * 1e3:.2f} ms (1 matmul)",
                      f"{t / mm:.1f}x", f"{floor(b):g}x")


# ------------------------------------------------------------------------------ main

def main(argv=None):
    args = parse_args(argv)
    args.failed = False
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("error: --device cuda but no CUDA GPU is visible")
        device = torch.device("cuda", torch.cuda.current_device())
        name = torch.cuda.get_device_name(device)
        amp = not args.no_amp and torch.cuda.is_bf16_supported(including_emulation=False)
    else:
        name = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                f"{torch.get_num_threads()} threads")
        reused = not args.glibc_default_malloc and reuse_freed_memory()
        name += "; freed memory reused (mallopt)" if reused else "; glibc's default malloc"
        amp = False
    torch.manual_seed(0)
    started = time.perf_counter()
    print(f"# throughput: {name}; torch {torch.__version__}; "
          f"{datetime.datetime.now():%Y-%m-%d %H:%M}; amp={'bf16' if amp else 'off'}; "
          f"compile={args.compile}")
    print("# command: python " + " ".join(sys.argv))
    header = ("part", "what", "B", "ours", "baseline", "ratio", "matmul floor", "loss share",
              "peak mem")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header), flush=True)
    with tempfile.TemporaryDirectory() as out:
        ctx = common.Context(0, 1, 0, device, out, amp)  # for the aug and loss rows
        parts = {"aug": augmentation_rows, "step": step_rows, "loss": loss_rows}
        for part, rows in parts.items():
            # row by row, as measured: a run stopped by a time-out keeps what it measured
            for r in rows(args, ctx) if part not in args.skip else []:
                print("| " + " | ".join(str(c) for c in r) + " |", flush=True)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    print(f"# {time.perf_counter() - started:.0f} s; load average at end {load:.2f}; "
          f"peak RSS of this process {rss:.2f} GiB")
    if args.failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
