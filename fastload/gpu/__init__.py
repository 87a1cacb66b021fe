"""fastload's GPU side (no CUDA at import time): batched transforms on any device, in the order a
batch meets them (``base``, ``geometry`` + ``resample``, ``color``, ``normalize``); the prefetcher
and the feeder thread; device decoding (``decode``, ``nvimgcodec``, ``hybrid``); streams and pinned
memory. Code not yet measured on a GPU is off unless ``FASTLOAD_GPU_EXPERIMENTAL=1``.
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
