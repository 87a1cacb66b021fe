"""The last device transform, :class:`Normalize` (uint8 to the model's floats), and the reused CPU
outputs it writes into (:data:`host_pool`; uint8 channels-last batches by a C table lookup there).
"""

from __future__ import annotations

import collections
import math
import numbers
import threading
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .._checks import check_int
from ..decode import affine_for_table, to_chw_by_table
from ..device import small_to_device
from .base import BatchTransform, Images, Indices, require_tensor

__all__ = ["HostBufferPool", "Normalize", "host_pool"]


class HostBufferPool:
    """Recycles large CPU output tensors, never handing out memory that is still referenced.

    A fresh 20-40 MB batch costs more than filling it (page faults). A buffer goes back to the
    pool only when the tensor's *storage* is gone (views, ``.numpy()`` arrays, autograd's saved
    references); at most ``max_idle`` free buffers and ``max_idle_bytes`` are kept, newest first.
    Tensors made here cannot grow (``resize_``), and arrays exported before a ``share_memory_()``
    see recycled memory afterwards.
    """

    _NUMPY = {
        torch.float32: np.float32,
        torch.float64: np.float64,
        torch.float16: np.float16,
        torch.bfloat16: np.int16,  # its bits, viewed as bfloat16 (torch 2.1 takes no uint16 array)
    }

    def __init__(self, max_idle: int = 4, max_idle_bytes: int = 1 << 30) -> None:
        self.max_idle = int(max_idle)
        self.max_idle_bytes = int(max_idle_bytes)
        self._free: collections.deque[tuple[Any, np.ndarray]] = collections.deque()  # newest last
        # re-entrant: a finalizer (_release) may run inside the collector during the pool's own code
        self._lock = threading.RLock()

    def empty(self, shape: Sequence[int], dtype: torch.dtype, channels_last: bool = False) -> torch.Tensor:
        """An uninitialised CPU tensor of ``shape`` (4-D when ``channels_last``), pooled when possible."""
        shape = tuple(int(v) for v in shape)
        if dtype not in self._NUMPY:
            fmt = torch.channels_last if channels_last else torch.contiguous_format
            return torch.empty(shape, dtype=dtype, memory_format=fmt)
        key = (shape, dtype, channels_last)
        buf = None
        with self._lock:
            for k in range(len(self._free) - 1, -1, -1):  # newest first
                if self._free[k][0] == key:
                    buf = self._free[k][1]
                    del self._free[k]
                    break
        if buf is None:
            buf = np.empty(math.prod(shape), dtype=self._NUMPY[dtype])
        view = buf[:]  # a new array object: the torch storage below holds it, and only it
        weakref.finalize(view, self._release, key, buf)
        flat = torch.from_numpy(view)
        if dtype == torch.bfloat16:
            flat = flat.view(torch.bfloat16)
        if channels_last:
            n, c, h, w = shape
            return flat.view(n, h, w, c).permute(0, 3, 1, 2)
        return flat.view(shape)

    def _release(self, key: Any, buf: np.ndarray) -> None:
        with self._lock:
            self._free.append((key, buf))
            while self._free and (len(self._free) > self.max_idle or self.idle_bytes() > self.max_idle_bytes):
                self._free.popleft()  # the oldest goes back to the OS

    def idle(self) -> int:
        """How many free buffers the pool holds."""
        with self._lock:
            return len(self._free)

    def idle_bytes(self) -> int:
        """Bytes held in free buffers."""
        with self._lock:
            return sum(buf.nbytes for _, buf in self._free)


#: The pool :class:`Normalize` uses for CPU outputs.
host_pool = HostBufferPool()


class Normalize(BatchTransform):
    """Converts to float (uint8 scaled to [0, 1]) and normalises per channel: ``(x / 255 - mean) / std``.

    torchvision's ``ToDtype(float32, scale=True)`` then ``Normalize``, op for op (half precision:
    computed in float32, cast once). ``mean``/``std`` above 1 are taken as 0-255 units (DALI's
    habit) and divided by 255, with a warning. ``buffers=k > 0``: a ring of ``k`` reused outputs,
    call ``t``'s overwritten by call ``t + k`` (2 is safe with :class:`fastload.CUDAPrefetcher` if
    you keep no batch beyond the next step).

    Example:
        >>> import torch
        >>> t = Normalize([0.5], [0.5])
        >>> t(torch.tensor([[[[0, 255]]]], dtype=torch.uint8)).tolist()
        [[[[-1.0, 1.0]]]]
    """

    def __init__(
        self,
        mean: float | Sequence[float],
        std: float | Sequence[float],
        dtype: torch.dtype = torch.float32,
        channels_last: bool = False,
        buffers: int = 0,
    ) -> None:
        self.mean = self._floats(mean, "mean")
        self.std = self._floats(std, "std")
        if any(s == 0 for s in self.std):
            raise ValueError(f"std should be non-zero, but got std={std!r}")
        if any(abs(v) > 1 for v in self.mean + self.std):
            warnings.warn(
                f"Normalize got mean={mean!r}, std={std!r}: values above 1 are taken as 0-255 units and "
                "divided by 255 (images are scaled to [0, 1] before normalizing); pass them in [0, 1] "
                "units, e.g. mean=(0.485, 0.456, 0.406), to silence this warning",
                stacklevel=2,
            )
            self.mean = [v / 255 for v in self.mean]
            self.std = [v / 255 for v in self.std]
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype should be a floating torch.dtype, but got dtype={dtype!r}")
        buffers = check_int(buffers, "buffers", low=0)
        self.dtype = dtype
        self.channels_last = bool(channels_last)
        self.buffers = int(buffers)
        self._ring: list[torch.Tensor] = []
        self._next = 0
        self._constants: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}
        self._lut: np.ndarray | None = None  # see _table
        self._affine: np.ndarray | None = None  # see _table

    @staticmethod
    def _floats(value: Any, name: str) -> list[float]:
        if isinstance(value, numbers.Real):
            return [float(value)]
        if isinstance(value, Sequence) and len(value) > 0 and all(isinstance(v, numbers.Real) for v in value):
            return [float(v) for v in value]
        raise TypeError(f"{name} should be a number or a sequence of numbers, but got {name}={value!r}")

    def _extra_repr(self) -> str:
        return (
            f"mean={self.mean}, std={self.std}, dtype={self.dtype}, "
            f"channels_last={self.channels_last}, buffers={self.buffers}"
        )

    def _output(self, shape: torch.Size, device: torch.device) -> torch.Tensor:
        fmt = torch.channels_last if self.channels_last else torch.contiguous_format
        if not self.buffers:
            if device.type == "cpu" and (len(shape) == 4 or not self.channels_last):
                return host_pool.empty(shape, self.dtype, self.channels_last)  # recycled, never aliased
            return torch.empty(shape, dtype=self.dtype, device=device, memory_format=fmt)
        if not self._ring or self._ring[0].shape != shape or self._ring[0].device != device:
            self._ring = [
                torch.empty(shape, dtype=self.dtype, device=device, memory_format=fmt)
                for _ in range(self.buffers)
            ]
            self._next = 0
        out = self._ring[self._next]
        self._next = (self._next + 1) % self.buffers
        return out

    def _table(self) -> np.ndarray:
        """``(3, 256)`` float32: this transform's arithmetic on every uint8 value of each channel."""
        if self._lut is None:
            values = torch.arange(256, dtype=torch.uint8).view(1, 1, 1, 256).expand(1, 3, 1, 256)
            work = torch.empty(values.shape, dtype=torch.float32)
            work.copy_(values)
            work.mul_(1.0 / 255)
            mean = torch.tensor(self.mean, dtype=torch.float32).view(-1, 1, 1)
            std = torch.tensor(self.std, dtype=torch.float32).view(-1, 1, 1)
            work.sub_(mean).div_(std)
            self._lut = np.ascontiguousarray(work.view(3, 256).numpy())
            self._affine = affine_for_table(self._lut, 1.0 / 255, False, self.mean, self.std)
        return self._lut

    def _by_table(self, images: torch.Tensor, out: torch.Tensor) -> bool:
        """A CPU uint8 RGB channels-last batch into a float32 ``out`` by C table lookups; ``False``:
        does not apply (nothing written)."""
        if not (
            images.device.type == "cpu"
            and images.dtype == torch.uint8
            and images.ndim == 4
            and images.shape[1] == 3
            and images.numel() > 0
            and images.permute(0, 2, 3, 1).is_contiguous()
            and out.dtype == torch.float32
            and out.is_contiguous()
            and out.device.type == "cpu"
        ):
            return False
        table = self._table()
        src = images.permute(0, 2, 3, 1).numpy()
        dst = out.numpy()
        for i in range(src.shape[0]):
            if not to_chw_by_table(src[i], dst[i], table, self._affine):
                return False  # no C extension: nothing was written (it is the first image)
        return True

    def __call__(
        self, images: Images, *, indices: Indices = None, epoch: int = 0, seed: int = 0
    ) -> torch.Tensor:
        images = require_tensor(images, "Normalize")
        channels = images.shape[1]
        for name, values in (("mean", self.mean), ("std", self.std)):
            if len(values) not in (1, channels):
                raise ValueError(
                    f"{name} should have 1 or {channels} (channels) entries, but got {len(values)} entries"
                )
        if images.dtype != torch.uint8 and not images.is_floating_point():
            raise TypeError(f"Normalize needs uint8 or floating images, but got dtype {images.dtype}")
        out = self._output(images.shape, images.device)
        wide = self.dtype in (torch.float32, torch.float64)
        work = out if wide else torch.empty_like(out, dtype=torch.float32)
        key = (work.device, work.dtype)
        if key not in self._constants:
            self._constants[key] = (
                small_to_device(np.array(self.mean), work.device, work.dtype).view(-1, 1, 1),
                small_to_device(np.array(self.std), work.device, work.dtype).view(-1, 1, 1),
            )
        mean, std = self._constants[key]
        if self._by_table(images, out):
            return out
        # on the CPU, one large image at a time (the four passes stay in the cache); the same bits
        chunks = (
            zip(work, images, strict=False)
            if work.device.type == "cpu"
            and work.ndim == 4
            and work.shape[0] > 1
            and work[0].numel() >= 1 << 15
            else [(work, images)]
        )
        for w, x in chunks:
            w.copy_(x)
            if images.dtype == torch.uint8:
                w.mul_(1.0 / 255)
            w.sub_(mean).div_(std)
        if work is not out:
            out.copy_(work)
        return out
