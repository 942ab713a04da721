"""On a CUDA GPU: each method file's first step there is the CPU's step, its main() runs there as a
user runs it (its defaults' probes, MoCo v2's momentum probe, an authors' linear protocol,
--compile, a continued run) and makes the host wait for nothing; a streamed image folder; the global
BatchNorm's fused kernels are nn.BatchNorm's; 2 GPUs train as one. Skipped without CUDA; the
2-process tests need 2 GPUs. The GPU check, `bash benchmarks/gpu_check.sh LOGS`, runs this file in
three parts (the global BatchNorm's tests first, the compile tests, named "compiled", last).

The step's comparison: each method's main() on the CPU (float32) and on CUDA (float32 without
TF32, or bf16 autocast), its first train_step given the CPU's views from the same weights, labels,
GSG pairs and queue: the loss and each module's update (after - before), |delta - delta_cpu| /
|delta_cpu| over its parameters and over its buffers; integer buffers must be equal. TOLERANCES
(relative; the loss's absolute below 1) come from CPU measurements (ResNet-18 w16, batch 64, 32
px): in float32 another convolution algorithm moved the loss by <= 1.1e-6 and updates by <=
1.1e-2; under bf16 autocast updates moved by <= 0.68 (NNCLR: neighbours change), so bf16's update
bound only catches an update lost, doubled or reversed, and its loss bound is 3e-2 (NNCLR's loss
moved by 1.4e-2).
"""
import os
import sys
import warnings

import pytest
import torch
import torch.nn as nn

import common
from helpers import (QUICK_START, ROOT, check_run_folder, run_distributed, run_main, run_ok,
                     smoke_args, stop_in_epoch, tiny)

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import speed  # noqa: E402
from test_global_batchnorm import LAYOUTS, assert_same_rows_on_two_ranks  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")

METHODS = sorted(QUICK_START)
HARNESS = next(iter(QUICK_START))  # the README's first quick-start script
TOLERANCES = {"float32": {"loss": 1e-4, "update": 5e-2},
              "bf16": {"loss": 3e-2, "update": 0.9}}
DIST_TOLERANCE = 1e-3  # 2 processes vs 1, float32: the first step's global loss
# 32 images of 20 px (textures), batch 32: one step an epoch; width 16
STEP = ["--limit-train", "32", "--batch-size", "32", "--width", "16", "--epochs", "1"]


def bf16_or_skip(precision):
    if precision == "bf16" and not torch.cuda.is_bf16_supported(including_emulation=False):
        pytest.skip("no native bf16 on this GPU")


@pytest.fixture(autouse=True)
def scripts_float32():
    """float32 as common.setup sets it for every run (no TF32), put back after the test."""
    saved = (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision)
    yield
    torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = saved


def snapshot(modules):
    """{(module, 'params' or 'buffers', name): a CPU copy} of every tensor of the modules."""
    return {(m, kind, n): x.detach().cpu().clone() for m, module in modules.items()
            for kind, named in (("params", module.named_parameters()),
                                ("buffers", module.named_buffers())) for n, x in named}


def first_step(method, device, tmp_path, views=None, bf16=False):
    """The method's main() on `device`, stopped after its first train_step, given `views` (CPU
    tensors) for it if any -> its views on the CPU, its loss, its modules before and after."""
    module = __import__(method)
    real = module.train_step
    seen = {}

    def before(i, args, kwargs):
        bound = speed.arguments(real, args, kwargs)
        seen["modules"] = {n: m for n, m in bound.items() if isinstance(m, nn.Module)}
        seen["before"] = snapshot(seen["modules"])
        if views is not None:
            given = [v.to(device).contiguous(memory_format=torch.channels_last) for v in views]
            bound["views"] = given
            return (), dict(bound)
        seen["views"] = [v.cpu() for v in bound["views"]]

    def after(i, args, kwargs, result):
        seen["loss"] = float(result[0])
        seen["after"] = snapshot(seen["modules"])

    argv = [*tiny(method), *STEP, "--device", device, "--amp" if bf16 else "--no-amp",
            "--out", tmp_path / f"{method}-{device}"]
    run_main(module, argv, before=before, after=after, steps=1)
    return seen


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
                sums.setdefault(group, [0.0, 0.0])[0] = float("inf")
            continue
        delta, reference_delta = (mine_after - mine).double(), (after - start).double()
        total = sums.setdefault(group, [0.0, 0.0])
        total[0] += float((delta - reference_delta).square().sum())
        total[1] += float(reference_delta.square().sum())
    return {group: 0.0 if error == 0 else (error / size) ** 0.5 if size > 0 else float("inf")
            for group, (error, size) in sums.items()}


@pytest.mark.parametrize("precision", ["float32", "bf16"])
@pytest.mark.rule("cuda")
@pytest.mark.parametrize("method", METHODS)
def test_the_cuda_step_is_the_cpu_step(method, precision, tmp_path):
    """The method's first train_step in its main() on CUDA (float32 without TF32, or bf16
    autocast) against the same step on the CPU in float32, given the CPU's views: loss and every
    module's update within TOLERANCES[precision]."""
    bf16_or_skip(precision)
    cpu = first_step(method, "cpu", tmp_path)
    cuda = first_step(method, "cuda", tmp_path, cpu["views"], precision == "bf16")
    tolerance = TOLERANCES[precision]
    errors = {"loss": abs(cuda["loss"] - cpu["loss"]) / max(abs(cpu["loss"]), 1.0),
              **update_errors(cuda, cpu)}
    beyond = {k: v for k, v in errors.items() if not v <= tolerance[k.split()[0]]}
    assert not beyond, (beyond, errors)


def count_syncs(method, argv, tmp_path):
    """The method's main() on CUDA with the progress bar on, the host-device syncs counted from
    the end of its first train_step to the end of its fourth -> (syncs, steps)."""
    caught = warnings.catch_warnings(record=True)
    seen = {}

    def after(i, args, kwargs, result):
        if i == 1:
            seen["warnings"] = caught.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        if i == 4:  # before the epoch's end (the kNN monitor waits, as it must)
            torch.cuda.set_sync_debug_mode(0)
            seen["steps"] = 3

    hide_bar = common.hide_bar
    common.hide_bar = lambda rank: rank != 0
    try:
        run_main(__import__(method), [*argv, "--out", tmp_path / "run"], after=after)
    finally:
        common.hide_bar = hide_bar
        torch.cuda.set_sync_debug_mode(0)
        caught.__exit__(None, None, None)
    return sum("synchroniz" in str(w.message) for w in seen["warnings"]), seen["steps"]


# Each method file as its quick start runs it; then MoCo v2, whose momentum encoder, queue and
# momentum probe the quick start's SimCo has not.
SYNC_RUNS = {**{m: [m] for m in METHODS},
             "moco_simmoco_simco-mocov2": ["moco_simmoco_simco", "--method", "mocov2",
                                           "--queue-size", "64"]}


@pytest.mark.rule("cuda")
@pytest.mark.parametrize("run", SYNC_RUNS)
def test_main_runs_on_cuda_and_its_steps_make_the_host_wait_for_nothing(run, tmp_path):
    """The method's main() on CUDA, tiny, with its defaults' probes (MoCo v2 adds the momentum
    probe): steps 2 to 4 under set_sync_debug_mode("warn") count no host sync; the run folder is
    whole."""
    method, *more = SYNC_RUNS[run]
    argv = [*tiny(method, *more), "--device", "cuda"]
    syncs, steps = count_syncs(method, argv, tmp_path)
    assert steps >= 3 and syncs == 0, f"{method}: {syncs} host syncs in {steps} steps"
    check_run_folder(tmp_path / "run")


def epoch_losses(method, argv, tmp_path, name):
    out = tmp_path / name
    run_main(__import__(method), [*argv, "--out", out])
    return [line["loss"] for line in check_run_folder(out)[1]]


def close(compiled, eager):
    return all(abs(c - e) <= 1e-3 * max(1.0, abs(e)) for c, e in zip(compiled, eager))


@pytest.mark.rule("cuda")
@pytest.mark.parametrize("method", METHODS)
def test_compiled_main_equals_eager(method, tmp_path):
    """--compile (the network and the augmentation) for the method's tiny run of 2 epochs, float32:
    each epoch's loss within 1e-3 of the eager run's (inductor's kernels round otherwise)."""
    argv = [*tiny(method), "--device", "cuda", "--no-amp"]
    eager = epoch_losses(method, argv, tmp_path, "eager")
    compiled = epoch_losses(method, [*argv, "--compile"], tmp_path, "compiled")
    assert len(eager) == 2 and close(compiled, eager), (compiled, eager)
    torch._dynamo.reset()


def test_compiled_blur_above_64_px_equals_eager(tiny_folder, tmp_path):
    """Above 64 px SimCLR's recipe blurs (p 0.5): the harness script on an image folder cropped to
    72 px, --compile against eager, float32: the epoch's loss within 1e-3."""
    argv = [*smoke_args(tiny_folder, tmp_path / "unused", "--image-size", "72", "--no-amp"),
            "--device", "cuda"]
    eager = epoch_losses(HARNESS, argv, tmp_path, "eager")
    compiled = epoch_losses(HARNESS, [*argv, "--compile"], tmp_path, "compiled")
    assert close(compiled, eager), (compiled, eager)
    torch._dynamo.reset()


def test_a_streamed_image_folder_on_cuda(tiny_folder, tmp_path):
    """An image folder on CUDA: 2 DataLoader workers decode and crop, pinned memory, the
    evaluation's loader; the run folder; then linear_eval.py's moco probe on streamed crops."""
    out = tmp_path / "run"
    args = [*smoke_args(tiny_folder, out, "--workers", "2"), "--device", "cuda"]
    run_ok(f"{HARNESS}.py", args)
    check_run_folder(out)
    run_ok("benchmarks/linear_eval.py", [out, "--protocol", "moco", "--epochs", "1"])
    assert (out / "linear_moco.json").is_file()


def test_a_cuda_run_continues_on_cuda(tiny_folder, tmp_path):
    """The harness script on CUDA stopped in epoch 2 of 2, then the same command: epoch 1's
    checkpoint loads on the GPU and the run finishes its 2 epochs, one metrics line each."""
    out = tmp_path / "run"
    argv = [*smoke_args(tiny_folder, out, "--epochs", "2", "--linear-epochs", "0"),
            "--device", "cuda"]
    stop_in_epoch(2, argv, HARNESS)
    run_ok(f"{HARNESS}.py", argv)
    check_run_folder(out, epochs=2)


def test_the_scripts_float32_has_no_tf32():
    """common.setup on CUDA sets float32 matmuls and convolutions to full float32 (cuDNN's
    convolutions default to TF32), as the README says."""
    torch.backends.cudnn.conv.fp32_precision = "tf32"
    common.setup(__import__(HARNESS).parse_args(["--device", "cuda", "--out", "/nonexistent"]))
    assert torch.backends.cuda.matmul.fp32_precision == "ieee"
    assert torch.backends.cudnn.conv.fp32_precision == "ieee"


# ---- what a step meets
def augment_on(device):
    """common.Augment on `device` with every op on (crop, flip, jitter with hue, grey, blur,
    solarize), and a batch of uint8 images there."""
    recipes = [common.Recipe(blur_p=0.5, solarize_p=0.2), common.Recipe(gray_p=0.5, blur_p=1.0)]
    ctx = common.Context(0, 1, 0, torch.device(device), False)
    augment = common.Augment(recipes, 32, *common.STATS["cifar10"], ctx)
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (64, 3, 32, 32), dtype=torch.uint8, generator=g)
    return augment, images.to(device)


def test_the_augmentation_on_cuda_is_the_cpus_and_makes_the_host_wait_for_nothing():
    """From the same CPU generator, common.Augment's views on CUDA are the CPU's within 1e-4
    (bilinear sampling and the hue's divisions round differently), channels_last, the same for
    the same seed; one call under set_sync_debug_mode("error") makes the host wait for nothing."""
    cpu, images = augment_on("cpu")
    cuda, _ = augment_on("cuda")
    expected = cpu(images, common.epoch_generators(0, 0)[1])
    views = cuda(images.cuda(), common.epoch_generators(0, 0)[1])
    again = cuda(images.cuda(), common.epoch_generators(0, 0)[1])
    for view, reference, same in zip(views, expected, again):
        assert view.is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(view.cpu(), reference, rtol=0, atol=1e-4)
        assert torch.equal(view, same)
    _, generator = common.epoch_generators(0, 0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        cuda(images.cuda(), generator)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


# ---- global BatchNorm
# Measured on the CPU's stand-ins for the kernels against nn.BatchNorm: float32 outputs <= 1e-6,
# weight gradients <= 1.1e-5; a bf16 value may round to the next bf16 (3.9e-3 relative). The
# bounds: float32 1e-4; bf16 outputs and input gradients 1.6e-2 (4 roundings), the rest 1e-3.
BATCHNORM_TOLERANCES = {"float32": (1e-4, 1e-4), "bf16": (1.6e-2, 1e-3)}
BATCHNORM_CASES = {"2d": (32, 16, 8, 8), "1d": (64, 16)}  # the global batch, channels 16


def batchnorm_on_cuda(case, implementation, rank=0, world=1, bf16=False):
    """A training pass of nn.BatchNorm2d/1d or common.GlobalBatchNorm on rank's rows of a batch on
    this GPU, channels_last, bf16 or float32, and the backward of a weighted sum -> CPU copies of
    the output, its gradients, the running statistics; the output's grad_fn."""
    shape = BATCHNORM_CASES[case]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g) * 3 + 2
    weights = torch.randn(shape, generator=g)
    bn = (nn.BatchNorm2d if len(shape) == 4 else nn.BatchNorm1d)(shape[1])
    bn.weight.data.uniform_(0.5, 1.5, generator=g)
    bn.bias.data.uniform_(-1, 1, generator=g)
    bn = bn.cuda()
    if implementation == "global":
        ctx = common.Context(rank, world, rank, torch.device("cuda"), bf16)
        bn = common.sync_batchnorm(nn.Sequential(bn), ctx)[0]
        bn.__class__ = common.GlobalBatchNorm  # at world 1 too
    rows = slice(rank * shape[0] // world, (rank + 1) * shape[0] // world)
    x = x[rows].cuda().to(torch.bfloat16 if bf16 else torch.float32)
    if x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_()
    with torch.autocast("cuda", torch.bfloat16, enabled=bf16):
        out = bn(x)
    (out.float() * weights[rows].cuda()).sum().backward()
    result = {"out": out, "grad_x": x.grad, "grad_w": bn.weight.grad, "grad_b": bn.bias.grad,
              "running_mean": bn.running_mean, "running_var": bn.running_var,
              "batches": bn.num_batches_tracked}
    return {k: v.detach().cpu() for k, v in result.items()}, type(out.grad_fn).__name__


@pytest.mark.parametrize("precision", ["float32", "bf16"])
@pytest.mark.parametrize("case", BATCHNORM_CASES)
def test_the_global_batchnorms_cuda_path_at_one_process_is_nn_batchnorm(case, precision):
    """common.GlobalBatchNorm on CUDA at a world of 1 runs its fused path (torch's kernels) and
    gives nn.BatchNorm's output, of the same dtype, its input, weight and bias gradients and its
    running statistics within BATCHNORM_TOLERANCES; in float32 and for a bf16 input under bf16
    autocast."""
    bf16_or_skip(precision)
    bf16 = precision == "bf16"
    one, _ = batchnorm_on_cuda(case, "nn", bf16=bf16)
    fused, grad_fn = batchnorm_on_cuda(case, "global", bf16=bf16)
    assert grad_fn == "_FusedBatchNormStepBackward"
    assert fused["out"].dtype == one["out"].dtype
    elementwise, statistics = BATCHNORM_TOLERANCES[precision]
    for key, value in one.items():
        tolerance = elementwise if key in ("out", "grad_x") else statistics
        torch.testing.assert_close(fused[key].float(), value.float(), rtol=tolerance,
                                   atol=tolerance, msg=key)


@pytest.mark.parametrize("precision", ["float32", "bf16"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "no affine"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_global_batchnorms_cuda_path_at_a_world_of_two_on_one_gpu(layout, affine, precision):
    """What 8 GPUs run, on one: torch's fused kernels in common.GlobalBatchNorm's step as one
    rank of 2 that hold the same rows against nn.BatchNorm on the rows doubled, within
    DOUBLED_TOLERANCES, in every layout, affine and not, float32 and bf16 under autocast
    (tests/test_global_batchnorm.py, same_rows_on_two_ranks)."""
    bf16_or_skip(precision)
    assert_same_rows_on_two_ranks(layout, affine, precision, "cuda")


# ---- 2 GPUs
@two_gpus
@pytest.mark.rule("cuda")
@pytest.mark.parametrize("method", METHODS)
def test_two_gpus_take_the_first_step_of_one(method, tmp_path):
    """The method's real script under torchrun on 2 GPUs (NCCL) and as one process on one GPU,
    float32, one step (an epoch): the step's global loss within DIST_TOLERANCE, the run folder
    whole."""
    losses = []
    for nproc in (1, 2):
        out = tmp_path / f"nproc{nproc}"
        argv = [*tiny(method), *STEP, "--device", "cuda", "--no-amp", "--out", out]
        run_ok(f"{method}.py", argv, nproc=nproc)
        losses.append(check_run_folder(out)[1][0]["loss"])
    assert abs(losses[0] - losses[1]) <= DIST_TOLERANCE * max(1.0, abs(losses[0])), losses


def _worker_no_host_sync():
    """In each of 2 NCCL processes: forward + backward of a ResNet and a projector with batch
    norm through common.distribute, under torch.cuda.set_sync_debug_mode("error"), after two
    warm-up passes (DDP builds its buckets)."""
    rank = common.rank()
    ctx = common.Context(rank, 2, rank, torch.device("cuda", rank),
                         torch.cuda.is_bf16_supported(including_emulation=False))
    torch.manual_seed(0)
    model = nn.Sequential(common.ResNet("resnet18", 8, 32), nn.Linear(64, 64),
                          nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 32))
    net = common.distribute(model.to(ctx.device), ctx)
    views = torch.randn(32, 3, 32, 32, device=ctx.device)
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


def _worker_batchnorm():
    """Each of 2 NCCL processes: its half of each BATCHNORM_CASES batch through
    common.GlobalBatchNorm, float32 -> batchnorm_on_cuda's results."""
    rank = common.rank()
    return {case: batchnorm_on_cuda(case, "global", rank, 2)[0] for case in BATCHNORM_CASES}


@two_gpus
def test_two_gpus_global_batchnorm_is_one_gpus_batchnorm(tmp_path, monkeypatch):
    """float32, 2 NCCL processes of half the rows each against nn.BatchNorm on the whole batch on
    one GPU: outputs and input gradients in rank order, weight and bias gradients summed over the
    ranks, the running statistics on each rank, within BATCHNORM_TOLERANCES' float32 bounds."""
    monkeypatch.setenv("DIST_BACKEND", "nccl")
    ranks = run_distributed("test_cuda", "_worker_batchnorm", tmp_path)
    tolerance = BATCHNORM_TOLERANCES["float32"][0]
    for case in BATCHNORM_CASES:
        one, _ = batchnorm_on_cuda(case, "nn")
        got = [r[case] for r in ranks]
        for key, value in one.items():
            if key in ("out", "grad_x"):
                mine = torch.cat([r[key] for r in got])
            elif key in ("grad_w", "grad_b"):
                mine = sum(r[key] for r in got)
            else:
                mine = got[1][key]
                torch.testing.assert_close(got[0][key], mine, rtol=0, atol=0)
            torch.testing.assert_close(mine.float(), value.float(), rtol=tolerance,
                                       atol=tolerance, msg=f"{case} {key}")


@two_gpus
def test_global_batchnorm_never_makes_the_host_wait(tmp_path, monkeypatch):
    """The ranks exchange per-channel statistics with no .item() or boolean indexing: no call in
    forward or backward raises under set_sync_debug_mode("error")."""
    monkeypatch.setenv("DIST_BACKEND", "nccl")
    assert run_distributed("test_cuda", "_worker_no_host_sync", tmp_path) == ["no sync"] * 2
