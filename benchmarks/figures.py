r"""The papers' figures, drawn by this code at small scale from
run folders (labelled with the paper's figure number, not a
reproduction); each PNG goes to --out (runs/figures; the
committed ones: --out benchmarks/figures) with its data as JSON.

    python benchmarks/figures.py dcl --untrained  # seconds
    python benchmarks/figures.py dcl --train  # DCL Fig. 1
    python benchmarks/figures.py dt --train   # DT Fig. 3
    python benchmarks/figures.py gsg --train  # GSG Figs. 4, 5
    python benchmarks/figures.py curves RUN [RUN ...]

--train first runs the figure's variants by compare.py (the
README's quick-start T, lr 0.3 for every method, kNN each
epoch; options after `--` go last). Each DCL and DT network
is trained once, then evaluated at every batch size, or every
K and tau_beta. GSG's runs without a predictor take 12
epochs, the others 5. MoCo v2 takes --lr 1.0 --key-momentum
0.999 --queue-size 256. In its 3 epochs the loss climbs
toward log(K + 1) = 5.55 (5.17 -> 5.38) while kNN rises from
the untrained 50% to 86%. At m = 0.99 the loss climbs too
(4.09 -> 5.26), and kNN ends at 73%.
"""
import argparse
import importlib
import json
import math
import os
import subprocess
import sys
import textwrap

import torch
import torch.nn.functional as F

try:
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator
except ImportError:  # the training scripts never need it
    Figure = None
DRAW = "figures.py draws with matplotlib: " \
    "pip install -r benchmarks/requirements.txt"

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import common  # noqa: E402

# The README's quick-start T; no figure shows a linear probe.
QUICK = ("--dataset textures --width 8 --batch-size 32 --lr 0.3"
         " --warmup-epochs 0 --epochs 3 --proj-hidden 256"
         " --proj-dim 64 --eval-every 1 --linear-epochs 0").split()
MOCO = "--lr 1.0 --key-momentum 0.999 --queue-size 256"
GSG = ["symmetric", "guided", "random", "reverse"]
# figure -> compare.py's variants and their options
TRAIN = {
    "dcl": (["simclr-infonce", "simclr-dcl"], []),
    "dt": (["mocov2", "simco"],
           ["--no-online-probe", "--per-variant", "mocov2", MOCO]),
    "gsg": ([f"simsiam-{s}" for s in GSG]
            + [f"simsiam-{s}-no-predictor" for s in GSG[:2]],
            ["--epochs", "5", "--limit-train", "1000",
             "--per-variant", "*-no-predictor", "--epochs 12"]),
}
# --untrained: the method file whose network each figure shows
UNTRAINED = {"dcl": "simclr_dcl", "dt": "moco_simmoco_simco"}
SIZES = (32, 64, 128, 256, 512, 1024)
TAUS = (0.05, 0.1, 0.2, 0.5, 1.0)
SKIP = {"epoch", "seconds", "images_per_s", "anchors"}


# ------------ runs
def name(run):
    return os.path.basename(os.path.normpath(run))


def config(run):
    with open(os.path.join(run, "config.json")) as f:
        return json.load(f)


def metrics(run):
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def per_epoch(run, key):
    """[[epoch, value], ...] of one number of metrics.jsonl."""
    return [[m["epoch"], m[key]] for m in metrics(run) if key in m]


def rebuild(run, n):
    """A run's script, options (its parse_args on its recorded
    command line), checkpoint, and two views of its first n
    training images by the script's recipes. `run` a method
    file's name: its network untrained, at the quick start's T."""
    if run in UNTRAINED.values():
        script = importlib.import_module(run)
        args = script.parse_args(QUICK + ["--device", "cpu"])
        state = {"model": None}
    else:
        recorded = config(run)
        script = importlib.import_module(recorded["args"]["script"])
        # The recorded options; a figure's few thousand views need
        # no GPU.
        args = argparse.Namespace(
            **{**recorded["args"], "device": "cpu"})
        path = os.path.join(run, "checkpoint.pt")
        state = torch.load(path, weights_only=True)
    ctx = common.setup(args)
    data = common.load_data(args, ctx)
    args.image_size = data.image_size
    augment = common.Augment(script.recipes(args), data.image_size,
                             data.mean, data.std, ctx)
    generator = torch.Generator().manual_seed(args.seed)
    views = augment(data.train[:n], generator)
    return script, args, state, views


def trained(run, args, *also):
    """'trained once with' the run's --batch-size, --epochs and
    `also` options, for a caption; or 'untrained'."""
    if run in UNTRAINED.values():
        return "untrained"
    keys = ("batch_size", "epochs", *also)
    return "trained once with " + " ".join(
        f"--{key.replace('_', '-')} {getattr(args, key)}"
        for key in keys)


def network(cls, args, state):
    """The run's network; state None: as main() builds it."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args.seed)
        net = cls(args.arch, args.width, args.image_size,
                  args.proj_hidden, args.proj_dim, args.stem_padding)
    if state is not None:
        net.load_state_dict(state)
    # In eval mode a view's projection is the same in any batch,
    # so only the number of negatives changes with the batch.
    return net.eval()


def panels(count, title):
    """A titled figure and its `count` axes, four a row."""
    rows = -(-count // 4)
    width = min(count, 4)
    # At least 8 in wide: the caption's room.
    fig = Figure(figsize=(max(4.2 * width, 8), 3.4 * rows),
                 layout="constrained")
    fig.suptitle(f"{title}: this code at small scale, "
                 f"not a reproduction")
    return fig, [fig.add_subplot(rows, width, i + 1)
                 for i in range(count)]


def doubling_axis(ax, sizes, xlabel):
    """A batch or dictionary size that doubles: a point per size,
    evenly spaced, each labelled."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(n) for n in sizes], fontsize=7)
    ax.set_xlabel(xlabel)


def caption(fig, lines):
    """The measured values, under the panels, each line wrapped
    to the figure's width (not inside an option's name)."""
    width = int(fig.get_figwidth() * 13)  # characters at size 9
    wrapped = [part for line in lines
               for part in textwrap.wrap(line, width,
                                         break_on_hyphens=False)]
    fig.supxlabel("\n".join(wrapped), fontsize=9)
    # A line of size 9 is about 0.15 in: the panels keep theirs.
    fig.set_figheight(fig.get_figheight() + 0.15 * len(wrapped))


def epochs_axis(ax, title, ylabel=None):
    ax.set(title=title, xlabel="epoch", ylabel=ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def save(fig, saved, out, figure):
    for ax in fig.axes:
        labelled = ax.get_legend_handles_labels()[0]
        if labelled and not ax.get_legend():
            ax.legend(fontsize=7)
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, figure)
    fig.savefig(path + ".png", dpi=110)
    with open(path + ".json", "w") as f:
        json.dump(saved, f, indent=1)
    print(f"written: {path}.png and {path}.json")
    print(fig.get_supxlabel())


# ------------ DCL Fig. 1
@torch.no_grad()
def npc_by_batch(run):
    """The run's options, {N: q_B of each anchor of batches of N
    images} by simclr_dcl.npc_multiplier."""
    script, args, state, (x1, x2) = rebuild(run, SIZES[-1])
    model = network(script.SimCLR, args, state["model"])
    z1 = model(x1)  # (n, D)
    z2 = model(x2)  # (n, D)
    q = {}
    for size in [s for s in SIZES if s <= len(z1)]:
        used = len(z1) // size * size
        pairs = zip(z1[:used].split(size), z2[:used].split(size))
        q[size] = torch.cat([
            script.npc_multiplier(a, b, args.temperature)
            for a, b in pairs])  # (2 * used,)
    return args, q


def dcl_figure(runs):
    fig, axes = panels(len(runs) + 2, "DCL Fig. 1")
    axes[-2].set(title="mean <q_B>")
    axes[-1].set(title="C_v = std / mean of q_B")
    saved = {}
    lines = []
    for run, ax in zip(runs, axes):
        args, q = npc_by_batch(run)
        label = f"{name(run)} (--loss {args.loss})"
        # Bins even in q_B up to its bound 1: at this scale most
        # of q_B's range is empty, and the figure shows that.
        low = torch.cat(list(q.values())).min().item()
        edges = torch.linspace(low, 1, 41)
        rows = {}
        for size, values in q.items():
            counts = torch.histogram(values, edges).hist
            share = counts / len(values)
            ax.stairs(share, edges, label=f"N = {size}")
            cv = values.std(correction=0) / values.mean()
            rows[size] = dict(mean=values.mean().item(),
                              cv=cv.item(), share=share.tolist())
        ax.set(xlabel="q_B", title=label,
               ylabel="share of anchors")
        sizes = list(rows)
        for key, side in zip(("mean", "cv"), axes[-2:]):
            side.plot(sizes, [rows[n][key] for n in sizes], "o-",
                      label=label)
        saved[name(run)] = dict(loss=args.loss, batch_sizes=rows,
                                bin_edges=edges.tolist())
        first = rows[sizes[0]]
        last = rows[sizes[-1]]
        lines.append(f"{label}, {trained(run, args)}: from N "
                     f"= {sizes[0]} to {sizes[-1]}, <q_B> "
                     f"{first['mean']:.3f} -> "
                     f"{last['mean']:.3f}, C_v {first['cv']:.3f} "
                     f"-> {last['cv']:.4f}")
    # q_B lies in (0, 1), C_v from 0: both axes start at 0.
    axes[-2].set_ylim(0, 1)
    axes[-2].legend(loc="lower right", fontsize=7)
    axes[-1].set_ylim(bottom=0)
    for ax in axes[-2:]:
        doubling_axis(ax, sizes, "batch size N")
    # DCL Fig. 1(b)'s protocol: one network, each batch size.
    lines.append("Each network evaluated at every N, as DCL Fig. "
                 "1(b) evaluates \"a pre-trained SimCLR baseline "
                 "model\"; networks trained at other N not shown")
    caption(fig, lines)
    return fig, saved


# ------------ DT Fig. 3
@torch.no_grad()
def entropy_by_dictionary(run, anchors=256):
    """The run's options, dictionary sizes K, A and {tau_beta:
    H(r_+) / log A at each K} of A anchors, by the script's
    dual_temperature_loss and anchor_weight_stats."""
    script, args, state, (x1, x2) = rebuild(run, 2048)
    query = network(script.Encoder, args, state["model"])
    # SimCo has no key encoder: its one encoder makes the keys.
    key = network(script.Encoder, args,
                  state.get("key_encoder", state["model"]))
    a = min(anchors, len(x1) // 2)
    # In float64: at a large K every W_i lies closer to 1 than
    # float32 resolves.
    # Encoder -> (projections, backbone features): the first.
    q = query(x1[:a])[0].double()  # (A, D)
    k = key(x2[:a])[0].double()  # (A, D) the positives
    # Other images' keys only: no anchor meets its positive
    # among the negatives.
    keys = F.normalize(key(x2[a:])[0].double(), dim=1)
    sizes = [2 ** i for i in range(17) if 2 ** i <= len(keys)]
    entropy = {}
    for tau in TAUS:
        entropy[tau] = []
        for size in sizes:
            _, w = script.dual_temperature_loss(
                q, k, args.tau_alpha, tau, keys[:size])
            h = script.anchor_weight_stats(*w)[2]
            # log A, the entropy of equal weights, is the most.
            entropy[tau].append(h.item() / math.log(a))
    return args, sizes, a, entropy


def pull(label, sizes, anchors, spread):
    """A caption line: how many anchors carry the pull, from
    {tau_beta: exp(H) at each K}."""
    tau = min(spread)
    fewest = [min(row[i] for row in spread.values())
              for i in range(len(sizes))]
    if min(fewest) >= 0.95 * anchors:
        return (f"{label}: {min(fewest):.0f} to {anchors} of "
                f"{anchors} anchors at every K and tau_beta, "
                f"r_+ uniform at this scale")
    # From which K on 99% of the anchors or more pull, at every
    # tau_beta.
    k, most = next((k, n) for k, n in zip(sizes, fewest)
                   if n >= 0.99 * anchors or k == sizes[-1])
    return (f"{label}: evaluated at K = {sizes[0]}, tau_beta = "
            f"{tau}, {spread[tau][0]:.0f} of {anchors} anchors "
            f"carry the pull; from K = {k}, {most:.0f} or more")


def dt_figure(runs):
    fig, axes = panels(len(runs), "DT Fig. 3")
    saved = {}
    lines = []
    for run, ax in zip(runs, axes):
        args, sizes, anchors, entropy = entropy_by_dictionary(run)
        # exp(H(r_+)): the number of anchors that would carry the
        # pull if they carried it equally; A at most.
        spread = {tau: [anchors ** h for h in row]
                  for tau, row in entropy.items()}
        for tau, row in spread.items():
            ax.plot(sizes, row, "o-", label=f"tau_beta = {tau}")
        ax.set_ylim(0, anchors * 1.05)
        doubling_axis(ax, sizes, "dictionary size K")
        label = f"{name(run)} (--method {args.method})"
        ax.set(ylabel=f"exp(H(r_+)), of {anchors} anchors",
               title=label)
        how = trained(run, args, "tau_beta")
        lines.append(pull(f"{label}, {how}", sizes, anchors,
                          spread))
        saved[name(run)] = dict(dictionary_sizes=sizes,
                                anchors=anchors,
                                normalised_entropy=entropy,
                                effective_anchors=spread)
    lines.append("Each network evaluated at every K and tau_beta; "
                 "networks trained at other values not shown")
    caption(fig, lines)
    return fig, saved


# ------------ GSG Figs. 4, 5
def trend(points):
    """'first -> last' of [[epoch, value], ...], with the peak
    where it lies between them."""
    values = [value for _, value in points]
    text = f"{values[0]:.3g} -> {values[-1]:.3g}"
    epoch, peak = max(points, key=lambda point: point[1])
    if peak > max(values[0], values[-1]):
        text += f" (peak {peak:.3g}, epoch {epoch})"
    return text


def gsg_figure(runs):
    fig, axes = panels(3, "GSG Figs. 4, 5")
    epochs_axis(axes[0], "Fig. 4: with predictor", "kNN top-1 (%)")
    epochs_axis(axes[1], "Fig. 5: no predictor", "kNN top-1 (%)")
    epochs_axis(axes[2], "Fig. 5: no predictor", "proj_std")
    # Accuracy starts at 0.
    axes[0].set_ylim(0, 100)
    axes[1].set_ylim(0, 100)
    saved = {}
    fig4 = []
    fig5 = []
    for run in runs:
        alone = config(run)["args"]["no_predictor"]
        shown = {"knn_top1": axes[0]}
        # Without a predictor the run is Fig. 5's.
        if alone:
            shown = {"knn_top1": axes[1], "proj_std": axes[2]}
        saved[name(run)] = {}
        for key, ax in shown.items():
            points = per_epoch(run, key)
            ax.plot(*zip(*points), "o-", label=name(run))
            saved[name(run)][key] = points
        trends = [f"{key} {trend(points)}"
                  for key, points in saved[name(run)].items()]
        epochs = f"{points[-1][0]} epochs"
        (fig5 if alone else fig4).append(
            f"{name(run)}, {epochs}: " + ", ".join(trends))
    # proj_std 0: all projections the same, a full collapse.
    axes[2].set_ylim(bottom=0)
    lines = ["Fig. 4 (one seed each): " + "; ".join(fig4)]
    lines += [f"Fig. 5: {line}" for line in fig5]
    if fig5:
        # SimSiam Sec. 4.1; the runs share one D.
        dim = config(run)["args"]["proj_dim"]
        lines.append(f"proj_std: 0 if all projections coincide, "
                     f"about 1/sqrt({dim}) = {dim ** -0.5:.3f} "
                     f"if they spread")
        # What a short run can show of Fig. 5's collapse.
        lines.append("A collapse begins as proj_std falls; kNN "
                     "falls to chance later: GSG Sec. 6.2 runs "
                     "CIFAR-10 up to 400 epochs \"to confirm "
                     "complete collapse\"")
    caption(fig, lines)
    return fig, saved


# ------------ training curves
def curves_figure(runs):
    keys = dict.fromkeys(key for run in runs
                         for line in metrics(run) for key in line)
    keys = [key for key in keys if key not in SKIP]
    first = ("loss", "lr", "knn_top1")
    keys.sort(key=lambda key: key not in first)
    fig, axes = panels(len(keys), "training curves")
    saved = {key: {} for key in keys}
    for ax, key in zip(axes, keys):
        epochs_axis(ax, key)
        for run in runs:
            points = per_epoch(run, key)
            if points:
                ax.plot(*zip(*points), "o-", label=name(run))
                saved[key][name(run)] = points
    return fig, saved


FIGURES = {"dcl": dcl_figure, "dt": dt_figure,
           "gsg": gsg_figure, "curves": curves_figure}


# ------------ --untrained
def untrained(args):
    """The figure's quantity for the quick start's network before
    any training, printed, and drawn where matplotlib is."""
    run = UNTRAINED[args.figure]
    print(f"{run}.py's network at the quick start's T, untrained, "
          f"on two views of generated textures:")
    if args.figure == "dcl":
        _, q = npc_by_batch(run)
        print("q_B of each anchor (npc_multiplier) by batch size N"
              "\n  N     <q_B>   C_v     1 - 1/(2N - 1)")
        for n, v in q.items():
            cv = v.std(correction=0) / v.mean()
            print(f"  {n:<5} {v.mean():.4f}  {cv:.4f}  "
                  f"{1 - 1 / (2 * n - 1):.4f}")
        print("A positive no closer than the 2N - 2 negatives gives "
              "q_B = 1 - 1/(2N - 1). Trained once at\nbatch 32 "
              "(--train), positives lie closer: at each N, q_B falls "
              "below that and spreads,\nthe most at small N.")
    else:
        _, sizes, a, entropy = entropy_by_dictionary(run)
        print(f"exp(H(r_+)) / {a}, the share of {a} anchors that "
              f"carry the pull (anchor_weight_stats),\nby tau_beta "
              f"(rows) and dictionary size K\n  K   " + "".join(
                  f"{k:>6}" for k in sizes))
        for tau, row in entropy.items():
            print(f"  {tau:<4}" + "".join(
                f"{a ** h / a:6.3f}" for h in row))
        print("A positive about as close as the K negatives gives "
              "every W_i = 1 - p_+ about K / (K + 1):\nthe anchors "
              "pull alike. Trained once at tau_beta 1.0 (--train), "
              "some positives are easy:\nat a small K and a low "
              "tau_beta, far fewer anchors carry the pull.")
    if Figure is None:
        print(DRAW)
        return
    fig, saved = FIGURES[args.figure]([run])
    fig.suptitle(f"{run}.py's network untrained: not a trained "
                 f"figure")
    save(fig, saved, args.out, f"{args.figure}-untrained")


# ------------ main
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
    a("--untrained", action="store_true",
      help="dcl, dt: the quick start's network untrained, "
           "printed (seconds)")
    a("--runs-dir", default="runs/figures",
      help="--train: its runs go to RUNS_DIR/FIGURE (%(default)s)")
    # The committed figures change only when asked: --out
    # benchmarks/figures.
    a("--out", default="runs/figures",
      help="FIGURE.png and FIGURE.json go here (%(default)s)")
    args = parser.parse_args(argv[:split])
    args.given = argv[split + 1:]
    if args.train and args.figure not in TRAIN:
        parser.error("--train: dcl, dt or gsg, not curves")
    if args.untrained and (args.figure not in UNTRAINED
                           or args.runs or args.train):
        parser.error("--untrained: dcl or dt, alone")
    if not (args.runs or args.train or args.untrained):
        parser.error("give run folders, or --train")
    return args


def train(args):
    """The figure's variants run by compare.py (each through its
    script's real command line) -> their run folders."""
    variants, options = TRAIN[args.figure]
    folder = os.path.join(args.runs_dir, args.figure)
    command = [sys.executable, os.path.join(HERE, "compare.py"),
               "--out", folder, "--variants", *variants,
               *QUICK, *options, "--", *args.given]
    if subprocess.run(command).returncode:
        sys.exit(f"a run failed: see its log.txt in {folder}")
    return [os.path.join(folder, v) for v in variants]


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.untrained:
        return untrained(args)
    if Figure is None:
        sys.exit(DRAW)
    runs = list(args.runs)
    if args.train:
        runs += train(args)
    fig, saved = FIGURES[args.figure](runs)
    save(fig, saved, args.out, args.figure)


if __name__ == "__main__":
    main()
