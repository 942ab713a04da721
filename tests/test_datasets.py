"""The CIFAR and STL-10 paths, run on tiny fakes written in torchvision's on-disk formats (pickled
CIFAR batches, STL-10's binary files; only torchvision's MD5 check disabled), and the generated
--dataset textures. Everything else is the real loading code and a real training run."""

import os
import pickle
import sys

import numpy as np
import pytest
import torch
import torchvision

import common
from helpers import check_run_folder, ctx_for, harness_module

harness = harness_module()  # the README's first quick-start script
CPU = ctx_for()


def coloured_images(n, size, seed):
    """n class-tinted uint8 images (n, 3, size, size) and their labels 0..9."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, n)
    images = rng.integers(0, 90, (n, 3, size, size))
    images[np.arange(n), labels % 3] += 150
    return images.astype(np.uint8), labels


@pytest.fixture
def no_md5(monkeypatch):
    monkeypatch.setattr(torchvision.datasets.CIFAR10, "_check_integrity", lambda self: True)
    monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", lambda *a, **k: True)
    monkeypatch.setattr(torchvision.datasets.STL10, "_check_integrity", lambda self: True)


def write_cifar10(root, train_per_batch=8, test=20):
    folder = os.path.join(root, "cifar-10-batches-py")
    os.makedirs(folder)
    batches = [(f"data_batch_{i}", train_per_batch) for i in range(1, 6)] + [("test_batch", test)]
    for seed, (name, n) in enumerate(batches):
        images, labels = coloured_images(n, 32, seed)
        with open(os.path.join(folder, name), "wb") as f:
            pickle.dump({"data": images.reshape(n, -1), "labels": labels.tolist()}, f)
    with open(os.path.join(folder, "batches.meta"), "wb") as f:
        pickle.dump({"label_names": [f"c{i}" for i in range(10)]}, f)
    return root


def write_stl10(root, train=12, unlabeled=20, test=10):
    folder = os.path.join(root, "stl10_binary")
    os.makedirs(folder)
    for seed, (split, n) in enumerate((("train", train), ("unlabeled", unlabeled), ("test", test))):
        images, labels = coloured_images(n, 96, seed)
        images.transpose(0, 1, 3, 2).tofile(os.path.join(folder, f"{split}_X.bin"))  # column-major
        if split != "unlabeled":
            (labels + 1).astype(np.uint8).tofile(os.path.join(folder, f"{split}_y.bin"))  # 1-based
    return root


def test_cifar10_is_decoded_once_to_uint8_on_the_device(tmp_path, no_md5):
    """(N, H, W, 3) pickles -> (N, 3, 32, 32) uint8; --limit-train cuts the train set."""
    root = write_cifar10(str(tmp_path))
    argv = ["--data-dir", root, "--device", "cpu", "--limit-train", "30", "--batch-size", "16"]
    data = common.load_data(harness.parse_args(argv), CPU)
    images, labels = coloured_images(8, 32, 0)
    assert data.train.dtype == torch.uint8 and data.train.shape == (30, 3, 32, 32)
    assert torch.equal(data.train[:8], torch.from_numpy(images))
    assert data.train_labels[:8].tolist() == labels.tolist()
    assert data.eval_test[0].shape == (20, 3, 32, 32)
    assert data.num_classes == 10 and data.image_size == 32


@pytest.mark.parametrize("dataset, write, kernel", [("cifar10", "write_cifar10", 3),
                                                     ("stl10", "write_stl10", 7)])
def test_training_run_on_the_fake_set_uses_the_stem_of_its_image_size(dataset, write, kernel,
                                                                      tmp_path, no_md5):
    """A full run on each loader writes its run folder; CIFAR's 32 px get the CIFAR stem (3x3),
    STL-10's 96 px the ImageNet one (7x7)."""
    root = globals()[write](str(tmp_path / "data"))
    out = tmp_path / "run"
    harness.main(["--dataset", dataset, "--data-dir", root, "--width", "8", "--epochs", "1",
                  "--batch-size", "16", "--device", "cpu", "--linear-epochs", "2", "--out",
                  str(out)])
    check_run_folder(out, epochs=1)
    assert torch.load(out / "backbone.pt")["conv1.weight"].shape[-1] == kernel


def test_stl10_pretrains_on_train_plus_unlabeled_and_evaluates_on_labelled_splits(tmp_path, no_md5):
    """train+unlabeled (labels -1 for the unlabeled part) for pre-training, train/test for
    evaluation."""
    root = write_stl10(str(tmp_path))
    argv = ["--dataset", "stl10", "--data-dir", root, "--device", "cpu", "--batch-size", "16"]
    data = common.load_data(harness.parse_args(argv), CPU)
    images, labels = coloured_images(12, 96, 0)
    assert data.train.shape == (32, 3, 96, 96) and data.image_size == 96
    assert torch.equal(data.train[:12], torch.from_numpy(images))
    assert data.train_labels[:12].tolist() == labels.tolist()
    assert (data.train_labels[12:] == -1).all()
    assert data.eval_train[0].shape == (12, 3, 96, 96)
    assert data.eval_test[0].shape == (10, 3, 96, 96)


@pytest.mark.parametrize("dataset, write, checks", [("cifar10", "write_cifar10", 2),
                                                     ("stl10", "write_stl10", 1)])
def test_each_split_is_read_once_and_the_files_checked_once_a_node(dataset, write, checks,
                                                                   tmp_path, monkeypatch):
    """common.load_data with torchvision's own classes: every process constructs the data set
    twice (CIFAR: train, test; STL-10: train+unlabeled, whose first rows are the train split, and
    test), and only a node's first process (LOCAL_RANK 0) checks the files' MD5, while
    constructing its first split."""
    root = globals()[write](str(tmp_path))
    cls = getattr(torchvision.datasets, dataset.upper())
    files = [name for name, _ in cls.train_list + cls.test_list]
    counts = {"constructions": 0, "file checks": 0}
    init = cls.__init__

    def construct(self, *args, **kwargs):
        counts["constructions"] += 1
        init(self, *args, **kwargs)

    def check(path, md5=None):  # the fakes' MD5s are not the real files'
        counts["file checks"] += os.path.basename(path) in files  # not CIFAR's label names
        return True

    monkeypatch.setattr(cls, "__init__", construct)
    monkeypatch.setattr(sys.modules[cls.__module__], "check_integrity", check)
    args = harness.parse_args(["--dataset", dataset, "--data-dir", root, "--device", "cpu",
                               "--batch-size", "8"])
    for local_rank, file_checks in ((0, checks * len(files)), (1, 0)):
        counts.update(dict.fromkeys(counts, 0))
        ctx = common.Context(local_rank, 1, local_rank, torch.device("cpu"), amp=False)
        data = common.load_data(args, ctx)
        assert counts == {"constructions": 2, "file checks": file_checks}, (local_rank, counts)
        assert data.eval_test[0].shape[0] in (10, 20)  # the fakes' test splits


def test_textures_are_generated_from_the_seed():
    """common.texture_images: the same seed gives the same images, another seed others; uint8
    (N, 3, 20, 20), 400 training and 100 test images per class."""
    (train, train_y), (test, test_y) = common.texture_images(0)
    (again, again_y), _ = common.texture_images(0)
    (other, _), _ = common.texture_images(1)
    assert train.dtype == torch.uint8 and train.shape == (2000, 3, 20, 20) and test.shape[0] == 500
    assert torch.equal(train, again) and torch.equal(train_y, again_y)
    assert not torch.equal(train, other)
    assert train_y.bincount().tolist() == [400] * 5 and test_y.bincount().tolist() == [100] * 5


def test_textures_are_held_like_cifar_and_nothing_is_written(tmp_path, monkeypatch):
    """--dataset textures: generated from --seed and held on the device as CIFAR is (eval_train is
    the training set); nothing is written outside the run folder."""
    monkeypatch.chdir(tmp_path)
    args = harness.parse_args(["--dataset", "textures", "--device", "cpu", "--seed", "3",
                               "--limit-train", "100", "--batch-size", "16"])
    data = common.load_data(args, CPU)
    (images, labels), (test, _) = common.texture_images(3)
    assert torch.equal(data.train, images[:100]) and torch.equal(data.train_labels, labels[:100])
    assert data.eval_train[0] is data.train and torch.equal(data.eval_test[0], test)
    assert (data.num_classes, data.image_size, data.streaming) == (5, 20, False)
    harness.main(["--dataset", "textures", "--width", "8", "--epochs", "1", "--batch-size", "64",
                  "--limit-train", "256", "--device", "cpu", "--linear-epochs", "1", "--out",
                  "run"])
    check_run_folder(tmp_path / "run", epochs=1)
    assert os.listdir(tmp_path) == ["run"]
