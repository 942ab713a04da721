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

With `--paper dt|gsg|dcl|dcl-imagenet` it runs that paper's own comparison instead (its rows,
settings and protocol: benchmarks/papers.py) and prints our numbers beside the published ones,
each with its source, the difference and the wall time; `--seeds N` runs each row N times (mean
and spread). Any option that changes the paper's settings (`--epochs`, `--width`, `--dataset
imagefolder`, `--batch-divisor`, ...) is named in the table's header, and the published numbers
are then marked "not comparable":

    python benchmarks/compare.py --paper gsg --gpus 0,1,2,3          # 12 runs, 4 at a time
    python benchmarks/compare.py --paper dt --dataset imagefolder --data-dir D --image-size 8 \
        --width 8 --epochs 1 --batch-divisor 16 --device cpu         # a CPU smoke run

`--gpus 0,1,...` gives each job its own GPU(s) (CUDA_VISIBLE_DEVICES; --nproc of them per job),
`--jobs-per-gpu K` packs K small jobs on each. From each job's first epoch it prints an estimate
of the whole table's time. The exit status is 1 if a run failed.
"""
import argparse
import concurrent.futures
import fnmatch
import json
import os
import queue
import shlex
import subprocess
import sys
import threading
import time

import papers

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


# options that change nothing a run computes; any other option given with --paper is a change of
# the paper's settings, named in the table's header (--eval-every too where the protocol sets it)
NEUTRAL = {"--data-dir", "--workers", "--seed", "--eval-every"}


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     usage="%(prog)s [options] [-- OPTIONS FOR EVERY RUN]")
    a = parser.add_argument
    a("--out", help="one run folder per variant (--paper: per row and seed) goes here (default "
                    "runs/compare; --paper: runs/paper-NAME)")
    a("--paper", choices=list(papers.PAPERS),
      help="run that paper's own comparison (benchmarks/papers.py) instead of the variants")
    a("--variants", nargs="+", default=["*"], metavar="NAME",
      help="names or globs of the variants (--paper: of its rows) to run (default: all, see "
           "--list); each script's untrained row comes with its variants; --paper's table "
           "lists the rows not run as well")
    a("--seeds", type=int, help="--paper: runs of each row, with seeds SEED, SEED+1, ... "
                                "(default: as many as the paper's numbers average)")
    a("--batch-divisor", type=int, default=1, help="--paper: every row's batch size / N, for a "
      "small image folder (a change of the paper's settings, named in the table)")
    a("--per-variant", nargs=2, action="append", default=[], metavar=("GLOB", "OPTIONS"),
      help="more options, one quoted string, for the variants matching GLOB; repeatable")
    a("--list", action="store_true", help="print the selected variants' commands and exit")
    a("--device", default=None, help="cuda or cpu (default: cuda if available)")
    a("--jobs", type=int, default=None,
      help="runs side by side (default: 1 on CUDA, else cores / nproc); on CPU each run gets "
           "cores / (jobs x nproc) threads through OMP_NUM_THREADS")
    a("--gpus", metavar="IDS", help="comma-separated GPU ids, as CUDA_VISIBLE_DEVICES takes "
      "them: each job runs on its own --nproc of them, one job per GPU (group) at a time")
    a("--jobs-per-gpu", type=int, default=None, help="with --gpus: K jobs side by side on each "
      "GPU (group), for runs too small to fill one")
    a("--nproc", type=int, default=1, help="processes per run; above 1, runs start under torchrun")
    for flag, kind, text in SHARED:
        a(flag, type=kind, default=None, help=f"{text} (default: each script's own)")
    extra = []
    if "--" in argv:
        argv, extra = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    args = parser.parse_args(argv)
    args.extra = extra
    for flag in ("--seeds", "--batch-divisor", "--jobs", "--jobs-per-gpu", "--nproc"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and value < 1:
            parser.error(f"{flag} {value}: give a number of at least 1")
    if args.paper is None:
        if args.seeds or args.batch_divisor != 1:
            parser.error("--seeds and --batch-divisor need --paper")
        names = VARIANTS
    else:
        paper = papers.PAPERS[args.paper]
        if args.batch_size is not None:
            parser.error("--paper: each row has its own batch size; --batch-divisor N divides "
                         "them all")
        if args.paper == "dcl-imagenet" and args.data_dir is None:
            parser.error("--paper dcl-imagenet needs --data-dir IMAGENET (its train/ and val/ "
                         "class folders)")
        args.seeds = args.seeds or paper.seeds
        names = paper.rows
    unknown = [p for p in args.variants if not fnmatch.filter(names, p)]
    if unknown:
        parser.error(f"no {'row of --paper ' + args.paper if args.paper else 'variant'} matches "
                     f"{' '.join(unknown)}; there are: {' '.join(names)}")
    args.out = args.out or (f"runs/paper-{args.paper}" if args.paper else "runs/compare")
    if args.jobs_per_gpu and not args.gpus:
        parser.error("--jobs-per-gpu needs --gpus")
    if args.gpus:
        ids = [g.strip() for g in args.gpus.split(",") if g.strip()]
        if args.jobs is not None:
            parser.error("--gpus: the runs side by side are the GPUs x --jobs-per-gpu; drop --jobs")
        if args.device not in (None, "cuda"):
            parser.error(f"--gpus needs --device cuda, not {args.device}")
        if not ids or len(ids) % args.nproc:
            parser.error(f"--gpus {args.gpus}: give a multiple of --nproc {args.nproc} GPU ids")
        groups = [",".join(ids[i:i + args.nproc]) for i in range(0, len(ids), args.nproc)]
        args.slots = groups * (args.jobs_per_gpu or 1)  # one CUDA_VISIBLE_DEVICES per job
        args.device, args.jobs = "cuda", len(args.slots)
    if args.device is None:
        import torch  # only to pick the default device as the scripts do
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.jobs is None:
        cores = os.cpu_count() or 1
        args.jobs = 1 if args.device.startswith("cuda") else max(1, cores // args.nproc)
    if not args.gpus:
        args.slots = [None] * args.jobs  # the environment's own devices
    return args


def launcher(args):
    if args.nproc == 1:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={args.nproc}"]


def shared_options(args, skip=()):
    options = []
    for flag, _, _ in SHARED:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and flag not in skip:
            options += [flag, str(value)]
    return options


def per_variant_options(name, args):
    options = []
    for pattern, text in args.per_variant:
        if fnmatch.fnmatch(name, pattern):
            options += shlex.split(text)
    return options


def command(name, args):
    """One variant's command: shared options, `--` options, --per-variant options, and the
    variant's own options last (argparse keeps the last value, so nothing undoes the variant)."""
    script, own = VARIANTS[name]
    options = ["--device", args.device, "--out", os.path.join(args.out, name)]
    options += shared_options(args) + args.extra + per_variant_options(name, args)
    return launcher(args) + [os.path.join(ROOT, script)] + options + own


def paper_command(name, seed, folder, args):
    """One paper row's command for one seed: the paper's settings, the row's options (its batch
    divided by --batch-divisor), the protocol, the seed, and then the options given here, last so
    that they win: they are the changes the table's header names."""
    paper, protocol = papers.PAPERS[args.paper], papers.PROTOCOLS[args.paper]
    row = paper.rows[name]
    own = list(row.options)
    if "--batch-size" in own:
        at = own.index("--batch-size") + 1
        own[at] = str(max(1, int(own[at]) // args.batch_divisor))
    options = ["--device", args.device, "--out", folder] + paper.settings + own
    options += protocol.options + ["--seed", str(seed)] + shared_options(args, skip={"--seed"})
    options += args.extra + per_variant_options(name, args)
    return launcher(args) + [os.path.join(ROOT, row.script)] + options


def jobs(args):
    """Every run, as {name, row, seed, folder, command}: one per variant (each script's untrained
    row before its variants), or with --paper one per selected row and seed."""
    selected = lambda name: any(fnmatch.fnmatch(name, p) for p in args.variants)  # noqa: E731
    if args.paper is None:
        chosen = {name for name in VARIANTS if selected(name)}
        scripts = {VARIANTS[name][0] for name in chosen}  # their untrained rows come along
        names = [name for name, (script, _) in VARIANTS.items()
                 if name in chosen or name.startswith("untrained-") and script in scripts]
        return [{"name": name, "row": name, "seed": None, "folder": os.path.join(args.out, name),
                 "command": command(name, args)} for name in names]
    first = args.seed or 0
    todo = []
    for name in filter(selected, papers.PAPERS[args.paper].rows):
        for seed in range(first, first + args.seeds):
            folder = os.path.join(args.out, name, f"seed{seed}")
            todo.append({"name": f"{name}/seed{seed}", "row": name, "seed": seed,
                         "folder": folder, "command": paper_command(name, seed, folder, args)})
    return todo


def option_values(options):
    """{flag: value} of a command line's options ('' for a flag without a value)."""
    values = {}
    for i, token in enumerate(options):
        if token.startswith("--"):
            following = options[i + 1] if i + 1 < len(options) else "--"
            values[token] = "" if following.startswith("--") else following
    return values


def changes(args):
    """The options given that change the paper's settings or protocol, for the table's header;
    none: the rows ran at the paper's full scale."""
    paper, protocol = papers.PAPERS[args.paper], papers.PROTOCOLS[args.paper]
    fixed = option_values(paper.settings + protocol.options)
    given = option_values(shared_options(args))
    found = [f"{flag} {value}" for flag, value in given.items()
             if fixed.get(flag) != value and (flag not in NEUTRAL or flag in fixed)]
    if "--data-dir" in given and given.get("--dataset", fixed.get("--dataset")) != \
            fixed.get("--dataset"):  # the folder of a data set that is not the paper's
        found.append(f"--data-dir {given['--data-dir']}")
    if args.batch_divisor != 1:
        found.append(f"--batch-divisor {args.batch_divisor}")
    found += [f"--per-variant {shlex.quote(glob)} {shlex.quote(text)}"
              for glob, text in args.per_variant]
    return found + (["--"] + args.extra if args.extra else [])


class Progress:
    """An estimate of the whole table's time: each finished job's wall time and, for each
    running job, its time to its first epoch's metrics line plus (epochs - 1) x that epoch's
    training seconds (later evaluations and the final probe are not counted); jobs not timed yet
    count at the mean of those that are, `slots` at a time."""

    def __init__(self, total, slots):
        self.total, self.slots, self.times, self.lock = total, slots, {}, threading.Lock()

    def finished(self, name, wall_s):
        if wall_s is not None:
            with self.lock:
                self.times[name] = wall_s

    def first_epoch(self, name, folder, elapsed):
        """Read the first metrics line of a running job; returns whether there was one."""
        try:
            with open(os.path.join(folder, "metrics.jsonl")) as f:
                first = f.readline()
            seconds = json.loads(first)["seconds"]
            epochs = read_json(os.path.join(folder, "config.json"))["args"]["epochs"]
        except (OSError, ValueError, KeyError, TypeError):
            return False  # not written yet (or half written)
        estimate = elapsed + (epochs - 1) * seconds
        with self.lock:
            self.times[name] = estimate
            mean = sum(self.times.values()) / len(self.times)
            table = (sum(self.times.values()) + mean * (self.total - len(self.times))) / self.slots
            timed = len(self.times)
        print(f"estimate: {name} about {papers.duration(estimate)} (first epoch "
              f"{seconds:.0f} s of {epochs}); the table about {papers.duration(table)}, "
              f"{self.slots} at a time ({timed} of {self.total} jobs timed, the others counted "
              f"at their mean; evaluations after epoch 1 not counted)", flush=True)
        return True


def run(job, args, slots, progress):
    """Run one job unless its folder already holds results.json, on a free slot of `slots` (its
    GPUs, given to it as CUDA_VISIBLE_DEVICES); writes its runner.json."""
    name, folder = job["name"], job["folder"]
    if os.path.isfile(os.path.join(folder, "results.json")):
        progress.finished(name, read_json(os.path.join(folder, "runner.json")).get("wall_s"))
        return
    cmd = list(job["command"])
    resuming = os.path.isfile(os.path.join(folder, "checkpoint.pt"))
    if resuming:  # interrupted: continue bit for bit (the script refuses changed options)
        cmd += ["--resume", folder]
    os.makedirs(folder, exist_ok=True)
    slot = slots.get()
    try:
        env = dict(os.environ)
        if slot is not None:
            env["CUDA_VISIBLE_DEVICES"] = slot
        elif not args.device.startswith("cuda") and "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // (args.jobs * args.nproc)))
        where = f" on GPU {slot}" if slot is not None else ""
        print(f"{name}: {'resuming' if resuming else 'starting'}{where}: {shlex.join(cmd)}",
              flush=True)
        start = time.perf_counter()
        timed = resuming  # a resumed run's first metrics line is an old epoch's
        with open(os.path.join(folder, "log.txt"), "a") as log:
            process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            while True:
                try:
                    returncode = process.wait(timeout=2)
                    break
                except subprocess.TimeoutExpired:
                    timed = timed or progress.first_epoch(name, folder,
                                                          time.perf_counter() - start)
    finally:
        slots.put(slot)
    record = {"command": cmd, "returncode": returncode, "wall_s": time.perf_counter() - start}
    if resuming:  # the whole run's wall time, not only its last part's
        record["wall_s"] += read_json(os.path.join(folder, "runner.json")).get("wall_s", 0.0)
    if returncode != 0:
        record["error"] = error_line(os.path.join(folder, "log.txt"))
    with open(os.path.join(folder, "runner.json"), "w") as f:
        json.dump(record, f, indent=2)
    progress.finished(name, record["wall_s"])
    print(f"{name}: {record.get('error', 'done')} ({record['wall_s']:.0f} s)", flush=True)


def error_line(log_path):
    """The script's `error: ...` line, else the last line it printed (a traceback's exception)."""
    with open(log_path, errors="replace") as f:
        lines = [line.strip() for line in f.read().replace("\r", "\n").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error")]
    return errors[-1] if errors else (lines[-1] if lines else "exited without output")


read_json = papers.read_json


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
    todo = jobs(args)
    if args.list:
        for job in todo:
            print(f"{job['name']}: {shlex.join(job['command'])}")
        return 0
    os.makedirs(args.out, exist_ok=True)
    slots = queue.Queue()
    for slot in args.slots:
        slots.put(slot)
    progress = Progress(len(todo), len(args.slots))
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:  # threads wait on subprocesses
        list(pool.map(lambda job: run(job, args, slots, progress), todo))
    if args.paper is None:
        rows = [row(job["name"], job["folder"]) for job in todo]
        text = table(rows)
    else:
        runs = {}  # row -> its seeds' runs: folder, seed, wall_s, error
        for job in todo:
            runs.setdefault(job["row"], []).append(dict(job, **row(job["name"], job["folder"])))
        found = changes(args)
        comparable = not found and papers.PROTOCOLS[args.paper].authors
        first = args.seed or 0
        lines = papers.table_rows(args.paper, runs, comparable, args.batch_divisor)
        text = papers.table(args.paper, lines, found, range(first, first + args.seeds))
        rows = {"paper": args.paper, "changes": found, "comparable": comparable, "rows": lines}
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "rows.json"), "w") as f:
        json.dump(rows, f, indent=2)
    print(text)
    print(f"written: {os.path.join(args.out, 'table.md')} and rows.json")
    failed = [job["name"] for job in todo
              if not os.path.isfile(os.path.join(job["folder"], "results.json"))]
    return 1 if failed else 0  # the exit status: a run failed (the table shows its error)


if __name__ == "__main__":
    sys.exit(main())
