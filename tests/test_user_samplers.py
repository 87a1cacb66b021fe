"""The fast path with samplers of the user's: the epoch they are given, and samples given twice."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torchvision
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T

import fastload
from fastload._engine import SampleKeys


def _train(root: Path) -> Any:
    tf = T.Compose([T.RandomResizedCrop(24), T.RandomHorizontalFlip(), T.PILToTensor()])
    return torchvision.datasets.ImageFolder(root / "train", transform=tf)


def _by_sample(loader: Any, order: list[int]) -> dict[int, torch.Tensor]:
    images = [image for batch, _ in loader for image in batch]
    assert len(images) == len(order)
    return dict(zip(order, images, strict=True))


def test_a_users_distributed_samplers_epoch_is_the_fast_paths(imagenet_root: Path) -> None:
    """torchvision's reference script calls ``train_sampler.set_epoch(epoch)`` on torch's
    DistributedSampler: a job restarted at epoch 1 (a new loader) draws epoch 1's augmentations,
    not epoch 0's again, and an uninterrupted loader's epochs differ."""
    dataset = _train(imagenet_root)

    def run(epochs: list[int]) -> dict[int, dict[int, torch.Tensor]]:
        torch.manual_seed(0)  # the script's seed: the loader's (seed=None) is drawn from it
        sampler = DistributedSampler(dataset, num_replicas=1, rank=0)
        loader = fastload.DataLoader(dataset, batch_size=4, sampler=sampler, num_workers=0)
        assert loader.path == "fast"
        seen = {}
        for epoch in epochs:
            sampler.set_epoch(epoch)
            seen[epoch] = _by_sample(loader, list(sampler))
            assert loader.epoch == epoch + 1  # the next pass's, unless the sampler is told another
        return seen

    full, restarted = run([0, 1]), run([1])
    assert all(torch.equal(full[1][i], restarted[1][i]) for i in full[1])
    assert sum(torch.equal(full[0][i], full[1][i]) for i in full[0]) < len(dataset) // 4


def test_a_sampler_without_set_epoch_still_gets_new_augmentations(imagenet_root: Path) -> None:
    """A sampler whose epoch never changes: the loader's own epochs go on (a new one each pass)."""
    dataset = _train(imagenet_root)
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=False)
    loader = fastload.DataLoader(dataset, batch_size=4, sampler=sampler, num_workers=0)
    first, second = (_by_sample(loader, list(sampler)) for _ in range(2))
    assert loader.epoch == 2
    assert sum(torch.equal(first[i], second[i]) for i in first) < len(dataset) // 4


class _Repeats(torch.utils.data.Sampler[int]):
    """Each sample ``times`` times in a row, as repeated augmentation (``RASampler``) gives them."""

    def __init__(self, n: int, times: int) -> None:
        self.n, self.times = n, times

    def __len__(self) -> int:
        return self.n * self.times

    def __iter__(self) -> Any:
        return (i for i in range(self.n) for _ in range(self.times))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_sample_given_twice_gets_its_own_augmentation_each_time(
    imagenet_root: Path, num_workers: int
) -> None:
    """Each copy of a sample (in the same batch or the next) has its own crop and flip; the
    batches are the same for any number of workers."""
    dataset = _train(imagenet_root)
    n = len(dataset)
    loader = fastload.DataLoader(
        dataset, batch_size=5, sampler=_Repeats(n, 3), num_workers=num_workers, seed=0
    )
    assert loader.path == "fast"
    images = torch.stack([image for batch, _ in loader for image in batch]).view(n, 3, 3, 24, 24)
    identical = sum(torch.equal(images[i, 0], images[i, k]) for i in range(n) for k in (1, 2))
    assert identical < n // 4
    reference = fastload.DataLoader(dataset, batch_size=5, sampler=_Repeats(n, 3), num_workers=0, seed=0)
    assert torch.equal(
        torch.stack([image for batch, _ in reference for image in batch]).view_as(images), images
    )


def test_a_pass_with_repeated_samples_resumes_exactly(imagenet_root: Path) -> None:
    """A job restarted inside an epoch of a sampler giving samples twice (repeated augmentation
    over two ranks, torch's DistributedSampler padding): the rest of the pass is the rest of the
    uninterrupted one, each copy with the augmentation it had there."""
    dataset = _train(imagenet_root)

    def make(num_workers: int) -> Any:
        sampler = _Repeats(len(dataset), 2)
        return fastload.DataLoader(dataset, batch_size=3, sampler=sampler, num_workers=num_workers, seed=1)

    whole = [images for images, _ in make(0)]
    loader = make(2)
    it = iter(loader)
    for _ in range(5):
        next(it)
    state = loader.state_dict()
    del it
    restarted = make(2)
    restarted.load_state_dict(state)
    rest = [images for images, _ in restarted]
    assert len(rest) == len(whole) - 5
    assert all(torch.equal(a, b) for a, b in zip(rest, whole[5:], strict=True))


def test_sample_keys_tell_copies_and_ranks_apart() -> None:
    batches = [np.array([3, 4]), np.array([3, 3, 5]), np.array([11]), np.array([4])]
    keys = SampleKeys(10, rank=0, replicas=1)
    assert keys.of(0, batches) is None  # each sample once, one rank: its own index
    assert keys.of(1, batches).tolist() == [13, 23, 5]  # copies 1 and 2 of sample 3
    assert keys.of(1, batches).tolist() == [13, 23, 5]  # asked again: the same
    assert keys.of(2, batches) is None  # out of range: the worker names the sample
    resumed = SampleKeys(10, rank=0, replicas=1)
    assert resumed.of(3, batches).tolist() == [14]  # a pass resumed at batch 3: the copies before count
    ranked = SampleKeys(10, rank=1, replicas=2)
    assert ranked.of(0, [np.array([3, 3])]).tolist() == [13, 33]  # rank 1 of 2: copy k at i + 10 (2k + 1)


def test_a_state_inside_an_epoch_of_torchs_random_sampler_is_refused(imagenet_root: Path) -> None:
    """torch's RandomSampler orders a pass by the RNG's state when it starts: a restarted job
    would skip other samples than those seen. The resume is refused, naming the ways that work;
    a state at an epoch's end resumes."""
    dataset = _train(imagenet_root)

    def make() -> Any:
        return fastload.DataLoader(
            dataset, batch_size=4, sampler=torch.utils.data.RandomSampler(dataset), num_workers=0
        )

    loader = make()
    it = iter(loader)
    next(it)
    inside = loader.state_dict()
    with pytest.raises(fastload.ResumeError, match=r"inside an epoch of torch's RandomSampler.*shuffle=True"):
        make().load_state_dict(inside)
    for _ in it:
        pass
    ended = loader.state_dict()
    restarted = make()
    restarted.load_state_dict(ended)
    assert len(list(restarted)) == len(loader)


def test_normalize_with_a_zero_std_raises_torchvisions_error(imagenet_root: Path) -> None:
    tf = T.Compose([T.Resize(16), T.CenterCrop(16), T.ToTensor(), T.Normalize([0.5] * 3, [0.5, 0.0, 0.5])])
    dataset = torchvision.datasets.ImageFolder(imagenet_root / "val", transform=tf)
    for cls in (torch.utils.data.DataLoader, fastload.DataLoader):
        with pytest.raises(ValueError, match="std evaluated to zero"):
            next(iter(cls(dataset, batch_size=4, num_workers=0)))
