"""Shared infrastructure for the four method files; no loss, head or training step lives here.

Part 1, what the methods build on (read it next to a method file):
  processes and gathers    Context, gather(_with_grad), all_reduce_sum, GlobalBatchNorm, distribute
  ResNet                   torchvision's blocks and names at any width; CIFAR stem <= 64 px
  augmentation             Recipe, Augment (per-sample draws on the device), then its ops in order
  data order and batches   epoch_generators, train_batches
  evaluation               extract_features, knn_accuracy, the linear probes, OnlineProbe, evaluate
  optimisers               learning_rate, LARS, pretraining_optimizer
Part 2, plumbing that changes nothing a method computes:
  errors and command line  UserError, run, add_common_args, parse_args (a resume parses the recorded
                           command line again), setup
  epoch log and run folder EpochMeter, log_epoch, hold_run_folder (the lock), write_atomic,
                           start_run, save_checkpoint, load_checkpoint, finish
  data                     load_data, texture_images, torchvision_split, image_folder, ImageFiles
"""
import argparse
import contextlib
import fcntl
import io
import json
import math
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
# torchvision imports torch._dynamo, which, imported after init_process_group, keeps gloo's threads
# alive past destroy_process_group and can abort Python's exit (torch 2.14): here, before setup.
import torchvision
import torchvision.transforms.v2 as T
import torchvision.transforms.v2.functional as TF
from PIL import Image
from torchvision.transforms.functional import rgb_to_grayscale as grayscale  # takes batches too
from torchvision.models.resnet import BasicBlock, Bottleneck
from tqdm import tqdm


# ==================================================================================================
# Part 1: what the methods build on
# ==================================================================================================
# ---------------------------------------------------------------------------- processes and gathers
@dataclass
class Context:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    out: str
    amp: bool

    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp)

    def print(self, text, file=None):  # file: sys.stdout, or sys.stderr for warnings
        if self.rank == 0:
            tqdm.write(text, file=file)


def rank():
    return dist.get_rank() if dist.is_initialized() else 0


def world_size():
    return dist.get_world_size() if dist.is_initialized() else 1


class _GatherWithGrad(torch.autograd.Function):
    """dist.all_gather with a backward (it has none): my rows' gradient summed over all ranks."""

    @staticmethod
    def forward(ctx, x):
        return gather(x)

    @staticmethod
    def backward(ctx, grad):
        grad, rows = all_reduce_sum(grad.contiguous()), grad.shape[0] // world_size()
        return grad[rank() * rows:(rank() + 1) * rows]


def gather_with_grad(x):
    """(B, ...) on each rank -> (world * B, ...) in rank order, differentiable."""
    return _GatherWithGrad.apply(x) if world_size() > 1 else x


@torch.no_grad()
def gather(x):
    """(B, ...) on each rank -> (world * B, ...) in rank order, no gradient."""
    if world_size() == 1:
        return x
    out = x.new_empty((world_size() * x.shape[0],) + x.shape[1:])
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # < 2.14
    all_gather(out, x.contiguous())
    return out


def all_reduce_sum(x):
    if world_size() > 1:
        x = x.clone()
        dist.all_reduce(x)
    return x


class GlobalBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm over all ranks' rows (equal per rank): channel means and variances gathered with
    grad, no host sync (torch's SyncBatchNorm drops empty ranks with masks: 3 syncs a layer)."""

    def _check_input_dim(self, x):  # (B, C) and (B, C, H, W) alike
        pass

    def forward(self, x):
        if not self.training:
            return super().forward(x)
        x, shape = float32(x), [1, -1] + [1] * (x.dim() - 2)  # statistics in float32 at least
        var, mean = torch.var_mean(x, [d for d in range(x.dim()) if d != 1], correction=0)
        means, variances = gather_with_grad(torch.stack([mean, var])[None]).unbind(1)  # (world, C)
        mean = means.mean(0)
        var = (variances + (means - mean) ** 2).mean(0)  # the law of total variance
        n = x.numel() // x.shape[1] * len(means)  # the global batch's values per channel
        with torch.no_grad():
            self.running_mean.lerp_(mean, self.momentum)
            self.running_var.lerp_(var * n / (n - 1), self.momentum)  # unbiased, as torch's
            self.num_batches_tracked.add_(1)
        x = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        return x * self.weight.view(shape) + self.bias.view(shape) if self.affine else x


def sync_batchnorm(module, ctx):
    """Every BatchNorm of `module`, in place, a GlobalBatchNorm (with more than one process)."""
    for name, child in module.named_children() if ctx.world > 1 else ():
        if isinstance(child, nn.modules.batchnorm._BatchNorm):
            synced = GlobalBatchNorm(child.num_features, child.eps, child.momentum, child.affine)
            synced.load_state_dict(child.state_dict())
            setattr(module, name, synced.to(child.running_mean))
        else:
            sync_batchnorm(child, ctx)
    return module


def distribute(model, ctx):
    """-> the module to call; `model` itself stays bare (its state_dict has no 'module.' prefix)."""
    model = sync_batchnorm(model, ctx)
    if ctx.device.type == "cuda":
        model = model.to(memory_format=torch.channels_last)
    if ctx.world == 1:
        return model
    ddp = nn.parallel.DistributedDataParallel
    # torch 2.14 renamed broadcast_buffers (torch.__version__ compares as a version, not as text)
    sync = "forward_sync_buffers" if torch.__version__ >= "2.14" else "broadcast_buffers"
    return ddp(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
               **{sync: False})  # global BatchNorm keeps buffers equal: nothing to broadcast


def to_device(t, device):
    """CPU tensor -> `device` with no host sync (from pageable memory a copy waits for the GPU)."""
    return (t.pin_memory() if device.type == "cuda" else t).to(device, non_blocking=True)


def float32(t):
    """The loss's precision: bf16 outputs of autocast -> float32; float32 and float64 unchanged."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


# ------------------------------------------------------------------------------------------- ResNet
class ResNet(nn.Module):
    """ResNet-18/34/50, no classifier: (B, 3, S, S) -> (B, out_dim); torchvision's blocks and names
    at any `width` (at 64 its weights load, fc dropped). Up to 64 px the CIFAR stem, no max-pool
    (ImageNet's shrinks 32 px to 8); `stem_padding` 1 keeps 32 x 32, DT's and solo-learn's 2: 34."""
    LAYERS = {"resnet18": (BasicBlock, [2, 2, 2, 2]), "resnet34": (BasicBlock, [3, 4, 6, 3]),
              "resnet50": (Bottleneck, [3, 4, 6, 3])}

    def __init__(self, arch="resnet18", width=64, image_size=32, stem_padding=1,
                 zero_init_residual=False):
        super().__init__()
        block, blocks = self.LAYERS[arch]
        small = image_size <= 64
        stem = (3, 1, stem_padding) if small else (7, 2, 3)  # kernel, stride, padding
        self.conv1 = nn.Conv2d(3, width, *stem, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.maxpool = nn.Identity() if small else nn.MaxPool2d(3, 2, 1)
        c_in = width
        for i, n in enumerate(blocks):
            layer, c = [], width * 2 ** i
            for j in range(n):
                stride, c_out = 2 if i > 0 and j == 0 else 1, c * block.expansion
                shortcut = None if stride == 1 and c_in == c_out else nn.Sequential(
                    nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))
                layer.append(block(c_in, c, stride, shortcut))
                c_in = c_out
            setattr(self, f"layer{i + 1}", nn.Sequential(*layer))
        self.out_dim = c_in
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if zero_init_residual and isinstance(m, (BasicBlock, Bottleneck)):
                # each block starts as the identity (official SimSiam / GSG code)
                nn.init.zeros_(m.bn3.weight if isinstance(m, Bottleneck) else m.bn2.weight)

    def forward(self, x):
        x = self.maxpool(F.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)


# ------------------------------------------------------------------------------------- augmentation
@dataclass
class Recipe:  # one view's augmentation
    crop_scale: tuple = (0.08, 1.0)
    crop_ratio: tuple = (3 / 4, 4 / 3)
    flip_p: float = 0.5
    jitter: tuple = (0.4, 0.4, 0.4, 0.1)  # brightness, contrast, saturation, hue
    jitter_p: float = 0.8
    gray_p: float = 0.2
    blur_p: float = 0.0
    blur_sigma: tuple = (0.1, 2.0)
    solarize_p: float = 0.0


class Augment:
    """A Recipe per view on the device, parameters per sample (transforms.v2: one set per batch),
    drawn for the global batch alike on every rank, each keeping its rows: N processes as one."""

    def __init__(self, recipes, size, mean, std, ctx):
        self.recipes, self.size, self.ctx = recipes, size, ctx
        self.mean, self.std = (torch.tensor(t, device=ctx.device) for t in (mean, std))

    def __call__(self, x, generator):
        """uint8 (b, 3, H, W), or (b, V, 3, S, S) pre-cropped -> list of V normalised views."""
        return [self.view(x[:, v] if x.dim() == 5 else x, recipe, generator, crop=x.dim() == 4)
                for v, recipe in enumerate(self.recipes)]

    def view(self, image, r, generator, crop=True):
        b, start = image.shape[0], self.ctx.rank * image.shape[0]

        def rand(shape):  # uniforms for the global batch; this rank's rows
            shape = (b * self.ctx.world,) + ((shape,) if isinstance(shape, int) else shape)[1:]
            full = torch.rand(shape, generator=generator, device=generator.device)
            return full[start:start + b].to(self.ctx.device)

        def where(p, y, x):  # y for the samples drawn with probability p, else x
            return torch.where((rand(b) < p).view(-1, 1, 1, 1), y, x)

        x = image.float() / 255
        if crop:
            box = sample_crop_boxes(rand, b, x.shape[2], x.shape[3], r.crop_scale, r.crop_ratio)
            x = resized_crop_flip(x, *box, rand(b) < r.flip_p, self.size)
        if any(r.jitter):
            jitter = rand(b) < r.jitter_p  # drawn before the factors
            # U(max(0, 1 - s), 1 + s): torchvision's ColorJitter clips the range at 0
            factors = [max(0, 1 - s) + (1 + s - max(0, 1 - s)) * rand(b) for s in r.jitter[:3]]
            hue = r.jitter[3] * (2 * rand(b) - 1) if r.jitter[3] > 0 else None
            order = rand((b, 4)).argsort(1)  # per image, as transforms.py ColorJitter.get_params
            x = torch.where(jitter.view(-1, 1, 1, 1), colour_jitter(x, *factors, hue, order), x)
        if r.gray_p > 0:
            x = where(r.gray_p, grayscale(x).expand_as(x), x)
        if r.blur_p > 0:
            sigma = r.blur_sigma[0] + (r.blur_sigma[1] - r.blur_sigma[0]) * rand(b)
            kernel = (self.size // 10) | 1  # odd, about 10% of the image (SimCLR's 23 px at 224)
            x = where(r.blur_p, gaussian_blur(x, sigma, kernel), x)
        if r.solarize_p > 0:
            x = where(r.solarize_p, TF.solarize(x, 0.5), x)  # torchvision's, batched
        return normalize(x, self.mean, self.std)


def sample_crop_boxes(rand, n, height, width, scale, ratio, tries=10):
    """RandomResizedCrop's box sampler, batched -> top, left, h, w (n,): of `tries` draws of (area,
    log-ratio) the first that fits, else a centre crop, ratio clamped; rand(shape): U[0, 1)."""
    area = height * width * (scale[0] + (scale[1] - scale[0]) * rand((n, tries)))
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    aspect = torch.exp(log_lo + (log_hi - log_lo) * rand((n, tries)))
    w, h = torch.round(torch.sqrt(area * aspect)), torch.round(torch.sqrt(area / aspect))
    fits = (w > 0) & (h > 0) & (w <= width) & (h <= height)
    first = fits.float().argmax(1, keepdim=True)  # the first draw that fits
    w, h, found = w.gather(1, first)[:, 0], h.gather(1, first)[:, 0], fits.any(1)
    fh = round(width / ratio[0]) if width / height < ratio[0] else height
    fw = round(height * ratio[1]) if width / height > ratio[1] else width
    w, h = torch.where(found, w, float(fw)), torch.where(found, h, float(fh))
    u, v = rand((n,)), rand((n,))
    top = torch.where(found, torch.floor(u * (height - h + 1)), torch.floor((height - h) / 2))
    left = torch.where(found, torch.floor(v * (width - w + 1)), torch.floor((width - w) / 2))
    return top, left, h, w


def resized_crop_flip(x, top, left, h, w, flip, size):
    """Crop each box, resize it to `size` (no antialias), mirror where `flip`: one grid_sample."""
    B, _, H, W = x.shape
    zero = torch.zeros_like(w)
    theta = torch.stack([torch.where(flip, -w / W, w / W), zero, (2 * left + w) / W - 1,
                         zero, h / H, (2 * top + h) / H - 1], 1).view(B, 2, 3).to(x)
    grid = F.affine_grid(theta, (B, 3, size, size), align_corners=False)  # resized_crop's points
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)


def colour_jitter(x, brightness, contrast, saturation, hue=None, order=None):
    """torchvision's ColorJitter per image: factors (B,) and order (B, 4) of the ops 0 brightness,
    1 contrast, 2 saturation, 3 hue (order None: 0-3 for all; hue None: no hue), no host sync."""
    positions = torch.arange(4, device=x.device)
    order = positions.expand(len(x), 4) if order is None else order
    hue_at = (order == 3).int().argmax(1, keepdim=True)  # (B, 1) hue's position in the order
    before = torch.where(positions < hue_at, order, -1)[:, :3]  # (B, 3) ops before hue, -1: none
    after = torch.where(positions > hue_at, order, -1)[:, 1:]  # (B, 3) after it (none at 0)
    factors = torch.stack([brightness, contrast, saturation], 1)  # (B, 3)
    for op in before.unbind(1):
        x = blend_op(x, op, factors)
    x = x if hue is None else adjust_hue(x, hue)
    for op in after.unbind(1):
        x = blend_op(x, op, factors)
    return x


def blend_op(x, op, factors):
    """torchvision's _blend of image i's op[i] with 0 brightness: black, 1 contrast: mean grey,
    2 saturation: grey; -1 none."""
    grey, op = grayscale(x), op.view(-1, 1, 1, 1)  # (B, 1, H, W), (B, 1, 1, 1)
    other = torch.where(op == 0, 0.0, torch.where(op == 1, grey.mean((1, 2, 3), True), grey))
    factor = torch.where(op >= 0, factors.gather(1, op.view(-1, 1).clamp(min=0)).view_as(op), 1.0)
    return (factor * x + (1 - factor) * other).clamp(0, 1)


def adjust_hue(x, shift):
    """Hue turned `shift` (B,) turns via HSV, as torchvision: h6 in [0, 6) from the max's channel;
    to RGB, channel n = 5, 3, 1 is v - chroma * clamp(min(k, 4 - k), 0, 1), k = (n + h6) mod 6."""
    r, g, b = x.unbind(1)
    minimum, value = torch.aminmax(x, dim=1)  # (B, H, W) each
    chroma = value - minimum
    c = torch.where(chroma > 0, chroma, 1.0)
    hue = torch.where(value == r, g - b,  # 6 * hue * c; ties: red, then green, then blue
                      torch.where(value == g, b - r + 2 * c, r - g + 4 * c)) / c
    hue = (hue + 6 * shift.view(-1, 1, 1)).remainder(6)  # (B, H, W) rotated, in [0, 6)
    k = hue.unsqueeze(1) + torch.arange(5, 0, -2, device=x.device, dtype=x.dtype).view(1, 3, 1, 1)
    k = torch.where(k >= 6, k - 6, k)  # (B, 3, H, W)
    return value.unsqueeze(1) - chroma.unsqueeze(1) * torch.minimum(k, 4 - k).clamp(0, 1)


def gaussian_blur(x, sigma, kernel_size):
    """Per-sample sigma (B,), separable kernel, reflect padding (torchvision's gaussian_blur)."""
    B, C, H, W = x.shape
    radius = kernel_size // 2
    offsets = torch.arange(-radius, radius + 1, device=x.device, dtype=x.dtype)
    kernel = torch.exp(-0.5 * (offsets / sigma.view(-1, 1)) ** 2)
    kernel = (kernel / kernel.sum(1, keepdim=True)).repeat_interleave(C, 0)  # (B*C, K)
    y = F.pad(x.reshape(1, B * C, H, W), (radius,) * 4, mode="reflect")
    y = F.conv2d(y, kernel.view(B * C, 1, 1, -1), groups=B * C)  # horizontal pass
    y = F.conv2d(y, kernel.view(B * C, 1, -1, 1), groups=B * C)  # vertical pass
    return y.view(B, C, H, W)


def normalize(x, mean, std):
    """[0, 1] images (B, 3, H, W) -> normalised, channels_last on CUDA (the networks' layout)."""
    x = TF.normalize(x, mean, std)
    return x.contiguous(memory_format=torch.channels_last) if x.is_cuda else x


# --------------------------------------------------------------------------- data order and batches
def epoch_generators(seed, epoch, device):
    """(seed, epoch) -> this epoch's generators, so a resumed run draws as an uninterrupted one:
    order and pairings on the CPU (CUDA's random kernels differ by GPU), views on the device."""
    seed = 2 * (seed * 100003 + epoch)
    return torch.Generator().manual_seed(seed), torch.Generator(device).manual_seed(seed + 1)


def train_batches(data, batch_size, generator, ctx, workers=0):
    """One epoch's (images, labels) on the device: uint8 (b, 3, S, S), or (b, crops, 3, S, S) when
    streamed; rank r's rows [r*b, (r+1)*b) of each batch, in `generator`'s order (CPU, alike)."""
    b, steps = batch_size // ctx.world, len(data) // batch_size
    perm = torch.randperm(len(data), generator=generator)[:steps * batch_size]
    mine = perm.view(steps, ctx.world, b)[:, ctx.rank].flatten()  # (steps * b,)
    if not data.streaming:
        for rows in mine.to(ctx.device).view(steps, b):  # no batch at all when steps is 0
            yield data.train[rows], data.train_labels[rows]
        return
    data.train.seed = int(torch.randint(2 ** 62, (1,), generator=generator))  # this epoch's crops
    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(data.train, mine.tolist()), b,
                                         num_workers=workers, pin_memory=ctx.device.type == "cuda")
    for views, labels in loader:
        yield views.to(ctx.device, non_blocking=True), labels.to(ctx.device, non_blocking=True)


# --------------------------------------------------------------------------------------- evaluation
def eval_view(images, size):
    """uint8 (..., 3, H, W) -> (..., 3, S, S): torchvision's Resize(S / 0.875 above 64 px: 256 for
    224), CenterCrop(S)."""
    side = round(size / 0.875) if size > 64 else size
    return TF.center_crop(TF.resize(images, [side], antialias=True), [size])


@torch.no_grad()
def extract_features(backbone, split, data, ctx, workers=0, unit=True):
    """Features (L2-normalised if `unit`) of un-augmented images, ranks sharing the work, gathered
    on every rank -> float32 (N', F), (N',), N' = world * ceil(N / world), padding labelled -1."""
    was_training, device, held = backbone.training, ctx.device, isinstance(split, tuple)
    n = len(split[1]) if held else len(split)
    share = -(-n // ctx.world)
    lo, hi = min(ctx.rank * share, n), min((ctx.rank + 1) * share, n)
    batches = zip(*(t[lo:hi].split(256) for t in split)) if held else torch.utils.data.DataLoader(
        torch.utils.data.Subset(split, range(lo, hi)), 256, num_workers=workers,
        pin_memory=device.type == "cuda", generator=torch.Generator())  # (not the global RNG)
    features = torch.zeros(share, backbone.out_dim, device=device)
    labels = torch.full((share,), -1, dtype=torch.long, device=device)
    mean, std = (torch.tensor(t, device=device) for t in (data.mean, data.std))  # copied once
    backbone.eval()
    batches = tqdm(batches, "features", -(-(hi - lo) // 256), leave=False, disable=ctx.rank != 0)
    for i, (images, y) in enumerate(batches):  # batches of 256; pinned: copies without a wait
        images, y = images.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if data.whole and held:  # image files held whole: the view streamed
            images = eval_view(images, data.image_size)  # ones get from their workers
        with ctx.autocast():
            f = backbone(normalize(images.float() / 255, mean, std)).float()
        features[256 * i:256 * i + len(y)] = F.normalize(f, dim=1) if unit else f
        labels[256 * i:256 * i + len(y)] = y
    backbone.train(was_training)
    return gather(features), gather(labels)


@torch.no_grad()
def knn_accuracy(train_f, train_y, test_f, test_y, num_classes, k=200, t=0.1):
    """Weighted kNN (InstDisc, MoCo): the k nearest (cosine) vote exp(sim / t) -> top-1 %."""
    k, unlabelled = min(k, int((train_y >= 0).sum())), train_y < 0
    share = -(-len(test_y) // world_size())  # each rank's rows of the test set
    correct, lo, hi = torch.zeros((), device=test_f.device), rank() * share, (rank() + 1) * share
    for i in range(lo, min(hi, len(test_y)), 256):
        stop = min(i + 256, hi, len(test_y))
        sim = (test_f[i:stop] @ train_f.T).float().masked_fill_(unlabelled, -math.inf)  # (b, N)
        sim, idx = sim.topk(k, dim=1)  # (b, k)
        votes = torch.zeros(stop - i, num_classes, device=test_f.device)
        votes.scatter_add_(1, train_y[idx], torch.exp(sim / t))
        correct += (votes.argmax(1) == test_y[i:stop]).sum()
    return 100.0 * all_reduce_sum(correct).item() / int((test_y >= 0).sum())


def linear_classifier(dim, classes, device, seed, std=None):
    """nn.Linear(dim, classes): weight N(0, std), bias 0 (0.01: MoCo's, SimSiam's main_lincls.py) or
    torch's init (std None), from `seed` in a forked RNG: a global draw would shift later ones."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layer = nn.Linear(dim, classes)
        if std is not None:
            nn.init.normal_(layer.weight, 0.0, std), nn.init.zeros_(layer.bias)
    return layer.to(device)


LINEAR_PROTOCOLS = {  # --linear-protocol: the final probe's settings, lr per 256 images
    "fixed": dict(optimizer="adamw", lr=1e-3, epochs=100, batch=256),  # this project's own probe
    # GSG Sec. 5.1 "Linear evaluation" (CIFAR-10), momentum 0.9; assumed: crop+flip views, wd 0
    "gsg-cifar": dict(optimizer="sgd", lr=30.0, epochs=90, batch=256, schedule="cosine"),
    # facebookresearch/moco main_lincls.py: --lr 30, -b 256, --epochs 100, --schedule 60 80, wd 0
    "moco": dict(optimizer="sgd", lr=30.0, epochs=100, batch=256, schedule="steps"),
    # facebookresearch/simsiam main_lincls.py --lars (as bych-lee/gsg): apex LARC, no clip, bias too
    "simsiam-imagenet": dict(optimizer="lars", lr=0.1, epochs=90, batch=4096, schedule="cosine"),
}


def train_linear(classifier, optimizer, batches, epochs, lr=None, scheduler=None, world=1):
    """The probes' loop: per epoch, lr(epoch) and cross-entropy steps on batches(epoch)."""
    for epoch in tqdm(range(epochs), "linear probe", leave=False, disable=rank() != 0):
        for group in optimizer.param_groups if lr else ():
            group["lr"] = lr(epoch)
        for features, y in batches(epoch):
            loss = F.cross_entropy(classifier(features), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            for p in classifier.parameters() if world > 1 else ():
                p.grad = all_reduce_sum(p.grad) / world
            optimizer.step()
            if scheduler:
                scheduler.step()


@torch.no_grad()
def top1(classify, features, labels):
    """Top-1 % of classify(features) over the labelled rows (-1: padding), 65536 rows at a time."""
    correct = sum(int((classify(f).argmax(1) == y).sum())
                  for f, y in zip(features.split(65536), labels.split(65536)))
    return 100.0 * correct / int((labels >= 0).sum())


def linear_probe(train_f, train_y, test_f, test_y, num_classes, epochs, lr, batch, seed=0):
    """`fixed` protocol: a linear classifier from zero (convex), AdamW + cosine -> test top-1 %."""
    rows = (train_y >= 0).nonzero()[:, 0]
    std, mean = torch.std_mean(train_f[rows], 0, correction=0)
    standardised = lambda f: (f - mean) / (std + 1e-6)  # noqa: E731
    classifier = linear_classifier(train_f.shape[1], num_classes, train_f.device, seed, std=0.0)
    optimizer = torch.optim.AdamW(classifier.parameters(), lr=lr * batch / 256, weight_decay=5e-4)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, epochs * -(-len(rows) // batch))
    generator = torch.Generator(device=train_f.device).manual_seed(seed)

    def batches(epoch):
        perm = rows[torch.randperm(len(rows), generator=generator, device=rows.device)]
        return ((standardised(train_f[r]), train_y[r]) for r in perm.split(batch))
    train_linear(classifier, optimizer, batches, epochs, scheduler=cosine)  # alike on every rank
    return top1(lambda f: classifier(standardised(f)), test_f, test_y)


def linear_probe_augmented(backbone, data, ctx, protocol, epochs, lr, batch, seed=0, workers=0):
    """An authors' probe (LINEAR_PROTOCOLS) on the frozen backbone, crop + flip views -> top-1 %."""
    own = LINEAR_PROTOCOLS[protocol]
    images, labels = data.eval_train if not data.streaming else (  # streamed: workers crop + flip
        ImageFiles(data.eval_train.samples, data.image_size, crops=1), data.train_labels)
    probe_set = replace(data, train=images, train_labels=labels)  # drawn as pre-training's batches
    batch = max(1, min(batch, len(labels)) // ctx.world) * ctx.world  # a multiple of the processes
    peak = lr * batch / 256
    classifier = linear_classifier(backbone.out_dim, data.num_classes, ctx.device, seed, std=0.01)
    optimizer = LARS(classifier.parameters(), peak, momentum=0.9, eta=0.001) \
        if own["optimizer"] == "lars" else torch.optim.SGD(classifier.parameters(), peak, 0.9)
    augment = Augment([Recipe(jitter=(0, 0, 0, 0), gray_p=0)], data.image_size, data.mean,
                      data.std, ctx)  # held images: crop + flip here; streamed: normalise only

    def lr_at(epoch):  # per epoch, as main_lincls.py's adjust_learning_rate; MoCo's steps: x0.1
        if own["schedule"] == "cosine":  # at epochs 60 and 80 of 100, here at 60% and 80% of them
            return peak * 0.5 * (1 + math.cos(math.pi * epoch / epochs))
        return peak * 0.1 ** sum(epoch >= share * epochs for share in (0.6, 0.8))

    def batches(epoch):
        order, generator = epoch_generators(seed + 1, epoch, ctx.device)
        for x, y in train_batches(probe_set, batch, order, ctx, workers):
            views = augment(x, generator)[0]  # in float32, as in pre-training
            with torch.no_grad(), ctx.autocast():
                features = backbone(views)
            yield features.float(), y
    was_training = backbone.training
    backbone.eval()  # frozen: BatchNorm normalises with, and keeps, its running statistics
    train_linear(classifier, optimizer, batches, epochs, lr=lr_at, world=ctx.world)
    test_f, test_y = extract_features(backbone.train(was_training), data.eval_test, data, ctx,
                                      workers, unit=False)
    return top1(lambda f: classifier(f.float()), test_f, test_y)  # float32, as in training


class OnlineProbe:
    """The DT authors' online classifier (ChaoningZhang/Dual-temperature solo/methods/base.py lines
    246, 335-343, 424-447) on training views' detached features, which `keep` collects as a forward
    hook on `backbone` that main() registers (their lines 475, 482 read the same features),
    SGD momentum 0.9 (solo/args/utils.py line 204), no weight decay, lr 0.3 not scaled by the batch
    (bash_files/*.sh --classifier_lr; utils.py line 212 scales only --lr); its result is `name`."""

    def __init__(self, backbone, num_classes, ctx, seed, name="online_top1", lr=0.3):
        self.backbone, self.name, self.lr, self.features = backbone, name, lr, []
        self.classifier = linear_classifier(backbone.out_dim, num_classes, ctx.device, seed)
        self.optimizer = torch.optim.SGD(self.classifier.parameters(), lr=lr, momentum=0.9)

    def keep(self, backbone, inputs, output):
        if backbone.training:  # not evaluation's
            self.features.append(output.detach())

    def step(self, labels, lr_scale):
        """SGD step on the kept views, labels (b,) per view; lr_scale: pre-training lr / peak."""
        features, self.features = float32(torch.cat(self.features)), []  # (V * b, F)
        y = labels.repeat(len(features) // len(labels))  # (V * b,)
        labelled = all_reduce_sum((y >= 0).sum()).clamp_min(1)  # over every rank's views
        loss = F.cross_entropy(self.classifier(features), y, ignore_index=-1, reduction="sum")
        self.optimizer.zero_grad(set_to_none=True)
        (loss / labelled).backward()
        for p in self.classifier.parameters():  # each rank's share of the global mean
            p.grad = all_reduce_sum(p.grad)
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr * lr_scale
        self.optimizer.step()

    def accuracy(self, data, ctx, workers=0):
        """Top-1 % on the un-augmented test split, the backbone in eval mode (the DT fork's)."""
        f, y = extract_features(self.backbone, data.eval_test, data, ctx, workers, unit=False)
        return top1(lambda x: self.classifier(float32(x)), f, y)

    def state_dict(self):  # for checkpoint.pt
        return dict(classifier=self.classifier.state_dict(), optimizer=self.optimizer.state_dict())

    def load_state_dict(self, state):
        self.classifier.load_state_dict(state["classifier"])
        self.optimizer.load_state_dict(state["optimizer"])


def online_probes(args, data, ctx, backbone, momentum_encoder=None):
    """--online-probe's OnlineProbes by checkpoint name ({} without it): on `backbone`, and on a
    momentum encoder's as the DT scripts' --momentum_classifier (base.py lines 631-635, 768-782)."""
    if not args.online_probe:
        return {}
    probes = {"online_probe": OnlineProbe(backbone, data.num_classes, ctx, args.seed)}
    if momentum_encoder is not None:
        probes["momentum_probe"] = OnlineProbe(momentum_encoder.backbone, data.num_classes, ctx,
                                               args.seed, "momentum_online_top1")
    return probes


def evaluate(backbone, data, ctx, args, final=False, probes=None):
    """kNN top-1 (--knn-k) and each probe's; `final` adds k=1 and the linear probe (--linear-*)."""
    train_f, train_y = extract_features(backbone, data.eval_train, data, ctx, args.workers)
    test_f, test_y = extract_features(backbone, data.eval_test, data, ctx, args.workers)
    knn = lambda k: knn_accuracy(train_f, train_y, test_f, test_y, data.num_classes, k,  # noqa
                                 args.knn_t)
    result = {"knn_top1": knn(args.knn_k)}
    for probe in (probes or {}).values():
        result[probe.name] = probe.accuracy(data, ctx, args.workers)
    if final:  # the method: the script and the options that choose it
        flags = [f"--{k} {getattr(args, k)}" for k in ("loss", "method", "stopgrad")
                 if hasattr(args, k)]
        result = {"method": " ".join([f"{RUN['script']}.py", *flags]), **result,
                  "knn_k": args.knn_k, "knn_k1_top1": knn(1), "epochs": args.epochs}
        protocol, given = args.linear_protocol, dict(epochs=args.linear_epochs, lr=args.linear_lr,
                                                     batch=args.linear_batch)
        settings = {k: LINEAR_PROTOCOLS[protocol][k] if v is None else v for k, v in given.items()}
        if settings["epochs"]:
            linear = (linear_probe(train_f, train_y, test_f, test_y, data.num_classes,
                                   seed=args.seed, **settings) if protocol == "fixed" else
                      linear_probe_augmented(backbone, data, ctx, protocol, seed=args.seed,
                                             workers=args.workers, **settings))
            result.update(linear_top1=linear, linear_protocol=protocol)
    return result


# --------------------------------------------------------------------------------------- optimisers
def learning_rate(step, total_steps, warmup_steps, peak, schedule="cosine"):
    """Linear warm-up to `peak`, then cosine decay to 0 (or constant)."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    if schedule == "constant":
        return peak
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


class LARS(torch.optim.Optimizer):
    """SGD with momentum and LARS's trust ratio (You et al. 2017) per tensor; adapt=False: r = 1.
        g' = g + wd * w,   r = eta * ||w|| / ||g'||   (r = 1 where ||w|| or ||g'|| is 0)
        with `clip`: r = min(r / lr, 1),   buf <- momentum * buf + r * g',   w <- w - lr * buf
    r as google-research/simclr lars_optimizer.py lines 98-110 (eta 0.001: its line 26; solo-learn's
    lars.py line 142 divides by ||g|| + wd ||w||); clip and momentum as its lines 145-165."""

    def __init__(self, params, lr, momentum=0.9, weight_decay=0.0, eta=0.001, clip=False):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                                      eta=eta, clip=clip, adapt=True))

    @torch.no_grad()
    def step(self):  # each group's tensors at once (torch._foreach_*), nothing read on the host
        for group in self.param_groups:
            params = [w for w in group["params"] if w.grad is not None]
            for w in params:  # made once, at the first step
                if "momentum_buffer" not in self.state[w]:
                    self.state[w]["momentum_buffer"] = torch.zeros_like(w)
            if not params:
                continue
            g = torch._foreach_add([w.grad for w in params], params, alpha=group["weight_decay"])
            if group["adapt"]:
                w_norm, g_norm = (torch.stack(torch._foreach_norm(t)) for t in (params, g))
                trust = group["eta"] * w_norm / g_norm
                trust = (trust / group["lr"]).clamp(max=1) if group["clip"] else trust
                torch._foreach_mul_(g, torch.where((w_norm > 0) & (g_norm > 0), trust, 1).unbind())
            buffers = [self.state[w]["momentum_buffer"] for w in params]
            torch._foreach_mul_(buffers, group["momentum"])
            torch._foreach_add_(buffers, g)
            torch._foreach_add_(params, buffers, alpha=-group["lr"])


def optimizer_groups(groups):
    """Parameters (or group dicts) -> LARS's param groups: 1-D ones (batch norm, bias) apart, no wd
    or trust ratio (SimCLR's tf2/model.py lines 40-42, solo-learn's lars.py line 140)."""
    groups, split = list(groups), []
    for group in groups if isinstance(groups[0], dict) else [{"params": groups}]:
        params = list(group["params"])
        split.append({**group, "params": [p for p in params if p.ndim > 1]})
        split.append({**group, "params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0,
                      "adapt": False})
    return [group for group in split if group["params"]]


def pretraining_optimizer(groups, args, ctx, lr):
    """--optimizer: SGD, momentum 0.9, wd on every parameter (the authors' SGD runs), or LARS."""
    if args.optimizer == "lars":
        return LARS(optimizer_groups(groups), lr, 0.9, args.wd, args.lars_eta, args.lars_clip)
    return torch.optim.SGD(groups, lr=lr, momentum=0.9, weight_decay=args.wd)


# ==================================================================================================
# Part 2: plumbing that changes nothing a method computes
# =============================================================================
# ----------------------------------------------------- errors and command line
class UserError(Exception):
    """A problem the user can fix: one line, exit status 2, no traceback."""


RUN = {"out": None, "argv": None, "script": None, "metrics": []}  # this run


def run(main):
    """main(); a UserError or OSError: one `error:` line, exit 2;
    Ctrl-C: a --resume line, exit 130."""
    rank = int(os.environ.get("RANK", 0))  # before any process group
    try:
        main()
    except (UserError, OSError, KeyboardInterrupt) as error:
        for bar in list(tqdm._instances):  # an interrupted epoch's bar
            bar.close()
        if isinstance(error, KeyboardInterrupt):
            if rank == 0:
                print(f"interrupted; continue with --resume {RUN['out']}",
                      file=sys.stderr)
            sys.exit(130)
        if rank != 0:
            # Rank 0 speaks for all and torchrun stops the rest; a rank
            # alone in its error speaks after the wait.
            time.sleep(10)
        # From a DataLoader worker, the message is its traceback.
        message = str(error).strip().splitlines()[-1].split("UserError: ")[-1]
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
    a("--crop-scale", type=float, nargs=2, metavar=("MIN", "MAX"),
      help="random crop's area range")
    a("--out", help="run folder (default runs/<script>-<time>-<process id>)")
    a("--resume", metavar="RUN",
      help="continue RUN bit-for-bit, or evaluate a finished RUN again")
    a("--stop-after", type=positive_int,
      help="end after that many epochs in all (then --resume)")
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
      help="torch.compile the model")


# What --resume may change; the rest comes from the recorded line.
RESUMABLE = set("resume device data_dir workers stop_after eval_every "
                "compile amp knn_k knn_t linear_protocol linear_epochs "
                "linear_lr linear_batch".split())


def parse_args(parser, argv, script):
    """A new run's options (--out: a fresh folder); --resume RUN: its
    recorded command line, then this one (RESUMABLE options only)."""
    # Checked even if the command line gives one: the file is at fault.
    unset = [k for k in METHOD_DEFAULTS if parser.get_default(k) is None]
    if unset:
        raise UserError(
            f"{script}.py sets no default for {', '.join(unset)}: give "
            f"each in its parser.set_defaults(...)")
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    args = parse(parser, argv)
    RUN["script"] = script
    if args.resume is None:
        # The process id keeps apart runs started in one second.
        name = f"{script}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        args.out = args.out or os.path.join("runs", name)
        RUN.update(out=args.out, argv=argv, metrics=[])
        return args
    folder = args.resume  # or RUN/checkpoint.pt
    if folder.endswith(".pt"):
        folder = os.path.dirname(folder)
    path = os.path.join(folder, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
        if config["script"] != script:
            raise UserError(
                f"--resume {folder}: that run was made by "
                f"{config['script']}.py, not {script}.py; start a new --out")
        recorded = [str(a) for a in config["argv"]]
        saved = dict(config["args"])
    except (OSError, ValueError, TypeError, KeyError):
        # ValueError: not JSON, or not UTF-8; the others: not a config.
        raise UserError(
            f"--resume {folder}: no readable config.json with its command "
            f"line there; give a run folder of this project") from None
    then = vars(parse(parser, recorded, path))
    args = parse(parser, recorded + argv, path)
    for key, value in vars(args).items():
        if key in RESUMABLE or key == "out":
            continue
        option = "--" + key.replace("_", "-")
        value = json.loads(json.dumps(value))  # (json: tuples as lists)
        if value != json.loads(json.dumps(then[key])):
            raise UserError(
                f"run {folder} was trained with {option} {then[key]}, not "
                f"{value}; drop that option to continue it, or start a "
                f"new --out")
        # None: set later (the image size).
        if value is None or value == saved.get(key, "missing"):
            continue
        was = json.dumps(saved[key]) if key in saved else "missing"
        raise UserError(
            f"{path}: {option} is {was}, which the command line reads as "
            f"{json.dumps(value)}; start a new --out")
    args.out = RUN["out"] = folder
    return args


def parse(parser, argv, path=None):
    """Parse argv, crop scale checked; with `path`, a failure is one line."""
    def refuse(message):
        raise UserError(f"{path}: its command line fails the check "
                        f"({message}); start a new --out")
    if path:  # (parse_args builds its parser anew)
        parser.error = refuse
    args = parser.parse_args(argv)
    scale = args.crop_scale
    if scale and not 0 < scale[0] <= scale[1] <= 1:
        raise UserError(f"--crop-scale {' '.join(map(str, scale))}: need "
                        f"0 < MIN <= MAX <= 1")
    return args


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
        self.epoch = epoch
        self.images_per_step = images_per_step
        self.every = min(20, max(1, steps // 20))
        self.sums = {}
        self.steps = 0
        self.lr = 0.0
        self.bar = tqdm(total=steps, desc=f"epoch {epoch + 1}/{epochs}", leave=False,
                        disable=ctx.rank != 0, dynamic_ncols=True)
        self.start = self.last = time.perf_counter()

    def update(self, lr, **scalars):
        self.steps += 1
        self.lr = lr
        for name, value in scalars.items():  # summed on the device
            self.sums[name] = self.sums.get(name, 0) + value.detach().float()
        if self.steps % self.every:
            return
        now = time.perf_counter()
        loss = self.sums["loss"].item() / self.steps
        rate = self.every * self.images_per_step / (now - self.last)
        self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.4g}", img_s=f"{rate:.0f}")
        self.bar.update(self.every)
        self.last = now

    def summary(self):
        self.bar.close()
        rows = self.steps * self.world
        # .item() waits for the device: the clock reads a finished epoch.
        means = {name: all_reduce_sum(total).item() / rows
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


def log_epoch(ctx, record):
    """The epoch's line into RUN's metrics, metrics.jsonl, stdout."""
    RUN["metrics"].append(record)
    if ctx.rank != 0:
        return
    # All lines: a resume's are the checkpoint's (a later one goes).
    lines = "".join(json.dumps(r) + "\n" for r in RUN["metrics"])
    write_atomic(os.path.join(ctx.out, "metrics.jsonl"), lines.encode())
    ctx.print(one_line(record, ".4g"))


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


def start_run(args, ctx, data, backbone):
    """Say what runs where; a new run takes its folder (the lock), writes
    config.json. Called when all is ready: a failed start leaves none."""
    where = "generated" if args.dataset == "textures" else args.data_dir
    held = "streamed" if data.streaming else "held"
    val = data.eval_test if data.streaming else data.eval_test[1]
    size = sum(p.numel() for p in backbone.parameters())
    ctx.print(
        f"run {ctx.out}  data {args.dataset} ({where}, {held})  train "
        f"{len(data)}  val {len(val)}  classes {data.num_classes}  image "
        f"{data.image_size} px  device {ctx.device}  processes {ctx.world}"
        f"  backbone {args.arch} width {args.width}: {size:,} parameters")
    if 0 < args.epochs <= args.warmup_epochs:
        # The lr ends at epochs / warm-up of its peak.
        ctx.print(f"warning: --epochs {args.epochs} is not more than "
                  f"--warmup-epochs {args.warmup_epochs}: the learning "
                  f"rate never reaches its peak", sys.stderr)
    if ctx.rank != 0 or args.resume:
        return
    os.makedirs(ctx.out, exist_ok=True)
    # No other run can begin here now; one stopped in epoch 1 restarts.
    hold_run_folder(ctx.out)
    for name in ("checkpoint.pt", "results.json"):
        if os.path.exists(os.path.join(ctx.out, name)):
            raise UserError(
                f"--out {ctx.out} already holds a run: continue it with "
                f"--resume {ctx.out}, or choose another --out")
    # An --epochs 0 run's stays empty.
    write_atomic(os.path.join(ctx.out, "metrics.jsonl"), b"")
    here = os.path.dirname(os.path.abspath(__file__))
    git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here,
                         capture_output=True, text=True)
    versions = dict(python=sys.version.split()[0], torch=torch.__version__,
                    git_commit=git.stdout.strip() or None)
    config = dict(script=RUN["script"], argv=RUN["argv"], args=vars(args),
                  world_size=ctx.world, versions=versions)
    write_atomic(os.path.join(ctx.out, "config.json"),
                 json.dumps(config, indent=2).encode())


def save_checkpoint(ctx, epoch, states):
    """checkpoint.pt: the epochs done, metrics' lines, state_dicts."""
    if ctx.rank != 0:
        return
    saved = {name: state.state_dict() for name, state in states.items()
             if state is not None}  # None: a part this model lacks
    checkpoint = {"epoch": epoch, "metrics": RUN["metrics"], **saved}
    write_atomic(os.path.join(ctx.out, "checkpoint.pt"), checkpoint)


def load_checkpoint(ctx, states):
    """Take the run folder (its lock), load checkpoint.pt -> epochs."""
    if ctx.rank == 0:
        hold_run_folder(ctx.out)
    path = os.path.join(ctx.out, "checkpoint.pt")
    states = {k: s for k, s in states.items() if s is not None}
    try:
        # Missing (epoch 1 never ended), truncated, not a dict, ...
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
        saved = checkpoint.keys() - {"epoch", "metrics"}
        missing = ", ".join(sorted(states.keys() - saved)) or "none"
        left_over = ", ".join(sorted(saved - states.keys())) or "none"
        if saved != states.keys():  # named: not a KeyError, nor unsaid
            raise UserError(
                f"{path} does not fit this run (states missing: "
                f"{missing}; left over: {left_over}); start a new --out")
        for name, state in states.items():
            state.load_state_dict(checkpoint[name])
        epoch = int(checkpoint["epoch"])
        RUN["metrics"] = checkpoint["metrics"]
    except UserError:
        raise
    except Exception as error:
        why = " ".join(str(error).split())[:120]
        raise UserError(
            f"{path} does not fit this run or is unreadable "
            f"({type(error).__name__}: {why}); start a new --out") from None
    ctx.print(f"resumed {ctx.out} at epoch {epoch}")
    return epoch


def finish(ctx, backbone, results):
    """backbone.pt (torchvision's names); results.json, or eval-<time>.json."""
    if ctx.rank != 0:
        return
    path = os.path.join(ctx.out, "results.json")
    if os.path.exists(path):  # evaluated again
        name = f"eval-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.json"
        path = os.path.join(ctx.out, name)
    weights = os.path.join(ctx.out, "backbone.pt")
    if not os.path.exists(weights):  # first finish, or deleted
        state = backbone.state_dict()
        write_atomic(weights, {k: v.cpu() for k, v in state.items()})
    write_atomic(path, json.dumps(results, indent=2).encode())
    lock = LOCKS.pop(os.path.realpath(ctx.out), None)
    if lock:
        lock.close()  # which drops its flock
    ctx.print(f"final: {one_line(results, '.2f')}\nwritten to {path}")


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
    """--dataset as Data; `crops`: random crops per streamed image."""
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
