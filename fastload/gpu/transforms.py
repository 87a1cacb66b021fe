"""Batched image transforms for NCHW tensors on any device, with per-sample randomness.

The CPU ships compact ``uint8`` batches; these transforms do the rest where the model runs.
Every transform works on a whole batch at once (no Python loop over images) and on any device:
on CPU tensors the results are checked against :mod:`torchvision.transforms.v2.functional`
applied image by image with the same parameters.

Call convention
---------------
Every transform here is a :class:`BatchTransform` and is called as::

    out = transform(images, indices=None, epoch=0, seed=0)

``images`` is a ``(N, C, H, W)`` tensor. The resize-type transforms (:class:`RandomResizedCrop`,
:class:`Resize`, :class:`CenterCrop`, :class:`RandomHorizontalFlip`) also accept a list of ``(C, H, W)``
tensors of different sizes (what a device JPEG decoder returns) and return one batch.

Per-sample randomness
---------------------
With ``indices`` given (the dataset index of each image), every random parameter of image ``r`` is
drawn from ``fastload.rng.batch_uniform(seed, epoch, indices, stream, n)[r]``, where ``stream`` is a
fixed id per transform class (:attr:`RandomResizedCrop.stream`, ...). So a sample gets the same
augmentation whatever batch it lands in, whatever the batch size, and after a resume. Two
instances of the same class in one pipeline draw the same numbers unless you give one a different
``stream`` (``t.stream = 123``). With ``indices=None`` the uniforms come from torch's global
generator, one set per image (reproducible with ``torch.manual_seed``, like torchvision).

Each random transform has a ``get_params(images, indices=..., epoch=..., seed=...)`` method that
returns the parameters it draws for those images, as numpy arrays (one entry per image).

Where the indices come from: :class:`IndexedBatch` is an ``(images, labels)`` tuple that also
carries ``.indices``; :class:`fastload.CUDAPrefetcher` passes them, with the loader's epoch and
seed, to the transforms (see :mod:`fastload.prefetch`).

Fusion
------
Inside :class:`Compose`, consecutive geometric transforms are fused into one resampling pass:
``Compose([Resize(256), CenterCrop(224)])`` computes only the 224x224 window of the resized image
(so it also works on a list of images of different aspect ratios), and
``Compose([RandomResizedCrop(224), RandomHorizontalFlip()])`` writes the flipped crop directly.
The result equals applying the transforms one after the other: bit for bit for crops and flips
after the resize, to float rounding (at most one uint8 level) for a flip before it.

A ragged list is processed in a few groups of similar region width: each region keeps its own
rows and is padded to its group's widest (so are its rows after the vertical pass); the batch is
split into the fewest groups for which that padding costs at most 1.5 times the batch's own work
in all, so one 4000x3000 photo in a batch of 400x350 crops does not make every crop cost 4000
columns (on the CPU, a group's width may change the float rounding of the resampling by an ulp:
at most one uint8 level, rarely).

Resampling and accuracy
-----------------------
Bilinear resizing (with ``antialias=True``, torch's triangle filter widened by the downscale
factor, exactly like ``interpolate(..., antialias=True)``) is computed for the whole batch as two
separable passes of :func:`torch.nn.functional.embedding_bag` (a fused "weighted sum of K gathered
rows"), with per-image filter taps made on the host (in one call of the C extension
``fastload._resample`` without the interpreter, else numpy) and sent to the device with the
rest of the batch's plan in two copies. It works for any per-image crop box and any
scale, up or down. Arithmetic is float32 and uint8 outputs are rounded. Measured on 400x350
photo-like images (``bench/gpu_transforms.py --accuracy``, asserted in ``tests/test_gpu.py``):

- vs torchvision's float path (what it does on GPU), rounded: max 1 level, mean 1e-4 levels
  (only rounding ties differ), for mild/strong downscales and upscales alike;
- vs torchvision's CPU uint8 path (16-bit fixed-point weights, rounding between its passes):
  max 1 level, on 9-19% of the pixels (mean 0.09-0.19 levels).

A uniform batch tensor with the same geometry for every image (``Resize``/``CenterCrop`` of an
NCHW tensor) goes through torchvision's own batched resize and slicing, so it is identical to
torchvision. Flips, crops, zero padding, colour jitter, erasing and normalisation are exact
(bit-identical to the torchvision functional ops with the same parameters).

Example:
    >>> import torch
    >>> from fastload import gpu
    >>> train = gpu.Compose([
    ...     gpu.RandomResizedCrop(224),
    ...     gpu.RandomHorizontalFlip(),
    ...     gpu.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
    ... ])
    >>> images = torch.randint(0, 256, (8, 3, 300, 400), dtype=torch.uint8)
    >>> out = train(images, indices=torch.arange(8), epoch=0, seed=0)
    >>> out.shape, out.dtype
    (torch.Size([8, 3, 224, 224]), torch.float32)
    >>> bool((train(images[2:4], indices=torch.arange(2, 4)) == out[2:4]).all())  # same samples
    True
"""

from __future__ import annotations

import collections
import math
import numbers
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as nnf

from .. import rng
from .._checks import check_int, check_probability, check_size
from ..batch import IndexedBatch
from ..decode import affine_for_table, to_chw_by_table
from ..device import small_to_device

try:  # the plan of a batch's resize in a few calls without the interpreter (setup.py)
    from .. import _resample as _c_resample
except ImportError:  # built without a C compiler: the same numbers from numpy
    _c_resample = None
if _c_resample is not None and not all(
    hasattr(_c_resample, name) for name in ("antialias_taps", "axis_taps", "region_rows", "fewest_groups")
):
    _c_resample = None  # built from an older source (an in-place build not redone): numpy's, not an error

__all__ = [
    "BatchTransform",
    "CenterCrop",
    "ColorJitter",
    "Compose",
    "HostBufferPool",
    "IndexedBatch",
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


class PackedImages:
    """Images of different sizes back to back in one flat buffer, each channels first (what a
    region decoder writes a batch's crops into): the geometric transforms read them from there,
    with no tensor per image.

    Args:
        flat: The buffer, 1-D (it may hold more than the images, e.g. a refused image's space).
        offsets: Where each image starts in ``flat`` (elements).
        heights: Each image's height.
        widths: Each image's width.
        channels: Channels of every image.

    Example:
        >>> flat = torch.arange(2 * 3 + 2 * 2 * 3, dtype=torch.uint8)
        >>> packed = PackedImages(flat, np.array([0, 6]), np.array([1, 2]), np.array([2, 2]), channels=3)
        >>> packed.image(1).shape
        torch.Size([3, 2, 2])
    """

    def __init__(
        self, flat: torch.Tensor, offsets: np.ndarray, heights: np.ndarray, widths: np.ndarray, channels: int
    ) -> None:
        if flat.ndim != 1:
            raise ValueError(f"flat should be a 1-D tensor, but got shape {tuple(flat.shape)}")
        self.flat, self.channels = flat, int(channels)
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.heights = np.asarray(heights, dtype=np.int64)
        self.widths = np.asarray(widths, dtype=np.int64)
        if not len(self.offsets) == len(self.heights) == len(self.widths):
            raise ValueError(
                f"offsets, heights and widths should have one entry per image, but got {len(self.offsets)}, "
                f"{len(self.heights)} and {len(self.widths)}"
            )
        ends = self.offsets + self.channels * self.heights * self.widths
        if len(ends) and (self.offsets.min() < 0 or int(ends.max()) > flat.numel()):
            raise ValueError(f"the images run past the end of flat ({flat.numel()} elements)")

    def __len__(self) -> int:
        return len(self.offsets)

    def image(self, k: int) -> torch.Tensor:
        """Image ``k`` as a ``(C, H, W)`` view of the buffer."""
        h, w = int(self.heights[k]), int(self.widths[k])
        start = int(self.offsets[k])
        return self.flat[start : start + self.channels * h * w].view(self.channels, h, w)

    def select(self, rows: np.ndarray) -> PackedImages:
        """The images ``rows`` (in that order), in the same buffer."""
        offsets, heights, widths = self.offsets[rows], self.heights[rows], self.widths[rows]
        return PackedImages(self.flat, offsets, heights, widths, self.channels)


Images = torch.Tensor | Sequence[torch.Tensor] | PackedImages
Indices = Sequence[int] | np.ndarray | torch.Tensor | None


# --------------------------------------------------------------------------------------------
# Argument helpers
# --------------------------------------------------------------------------------------------


def _check_range(
    value: Any, name: str, low: float = -math.inf, high: float = math.inf
) -> tuple[float, float]:
    if not (
        isinstance(value, Sequence) and len(value) == 2 and all(isinstance(v, numbers.Real) for v in value)
    ):
        raise TypeError(f"{name} should be a sequence of two numbers (min, max), but got {name}={value!r}")
    a, b = float(value[0]), float(value[1])
    if not (low <= a <= b <= high):
        raise ValueError(
            f"{name} should be (min, max) with {low} <= min <= max <= {high}, but got {name}={value!r}"
        )
    return a, b


def _check_interpolation(interpolation: Any) -> None:
    value = getattr(interpolation, "value", interpolation)
    if value != "bilinear":
        raise ValueError(
            "only bilinear interpolation is implemented for batched transforms, "
            f"but got interpolation={interpolation!r}"
        )


def _batch_size(images: Images) -> int:
    if isinstance(images, torch.Tensor):
        if images.ndim != 4:
            raise ValueError(
                f"images should be an (N, C, H, W) tensor, but got a tensor of shape {tuple(images.shape)}"
            )
        return images.shape[0]
    if isinstance(images, (list, tuple, PackedImages)):
        return len(images)
    raise TypeError(
        "images should be an (N, C, H, W) tensor or a list of (C, H, W) tensors, but got "
        f"{type(images).__name__}"
    )


def _image_sizes(images: Images) -> tuple[np.ndarray, np.ndarray]:
    """Heights and widths (int64 arrays) of a batch tensor or a list of CHW tensors."""
    n = _batch_size(images)
    if isinstance(images, torch.Tensor):
        return np.full(n, images.shape[2], dtype=np.int64), np.full(n, images.shape[3], dtype=np.int64)
    if isinstance(images, PackedImages):
        return images.heights.copy(), images.widths.copy()
    for k, t in enumerate(images):
        if not isinstance(t, torch.Tensor) or t.ndim != 3:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"images[{k}] should be a (C, H, W) tensor, but got {shape}")
    return (
        np.array([t.shape[1] for t in images], dtype=np.int64),
        np.array([t.shape[2] for t in images], dtype=np.int64),
    )


def _require_tensor(images: Images, who: str) -> torch.Tensor:
    if not isinstance(images, torch.Tensor):
        raise TypeError(
            f"{who} needs an (N, C, H, W) tensor, but got {type(images).__name__}; "
            "put a resize-type transform (RandomResizedCrop, Resize, CenterCrop) first to make one batch"
        )
    _batch_size(images)
    return images


def _uniforms(n: int, indices: Indices, epoch: int, seed: int, stream: int, draws: int) -> np.ndarray:
    """``(n, draws)`` uniforms in [0, 1).

    Per-sample streams if ``indices`` is given, else torch's global RNG.
    """
    if indices is None:
        return torch.rand((n, draws), dtype=torch.float64).numpy()
    if isinstance(indices, torch.Tensor):
        indices = indices.detach().cpu().numpy()
    idx = np.asarray(indices)
    if idx.ndim != 1 or idx.shape[0] != n:
        raise ValueError(
            f"indices should hold one dataset index per image ({n}), but got shape {tuple(idx.shape)}"
        )
    if n == 0:
        return np.zeros((0, draws), dtype=np.float64)
    return rng.batch_uniform(int(seed), int(epoch), idx.astype(np.int64), stream, draws)


def _refuse_empty(heights: np.ndarray, widths: np.ndarray, what: str) -> None:
    """A clear error naming the first image with no pixels (``what``: what cannot be done to it)."""
    empty = np.flatnonzero((heights < 1) | (widths < 1))
    if len(empty):
        k = int(empty[0])
        raise ValueError(
            f"image {k} of the batch has no pixels ({int(heights[k])}x{int(widths[k])}), so {what}: leave "
            "empty images out of the batch"
        )


def _randint(u: np.ndarray, high: np.ndarray) -> np.ndarray:
    """Integers in ``[0, high)`` from uniforms (``high >= 1``)."""
    return np.minimum((u * high).astype(np.int64), high - 1)


# --------------------------------------------------------------------------------------------
# Geometry plans: crops, resizes and flips of a whole batch, executed as one resampling pass
# --------------------------------------------------------------------------------------------


class _Axis:
    """The geometry of one axis (rows or columns) of every image of a batch.

    The current virtual image ``V`` along this axis is ``V[k] = R[win0 + k]`` for
    ``k < winlen``, zero where ``win0 + k`` is outside ``[lo, hi)``. ``R`` is the source ``S``
    itself until a resize happens (``resampled`` False); afterwards it is ``S[src0 : src0 + srclen]``
    (zero outside ``[m0, m1)``) resampled to ``reslen`` pixels.
    """

    __slots__ = ("size", "src0", "srclen", "reslen", "win0", "winlen", "lo", "hi", "m0", "m1", "resampled")

    def __init__(self, size: np.ndarray) -> None:
        zeros = np.zeros_like(size)
        self.size = size
        self.src0, self.srclen, self.reslen = zeros, size, size
        self.win0, self.winlen = zeros, size
        self.lo, self.hi = zeros, size
        self.m0, self.m1 = zeros, size
        self.resampled = False

    def crop(self, start: np.ndarray, length: np.ndarray) -> None:
        self.lo = np.maximum(self.lo, self.win0)
        self.hi = np.minimum(self.hi, self.win0 + self.winlen)
        self.win0 = self.win0 + start
        self.winlen = np.asarray(length, dtype=np.int64)

    def resize(self, length: np.ndarray) -> None:
        # Not yet resampled, so R == S: the window (with its zero padding) becomes the region.
        self.src0, self.srclen = self.win0, self.winlen
        self.m0, self.m1 = self.lo, self.hi
        self.reslen = length
        self.win0, self.winlen = np.zeros_like(length), length
        self.lo, self.hi = np.zeros_like(length), length
        self.resampled = True

    def uniform(self) -> bool:
        return all(
            bool((getattr(self, name) == getattr(self, name)[0]).all()) for name in self.__slots__[:-1]
        )

    def taps(self, flip: np.ndarray | None, antialias: bool) -> _Taps:
        """This axis's filter taps: ``V[o] = sum_k w[o, k] * S[pos[o, k]]`` for every image."""
        length = int(self.winlen[0])
        if self.resampled and antialias and _c_resample is not None and USE_C_TAPS:
            # the same numbers as below, for every output pixel in one call without the interpreter
            n = len(self.size)
            xmin, xsize = np.empty((n, length), dtype=np.int64), np.empty((n, length), dtype=np.int64)
            center, valid = np.empty((n, length)), np.empty((n, length), dtype=bool)
            invscale = np.empty(n)
            per_image = [np.ascontiguousarray(a, dtype=np.int64) for a in (self.win0, self.lo, self.hi)]
            per_image += [np.ascontiguousarray(a, dtype=np.int64) for a in (self.srclen, self.reslen)]
            flips = None if flip is None else np.ascontiguousarray(flip, dtype=bool)
            _c_resample.axis_taps(*per_image, flips, xmin, xsize, center, valid, invscale)
            return _AntialiasTaps(self, xmin, xsize, center, invscale, valid)
        o = np.arange(length, dtype=np.int64)[None, :]
        if flip is not None:
            o = np.where(flip[:, None], length - 1 - o, o)
        r = self.win0[:, None] + o  # (N, L) position in R
        valid = (r >= self.lo[:, None]) & (r < self.hi[:, None])
        if not self.resampled:
            pos = np.clip(r[:, :, None], 0, self.size[:, None, None] - 1)
            return _HostTaps(pos, valid[:, :, None].astype(np.float64))
        n = self.srclen[:, None].astype(np.float64)
        m = self.reslen[:, None]
        scale = n / m
        rr = np.clip(r, 0, m - 1).astype(np.float64)
        if not antialias:
            # Plain bilinear (align_corners=False), two taps.
            src = np.maximum(scale * (rr + 0.5) - 0.5, 0.0)
            i0 = np.minimum(np.floor(src).astype(np.int64), self.srclen[:, None] - 1)
            i1 = i0 + (i0 < self.srclen[:, None] - 1)
            lam = np.clip(src - i0, 0.0, 1.0)
            pos = self.src0[:, None, None] + np.stack([i0, i1], -1)
            inside = (pos >= self.m0[:, None, None]) & (pos < self.m1[:, None, None])
            weights = np.stack([1.0 - lam, lam], -1) * inside * valid[:, :, None]
            return _HostTaps(np.clip(pos, 0, self.size[:, None, None] - 1), weights)
        # torch's separable antialiased bilinear filter (interpolate(..., antialias=True)): per
        # output pixel, taps xmin .. xmin + xsize - 1 of a triangle of width 2 * support. Only
        # these per-pixel numbers are computed here; the (n, L, K) positions and weights of each
        # group of images are made once the groups are known (see _AntialiasTaps.fill).
        support = np.where(scale >= 1.0, scale, 1.0)
        invscale = np.where(scale >= 1.0, 1.0 / scale, 1.0)[:, 0]
        center = scale * (rr + 0.5)
        xmin = np.maximum(np.trunc(center - support + 0.5), 0).astype(np.int64)
        xmax = np.minimum(np.trunc(center + support + 0.5).astype(np.int64), self.srclen[:, None])
        return _AntialiasTaps(self, xmin, xmax - xmin, center, invscale, valid)


class _Taps:
    """An axis's filter taps for a batch: for image ``i``, output ``o`` and tap ``k``, a position in
    the image (clipped into it) and a weight."""

    def bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """Per image, the lowest and highest position any tap reads."""
        raise NotImplementedError

    def width(self, rows: np.ndarray) -> int:
        """How many taps the images ``rows`` need (the trailing ones weigh 0 for all of them)."""
        raise NotImplementedError

    def fill(self, rows: np.ndarray, shift: np.ndarray, pos: np.ndarray, weights: np.ndarray) -> None:
        """Writes the taps of images ``rows`` into ``pos`` (int64, each position plus its image's
        ``shift``) and ``weights`` (float32 or float64), each ``(n, L, K)`` with ``K >=
        width(rows)``."""
        raise NotImplementedError


class _HostTaps(_Taps):
    """Taps computed on the host (a crop, a flip, plain bilinear: one or two taps per pixel)."""

    def __init__(self, pos: np.ndarray, weights: np.ndarray) -> None:
        self.pos, self.weights = pos, weights

    def bounds(self) -> tuple[np.ndarray, np.ndarray]:
        n = len(self.pos)
        return self.pos.reshape(n, -1).min(1), self.pos.reshape(n, -1).max(1)

    def width(self, rows: np.ndarray) -> int:
        used = np.nonzero((self.weights[rows] != 0).any(axis=(0, 1)))[0]
        return int(used[-1]) + 1 if len(used) else 1

    def fill(self, rows: np.ndarray, shift: np.ndarray, pos: np.ndarray, weights: np.ndarray) -> None:
        k = min(pos.shape[2], self.pos.shape[2])
        np.add(self.pos[rows, :, :k], shift[:, None, None], out=pos[:, :, :k])
        weights[:, :, :k] = self.weights[rows, :, :k]
        if k < pos.shape[2]:  # wider than these taps: the rest weigh 0 and read the first
            pos[:, :, k:] = pos[:, :, :1]
            weights[:, :, k:] = 0


class _AntialiasTaps(_Taps):
    """torch's antialiased bilinear taps, made on the host from per-pixel numbers.

    Output ``o`` of image ``i`` reads taps ``k < xsize[i, o]`` at ``xmin[i, o] + k`` (from the
    resampled region's start) with weight ``max(0, 1 - |(xmin + k - center + 0.5) * invscale|)``,
    normalised by their sum taken in order of ``k`` (as torch sums them): the same float64
    operations as torch's kernel setup, and an image's weights do not depend on the others of its
    batch. Taps past an output's own ``xsize`` (a group is as wide as its widest filter) weigh 0
    and read its first tap's position. Made for a whole batch in one call of the C extension
    (``fastload._resample``, the interpreter released), else by the same arithmetic in numpy.
    """

    def __init__(
        self,
        axis: _Axis,
        xmin: np.ndarray,
        xsize: np.ndarray,
        center: np.ndarray,
        invscale: np.ndarray,
        valid: np.ndarray,
    ) -> None:
        def int64(a: np.ndarray) -> np.ndarray:
            return np.ascontiguousarray(a, dtype=np.int64)

        self.src0, self.m0, self.m1, self.size = (
            int64(axis.src0),
            int64(axis.m0),
            int64(axis.m1),
            int64(axis.size),
        )
        self.xmin, self.xsize = int64(xmin), int64(xsize)
        self.center = np.ascontiguousarray(center, dtype=np.float64)
        self.invscale = np.ascontiguousarray(invscale, dtype=np.float64)
        self.valid = np.ascontiguousarray(valid, dtype=bool)

    def _clip(self, pos: np.ndarray) -> np.ndarray:
        return np.clip(pos, 0, self.size - 1)

    def bounds(self) -> tuple[np.ndarray, np.ndarray]:
        first = self.src0 + self.xmin.min(1)
        last = self.src0 + (self.xmin + np.maximum(self.xsize, 1) - 1).max(1)
        return self._clip(first), self._clip(last)

    def width(self, rows: np.ndarray) -> int:
        return max(int(self.xsize[rows].max()), 1)

    def fill(self, rows: np.ndarray, shift: np.ndarray, pos: np.ndarray, weights: np.ndarray) -> None:
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        shift = np.ascontiguousarray(shift, dtype=np.int64)
        if _c_resample is not None and USE_C_TAPS:
            _c_resample.antialias_taps(
                self.xmin, self.xsize, self.center, self.invscale, self.valid,
                self.src0, self.m0, self.m1, self.size, rows, shift, pos, weights,
            )  # fmt: skip
        else:
            self._fill_numpy(rows, shift, pos, weights)

    def _fill_numpy(self, rows: np.ndarray, shift: np.ndarray, pos: np.ndarray, weights: np.ndarray) -> None:
        """:meth:`fill` in numpy: the C extension's arithmetic, operation for operation."""
        k = np.arange(pos.shape[2], dtype=np.int64)
        used = k < self.xsize[rows][:, :, None]
        j = self.xmin[rows][:, :, None] + k
        w = 1.0 - np.abs((j - self.center[rows][:, :, None] + 0.5) * self.invscale[rows][:, None, None])
        w = np.where(used, np.maximum(w, 0.0), 0.0)
        total = w[:, :, 0].copy()
        for tap in range(1, w.shape[2]):  # in order, as torch sums them
            total += w[:, :, tap]
        w = w / np.where(total > 0.0, total, 1.0)[:, :, None]
        at = self.src0[rows][:, None, None] + j
        inside = (at >= self.m0[rows][:, None, None]) & (at < self.m1[rows][:, None, None])
        weights[...] = w * inside * self.valid[rows][:, :, None]
        clipped = np.minimum(np.maximum(at, 0), (self.size[rows] - 1)[:, None, None])
        np.add(np.where(used, clipped, clipped[:, :, :1]), shift[:, None, None], out=pos)


#: Whether the resize's taps and table rows come from the C extension where it is built (tests
#: compare both ways).
USE_C_TAPS = True


def plan_extension_built() -> bool:
    """Whether the C extension ``fastload._resample`` (built from this source) plans the resizes."""
    return _c_resample is not None


class _Plan:
    """Pending geometry for a batch: ``execute()`` produces the NCHW result in one pass."""

    def __init__(self, images: Images) -> None:
        heights, widths = _image_sizes(images)
        if isinstance(images, PackedImages):
            if len(images) == 0:
                raise ValueError("images should hold at least one image, but got an empty PackedImages")
        elif not isinstance(images, torch.Tensor):
            if len(images) == 0:
                raise ValueError(
                    "images should be a non-empty list of (C, H, W) tensors, but got an empty list"
                )
            first = images[0]
            for k, t in enumerate(images):
                if t.shape[0] != first.shape[0] or t.dtype != first.dtype or t.device != first.device:
                    raise ValueError(
                        "images should share channels, dtype and device, but images[0] is "
                        f"{tuple(first.shape)} {first.dtype} on {first.device} and images[{k}] is "
                        f"{tuple(t.shape)} {t.dtype} on {t.device}"
                    )
        self.images = images
        # An empty batch is planned as one virtual image, so that the output shape is known.
        self.empty = len(heights) == 0
        if self.empty:
            heights, widths = np.array([images.shape[2]]), np.array([images.shape[3]])  # type: ignore[union-attr]
        self.n = len(heights)
        self.y = _Axis(heights)
        self.x = _Axis(widths)
        self.flip = np.zeros(self.n, dtype=bool)
        self.random_geometry = False
        self.antialias = True

    def draw(self, indices: Indices, epoch: int, seed: int, stream: int, draws: int) -> np.ndarray:
        """``(n, draws)`` uniforms for the images of this plan."""
        if self.empty:
            _uniforms(0, indices, epoch, seed, stream, draws)  # validates indices
            return np.zeros((1, draws))
        return _uniforms(self.n, indices, epoch, seed, stream, draws)

    @property
    def resampled(self) -> bool:
        return self.y.resampled or self.x.resampled

    def sizes(self) -> tuple[np.ndarray, np.ndarray]:
        """Current per-image ``(heights, widths)``."""
        return self.y.winlen, self.x.winlen

    def crop(self, top: np.ndarray, left: np.ndarray, height: np.ndarray, width: np.ndarray) -> None:
        # A crop of a flipped image is the mirrored crop of the unflipped one, then flipped.
        left = np.where(self.flip, self.x.winlen - left - width, left)
        self.y.crop(
            np.asarray(top, dtype=np.int64), np.broadcast_to(np.asarray(height, dtype=np.int64), (self.n,))
        )
        self.x.crop(
            np.asarray(left, dtype=np.int64), np.broadcast_to(np.asarray(width, dtype=np.int64), (self.n,))
        )

    def resize(self, height: np.ndarray, width: np.ndarray, antialias: bool) -> None:
        """Resamples the current image (only valid while ``not self.resampled``)."""
        if not self.empty:
            _refuse_empty(self.y.winlen, self.x.winlen, "it cannot be resized")
        for axis, new in ((self.y, height), (self.x, width)):
            new = np.broadcast_to(np.asarray(new, dtype=np.int64), (self.n,)).copy()
            if not (new == axis.winlen).all():  # resizing to the same size is the identity
                axis.resize(new)
                self.antialias = antialias

    def execute(self) -> torch.Tensor:
        images = self.images
        heights, widths = self.sizes()
        if not ((heights == heights[0]).all() and (widths == widths[0]).all()):
            pairs = sorted({(int(h), int(w)) for h, w in zip(heights, widths, strict=False)})
            raise ValueError(
                f"a batch needs one output size, but these transforms give per-image sizes {pairs[:4]}"
                f"{' ...' if len(pairs) > 4 else ''}; resize to a fixed (h, w), or follow Resize(int) "
                "with CenterCrop inside one Compose"
            )
        if isinstance(images, torch.Tensor):
            if self.empty:
                return images.new_empty((0, images.shape[1], int(heights[0]), int(widths[0])))
            if not self.random_geometry and self.y.uniform() and self.x.uniform():
                fast = self._execute_uniform(images)
                if fast is not None:
                    return fast
        return self._execute_general()

    def _execute_uniform(self, images: torch.Tensor) -> torch.Tensor | None:
        """Same geometry for every image and no padding: slices plus torchvision's batched resize."""
        for axis in (self.y, self.x):
            if axis.resampled:
                if axis.src0[0] < axis.m0[0] or axis.src0[0] + axis.srclen[0] > axis.m1[0]:
                    return None
            if axis.win0[0] < axis.lo[0] or axis.win0[0] + axis.winlen[0] > axis.hi[0]:
                return None
        out = images
        for dim, axis in ((2, self.y), (3, self.x)):
            start, length = (
                (axis.src0[0], axis.srclen[0]) if axis.resampled else (axis.win0[0], axis.winlen[0])
            )
            if start != 0 or length != out.shape[dim]:
                out = out.narrow(dim, int(start), int(length))
        if self.resampled:
            # on first use (a flip or a crop alone does not need torchvision: seconds of imports)
            from torchvision.transforms.v2 import functional as tvf

            size = [
                int(self.y.reslen[0]) if self.y.resampled else out.shape[2],
                int(self.x.reslen[0]) if self.x.resampled else out.shape[3],
            ]
            out = tvf.resize(out, size, antialias=self.antialias)
            for dim, axis in ((2, self.y), (3, self.x)):
                if axis.resampled and (axis.win0[0] != 0 or axis.winlen[0] != out.shape[dim]):
                    out = out.narrow(dim, int(axis.win0[0]), int(axis.winlen[0]))
        if self.flip.any():
            mask = small_to_device(self.flip, out.device).view(-1, 1, 1, 1)
            out = torch.where(mask, out.flip(-1), out)
        return out

    def _execute_general(self) -> torch.Tensor:
        images = self.images
        n = self.n
        if isinstance(images, PackedImages):
            first, channels = images.flat, images.channels
        elif isinstance(images, torch.Tensor):
            first, channels = images, images.shape[1]
        else:
            first = images[0]
            channels = first.shape[0]
        device, dtype = first.device, first.dtype
        compute = torch.float64 if dtype == torch.float64 else torch.float32
        taps_y = self.y.taps(None, self.antialias)
        taps_x = self.x.taps(self.flip, self.antialias)
        out_h, out_w = int(self.y.winlen[0]), int(self.x.winlen[0])
        out = torch.empty((n, channels, out_h, out_w), dtype=dtype, device=device)
        if out_h == 0 or out_w == 0:
            return out

        # The source rectangle each image needs: origin (clamped so that it stays inside the
        # image where possible) and extent.
        lo_y, hi_y = taps_y.bounds()
        lo_x, hi_x = taps_x.bounds()
        span_y, span_x = hi_y - lo_y + 1, hi_x - lo_x + 1
        heights, widths = self.y.size, self.x.size

        # One flat buffer holds every image; row windows of it are views (unfold).
        if isinstance(images, torch.Tensor):
            flat = images.contiguous().view(-1)
            offsets = np.arange(n, dtype=np.int64) * (channels * heights * widths)
        elif isinstance(images, PackedImages):
            flat, offsets = images.flat, images.offsets
            # padding: a window that starts in a narrow image may run past the buffer's end (a
            # region decoder leaves room for it: no copy then)
            reach = int((offsets + channels * heights * widths).max()) + int(span_x.max())
            if flat.numel() < reach:
                flat = torch.cat([flat, flat.new_zeros(reach - flat.numel())])
        else:
            numels = np.array([t.numel() for t in images], dtype=np.int64)
            offsets = np.concatenate([[0], np.cumsum(numels)[:-1]]).astype(np.int64)
            # padding: a window that starts in a narrow image may run past its end
            flat = torch.cat([t.reshape(-1) for t in images] + [first.new_zeros(int(span_x.max()))])

        # The host plans every group (its table rows, each axis's bags of taps and their weights,
        # each image's place in the batch) into one int64 and one float array, sent to the device
        # in two copies; each group takes its pieces of them. So a batch costs the device a few
        # torch calls per group and no Python per image (each torch call returns to the
        # interpreter: on a GPU, beside the training thread, whose kernel launches wait for it).
        groups = _group_by_extent(span_y, span_x, rows_out=out_h)
        np_compute = np.float64 if compute == torch.float64 else np.float32
        many = len(groups) > 1
        plans = []
        int_sizes: list[int] = []  # per group: table rows, bags and offsets of each pass[, images]
        float_sizes: list[int] = []  # per group: the weights of each pass
        for rows in groups:
            n_g, rx = len(rows), int(span_x[rows].max())
            ky, kx = taps_y.width(rows), taps_x.width(rows)
            plans.append((rows, rx, ky, kx))
            int_sizes += [int(span_y[rows].sum()) * channels, n_g * out_h * ky, n_g * out_h]
            int_sizes += [n_g * out_w * kx, n_g * out_w] + ([n_g] if many else [])
            float_sizes += [n_g * out_h * ky, n_g * out_w * kx]
        ints = np.empty(sum(int_sizes), dtype=np.int64)
        floats = np.empty(sum(float_sizes), dtype=np_compute)
        int_parts = np.split(ints, np.cumsum(int_sizes)[:-1])
        float_parts = np.split(floats, np.cumsum(float_sizes)[:-1])
        per_group = 6 if many else 5
        for g, (rows, rx, ky, kx) in enumerate(plans):
            n_g, ry = len(rows), span_y[rows]
            oy = lo_y[rows]  # each image's own rows (its taps' bounds are inside it)
            ox = np.clip(lo_x[rows], 0, np.maximum(widths[rows] - rx, 0))
            picks, bags_y, offsets_y, bags_x, offsets_x = int_parts[per_group * g : per_group * g + 5]
            _region_rows(offsets[rows], heights[rows], widths[rows], channels, ry, oy, ox, picks)
            first_row = np.zeros(n_g, dtype=np.int64)  # each image's first row of the group's table
            np.cumsum(ry[:-1], out=first_row[1:])
            w_y, w_x = float_parts[2 * g], float_parts[2 * g + 1]
            taps_y.fill(rows, first_row - oy, bags_y.reshape(n_g, out_h, ky), w_y.reshape(n_g, out_h, ky))
            columns = np.arange(n_g, dtype=np.int64) * rx  # each image's first column after the transpose
            taps_x.fill(rows, columns - ox, bags_x.reshape(n_g, out_w, kx), w_x.reshape(n_g, out_w, kx))
            np.multiply(np.arange(len(offsets_y), dtype=np.int64), ky, out=offsets_y)  # where each bag starts
            np.multiply(np.arange(len(offsets_x), dtype=np.int64), kx, out=offsets_x)
            if many:
                int_parts[per_group * g + 5][:] = rows
        ints_there = small_to_device(ints, device).split(int_sizes)
        floats_there = small_to_device(floats, device).split(float_sizes)
        for g, (_, rx, _, _) in enumerate(plans):
            picks, bags_y, offsets_y, bags_x, offsets_x = ints_there[per_group * g : per_group * g + 5]
            result = _resample(
                flat,
                channels,
                rx,
                picks,
                (bags_y, offsets_y, floats_there[2 * g]),
                (bags_x, offsets_x, floats_there[2 * g + 1]),
                out_h,
                out_w,
            )
            if not dtype.is_floating_point:
                info = torch.iinfo(dtype)
                result = result.round_().clamp_(info.min, info.max)
            if not many:
                out.copy_(result)
            else:
                out.index_copy_(0, ints_there[per_group * g + 5], result.to(dtype))
        return out


def _group_by_extent(
    span_y: np.ndarray, span_x: np.ndarray, waste: float = 1.5, rows_out: int = 0
) -> list[np.ndarray]:
    """Splits a batch into the fewest groups whose resampling buffers -- each image's source rows
    and its ``rows_out`` rows after the vertical pass, as wide as its group's widest region (the
    rows the resampling reads and writes are windows of one width) -- cost at most ``waste``
    times the batch's own in all (so one huge image cannot blow up the memory of a whole batch,
    nor small crops join its group by the hundred); of the splits into that many groups, the one
    that costs least.

    Example: spans 300x300 (x63) and 3000x4000 (x1) give two groups, not 64 regions 4000 wide;
    crops of any heights and of widths within a factor of 1.5 of each other, one group.
    ``RandomResizedCrop``'s regions of photos of different sizes: three groups per batch of 256
    (each group's resampling is a dozen torch calls, kernel launches on a GPU; on the CPU, more
    padding costs more than it saves).
    """
    rows = (span_y + rows_out).astype(np.float64)
    order = np.argsort(-span_x, kind="stable")
    ys, xs = np.ascontiguousarray(rows[order]), np.ascontiguousarray(span_x[order], dtype=np.float64)
    starts = np.empty(len(order), dtype=np.int64)
    if _c_resample is not None and USE_C_TAPS:
        count = _c_resample.fewest_groups(ys, xs, float(waste), starts)
    else:
        count = _fewest_groups(ys, xs, waste, starts)
    bounds = [*starts[:count].tolist(), len(order)]
    return [np.sort(order[a:b]).astype(np.int64) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def _fewest_groups(ys: np.ndarray, xs: np.ndarray, waste: float, starts: np.ndarray) -> int:
    """The split of images sorted widest first (rows ``ys``, widths ``xs``) into the fewest runs
    whose rows, each run as wide as its first image, cost at most ``waste`` times ``sum(ys *
    xs)``; of those, the cheapest. Writes each run's first image into ``starts``; returns how many
    runs. Dynamic programming over the runs' ends, one run more at a time (all sums are of whole
    numbers, exact in float64: the C extension's ``fewest_groups`` gives the same split)."""
    n = len(ys)
    if n == 0:
        return 0
    total = np.zeros(n + 1)
    np.cumsum(ys, out=total[1:])
    bound = waste * float(np.cumsum(ys * xs)[-1])
    cost = xs[0] * total[1:]  # cost[j]: images 0..j in one run
    picks: list[np.ndarray] = []
    first = np.arange(1, n)[:, None]  # the last run's first image
    last = np.arange(n)[None, :]
    while cost[-1] > bound and len(picks) < n - 1:
        # one run more: images 0..j as the best split of 0..i-1 (one run fewer) plus the run i..j
        runs = cost[:-1, None] + xs[1:, None] * (total[None, 1:] - total[1:-1, None])
        runs = np.where(first <= last, runs, np.inf)
        pick = np.argmin(runs, axis=0)
        cost = runs[pick, np.arange(n)]
        picks.append(pick + 1)
    count, end = len(picks) + 1, n - 1
    for k, pick in enumerate(reversed(picks)):
        starts[count - 1 - k] = int(pick[end])
        end = int(pick[end]) - 1
    starts[0] = 0
    return count


def _region_rows(
    offsets: np.ndarray,
    heights: np.ndarray,
    widths: np.ndarray,
    channels: int,
    ry: np.ndarray,
    oy: np.ndarray,
    ox: np.ndarray,
    out: np.ndarray,
) -> None:
    """Where each row of a group's resampling table starts in the flat buffer, into ``out``.

    Image ``r`` (CHW from ``offsets[r]``, ``heights[r]`` x ``widths[r]``) gives its ``ry[r]`` rows
    from ``(oy[r], ox[r])``, each row's channels one after the other: the table row ``(r, row)``
    holds every channel's window of the row, so the vertical pass sums whole rows of all channels.
    In one call of the C extension where it is built.
    """
    args = [np.ascontiguousarray(a, dtype=np.int64) for a in (offsets, heights, widths, ry, oy, ox)]
    if _c_resample is not None and USE_C_TAPS:
        _c_resample.region_rows(*args, out)
        return
    offsets, heights, widths, ry, oy, ox = args
    rows = int(ry.sum())
    image = np.repeat(np.arange(len(ry), dtype=np.int64), ry)
    first = np.zeros(len(ry), dtype=np.int64)
    np.cumsum(ry[:-1], out=first[1:])
    row = np.arange(rows, dtype=np.int64) - first[image]  # each table row's row in its region
    start = offsets[image] + (oy[image] + row) * widths[image] + ox[image]
    plane = (heights * widths)[image]
    np.add(
        start[:, None],
        np.arange(channels, dtype=np.int64)[None, :] * plane[:, None],
        out=out.reshape(rows, channels),
    )


def _resample(
    flat: torch.Tensor,
    channels: int,
    rx: int,
    picks: torch.Tensor,
    taps_y: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    taps_x: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    out_h: int,
    out_w: int,
) -> torch.Tensor:
    """Separable resampling of one group: ``(n, C, out_h, out_w)`` float, layout-permuted view.

    ``flat`` holds the images; ``picks`` (see :func:`_region_rows`) are where the ``rx`` pixels of
    each region row of each channel start: the group's table has a row of ``C * rx`` values per
    region row. ``taps_y`` are the vertical pass's bags of table rows (``n * out_h`` bags, flat),
    where each bag starts, and their weights; ``taps_x`` the same for the horizontal pass's bags of
    columns of the vertical pass's transposed output (image ``r``'s columns from ``r * rx``,
    ``n * out_w`` bags). Each output value is ``sum_a sum_b wy[a] * wx[b] * S[py[a], px[b]]``,
    summed in tap order.
    """
    bags_y, starts_y, w_y = taps_y
    bags_x, starts_x, w_x = taps_x
    n = starts_y.shape[0] // out_h
    table = flat.unfold(0, rx, 1).index_select(0, picks).to(w_y.dtype).view(-1, channels * rx)
    t1 = nnf.embedding_bag(bags_y, table, starts_y, mode="sum", per_sample_weights=w_y)
    # Horizontal pass on the transposed intermediate, whose rows are now (image, column).
    t1 = t1.view(n, out_h, channels, rx).permute(0, 3, 2, 1).reshape(n * rx, channels * out_h)
    t2 = nnf.embedding_bag(bags_x, t1, starts_x, mode="sum", per_sample_weights=w_x)
    return t2.view(n, out_w, channels, out_h).permute(0, 2, 3, 1)


# --------------------------------------------------------------------------------------------
# Transforms
# --------------------------------------------------------------------------------------------


class BatchTransform:
    """Base class: a transform of a whole batch, called as ``t(images, indices=..., epoch=..., seed=...)``.

    Attributes:
        stream: The random-stream id this class draws from (0 for deterministic transforms).
    """

    stream: int = 0

    def __call__(
        self, images: Images, *, indices: Indices = None, epoch: int = 0, seed: int = 0
    ) -> torch.Tensor:
        raise NotImplementedError

    def _extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._extra_repr()})"


def apply_transform(
    transform: Callable[..., Any], images: Any, indices: Indices, epoch: int, seed: int
) -> Any:
    """Calls a fastload transform with the per-sample keys, any other callable with the images only.

    This is how :class:`Compose` and :class:`fastload.prefetch.CUDAPrefetcher` apply a transform:
    ``apply_transform(gpu.RandomHorizontalFlip(), x, [4, 9], epoch=1, seed=0)`` flips image ``k``
    as drawn for sample ``indices[k]``; ``apply_transform(torchvision_transform, x, ...)`` is
    ``torchvision_transform(x)``.
    """
    if isinstance(transform, BatchTransform):
        return transform(images, indices=indices, epoch=epoch, seed=seed)
    return transform(images)


class _Geometric(BatchTransform):
    """A transform expressible as crops, resizes and flips; fusable with its neighbours."""

    def _update(self, plan: _Plan, indices: Indices, epoch: int, seed: int) -> bool:
        """Adds this transform to ``plan``; returns False if the plan must be executed first."""
        raise NotImplementedError

    def __call__(
        self, images: Images, *, indices: Indices = None, epoch: int = 0, seed: int = 0
    ) -> torch.Tensor:
        plan = _Plan(images)
        self._update(plan, indices, epoch, seed)
        return plan.execute()


class Compose(BatchTransform):
    """Applies transforms in order, fusing consecutive geometric ones into one resampling pass.

    Any callable may appear in the list; fastload transforms receive ``indices``, ``epoch`` and
    ``seed``, other callables (e.g. a torchvision transform) get the images only.

    Args:
        transforms: The transforms, applied first to last.

    Example:
        >>> import torch
        >>> images = [torch.zeros(3, 300, 400, dtype=torch.uint8),
        ...           torch.zeros(3, 500, 260, dtype=torch.uint8)]
        >>> Compose([Resize(256), CenterCrop(224)])(images).shape   # different aspect ratios: fused
        torch.Size([2, 3, 224, 224])
    """

    def __init__(self, transforms: Sequence[Callable[..., Any]]) -> None:
        if not isinstance(transforms, Sequence) or not all(callable(t) for t in transforms):
            raise TypeError(
                f"transforms should be a sequence of callables, but got transforms={transforms!r}"
            )
        self.transforms = list(transforms)

    def __call__(self, images: Images, *, indices: Indices = None, epoch: int = 0, seed: int = 0) -> Any:
        plan: _Plan | None = None
        for t in self.transforms:
            if isinstance(t, _Geometric):
                if plan is None:
                    plan = _Plan(images)
                if not t._update(plan, indices, epoch, seed):
                    plan = _Plan(plan.execute())
                    t._update(plan, indices, epoch, seed)
                continue
            if plan is not None:
                images, plan = plan.execute(), None
            images = apply_transform(t, images, indices, epoch, seed)
        return plan.execute() if plan is not None else images

    def __repr__(self) -> str:
        inner = "".join(f"\n    {t!r}," for t in self.transforms)
        return f"Compose([{inner}\n])"


def crop_resize(
    images: Images,
    top: np.ndarray,
    left: np.ndarray,
    height: np.ndarray,
    width: np.ndarray,
    size: tuple[int, int],
    antialias: bool = True,
) -> torch.Tensor:
    """Image ``k``'s box ``(top[k], left[k], height[k], width[k])`` resized to ``size``, for the
    whole batch in one resampling pass: what :class:`RandomResizedCrop` does with the boxes it
    draws (the same taps, so the same pixels), for boxes drawn elsewhere (a region decoder's).

    Returns:
        An ``(N, C, size[0], size[1])`` tensor, of the images' dtype.

    Raises:
        ValueError: If a box argument has not one entry per image, or a box is empty or reaches
            outside its image (naming the first such image).
    """
    heights, widths = _image_sizes(images)
    n = len(heights)
    box = []
    for name, value in (("top", top), ("left", left), ("height", height), ("width", width)):
        array = np.asarray(value, dtype=np.int64).reshape(-1)
        if len(array) != n:
            raise ValueError(f"{name} should have one entry per image ({n}), but got {len(array)}")
        box.append(array)
    t, lft, h, w = box
    bad = np.flatnonzero((h < 1) | (w < 1) | (t < 0) | (lft < 0) | (t + h > heights) | (lft + w > widths))
    if len(bad):
        k = int(bad[0])
        raise ValueError(
            f"box {k} (top {t[k]}, left {lft[k]}, height {h[k]}, width {w[k]}) should be non-empty and "
            f"inside image {k} ({heights[k]}x{widths[k]})"
        )
    if n == 0 and isinstance(images, torch.Tensor):  # an empty batch: an empty batch of that size
        return images.new_empty((0, images.shape[1], int(size[0]), int(size[1])))
    plan = _Plan(images)
    plan.crop(t, lft, h, w)
    plan.resize(np.full(plan.n, size[0]), np.full(plan.n, size[1]), antialias)
    plan.random_geometry = True
    return plan.execute()


class RandomResizedCrop(_Geometric):
    """Crops a random box of each image and resizes it to ``size`` (torchvision's semantics, per sample).

    The box of each image follows ``torchvision.transforms.RandomResizedCrop.get_params``: up to
    10 attempts of (area fraction in ``scale``, log-uniform aspect ratio in ``ratio``), the first
    that fits wins, at a uniformly random position; if none fits, the central crop with the ratio
    clamped into ``ratio``. The attempts of the whole batch are evaluated at once in numpy.

    Args:
        size: Output ``(h, w)``, or an int for a square.
        scale: Range of the crop's area as a fraction of the image's.
        ratio: Range of the crop's aspect ratio (width / height).
        interpolation: Only bilinear is implemented.
        antialias: Antialias downscales (torch's triangle filter), like torchvision's default.

    Example:
        >>> import torch
        >>> t = RandomResizedCrop(64)
        >>> images = torch.randint(0, 256, (4, 3, 100, 80), dtype=torch.uint8)
        >>> top, left, height, width = t.get_params(images, indices=[10, 11, 12, 13], epoch=1, seed=0)
        >>> t(images, indices=[10, 11, 12, 13], epoch=1).shape
        torch.Size([4, 3, 64, 64])
    """

    stream = 0x47500001

    def __init__(
        self,
        size: int | Sequence[int],
        scale: Sequence[float] = (0.08, 1.0),
        ratio: Sequence[float] = (3.0 / 4.0, 4.0 / 3.0),
        interpolation: Any = "bilinear",
        antialias: bool = True,
    ) -> None:
        self.size = check_size(size)
        self.scale = _check_range(scale, "scale", 0.0)
        self.ratio = _check_range(ratio, "ratio", 0.0)
        if self.ratio[0] <= 0:
            raise ValueError(f"ratio should be positive, but got ratio={ratio!r}")
        _check_interpolation(interpolation)
        self.antialias = bool(antialias)

    def _extra_repr(self) -> str:
        return f"size={self.size}, scale={self.scale}, ratio={self.ratio}, antialias={self.antialias}"

    def _params(
        self, heights: np.ndarray, widths: np.ndarray, u: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        n = len(heights)
        _refuse_empty(heights, widths, "no crop can be drawn from it")
        height = heights.astype(np.float64)[:, None]
        width = widths.astype(np.float64)[:, None]
        area = height * width
        log_lo, log_hi = math.log(self.ratio[0]), math.log(self.ratio[1])
        target = area * (self.scale[0] + (self.scale[1] - self.scale[0]) * u[:, 0:10])
        aspect = np.exp(log_lo + (log_hi - log_lo) * u[:, 10:20])
        w = np.round(np.sqrt(target * aspect)).astype(np.int64)  # round half to even, like round()
        h = np.round(np.sqrt(target / aspect)).astype(np.int64)
        fits = (w > 0) & (w <= widths[:, None]) & (h > 0) & (h <= heights[:, None])
        attempt = np.argmax(fits, axis=1)
        rows = np.arange(n)
        found = fits[rows, attempt]
        h, w = h[rows, attempt], w[rows, attempt]
        top = _randint(u[rows, 20 + attempt], heights - h + 1)
        left = _randint(u[rows, 30 + attempt], widths - w + 1)
        # Fallback: central crop, aspect ratio clamped into `ratio`.
        in_ratio = widths / heights
        fb_w = np.where(
            in_ratio < self.ratio[0],
            widths,
            np.where(in_ratio > self.ratio[1], np.round(heights * self.ratio[1]).astype(np.int64), widths),
        )
        fb_h = np.where(in_ratio < self.ratio[0], np.round(widths / self.ratio[0]).astype(np.int64), heights)
        h = np.where(found, h, fb_h)
        w = np.where(found, w, fb_w)
        top = np.where(found, top, (heights - h) // 2)
        left = np.where(found, left, (widths - w) // 2)
        return top, left, h, w

    def get_params(
        self, images: Images, *, indices: Indices = None, epoch: int = 0, seed: int = 0
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The crop boxes ``(top, left, height, width)`` drawn for these images (int64 arrays)."""
        return self.boxes(*_image_sizes(images), indices=indices, epoch=epoch, seed=seed)

    def boxes(
        self, heights: Any, widths: Any, *, indices: Indices = None, epoch: int = 0, seed: int = 0
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The crop boxes :meth:`get_params` draws for images of these sizes, without the images.

        A sample's box depends only on its size and ``(seed, epoch, index)``: ``decode="hybrid"``
        crops the samples its CPU workers decode with the boxes this draws for them (one at a
        time), the same as the device draws for a whole batch.

        Example:
            >>> t = RandomResizedCrop(224)
            >>> one = t.boxes([375], [500], indices=[7], epoch=2, seed=0)
            >>> two = t.boxes([480, 375], [640, 500], indices=[3, 7], epoch=2, seed=0)
            >>> [int(a[0]) for a in one] == [int(a[1]) for a in two]
            True
        """
        heights = np.asarray(heights, dtype=np.int64).reshape(-1)
        widths = np.asarray(widths, dtype=np.int64).reshape(-1)
        return self._params(heights, widths, _uniforms(len(heights), indices, epoch, seed, self.stream, 40))

    def box(
        self, height: int, width: int, *, index: int, epoch: int = 0, seed: int = 0
    ) -> tuple[int, int, int, int]:
        """:meth:`boxes` for one image of sample ``index``, in plain Python (about 20x faster for
        one image; the same box: the same draws and the same float operations, in the same order).
        What ``decode="hybrid"``'s CPU workers crop with."""
        u = rng.SampleRNG(seed, epoch, index, self.stream).draw
        area = float(height) * float(width)
        (s0, s1), (r0, r1) = self.scale, self.ratio
        log_lo, log_hi = math.log(r0), math.log(r1)
        for a in range(10):
            target = area * (s0 + (s1 - s0) * u(a))
            aspect = float(np.exp(log_lo + (log_hi - log_lo) * u(10 + a)))  # numpy's exp, as in boxes
            w = round(math.sqrt(target * aspect))  # round half to even, as np.round
            h = round(math.sqrt(target / aspect))
            if 0 < w <= width and 0 < h <= height:
                top = min(int(u(20 + a) * (height - h + 1)), height - h)
                left = min(int(u(30 + a) * (width - w + 1)), width - w)
                return top, left, h, w
        in_ratio = width / height
        if in_ratio < r0:
            w, h = width, round(width / r0)
        elif in_ratio > r1:
            w, h = round(height * r1), height
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w

    def _update(self, plan: _Plan, indices: Indices, epoch: int, seed: int) -> bool:
        if plan.resampled:
            return False
        heights, widths = plan.sizes()
        top, left, h, w = self._params(heights, widths, plan.draw(indices, epoch, seed, self.stream, 40))
        plan.crop(top, left, h, w)
        plan.resize(np.full(plan.n, self.size[0]), np.full(plan.n, self.size[1]), self.antialias)
        plan.random_geometry = True
        return True


class Resize(_Geometric):
    """Resizes every image (torchvision's ``Resize``: an int sets the shorter side).

    With an int ``size``, images of different aspect ratios get different sizes, which cannot
    form one batch on their own: follow ``Resize`` with :class:`CenterCrop` inside a
    :class:`Compose` (fused, only the crop is computed), or pass ``(h, w)``.

    Args:
        size: ``(h, w)``, or an int for the shorter side (the longer one keeps the aspect ratio,
            ``int(size * long / short)``, as in torchvision).
        max_size: Caps the longer side when ``size`` is an int.
        interpolation: Only bilinear is implemented.
        antialias: Antialias downscales.

    Example:
        >>> import torch
        >>> Resize(32)(torch.zeros(2, 3, 40, 80, dtype=torch.uint8)).shape
        torch.Size([2, 3, 32, 64])
    """

    def __init__(
        self,
        size: int | Sequence[int],
        max_size: int | None = None,
        interpolation: Any = "bilinear",
        antialias: bool = True,
    ) -> None:
        self.short = isinstance(size, numbers.Integral) or (isinstance(size, Sequence) and len(size) == 1)
        self.size = check_size(size)
        if max_size is not None:
            if not self.short:
                raise ValueError(f"max_size should only be given when size is an int, but got size={size!r}")
            if not isinstance(max_size, numbers.Integral) or max_size <= self.size[0]:
                raise ValueError(f"max_size should be an int larger than size, but got max_size={max_size!r}")
        self.max_size = max_size
        _check_interpolation(interpolation)
        self.antialias = bool(antialias)

    def _extra_repr(self) -> str:
        size = self.size[0] if self.short else self.size
        return f"size={size}, max_size={self.max_size}, antialias={self.antialias}"

    def output_sizes(self, heights: np.ndarray, widths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per-image output ``(heights, widths)`` for input sizes (torchvision's rule, vectorised)."""
        if not self.short:
            return np.full(len(heights), self.size[0]), np.full(len(heights), self.size[1])
        _refuse_empty(heights, widths, "it cannot be resized")
        short = np.minimum(heights, widths)
        long = np.maximum(heights, widths)
        new_short = np.full(len(heights), self.size[0], dtype=np.int64)
        new_long = (self.size[0] * long / short).astype(np.int64)  # int() truncation
        if self.max_size is not None:
            over = new_long > self.max_size
            capped = (self.max_size * new_short / np.maximum(new_long, 1)).astype(np.int64)
            new_short = np.where(over, capped, new_short)
            new_long = np.where(over, self.max_size, new_long)
        portrait = widths <= heights
        return np.where(portrait, new_long, new_short), np.where(portrait, new_short, new_long)

    def _update(self, plan: _Plan, indices: Indices, epoch: int, seed: int) -> bool:
        if plan.resampled:
            return False
        plan.resize(*self.output_sizes(*plan.sizes()), self.antialias)
        return True


class CenterCrop(_Geometric):
    """Crops the centre of every image (torchvision's ``CenterCrop``, zero padding if the crop is larger).

    Placement follows torchvision exactly. Worked example, one axis: an image 100 high cropped to
    57 starts at row ``round(43 / 2) = 22`` (round half to even: 21.5 -> 22, but 20.5 -> 20 for
    41 spare rows); cropped to 125, it gets ``25 // 2 = 12`` zero rows above and 13 below.

    Args:
        size: ``(h, w)``, or an int for a square.

    Example:
        >>> import torch
        >>> CenterCrop(4)(torch.arange(36, dtype=torch.uint8).view(1, 1, 6, 6))[0, 0, 0].tolist()
        [7, 8, 9, 10]
    """

    def __init__(self, size: int | Sequence[int]) -> None:
        self.size = check_size(size)

    def _extra_repr(self) -> str:
        return f"size={self.size}"

    def _update(self, plan: _Plan, indices: Indices, epoch: int, seed: int) -> bool:
        heights, widths = plan.sizes()
        ch, cw = self.size

        def anchor(size: np.ndarray, crop: int) -> np.ndarray:
            # Padding case: torchvision pads (crop - size) // 2 before; else round((size - crop) / 2).
            return np.where(
                crop > size, -((crop - size) // 2), np.round((size - crop) / 2.0).astype(np.int64)
            )

        plan.crop(anchor(heights, ch), anchor(widths, cw), np.full(plan.n, ch), np.full(plan.n, cw))
        return True


class RandomHorizontalFlip(_Geometric):
    """Flips each image left-right with probability ``p``, decided per sample.

    Args:
        p: Probability of flipping an image.

    Example:
        >>> import torch
        >>> t = RandomHorizontalFlip(p=1.0)
        >>> t(torch.tensor([[[[1, 2, 3]]]], dtype=torch.uint8)).tolist()
        [[[[3, 2, 1]]]]
    """

    stream = 0x47500002

    def __init__(self, p: float = 0.5) -> None:
        self.p = check_probability(p)

    def _extra_repr(self) -> str:
        return f"p={self.p}"

    def get_params(
        self, images: Images, *, indices: Indices = None, epoch: int = 0, seed: int = 0
    ) -> np.ndarray:
        """Which images get flipped (bool array)."""
        return _uniforms(_batch_size(images), indices, epoch, seed, self.stream, 1)[:, 0] < self.p

    def _update(self, plan: _Plan, indices: Indices, epoch: int, seed: int) -> bool:
        plan.flip = plan.flip ^ (plan.draw(indices, epoch, seed, self.stream, 1)[:, 0] < self.p)
        return True


def _grayscale(images: torch.Tensor) -> torch.Tensor:
    """torchvision's luma, as a float ``(N, 1, H, W)`` tensor (floored for integer images)."""
    r, g, b = images.unbind(dim=1)
    gray = r.mul(0.2989).add_(g, alpha=0.587).add_(b, alpha=0.114).unsqueeze(1)
    return gray if images.is_floating_point() else gray.floor_()


class ColorJitter(BatchTransform):
    """Random brightness, contrast and saturation per sample, in a random order per sample.

    Matches torchvision's ``ColorJitter`` (without hue): each enabled factor is uniform in its
    range, and the three adjustments are applied in a random order, using the same arithmetic
    as ``torchvision.transforms.v2.functional.adjust_*`` (blend with black / the mean grey / the
    greyscale image, clamp, truncate back to uint8). Samples sharing an order are processed
    together, so a batch costs at most nine batched kernels.

    Args:
        brightness: ``b`` for a factor in ``[max(0, 1 - b), 1 + b]``, or ``(min, max)``.
        contrast: Same, for contrast.
        saturation: Same, for saturation.

    Example:
        >>> t = ColorJitter(brightness=0.4, contrast=0.4, saturation=0.4)
        >>> p = t.get_params(torch.zeros(2, 3, 8, 8), indices=[0, 1])
        >>> sorted(p), p["order"].shape
        (['brightness', 'contrast', 'order', 'saturation'], (2, 3))
    """

    stream = 0x47500003
    _NAMES = ("brightness", "contrast", "saturation")

    def __init__(self, brightness: Any = 0, contrast: Any = 0, saturation: Any = 0) -> None:
        self.brightness = self._check(brightness, "brightness")
        self.contrast = self._check(contrast, "contrast")
        self.saturation = self._check(saturation, "saturation")

    @staticmethod
    def _check(value: Any, name: str) -> tuple[float, float] | None:
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            if value < 0:
                raise ValueError(f"{name} should be a non-negative number, but got {name}={value!r}")
            lo, hi = max(0.0, 1.0 - float(value)), 1.0 + float(value)
        else:
            lo, hi = _check_range(value, name, 0.0)
        return None if lo == hi == 1.0 else (lo, hi)

    def _extra_repr(self) -> str:
        return f"brightness={self.brightness}, contrast={self.contrast}, saturation={self.saturation}"

    def get_params(
        self, images: Images, *, indices: Indices = None, epoch: int = 0, seed: int = 0
    ) -> dict[str, Any]:
        """Per-image factors (``None`` when disabled) and ``order``: ``(N, 3)`` op ids (0 b, 1 c, 2 s)."""
        n = _batch_size(images)
        u = _uniforms(n, indices, epoch, seed, self.stream, 6)
        params: dict[str, Any] = {"order": np.argsort(u[:, 0:3], axis=1, kind="stable")}
        for k, (name, rng_) in enumerate(
            zip(self._NAMES, (self.brightness, self.contrast, self.saturation), strict=False)
        ):
            params[name] = None if rng_ is None else rng_[0] + (rng_[1] - rng_[0]) * u[:, 3 + k]
        return params

    @staticmethod
    def _blend(images: torch.Tensor, other: torch.Tensor, factor: np.ndarray) -> torch.Tensor:
        compute = images.dtype if images.is_floating_point() else torch.get_default_dtype()
        ratio = small_to_device(factor, images.device, compute).view(-1, 1, 1, 1)
        alpha = small_to_device(1.0 - factor, images.device, compute).view(-1, 1, 1, 1)
        # addcmul rounds a + alpha * b once, like torchvision's add_(b, alpha=...): bit-identical.
        return torch.addcmul(images.mul(ratio), other, alpha)

    def _apply(self, op: int, images: torch.Tensor, factor: np.ndarray) -> torch.Tensor:
        fp = images.is_floating_point()
        bound = 1.0 if fp else float(torch.iinfo(images.dtype).max)
        if op == 0:
            compute = images.dtype if fp else torch.get_default_dtype()
            out = images.mul(small_to_device(factor, images.device, compute).view(-1, 1, 1, 1))
        elif op == 1:
            mean = _grayscale(images).mean(dim=(-3, -2, -1), keepdim=True)
            out = self._blend(images, mean, factor)
        else:
            out = self._blend(images, _grayscale(images), factor)
        out = out.clamp_(0, bound)
        return out if fp else out.to(images.dtype)

    def __call__(
        self, images: Images, *, indices: Indices = None, epoch: int = 0, seed: int = 0
    ) -> torch.Tensor:
        images = _require_tensor(images, "ColorJitter")
        if images.shape[1] != 3:
            raise ValueError(f"ColorJitter needs RGB images (3 channels), but got {images.shape[1]} channels")
        params = self.get_params(images, indices=indices, epoch=epoch, seed=seed)
        out = images
        for stage in range(3):
            ops = params["order"][:, stage]
            staged: torch.Tensor | None = None
            for op, name in enumerate(self._NAMES):
                factor = params[name]
                chosen = ops == op
                if factor is None or not chosen.any():
                    continue
                if chosen.all():
                    out = self._apply(op, out, factor)
                    break
                rows = small_to_device(np.nonzero(chosen)[0], out.device)
                if staged is None:
                    staged = out.clone()
                staged.index_copy_(0, rows, self._apply(op, out.index_select(0, rows), factor[chosen]))
            if staged is not None:
                out = staged
        return out


class RandomErasing(BatchTransform):
    """Erases a random rectangle of each image with probability ``p`` (torchvision's ``RandomErasing``).

    The rectangle of each image follows torchvision's parameter search (10 attempts with area in
    ``scale`` and log-uniform ``ratio``, the rectangle must be strictly smaller than the image; if
    none fits, the image is left unchanged). ``value="random"`` is not supported: per-pixel noise
    has no cheap per-sample stream.

    Args:
        p: Probability of erasing an image.
        scale: Range of the erased area as a fraction of the image's.
        ratio: Range of the rectangle's aspect ratio (height / width, as in torchvision).
        value: Fill value, one number or one per channel (cast to the image dtype).

    Example:
        >>> import torch
        >>> t = RandomErasing(p=1.0, value=0)
        >>> out = t(torch.full((2, 3, 32, 32), 7, dtype=torch.uint8), indices=[0, 1])
        >>> bool((out == 0).any()), bool((out == 7).any())
        (True, True)
    """

    stream = 0x47500004

    def __init__(
        self,
        p: float = 0.5,
        scale: Sequence[float] = (0.02, 0.33),
        ratio: Sequence[float] = (0.3, 3.3),
        value: float | Sequence[float] = 0,
    ) -> None:
        self.p = check_probability(p)
        self.scale = _check_range(scale, "scale", 0.0, 1.0)
        self.ratio = _check_range(ratio, "ratio", 0.0)
        if self.ratio[0] <= 0:
            raise ValueError(f"ratio should be positive, but got ratio={ratio!r}")
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            self.value = [float(value)]
        elif (
            isinstance(value, Sequence)
            and not isinstance(value, str)
            and len(value) > 0
            and all(isinstance(v, numbers.Real) for v in value)
        ):
            self.value = [float(v) for v in value]
        else:
            raise TypeError(
                "value should be a number or a sequence of numbers (one per channel), but got "
                f"value={value!r}"
            )

    def _extra_repr(self) -> str:
        return f"p={self.p}, scale={self.scale}, ratio={self.ratio}, value={self.value}"

    def get_params(
        self, images: Images, *, indices: Indices = None, epoch: int = 0, seed: int = 0
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(erase, top, left, height, width)``: which images are erased and their rectangles."""
        images = _require_tensor(images, "RandomErasing")
        n, _, img_h, img_w = images.shape
        u = _uniforms(n, indices, epoch, seed, self.stream, 41)
        area = float(img_h * img_w) * (self.scale[0] + (self.scale[1] - self.scale[0]) * u[:, 1:11])
        log_lo, log_hi = math.log(self.ratio[0]), math.log(self.ratio[1])
        aspect = np.exp(log_lo + (log_hi - log_lo) * u[:, 11:21])
        h = np.round(np.sqrt(area * aspect)).astype(np.int64)
        w = np.round(np.sqrt(area / aspect)).astype(np.int64)
        fits = (h < img_h) & (w < img_w)
        attempt = np.argmax(fits, axis=1)
        rows = np.arange(n)
        found = fits[rows, attempt]
        h, w = np.where(found, h[rows, attempt], 0), np.where(found, w[rows, attempt], 0)
        top = np.where(found, _randint(u[rows, 21 + attempt], img_h - h + 1), 0)
        left = np.where(found, _randint(u[rows, 31 + attempt], img_w - w + 1), 0)
        return (u[:, 0] < self.p) & found, top, left, h, w

    def __call__(
        self, images: Images, *, indices: Indices = None, epoch: int = 0, seed: int = 0
    ) -> torch.Tensor:
        images = _require_tensor(images, "RandomErasing")
        channels = images.shape[1]
        if len(self.value) not in (1, channels):
            raise ValueError(
                f"value should have 1 or {channels} (channels) entries, but got {len(self.value)} entries"
            )
        erase, top, left, h, w = self.get_params(images, indices=indices, epoch=epoch, seed=seed)
        if not erase.any():
            return images
        device = images.device
        ys = np.arange(images.shape[2])[None, :]
        xs = np.arange(images.shape[3])[None, :]
        in_rows = small_to_device(erase[:, None] & (ys >= top[:, None]) & (ys < (top + h)[:, None]), device)
        in_cols = small_to_device((xs >= left[:, None]) & (xs < (left + w)[:, None]), device)
        mask = in_rows[:, None, :, None] & in_cols[:, None, None, :]
        fill = small_to_device(torch.tensor(self.value, dtype=torch.float32).to(images.dtype), device).view(
            1, -1, 1, 1
        )
        return torch.where(mask, fill, images)


class HostBufferPool:
    """Recycles large CPU output tensors, never handing out memory that is still referenced.

    Allocating a fresh 20-40 MB float batch each step costs more than filling it: the kernel
    maps and zeroes every page on first touch (glibc serves blocks this size with ``mmap``).
    Measured on a 64x3x224x224 float32 batch on this machine: normalizing into a new tensor took
    50 ms, into a reused one 27 ms. Reusing a fixed ring of outputs is only safe if nobody keeps a
    batch; this pool instead ties each buffer to the lifetime of the tensor's *storage*: the
    buffer goes back to the pool only when the tensor, all its views, ``.detach()``-ed copies,
    ``.numpy()`` arrays and autograd's saved references are gone. A batch you keep stays yours.

    Free buffers are kept newest first, at most ``max_idle`` of them and ``max_idle_bytes`` in
    all; older ones (e.g. of a batch shape no longer used) are released to the OS.

    Two limits of tensors made here: their storage cannot grow (``resize_`` to a larger size
    raises), and ``share_memory_()`` moves a tensor to new memory, so arrays exported from it
    *before* that call (``.numpy()``, DLPack) see recycled memory afterwards, as they would see
    freed memory with plain torch tensors.

    Args:
        max_idle: Free buffers kept, over all shapes.
        max_idle_bytes: Bytes of free buffers kept, over all shapes.
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
        # Re-entrant: a finalizer (_release) can run inside the garbage collector while this
        # thread is in the pool's own code.
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
        """How many free buffers the pool holds (for tests and debugging)."""
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

    The arithmetic is torchvision's ``ToDtype(float32, scale=True)`` then ``Normalize``, op for
    op, so float32 results are bit-identical to it; float16/bfloat16 outputs are computed in
    float32 and cast once (more accurate than doing the arithmetic in half precision).

    Args:
        mean: Per-channel means (in [0, 1] units), or one number. Values above 1 are taken as
            0-255 units (``mean=(123.675, 116.28, 103.53)``, DALI's habit): mean and std are
            then divided by 255, with a warning.
        std: Per-channel standard deviations, non-zero (same units as ``mean``).
        dtype: Output floating dtype.
        channels_last: Return a ``torch.channels_last`` tensor.
        buffers: 0 (default): every call returns a tensor of its own (on the CPU taken from
            :data:`host_pool`, which reuses the memory of batches that no longer exist: no page
            faults, no aliasing). ``k > 0`` writes the outputs into a ring of
            ``k`` reusable tensors while shapes match: the result of call ``t`` is overwritten by
            call ``t + k``. ``buffers=2`` is safe with :class:`fastload.CUDAPrefetcher` as long
            as you do not keep batches beyond the next step.

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
            # 0-255 units (DALI's and OpenCV's habit): the inputs are scaled to [0, 1] first.
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
        """``(3, 256)`` float32: this transform's arithmetic run on every uint8 value of each channel
        (elementwise, so looking pixels up in it gives the same bits as converting them)."""
        if self._lut is None:
            values = torch.arange(256, dtype=torch.uint8).view(1, 1, 1, 256).expand(1, 3, 1, 256)
            work = torch.empty(values.shape, dtype=torch.float32)
            work.copy_(values)
            work.mul_(1.0 / 255)
            mean = torch.tensor(self.mean, dtype=torch.float32).view(-1, 1, 1)
            std = torch.tensor(self.std, dtype=torch.float32).view(-1, 1, 1)
            work.sub_(mean).div_(std)
            self._lut = np.ascontiguousarray(work.view(3, 256).numpy())
            # with AVX2 the C extension computes these values where that gives the table's bits
            self._affine = affine_for_table(self._lut, 1.0 / 255, False, self.mean, self.std)
        return self._lut

    def _by_table(self, images: torch.Tensor, out: torch.Tensor) -> bool:
        """A CPU uint8 RGB batch in channels-last memory (the fast path's batches) to a contiguous
        float32 ``out``: a table lookup per pixel that also moves the channels first, in the C
        extension (about 3x faster than the four elementwise passes). ``False`` where it does not
        apply (nothing written)."""
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
        images = _require_tensor(images, "Normalize")
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
        # On the CPU, one large image at a time: the four passes then run in the cache instead of
        # streaming the whole batch through memory four times (16 vs 27 ms for 64x3x224x224 here);
        # small images in one go (four calls per image would cost more than the passes). Same
        # elementwise arithmetic, so the same bits.
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
