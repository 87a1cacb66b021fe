"""fastload's GPU side; nothing here touches CUDA at import time.

Batched transforms, per-sample random from ``(seed, epoch, index)``, on any device, in the order a
batch meets them: :mod:`~fastload.gpu.base` (shared call convention), :mod:`~fastload.gpu.geometry`
(crops, resizes, flips, fused by :mod:`~fastload.gpu.resample` into one pass),
:mod:`~fastload.gpu.color`, :mod:`~fastload.gpu.normalize`. Around them: the prefetcher
(:mod:`~fastload.gpu.prefetch`) and the feeder thread (:mod:`~fastload.gpu.feeder`); device
decoding (:mod:`~fastload.gpu.decode`, :mod:`~fastload.gpu.nvimgcodec`, :mod:`~fastload.gpu.hybrid`);
streams and pinned memory (:mod:`~fastload.gpu.streams`, :mod:`~fastload.gpu.memory`). Code not yet
measured on a GPU is off unless ``FASTLOAD_GPU_EXPERIMENTAL=1``.
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
