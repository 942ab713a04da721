"""Shared infrastructure for the method files; no algorithm lives here.

Distributed setup and an autograd-aware all-gather, ResNets with a small-image stem, datasets held
on the device (or streamed for large image folders), batched per-sample augmentation, kNN and
linear evaluation, the learning-rate schedule, the run folder and exact checkpoints.
Losses, heads, EMA updates, queues and training steps live in the method files.
"""
import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm


class UserError(Exception):
    """A problem the user can fix: printed as one line, exit status 2, no traceback."""


def run(main):
    """Call `main()`; turn a UserError into one line on stderr and a non-zero exit."""
    try:
        main()
    except UserError as error:
        rank = int(os.environ.get("RANK", 0))
        if rank != 0:
            # Rank 0 says it. torchrun stops every worker as soon as one exits, so the others wait a
            # moment (and are usually stopped) instead of racing rank 0's message; an error that only
            # this rank hit is still printed.
            time.sleep(1)
        print(f"error: {error}" if rank == 0 else f"error (rank {rank}): {error}", file=sys.stderr, flush=True)
        sys.exit(2)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# ------------------------------------------------------------------------------ command line

def positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def positive_float(text):
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def non_negative_int(text):
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or a positive integer, got {text}")
    return value


def momentum_value(text):
    """An EMA momentum m in [0, 1): target <- m * target + (1 - m) * online."""
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help keeps the usage docstring's layout and shows every default."""


def add_common_args(parser):
    """The options every script shares ; method files set their own defaults."""
    a = parser.add_argument
    a("--dataset", choices=["cifar10", "cifar100", "stl10", "imagefolder"], default="cifar10",
      help="training data; imagefolder reads DATA_DIR/train/<class>/* and DATA_DIR/val/<class>/*")
    a("--data-dir", default="./data", help="where the dataset lives (CIFAR/STL are downloaded here)")
    a("--image-size", type=positive_int, default=None,
      help="side of the square training images (default: 32 CIFAR, 96 STL-10, 224 imagefolder)")
    a("--stream", action="store_true",
      help="imagefolder: decode images in DataLoader workers every epoch instead of once onto the "
           "device (automatic when the decoded set would exceed 16 GB)")
    a("--crop-scale", type=float, nargs=2, default=(0.08, 1.0), metavar=("MIN", "MAX"),
      help="area range of the random resized crop")
    a("--workers", type=int, default=min(8, os.cpu_count() or 1), help="DataLoader workers for decoding")
    a("--arch", choices=["resnet18", "resnet34", "resnet50"], default="resnet18", help="backbone")
    a("--width", type=positive_int, default=64, help="base channel count (64 = standard ResNet)")
    a("--epochs", type=non_negative_int, default=200,
      help="pre-training epochs (0: evaluate the untrained network)")
    a("--batch-size", type=positive_int, default=256, help="global batch, split evenly across ranks")
    a("--lr", type=positive_float, default=0.06, help="base learning rate per 256 images (lr = LR * batch / 256)")
    a("--wd", type=float, default=5e-4, help="weight decay")
    a("--warmup-epochs", type=int, default=10, help="linear learning-rate warm-up epochs")
    a("--out", default=None, help="run folder (default runs/<script>-<time>)")
    a("--resume", default=None, help="run folder or checkpoint.pt to continue bit-for-bit")
    a("--stop-after", type=positive_int, default=None,
      help="end this process after that many epochs in total, keeping the checkpoint (continue with --resume)")
    a("--eval-every", type=positive_int, default=10, help="kNN monitor every N epochs (and at the last)")
    a("--knn-k", type=positive_int, default=200, help="neighbours of the kNN monitor")
    a("--knn-t", type=positive_float, default=0.1, help="temperature of the weighted kNN vote")
    a("--linear-epochs", type=int, default=100, help="epochs of the final linear probe (0 skips it)")
    a("--linear-aug", action="store_true",
      help="train the linear probe on crop+flip augmented images (slower) instead of fixed features")
    a("--limit-train", type=positive_int, default=None, help="use only the first N training images")
    a("--seed", type=int, default=0, help="random seed (model init, data order, augmentation)")
    a("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu")
    a("--amp", action=argparse.BooleanOptionalAction, default=True, help="bf16 autocast on CUDA")
    a("--compile", action="store_true", help="torch.compile the model")


# Options that may differ between a run and its --resume; everything else must match the checkpoint.
RESUMABLE = {"resume", "out", "device", "data_dir", "workers", "stop_after", "eval_every", "compile",
             "amp", "knn_k", "knn_t", "linear_epochs", "linear_aug"}


def parse_args(parser, argv=None):
    """Parse; with --resume, take the checkpoint's arguments and refuse conflicting ones."""
    args = parser.parse_args(argv)
    args.checkpoint = None
    if args.resume is None:
        return args
    path = args.resume
    if os.path.isdir(path):
        path = os.path.join(path, "checkpoint.pt")
    if not os.path.isfile(path):
        raise UserError(f"--resume {args.resume}: no checkpoint.pt there; give a run folder of this project")
    checkpoint = load_checkpoint(path)
    saved = checkpoint["args"]
    # Which options were typed on the command line: argparse fills in a default only where the
    # namespace lacks the attribute, so a namespace pre-filled with a sentinel keeps just the typed ones.
    unset = object()
    probe = argparse.Namespace(**{action.dest: unset for action in parser._actions})
    typed = {k: v for k, v in vars(parser.parse_args(argv, probe)).items() if v is not unset}
    for key, value in typed.items():
        if key not in RESUMABLE and key in saved and saved[key] != value:
            raise UserError(f"checkpoint {path} was trained with --{key.replace('_', '-')} {saved[key]}, "
                            f"not {value}; drop that option to continue the run, or start a new --out")
    merged = vars(args)  # defaults only for options newer than the checkpoint
    merged.update(saved)
    merged.update({k: v for k, v in typed.items() if k in RESUMABLE})
    if "out" not in typed:
        merged["out"] = os.path.dirname(os.path.abspath(path))
    args = argparse.Namespace(**merged)
    args.checkpoint = checkpoint
    return args


# ------------------------------------------------------------------------------ distributed

@dataclass
class Context:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    out: str
    amp: bool
    script: str = ""
    is_main: bool = field(init=False)

    def __post_init__(self):
        self.is_main = self.rank == 0

    def autocast(self):
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.amp)

    def print(self, *text):
        if self.is_main:
            tqdm.write(" ".join(str(t) for t in text))


def setup(args, script):
    """Process group from torchrun's environment (world of one without it), device, seed, run folder."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError("--device cuda but no CUDA GPU is visible; use --device cpu")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True
    elif device.type != "cpu":
        raise UserError(f"--device {args.device}: use cuda or cpu")
    if args.checkpoint is not None and args.checkpoint.get("script", script) != script:
        raise UserError(f"--resume {args.resume}: that run was made by {args.checkpoint['script']}.py, "
                        f"not {script}.py; start a new --out")
    if args.batch_size % world or args.batch_size // world < 2:
        raise UserError(f"--batch-size {args.batch_size} must be a multiple of the {world} processes "
                        f"with at least 2 images per process")
    if world > 1 and not dist.is_initialized():
        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    torch.manual_seed(args.seed)  # the same initial model on every rank
    out = args.out or os.path.join("runs", f"{script}-{time.strftime('%Y%m%d-%H%M%S')}")
    args.out = out
    ctx = Context(rank, world, local_rank, device, out, amp=args.amp and device.type == "cuda", script=script)
    if ctx.is_main:
        os.makedirs(out, exist_ok=True)
        config = {k: v for k, v in vars(args).items() if k != "checkpoint"}
        config["world_size"] = world
        config["command"] = sys.argv
        config["versions"] = {"python": platform.python_version(), "torch": torch.__version__,
                              "torchvision": _torchvision_version(), "git_commit": _git_commit()}
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
    return ctx


def _torchvision_version():
    import torchvision
    return torchvision.__version__


def _git_commit():
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True,
                              text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def rank():
    return dist.get_rank() if dist.is_initialized() else 0


def world_size():
    return dist.get_world_size() if dist.is_initialized() else 1


class _GatherWithGrad(torch.autograd.Function):
    """all_gather whose backward hands each rank the gradient of its own rows.

    Every rank's loss uses every rank's rows, so the gradient of the global loss with respect to
    my rows is the sum, over ranks, of their losses' gradients with respect to my rows: hence the
    all_reduce(SUM) in backward before taking my slice. (Plain dist.all_gather has no backward,
    so the negatives from other ranks would silently get no gradient.)
    """

    @staticmethod
    def forward(ctx, x):
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad)
        rows = grad.shape[0] // dist.get_world_size()
        start = dist.get_rank() * rows
        return grad[start:start + rows]


def gather_with_grad(x):
    """(B, ...) on each rank -> (world * B, ...) in rank order, differentiable."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return x
    return _GatherWithGrad.apply(x)


@torch.no_grad()
def gather(x):
    """(B, ...) on each rank -> (world * B, ...) in rank order, no gradient."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts)


def all_reduce_sum(x):
    if dist.is_initialized() and dist.get_world_size() > 1:
        x = x.clone()
        dist.all_reduce(x)
    return x


def float32(t):
    """The loss's precision: bf16 outputs of autocast -> float32; float32 and float64 unchanged."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def logsumexp_rows(logits, bound):
    """log sum_j exp(logits_..j) over the last dim -> (..., R), for logits <= `bound` (unit vectors: 1/tau).

    Shifting by the known bound instead of each row's maximum saves torch.logsumexp's max pass and
    half of its backward passes over the (R, C) matrix. Overwrites `logits` (a fresh matmul output:
    the matmul saved its inputs, not it). Exact unless a whole row lies 80 below the bound, which
    logits >= -bound rule out for bound <= 40; larger bounds (tau < 0.025) take torch.logsumexp.
    """
    if bound > 40:
        return torch.logsumexp(logits, -1)
    return torch.exp(logits.sub_(bound)).sum(-1).log() + bound


class GatherBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm with statistics over every rank's batch, for CPU (gloo) runs.

    torch's SyncBatchNorm runs only on CUDA. This one all-gathers the per-channel sums and sums
    of squares with gradient, so a 2-process CPU run normalises exactly as one process would.
    """

    def _check_input_dim(self, x):
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input, got {x.dim()}D")

    def forward(self, x):
        if not self.training:
            return super().forward(x)
        dims = [0] + list(range(2, x.dim()))
        shape = [1, -1] + [1] * (x.dim() - 2)
        # Per-rank mean and sum of squared deviations, combined across ranks (Chan et al.): stable
        # where E[x^2] - mean^2 would cancel. Equal batch sizes on every rank make the mean a plain average.
        local_mean = x.mean(dims)
        local_m2 = ((x - local_mean.view(shape)) ** 2).sum(dims)
        stats = gather_with_grad(torch.stack([local_mean, local_m2])[None])  # (world, 2, C)
        mean = stats[:, 0].mean(0)
        count = x.numel() // x.shape[1] * dist.get_world_size()
        var = (stats[:, 1].sum(0) + (x.numel() // x.shape[1]) * ((stats[:, 0] - mean) ** 2).sum(0)) / count
        with torch.no_grad():
            self.num_batches_tracked += 1
            self.running_mean.lerp_(mean, self.momentum)
            self.running_var.lerp_(var * count / (count - 1), self.momentum)
        x = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        return x * self.weight.view(shape) + self.bias.view(shape) if self.affine else x


def sync_batchnorm(module, ctx):
    """Make every BatchNorm normalise over the global batch (SyncBatchNorm on CUDA)."""
    if ctx.world == 1:
        return module
    if ctx.device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(module)
    for name, child in module.named_children():
        if isinstance(child, nn.modules.batchnorm._BatchNorm):
            synced = GatherBatchNorm(child.num_features, child.eps, child.momentum, child.affine)
            synced = synced.to(child.running_mean)  # same device and dtype
            synced.load_state_dict(child.state_dict())
            setattr(module, name, synced)
        else:
            sync_batchnorm(child, ctx)
    return module


def distribute(model, ctx, compile=False):
    """Global BatchNorm, channels_last on CUDA, DDP across ranks; returns the module to call."""
    model = sync_batchnorm(model, ctx)
    if ctx.device.type == "cuda":
        model = model.to(memory_format=torch.channels_last)
    if ctx.world > 1:
        model = nn.parallel.DistributedDataParallel(
            model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    if compile:
        model = torch.compile(model)
    return model


# ------------------------------------------------------------------------------ ResNet

class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, c_in, c, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)
        self.downsample = None
        if stride != 1 or c_in != c:
            self.downsample = nn.Sequential(nn.Conv2d(c_in, c, 1, stride, bias=False), nn.BatchNorm2d(c))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        identity = x if self.downsample is None else self.downsample(x)
        return F.relu(self.bn2(self.conv2(out)) + identity)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, c_in, c, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, stride, 1, bias=False)  # stride on the 3x3, as torchvision (v1.5)
        self.bn2 = nn.BatchNorm2d(c)
        self.conv3 = nn.Conv2d(c, 4 * c, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(4 * c)
        self.downsample = None
        if stride != 1 or c_in != 4 * c:
            self.downsample = nn.Sequential(nn.Conv2d(c_in, 4 * c, 1, stride, bias=False),
                                            nn.BatchNorm2d(4 * c))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        identity = x if self.downsample is None else self.downsample(x)
        return F.relu(self.bn3(self.conv3(out)) + identity)


class ResNet(nn.Module):
    """ResNet-18/34/50 backbone: image (B, 3, S, S) -> features (B, out_dim), no classifier.

    Written out (not torchvision's class) so that `width` can shrink every layer for CPU runs;
    module names are torchvision's, so at width 64 the state_dict loads into
    torchvision.models.resnet18/34/50 (with `fc` dropped) unchanged.
    Images up to 64 px get the CIFAR stem (3x3 stride-1 conv, no max-pool): the ImageNet stem
    would shrink a 32 px image to 8 px before the first block.
    """
    LAYERS = {"resnet18": (BasicBlock, [2, 2, 2, 2]), "resnet34": (BasicBlock, [3, 4, 6, 3]),
              "resnet50": (Bottleneck, [3, 4, 6, 3])}

    def __init__(self, arch="resnet18", width=64, image_size=32, zero_init_residual=False):
        super().__init__()
        block, blocks = self.LAYERS[arch]
        small = image_size <= 64
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False) if small else \
            nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.maxpool = nn.Identity() if small else nn.MaxPool2d(3, 2, 1)
        c_in = width
        for i, n in enumerate(blocks):
            layer = []
            for j in range(n):
                layer.append(block(c_in, width * 2 ** i, stride=2 if i > 0 and j == 0 else 1))
                c_in = width * 2 ** i * block.expansion
            setattr(self, f"layer{i + 1}", nn.Sequential(*layer))
        self.out_dim = c_in
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        if zero_init_residual:  # each residual branch starts as zero: every block starts as identity
            for m in self.modules():
                if isinstance(m, (BasicBlock, Bottleneck)):
                    nn.init.zeros_(m.bn3.weight if isinstance(m, Bottleneck) else m.bn2.weight)

    def forward(self, x):
        x = self.maxpool(F.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)


# ------------------------------------------------------------------------------ data

STATS = {"cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
         "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
         "stl10": ((0.4467, 0.4398, 0.4066), (0.2603, 0.2566, 0.2713)),
         "imagefolder": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))}
STREAM_ABOVE_BYTES = 16 * 2 ** 30


@dataclass
class Data:
    """Pre-training set and the two evaluation splits.

    On the device: `train` is uint8 (N, 3, S, S) and the eval splits are (images, labels) pairs.
    Streaming: `train` is a Dataset of two pre-cropped views and the eval splits are Datasets.
    """
    train: object
    train_labels: torch.Tensor  # (N,) int64, -1 where unlabeled (STL-10)
    eval_train: object
    eval_test: object
    num_classes: int
    image_size: int
    mean: tuple
    std: tuple
    streaming: bool = False

    def __len__(self):
        return len(self.train_labels)


def _torchvision_set(name, root, ctx, **kwargs):
    """Rank 0 downloads once; the others read what it wrote."""
    import torchvision
    cls = {"cifar10": torchvision.datasets.CIFAR10, "cifar100": torchvision.datasets.CIFAR100,
           "stl10": torchvision.datasets.STL10}[name]
    try:
        if ctx.is_main:
            try:
                return cls(root, download=True, **kwargs)
            finally:
                if ctx.world > 1:
                    dist.barrier()
        if ctx.world > 1:
            dist.barrier()
        return cls(root, download=False, **kwargs)
    except Exception as error:  # URLError, RuntimeError("Dataset not found or corrupted"), ...
        raise UserError(f"no {name} in {root} and it could not be downloaded ({type(error).__name__}); "
                        f"put {cls.filename} or its extracted {cls.base_folder}/ there, or point "
                        f"--data-dir at a folder that has it") from None


def _as_tensors(dataset, limit=None):
    images = torch.as_tensor(dataset.data)
    if images.shape[-1] == 3:  # CIFAR stores (N, H, W, 3)
        images = images.permute(0, 3, 1, 2)
    labels = torch.as_tensor(dataset.labels if hasattr(dataset, "labels") else dataset.targets)
    if limit:
        images, labels = images[:limit], labels[:limit]
    return images.contiguous(), labels.long()


def load_data(args, ctx):
    name = args.dataset
    mean, std = STATS[name]
    if name in ("cifar10", "cifar100", "stl10"):
        size = 96 if name == "stl10" else 32
        if args.image_size not in (None, size):
            raise UserError(f"--image-size {args.image_size}: {name} images are {size} px")
        os.makedirs(args.data_dir, exist_ok=True)
        if name == "stl10":
            train = _as_tensors(_torchvision_set(name, args.data_dir, ctx, split="train+unlabeled"), args.limit_train)
            eval_train = _as_tensors(_torchvision_set(name, args.data_dir, ctx, split="train"), args.limit_train)
            test = _as_tensors(_torchvision_set(name, args.data_dir, ctx, split="test"))
        else:
            train = eval_train = _as_tensors(_torchvision_set(name, args.data_dir, ctx, train=True), args.limit_train)
            test = _as_tensors(_torchvision_set(name, args.data_dir, ctx, train=False))
        to = lambda pair: tuple(t.to(ctx.device) for t in pair)
        train, eval_train, test = to(train), to(eval_train), to(test)
        return Data(train[0], train[1], eval_train, test, 100 if name == "cifar100" else 10, size, mean, std)
    return _load_image_folder(args, ctx, mean, std)


def _load_image_folder(args, ctx, mean, std):
    import torchvision
    size = args.image_size or 224
    splits = {}
    for split in ("train", "val"):
        root = os.path.join(args.data_dir, split)
        if not os.path.isdir(root):
            raise UserError(f"imagefolder: {root} does not exist; --data-dir needs train/ and val/ "
                            f"folders with one subfolder of images per class")
        try:
            splits[split] = torchvision.datasets.ImageFolder(root)
        except (FileNotFoundError, RuntimeError) as error:
            raise UserError(f"imagefolder: {root} has no images in class subfolders ({error})") from None
        if len(splits[split].classes) < 2:
            raise UserError(f"imagefolder: {root} has {len(splits[split].classes)} class folder(s); "
                            f"kNN and linear evaluation need at least 2")
    train, val = splits["train"], splits["val"]
    if train.classes != val.classes:
        raise UserError(f"imagefolder: train/ and val/ have different class folders")
    if args.limit_train:
        train.samples = train.samples[:args.limit_train]
        train.targets = train.targets[:args.limit_train]
    labels = torch.tensor(train.targets).to(ctx.device)
    stream = args.stream or len(train.samples) * 3 * size * size > STREAM_ABOVE_BYTES
    if stream:
        return Data(_TwoCrops(train.samples, size, args.crop_scale), labels, _Fixed(train.samples, size),
                    _Fixed(val.samples, size), len(train.classes), size, mean, std, streaming=True)
    decode = lambda samples: _decode_all(_Fixed(samples, size), args.workers, ctx.device)
    return Data(decode(train.samples)[0], labels, decode(train.samples), decode(val.samples),
                len(train.classes), size, mean, std)


class _Fixed(torch.utils.data.Dataset):
    """Image file -> uint8 (3, S, S): shorter side resized to S, centre crop."""

    def __init__(self, samples, size):
        import torchvision.transforms.v2 as T
        self.samples = samples
        self.transform = T.Compose([T.PILToTensor(), T.Resize(size, antialias=True), T.CenterCrop(size)])

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        from PIL import Image
        path, label = self.samples[i]
        with Image.open(path) as image:
            return self.transform(image.convert("RGB")), label


class _TwoCrops(_Fixed):
    """Image file -> uint8 (2, 3, S, S): two random resized crops with flips (streaming path).

    Cropping in the worker keeps full-resolution decoding off the device; the colour part of the
    recipe then runs batched on the device like the in-memory path.
    """

    def __init__(self, samples, size, scale):
        import torchvision.transforms.v2 as T
        self.samples = samples
        self.transform = T.Compose([T.PILToTensor(), T.RandomResizedCrop(size, scale=tuple(scale), antialias=True),
                                    T.RandomHorizontalFlip()])

    def __getitem__(self, i):
        from PIL import Image
        path, label = self.samples[i]
        with Image.open(path) as image:
            image = image.convert("RGB")
            return torch.stack([self.transform(image), self.transform(image)]), label


def _decode_all(dataset, workers, device):
    loader = torch.utils.data.DataLoader(dataset, batch_size=256, num_workers=workers)
    images, labels = zip(*loader)
    return torch.cat(images).to(device), torch.cat(labels).long().to(device)


def train_batches(data, epoch, batch_size, generator, ctx, workers=0):
    """Yield this rank's slice (B / world images) of each global batch of one epoch.

    The permutation comes from `generator`, seeded the same on every rank, so rank r takes rows
    [r*b, (r+1)*b) of the global batch that a single process would have taken whole.
    On the device: uint8 (b, 3, S, S). Streaming: uint8 (b, 2, 3, S, S) pre-cropped views.
    """
    device = ctx.device
    n = len(data)
    perm = torch.randperm(n, generator=generator, device=generator.device).to(device)
    per_rank = batch_size // ctx.world
    steps = n // batch_size
    if not data.streaming:
        for step in range(steps):
            rows = perm[step * batch_size + ctx.rank * per_rank:][:per_rank]
            yield data.train[rows], data.train_labels[rows]
        return
    mine = perm[:steps * batch_size].view(steps, ctx.world, per_rank)[:, ctx.rank].flatten().tolist()
    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(data.train, mine), batch_size=per_rank,
                                         num_workers=workers, pin_memory=device.type == "cuda",
                                         persistent_workers=False, drop_last=True)
    for views, labels in loader:
        yield views.to(device, non_blocking=True), labels.to(device, non_blocking=True)


def steps_per_epoch(data, batch_size):
    return len(data) // batch_size


def epoch_generator(seed, epoch, device):
    """One generator per epoch, so a resumed run draws exactly what an uninterrupted one would."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed * 100003 + epoch)
    return generator


def fit_batch_to_data(args, data, ctx):
    """A data set smaller than one global batch: shrink the batch (and say so) rather than run 0 steps."""
    if len(data) >= args.batch_size:
        return
    batch = len(data) // ctx.world * ctx.world
    if batch // ctx.world < 2:
        raise UserError(f"only {len(data)} training images: too few for {ctx.world} process(es)")
    ctx.print(f"note: --batch-size {args.batch_size} is more than the {len(data)} training images; using {batch}")
    args.batch_size = batch


# ------------------------------------------------------------------------------ augmentation

@dataclass
class Recipe:
    """One view's augmentation: which ops, their strengths and probabilities."""
    crop_scale: tuple = (0.08, 1.0)
    crop_ratio: tuple = (3 / 4, 4 / 3)
    flip_p: float = 0.5
    jitter: tuple = (0.4, 0.4, 0.4, 0.1)  # brightness, contrast, saturation, hue
    jitter_p: float = 0.8
    gray_p: float = 0.2
    blur_p: float = 0.0
    blur_sigma: tuple = (0.1, 2.0)
    solarize_p: float = 0.0


GRAY = (0.2989, 0.587, 0.114)  # torchvision's rgb_to_grayscale weights


def grayscale(x):
    """(B, 3, H, W) -> (B, 1, H, W) luma."""
    r, g, b = x.unbind(1)
    return (GRAY[0] * r + GRAY[1] * g + GRAY[2] * b).unsqueeze(1)


def adjust_brightness(x, factor):  # factor: (B,)
    return (x * factor.view(-1, 1, 1, 1)).clamp(0, 1)


def adjust_contrast(x, factor):
    mean = grayscale(x).mean(dim=(1, 2, 3), keepdim=True)
    f = factor.view(-1, 1, 1, 1)
    return (f * x + (1 - f) * mean).clamp(0, 1)


def adjust_saturation(x, factor):
    f = factor.view(-1, 1, 1, 1)
    return (f * x + (1 - f) * grayscale(x)).clamp(0, 1)


def adjust_hue(x, shift):
    """Rotate the hue by `shift` (B,) turns, through HSV, as torchvision does.

    Hue in sextants h6 in [0, 6) from the channel holding the maximum v (ties give the same hue);
    back to RGB, channel n in (R, G, B) = v - chroma * clamp(min(k, 4 - k), 0, 1), k = (n + h6) mod 6,
    n = 5, 3, 1, with chroma = v - min = v * s: torchvision's round trip in fewer passes.
    """
    r, g, b = x.unbind(1)
    minimum, value = torch.aminmax(x, dim=1)  # (B, H, W) each, one pass
    chroma = value - minimum
    c = torch.where(chroma > 0, chroma, 1.0)
    hue = torch.where(value == r, g - b,  # 6 * hue * c, as torchvision: red, then green, then blue
                      torch.where(value == g, (b - r).add_(c, alpha=2), (r - g).add_(c, alpha=4))).div_(c)
    hue = hue.add_(6 * shift.view(-1, 1, 1)).remainder_(6)  # (B, H, W) rotated, in [0, 6)
    n = torch.tensor([5.0, 3.0, 1.0], device=x.device, dtype=x.dtype).view(1, 3, 1, 1)
    k = hue.unsqueeze(1) + n  # (B, 3, H, W) in [0, 12)
    k = torch.where(k >= 6, k - 6, k)
    ramp = torch.minimum(k, 4 - k).clamp_(0, 1)
    return torch.addcmul(value.unsqueeze(1), chroma.unsqueeze(1), ramp, value=-1)


def gaussian_blur(x, sigma, kernel_size):
    """Per-sample sigma (B,), separable kernel, reflect padding (torchvision's gaussian_blur)."""
    B, C, H, W = x.shape
    radius = kernel_size // 2
    offsets = torch.arange(-radius, radius + 1, device=x.device, dtype=x.dtype)
    kernel = torch.exp(-0.5 * (offsets / sigma.view(-1, 1)) ** 2)
    kernel = (kernel / kernel.sum(1, keepdim=True)).repeat_interleave(C, 0)  # (B*C, K)
    y = F.pad(x.reshape(1, B * C, H, W), (radius, radius, radius, radius), mode="reflect")
    y = F.conv2d(y, kernel.view(B * C, 1, 1, -1), groups=B * C)  # horizontal pass
    y = F.conv2d(y, kernel.view(B * C, 1, -1, 1), groups=B * C)  # vertical pass
    return y.view(B, C, H, W)


def solarize(x, threshold=0.5):
    return torch.where(x >= threshold, 1 - x, x)


def sample_crop_boxes(rand, n, height, width, scale, ratio, tries=10):
    """RandomResizedCrop's box sampler, vectorised: returns top, left, h, w as (n,) float tensors.

    Like torchvision: up to `tries` draws of (area, log-ratio), the first that fits wins, else a
    centre crop with the ratio clamped into range. `rand(shape)` returns uniforms in [0, 1).
    """
    area = height * width * (scale[0] + (scale[1] - scale[0]) * rand((n, tries)))
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    aspect = torch.exp(log_lo + (log_hi - log_lo) * rand((n, tries)))
    w = torch.round(torch.sqrt(area * aspect))
    h = torch.round(torch.sqrt(area / aspect))
    fits = (w > 0) & (h > 0) & (w <= width) & (h <= height)
    first = fits.float().argmax(1, keepdim=True)  # index of the first fitting draw
    w, h, found = w.gather(1, first)[:, 0], h.gather(1, first)[:, 0], fits.any(1)
    # fallback: the whole image, cut to the nearest allowed aspect ratio
    if width / height < ratio[0]:
        fw, fh = width, round(width / ratio[0])
    elif width / height > ratio[1]:
        fw, fh = round(height * ratio[1]), height
    else:
        fw, fh = width, height
    w = torch.where(found, w, torch.full_like(w, fw))
    h = torch.where(found, h, torch.full_like(h, fh))
    u, v = rand((n,)), rand((n,))
    top = torch.where(found, torch.floor(u * (height - h + 1)), torch.floor((height - h) / 2 + 0 * u))
    left = torch.where(found, torch.floor(v * (width - w + 1)), torch.floor((width - w) / 2 + 0 * v))
    return top, left, h, w


def resized_crop_flip(x, top, left, h, w, flip, size):
    """Crop box (per sample), resize to `size` bilinearly and mirror where `flip`, in one grid_sample.

    The affine map sends the output's [-1, 1] square onto the box; with align_corners=False this
    samples exactly where torchvision's resized_crop (bilinear, no antialias) samples.
    """
    B, _, H, W = x.shape
    theta = torch.zeros(B, 2, 3, device=x.device, dtype=x.dtype)
    theta[:, 0, 0] = torch.where(flip, -w / W, w / W)
    theta[:, 0, 2] = (2 * left + w) / W - 1
    theta[:, 1, 1] = h / H
    theta[:, 1, 2] = (2 * top + h) / H - 1
    grid = F.affine_grid(theta, (B, 3, size, size), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)


class Augment:
    """Batched augmentation on the device with per-sample random parameters, one recipe per view.

    Parameters are drawn for the whole global batch from a generator seeded alike on every rank,
    and each rank keeps its own rows: N processes augment exactly as one process would.
    (torchvision.transforms.v2 on a batch draws one set of parameters for the whole batch.)
    Colour jitter runs in the fixed order brightness, contrast, saturation, hue.
    """

    def __init__(self, recipes, size, mean, std, ctx):
        self.recipes, self.size, self.ctx = recipes, size, ctx
        self.mean = torch.tensor(mean, device=ctx.device).view(1, 3, 1, 1)
        self.std = torch.tensor(std, device=ctx.device).view(1, 3, 1, 1)

    def __call__(self, x, generator):
        """uint8 (b, 3, H, W), or (b, V, 3, S, S) pre-cropped -> list of V normalised float views."""
        views = []
        for v, recipe in enumerate(self.recipes):
            image = x[:, v] if x.dim() == 5 else x
            views.append(self.view(image, recipe, generator, crop=x.dim() == 4))
        return views

    def rand(self, generator, b):
        """uniform(shape) for the global batch; this rank's rows."""
        start = self.ctx.rank * b

        def draw(shape):
            shape = (shape,) if isinstance(shape, int) else shape
            full = torch.rand((b * self.ctx.world,) + tuple(shape[1:]), generator=generator,
                              device=generator.device)
            return full[start:start + b].to(self.ctx.device)
        return draw

    def view(self, image, r, generator, crop=True):
        b = image.shape[0]
        rand = self.rand(generator, b)
        x = image.float() / 255
        if crop:
            top, left, h, w = sample_crop_boxes(rand, b, x.shape[2], x.shape[3], r.crop_scale, r.crop_ratio)
            x = resized_crop_flip(x, top, left, h, w, rand(b) < r.flip_p, self.size)
        bright, contrast, sat, hue = r.jitter
        jitter = (rand(b) < r.jitter_p).view(-1, 1, 1, 1)
        if any(r.jitter):
            y = adjust_brightness(x, 1 - bright + 2 * bright * rand(b))
            y = adjust_contrast(y, 1 - contrast + 2 * contrast * rand(b))
            y = adjust_saturation(y, 1 - sat + 2 * sat * rand(b))
            if hue > 0:
                y = adjust_hue(y, hue * (2 * rand(b) - 1))
            x = torch.where(jitter, y, x)
        if r.gray_p > 0:
            x = torch.where((rand(b) < r.gray_p).view(-1, 1, 1, 1), grayscale(x).expand_as(x), x)
        if r.blur_p > 0:
            sigma = r.blur_sigma[0] + (r.blur_sigma[1] - r.blur_sigma[0]) * rand(b)
            kernel = (self.size // 10) | 1  # odd, about 10% of the image (SimCLR's 23 px at 224)
            x = torch.where((rand(b) < r.blur_p).view(-1, 1, 1, 1), gaussian_blur(x, sigma, kernel), x)
        if r.solarize_p > 0:
            x = torch.where((rand(b) < r.solarize_p).view(-1, 1, 1, 1), solarize(x), x)
        x = (x - self.mean) / self.std
        if self.ctx.device.type == "cuda":
            x = x.contiguous(memory_format=torch.channels_last)
        return x


# ------------------------------------------------------------------------------ evaluation

def eval_batches(split, ctx, batch_size=512, workers=0):
    """This rank's contiguous share of an eval split as (uint8 images, labels) batches."""
    if isinstance(split, tuple):
        images, labels = split
        n = len(labels)
    else:
        n = len(split)
    share = -(-n // ctx.world)
    start, stop = min(ctx.rank * share, n), min((ctx.rank + 1) * share, n)
    if isinstance(split, tuple):
        for i in range(start, stop, batch_size):
            yield images[i:min(i + batch_size, stop)], labels[i:min(i + batch_size, stop)]
        return
    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(split, range(start, stop)),
                                         batch_size=batch_size, num_workers=workers)
    for images, labels in loader:
        yield images.to(ctx.device), labels.to(ctx.device)


@torch.no_grad()
def extract_features(backbone, split, data, ctx, workers=0):
    """L2-normalised backbone features of un-augmented images, ranks sharing the work -> (N, F), (N,)."""
    was_training = backbone.training
    backbone.eval()
    mean = torch.tensor(data.mean, device=ctx.device).view(1, 3, 1, 1)
    std = torch.tensor(data.std, device=ctx.device).view(1, 3, 1, 1)
    features, labels = [], []
    for images, y in eval_batches(split, ctx, workers=workers):
        x = (images.float() / 255 - mean) / std
        if ctx.device.type == "cuda":
            x = x.contiguous(memory_format=torch.channels_last)
        with ctx.autocast():
            features.append(F.normalize(backbone(x).float(), dim=1))
        labels.append(y)
    backbone.train(was_training)
    n = len(split[1]) if isinstance(split, tuple) else len(split)
    share = -(-n // ctx.world)
    dim = backbone.out_dim
    f = torch.cat(features) if features else torch.zeros(0, dim, device=ctx.device)
    y = torch.cat(labels) if labels else torch.zeros(0, dtype=torch.long, device=ctx.device)
    pad = share - len(y)  # all_gather needs equal shares
    f = torch.cat([f, f.new_zeros(pad, dim)])
    y = torch.cat([y, y.new_full((pad,), -1)])
    f, y = gather(f), gather(y)
    keep = y.new_zeros(len(y), dtype=torch.bool)
    for r in range(ctx.world):  # drop the padding rows of each rank
        keep[r * share:r * share + min(share, max(0, n - r * share))] = True
    return f[keep], y[keep]


@torch.no_grad()
def knn_accuracy(train_f, train_y, test_f, test_y, num_classes, k=200, t=0.1, ctx=None):
    """Weighted kNN (InstDisc / MoCo monitor): the k most cosine-similar training features vote
    with weight exp(sim / t). Features must be L2-normalised. Ranks split the test set. -> top-1 %."""
    keep = train_y >= 0
    train_f, train_y = train_f[keep], train_y[keep]
    k = min(k, len(train_y))
    world, rank = (ctx.world, ctx.rank) if ctx else (1, 0)
    share = -(-len(test_y) // world)
    correct = torch.zeros((), device=test_f.device)
    for i in range(rank * share, min((rank + 1) * share, len(test_y)), 1024):
        stop = min(i + 1024, (rank + 1) * share, len(test_y))
        sim, idx = (test_f[i:stop] @ train_f.T).topk(k, dim=1)  # (b, k)
        votes = torch.zeros(stop - i, num_classes, device=test_f.device)
        votes.scatter_add_(1, train_y[idx], torch.exp(sim / t))
        correct += (votes.argmax(1) == test_y[i:stop]).sum()
    return 100.0 * all_reduce_sum(correct).item() / len(test_y)


def linear_probe(train_f, train_y, test_f, test_y, num_classes, epochs=100, seed=0, batch_size=256):
    """Linear classifier on frozen features (standardised), AdamW + cosine; -> test top-1 %.

    Every rank computes the same thing from the same features, so nothing needs reducing.
    """
    keep = train_y >= 0
    train_f, train_y = train_f[keep].float(), train_y[keep]
    mean, std = train_f.mean(0), train_f.std(0) + 1e-6
    train_f, test_f = (train_f - mean) / std, (test_f.float() - mean) / std
    generator = torch.Generator(device=train_f.device).manual_seed(seed)
    torch.manual_seed(seed)
    classifier = nn.Linear(train_f.shape[1], num_classes).to(train_f.device)
    optimizer = torch.optim.AdamW(classifier.parameters(), lr=1e-3, weight_decay=5e-4)
    steps = max(1, epochs * math.ceil(len(train_y) / batch_size))
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    for _ in range(epochs):
        perm = torch.randperm(len(train_y), generator=generator, device=train_f.device)
        for i in range(0, len(perm), batch_size):
            rows = perm[i:i + batch_size]
            loss = F.cross_entropy(classifier(train_f[rows]), train_y[rows])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
    with torch.no_grad():
        return 100.0 * (classifier(test_f).argmax(1) == test_y).float().mean().item()


def linear_probe_augmented(backbone, data, ctx, epochs=100, batch_size=256, seed=0):
    """The slower protocol: a linear layer on the frozen backbone, trained on crop+flip views."""
    if data.streaming:
        raise UserError("--linear-aug needs a data set held on the device (not --stream)")
    images, labels = data.eval_train
    keep = labels >= 0
    images, labels = images[keep], labels[keep]
    backbone.eval()
    classifier = nn.Linear(backbone.out_dim, data.num_classes).to(ctx.device)
    optimizer = torch.optim.SGD(classifier.parameters(), lr=0.1 * batch_size / 256, momentum=0.9)
    augment = Augment([Recipe(jitter=(0, 0, 0, 0), jitter_p=0, gray_p=0)], data.image_size, data.mean, data.std, ctx)
    per_rank = max(1, batch_size // ctx.world)
    steps = max(1, len(labels) // (per_rank * ctx.world))
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, epochs * steps)
    for epoch in range(epochs):
        generator = epoch_generator(seed + 1, epoch, ctx.device)
        data_view = Data(images, labels, None, None, data.num_classes, data.image_size, data.mean, data.std)
        for x, y in train_batches(data_view, epoch, per_rank * ctx.world, generator, ctx):
            with torch.no_grad(), ctx.autocast():
                features = backbone(augment(x, generator)[0]).float()
            loss = F.cross_entropy(classifier(features), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            for p in classifier.parameters():  # average the classifier's gradient across ranks
                p.grad = all_reduce_sum(p.grad) / ctx.world
            optimizer.step()
            schedule.step()
    correct, total = torch.zeros((), device=ctx.device), torch.zeros((), device=ctx.device)
    with torch.no_grad():
        for x, y in eval_batches(data.eval_test, ctx):
            x = (x.float() / 255 - augment.mean) / augment.std
            with ctx.autocast():
                correct += (classifier(backbone(x).float()).argmax(1) == y).sum()
            total += len(y)
    return 100.0 * all_reduce_sum(correct).item() / all_reduce_sum(total).item()


def evaluate(backbone, data, ctx, args, final=False):
    """kNN top-1 (k = --knn-k) every monitor epoch; at the end also k=1 and the linear probe."""
    train_f, train_y = extract_features(backbone, data.eval_train, data, ctx, args.workers)
    test_f, test_y = extract_features(backbone, data.eval_test, data, ctx, args.workers)
    result = {"knn_top1": knn_accuracy(train_f, train_y, test_f, test_y, data.num_classes, args.knn_k, args.knn_t, ctx)}
    if final:
        result["knn_k"] = args.knn_k
        result["knn_k1_top1"] = knn_accuracy(train_f, train_y, test_f, test_y, data.num_classes, 1, args.knn_t, ctx)
        if args.linear_epochs > 0:
            if args.linear_aug:
                result["linear_top1"] = linear_probe_augmented(backbone, data, ctx, args.linear_epochs, seed=args.seed)
            else:
                result["linear_top1"] = linear_probe(train_f, train_y, test_f, test_y, data.num_classes,
                                                     args.linear_epochs, args.seed)
    return result


# ------------------------------------------------------------------------------ schedule, logging

def learning_rate(step, total_steps, warmup_steps, peak, schedule="cosine"):
    """Linear warm-up to `peak`, then cosine decay to 0 (or constant)."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    if schedule == "constant":
        return peak
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


class EpochMeter:
    """Progress bar and per-epoch means, without a host sync per step.

    Scalars are summed on the device; every `every` steps one sync refreshes the bar (loss, lr,
    images/s) and checks the loss is finite on every rank.
    """

    def __init__(self, ctx, epoch, epochs, steps, images_per_step, every=20):
        self.ctx, self.epoch, self.every, self.images_per_step = ctx, epoch, every, images_per_step
        self.sums, self.steps, self.lr = {}, 0, 0.0
        self.bar = tqdm(total=steps, desc=f"epoch {epoch + 1}/{epochs}", disable=not ctx.is_main,
                        dynamic_ncols=True, leave=False)
        self.start = self.last = time.perf_counter()
        self.last_steps = 0

    def update(self, lr, **scalars):
        self.steps += 1
        self.lr = lr
        for name, value in scalars.items():
            value = value.detach().float()
            self.sums[name] = self.sums[name] + value if name in self.sums else value
        if self.steps % self.every == 0:
            self.refresh()

    def refresh(self):
        loss = all_reduce_sum(self.sums["loss"]).item() / (self.steps * self.ctx.world)
        if not math.isfinite(loss):
            self.bar.close()
            raise UserError(f"loss became {loss} in epoch {self.epoch + 1}, step {self.steps}; the last "
                            f"good checkpoint is kept; lower --lr, or try --no-amp")
        now = time.perf_counter()
        rate = (self.steps - self.last_steps) * self.images_per_step / (now - self.last)
        self.last, self.last_steps = now, self.steps
        self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{self.lr:.4g}", img_s=f"{rate:.0f}")
        self.bar.update(self.steps - self.bar.n)

    def summary(self):
        """Means over steps and ranks of every scalar, plus lr and images/s; closes the bar."""
        self.refresh()
        self.bar.close()
        seconds = time.perf_counter() - self.start
        record = {"epoch": self.epoch + 1}
        for name, total in self.sums.items():
            record[name] = all_reduce_sum(total).item() / (self.steps * self.ctx.world)
        record.update(lr=self.lr, images_per_s=self.steps * self.images_per_step / seconds, seconds=seconds)
        return record


def log_epoch(ctx, record):
    """Append one JSON line to metrics.jsonl and print it (rank 0)."""
    if not ctx.is_main:
        return
    with open(os.path.join(ctx.out, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")
    ctx.print("  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in record.items()))


# ------------------------------------------------------------------------------ checkpoints

def save_atomic(obj, path):
    """torch.save to a temp file, then os.replace: a crash mid-save never leaves a broken file."""
    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def save_checkpoint(ctx, state):
    if ctx.is_main:
        save_atomic(dict(state, script=ctx.script), os.path.join(ctx.out, "checkpoint.pt"))


def load_checkpoint(path):
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise UserError(f"checkpoint {path} is unreadable ({type(error).__name__}); it is truncated or "
                        f"not from this project: delete it or start a new --out") from None
    if not isinstance(checkpoint, dict) or not {"args", "epoch", "model"} <= checkpoint.keys():
        raise UserError(f"checkpoint {path} is not a checkpoint of this project")
    return checkpoint


def restore(module, state_dict, what, path="checkpoint"):
    """load_state_dict, turning a mismatch (other method, width, arch) into a UserError."""
    try:
        module.load_state_dict(state_dict)
    except (RuntimeError, KeyError, ValueError) as error:
        detail = " ".join(str(error).split())[:160]
        raise UserError(f"{path}: the saved {what} does not fit this model, so the run was made with other "
                        f"model options ({detail}); start a new --out") from None


def resume(args, ctx, **states):
    """With --resume, load each named state (model=..., optimizer=..., queue=...) from the checkpoint
    and return the epoch to start from; 0 for a new run. None states are skipped."""
    checkpoint, args.checkpoint = args.checkpoint, None
    if checkpoint is None:
        return 0
    for name, state in states.items():
        if state is not None:
            if name not in checkpoint:
                raise UserError(f"--resume {args.resume}: the checkpoint has no {name}; start a new --out")
            restore(state, checkpoint[name], name.replace("_", " "))
    ctx.print(f"resumed from {ctx.out} at epoch {checkpoint['epoch']}")
    return checkpoint["epoch"]


def end_epoch(ctx, args, epoch, record, backbone, data, saved_args, **states):
    """Close an epoch: kNN monitor when due, one metrics line, the checkpoint (arguments, epoch and
    every named state). Returns True when --stop-after ends this process here."""
    if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
        record.update(evaluate(backbone, data, ctx, args))
    log_epoch(ctx, record)
    save_checkpoint(ctx, {"args": saved_args, "epoch": epoch + 1,
                          **{name: state.state_dict() for name, state in states.items() if state is not None}})
    if args.stop_after and args.stop_after <= epoch + 1 < args.epochs:
        ctx.print(f"stopped after epoch {epoch + 1} (--stop-after); continue with --resume {ctx.out}")
        return True
    return False


def finish(ctx, backbone, results):
    """Write backbone.pt and results.json (rank 0) and print the final accuracies."""
    if ctx.is_main:
        save_atomic(backbone.state_dict(), os.path.join(ctx.out, "backbone.pt"))
        with open(os.path.join(ctx.out, "results.json"), "w") as f:
            json.dump(results, f, indent=2)
        line = (f"final kNN top-1 (k={results['knn_k']}): {results['knn_top1']:.2f}%  "
                f"kNN top-1 (k=1): {results['knn_k1_top1']:.2f}%")
        if "linear_top1" in results:
            line += f"  linear probe top-1: {results['linear_top1']:.2f}%"
        ctx.print(line)
        ctx.print(f"run folder: {ctx.out}")
