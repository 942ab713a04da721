"""Shared infrastructure, no algorithm: command line, run folder, processes and gathers, ResNets,
data on the device (or streamed), batched augmentation, kNN and linear probes, exact checkpoints."""
import argparse
import contextlib
import datetime
import fcntl
import inspect
import json
import math
import os
import re
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision  # here, before any process group: see below
import torchvision.transforms.v2 as T
from PIL import Image
from torchvision.transforms.functional import rgb_to_grayscale as grayscale  # takes batches too
from torchvision.models.resnet import BasicBlock, Bottleneck
from tqdm import tqdm

# torchvision imports torch._dynamo, which, imported after init_process_group, keeps the default
# group alive past destroy_process_group (torch 2.14): gloo's threads outlive it and can abort
# Python's exit ("terminate called without an active exception"). Never import it after setup().


class UserError(Exception):
    """A problem the user can fix: printed as one line, exit status 2, no traceback."""


def run(main):
    """Call `main()`; a UserError becomes one `error:` line on stderr and exit status 2."""
    try:
        main()
    except UserError as error:
        rank = int(os.environ.get("RANK", 0))
        if rank != 0:  # rank 0 says what every rank usually met, and torchrun then stops the
            time.sleep(10)  # others; a rank that met an error alone says it after a while
        # raised in a DataLoader worker, the message is the worker's traceback: its last line
        message = str(error).strip().splitlines()[-1].split("UserError: ")[-1]
        for bar in list(tqdm._instances):  # met mid-epoch: the progress bar leaves the line first
            bar.close()
        print(f"error{f' (rank {rank})' if rank else ''}: {message}", file=sys.stderr, flush=True)
        sys.exit(2)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# ------------------------------------------------------------------------------ command line
def checked(convert, test, what):
    """An argparse type: `convert` the text, refused unless `test` passes ("must be `what`")."""
    def parse(text):
        if not test(convert(text)):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return convert(text)
    parse.__name__ = convert.__name__  # argparse's "invalid int value: 'x'"
    return parse


positive_int = checked(int, lambda n: n >= 1, "a positive integer")
non_negative_int = checked(int, lambda n: n >= 0, "0 or a positive integer")
positive_float = checked(float, lambda x: 0 < x < math.inf, "a positive number")
non_negative_float = checked(float, lambda x: 0 <= x < math.inf, "0 or a positive number")
seed_value = checked(int, lambda s: 0 <= s < 2 ** 32, "in [0, 2^32)")
momentum_value = checked(float, lambda m: 0 <= m < 1, "in [0, 1)")  # EMA: t <- m t + (1 - m) o


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help keeps the usage docstring's layout and shows every default."""


def add_common_args(parser):
    """The shared options; each method file sets its own batch, epochs, lr, wd, warm-up, crop."""
    a = parser.add_argument
    a("--dataset", choices=["cifar10", "cifar100", "stl10", "imagefolder"], default="cifar10",
      help="imagefolder reads DATA_DIR/train/<class>/* and DATA_DIR/val/<class>/*")
    a("--data-dir", default="./data", help="where the data set is (CIFAR/STL-10 download here)")
    a("--image-size", type=positive_int, help="default: 32 CIFAR, 96 STL-10, 224 imagefolder")
    a("--stream", action="store_true", help="imagefolder: decode in DataLoader workers every "
      "epoch (automatic when the decoded set would fill over half the free device memory)")
    a("--workers", type=non_negative_int, default=min(8, os.cpu_count() or 1), help="decoders")
    a("--limit-train", type=positive_int, help="use only N training images: the first N "
      "(imagefolder: N spread over its class folders)")
    a("--arch", choices=["resnet18", "resnet34", "resnet50"], default="resnet18", help="backbone")
    a("--width", type=positive_int, default=64, help="base channel count (64 = standard ResNet)")
    a("--epochs", type=non_negative_int, help="pre-training epochs (0: evaluate the untrained net)")
    a("--batch-size", type=positive_int, help="global batch, split evenly across processes")
    a("--lr", type=positive_float, help="base learning rate per 256 images (lr = LR * batch / 256)")
    a("--wd", type=non_negative_float, help="weight decay")
    a("--warmup-epochs", type=non_negative_int, help="linear learning-rate warm-up epochs")
    a("--crop-scale", type=float, nargs=2, metavar=("MIN", "MAX"), help="random crop's area range")
    a("--out", help="run folder (default runs/<script>-<time>-<process id>)")
    a("--resume", metavar="RUN", help="continue RUN bit-for-bit, or evaluate a finished RUN again")
    a("--stop-after", type=positive_int, help="end after that many epochs in all (then --resume)")
    a("--eval-every", type=positive_int, default=10, help="kNN monitor every N epochs (and last)")
    a("--knn-k", type=positive_int, default=200, help="neighbours of the kNN monitor")
    a("--knn-t", type=positive_float, default=0.1, help="temperature of the weighted kNN vote")
    a("--linear-epochs", type=non_negative_int, default=100, help="final linear probe (0: none)")
    a("--linear-aug", action=argparse.BooleanOptionalAction, default=False, help="the probe of "
      "MoCo/SimSiam/GSG: SGD on crop+flip views (slow), not AdamW on fixed standardised features")
    a("--linear-lr", type=positive_float, default=30.0,
      help="--linear-aug SGD lr per 256 images (MoCo's main_lincls.py)")
    a("--seed", type=seed_value, default=0, help="seed of model init, data order, augmentation")
    a("--device", default="cuda" if torch.cuda.is_available() else "cpu",
      help="cuda, cuda:N or cpu (under torchrun, cuda means cuda:LOCAL_RANK)")
    a("--amp", action=argparse.BooleanOptionalAction, help="bf16 autocast (default: native bf16)")
    a("--compile", action=argparse.BooleanOptionalAction, default=False,
      help="torch.compile the model (one process only)")


# The options --resume may change; every other one comes from the run's config.json.
RESUMABLE = {"resume", "device", "data_dir", "workers", "stop_after", "eval_every", "compile",
             "amp", "knn_k", "knn_t", "linear_epochs", "linear_aug", "linear_lr"}


def parse_args(parser, argv, script):
    """A new run gets a fresh --out (a folder holding a run is refused); --resume RUN takes RUN's
    config.json, changed only by the options in RESUMABLE."""
    args = parser.parse_args(argv)
    if args.crop_scale and not 0 < args.crop_scale[0] <= args.crop_scale[1] <= 1:
        raise UserError(f"--crop-scale {' '.join(map(str, args.crop_scale))}: need 0 < MIN <= MAX "
                        f"<= 1")
    if args.resume is None:
        # the process id keeps apart runs started in the same second (rank 0's names the folder)
        default = f"{script}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        args.out = args.out or os.path.join("runs", default)
        if os.path.exists(args.out) and not os.path.isdir(args.out):
            raise UserError(f"--out {args.out} is a file; choose a folder")
        # a run that stopped before its first checkpoint may be started again in its folder
        held = [os.path.join(args.out, name) for name in ("checkpoint.pt", "results.json")]
        if any(map(os.path.exists, held)):
            raise UserError(f"--out {args.out} already holds a run: continue it with --resume "
                            f"{args.out}, or choose another --out")
        return args
    run = os.path.dirname(args.resume) if args.resume.endswith(".pt") else args.resume
    try:
        with open(os.path.join(run, "config.json")) as f:
            config = json.load(f)
        saved = config["args"]
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(f"--resume {run}: no readable config.json there; give a run folder of "
                        f"this project") from None
    if config.get("script") != script:
        raise UserError(f"--resume {run}: that run was made by {config.get('script')}.py, not "
                        f"{script}.py; start a new --out")
    parser.set_defaults(**saved)  # the options not typed again take the run's values
    args = parser.parse_args(argv)
    if os.path.normpath(args.out) not in map(os.path.normpath, (run, saved.get("out", run))):
        raise UserError(f"--resume {run} writes into {run}; drop --out {args.out}")
    for key, value in vars(args).items():
        value = json.loads(json.dumps(value))  # tuples -> lists, as saved
        if key in saved and key not in RESUMABLE | {"out"} and value != saved[key]:
            raise UserError(f"run {run} was trained with --{key.replace('_', '-')} {saved[key]}, "
                            f"not {value}; drop that option to continue it, or start a new --out")
    args.out = run
    return args


# ------------------------------------------------------------------------------ processes
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

    def print(self, text):
        if self.rank == 0:
            tqdm.write(text)


def setup(args):
    """This process's device and torchrun's process group; cuDNN autotuner on, no TF32 matmuls."""
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.batch_size % world or args.batch_size // world < 2:
        raise UserError(f"--batch-size {args.batch_size} must be a multiple of the {world} "
                        f"processes with at least 2 images per process")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        raise UserError(f"--device {args.device}: use cuda, cuda:N or cpu")
    device = torch.device(args.device)
    if device.type == "cuda":
        count = torch.cuda.device_count()
        if device.index is None:  # torchrun: a GPU per local rank; or the one GPU a process sees
            device = torch.device("cuda", local_rank if count > 1 else 0)
        if device.index >= count:
            raise UserError(f"--device {device}, but {count} CUDA GPU(s) are visible here")
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                device_id=device if device.type == "cuda" else None)
    amp = device.type == "cuda" and (args.amp if args.amp is not None else
                                     torch.cuda.is_bf16_supported(including_emulation=False))
    return Context(rank, world, local_rank, device, args.out, amp)


def rank():
    return dist.get_rank() if dist.is_initialized() else 0


def world_size():
    return dist.get_world_size() if dist.is_initialized() else 1


class _GatherWithGrad(torch.autograd.Function):
    """all_gather with a backward (dist.all_gather has none: the other ranks' rows would get no
    gradient). Every rank's loss uses my rows: their gradient is all_reduce(SUM), my slice."""

    @staticmethod
    def forward(ctx, x):
        return gather(x)

    @staticmethod
    def backward(ctx, grad):
        grad, rows = all_reduce_sum(grad.contiguous()), grad.shape[0] // dist.get_world_size()
        return grad[dist.get_rank() * rows:(dist.get_rank() + 1) * rows]


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


class GatherBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm over every rank's batch for CPU (gloo) runs, where torch's SyncBatchNorm does not
    run: the ranks' inputs are gathered with gradient and normalised as one batch, of which each
    rank keeps its own rows. Every rank repeats the whole batch's work: CPU runs are small."""

    def _check_input_dim(self, x):  # (B, C) and (B, C, H, W) alike
        pass

    def forward(self, x):
        if not self.training:
            return super().forward(x)
        mine = slice(rank() * len(x), (rank() + 1) * len(x))
        return super().forward(gather_with_grad(x))[mine]


def sync_batchnorm(module, ctx):
    """Every BatchNorm of `module`, in place, over the global batch (SyncBatchNorm on CUDA)."""
    if ctx.world == 1:
        return module
    if ctx.device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(module)
    for name, child in module.named_children():
        if isinstance(child, nn.modules.batchnorm._BatchNorm):
            synced = GatherBatchNorm(child.num_features, child.eps, child.momentum, child.affine)
            synced.load_state_dict(child.state_dict())
            setattr(module, name, synced.to(child.running_mean))
        else:
            sync_batchnorm(child, ctx)
    return module


def distribute(model, ctx):
    """Global BatchNorm, channels_last on CUDA, DDP across processes -> the module to call
    (`model` itself stays the bare module, whose state_dict has no 'module.' prefix)."""
    model = sync_batchnorm(model, ctx)
    if ctx.device.type == "cuda":
        model = model.to(memory_format=torch.channels_last)
    if ctx.world == 1:
        return model
    # global BatchNorm keeps the buffers equal on every rank: nothing to broadcast each step
    # (torch 2.14 renamed broadcast_buffers to forward_sync_buffers)
    ddp = nn.parallel.DistributedDataParallel
    no_sync = {"forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(ddp).parameters
               else "broadcast_buffers": False}
    return ddp(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
               **no_sync)


def compile_model(net, ctx):
    """torch.compile on one process only: compiling DDP with SyncBatchNorm has open upstream
    failures, and no multi-GPU run of this project has passed with it yet."""
    if ctx.world > 1:
        warnings.warn("--compile is ignored with more than one process (DDP + SyncBatchNorm)")
        return net
    return torch.compile(net)


def to_device(t, device):
    """A CPU tensor -> `device` without a host sync: from pageable memory CUDA first waits for all
    queued GPU work; from pinned memory the copy is queued like a kernel."""
    return (t.pin_memory() if device.type == "cuda" else t).to(device, non_blocking=True)


def float32(t):
    """The loss's precision: bf16 outputs of autocast -> float32; float32 and float64 unchanged."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


# ------------------------------------------------------------------------------ ResNet
class ResNet(nn.Module):
    """ResNet-18/34/50 backbone: image (B, 3, S, S) -> features (B, out_dim), no classifier.
    Written out, not torchvision's class, so that `width` (--width) can shrink every layer; its
    blocks and names are torchvision's: at width 64 the weights load into torchvision's resnet
    (fc dropped). Up to 64 px the CIFAR stem (3x3 stride-1 conv, no max-pool): the ImageNet one
    would shrink 32 px to 8 before layer1."""
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


# ------------------------------------------------------------------------------ data
STATS = {"cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
         "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
         "stl10": ((0.4467, 0.4398, 0.4066), (0.2603, 0.2566, 0.2713)),
         "imagefolder": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))}


@dataclass
class Data:
    """The pre-training set and two evaluation splits, labels -1 where unlabelled. On the device:
    `train` uint8 (N, 3, S, S), the splits (images, labels), eval_train sharing train's tensor
    where they are the same images. Streaming: ImageFiles that DataLoader workers decode."""
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
    """--dataset as Data; `crops`: random crops per image that a streaming train set makes."""
    mean, std = STATS[args.dataset]
    size = {"cifar10": 32, "cifar100": 32, "stl10": 96}.get(args.dataset, args.image_size or 224)
    if args.dataset == "imagefolder":
        data = image_folder(args, ctx, size, mean, std, crops)
    elif args.image_size not in (None, size):
        raise UserError(f"--image-size {args.image_size}: {args.dataset} images are {size} px")
    elif args.dataset == "stl10":  # pre-train on train+unlabeled, evaluate on the labelled splits
        train = torchvision_split(args, ctx, args.limit_train, split="train+unlabeled")
        data = Data(*train, torchvision_split(args, ctx, args.limit_train, split="train"),
                    torchvision_split(args, ctx, None, split="test"), 10, size, mean, std)
    else:
        train = torchvision_split(args, ctx, args.limit_train, train=True)
        data = Data(*train, train, torchvision_split(args, ctx, None, train=False),
                    100 if args.dataset == "cifar100" else 10, size, mean, std)
    if data.streaming and args.linear_aug and args.linear_epochs:
        raise UserError("--linear-aug needs the data set held on the device (not --stream); "
                        "use --no-linear-aug, or --linear-epochs 0")
    if len(data) < args.batch_size:
        raise UserError(f"--batch-size {args.batch_size} is more than the {len(data)} training "
                        f"images; use a smaller batch")
    return data


# A node whose gloo cannot reach the others (wrong interface: GLOO_SOCKET_IFNAME) fails after
# CONNECT_TIMEOUT; the others wait up to DOWNLOAD_TIMEOUT for the slowest node's download.
CONNECT_TIMEOUT = datetime.timedelta(minutes=5)
DOWNLOAD_TIMEOUT = datetime.timedelta(hours=6)


def torchvision_split(args, ctx, limit, **split):
    """CIFAR/STL-10 as uint8 (N, 3, S, S) and labels on the device. Each node's first process
    downloads (no shared file system needed; into a shared --data-dir one node at a time, under
    its file lock); then every rank learns whether every node has the data, and all stop together
    if not. Their gloo group connects before the download, so a node that cannot reach the others
    fails within CONNECT_TIMEOUT, not after the DOWNLOAD_TIMEOUT a slow download may take."""
    cls = {"cifar10": torchvision.datasets.CIFAR10, "cifar100": torchvision.datasets.CIFAR100,
           "stl10": torchvision.datasets.STL10}[args.dataset]
    group = data_group(ctx) if ctx.world > 1 else None
    ready = torch.ones(1)
    if ctx.local_rank == 0:
        with data_dir_lock(args.data_dir):
            try:
                cls(args.data_dir, download=True, **split)
            except Exception:  # URLError, RuntimeError("Dataset not found or corrupted"), ...
                ready.zero_()
    if group is not None:  # a barrier with its own time-out: the group's is CONNECT_TIMEOUT
        dist.monitored_barrier(group, timeout=DOWNLOAD_TIMEOUT)
        dist.all_reduce(ready, op=dist.ReduceOp.MIN, group=group)
        dist.destroy_process_group(group)
    if not ready.item():
        raise UserError(f"no {args.dataset} in {args.data_dir} and it could not be downloaded; "
                        f"put {cls.filename} or its extracted {cls.base_folder}/ there")
    dataset = cls(args.data_dir, download=False, **split)
    images = torch.as_tensor(dataset.data)
    images = images.permute(0, 3, 1, 2) if images.shape[-1] == 3 else images  # CIFAR is NHWC
    labels = torch.as_tensor(dataset.labels if hasattr(dataset, "labels") else dataset.targets)
    return images[:limit].contiguous().to(ctx.device), labels[:limit].long().to(ctx.device)


def data_group(ctx):
    """A gloo group of every process (the data's flags are CPU tensors), connected now: one error
    line if some process cannot be reached within CONNECT_TIMEOUT."""
    try:
        group = dist.new_group(backend="gloo", timeout=CONNECT_TIMEOUT)
        dist.barrier(group=group)
    except RuntimeError as error:  # DistStoreError, gloo's connect and time-out errors
        raise UserError(f"the {ctx.world} processes did not all connect over gloo within "
                        f"{CONNECT_TIMEOUT.total_seconds():g} s to prepare the data "
                        f"({' '.join(str(error).split())[:120]}); on several nodes set "
                        f"GLOO_SOCKET_IFNAME to the network interface they reach each other on") \
            from None
    return group


@contextlib.contextmanager
def data_dir_lock(folder):
    """An exclusive lock (fcntl.flock) on FOLDER/.download.lock while the block runs: nodes that
    share --data-dir download and extract into it one at a time, the later ones finding the files
    and only checking them. No lock where the file cannot be made (a read-only folder) or the
    file system has no flock (Lustre without its flock option)."""
    try:
        os.makedirs(folder, exist_ok=True)
        lock = open(os.path.join(folder, ".download.lock"), "a")
    except OSError:
        yield
        return
    with lock:  # closing the file releases the lock
        with contextlib.suppress(OSError):
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def image_folder(args, ctx, size, mean, std, crops):
    folders = {}
    for split in ("train", "val"):
        root = os.path.join(args.data_dir, split)
        if not os.path.isdir(root):
            raise UserError(f"imagefolder: {root} does not exist; --data-dir needs train/ and "
                            f"val/ folders with one subfolder of images per class")
        try:
            folders[split] = torchvision.datasets.ImageFolder(root)
        except (FileNotFoundError, RuntimeError) as error:
            raise UserError(f"imagefolder: {root} has no images in class folders ({error})") \
                from None
        if len(folders[split].classes) < 2:
            raise UserError(f"imagefolder: {root} has {len(folders[split].classes)} class "
                            f"folder(s); kNN and linear evaluation need at least 2")
    if folders["train"].classes != folders["val"].classes:
        only = sorted(set(folders["train"].classes) ^ set(folders["val"].classes))
        raise UserError(f"imagefolder: train/ and val/ need the same class folders; "
                        f"{', '.join(only[:5])}{' ...' if len(only) > 5 else ''} only in one")
    train, val = folders["train"].samples, folders["val"].samples
    if args.limit_train and args.limit_train < len(train):  # spread over the class by class list
        train = [train[i * len(train) // args.limit_train] for i in range(args.limit_train)]
    labels = [torch.tensor([y for _, y in s], device=ctx.device) for s in (train, val)]
    classes = len(folders["train"].classes)
    if ctx.device.type == "cuda":  # decoded on the device if it takes at most half the free memory
        free = torch.cuda.mem_get_info(ctx.device)[0]
    else:  # CPU: the free host memory, which this node's processes share
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        free //= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if ctx.world > 1:  # one decision for all ranks: each sees its own free memory
        free = torch.tensor(free, device=ctx.device)
        dist.all_reduce(free, op=dist.ReduceOp.MIN)
        free = int(free)
    if args.stream or (len(train) + len(val)) * 3 * size * size > free // 2:
        return Data(ImageFiles(train, size, crops, args.crop_scale), labels[0],
                    ImageFiles(train, size), ImageFiles(val, size), classes, size, mean, std,
                    streaming=True)
    images = decode(train, size, args.workers, ctx)  # once: pre-training and kNN share it
    return Data(images, labels[0], (images, labels[0]),
                (decode(val, size, args.workers, ctx), labels[1]), classes, size, mean, std)


class ImageFiles(torch.utils.data.Dataset):
    """(path, label) list -> uint8 (3, S, S), shorter side resized to S and centre-cropped; with
    `crops`, uint8 (crops, 3, S, S) random resized crops and flips (the streaming train set:
    cropping in the workers keeps full-size images off the device; colour runs there batched)."""

    def __init__(self, samples, size, crops=0, scale=(0.08, 1.0)):
        self.samples, self.crops, self.seed = samples, crops, 0
        self.fixed = T.Compose([T.PILToTensor(), T.Resize(size, antialias=True),
                                T.CenterCrop(size)])
        self.random = T.Compose([T.PILToTensor(), T.RandomHorizontalFlip(),
                                 T.RandomResizedCrop(size, tuple(scale), antialias=True)])

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        path, label = self.samples[i]
        try:
            with Image.open(path) as image:
                if image.mode[0] in "IF":  # I;16, I, F: convert("RGB") would clip them to 8 bits
                    raise UserError(f"image {path} is {image.mode} (16-bit or float); convert "
                                    f"it to 8 bits per channel")
                image = image.convert("RGB")
        except (OSError, Image.DecompressionBombError) as error:  # UnidentifiedImageError too
            raise UserError(f"unreadable image {path} ({type(error).__name__}); remove or "
                            f"replace it") from None
        if not self.crops:
            return self.fixed(image), label
        with torch.random.fork_rng(devices=[]):  # the crops depend on (epoch seed, image) only:
            torch.manual_seed(self.seed + i)  # whichever rank or worker loads it, or a resumed run
            return torch.stack([self.random(image) for _ in range(self.crops)]), label


def decode(samples, size, workers, ctx):
    """Image files -> uint8 (N, 3, S, S) on every rank, each rank decoding its share."""
    share = -(-len(samples) // ctx.world)
    mine = ImageFiles(samples[ctx.rank * share:(ctx.rank + 1) * share], size)
    parts, error = [], ""
    try:
        parts = [x for x, _ in torch.utils.data.DataLoader(mine, 256, num_workers=workers)]
    except UserError as e:
        error = str(e)
    errors = [error] * ctx.world
    if ctx.world > 1:  # every rank stops at an unreadable file, not in a broken all_gather
        dist.all_gather_object(errors, error)
    if any(errors):
        raise UserError(next(e for e in errors if e))
    images = torch.cat(parts + [torch.zeros(share - len(mine), 3, size, size, dtype=torch.uint8)])
    return gather(images.to(ctx.device))[:len(samples)]  # padded: all_gather needs equal shares


def epoch_generators(seed, epoch, device):
    """This epoch's generators from (seed, epoch), so a resumed run draws as an uninterrupted one:
    data order and pairings on the CPU (CUDA's random kernels depend on the GPU model), and one
    for augmentation on the device."""
    seed = 2 * (seed * 100003 + epoch)
    return torch.Generator().manual_seed(seed), torch.Generator(device).manual_seed(seed + 1)


def train_batches(data, batch_size, generator, ctx, workers=0):
    """This rank's slice of each global batch of one epoch: (images, labels), uint8 (b, 3, S, S)
    on the device, or (b, crops, 3, S, S) pre-cropped when streaming. The order comes from
    `generator` (CPU), seeded alike everywhere: rank r takes rows [r*b, (r+1)*b) of the batch."""
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


def colour_jitter(x, brightness, contrast, saturation, hue=None):
    """torchvision's ColorJitter ops in a fixed order (torchvision shuffles it per call), a factor
    (B,) per image for each (1: unchanged; `hue` in turns, None: skipped); the first three blend x
    with black, its mean grey, its grey."""
    b, c, s = (f.view(-1, 1, 1, 1) for f in (brightness, contrast, saturation))
    x = (b * x).clamp(0, 1)
    x = (c * x + (1 - c) * grayscale(x).mean(dim=(1, 2, 3), keepdim=True)).clamp(0, 1)
    x = (s * x + (1 - s) * grayscale(x)).clamp(0, 1)
    return x if hue is None else adjust_hue(x, hue)


def adjust_hue(x, shift):
    """Rotate the hue by `shift` (B,) turns through HSV, as torchvision does: hue h6 in [0, 6)
    from the channel holding the maximum v; back to RGB, channel n of (R, G, B) is
    v - chroma * clamp(min(k, 4 - k), 0, 1) with k = (n + h6) mod 6, n = 5, 3, 1."""
    r, g, b = x.unbind(1)
    minimum, value = torch.aminmax(x, dim=1)  # (B, H, W) each
    chroma = value - minimum
    c = torch.where(chroma > 0, chroma, 1.0)
    hue = torch.where(value == r, g - b,  # 6 * hue * c; ties: red, then green, then blue
                      torch.where(value == g, b - r + 2 * c, r - g + 4 * c)) / c
    hue = (hue + 6 * shift.view(-1, 1, 1)).remainder(6)  # (B, H, W) rotated, in [0, 6)
    k = hue.unsqueeze(1) + torch.arange(5, 0, -2, device=x.device, dtype=x.dtype).view(1, 3, 1, 1)
    k = torch.where(k >= 6, k - 6, k)  # (B, 3, H, W)
    ramp = torch.minimum(k, 4 - k).clamp(0, 1)
    return value.unsqueeze(1) - chroma.unsqueeze(1) * ramp


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


def solarize(x, threshold=0.5):
    return torch.where(x >= threshold, 1 - x, x)


def sample_crop_boxes(rand, n, height, width, scale, ratio, tries=10):
    """RandomResizedCrop's box sampler, batched -> top, left, h, w as (n,) float tensors. As in
    torchvision: of `tries` draws of (area, log-ratio) the first that fits wins, else a centre
    crop with the ratio clamped into range. `rand(shape)` gives uniforms in [0, 1)."""
    area = height * width * (scale[0] + (scale[1] - scale[0]) * rand((n, tries)))
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    aspect = torch.exp(log_lo + (log_hi - log_lo) * rand((n, tries)))
    w, h = torch.round(torch.sqrt(area * aspect)), torch.round(torch.sqrt(area / aspect))
    fits = (w > 0) & (h > 0) & (w <= width) & (h <= height)
    first = fits.float().argmax(1, keepdim=True)  # the first draw that fits
    w, h, found = w.gather(1, first)[:, 0], h.gather(1, first)[:, 0], fits.any(1)
    fw, fh = width, height  # the fallback: the whole image, cut to the nearest allowed ratio
    if width / height < ratio[0]:
        fh = round(width / ratio[0])
    elif width / height > ratio[1]:
        fw = round(height * ratio[1])
    w, h = torch.where(found, w, float(fw)), torch.where(found, h, float(fh))
    u, v = rand((n,)), rand((n,))
    top = torch.where(found, torch.floor(u * (height - h + 1)), torch.floor((height - h) / 2))
    left = torch.where(found, torch.floor(v * (width - w + 1)), torch.floor((width - w) / 2))
    return top, left, h, w


def resized_crop_flip(x, top, left, h, w, flip, size):
    """Crop each sample's box, resize it to `size` bilinearly and mirror it where `flip`, in one
    grid_sample. The affine map sends the output's [-1, 1] square onto the box; with
    align_corners=False it samples where torchvision's resized_crop (no antialias) samples."""
    B, _, H, W = x.shape
    zero = torch.zeros_like(w)
    theta = torch.stack([torch.where(flip, -w / W, w / W), zero, (2 * left + w) / W - 1,
                         zero, h / H, (2 * top + h) / H - 1], 1).view(B, 2, 3).to(x)
    grid = F.affine_grid(theta, (B, 3, size, size), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)


def normalize(x, mean, std):
    """Images in [0, 1] (B, 3, H, W) -> standardised per channel (channels_last on CUDA)."""
    mean = torch.as_tensor(mean, device=x.device).view(1, 3, 1, 1)
    x = (x - mean) / torch.as_tensor(std, device=x.device).view(1, 3, 1, 1)
    return x.contiguous(memory_format=torch.channels_last) if x.is_cuda else x


class Augment:
    """Batched augmentation on the device, a Recipe per view, with random parameters per sample
    (transforms.v2 on a batch draws one set for all), drawn for the global batch from a generator
    seeded alike on every rank: each rank keeps its rows, so N processes augment as one does."""

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
            factors = [1 - s + 2 * s * rand(b) for s in r.jitter[:3]]
            hue = r.jitter[3] * (2 * rand(b) - 1) if r.jitter[3] > 0 else None
            x = torch.where(jitter.view(-1, 1, 1, 1), colour_jitter(x, *factors, hue), x)
        if r.gray_p > 0:
            x = where(r.gray_p, grayscale(x).expand_as(x), x)
        if r.blur_p > 0:
            sigma = r.blur_sigma[0] + (r.blur_sigma[1] - r.blur_sigma[0]) * rand(b)
            kernel = (self.size // 10) | 1  # odd, about 10% of the image (SimCLR's 23 px at 224)
            x = where(r.blur_p, gaussian_blur(x, sigma, kernel), x)
        if r.solarize_p > 0:
            x = where(r.solarize_p, solarize(x), x)
        return normalize(x, self.mean, self.std)


# ------------------------------------------------------------------------------ evaluation
@torch.no_grad()
def extract_features(backbone, split, data, ctx, workers=0, unit=True):
    """Features (L2-normalised if `unit`) of un-augmented images, ranks sharing the work, gathered
    on every rank -> (N', F), (N',), N' = world * ceil(N / world), padding labelled -1. float16
    on CUDA (ImageNet: 1.28M x 2048 x 2 bytes = 5.2 GB on every rank), float32 on CPU."""
    was_training, device = backbone.training, ctx.device
    n = len(split[1]) if isinstance(split, tuple) else len(split)
    share = -(-n // ctx.world)
    lo, hi = min(ctx.rank * share, n), min((ctx.rank + 1) * share, n)
    batches = zip(*(t[lo:hi].split(256) for t in split)) if isinstance(split, tuple) else \
        torch.utils.data.DataLoader(torch.utils.data.Subset(split, range(lo, hi)), 256,
                                    num_workers=workers)
    features = torch.zeros(share, backbone.out_dim, device=device,
                           dtype=torch.float16 if device.type == "cuda" else torch.float32)
    labels = torch.full((share,), -1, dtype=torch.long, device=device)
    backbone.eval()
    for i, (images, y) in enumerate(batches):  # batches of 256
        with ctx.autocast():
            f = backbone(normalize(images.to(device).float() / 255, data.mean, data.std)).float()
        features[256 * i:256 * i + len(y)] = F.normalize(f, dim=1) if unit else f
        labels[256 * i:256 * i + len(y)] = y
    backbone.train(was_training)
    return gather(features), gather(labels)


@torch.no_grad()
def knn_accuracy(train_f, train_y, test_f, test_y, num_classes, k=200, t=0.1, ctx=None):
    """Weighted kNN (InstDisc / MoCo monitor): the k most cosine-similar training features vote
    with weight exp(sim / t); rows labelled -1 take no part; ranks split the test set -> top-1 %."""
    world, rank = (ctx.world, ctx.rank) if ctx else (1, 0)
    k, unlabelled, share = min(k, int((train_y >= 0).sum())), train_y < 0, -(-len(test_y) // world)
    correct = torch.zeros((), device=test_f.device)
    for i in range(rank * share, min((rank + 1) * share, len(test_y)), 256):
        stop = min(i + 256, (rank + 1) * share, len(test_y))
        sim = (test_f[i:stop] @ train_f.T).float().masked_fill_(unlabelled, -math.inf)  # (b, N)
        sim, idx = sim.topk(k, dim=1)  # (b, k)
        votes = torch.zeros(stop - i, num_classes, device=test_f.device)
        votes.scatter_add_(1, train_y[idx], torch.exp(sim / t))
        correct += (votes.argmax(1) == test_y[i:stop]).sum()
    return 100.0 * all_reduce_sum(correct).item() / int((test_y >= 0).sum())


def linear_probe(train_f, train_y, test_f, test_y, num_classes, epochs=100, seed=0, batch=256):
    """A linear classifier on frozen features standardised with the training set's mean and std,
    AdamW + cosine -> test top-1 %. Every rank computes the same from the same features."""
    rows, test_rows = (train_y >= 0).nonzero()[:, 0], (test_y >= 0).nonzero()[:, 0]
    total = 0
    for r in rows.split(65536):  # in chunks: no float32 copy of a float16 bank
        f = train_f[r].float()
        total = total + torch.stack([f.sum(0), (f * f).sum(0)])
    mean = total[0] / len(rows)
    std = (total[1] / len(rows) - mean ** 2).clamp_min(0).sqrt() + 1e-6
    classifier = nn.Linear(train_f.shape[1], num_classes).to(train_f.device)
    nn.init.zeros_(classifier.weight)  # a convex problem: a zero start, no random draw
    optimizer = torch.optim.AdamW(classifier.parameters(), lr=1e-3, weight_decay=5e-4)
    steps = epochs * -(-len(rows) // batch)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    generator = torch.Generator(device=train_f.device).manual_seed(seed)
    for _ in range(epochs):
        perm = rows[torch.randperm(len(rows), generator=generator, device=rows.device)]
        for r in perm.split(batch):
            loss = F.cross_entropy(classifier((train_f[r].float() - mean) / std), train_y[r])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
    with torch.no_grad():
        predict = lambda r: classifier((test_f[r].float() - mean) / std).argmax(1)  # noqa: E731
        correct = sum(int((predict(r) == test_y[r]).sum()) for r in test_rows.split(65536))
    return 100.0 * correct / len(test_rows)


def linear_probe_augmented(backbone, data, ctx, epochs=90, lr=30.0, seed=0, batch=256):
    """The probe of MoCo's and SimSiam's main_lincls.py, which GSG uses: a linear layer on the
    frozen backbone, trained on crop+flip views, SGD momentum 0.9, no weight decay, cosine."""
    images, labels = data.eval_train  # labelled: batches drawn as pre-training draws its own
    batch = max(1, batch // ctx.world) * ctx.world  # a multiple of the processes
    probe_set = replace(data, train=images, train_labels=labels)
    backbone.eval()
    classifier = nn.Linear(backbone.out_dim, data.num_classes).to(ctx.device)
    nn.init.zeros_(classifier.weight)
    optimizer = torch.optim.SGD(classifier.parameters(), lr=lr * batch / 256, momentum=0.9)
    steps = max(1, epochs * (len(labels) // batch))
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    augment = Augment([Recipe(jitter=(0, 0, 0, 0), gray_p=0)], data.image_size, data.mean,
                      data.std, ctx)
    for epoch in range(epochs):
        order, generator = epoch_generators(seed + 1, epoch, ctx.device)
        for x, y in train_batches(probe_set, batch, order, ctx):
            views = augment(x, generator)[0]  # in float32, as in pre-training
            with torch.no_grad(), ctx.autocast():
                features = backbone(views)
            loss = F.cross_entropy(classifier(features.float()), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            for p in classifier.parameters():  # the mean gradient over the global batch
                p.grad = all_reduce_sum(p.grad) / ctx.world
            optimizer.step()
            schedule.step()
    test_f, test_y = extract_features(backbone, data.eval_test, data, ctx, unit=False)
    with torch.no_grad():  # features as in training: bf16 backbone, float32 classifier
        correct = (classifier(test_f.float()).argmax(1) == test_y).sum()
    return 100.0 * int(correct) / int((test_y >= 0).sum())


def evaluate(backbone, data, ctx, args, final=False):
    """kNN top-1 (k = --knn-k); with `final` also k=1 and the linear probe (--linear-epochs)."""
    train_f, train_y = extract_features(backbone, data.eval_train, data, ctx, args.workers)
    test_f, test_y = extract_features(backbone, data.eval_test, data, ctx, args.workers)
    knn = lambda k: knn_accuracy(train_f, train_y, test_f, test_y, data.num_classes, k,  # noqa
                                 args.knn_t, ctx)
    result = {"knn_top1": knn(args.knn_k)}
    if final:
        result.update(knn_k=args.knn_k, knn_k1_top1=knn(1))
        if args.linear_epochs and args.linear_aug:
            result["linear_top1"] = linear_probe_augmented(backbone, data, ctx, args.linear_epochs,
                                                           args.linear_lr, args.seed)
            result["linear_protocol"] = "augmented SGD"
        elif args.linear_epochs:
            result["linear_top1"] = linear_probe(train_f, train_y, test_f, test_y,
                                                 data.num_classes, args.linear_epochs, args.seed)
            result["linear_protocol"] = "fixed features AdamW"
    return result


# ------------------------------------------------------------------------------ training loop
def learning_rate(step, total_steps, warmup_steps, peak, schedule="cosine"):
    """Linear warm-up to `peak`, then cosine decay to 0 (or constant)."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    if schedule == "constant":
        return peak
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


class EpochMeter:
    """The epoch's progress bar (this rank's mean loss, lr, images/s; the host syncs only every
    `every` steps) and, from summary(), each scalar's mean over steps and ranks."""

    def __init__(self, ctx, epoch, epochs, steps, images_per_step, every=20):
        self.ctx, self.epoch, self.every, self.images_per_step = ctx, epoch, every, images_per_step
        self.sums, self.steps, self.lr = {}, 0, 0.0
        self.bar = tqdm(total=steps, desc=f"epoch {epoch + 1}/{epochs}", disable=ctx.rank != 0,
                        dynamic_ncols=True, leave=False)
        self.start = self.last = time.perf_counter()

    def update(self, lr, **scalars):
        self.steps, self.lr = self.steps + 1, lr
        for name, value in scalars.items():
            self.sums[name] = self.sums.get(name, 0) + value.detach().float()
        if self.steps % self.every == 0:
            now, loss = time.perf_counter(), self.sums["loss"].item() / self.steps
            rate = self.every * self.images_per_step / (now - self.last)
            self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.4g}", img_s=f"{rate:.0f}")
            self.bar.update(self.every)
            self.last = now

    def summary(self):
        self.bar.close()
        seconds = time.perf_counter() - self.start
        means = {k: all_reduce_sum(s).item() / (self.steps * self.ctx.world)
                 for k, s in self.sums.items()}
        return {"epoch": self.epoch + 1, **means, "lr": self.lr,
                "images_per_s": self.steps * self.images_per_step / seconds, "seconds": seconds}


def check_finite(record):
    if not math.isfinite(record["loss"]):
        kept = f"epoch {record['epoch'] - 1}'s checkpoint is kept" if record["epoch"] > 1 else \
            "no checkpoint was written"
        raise UserError(f"loss became {record['loss']} in epoch {record['epoch']}; {kept}; lower "
                        f"--lr, check --wd and the temperatures, or try --no-amp")


def log_epoch(ctx, record):
    if ctx.rank == 0:
        with open(os.path.join(ctx.out, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")
        ctx.print("  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                            for k, v in record.items()))


# ------------------------------------------------------------------------------ run folder
def start_run(args, ctx, script):
    """Create the run folder and its config.json (a resumed run keeps its own). Called once the
    data and the model are ready, so that a run that fails to start leaves nothing behind."""
    if ctx.rank != 0 or args.resume:
        return
    try:
        os.makedirs(ctx.out, exist_ok=True)
        open(os.path.join(ctx.out, "metrics.jsonl"), "w").close()  # empty, if a run started here
    except OSError as error:
        raise UserError(f"--out {ctx.out}: cannot write there ({error.strerror})") from None
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        commit = None
    config = {"script": script, "args": vars(args), "world_size": ctx.world, "command": sys.argv,
              "versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                           "git_commit": commit or None}}
    with open(os.path.join(ctx.out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def save_atomic(obj, path):
    """torch.save to a temp file, then os.replace: a crash mid-save never leaves a broken file."""
    torch.save(obj, path + ".tmp")
    os.replace(path + ".tmp", path)


def save_checkpoint(ctx, epoch, states):
    """checkpoint.pt: the epochs done and each named state_dict (model, optimizer, queue, ...)."""
    if ctx.rank == 0:
        state = {name: s.state_dict() for name, s in states.items() if s is not None}
        save_atomic({"epoch": epoch, **state}, os.path.join(ctx.out, "checkpoint.pt"))


def load_checkpoint(ctx, states):
    """Load each named state from the run folder's checkpoint.pt, and keep only the metrics lines
    of the epochs it holds -> the epoch to continue from."""
    path = os.path.join(ctx.out, "checkpoint.pt")
    if not os.path.exists(path):  # no epoch was saved: an --epochs 0 run, or one that failed
        if os.path.exists(os.path.join(ctx.out, "results.json")):
            return 0
        raise UserError(f"{ctx.out} has no checkpoint: its first epoch never ended; start it "
                        f"again with --out {ctx.out}")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise UserError(f"{path} is unreadable ({type(error).__name__}): it is truncated or not "
                        f"from this project; start a new --out") from None
    for name, state in states.items():
        # an optimizer keeps this run's fused/foreach choice, not the saving machine's
        flags = [{k: g[k] for k in ("fused", "foreach") if k in g}
                 for g in getattr(state, "param_groups", [])]
        try:
            state is None or state.load_state_dict(checkpoint[name])
        except (RuntimeError, KeyError, ValueError) as error:
            raise UserError(f"{path}: the saved {name} does not fit this model "
                            f"({' '.join(str(error).split())[:160]}); start a new --out") from None
        for group, flag in zip(getattr(state, "param_groups", []), flags):  # new dicts now
            group.update(flag)
        for p, buffers in getattr(state, "state", {}).items():  # a CPU run's momentum, resumed on
            for k, v in buffers.items():  # CUDA, takes channels_last like p (fused SGD needs it)
                if torch.is_tensor(v) and v.shape == p.shape:
                    buffers[k] = torch.empty_like(p).copy_(v)
    metrics = os.path.join(ctx.out, "metrics.jsonl")
    if ctx.rank == 0 and os.path.exists(metrics):  # a run stopped between log and save logged an
        with open(metrics) as f:  # epoch it now trains again (or half a line): those lines go
            lines = [line for line in f
                     if line.endswith("\n") and json.loads(line)["epoch"] <= checkpoint["epoch"]]
        with open(metrics, "w") as f:
            f.writelines(lines)
    ctx.print(f"resumed {ctx.out} at epoch {checkpoint['epoch']}")
    return checkpoint["epoch"]


def finish(ctx, backbone, results):
    """backbone.pt (CPU tensors, torchvision's names) and results.json, printing the accuracies.
    A finished run resumed with other evaluation options writes eval-<time>.json beside them."""
    if ctx.rank != 0:
        return
    path = os.path.join(ctx.out, "results.json")
    if os.path.exists(path):
        path = os.path.join(ctx.out, time.strftime("eval-%Y%m%d-%H%M%S.json"))
    else:
        weights = {k: v.cpu() for k, v in backbone.state_dict().items()}
        save_atomic(weights, os.path.join(ctx.out, "backbone.pt"))
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
    line = (f"final kNN top-1 (k={results['knn_k']}): {results['knn_top1']:.2f}%  "
            f"kNN top-1 (k=1): {results['knn_k1_top1']:.2f}%")
    if "linear_top1" in results:
        line += f"  linear probe top-1: {results['linear_top1']:.2f}%"
    ctx.print(f"{line}\nwritten to {path}")
