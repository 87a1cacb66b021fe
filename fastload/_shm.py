"""Shared memory that a container's small ``/dev/shm`` does not limit.

Docker and Kubernetes give a container a 64 MB ``/dev/shm`` unless told otherwise. torch puts every
tensor it shares between processes there (``share_memory_()``, the batches its workers send), so a
loader whose batches are larger fails with "unable to allocate shared memory(shm) ... No space
left on device", or with a bus error when a page cannot be backed.

The memory fastload allocates for batches (the fast path's slots, the reused segments and tables
of torch's path, streamed batches, a ``collate_fn``'s output) is made here instead: on Linux an
anonymous ``memfd_create`` file, mapped through torch's own constructor for a storage shared by
file descriptor (the one torch's receiving side uses), so torch sends such a tensor between
processes by descriptor exactly as it sends its own, and it is freed when the last process lets go
of it, like ``/dev/shm`` segments torch unlinks. It counts against the container's memory limit, not
``/dev/shm``'s size. Elsewhere (no ``memfd_create``, or torch's ``file_system`` sharing strategy,
which shares by name) it is torch's ``share_memory_()``.

:func:`shm_error` turns the error of an allocation that still went to ``/dev/shm`` into one that
says so: the mount, its size and free space, and the fixes.
"""

from __future__ import annotations

import mmap
import os
from typing import Any

import torch

__all__ = [
    "describe",
    "memfd_available",
    "send_through_memfd",
    "shared_empty",
    "shared_slots",
    "shared_storage",
    "shm_error",
]

_FD_CONSTRUCTOR = "_new_shared_fd_cpu"  # torch >= 2.0 (reductions.rebuild_storage_fd)
_ok: bool | None = None


def memfd_available() -> bool:
    """Whether :func:`shared_storage` makes memfd-backed storages here (checked once, then per call
    for the sharing strategy, which the user may change)."""
    global _ok
    if _ok is None:
        _ok = False
        if hasattr(os, "memfd_create") and hasattr(torch.UntypedStorage, _FD_CONSTRUCTOR):
            try:
                storage = _memfd_storage(4096)
                _ok = storage.is_shared() and storage._get_shared_fd() >= 0  # type: ignore[attr-defined]
            except (OSError, RuntimeError, AttributeError):
                _ok = False
    return _ok and torch.multiprocessing.get_sharing_strategy() == "file_descriptor"


def _memfd_storage(nbytes: int) -> torch.UntypedStorage:
    fd = os.memfd_create("fastload-batch", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, max(1, nbytes))
        # torch dups the descriptor and keeps its copy (for sending); ours is closed below
        return getattr(torch.UntypedStorage, _FD_CONSTRUCTOR)(fd, max(1, nbytes))
    finally:
        os.close(fd)


def shared_storage(nbytes: int) -> torch.UntypedStorage:
    """``nbytes`` of shared memory as an untyped storage: memfd-backed where
    :func:`memfd_available`, else torch's (``/dev/shm``)."""
    if memfd_available():
        return _memfd_storage(nbytes)
    return torch.UntypedStorage._new_shared(nbytes)


def shared_empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous tensor in shared memory (see :func:`shared_storage`)."""
    shape = tuple(int(s) for s in shape)
    numel = 1
    for s in shape:
        numel *= s
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if not memfd_available():
        return torch.empty(shape, dtype=dtype).share_memory_()
    storage = _memfd_storage(numel * itemsize)
    strides, step = [], 1
    for s in reversed(shape):
        strides.append(step)
        step *= s
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape, tuple(reversed(strides)))


PAGE = mmap.PAGESIZE


def shared_slots(num_slots: int, slot_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A ``(num_slots, *slot_shape)`` tensor in shared memory (see :func:`shared_empty`) whose
    slots each start on a page of their own (the stride between slots is rounded up to whole
    pages), so that each slot can be page-locked for the GPU on its own. Example: slots of
    ``(5, 32, 32, 3)`` uint8 (15,360 bytes) lie 16,384 bytes apart."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    numel = 1
    for size in slot_shape:
        numel *= int(size)
    stride = -(-max(1, numel * itemsize) // PAGE) * PAGE  # bytes between slot starts
    storage = shared_storage(num_slots * stride)
    inner, step = [], 1
    for size in reversed(slot_shape):
        inner.append(step)
        step *= int(size)
    strides = (stride // itemsize, *reversed(inner))
    return torch.empty(0, dtype=dtype).set_(storage, 0, (num_slots, *slot_shape), strides)


_torch_reduce_storage: Any = None


def _reduce_storage(storage: Any) -> Any:
    """torch's ``reduce_storage``, but a storage in this process's own memory is sent through a
    memfd copy instead of being moved into a new ``/dev/shm`` segment (torch's way): the receiver
    maps the same kind of descriptor either way."""
    if (
        storage.device.type == "cpu"
        and storage.nbytes() > 0
        and not storage.is_shared()
        and memfd_available()
    ):
        shared = _memfd_storage(storage.nbytes())
        shared.copy_(storage)
        storage = shared
    return _torch_reduce_storage(storage)


def send_through_memfd() -> bool:
    """In this process (a worker), tensors sent to another process through ``torch.multiprocessing``
    go through memfd copies when they are not in shared memory yet (a ``collate_fn``'s output, any
    dataset's batch), not through new ``/dev/shm`` segments. ``False`` where memfds are not used."""
    global _torch_reduce_storage
    if not memfd_available():
        return False
    from multiprocessing.reduction import ForkingPickler

    from torch.multiprocessing import reductions

    if _torch_reduce_storage is None:
        _torch_reduce_storage = reductions.reduce_storage
    ForkingPickler.register(torch.UntypedStorage, _reduce_storage)
    return True


def _shm_numbers() -> tuple[int, int] | None:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def shm_error(error: BaseException, needed: int | None = None) -> RuntimeError | None:
    """A clear error for ``error`` when it is an allocation in ``/dev/shm`` that did not fit (else
    ``None``): what ``/dev/shm`` holds, what was needed (if known) and the fixes. The errors it was
    raised from count too (torch 2.1 raises "worker ... exited unexpectedly" from the
    worker's bus error)."""
    texts: list[str] = []
    cause: BaseException | None = error
    while cause is not None and len(texts) < 4:
        texts.append(str(cause))
        cause = cause.__cause__ or cause.__context__
    text = "\n".join(texts)
    if not (
        "unable to allocate shared memory" in text
        or ("No space left on device" in text and "shm" in text)
        or "bus error" in text.lower()
    ):
        return None
    numbers = _shm_numbers()
    size = "" if numbers is None else f" is {numbers[0] / 2**20:.0f} MB ({numbers[1] / 2**20:.0f} MB free)"
    need = "" if needed is None else f" A batch needs {needed / 2**20:.0f} MB."
    return RuntimeError(
        f"shared memory ran out: /dev/shm{size} and a DataLoader worker could not put a batch there "
        f"(torch shares batches through /dev/shm; containers get 64 MB unless told otherwise).{need} "
        "Fix: give the container more (docker run --shm-size=8g ...; Kubernetes: an emptyDir with "
        "medium: Memory mounted at /dev/shm), or lower batch_size / num_workers. fastload's own "
        "batch memory does not use /dev/shm: this batch was one torch allocated (a collate_fn's "
        f"small tensors, or a dataset fastload does not build in place). Original error: {_first_line(text)}"
    )


def _first_line(text: str) -> str:
    lines = [line for line in text.splitlines() if "shared memory" in line or "No space" in line]
    return (lines[-1] if lines else text.splitlines()[0] if text else "").strip()


def describe(storage: Any) -> str:
    """Where a storage's shared memory lives: ``"memfd"``, ``"/dev/shm"`` or ``"private"``."""
    try:
        fd = storage._get_shared_fd()
    except (RuntimeError, AttributeError):
        return "private"
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "shared"
    return (
        "memfd" if target.startswith("/memfd:") else "/dev/shm" if target.startswith("/dev/shm") else target
    )
