"""SimSiam and BYOL, with the symmetric loss or with guided stop-gradient (GSG).

Paper: Lee & Lee, "Implicit Contrastive Representation Learning with Guided Stop-gradient",
NeurIPS 2023 (Eq. numbers are the paper's); official code github.com/bych-lee/gsg. SimSiam and
BYOL pull two views of an image together through a predictor on one side and a stop-gradient on
the other, symmetrised (Eq. 1). GSG pairs each image x1 with an image x2 = r(x1) of the batch and
puts the predictor on the two cross-image views that lie closest (Eq. 6): chasing their targets
pulls them apart, an implicit contrastive effect. Every image gets four crops: 0, 1 are its views
as x1, 2, 3 its views as x2 (official gsg/loader.py). `random` / `reverse` are Sec. 6.1's baselines.

    python simsiam_byol_gsg.py --method byol --stopgrad guided        # one GPU, CIFAR-10 in ./data
    torchrun --nproc_per_node=8 simsiam_byol_gsg.py --method simsiam  # 8 GPUs, same global batch
    python simsiam_byol_gsg.py --dataset textures --width 8 --batch-size 32 --lr 0.3 \\
        --warmup-epochs 0 --epochs 3 --proj-hidden 256 --proj-dim 64  # CPU, no download
"""
import argparse
import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import common
from common import all_reduce_sum, gather, gather_with_grad

CASES = ("11_21", "11_22", "12_21", "12_22")  # case c <-> d(z_1a, z_2b), c = 2 * (a - 1) + (b - 1)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=common.HelpFormatter)
    common.add_common_args(parser)
    a = parser.add_argument
    a("--method", choices=["simsiam", "byol"], default="simsiam",
      help="simsiam: the target is the online encoder; byol: a momentum (EMA) encoder")
    a("--stopgrad", choices=["symmetric", "guided", "random", "reverse"], default="guided",
      help="symmetric = Eq. 1 (two crops); guided = Eq. 6, random / reverse = Sec. 6.1 (four)")
    a("--no-predictor", action="store_true", help="p = z, no predictor (Sec. 6.2)")
    # 0.99, constant: bych-lee/gsg gsg/builder.py (BYOL, BYOLGSG)
    a("--ema", type=common.momentum_value, default=0.99, help="BYOL target momentum tau")
    a("--ema-schedule", choices=["constant", "cosine"], default="constant",
      help="BYOL: constant tau, or BYOL's cosine increase of tau to 1.0")
    # constant: GSG Sec. 5.1 (CIFAR-10); cosine: GSG Sec. 5.1 (ImageNet)
    a("--schedule", choices=["constant", "cosine"], default="constant", help="lr schedule")
    # 2 layers: GSG Sec. 5.1 (CIFAR-10); 3: its ImageNet's, facebookresearch/simsiam builder.py
    a("--proj-layers", type=int, choices=[2, 3], default=2, help="projector depth")
    # this project's choice: the projection width (GSG Sec. 5.1 gives the depth only)
    a("--proj-hidden", type=common.positive_int, default=2048,
      help="hidden width of the 2-layer projector (the 3-layer one uses the backbone's width)")
    # 2048 and 512: bych-lee/gsg main_pretrain.py (--dim, --pred-dim)
    a("--proj-dim", type=common.positive_int, default=2048, help="projection dimension D")
    a("--pred-hidden", type=common.positive_int, default=512, help="predictor bottleneck width")
    # off: bych-lee/gsg main_pretrain.py; its README's ImageNet command turns it on
    a("--fix-pred-lr", action="store_true", help="the predictor keeps the peak lr (no schedule)")
    # GSG Sec. 5.1 (CIFAR-10): batch 512, 200 epochs, lr 0.06 at batch 512 (0.03 per 256), wd 5e-4;
    # no warm-up: bych-lee/gsg main_pretrain.py has none; crop scale (0.2, 1): main_pretrain.py,
    # its ImageNet script (the paper's CIFAR appendix is not in our copy); kNN T 0.2, k 200:
    # main_knn.py lines 65-66 (ImageNet), moot at CIFAR-10's k=1 (GSG)
    parser.set_defaults(batch_size=512, epochs=200, lr=0.03, wd=5e-4, warmup_epochs=0,
                        crop_scale=(0.2, 1.0), knn_t=0.2)
    return common.parse_args(parser, argv, "simsiam_byol_gsg")


# ------------------------------------------------------------------------------ model
class Encoder(nn.Module):
    """f = backbone (ResNet) + projector: image -> projection z (B, proj_dim)."""

    def __init__(self, arch, width, image_size, proj_hidden=2048, proj_dim=2048, proj_layers=2,
                 stem_padding=1):
        super().__init__()
        self.backbone = common.ResNet(arch, width, image_size, stem_padding,
                                      zero_init_residual=True)  # official SimSiam's and GSG's
        f = self.backbone.out_dim
        if proj_layers == 2:  # CIFAR-10 (GSG Sec. 5.1)
            self.projector = nn.Sequential(
                nn.Linear(f, proj_hidden, bias=False), nn.BatchNorm1d(proj_hidden), nn.ReLU(),
                nn.Linear(proj_hidden, proj_dim, bias=False),
                nn.BatchNorm1d(proj_dim, affine=False))
        else:  # ImageNet: SimSiam's 3-layer projector, hidden width = backbone width
            self.projector = nn.Sequential(
                nn.Linear(f, f, bias=False), nn.BatchNorm1d(f), nn.ReLU(),
                nn.Linear(f, f, bias=False), nn.BatchNorm1d(f), nn.ReLU(),
                nn.Linear(f, proj_dim, bias=False), nn.BatchNorm1d(proj_dim, affine=False))

    def forward(self, x):
        return self.projector(self.backbone(x))


class SiameseNet(nn.Module):
    """Online side: encoder f and predictor h. Crops x_1..x_V -> ([z_1..z_V], [p_1..p_V])."""

    def __init__(self, arch, width, image_size, proj_hidden=2048, proj_dim=2048, pred_hidden=512,
                 predictor=True, proj_layers=2, stem_padding=1):
        super().__init__()
        self.encoder = Encoder(arch, width, image_size, proj_hidden, proj_dim, proj_layers,
                               stem_padding)
        self.predictor = nn.Sequential(
            nn.Linear(proj_dim, pred_hidden, bias=False), nn.BatchNorm1d(pred_hidden), nn.ReLU(),
            nn.Linear(pred_hidden, proj_dim)) if predictor else nn.Identity()  # Sec. 6.2: p = z

    def forward(self, *views):
        # one pass per crop, as the official code: each crop is its own BatchNorm batch
        z = [self.encoder(x) for x in views]  # V x (b, D)
        return z, [self.predictor(t) for t in z]


def momentum_encoder(model, ctx):
    """A frozen copy of `model` that only ema_update moves; BatchNorm over the global batch."""
    frozen = common.sync_batchnorm(copy.deepcopy(model), ctx).requires_grad_(False)
    return frozen.to(memory_format=torch.channels_last) if ctx.device.type == "cuda" else frozen


@torch.no_grad()
def ema_update(target, online, momentum):
    """target <- momentum * target + (1 - momentum) * online, parameter by parameter. BatchNorm
    running statistics are not averaged: the target (in train mode) keeps its own."""
    for t, o in zip(target.parameters(), online.parameters()):
        t.lerp_(o, 1 - momentum)


def ema_momentum(step, total_steps, base=0.99, schedule="constant"):
    """tau at `step`: constant, or BYOL's 1 - (1 - base) * (cos(pi k / K) + 1) / 2, rising to 1."""
    cosine = 1 - (1 - base) * (math.cos(math.pi * step / total_steps) + 1) / 2
    return base if schedule == "constant" else cosine


# ------------------------------------------------------------------------------ loss
def D(p, z):
    """D(p, z) = -<p/|p|, z/|z|> per row -> (B,). The stop-gradient is written where D is called."""
    return -(F.normalize(p, dim=1) * F.normalize(z, dim=1)).sum(1)


def symmetric_loss(p1, p2, z1, z2):
    """SimSiam / BYOL loss (GSG Eq. 1), mean over the B images -> scalar in [-1, 1].
    p1, p2: (B, D) predictions of the two views; z1, z2: (B, D) target projections."""
    return (0.5 * D(p1, z2.detach()) + 0.5 * D(p2, z1.detach())).mean()


def guided_stopgrad_loss(p11, p12, p21, p22, z11, z12, z21, z22, mode="guided", random_case=None):
    """GSG loss (Eq. 6) over B pairs of images (x1, x2), mean over pairs -> (scalar, case (B,)).
    p_ab, z_ab: (B, D) prediction and target projection of view b of image a of each pair.
    case c indexes d = [d(z11,z21), d(z11,z22), d(z12,z21), d(z12,z22)], d Euclidean (Eq. 4),
    and puts the predictor on view 1 + c // 2 of x1 and view 1 + c % 2 of x2.
    mode: guided  c = argmin d (Eq. 5): the two closest cross-image views get the predictor;
          reverse c = 3 - argmin d: the other two terms of Eq. 2 (Eq. 7, Sec. 6.1);
          random  c uniform in 0..3 (Sec. 6.1): `random_case` (B,) if given, else torch's RNG."""
    with torch.no_grad():
        d = torch.stack([(z11 - z21).norm(dim=1), (z11 - z22).norm(dim=1),
                         (z12 - z21).norm(dim=1), (z12 - z22).norm(dim=1)], 1)  # (B, 4)
        if mode == "guided":
            case = d.argmin(1)
        elif mode == "reverse":
            case = 3 - d.argmin(1)  # 0 <-> 3, 1 <-> 2: the two views guided would have stopped
        elif mode == "random":
            n = len(d)
            case = torch.randint(4, (n,), device=d.device) if random_case is None else random_case
        else:
            raise ValueError(f"unknown stop-gradient mode {mode!r}")
    # torch.where sends no gradient to the branch not taken: only the two selected predictions learn
    first = torch.where(case < 2, D(p11, z12.detach()), D(p12, z11.detach()))  # (B,) x1's term
    second = torch.where(case % 2 == 0, D(p21, z22.detach()), D(p22, z21.detach()))  # (B,) x2's
    return (0.5 * first + 0.5 * second).mean(), case


def partner_crops(p2, p3, z2, z3, partner):
    """x2's views for this rank's pairs: crops 2 and 3 of image r(i) -> p21, p22, z21, z22 (b, D).
    p2, p3, z2, z3: (b, D) crops 2, 3 of this rank's images; partner: (b,) indices into the global
    batch. A selected partner prediction's gradient must reach its rank: an autograd all-gather."""
    p21, p22 = gather_with_grad(p2)[partner], gather_with_grad(p3)[partner]  # (N, D) -> (b, D)
    return p21, p22, gather(z2)[partner], gather(z3)[partner]


def draw_pairing(batch_size, mode, generator, ctx):
    """Partners r(i) of this rank's images and, for random SG, their cases (None if symmetric),
    drawn for the global batch from the epoch's CPU generator (alike on every rank and GPU model,
    replayed on --resume) and sliced to this rank's rows: N processes pair as one process does."""
    if mode == "symmetric":
        return None, None
    b = batch_size // ctx.world
    mine = slice(ctx.rank * b, (ctx.rank + 1) * b)
    partner = torch.randperm(batch_size, generator=generator, device=generator.device)
    random_case = None
    if mode == "random":
        random_case = torch.randint(4, (batch_size,), generator=generator, device=generator.device)
        random_case = common.to_device(random_case[mine], ctx.device)
    return common.to_device(partner[mine], ctx.device), random_case  # CPU draws, no host sync


@torch.no_grad()
def projection_std(z):
    """Collapse monitor (SimSiam Sec. 4.1): std over the global batch of z/|z|, mean over dims.
    About 1/sqrt(D) for well-spread projections, 0 when every image maps to the same point."""
    z = F.normalize(common.float32(z), dim=1)
    n = len(z) * common.world_size()
    sums = all_reduce_sum(torch.stack([z.sum(0), (z * z).sum(0)]))  # (2, D)
    var = (sums[1] - sums[0] ** 2 / n) / (n - 1)
    return var.clamp_min(0).sqrt().mean()


# ------------------------------------------------------------------------------ training step
def train_step(net, optimizer, views, args, ctx, pairing=None, target=None, online=None, tau=None):
    """One SGD step (+ BYOL's EMA) -> loss, the GSG case per image (None if symmetric), proj std.
    views: this rank's crops (b, 3, S, S), 2 for symmetric, 4 for GSG (0, 1: x1's; 2, 3: x2's, of
    image r(i)); pairing: draw_pairing's (r(i), random_case). target: BYOL's momentum encoder, after
    the step moved towards `online` (the bare encoder) by tau; None for SimSiam (targets: its z)."""
    with ctx.autocast():
        z, p = net(*views)  # V x (b, D) projections and predictions, one encoder pass per crop
        with torch.no_grad():  # BYOL's targets: one momentum-encoder pass per crop
            t = [target(x) for x in views] if target is not None else z  # SimSiam's: its own z
    p, t = [common.float32(x) for x in p], [common.float32(x) for x in t]  # loss in fp32 under bf16
    if args.stopgrad == "symmetric":
        loss, case = symmetric_loss(p[0], p[1], t[0], t[1]), None
    else:
        partner, random_case = pairing
        p21, p22, z21, z22 = partner_crops(p[2], p[3], t[2], t[3], partner)
        loss, case = guided_stopgrad_loss(p[0], p[1], p21, p22, t[0], t[1], z21, z22,
                                          args.stopgrad, random_case)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    if target is not None:
        ema_update(target, online, tau)
    return loss.detach(), case, projection_std(z[0].detach())


def recipes(args):
    """SimSiam's recipe for SimSiam and BYOL alike (GSG: the set-ups differ only in the momentum
    encoder; bych-lee/gsg main_pretrain.py), blur p=0.5 above 64 px; none at 32 px (this project's
    choice). Two crops for symmetric, four for GSG (gsg/loader.py)."""
    blur_p = 0.5 if args.image_size > 64 else 0.0
    crop = common.Recipe(crop_scale=tuple(args.crop_scale), blur_p=blur_p)
    return [crop] * (2 if args.stopgrad == "symmetric" else 4)


# ------------------------------------------------------------------------------ main loop
def main(argv=None):
    args = parse_args(argv)
    ctx = common.setup(args)  # this process's device; the process group under torchrun
    data = common.load_data(args, ctx, crops=2 if args.stopgrad == "symmetric" else 4)
    args.image_size = data.image_size
    torch.manual_seed(args.seed)  # the same initial model on every rank
    model = SiameseNet(args.arch, args.width, data.image_size, args.proj_hidden, args.proj_dim,
                       args.pred_hidden, not args.no_predictor, args.proj_layers,
                       args.stem_padding).to(ctx.device)
    target = momentum_encoder(model.encoder, ctx) if args.method == "byol" else None  # BYOL only
    net = common.distribute(model, ctx)  # global BatchNorm + DDP; `model` stays bare
    net = torch.compile(net) if args.compile else net
    peak_lr = args.lr * args.batch_size / 256
    # --fix-pred-lr: the predictor's group keeps peak_lr (facebookresearch/simsiam main_simsiam.py)
    groups = [{"params": model.encoder.parameters(), "fix_lr": False},
              {"params": model.predictor.parameters(), "fix_lr": args.fix_pred_lr}]
    optimizer = common.pretraining_optimizer(groups, args, ctx, peak_lr)
    probes = common.online_probes(args, data, ctx, model.encoder.backbone, target)
    for probe in probes.values():  # the probes read the features by a forward hook
        probe.backbone.register_forward_hook(probe.keep)
    states = {"model": model, "optimizer": optimizer, "target": target, **probes}  # checkpoint.pt
    start_epoch = common.load_checkpoint(ctx, states) if args.resume else 0
    common.start_run(args, ctx, data, model.encoder.backbone)
    augment = common.Augment(recipes(args), data.image_size, data.mean, data.std, ctx)
    steps = len(data) // args.batch_size
    total_steps = args.epochs * steps

    for epoch in range(start_epoch, args.epochs):
        # data order and pairs, on the CPU; augmentation on the device
        order, generator = common.epoch_generators(args.seed, epoch, ctx.device)
        meter = common.EpochMeter(ctx, epoch, args.epochs, steps, args.batch_size)
        batches = common.train_batches(data, args.batch_size, order, ctx, args.workers)
        for step, (images, labels) in enumerate(batches):
            global_step = epoch * steps + step
            lr = common.learning_rate(global_step, total_steps, args.warmup_epochs * steps,
                                      peak_lr, args.schedule)
            for group in optimizer.param_groups:
                group["lr"] = peak_lr if group["fix_lr"] else lr
            views = augment(images, generator)
            pairing = draw_pairing(args.batch_size, args.stopgrad, order, ctx)  # GSG's r(i)
            tau = ema_momentum(global_step, total_steps, args.ema, args.ema_schedule)
            loss, case, proj_std = train_step(net, optimizer, views, args, ctx, pairing=pairing,
                                              target=target, online=model.encoder, tau=tau)
            for probe in probes.values():  # the views' features this step kept
                probe.step(labels, lr / peak_lr)
            scalars = {"loss": loss, "proj_std": proj_std}
            if case is not None:  # how often each distance was the guide (Eq. 5)
                counts = F.one_hot(case, 4).float().mean(0)  # (4,); bincount would sync the host
                scalars.update({f"case_{name}": counts[c] for c, name in enumerate(CASES)})
            meter.update(lr, **scalars)
        record = meter.summary()
        common.check_finite(record)
        if target is not None:
            record["ema"] = tau
        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            record.update(common.evaluate(model.encoder.backbone, data, ctx, args, probes=probes))
        common.log_epoch(ctx, record)
        common.save_checkpoint(ctx, epoch + 1, states)
        if args.stop_after == epoch + 1 < args.epochs:
            return ctx.print(f"stopped after epoch {epoch + 1}: continue with --resume {ctx.out}")

    results = common.evaluate(model.encoder.backbone, data, ctx, args, final=True, probes=probes)
    common.finish(ctx, model.encoder.backbone, results)


if __name__ == "__main__":
    common.run(main)
