"""Fixtures of the fault suite: a folder of bad images next to good ones, as files, RAM and pack."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fastload.folder import scan_folder
from fastload.imagefolder import ImageFolder
from fastload.memory import InMemoryImageFolder
from fastload.pack import write_pack
from fastload.synthetic import make_imagenet_like

from ._faults import bad_images


@pytest.fixture(scope="session")
def bad_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``bad/<k>-<kind>.jpg`` for every bad image, and ``good/`` with 8 synthetic JPEGs."""
    root = tmp_path_factory.mktemp("faults") / "train"
    (root / "bad").mkdir(parents=True)
    for k, (kind, data) in enumerate(bad_images().items()):
        (root / "bad" / f"{k:02d}-{kind}.jpg").write_bytes(data)
    synth = make_imagenet_like(
        tmp_path_factory.mktemp("faults-good"), classes=1, per_class=8, val_per_class=0, seed=3, num_workers=1
    )
    (synth / "train" / next(iter(p.name for p in (synth / "train").iterdir()))).rename(root / "good")
    return root


@pytest.fixture(scope="session")
def bad_pack(bad_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("faults-pack") / "bad.fastpack"
    write_pack(scan_folder(bad_root), out, num_workers=0)
    return out


@pytest.fixture
def open_dataset(bad_root: Path, bad_pack: Path) -> Iterator[object]:
    """``open_dataset(storage, transform)``: the bad tree as files, in RAM or from the pack; closed after."""
    opened: list[InMemoryImageFolder] = []

    def make(storage: str, transform: object) -> ImageFolder | InMemoryImageFolder:
        if storage == "files":
            return ImageFolder(bad_root, transform=transform)
        ds = (
            InMemoryImageFolder(bad_root, transform=transform, num_threads=0)
            if storage == "ram"
            else InMemoryImageFolder.from_pack(bad_pack, transform=transform, in_memory=False)
        )
        opened.append(ds)
        return ds

    yield make
    for ds in opened:
        ds.close()
