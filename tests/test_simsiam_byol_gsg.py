"""simsiam_byol_gsg.py: the GSG paper's identities, BYOL's EMA, 2 processes == 1 process, and runs
of every method x stop-gradient mode."""
import argparse
import json

import pytest
import torch
import torch.nn.functional as F

import common
import simsiam_byol_gsg as gsg
from helpers import (check_run_folder, ctx_for, identity, run_distributed, run_ok,
                     smoke_args)

MODES = ["guided", "random", "reverse"]
TINY_HEADS = ["--proj-hidden", "32", "--proj-dim", "32", "--pred-hidden", "8"]


def D(p, z):
    """D(p, z) = -<p/|p|, z/|z|> per row."""
    return -(F.normalize(p, dim=1) * F.normalize(z, dim=1)).sum(1)


def eight(b=6, d=5, seed=0, grad=False):
    """p11, p12, p21, p22, z11, z12, z21, z22: random (b, d) float64 tensors."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, d, generator=g, dtype=torch.float64).requires_grad_(grad)
            for _ in range(8)]


def case_formula(c, p11, p12, p21, p22, z11, z12, z21, z22):
    """GSG Eq. 6, case c, per pair (B,)."""
    first = D(p11, z12) if c < 2 else D(p12, z11)
    second = D(p21, z22) if c % 2 == 0 else D(p22, z21)
    return 0.5 * first + 0.5 * second


# ---- GSG identities

def test_eq1_symmetric_loss_is_half_sum_of_two_terms_with_targets_stopped():
    """L = 1/2 D(p1, sg z2) + 1/2 D(p2, sg z1); the target z gets no gradient through the loss."""
    p1, p2, z1, z2 = eight(grad=True)[:4]
    loss = gsg.symmetric_loss(p1, p2, z1, z2)
    identity("GSG Eq. 1", "symmetric_loss", loss, "1/2 D(p1, z2) + 1/2 D(p2, z1)",
             (0.5 * D(p1, z2) + 0.5 * D(p2, z1)).mean(), rtol=0)
    loss.backward()
    print(f"GSG Eq. 1, sg(z): z1.grad {z1.grad}, z2.grad {z2.grad}")
    assert z1.grad is None and z2.grad is None
    assert p1.grad.abs().sum() > 0 and p2.grad.abs().sum() > 0


def test_eq6_each_case_is_chosen_by_the_closest_cross_image_views_and_equals_its_formula():
    """m = min{d(z11,z21), d(z11,z22), d(z12,z21), d(z12,z22)} picks the case; the loss is that
    case's Eq. 6 line."""
    p11, p12, p21, p22, z11, z12, z21, z22 = eight(b=4, d=3, seed=1)
    e = torch.eye(3, dtype=torch.float64)
    for c in range(4):  # pair c: views 1+c//2 of x1 and 1+c%2 of x2 nearly coincide, others far
        near1, near2 = (z11, z12)[c // 2], (z21, z22)[c % 2]
        far1, far2 = (z12, z11)[c // 2], (z22, z21)[c % 2]
        near1[c], near2[c] = e[0], e[0] + 0.01
        far1[c], far2[c] = 5 * e[1], -5 * e[2]
    args = (p11, p12, p21, p22, z11, z12, z21, z22)
    _, case = gsg.guided_stopgrad_loss(*args, mode="guided")
    assert case.dtype == torch.int64 and case.tolist() == [0, 1, 2, 3]
    print(f"GSG Eq. 5: the closest cross-image views pick cases {case.tolist()}")
    losses = [gsg.guided_stopgrad_loss(*[t[c:c + 1] for t in args])[0] for c in range(4)]
    formulas = [case_formula(c, *args)[c] for c in range(4)]
    identity("GSG Eq. 6, pairs 0-3", "the loss", torch.stack(losses), "their case's line",
             torch.stack(formulas), rtol=0)
    identity("GSG Eq. 6, the batch", "the loss", gsg.guided_stopgrad_loss(*args)[0],
             "the mean of the lines", torch.stack(formulas).mean(), rtol=0)


def test_eq7_reverse_stopgrad_takes_the_two_terms_guided_leaves_out():
    """reverse case = 3 - guided case, and
    guided + reverse = 1/2 (D(p11,z12) + D(p12,z11) + D(p21,z22) + D(p22,z21))."""
    args = eight(b=50, seed=2)
    cases, sums = [], []
    for i in range(50):
        row = [t[i:i + 1] for t in args]
        guided, c_guided = gsg.guided_stopgrad_loss(*row, mode="guided")
        reverse, c_reverse = gsg.guided_stopgrad_loss(*row, mode="reverse")
        assert c_reverse.item() == 3 - c_guided.item()
        cases.append((c_guided.item(), c_reverse.item()))
        sums.append(guided + reverse)
    p11, p12, p21, p22, z11, z12, z21, z22 = args
    all_four = 0.5 * (D(p11, z12) + D(p12, z11) + D(p21, z22) + D(p22, z21))
    print(f"GSG Eq. 7: (guided, reverse) cases of pairs 0-3: {cases[:4]}")
    identity("GSG Eq. 7, 50 pairs", "guided + reverse", torch.stack(sums),
             "1/2 (the four D terms)", all_four, rtol=0)


def test_random_stopgrad_hits_each_case_a_quarter_of_the_time_and_is_seeded():
    """random: P(case = c) = 1/4 for c in 0..3; the training loop draws cases from a seeded
    generator, each rank its rows of the same global draw."""
    torch.manual_seed(0)
    args = eight(b=40000, d=2, seed=3)
    _, case = gsg.guided_stopgrad_loss(*args, mode="random")
    freq = torch.bincount(case, minlength=4).double() / len(case)
    torch.testing.assert_close(freq, torch.full((4,), 0.25, dtype=torch.float64), rtol=0, atol=0.01)
    def draw(ctx):  # from a fresh generator of seed 7, epoch 3
        return gsg.draw_pairing(64, "random", common.epoch_generators(7, 3)[0], ctx)
    draws = [draw(ctx_for()) for _ in range(2)]
    # each of 2 ranks gets its own rows of the one global draw, partners and cases alike
    ranks = [draw(ctx_for(r, 2)) for r in range(2)]
    for k in range(2):
        torch.testing.assert_close(draws[0][k], draws[1][k], rtol=0, atol=0)
        torch.testing.assert_close(torch.cat([r[k] for r in ranks]), draws[0][k], rtol=0, atol=0)
    _, forced = gsg.guided_stopgrad_loss(*[t[:64] for t in args], mode="random",
                                         random_case=draws[0][1])
    torch.testing.assert_close(forced, draws[0][1], rtol=0, atol=0)


@pytest.mark.parametrize("mode", MODES)
def test_gradient_reaches_only_the_two_selected_predictions(mode):
    """dL/dp11 != 0 only where case in {0,1}, dL/dp12 only in {2,3}, dL/dp21 only in {0,2},
    dL/dp22 only in {1,3}; every z is a stop-gradient target and gets none."""
    torch.manual_seed(1)
    args = eight(b=64, seed=4, grad=True)
    loss, case = gsg.guided_stopgrad_loss(*args, mode=mode)
    loss.backward()
    p11, p12, p21, p22 = args[:4]
    for p, used in ((p11, case < 2), (p12, case >= 2), (p21, case % 2 == 0), (p22, case % 2 == 1)):
        nonzero = p.grad.abs().sum(1) > 0
        torch.testing.assert_close(nonzero, used, rtol=0, atol=0)
    assert all(z.grad is None for z in args[4:])


def test_loss_in_unit_range_and_mean_of_the_four_cases_is_the_symmetric_loss():
    """L reaches -1 and 1; mean_c L_c = Eq. 2 = 1/2 L_sym(x1) + 1/2 L_sym(x2) (each Eq. 2 term is
    in two cases)."""
    p11, p12, p21, p22, z11, z12, z21, z22 = args = eight(b=16, seed=5)
    cases = [gsg.guided_stopgrad_loss(*args, mode="random", random_case=torch.full((16,), c))[0]
             for c in range(4)]
    eq2 = 0.5 * (gsg.symmetric_loss(p11, p12, z11, z12) + gsg.symmetric_loss(p21, p22, z21, z22))
    torch.testing.assert_close(torch.stack(cases).mean(), eq2, rtol=0, atol=1e-12)
    for mode in ("guided", "reverse"):  # the bounds are reached: p = z everywhere -1, p = -z +1
        assert gsg.guided_stopgrad_loss(*[p11] * 8, mode=mode)[0].item() == pytest.approx(-1)
        antipodal = gsg.guided_stopgrad_loss(*[p11] * 4, *[-p11] * 4, mode=mode)[0]
        assert antipodal.item() == pytest.approx(1)


# ---- model, BYOL, crops, diagnostics

def test_byol_ema_momentum_is_constant_or_follows_the_cosine_schedule():
    """Cosine tau_k = 1 - (1 - tau_0)(cos(pi k/K) + 1)/2: tau_0 at k=0, 1 at k=K. (The update:
    the BYOL train_step test below.)"""
    assert gsg.ema_momentum(5, 100, 0.99, "constant") == 0.99
    assert gsg.ema_momentum(0, 100, 0.99, "cosine") == pytest.approx(0.99)
    assert gsg.ema_momentum(50, 100, 0.99, "cosine") == pytest.approx(0.995)
    assert gsg.ema_momentum(100, 100, 0.99, "cosine") == pytest.approx(1.0)


CPU = ctx_for()


def test_simsiam_target_gets_no_gradient_and_byol_target_moves_only_by_ema_after_the_step(float64):
    """SimSiam: the gradient flows through p = h(z) only, never through sg(z). BYOL: after
    train_step the target is tau * old + (1 - tau) * (the online encoder after the step).
    --no-predictor makes p = z (Sec. 6.2)."""
    torch.manual_seed(0)
    args = type("Args", (), {"stopgrad": "guided"})
    views = [torch.randn(8, 3, 8, 8) for _ in range(4)]
    model = gsg.SiameseNet("resnet18", 4, 8, 8, 8, 4)
    (z1, z2), (p1, p2) = model(*views[:2])
    loss = gsg.symmetric_loss(p1, p2, z1, z2)
    grad_via_p = torch.autograd.grad(loss, [p1, p2], retain_graph=True)
    full = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
    only_p = torch.autograd.grad([p1, p2], list(model.parameters()), grad_outputs=grad_via_p)
    for a, b in zip(full, only_p):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    target = gsg.momentum_encoder(model.encoder, CPU)  # as main builds it
    with torch.no_grad():  # the target differs from the online encoder, so the EMA is visible
        for t in target.parameters():
            t.add_(torch.randn_like(t))
    old = [t.clone() for t in target.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    gsg.train_step(model, optimizer, views, args, CPU, pairing=(torch.randperm(8), None),
                   target=target, online=model.encoder, tau=0.9)
    for t, o, theta in zip(target.parameters(), old, model.encoder.parameters()):
        torch.testing.assert_close(t, 0.9 * o + 0.1 * theta, rtol=0, atol=1e-12)
    (z1, z2), (p1, p2) = gsg.SiameseNet("resnet18", 4, 8, 8, 8, 4, predictor=False)(*views[:2])
    torch.testing.assert_close(p1, z1, rtol=0, atol=0)
    torch.testing.assert_close(p2, z2, rtol=0, atol=0)


def test_residual_branches_start_at_zero_and_both_projector_depths():
    """zero_init_residual (official SimSiam / GSG code): every block's last BN weight is 0.
    2 layers: f -> hidden -> D; 3 layers (ImageNet): f -> f -> f -> D; output BN without affine."""
    two = gsg.Encoder("resnet18", 4, 8, proj_hidden=12, proj_dim=10)
    blocks = [m for m in two.backbone.modules() if isinstance(m, common.BasicBlock)]
    assert len(blocks) == 8 and all(torch.all(b.bn2.weight == 0) for b in blocks)
    f = two.backbone.out_dim
    three = gsg.Encoder("resnet18", 4, 8, proj_hidden=12, proj_dim=10, proj_layers=3)
    for encoder, widths in ((two, [(f, 12), (12, 10)]), (three, [(f, f), (f, f), (f, 10)])):
        linear = [(m.in_features, m.out_features) for m in encoder.projector
                  if isinstance(m, torch.nn.Linear)]
        assert linear == widths and not encoder.projector[-1].affine
        assert encoder(torch.randn(4, 3, 8, 8)).shape == (4, 10)


def test_byol_uses_simsiams_recipe_and_gsg_makes_four_crops():
    """One recipe for both methods (GSG Sec. 6.1), blur 0.5 above 64 px, none at 32 px, no
    solarisation; four crops for guided / random / reverse, two for symmetric."""
    def make(method, stopgrad, size):
        return gsg.recipes(argparse.Namespace(method=method, stopgrad=stopgrad, image_size=size,
                                              crop_scale=[0.2, 1.0]))
    for mode in MODES:
        large = make("byol", mode, 96)
        assert large == make("simsiam", mode, 96) and len(large) == 4
        assert all(r.blur_p == 0.5 and r.solarize_p == 0 and r.crop_scale == (0.2, 1.0)
                   for r in large)
        assert all(r.blur_p == 0 for r in make("byol", mode, 32))
    assert len(make("byol", "symmetric", 32)) == 2


def test_partners_views_are_its_crops_2_and_3_not_its_own_pair_and_the_loss_uses_them():
    """Every image's crops 2, 3 differ from its crops 0, 1; train_step's loss is Eq. 6 with x2's
    views = crops 2, 3 of image r(i), not r(i)'s crops 0, 1."""
    torch.manual_seed(0)
    args = argparse.Namespace(method="simsiam", stopgrad="guided", image_size=16,
                              crop_scale=[0.2, 1.0])
    images = torch.randint(0, 256, (8, 3, 20, 24), dtype=torch.uint8)
    augment = common.Augment(gsg.recipes(args), 16, (0.5,) * 3, (0.25,) * 3, CPU)
    generator = common.epoch_generators(0, 0)[0]
    views = augment(images, generator)
    for own in (0, 1):
        for fresh in (2, 3):
            assert (views[own] - views[fresh]).flatten(1).abs().amax(1).min() > 0.01
    partner, _ = gsg.draw_pairing(8, "guided", generator, CPU)
    assert (partner != torch.arange(8)).any()
    model = gsg.SiameseNet("resnet18", 4, 16, 16, 16, 8)
    with torch.no_grad():  # train mode, one pass per crop, as train_step
        z = [model.encoder(v) for v in views]
        p = [model.predictor(t) for t in z]
    r = partner
    expected = gsg.guided_stopgrad_loss(p[0], p[1], p[2][r], p[3][r], z[0], z[1], z[2][r], z[3][r])
    two_crop = gsg.guided_stopgrad_loss(p[0], p[1], p[0][r], p[1][r], z[0], z[1], z[0][r], z[1][r])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss, case, _ = gsg.train_step(model, optimizer, views, args, CPU, pairing=(partner, None))
    torch.testing.assert_close(loss, expected[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(case, expected[1], rtol=0, atol=0)
    assert (loss - two_crop[0]).abs() > 1e-3


def test_projection_std_is_one_over_sqrt_d_when_spread_and_zero_when_collapsed():
    """std over the batch of z/|z|, mean over dims: ~1/sqrt(D) for isotropic z, 0 if collapsed."""
    torch.manual_seed(0)
    assert gsg.projection_std(torch.randn(20000, 64)).item() == pytest.approx(1 / 8, rel=0.02)
    assert gsg.projection_std(torch.ones(32, 64) + 1e-9 * torch.randn(32, 64)).item() < 1e-6


# ---- 2 processes == 1 process

N, WIDTH, SIZE, STEPS = 8, 4, 8, 3


def _global_inputs(seed=0, d=6):
    """p_k, z_k (N, d) of crops k = 0..3 of the global batch, partners r and random cases."""
    g = torch.Generator().manual_seed(seed)
    p = [torch.randn(N, d, generator=g, dtype=torch.float64) for _ in range(4)]
    z = [torch.randn(N, d, generator=g, dtype=torch.float64) for _ in range(4)]
    partner = torch.randperm(N, generator=g)
    random_case = torch.randint(4, (N,), generator=g)
    return p, z, partner, random_case


def _losses_and_grads(rank, world):
    """Every mode's loss over the global batch: this rank's loss, dL/dp_k of its rows, cases."""
    p, z, partner, random_case = _global_inputs()
    rows = slice(rank * N // world, (rank + 1) * N // world)
    out = {}
    for mode in ["symmetric"] + MODES:
        q = [pk[rows].clone().requires_grad_() for pk in p]
        t = [zk[rows] for zk in z]
        if mode == "symmetric":
            loss, case = gsg.symmetric_loss(q[0], q[1], t[0], t[1]), None
        else:
            p21, p22, z21, z22 = gsg.partner_crops(q[2], q[3], t[2], t[3], partner[rows])
            loss, case = gsg.guided_stopgrad_loss(q[0], q[1], p21, p22, t[0], t[1], z21, z22, mode,
                                                  random_case[rows])
        loss.backward()
        grads = [torch.zeros_like(qk) if qk.grad is None else qk.grad for qk in q]
        out[mode] = (loss.detach(), grads, case)
    return out


def _train_steps(rank, world, method):
    """STEPS four-crop guided train_step calls (BYOL: EMA inside) on a DDP model."""
    torch.manual_seed(0)
    ctx = ctx_for(rank, world)
    model = gsg.SiameseNet("resnet18", WIDTH, SIZE, 16, 16, 8)
    target = gsg.momentum_encoder(model.encoder, ctx) if method == "byol" else None
    net = common.distribute(model, ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9, weight_decay=5e-4)
    args = type("Args", (), {"stopgrad": "guided"})
    rows = slice(rank * N // world, (rank + 1) * N // world)
    losses, cases = [], []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 + step)
        crops = [torch.randn(N, 3, SIZE, SIZE, generator=g)[rows] for _ in range(4)]
        pairing = gsg.draw_pairing(N, "guided", g, ctx)
        loss, case, std = gsg.train_step(net, optimizer, crops, args, ctx, pairing=pairing,
                                         target=target, online=model.encoder, tau=0.9)
        losses.append(loss)
        cases.append(case)
    return {"model": model.state_dict(), "target": target.state_dict() if target else None,
            "losses": losses, "cases": cases, "std": std}


def _worker_gsg():
    """Rank's results in float64 for the loss-level and train-step comparisons (one launch)."""
    import torch.distributed as dist
    torch.set_default_dtype(torch.float64)
    rank, world = dist.get_rank(), dist.get_world_size()
    return {"loss": _losses_and_grads(rank, world), "simsiam": _train_steps(rank, world, "simsiam"),
            "byol": _train_steps(rank, world, "byol")}


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    return run_distributed("test_simsiam_byol_gsg", "_worker_gsg",
                           tmp_path_factory.mktemp("gsg_dist"))


def test_two_processes_equal_one_loss_and_gradient_with_partners_on_the_other_rank(
        two_processes, float64):
    """mean_r L_r = L, and dL_r/dp_k (rank r's rows) / 2 = the same rows of dL/dp_k for all four
    crops, in every stop-gradient mode; the partner's crops 2, 3 send their gradient home."""
    reference = _losses_and_grads(0, 1)
    partner = _global_inputs()[2]
    assert (partner[:N // 2] >= N // 2).any()  # some partners do live on the other rank
    assert reference["guided"][1][2].abs().sum() > 0  # crop 2 (x2's view) does get a gradient
    for mode, (loss, grads, case) in reference.items():
        ranks = [result["loss"][mode] for result in two_processes]
        mean = torch.stack([r[0] for r in ranks]).mean()
        torch.testing.assert_close(mean, loss, rtol=0, atol=1e-12)
        for k in range(4):
            torch.testing.assert_close(torch.cat([r[1][k] for r in ranks]) / 2, grads[k], rtol=0,
                                       atol=1e-12)
        if case is not None:
            torch.testing.assert_close(torch.cat([r[2] for r in ranks]), case, rtol=0, atol=0)


@pytest.mark.parametrize("method", ["simsiam", "byol"])
def test_two_processes_equal_one_guided_training_steps(two_processes, float64, method):
    """After 3 four-crop guided train_step calls (BYOL: + EMA), 2 gloo processes hold the
    1-process model and target."""
    reference = _train_steps(0, 1, method)
    ranks = [result[method] for result in two_processes]
    for step in range(STEPS):
        mean = (ranks[0]["losses"][step] + ranks[1]["losses"][step]) / 2
        torch.testing.assert_close(mean, reference["losses"][step], rtol=0, atol=1e-10)
        torch.testing.assert_close(torch.cat([r["cases"][step] for r in ranks]),
                                   reference["cases"][step], rtol=0, atol=0)
    torch.testing.assert_close(ranks[0]["std"], reference["std"], rtol=0, atol=1e-10)
    for r in ranks:
        for key in ("model", "target") if method == "byol" else ("model",):
            for name, value in reference[key].items():
                torch.testing.assert_close(r[key][name], value, rtol=0, atol=1e-9,
                                           msg=f"{key} {name}")


# ---- runs of the script

def run_main(folder, out, *extra):
    gsg.main(smoke_args(folder, out, "--linear-epochs", "0", *TINY_HEADS, *extra))
    return [json.loads(line) for line in open(out / "metrics.jsonl")]


@pytest.mark.parametrize("method", ["simsiam", "byol"])
def test_every_stopgrad_mode_and_no_predictor_runs_and_logs_its_diagnostics(
        tiny_folder, tmp_path, method):
    """Every stop-gradient mode and guided --no-predictor: case fractions sum to 1 (none for
    symmetric), the projection std is logged, the final report has kNN k=1; random is
    reproducible."""
    for mode, extra in [(m, []) for m in ["symmetric"] + MODES] + [("guided", ["--no-predictor"])]:
        out = tmp_path / f"{mode}{len(extra)}"
        record = run_main(tiny_folder, out, "--method", method, "--stopgrad", mode, *extra)[-1]
        fractions = [record.get(f"case_{name}") for name in gsg.CASES]
        if mode == "symmetric":
            assert fractions == [None] * 4
        else:
            assert sum(fractions) == pytest.approx(1)
        assert record["proj_std"] > 0 and ("ema" in record) == (method == "byol")
        assert "knn_k1_top1" in json.load(open(out / "results.json"))
    run_main(tiny_folder, tmp_path / "random_again", "--method", method, "--stopgrad", "random")
    first = torch.load(tmp_path / "random0" / "checkpoint.pt")["model"]
    second = torch.load(tmp_path / "random_again" / "checkpoint.pt")["model"]
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_imagenet_options_three_layer_projector_and_fixed_predictor_lr(tiny_folder, tmp_path):
    """--proj-layers 3 --fix-pred-lr --schedule cosine: a 3-layer projector; the predictor's group
    ends the run at the peak lr, the encoder's decayed (official main_simsiam.py)."""
    run_main(tiny_folder, tmp_path / "run", "--proj-layers", "3", "--fix-pred-lr",
             "--schedule", "cosine")
    checkpoint = torch.load(tmp_path / "run" / "checkpoint.pt")
    peak = 0.03 * 16 / 256
    encoder, predictor = checkpoint["optimizer"]["param_groups"]
    assert predictor["lr"] == pytest.approx(peak) and encoder["lr"] < 0.9 * peak
    assert "encoder.projector.6.weight" in checkpoint["model"]  # the third Linear


def test_bad_momentum_is_an_argparse_error():
    """--ema must lie in [0, 1): 1 would freeze the target, 1.5 would extrapolate."""
    assert gsg.parse_args(["--ema", "0.996"]).ema == 0.996
    for bad in ("1", "1.5", "-0.1"):
        with pytest.raises(SystemExit):
            gsg.parse_args(["--ema", bad])


def test_smoke_byol_guided_run_under_torchrun(tiny_folder, tmp_path):
    """The real script, BYOL with guided stop-gradient, under `torchrun --nproc_per_node=2`."""
    out = tmp_path / "run"
    args = smoke_args(tiny_folder, out, "--method", "byol", *TINY_HEADS)
    done = run_ok("simsiam_byol_gsg.py", args, nproc=2)
    config, (record,), results = check_run_folder(out, epochs=1)
    assert {"loss", "proj_std", *(f"case_{name}" for name in gsg.CASES)} <= record.keys()
    assert "linear_top1" in results and config["args"]["method"] == "byol"
    assert " knn_k1_top1 " in done.stdout + done.stderr


def test_byol_with_random_stopgrad_and_a_cosine_ema_resumes_exactly(tiny_folder, tmp_path):
    """BYOL's target, its cosine momentum schedule and GSG's random cases and pairings: stopped in
    epoch 2 and continued, the run ends as uninterrupted."""
    from test_runs import resume_is_exact

    resume_is_exact("simsiam_byol_gsg", ["--method", "byol", "--stopgrad", "random",
                                         "--ema-schedule", "cosine", *TINY_HEADS],
                    tiny_folder, tmp_path)
