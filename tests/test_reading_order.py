"""common.py puts the reader's path first: Part 1, what the methods build on, comes before Part 2,
the plumbing that changes nothing a method computes; the module docstring lists every section;
no loss, head or model of a method file calls a Part 2 function."""
import ast
import importlib
import inspect
import re

import pytest

import common
from helpers import METHODS

SOURCE = inspect.getsource(common)
BANNER = re.compile(r"^# -+ (.+)$", re.M)
PLUMBING_IN_METHOD_FILES = {"main", "parse_args"}  # the only places a method file may call Part 2


def parts():
    """(Part 1 names, Part 2 names, Part 1 section titles, Part 2 section titles)."""
    split = SOURCE.index("# Part 2:")
    assert SOURCE.index("# Part 1:") < split
    names = ([], [])
    for node in ast.parse(SOURCE).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            start = len("\n".join(SOURCE.splitlines()[:node.lineno - 1]))
            names[start > split].append(node.name)
    titles = BANNER.findall(SOURCE)
    cut = len(BANNER.findall(SOURCE[:split]))
    return names[0], names[1], titles[:cut], titles[cut:]


def test_part_one_holds_what_the_methods_build_on_and_comes_first():
    first, second, _, _ = parts()
    for name in ("gather_with_grad", "GlobalBatchNorm", "ResNet", "Augment", "colour_jitter",
                 "load_data", "image_folder", "ImageFiles", "train_batches", "knn_accuracy",
                 "linear_probe", "split_features", "LARS", "learning_rate"):
        assert name in first, name
    for name in ("run", "parse_args", "setup", "open_run", "EpochMeter", "Run", "write_atomic"):
        assert name in second, name


def test_the_module_docstring_lists_both_parts_sections():
    _, _, one, two = parts()
    doc = common.__doc__
    assert doc.index("Part 1") < doc.index("Part 2")
    for title in one:
        assert title in doc[:doc.index("Part 2")], title
    for title in two:
        assert title in doc[doc.index("Part 2"):], title


@pytest.mark.rule("part-two")
@pytest.mark.parametrize("method", METHODS)
def test_no_loss_head_or_model_of_a_method_file_calls_part_two(method):
    """Every function and class of a method file but main() and parse_args() (its losses, heads,
    FIFOs, training step, recipes) uses only Part 1 of common.py."""
    _, second, _, _ = parts()
    tree = ast.parse(inspect.getsource(importlib.import_module(method)))
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            continue
        if node.name in PLUMBING_IN_METHOD_FILES:
            continue
        used = {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
                and isinstance(n.value, ast.Name) and n.value.id == "common"}
        assert not used & set(second), (method, node.name, used & set(second))
