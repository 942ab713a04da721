"""Evaluation (common.py) on small hand-built cases, each against a plain loop or a hand-computed
reference: the weighted kNN and evaluate's two kNN numbers, the features, the fixed probe."""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn

import common
from helpers import ctx_for

CPU = ctx_for()


def on_circle(*angles):
    """Unit 2-d features at these angles (radians) -> (len(angles), 2)."""
    a = torch.tensor(angles)
    return torch.stack([a.cos(), a.sin()], 1)


def knn_by_hand(train_f, train_y, test_f, test_y, k, t):
    """Weighted kNN as a plain loop: the k most cosine-similar labelled training rows vote with
    weight exp(sim / t); test rows labelled -1 are not counted -> top-1 %."""
    bank = [(f, y) for f, y in zip(train_f.tolist(), train_y.tolist()) if y >= 0]
    correct = counted = 0
    for f, y in zip(test_f.tolist(), test_y.tolist()):
        if y < 0:
            continue
        similar = sorted(((sum(a * b for a, b in zip(f, g)), label) for g, label in bank),
                         reverse=True)[:k]
        votes = {}
        for sim, label in similar:
            votes[label] = votes.get(label, 0.0) + math.exp(sim / t)
        correct += max(votes, key=votes.get) == y
        counted += 1
    return 100.0 * correct / counted


# One test image (class 1) at angle 0; the nearest training image of class 0 (0.10 rad), the next
# two of class 1 (0.20, 0.25 rad), three far of class 2. k=3 at t=0.1 says class 1 (e^9.95 <
# e^9.80 + e^9.69); at t=0.02 class 0 (e^49.75 > e^49.00 + e^48.46).
NEAR_TRAIN_F = on_circle(0.10, 0.20, 0.25, 2.0, 2.1, 2.2)
NEAR_TRAIN_Y = torch.tensor([0, 1, 1, 2, 2, 2])
NEAR_TEST_F, NEAR_TEST_Y = on_circle(0.0), torch.tensor([1])


def test_knn_votes_with_the_k_nearest_neighbours_weighted_by_exp_of_similarity_over_t():
    """The k nearest vote, not the nearest alone: k=1, the single nearest (class 0) decides, 0 %;
    k=3, t=0.1, its two class-1 neighbours outvote it, 100 %. Their weights are exp(sim / t): at
    t=0.02 the nearest outvotes the two next (0 %), at t=1 it does not (100 %); with exp(sim * t)
    t=0.02 would weigh all three alike. Each as the plain loop computes."""
    case = (NEAR_TRAIN_F, NEAR_TRAIN_Y, NEAR_TEST_F, NEAR_TEST_Y)
    for k, t, expected in ((1, 0.1, 0.0), (3, 0.1, 100.0), (3, 0.02, 0.0), (3, 1.0, 100.0)):
        assert knn_by_hand(*case, k=k, t=t) == expected
        assert common.knn_accuracy(*case, num_classes=3, k=k, t=t) == expected


def test_unlabelled_rows_neither_vote_nor_count():
    """Training rows labelled -1 (unlabelled images, extract_features' padding) are the test
    image's nearest, yet take no part in the vote, also when k exceeds the labelled rows; test
    rows labelled -1 are not in the accuracy's denominator."""
    train_f = torch.cat([on_circle(0.01, 0.02), NEAR_TRAIN_F])  # the two nearest are unlabelled
    train_y = torch.cat([torch.tensor([-1, -1]), NEAR_TRAIN_Y])
    test_f = torch.cat([NEAR_TEST_F, on_circle(2.05)])  # a padding row: class 2 but labelled -1
    test_y = torch.cat([NEAR_TEST_Y, torch.tensor([-1])])
    for k, expected in ((1, 0.0), (3, 100.0), (200, 100.0)):
        assert knn_by_hand(train_f, train_y, test_f, test_y, k=k, t=0.1) == expected
        assert common.knn_accuracy(train_f, train_y, test_f, test_y, 3, k=k, t=0.1) == expected


class FeatureTable(nn.Module):
    """A stand-in backbone: image i, whose first pixel holds i, -> row i of a hand-built table.
    Evaluated with mean 0 and std 1 the pixel arrives as i / 255."""

    def __init__(self, table):
        super().__init__()
        self.register_buffer("table", table)
        self.out_dim = table.shape[1]

    def forward(self, x):
        return self.table[(x[:, 0, 0, 0] * 255).round().long()]


def indexed_images(first, n):
    """uint8 (n, 3, 2, 2) images first .. first + n - 1, the index in every pixel."""
    return torch.arange(first, first + n, dtype=torch.uint8).view(n, 1, 1, 1).expand(n, 3, 2, 2)


def table_data(train_f, train_y, test_f, test_y, num_classes):
    """A Data whose evaluation splits are images of FeatureTable(cat([train_f, test_f]))."""
    n = len(train_y)
    data = common.Data(train=None, train_labels=train_y, num_classes=num_classes, image_size=2,
                       eval_train=(indexed_images(0, n), train_y),
                       eval_test=(indexed_images(n, len(test_y)), test_y),
                       mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))
    return FeatureTable(torch.cat([train_f, test_f])), data


def evaluation_args(**options):
    defaults = dict(knn_k=200, knn_t=0.1, linear_epochs=0, seed=0, epochs=1)
    return SimpleNamespace(**{**defaults, **options})


def test_final_evaluation_reports_knn_with_knn_k_and_knn_t_and_with_k_1():
    """evaluate(final=True): knn_top1 is the vote of --knn-k neighbours at --knn-t, knn_k1_top1
    that of the single nearest, each as the plain loop computes on the features. Two class-1 test
    images: P at 0 rad (class 0 at 0.10, class 1 at 0.20, 0.25: k=3 says 0 at t=0.02, 1 at 0.1),
    Q at 1.2 (class 0 at +0.05, class 1 at +0.055, +0.06: k=3 says 1); k=1 says 0 for both."""
    train_f = on_circle(0.10, 0.20, 0.25, 1.25, 1.255, 1.26, 2.5, 2.6, 2.7)
    train_y = torch.tensor([0, 1, 1, 0, 1, 1, 2, 2, 2])
    test_f, test_y = on_circle(0.0, 1.2), torch.tensor([1, 1])
    backbone, data = table_data(train_f, train_y, test_f, test_y, 3)
    features = common.split_features(backbone, data, CPU)
    result = common.evaluate(features, data, evaluation_args(knn_k=3, knn_t=0.02), final=True)
    case = (train_f, train_y, test_f, test_y)
    assert result["knn_top1"] == knn_by_hand(*case, k=3, t=0.02) == 50.0
    assert result["knn_k1_top1"] == knn_by_hand(*case, k=1, t=0.02) == 0.0
    assert knn_by_hand(*case, k=3, t=0.1) == 100.0  # --knn-t matters in this case
    assert result["knn_k"] == 3 and "linear_top1" not in result  # --linear-epochs 0: no probe


def test_extracted_features_are_the_eval_mode_backbones_rows_scaled_to_unit_norm():
    """unit=True: F(x) / |F(x)| of the backbone in eval mode on the normalised images, every row
    of norm 1, in float16; unit=False: F(x) itself; the backbone's train mode is given back."""
    torch.manual_seed(0)
    backbone = common.ResNet("resnet18", 8, 8)
    backbone(torch.randn(16, 3, 8, 8))  # moves the BatchNorm running statistics off 0 and 1
    images, labels = torch.randint(0, 256, (5, 3, 8, 8), dtype=torch.uint8), torch.arange(5)
    data = common.Data(train=None, train_labels=labels, eval_train=(images, labels),
                       eval_test=None, num_classes=5, image_size=8, mean=(0.5, 0.4, 0.3),
                       std=(0.2, 0.25, 0.3))
    mean, std = torch.tensor(data.mean).view(3, 1, 1), torch.tensor(data.std).view(3, 1, 1)
    with torch.no_grad():
        raw = backbone.eval()((images / 255 - mean) / std)  # (5, F)
    backbone.train()
    unit, y = common.extract_features(backbone, data.eval_train, data, CPU)
    assert torch.equal(y, labels) and backbone.training
    assert unit.dtype == torch.float16  # the kNN bank's: to 5e-4
    unit = unit.float()
    torch.testing.assert_close(unit.norm(dim=1), torch.ones(5), rtol=0, atol=2e-3)
    torch.testing.assert_close(unit, raw / raw.norm(dim=1, keepdim=True), rtol=0, atol=5e-4)
    torch.testing.assert_close(common.extract_features(backbone, data.eval_train, data, CPU,
                                                       unit=False)[0], raw)
    assert (raw.norm(dim=1) - 1).abs().min() > 0.1  # unit=True changes these rows


def test_the_fixed_probe_standardises_the_test_features_with_the_training_statistics():
    """One feature, 100 + 0.1 * (+-1 + U(-0.25, 0.25)), the sign of the +-1 the class: trained on
    standardised features, the probe classifies the test features standardised alike perfectly
    (raw, it would call them all one class, 50 %)."""
    g = torch.Generator().manual_seed(0)

    def features(n):
        y = torch.arange(n) % 2  # (n,) balanced classes
        jitter = 0.5 * torch.rand(n, 1, generator=g) - 0.25  # (n, 1)
        return 100 + 0.1 * ((2 * y[:, None] - 1) + jitter), y
    (train_f, train_y), (test_f, test_y) = features(200), features(100)
    assert common.linear_probe(train_f, train_y, test_f, test_y, 2, 5, batch=32) == 100.0
