"""What every method file must do, each run as the README's quick start runs it
(helpers.QUICK_START, the one place a method file is named: a new script with its quick-start line
is checked here with nothing edited); `pytest -k NAME` selects one method file's checks. The runs
are real processes (no fork of this one), but those of main() run here (run_main)."""
import importlib
import inspect
import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import common
from helpers import (QUICK_START, OpNames, check_run_folder, float64, modules_of, run_distributed,
                     run_main, run_ok, same_run, tiny)
from test_preemption import killed

METHODS = sorted(QUICK_START)
# kNN top-1 points over the untrained network. Measured for the quick starts' seed 0 at one thread
# (2026-12-06): gains of 35.4 (NNCLR) to 48.8 (SimCLR); over the README's seeds and thread counts
# every run gained 20 or more (benchmarks/README.md, "How the README's numbers were measured")
MARGIN = 10.0


@pytest.mark.rule("run-folder")
@pytest.mark.parametrize("method", METHODS)
def test_python_and_torchrun_write_the_same_run(method, tmp_path):
    """One step of 16 images (an epoch), as `python` and as `torchrun --nproc_per_node=2`: both
    write the whole run folder, the start-up line from rank 0 alone, and the step's loss (before
    any update) within 1e-4 of each other."""
    args = [*tiny(method, "--limit-train", "16", "--epochs", "1"), "--linear-epochs", "1"]
    runs = {}
    for nproc in (1, 2):
        out = tmp_path / f"nproc{nproc}"
        done = run_ok(f"{method}.py", [*args, "--out", out], nproc=nproc)
        assert sum(line.startswith("run ") for line in done.stdout.splitlines()) == 1
        _, (line,), results = check_run_folder(out, epochs=1)
        assert "linear_top1" in results
        runs[nproc] = line["loss"]
    assert abs(runs[1] - runs[2]) < 1e-4 * max(1.0, abs(runs[1])), runs


@pytest.mark.rule("resume")
@pytest.mark.parametrize("method", METHODS)
def test_a_killed_run_continues_with_the_same_command_bit_for_bit(method, tmp_path, capsys):
    """One process killed (SIGKILL) in epoch 2's second step: epoch 1's checkpoint is kept, no
    temp file left; the same command then continues from it (and says so) and ends as an
    uninterrupted run does (helpers.same_run)."""
    module = importlib.import_module(method)
    module.main([*tiny(method), "--out", tmp_path / "straight"])
    out = tmp_path / "stopped"
    argv = [*tiny(method), "--out", out]
    assert killed(method, argv, 0, 6).returncode == -9  # epoch 2's second step
    assert not [n for n in os.listdir(out) if n.endswith(".tmp")]
    assert torch.load(out / "checkpoint.pt", weights_only=True)["epoch"] == 1
    capsys.readouterr()
    module.main(argv)
    assert f"continuing {out} from epoch 2" in capsys.readouterr().out
    same_run(tmp_path / "straight", out)


@pytest.fixture(scope="module")
def quick_starts(request, tmp_path_factory):
    """quick_starts(method) -> (kNN untrained, kNN trained) of the method's quick start (with
    --linear-epochs 0, --workers 0) at one thread. The first call makes every selected method's
    runs, two processes at a time."""
    root = tmp_path_factory.mktemp("quick_starts")
    selected = {item.callspec.params["method"] for item in request.session.items
                if item.module is request.module and "quick_start" in item.name}
    done = {}

    def run(job):
        method, epochs = job
        out = root / f"{method}-{'untrained' if epochs else 'trained'}"
        argv = [*QUICK_START[method], "--linear-epochs", "0", "--workers", "0",
                "--device", "cpu", "--out", out, *epochs]
        run_ok(f"{method}.py", argv)
        with open(out / "results.json") as f:
            return json.load(f)["knn_top1"]

    def knn(method):
        if not done:
            jobs = [(m, e) for m in sorted(selected) for e in ([], ["--epochs", "0"])]
            with ThreadPoolExecutor(2) as pool:
                for job, top1 in zip(jobs, pool.map(run, jobs)):
                    done[job[0], bool(job[1])] = top1
        return done[method, True], done[method, False]
    return knn


@pytest.mark.rule("learns")
@pytest.mark.parametrize("method", METHODS)
def test_the_quick_start_learns(method, quick_starts):
    """The README's quick-start line for the method (3 epochs on the generated textures) ends with
    kNN top-1 at least MARGIN points above the same network untrained (--epochs 0)."""
    untrained, trained = quick_starts(method)
    assert trained >= untrained + MARGIN, f"{method}: kNN {trained:.1f}% vs {untrained:.1f}%"


# torch.tensor, as_tensor and new_tensor of Python data, on the CPU. A Python number given to an
# op (scalar_tensor) is no copy: CUDA's kernels take it as an argument.
FROM_PYTHON_DATA = {"aten.lift_fresh", "aten.lift_fresh_copy"}


@pytest.mark.rule("no-python-data")
@pytest.mark.parametrize("method", METHODS)
def test_a_step_of_main_builds_no_tensor_from_python_data(method, tmp_path):
    """On a GPU each tensor built from Python data is a blocking host-to-device copy, and with 8
    GPUs every host waits for the slowest. Counted from the end of main()'s first train_step to
    the end of its second (the probes, meter, schedule, augmentation, GSG's pairs, train_step): the
    CPU sees each such copy as an aten.lift_fresh. CUDA twin: tests/test_cuda.py."""
    counter = OpNames()

    def after(step, args, kwargs, result):
        if step == 1:
            counter.__enter__()
        else:
            counter.__exit__(None, None, None)

    run_main(importlib.import_module(method), [*tiny(method), "--out", tmp_path / "run"],
             after=after, steps=2)
    made = {k: counter.names[k] for k in FROM_PYTHON_DATA}
    assert sum(counter.names.values()) > 100 and sum(made.values()) == 0, made


def first_step(method, out):
    """METHOD's main() up to the end of its first train_step (16 images), in float64 -> {"loss";
    "grads", the gradient the optimiser took (None where a parameter has none); "updates", each
    parameter after the step less before; "backbone", whether each lies in a common.ResNet}, over
    the bare network's parameters in order. Under tests/dist_worker.py, one rank's step."""
    module = importlib.import_module(method)
    signature = inspect.signature(module.train_step)
    seen = {}

    def parameters():
        return [p.detach().clone() for p in seen["net"].parameters()]

    def gradients(*_):
        seen["grads"] = [None if p.grad is None else p.grad.clone()
                         for p in seen["net"].parameters()]

    def before(step, args, kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.arguments["views"] = [v.double() for v in bound.arguments["views"]]
        net = bound.arguments["net"]
        seen["net"] = getattr(net, "module", net)  # DDP's bare model
        seen["before"] = parameters()
        # The gradient the optimiser is given, before its step can change it.
        optimizer = bound.arguments["optimizer"]
        seen["hook"] = optimizer.register_step_pre_hook(gradients)
        return bound.args, bound.kwargs

    def after(step, args, kwargs, result):
        seen.pop("hook").remove()
        seen["loss"] = float(result[0])
        seen["updates"] = [a - b for a, b in zip(parameters(), seen.pop("before"))]

    with float64():
        argv = [*tiny(method, "--limit-train", "16"), "--out", out]
        run_main(module, argv, before=before, after=after, steps=1)
    net = seen.pop("net")
    backbone = {id(p) for m in net.modules() if isinstance(m, common.ResNet)
                for p in m.parameters()}
    seen["backbone"] = [id(p) in backbone for p in net.parameters()]
    return seen


def first_steps(out, *methods):
    """first_step of each method in turn -> {method: its result}."""
    return {m: first_step(m, os.path.join(out, m)) for m in methods}


@pytest.fixture(scope="module")
def one_process_steps(tmp_path_factory):
    """one_process_steps(method) -> its first_step in this process, made once."""
    root = tmp_path_factory.mktemp("one_process_steps")
    done = {}

    def step(method):
        if method not in done:
            done[method] = first_step(method, root / method)
        return done[method]
    return step


@pytest.fixture(scope="module")
def two_process_steps(request, tmp_path_factory):
    """{method: (rank 0's first_step, rank 1's)} at 2 gloo processes, every selected method in
    one torchrun."""
    selected = sorted({item.callspec.params["method"] for item in request.session.items
                       if item.module is request.module and "two_processes" in item.name})
    root = tmp_path_factory.mktemp("two_process_steps")
    ranks = run_distributed("test_each_method", "first_steps", root, root, *selected)
    return {m: (ranks[0][m], ranks[1][m]) for m in selected}


@pytest.mark.rule("backbone-gradient")
@pytest.mark.parametrize("method", METHODS)
def test_a_first_step_moves_the_backbone_down_the_losss_gradient(method, one_process_steps):
    """The loss of main()'s first step reaches the backbone (every common.ResNet in the network),
    a finite gradient that is not zero, and the step moves the backbone against it (measured: the
    update's cosine with minus the gradient 0.9999 or more; weight decay alone would move it too).
    A loss multiplied by 0 fails here in a second (the learning runs take minutes to see it)."""
    step = one_process_steps(method)
    mine = [b and g is not None for g, b in zip(step["grads"], step["backbone"])]
    assert any(mine), f"{method}: no gradient reaches the backbone"
    grad = torch.cat([g.flatten() for g, m in zip(step["grads"], mine) if m])
    update = torch.cat([u.flatten() for u, m in zip(step["updates"], mine) if m])
    assert torch.isfinite(grad).all() and grad.norm() > 0, f"{method}: gradient {grad.norm()}"
    assert torch.dot(update, -grad) > 0, f"{method}: the step does not descend"


@pytest.mark.rule("two-processes")
@pytest.mark.parametrize("method", METHODS)
def test_two_processes_take_the_first_step_one_process_takes(method, one_process_steps,
                                                              two_process_steps):
    """main()'s first step in float64, 16 images as 2 gloo processes of 8 and as one of 16: each
    rank's gradient (DDP's average) and update of the parameters are one process's to 1e-9 of
    their size (measured: 7e-15 to 6e-14), and so is the mean of the ranks' losses. Negatives
    gathered without their gradient fail here, while their loss is the same."""
    one = one_process_steps(method)
    ranks = two_process_steps[method]
    mean = sum(two["loss"] for two in ranks) / len(ranks)
    assert mean == pytest.approx(one["loss"], rel=1e-9, abs=1e-12)
    for rank, two in enumerate(ranks):
        assert [g is None for g in two["grads"]] == [g is None for g in one["grads"]], rank
        for name in ("grads", "updates"):
            pairs = [(a, b) for a, b in zip(one[name], two[name]) if a is not None]
            first = torch.cat([a.flatten() for a, _ in pairs])
            second = torch.cat([b.flatten() for _, b in pairs])
            error = (first - second).norm() / first.norm()
            assert error < 1e-9, f"{method} rank {rank}: {name} differ by {error:.2e} of their size"


def test_run_main_sees_each_steps_networks(tmp_path):
    """helpers.run_main gives each train_step call's own arguments (here MoCo v2's query network,
    key encoder and queue), and ends main after the steps asked."""
    import moco_simmoco_simco

    seen = []
    argv = [*tiny("moco_simmoco_simco"), "--method", "mocov2", "--queue-size", "32",
            "--out", tmp_path / "run"]
    taken = run_main(moco_simmoco_simco, argv, steps=2,
                     after=lambda i, a, k, r: seen.append(len(modules_of(a, k))))
    assert taken == 2 and seen == [3, 3]
