import pytest

from helpers import tiny_image_folder


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
    """A 3-class ImageFolder of 20x24 px PNGs: 72 training and 18 validation images."""
    return tiny_image_folder(str(tmp_path_factory.mktemp("tiny_folder")))
