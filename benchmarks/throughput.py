"""Throughput benchmark: does the device ever wait? One table, every figure from this run on this device.

Rows of the table:
  aug   images/s of common.Augment (batched, per-sample parameters, the SimCLR recipe with hue) vs
        torchvision's per-image PIL pipeline for the same recipe in a DataLoader with one worker
        per core (on CPU ours runs on the same cores, as torch threads).
  step  images/s of each method file's REAL step (augmentation from uint8 images on the device, the
        file's train_step, EMA, queue / support set, the per-step scalars, exactly as its main() loop
        does) vs the BARE step: the same networks' forward/backward + SGD on pre-made views with a
        trivial loss. ratio = real / bare is the pipeline efficiency (1.0 = augmentation, loss and
        bookkeeping are free). `loss share` is the method's loss forward+backward, timed alone at the
        step's batch and projection size, as a fraction of the real step. `peak mem` is
        torch.cuda.max_memory_allocated during the real step (CPU: n/a; the process RSS peak is below).
  loss  each loss's forward+backward at batch B, D = 128, vs ONE (2B x D) @ (D x 2B) matmul forward
        (a loss needs at least three such products, forward and backward: 3x is the floor).

    python benchmarks/throughput.py --device cpu --width 16 --step-image-size 16        # the README's CPU table
    python benchmarks/throughput.py --device cuda --batch-size 512                      # one GPU, bf16 + channels_last
    python benchmarks/throughput.py --device cuda --method simco byol-gsg --compile     # a subset, torch.compile
"""
import argparse
import copy
import datetime
import importlib
import os
import platform
import resource
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import common  # noqa: E402

# name -> (method file, its options); default batch = the file's own default
METHODS = {
    "simclr-dcl": ("simclr_dcl", ["--loss", "dcl"]),
    "mocov2": ("moco_simmoco_simco", ["--method", "mocov2"]),
    "simmoco": ("moco_simmoco_simco", ["--method", "simmoco"]),
    "simco": ("moco_simmoco_simco", ["--method", "simco"]),
    "simsiam-gsg": ("simsiam_byol_gsg", ["--method", "simsiam", "--stopgrad", "guided"]),
    "byol-gsg": ("simsiam_byol_gsg", ["--method", "byol", "--stopgrad", "guided"]),
    "nnclr-dcl": ("nnclr_dcl", ["--loss", "dcl"]),
}
CIFAR_MEAN, CIFAR_STD = common.STATS["cifar10"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--method", nargs="+", default=["all"], choices=["all", *METHODS], help="methods of the step rows")
    p.add_argument("--batch-size", type=int, default=None, help="step rows: global batch (default: each method's own)")
    p.add_argument("--arch", default="resnet18", choices=["resnet18", "resnet34", "resnet50"])
    p.add_argument("--width", type=int, default=64, help="ResNet base width of the step rows")
    p.add_argument("--step-image-size", type=int, default=32, help="image side of the step rows")
    p.add_argument("--steps", type=int, default=10, help="timed steps per method (after --warmup)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 2, 5 with --compile)")
    p.add_argument("--compile", action="store_true", help="torch.compile the trained network, as the scripts' --compile")
    p.add_argument("--no-amp", action="store_true", help="CUDA: float32 instead of bf16 autocast")
    p.add_argument("--aug-batch", type=int, default=1024, help="images per call of the batched augmentation")
    p.add_argument("--aug-image-size", type=int, default=32, help="augmentation rows: image side (CIFAR: 32)")
    p.add_argument("--pil-images", type=int, default=None, help="images through the PIL pipeline (default 3000 per core)")
    p.add_argument("--loss-batches", type=int, nargs="*", default=[256, 512, 1024, 2048, 4096])
    p.add_argument("--loss-dim", type=int, default=128)
    p.add_argument("--reps", type=int, default=3, help="timed repetitions of each loss / augmentation (best kept)")
    p.add_argument("--skip", nargs="*", default=[], choices=["aug", "step", "loss"])
    args = p.parse_args(argv)
    if "all" in args.method:
        args.method = list(METHODS)
    if args.warmup is None:
        args.warmup = 5 if args.compile else 2
    return args


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


# ------------------------------------------------------------------------------ augmentation

class _PilCifar(torch.utils.data.Dataset):
    """CIFAR as torchvision serves it: uint8 HWC array -> PIL image -> the per-image transform."""

    def __init__(self, images, transform):
        self.images, self.transform = images, transform

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        from PIL import Image
        return self.transform(Image.fromarray(self.images[i])), 0


def pil_rate(size, n, workers):
    """images/s of the standard torchvision (v1, PIL) SimCLR CIFAR recipe in a DataLoader."""
    import torchvision.transforms as T
    r = common.Recipe()
    transform = T.Compose([
        T.RandomResizedCrop(size, scale=r.crop_scale, ratio=r.crop_ratio), T.RandomHorizontalFlip(r.flip_p),
        T.RandomApply([T.ColorJitter(*r.jitter)], p=r.jitter_p), T.RandomGrayscale(r.gray_p),
        T.ToTensor(), T.Normalize(CIFAR_MEAN, CIFAR_STD)])
    images = torch.randint(0, 256, (n, size, size, 3), dtype=torch.uint8).numpy()
    loader = torch.utils.data.DataLoader(_PilCifar(images, transform), batch_size=256, num_workers=workers,
                                         persistent_workers=workers > 0)
    for _ in loader:  # start the workers (not timed)
        break
    start = time.perf_counter()
    count = sum(len(x) for x, _ in loader)
    return count / (time.perf_counter() - start)


def augmentation_rows(args, ctx):
    cores = os.cpu_count() or 1
    s, b = args.aug_image_size, args.aug_batch
    augment = common.Augment([common.Recipe()], s, CIFAR_MEAN, CIFAR_STD, ctx)
    images = torch.randint(0, 256, (b, 3, s, s), dtype=torch.uint8, device=ctx.device)
    generator = torch.Generator(device=ctx.device).manual_seed(0)
    ours = b / best_time(lambda: augment(images, generator), ctx.device, args.reps)
    pil = pil_rate(s, args.pil_images or 3000 * cores, cores)
    where = f"{torch.get_num_threads()} threads" if ctx.device.type == "cpu" else str(ctx.device)
    return [("aug", f"SimCLR recipe incl. hue, {s} px, one view; ours on {where} vs PIL in {cores} workers",
             b, f"{ours:,.0f} img/s", f"{pil:,.0f} img/s", f"{ours / pil:.1f}x", "", "", "")]


# ------------------------------------------------------------------------------ training steps

class Bench:
    """One method built as its main() builds it: `real(images, labels, generator, step)` is the body of
    main()'s loop, `bare(views)` the networks alone, `loss()` the loss alone at the step's shapes."""

    def __init__(self, name, args, ctx):
        module_name, options = METHODS[name]
        self.mod = mod = importlib.import_module(module_name)
        argv = [*options, "--arch", args.arch, "--width", str(args.width), "--device", ctx.device.type]
        if args.batch_size:
            argv += ["--batch-size", str(args.batch_size)]
        if args.compile:
            argv += ["--compile"]
        self.a = a = mod.parse_args(argv)
        a.image_size = args.step_image_size
        self.ctx, self.sums = ctx, {}
        build = {"simclr_dcl": self.simclr, "moco_simmoco_simco": self.moco, "simsiam_byol_gsg": self.siamese,
                 "nnclr_dcl": self.nnclr}[module_name]
        build(mod, a, ctx)
        self.peak_lr = a.lr * a.batch_size / 256
        # fused SGD where the scripts use it (CUDA), exactly the scripts' optimizer
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=self.peak_lr, momentum=0.9,
                                         weight_decay=a.wd, fused=ctx.device.type == "cuda")

    def accumulate(self, **scalars):  # EpochMeter.update without the bar: device-side sums, no sync
        for k, v in scalars.items():
            v = v.detach().float()
            self.sums[k] = self.sums[k] + v if k in self.sums else v

    def set_lr(self, step, total=1000):
        lr = common.learning_rate(step, total, self.a.warmup_epochs, self.peak_lr)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def bare_update(self, loss):
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()

    # -- one builder per method file, mirroring its main()
    def simclr(self, mod, a, ctx):
        self.model = mod.SimCLR(a.arch, a.width, a.image_size, a.proj_hidden, a.proj_dim).to(ctx.device)
        self.net = common.distribute(self.model, ctx, a.compile)
        self.augment = common.Augment([mod.recipe(a), mod.recipe(a)], a.image_size, CIFAR_MEAN, CIFAR_STD, ctx)

        def real(images, labels, generator, step):
            self.set_lr(step)
            loss, q = mod.train_step(self.net, self.optimizer, self.augment(images, generator), a, ctx)
            self.accumulate(loss=loss, npc_mean=q.mean(), npc_sq=(q * q).mean())

        def bare(views):
            with ctx.autocast():
                z = self.net(torch.cat(views))
            self.bare_update(z.float().mean())

        def loss(z1, z2):
            return mod.contrastive_loss(z1, z2, a.temperature, a.loss, a.sigma)
        self.real, self.bare, self.loss_fn, self.loss_dim = real, bare, loss, a.proj_dim

    def moco(self, mod, a, ctx):
        self.model = mod.Encoder(a.arch, a.width, a.image_size, a.proj_hidden, a.proj_dim).to(ctx.device)
        key_encoder = mod.momentum_encoder(self.model, ctx) if a.method != "simco" else None
        queue = mod.KeyQueue(a.queue_size, a.proj_dim).to(ctx.device) if a.method == "mocov2" else None
        self.net = common.distribute(self.model, ctx, a.compile)
        self.augment = common.Augment([mod.recipe(a), mod.recipe(a)], a.image_size, CIFAR_MEAN, CIFAR_STD, ctx)

        def real(images, labels, generator, step):
            self.set_lr(step)
            views = self.augment(images, generator)
            loss, (wa, wb, h) = mod.train_step(self.net, self.optimizer, views, a, ctx, key_encoder, queue)
            self.accumulate(loss=loss, w_alpha=wa, w_beta=wb, r_plus_entropy=h)

        def bare(views):
            with ctx.autocast():
                if key_encoder is None:
                    out = self.net(torch.cat(views))
                else:
                    out = self.net(views[0])
                    with torch.no_grad():
                        key_encoder(views[1])
            self.bare_update(out.float().mean())

        def loss(z1, z2):
            if a.method == "simco":
                return (mod.dual_temperature_loss(z1, z2, a.tau_alpha, a.tau_beta)
                        + mod.dual_temperature_loss(z2, z1, a.tau_alpha, a.tau_beta)) / 2
            return mod.dual_temperature_loss(z1, z2.detach(), a.tau_alpha, a.tau_beta,
                                             queue.keys if queue is not None else None)
        self.real, self.bare, self.loss_fn, self.loss_dim = real, bare, loss, a.proj_dim

    def siamese(self, mod, a, ctx):
        self.model = mod.SiameseNet(a.arch, a.width, a.image_size, a.proj_hidden, a.proj_dim, a.pred_hidden,
                                    predictor=not a.no_predictor).to(ctx.device)
        target = None
        if a.method == "byol":
            target = common.sync_batchnorm(copy.deepcopy(self.model.encoder), ctx).requires_grad_(False)
            if ctx.device.type == "cuda":
                target = target.to(memory_format=torch.channels_last)
        self.net = common.distribute(self.model, ctx, a.compile)
        target_net = torch.compile(target) if a.compile and target is not None else target
        self.augment = common.Augment([mod.recipe(a, 0), mod.recipe(a, 1)], a.image_size, CIFAR_MEAN, CIFAR_STD, ctx)

        def real(images, labels, generator, step):  # simsiam_byol_gsg.main's loop body
            self.set_lr(step)
            views = self.augment(images, generator)
            partner, random_case = mod.draw_pairing(a.batch_size, a.stopgrad, generator, ctx)
            loss, case, proj_std = mod.train_step(self.net, target_net, self.optimizer, views, partner,
                                                  random_case, a, ctx)
            if target is not None:
                mod.ema_update(target, self.model.encoder, mod.ema_momentum(step, 1000, a.ema, a.ema_schedule))
            scalars = {"loss": loss, "proj_std": proj_std}
            if case is not None:
                counts = torch.bincount(case, minlength=4).float() / len(case)
                scalars.update({f"case_{n}": counts[c] for c, n in enumerate(mod.CASES)})
            self.accumulate(**scalars)

        def bare(views):
            with ctx.autocast():
                outs = self.net(*views)
                if target_net is not None:
                    with torch.no_grad():
                        target_net(views[0]), target_net(views[1])
            self.bare_update(sum(o.float().mean() for o in outs))

        def loss(z1, z2):  # z1, z2 stand for the predictions; the targets are detached copies
            b = len(z1)
            partner = torch.randperm(b, device=z1.device)
            if a.stopgrad == "symmetric":
                return mod.symmetric_loss(z1, z2, z2.detach(), z1.detach())
            return mod.global_guided_loss(z1, z2, z2.detach(), z1.detach(), partner, a.stopgrad)[0]
        self.real, self.bare, self.loss_fn, self.loss_dim = real, bare, loss, a.proj_dim

    def nnclr(self, mod, a, ctx):
        self.model = mod.NNCLR(a.arch, a.width, a.image_size, a.proj_hidden, a.proj_dim, a.pred_hidden).to(ctx.device)
        self.net = common.distribute(self.model, ctx, a.compile)
        support_set = mod.SupportSet(a.support_size, a.proj_dim, ctx.device, a.seed)
        self.augment = common.Augment(mod.recipes(a), a.image_size, CIFAR_MEAN, CIFAR_STD, ctx)

        def real(images, labels, generator, step):
            self.set_lr(step)
            views = self.augment(images, generator)
            loss, same_class, labelled = mod.train_step(self.net, self.optimizer, views, labels, support_set, a, ctx)
            self.accumulate(loss=loss, same_class=same_class, labelled=labelled)

        def bare(views):
            with ctx.autocast():
                z, p = self.net(torch.cat(views))
            self.bare_update(z.float().mean() + p.float().mean())

        def loss(z1, z2):  # z1, z2 stand for both the projections and the predictions
            return mod.nnclr_loss(z1.detach(), z2.detach(), z1, z2, support_set.z, a.temperature, a.loss, a.sigma)
        self.real, self.bare, self.loss_fn, self.loss_dim = real, bare, loss, a.proj_dim


def loss_time(loss_fn, b, d, device, reps):
    """Forward + backward of loss_fn on two (b, d) float32 inputs that need a gradient, best of reps."""
    g = torch.Generator(device=device).manual_seed(0)
    z1 = torch.randn(b, d, device=device, generator=g).requires_grad_()
    z2 = (z1.detach() + torch.randn(b, d, device=device, generator=g)).requires_grad_()

    def run():
        z1.grad = z2.grad = None
        loss_fn(z1, z2).backward()
    return best_time(run, device, reps)


def step_rows(args, ctx):
    rows = []
    for name in args.method:
        try:
            bench = Bench(name, args, ctx)
        except Exception as error:  # e.g. a method file still being written
            rows.append(("step", name, "", f"n/a: {type(error).__name__}: {error}"[:90], "", "", "", "", ""))
            continue
        a, s = bench.a, args.step_image_size
        n = (args.warmup + args.steps) * a.batch_size
        # main()'s data path: uint8 images on the device, a permutation per epoch, rows gathered per step
        data = common.Data(torch.randint(0, 256, (n, 3, s, s), dtype=torch.uint8, device=ctx.device),
                           torch.randint(0, 10, (n,), device=ctx.device), None, None, 10, s, CIFAR_MEAN, CIFAR_STD)
        generator = common.epoch_generator(0, 0, ctx.device)
        views = [v.detach().clone() for v in bench.augment(data.train[:a.batch_size], generator)]
        for _ in range(args.warmup):
            bench.bare(views)
        sync(ctx.device)
        start = time.perf_counter()
        for _ in range(args.steps):
            bench.bare(views)
        sync(ctx.device)
        bare = args.steps * a.batch_size / (time.perf_counter() - start)

        if ctx.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(ctx.device)
        batches = common.train_batches(data, 0, a.batch_size, generator, ctx)
        for step in range(args.warmup):
            bench.real(*next(batches), generator, step)
        sync(ctx.device)
        start = time.perf_counter()
        for step in range(args.warmup, args.warmup + args.steps):
            bench.real(*next(batches), generator, step)
        sync(ctx.device)
        seconds = (time.perf_counter() - start) / args.steps
        real = a.batch_size / seconds
        if not all(torch.isfinite(v).all() for v in bench.sums.values() if v.is_floating_point()):
            raise RuntimeError(f"{name}: non-finite scalars in the benchmark run")
        memory = f"{torch.cuda.max_memory_allocated(ctx.device) / 2 ** 30:.2f} GiB" if ctx.device.type == "cuda" else "n/a"
        loss = loss_time(bench.loss_fn, a.batch_size, bench.loss_dim, ctx.device, args.reps)
        rows.append(("step", f"{name} ({a.arch} w{a.width}, {s} px, D={bench.loss_dim})", a.batch_size,
                     f"{real:,.0f} img/s", f"{bare:,.0f} img/s (bare)", f"{real / bare:.2f}", "",
                     f"{100 * loss / seconds:.1f}%", memory))
        del bench, data, views
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------ losses vs matmul

def loss_rows(args, ctx):
    import moco_simmoco_simco as dt
    import simclr_dcl
    import simsiam_byol_gsg as gsg
    d, device, k, q = args.loss_dim, ctx.device, 65536, 16384
    # name -> (loss, floor): the matmul work it cannot avoid, in units of one (2B x D) @ (D x 2B)
    losses = {f"simclr {n}": ((lambda n: lambda z1, z2: simclr_dcl.contrastive_loss(z1, z2, 0.1, n))(n), lambda b: 3)
              for n in ("infonce", "dcl", "dclw")}
    losses["simco (DT, symmetric)"] = (lambda z1, z2: (dt.dual_temperature_loss(z1, z2, 0.1, 1.0)
                                                       + dt.dual_temperature_loss(z2, z1, 0.1, 1.0)) / 2, lambda b: 1.5)
    losses["simmoco (DT, key detached)"] = (lambda z1, z2: dt.dual_temperature_loss(z1, z2.detach(), 0.1, 1.0),
                                            lambda b: 0.5)
    queue = F.normalize(torch.randn(k, d, device=device), dim=1)
    losses[f"mocov2 (DT, queue K={k})"] = (lambda z1, z2: dt.dual_temperature_loss(z1, z2.detach(), 0.1, 0.1, queue),
                                           lambda b: 2 * k / (4 * b))  # (B x K) forward + grad of q
    losses["gsg guided (simsiam/byol)"] = (lambda z1, z2: gsg.global_guided_loss(
        z1, z2, z2.detach(), z1.detach(), torch.arange(len(z1), device=device).roll(1))[0], lambda b: 0)
    losses["symmetric (simsiam/byol)"] = (lambda z1, z2: gsg.symmetric_loss(z1, z2, z2.detach(), z1.detach()),
                                          lambda b: 0)
    try:
        import nnclr_dcl
        support = F.normalize(torch.randn(q, d, device=device), dim=1)
        losses[f"nnclr dcl (support {q})"] = (lambda z1, z2: nnclr_dcl.nnclr_loss(
            z1.detach(), z2.detach(), z1, z2, support, 0.1, "dcl"), lambda b: q / (2 * b) + 1.5)  # lookup + 2 (B x B)
    except Exception as error:
        print(f"note: nnclr_dcl not benchmarked ({type(error).__name__}: {error})", file=sys.stderr)
    rows = []
    for b in args.loss_batches:
        z = torch.randn(2 * b, d, device=device)
        mm = best_time(lambda: z @ z.T, device, max(args.reps, 5))
        for name, (fn, floor) in losses.items():
            try:
                t = loss_time(fn, b, d, device, args.reps)
            except Exception as error:
                rows.append(("loss", name, b, f"n/a: {type(error).__name__}"[:60], "", "", "", "", ""))
                continue
            rows.append(("loss", name, b, f"{t * 1e3:.2f} ms", f"{mm * 1e3:.2f} ms (1 matmul)", f"{t / mm:.1f}x",
                         f"{floor(b):g}x", "", ""))
    return rows


# ------------------------------------------------------------------------------ main

def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("error: --device cuda but no CUDA GPU is visible")
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True  # as common.setup
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True
        name = torch.cuda.get_device_name(device)
    else:
        name = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads"
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as out:
        ctx = common.Context(0, 1, 0, device, out=out, amp=device.type == "cuda" and not args.no_amp)
        rows = []
        if "aug" not in args.skip:
            rows += augmentation_rows(args, ctx)
        if "step" not in args.skip:
            rows += step_rows(args, ctx)
        if "loss" not in args.skip:
            rows += loss_rows(args, ctx)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"# throughput: {name}; torch {torch.__version__}; {datetime.datetime.now():%Y-%m-%d %H:%M}; "
          f"amp={'bf16' if ctx.amp else 'off'}; channels_last={device.type == 'cuda'}; compile={args.compile}; "
          f"load average at end {load:.2f}")
    print("# command: python " + " ".join(sys.argv))
    header = ("part", "what", "B", "ours", "baseline", "ratio", "matmul floor", "loss share", "peak mem")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")
    if device.type == "cpu":
        print(f"# peak RSS of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20:.2f} GiB")


if __name__ == "__main__":
    main()
