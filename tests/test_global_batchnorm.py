"""common.GlobalBatchNorm, every BatchNorm with more than one process: at 2 gloo processes it is one
process's BatchNorm on the global batch, its statistics exchanged in one collective each way;
under bf16 autocast it returns what nn's returns, so bf16 at 2 processes is bf16 at one. Its CUDA
path, in torch's fused kernels (which have no CPU version), runs here on stand-ins that compute
and return what the kernels do (their CUDA sources': None or empty(0) included);
tests/test_cuda.py runs the kernels, also as one rank of two on one GPU.

One torchrun run serves every test here (a start costs seconds)."""
import contextlib
from unittest import mock

import pytest
import torch
import torch.nn as nn

import common
from helpers import HARNESS, OpNames, ctx_for, run_distributed, small_network

WORLD = 2
CASES = {  # the layer, the global batch, affine
    "2d": (nn.BatchNorm2d, (16, 16, 6, 6), True),
    "1d without affine": (nn.BatchNorm1d, (16, 16), False),
}
# bf16 at 2 processes against 1 (a ResNet and a projector, 16 images of 8 px): measured 6.6e-8 for
# the loss and 6.4e-3 for the gradients; the bounds are 4 and 8 of bf16's roundings (8 bits: 3.9e-3)
BF16_LOSS = 1.6e-2
BF16_GRADIENTS = 3.1e-2
# the CPU's path, and its CUDA path on the kernels' stand-ins
IMPLEMENTATIONS = ["global", "fused"]


def per_channel(x, t):
    """A (C,) tensor shaped to broadcast over x (B, C, ...)."""
    return t.view([1, -1] + [1] * (x.dim() - 2))


def sums(x):
    """Sums over every dimension but the channels'."""
    return x.sum([d for d in range(x.dim()) if d != 1])


# torch's fused BatchNorm kernels (CUDA only) on the CPU, as their CUDA sources compute and
# return (aten/src/ATen/native/cuda/Normalization.cu and .cuh, torch 2.14): statistics and sums
# in the accumulation type (float32 for a bf16 input), outputs in the input's dtype.
def accumulation(x):
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


def channels_last_kernels(t):
    """Normalization.cu's batch_norm_use_channels_last_kernels: NHWC, and (N, C) contiguous."""
    nhwc = t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last)
    return nhwc or (t.is_contiguous() and t.stride(1) == 1)


def batch_norm_stats(x, eps):
    x = x.to(accumulation(x))
    var, mean = torch.var_mean(x, [d for d in range(x.dim()) if d != 1], correction=0)
    return mean, (var + eps).rsqrt()


def batch_norm_gather_stats_with_counts(x, means, invstds, running_mean,
                                        running_var, momentum, eps, counts):
    assert counts.dtype == running_mean.dtype and len(counts) == len(means)
    n, weights = counts.sum(), counts[:, None] / counts.sum()
    mean = (weights * means).sum(0)  # (C,)
    var = (weights * (invstds ** -2 - eps + (means - mean) ** 2)).sum(0)
    running_mean.lerp_(mean.to(running_mean), momentum)
    running_var.lerp_((var * n / (n - 1)).to(running_var), momentum)
    return mean, (var + eps).rsqrt()


def batch_norm_elemt(x, weight, bias, mean, invstd, eps):
    y = (x.to(mean) - per_channel(x, mean)) * per_channel(x, invstd)
    if weight is not None:
        y = y * per_channel(x, weight) + per_channel(x, bias)
    return y.to(x.dtype)


def batch_norm_backward_reduce(dy, x, mean, invstd, weight, input_g, weight_g, bias_g):
    """sum(dy), sum(dy (x - mean)), grad_weight, grad_bias. The channels-last kernels return the
    last two whatever the flags, and with no weight `empty(0)`, not None; the others return each
    only where its flag asks."""
    dy_, x_ = dy.to(mean), x.to(mean)
    sum_dy, sum_dy_xmu = sums(dy_), sums(dy_ * (x_ - per_channel(x, mean)))
    grad_weight, grad_bias = sum_dy_xmu * invstd, sum_dy
    if weight is not None:
        grad_weight, grad_bias = grad_weight.to(weight), grad_bias.to(weight)
    if channels_last_kernels(dy) and channels_last_kernels(x):
        if weight is None:  # "because I cannot return an uninitialized at::Tensor"
            grad_weight = grad_bias = mean.new_empty(0)
        return sum_dy, sum_dy_xmu, grad_weight, grad_bias
    return (sum_dy if input_g else None, sum_dy_xmu if input_g else None,
            grad_weight if weight_g else None, grad_bias if bias_g else None)


def batch_norm_backward_elemt(dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, counts):
    assert counts.dtype == torch.int32
    n = counts.sum()
    x_hat = (x.to(mean) - per_channel(x, mean)) * per_channel(x, invstd)
    dx = dy.to(mean) - per_channel(x, sum_dy / n) - x_hat * per_channel(x, sum_dy_xmu * invstd / n)
    scale = invstd if weight is None else invstd * weight
    return (dx * per_channel(x, scale)).to(x.dtype)


KERNELS = {f.__name__: f for f in (
    batch_norm_stats, batch_norm_gather_stats_with_counts, batch_norm_elemt,
    batch_norm_backward_reduce, batch_norm_backward_elemt)}


def batchnorm_step(case, implementation, rank, world):
    """A float64 training pass and backward of a weighted sum (the global loss split by rows) on
    rank's rows, then an evaluation pass -> the layer's type, outputs, gradients, statistics."""
    layer, shape, affine = CASES[case]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 3 + 2
    weights = torch.randn(shape, generator=g, dtype=torch.float64)
    bn = layer(shape[1], affine=affine).double()
    if affine:
        bn.weight.data.uniform_(0.5, 1.5, generator=g)
        bn.bias.data.uniform_(-1, 1, generator=g)
    bn = common.sync_batchnorm(nn.Sequential(bn), ctx_for(rank, world))[0]
    rows = slice(rank * shape[0] // world, (rank + 1) * shape[0] // world)
    x = x[rows].clone().requires_grad_()
    with mock.patch.multiple(torch, **KERNELS):  # "fused" alone calls them
        if implementation == "fused":  # the CUDA path
            out = common._FusedBatchNormStep.apply(x, bn.weight, bn.bias, bn)
        else:
            out = bn(x)
        (out * weights[rows]).sum().backward()
    result = {"type": type(bn), "out": out.detach(), "grad_x": x.grad,
              "running_mean": bn.running_mean.clone(),
              "running_var": bn.running_var.clone(),
              "eval": bn.eval()(x.detach())}
    if affine:
        result.update(grad_w=bn.weight.grad, grad_b=bn.bias.grad)
    return result


def ops(layer, x):
    """The ops of a training pass of `layer` on x and a backward."""
    x = x.clone().requires_grad_()
    with OpNames() as counter:
        layer(x).sum().backward()
    return counter.names


def bf16_network(world, rank):
    """A ResNet-18 w4 and a projector (BatchNorm2d and 1d) under bf16 autocast, distributed as
    main() does, on rank's rows of 16 images -> the global loss, the gradients, the dtype of every
    BatchNorm's output, the running statistics."""
    ctx = ctx_for(rank, world, amp=True)
    torch.manual_seed(0)
    model = small_network()
    net = common.distribute(model, ctx)
    dtypes = set()
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.register_forward_hook(lambda m, inputs, out: dtypes.add(out.dtype))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 3, 8, 8, generator=g)
    weights = torch.randn(16, 8, generator=g)
    rows = slice(rank * 16 // world, (rank + 1) * 16 // world)
    with ctx.autocast():
        z = net(x[rows])  # (8, 8) each
    # the global loss split by rows: DDP averages the ranks'
    loss = (common.float32(z) * weights[rows]).sum() * world / 16
    loss.backward()
    global_loss = common.all_reduce_sum(loss.detach()) / world
    return {"loss": global_loss, "dtypes": dtypes,
            "grads": [p.grad for p in model.parameters()],
            "stats": [b.clone() for b in model.buffers()]}


def _worker():
    rank = common.rank()
    results = {"cases": {(c, i): batchnorm_step(c, i, rank, WORLD)
                         for c in CASES for i in IMPLEMENTATIONS}}
    # the size, (8, 16, 6, 6) on each rank
    x = torch.randn(8, 16, 6, 6)
    synced = common.sync_batchnorm(nn.Sequential(nn.BatchNorm2d(16)), ctx_for(rank, WORLD))[0]
    results["ops"] = ops(synced, x)
    results["bf16"] = bf16_network(WORLD, rank)
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_distributed("test_global_batchnorm", "_worker", tmp_path_factory.mktemp("bn"))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", CASES)
def test_two_processes_equal_one_batchnorm_on_the_global_batch(ranks, case, implementation):
    """float64, 2 processes of 8 rows, their BatchNorm made a GlobalBatchNorm by
    common.sync_batchnorm, against nn's BatchNorm on 16: the outputs and input gradients in rank
    order; the weight and bias gradients summed over the ranks (DDP averages them); the running
    statistics on each rank; and, in evaluation, nn's pass on those statistics."""
    one = batchnorm_step(case, "nn", 0, 1)
    got = [r["cases"][case, implementation] for r in ranks]
    assert all(r["type"] is common.GlobalBatchNorm for r in got)
    for key in ("out", "grad_x"):
        torch.testing.assert_close(torch.cat([r[key] for r in got]), one[key], rtol=0, atol=1e-12)
    for key in ("grad_w", "grad_b"):
        if key in one:
            torch.testing.assert_close(sum(r[key] for r in got), one[key], rtol=0, atol=1e-11)
    for r in got:
        for key in ("running_mean", "running_var"):
            torch.testing.assert_close(r[key], one[key], rtol=0, atol=1e-12)
    torch.testing.assert_close(torch.cat([r["eval"] for r in got]), one["eval"], rtol=0, atol=1e-12)


def test_it_exchanges_statistics_in_one_collective_each_way(ranks):
    """At 2 processes, forward and backward of (8, 16, 6, 6) on each rank: one all_gather (the
    per-channel statistics, not the activations) and one all_reduce."""
    for r in ranks:
        collectives = {k: v for k, v in r["ops"].items() if k.startswith("c10d.")}
        assert collectives == {"c10d._allgather_base_": 1, "c10d.allreduce_": 1}, collectives


def test_bf16_at_two_processes_is_bf16_at_one(ranks):
    """Under CPU bf16 autocast a ResNet and a projector at 2 processes, as at one: every BatchNorm
    returns bf16 (as nn's does), the statistics are float32 and equal to nn's, and the global loss
    and the gradients agree within BF16_LOSS and BF16_GRADIENTS (relative error of the loss; of all
    gradients, as one vector)."""
    one = bf16_network(1, 0)
    assert one["dtypes"] == {torch.bfloat16}
    for r in (r["bf16"] for r in ranks):
        assert r["dtypes"] == {torch.bfloat16}
        for mine, theirs in zip(r["stats"], one["stats"]):
            assert mine.dtype == theirs.dtype
            if mine.is_floating_point():
                torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
        loss_error = abs(float(r["loss"] - one["loss"])) / abs(float(one["loss"]))
        assert loss_error <= BF16_LOSS, loss_error
        mine = torch.cat([g.flatten() for g in r["grads"]])
        theirs = torch.cat([g.flatten() for g in one["grads"]])
        error = float((mine - theirs).norm() / theirs.norm())
        assert error <= BF16_GRADIENTS, error


# ---- a world of 2 on one device
# The fused step's world > 1 arithmetic on one device (tests/test_cuda.py runs it on torch's
# kernels): two ranks that hold the same rows are nn.BatchNorm on the batch doubled.
LAYOUTS = {"(N, C)": ((32, 16), torch.contiguous_format),
           "NCHW": ((8, 16, 4, 4), torch.contiguous_format),
           "NHWC": ((8, 16, 4, 4), torch.channels_last)}
# Measured on the CPU's stand-ins (|a - b| / (1 + |b|)): float64 at most 2.7e-15, bf16 at most
# 3.8e-6 (outputs and input gradients; a bf16 rounding is 3.9e-3). The bounds: float64 1e-12,
# float32 1e-4; bf16 outputs and input gradients 1.6e-2 (4 roundings), the rest 1e-3.
DOUBLED_TOLERANCES = {"float64": (1e-12, 1e-12), "float32": (1e-4, 1e-4),
                      "bf16": (1.6e-2, 1e-3)}


def same_rows_on_two_ranks(layout, affine, precision, device):
    """One rank of a world of 2 whose ranks hold the same rows (the fused step, its gather and
    all-reduce standing in) and nn.BatchNorm on the batch doubled, each a training pass and the
    backward of a weighted sum -> (rank, doubled): the output, the input, weight and bias
    gradients, the running statistics (of the doubled batch: one rank's share)."""
    shape, memory_format = LAYOUTS[layout]
    layer = nn.BatchNorm2d if len(shape) == 4 else nn.BatchNorm1d
    dtype = {"bf16": torch.bfloat16, "float32": torch.float32}.get(precision, torch.float64)
    loss_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g) * 3 + 2
    weights = torch.randn(shape, generator=g)
    params = torch.rand(2, shape[1], generator=g) + 0.5
    stand_ins = {"gather": lambda t: torch.cat([t, t]), "all_reduce_sum": lambda t: 2 * t}
    results = []
    for doubled in (False, True):
        bn = layer(shape[1], affine=affine).to(device, loss_dtype)
        if affine:
            bn.weight.data.copy_(params[0])
            bn.bias.data.copy_(params[1] - 1)
        rows = torch.cat([x, x]) if doubled else x
        rows = rows.to(device, dtype).contiguous(memory_format=memory_format)
        rows.requires_grad_()
        w = (torch.cat([weights, weights]) if doubled else weights).to(device, loss_dtype)
        w = w.contiguous(memory_format=memory_format)  # dy as a network's: x's layout
        # the collectives stand in for the forward and the backward
        collectives = mock.patch.multiple(common, **stand_ins)
        with contextlib.nullcontext() if doubled else collectives:
            with torch.autocast(device, torch.bfloat16, enabled=precision == "bf16"):
                if doubled:
                    out = bn(rows)
                else:
                    out = common._FusedBatchNormStep.apply(rows, bn.weight, bn.bias, bn)
            assert out.dtype == dtype
            (out.to(loss_dtype) * w).sum().backward()
        n = len(x)
        result = {"out": out[:n], "grad_x": rows.grad[:n],
                  "running_mean": bn.running_mean, "running_var": bn.running_var}
        if affine:
            half = 0.5 if doubled else 1.0
            result.update(grad_w=bn.weight.grad * half, grad_b=bn.bias.grad * half)
        results.append({k: v.detach().cpu().double() for k, v in result.items()})
    return results


def assert_same_rows_on_two_ranks(layout, affine, precision, device):
    rank, doubled = same_rows_on_two_ranks(layout, affine, precision, device)
    elementwise, statistics = DOUBLED_TOLERANCES[precision]
    assert rank.keys() == doubled.keys()
    errors = {}
    for key, value in doubled.items():
        tolerance = elementwise if key in ("out", "grad_x") else statistics
        errors[key] = float(((rank[key] - value).abs() / (1 + value.abs())).max())
        torch.testing.assert_close(rank[key], value, rtol=tolerance, atol=tolerance, msg=key)
    print(f"{layout} affine={affine} {precision}: largest error "
          + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))


@pytest.mark.parametrize("precision", ["float64", "bf16"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "no affine"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_fused_step_at_a_world_of_two_is_batchnorm_on_both_ranks_rows(layout, affine,
                                                                          precision):
    """On the CPU, on the kernels' stand-ins: the fused step as one rank of 2 that hold the same
    rows equals nn.BatchNorm on the rows doubled, within DOUBLED_TOLERANCES."""
    with mock.patch.multiple(torch, **KERNELS):
        assert_same_rows_on_two_ranks(layout, affine, precision, "cpu")


@pytest.mark.parametrize("dataset", ["textures", "imagefolder"], ids=["held", "streamed"])
def test_a_ragged_last_batch_never_reaches_the_step(dataset, tiny_folder):
    """The fused step counts every rank's rows as its own, so common.train_batches drops an
    epoch's remainder: 70 held or 72 streamed images at batch 20, at a world of 2: 3 steps, each
    rank's every batch 10 rows."""
    harness = __import__(HARNESS)
    argv = ["--dataset", dataset, "--data-dir", tiny_folder, "--limit-train", "70",
            "--batch-size", "20", "--workers", "0", "--out", "/nonexistent"]
    for rank in range(2):
        ctx = ctx_for(rank, 2)
        data = common.load_data(harness.parse_args(argv), ctx)
        order = common.epoch_generators(0, 0)[0]
        rows = [len(y) for _, y in common.train_batches(data, 20, order, ctx)]
        assert rows == [10] * 3, rows
