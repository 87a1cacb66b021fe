"""The fast path's workers: the loop each one runs, the messages it sends, the pool of them.

The shape of torch's ``torch/utils/data/_utils/worker.py``, for fastload's shared batch slots::

    main process (WorkerPool)                     worker (process or thread): worker_loop()
    tasks.put(Task(batch k, slot s, indices)) ──> run_task: decode each sample into slots[s]
    results.get() <── BatchDone(k, s, filled)     (or BatchFailed(k, s, error, traceback))

Lifecycle guarantees (each tested):

- **A worker never outlives the process that started it.** On Linux a process worker asks the
  kernel for ``SIGKILL`` when its parent dies (``prctl(PR_SET_PDEATHSIG)``, when it was started
  from the main thread), checks once that the parent is still there (the race before the
  ``prctl``), and, on every platform, a watchdog in its task loop (like torch's
  ``ManagerWatchdog``) notices within ``WATCHDOG_SECONDS`` that the main process is gone.
- **Workers own their signal handling.** A process worker resets every Python signal handler it
  inherited (a framework's SIGTERM handler that only logs would make it unkillable by
  ``terminate()``), restores the default ``SIGTERM`` action and ignores ``SIGINT``: a Ctrl-C in a
  terminal reaches every process of the group, and only the main process decides what it means
  (a persistent worker that exited on it would fail the next pass; one that is no longer needed
  dies with its parent or is stopped at exit).
- **Pools shut down** on :meth:`WorkerPool.close`, when their owner is garbage-collected, and at
  interpreter exit, within a bounded time: a stop message, then ``terminate()``, then ``kill()``.
  Thread workers get the stop message; they are daemon threads.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import contextlib
import copyreg
import ctypes
import functools
import gc
import io
import mmap
import multiprocessing
import multiprocessing.context
import multiprocessing.queues
import multiprocessing.reduction
import os
import pickle
import queue
import random
import signal
import sys
import tempfile
import threading
import time
import traceback
import types
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import IO, Any

import numpy as np
import torch
import torch.multiprocessing as torch_mp
from torch._utils import ExceptionWrapper  # what torch's iterator re-raises for a batch

from . import rng
from ._shm import send_through_memfd, shared_empty, shared_slots
from ._stream import drop_idle_ring, enable_ring
from ._stream import enable as enable_streaming
from .decode import DecodeError
from .gpu.memory import PageLock, host_memory
from .gpu.streams import current_cuda_device

__all__ = [
    "WATCHDOG_SECONDS",
    "BatchDone",
    "BatchFailed",
    "Task",
    "TorchWorkerInit",
    "WorkerPool",
    "ReportingQueue",
    "UnsendableBatchError",
    "SHIP_MIN_BYTES",
    "ShippedDataset",
    "describe_sample",
    "frozen_heap",
    "reporting_context",
    "start_method",
    "run_task",
    "ship_dataset",
    "worker_loop",
]

WATCHDOG_SECONDS = 2.0
POLL_SECONDS = 0.5
JOIN_SECONDS = 5.0


# --------------------------------------------------------------------------------------------
# Messages
# --------------------------------------------------------------------------------------------


#: What ``next()`` on a pass says once its loader was closed (``close()``) or its workers shut down.
CLOSED_MIDPASS = (
    "the DataLoader was closed (close(), or its workers shut down) while a pass was still iterating"
)


@dataclass
class Task:
    """Decode the samples ``indices`` of batch ``batch`` (of pass ``generation``) into ``slot``."""

    generation: int
    batch: int  # position in the epoch
    slot: int
    epoch: int
    seed: int
    indices: np.ndarray
    images: torch.Tensor | None = None  # the buffers of an extra slot (not one of the ring's)
    labels: torch.Tensor | None = None
    #: each sample's random-stream index where not its own (a copy given again: SampleKeys)
    keys: np.ndarray | None = None

    def key_list(self) -> list[int]:
        return (self.keys if self.keys is not None else self.indices).tolist()


@dataclass
class BatchDone:
    """A worker filled ``slot`` with ``filled`` samples; ``skipped`` lists ``(index, reason)``."""

    generation: int
    batch: int
    slot: int
    worker_id: int
    filled: int
    skipped: list[tuple[int, str]]
    seconds: float


@dataclass
class BatchFailed:
    """Decoding batch ``batch`` raised: the error (or its text if it cannot be pickled) and traceback."""

    generation: int
    batch: int
    slot: int
    worker_id: int
    error: BaseException | str
    traceback: str

    def reraise(self, epoch: int) -> None:
        """Raises the worker's error in the calling process, torch's ``ExceptionWrapper`` style."""
        context = (
            f"Caught in DataLoader worker {self.worker_id}, batch {self.batch} of epoch {epoch}.\n"
            f"Original traceback in the worker:\n{self.traceback}"
        )
        error = self.error
        if isinstance(error, BaseException):
            if hasattr(error, "add_note"):  # Python >= 3.11
                error.add_note(context)
            raise error
        raise RuntimeError(f"DataLoader worker {self.worker_id} failed: {error}\n\n{context}")


Report = BatchDone | BatchFailed


# --------------------------------------------------------------------------------------------
# One task
# --------------------------------------------------------------------------------------------


def describe_sample(dataset: Any, i: int) -> str:
    """How error messages name sample ``i``: the dataset's ``describe(i)`` (its file), else its index."""
    describe = getattr(dataset, "describe", None)
    return describe(i) if callable(describe) else f"sample {i}"


def run_task(
    dataset: Any, task: Task, out: np.ndarray, lab: np.ndarray, skip: bool
) -> tuple[int, list[tuple[int, str]]]:
    """Decodes the samples of ``task`` into its slot's arrays ``out`` (N, H, W, 3) and ``lab`` (N,).

    Returns:
        ``(filled, skipped)``: how many samples were written, and ``(index, reason)`` of those
        left out (only with ``skip``, for unreadable images).
    """
    transform = dataset.transform
    targets = dataset.targets
    target_transform = getattr(dataset, "target_transform", None)
    filled = 0
    skipped: list[tuple[int, str]] = []
    for i, key in zip(task.indices.tolist(), task.key_list(), strict=True):
        try:
            data = dataset.get_bytes(i)
            with rng.sample_scope(task.seed, task.epoch, key):
                transform.decode_into(data, out[filled], describe_sample(dataset, i))
        except (DecodeError, OSError) as e:
            if not skip:
                raise
            skipped.append((i, str(e)))
            continue
        target = int(targets[i])
        lab[filled] = int(target_transform(target)) if target_transform is not None else target
        filled += 1
    return filled, skipped


def own_reader(dataset: Any) -> bool:
    """Whether ``dataset.get_bytes`` is fastload's own (safe to call from several threads), not a
    user's override (user code runs where torch runs it: with ``num_workers=0``, in this thread)."""
    get_bytes = getattr(type(dataset), "get_bytes", None)
    return str(getattr(get_bytes, "__module__", "")).startswith("fastload.")


def run_task_split(
    dataset: Any,
    task: Task,
    out: np.ndarray,
    lab: np.ndarray,
    skip: bool,
    threads: ThreadPoolExecutor,
    parts: int,
) -> tuple[int, list[tuple[int, str]]]:
    """:func:`run_task` with the samples decoded by ``parts`` threads of ``threads``: the same result.

    Each sample is decoded into its own position (its random stream is its own), so the pixels do
    not depend on the split. Errors are raised as the serial loop raises them: the first failing
    sample's, in batch order; with ``skip`` the unreadable samples are left out and the others moved
    up in order. The labels (and a user's ``target_transform``) are computed in the calling thread.
    """
    transform = dataset.transform
    indices = task.indices.tolist()
    keys = task.key_list()

    def decode(positions: range) -> dict[int, BaseException]:
        errors: dict[int, BaseException] = {}
        for p in positions:
            i = indices[p]
            try:
                data = dataset.get_bytes(i)
                with rng.sample_scope(task.seed, task.epoch, keys[p]):
                    transform.decode_into(data, out[p], describe_sample(dataset, i))
            except BaseException as e:  # noqa: BLE001 - raised in the caller, in batch order
                errors[p] = e
                if not (skip and isinstance(e, (DecodeError, OSError))):
                    break  # the serial loop would stop here
        return errors

    n = len(indices)
    step = -(-n // parts)
    futures = [threads.submit(decode, range(a, min(n, a + step))) for a in range(0, n, step)]
    try:
        errors: dict[int, BaseException] = {}
        for f in futures:
            errors.update(f.result())
    except BaseException:
        wait_all(futures)  # no thread may still write into the slot once the caller releases it
        raise
    skipped: list[tuple[int, str]] = []
    for p in sorted(errors):
        e = errors[p]
        if not (skip and isinstance(e, (DecodeError, OSError))):
            raise e
        skipped.append((indices[p], str(e)))
    targets = dataset.targets
    target_transform = getattr(dataset, "target_transform", None)
    filled = 0
    for p, i in enumerate(indices):
        if p in errors:
            continue
        if filled != p:
            out[filled] = out[p]
        target = int(targets[i])
        lab[filled] = int(target_transform(target)) if target_transform is not None else target
        filled += 1
    return filled, skipped


def wait_all(futures: list[Future[Any]]) -> None:
    """Waits until every future is done (a second Ctrl-C ends the wait)."""
    for f in futures:
        f.cancel()
    concurrent.futures.wait(futures)


def _portable_error(error: BaseException) -> BaseException | str:
    """The exception itself when it survives pickling (the main process re-raises its type)."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:  # noqa: BLE001 - any pickling failure: send the text
        return f"{type(error).__name__}: {error}"
    return error


# --------------------------------------------------------------------------------------------
# The worker loop
# --------------------------------------------------------------------------------------------

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Linux: the kernel sends SIGKILL to this process when the thread that forked it ends.

    Only set when the pool was started from the main thread: a worker started from a thread
    that later ends would otherwise die with that thread. The watchdog covers the rest.
    """
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _reset_signal_handlers() -> None:
    """Drops the Python signal handlers inherited from the parent (fork) and the ignored SIGTERM.

    ``SIGINT`` is ignored: Ctrl-C is for the main process (see the module docstring).
    """
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        with contextlib.suppress(OSError, ValueError, RuntimeError):
            handler = signal.getsignal(sig)
            if sig == signal.SIGINT:
                signal.signal(sig, signal.SIG_IGN)
            elif callable(handler):
                signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


class _Watchdog:
    """Whether the process that started the workers is still alive (torch's ManagerWatchdog)."""

    def __init__(self, main_pid: int) -> None:
        self.main_pid = main_pid
        self.parent = os.getppid()

    def alive(self) -> bool:
        if os.getppid() != self.parent:
            return False  # re-parented: our parent (main process or forkserver) is gone
        try:
            os.kill(self.main_pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # pragma: no cover - a pid reused by another user's process
            return False
        return True


@dataclass
class WorkerArgs:
    """Everything a worker is started with (pickled once for spawn/forkserver)."""

    worker_id: int
    dataset: Any
    tasks: Any
    results: Any
    images: torch.Tensor
    labels: torch.Tensor
    base_seed: int
    skip: bool
    worker_init_fn: Callable[[int], None] | None
    is_process: bool
    main_pid: int
    die_with_parent: bool
    preload: Callable[[], None] | None = None
    num_workers: int = 1


def _numpy_seed(base_seed: int, worker_id: int) -> Any:
    """The seed torch's workers give numpy's global RNG (torch's own function where it has it)."""
    try:
        from torch.utils.data._utils.worker import _generate_state
    except ImportError:  # pragma: no cover - torch before 1.9
        return (base_seed + worker_id) % 2**32
    return _generate_state(base_seed, worker_id)


def worker_loop(args: WorkerArgs) -> None:
    """The loop of one worker: take a task, fill its slot, report. ``None`` ends it."""
    watchdog: _Watchdog | None = None
    if args.is_process:
        if args.die_with_parent:
            _die_with_parent()
        _reset_signal_handlers()
        watchdog = _Watchdog(args.main_pid)
        if not watchdog.alive():
            return  # the parent died before the prctl took effect
        torch.set_num_threads(1)
        if args.preload is not None:  # spawn/forkserver: imports now, not in the first task (fork: done)
            args.preload()
        # Like torch's workers: distinct global RNG states (fastload's own randomness never uses them),
        # numpy's too: forked workers would otherwise share the parent's (a worker_init_fn's draws)
        random.seed(args.base_seed + args.worker_id)
        torch.manual_seed(args.base_seed + args.worker_id)
        np.random.seed(_numpy_seed(args.base_seed, args.worker_id))
        # torch.utils.data.get_worker_info() in a worker_init_fn (it shards or seeds by worker id)
        from torch.utils.data._utils import worker as torch_worker

        torch_worker._worker_info = torch_worker.WorkerInfo(
            id=args.worker_id,
            num_workers=args.num_workers,
            seed=args.base_seed + args.worker_id,
            dataset=args.dataset,
        )
    try:
        init_error: tuple[BaseException, str] | None = None
        if args.worker_init_fn is not None:
            try:
                args.worker_init_fn(args.worker_id)
            except Exception as e:  # noqa: BLE001 - raised for this worker's batches, as torch's
                init_error = (e, "in worker_init_fn:\n" + traceback.format_exc())
        _serve(args, watchdog, init_error)
    except KeyboardInterrupt:  # a Ctrl-C before the handlers were reset: the main process handles it
        pass


def _serve(
    args: WorkerArgs, watchdog: _Watchdog | None, init_error: tuple[BaseException, str] | None
) -> None:
    """Serves tasks until told to stop. ``init_error``: what ``worker_init_fn`` raised, reported as
    the failure of every task this worker takes (torch's workers report it for their first batch,
    then fail every other one with an error of their own)."""
    np_images = args.images.numpy()
    np_labels = args.labels.numpy()
    while True:
        try:
            task = args.tasks.get(timeout=WATCHDOG_SECONDS)
        except queue.Empty:
            if watchdog is not None and not watchdog.alive():
                return
            continue
        except (EOFError, OSError):  # the main process went away
            return
        if task is None:
            return
        if init_error is not None:  # every batch of this worker: it was never set up
            error, trace = init_error
            args.results.put(
                BatchFailed(
                    task.generation, task.batch, task.slot, args.worker_id, _portable_error(error), trace
                )
            )
            continue
        t0 = time.perf_counter()
        if task.images is not None and task.labels is not None:  # an extra slot
            out, lab = task.images.numpy(), task.labels.numpy()
        else:
            out, lab = np_images[task.slot], np_labels[task.slot]
        try:
            filled, skipped = run_task(args.dataset, task, out, lab, args.skip)
        except Exception as e:  # reported to the main process, which re-raises it  # noqa: BLE001
            report: Report = BatchFailed(
                task.generation,
                task.batch,
                task.slot,
                args.worker_id,
                _portable_error(e),
                traceback.format_exc(),
            )
        else:
            report = BatchDone(
                task.generation,
                task.batch,
                task.slot,
                args.worker_id,
                filled,
                skipped,
                time.perf_counter() - t0,
            )
        args.results.put(report)


# --------------------------------------------------------------------------------------------
# torch's workers: a batch that cannot be sent is an error, not a hang
# --------------------------------------------------------------------------------------------


class UnsendableBatchError(RuntimeError):
    """A torch worker could not send a batch to the main process (it cannot be pickled)."""


class ReportingQueue(multiprocessing.queues.Queue):
    """A multiprocessing queue whose worker-side pickling failures reach the main process.

    torch's workers put ``(batch number, batch)`` on their result queue; when the batch cannot be
    pickled (a lambda, a file handle, a lock in a sample), the queue's feeder thread prints the
    error and drops the batch, and torch's iterator waits for it forever. This queue sends the
    error instead, wrapped like any other worker error, so ``next()`` raises it for that batch.
    """

    def _on_queue_feeder_error(self, e: Exception, obj: object) -> None:  # the documented hook
        if not (isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[0], int)):
            traceback.print_exc()  # what multiprocessing does for anything else
            return
        try:
            raise UnsendableBatchError(
                f"a DataLoader worker could not send batch {obj[0]} to the main process (a "
                f"{type(obj[1]).__name__}): {type(e).__name__}: {e}. With num_workers > 0 every sample "
                "must be picklable: return tensors, numbers, strings and containers of them from the "
                "dataset (or use num_workers=0)."
            ) from e
        except UnsendableBatchError:
            wrapper = ExceptionWrapper(sys.exc_info(), where="in a DataLoader worker process")
        self.put((obj[0], wrapper))


def _reporting(base: type[multiprocessing.context.BaseContext]) -> type[Any]:
    class Context(base):  # type: ignore[valid-type,misc]
        def Queue(self, maxsize: int = 0) -> ReportingQueue:  # noqa: N802 - multiprocessing's name
            return ReportingQueue(maxsize, ctx=self.get_context())

        def __reduce__(self) -> tuple[Any, ...]:  # a loader pickles (torch.multiprocessing.spawn, ddp_spawn)
            return (reporting_context, (self.get_start_method(),))

    return Context


_REPORTING = {
    name: _reporting(type(multiprocessing.get_context(name)))
    for name in multiprocessing.get_all_start_methods()
}


def reporting_context(context: Any) -> Any:
    """A multiprocessing context like ``context`` (``None``: the default start method, a name, or a
    standard context) whose queues report a batch that cannot be pickled; any other object as is."""
    if context is None:
        name = multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]
    elif isinstance(context, str):
        name = context
    elif type(context) in {type(multiprocessing.get_context(m)) for m in _REPORTING}:
        name = context.get_start_method()
    else:
        return context  # the user's own context class: leave it alone
    cls = _REPORTING.get(name)
    return context if cls is None else cls()


# --------------------------------------------------------------------------------------------
# Forking without copying the parent's heap
# --------------------------------------------------------------------------------------------


def start_method(context: Any) -> str:
    """The start method of a multiprocessing ``context`` (``None``: the default one)."""
    if context is None:
        return multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]
    if isinstance(context, str):
        return context
    return str(context.get_start_method())


#: Objects frozen (``gc.get_freeze_count()``) when fastload was imported.
FROZEN_AT_IMPORT = gc.get_freeze_count()

#: At most this many objects frozen at fastload's import are taken for the environment's doing (seen:
#: 375 in every process of one machine's Python), not the program's: a ``gc.freeze()`` freezes every
#: object the collector tracks, at least the interpreter's 4,000-8,000 from its start-up.
ENVIRONMENT_FROZEN_LIMIT = 2_000


def _frozen_by_environment() -> int:
    """How many frozen objects :func:`frozen_heap` does not take for the program's own freeze."""
    return FROZEN_AT_IMPORT if FROZEN_AT_IMPORT <= ENVIRONMENT_FROZEN_LIMIT else 0


@contextlib.contextmanager
def frozen_heap(context: Any) -> Iterator[None]:
    """Process workers forked inside this block never run the garbage collector over the objects
    they inherit.

    ``gc.freeze()`` before the fork moves every object the collector tracks into its permanent
    generation, which it never examines: a forked worker's collections then leave the inherited
    objects' headers alone, and their memory pages stay shared with the parent instead of being
    copied one by one (CPython's own advice for fork-based servers). ``gc.unfreeze()`` afterwards,
    in the parent (also when starting a worker raises), puts them back in the collector's oldest
    generation; the workers keep them frozen.

    Nothing else changes in the parent, with one effect on timing: objects that were in a young
    generation when the workers started are examined from then on by full collections only
    (as objects that survived two collections are), so a reference cycle among them that becomes
    garbage later is freed by the next full collection rather than by the next young one.

    Not done when ``context`` does not fork (spawn and forkserver workers start from a fresh
    interpreter), and not when the program froze objects itself (``gc.get_freeze_count() > 0``,
    before or after fastload's import): a program that freezes its own heap keeps managing it,
    and ``gc.unfreeze()`` would undo that. A few objects frozen before fastload's import (at most
    :data:`ENVIRONMENT_FROZEN_LIMIT`; seen: 375 frozen at the start of every Python process of one
    GPU machine's environment) are the environment's and do not turn the freeze off; they are
    unfrozen with the rest after the fork, which changes nothing but when the collector looks at
    them.

    Where CUDA is initialised, a full collection runs before the fork (with or without the
    freeze): a forked worker must never finalise the parent's CUDA objects.
    """
    if start_method(context) != "fork":
        yield
        return
    if torch.cuda.is_initialized():
        # Garbage the parent has not collected yet (reference cycles) would be collected in the
        # forked workers too, where finalising a CUDA object (an event, a stream, a tensor's
        # memory) aborts the worker ("CUDA error: initialization error"): collect it here first.
        gc.collect()
    if gc.get_freeze_count() > _frozen_by_environment():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


# --------------------------------------------------------------------------------------------
# torch's workers: what a worker keeps between batches goes back to the system when it idles
# --------------------------------------------------------------------------------------------

#: How often a torch worker started by ``fastload.DataLoader`` checks whether it is idle (seconds);
#: ``None`` turns the check off.
IDLE_TRIM_SECONDS: float | None = 0.5


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or ``None`` (another C library, another system)."""
    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)
    except OSError:  # pragma: no cover - no C library to load
        return None


def _trim_when_idle(trim: Callable[[int], int] | None, period: float) -> None:
    """Returns the worker's free memory to the system once each time the worker goes idle: when
    it used under 1% of a CPU over the last ``period`` seconds after having worked. Its free
    reused batch segments (:func:`fastload._stream.drop_idle_ring`), then its free heap memory
    (``malloc_trim(0)``, with glibc). Daemon thread of a torch worker."""
    last = time.process_time()
    worked = False
    while True:
        time.sleep(period)
        now = time.process_time()
        if now - last >= 0.01 * period:
            worked = True
        elif worked:
            drop_idle_ring()
            if trim is not None:
                trim(0)
            worked = False
        last = now


def pass_seed_cell() -> torch.Tensor:
    """The shared cell of fastload's default persistent workers on torch's iterator: the number
    of the pass and the base seed the main process drew for it (see :func:`reseed_each_pass`)."""
    return shared_empty((2,), torch.int64).zero_()


def seed_as_torch(base_seed: int, worker_id: int) -> None:
    """Seeds this worker's RNGs as torch's worker loop seeds a new worker of a pass whose base seed
    is ``base_seed`` (Python's ``random``, torch's, numpy's), and makes
    ``get_worker_info().seed`` that seed."""
    from torch.utils.data._utils import worker as torch_worker

    seed = base_seed + worker_id
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(_numpy_seed(base_seed, worker_id))
    info = torch_worker._worker_info
    if info is not None:
        torch_worker._worker_info = type(info)(
            id=info.id, num_workers=info.num_workers, seed=seed, dataset=info.dataset
        )


def reseed_each_pass(cell: torch.Tensor, worker_id: int) -> None:
    """In a worker of torch's iterator kept between passes by fastload's default (not asked for):
    at each new pass, seed it as torch's default, which starts new workers every pass, would.

    torch's worker loop makes its fetcher as the worker starts (seeded by torch for the first
    pass), and again for each later pass's ``_ResumeIteration``; before that is sent, the main
    process writes the pass's number and base seed into ``cell``
    (:func:`fastload._torchpath.torch_iter`). This wraps the fetcher's factory in this process
    only: at every call of torch's worker loop after its first, the worker seeds itself from the
    cell (:func:`seed_as_torch`), so random transforms draw what torch's new workers would draw
    (also a worker that started late, after the main process had begun a later pass: it serves
    the first pass's tasks with torch's seeding, then takes each resume in order).
    """
    from torch.utils.data import _DatasetKind

    make_fetcher = _DatasetKind.create_fetcher
    cells = cell.numpy()
    started = False

    def create_fetcher(*args: Any, **kwargs: Any) -> Any:
        nonlocal started
        # only torch's worker loop (not a loader the dataset iterates inside the worker)
        if sys._getframe(1).f_code.co_name == "_worker_loop":
            if started:
                seed_as_torch(int(cells[1]), worker_id)
            started = True
        return make_fetcher(*args, **kwargs)

    _DatasetKind.create_fetcher = staticmethod(create_fetcher)  # type: ignore[method-assign]


@dataclass(frozen=True)
class TorchWorkerInit:
    """The ``worker_init_fn`` of torch's worker processes started by ``fastload.DataLoader``: starts
    the idle trim (see below; ``trim``), turns on streamed batches (``stream``), then runs the
    user's ``worker_init_fn``, if any.

    Why: torch's worker loop builds a batch as a list of per-sample tensors and then collates them
    (at batch 256 of 224 px, 38.5 MB of samples). glibc's malloc serves such blocks from its heap
    once the first one was freed (its mmap threshold adapts upwards), and keeps the freed memory
    for the next batch: a worker holds that much private memory for as long as it lives, also
    while it idles (persistent workers of a training loader during evaluation, a paused loop).
    When the worker has been idle for :data:`IDLE_TRIM_SECONDS`, ``malloc_trim(0)`` gives that
    memory back; the next batch takes it again. Nothing else changes (no result, no timing
    while the worker is busy). Only with glibc. The same idle check drops the worker's free
    reused batch segments (``ring``, see :mod:`fastload._stream`), with any C library.
    """

    user_fn: Callable[[int], None] | None
    #: Whether fastload datasets stream their batches in this worker (:func:`fastload._stream.enable`):
    #: set when the loader batches and collates with torch's ``default_collate`` (it then runs
    #: :func:`fastload._stream.collate` instead; see ``fastload.loader._worker_init``).
    stream: bool = False
    #: The ring table of the reused batch segments (:func:`fastload._stream.ring_table`), or ``None``;
    #: without ``stream``, for a user's ``collate_fn`` (:class:`fastload._stream.RingedCollate`).
    ring: torch.Tensor | None = field(default=None, compare=False)
    #: fastload's default persistent workers: the pass cell (:func:`pass_seed_cell`) from which
    #: the worker seeds itself at each pass, as torch's new worker of that pass would be seeded.
    pass_seeds: torch.Tensor | None = field(default=None, compare=False)
    #: Whether the idle check also gives the heap's free memory back (``malloc_trim``): only where
    #: fastload runs every op in the worker (no allocator change in a process running user code).
    trim: bool = False

    def __call__(self, worker_id: int) -> None:
        send_through_memfd()  # batches this worker sends never need /dev/shm (fastload._shm)
        if self.pass_seeds is not None:
            reseed_each_pass(self.pass_seeds, worker_id)
        if self.stream:
            enable_streaming(self.ring, worker_id)
        else:
            enable_ring(self.ring, worker_id)  # a user's collate_fn: RingedCollate, in reused segments
        trim = _malloc_trim() if self.trim else None
        if (trim is not None or self.ring is not None) and IDLE_TRIM_SECONDS is not None:
            threading.Thread(
                target=_trim_when_idle, args=(trim, IDLE_TRIM_SECONDS), name="fastload-idle-trim", daemon=True
            ).start()
        if self.user_fn is not None:
            self.user_fn(worker_id)


# --------------------------------------------------------------------------------------------
# Spawn and forkserver: the dataset pickled once, read by every worker from an anonymous file
# --------------------------------------------------------------------------------------------

#: A dataset whose pickle is at least this large is shipped (:func:`ship_dataset`); a smaller one
#: is pickled into each worker's start as usual (it fits the 64 KiB pipe with room to spare).
SHIP_MIN_BYTES = 32 * 1024

#: Types multiprocessing's pickler reduces with pure functions (methods, method descriptors,
#: ``functools.partial``): a pickle of them can be loaded by any number of processes. Its other
#: reductions (sockets, connections, torch's tensors and storages shared through file descriptors
#: or named segments) hand a resource to the one process being started.
_PURE_REDUCTIONS = (
    types.MethodType,
    types.MethodDescriptorType,
    types.WrapperDescriptorType,
    functools.partial,
)


class _ProcessBound(Exception):
    """Raised while pickling for :func:`ship_dataset`: the object needs the process being started."""


def _process_bound(obj: object) -> Any:
    raise _ProcessBound(type(obj).__qualname__)


class _NotingPickler(pickle.Pickler):
    """A pickler that notes the top-level package of every class and function it pickles."""

    def __init__(self, file: IO[bytes], packages: set[str]) -> None:
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self.packages = packages

    def reducer_override(self, obj: Any) -> Any:
        module = getattr(obj, "__module__", None) if isinstance(obj, type) or callable(obj) else None
        if not isinstance(module, str):
            module = type(obj).__module__
        self.packages.add(module.partition(".")[0])
        return NotImplemented  # pickled as usual


def _portable_pickle(obj: Any, packages: set[str] | None = None) -> bytes | None:
    """``obj`` pickled as multiprocessing's ``ForkingPickler`` would, if any number of processes can
    load that one pickle; ``None`` otherwise (a tensor, queue, lock, socket, connection inside, or
    anything that does not pickle outside a process start: it is then sent as usual, where any
    real error is reported). The top-level packages of the classes and functions in it are added
    to ``packages``, if given."""
    buf = io.BytesIO()
    table = dict(multiprocessing.reduction.ForkingPickler(io.BytesIO()).dispatch_table)
    for cls, reducer in table.items():
        if copyreg.dispatch_table.get(cls) is not reducer and not issubclass(cls, _PURE_REDUCTIONS):
            table[cls] = _process_bound
    pickler = (
        pickle.Pickler(buf, pickle.HIGHEST_PROTOCOL) if packages is None else _NotingPickler(buf, packages)
    )
    pickler.dispatch_table = table
    try:
        pickler.dump(obj)
    except Exception:  # noqa: BLE001 - any failure: the usual per-worker pickling decides
        return None
    return buf.getvalue()


#: Packages a forkserver imports before it forks workers (:func:`preload_forkserver`) when what
#: the workers are sent refers to them; only libraries whose import has no effect on the process
#: beyond loading them (never the user's own modules, whose import may do anything).
PRELOADABLE = ("torch", "torchvision", "numpy", "PIL", "fastload")


def main_module_packages() -> set[str]:
    """The top-level packages the main module's globals refer to (modules it imported, and the
    classes and functions it imported from them)."""
    main = sys.modules.get("__main__")
    found = set()
    for value in list(getattr(main, "__dict__", {}).values()):
        name = value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", None)
        if isinstance(name, str):
            found.add(name.partition(".")[0])
    return found


def preload_forkserver(context: Any, packages: set[str]) -> list[str] | None:
    """Before the first forkserver worker starts: has the forkserver import ``torch``, ``fastload``
    and those of :data:`PRELOADABLE` that ``packages`` or the main module refer to and that are
    imported here, besides what it preloads already. Each worker then forks from a process that
    has them instead of importing them itself (``import torch`` and ``import torchvision`` take
    seconds each).

    Why the main module's: a forkserver worker runs the main module again as it starts, as a
    spawned one does (Python 3.11's forkserver does not preload ``__main__``, although its default
    preload list names it: the start data it reads lacks the main module's path), so a script
    that imports torch and torchvision at the top has each worker import them again, unless the
    forkserver has them already.

    Returns the new preload list, or ``None`` when nothing changed (another start method, or the
    forkserver runs already: it reads the list once, when it starts)."""
    if start_method(context) != "forkserver":
        return None
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    if server is None or getattr(server, "_forkserver_pid", None) is not None:
        return None
    current = list(getattr(server, "_preload_modules", ["__main__"]))
    wanted = {"torch", "fastload"} | ((packages | main_module_packages()) & set(PRELOADABLE))
    added = [name for name in PRELOADABLE if name in wanted and name in sys.modules and name not in current]
    if not added:
        return None
    forkserver.set_forkserver_preload(current + added)
    return current + added


def _anonymous_file(data: bytes) -> int:
    """A file descriptor of a new file holding ``data`` that has no name (a memfd on Linux, else an
    unlinked temporary file): the kernel frees it when the last descriptor to it is closed."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("fastload-dataset", os.MFD_CLOEXEC)
    else:  # pragma: no cover - macOS and other POSIX systems
        with tempfile.TemporaryFile() as f:
            fd = os.dup(f.fileno())
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except BaseException:
        os.close(fd)
        raise
    return fd


def _same(obj: Any) -> Any:
    return obj


def _receive_dataset(inherited: Any, size: int) -> Any:
    """In a worker, while its process object is unpickled: the dataset from the shipped file."""
    fd = inherited.detach()
    try:
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as data:
            return pickle.loads(data)
    finally:
        os.close(fd)


class ShippedDataset:
    """A dataset pickled once, for the spawn/forkserver workers started while this object is open.

    A spawned worker receives its process object (target, arguments, the dataset among them)
    through a pipe. ``Process.start()`` writes it in one go, and a pipe holds 64 KiB: with a larger
    dataset the write returns only once the new interpreter has read nearly all of it, which it
    does after importing the main module and, while unpickling, torch (the worker function comes
    first). So each ``start()`` waits for that worker's imports and the workers start one after
    another: 2 workers with a 1.28M-sample index took 5 s each. Pickled as this object, a worker's
    process object is a few hundred bytes, ``start()`` returns at once, and the workers' imports
    run side by side. In each worker it unpickles to the dataset itself (the same as sending
    the dataset: every worker gets its own copy, ``get_worker_info().dataset`` is the dataset).

    The pickle lives in an anonymous file (:func:`_anonymous_file`) whose descriptor each worker
    inherits when it starts and closes once it has read it: :meth:`close` it right after the
    workers started. The kernel frees the file when the last of them has read it (or exited):
    nothing is left in ``/dev/shm`` or elsewhere, not even after a ``SIGKILL``. Pickled outside a
    process start, or after :meth:`close`, it pickles as the dataset.
    """

    def __init__(self, dataset: Any, data: bytes) -> None:
        self.dataset = dataset
        self.nbytes = len(data)
        self._fd = _anonymous_file(data)
        self._finalizer = weakref.finalize(self, os.close, self._fd)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Closes this process's descriptor (workers started already keep theirs until they read it)."""
        self._finalizer()

    def __reduce__(self) -> tuple[Any, ...]:
        if self._finalizer.alive and multiprocessing.context.get_spawning_popen() is not None:
            # the descriptor is passed to the process being started (spawn: inherited; forkserver:
            # sent with the start request), like multiprocessing's own connections
            return _receive_dataset, (multiprocessing.reduction.DupFd(self._fd), self.nbytes)
        return _same, (self.dataset,)

    def __repr__(self) -> str:
        return f"ShippedDataset({self.dataset!r}, {self.nbytes} bytes)"


def ship_dataset(dataset: Any, context: Any, *also_sent: Any) -> ShippedDataset | None:
    """The dataset to hand to the workers about to start with ``context``: a
    :class:`ShippedDataset` when they are spawned or forkserver-started (on POSIX) and the dataset
    pickles to at least :data:`SHIP_MIN_BYTES` in one pickle any number of workers can load, else
    ``None`` (hand them ``dataset`` itself). The caller closes it once the workers started.

    Forkserver workers: the libraries the dataset and ``also_sent`` (e.g. a ``worker_init_fn``)
    refer to are preloaded by the forkserver, if it has not started yet (:func:`preload_forkserver`).
    """
    method = start_method(context)
    if os.name != "posix" or method not in ("spawn", "forkserver"):
        return None  # forked workers inherit the dataset; Windows passes handles differently
    packages: set[str] | None = set() if method == "forkserver" else None
    data = _portable_pickle(dataset, packages)
    if packages is not None:
        for obj in also_sent:
            _portable_pickle(obj, packages)
        preload_forkserver(context, packages)
    if data is None or len(data) < SHIP_MIN_BYTES:
        return None
    return ShippedDataset(dataset, data)


# --------------------------------------------------------------------------------------------
# The pool
# --------------------------------------------------------------------------------------------

_LIVE_POOLS: weakref.WeakSet[WorkerPool] = weakref.WeakSet()


@atexit.register
def _close_live_pools() -> None:
    """At interpreter exit: stop every pool still running (before multiprocessing's own hook)."""
    for pool in list(_LIVE_POOLS):
        with contextlib.suppress(Exception):
            pool.close()


class WorkerPool:
    """Workers and the shared batch slots they write into.

    Slot ownership: a slot is *free*, *busy* (a task writing into it, of whichever pass),
    *pending* (issued and not yet handed out), or *out*: handed to the consumer, as tensors over
    the slot's memory. An out slot becomes free only when no tensor, view, ``.numpy()`` array or
    autograd reference to it is left (a finalizer on the storage of the handed-out tensors says
    so), so a batch the consumer keeps is never overwritten. A consumer that keeps more than the
    usual two batches (the loop variable and the batch before it) gets *extra* slots instead,
    allocated one batch at a time and freed when released, so the decoding pipeline keeps its
    depth. A pass only takes free slots, and a slot of an abandoned pass becomes free when its
    task reports back, so no two tasks ever write into one slot.

    Args:
        dataset: Serves ``get_bytes(i)``, ``targets`` and a ``transform`` with ``decode_into``.
        sample_shape: The shape of one sample's slot: ``(H, W, 3)`` (handed out as channels-last
            NCHW) or, with ``channels_first``, ``(3, H, W)`` (handed out as contiguous NCHW).
        dtype: The slot's dtype (uint8, or float32 for a recognised torchvision pipeline).
        batch_size: Samples per slot.
        num_slots: Batch slots in the ring.
        num_workers: 0: no workers (the caller decodes with :func:`run_task`).
        kind: ``"process"`` or ``"thread"``.
        context: A multiprocessing context (process workers), or ``None`` for torch's default.
        pin: Hand out every batch in pinned memory (where memory can be pinned: with CUDA): the
            ring page-locked in place (process workers: its shared memory, locked while they start;
            thread workers and ``num_workers=0``: allocated pinned), a pinned copy otherwise.
        base_seed, skip, worker_init_fn: Passed to each worker.
        preload: Imports what decoding needs (e.g. :func:`fastload.transforms.import_decode_modules`):
            run here before process workers start (forked ones inherit the modules) and by each
            spawn/forkserver worker as it starts.
        cuda_device: The CUDA device the batches go to, where the loader knows it (the thread
            page-locking the ring runs on it); ``None``: the calling thread's current device.
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
    ) -> None:
        self.num_workers = num_workers
        self.kind = kind
        #: ``dataset.will_need(indices)``, if it has one: a read-ahead hint for each issued batch
        #: (e.g. a pack served from its map, see ``InMemoryImageFolder.will_need``).
        self.will_need: Callable[[np.ndarray], None] | None = getattr(dataset, "will_need", None)
        host = host_memory()
        self.host = host
        #: every batch handed out is in pinned memory (for asynchronous copies to a CUDA device)
        self.pin = pin and host.can_pin()
        #: process slots page-locked in place, slot by slot, while the workers start (``None``:
        #: pinned as allocated, or not pinned); see :meth:`_in_place`
        self.page_lock: PageLock | None = None
        self.warned_lock = False
        self.hwc = not channels_first
        is_process = num_workers > 0 and kind == "process"
        if is_process:  # shared with the workers; memfd-backed, so /dev/shm's size does not limit it
            self.images = shared_slots(num_slots, (batch_size, *sample_shape), dtype)  # a page each
            self.labels = shared_empty((num_slots, batch_size), torch.int64)
            if self.pin:  # cudaHostRegister: labels first, then the slots in the order they are used
                # the lock thread's: the loader's device, else the current one (as torch's pin
                # thread takes it)
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
        with frozen_heap(method), closing:
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
                    # An asynchronous copy out of it may still be queued on the device (the usual
                    # `images.cuda(non_blocking=True)` returns at once, and the batch is dropped
                    # right after): no worker writes into it before the copies queued so far are done
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
        threads as torch splits its own ops (intra-op parallelism; ``torch.set_num_threads(1)``
        keeps it in this thread). Only for fastload's own readers and transforms (no user code runs
        in those threads); the batch is the same for any number of threads."""
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
        """Whether ``slot``'s memory is pinned as it is (else :meth:`hand_out` hands out pinned
        copies): a ring slot once its page lock holds (while it is being locked, a copy), never an
        extra slot (locking one costs more than copying it: about 3.4 ms per MB, measured)."""
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
        """The first ``filled`` images (N, 3, H, W; channels-last memory for HWC slots) and labels of
        ``slot``, as tensors whose storage tells the pool when they, and everything made from them,
        are gone. With ``pin``, in pinned memory: the slot's own (page-locked), or a pinned copy
        (an extra slot, or a ring that could not be locked; the slot is then free again at once)."""
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
        """Takes back the tasks no worker has started yet (best effort) and frees their slots.

        Tasks of generation ``keep`` (an adopted epoch lookahead) are put back, in order.
        """
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
        """The next finished task's report (its slot is then no longer busy); clear errors, no hang.

        Raises:
            RuntimeError: torch's ``"DataLoader timed out after N seconds"`` when ``timeout > 0``
                passes without a report, or a worker died (named, with its exit code or signal).
        """
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
