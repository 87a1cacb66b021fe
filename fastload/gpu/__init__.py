"""fastload's GPU side: batched device transforms, the prefetcher and the feeder, device decoding,
CUDA streams and pinned host memory.

The batched transforms, in the order a batch meets them (their public names are this package's:
``gpu.Compose``, ``gpu.RandomResizedCrop``, ``gpu.Normalize``, ...): per-sample random parameters
from ``(seed, epoch, index)``, one kernel sequence per batch, on any device (CPU tensors too).

- :mod:`fastload.gpu.base` -- what every transform shares: the images it takes (a batch tensor, a
  list of decoded images, :class:`PackedImages`), the call convention (:class:`BatchTransform`,
  :func:`apply_transform`) and the per-sample draws.
- :mod:`fastload.gpu.geometry` -- crops, resizes and flips (:class:`RandomResizedCrop`,
  :class:`Resize`, :class:`CenterCrop`, :class:`RandomHorizontalFlip`, :func:`crop_resize`),
  fused by :class:`Compose` into one resampling pass, planned and run by
  :mod:`fastload.gpu.resample`.
- :mod:`fastload.gpu.color` -- :class:`ColorJitter`, :class:`RandomErasing`.
- :mod:`fastload.gpu.normalize` -- :class:`Normalize` and the reused CPU output buffers
  (:class:`HostBufferPool`, :data:`host_pool`).

Around them:

- :mod:`fastload.gpu.prefetch` -- :class:`~fastload.gpu.prefetch.CUDAPrefetcher` (also
  ``fastload.CUDAPrefetcher``): copy and transform batch k + 1 on a side stream while the model
  trains on batch k.
- :mod:`fastload.gpu.feeder` -- :class:`~fastload.gpu.feeder.DeviceFeeder`: a batch's device work in
  a thread and stream of its own, handed to the training thread by event
  (``DataLoader(device="cuda", ...)`` and ``decode="device"`` run on it).
- :mod:`fastload.gpu.decode` -- decoding on the device (``decode_batch``: nvJPEG for the JPEGs it
  takes, the CPU's decoders for the rest); :mod:`fastload.gpu.nvimgcodec` -- nvImageCodec's
  decoder (optional); :mod:`fastload.gpu.hybrid` -- ``decode="hybrid"``'s split between the
  device and the CPU workers.
- :mod:`fastload.gpu.streams` and :mod:`fastload.gpu.memory` -- stream operations (a no-op stand-in
  without CUDA; tests record them) and pinned host memory (page-locked batch rings, pinned copies).

``fastload.loader`` chooses the path. Code written for the GPU and not yet measured on one is
off unless ``FASTLOAD_GPU_EXPERIMENTAL=1`` (:func:`fastload.device.gpu_experimental`). Nothing here
touches CUDA at import time.
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
