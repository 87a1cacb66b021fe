"""Pinned (page-locked) host memory, the source an asynchronous host-to-device copy needs:
:func:`host_memory` (locks in place, pinned copies) and :class:`PageLock` (a ring of buffers locked
one by one in a background thread). Nothing here touches CUDA at import time.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Protocol

import torch

from .._exit import stop_at_exit
from ..device import cuda_available
from . import streams
from .streams import use_device

__all__ = ["HostMemory", "PageLock", "host_memory"]


class HostMemory(Protocol):
    """Pinned host memory; :func:`host_memory` gives the one in use (CUDA's, or a test's stand-in).

    ``register`` page-locks a contiguous tensor in place (``False``: it cannot); ``pin`` copies into
    pinned memory with the same sizes and strides (also a pinned tensor); ``fence`` marks every copy
    queued so far on each device's current stream (``None``: none can be pending), which ``done``
    and ``wait`` ask about: memory locked in place is rewritten only after it.
    """

    def can_pin(self) -> bool: ...
    def register(self, t: torch.Tensor) -> bool: ...
    def unregister(self, t: torch.Tensor) -> None: ...
    def pin(self, t: torch.Tensor) -> torch.Tensor: ...
    def is_pinned(self, t: torch.Tensor) -> bool: ...
    def fence(self) -> Any: ...
    def done(self, fence: Any) -> bool: ...
    def wait(self, fence: Any) -> None: ...


def _runtime() -> Any:
    """CUDA's runtime API from ``cuda-bindings``, or ``None`` (``torch.cuda.cudart()`` then)."""
    try:
        from cuda.bindings import runtime
    except ImportError:
        return None
    return runtime


def _status(result: Any) -> int:
    """The error code of a runtime call: cuda-bindings returns ``(code, ...)``, torch's the code."""
    code: Any = result[0] if isinstance(result, tuple) else result
    return int(getattr(code, "value", code))


_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, not only the caller's


class _CudaHost:  # pragma: no cover - needs CUDA (the tests use a recording stand-in)
    """CUDA's pinned memory: ``cudaHostRegister`` in place, ``Tensor.pin_memory()`` copies.

    A failed runtime call's "last error" is cleared at once, or torch's next launch would report it.
    """

    def can_pin(self) -> bool:
        return cuda_available()

    def _call(self, name: str, *args: Any) -> bool:
        runtime = _runtime()
        try:
            if runtime is not None:
                ok = _status(getattr(runtime, name)(*args)) == 0
                if not ok:
                    runtime.cudaGetLastError()  # clear it: it is not torch's error
                return ok
            ok = _status(getattr(torch.cuda.cudart(), name)(*args)) == 0
        except (RuntimeError, AttributeError, TypeError):
            return False
        if not ok:
            with contextlib.suppress(RuntimeError):  # torch's binding cannot clear it: a launch reads it
                torch.empty(1, device="cuda").zero_()
        return ok

    def register(self, t: torch.Tensor) -> bool:
        nbytes = t.numel() * t.element_size()
        if nbytes == 0:
            return True
        return t.is_contiguous() and self._call("cudaHostRegister", t.data_ptr(), nbytes, _REGISTER_PORTABLE)

    def unregister(self, t: torch.Tensor) -> None:
        if t.numel() > 0:
            self._call("cudaHostUnregister", t.data_ptr())

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        # always a copy: t.pin_memory() returns a pinned t itself (a view of a batch buffer)
        if 0 in t.stride():
            return t.contiguous().pin_memory() if not t.is_pinned() else t.clone().pin_memory()
        out = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, pin_memory=True)
        return out.copy_(t)

    def is_pinned(self, t: torch.Tensor) -> bool:
        return bool(t.is_pinned())

    def fence(self) -> Any:
        if not torch.cuda.is_initialized():
            return None  # nothing was ever queued on a device
        # the loop may copy to any device (`images.to(rank)` without set_device): a blocking event
        # on the current stream of every device with a context
        events = []
        for device in devices_in_use():
            event = torch.cuda.Event(blocking=True)
            event.record(torch.cuda.current_stream(device))
            events.append(event)
        return events

    def done(self, fence: Any) -> bool:
        return fence is None or all(event.query() for event in fence)

    def wait(self, fence: Any) -> None:
        for event in fence or ():
            event.synchronize()


def devices_in_use() -> list[int]:
    """The CUDA devices this process has a context on (asked without making one), or the current
    device where torch cannot say."""
    has_context = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    if has_context is None:  # pragma: no cover - torch has it from 1.x to today
        return [torch.cuda.current_device()]
    devices = [d for d in range(torch.cuda.device_count()) if has_context(d)]
    return devices or [torch.cuda.current_device()]


_CUDA_HOST = _CudaHost()


def host_memory() -> HostMemory:
    """The pinned host memory in use: CUDA's (or a test's stand-in, see :func:`simulate_cuda`)."""
    return streams._simulated[1] if streams._simulated is not None else _CUDA_HOST


class PageLock:
    """Page-locks each of ``tensors`` in place, in order, in a background thread on CUDA device
    ``device``: a batch ring is locked while the workers start, and the consumer waits only for the
    slot it hands out (:meth:`wait`), or copies where :meth:`ready` says it is not locked yet.

    Each tensor is contiguous and starts on a page of its own; one that cannot be locked ends the
    locking there. :meth:`release`, or collection (never at exit, nor in a forked child), undoes
    the locks and cancels those not made yet; the tensors stay referenced until then.
    """

    def __init__(
        self, tensors: list[torch.Tensor], host: HostMemory | None = None, device: int | None = None
    ) -> None:
        state = self._state = _LockState(host if host is not None else host_memory(), len(tensors), device)
        self._finalizer = weakref.finalize(self, state.undo)  # the state, not this object: no cycle
        self._finalizer.atexit = False
        state.thread = threading.Thread(
            target=state.run, args=(tensors,), name="fastload-pagelock", daemon=True
        )
        state.thread.start()
        stop_at_exit(state)  # a lock under way at exit is finished first, and no more are made

    def wait(self, index: int | None = None) -> bool:
        """Waits until tensor ``index`` (default: the last) was tried; whether it is locked."""
        state = self._state
        index = state.count - 1 if index is None else index
        with state.progress:
            state.progress.wait_for(lambda: state.tried > index)
            return state.failed is None or index < state.failed

    def ready(self, index: int) -> bool | None:
        """Without waiting: whether tensor ``index`` is locked (``None``: not tried yet)."""
        state = self._state
        with state.progress:
            if state.tried <= index:
                return None
            return state.failed is None or index < state.failed

    def release(self) -> None:
        """Unlocks what was locked (waits for the locking thread first)."""
        self._finalizer()


class _LockState:
    """What :class:`PageLock`'s thread and its finalizer share."""

    def __init__(self, host: HostMemory, count: int, device: int | None) -> None:
        self.host = host
        self.count = count
        self.device = device
        self.progress = threading.Condition()
        self.tried = 0  # tensors tried so far (all of them once one failed, or once cancelled)
        self.failed: int | None = None  # the index of the first tensor not locked
        self.cancelled = False
        self.locked: list[torch.Tensor] = []
        self.thread: threading.Thread | None = None

    def run(self, tensors: list[torch.Tensor]) -> None:
        k = 0
        try:
            if self.device is not None:
                use_device(self.device)  # this thread's current device: the one the loader's runs on
            for k, t in enumerate(tensors):
                try:
                    ok = not self.cancelled and self.host.register(t)
                except Exception:  # noqa: BLE001 - a lock that fails is said by the pool, once
                    ok = False
                if not ok:
                    break
                with self.progress:
                    self.locked.append(t)
                    self.tried = k + 1
                    self.progress.notify_all()
            else:
                return
        finally:
            with self.progress:  # whatever happened (a refusal, an error, a cancel): nothing more comes
                if self.tried < self.count:
                    self.failed = min(k, self.tried) if self.failed is None else self.failed
                    self.tried = self.count
                self.progress.notify_all()

    def stop_for_exit(self) -> threading.Thread | None:
        """At interpreter exit: no more locks, without waiting; returns the thread."""
        with self.progress:
            self.cancelled = True
        return self.thread

    def undo(self) -> None:
        with self.progress:
            self.cancelled = True  # the locks not made yet are not made
            if threading.current_thread() is not self.thread:
                self.progress.wait_for(lambda: self.tried >= self.count)
        for t in list(self.locked):
            self.host.unregister(t)
        self.locked.clear()
