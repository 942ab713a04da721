"""SimCLR with the InfoNCE, DCL or DCLW loss.

Paper: Yeh et al., "Decoupled Contrastive Learning" (DCL), ECCV
2022. Two views of every image go through a ResNet and an MLP
projector, and each view must pick its partner among the 2N-1
other views of the global batch. InfoNCE's gradient carries the
negative-positive coupling multiplier q_B (Prop. 1); DCL drops
the positive from the denominator, which removes q_B (Prop. 2);
DCLW also up-weights hard positive pairs.

    python simclr_dcl.py --loss dclw  # 1 GPU, CIFAR-10 in ./data
    torchrun --nproc_per_node=8 simclr_dcl.py --loss dclw  # same batch
    python simclr_dcl.py --dataset textures --width 8 \\
        --batch-size 32 --lr 0.3 --warmup-epochs 0 --epochs 3 \\
        --proj-hidden 256 --proj-dim 64  # CPU, no download

A run writes its folder, --out (default: a new runs/simclr_dcl-
<time>-<pid>): each epoch's line, the kNN monitor every 10
epochs and checkpoint.pt; at the end backbone.pt and
results.json. The same command with the same --out continues
a killed run from its last epoch (common.Run).
"""
import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import common
from common import all_reduce_sum, gather, gather_with_grad


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=common.HelpFormatter)
    common.add_common_args(parser)
    a = parser.add_argument
    a("--loss", choices=["infonce", "dcl", "dclw"], default="dcl",
      help="infonce = SimCLR, dcl = DCL Prop. 2, "
           "dclw = DCL with the vMF weight")
    # tau 0.1: the default of SimCLR's official tf2/run.py
    # (google-research/simclr) and of lightly's DCLLoss.
    a("--temperature", type=common.positive_float, default=0.1,
      help="tau")
    # sigma 0.5: lightly's DCLWLoss default (a third party,
    # lightly/loss/dcl_loss.py).
    a("--sigma", type=common.positive_float, default=0.5,
      help="DCLW weight temperature")
    # Output 128: SimCLR's tf2/run.py --proj_out_dim; hidden 2048:
    # this project's choice.
    a("--proj-hidden", type=common.positive_int, default=2048,
      help="projector hidden width")
    a("--proj-dim", type=common.positive_int, default=128,
      help="projection dimension D")
    # This project's choice: the DCL paper gives no CIFAR
    # settings. Batch 256 because DCL is about small batches; plain
    # SGD (lr 0.06 per 256, wd 5e-4, 200 cosine epochs) instead of
    # the LARS of SimCLR's own CIFAR command (google-research/simclr
    # README: batch 512, lr 1.0, wd 1e-4, tau 0.5, 1000 epochs). 10
    # warm-up epochs: SimCLR's tf2/run.py. Crop scale (0.08, 1):
    # SimCLR paper, Appendix A.
    parser.set_defaults(batch_size=256, epochs=200, lr=0.06,
                        wd=5e-4, warmup_epochs=10,
                        crop_scale=(0.08, 1.0))
    return common.parse_args(parser, argv, "simclr_dcl")


# ---------------------------------------- model
class SimCLR(nn.Module):
    """Backbone f (a ResNet) and projector g: image -> projection
    (B, proj_dim), not yet normalised. g = Linear-BN-ReLU-Linear,
    one hidden layer, as SimCLR's Sec. 2.1."""

    def __init__(self, arch, width, image_size, proj_hidden=2048,
                 proj_dim=128, stem_padding=1):
        super().__init__()
        self.backbone = common.ResNet(
            arch, width, image_size, stem_padding)
        f = self.backbone.out_dim
        self.projector = nn.Sequential(
            nn.Linear(f, proj_hidden, bias=False),
            nn.BatchNorm1d(proj_hidden),
            nn.ReLU(),
            nn.Linear(proj_hidden, proj_dim),
        )

    def forward(self, x):
        return self.projector(self.backbone(x))


# ---------------------------------------- loss
def anchor_masks(logits):
    """(2B, 2N) logits of this rank's anchors [z1; z2] against
    the global batch (every rank's [z1; z2] in rank order) ->
    (self_mask, positive_mask): each anchor, its other view."""
    b = logits.shape[0] // 2
    # This rank's views are columns start .. start + 2B - 1.
    start = common.rank() * 2 * b
    rows = torch.arange(2 * b, device=logits.device)  # (2B,)
    columns = torch.arange(logits.shape[1], device=logits.device)  # (2N,)
    # Anchor z_i^(1)'s other view z_i^(2) is B columns on, and back.
    positive = start + (rows + b) % (2 * b)  # (2B,)
    self_mask = columns == (start + rows)[:, None]  # (2B, 2N)
    positive_mask = columns == positive[:, None]  # (2B, 2N)
    return self_mask, positive_mask


def contrastive_loss(z1, z2, temperature=0.1, loss="infonce",
                     sigma=0.5, reduction="mean"):
    """SimCLR's InfoNCE, DCL or DCLW -> the mean over this rank's
    2B anchors [z1; z2] (reduction="none": their (2B,) losses).
    DDP averages the ranks' gradients: that of the mean over the
    global batch's 2N anchors.

    z1, z2: this rank's (B, D) projections of the two views,
    normalised here. Anchor z_i^(k)'s positive is z_i^(u), u != k;
    the 2N-2 other views of the global batch are its negatives.
    With pos = <z_i^(1), z_i^(2)>/tau and U the sum of exp over
    the negatives:

        InfoNCE: L_i^(k) = -pos + log(exp(pos) + U)
        DCL:     L_i^(k) = -pos + log U    (DCL Prop. 2)
        DCLW:    L_i^(k) = -w_i pos + log U  (w_i: dclw_weights)
    """
    if loss not in ("infonce", "dcl", "dclw"):
        raise ValueError(f"unknown loss {loss!r}")
    z1 = F.normalize(z1, dim=1)
    z2 = F.normalize(z2, dim=1)
    anchors = torch.cat([z1, z2])  # (2B, D) this rank's views
    # The negatives come from every rank with their gradient, so N
    # processes, their losses averaged by DDP, give the gradient
    # of one process on the whole batch.
    candidates = gather_with_grad(anchors)  # (2N, D)
    logits = anchors @ candidates.T / temperature  # (2B, 2N)
    self_mask, positive_mask = anchor_masks(logits)
    # Each row's one True picks its positive: exact, and unlike
    # boolean indexing it never waits for the device.
    pos = (logits * positive_mask).sum(1)  # (2B,)
    # A view is not its own negative.
    logits = logits.masked_fill(self_mask, -math.inf)
    if loss != "infonce":
        # DCL Prop. 2: the positive leaves the denominator.
        logits = logits.masked_fill(positive_mask, -math.inf)
    weight = 1.0
    if loss == "dclw":
        w = dclw_weights((z1 * z2).sum(1), sigma)  # (B,)
        weight = w.repeat(2)  # (2B,) a pair's w for both views
    losses = -weight * pos + torch.logsumexp(logits, dim=1)
    return losses if reduction == "none" else losses.mean()


# w is a constant in backward, as lightly's
# negative_mises_fisher_weights makes it (lightly/loss/
# dcl_loss.py; the paper does not say): with its gradient, the
# easiest pair's term would push its two views apart (a test in
# tests/test_simclr_dcl.py).
@torch.no_grad()
def dclw_weights(pos_similarity, sigma=0.5):
    """DCLW's weight of each positive pair, the paper's negative
    von Mises-Fisher function: pos_similarity (B,), the cosines of
    this rank's positive pairs -> (B,), of mean 1 over the global
    batch (j runs over every rank's pairs):

        w_i = 2 - exp(s_i / sigma) / mean_j exp(s_j / sigma)
    """
    vmf = torch.exp(pos_similarity / sigma)  # (B,)
    pairs = vmf.numel() * common.world_size()  # N
    global_mean = all_reduce_sum(vmf.sum()) / pairs
    return 2 - vmf / global_mean


@torch.no_grad()
def npc_multiplier(z1, z2, temperature=0.1):
    """q_B of each of this rank's 2B anchors [z1; z2] (DCL Eq. 8)
    -> (2B,): q = 1 - exp(pos) / (exp(pos) + U), computed as
    sigmoid(log U - pos), which keeps a small q exact."""
    z1 = F.normalize(z1, dim=1)
    z2 = F.normalize(z2, dim=1)
    anchors = torch.cat([z1, z2])  # (2B, D)
    logits = anchors @ gather(anchors).T / temperature  # (2B, 2N)
    self_mask, positive_mask = anchor_masks(logits)
    # U sums over the negatives alone.
    negatives = logits.masked_fill(self_mask | positive_mask, -math.inf)
    log_u = torch.logsumexp(negatives, dim=1)  # (2B,)
    pos = (logits * positive_mask).sum(1)  # (2B,)
    return torch.sigmoid(log_u - pos)


# ---------------------------------------- training step
def train_step(net, optimizer, views, args, ctx):
    """One SGD step on both views -> the mean loss and each
    anchor's q_B (DCL Fig. 1's diagnostic)."""
    with ctx.autocast():
        # Both views in one forward pass, so BatchNorm's statistics
        # cover all 2B views: SimCLR's own convention
        # (google-research/simclr tf2/model.py concatenates them).
        z1, z2 = net(torch.cat(views)).chunk(2)  # (B, D) each
    # The loss in float32 under bf16 autocast
    z1 = common.float32(z1)
    z2 = common.float32(z2)
    loss = contrastive_loss(z1, z2, args.temperature, args.loss,
                            args.sigma)
    # q_B of the same z1, z2, under no_grad.
    q = npc_multiplier(z1, z2, args.temperature)  # (2B,)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.detach(), q


def recipes(args):
    """SimCLR's augmentation, the same for both views. Up to 64 px
    that of its CIFAR command (google-research/simclr README:
    --color_jitter_strength=0.5, i.e. jitter (0.4, 0.4, 0.4, 0.1),
    --use_blur=False); larger images add Gaussian blur with p 0.5
    (SimCLR paper, Appendix A)."""
    blur_p = 0.5 if args.image_size > 64 else 0.0
    recipe = common.Recipe(crop_scale=tuple(args.crop_scale),
                           blur_p=blur_p)
    return [recipe] * 2


# ---------------------------------------- main loop
def main(argv=None):
    # shared: the options, this process
    args = parse_args(argv)
    ctx = common.setup(args)

    # own: the data, SimCLR's network, optimiser, augmentation
    data = common.load_data(args, ctx)
    torch.manual_seed(args.seed)  # the same model on every rank
    model = SimCLR(args.arch, args.width, data.image_size,
                   args.proj_hidden, args.proj_dim,
                   args.stem_padding).to(ctx.device)
    backbone = model.backbone
    net = common.distribute(model, ctx)  # `model` stays bare
    peak_lr = args.lr * args.batch_size / 256
    optimizer = common.pretraining_optimizer(
        model.parameters(), args, peak_lr)
    augment = common.Augment(recipes(args), data.image_size,
                             data.mean, data.std, ctx)
    if args.compile:  # the loss stays as written
        net = torch.compile(net)
        augment = torch.compile(augment)
    # what a checkpoint keeps
    states = dict(model=model, optimizer=optimizer)

    # shared: the run folder; a checkpoint there is continued
    run = common.Run(args, ctx, data, backbone, states)
    # shared: the epochs still to train, each one's steps
    for epoch in run.epochs():
        for step, images, labels in run.batches(epoch):
            # own: the schedule, the augmented views, the step
            lr = common.learning_rate(
                epoch * run.steps + step, args.epochs * run.steps,
                args.warmup_epochs * run.steps, peak_lr)
            for group in optimizer.param_groups:
                group["lr"] = lr
            views = augment(images, run.draws)
            loss, q = train_step(net, optimizer, views, args, ctx)
            run.meter.update(lr, loss=loss, npc_mean=q.mean(),
                             npc_sq=(q * q).mean())

        # own: DCL Fig. 1, the mean NPC multiplier <q_B> and
        # its coefficient of variation
        record = run.meter.summary()
        npc_mean = record["npc_mean"]
        npc_var = max(record.pop("npc_sq") - npc_mean ** 2, 0)
        record["npc_cv"] = math.sqrt(npc_var) / npc_mean
        run.end_epoch(record)  # the kNN monitor, the log, a checkpoint

    # shared: the final evaluation, backbone.pt, results.json
    run.finish()


if __name__ == "__main__":
    common.run(main)
