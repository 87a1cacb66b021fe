"""The device feeder: a batch's device work in a thread and CUDA stream of its own, ``depth``
batches ahead, not in the training thread, whose kernel launches it would wait for::

    feeder thread (stream S)                          training thread (stream C)
    for k in start..n-1:                              next():
        batch_k = prepare(k)     # queued on S           take (k, batch_k, event_k)   # queue.get
        event_k = record(S)                              C.wait_event(event_k)        # no host wait
        queue.put(k, batch_k, event_k)  # blocks at depth  batch_k.record_stream(C)
                                                         return batch_k

Device memory: ``depth + 2`` batches at most, plus the one a ``for`` loop's variables still name.
An error preparing batch ``k`` is raised by its ``next()``, and the next ``next()`` returns batch
``k + 1`` (torch's contract).
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

from .._exit import stop_at_exit
from ..batch import iter_tensors
from .streams import StreamBackend, pinned_device, stream_backend, use_device

__all__ = ["DeviceFeeder"]


class _Stop:
    """Put in the queue when the feeder thread ends (``error``: why it could not go on)."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error


class DeviceFeeder:
    """Prepares batches ``start .. n - 1`` (``n=None``: until ``StopIteration``) with ``prepare(k)``
    (its device work queued on the current stream, the feeder's) in a thread; hands them out in
    order. ``timeout``: seconds ``next()`` waits for a batch (0: forever)."""

    def __init__(
        self,
        prepare: Callable[[int], Any],
        n: int | None,
        start: int,
        device: torch.device,
        depth: int = 2,
        backend: StreamBackend | None = None,
        timeout: float = 0,
    ) -> None:
        if depth < 1:
            raise ValueError(f"depth should be a positive integer, but got depth={depth}")
        self.n = n
        self.next_batch = start
        self.device = device = pinned_device(device)  # the thread's current device: this one
        self.timeout = timeout
        self._ended = False
        self._backend = backend if backend is not None else stream_backend(device)
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(prepare, start), name="fastload-feeder", daemon=True
        )
        self._thread.start()
        stop_at_exit(self)  # a pass left open at exit: the thread stops before the interpreter ends

    def _put(self, item: Any) -> bool:
        """Queues ``item`` unless stopped meanwhile; whether it was queued."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, prepare: Callable[[int], Any], start: int) -> None:
        backend = self._backend
        try:
            if self.device.type == "cuda":  # a new thread starts on device 0
                use_device(self.device.index or 0)
            side = backend.new_stream(self.device)
            with backend.stream_context(side):
                for k in range(start, self.n) if self.n is not None else itertools.count(start):
                    if self._stop.is_set():
                        return
                    try:
                        batch = prepare(k)
                        item: Any = (k, batch, backend.record_event(side), None)
                    except StopIteration:
                        break
                    except Exception as error:  # noqa: BLE001 - raised by the next() of batch k
                        item = (k, None, None, error)
                    if not self._put(item):
                        return
        except BaseException as error:  # noqa: BLE001 - the stream itself failed: said by next()
            self._put(_Stop(error))
            return
        self._put(_Stop())

    def __iter__(self) -> DeviceFeeder:
        return self

    def __len__(self) -> int:
        if self.n is None:
            raise TypeError("this feeder's pass has no len()")
        return self.n

    def _take(self) -> Any:
        waited = 0.0
        while True:
            try:
                return self._queue.get(timeout=0.1)
            except queue.Empty:
                waited += 0.1
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("the device feeder thread ended unexpectedly") from None
                if self.timeout and waited >= self.timeout:
                    raise RuntimeError(f"DataLoader timed out after {self.timeout:g} seconds") from None

    def __next__(self) -> Any:
        if self._ended or (self.n is not None and self.next_batch >= self.n):
            raise StopIteration
        item = self._take()
        if isinstance(item, _Stop):
            self._ended = True
            if item.error is not None:
                raise item.error
            raise StopIteration
        k, batch, event, error = item
        self.next_batch = k + 1
        if error is not None:
            raise error
        backend = self._backend
        consumer = backend.current_stream(self.device)
        backend.wait_event(consumer, event)
        for tensor in iter_tensors(batch):
            backend.record_stream(tensor, consumer)
        return batch

    def close(self) -> None:
        """Stops the thread (after the batch it is preparing) and drops what it had made."""
        self._stop.set()
        self._drop_queued()
        if threading.current_thread() is not self._thread:  # (a collection may run it there)
            self._thread.join(timeout=30)
            self._drop_queued()  # a put that was waiting for room took the room the first drop made

    def _drop_queued(self) -> None:
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break

    def stop_for_exit(self) -> threading.Thread:
        """At interpreter exit: stops the thread after its batch, without waiting; returns the thread."""
        self._stop.set()
        return self._thread
