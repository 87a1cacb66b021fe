"""The one place that knows the machine: every other module asks here, not ``torch.cuda`` or
``os.cpu_count``, whether a device is CUDA (without creating a CUDA context) and how many CPUs,
ranks per node and workers there are. Streams and pinned memory: :mod:`fastload.gpu`.
"""

from __future__ import annotations

import os

import numpy as np
import torch

__all__ = [
    "auto_num_workers",
    "available_cpus",
    "cuda_available",
    "default_device",
    "device_is_cuda",
    "gpu_experimental",
    "local_world_size",
    "small_to_device",
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


def small_to_device(
    array: np.ndarray | torch.Tensor, device: torch.device, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """A small host array (parameters, indices) as a tensor on ``device``; on CUDA an asynchronous
    copy staged through pinned memory, so it never blocks the host."""
    tensor = array if isinstance(array, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(array))
    if dtype is not None and tensor.dtype != dtype:
        tensor = tensor.to(dtype)  # on the host: same rounding, smaller copy
    if device.type == "cpu":
        return tensor
    if device_is_cuda(device):
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


GPU_EXPERIMENTAL = "FASTLOAD_GPU_EXPERIMENTAL"


def gpu_experimental() -> bool:
    """Whether the GPU code not yet measured on a GPU runs (``docs/gpu.md``, "Experimental"):
    ``FASTLOAD_GPU_EXPERIMENTAL=1``; unset, empty or ``0``: off; anything else: ``ValueError``."""
    value = os.environ.get(GPU_EXPERIMENTAL, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(
            f"{GPU_EXPERIMENTAL} should be 1 (on) or 0 (off, the default), but got "
            f"{GPU_EXPERIMENTAL}={value!r}"
        )
    return value == "1"


def available_cpus() -> int:
    """The CPUs this process may run on: its affinity mask (``taskset``, Slurm, containers)."""
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
    """The processes of this job on this machine (they share its CPUs): the first of
    ``LOCAL_WORLD_SIZE``, ``SLURM_NTASKS_PER_NODE``, the process group's size, ``WORLD_SIZE`` (a
    job that gives only its total is taken to run on one machine: never oversubscribes), else 1."""
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = _positive_env(name)
        if value is not None:
            return value
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    value = _positive_env("WORLD_SIZE")
    return 1 if value is None else value


def cpu_share() -> int:
    """This process's share of the CPUs: :func:`available_cpus` // :func:`local_world_size`, at least 1."""
    return max(1, available_cpus() // local_world_size())


def auto_num_workers() -> int:
    """``num_workers="auto"``: this process's share of the CPUs, at least 1 and at most 16.

    Example: 2 CPUs, no torchrun -> 2; 32 CPUs and ``torchrun --nproc-per-node 8`` -> 4.
    """
    return min(MAX_AUTO_WORKERS, cpu_share())
