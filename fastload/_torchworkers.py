"""What fastload adds to torch's worker processes (the paths that run torch's iterator).

- :func:`reporting_context`: a multiprocessing context whose queues turn a batch a worker cannot
  pickle into an error for that batch (:class:`UnsendableBatchError`), not a hang.
- :class:`TorchWorkerInit`: the ``worker_init_fn`` fastload gives torch's workers around the
  user's: batches sent without ``/dev/shm``, streamed batches and reused segments
  (:mod:`fastload._stream`), and the idle trim (memory back to the system while a worker idles).
- :func:`seed_as_torch`: a worker's global RNGs seeded as torch seeds a new worker (fastload's
  default persistent workers at each pass: :class:`fastload._torchpath.PassSeeded`).
- :func:`numpy_seed`: the seed torch's workers give numpy, which fastload's own workers
  (:mod:`fastload._worker`) take too.

How these workers are started (heap frozen at a fork, dataset shipped once to spawned ones) is
:mod:`fastload._workerstart`'s.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import multiprocessing.context
import multiprocessing.queues
import random
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch._utils import ExceptionWrapper  # what torch's iterator re-raises for a batch

from ._shm import send_through_memfd
from ._stream import drop_idle_ring, enable_ring
from ._stream import enable as enable_streaming

__all__ = [
    "IDLE_TRIM_SECONDS",
    "ReportingQueue",
    "TorchWorkerInit",
    "UnsendableBatchError",
    "numpy_seed",
    "reporting_context",
    "seed_as_torch",
]


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


# --------------------------------------------------------------------------------------------
# torch's workers: seeded as torch seeds them (also fastload's own workers' global RNGs)
# --------------------------------------------------------------------------------------------


def numpy_seed(base_seed: int, worker_id: int) -> Any:
    """The seed torch's workers give numpy's global RNG (torch's own function where it has it)."""
    try:
        from torch.utils.data._utils.worker import _generate_state
    except ImportError:  # pragma: no cover - torch before 1.9
        return (base_seed + worker_id) % 2**32
    return _generate_state(base_seed, worker_id)


def seed_as_torch(base_seed: int, worker_id: int) -> None:
    """Seeds this process's global RNGs (Python's ``random``, torch's, numpy's) as torch's worker
    loop seeds a new worker of a pass whose base seed is ``base_seed``."""
    random.seed(base_seed + worker_id)
    torch.manual_seed(base_seed + worker_id)
    np.random.seed(numpy_seed(base_seed, worker_id))


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
    #: Whether the idle check also gives the heap's free memory back (``malloc_trim``): only where
    #: fastload runs every op in the worker (no allocator change in a process running user code).
    trim: bool = False

    def __call__(self, worker_id: int) -> None:
        send_through_memfd()  # batches this worker sends never need /dev/shm (fastload._shm)
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
