"""Stream operations for a device (:class:`StreamBackend`, :func:`stream_backend`: CUDA streams,
or no-ops; tests install a recording fake with :func:`simulate_cuda`), and which CUDA device a
thread works on (:func:`use_device`, :func:`pinned_device`, :func:`current_cuda_device`: a new
thread starts on device 0). Nothing here touches CUDA at import time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from ..device import cuda_available, device_is_cuda

__all__ = ["StreamBackend", "current_cuda_device", "pinned_device", "stream_backend", "use_device"]

#: ``(streams, host memory)`` a test installed with :func:`simulate_cuda`, else ``None``.
_simulated: tuple[StreamBackend, Any] | None = None


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
    """Devices without streams (CPU, ...): every stream operation is a no-op (``...``: ``None``)."""

    is_cuda = False

    def new_stream(self, device: torch.device) -> None: ...
    def current_stream(self, device: torch.device) -> None: ...
    def wait_stream(self, waiter: Any, waitee: Any) -> None: ...
    def wait_event(self, waiter: Any, event: Any) -> None: ...
    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None: ...
    def record_event(self, stream: Any) -> None: ...
    def synchronize_event(self, event: Any) -> None: ...
    def synchronize(self, device: torch.device) -> None: ...

    def stream_context(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def to_device(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        return tensor.to(device)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return True  # irrelevant without asynchronous copies


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
        # blocking: a waiting thread sleeps instead of spinning a CPU the hybrid workers decode on
        event = torch.cuda.Event(blocking=True)
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
    """CUDA streams for a CUDA device, no-ops otherwise (or :func:`simulate_cuda`'s stand-ins)."""
    if _simulated is not None:
        return _simulated[0]
    return _CudaStreams() if device_is_cuda(device) else _NoStreams()


@contextlib.contextmanager
def simulate_cuda(streams: StreamBackend, host: Any) -> Iterator[None]:
    """For tests without a GPU: inside the block, ``streams`` and ``host`` (pinned memory) stand in."""
    global _simulated
    saved, _simulated = _simulated, (streams, host)
    try:
        yield
    finally:
        _simulated = saved


def use_device(index: int) -> None:
    """Makes CUDA device ``index`` the calling thread's current device (a thread starts on 0)."""
    torch.cuda.set_device(index)


def pinned_device(device: torch.device) -> torch.device:
    """``device`` with its index: ``cuda`` becomes the calling thread's current device (another
    thread would take ``cuda`` as device 0)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def current_cuda_device() -> int | None:
    """The calling thread's current CUDA device (creating CUDA's context there, as torch's own
    pin-memory thread does), or ``None`` without CUDA."""
    return torch.cuda.current_device() if cuda_available() else None
