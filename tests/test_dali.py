"""The DALI backend: labels, shards, orders and pixels against fastload's and torchvision's own.

Tests that need DALI take the ``dali`` fixture, which skips them (with the install command) where
``nvidia.dali`` cannot be imported, except with ``FASTLOAD_REQUIRE_DALI=1`` (CI), where they fail.
The rest (the import contract, the error without DALI, argument checks, the header parser) run
everywhere.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torchvision.transforms.functional as F
from PIL import Image

from fastload import rng
from fastload import transforms as T
from fastload.__main__ import main
from fastload.dali import IMAGENET_MEAN, IMAGENET_STD, DALILoader, _Feed, _samples, image_size
from fastload.folder import ClassIndex, FolderIndex, scan_folder
from fastload.imagefolder import ImageFolder
from fastload.sampler import DistributedSampler
from fastload.shards import TarShards

from _harness import timing
from _harness.backends import BACKENDS, dali_backend
from _harness.config import BenchConfig

MEAN = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1) * 255
STD = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1) * 255


@pytest.fixture(scope="module")
def dali() -> Any:
    if os.environ.get("FASTLOAD_REQUIRE_DALI") == "1":  # CI (make test WITH_DALI=1): never skip
        import nvidia.dali

        return nvidia.dali
    return pytest.importorskip(
        "nvidia.dali",
        reason="NVIDIA DALI is not installed (pip install 'fastload[dali]'): DALI backend tests skipped",
    )


@pytest.fixture(scope="module")
def classes(imagenet_root: Path) -> ClassIndex:
    return ClassIndex.from_folder(imagenet_root / "train")


@pytest.fixture(scope="module")
def train_index(imagenet_root: Path, classes: ClassIndex) -> FolderIndex:
    return scan_folder(imagenet_root / "train", classes)  # 32 files incl. grayscale, CMYK, PNG-as-.JPEG


@pytest.fixture(scope="module")
def val_index(imagenet_root: Path, classes: ClassIndex) -> FolderIndex:
    return scan_folder(imagenet_root / "val", classes)  # 12 files


def pixels(images: torch.Tensor) -> torch.Tensor:
    """Normalized float images back on the 0..255 scale."""
    return images * STD + MEAN


def torchvision_val(path: str, size: int) -> torch.Tensor:
    """torchvision's eval transform (PIL loader, Resize, CenterCrop) as float 0..255 CHW."""
    img = Image.open(path).convert("RGB")
    img = F.center_crop(F.resize(img, size * 256 // 224), size)
    return F.pil_to_tensor(img).float()


def collect(loader: DALILoader) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    images, labels = [], []
    for x, y in loader:
        images.append(x)
        labels.append(y)
    return images, labels


# ------------------------------------------------------------------ without DALI


def test_importing_fastload_never_imports_dali() -> None:
    code = (
        "import sys, fastload, fastload.dali; fastload.dali.DALILoader; print('nvidia.dali' in sys.modules)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "False"


def test_without_dali_the_loader_names_the_install_command(
    train_index: FolderIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)  # what an environment without DALI looks like
    with pytest.raises(ImportError, match=r"pip install 'fastload\[dali\]'"):
        DALILoader(train_index, 4, device="cpu")
    reason = dali_backend().unavailable()
    assert reason is not None and "pip install 'fastload[dali]'" in reason


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"batch_size": 0}, ValueError, "batch_size should be a positive integer, but got batch_size=0"),
        ({"batch_size": 2.0}, TypeError, "batch_size should be a positive integer, but got batch_size=2.0"),
        ({"size": 0}, ValueError, "size should be a positive integer, but got size=0"),
        ({"num_threads": 0}, ValueError, "num_threads should be a positive integer, but got num_threads=0"),
        (
            {"num_replicas": 4, "rank": 4},
            ValueError,
            r"Invalid rank 4, rank should be in the interval \[0, 3\]",
        ),
        ({"std": (0.2, 0.0, 0.2)}, ValueError, "std should be positive"),
        ({"mean": (0.5, 0.5)}, ValueError, "mean should be 3 finite numbers"),
        ({"seed": "0"}, TypeError, "seed should be an integer, but got seed='0'"),
        ({"device": "mps"}, ValueError, "device should be 'cpu', 'cuda' or 'cuda:N', but got device='mps'"),
    ],
)
def test_bad_arguments_are_named(
    train_index: FolderIndex, kwargs: dict[str, Any], error: type, message: str
) -> None:
    args = {"batch_size": 4, "device": "cpu", **kwargs}
    with pytest.raises(error, match=message):
        DALILoader(train_index, **args)


def test_index_must_be_a_folder_index_or_a_dataset_with_bytes(imagenet_root: Path) -> None:
    with pytest.raises(
        TypeError, match="index should be a fastload.FolderIndex .* or a dataset with index and"
    ):
        DALILoader(str(imagenet_root / "train"), 4)


def test_tar_shards_feed_the_bytes_and_labels_of_the_same_images_as_a_folder(
    imagenet_root: Path, train_index: FolderIndex, tmp_path: Path
) -> None:
    assert (
        main(
            ["shards", str(imagenet_root / "train"), str(tmp_path), "--shard-size", "1200000", "--no-shuffle"]
        )
        == 0
    )
    shards = TarShards(tmp_path, classes=tmp_path / "train-classes.json")  # several shards, folder order
    batches = [np.array([5, 0, 31]), np.array([17, 2])]
    for train in (True, False):  # (data, anchor, shape, mirror), or (data, roi_start, roi_end)
        feeds = [_Feed(source, train, size=64, resize=73, seed=3) for source in (train_index, shards)]
        for feed in feeds:
            feed.start(1, batches)
        for _ in batches:
            folder, tars = feeds[0](), feeds[1]()
            assert [d.tobytes() for d in tars[0]] == [d.tobytes() for d in folder[0]]
            for a, b in zip(folder[1:], tars[1:], strict=True):
                np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(_samples(shards)[0].targets, train_index.targets)  # the labels fed


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_cuda_device_without_cuda_is_an_error(train_index: FolderIndex) -> None:
    with pytest.raises(ValueError, match="torch.cuda.is_available\\(\\) is False"):
        DALILoader(train_index, 4, device="cuda")


def test_header_sizes_match_pil(train_index: FolderIndex, val_index: FolderIndex) -> None:
    modes = set()
    for index in (train_index, val_index):
        for i in range(len(index)):
            raw = Path(index.paths[i]).read_bytes()
            with Image.open(index.paths[i]) as im:
                modes.add((im.format, im.mode))
                w, h = im.size
            assert image_size(raw) == (h, w), index.paths[i]
    assert {
        ("JPEG", "L"),
        ("JPEG", "CMYK"),
        ("PNG", "RGB"),
        ("JPEG", "RGB"),
    } <= modes  # the quirks were covered
    jpeg = Path(train_index.paths[0]).read_bytes()
    assert image_size(jpeg[:40]) is None  # truncated before the frame header: PIL decides
    assert image_size(b"GIF89a" + jpeg) is None
    assert image_size(b"") is None


# ------------------------------------------------------------------ with DALI


@pytest.mark.dali
def test_val_pipeline_labels_shapes_and_pixels(dali: Any, train_index: FolderIndex) -> None:
    # The train split holds every quirk (grayscale, CMYK, PNG named .JPEG); decode it with the eval pipeline.
    loader = DALILoader(train_index, 5, train=False, device="cpu", num_threads=2)
    images, labels = collect(loader)
    assert [len(y) for y in labels] == [5, 5, 5, 5, 5, 5, 2] and len(
        loader
    ) == 7  # short last batch, no padding
    assert all(
        x.dtype == torch.float32 and x.shape[1:] == (3, 224, 224) and x.device.type == "cpu" for x in images
    )
    assert all(y.dtype == torch.int64 for y in labels)
    got = torch.cat(labels)
    assert torch.equal(got, torch.as_tensor(ImageFolder(None, index=train_index).targets))  # sample by sample
    assert loader.indices() == list(range(len(train_index)))
    ref = torch.stack([torchvision_val(train_index.paths[i], 224) for i in range(len(train_index))])
    diff = (pixels(torch.cat(images)) - ref).abs()
    # Measured: max 1.0, mean 0.18 (0..255 scale) against torchvision's Resize(256) + CenterCrop(224).
    assert diff.max().item() <= 2.0
    assert diff.mean().item() <= 0.3
    assert diff.flatten(1).mean(1).max().item() <= 0.4  # every image, the quirky ones included
    assert loader.stats.samples == len(train_index) and loader.stats.batches == 7


@pytest.mark.dali
def test_train_crops_and_flips_are_fastloads_per_sample_draws(dali: Any, train_index: FolderIndex) -> None:
    loader = DALILoader(train_index, 5, train=True, seed=3, device="cpu", num_threads=2)
    loader.set_epoch(2)
    images, labels = collect(loader)
    order = loader.indices(2)
    assert len(order) == 30 and [len(y) for y in labels] == [5] * 6  # drop_last: 32 -> 30
    assert torch.equal(torch.cat(labels), torch.as_tensor(train_index.targets[order]))
    pipeline = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip()])
    refs, flips = [], 0
    for i in order:
        img = Image.open(train_index.paths[i]).convert("RGB")
        plan = pipeline.plan(img.height, img.width, rng.SampleRNG(3, 2, i))  # what fastload.DataLoader draws
        (_, top, left, h, w), *_ = [op for op in plan.ops if op[0] == "crop"]
        t = F.resized_crop(F.pil_to_tensor(img), top, left, h, w, [224, 224], antialias=True)
        refs.append((t.flip(-1) if plan.flip else t).float())
        flips += plan.flip
    assert 0 < flips < len(order)  # both branches checked
    diff = (pixels(torch.cat(images)) - torch.stack(refs)).abs()
    # Measured: mean 0.009, 99.9th percentile 5, max 13 (DALI's antialias filter at hard edges).
    # A wrong box or flip would give a mean difference in the tens.
    assert diff.mean().item() <= 0.1
    assert torch.quantile(diff.flatten()[::11], 0.999).item() <= 8
    assert diff.max().item() <= 32


@pytest.mark.dali
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [12, 10, 3])
def test_eval_sees_every_sample_exactly_once(
    dali: Any, val_index: FolderIndex, world_size: int, n: int
) -> None:
    # n=10 on 4 ranks with batches of 2: the last round has 2 samples for 4 ranks; n=3 on 4: rank 3 is empty.
    index = val_index.subset(range(n))
    ref = torch.stack([torchvision_val(index.paths[i], 32) for i in range(n)])
    seen: list[int] = []
    for rank in range(world_size):
        loader = DALILoader(
            index, 2, train=False, size=32, device="cpu", num_threads=1, num_replicas=world_size, rank=rank
        )
        shard = loader.indices()
        assert shard == list(range(rank, n, world_size))  # fastload's strided, unpadded shard
        images, labels = collect(loader)
        assert len(images) == len(loader) == -(-len(shard) // 2)
        assert all(0 < len(y) <= 2 for y in labels)
        if not shard:
            continue
        x = pixels(torch.cat(images))
        assert torch.equal(torch.cat(labels), torch.as_tensor(index.targets[shard]))
        # Which sample is each image? The nearest torchvision reference must be the claimed one.
        dist = (x[:, None] - ref[None]).abs().flatten(2).mean(2)
        assert dist.argmin(1).tolist() == shard
        assert dist.min(1).values.max().item() <= 0.5
        seen += shard
    assert sorted(seen) == list(range(n))


@pytest.mark.dali
def test_epoch_orders_are_reproducible_across_restarts(dali: Any, train_index: FolderIndex) -> None:
    def make(rank: int, seed: int = 5) -> DALILoader:
        return DALILoader(
            train_index,
            4,
            train=True,
            size=32,
            seed=seed,
            device="cpu",
            num_threads=1,
            num_replicas=2,
            rank=rank,
        )

    runs = {}
    for rank in range(2):
        loader = make(rank)
        assert len(loader) == 4  # 16 samples per rank, 4 full batches
        runs[rank] = [collect(loader) for _ in range(3)]  # epochs 0, 1, 2 without set_epoch
        assert loader.epoch == 3
        for epoch in range(3):
            expected = DistributedSampler(train_index, 2, rank, shuffle=True, seed=5, drop_last=True).indices(
                epoch
            )
            assert loader.indices(epoch) == expected
            assert torch.equal(
                torch.cat(runs[rank][epoch][1]), torch.as_tensor(train_index.targets[expected])
            )
    for epoch in range(3):  # the two ranks' shards of an epoch are disjoint
        assert not set(make(0).indices(epoch)) & set(make(1).indices(epoch))
    assert make(0).indices(0) != make(0).indices(1) != make(0).indices(2)
    epoch0, epoch1 = torch.cat(runs[0][0][0]), torch.cat(runs[0][1][0])
    assert not torch.equal(epoch0, epoch1)  # a new order and new crops

    restarted = make(0)  # a new process resuming at epoch 2: bitwise what the uninterrupted run saw
    restarted.set_epoch(2)
    images, labels = collect(restarted)
    assert all(torch.equal(a, b) for a, b in zip(images, runs[0][2][0], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(labels, runs[0][2][1], strict=True))
    assert make(0, seed=6).indices(2) != make(0).indices(2)


@pytest.mark.dali
def test_mid_epoch_resume_gives_the_rest_of_the_epoch(dali: Any, train_index: FolderIndex) -> None:
    def make() -> DALILoader:
        return DALILoader(train_index, 4, train=True, size=32, seed=1, device="cpu", num_threads=1)

    full = make()
    full.set_epoch(1)
    expected = collect(full)
    first = make()
    first.set_epoch(1)
    it = iter(first)
    next(it), next(it), next(it)
    state = first.state_dict()
    assert (state["epoch"], state["batches"]) == (1, 3)
    del it
    resumed = make()
    resumed.load_state_dict(state)
    rest = collect(resumed)
    assert len(rest[0]) == len(expected[0]) - 3 == len(first) - 3
    assert all(torch.equal(a, b) for a, b in zip(rest[0], expected[0][3:], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(rest[1], expected[1][3:], strict=True))
    assert resumed.epoch == 2  # the next pass is epoch 2
    done = resumed.state_dict()
    again = make()
    again.load_state_dict(done)  # saved at the end of epoch 1: resumes at the start of epoch 2
    assert again.state_dict()["epoch"] == 2 and again.state_dict()["batches"] == 0
    # another batch size: the same rest of the epoch (each sample with its own crop and flip), in
    # batches of 8: 20 samples left, 2 whole batches (train drops the last incomplete one)
    eights = DALILoader(train_index, 8, train=True, size=32, device="cpu", num_threads=1)
    eights.load_state_dict(state)
    rest8 = collect(eights)
    assert len(rest8[1]) == 2
    assert torch.equal(torch.cat(rest8[1]), torch.cat(expected[1][3:])[:16])
    assert torch.equal(torch.cat(rest8[0]), torch.cat(expected[0][3:])[:16])


@pytest.mark.dali
def test_resume_on_another_number_of_ranks(dali: Any, train_index: FolderIndex) -> None:
    """Evaluation on 4 ranks (batches of 3) stopped after 1 step, finished on 3 ranks (batches of
    2): every image of the epoch exactly once; its pixels those the uninterrupted run gives it."""

    def make(world: int, rank: int, batch: int) -> DALILoader:
        return DALILoader(
            train_index, batch, train=False, size=32, device="cpu", num_threads=1,
            num_replicas=world, rank=rank,
        )  # fmt: skip

    whole = {}
    for x, i in zip(collect(make(1, 0, 4))[0], _chunks(list(range(32)), 4), strict=True):
        whole.update(zip(i, x, strict=True))
    seen, state = [], None
    for rank in range(4):
        lo = make(4, rank, 3)
        it = iter(lo)
        images = next(it)[0]
        seen += lo.indices(0)[:3]
        state = state or lo.state_dict()  # rank 0's, inside the pass
        assert all(torch.equal(a, whole[i]) for a, i in zip(images, lo.indices(0)[:3], strict=True))
    assert state is not None and state["position"] == 12
    for rank in range(3):
        lo = make(3, rank, 2)
        lo.load_state_dict(state)
        rest = lo.sampler.indices(0, start=12)
        images = torch.cat(collect(lo)[0]) if rest else torch.empty(0)
        assert all(torch.equal(a, whole[i]) for a, i in zip(images, rest, strict=True))
        seen += rest
    assert sorted(seen) == list(range(32))


def _chunks(items: list[int], size: int) -> list[list[int]]:
    return [items[k : k + size] for k in range(0, len(items), size)]


@pytest.mark.dali
def test_abandoned_pass_does_not_leak_into_the_next(dali: Any, val_index: FolderIndex) -> None:
    from fastload.device import auto_num_workers, default_device

    loader = DALILoader(val_index, 2, train=False, size=32)  # device and num_threads picked for this machine
    assert loader.device == default_device() and loader.num_threads == auto_num_workers()
    expected = collect(loader)
    for _images, _ in loader:
        break  # leaves batches in flight in DALI's queue
    again = collect(loader)  # a full, fresh pass: nothing stale from the abandoned one
    assert all(torch.equal(a, b) for a, b in zip(again[0], expected[0], strict=True))
    old = iter(loader)
    next(old)
    new = collect(loader)  # starts a new pass while `old` is suspended
    assert len(new[0]) == len(loader)
    with pytest.raises(RuntimeError, match="a new pass over the loader started"):
        next(old)
    loader.close()
    assert len(collect(loader)[0]) == len(loader)  # close() releases the pipeline; the next pass rebuilds it


@pytest.mark.dali
def test_bench_backend_yields_normalized_batches(
    dali: Any, imagenet_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = dali_backend()
    assert backend.name == "dali" and backend.unavailable() is None
    config = BenchConfig(data=imagenet_root, batch_size=4, batches=2, warmup=1, repeat=1)
    loader = backend.build(config, "train", 0)
    assert isinstance(loader, DALILoader) and loader.num_threads == 1 and loader.train
    images, labels = next(iter(loader))
    assert images.shape == (4, 3, 224, 224) and images.dtype == torch.float32 and labels.dtype == torch.int64
    assert abs(images.mean().item()) < 1.5  # normalized, not 0..255
    loader.close()
    monkeypatch.setitem(BACKENDS, "dali", backend)
    records = timing.run(config, ["torchvision", "dali"], ["val"], [0], log=lambda line: None)
    assert [r["backend"] for r in records] == ["torchvision", "dali"]
    assert records[1]["images_per_s"] > 0 and records[1]["ratio_vs_torchvision"] is not None


@pytest.mark.cuda
@pytest.mark.dali
def test_gpu_pipeline_matches_cpu_pipeline(dali: Any, val_index: FolderIndex) -> None:
    cpu = torch.cat(collect(DALILoader(val_index, 4, train=False, device="cpu", num_threads=2))[0])
    gpu_images, gpu_labels = collect(DALILoader(val_index, 4, train=False, device="cuda", num_threads=2))
    assert all(x.is_cuda for x in gpu_images) and all(y.is_cuda for y in gpu_labels)
    diff = (pixels(torch.cat(gpu_images).cpu()) - pixels(cpu)).abs()
    assert diff.mean().item() <= 1.0  # nvJPEG's IDCT differs a little from libjpeg-turbo's
