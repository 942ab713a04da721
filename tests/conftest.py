import os
import sys

import pytest
import torch

# `import common` under plain `pytest`
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import helpers  # noqa: E402
from helpers import tiny_image_folder  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "rule(name): holds every method file to the README's checklist line `name` "
        "(\"Adding a method\"); `pytest -m rule` runs them all")


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
    """A 3-class ImageFolder of 20x24 px PNGs: 72 training and 18 validation images."""
    return tiny_image_folder(str(tmp_path_factory.mktemp("tiny_folder")))


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """One intra-op thread, as the subprocess runs have (OMP_NUM_THREADS=1): on a 2-core machine
    more threads only oversubscribe the cores that the torchrun workers also need."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(name="float64")
def float64_fixture():
    with helpers.float64():
        yield
