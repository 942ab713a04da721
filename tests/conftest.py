import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # `import common` under plain `pytest`

from helpers import tiny_image_folder  # noqa: E402


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
    """A 3-class ImageFolder of 20x24 px PNGs: 72 training and 18 validation images."""
    return tiny_image_folder(str(tmp_path_factory.mktemp("tiny_folder")))
