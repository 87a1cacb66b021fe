"""The fast path's workers: the loop each one runs and the messages it sends and receives.

The shape of torch's ``torch/utils/data/_utils/worker.py``, for fastload's shared batch slots::

    main process (fastload._pool.WorkerPool)      worker (process or thread): worker_loop()
    tasks.put(Task(batch k, slot s, indices)) ──> run_task: decode each sample into slots[s]
    results.get() <── BatchDone(k, s, filled)     (or BatchFailed(k, s, error, traceback))

The pool that starts these workers and owns the slots is :mod:`fastload._pool`; with
``num_workers=0`` it runs :func:`run_task` (or :func:`run_task_split`) in the calling process.
A process worker never outlives the process that started it (``PR_SET_PDEATHSIG`` on Linux, and a
watchdog within ``WATCHDOG_SECONDS``), resets the Python signal handlers it inherited and ignores
``SIGINT``: a Ctrl-C reaches every process of the group, and only the main process decides.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import os
import pickle
import queue
import signal
import sys
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from . import rng
from ._torchworkers import seed_as_torch
from .decode import DecodeError

WATCHDOG_SECONDS = 2.0


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


def describe_sample(dataset: Any, i: int) -> str:
    """How error messages name sample ``i``: the dataset's ``describe(i)`` (its file), else its index."""
    describe = getattr(dataset, "describe", None)
    return describe(i) if callable(describe) else f"sample {i}"


def run_task(
    dataset: Any, task: Task, out: np.ndarray, lab: np.ndarray, skip: bool
) -> tuple[int, list[tuple[int, str]]]:
    """Decodes the samples of ``task`` into its slot's arrays ``out`` (N, H, W, 3) and ``lab`` (N,);
    returns ``(filled, skipped)``: ``(index, reason)`` of those left out (``skip``)."""
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
    """:func:`run_task` with the samples decoded by ``parts`` threads of ``threads``: the same result,
    errors raised in batch order as the serial loop raises them; the labels (and a user's
    ``target_transform``) computed in the calling thread."""
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


_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Linux: the kernel sends SIGKILL to this process when the thread that forked it ends (set
    only when the pool was started from the main thread; the watchdog covers the rest)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _reset_signal_handlers() -> None:
    """Drops the Python signal handlers inherited from the parent (fork) and the ignored SIGTERM;
    ignores ``SIGINT`` (Ctrl-C is for the main process)."""
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
        except (ProcessLookupError, PermissionError):  # gone, or its pid reused by another user
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
        seed_as_torch(args.base_seed, args.worker_id)
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
