"""The GPU check: is every method's CUDA step right, how long does a CIFAR-10 epoch take, where does
a step's time go, and does the GPU ever wait for the host? About 5 minutes on one H200.

    bash benchmarks/gpu_check.sh                       # CUDA GPU: the check, one command
    GPU_CHECK_DEVICE=cpu bash benchmarks/gpu_check.sh  # dry run: every part at tiny sizes
    bash benchmarks/gpu_check.sh --compile --with-tests  # + the optional parts

Each part runs in its own process under its own time limit (a failure or a hang stops that part
only) and writes its log and its rows (JSON lines) under GPU_CHECK_OUT; the summary, in Markdown,
is printed last and written to summary.md there. Every part runs the method files' own main(),
with `common.load_data` replaced by generated uint8 images held on the device, and stands in for
their `train_step` with a probe that calls the real one (as throughput.py's StepProbe does).
  correctness  one training step of every method on the device against the same step on the CPU
               in float32 (TF32 off), from the same weights and the same views: loss, gradient
               norm, and the update (after - before) of each module's parameters and buffers;
               then the device step under bf16 autocast against that CPU step (TOLERANCES)
  epoch        one epoch of every method's default recipe at batch 512 on images of CIFAR-10's
               shape (50,000 train + 10,000 test, 32 px, ResNet-18 width 64), kNN monitor included
  regions      where a step's time goes: each region of the loop (augmentation, forward, loss,
               backward, optimiser, after the step: EMA / queue / support set) on the device's
               timeline (CUDA events) and the host's, the share of wall time the GPU is busy (the
               profiler's kernels), and host-device synchronisations per step
               (torch.cuda.set_sync_debug_mode; the goal is 0 inside train_step)
  small        the regions rows at batch 32 and 64 (what each of 8 GPUs gets from a batch of 256)
  compile      (--compile) the regions rows with --compile; warm-up seconds include compilation
  dist         (two GPUs visible, or the CPU dry run) every method in 2 processes for one short
               epoch; its first steps' global losses against one process on the same batches
  tests        (--with-tests) the CPU test suite
"""
import argparse
import contextlib
import datetime
import functools
import importlib
import inspect
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import throughput  # noqa: E402  (puts the project's root on sys.path)
from throughput import METHODS, StopMain, replaced, sync  # noqa: E402
import common  # noqa: E402

ROOT = throughput.ROOT
# every method's step for the correctness part: the step rows' seven, and the variants whose
# train_step takes another path (a second queue, two crops, random stop-gradient, DCLW)
CHECKED = {**METHODS,
           "simclr-dclw": ("simclr_dcl", ["--loss", "dclw"]),
           "mocov2-symmetric": ("moco_simmoco_simco", ["--method", "mocov2", "--symmetric"]),
           "simsiam-symmetric": ("simsiam_byol_gsg", ["--method", "simsiam",
                                                      "--stopgrad", "symmetric"]),
           "byol-random": ("simsiam_byol_gsg", ["--method", "byol", "--stopgrad", "random"])}
# The largest relative error allowed against the CPU step in float32: loss (relative; absolute
# below 1), gradient norm, and each module's update, |delta - delta_cpu| / |delta_cpu| over its
# parameters, and over its buffers. Set from CPU measurements (ResNet-18 w16, batch 64, 32 px;
# benchmarks/README.md): in float32, another convolution algorithm (oneDNN off) moved the loss
# by <= 1.1e-6, the gradient norm by <= 3.4e-4 and updates by <= 1.1e-2 (the summation order's
# rounding grows through the backward pass), EMA targets' by <= 2.6e-2 (their first change is
# 1e-7 of the weight, near float32's resolution); under bf16 autocast updates moved by <= 0.68
# (NNCLR's neighbours change), so bf16's update bound is loose: 1.0 is an update lost or doubled.
TOLERANCES = {"float32": {"loss": 1e-4, "grad_norm": 5e-3, "update": 5e-2},
              "bf16": {"loss": 1e-2, "grad_norm": 5e-2, "update": 0.9}}
DIST_TOLERANCE = 1e-3  # 2 processes vs 1, float32: the first steps' global losses


@dataclass
class Sizes:
    width: int  # ResNet-18 base width
    image: int  # image side
    check_batch: int  # correctness
    epoch_train: int  # epoch: training images (every one trained on, then the kNN bank)
    epoch_test: int
    batch: int  # epoch and regions
    small_batches: tuple
    warmup: int  # regions: untimed steps first
    steps: int  # regions: timed steps
    sync_steps: int  # regions: steps under set_sync_debug_mode
    profile_steps: int  # regions: steps under the profiler (CUDA only)
    dist_images: int
    dist_batch: int
    dist_steps: int  # first steps compared between 2 processes and 1
    options: tuple = ()  # (method file, [options]) pairs: smaller heads, queue, support set


HEADS = ["--proj-hidden", "64", "--proj-dim", "32"]  # the small sizes' heads, queue, support set
SMALL = (("simclr_dcl", HEADS), ("moco_simmoco_simco", [*HEADS, "--queue-size", "1024"]),
         ("simsiam_byol_gsg", [*HEADS, "--pred-hidden", "16"]),
         ("nnclr_dcl", [*HEADS, "--pred-hidden", "64", "--support-size", "1024"]))
PRESETS = {  # full: a CUDA GPU; dry: the CPU dry run (minutes); tiny: the test of the dry run
    "full": Sizes(64, 32, 64, 50000, 10000, 512, (32, 64), 3, 10, 3, 3, 4096, 256, 3),
    "dry": Sizes(8, 16, 16, 1024, 256, 64, (32, 64), 1, 3, 2, 0, 256, 32, 2, SMALL),
    "tiny": Sizes(4, 8, 8, 64, 32, 16, (8,), 1, 1, 1, 0, 64, 16, 2, SMALL),
}
# part -> the seconds it may take at the full sizes (x4 on the CPU); all but OPTIONAL: the check
PARTS = {"correctness": 70, "regions": 50, "small": 45, "epoch": 130,
         "compile": 300, "dist": 180, "tests": 900}
OPTIONAL = ("compile", "dist", "tests")


# ------------------------------------------------------------------------------ running main()

def cifar_like(n_train, n_test, size, device, seed=0):
    """What common.load_data returns for CIFAR-10, with random uint8 images on `device`: the train
    split doubles as the kNN bank (as CIFAR's does), the test split is apart. Drawn on the CPU, so
    that every process and device holds the same images."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n_train + n_test, 3, size, size), dtype=torch.uint8,
                           generator=generator).to(device)
    labels = torch.randint(0, 10, (n_train + n_test,), generator=generator).to(device)
    train = images[:n_train], labels[:n_train]
    return common.Data(*train, train, (images[n_train:], labels[n_train:]), 10, size,
                       *common.STATS["cifar10"])


def run_main(name, options, data, patches):
    """Run method `name`'s own main() with `options`, common.load_data returning data(ctx), and
    each (owner, attribute, value) of `patches(module)` in place, until a patch raises StopMain."""
    module_name, file_options = CHECKED[name]
    mod = importlib.import_module(module_name)
    with contextlib.ExitStack() as stack:
        stack.enter_context(replaced(common, "load_data",
                                     lambda args, ctx, *more, **named: data(ctx)))
        for owner, attribute, value in patches(mod):
            stack.enter_context(replaced(owner, attribute, value))
        try:
            mod.main([*file_options, "--linear-epochs", "0", "--workers", "0", *options])
        except StopMain:
            return
    raise RuntimeError(f"{module_name}.main() returned before the check had what it needed")


def method_options(o, sizes, out, batch, name):
    """The options every part gives method file `name`: width, device, batch, run folder."""
    return ["--width", str(sizes.width), "--device", o.device, "--batch-size", str(batch),
            "--out", out, *dict(sizes.options).get(CHECKED[name][0], [])]


def each_method(rows, write):
    """write(make_row()) for each (label, make_row) of `rows`; a method that fails gets an error
    row (its traceback in the log) and the others still run; then the part fails if one did."""
    failed = []
    for label, make_row in rows.items():
        try:
            write(make_row())
        except Exception as error:
            traceback.print_exc()
            write({"method": label, "error": f"{type(error).__name__}: {error}"[:200]})
            failed.append(label)
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)}")


def dict_argument(args, kwargs):
    """The dict among a call's arguments (the record of log_epoch, the results of finish)."""
    return next(a for a in [*args, *kwargs.values()] if isinstance(a, dict))


def top_modules(inputs):
    """The nn.Module arguments of a train_step call, each once: (name, module), skipping those
    inside an earlier one (GSG's `online` encoder is part of `net`)."""
    found, inside = [], set()
    for name, value in inputs.items():
        if isinstance(value, nn.Module) and id(value) not in inside:
            found.append((name, value))
            inside |= {id(m) for m in value.modules()}
    return found


# ------------------------------------------------------------------------------ correctness

def tensor_inputs(inputs):
    """The tensors a train_step call was given (views, GSG's partners, NNCLR's labels): CPU
    copies."""
    def cpu(v):
        return [t.detach().cpu() for t in v] if isinstance(v, (list, tuple)) else v.detach().cpu()
    return {k: cpu(v) for k, v in inputs.items() if torch.is_tensor(v)
            or isinstance(v, (list, tuple)) and v and all(torch.is_tensor(t) for t in v)}


def moved(value, device):
    """A tensor (or list of them) on `device`: contiguous on the CPU, as the CPU's own views are;
    on CUDA the layout it was recorded in (channels_last views)."""
    def move(t):
        t = t.to(device)
        return t.contiguous() if device.type == "cpu" else t
    return [move(t) for t in value] if isinstance(value, list) else move(value)


def snapshot(modules):
    """{(module, 'params' | 'buffers', name): CPU copy} of every tensor of the modules."""
    state = {}
    for arg, module in modules:
        for kind, named in (("params", module.named_parameters()),
                            ("buffers", module.named_buffers())):
            state.update({(arg, kind, n): t.detach().cpu().clone() for n, t in named})
    return state


class OneStep:
    """Stands in for a method file's train_step for one call: the real train_step, on the tensors
    `given` (views, partners, labels of another run) or on its own (then recorded in `given`);
    snapshots of every module it was given before and after; then main() stops.
    `perturb`: noise on the first view before the step, a deliberately wrong one."""

    def __init__(self, train_step, given=None, perturb=False):
        self.train_step, self.given, self.perturb = train_step, given, perturb

    def __call__(self, *args, **kwargs):
        bound = inspect.signature(self.train_step).bind(*args, **kwargs)
        inputs = bound.arguments  # changes here reach bound.args / bound.kwargs
        device = inputs["ctx"].device
        if self.given is None:
            self.given = tensor_inputs(inputs)
        else:
            inputs.update({k: moved(v, device) for k, v in self.given.items()})
        if self.perturb:
            view = inputs["views"][0]
            noise = torch.randn(view.shape, generator=torch.Generator().manual_seed(1))
            inputs["views"] = [view + 0.05 * noise.to(view), *inputs["views"][1:]]
        modules = top_modules(inputs)
        self.before = snapshot(modules)
        out = self.train_step(*bound.args, **bound.kwargs)
        self.loss = float(out[0])
        grads = [p.grad.detach().double().norm() for group in inputs["optimizer"].param_groups
                 for p in group["params"] if p.grad is not None]
        self.grad_norm = float(torch.stack(grads).norm())
        self.after = snapshot(modules)
        raise StopMain


def one_step(name, o, sizes, amp, given=None, perturb=False):
    """One step of `name` on o.device (amp: bf16 autocast) -> OneStep with its snapshots."""
    probe = None
    real_setup = common.setup

    def setup(args):  # the precision is this check's to choose, on the CPU too (its dry run)
        ctx = real_setup(args)
        ctx.amp = amp
        return ctx

    def patches(mod):
        nonlocal probe
        probe = OneStep(mod.train_step, given, perturb)
        return [(mod, "train_step", probe), (common, "setup", setup)]
    with tempfile.TemporaryDirectory() as out:
        run_main(name, method_options(o, sizes, out, sizes.check_batch, name),
                 lambda ctx: cifar_like(sizes.check_batch, 16, sizes.image, ctx.device), patches)
    return probe


def step_errors(candidate, reference):
    """Relative errors of one step against the reference: loss, gradient norm, and the update
    (after - before) of each module's parameters and buffers; integer buffers (queue pointers,
    labels, BatchNorm's counters) must be equal. Also 'start': the largest difference before the
    step (0: the two steps started from the same weights)."""
    errors = {"loss": abs(candidate.loss - reference.loss) / max(abs(reference.loss), 1.0),
              "grad_norm": abs(candidate.grad_norm - reference.grad_norm) / reference.grad_norm}
    sums, start = {}, 0.0
    for key, before in reference.before.items():
        mine, mine_after, after = candidate.before[key], candidate.after[key], reference.after[key]
        group = f"{key[0]}.{key[1]}"  # e.g. net.params, queues.buffers
        if not before.is_floating_point():
            start = max(start, float((mine != before).any()))
            if not torch.equal(mine_after, after):
                sums[group] = [math.inf, 1.0]
            continue
        start = max(start, float((mine.double() - before.double()).abs().max()))
        delta, reference_delta = mine_after.double() - mine.double(), after.double() - before
        total = sums.setdefault(group, [0.0, 0.0])
        total[0] += float((delta - reference_delta).square().sum())
        total[1] += float(reference_delta.square().sum())
    for group, (error, size) in sums.items():
        errors[f"update {group}"] = (0.0 if error == 0 else
                                     math.sqrt(error / size) if size > 0 else math.inf)
    errors["start"] = start
    return errors


def verdict(errors, tolerance):
    """The errors over their tolerance, as 'name error > tolerance' ('' when all are within)."""
    failed = [f"{k} {v:.2g} > {tolerance[k.split()[0]]:g}" for k, v in errors.items()
              if k != "start" and not v <= tolerance[k.split()[0]]]
    if errors["start"] != 0:
        failed.insert(0, f"different weights before the step ({errors['start']:.2g})")
    return "; ".join(failed)


def check_method(name, o, sizes, perturb=False):
    """The correctness row of one method: its step on o.device in float32 and in bf16 against the
    step on the CPU in float32, on the device step's own views. On the CPU (the dry run) the
    'device' step runs with oneDNN off, PyTorch's own convolutions: another summation order, as a
    GPU's; its bf16 (CPU autocast, not CUDA's) is shown, not judged. `perturb`: the device step
    gets noise on its first view (a check of the check: its float32 comparison must fail)."""
    with replaced(torch.backends.mkldnn, "enabled", o.device != "cpu"):
        device_step = one_step(name, o, sizes, amp=False, perturb=perturb)
    cpu = argparse.Namespace(**{**vars(o), "device": "cpu"})
    reference = one_step(name, cpu, sizes, amp=False, given=device_step.given)
    half = one_step(name, o, sizes, amp=True, given=device_step.given, perturb=perturb)
    row = {"method": name, "batch": sizes.check_batch, "loss": reference.loss}
    for precision, step in (("float32", device_step), ("bf16", half)):
        errors = step_errors(step, reference)
        row[precision] = {"errors": errors, "failed": verdict(errors, TOLERANCES[precision])}
    judged = ("float32", "bf16") if o.device == "cuda" else ("float32",)
    row["ok"] = not any(row[p]["failed"] for p in judged)
    if o.device != "cuda":
        row["bf16"]["failed"] = "not judged (CPU autocast) " + row["bf16"]["failed"]
    return row


def correctness_part(o, sizes, write):
    if o.device == "cuda":  # float32 as the CPU computes it: no TF32 in matmuls or convolutions
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    each_method({n: functools.partial(check_method, n, o, sizes) for n in o.checked}, write)


# ------------------------------------------------------------------------------ epoch

def epoch_row(name, o, sizes):
    timing = {}
    real_evaluate = common.evaluate

    def evaluate(*args, **kwargs):  # the kNN monitor, timed
        sync(torch.device(o.device))
        start = time.perf_counter()
        result = real_evaluate(*args, **kwargs)
        sync(torch.device(o.device))
        timing["knn_s"] = time.perf_counter() - start
        return result

    def log_epoch(*args, **kwargs):  # the epoch is over: no checkpoint, no final evaluation
        timing["record"] = dict_argument(args, kwargs)
        raise StopMain
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        run_main(name, ["--epochs", "1", "--eval-every", "1",
                        *method_options(o, sizes, out, sizes.batch, name)],
                 lambda ctx: cifar_like(sizes.epoch_train, sizes.epoch_test, sizes.image,
                                        ctx.device),
                 lambda mod: [(common, "evaluate", evaluate), (common, "log_epoch", log_epoch)])
    record = timing["record"]
    epoch_s = record["seconds"] + timing["knn_s"]
    steps = sizes.epoch_train // sizes.batch
    return {"method": name, "batch": sizes.batch, "train_images": sizes.epoch_train,
            "test_images": sizes.epoch_test, "train_s": record["seconds"],
            "knn_s": timing["knn_s"], "epoch_s": epoch_s,
            "train_img_s": record["images_per_s"], "epoch_img_s": steps * sizes.batch / epoch_s,
            "loss": record["loss"], "knn_top1": record.get("knn_top1"),
            "setup_s": time.perf_counter() - start - epoch_s}


def epoch_part(o, sizes, write):
    each_method({n: functools.partial(epoch_row, n, o, sizes) for n in o.methods}, write)


# ------------------------------------------------------------------------------ regions

REGIONS = ("augment", "forward", "loss", "backward", "optimizer", "after step", "loop")


class Clock:
    """Marks on the device's timeline (CUDA events) beside the host clock; on the CPU the host's
    alone, which is then the device's too."""

    def __init__(self, device):
        self.cuda, self.marks = device.type == "cuda", []

    def mark(self, name):
        event = torch.cuda.Event(enable_timing=True) if self.cuda else None
        if event is not None:
            event.record()
        self.marks.append((name, event, time.perf_counter()))

    def regions(self):
        """After a synchronisation: {region: [device ms, host ms]} summed over the marks. Each
        interval belongs to the region its first mark opens; inside train_step, whatever is not a
        forward pass before zero_grad (loss, diagnostics, casts, gathers) is 'loss'."""
        totals = {r: [0.0, 0.0] for r in REGIONS}
        opens = {"aug_start": "augment", "fwd_start": "forward", "step_start": "loss",
                 "fwd_end": "loss", "zero_grad": "backward", "opt_start": "optimizer",
                 "opt_end": "after step", "step_end": "loop", "aug_end": "loop"}
        for (name, event, host), (_, next_event, next_host) in zip(self.marks, self.marks[1:]):
            host_ms = 1e3 * (next_host - host)
            device_ms = event.elapsed_time(next_event) if self.cuda else host_ms
            totals[opens[name]][0] += device_ms
            totals[opens[name]][1] += host_ms
        return totals


def busy_share(profiler, wall_s):
    """Share of `wall_s` in which the GPU ran a kernel, copy or fill: the union of their
    intervals in the profiler's trace."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        profiler.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in events
                   if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    busy, end = 0.0, -math.inf
    for start, stop in spans:
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return busy / 1e6 / wall_s


class RegionProbe:
    """Stands in for a method file's train_step (and wraps common.Augment, the networks given to
    train_step and its optimizer) while its main() runs. Iterations, each counted from its
    augmentation: `warmup` untimed; `steps` with a mark at each region's edge; `sync_steps` under
    torch.cuda.set_sync_debug_mode('warn'), counting the warnings; `profile_steps` under the
    profiler (CUDA); then main() stops. Every call goes through unchanged."""

    def __init__(self, mod, device, warmup, steps, sync_steps, profile_steps):
        self.train_step, self.device = mod.train_step, device
        self.timed = range(warmup, warmup + steps)
        self.syncs = range(self.timed.stop, self.timed.stop + sync_steps)
        cuda = device.type == "cuda"
        self.profiled = range(self.syncs.stop, self.syncs.stop + (profile_steps if cuda else 0))
        self.calls, self.clock, self.hooks, self.caught = 0, Clock(device), [], None
        self.sync_counts, self.sync_sites = {"train_step": 0, "loop": 0}, {}
        self.busy, self.warmup_s = None, 0.0
        self.start = time.perf_counter()
        real_augment = common.Augment.__call__

        @functools.wraps(real_augment)
        def augment(augmenter, *args, **kwargs):
            self.iteration_starts()
            self.mark("aug_start")
            views = real_augment(augmenter, *args, **kwargs)
            self.mark("aug_end")
            return views
        self.augment = augment

    def mark(self, name):
        if self.calls in self.timed:
            self.clock.mark(name)

    def iteration_starts(self):
        """At each augmentation: open and close the windows."""
        i = self.calls
        if i == self.timed.start:
            sync(self.device)
            self.warmup_s = time.perf_counter() - self.start
            self.timed_start = time.perf_counter()
        if i == self.timed.stop:  # the last mark, an iteration's start, closes the timed steps
            self.clock.mark("aug_start")
            sync(self.device)
            self.timed_s = time.perf_counter() - self.timed_start
            for hook in self.hooks:
                hook.remove()
        if i == self.syncs.start and len(self.syncs):
            self.catch = warnings.catch_warnings(record=True)
            self.caught = self.catch.__enter__()
            warnings.simplefilter("always")  # every synchronisation, not once per line
            if self.device.type == "cuda":
                torch.cuda.set_sync_debug_mode("warn")
        if i == self.syncs.stop and len(self.syncs):
            self.take_syncs("loop")
            if self.device.type == "cuda":
                torch.cuda.set_sync_debug_mode(0)
            self.catch.__exit__(None, None, None)
            self.caught = None
        if i == self.profiled.start and len(self.profiled):
            sync(self.device)
            self.profiler = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CUDA])
            self.profiler.start()
            self.profile_start = time.perf_counter()
        if i == self.profiled.stop and len(self.profiled):
            sync(self.device)
            wall = time.perf_counter() - self.profile_start
            try:  # a profiler that fails costs this column only
                self.profiler.stop()
                self.busy = busy_share(self.profiler, wall)
            except Exception:
                traceback.print_exc()
        if i == self.profiled.stop:
            raise StopMain

    def take_syncs(self, where):
        """Count the synchronisation warnings caught since the last call as `where`'s
        ('train_step' or 'loop'), tallying their source lines in sync_sites."""
        for w in self.caught:
            if "synchroniz" in str(w.message):
                self.sync_counts[where] += 1
                site = f"{os.path.relpath(w.filename, ROOT)}:{w.lineno}"
                self.sync_sites[site] = self.sync_sites.get(site, 0) + 1
        self.caught.clear()

    def step(self, *args, **kwargs):
        inputs = inspect.signature(self.train_step).bind(*args, **kwargs).arguments
        if self.calls == self.timed.start:
            self.instrument(inputs)
        self.mark("step_start")
        if self.caught is not None:
            self.take_syncs("loop")
        out = self.train_step(*args, **kwargs)
        if self.caught is not None:
            self.take_syncs("train_step")
        self.mark("step_end")
        if self.calls == self.timed.start:
            self.optimizer, self.views = inputs["optimizer"], len(inputs["views"])
            self.batch = len(inputs["views"][0]) * inputs["ctx"].world
        self.calls += 1
        return out

    def instrument(self, inputs):
        """Marks at each forward pass of the networks given, at zero_grad and the optimizer step."""
        for _, module in top_modules(inputs):
            self.hooks.append(module.register_forward_pre_hook(
                lambda *_: self.mark("fwd_start")))
            self.hooks.append(module.register_forward_hook(lambda *_: self.mark("fwd_end")))
        optimizer = inputs["optimizer"]
        zero_grad = optimizer.zero_grad

        def marked_zero_grad(*args, **kwargs):  # backward follows it
            self.mark("zero_grad")
            return zero_grad(*args, **kwargs)
        optimizer.zero_grad = marked_zero_grad
        self.hooks.append(optimizer.register_step_pre_hook(lambda *_: self.mark("opt_start")))
        self.hooks.append(optimizer.register_step_post_hook(lambda *_: self.mark("opt_end")))


def region_row(name, o, sizes, batch, sync_steps=None, compile=False):
    device = torch.device(o.device)
    probe = None
    warmup = sizes.warmup + 2 * compile  # compiling takes the first steps

    def patches(mod):
        nonlocal probe
        probe = RegionProbe(mod, device, warmup, sizes.steps,
                            sizes.sync_steps if sync_steps is None else sync_steps,
                            sizes.profile_steps)
        return [(mod, "train_step", probe.step), (common.Augment, "__call__", probe.augment)]
    iterations = warmup + sizes.steps + sizes.sync_steps + sizes.profile_steps + 1
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with tempfile.TemporaryDirectory() as out:
        run_main(name, ["--epochs", "1", *method_options(o, sizes, out, batch, name),
                        *(["--compile"] if compile else [])],
                 lambda ctx: cifar_like(iterations * batch, 16, sizes.image, ctx.device), patches)
    regions = probe.clock.regions()
    per_step = {r: [ms / sizes.steps for ms in v] for r, v in regions.items()}
    counted = len(probe.syncs) if device.type == "cuda" else 0  # no device to wait for on a CPU
    row = {"method": name, "batch": probe.batch, "views": probe.views,
           "img_s": probe.batch * sizes.steps / probe.timed_s,
           "step_ms": 1e3 * probe.timed_s / sizes.steps,
           "device_ms": {r: v[0] for r, v in per_step.items()},
           "host_ms": {r: v[1] for r, v in per_step.items()},
           "gpu_busy": probe.busy, "warmup_s": probe.warmup_s, "compile": compile,
           "syncs_train_step": probe.sync_counts["train_step"] / counted if counted else None,
           "syncs_loop": probe.sync_counts["loop"] / counted if counted else None,
           "sync_sites": dict(sorted(probe.sync_sites.items(), key=lambda kv: -kv[1])[:6]),
           "peak_mem_gib": (torch.cuda.max_memory_allocated(device) / 2 ** 30
                            if device.type == "cuda" else None)}
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def regions_part(o, sizes, write):
    each_method({n: functools.partial(region_row, n, o, sizes, sizes.batch) for n in o.methods},
                write)


def small_part(o, sizes, write):
    each_method({f"{n} at batch {b}": functools.partial(region_row, n, o, sizes, b, sync_steps=0)
                 for b in sizes.small_batches for n in o.methods}, write)


def compile_part(o, sizes, write):
    each_method({n: functools.partial(region_row, n, o, sizes, sizes.batch, sync_steps=0,
                                      compile=True) for n in o.methods}, write)


# ------------------------------------------------------------------------------ 2 processes

def first_losses(name, o, sizes, out):
    """Run `name` for one epoch of sizes.dist_images (kNN monitor and final kNN included) in this
    process's world; -> its first sizes.dist_steps global losses and its results."""
    losses, results = [], {}

    def patches(mod):
        real_step = mod.train_step

        def step(*args, **kwargs):
            out = real_step(*args, **kwargs)
            if len(losses) < sizes.dist_steps:  # every rank's mean loss is a mean over its share
                losses.append(float(common.all_reduce_sum(out[0].float())) / common.world_size())
            return out

        def finish(*args, **kwargs):  # the final kNN is in; no files written
            results.update(dict_argument(args, kwargs))
            raise StopMain
        return [(mod, "train_step", step), (common, "finish", finish)]
    if o.device == "cuda":  # float32 as exact as one process's: no TF32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    run_main(name, ["--epochs", "1", "--eval-every", "1", "--no-amp",
                    *method_options(o, sizes, out, sizes.dist_batch, name)],
             lambda ctx: cifar_like(sizes.dist_images, sizes.dist_images // 4, sizes.image,
                                    ctx.device), patches)
    return losses, results


def dist_worker(o, sizes, write):
    """Under torchrun: every method in turn, rank 0 writing a row each."""
    for name in o.methods:  # no error rows: a rank that fails leaves the others in a collective
        with tempfile.TemporaryDirectory() as out:
            losses, results = first_losses(name, o, sizes, out)
        if common.rank() == 0:
            write({"method": name, "world": common.world_size(), "losses": losses, **results})
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def dist_part(o, sizes, write):
    rows = os.path.join(o.out, "dist_worker.jsonl")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node=2", os.path.abspath(__file__), "--part", "dist_worker",
               *o.forward]
    env = dict(os.environ, OMP_NUM_THREADS="1") if o.device == "cpu" else None
    done = subprocess.run(command, env=env)
    two = {}
    if os.path.exists(rows):
        with open(rows) as f:
            two = {r["method"]: r for r in map(json.loads, f)}
    def compared(name):
        with tempfile.TemporaryDirectory() as out:
            one, _ = first_losses(name, o, sizes, out)
        row = {"method": name, "losses_1": one}
        if name in two:
            row["losses_2"], row["knn_top1"] = two[name]["losses"], two[name].get("knn_top1")
            row["max_error"] = max(abs(a - b) / max(abs(b), 1.0)
                                   for a, b in zip(row["losses_2"], one))
            row["ok"] = row["max_error"] <= DIST_TOLERANCE
        return row
    each_method({n: functools.partial(compared, n) for n in o.methods}, write)
    if done.returncode:
        raise SystemExit(f"torchrun exited with {done.returncode}")


def tests_part(o, sizes, write):
    done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider"],
                          cwd=ROOT, capture_output=True, text=True)
    print(done.stdout + done.stderr)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    write({"returncode": done.returncode, "last_line": lines[-1] if lines else ""})
    if done.returncode:
        raise SystemExit(done.returncode)


def environment_part(o, sizes, write):
    import platform
    import torchvision
    start = time.perf_counter()
    row = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "python": platform.python_version(), "torch": torch.__version__,
           "torchvision": torchvision.__version__, "cuda": torch.version.cuda,
           "gpus": torch.cuda.device_count() if o.device == "cuda" else 0,
           "cpu": f"{platform.machine()}, {os.cpu_count()} cores, "
                  f"{torch.get_num_threads()} threads"}
    try:
        git = ["git", "-C", ROOT]
        row["git"] = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True).stdout.strip()
        if subprocess.run(git + ["diff", "--quiet", "HEAD", "--"]).returncode:
            row["git"] += " + uncommitted changes"
    except OSError:
        pass
    if o.device == "cuda" and row["gpus"]:
        torch.zeros(1, device="cuda")  # CUDA's initialisation, timed
        properties = torch.cuda.get_device_properties(0)
        row.update(gpu=properties.name, memory_gib=properties.total_memory / 2 ** 30,
                   bf16=torch.cuda.is_bf16_supported(including_emulation=False),
                   cuda_init_s=time.perf_counter() - start)
    write(row)


PART_FUNCTIONS = {"environment": environment_part, "correctness": correctness_part,
                  "regions": regions_part, "small": small_part, "epoch": epoch_part,
                  "compile": compile_part, "dist": dist_part, "dist_worker": dist_worker,
                  "tests": tests_part}


def run_part(o):
    """--part NAME: run one part in this process, its rows to OUT/NAME.jsonl as they come."""
    sizes = PRESETS[o.preset]
    path = os.path.join(o.out, f"{o.part}.jsonl")
    if o.device == "cpu":  # one thread: at these sizes a descheduled second one stalls every op
        throughput.reuse_freed_memory()
        torch.set_num_threads(1)

    def write(row):
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
    torch.manual_seed(0)
    PART_FUNCTIONS[o.part](o, sizes, write)


# ------------------------------------------------------------------------------ the check

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--device", default=os.environ.get("GPU_CHECK_DEVICE", "cuda"), choices=["cuda", "cpu"],
      help="cpu: the dry run (env GPU_CHECK_DEVICE)")
    a("--out", default=os.environ.get("GPU_CHECK_OUT"),
      help="output folder (env GPU_CHECK_OUT; default runs/gpu_check-<time>)")
    a("--preset", choices=list(PRESETS), help="sizes (default: full on cuda, dry on cpu)")
    a("--budget", type=float, default=300.0,
      help="seconds for the check's parts after CUDA's initialisation; the optional ones add "
           "their own limits")
    a("--methods", nargs="+", choices=list(METHODS), default=list(METHODS),
      help="epoch, regions, small, compile, dist rows")
    a("--checked", nargs="+", choices=list(CHECKED), help="correctness rows (default: all)")
    a("--parts", nargs="+", choices=[p for p in PARTS if p not in OPTIONAL],
      default=[p for p in PARTS if p not in OPTIONAL], help="the check's own parts to run")
    a("--compile", action="store_true", help="add the compile part")
    a("--dist", choices=["auto", "on", "off"], default="auto",
      help="the 2-process part: auto = when 2 GPUs are visible, or on the CPU dry run")
    a("--with-tests", action="store_true", help="add the CPU test suite (pytest) at the end")
    a("--in-process", action="store_true",
      help="run the parts one after the other in this process, without time limits (a test)")
    a("--part", choices=list(PART_FUNCTIONS), help=argparse.SUPPRESS)  # one part, in this process
    o = p.parse_args(argv)
    o.preset = o.preset or ("full" if o.device == "cuda" else "dry")
    if o.compile and o.device == "cpu" and PRESETS[o.preset].width < 8:
        # seen with torch 2.11 and 2.14: 4 channels at 8 px corrupt the heap (plain torch.compile)
        p.error(f"--compile on the CPU: inductor's CPU kernels crash at the {o.preset} preset's "
                f"width {PRESETS[o.preset].width}; use --preset dry")
    o.checked = o.checked or list(CHECKED)
    o.out = o.out or os.path.join(ROOT, "runs", time.strftime("gpu_check-%Y%m%d-%H%M%S"))
    o.out = os.path.abspath(o.out)
    o.forward = ["--device", o.device, "--out", o.out, "--preset", o.preset,
                 "--methods", *o.methods, "--checked", *o.checked]
    return o


def launch(name, o, limit):
    """Run part `name` in a process of its own -> (state, seconds)."""
    command = [sys.executable, os.path.abspath(__file__), "--part", name, *o.forward]
    return run_limited(command, os.path.join(o.out, f"{name}.log"), limit)


def run_limited(command, log_path, limit):
    """Run `command` with its output to log_path for at most `limit` seconds, then end its
    process group (torchrun's workers too) -> ('ok' | 'FAILED ...' | 'TIMED OUT ...', seconds)."""
    start = time.perf_counter()
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                   start_new_session=True)  # a process group of its own
        try:
            code = process.wait(timeout=max(limit, 1))
        except subprocess.TimeoutExpired:
            code = None
        finally:  # also when this process is told to stop: the part must not outlive it
            for sig in (signal.SIGTERM, signal.SIGKILL):  # what SIGTERM leaves, SIGKILL ends
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, sig)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=10 if sig == signal.SIGTERM else None)
    seconds = time.perf_counter() - start
    state = "ok" if code == 0 else f"TIMED OUT (limit {limit:.0f} s)" if code is None else \
        f"FAILED (exit {code}; see {os.path.basename(log_path)})"
    return state, seconds


def run_here(name, o, limit):
    """Run part `name` in this process (no time limit) -> (state, seconds)."""
    start = time.perf_counter()
    try:
        run_part(argparse.Namespace(**{**vars(o), "part": name}))
        state = "ok"
    except (Exception, SystemExit) as error:  # a part that fails ends with SystemExit
        traceback.print_exc()
        state = f"FAILED ({type(error).__name__}: {error})"
    return state, time.perf_counter() - start


def read_rows(out, name):
    path = os.path.join(out, f"{name}.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def main(argv=None):
    o = parse_args(argv)
    if o.part:
        return run_part(o)
    if not o.in_process:  # stopped (a time-out around the check): end the running part first
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    os.makedirs(o.out, exist_ok=True)
    for name in [*PARTS, "environment", "dist_worker"]:  # a folder used before: fresh rows
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(o.out, f"{name}.jsonl"))
    scale = 1.0 if o.preset == "full" else 4.0  # the dry run's limits: a slow, shared CPU
    state, _ = (run_here if o.in_process else launch)("environment", o, 120)
    environment = (read_rows(o.out, "environment") or [{}])[0]
    if o.device == "cuda" and not environment.get("gpus"):
        print(f"error: no CUDA GPU is visible to {sys.executable} (environment: {state}); "
              f"dry run on the CPU: GPU_CHECK_DEVICE=cpu bash benchmarks/gpu_check.sh",
              file=sys.stderr)
        return 2
    parts = list(o.parts) + ["compile"] * o.compile
    if o.dist == "on" or o.dist == "auto" and (o.device == "cpu" or environment["gpus"] >= 2):
        parts.append("dist")
    parts += ["tests"] * o.with_tests
    budget = o.budget * scale + sum(PARTS[p] * scale for p in parts if p in OPTIONAL)
    start = time.perf_counter()
    status = {}
    for name in parts:
        left = budget - (time.perf_counter() - start)
        limit = min(PARTS[name] * scale, left) if name != "tests" else PARTS[name]
        if limit < 5:
            status[name] = ("not run: the budget was spent", 0.0)
            continue
        print(f"=== {name} (limit {limit:.0f} s, {time.strftime('%H:%M:%S')})", flush=True)
        status[name] = (run_here if o.in_process else launch)(name, o, limit)
        print(f"    {name}: {status[name][0]}, {status[name][1]:.0f} s", flush=True)
    total = time.perf_counter() - start
    text = summary(o, environment, status, total)
    with open(os.path.join(o.out, "summary.md"), "w") as f:
        f.write(text)
    print("\n" + text + f"\n(written to {os.path.join(o.out, 'summary.md')})")
    rows = [r for p in ("correctness", "dist") for r in read_rows(o.out, p)]
    failed = any(s != "ok" for s, _ in status.values()) or any(not r.get("ok") for r in rows)
    return int(failed)


# ------------------------------------------------------------------------------ summary

def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(map(str, r)) + " |" for r in rows]


def number(x, digits=1, unit=""):
    return "n/a" if x is None else f"{x:,.{digits}f}{unit}"


def summary(o, env, status, total):
    """The Markdown summary of every part's rows (a method's error row is listed at the end)."""
    errors = {}  # part and method -> error

    def rows_of(part):
        rows = read_rows(o.out, part)
        errors.update({f"{part} {r['method']}": r["error"] for r in rows if "error" in r})
        return [r for r in rows if "error" not in r]
    device = (f"{env.get('gpu', '?')} ({env.get('memory_gib', 0):.0f} GiB, bf16 "
              f"{'yes' if env.get('bf16') else 'no'})" if o.device == "cuda"
              else f"CPU DRY RUN, no GPU figure ({env.get('cpu', '?')})")
    lines = [f"#### gpu_check: {device}, {env.get('date', '?')}, git {env.get('git', 'n/a')}", "",
             f"python {env.get('python')}, torch {env.get('torch')}, torchvision "
             f"{env.get('torchvision')}, CUDA {env.get('cuda')}; preset {o.preset}; parts "
             f"{total:.0f} s" + (f" after CUDA's initialisation ({env['cuda_init_s']:.1f} s)."
                                 if "cuda_init_s" in env else ".")]
    sizes = PRESETS[o.preset]
    rows = rows_of("correctness")
    if rows:
        t32, t16 = TOLERANCES["float32"], TOLERANCES["bf16"]
        lines += ["", f"**Correctness**: one step at batch {sizes.check_batch}, ResNet-18 w"
                  f"{sizes.width}, {sizes.image} px, {o.device} vs the CPU in float32 from the "
                  f"same weights and views. Relative errors (loss / grad norm / worst module "
                  f"update); tolerance float32 (TF32 off) {t32['loss']:g} / {t32['grad_norm']:g} "
                  f"/ {t32['update']:g}, bf16 {t16['loss']:g} / {t16['grad_norm']:g} / "
                  f"{t16['update']:g}.", ""]

        def cells(result):
            e = result["errors"]
            worst = max((k for k in e if k.startswith("update")), key=lambda k: e[k])
            return [f"{e['loss']:.1e} / {e['grad_norm']:.1e} / {e[worst]:.1e} "
                    f"({worst.split()[1]})", result["failed"] or "ok"]
        lines += table(["method", "float32", "verdict", "bf16", "verdict"],
                       [[r["method"], *cells(r["float32"]), *cells(r["bf16"])] for r in rows])
    rows = rows_of("epoch")
    if rows:
        r0 = rows[0]
        lines += ["", f"**Epoch**: {r0['train_images']:,} + {r0['test_images']:,} uint8 images "
                  f"of {sizes.image} px held on the device, ResNet-18 w{sizes.width}, batch "
                  f"{r0['batch']}, each method's default recipe, kNN monitor included "
                  f"(the first epoch: cuDNN's autotuning included).", ""]
        lines += table(["method", "epoch s", "train s", "kNN s", "img/s train", "img/s epoch"],
                       [[r["method"], number(r["epoch_s"]), number(r["train_s"]),
                         number(r["knn_s"]), number(r["train_img_s"], 0),
                         number(r["epoch_img_s"], 0)] for r in rows])
    for part, title in (("regions", "Where the time goes"), ("small", "Small batches"),
                        ("compile", "--compile")):
        rows = rows_of(part)
        if not rows:
            continue
        explained = part != "regions" and rows_of("regions")
        lines += ["", f"**{title}**: " + ("columns as above." if explained else
                  "ms per step per region on the device's timeline (CUDA events; on a CPU the "
                  "host's clock); GPU busy: share of wall time with a kernel running "
                  "(profiler); syncs: host-device synchronisations per step in train_step / "
                  "in the rest of the loop (set_sync_debug_mode); warm-up: main()'s start to "
                  "the first timed step (model, data, compilation)."), ""]
        header = ["method", "B", "img/s", "wall ms", *REGIONS, "GPU busy", "syncs", "warm-up s"]
        lines += table(header, [[r["method"], r["batch"], number(r["img_s"], 0),
                                 number(r["step_ms"]),
                                 *(number(r["device_ms"][g]) for g in REGIONS),
                                 number(None if r["gpu_busy"] is None else 100 * r["gpu_busy"],
                                        0, "%"),
                                 f"{number(r['syncs_train_step'])} / {number(r['syncs_loop'])}",
                                 number(r["warmup_s"])] for r in rows])
        sites = {}
        for r in rows:
            for site, n in r["sync_sites"].items():
                sites[site] = sites.get(site, 0) + n
        if sites:
            lines += ["", "Sync sites: " + ", ".join(f"{s} ({n})" for s, n in
                                                     sorted(sites.items(), key=lambda kv: -kv[1]))]
    rows = rows_of("dist")
    if rows:
        lines += ["", f"**2 processes** vs 1, float32: global loss of the first "
                  f"{sizes.dist_steps} steps, relative error (tolerance {DIST_TOLERANCE:g}).", ""]
        lines += table(["method", "max error", "verdict", "kNN top-1 (2 proc.)"],
                       [[r["method"], "n/a" if "max_error" not in r else f"{r['max_error']:.1e}",
                         "ok" if r.get("ok") else "FAILED", number(r.get("knn_top1"))]
                        for r in rows])
    rows = rows_of("tests")
    lines += ["", "Parts:", ""]
    lines += [f"- {name}: {state}, {seconds:.0f} s" for name, (state, seconds) in status.items()]
    lines += [f"- FAILED {where}: {error}" for where, error in errors.items()]
    if rows:
        lines.append(f"- pytest: {rows[0]['last_line']}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:
        traceback.print_exc()
        sys.exit(1)
