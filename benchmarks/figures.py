r"""Draw the papers' diagnostic figures from run folders.

Each figure is this code at small scale, labelled with the
paper's figure number; it is not a reproduction. Each PNG goes
to --out with its data beside it as JSON.

    python benchmarks/figures.py dcl --train  # DCL Fig. 1
    python benchmarks/figures.py dt --train   # DT Fig. 3
    python benchmarks/figures.py gsg --train  # GSG Figs. 4, 5
    python benchmarks/figures.py dcl RUN [RUN ...]  # your runs
    python benchmarks/figures.py curves RUN [RUN ...]

dcl: q_B, the negative-positive coupling multiplier
(simclr_dcl.npc_multiplier), of 1024 images' augmented views
split into batches of 32 ... 1024: its distribution, mean and
coefficient of variation. dt: the entropy of r_+ over 256
anchors (moco_simmoco_simco.dual_temperature_loss, then
anchor_weight_stats) against K keys of other images, at several
tau_beta, divided by log 256. Both rebuild the model from the
run's config.json and checkpoint.pt. gsg: kNN top-1 per epoch,
and proj_std without a predictor. curves: every number of
metrics.jsonl per epoch.

--train first runs compare.py's variants for the figure on
--dataset textures (the README's quick start, kNN every epoch)
into RUNS_DIR/FIGURE; a second call reuses finished runs.
MoCo v2 runs with --lr 1.0 --key-momentum 0.999 --queue-size
256: at the quick start's momentum 0.99 its loss climbs to
log(K + 1) and its kNN stays near the untrained 51%; with MoCo's
own momentum 0.999 it learns (kNN 51% -> 83% in 3 epochs).
Options after `--` go to every run, e.g. `-- --device cuda`.
"""
import argparse
import importlib
import json
import math
import os
import subprocess
import sys

import torch
import torch.nn.functional as F
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
import common  # noqa: E402

# The README's quick start, with kNN each epoch and no
# final linear probe (no figure shows it).
QUICK = ["--dataset", "textures", "--width", "8",
         "--batch-size", "32", "--lr", "0.3",
         "--warmup-epochs", "0", "--epochs", "3",
         "--proj-hidden", "256", "--proj-dim", "64",
         "--eval-every", "1", "--linear-epochs", "0"]
MOCO = "--lr 1.0 --key-momentum 0.999 --queue-size 256"
STOPGRADS = ("symmetric", "guided", "random", "reverse",
             "symmetric-no-predictor", "guided-no-predictor")
# figure -> compare.py's variants and their own options
TRAIN = {
    "dcl": (["simclr-infonce", "simclr-dcl"], []),
    "dt": (["mocov2", "simco"],
           ["--no-online-probe",
            "--per-variant", "mocov2", MOCO]),
    "gsg": ([f"simsiam-{s}" for s in STOPGRADS],
            ["--epochs", "5", "--limit-train", "1000"]),
}
SIZES = (32, 64, 128, 256, 512, 1024)
TAUS = (0.05, 0.1, 0.2, 0.5, 1.0)
ANCHORS = 256
BINS = 40
SKIP = {"epoch", "seconds", "images_per_s"}


# --------------------------------------------------- runs
def name(run):
    return os.path.basename(os.path.normpath(run))


def read_json(run, file):
    with open(os.path.join(run, file)) as f:
        return json.load(f)


def read_metrics(run):
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def rebuild(run):
    """A run's script (module), options, data and checkpoint,
    its recorded command line parsed by its own parse_args."""
    config = read_json(run, "config.json")
    script = importlib.import_module(config["script"])
    # A figure's few thousand views need no GPU.
    argv = config["argv"] + ["--device", "cpu"]
    args = script.parse_args(argv)
    ctx = common.setup(args)
    data = common.load_data(args, ctx)
    args.image_size = data.image_size
    path = os.path.join(run, "checkpoint.pt")
    checkpoint = torch.load(path, map_location="cpu",
                            weights_only=True)
    return script, args, ctx, data, checkpoint


def views(script, args, ctx, data, n):
    """Two views of the first n training images, drawn by
    the script's own recipes."""
    augment = common.Augment(script.recipes(args),
                             data.image_size, data.mean,
                             data.std, ctx)
    generator = torch.Generator().manual_seed(args.seed)
    return augment(data.train[:n], generator)


def save(fig, saved, out, figure):
    os.makedirs(out, exist_ok=True)
    fig.savefig(os.path.join(out, f"{figure}.png"), dpi=110)
    with open(os.path.join(out, f"{figure}.json"), "w") as f:
        json.dump(saved, f, indent=1)
    print(f"written: {os.path.join(out, figure)}.png, .json")


def panels(count, title, columns=4):
    """A titled figure and its `count` axes, in rows."""
    rows = -(-count // columns)
    width = min(count, columns)
    fig = Figure(figsize=(4.2 * width, 3.4 * rows),
                 layout="constrained")
    fig.suptitle(f"{title}: this code at small scale, "
                 f"not a reproduction")
    axes = list(fig.subplots(rows, width,
                             squeeze=False).flat)
    for ax in axes[count:]:
        ax.set_visible(False)
    return fig, axes[:count]


# ------------------------------------------ DCL Fig. 1
@torch.no_grad()
def npc_by_batch(run):
    """The run's options and {N: q_B of every anchor of the
    batches of N images}, by simclr_dcl.npc_multiplier."""
    script, args, ctx, data, checkpoint = rebuild(run)
    model = script.SimCLR(args.arch, args.width,
                          data.image_size, args.proj_hidden,
                          args.proj_dim, args.stem_padding)
    model.load_state_dict(checkpoint["model"])
    # Eval mode: a view's projection is then the same in any
    # batch, and only the number of negatives changes.
    model.eval()
    n = min(SIZES[-1], len(data))
    x1, x2 = views(script, args, ctx, data, n)
    z1 = model(x1)  # (n, D)
    z2 = model(x2)  # (n, D)
    q = {}
    for size in [s for s in SIZES if s <= n]:
        used = n // size * size
        pairs = zip(z1[:used].split(size),
                    z2[:used].split(size))
        q[size] = torch.cat([
            script.npc_multiplier(a, b, args.temperature)
            for a, b in pairs])  # (2 * used,)
    return args, q


def dcl_figure(runs):
    fig, axes = panels(len(runs) + 2, "DCL Fig. 1")
    saved = {}
    for run, ax in zip(runs, axes):
        args, q = npc_by_batch(run)
        label = f"{name(run)} (--loss {args.loss})"
        # Bins even in logit(q_B) = log U - pos, drawn on a
        # logit axis: q_B near 0 or 1 stays readable.
        logits = torch.logit(torch.cat(list(q.values())))
        edges = torch.linspace(logits.min().item(),
                               logits.max().item(), BINS + 1)
        rows = {}
        for size, values in q.items():
            mean = values.mean().item()
            std = values.std(correction=0).item()
            counts = torch.histogram(torch.logit(values),
                                     edges).hist
            share = counts / counts.sum()
            ax.stairs(share, edges.sigmoid(),
                      label=f"N = {size}")
            rows[size] = dict(mean=mean, cv=std / mean,
                              share=share.tolist())
        ax.set(xscale="logit", xlabel="q_B",
               ylabel="share of anchors",
               title=f"q_B: {label}")
        ax.legend(fontsize=7)
        sizes = list(rows)
        means = [rows[s]["mean"] for s in sizes]
        cvs = [rows[s]["cv"] for s in sizes]
        axes[-2].plot(sizes, means, "o-", label=label)
        axes[-1].plot(sizes, cvs, "o-", label=label)
        saved[name(run)] = dict(
            loss=args.loss, temperature=args.temperature,
            bin_edges=edges.sigmoid().tolist(),
            batch_sizes=rows)
    whats = ("mean <q_B>", "C_v = std / mean of q_B")
    for ax, what in zip(axes[-2:], whats):
        ax.set(xscale="log", xlabel="batch size N",
               ylabel=what, title=what)
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.legend(fontsize=7)
    return fig, saved


# -------------------------------------------- DT Fig. 3
@torch.no_grad()
def entropy_by_dictionary(run):
    """The dictionary sizes K and {tau_beta: H(r_+) / log A
    at each K} of A anchors, by the script's own functions."""
    script, args, ctx, data, checkpoint = rebuild(run)

    def encoder(state):
        net = script.Encoder(args.arch, args.width,
                             data.image_size, args.proj_hidden,
                             args.proj_dim, args.stem_padding)
        net.load_state_dict(state)
        return net.eval()  # each key the same in any batch

    query = encoder(checkpoint["model"])
    # SimCo has no key encoder: its one encoder makes keys.
    key = encoder(checkpoint.get("key_encoder",
                                 checkpoint["model"]))
    n = min(len(data), 2048)
    anchors = min(ANCHORS, n // 2)
    x1, x2 = views(script, args, ctx, data, n)
    # In float64: at a large K every W_i lies closer to 1
    # than float32 resolves.
    q = query(x1[:anchors]).double()  # (A, D)
    k = key(x2[:anchors]).double()  # (A, D) the positives
    # The dictionary holds other images' keys only, so no
    # anchor meets its own positive among the negatives.
    keys = F.normalize(key(x2[anchors:]).double(), dim=1)
    sizes = [2 ** i for i in range(0, 17)
             if 2 ** i <= len(keys)]
    entropy = {}
    for tau in TAUS:
        row = []
        for size in sizes:
            _, w = script.dual_temperature_loss(
                q, k, args.tau_alpha, tau, keys[:size])
            h = script.anchor_weight_stats(*w)[2]
            # log A is the entropy of equal weights.
            row.append(h.item() / math.log(anchors))
        entropy[tau] = row
    return args, sizes, entropy


def dt_figure(runs):
    fig, axes = panels(len(runs), "DT Fig. 3")
    saved = {}
    for run, ax in zip(runs, axes):
        args, sizes, entropy = entropy_by_dictionary(run)
        for tau, row in entropy.items():
            ax.plot(sizes, row, "o-",
                    label=f"tau_beta = {tau}")
        # A logit axis spreads the values close to 1.
        ax.set(xscale="log", yscale="logit",
               xlabel="dictionary size K",
               ylabel="H(r_+) / log(anchors)",
               title=f"{name(run)} (--method {args.method})")
        ax.legend(fontsize=7)
        saved[name(run)] = dict(method=args.method,
                                tau_alpha=args.tau_alpha,
                                dictionary_sizes=sizes,
                                normalised_entropy=entropy)
    return fig, saved


# --------------------------------------- GSG Figs. 4, 5
def gsg_figure(runs):
    fig, axes = panels(3, "GSG Figs. 4, 5", columns=3)
    titles = ("Fig. 4: with predictor",
              "Fig. 5: no predictor",
              "Fig. 5: no predictor")
    labels = ("kNN top-1 (%)", "kNN top-1 (%)", "proj_std")
    for ax, title, label in zip(axes, titles, labels):
        ax.set(title=title, xlabel="epoch", ylabel=label)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    saved = {}
    for run in runs:
        options = read_json(run, "config.json")["args"]
        lines = read_metrics(run)
        knn = [[line["epoch"], line["knn_top1"]]
               for line in lines if "knn_top1" in line]
        std = [[line["epoch"], line["proj_std"]]
               for line in lines]
        if options["no_predictor"]:
            axes[1].plot(*zip(*knn), "o-", label=name(run))
            axes[2].plot(*zip(*std), "o-", label=name(run))
        else:
            axes[0].plot(*zip(*knn), "o-", label=name(run))
        saved[name(run)] = dict(
            method=options["method"],
            stopgrad=options["stopgrad"],
            no_predictor=options["no_predictor"],
            knn_top1=knn, proj_std=std)
    for ax in axes:
        ax.legend(fontsize=7)
    return fig, saved


# ------------------------------------- training curves
def curves_figure(runs):
    lines = {name(run): read_metrics(run) for run in runs}
    keys = [key for key in dict.fromkeys(
        key for rows in lines.values()
        for row in rows for key in row) if key not in SKIP]
    fig, axes = panels(len(keys), "training curves")
    saved = {}
    for ax, key in zip(axes, keys):
        saved[key] = {}
        for run, rows in lines.items():
            points = [[row["epoch"], row[key]]
                      for row in rows if key in row]
            if points:
                ax.plot(*zip(*points), "o-", label=run)
                saved[key][run] = points
        ax.set(title=key, xlabel="epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=7)
    return fig, saved


FIGURES = {"dcl": dcl_figure, "dt": dt_figure,
           "gsg": gsg_figure, "curves": curves_figure}


# --------------------------------------------------- main
def parse_args(argv):
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    a = parser.add_argument
    a("figure", choices=list(FIGURES), help="what to draw")
    a("runs", nargs="*", help="run folders to draw from")
    a("--train", action="store_true",
      help="first train the figure's runs (not curves)")
    a("--runs-dir", default="runs/figures",
      help="--train: its run folders go to RUNS_DIR/FIGURE")
    a("--out", default="benchmarks/figures",
      help="where FIGURE.png and FIGURE.json go")
    args = parser.parse_args(argv[:split])
    args.given = argv[split + 1:]
    if args.train and args.figure == "curves":
        parser.error("--train: dcl, dt or gsg, no curves")
    if not (args.runs or args.train):
        parser.error("give run folders, or --train")
    return args


def train(args):
    """Run the figure's variants through compare.py (each a
    script's real command line) -> their run folders."""
    variants, options = TRAIN[args.figure]
    folder = os.path.join(args.runs_dir, args.figure)
    command = [sys.executable,
               os.path.join(HERE, "compare.py"),
               "--out", folder, "--variants", *variants,
               *QUICK, *options, "--", *args.given]
    if subprocess.run(command).returncode:
        sys.exit(f"a run failed: see its log.txt in {folder}")
    return [os.path.join(folder, v) for v in variants]


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    runs = list(args.runs)
    if args.train:
        runs += train(args)
    fig, saved = FIGURES[args.figure](runs)
    save(fig, saved, args.out, args.figure)


if __name__ == "__main__":
    main()
