"""MoCo v2, SimMoCo and SimCo with the dual-temperature InfoNCE loss.

Paper: Zhang et al., "Dual Temperature Helps Contrastive Learning
Without Many Negative Samples: Towards Understanding and
Simplifying MoCo", CVPR 2022, arXiv:2203.17248 (DT). InfoNCE's
gradient on an anchor is a scalar W_i (inter-anchor hardness)
times a direction (intra-anchor hardness) (DT Eq. 4); dual
temperature sets the scalar at tau_beta, the direction at
tau_alpha (DT Eq. 9). MoCo v2's queue can then go (SimMoCo), and its
momentum encoder too (SimCo: one encoder, a symmetric loss).

    python moco_simmoco_simco.py --method simco --dataset cifar100
    torchrun --nproc_per_node=8 moco_simmoco_simco.py \\
        --method simmoco --dataset cifar100  # global batch 256
    python moco_simmoco_simco.py --dataset textures --width 8 \\
        --batch-size 32 --lr 0.3 --warmup-epochs 0 --epochs 3 \\
        --proj-hidden 256 --proj-dim 64  # CPU, no download

"official": github.com/ChaoningZhang/Dual-temperature, a fork of
solo-learn (solo/ paths).
"""
import argparse
import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import common


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=common.HelpFormatter)
    common.add_common_args(parser)
    add = parser.add_argument
    # This project's choice: SimCo, the paper's proposal and best
    # result (official README).
    add("--method", choices=["mocov2", "simmoco", "simco"],
        default="simco",
        help="mocov2 = queue + momentum encoder, simmoco = no "
             "queue, simco = no queue, no momentum")
    add("--symmetric", action="store_true",
        help="MoCo v2+ / SimMoCo+: both views are queries (twice "
             "the compute); SimCo always is")
    # The DT paper's "Training" paragraph; official
    # bash_files/*.sh --temperature 0.1.
    add("--tau-alpha", type=common.positive_float, default=0.1,
        help="temperature of the intra-anchor (vector) part")
    # 1.0: "Training"; official simco.sh, simmoco.sh --dt_m 10
    # (x 0.1). mocov2: plain InfoNCE, as official moco.sh
    # (solo/losses/moco.py).
    add("--tau-beta", type=common.positive_float, default=None,
        help="temperature of the inter-anchor (scalar) part "
             "(None: 1.0; mocov2: = tau-alpha)")
    # Official solo/methods/mocov2.py, moco.sh; the DT paper.
    add("--queue-size", type=common.positive_int, default=65536,
        help="mocov2: keys K in each queue")
    # "Training"; official moco.sh and simmoco.sh
    # --base/final_tau_momentum 0.99.
    add("--key-momentum", type=common.momentum_value,
        default=0.99, help="m of the momentum (key) encoder EMA")
    # The DT paper's protocol ("Evaluation": top-1 of the online
    # linear evaluation), official base.py's online classifier.
    add("--online-probe", action=argparse.BooleanOptionalAction,
        default=True, help="the DT authors' online classifiers")
    # Official bash_files/{moco,simmoco,simco}.sh
    # --proj_hidden_dim 128.
    add("--proj-hidden", type=common.positive_int, default=128,
        help="projector hidden width")
    # Official solo/methods/*.py --proj_output_dim.
    add("--proj-dim", type=common.positive_int, default=128,
        help="projection dimension D")
    # "Training" and official bash_files/*.sh: batch 256, 200
    # epochs, lr 0.03 per 256 (solo/args/utils.py), wd 5e-4, 10
    # warm-up epochs (solo/methods/base.py); crop scale from 0.08
    # (solo/args/dataset.py). The CIFAR stem's padding 2:
    # solo/methods/base.py lines 239-241.
    parser.set_defaults(batch_size=256, epochs=200, lr=0.03, wd=5e-4,
                        warmup_epochs=10, crop_scale=(0.08, 1.0),
                        stem_padding=2)
    args = common.parse_args(parser, argv, "moco_simmoco_simco")
    if args.tau_beta is None:
        plain = args.method == "mocov2"
        args.tau_beta = args.tau_alpha if plain else 1.0
    if args.method == "mocov2" and args.queue_size < args.batch_size:
        # One step's keys must fit in each queue, or some would
        # overwrite others (K need not divide by the batch).
        parser.error(f"--queue-size {args.queue_size} is smaller "
                     f"than the {args.batch_size} keys one step "
                     f"pushes; use at least that")
    return args


# ------------------------------ model
class Encoder(nn.Module):
    """backbone f (ResNet) + MoCo v2's projector (Linear-ReLU-Linear,
    no BatchNorm): image -> (B, D), and the backbone's (B, F),
    which the online probe learns from."""

    def __init__(self, arch, width, image_size, proj_hidden=128,
                 proj_dim=128, stem_padding=1):
        super().__init__()
        self.backbone = common.ResNet(arch, width, image_size, stem_padding)
        self.projector = nn.Sequential(
            nn.Linear(self.backbone.out_dim, proj_hidden), nn.ReLU(),
            nn.Linear(proj_hidden, proj_dim))

    def forward(self, x):
        features = self.backbone(x)
        return self.projector(features), features


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


class KeyQueue(nn.Module):
    """MoCo's dictionary: a FIFO of the global batch's last `size`
    unit keys, (K, D). Buffers, so the checkpoint holds them; the
    write position is a device tensor (no host sync). The rows start
    as random unit vectors, as MoCo's, the same on every rank."""

    def __init__(self, size, dim, seed=0):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        noise = torch.randn(size, dim, generator=generator)
        rows = F.normalize(noise, dim=1)  # (K, D)
        self.register_buffer("rows", rows)
        # The next row to write: the oldest.
        self.register_buffer("ptr", torch.zeros((), dtype=torch.long))

    @torch.no_grad()
    def push(self, rows):
        """rows (N, D), gathered from every rank, replace the N
        oldest, wrapping around the end: none is dropped."""
        n = len(rows)
        size = len(self.rows)
        if n > size:
            raise ValueError(f"{type(self).__name__} of {size} rows "
                             f"cannot take a batch of {n}")
        offsets = torch.arange(n, device=self.rows.device)
        index = (self.ptr + offsets) % size  # (N,)
        self.rows.index_copy_(0, index, rows.to(self.rows.dtype))
        self.ptr.copy_((self.ptr + n) % size)


# ------------------------------ loss
def dual_temperature_loss(q, k, tau_alpha=0.1, tau_beta=1.0, queue=None):
    """DT Eq. 9 over this rank's anchors -> (loss, (W(tau_alpha),
    W(tau_beta))): a scalar and two (B,).

        L_i = sg(W_i(tau_beta) / W_i(tau_alpha)) * InfoNCE_i(tau_alpha)
        W_i(tau) = 1 - p_+(tau)

    The ratio swaps InfoNCE's anchor weight W(tau_alpha) (DT Eq. 4)
    for W(tau_beta), keeping the direction (which negatives push)
    at tau_alpha; tau_beta = tau_alpha is InfoNCE (DT Eq. 1).
    q, k: (B, D) anchors and their positive keys, normalised here.
    queue: (K, D) unit negatives (MoCo v2). None: q_i's negatives
    are the GLOBAL batch's keys k_j, j != i, with gradient when k
    has it (SimCo).
    """
    q = F.normalize(q, dim=1)
    k = F.normalize(k, dim=1)
    l_pos = (q * k).sum(1, keepdim=True)  # (B, 1)
    if queue is not None:
        l_neg = q @ queue.T  # (B, K)
    else:
        # Every rank's keys in rank order; SimCo's carry gradient.
        keys = common.gather_with_grad(k)  # (N, D)
        l_neg = q @ keys.T  # (B, N)
        # k_i is q_i's positive, not a negative: mask its column.
        b = len(q)
        own = common.rank() * b + torch.arange(b, device=q.device)  # (B,)
        columns = torch.arange(len(keys), device=q.device)  # (N,)
        is_positive = columns[None, :] == own[:, None]  # (B, N)
        l_neg = l_neg.masked_fill(is_positive, -math.inf)
    # The positive in column 0, as MoCo writes it.
    logits = torch.cat([l_pos, l_neg], 1)  # (B, 1 + K or N)
    labels = torch.zeros(len(q), dtype=torch.long, device=q.device)
    infonce = F.cross_entropy(logits / tau_alpha, labels,
                              reduction="none")  # (B,) -log p_+
    if tau_beta == tau_alpha:
        # The weight ratio is 1: plain InfoNCE (DT Eq. 1), MoCo
        # v2's loss. W_i = 1 - exp(-InfoNCE_i) is a diagnostic.
        w = -torch.expm1(-infonce.detach())  # (B,)
        return infonce.mean(), (w, w)

    def log_w(tau):
        # log W_i(tau) (DT Eq. 4): as p_+ -> 1, 1 - p_+ itself
        # keeps no significant digit.
        log_neg = torch.logsumexp(l_neg / tau, 1)  # (B,)
        log_denom = torch.logaddexp(l_pos[:, 0] / tau, log_neg)
        return log_neg - log_denom

    # sg(.): a constant to autograd, so each anchor's gradient
    # keeps InfoNCE's direction at tau_alpha, only rescaled.
    with torch.no_grad():
        log_w_alpha = log_w(tau_alpha)
        log_w_beta = log_w(tau_beta)
    ratio = torch.exp(log_w_beta - log_w_alpha)  # (B,)
    loss = (ratio * infonce).mean()  # DT Eq. 9
    return loss, (log_w_alpha.exp(), log_w_beta.exp())


@torch.no_grad()
def anchor_weight_stats(w_alpha, w_beta):
    """Over the global batch: mean W(tau_alpha), mean W(tau_beta),
    the entropy H of r_+ (DT Fig. 3), mean W log W (for
    epoch_share).

    r_+^i = W_i / sum_j W_j is anchor i's share of the pull towards
    the positives, with the W the loss applies, W(tau_beta). Equal
    weights give the maximum, H = log N for N anchors."""
    w_alpha = common.gather(w_alpha)  # (N,) every rank's anchors
    w_beta = common.gather(w_beta)  # (N,)
    r_plus = w_beta / w_beta.sum()  # (N,)
    entropy = torch.special.entr(r_plus).sum()  # -sum r log r
    w_log_w = torch.special.xlogy(w_beta, w_beta).mean()
    return w_alpha.mean(), w_beta.mean(), entropy, w_log_w


def epoch_share(record):
    """An epoch's record, with r_plus_share in place of w_log_w.

    r_plus_share is exp(H) / n, the share of the epoch's n anchors
    that carried its pull, where H is the entropy of r_+ taken over
    all n of them (each step's loss is a mean over as many anchors,
    so anchor i's share of the epoch's pull is W_i / sum_j W_j).
    From the epoch's means of W and W log W, W at tau_beta:
        H = log(n mean W) - mean(W log W) / mean W
    """
    w, w_log_w = record["w_beta"], record.pop("w_log_w")
    share = math.nan  # no anchor pulls: no share
    if w > 0:
        share = w * math.exp(-w_log_w / w)
    record["r_plus_share"] = share
    return record


# ------------------------------ training step
def train_step(net, optimizer, views, args, ctx, key_encoder=None,
               queues=None):
    """One SGD step -> the loss, anchor_weight_stats and the views'
    backbone features (2b, F), detached: the online encoder's, then
    the key encoder's. L is DT Eq. 9, f `net`, f_k the key encoder.

    mocov2, simmoco: L(q1, k2), q1 = f(x1), k2 = f_k(x2) (no
    gradient); --symmetric (MoCo v2+, SimMoCo+) averages it with
    L(q2, k1). simco: (L(z1, z2) + L(z2, z1)) / 2, z = f(x),
    gradient through both. Each view is its own forward pass
    (BatchNorm over its own batch) through each encoder, as the
    official code (DT solo/methods/base.py, lines 475, 482):
    without --symmetric, q2 and k1 feed only BatchNorm's statistics
    and the probes.
    """
    def L(q, k, queue=None):
        return dual_temperature_loss(q, k, args.tau_alpha,
                                     args.tau_beta, queue)

    x1, x2 = views
    if args.method == "simco":
        with ctx.autocast():
            z1, h1 = net(x1)  # (b, D), (b, F)
            z2, h2 = net(x2)
        z1 = common.float32(z1)
        z2 = common.float32(z2)
        loss_12, (wa_12, wb_12) = L(z1, z2)
        loss_21, (wa_21, wb_21) = L(z2, z1)
        loss = (loss_12 + loss_21) / 2
        w_alpha = torch.cat([wa_12, wa_21])  # (2b,)
        w_beta = torch.cat([wb_12, wb_21])
    else:
        with ctx.autocast():
            q1, h1 = net(x1)  # (b, D), (b, F)
            # Without --symmetric no loss takes q2: no graph.
            with torch.set_grad_enabled(args.symmetric):
                q2, h2 = net(x2)
            # q2's and q1's positives.
            with torch.no_grad():
                k1, key_h1 = key_encoder(x1)  # (b, D), (b, F)
                k2, key_h2 = key_encoder(x2)
        # mocov2's negatives: a queue of past keys per key view.
        past = [None, None]
        if queues is not None:
            past = [queue.rows for queue in queues]  # (K, D) each
        q1 = common.float32(q1)
        # Unit keys, as the queue keeps them.
        k2 = F.normalize(common.float32(k2), dim=1)
        loss, (w_alpha, w_beta) = L(q1, k2, past[0])
        if args.symmetric:
            q2 = common.float32(q2)
            k1 = F.normalize(common.float32(k1), dim=1)
            loss_21, (wa_21, wb_21) = L(q2, k1, past[1])
            loss = (loss + loss_21) / 2
            w_alpha = torch.cat([w_alpha, wa_21])  # (2b,)
            w_beta = torch.cat([w_beta, wb_21])
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    if key_encoder is not None:
        # After the step: the next keys see the new theta_q.
        ema_update(key_encoder, net, args.key_momentum)
    if queues is not None:
        # Every rank's keys in rank order, as one process's.
        queues[0].push(common.gather(k2))
        if args.symmetric:
            queues[1].push(common.gather(k1))
    features = [torch.cat([h1, h2]).detach()]  # (2b, F)
    if key_encoder is not None:
        features.append(torch.cat([key_h1, key_h2]))
    stats = anchor_weight_stats(w_alpha, w_beta)
    return loss.detach(), stats, features


def recipes(args):
    """MoCo v2's CIFAR augmentation for both views: crop, colour
    jitter, grayscale, flip; no blur. The DT paper ("Training")
    lists jitter, flip and grayscale; the official scripts
    (CIFAR-100 only) set --gaussian_prob 0.0 0.0, kept on STL-10
    (this project's choice). Jitter 0.4, 0.4, 0.4, 0.1: the
    scripts'; p 0.8, 0.2, 0.5: Recipe's, from
    solo/utils/pretrain_dataloader.py."""
    crop_scale = tuple(args.crop_scale)
    return [common.Recipe(crop_scale=crop_scale, blur_p=0.0)] * 2


# ------------------------------ the online probes
class OnlineProbes:
    """The DT authors' online linear evaluation (official
    solo/methods/base.py lines 335-343, 424-447): a classifier
    trained during pre-training on the views' detached backbone
    features, and one on the momentum encoder's
    (--momentum_classifier). SGD, momentum 0.9, lr 0.3 at any
    batch (bash_files/*.sh), on the schedule's shape."""

    def __init__(self, data, ctx, args, encoder, key_encoder=None,
                 lr=0.3):
        self.data = data
        self.ctx = ctx
        self.workers = args.workers
        self.key_encoder = key_encoder
        self.lr = lr
        names = ["online_top1"]
        if key_encoder is not None:
            names.append("momentum_online_top1")
        self.classifiers = nn.ModuleDict({
            name: common.linear_classifier(
                encoder.backbone.out_dim, data.num_classes, ctx.device,
                args.seed)
            for name in names})
        self.optimizer = torch.optim.SGD(
            self.classifiers.parameters(), lr=lr, momentum=0.9)

    def step(self, features, labels, lr_scale):
        """A step on train_step's features; lr_scale: lr / peak."""
        loss = 0
        for classifier, f in zip(self.classifiers.values(), features):
            f = common.float32(f)  # (V b, F)
            y = labels.repeat(len(f) // len(labels))  # (V b,)
            loss = loss + F.cross_entropy(
                classifier(f), y, ignore_index=-1, reduction="sum")
        # The mean over the global batch's labelled views.
        labelled = common.all_reduce_sum((y >= 0).sum()).clamp_min(1)
        self.optimizer.zero_grad(set_to_none=True)
        (loss / labelled).backward()
        for p in self.classifiers.parameters():
            p.grad = common.all_reduce_sum(p.grad)
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr * lr_scale
        self.optimizer.step()

    def top1(self, test_f, test_y):
        """Test top-1 %: the online classifier on the run's test
        features (F), the momentum one on the key encoder's."""
        classify = self.classifiers["online_top1"]
        result = {"online_top1": common.top1(classify, test_f, test_y)}
        if self.key_encoder is not None:
            f, y = common.extract_features(
                self.key_encoder.backbone, self.data.eval_test,
                self.data, self.ctx, self.workers, unit=False)
            classify = self.classifiers["momentum_online_top1"]
            result["momentum_online_top1"] = common.top1(classify, f, y)
        return result

    def state_dict(self):  # for checkpoint.pt
        return dict(classifiers=self.classifiers.state_dict(),
                    optimizer=self.optimizer.state_dict())

    def load_state_dict(self, state):
        self.classifiers.load_state_dict(state["classifiers"])
        self.optimizer.load_state_dict(state["optimizer"])


# ------------------------------ main loop
def main(argv=None):
    # shared: the options, this process
    args = parse_args(argv)
    ctx = common.setup(args)

    # own: the data (CIFAR-100 with the DT fork's CIFAR-10
    # statistics), the encoder, the key encoder, the queues
    data = common.load_data(args, ctx)
    torch.manual_seed(args.seed)  # the same model on every rank
    if args.dataset == "cifar100":
        data.mean, data.std = common.STATS["cifar10"]
    model = Encoder(args.arch, args.width, data.image_size,
                    args.proj_hidden, args.proj_dim,
                    args.stem_padding).to(ctx.device)
    backbone = model.backbone
    net = common.distribute(model, ctx)  # `model` stays bare
    key_encoder = None
    if args.method != "simco":  # global BatchNorm: no shuffle-BN
        key_encoder = momentum_encoder(model, ctx)
    queues = None
    if args.method == "mocov2":
        # MoCo v2+ keeps a queue per key view, as official mocov2plus.
        n_queues = 2 if args.symmetric else 1
        queues = nn.ModuleList(
            KeyQueue(args.queue_size, args.proj_dim, args.seed + i)
            for i in range(n_queues)).to(ctx.device)

    # own: the optimiser, the probes, the augmentation
    peak_lr = args.lr * args.batch_size / 256
    optimizer = common.pretraining_optimizer(
        model.parameters(), args, peak_lr)
    probes = None  # DT's online evaluation (--online-probe)
    if args.online_probe:
        probes = OnlineProbes(data, ctx, args, model, key_encoder)
    augment = common.Augment(recipes(args), data.image_size,
                             data.mean, data.std, ctx)
    if args.compile:  # the loss stays as written
        net = torch.compile(net)
        augment = torch.compile(augment)
    # what a checkpoint keeps
    states = dict(model=model, optimizer=optimizer,
                  key_encoder=key_encoder, queues=queues, probes=probes)

    # shared: the run folder; a checkpoint there is continued
    run = common.Run(args, ctx, data, backbone, states)
    # own: the probes' test top-1 beside each kNN monitor
    run.also = probes.top1 if probes else None
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
            loss, stats, features = train_step(
                net, optimizer, views, args, ctx, key_encoder, queues)
            if probes:
                probes.step(features, labels, lr / peak_lr)
            w_alpha, w_beta, entropy, w_log_w = stats
            # the anchors' weights, how unequal (DT Eq. 4, Fig. 3)
            run.meter.update(lr, loss=loss, w_alpha=w_alpha,
                             w_beta=w_beta, r_plus_entropy=entropy,
                             w_log_w=w_log_w)

        # own: the epoch's means and share of the pull, the anchors
        # r_+ spans a step (2N with a loss per view), the kNN
        # monitor, the log
        record = epoch_share(run.meter.summary())
        per_view = args.method == "simco" or args.symmetric
        record["anchors"] = args.batch_size * (2 if per_view else 1)
        run.end_epoch(record)

    # shared: the final evaluation, backbone.pt, results.json
    run.finish()


if __name__ == "__main__":
    common.run(main)
