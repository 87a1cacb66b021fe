"""The fast path's pool: its workers and the shared batch slots they write into.

The main process's side of :mod:`fastload._worker`: :class:`WorkerPool` starts the workers
(processes or threads; with :mod:`fastload._workerstart`'s frozen heap at a fork and shipped
dataset at a spawn), hands each a :class:`~fastload._worker.Task` for a free slot
(:meth:`WorkerPool.issue`), takes back their reports (:meth:`WorkerPool.get`) and hands a filled
slot out as tensors (:meth:`WorkerPool.hand_out`, in pinned memory for a CUDA device), reclaiming
the slot once no tensor over it is left. The engine (:mod:`fastload._engine`) drives it.

Pools shut down on :meth:`WorkerPool.close`, when their owner is collected, and at exit.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import os
import queue
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
import torch.multiprocessing as torch_mp

from ._shm import shared_empty, shared_slots
from ._worker import Report, Task, WorkerArgs, own_reader, run_task, run_task_split, worker_loop
from ._workerstart import frozen_heap, ship_dataset, start_method
from .gpu.memory import PageLock, host_memory
from .gpu.streams import current_cuda_device

POLL_SECONDS = 0.5
JOIN_SECONDS = 5.0

#: What ``next()`` on a pass says once its loader was closed (``close()``) or its workers shut down.
CLOSED_MIDPASS = (
    "the DataLoader was closed (close(), or its workers shut down) while a pass was still iterating"
)


_LIVE_POOLS: weakref.WeakSet[WorkerPool] = weakref.WeakSet()


@atexit.register
def _close_live_pools() -> None:
    """At interpreter exit: stop every pool still running (before multiprocessing's own hook)."""
    for pool in list(_LIVE_POOLS):
        with contextlib.suppress(Exception):
            pool.close()


class WorkerPool:
    """Workers and the shared batch slots they write into.

    A slot is *free*, *busy* (a task writing into it, of whichever pass), *pending* (issued, not
    handed out yet), or *out*: handed to the consumer as tensors over its memory, free again only
    when no tensor, view or array over it is left (a finalizer on their storage). A consumer that
    keeps more than two batches gets *extra* slots, allocated one batch at a time, so the
    pipeline keeps its depth. A slot of an abandoned pass is free once its task reports back.

    Args:
        sample_shape: ``(H, W, 3)`` (handed out as channels-last NCHW) or, with
            ``channels_first``, ``(3, H, W)``.
        num_workers: 0: no workers (the caller decodes with :meth:`run_inline`).
        pin: Hand out every batch in pinned memory (where memory can be pinned): the ring
            page-locked in place, or a pinned copy.
        preload: Imports what decoding needs, run here and by each spawn/forkserver worker.
        cuda_device: The device the batches go to (``None``: the current one).
    """

    def __init__(
        self,
        dataset: Any,
        sample_shape: tuple[int, ...],
        dtype: torch.dtype,
        batch_size: int,
        num_slots: int,
        num_workers: int,
        kind: str,
        context: Any,
        pin: bool,
        base_seed: int,
        skip: bool,
        worker_init_fn: Callable[[int], None] | None,
        channels_first: bool = False,
        preload: Callable[[], None] | None = None,
        cuda_device: int | None = None,
        freeze: bool = True,
    ) -> None:
        self.num_workers = num_workers
        self.kind = kind
        self.will_need: Callable[[np.ndarray], None] | None = getattr(dataset, "will_need", None)
        self.host = host = host_memory()
        self.pin = pin and host.can_pin()
        self.page_lock: PageLock | None = None
        self.warned_lock = False
        self.hwc = not channels_first
        is_process = num_workers > 0 and kind == "process"
        if is_process:  # shared with the workers; memfd-backed, so /dev/shm's size does not limit it
            self.images = shared_slots(num_slots, (batch_size, *sample_shape), dtype)  # a page each
            self.labels = shared_empty((num_slots, batch_size), torch.int64)
            if self.pin:  # cudaHostRegister: labels first, then the slots in the order they are used
                device = cuda_device if cuda_device is not None else current_cuda_device()
                self.page_lock = PageLock([self.labels, *self.images.unbind(0)], host, device)
        else:
            self.images = torch.empty((num_slots, batch_size, *sample_shape), dtype=dtype)
            self.labels = torch.empty((num_slots, batch_size), dtype=torch.int64)
            if self.pin:
                self.images = host.pin(self.images)
                self.labels = host.pin(self.labels)
        self.num_slots = num_slots
        self.np_images = self.images.numpy()
        self.np_labels = self.labels.numpy()
        self.free_slots = list(range(num_slots))
        self.busy: dict[int, int] = {}  # slot -> generation of the task writing into it
        self.pending: set[int] = set()  # issued, not handed out yet
        self.out: dict[int, int] = {}  # handed out: slot -> finalizers still to run
        self.returned: collections.deque[int] = collections.deque()  # appended by finalizers (any thread)
        self.extra: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        #: free slots that copies queued on the device may still read: slot -> the host's fence
        self.fences: dict[int, Any] = {}
        self.next_extra = num_slots
        self.depth = max(1, num_slots - 2)  # pending slots the pipeline keeps (the ring less 2 in use)
        self.slot_shape = (batch_size, *sample_shape)
        self.dtype = dtype
        self.share = is_process
        self.workers: list[Any] = []
        self.tasks: Any = None
        self.results: Any = None
        self.closed = False
        self.inline: ThreadPoolExecutor | None = None  # num_workers=0: the threads of run_inline
        self.inline_parts = 0  # how many threads self.inline has
        if num_workers == 0:
            return
        if is_process:
            ctx: Any = context if context is not None else torch_mp.get_context()
            if isinstance(ctx, str):
                ctx = torch_mp.get_context(ctx)
            self.tasks, self.results = ctx.Queue(), ctx.Queue()
            start: Any = ctx.Process
            method = start_method(ctx)
        else:
            self.tasks, self.results = queue.Queue(), queue.Queue()
            start = threading.Thread
            method = "thread"
        main_thread = threading.current_thread() is threading.main_thread()
        if preload is not None:
            preload()
        # spawn/forkserver: a large dataset is pickled once, so each start() returns at once
        shipped = ship_dataset(dataset, method) if is_process else None
        closing: Any = contextlib.closing(shipped) if shipped is not None else contextlib.nullcontext()
        with frozen_heap(method, freeze=freeze), closing:
            for wid in range(num_workers):
                args = WorkerArgs(
                    wid,
                    dataset if shipped is None else shipped,
                    self.tasks,
                    self.results,
                    self.images,
                    self.labels,
                    base_seed,
                    skip,
                    worker_init_fn,
                    is_process,
                    os.getpid(),
                    main_thread,
                    preload if is_process else None,
                    num_workers,
                )
                worker = start(target=worker_loop, args=(args,), name=f"fastload-worker-{wid}", daemon=True)
                try:
                    worker.start()
                except BaseException:
                    self.close()  # the workers started so far stop: no half-started pool is left
                    raise
                self.workers.append(worker)
        _LIVE_POOLS.add(self)

    def collect_returned(self) -> None:
        """Frees the slots whose handed-out tensors are all gone."""
        while self.returned:
            slot = self.returned.popleft()
            left = self.out.get(slot, 0) - 1
            if left > 0:
                self.out[slot] = left
                continue
            self.out.pop(slot, None)
            if slot in self.extra:
                del self.extra[slot]  # extras are used once: their memory goes back to the OS
            elif slot not in self.busy and slot not in self.free_slots:
                if self.pin:
                    # an asynchronous copy out of it may still be queued on the device
                    self.fences[slot] = self.host.fence()
                self.free_slots.append(slot)

    def _unfenced_slot(self) -> int | None:
        """A free slot no queued copy still reads, if there is one."""
        for k, slot in enumerate(self.free_slots):
            fence = self.fences.get(slot)
            if fence is None or self.host.done(fence):
                self.fences.pop(slot, None)
                return self.free_slots.pop(k)
        return None

    def take_slot(self) -> int | None:
        """A free slot, an extra one if the consumer keeps batches, or ``None`` (the pipeline is full,
        or its free slots are still being copied from and a task in flight will report first)."""
        self.collect_returned()
        slot = self._unfenced_slot()
        if slot is not None:
            return slot
        if self.free_slots:
            if self.pending:
                return None  # try again after the next report: the copies will be done by then
            slot = self.free_slots.pop(0)  # nothing else to wait for: wait for the device
            self.host.wait(self.fences.pop(slot))
            return slot
        if len(self.pending) >= self.depth:
            return None
        slot, self.next_extra = self.next_extra, self.next_extra + 1
        if self.share:
            images = shared_empty(self.slot_shape, self.dtype)
            labels = shared_empty(self.slot_shape[:1], torch.int64)
        else:
            images = torch.empty(self.slot_shape, dtype=self.dtype)
            labels = torch.empty(self.slot_shape[:1], dtype=torch.int64)
        self.extra[slot] = (images, labels)
        return slot

    def run_inline(
        self, dataset: Any, task: Task, out: np.ndarray, lab: np.ndarray, skip: bool
    ) -> tuple[int, list[tuple[int, str]]]:
        """``num_workers=0``: decodes ``task`` in this process, split over ``torch.get_num_threads()``
        threads as torch splits its own ops; a user's ``get_bytes`` runs in this thread only."""
        parts = min(torch.get_num_threads(), len(task.indices))
        if parts < 2 or not own_reader(dataset):
            return run_task(dataset, task, out, lab, skip)
        if self.inline is None or self.inline_parts != parts:
            if self.inline is not None:
                self.inline.shutdown(wait=True)
            self.inline = ThreadPoolExecutor(max_workers=parts, thread_name_prefix="fastload-decode")
            self.inline_parts = parts
        return run_task_split(dataset, task, out, lab, skip, self.inline, parts)

    def arrays(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """The images (N, *sample_shape) and labels (N,) arrays of ``slot``."""
        if slot in self.extra:
            images, labels = self.extra[slot]
            return images.numpy(), labels.numpy()
        return self.np_images[slot], self.np_labels[slot]

    def batch_view(self, images: torch.Tensor) -> torch.Tensor:
        """A slot's images as ``(N, 3, H, W)``: channels-last memory for HWC slots, else as stored."""
        return images.permute(0, 3, 1, 2) if self.hwc else images

    def _in_place(self, slot: int) -> bool:
        """Whether ``slot``'s memory is pinned as it is: a ring slot once its page lock holds, never
        an extra slot (locking one costs more than copying it: about 3.4 ms per MB, measured)."""
        if slot in self.extra:
            return False
        if self.page_lock is None:  # allocated pinned
            return True
        slot_ready, labels_ready = self.page_lock.ready(1 + slot), self.page_lock.ready(0)
        if slot_ready is None or labels_ready is None:
            # still being locked (0.5 s for a float32 slot of 256 images, measured): a pinned copy
            # now (a few ms) rather than a wait; the slot is handed out in place once it is locked
            return False
        locked = slot_ready and labels_ready
        if not locked and not self.warned_lock:
            self.warned_lock = True
            warnings.warn(
                "fastload could not page-lock its batch buffers in place (cudaHostRegister failed): "
                "each batch is copied into pinned memory before it is handed out instead, which "
                "costs a copy per batch in this thread",
                stacklevel=4,
            )
        return locked

    def hand_out(self, slot: int, filled: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``filled`` images (N, 3, H, W) and labels of ``slot``, as tensors whose storage
        tells the pool when they are gone; with ``pin``, the slot's own pinned memory or a copy."""
        if self.pin and not self._in_place(slot):
            return self.copy_out(slot, filled)
        self.pending.discard(slot)
        images, labels = self.arrays(slot)
        images, labels = images[:], labels[:]  # new array objects: only these storages hold them
        self.out[slot] = 2
        weakref.finalize(images, self.returned.append, slot)
        weakref.finalize(labels, self.returned.append, slot)
        return self.batch_view(torch.from_numpy(images)[:filled]), torch.from_numpy(labels)[:filled]

    def copy_out(self, slot: int, filled: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of ``slot``'s first ``filled`` images and labels (``reuse_buffers=False``), pinned
        with ``pin``; the slot is free again at once."""
        self.pending.discard(slot)
        out, lab = self.arrays(slot)
        images = self.batch_view(torch.from_numpy(out[:filled]))
        labels = torch.from_numpy(lab[:filled])
        if self.pin:
            images, labels = self.host.pin(images), self.host.pin(labels)
        else:
            images, labels = images.clone(memory_format=torch.preserve_format), labels.clone()
        self.release(slot)
        return images, labels

    def pin_small(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (a batch's indices, say) in pinned memory with ``pin``, else ``t`` itself."""
        return self.host.pin(t) if self.pin else t

    def release(self, slot: int) -> None:
        """Makes ``slot`` free again (unless a task is still writing into it or it is out)."""
        self.pending.discard(slot)
        if slot in self.busy or slot in self.out or slot in self.free_slots:
            return
        if slot in self.extra:
            del self.extra[slot]
        else:
            self.free_slots.append(slot)

    def reclaim(self, keep: set[int]) -> None:
        """At the start of a pass: every slot that is not busy, out, or in ``keep`` is free."""
        self.collect_returned()
        self.pending = set(self.busy) | keep
        for slot in [s for s in self.extra if s not in self.pending and s not in self.out]:
            del self.extra[slot]
        self.free_slots = [
            s for s in range(self.num_slots) if s not in self.busy and s not in keep and s not in self.out
        ]

    def issue(
        self,
        generation: int,
        epoch: int,
        seed: int,
        batches: Sequence[np.ndarray],
        issued: int,
        in_flight: dict[int, int],
        keys: Any = None,
    ) -> int:
        """Hands ``batches[issued:]`` to the workers while slots are free; returns the new ``issued``
        (``keys``: a :class:`fastload._engine.SampleKeys` of the pass, or ``None``)."""
        has = getattr(batches, "has", None)  # batches read from the sampler as issued (SamplerBatches)
        while has(issued) if has is not None else issued < len(batches):
            slot = self.take_slot()
            if slot is None:
                break
            images, labels = self.extra.get(slot, (None, None))
            indices = batches[issued]
            sample_keys = keys.of(issued, batches) if keys is not None else None
            self.put(Task(generation, issued, slot, epoch, seed, indices, images, labels, sample_keys))
            if self.will_need is not None:  # read-ahead: the task waits behind the ones issued before
                self.will_need(batches[issued])
            in_flight[issued] = slot
            issued += 1
        return issued

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError(CLOSED_MIDPASS)

    def put(self, task: Task) -> None:
        """Hands one task to the workers; its slot is busy until the task reports."""
        self._check_open()
        self.busy[task.slot] = task.generation
        self.pending.add(task.slot)
        self.tasks.put(task)

    def drain(self, keep: int | None = None) -> None:
        """Takes back the tasks no worker has started yet (best effort) and frees their slots; tasks
        of generation ``keep`` (an adopted epoch lookahead) are put back, in order."""
        kept: list[Task] = []
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

    def get(self, timeout: float) -> Report:
        """The next finished task's report; raises torch's timeout error after ``timeout > 0``
        seconds without one, or an error naming a worker that died."""
        deadline = None if timeout <= 0 else time.monotonic() + timeout
        while True:
            self._check_open()
            try:
                report: Report = self.results.get(timeout=POLL_SECONDS)
            except queue.Empty:
                pass
            else:
                self.busy.pop(report.slot, None)
                return report
            self.check_alive()
            if deadline is not None and time.monotonic() > deadline:
                raise RuntimeError(f"DataLoader timed out after {timeout} seconds")

    def check_alive(self) -> None:
        """Raises a clear error (and closes the pool) if a worker has died."""
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
                    "use fewer workers or a smaller batch_size; run with num_workers=0 to see the error "
                    "in the main process."
                )

    def close(self) -> None:
        """Stops the workers: a stop message each, then ``terminate()``, then ``kill()``."""
        if self.closed:
            return
        self.closed = True
        _LIVE_POOLS.discard(self)
        if self.inline is not None:
            self.inline.shutdown(wait=True)
        if self.workers:
            self.drain()  # don't make the workers decode a backlog nobody will read
        for _ in self.workers:
            with contextlib.suppress(OSError, ValueError):
                self.tasks.put(None)
        deadline = time.monotonic() + JOIN_SECONDS
        for w in self.workers:
            w.join(timeout=max(0.0, deadline - time.monotonic()))
        if self.kind == "process":
            for w in self.workers:
                if w.is_alive():
                    w.terminate()
                    w.join(timeout=1.0)
                if w.is_alive():
                    w.kill()
                    w.join(timeout=1.0)
            for q in (self.tasks, self.results):
                if q is not None:
                    q.cancel_join_thread()  # never block exit on undelivered messages
                    q.close()
        if self.page_lock is not None:
            self.host.wait(self.host.fence())  # copies still queued from the ring finish first
            self.page_lock.release()
            self.page_lock = None
        self.workers = []
