"""SimSiam and BYOL, with the symmetric loss or guided stop-gradient.

Paper: Lee & Lee, "Implicit Contrastive Representation Learning
with Guided Stop-gradient" (GSG), NeurIPS 2023; official code
github.com/bych-lee/gsg. SimSiam and BYOL pull two views of an
image together, a predictor on one side and a stop-gradient on the
other, symmetrised (Eq. 1). GSG pairs each image x1 with an
image x2 = r(x1) of the batch and puts the predictor on the two
cross-image views that lie closest (Eq. 6): chasing their targets
pulls them apart, an implicit contrastive effect. Every image gets
four crops: 0, 1 its views as x1, 2, 3 as x2 (official
gsg/loader.py). `random` and `reverse` are Sec. 6.1's baselines.

    python simsiam_byol_gsg.py --method byol --stopgrad guided  # 1 GPU
    torchrun --nproc_per_node=8 simsiam_byol_gsg.py  # 8 GPUs, same batch
    python simsiam_byol_gsg.py --dataset textures --width 8 \\
        --batch-size 32 --lr 0.45 --warmup-epochs 0 --epochs 3 \\
        --proj-hidden 256 --proj-dim 64  # CPU, no download
"""
import argparse
import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import common
from common import all_reduce_sum, gather, gather_with_grad

# The metrics' names of guided_stopgrad_loss's four cases
CASES = ("11_21", "11_22", "12_21", "12_22")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=common.HelpFormatter)
    common.add_common_args(parser)
    a = parser.add_argument
    a("--method", choices=["simsiam", "byol"], default="simsiam",
      help="the target: the online encoder, or BYOL's EMA of it")
    a("--stopgrad", default="guided",
      choices=["symmetric", "guided", "random", "reverse"],
      help="symmetric = Eq. 1, guided = Eq. 6, the others Sec. 6.1")
    a("--no-predictor", action="store_true", help="p = z (Sec. 6.2)")
    # 0.99, constant (bych-lee/gsg gsg/builder.py, BYOL, BYOLGSG)
    a("--ema", type=common.momentum_value, default=0.99,
      help="BYOL target momentum tau")
    a("--ema-schedule", choices=["constant", "cosine"],
      default="constant", help="or BYOL's cosine rise of tau to 1")
    # Constant on CIFAR-10, cosine on ImageNet (GSG Sec. 5.1).
    a("--schedule", choices=["constant", "cosine"],
      default="constant", help="lr schedule")
    # 2 layers on CIFAR-10 (GSG Sec. 5.1); 3 on ImageNet, as
    # SimSiam's (facebookresearch/simsiam builder.py).
    a("--proj-layers", type=int, choices=[2, 3], default=2,
      help="projector depth")
    # This project's choice: GSG Sec. 5.1 gives the depth only.
    a("--proj-hidden", type=common.positive_int, default=2048,
      help="2-layer projector's hidden width (3: the backbone's)")
    # 2048 and 512 (bych-lee/gsg main_pretrain.py, --dim, --pred-dim)
    a("--proj-dim", type=common.positive_int, default=2048,
      help="projection dimension D")
    a("--pred-hidden", type=common.positive_int, default=512,
      help="predictor bottleneck width")
    # Off in bych-lee/gsg main_pretrain.py; its README's ImageNet
    # command turns it on.
    a("--fix-pred-lr", action="store_true",
      help="the predictor keeps the peak lr (no schedule)")
    # CIFAR-10's batch 512, 200 epochs, lr 0.06 at 512, wd 5e-4
    # (GSG Sec. 5.1). No warm-up and crop scale (0.2, 1): bych-lee/gsg
    # main_pretrain.py (ImageNet's). kNN T 0.2: its main_knn.py
    # lines 65-66, moot at GSG's CIFAR-10 k=1.
    parser.set_defaults(batch_size=512, epochs=200, lr=0.03, wd=5e-4,
                        warmup_epochs=0, crop_scale=(0.2, 1.0), knn_t=0.2)
    return common.parse_args(parser, argv, "simsiam_byol_gsg")


# ---------------------------------------- model
class Encoder(nn.Module):
    """f = backbone (ResNet) + projector: image -> z (B, proj_dim)."""

    def __init__(self, arch, width, image_size, proj_hidden=2048,
                 proj_dim=2048, proj_layers=2, stem_padding=1):
        super().__init__()
        # zero_init_residual as official SimSiam and GSG do.
        self.backbone = common.ResNet(
            arch, width, image_size, stem_padding, zero_init_residual=True)
        f = self.backbone.out_dim
        h = proj_hidden
        d = proj_dim
        if proj_layers == 2:  # CIFAR-10's (GSG Sec. 5.1)
            self.projector = nn.Sequential(
                nn.Linear(f, h, bias=False), nn.BatchNorm1d(h), nn.ReLU(),
                nn.Linear(h, d, bias=False), nn.BatchNorm1d(d, affine=False))
        else:  # ImageNet's: SimSiam's, the backbone's width
            self.projector = nn.Sequential(
                nn.Linear(f, f, bias=False), nn.BatchNorm1d(f), nn.ReLU(),
                nn.Linear(f, f, bias=False), nn.BatchNorm1d(f), nn.ReLU(),
                nn.Linear(f, d, bias=False), nn.BatchNorm1d(d, affine=False))

    def forward(self, x):
        return self.projector(self.backbone(x))


class SiameseNet(nn.Module):
    """Encoder f and predictor h: crops x_1..x_V -> ([z_v], [p_v])."""

    def __init__(self, arch, width, image_size, proj_hidden=2048,
                 proj_dim=2048, pred_hidden=512, predictor=True,
                 proj_layers=2, stem_padding=1):
        super().__init__()
        self.encoder = Encoder(arch, width, image_size, proj_hidden,
                               proj_dim, proj_layers, stem_padding)
        h = pred_hidden
        d = proj_dim
        if predictor:
            self.predictor = nn.Sequential(
                nn.Linear(d, h, bias=False), nn.BatchNorm1d(h), nn.ReLU(),
                nn.Linear(h, d))
        else:
            self.predictor = nn.Identity()  # p = z (Sec. 6.2)

    def forward(self, *views):
        # One pass per crop, as the official code: each crop is its
        # own BatchNorm batch.
        z = [self.encoder(x) for x in views]  # V x (b, D)
        return z, [self.predictor(t) for t in z]


def momentum_encoder(model, ctx):
    """A frozen copy of `model` that only ema_update moves.

    Its BatchNorm layers normalise over the global batch, as the
    online encoder's do."""
    frozen = copy.deepcopy(model)
    frozen = common.sync_batchnorm(frozen, ctx)
    frozen.requires_grad_(False)
    if ctx.device.type == "cuda":
        frozen = frozen.to(memory_format=torch.channels_last)
    return frozen


@torch.no_grad()
def ema_update(target, online, momentum):
    """target <- momentum * target + (1 - momentum) * online.

    Every parameter in one call: a GPU would launch a kernel for
    each lerp_ of a loop. BatchNorm's running statistics are not
    averaged: the target, in train mode, keeps its own."""
    torch._foreach_lerp_(list(target.parameters()),
                         list(online.parameters()), 1 - momentum)


def ema_momentum(step, total_steps, base=0.99, schedule="constant"):
    """tau at step k of K: `base`, or BYOL's cosine rise to 1,
    1 - (1 - base) * (cos(pi k / K) + 1) / 2."""
    cos = math.cos(math.pi * step / total_steps)
    cosine = 1 - (1 - base) * (cos + 1) / 2
    return base if schedule == "constant" else cosine


# ---------------------------------------- loss
def D(p, z):
    """-cos(p, z) per row -> (B,); the stop-gradient is at the call."""
    return -(F.normalize(p, dim=1) * F.normalize(z, dim=1)).sum(1)


def symmetric_loss(p1, p2, z1, z2):
    """SimSiam's and BYOL's loss (GSG Eq. 1), mean over the B
    images -> scalar in [-1, 1].

    p1, p2: (B, D), the two views' predictions; z1, z2: (B, D),
    their targets."""
    return (0.5 * D(p1, z2.detach()) + 0.5 * D(p2, z1.detach())).mean()


def guided_stopgrad_loss(p11, p12, p21, p22, z11, z12, z21, z22,
                         mode="guided", random_case=None):
    """GSG's loss (Eq. 6), mean over B pairs of images (x1, x2)
    -> (scalar, case (B,)).

    p_ab, z_ab: (B, D) prediction and target of view b of image a.
    Case c = 2 (a - 1) + (b - 1) is d's column d(z_1a, z_2b), the
    Euclidean distance (Eq. 4); it puts the predictor on view a of
    x1 and view b of x2:
      guided   c = argmin d (Eq. 5), the closest cross-image views;
               each chases its sibling's target, away from the
               other image: the implicit contrast (GSG Eq. 3);
      reverse  c = 3 - argmin d, Eq. 2's other terms (Eq. 7);
      random   c uniform in 0..3: `random_case` (B,) or torch's RNG."""
    with torch.no_grad():
        d = torch.stack([
            (z11 - z21).norm(dim=1), (z11 - z22).norm(dim=1),
            (z12 - z21).norm(dim=1), (z12 - z22).norm(dim=1),
        ], 1)  # (B, 4)
        if mode == "guided":
            case = d.argmin(1)
        elif mode == "reverse":
            # 0 <-> 3, 1 <-> 2: the views guided would have stopped
            case = 3 - d.argmin(1)
        elif mode == "random":
            case = random_case
            if random_case is None:
                case = torch.randint(4, (len(d),), device=d.device)
        else:
            raise ValueError(f"unknown stop-gradient mode {mode!r}")
    # x1's and x2's terms, (B,). torch.where sends no gradient to
    # the branch not taken: only the two chosen predictions learn.
    first = torch.where(
        case < 2, D(p11, z12.detach()), D(p12, z11.detach()))
    second = torch.where(
        case % 2 == 0, D(p21, z22.detach()), D(p22, z21.detach()))
    return (0.5 * first + 0.5 * second).mean(), case


def partner_crops(p2, p3, z2, z3, partner):
    """Crops 2, 3 of each pair's x2 = r(i): p21, p22, z21, z22 (b, D).

    p2, p3, z2, z3: (b, D), crops 2, 3 of this rank's images;
    partner: (b,) r(i), indices into the global batch."""
    # The gradient of a partner's prediction must reach its rank:
    # an all-gather with autograd.
    p21 = gather_with_grad(p2)[partner]  # (N, D) -> (b, D)
    p22 = gather_with_grad(p3)[partner]  # (b, D)
    return p21, p22, gather(z2)[partner], gather(z3)[partner]


def draw_pairing(batch_size, mode, generator, ctx):
    """GSG's partners r(i) of this rank's images and, for random,
    their cases; (None, None) for symmetric.

    One draw for the global batch from the epoch's CPU generator
    (no host sync), alike on every rank and GPU model, replayed by
    a continued run, sliced to this rank's rows: N processes pair
    as one."""
    if mode == "symmetric":
        return None, None
    b = batch_size // ctx.world
    mine = slice(ctx.rank * b, (ctx.rank + 1) * b)
    partner = torch.randperm(
        batch_size, generator=generator, device=generator.device)
    random_case = None
    if mode == "random":
        random_case = torch.randint(
            4, (batch_size,), generator=generator, device=generator.device)
        random_case = common.to_device(random_case[mine], ctx.device)
    return common.to_device(partner[mine], ctx.device), random_case


@torch.no_grad()
def projection_std(z):
    """SimSiam's collapse monitor (Sec. 4.1): the std of z/|z| over
    the global batch, mean over dimensions. About 1/sqrt(D) when
    the projections are well spread, 0 when all coincide."""
    z = F.normalize(common.float32(z), dim=1)
    n = len(z) * common.world_size()
    sums = torch.stack([z.sum(0), (z * z).sum(0)])  # (2, D)
    sums = all_reduce_sum(sums)
    var = (sums[1] - sums[0] ** 2 / n) / (n - 1)  # (D,)
    return var.clamp_min(0).sqrt().mean()


# ---------------------------------------- training step
def train_step(net, optimizer, views, args, ctx, pairing=None,
               target=None, online=None, tau=None):
    """One SGD step (and BYOL's EMA) -> the loss, the GSG case per
    image (None if symmetric), the projection std.

    views: this rank's crops (b, 3, S, S); pairing: draw_pairing's.
    target: BYOL's momentum encoder, moved to `online` by tau after
    the step; None for SimSiam, whose targets are its z."""
    with ctx.autocast():
        z, p = net(*views)  # V x (b, D) each
        t = z
        if target is not None:
            # BYOL's targets: a momentum-encoder pass per crop
            with torch.no_grad():
                t = [target(x) for x in views]
    # The loss in float32 under bf16 autocast
    p = [common.float32(x) for x in p]
    t = [common.float32(x) for x in t]
    case = None
    if args.stopgrad == "symmetric":
        loss = symmetric_loss(p[0], p[1], t[0], t[1])
    else:
        partner, random_case = pairing
        p21, p22, z21, z22 = partner_crops(p[2], p[3], t[2], t[3], partner)
        loss, case = guided_stopgrad_loss(
            p[0], p[1], p21, p22, t[0], t[1], z21, z22,
            args.stopgrad, random_case)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    if target is not None:
        ema_update(target, online, tau)
    return loss.detach(), case, projection_std(z[0].detach())


def recipes(args):
    """SimSiam's recipe for both methods (bych-lee/gsg
    main_pretrain.py); blur p=0.5 above 64 px, none at 32 (this
    project's choice); 2 crops, or GSG's 4 (gsg/loader.py)."""
    blur_p = 0.5 if args.image_size > 64 else 0.0
    crop = common.Recipe(crop_scale=tuple(args.crop_scale), blur_p=blur_p)
    return [crop] * (2 if args.stopgrad == "symmetric" else 4)


def parameter_groups(model, args):
    """The optimiser's groups; --fix-pred-lr keeps the predictor's
    at the peak lr (facebookresearch/simsiam main_simsiam.py)."""
    return [
        {"params": model.encoder.parameters(), "fix_lr": False},
        {"params": model.predictor.parameters(), "fix_lr": args.fix_pred_lr},
    ]


def case_shares(case):
    """GSG's case per image (B,) -> each case's share (Eq. 5), by
    its metrics name; one-hot, as a bincount would sync the host."""
    counts = F.one_hot(case, 4).float().mean(0)  # (4,)
    return {f"case_{name}": counts[c] for c, name in enumerate(CASES)}


# ---------------------------------------- main loop
def main(argv=None):
    # shared: the options, this process
    args = parse_args(argv)
    ctx = common.setup(args)

    # own: the data (GSG: 4 crops), the network, BYOL's target
    crops = 2 if args.stopgrad == "symmetric" else 4
    data = common.load_data(args, ctx, crops=crops)
    torch.manual_seed(args.seed)  # the same model on every rank
    model = SiameseNet(
        args.arch, args.width, data.image_size, args.proj_hidden,
        args.proj_dim, args.pred_hidden, not args.no_predictor,
        args.proj_layers, args.stem_padding).to(ctx.device)
    backbone = model.encoder.backbone
    net = common.distribute(model, ctx)  # `model` stays bare
    target = None
    if args.method == "byol":
        target = momentum_encoder(model.encoder, ctx)

    # own: the optimiser, the augmentation
    peak_lr = args.lr * args.batch_size / 256
    optimizer = common.pretraining_optimizer(
        parameter_groups(model, args), args, peak_lr)
    augment = common.Augment(recipes(args), data.image_size,
                             data.mean, data.std, ctx)
    if args.compile:  # the loss stays as written
        net = torch.compile(net)
        augment = torch.compile(augment)
    # what a checkpoint keeps
    states = dict(model=model, optimizer=optimizer, target=target)

    # shared: the run folder; a checkpoint there is continued
    run = common.Run(args, ctx, data, backbone, states)
    # shared: the epochs still to train, each one's steps
    for epoch in run.epochs():
        for step, images, labels in run.batches(epoch):
            # own: the schedules, the views, GSG's pairs, the step
            global_step = epoch * run.steps + step
            lr = common.learning_rate(
                global_step, args.epochs * run.steps,
                args.warmup_epochs * run.steps, peak_lr, args.schedule)
            for group in optimizer.param_groups:
                group["lr"] = peak_lr if group["fix_lr"] else lr
            views = augment(images, run.draws)
            pairing = draw_pairing(args.batch_size, args.stopgrad,
                                   run.order, ctx)  # GSG's r(i)
            tau = ema_momentum(
                global_step, args.epochs * run.steps, args.ema,
                args.ema_schedule)
            loss, case, proj_std = train_step(
                net, optimizer, views, args, ctx, pairing=pairing,
                target=target, online=model.encoder, tau=tau)
            scalars = {"loss": loss, "proj_std": proj_std}
            if target is not None:
                scalars["ema"] = tau
            if case is not None:
                scalars.update(case_shares(case))
            run.meter.update(lr, **scalars)

        # own: the epoch's means, the kNN monitor, the log
        run.end_epoch(run.meter.summary())

    # shared: the final evaluation, backbone.pt, results.json
    run.finish()


if __name__ == "__main__":
    common.run(main)
