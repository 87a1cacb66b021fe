"""Stand-ins for CUDA on a machine without a GPU: pinned host memory that remembers what it pinned,
and stream operations that record every host-to-device copy and whether its source was pinned.

Installed with :func:`fastload.gpu.streams.simulate_cuda`, they let a CPU test fail on a pageable copy
anywhere on a loader's path to the device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


class FakeHost:
    """``HostMemory`` on the CPU: ``pin`` copies (keeping sizes and strides), ``register`` locks in
    place; both remember the address ranges, which ``is_pinned`` checks. ``register_ok=False``:
    locking in place fails, as ``cudaHostRegister`` can."""

    def __init__(self, register_ok: bool = True, hold_fences: bool = False) -> None:
        self.register_ok = register_ok
        self.hold_fences = hold_fences
        self.fences_made = 0
        self.released_to = 0
        self.waited: list[int] = []
        self.ranges: list[tuple[int, int]] = []
        self.kept: list[Any] = []  # pinned storages stay alive: their addresses are not reused
        self.registered: list[int] = []
        self.unregistered: list[int] = []
        self.copies = 0

    def can_pin(self) -> bool:
        return True

    def _remember(self, t: torch.Tensor) -> None:
        assert t.is_contiguous()
        self.kept.append(t.untyped_storage())
        self.ranges.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))

    def register(self, t: torch.Tensor) -> bool:
        if not self.register_ok:
            return False
        page = 4096  # two locks never share a page (cudaHostRegister refuses the second)
        start, end = t.data_ptr() // page, (t.data_ptr() + t.numel() * t.element_size() - 1) // page
        for a, b in self.ranges:
            if a // page <= end and start <= (b - 1) // page:
                raise AssertionError("a lock shares a page with another pinned range")
        self._remember(t)
        self.registered.append(t.data_ptr())
        return True

    def unregister(self, t: torch.Tensor) -> None:
        start = t.data_ptr()
        self.unregistered.append(start)
        self.ranges = [r for r in self.ranges if r[0] != start]

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        # a new copy even of pinned memory (the contract; ``Tensor.pin_memory()`` would return a
        # pinned tensor itself, which for a view of a reused batch buffer is a batch overwritten later)
        out = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype)
        out.copy_(t)
        storage = out.untyped_storage()
        self.kept.append(storage)
        self.ranges.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
        self.copies += 1
        return out

    def is_pinned(self, t: torch.Tensor) -> bool:
        ptr = t.data_ptr()
        return t.numel() == 0 or any(a <= ptr < b for a, b in self.ranges)

    # Fences are numbered 1, 2, ...: done at once, or with ``hold_fences`` once waited for (as if
    # the device had copies queued until then); ``released_to`` is the last one done.

    def fence(self) -> int:
        self.fences_made += 1
        if not self.hold_fences:
            self.released_to = self.fences_made
        return self.fences_made

    def done(self, fence: int) -> bool:
        return fence <= self.released_to

    def wait(self, fence: int) -> None:
        self.waited.append(fence)
        self.released_to = max(self.released_to, fence)


class CopyRecorder:
    """A ``StreamBackend`` whose every stream operation is a no-op and which records each copy to
    the device: ``(shape, dtype, source pinned)``."""

    is_cuda = True  # the prefetcher checks (and warns about) pageable sources, as on a GPU

    def __init__(self, host: FakeHost) -> None:
        self.host = host
        self.copies: list[tuple[tuple[int, ...], torch.dtype, bool]] = []
        self.events = 0
        self.waited_events: list[tuple[Any, int]] = []

    def new_stream(self, device: torch.device) -> Any:
        return "side"

    def current_stream(self, device: torch.device) -> Any:
        return "consumer"

    def stream_context(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def wait_stream(self, waiter: Any, waitee: Any) -> None:
        pass

    def wait_event(self, waiter: Any, event: Any) -> None:
        self.waited_events.append((waiter, event))

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        pass

    def record_event(self, stream: Any) -> int:
        self.events += 1
        return self.events

    def synchronize_event(self, event: Any) -> None:
        pass

    def to_device(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        self.copies.append((tuple(tensor.shape), tensor.dtype, self.host.is_pinned(tensor)))
        return tensor.clone()

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return self.host.is_pinned(tensor)

    def synchronize(self, device: torch.device) -> None:
        pass

    def pageable(self) -> list[tuple[tuple[int, ...], torch.dtype, bool]]:
        """The copies whose source was not pinned."""
        return [c for c in self.copies if not c[2]]


@contextlib.contextmanager
def fake_cuda(register_ok: bool = True, hold_fences: bool = False) -> Iterator[tuple[CopyRecorder, FakeHost]]:
    """Inside the block, loaders and prefetchers use the stand-ins (see the module docs)."""
    from fastload.gpu.streams import simulate_cuda

    host = FakeHost(register_ok, hold_fences)
    streams = CopyRecorder(host)
    with simulate_cuda(streams, host):
        yield streams, host
