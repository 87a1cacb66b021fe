"""What fastload adds to torch's worker processes (the paths that run torch's iterator).

- :func:`reporting_context`: a multiprocessing context whose queues turn a batch a worker cannot
  pickle into an error for that batch (:class:`UnsendableBatchError`), not a hang.
- :class:`TorchWorkerInit`: the ``worker_init_fn`` fastload gives torch's workers around the
  user's: batches sent without ``/dev/shm``, streamed batches and reused segments
  (:mod:`fastload._stream`), and the idle trim (memory back to the system while a worker idles).
- :func:`seed_as_torch`: a worker's global RNGs seeded as torch seeds a new worker (also
  fastload's own workers, :mod:`fastload._worker`).
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
from torch.utils.data._utils.worker import _generate_state  # numpy's seed in torch's workers

from ._shm import send_through_memfd
from ._stream import drop_idle_ring, enable_ring
from ._stream import enable as enable_streaming
from ._workerstart import start_method


class UnsendableBatchError(RuntimeError):
    """A torch worker could not send a batch to the main process (it cannot be pickled)."""


class ReportingQueue(multiprocessing.queues.Queue):
    """A multiprocessing queue that sends a worker's ``(batch number, batch)`` it cannot pickle as
    that batch's error (multiprocessing prints it and drops the batch: torch's iterator hangs)."""

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
    if context is None or isinstance(context, str):
        name = start_method(context)
    elif type(context) in {type(multiprocessing.get_context(m)) for m in _REPORTING}:
        name = context.get_start_method()
    else:
        return context  # the user's own context class: leave it alone
    cls = _REPORTING.get(name)
    return context if cls is None else cls()


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
    """A torch worker's daemon thread: each time the worker goes idle (under 1% of a CPU over
    ``period`` seconds, after having worked), drops its free reused batch segments and trims."""
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


def seed_as_torch(base_seed: int, worker_id: int) -> None:
    """Seeds this process's global RNGs (Python's ``random``, torch's, numpy's) as torch's worker
    loop seeds a new worker of a pass whose base seed is ``base_seed``."""
    random.seed(base_seed + worker_id)
    torch.manual_seed(base_seed + worker_id)
    np.random.seed(_generate_state(base_seed, worker_id))


@dataclass(frozen=True)
class TorchWorkerInit:
    """The ``worker_init_fn`` of torch's worker processes started by ``fastload.DataLoader``: turns
    on streamed batches (``stream``, :func:`fastload._stream.enable`) or a user's collate's reused
    segments (``ring``), starts the idle check, then runs the user's ``worker_init_fn``.

    Why the idle trim: torch's worker collates a batch from per-sample tensors (38.5 MB at 256 of
    224 px) that glibc's malloc keeps in the heap for as long as the worker lives, also while it
    idles; ``malloc_trim(0)`` after :data:`IDLE_TRIM_SECONDS` idle gives it back. ``trim``: only
    where fastload runs every op in the worker (no allocator change in a process running user code).
    """

    user_fn: Callable[[int], None] | None
    stream: bool = False
    ring: torch.Tensor | None = field(default=None, compare=False)
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
