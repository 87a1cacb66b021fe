"""The colour and pixel transforms of a batch, between the geometric ones and ``Normalize``: per
sample parameters, bit-identical to torchvision's functional ops with the same parameters.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .._checks import check_probability
from ..device import small_to_device
from .base import BatchTransform, Images, Indices, batch_size, check_range, randint, require_tensor, uniforms

__all__ = ["ColorJitter", "RandomErasing"]


def _grayscale(images: torch.Tensor) -> torch.Tensor:
    """torchvision's luma, as a float ``(N, 1, H, W)`` tensor (floored for integer images)."""
    r, g, b = images.unbind(dim=1)
    gray = r.mul(0.2989).add_(g, alpha=0.587).add_(b, alpha=0.114).unsqueeze(1)
    return gray if images.is_floating_point() else gray.floor_()


class ColorJitter(BatchTransform):
    """Random brightness, contrast and saturation per sample, in a random order per sample.

    torchvision's ``ColorJitter`` without hue (each argument ``b``: a factor in
    ``[max(0, 1 - b), 1 + b]``, or ``(min, max)``). Samples sharing an order run together: at most
    nine batched kernels per batch.

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
            lo, hi = check_range(value, name, 0.0)
        return None if lo == hi == 1.0 else (lo, hi)

    def _extra_repr(self) -> str:
        return f"brightness={self.brightness}, contrast={self.contrast}, saturation={self.saturation}"

    def get_params(
        self, images: Images, *, indices: Indices = None, epoch: int = 0, seed: int = 0
    ) -> dict[str, Any]:
        """Per-image factors (``None`` when disabled) and ``order``: ``(N, 3)`` op ids (0 b, 1 c, 2 s)."""
        n = batch_size(images)
        u = uniforms(n, indices, epoch, seed, self.stream, 6)
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
        # addcmul rounds a + alpha * b once, as torchvision's add_(b, alpha=...)
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
        images = require_tensor(images, "ColorJitter")
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

    torchvision's parameter search (10 attempts; none fits: unchanged); ``value``: one number or
    one per channel (``"random"`` is not supported: per-pixel noise has no cheap per-sample stream).

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
        self.scale = check_range(scale, "scale", 0.0, 1.0)
        self.ratio = check_range(ratio, "ratio", 0.0)
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
        images = require_tensor(images, "RandomErasing")
        n, _, img_h, img_w = images.shape
        u = uniforms(n, indices, epoch, seed, self.stream, 41)
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
        top = np.where(found, randint(u[rows, 21 + attempt], img_h - h + 1), 0)
        left = np.where(found, randint(u[rows, 31 + attempt], img_w - w + 1), 0)
        return (u[:, 0] < self.p) & found, top, left, h, w

    def __call__(
        self, images: Images, *, indices: Indices = None, epoch: int = 0, seed: int = 0
    ) -> torch.Tensor:
        images = require_tensor(images, "RandomErasing")
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
