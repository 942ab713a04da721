"""NNCLR + DCL: the loss with nearest-neighbour positives, the support set,
distributed equivalence, an exact continuation and smoke runs of nnclr_dcl.py.

Identities run in float64. The anchors NN(z) are constants; gradients are taken with respect to
the predictions p, the only path by which the loss trains the network.
"""
import math

import pytest
import torch
import torch.nn.functional as F

import common
import nnclr_dcl
from helpers import (check_run_folder, ctx_for, identity, run_distributed, run_ok,
                     smoke_args)
from nnclr_dcl import SupportSet, dclw_weights, nearest_neighbour, nnclr_loss

TAU = 0.1
SMALL_HEADS = ("--proj-hidden", "32", "--pred-hidden", "32", "--proj-dim", "16")


def views_and_predictions(b=6, d=8, seed=0, noise=0.8):
    """Projections z1, z2 of two views and predictions p1, p2 near them, (B, D) each."""
    g = torch.Generator().manual_seed(seed)
    z1 = torch.randn(b, d, generator=g, dtype=torch.float64)
    z2 = z1 + noise * torch.randn(b, d, generator=g, dtype=torch.float64)
    p1 = z1 + noise * torch.randn(b, d, generator=g, dtype=torch.float64)
    p2 = z2 + noise * torch.randn(b, d, generator=g, dtype=torch.float64)
    return z1, z2, p1, p2


def random_support_set(q=20, d=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(q, d, generator=g, dtype=torch.float64), dim=1)


def brute_force_nn(z, support_set):
    """NN(z) = argmax_{s in Q} cos(z, s), one row at a time."""
    def nearest(zi):
        return max(range(len(support_set)),
                   key=lambda k: F.cosine_similarity(zi, support_set[k], dim=0).item())
    return support_set[[nearest(zi) for zi in z]]


def naive_losses(a1, a2, p1, p2, temperature, loss, sigma=0.5):
    """NNCLR + DCL anchor by anchor with explicit index sets -> (2B,): anchor a1_i picks
    p_i^(2) among all p_j^(2); anchor a2_i picks p_i^(1) among all p_j^(1)."""
    out = []
    for anchors, partners in ((a1, F.normalize(p2, dim=1)), (a2, F.normalize(p1, dim=1))):
        b = len(anchors)
        cos = torch.stack([anchors[i] @ partners[i] for i in range(b)])
        vmf = torch.exp(cos.detach() / sigma)
        w = 2 - vmf / vmf.mean()
        for i in range(b):
            pos = cos[i] / temperature
            negatives = [anchors[i] @ partners[j] / temperature for j in range(b) if j != i]
            log_u = torch.logsumexp(torch.stack(negatives), 0)
            out.append({"infonce": -pos + torch.logaddexp(pos, log_u), "dcl": -pos + log_u,
                        "dclw": -w[i] * pos + log_u}[loss])
    return torch.stack(out)


def npc_multiplier(a1, a2, p1, p2, temperature=TAU):
    """q_i = 1 - exp(pos) / (exp(pos) + U_i) per anchor (DCL Eq. 8, NN positives) -> (2B,)."""
    with torch.no_grad():
        dcl = naive_losses(a1, a2, p1, p2, temperature, "dcl")
        infonce = naive_losses(a1, a2, p1, p2, temperature, "infonce")
        # InfoNCE - DCL = log(exp(pos) + U) - log U = -log q
        return torch.exp(dcl - infonce)


def loss_and_gradients(loss_of, p1, p2):
    """loss_of(p1, p2), and the gradient of its sum with respect to p1 and p2."""
    p1, p2 = p1.clone().requires_grad_(), p2.clone().requires_grad_()
    loss = loss_of(p1, p2)
    loss.sum().backward()
    return loss.detach(), p1.grad, p2.grad


def prediction_gradients(z1, z2, p1, p2, support_set, anchor, loss, sigma=0.5):
    """Autograd gradient of one anchor's loss with respect to p1 and p2."""
    p1, p2 = p1.clone().requires_grad_(), p2.clone().requires_grad_()
    nnclr_loss(z1, z2, p1, p2, support_set, TAU, loss, sigma, reduction="none")[anchor].backward()
    return p1.grad, p2.grad


# ---- identities

def test_nearest_neighbour_is_the_most_cosine_similar_support_row():
    """NN(z) = argmax_{s in Q} <z, s> over unit rows: a row of Q itself, whatever the norm of z."""
    z1, _, _, _ = views_and_predictions(b=7)
    support_set = random_support_set()
    nn = nearest_neighbour(z1, support_set)
    torch.testing.assert_close(nn, brute_force_nn(z1, support_set), rtol=0, atol=0)
    torch.testing.assert_close(nearest_neighbour(5.0 * z1, support_set), nn, rtol=0, atol=0)


@pytest.mark.parametrize("loss", ["infonce", "dcl", "dclw"])
def test_support_set_holding_the_batch_gives_the_plain_loss(loss):
    """Q = {z of the batch} => NN(z) = z, and the loss is the plain loss between
    z^(1) and p^(2) (and z^(2), p^(1)), value and gradient."""
    z1, z2, p1, p2 = views_and_predictions(seed=2)
    z1, z2 = F.normalize(z1, dim=1), F.normalize(z2, dim=1)
    support_set = torch.cat([z1, z2])
    torch.testing.assert_close(nearest_neighbour(torch.cat([z1, z2]), support_set), support_set,
                               rtol=0, atol=0)
    fast = loss_and_gradients(
        lambda a1, a2: nnclr_loss(z1, z2, a1, a2, support_set, TAU, loss), p1, p2)
    plain = loss_and_gradients(
        lambda a1, a2: naive_losses(z1, z2, a1, a2, TAU, loss).mean(), p1, p2)
    for mine, expected in zip(fast, plain):  # value, dL/dp1, dL/dp2
        torch.testing.assert_close(mine, expected, rtol=1e-5, atol=1e-12)
    if loss == "infonce":  # and InfoNCE is the cross-entropy of picking p_i^(2) among the batch
        labels = torch.arange(6)
        expect = (F.cross_entropy(z1 @ F.normalize(p2, dim=1).T / TAU, labels) +
                  F.cross_entropy(z2 @ F.normalize(p1, dim=1).T / TAU, labels)) / 2
        torch.testing.assert_close(fast[0], expect, rtol=1e-5, atol=1e-12)


@pytest.mark.parametrize("loss", ["infonce", "dcl", "dclw"])
def test_loss_equals_a_per_anchor_loop_with_nn_positives(loss):
    """With a support set of other vectors, the masked loss is the anchor-by-anchor formula with
    the brute-force neighbours as anchors: each anchor's value, the mean and the gradient."""
    z1, z2, p1, p2 = views_and_predictions(seed=3)
    support_set = random_support_set(seed=4)
    nn1, nn2 = brute_force_nn(z1, support_set), brute_force_nn(z2, support_set)
    assert not torch.equal(nn1, F.normalize(z1, dim=1))
    masked = loss_and_gradients(
        lambda a1, a2: nnclr_loss(z1, z2, a1, a2, support_set, TAU, loss, reduction="none"),
        p1, p2)
    naive = loss_and_gradients(lambda a1, a2: naive_losses(nn1, nn2, a1, a2, TAU, loss), p1, p2)
    for mine, expected in zip(masked, naive):  # each anchor's value, dL/dp1, dL/dp2
        torch.testing.assert_close(mine, expected, rtol=1e-5, atol=1e-12)
    mean = nnclr_loss(z1, z2, p1, p2, support_set, TAU, loss)
    torch.testing.assert_close(mean, naive[0].mean(), rtol=1e-5, atol=1e-12)


def test_prop2_dcl_gradient_is_infonce_gradient_without_q_with_nn_positives():
    """DCL Prop. 2 with NN positives: grad InfoNCE_i = q_i * grad L_DC,i for every prediction and
    every anchor."""
    z1, z2, p1, p2 = views_and_predictions(seed=5)
    support_set = random_support_set(seed=6)
    nn1, nn2 = nearest_neighbour(z1, support_set), nearest_neighbour(z2, support_set)
    q = npc_multiplier(nn1, nn2, p1, p2)
    infonce, dcl = [], []
    for anchor in range(2 * len(z1)):
        n1, n2 = prediction_gradients(z1, z2, p1, p2, support_set, anchor, "infonce")
        d1, d2 = prediction_gradients(z1, z2, p1, p2, support_set, anchor, "dcl")
        # p2's gradient first, as the first anchors' losses do not reach p1.
        infonce.append(torch.cat([n2, n1]))
        dcl.append(torch.cat([d2, d1]))
        assert max(d1.abs().max(), d2.abs().max()) > 1e-3  # the identity is not 0 = 0
    identity("DCL Prop. 2 with NN positives, every anchor's dL/d(p2, p1)", "grad InfoNCE",
             torch.stack(infonce), "q * grad DCL", q[:, None, None] * torch.stack(dcl))


def test_infonce_equals_dcl_minus_log_q_with_nn_positives():
    """Value: InfoNCE_i = L_DC,i - log q_i, with q_i = 1 - exp(pos)/(exp(pos) + U_i) computed from
    its definition; hence DCL <= InfoNCE anchor by anchor."""
    z1, z2, p1, p2 = views_and_predictions(seed=7)
    support_set = random_support_set(seed=8)
    nn1, nn2 = nearest_neighbour(z1, support_set), nearest_neighbour(z2, support_set)
    p2n = F.normalize(p2, dim=1)
    pos = torch.exp(nn1 @ p2n.T / TAU)  # (B, B): column j is exp(<NN(z_i^(1)), p_j^(2)>/tau)
    q1 = 1 - pos.diagonal() / pos.sum(1)  # the first direction's anchors, straight from Eq. 8
    infonce = nnclr_loss(z1, z2, p1, p2, support_set, TAU, "infonce", reduction="none")
    dcl = nnclr_loss(z1, z2, p1, p2, support_set, TAU, "dcl", reduction="none")
    torch.testing.assert_close(infonce[:6], dcl[:6] - torch.log(q1), rtol=1e-5, atol=1e-12)
    torch.testing.assert_close(infonce, dcl - torch.log(npc_multiplier(nn1, nn2, p1, p2)),
                               rtol=1e-5, atol=1e-12)
    assert (dcl < infonce).all()


@pytest.mark.parametrize("sigma", [0.1, 0.5, 2.0])
def test_dclw_weights_have_mean_one(sigma):
    """E[w] = 1 per direction for any sigma; the hardest positive pair gets the largest weight."""
    g = torch.Generator().manual_seed(9)
    similarity = 2 * torch.rand(2, 32, generator=g, dtype=torch.float64) - 1  # (direction, B)
    w = torch.stack([dclw_weights(s, sigma) for s in similarity])  # one call per direction
    torch.testing.assert_close(w.mean(1), torch.ones(2, dtype=torch.float64), rtol=1e-5, atol=1e-12)
    torch.testing.assert_close(w.argmax(1), similarity.argmin(1), rtol=0, atol=0)
    torch.testing.assert_close(w.argmin(1), similarity.argmax(1), rtol=0, atol=0)


def test_dclw_tends_to_dcl_as_sigma_grows():
    """w -> 1 and L_DCW -> L_DC, value and gradient, as sigma -> inf; not so at sigma = 0.5."""
    z1, z2, p1, p2 = views_and_predictions(seed=10)
    support_set = random_support_set(seed=11)
    for anchor in range(2 * len(z1)):
        w1, w2 = prediction_gradients(z1, z2, p1, p2, support_set, anchor, "dclw", sigma=1e9)
        d1, d2 = prediction_gradients(z1, z2, p1, p2, support_set, anchor, "dcl")
        torch.testing.assert_close(w1, d1, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(w2, d2, rtol=1e-5, atol=1e-7)
    dcl = nnclr_loss(z1, z2, p1, p2, support_set, TAU, "dcl")
    assert abs(nnclr_loss(z1, z2, p1, p2, support_set, TAU, "dclw", 1e9) - dcl) < 1e-7
    assert abs(nnclr_loss(z1, z2, p1, p2, support_set, TAU, "dclw", 0.5) - dcl) > 1e-4


def test_no_gradient_into_the_support_set_or_through_the_lookup():
    """NN(z) is a constant: the support set and the projections z get no gradient from the loss;
    the predictions do."""
    z1, z2, p1, p2 = (t.clone().requires_grad_() for t in views_and_predictions(seed=14))
    support_set = random_support_set(seed=15).requires_grad_()
    nnclr_loss(z1, z2, p1, p2, support_set, TAU, "dclw").backward()
    assert z1.grad is None and z2.grad is None and support_set.grad is None
    assert p1.grad.abs().max() > 1e-3 and p2.grad.abs().max() > 1e-3


# ---- support set

def test_support_set_is_a_fifo_that_wraps_around_without_dropping_rows():
    """Rows enter in order; past the end they wrap to the front, over the oldest rows, and every
    row of a batch is kept, without autograd history."""
    support = SupportSet(5, 2)
    assert (support.labels == -1).all()
    torch.testing.assert_close(support.rows.norm(dim=1), torch.ones(5), rtol=1e-5, atol=1e-8)
    batch = lambda start, n: (torch.arange(start, start + n).float()[:, None].repeat(1, 2),
                              torch.arange(start, start + n))
    support.push(*batch(0, 3))
    assert support.ptr == 3 and support.labels.tolist() == [0, 1, 2, -1, -1]
    z, labels = batch(3, 4)
    support.push(z.requires_grad_(), labels)  # rows 3, 4, then 0, 1: the oldest (0, 1) go
    assert support.ptr == 2 and support.labels.tolist() == [5, 6, 2, 3, 4]
    assert support.rows[:, 0].tolist() == [5, 6, 2, 3, 4] and not support.rows.requires_grad
    support.push(*batch(7, 5))  # exactly a full turn
    assert support.ptr == 2 and support.labels.tolist() == [10, 11, 7, 8, 9]
    with pytest.raises(ValueError):
        support.push(*batch(0, 6))


def test_support_set_state_dict_round_trip():
    """Rows, labels and the write position go through state_dict; a support set of another size
    is refused."""
    a, b = SupportSet(6, 3, seed=1), SupportSet(6, 3, seed=2)
    assert not torch.equal(a.rows, b.rows)
    a.push(torch.ones(4, 3), torch.arange(4))
    b.load_state_dict(a.state_dict())
    torch.testing.assert_close(a.rows, b.rows, rtol=0, atol=0)
    torch.testing.assert_close(a.labels, b.labels, rtol=0, atol=0)
    assert a.ptr == b.ptr == 4
    with pytest.raises(RuntimeError, match="size mismatch"):  # one error line on resume
        SupportSet(7, 3).load_state_dict(a.state_dict())


def tiny_model():
    torch.manual_seed(0)
    return nnclr_dcl.NNCLR("resnet18", 4, 8, proj_hidden=16, proj_dim=8, pred_hidden=16)


def step_args(loss="dclw"):
    return type("Args", (), {"temperature": TAU, "loss": loss, "sigma": 0.5})


def test_train_step_minimises_nnclr_loss_then_enqueues_z1_and_counts_same_class_neighbours(
        float64):
    """train_step's loss is nnclr_loss of the model's z, p (one forward pass per view) against the
    support set before the step; afterwards the support set holds the batch's unit z^(1) at its
    pointer; the diagnostic counts labelled anchors whose neighbour has their label."""
    model = tiny_model()
    ctx = ctx_for()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(16)
    views = [torch.randn(6, 3, 8, 8, generator=g) for _ in range(2)]
    labels = torch.tensor([0, 1, 2, 0, -1, 1])
    support = SupportSet(10, 8, seed=3)
    support.labels[:] = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2, 0])
    before = support.rows.clone()
    (z1, p1), (z2, p2) = model(views[0]), model(views[1])  # one BatchNorm batch per view
    expect = nnclr_loss(z1, z2, p1, p2, before, TAU, "dclw")
    z = F.normalize(torch.cat([z1, z2]).detach(), dim=1)
    nn_rows = (z @ before.T).argmax(1)
    anchor_labels = labels.repeat(2)
    expect_same = sum(int(a >= 0 and support.labels[r] == a)
                      for a, r in zip(anchor_labels.tolist(), nn_rows.tolist()))
    loss, same_class, labelled = nnclr_dcl.train_step(model, optimizer, views, step_args(), ctx,
                                                      labels, support)
    torch.testing.assert_close(loss, expect, rtol=1e-5, atol=1e-12)
    assert same_class.item() == expect_same and labelled.item() == 10
    assert support.ptr == 6
    torch.testing.assert_close(support.rows[:6], z[:6], rtol=1e-5, atol=1e-12)
    torch.testing.assert_close(support.rows[6:], before[6:], rtol=0, atol=0)
    assert support.labels[:6].tolist() == labels.tolist()


# ---- 2 processes == 1 process

def _global_batch(seed=17, n=8, d=8):
    z1, z2, p1, p2 = views_and_predictions(b=n, d=d, seed=seed)
    return z1, z2, p1, p2, random_support_set(q=12, d=d, seed=seed)


def _loss_and_grads(z1, z2, p1, p2, support_set):
    out = {}
    for loss in ("infonce", "dcl", "dclw"):
        out[loss] = loss_and_gradients(
            lambda a1, a2: nnclr_loss(z1, z2, a1, a2, support_set, TAU, loss), p1, p2)
    nn1 = nearest_neighbour(z1, support_set)
    out["weights"] = dclw_weights((nn1 * F.normalize(p2, dim=1)).sum(1), 0.5)
    return out


def _train_three_steps(ctx, rows):
    """3 real train_steps (DCLW), float64, a support set of 12 rows and a global batch of 8 (so it
    wraps) -> parameters, support set, losses and diagnostic counts."""
    model = tiny_model()
    net = common.distribute(model, ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9, weight_decay=5e-4)
    support = SupportSet(12, 8, seed=5)
    g = torch.Generator().manual_seed(18)
    history = []
    for _ in range(3):
        views = [torch.randn(8, 3, 8, 8, generator=g)[rows] for _ in range(2)]
        labels = torch.randint(-1, 3, (8,), generator=g)[rows]
        out = nnclr_dcl.train_step(net, optimizer, views, step_args(), ctx, labels, support)
        history.append(torch.stack([t.double() for t in out]))  # [loss, same class, labelled]
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return params, support.state_dict(), torch.stack(history)  # history: (3 steps, 3)


def _worker():
    torch.set_default_dtype(torch.float64)
    rank = common.rank()
    rows = slice(rank * 4, rank * 4 + 4)
    z1, z2, p1, p2, support_set = _global_batch()
    losses = _loss_and_grads(z1[rows], z2[rows], p1[rows], p2[rows], support_set)
    support = SupportSet(12, 8)
    support.push(common.gather(z1[rows]), common.gather(torch.arange(8)[rows]))
    support.push(common.gather(z2[rows]), common.gather(torch.arange(8, 16)[rows]))
    ctx = ctx_for(rank, 2)
    return {"losses": losses, "push": support.state_dict(), "train": _train_three_steps(ctx, rows)}


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """One torchrun launch for all 2-process checks."""
    return run_distributed("test_nnclr_dcl", "_worker", tmp_path_factory.mktemp("dist"))


def test_two_processes_give_the_loss_and_gradients_of_one(two_processes):
    """Per-rank losses average to the 1-process loss; each rank's gradient / world equals the
    1-process gradient of its rows (the predictions are gathered with gradient); the DCLW weights
    are normalised over the global batch."""
    z1, z2, p1, p2, support_set = _global_batch()
    single = _loss_and_grads(z1, z2, p1, p2, support_set)
    ranks = [r["losses"] for r in two_processes]
    for loss in ("infonce", "dcl", "dclw"):
        value, g1, g2 = single[loss]
        assert abs((ranks[0][loss][0] + ranks[1][loss][0]) / 2 - value) < 1e-12
        for i, expected in ((1, g1), (2, g2)):  # dL/dp1, dL/dp2
            torch.testing.assert_close(torch.cat([r[loss][i] for r in ranks]) / 2, expected,
                                       rtol=1e-5, atol=1e-12)
    torch.testing.assert_close(torch.cat([r["weights"] for r in ranks]), single["weights"],
                               rtol=1e-5, atol=1e-12)


def test_support_set_takes_every_ranks_rows(two_processes):
    """After two pushes of a global batch of 8 into 12 rows, both ranks hold one process's support
    set: rank 0's rows then rank 1's, the second batch wrapped."""
    z1, z2, *_ = _global_batch()
    single = SupportSet(12, 8).double()
    single.push(z1, torch.arange(8))
    single.push(z2, torch.arange(8, 16))
    assert single.labels.tolist() == [12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11] and single.ptr == 4
    for rank in two_processes:
        for name, value in single.state_dict().items():  # rows, labels, write position
            torch.testing.assert_close(rank["push"][name], value, rtol=0, atol=0)


def test_two_processes_train_like_one_process(two_processes, float64):
    """3 DDP steps on 2 ranks (global BatchNorm, gathered predictions, global support set and DCLW
    weights) leave the model and the support set where 3 steps of one process leave them."""
    ctx = ctx_for()
    params, support, history = _train_three_steps(ctx, slice(0, 8))
    for rank_params, rank_support, _ in (r["train"] for r in two_processes):
        for key, value in params.items():
            torch.testing.assert_close(rank_params[key], value, rtol=1e-5, atol=1e-10,
                                       msg=lambda m: f"{key}: {m}")
        torch.testing.assert_close(rank_support["rows"], support["rows"], rtol=1e-5, atol=1e-10)
        torch.testing.assert_close(rank_support["labels"], support["labels"], rtol=0, atol=0)
        assert rank_support["ptr"] == support["ptr"] == 0
    ranks = torch.stack([r["train"][2] for r in two_processes])  # (2, 3, 3)
    # losses average, diagnostic counts add up
    torch.testing.assert_close(ranks[:, :, 0].mean(0), history[:, 0], rtol=1e-5, atol=1e-10)
    torch.testing.assert_close(ranks[:, :, 1:].sum(0), history[:, 1:], rtol=0, atol=0)
    initial = dict(tiny_model().named_parameters())  # not BatchNorm's statistics: they move too
    moved = max((params[k] - initial[k]).abs().max() for k in initial)
    assert moved > 1e-3  # the steps moved the model
    assert history[1:, 1].sum() > 0  # and some neighbours match


# ---- runs

def tiny_run(folder, out, *extra):
    return smoke_args(folder, out, *SMALL_HEADS, "--support-size", "40", *extra)


def test_a_support_set_smaller_than_the_batch_is_a_user_error(tiny_folder, tmp_path):
    with pytest.raises(common.UserError, match="support-size"):
        nnclr_dcl.main(smoke_args(tiny_folder, tmp_path / "a", "--support-size", "8"))


def test_infonce_run_in_process(tiny_folder, tmp_path):
    """The plain NNCLR loss through main() (dcl: the resume test, dclw: the smoke test)."""
    nnclr_dcl.main(tiny_run(tiny_folder, tmp_path, "--loss", "infonce"))
    _, lines, results = check_run_folder(tmp_path, 1)
    assert {"nn_same_class", "knn_top1", "images_per_s", "lr"} <= lines[0].keys()
    assert math.isfinite(lines[0]["loss"]) and "linear_top1" in results


def test_smoke_python_and_torchrun_agree(tiny_folder, tmp_path):
    """The acceptance run with --loss dclw, as `python` and as `torchrun --nproc_per_node=2`: both
    write the run folder with the neighbour diagnostic, and take the same steps. (One epoch of 2
    steps: in float32 rounding grows through the support set, a neighbour flips, and by the third
    step the losses differ by 1%; exact equality is the float64 test above.)"""
    args = lambda out: tiny_run(tiny_folder, out, "--loss", "dclw", "--limit-train", "32")
    one = run_ok("nnclr_dcl.py", args(tmp_path / "one"))
    run_ok("nnclr_dcl.py", args(tmp_path / "two"), nproc=2)
    assert "final: command nnclr_dcl.py " in one.stdout and " linear_top1 " in one.stdout
    _, (line1,), _ = check_run_folder(tmp_path / "one", 1)
    config, (line2,), _ = check_run_folder(tmp_path / "two", 1)
    assert abs(line1["loss"] - line2["loss"]) < 1e-4
    assert line1["nn_same_class"] == line2["nn_same_class"]
    assert config["world_size"] == 2 and config["args"]["loss"] == "dclw"
    assert config["args"]["support_size"] == 40
    s1 = torch.load(tmp_path / "one" / "checkpoint.pt")["support_set"]
    s2 = torch.load(tmp_path / "two" / "checkpoint.pt")["support_set"]
    assert s1["ptr"] == s2["ptr"] == 32 and torch.equal(s1["labels"], s2["labels"])
    assert torch.allclose(s1["rows"], s2["rows"], atol=1e-3)


def test_a_resumed_run_keeps_its_support_set_exactly(tiny_folder, tmp_path):
    """A support set of 40 rows (it wraps within the epoch): stopped in epoch 2 and continued, the
    run ends as uninterrupted, the support set's rows, labels and pointer among its tensors."""
    from test_runs import resume_is_exact

    resume_is_exact("nnclr_dcl", ["--support-size", "40", *SMALL_HEADS], tiny_folder, tmp_path)
