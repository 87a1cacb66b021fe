"""The fast path's engine: what lives across a loader's passes (:class:`Engine`: the worker pool
and its slot ring, the epoch lookahead) and one pass (:class:`FastPass`: batches decoded by the
workers into reusable, pinned slots). :mod:`fastload.loader` builds the passes;
:mod:`fastload._devicepass` drives one from a feeder thread for ``decode="hybrid"``.
"""

from __future__ import annotations

import itertools
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import SequentialSampler

from ._checks import optional_attribute, sample_index
from ._pool import WorkerPool
from ._threads import ThreadCap
from ._worker import BatchDone, BatchFailed, Report, Task, describe_sample
from .batch import IndexedBatch
from .decode import without_skip_hint
from .device import cpu_share
from .sampler import DistributedSampler, EpochRandomSampler
from .transforms import import_decode_modules

__all__ = [
    "SUPERSEDED",
    "Engine",
    "FastPass",
    "Lookahead",
    "SampleNames",
    "SamplerBatches",
    "has_batch",
    "predicted_order",
    "split_batches",
]

#: What the ``next()`` of a pass says once a newer pass of its loader has taken over the workers.
SUPERSEDED = (
    "this pass of the DataLoader cannot go on: a newer pass of the same loader (a new "
    "iter(loader)) has taken over its workers; finish or close a pass before starting the next"
)


def split_batches(order: np.ndarray, batch_size: int, drop_last: bool) -> list[np.ndarray]:
    """``order`` cut into batches (the last one shorter unless ``drop_last``)."""
    n_full = len(order) // batch_size
    batches = [order[k * batch_size : (k + 1) * batch_size] for k in range(n_full)]
    if not drop_last and len(order) % batch_size:
        batches.append(order[n_full * batch_size :])
    return batches


class SamplerBatches(Sequence[np.ndarray]):
    """A pass's batches read from the sampler as they are issued (a few ahead of the loop), as torch
    reads it: a sampler the loop steers during the epoch (a curriculum) is read when torch would.
    ``len()``: the sampler's ``len()`` until it is exhausted, then the count it gave.
    """

    def __init__(self, sampler: Any, batch_size: int, drop_last: bool, expected: int) -> None:
        self._it = iter(sampler)
        self._batch_size = batch_size
        self._drop_last = drop_last
        self._expected = expected
        self._read: list[np.ndarray] = []
        self._done = False

    def has(self, k: int) -> bool:
        """Whether batch ``k`` exists (the sampler read up to it)."""
        while len(self._read) <= k and not self._done:
            chunk = np.fromiter(
                (sample_index(i) for i in itertools.islice(self._it, self._batch_size)), dtype=np.int64
            )
            if len(chunk) < self._batch_size:
                self._done = True
                if not len(chunk) or self._drop_last:
                    break
            self._read.append(chunk)
        return k < len(self._read)

    def __len__(self) -> int:
        return len(self._read) if self._done else max(self._expected, len(self._read))

    def __getitem__(self, k: Any) -> Any:  # int: np.ndarray; slice: a list
        if isinstance(k, slice):
            self.has(2**62)  # all of it
            return self._read[k]
        if k < 0 or not self.has(k):
            raise IndexError(f"batch {k} of a pass of {len(self)}")
        return self._read[k]


class SampleKeys:
    """The random streams' index for each sample a user's sampler gives, batch by batch.

    A sampler that gives a sample twice in a pass (``RASampler``, sampling with replacement), or
    ranks given the same sample, would give each copy the same crop and flip: the ``k``-th copy of
    sample ``i`` on this rank is keyed ``i + n * (k * replicas + rank)`` instead (``i`` for a
    sample once on one rank), whatever the workers."""

    def __init__(self, n: int, rank: int, replicas: int) -> None:
        self.n, self.rank, self.replicas = n, rank, max(1, replicas)
        self.counts = np.zeros(n, dtype=np.uint32)  # copies given so far in this pass
        self.done: dict[int, np.ndarray | None] = {}
        self.next = 0  # the first batch not counted yet

    def of(self, k: int, batches: Sequence[np.ndarray]) -> np.ndarray | None:
        """The keys of ``batches[k]`` (``None``: the indices themselves), the batches before it counted
        first (a resumed pass)."""
        while self.next <= k:
            self.done[self.next] = self._count(batches[self.next])
            self.next += 1
        return self.done[k]

    def _count(self, indices: np.ndarray) -> np.ndarray | None:
        if not len(indices) or indices.min() < 0 or indices.max() >= self.n:
            return None  # out of range: the worker names the sample
        counts = self.counts
        if len(np.unique(indices)) == len(indices):
            copies = counts[indices].astype(np.int64)
            counts[indices] += 1
        else:  # a sample twice in this batch: each copy in turn
            copies = np.empty(len(indices), dtype=np.int64)
            for p, i in enumerate(indices.tolist()):
                copies[p] = counts[i]
                counts[i] += 1
        if self.replicas > 1 or copies.any():
            return indices + self.n * (copies * self.replicas + self.rank)
        return None


def _cuda_index(device: torch.device | None) -> int | None:
    """The index of a CUDA ``device`` that names one, else ``None``."""
    return device.index if device is not None and device.type == "cuda" else None


def has_batch(batches: Sequence[np.ndarray], k: int) -> bool:
    """Whether ``batches`` has a batch ``k`` (a :class:`SamplerBatches` is read up to it)."""
    return batches.has(k) if isinstance(batches, SamplerBatches) else k < len(batches)


def predicted_order(sampler: Any, epoch: int) -> np.ndarray | None:
    """The sampler's order for ``epoch`` when it is a pure function of it, without touching the sampler."""
    if type(sampler) is EpochRandomSampler:
        return sampler.indices(epoch)
    if type(sampler) is DistributedSampler:
        return np.asarray(sampler.indices(epoch), dtype=np.int64)
    if type(sampler) is SequentialSampler:
        return np.arange(len(sampler), dtype=np.int64)
    return None


@dataclass
class Lookahead:
    """Batches of the *next* epoch decoded while the current one drains (``epoch_lookahead``),
    once every batch of a pass is issued and slots are free. The next pass adopts it when it is
    that epoch from its start with the same seed and batches; else its slots come back."""

    generation: int
    epoch: int
    seed: int
    batches: list[np.ndarray]
    pool: WorkerPool  # a replaced pool (dead worker) voids it
    dataset_state: tuple[Any, ...]  # the dataset's transform objects when it was made
    issued: int = 0
    in_flight: dict[int, int] = field(default_factory=dict)  # batch -> slot, task not reported yet
    reports: dict[int, Report] = field(default_factory=dict)  # batch -> worker report


def dataset_state(dataset: Any) -> tuple[Any, ...]:
    """The dataset's transform objects: replacing one between epochs voids a lookahead."""
    return tuple(optional_attribute(dataset, name) for name in ("transform", "target_transform"))


class Engine:
    """What lives across passes: the worker pool and its slot ring, the epoch lookahead and the torch
    thread cap. One per DataLoader, given to each pass; no reference to the loader (a dropped loader
    is collected at once and its workers stop)."""

    def __init__(self) -> None:
        self.pool: WorkerPool | None = None
        self.generation = 0
        self.lookahead: Lookahead | None = None
        # the newest fast pass's generation: an older pass left alive no longer takes reports
        self.live_pass: int | None = None
        # reports of the newest pass an older pass's thread received: (generation, batch) -> report
        self.stashed: dict[tuple[int, int], Report] = {}
        self.threads = ThreadCap()  # its hold on torch's thread count while its workers live
        self.holds = 0  # passes that took the hold: only the newest one's end releases it

    def new_generation(self) -> int:
        self.generation += 1
        return self.generation

    def get_pool(self, loader: Any, seed: int, dataset: Any) -> WorkerPool:
        """The workers (made on first use) and their slot ring for ``dataset``."""
        if self.pool is None or self.pool.closed:
            self.lookahead = None
            slots = max(2, loader.num_workers * (loader.prefetch_factor or 2)) + (
                3 if loader.reuse_buffers else 1
            )
            transform = dataset.transform
            h, w = transform.output_size
            self.pool = WorkerPool(
                dataset,
                tuple(getattr(transform, "sample_shape", (h, w, 3))),
                getattr(transform, "sample_dtype", torch.uint8),
                loader.batch_size or 1,
                slots,
                loader.num_workers,
                loader.worker_type,
                loader.multiprocessing_context,
                bool(loader.pin_memory),
                seed,
                loader.on_error == "skip",
                loader.worker_init_fn,
                bool(getattr(transform, "channels_first", False)),
                preload=import_decode_modules,
                cuda_device=_cuda_index(loader.device),
                freeze=loader._runs_user_code is None,  # no gc.freeze where workers run code of yours
            )
        return self.pool

    def limit_threads(self, busy: int) -> int:
        """Caps torch's intra-op threads so that they and ``busy`` workers fit this process's CPUs
        (:mod:`fastload._threads`); returns the pass's hold, for :meth:`end_hold`."""
        self.threads.hold(cpu_share() - busy)
        self.holds += 1
        return self.holds

    def end_hold(self, hold: int) -> None:
        """A pass whose workers stop with it ended: its hold ends unless a newer pass took it."""
        if hold == self.holds:
            self.threads.release()

    def fill_lookahead(self, loader: Any, epoch: int, seed: int) -> None:
        """Gives free slots to the next epoch's first batches (see ``epoch_lookahead``)."""
        pool = self.pool
        if not (loader.epoch_lookahead and loader.persistent_workers) or pool is None:
            return
        ahead = self.lookahead
        if ahead is None or ahead.epoch != epoch + 1 or ahead.seed != seed or ahead.pool is not pool:
            order = predicted_order(loader.sampler, epoch + 1)
            if order is None:
                return
            batches = split_batches(order, loader.batch_size or 1, loader.drop_last)
            ahead = Lookahead(
                self.new_generation(), epoch + 1, seed, batches, pool, dataset_state(loader.dataset)
            )
            self.lookahead = ahead
        ahead.issued = pool.issue(
            ahead.generation, ahead.epoch, ahead.seed, ahead.batches, ahead.issued, ahead.in_flight
        )

    def keep_lookahead_report(self, report: Report) -> bool:
        """Keeps a report of the lookahead's tasks (``True``); ``False``: not one of them."""
        ahead = self.lookahead
        if ahead is None or report.generation != ahead.generation:
            return False
        ahead.reports[report.batch] = report
        return True

    def take_lookahead(
        self, dataset: Any, epoch: int, start: int, seed: int, batches: Sequence[np.ndarray]
    ) -> Lookahead | None:
        """The lookahead, if this pass is exactly what it decoded; else it is dropped (slots freed)."""
        ahead, self.lookahead = self.lookahead, None
        if ahead is None:
            return None
        if not isinstance(batches, SamplerBatches):  # (whose order is not known ahead: dropped)
            if ahead.pool is not self.pool or ahead.pool.closed:
                return None  # its workers are gone (a dead worker closed the pool): nothing to free
            if (
                ahead.epoch == epoch
                and start == 0
                and ahead.seed == seed
                and all(a is b for a, b in zip(ahead.dataset_state, dataset_state(dataset), strict=True))
                and len(ahead.batches) == len(batches)
                and all(np.array_equal(a, b) for a, b in zip(ahead.batches, batches, strict=True))
            ):
                return ahead
        for report in ahead.reports.values():
            ahead.pool.release(report.slot)
        return None

    def close(self) -> None:
        """Stops the workers and ends the thread cap's hold."""
        self.lookahead = None
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        self.threads.release()


class FastPass:
    """One pass of the fast path: the epoch's ``batches``, ``start`` batches in, through the engine.

    ``loader`` gives its public settings only; ``keys``: a user sampler's (:class:`SampleKeys`).
    ``lookahead=False`` (``decode="hybrid"``, whose shares are decided when issued): none.
    """

    def __init__(
        self,
        loader: Any,
        engine: Engine,
        epoch: int,
        start: int,
        seed: int,
        batches: Sequence[np.ndarray],
        dataset: Any,
        keys: SampleKeys | None = None,
        lookahead: bool = True,
    ) -> None:
        self.loader = loader
        self.engine = engine
        self.epoch = epoch
        self.seed = seed
        self.lookahead = lookahead
        self.dataset = dataset
        self.batches = batches
        self.keys = keys
        self.next_batch = start
        self.issued = start
        self.pool = engine.get_pool(loader, seed, self.dataset)
        self.ready: dict[int, BatchDone] = {}
        self.in_flight: dict[int, int] = {}  # batch -> slot
        self.reports: dict[int, Report] = {}  # batch -> report received before this pass began
        self.last_seconds = 0.0  # the worker time of the batch handed out last
        ahead = engine.take_lookahead(loader.dataset, epoch, start, seed, batches) if lookahead else None
        if ahead is not None:  # the workers already started on this epoch: carry on from there
            self.generation = ahead.generation
            self.issued = ahead.issued
            self.in_flight = ahead.in_flight
            self.reports = ahead.reports
        else:
            self.generation = engine.new_generation()
        pool = self.pool
        engine.live_pass = self.generation  # an older pass still alive stops taking reports
        for key in [key for key in engine.stashed if key[0] != self.generation]:
            pool.release(engine.stashed.pop(key).slot)
        self.skipped: set[int] = set()  # batches given up without their report (see skip)
        if pool.num_workers:
            pool.drain(keep=self.generation)  # tasks of an abandoned pass that no worker started
        # free: slots not written by an earlier pass's task, nor adopted, nor held by the consumer
        pool.reclaim({report.slot for report in self.reports.values()})

    def __len__(self) -> int:
        return len(self.batches)

    def _superseded(self) -> None:
        """Raises if a newer pass of the loader has taken over the workers."""
        if self.engine.live_pass != self.generation:
            raise RuntimeError(SUPERSEDED)

    def skip(self, k: int) -> None:
        """Gives up batch ``k`` (the next one) without its report (a timeout ended it); its slot is
        freed when its report arrives."""
        if self.next_batch == k:
            self.next_batch = k + 1
            self.skipped.add(k)
            if self.pool.num_workers:
                self._fill()

    def _fill(self) -> None:
        pool = self.pool
        if self.engine.live_pass != self.generation:
            return  # a newer pass issues the tasks now
        self.issued = pool.issue(
            self.generation, self.epoch, self.seed, self.batches, self.issued, self.in_flight, self.keys
        )
        pool.collect_returned()
        if (
            self.lookahead
            and not has_batch(self.batches, self.issued)
            and pool.free_slots
            and pool.num_workers
        ):
            self.engine.fill_lookahead(self.loader, self.epoch, self.seed)

    def _run_inline(self) -> Report:
        """num_workers=0: decode exactly the batch the consumer asks for, in this process."""
        slot = self.pool.take_slot()
        if slot is None:  # pragma: no cover - nothing is pending without workers: take_slot allocates
            raise RuntimeError("no free batch slot: this is a fastload bug, please report it")
        indices = self.batches[self.next_batch]
        task = Task(self.generation, self.next_batch, slot, self.epoch, self.seed, indices)
        task.keys = self.keys.of(self.next_batch, self.batches) if self.keys is not None else None
        self.in_flight[task.batch] = slot
        t0 = time.perf_counter()
        out, lab = self.pool.arrays(slot)
        filled, skipped = self.pool.run_inline(self.dataset, task, out, lab, self.loader.on_error == "skip")
        return BatchDone(task.generation, task.batch, slot, 0, filled, skipped, time.perf_counter() - t0)

    def _wait(self) -> Report:
        """The report of batch ``next_batch``, from before this pass or from the workers."""
        pool = self.pool
        engine = self.engine
        self._superseded()  # not even a batch this pass received before: its next() raises
        while True:
            if self.next_batch in self.reports:  # decoded ahead, before this pass began
                return self.reports.pop(self.next_batch)
            if self.next_batch in self.ready:
                return self.ready.pop(self.next_batch)
            stashed = engine.stashed.pop((self.generation, self.next_batch), None)
            if stashed is not None:  # received by an older pass's thread
                return stashed
            self._superseded()
            self._fill()
            report = pool.get(self.loader.timeout)
            if report.generation != self.generation:
                if report.generation == engine.live_pass:  # the newer pass's: kept for it
                    engine.stashed[(report.generation, report.batch)] = report
                elif not engine.keep_lookahead_report(report):
                    pool.release(report.slot)  # a task of an abandoned pass: its slot is free again
                continue
            if report.batch in self.skipped:
                self.skipped.discard(report.batch)
                pool.release(report.slot)  # a batch given up (see skip)
                continue
            if report.batch == self.next_batch:
                return report
            if isinstance(report, BatchDone):
                self.ready[report.batch] = report
            else:
                self.reports[report.batch] = report  # an error of a later batch: raised in its turn

    def __next__(self) -> IndexedBatch:
        pool = self.pool
        if not has_batch(self.batches, self.next_batch):
            raise StopIteration
        k = self.next_batch
        indices = self.batches[k]
        try:
            report = self._run_inline() if pool.num_workers == 0 else self._wait()
        except BaseException:
            if pool.num_workers == 0:  # the inline decode raised: batch k is over, k + 1 comes next
                slot = self.in_flight.pop(k, None)
                if slot is not None:
                    pool.release(slot)
                    self.next_batch += 1
            raise  # with workers (a timeout, say) the next call waits for batch k again, as torch's
        self.next_batch += 1
        self.in_flight.pop(k, None)
        if pool.num_workers:
            self._fill()
        if isinstance(report, BatchFailed):
            pool.release(report.slot)
            report.reraise(self.epoch)
        assert isinstance(report, BatchDone)
        self.loader.stats.record_decode(report.worker_id, report.seconds)
        self.last_seconds = report.seconds
        if report.skipped:
            indices = indices[~np.isin(indices, [i for i, _ in report.skipped])]
            for index, message in report.skipped:
                warnings.warn(
                    f"skipped sample {index} (on_error='skip'): {without_skip_hint(message)}", stacklevel=3
                )
            self.loader.stats.skipped += len(report.skipped)
        slot, filled = report.slot, report.filled
        if self.loader.reuse_buffers:  # reused once nothing refers to this batch any more
            images, labels = pool.hand_out(slot, filled)
        else:
            images, labels = pool.copy_out(slot, filled)
        return IndexedBatch(images, labels, pool.pin_small(torch.from_numpy(indices)))


class SampleNames(Sequence[str]):
    """How errors name the samples of a batch, made only when an error needs one."""

    def __init__(self, dataset: Any, indices: np.ndarray) -> None:
        self.dataset, self.indices = dataset, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, k: Any) -> Any:  # int: str; slice: a list
        if isinstance(k, slice):
            return [describe_sample(self.dataset, int(i)) for i in self.indices[k]]
        return describe_sample(self.dataset, int(self.indices[k]))
