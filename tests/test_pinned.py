"""Every host batch bound for the device is in pinned memory, on every path (a CPU test: the
stand-ins of ``tests/_fakecuda.py`` record each copy's source and fail on a pageable one)."""

from __future__ import annotations

import gc
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from _fakecuda import FakeHost, fake_cuda

import fastload
from fastload import gpu
from fastload import transforms as T
from fastload.batch import IndexedBatch


def _train(root: Path) -> fastload.ImageFolder:
    return fastload.ImageFolder(root / "train", transform=T.Compose([T.RandomResizedCrop(16)]))


def _run(loader: Any, keep: bool = False) -> list[Any]:
    """Two passes; ``keep``: every batch of the first kept alive (the loader then needs extra slots)."""
    kept = []
    with warnings.catch_warnings():
        # no "pageable memory" warning (Python >= 3.12's DeprecationWarning about fork() in a
        # process with threads -- CUDA's, the page lock's -- is not what this checks)
        warnings.filterwarnings("error", category=UserWarning)
        for epoch in range(2):
            for images, labels in loader:
                assert images.dtype == torch.uint8 and labels.dtype == torch.int64
                if keep and epoch == 0:
                    kept.append((images, labels))
    return kept


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_workers": 2},
        {"num_workers": 2, "reuse_buffers": False},
        {"num_workers": 2, "worker_type": "thread"},
        {"num_workers": 0},
    ],
    ids=["process", "process-copies", "thread", "inline"],
)
@pytest.mark.parametrize("keep", [False, True], ids=["consume", "keep"])
def test_fast_path_copies_only_pinned_memory(imagenet_root: Path, kwargs: dict[str, Any], keep: bool) -> None:
    with fake_cuda() as (streams, host):
        loader = fastload.DataLoader(
            _train(imagenet_root), batch_size=5, device="cpu", pin_memory=True, shuffle=True, seed=0, **kwargs
        )
        assert loader.path == "fast"
        _run(loader, keep)
        loader.close()
    # 8 batches a pass (32 images), each copied as images, labels, indices
    assert len(streams.copies) == 2 * 7 * 3 and streams.pageable() == []
    if kwargs.get("worker_type", "process") == "process" and kwargs["num_workers"]:
        # the labels, then each slot of the ring on its own pages, locked in place ...
        assert len(host.registered) >= 3 and all(ptr % 4096 == 0 for ptr in host.registered[1:])
        assert sorted(host.unregistered) == sorted(host.registered)  # ... and unlocked by close()


def test_extra_slots_of_kept_batches_are_pinned_copies(imagenet_root: Path) -> None:
    """A consumer that keeps every batch makes the loader decode into extra buffers (not locked:
    locking costs more than copying); those batches come out as pinned copies, the others in place."""
    with fake_cuda() as (streams, host):
        loader = fastload.DataLoader(
            _train(imagenet_root), batch_size=4, num_workers=1, pin_memory=True, prefetch_factor=1
        )
        batches = list(loader)  # kept: the ring (3 slots) cannot hold them all
        assert len(batches) == 8 and all(host.is_pinned(x) and host.is_pinned(y) for x, y in batches)
        assert host.copies >= 8 - 3  # extra slots: pinned copies (images, labels, indices)
        loader.close()


def test_a_ring_that_cannot_be_locked_warns_once_and_copies_into_pinned_memory(imagenet_root: Path) -> None:
    with fake_cuda(register_ok=False) as (streams, host):
        loader = fastload.DataLoader(
            _train(imagenet_root), batch_size=5, device="cpu", pin_memory=True, num_workers=2
        )
        with pytest.warns(UserWarning, match="could not page-lock its batch buffers") as record:
            for _ in range(2):
                list(loader)
        assert len([w for w in record if "page-lock" in str(w.message)]) == 1
        assert not [w for w in record if "pageable" in str(w.message)]
        loader.close()
    assert streams.copies and streams.pageable() == []


def test_without_pin_memory_the_prefetcher_says_the_copies_are_synchronous(imagenet_root: Path) -> None:
    """The control: a pageable batch is seen, and named once."""
    with fake_cuda() as (streams, _):
        loader = fastload.DataLoader(
            _train(imagenet_root), batch_size=5, device="cpu", pin_memory=False, num_workers=0
        )
        with pytest.warns(UserWarning, match="pageable memory: the host-to-device copy is synchronous"):
            list(loader)
    assert len(streams.pageable()) == len(streams.copies) > 0


def test_device_loaders_pin_by_default_where_cuda_is(
    monkeypatch: pytest.MonkeyPatch, imagenet_root: Path
) -> None:
    import fastload._path

    monkeypatch.setattr(fastload._path, "cuda_available", lambda: True)
    assert fastload.DataLoader(_train(imagenet_root), batch_size=4, num_workers=0).pin_memory is True
    monkeypatch.setattr(fastload._path, "cuda_available", lambda: False)
    assert fastload.DataLoader(_train(imagenet_root), batch_size=4, num_workers=0).pin_memory is False


def _torch_pin_calls_a_sequences_own_pin_memory() -> bool:
    """Whether torch's ``pin_memory`` asks a list subclass to pin itself (torch 2.1 rebuilds it
    as ``type(batch)(items)``, which drops what the items do not carry: an IndexedBatch's indices)."""
    from torch.utils.data._utils.pin_memory import pin_memory as torch_pin

    class Probe(list[int]):
        def pin_memory(self, *args: Any) -> str:
            return "own"

    return bool(torch_pin(Probe([1, 2])) == "own")


OWN_PIN = pytest.mark.skipif(
    not _torch_pin_calls_a_sequences_own_pin_memory(),
    reason=f"torch {torch.__version__}'s pin_memory rebuilds a list subclass from its items (drops indices)",
)


@OWN_PIN
def test_indexed_batch_pins_all_it_carries(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's pin-memory thread calls ``IndexedBatch.pin_memory()`` (a collate_fn's batches on
    torch's path): the indices, which the prefetcher moves too, are pinned with the rest."""
    from torch.utils.data._utils.pin_memory import pin_memory as torch_pin

    host = FakeHost()
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t, *a, **k: host.pin(t))
    batch = IndexedBatch(
        torch.zeros(2, 3, 4, 4, dtype=torch.uint8), torch.tensor([1, 2]), torch.tensor([7, 9])
    )
    pinned = torch_pin(batch)  # what torch's pin-memory thread does with it
    assert isinstance(pinned, IndexedBatch) and pinned.indices.tolist() == [7, 9]
    assert all(host.is_pinned(t) for t in (pinned[0], pinned[1], pinned.indices))
    assert not host.is_pinned(batch.indices)


@OWN_PIN
def test_prefetcher_over_a_pinned_loader_copies_nothing_pageable(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's loader with ``pin_memory=True`` and a collate_fn yielding IndexedBatch (pinned by
    torch's iterator), through CUDAPrefetcher."""
    with fake_cuda() as (streams, host):
        monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t, *a, **k: host.pin(t))
        batches = [
            IndexedBatch(
                torch.zeros(2, 3, 4, 4, dtype=torch.uint8), torch.tensor([k, k]), torch.tensor([k, k + 1])
            )
            for k in range(3)
        ]
        from torch.utils.data._utils.pin_memory import pin_memory as torch_pin

        p = fastload.CUDAPrefetcher(
            [torch_pin(b) for b in batches], device="cpu", transforms=gpu.Normalize([0.5], [0.5])
        )
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert len(list(p)) == 3
    assert len(streams.copies) == 9 and streams.pageable() == []


def test_the_page_lock_is_undone_when_a_loader_is_dropped(imagenet_root: Path) -> None:
    with fake_cuda() as (_, host):
        loader = fastload.DataLoader(_train(imagenet_root), batch_size=4, pin_memory=True, num_workers=1)
        next(iter(loader))
        del loader
        gc.collect()
        assert len(host.registered) >= 3 and sorted(host.unregistered) == sorted(host.registered)


# ------------------------------------------------------------------------------ on a GPU


class _Identity:
    """An op fastload does not reproduce: the pipeline stays on torch's iterator."""

    def __call__(self, x: Any) -> Any:
        return x


class _Square32:
    """A transform that is no torchvision pipeline at all: torch's iterator, no head acceleration."""

    def __call__(self, image: Any) -> torch.Tensor:
        from torchvision.transforms.functional import pil_to_tensor

        return pil_to_tensor(image.convert("RGB").resize((32, 32)))


def _gpu_loader(root: Path, path: str) -> fastload.DataLoader[Any]:
    import torchvision
    from torchvision import transforms as tv

    normalize = gpu.Normalize([0.5] * 3, [0.25] * 3)
    common: dict[str, Any] = {"batch_size": 6, "device": "cuda", "shuffle": True, "seed": 0}
    if path in ("fast", "fast-copies", "thread", "inline"):
        kwargs: dict[str, Any] = {
            "fast": {"num_workers": 2},
            "fast-copies": {"num_workers": 2, "reuse_buffers": False},
            "thread": {"num_workers": 2, "worker_type": "thread"},
            "inline": {"num_workers": 0},
        }[path]
        return fastload.DataLoader(_train(root), gpu_transforms=normalize, **common, **kwargs)
    if path in ("device-decode", "hybrid"):
        ds = fastload.InMemoryImageFolder(root / "train")
        pipeline = gpu.Compose([gpu.RandomResizedCrop(16), normalize])
        decode = "device" if path == "device-decode" else "hybrid"
        return fastload.DataLoader(ds, decode=decode, gpu_transforms=pipeline, num_workers=2, **common)
    if path == "head":
        tf: Any = tv.Compose([tv.RandomResizedCrop(16), tv.PILToTensor(), _Identity()])
    else:
        tf = _Square32()
    ds = torchvision.datasets.ImageFolder(str(root / "train"), transform=tf)
    return fastload.DataLoader(ds, num_workers=2, **common)


@pytest.mark.cuda
@pytest.mark.parametrize(
    "path", ["fast", "fast-copies", "thread", "inline", "head", "torch", "device-decode", "hybrid"]
)
def test_no_pageable_copy_on_a_gpu(imagenet_root: Path, path: str) -> None:  # pragma: no cover - needs CUDA
    """With CUDA, every path's batches reach the GPU from pinned memory (default ``pin_memory``):
    the prefetcher's pageable-memory warning would fail this test."""
    loader = _gpu_loader(imagenet_root, path)
    assert loader.path == {
        "head": "head-accelerated",
        "torch": "torch",
        "device-decode": "device-decode",
        "hybrid": "hybrid",
    }.get(path, "fast")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*pageable memory.*")
        warnings.filterwarnings("error", message=".*could not page-lock.*")
        for _ in range(2):
            for images, labels in loader:
                assert images.device.type == "cuda" and labels.device.type == "cuda"
    loader.close()


@pytest.mark.parametrize("workers", [1, 0])
def test_a_buffer_is_not_rewritten_while_a_copy_out_of_it_may_be_queued(
    imagenet_root: Path, workers: int
) -> None:
    """The one-line swap's loop moves each batch itself (``images.cuda(non_blocking=True)``): the
    copy is queued on the device and the batch dropped at once. The pinned buffer it came from is
    not decoded into again until the copies queued before it was given back are done (here: the
    stand-in holds them until the loader has nothing else to wait for and waits for them)."""
    import ctypes

    with fake_cuda(hold_fences=True) as (_, host):
        loader = fastload.DataLoader(
            _train(imagenet_root), batch_size=2, num_workers=workers, pin_memory=True
        )
        it = iter(loader)
        images, _ = next(it)
        ptr, size = images.data_ptr(), images.numel()
        queued = ctypes.string_at(ptr, size)  # what the queued copy will read
        del images  # the loop drops the batch after queueing its copy
        for _ in range(len(loader) - 1):
            next(it)
            if host.released_to == 0:  # fence 1 (the first buffer's) not done: its bytes unchanged
                assert ctypes.string_at(ptr, size) == queued
        assert host.fences_made >= len(loader) - 1  # every given-back buffer was fenced
        assert host.waited  # with every free buffer fenced and nothing decoding, it waited
        loader.close()


def test_the_ring_is_locked_slot_by_slot() -> None:
    """The ring is locked slot by slot in the background (16 s for 4.6 GB of float32 slots,
    measured): each slot can be asked whether it is locked yet, without waiting, and a slot that
    cannot be locked makes it and the later ones pinned copies."""
    import threading

    from fastload._shm import shared_slots
    from fastload.gpu.memory import PageLock

    gate = threading.Event()

    class SlowHost(FakeHost):
        def register(self, t: torch.Tensor) -> bool:
            if len(self.registered) >= 2:
                gate.wait(10)  # the third slot takes long
            return super().register(t) if len(self.registered) < 4 else False

    slots = shared_slots(6, (5, 32, 32, 3), torch.uint8)
    assert slots.stride(0) == 16384 and not slots.is_contiguous() and slots[1].is_contiguous()
    host = SlowHost()
    lock = PageLock(list(slots.unbind(0)), host)
    assert lock.wait(0) and lock.wait(1)  # while slot 2 is still being locked
    assert len(host.registered) == 2 and lock.ready(1) is True and lock.ready(2) is None
    gate.set()
    assert lock.wait(3) and not lock.wait(4) and not lock.wait(5)  # the fifth could not be locked
    assert lock.ready(3) is True and lock.ready(4) is False
    lock.release()
    assert sorted(host.unregistered) == sorted(host.registered) and len(host.registered) == 4


@pytest.mark.cuda
def test_cuda_pin_is_always_a_new_copy() -> None:  # pragma: no cover - needs CUDA
    """``Tensor.pin_memory()`` returns a pinned tensor itself: for a view of a page-locked batch
    buffer that is a "copy" the workers overwrite once the buffer is reused (seen on a GPU machine:
    reuse_buffers=False batches changed after they were handed out)."""
    from fastload.gpu.memory import host_memory

    host = host_memory()
    ring = torch.arange(2 * 4 * 6 * 3, dtype=torch.uint8).reshape(2, 4, 6, 3).pin_memory()
    view = ring[0].permute(2, 0, 1)  # a slot's batch as the loader hands it out
    copy = host.pin(view)
    assert host.is_pinned(copy) and copy.data_ptr() != view.data_ptr()
    assert torch.equal(copy, view) and copy.stride() == view.stride()
    ring.zero_()
    assert not torch.equal(copy, view)  # the copy kept the batch


def test_batches_are_pinned_copies_while_their_slot_is_still_being_locked(imagenet_root: Path) -> None:
    """The consumer never waits for a slot's lock: until it holds, the batch is a pinned copy."""
    import threading

    from _fakecuda import CopyRecorder

    from fastload.gpu.streams import simulate_cuda

    gate = threading.Event()

    class SlowHost(FakeHost):
        def register(self, t: torch.Tensor) -> bool:
            if self.registered:  # the labels are locked at once, the slots only once the gate opens
                gate.wait(60)
            return super().register(t)

    host = SlowHost()
    streams = CopyRecorder(host)
    with simulate_cuda(streams, host):
        loader = fastload.DataLoader(
            _train(imagenet_root), batch_size=5, device="cpu", pin_memory=True, num_workers=2, shuffle=True
        )
        _run(loader)  # two passes, without waiting for the locks
        assert host.copies == 2 * 7 * 3  # images, labels and indices of every batch: pinned copies
        gate.set()
        pool = loader._engine.pool
        assert pool is not None and pool.page_lock is not None and pool.page_lock.wait()
        _run(loader)
        assert host.copies == 2 * 7 * 3 + 2 * 7  # now only the indices: the batches come in place
        loader.close()
    assert streams.pageable() == []


def test_a_lock_that_raises_or_is_released_early_never_hangs() -> None:
    """An error while locking ends the locking (waiters and the release return); a release while
    the ring is still being locked cancels the locks not made yet instead of waiting for them."""
    import threading
    import time

    from fastload._shm import shared_slots
    from fastload.gpu.memory import PageLock

    class Raising(FakeHost):
        def register(self, t: torch.Tensor) -> bool:
            if len(self.registered) == 2:
                raise OSError("the driver said no")
            return super().register(t)

    slots = list(shared_slots(5, (4, 8, 8, 3), torch.uint8).unbind(0))
    host = Raising()
    lock = PageLock(slots, host)
    assert lock.wait(1) and not lock.wait(2) and not lock.wait()
    lock.release()
    assert sorted(host.unregistered) == sorted(host.registered) and len(host.registered) == 2

    class Slow(FakeHost):
        def register(self, t: torch.Tensor) -> bool:
            time.sleep(0.3)
            return super().register(t)

    slow = Slow()
    many = list(shared_slots(20, (4, 8, 8, 3), torch.uint8).unbind(0))
    lock = PageLock(many, slow)
    assert lock.wait(0)
    t0 = time.perf_counter()
    lock.release()  # 20 locks would take 6 s
    assert time.perf_counter() - t0 < 2 and len(slow.registered) < 6
    assert sorted(slow.unregistered) == sorted(slow.registered)
    assert not [t for t in threading.enumerate() if t.name == "fastload-pagelock" and t.is_alive()]


def test_a_slot_fence_marks_every_device_in_use_not_only_the_current_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The loop copies a batch to the device it chose -- DDP written as ``images.to(rank)``, with
    no ``set_device``, copies to cuda:1 while the current device stays 0 --, so a slot's fence is
    recorded on the current stream of each device this process has a context on (asked without
    making one), and the slot is free only when all are done. (torch.cuda's calls stood in for.)"""
    from fastload.gpu import memory

    recorded: list[tuple[str, bool]] = []

    class Event:
        def __init__(self, blocking: bool = False) -> None:
            self.blocking, self.finished, self.stream = blocking, False, ""

        def record(self, stream: str) -> None:
            self.stream = stream
            recorded.append((stream, self.blocking))

        def query(self) -> bool:
            return self.finished

        def synchronize(self) -> None:
            self.finished = True

    contexts = {0: True, 1: True, 2: False, 3: True}
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: f"current stream of cuda:{device}")
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch._C, "_cuda_hasPrimaryContext", lambda d: contexts[d], raising=False)
    host = memory._CudaHost()
    fence = host.fence()
    assert recorded == [(f"current stream of cuda:{d}", True) for d in (0, 1, 3)]  # blocking: no spinning
    assert not host.done(fence)
    fence[0].finished = fence[2].finished = True
    assert not host.done(fence)  # cuda:1's copy may still read the slot
    fence[1].finished = True
    assert host.done(fence)
    host.wait(host.fence())  # waits on each
    monkeypatch.setattr(torch._C, "_cuda_hasPrimaryContext", lambda d: False, raising=False)
    assert memory.devices_in_use() == [0]  # none known: the current device
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert host.fence() is None and host.done(None)


def test_the_ring_is_page_locked_on_the_loaders_device(
    imagenet_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The thread page-locking the workers' ring runs on the loader's CUDA device where the loader
    names one (``device="cuda:1"``), else on the current device as torch's pin thread: it would
    otherwise make a context on GPU 0 in every rank."""
    from fastload import _engine, _pool

    devices: list[int | None] = []

    class RecordingLock:
        def __init__(self, tensors: list[torch.Tensor], host: Any, device: int | None) -> None:
            devices.append(device)

        def wait(self, index: int | None = None) -> bool:
            return False

        def ready(self, index: int) -> bool | None:
            return False

        def release(self) -> None:
            pass

    assert _engine._cuda_index(torch.device("cuda", 1)) == 1
    assert _engine._cuda_index(torch.device("cuda")) is None and _engine._cuda_index(None) is None
    assert _engine._cuda_index(torch.device("cpu")) is None
    monkeypatch.setattr(_pool, "PageLock", RecordingLock)
    monkeypatch.setattr(_pool, "current_cuda_device", lambda: 0)
    for named in (None, 1):
        monkeypatch.setattr(_engine, "_cuda_index", lambda device, named=named: named)
        with fake_cuda(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", "fastload could not page-lock")
            loader = fastload.DataLoader(
                _train(imagenet_root), batch_size=5, device="cpu", pin_memory=True, num_workers=2
            )
            assert len(list(loader)) == len(loader)
            loader.close()
    assert devices == [0, 1]
