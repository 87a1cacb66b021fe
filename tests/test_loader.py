from __future__ import annotations

import gc
import pickle
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import torch
import torchvision
from _batches import collect as _collect
from _batches import same as _same

import fastload
from fastload import ImageFolder, gpu
from fastload import transforms as T
from fastload._threads import held_caps
from fastload.loader import DataLoader, EpochRandomSampler, auto_num_workers


def _train_tf(size: int = 32) -> T.Compose:
    return T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip()])


def _val_tf() -> T.Compose:
    return T.Compose([T.Resize(40), T.CenterCrop(32)])


@pytest.fixture(scope="module")
def train_set(imagenet_root: Path) -> ImageFolder:
    return ImageFolder(imagenet_root / "train", transform=_train_tf())


# ------------------------------------------------------------------------------------ contract


def test_contract_uint8_nchw_batches(imagenet_root: Path) -> None:
    ds = ImageFolder(
        imagenet_root / "train", transform=T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip()])
    )
    loader = DataLoader(ds, batch_size=8, shuffle=True, seed=3, num_workers=2)
    assert isinstance(loader, torch.utils.data.DataLoader) and loader.fast_path
    batches = _collect(loader)
    assert len(batches) == len(loader) == 4
    for images, labels in batches:
        assert images.shape == (8, 3, 224, 224) and images.dtype == torch.uint8
        assert labels.dtype == torch.int64 and labels.shape == (8,)
    seen = torch.cat([y for _, y in batches])
    assert sorted(seen.tolist()) == sorted(ds.targets.tolist())  # every sample once, labels right
    loader.close()


def test_images_equal_the_transform_applied_per_sample(train_set: ImageFolder) -> None:
    """Batch j of the loader holds exactly transform(sample) under that sample's rng scope."""
    loader = DataLoader(train_set, batch_size=6, shuffle=True, seed=11, num_workers=0)
    order = list(loader.sampler) if False else fastload.rng.epoch_permutation(len(train_set), 11, 0).tolist()
    (images, labels), *_ = _collect(loader, 1)
    for j, i in enumerate(order[:6]):
        with fastload.rng.sample_scope(11, 0, i):
            expected = train_set.transform.decode_and_apply(train_set.get_bytes(i), "x")
        assert torch.equal(images[j], expected)
        assert labels[j] == train_set.targets[i]


def test_generic_dataset_behaves_like_torch(imagenet_root: Path) -> None:
    ds = torchvision.datasets.ImageFolder(
        str(imagenet_root / "val"),
        transform=torchvision.transforms.Compose(
            [
                torchvision.transforms.Resize((16, 16)),
                torchvision.transforms.Grayscale(3),
                torchvision.transforms.PILToTensor(),
            ]
        ),
    )
    ours = DataLoader(ds, batch_size=5, num_workers=0)
    theirs = torch.utils.data.DataLoader(ds, batch_size=5)
    assert not ours.fast_path
    assert _same(_collect(ours), _collect(theirs))
    names = DataLoader(ds, batch_size=4, collate_fn=_labels_only, num_workers=1)
    assert sum((b for b in names), []) == ds.targets


def _labels_only(batch: list[tuple[torch.Tensor, int]]) -> list[int]:
    return [t for _, t in batch]


class _Count(torch.utils.data.IterableDataset):
    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(range(10))


def test_iterable_dataset_and_shuffle_semantics() -> None:
    loader = DataLoader(_Count(), batch_size=4, num_workers=0)
    assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    with pytest.raises(ValueError, match="shuffle"):
        DataLoader(_Count(), batch_size=4, shuffle=True, num_workers=0)


def test_last_batch_and_drop_last(imagenet_root: Path) -> None:
    ds = ImageFolder(imagenet_root / "val", transform=_val_tf())  # 12 samples
    assert [len(y) for _, y in DataLoader(ds, batch_size=5, num_workers=0)] == [5, 5, 2]
    assert [len(y) for _, y in DataLoader(ds, batch_size=5, num_workers=2, drop_last=True)] == [5, 5]
    assert len(DataLoader(ds, batch_size=5, num_workers=0, drop_last=True)) == 2
    # Unshuffled: dataset order, exactly torchvision's labels.
    labels = torch.cat([y for _, y in DataLoader(ds, batch_size=5, num_workers=2)])
    assert labels.tolist() == ds.targets.tolist()


# ------------------------------------------------------------------------------------ determinism


@pytest.mark.parametrize(
    "num_workers, worker_type", [(1, "process"), (2, "process"), (3, "process"), (2, "thread"), (3, "thread")]
)
@pytest.mark.filterwarnings("ignore:This DataLoader will create")  # 3 workers on 2 CPUs: torch's advice
def test_same_batches_for_any_workers(train_set: ImageFolder, num_workers: int, worker_type: str) -> None:
    reference = _collect(DataLoader(train_set, batch_size=5, shuffle=True, seed=7, num_workers=0))
    loader = DataLoader(
        train_set, batch_size=5, shuffle=True, seed=7, num_workers=num_workers, worker_type=worker_type
    )
    assert _same(_collect(loader), reference)
    loader.close()


def test_epochs_differ_and_set_epoch_replays(train_set: ImageFolder) -> None:
    loader = DataLoader(train_set, batch_size=8, shuffle=True, seed=5, num_workers=2)
    e0, e1 = _collect(loader), _collect(loader)  # no set_epoch: epochs 0 then 1
    assert not _same(e0, e1)
    loader.set_epoch(0)
    assert _same(_collect(loader), e0)
    loader.set_epoch(1)
    assert _same(_collect(loader), e1)
    other_seed = DataLoader(train_set, batch_size=8, shuffle=True, seed=6, num_workers=0)
    assert not _same(_collect(other_seed), e0)
    # The augmentation of a sample depends on the epoch too, not only the order.
    unshuffled = DataLoader(train_set, batch_size=8, shuffle=False, seed=5, num_workers=0)
    a, b = _collect(unshuffled), _collect(unshuffled)
    assert [y.tolist() for _, y in a] == [y.tolist() for _, y in b] and not _same(a, b)
    loader.close()


def test_seed_none_follows_torch_manual_seed(train_set: ImageFolder) -> None:
    def run() -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]:
        torch.manual_seed(123)
        loader = DataLoader(train_set, batch_size=8, shuffle=True, num_workers=0)
        return loader.seed, _collect(loader)

    (seed_a, a), (seed_b, b) = run(), run()
    assert seed_a == seed_b and _same(a, b)
    torch.manual_seed(124)
    assert DataLoader(train_set, batch_size=8, shuffle=True, num_workers=0).seed != seed_a


# ------------------------------------------------------------------------------------ resume


def _collect_then_save(
    loader: DataLoader, stop_after: int
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], dict]:
    """Takes ``stop_after`` batches and the state saved right after the last one (inside the loop)."""
    out, state = [], None
    for k, (x, y) in enumerate(loader):
        out.append((x.clone(), y.clone()))
        if k + 1 == stop_after:
            state = loader.state_dict()
            break
    assert state is not None
    return out, state


def _resume_case(loader_kwargs: dict, dataset: object, stop_after: int) -> None:
    """The shared save-and-resume check: run through 2 epochs, or stop, save, resume elsewhere."""
    full = DataLoader(dataset, **loader_kwargs)
    uninterrupted = _collect(full) + _collect(full)
    first = DataLoader(dataset, **loader_kwargs)
    head, state = _collect_then_save(first, stop_after)
    state = pickle.loads(pickle.dumps(state))
    second = DataLoader(dataset, **{**loader_kwargs, "seed": 999})  # the state carries the seed
    second.load_state_dict(state)
    tail = _collect(second)
    if stop_after < len(second):  # stopped mid-epoch: the rest of it, then the next epoch
        tail += _collect(second)
    assert _same(head + tail, uninterrupted)
    # Between passes, the state says what the live loader does next: the next epoch.
    after_break = first.state_dict()
    assert (after_break["epoch"], after_break["batches"]) == (1, 0)
    assert _same(_collect(first), uninterrupted[len(full) :])
    for lo in (full, first, second):
        lo.close()


@pytest.mark.parametrize("num_workers, worker_type", [(0, "process"), (2, "process"), (2, "thread")])
@pytest.mark.parametrize("stop_after", [1, 3, 7])
def test_resume_mid_epoch_fast_path(
    train_set: ImageFolder, num_workers: int, worker_type: str, stop_after: int
) -> None:
    _resume_case(
        {
            "batch_size": 5,
            "shuffle": True,
            "seed": 21,
            "num_workers": num_workers,
            "worker_type": worker_type,
        },
        train_set,
        stop_after,
    )


def test_resume_on_torch_path(imagenet_root: Path) -> None:
    ds = torchvision.datasets.ImageFolder(
        str(imagenet_root / "val"),
        transform=torchvision.transforms.Compose(
            [torchvision.transforms.Resize((8, 8)), torchvision.transforms.PILToTensor()]
        ),
    )
    _resume_case({"batch_size": 5, "shuffle": True, "seed": 2, "num_workers": 0}, ds, 2)


_RESUME_SCRIPT = r"""
import pickle, sys, torch
from fastload import ImageFolder, DataLoader, transforms as T
ds = ImageFolder(sys.argv[1], transform=T.Compose([T.RandomResizedCrop(32), T.RandomHorizontalFlip()]))
loader = DataLoader(ds, batch_size=5, shuffle=True, num_workers=2)
loader.load_state_dict(pickle.load(open(sys.argv[2], "rb")))
batches = [(x.clone(), y.clone()) for x, y in loader]
torch.save(batches, sys.argv[3])
"""


def test_resume_in_a_new_process(train_set: ImageFolder, tmp_path: Path) -> None:
    loader = DataLoader(train_set, batch_size=5, shuffle=True, seed=4, num_workers=2)
    loader.set_epoch(3)
    full = _collect(loader)
    loader.set_epoch(3)
    head, state = _collect_then_save(loader, 2)
    (tmp_path / "state.pkl").write_bytes(pickle.dumps(state))
    (tmp_path / "resume.py").write_text(_RESUME_SCRIPT)
    subprocess.run(
        [
            sys.executable,
            str(tmp_path / "resume.py"),
            train_set.root,
            str(tmp_path / "state.pkl"),
            str(tmp_path / "out.pt"),
        ],
        check=True,
        timeout=300,
    )
    tail = torch.load(tmp_path / "out.pt")
    assert _same(head + tail, full)
    loader.close()


def test_state_dict_errors(train_set: ImageFolder, imagenet_root: Path) -> None:
    loader = DataLoader(train_set, batch_size=5, num_workers=0)
    with pytest.raises(ValueError, match="state_dict"):
        loader.load_state_dict({"epoch": 1})
    other = DataLoader(ImageFolder(imagenet_root / "val", transform=_val_tf()), batch_size=5, num_workers=0)
    with pytest.raises(ValueError, match="12 samples"):
        other.load_state_dict(loader.state_dict())


# ------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (
            {"batch_size": 0},
            ValueError,
            "batch_size should be a positive integer value, but got batch_size=0",
        ),
        ({"num_workers": -1}, ValueError, "num_workers option should be non-negative"),
        ({"num_workers": "many"}, TypeError, "num_workers should be a non-negative integer or 'auto'"),
        ({"worker_type": "fiber"}, ValueError, "worker_type"),
        ({"on_error": "ignore"}, ValueError, "on_error"),
        ({"seed": "x"}, TypeError, "seed"),
        ({"shuffle": True, "sampler": [0, 1]}, ValueError, "mutually exclusive"),
    ],
)
def test_bad_arguments(train_set: ImageFolder, kwargs: dict, exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        DataLoader(train_set, **{"num_workers": 0, **kwargs})


def _corrupt_tree(root: Path) -> Path:
    from fastload.synthetic import make_imagenet_like

    make_imagenet_like(root, classes=2, per_class=4, val_per_class=0, seed=1, num_workers=1)
    bad = sorted((root / "train").rglob("*.JPEG"))[2]
    bad.write_bytes(b"\xff\xd8\xff\xe0 definitely not a jpeg")
    return bad


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_ops_own_error_on_a_good_image_is_torchvisions(tmp_path: Path, num_workers: int) -> None:
    """A valid file whose geometry an op refuses (14x900: ``Resize(20, max_size=64)`` makes it 0 px
    wide) raises torchvision's ValueError as torch's loader does, not a DecodeError telling the
    user to remove the file; the traceback names the sample (Python 3.11+)."""
    from PIL import Image
    from torchvision import transforms as tvT

    for cls, size in (("a", (40, 40)), ("b", (14, 900))):
        (tmp_path / cls).mkdir()
        Image.new("RGB", size, (90, 120, 200)).save(tmp_path / cls / "x.jpg", quality=90)
    transform = tvT.Compose([tvT.Resize(20, max_size=64), tvT.CenterCrop(20), tvT.PILToTensor()])
    ds = torchvision.datasets.ImageFolder(tmp_path, transform=transform)
    loader = DataLoader(ds, batch_size=1, num_workers=num_workers)
    assert loader.fast_path
    with pytest.raises(ValueError) as info:
        list(loader)
    assert not isinstance(info.value, fastload.DecodeError)
    with pytest.raises(ValueError) as want:
        list(torch.utils.data.DataLoader(ds, batch_size=1))
    assert str(info.value) == str(want.value) == "height and width must be > 0"
    if sys.version_info >= (3, 11):
        assert f"while transforming sample 1 ('{tmp_path / 'b' / 'x.jpg'}')" in info.value.__notes__[0]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_corrupt_image_raises_naming_it_or_is_skipped(tmp_path: Path, num_workers: int) -> None:
    bad = _corrupt_tree(tmp_path)
    ds = ImageFolder(tmp_path / "train", transform=_val_tf())
    with pytest.raises(Exception, match=bad.name):
        list(DataLoader(ds, batch_size=4, num_workers=num_workers))
    loader = DataLoader(ds, batch_size=4, num_workers=num_workers, on_error="skip")
    with pytest.warns(UserWarning, match=f"skipped sample 2 .*{bad.name}"):
        sizes = [len(y) for _, y in loader]
    assert sizes == [3, 4] and loader.stats.skipped == 1
    loader.close()


# ------------------------------------------------------------- num_workers=0: intra-op decode threads


def _decode_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("fastload-decode")}


@pytest.fixture
def torch_threads() -> Iterator[None]:
    """torch's thread count as the test sets it: no loader of an earlier test that waits for the
    garbage collector (its workers still alive) holds a cap on it meanwhile."""
    gc.collect()
    assert not held_caps(), f"a loader of an earlier test still caps torch's threads: {held_caps()}"
    saved = torch.get_num_threads()
    yield
    torch.set_num_threads(saved)


@pytest.mark.usefixtures("torch_threads")
def test_inline_decode_splits_a_batch_over_torchs_threads(tmp_path: Path, train_set: ImageFolder) -> None:
    """num_workers=0 decodes a batch with torch.get_num_threads() threads: the same batches as one
    thread (skips, labels and target_transform included), the same first error, and no thread
    left after close()."""
    torch.set_num_threads(1)
    one = _collect(DataLoader(train_set, batch_size=8, num_workers=0, shuffle=True, seed=3))
    assert not _decode_threads()
    torch.set_num_threads(3)
    loader = DataLoader(train_set, batch_size=8, num_workers=0, shuffle=True, seed=3)
    it = iter(loader)
    first = next(it)
    # the batch was split over torch's threads (the loader caps those at the CPU count); a thread
    # that finished its part early takes another part, so there may be fewer threads than parts
    pool = it._source.pool
    assert pool.inline is not None and pool.inline_parts >= 2
    assert 1 <= len(_decode_threads()) <= pool.inline_parts <= torch.get_num_threads()
    assert _same([(first[0].clone(), first[1].clone()), *_collect(it)], one)
    del it, first
    loader.close()
    assert not _decode_threads()

    bad = _corrupt_tree(tmp_path)
    ds = ImageFolder(tmp_path / "train", transform=_val_tf(), target_transform=lambda y: 10 + y)
    batches = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        with pytest.raises(Exception, match=bad.name):
            list(DataLoader(ds, batch_size=4, num_workers=0))
        loader = DataLoader(ds, batch_size=4, num_workers=0, on_error="skip")
        with pytest.warns(UserWarning, match=f"skipped sample 2 .*{bad.name}"):
            batches[threads] = _collect(loader)
        loader.close()
    assert _same(batches[1], batches[2])
    assert [len(y) for _, y in batches[2]] == [3, 4] and batches[2][0][1].min() >= 10


class _OwnReader(ImageFolder):
    """A user's ``get_bytes``: user code, so it runs in the thread torch would run it in."""

    threads: set[str] = set()

    def get_bytes(self, i: int) -> bytes:
        _OwnReader.threads.add(threading.current_thread().name)
        return super().get_bytes(i)


@pytest.mark.usefixtures("torch_threads")
def test_inline_decode_runs_a_users_reader_in_the_calling_thread(imagenet_root: Path) -> None:
    torch.set_num_threads(2)
    ds = _OwnReader(imagenet_root / "train", transform=_train_tf())
    assert sum(len(y) for _, y in DataLoader(ds, batch_size=8, num_workers=0)) == len(ds)
    assert _OwnReader.threads == {threading.current_thread().name}


# ------------------------------------------------------------------------------------ extras


def test_stats_and_reuse_buffers(train_set: ImageFolder) -> None:
    loader = DataLoader(train_set, batch_size=8, num_workers=2, shuffle=True, seed=0)
    assert sum(len(x) for x, _ in loader) == 32
    assert loader.stats.batches == 4 and loader.stats.samples == 32
    assert 0 <= loader.stats.stall_fraction <= 1 and loader.stats.images_per_s > 0
    assert sum(loader.stats.decode_seconds.values()) > 0
    assert "4 batches, 32 samples" in loader.stats.summary()
    # With reuse, the batch buffers are a fixed ring; without, every batch is fresh memory.
    ring = DataLoader(train_set, batch_size=2, num_workers=2, shuffle=True, seed=0)
    ptrs = [x.data_ptr() for x, _ in ring]
    assert len(ptrs) == 16 and len(set(ptrs)) < 16
    ring.close()
    copies = DataLoader(train_set, batch_size=8, num_workers=2, shuffle=True, seed=0, reuse_buffers=False)
    kept = [x for x, _ in copies]
    fresh = [x.clone() for x, _ in DataLoader(train_set, batch_size=8, num_workers=0, shuffle=True, seed=0)]
    assert all(torch.equal(a, b) for a, b in zip(kept, fresh, strict=True))
    loader.close()
    copies.close()


@pytest.mark.usefixtures("torch_threads")
def test_defaults_fix_known_traps(train_set: ImageFolder) -> None:
    loader = DataLoader(train_set, batch_size=4)
    assert loader.num_workers == auto_num_workers() >= 1
    assert loader.persistent_workers is True
    assert loader.pin_memory is torch.cuda.is_available()
    assert isinstance(DataLoader(train_set, shuffle=True, num_workers=0).sampler, EpochRandomSampler)
    torch.set_num_threads(64)
    capped = DataLoader(train_set, batch_size=16, num_workers=1)
    list(capped)
    # capped while the loader lives, so the main process and its worker fit the CPUs ...
    assert torch.get_num_threads() <= max(1, len(psutil.Process().cpu_affinity()) - 1)
    capped.close()
    assert torch.get_num_threads() == 64  # ... and given back when it is closed
    list(DataLoader(train_set, batch_size=16, num_workers=1))  # or garbage-collected
    assert torch.get_num_threads() == 64
    # several loaders alive at once: tests/test_threads.py


def test_auto_workers_divided_among_local_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("fastload.device.available_cpus", lambda: 32)
    assert auto_num_workers() == 16
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert auto_num_workers() == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "64")
    assert auto_num_workers() == 1


def test_empty_dataset_yields_nothing(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    ds = ImageFolder(tmp_path, transform=_val_tf(), allow_empty=True)
    assert len(ds) == 0
    assert list(DataLoader(ds, batch_size=4, num_workers=2)) == []


# ------------------------------------------------------------------------------------ device path


def test_device_and_gpu_transforms_on_cpu(train_set: ImageFolder) -> None:
    """device=/gpu_transforms= run the prefetcher path on CPU: normalized floats, per-sample params."""
    from fastload import gpu

    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    tf = gpu.Compose([gpu.RandomHorizontalFlip(), gpu.Normalize(mean, std)])
    loader = DataLoader(
        train_set, batch_size=5, shuffle=True, seed=9, num_workers=2, device="cpu", gpu_transforms=tf
    )
    host = DataLoader(train_set, batch_size=5, shuffle=True, seed=9, num_workers=0, reuse_buffers=False)
    out = _collect(loader)
    ref = [b for b in host]  # IndexedBatch: carries the sample indices
    assert len(out) == len(ref) == 7
    for (x, y), batch in zip(out, ref, strict=True):
        expected = tf(batch[0], indices=batch.indices, epoch=0, seed=9)
        assert x.dtype == torch.float32 and x.shape == batch[0].shape
        assert torch.equal(x, expected) and torch.equal(y, batch[1])
    assert loader.stats.batches == 7 and loader.stats.samples == 32
    loader.close()


def test_device_path_resume_is_exact(train_set: ImageFolder) -> None:
    from fastload import gpu

    kwargs = {
        "batch_size": 5,
        "shuffle": True,
        "seed": 3,
        "num_workers": 2,
        "device": "cpu",
        "gpu_transforms": gpu.Normalize((0.5,), (0.5,)),
    }
    _resume_case(kwargs, train_set, 3)


def test_distributed_true_builds_the_right_sampler(train_set: ImageFolder, tmp_path: Path) -> None:
    import torch.distributed as dist

    from fastload import DistributedSampler

    with pytest.raises(ValueError, match="distributed=True"):
        DataLoader(train_set, distributed=True, sampler=[0, 1], num_workers=0)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        train = DataLoader(train_set, batch_size=5, shuffle=True, distributed=True, seed=4, num_workers=0)
        val = DataLoader(train_set, batch_size=5, shuffle=False, distributed=True, num_workers=0)
        assert isinstance(train.sampler, DistributedSampler) and isinstance(val.sampler, DistributedSampler)
        assert train.sampler.shuffle and not train.sampler.drop_last and train.sampler.seed == 4
        assert not val.sampler.shuffle and not val.sampler.drop_last
        train.set_epoch(3)
        assert train.sampler.epoch == 3
        order = [int(i) for b in train for i in b.indices]
        assert order == fastload.rng.epoch_permutation(len(train_set), 4, 3).tolist()
        assert sorted(int(i) for b in val for i in b.indices) == list(range(len(train_set)))
    finally:
        dist.destroy_process_group()


def test_decode_on_device_matches_cpu_decode_plus_gpu_transforms(imagenet_root: Path) -> None:
    """decode='device' (run here on CPU tensors): same as decoding each file, then the batched transforms."""
    from fastload import InMemoryImageFolder, gpu
    from fastload.decode import decode_pil

    tf = gpu.Compose([gpu.RandomResizedCrop(48), gpu.RandomHorizontalFlip()])
    for ds in (ImageFolder(imagenet_root / "train"), InMemoryImageFolder(imagenet_root / "train")):
        loader = DataLoader(
            ds,
            batch_size=6,
            shuffle=True,
            seed=2,
            num_workers=1,
            decode="device",
            gpu_transforms=tf,
            device="cpu",
        )
        batches = _collect(loader)
        assert [len(y) for _, y in batches] == [6, 6, 6, 6, 6, 2]
        order = fastload.rng.epoch_permutation(len(ds), 2, 0).tolist()
        for k, (images, labels) in enumerate(batches):
            idx = order[6 * k : 6 * k + 6]
            decoded = [
                torch.from_numpy(np.array(decode_pil(bytes(ds.get_bytes(i))))).permute(2, 0, 1) for i in idx
            ]
            assert torch.equal(images, tf(decoded, indices=idx, epoch=0, seed=2))
            assert labels.tolist() == [int(ds.targets[i]) for i in idx]
        loader.close()


def test_decode_on_device_argument_checks(imagenet_root: Path) -> None:
    from fastload import gpu

    plain = ImageFolder(imagenet_root / "val")
    with pytest.raises(ValueError, match="needs gpu_transforms"):
        DataLoader(plain, decode="device")
    with pytest.raises(ValueError, match="leave the dataset's transform None"):
        DataLoader(
            ImageFolder(imagenet_root / "val", transform=_val_tf()),
            decode="device",
            gpu_transforms=gpu.Resize(8),
        )
    with pytest.raises(ValueError, match="decode should be"):
        DataLoader(plain, decode="gpu")
    # batches made ahead in a feeder thread: a ring of device buffers would be overwritten under
    # the loop (the in-thread prefetcher, one batch ahead, is where buffers=k is safe)
    ring = gpu.Compose([gpu.RandomResizedCrop(16), gpu.Normalize([0.5], [0.5], buffers=2)])
    for decode in ("device", "hybrid"):
        refused = rf"decode='{decode}' prepares batches 2 ahead .* leave buffers at 0"
        with pytest.raises(ValueError, match=refused):
            DataLoader(plain, decode=decode, gpu_transforms=ring)
    loader = DataLoader(plain, decode="device", gpu_transforms=gpu.Resize(8), batch_size=4)
    loader.gpu_transforms = ring  # set after construction: refused when the pass starts
    with pytest.raises(ValueError, match="would overwrite a batch the loop still holds"):
        iter(loader)
    loader.close()


def test_progress_bar(train_set: ImageFolder, capsys: pytest.CaptureFixture[str]) -> None:
    loader = DataLoader(train_set, batch_size=8, num_workers=0, progress=True)
    assert len([b for b in loader]) == 4
    err = capsys.readouterr().err
    assert "epoch 0" in err and "4/4" in err


# ------------------------------------------------------------------------------------ robustness
# A dataset that follows the encoded-dataset protocol with a trivial "decoder": sample i's pixels
# are i (+100 while SLOW is set, when decoding also takes a while), so any stale or misplaced write
# shows up in the batch.

_FAKE = {"slow": False, "bad": -1, "calls": 0}


class _FakeDecode:
    output_size = (2, 2)

    def decode_into(self, data: int, out: np.ndarray, name: str = "image") -> None:
        _FAKE["calls"] += 1
        if data == _FAKE["bad"]:
            raise fastload.DecodeError(f"cannot decode {name}")
        if _FAKE["slow"]:
            time.sleep(0.2)
        out[...] = (data % 100) + (100 if _FAKE["slow"] else 0)


class _RandomDecode:
    output_size = (1, 1)

    def decode_into(self, data: int, out: np.ndarray, name: str = "image") -> None:
        out[...] = fastload.rng.current().randint(0, 256)


class _FakeSet:
    def __init__(self, n: int, transform: object) -> None:
        self.n, self.transform, self.targets = n, transform, np.arange(n)

    def get_bytes(self, i: int) -> int:
        return i

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def test_abandoned_pass_never_overwrites_a_live_batch() -> None:
    loader = DataLoader(
        _FakeSet(40, _FakeDecode()), batch_size=2, num_workers=2, worker_type="thread", prefetch_factor=1
    )
    _FAKE["slow"] = True
    try:
        for _ in loader:  # abandoned with slow tasks still queued and running
            break
    finally:
        _FAKE["slow"] = False
    for k, batch in enumerate(loader):
        time.sleep(0.15)  # a training step, while stale tasks finish
        assert batch[0][:, 0, 0, 0].tolist() == (batch.indices % 100).tolist(), f"batch {k} overwritten"
        if k == 8:
            break
    loader.close()


def test_a_pass_left_alive_under_a_newer_one_says_so_and_takes_none_of_its_batches() -> None:
    # persistent workers asked for: one set, which the newer pass takes over (the default ones give
    # a newer pass beside a live one workers of its own: tests/test_torch_contract.py)
    loader = DataLoader(
        _FakeSet(40, _FakeDecode()),
        batch_size=2,
        num_workers=2,
        worker_type="thread",
        persistent_workers=True,
    )
    old = iter(loader)
    next(old)
    new = iter(loader)
    first = next(new)
    with pytest.raises(RuntimeError, match="a newer pass of the same loader"):
        next(old)
    rest = [b.indices.clone() for b in new]
    assert len(rest) == 19 and sorted(torch.cat([first.indices, *rest]).tolist()) == list(range(40))
    loader.close()


def test_a_newer_pass_is_the_next_epoch_and_the_one_it_took_over_from_stops_at_once(
    imagenet_root: Path,
) -> None:
    """A batch peeked at with an iterator kept aside, then the loop: the loop's pass is the next
    epoch (as after a break; set_epoch still decides), and the kept iterator's next() raises every
    time, its workers given time to decode its next batches first (process workers)."""
    ds = ImageFolder(imagenet_root / "train", transform=_train_tf(8))
    reference = DataLoader(ds, batch_size=4, shuffle=True, seed=5, num_workers=0)
    epochs = [[b.indices.tolist() for b in reference] for _ in range(3)]
    reference.close()
    loader = DataLoader(ds, batch_size=4, shuffle=True, seed=5, num_workers=2, persistent_workers=True)
    for trial in range(3):
        loader.set_epoch(0)
        kept = iter(loader)
        assert next(kept).indices.tolist() == epochs[0][0]
        time.sleep(0.5)  # its workers deliver the batches after it
        loop = iter(loader)
        assert loop.epoch == 1, trial
        with pytest.raises(RuntimeError, match="a newer pass of the same loader"):
            next(kept)
        assert [b.indices.tolist() for b in loop] == epochs[1]
        del kept
    loader.set_epoch(0)
    kept = iter(loader)
    next(kept)
    loader.set_epoch(2)
    assert [b.indices.tolist() for b in loader] == epochs[2]  # set_epoch between them decides
    loader.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_an_old_iterator_dropped_late_leaves_a_newer_pass_of_the_same_epoch_alone(
    imagenet_root: Path, workers: int
) -> None:
    """An iterator kept past load_state_dict (or set_epoch) and a new pass of the same epoch: when
    it is dropped, the new pass goes on being that epoch, and the state says so."""
    import gc

    ds = ImageFolder(imagenet_root / "train", transform=_train_tf(8))
    loader = DataLoader(ds, batch_size=4, shuffle=True, seed=5, num_workers=workers)
    whole = [b.indices.tolist() for b in loader]  # epoch 0
    loader.set_epoch(0)
    old = iter(loader)
    next(old), next(old)
    loader.load_state_dict(loader.state_dict())  # epoch 0, 2 batches handed out
    new = iter(loader)
    got = [next(new).indices.tolist()]
    del old
    gc.collect()
    state = loader.state_dict()
    assert (state["epoch"], state["position"]) == (0, 3 * 4)  # 3 batches of 4 of epoch 0 handed out
    got += [b.indices.tolist() for b in new]
    assert got == whole[2:]
    loader.set_epoch(3)
    old = iter(loader)
    next(old)
    loader.set_epoch(3)
    new = iter(loader)
    next(new)
    del old
    gc.collect()
    state = loader.state_dict()
    assert (state["epoch"], state["position"]) == (3, 4)
    del new
    loader.close()


def test_close_while_iterating_raises_instead_of_hanging() -> None:
    loader = DataLoader(
        _FakeSet(400, _FakeDecode()), batch_size=2, num_workers=2, worker_type="thread", timeout=0
    )
    it = iter(loader)
    next(it)
    loader.close()
    with pytest.raises(RuntimeError, match="closed"):
        for _ in it:
            pass


def test_close_stops_torchs_persistent_workers(imagenet_root: Path) -> None:
    """On torch's path too: close() stops the persistent workers now (not when torch's iterator is
    garbage-collected), and the next pass starts new ones and gives the same batches."""
    from torchvision import transforms as v1

    transform = v1.Compose([v1.CenterCrop(16), v1.PILToTensor(), v1.ColorJitter(0.2)])
    dataset = fastload.ImageFolder(imagenet_root / "val", transform=transform)
    loader = DataLoader(dataset, batch_size=4, num_workers=2, multiprocessing_context="fork")
    assert not loader.fast_path and loader.persistent_workers
    first = [y.tolist() for _, y in loader]
    workers = list(loader._iterator._workers)  # torch's worker processes
    assert len(workers) == 2 and all(w.is_alive() for w in workers)
    loader.close()
    assert not any(w.is_alive() for w in workers)
    assert [y.tolist() for _, y in loader] == first
    loader.close()


def test_seed_of_a_loaded_state_reaches_running_workers() -> None:
    ds = _FakeSet(12, _RandomDecode())
    fresh = DataLoader(ds, batch_size=4, shuffle=True, seed=2, num_workers=2)
    expected = _collect(fresh)
    loader = DataLoader(ds, batch_size=4, shuffle=True, seed=1, num_workers=2)
    next(iter(loader))  # the workers exist, started with seed 1
    loader.load_state_dict(fresh.state_dict() | {"epoch": 0, "batches": 0})
    assert _same(_collect(loader), expected)
    for lo in (fresh, loader):
        lo.close()


def test_inline_path_decodes_one_batch_per_next_and_errors_at_its_batch() -> None:
    _FAKE["calls"], _FAKE["bad"] = 0, 8
    try:
        loader = DataLoader(_FakeSet(20, _FakeDecode()), batch_size=2, num_workers=0)
        it = iter(loader)
        next(it)
        next(it)
        assert _FAKE["calls"] == 4
        got = [b.indices.tolist() for b in [next(it), next(it)]]
        assert got == [[4, 5], [6, 7]]
        with pytest.raises(fastload.DecodeError, match="sample 8"):
            next(it)
    finally:
        _FAKE["bad"] = -1


@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_worker_errors_keep_their_type(worker_type: str) -> None:
    _FAKE["bad"] = 5
    try:
        loader = DataLoader(
            _FakeSet(10, _FakeDecode()),
            batch_size=2,
            num_workers=2,
            worker_type=worker_type,
            persistent_workers=False,
        )
        with pytest.raises(fastload.DecodeError, match="sample 5"):
            list(loader)
    finally:
        _FAKE["bad"] = -1


def _plus_ten(target: int) -> int:
    return target + 10


def test_target_transform_on_every_path(imagenet_root: Path) -> None:
    from fastload import gpu

    expected = [t + 10 for t in ImageFolder(imagenet_root / "val").targets.tolist()]
    fast = DataLoader(
        ImageFolder(imagenet_root / "val", transform=_val_tf(), target_transform=_plus_ten),
        batch_size=5,
        num_workers=2,
    )
    device = DataLoader(
        ImageFolder(imagenet_root / "val", target_transform=_plus_ten),
        batch_size=5,
        num_workers=1,
        decode="device",
        gpu_transforms=gpu.Resize((8, 8)),
        device="cpu",
    )
    for loader in (fast, device):
        assert torch.cat([y for _, y in loader]).tolist() == expected
        loader.close()


class _RecordingReads(ImageFolder):
    """A user's ``get_bytes`` (a subclass's own: read by the reader threads), recording the thread
    that read each sample; sample ``fail`` raises."""

    fail = -1

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.reads: list[tuple[str, int]] = []

    def get_bytes(self, i: int) -> bytes:
        import threading

        self.reads.append((threading.current_thread().name, i))
        if i == self.fail:
            raise OSError(f"sample {i} could not be read")
        return super().get_bytes(i)


def test_device_decode_reads_runs_of_samples_and_checked_in_memory_bytes_in_its_decoder_thread(
    imagenet_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """decode="device": a dataset's own ``get_bytes`` (files) runs in the reader threads, in runs of
    consecutive samples (READ_TASKS_PER_READER per reader and batch, not a task per sample); an
    InMemoryImageFolder's bytes too while their CRC-32 is still to be checked (its first epoch),
    then its slices are taken by the decoder thread itself (no reader task), at once where
    check_crc is off; an instance's own get_bytes is the user's (reader threads). Same batches."""
    from fastload import InMemoryImageFolder, _devicepass, gpu

    chunks: list[list[int]] = []
    read_chunk = _devicepass._read_chunk

    def recording(get_bytes: Any, indices: list[int]) -> list[Any]:
        chunks.append(list(indices))
        return read_chunk(get_bytes, indices)

    monkeypatch.setattr(_devicepass, "_read_chunk", recording)
    tf = gpu.Compose([gpu.RandomResizedCrop(16), gpu.RandomHorizontalFlip()])

    def two_epochs(dataset: Any) -> tuple[list[Any], list[list[list[int]]]]:
        loader = DataLoader(
            dataset, batch_size=15, shuffle=True, seed=4, num_workers=1, decode="device",
            device="cpu", gpu_transforms=tf,
        )  # fmt: skip
        batches, tasks = [], []
        for epoch in range(2):
            chunks.clear()
            loader.set_epoch(epoch)
            batches.append(_collect(loader))
            tasks.append(list(chunks))
        loader.close()
        return batches, tasks

    files = _RecordingReads(imagenet_root / "train")
    expected, tasks = two_epochs(files)
    assert all(name.startswith("fastload-read") for name, _ in files.reads)
    for epoch in range(2):
        order = fastload.rng.epoch_permutation(len(files), 4, epoch).tolist()
        assert sorted(i for c in tasks[epoch] for i in c) == sorted(order)  # every sample read once
        for a in range(0, len(order), 15):
            batch = order[a : a + 15]
            runs = [c for c in tasks[epoch] if c[0] in batch]
            size = -(-len(batch) // _devicepass.READ_TASKS_PER_READER)
            assert [i for c in runs for i in c] == batch and [len(c) for c in runs[:-1]] == [size] * (
                len(runs) - 1
            )
            assert 1 < len(runs) <= _devicepass.READ_TASKS_PER_READER

    checked = InMemoryImageFolder(imagenet_root / "train")
    assert checked.check_crc
    got, tasks = two_epochs(checked)
    assert sorted(i for c in tasks[0] for i in c) == list(range(len(files)))  # checked by readers
    assert tasks[1] == []  # then slices, taken by the decoder thread
    unchecked = InMemoryImageFolder(imagenet_root / "train", check_crc=False)
    got_unchecked, tasks_unchecked = two_epochs(unchecked)
    assert tasks_unchecked == [[], []]
    patched = InMemoryImageFolder(imagenet_root / "train", check_crc=False)
    patched.get_bytes = patched.get_bytes  # type: ignore[method-assign]  # an instance's own
    got_patched, tasks_patched = two_epochs(patched)
    assert all(tasks_patched)
    for batches in (got, got_unchecked, got_patched):
        for epoch in range(2):
            assert len(batches[epoch]) == len(expected[epoch])
            for (x, y), (u, v) in zip(batches[epoch], expected[epoch], strict=True):
                assert torch.equal(x, u) and torch.equal(y, v)


def test_a_bad_hardware_decoder_share_is_an_error_when_the_loader_is_made(
    imagenet_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fastload import gpu

    monkeypatch.setenv("FASTLOAD_HW_DECODER_LOAD", "all")
    for decode in ("device", "hybrid"):
        with pytest.raises(ValueError, match="FASTLOAD_HW_DECODER_LOAD='all'"):
            DataLoader(ImageFolder(imagenet_root / "val"), decode=decode, gpu_transforms=gpu.Resize((8, 8)))
    DataLoader(ImageFolder(imagenet_root / "val"))  # decode="cpu" does not read it


def test_device_decode_read_error_is_raised_by_its_batch(imagenet_root: Path) -> None:
    from fastload import gpu

    files = _RecordingReads(imagenet_root / "train")
    order = fastload.rng.epoch_permutation(len(files), 4, 0).tolist()
    files.fail = order[9]  # batch 1 (of 7 samples each)
    loader = DataLoader(
        files,
        batch_size=7,
        shuffle=True,
        seed=4,
        num_workers=2,
        decode="device",
        device="cpu",
        gpu_transforms=gpu.Resize((8, 8)),
    )
    it = iter(loader)
    assert next(it)[1].shape == (7,)
    with pytest.raises(OSError, match=f"sample {order[9]} could not be read"):
        next(it)
    assert next(it)[1].shape == (7,)  # the pass goes on
    loader.close()


def test_a_device_or_gpu_transforms_that_cannot_work_is_refused_when_the_loader_is_made(
    imagenet_root: Path,
) -> None:
    ds = ImageFolder(imagenet_root / "val")
    with pytest.raises(TypeError, match=r"gpu_transforms should be a callable .* gpu_transforms='normalize'"):
        DataLoader(ds, batch_size=4, gpu_transforms="normalize")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"device='cuda' and CUDA is not available: pass device='cpu'"):
            DataLoader(ds, batch_size=4, device="cuda")
        with pytest.raises(ValueError, match="CUDA is not available"):
            DataLoader(ds, batch_size=4, device="cuda:0", decode="device", gpu_transforms=gpu.Resize((8, 8)))


def test_device_decoding_without_a_device_where_cuda_is_says_it_decodes_on_the_cpu(
    imagenet_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Never a silent slow path: decode='device' without device= decodes on the CPU; where CUDA is
    (here: said to be), the loader says so when it is made. Without CUDA that is the CPU's mode."""
    ds = ImageFolder(imagenet_root / "val")
    if not torch.cuda.is_available():
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            DataLoader(ds, decode="device", gpu_transforms=gpu.Resize((8, 8)), pin_memory=False)
    monkeypatch.setattr(fastload.loader, "cuda_available", lambda: True)
    with pytest.warns(UserWarning, match="it decodes on the CPU. Pass device='cuda'") as record:
        DataLoader(ds, decode="device", gpu_transforms=gpu.Resize((8, 8)), pin_memory=False)
    assert record[0].filename == __file__


def test_the_dataset_state_compared_each_pass() -> None:
    """Plans are made again when what fastload reads of the dataset changed (fastload._source):
    its samples by a copy of their content (changed in place: relabelled samples), its transform
    by its ops' public attributes (an op's size changed in place: progressive resizing); nothing
    else of the dataset is read."""
    from torchvision import transforms as T

    from fastload._source import changed_attributes, source_state

    class Plain(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __init__(self) -> None:
            self.size = (32, 32)
            self.samples = [(f"{i}.jpg", i % 3) for i in range(100_000)]
            self.transform = T.Compose([T.Resize(36), T.CenterCrop(32)])
            self._cache = {"private": 1}

    ds = Plain()
    before = source_state(ds)
    assert [name for name, _ in before[1]] == ["transform", "samples"]  # not size, not _cache
    ds.size = (16, 16)
    ds._cache["private"] = 2
    ds.samples = list(ds.samples)  # an equal new list: no change
    assert source_state(ds) == before
    ds.transform.transforms[1] = T.CenterCrop(32)  # an equal op (another object): a change
    assert source_state(ds) != before
    before = source_state(ds)
    for change in (
        lambda: ds.samples.__setitem__(5, ("5.jpg", 0)),  # relabelled (it was 2)
        lambda: setattr(ds.transform.transforms[0], "size", 24),
        lambda: ds.transform.transforms.append(T.RandomHorizontalFlip()),
    ):
        change()
        after = source_state(ds)
        assert after != before
        before = after
    assert changed_attributes(before, source_state(ds)) == []
    ds.samples[7] = ("7.jpg", 2)
    assert changed_attributes(before, source_state(ds)) == ["'samples'"]
