"""The one place that knows the machine: CUDA, CPUs, ranks per node, worker counts.

Every other module asks here instead of calling ``torch.cuda`` or ``os.cpu_count`` itself:

- :func:`device_is_cuda`, :func:`cuda_available`, :func:`default_device`: "is this CUDA",
  answered without creating a CUDA context (nothing here touches CUDA at import time).
- :func:`small_to_device`: a few parameters on a device, without blocking the host.
- :func:`gpu_experimental`: whether the GPU code not yet measured on a GPU runs
  (``FASTLOAD_GPU_EXPERIMENTAL=1``; off by default).
- Streams and pinned host memory live on the GPU side: :mod:`fastload.gpu.streams`
  (:class:`~fastload.gpu.streams.StreamBackend`, :func:`~fastload.gpu.streams.stream_backend`) and
  :mod:`fastload.gpu.memory` (:func:`~fastload.gpu.memory.host_memory`,
  :class:`~fastload.gpu.memory.PageLock`).
- :func:`available_cpus`: the CPUs this process may run on (its affinity mask).
- :func:`local_world_size`: the processes of this job on this machine.
- :func:`auto_num_workers`: ``num_workers="auto"``.
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
    """A small host array (parameters, indices) as a tensor on ``device``.

    On CUDA the copy is staged through pinned memory and is asynchronous: transforms queued on
    the prefetcher's side stream (behind a wait on the training stream) never block the host.
    """
    tensor = array if isinstance(array, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(array))
    if dtype is not None and tensor.dtype != dtype:
        tensor = tensor.to(dtype)  # on the host: same rounding, smaller copy
    if device.type == "cpu":
        return tensor
    if device_is_cuda(device):
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


#: The environment variable that turns on the GPU code not yet measured on a GPU (see
#: :func:`gpu_experimental`).
GPU_EXPERIMENTAL = "FASTLOAD_GPU_EXPERIMENTAL"


def gpu_experimental() -> bool:
    """Whether the GPU code that was written for a GPU but never measured on one runs:
    ``FASTLOAD_GPU_EXPERIMENTAL=1`` in the environment; unset, empty or ``0``: off (the default).

    It turns on, together (``docs/gpu.md``, "Experimental"):

    - nvImageCodec's in-place region decoding: a batch's crops decoded into one buffer
      (:meth:`fastload.gpu.nvimgcodec.RegionDecoder.decode_packed`), and with it nvImageCodec's C
      interface (``fastload._nvimgcodec``: one call per batch without the interpreter). Off: each
      crop is decoded by nvImageCodec's Python interface and copied out of its memory, as measured
      on an H200.
    - ``decode="hybrid"``'s split that follows the training loop's demand
      (:class:`fastload.gpu.hybrid.HybridSplit`). Off: the split follows the two sides' decoding
      rates, as measured on an H200.

    Read each time it is asked (a decoder or a split asks once, when it is made), so a test or a
    program may set the variable before making its loader.

    Raises:
        ValueError: If the variable holds anything other than ``1``, ``0`` or nothing.
    """
    value = os.environ.get(GPU_EXPERIMENTAL, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(
            f"{GPU_EXPERIMENTAL} should be 1 (on) or 0 (off, the default), but got "
            f"{GPU_EXPERIMENTAL}={value!r}"
        )
    return value == "1"


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


def cpu_share() -> int:
    """This process's share of the CPUs: those it may run on, divided among the job's processes
    on this machine (:func:`local_world_size`), at least 1.

    Example: 32 CPUs and ``torchrun --nproc-per-node 8`` -> 4; no torchrun -> 32.
    """
    return max(1, available_cpus() // local_world_size())


def auto_num_workers() -> int:
    """``num_workers="auto"``: this process's share of the CPUs, at least 1 and at most 16.

    Example: 2 CPUs, no torchrun -> 2; 32 CPUs and ``torchrun --nproc-per-node 8`` -> 4.
    """
    return min(MAX_AUTO_WORKERS, cpu_share())
