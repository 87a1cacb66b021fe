"""Torch's defaults wherever fastload runs the user's code; fastload's own only where it runs every op.

Each stateful dataset below changes as it is called, or is changed by the loop between epochs. torch's
loader with the same arguments is the reference: fastload's must give the same batches, epoch after
epoch, with default arguments and with an explicit ``num_workers``.
"""

from __future__ import annotations

import logging
import os
import random
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset
from torchvision import datasets
from torchvision import transforms as T

import fastload
from fastload.device import auto_num_workers

EPOCHS = 3
N = 12

#: changed by the loop between epochs (a progressive-resize style global)
SCALE = 1


class Counter(Dataset[int]):
    def __init__(self) -> None:
        self.n = 0

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> int:
        self.n += 1
        return i * 100 + self.n


class Cache(Dataset[int]):
    def __init__(self) -> None:
        self.cache: dict[int, int] = {}

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> int:
        hit = int(i in self.cache)
        self.cache[i] = i
        return i * 10 + hit


class InPlaceOut(Dataset[int]):
    """``np.multiply(a, 2, a)``: the output array given by position."""

    def __init__(self) -> None:
        self.a = np.arange(N, dtype=np.int64)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> int:
        np.multiply(self.a, 2, self.a)
        return int(self.a[i]) + i


class Resized(Dataset[int]):
    """``ndarray.resize`` in place."""

    def __init__(self) -> None:
        self.buf = np.zeros(4, dtype=np.int64)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> int:
        self.buf.resize(len(self.buf) + 1, refcheck=False)
        return len(self.buf) * 10 + i


class LazyFile(Dataset[int]):
    """A file handle opened at the first read and kept; the offset read is the handle's state."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.handle: Any = None

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> int:
        if self.handle is None:
            self.handle = open(self.path, "rb")  # noqa: SIM115 - kept open on purpose
        byte = self.handle.read(1)
        return i * 1000 + (byte[0] if byte else 255)


class Generated(Dataset[int]):
    """A generator of its own, advanced by every sample."""

    def __init__(self) -> None:
        self.gen = iter(range(10**6))

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> int:
        return i * 1000 + next(self.gen)


class ReadsGlobal(Dataset[int]):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> int:
        return i * SCALE


class OwnRandom(Dataset[int]):
    """A random state held by the dataset."""

    def __init__(self) -> None:
        self.rng = random.Random(7)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> int:
        return i * 1000 + self.rng.randrange(1000)


def _file() -> str:
    fd, path = tempfile.mkstemp()
    os.write(fd, bytes(range(256)))
    os.close(fd)
    return path


MAKERS: dict[str, Callable[[], Dataset[int]]] = {
    "counter": Counter,
    "cache": Cache,
    "in-place out by position": InPlaceOut,
    "ndarray.resize": Resized,
    "lazy file handle": lambda: LazyFile(_file()),
    "generator": Generated,
    "module global changed between epochs": ReadsGlobal,
    "random state held": OwnRandom,
}


def _epochs(loader_class: Any, dataset: Dataset[int], **kwargs: Any) -> list[list[list[int]]]:
    global SCALE
    torch.manual_seed(0)
    loader = loader_class(dataset, batch_size=4, **kwargs)
    out = []
    for epoch in range(EPOCHS):
        SCALE = epoch + 1
        out.append([batch.tolist() for batch in loader])
    SCALE = 1
    return out


@pytest.mark.parametrize("workers", [None, 2], ids=["default arguments", "num_workers=2"])
@pytest.mark.parametrize("name", list(MAKERS))
def test_stateful_datasets_get_torchs_batches(name: str, workers: int | None) -> None:
    kwargs = {} if workers is None else {"num_workers": workers}
    expected = _epochs(TorchDataLoader, MAKERS[name](), **kwargs)
    got = _epochs(fastload.DataLoader, MAKERS[name](), **kwargs)
    assert got == expected
    if name in ("counter", "in-place out by position"):
        # in one process the state carries over between epochs; kept workers would carry it over too
        assert (expected[0] != expected[1]) is (workers is None)


def test_defaults_on_torchs_path_are_torchs() -> None:
    loader = fastload.DataLoader(Counter(), batch_size=4)
    assert loader.path == "torch"
    assert (loader.num_workers, loader.persistent_workers, loader.pin_memory, loader.limit_threads) == (
        0,
        False,
        False,
        False,
    )
    asked = fastload.DataLoader(Counter(), batch_size=4, num_workers="auto")
    assert asked.num_workers == auto_num_workers() > 0
    assert not asked.persistent_workers


def test_torchs_errors_for_arguments_that_need_workers() -> None:
    # with num_workers left to torch's default, as torch's loader raises
    for kwargs in (
        {"prefetch_factor": 2},
        {"persistent_workers": True},
        {"multiprocessing_context": "spawn"},
    ):
        with pytest.raises(ValueError) as torch_error:
            TorchDataLoader(Counter(), **kwargs)
        with pytest.raises(ValueError) as ours:
            fastload.DataLoader(Counter(), **kwargs)
        assert str(ours.value) == str(torch_error.value)


def test_fastloads_defaults_where_it_runs_every_op(imagenet_root: Any) -> None:
    train = os.path.join(imagenet_root, "train")
    tf = T.Compose([T.RandomResizedCrop(32), T.RandomHorizontalFlip(), T.ToTensor()])
    loader = fastload.DataLoader(datasets.ImageFolder(train, transform=tf), batch_size=8)
    assert loader.path == "fast"
    assert loader.num_workers == auto_num_workers() > 0
    assert loader.persistent_workers and loader.limit_threads
    # the same pipeline with a collate_fn of the user's: torch's defaults
    user = fastload.DataLoader(
        datasets.ImageFolder(train, transform=tf), batch_size=8, collate_fn=lambda b: b
    )
    assert (user.num_workers, user.persistent_workers, user.limit_threads) == (0, False, False)
    # a worker_init_fn of the user's: torch's defaults, even on the fast path
    init = fastload.DataLoader(datasets.ImageFolder(train, transform=tf), batch_size=8, worker_init_fn=print)
    assert (init.path, init.num_workers, init.persistent_workers) == ("fast", 0, False)


def test_head_acceleration_keeps_workers_only_with_torchvisions_ops(imagenet_root: Any) -> None:
    train = os.path.join(imagenet_root, "train")
    known = T.Compose([T.RandomResizedCrop(32), T.TrivialAugmentWide(), T.PILToTensor()])
    loader = fastload.DataLoader(datasets.ImageFolder(train, transform=known), batch_size=8)
    assert loader.path == "head-accelerated"
    assert loader.num_workers > 0 and loader.persistent_workers

    class Mine:
        def __call__(self, image: Any) -> Any:
            return image

    mine = T.Compose([T.RandomResizedCrop(32), Mine(), T.PILToTensor()])
    user = fastload.DataLoader(datasets.ImageFolder(train, transform=mine), batch_size=8)
    assert user.path == "head-accelerated"
    assert (user.num_workers, user.persistent_workers) == (0, False)
    lam = T.Compose([T.RandomResizedCrop(32), T.Lambda(lambda x: x), T.PILToTensor()])
    assert fastload.DataLoader(datasets.ImageFolder(train, transform=lam), batch_size=8).num_workers == 0


def test_the_path_line_says_where_torchs_default_loads(imagenet_root: Any, caplog: Any) -> None:
    """Where the user's code runs and num_workers is left to torch's default, the WARNING path line
    says that the loader runs in the main process and how to have workers: advice, not a change."""
    caplog.set_level(logging.INFO, logger="fastload")
    train = os.path.join(imagenet_root, "train")
    mine = T.Compose([T.RandomResizedCrop(32), T.Lambda(lambda x: x), T.PILToTensor()])
    loader = fastload.DataLoader(datasets.ImageFolder(train, transform=mine), batch_size=8)
    assert loader.num_workers == 0
    assert "it loads in the main process, as torch's default num_workers=0" in caplog.text
    assert "pass num_workers='auto'" in caplog.text
    caplog.clear()
    fastload.DataLoader(datasets.ImageFolder(train, transform=mine), batch_size=8, num_workers=1)
    assert "loads in the main process" not in caplog.text
    caplog.clear()
    fastload.DataLoader(Counter(), batch_size=4)  # a dataset of the user's: its reason, then the advice
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "runs torch's iterator for this Counter (no acceleration): Counter is not" in caplog.text
    assert "; it loads in the main process, as torch's default" in caplog.text
