"""``fastload.DataLoader``: torch's DataLoader, with uint8 batches decoded straight into reusable buffers.

A subclass of :class:`torch.utils.data.DataLoader` with the same arguments and semantics. Given a
dataset that serves encoded images (``fastload.ImageFolder``, ``fastload.InMemoryImageFolder``)
and a fastload transform with a fixed output size, it runs its own *fast path*::

    main process                                      worker (process or thread)
    sampler order = f(seed, epoch) ─ batch k ─task─>  for i in batch: bytes = dataset.get_bytes(i)
                                                        with rng.sample_scope(seed, epoch, i):
                                                          transform.decode_into(bytes, slot[k][j])
    yield slot[k] as uint8 NCHW  <────── done ─────   labels[k][j] = targets[i]

The batch buffers (``slots``) are allocated once, in memory shared with the workers, and reused:
no per-sample tensors, no collate, no pickling of pixels. Images come out as a uint8 tensor of
shape ``(N, 3, H, W)`` whose memory is channels-last (``images.is_contiguous(memory_format=
torch.channels_last)``), which is what convolution kernels prefer; labels as int64 ``(N,)``.
Float conversion and normalization happen once per batch on the device (``fastload.gpu``).

**Buffer reuse.** A yielded batch stays valid while the next two batches are consumed: its
buffer is handed back to the workers when batch k+3 is requested (also across an epoch
boundary). Training loops never notice; code that keeps batches (a list of them, say) must
``.clone()`` them, or pass ``reuse_buffers=False``.

**Epoch lookahead.** With persistent workers, once every batch of an epoch has been handed to
the workers, free slots go to the *next* epoch's first batches (when the order is a function of
the epoch), so the workers never idle at an epoch boundary. The next pass uses them only if it is
exactly that epoch from its start; otherwise they are discarded (``epoch_lookahead=False`` turns
this off).

**Workers.** fastload's own workers run the fast path; ``worker_init_fn`` is called in each of
them (process or thread) and each process worker seeds ``random`` and torch with
``seed + worker_id``. ``torch.utils.data.get_worker_info()`` is ``None`` inside them (it is
torch's private machinery); datasets that need it run through torch's iterator anyway (any
dataset without ``get_bytes`` or without a fastload transform).

**Determinism.** The order is a function of ``(seed, epoch)`` and every random augmentation of
sample ``i`` a function of ``(seed, epoch, i)`` (:mod:`fastload.rng`), so the batches are bitwise
the same for any ``num_workers``, for process and thread workers, and after a mid-epoch resume:

    >>> state = loader.state_dict()                 # doctest: +SKIP
    >>> loader2.load_state_dict(state)              # in a new process: the rest of the epoch,
    >>> rest = list(loader2)                        # then the next epochs, as if never stopped

The epoch is the one given to :meth:`DataLoader.set_epoch`; a pass without a ``set_epoch`` call
uses the previous epoch + 1 (starting at 0), so a plain ``for epoch ...: for batch in loader``
also changes the order every epoch, exactly like an explicit ``set_epoch(epoch)``. A pass that is
left early (``break``) also counts as an epoch. ``state_dict()`` taken inside a pass records the
epoch and the batches handed out; taken between passes, it records what the next pass will do.

Any other dataset / ``collate_fn`` / ``batch_sampler`` goes through torch's own iterator
unchanged (with the seeded sampler when ``shuffle=True``).
"""

from __future__ import annotations

import pickle
import queue
import random
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np
import torch
import torch.multiprocessing as torch_mp
from torch.utils.data import IterableDataset, Sampler

from . import rng as _rng
from .batch import IndexedBatch
from .decode import DecodeError
from .device import auto_num_workers, available_cpus, cuda_available, register_pinned, unregister_pinned
from .stats import LoaderStats

__all__ = ["DataLoader", "EpochRandomSampler", "auto_num_workers"]

T_co = TypeVar("T_co", covariant=True)

_STATE_FORMAT = "fastload.DataLoader"
_POLL_SECONDS = 0.5


class EpochRandomSampler(Sampler[int]):
    """Random order of ``range(len(data_source))`` that is a function of ``(seed, epoch)`` only.

    The permutation is :func:`fastload.rng.epoch_permutation` (``torch.randperm`` seeded with
    ``seed + epoch``), the same one torch's ``DistributedSampler`` uses for one replica.

    Args:
        data_source: The dataset (only its length is used).
        seed: The shuffling seed.
    """

    def __init__(self, data_source: Any, seed: int = 0) -> None:
        self.data_source = data_source
        self.seed = int(seed)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch whose order the next iteration yields."""
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[int]:
        return iter(_rng.epoch_permutation(len(self.data_source), self.seed, self.epoch).tolist())

    def __len__(self) -> int:
        return len(self.data_source)


def _check_nonneg_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name} should be a non-negative integer, but got {name}={value!r}")
    return int(value)


# ------------------------------------------------------------------------------------ fast path


@dataclass
class _Task:
    generation: int
    batch: int  # position in the epoch
    slot: int
    epoch: int
    seed: int
    indices: np.ndarray


@dataclass
class _Lookahead:
    """Batches of the *next* epoch decoded while the current one drains (``epoch_lookahead``).

    Made when every batch of a pass has been handed to the workers and slots are free. The next
    pass adopts it when it is that epoch, from its start, with the same seed and exactly the same
    batches; otherwise it is dropped (its slots come back as its tasks report).
    """

    generation: int
    epoch: int
    seed: int
    batches: list[np.ndarray]
    pool: Any  # the _WorkerPool its tasks went to: a replaced pool (dead worker) voids it
    dataset_state: tuple[Any, ...]  # the dataset's transform objects when it was made
    issued: int = 0
    in_flight: dict[int, int] = field(default_factory=dict)  # batch -> slot, task not reported yet
    reports: dict[int, tuple[Any, ...]] = field(default_factory=dict)  # batch -> worker report


def _is_fast_dataset(dataset: Any) -> bool:
    transform = getattr(dataset, "transform", None)
    return (
        callable(getattr(dataset, "get_bytes", None))
        and transform is not None
        and callable(getattr(transform, "decode_into", None))
        and getattr(transform, "output_size", None) is not None
    )


def _describe(dataset: Any, i: int) -> str:
    describe = getattr(dataset, "describe", None)
    return describe(i) if callable(describe) else f"sample {i}"


def _label(targets: Any, target_transform: Callable[[int], Any] | None, i: int) -> int:
    target = int(targets[i])
    return int(target_transform(target)) if target_transform is not None else target


def _run_task(
    dataset: Any, task: _Task, images: np.ndarray, labels: np.ndarray, skip: bool
) -> tuple[int, list[tuple[int, str]]]:
    """Decodes the samples of ``task`` into ``images[slot]`` / ``labels[slot]``; returns (filled, skipped)."""
    transform = dataset.transform
    targets = dataset.targets
    target_transform = getattr(dataset, "target_transform", None)
    out = images[task.slot]
    lab = labels[task.slot]
    filled = 0
    skipped: list[tuple[int, str]] = []
    for i in task.indices.tolist():
        try:
            data = dataset.get_bytes(i)
            with _rng.sample_scope(task.seed, task.epoch, i):
                transform.decode_into(data, out[filled], _describe(dataset, i))
        except (DecodeError, OSError) as e:
            if not skip:
                raise
            skipped.append((i, str(e)))
            continue
        lab[filled] = _label(targets, target_transform, i)
        filled += 1
    return filled, skipped


def _portable_error(error: Exception) -> Exception | str:
    """The exception itself when it survives pickling (so the main process re-raises its type)."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:  # noqa: BLE001 - any pickling failure: send the text
        return f"{type(error).__name__}: {error}"
    return error


def _worker_main(
    worker_id: int,
    dataset: Any,
    tasks: Any,
    results: Any,
    images: torch.Tensor,
    labels: torch.Tensor,
    base_seed: int,
    skip: bool,
    worker_init_fn: Callable[[int], None] | None,
    is_process: bool,
) -> None:
    """The loop of one worker: take a task, fill its slot, report. ``None`` ends it."""
    if is_process:
        torch.set_num_threads(1)
        # Like torch's workers: distinct global RNG states (fastload's own randomness never uses them).
        random.seed(base_seed + worker_id)
        torch.manual_seed(base_seed + worker_id)
    if worker_init_fn is not None:
        worker_init_fn(worker_id)
    np_images = images.numpy()
    np_labels = labels.numpy()
    while True:
        try:
            task = tasks.get()
        except (EOFError, OSError, KeyboardInterrupt):  # the main process went away
            return
        if task is None:
            return
        t0 = time.perf_counter()
        try:
            filled, skipped = _run_task(dataset, task, np_images, np_labels, skip)
        except Exception as e:  # reported to the main process, which re-raises it
            results.put(
                (
                    task.generation,
                    task.batch,
                    task.slot,
                    "error",
                    _portable_error(e),
                    traceback.format_exc(),
                    worker_id,
                )
            )
            continue
        results.put(
            (
                task.generation,
                task.batch,
                task.slot,
                "ok",
                filled,
                skipped,
                (worker_id, time.perf_counter() - t0),
            )
        )


class _WorkerPool:
    """Workers and the shared batch slots they write into; lives as long as the loader.

    Slot ownership: a slot is *free*, *busy* (a task writing into it, of whichever pass), or held
    by the current pass (ready, or handed to the consumer). A new pass only takes free slots, and a
    slot of an abandoned pass becomes free when its task reports back, so no two tasks ever write
    into one slot and no batch is overwritten while it is in use.
    """

    def __init__(self, loader: DataLoader[Any], shape: tuple[int, int], num_slots: int) -> None:
        self.num_workers = loader.num_workers
        self.kind = loader.worker_type
        b = loader.batch_size or 1
        h, w = shape
        pin = bool(loader.pin_memory) and cuda_available()
        self.images = torch.empty((num_slots, b, h, w, 3), dtype=torch.uint8)
        self.labels = torch.empty((num_slots, b), dtype=torch.int64)
        self.pinned = False
        if self.num_workers > 0 and self.kind == "process":
            self.images.share_memory_()
            self.labels.share_memory_()
            if pin:
                self.pinned = register_pinned(self.images) and register_pinned(self.labels)
        elif pin:
            self.images = self.images.pin_memory()
            self.labels = self.labels.pin_memory()
            self.pinned = True
        self.num_slots = num_slots
        self.free_slots = list(range(num_slots))
        self.busy: dict[int, int] = {}  # slot -> generation of the task writing into it
        self.workers: list[Any] = []
        self.tasks: Any = None
        self.results: Any = None
        self.closed = False
        if self.num_workers == 0:
            return
        is_process = self.kind == "process"
        if is_process:
            ctx = loader.multiprocessing_context or torch_mp.get_context()
            self.tasks, self.results = ctx.Queue(), ctx.Queue()
            spawn: Any = ctx.Process
        else:
            self.tasks, self.results = queue.Queue(), queue.Queue()
            spawn = threading.Thread
        for wid in range(self.num_workers):
            worker = spawn(
                target=_worker_main,
                args=(
                    wid,
                    loader.dataset,
                    self.tasks,
                    self.results,
                    self.images,
                    self.labels,
                    loader._seed,
                    loader.on_error == "skip",
                    loader.worker_init_fn,
                    is_process,
                ),
                name=f"fastload-worker-{wid}",
                daemon=True,
            )
            worker.start()
            self.workers.append(worker)

    def take_slot(self) -> int | None:
        return self.free_slots.pop(0) if self.free_slots else None

    def release(self, slot: int) -> None:
        if slot not in self.busy and slot not in self.free_slots:
            self.free_slots.append(slot)

    def issue(
        self,
        generation: int,
        epoch: int,
        seed: int,
        batches: list[np.ndarray],
        issued: int,
        in_flight: dict[int, int],
    ) -> int:
        """Hands ``batches[issued:]`` to the workers while slots are free; returns the new ``issued``."""
        while issued < len(batches):
            slot = self.take_slot()
            if slot is None:
                break
            self.put(_Task(generation, issued, slot, epoch, seed, batches[issued]))
            in_flight[issued] = slot
            issued += 1
        return issued

    def put(self, task: _Task) -> None:
        self.busy[task.slot] = task.generation
        self.tasks.put(task)

    def drain(self, keep: int | None = None) -> None:
        """Takes back the tasks no worker has started yet (best effort) and frees their slots.

        Tasks of generation ``keep`` (an adopted epoch lookahead) are put back, in order.
        """
        kept: list[_Task] = []
        while True:
            try:
                task = self.tasks.get_nowait()
            except (queue.Empty, OSError, ValueError):
                break
            if task is None:  # not ours to drop
                self.tasks.put(None)
                break
            if task.generation == keep:
                kept.append(task)
                continue
            self.busy.pop(task.slot, None)
            self.release(task.slot)
        for task in kept:
            self.tasks.put(task)

    def get(self, timeout: float) -> tuple[Any, ...]:
        """The next finished task's report (its slot is then no longer busy); clear errors, no hang."""
        deadline = None if timeout <= 0 else time.monotonic() + timeout
        while True:
            if self.closed:
                raise RuntimeError(
                    "the DataLoader was closed (close(), or its workers shut down) while a pass was still iterating"
                )
            try:
                report = self.results.get(timeout=_POLL_SECONDS)
            except queue.Empty:
                pass
            else:
                self.busy.pop(report[2], None)
                return report
            self.check_alive()
            if deadline is not None and time.monotonic() > deadline:
                raise RuntimeError(
                    f"DataLoader timed out after {timeout} seconds waiting for a batch (timeout={timeout})"
                )

    def check_alive(self) -> None:
        for wid, w in enumerate(self.workers):
            if not w.is_alive():
                code = getattr(w, "exitcode", None)
                how = (
                    f"was killed by signal {-code}"
                    if code is not None and code < 0
                    else f"exited with code {code}"
                )
                pid = getattr(w, "pid", None)
                self.close()
                raise RuntimeError(
                    f"DataLoader worker {wid} (pid {pid}) {how} unexpectedly. If it ran out of memory, "
                    "use fewer workers or a smaller batch_size; run with num_workers=0 to see the error in the main process."
                )

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.workers:
            self.drain()  # don't make the workers decode a backlog nobody will read
        for _ in self.workers:
            try:
                self.tasks.put(None)
            except (OSError, ValueError):
                pass
        for w in self.workers:
            w.join(timeout=5)
            if self.kind == "process" and w.is_alive():
                w.terminate()
                w.join(timeout=5)
        if self.pinned and self.kind == "process":
            unregister_pinned(self.images)
            unregister_pinned(self.labels)
        self.workers = []


class _FastIterator:
    """One pass over the epoch's batches, ``start`` batches in (resume), through the pool."""

    def __init__(self, loader: DataLoader[Any], epoch: int, start: int) -> None:
        self.loader = loader
        self.epoch = epoch
        self.seed = loader._seed
        self.batches = loader._epoch_batches(epoch)
        self.next_batch = start
        self.issued = start
        self.pool = loader._get_pool()
        self.ready: dict[int, tuple[int, int, list[tuple[int, str]]]] = {}
        self.in_flight: dict[int, int] = {}  # batch -> slot
        self.reports: dict[int, tuple[Any, ...]] = {}  # batch -> report received before this pass began
        ahead = loader._take_lookahead(epoch, start, self.seed, self.batches)
        if ahead is not None:  # the workers already started on this epoch: carry on from there
            self.generation = ahead.generation
            self.issued = ahead.issued
            self.in_flight = ahead.in_flight
            self.reports = ahead.reports
        else:
            loader._generation += 1
            self.generation = loader._generation
        self.held = loader._held  # slots handed to the consumer, released two batches later (across passes)
        self.stats = loader.stats
        self.external_stats = loader._prefetching  # the prefetcher measures at the consumer
        if not self.external_stats:
            self.stats.start()
        self.done = False
        pool = self.pool
        if pool.num_workers:
            pool.drain(keep=self.generation)  # tasks of an abandoned pass that no worker started
        # Slots not written by a task of an earlier pass (those come back when their task reports)
        # and not holding an adopted lookahead batch.
        # The previous pass's last batches stay valid while the next two are consumed, too.
        kept = {report[2] for report in self.reports.values()} | set(self.held)
        pool.free_slots = [
            slot for slot in range(pool.num_slots) if slot not in pool.busy and slot not in kept
        ]

    def __iter__(self) -> _FastIterator:
        return self

    def _hold_limit(self) -> int:
        return 2 if self.loader.reuse_buffers else 0

    def _fill(self) -> None:
        pool = self.pool
        self.issued = pool.issue(
            self.generation, self.epoch, self.seed, self.batches, self.issued, self.in_flight
        )
        if self.issued == len(self.batches) and pool.free_slots and pool.num_workers:
            self.loader._fill_lookahead(self.epoch, self.seed)

    def _run_inline(self) -> None:
        """num_workers=0: decode exactly the batch the consumer asks for, in this thread."""
        slot = self.pool.take_slot()
        assert slot is not None  # the consumer holds at most _hold_limit() slots of >= 3
        task = _Task(
            self.generation, self.next_batch, slot, self.epoch, self.seed, self.batches[self.next_batch]
        )
        t0 = time.perf_counter()
        try:
            filled, skipped = _run_task(
                self.loader.dataset,
                task,
                self.pool.images.numpy(),
                self.pool.labels.numpy(),
                self.loader.on_error == "skip",
            )
        except BaseException:
            self.pool.release(slot)
            raise
        self.stats.record_decode(0, time.perf_counter() - t0)
        self.in_flight[task.batch] = slot
        self.ready[task.batch] = (slot, filled, skipped)

    def _wait(self) -> None:
        pool = self.pool
        while self.next_batch not in self.ready:
            if self.next_batch in self.reports:  # decoded ahead, before this pass began
                self._accept(self.reports.pop(self.next_batch))
                continue
            self._fill()
            report = pool.get(self.loader.timeout)
            if report[0] != self.generation:
                if not self.loader._lookahead_report(report):
                    pool.release(report[2])  # a task of an abandoned pass: its slot is free again
                continue
            self._accept(report)

    def _accept(self, report: tuple[Any, ...]) -> None:
        """Takes a worker's report of this pass: the batch is ready, or its error is raised."""
        pool = self.pool
        batch, slot, status = report[1], report[2], report[3]
        if status == "error":
            pool.release(slot)
            self._finish()
            error, tb, wid = report[4], report[5], report[6]
            context = f"in DataLoader worker {wid}, batch {batch} of epoch {self.epoch}\n\nOriginal traceback in the worker:\n{tb}"
            if isinstance(error, BaseException):
                if hasattr(error, "add_note"):
                    error.add_note(context)
                raise error
            raise RuntimeError(
                f"DataLoader worker {wid} failed on batch {batch} of epoch {self.epoch}: {error}\n\n{context}"
            )
        filled, skipped, (wid, seconds) = report[4], report[5], report[6]
        self.stats.record_decode(wid, seconds)
        self.ready[batch] = (slot, filled, skipped)

    def __next__(self) -> IndexedBatch:
        if self.done:
            raise StopIteration
        t0 = time.perf_counter()
        pool = self.pool
        while len(self.held) > self._hold_limit():
            pool.release(self.held.pop(0))
        if self.next_batch >= len(self.batches):
            self._finish()
            raise StopIteration
        if pool.num_workers == 0:
            self._run_inline()
        else:
            self._wait()
        slot, filled, skipped = self.ready.pop(self.next_batch)
        indices = self.batches[self.next_batch]
        if skipped:
            indices = indices[~np.isin(indices, [i for i, _ in skipped])]
        del self.in_flight[self.next_batch]
        self.next_batch += 1
        self.loader._batches_done = self.next_batch
        if pool.num_workers:
            self._fill()
        for index, message in skipped:
            warnings.warn(f"skipped sample {index} (on_error='skip'): {message}", stacklevel=2)
        self.stats.skipped += len(skipped)
        images = pool.images[slot, :filled].permute(0, 3, 1, 2)
        labels = pool.labels[slot, :filled]
        if self.loader.reuse_buffers:
            self.held.append(slot)
        else:
            images, labels = images.clone(memory_format=torch.channels_last), labels.clone()
            pool.release(slot)
        if not self.external_stats:
            self.stats.record_batch(filled, time.perf_counter() - t0)
        return IndexedBatch(images, labels, torch.from_numpy(indices))

    def _finish(self) -> None:
        if not self.done:
            self.done = True
            if not self.external_stats:
                self.stats.stop()
            self.loader._finished_epoch(self.epoch, self.next_batch >= len(self.batches))

    def __len__(self) -> int:
        return len(self.batches)


# ------------------------------------------------------------------------------------ DataLoader


class DataLoader(torch.utils.data.DataLoader, Generic[T_co]):  # type: ignore[type-arg]
    """Drop-in for :class:`torch.utils.data.DataLoader` (see the module docs for what it adds).

    Every torch argument keeps its name and meaning; these defaults differ, to fix known traps:
    ``num_workers="auto"`` (:func:`auto_num_workers`), ``persistent_workers=True`` when there are
    workers, ``pin_memory=True`` when CUDA is available. The main process's torch intra-op threads
    are capped so that they and the workers never oversubscribe the CPUs (``limit_threads``).

    Args:
        dataset: Any map-style or iterable dataset.
        batch_size, shuffle, sampler, batch_sampler, collate_fn, drop_last, timeout,
            worker_init_fn, multiprocessing_context, generator, prefetch_factor,
            pin_memory_device, in_order: As in torch.
        num_workers: Worker count, or ``"auto"``.
        pin_memory: ``None`` pins when CUDA is available.
        persistent_workers: ``None`` keeps workers between epochs when there are any.
        seed: Seeds the shuffle order and every random augmentation. ``None`` draws one from
            torch's global RNG at construction (so ``torch.manual_seed`` makes runs repeatable,
            as with torch), or from ``generator`` when given.
        device: Move batches to this device (through :class:`fastload.CUDAPrefetcher`).
        gpu_transforms: Batched transforms (``fastload.gpu``) applied on ``device``.
        worker_type: ``"process"`` (default) or ``"thread"`` (decoding releases the GIL); both
            give identical batches.
        distributed: Build a :class:`fastload.DistributedSampler` from the process group: with
            ``shuffle=True`` a training sampler (``drop_last=True``: equal step counts on every
            rank), else an evaluation sampler (every sample exactly once over all ranks).
        on_error: ``"raise"`` (default): a corrupt image raises an error naming it. ``"skip"``:
            the sample is left out of its batch (which is then shorter), counted in
            ``stats.skipped``, and a warning names it.
        reuse_buffers: Hand out views of the reusable batch buffers (see the module docs).
        progress: Show a tqdm bar per epoch.
        limit_threads: Cap ``torch.get_num_threads()`` at ``CPUs - num_workers`` (at least 1)
            when iteration starts.
        decode: ``"cpu"`` (default): workers decode. ``"device"``: workers only read the encoded
            bytes (free with ``InMemoryImageFolder``); :func:`fastload.decode.decode_batch`
            decodes each batch on ``device`` (nvJPEG on a GPU; the CPU decoder on the CPU) and
            ``gpu_transforms`` (required, starting with a resize-type transform) make one batch
            of the differently sized images. The dataset's ``transform`` must be ``None``.
        epoch_lookahead: With persistent workers and an order that is a function of the epoch
            (``shuffle=True``/``False``, ``distributed=True`` or a fastload ``DistributedSampler``),
            workers that have no batch of the current epoch left start on the next epoch's first
            batches, so there is no pipeline drain and refill at each epoch boundary. The next
            pass uses them only if it is exactly that epoch (same seed, same batches); anything
            else (``set_epoch`` to another epoch, a resume, a changed sampler) discards them.
            At most the batch ring (``num_workers * prefetch_factor`` batches) is decoded ahead.

    Raises:
        ValueError / TypeError: Naming the argument, for invalid values.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Sampler[Any] | Iterable[Any] | None = None,
        batch_sampler: Sampler[list[Any]] | Iterable[list[Any]] | None = None,
        num_workers: int | str = "auto",
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool | None = None,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool | None = None,
        pin_memory_device: str = "",
        in_order: bool = True,
        seed: int | None = None,
        device: str | torch.device | None = None,
        gpu_transforms: Callable[..., Any] | None = None,
        worker_type: str = "process",
        distributed: bool = False,
        on_error: str = "raise",
        reuse_buffers: bool = True,
        progress: bool = False,
        limit_threads: bool = True,
        decode: str = "cpu",
        epoch_lookahead: bool = True,
    ) -> None:
        if num_workers == "auto":
            num_workers = auto_num_workers()
        elif (
            isinstance(num_workers, bool) or not isinstance(num_workers, (int, np.integer)) or num_workers < 0
        ):
            raise ValueError(
                f"num_workers should be a non-negative integer or 'auto', but got num_workers={num_workers!r}"
            )
        num_workers = int(num_workers)
        if batch_size is not None and (
            isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size <= 0
        ):
            raise ValueError(f"batch_size should be a positive integer, but got batch_size={batch_size!r}")
        if worker_type not in ("process", "thread"):
            raise ValueError(
                f"worker_type should be 'process' or 'thread', but got worker_type={worker_type!r}"
            )
        if decode not in ("cpu", "device"):
            raise ValueError(f"decode should be 'cpu' or 'device', but got decode={decode!r}")
        if decode == "device":
            if not callable(getattr(dataset, "get_bytes", None)):
                raise ValueError(
                    "decode='device' needs a dataset that serves encoded images (fastload.ImageFolder or InMemoryImageFolder)"
                )
            if gpu_transforms is None:
                raise ValueError(
                    "decode='device' needs gpu_transforms that bring the decoded images to one size, e.g. gpu.Compose([gpu.RandomResizedCrop(224), gpu.Normalize(...)])"
                )
            if getattr(dataset, "transform", None) is not None:
                raise ValueError(
                    "decode='device' decodes and transforms on the device: leave the dataset's transform None and pass the augmentations as gpu_transforms"
                )
            if collate_fn is not None or batch_sampler is not None:
                raise ValueError(
                    "decode='device' builds its own batches: collate_fn and batch_sampler are not supported with it"
                )
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error should be 'raise' or 'skip', but got on_error={on_error!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))):
            raise TypeError(f"seed should be an integer or None, but got seed={seed!r}")
        if pin_memory is None:
            pin_memory = cuda_available()
        if persistent_workers is None:
            persistent_workers = num_workers > 0
        if seed is None:
            source = generator if generator is not None else None
            seed = int(torch.randint(0, 2**62, (1,), generator=source).item())
        self._seed = int(seed)
        is_iterable = isinstance(dataset, IterableDataset)
        own_sampler = False
        if distributed:
            if sampler is not None or batch_sampler is not None:
                raise ValueError(
                    "distributed=True builds the sampler itself: pass either distributed=True or sampler/batch_sampler, not both"
                )
            from .sampler import DistributedSampler

            sampler = DistributedSampler(
                dataset, shuffle=bool(shuffle), seed=self._seed, drop_last=bool(shuffle)
            )
            shuffle = False
            own_sampler = True
        elif shuffle and sampler is None and batch_sampler is None and not is_iterable:
            sampler = EpochRandomSampler(dataset, self._seed)
            shuffle = False
            own_sampler = True
        self._own_sampler = own_sampler
        super().__init__(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            sampler=sampler,
            batch_sampler=batch_sampler,
            num_workers=num_workers,
            collate_fn=collate_fn,
            pin_memory=pin_memory,
            drop_last=drop_last,
            timeout=timeout,
            worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context,
            generator=generator,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
            in_order=in_order,
        )
        self.worker_type = worker_type
        self.on_error = on_error
        self.reuse_buffers = bool(reuse_buffers)
        self.progress = bool(progress)
        self.limit_threads = bool(limit_threads)
        self.device = None if device is None else torch.device(device)
        self.gpu_transforms = gpu_transforms
        self.stats = LoaderStats()
        self.decode = decode
        self._fast = (
            decode == "cpu"
            and collate_fn is None
            and batch_sampler is None
            and batch_size is not None
            and not is_iterable
            and _is_fast_dataset(dataset)
        )
        self._epoch = 0  # the epoch of the next (or current) pass
        self._epoch_set = False
        self._resume_at = 0  # batches of self._epoch to skip on the next pass (load_state_dict)
        self._batches_done = 0
        self._pass_epoch: int | None = None  # epoch of the pass that _batches_done counts
        self._pool: _WorkerPool | None = None
        self._generation = 0
        self._prefetcher: Any = None
        self._prefetching = False
        self.epoch_lookahead = bool(epoch_lookahead)
        self._lookahead: _Lookahead | None = None
        self._held: list[int] = []  # batch slots the consumer may still be using (see reuse_buffers)

    # ---------------------------------------------------------------- public extras

    @property
    def seed(self) -> int:
        """The seed of the shuffle order and of every random augmentation."""
        return self._seed

    @property
    def epoch(self) -> int:
        """The epoch of the current (or next) pass."""
        return self._epoch

    @property
    def fast_path(self) -> bool:
        """Whether batches are decoded straight into shared buffers (else torch's iterator runs)."""
        return self._fast

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch of the next pass (order and augmentation), and the sampler's, if it has one."""
        self._epoch = _check_nonneg_int(epoch, "epoch")
        self._epoch_set = True
        self._resume_at = 0
        self._pass_epoch = None
        if self._prefetcher is not None:
            self._prefetcher._state = None  # its snapshot belongs to the abandoned pass
        set_sampler_epoch = getattr(self.sampler, "set_epoch", None)
        if callable(set_sampler_epoch):
            set_sampler_epoch(self._epoch)

    def state_dict(self) -> dict[str, Any]:
        """Where the loader is: seed, epoch and batches already handed out in that epoch.

        With ``device``/``gpu_transforms`` the prefetcher is one batch ahead of the consumer; the
        state is the one of the last batch the consumer received, so a resume neither skips nor
        repeats a batch.
        """
        if self._prefetcher is not None and self._pass_epoch is not None:
            return self._prefetcher.state_dict()
        return self._host_state_dict()

    def _host_state_dict(self) -> dict[str, Any]:
        if self._pass_epoch is not None:  # inside a pass: its epoch and the batches handed out
            epoch, done = self._pass_epoch, self._batches_done
        else:  # between passes: what the next pass will do (set_epoch, load_state_dict, or epoch + 1)
            epoch, done = self._epoch, self._resume_at
        return {
            "format": _STATE_FORMAT,
            "version": 1,
            "seed": self._seed,
            "epoch": epoch,
            "batches": done,
            "batch_size": self.batch_size,
            "num_samples": len(self.dataset) if not isinstance(self.dataset, IterableDataset) else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resumes from :meth:`state_dict`: the next pass yields the rest of the saved epoch.

        Raises:
            ValueError: If the state is not a fastload loader state or describes another
                dataset size or batch size (the remaining batches would be wrong).
        """
        if not isinstance(state, dict) or state.get("format") != _STATE_FORMAT:
            raise ValueError("state should come from fastload.DataLoader.state_dict()")
        if state.get("version") != 1:
            raise ValueError(
                f"unsupported DataLoader state version {state.get('version')!r} (this fastload reads version 1)"
            )
        n = len(self.dataset) if not isinstance(self.dataset, IterableDataset) else None
        if state.get("num_samples") != n or state.get("batch_size") != self.batch_size:
            raise ValueError(
                f"the state was saved for {state.get('num_samples')} samples in batches of {state.get('batch_size')}, "
                f"but this loader has {n} samples in batches of {self.batch_size}"
            )
        self._seed = int(state["seed"])
        if isinstance(self.sampler, EpochRandomSampler):
            self.sampler.seed = self._seed
        elif self._own_sampler and hasattr(self.sampler, "seed"):
            self.sampler.seed = self._seed
        epoch, done = int(state["epoch"]), int(state["batches"])
        if done >= len(self):
            epoch, done = epoch + 1, 0
        self.set_epoch(epoch)
        self._resume_at = done

    def close(self) -> None:
        """Stops the workers now (they also stop when the loader is garbage-collected)."""
        self._lookahead = None
        self._held.clear()
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # ---------------------------------------------------------------- iteration

    def _begin_pass(self) -> tuple[int, int]:
        epoch, start = self._epoch, self._resume_at
        set_sampler_epoch = getattr(self.sampler, "set_epoch", None)
        if callable(set_sampler_epoch) and (self._own_sampler or self._epoch_set):
            set_sampler_epoch(epoch)
        self._resume_at = 0
        self._batches_done = start
        self._pass_epoch = epoch
        if self.limit_threads:
            self._limit_threads()
        return epoch, start

    def _finished_epoch(self, epoch: int, complete: bool) -> None:
        # The next pass without set_epoch() is the next epoch, also after a partial pass (a loop that
        # breaks after N steps must not see the same N batches every epoch); state_dict() between
        # passes says so too, so a resumed run does what this loader would have done.
        if self._pass_epoch == epoch:
            self._pass_epoch = None
        if self._epoch == epoch:
            self._epoch = epoch + 1
            self._epoch_set = False
            self._resume_at = 0

    def _limit_threads(self) -> None:
        busy = self.num_workers  # process or thread workers: each keeps a core busy decoding
        cap = max(1, available_cpus() - busy)
        if torch.get_num_threads() > cap:
            torch.set_num_threads(cap)

    def _epoch_batches(self, epoch: int) -> list[np.ndarray]:
        return self._batches_of(np.fromiter((int(i) for i in self.sampler), dtype=np.int64))

    def _predicted_order(self, epoch: int) -> np.ndarray | None:
        """The sampler's order for ``epoch`` when it is a pure function of it, without touching the sampler."""
        from .sampler import DistributedSampler

        sampler = self.sampler
        if type(sampler) is EpochRandomSampler:
            return np.asarray(
                _rng.epoch_permutation(len(sampler.data_source), sampler.seed, epoch), dtype=np.int64
            )
        if type(sampler) is DistributedSampler:
            return np.asarray(sampler.indices(epoch), dtype=np.int64)
        if type(sampler) is torch.utils.data.SequentialSampler:
            return np.arange(len(sampler), dtype=np.int64)
        return None

    def _fill_lookahead(self, epoch: int, seed: int) -> None:
        """Gives free slots to the next epoch's first batches (see ``epoch_lookahead``)."""
        pool = self._pool
        if not (self.epoch_lookahead and self.persistent_workers) or pool is None:
            return
        ahead = self._lookahead
        if ahead is None or ahead.epoch != epoch + 1 or ahead.seed != seed or ahead.pool is not pool:
            order = self._predicted_order(epoch + 1)
            if order is None:
                return
            self._generation += 1
            ahead = self._lookahead = _Lookahead(
                self._generation, epoch + 1, seed, self._batches_of(order), pool, self._dataset_state()
            )
        ahead.issued = pool.issue(
            ahead.generation, ahead.epoch, ahead.seed, ahead.batches, ahead.issued, ahead.in_flight
        )

    def _dataset_state(self) -> tuple[Any, ...]:
        """The dataset's transform objects: replacing one between epochs voids a lookahead
        (thread workers would otherwise have decoded the next epoch's first batches with the old one)."""
        ds = self.dataset
        return tuple(getattr(ds, name, None) for name in ("transform", "target_transform"))

    def _lookahead_report(self, report: tuple[Any, ...]) -> bool:
        """Keeps a report of the lookahead's tasks (``True``); ``False``: not one of them."""
        ahead = self._lookahead
        if ahead is None or report[0] != ahead.generation:
            return False
        ahead.reports[report[1]] = report
        return True

    def _take_lookahead(
        self, epoch: int, start: int, seed: int, batches: list[np.ndarray]
    ) -> _Lookahead | None:
        """The lookahead, if this pass is exactly what it decoded; else it is dropped (slots freed)."""
        ahead, self._lookahead = self._lookahead, None
        if ahead is None:
            return None
        if ahead.pool is not self._pool or ahead.pool.closed:
            return None  # its workers are gone (a dead worker closed the pool): nothing to free
        if (
            ahead.epoch == epoch
            and start == 0
            and ahead.seed == seed
            and all(a is b for a, b in zip(ahead.dataset_state, self._dataset_state()))
            and len(ahead.batches) == len(batches)
            and all(np.array_equal(a, b) for a, b in zip(ahead.batches, batches))
        ):
            return ahead
        if self._pool is not None:
            for report in ahead.reports.values():
                self._pool.release(report[2])
        return None

    def _batches_of(self, order: np.ndarray) -> list[np.ndarray]:
        b = self.batch_size or 1
        n_full = len(order) // b
        batches = [order[k * b : (k + 1) * b] for k in range(n_full)]
        if not self.drop_last and len(order) % b:
            batches.append(order[n_full * b :])
        return batches

    def _get_pool(self) -> _WorkerPool:
        if self._pool is None or self._pool.closed:
            self._lookahead = None
            self._held.clear()  # slots of the old pool's buffers, which the consumer may keep
            shape = self.dataset.transform.output_size
            slots = max(2, self.num_workers * (self.prefetch_factor or 2)) + (3 if self.reuse_buffers else 1)
            self._pool = _WorkerPool(self, tuple(shape), slots)
        return self._pool

    def _encoded_batches(self, epoch: int, start: int) -> Iterator[IndexedBatch]:
        """decode='device': batches of still-encoded images, read ahead by a thread pool."""
        from concurrent.futures import ThreadPoolExecutor

        from .decode import decode_batch

        dataset = self.dataset
        device = self.device if self.device is not None else torch.device("cpu")
        batches = self._epoch_batches(epoch)[start:]
        targets = dataset.targets
        target_transform = getattr(dataset, "target_transform", None)
        with ThreadPoolExecutor(
            max_workers=max(1, self.num_workers), thread_name_prefix="fastload-read"
        ) as pool:
            pending = pool.map(dataset.get_bytes, batches[0].tolist()) if batches else None
            for k, indices in enumerate(batches):
                encoded = list(pending)  # type: ignore[arg-type]
                if k + 1 < len(batches):
                    pending = pool.map(dataset.get_bytes, batches[k + 1].tolist())
                names = [_describe(dataset, int(i)) for i in indices]
                images = decode_batch(encoded, device, names)
                labels = torch.tensor(
                    [_label(targets, target_transform, int(i)) for i in indices], dtype=torch.int64
                )
                self._batches_done = start + k + 1
                yield IndexedBatch(images, labels, torch.from_numpy(indices))

    def _host_batches(self) -> Iterator[Any]:
        epoch, start = self._begin_pass()
        if self.decode == "device":
            try:
                yield from self._encoded_batches(epoch, start)
            finally:
                self._finished_epoch(epoch, True)
            return
        if self._fast:
            it = _FastIterator(self, epoch, start)
            try:
                yield from it
            finally:
                it._finish()
                if not self.persistent_workers and self._generation == it.generation:
                    self.close()  # only the newest pass: an older one must not stop a live pass
            return
        if not self._prefetching:
            self.stats.start()
        inner = super().__iter__()
        done = 0
        try:
            for batch in inner:
                done += 1
                if done <= start:
                    continue  # resume on torch's path: the skipped batches are still loaded
                self._batches_done = done
                yield batch
        finally:
            if not self._prefetching:
                self.stats.stop()
            self._finished_epoch(epoch, True)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        self._prefetching = self.device is not None or self.gpu_transforms is not None
        host = self._host_batches()
        if not self._fast and not self._prefetching:
            host = self._timed(host)
        if self._prefetching:
            from .prefetch import CUDAPrefetcher

            one_pass = _OnePass(self, host)
            if self._prefetcher is None:
                device = self.device if self.device is not None else torch.device("cpu")
                self._prefetcher = CUDAPrefetcher(
                    one_pass, device=device, transforms=self.gpu_transforms, dtype=None
                )
                self._prefetcher.stats = self.stats
            else:
                self._prefetcher.loader = one_pass
            host = iter(self._prefetcher)
        if self.progress:
            from tqdm import tqdm

            host = iter(tqdm(host, total=len(self), desc=f"epoch {self._epoch}", unit="batch"))
        return host

    def _timed(self, it: Iterator[Any]) -> Iterator[Any]:
        while True:
            t0 = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                return
            self.stats.record_batch(_batch_len(batch), time.perf_counter() - t0)
            yield batch


class _OnePass:
    """One host pass as the prefetcher's loader: the batches, plus the pass's seed and epoch."""

    def __init__(self, loader: DataLoader[Any], batches: Iterator[Any]) -> None:
        self._loader = loader
        self._batches = batches
        self.seed = loader.seed
        self.epoch = loader.epoch

    def state_dict(self) -> dict[str, Any]:
        return self._loader._host_state_dict()

    def __iter__(self) -> Iterator[Any]:
        # Hand the pass over: only the consumer's iterator keeps it alive, so dropping that
        # iterator (a break) ends the pass, as on the host path.
        batches, self._batches = self._batches, iter(())
        return batches

    def __len__(self) -> int:
        return len(self._loader)


def _batch_len(batch: Any) -> int:
    first = batch[0] if isinstance(batch, (tuple, list)) and batch else batch
    try:
        return len(first)
    except TypeError:
        return 1
