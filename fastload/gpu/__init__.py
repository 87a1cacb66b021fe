"""fastload's GPU side: batched device transforms, the prefetcher and the feeder, device decoding,
CUDA streams and pinned host memory. Nothing here touches CUDA at import time.

The batched transforms (public as ``gpu.Compose``, ``gpu.RandomResizedCrop``, ...), in the order a
batch meets them, each with per-sample random parameters from ``(seed, epoch, index)``, on any
device (CPU tensors too):

- :mod:`fastload.gpu.base` -- what every transform shares: the images it takes, the call
  convention (:class:`BatchTransform`, :func:`apply_transform`), the per-sample draws.
- :mod:`fastload.gpu.geometry` -- crops, resizes and flips, fused by :class:`Compose` into one
  resampling pass (planned and run by :mod:`fastload.gpu.resample`).
- :mod:`fastload.gpu.color` -- :class:`ColorJitter`, :class:`RandomErasing`.
- :mod:`fastload.gpu.normalize` -- :class:`Normalize` and its reused CPU outputs (:data:`host_pool`).

Around them: :mod:`fastload.gpu.prefetch` (``CUDAPrefetcher``: batch k + 1 copied and transformed
on a side stream while the model trains on batch k); :mod:`fastload.gpu.feeder` (``DeviceFeeder``:
a batch's device work in a thread and stream of its own); :mod:`fastload.gpu.decode`,
:mod:`fastload.gpu.nvimgcodec` and :mod:`fastload.gpu.hybrid` (decoding on the device, and
``decode="hybrid"``'s split with the CPU workers); :mod:`fastload.gpu.streams` and
:mod:`fastload.gpu.memory` (stream operations, pinned host memory). Code not yet measured on a GPU
is off unless ``FASTLOAD_GPU_EXPERIMENTAL=1`` (:func:`fastload.device.gpu_experimental`).
"""

from __future__ import annotations

from .base import BatchTransform, PackedImages, apply_transform
from .color import ColorJitter, RandomErasing
from .geometry import CenterCrop, Compose, RandomHorizontalFlip, RandomResizedCrop, Resize, crop_resize
from .normalize import HostBufferPool, Normalize, host_pool

__all__ = [
    "BatchTransform",
    "CenterCrop",
    "ColorJitter",
    "Compose",
    "HostBufferPool",
    "Normalize",
    "PackedImages",
    "RandomErasing",
    "RandomHorizontalFlip",
    "RandomResizedCrop",
    "Resize",
    "apply_transform",
    "crop_resize",
    "host_pool",
]
