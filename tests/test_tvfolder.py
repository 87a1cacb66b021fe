"""The views over a torchvision DatasetFolder: torch's workers read fastload's index of the samples,
never ``dataset.samples``, and run ``DatasetFolder.__getitem__`` as written."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torchvision
from torchvision import transforms as v1

import fastload
from fastload.tvfolder import sample_index, worker_view

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def _val_v1() -> Any:  # reproduced by the fast path
    return v1.Compose([v1.Resize(40), v1.CenterCrop(32), v1.ToTensor(), v1.Normalize(MEAN, STD)])


class _OwnGetItem(torchvision.datasets.ImageFolder):
    def __getitem__(self, index: int) -> Any:
        image, target = super().__getitem__(index)
        return image, target * 10


def _custom_loader(path: str) -> Any:
    from PIL import Image

    with open(path, "rb") as f:
        return Image.open(f).convert("L").convert("RGB")


# ------------------------------------------------- workers read fastload's index, not dataset.samples


class _WatchedList(list):  # type: ignore[type-arg]
    """A ``samples`` list that notes, in a file, every read from a process other than its maker's."""

    def __init__(self, items: Any, marker: Path) -> None:
        super().__init__(items)
        self.owner = os.getpid()
        self.marker = str(marker)

    def _seen(self) -> None:
        if os.getpid() != self.owner:
            with open(self.marker, "a") as f:
                f.write(f"{os.getpid()}\n")

    def __getitem__(self, i: Any) -> Any:
        self._seen()
        return super().__getitem__(i)

    def __iter__(self) -> Any:
        self._seen()
        return super().__iter__()


def _jitter() -> Any:  # not reproduced by the fast path: torch's iterator runs it
    return v1.Compose([v1.RandomResizedCrop(32), v1.ColorJitter(0.3, hue=0.1), v1.ToTensor()])


def _watched(root: Path, transform: Any, marker: Path) -> Any:
    dataset = torchvision.datasets.ImageFolder(root, transform=transform)
    dataset.samples = _WatchedList(dataset.samples, marker)
    return dataset


def _same_batches(want: list[Any], got: list[Any], pixels: bool = True) -> None:
    assert len(want) == len(got)
    for (a, ya), (b, yb) in zip(want, got, strict=True):
        assert torch.equal(ya, yb)
        if pixels:
            assert torch.equal(a, b)


@pytest.mark.parametrize(
    "case, context",
    [("unrecognised", "fork"), ("recognised", "fork"), ("unrecognised", "spawn")],
)
def test_workers_never_read_the_sample_list(
    imagenet_root: Path, tmp_path: Path, case: str, context: str
) -> None:
    marker = tmp_path / "read-in-a-worker"
    transform = _jitter() if case == "unrecognised" else _val_v1()
    dataset = _watched(imagenet_root / "val", transform, marker)
    workers = 2 if context == "fork" else 1
    kwargs: dict[str, Any] = {"batch_size": 4, "num_workers": workers, "multiprocessing_context": context}
    # unrecognised: head acceleration at full-size decode, so the pixels are torch's too
    loader = fastload.DataLoader(dataset, **kwargs, exact_pixels=case == "unrecognised")
    assert loader.fast_path == (case == "recognised"), loader.fast_path_reason
    torch.manual_seed(0)  # the workers' seeds (ColorJitter draws from torch's RNG) come from it
    got = [(x.clone(), y.clone()) for x, y in loader]
    loader.close()
    assert not marker.exists(), "a worker read dataset.samples"
    assert loader.dataset is dataset
    torch.manual_seed(0)
    want = list(torch.utils.data.DataLoader(dataset, **kwargs))
    assert marker.exists()  # the control: torch's workers read the list (the check can fail)
    _same_batches(want, got, pixels=case == "unrecognised")  # recognised: within 1 level, tested above


def test_worker_view_runs_datasetfolder_getitem(imagenet_root: Path) -> None:
    def shift(target: int) -> int:
        return target + 10

    for root in (imagenet_root / "train", f"{imagenet_root / 'train'}/"):
        dataset = torchvision.datasets.ImageFolder(root, transform=_jitter(), target_transform=shift)
        view, reason = worker_view(dataset)
        assert view is not None and reason is None
        assert len(view) == len(dataset) and view.classes == dataset.classes
        assert view.class_to_idx == dataset.class_to_idx and view.root == dataset.root
        assert view.loader is dataset.loader and view.transform is dataset.transform
        assert list(view.samples) == dataset.samples
        for i in (0, 5, len(dataset) - 1, -1):
            torch.manual_seed(i)
            image, target = view[i]
            torch.manual_seed(i)
            want_image, want_target = dataset[i]
            assert torch.equal(image, want_image) and target == want_target and type(target) is int
    # a sample outside the root: whole paths are kept, still the same strings
    dataset = torchvision.datasets.ImageFolder(imagenet_root / "train")
    dataset.samples = [*dataset.samples, (str(next((imagenet_root / "val").rglob("*.JPEG"))), 1)]
    index = sample_index(dataset)
    assert index.root == "" and [index.paths[i] for i in range(len(index))] == [p for p, _ in dataset.samples]


class _SameGetItem(torchvision.datasets.ImageFolder):
    """A subclass that adds an attribute only: served from the index like the class itself."""

    note = "mine"


class _BoundTransform(torchvision.datasets.ImageFolder):
    def crop(self, image: Any) -> Any:
        return v1.functional.to_tensor(v1.functional.center_crop(image, 16))


def test_worker_view_keeps_datasets_that_may_read_themselves(imagenet_root: Path) -> None:
    root = imagenet_root / "val"
    assert worker_view(_SameGetItem(root, transform=_jitter()))[0] is not None
    bound = _BoundTransform(root)
    bound.transform = bound.crop
    own_targets = torchvision.datasets.ImageFolder(root, transform=_jitter())
    own_targets.samples = [(p, str(t)) for p, t in own_targets.samples]
    for dataset, word in (
        (_OwnGetItem(root, transform=_jitter()), "__getitem__"),
        (torchvision.datasets.ImageFolder(root, transform=_jitter(), loader=_custom_loader), "loader"),
        (bound, "method of the dataset"),
        (own_targets, "(str, str)"),
        (torch.utils.data.TensorDataset(torch.zeros(2)), "not a torchvision DatasetFolder"),
    ):
        view, reason = worker_view(dataset)
        assert view is None and reason is not None and word in reason, (type(dataset), reason)


def test_spawned_workers_get_compact_arrays_not_the_list(imagenet_root: Path) -> None:
    """What a spawn/forkserver worker unpickles for 200,000 samples: the relative paths' bytes and
    3 bytes a sample (a 1-byte path length and a 2-byte target), not one tuple per sample."""
    dataset = torchvision.datasets.ImageFolder(imagenet_root / "train", transform=_jitter())
    root = os.path.join(dataset.root, "")
    n = 200_000
    rel = [f"{dataset.classes[i % 4]}/{dataset.classes[i % 4]}_{i}.JPEG" for i in range(n)]
    dataset.samples = [(root + r, i % 4) for i, r in enumerate(rel)]
    view, reason = worker_view(dataset)
    assert view is not None, reason
    blob = pickle.dumps(view)
    path_bytes = sum(len(r) for r in rel)
    assert len(blob) <= path_bytes + 3 * n + 16_384, len(blob) - path_bytes
    assert len(pickle.dumps(dataset.samples)) > len(blob) + 10 * n  # the list it replaces
    again = pickle.loads(blob)
    assert again.samples[n - 1] == dataset.samples[n - 1] and len(again) == n


def test_torch_workers_follow_a_changed_sample_list(imagenet_root: Path) -> None:
    """As torch's loader without persistent workers: each pass's workers see the samples as they are."""
    dataset = torchvision.datasets.ImageFolder(imagenet_root / "val", transform=_jitter())
    loader = fastload.DataLoader(
        dataset, batch_size=4, num_workers=1, multiprocessing_context="fork", persistent_workers=False
    )

    def labels() -> list[int]:
        return torch.cat([y for _, y in loader]).tolist()

    assert labels() == dataset.targets
    dataset.samples = dataset.samples[::2]  # replaced
    assert labels() == [t for _, t in dataset.samples]
    dataset.samples.extend(dataset.samples[:3])  # changed in place
    assert labels() == [t for _, t in dataset.samples]
