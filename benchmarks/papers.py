"""Each paper's own comparison, for `python benchmarks/compare.py --paper NAME`: its rows (a script
and the options that make the row), the settings and protocol its numbers were measured by, and
the published numbers, quoted, with their sources. Facts only: compare.py runs and tables them.
"""
from collections import namedtuple

# Where each published number comes from; a row's `source` is one of these keys.
SOURCES = {
    "DT README": "github.com/ChaoningZhang/Dual-temperature README.md, 'Results', lines 99-103 "
                 "(commit e8d5e76): the authors' runs of their bash_files/{moco,simmoco,simco}.sh, "
                 "ResNet-18, CIFAR-100, 200 epochs; their solo-learn fork trains an online "
                 "linear probe on the encoder and one on the momentum encoder; the README does "
                 "not name which its table reports, so ours of both stand beside it",
    "GSG Table 1": "Lee & Lee, 'Implicit Contrastive Representation Learning with Guided "
                   "Stop-gradient', NeurIPS 2023, Table 1: CIFAR-10, ResNet-18, 200 epochs, kNN "
                   "k=1 and linear top-1 (Sec. 5.1), mean and standard deviation of 3 runs "
                   "(Sec. 5.1, 'Results')",
    "lightly": "github.com/lightly-ai/lightly docs/source/getting_started/benchmarks.rst, "
               "'CIFAR-10', lines 155-179 (commit e8d317f): ResNet-18, 200 epochs, kNN k=200, "
               "reported as the best epoch's test accuracy (lines 139-143); a third party's runs",
    "DCL abstract": "Yeh et al., Decoupled Contrastive Learning, ECCV 2022 (arXiv 2110.06848), "
                    "abstract: SimCLR + DCL 68.2% ImageNet-1K top-1 at batch 256 in 200 epochs, "
                    "6.4 points over its SimCLR baseline",
}

# How a paper's numbers were measured: the options that select it on every row's command line,
# the metrics its table shows (results.json's keys; knn_top1_best: the best kNN of any epoch, as
# lightly reports), `authors` (False: a stand-in for a protocol this project lacks, never
# comparable), the protocol in words, and `linear`: linear_eval.py's --protocol for each finished
# run (None: none).
Protocol = namedtuple("Protocol", "options metrics authors text linear", defaults=[None])
PROTOCOLS = {
    # the DT paper's "Evaluation" paragraph: top-1 of the online linear evaluation, which their
    # solo-learn fork trains on the encoder and on the momentum encoder (moco_simmoco_simco.py's
    # OnlineProbes)
    "dt": Protocol(["--online-probe"], ["online_top1", "momentum_online_top1"], True,
                   "the DT authors' online linear probes (their solo-learn fork's), on the encoder "
                   "and on the momentum encoder (MoCo v2, SimMoCo), test top-1 after the last "
                   "epoch; their README does not say which its numbers are, so both face them"),
    # kNN k=1 (GSG Sec. 5.1, 'k-nearest neighbors': a majority vote, which our weighted vote
    # equals at k=1)
    "gsg": Protocol(["--linear-epochs", "0"], ["knn_k1_top1", "linear_top1"], True,
                    "kNN k=1 and GSG's CIFAR linear probe (SGD lr 30, 90 epochs, cosine: GSG Sec. "
                    "5.1; its crop+flip views are this project's assumption, not the paper's)",
                    "gsg-cifar"),
    # lightly's kNN: k=200, T=0.1 (cifar10_benchmark.py lines 105-106), our monitor's defaults,
    # every epoch on the test set; no linear probe
    "dcl": Protocol(["--eval-every", "1", "--linear-epochs", "0"],
                    ["knn_top1_best", "knn_top1"], True,
                    "kNN k=200, T=0.1 after every epoch; lightly reports the best epoch on the "
                    "test set, ours is given both ways (last epoch, and best epoch as lightly)"),
    # our copy of the DCL paper does not give its linear protocol: SimSiam's ImageNet probe runs
    # in its place, so the published numbers stay "not comparable"
    "dcl-imagenet": Protocol(["--linear-epochs", "0"], ["linear_top1"], False,
                             "SimSiam's ImageNet linear probe (LARS, lr 0.1 per 256, batch 4096, "
                             "90 epochs): the DCL paper's own protocol is not in our copy",
                             "simsiam-imagenet"),
}

# A published number: its value, its source (a SOURCES key), the source's standard deviation if
# given. A row: its script, options (its batch among them), {metric: Published}, the metrics its
# script reports (None: the protocol's). A paper: the options every row gets, those settings in
# words, {name: Row}, the runs each number averages.
Published = namedtuple("Published", "value source spread", defaults=[None])
Row = namedtuple("Row", "script options published metrics", defaults=[None])
Paper = namedtuple("Paper", "title settings text rows seeds", defaults=[1])

DT = {"mocov2": (52.58, 54.40, 53.28, 51.47, 48.90),
      "simmoco": (54.02, 54.93, 54.11, 52.45, 49.70),
      "simco": (58.04, 58.29, 58.35, 57.08, 55.34)}  # DT README lines 101-103
PROBES = dict.fromkeys(("mocov2", "simmoco"), PROTOCOLS["dt"].metrics) | {"simco": ["online_top1"]}
DT_ROWS = {f"{method}-b{batch}": Row(  # one number, each probe it may be (SimCo has one)
    "moco_simmoco_simco.py", ["--method", method, "--batch-size", str(batch)],
    {probe: Published(value, "DT README") for probe in PROBES[method]}, PROBES[method])
    for method, values in DT.items() for batch, value in zip((64, 128, 256, 512, 1024), values)}

GSG = {("simsiam", "symmetric"): ((77.0, 0.67), (82.7, 0.26)),  # GSG Table 1,
       ("simsiam", "guided"): ((82.2, 0.48), (86.4, 0.28)),  # CIFAR-10 columns
       ("byol", "symmetric"): ((85.4, 0.24), (88.0, 0.09)),
       ("byol", "guided"): ((89.4, 0.21), (90.3, 0.16))}
GSG_ROWS = {f"{method}-{stopgrad}": Row(
    "simsiam_byol_gsg.py", ["--method", method, "--stopgrad", stopgrad, "--batch-size", "512"],
    {"knn_k1_top1": Published(knn, "GSG Table 1", knn_sd),
     "linear_top1": Published(linear, "GSG Table 1", linear_sd)})
    for (method, stopgrad), ((knn, knn_sd), (linear, linear_sd)) in GSG.items()}

# lightly's benchmarks.rst lines 161-179: SimCLR, DCL, DCLW at batch 128 and 512
LIGHTLY = {("infonce", 128): 84.7, ("dcl", 128): 84.4, ("dclw", 128): 83.3,
           ("infonce", 512): 84.8, ("dcl", 512): 84.0, ("dclw", 512): 82.4}
# lightly's SimCLR uses NTXentLoss's default temperature 0.5 (lightly/loss/
# ntx_ent_loss.py line 64), its DCL and DCLW their default 0.1 (dcl_loss.py lines 85, 253)
TEMPERATURES = {"infonce": "0.5", "dcl": "0.1", "dclw": "0.1"}
DCL_ROWS = {f"simclr-{loss}-b{batch}": Row(
    "simclr_dcl.py", ["--loss", loss, "--temperature", temperature, "--batch-size", str(batch)],
    {"knn_top1_best": Published(LIGHTLY[loss, batch], "lightly")} if (loss, batch) in LIGHTLY
    else {}) for loss, temperature in TEMPERATURES.items() for batch in (32, 64, 128, 256, 512)}

DCL_IMAGENET = {"infonce": 68.2 - 6.4, "dcl": 68.2}  # DCL abstract: "outperforming ... by 6.4%"
DCL_IMAGENET_ROWS = {f"simclr-{loss}-e200": Row(
    "simclr_dcl.py", ["--loss", loss, "--batch-size", "256", "--epochs", "200"],
    {"linear_top1": Published(round(value, 1), "DCL abstract")})
    for loss, value in DCL_IMAGENET.items()}

PAPERS = {
    "dt": Paper("Dual temperature: MoCo v2 / SimMoCo / SimCo over the batch size (the authors' "
                "README table)", ["--dataset", "cifar100"],
                "CIFAR-100, ResNet-18, 200 epochs, moco_simmoco_simco.py's defaults, which are "
                "the authors' bash_files/*.sh (SGD lr 0.03 per 256, wd 5e-4, 10 warm-up epochs, "
                "queue 65536)", DT_ROWS),
    "gsg": Paper("Guided stop-gradient: SimSiam and BYOL, symmetric vs guided (GSG Table 1, "
                 "CIFAR-10)", ["--dataset", "cifar10"],
                 "CIFAR-10, ResNet-18, batch 512, 200 epochs, SGD lr 0.06 at 512, wd 5e-4, no "
                 "schedule: simsiam_byol_gsg.py's defaults, which are GSG Sec. 5.1's",
                 GSG_ROWS, seeds=3),
    # lightly's cifar10_benchmark.py: lr 6e-2 * batch / 128 (line 126; i.e. 0.12 per 256), SGD m
    # 0.9, wd 5e-4, cosine without warm-up (lines 782-784), SimCLRProjectionHead(512, 512, 128)
    # (line 764); 200 epochs (line 103)
    "dcl": Paper(
        "DCL: InfoNCE (SimCLR) vs DCL vs DCLW over the batch size, CIFAR-10 (lightly's benchmark: "
        "the DCL paper's CIFAR table is missing from our copy)",
        ["--dataset", "cifar10", "--lr", "0.12", "--warmup-epochs", "0", "--proj-hidden", "512"],
        "CIFAR-10, ResNet-18, 200 epochs, lightly's cifar10_benchmark.py settings: SGD lr 0.06 x "
        "batch / 128, wd 5e-4, cosine, no warm-up, projector 512-512-128, temperature 0.5 for "
        "SimCLR and 0.1 for DCL/DCLW", DCL_ROWS),
    "dcl-imagenet": Paper(
        "DCL: SimCLR vs SimCLR + DCL on ImageNet-1K at batch 256 (the DCL paper)",
        ["--dataset", "imagefolder", "--arch", "resnet50", "--image-size", "224"],
        "ImageNet-1K (--data-dir: train/ and val/ class folders), ResNet-50, batch 256, 200 "
        "epochs, simclr_dcl.py's other defaults (the paper's optimiser settings are not in our "
        "copy)", DCL_IMAGENET_ROWS),
}
