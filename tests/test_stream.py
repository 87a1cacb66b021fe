"""Batches built in place on torch's path (fastload._stream): default_collate's batches, one batch held.

Real worker processes over the synthetic JPEG tree; the unit tests call fetch/collate directly with
streaming on, as a worker has it.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torchvision
from torch.utils.data import default_collate
from torchvision import transforms as tv

import fastload
from fastload import _stream, _torchpath, _torchworkers


class _Identity:
    """An op fastload does not reproduce: the pipeline stays on torch's path."""

    def __call__(self, x: Any) -> Any:
        return x


@pytest.fixture(autouse=True)
def _unpinned_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ring carries batches torch's iterator does not copy into pinned memory: these tests
    run with ``pin_memory``'s default of a machine without CUDA (``False``) on a GPU machine too;
    ``test_no_ring_when_torchs_pin_memory_thread_copies_the_batches`` covers pinning."""
    import fastload._path

    monkeypatch.setattr(fastload._path, "cuda_available", lambda: False)


def _tv_pipeline() -> tv.Compose:
    return tv.Compose([tv.RandomResizedCrop(32), tv.RandomHorizontalFlip(), tv.PILToTensor(), _Identity()])


def _plain_collate(batch: list[Any]) -> Any:
    """torch's default_collate behind another function: the loader does not stream for it."""
    return default_collate(batch)


class _Recorded:
    """A worker_init_fn that writes whether streaming is on in that worker."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __call__(self, worker_id: int) -> None:
        (self.path / f"w{worker_id}").write_text(str(_stream.enabled()))


@pytest.mark.parametrize("kind", ["torchvision", "fastload"])
def test_streamed_batches_are_default_collates(imagenet_root: Path, tmp_path: Path, kind: str) -> None:
    """Same batches as with a collate_fn of the user's (which turns streaming off; here it calls
    default_collate), including the short last batch; one shared-memory tensor, as default_collate
    makes it."""
    root = imagenet_root / "train"
    make = torchvision.datasets.ImageFolder if kind == "torchvision" else fastload.ImageFolder
    dataset = make(root, transform=_tv_pipeline())
    runs = []
    for given in (None, _plain_collate):
        torch.manual_seed(3)
        loader = fastload.DataLoader(
            dataset,
            batch_size=5,  # 32 samples: 6 batches of 5 and one of 2
            shuffle=True,
            num_workers=2,
            collate_fn=given,
            worker_init_fn=_Recorded(tmp_path),
            multiprocessing_context="fork",
        )
        assert not loader.fast_path
        runs.append(list(loader))
        loader.close()
        flags = {p.read_text() for p in tmp_path.iterdir()}
        assert flags == {"True" if given is None else "False"}, flags  # streamed only without a collate_fn
    streamed, collated = runs
    assert len(streamed) == len(collated) == 7 and len(streamed[-1][1]) == 2
    for (images, labels), (ref_images, ref_labels) in zip(streamed, collated, strict=True):
        assert type(images) is torch.Tensor and images.dtype == torch.uint8
        assert images.shape[1:] == (3, 32, 32)
        assert torch.equal(images, ref_images) and torch.equal(labels, ref_labels)
        assert labels.dtype == torch.int64 and images.is_shared() == ref_images.is_shared()


@pytest.mark.parametrize("kind", ["torchvision", "fastload"])
def test_streamed_batches_are_torchs_own(imagenet_root: Path, kind: str) -> None:
    """The same case through torch.utils.data.DataLoader (a pipeline without random ops, in order):
    the same batches, types and sharing."""
    make = torchvision.datasets.ImageFolder if kind == "torchvision" else fastload.ImageFolder
    transform = tv.Compose([tv.Resize(20), tv.CenterCrop(16), tv.PILToTensor(), _Identity()])
    dataset = make(imagenet_root / "train", transform=transform)
    want = list(torch.utils.data.DataLoader(dataset, batch_size=5, num_workers=2))
    loader = fastload.DataLoader(dataset, batch_size=5, num_workers=2, multiprocessing_context="fork")
    got = list(loader)
    loader.close()
    assert len(got) == len(want) == 7
    for ours, theirs in zip(got, want, strict=True):
        assert type(ours) is type(theirs) and len(ours) == len(theirs) == 2
        for a, b in zip(ours, theirs, strict=True):
            assert type(a) is type(b) and a.dtype == b.dtype and a.stride() == b.stride()
            assert torch.equal(a, b) and a.is_shared() == b.is_shared()


class _Samples(torch.utils.data.Dataset):
    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Any:
        return self.items[i]


@pytest.fixture
def streaming(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_stream, "_ENABLED", True)


def test_fetch_writes_rows_of_one_batch_and_collate_returns_it(streaming: None) -> None:
    items = [(torch.full((2, 3), i, dtype=torch.float32), i, f"s{i}") for i in range(4)]
    samples = _stream.fetch(_Samples(items), [2, 0, 3])
    images = [s[0] for s in samples]
    assert len({t.untyped_storage().data_ptr() for t in images}) == 1  # rows of one tensor
    batch = _stream.collate(samples)
    ref = default_collate([items[2], items[0], items[3]])
    assert batch[0].data_ptr() == images[0].data_ptr()  # that tensor itself, not a new stack
    assert torch.equal(batch[0], ref[0]) and torch.equal(batch[1], ref[1]) and batch[2] == ref[2]
    assert type(batch) is type(ref)  # a list, as default_collate returns for tuples


def test_unequal_shapes_give_torchs_error(streaming: None) -> None:
    items = [(torch.zeros(3, 4, 4, dtype=torch.uint8), 0), (torch.zeros(3, 5, 4, dtype=torch.uint8), 1)]
    with pytest.raises(RuntimeError) as ours:
        _stream.collate(_stream.fetch(_Samples(items), [0, 1]))
    with pytest.raises(RuntimeError) as torchs:
        default_collate(items)
    assert str(ours.value) == str(torchs.value)


@pytest.mark.parametrize(
    "make",
    [
        lambda i: {"image": torch.full((2,), i)},  # a dict: not streamed
        lambda i: torch.full((2,), i, dtype=torch.float32, requires_grad=True),  # needs grad
        lambda i: (torch.full((2,), i).as_subclass(_Sub), i),  # a tensor subclass
        lambda i: (torch.full((2,), i) if i % 2 else torch.full((2,), i, dtype=torch.float64), i),  # dtype
        lambda i: (torch.full((2,), i), [i, i]),  # a list inside: collated as torch does
        lambda i: i,  # no tensor at all
    ],
    ids=["dict", "requires-grad", "subclass", "dtype-changes", "nested-list", "int"],
)
def test_anything_else_is_collated_as_torch_does(streaming: None, make: Any) -> None:
    items = [make(i) for i in range(4)]
    got = _stream.collate(_stream.fetch(_Samples(items), [0, 1, 2, 3]))
    ref = default_collate(items)
    assert type(got) is type(ref)
    flat_got, spec = torch.utils._pytree.tree_flatten(got)
    flat_ref, ref_spec = torch.utils._pytree.tree_flatten(ref)
    assert spec == ref_spec
    for a, b in zip(flat_got, flat_ref, strict=True):
        assert type(a) is type(b)
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


class _Sub(torch.Tensor):
    pass


def test_a_collate_fn_assigned_later_is_used(imagenet_root: Path, tmp_path: Path) -> None:
    """torch lets a loader's collate_fn be replaced after construction: it is the one that runs."""
    dataset = fastload.ImageFolder(imagenet_root / "val", transform=_tv_pipeline())
    loader = fastload.DataLoader(dataset, batch_size=4, num_workers=1, worker_init_fn=_Recorded(tmp_path))
    loader.collate_fn = _Tagged()
    batches = list(loader)
    loader.close()
    assert batches and all(b[0] == "tagged" for b in batches)
    assert (tmp_path / "w0").read_text() == "False"


class _Tagged:
    def __call__(self, batch: list[Any]) -> Any:
        return ("tagged", default_collate(batch))


def test_off_it_is_a_plain_list(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside fastload's torch-path workers (e.g. torch's own DataLoader): torch's fetch exactly."""
    monkeypatch.setattr(_stream, "_ENABLED", False)
    items = [(torch.full((2,), i), i) for i in range(3)]
    samples = _stream.fetch(_Samples(items), [1, 2])
    assert samples[0] is items[1] and samples[1] is items[2]


class _Recording:
    """A transform whose output is a tensor of ``mb`` MB; before each, it appends the worker's
    ``key`` (kB) from ``/proc/self/<source>`` to ``path``."""

    def __init__(self, path: Path, source: str, key: str, mb: int) -> None:
        self.path, self.source, self.key, self.mb = path, source, key, mb

    def __call__(self, image: Any) -> torch.Tensor:
        text = Path("/proc/self", self.source).read_text()
        value = next(line.split()[1] for line in text.splitlines() if line.startswith(self.key + ":"))
        with open(self.path, "a") as f:
            f.write(value + "\n")
        return torch.ones(self.mb * 2**20, dtype=torch.uint8)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_a_worker_holds_one_batch_not_two(imagenet_root: Path, tmp_path: Path) -> None:
    """The point of it: 32 samples of 8 MB make a 256 MB batch. Collated from a list, the worker holds
    the samples and their stack at once; streamed, the batch and one sample."""
    peaks = []
    for given in (_plain_collate, None):
        log = tmp_path / f"{given is None}.txt"
        peaks_of = _Recording(log, "status", "VmHWM", 8)  # the peak before each 8 MB sample
        dataset = fastload.ImageFolder(imagenet_root / "train", transform=peaks_of)
        loader = fastload.DataLoader(
            dataset,
            batch_size=32,
            num_workers=1,
            collate_fn=given,
            persistent_workers=True,  # one worker over both passes (a recording transform: not by default)
            # spawn: a forked worker starts with its parent's heap, whose free resident blocks it
            # reuses without a new peak (after other tests: 72 MB growth both ways, nothing measured)
            multiprocessing_context="spawn",
        )
        for _ in range(2):  # two passes: the second one's first sample sees the first pass's peak
            for batch in loader:
                del batch
        loader.close()
        kb = [int(v) for v in log.read_text().split()]
        peaks.append(max(kb) - kb[0])  # growth of the peak since the first sample
    collated, streamed = peaks
    # the samples' 256 MB no longer held next to their stack (measured: 200-228 MB less; the rest of a
    # worker's memory moves by some 20 MB from run to run)
    assert collated > 384 * 1024 and collated - streamed > 128 * 1024, (collated, streamed)


@pytest.mark.parametrize("kind", ["torchvision", "fastload"])
def test_without_batching_samples_are_converted_as_torch_does(imagenet_root: Path, kind: str) -> None:
    """batch_size=None: torch hands each sample to default_convert, not to a collate (a sample of an
    image and an int is no batch): the same samples as torch's DataLoader, in workers too."""
    make = torchvision.datasets.ImageFolder if kind == "torchvision" else fastload.ImageFolder
    dataset = make(imagenet_root / "val", transform=tv.Compose([tv.CenterCrop(16), tv.PILToTensor()]))
    want = list(torch.utils.data.DataLoader(dataset, batch_size=None))
    loader = fastload.DataLoader(dataset, batch_size=None, num_workers=1, multiprocessing_context="fork")
    got = list(loader)
    loader.close()
    assert len(got) == len(want)
    for (image, label), (ref_image, ref_label) in zip(got, want, strict=True):
        assert type(image) is torch.Tensor and torch.equal(image, ref_image)
        assert type(label) is type(ref_label) and label == ref_label


# ------------------------------------------------------------------ reused batch segments (the ring)


def _inode(t: torch.Tensor) -> int:
    return os.fstat(t.untyped_storage()._get_shared_fd()).st_ino  # type: ignore[attr-defined]


def _float_pipeline() -> tv.Compose:
    """Deterministic float samples of 110 KB: a batch of 10 is over RING_MIN_BYTES."""
    return tv.Compose([tv.Resize(100), tv.CenterCrop(96), tv.ToTensor(), _Identity()])


@pytest.fixture(scope="module")
def float_set(imagenet_root: Path) -> torchvision.datasets.ImageFolder:
    return torchvision.datasets.ImageFolder(imagenet_root / "train", transform=_float_pipeline())


@pytest.fixture(scope="module")
def float_want(float_set: torchvision.datasets.ImageFolder) -> list[list[torch.Tensor]]:
    return list(torch.utils.data.DataLoader(float_set, batch_size=10, num_workers=2))


def _same(got: list[Any], want: list[Any]) -> bool:
    return len(got) == len(want) and all(
        torch.equal(a, b) for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True)
    )


@pytest.fixture
def never_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forked workers do not drop their free segments when idle (a loaded machine can make them
    wait between passes), so which segments batches come in is exactly the ring's doing."""
    monkeypatch.setattr(_torchworkers, "IDLE_TRIM_SECONDS", None)


def test_the_usual_loop_reuses_batch_segments(
    float_set: torchvision.datasets.ImageFolder, float_want: list[Any], never_idle: None
) -> None:
    """32 samples in batches of 10: three full batches (1.1 MB each, in ring segments) and one of 2
    (too small for one). Every pass gives torch's batches, and the later passes send the full
    batches in the segments the first pass made (torch makes a new segment for every batch)."""
    assert float_want[0][0].nbytes >= _stream.RING_MIN_BYTES > float_want[-1][0].nbytes
    loader = fastload.DataLoader(
        float_set, batch_size=10, num_workers=2, multiprocessing_context="fork", persistent_workers=True
    )
    assert not loader.fast_path and loader.persistent_workers
    seen = []
    for _ in range(3):
        got = []
        for x, y in loader:
            got.append([x, y])
            seen.append(_inode(x))
        assert _same(got, float_want)
        del got, x, y
    loader.close()
    full = [ino for k, ino in enumerate(seen) if k % 4 != 3]
    assert len(set(full)) <= 4 < len(full), seen  # at most a segment or two per worker, reused
    assert len(set(seen[3::4])) == 3  # the short batch: a new segment each pass, as torch's


def test_no_reuse_without_reuse_buffers(float_set: torchvision.datasets.ImageFolder) -> None:
    loader = fastload.DataLoader(float_set, batch_size=10, num_workers=2, reuse_buffers=False)
    seen = [_inode(x) for _ in range(2) for x, _ in loader]
    loader.close()
    assert len(set(seen)) == len(seen) == 8


@pytest.mark.parametrize(("persistent", "method"), [(True, "fork"), (False, "fork"), (True, "spawn")])
def test_kept_batches_are_never_written_over(
    float_set: torchvision.datasets.ImageFolder, float_want: list[Any], persistent: bool, method: str
) -> None:
    """Batches the consumer keeps (whole, as a view, or as a numpy array) keep their values while
    the loader goes on: their segments are not reused until nothing refers to them."""
    loader = fastload.DataLoader(
        float_set, batch_size=10, num_workers=2, persistent_workers=persistent, multiprocessing_context=method
    )
    kept = list(loader)
    views = [x[1:3] for x, _ in loader]  # only a view of each batch is left of this pass
    arrays = [x.numpy() for x, _ in loader]
    expected_views = [w[0][1:3] for w in float_want]
    for _ in range(2):
        assert _same(list(loader), float_want)
    loader.close()
    assert _same(kept, float_want)
    assert all(torch.equal(v, e) for v, e in zip(views, expected_views, strict=True))
    assert all(np.array_equal(a, w[0].numpy()) for a, w in zip(arrays, float_want, strict=True))


def test_a_pass_left_early_gives_its_segments_back(
    float_set: torchvision.datasets.ImageFolder, float_want: list[Any], never_idle: None
) -> None:
    """With persistent workers, a pass left after one batch: torch drops the batches in flight as
    the next pass starts; their segments are reused afterwards, and the batches are torch's."""
    loader = fastload.DataLoader(
        float_set, batch_size=10, num_workers=2, multiprocessing_context="fork", persistent_workers=True
    )
    for _ in range(3):
        for _batch in loader:
            break
    del _batch
    first = iter(loader)
    next(first)
    second = iter(loader)  # a new pass while the old one's iterator is still there
    got = [next(second)]
    del first
    gc.collect()  # the old pass ends now: the live one's segments stay as they are
    got += list(second)
    assert _same(got, float_want)
    del got, second
    seen = []
    for _ in range(3):
        got = [[x, y] for x, y in loader]
        assert _same(got, float_want)
        seen += [_inode(b[0]) for b in got[:3]]
        del got
    ring = loader._torch_ring
    assert ring is not None
    ring.poll()  # (a pass frees what the consumer dropped at its next batch; here, now)
    rows = ring.rows
    made = set(rows[:, :, 0][rows[:, :, 0] > 0].tolist())
    assert set(seen) <= made  # all full batches came in ring segments
    assert (rows[:, :, 3] == rows[:, :, 1]).all()  # and every segment is free again
    loader.close()


def test_idle_workers_give_their_segments_back(
    float_set: torchvision.datasets.ImageFolder, float_want: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Persistent workers that wait for the next pass drop their free segments, and the main process
    has let go of its mappings of them at the end of the pass: their memory goes back to the system.
    The next pass makes new ones and gives torch's batches."""
    monkeypatch.setattr(_torchworkers, "IDLE_TRIM_SECONDS", 0.2)
    loader = fastload.DataLoader(
        float_set, batch_size=10, num_workers=2, multiprocessing_context="fork", persistent_workers=True
    )
    _one_pass(loader, float_want)
    ring = loader._torch_ring
    assert ring is not None and not ring.held  # let go at the end of the pass (no batch kept)
    made = set(ring.rows[:, :, 0].ravel()) - {0}
    assert len(made) >= 2
    deadline = time.monotonic() + 30
    while (ring.rows[:, :, 0] > 0).any() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not (ring.rows[:, :, 0] > 0).any()  # every worker dropped its segments
    _one_pass(loader, float_want)
    remade = set(ring.rows[:, :, 0].ravel()) - {0}
    assert len(remade) >= 2 and not remade & made
    loader.close()


def _one_pass(loader: Any, want: list[Any]) -> None:
    """A loop that keeps no batch when it ends."""
    n = 0
    for x, y in loader:
        assert torch.equal(x, want[n][0]) and torch.equal(y, want[n][1])
        n += 1
        del x, y
    assert n == len(want)


def test_main_frees_only_the_send_it_received() -> None:
    """The protocol: a segment is freed for its worker with the count of the send the main process
    received, once nothing there refers to it; a newer send it has not received keeps it busy."""
    table = _stream.ring_table(1, 2)
    main = _stream.MainRing(table)
    storage = torch.UntypedStorage._new_shared(_stream.RING_MIN_BYTES)
    rows = table[0].numpy()
    rows[1, 0] = _inode(torch.empty(0, dtype=torch.uint8).set_(storage))
    rows[1, 1] = 1  # the worker sent it once
    batch = torch.empty(0, dtype=torch.uint8).set_(storage)
    del storage
    main.received([batch, torch.zeros(3)])
    main.poll()
    assert rows[1, 3] == 0  # the batch is still referenced
    view = batch[5:9]
    del batch
    main.poll()
    assert rows[1, 3] == 0  # a view of it too
    del view
    rows[1, 1] = 2  # the worker sent it again (as if freed): the main process has not received that
    main.poll()
    assert rows[1, 3] == 1  # freed is the receipt's count: 1 != 2, so the worker keeps off it
    main.poll()
    assert rows[1, 3] == 1


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="reads /proc")
def test_a_busy_worker_writes_into_memory_the_main_process_maps(imagenet_root: Path, tmp_path: Path) -> None:
    """The point of the ring: while a worker builds a batch in a segment the main process has
    mapped (and read), those pages are shared, not the worker's private memory. Measured in the
    worker before the last sample of each batch (7 of 8 rows of 4 MB written) in the second half
    of a pass of 12 batches: with new segments (``reuse_buffers=False``, torch's way) they count
    as private, in the ring they do not."""
    apart = []
    for attempt in range(3):  # beside other processes the new segments' count varies: best of 3
        private = {}
        for reuse in (False, True):
            log = tmp_path / f"{attempt}-{reuse}.txt"
            private_of = _Recording(log, "smaps_rollup", "Private_Dirty", 4)  # before each 4 MB sample
            dataset = fastload.ImageFolder(imagenet_root / "train", transform=private_of)
            sampler = torch.utils.data.RandomSampler(dataset, replacement=True, num_samples=96)
            loader = fastload.DataLoader(
                dataset,
                batch_size=8,
                sampler=sampler,
                num_workers=1,
                reuse_buffers=reuse,
                multiprocessing_context="spawn",
            )
            for x, _y in loader:
                assert int(x[:, :4096].sum()) == 8 * 4096  # the consumer reads its batch (all of it:)
                x.sum()
            loader.close()
            kb = [int(v) for v in log.read_text().split()]
            assert len(kb) == 96
            private[reuse] = statistics.median(kb[k] for k in range(55, 96, 8))  # batches 7-12, 7 rows in
        apart.append(private[False] - private[True])
        # 28 MB of rows written: private with new segments, shared in the ring. Measured apart: 29 to
        # 55 MB alone; beside the rest of the suite (2 processes on 2 cores) once 19 MB, once 6 MB
        if apart[-1] > 12 * 1024:
            break
    assert max(apart) > 12 * 1024, apart


@pytest.mark.parametrize(
    "weakrefs",
    [pytest.param(True, marks=pytest.mark.skipif(not _stream._STORAGE_WEAKREFS, reason="torch 2.1")), False],
)
def test_a_batch_kept_past_the_end_of_a_pass_is_freed_when_dropped(
    weakrefs: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At the end of a pass the main process lets go of its mappings; the segment of a batch the
    consumer still holds (the loop variable) is freed for its worker once that batch is gone:
    watched through a weak reference to its storage, or with torch 2.1 (which crashes at exit on
    one) kept mapped and freed by the next pass's first poll."""
    monkeypatch.setattr(_stream, "_STORAGE_WEAKREFS", weakrefs)
    table = _stream.ring_table(1, 1)
    main = _stream.MainRing(table)
    storage = torch.UntypedStorage._new_shared(_stream.RING_MIN_BYTES)
    rows = table[0].numpy()
    batch = torch.empty(0, dtype=torch.uint8).set_(storage)
    rows[0, 0], rows[0, 1] = _inode(batch), 3
    del storage
    main.received((batch,))
    main.release()
    assert bool(main.held) is not weakrefs and rows[0, 3] == 0  # not freed: the batch is still here
    view = batch[:10]
    del batch
    main.poll()
    assert rows[0, 3] == 0
    del view
    if not weakrefs:
        assert rows[0, 3] == 0
        main.poll()  # the next pass's first batch
    assert rows[0, 3] == 3


@pytest.mark.parametrize("persistent", [True, False])
def test_the_loop_variable_keeps_the_last_batch_intact_through_the_next_pass(
    float_set: torchvision.datasets.ImageFolder, persistent: bool
) -> None:
    """The usual epoch loop: when the next pass starts, the loop variable still holds the last
    batch of the one before (in a ring segment: 16 samples, 1.8 MB). It must stay intact while
    the next pass (shuffled: other batches) runs; the passes' batches are those of a loader that
    reuses nothing."""
    assert 16 * float_set[0][0].nbytes >= _stream.RING_MIN_BYTES

    def passes(reuse: bool) -> list[list[list[torch.Tensor]]]:
        loader = fastload.DataLoader(
            float_set,
            batch_size=16,
            shuffle=True,
            seed=5,
            num_workers=2,
            persistent_workers=persistent,
            reuse_buffers=reuse,
        )
        previous = kept = None
        runs = []
        for _ in range(4):
            got = []
            for x, y in loader:
                got.append([x.clone(), y.clone()])
                if previous is not None:
                    assert torch.equal(previous, kept)  # the last pass's last batch, untouched
            runs.append(got)
            previous, kept = x, x.clone()  # the loop variable, as it is when the next pass starts
        loader.close()
        assert torch.equal(previous, kept)
        return runs

    reused, fresh = passes(True), passes(False)
    assert all(_same(a, b) for a, b in zip(reused, fresh, strict=True))
    assert not _same(reused[0], reused[1])  # shuffled: the passes differ


def test_no_ring_when_torchs_pin_memory_thread_copies_the_batches(
    float_set: torchvision.datasets.ImageFolder, float_want: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``pin_memory`` (the default with CUDA) torch's pin thread copies each batch into pinned
    memory and drops the worker's segment before the iterator hands the batch out, so the main
    process would never free a ring segment: each worker would fill its ring once and keep it busy
    (``prefetch_factor + 2`` batches of shared memory) for the whole pass. No ring then. No GPU
    here: torch's pin thread runs with an accelerator reported and a copying ``pin_memory``."""
    monkeypatch.setattr(_torchworkers, "IDLE_TRIM_SECONDS", None)
    if hasattr(torch, "accelerator"):  # torch 2.6 on: its pin thread asks torch.accelerator
        monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
        monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
        monkeypatch.setattr(torch.accelerator, "set_device_index", lambda index: None)
    else:  # and fastload's check of it (this file's fixture says False)
        monkeypatch.setattr(_torchpath, "cuda_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *args, **kwargs: self.clone())
    loader = fastload.DataLoader(
        float_set, batch_size=10, num_workers=1, pin_memory=True, multiprocessing_context="fork"
    )
    for _ in range(2):
        got = [[x, y] for x, y in loader]
        assert _same(got, float_want)
        assert not any(b[0].is_shared() for b in got)  # torch's pinned copies (here: clones)
    assert loader._torch_ring is None
    loader.close()


class _ExtraOfClass:
    """A target transform whose tensor has another size for class 3: a batch mixing it with the
    other classes fails in collate (torch's "stack expects each tensor to be equal size")."""

    def __call__(self, target: int) -> torch.Tensor:
        return torch.zeros(2 if target == 3 else 1)


def test_a_batch_whose_collate_raises_leaves_its_segment_free(imagenet_root: Path, never_idle: None) -> None:
    """The images of a batch are streamed into a ring segment, then collating the targets raises:
    the batch is never sent, so its segment must stay free for the next batch (it used to be
    counted as sent and stayed busy, and the worker's ring ran out after a few such batches)."""
    dataset = fastload.ImageFolder(
        imagenet_root / "train", transform=_float_pipeline(), target_transform=_ExtraOfClass()
    )
    bad, good = list(range(20, 30)), list(range(10))  # classes 2 and 3 / 0 and 1
    assert {dataset.targets[i] for i in bad} == {2, 3}
    loader = fastload.DataLoader(
        dataset,
        batch_sampler=[bad, good] * 8,
        num_workers=1,
        persistent_workers=False,
        multiprocessing_context="fork",
    )
    it = iter(loader)
    seen = []
    for k in range(16):
        if k % 2 == 0:
            with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
                next(it)
            continue
        x, _y = next(it)
        assert x.shape == (10, 3, 96, 96)
        seen.append(_inode(x))
        del x, _y
    assert len(set(seen)) <= 3, seen  # the good batches reuse the one or two segments they need


def test_a_new_batch_size_takes_the_place_of_free_segments_of_the_old(
    float_set: torchvision.datasets.ImageFolder, never_idle: None
) -> None:
    """Batches of 10, then of 12 (a batch_sampler of varying sizes, or a new resolution): once
    the ring is full of free segments of the old size, the new size takes their places instead
    of a new torch segment for every batch."""
    batches = [[k % 32 for k in range(10 * j, 10 * j + 10)] for j in range(8)]
    batches += [[k % 32 for k in range(12 * j, 12 * j + 12)] for j in range(10)]
    want = list(torch.utils.data.DataLoader(float_set, batch_sampler=batches))
    loader = fastload.DataLoader(
        float_set, batch_sampler=batches, num_workers=1, multiprocessing_context="fork"
    )
    got, seen = [], []
    for x, y in loader:
        got.append([x.clone(), y])
        seen.append((len(x), _inode(x)))
    loader.close()
    assert _same(got, want)
    later = {inode for n, inode in seen[10:] if n == 12}
    assert len(later) <= 4, seen  # the last 8 batches of 12 reuse the ring's 4 places


def _keeper(inbox: Any, outbox: Any) -> None:
    """Another process: keeps the batch it is sent (shared memory, as torch sends it), reports when
    it has it, and at the end whether it still holds the values it got."""
    batch = inbox.get()
    copy = batch.clone()
    outbox.put("got it")
    inbox.get()  # the loader has gone on meanwhile
    outbox.put(bool(torch.equal(batch, copy)))


@pytest.mark.parametrize("held_to_the_end", [False, True])
def test_a_batch_sent_on_to_another_process_is_never_written_over(
    float_set: torchvision.datasets.ImageFolder, held_to_the_end: bool
) -> None:
    """A batch put on a torch.multiprocessing queue shares its memory with the process that gets it
    (as with torch). Once this process drops it, its segment must not be reused: the other process
    still reads it. Dropped mid-pass (the usual poll), or held to the end of the pass (the
    finalizer); then more passes run."""
    # the other process starts from a fresh interpreter: forked from a test process that ran
    # earlier tests' workers, it could inherit a lock another thread held at the fork
    ctx = torch.multiprocessing.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    keeper = ctx.Process(target=_keeper, args=(inbox, outbox))
    keeper.start()
    loader = fastload.DataLoader(float_set, batch_size=10, shuffle=True, num_workers=2)
    try:
        it = iter(loader)
        sent, _ = next(it)
        inbox.put(sent)
        assert outbox.get(timeout=60) == "got it"
        if not held_to_the_end:
            del sent
        for _ in it:
            pass
        del _
        if held_to_the_end:
            del sent
        for _ in range(4):  # the segments go round several times
            for _batch in loader:
                pass
        inbox.put("check")
        assert outbox.get(timeout=60) is True
    finally:
        loader.close()
        keeper.join(timeout=30)


# ------------------------------------------------------------------ a user's collate_fn (RingedCollate)


class _Scaled:
    """A collate_fn around default_collate, shaped like torchvision's reference
    ``mixup_cutmix(*default_collate(batch))``: new tensors out (images scaled, labels one-hot)."""

    def __init__(self, view: bool = False) -> None:
        self.view = view

    def __call__(self, batch: list[Any]) -> Any:
        images, labels = default_collate(batch)
        out = images * 0.5
        if self.view:  # a view of a larger storage: torch sends the whole storage, so is it left alone
            out = torch.cat([out, out])[: len(batch)]
        return out, torch.nn.functional.one_hot(labels, 4).float()


@pytest.mark.parametrize("view", [False, True])
def test_a_user_collate_sends_its_batches_in_reused_segments(
    float_set: torchvision.datasets.ImageFolder, never_idle: None, view: bool
) -> None:
    """The user's collate_fn runs as written (default_collate inside it, then its own tensors): the
    batches are torch's, and its large output tensor travels in the worker's reused segments
    (torch puts every batch in a new one); a view of a larger storage is sent as torch sends it."""
    collate = _Scaled(view)
    want = list(torch.utils.data.DataLoader(float_set, batch_size=10, num_workers=2, collate_fn=collate))
    loader = fastload.DataLoader(  # workers kept over the passes (a collate object: not by default)
        float_set,
        batch_size=10,
        num_workers=2,
        collate_fn=collate,
        multiprocessing_context="fork",
        persistent_workers=True,
    )
    assert loader.path == "head-accelerated"
    seen = []
    for _ in range(3):
        got = []
        for batch in loader:
            got.append(batch)
            seen.append(_inode(batch[0]))
        assert len(got) == len(want) == 4
        for ours, theirs in zip(got, want, strict=True):
            assert type(ours) is type(theirs)
            for a, b in zip(ours, theirs, strict=True):
                assert type(a) is type(b) and a.dtype == b.dtype and a.stride() == b.stride()
                assert torch.equal(a, b) and a.is_shared() and b.is_shared()
        del got, batch
    loader.close()
    full = [ino for k, ino in enumerate(seen) if k % 4 != 3]
    if view:
        assert len(set(full)) == len(full)  # torch's way: a new segment each batch
    else:
        assert len(set(full)) <= 4 < len(full), seen  # at most a segment or two per worker, reused


def test_ringed_collate_outside_a_worker_only_calls_the_function() -> None:
    collate = _stream.RingedCollate(_Scaled())
    batch = [(torch.full((3, 8, 8), float(i)), i % 4) for i in range(4)]
    images, labels = collate(batch)
    want_images, want_labels = _Scaled()(batch)
    assert torch.equal(images, want_images) and torch.equal(labels, want_labels)
    assert "_Scaled" in repr(collate)
