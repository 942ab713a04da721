"""Method training steps on small hand-built cases, each against a hand-computed reference:
BYOL's targets (symmetric and GSG) and the projection-std diagnostic, MoCo v2+'s two queues."""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import moco_simmoco_simco as mss
import simsiam_byol_gsg as gsg
from helpers import OpNames, ctx_for, smoke_args

CPU = ctx_for()


def D(p, z):
    """-cos(p_i, z_i) per row -> (B,)."""
    return -F.cosine_similarity(p, z, dim=1)


def symmetric_by_hand(p, z):
    """Eq. 1: mean of D(p1, z2) / 2 + D(p2, z1) / 2."""
    return (D(p[0], z[1]) / 2 + D(p[1], z[0]) / 2).mean()


def guided_by_hand(p, z, partner):
    """Eq. 6 image by image: x1 = image i (crops 0, 1), x2 = image r(i) (its crops 2, 3); the two
    cross-image views whose targets lie closest get the predictor."""
    terms = []
    for i, j in enumerate(partner.tolist()):
        z11, z12, z21, z22 = z[0][i], z[1][i], z[2][j], z[3][j]
        d = [(z11 - z21).norm(), (z11 - z22).norm(), (z12 - z21).norm(), (z12 - z22).norm()]
        c = min(range(4), key=lambda n: d[n])
        first = D(p[0][i:i + 1], z12[None]) if c < 2 else D(p[1][i:i + 1], z11[None])
        second = D(p[2][j:j + 1], z22[None]) if c % 2 == 0 else D(p[3][j:j + 1], z21[None])
        terms.append(first / 2 + second / 2)
    return torch.cat(terms).mean()


def std_by_hand(z):
    """The unbiased std over the rows of z / |z| per dimension, then the mean over dimensions
    (SimSiam Sec. 4.1), as a plain loop."""
    rows = [[x / math.sqrt(sum(v * v for v in row)) for x in row] for row in z.tolist()]
    n, stds = len(rows), []
    for column in zip(*rows):
        mean = sum(column) / n
        stds.append(math.sqrt(sum((x - mean) ** 2 for x in column) / (n - 1)))
    return sum(stds) / len(stds)


@pytest.mark.parametrize("stopgrad", ["symmetric", "guided"])
def test_byol_targets_are_the_momentum_encoders_projections_of_the_same_views(float64, stopgrad):
    """BYOL and BYOL + GSG: the step's loss is Eq. 1 / Eq. 6 with the online predictions p and the
    TARGET network's projections of the same crops (the target made to differ from the online
    encoder first), not the online projections; the projection std is the online z of crop 0's,
    the plain loop's unbiased std (6 rows: n / (n - 1) shows) of z / |z| over the batch."""
    torch.manual_seed(0)
    model = gsg.SiameseNet("resnet18", 4, 8, proj_hidden=16, proj_dim=8, pred_hidden=4)
    target = gsg.momentum_encoder(model.encoder, CPU)
    with torch.no_grad():
        for t in target.parameters():
            t.add_(0.5 * torch.randn_like(t))
    views = [torch.randn(6, 3, 8, 8) for _ in range(2 if stopgrad == "symmetric" else 4)]
    partner = torch.tensor([3, 0, 5, 1, 2, 4])
    with torch.no_grad():  # train mode, one pass per crop, as the step
        z, p = model(*views)
        t = [target(x) for x in views]

    def by_hand(targets):
        return symmetric_by_hand(p, targets) if stopgrad == "symmetric" else \
            guided_by_hand(p, targets, partner)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss, _, proj_std = gsg.train_step(model, optimizer, views, SimpleNamespace(stopgrad=stopgrad),
                                       CPU, pairing=(partner, None), target=target,
                                       online=model.encoder, tau=0.99)
    torch.testing.assert_close(loss, by_hand(t), rtol=0, atol=1e-12)
    assert (loss - by_hand(z)).abs() > 1e-3  # the online projections give another loss
    assert proj_std.item() == pytest.approx(std_by_hand(z[0]), abs=1e-12)
    assert abs(std_by_hand(z[0]) - std_by_hand(t[0])) > 1e-3


def test_moco_v2_plus_queues_start_from_different_random_keys(tiny_folder, tmp_path):
    """MoCo v2+ keeps a queue per key view, started as different random unit rows: after one
    epoch (4 steps of 16 keys) rows 64.. of each, never pushed, are unit rows, unequal."""
    out = tmp_path / "run"
    mss.main(smoke_args(tiny_folder, out, "--method", "mocov2", "--symmetric", "--queue-size",
                        "100", "--proj-dim", "8", "--proj-hidden", "16", "--linear-epochs", "0",
                        "--no-online-probe"))
    queues = torch.load(out / "checkpoint.pt", weights_only=True)["queues"]
    assert queues["0.ptr"].item() == queues["1.ptr"].item() == 64
    first, second = queues["0.rows"][64:], queues["1.rows"][64:]  # (36, 8) each, never pushed
    torch.testing.assert_close(first.norm(dim=1), torch.ones(36))
    torch.testing.assert_close(second.norm(dim=1), torch.ones(36))
    assert (first - second).norm(dim=1).min() > 0.1


@pytest.mark.parametrize("method_file", [mss, gsg])
def test_the_ema_is_one_foreach_lerp_equal_to_the_loop_to_the_bit(method_file):
    """ema_update moves every parameter of the target in one aten._foreach_lerp_ (a GPU launches
    a kernel per op), to the bit what t.lerp_(o, 1 - m) one by one gives."""
    torch.manual_seed(0)
    online = mss.Encoder("resnet18", 4, 8, 16, 8)
    target = method_file.momentum_encoder(online, CPU)
    for p in online.parameters():
        p.data.add_(torch.randn_like(p))
    expected = [t.detach().clone() for t in target.parameters()]
    for t, o in zip(expected, online.parameters()):
        t.lerp_(o.detach(), 1 - 0.99)
    with OpNames() as ops:
        method_file.ema_update(target, online, 0.99)
    assert ops.names == {"aten._foreach_lerp_": 1}, ops.names
    for t, e in zip(target.parameters(), expected):
        assert torch.equal(t, e)
