"""Shared memory that a container's small ``/dev/shm`` (64 MB unless told otherwise) does not limit.

The memory fastload allocates for batches is an anonymous ``memfd_create`` file on Linux, made
through torch's own constructor for a storage shared by file descriptor (sent and freed as
torch's own); elsewhere torch's ``share_memory_()``. :func:`shm_error` turns an allocation that
still failed in ``/dev/shm`` into an error that says so, with the fixes.
"""

from __future__ import annotations

import math
import mmap
import os
from typing import Any

import torch

_ok: bool | None = None


def memfd_available() -> bool:
    """Whether :func:`shared_storage` makes memfd-backed storages here (the sharing strategy: per call)."""
    global _ok
    if _ok is None:
        _ok = False
        if hasattr(os, "memfd_create"):
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
        return torch.UntypedStorage._new_shared_fd_cpu(fd, max(1, nbytes))  # type: ignore[attr-defined]
    finally:
        os.close(fd)


def shared_storage(nbytes: int) -> torch.UntypedStorage:
    """``nbytes`` of shared memory: memfd-backed where :func:`memfd_available`, else ``/dev/shm``."""
    if memfd_available():
        return _memfd_storage(nbytes)
    return torch.UntypedStorage._new_shared(nbytes)


def shared_empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous tensor in shared memory (see :func:`shared_storage`)."""
    shape = tuple(int(s) for s in shape)
    if not memfd_available():
        return torch.empty(shape, dtype=dtype).share_memory_()
    storage = _memfd_storage(math.prod(shape) * torch.empty(0, dtype=dtype).element_size())
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape, contiguous_strides(shape))


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


PAGE = mmap.PAGESIZE


def shared_slots(num_slots: int, slot_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A ``(num_slots, *slot_shape)`` tensor in shared memory whose slots each start on a page of
    their own, so that each can be page-locked on its own."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    inner = tuple(int(size) for size in slot_shape)
    stride = -(-max(1, math.prod(inner) * itemsize) // PAGE) * PAGE  # bytes between slot starts
    storage = shared_storage(num_slots * stride)
    strides = (stride // itemsize, *contiguous_strides(inner))
    return torch.empty(0, dtype=dtype).set_(storage, 0, (num_slots, *slot_shape), strides)


_torch_reduce_storage: Any = None


def _reduce_storage(storage: Any) -> Any:
    """torch's ``reduce_storage``, sending a private storage through a memfd copy, not ``/dev/shm``."""
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
    """Tensors this process (a worker) sends that are not shared yet go through memfd copies, not
    new ``/dev/shm`` segments. ``False`` where memfds are not used."""
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
    """A clear error (the mount's size, what was needed, the fixes) when ``error`` or its causes
    is an allocation in ``/dev/shm`` that did not fit, else ``None``."""
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
