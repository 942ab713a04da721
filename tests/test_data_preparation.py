"""Preparing CIFAR/STL-10 on a cluster: nodes sharing --data-dir download into it one at a time,
and on a node the first process downloads while the others wait (a fake download: what is tested
is the lock and the wait around it)."""

import argparse
import os
import threading
import time

import numpy as np
import torch
import torchvision

import common
from helpers import run_distributed


class FakeCIFAR10:
    """Stands in for torchvision's CIFAR10: download=True "downloads" for 0.3 s into root, noting
    when in `downloads`; the data are four black images."""

    filename, base_folder = "cifar-10-python.tar.gz", "cifar-10-batches-py"
    downloads = []  # (start, end) of each download=True call
    reads = []  # when each download=False call began

    def __init__(self, root, train=True, download=False):
        if download:
            start = time.monotonic()
            os.makedirs(os.path.join(root, self.base_folder), exist_ok=True)
            time.sleep(0.3)
            self.downloads.append((start, time.monotonic()))
        else:
            self.reads.append(time.monotonic())
        self.data, self.targets = np.zeros((4, 32, 32, 3), np.uint8), [0, 1, 2, 3]


def cifar_args(data_dir):
    return argparse.Namespace(dataset="cifar10", data_dir=str(data_dir), limit_train=None)


def test_nodes_sharing_a_data_dir_download_one_at_a_time(tmp_path, monkeypatch):
    """Two nodes' first processes prepare CIFAR-10 in the same --data-dir at the same moment: the
    file lock in --data-dir lets one download while the other waits."""
    monkeypatch.setattr(torchvision.datasets, "CIFAR10", FakeCIFAR10)
    monkeypatch.setattr(FakeCIFAR10, "downloads", [])
    ctx = common.Context(0, 1, 0, torch.device("cpu"), amp=False)  # each a node's rank 0
    start = threading.Barrier(2)
    shapes = []

    def prepare():
        start.wait()
        (images, _), = common.torchvision_splits(cifar_args(tmp_path), ctx, dict(train=True))
        shapes.append(images.shape)
    nodes = [threading.Thread(target=prepare) for _ in range(2)]
    for node in nodes:
        node.start()
    for node in nodes:
        node.join()
    assert shapes == [(4, 3, 32, 32)] * 2
    (_, first_end), (second_start, _) = sorted(FakeCIFAR10.downloads)
    assert first_end <= second_start, "the two downloads overlapped"


def _worker_node(data_dir):
    """A node's 2 processes prepare CIFAR-10's two splits -> this rank's download=True calls'
    (start, end) and download=False calls' starts, in time.monotonic (one clock a machine)."""
    torchvision.datasets.CIFAR10 = FakeCIFAR10
    rank = common.rank()
    ctx = common.Context(rank, 2, rank, torch.device("cpu"), amp=False)
    common.torchvision_splits(cifar_args(data_dir), ctx, dict(train=True), dict(train=False))
    return FakeCIFAR10.downloads, FakeCIFAR10.reads


def test_on_a_node_the_first_process_downloads_and_the_others_wait(tmp_path):
    """2 processes of a node (LOCAL_RANK 0 and 1): the first downloads once (0.3 s, its first
    split) and reads its second split; the other downloads nothing and reads both splits only
    after that download ended."""
    (first_downloads, first_reads), (downloads, reads) = run_distributed(
        "test_data_preparation", "_worker_node", tmp_path, str(tmp_path / "data"))
    assert len(first_downloads) == 1 and len(first_reads) == 1
    assert downloads == [] and len(reads) == 2
    assert min(reads) >= first_downloads[0][1], "a read began before the download ended"
