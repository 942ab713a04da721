"""NNCLR with the InfoNCE, DCL or DCLW loss.

Papers: Dwibedi et al., "With a Little Help from My Friends:
Nearest-Neighbor Contrastive Learning of Visual
Representations" (NNCLR), ICCV 2021; Yeh et al., "Decoupled
Contrastive Learning" (DCL), ECCV 2022, contribution 4.
NNCLR replaces a view's projection by its nearest neighbour
in a support set of past projections, which must pick the
other view's prediction among the global batch's. DCL drops
the positive from that denominator; DCLW also up-weights
hard positive pairs.

    python nnclr_dcl.py --loss dcl  # one GPU, CIFAR-10 to ./data
    # 8 GPUs, the same global batch of 256:
    torchrun --nproc_per_node=8 nnclr_dcl.py --loss dcl
    python nnclr_dcl.py --dataset textures --width 8 --epochs 3 \\
        --batch-size 32 --lr 0.3 --warmup-epochs 0 --support-size 512 \\
        --optimizer sgd --proj-hidden 256 --proj-dim 64  # CPU, no download
"""
import argparse
import math
from dataclasses import replace

import torch
import torch.nn as nn
import torch.nn.functional as F

import common
from common import all_reduce_sum, gather, gather_with_grad


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=common.HelpFormatter)
    common.add_common_args(parser)
    parser.add_argument(
        "--loss", choices=["infonce", "dcl", "dclw"], default="dcl",
        help="infonce = NNCLR, dcl = NNCLR + DCL (Prop. 2), "
             "dclw = vMF-weighted")
    # solo-learn's CIFAR NNCLR (scripts/pretrain/cifar/nnclr.yaml, line 19).
    parser.add_argument(
        "--temperature", type=common.positive_float, default=0.2, help="tau")
    # lightly's DCLWLoss default (lightly/loss/dcl_loss.py).
    parser.add_argument(
        "--sigma", type=common.positive_float, default=0.5,
        help="DCLW weight temperature")
    # nnclr.yaml, line 23 (queue_size).
    parser.add_argument(
        "--support-size", type=common.positive_int, default=65536,
        help="support set Q: past projections the nearest "
             "neighbour is searched in")
    # solo-learn's NNCLR heads, in its CIFAR config too
    # (solo/methods/nnclr.py defaults).
    parser.add_argument(
        "--proj-hidden", type=common.positive_int,
        default=2048, help="projector hidden width")
    parser.add_argument(
        "--proj-dim", type=common.positive_int, default=256,
        help="projection dimension D")
    parser.add_argument(
        "--pred-hidden", type=common.positive_int,
        default=4096, help="predictor hidden width")
    # solo-learn's CIFAR NNCLR, as the DCL paper gives no CIFAR
    # settings for NNCLR + DCL. In nnclr.yaml: batch 256 (line
    # 32); LARS (31), eta 0.02, clip_lr, bias and norms
    # excluded (36-39); lr 0.4 (33) per 256
    # (solo/args/pretrain.py, lines 153-154); weight decay
    # 1e-5 (35); warmup_cosine (41), 10 warm-up epochs per
    # step (solo/methods/base.py, lines 293-294); 1000 epochs
    # (50). Crop scale: augmentations/asymmetric.yaml, lines
    # 3-4. The CIFAR stem's padding 2: solo/methods/base.py,
    # lines 200-202 (at 9187ea3).
    parser.set_defaults(
        batch_size=256, epochs=1000, lr=0.4, wd=1e-5, warmup_epochs=10,
        crop_scale=(0.08, 1.0), optimizer="lars", lars_eta=0.02,
        lars_clip=True, stem_padding=2)
    return common.parse_args(parser, argv, "nnclr_dcl")


# -------------------------------------------------------------- model
class NNCLR(nn.Module):
    """backbone f + projector g (3 layers) + predictor h
    (2 layers): image (B, 3, S, S) -> projection z and
    prediction p = h(z), (B, proj_dim) each, neither
    normalised. z feeds the support set and the lookup only.
    """

    def __init__(self, arch, width, image_size, proj_hidden=2048,
                 proj_dim=256, pred_hidden=4096, stem_padding=1):
        super().__init__()
        self.backbone = common.ResNet(arch, width, image_size, stem_padding)
        self.projector = nn.Sequential(
            nn.Linear(self.backbone.out_dim, proj_hidden, bias=False),
            nn.BatchNorm1d(proj_hidden),
            nn.ReLU(),
            nn.Linear(proj_hidden, proj_hidden, bias=False),
            nn.BatchNorm1d(proj_hidden),
            nn.ReLU(),
            nn.Linear(proj_hidden, proj_dim, bias=False),
            nn.BatchNorm1d(proj_dim),
        )
        self.predictor = nn.Sequential(
            nn.Linear(proj_dim, pred_hidden, bias=False),
            nn.BatchNorm1d(pred_hidden),
            nn.ReLU(),
            nn.Linear(pred_hidden, proj_dim),
        )

    def forward(self, x):
        z = self.projector(self.backbone(x))
        return z, self.predictor(z)


# -------------------------------------------------------- support set
class SupportSet(nn.Module):
    """NNCLR's support set Q: a FIFO of the last `size` unit
    projections of the global batch (Q, D).

    Buffers, so the checkpoint holds them; the write position
    is a device tensor (no host sync). The rows start as
    random unit vectors, as in public NNCLR code, the same on
    every rank (seeded). `labels` (-1: none yet) serve only
    the neighbour-quality diagnostic.
    """

    def __init__(self, size, dim, seed=0):
        super().__init__()
        seeded = torch.Generator().manual_seed(seed)
        noise = torch.randn(size, dim, generator=seeded)
        self.register_buffer("rows", F.normalize(noise, dim=1))  # (Q, D)
        labels = torch.full((size,), -1, dtype=torch.long)
        self.register_buffer("labels", labels)  # (Q,)
        # ptr: the next row to write, the oldest.
        self.register_buffer("ptr", torch.zeros((), dtype=torch.long))

    @torch.no_grad()
    def push(self, rows, labels):
        """rows (N, D) and labels (N,), already gathered from
        every rank, replace the N oldest rows, wrapping around
        the end, so no row of the batch is lost."""
        n = len(rows)
        size = len(self.rows)
        if n > size:
            raise ValueError(
                f"{type(self).__name__} of {size} rows "
                f"cannot take a batch of {n}")
        offsets = torch.arange(n, device=self.rows.device)
        index = (self.ptr + offsets) % size  # (N,)
        self.rows.index_copy_(0, index, rows.to(self.rows.dtype))
        self.labels.index_copy_(0, index, labels.to(self.labels.device))
        self.ptr.copy_((self.ptr + n) % size)


@torch.no_grad()
def nearest_index(z, support_set):
    """The support set's row most cosine-similar to each z:
    (B, D), (Q, D) unit rows -> (B,). The argmax ignores
    |z|, so z need not be normalised."""
    similarity = z @ support_set.T  # (B, Q)
    return similarity.argmax(1)  # (B,)


# No gradient into the support set, nor back into z.
@torch.no_grad()
def nearest_neighbour(z, support_set):
    """NN(z) = argmax_{s in Q} <z, s>, NNCLR's lookup:
    (B, D), (Q, D) unit rows -> (B, D)."""
    return support_set[nearest_index(z, support_set)]


# --------------------------------------------------------------- loss
def nnclr_loss(z1, z2, p1, p2, support_set, temperature=0.1,
               loss="dcl", sigma=0.5, reduction="mean"):
    """NNCLR's symmetrised loss with the InfoNCE, DCL or DCLW
    denominator: the mean over this rank's 2B anchors (DDP's
    average: the global batch's gradient) -> scalar
    (reduction="none": the (2B,) losses, direction 1 then 2).

    z1, z2, p1, p2: (B, D), this rank's projections of the
    two views and their predictions; support_set: (Q, D)
    unit rows, the same on every rank. Anchor NN(z_i^(1))
    must pick p_i^(2) among the p_j^(2) of the global
    batch's N images (gathered with gradient); NN(z_i^(2))
    picks p_i^(1). With pos = <NN(z_i^(1)), p_i^(2)>/tau
    (p normalised here) and U_i the sum of exp over the N-1
    negatives j != i:
      InfoNCE: L_i = -pos + log(exp(pos) + U_i)  (NNCLR)
      DCL:     L_i = -pos + log U_i  (DCL Prop. 2)
      DCLW:    L_i = -w_i pos + log U_i  (w_i: dclw_weights)
    The gradient reaches the network through p only.
    """
    if loss not in ("infonce", "dcl", "dclw"):
        raise ValueError(f"unknown loss {loss!r}")
    b = p1.shape[0]
    rows = torch.arange(b, device=p1.device)  # (B,)
    own = common.rank() * b + rows  # (B,) this rank's columns
    losses = []
    # The NN of one view picks the other view's prediction.
    for z, p in ((z1, p2), (z2, p1)):
        anchors = nearest_neighbour(z, support_set)  # (B, D)
        partners = F.normalize(p, dim=1)  # (B, D)
        candidates = gather_with_grad(partners)  # (N, D)
        logits = anchors @ candidates.T / temperature  # (B, N)
        pos = logits[rows, own]  # (B,)
        if loss != "infonce":
            # DCL Prop. 2: the positive leaves the denominator.
            columns = torch.arange(len(candidates), device=p.device)
            positive_mask = columns == own[:, None]  # (B, N)
            logits = logits.masked_fill(positive_mask, -math.inf)
        weight = 1.0
        if loss == "dclw":
            cosine = (anchors * partners).sum(1)  # (B,)
            weight = dclw_weights(cosine, sigma)  # (B,)
        losses.append(-weight * pos + torch.logsumexp(logits, dim=1))
    losses = torch.cat(losses)  # (2B,)
    return losses if reduction == "none" else losses.mean()


# w is a constant in backward, as lightly's
# negative_mises_fisher_weights makes it (the paper does not say).
@torch.no_grad()
def dclw_weights(pos_similarity, sigma=0.5):
    """DCLW's weight of each positive pair, the paper's
    negative von Mises-Fisher function: the cosines
    pos_similarity (B,) of this rank's pairs -> (B,), mean 1
    over the GLOBAL batch (j over every rank's pairs):
        w_i = 2 - exp(s_i / sigma) / mean_j exp(s_j / sigma)
    Here a pair is (NN(z_i^(1)), p_i^(2)), one call per
    direction."""
    vmf = torch.exp(pos_similarity / sigma)  # (B,)
    pairs = vmf.numel() * common.world_size()
    global_mean = all_reduce_sum(vmf.sum()) / pairs
    return 2 - vmf / global_mean


# ------------------------------------------------------ training step
def train_step(net, optimizer, views, args, ctx, labels, support_set):
    """One SGD step on both views; then the support set takes
    the global batch's unit z^(1). Returns the loss and the
    diagnostic's counts on this rank: the labelled anchors
    whose neighbour has their class, and all labelled ones.
    """
    with ctx.autocast():
        # One pass per view, so BatchNorm normalises each view
        # with its own statistics, as solo-learn's NNCLR does
        # (per-crop forward).
        z1, p1 = net(views[0])  # (B, D) each
        z2, p2 = net(views[1])
    z1, z2, p1, p2 = map(common.float32, (z1, z2, p1, p2))
    loss = nnclr_loss(z1, z2, p1, p2, support_set.rows,
                      args.temperature, args.loss, args.sigma)
    # NNCLR's neighbour quality, never trained on: is an
    # anchor's neighbour of its class?
    with torch.no_grad():
        index = nearest_index(torch.cat([z1, z2]), support_set.rows)  # (2B,)
        anchor_labels = labels.repeat(2)  # (2B,)
        labelled = anchor_labels >= 0  # STL-10's unlabeled images are -1.
        same_class = (support_set.labels[index] == anchor_labels) & labelled
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    # After the lookup, so the neighbours come from past
    # batches only; gather stacks the ranks' rows in order.
    unit_z1 = F.normalize(z1.detach(), dim=1)
    support_set.push(gather(unit_z1), gather(labels))
    return loss.detach(), same_class.sum(), labelled.sum()


def recipes(args):
    """solo-learn's asymmetric views for NNCLR (BYOL's):
    jitter p 0.8, grayscale p 0.2, flip p 0.5 in both;
    solarisation p 0.2 in the second only; blur above 64 px
    only, p 1.0 and 0.1
    (scripts/pretrain/cifar/augmentations/asymmetric.yaml,
    lines 5-20, 24-39, gaussian_blur 0.0; imagenet-100/
    augmentations/asymmetric.yaml: blur 1.0 and 0.1)."""
    view = common.Recipe(crop_scale=tuple(args.crop_scale),
                         jitter=(0.4, 0.4, 0.2, 0.1))
    blur = (1.0, 0.1) if args.image_size > 64 else (0.0, 0.0)
    return [replace(view, blur_p=blur[0]),
            replace(view, blur_p=blur[1], solarize_p=0.2)]


# ---------------------------------------------------------- main loop
def main(argv=None):
    # shared: the options, this process
    args = parse_args(argv)
    ctx = common.setup(args)

    # own: the data, NNCLR's network, support set (a batch at
    # least), optimiser, augmentation
    data = common.load_data(args, ctx)
    torch.manual_seed(args.seed)  # the same model on every rank
    if args.support_size < args.batch_size:
        raise common.UserError(
            f"--support-size {args.support_size} is smaller than the global "
            f"batch {args.batch_size}; it must hold at least one batch")
    model = NNCLR(args.arch, args.width, data.image_size, args.proj_hidden,
                  args.proj_dim, args.pred_hidden,
                  args.stem_padding).to(ctx.device)
    backbone = model.backbone
    net = common.distribute(model, ctx)  # `model` stays bare
    support_set = SupportSet(args.support_size, args.proj_dim, args.seed)
    support_set = support_set.to(ctx.device)
    peak_lr = args.lr * args.batch_size / 256
    optimizer = common.pretraining_optimizer(
        model.parameters(), args, peak_lr)
    augment = common.Augment(recipes(args), data.image_size,
                             data.mean, data.std, ctx)
    if args.compile:  # the loss stays as written
        net = torch.compile(net)
        augment = torch.compile(augment)
    # what a checkpoint keeps
    states = dict(model=model, optimizer=optimizer,
                  support_set=support_set)

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
            loss, same_class, labelled = train_step(
                net, optimizer, views, args, ctx, labels, support_set)
            run.meter.update(lr, loss=loss, same_class=same_class,
                             labelled=labelled)

        # own: the fraction of labelled anchors whose neighbour
        # has their class
        record = run.meter.summary()
        same_class = record.pop("same_class")
        labelled = record.pop("labelled")
        record["nn_same_class"] = None
        if labelled > 0:
            record["nn_same_class"] = same_class / labelled
        run.end_epoch(record)  # the kNN monitor, the log, a checkpoint

    # shared: the final evaluation, backbone.pt, results.json
    run.finish()


if __name__ == "__main__":
    common.run(main)
