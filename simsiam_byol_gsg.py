"""SimSiam and BYOL, with the symmetric loss or with guided stop-gradient (GSG).

Paper: Lee & Lee, "Implicit Contrastive Representation Learning with Guided Stop-gradient", NeurIPS 2023
(Eq. numbers are the paper's). SimSiam and BYOL pull two views of an image together through a
predictor on one side and a stop-gradient on the other, and symmetrise that (Eq. 1). GSG pairs each
image with another image of the batch and, of the two views of each image, puts the predictor on the
two views of the pair that lie closest together (Eq. 6): chasing their targets pulls them apart, an
implicit contrastive effect. `random` and `reverse` stop-gradient are the paper's Sec. 6.1 baselines,
`--no-predictor` its Sec. 6.2 collapse study.

    python simsiam_byol_gsg.py --method byol --stopgrad guided                        # one GPU, CIFAR-10 in ./data
    torchrun --nproc_per_node=8 simsiam_byol_gsg.py --method simsiam --stopgrad guided  # 8 GPUs, same global batch of 512
    python simsiam_byol_gsg.py --dataset imagefolder --data-dir D --width 8 --epochs 2 --device cpu  # CPU smoke run

Learning rate: --lr is per 256 images, as in every script here (lr = LR * batch / 256). The paper
gives 0.06 at its batch of 512 with no scaling rule, so the default --lr 0.03 is exactly the paper's
0.06 at --batch-size 512, held constant (no schedule, no warm-up) as the paper does on CIFAR-10.
"""
import argparse
import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import common
from common import all_reduce_sum, gather, gather_with_grad

CASES = ("11_21", "11_22", "12_21", "12_22")  # case c <-> distance d(z_1a, z_2b), c = 2 * (a - 1) + (b - 1)


def momentum_value(text):
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=common.HelpFormatter)
    common.add_common_args(parser)
    parser.add_argument("--method", choices=["simsiam", "byol"], default="simsiam",
                        help="simsiam: the target is the online encoder; byol: a momentum (EMA) encoder")
    parser.add_argument("--stopgrad", choices=["symmetric", "guided", "random", "reverse"], default="guided",
                        help="symmetric = Eq. 1 (the original method), guided = GSG Eq. 6, random / reverse = Sec. 6.1")
    parser.add_argument("--no-predictor", action="store_true", help="p = z, no predictor (Sec. 6.2)")
    parser.add_argument("--ema", type=momentum_value, default=0.99, help="BYOL target momentum tau")
    parser.add_argument("--ema-schedule", choices=["constant", "cosine"], default="constant",
                        help="BYOL: constant tau, or BYOL's cosine increase of tau to 1.0")
    parser.add_argument("--schedule", choices=["constant", "cosine"], default="constant",
                        help="learning-rate schedule (the paper: constant on CIFAR-10, cosine on ImageNet)")
    parser.add_argument("--proj-hidden", type=common.positive_int, default=2048, help="projector hidden width")
    parser.add_argument("--proj-dim", type=common.positive_int, default=2048, help="projection dimension D")
    parser.add_argument("--pred-hidden", type=common.positive_int, default=512, help="predictor bottleneck width")
    # GSG CIFAR-10 setting (Sec. 5.1): batch 512, 200 epochs, SGD 0.06 at batch 512 (= 0.03
    # per 256), wd 5e-4, no learning-rate schedule, crop scale (0.2, 1) as SimSiam's CIFAR recipe
    parser.set_defaults(batch_size=512, epochs=200, lr=0.03, wd=5e-4, warmup_epochs=0, crop_scale=(0.2, 1.0))
    return common.parse_args(parser, argv, "simsiam_byol_gsg")


# ------------------------------------------------------------------------------ model

def mlp(dim_in, hidden, dim_out, out_bn):
    """Linear-BN-ReLU-Linear(-BN): the 2-layer projector (output BN without affine, as SimSiam's) or the predictor."""
    layers = [nn.Linear(dim_in, hidden, bias=False), nn.BatchNorm1d(hidden), nn.ReLU(),
              nn.Linear(hidden, dim_out, bias=not out_bn)]
    return nn.Sequential(*layers, nn.BatchNorm1d(dim_out, affine=False)) if out_bn else nn.Sequential(*layers)


class Encoder(nn.Module):
    """f = backbone (ResNet) + projector: image -> projection z (B, proj_dim)."""

    def __init__(self, arch, width, image_size, proj_hidden=2048, proj_dim=2048):
        super().__init__()
        self.backbone = common.ResNet(arch, width, image_size)
        self.projector = mlp(self.backbone.out_dim, proj_hidden, proj_dim, out_bn=True)

    def forward(self, x):
        return self.projector(self.backbone(x))


class SiameseNet(nn.Module):
    """Online side: encoder f and predictor h. (x1, x2) -> z1, z2, p1 = h(z1), p2 = h(z2)."""

    def __init__(self, arch, width, image_size, proj_hidden=2048, proj_dim=2048, pred_hidden=512, predictor=True):
        super().__init__()
        self.encoder = Encoder(arch, width, image_size, proj_hidden, proj_dim)
        # Sec. 6.2 removes the predictor: p = z
        self.predictor = mlp(proj_dim, pred_hidden, proj_dim, out_bn=False) if predictor else nn.Identity()

    def forward(self, x1, x2):
        # one pass per view, as SimSiam's reference does, so BatchNorm statistics are per view
        z1, z2 = self.encoder(x1), self.encoder(x2)
        return z1, z2, self.predictor(z1), self.predictor(z2)


@torch.no_grad()
def ema_update(target, online, momentum):
    """BYOL target: xi <- tau * xi + (1 - tau) * theta, parameter by parameter.

    BatchNorm running statistics are buffers, not parameters: the target keeps its own, tracked
    from its own forward passes (they are never used, the target only runs in training mode).
    """
    torch._foreach_lerp_(list(target.parameters()), list(online.parameters()), 1 - momentum)  # xi + (1-tau)(theta-xi)


def ema_momentum(step, total_steps, base=0.99, schedule="constant"):
    """tau at `step`: constant, or BYOL's tau = 1 - (1 - base) * (cos(pi k / K) + 1) / 2, rising to 1."""
    if schedule == "constant":
        return base
    return 1 - (1 - base) * (math.cos(math.pi * step / total_steps) + 1) / 2


# ------------------------------------------------------------------------------ loss

def neg_cosine(p, z):
    """D(p, sg(z)) = -<p/|p|, z/|z|> per row -> (B,); the target z is detached here."""
    return -(F.normalize(p, dim=1) * F.normalize(z.detach(), dim=1)).sum(1)


def symmetric_loss(p1, p2, z1, z2):
    """SimSiam / BYOL loss (GSG Eq. 1), mean over the B images -> scalar in [-1, 1].

    p1, p2: (B, D) predictions of the two views; z1, z2: (B, D) target projections (stop-gradient).
        L = 1/2 D(p1, sg z2) + 1/2 D(p2, sg z1)
    """
    return (0.5 * neg_cosine(p1, z2) + 0.5 * neg_cosine(p2, z1)).mean()


def guided_stopgrad_loss(p11, p12, p21, p22, z11, z12, z21, z22, mode="guided", random_case=None):
    """GSG loss (GSG Eq. 6) over B pairs of images (x1, x2), mean over pairs -> (scalar, case (B,) int64).

    p_ab, z_ab: (B, D) prediction and target projection of view b of image a of each pair.
    case c indexes d = [d(z11,z21), d(z11,z22), d(z12,z21), d(z12,z22)], d = Euclidean (Eq. 4);
    case c puts the predictor on view 1 + c // 2 of x1 and view 1 + c % 2 of x2:
        c = 0:  1/2 D(p11, sg z12) + 1/2 D(p21, sg z22)      c = 1:  1/2 D(p11, sg z12) + 1/2 D(p22, sg z21)
        c = 2:  1/2 D(p12, sg z11) + 1/2 D(p21, sg z22)      c = 3:  1/2 D(p12, sg z11) + 1/2 D(p22, sg z21)
    mode: guided  c = argmin d (Eq. 5), the two closest cross-image views get the predictor;
          reverse c = 3 - argmin d, the other two terms of Eq. 2 (Eq. 7, Sec. 6.1);
          random  c uniform in 0..3 (Sec. 6.1): `random_case` (B,) if given, else drawn from torch's RNG.
    """
    with torch.no_grad():
        d = torch.stack([(z11 - z21).norm(dim=1), (z11 - z22).norm(dim=1),
                         (z12 - z21).norm(dim=1), (z12 - z22).norm(dim=1)], 1)  # (B, 4)
        if mode == "guided":
            case = d.argmin(1)
        elif mode == "reverse":
            case = 3 - d.argmin(1)  # 0 <-> 3, 1 <-> 2: the two views guided would have stopped
        elif mode == "random":
            case = random_case if random_case is not None else torch.randint(4, (len(d),), device=d.device)
        else:
            raise ValueError(f"unknown stop-gradient mode {mode!r}")
    # torch.where sends no gradient to the branch not taken: only the two selected predictions learn
    first = torch.where(case < 2, neg_cosine(p11, z12), neg_cosine(p12, z11))  # (B,) image x1's term
    second = torch.where(case % 2 == 0, neg_cosine(p21, z22), neg_cosine(p22, z21))  # (B,) image x2's term
    return (0.5 * first + 0.5 * second).mean(), case


def global_guided_loss(p1, p2, z1, z2, partner, mode="guided", random_case=None):
    """GSG for this rank's b images against partners anywhere in the global batch -> (scalar, case (b,)).

    p1, p2, z1, z2: (b, D) this rank's predictions and targets; partner: (b,) indices r(i) into the
    global batch of N images (rank order). Image i is x1 of its pair, image r(i) is x2.
    """
    # The partner's prediction may be selected, so it must send its gradient back to the rank that
    # owns it: an autograd all-gather. Targets and distances need no gradient: a plain all-gather.
    p1_all, p2_all = gather_with_grad(p1), gather_with_grad(p2)  # (N, D)
    z1_all, z2_all = gather(z1), gather(z2)  # (N, D)
    return guided_stopgrad_loss(p1, p2, p1_all[partner], p2_all[partner], z1, z2, z1_all[partner],
                                z2_all[partner], mode, random_case)


def draw_pairing(batch_size, mode, generator, ctx):
    """Partners r(i) of this rank's images and, for random SG, their cases; None, None if symmetric.

    Drawn for the whole global batch from the epoch generator (the same on every rank, replayed
    exactly on --resume) and sliced to this rank's rows, so N processes pair as one process does.
    """
    if mode == "symmetric":
        return None, None
    b = batch_size // ctx.world
    mine = slice(ctx.rank * b, (ctx.rank + 1) * b)
    partner = torch.randperm(batch_size, generator=generator, device=generator.device)[mine].to(ctx.device)
    random_case = None
    if mode == "random":
        random_case = torch.randint(4, (batch_size,), generator=generator, device=generator.device)
        random_case = random_case[mine].to(ctx.device)
    return partner, random_case


def at_least_fp32(t):
    """bf16 (autocast) -> float32; float32 and float64 unchanged."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


@torch.no_grad()
def projection_std(z):
    """Collapse monitor (SimSiam Sec. 4.1): std over the global batch of z/|z|, mean over the D dims.

    About 1/sqrt(D) for well-spread projections, 0 when every image maps to the same point.
    """
    z = F.normalize(at_least_fp32(z), dim=1)
    n = len(z) * common.world_size()
    sums = all_reduce_sum(torch.stack([z.sum(0), (z * z).sum(0)]))  # (2, D)
    var = (sums[1] - sums[0] ** 2 / n) / (n - 1)
    return var.clamp_min(0).sqrt().mean()


# ------------------------------------------------------------------------------ training step

def train_step(net, target, optimizer, views, partner, random_case, args, ctx):
    """One SGD step; returns the loss, the GSG case per image (None if symmetric) and the projection std.

    net: the online SiameseNet (DDP-wrapped); target: BYOL's momentum encoder, or None for SimSiam,
    whose targets are its own projections under stop-gradient.
    """
    x1, x2 = views
    with ctx.autocast():
        z1, z2, p1, p2 = net(x1, x2)
        if target is not None:
            with torch.no_grad():
                t1, t2 = target(x1), target(x2)
    z1, z2, p1, p2 = map(at_least_fp32, (z1, z2, p1, p2))  # the loss runs in float32 even under bf16
    t1, t2 = (at_least_fp32(t1), at_least_fp32(t2)) if target is not None else (z1, z2)  # detached in the loss
    if args.stopgrad == "symmetric":
        loss, case = symmetric_loss(p1, p2, t1, t2), None
    else:
        loss, case = global_guided_loss(p1, p2, t1, t2, partner, args.stopgrad, random_case)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.detach(), case, projection_std(z1.detach())


def recipe(args, view):
    """SimSiam's CIFAR augmentation (crop scale 0.2-1, no blur at 32 px). Above 64 px: SimSiam's blur
    p=0.5 on both views; BYOL's asymmetric blur (1.0 / 0.1) and solarize (0 / 0.2)."""
    if args.image_size <= 64:
        return common.Recipe(crop_scale=tuple(args.crop_scale))
    if args.method == "simsiam":
        return common.Recipe(crop_scale=tuple(args.crop_scale), blur_p=0.5)
    return common.Recipe(crop_scale=tuple(args.crop_scale), blur_p=(1.0, 0.1)[view], solarize_p=(0.0, 0.2)[view])


# ------------------------------------------------------------------------------ main loop

def main(argv=None):
    args = parse_args(argv)
    ctx = common.setup(args)  # this process's device; the process group under torchrun
    data = common.load_data(args, ctx)
    args.image_size = data.image_size
    torch.manual_seed(args.seed)  # the same initial model on every rank
    model = SiameseNet(args.arch, args.width, data.image_size, args.proj_hidden, args.proj_dim,
                       args.pred_hidden, predictor=not args.no_predictor).to(ctx.device)
    target = None
    if args.method == "byol":
        # BYOL's target starts as a copy of the online encoder and moves only by EMA; its
        # BatchNorm is global too, or N processes would normalise the targets differently
        target = common.sync_batchnorm(copy.deepcopy(model.encoder), ctx).requires_grad_(False)
        target = target.to(memory_format=torch.channels_last) if ctx.device.type == "cuda" \
            else target
    net = common.distribute(model, ctx)  # global BatchNorm + DDP; `model` stays bare
    if args.compile:
        net = common.compile_model(net, ctx)
    peak_lr = args.lr * args.batch_size / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=peak_lr, momentum=0.9, weight_decay=args.wd,
                                fused=ctx.device.type == "cuda")
    states = {"model": model, "optimizer": optimizer, "target": target}
    start_epoch = common.load_checkpoint(ctx, states) if args.resume else 0
    common.start_run(args, ctx, "simsiam_byol_gsg")
    augment = common.Augment([recipe(args, 0), recipe(args, 1)], data.image_size, data.mean,
                             data.std, ctx)
    steps = len(data) // args.batch_size
    total_steps = args.epochs * steps

    for epoch in range(start_epoch, args.epochs):
        # data order and pairs, on the CPU; augmentation on the device
        order, generator = common.epoch_generators(args.seed, epoch, ctx.device)
        meter = common.EpochMeter(ctx, epoch, args.epochs, steps, args.batch_size)
        batches = common.train_batches(data, args.batch_size, order, ctx, args.workers)
        for step, (images, _) in enumerate(batches):
            global_step = epoch * steps + step
            lr = common.learning_rate(global_step, total_steps, args.warmup_epochs * steps,
                                      peak_lr, args.schedule)
            for group in optimizer.param_groups:
                group["lr"] = lr
            views = augment(images, generator)
            partner, random_case = draw_pairing(args.batch_size, args.stopgrad, order, ctx)
            loss, case, proj_std = train_step(net, target, optimizer, views, partner, random_case,
                                              args, ctx)
            if target is not None:
                tau = ema_momentum(global_step, total_steps, args.ema, args.ema_schedule)
                ema_update(target, model.encoder, tau)
            scalars = {"loss": loss, "proj_std": proj_std}
            if case is not None:  # how often each distance was the guide (Eq. 5)
                counts = F.one_hot(case, 4).float().mean(0)  # (4,); bincount would sync the host
                scalars.update({f"case_{name}": counts[c] for c, name in enumerate(CASES)})
            meter.update(lr, **scalars)
        record = meter.summary()
        common.check_finite(record)
        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            record.update(common.evaluate(model.encoder.backbone, data, ctx, args))
        common.log_epoch(ctx, record)
        common.save_checkpoint(ctx, epoch + 1, states)
        if args.stop_after == epoch + 1 < args.epochs:
            return ctx.print(f"stopped after epoch {epoch + 1}: continue with --resume {ctx.out}")

    backbone = model.encoder.backbone
    common.finish(ctx, backbone, common.evaluate(backbone, data, ctx, args, final=True))


if __name__ == "__main__":
    common.run(main)
