"""Every method learns: short runs of the real scripts on a generated texture set end far above the
same network untrained, and the GSG paper's collapse claim shows without a predictor.

The identity tests call the loss functions; these call each script's `main()`, so they notice a
training step that detaches the wrong branch, feeds the loss the same view twice or never steps.
Data: tests/helpers.texture_image_folder, 5 texture classes, 2,000 training and 500 validation
images of 20 px, written once per session. Network: ResNet-18 at width 8, small heads, batch 32,
2-3 epochs (150-225 steps). Each run is deterministic (seeded, one CPU thread).

The settings are this test's choices for runs of a few hundred steps, not the papers': batch 32,
no warm-up, --lr 0.3 per 256 images (1.0 for MoCo v2 and SimMoCo, whose keys come from a slowly
moving encoder), a 256-key queue and a 512-row support set (at 65,536 and 16,384 they would hold
mostly the random rows they start with, and a 2,000-image set with 5 classes in a large queue puts
hundreds of same-class keys among the negatives), BYOL's target momentum 0.9 (at 0.99 the target
barely leaves its random start in 225 steps).
Measured over seeds 0-4 before choosing the margin: untrained kNN top-1 46-55%, trained 61-98%,
the smallest gap 15 points (BYOL, symmetric); see each test for what it guards.
"""
import json
import os

import pytest

import moco_simmoco_simco
import nnclr_dcl
import simclr_dcl
import simsiam_byol_gsg
from helpers import texture_image_folder

MARGIN = 10.0  # kNN top-1 points above the untrained network; the smallest measured gap was 15
PROJ_DIM = 64
SHARED = ["--dataset", "imagefolder", "--image-size", "20", "--width", "8", "--batch-size", "32",
          "--proj-hidden", "256", "--proj-dim", str(PROJ_DIM), "--warmup-epochs", "0", "--lr", "0.3",
          "--linear-epochs", "0", "--device", "cpu", "--workers", "0", "--seed", "2"]
GSG = ["--pred-hidden", "64"]
RUNS = {  # name -> (script module, options after SHARED)
    # the untrained row: every script builds the same ResNet first from the same seed
    "untrained": (simclr_dcl, ["--epochs", "0"]),
    "simclr-infonce": (simclr_dcl, ["--epochs", "2", "--loss", "infonce"]),
    "simclr-dcl": (simclr_dcl, ["--epochs", "2", "--loss", "dcl"]),
    "simclr-dclw": (simclr_dcl, ["--epochs", "2", "--loss", "dclw"]),
    "mocov2": (moco_simmoco_simco, ["--epochs", "3", "--method", "mocov2", "--queue-size", "64", "--lr", "1.0"]),
    "simmoco": (moco_simmoco_simco, ["--epochs", "3", "--method", "simmoco", "--lr", "1.0"]),
    "simco": (moco_simmoco_simco, ["--epochs", "2", "--method", "simco"]),
    "simsiam-symmetric": (simsiam_byol_gsg, ["--epochs", "2", "--stopgrad", "symmetric", *GSG]),
    "simsiam-guided": (simsiam_byol_gsg, ["--epochs", "2", "--stopgrad", "guided", *GSG]),
    "byol-symmetric": (simsiam_byol_gsg, ["--epochs", "3", "--method", "byol", "--ema", "0.9",
                                          "--stopgrad", "symmetric", *GSG]),
    "byol-guided": (simsiam_byol_gsg, ["--epochs", "3", "--method", "byol", "--ema", "0.9",
                                       "--stopgrad", "guided", *GSG]),
    "nnclr-dcl": (nnclr_dcl, ["--epochs", "2", "--loss", "dcl", "--pred-hidden", "256", "--support-size", "512"]),
    "simsiam-symmetric-no-predictor": (simsiam_byol_gsg, ["--epochs", "2", "--stopgrad", "symmetric",
                                                          "--no-predictor"]),
    "simsiam-guided-no-predictor": (simsiam_byol_gsg, ["--epochs", "2", "--stopgrad", "guided", "--no-predictor"]),
}
METHODS = [name for name in RUNS if name != "untrained" and not name.endswith("no-predictor")]


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """trained(name) -> (results.json, metrics.jsonl records) of that run; each run happens once."""
    data = texture_image_folder(str(tmp_path_factory.mktemp("textures")))
    root = tmp_path_factory.mktemp("learning")
    done = {}

    def run(name):
        if name not in done:
            module, options = RUNS[name]
            out = os.path.join(root, name)
            module.main([*SHARED, "--data-dir", data, "--out", out, *options])
            with open(os.path.join(out, "results.json")) as f:
                results = json.load(f)
            records = []
            if os.path.exists(os.path.join(out, "metrics.jsonl")):
                with open(os.path.join(out, "metrics.jsonl")) as f:
                    records = [json.loads(line) for line in f]
            done[name] = results, records
        return done[name]
    return run


@pytest.mark.parametrize("name", METHODS)
def test_method_ends_above_the_untrained_network(name, trained):
    """kNN top-1 (k=200) after 2-3 epochs >= the same network untrained (--epochs 0, same seed) + MARGIN.

    Guards each method's training step end to end. Broken on purpose in a scratch copy, each of
    these ended below the margin and failed this test (see the module docstring for the numbers):
    TODO
    """
    untrained = trained("untrained")[0]["knn_top1"]
    knn = trained(name)[0]["knn_top1"]
    assert knn >= untrained + MARGIN, f"{name}: kNN top-1 {knn:.1f}% vs {untrained:.1f}% untrained"


def test_gsg_without_predictor_symmetric_collapses_guided_does_not(trained):
    """GSG Sec. 6.2: without a predictor, SimSiam's symmetric loss collapses, guided stop-gradient does not.

    Shown here by proj_std, the std over the batch of z/|z| (about 1/sqrt(D) when spread, 0 when
    collapsed): in 2 epochs symmetric SimSiam's falls (0.09 -> 0.06-0.08 measured over seeds 0-2
    at D = 64) while guided SimSiam's stays near 1/sqrt(D) = 0.125 (0.12). The projector's last
    BatchNorm keeps each coordinate spread, so at this scale the collapse is partial, not to 0.
    Guards the guided case choice and the no-predictor path: TODO
    """
    symmetric = [r["proj_std"] for r in trained("simsiam-symmetric-no-predictor")[1]]
    guided = [r["proj_std"] for r in trained("simsiam-guided-no-predictor")[1]]
    spread = PROJ_DIM ** -0.5
    assert symmetric[-1] < symmetric[0] and symmetric[-1] < 0.8 * spread, symmetric
    assert guided[-1] > 0.9 * spread, guided
