"""NNCLR with the InfoNCE, DCL or DCLW loss.

Papers: Dwibedi et al., "With a Little Help from My Friends: Nearest-Neighbor Contrastive Learning"
(NNCLR), ICCV 2021, and Yeh et al., "Decoupled Contrastive Learning", ECCV 2022, contribution 4.
NNCLR takes as the positive of a view not the other view but
the nearest neighbour of its projection in a support set of past projections, and asks it to pick
the prediction of the other view among the predictions of the global batch. DCL removes the
positive from that denominator; DCLW also up-weights hard positive pairs.

    python nnclr_dcl.py --loss dcl                        # one GPU, CIFAR-10 downloaded to ./data
    torchrun --nproc_per_node=8 nnclr_dcl.py --loss dcl   # 8 GPUs, same global batch of 256
    python nnclr_dcl.py --dataset imagefolder --data-dir D --width 8 --epochs 2 --device cpu  # CPU smoke run
"""
import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import common
from common import all_reduce_sum, gather, gather_with_grad, logsumexp_rows


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=common.HelpFormatter)
    common.add_common_args(parser)
    parser.add_argument("--loss", choices=["infonce", "dcl", "dclw"], default="dcl",
                        help="infonce = NNCLR, dcl = NNCLR + DCL (Prop. 2), dclw = NNCLR + DCL with the vMF weight")
    parser.add_argument("--temperature", type=common.positive_float, default=0.1, help="tau")
    parser.add_argument("--sigma", type=common.positive_float, default=0.5, help="DCLW weight temperature")
    parser.add_argument("--support-size", type=common.positive_int, default=16384,
                        help="support set Q: how many past projections the nearest neighbour is searched in")
    parser.add_argument("--proj-hidden", type=common.positive_int, default=2048, help="projector hidden width")
    parser.add_argument("--proj-dim", type=common.positive_int, default=256, help="projection dimension D")
    parser.add_argument("--pred-hidden", type=common.positive_int, default=4096, help="predictor hidden width")
    # NNCLR + DCL CIFAR setting: batch 256, 200 epochs, SGD lr 0.06 per 256, wd 5e-4, cosine
    parser.set_defaults(batch_size=256, epochs=200, lr=0.06, wd=5e-4, warmup_epochs=10, crop_scale=(0.08, 1.0))
    return common.parse_args(parser, argv, "nnclr_dcl")


# ------------------------------------------------------------------------------ model

def mlp(dims, last_bn):
    """Linear-BN-ReLU blocks through `dims`; the last layer gets a BatchNorm only if `last_bn`."""
    layers = []
    for i, (d_in, d_out) in enumerate(zip(dims[:-1], dims[1:])):
        last = i == len(dims) - 2
        layers.append(nn.Linear(d_in, d_out, bias=last and not last_bn))
        if not last or last_bn:
            layers.append(nn.BatchNorm1d(d_out))
        if not last:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class NNCLR(nn.Module):
    """backbone f + projector g (3 layers) + predictor h (2 layers), as in NNCLR.

    image (B, 3, S, S) -> projection z (B, proj_dim) and prediction p = h(z) (B, proj_dim), neither
    normalised. z only feeds the support set and the nearest-neighbour lookup; the loss sees p.
    """

    def __init__(self, arch, width, image_size, proj_hidden=2048, proj_dim=256, pred_hidden=4096):
        super().__init__()
        self.backbone = common.ResNet(arch, width, image_size)
        self.projector = mlp([self.backbone.out_dim, proj_hidden, proj_hidden, proj_dim], last_bn=True)
        self.predictor = mlp([proj_dim, pred_hidden, proj_dim], last_bn=False)

    def forward(self, x):
        z = self.projector(self.backbone(x))
        return z, self.predictor(z)


# ------------------------------------------------------------------------------ support set

class SupportSet:
    """NNCLR's support set Q: a FIFO queue of the last `size` projections of the global batch.

    Starts as random unit vectors (label -1), as the public NNCLR implementations do, so the first
    size / batch steps look up partly random neighbours. It is a constant for the loss: rows are
    stored detached, and the lookup picks rows without a gradient. `labels` serve only the
    neighbour-quality diagnostic; training never reads them.
    """

    def __init__(self, size, dim, device, seed=0):
        generator = torch.Generator().manual_seed(seed)
        self.z = F.normalize(torch.randn(size, dim, generator=generator), dim=1).to(device)  # (Q, D) unit rows
        self.labels = torch.full((size,), -1, dtype=torch.long, device=device)  # (Q,)
        self.ptr = 0  # next row to overwrite = the oldest row

    @torch.no_grad()
    def push(self, z, labels):
        """Append this step's rows of EVERY rank (rank order, as one process would) -> all ranks agree.

        z: (B, D) unit projections of this rank, labels: (B,). Wraps around the end of the queue
        so no row of the batch is dropped: the oldest rows are overwritten.
        """
        z, labels = gather(z), gather(labels)  # (N, D), (N,) the global batch, no gradient
        if len(z) > len(self.z):
            raise ValueError(f"support set of {len(self.z)} rows cannot take a batch of {len(z)}")
        rows = (self.ptr + torch.arange(len(z), device=self.z.device)) % len(self.z)  # (N,) wrap-around
        self.z[rows] = z.to(self.z.dtype)
        self.labels[rows] = labels
        self.ptr = (self.ptr + len(z)) % len(self.z)

    def state_dict(self):
        return {"z": self.z, "labels": self.labels, "ptr": self.ptr}

    def load_state_dict(self, state):
        if state["z"].shape != self.z.shape:
            raise common.UserError(f"checkpoint: the saved support set is {tuple(state['z'].shape)}, this run "
                                   f"needs {tuple(self.z.shape)}; start a new --out")
        self.z.copy_(state["z"])
        self.labels.copy_(state["labels"])
        self.ptr = int(state["ptr"])


@torch.no_grad()
def nearest_index(z, support_set):
    """Row of the support set most cosine-similar to each z: (B, D), (Q, D) unit rows -> (B,).

    One (B, Q) matmul; the argmax does not depend on |z|, so z need not be normalised.
    """
    return (z @ support_set.T).argmax(1)  # (B,)


@torch.no_grad()  # no gradient into the support set, nor through the lookup back into z
def nearest_neighbour(z, support_set):
    """NN(z) = argmax_{s in Q} <z, s> (NNCLR's lookup): (B, D), (Q, D) unit rows -> (B, D)."""
    return support_set[nearest_index(z, support_set)]


# ------------------------------------------------------------------------------ loss

def nnclr_loss(z1, z2, p1, p2, support_set, temperature=0.1, loss="dcl", sigma=0.5):
    """NNCLR loss with the InfoNCE, DCL or DCLW denominator, mean over this rank's anchors -> scalar.

    z1, z2: (B, D) projections of the two views on this rank; p1, p2: (B, D) their predictions;
    support_set: (Q, D) unit rows, the same on every rank. The lookup of both views is one matmul.
    """
    nn1, nn2 = nearest_neighbour(torch.cat([z1, z2]), support_set).chunk(2)  # (B, D) each
    return anchor_losses(nn1, nn2, p1, p2, temperature, loss, sigma).mean()


def anchor_losses(nn1, nn2, p1, p2, temperature=0.1, loss="dcl", sigma=0.5):
    """The loss of each of this rank's 2B anchors [NN(z^(1)); NN(z^(2))] -> (2B,).

    Anchor NN(z_i^(1)) must pick p_i^(2) among the predictions p_j^(2) of the N images of the
    global batch (gathered from all ranks with gradient), and NN(z_i^(2)) picks p_i^(1): the
    symmetrised NNCLR loss. With pos = <NN(z_i^(1)), p_i^(2)>/tau (p normalised here) and
    U_i = sum_{j != i} exp(<NN(z_i^(1)), p_j^(2)>/tau) over the N-1 negatives:
      InfoNCE: L_i = -pos + log(exp(pos) + U_i)       (NNCLR)
      DCL:     L_i = -pos + log U_i                    (DCL Prop. 2: positive out of the denominator)
      DCLW:    L_i = -w_i * pos + log U_i              (w_i from dclw_weights, a constant in backward)
    The neighbours are constants; the gradient reaches the network through the predictions only.
    """
    b = nn1.shape[0]
    anchors = torch.stack([nn1, nn2])  # (2, B, D)
    partners = F.normalize(torch.stack([p2, p1]), dim=2)  # (2, B, D) each anchor's other-view prediction
    # every rank's partners, in rank order: gather gives (world*2, B, D) -> (2, N, D)
    candidates = gather_with_grad(partners).unflatten(0, (-1, 2)).transpose(0, 1).flatten(1, 2)
    logits = (anchors / temperature) @ candidates.transpose(1, 2)  # (2, B, N); 1/tau on the small side
    similarity = (anchors * partners).sum(2)  # (2, B) <NN(z_i^(1)), p_i^(2)>, <NN(z_i^(2)), p_i^(1)>
    pos = (similarity / temperature).flatten()  # (2B,)
    if loss == "infonce":
        return logsumexp_rows(logits, 1 / temperature).flatten() - pos  # unit rows: logits <= 1/tau
    # This rank's partners are columns [r*B, (r+1)*B) of the N; the positive sits on that block's
    # diagonal. Filling it in place is safe because the matmul saves its inputs, not its output; through
    # a detached view, because exp(-inf) = 0 sends no gradient there anyway and a fill that autograd
    # records would copy the whole (2, B, N) gradient in backward.
    start = common.rank() * b
    logits.detach()[:, :, start:start + b].diagonal(dim1=1, dim2=2).fill_(-math.inf)  # DCL Prop. 2: drop the positive
    log_u = logsumexp_rows(logits, 1 / temperature).flatten()  # (2B,) log U_i
    if loss == "dcl":
        return log_u - pos
    if loss == "dclw":
        return log_u - dclw_weights(similarity, sigma).flatten() * pos
    raise ValueError(f"unknown loss {loss!r}")


@torch.no_grad()  # the weight is a constant in backward (sg), as in the paper's weighting function
def dclw_weights(similarity, sigma=0.5):
    """DCLW's negative von Mises-Fisher weight of each positive pair, here (NN(z_i^(1)), p_i^(2)):
    similarity (..., B) cosine of the pairs on this rank -> (..., B), mean 1 over the GLOBAL batch:
    w_i = 2 - exp(s_i/sigma) / mean_j exp(s_j/sigma), one mean per direction of the symmetrised loss."""
    vmf = torch.exp(similarity / sigma)  # (..., B)
    mean_vmf = all_reduce_sum(vmf.sum(-1, keepdim=True)) / (vmf.shape[-1] * common.world_size())
    return 2 - vmf / mean_vmf


# ------------------------------------------------------------------------------ training step

def train_step(model, optimizer, views, labels, support_set, args, ctx):
    """One SGD step on both views, then the support set takes the batch's z^(1).

    Returns the loss and, for the diagnostic, how many of this rank's labelled anchors have a
    neighbour of their own class and how many labelled anchors there were.
    """
    x = torch.cat(views)  # (2b, 3, S, S): one forward pass for both views
    with ctx.autocast():
        z, p = model(x)
    z, p = z.to(support_set.z.dtype), p.to(support_set.z.dtype)  # the support set's float32 under bf16 autocast
    z = F.normalize(z.detach(), dim=1)  # (2b, D) only looked up and stored: no gradient
    p1, p2 = p.chunk(2)
    # nnclr_loss(z1, z2, p1, p2, support_set.z) written out, to keep the neighbours' rows for the diagnostic
    index = nearest_index(z, support_set.z)  # (2b,) both views in one matmul
    nn1, nn2 = support_set.z[index].chunk(2)
    loss = anchor_losses(nn1, nn2, p1, p2, args.temperature, args.loss, args.sigma).mean()
    # NNCLR's neighbour quality: does the neighbour share the anchor's class? (labels never train)
    anchor_labels = labels.repeat(2)  # (2b,)
    labelled = anchor_labels >= 0  # STL-10's unlabeled images are -1: left out
    same_class = (support_set.labels[index] == anchor_labels) & labelled
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    support_set.push(z[:len(z) // 2], labels)  # after the lookup: neighbours come from past batches only
    return loss.detach(), same_class.sum(), labelled.sum()


def recipes(args):
    """NNCLR uses BYOL's augmentations. At <= 64 px (CIFAR) both views get SimCLR's crop, flip and
    colour, no blur or solarisation; larger images get BYOL's asymmetric blur and solarisation."""
    if args.image_size <= 64:
        return [common.Recipe(crop_scale=tuple(args.crop_scale))] * 2
    return [common.Recipe(crop_scale=tuple(args.crop_scale), blur_p=1.0),
            common.Recipe(crop_scale=tuple(args.crop_scale), blur_p=0.1, solarize_p=0.2)]


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
                  args.pred_hidden)
    net = common.distribute(model.to(ctx.device), ctx)  # global BatchNorm + DDP; `model` stays bare
    if args.compile:
        net = common.compile_model(net, ctx)
    peak_lr = args.lr * args.batch_size / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=peak_lr, momentum=0.9, weight_decay=args.wd,
                                fused=ctx.device.type == "cuda")
    support_set = SupportSet(args.support_size, args.proj_dim, ctx.device, args.seed)
    states = {"model": model, "optimizer": optimizer, "support_set": support_set}
    start_epoch = common.load_checkpoint(ctx, states) if args.resume else 0
    common.start_run(args, ctx, "nnclr_dcl")
    augment = common.Augment(recipes(args), data.image_size, data.mean, data.std, ctx)
    steps = len(data) // args.batch_size

    for epoch in range(start_epoch, args.epochs):
        order = common.epoch_generator(args.seed, epoch)  # data order, on the CPU
        generator = common.epoch_generator(args.seed, epoch, ctx.device)  # augmentation
        meter = common.EpochMeter(ctx, epoch, args.epochs, steps, args.batch_size)
        batches = common.train_batches(data, args.batch_size, order, ctx, args.workers)
        for step, (images, labels) in enumerate(batches):
            lr = common.learning_rate(epoch * steps + step, args.epochs * steps,
                                      args.warmup_epochs * steps, peak_lr)
            for group in optimizer.param_groups:
                group["lr"] = lr
            views = augment(images, generator)
            loss, same_class, labelled = train_step(net, optimizer, views, labels, support_set,
                                                    args, ctx)
            meter.update(lr, loss=loss, same_class=same_class, labelled=labelled)
        record = meter.summary()
        common.check_finite(record)
        # the fraction of labelled anchors whose nearest neighbour has their class
        same_class, labelled = record.pop("same_class"), record.pop("labelled")
        record["nn_same_class"] = same_class / labelled if labelled > 0 else None
        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            record.update(common.evaluate(model.backbone, data, ctx, args))
        common.log_epoch(ctx, record)
        common.save_checkpoint(ctx, epoch + 1, states)
        if args.stop_after == epoch + 1 < args.epochs:
            return ctx.print(f"stopped after epoch {epoch + 1}: continue with --resume {ctx.out}")

    common.finish(ctx, model.backbone, common.evaluate(model.backbone, data, ctx, args, final=True))


if __name__ == "__main__":
    common.run(main)
