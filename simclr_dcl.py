"""SimCLR with the InfoNCE, DCL or DCLW loss.

Paper: Yeh et al., "Decoupled Contrastive Learning", ECCV 2022 (Prop. / Eq. numbers are the paper's).
Two augmented views of every image pass through a ResNet and an MLP projector; each view must pick
its partner among the 2N-1 other views of the global batch. InfoNCE's gradient carries the
negative-positive coupling multiplier q_B (Prop. 1); DCL drops the positive from the denominator,
which removes q_B (Prop. 2); DCLW also up-weights hard positive pairs.

    python simclr_dcl.py --loss dclw                        # one GPU, CIFAR-10 downloaded to ./data
    torchrun --nproc_per_node=8 simclr_dcl.py --loss dclw   # 8 GPUs, same global batch of 256
    python simclr_dcl.py --dataset imagefolder --data-dir D --width 8 --epochs 2 --device cpu  # CPU smoke run
"""
import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import common
from common import all_reduce_sum, gather_with_grad, logsumexp_rows


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=common.HelpFormatter)
    common.add_common_args(parser)
    parser.add_argument("--loss", choices=["infonce", "dcl", "dclw"], default="dcl",
                        help="infonce = SimCLR, dcl = DCL Prop. 2, dclw = DCL with the vMF positive weight")
    parser.add_argument("--temperature", type=common.positive_float, default=0.1, help="tau")
    parser.add_argument("--sigma", type=common.positive_float, default=0.5, help="DCLW weight temperature")
    parser.add_argument("--proj-hidden", type=common.positive_int, default=2048, help="projector hidden width")
    parser.add_argument("--proj-dim", type=common.positive_int, default=128, help="projection dimension D")
    # SimCLR / DCL CIFAR setting: batch 256, 200 epochs, SGD lr 0.06 per 256, wd 5e-4
    parser.set_defaults(batch_size=256, epochs=200, lr=0.06, wd=5e-4, warmup_epochs=10, crop_scale=(0.08, 1.0))
    return common.parse_args(parser, argv, "simclr_dcl")


# ------------------------------------------------------------------------------ model

class SimCLR(nn.Module):
    """backbone f (ResNet) + projector g: image -> projection (B, proj_dim), not yet normalised."""

    def __init__(self, arch, width, image_size, proj_hidden=2048, proj_dim=128):
        super().__init__()
        self.backbone = common.ResNet(arch, width, image_size)
        self.projector = nn.Sequential(
            nn.Linear(self.backbone.out_dim, proj_hidden, bias=False), nn.BatchNorm1d(proj_hidden), nn.ReLU(),
            nn.Linear(proj_hidden, proj_dim))

    def forward(self, x):
        return self.projector(self.backbone(x))


# ------------------------------------------------------------------------------ loss

def pair_logits(z1, z2, temperature):
    """Similarities of this rank's 2B anchors with every view of the global batch but themselves.

    z1, z2: (B, D) L2-normalised views of this rank's images.
    Returns pos (2B,) = <z_i^(1), z_i^(2)>/tau for anchors [z1; z2], logits (2B, 2N) with -inf where
    an anchor meets itself, and `block`, the (2B, 2B) view of logits on this rank's own columns
    (detached: fill it only with -inf).
    """
    b = z1.shape[0]
    z = torch.cat([z1, z2])  # (2B, D) this rank's anchors
    z_all = gather_with_grad(z)  # (2N, D) every rank's [z1; z2], in rank order, with gradient
    logits = (z / temperature) @ z_all.T  # (2B, 2N); 1/tau on the (2B, D) side saves two passes over (2B, 2N)
    pos = (z1 * z2).sum(1).repeat(2) / temperature  # (2B,)
    # This rank's own views are columns [r*2B, (r+1)*2B): each anchor meets itself on that block's
    # diagonal and its positive on the +-B diagonals. Filling those few entries in place is cheaper
    # than building a (2B, 2N) mask; it is safe because mm saves its inputs, not its output.
    # The fills go through `block`, a detached view: exp(-inf) = 0 already sends those entries no
    # gradient, and a fill that autograd records would copy the whole (2B, 2N) gradient in backward.
    start = common.rank() * 2 * b
    block = logits.detach()[:, start:start + 2 * b]
    block.diagonal().fill_(-math.inf)  # a view is not its own negative
    return pos, logits, block


def contrastive_loss(z1, z2, temperature=0.1, loss="infonce", sigma=0.5):
    """SimCLR's InfoNCE, DCL or DCLW, mean over the 2N anchors of the global batch -> scalar.

    z1, z2: this rank's (B, D) projections of the two views (normalised here). Every other view
    of the global batch is a negative (2N-2 per anchor), gathered from all ranks with gradient, so
    N processes (their losses averaged by DDP) give the gradient of one process on the whole batch.
    """
    return anchor_losses(z1, z2, temperature, loss, sigma).mean()


def anchor_losses(z1, z2, temperature=0.1, loss="infonce", sigma=0.5):
    """The loss of each of this rank's 2B anchors [z1; z2] -> (2B,), with pos = <z_i^(1), z_i^(2)>/tau:
      InfoNCE: L_i^(k) = -pos + log(exp(pos) + U_{i,k})      U_{i,k} = sum over the 2N-2 negatives
      DCL:     L_i^(k) = -pos + log U_{i,k}                   (DCL Prop. 2: positive out of the denominator)
      DCLW:    L_i^(k) = -w_i * pos + log U_{i,k}             (w_i from dclw_weights, a constant in backward)
    """
    z1, z2 = F.normalize(z1, dim=1), F.normalize(z2, dim=1)
    b = z1.shape[0]
    pos, logits, block = pair_logits(z1, z2, temperature)
    if loss == "infonce":
        return logsumexp_rows(logits, 1 / temperature) - pos
    block.diagonal(b).fill_(-math.inf)  # DCL Prop. 2: drop the positive from the denominator
    block.diagonal(-b).fill_(-math.inf)
    log_u = logsumexp_rows(logits, 1 / temperature)  # (2B,) log U_{i,k}
    if loss == "dcl":
        return log_u - pos
    if loss == "dclw":
        return log_u - dclw_weights(z1, z2, sigma).repeat(2) * pos
    raise ValueError(f"unknown loss {loss!r}")


@torch.no_grad()  # the weight is a constant in backward (sg), as in the paper's weighting function
def dclw_weights(z1, z2, sigma=0.5):
    """DCLW's negative von Mises-Fisher weight per pair -> (B,), mean 1 over the GLOBAL batch:
    w_i = 2 - exp(<z_i^(1), z_i^(2)>/sigma) / mean_j exp(<z_j^(1), z_j^(2)>/sigma)."""
    z1, z2 = F.normalize(z1, dim=1), F.normalize(z2, dim=1)
    vmf = torch.exp((z1 * z2).sum(1) / sigma)  # (B,)
    mean_vmf = all_reduce_sum(vmf.sum()) / (len(vmf) * common.world_size())
    return 2 - vmf / mean_vmf


@torch.no_grad()
def npc_multiplier(z1, z2, temperature=0.1):
    """q_B per anchor (DCL Eq. 8): q = 1 - pos / (pos + U) = sigmoid(log U - log pos) -> (2B,)."""
    z1, z2 = F.normalize(z1, dim=1), F.normalize(z2, dim=1)
    b = z1.shape[0]
    pos, logits, block = pair_logits(z1, z2, temperature)
    block.diagonal(b).fill_(-math.inf)
    block.diagonal(-b).fill_(-math.inf)
    return torch.sigmoid(logsumexp_rows(logits, 1 / temperature) - pos)


# ------------------------------------------------------------------------------ training step

def train_step(model, optimizer, views, args, ctx):
    """One SGD step on both views; returns the loss and q_B per anchor (for the Fig. 1 diagnostics)."""
    x = torch.cat(views)  # (2b, 3, S, S): one forward pass for both views
    with ctx.autocast():
        z = model(x)
    z1, z2 = z.to(torch.promote_types(z.dtype, torch.float32)).chunk(2)  # loss in >= float32 under bf16 autocast
    losses = anchor_losses(z1, z2, args.temperature, args.loss, args.sigma)  # (2b,)
    loss = losses.mean()  # = contrastive_loss(z1, z2, ...)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.detach(), npc_from_losses(losses.detach(), z1.detach(), z2.detach(), args.temperature, args.loss,
                                          args.sigma)


@torch.no_grad()
def npc_from_losses(losses, z1, z2, temperature=0.1, loss="infonce", sigma=0.5):
    """q_B per anchor recovered from the anchor losses, without a second (2B, 2N) matmul -> (2B,).

    InfoNCE: L = -log(1 - q), so q = -expm1(-L).   DCL: L = log U - pos = logit(q).
    DCLW: L = log U - w pos, so logit(q) = L + (w - 1) pos.
    """
    if loss == "infonce":
        return -torch.expm1(-losses)
    if loss == "dclw":
        pos = (F.normalize(z1, dim=1) * F.normalize(z2, dim=1)).sum(1).repeat(2) / temperature
        losses = losses + (dclw_weights(z1, z2, sigma).repeat(2) - 1) * pos
    return torch.sigmoid(losses)


def recipe(args):
    """SimCLR's CIFAR augmentation (no blur at 32 px; Gaussian blur p=0.5 for larger images)."""
    return common.Recipe(crop_scale=tuple(args.crop_scale), blur_p=0.5 if args.image_size > 64 else 0.0)


# ------------------------------------------------------------------------------ main loop

def main(argv=None):
    args = parse_args(argv)
    ctx = common.setup(args)  # this process's device; the process group under torchrun
    data = common.load_data(args, ctx)
    args.image_size = data.image_size
    torch.manual_seed(args.seed)  # the same initial model on every rank
    model = SimCLR(args.arch, args.width, data.image_size, args.proj_hidden, args.proj_dim)
    net = common.distribute(model.to(ctx.device), ctx)  # global BatchNorm + DDP; `model` stays bare
    if args.compile:
        net = common.compile_model(net, ctx)
    peak_lr = args.lr * args.batch_size / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=peak_lr, momentum=0.9, weight_decay=args.wd,
                                fused=ctx.device.type == "cuda")
    states = {"model": model, "optimizer": optimizer}  # what checkpoint.pt holds
    start_epoch = common.load_checkpoint(ctx, states) if args.resume else 0
    common.start_run(args, ctx, "simclr_dcl")
    augment = common.Augment([recipe(args), recipe(args)], data.image_size, data.mean, data.std, ctx)
    steps = len(data) // args.batch_size

    for epoch in range(start_epoch, args.epochs):
        order = common.epoch_generator(args.seed, epoch)  # data order, on the CPU
        generator = common.epoch_generator(args.seed, epoch, ctx.device)  # augmentation
        meter = common.EpochMeter(ctx, epoch, args.epochs, steps, args.batch_size)
        batches = common.train_batches(data, args.batch_size, order, ctx, args.workers)
        for step, (images, _) in enumerate(batches):
            lr = common.learning_rate(epoch * steps + step, args.epochs * steps,
                                      args.warmup_epochs * steps, peak_lr)
            for group in optimizer.param_groups:
                group["lr"] = lr
            views = augment(images, generator)
            loss, q = train_step(net, optimizer, views, args, ctx)
            meter.update(lr, loss=loss, npc_mean=q.mean(), npc_sq=(q * q).mean())
        record = meter.summary()
        common.check_finite(record)
        # DCL Fig. 1: the mean NPC multiplier <q_B> and its coefficient of variation
        npc_sq = record.pop("npc_sq")
        record["npc_cv"] = math.sqrt(max(npc_sq - record["npc_mean"] ** 2, 0)) / record["npc_mean"]
        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            record.update(common.evaluate(model.backbone, data, ctx, args))
        common.log_epoch(ctx, record)
        common.save_checkpoint(ctx, epoch + 1, states)
        if args.stop_after == epoch + 1 < args.epochs:
            return ctx.print(f"stopped after epoch {epoch + 1}: continue with --resume {ctx.out}")

    common.finish(ctx, model.backbone, common.evaluate(model.backbone, data, ctx, args, final=True))


if __name__ == "__main__":
    common.run(main)
