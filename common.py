"""Shared infrastructure of the four method files; no loss, head or
training step lives here.

Part 1, what the methods build on (read it beside a method file):
  processes and gathers: Context, gather(_with_grad), GlobalBatchNorm
  ResNet: torchvision's at any width, CIFAR stem up to 64 px
  augmentation: Recipe, Augment (per-sample draws), its ops
  data: load_data, the held sets, ImageFiles (streamed), batches
  evaluation: kNN, the fixed linear probe, evaluate
  optimisers: learning_rate, LARS
Part 2, the run, which changes nothing a method computes:
  errors and options: UserError, run, add_common_args, parse_args,
    setup, open_run
  the run folder: EpochMeter, Run, write_atomic
"""
import argparse
import contextlib
import datetime
import fcntl
import inspect
import io
import json
import math
import os
import shlex
import sys
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
# torchvision imports torch._dynamo, which, imported after
# init_process_group, keeps gloo's threads alive past
# destroy_process_group and can abort Python's exit (torch 2.14):
# hence here, before setup.
import torchvision
import torchvision.transforms.v2 as T
import torchvision.transforms.v2.functional as TF
from PIL import Image
from torchvision.transforms.functional import (
    rgb_to_grayscale as grayscale)  # it takes batches too
from torchvision.models.resnet import BasicBlock, Bottleneck
from tqdm import tqdm


# =================================
# Part 1: what the methods build on
# =================================
# ---- processes and gathers
@dataclass
class Context:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    amp: bool

    def autocast(self):
        bf16 = torch.bfloat16
        return torch.autocast(self.device.type, bf16, enabled=self.amp)

    def print(self, text):
        if self.rank == 0:
            tqdm.write(text)


def rank():
    return dist.get_rank() if dist.is_initialized() else 0


def world_size():
    return dist.get_world_size() if dist.is_initialized() else 1


class _GatherWithGrad(torch.autograd.Function):
    """dist.all_gather with a backward (it has none)."""

    @staticmethod
    def forward(ctx, x):
        return gather(x)

    @staticmethod
    def backward(ctx, grad):
        grad = all_reduce_sum(grad.contiguous())  # every loss reads my rows
        rows = grad.shape[0] // world_size()  # B
        return grad[rank() * rows:(rank() + 1) * rows]


def gather_with_grad(x):
    """(B, ...) on each rank -> (world * B, ...) in rank order, with
    grad: each rank's rows receive the sum over all ranks of the
    gradient with respect to them, so with DDP's average N processes
    give one process's gradient on the whole batch."""
    return _GatherWithGrad.apply(x) if world_size() > 1 else x


@torch.no_grad()
def gather(x):
    if world_size() == 1:
        return x
    out = x.new_empty((world_size() * x.shape[0],) + x.shape[1:])
    # all_gather_into_tensor before torch 2.14
    all_gather = getattr(dist, "all_gather_single", None)
    all_gather = all_gather or dist.all_gather_into_tensor
    all_gather(out, x.contiguous())
    return out


def all_reduce_sum(x):
    if world_size() > 1:
        x = x.clone()
        dist.all_reduce(x)
    return x


class GlobalBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm over all ranks' rows in training, one collective
    each way and no host sync (torch's SyncBatchNorm waits on the
    host once a layer), in torch's fused kernels on CUDA."""

    def _check_input_dim(self, x):  # (B, C) and (B, C, H, W) alike
        pass

    def forward(self, x):
        if not self.training:
            return super().forward(x)
        if x.is_cuda:
            return _FusedBatchNormStep.apply(x, self.weight, self.bias, self)
        return global_batch_norm(x, self)


def global_batch_norm(x, bn):
    """The CPU's: each rank's (mean, var) gathered with their
    gradient, then BatchNorm's formula with the global ones."""
    dims = [d for d in range(x.dim()) if d != 1]
    var, mean = torch.var_mean(float32(x), dims, correction=0)
    stats = gather_with_grad(torch.stack([mean, var])[None])
    means, variances = stats.unbind(1)  # (world, C) each
    # equal rows per rank: the mean variance + the means' spread
    mean = means.mean(0)  # (C,)
    var = (variances + (means - mean) ** 2).mean(0)
    n = x.numel() // x.shape[1] * len(means)  # values per channel
    with torch.no_grad():
        bn.running_mean.lerp_(mean, bn.momentum)
        unbiased = var * (n / (n - 1))  # as torch's
        bn.running_var.lerp_(unbiased, bn.momentum)
        bn.num_batches_tracked.add_(1)
    shape = [1, -1] + [1] * (x.dim() - 2)  # per channel
    y = (float32(x) - mean.view(shape)) / (var.view(shape) + bn.eps).sqrt()
    if bn.affine:
        y = y * bn.weight.view(shape) + bn.bias.view(shape)
    return y.to(x.dtype)  # as nn's under autocast


class _FusedBatchNormStep(torch.autograd.Function):
    """global_batch_norm in nn.SyncBatchNorm's kernels, with no mask:
    every rank has as many rows (train_batches gives each rank b,
    the remainder dropped), so the counts are this rank's."""

    @staticmethod
    def forward(ctx, x, weight, bias, bn):
        x = in_kernel_layout(x)
        mean, invstd = torch.batch_norm_stats(x, bn.eps)  # (C,) each
        stats = gather(torch.cat([mean, invstd])[None])  # (world, 2C)
        counts = torch.full((len(stats),), x.numel() // x.shape[1],
                            dtype=bn.running_mean.dtype, device=x.device)
        # the global mean and 1 / std; the running ones updated
        mean, invstd = torch.batch_norm_gather_stats_with_counts(
            x, *stats.chunk(2, 1), bn.running_mean, bn.running_var,
            bn.momentum, bn.eps, counts)
        bn.num_batches_tracked.add_(1)
        ctx.save_for_backward(x, weight, mean, invstd, counts.int())
        return torch.batch_norm_elemt(x, weight, bias, mean, invstd, bn.eps)

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, invstd, counts = ctx.saved_tensors
        dy = in_kernel_layout(dy)
        affine = weight is not None
        # sum(dy), sum(dy (x - mean)), this rank's weight and bias
        *sums, grad_weight, grad_bias = torch.batch_norm_backward_reduce(
            dy, x, mean, invstd, weight, True, affine, affine)
        sums = all_reduce_sum(torch.cat(sums)).chunk(2)
        dx = torch.batch_norm_backward_elemt(
            dy, x, mean, invstd, weight, *sums, counts)
        if not affine:  # the NHWC and (N, C) kernels give empty(0)
            return dx, None, None, None
        return dx, grad_weight, grad_bias, None


def in_kernel_layout(x):  # as nn.SyncBatchNorm gives them
    cl = x.is_contiguous(memory_format=torch.channels_last)
    return x if cl else x.contiguous()


def sync_batchnorm(module, ctx):
    """Every BatchNorm a GlobalBatchNorm (above one process), its
    tensors kept: an optimiser may hold them already."""
    batchnorm = nn.modules.batchnorm._BatchNorm
    for m in module.modules():
        if ctx.world > 1 and isinstance(m, batchnorm):
            m.__class__ = GlobalBatchNorm
    return module


def distribute(model, ctx):
    """-> the module to call; `model` itself stays bare (its
    state_dict has no 'module.' prefix)."""
    model = sync_batchnorm(model, ctx)
    cuda = ctx.device.type == "cuda"
    if cuda:
        model = model.to(memory_format=torch.channels_last)
    if ctx.world == 1:
        return model
    ddp = nn.parallel.DistributedDataParallel
    # Global BatchNorm keeps the buffers equal: nothing to sync.
    # torch 2.14 renamed the keyword; the signature says which.
    sync = "forward_sync_buffers"
    if sync not in inspect.signature(ddp).parameters:
        sync = "broadcast_buffers"
    ids = [ctx.device.index] if cuda else None
    return ddp(model, device_ids=ids, **{sync: False})


def to_device(t, device):
    """CPU tensor -> `device` from pinned memory: no host sync."""
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def hide_bar(rank):
    """tqdm's `disable`: rank 0's bars, on a terminal only."""
    return None if rank == 0 else True


def float32(t):
    """The loss's precision: bf16 -> float32; float64 stays."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


# ---- ResNet
class ResNet(nn.Module):
    """torchvision's ResNet-18/34/50 (its names) at any `width`, no
    fc: (B, 3, S, S) -> (B, out_dim). Up to 64 px the CIFAR stem, no
    max-pool; the dual-temperature code and solo-learn pad it by 2."""
    LAYERS = {"resnet18": (BasicBlock, [2, 2, 2, 2]),
              "resnet34": (BasicBlock, [3, 4, 6, 3]),
              "resnet50": (Bottleneck, [3, 4, 6, 3])}

    def __init__(self, arch="resnet18", width=64, image_size=32,
                 stem_padding=1, zero_init_residual=False):
        super().__init__()
        block, blocks = self.LAYERS[arch]
        small = image_size <= 64
        stem = (3, 1, stem_padding) if small else (7, 2, 3)
        self.conv1 = nn.Conv2d(3, width, *stem, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.maxpool = nn.Identity() if small else nn.MaxPool2d(3, 2, 1)
        c_in = width
        for i, n in enumerate(blocks):
            c = width * 2 ** i
            layer = []
            for j in range(n):
                stride = 2 if i > 0 and j == 0 else 1
                c_out = c * block.expansion
                shortcut = None
                if stride != 1 or c_in != c_out:
                    shortcut = nn.Sequential(
                        nn.Conv2d(c_in, c_out, 1, stride, bias=False),
                        nn.BatchNorm2d(c_out))
                layer.append(block(c_in, c, stride, shortcut))
                c_in = c_out
            setattr(self, f"layer{i + 1}", nn.Sequential(*layer))
        self.out_dim = c_in
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(
                    m.weight, mode="fan_out", nonlinearity="relu")
            if zero_init_residual and isinstance(m, (BasicBlock, Bottleneck)):
                # blocks start as identities (official SimSiam / GSG code)
                last = m.bn3 if isinstance(m, Bottleneck) else m.bn2
                nn.init.zeros_(last.weight)

    def forward(self, x):
        x = self.maxpool(F.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)  # (B, C)


# ---- augmentation
@dataclass(frozen=True)
class Recipe:  # one view's augmentation
    crop_scale: tuple = (0.08, 1.0)
    crop_ratio: tuple = (3 / 4, 4 / 3)
    flip_p: float = 0.5
    # brightness, contrast, saturation, hue
    jitter: tuple = (0.4, 0.4, 0.4, 0.1)
    jitter_p: float = 0.8
    gray_p: float = 0.2
    blur_p: float = 0.0
    blur_sigma: tuple = (0.1, 2.0)
    solarize_p: float = 0.0


# A view's uniforms: its coins, in this order, then what its ops
# take in turn (the crop 22, the jitter 8, the blur 1).
COINS = ("flip_p", "jitter_p", "gray_p", "blur_p", "solarize_p")
UNIFORMS = 36


class Augment:
    """A Recipe per view, on the device, parameters per sample
    (transforms.v2: one set per batch), drawn for the global batch
    on every rank alike: N processes augment as one. The views go
    through the ops as one batch (a kernel an op on a GPU): their
    recipes may differ in their probabilities (COINS) only."""

    def __init__(self, recipes, size, mean, std, ctx):
        shared = {replace(r, **dict.fromkeys(COINS, 0.0)) for r in recipes}
        if len(shared) > 1:
            raise ValueError("Augment's recipes may differ in their "
                             "probabilities only")
        self.recipe = shared.pop()
        self.views = len(recipes)
        self.size = size
        self.ctx = ctx
        device = ctx.device
        self.mean = torch.tensor(mean, device=device)
        self.std = torch.tensor(std, device=device)
        p = [[getattr(r, c) for c in COINS] for r in recipes]
        self.p = torch.tensor(p, device=device).unsqueeze(1)  # (V, 1, 5)
        self.probs = list(zip(*p))  # each coin's, per view

    def __call__(self, x, generator):
        """uint8 (b, 3, H, W), or (b, V, 3, S, S) cropped -> V views."""
        b = x.shape[0]
        start = rank() * b
        shape = (self.views, b * world_size(), UNIFORMS)
        # On the CPU: a GPU's torch.rand lays out a large draw by its
        # number of SMs, so another GPU model would draw other views.
        u = torch.rand(shape, generator=generator, dtype=torch.float32)
        u = to_device(u[:, start:start + b], self.ctx.device)  # my rows
        crop = x.dim() == 4
        if crop:  # view after view
            x = x.repeat(self.views, 1, 1, 1)
        else:
            x = x.transpose(0, 1).flatten(0, 1)
        x = x.float() / 255  # (n, 3, H, W), n = V b
        n = len(x)
        heads = u[..., :len(COINS)] < self.p  # (V, b, 5)
        heads = heads.view(n, -1, 1, 1, 1).unbind(1)
        columns = iter(u.reshape(n, -1).unbind(1)[len(COINS):])
        r = self.recipe

        def rand(shape):  # the next columns: (n,) or (n, k)
            if len(shape) == 1:
                return next(columns)
            k = shape[1]
            return torch.stack([next(columns) for _ in range(k)], 1)

        def uniform(low, high):
            return low + (high - low) * next(columns)

        def where(coin, y, x):  # y where the coin came up heads
            if min(self.probs[coin]) == 1:
                return y  # a mask all true: no op
            return torch.where(heads[coin], y, x)

        if crop:
            H, W = x.shape[2:]
            box = sample_crop_boxes(
                rand, n, H, W, r.crop_scale, r.crop_ratio)
            x = resized_crop_flip(x, *box, heads[0].view(n), self.size)
        if any(r.jitter) and max(self.probs[1]) > 0:
            factors = [uniform(max(0, 1 - s), 1 + s)
                       for s in r.jitter[:3]]
            hue = None
            if r.jitter[3] > 0:
                hue = uniform(-r.jitter[3], r.jitter[3])
            # per image, as ColorJitter.get_params
            order = rand((n, 4)).argsort(1)  # (n, 4)
            x = where(1, colour_jitter(x, *factors, hue, order), x)
        if max(self.probs[2]) > 0:
            x = where(2, grayscale(x).expand_as(x), x)
        if max(self.probs[3]) > 0:
            sigma = uniform(*r.blur_sigma)
            # odd, ~10% of the image (SimCLR's 23 px at 224)
            kernel = (self.size // 10) | 1
            x = where(3, gaussian_blur(x, sigma, kernel), x)
        if max(self.probs[4]) > 0:
            x = where(4, TF.solarize(x, 0.5), x)
        return list(normalize(x, self.mean, self.std).chunk(self.views))


def sample_crop_boxes(rand, n, height, width, scale, ratio, tries=10):
    """RandomResizedCrop's boxes, batched -> top, left, h, w (n,)."""
    low = height * width * scale[0]
    high = height * width * scale[1]
    area = low + (high - low) * rand((n, tries))  # (n, tries)
    log_lo, log_hi = map(math.log, ratio)
    aspect = torch.exp(log_lo + (log_hi - log_lo) * rand((n, tries)))
    w = torch.round(torch.sqrt(area * aspect))
    h = torch.round(torch.sqrt(area / aspect))
    fits = (torch.minimum(w, h) > 0) & (w <= width) & (h <= height)
    # argmax: the first that fits; none: a centre crop
    first = fits.int().argmax(1, keepdim=True)
    found = fits.any(1)
    fh = round(width / ratio[0]) if width / height < ratio[0] else height
    fw = round(height * ratio[1]) if width / height > ratio[1] else width
    w = torch.where(found, w.gather(1, first)[:, 0], float(fw))
    h = torch.where(found, h.gather(1, first)[:, 0], float(fh))
    gap = height - h
    top = torch.where(found, rand((n,)) * (gap + 1), gap / 2).floor()
    gap = width - w
    left = torch.where(found, rand((n,)) * (gap + 1), gap / 2).floor()
    return top, left, h, w


def resized_crop_flip(x, top, left, h, w, flip, size):
    """Each box resized to `size`, mirrored where `flip`: one
    grid_sample."""
    B, _, H, W = x.shape
    zero = torch.zeros_like(w)
    theta = torch.stack([torch.where(flip, -w, w) / W, zero,
                         (2 * left + w) / W - 1, zero, h / H,
                         (2 * top + h) / H - 1], 1)
    theta = theta.view(B, 2, 3).to(x)  # (B, 2, 3)
    grid = F.affine_grid(theta, (B, 3, size, size), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear",
                         padding_mode="border", align_corners=False)


def colour_jitter(x, brightness, contrast, saturation, hue=None, order=None):
    """ColorJitter per image: factors (B,), order (B, 4) of the ops
    0 brightness, 1 contrast, 2 saturation, 3 hue. Hue runs once,
    between three blend slots and three more: an image's blend at
    position k runs in slot k before hue, k + 2 after it."""
    if order is None:
        order = torch.arange(4, device=x.device).expand(len(x), 4)
    order = order.T  # (4, B): the op at each position
    before = (order[:3] != 3).cummin(0).values  # (3, B)
    # each slot's op, 3: none
    slots = torch.cat([order[:3].masked_fill(~before, 3),
                       order[1:].masked_fill(before, 3)])  # (6, B)
    ones = torch.ones_like(brightness)
    factors = torch.stack([brightness, contrast, saturation, ones])
    factor = factors.gather(0, slots).to(x.dtype)  # (6, B)
    blends = torch.stack([factor, slots == 1, slots == 2], 1)
    blends = blends.view(18, -1, 1, 1, 1).unbind(0)  # (B, 1, 1, 1)
    for slot in range(6):
        if slot == 3 and hue is not None:
            x = adjust_hue(x, hue)
        x = blend_op(x, *blends[3 * slot:3 * slot + 3])
    return x


def blend_op(x, factor, contrast, saturation):
    """torchvision's _blend with mean grey (contrast), grey
    (saturation) or black (brightness). All (B, 1, 1, 1)."""
    grey = grayscale(x)  # (B, 1, H, W)
    mean = grey.mean((2, 3), keepdim=True)  # (B, 1, 1, 1)
    other = torch.addcmul(contrast * mean, saturation, grey)
    return torch.lerp(other, x, factor).clamp(0, 1)


def adjust_hue(x, shift):
    """Hue turned by `shift` (B,) turns via HSV, as torchvision."""
    value, top = x.max(1, keepdim=True)  # (B, 1, H, W) each
    chroma = value - x.amin(1, keepdim=True)
    gaps = x.roll(-1, 1) - x.roll(-2, 1)  # x[c + 1] - x[c + 2]
    tiny = torch.finfo(x.dtype).tiny  # grey: 0 / tiny
    hue = 2 * top + gaps.gather(1, top) / chroma.clamp(min=tiny)
    shift = shift.to(x.dtype).view(-1, 1, 1, 1)
    hue = torch.add(hue, shift, alpha=6)
    n = torch.arange(5, 0, -2, device=x.device, dtype=x.dtype)
    k = (hue + n.view(3, 1, 1)).remainder(6)  # (B, 3, H, W)
    ramp = torch.minimum(k, 4 - k).clamp(0, 1)
    return value - chroma * ramp


def gaussian_blur(x, sigma, kernel_size):
    """torchvision's gaussian_blur, sigma (B,) per sample."""
    B, C, H, W = x.shape
    radius = kernel_size // 2
    offsets = torch.arange(-radius, radius + 1, device=x.device, dtype=x.dtype)
    kernel = torch.exp(-0.5 * (offsets / sigma.view(-1, 1)) ** 2)
    kernel = kernel / kernel.sum(1, keepdim=True)  # (B, K)
    kernel = kernel.to(x.dtype)
    kernel = kernel.repeat_interleave(C, 0)  # (B*C, K)
    y = F.pad(x.reshape(1, B * C, H, W), (radius,) * 4, mode="reflect")
    y = F.conv2d(y, kernel.view(B * C, 1, 1, -1), groups=B * C)  # in x
    y = F.conv2d(y, kernel.view(B * C, 1, -1, 1), groups=B * C)  # in y
    return y.view(B, C, H, W)


def normalize(x, mean, std):
    """[0, 1] images -> normalised, channels_last on CUDA."""
    x = TF.normalize(x, mean, std)
    return x.contiguous(memory_format=torch.channels_last) if x.is_cuda else x


# ---- data
STATS = {  # (mean, std) per channel
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "stl10": ((0.4467, 0.4398, 0.4066), (0.2603, 0.2566, 0.2713)),
    "imagefolder": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
}
TEXTURES = ("horizontal_stripes", "vertical_stripes", "checkerboard",
            "dots", "rings")


@dataclass
class Data:
    """The pre-training set and two evaluation splits (label -1:
    none), held on the device as uint8 (N, 3, S, S) and a split as
    (images, labels), or streamed as ImageFiles."""
    train: object
    train_labels: torch.Tensor
    eval_train: object
    eval_test: object
    num_classes: int
    image_size: int
    mean: tuple
    std: tuple
    streaming: bool = False

    def __len__(self):
        return len(self.train_labels)


def load_data(args, ctx, crops=2):
    """--dataset as Data; `crops`: per streamed image."""
    mean, std = STATS.get(args.dataset, STATS["imagefolder"])
    sizes = {"cifar10": 32, "cifar100": 32, "stl10": 96, "textures": 20}
    size = sizes.get(args.dataset, args.image_size or 224)
    limit = args.limit_train
    if args.dataset == "imagefolder":
        data = image_folder(args, ctx, size, mean, std, crops)
    elif args.dataset == "textures":
        train, test = texture_images(args.seed)
        train = tuple(t.to(ctx.device)[:limit] for t in train)
        test = tuple(t.to(ctx.device) for t in test)
        data = Data(*train, train, test, len(TEXTURES), size, mean, std)
    elif args.dataset == "stl10":  # evaluated on the labelled splits
        train, test = torchvision_splits(
            args, ctx, dict(split="train+unlabeled"), dict(split="test"))
        # the train split: train+unlabeled's first rows (labels >= 0)
        labelled = int((train[1] >= 0).sum())
        labelled = tuple(t[:labelled] for t in train)
        data = Data(*train, labelled, test, 10, size, mean, std)
    else:
        train, test = torchvision_splits(
            args, ctx, dict(train=True), dict(train=False))
        classes = 100 if args.dataset == "cifar100" else 10
        data = Data(*train, train, test, classes, size, mean, std)
    if len(data) < args.batch_size:
        raise UserError(f"--batch-size {args.batch_size}: only {len(data)} "
                        f"training images")
    args.image_size = size
    return data


def texture_images(seed, counts=(2000, 500), size=20):
    """(uint8 (N, 3, S, S), labels) per split from `seed`: image i a
    TEXTURES[i % 5] in two colours (either in front), plus noise."""
    generator = torch.Generator().manual_seed(seed)

    def uniform(n):  # (n, 1, 1) in [0, 1)
        return torch.rand(n, 1, 1, generator=generator)

    yellow_blue = [[0.85, 0.75, 0.25], [0.2, 0.25, 0.6]]
    colours = torch.tensor(yellow_blue).view(2, 3, 1, 1)
    pixels = torch.arange(size).float()
    y, x = torch.meshgrid(pixels, pixels, indexing="ij")  # (S, S)
    splits = []
    for n in counts:
        label = torch.arange(n) % len(TEXTURES)  # (n,)
        period = 4.5 + 2 * uniform(n)  # 4.5-6.5 px
        y_ = y + period * uniform(n)  # (n, S, S), a random phase
        x_ = x + period * uniform(n)
        centre_y = size * (0.2 + 0.6 * uniform(n))
        centre_x = size * (0.2 + 0.6 * uniform(n))

        def wave(t):
            return torch.sin(2 * torch.pi * t / period)

        dy = torch.remainder(y_, period) - period / 2
        dx = torch.remainder(x_, period) - period / 2
        radius = ((y - centre_y) ** 2 + (x - centre_x) ** 2).sqrt()
        patterns = torch.stack([  # (5, n, S, S), as TEXTURES
            wave(y_) > 0, wave(x_) > 0, wave(y_) * wave(x_) > 0,
            dy ** 2 + dx ** 2 < (0.3 * period) ** 2, wave(radius) > 0])
        mask = patterns[label, torch.arange(n)]
        mask = mask.unsqueeze(1).float()  # (n, 1, S, S)
        first = torch.randint(2, (n,), generator=generator)
        images = mask * colours[first] + (1 - mask) * colours[1 - first]
        noise = torch.randn(n, 3, size, size, generator=generator)
        images = images + 0.08 * noise
        images = (images.clamp(0, 1) * 255).round().to(torch.uint8)
        splits.append((images, label))
    return splits


def torchvision_splits(args, ctx, *splits):
    """CIFAR's or STL-10's splits on the device, the first cut to
    --limit-train, each read once; a node's first process downloads
    and checks them, under a lock: nodes may share the folder."""
    cls = getattr(torchvision.datasets, args.dataset.upper())
    root = args.data_dir
    sets = []
    failed = torch.zeros(1)
    if ctx.local_rank == 0:
        lock = contextlib.nullcontext()  # a read-only folder: no lock
        with contextlib.suppress(OSError):
            os.makedirs(root, exist_ok=True)
            lock = open(os.path.join(root, ".download.lock"), "a")
            fcntl.flock(lock, fcntl.LOCK_EX)  # until closed
        with lock:
            try:
                sets.append(cls(root, download=True, **splits[0]))
            except Exception:  # no network, a corrupt file
                failed += 1
    # The others wait here, in gloo: NCCL's 10 minutes may not
    # last a download.
    if world_size() > 1:
        day = datetime.timedelta(days=1)
        group = dist.new_group(backend="gloo", timeout=day)
        dist.all_reduce(failed, group=group)
    if failed.item():
        raise UserError(
            f"no {args.dataset} in {root}; it could not be "
            f"downloaded: put {cls.filename} or its "
            f"{cls.base_folder}/ there")
    # checked: no MD5 of every file again for each split
    unchecked = type(cls.__name__, (cls,),
                     {"_check_integrity": lambda self: True})
    sets += [unchecked(root, **split) for split in splits[len(sets):]]
    for i, dataset in enumerate(sets):
        limit = None if i else args.limit_train
        images = torch.as_tensor(dataset.data)[:limit]
        if images.shape[-1] == 3:  # CIFAR is NHWC
            images = images.permute(0, 3, 1, 2)
        labels = dataset.labels if args.dataset == "stl10" else dataset.targets
        labels = torch.as_tensor(labels)[:limit].long()
        sets[i] = images.contiguous().to(ctx.device), labels.to(ctx.device)
    return sets


def image_folder(args, ctx, size, mean, std, crops):
    """DATA_DIR/{train,val}/<class>/<images> as Data, streamed."""
    folders = [os.path.join(args.data_dir, s) for s in ("train", "val")]
    try:
        train, val = map(torchvision.datasets.ImageFolder, folders)
    except (FileNotFoundError, RuntimeError) as error:
        raise UserError(
            f"imagefolder: {error}; --data-dir needs train/ and val/ "
            f"folders with one subfolder of images per class") from None
    only = sorted(set(train.classes) ^ set(val.classes))
    if only:  # the labels would not match
        raise UserError(
            f"imagefolder: train/ and val/ need the same class folders; "
            f"{', '.join(only[:5])} only in one")
    samples = train.samples  # class by class
    limit = args.limit_train
    if limit and limit < len(samples):  # spread over the classes
        samples = [samples[i * len(samples) // limit] for i in range(limit)]
    labels = torch.tensor([y for _, y in samples], device=ctx.device)
    crops = ImageFiles(samples, size, crops, args.crop_scale)
    return Data(crops, labels, ImageFiles(samples, size),
                ImageFiles(val.samples, size), len(train.classes),
                size, mean, std, streaming=True)


class ImageFiles(torch.utils.data.Dataset):
    """(path, label) list -> uint8 (3, S, S) for evaluation: Resize(S
    / 0.875 above 64 px) and CenterCrop(S); with `crops`, (crops, 3,
    S, S), random crops, flipped (the colour: on the device)."""

    def __init__(self, samples, size, crops=0, scale=(0.08, 1.0)):
        self.samples = samples
        self.size = size
        self.crops = crops
        self.scale = tuple(scale)
        self.seed = 0  # the epoch's, set by train_batches

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        path, label = self.samples[i]
        try:
            with Image.open(path) as image:
                image = TF.pil_to_tensor(image.convert("RGB"))
        except Exception as error:  # what a decoder raises
            raise UserError(
                f"unreadable image {path} ({type(error).__name__}); "
                f"remove or replace it") from None
        if not self.crops:
            side = round(self.size / 0.875) if self.size > 64 else self.size
            image = TF.resize(image, [side], antialias=True)
            return TF.center_crop(image, [self.size]), label
        # (epoch seed, i) alone: any rank, worker or continued run
        with torch.random.fork_rng(devices=[]):
            # the CPU's only: fork_rng(devices=[]) puts back no GPU's
            torch.default_generator.manual_seed(self.seed + i)
            views = [self.random_crop(image) for _ in range(self.crops)]
        return torch.stack(views), label

    def random_crop(self, image):
        """RandomHorizontalFlip, then RandomResizedCrop, as drawn in
        torchvision, but only the box is resized and then flipped."""
        flip = torch.rand(1) < 0.5
        top, left, h, w = T.RandomResizedCrop.get_params(
            image, self.scale, (3 / 4, 4 / 3))
        if flip:  # the box in the image before its flip
            left = image.shape[2] - left - w
        box = image[:, top:top + h, left:left + w]
        view = TF.resize(box, [self.size] * 2, antialias=True)
        return view.flip(2) if flip else view


def epoch_generators(seed, epoch):
    """This epoch's generators, the order's and the views': a continued
    run draws as if never stopped. Both on the CPU: alike on any
    machine."""
    seed = 2 * (seed * 100003 + epoch)
    order = torch.Generator().manual_seed(seed)
    views = torch.Generator().manual_seed(seed + 1)
    return order, views


def train_batches(data, batch_size, generator, ctx, workers=0):
    """One epoch's (images, labels) on the device, rank r's rows [r b,
    (r + 1) b) of each global batch."""
    b = batch_size // ctx.world
    steps = len(data) // batch_size
    perm = torch.randperm(len(data), generator=generator)[:steps * batch_size]
    mine = perm.view(steps, ctx.world, b)[:, ctx.rank]  # (steps, b)
    if not data.streaming:
        mine = mine.to(ctx.device)
        return ((data.train[rows], data.train_labels[rows]) for rows in mine)
    data.train.seed = int(torch.randint(2 ** 62, (1,), generator=generator))
    subset = torch.utils.data.Subset(data.train, mine.flatten().tolist())
    loader = torch.utils.data.DataLoader(
        subset, b, num_workers=workers, pin_memory=ctx.device.type == "cuda")
    return ((views.to(ctx.device, non_blocking=True),
             labels.to(ctx.device, non_blocking=True))
            for views, labels in loader)


# ---- evaluation
@torch.no_grad()
def extract_features(backbone, split, data, ctx, workers=0, unit=True):
    """Un-augmented images' features, the ranks sharing the work ->
    (N', F), (N',), padding labelled -1. `unit`: the kNN bank,
    L2-normalised float16 (half float32's memory)."""
    was_training = backbone.training
    device = ctx.device
    held = isinstance(split, tuple)  # (images, labels)
    n = len(split[1]) if held else len(split)
    share = -(-n // ctx.world)
    lo = min(ctx.rank * share, n)
    hi = min((ctx.rank + 1) * share, n)
    if held:
        batches = zip(*(t[lo:hi].split(256) for t in split))
    else:  # its own generator, not the global one
        batches = torch.utils.data.DataLoader(
            torch.utils.data.Subset(split, range(lo, hi)), 256,
            num_workers=workers, pin_memory=device.type == "cuda",
            generator=torch.Generator())
    dtype = torch.float16 if unit else torch.float32
    features = torch.zeros(
        share, backbone.out_dim, device=device, dtype=dtype)
    labels = torch.full((share,), -1, dtype=torch.long, device=device)
    mean = torch.tensor(data.mean, device=device)
    std = torch.tensor(data.std, device=device)
    backbone.eval()
    batches = tqdm(batches, "features", -(-(hi - lo) // 256),
                   leave=False, disable=hide_bar(ctx.rank))
    for i, (images, y) in enumerate(batches):
        images = images.to(device, non_blocking=True)  # pinned
        y = y.to(device, non_blocking=True)
        with ctx.autocast():
            f = backbone(normalize(images.float() / 255, mean, std)).float()
        rows = slice(256 * i, 256 * i + len(y))
        features[rows] = F.normalize(f, dim=1) if unit else f
        labels[rows] = y
    backbone.train(was_training)
    return gather(features), gather(labels)


@torch.no_grad()
def knn_accuracy(train_f, train_y, test_f, test_y, num_classes, k=200, t=0.1):
    """Weighted kNN (InstDisc, MoCo): the k nearest vote exp(cos / t)."""
    k = min(k, int((train_y >= 0).sum()))
    unlabelled = train_y < 0

    def vote(f):  # (b, F) -> (b, classes)
        sim = (f @ train_f.T).float().masked_fill_(unlabelled, -math.inf)
        sim, idx = sim.topk(k, dim=1)  # (b, k)
        votes = torch.zeros(len(f), num_classes, device=f.device)
        return votes.scatter_add_(1, train_y[idx], torch.exp(sim / t))

    return top1(vote, test_f, test_y, rows=256)


def linear_classifier(dim, classes, device, seed, std=None):
    """nn.Linear from `seed` in a forked RNG: weight N(0, std), bias
    0 (0.01: MoCo's main_lincls.py), or torch's init."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)  # as ImageFiles
        layer = nn.Linear(dim, classes)
        if std is not None:
            nn.init.normal_(layer.weight, 0.0, std)
            nn.init.zeros_(layer.bias)
    return layer.to(device)


@torch.no_grad()
def top1(classify, features, labels, rows=65536):
    """Top-1 % over the labelled rows, `rows` at a time."""
    correct = 0
    for f, y in zip(features.split(rows), labels.split(rows)):
        correct += int((classify(f).argmax(1) == y).sum())
    return 100.0 * correct / int((labels >= 0).sum())


def linear_probe(train_f, train_y, test_f, test_y, num_classes, epochs,
                 lr=1e-3, batch=256, seed=0):
    """The fixed-feature probe, this project's own: the kNN bank's
    features (unit length, float16) standardised, a linear layer
    from zero, AdamW, cosine -> test top-1 %. The authors' probes,
    on augmented views, are benchmarks/linear_eval.py."""
    rows = (train_y >= 0).nonzero()[:, 0]  # labelled
    # chunks (train_f[rows] copies the bank); float64: E[f^2] -
    # E[f]^2 cancels
    sums = 0
    for chunk in rows.split(16384):
        f = train_f[chunk].double()  # (<= 16384, F)
        sums = sums + torch.stack([f.sum(0), f.square().sum(0)])
    mean, square = sums / len(rows)  # E[f], E[f^2]
    std = (square - mean ** 2).clamp_min(0).sqrt().float()
    mean = mean.float()

    def standardised(f):
        return (f - mean) / (std + 1e-6)

    device = train_f.device
    classifier = linear_classifier(
        train_f.shape[1], num_classes, device, seed, std=0.0)
    optimizer = torch.optim.AdamW(
        classifier.parameters(), lr=lr * batch / 256, weight_decay=5e-4)
    steps = epochs * -(-len(rows) // batch)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    generator = torch.Generator(device=device).manual_seed(seed)
    for _ in tqdm(range(epochs), "linear probe", leave=False,
                  disable=hide_bar(rank())):
        perm = torch.randperm(
            len(rows), generator=generator, device=rows.device)
        for r in rows[perm].split(batch):
            logits = classifier(standardised(train_f[r]))
            loss = F.cross_entropy(logits, train_y[r])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            cosine.step()
    return top1(lambda f: classifier(standardised(f)), test_f, test_y)


def split_features(backbone, data, ctx, workers=0):
    """-> (train_f, train_y, test_f, test_y): the kNN bank and the
    test split's float32 features."""
    train = extract_features(backbone, data.eval_train, data, ctx, workers)
    test = extract_features(
        backbone, data.eval_test, data, ctx, workers, unit=False)
    return (*train, *test)


def evaluate(features, data, args, final=False):
    """kNN top-1; `final`: k=1 and the fixed linear probe too."""
    train_f, train_y, test_f, test_y = features
    test_unit = F.normalize(test_f, dim=1).to(train_f.dtype)

    def knn(k):
        return knn_accuracy(train_f, train_y, test_unit, test_y,
                            data.num_classes, k, args.knn_t)

    result = {"knn_top1": knn(args.knn_k)}
    if not final:
        return result
    result.update(knn_k=args.knn_k, knn_k1_top1=knn(1), epochs=args.epochs)
    if args.linear_epochs:
        result["linear_top1"] = linear_probe(
            train_f, train_y, test_unit, test_y, data.num_classes,
            args.linear_epochs, seed=args.seed)
    return result


# ---- optimisers
def learning_rate(step, total_steps, warmup_steps, peak, schedule="cosine"):
    """Linear warm-up to `peak`, then cosine decay to 0 (or constant)."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    if schedule == "constant":
        return peak
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


class LARS(torch.optim.Optimizer):
    """SGD with LARS's trust ratio per tensor (adapt=False: r = 1):
        g' = g + wd w,  r = eta ||w|| / ||g'||  (clip: min(r / lr, 1))
        buf <- momentum buf + r g',  w <- w - lr buf
    (google-research/simclr lars_optimizer.py lines 98-110)."""

    def __init__(self, params, lr, momentum=0.9, weight_decay=0.0,
                 eta=0.001, clip=False):
        super().__init__(params, dict(
            lr=lr, momentum=momentum, weight_decay=weight_decay,
            eta=eta, clip=clip, adapt=True))

    @torch.no_grad()
    def step(self):  # no host sync
        for group in self.param_groups:
            params = [w for w in group["params"] if w.grad is not None]
            for w in params:
                if "momentum_buffer" not in self.state[w]:
                    self.state[w]["momentum_buffer"] = torch.zeros_like(w)
            if not params:
                continue
            grads = [w.grad for w in params]
            g = torch._foreach_add(grads, params, alpha=group["weight_decay"])
            if group["adapt"]:
                w_norm = torch.stack(torch._foreach_norm(params))
                g_norm = torch.stack(torch._foreach_norm(g))
                trust = group["eta"] * w_norm / g_norm
                if group["clip"]:
                    trust = (trust / group["lr"]).clamp(max=1)
                both = (w_norm > 0) & (g_norm > 0)
                trust = torch.where(both, trust, 1)
                torch._foreach_mul_(g, trust.unbind())
            buffers = [self.state[w]["momentum_buffer"] for w in params]
            torch._foreach_mul_(buffers, group["momentum"])
            torch._foreach_add_(buffers, g)
            torch._foreach_add_(params, buffers, alpha=-group["lr"])


def optimizer_groups(groups):
    """LARS's groups: 1-D parameters without wd or trust ratio
    (SimCLR's tf2/model.py lines 40-42)."""
    groups = list(groups)
    if not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    split = []
    for group in groups:
        params = list(group["params"])
        matrices = [p for p in params if p.ndim > 1]
        vectors = [p for p in params if p.ndim <= 1]
        split.append({**group, "params": matrices})
        split.append({**group, "params": vectors, "weight_decay": 0.0,
                      "adapt": False})
    return [group for group in split if group["params"]]


def pretraining_optimizer(groups, args, lr):
    if args.optimizer == "lars":
        return LARS(optimizer_groups(groups), lr, 0.9, args.wd,
                    args.lars_eta, args.lars_clip)
    return torch.optim.SGD(groups, lr=lr, momentum=0.9, weight_decay=args.wd)


# ========================================================
# Part 2: the run, which changes nothing a method computes
# ========================================================
# ---- errors and options
class UserError(Exception):
    """A problem the user can fix: one line, exit status 2."""


def run(main):
    """main() as a command: any exception but a UserError is a bug
    and keeps its traceback. No signal handler: a killed run is
    continued by its command (README.md, "The run folder")."""
    rank = int(os.environ.get("RANK", 0))
    try:
        main()
    except UserError as error:
        # A DataLoader worker's error ends its traceback's text.
        message = str(error).strip().split("\n")[-1]
        message = message.split("UserError: ")[-1]
        if rank != 0:
            # Rank 0 speaks for all, torchrun ends the rest in this
            # wait; a rank that failed alone speaks after it.
            time.sleep(10)
        where = f" (rank {rank})" if rank else ""
        print(f"error{where}: {message}", file=sys.stderr)
        sys.exit(2)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def checked(convert, test, what):
    """An argparse type: `convert`, refused unless `test` passes."""
    def parse(text):
        if not test(convert(text)):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return convert(text)
    parse.__name__ = convert.__name__  # "invalid int value: 'x'"
    return parse


positive_int = checked(int, lambda n: n >= 1, "a positive integer")
non_negative_int = checked(int, lambda n: n >= 0, "0 or a positive integer")
positive_float = checked(float, lambda x: 0 < x < math.inf, "a positive number")
non_negative_float = checked(float, lambda x: 0 <= x < math.inf,
                             "0 or a positive number")
fraction = checked(float, lambda x: 0 < x <= 1, "in (0, 1]")
seed_value = checked(int, lambda s: 0 <= s < 2 ** 32, "in [0, 2^32)")
# An EMA's momentum: t <- m t + (1 - m) o.
momentum_value = checked(float, lambda m: 0 <= m < 1, "in [0, 1)")


def device_name(text):
    """An argparse type: a name torch.device takes."""
    try:
        torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"not a device: {text}") from None
    return text


class HelpFormatter(argparse.RawDescriptionHelpFormatter,
                    argparse.ArgumentDefaultsHelpFormatter):
    """--help: the usage docstring's layout, each option's default."""


def add_common_args(parser):
    """The shared options; a method file sets the defaults of
    batch_size, epochs, lr, wd, warmup_epochs, crop_scale."""
    a = parser.add_argument
    on_off = argparse.BooleanOptionalAction
    a("--dataset", choices=[*STATS, "textures"], default="cifar10",
      help="imagefolder: DATA_DIR/{train,val}/<class>/*; textures: a "
           "generated CPU demo")
    a("--data-dir", default="./data", help="CIFAR/STL-10 download here")
    a("--image-size", type=positive_int, help="imagefolder's (224)")
    cores = os.cpu_count() or 1  # all of them: macOS has no affinity
    if hasattr(os, "sched_getaffinity"):  # Linux: those it may use
        cores = len(os.sched_getaffinity(0))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # torchrun's
    a("--workers", type=non_negative_int, default=max(1, cores // local),
      help="image folder decoders a process (the node's cores / its "
           "processes)")
    a("--limit-train", type=positive_int, help="N training images")
    a("--arch", choices=list(ResNet.LAYERS), default="resnet18")
    a("--stem-padding", type=non_negative_int, default=1,
      help="of the 3x3 stem (<= 64 px)")
    a("--width", type=positive_int, default=64,
      help="base channels (64: the standard ResNet)")
    a("--epochs", type=non_negative_int, help="0: evaluate untrained")
    a("--batch-size", type=positive_int, help="global, over processes")
    a("--lr", type=positive_float, help="per 256 images")
    a("--wd", type=non_negative_float, help="weight decay")
    a("--warmup-epochs", type=non_negative_int, help="linear warm-up")
    a("--optimizer", choices=["sgd", "lars"], default="sgd")
    a("--lars-eta", type=positive_float, default=0.001,
      help="LARS trust coefficient (SimCLR's)")
    a("--lars-clip", action=on_off, default=False,
      help="LARS: lr <= the schedule's (solo-learn's)")
    a("--crop-scale", type=fraction, nargs=2, metavar=("MIN", "MAX"),
      help="random crop's area range")
    a("--out", help="run folder (runs/<script>-<time>-<pid>); the "
      "same command again continues its run")
    a("--eval-every", type=positive_int, default=10,
      help="kNN monitor every N epochs (and last)")
    a("--knn-k", type=positive_int, default=200, help="kNN neighbours")
    a("--knn-t", type=positive_float, default=0.1, help="kNN temperature")
    a("--linear-epochs", type=non_negative_int, default=100,
      help="the fixed-feature probe's epochs (0: none)")
    a("--seed", type=seed_value, default=0)
    a("--device", type=device_name,
      default="cuda" if torch.cuda.is_available() else "cpu",
      help="cuda, cuda:N or cpu (torchrun: cuda, LOCAL_RANK's GPU)")
    a("--amp", action=on_off,
      help="bf16 autocast (None: where the GPU has bf16)")
    a("--compile", action=on_off, default=False,
      help="torch.compile the network and the augmentation")


# Options that change nothing a run trains: a run continues
# under other values of them (another machine, another GPU).
MAY_DIFFER = ("workers", "device", "out", "argv")


def parse_args(parser, argv, script):
    """The options, with the script's name and its command line."""
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    args = parser.parse_args(argv)
    if args.crop_scale and args.crop_scale[0] > args.crop_scale[1]:
        parser.error("--crop-scale: MIN > MAX")
    args.script = script
    args.argv = argv
    return args


def command_line(args):
    return shlex.join([f"{args['script']}.py", *args["argv"]])


def choose_device(name, world, local_rank):
    """--device as a torch.device; under torchrun, LOCAL_RANK's GPU
    (GPU 0 where a scheduler gives each process one)."""
    device = torch.device(name)
    if device.type != "cuda":
        return device
    if world > 1 and device.index is not None:
        raise UserError(
            f"--device {name}: under torchrun each process takes its "
            f"LOCAL_RANK's GPU; give --device cuda")
    gpus = torch.cuda.device_count()
    index = device.index
    if index is None:
        index = 0 if gpus == 1 else local_rank
    if index >= gpus:
        raise UserError(
            f"--device {name}: no GPU {index} here for LOCAL_RANK "
            f"{local_rank} ({gpus} GPUs); use --device cpu, or at most "
            f"{gpus} processes a node")
    return torch.device("cuda", index)


def setup(args):
    """The device, torchrun's process group, float32's precision
    and the default --out (rank 0's, for all) -> Context."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.batch_size % world or args.batch_size // world < 2:
        raise UserError(
            f"--batch-size {args.batch_size} must be a multiple of the "
            f"{world} processes with at least 2 images per process")
    device = choose_device(args.device, world, local_rank)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True
        # No TF32, which cuDNN's convolutions default to: float32
        # losses stay float32, --no-amp the reference; speed comes
        # from bf16 autocast.
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        torch.backends.cudnn.conv.fp32_precision = "ieee"
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo",
                                device_id=device if cuda else None)
    if args.out is None:
        name = f"{args.script}-{time.strftime('%Y%m%d-%H%M%S')}"
        out = [os.path.join("runs", f"{name}-{os.getpid()}")]
        if world > 1:
            dist.broadcast_object_list(out, src=0)
        args.out = out[0]
    amp = cuda and args.amp
    if amp is None:  # unset: where the GPU has native bf16
        amp = torch.cuda.is_bf16_supported(including_emulation=False)
    return Context(rank, world, local_rank, device, amp)


def open_run(args, ctx):
    """Rank 0 decides what --out holds, every rank follows (README.md,
    "The run folder") -> True where the run continues."""
    verdict = [None, None]  # rank 0's: new or continue, a refusal
    if ctx.rank == 0:
        try:
            verdict = [prepare_folder(args), None]
        except UserError as error:
            verdict = [None, str(error)]
    if ctx.world > 1:
        dist.broadcast_object_list(verdict, src=0)
    action, refusal = verdict
    if refusal:
        raise UserError(refusal)
    if action == "finished":
        if ctx.rank == 0:
            print(f"{args.out} is finished (results.json)", file=sys.stderr)
        sys.exit(0)  # a requeue of a finished run succeeds at once
    return action == "continue"


def prepare_folder(args):
    """Rank 0's look in --out -> new (its config.json written),
    continue or finished; another command's run, refused."""
    ours = json.loads(json.dumps(vars(args)))  # as config.json has it
    path = os.path.join(args.out, "config.json")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            theirs = json.load(f)["args"]
        changed = [f"--{k.replace('_', '-')}" for k in ours
                   if k not in MAY_DIFFER and theirs.get(k) != ours[k]]
        differ = f"not this command's (its {', '.join(changed)})"
        if theirs["script"] != args.script:
            differ = f"not {args.script}.py's"
        if changed:  # args.script among them
            raise UserError(
                f"--out {args.out} holds the run of "
                f"`{command_line(theirs)}`, {differ}: run that "
                f"command again to continue it, or choose another --out")
        if os.path.exists(os.path.join(args.out, "results.json")):
            return "finished"
        if os.path.exists(os.path.join(args.out, "checkpoint.pt")):
            return "continue"
        # No checkpoint yet (its first epoch failed): it starts again.
    versions = dict(python=sys.version.split()[0], torch=torch.__version__)
    config = dict(command=command_line(ours), args=ours,
                  world_size=world_size(), versions=versions)
    write_atomic(os.path.join(args.out, "metrics.jsonl"), b"")
    write_atomic(path, json.dumps(config, indent=2).encode())
    return "new"


# ---- the run folder
class EpochMeter:
    """An epoch's progress bar (images/s, lr, loss) and the means of
    its scalars, summed on the device and read at its end."""

    def __init__(self, ctx, epoch, epochs, steps, batch):
        self.ctx = ctx
        self.epoch = epoch
        self.batch = batch
        self.every = min(20, max(1, steps // 20))
        self.sums = {}
        self.steps = 0
        self.lr = 0.0
        self.copied = None  # the mean loss on its way to the host
        self.bar = tqdm(total=steps * batch, unit="img", leave=False,
                        desc=f"epoch {epoch + 1}/{epochs}",
                        disable=hide_bar(ctx.rank), dynamic_ncols=True)
        self.start = time.perf_counter()

    def update(self, lr, loss, **scalars):
        """The step's loss and diagnostics: tensors or numbers."""
        self.steps += 1
        self.lr = lr
        for name, value in {"loss": loss, **scalars}.items():
            # a number sent to a GPU would make the host wait
            if torch.is_tensor(value):
                value = value.detach().float()
            self.sums[name] = self.sums.get(name, 0) + value
        if self.steps % self.every or self.bar.disable:
            return
        shown = dict(lr=f"{lr:.4g}")
        # The mean loss copied `every` steps ago, once it is here: a
        # GPU's read now would make the host wait.
        if self.copied:
            loss, done = self.copied
            if done is None or done.query():
                shown["loss"] = f"{float(loss):.4f}"
        loss = torch.as_tensor(self.sums["loss"]) / self.steps
        done = None
        if loss.is_cuda:  # into pinned memory: a copy without a wait
            loss = loss.to("cpu", non_blocking=True)
            done = torch.cuda.Event()
            done.record()  # after the copy
        self.copied = (loss, done)
        self.bar.set_postfix(shown, refresh=False)
        self.bar.update(self.every * self.batch)

    def summary(self):
        """The epoch's record: each scalar's mean over all ranks."""
        self.bar.close()
        rows = self.steps * self.ctx.world
        means = {}
        for name, total in self.sums.items():
            total = torch.as_tensor(total, device=self.ctx.device).float()
            # .item() waits: the clock reads a finished epoch
            means[name] = all_reduce_sum(total).item() / rows
        seconds = time.perf_counter() - self.start
        return {"epoch": self.epoch + 1, **means, "lr": self.lr,
                "images_per_s": self.steps * self.batch / seconds,
                "seconds": seconds}


def one_line(record, spec):
    return "  ".join(f"{k} {v:{spec}}" if isinstance(v, float) else
                     f"{k} {v}" for k, v in record.items())


def tensors(state):
    """Every tensor of a nested state_dict."""
    if torch.is_tensor(state):
        return [state]
    if isinstance(state, dict):
        state = list(state.values())
    if not isinstance(state, (list, tuple)):
        return []
    return [t for part in state for t in tensors(part)]


class Run:
    """The run folder (README.md, "The run folder") and the loop's
    bookkeeping. `states`: what checkpoint.pt keeps, by name (None:
    a part this method lacks). `run.also`, which a method may set:
    the test split's features and labels -> more results beside
    each kNN monitor (moco_simmoco_simco.py's online probes)."""

    def __init__(self, args, ctx, data, backbone, states):
        self.args = args
        self.ctx = ctx
        self.data = data
        self.backbone = backbone
        self.also = None
        self.states = {k: s for k, s in states.items() if s is not None}
        self.path = os.path.join(args.out, "checkpoint.pt")
        self.steps = len(data) // args.batch_size  # an epoch's
        self.epoch = 0  # epochs done
        self.metrics = []  # their records
        self.last = None  # the last epoch's features and results
        ctx.print(f"run {args.out}  data {args.dataset}  train {len(data)}"
                  f"  classes {data.num_classes}  image {data.image_size}"
                  f" px  device {ctx.device}  processes {ctx.world}")
        if open_run(args, ctx):
            self.load()

    def load(self):
        try:
            # dict(): a tensor indexed by name would warn
            saved = dict(torch.load(self.path, map_location="cpu",
                                    weights_only=True))
            for name, state in self.states.items():
                state.load_state_dict(saved[name])
            self.epoch = saved["epoch"]
            self.metrics = saved["metrics"]
        except Exception as error:  # truncated, not ours, changed code
            raise UserError(
                f"{self.path} does not fit this run or is unreadable "
                f"({type(error).__name__}); start a new --out") from None
        self.ctx.print(f"continuing {self.args.out} from epoch "
                       f"{self.epoch + 1}")

    def epochs(self):
        return range(self.epoch, self.args.epochs)

    def batches(self, epoch):
        """This epoch's (step, images, labels); meanwhile self.order
        and self.draws are its generators, self.meter its meter."""
        args = self.args
        self.order, self.draws = epoch_generators(args.seed, epoch)
        self.meter = EpochMeter(self.ctx, epoch, args.epochs,
                                self.steps, args.batch_size)
        batches = train_batches(self.data, args.batch_size, self.order,
                                self.ctx, args.workers)
        for step, (images, labels) in enumerate(batches):
            yield step, images, labels

    def monitor(self):
        """The kNN monitor and `also` -> (features, results)."""
        features = split_features(
            self.backbone, self.data, self.ctx, self.args.workers)
        result = evaluate(features, self.data, self.args)
        if self.also:
            result.update(self.also(*features[2:]))
        return features, result

    def end_epoch(self, record):
        """The record checked and logged, the kNN monitor every
        --eval-every epochs and last, checkpoint.pt."""
        states = {k: s.state_dict() for k, s in self.states.items()}
        self.check_finite(record, states)
        done = record["epoch"]
        if done % self.args.eval_every == 0 or done == self.args.epochs:
            features, result = self.monitor()
            record.update(result)
            if done == self.args.epochs:  # finish's too
                self.last = features, result
        self.metrics.append(record)
        self.epoch = done
        if self.ctx.rank != 0:
            return
        # every line: a continued run's are its checkpoint's
        lines = "".join(json.dumps(r) + "\n" for r in self.metrics)
        write_atomic(os.path.join(self.args.out, "metrics.jsonl"),
                     lines.encode())
        self.ctx.print(one_line(record, ".4g"))
        checkpoint = dict(epoch=done, metrics=self.metrics, **states)
        write_atomic(self.path, checkpoint)

    def check_finite(self, record, states):
        """Every rank (all hold the same) stops at a non-finite loss
        or state: no checkpoint holds one."""
        floats = [t for t in tensors(states) if t.is_floating_point()]
        finite = all(bool(t.isfinite().all()) for t in floats)
        if math.isfinite(record["loss"]) and finite:
            return
        what = f"the loss became {record['loss']}"
        if math.isfinite(record["loss"]):
            what = "the weights became non-finite"
        kept = f"epoch {self.epoch}'s checkpoint is kept"
        if not self.epoch:
            kept = "no checkpoint was written"
        raise UserError(f"{what} in epoch {record['epoch']}; {kept}. Lower "
                        f"--lr, check --wd and the temperatures, or try "
                        f"--no-amp, in a new --out")

    def finish(self):
        """The final evaluation, on the last epoch's features where
        they are at hand: backbone.pt, results.json."""
        features, results = self.last or self.monitor()
        results.update(evaluate(features, self.data, self.args, final=True))
        if self.ctx.rank != 0:
            return
        weights = self.backbone.state_dict()
        weights = {k: v.cpu() for k, v in weights.items()}
        write_atomic(os.path.join(self.args.out, "backbone.pt"), weights)
        path = os.path.join(self.args.out, "results.json")
        command = command_line(vars(self.args))
        results = {"command": command, **results}
        shown = one_line(results, ".2f")
        # backbone.pt's inputs are normalised by these
        results.update(mean=self.data.mean, std=self.data.std)
        write_atomic(path, json.dumps(results, indent=2).encode())
        self.ctx.print(f"final: {shown}\nwritten to {path}")


def write_atomic(path, data):
    """`path` whole or not at all (bytes, or torch.save's input)."""
    if not isinstance(data, bytes):
        buffer = io.BytesIO()
        torch.save(data, buffer)
        data = buffer.getvalue()
    temp = path + ".tmp"
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(temp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except OSError as error:
        raise UserError(f"cannot write {path} ({error.strerror}); what "
                        f"was written before is kept") from None
    finally:  # what a full disk or Ctrl-C left
        with contextlib.suppress(OSError):
            os.remove(temp)
