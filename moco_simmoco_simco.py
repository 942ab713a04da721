"""MoCo v2, SimMoCo and SimCo with the dual-temperature InfoNCE loss.

Paper: Zhang et al., "Dual Temperature Helps Contrastive Learning Without Many Negative Samples:
Towards Understanding and Simplifying MoCo", CVPR 2022, arXiv:2203.17248 (Eq. numbers are the
paper's). InfoNCE's gradient on an anchor is a scalar W_i (inter-anchor hardness) times a
direction (intra-anchor hardness) (DT Eq. 4). Dual temperature sets the scalar at tau_beta and the
direction at tau_alpha (DT Eq. 9). With it, MoCo v2's queue can go (SimMoCo: the current batch's
keys are the negatives), then its momentum encoder too (SimCo: one encoder, symmetric loss).

    python moco_simmoco_simco.py --method simco --dataset cifar100                 # one GPU
    torchrun --nproc_per_node=8 moco_simmoco_simco.py --method simmoco --dataset cifar100
    python moco_simmoco_simco.py --dataset textures --width 8 --batch-size 32 --lr 0.3 \\
        --warmup-epochs 0 --epochs 3 --proj-hidden 256 --proj-dim 64  # CPU, no download

(torchrun: --batch-size is global, 256 split over the 8 GPUs; the last line runs on a CPU in
minutes.) "official": github.com/ChaoningZhang/Dual-temperature, built on solo-learn (solo/ paths).
"""
import argparse
import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import common


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=common.HelpFormatter)
    common.add_common_args(parser)
    a = parser.add_argument
    # this project's choice: SimCo is the paper's proposal and its best result (official README)
    a("--method", choices=["mocov2", "simmoco", "simco"], default="simco",
      help="mocov2 = queue + momentum encoder, simmoco = no queue, simco = no queue, no momentum")
    a("--symmetric", action="store_true",
      help="MoCo v2+ / SimMoCo+: both views are queries (twice the compute); SimCo always is")
    # DT paper, "Training" paragraph; official bash_files/*.sh --temperature 0.1
    a("--tau-alpha", type=common.positive_float, default=0.1,
      help="temperature of the intra-anchor (vector) part")
    # DT paper, "Training" paragraph (1.0); official simco.sh / simmoco.sh --dt_m 10 (x 0.1).
    # mocov2: = tau-alpha, plain InfoNCE as official bash_files/moco.sh (solo/losses/moco.py)
    a("--tau-beta", type=common.positive_float, default=None,
      help="temperature of the inter-anchor (scalar) part (default 1.0; mocov2: = tau-alpha)")
    # official solo/methods/mocov2.py --queue_size default (moco.sh keeps it); DT paper: "65536"
    a("--queue-size", type=common.positive_int, default=65536,
      help="mocov2: keys K in each queue")
    # DT paper, "Training" paragraph; official moco.sh / simmoco.sh --base/final_tau_momentum 0.99
    a("--key-momentum", type=common.momentum_value, default=0.99,
      help="m of the momentum (key) encoder EMA")
    # official bash_files/{moco,simmoco,simco}.sh --proj_hidden_dim 128
    a("--proj-hidden", type=common.positive_int, default=128, help="projector hidden width")
    # official solo/methods/*.py --proj_output_dim default 128 (the scripts keep it)
    a("--proj-dim", type=common.positive_int, default=128, help="projection dimension D")
    # DT paper, "Training" paragraph, and official bash_files/*.sh: --batch_size 256,
    # --max_epochs 200, --lr 0.03 (per 256: solo/args/utils.py scales it by batch / 256),
    # --weight_decay 5e-4; 10 warm-up epochs: the paper and solo/methods/base.py --warmup_epochs;
    # crop area from 0.08: solo/args/dataset.py --min_scale default. The online probe: the DT
    # paper's "Evaluation" paragraph reports "top-1 accuracy ... with the online linear evaluation".
    # The CIFAR stem's padding 2: official solo/methods/base.py lines 239-241 (at e8d5e76)
    parser.set_defaults(batch_size=256, epochs=200, lr=0.03, wd=5e-4, warmup_epochs=10,
                        crop_scale=(0.08, 1.0), online_probe=True, stem_padding=2)
    args = common.parse_args(parser, argv, "moco_simmoco_simco")
    if args.tau_beta is None:  # MoCo v2 is plain InfoNCE unless --tau-beta asks for it
        args.tau_beta = args.tau_alpha if args.method == "mocov2" else 1.0
    if args.method == "mocov2" and args.queue_size < args.batch_size:
        # each step pushes the global batch's keys onto each queue; more than K would overwrite
        # each other (any size >= the batch works, no divisibility needed)
        parser.error(f"--queue-size {args.queue_size} is smaller than the {args.batch_size} keys "
                     f"one step pushes; use at least that")
    return args


# ------------------------------------------------------------------------------ model
class Encoder(nn.Module):
    """backbone f (ResNet) + MoCo v2's projector (Linear-ReLU-Linear, no BatchNorm) -> (B, D)."""

    def __init__(self, arch, width, image_size, proj_hidden=128, proj_dim=128, stem_padding=1):
        super().__init__()
        self.backbone = common.ResNet(arch, width, image_size, stem_padding)
        self.projector = nn.Sequential(nn.Linear(self.backbone.out_dim, proj_hidden), nn.ReLU(),
                                       nn.Linear(proj_hidden, proj_dim))

    def forward(self, x):
        return self.projector(self.backbone(x))


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


class KeyQueue(nn.Module):
    """MoCo's dictionary: a FIFO of the last `size` unit keys of the global batch (K, D).

    Buffers, so the checkpoint holds them; the write position is a device tensor (no host sync).
    The rows start as random unit vectors, as MoCo's do, the same on every rank (seeded).
    """

    def __init__(self, size, dim, seed=0):
        super().__init__()
        noise = torch.randn(size, dim, generator=torch.Generator().manual_seed(seed))
        self.register_buffer("rows", F.normalize(noise, dim=1))  # (K, D)
        self.register_buffer("ptr", torch.zeros((), dtype=torch.long))  # next row = the oldest

    @torch.no_grad()
    def push(self, rows):
        """rows (N, D) already gathered from every rank: they replace the N oldest rows, wrapping
        around the end, so no row of the batch is dropped."""
        n, size = len(rows), len(self.rows)
        if n > size:
            raise ValueError(f"{type(self).__name__} of {size} rows cannot take a batch of {n}")
        index = (self.ptr + torch.arange(n, device=self.rows.device)) % size  # (N,) wraps around
        self.rows.index_copy_(0, index, rows.to(self.rows.dtype))
        self.ptr.copy_((self.ptr + n) % size)


# ------------------------------------------------------------------------------ loss
def dual_temperature_loss(q, k, tau_alpha=0.1, tau_beta=1.0, queue=None):
    """DT Eq. 9 over this rank's anchors -> (loss, (W(tau_alpha), W(tau_beta))): a scalar, (B,) x 2.

        L_i = sg(W_i(tau_beta) / W_i(tau_alpha)) * InfoNCE_i(tau_alpha),   W_i(tau) = 1 - p_+(tau)

    The ratio swaps InfoNCE's anchor weight W(tau_alpha) (DT Eq. 4) for W(tau_beta) and keeps the
    direction (which negatives push) at tau_alpha; tau_beta = tau_alpha is InfoNCE (DT Eq. 1).
    q, k: (B, D) anchors and their positive keys (normalised here).
    queue: (K, D) unit-vector negatives (MoCo v2); None: the negatives of q_i are the keys k_j,
    j != i, of the GLOBAL batch, with gradient when k has it (SimCo).
    """
    q, k = F.normalize(q, dim=1), F.normalize(k, dim=1)
    l_pos = (q * k).sum(1, keepdim=True)  # (B, 1) <q_i, k_i>
    if queue is not None:
        l_neg = q @ queue.T  # (B, K)
    else:
        keys = common.gather_with_grad(k)  # (N, D) all ranks' keys, rank order; SimCo's get grad
        l_neg = q @ keys.T  # (B, N)
        b = len(q)
        own = common.rank() * b + torch.arange(b, device=q.device)  # (B,) column of k_i in keys
        is_positive = torch.arange(len(keys), device=q.device)[None, :] == own[:, None]  # (B, N)
        l_neg = l_neg.masked_fill(is_positive, -math.inf)  # k_i is q_i's positive, not a negative
    logits = torch.cat([l_pos, l_neg], 1)  # (B, 1 + K) or (B, 1 + N): the positive in column 0
    labels = torch.zeros(len(q), dtype=torch.long, device=q.device)
    infonce = F.cross_entropy(logits / tau_alpha, labels, reduction="none")  # (B,) -log p_+(tau_a)
    if tau_beta == tau_alpha:  # the weight ratio is 1: plain InfoNCE (DT Eq. 1), MoCo v2's loss
        w = -torch.expm1(-infonce.detach())  # W_i = 1 - p_+ = 1 - exp(-InfoNCE_i), a diagnostic
        return infonce.mean(), (w, w)

    def log_w(tau):  # (B,) log W_i(tau): the softmax mass on the negatives, 1 - p_+ (DT Eq. 4)
        # in log space: as p_+ -> 1, the difference 1 - p_+ keeps no significant digit
        log_neg = torch.logsumexp(l_neg / tau, 1)  # log sum_j exp(<q_i, k_j> / tau)
        return log_neg - torch.logaddexp(l_pos[:, 0] / tau, log_neg)  # minus the log denominator

    with torch.no_grad():  # sg(.): the weight is a constant to autograd
        log_w_alpha, log_w_beta = log_w(tau_alpha), log_w(tau_beta)
    loss = (torch.exp(log_w_beta - log_w_alpha) * infonce).mean()  # DT Eq. 9
    return loss, (log_w_alpha.exp(), log_w_beta.exp())


@torch.no_grad()
def anchor_weight_stats(w_alpha, w_beta):
    """Over the global batch: mean W(tau_alpha), mean W(tau_beta), entropy of r_+ (DT Fig. 3).

    r_+^i = W_i / sum_j W_j is the share anchor i gets of the pull towards the positives; we take
    the W the loss applies, W(tau_beta). Equal weights give the maximum, log(number of anchors).
    """
    w_alpha, w_beta = common.gather(w_alpha), common.gather(w_beta)  # (N,) every rank's anchors
    r_plus = w_beta / w_beta.sum()
    return w_alpha.mean(), w_beta.mean(), torch.special.entr(r_plus).sum()  # entr(r) = -r log r


# ------------------------------------------------------------------------------ training step
def train_step(net, optimizer, views, args, ctx, key_encoder=None, queues=None):
    """One SGD step; returns the loss and (mean W(tau_alpha), mean W(tau_beta), H(r_+)).

    L(q, k, queue) is DT Eq. 9 (dual_temperature_loss); f is `net`, f_k the momentum encoder.
      mocov2 / simmoco: q1 = f(x1), k2 = f_k(x2) (no gradient), L(q1, k2, queue); --symmetric
        (MoCo v2+ / SimMoCo+) adds L(q2, k1), q2 = f(x2), k1 = f_k(x1): (L(q1, k2) + L(q2, k1)) / 2.
        mocov2's negatives are past keys, a queue per key view as official mocov2plus: q1 meets
        past k2's, q2 past k1's; simmoco's are the batch's other keys (queue None).
      simco: z1 = f(x1), z2 = f(x2), (L(z1, z2) + L(z2, z1)) / 2, gradient through both.
    Each view is its own forward pass (BatchNorm over its own batch) through each encoder, in every
    method, as the official code (DT's solo/methods/base.py lines 475, 482): without
    --symmetric, q2 and k1 feed only BatchNorm's statistics and the online probes.
    """
    def L(q, k, queue=None):  # -> (loss, (W(tau_alpha), W(tau_beta)) per anchor)
        return dual_temperature_loss(q, k, args.tau_alpha, args.tau_beta, queue)
    x1, x2 = views
    if args.method == "simco":
        with ctx.autocast():
            z1, z2 = net(x1), net(x2)  # (b, D) each
        z1, z2 = common.float32(z1), common.float32(z2)
        (loss_12, (wa_12, wb_12)), (loss_21, (wa_21, wb_21)) = L(z1, z2), L(z2, z1)
        loss = (loss_12 + loss_21) / 2
        w_alpha, w_beta = torch.cat([wa_12, wa_21]), torch.cat([wb_12, wb_21])  # (2b,) each
    else:
        with ctx.autocast():
            q1 = net(x1)  # (b, D)
            with torch.set_grad_enabled(args.symmetric):  # else no loss takes q2: no graph
                q2 = net(x2)  # (b, D)
            with torch.no_grad():
                k1, k2 = key_encoder(x1), key_encoder(x2)  # (b, D) each: q2's and q1's positives
        q1, k2 = common.float32(q1), F.normalize(common.float32(k2), dim=1)  # keys: unit, as queued
        loss, (w_alpha, w_beta) = L(q1, k2, queues[0].rows if queues is not None else None)
        if args.symmetric:
            q2, k1 = common.float32(q2), F.normalize(common.float32(k1), dim=1)
            loss_21, (wa_21, wb_21) = L(q2, k1, queues[1].rows if queues is not None else None)
            loss = (loss + loss_21) / 2
            w_alpha, w_beta = torch.cat([w_alpha, wa_21]), torch.cat([w_beta, wb_21])  # (2b,)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    if key_encoder is not None:
        # after the step: the next step's keys come from m * theta_k + (1 - m) * (current theta_q)
        ema_update(key_encoder, net, args.key_momentum)
    if queues is not None:  # every rank's keys, in rank order: one process's rows
        queues[0].push(common.gather(k2))
        if args.symmetric:
            queues[1].push(common.gather(k1))
    return loss.detach(), anchor_weight_stats(w_alpha, w_beta)


def recipes(args):
    """MoCo v2's CIFAR augmentation: crop, colour jitter, grayscale, flip; never blur.

    The DT paper ("Training") lists jitter, flip and grayscale; the official scripts (CIFAR-100
    only) set --gaussian_prob 0.0 0.0, kept here on STL-10 too (this project's). Jitter strengths
    0.4/0.4/0.4/0.1: the scripts'; p 0.8 / 0.2 / 0.5: solo/utils/pretrain_dataloader.py (Recipe's).
    """
    return [common.Recipe(crop_scale=tuple(args.crop_scale), blur_p=0.0)] * 2  # both views


# ------------------------------------------------------------------------------ main loop
def main(argv=None):
    args = parse_args(argv)
    ctx = common.setup(args)  # this process's device; the process group under torchrun
    data = common.load_data(args, ctx)
    if args.dataset == "cifar100":  # as the DT fork does: CIFAR-10's mean and std
        data.mean, data.std = common.STATS["cifar10"]
    args.image_size = data.image_size
    torch.manual_seed(args.seed)  # the same initial model on every rank
    model = Encoder(args.arch, args.width, data.image_size, args.proj_hidden, args.proj_dim,
                    args.stem_padding).to(ctx.device)
    key_encoder = momentum_encoder(model, ctx) if args.method != "simco" else None  # no shuffle-BN
    queues = None
    if args.method == "mocov2":  # MoCo v2+ keeps one queue per key view, as official mocov2plus
        queues = nn.ModuleList(KeyQueue(args.queue_size, args.proj_dim, args.seed + i)
                               for i in range(2 if args.symmetric else 1)).to(ctx.device)
    net = common.distribute(model, ctx)  # global BatchNorm + DDP; `model` stays bare
    net = torch.compile(net) if args.compile else net
    peak_lr = args.lr * args.batch_size / 256
    optimizer = common.pretraining_optimizer(model.parameters(), args, ctx, peak_lr)
    probes = common.online_probes(args, data, ctx, model.backbone, key_encoder)
    for probe in probes.values():  # the probes read the features by a forward hook
        probe.backbone.register_forward_hook(probe.keep)
    states = {"model": model, "optimizer": optimizer, "key_encoder": key_encoder, "queues": queues,
              **probes}
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
            loss, (w_alpha, w_beta, entropy) = train_step(net, optimizer, views, args, ctx,
                                                          key_encoder, queues)
            for probe in probes.values():  # the views' features this step kept
                probe.step(labels, lr / peak_lr)
            # DT Fig. 3 / Eq. 4: the anchors' weights and how unequal they are
            meter.update(lr, loss=loss, w_alpha=w_alpha, w_beta=w_beta, r_plus_entropy=entropy)
        record = meter.summary()
        common.check_finite(record)
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
