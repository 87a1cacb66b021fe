"""The one place that knows the machine: CUDA, streams, CPUs, ranks per node, worker counts.

Every other module asks here instead of calling ``torch.cuda`` or ``os.cpu_count`` itself:

- :func:`device_is_cuda`, :func:`cuda_available`, :func:`default_device`: "is this CUDA",
  answered without creating a CUDA context (nothing here touches CUDA at import time).
- :class:`StreamBackend` and :func:`stream_backend`: the stream operations of the prefetcher;
  CUDA streams for a CUDA device, no-ops otherwise (tests inject a recording fake).
- :class:`HostMemory` and :func:`host_memory`: pinned (page-locked) host memory -- batch buffers
  page-locked in place (``cudaHostRegister``), pinned copies, "is this pinned" -- so that every
  host-to-device copy is asynchronous; :func:`register_pinned` / :func:`unregister_pinned` are its
  in-place half.
- :func:`available_cpus`: the CPUs this process may run on (its affinity mask).
- :func:`local_world_size`: the processes of this job on this machine.
- :func:`auto_num_workers`: ``num_workers="auto"``.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Iterator
from typing import Any, Protocol

import torch

__all__ = [
    "HostMemory",
    "PageLock",
    "StreamBackend",
    "auto_num_workers",
    "available_cpus",
    "cuda_available",
    "default_device",
    "device_is_cuda",
    "host_memory",
    "local_world_size",
    "register_pinned",
    "stream_backend",
    "unregister_pinned",
]

MAX_AUTO_WORKERS = 16


def device_is_cuda(device: torch.device | str | int | None) -> bool:
    """Whether ``device`` names a CUDA device (does not initialise CUDA).

    Example:
        >>> device_is_cuda("cuda:1"), device_is_cuda("cpu"), device_is_cuda(None)
        (True, False, False)
    """
    if device is None:
        return False
    if isinstance(device, int):
        return True  # torch's convention: a bare index is a CUDA ordinal
    return torch.device(device).type == "cuda"


def cuda_available() -> bool:
    """Whether a CUDA device can be used (without creating a CUDA context)."""
    return torch.cuda.is_available()


def default_device() -> torch.device:
    """The current CUDA device if CUDA is available, else the CPU."""
    if cuda_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class StreamBackend(Protocol):
    """The stream operations the prefetcher needs; :func:`stream_backend` picks the implementation."""

    is_cuda: bool

    def new_stream(self, device: torch.device) -> Any: ...
    def current_stream(self, device: torch.device) -> Any: ...
    def stream_context(self, stream: Any) -> contextlib.AbstractContextManager[Any]: ...
    def wait_stream(self, waiter: Any, waitee: Any) -> None: ...
    def wait_event(self, waiter: Any, event: Any) -> None: ...
    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None: ...
    def record_event(self, stream: Any) -> Any: ...
    def synchronize_event(self, event: Any) -> None: ...
    def to_device(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor: ...
    def is_pinned(self, tensor: torch.Tensor) -> bool: ...
    def synchronize(self, device: torch.device) -> None: ...


class _NoStreams:
    """Devices without streams (CPU, ...): every stream operation is a no-op."""

    is_cuda = False

    def new_stream(self, device: torch.device) -> None:
        return None

    def current_stream(self, device: torch.device) -> None:
        return None

    def stream_context(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def wait_stream(self, waiter: Any, waitee: Any) -> None:
        pass

    def wait_event(self, waiter: Any, event: Any) -> None:
        pass

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        pass

    def record_event(self, stream: Any) -> None:
        return None

    def synchronize_event(self, event: Any) -> None:
        pass

    def to_device(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        return tensor.to(device)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return True  # irrelevant without asynchronous copies

    def synchronize(self, device: torch.device) -> None:
        pass


class _CudaStreams:
    """CUDA streams and events. Constructing it does not touch CUDA."""

    is_cuda = True

    def new_stream(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.Stream(device=device)

    def current_stream(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.current_stream(device)

    def stream_context(self, stream: torch.cuda.Stream) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def wait_stream(self, waiter: torch.cuda.Stream, waitee: torch.cuda.Stream) -> None:
        waiter.wait_stream(waitee)

    def wait_event(self, waiter: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        waiter.wait_event(event)

    def record_stream(self, tensor: torch.Tensor, stream: torch.cuda.Stream) -> None:
        if tensor.device.type == "cuda":
            tensor.record_stream(stream)

    def record_event(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def synchronize_event(self, event: torch.cuda.Event) -> None:
        event.synchronize()

    def to_device(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        return tensor.to(device, non_blocking=True)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)


def stream_backend(device: torch.device | str | None) -> StreamBackend:
    """The stream backend for ``device``: CUDA streams for a CUDA device, no-ops otherwise (or the
    stand-ins a test installed with :func:`simulate_cuda`)."""
    if _simulated is not None:
        return _simulated[0]
    return _CudaStreams() if device_is_cuda(device) else _NoStreams()


# --------------------------------------------------------------------------------------------
# Pinned host memory
# --------------------------------------------------------------------------------------------


class HostMemory(Protocol):
    """Pinned (page-locked) host memory, the source an asynchronous host-to-device copy needs.

    :func:`host_memory` gives the one in use: CUDA's, or a test's stand-in that records what it
    pinned, so that the tests catch a pageable copy on a machine without a GPU.
    """

    def can_pin(self) -> bool:
        """Whether memory can be pinned here (a CUDA device is available)."""
        ...

    def register(self, t: torch.Tensor) -> bool:
        """Page-locks the memory of ``t`` (contiguous) in place; ``False`` if it cannot."""
        ...

    def unregister(self, t: torch.Tensor) -> None:
        """Undoes :meth:`register` (only for a tensor it returned ``True`` for)."""
        ...

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of ``t`` in pinned memory, with the same sizes and strides -- a copy also when
        ``t`` is pinned already (unlike ``Tensor.pin_memory()``, which then returns ``t``)."""
        ...

    def is_pinned(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is in pinned memory."""
        ...

    def fence(self) -> Any:
        """A mark after every copy queued so far on the current device stream (``None``: none can
        be pending). Pinned memory that is reused -- fastload's batch buffers -- must not be
        written until the asynchronous copies out of it are done, which torch's caching pinned
        allocator ensures for its own blocks, but not for memory locked in place."""
        ...

    def done(self, fence: Any) -> bool:
        """Whether the copies before ``fence`` are done (without waiting)."""
        ...

    def wait(self, fence: Any) -> None:
        """Waits until the copies before ``fence`` are done."""
        ...


def _runtime() -> Any:
    """CUDA's runtime API as the ``cuda-bindings`` package exposes it (a dependency of torch's CUDA
    builds), or ``None``: then torch's own small binding (``torch.cuda.cudart()``) is used."""
    try:
        from cuda.bindings import runtime
    except ImportError:
        return None
    return runtime


def _status(result: Any) -> int:
    """The error code of a runtime call: cuda-bindings returns ``(code, ...)``, torch's the code."""
    code: Any = result[0] if isinstance(result, tuple) else result
    return int(getattr(code, "value", code))


#: ``cudaHostRegisterPortable``: the memory is pinned for every CUDA context, not only the caller's.
_REGISTER_PORTABLE = 1


class _CudaHost:  # pragma: no cover - needs CUDA (the tests use a recording stand-in)
    """CUDA's pinned memory: ``cudaHostRegister`` in place, ``Tensor.pin_memory()`` copies.

    A failed runtime call leaves its error as the runtime's "last error", which the next kernel
    launch of torch would report as its own ("CUDA error: invalid argument"); it is read and
    cleared at once here.
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
        # Always a copy: ``t.pin_memory()`` returns ``t`` itself when it is pinned already -- a
        # view of a page-locked batch buffer, which the pool hands back to the workers next
        if 0 in t.stride():
            return t.contiguous().pin_memory() if not t.is_pinned() else t.clone().pin_memory()
        out = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, pin_memory=True)
        return out.copy_(t)

    def is_pinned(self, t: torch.Tensor) -> bool:
        return bool(t.is_pinned())

    def fence(self) -> Any:
        if not torch.cuda.is_initialized():
            return None  # nothing was ever queued on a device
        event = torch.cuda.Event()
        event.record()  # the current device's current stream: where `tensor.cuda()` copies
        return event

    def done(self, fence: Any) -> bool:
        return fence is None or bool(fence.query())

    def wait(self, fence: Any) -> None:
        if fence is not None:
            fence.synchronize()


_CUDA_HOST = _CudaHost()
_simulated: tuple[StreamBackend, HostMemory] | None = None


def host_memory() -> HostMemory:
    """The pinned host memory in use: CUDA's (or a test's stand-in, see :func:`simulate_cuda`)."""
    return _simulated[1] if _simulated is not None else _CUDA_HOST


@contextlib.contextmanager
def simulate_cuda(streams: StreamBackend, host: HostMemory) -> Iterator[None]:
    """For tests on a machine without a GPU: inside the block every prefetcher and loader created
    uses ``streams`` for its stream operations (whatever its device) and ``host`` for pinned
    memory, so a test sees each copy and whether its source was pinned."""
    global _simulated
    saved, _simulated = _simulated, (streams, host)
    try:
        yield
    finally:
        _simulated = saved


class PageLock:
    """Page-locks the memory of each of ``tensors`` in place (:meth:`HostMemory.register`), in
    order, in a background thread: a batch ring is locked while the workers start and decode, and
    the consumer waits only for the slot it hands out (:meth:`wait`). Measured on an H200 machine:
    130 ms for one 38.5 MB slot, so a 30-slot ring of float32 batches of 256 (4.6 GB) takes 16 s
    to lock in all, and the first batch would wait that long for a lock of the whole ring. A
    consumer that cannot wait copies instead: :meth:`ready` says without waiting.

    Each tensor must be contiguous and start on a page of its own (see
    :func:`fastload._shm.shared_slots`): two locks must not share a page. A tensor that cannot be
    locked (or an error) ends the locking there: the later ones are not tried. The thread runs on
    CUDA device ``device`` (the loader's; a new thread would start on device 0, and make a context
    there in every rank), and the memory is locked for every device (``cudaHostRegisterPortable``).
    The locks are undone by :meth:`release` or when this object is garbage-collected (never at
    interpreter exit, nor in a forked child: the system frees them with the process), which also
    cancels the locks not made yet; the tensors stay referenced until then, so their memory is not
    unmapped while it is locked.
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

    def undo(self) -> None:
        with self.progress:
            self.cancelled = True  # the locks not made yet are not made
            if threading.current_thread() is not self.thread:
                self.progress.wait_for(lambda: self.tried >= self.count)
        for t in list(self.locked):
            self.host.unregister(t)
        self.locked.clear()


def use_device(index: int) -> None:
    """Makes CUDA device ``index`` the calling thread's current device (a thread starts on 0)."""
    torch.cuda.set_device(index)


def pinned_device(device: torch.device) -> torch.device:
    """``device`` with its index: ``cuda`` becomes the calling thread's current device (another
    thread would take ``cuda`` as device 0, whatever ``torch.cuda.set_device`` this one did)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def current_cuda_device() -> int | None:
    """The calling thread's current CUDA device (creating CUDA's context there, as torch's own
    pin-memory thread does), or ``None`` without CUDA."""
    return torch.cuda.current_device() if cuda_available() else None


def register_pinned(t: torch.Tensor) -> bool:
    """Page-locks ``t``'s memory in place (``cudaHostRegister``) so H2D copies from it are async.

    Returns ``False`` (and changes nothing) when it cannot be done.
    """
    return host_memory().register(t)


def unregister_pinned(t: torch.Tensor) -> None:
    """Undoes :func:`register_pinned` (call it only where that returned ``True``)."""
    host_memory().unregister(t)


# --------------------------------------------------------------------------------------------
# CPUs, ranks per machine, workers
# --------------------------------------------------------------------------------------------


def available_cpus() -> int:
    """The CPUs this process may run on: its affinity mask (``taskset``, Slurm, containers).

    Example: a 64-core machine where Slurm gave the job cores 0-7 -> 8 (``os.cpu_count()``
    would say 64).
    """
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - macOS, Windows
        return os.cpu_count() or 1


def _positive_env(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} should be a positive integer, but got {name}={raw!r}") from None
    if value <= 0:
        raise ValueError(f"{name} should be a positive integer, but got {name}={raw!r}")
    return value


def local_world_size() -> int:
    """The processes of this job on this machine (they share its CPUs).

    The first of: ``LOCAL_WORLD_SIZE`` (torchrun, Lightning, Accelerate), ``SLURM_NTASKS_PER_NODE``,
    the initialized process group's size, ``WORLD_SIZE`` -- a job that says only how many
    processes it has in all is taken to run on one machine, which never oversubscribes the CPUs
    -- else 1. Example: ``torchrun --nnodes 2 --nproc-per-node 4`` sets ``LOCAL_WORLD_SIZE=4``
    -> 4; only ``WORLD_SIZE=8`` -> 8; nothing set -> 1.

    Raises:
        ValueError: If one of those variables is set to something other than a positive integer.
    """
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = _positive_env(name)
        if value is not None:
            return value
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    value = _positive_env("WORLD_SIZE")
    return 1 if value is None else value


def auto_num_workers() -> int:
    """``num_workers="auto"``: this process's share of the CPUs, at least 1 and at most 16.

    Example: 2 CPUs, no torchrun -> 2; 32 CPUs and ``torchrun --nproc-per-node 8`` -> 4.
    """
    return max(1, min(MAX_AUTO_WORKERS, available_cpus() // local_world_size()))
