"""fastload's GPU side: batched device transforms, the prefetcher and the feeder, device decoding,
CUDA streams and pinned host memory.

- :mod:`fastload.gpu.transforms` -- the batched transforms (``gpu.Compose``, ``gpu.RandomResizedCrop``,
  ``gpu.Normalize``, ...), re-exported here: per-sample random parameters from
  ``(seed, epoch, index)``, one kernel sequence per batch, on any device (CPU tensors too).
- :mod:`fastload.gpu.prefetch` -- :class:`CUDAPrefetcher` (also ``fastload.CUDAPrefetcher``): copy
  and transform batch k + 1 on a side stream while the model trains on batch k.
- :mod:`fastload.gpu.feeder` -- :class:`DeviceFeeder`: a batch's device work in a thread and stream
  of its own, handed to the training thread by event (``DataLoader(device="cuda", ...)`` and
  ``decode="device"`` run on it).
- :mod:`fastload.gpu.decode` -- decoding on the device (:func:`decode_batch`: nvJPEG for the JPEGs it
  takes, the CPU's decoders for the rest).
- :mod:`fastload.gpu.streams` and :mod:`fastload.gpu.memory` -- stream operations (a no-op stand-in
  without CUDA; tests record them) and pinned host memory (page-locked batch rings, pinned copies).

``fastload.loader`` chooses the path; ``fastload.prefetch``, ``fastload.feeder`` and the names of
``fastload.device`` and ``fastload.decode`` that moved here stay importable. Nothing here touches
CUDA at import time.
"""

from __future__ import annotations

from . import transforms
from .transforms import *  # noqa: F403 - the transforms' public names are fastload.gpu's

__all__ = list(transforms.__all__)
