"""MoCo v2, SimMoCo and SimCo with the dual-temperature InfoNCE loss.

Paper: Zhang et al., "Dual Temperature Helps Contrastive Learning Without Many Negative Samples:
Towards Understanding and Simplifying MoCo", CVPR 2022, arXiv:2203.17248 (Eq. numbers are the paper's).
InfoNCE's gradient on an anchor is a scalar W_i (inter-anchor hardness) times a direction
(intra-anchor hardness) (DT Eq. 4). Dual temperature sets the scalar at tau_beta and the direction
at tau_alpha (DT Eq. 9). With it, MoCo v2's queue can go (SimMoCo: the current batch's keys are the
negatives), and then its momentum encoder too (SimCo: one encoder, symmetric loss, gradient on both).

    python moco_simmoco_simco.py --method simco --dataset cifar100                        # one GPU
    torchrun --nproc_per_node=8 moco_simmoco_simco.py --method simmoco --dataset cifar100  # 8 GPUs, global batch 256
    python moco_simmoco_simco.py --dataset imagefolder --data-dir D --width 8 --epochs 2 --device cpu  # CPU smoke run
"""
import argparse
import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import common
from common import all_reduce_sum, gather, gather_with_grad, logsumexp_rows


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=common.HelpFormatter)
    common.add_common_args(parser)
    parser.add_argument("--method", choices=["mocov2", "simmoco", "simco"], default="simco",
                        help="mocov2 = queue + momentum encoder, simmoco = no queue, simco = no queue, no momentum")
    parser.add_argument("--symmetric", action="store_true",
                        help="MoCo v2+ / SimMoCo+: both views are queries (twice the compute); SimCo always is")
    parser.add_argument("--tau-alpha", type=common.positive_float, default=0.1,
                        help="temperature of the intra-anchor (vector) part")
    parser.add_argument("--tau-beta", type=common.positive_float, default=None,
                        help="temperature of the inter-anchor (scalar) part (default 1.0; mocov2: = tau-alpha)")
    parser.add_argument("--queue-size", type=common.positive_int, default=65536, help="mocov2: keys in the queue K")
    parser.add_argument("--key-momentum", type=float, default=0.99, help="m of the momentum (key) encoder EMA")
    parser.add_argument("--proj-hidden", type=common.positive_int, default=2048, help="projector hidden width")
    parser.add_argument("--proj-dim", type=common.positive_int, default=128, help="projection dimension D")
    # the paper's CIFAR setting: batch 256, 200 epochs, SGD lr 0.03 per 256, wd 5e-4
    parser.set_defaults(batch_size=256, epochs=200, lr=0.03, wd=5e-4, warmup_epochs=10, crop_scale=(0.08, 1.0))
    args = common.parse_args(parser, argv, "moco_simmoco_simco")
    if args.tau_beta is None:  # MoCo v2 is plain InfoNCE unless --tau-beta asks for dual temperature
        args.tau_beta = args.tau_alpha if args.method == "mocov2" else 1.0
    if not 0 <= args.key_momentum < 1:
        parser.error(f"--key-momentum {args.key_momentum}: must be in [0, 1)")
    keys_per_step = args.batch_size * (2 if args.symmetric else 1)
    if args.method == "mocov2" and args.queue_size < keys_per_step:
        # every step writes all its keys; more than K of them would overwrite each other
        parser.error(f"--queue-size {args.queue_size} is smaller than the {keys_per_step} keys one step "
                     f"enqueues; use at least that (any size >= it works, no divisibility needed)")
    return args


# ------------------------------------------------------------------------------ model

class Encoder(nn.Module):
    """backbone f (ResNet) + MoCo v2's projector (Linear-ReLU-Linear, no BatchNorm): image -> (B, proj_dim)."""

    def __init__(self, arch, width, image_size, proj_hidden=2048, proj_dim=128):
        super().__init__()
        self.backbone = common.ResNet(arch, width, image_size)
        self.projector = nn.Sequential(nn.Linear(self.backbone.out_dim, proj_hidden), nn.ReLU(),
                                       nn.Linear(proj_hidden, proj_dim))

    def forward(self, x):
        return self.projector(self.backbone(x))


def momentum_encoder(model, ctx):
    """A frozen copy of the query encoder, its BatchNorm over the global batch (no shuffle-BN)."""
    key_encoder = common.sync_batchnorm(copy.deepcopy(model), ctx).requires_grad_(False)
    if ctx.device.type == "cuda":
        key_encoder = key_encoder.to(memory_format=torch.channels_last)
    return key_encoder


@torch.no_grad()
def update_key_encoder(key_encoder, query_encoder, momentum):
    """theta_k <- m * theta_k + (1 - m) * theta_q, parameter by parameter (MoCo's EMA).

    BatchNorm running statistics are not averaged: the key encoder runs in train mode and keeps its own.
    """
    keys, queries = list(key_encoder.parameters()), list(query_encoder.parameters())
    assert len(keys) == len(queries)
    torch._foreach_lerp_(keys, queries, 1 - momentum)  # k + (1 - m)(q - k), one fused kernel per dtype


class KeyQueue(nn.Module):
    """MoCo's dictionary: a FIFO ring of the K most recent keys of ALL ranks, (K, D), L2-normalised.

    Buffers, so they go into the checkpoint; the write position is a device tensor (no host sync).
    """

    def __init__(self, size, dim):
        super().__init__()
        self.register_buffer("keys", F.normalize(torch.randn(size, dim), dim=1))  # MoCo starts from noise
        self.register_buffer("ptr", torch.zeros((), dtype=torch.long))

    @torch.no_grad()
    def enqueue(self, keys):
        """keys: (N, D) already gathered from every rank; they replace the N oldest, wrapping around."""
        n, size = keys.shape[0], self.keys.shape[0]
        assert n <= size, "a step cannot enqueue more keys than the queue holds"
        rows = (self.ptr + torch.arange(n, device=keys.device)) % size  # (N,) wraps; no key is dropped
        self.keys.index_copy_(0, rows, keys.to(self.keys.dtype))
        self.ptr.copy_((self.ptr + n) % size)


# ------------------------------------------------------------------------------ loss

def dual_temperature_terms(q, k, tau_alpha=0.1, tau_beta=1.0, queue=None):
    """Per-anchor parts of DT Eq. 9 -> infonce (B,), log W(tau_alpha) (B,), log W(tau_beta) (B,).

    q, k: (B, D) this rank's anchors and their positive keys (normalised here).
    queue: (K, D) normalised negatives (MoCo v2); None: the negatives of q_i are the keys k_j, j != i,
    of the GLOBAL batch, gathered with gradient (SimCo: k comes from the trained encoder).
      p_+(tau) = exp(<q_i,k_i>/tau) / (exp(<q_i,k_i>/tau) + sum_j exp(<q_i,k_j>/tau))
      W_i(tau) = 1 - p_+(tau) = sum_j p_j(tau)       (DT Eq. 4: the anchor's weight)
      infonce_i = -log p_+(tau_alpha)                 (DT Eq. 1)
    The W's are computed in log space, log W = log sum_neg - log sum_all, exact even when p_+ -> 1.
    """
    q, k = F.normalize(q, dim=1), F.normalize(k, dim=1)
    pos = (q * k).sum(1)  # (B,) <q_i, k_i>
    # neg holds <q_i, k_j> / tau_alpha: 1/tau_alpha on the (B, D) side saves two passes over (B, N)
    if queue is not None:
        neg = (q / tau_alpha) @ queue.T  # (B, K)
    else:
        b = q.shape[0]
        neg = (q / tau_alpha) @ gather_with_grad(k).T  # (B, N) every rank's keys, in rank order
        # k_i is column rank*B + i: -inf there removes the positive from the negatives. Filling B
        # entries in place needs no (B, N) mask; it is safe because mm saves its inputs, not its output.
        # Through a detached view: exp(-inf) = 0 sends no gradient there anyway, and a recorded fill
        # would copy the whole (B, N) gradient in backward.
        start = common.rank() * b
        neg.detach()[:, start:start + b].diagonal().fill_(-math.inf)
    with torch.no_grad():  # the same similarities at the scalar temperature: no second matmul
        neg_beta = None if tau_beta == tau_alpha else logsumexp_rows(neg * (tau_alpha / tau_beta), 1 / tau_beta)
    log_neg = logsumexp_rows(neg, 1 / tau_alpha)  # (B,) log sum_j exp(<q_i,k_j>/tau_alpha); overwrites neg
    log_all = torch.logaddexp(pos / tau_alpha, log_neg)  # (B,) the positive joins the denominator
    infonce = log_all - pos / tau_alpha  # DT Eq. 1
    with torch.no_grad():
        log_w_alpha = log_neg - log_all
        if tau_beta == tau_alpha:
            log_w_beta = log_w_alpha
        else:
            log_w_beta = neg_beta - torch.logaddexp(pos.detach() / tau_beta, neg_beta)
    return infonce, log_w_alpha, log_w_beta


def dual_temperature_loss(q, k, tau_alpha=0.1, tau_beta=1.0, queue=None):
    """DT Eq. 9, mean over this rank's anchors -> scalar:  sg(W(tau_beta) / W(tau_alpha)) * InfoNCE(tau_alpha).

    The stop-gradient ratio swaps InfoNCE's anchor weight W(tau_alpha) for W(tau_beta) and keeps the
    direction (which negatives push) at tau_alpha. tau_beta == tau_alpha gives plain InfoNCE.
    q, k: (B, D); queue: (K, D) or None (see dual_temperature_terms).
    """
    infonce, log_w_alpha, log_w_beta = dual_temperature_terms(q, k, tau_alpha, tau_beta, queue)
    return (torch.exp(log_w_beta - log_w_alpha) * infonce).mean()


@torch.no_grad()
def anchor_weight_stats(log_w_alpha, log_w_beta):
    """Over the global batch: mean W(tau_alpha), mean W(tau_beta), and the entropy of r_+ (DT Fig. 3).

    r_+^i = W_i / sum_j W_j is the relative weight anchor i puts on attracting its positive; we take
    the W the loss applies, W(tau_beta). H(r_+) = log S - sum_i W_i log W_i / S with S = sum_i W_i,
    so one all-reduce of three sums gives it exactly; its maximum is log(number of anchors).
    """
    w_alpha, w_beta = log_w_alpha.exp(), log_w_beta.exp()
    count = torch.tensor(float(len(w_beta)), device=w_beta.device)
    total = all_reduce_sum(torch.stack([w_alpha.sum(), w_beta.sum(), (w_beta * log_w_beta).sum(), count]))
    entropy = total[1].log() - total[2] / total[1]
    return total[0] / total[3], total[1] / total[3], entropy


# ------------------------------------------------------------------------------ training step

def loss_precision(z):
    """bf16 autocast outputs -> float32, so the loss never runs in bf16; float32/float64 stay as they are."""
    return z.float() if z.dtype in (torch.bfloat16, torch.float16) else z


def train_step(net, optimizer, views, args, ctx, key_encoder=None, queue=None):
    """One SGD step; returns the loss and (mean W(tau_alpha), mean W(tau_beta), H(r_+)).

    mocov2 / simmoco: q from the trained encoder, k from the momentum encoder (no gradient);
      L(q1, k2), or with --symmetric (L(q1, k2) + L(q2, k1)) / 2. mocov2's negatives are the queue.
    simco: q and k from the same encoder, (L(z1, z2) + L(z2, z1)) / 2, gradient through both.
    """
    if args.method == "simco":
        with ctx.autocast():
            z1, z2 = loss_precision(net(torch.cat(views))).chunk(2)  # (b, D) each; one pass for both views
        pairs = [(z1, z2), (z2, z1)]
    else:
        # --symmetric: both views in one pass per encoder ((2b, ...)); else query view 1, key view 2
        query_views, key_views = (torch.cat(views), torch.cat(views[::-1])) if args.symmetric else views
        with ctx.autocast():
            q = loss_precision(net(query_views))  # (b, D) or (2b, D): [q1; q2]
            with torch.no_grad():
                k = F.normalize(loss_precision(key_encoder(key_views)), dim=1)  # [k2; k1], row i is q's positive
        pairs = list(zip(q.chunk(2), k.chunk(2))) if args.symmetric else [(q, k)]
    negatives = queue.keys if args.method == "mocov2" else None  # the queue before this step's keys
    terms = [dual_temperature_terms(a, b, args.tau_alpha, args.tau_beta, negatives) for a, b in pairs]
    loss = sum((torch.exp(lb - la) * nce).mean() for nce, la, lb in terms) / len(terms)  # DT Eq. 9
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    if key_encoder is not None:
        # after the step, so the next step's keys come from m * theta_k + (1 - m) * (current theta_q)
        update_key_encoder(key_encoder, net, args.key_momentum)
    if queue is not None:
        # every rank's keys, view by view, so the queue holds the same rows in the same order as one process
        queue.enqueue(torch.cat([gather(k) for _, k in pairs]))
    stats = anchor_weight_stats(torch.cat([t[1] for t in terms]), torch.cat([t[2] for t in terms]))
    return loss.detach(), stats


def recipe(args):
    """MoCo v2's CIFAR augmentation as in the paper: crop, flip, colour jitter, grayscale; no blur at 32 px."""
    return common.Recipe(crop_scale=tuple(args.crop_scale), blur_p=0.5 if args.image_size > 64 else 0.0)


# ------------------------------------------------------------------------------ main loop

def main(argv=None):
    args = parse_args(argv)
    ctx = common.setup(args)  # this process's device; the process group under torchrun
    data = common.load_data(args, ctx)
    args.image_size = data.image_size
    torch.manual_seed(args.seed)  # the same initial model on every rank
    model = Encoder(args.arch, args.width, data.image_size, args.proj_hidden, args.proj_dim)
    model = model.to(ctx.device)
    key_encoder = momentum_encoder(model, ctx) if args.method != "simco" else None
    queue = KeyQueue(args.queue_size, args.proj_dim).to(ctx.device) if args.method == "mocov2" \
        else None
    net = common.distribute(model, ctx)  # global BatchNorm + DDP; `model` stays bare
    if args.compile:
        net = common.compile_model(net, ctx)
    peak_lr = args.lr * args.batch_size / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=peak_lr, momentum=0.9, weight_decay=args.wd,
                                fused=ctx.device.type == "cuda")
    states = {"model": model, "optimizer": optimizer, "key_encoder": key_encoder, "queue": queue}
    start_epoch = common.load_checkpoint(ctx, states) if args.resume else 0
    common.start_run(args, ctx, "moco_simmoco_simco")
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
            loss, (w_alpha, w_beta, entropy) = train_step(net, optimizer, views, args, ctx,
                                                          key_encoder, queue)
            # DT Fig. 3 / Eq. 4: the anchors' weights and how unequal they are
            meter.update(lr, loss=loss, w_alpha=w_alpha, w_beta=w_beta, r_plus_entropy=entropy)
        record = meter.summary()
        common.check_finite(record)
        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            record.update(common.evaluate(model.backbone, data, ctx, args))
        common.log_epoch(ctx, record)
        common.save_checkpoint(ctx, epoch + 1, states)
        if args.stop_after == epoch + 1 < args.epochs:
            return ctx.print(f"stopped after epoch {epoch + 1}: continue with --resume {ctx.out}")

    common.finish(ctx, model.backbone, common.evaluate(model.backbone, data, ctx, args, final=True))


if __name__ == "__main__":
    common.run(main)
