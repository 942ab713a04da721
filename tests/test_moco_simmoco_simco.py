"""Tests for moco_simmoco_simco.py: the paper's identities (float64, against autograd),
the queue and the momentum encoder, 2 processes == 1 process, an exact continuation, and smoke
runs."""
import argparse
import math
import os

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import common
import moco_simmoco_simco as mss
from helpers import (check_run_folder, ctx_for, float64, identity, run_distributed, run_main,
                     smoke_args, tiny)

TAU = 0.1


def embeddings(b=6, d=5, k=9, seed=0, use_queue=True):
    """Un-normalised anchors q (B, D) and keys k (B, D) with gradient, and a normalised queue
    (K, D), None without use_queue."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, d, generator=g, dtype=torch.float64).requires_grad_()
    keys = torch.randn(b, d, generator=g, dtype=torch.float64).requires_grad_()
    queue = F.normalize(torch.randn(k, d, generator=g, dtype=torch.float64), dim=1)
    return q, keys, queue if use_queue else None


def reference_logits(q, k, queue=None):
    """Written out with an explicit mask: column 0 the positive <q_i,k_i>, then the negatives."""
    q, k = F.normalize(q, dim=1), F.normalize(k, dim=1)
    pos = (q * k).sum(1, keepdim=True)
    if queue is not None:
        return torch.cat([pos, q @ queue.T], 1)  # (B, 1 + K)
    b = len(q)
    off_diagonal = ~torch.eye(b, dtype=torch.bool)
    return torch.cat([pos, (q @ k.T)[off_diagonal].view(b, b - 1)], 1)  # (B, 1 + B - 1)


def reference_infonce(logits, tau):
    """-log p_+(tau) per anchor (DT Eq. 1) as MoCo writes it: cross-entropy with label 0."""
    labels = torch.zeros(len(logits), dtype=torch.long)
    return F.cross_entropy(logits / tau, labels, reduction="none")


def reference_weight(logits, tau):
    """W_i(tau) = sum_j p_j(tau), the softmax mass on the negatives."""
    return torch.softmax(logits / tau, 1)[:, 1:].sum(1)


def reference_dcl(logits, tau):
    """The positive-free form of Eq. 7's bracket: -<q_i,k_i>/tau + log sum_j exp(<q_i,k_j>/tau)."""
    return -logits[:, 0] / tau + torch.logsumexp(logits[:, 1:] / tau, 1)


def grad(value, x):
    return torch.autograd.grad(value, x, retain_graph=True)[0]


# ---- DT sec. 2 identities

def test_eq4_infonce_gradient_is_anchor_weight_times_positive_minus_weighted_negatives():
    """dL_i/dq_i = -(1/tau) W_i (k_i - sum_j phat_j k_j), phat_j = p_j / W_i,
    W_i = sum_j p_j = 1 - p_+.

    The code normalises q inside, so autograd's gradient on the raw q is the closed form on q/|q|
    times the normalisation Jacobian (I - qhat qhat^T) / |q|."""
    q, k, queue = embeddings()
    loss, (w_returned, _) = mss.dual_temperature_loss(q, k, TAU, TAU, queue)  # = mean_i InfoNCE_i
    g = grad(loss * len(q), q)  # the gradient of sum_i InfoNCE_i
    qn, kn = F.normalize(q, dim=1).detach(), F.normalize(k, dim=1).detach()
    p = torch.softmax(reference_logits(q, k, queue).detach() / TAU, 1)  # (B, 1 + K)
    w = p[:, 1:].sum(1)
    # weight on the positive = sum on negatives
    torch.testing.assert_close(w, 1 - p[:, 0], rtol=1e-5, atol=1e-14)
    identity("DT Eq. 4, W_i", "the loss's", w_returned, "1 - p_+", w, atol=1e-14)
    p_hat = p[:, 1:] / w[:, None]
    closed = -(1 / TAU) * w[:, None] * (kn - p_hat @ queue)  # (B, D) on the normalised q
    jacobian = torch.eye(q.shape[1]) - qn[:, :, None] * qn[:, None, :]  # (B, D, D)
    jacobian = jacobian / q.norm(dim=1)[:, None, None]
    identity("DT Eq. 4, dInfoNCE/dq", "autograd", g, "-(1/tau) W_i (k_i - sum_j phat_j k_j)",
             (jacobian @ closed[:, :, None]).squeeze(2))


@pytest.mark.parametrize("use_queue", [True, False])
def test_eq7_loss_transformation_has_the_eq1_gradient_on_q(use_queue):
    """sg(W_i) * (-<q_i,k_i>/tau + log sum_j exp(<q_i,k_j>/tau)) and -log p_+: the same dL/dq."""
    q, k, queue = embeddings(use_queue=use_queue)
    infonce, (w, _) = mss.dual_temperature_loss(q, k.detach(), TAU, TAU, queue)
    eq7 = (w * reference_dcl(reference_logits(q, k.detach(), queue), TAU)).mean()
    negatives = "a queue" if use_queue else "the batch's keys"
    identity(f"DT Eq. 7 with {negatives}, dL/dq", "autograd of InfoNCE", grad(infonce, q),
             "autograd of sg(W) * DCL", grad(eq7, q))


@pytest.mark.parametrize("use_queue", [True, False])
def test_equal_temperatures_is_exactly_infonce(use_queue):
    """tau_beta = tau_alpha: sg(W/W) = 1, so Eq. 9 is InfoNCE (Eq. 1) in value and in gradient
    on q and k."""
    q, k, queue = embeddings(use_queue=use_queue)
    loss, _ = mss.dual_temperature_loss(q, k, TAU, TAU, queue)
    reference = reference_infonce(reference_logits(q, k, queue), TAU).mean()
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=1e-14)
    for x in (q, k):
        torch.testing.assert_close(grad(loss, x), grad(reference, x), rtol=1e-5, atol=1e-13)


@pytest.mark.parametrize("use_queue", [True, False])
def test_dual_temperature_gradient_is_weight_ratio_times_infonce_gradient(use_queue):
    """Per anchor: dL_i/dq_i = (W_i(tau_b)/W_i(tau_a)) dInfoNCE_i(tau_a)/dq_i
                             = W_i(tau_b) dDCL_i(tau_a)/dq_i.

    With in-batch negatives (SimCo) the same holds for the gradient on every key, since the weight
    is a constant: d/dk of Eq. 9 = d/dk of sum_i ratio_i * InfoNCE_i."""
    tau_beta = 1.0
    q, k, queue = embeddings(use_queue=use_queue)
    loss, (w_alpha_out, w_beta_out) = mss.dual_temperature_loss(q, k, TAU, tau_beta, queue)
    logits = reference_logits(q, k, queue)
    w_alpha = reference_weight(logits, TAU).detach()
    w_beta = reference_weight(logits, tau_beta).detach()
    ratio_infonce = (w_beta / w_alpha * reference_infonce(logits, TAU)).mean()
    weighted_dcl = (w_beta * reference_dcl(logits, TAU)).mean()
    assert not torch.allclose(w_alpha, w_beta)  # the identity is not trivially true here
    negatives = "a queue" if use_queue else "the batch's keys"
    for x, name in ((q, "q"), (k, "k")):
        title = f"DT Eq. 9 with {negatives}, dL/d{name}"
        identity(title, "autograd", grad(loss, x), "W(tau_b) / W(tau_a) * dInfoNCE",
                 grad(ratio_infonce, x), atol=1e-13)
        identity(title, "autograd", grad(loss, x), "W(tau_b) * dDCL", grad(weighted_dcl, x),
                 atol=1e-13)
    torch.testing.assert_close(w_alpha_out, w_alpha, rtol=1e-5, atol=1e-14)
    torch.testing.assert_close(w_beta_out, w_beta, rtol=1e-5, atol=1e-14)


def test_tau_beta_to_infinity_weights_every_anchor_equally():
    """tau_beta -> inf: W_i(tau_beta) -> K/(K+1) for every anchor, so the gradient is K/(K+1) times
    the DCL gradient: the inter-anchor hardness-awareness is gone."""
    q, k, queue = embeddings()
    n_neg = len(queue)
    loss, (_, w_beta) = mss.dual_temperature_loss(q, k, TAU, 1e9, queue)
    expected = torch.full((len(q),), n_neg / (n_neg + 1), dtype=torch.float64)
    torch.testing.assert_close(w_beta, expected, rtol=1e-5, atol=1e-8)
    dcl = n_neg / (n_neg + 1) * reference_dcl(reference_logits(q, k, queue), TAU).mean()
    torch.testing.assert_close(grad(loss, q), grad(dcl, q), rtol=1e-5, atol=1e-8)


def test_anchor_weight_keeps_its_precision_in_float32_when_p_plus_is_near_one():
    """q_i = k_i and every negative opposite: p_+ = 1 / (1 + K e^(-2/tau)), and 1 - p_+ ~ 2e-8
    rounds to 0 in float32, so W must be computed in log space; the loss stays finite, W exact."""
    q = torch.tensor([[0.6, 0.8], [0.6, 0.8]])  # (2, 2) unit vectors
    queue = -q[:1].repeat(10, 1)  # (10, 2): every negative at similarity -1
    loss, (w_alpha, w_beta) = mss.dual_temperature_loss(q, q, TAU, 1.0, queue)

    def exact(tau):  # W = 1 - p_+ = K e^(-2/tau) / (1 + K e^(-2/tau)), K = 10
        return torch.full((2,), 10 * math.exp(-2 / tau) / (1 + 10 * math.exp(-2 / tau)))
    torch.testing.assert_close(w_alpha, exact(TAU), rtol=1e-5, atol=0)
    assert w_alpha.dtype == torch.float32 and torch.isfinite(loss)
    torch.testing.assert_close(w_beta, exact(1.0), rtol=1e-5, atol=1e-8)


def test_r_plus_entropy_is_the_entropy_of_the_relative_anchor_weights():
    """H(r_+) = -sum_i r_i log r_i with r_i = W_i(tau_beta) / sum_j W_j(tau_beta) (DT Fig. 3), and
    the share of the N anchors that carry the pull, exp(H) / N, from the means of W and W log W.

    W(tau_beta) = (0.1, 0.1, 0.2): r = (1/4, 1/4, 1/2), H = 2 (1/4) log 4 + (1/2) log 2 = 1.5 log 2.
    W(tau_alpha) is equal for all three anchors (H would be log 3): the entropy uses tau_beta's."""
    w_alpha = torch.tensor([0.3, 0.3, 0.3], dtype=torch.float64)
    w_beta = torch.tensor([0.1, 0.1, 0.2], dtype=torch.float64)
    mean_alpha, mean_beta, entropy, w_log_w = mss.anchor_weight_stats(w_alpha, w_beta)
    expected = torch.tensor([1.5 * math.log(2), 0.3, 0.4 / 3], dtype=torch.float64)
    torch.testing.assert_close(torch.stack([entropy, mean_alpha, mean_beta]), expected,
                               rtol=1e-5, atol=1e-15)
    # the share of anchors that carry the pull: exp(H) / N = 2 ** 1.5 / 3
    record = mss.epoch_share(dict(w_beta=mean_beta.item(), w_log_w=w_log_w.item()))
    assert record == {"w_beta": pytest.approx(0.4 / 3), "r_plus_share": pytest.approx(2 ** 1.5 / 3)}
    flat = torch.full((7,), 0.6, dtype=torch.float64)  # equal weights: the maximum, log 7
    _, mean_beta, entropy, w_log_w = mss.anchor_weight_stats(flat, flat)
    assert entropy.item() == pytest.approx(math.log(7), rel=1e-5, abs=1e-8)
    record = mss.epoch_share(dict(w_beta=mean_beta.item(), w_log_w=w_log_w.item()))
    assert record["r_plus_share"] == pytest.approx(1, rel=1e-12)


def test_the_logged_r_plus_share_is_over_every_anchor_of_the_epoch(tmp_path, monkeypatch):
    """An epoch's r_plus_share is exp(H) / n with r_+ over all n anchors its steps trained, as
    computed here from each step's W(tau_beta), and r_plus_entropy the mean of each step's H: one
    key an anchor (batch 2) at tau_beta 0.05, where the share is not the mean of each step's."""
    weights, real = [], mss.anchor_weight_stats

    def recorded(w_alpha, w_beta):
        weights.append(w_beta.double())
        return real(w_alpha, w_beta)

    monkeypatch.setattr(mss, "anchor_weight_stats", recorded)
    run_main(mss, [*tiny("moco_simmoco_simco", "--batch-size", 2, "--tau-beta", 0.05,
                         "--limit-train", 32, "--no-online-probe", "--out", tmp_path / "run")])
    _, lines, _ = check_run_folder(tmp_path / "run")
    assert len(weights) == 2 * 16 and {len(w) for w in weights} == {4}  # 2 epochs of 16 steps
    for epoch, line in enumerate(lines):
        steps = weights[16 * epoch:16 * (epoch + 1)]
        w = torch.cat(steps)  # every anchor of the epoch
        share = torch.special.entr(w / w.sum()).sum().exp().item() / len(w)
        assert line["r_plus_share"] == pytest.approx(share, rel=1e-5)
        each_step = [torch.special.entr(s / s.sum()).sum().item() for s in steps]  # H, nats
        assert line["r_plus_entropy"] == pytest.approx(sum(each_step) / 16, rel=1e-5)
        each_share = [math.exp(h) / 4 for h in each_step]
        assert abs(sum(each_share) / 16 - share) > 1e-3
        assert "w_log_w" not in line


# ---- queue and momentum encoder

def test_queue_is_fifo_and_wraps_around_without_dropping_keys():
    """K = 10, 4 keys per step: step 3 writes rows 8, 9, 0, 1; rows 2, 3 still hold step 1's."""
    queue = mss.KeyQueue(10, 3)
    steps = [torch.randn(4, 3) for _ in range(3)]
    for keys in steps:
        queue.push(keys)
    expected = torch.cat([steps[2][2:], steps[0][2:], steps[1], steps[2][:2]])  # rows 0 ... 9
    torch.testing.assert_close(queue.rows, expected, rtol=0, atol=0)
    assert queue.ptr.item() == 2


def test_queue_size_is_checked_against_the_keys_one_step_pushes(capsys):
    """Each queue must hold one step's keys (the global batch; with --symmetric each of the two
    queues gets one view's keys, so the bound is the same); divisibility is not needed."""
    base = ["--method", "mocov2", "--batch-size", "256"]
    for extra in ([], ["--symmetric"]):
        with pytest.raises(SystemExit) as error:
            mss.parse_args(base + extra + ["--queue-size", "200"])
        message = "--queue-size 200 is smaller than the 256 keys"
        assert error.value.code == 2 and message in capsys.readouterr().err
        # 300 % 256 != 0: wraps around
        assert mss.parse_args(base + extra + ["--queue-size", "300"]).queue_size == 300
    assert mss.parse_args(["--method", "simmoco", "--queue-size", "1"]).tau_beta == 1.0  # no check
    assert mss.parse_args(base).tau_beta == 0.1  # MoCo v2: plain InfoNCE unless --tau-beta


def tiny_setup(method, symmetric, ctx, queue_size=20, seed=0):
    """A tiny encoder (float64), its momentum encoder and queues, built as main() builds them."""
    torch.manual_seed(seed)
    model = mss.Encoder("resnet18", 4, 8, proj_hidden=16, proj_dim=8)
    key_encoder = mss.momentum_encoder(model, ctx) if method != "simco" else None
    queues = None
    if method == "mocov2":
        queues = torch.nn.ModuleList(mss.KeyQueue(queue_size, 8, seed + i)
                                     for i in range(1 + symmetric))
    net = common.distribute(model, ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    args = argparse.Namespace(method=method, symmetric=symmetric, tau_alpha=0.1, tau_beta=0.5,
                              key_momentum=0.9)
    return model, net, key_encoder, queues, optimizer, args


def step_views(step, global_batch=8, rank=0, world=1):
    g = torch.Generator().manual_seed(100 + step)
    views = [torch.randn(global_batch, 3, 8, 8, generator=g) for _ in range(2)]
    per_rank = global_batch // world
    return [v[rank * per_rank:(rank + 1) * per_rank] for v in views]


@pytest.mark.parametrize("method", ["mocov2", "simmoco", "simco"])
def test_both_views_pass_the_online_encoder_and_feed_the_online_probe_in_every_method(method):
    """The DT authors' code passes every view through the online encoder and trains the online
    classifier on each (official solo/methods/base.py lines 475 and 482): one step of b images
    gives the probe 2 b rows of backbone features and the online BatchNorm two batches, without
    --symmetric too (the loss still takes q1 alone there); the momentum probe gets the key
    encoder's 2 b rows where there is one."""
    ctx = ctx_for()
    model, net, key_encoder, queues, optimizer, args = tiny_setup(method, False, ctx)
    views = step_views(0)
    _, _, features = mss.train_step(net, optimizer, views, args, ctx, key_encoder, queues)
    assert [f.shape for f in features] == [(16, model.backbone.out_dim)] * (
        1 if method == "simco" else 2)
    assert model.backbone.bn1.num_batches_tracked.item() == 2
    assert not any(f.requires_grad for f in features)


def probe_step_by_hand(classifier, features, labels, lr):
    """One SGD step with momentum 0.9 from a fresh buffer (= a plain gradient step) on the mean
    cross-entropy over the labelled rows: dL/dlogits = (softmax - onehot) / n -> (weight, bias)."""
    w, b = classifier.weight.detach(), classifier.bias.detach()
    keep = labels >= 0
    x, y = features[keep], labels[keep]
    dlogits = (torch.softmax(x @ w.T + b, 1) - F.one_hot(y, len(b))) / len(y)  # (n, C)
    return w - lr * dlogits.T @ x, b - lr * dlogits.sum(0)


def tiny_probes(momentum=False):
    ctx = ctx_for()
    encoder = mss.Encoder("resnet18", 4, 8, 16, 8)
    data = SimpleNamespace(num_classes=3)
    args = SimpleNamespace(workers=0, seed=0)
    return mss.OnlineProbes(data, ctx, args, encoder, encoder if momentum else None)


def test_online_probe_step_is_an_sgd_step_at_its_lr_times_the_given_scale(float64):
    """Two views' backbone features, labels repeated per view, one unlabelled image: each
    classifier moves by 0.3 * lr_scale times the gradient of the mean cross-entropy over the
    labelled views (a first momentum step is a plain gradient step), the momentum probe's on
    its own features."""
    torch.manual_seed(0)
    probes = tiny_probes(momentum=True)
    labels = torch.tensor([0, 2, -1, 1])
    features = [torch.randn(8, 32), torch.randn(8, 32)]
    expected = [probe_step_by_hand(c, f, labels.repeat(2), 0.3 * 0.25)
                for c, f in zip(probes.classifiers.values(), features)]
    probes.step(features, labels, 0.25)
    for classifier, (weight, bias) in zip(probes.classifiers.values(), expected):
        torch.testing.assert_close(classifier.weight, weight, rtol=0, atol=1e-12)
        torch.testing.assert_close(classifier.bias, bias, rtol=0, atol=1e-12)


def test_online_probe_accuracy_is_its_classifier_on_the_raw_features():
    """The online probe trains on raw (un-normalised) features and is tested on them: logits
    (x_0, 1.5) call feature rows (3, 0) and (2, 1) class 0, (1, 0) and (1, 1) class 1: 100 %;
    their unit rows (x_0 <= 1) would all be called class 1, 50 %."""
    test_f = torch.tensor([[3.0, 0.0], [2.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    test_y = torch.tensor([0, 0, 1, 1])
    probes = tiny_probes()
    classifier = torch.nn.Linear(2, 2)
    with torch.no_grad():
        classifier.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 0.0]]))
        classifier.bias.copy_(torch.tensor([0.0, 1.5]))
    probes.classifiers["online_top1"] = classifier
    assert probes.top1(test_f, test_y) == {"online_top1": 100.0}


def test_momentum_encoder_is_ema_of_the_query_encoder_and_queue_gets_its_keys_without_gradient():
    """After a step: theta_k = m theta_k_old + (1 - m) theta_q (parameter by parameter); the queue's
    new rows are the normalised keys k = f_k(x2) of the step; the queue and key encoder get no
    gradient."""
    ctx = ctx_for()
    with float64():
        model, net, key_encoder, queues, optimizer, args = tiny_setup("mocov2", False, ctx)
        views = step_views(0)
        for p in model.parameters():  # make query and key encoder differ
            p.data.add_(0.1 * torch.randn_like(p))
        old = [p.clone() for p in key_encoder.parameters()]
        with torch.no_grad():
            expected_keys = F.normalize(mss.momentum_encoder(key_encoder, ctx)(views[1])[0], dim=1)
        mss.train_step(net, optimizer, views, args, ctx, key_encoder, queues)
    for p_k, p_old, p_q in zip(key_encoder.parameters(), old, model.parameters()):
        torch.testing.assert_close(p_k, 0.9 * p_old + 0.1 * p_q, rtol=0, atol=1e-14)
        assert not p_k.requires_grad and p_k.grad is None
    (queue,) = queues
    torch.testing.assert_close(queue.rows[:8], expected_keys, rtol=1e-5, atol=1e-13)
    assert queue.ptr.item() == 8 and not queue.rows.requires_grad and queue.rows.grad is None


def test_simco_loss_is_symmetric_with_gradient_through_both_views_each_its_own_forward_pass():
    """SimCo: (L(z1, z2) + L(z2, z1)) / 2 with z1, z2 from one encoder; no momentum encoder, no
    queue. z1 and z2 come from separate forward passes (BatchNorm statistics per view, as
    solo-learn's per-crop forward); one pass over both views would normalise over 2b images."""
    ctx = ctx_for()
    with float64():
        model, net, _, _, optimizer, args = tiny_setup("simco", False, ctx)
        views = step_views(0)
        for group in optimizer.param_groups:
            group.update(lr=0.0, weight_decay=0.0)
        z1, z2 = model(views[0])[0], model(views[1])[0]
        expected = (mss.dual_temperature_loss(z1, z2, 0.1, 0.5)[0]
                    + mss.dual_temperature_loss(z2, z1, 0.1, 0.5)[0]) / 2
        g_expected = torch.autograd.grad(expected, list(model.parameters()))
        loss, _, _ = mss.train_step(net, optimizer, views, args, ctx)
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-14)
    for p, g in zip(model.parameters(), g_expected):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-12)


@pytest.mark.parametrize("method", ["mocov2", "simmoco"])
def test_symmetric_pairs_q1_with_k2_and_q2_with_k1_mocov2_with_two_queues(method):
    """MoCo v2+ / SimMoCo+: (L(q1, k2) + L(q2, k1)) / 2, each view its own forward pass.

    MoCo v2+ keeps two queues, as official mocov2plus: q1's negatives are past k2's (queue 0), q2's
    past k1's (queue 1); after the step k2 is pushed onto queue 0 and k1 onto queue 1."""
    ctx = ctx_for()
    with float64():
        model, net, key_encoder, queues, optimizer, args = tiny_setup(method, True, ctx)
        views = step_views(0)
        with torch.no_grad():
            frozen = mss.momentum_encoder(key_encoder, ctx)  # a copy: BatchNorm stats stay apart
            k1, k2 = (F.normalize(frozen(v)[0], dim=1) for v in views)
            q1, q2 = model(views[0])[0], model(views[1])[0]
        past_k2, past_k1 = (None, None) if queues is None else (q.rows.clone() for q in queues)

        def loss_with(queue_1, queue_2):
            return (mss.dual_temperature_loss(q1, k2, 0.1, 0.5, queue_1)[0]
                    + mss.dual_temperature_loss(q2, k1, 0.1, 0.5, queue_2)[0]) / 2
        loss, _, _ = mss.train_step(net, optimizer, views, args, ctx, key_encoder, queues)
    torch.testing.assert_close(loss, loss_with(past_k2, past_k1), rtol=1e-5, atol=1e-13)
    if method == "mocov2":
        assert not torch.allclose(loss, loss_with(past_k1, past_k2), atol=1e-6)  # not swapped
        torch.testing.assert_close(queues[0].rows[:8], k2, rtol=1e-5, atol=1e-13)
        torch.testing.assert_close(queues[1].rows[:8], k1, rtol=1e-5, atol=1e-13)
        torch.testing.assert_close(queues[0].rows[8:], past_k2[8:], rtol=0, atol=0)
        assert queues[0].ptr.item() == 8


# ---- 2 processes == 1 process

METHODS = [("mocov2", False), ("mocov2", True), ("simmoco", False), ("simmoco", True),
           ("simco", False)]


def losses_on(rank=0, world=1):
    """Each loss variant on this rank's rows of one batch of 8 and a queue of 11: value, grad on
    q, grad on k (None without grad)."""
    q, k, queue = embeddings(b=8, d=5, k=11, seed=3)
    q, k = q.detach(), k.detach()
    b = len(q) // world
    out = []
    variants = (("mocov2", False, queue), ("simmoco", False, None), ("simco", True, None))
    for name, keys_need_grad, negatives in variants:
        q_mine = q[rank * b:(rank + 1) * b].clone().requires_grad_()
        k_mine = k[rank * b:(rank + 1) * b].clone().requires_grad_(keys_need_grad)
        loss, _ = mss.dual_temperature_loss(q_mine, k_mine, TAU, 1.0, negatives)
        loss.backward()
        out.append((name, loss.detach(), q_mine.grad, k_mine.grad))
    return out


def run_steps(method, symmetric, rank=0, world=1, steps=3):
    """Three real train_steps; returns losses, diagnostics and every state that must match."""
    ctx = ctx_for(rank, world)
    model, net, key_encoder, queues, optimizer, args = tiny_setup(method, symmetric, ctx)
    losses, stats = [], []
    for step in range(steps):
        views = step_views(step, 8, rank, world)
        loss, stat, _ = mss.train_step(net, optimizer, views, args, ctx, key_encoder, queues)
        losses.append(loss)
        stats.append(torch.stack(stat))
    return {"losses": torch.stack(losses), "stats": torch.stack(stats), "model": model.state_dict(),
            "key_encoder": key_encoder.state_dict() if key_encoder else {},
            "queues": queues.state_dict() if queues else {}}


def smoke_variants():
    return [["--method", "mocov2", "--symmetric", "--queue-size", "40"], ["--method", "simmoco"],
            ["--method", "simco"]]


def _worker_two_processes(base):
    """Runs in each of 2 gloo processes: the losses, three train steps and main() per method."""
    rank, world = dist.get_rank(), dist.get_world_size()
    with float64():
        losses = losses_on(rank, world)
        steps = {(m, s): run_steps(m, s, rank, world) for m, s in METHODS}
    for i, extra in enumerate(smoke_variants()):
        mss.main(smoke_args(os.path.join(base, "data"), os.path.join(base, f"dist{i}"), *extra))
    return {"losses": losses, "steps": steps}


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory, tiny_folder):
    base = tmp_path_factory.mktemp("mss_dist")
    os.symlink(tiny_folder, base / "data")
    return run_distributed("test_moco_simmoco_simco", "_worker_two_processes", base, base), base


def test_two_processes_equal_one_process_loss_and_gradients(two_processes):
    """mean over ranks of the rank losses == 1-process loss; rank grad / 2 == its rows of the
    1-process grad, for the queue (MoCo v2), momentum-key (SimMoCo) and same-encoder-key (SimCo)
    negatives."""
    results, _ = two_processes
    with float64():
        reference = losses_on()
    for (name, *one), ranks in zip(reference, zip(*(r["losses"] for r in results))):
        two = [sum(r[1] for r in ranks) / 2, torch.cat([r[2] for r in ranks]) / 2]
        if one[2] is not None:  # SimCo: the negatives from the other rank carry gradient back
            two.append(torch.cat([r[3] for r in ranks]) / 2)
        for part, mine, expected in zip(("loss", "dL/dq", "dL/dk"), two, one):
            torch.testing.assert_close(mine, expected, rtol=1e-5, atol=1e-14,
                                       msg=lambda m: f"{name} {part}: {m}")


@pytest.mark.parametrize("method,symmetric", METHODS)
def test_two_processes_equal_one_process_after_three_steps(two_processes, method, symmetric):
    """Parameters, momentum encoder, queues (all ranks' keys, in one process's order; MoCo v2+ has
    two) and the diagnostics after 3 train_steps of a 2-process run equal one process on the whole
    batch."""
    results, _ = two_processes
    with float64():
        reference = run_steps(method, symmetric)
    ranks = [r["steps"][method, symmetric] for r in results]
    mean_loss = (ranks[0]["losses"] + ranks[1]["losses"]) / 2
    torch.testing.assert_close(mean_loss, reference["losses"], rtol=1e-5, atol=1e-12)
    for r in ranks:
        torch.testing.assert_close(r["stats"], reference["stats"], rtol=1e-5, atol=1e-12)
        for part in ("model", "key_encoder", "queues"):
            assert r[part].keys() == reference[part].keys()
            for name, value in reference[part].items():
                torch.testing.assert_close(r[part][name].double(), value.double(), rtol=1e-5,
                                           atol=1e-10, msg=lambda m: f"{part} {name}: {m}")


def check_mss_run_folder(out, method, world=1):
    config, lines, results = check_run_folder(out)
    args = config["args"]
    assert args["method"] == method and config["world_size"] == world
    assert "knn_top1" in lines[-1] and "linear_top1" in results
    anchors = args["batch_size"] * (2 if method == "simco" or args["symmetric"] else 1)
    for line in lines:  # W = 1 - p_+ in (0, 1); H(r_+) at most log(anchors of one step)
        assert 0 < line["w_alpha"] < 1 and 0 < line["w_beta"] < 1
        assert line["anchors"] == anchors  # the anchors H(r_+) is over, a step
        assert 0 < line["r_plus_entropy"] <= math.log(anchors) + 1e-6
        assert 0 < line["r_plus_share"] <= 1 + 1e-6
    checkpoint = torch.load(os.path.join(out, "checkpoint.pt"), weights_only=True)
    assert ("queues" in checkpoint) == (method == "mocov2")
    if method == "mocov2":  # MoCo v2+ checkpoints both queues
        assert {name.split(".")[0] for name in checkpoint["queues"]} == (
            {"0", "1"} if args["symmetric"] else {"0"})
    assert ("key_encoder" in checkpoint) == (method != "simco")


def test_main_under_two_processes_writes_run_folders(two_processes):
    """main() of every method (MoCo v2+ with wrapping queues, SimMoCo, SimCo) under 2 processes."""
    _, base = two_processes
    for i, extra in enumerate(smoke_variants()):
        check_mss_run_folder(base / f"dist{i}", extra[1], world=2)


# ---- continued and smoke runs

def test_simmoco_symmetric_main_writes_run_folder(tiny_folder, tmp_path):
    """SimMoCo+ (the variant no other run covers) in one process."""
    mss.main(smoke_args(tiny_folder, tmp_path / "run", "--method", "simmoco", "--symmetric"))
    check_mss_run_folder(tmp_path / "run", "simmoco")


def test_cifar100_is_normalised_with_cifar10_statistics_as_the_authors_code(
        tiny_folder, tmp_path, monkeypatch):
    """The DT fork normalises CIFAR-100 with CIFAR-10's mean and std: main() hands those to the
    augmentation and the evaluation (the tiny folder stands in for CIFAR-100)."""
    load, augment, seen = common.load_data, common.Augment, []

    def as_cifar100(args, ctx, crops=2):
        data = load(argparse.Namespace(**{**vars(args), "dataset": "imagefolder"}), ctx, crops)
        data.mean, data.std = common.STATS["cifar100"]
        return data
    monkeypatch.setattr(common, "load_data", as_cifar100)
    monkeypatch.setattr(common, "Augment", lambda *a: seen.append(a[2:4]) or augment(*a))
    mss.main(smoke_args(tiny_folder, tmp_path / "run", "--dataset", "cifar100", "--epochs", "0"))
    assert seen == [common.STATS["cifar10"]]


def test_mocov2_plus_resumes_exactly_with_two_queues_that_wrap(tiny_folder, tmp_path):
    """MoCo v2+'s two queues of 40 keys (they wrap within a batch of 16), its key encoder and
    tau_beta 0.5: stopped in epoch 2 and resumed, every tensor and loss as uninterrupted."""
    from test_runs import resume_is_exact

    resume_is_exact("moco_simmoco_simco", ["--method", "mocov2", "--symmetric", "--queue-size",
                                           "40", "--tau-beta", "0.5"], tiny_folder, tmp_path)
