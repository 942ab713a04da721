r"""Run every method variant of this project on one data set and print one comparison table.

Each variant is one run of a method script through its real command line, with that script's
defaults unless an option below overrides them, in its own folder under --out. The table has a
row per variant: kNN top-1 (k=200 and k=1), linear probe top-1, the last epoch's loss, the
collapse diagnostic proj_std (SimSiam / BYOL), images/s and wall time; and before each script's
variants its `untrained-SCRIPT` row, the same network evaluated before any step (--epochs 0), the
floor for their numbers. The table also goes to OUT/table.md, its rows to OUT/rows.json. A second
call with the same --out reuses every finished run (its folder holds results.json) and continues
an interrupted one from its checkpoint.

    python benchmarks/compare.py --dataset imagefolder --data-dir D --epochs 2 --width 8 \
        --device cpu                                                # CPU: runs side by side
    python benchmarks/compare.py --dataset cifar10 --out runs/c10   # one GPU, one run at a time
    python benchmarks/compare.py --nproc 8 --dataset cifar100       # each run on 8 GPUs (torchrun)
    python benchmarks/compare.py --list --variants 'simsiam-*'      # names and commands only

Options after `--` go to every run (`-- --proj-dim 64`); `--per-variant GLOB OPTIONS` gives options
to the variants matching GLOB only (`--per-variant 'mocov2*' '--queue-size 4096'`).
"""
import argparse
import concurrent.futures
import fnmatch
import json
import os
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> (script, the options that make the variant). Each script's variants follow its untrained
# row, the same network evaluated before any step: the scripts' ResNets do not all start alike
# (SimSiam/BYOL zero-initialise the residual branches, as SimSiam's builder does).
VARIANTS = {"untrained-simclr_dcl": ("simclr_dcl.py", ["--epochs", "0"])}
for loss in ("infonce", "dcl", "dclw"):
    VARIANTS[f"simclr-{loss}"] = ("simclr_dcl.py", ["--loss", loss])
VARIANTS["untrained-moco_simmoco_simco"] = ("moco_simmoco_simco.py", ["--epochs", "0"])
for method in ("mocov2", "simmoco"):
    VARIANTS[method] = ("moco_simmoco_simco.py", ["--method", method])
    VARIANTS[f"{method}-symmetric"] = ("moco_simmoco_simco.py", ["--method", method, "--symmetric"])
VARIANTS["simco"] = ("moco_simmoco_simco.py", ["--method", "simco"])
VARIANTS["untrained-simsiam_byol_gsg"] = ("simsiam_byol_gsg.py", ["--epochs", "0"])
for method in ("simsiam", "byol"):
    for stopgrad in ("symmetric", "guided", "random", "reverse"):
        VARIANTS[f"{method}-{stopgrad}"] = ("simsiam_byol_gsg.py",
                                             ["--method", method, "--stopgrad", stopgrad])
for stopgrad in ("symmetric", "guided"):
    VARIANTS[f"simsiam-{stopgrad}-no-predictor"] = (
        "simsiam_byol_gsg.py", ["--method", "simsiam", "--stopgrad", stopgrad, "--no-predictor"])
VARIANTS["untrained-nnclr_dcl"] = ("nnclr_dcl.py", ["--epochs", "0"])
for loss in ("infonce", "dcl", "dclw"):
    VARIANTS[f"nnclr-{loss}"] = ("nnclr_dcl.py", ["--loss", loss])

# passed to every run when given; left out, each script keeps its own default
SHARED = [("--dataset", str, "cifar10, cifar100, stl10 or imagefolder"),
          ("--data-dir", str, "where the data set lives"),
          ("--image-size", int, "side of the training images"),
          ("--arch", str, "resnet18, resnet34 or resnet50"),
          ("--width", int, "base channel count of the ResNet (64 = standard)"),
          ("--epochs", int, "pre-training epochs of every trained variant"),
          ("--batch-size", int, "global batch"),
          ("--lr", float, "base learning rate per 256 images"),
          ("--seed", int, "random seed (model init, data order, augmentation)"),
          ("--workers", int, "DataLoader workers for decoding"),
          ("--linear-epochs", int, "epochs of the final linear probe"),
          ("--limit-train", int, "use only the first N training images"),
          ("--eval-every", int, "kNN monitor every N epochs")]


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     usage="%(prog)s [options] [-- OPTIONS FOR EVERY RUN]")
    a = parser.add_argument
    a("--out", default="runs/compare", help="one run folder per variant goes here (%(default)s)")
    a("--variants", nargs="+", default=["*"], metavar="NAME",
      help="names or globs of the variants to run (default: all, see --list); each "
           "script's untrained row comes with its variants")
    a("--per-variant", nargs=2, action="append", default=[], metavar=("GLOB", "OPTIONS"),
      help="more options, one quoted string, for the variants matching GLOB; repeatable")
    a("--list", action="store_true", help="print the selected variants' commands and exit")
    a("--device", default=None, help="cuda or cpu (default: cuda if available)")
    a("--jobs", type=int, default=None,
      help="runs side by side (default: 1 on CUDA, else cores / nproc); on CPU each run gets "
           "cores / (jobs x nproc) threads through OMP_NUM_THREADS")
    a("--nproc", type=int, default=1, help="processes per run; above 1, runs start under torchrun")
    for flag, kind, text in SHARED:
        a(flag, type=kind, default=None, help=f"{text} (default: each script's own)")
    extra = []
    if "--" in argv:
        argv, extra = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    args = parser.parse_args(argv)
    args.extra = extra
    unknown = [p for p in args.variants if not fnmatch.filter(VARIANTS, p)]
    if unknown:
        parser.error(f"no variant matches {' '.join(unknown)}; there are: {' '.join(VARIANTS)}")
    if args.device is None:
        import torch  # only to pick the default device as the scripts do
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.jobs is None:
        cores = os.cpu_count() or 1
        args.jobs = 1 if args.device.startswith("cuda") else max(1, cores // args.nproc)
    return args


def command(name, args):
    """One variant's command: shared options, `--` options, --per-variant options, and the
    variant's own options last (argparse keeps the last value, so nothing undoes the variant)."""
    script, own = VARIANTS[name]
    launcher = [sys.executable]
    if args.nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone",
                     f"--nproc_per_node={args.nproc}"]
    options = ["--device", args.device, "--out", os.path.join(args.out, name)]
    for flag, _, _ in SHARED:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            options += [flag, str(value)]
    options += args.extra
    for pattern, text in args.per_variant:
        if fnmatch.fnmatch(name, pattern):
            options += shlex.split(text)
    return launcher + [os.path.join(ROOT, script)] + options + own


def run(name, args):
    """Run one variant unless its folder already holds results.json; returns its table row."""
    folder = os.path.join(args.out, name)
    if os.path.isfile(os.path.join(folder, "results.json")):
        return row(name, folder)
    cmd = command(name, args)
    resuming = os.path.isfile(os.path.join(folder, "checkpoint.pt"))
    if resuming:  # interrupted: continue bit for bit (the script refuses changed options)
        cmd += ["--resume", folder]
    os.makedirs(folder, exist_ok=True)
    env = dict(os.environ)
    if not args.device.startswith("cuda") and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // (args.jobs * args.nproc)))
    print(f"{name}: {'resuming' if resuming else 'starting'}: {shlex.join(cmd)}", flush=True)
    start = time.perf_counter()
    with open(os.path.join(folder, "log.txt"), "a") as log:
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    record = {"command": cmd, "returncode": done.returncode, "wall_s": time.perf_counter() - start}
    if resuming:  # the whole run's wall time, not only its last part's
        record["wall_s"] += read_json(os.path.join(folder, "runner.json")).get("wall_s", 0.0)
    if done.returncode != 0:
        record["error"] = error_line(os.path.join(folder, "log.txt"))
    with open(os.path.join(folder, "runner.json"), "w") as f:
        json.dump(record, f, indent=2)
    print(f"{name}: {record.get('error', 'done')} ({record['wall_s']:.0f} s)", flush=True)
    return row(name, folder)


def error_line(log_path):
    """The script's `error: ...` line, else the last line it printed (a traceback's exception)."""
    with open(log_path, errors="replace") as f:
        lines = [line.strip() for line in f.read().replace("\r", "\n").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error")]
    return errors[-1] if errors else (lines[-1] if lines else "exited without output")


def read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def row(name, folder):
    """A table row from a run folder: results.json, metrics.jsonl's last line, runner.json."""
    results = read_json(os.path.join(folder, "results.json"))
    runner = read_json(os.path.join(folder, "runner.json"))
    last = {}
    if os.path.isfile(os.path.join(folder, "metrics.jsonl")):
        with open(os.path.join(folder, "metrics.jsonl")) as f:
            lines = [line for line in f if line.strip()]
        last = json.loads(lines[-1]) if lines else {}
    error = None if results else runner.get("error", "no results.json: the run did not finish")
    return {"variant": name, "knn_top1": results.get("knn_top1"), "knn_k": results.get("knn_k"),
            "knn_k1_top1": results.get("knn_k1_top1"), "linear_top1": results.get("linear_top1"),
            "loss": last.get("loss"), "proj_std": last.get("proj_std"),
            "images_per_s": last.get("images_per_s"), "wall_s": runner.get("wall_s"),
            "error": error}


def table(rows):
    """Markdown: one row per variant, an error column only if a run failed."""
    k = next((r["knn_k"] for r in rows if r["knn_k"]), 200)
    columns = [(f"kNN k={k}", "knn_top1", "{:.1f}"), ("kNN k=1", "knn_k1_top1", "{:.1f}"),
               ("linear", "linear_top1", "{:.1f}"), ("last loss", "loss", "{:.4f}"),
               ("proj_std", "proj_std", "{:.4f}"), ("images/s", "images_per_s", "{:,.0f}"),
               ("wall s", "wall_s", "{:.0f}")]
    failed = any(r["error"] for r in rows)
    header = ["variant"] + [c[0] for c in columns] + ["error"] * failed
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for r in rows:
        cells = [r["variant"]] + [form.format(r[key]) if r[key] is not None else ""
                                  for _, key, form in columns]
        if failed:
            cells.append((r["error"] or "").replace("|", "\\|"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    chosen = {name for name in VARIANTS if any(fnmatch.fnmatch(name, p) for p in args.variants)}
    scripts = {VARIANTS[name][0] for name in chosen}  # their untrained rows come along
    names = [name for name, (script, _) in VARIANTS.items()
             if name in chosen or name.startswith("untrained-") and script in scripts]
    if args.list:
        for name in names:
            print(f"{name}: {shlex.join(command(name, args))}")
        return
    os.makedirs(args.out, exist_ok=True)
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:  # threads wait on subprocesses
        rows = list(pool.map(lambda name: run(name, args), names))
    text = table(rows)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "rows.json"), "w") as f:
        json.dump(rows, f, indent=2)
    print(text)
    print(f"written: {os.path.join(args.out, 'table.md')} and rows.json")


if __name__ == "__main__":
    main()
