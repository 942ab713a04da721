"""benchmarks/figures.py: each paper's figure drawn from small run folders made here (width 4,
256 texture images, 1-2 epochs), its numbers those of the functions training uses."""
import json
import math
import os
import sys

import pytest
import torch

import moco_simmoco_simco
import simclr_dcl
from helpers import ROOT, readme_quick_start, run_script

# Without matplotlib (benchmarks/requirements.txt) these skip,
# saying so, and the rest of the suite runs.
pytest.importorskip("matplotlib", reason="pip install -r benchmarks/requirements.txt")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import compare  # noqa: E402
import figures  # noqa: E402

TINY = ["--dataset", "textures", "--limit-train", "256", "--width", "4", "--batch-size", "32",
        "--epochs", "1", "--proj-hidden", "32", "--proj-dim", "16", "--linear-epochs", "0",
        "--eval-every", "1", "--device", "cpu", "--workers", "0"]
RUNS = {"mocov2": ("moco_simmoco_simco.py", ["--method", "mocov2", "--queue-size", "64",
                                             "--no-online-probe"]),
        "simsiam-guided": ("simsiam_byol_gsg.py", ["--epochs", "2"]),
        "simsiam-guided-no-predictor": ("simsiam_byol_gsg.py", ["--epochs", "2",
                                                                "--no-predictor"])}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """`figures.py dcl --train` at TINY scale -> (its runs' folder, its figures' folder)."""
    root = tmp_path_factory.mktemp("figure_train")
    out = str(root / "figures")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")  # each run one thread, as run_script's
        figures.main(["dcl", "--train", "--runs-dir", str(root), "--out", out, "--", *TINY])
    return root / "dcl", out


@pytest.fixture(scope="module")
def runs(trained, tmp_path_factory):
    """A run folder per RUNS entry, made by the script's real command line, and the InfoNCE run
    that `--train` made."""
    root = tmp_path_factory.mktemp("figure_runs")
    folders = {"simclr-infonce": str(trained[0] / "simclr-infonce")}
    for name, (script, options) in RUNS.items():
        folders[name] = str(root / name)
        done = run_script(script, TINY + options + ["--out", folders[name]])
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return folders


def spy(monkeypatch, module, function):
    """Replace module.function by itself, recording each result -> the list of results."""
    results, real = [], getattr(module, function)

    def recorded(*args):
        results.append(real(*args))
        return results[-1]
    monkeypatch.setattr(module, function, recorded)
    return results


def metrics(run):
    return [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]


def test_dcl_fig1_mean_npc_multiplier_rises_with_the_batch_size(runs, tmp_path, monkeypatch):
    """q_B = 1 - exp(pos) / (exp(pos) + U) (DCL Eq. 8) of the run's model on its own views, in
    batches of N = 32 ... 256 (all its images): <q_B> rises with N (DCL Fig. 1a); each batch's
    q_B is simclr_dcl.npc_multiplier's, 2N anchors a batch."""
    calls = spy(monkeypatch, simclr_dcl, "npc_multiplier")
    figures.main(["dcl", runs["simclr-infonce"], "--out", str(tmp_path)])
    saved = json.load(open(tmp_path / "dcl.json"))["simclr-infonce"]
    assert saved["loss"] == "infonce" and os.path.getsize(tmp_path / "dcl.png") > 10_000
    rows = saved["batch_sizes"]
    assert list(rows) == ["32", "64", "128", "256"]
    assert [len(q) for q in calls] == [64] * 8 + [128] * 4 + [256] * 2 + [512]
    means = [rows[size]["mean"] for size in rows]
    assert means == sorted(means) and means[0] < means[-1]
    for size in rows:
        q = torch.cat([batch for batch in calls if len(batch) == 2 * int(size)])
        assert rows[size]["mean"] == pytest.approx(q.mean().item(), rel=1e-5)
        assert sum(rows[size]["share"]) == pytest.approx(1)


def test_dcl_fig1_at_its_real_size(runs):
    """q_B on a linear axis up to its bound 1; <q_B> on an axis from 0 to 1 and C_v on one from
    0; the batch size N doubles along a log-2 axis; the caption gives <q_B> and C_v at the
    smallest and the largest N, and says that one network, trained at one batch size, is only
    evaluated at each N, the paper's protocol in its words (DCL Fig. 1(b))."""
    fig, saved = figures.dcl_figure([runs["simclr-infonce"]])
    print(fig.get_supxlabel())
    histogram, mean, cv = fig.axes
    assert [ax.get_yscale() for ax in fig.axes] == ["linear"] * 3
    assert [ax.get_xscale() for ax in fig.axes] == ["linear", "log", "log"]
    assert histogram.get_xlim()[1] >= 1
    assert mean.get_ylim() == (0, 1) and cv.get_ylim()[0] == 0
    rows = saved["simclr-infonce"]["batch_sizes"]
    caption = fig.get_supxlabel().replace("\n", " ")
    assert (f"simclr-infonce (--loss infonce), trained once with --batch-size 32 --epochs 1: "
            f"from N = 32 to 256, <q_B> {rows[32]['mean']:.3f} -> {rows[256]['mean']:.3f}, "
            f"C_v {rows[32]['cv']:.3f} -> {rows[256]['cv']:.4f}") in caption
    assert ('Each network evaluated at every N, as DCL Fig. 1(b) evaluates "a pre-trained SimCLR '
            'baseline model"; networks trained at other N not shown') in caption


def test_dt_fig3_entropy_of_r_plus_rises_with_the_dictionary_size(runs, tmp_path, monkeypatch):
    """H(r_+) / log A over A = 128 anchors against K = 1 ... 128 keys of the other images, at each
    tau_beta: in (0, 1], rising with K at a fixed tau_beta (DT Fig. 3); each number is
    anchor_weight_stats's entropy of dual_temperature_loss's weights."""
    weights = spy(monkeypatch, moco_simmoco_simco, "dual_temperature_loss")
    stats = spy(monkeypatch, moco_simmoco_simco, "anchor_weight_stats")
    figures.main(["dt", runs["mocov2"], "--out", str(tmp_path)])
    saved = json.load(open(tmp_path / "dt.json"))["mocov2"]
    sizes = saved["dictionary_sizes"]
    assert sizes == [1, 2, 4, 8, 16, 32, 64, 128]
    entropy = saved["normalised_entropy"]
    assert list(entropy) == [str(tau) for tau in figures.TAUS]
    assert len(weights) == len(stats) == len(figures.TAUS) * len(sizes)
    assert [len(w) for _, (w, _) in weights] == [128] * len(weights)
    recomputed = [h.item() / math.log(128) for _, _, h, _ in stats]
    assert [h for row in entropy.values() for h in row] == pytest.approx(recomputed, rel=1e-12)
    for row in entropy.values():
        assert all(0 < h <= 1 for h in row)
        assert row == sorted(row) and row[0] < row[-1]


def test_dt_fig3_effective_anchors_on_a_linear_axis_from_0(runs, monkeypatch):
    """exp(H(r_+)), the number of anchors that would carry the pull if they carried it equally
    (A = 128 at most), against K: a linear axis from 0 to at least A, each point exp of
    anchor_weight_stats's entropy and the JSON's; the caption gives the fewest, and says that the
    network, trained at one batch size and tau_beta, is only evaluated at each K and tau_beta."""
    stats = spy(monkeypatch, moco_simmoco_simco, "anchor_weight_stats")
    fig, saved = figures.dt_figure([runs["mocov2"]])
    print(fig.get_supxlabel())
    ax, = fig.axes
    assert ax.get_yscale() == "linear" and ax.get_xscale() == "log"
    assert ax.get_ylim()[0] == 0 and ax.get_ylim()[1] >= 128
    plotted = [y for line in ax.lines for y in line.get_ydata()]
    assert plotted == pytest.approx([math.exp(h.item()) for _, _, h, _ in stats], rel=1e-9)
    run = json.loads(json.dumps(saved))["mocov2"]
    assert run["anchors"] == 128
    assert plotted == [y for row in run["effective_anchors"].values() for y in row]
    caption = fig.get_supxlabel().replace("\n", " ")
    assert f"{min(plotted):.0f}" in caption and "of 128 anchors" in caption
    # MoCo v2 trains at tau_beta = tau_alpha, 0.1: InfoNCE.
    assert ("mocov2 (--method mocov2), trained once with --batch-size 32 --epochs 1 "
            "--tau-beta 0.1: " in caption)
    assert ("Each network evaluated at every K and tau_beta; networks trained at other values "
            "not shown") in caption


def test_gsg_figs4_5_one_point_per_epoch_per_run(runs, tmp_path):
    """kNN top-1 per epoch with the predictor (GSG Fig. 4), kNN and proj_std per epoch without
    it (Fig. 5): each run a line in its panels, a point per epoch, metrics.jsonl's numbers."""
    guided, alone = runs["simsiam-guided"], runs["simsiam-guided-no-predictor"]
    fig, saved = figures.gsg_figure([guided, alone])
    assert [len(ax.lines) for ax in fig.axes] == [1, 1, 1]
    assert [list(ax.lines[0].get_xdata()) for ax in fig.axes] == [[1, 2]] * 3
    for run, panels in ((guided, ["knn_top1"]), (alone, ["knn_top1", "proj_std"])):
        lines = saved[os.path.basename(run)]
        assert list(lines) == panels
        for key in panels:
            assert lines[key] == [[line["epoch"], line[key]] for line in metrics(run)]
    figures.main(["gsg", guided, alone, "--out", str(tmp_path)])
    assert json.load(open(tmp_path / "gsg.json")) == json.loads(json.dumps(saved))


def test_gsg_figs4_5_axes_from_0_and_values_in_the_caption(runs):
    """kNN top-1 on axes from 0 to 100 %, proj_std on one from 0 (all projections the same) to
    near its highest value, all linear; the caption gives each run's epochs, first and last
    values, and what a short run can show of a collapse (proj_std falling before kNN)."""
    guided, alone = runs["simsiam-guided"], runs["simsiam-guided-no-predictor"]
    fig, saved = figures.gsg_figure([guided, alone])
    print(fig.get_supxlabel())
    knn, knn_alone, proj_std = fig.axes
    assert [ax.get_yscale() for ax in fig.axes] == ["linear"] * 3
    assert [knn.get_ylim(), knn_alone.get_ylim()] == [(0, 100)] * 2
    highest = max(value for _, value in saved[os.path.basename(alone)]["proj_std"])
    caption = fig.get_supxlabel().replace("\n", " ")
    assert proj_std.get_ylim()[0] == 0 and proj_std.get_ylim()[1] < 1.5 * highest
    for run in saved.values():
        for key, points in run.items():
            first, last = points[0][1], points[-1][1]
            assert f"{key} {first:.3g} -> {last:.3g}" in caption
    assert "simsiam-guided, 2 epochs: knn_top1" in caption
    assert "simsiam-guided-no-predictor, 2 epochs: knn_top1" in caption
    assert ('A collapse begins as proj_std falls; kNN falls to chance later: GSG Sec. 6.2 runs '
            'CIFAR-10 up to 400 epochs "to confirm complete collapse"') in caption


def test_gsg_train_gives_the_runs_without_a_predictor_more_epochs():
    """`gsg --train`: compare.py gives the runs without a predictor 12 epochs, as many as a
    collapse's onset (proj_std falling) needs at this scale, and the others 5 (the untrained row
    0), each the last --epochs of its command."""
    variants, options = figures.TRAIN["gsg"]
    args = compare.parse_args(["--variants", *variants, *figures.QUICK, *options])
    epochs = {job["name"]: compare.values(job["commands"]["results.json"])["--epochs"]
              for job in compare.runs(args)}
    assert epochs == {"untrained-simsiam_byol_gsg": "0", **{
        name: "12" if name.endswith("no-predictor") else "5" for name in variants}}


def test_training_curves_of_runs_side_by_side(runs, tmp_path):
    """A panel per number of metrics.jsonl (loss, lr, kNN, each method's diagnostics), a line
    per run that logs it, a point per epoch."""
    figures.main(["curves", *runs.values(), "--out", str(tmp_path)])
    saved = json.load(open(tmp_path / "curves.json"))
    assert {"loss", "lr", "knn_top1", "npc_mean", "npc_cv", "w_alpha", "w_beta",
            "r_plus_entropy", "proj_std"} <= saved.keys()
    assert not saved.keys() & figures.SKIP
    assert "anchors" not in saved  # a count per step, the same each epoch: no curve
    assert set(saved["loss"]) == set(runs) and set(saved["npc_mean"]) == {"simclr-infonce"}
    for name, run in runs.items():
        assert saved["loss"][name] == [[line["epoch"], line["loss"]] for line in metrics(run)]
    assert os.path.getsize(tmp_path / "curves.png") > 10_000


def test_one_command_trains_and_draws(trained):
    """`figures.py dcl --train`: compare.py runs the InfoNCE and DCL variants (and the untrained
    row) into RUNS_DIR/dcl by the scripts' real command lines, the options after `--` last; then
    the figure is drawn from both."""
    folder, out = trained
    saved = json.load(open(os.path.join(out, "dcl.json")))
    assert {name: line["loss"] for name, line in saved.items()} == {
        "simclr-infonce": "infonce", "simclr-dcl": "dcl"}
    for name in saved:
        config = json.load(open(folder / name / "config.json"))
        assert config["args"]["argv"][-len(TINY) - 2:-2] == TINY
        assert len(metrics(folder / name)) == 1
    with pytest.raises(SystemExit):
        figures.parse_args(["curves", "--train"])


def test_train_recipe_is_the_readme_quick_start():
    """--train's runs take the README's quick start (T), with kNN each epoch and no linear
    probe, so the figures show the runs the README's numbers come from."""
    t, _ = readme_quick_start()
    assert figures.QUICK == t + ["--eval-every", "1", "--linear-epochs", "0"]


def test_by_default_a_figure_goes_to_runs_figures_not_over_the_committed_ones(
        runs, tmp_path, monkeypatch, capsys):
    """Run from the repository's root as the README does (here a copy's root, tmp_path), a
    figure and its JSON go to runs/figures, and figures.py says so: benchmarks/figures, the
    committed figures, changes only with `--out benchmarks/figures`."""
    monkeypatch.chdir(tmp_path)
    figures.main(["dcl", runs["simclr-infonce"]])
    written = os.path.join("runs", "figures", "dcl")
    assert f"written: {written}.png and {written}.json" in capsys.readouterr().out
    assert os.listdir(tmp_path) == ["runs"] and os.path.isfile(tmp_path / f"{written}.png")


def test_untrained_prints_each_papers_quantity_by_the_training_functions(
        tmp_path, monkeypatch, capsys):
    """`figures.py dcl --untrained`, `dt --untrained`: the quick start's network untrained on
    generated textures, no run folder. DCL: a row per batch size N, <q_B> and C_v of
    npc_multiplier's q_B (2N anchors a batch), <q_B> within 0.001 of its note's 1 - 1/(2N - 1);
    DT: a row per tau_beta, exp(H(r_+)) / A of anchor_weight_stats's H at each K. Each draws its
    figure into --out, its printed caption naming the network untrained; without matplotlib it
    prints the numbers alone, and how to draw them."""
    q = spy(monkeypatch, simclr_dcl, "npc_multiplier")
    stats = spy(monkeypatch, moco_simmoco_simco, "anchor_weight_stats")
    figures.main(["dcl", "--untrained", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "simclr_dcl (--loss dcl), untrained: from N = 32 to 1024" in out
    assert "trained once with" not in out
    rows = [line.split() for line in out.splitlines()
            if line.startswith("  ") and line.split()[0].isdigit()]
    assert [int(row[0]) for row in rows] == list(figures.SIZES)
    first = 0
    for (n, mean, cv, baseline), count in zip(rows, (32, 16, 8, 4, 2, 1)):
        values = torch.cat(q[first:first + count])
        first += count
        assert float(mean) == pytest.approx(values.mean().item(), abs=1e-4)
        assert float(cv) == pytest.approx((values.std(correction=0) / values.mean()).item(),
                                          abs=1e-4)
        assert abs(float(mean) - float(baseline)) < 1e-3
    monkeypatch.setattr(figures, "Figure", None)
    figures.main(["dt", "--untrained", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith(("  0.", "  1."))]
    assert [float(row[0]) for row in rows] == list(figures.TAUS)
    shares = [float(share) for row in rows for share in row[1:]]
    anchors = 256  # entropy_by_dictionary's
    assert shares == pytest.approx([math.exp(h.item()) / anchors for _, _, h, _ in stats],
                                   abs=6e-4)
    assert figures.DRAW in out
    assert sorted(os.listdir(tmp_path)) == ["dcl-untrained.json", "dcl-untrained.png"]
