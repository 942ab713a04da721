r"""Run this project's method variants, or one paper's own comparison, and print one table.

Each run is a method script's real command line, given every option not in --help, in its own
folder under --out; a paper's linear evaluation then runs on it (linear_eval.py). Plain: a row per
variant, after its script's untrained row (--epochs 0). --paper NAME: that paper's rows, settings
and protocol (papers.py), ours over --seeds runs beside each published number, its source and the
difference ("not comparable" where an option changes the paper's settings).

    python benchmarks/compare.py --dataset textures --epochs 2 --width 8 --device cpu \
        --jobs 2                                                    # CPU: 2 runs side by side
    python benchmarks/compare.py --nproc 8 --dataset cifar100       # each run on 8 GPUs (torchrun)
    python benchmarks/compare.py --paper gsg --gpus 0,1,2,3          # 12 runs, 4 at a time
    python benchmarks/compare.py --paper dt --dataset imagefolder --data-dir D --image-size 8 \
        --width 8 --epochs 1 --batch-divisor 16 --device cpu         # a CPU smoke run

Writes OUT/table.md and OUT/rows.json. A second call reuses what a run's folder holds
(results.json, linear_NAME.json) and continues an interrupted run. Exit status 1: a run failed.
"""
import argparse
import concurrent.futures
import fnmatch
import json
import os
import queue
import shlex
import statistics
import subprocess
import sys

import papers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> (script, its options). Each script's variants follow its untrained row (--epochs 0): the
# scripts' ResNets do not all start alike (SimSiam/BYOL zero the residual branches' last BN).
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

# options that change nothing a run computes; any other option given with --paper is a change of
# the paper's settings, named in the table's header (--eval-every too where the protocol sets it)
NEUTRAL = {"--data-dir", "--workers", "--seed", "--eval-every", "--device"}


def parse_args(argv):
    """compare.py's own options; the others (and all after `--`) go to every run: args.given."""
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,  # --seed: a run's
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    a = parser.add_argument
    a("--out", help="a folder per run goes here (default runs/compare, --paper: runs/paper-NAME)")
    a("--paper", choices=list(papers.PAPERS), help="run that paper's comparison instead")
    a("--variants", nargs="+", default=["*"], metavar="GLOB", help="the variants (rows) to run")
    a("--seeds", type=int, help="--paper: runs per row, from --seed on (default: the paper's)")
    a("--batch-divisor", type=int, default=1, help="--paper: run each row at its batch size / N")
    a("--per-variant", nargs=2, action="append", default=[], metavar=("GLOB", "OPTIONS"),
      help="more options, one quoted string, for the runs matching GLOB; repeatable")
    a("--jobs", type=int, default=1, help="runs side by side on the devices the runs see")
    a("--gpus", help="comma-separated GPU ids; each run gets --nproc of them")
    a("--jobs-per-gpu", type=int, default=1, help="with --gpus: runs side by side on each GPU")
    a("--nproc", type=int, default=1, help="processes per run; above 1, under torchrun")
    split = argv.index("--") if "--" in argv else len(argv)
    args, given = parser.parse_known_args(argv[:split])
    args.given = given + argv[split + 1:]
    if args.paper and "--batch-size" in args.given:
        parser.error("--paper: each row has its own batch size; --batch-divisor N divides them")
    ids = args.gpus.split(",") if args.gpus else []
    if ids and (len(ids) % args.nproc or args.jobs > 1) or args.jobs_per_gpu > 1 and not ids:
        parser.error("--gpus takes a multiple of --nproc GPU ids; --jobs-per-gpu needs --gpus")
    groups = [",".join(ids[i:i + args.nproc]) for i in range(0, len(ids), args.nproc)]
    args.slots = groups * args.jobs_per_gpu or [None] * args.jobs  # a run's GPUs; None: all
    args.given += ["--device", "cuda"] if ids else []
    args.out = args.out or (f"runs/paper-{args.paper}" if args.paper else "runs/compare")
    return args


def values(options):
    """{flag: value} of a command line's options ("" for a flag without one)."""
    pairs = zip(options, options[1:] + ["--"])
    return {flag: "" if v.startswith("--") else v for flag, v in pairs if flag.startswith("--")}


def runs(args):
    """Every run: each selected variant after its script's untrained row, its options last (a
    script keeps an option's last value: nothing undoes them); or each paper row and seed, the
    paper's settings first (the options given here change them) and the seed last."""
    def chosen(name):
        return any(fnmatch.fnmatch(name, glob) for glob in args.variants)
    given = values(args.given)
    if args.paper:  # (name, row, seed, script, options first, options last)
        paper, protocol = papers.PAPERS[args.paper], papers.PROTOCOLS[args.paper]
        first_seed = int(given.get("--seed", 0))
        plan = [(f"{name}/seed{seed}", name, seed, row.script, paper.settings + row.options
                 + ["--batch-size", batch(row, args)] + protocol.options, ["--seed", str(seed)])
                for name, row in paper.rows.items() if chosen(name)
                for seed in range(first_seed, first_seed + (args.seeds or paper.seeds))]
    else:
        scripts = {script for name, (script, _) in VARIANTS.items() if chosen(name)}
        plan = [(name, name, None, script, [], own) for name, (script, own) in VARIANTS.items()
                if chosen(name) or name.startswith("untrained-") and script in scripts]
    launcher = [sys.executable] + ["-m", "torch.distributed.run", "--standalone",
                                   f"--nproc_per_node={args.nproc}"] * (args.nproc > 1)
    linear = args.paper and papers.PROTOCOLS[args.paper].linear
    # linear_eval.py gets the options that change nothing, and --linear-epochs as its --epochs
    evaluation = [t for flag in ("--data-dir", "--workers", "--device") if flag in given
                  for t in (flag, given[flag])]
    if given.get("--linear-epochs", "0") != "0":
        evaluation += ["--epochs", given["--linear-epochs"]]
    todo = []
    for name, row, seed, script, first, last in plan:
        more = [token for glob, text in args.per_variant if fnmatch.fnmatch(row, glob)
                for token in shlex.split(text)]
        folder = os.path.join(args.out, name)
        command = [os.path.join(ROOT, script), "--out", folder, *first, *args.given, *more, *last]
        commands = {"results.json": launcher + command}  # by the file each writes
        if linear:
            commands[f"linear_{linear}.json"] = launcher + [
                os.path.join(ROOT, "benchmarks", "linear_eval.py"), folder, "--protocol", linear,
                *evaluation]
        todo.append(dict(name=name, row=row, seed=seed, folder=folder, commands=commands,
                         linear=linear))
    return todo


def batch(row, args):
    """A paper row's batch size divided by --batch-divisor (at least 1)."""
    return str(max(1, int(values(row.options)["--batch-size"]) // args.batch_divisor))


def run(job, args, slots):
    """Run a job's commands on a free slot (its GPUs), each unless its folder holds the file it
    writes (reused)."""
    folder = job["folder"]
    commands = [cmd for file, cmd in job["commands"].items()
                if not os.path.isfile(os.path.join(folder, file))]
    if not commands:
        return
    os.makedirs(folder, exist_ok=True)
    env, slot = dict(os.environ), slots.get()
    # the cores shared out between the runs side by side, else each run's torch takes them all
    env.setdefault("OMP_NUM_THREADS", str(max(1, os.cpu_count() // len(args.slots))))
    if slot is not None:
        env["CUDA_VISIBLE_DEVICES"] = slot
    where = "" if slot is None else f" on GPU {slot}"
    try:
        with open(os.path.join(folder, "log.txt"), "a") as log:
            for cmd in commands:
                print(f"{job['name']}{where}: {shlex.join(cmd)}")
                if subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env).wait():
                    break  # a failed run has nothing to evaluate
    finally:  # the slot back even if the run could not start: the other threads wait for it
        slots.put(slot)
    print(f"{job['name']}: {numbers(job)['error'] or 'done'}", flush=True)


def numbers(job):
    """A job's numbers: results.json's, its last epoch's, the best kNN of any epoch (as lightly
    reports), linear_eval.py's; if it failed, its `error:` line, else its log's last line."""
    folder = job["folder"]
    try:
        with open(os.path.join(folder, "results.json")) as f:
            results = json.load(f)
        if job["linear"]:
            with open(os.path.join(folder, f"linear_{job['linear']}.json")) as f:
                results["linear_top1"] = json.load(f)["linear_top1"]
    except (OSError, ValueError):  # not written (a failed run), or half written
        with open(os.path.join(folder, "log.txt"), errors="replace") as f:  # \r: progress bars
            lines = [line.strip() for line in f.read().replace("\r", "\n").splitlines()
                     if line.strip()]
        errors = [line for line in lines if line.startswith("error")] or lines or ["no output"]
        return {"error": errors[-1]}
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        epochs = [json.loads(line) for line in f if line.strip()]
    knn = [line["knn_top1"] for line in epochs + [results] if line.get("knn_top1") is not None]
    return dict(epochs[-1] if epochs else {}, **results, knn_top1_best=max(knn, default=None),
                error=None)


def cell(value, form):
    return "" if value is None else form.format(value)


def markdown(header, rows):
    lines = [header, ["---"] * len(header)] + rows
    return "\n".join("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"
                     for cells in lines)


def variants_table(todo):
    """rows.json's rows and the table: a row per variant."""
    rows = [dict(numbers(job), variant=job["name"]) for job in todo]
    columns = {"knn_top1": "{:.1f}", "knn_k1_top1": "{:.1f}", "linear_top1": "{:.1f}",
               "loss": "{:.4f}", "proj_std": "{:.4f}", "images_per_s": "{:,.0f}", "error": "{}"}
    cells = [[row["variant"]] + [cell(row.get(key), form) for key, form in columns.items()]
             for row in rows]
    return rows, markdown(["variant", *columns], cells)


def changes(args):
    """The options given that change the paper's settings or protocol (none: full scale)."""
    paper = values(papers.PAPERS[args.paper].settings + papers.PROTOCOLS[args.paper].options)
    ours = values(args.given)
    other_data = ours.get("--dataset", paper["--dataset"]) != paper["--dataset"]
    found = [f"{flag} {value}".strip() for flag, value in ours.items() if paper.get(flag) != value
             and (flag not in NEUTRAL or flag in paper or flag == "--data-dir" and other_data)]
    found += [f"--batch-divisor {args.batch_divisor}"] * (args.batch_divisor > 1)
    return found + [f"--per-variant {shlex.quote(g)} {shlex.quote(t)}" for g, t in args.per_variant]


def paper_line(row, metric, runs, comparable):
    """A row's line for one metric: ours (mean, sd, n of the seeds that finished), theirs, diff."""
    seeds = {run["seed"]: run.get(metric) for run in runs}
    ours = [value for value in seeds.values() if value is not None]
    mean = statistics.fmean(ours) if ours else None
    published = row.published.get(metric, papers.Published(None, None))
    comparable = bool(comparable and published.value is not None)
    return dict(metric=metric, ours=mean, ours_n=len(ours), ours_seeds=seeds,
                ours_spread=statistics.stdev(ours) if len(ours) > 1 else None,
                published=published.value, published_spread=published.spread,
                source=published.source, comparable=comparable, ran=bool(runs),
                diff=mean - published.value if comparable and ours else None,
                error=next((run["error"] for run in runs if run["error"]), None))


def paper_table(args, todo):
    """rows.json's content and the table: a header naming the paper's settings, protocol and any
    change of scale, a line per row and metric, then the sources."""
    paper, protocol, found = papers.PAPERS[args.paper], papers.PROTOCOLS[args.paper], changes(args)
    comparable = not found and protocol.authors
    lines, cells = [], []
    for name, row in paper.rows.items():
        runs = [dict(numbers(j), seed=j["seed"]) for j in todo if j["row"] == name]
        settings = " ".join(row.options)
        settings += f" (run at {batch(row, args)})" if args.batch_divisor > 1 else ""
        for metric in row.metrics or protocol.metrics:
            line = dict(row=name, settings=settings, **paper_line(row, metric, runs, comparable))
            ours = "not run" if not runs else "" if line["ours"] is None else (
                f"{line['ours']:.2f}{cell(line['ours_spread'], ' ± {:.2f}')} (n={line['ours_n']})")
            theirs = cell(line["published"], "{:.2f}")
            theirs += cell(line["published_spread"], " ± {:.2f}")
            off = "not comparable" if theirs and not line["comparable"] else ""
            diff = cell(line["diff"], "{:+.2f}") or off
            lines.append(line)
            cells.append([name, f"`{settings}`", metric, ours, theirs, line["source"] or "", diff,
                          line["error"] or ""])
    scale = "Full scale: the paper's settings and protocol." if comparable else "**" + (
        f"Changed from the paper's settings: `{' '.join(found)}`. This is not a reproduction"
        if found else "Full scale, but by a stand-in protocol") + ": not comparable to the paper.**"
    header = ["row", "settings", "metric", "ours", "published", "source", "diff", "error"]
    text = [f"## `--paper {args.paper}`: {paper.title}", "", f"Paper's settings: {paper.text}. "
            f"Protocol: {protocol.text}.", "", scale, "", markdown(header, cells), ""]
    text += [f"- {key}: {source}." for key, source in papers.SOURCES.items()
             if key in {line["source"] for line in lines}]
    saved = {"paper": args.paper, "changes": found, "comparable": comparable, "rows": lines}
    return saved, "\n".join(text)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    todo = runs(args)
    os.makedirs(args.out, exist_ok=True)
    slots = queue.Queue()
    for slot in args.slots:
        slots.put(slot)
    with concurrent.futures.ThreadPoolExecutor(len(args.slots)) as pool:  # each waits on its run
        list(pool.map(lambda job: run(job, args, slots), todo))
    saved, text = paper_table(args, todo) if args.paper else variants_table(todo)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "rows.json"), "w") as f:
        json.dump(saved, f, indent=2)
    print(f"{text}\nwritten: {os.path.join(args.out, 'table.md')} and rows.json")
    return 1 if any(numbers(job)["error"] for job in todo) else 0  # a run failed


if __name__ == "__main__":
    sys.exit(main())
