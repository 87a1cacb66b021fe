"""Batches a user keeps are never overwritten; the usual loop keeps reusing the same buffers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fastload import gpu
from fastload import transforms as T
from fastload.imagefolder import ImageFolder
from fastload.loader import DataLoader


@pytest.fixture(scope="module")
def train_set(imagenet_root: Path) -> ImageFolder:
    return ImageFolder(
        imagenet_root / "train", transform=T.Compose([T.RandomResizedCrop(16), T.RandomHorizontalFlip()])
    )


def _reference(ds: ImageFolder, **kwargs: object) -> list[tuple[torch.Tensor, torch.Tensor]]:
    loader = DataLoader(ds, batch_size=2, shuffle=True, seed=4, num_workers=0, reuse_buffers=False, **kwargs)
    return [(x.clone(), y.clone()) for x, y in loader]


@pytest.mark.parametrize(("workers", "kind"), [(0, "process"), (2, "process"), (2, "thread")])
@pytest.mark.parametrize("device", [None, "cpu"])
def test_kept_batches_stay_intact(
    train_set: ImageFolder, workers: int, kind: str, device: str | None
) -> None:
    kwargs: dict[str, object] = {} if device is None else {"device": device}
    expected = _reference(train_set, **kwargs)
    loader = DataLoader(
        train_set, batch_size=2, shuffle=True, seed=4, num_workers=workers, worker_type=kind, **kwargs
    )
    kept = list(loader)  # all 16 batches held at once, with the defaults
    assert len(kept) == len(expected) == 16
    for (x, y), (ex, ey) in zip(kept, expected, strict=True):
        assert torch.equal(x, ex) and torch.equal(y, ey)
    again = list(loader)  # a second epoch while the first one's batches are still held
    assert all(torch.equal(x, ex) for (x, _), (ex, _) in zip(kept, expected, strict=True))
    assert len(again) == 16
    loader.close()


def test_kept_batches_with_gpu_transforms(train_set: ImageFolder) -> None:
    norm = gpu.Normalize([0.5, 0.5, 0.5], [0.25, 0.25, 0.25])
    expected = _reference(train_set, device="cpu", gpu_transforms=norm)
    kept = list(
        DataLoader(
            train_set, batch_size=2, shuffle=True, seed=4, num_workers=2, device="cpu", gpu_transforms=norm
        )
    )
    assert all(torch.equal(x, ex) for (x, _), (ex, _) in zip(kept, expected, strict=True))


@pytest.mark.parametrize("kind", ["process", "thread"])
def test_the_usual_loop_reuses_the_ring(train_set: ImageFolder, kind: str) -> None:
    loader = DataLoader(train_set, batch_size=2, shuffle=True, seed=4, num_workers=2, worker_type=kind)
    pointers = set()
    for _ in range(3):
        for images, _labels in loader:  # consume, drop: no extra buffers, the same few slots
            pointers.add(images.data_ptr())
    pool = loader._engine.pool
    assert pool is not None and pool.next_extra == pool.num_slots  # no extra slot was ever made
    assert len(pointers) <= pool.num_slots
    loader.close()


def test_a_view_or_array_of_a_batch_keeps_it(train_set: ImageFolder) -> None:
    expected = _reference(train_set)
    loader = DataLoader(train_set, batch_size=2, shuffle=True, seed=4, num_workers=2)
    first_pixels = None
    first_array = None
    for k, (images, _labels) in enumerate(loader):
        if k == 0:
            first_pixels = images[1, :, 2:5]  # a view of the batch
            first_array = images.numpy()  # an array over its memory
    assert first_pixels is not None and first_array is not None
    assert torch.equal(first_pixels, expected[0][0][1, :, 2:5])
    assert torch.equal(torch.from_numpy(first_array), expected[0][0])
