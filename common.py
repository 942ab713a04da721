"""Shared infrastructure of the four method files; no loss, head or
training step lives here.

Part 1, what the methods build on (read it beside a method file):
  processes and gathers: Context, gather(_with_grad), all_reduce_sum,
    GlobalBatchNorm, distribute
  ResNet: torchvision's at any width, CIFAR stem up to 64 px
  augmentation: Recipe, Augment (per-sample draws), then its ops
  data order and batches: epoch_generators, train_batches
  evaluation: extract_features, knn_accuracy, the linear probes,
    OnlineProbe, evaluate
  optimisers: learning_rate, LARS, pretraining_optimizer
Part 2, plumbing that changes nothing a method computes:
  errors and command line: UserError, run, add_common_args,
    parse_args (continues), setup
  epoch log and run folder: EpochMeter, Run (the folder, resume,
    checkpoints, each epoch's end, the run's), hold_run_folder,
    write_atomic
  data: load_data, texture_images, torchvision_split, image_folder,
    ImageFiles
"""
import argparse
import contextlib
import fcntl
import io
import json
import math
import os
import re
import shlex
import signal
import socket
import subprocess
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


# =============================================================================
# Part 1: what the methods build on
# =============================================================================
# ------------------------------------------------------ processes and gathers
@dataclass
class Context:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    out: str
    amp: bool

    def autocast(self):
        bf16 = torch.bfloat16
        return torch.autocast(self.device.type, bf16, enabled=self.amp)

    def print(self, text, file=None):  # file: sys.stderr, warnings
        if self.rank == 0:
            tqdm.write(text, file=file)


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
    """gather_with_grad's forward, with no gradient."""
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
    """BatchNorm over all ranks' rows (equal per rank) in training,
    nn's in evaluation: one collective each way, no host sync
    (torch's SyncBatchNorm: 3 a layer), about nn's ops."""

    def _check_input_dim(self, x):  # (B, C) and (B, C, H, W) alike
        pass

    def forward(self, x):
        if not self.training:
            return super().forward(x)
        return _BatchNormStep.apply(x, self.weight, self.bias, self)


class _BatchNormStep(torch.autograd.Function):
    """The ranks' (mean, var) gathered; the textbook backward
    (Ioffe & Szegedy 2015, Sec. 3), its sums all-reduced. Statistics
    in float32 at least, output in x's dtype, as nn.BatchNorm2d's."""

    @staticmethod
    def forward(ctx, x, weight, bias, bn):
        dims = [d for d in range(x.dim()) if d != 1]
        var, mean = torch.var_mean(float32(x), dims, correction=0)
        stats = gather(torch.stack([mean, var])[None])  # (world, 2, C)
        means, variances = stats.unbind(1)  # (world, C) each
        # equal rows per rank: the variances' mean + the means' one
        spread, mean = torch.var_mean(means, 0, correction=0)
        var = variances.mean(0) + spread  # (C,)
        n = x.numel() // x.shape[1] * len(means)  # values per channel
        bn.running_mean.lerp_(mean, bn.momentum)
        unbiased = var * (n / (n - 1))  # as torch's
        bn.running_var.lerp_(unbiased, bn.momentum)
        bn.num_batches_tracked.add_(1)
        ctx.save_for_backward(x, weight, mean, var)
        ctx.n = n
        ctx.eps = bn.eps
        # nn's evaluation pass, given these statistics
        return F.batch_norm(x, mean, var, weight, bias, False, 0.0, bn.eps)

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, var = ctx.saved_tensors
        dims = [d for d in range(x.dim()) if d != 1]
        shape = [1, -1] + [1] * (x.dim() - 2)  # per channel
        # recomputed: saving it would keep a second activation
        x_hat = F.batch_norm(
            float32(x), mean, var, None, None, False, 0.0, ctx.eps)
        dy = float32(dy)
        # this rank's sums (2, C): its share of the affine grads
        sums = torch.stack([dy.sum(dims), (dy * x_hat).sum(dims)])
        mean_dy, mean_dy_x_hat = all_reduce_sum(sums) / ctx.n
        # dx = (dy - mean_dy - x_hat mean_dy_x_hat) weight /
        # sqrt(var + eps): nn's evaluation pass with mean_dy as
        # its mean does all but the x_hat term, in one op.
        partial = dy - x_hat * mean_dy_x_hat.view(shape)
        dx = F.batch_norm(
            partial, mean_dy, var, weight, None, False, 0.0, ctx.eps)
        if weight is None:
            return dx.to(x.dtype), None, None, None
        return dx.to(x.dtype), sums[1], sums[0], None


def sync_batchnorm(module, ctx):
    """Every BatchNorm of `module` a GlobalBatchNorm (with more than
    one process): the same module, with the tensors an optimiser
    built before holds, given GlobalBatchNorm's forward."""
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
    # torch 2.14 renamed broadcast_buffers (torch.__version__
    # compares as a version, not as text)
    old = torch.__version__ < "2.14"
    sync = "broadcast_buffers" if old else "forward_sync_buffers"
    ids = [ctx.device.index] if cuda else None
    # global BatchNorm keeps buffers equal: nothing to broadcast
    return nn.parallel.DistributedDataParallel(
        model, device_ids=ids, **{sync: False})


def to_device(t, device):
    """CPU tensor -> `device`, no host sync (from pageable memory a
    copy waits for the GPU)."""
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def hide_bar(rank):
    """tqdm's `disable`: rank 0's bars only on a terminal (None:
    tqdm asks its stream), so a log piped to a file keeps just
    the epoch lines; no other rank shows one."""
    return None if rank == 0 else True


def float32(t):
    """The loss's precision: autocast's bf16 -> float32; float32 and
    float64 unchanged."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


# --------------------------------------------------------------------- ResNet
class ResNet(nn.Module):
    """ResNet-18/34/50, no classifier: (B, 3, S, S) -> (B, out_dim);
    torchvision's blocks and names at any `width` (at 64 its weights
    load, fc dropped). Up to 64 px the CIFAR stem, no max-pool
    (ImageNet's shrinks 32 px to 8); `stem_padding` 1 keeps 32 x 32,
    DT's and solo-learn's 2: 34."""
    LAYERS = {"resnet18": (BasicBlock, [2, 2, 2, 2]),
              "resnet34": (BasicBlock, [3, 4, 6, 3]),
              "resnet50": (Bottleneck, [3, 4, 6, 3])}

    def __init__(self, arch="resnet18", width=64, image_size=32,
                 stem_padding=1, zero_init_residual=False):
        super().__init__()
        block, blocks = self.LAYERS[arch]
        small = image_size <= 64
        # kernel, stride, padding
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


# --------------------------------------------------------------- augmentation
# Frozen, so hashable: Augment groups views by their recipes.
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
    """A Recipe per view on the device, parameters per sample
    (transforms.v2: one set per batch), drawn for the global batch
    alike on every rank, each keeping its rows: N processes as one.
    A GPU launches a kernel per op, so a step draws once, and views
    whose recipes differ only in their probabilities go through the
    ops as one batch."""

    def __init__(self, recipes, size, mean, std, ctx):
        self.recipes = recipes
        self.size = size
        self.ctx = ctx
        device = ctx.device
        self.mean = torch.tensor(mean, device=device).view(3, 1, 1)
        self.std = torch.tensor(std, device=device).view(3, 1, 1)
        groups = {}  # a recipe, its probabilities 0 -> its views
        for v, r in enumerate(recipes):
            shared = replace(r, **dict.fromkeys(COINS, 0.0))
            groups.setdefault(shared, []).append(v)
        self.groups = []
        for r, views in groups.items():
            p = [[getattr(recipes[v], c) for c in COINS]
                 for v in views]
            p = torch.tensor(p, device=device).unsqueeze(1)
            index = torch.tensor(views, device=device)
            self.groups.append((r, views, index, p))  # p (V, 1, 5)

    def __call__(self, x, generator):
        """uint8 (b, 3, H, W), or (b, V, 3, S, S) pre-cropped -> V
        normalised views."""
        b = x.shape[0]
        start = rank() * b  # the rank the losses read
        shape = (len(self.recipes), b * world_size(), UNIFORMS)
        # float32 whatever the default dtype, as x.float()
        u = torch.rand(shape, generator=generator,
                       device=generator.device, dtype=torch.float32)
        u = u[:, start:start + b].to(self.ctx.device)  # my rows
        views = [None] * len(self.recipes)
        for group in self.groups:
            rows = self.batch(x, u, *group)  # (V b, 3, S, S)
            for v, view in zip(group[1], rows.chunk(len(group[1]))):
                views[v] = view
        return views

    def batch(self, x, u, r, views, index, p):
        """Views `views` of x as one batch, view after view: r their
        recipe (probabilities 0), p (V, 1, 5) their coins' p."""
        crop = x.dim() == 4
        if crop:  # a copy of the images for each view
            x = x.repeat(len(views), 1, 1, 1)
        else:  # (b, V, 3, S, S) -> their crops
            x = x.transpose(0, 1).index_select(0, index).flatten(0, 1)
        x = x.float() / 255  # (n, 3, H, W), n = V b
        n = len(x)
        u = u.index_select(0, index)  # (V, b, UNIFORMS)
        heads = u[..., :len(COINS)] < p  # (V, b, 5)
        heads = heads.view(n, -1, 1, 1, 1).unbind(1)
        columns = iter(u.view(n, -1).unbind(1)[len(COINS):])
        # per coin, its probability in each view
        probs = [[getattr(self.recipes[v], c) for v in views]
                 for c in COINS]

        def rand(shape):  # the next columns: (n,) or (n, k)
            if len(shape) == 1:
                return next(columns)
            k = shape[1]
            return torch.stack([next(columns) for _ in range(k)], 1)

        def uniform(low, high):
            return low + (high - low) * next(columns)

        def where(coin, y, x):  # y where the coin came up heads
            if min(probs[coin]) == 1:
                return y  # a mask all true: no op
            return torch.where(heads[coin], y, x)

        if crop:
            H, W = x.shape[2:]
            box = sample_crop_boxes(
                rand, n, H, W, r.crop_scale, r.crop_ratio)
            x = resized_crop_flip(x, *box, heads[0].view(n), self.size)
        if any(r.jitter) and max(probs[1]) > 0:
            # ColorJitter's ranges, clipped at 0
            factors = [uniform(max(0, 1 - s), 1 + s)
                       for s in r.jitter[:3]]
            hue = None
            if r.jitter[3] > 0:
                hue = uniform(-r.jitter[3], r.jitter[3])
            # per image, as transforms.py ColorJitter.get_params
            order = rand((n, 4)).argsort(1)  # (n, 4)
            x = where(1, colour_jitter(x, *factors, hue, order), x)
        if max(probs[2]) > 0:
            x = where(2, grayscale(x).expand_as(x), x)
        if max(probs[3]) > 0:
            sigma = uniform(*r.blur_sigma)
            # odd, ~10% of the image (SimCLR's 23 px at 224)
            kernel = (self.size // 10) | 1
            x = where(3, gaussian_blur(x, sigma, kernel), x)
        if max(probs[4]) > 0:  # torchvision's, batched
            x = where(4, TF.solarize(x, 0.5), x)
        return normalize(x, self.mean, self.std)


def sample_crop_boxes(rand, n, height, width, scale, ratio, tries=10):
    """RandomResizedCrop's box sampler, batched -> top, left, h, w
    (n,): of `tries` draws of (area, log-ratio) the first that fits,
    else a centre crop, ratio clamped; rand(shape): U[0, 1)."""
    low = height * width * scale[0]
    high = height * width * scale[1]
    area = low + (high - low) * rand((n, tries))  # (n, tries)
    log_lo, log_hi = map(math.log, ratio)
    aspect = torch.exp(log_lo + (log_hi - log_lo) * rand((n, tries)))
    w = torch.round(torch.sqrt(area * aspect))
    h = torch.round(torch.sqrt(area / aspect))
    fits = (torch.minimum(w, h) > 0) & (w <= width) & (h <= height)
    # argmax: the first of the largest, the first that fits
    first = fits.int().argmax(1, keepdim=True)
    found = fits.any(1)
    fh = round(width / ratio[0]) if width / height < ratio[0] else height
    fw = round(height * ratio[1]) if width / height > ratio[1] else width
    w = torch.where(found, w.gather(1, first)[:, 0], float(fw))
    h = torch.where(found, h.gather(1, first)[:, 0], float(fh))
    # randint(0, gap + 1) if found, else centred
    gap = height - h
    top = torch.where(found, rand((n,)) * (gap + 1), gap / 2).floor()
    gap = width - w
    left = torch.where(found, rand((n,)) * (gap + 1), gap / 2).floor()
    return top, left, h, w


def resized_crop_flip(x, top, left, h, w, flip, size):
    """Crop each box, resize it to `size` (no antialias), mirror it
    where `flip`: one grid_sample."""
    B, _, H, W = x.shape
    zero = torch.zeros_like(w)
    # the output's [-1, 1] square onto each box, x mirrored on flip
    theta = torch.stack([torch.where(flip, -w, w) / W, zero,
                         (2 * left + w) / W - 1, zero, h / H,
                         (2 * top + h) / H - 1], 1)
    theta = theta.view(B, 2, 3).to(x)  # (B, 2, 3)
    # resized_crop's sampling points
    grid = F.affine_grid(theta, (B, 3, size, size), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear",
                         padding_mode="border", align_corners=False)


def colour_jitter(x, brightness, contrast, saturation, hue=None, order=None):
    """torchvision's ColorJitter per image: factors (B,) and order
    (B, 4) of the ops 0 brightness, 1 contrast, 2 saturation, 3 hue
    (order None: 0-3 for all; hue None: no hue), no host sync.

    Hue runs once for all images, after three blend slots and
    before three more: an image's blend at position k of its order
    runs in slot k before hue if hue comes later, else in slot
    k - 1 after it; a slot leaves the images it does not blend as
    they are. With three slots, hue (its position differs from
    image to image) would need four passes, one at each gap."""
    if order is None:
        order = torch.arange(4, device=x.device).expand(len(x), 4)
    order = order.T  # (4, B): the op at each position
    # The ops up to position k are no hue: k runs before it.
    before = (order[:3] != 3).cummin(0).values  # (3, B)
    # each slot's op, 3: none
    slots = torch.cat([order[:3].masked_fill(~before, 3),
                       order[1:].masked_fill(before, 3)])  # (6, B)
    ones = torch.ones_like(brightness)  # none's factor
    factors = torch.stack([brightness, contrast, saturation, ones])
    # in x's dtype: lerp takes no other
    factor = factors.gather(0, slots).to(x.dtype)  # (6, B)
    # each slot's factor, and whether it is contrast, saturation
    blends = torch.stack([factor, slots == 1, slots == 2], 1)
    blends = blends.view(18, -1, 1, 1, 1).unbind(0)  # (B, 1, 1, 1)
    for slot in range(6):
        if slot == 3 and hue is not None:
            x = adjust_hue(x, hue)
        x = blend_op(x, *blends[3 * slot:3 * slot + 3])
    return x


def blend_op(x, factor, contrast, saturation):
    """torchvision's _blend of each image with mean grey where
    `contrast`, grey where `saturation`, else black (brightness):
    factor * x + (1 - factor) * other, clamped; factor 1 leaves it
    as it is. All (B, 1, 1, 1)."""
    # Python numbers as weights: no copy to the GPU a step
    grey = grayscale(x)  # (B, 1, H, W)
    mean = grey.mean((2, 3), keepdim=True)  # (B, 1, 1, 1)
    other = torch.addcmul(contrast * mean, saturation, grey)
    return torch.lerp(other, x, factor).clamp(0, 1)


def adjust_hue(x, shift):
    """Hue turned `shift` (B,) turns via HSV, as torchvision: 6 hue
    is 2 c + (x[c + 1] - x[c + 2]) / chroma, c the max's channel
    (ties: red, then green, then blue), channels mod 3; to RGB,
    channel n = 5, 3, 1 is v - chroma * clamp(min(k, 4 - k), 0, 1),
    k = (n + 6 hue) mod 6."""
    value, top = x.max(1, keepdim=True)  # (B, 1, H, W) each
    chroma = value - x.amin(1, keepdim=True)
    gaps = x.roll(-1, 1) - x.roll(-2, 1)  # x[c + 1] - x[c + 2]
    # A grey pixel's gap is 0: any divisor above 0 gives hue 0.
    tiny = torch.finfo(x.dtype).tiny  # float16's 1e-12 is 0
    hue = 2 * top + gaps.gather(1, top) / chroma.clamp(min=tiny)
    shift = shift.to(x.dtype).view(-1, 1, 1, 1)  # x's dtype out
    hue = torch.add(hue, shift, alpha=6)  # turned
    n = torch.arange(5, 0, -2, device=x.device, dtype=x.dtype)
    k = (hue + n.view(3, 1, 1)).remainder(6)  # (B, 3, H, W)
    ramp = torch.minimum(k, 4 - k).clamp(0, 1)
    return value - chroma * ramp


def gaussian_blur(x, sigma, kernel_size):
    """Per-sample sigma (B,), separable kernel, reflect padding
    (torchvision's gaussian_blur)."""
    B, C, H, W = x.shape
    radius = kernel_size // 2
    offsets = torch.arange(-radius, radius + 1, device=x.device, dtype=x.dtype)
    kernel = torch.exp(-0.5 * (offsets / sigma.view(-1, 1)) ** 2)
    kernel = kernel / kernel.sum(1, keepdim=True)  # (B, K)
    kernel = kernel.to(x.dtype)  # conv2d takes no other
    kernel = kernel.repeat_interleave(C, 0)  # (B*C, K)
    y = F.pad(x.reshape(1, B * C, H, W), (radius,) * 4, mode="reflect")
    y = F.conv2d(y, kernel.view(B * C, 1, 1, -1), groups=B * C)  # in x
    y = F.conv2d(y, kernel.view(B * C, 1, -1, 1), groups=B * C)  # in y
    return y.view(B, C, H, W)


def normalize(x, mean, std):
    """[0, 1] images (B, 3, H, W) -> normalised, channels_last on CUDA
    (the networks' layout); mean, std (3, 1, 1) or (3,)."""
    x = TF.normalize(x, mean, std)
    return x.contiguous(memory_format=torch.channels_last) if x.is_cuda else x


# ----------------------------------------------------- data order and batches
def epoch_generators(seed, epoch, device):
    """(seed, epoch) -> this epoch's generators, so a resumed run draws
    as an uninterrupted one: order and pairings on the CPU (CUDA's
    random kernels differ by GPU), views on the device."""
    seed = 2 * (seed * 100003 + epoch)
    order = torch.Generator().manual_seed(seed)
    views = torch.Generator(device).manual_seed(seed + 1)
    return order, views


def train_batches(data, batch_size, generator, ctx, workers=0, start=0):
    """One epoch's (images, labels) on the device, from step `start`:
    uint8 (b, 3, S, S), or (b, crops, 3, S, S) streamed; rank r's rows
    [r*b, (r+1)*b) of each batch in `generator`'s order (CPU, alike),
    drawn at the call: a resumed epoch's first steps are not read."""
    b = batch_size // ctx.world
    steps = len(data) // batch_size
    perm = torch.randperm(len(data), generator=generator)[:steps * batch_size]
    # this rank's rows of every batch from `start` on: (steps - start, b)
    mine = perm.view(steps, ctx.world, b)[start:, ctx.rank]
    if not data.streaming:
        mine = mine.to(ctx.device)
        return ((data.train[rows], data.train_labels[rows]) for rows in mine)
    # this epoch's crops
    data.train.seed = int(torch.randint(2 ** 62, (1,), generator=generator))
    subset = torch.utils.data.Subset(data.train, mine.flatten().tolist())
    loader = torch.utils.data.DataLoader(
        subset, b, num_workers=workers,
        pin_memory=ctx.device.type == "cuda")
    # pinned: copies without a wait
    return ((views.to(ctx.device, non_blocking=True),
             labels.to(ctx.device, non_blocking=True))
            for views, labels in loader)


# ----------------------------------------------------------------- evaluation
def eval_view(images, size):
    """uint8 (..., 3, H, W) -> (..., 3, S, S): torchvision's
    Resize(S / 0.875 above 64 px: 256 for 224), CenterCrop(S)."""
    side = round(size / 0.875) if size > 64 else size
    return TF.center_crop(TF.resize(images, [side], antialias=True), [size])


@torch.no_grad()
def extract_features(backbone, split, data, ctx, workers=0, unit=True):
    """Features (L2-normalised if `unit`: float16, the kNN bank, half
    of float32's GB; else float32) of un-augmented images, ranks
    sharing the work, gathered on every rank -> (N', F), (N',),
    N' = world * ceil(N / world), padding labelled -1."""
    was_training = backbone.training
    device = ctx.device
    held = isinstance(split, tuple)  # (images, labels)
    n = len(split[1]) if held else len(split)
    share = -(-n // ctx.world)
    lo = min(ctx.rank * share, n)
    hi = min((ctx.rank + 1) * share, n)
    if held:
        batches = zip(*(t[lo:hi].split(256) for t in split))
    else:  # its own generator: not the global RNG
        batches = torch.utils.data.DataLoader(
            torch.utils.data.Subset(split, range(lo, hi)), 256,
            num_workers=workers, pin_memory=device.type == "cuda",
            generator=torch.Generator())
    dtype = torch.float16 if unit else torch.float32
    features = torch.zeros(
        share, backbone.out_dim, device=device, dtype=dtype)
    labels = torch.full((share,), -1, dtype=torch.long, device=device)
    mean = torch.tensor(data.mean, device=device)  # copied to the device once
    std = torch.tensor(data.std, device=device)
    backbone.eval()
    batches = tqdm(batches, "features", -(-(hi - lo) // 256),
                   leave=False, disable=hide_bar(ctx.rank))
    for i, (images, y) in enumerate(batches):  # pinned: copies without a wait
        images = images.to(device, non_blocking=True)
        y = y.to(device, non_blocking=True)
        if data.whole and held:
            # held whole: the view streamed files get from workers
            images = eval_view(images, data.image_size)
        with ctx.autocast():
            f = backbone(normalize(images.float() / 255, mean, std)).float()
        rows = slice(256 * i, 256 * i + len(y))
        features[rows] = F.normalize(f, dim=1) if unit else f
        labels[rows] = y
    backbone.train(was_training)
    return gather(features), gather(labels)


@torch.no_grad()
def knn_accuracy(train_f, train_y, test_f, test_y, num_classes, k=200, t=0.1):
    """Weighted kNN (InstDisc, MoCo): the k nearest (cosine) vote
    exp(sim / t) -> top-1 %."""
    k = min(k, int((train_y >= 0).sum()))
    unlabelled = train_y < 0
    share = -(-len(test_y) // world_size())  # test rows per rank
    lo = rank() * share
    hi = min((rank() + 1) * share, len(test_y))
    correct = torch.zeros((), device=test_f.device)
    for i in range(lo, hi, 256):
        stop = min(i + 256, hi)
        sim = (test_f[i:stop] @ train_f.T).float()  # (b, N)
        sim = sim.masked_fill_(unlabelled, -math.inf)
        sim, idx = sim.topk(k, dim=1)  # (b, k)
        votes = torch.zeros(stop - i, num_classes, device=test_f.device)
        votes.scatter_add_(1, train_y[idx], torch.exp(sim / t))
        correct += (votes.argmax(1) == test_y[i:stop]).sum()
    return 100.0 * all_reduce_sum(correct).item() / int((test_y >= 0).sum())


def linear_classifier(dim, classes, device, seed, std=None):
    """nn.Linear(dim, classes): weight N(0, std), bias 0 (0.01:
    MoCo's, SimSiam's main_lincls.py) or torch's init (std None), from
    `seed` in a forked RNG: a global draw would shift later ones."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layer = nn.Linear(dim, classes)
        if std is not None:
            nn.init.normal_(layer.weight, 0.0, std)
            nn.init.zeros_(layer.bias)
    return layer.to(device)


# --linear-protocol: the final probe's settings, lr per 256 images
LINEAR_PROTOCOLS = {
    # this project's own probe
    "fixed": dict(optimizer="adamw", lr=1e-3, epochs=100, batch=256),
    # GSG Sec. 5.1 "Linear evaluation" (CIFAR-10), momentum 0.9;
    # assumed: crop+flip views, wd 0
    "gsg-cifar": dict(
        optimizer="sgd", lr=30.0, epochs=90, batch=256, schedule="cosine"),
    # facebookresearch/moco main_lincls.py: --lr 30, -b 256,
    # --epochs 100, --schedule 60 80, wd 0
    "moco": dict(
        optimizer="sgd", lr=30.0, epochs=100, batch=256, schedule="steps"),
    # facebookresearch/simsiam main_lincls.py --lars (as
    # bych-lee/gsg): apex LARC, no clip, bias too
    "simsiam-imagenet": dict(
        optimizer="lars", lr=0.1, epochs=90, batch=4096, schedule="cosine"),
}


def train_linear(classifier, optimizer, batches, epochs, lr=None,
                 scheduler=None, world=1):
    """The probes' loop: each epoch lr(epoch), cross-entropy steps."""
    for epoch in tqdm(range(epochs), "linear probe", leave=False,
                      disable=hide_bar(rank())):
        if lr:
            for group in optimizer.param_groups:
                group["lr"] = lr(epoch)
        for features, y in batches(epoch):
            loss = F.cross_entropy(classifier(features), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if world > 1:  # the mean of the ranks' gradients
                for p in classifier.parameters():
                    p.grad = all_reduce_sum(p.grad) / world
            optimizer.step()
            if scheduler:
                scheduler.step()


@torch.no_grad()
def top1(classify, features, labels):
    """Top-1 % of classify(features) over the labelled rows (-1:
    padding), 65536 rows at a time."""
    correct = 0
    for f, y in zip(features.split(65536), labels.split(65536)):
        correct += int((classify(f).argmax(1) == y).sum())
    return 100.0 * correct / int((labels >= 0).sum())


def linear_probe(train_f, train_y, test_f, test_y, num_classes, epochs,
                 lr, batch, seed=0):
    """`fixed` protocol: a linear classifier from zero (convex), AdamW
    + cosine -> test top-1 %."""
    rows = (train_y >= 0).nonzero()[:, 0]  # the labelled ones
    # a chunk at a time (train_f[rows] copies the bank), float64:
    # E[f^2] - E[f]^2 cancels
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

    def batches(epoch):
        perm = torch.randperm(
            len(rows), generator=generator, device=rows.device)
        for r in rows[perm].split(batch):
            yield standardised(train_f[r]), train_y[r]

    # alike on every rank
    train_linear(classifier, optimizer, batches, epochs, scheduler=cosine)
    return top1(lambda f: classifier(standardised(f)), test_f, test_y)


def linear_probe_augmented(backbone, data, ctx, protocol, epochs, lr,
                           batch, seed=0, workers=0):
    """An authors' probe (LINEAR_PROTOCOLS) on the frozen backbone,
    crop + flip views -> top-1 %."""
    own = LINEAR_PROTOCOLS[protocol]
    if data.streaming:  # the workers crop and flip
        images = ImageFiles(data.eval_train.samples, data.image_size, crops=1)
        labels = data.train_labels
    else:
        images, labels = data.eval_train
    # drawn as pre-training's batches
    probe_set = replace(data, train=images, train_labels=labels)
    batch = max(1, min(batch, len(labels)) // ctx.world) * ctx.world
    peak = lr * batch / 256
    classifier = linear_classifier(
        backbone.out_dim, data.num_classes, ctx.device, seed, std=0.01)
    params = classifier.parameters()
    if own["optimizer"] == "lars":
        optimizer = LARS(params, peak, momentum=0.9, eta=0.001)
    else:
        optimizer = torch.optim.SGD(params, peak, 0.9)
    recipe = Recipe(jitter=(0, 0, 0, 0), gray_p=0)
    augment = Augment([recipe], data.image_size, data.mean, data.std, ctx)

    def lr_at(epoch):  # as main_lincls.py's adjust_learning_rate
        if own["schedule"] == "cosine":
            return peak * 0.5 * (1 + math.cos(math.pi * epoch / epochs))
        # MoCo's steps: x0.1 at epochs 60, 80 of 100; here 60%, 80%
        passed = sum(epoch >= f * epochs for f in (0.6, 0.8))
        return peak * 0.1 ** passed

    def batches(epoch):
        order, views = epoch_generators(seed + 1, epoch, ctx.device)
        for x, y in train_batches(probe_set, batch, order, ctx, workers):
            x = augment(x, views)[0]  # float32, as in pre-training
            with torch.no_grad(), ctx.autocast():
                features = backbone(x)
            yield features.float(), y

    was_training = backbone.training
    backbone.eval()  # frozen: BatchNorm uses, and keeps, its statistics
    train_linear(classifier, optimizer, batches, epochs, lr=lr_at,
                 world=ctx.world)
    backbone.train(was_training)
    test_f, test_y = extract_features(
        backbone, data.eval_test, data, ctx, workers, unit=False)
    return top1(lambda f: classifier(f.float()), test_f, test_y)


class OnlineProbe:
    """The DT authors' online classifier
    (ChaoningZhang/Dual-temperature solo/methods/base.py lines 246,
    335-343, 424-447) on training views' detached features, kept by
    `keep`, the forward hook online_probes registers (their
    lines 475, 482 read the same features); SGD momentum 0.9
    (solo/args/utils.py line 204), no weight decay, lr 0.3 not scaled
    by the batch (bash_files/*.sh --classifier_lr; utils.py line 212
    scales only --lr); its result is `name`."""

    def __init__(self, backbone, num_classes, ctx, seed,
                 name="online_top1", lr=0.3):
        self.backbone, self.name, self.lr = backbone, name, lr
        self.features = []
        self.classifier = linear_classifier(
            backbone.out_dim, num_classes, ctx.device, seed)
        self.optimizer = torch.optim.SGD(
            self.classifier.parameters(), lr=lr, momentum=0.9)

    def keep(self, backbone, inputs, output):
        if backbone.training:  # not evaluation's
            self.features.append(output.detach())

    def step(self, labels, lr_scale):
        """SGD step on the kept views, labels (b,) per view; lr_scale:
        pre-training lr / peak."""
        features = float32(torch.cat(self.features))  # (V * b, F)
        self.features = []
        y = labels.repeat(len(features) // len(labels))  # (V * b,)
        # over every rank's views
        labelled = all_reduce_sum((y >= 0).sum()).clamp_min(1)
        loss = F.cross_entropy(
            self.classifier(features), y, ignore_index=-1, reduction="sum")
        self.optimizer.zero_grad(set_to_none=True)
        (loss / labelled).backward()
        # each rank's share of the global mean
        for p in self.classifier.parameters():
            p.grad = all_reduce_sum(p.grad)
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr * lr_scale
        self.optimizer.step()

    def accuracy(self, data, ctx, workers=0):
        """Top-1 % on the un-augmented test split, the backbone in eval
        mode (the DT fork's)."""
        f, y = extract_features(
            self.backbone, data.eval_test, data, ctx, workers, unit=False)
        return top1(lambda x: self.classifier(float32(x)), f, y)

    def state_dict(self):  # for checkpoint.pt
        return dict(classifier=self.classifier.state_dict(),
                    optimizer=self.optimizer.state_dict())

    def load_state_dict(self, state):
        self.classifier.load_state_dict(state["classifier"])
        self.optimizer.load_state_dict(state["optimizer"])


def online_probes(args, data, ctx, backbone, momentum_encoder=None):
    """--online-probe's OnlineProbes by checkpoint name ({} without
    it), each hooked to its backbone: on `backbone`, and on a momentum
    encoder's as the DT scripts' --momentum_classifier (base.py lines
    631-635, 768-782)."""
    if not args.online_probe:
        return {}
    classes = data.num_classes
    probes = {"online_probe": OnlineProbe(backbone, classes, ctx, args.seed)}
    if momentum_encoder is not None:
        probes["momentum_probe"] = OnlineProbe(
            momentum_encoder.backbone, classes, ctx, args.seed,
            "momentum_online_top1")
    for probe in probes.values():
        # The features train_step makes reach `keep`.
        probe.backbone.register_forward_hook(probe.keep)
    return probes


def method_name(args):
    """The script and each option its own file adds, in its order:
    `--loss dcl`, a flag only when set."""
    parser = argparse.ArgumentParser()  # a throwaway one
    add_common_args(parser)
    shared = vars(parser.parse_args([]))
    words = [f"{RUN['script']}.py"]
    for key, value in vars(args).items():
        if key in shared or value is None or value is False:
            continue
        words.append("--" + key.replace("_", "-"))
        if value is not True:
            words.append(str(value))
    return " ".join(words)


def evaluate(backbone, data, ctx, args, final=False, probes=None):
    """kNN top-1 (--knn-k) and each probe's; `final` adds k=1 and the
    linear probe (--linear-*)."""
    train_f, train_y = extract_features(
        backbone, data.eval_train, data, ctx, args.workers)
    test_f, test_y = extract_features(
        backbone, data.eval_test, data, ctx, args.workers)

    def knn(k):
        return knn_accuracy(
            train_f, train_y, test_f, test_y, data.num_classes, k, args.knn_t)

    result = {"knn_top1": knn(args.knn_k)}
    for probe in (probes or {}).values():
        result[probe.name] = probe.accuracy(data, ctx, args.workers)
    if not final:
        return result
    result = {"method": method_name(args), **result,
              "knn_k": args.knn_k, "knn_k1_top1": knn(1),
              "epochs": args.epochs}
    protocol = args.linear_protocol
    own = LINEAR_PROTOCOLS[protocol]
    given = dict(epochs=args.linear_epochs, lr=args.linear_lr,
                 batch=args.linear_batch)
    settings = {k: own[k] if v is None else v for k, v in given.items()}
    if not settings["epochs"]:
        return result
    if protocol == "fixed":
        linear = linear_probe(
            train_f, train_y, test_f, test_y, data.num_classes,
            seed=args.seed, **settings)
    else:
        linear = linear_probe_augmented(
            backbone, data, ctx, protocol, seed=args.seed,
            workers=args.workers, **settings)
    result.update(linear_top1=linear, linear_protocol=protocol)
    return result


# ----------------------------------------------------------------- optimisers
def learning_rate(step, total_steps, warmup_steps, peak, schedule="cosine"):
    """Linear warm-up to `peak`, then cosine decay to 0 (or constant)."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    if schedule == "constant":
        return peak
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


class LARS(torch.optim.Optimizer):
    """SGD with momentum and LARS's trust ratio (You et al. 2017) per
    tensor; adapt=False: r = 1.
        g' = g + wd * w,   r = eta * ||w|| / ||g'||   (r = 1 if a norm is 0)
        with `clip`: r = min(r / lr, 1)
        buf <- momentum * buf + r * g',   w <- w - lr * buf
    r as google-research/simclr lars_optimizer.py lines 98-110 (eta
    0.001: its line 26; solo-learn's lars.py line 142 divides by
    ||g|| + wd ||w||); clip and momentum as its lines 145-165."""

    def __init__(self, params, lr, momentum=0.9, weight_decay=0.0,
                 eta=0.001, clip=False):
        super().__init__(params, dict(
            lr=lr, momentum=momentum, weight_decay=weight_decay,
            eta=eta, clip=clip, adapt=True))

    @torch.no_grad()
    def step(self):  # tensors at once (torch._foreach_*), no host sync
        for group in self.param_groups:
            params = [w for w in group["params"] if w.grad is not None]
            for w in params:  # made once, at the first step
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
                # A kernel a tensor on CUDA: torch 2.14 fuses no
                # factor per tensor held on the device.
                torch._foreach_mul_(g, trust.unbind())
            buffers = [self.state[w]["momentum_buffer"] for w in params]
            torch._foreach_mul_(buffers, group["momentum"])
            torch._foreach_add_(buffers, g)
            torch._foreach_add_(params, buffers, alpha=-group["lr"])


def optimizer_groups(groups):
    """Parameters (or group dicts) -> LARS's param groups: 1-D ones
    (batch norm, bias) apart, no wd or trust ratio (SimCLR's
    tf2/model.py lines 40-42, solo-learn's lars.py line 140)."""
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


def pretraining_optimizer(groups, args, ctx, lr):
    """--optimizer: SGD, momentum 0.9, wd on every parameter (the
    authors' SGD runs), or LARS."""
    if args.optimizer == "lars":
        return LARS(optimizer_groups(groups), lr, 0.9, args.wd,
                    args.lars_eta, args.lars_clip)
    return torch.optim.SGD(groups, lr=lr, momentum=0.9, weight_decay=args.wd)


# =============================================================================
# Part 2: plumbing that changes nothing a method computes
# =============================================================================
# ----------------------------------------------------- errors and command line
class UserError(Exception):
    """A problem the user can fix: one line, exit status 2, no traceback."""


# This process's run: its folder, script and command line.
RUN = {"out": None, "script": None, "argv": None}


def stop(signum, frame):
    """SIGTERM as Ctrl-C: the run ends where it is (a download,
    a step, the kNN, a probe); the last checkpoint stays."""
    raise KeyboardInterrupt(signal.Signals(signum).name)


def run(main):
    """main() as a command. SIGINT, SIGTERM: one line, exit status
    128 + the signal's number; a UserError, OSError or a lost
    process: one `error:` line, exit status 2."""
    rank = int(os.environ.get("RANK", 0))  # before any process group
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        main()
    except KeyboardInterrupt as error:
        name = error.args[0] if error.args else "SIGINT"
        if rank == 0:
            print(f"stopped ({name}); the last checkpoint is kept: "
                  f"continue with --resume {RUN['out']}", file=sys.stderr)
        sys.exit(128 + signal.Signals[name])
    except (UserError, OSError, RuntimeError) as error:
        # From a DataLoader worker, the message is its traceback.
        message = str(error).strip().split("\n")[-1].split("UserError: ")[-1]
        peer = re.search(r"Connection \w+ by peer", str(error))
        if peer:  # gloo's words when a process ends
            message = (f"another process of this run stopped ({peer[0]}); "
                       f"the last checkpoint is kept: continue with "
                       f"--resume {RUN['out']}")
        elif isinstance(error, dist.DistError):  # NCCL's own words
            message = f"{type(error).__name__}: " + str(error).strip().split("\n")[0]
        elif isinstance(error, RuntimeError):
            raise  # a bug: its traceback
        if rank != 0:
            # Rank 0 speaks for all and torchrun stops the rest (its
            # SIGTERM ends the wait); a rank alone speaks after it.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            time.sleep(10)
        where = f" (rank {rank})" if rank else ""
        print(f"error{where}: {message}", file=sys.stderr)
        sys.exit(2)
    finally:
        signal.signal(signal.SIGTERM, previous)
        for bar in list(tqdm._instances):  # an interrupted epoch's bar
            bar.close()
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


class HelpFormatter(argparse.RawDescriptionHelpFormatter,
                    argparse.ArgumentDefaultsHelpFormatter):
    """--help: the usage docstring's layout, each default once."""

    def _get_help_string(self, action):
        if "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


METHOD_DEFAULTS = ("batch_size", "epochs", "lr", "wd", "warmup_epochs", "crop_scale")


def add_common_args(parser):
    """The shared options; the method file sets METHOD_DEFAULTS."""
    a = parser.add_argument
    on_off = argparse.BooleanOptionalAction
    a("--dataset", choices=[*STATS, "textures"], default="cifar10",
      help="imagefolder: DATA_DIR/{train,val}/<class>/<images>; "
           "textures: 5 generated classes of 20 px images (a CPU demo)")
    a("--data-dir", default="./data",
      help="where the data set is (CIFAR/STL-10 download here)")
    a("--image-size", type=positive_int,
      help="default: 32 CIFAR, 96 STL-10, 224 imagefolder")
    a("--stream", action="store_true",
      help="imagefolder: workers decode + crop each epoch")
    a("--workers", type=non_negative_int,
      default=min(8, os.cpu_count() or 1), help="decoders")
    a("--limit-train", type=positive_int,
      help="N training images (imagefolder: across classes)")
    a("--arch", choices=["resnet18", "resnet34", "resnet50"],
      default="resnet18", help="backbone")
    # 1: ours where no authors' CIFAR stem is cited (SimCLR, GSG); DT
    # and NNCLR set 2, as theirs.
    a("--stem-padding", type=non_negative_int, default=1,
      help="padding of the 3x3 stem (<= 64 px)")
    a("--width", type=positive_int, default=64,
      help="base channel count (64 = standard ResNet)")
    a("--epochs", type=non_negative_int,
      help="pre-training epochs (0: evaluate the untrained net)")
    a("--batch-size", type=positive_int,
      help="global batch, split evenly across processes")
    a("--lr", type=positive_float,
      help="base learning rate per 256 images (lr = LR * batch / 256)")
    a("--wd", type=non_negative_float, help="weight decay")
    a("--warmup-epochs", type=non_negative_int,
      help="linear learning-rate warm-up epochs")
    a("--optimizer", choices=["sgd", "lars"], default="sgd",
      help="SGD (momentum 0.9) or LARS")
    a("--lars-eta", type=positive_float, default=0.001,
      help="LARS trust coefficient (SimCLR's)")
    a("--lars-clip", action=on_off, default=False,
      help="LARS: lr <= the schedule's (solo-learn's)")
    a("--crop-scale", type=fraction, nargs=2, metavar=("MIN", "MAX"),
      help="random crop's area range")
    a("--out", help="run folder (default runs/<script>-<time>-<pid>); "
      "the same command again continues its run")
    a("--resume", metavar="RUN",
      help="continue RUN with the options its checkpoint keeps (any "
           "given here replace them), or evaluate a finished RUN again")
    a("--stop-after", type=positive_int,
      help="end after that many epochs in all (then --resume)")
    # torchtitan's default interval. A CIFAR epoch at batch 256 is
    # 195 steps and never reaches it; ImageNet's 5,004 write ten.
    a("--checkpoint-every", type=positive_int, default=500, metavar="N",
      help="a checkpoint every N steps of an epoch, and at its end: "
           "a killed run loses at most N steps")
    a("--eval-every", type=positive_int, default=10,
      help="kNN monitor every N epochs (and last)")
    a("--knn-k", type=positive_int, default=200,
      help="neighbours of the kNN monitor")
    a("--knn-t", type=positive_float, default=0.1,
      help="temperature of the weighted kNN vote")
    a("--online-probe", action=on_off, default=False,
      help="the DT authors' online classifiers")
    a("--linear-protocol", choices=list(LINEAR_PROTOCOLS), default="fixed",
      help="the final probe (fixed: AdamW on fixed features; the others "
           "on crop+flip views): common.LINEAR_PROTOCOLS")
    a("--linear-epochs", type=non_negative_int,
      help="probe epochs (None: the protocol's; 0: none)")
    a("--linear-lr", type=positive_float,
      help="probe lr per 256 images (None: the protocol's)")
    a("--linear-batch", type=positive_int,
      help="probe batch (None: the protocol's)")
    a("--seed", type=seed_value, default=0,
      help="seed of model init, data order, augmentation")
    a("--device", default="cuda" if torch.cuda.is_available() else "cpu",
      help="cuda, cuda:N or cpu (under torchrun, cuda means "
           "cuda:LOCAL_RANK)")
    a("--amp", action=on_off,
      help="bf16 autocast (default: where the GPU has native bf16)")
    a("--compile", action=on_off, default=False,
      help="torch.compile the network and the augmentation")


def parse_args(parser, argv, script):
    """The command line's options. With --resume RUN: those RUN's
    checkpoint keeps, any given here replacing them. In an --out
    holding this command's run: it continues (a requeue)."""
    # Checked even if the command line gives one: the file is at fault.
    unset = [k for k in METHOD_DEFAULTS if parser.get_default(k) is None]
    if unset:
        raise UserError(
            f"{script}.py sets no default for {', '.join(unset)}: give "
            f"each in its parser.set_defaults(...)")
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    args = parser.parse_args(argv)
    if args.crop_scale and args.crop_scale[0] > args.crop_scale[1]:
        parser.error("--crop-scale: MIN > MAX")
    RUN.update(script=script, argv=argv)
    if args.resume is None:
        # The process id keeps apart runs started in one second.
        name = f"{script}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        args.out = args.out or os.path.join("runs", name)
        RUN["out"] = args.out
        if not continues(args.out, argv, script):
            return args
        args.resume = args.out  # a scheduler's requeue
    folder = args.resume.removesuffix("checkpoint.pt")
    path = os.path.join(folder, "checkpoint.pt")
    try:  # mmap: the states are read when the run loads them
        saved = torch.load(path, map_location="cpu",
                           weights_only=True, mmap=True)
        made_by = saved.get("script")  # AttributeError: no dict
        kept = argparse.Namespace(**saved["args"])
    except Exception as error:  # missing, truncated, not ours
        raise UserError(
            f"{path}: no checkpoint of this project to resume "
            f"({type(error).__name__}); give a run folder that has "
            f"one, or start a new --out") from None
    if made_by != script:
        raise UserError(
            f"--resume {folder}: that run was made by {made_by}.py, "
            f"not {script}.py; start a new --out")
    args = parser.parse_args(argv, kept)  # argparse: kept, then argv
    args.resume = args.out = RUN["out"] = folder
    return args


def continues(out, argv, script):
    """Does `out` hold this command's run, checkpointed? Another
    command's is refused; a finished one ends this process."""
    held = os.listdir(out) if os.path.isdir(out) else []
    if "config.json" not in held:
        return False
    try:
        with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
        theirs = shlex.join([f"{config['script']}.py", *config["argv"]])
    except (OSError, ValueError, TypeError, KeyError):
        raise UserError(f"{out} holds no readable config.json: "
                        f"choose another --out") from None
    ours = shlex.join([f"{script}.py", *argv])
    if ours != theirs:
        raise UserError(
            f"--out {out} holds the run of `{theirs}`, not `{ours}`: run "
            f"that command again to continue it (or --resume {out}), or "
            f"choose another --out")
    if "results.json" in held:  # a requeue of it succeeds at once
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"{out} is finished (results.json); --resume {out} "
                  f"evaluates it again", file=sys.stderr)
        sys.exit(0)
    # No checkpoint yet (its first epoch failed): it starts again.
    return "checkpoint.pt" in held


def setup(args):
    """Device, torchrun's process group; cuDNN autotuner on, no TF32."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.batch_size % world or args.batch_size // world < 2:
        raise UserError(
            f"--batch-size {args.batch_size} must be a multiple of the "
            f"{world} processes with at least 2 images per process")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        raise UserError(f"--device {args.device}: use cuda, cuda:N or cpu")
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    count = torch.cuda.device_count()
    if cuda and device.index is None:
        # torchrun: a GPU per local rank, or the only one seen.
        device = torch.device("cuda", local_rank if count > 1 else 0)
    if cuda and device.index >= count:
        other = f"cuda:{count - 1}" if count else "cpu"
        raise UserError(
            f"--device {args.device}, but {count} CUDA GPU(s) are visible "
            f"here; use --device {other}")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo",
                                device_id=device if cuda else None)
    amp = cuda and args.amp  # unset: where the GPU has native bf16
    if cuda and args.amp is None:
        amp = torch.cuda.is_bf16_supported(including_emulation=False)
    return Context(rank, world, local_rank, device, args.out, amp)


# ---------------------------------------------------- epoch log and run folder
class EpochMeter:
    """Progress bar (loss, lr, images/s; host waits every `every` steps)."""

    def __init__(self, ctx, epoch, epochs, steps, images_per_step):
        self.world = ctx.world
        self.device = ctx.device
        self.epoch = epoch
        self.images_per_step = images_per_step
        self.every = min(20, max(1, steps // 20))
        self.sums = {}
        self.steps = 0
        self.lr = 0.0
        self.bar = tqdm(total=steps, desc=f"epoch {epoch + 1}/{epochs}", leave=False,
                        disable=hide_bar(ctx.rank), dynamic_ncols=True)
        self.start = self.last = time.perf_counter()

    def update(self, lr, loss, **scalars):
        """The step's loss and diagnostics: tensors or numbers."""
        self.steps += 1
        self.lr = lr
        scalars = {"loss": loss, **scalars}
        for name, value in scalars.items():
            # Tensors summed on the device, numbers on the host: a
            # number sent to a GPU every step would wait for it.
            if torch.is_tensor(value):
                value = value.detach().float()
            self.sums[name] = self.sums.get(name, 0) + value
        if self.steps % self.every or self.bar.disable:
            return
        now = time.perf_counter()
        loss = float(self.sums["loss"]) / self.steps
        rate = self.every * self.images_per_step / (now - self.last)
        self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.4g}", img_s=f"{rate:.0f}")
        self.bar.update(self.every)
        self.last = now

    def state_dict(self):  # every rank's sums: a collective
        sums = {k: gather(self.tensor(v).view(1))
                for k, v in self.sums.items()}
        return dict(steps=self.steps, lr=self.lr, sums=sums)

    def tensor(self, total):  # a sum, on the device
        return torch.as_tensor(total, dtype=torch.float32,
                               device=self.device)

    def load_state_dict(self, state):
        self.steps = state["steps"]
        self.lr = state["lr"]
        self.bar.update(self.steps)
        for name, sums in state["sums"].items():
            # Mine (on fewer processes than saved them: theirs too).
            mine = sums[rank()::self.world].sum()
            self.sums[name] = mine.to(self.device)

    def summary(self):
        self.bar.close()
        rows = self.steps * self.world
        # .item() waits for the device: the clock reads a finished epoch.
        means = {name: all_reduce_sum(self.tensor(total)).item() / rows
                 for name, total in self.sums.items()}
        seconds = time.perf_counter() - self.start
        rate = self.steps * self.images_per_step / seconds
        return {"epoch": self.epoch + 1, **means, "lr": self.lr,
                "images_per_s": rate, "seconds": seconds}


def check_finite(record):
    """A non-finite loss stops every rank alike (a global mean)."""
    if math.isfinite(record["loss"]):
        return
    kept = "no checkpoint was written"
    if record["epoch"] > 1:
        kept = "the last checkpoint is kept"
    raise UserError(
        f"loss became {record['loss']} in epoch {record['epoch']}; {kept}; "
        f"lower --lr, check --wd and the temperatures, or try --no-amp")


def one_line(record, spec):
    return "  ".join(f"{k} {v:{spec}}" if isinstance(v, float) else
                     f"{k} {v}" for k, v in record.items())


class Run:
    """The run folder and the loop's bookkeeping: where training
    starts, each epoch's batches and draws, its checkpoints, its
    end (kNN, log line) and the run's end (results.json).

    `states`: what checkpoint.pt keeps, by name (None: a part
    this method lacks); `probes`: OnlineProbes by name, kept too."""

    def __init__(self, args, ctx, data, backbone, probes, states):
        self.args = args
        self.ctx = ctx
        self.data = data
        self.backbone = backbone
        self.probes = probes
        self.states = {k: s for k, s in {**states, **probes}.items()
                       if s is not None}
        self.epoch = 0  # where training starts: `step` into `epoch`
        self.step = 0
        self.resumed = {}  # a mid-epoch checkpoint's draws, sums
        self.metrics = []  # the epochs' records
        self.steps = len(data) // args.batch_size  # an epoch's
        where = "generated" if args.dataset == "textures" else args.data_dir
        held = "streamed" if data.streaming else "held"
        val = data.eval_test if data.streaming else data.eval_test[1]
        size = sum(p.numel() for p in backbone.parameters())
        ctx.print(
            f"run {ctx.out}  data {args.dataset} ({where}, {held})  train "
            f"{len(data)}  val {len(val)}  classes {data.num_classes}  image "
            f"{data.image_size} px  device {ctx.device}  processes "
            f"{ctx.world}  backbone {args.arch} width {args.width}: "
            f"{size:,} parameters")
        if 0 < args.epochs <= args.warmup_epochs:
            ctx.print(f"warning: --epochs {args.epochs} is not more than "
                      f"--warmup-epochs {args.warmup_epochs}: the learning "
                      f"rate never reaches its peak", sys.stderr)
        if ctx.rank == 0:  # now that all is ready: no failed start's
            os.makedirs(ctx.out, exist_ok=True)
            hold_run_folder(ctx.out)
        if args.resume:
            self.load()
        elif ctx.rank == 0:
            self.write_config()

    def write_config(self):
        """config.json: the command line, options, versions."""
        here = os.path.dirname(os.path.abspath(__file__))
        git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here,
                             capture_output=True, text=True)
        versions = dict(python=sys.version.split()[0], torch=torch.__version__,
                        git_commit=git.stdout.strip() or None)
        config = dict(script=RUN["script"], argv=RUN["argv"],
                      args=vars(self.args), world_size=self.ctx.world,
                      versions=versions)
        write_atomic(os.path.join(self.ctx.out, "metrics.jsonl"), b"")
        write_atomic(os.path.join(self.ctx.out, "config.json"),
                     json.dumps(config, indent=2).encode())

    def load(self):
        """checkpoint.pt's states, epoch, step and metrics."""
        path = os.path.join(self.ctx.out, "checkpoint.pt")
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)
            kept = saved.keys() - CHECKPOINT_KEYS
            missing = ", ".join(sorted(self.states.keys() - kept)) or "none"
            left_over = ", ".join(sorted(kept - self.states.keys())) or "none"
            if kept != self.states.keys():  # named, not a KeyError
                raise UserError(
                    f"{path} does not fit this run (states missing: "
                    f"{missing}; left over: {left_over}); start a new --out")
            for name, state in self.states.items():
                state.load_state_dict(saved[name])
            self.epoch = saved["epoch"]
            self.step = saved.get("step", 0)
            self.metrics = saved["metrics"]
        except UserError:
            raise
        except Exception as error:
            why = " ".join(str(error).split())[:120]
            raise UserError(
                f"{path} does not fit this run or is unreadable "
                f"({type(error).__name__}: {why}); start a new --out") from None
        self.resumed = saved
        device = saved.get("device", self.ctx.device.type)
        if self.step and device != self.ctx.device.type:
            # Its random draws continue only on a generator alike.
            raise UserError(
                f"{path} stopped in epoch {self.epoch + 1} on {device}; "
                f"continue it with --device {device}")
        self.ctx.print(f"continuing {self.ctx.out} from epoch "
                       f"{self.epoch + 1} step {self.step}")

    def epochs(self):
        """The epochs to train: from the checkpoint's to --epochs,
        or to --stop-after if the run has not passed it."""
        end = self.args.epochs
        if self.epoch < (self.args.stop_after or 0):
            end = min(end, self.args.stop_after)
        return range(self.epoch, end)

    def batches(self, epoch):
        """This epoch's steps -> (step, images, labels), from the
        step its checkpoint reached, with a checkpoint after every
        --checkpoint-every steps. Meanwhile self.order (CPU: order,
        pairings) and self.draws (views) are the epoch's generators,
        self.meter its EpochMeter."""
        args = self.args
        first = self.step if epoch == self.epoch else 0
        self.order, self.draws = epoch_generators(
            args.seed, epoch, self.ctx.device)
        self.meter = EpochMeter(self.ctx, epoch, args.epochs,
                                self.steps, args.batch_size)
        batches = train_batches(self.data, args.batch_size, self.order,
                                self.ctx, args.workers, first)
        if first:  # the draws go on from the checkpoint's step
            for generator, state in zip((self.order, self.draws),
                                        self.resumed["generators"]):
                generator.set_state(state)
            self.meter.load_state_dict(self.resumed["meter"])
        for step, (images, labels) in enumerate(batches, first):
            yield step, images, labels
            done = step + 1
            if done % args.checkpoint_every == 0 and done < self.steps:
                self.save(epoch, done)

    def save(self, epoch, step=0):
        """checkpoint.pt: the states, `epoch` epochs done and the
        metrics; `step` steps into the next, also its draws and sums,
        for the next step to draw as if never stopped."""
        mid_epoch = {}
        if step:
            generators = [g.get_state() for g in (self.order, self.draws)]
            mid_epoch = dict(step=step, meter=self.meter.state_dict(),
                             generators=generators,
                             device=self.ctx.device.type)
        if self.ctx.rank != 0:
            return
        states = {k: s.state_dict() for k, s in self.states.items()}
        checkpoint = dict(script=RUN["script"], args=vars(self.args),
                          epoch=epoch, metrics=self.metrics,
                          **mid_epoch, **states)
        write_atomic(os.path.join(self.ctx.out, "checkpoint.pt"), checkpoint)

    def train_probes(self, labels, lr_scale):
        """The online probes learn from this step's features."""
        for probe in self.probes.values():
            probe.step(labels, lr_scale)

    def end_epoch(self, record):
        """The epoch's record, checked; the kNN monitor (and probes)
        every --eval-every epochs and after the last; its line in
        metrics.jsonl and on stdout; checkpoint.pt."""
        check_finite(record)
        done = record["epoch"]
        if done % self.args.eval_every == 0 or done == self.args.epochs:
            record.update(evaluate(self.backbone, self.data, self.ctx,
                                   self.args, probes=self.probes))
        self.metrics.append(record)
        self.epoch = done
        self.step = 0
        if self.ctx.rank == 0:
            # All lines: a resume's are the checkpoint's.
            lines = "".join(json.dumps(r) + "\n" for r in self.metrics)
            write_atomic(os.path.join(self.ctx.out, "metrics.jsonl"),
                         lines.encode())
            self.ctx.print(one_line(record, ".4g"))
        self.save(done)

    def finish(self):
        """The final evaluation: backbone.pt (torchvision's names),
        results.json (or eval-<time>.json when evaluated again). Or,
        stopped by --stop-after, how to continue."""
        ctx = self.ctx
        if self.epoch < self.args.epochs:
            ctx.print(f"stopped after epoch {self.epoch}: continue with "
                      f"--resume {ctx.out}")
            return
        results = evaluate(self.backbone, self.data, ctx, self.args,
                           final=True, probes=self.probes)
        if ctx.rank != 0:
            return
        path = os.path.join(ctx.out, "results.json")
        if os.path.exists(path):  # evaluated again
            name = f"eval-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.json"
            path = os.path.join(ctx.out, name)
        weights = os.path.join(ctx.out, "backbone.pt")
        if not os.path.exists(weights):  # first finish, or deleted
            save_weights(weights, self.backbone)
        write_atomic(path, json.dumps(results, indent=2).encode())
        lock = LOCKS.pop(os.path.realpath(ctx.out), None)
        if lock:
            lock.close()  # which drops its flock
        ctx.print(f"final: {one_line(results, '.2f')}\nwritten to {path}")


def save_weights(path, module):
    """`module`'s weights as CPU tensors, by torchvision's names."""
    state = module.state_dict()
    write_atomic(path, {k: v.cpu() for k, v in state.items()})


# What a checkpoint holds beside the states
CHECKPOINT_KEYS = {"script", "args", "epoch", "metrics", "step", "meter",
                   "generators", "device"}
LOCKS = {}  # run folder (real path) -> its OUT/.lock, flock held


def hold_run_folder(out):
    """OUT/.lock's flock (gone when the process ends): one process in OUT."""
    if os.path.realpath(out) in LOCKS:  # a run, its resume, one session
        return
    f = open(os.path.join(out, ".lock"), "a+", encoding="utf-8")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        time.sleep(0.1)  # the holder writes its name after it locks
        f.seek(0)
        raise UserError(
            f"{out} is in use by process {f.read().strip()}: a run or "
            f"--resume of it is going on; wait for it to end (or stop "
            f"it), then try again") from None
    f.truncate(0)
    print(os.getpid(), "on", socket.gethostname(), file=f, flush=True)
    LOCKS[os.path.realpath(out)] = f


def write_atomic(path, data):
    """`path` whole or not at all; `data`: bytes, or torch.save's input."""
    if not isinstance(data, bytes):
        # Serialised first: a failing torch.save writes nothing.
        buffer = io.BytesIO()
        torch.save(data, buffer)
        data = buffer.getvalue()
    temp = path + ".tmp"
    try:
        with open(temp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # a power cut keeps one whole file
        os.replace(temp, path)
    except OSError as error:
        raise UserError(
            f"cannot write {path} ({error.strerror}); the last good "
            f"checkpoint is kept: continue with --resume "
            f"{os.path.dirname(path)}") from None
    finally:  # what a full disk or Ctrl-C left (after the rename: none)
        with contextlib.suppress(OSError):
            os.remove(temp)


# ------------------------------------------------------------------------ data
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
    """Pre-training set, two evaluation splits (labels -1: unlabelled):
    uint8 (N, 3, H, W), (images, labels) on the device; or ImageFiles."""
    train: object
    train_labels: torch.Tensor
    eval_train: object
    eval_test: object
    num_classes: int
    image_size: int
    mean: tuple
    std: tuple
    streaming: bool = False
    whole: bool = False  # as decoded, seen through eval_view

    def __len__(self):
        return len(self.train_labels)


def load_data(args, ctx, crops=2):
    """--dataset as Data, its image size into args.image_size;
    `crops`: random crops per streamed image."""
    mean, std = STATS.get(args.dataset, STATS["imagefolder"])
    sizes = {"cifar10": 32, "cifar100": 32, "stl10": 96, "textures": 20}
    size = sizes.get(args.dataset, args.image_size or 224)
    limit = args.limit_train
    if args.dataset == "imagefolder":
        data = image_folder(args, ctx, size, mean, std, crops)
    elif args.image_size not in (None, size):  # a resume would refuse it
        raise UserError(f"--image-size {args.image_size}: {args.dataset} "
                        f"images are {size} px")
    elif args.dataset == "textures":  # from --seed: no file read
        train, test = texture_images(args.seed)
        train = tuple(t.to(ctx.device)[:limit] for t in train)
        test = tuple(t.to(ctx.device) for t in test)
        data = Data(*train, train, test, len(TEXTURES), size, mean, std)
    elif args.dataset == "stl10":  # evaluated on the labelled splits
        train = torchvision_split(args, ctx, limit, split="train+unlabeled")
        labelled = torchvision_split(args, ctx, limit, split="train")
        test = torchvision_split(args, ctx, None, split="test")
        data = Data(*train, labelled, test, 10, size, mean, std)
    else:
        train = torchvision_split(args, ctx, limit, train=True)
        test = torchvision_split(args, ctx, None, train=False)
        classes = 100 if args.dataset == "cifar100" else 10
        data = Data(*train, train, test, classes, size, mean, std)
    if len(data) < args.batch_size:
        raise UserError(f"--batch-size {args.batch_size}: only {len(data)} "
                        f"training images")
    args.image_size = size  # what the recipes and config.json read
    return data


def texture_images(seed, counts=(2000, 500), size=20):
    """--dataset textures: (uint8 (N, 3, S, S), labels) per split,
    image i a TEXTURES[i % 5] in two fixed colours (either in front)
    plus noise: no cue in colour, one an untrained net sees."""
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
        centre_y = size * (0.2 + 0.6 * uniform(n))  # the rings'
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
        first = torch.randint(2, (n,), generator=generator)  # foreground
        images = mask * colours[first] + (1 - mask) * colours[1 - first]
        noise = torch.randn(n, 3, size, size, generator=generator)
        images = images + 0.08 * noise
        images = (images.clamp(0, 1) * 255).round().to(torch.uint8)
        splits.append((images, label))
    return splits


def torchvision_split(args, ctx, limit, **split):
    """CIFAR/STL-10: uint8 (N, 3, S, S), labels on the device;
    downloaded, or checked, under a lock."""
    cls = getattr(torchvision.datasets, args.dataset.upper())
    root = args.data_dir
    folders = [os.path.join(root, f) for f in ("train", "val")]
    own = os.path.join(root, cls.base_folder)
    # An ImageFolder: said before anything is written.
    if all(map(os.path.isdir, folders)) and not os.path.exists(own):
        raise UserError(f"{root} holds train/ and val/: use --dataset imagefolder")
    # A read-only folder, or no flock: no lock.
    lock = contextlib.nullcontext()
    with contextlib.suppress(OSError):
        os.makedirs(root, exist_ok=True)
        lock = open(os.path.join(root, ".download.lock"), "a")
        fcntl.flock(lock, fcntl.LOCK_EX)  # closing the file releases it
    with lock:
        try:
            cls(root, download=True, **split)
        except Exception:  # URLError, RuntimeError("...corrupted"), ...
            raise UserError(
                f"no {args.dataset} in {root}; it could not be "
                f"downloaded: put {cls.filename} or its "
                f"{cls.base_folder}/ there") from None
    dataset = cls(root, download=False, **split)  # outside the lock
    images = torch.as_tensor(dataset.data)
    if images.shape[-1] == 3:  # CIFAR is NHWC
        images = images.permute(0, 3, 1, 2)
    labels = dataset.labels if args.dataset == "stl10" else dataset.targets
    labels = torch.as_tensor(labels)[:limit].long().to(ctx.device)
    return images[:limit].contiguous().to(ctx.device), labels


def image_folder(args, ctx, size, mean, std, crops):
    """DATA_DIR/{train,val} as Data: held on the device, each file
    whole, or --stream: decoded by DataLoader workers each epoch."""
    folders = [os.path.join(args.data_dir, s) for s in ("train", "val")]
    try:  # no folder; no class folder, or one without images
        train = torchvision.datasets.ImageFolder(folders[0])
        val = torchvision.datasets.ImageFolder(folders[1])
    except (FileNotFoundError, RuntimeError) as error:
        raise UserError(
            f"imagefolder: {error}; --data-dir needs train/ and val/ "
            f"folders with one subfolder of images per class") from None
    classes = len(train.classes)
    only = sorted(set(train.classes) ^ set(val.classes))
    if only:
        more = " ..." if len(only) > 5 else ""
        raise UserError(
            f"imagefolder: train/ and val/ need the same class folders; "
            f"{', '.join(only[:5])}{more} only in one")
    train = train.samples  # (path, label), class by class
    val = val.samples
    limit = args.limit_train
    if limit and limit < len(train):  # spread over the classes
        train = [train[i * len(train) // limit] for i in range(limit)]
    labels = [torch.tensor([y for _, y in s], device=ctx.device)
              for s in (train, val)]
    if args.stream:
        return Data(ImageFiles(train, size, crops, args.crop_scale), labels[0],
                    ImageFiles(train, size), ImageFiles(val, size), classes,
                    size, mean, std, streaming=True)
    held = []  # (images, labels) per split, on every rank
    for samples, split_labels in zip((train, val), labels):
        loader = torch.utils.data.DataLoader(
            ImageFiles(samples), None, num_workers=args.workers)
        files = [x for x, _ in loader]
        sizes = sorted({f"{x.shape[2]}x{x.shape[1]}" for x in files})
        if len(sizes) > 1:
            folder = os.path.dirname(os.path.dirname(samples[0][0]))
            raise UserError(
                f"imagefolder: {folder} holds images of different sizes "
                f"({', '.join(sizes[:3])} px); add --stream")
        held.append((torch.stack(files).to(ctx.device), split_labels))
    return Data(*held[0], held[0], held[1], classes, size, mean, std,
                whole=True)


class ImageFiles(torch.utils.data.Dataset):
    """(path, label) list -> uint8 (3, S, S), eval_view's (no size: as
    decoded); `crops`: (crops, 3, S, S), flip + crop of the full image."""

    def __init__(self, samples, size=None, crops=0, scale=(0.08, 1.0)):
        self.samples = samples
        self.size = size
        self.crops = crops
        self.seed = 0  # the epoch's, set by train_batches
        if crops:
            crop = T.RandomResizedCrop(size, tuple(scale), antialias=True)
            self.random = T.Compose([T.RandomHorizontalFlip(), crop])

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        path, label = self.samples[i]
        try:
            with Image.open(path) as image:
                mode = image.mode
                image = image.convert("RGB")
        except Exception as error:  # OSError, SyntaxError, ValueError...
            raise UserError(
                f"unreadable image {path} ({type(error).__name__}); "
                f"remove or replace it") from None
        if mode[0] in "IF":  # I;16, I, F: convert("RGB") clipped them
            raise UserError(f"image {path} is {mode} (16-bit or float); "
                            f"convert it to 8 bits")
        image = TF.pil_to_tensor(image)
        if not self.crops and self.size is None:
            return image, label
        if not self.crops:
            return eval_view(image, self.size), label
        # (epoch seed, image) alone sets the crops: any rank, worker, resume.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed + i)
            views = [self.random(image) for _ in range(self.crops)]
        return torch.stack(views), label
