"""What every batched transform shares: the call ``transform(images, indices=None, epoch=0, seed=0)``
on an ``(N, C, H, W)`` tensor (the resize-type ones also take a list of ``(C, H, W)`` tensors or
:class:`PackedImages`, as device decoders give), and the draws.

Per-sample randomness: with ``indices`` (each image's dataset index), image ``r``'s parameters come
from ``fastload.rng.batch_uniform(seed, epoch, indices, stream, n)[r]``, ``stream`` a fixed id per
class (``t.stream = 123`` gives an instance its own): the same augmentation whatever the batch and
after a resume. With ``indices=None``, torch's global generator. ``get_params`` returns the draws.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from .. import rng

__all__ = ["BatchTransform", "PackedImages", "apply_transform"]


class PackedImages:
    """Images of different sizes back to back in one 1-D buffer ``flat``, each channels first
    from ``offsets[k]`` (elements; ``flat`` may hold more, e.g. a refused image's space).

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


def check_range(value: Any, name: str, low: float = -math.inf, high: float = math.inf) -> tuple[float, float]:
    """``value`` as ``(min, max)``, checked to be two numbers with ``low <= min <= max <= high``."""
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


def batch_size(images: Images) -> int:
    """How many images ``images`` holds (a batch tensor must be 4-D)."""
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


def image_sizes(images: Images) -> tuple[np.ndarray, np.ndarray]:
    """Heights and widths (int64 arrays) of a batch tensor or a list of CHW tensors."""
    n = batch_size(images)
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


def require_tensor(images: Images, who: str) -> torch.Tensor:
    """``images`` where it is one ``(N, C, H, W)`` tensor, else a clear error naming ``who`` needs one."""
    if not isinstance(images, torch.Tensor):
        raise TypeError(
            f"{who} needs an (N, C, H, W) tensor, but got {type(images).__name__}; "
            "put a resize-type transform (RandomResizedCrop, Resize, CenterCrop) first to make one batch"
        )
    batch_size(images)
    return images


def uniforms(n: int, indices: Indices, epoch: int, seed: int, stream: int, draws: int) -> np.ndarray:
    """``(n, draws)`` uniforms in [0, 1): per-sample streams if ``indices`` is given, else torch's RNG."""
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


def refuse_empty(heights: np.ndarray, widths: np.ndarray, what: str) -> None:
    """A clear error naming the first image with no pixels (``what``: what cannot be done to it)."""
    empty = np.flatnonzero((heights < 1) | (widths < 1))
    if len(empty):
        k = int(empty[0])
        raise ValueError(
            f"image {k} of the batch has no pixels ({int(heights[k])}x{int(widths[k])}), so {what}: leave "
            "empty images out of the batch"
        )


def randint(u: np.ndarray, high: np.ndarray) -> np.ndarray:
    """Integers in ``[0, high)`` from uniforms (``high >= 1``)."""
    return np.minimum((u * high).astype(np.int64), high - 1)


class BatchTransform:
    """Base class: a transform of a whole batch; ``stream``: its random-stream id (0: deterministic)."""

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
    """Calls a fastload transform with the per-sample keys, any other callable with the images only."""
    if isinstance(transform, BatchTransform):
        return transform(images, indices=indices, epoch=epoch, seed=seed)
    return transform(images)
