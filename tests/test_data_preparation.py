"""Preparing CIFAR/STL-10 on a cluster: nodes sharing --data-dir download into it one at a time,
and a node that cannot reach the others over gloo fails in minutes, not hours. The download is a
fake (the dataset class monkeypatched): what is tested is the coordination around it."""

import argparse
import datetime
import multiprocessing
import os
import pickle
import threading
import time

import numpy as np
import torch
import torch.distributed as dist
import torchvision

import common


class FakeCIFAR10:
    """Stands in for torchvision's CIFAR10: download=True "downloads and extracts" for 0.3 s into
    root, noting when it ran in `downloads`; the data are four black images."""

    filename, base_folder = "cifar-10-python.tar.gz", "cifar-10-batches-py"
    downloads = []  # (start, end) of each download=True call

    def __init__(self, root, train=True, download=False):
        if download:
            start = time.monotonic()
            os.makedirs(os.path.join(root, self.base_folder), exist_ok=True)
            time.sleep(0.3)
            self.downloads.append((start, time.monotonic()))
        self.data, self.targets = np.zeros((4, 32, 32, 3), np.uint8), [0, 1, 2, 3]


def cifar_args(data_dir):
    return argparse.Namespace(dataset="cifar10", data_dir=str(data_dir))


def test_nodes_sharing_a_data_dir_download_one_at_a_time(tmp_path, monkeypatch):
    """Two first processes of two nodes prepare CIFAR-10 in the same --data-dir at the same moment:
    the file lock in --data-dir lets one download and extract while the other waits."""
    monkeypatch.setattr(torchvision.datasets, "CIFAR10", FakeCIFAR10)
    monkeypatch.setattr(FakeCIFAR10, "downloads", [])
    ctx = common.Context(0, 1, 0, torch.device("cpu"), out="", amp=False)  # each a node's rank 0
    start = threading.Barrier(2)
    shapes = []

    def prepare():
        start.wait()
        images, _ = common.torchvision_split(cifar_args(tmp_path), ctx, None, train=True)
        shapes.append(images.shape)
    nodes = [threading.Thread(target=prepare) for _ in range(2)]
    for node in nodes:
        node.start()
    for node in nodes:
        node.join()
    assert shapes == [(4, 3, 32, 32)] * 2
    (_, first_end), (second_start, _) = sorted(FakeCIFAR10.downloads)
    assert first_end <= second_start, "the two downloads overlapped"


def in_two_processes(function, tmp_path, *args):
    """function(*args) in 2 gloo processes forked from this one -> each rank's result. Forked, not
    torchrun's fresh interpreters: importing torch twice more would take most of the test."""
    def rank_process(rank):
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=rank,
                                world_size=2)
        result = function(*args)
        dist.destroy_process_group()
        with open(tmp_path / f"result.{rank}", "wb") as f:
            pickle.dump(result, f)
    ranks = [multiprocessing.get_context("fork").Process(target=rank_process, args=(r,))
             for r in range(2)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=60)
    for process in ranks:
        process.kill()  # one still waiting (the old 6-hour group) must not outlive the test
    assert [p.exitcode for p in ranks] == [0, 0], "a rank failed or was still waiting after 60 s"
    return [pickle.load(open(tmp_path / f"result.{r}", "rb")) for r in range(2)]


def prepare_with_a_silent_peer(data_dir):
    """2 gloo processes prepare CIFAR-10 together (both get the data); then rank 1 stays away, as
    a node whose gloo cannot reach the others -> on rank 0, (shape, error line, seconds to it)."""
    torchvision.datasets.CIFAR10 = FakeCIFAR10
    common.CONNECT_TIMEOUT = datetime.timedelta(seconds=2)
    ctx = common.Context(dist.get_rank(), 2, dist.get_rank(), torch.device("cpu"), "", False)
    shape = tuple(common.torchvision_split(cifar_args(data_dir), ctx, None, train=True)[0].shape)
    if dist.get_rank() == 1:
        return shape, None, None
    start = time.monotonic()
    try:
        common.torchvision_split(cifar_args(data_dir), ctx, None, train=True)
    except common.UserError as error:
        return shape, str(error), time.monotonic() - start
    return shape, "no error", time.monotonic() - start


def test_a_node_that_cannot_connect_fails_in_minutes_with_one_line(tmp_path):
    """The data-preparation group connects before the download, with its own short time-out: a
    peer that never connects stops rank 0 with one line naming GLOO_SOCKET_IFNAME (here after the
    time-out set to 2 s; the 6 hours the download may take are not waited)."""
    results = in_two_processes(prepare_with_a_silent_peer, tmp_path, str(tmp_path / "data"))
    assert [r[0] for r in results] == [(4, 3, 32, 32)] * 2
    _, message, seconds = results[0]
    assert "GLOO_SOCKET_IFNAME" in message and "\n" not in message, message
    assert seconds < 30, seconds
