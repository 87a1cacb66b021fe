"""One-line acceleration: an unchanged torchvision pipeline, only the DataLoader class swapped."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torchvision
from torchvision import transforms as v1
from torchvision.transforms import v2

import fastload
from fastload.recognize import convert_pipeline

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def _val_v1() -> Any:
    return v1.Compose([v1.Resize(40), v1.CenterCrop(32), v1.ToTensor(), v1.Normalize(MEAN, STD)])


def _val_v2() -> Any:
    return v2.Compose(
        [
            v2.ToImage(),
            v2.Resize(40),
            v2.CenterCrop(32),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(MEAN, STD),
        ]
    )


def _val_v2_pil() -> Any:  # resizes on the PIL image, then converts
    return v2.Compose(
        [v2.Resize(40), v2.CenterCrop(32), v2.PILToTensor(), v2.ToDtype(torch.float32, scale=True)]
    )


def _val_uint8_v1() -> Any:
    return v1.Compose(
        [v1.Resize(40, interpolation=v1.InterpolationMode.BICUBIC), v1.CenterCrop(32), v1.PILToTensor()]
    )


def _val_uint8_v2() -> Any:
    return v2.Compose([v2.Resize((36, 30)), v2.CenterCrop(28), v2.ToImage()])


def _val_convert_v1() -> Any:
    return v1.Compose(
        [
            v1.Resize(40),
            v1.CenterCrop(32),
            v1.PILToTensor(),
            v1.ConvertImageDtype(torch.float32),
            v1.Normalize(MEAN, STD),
        ]
    )


def _train_v1() -> Any:
    return v1.Compose(
        [v1.RandomResizedCrop(32), v1.RandomHorizontalFlip(), v1.ToTensor(), v1.Normalize(MEAN, STD)]
    )


def _train_v2() -> Any:
    return v2.Compose(
        [
            v2.RandomResizedCrop(32, antialias=True),
            v2.RandomHorizontalFlip(),
            v2.ToImage(),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(MEAN, STD),
        ]
    )


VAL = {
    "v1 float": (_val_v1, torch.float32),
    "v2 tensor ops": (_val_v2, torch.float32),
    "v2 pil ops": (_val_v2_pil, torch.float32),
    "v1 uint8 bicubic": (_val_uint8_v1, torch.uint8),
    "v2 uint8 (h, w)": (_val_uint8_v2, torch.uint8),
    "v1 ConvertImageDtype": (_val_convert_v1, torch.float32),
}
TRAIN = {"v1": _train_v1, "v2": _train_v2}


def _levels(x: torch.Tensor, normalized: bool) -> torch.Tensor:
    """Batches on the 0..255 scale (undoing Normalize and the [0, 1] scaling) for a comparison in levels."""
    if not x.dtype.is_floating_point:
        return x.double()
    x = x.double()
    if normalized:
        mean, std = (torch.tensor(v, dtype=torch.float64).view(1, 3, 1, 1) for v in (MEAN, STD))
        x = x * std + mean
    return x * 255


def _epoch(loader: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    images, labels = [], []
    for x, y in loader:
        images.append(x.clone())
        labels.append(y.clone())
    return images, labels


@pytest.mark.parametrize("split", ["train", "val"])
@pytest.mark.parametrize("name", list(VAL))
def test_eval_pipelines_match_torch(imagenet_root: Path, name: str, split: str) -> None:
    make, dtype = VAL[name]
    dataset = torchvision.datasets.ImageFolder(imagenet_root / split, transform=make())
    torch_images, torch_labels = _epoch(torch.utils.data.DataLoader(dataset, batch_size=5))
    loader = fastload.DataLoader(dataset, batch_size=5, num_workers=0)
    assert loader.fast_path, loader.fast_path_reason
    assert loader.fast_path_reason is None
    images, labels = _epoch(loader)
    assert len(images) == len(torch_images)
    for a, b, ya, yb in zip(torch_images, images, torch_labels, labels, strict=True):
        assert b.dtype == a.dtype == dtype
        assert b.shape == a.shape
        assert b.is_contiguous()  # default_collate's memory format: contiguous NCHW
        assert torch.equal(ya, yb)  # same labels, same order (shuffle=False)
    normalized = name in ("v1 float", "v2 tensor ops", "v1 ConvertImageDtype")
    diff = (_levels(torch.cat(images), normalized) - _levels(torch.cat(torch_images), normalized)).abs()
    assert diff.max().item() <= 1.0 + 1e-3, f"{name}: eval pixels differ by {diff.max().item():.3f} levels"
    assert diff.mean().item() < 0.05


def test_dataset_and_transform_are_left_alone(imagenet_root: Path) -> None:
    transform = _val_v1()
    dataset = torchvision.datasets.ImageFolder(imagenet_root / "val", transform=transform)
    loader = fastload.DataLoader(dataset, batch_size=4, num_workers=0)
    assert loader.fast_path
    next(iter(loader))
    assert loader.dataset is dataset and dataset.transform is transform
    assert dataset[0][0].dtype == torch.float32  # the user's dataset still runs the user's pipeline


@pytest.mark.parametrize("version", list(TRAIN))
def test_train_pipelines_keep_torch_statistics(imagenet_root: Path, version: str) -> None:
    """Random crops + flips: per-channel mean and std of normalized epochs within 0.02 of torch's."""
    dataset = torchvision.datasets.ImageFolder(imagenet_root / "train", transform=TRAIN[version]())
    torch.manual_seed(0)
    reference = torch.utils.data.DataLoader(dataset, batch_size=16, shuffle=True)
    loader = fastload.DataLoader(dataset, batch_size=16, shuffle=True, num_workers=0, seed=0)
    assert loader.fast_path, loader.fast_path_reason
    ours, theirs = [], []
    for _ in range(25):  # 800 random crops each
        for (a, ya), (b, yb) in zip(reference, loader, strict=True):
            assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape and b.is_contiguous()
            assert ya.dtype == yb.dtype == torch.int64
            theirs.append(a)
            ours.append(b.clone())
    a, b = torch.cat(theirs), torch.cat(ours)
    for c in range(3):
        assert abs(a[:, c].mean() - b[:, c].mean()) < 0.02, f"channel {c} mean"
        assert abs(a[:, c].std() - b[:, c].std()) < 0.02, f"channel {c} std"


def test_labels_follow_the_torchvision_dataset(imagenet_root: Path) -> None:
    """Same class_to_idx and targets, also after the user edits samples (as torch would read them)."""
    dataset = torchvision.datasets.ImageFolder(imagenet_root / "train", transform=_val_uint8_v1())
    dataset.samples = dataset.samples[::3]  # a subset: torch reads whatever samples holds
    dataset.targets = [t for _, t in dataset.samples]
    loader = fastload.DataLoader(dataset, batch_size=4, num_workers=0)
    assert loader.fast_path
    labels = torch.cat([y for _, y in loader])
    assert labels.tolist() == dataset.targets
    assert len(labels) == len(dataset)


def test_process_workers_give_the_same_batches(imagenet_root: Path) -> None:
    dataset = torchvision.datasets.ImageFolder(imagenet_root / "train", transform=_train_v1())
    inline = _epoch(fastload.DataLoader(dataset, batch_size=6, shuffle=True, num_workers=0, seed=3))
    workers = fastload.DataLoader(dataset, batch_size=6, shuffle=True, num_workers=2, seed=3)
    assert workers.fast_path
    other = _epoch(workers)
    workers.close()
    for a, b in zip(inline[0] + inline[1], other[0] + other[1], strict=True):
        assert torch.equal(a, b)


def test_fastload_datasets_with_torchvision_transforms(imagenet_root: Path) -> None:
    reference = torchvision.datasets.ImageFolder(imagenet_root / "val", transform=_val_v1())
    want = torch.cat([x for x, _ in torch.utils.data.DataLoader(reference, batch_size=4)])
    for dataset in (
        fastload.ImageFolder(imagenet_root / "val", transform=_val_v1()),
        fastload.InMemoryImageFolder(imagenet_root / "val", transform=_val_v1()),
    ):
        loader = fastload.DataLoader(dataset, batch_size=4, num_workers=0)
        assert loader.fast_path, loader.fast_path_reason
        got = torch.cat([x.clone() for x, _ in loader])
        assert got.dtype == torch.float32 and got.shape == want.shape
        levels = ((got - want).abs() * torch.tensor(STD).view(1, 3, 1, 1) * 255).max().item()
        assert levels <= 1.0 + 1e-3


def _lambda_pipeline() -> Any:
    return v1.Compose([v1.CenterCrop(32), v1.Lambda(lambda img: img), v1.ToTensor()])


class _OwnGetItem(torchvision.datasets.ImageFolder):
    def __getitem__(self, index: int) -> Any:
        image, target = super().__getitem__(index)
        return image, target * 10


def _custom_loader(path: str) -> Any:
    from PIL import Image

    with open(path, "rb") as f:
        return Image.open(f).convert("L").convert("RGB")


FALLBACKS = {
    "ColorJitter": (
        lambda root: torchvision.datasets.ImageFolder(
            root, transform=v1.Compose([v1.CenterCrop(32), v1.ColorJitter(0.2), v1.ToTensor()])
        ),
        "ColorJitter",
    ),
    "Lambda": (lambda root: torchvision.datasets.ImageFolder(root, transform=_lambda_pipeline()), "Lambda"),
    "target_transform": (
        lambda root: torchvision.datasets.ImageFolder(
            root, transform=_val_v1(), target_transform=lambda t: t + 1
        ),
        "target_transform",
    ),
    "custom loader": (
        lambda root: torchvision.datasets.ImageFolder(root, transform=_val_v1(), loader=_custom_loader),
        "loader",
    ),
    "own __getitem__": (lambda root: _OwnGetItem(root, transform=_val_v1()), "__getitem__"),
    "no fixed size": (
        lambda root: torchvision.datasets.ImageFolder(
            root, transform=v1.Compose([v1.Resize(40), v1.ToTensor()])
        ),
        "size",
    ),
    "geometry after float": (
        lambda root: torchvision.datasets.ImageFolder(
            root, transform=v1.Compose([v1.ToTensor(), v1.CenterCrop(32)])
        ),
        "float",
    ),
    "PIL output": (
        lambda root: torchvision.datasets.ImageFolder(root, transform=v1.Compose([v1.CenterCrop(32)])),
        "PIL",
    ),
}


@pytest.mark.parametrize("case", list(FALLBACKS))
def test_unrecognized_pipelines_run_torchs_path_and_say_why(
    imagenet_root: Path, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    make, word = FALLBACKS[case]
    dataset = make(imagenet_root / "val")
    with caplog.at_level(logging.INFO, logger="fastload"):
        loader = fastload.DataLoader(dataset, batch_size=4, num_workers=0)
    assert not loader.fast_path
    assert loader.fast_path_reason is not None and word in loader.fast_path_reason
    records = [r for r in caplog.records if r.name == "fastload"]
    assert len(records) == 1 and records[0].levelno == logging.INFO
    assert loader.fast_path_reason in records[0].getMessage()
    torch_error = {"PIL output": TypeError, "no fixed size": RuntimeError}.get(case)
    if torch_error is not None:  # torch's own error: default_collate cannot batch these
        with pytest.raises(torch_error):
            next(iter(torch.utils.data.DataLoader(dataset, batch_size=4)))
        with pytest.raises(torch_error):
            next(iter(loader))
        return
    torch.manual_seed(0)
    want = list(torch.utils.data.DataLoader(dataset, batch_size=4))
    torch.manual_seed(0)
    got = list(loader)
    for (a, ya), (b, yb) in zip(want, got, strict=True):
        assert torch.equal(ya, yb)
        if case not in ("ColorJitter",):  # jitter draws from torch's RNG in the same order: equal too
            assert torch.equal(a, b)


def test_fast_path_false_runs_torchs_path(imagenet_root: Path, caplog: pytest.LogCaptureFixture) -> None:
    dataset = torchvision.datasets.ImageFolder(imagenet_root / "val", transform=_val_v1())
    with caplog.at_level(logging.INFO, logger="fastload"):
        loader = fastload.DataLoader(dataset, batch_size=4, num_workers=0, fast_path=False)
    assert not loader.fast_path
    assert loader.fast_path_reason == "fast_path=False"
    assert not [r for r in caplog.records if r.name == "fastload"]  # asked for: nothing to report
    want = list(torch.utils.data.DataLoader(dataset, batch_size=4))
    for (a, ya), (b, yb) in zip(want, loader, strict=True):
        assert torch.equal(a, b) and torch.equal(ya, yb)


def test_other_datasets_say_why_without_logging(caplog: pytest.LogCaptureFixture) -> None:
    dataset = torch.utils.data.TensorDataset(torch.zeros(8, 3, 4, 4), torch.arange(8))
    with caplog.at_level(logging.INFO, logger="fastload"):
        loader = fastload.DataLoader(dataset, batch_size=4, num_workers=0)
    assert not loader.fast_path
    assert "TensorDataset" in (loader.fast_path_reason or "")
    assert not [r for r in caplog.records if r.name == "fastload"]
    assert "collate_fn" in (
        fastload.DataLoader(dataset, batch_size=4, num_workers=0, collate_fn=lambda b: b).fast_path_reason
        or ""
    )


def test_a_replaced_transform_is_followed_between_epochs(imagenet_root: Path) -> None:
    """Like torch's loader (without persistent workers), a new transform applies from the next pass."""
    dataset = torchvision.datasets.ImageFolder(imagenet_root / "val", transform=_val_uint8_v1())
    loader = fastload.DataLoader(dataset, batch_size=4, num_workers=0)
    first = next(iter(loader))[0]
    assert first.dtype == torch.uint8 and loader.fast_path
    dataset.transform = _val_v1()
    second = next(iter(loader))[0]
    assert second.dtype == torch.float32 and loader.fast_path
    dataset.transform = v1.Compose([v1.CenterCrop(32), v1.ColorJitter(0.2), v1.ToTensor()])
    third = next(iter(loader))[0]
    assert not loader.fast_path and "ColorJitter" in (loader.fast_path_reason or "")
    assert third.shape == (4, 3, 32, 32)


@pytest.mark.parametrize("name", list(VAL))
def test_device_conversion_equals_the_per_sample_one(imagenet_root: Path, name: str) -> None:
    """With a CUDA ``device`` the uint8 batch is converted on the device by torch's arithmetic; the
    workers convert each sample through a table of the 256 values (C extension): the same floats."""
    pipeline = convert_pipeline(VAL[name][0]())
    assert (pipeline._table() is not None) == (VAL[name][1] == torch.float32)
    geometry = pipeline.geometry_only()
    data = sorted((imagenet_root / "val").rglob("*"))
    files = [p for p in data if p.is_file()][:6]
    per_sample = torch.stack([pipeline.decode_and_apply(p.read_bytes(), str(p)) for p in files])
    hwc = np.stack([np.empty(geometry.sample_shape, dtype=np.uint8) for _ in files])
    for out, p in zip(hwc, files, strict=True):
        geometry.decode_into(p.read_bytes(), out, str(p))
    batched = geometry.convert_batch(torch.from_numpy(hwc).permute(0, 3, 1, 2))
    assert batched.is_contiguous() and batched.dtype == VAL[name][1]
    assert torch.equal(batched, per_sample)


def test_recognition_reasons_name_the_op() -> None:
    with pytest.raises(ValueError, match="RandAugment"):
        convert_pipeline(v2.Compose([v2.RandAugment(), v2.CenterCrop(8), v2.ToImage()]))
    with pytest.raises(ValueError, match="float64"):
        convert_pipeline(v2.Compose([v2.CenterCrop(8), v2.ToImage(), v2.ToDtype(torch.float64, scale=True)]))
    with pytest.raises(ValueError, match="interpolation"):
        convert_pipeline(
            v1.Compose(
                [v1.Resize(8, interpolation=v1.InterpolationMode.LANCZOS), v1.CenterCrop(8), v1.PILToTensor()]
            )
        )
