"""timm's data pipeline through fastload: its datasets, transforms, ``fast_collate`` and
``PrefetchLoader`` as ``create_loader`` builds them with train.py's settings, and the zero-edit swap.

Needs timm (a test extra: ``pip install -e '.[test]'``, or ``pip install timm``)."""

from __future__ import annotations

import functools
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils.data as tud

import fastload
from fastload import transforms as T
from fastload.fused import Plan
from fastload.rng import SampleRNG

timm_data = pytest.importorskip("timm.data", reason="needs timm: pip install timm (a test extra)")
from timm.data import ImageDataset, create_dataset, create_loader  # noqa: E402
from timm.data.loader import PrefetchLoader, fast_collate  # noqa: E402
from timm.data.transforms_factory import create_transform  # noqa: E402

TORCH_DATALOADER = tud.DataLoader
CPU = torch.device("cpu")
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # resnet18.tv_in1k's config


def _loader(
    loader_class: Any, dataset: Any, training: bool, prefetcher: bool, workers: int = 2, **kwargs: Any
) -> Any:
    """``create_loader`` with train.py's settings (its defaults; 2 workers, batch 8), building its
    loader with ``loader_class`` where train.py's name ``torch.utils.data.DataLoader`` is looked up."""
    tud.DataLoader = loader_class
    try:
        train = dict(  # train.py's train_loader_kwargs, at its defaults
            re_prob=0.0, scale=None, ratio=None, hflip=0.5, vflip=0.0, color_jitter=0.4,
            auto_augment=None, interpolation="random", worker_seeding="all",
        )  # fmt: skip
        options = dict(
            input_size=(3, 32, 32),
            batch_size=8,
            is_training=training,
            use_prefetcher=prefetcher,
            mean=MEAN,
            std=STD,
            pin_memory=False,
            img_dtype=torch.float32,
            device=CPU,
            distributed=False,
            num_workers=workers,
            persistent_workers=False,
            **(train if training else dict(interpolation="bilinear", crop_pct=0.875)),
        )
        options.update(kwargs)
        return create_loader(dataset, **options)
    finally:
        tud.DataLoader = TORCH_DATALOADER


def _batches(loader: Any, seed: int = 0) -> list[Any]:
    torch.manual_seed(seed)
    return [[t.clone() for t in batch] for batch in loader]


def _same(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(
        len(x) == len(y) and all(torch.equal(s, t) for s, t in zip(x, y, strict=True))
        for x, y in zip(a, b, strict=True)
    )


def _inner(loader: Any) -> Any:
    return loader.loader if isinstance(loader, PrefetchLoader) else loader


@pytest.fixture
def natural_root(imagenet_root: Path, tmp_path: Path) -> Path:
    """Classes named so that timm's natural sort (c1, c2, c10) differs from torchvision's (c1, c10, c2)."""
    for k, source in enumerate(sorted((imagenet_root / "val").iterdir())[:3]):
        shutil.copytree(source, tmp_path / ("c1", "c2", "c10")[k])
    return tmp_path


@pytest.mark.parametrize("name", ["", "torch/image_folder"], ids=["ImageDataset", "torch-image-folder"])
@pytest.mark.parametrize("prefetcher", [False, True], ids=["tensor", "prefetcher"])
def test_eval_loader_runs_the_fast_path_with_torchs_batches(
    imagenet_root: Path, prefetcher: bool, name: str
) -> None:
    dataset = create_dataset(name, root=str(imagenet_root / "val"), split="validation")
    fast = _loader(fastload.DataLoader, dataset, False, prefetcher)
    assert _inner(fast).path == "fast", _inner(fast).fast_path_reason
    expected = _batches(_loader(TORCH_DATALOADER, dataset, False, prefetcher))
    got = _batches(fast)
    assert _same(expected, got)  # labels in order and pixels, bit for bit (eval: no random op)
    assert got[0][0].dtype == torch.float32 and got[0][0].shape == (8, 3, 32, 32)


def test_labels_are_timms_own(natural_root: Path) -> None:
    dataset = ImageDataset(str(natural_root), transform=create_transform(32, is_training=False))
    assert dataset.reader.class_to_idx == {"c1": 0, "c2": 1, "c10": 2}  # not torchvision's order
    loader = fastload.DataLoader(dataset, batch_size=4, num_workers=0)
    assert loader.path == "fast"
    labels = torch.cat([y for _, y in loader]).tolist()
    assert labels == [target for _, target in dataset.reader.samples]
    assert labels == [dataset[i][1] for i in range(len(dataset))]


def test_a_timm_dataset_fastload_cannot_read_as_timm_does_says_why(imagenet_root: Path) -> None:
    dataset = ImageDataset(str(imagenet_root / "val"), transform=create_transform(32), input_img_mode="L")
    loader = fastload.DataLoader(dataset, batch_size=4, num_workers=0)
    assert loader.path == "torch" and "a mode other than RGB" in (loader.fast_path_reason or "")


def _in_order(loader_class: Any, dataset: Any, **kwargs: Any) -> Any:
    """A loader over ``dataset`` in one fixed order (a list both loaders take as their sampler)."""
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(1)).tolist()
    return loader_class(dataset, batch_size=8, sampler=order, num_workers=2, **kwargs)


def test_train_loader_runs_timms_pipeline_on_the_fast_path(imagenet_root: Path) -> None:
    """RandomResizedCropAndInterpolation (random interpolation), the flip and ColorJitter fused with
    decoding, their draws from fastload's (seed, epoch, index) streams: the same batches for any
    num_workers; with exact_pixels, head acceleration and torch's batches bit for bit (timm's draws)."""
    dataset = create_dataset("", root=str(imagenet_root / "train"), split="train", is_training=True)
    loader = _loader(fastload.DataLoader, dataset, True, False)
    assert loader.path == "fast", loader.fast_path_reason
    assert loader._runs_user_code == "a worker_init_fn"  # timm's seeding function; its ops are library ops
    labels = torch.cat([y for _, y in _batches(loader)])
    assert torch.bincount(labels).tolist() == [8, 8, 8, 8]  # each sample once in the pass
    seeded = functools.partial(fastload.DataLoader, seed=5)
    one = _batches(_loader(seeded, dataset, True, False, workers=0))
    assert _same(one, _batches(_loader(seeded, dataset, True, False, workers=2)))
    other = functools.partial(fastload.DataLoader, seed=6)
    assert not _same(one, _batches(_loader(other, dataset, True, False, workers=0)))
    seeding = loader.worker_init_fn
    expected = _batches(_in_order(TORCH_DATALOADER, dataset, worker_init_fn=seeding))
    exact_loader = _in_order(fastload.DataLoader, dataset, worker_init_fn=seeding, exact_pixels=True)
    assert exact_loader.path == "head-accelerated"
    assert "ColorJitter on the decoded pixels" in exact_loader._head_dataset.transform.describe()
    assert _same(expected, _batches(exact_loader))
    fast = _batches(_in_order(fastload.DataLoader, dataset, worker_init_fn=seeding))
    assert [b[1].tolist() for b in fast] == [b[1].tolist() for b in expected]
    assert all(a[0].shape == b[0].shape for a, b in zip(fast, expected, strict=True))


def test_prefetcher_route_gets_uint8_batches_from_fast_collate(imagenet_root: Path) -> None:
    """fast_collate + PrefetchLoader: the fast path for a uint8 pipeline (the format fast_collate
    makes); fast_collate given float images runs as written (it casts them to uint8)."""
    dataset = create_dataset("", root=str(imagenet_root / "train"), split="train", is_training=True)
    loader = _loader(fastload.DataLoader, dataset, True, True)
    assert isinstance(loader, PrefetchLoader) and loader.loader.path == "fast"
    images, labels = next(iter(loader.loader))
    assert images.dtype == torch.uint8 and images.shape == (8, 3, 32, 32) and labels.dtype == torch.int64
    batches = list(loader)
    assert len(batches) == len(loader) and batches[0][0].dtype == torch.float32
    floats = create_dataset("", root=str(imagenet_root / "val"), split="validation")
    floats.transform = create_transform(32, is_training=False)  # ToTensor + Normalize: float32
    as_written = fastload.DataLoader(floats, batch_size=8, collate_fn=fast_collate, num_workers=0)
    assert as_written.path == "head-accelerated"
    assert "fast_collate is given torch.float32 images" in (as_written.fast_path_reason or "")
    reference = TORCH_DATALOADER(floats, batch_size=8, collate_fn=fast_collate)
    assert _same(_batches(reference), _batches(as_written))


def test_randaugment_and_random_erasing_run_as_written_after_the_head(imagenet_root: Path) -> None:
    dataset = create_dataset("", root=str(imagenet_root / "train"), split="train", is_training=True)
    dataset.transform = create_transform(32, is_training=True, auto_augment="rand-m9-mstd0.5", re_prob=0.25)
    loader = _in_order(fastload.DataLoader, dataset, exact_pixels=True)
    assert loader.path == "head-accelerated"
    assert loader._runs_user_code is None  # timm's and torchvision's classes only: fastload's defaults
    assert _same(_batches(_in_order(TORCH_DATALOADER, dataset)), _batches(loader))


def test_random_interpolation_draws_each_mode() -> None:
    crop = T.RandomResizedCrop(16, interpolation=("bilinear", "bicubic"))
    modes = set()
    for index in range(32):
        plan = Plan(40, 60)
        crop._plan(plan, SampleRNG(0, 0, index))
        modes.add(plan.ops[-1][3])
    assert modes == {"bilinear", "bicubic"}


def test_every_loader_off_the_fast_path_says_why(imagenet_root: Path, caplog: Any) -> None:
    """One WARNING with the reason, whatever the dataset: torchvision's, timm's, a user's own, an
    IterableDataset."""
    import torchvision

    class Mine(tud.Dataset[int]):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> int:
            return i

    class Stream(tud.IterableDataset[int]):
        def __iter__(self) -> Any:
            return iter(range(8))

    jitter = torchvision.transforms.Compose([torchvision.transforms.ColorJitter(0.4)])
    timm_grey = create_transform(32)
    kinds = {
        "ImageFolder": torchvision.datasets.ImageFolder(str(imagenet_root / "val"), transform=jitter),
        "ImageDataset": ImageDataset(str(imagenet_root / "val"), transform=timm_grey, input_img_mode="L"),
        "Mine": Mine(),
        "Stream": Stream(),
    }
    for name, dataset in kinds.items():
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="fastload"):
            loader = fastload.DataLoader(dataset, batch_size=4, num_workers=0)
        records = [r for r in caplog.records if r.name == "fastload"]
        assert [r.levelno for r in records] == [logging.WARNING], name
        assert loader.path == "torch" and f"for this {name} (no acceleration)" in records[0].getMessage()
        assert (loader.fast_path_reason or "") in records[0].getMessage()


_SCRIPT = """
import os, sys, torch
from timm.data import create_dataset, create_loader
distributed = "RANK" in os.environ
if distributed:
    torch.distributed.init_process_group("gloo")
multi = sys.argv[2] == "multi-epochs"  # timm's MultiEpochsDataLoader: subclasses the name at import
dataset = create_dataset("", root=sys.argv[1], split="validation")
loader = create_loader(dataset, input_size=(3, 32, 32), batch_size=4, is_training=False,
                       use_prefetcher=True, device=torch.device("cpu"), num_workers=1,
                       distributed=distributed, crop_pct=0.875, use_multi_epochs_loader=multi)
total = torch.tensor([sum(len(y) for _, y in loader) for epoch in range(2)])
if distributed:
    torch.distributed.all_reduce(total)
if not distributed or torch.distributed.get_rank() == 0:
    fastload = isinstance(loader.loader, sys.modules["fastload"].DataLoader)
    print("fastload" if fastload else "torch", loader.loader.path, "samples", total.tolist())
"""


@pytest.mark.parametrize("how", ["python", "torchrun", "multi-epochs"])
def test_zero_edit_swap_runs_an_unchanged_script(imagenet_root: Path, tmp_path: Path, how: str) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_SCRIPT))
    launcher = [sys.executable, "-m", "fastload", "run"]
    if how == "torchrun":
        torchrun = ["torch.distributed.run", "--nproc_per_node", "2", "-m", "fastload", "run"]
        launcher = [sys.executable, "-m", *torchrun]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [*launcher, str(script), str(imagenet_root / "val"), how],
        capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    # 12 samples an epoch in all (timm's eval sampler pads to a multiple of the ranks: 12 stays 12);
    # MultiEpochsDataLoader's endless batch sampler runs on torch's iterator, the head fused
    path = "head-accelerated" if how == "multi-epochs" else "fast"
    assert done.stdout.count(f"fastload {path} samples [12, 12]") == 1, done.stdout
    said = done.stderr.count("fastload.DataLoader runs the fast path for this ImageDataset")
    assert said == 1 or (how == "torchrun" and said >= 1), done.stderr[-3000:]  # one line per loader and rank


def test_run_without_a_script_says_how() -> None:
    command = [sys.executable, "-m", "fastload", "run"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "usage: python -m fastload run SCRIPT" in done.stderr


@pytest.mark.parametrize("how", ["non-square", "border"])
def test_resize_keep_ratio_is_fused_under_head_acceleration(imagenet_root: Path, how: str) -> None:
    """timm's ResizeKeepRatio (a non-square eval size; crop_mode="border") fused with decoding, its
    size computed per image by its own code: torch's batches bit for bit (eval: no random op)."""
    options = {"non-square": dict(input_size=(3, 32, 40)), "border": dict(crop_mode="border")}[how]
    dataset = create_dataset("", root=str(imagenet_root / "val"), split="validation")
    fast = _loader(fastload.DataLoader, dataset, False, False, **options)
    assert fast.path == "head-accelerated", fast.fast_path_reason
    assert "ResizeKeepRatio" in fast._head_dataset.transform.describe().split(" fused")[0]
    assert _same(_batches(_loader(TORCH_DATALOADER, dataset, False, False, **options)), _batches(fast))


def test_timm_samples_relabelled_between_epochs_are_followed(imagenet_root: Path) -> None:
    """What fastload reads of a timm dataset (its reader's samples) is compared at each pass start:
    a sample relabelled in place reaches the next pass, as torch's loader would see it."""
    dataset = ImageDataset(str(imagenet_root / "val"), transform=create_transform(32, is_training=False))
    loader = fastload.DataLoader(dataset, batch_size=4, num_workers=0)
    assert loader.path == "fast"
    first = torch.cat([y for _, y in loader])
    path, target = dataset.reader.samples[0]
    dataset.reader.samples[0] = (path, (target + 1) % 4)
    second = torch.cat([y for _, y in loader])
    assert second[0] == (first[0] + 1) % 4 and torch.equal(second[1:], first[1:])
    assert second.tolist() == [target for _, target in dataset.reader.samples]
