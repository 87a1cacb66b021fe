"""The one place that knows the machine: CUDA, streams, CPUs, ranks per node, worker counts.

Every other module asks here instead of calling ``torch.cuda`` or ``os.cpu_count`` itself:

- :func:`device_is_cuda`, :func:`cuda_available`, :func:`default_device`: "is this CUDA",
  answered without creating a CUDA context (nothing here touches CUDA at import time).
- :class:`StreamBackend` and :func:`stream_backend`: the stream operations of the prefetcher;
  CUDA streams for a CUDA device, no-ops otherwise (tests inject a recording fake).
- :func:`register_pinned` / :func:`unregister_pinned`: page-lock shared memory in place.
- :func:`available_cpus`: the CPUs this process may run on (its affinity mask).
- :func:`local_world_size`: the processes of this job on this machine.
- :func:`auto_num_workers`: ``num_workers="auto"``.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Protocol

import torch

__all__ = [
    "StreamBackend",
    "auto_num_workers",
    "available_cpus",
    "cuda_available",
    "default_device",
    "device_is_cuda",
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
    """The stream backend for ``device``: CUDA streams for a CUDA device, no-ops otherwise."""
    return _CudaStreams() if device_is_cuda(device) else _NoStreams()


def register_pinned(t: torch.Tensor) -> bool:  # pragma: no cover - needs CUDA
    """Page-locks ``t``'s memory in place (``cudaHostRegister``) so H2D copies from it are async.

    Returns ``False`` (and changes nothing) when CUDA cannot do it.
    """
    try:
        err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    except (RuntimeError, AttributeError):
        return False
    return int(getattr(err, "value", err)) == 0


def unregister_pinned(t: torch.Tensor) -> None:  # pragma: no cover - needs CUDA
    """Undoes :func:`register_pinned`."""
    with contextlib.suppress(RuntimeError, AttributeError):
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


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
