"""Crops, resizes and flips of a batch (torchvision's semantics, per sample), first in its device
transforms: each adds its step to a :class:`~fastload.gpu.resample.GeometryPlan`, and
:class:`Compose` runs consecutive ones as one resampling pass (``Resize(256)`` + ``CenterCrop(224)``
computes only the 224x224 window). The result equals applying them in turn: bit for bit for crops
and flips after the resize, within one uint8 level for a flip before it.

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

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from .. import rng
from .._checks import check_probability, check_size
from .base import (
    BatchTransform,
    Images,
    Indices,
    apply_transform,
    batch_size,
    check_range,
    image_sizes,
    randint,
    refuse_empty,
    uniforms,
)
from .resample import GeometryPlan

__all__ = ["CenterCrop", "Compose", "RandomHorizontalFlip", "RandomResizedCrop", "Resize", "crop_resize"]


def _check_interpolation(interpolation: Any) -> None:
    value = getattr(interpolation, "value", interpolation)
    if value != "bilinear":
        raise ValueError(
            "only bilinear interpolation is implemented for batched transforms, "
            f"but got interpolation={interpolation!r}"
        )


class _Geometric(BatchTransform):
    """A transform expressible as crops, resizes and flips; fusable with its neighbours."""

    def _update(self, plan: GeometryPlan, indices: Indices, epoch: int, seed: int) -> bool:
        """Adds this transform to ``plan``; False: the plan must be executed first."""
        raise NotImplementedError

    def __call__(
        self, images: Images, *, indices: Indices = None, epoch: int = 0, seed: int = 0
    ) -> torch.Tensor:
        plan = GeometryPlan(images)
        self._update(plan, indices, epoch, seed)
        return plan.execute()


class Compose(BatchTransform):
    """Applies transforms in order, fusing consecutive geometric ones into one resampling pass.

    Any callable may appear (see :func:`~fastload.gpu.base.apply_transform`).

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
        plan: GeometryPlan | None = None
        for t in self.transforms:
            if isinstance(t, _Geometric):
                if plan is None:
                    plan = GeometryPlan(images)
                if not t._update(plan, indices, epoch, seed):
                    plan = GeometryPlan(plan.execute())
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
    """Image ``k``'s box ``(top[k], left[k], height[k], width[k])`` resized to ``size`` in one
    pass: :class:`RandomResizedCrop`'s resize for boxes drawn elsewhere (a region decoder's)."""
    heights, widths = image_sizes(images)
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
    plan = GeometryPlan(images)
    plan.crop(t, lft, h, w)
    plan.resize(np.full(plan.n, size[0]), np.full(plan.n, size[1]), antialias)
    plan.random_geometry = True
    return plan.execute()


class RandomResizedCrop(_Geometric):
    """Crops a random box of each image and resizes it to ``size`` (torchvision's semantics, per sample).

    The boxes follow ``torchvision.transforms.RandomResizedCrop.get_params`` (10 attempts, then
    the central crop); only bilinear interpolation is implemented.

    Example:
        >>> import torch
        >>> t = RandomResizedCrop(64)
        >>> images = torch.randint(0, 256, (4, 3, 100, 80), dtype=torch.uint8)
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
        self.scale = check_range(scale, "scale", 0.0)
        self.ratio = check_range(ratio, "ratio", 0.0)
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
        refuse_empty(heights, widths, "no crop can be drawn from it")
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
        top = randint(u[rows, 20 + attempt], heights - h + 1)
        left = randint(u[rows, 30 + attempt], widths - w + 1)
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
        return self.boxes(*image_sizes(images), indices=indices, epoch=epoch, seed=seed)

    def boxes(
        self, heights: Any, widths: Any, *, indices: Indices = None, epoch: int = 0, seed: int = 0
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`get_params` from the images' sizes: a box depends only on its image's size and
        ``(seed, epoch, index)``.

        Example:
            >>> t = RandomResizedCrop(224)
            >>> one = t.boxes([375], [500], indices=[7], epoch=2, seed=0)
            >>> two = t.boxes([480, 375], [640, 500], indices=[3, 7], epoch=2, seed=0)
            >>> [int(a[0]) for a in one] == [int(a[1]) for a in two]
            True
        """
        heights = np.asarray(heights, dtype=np.int64).reshape(-1)
        widths = np.asarray(widths, dtype=np.int64).reshape(-1)
        return self._params(heights, widths, uniforms(len(heights), indices, epoch, seed, self.stream, 40))

    def box(
        self, height: int, width: int, *, index: int, epoch: int = 0, seed: int = 0
    ) -> tuple[int, int, int, int]:
        """:meth:`boxes` for one image, in plain Python with the same float operations (the same
        box): what ``decode="hybrid"``'s CPU workers crop with."""
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

    def _update(self, plan: GeometryPlan, indices: Indices, epoch: int, seed: int) -> bool:
        if plan.resampled:
            return False
        heights, widths = plan.sizes()
        top, left, h, w = self._params(heights, widths, plan.draw(indices, epoch, seed, self.stream, 40))
        plan.crop(top, left, h, w)
        plan.resize(np.full(plan.n, self.size[0]), np.full(plan.n, self.size[1]), self.antialias)
        plan.random_geometry = True
        return True


class Resize(_Geometric):
    """Resizes every image (torchvision's ``Resize``: an int sets the shorter side, the longer one
    ``int(size * long / short)``; only bilinear interpolation).

    With an int ``size``, images of different aspect ratios get different sizes: follow it with
    :class:`CenterCrop` inside a :class:`Compose`, or pass ``(h, w)``, to make one batch.

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
        """Per-image output ``(heights, widths)`` for input sizes."""
        if not self.short:
            return np.full(len(heights), self.size[0]), np.full(len(heights), self.size[1])
        refuse_empty(heights, widths, "it cannot be resized")
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

    def _update(self, plan: GeometryPlan, indices: Indices, epoch: int, seed: int) -> bool:
        if plan.resampled:
            return False
        plan.resize(*self.output_sizes(*plan.sizes()), self.antialias)
        return True


class CenterCrop(_Geometric):
    """Crops the centre of every image (torchvision's ``CenterCrop``, zero padding if the crop is larger).

    Example:
        >>> import torch
        >>> CenterCrop(4)(torch.arange(36, dtype=torch.uint8).view(1, 1, 6, 6))[0, 0, 0].tolist()
        [7, 8, 9, 10]
    """

    def __init__(self, size: int | Sequence[int]) -> None:
        self.size = check_size(size)

    def _extra_repr(self) -> str:
        return f"size={self.size}"

    def _update(self, plan: GeometryPlan, indices: Indices, epoch: int, seed: int) -> bool:
        heights, widths = plan.sizes()
        ch, cw = self.size

        def anchor(size: np.ndarray, crop: int) -> np.ndarray:  # torchvision's placement
            return np.where(
                crop > size, -((crop - size) // 2), np.round((size - crop) / 2.0).astype(np.int64)
            )

        plan.crop(anchor(heights, ch), anchor(widths, cw), np.full(plan.n, ch), np.full(plan.n, cw))
        return True


class RandomHorizontalFlip(_Geometric):
    """Flips each image left-right with probability ``p``, decided per sample."""

    stream = 0x47500002

    def __init__(self, p: float = 0.5) -> None:
        self.p = check_probability(p)

    def _extra_repr(self) -> str:
        return f"p={self.p}"

    def get_params(
        self, images: Images, *, indices: Indices = None, epoch: int = 0, seed: int = 0
    ) -> np.ndarray:
        """Which images get flipped (bool array)."""
        return uniforms(batch_size(images), indices, epoch, seed, self.stream, 1)[:, 0] < self.p

    def _update(self, plan: GeometryPlan, indices: Indices, epoch: int, seed: int) -> bool:
        plan.flip = plan.flip ^ (plan.draw(indices, epoch, seed, self.stream, 1)[:, 0] < self.p)
        return True
