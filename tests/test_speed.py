"""benchmarks/speed.py on the CPU at the smallest sizes: a row for every method file (through its
own main()), the ops tables' bounds, and the bare step's replay."""
import os
import sys

import pytest
import torch

import moco_simmoco_simco
import simsiam_byol_gsg
from helpers import QUICK_START, ROOT, run_main, tiny

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import speed  # noqa: E402

TINY = speed.Preset(4, 8, 8, 32, 16, 1, 0, 2, 64, True)  # 4 steps of 8 images
METHODS = list(QUICK_START)


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    """main() at the tiny preset -> its Markdown rows, split into cells."""
    out = tmp_path_factory.mktemp("speed") / "speed.md"
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(speed.PRESETS, "cpu", TINY)
        speed.main(["--device", "cpu", "--out", str(out)])
    return [line.split(" | ") for line in out.read_text().splitlines() if line.startswith("| ")]


def method_rows(tables, method):
    """The method file's row of the speed, ops and 2-process tables (each a row per method
    file)."""
    rows = [r for r in tables if r[0][2:] in QUICK_START]
    assert [r[0][2:] for r in rows] == METHODS * 3
    return rows[METHODS.index(method)::len(METHODS)]


@pytest.mark.rule("speed")
@pytest.mark.parametrize("method", METHODS)
def test_each_method_files_rows_and_its_ops_bounds(tables, method):
    """main() at the tiny preset writes the method file's rows (rates, positive, with no GPU busy
    fraction, sync count or memory on a CPU; ops and host ms; its step's ops at 2 gloo processes
    beside 1), then the augmentation and optimiser rows. As speed.py counts them, its
    common.Augment dispatches at most 150 aten ops a view, its augmentation plus its train_step at
    most 1.7 times its bare network step's ops, and its step at 2 processes (the global BatchNorm,
    the gathers, DDP) at most 5.5 times its ops at one (rest + bare): measured 3.62 (SimCLR) to
    4.97 (GSG's four crops), with the CPU's global BatchNorm by autograd; the collectives among
    them are counted too (measured: 46 for SimCLR to 192 for GSG)."""
    rates, ops, (name, one, both, ratio, collectives) = method_rows(tables, method)
    assert float(rates[3].replace(",", "")) > 0 and float(rates[5]) > 0
    assert rates[6] == "n/a" and rates[9:] == ["n/a", "n/a |"]
    assert [r[0][2:] for r in tables[-2:]] == ["augmentation, SimCLR's recipe, 8 px, 64 images",
                                               "optimiser step, ResNet-18 w4"]
    # The ops row: views, "ops (a view)", rest, bare, ratio, then three ms.
    assert all(float(ms.strip(" |")) > 0 for ms in ops[6:])
    assert int(ops[2].split()[0].replace(",", "")) <= 150 * int(ops[1]), ops
    assert float(ops[5]) <= 1.7, ops
    rest = int(ops[3].replace(",", ""))
    bare = int(ops[4].replace(",", ""))
    one = int(one.replace(",", ""))
    assert rest > 0 and bare > 0 and one == rest + bare
    assert one < int(both.replace(",", "")) <= 5.5 * one, (name, one, both)
    assert 0 < int(collectives.strip(" |")) < one, (name, collectives)


@pytest.mark.parametrize("module, argv, expected", [
    (simsiam_byol_gsg, ["--method", "byol"], [("net", 4, True)] + [("target", 1, False)] * 4),
    (moco_simmoco_simco, ["--method", "mocov2", "--queue-size", "32"],
     [("net", 1, True), ("net", 1, False)] + [("key_encoder", 1, False)] * 2),
], ids=["byol-gsg", "mocov2"])
def test_the_bare_step_replays_the_networks_the_real_step_called(module, argv, expected,
                                                                  tmp_path):
    """The outermost network calls of a step of main(), which the bare step replays: BYOL + GSG's
    online network once on the four crops, with gradient, then its momentum encoder on each crop
    without; MoCo v2's query network on view 1 with gradient and on view 2 without, the key
    encoder on each view without."""
    seen = {}
    real = module.train_step

    def before(i, args, kwargs):
        bound = speed.arguments(real, args, kwargs)
        seen["names"] = {id(m): n for n, m in bound.items() if isinstance(m, torch.nn.Module)}
        seen["views"] = bound["views"]
        seen["recorder"] = speed.Recorder([m for m in bound.values()
                                           if isinstance(m, torch.nn.Module)])

    def after(i, args, kwargs, result):
        seen["calls"] = seen["recorder"].stop()

    run_main(module, [*tiny(module.__name__), *argv, "--out", tmp_path / "run"], before=before,
             after=after, steps=1)
    calls = seen["calls"]
    assert [(seen["names"][id(m)], len(inputs), grad) for m, inputs, grad in calls] == expected
    assert all(x is v for x, v in zip(calls[0][1], seen["views"]))  # the very views of the step


def test_the_op_counter_counts_every_aten_op():
    """Known ops: an add and a mul are 2; torch.where with a Python number lifts it to a tensor
    first (3: gt, scalar_tensor, where); a view is one too."""
    x = torch.ones(3)
    assert speed.ops_in(lambda: (x + 1) * 2) == 2
    assert speed.ops_in(lambda: torch.where(x > 0, x, 0.0)) == 3
    assert speed.ops_in(lambda: x.view(3, 1)) == 1


def test_a_row_says_in_a_line_what_it_found_wrong():
    """A sync, a recompile or a loop slower than half the bare step: a line each, naming it."""
    row = {"method": "m", "syncs": 2.0, "regraphs": 1, "loop": 100.0, "bare": 300.0}
    lines = speed.warnings_of(row)
    assert len(lines) == 3 and all(line.startswith("warning: m: ") for line in lines)
    assert speed.warnings_of({**row, "syncs": 0.0, "regraphs": 0, "loop": 200.0}) == []


def test_a_script_that_cannot_be_measured_is_one_line_and_no_row(tmp_path, monkeypatch):
    """A method file whose main() speed.py cannot run gets one line saying so, and no row in any
    table; the others are measured."""
    real = speed.method_row

    def method_row(method, *args):
        if method == METHODS[0]:
            raise TypeError("train_step() missing 1 required positional argument")
        return real(method, *args)

    monkeypatch.setattr(speed, "method_row", method_row)
    monkeypatch.setitem(speed.PRESETS, "cpu", TINY)
    out = tmp_path / "speed.md"
    speed.main(["--device", "cpu", "--methods", *METHODS[:2], "--out", str(out)])
    text = out.read_text()
    assert f"{METHODS[0]}: not measured, TypeError: train_step() missing" in text
    rows = [line for line in text.splitlines() if line.startswith(f"| {METHODS[0]} ")]
    assert rows == [] and text.count(f"| {METHODS[1]} ") == 3


def test_on_the_cpu_the_batchnorm_rows_are_one_line_saying_why_there_are_none(tmp_path):
    """--rows batchnorm on the CPU: the global BatchNorm's rows need CUDA; one line says so, and
    no table is written."""
    out = tmp_path / "speed.md"
    speed.main(["--device", "cpu", "--rows", "batchnorm", "--out", str(out)])
    lines = out.read_text().splitlines()
    assert [line for line in lines if line.startswith("No global BatchNorm rows")] == [
        "No global BatchNorm rows: its fused kernels and nn.SyncBatchNorm's run on CUDA only."]
    assert not any(line.startswith("|") for line in lines)
