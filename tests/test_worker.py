"""Process workers and the parent's heap: ``gc.freeze()`` around forking them (fastload._workerstart),
only where the workers run no code of the user's.

A forked worker shares the parent's memory pages until it writes to them. CPython's cyclic
garbage collector writes into the header of every object it examines, so a collection in a
worker copies every page of the parent's heap it walks. fastload freezes the parent's heap for
the collector while it forks (on its own path and on torch's), and unfreezes it right after.
"""

from __future__ import annotations

import gc
import multiprocessing
import multiprocessing.context
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

import fastload
import fastload._stream
import fastload._torchworkers
import fastload._workerstart
from fastload import transforms as T

if not hasattr(os, "fork"):  # pragma: no cover - the whole module is about fork
    pytest.skip("needs fork", allow_module_level=True)


def _private_dirty() -> int:
    """Bytes only this process has written (``Private_Dirty`` of ``/proc/self/smaps_rollup``)."""
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Private_Dirty:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no Private_Dirty in /proc/self/smaps_rollup")


def _collect_cost() -> tuple[int, int]:
    """In a worker: (objects frozen, bytes of private memory one full collection wrote)."""
    before = _private_dirty()
    gc.collect()
    return gc.get_freeze_count(), _private_dirty() - before


class _CollectInWorker(Dataset[Any]):
    """A user dataset (torch's path): each sample runs a full collection in the worker and says
    how many objects it found frozen and how much private memory the collection wrote."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> torch.Tensor:
        frozen, grown = _collect_cost()
        return torch.tensor([frozen, grown])


def _fast_dataset(root: Path) -> fastload.ImageFolder:
    return fastload.ImageFolder(root, transform=T.Compose([T.RandomResizedCrop(16)]))


def _seed_nothing(worker_id: int) -> None:
    """A worker_init_fn of the user's that does nothing."""


def _report_collect_cost(worker_id: int) -> None:
    """worker_init_fn of the fast path: the same report, written to a file named by the env."""
    frozen, grown = _collect_cost()
    Path(os.environ["FASTLOAD_TEST_REPORT"], f"{worker_id}.txt").write_text(f"{frozen} {grown}")


@pytest.fixture(autouse=True)
def _heap_not_frozen_by_others() -> None:
    """These tests start from a program that has not frozen its heap. Something else in the test
    process may have left objects frozen (seen on a GPU machine: 375 objects, in two of 14
    pytest-xdist processes, before these tests ran), which would make the loader leave the heap
    alone (the program's own freeze is respected, see the test below): start from none."""
    if gc.get_freeze_count() > 0:
        gc.unfreeze()


@pytest.fixture
def big_heap() -> Any:
    """400,000 small objects the collector tracks (about 40 MB of pages), alive in the parent."""
    heap = [[i] for i in range(400_000)]
    yield heap
    del heap


def _unfrozen() -> None:
    """Start from a heap nothing froze (see the fixture above); on a GPU machine a few hundred
    objects were seen frozen again between the fixture and the test body."""
    while gc.get_freeze_count() > 0:
        gc.unfreeze()


def test_torch_path_workers_running_the_users_code_inherit_the_heap_as_torchs(big_heap: Any) -> None:
    """A dataset of the user's: no gc.freeze around the fork (torch's defaults wherever fastload runs
    the user's code), so the worker's first collection copies the inherited pages, as torch's does."""
    _unfrozen()
    loader = fastload.DataLoader(
        _CollectInWorker(), batch_size=None, num_workers=1, multiprocessing_context="fork"
    )
    assert not loader.fast_path
    ours = [tuple(x.tolist()) for x in loader]
    assert gc.get_freeze_count() < len(big_heap)  # unfrozen in the parent once the worker started
    theirs = [
        tuple(x.tolist())
        for x in torch.utils.data.DataLoader(
            _CollectInWorker(), batch_size=None, num_workers=1, multiprocessing_context="fork"
        )
    ]
    # both workers inherit an unfrozen heap: the first collection copies the pages of the 400,000
    # lists (>= 20 MB). (Not "0 frozen": on a GPU machine's Python 3.12 a few hundred objects were
    # seen frozen there, by something other than fastload.)
    assert theirs[0][0] < len(big_heap) and theirs[0][1] > 20 * 2**20, theirs
    assert ours[0][0] < len(big_heap) and ours[0][1] > 20 * 2**20, ours
    loader.close()


def test_fast_path_workers_running_a_worker_init_fn_inherit_the_heap_as_torchs(
    imagenet_root: Path, big_heap: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker_init_fn is code of yours: no gc.freeze around the fork (torch's defaults), so the
    worker's first collection copies the inherited pages, as torch's workers' does. Without code of
    yours the fast path does freeze (the control of the next test)."""
    monkeypatch.setenv("FASTLOAD_TEST_REPORT", str(tmp_path))
    loader = fastload.DataLoader(
        _fast_dataset(imagenet_root / "val"),
        batch_size=4,
        num_workers=2,
        multiprocessing_context="fork",
        worker_init_fn=_report_collect_cost,
    )
    assert loader.fast_path
    _unfrozen()
    assert len(list(loader)) == 3
    assert gc.get_freeze_count() < len(big_heap)  # unfrozen in the parent once the workers started
    loader.close()
    for wid in range(2):
        frozen, grown = map(int, (tmp_path / f"{wid}.txt").read_text().split())
        assert frozen < len(big_heap) and grown > 20 * 2**20, (wid, frozen, grown)


def test_spawned_and_thread_workers_freeze_nothing(
    imagenet_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only a fork inherits the heap: no freeze (and so no effect on the parent) otherwise."""
    calls: list[str] = []
    freeze = gc.freeze

    def counting_freeze() -> None:
        calls.append("freeze")
        freeze()

    monkeypatch.setattr(gc, "freeze", counting_freeze)
    for kind, context in (("thread", None), ("process", "spawn")):
        loader = fastload.DataLoader(
            _fast_dataset(imagenet_root / "val"),
            batch_size=4,
            num_workers=1,
            worker_type=kind,
            multiprocessing_context=context,
        )
        assert len(list(loader)) == 3
        loader.close()
    assert calls == []
    loader = fastload.DataLoader(
        _fast_dataset(imagenet_root / "val"), batch_size=4, num_workers=1, multiprocessing_context="fork"
    )
    assert len(list(loader)) == 3
    loader.close()
    assert calls == ["freeze"]  # the control: a fork does freeze
    assert gc.get_freeze_count() <= fastload._workerstart.FROZEN_AT_IMPORT
    loader = fastload.DataLoader(  # code of yours in the workers: torch's defaults, no freeze
        _fast_dataset(imagenet_root / "val"),
        batch_size=4,
        num_workers=1,
        multiprocessing_context="fork",
        worker_init_fn=_seed_nothing,
    )
    assert len(list(loader)) == 3
    loader.close()
    assert calls == ["freeze"]


def _freeze_run(before_import: str, limit: str = "") -> list[str]:
    """In a fresh process: ``before_import`` runs, then fastload._workerstart is imported (``limit``:
    ENVIRONMENT_FROZEN_LIMIT set after it) and a heap of 200,000 lists built; prints the frozen
    count at the import, during a fork's frozen_heap, and after it."""
    import subprocess
    import sys

    script = f"""
import gc
{before_import}
import fastload._workerstart as w
{limit}
at_import = gc.get_freeze_count()
heap = [[i] for i in range(200_000)]
with w.frozen_heap("fork"):
    during = gc.get_freeze_count()
print(at_import, during, gc.get_freeze_count())
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120
    )
    return out.stdout.split()


def test_objects_the_environment_froze_before_fastload_do_not_turn_the_freeze_off() -> None:
    """A process that starts with a few objects frozen (seen on a GPU machine: 375 in every Python
    process of its environment) still gets its heap frozen around a fork, and all unfrozen after.
    (A real gc.freeze() freezes thousands at start-up: the limit is raised to stand for it.)"""
    at_import, during, after = map(int, _freeze_run("gc.freeze()", "w.ENVIRONMENT_FROZEN_LIMIT = 10**6"))
    assert 0 < at_import < 200_000
    assert during >= 200_000 and after == 0


@pytest.mark.parametrize("heap_first", [True, False])
def test_a_program_that_froze_its_heap_before_importing_fastload_keeps_it_frozen(heap_first: bool) -> None:
    """A program's own freeze is respected whether it came before fastload's import (its heap, or
    only the interpreter's start-up objects: more than an environment freezes) or after."""
    before = "keep = [[i] for i in range(100_000)]\ngc.freeze()" if heap_first else "gc.freeze()"
    at_import, during, after = map(int, _freeze_run(before))
    assert at_import > 2_000
    assert during == at_import and after == at_import  # not frozen again, not unfrozen


def test_a_program_that_freezes_its_own_heap_keeps_it_frozen(
    imagenet_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The freeze count alone cannot tell: frozen objects that die leave the permanent generation,
    # so the count may drop a little while the loader runs. Record the calls instead.
    calls: list[str] = []
    freeze, unfreeze = gc.freeze, gc.unfreeze
    monkeypatch.setattr(gc, "freeze", lambda: (calls.append("freeze"), freeze())[1])
    monkeypatch.setattr(gc, "unfreeze", lambda: (calls.append("unfreeze"), unfreeze())[1])
    freeze()
    try:
        frozen = gc.get_freeze_count()
        loader = fastload.DataLoader(
            _fast_dataset(imagenet_root / "val"), batch_size=4, num_workers=1, multiprocessing_context="fork"
        )
        assert len(list(loader)) == 3
        loader.close()
        assert calls == []  # neither frozen again nor unfrozen behind the program's back
        assert gc.get_freeze_count() > frozen // 2  # still frozen: only dead objects left it
    finally:
        unfreeze()


class _Finalised:
    """Garbage in a reference cycle whose finaliser records the process that ran it (standing in
    for a CUDA event or stream, whose finaliser aborts a forked worker)."""

    def __init__(self, record: Path) -> None:
        self.record, self.me = record, self

    def __del__(self) -> None:
        with open(self.record, "a") as f:
            f.write(f"{os.getpid()}\n")


def _collect(worker_id: int) -> None:
    gc.collect()


@pytest.mark.parametrize("path", ["fast", "torch"])
@pytest.mark.parametrize("frozen_by_the_program", [False, True])
def test_with_cuda_initialised_the_parents_garbage_is_collected_before_the_fork(
    imagenet_root: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    path: str,
    frozen_by_the_program: bool,
) -> None:
    """Seen on a GPU machine: a forked worker aborted ("CUDA error: initialization error") when
    its first collection finalised a CUDA object from garbage the parent had not collected yet.
    With CUDA initialised, that garbage is collected in the parent before the workers fork, also
    when the program froze its heap itself (then fastload does not freeze it)."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    record = tmp_path / "finalised.txt"
    if frozen_by_the_program:
        gc.freeze()
    gc.disable()  # the cycle stays garbage until someone collects it
    try:
        _Finalised(record)  # unreachable at once, kept alive by its cycle
        dataset = _fast_dataset(imagenet_root / "val") if path == "fast" else _CollectInWorker()
        loader = fastload.DataLoader(
            dataset,
            batch_size=4 if path == "fast" else None,
            num_workers=1,
            multiprocessing_context="fork",
            worker_init_fn=_collect,
        )
        assert loader.fast_path == (path == "fast")
        assert len(list(loader)) >= 2
        loader.close()
    finally:
        gc.enable()
        if frozen_by_the_program:
            gc.unfreeze()
    assert record.read_text().split() == [str(os.getpid())]  # finalised once, in this process


class _FailingProcess(multiprocessing.context.ForkProcess):
    """A fork whose second start fails, as ``fork()`` does when the system is out of processes."""

    started = 0

    def start(self) -> None:
        type(self).started += 1
        if type(self).started == 2:
            raise OSError(11, "Resource temporarily unavailable (fork failed)")
        super().start()


class _FailingContext(multiprocessing.context.ForkContext):
    Process = _FailingProcess


@pytest.mark.parametrize("path", ["fast", "torch"])
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # torch's half-made iterator
def test_gc_is_unfrozen_when_a_worker_fails_to_start(imagenet_root: Path, path: str) -> None:
    _FailingProcess.started = 0
    if path == "fast":
        dataset: Any = _fast_dataset(imagenet_root / "val")
    else:
        dataset = _CollectInWorker()
    loader = fastload.DataLoader(
        dataset,
        batch_size=4 if path == "fast" else None,
        num_workers=2,
        multiprocessing_context=_FailingContext(),
    )
    assert loader.fast_path == (path == "fast")
    with pytest.raises(OSError, match="fork failed"):
        iter(loader) if path == "fast" else next(iter(loader))
    assert gc.get_freeze_count() <= fastload._workerstart.FROZEN_AT_IMPORT
    assert _FailingProcess.started == 2
    if path == "fast":  # fastload stops the worker that did start (torch's iterator leaves it to exit)
        assert not [p for p in multiprocessing.active_children() if isinstance(p, _FailingProcess)]
    loader.close()


# ------------------------------------------- spawn/forkserver: the dataset pickled once, not into each start


def _large_folder(root: Path, n: int, transform: Any) -> Any:
    """A torchvision ``ImageFolder`` of ``n`` samples that cycle over the real files of ``root``."""
    import torchvision

    dataset = torchvision.datasets.ImageFolder(root, transform=transform)
    real = list(dataset.samples)
    dataset.samples = [real[i % len(real)] for i in range(n)]
    dataset.targets = [t for _, t in dataset.samples]
    return dataset


_LARGE = 200_000


def _check_worker_dataset(worker_id: int) -> None:
    """worker_init_fn: the worker received the whole dataset itself (not a handle to it)."""
    info = torch.utils.data.get_worker_info()
    dataset = info.dataset if info is not None else None
    if not isinstance(dataset, fastload.ImageFolder) or len(dataset) != _LARGE:
        raise RuntimeError(f"worker {worker_id} got {type(dataset).__name__} {dataset!r}")


def _shipped_fds(pid: int) -> list[str]:
    """The file descriptors of process ``pid`` that point at a shipped dataset."""
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed in between
            continue
        if "fastload-dataset" in target:
            found.append(target)
    return found


@pytest.mark.parametrize("path", ["torch", "fast"])
def test_spawned_workers_start_without_waiting_for_each_other(
    imagenet_root: Path, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """Each spawn start writes a few KB (the pipe holds 64 KiB, so ``start()`` does not wait until
    that worker imported torch), for a 200,000-sample index that pickles to megabytes; the
    workers get the dataset itself; the shipped copy is gone from every process once they read it."""
    import multiprocessing.reduction

    import psutil
    from torchvision import transforms as v1

    ops = [v1.Resize(16), v1.CenterCrop(16), v1.PILToTensor()]
    if path == "torch":
        ops.append(v1.ColorJitter(0.3, hue=0.1))  # an op fastload does not reproduce
    dataset = _large_folder(imagenet_root / "val", _LARGE, v1.Compose(ops))
    written: list[int] = []
    dump = multiprocessing.reduction.dump

    def measured_dump(obj: Any, file: Any, protocol: Any = None) -> None:
        start = file.tell()
        dump(obj, file, protocol)
        if isinstance(obj, multiprocessing.process.BaseProcess):
            written.append(file.tell() - start)

    monkeypatch.setattr(multiprocessing.reduction, "dump", measured_dump)
    shm_before = set(os.listdir("/dev/shm"))

    def first_batch(ship: bool, workers: int) -> torch.Tensor:
        if not ship:
            monkeypatch.setattr(fastload._workerstart, "SHIP_MIN_BYTES", 1 << 62)
        written.clear()
        loader = fastload.DataLoader(
            dataset,
            batch_size=4,
            num_workers=workers,
            multiprocessing_context="spawn",
            worker_init_fn=_check_worker_dataset if path == "torch" else None,
        )
        assert loader.fast_path == (path == "fast"), loader.fast_path_reason
        it = iter(loader)
        assert not _shipped_fds(os.getpid())  # this process closed its copy once the workers started
        _, labels = next(it)
        if ship:  # each worker closes its copy once it has read it
            for worker in psutil.Process().children():
                deadline = time.monotonic() + 120
                while _shipped_fds(worker.pid) and time.monotonic() < deadline:
                    time.sleep(0.1)  # the other worker may still be importing torch
                assert not _shipped_fds(worker.pid), worker
        loader.close()
        return labels

    labels = first_batch(ship=True, workers=2)
    assert len(written) == 2 and max(written) < 16_384, written
    assert labels.tolist() == dataset.targets[:4]
    # the control: the dataset pickled into the start, as torch does (megabytes)
    labels = first_batch(ship=False, workers=1)
    assert len(written) == 1 and written[0] > 2_000_000, written
    assert labels.tolist() == dataset.targets[:4]

    # nothing left behind in /dev/shm. multiprocessing's named semaphores (sem.mp-*) are not
    # looked at: any process of the machine (another test process, beside this one) makes and
    # unlinks them at any time, and multiprocessing's resource tracker owns them
    def ours() -> set[str]:
        return {name for name in os.listdir("/dev/shm") if not name.startswith("sem.mp-")} - shm_before

    deadline = time.monotonic() + 10
    while ours() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not ours()


class _HoldsTensor:
    def __init__(self, value: Any) -> None:
        self.value = value


def test_what_is_shipped_and_what_is_not() -> None:
    """Shipped: a large pickle that any number of processes can load. Not shipped (sent into each
    start as before): small ones, fork workers, and what multiprocessing hands to one process only
    (a tensor moved to shared memory, a queue)."""
    import pickle

    from fastload._workerstart import SHIP_MIN_BYTES, ShippedDataset, ship_dataset

    large = _HoldsTensor(np.arange(SHIP_MIN_BYTES // 4, dtype=np.int64))
    for method in ("spawn", "forkserver"):
        shipped = ship_dataset(large, method)
        assert isinstance(shipped, ShippedDataset) and shipped.nbytes >= SHIP_MIN_BYTES
        # outside a process start it pickles as the dataset itself
        again = pickle.loads(pickle.dumps(shipped))
        assert type(again) is _HoldsTensor and np.array_equal(again.value, large.value)
        shipped.close()
        assert shipped.closed and not _shipped_fds(os.getpid())
    assert ship_dataset(large, "fork") is None
    assert ship_dataset(_HoldsTensor(np.arange(10)), "spawn") is None
    assert ship_dataset(_HoldsTensor(torch.zeros(SHIP_MIN_BYTES)), "spawn") is None
    queue = multiprocessing.get_context("spawn").Queue()
    assert ship_dataset(_HoldsTensor([queue, np.arange(SHIP_MIN_BYTES)]), "spawn") is None


# ------------------------------------------- torch's workers: the last batch's heap goes back when idle


def _private_dirty_of(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Private_Dirty:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no Private_Dirty for process {pid}")


@pytest.mark.skipif(fastload._torchworkers._malloc_trim() is None, reason="needs glibc's malloc_trim")
@pytest.mark.skipif(
    not fastload._stream._STORAGE_WEAKREFS,
    reason="torch 2.1: the main process keeps the last batch's segment mapped until the next pass",
)
def test_idle_torch_workers_give_back_the_last_batch(
    imagenet_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch of 32 samples of 3 x 640 x 640 (39 MB of per-sample tensors before collating): the
    worker's heap keeps them after the batch is sent; once the worker idles they go back. Head
    acceleration followed only by torchvision's ops: fastload runs every op, so the trim is on."""
    from torchvision import transforms as v1

    transform = v1.Compose([v1.Resize(640), v1.CenterCrop(640), v1.PILToTensor(), v1.ColorJitter(0.1)])
    dataset = fastload.ImageFolder(imagenet_root / "train", transform=transform)

    def idle_private(trim: bool) -> int:
        monkeypatch.setattr(fastload._torchworkers, "IDLE_TRIM_SECONDS", 0.2 if trim else None)  # inherited
        loader = fastload.DataLoader(
            dataset,
            batch_size=32,
            num_workers=1,
            multiprocessing_context="fork",
            persistent_workers=True,
        )
        assert loader.path == "head-accelerated"
        it = iter(loader)
        pid = it._workers[0].pid
        assert [len(y) for _, y in it] == [32]
        assert [len(y) for _, y in loader] == [32]
        private = _private_dirty_of(pid)
        # the trimmed worker: until its memory went back (at most 30 s); the control: 2 s, ten
        # times the trim interval it would have used
        deadline = time.monotonic() + (30 if trim else 2)
        while time.monotonic() < deadline:  # the worker has nothing left to do
            time.sleep(0.5)
            private = _private_dirty_of(pid)
            if trim and private < 25 * 2**20:
                break
        loader.close()
        return private

    kept = idle_private(trim=False)  # the control: glibc keeps the samples' memory for the next batch
    trimmed = idle_private(trim=True)
    assert trimmed < 25 * 2**20 and kept > trimmed + 20 * 2**20, (kept, trimmed)


# ------------------------------------------------------ forkserver: the libraries imported once, there

_FORKSERVER_SCRIPT = """
import multiprocessing.forkserver, os, sys, time
from pathlib import Path
import torch, torchvision
from torchvision import transforms as v1
import fastload
import fastload._workerstart

def parent_maps(worker_id):
    # the forkserver is the worker's parent: which of these libraries has it loaded?
    maps = Path(f"/proc/{os.getppid()}/maps").read_text()
    found = sorted(name for name in ("torch", "torchvision") if f"/{name}/" in maps)
    Path(sys.argv[2], f"w{worker_id}").write_text(" ".join(found))

if __name__ == "__main__":
    preload = [x for x in sys.argv[3].split(",") if x]
    fastload._workerstart.PRELOADABLE = tuple(preload)
    transform = v1.Compose([v1.Resize(16), v1.CenterCrop(16), v1.PILToTensor(), v1.ColorJitter(0.3)])
    dataset = fastload.ImageFolder(sys.argv[1], transform=transform)
    loader = fastload.DataLoader(
        dataset, batch_size=4, num_workers=2, multiprocessing_context="forkserver", worker_init_fn=parent_maps
    )
    assert not loader.fast_path
    t0 = time.perf_counter()
    x, y = next(iter(loader))
    print("first batch", time.perf_counter() - t0, "s; labels", y.tolist())
    print("preload", multiprocessing.forkserver._forkserver._preload_modules)
    loader.close()
"""


def test_a_forkserver_preloads_the_libraries_the_workers_need(imagenet_root: Path, tmp_path: Path) -> None:
    """The forkserver imports torch, torchvision (the transforms sent to the workers are
    torchvision's) and fastload before it forks the workers, besides the main module; the test's
    own modules are not imported there. The control: with nothing preloadable, it has neither."""
    import subprocess
    import sys

    script = tmp_path / "forkserver_preload.py"
    script.write_text(_FORKSERVER_SCRIPT)
    for preloadable in (fastload._workerstart.PRELOADABLE, ()):
        report = tmp_path / f"report-{len(preloadable)}"
        report.mkdir()
        run = subprocess.run(
            [sys.executable, str(script), str(imagenet_root / "train"), str(report), ",".join(preloadable)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stderr[-3000:]
        labels = [int(t) for t in fastload.ImageFolder(imagenet_root / "train").targets[:4]]
        assert f"labels {labels}" in run.stdout
        seen = {p.read_text() for p in report.iterdir()}
        if preloadable:
            assert seen == {"torch torchvision"}, seen
            # numpy: fastload's index is numpy arrays
            assert "['__main__', 'torch', 'torchvision', 'numpy', 'fastload']" in run.stdout, run.stdout
        else:
            assert seen == {""}, seen  # the default: each worker imports them itself
            assert "preload ['__main__']" in run.stdout, run.stdout


def test_only_the_forkserver_is_preloaded(monkeypatch: pytest.MonkeyPatch) -> None:
    from multiprocessing import forkserver

    import torchvision  # noqa: F401 - only what this process has imported is preloaded

    assert fastload._workerstart.preload_forkserver("spawn", {"torchvision"}) is None
    assert fastload._workerstart.preload_forkserver("fork", {"torchvision"}) is None
    calls: list[list[str]] = []
    monkeypatch.setattr(forkserver, "set_forkserver_preload", calls.append)
    monkeypatch.setattr(forkserver._forkserver, "_forkserver_pid", 12345)  # running already
    assert fastload._workerstart.preload_forkserver("forkserver", {"torchvision"}) is None
    monkeypatch.setattr(forkserver._forkserver, "_forkserver_pid", None)
    monkeypatch.setattr(forkserver._forkserver, "_preload_modules", ["__main__", "mine"])
    got = fastload._workerstart.preload_forkserver("forkserver", {"torchvision", "tests", "mylib"})
    assert got == calls[0] == ["__main__", "mine", "torch", "torchvision", "fastload"]


def test_what_the_main_module_imports_is_preloaded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A forkserver worker runs the main module again as it starts: the libraries it imported at
    the top (as modules or names) are preloaded too, whatever the dataset refers to."""
    import types
    from multiprocessing import forkserver

    import PIL.Image

    main = types.ModuleType("__main__")
    main.np = np  # type: ignore[attr-defined]
    main.Image = PIL.Image.Image  # type: ignore[attr-defined]
    main.mine = types.ModuleType("my_project.data")  # type: ignore[attr-defined]
    monkeypatch.setitem(__import__("sys").modules, "__main__", main)
    assert fastload._workerstart.main_module_packages() >= {"numpy", "PIL", "my_project"}
    calls: list[list[str]] = []
    monkeypatch.setattr(forkserver, "set_forkserver_preload", calls.append)
    monkeypatch.setattr(forkserver._forkserver, "_forkserver_pid", None)
    monkeypatch.setattr(forkserver._forkserver, "_preload_modules", ["__main__"])
    assert fastload._workerstart.preload_forkserver("forkserver", set()) == [
        "__main__",
        "torch",
        "numpy",
        "PIL",
        "fastload",
    ]
