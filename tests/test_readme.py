"""README.md states what the code does: the functions its "where each idea lives" table names exist,
each settings table's values are the parsers' defaults, the linear protocols are the code's, its
DCLW weight is the one dclw_weights computes, each paper's path to learn it selects the tests it
promises, and "Adding a method" lists every rule the tests hold a method file to."""
import argparse
import ast
import importlib
import math
import os
import re
import subprocess
import sys

import pytest
import torch

import common
import nnclr_dcl
import simclr_dcl
from helpers import METHODS, ROOT, TESTS, readme_quick_start

SCRIPTS = METHODS
# the paper identities and changes the table must map to code, by words of their row
IDEAS = ("DCL Prop. 2", "DCLW weight", "DT Eq. 4", "DT Eq. 9", "GSG Eq. 6", "NNCLR's support set",
         "the gather's backward", "GlobalBatchNorm", "online linear probe", "LARS",
         "colour jitter in a random order")


def readme():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return f.read()


def section(text, heading):
    """The text under `heading` (a line starting with it) up to the next heading of its level."""
    level = heading.split(" ")[0]
    start = text.index("\n" + heading) + 1
    after = re.search(rf"^{level} ", text[start + len(heading):], re.MULTILINE)
    return text[start:start + len(heading) + after.start()] if after else text[start:]


def tables(text):
    """Every markdown table in `text` -> list of (header cells, rows of cells)."""
    found, rows = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif rows:
            found.append((rows[0], [r for r in rows[2:]]))  # rows[1] is the |---| line
            rows = []
    return found


def code_spans(cell):
    return re.findall(r"`([^`]*)`", cell)


def default_args(script):
    return importlib.import_module(script).parse_args([])


# ---- the idea table

def idea_rows():
    (header, rows), = tables(section(readme(), "## Where each idea lives"))
    assert header == ["idea", "file", "function"]
    return rows


@pytest.mark.rule("quick-start-line")
@pytest.mark.parametrize("script", SCRIPTS)
def test_the_quick_start_opens_with_a_textures_run_of_every_script(script):
    """Its first commands: T (--dataset textures, a warm-up shorter than the run) and one run of
    each script on it; this script's parses and names the kNN untrained -> trained it reaches."""
    t, lines = readme_quick_start()
    runs = [line.split("#")[0].split() for line in lines[:len(SCRIPTS)]]
    assert sorted(run[:3] for run in runs) == [["python", f"{s}.py", "$T"] for s in SCRIPTS]
    mine = [run[1] for run in runs].index(f"{script}.py")
    args = importlib.import_module(script).parse_args(t + runs[mine][3:])
    assert args.dataset == "textures" and args.epochs > args.warmup_epochs
    # kNN as the median (range) over seeds, untrained -> trained
    number = r"([\d.]+) \(([\d.]+)-([\d.]+)\)"
    line = lines[mine]
    found = re.search(f"kNN {number} -> {number}", line)
    assert found, line
    for first in (1, 4):  # untrained, trained
        mid, low, high = (float(found.group(first + i)) for i in range(3))
        assert low <= mid <= high, line


def test_the_idea_table_has_a_row_per_paper_identity_naming_existing_functions(monkeypatch):
    """A row for each of IDEAS; every file and function a row names exists."""
    rows = idea_rows()
    for words in IDEAS:
        assert any(words in idea for idea, _, _ in rows), f"no row for {words!r}"
    for idea, file_cell, function_cell in rows:
        (file,) = code_spans(file_cell)
        assert os.path.isfile(os.path.join(ROOT, file)), (idea, file)
        names = code_spans(function_cell)
        assert names, idea
        monkeypatch.syspath_prepend(os.path.join(ROOT, os.path.dirname(file)))  # benchmarks/
        for name in names:
            thing = importlib.import_module(os.path.basename(file).removesuffix(".py"))
            for part in name.split("."):  # dotted: a class's method
                assert hasattr(thing, part), f"{idea!r}: {file} has no {name}"
                thing = getattr(thing, part)
            assert callable(thing), (idea, name)


# ---- settings tables

def settings_tables():
    """{script or "common": [(options, values)]} from the Settings section's tables."""
    found = {}
    for header, rows in tables(section(readme(), "## Settings")):
        title = code_spans(header[0])
        if header[1] != "value" or not header[2].startswith("source") or not title:
            continue
        script = "common" if title[0] == "common.py" else title[0].removesuffix(".py")
        for row in rows:
            options = re.findall(r"`(--[a-z0-9-]+)`", row[0])
            values = code_spans(row[1])
            assert len(options) == len(values), f"{script}: {row[0]} has {len(values)} values"
            found.setdefault(script, []).extend(zip(options, values))
    return found


def agrees(text, default):
    """Does the README's value `text` state the parser's `default`?"""
    if isinstance(default, bool):
        return text == ("on" if default else "off")
    if isinstance(default, (list, tuple)):
        return len(text.split()) == len(default) and all(
            math.isclose(float(t), d) for t, d in zip(text.split(), default))
    if isinstance(default, (int, float)):
        return math.isclose(float(text), default)
    return text == default


def mismatches(stated, args, script):
    wrong = []
    for option, text in stated:
        dest = option[2:].replace("-", "_")
        assert hasattr(args, dest), f"{script}.py has no option {option}"
        if not agrees(text, getattr(args, dest)):
            wrong.append(f"{script}.py {option}: README {text}, parser {getattr(args, dest)!r}")
    return wrong


@pytest.mark.rule("settings-table")
@pytest.mark.parametrize("script", SCRIPTS)
def test_settings_tables_state_each_scripts_parser_defaults_and_every_one_it_sets(script):
    """Each `--option` row of the script's table is its parse_args([]) default; the common
    table's rows hold for it where its own table does not state that option. A default the script
    sets (one the shared parser lacks or sets otherwise) has its row, so no setting can be added
    or changed without the README."""
    stated = settings_tables()
    assert set(stated) == {"common", *SCRIPTS}
    own = {option for option, _ in stated[script]}
    shared = [(o, v) for o, v in stated["common"] if o not in own]
    wrong = mismatches(stated[script] + shared, default_args(script), script)
    assert not wrong, "\n".join(wrong)
    parser = argparse.ArgumentParser()
    common.add_common_args(parser)
    base = vars(parser.parse_args([]))
    for dest, value in vars(default_args(script)).items():
        if dest in ("out", "script", "argv") or value is None or value is False:
            continue  # the run folder, the command line; options off unless given
        if dest not in base or base[dest] != value:
            assert f"--{dest.replace('_', '-')}" in own, f"{script}.py sets --{dest} {value!r}"


def test_linear_eval_protocol_table_is_the_codes():
    """benchmarks/README.md's table of linear_eval.py's protocols is its PROTOCOLS."""
    with open(os.path.join(ROOT, "benchmarks", "README.md"), encoding="utf-8") as f:
        (header, rows), = tables(section(f.read(), "## linear_eval.py"))
    assert header[:6] == ["`--protocol`", "optimiser", "lr", "epochs", "batch", "schedule"]
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    protocols = importlib.import_module("linear_eval").PROTOCOLS
    assert [code_spans(row[0])[0] for row in rows] == list(protocols)
    for row, own in zip(rows, protocols.values()):
        stated = [row[1], float(row[2]), int(row[3]), int(row[4]), row[5].split(":")[0]]
        assert stated == [own[k] for k in ("optimizer", "lr", "epochs", "batch", "schedule")], row


# ---- formulas

DCLW_WEIGHT = "w_i = 2 - exp(s_i / sigma) / mean_j exp(s_j / sigma)"


def squeeze(text):
    return " ".join(text.split())


def test_readme_formulas_are_the_loss_functions_own():
    """The README's loss formulas are those the functions' docstrings state (and the identity
    tests check); DCLW's weight takes the positive pair's cosine s_i, not tau * pos."""
    text = squeeze(readme())
    assert "`s_i = <z_i^(1), z_i^(2)>` the cosine" in text
    assert DCLW_WEIGHT in text and "tau pos_i" not in text
    assert DCLW_WEIGHT in squeeze(simclr_dcl.dclw_weights.__doc__)
    assert DCLW_WEIGHT in squeeze(nnclr_dcl.dclw_weights.__doc__)
    for formula in ("-pos + log(exp(pos) + U", "-pos + log U", "-w_i pos + log U"):
        assert formula in text and formula in squeeze(simclr_dcl.contrastive_loss.__doc__)
    eq9 = "L_i = sg(W_i(tau_beta) / W_i(tau_alpha)) * InfoNCE_i(tau_alpha)"
    mss = importlib.import_module("moco_simmoco_simco")
    assert eq9 in text and eq9 in squeeze(mss.dual_temperature_loss.__doc__)


@pytest.mark.parametrize("sigma", [0.5, 2.0])
def test_dclw_weight_as_the_readme_writes_it_is_dclw_weights(sigma):
    s = torch.linspace(-0.9, 0.95, 7, dtype=torch.float64)  # cosines of 7 positive pairs
    readme_w = 2 - torch.exp(s / sigma) / torch.exp(s / sigma).mean()
    assert torch.allclose(simclr_dcl.dclw_weights(s, sigma), readme_w, atol=1e-12)


# ---- adding a method

def rules_the_tests_hold():
    """{name: [test, ...]} of every `@pytest.mark.rule(name)` on a test in tests/."""
    rules = {}
    for file in sorted(os.listdir(TESTS)):
        if not file.endswith(".py"):
            continue
        with open(os.path.join(TESTS, file), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for test in ast.walk(tree):
            for mark in getattr(test, "decorator_list", []):
                if isinstance(mark, ast.Call) and ast.unparse(mark.func) == "pytest.mark.rule":
                    rules.setdefault(mark.args[0].value, []).append(f"{file}::{test.name}")
    return rules


def test_adding_a_method_lists_every_rule_the_tests_hold_a_method_file_to():
    """"Adding a method" is a checklist, a line `- `NAME`: ...` for each rule some test holds
    every method file to (`@pytest.mark.rule(NAME)`), and no other."""
    listed = re.findall(r"^- `([a-z0-9-]+)`", section(readme(), "## Adding a method"), re.M)
    held = rules_the_tests_hold()
    assert len(listed) == len(set(listed)), listed
    assert not set(held) - set(listed), f"rules without a README line: {set(held) - set(listed)}"
    assert not set(listed) - set(held), f"README lines no test holds: {set(listed) - set(held)}"


# ---- the two commands

def test_ci_runs_exactly_the_readmes_install_and_test_commands():
    """.ci/run's commands are lines of the README's code blocks, word for word: CI then fails
    whenever a newcomer following the README would."""
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        ci = [line.strip() for line in f if line.strip()]
    commands = [line for line in ci if not line.startswith(("#", "set ", "cd "))]
    shown = {line.split("  #")[0].strip() for line in readme().splitlines()
             if line.startswith("    ")}
    assert any("pip install" in c for c in commands), commands
    assert any("pytest" in c for c in commands), commands
    missing = [c for c in commands if c not in shown]
    assert not missing, f".ci/run runs {missing}, which the README does not show"


# ---- the paths to learn each paper

def selected(node_ids, expression):
    """The node ids `pytest -k "word or word ..."` keeps: each word matched, case-insensitively,
    in the node id."""
    words = expression.split(" or ")
    assert all(re.fullmatch(r"\w+", word) for word in words), f"-k {expression}: words joined by or"
    return [node for node in node_ids if any(word.lower() in node.lower() for word in words)]


def test_each_path_to_learn_a_paper_selects_the_tests_it_promises():
    """Each "A path to learn it" pytest command, `-k` and all, selects as many tests as the
    `N passed` the README says it prints."""
    command = r'`python -m pytest -q (tests/\S+) -k ("[^"]+"|\S+)` prints `(\d+) passed`'
    promised = re.findall(command, squeeze(readme()))
    assert len(promised) == 3, promised  # DCL, DT, GSG
    listed = subprocess.run(  # one collection of the three files, as pytest sees them
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
         *sorted({path for path, _, _ in promised})],
        cwd=ROOT, capture_output=True, text=True)
    assert listed.returncode == 0, listed.stdout + listed.stderr
    node_ids = [line for line in listed.stdout.splitlines() if "::" in line]
    for path, expression, count in promised:
        ours = [node for node in node_ids if node.startswith(path + "::")]
        chosen = selected(ours, expression.strip('"'))
        assert len(chosen) == int(count), f"{path} -k {expression}: {chosen}, README {count}"
