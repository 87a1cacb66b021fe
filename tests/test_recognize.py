"""One-line acceleration: an unchanged torchvision pipeline, only the DataLoader class swapped."""

from __future__ import annotations

import logging
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torchvision
from torchvision import transforms as v1
from torchvision.transforms import v2

import fastload
from fastload.device import small_to_device
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
    # On PIL images a resize then a crop is PIL's resize and crop exactly (the C extension computes
    # the crop's window of the whole resize; without it, op by op). On tensors (v2 tensor ops) the
    # fast path runs torch's uint8 kernel on channels-last memory: within 1 level.
    limit = 1.0 + 1e-3 if name == "v2 tensor ops" else 0.0
    assert diff.max().item() <= limit, f"{name}: eval pixels differ by {diff.max().item():.3f} levels"


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
        assert torch.equal(got, want)  # torchvision's pixels, bit for bit


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
            root, transform=v1.Compose([v1.CenterCrop(32), v1.ColorJitter(0.2, hue=0.1), v1.ToTensor()])
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
    assert len(records) == 1 and records[0].levelno == logging.WARNING
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
    exact = fastload.DataLoader(dataset, batch_size=4, num_workers=0, exact_pixels=True)
    assert exact.path == loader.path
    for candidate, tolerance in ((loader, 1 / 255 / 0.224), (exact, 0.0)):
        torch.manual_seed(0)
        got = list(candidate)
        for (a, ya), (b, yb) in zip(want, got, strict=True):
            assert torch.equal(ya, yb)
            # head acceleration draws torch's jitter in torch's order; a Resize + CenterCrop head
            # resamples its box at once (1 level off on a few pixels) unless exact_pixels
            limit = tolerance if loader.path == "head-accelerated" else 0.0
            assert (a - b).abs().max() <= limit + 1e-6


def test_fast_path_false_runs_torchs_path(imagenet_root: Path, caplog: pytest.LogCaptureFixture) -> None:
    dataset = torchvision.datasets.ImageFolder(imagenet_root / "val", transform=_val_v1())
    with caplog.at_level(logging.INFO, logger="fastload"):
        loader = fastload.DataLoader(dataset, batch_size=4, num_workers=0, fast_path=False)
    assert not loader.fast_path
    assert loader.fast_path_reason == "fast_path=False"
    records = [r for r in caplog.records if r.name == "fastload"]  # asked for: INFO, no warning
    assert [r.levelno for r in records] == [logging.INFO]
    assert "as fast_path=False asks" in records[0].getMessage()
    want = list(torch.utils.data.DataLoader(dataset, batch_size=4))
    for (a, ya), (b, yb) in zip(want, loader, strict=True):
        assert torch.equal(a, b) and torch.equal(ya, yb)


def test_other_datasets_say_why_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    dataset = torch.utils.data.TensorDataset(torch.zeros(8, 3, 4, 4), torch.arange(8))
    with caplog.at_level(logging.INFO, logger="fastload"):
        loader = fastload.DataLoader(dataset, batch_size=4, num_workers=0)
    assert not loader.fast_path
    assert "TensorDataset" in (loader.fast_path_reason or "")
    records = [r for r in caplog.records if r.name == "fastload"]
    assert [r.levelno for r in records] == [logging.WARNING]
    assert loader.fast_path_reason in records[0].getMessage()
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
    dataset.transform = v1.Compose([v1.CenterCrop(32), v1.ColorJitter(0.2, hue=0.1), v1.ToTensor()])
    third = next(iter(loader))[0]
    assert not loader.fast_path and "ColorJitter" in (loader.fast_path_reason or "")
    assert third.shape == (4, 3, 32, 32)


def test_the_log_follows_a_transform_set_after_the_loader_was_made(
    imagenet_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A transform set after construction (the dataset made first, its transform later) changes the
    path at the next pass: a line says so, so that the last line logged names the path that runs;
    a change that keeps the path says nothing more."""
    dataset = torchvision.datasets.ImageFolder(imagenet_root / "val")
    with caplog.at_level(logging.INFO, logger="fastload"):
        loader = fastload.DataLoader(dataset, batch_size=4, num_workers=0)

        def said() -> list[logging.LogRecord]:
            records = [r for r in caplog.records if r.name == "fastload"]
            caplog.clear()
            return records

        [made] = said()
        assert made.levelno == logging.WARNING and "torch's iterator" in made.getMessage()
        dataset.transform = _val_v1()
        next(iter(loader))
        [fast] = said()
        assert loader.path == "fast" and fast.levelno == logging.INFO
        assert "runs the fast path" in fast.getMessage()
        dataset.transform = _val_uint8_v1()  # another pipeline on the same path
        next(iter(loader))
        assert loader.path == "fast" and not said()
        dataset.transform = v1.Compose([v1.CenterCrop(32), v1.ColorJitter(0.2, hue=0.1), v1.ToTensor()])
        next(iter(loader))
        [back] = said()
        assert loader.path != "fast" and back.levelno == logging.WARNING
        assert "ColorJitter" in back.getMessage()


@pytest.mark.parametrize("name", list(VAL))
def test_device_conversion_equals_the_per_sample_one(imagenet_root: Path, name: str) -> None:
    """With a CUDA ``device`` the uint8 batch is converted on the device by torch's arithmetic; the
    workers convert each sample through a table of the 256 values (C extension): the same floats."""
    pipeline = convert_pipeline(VAL[name][0]())
    assert (pipeline.conversion.table() is not None) == (VAL[name][1] == torch.float32)
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


def test_the_device_conversion_copies_its_constants_once_per_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Normalize's mean and std go to the batch's device once (through pinned memory on CUDA), not
    as a blocking copy per batch; each device has its own, and a pickled copy takes none along."""
    copies: list[torch.device] = []

    def counted(array: Any, device: torch.device, dtype: Any = None) -> torch.Tensor:
        copies.append(device)
        return small_to_device(array, device, dtype)

    monkeypatch.setattr(fastload.tvpipeline, "small_to_device", counted)
    conversion = convert_pipeline(_val_v1()).geometry_only().conversion
    images = torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8)
    by_torchvision = v1.Normalize(MEAN, STD)(images.float().div(255))
    for _ in range(3):
        assert torch.equal(conversion.batch(images), by_torchvision)
    on_meta = conversion.batch(images.to("meta"))
    assert on_meta.device.type == "meta" and on_meta.dtype == torch.float32
    conversion.batch(images.to("meta"))
    assert copies == [torch.device("cpu")] * 2 + [torch.device("meta")] * 2  # mean and std, per device
    assert not pickle.loads(pickle.dumps(conversion))._on_device


@pytest.mark.parametrize(
    "mean, std",
    [(0.5, 0.25), (torch.tensor(MEAN), np.array(STD)), (torch.tensor(MEAN).view(3, 1, 1), STD)],
    ids=["numbers", "tensor-and-array", "c11-tensor"],
)
def test_normalize_takes_what_torchvision_takes(imagenet_root: Path, mean: Any, std: Any) -> None:
    """torchvision applies Normalize's mean and std with torch.as_tensor: a number, a tensor or an
    array are recognised too, and give torch's floats (pixels within 1 level)."""
    transform = v1.Compose([v1.Resize(40), v1.CenterCrop(32), v1.ToTensor(), v1.Normalize(mean, std)])
    dataset = torchvision.datasets.ImageFolder(imagenet_root / "val", transform=transform)
    loader = fastload.DataLoader(dataset, batch_size=6, num_workers=0)
    assert loader.fast_path, loader.fast_path_reason
    ours, _ = _epoch(loader)
    want, _ = _epoch(torch.utils.data.DataLoader(dataset, batch_size=6))
    level = 1 / 255 / float(torch.as_tensor(std, dtype=torch.float64).min())
    for a, b in zip(want, ours, strict=True):
        assert b.dtype == a.dtype and b.shape == a.shape
        assert (a - b).abs().max().item() <= level * (1 + 1e-3)


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_convert_sample_gives_torchvisions_bits(version: str) -> None:
    """The per-sample conversion (table lookups, or AVX2 arithmetic where checked identical) gives
    torchvision's floats bit for bit, for many means and stds (random, negative, tiny std, one
    value, tensors and arrays), image sizes that are not a multiple of 16 pixels and a source that
    is a strided view (not contiguous: torch's arithmetic then)."""
    rng = np.random.default_rng(7)
    cases: list[tuple[Any, Any]] = [
        ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
        ([-1.5, 0.0, 2.25], [1e-6, 3.0, 0.01]),
        ([0.3], [1e-30]),
        (torch.tensor([0.1, 0.2, 0.3]), np.array([0.7, 0.8, 0.9])),
    ]
    cases += [(rng.uniform(-2, 2, 3).tolist(), rng.uniform(1e-4, 4, 3).tolist()) for _ in range(12)]
    for k, (mean, std) in enumerate(cases):
        h, w = int(rng.integers(1, 30)), int(rng.integers(1, 30))
        if version == "v1":
            to_float: Any = v1.ToTensor()
            norm: Any = v1.Normalize(mean, std)
            pipeline = v1.Compose([v1.CenterCrop((h, w)), to_float, norm])
        else:
            to_float = v2.Compose([v2.ToImage(), v2.ToDtype(torch.float32, scale=True)])
            norm = v2.Normalize(torch.as_tensor(mean).tolist(), torch.as_tensor(std).tolist())
            pipeline = v2.Compose([v2.CenterCrop((h, w)), to_float, norm])
        recognised = convert_pipeline(pipeline)
        wide = rng.integers(0, 256, (h, 2 * w, 3), dtype=np.uint8)
        for hwc in (np.ascontiguousarray(wide[:, ::2]), wide[:, ::2]):
            out = np.empty((3, h, w), dtype=np.float32)
            recognised.convert_sample(hwc, out)
            want = norm(to_float(np.ascontiguousarray(hwc))).numpy()
            assert np.array_equal(out.view(np.int32), want.view(np.int32)), (k, mean, std, (h, w))


def test_a_normalize_torchvision_cannot_apply_gets_torchs_error(imagenet_root: Path) -> None:
    transform = v1.Compose([v1.CenterCrop(32), v1.ToTensor(), v1.Normalize([0.5, 0.5], [0.2, 0.2])])
    dataset = torchvision.datasets.ImageFolder(imagenet_root / "val", transform=transform)
    loader = fastload.DataLoader(dataset, batch_size=4, num_workers=0)
    assert not loader.fast_path and "2 values" in (loader.fast_path_reason or "")
    with pytest.raises(RuntimeError) as ours:
        next(iter(loader))
    with pytest.raises(RuntimeError) as torchs:
        next(iter(torch.utils.data.DataLoader(dataset, batch_size=4)))
    assert str(ours.value) == str(torchs.value)


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


def test_the_fast_path_says_so_at_info(imagenet_root: Path, caplog: pytest.LogCaptureFixture) -> None:
    """One line per loader on the ``fastload`` logger: INFO for the fast path (the other paths
    warn, see test_unrecognized_pipelines_run_torchs_path_and_say_why)."""
    dataset = torchvision.datasets.ImageFolder(imagenet_root / "val", transform=_val_v1())
    with caplog.at_level(logging.INFO, logger="fastload"):
        loader = fastload.DataLoader(dataset, batch_size=4, num_workers=0)
    records = [r for r in caplog.records if r.name == "fastload"]
    assert loader.path == "fast"
    assert len(records) == 1 and records[0].levelno == logging.INFO
    assert "runs the fast path for this ImageFolder" in records[0].getMessage()


def test_torchvision_016s_warn_default_does_not_antialias_tensors() -> None:
    """torchvision 0.15/0.16's ``antialias="warn"`` default warned and resized tensors without
    antialiasing (0.17 made ``True`` the default); PIL images are always antialiased."""
    from types import SimpleNamespace

    from fastload.recognize import tensor_antialias

    op = SimpleNamespace(antialias="warn")
    assert tensor_antialias(op, on_pil=False) is False and tensor_antialias(op, on_pil=True) is True
    assert tensor_antialias(SimpleNamespace(antialias=None), on_pil=False) is False
    assert tensor_antialias(SimpleNamespace(antialias=True), on_pil=False) is True


def test_exact_pixels_on_the_fast_path_is_torchvisions_batches_bit_for_bit(imagenet_root: Path) -> None:
    """A tensor pipeline (v2 ToImage, then Resize and CenterCrop) over every kind of file in the
    tree (RGB and grayscale JPEGs, a CMYK JPEG and a PNG, which PIL decodes): the same bytes as
    torch's loader with exact_pixels=True (without it, up to 1 level off on a few pixels)."""
    from PIL import Image
    from torchvision.transforms import v2

    dataset = torchvision.datasets.ImageFolder(
        imagenet_root / "train", transform=v2.Compose([v2.ToImage(), v2.Resize(36), v2.CenterCrop(32)])
    )
    kinds = {Image.open(path).mode + str(Image.open(path).format) for path, _ in dataset.samples}
    assert {"CMYKJPEG", "RGBPNG", "LJPEG", "RGBJPEG"} <= kinds
    want = torch.cat([x for x, _ in torch.utils.data.DataLoader(dataset, batch_size=8)])
    for exact in (False, True):
        loader = fastload.DataLoader(dataset, batch_size=8, num_workers=0, exact_pixels=exact)
        assert loader.fast_path
        got = torch.cat([x for x, _ in loader])
        difference = (got.int() - want.int()).abs().max().item()
        assert difference == 0 if exact else difference <= 1


def test_color_jitter_after_the_geometry_is_fused(imagenet_root: Path) -> None:
    """A ColorJitter (no hue) on the PIL image after the crops and flips runs on the fast path, its
    factors and order drawn per sample from (seed, epoch, index): the same batches for any
    num_workers, Pillow's blends (a factor range of exactly 1 changes nothing); a crop after it is
    not fused."""
    jitter = v1.Compose([v1.RandomResizedCrop(24), v1.RandomHorizontalFlip(), v1.ColorJitter(0.4, 0.4, 0.4)])
    dataset = torchvision.datasets.ImageFolder(
        imagenet_root / "train", transform=v1.Compose([jitter, v1.PILToTensor()])
    )
    loaders = [fastload.DataLoader(dataset, batch_size=8, seed=1, num_workers=n) for n in (0, 2)]
    assert [loader.path for loader in loaders] == ["fast", "fast"]
    batches = [[b[0] for b in loader] for loader in loaders]
    assert all(torch.equal(a, b) for a, b in zip(*batches, strict=True))

    def first_batch(ops: list[Any]) -> torch.Tensor:
        folder = torchvision.datasets.ImageFolder(
            imagenet_root / "train", transform=v1.Compose([*ops, v1.PILToTensor()])
        )
        return next(iter(fastload.DataLoader(folder, batch_size=8, seed=1, num_workers=0)))[0]

    plain = first_batch([v1.RandomResizedCrop(24), v1.RandomHorizontalFlip()])
    assert not torch.equal(batches[0][0], plain)  # jittered
    ones = v1.ColorJitter((1, 1), (1, 1), (1, 1))  # no factor (torchvision: None); crops drawn first, unmoved
    assert torch.equal(first_batch([v1.RandomResizedCrop(24), v1.RandomHorizontalFlip(), ones]), plain)
    after = v1.Compose([v1.ColorJitter(0.4), v1.CenterCrop(16), v1.ToTensor()])
    dataset = torchvision.datasets.ImageFolder(imagenet_root / "val", transform=after)
    loader = fastload.DataLoader(dataset, batch_size=4, num_workers=0)
    assert loader.path != "fast" and "CenterCrop after ColorJitter" in (loader.fast_path_reason or "")
