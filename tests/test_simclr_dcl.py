"""The DCL paper's identities, distributed equivalence and smoke runs of simclr_dcl.py.

Identities run in float64 on unit vectors; autograd's gradients pass through the loss's own
normalisation, so closed forms are compared after the same projection (I - z z^T).
"""
import json
import math

import pytest
import torch
import torch.nn.functional as F

import common
import simclr_dcl
from helpers import (check_run_folder, ctx_for, float64, identity, run_distributed, run_ok,
                     smoke_args)
from simclr_dcl import contrastive_loss, dclw_weights, npc_multiplier

TAU = 0.1
# The options train_step reads.
STEP_ARGS = type("Args", (), {"temperature": TAU, "loss": "dclw", "sigma": 0.5})


def unit_pairs(b=6, d=16, seed=0, noise=1.0):
    """Two correlated views: z2 = normalise(z1 + noise)."""
    g = torch.Generator().manual_seed(seed)
    z1 = F.normalize(torch.randn(b, d, generator=g, dtype=torch.float64), dim=1)
    z2 = F.normalize(z1 + noise * torch.randn(b, d, generator=g, dtype=torch.float64), dim=1)
    return z1, z2


def anchor_gradient(z1, z2, anchor, loss, temperature=TAU, sigma=0.5):
    """Autograd gradient of one anchor's loss with respect to z1 and z2."""
    z1, z2 = z1.clone().requires_grad_(), z2.clone().requires_grad_()
    contrastive_loss(z1, z2, temperature, loss, sigma, reduction="none")[anchor].backward()
    return z1.grad, z2.grad


def project(z, g):
    """Gradient of a unit-norm input as autograd sees it: g minus its radial part."""
    return g - (g * z).sum(-1, keepdim=True) * z


def naive_losses(z1, z2, temperature, loss, sigma=0.5):
    """The DCL paper's three losses, one anchor at a time with explicit index sets -> (2B,):
    SimCLR's InfoNCE, the decoupled L_DC of Proposition 2 (the positive left out of the
    denominator) and L_DCW with the weight w = 2 - exp(<z1, z2>/sigma) / E[exp(<z1, z2>/sigma)]."""
    z1, z2 = F.normalize(z1, dim=1), F.normalize(z2, dim=1)
    b = len(z1)
    views = torch.cat([z1, z2])
    out = []
    vmf = torch.exp((z1 * z2).sum(1) / sigma)
    w = 2 - vmf / vmf.mean()
    for a in range(2 * b):
        i = a % b
        pos = (z1[i] @ z2[i]) / temperature
        negatives = [j for j in range(2 * b) if j % b != i]
        negative_logits = torch.stack([views[a] @ views[j] / temperature for j in negatives])
        log_u = torch.logsumexp(negative_logits, 0)
        if loss == "infonce":
            out.append(-pos + torch.logaddexp(pos, log_u))
        elif loss == "dcl":
            out.append(-pos + log_u)
        else:
            out.append(-w[i].detach() * pos + log_u)
    return torch.stack(out)


# ---- identities

@pytest.mark.parametrize("loss", ["infonce", "dcl", "dclw"])
def test_loss_equals_a_per_anchor_loop_over_the_formula(loss):
    """The masked loss equals the anchor-by-anchor formula, each anchor's value and the gradient."""
    z1, z2 = unit_pairs(b=5, d=8, seed=1)
    a1, a2 = z1.clone().requires_grad_(), z2.clone().requires_grad_()
    n1, n2 = z1.clone().requires_grad_(), z2.clone().requires_grad_()
    masked = contrastive_loss(a1, a2, TAU, loss, reduction="none")
    naive = naive_losses(n1, n2, TAU, loss)
    torch.testing.assert_close(masked, naive, rtol=1e-5, atol=1e-12)
    torch.testing.assert_close(contrastive_loss(a1, a2, TAU, loss), naive.mean(), rtol=1e-5,
                               atol=1e-12)
    masked.mean().backward()
    naive.mean().backward()
    torch.testing.assert_close(a1.grad, n1.grad, rtol=1e-5, atol=1e-12)
    torch.testing.assert_close(a2.grad, n2.grad, rtol=1e-5, atol=1e-12)


def test_prop1_infonce_gradient_has_npc_multiplier():
    """DCL Prop. 1, anchor z_i^(1) with q = npc_multiplier, p_j = exp(<z_i^(1), z_j^(l)>/tau) / U:
    dL/dz_i^(1) = -(q/tau)(z_i^(2) - sum p_j z_j^(l)),  dL/dz_i^(2) = -(q/tau) z_i^(1),
    dL/dz_j^(l) = (q/tau) p_j z_i^(1) for every negative."""
    z1, z2 = unit_pairs()
    b = len(z1)
    q = npc_multiplier(z1, z2, TAU)
    autograd, closed = [], []
    for i in range(b):
        g1, g2 = anchor_gradient(z1, z2, i, "infonce")
        neg_views = torch.cat([z1, z2])
        neg = torch.tensor([j % b != i for j in range(2 * b)])
        p = torch.softmax(neg_views[neg] @ z1[i] / TAU, 0)  # p_j over the 2N-2 negatives
        expect1 = torch.zeros_like(z1)
        expect2 = torch.zeros_like(z2)
        expect1[i] = -(q[i] / TAU) * (z2[i] - p @ neg_views[neg])
        expect2[i] = -(q[i] / TAU) * z1[i]
        negative_grads = (q[i] / TAU) * p[:, None] * z1[i]  # one row per negative
        full = torch.cat([expect1, expect2])
        full[neg] = negative_grads
        expect1, expect2 = full[:b], full[b:]
        autograd.append(torch.cat([g1, g2]))
        closed.append(torch.cat([project(z1, expect1), project(z2, expect2)]))
    identity("DCL Prop. 1, dL/dz of every view, anchors z_i^(1)", "autograd",
             torch.stack(autograd), "the closed form with q_B", torch.stack(closed))
    # the multiplier itself: q = 1 - pos / (pos + U)
    pos = torch.exp((z1 * z2).sum(1) / TAU)
    views = torch.cat([z1, z2])
    u = torch.stack([torch.exp(views[[j for j in range(2 * b) if j % b != i]] @ z1[i] / TAU).sum()
                     for i in range(b)])
    identity("DCL Eq. 8", "npc_multiplier", q[:b], "1 - pos / (pos + U)", 1 - pos / (pos + u))


def test_prop2_dcl_gradient_is_infonce_gradient_without_q():
    """DCL Prop. 2: grad InfoNCE_i^(k) = q_{B,i}^(k) * grad L_DC,i^(k), for every embedding and
    every anchor."""
    z1, z2 = unit_pairs(seed=2)
    q = npc_multiplier(z1, z2, TAU)
    infonce, dcl = [], []
    for anchor in range(2 * len(z1)):
        infonce.append(torch.cat(anchor_gradient(z1, z2, anchor, "infonce")))
        dcl.append(torch.cat(anchor_gradient(z1, z2, anchor, "dcl")))
        assert dcl[-1].abs().max() > 1e-3  # the identity is not 0 = 0
    identity("DCL Prop. 2, every anchor", "grad InfoNCE", torch.stack(infonce),
             "q_B * grad DCL", q[:, None, None] * torch.stack(dcl))


def test_infonce_equals_dcl_minus_log_q_so_dcl_is_smaller_and_can_be_negative():
    """Value: InfoNCE_i^(k) = L_DC,i^(k) - log q_{B,i}^(k); hence DCL <= InfoNCE, and DCL < 0 when
    the positive is much closer than the negatives."""
    z1, z2 = unit_pairs(seed=3)
    infonce = contrastive_loss(z1, z2, TAU, "infonce", reduction="none")
    dcl = contrastive_loss(z1, z2, TAU, "dcl", reduction="none")
    torch.testing.assert_close(infonce, dcl - torch.log(npc_multiplier(z1, z2, TAU)), rtol=1e-5,
                               atol=1e-12)
    assert (dcl <= infonce).all()
    easy1, easy2 = unit_pairs(b=4, d=64, seed=4, noise=0.05)  # near-identical views
    assert contrastive_loss(easy1, easy2, TAU, "dcl") < 0
    assert contrastive_loss(easy1, easy2, TAU, "infonce") > 0


@pytest.mark.parametrize("sigma", [0.1, 0.5, 2.0])
def test_dclw_weights_have_mean_one(sigma):
    """E[w] = 1 for any sigma, and hard (far-apart) positive pairs get the larger weight."""
    z1, z2 = unit_pairs(b=32, seed=5)
    w = dclw_weights((z1 * z2).sum(1), sigma)
    assert abs(w.mean().item() - 1) < 1e-12
    cos = (z1 * z2).sum(1)
    assert w[cos.argmin()] == w.max() and w[cos.argmax()] == w.min()


def test_dclw_weight_is_a_constant_so_every_positive_pair_is_pulled_closer():
    """DCLW's positive term is -sum_i w_i s_i / tau with w = sg(w(s)). With w a constant, its
    gradient on each pair's cosine s_i is -w_i / tau < 0: every pair is pulled closer. With w's
    own gradient (the weight differentiated), the easiest pair's (s = 0.9) flips sign: its term
    would push its two views apart. On s = (0.1, 0.5, 0.9), sigma 0.5: -1.83 -> +5.68."""
    s = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64, requires_grad=True)
    w = dclw_weights(s, 0.5)
    assert not w.requires_grad
    (-(w * s).sum() / TAU).backward()
    assert (s.grad < 0).all()
    assert s.grad[2].item() == pytest.approx(-1.83, abs=0.01)
    t = s.detach().clone().requires_grad_()
    vmf = torch.exp(t / 0.5)
    w_with_grad = 2 - vmf / vmf.mean()  # the same weight, differentiated
    torch.testing.assert_close(w_with_grad.detach(), w)
    (-(w_with_grad * t).sum() / TAU).backward()
    assert t.grad[2].item() == pytest.approx(5.68, abs=0.01)


def test_dclw_tends_to_dcl_as_sigma_grows():
    """w -> 1 and L_DCW -> L_DC, value and gradient, as sigma -> inf."""
    z1, z2 = unit_pairs(seed=6)
    w = dclw_weights((z1 * z2).sum(1), 1e9)
    torch.testing.assert_close(w, torch.ones(len(z1), dtype=torch.float64), rtol=1e-5, atol=1e-8)
    for anchor in range(2 * len(z1)):
        w1, w2 = anchor_gradient(z1, z2, anchor, "dclw", sigma=1e9)
        d1, d2 = anchor_gradient(z1, z2, anchor, "dcl")
        torch.testing.assert_close(w1, d1, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(w2, d2, rtol=1e-5, atol=1e-7)
    dcl = contrastive_loss(z1, z2, TAU, "dcl")
    assert abs(contrastive_loss(z1, z2, TAU, "dclw", 1e9) - dcl) < 1e-7
    assert abs(contrastive_loss(z1, z2, TAU, "dclw", 0.5) - dcl) > 1e-4


def test_fig1a_mean_npc_multiplier_grows_with_batch_size():
    """<q_B> rises toward 1 as the batch grows (DCL Fig. 1a): more negatives, larger U."""
    means = []
    for b in (8, 32, 128, 512):
        z1, z2 = unit_pairs(b=b, d=32, seed=7, noise=0.7)
        means.append(npc_multiplier(z1, z2, TAU).mean().item())
    print("DCL Fig. 1a: <q_B> at B = 8, 32, 128, 512:", ", ".join(f"{m:.3f}" for m in means))
    assert means == sorted(means) and means[-1] > 0.9 and means[0] < means[-1] - 0.1


@pytest.mark.parametrize("loss", ["infonce", "dcl", "dclw"])
def test_swapping_the_views_leaves_the_loss_unchanged(loss):
    z1, z2 = unit_pairs(seed=8)
    swapped = contrastive_loss(z2, z1, TAU, loss)
    torch.testing.assert_close(contrastive_loss(z1, z2, TAU, loss), swapped, rtol=1e-5, atol=1e-12)


def test_train_step_returns_the_loss_and_q_b_of_the_model_before_the_step():
    """train_step's loss is contrastive_loss of the model's z1, z2 from ONE forward pass of both
    views (SimCLR's joint BatchNorm batch), and its q is npc_multiplier of the same z1, z2; the
    step then moves the model."""
    with float64():
        torch.manual_seed(0)
        model = simclr_dcl.SimCLR("resnet18", 4, 8, proj_hidden=16, proj_dim=8)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        g = torch.Generator().manual_seed(4)
        views = [torch.randn(6, 3, 8, 8, generator=g) for _ in range(2)]
        z1, z2 = model(torch.cat(views)).chunk(2)
        expect_loss = contrastive_loss(z1, z2, TAU, "dclw")
        expect_q = npc_multiplier(z1, z2, TAU)
        before = model.projector[0].weight.detach().clone()
        loss, q = simclr_dcl.train_step(model, optimizer, views, STEP_ARGS, ctx_for())
    torch.testing.assert_close(loss, expect_loss, rtol=1e-5, atol=1e-12)
    torch.testing.assert_close(q, expect_q, rtol=1e-5, atol=1e-12)
    assert q.shape == (12,) and (model.projector[0].weight - before).abs().max() > 1e-4


# ---- 2 processes == 1 process

def _global_batch(seed=11, n=8, d=12):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, d, generator=g, dtype=torch.float64),
            torch.randn(n, d, generator=g, dtype=torch.float64))


def _loss_and_grads(z1, z2):
    out = {}
    for loss in ("infonce", "dcl", "dclw"):
        a, b = z1.clone().requires_grad_(), z2.clone().requires_grad_()
        value = contrastive_loss(a, b, TAU, loss)
        value.backward()
        out[loss] = (value.detach(), a.grad, b.grad)
    return out


def _worker_loss():
    torch.set_default_dtype(torch.float64)
    z1, z2 = _global_batch()
    rows = slice(common.rank() * 4, common.rank() * 4 + 4)
    return _loss_and_grads(z1[rows], z2[rows])


def test_two_processes_give_the_loss_and_gradients_of_one(tmp_path):
    """Per-rank losses average to the 1-process loss; each rank's gradient / world equals the
    1-process gradient of its rows (the gather's backward returns the other ranks' share)."""
    ranks = run_distributed("test_simclr_dcl", "_worker_loss", tmp_path)
    z1, z2 = _global_batch()
    single = _loss_and_grads(z1, z2)
    for loss, (value, g1, g2) in single.items():
        assert abs((ranks[0][loss][0] + ranks[1][loss][0]) / 2 - value) < 1e-12
        torch.testing.assert_close(torch.cat([r[loss][1] for r in ranks]) / 2, g1, rtol=1e-5,
                                   atol=1e-12)
        torch.testing.assert_close(torch.cat([r[loss][2] for r in ranks]) / 2, g2, rtol=1e-5,
                                   atol=1e-12)


def _train_three_steps(ctx, rows):
    """The real train_step on a width-4 model, 3 steps, float64; returns the parameters."""
    torch.manual_seed(0)
    model = simclr_dcl.SimCLR("resnet18", 4, 8, proj_hidden=16, proj_dim=8)
    net = common.distribute(model, ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        views = [torch.randn(8, 3, 8, 8, generator=g, dtype=torch.float64)[rows] for _ in range(2)]
        simclr_dcl.train_step(net, optimizer, views, STEP_ARGS, ctx)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _worker_steps():
    torch.set_default_dtype(torch.float64)
    rows = slice(common.rank() * 4, common.rank() * 4 + 4)
    return _train_three_steps(ctx_for(common.rank(), 2), rows)


def test_two_processes_train_like_one_process(tmp_path):
    """3 DDP steps on 2 ranks (global BatchNorm, gathered negatives, global DCLW weights) leave the
    model exactly where 3 steps of one process on the whole batch do."""
    ranks = run_distributed("test_simclr_dcl", "_worker_steps", tmp_path)
    with float64():
        single = _train_three_steps(ctx_for(), slice(0, 8))
    torch.manual_seed(0)
    initial = simclr_dcl.SimCLR("resnet18", 4, 8, proj_hidden=16, proj_dim=8).state_dict()
    moved = 0.0
    for key, value in single.items():
        for rank in ranks:
            torch.testing.assert_close(rank[key], value, rtol=1e-5, atol=1e-10,
                                       msg=lambda m: f"{key}: {m}")
        moved = max(moved, (value.double() - initial[key]).abs().max().item())
    assert moved > 1e-3  # the steps really changed the model


# ---- smoke runs

def test_smoke_python_and_torchrun_agree(tiny_folder, tmp_path):
    """The acceptance run, as `python` and as `torchrun --nproc_per_node=2`: both write the run
    folder (rank 0 alone: one metrics line per epoch) and compute the same run, two epochs of one
    step each.

    Epoch 1 logs the first step's loss and <q_B> before any update, so the launchers differ only
    by float32 rounding in other summation orders: 1.9e-6 and 6e-8 measured (4 float32 ulps of a
    loss of 4.56). The bounds 1e-4 and 1e-5 leave 50x; real disagreements move the loss far more:
    DCLW's mean over one rank's pairs 0.019, a wrong world-size scaling 1.7, the positives looked
    up in rank 0's columns 1.7. After an update float32 runs drift (a ReLU pre-activation of 6e-7
    that changes sign switches its derivative: epoch 2's losses lie 4.3e-4 apart); exact equality
    of steps is the float64 tests' job. So the backbones are compared with how far the steps moved
    them: 8% of the move apart measured, the bound one half; steps on world x the loss lie 1.7
    moves apart, steps with the negatives gathered without their gradient 0.66."""
    args = lambda out: smoke_args(tiny_folder, out, "--epochs", "2", "--loss", "dclw",
                                  "--limit-train", "16")
    one = run_ok("simclr_dcl.py", args(tmp_path / "one"))
    two = run_ok("simclr_dcl.py", args(tmp_path / "two"), nproc=2)
    assert "final: command simclr_dcl.py " in one.stdout and " linear_top1 " in one.stdout
    assert [line.split("  ")[-1:] for line in two.stdout.splitlines()
            if line.startswith("run ")] == [["processes 2"]]  # the start-up line, rank 0 alone
    _, lines1, results = check_run_folder(tmp_path / "one", 2)
    _, lines2, _ = check_run_folder(tmp_path / "two", 2)
    assert "linear_top1" in results
    assert {"npc_mean", "npc_cv", "knn_top1", "images_per_s", "lr"} <= lines1[-1].keys()
    assert 0 < lines1[0]["npc_mean"] < 1
    assert abs(lines1[0]["loss"] - lines2[0]["loss"]) < 1e-4
    assert abs(lines1[0]["npc_mean"] - lines2[0]["npc_mean"]) < 1e-5
    assert [a["lr"] for a in lines1] == [b["lr"] for b in lines2]
    config = json.load(open(tmp_path / "two" / "config.json"))
    assert config["world_size"] == 2 and config["args"]["loss"] == "dclw"
    assert "torch" in config["versions"]
    run = config["args"]
    torch.manual_seed(run["seed"])  # main()'s initial model
    initial = simclr_dcl.SimCLR(run["arch"], run["width"], run["image_size"], run["proj_hidden"],
                                run["proj_dim"], run["stem_padding"]).backbone.state_dict()
    w1 = torch.load(tmp_path / "one" / "backbone.pt")
    w2 = torch.load(tmp_path / "two" / "backbone.pt")
    assert w1.keys() == w2.keys() == initial.keys()
    for key in w1:
        moved = (w1[key].double() - initial[key].double()).abs().max()
        apart = (w1[key].double() - w2[key].double()).abs().max()
        assert apart <= moved / 2, key


@pytest.mark.parametrize("loss", ["infonce", "dcl"])
def test_each_loss_trains_in_process(tiny_folder, tmp_path, loss):
    """Each loss runs through main() and logs a finite loss and a q_B in (0, 1); with InfoNCE
    (L_i = -log(1 - q_i)), by Jensen, <q_B> <= 1 - exp(-<L>)."""
    simclr_dcl.main(smoke_args(tiny_folder, tmp_path, "--loss", loss))
    _, (line,), _ = check_run_folder(tmp_path, 1)
    assert math.isfinite(line["loss"]) and 0 < line["npc_mean"] < 1
    if loss == "infonce":
        assert line["npc_mean"] <= 1 - math.exp(-line["loss"]) + 1e-6
