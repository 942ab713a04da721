"""On a CUDA GPU: every method's step there is the CPU's step, 2 GPUs train as one (float32 and
bf16), and nothing a step does makes the host wait; the scripts run there as a user runs them
(torchrun and common.setup on 2 GPUs, --compile, a checkpoint resumed). Skipped without CUDA;
the 2-process tests need 2 GPUs.

    python -m pytest -q tests/test_cuda.py

Each method file's real train_step, its model, optimiser, queue, support set and EMA target built
as its main() builds them (benchmarks/speed.py's `training`, ResNet-18 w16 and small heads,
batch 64 of 32 px views made by the file's own recipes on the CPU), from the same weights and the
same views on both devices. Compared: the loss, the gradient norm, and each module's update
(after - before), |delta - delta_cpu| / |delta_cpu| over its parameters and over its buffers;
integer buffers (queue pointers, labels, step counts) must be equal.

Tolerances (relative; the loss's absolute below 1) are those benchmarks/gpu_check.py stated (the
tool this test replaced, at commit 94f9159), set there from CPU measurements (ResNet-18 w16,
batch 64, 32 px): in float32 another convolution algorithm (oneDNN off) moved the loss by
<= 1.1e-6, the gradient norm by <= 3.4e-4 and updates by <= 1.1e-2 (the rounding of another
summation order grows through the backward pass), EMA targets' by <= 2.6e-2; under bf16 autocast
updates moved by <= 0.68 (NNCLR: neighbours change), so bf16's update bound only catches an update
lost, doubled or reversed (errors of 1 or more). One is raised: bf16's loss bound, 1e-2 there, is
3e-2 here, as at this test's sizes CPU bf16 autocast moved NNCLR's loss by 1.4e-2 (its neighbours
change; every other method's by <= 2.7e-3; float32 with oneDNN off: loss <= 1.9e-6, gradient
norm <= 6.1e-4, updates <= 8.6e-3, all measured here on the CPU at 94f9159). CUDA's float32 runs
without TF32, as the CPU computes.
"""
import functools
import math
import os
import sys

import pytest
import torch

import common
import moco_simmoco_simco as mss
import nnclr_dcl
import simclr_dcl
import simsiam_byol_gsg as gsg
from helpers import (ROOT, check_run_folder, run_distributed, run_script, smoke_args,
                     stop_in_epoch)

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import speed  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")

TOLERANCES = {"float32": {"loss": 1e-4, "grad_norm": 5e-3, "update": 5e-2},
              "bf16": {"loss": 3e-2, "grad_norm": 5e-2, "update": 0.9}}
DIST_TOLERANCE = 1e-3  # 2 processes vs 1, float32: each step's global loss (gpu_check.py's)
BATCH, SIZE, STEPS = 64, 32, 2  # STEPS: the 2-process runs' steps (test_two_gpus_train_as_one)
# every method, and the variants whose train_step takes another path (a second queue, two crops,
# random stop-gradient, DCLW)
METHODS = {
    "simclr-dcl": (simclr_dcl, ["--loss", "dcl"]),
    "simclr-dclw": (simclr_dcl, ["--loss", "dclw"]),
    "mocov2": (mss, ["--method", "mocov2"]),
    "mocov2-symmetric": (mss, ["--method", "mocov2", "--symmetric"]),
    "simmoco": (mss, ["--method", "simmoco"]),
    "simco": (mss, ["--method", "simco"]),
    "simsiam-symmetric": (gsg, ["--method", "simsiam", "--stopgrad", "symmetric"]),
    "simsiam-gsg": (gsg, ["--method", "simsiam", "--stopgrad", "guided"]),
    "byol-gsg": (gsg, ["--method", "byol", "--stopgrad", "guided"]),
    "byol-random": (gsg, ["--method", "byol", "--stopgrad", "random"]),
    "nnclr-dcl": (nnclr_dcl, ["--loss", "dcl"]),
}


@pytest.fixture(autouse=True)
def no_tf32():
    """float32 as the CPU computes it: no TF32 in cuBLAS's matmuls or cuDNN's convolutions."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def build(name, ctx):
    mod, options = METHODS[name]
    argv = [*options, "--width", "16", "--batch-size", str(BATCH), *speed.SMALL_HEADS[mod]]
    return speed.training(mod, argv, ctx, SIZE)


def snapshot(modules):
    """{(module, 'params' or 'buffers', name): a CPU copy} of every tensor of the modules."""
    return {(m, kind, n): x.detach().cpu().clone() for m, module in modules.items()
            for kind, named in (("params", module.named_parameters()),
                                ("buffers", module.named_buffers())) for n, x in named}


def steps(name, ctx, count=1):
    """`count` real train_steps of method `name` in ctx's process (its rows of each global batch)
    -> global loss of each step, gradient norm of the last (this rank's), state before and after."""
    t = build(name, ctx)
    mod = METHODS[name][0]
    cpu = common.Context(0, 1, 0, torch.device("cpu"), "", False)
    augment = common.Augment(mod.recipes(t.args), SIZE, *common.STATS["cifar10"], cpu)
    order = torch.Generator().manual_seed(1)  # GSG's pairs, drawn on the CPU as in main()
    rows = slice(ctx.rank * BATCH // ctx.world, (ctx.rank + 1) * BATCH // ctx.world)
    before, losses = snapshot(t.modules), []
    for step in range(count):
        g = torch.Generator().manual_seed(step)
        images = torch.randint(0, 256, (BATCH, 3, SIZE, SIZE), dtype=torch.uint8, generator=g)
        labels = torch.randint(0, 10, (BATCH,), generator=g)[rows].to(ctx.device)
        views = [moved(v, ctx.device) for v in augment(images[rows], g)]  # its rows' draws
        loss = t.step(views, labels, order)  # the mean over this rank's rows
        losses.append(float(common.all_reduce_sum(loss.float())) / ctx.world)
    grads = [p.grad.double().norm() for group in t.optimizer.param_groups
             for p in group["params"] if p.grad is not None]
    return {"losses": losses, "grad_norm": float(torch.stack(grads).norm()), "before": before,
            "after": snapshot(t.modules)}


def moved(view, device):
    """A CPU view on `device`, in the layout the device's augmentation gives (channels_last on
    CUDA, common.normalize)."""
    view = view.to(device)
    return view.contiguous(memory_format=torch.channels_last) if view.is_cuda else view


def update_errors(run, reference):
    """{'update MODULE.params' or '.buffers': relative error of the update}; integer buffers
    equal or the error is inf. Asserts first that both started from the same state."""
    sums = {}
    for key, start in reference["before"].items():
        mine, mine_after, after = run["before"][key], run["after"][key], reference["after"][key]
        assert torch.equal(mine, start), f"{key}: another state before the step"
        group = f"update {key[0]}.{key[1]}"
        if not start.is_floating_point():  # pointers, labels, counts: equal, else inf
            if not torch.equal(mine_after, after):
                sums.setdefault(group, [0.0, 0.0])[0] = math.inf
            continue
        delta, reference_delta = (mine_after - mine).double(), (after - start).double()
        total = sums.setdefault(group, [0.0, 0.0])
        total[0] += float((delta - reference_delta).square().sum())
        total[1] += float(reference_delta.square().sum())
    return {group: 0.0 if error == 0 else math.sqrt(error / size) if size > 0 else math.inf
            for group, (error, size) in sums.items()}


def beyond(errors, tolerance):
    """The errors over their tolerance (the tolerance named by the error's first word)."""
    return {k: f"{v:.2g} > {tolerance[k.split()[0]]:g}" for k, v in errors.items()
            if not v <= tolerance[k.split()[0]]}


@functools.lru_cache(maxsize=None)
def cpu_step(name):
    return steps(name, common.Context(0, 1, 0, torch.device("cpu"), "", False))


@pytest.mark.parametrize("precision", ["float32", "bf16"])
@pytest.mark.parametrize("name", METHODS)
def test_the_cuda_step_is_the_cpu_step(name, precision):
    """One real train_step on CUDA (float32 without TF32, or bf16 autocast) against the same step
    on the CPU in float32 from the same weights and views: loss, gradient norm and every module's
    update within TOLERANCES[precision]."""
    if precision == "bf16" and not torch.cuda.is_bf16_supported(including_emulation=False):
        pytest.skip("no native bf16 on this GPU")
    cuda = steps(name, common.Context(0, 1, 0, torch.device("cuda"), "", precision == "bf16"))
    reference = cpu_step(name)
    loss, loss_cpu = cuda["losses"][0], reference["losses"][0]
    errors = {"loss": abs(loss - loss_cpu) / max(abs(loss_cpu), 1.0),
              "grad_norm": abs(cuda["grad_norm"] - reference["grad_norm"]) / reference["grad_norm"],
              **update_errors(cuda, reference)}
    assert not beyond(errors, TOLERANCES[precision]), (beyond(errors, TOLERANCES[precision]),
                                                       errors)


def _worker_two_gpus(precision):
    """In each of 2 NCCL processes (tests/dist_worker.py, DIST_BACKEND=nccl): every method's first
    STEPS steps on this rank's half of each global batch, in float32 or under bf16 autocast."""
    torch.backends.cudnn.allow_tf32 = False
    rank = common.rank()
    ctx = common.Context(rank, 2, rank, torch.device("cuda", rank), "", precision == "bf16")
    return {name: steps(name, ctx, STEPS) for name in METHODS}


@two_gpus
@pytest.mark.parametrize("precision", ["float32", "bf16"])
def test_two_gpus_train_as_one(tmp_path, monkeypatch, precision):
    """STEPS steps of every method in 2 NCCL processes (gathered negatives, global BatchNorm,
    global queue and support set, DDP's averaged gradients) against one process on one GPU with
    the whole batch, in the same precision: each step's global loss within DIST_TOLERANCE in
    float32 (bf16: its loss tolerance), each module's update after the steps, on both ranks,
    within the precision's update tolerance. bf16 (issue 45): the global BatchNorm returns bf16
    as nn's does, so 2 GPUs compute what one does (on the CPU, tests/test_global_batchnorm.py).
    Two steps: the second's loss already sees the first's update through every exchange; later
    steps on these random images drift apart by rounding alone (2 gloo processes against one on
    the CPU, measured at 94f9159: after 2 steps losses <= 6.3e-7 apart, updates <= 1.7e-3; the
    3rd step's losses up to 9.6e-4, updates up to 3.9e-2)."""
    bf16 = precision == "bf16"
    if bf16 and not torch.cuda.is_bf16_supported(including_emulation=False):
        pytest.skip("no native bf16 on this GPU")
    monkeypatch.setenv("DIST_BACKEND", "nccl")
    ranks = run_distributed("test_cuda", "_worker_two_gpus", tmp_path, precision)
    loss_tolerance = TOLERANCES["bf16"]["loss"] if bf16 else DIST_TOLERANCE
    failed = {}
    for name in METHODS:
        one = steps(name, common.Context(0, 1, 0, torch.device("cuda"), "", bf16), STEPS)
        for rank, run in enumerate(r[name] for r in ranks):
            errors = {f"loss {i}": abs(a - b) / max(abs(b), 1.0)
                      for i, (a, b) in enumerate(zip(run["losses"], one["losses"]))}
            errors = beyond(errors, {"loss": loss_tolerance}) | beyond(
                update_errors(run, one), TOLERANCES[precision])
            if errors:
                failed[f"{name} rank {rank}"] = errors
    assert not failed, failed


def _worker_no_host_sync():
    """In each of 2 NCCL processes: forward + backward of a SimCLR network passed through
    common.distribute (global BatchNorm in the ResNet and the projector, DDP) under
    torch.cuda.set_sync_debug_mode("error"), after two warm-up passes (DDP builds its buckets)."""
    rank = common.rank()
    ctx = common.Context(rank, 2, rank, torch.device("cuda", rank), "",
                         torch.cuda.is_bf16_supported(including_emulation=False))
    torch.manual_seed(0)
    net = common.distribute(simclr_dcl.SimCLR("resnet18", 8, SIZE, 64, 32).to(ctx.device), ctx)
    views = torch.randn(2 * 16, 3, SIZE, SIZE, device=ctx.device)
    views = views.contiguous(memory_format=torch.channels_last)

    def forward_backward():
        with ctx.autocast():
            z = net(views)
        common.float32(z).square().mean().backward()
    for _ in range(2):
        forward_backward()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            forward_backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return "no sync"


@two_gpus
def test_global_batchnorm_never_makes_the_host_wait(tmp_path, monkeypatch):
    """DESIGN section 3: the ranks exchange per-channel statistics through the autograd-aware
    gather, with no .item() or boolean indexing: a synchronising call in forward or backward
    raises under set_sync_debug_mode("error") and fails the worker."""
    monkeypatch.setenv("DIST_BACKEND", "nccl")
    assert run_distributed("test_cuda", "_worker_no_host_sync", tmp_path) == ["no sync"] * 2


# ------------------------------------------------------------------------------ what a step meets
def augment_on(device):
    """common.Augment on `device` with every op on (two recipes: crop, flip, jitter with hue,
    grey, blur, solarize), and a batch of uint8 images there."""
    recipes = [common.Recipe(blur_p=0.5, solarize_p=0.2),
               common.Recipe(crop_scale=(0.2, 1.0), gray_p=0.5, blur_p=1.0)]
    ctx = common.Context(0, 1, 0, torch.device(device), "", False)
    augment = common.Augment(recipes, SIZE, *common.STATS["cifar10"], ctx)
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (BATCH, 3, SIZE, SIZE), dtype=torch.uint8, generator=g)
    return augment, images.to(device)


def test_the_augmentation_on_cuda_is_the_cpus_and_draws_from_a_cuda_generator():
    """Given the same draws (a CPU generator), common.Augment's views on CUDA are the CPU's within
    1e-4 (bilinear sampling and the hue's divisions round differently), channels_last; with a
    CUDA generator, as main() gives it (common.epoch_generators), the views are finite, the same
    for the same seed, and one call under set_sync_debug_mode("error") makes the host wait for
    nothing."""
    cpu, images = augment_on("cpu")
    cuda, _ = augment_on("cuda")
    expected = cpu(images, torch.Generator().manual_seed(1))
    views = cuda(images.cuda(), torch.Generator().manual_seed(1))
    for view, reference in zip(views, expected):
        assert view.is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(view.cpu(), reference, rtol=0, atol=1e-4)
    _, generator = common.epoch_generators(0, 0, torch.device("cuda"))
    first = cuda(images.cuda(), generator)
    again = cuda(images.cuda(), common.epoch_generators(0, 0, torch.device("cuda"))[1])
    for a, b in zip(first, again):
        assert torch.equal(a, b) and bool(a.isfinite().all())
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        cuda(images.cuda(), generator)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def whole_step(name, device):
    """Method `name`'s training as main() builds it on `device` (speed.training) -> a function
    that runs one step as main()'s loop does: the augmentation (a device generator), GSG's
    pairs (the CPU's order generator), train_step (loss, optimiser, EMA, queue, support set)."""
    ctx = common.Context(0, 1, 0, torch.device(device), "", False)
    t = build(name, ctx)
    augment = common.Augment(METHODS[name][0].recipes(t.args), SIZE, *common.STATS["cifar10"],
                             ctx)
    order, generator = common.epoch_generators(0, 0, ctx.device)
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (BATCH, 3, SIZE, SIZE), dtype=torch.uint8, generator=g)
    images = images.to(device)
    labels = torch.randint(0, 10, (BATCH,), generator=g).to(device)
    return lambda: t.step(augment(images, generator), labels, order)


@pytest.mark.parametrize("name", METHODS)
def test_the_whole_step_never_makes_the_host_wait(name):
    """Issue 45: the augmentation, the loss, the optimiser, the EMA, the queue and the support set
    of a step, after a first step (the optimiser's state, cuDNN's choices), under
    torch.cuda.set_sync_debug_mode("error"): a blocking copy (a tensor built from Python data),
    an .item() or a boolean index raises and fails the test. CPU twin:
    tests/test_host_waits.py."""
    step = whole_step(name, "cuda")
    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


# The scripts' command line (--compile, the run folder and how a run continues).
def cuda_args(folder, out, *extra):
    """helpers.smoke_args (a tiny ImageFolder, width 8, 16 px, batch 16) on CUDA."""
    args = smoke_args(folder, out, *extra)
    args[args.index("--device") + 1] = "cuda"
    return args


@two_gpus
def test_a_script_runs_under_torchrun_on_two_gpus(tiny_folder, tmp_path):
    """simclr_dcl.py under torchrun, 2 processes: common.setup() binds each to its GPU
    (LOCAL_RANK) and joins NCCL's process group (and gloo's beside it); one epoch, the kNN
    monitor, the final evaluation and the run folder, as on the CPU."""
    out = tmp_path / "run"
    done = run_script("simclr_dcl.py", cuda_args(tiny_folder, out), nproc=2)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    check_run_folder(out)


def test_one_compiled_step_on_cuda(tiny_folder, tmp_path):
    """simclr_dcl.py --compile on CUDA, one step (--limit-train 16: one batch of 16): the network,
    the augmentation and the loss compiled (inductor's GPU kernels), then the run folder."""
    out = tmp_path / "run"
    args = cuda_args(tiny_folder, out, "--compile", "--limit-train", "16", "--linear-epochs", "0")
    done = run_script("simclr_dcl.py", args)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    check_run_folder(out)


def test_a_cuda_checkpoint_resumes_on_cuda(tiny_folder, tmp_path):
    """simclr_dcl.py on CUDA stopped in epoch 2 of 2 (Ctrl-C), then --resume: epoch 1's
    checkpoint loads on the GPU and the run finishes its 2 epochs, one metrics line each."""
    out = tmp_path / "run"
    stop_in_epoch(2, cuda_args(tiny_folder, out, "--epochs", "2", "--linear-epochs", "0"))
    done = run_script("simclr_dcl.py", ["--resume", out])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    check_run_folder(out, epochs=2)
