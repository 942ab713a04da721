"""benchmarks/compare.py --paper: each paper's table beside the published numbers (every one, with
its source; "not comparable" at reduced scale; seeds' mean and spread; linear_eval.py after each
run), and jobs placed on GPUs (--gpus, --jobs-per-gpu) through CUDA_VISIBLE_DEVICES."""
import concurrent.futures
import json
import os
import subprocess
import sys
import threading
import time

import pytest

from helpers import ROOT, tiny_image_folder

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import compare  # noqa: E402
import papers  # noqa: E402

# The published numbers as their sources print them (not read from papers.py, which they check).
DT = {"mocov2": (52.58, 54.40, 53.28, 51.47, 48.90), "simmoco": (54.02, 54.93, 54.11, 52.45, 49.70),
      "simco": (58.04, 58.29, 58.35, 57.08, 55.34)}  # batch 64, 128, 256, 512, 1024
GSG = {"simsiam-symmetric": (77.0, 82.7), "simsiam-guided": (82.2, 86.4),
       "byol-symmetric": (85.4, 88.0), "byol-guided": (89.4, 90.3)}  # kNN k=1, linear
LIGHTLY = {"simclr-infonce-b128": 84.7, "simclr-infonce-b512": 84.8, "simclr-dcl-b128": 84.4,
           "simclr-dcl-b512": 84.0, "simclr-dclw-b128": 83.3, "simclr-dclw-b512": 82.4}
DCL_IMAGENET = {"simclr-infonce-e200": 61.8, "simclr-dcl-e200": 68.2}


def published(paper):
    """(row, metric) -> (number, source key) that the paper's table must carry."""
    if paper == "dt":
        # the README names neither probe: each of ours that exists faces the number
        return {(f"{m}-b{b}", metric): (v, "DT README")
                for m, values in DT.items() for b, v in zip((64, 128, 256, 512, 1024), values)
                for metric in ("online_top1", "momentum_online_top1")[:1 if m == "simco" else 2]}
    if paper == "gsg":
        return {(row, metric): (v, "GSG Table 1") for row, values in GSG.items()
                for metric, v in zip(("knn_k1_top1", "linear_top1"), values)}
    if paper == "dcl":
        return {(row, "knn_top1_best"): (v, "lightly") for row, v in LIGHTLY.items()}
    return {(row, "linear_top1"): (v, "DCL abstract") for row, v in DCL_IMAGENET.items()}


SOURCE_FILES = {"DT README": "ChaoningZhang/Dual-temperature README.md",
                "GSG Table 1": "Guided Stop-gradient', NeurIPS 2023, Table 1",
                "lightly": "lightly-ai/lightly docs/source/getting_started/benchmarks.rst",
                "DCL abstract": "2110.06848"}


def check_published(out, paper):
    """Every published number is a row of rows.json with its source, and shown in its line of
    table.md beside the source, whose citation (file and lines) is under the table."""
    saved = json.load(open(os.path.join(out, "rows.json")))
    text = open(os.path.join(out, "table.md")).read()
    lines = {(r["row"], r["metric"]): r for r in saved["rows"]}
    for (row, metric), (value, source) in published(paper).items():
        assert lines[row, metric]["published"] == pytest.approx(value, abs=1e-9), (row, metric)
        assert lines[row, metric]["source"] == source
        assert any(line.startswith(f"| {row} |") and f"| {metric} |" in line
                   and f"| {value:.2f}" in line and f"| {source} |" in line
                   for line in text.splitlines()), (row, metric)
        assert SOURCE_FILES[source] in papers.SOURCES[source] and papers.SOURCES[source] in text
    return saved, text


def test_paper_tables_at_the_smallest_scale(tmp_path):
    """dt, gsg and dcl on a generated folder of 8 px images, width 8, 1 epoch, each row's batch /
    16 (DT's batch 1024 runs at 64 of the 96 images), one row a paper: the header names every
    change of scale; every published number is shown with its source, but "not comparable" and
    without a difference; the rows run have our numbers (gsg: 2 seeds, mean and spread, each then
    linear_eval.py for 1 epoch), the others say "not run"."""
    data = tiny_image_folder(str(tmp_path / "data"), classes=2, train_per_class=48,
                             val_per_class=8, height=8, width=8)
    scale = ["--dataset", "imagefolder", "--data-dir", data, "--image-size", "8", "--width", "8",
             "--epochs", "1", "--batch-divisor", "16", "--workers", "0", "--device", "cpu",
             "--jobs", "2"]
    runs = {"dt": (["simco-b1024"], ["--linear-epochs", "1"]),
            "gsg": (["simsiam-guided"], ["--seeds", "2", "--linear-epochs", "1"]),
            "dcl": (["simclr-dcl-b128"], [])}
    with concurrent.futures.ThreadPoolExecutor(3) as pool:  # the three tables side by side
        list(pool.map(lambda paper: compare.main(
            ["--paper", paper, "--out", str(tmp_path / paper), "--variants", *runs[paper][0]]
            + scale + runs[paper][1]), runs))
    for paper, (ran, options) in runs.items():
        saved, text = check_published(str(tmp_path / paper), paper)
        assert not saved["comparable"]
        for change in ("--epochs 1", "--width 8", "--dataset imagefolder", "--batch-divisor 16",
                       f"--data-dir {data}"):
            assert change in " ".join(saved["changes"]) and change in text
        assert "This is not a reproduction" in text
        for line in saved["rows"]:
            assert not line["comparable"] and line["diff"] is None
            if line["row"] in ran:
                assert line["ours"] is not None and 0 <= line["ours"] <= 100, line
                assert line["error"] is None
            else:
                assert line["ours"] is None and not line["ran"]
        table = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
        assert len(table) == 1 + len(saved["rows"])  # the header, then one line per row
        for line, row in zip(table[1:], saved["rows"]):
            assert line.startswith(f"| {row['row']} |")
            assert ("not comparable" in line) == (row["published"] is not None)
            assert ("not run" in line) == (row["row"] not in ran)
        if paper == "dt":  # 1024 / 16 = 64 of the 96 images: one step
            assert "`--method simco --batch-size 1024 (run at 64)`" in text
        if paper == "gsg":
            for line in (r for r in saved["rows"] if r["row"] == "simsiam-guided"):
                assert line["ours_n"] == 2 and set(line["ours_seeds"]) == {"0", "1"}
                values = list(line["ours_seeds"].values())
                assert line["ours"] == pytest.approx(sum(values) / 2)
                assert line["ours_spread"] == pytest.approx(abs(values[0] - values[1]) / 2 ** 0.5)
            assert sum(" ± " in line and "(n=2)" in line for line in table) == 2
            for seed in "01":  # --linear-epochs 1: linear_eval.py's --epochs
                folder = tmp_path / paper / "simsiam-guided" / f"seed{seed}"
                assert json.load(open(folder / "linear_gsg-cifar.json"))["epochs"] == 1
        if paper == "dcl":  # lightly's best epoch, and ours both ways
            by = {(r["row"], r["metric"]): r for r in saved["rows"]}
            for row in ran:
                assert by[row, "knn_top1_best"]["ours"] >= by[row, "knn_top1"]["ours"]


class FakeRun:
    """Stands in for subprocess.Popen: notes each job's CUDA_VISIBLE_DEVICES and command, how
    many jobs share a GPU at once, and writes the run folder a finished script would (a row whose
    --out holds `fail` fails with an `error:` line), or linear_eval.py's linear_NAME.json."""

    def __init__(self, fail=None):
        self.fail, self.jobs, self.lock, self.busy, self.most = fail, [], threading.Lock(), {}, {}

    def __call__(self, cmd, stdout, stderr, env):
        gpu = env.get("CUDA_VISIBLE_DEVICES")
        linear = "--protocol" in cmd  # linear_eval.py RUN --protocol NAME
        out = cmd[cmd.index("--protocol") - 1] if linear else cmd[cmd.index("--out") + 1]
        with self.lock:
            self.jobs.append({"gpu": gpu, "cmd": cmd, "out": out, "linear": linear})
            self.busy[gpu] = self.busy.get(gpu, 0) + 1
            self.most[gpu] = max(self.most.get(gpu, 0), self.busy[gpu])
        if linear:
            name = cmd[cmd.index("--protocol") + 1]
            json.dump({"linear_top1": 80.0}, open(os.path.join(out, f"linear_{name}.json"), "w"))
            return FakeProcess(self, gpu, 0)
        json.dump({"args": {"epochs": 200}}, open(os.path.join(out, "config.json"), "w"))
        with open(os.path.join(out, "metrics.jsonl"), "w") as f:
            for epoch, knn in ((1, 50.0), (2, 81.0), (3, 80.0)):
                f.write(json.dumps({"epoch": epoch, "seconds": 10.0, "knn_top1": knn}) + "\n")
        fails = self.fail and self.fail in out
        if fails:
            stdout.write("error: --data-dir ./data: no CIFAR-10 there\n")
        else:
            json.dump({"knn_top1": 80.0, "knn_k1_top1": 80.0, "online_top1": 80.0},
                      open(os.path.join(out, "results.json"), "w"))
        return FakeProcess(self, gpu, 2 if fails else 0)


class FakeProcess:
    def __init__(self, fake, gpu, returncode):
        self.fake, self.gpu, self.returncode = fake, gpu, returncode

    def wait(self):
        time.sleep(0.05)  # the job runs a while: the runner starts the others meanwhile
        with self.fake.lock:
            self.fake.busy[self.gpu] -= 1
        return self.returncode


def test_gpus_give_each_job_its_own_cuda_visible_devices(tmp_path, monkeypatch):
    """--gpus 0,1 --jobs-per-gpu 2: every job on GPU 0 or 1, at most 2 on one GPU at a time (and
    2 reached); --nproc 2 --gpus 0,1,2,3: each torchrun job gets a pair; without --gpus the
    environment's devices are left alone. The full-scale tables show the published numbers and
    the difference (dcl-imagenet's borrowed protocol "not comparable"), a failed row its error
    line, and a second call reruns only that row. linear_eval.py runs on each finished gsg run's
    GPUs after it; a second call reruns it alone where its linear_NAME.json is missing."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    fake = FakeRun(fail="simclr-dclw-b64")
    monkeypatch.setattr(compare.subprocess, "Popen", fake)
    out = str(tmp_path / "dcl")
    dcl = ["--paper", "dcl", "--out", out, "--gpus", "0,1", "--jobs-per-gpu", "2"]
    assert compare.main(dcl) == 1  # a run failed
    assert len(fake.jobs) == 15 and {job["gpu"] for job in fake.jobs} == {"0", "1"}
    assert fake.most == {"0": 2, "1": 2}
    assert all(job["cmd"][job["cmd"].index("--device") + 1] == "cuda" for job in fake.jobs)
    saved, text = check_published(out, "dcl")
    assert saved["comparable"] and "Full scale: the paper's settings and protocol." in text
    best = {r["row"]: r for r in saved["rows"] if r["metric"] == "knn_top1_best"}
    assert best["simclr-dcl-b128"]["ours"] == 81.0 and best["simclr-dcl-b128"]["diff"] == \
        pytest.approx(81.0 - 84.4)
    assert "| 84.40 | lightly | -3.40 |" in text and "error: --data-dir ./data" in text
    assert best["simclr-dclw-b64"]["error"].startswith("error: --data-dir")
    fake.jobs.clear()
    assert compare.main(dcl) == 1
    assert [job["out"] for job in fake.jobs] == [os.path.join(out, "simclr-dclw-b64", "seed0")]

    fake = FakeRun(fail=os.path.join("byol-guided", "seed2"))
    monkeypatch.setattr(compare.subprocess, "Popen", fake)
    out = str(tmp_path / "gsg")
    gsg = ["--paper", "gsg", "--out", out, "--nproc", "2", "--gpus", "0,1,2,3"]
    assert compare.main(gsg) == 1
    assert len(fake.jobs) == 23 and {job["gpu"] for job in fake.jobs} == {"0,1", "2,3"}
    assert all("--nproc_per_node=2" in job["cmd"] for job in fake.jobs)
    trained = {job["out"]: job for job in fake.jobs if not job["linear"]}
    for job in (job for job in fake.jobs if job["linear"]):
        run = trained.pop(job["out"])
        assert job["cmd"][-6:] == [os.path.join(ROOT, "benchmarks", "linear_eval.py"),
                                   job["out"], "--protocol", "gsg-cifar", "--device", "cuda"]
        assert job["gpu"] == run["gpu"] and fake.jobs.index(job) > fake.jobs.index(run)
    assert list(trained) == [os.path.join(out, "byol-guided", "seed2")]  # failed: no evaluation
    saved, text = check_published(out, "gsg")
    assert saved["comparable"] and "| 77.00 ± 0.67 | GSG Table 1 | +3.00 |" in text
    assert "| 80.00 ± 0.00 (n=3) | 82.70 ± 0.26 | GSG Table 1 | -2.70 |" in text
    os.remove(os.path.join(out, "simsiam-guided", "seed0", "linear_gsg-cifar.json"))
    fake.jobs.clear()
    assert compare.main(gsg) == 1
    assert sorted((job["out"], job["linear"]) for job in fake.jobs) == [
        (os.path.join(out, "byol-guided", "seed2"), False),
        (os.path.join(out, "simsiam-guided", "seed0"), True)]

    fake = FakeRun()
    monkeypatch.setattr(compare.subprocess, "Popen", fake)
    for paper, extra in (("dt", []), ("dcl-imagenet", ["--data-dir", str(tmp_path)])):
        out = str(tmp_path / paper)
        compare.main(["--paper", paper, "--out", out, "--device", "cuda"] + extra)
        saved, text = check_published(out, paper)
        assert saved["comparable"] == papers.PROTOCOLS[paper].authors
        assert ("not comparable" in text) != papers.PROTOCOLS[paper].authors
    assert {job["gpu"] for job in fake.jobs} == {"7"}  # no --gpus: the environment's devices

    for wrong in (["--jobs-per-gpu", "2"], ["--gpus", "0,1,2", "--nproc", "2"],
                  ["--gpus", "0", "--jobs", "2"], ["--paper", "dt", "--batch-size", "64"]):
        with pytest.raises(SystemExit):
            compare.parse_args(wrong)


def test_exit_status_is_nonzero_when_a_run_failed(tmp_path):
    """compare.py as a user runs it: its one run fails (no data where --data-dir points), so the
    process exits non-zero, and the table names the run's error."""
    out = tmp_path / "dcl"
    process = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "compare.py"), "--paper", "dcl",
         "--variants", "simclr-dcl-b128", "--out", str(out), "--dataset", "imagefolder",
         "--data-dir", str(tmp_path / "missing"), "--device", "cpu"],
        capture_output=True, text=True)
    assert process.returncode != 0, process.stdout + process.stderr
    assert "error" in [line for line in (out / "table.md").read_text().splitlines()
                       if line.startswith("| simclr-dcl-b128 |")][0]
