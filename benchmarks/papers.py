"""Each paper's own comparison, for `python benchmarks/compare.py --paper NAME`: its rows (a script
and the options that make the row), the settings and the protocol its numbers were measured by,
and the published numbers with their sources. compare.py runs the rows; this file says what they
are, reads our numbers from the run folders and prints the table beside the published ones.

A published number is quoted, never ours; it is shown beside our number only when the rows ran
at the paper's full scale with the paper's protocol (else the table says "not comparable").
"""
import json
import os
import statistics
from dataclasses import dataclass, field

# Where each published number comes from; a row's `source` is one of these keys.
SOURCES = {
    "DT README": "github.com/ChaoningZhang/Dual-temperature README.md, 'Results', lines 99-103 "
                 "(commit e8d5e76): the authors' runs of their bash_files/{moco,simmoco,simco}.sh, "
                 "ResNet-18, CIFAR-100, 200 epochs; their code, a solo-learn fork, trains an "
                 "online linear probe on the encoder and (--momentum_classifier) one on the "
                 "momentum encoder, and the README does not name which one its table reports: "
                 "ours of both stand beside the number",
    "GSG Table 1": "Lee & Lee, NeurIPS 2023, Table 1 (shared/papers/guided_stop_gradient.txt "
                   "lines 137-145): CIFAR-10, ResNet-18, 200 epochs, kNN k=1 and linear top-1 "
                   "(Sec. 5.1), mean and standard deviation of 3 runs (line 169)",
    "lightly": "github.com/lightly-ai/lightly docs/source/getting_started/benchmarks.rst, "
               "'CIFAR-10', lines 155-179 (commit e8d317f): ResNet-18, 200 epochs, kNN k=200, "
               "reported as the best epoch's test accuracy (lines 139-143); a third party's runs",
    "DCL abstract": "Yeh et al., Decoupled Contrastive Learning, ECCV 2022 (arXiv 2110.06848), "
                    "abstract: SimCLR + DCL 68.2% ImageNet-1K top-1 at batch 256 in 200 epochs, "
                    "6.4 points over its SimCLR baseline",
}

# What each metric is; "knn_top1_best" is the best kNN over the epochs (metrics.jsonl), the others
# come from the run's results.json.
METRICS = {"online_top1": "online probe top-1", "linear_top1": "linear top-1",
           "momentum_online_top1": "momentum-encoder online probe top-1",
           "knn_k1_top1": "kNN k=1 top-1", "knn_top1": "kNN top-1, last epoch",
           "knn_top1_best": "kNN top-1, best epoch (as lightly reports)"}


@dataclass
class Protocol:
    """How a paper's numbers were measured: the options that select the protocol on every row's
    command line, and for each published metric the key ours is read from."""
    options: list
    reads: dict  # published metric -> our metric
    authors: bool  # False: a stand-in for a protocol this project lacks; never comparable
    text: str


PROTOCOLS = {
    # the DT paper's "Evaluation" paragraph: top-1 of the online linear evaluation, which their
    # solo-learn fork trains on the encoder and, with a momentum encoder, on it too
    # (common.online_probes); moco_simmoco_simco.py has them on by default
    "dt": Protocol(["--online-probe"], {"online_top1": "online_top1",
                                        "momentum_online_top1": "momentum_online_top1"}, True,
                   "the authors' online linear probes (their solo-learn fork's), on the encoder "
                   "and on the momentum encoder (MoCo v2, SimMoCo), test top-1 after the last "
                   "epoch; their README does not say which its numbers are, so both face them"),
    # --linear-protocol gsg-cifar is GSG's CIFAR probe (GSG Sec. 5.1: SGD m 0.9, lr 30,
    # batch 256, cosine, 90 epochs; guided_stop_gradient.txt line 167), its crop+flip views this
    # project's assumption (no source gives them); kNN k=1 (line 165; a majority vote, which our
    # weighted vote equals at k=1)
    "gsg": Protocol(["--linear-protocol", "gsg-cifar"],
                    {"knn_k1_top1": "knn_k1_top1", "linear_top1": "linear_top1"}, True,
                    "kNN k=1 and GSG's CIFAR linear probe (SGD lr 30, 90 epochs, cosine: GSG Sec. "
                    "5.1; its crop+flip views are this project's assumption, not the paper's)"),
    # lightly's kNN: k=200, T=0.1 (cifar10_benchmark.py lines 105-106), our monitor's defaults,
    # every epoch on the test set; no linear probe
    "dcl": Protocol(["--eval-every", "1", "--linear-epochs", "0"],
                    {"knn_top1_best": "knn_top1_best", "knn_top1": "knn_top1"}, True,
                    "kNN k=200, T=0.1 after every epoch; lightly reports the best epoch on the "
                    "test set, ours is given both ways (last epoch, and best epoch as lightly)"),
    # our copy of the DCL paper does not give its linear protocol: SimSiam's ImageNet probe runs
    # in its place, so the published numbers stay "not comparable"
    "dcl-imagenet": Protocol(["--linear-protocol", "simsiam-imagenet"],
                             {"linear_top1": "linear_top1"}, False,
                             "SimSiam's ImageNet linear probe (LARS, lr 0.1 per 256, batch 4096, "
                             "90 epochs): the DCL paper's own protocol is not in our copy"),
}


@dataclass
class Published:
    value: float
    source: str  # a key of SOURCES
    spread: float = None  # the source's standard deviation, where it gives one


@dataclass
class Row:
    script: str
    options: list  # the options that make the row (its batch among them)
    published: dict = field(default_factory=dict)  # metric -> Published
    metrics: tuple = None  # the protocol's metrics this row's script gives (None: all)


@dataclass
class Paper:
    title: str
    settings: list  # options every row gets: the paper's data set and training settings
    text: str  # those settings in words, with their source
    rows: dict  # name -> Row
    seeds: int = 1  # the number of runs each published number is the mean of


def dt_rows():
    published = {"mocov2": (52.58, 54.40, 53.28, 51.47, 48.90),
                 "simmoco": (54.02, 54.93, 54.11, 52.45, 49.70),
                 "simco": (58.04, 58.29, 58.35, 57.08, 55.34)}  # DT README lines 101-103
    # one number, two probes it may be (the README names neither); SimCo has no momentum encoder
    metrics = {"mocov2": ("online_top1", "momentum_online_top1"),
               "simmoco": ("online_top1", "momentum_online_top1"), "simco": ("online_top1",)}
    return {f"{method}-b{batch}": Row("moco_simmoco_simco.py",
                                      ["--method", method, "--batch-size", str(batch)],
                                      {m: Published(value, "DT README") for m in metrics[method]},
                                      metrics[method])
            for method, values in published.items()
            for batch, value in zip((64, 128, 256, 512, 1024), values)}


def gsg_rows():
    published = {("simsiam", "symmetric"): ((77.0, 0.67), (82.7, 0.26)),  # GSG Table 1,
                 ("simsiam", "guided"): ((82.2, 0.48), (86.4, 0.28)),  # CIFAR-10 columns
                 ("byol", "symmetric"): ((85.4, 0.24), (88.0, 0.09)),
                 ("byol", "guided"): ((89.4, 0.21), (90.3, 0.16))}
    return {f"{method}-{stopgrad}": Row(
        "simsiam_byol_gsg.py", ["--method", method, "--stopgrad", stopgrad, "--batch-size", "512"],
        {"knn_k1_top1": Published(knn, "GSG Table 1", knn_sd),
         "linear_top1": Published(linear, "GSG Table 1", linear_sd)})
        for (method, stopgrad), ((knn, knn_sd), (linear, linear_sd)) in published.items()}


def dcl_rows():
    # lightly's benchmarks.rst lines 161-179: SimCLR, DCL, DCLW at batch 128 and 512
    published = {("infonce", 128): 84.7, ("dcl", 128): 84.4, ("dclw", 128): 83.3,
                 ("infonce", 512): 84.8, ("dcl", 512): 84.0, ("dclw", 512): 82.4}
    rows = {}
    for loss in ("infonce", "dcl", "dclw"):
        # lightly's SimCLR uses NTXentLoss's default temperature 0.5 (lightly/loss/
        # ntx_ent_loss.py line 64), its DCL and DCLW their default 0.1 (dcl_loss.py lines 85, 253)
        temperature = "0.5" if loss == "infonce" else "0.1"
        for batch in (32, 64, 128, 256, 512):
            value = published.get((loss, batch))
            rows[f"simclr-{loss}-b{batch}"] = Row(
                "simclr_dcl.py", ["--loss", loss, "--temperature", temperature,
                                  "--batch-size", str(batch)],
                {} if value is None else {"knn_top1_best": Published(value, "lightly")})
    return rows


def dcl_imagenet_rows():
    published = {"infonce": 68.2 - 6.4, "dcl": 68.2}  # DCL abstract: "outperforming ... by 6.4%"
    return {f"simclr-{loss}-e200": Row(
        "simclr_dcl.py", ["--loss", loss, "--batch-size", "256", "--epochs", "200"],
        {"linear_top1": Published(round(value, 1), "DCL abstract")})
        for loss, value in published.items()}


PAPERS = {
    "dt": Paper("Dual temperature: MoCo v2 / SimMoCo / SimCo over the batch size (the authors' "
                "README table)", ["--dataset", "cifar100"],
                "CIFAR-100, ResNet-18, 200 epochs, moco_simmoco_simco.py's defaults, which are "
                "the authors' bash_files/*.sh (SGD lr 0.03 per 256, wd 5e-4, 10 warm-up epochs, "
                "queue 65536)", dt_rows()),
    "gsg": Paper("Guided stop-gradient: SimSiam and BYOL, symmetric vs guided (GSG Table 1, "
                 "CIFAR-10)", ["--dataset", "cifar10"],
                 "CIFAR-10, ResNet-18, batch 512, 200 epochs, SGD lr 0.06 at 512, wd 5e-4, no "
                 "schedule: simsiam_byol_gsg.py's defaults, which are GSG Sec. 5.1's",
                 gsg_rows(), seeds=3),
    # lightly's cifar10_benchmark.py: lr 6e-2 * batch / 128 (line 126; i.e. 0.12 per 256), SGD m
    # 0.9, wd 5e-4, cosine without warm-up (lines 782-784), SimCLRProjectionHead(512, 512, 128)
    # (line 764); 200 epochs (line 103)
    "dcl": Paper("DCL: InfoNCE (SimCLR) vs DCL vs DCLW over the batch size, CIFAR-10 (lightly's "
                 "benchmark: the DCL paper's CIFAR table is missing from our copy)",
                 ["--dataset", "cifar10", "--lr", "0.12", "--warmup-epochs", "0",
                  "--proj-hidden", "512"],
                 "CIFAR-10, ResNet-18, 200 epochs, lightly's cifar10_benchmark.py settings: SGD "
                 "lr 0.06 x batch / 128, wd 5e-4, cosine, no warm-up, projector 512-512-128, "
                 "temperature 0.5 for SimCLR and 0.1 for DCL/DCLW", dcl_rows()),
    # issue 21 adds SimCLR's ImageNet settings (--optimizer lars and its lr) to `settings` here
    "dcl-imagenet": Paper("DCL: SimCLR vs SimCLR + DCL on ImageNet-1K at batch 256 (the DCL "
                          "paper)", ["--dataset", "imagefolder", "--arch", "resnet50",
                                     "--image-size", "224"],
                          "ImageNet-1K (--data-dir: train/ and val/ class folders), ResNet-50, "
                          "batch 256, 200 epochs, simclr_dcl.py's other defaults (the "
                          "paper's optimiser settings are not in our copy)",
                          dcl_imagenet_rows()),
}


# ------------------------------------------------------------------------------ our numbers
def read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def metric(folder, key):
    """Our number `key` from one run folder: results.json's, or for knn_top1_best the best kNN
    of any epoch in metrics.jsonl and of the final evaluation; None if the run has none."""
    results = read_json(os.path.join(folder, "results.json"))
    if key != "knn_top1_best":
        return results.get(key)
    values = [results["knn_top1"]] if "knn_top1" in results else []
    try:
        with open(os.path.join(folder, "metrics.jsonl")) as f:
            values += [json.loads(line).get("knn_top1") for line in f if line.strip()]
    except (OSError, ValueError):
        pass
    values = [v for v in values if v is not None]
    return max(values) if values else None


def mean_spread(values):
    """(mean, sample standard deviation or None for one value, n) of the values not None."""
    values = [v for v in values if v is not None]
    if not values:
        return None, None, 0
    spread = statistics.stdev(values) if len(values) > 1 else None
    return statistics.fmean(values), spread, len(values)


def table_rows(paper_name, runs, comparable, batch_divisor=1):
    """One table line per row and published metric. `runs`: row name -> its seeds' runs, each
    {"folder", "seed", "wall_s", "error"} (none: the row was not run)."""
    paper, protocol = PAPERS[paper_name], PROTOCOLS[paper_name]
    lines = []
    for name, row in paper.rows.items():
        seeds = runs.get(name, [])
        for published_metric, ours_metric in protocol.reads.items():
            if row.metrics is not None and published_metric not in row.metrics:
                continue
            values = [metric(run["folder"], ours_metric) for run in seeds]
            mean, spread, n = mean_spread(values)
            published = row.published.get(published_metric)
            walls = [run["wall_s"] for run in seeds if run.get("wall_s") is not None]
            errors = [run["error"] for run in seeds if run.get("error")]
            settings = " ".join(row.options)
            if batch_divisor != 1 and "--batch-size" in row.options:
                batch = int(row.options[row.options.index("--batch-size") + 1])
                settings += f" (run at {max(1, batch // batch_divisor)})"
            lines.append({
                "paper": paper_name, "row": name, "script": row.script,
                "settings": settings, "metric": published_metric,
                "ours_metric": ours_metric, "ours": mean, "ours_spread": spread, "ours_n": n,
                "ours_seeds": {run["seed"]: v for run, v in zip(seeds, values)},
                "published": published.value if published else None,
                "published_spread": published.spread if published else None,
                "source": published.source if published else None,
                "comparable": comparable and published is not None,
                "diff": mean - published.value if comparable and published and n else None,
                "wall_s": statistics.fmean(walls) if walls else None,
                "ran": bool(seeds), "error": errors[0] if errors else None})
    return lines


def duration(seconds):
    if seconds is None:
        return ""
    return (f"{seconds / 3600:.1f} h" if seconds >= 3600 else
            f"{seconds / 60:.0f} min" if seconds >= 60 else f"{seconds:.0f} s")


def table(paper_name, lines, changes, seeds):
    """Markdown: a header naming the paper's settings, the protocol and any change of scale, then
    one line per row and metric, then the sources."""
    paper, protocol = PAPERS[paper_name], PROTOCOLS[paper_name]
    head = [f"## `--paper {paper_name}`: {paper.title}", "",
            f"Paper's settings: {paper.text}.", f"Protocol: {protocol.text}.",
            f"Seeds: {', '.join(map(str, seeds))} (ours: mean ± standard deviation over the "
            f"seeds that finished, n of them).", ""]
    if changes:
        head += [f"**Changed from the paper's settings: `{' '.join(changes)}`. This is not a "
                 f"reproduction: the published numbers are not comparable.**", ""]
    elif not protocol.authors:
        head += ["**Full scale, but by a stand-in protocol: the published numbers are not "
                 "comparable.**", ""]
    else:
        head += ["Full scale: the paper's settings and protocol.", ""]
    failed = any(line["error"] for line in lines)
    header = ["row", "settings", "metric", "ours", "published", "source", "diff", "wall / run"]
    header += ["error"] * failed
    out = head + ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for line in lines:
        ours = "not run" if not line["ran"] else "" if line["ours"] is None else (
            f"{line['ours']:.2f}" + (f" ± {line['ours_spread']:.2f}" if line["ours_n"] > 1
                                     else "") + f" (n={line['ours_n']})")
        what = METRICS[line["metric"]]
        if line["ours_metric"] != line["metric"]:
            what += f" [ours: {METRICS[line['ours_metric']]}, stand-in]"
        if line["published"] is None:
            published = "none published"
        elif not line["comparable"]:
            published = "not comparable"
        else:
            published = f"{line['published']:.2f}" + (
                f" ± {line['published_spread']:.2f}" if line["published_spread"] else "")
        diff = "" if line["diff"] is None else f"{line['diff']:+.2f}"
        cells = [line["row"], f"`{line['settings']}`", what, ours, published,
                 line["source"] or "", diff, duration(line["wall_s"])]
        if failed:
            cells.append((line["error"] or "").replace("|", "\\|"))
        out.append("| " + " | ".join(cells) + " |")
    used = sorted({line["source"] for line in lines if line["source"]})
    out += [""] + [f"- {key}: {SOURCES[key]}." for key in used]
    return "\n".join(out)
