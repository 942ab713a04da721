"""NNCLR with the InfoNCE, DCL or DCLW loss.

Papers: Dwibedi et al., "With a Little Help from My Friends: Nearest-Neighbor Contrastive Learning
of Visual Representations" (NNCLR), ICCV 2021; Yeh et al., "Decoupled Contrastive Learning" (DCL),
ECCV 2022, contribution 4. NNCLR replaces a view's projection by its nearest neighbour in a
support set of past projections; that neighbour must pick the prediction of the other view among
the predictions of the global batch. DCL removes the positive from that denominator; DCLW also
up-weights hard positive pairs.

    python nnclr_dcl.py --loss dcl                        # one GPU, CIFAR-10 downloaded to ./data
    torchrun --nproc_per_node=8 nnclr_dcl.py --loss dcl   # 8 GPUs, same global batch of 256
    python nnclr_dcl.py --dataset textures --width 8 --batch-size 32 --lr 0.3 --warmup-epochs 0 \\
        --epochs 3 --proj-hidden 256 --proj-dim 64 --support-size 512   # CPU, no download
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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=common.HelpFormatter)
    common.add_common_args(parser)
    parser.add_argument("--loss", choices=["infonce", "dcl", "dclw"], default="dcl",
                        help="infonce = NNCLR, dcl = NNCLR + DCL (Prop. 2), dclw = vMF-weighted")
    # solo-learn's CIFAR NNCLR, scripts/pretrain/cifar/nnclr.yaml line 19 (temperature 0.2)
    parser.add_argument("--temperature", type=common.positive_float, default=0.2, help="tau")
    # sigma 0.5: lightly's DCLWLoss default (lightly/loss/dcl_loss.py, third-party)
    parser.add_argument("--sigma", type=common.positive_float, default=0.5,
                        help="DCLW weight temperature")
    # nnclr.yaml line 23 (queue_size 65536)
    parser.add_argument("--support-size", type=common.positive_int, default=65536,
                        help="support set Q: past projections the nearest neighbour is searched in")
    # head widths: solo-learn's NNCLR (solo/methods/nnclr.py defaults, its CIFAR config too)
    parser.add_argument("--proj-hidden", type=common.positive_int, default=2048,
                        help="projector hidden width")
    parser.add_argument("--proj-dim", type=common.positive_int, default=256,
                        help="projection dimension D")
    parser.add_argument("--pred-hidden", type=common.positive_int, default=4096,
                        help="predictor hidden width")
    # solo-learn's CIFAR NNCLR (the DCL paper gives no CIFAR settings for NNCLR + DCL), nnclr.yaml:
    # batch 256 (line 32); LARS (31), eta 0.02, clip_lr, bias and norms excluded (36-39); lr 0.4
    # (33) per 256 (solo/args/pretrain.py lines 153-154 scale it by batch / 256); weight decay 1e-5
    # (35); warmup_cosine (41), 10 warm-up epochs per step (solo/methods/base.py lines 293-294);
    # 1000 epochs (50). Crop scale (0.08, 1): augmentations/asymmetric.yaml lines 3-4. The CIFAR
    # stem's padding 2: solo/methods/base.py lines 200-202 (at 9187ea3)
    parser.set_defaults(batch_size=256, epochs=1000, lr=0.4, wd=1e-5, warmup_epochs=10,
                        crop_scale=(0.08, 1.0), optimizer="lars", lars_eta=0.02, lars_clip=True,
                        stem_padding=2)
    return common.parse_args(parser, argv, "nnclr_dcl")


# ------------------------------------------------------------------------------ model
class NNCLR(nn.Module):
    """backbone f + projector g (3 layers) + predictor h (2 layers), as in NNCLR.

    image (B, 3, S, S) -> projection z (B, proj_dim) and prediction p = h(z) (B, proj_dim), neither
    normalised. z only feeds the support set and the nearest-neighbour lookup; the loss sees p.
    """

    def __init__(self, arch, width, image_size, proj_hidden=2048, proj_dim=256, pred_hidden=4096,
                 stem_padding=1):
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


# ------------------------------------------------------------------------------ support set
class SupportSet(nn.Module):
    """NNCLR's support set Q: a FIFO of the last `size` unit projections of the global batch (Q, D).

    Buffers, so the checkpoint holds them; the write position is a device tensor (no host sync).
    The rows start as random unit vectors, as the public NNCLR implementations do, the same on
    every rank (seeded). `labels` (-1: none yet) serve only the neighbour-quality diagnostic.
    """

    def __init__(self, size, dim, seed=0):
        super().__init__()
        noise = torch.randn(size, dim, generator=torch.Generator().manual_seed(seed))
        self.register_buffer("rows", F.normalize(noise, dim=1))  # (Q, D)
        self.register_buffer("labels", torch.full((size,), -1, dtype=torch.long))  # (Q,)
        self.register_buffer("ptr", torch.zeros((), dtype=torch.long))  # next row = the oldest

    @torch.no_grad()
    def push(self, rows, labels):
        """rows (N, D) and labels (N,) already gathered from every rank: they replace the N oldest
        rows, wrapping around the end, so no row of the batch is dropped."""
        n, size = len(rows), len(self.rows)
        if n > size:
            raise ValueError(f"{type(self).__name__} of {size} rows cannot take a batch of {n}")
        index = (self.ptr + torch.arange(n, device=self.rows.device)) % size  # (N,) wraps around
        self.rows.index_copy_(0, index, rows.to(self.rows.dtype))
        self.labels.index_copy_(0, index, labels.to(self.labels.device))
        self.ptr.copy_((self.ptr + n) % size)


@torch.no_grad()
def nearest_index(z, support_set):
    """Row of the support set most cosine-similar to each z: (B, D), (Q, D) unit rows -> (B,).
    One (B, Q) matmul; the argmax does not depend on |z|, so z need not be normalised."""
    return (z @ support_set.T).argmax(1)  # (B,)


@torch.no_grad()  # no gradient into the support set, nor through the lookup back into z
def nearest_neighbour(z, support_set):
    """NN(z) = argmax_{s in Q} <z, s> (NNCLR's lookup): (B, D), (Q, D) unit rows -> (B, D)."""
    return support_set[nearest_index(z, support_set)]


# ------------------------------------------------------------------------------ loss
def nnclr_loss(z1, z2, p1, p2, support_set, temperature=0.1, loss="dcl", sigma=0.5,
               reduction="mean"):
    """NNCLR's symmetrised loss with the InfoNCE, DCL or DCLW denominator: mean over the anchors
    of the global batch -> scalar (reduction="none": this rank's (2B,) anchor losses, direction 1
    then direction 2, for the identity tests).

    z1, z2: (B, D) projections of the two views on this rank; p1, p2: (B, D) their predictions;
    support_set: (Q, D) unit rows, the same on every rank. Anchor NN(z_i^(1)) must pick p_i^(2)
    among the predictions p_j^(2) of the N images of the global batch (gathered from all ranks
    with gradient), and NN(z_i^(2)) picks p_i^(1). With pos = <NN(z_i^(1)), p_i^(2)>/tau (p
    normalised here) and U_i the sum of exp over the N-1 negatives j != i:
      InfoNCE: L_i = -pos + log(exp(pos) + U_i)   (NNCLR)
      DCL:     L_i = -pos + log U_i                (DCL Prop. 2)
      DCLW:    L_i = -w_i pos + log U_i            (w_i = dclw_weights, a constant)
    The neighbours are constants; the gradient reaches the network through the predictions only.
    """
    if loss not in ("infonce", "dcl", "dclw"):
        raise ValueError(f"unknown loss {loss!r}")
    b = p1.shape[0]
    rows = torch.arange(b, device=p1.device)  # (B,)
    own = common.rank() * b + rows  # (B,) this rank's images among the N
    losses = []
    for z, p in ((z1, p2), (z2, p1)):  # NN of one view picks the other view's prediction
        anchors = nearest_neighbour(z, support_set)  # (B, D) unit rows, no gradient
        partners = F.normalize(p, dim=1)  # (B, D)
        candidates = gather_with_grad(partners)  # (N, D) every rank's predictions, with gradient
        logits = anchors @ candidates.T / temperature  # (B, N)
        columns = torch.arange(logits.shape[1], device=logits.device)  # (N,)
        positive_mask = columns == own[:, None]  # (B, N) anchor i's positive is p_i
        pos = logits[rows, own]  # (B,) pos_i, each anchor's positive logit
        if loss != "infonce":
            logits = logits.masked_fill(positive_mask, -math.inf)  # DCL Prop. 2: drop the positive
        weight = dclw_weights((anchors * partners).sum(1), sigma) if loss == "dclw" else 1.0  # (B,)
        losses.append(-weight * pos + torch.logsumexp(logits, dim=1))  # (B,)
    losses = torch.cat(losses)  # (2B,)
    return losses if reduction == "none" else losses.mean()


@torch.no_grad()  # w is a constant weight in backward (sg), as the paper's weighting function
def dclw_weights(pos_similarity, sigma=0.5):
    """DCLW's weight of each positive pair, the paper's negative von Mises-Fisher function:
    pos_similarity (B,) cosine of this rank's positive pairs -> (B,), with mean 1 over the GLOBAL
    batch:  w_i = 2 - exp(s_i / sigma) / mean_j exp(s_j / sigma), j over every rank's pairs.
    Here a pair is (NN(z_i^(1)), p_i^(2)), one call per direction of the symmetrised loss."""
    vmf = torch.exp(pos_similarity / sigma)  # (B,)
    global_mean = all_reduce_sum(vmf.sum()) / (vmf.numel() * common.world_size())
    return 2 - vmf / global_mean


# ------------------------------------------------------------------------------ training step
def train_step(net, optimizer, views, args, ctx, labels, support_set):
    """One SGD step on both views, then the support set takes the global batch's unit z^(1).

    Returns the loss and, for the diagnostic, how many of this rank's labelled anchors have a
    neighbour of their own class and how many labelled anchors there were.
    """
    with ctx.autocast():
        # one forward pass per view, so BatchNorm normalises each view with its own statistics,
        # as solo-learn's NNCLR (per-crop forward) does; simclr_dcl.py keeps SimCLR's joint pass
        (z1, p1), (z2, p2) = net(views[0]), net(views[1])  # (B, D) each
    z1, z2 = common.float32(z1), common.float32(z2)
    p1, p2 = common.float32(p1), common.float32(p2)
    loss = nnclr_loss(z1, z2, p1, p2, support_set.rows, args.temperature, args.loss, args.sigma)
    with torch.no_grad():  # NNCLR's neighbour quality: same class as the anchor? (never trains)
        index = nearest_index(torch.cat([z1, z2]), support_set.rows)  # (2B,) the loss's neighbours
        anchor_labels = labels.repeat(2)  # (2B,)
        labelled = anchor_labels >= 0  # STL-10's unlabeled images are -1: left out
        same_class = (support_set.labels[index] == anchor_labels) & labelled
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    # after the lookup, so neighbours come from past batches only; every rank's rows, rank order
    support_set.push(gather(F.normalize(z1.detach(), dim=1)), gather(labels))
    return loss.detach(), same_class.sum(), labelled.sum()


def recipes(args):
    """solo-learn's asymmetric views for NNCLR (BYOL's): jitter (0.4, 0.4, 0.2, 0.1) p 0.8,
    grayscale p 0.2, flip p 0.5 in both; solarisation p 0.2 in the second view only; blur only
    above 64 px, p 1.0 and 0.1 (scripts/pretrain/cifar/augmentations/asymmetric.yaml: lines 5-20,
    24-39, gaussian_blur 0.0; imagenet-100/augmentations/asymmetric.yaml: blur 1.0 and 0.1)."""
    view = common.Recipe(crop_scale=tuple(args.crop_scale), jitter=(0.4, 0.4, 0.2, 0.1))
    blur = (1.0, 0.1) if args.image_size > 64 else (0.0, 0.0)
    return [replace(view, blur_p=blur[0]), replace(view, blur_p=blur[1], solarize_p=0.2)]


# ------------------------------------------------------------------------------ main loop
def main(argv=None):
    args = parse_args(argv)
    ctx = common.setup(args)  # this process's device; the process group under torchrun
    data = common.load_data(args, ctx)
    args.image_size = data.image_size
    if args.support_size < args.batch_size:
        raise common.UserError(f"--support-size {args.support_size} is smaller than the global "
                               f"batch {args.batch_size}; it must hold at least one batch")
    torch.manual_seed(args.seed)  # the same initial model on every rank
    model = NNCLR(args.arch, args.width, data.image_size, args.proj_hidden, args.proj_dim,
                  args.pred_hidden, args.stem_padding)
    net = common.distribute(model.to(ctx.device), ctx)  # global BatchNorm + DDP; `model` stays bare
    net = torch.compile(net) if args.compile else net
    peak_lr = args.lr * args.batch_size / 256
    optimizer = common.pretraining_optimizer(model.parameters(), args, ctx, peak_lr)
    support_set = SupportSet(args.support_size, args.proj_dim, args.seed).to(ctx.device)
    probes = common.online_probes(args, data, ctx, model.backbone)
    for probe in probes.values():  # the probes read the features by a forward hook
        probe.backbone.register_forward_hook(probe.keep)
    states = {"model": model, "optimizer": optimizer, "support_set": support_set, **probes}
    start_epoch = common.load_checkpoint(ctx, states) if args.resume else 0
    common.start_run(args, ctx, data, model.backbone)
    augment = common.Augment(recipes(args), data.image_size, data.mean, data.std, ctx)
    steps = len(data) // args.batch_size

    for epoch in range(start_epoch, args.epochs):
        # data order, on the CPU; augmentation on the device
        order, generator = common.epoch_generators(args.seed, epoch, ctx.device)
        meter = common.EpochMeter(ctx, epoch, args.epochs, steps, args.batch_size)
        batches = common.train_batches(data, args.batch_size, order, ctx, args.workers)
        for step, (images, labels) in enumerate(batches):
            lr = common.learning_rate(epoch * steps + step, args.epochs * steps,
                                      args.warmup_epochs * steps, peak_lr)
            for group in optimizer.param_groups:
                group["lr"] = lr
            views = augment(images, generator)
            loss, same_class, labelled = train_step(net, optimizer, views, args, ctx, labels,
                                                    support_set)
            for probe in probes.values():  # the views' features this step kept
                probe.step(labels, lr / peak_lr)
            meter.update(lr, loss=loss, same_class=same_class, labelled=labelled)
        record = meter.summary()
        common.check_finite(record)
        # the fraction of labelled anchors whose nearest neighbour has their class
        same_class, labelled = record.pop("same_class"), record.pop("labelled")
        record["nn_same_class"] = same_class / labelled if labelled > 0 else None
        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            record.update(common.evaluate(model.backbone, data, ctx, args, probes=probes))
        common.log_epoch(ctx, record)
        common.save_checkpoint(ctx, epoch + 1, states)
        if args.stop_after == epoch + 1 < args.epochs:
            return ctx.print(f"stopped after epoch {epoch + 1}: continue with --resume {ctx.out}")

    results = common.evaluate(model.backbone, data, ctx, args, final=True, probes=probes)
    common.finish(ctx, model.backbone, results)


if __name__ == "__main__":
    common.run(main)
