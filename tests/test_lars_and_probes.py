"""LARS against its formula and the online probe (no change to pre-training), both also across 2
processes; the kNN bank's and the fixed probe's memory."""

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

import common
import moco_simmoco_simco
from helpers import (ctx_for, flat_tensors, float64, global_batch_loss, run_distributed,
                     small_network, smoke_args)



# ---- LARS

@pytest.mark.parametrize("clip", [False, True])
def test_lars_takes_the_formulas_step_tensor_by_tensor(float64, clip):
    """Three LARS steps (lr 0.5, 0.05, 0.005 as a schedule would set them) equal, per tensor,
        g' = g + wd w,  r = eta ||w|| / ||g'|| (1 where ||w|| = 0),  clip: r = min(r / lr, 1),
        buf <- m buf + r g',  w <- w - lr buf,
    and the 1-D tensors (bias, BatchNorm) that optimizer_groups sets apart take plain SGD steps
    without weight decay (r = 1). With clip, r / lr passes 1 for some tensors only."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Linear(4, 3, bias=False))
    nn.init.zeros_(model[2].weight)  # ||w|| = 0 at the first step: r = 1
    m, wd, eta = 0.9, 1e-2, 0.02
    optimizer = common.LARS(common.optimizer_groups(model.parameters()), 0.5, m, wd, eta, clip)
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    buffers = {n: torch.zeros_like(p) for n, p in expected.items()}
    generator, clipped = torch.Generator().manual_seed(1), set()
    for lr in (0.5, 0.05, 0.005):
        for group in optimizer.param_groups:
            group["lr"] = lr
        for name, p in model.named_parameters():
            p.grad = torch.randn(p.shape, generator=generator, dtype=p.dtype)
            w, g = expected[name], p.grad
            r = 1.0
            if w.ndim > 1:  # weights: decay and trust ratio
                g = g + wd * w
                if w.norm() > 0:
                    r = eta * w.norm().item() / g.norm().item()
                    if clip:
                        clipped.add(r / lr > 1)
                        r = min(r / lr, 1.0)
            buffers[name] = m * buffers[name] + r * g
            expected[name] = w - lr * buffers[name]
        optimizer.step()
        for name, p in model.named_parameters():
            assert torch.allclose(p, expected[name], rtol=0, atol=1e-12), (lr, name)
    assert clipped == ({True, False} if clip else set())


# ---- 2 processes

LABELS = torch.tensor([0, 1, 2, 0, -1, 1, -1, 2])  # rank 1 holds both unlabelled images


def _lars_and_online_probe_steps(ctx, rows):
    """3 steps of a global-batch loss with LARS (clip on) and the online probe on the backbone,
    float64 -> the model's and the probe's state."""
    torch.manual_seed(0)
    model = small_network()
    net = common.distribute(model, ctx)
    args = SimpleNamespace(optimizer="lars", wd=1e-3, lars_eta=0.02, lars_clip=True)
    optimizer = common.pretraining_optimizer(model.parameters(), args, 0.5)
    probes = online_probes(model.backbone, ctx)
    features = []  # the backbone's output, as moco_simmoco_simco.train_step returns it
    model.backbone.register_forward_hook(lambda m, i, out: features.append(out.detach()))
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        views = [torch.randn(8, 3, 8, 8, generator=g, dtype=torch.float64)[rows] for _ in range(2)]
        loss = global_batch_loss(net(torch.cat(views)))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        probes.step([features.pop()], LABELS[rows], 0.5)
    classifier = probes.classifiers["online_top1"]
    return ({k: v.detach().clone() for k, v in model.state_dict().items()},
            {k: v.detach().clone() for k, v in classifier.state_dict().items()})


def online_probes(backbone, ctx):
    """moco_simmoco_simco's OnlineProbes on `backbone`'s features, 3 classes."""
    encoder = SimpleNamespace(backbone=backbone)
    return moco_simmoco_simco.OnlineProbes(
        SimpleNamespace(num_classes=3), ctx, SimpleNamespace(workers=0, seed=0), encoder)


def _worker():
    ctx = ctx_for(common.rank(), 2)
    with float64():
        return _lars_and_online_probe_steps(ctx, slice(4 * ctx.rank, 4 * ctx.rank + 4))


def test_lars_and_the_online_probe_train_like_one_process(tmp_path):
    """3 steps of LARS on 2 ranks leave the model where 3 steps of one process on the whole batch
    do; the online probe's classifier too: its gradient is the mean over the global batch's
    labelled views (rank 1 has 2 of 4, rank 0 all 4), not a mean of rank means."""
    with float64():
        model, classifier = _lars_and_online_probe_steps(ctx_for(), slice(0, 8))
    torch.manual_seed(0)
    initial = small_network().state_dict()
    for rank in run_distributed("test_lars_and_probes", "_worker", tmp_path):
        for key, value in model.items():
            assert torch.allclose(rank[0][key], value, rtol=0, atol=1e-10), key
        for key, value in classifier.items():
            assert torch.allclose(rank[1][key], value, rtol=0, atol=1e-12), key
    assert max((model[k].double() - initial[k]).abs().max() for k in model) > 1e-3
    with float64():
        start = common.linear_classifier(32, 3, "cpu", 0).weight  # the backbone's 32 features
    assert (classifier["weight"] - start).abs().max() > 1e-4


# ---- online probe

def test_the_online_probe_draws_nothing_from_the_global_rng():
    backbone = common.ResNet("resnet18", 4, 8)
    state = torch.get_rng_state()
    online_probes(backbone, ctx_for())
    assert torch.equal(state, torch.get_rng_state())


def checkpoint(out):
    return torch.load(out / "checkpoint.pt", weights_only=True)


def test_the_online_probe_leaves_pre_training_bit_identical(tiny_folder, tmp_path):
    """One epoch (4 steps) with and without --online-probe: every tensor of the model, optimizer,
    queue and momentum encoder is bit-identical. With it, the probe and the momentum encoder's
    (the DT scripts' --momentum_classifier) are in checkpoint.pt, online_top1 and
    momentum_online_top1 in the evaluation's metrics line and in results.json."""
    extra = ["--method", "mocov2", "--queue-size", "40"]  # queue, key encoder
    run = lambda name, flag: moco_simmoco_simco.main(smoke_args(  # noqa: E731
        tiny_folder, tmp_path / name, flag, *extra, "--linear-epochs", "0"))
    run("with", "--online-probe")
    run("without", "--no-online-probe")
    a, b = checkpoint(tmp_path / "with"), checkpoint(tmp_path / "without")
    assert a.keys() - b.keys() == {"probes"}
    a, b = flat_tensors(a), flat_tensors(b)
    assert len(b) > 50 and b.keys() <= a.keys()
    for key, value in b.items():
        assert torch.equal(a[key], value), key
    line = json.loads(open(tmp_path / "with" / "metrics.jsonl").readline())
    results = json.load(open(tmp_path / "with" / "results.json"))
    for key in ("online_top1", "momentum_online_top1"):
        assert 0 <= line[key] <= 100 and 0 <= results[key] <= 100, key
    assert "online_top1" not in json.load(open(tmp_path / "without" / "results.json"))


class PerTensorLARS(torch.optim.Optimizer):
    """The LARS step one tensor at a time (the reference)."""

    def __init__(self, groups, lr, momentum, weight_decay, eta, clip):
        super().__init__(groups, dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                                      eta=eta, clip=clip, adapt=True))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for w in (w for w in group["params"] if w.grad is not None):
                g, r = w.grad.add(w, alpha=group["weight_decay"]), torch.ones(())
                if group["adapt"]:
                    w_norm, g_norm = w.norm(), g.norm()
                    trust = group["eta"] * w_norm / g_norm
                    trust = (trust / group["lr"]).clamp(max=1) if group["clip"] else trust
                    r = torch.where((w_norm > 0) & (g_norm > 0), trust, r)
                buf = self.state[w].setdefault("momentum_buffer", torch.zeros_like(w))
                buf.mul_(group["momentum"]).add_(r * g)
                w.add_(buf, alpha=-group["lr"])


@pytest.mark.parametrize("clip", [False, True])
def test_lars_equals_the_per_tensor_step_over_20_resnet_steps(clip, monkeypatch):
    """common.LARS (each group's tensors at once) against the per-tensor loop, 20 steps of a
    width-8 ResNet-18 under a falling lr: the same weights to 1e-6. After the first step a step
    makes no tensor of state (the same momentum buffers, no zeros_like)."""
    torch.manual_seed(0)
    models = [common.ResNet("resnet18", 8, 16) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    optimizers = [cls(common.optimizer_groups(m.parameters()), 0.5, 0.9, 1e-3, 0.02,
                      clip) for cls, m in zip((common.LARS, PerTensorLARS), models)]
    x = torch.randn(4, 3, 16, 16)
    real, made = torch.zeros_like, []
    monkeypatch.setattr(torch, "zeros_like", lambda *a, **k: made.append(1) or real(*a, **k))
    for step in range(20):
        for model, optimizer in zip(models, optimizers):
            for group in optimizer.param_groups:
                group["lr"] = 0.5 * (1 - step / 20)
            model.zero_grad()
            model(x).square().mean().backward()
            made.clear()
            optimizer.step()
            if optimizer is optimizers[0] and step > 0:
                assert not made, f"step {step + 1} made {len(made)} tensors with zeros_like"
        ours = [optimizers[0].state[p]["momentum_buffer"] for p in models[0].parameters()]
        buffers = ours if step == 0 else buffers
        assert all(a is b for a, b in zip(ours, buffers))
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.allclose(a, b, rtol=0, atol=1e-6)


# ---- ImageNet's memory

def overlapping_classes(n, dim=32, classes=10, seed=0):
    """Unit features of `classes` overlapping clusters: n - 1,000 rows to train on, 1,000 to test
    -> (train_f, train_y, test_f, test_y)."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, dim, generator=g)
    labels = torch.randint(0, classes, (n,), generator=g)
    features = centres[labels] + 1.5 * torch.randn(n, dim, generator=g)
    features = nn.functional.normalize(features, dim=1)
    return features[:-1000], labels[:-1000], features[-1000:], labels[-1000:]


def test_the_knn_bank_is_float16_and_votes_as_float32_does():
    """ImageNet's kNN bank is float16 (5.2 GB a rank for ResNet-50, as benchmarks/README.md
    states): extract_features returns unit features in float16 (others in float32), and kNN top-1
    on the float16 bank is float32's within 3 of 1,000 test images (measured: 92.3 and 84.5 at k =
    200 and 1, equal)."""
    backbone = common.ResNet("resnet18", 4, 8)
    data = SimpleNamespace(mean=(0.5,) * 3, std=(0.25,) * 3, image_size=8)
    images = torch.randint(0, 256, (6, 3, 8, 8), dtype=torch.uint8)
    split = (images, torch.zeros(6, dtype=torch.long))
    unit, _ = common.extract_features(backbone, split, data, ctx_for())
    raw, _ = common.extract_features(backbone, split, data, ctx_for(), unit=False)
    assert unit.dtype == torch.float16 and raw.dtype == torch.float32
    train_f, train_y, test_f, test_y = overlapping_classes(6000)
    for k in (200, 1):
        single = common.knn_accuracy(train_f, train_y, test_f, test_y, 10, k)
        half = common.knn_accuracy(train_f.half(), train_y, test_f.half(), test_y, 10, k)
        assert 20 < single < 95, single  # neither chance nor solved
        assert abs(half - single) <= 0.3, (k, half, single)


def test_the_fixed_probe_standardises_a_chunk_of_the_bank_at_a_time():
    """On a bank of 40,000 rows (three of common.py's chunks of 16,384) no op of the fixed probe
    makes a tensor of half the bank's size (a copy of the bank on ImageNet is gigabytes), and its
    top-1 on the float16 bank is the float32 bank's within 1 point of 1,000 test images (measured:
    50.1, equal)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):  # the largest output of any op
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if torch.is_tensor(t):
                    self.numel = max(self.numel, t.numel())
            return out

    train_f, train_y, test_f, test_y = overlapping_classes(41000, dim=8)
    train_y[::7] = -1  # unlabelled rows, left out of the statistics
    bank = train_f.half()
    with Largest() as largest:
        half = common.linear_probe(bank, train_y, test_f.half(), test_y, 10, 2, batch=4096)
    assert largest.numel < train_f.numel() / 2, largest.numel
    single = common.linear_probe(train_f, train_y, test_f, test_y, 10, 2, batch=4096)
    assert 20 < single < 95, single
    assert abs(half - single) <= 1.0, (half, single)
