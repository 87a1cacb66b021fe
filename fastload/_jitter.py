"""torchvision's ``ColorJitter`` (v1, without hue) on a decoded HWC RGB array, in Pillow's
arithmetic: the same bytes as on the PIL image, without making one.

Brightness, contrast and saturation are blended in place by the C extension's ``enhance`` (PIL's
``ImageEnhance``). The fast path (:class:`fastload.tvpipeline.TorchvisionPipeline`, a ``ColorJitter``
after the crops and flips: timm's default train pipeline) draws the order and factors from the
sample's ``(seed, epoch, index)`` stream; head acceleration (:mod:`fastload.head`, :class:`Jitter`)
calls the op's own ``get_params``, drawing from torch's RNG as its ``forward`` does.
:func:`reproduces_pillow` compares it with the installed Pillow once; where it differs, or without
the C extension, the op runs as written (head acceleration, not the fast path).
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import numpy as np
from PIL import Image, ImageEnhance

try:
    from . import _jpeg
except ImportError:  # not built: the op runs as written
    _jpeg = None

_ENHANCERS = (ImageEnhance.Brightness, ImageEnhance.Contrast, ImageEnhance.Color)


@functools.cache
def reproduces_pillow() -> bool:
    """Whether ``enhance`` gives the installed Pillow's bytes (checked once, on random pixels)."""
    if _jpeg is None or not hasattr(_jpeg, "enhance"):
        return False
    image = np.random.default_rng(0).integers(0, 256, (17, 23, 3), dtype=np.uint8)
    for kind, enhancer in enumerate(_ENHANCERS):
        for factor in (0.0, 0.37, 0.6183, 1.0, 1.3999, 2.5, -0.25):
            ours = image.copy()
            _jpeg.enhance(ours, factor, kind)
            if not np.array_equal(ours, np.asarray(enhancer(Image.fromarray(image)).enhance(factor))):
                return False
    return True


def is_jitter(op: Any) -> bool:
    """Whether ``op`` is torchvision's v1 ``ColorJitter`` (not a subclass) without hue."""
    module = sys.modules.get("torchvision.transforms.transforms")
    return type(op) is getattr(module, "ColorJitter", None) and op.hue is None and reproduces_pillow()


def jitter_pixels(pixels: np.ndarray, order: list[int], factors: list[Any]) -> None:
    """Brightness (0), contrast (1) and saturation (2) in ``order`` on a contiguous HWC RGB array,
    in place, as ``ColorJitter`` on its PIL image (``None``: that one skipped)."""
    for kind in order:
        if kind < 3 and factors[kind] is not None:
            _jpeg.enhance(pixels, float(factors[kind]), kind)


def draw_jitter(ranges: tuple[Any, Any, Any], rng: Any) -> tuple[list[int], list[Any]]:
    """fastload's draws of a ``ColorJitter`` (the fast path): the three ops in a random order, then
    each factor uniform in its range, from the sample's stream ``rng`` (:class:`fastload.rng.SampleRNG`)."""
    order = [0, 1, 2]
    for i in (2, 1):
        j = rng.randint(0, i + 1)
        order[i], order[j] = order[j], order[i]
    return order, [None if r is None else rng.uniform(float(r[0]), float(r[1])) for r in ranges]


class Jitter:
    """A head-accelerated pipeline's ``ColorJitter`` stage: on the head's HWC array (or a PIL RGB
    image), the op's draws and Pillow's blends; anything else goes to the op as written."""

    def __init__(self, op: Any) -> None:
        self.op = op

    def __call__(self, image: Any) -> Any:
        pil = isinstance(image, Image.Image)
        if not (isinstance(image, np.ndarray) or (pil and image.mode == "RGB")):
            return self.op(image)
        op = self.op
        order, *factors = op.get_params(op.brightness, op.contrast, op.saturation, op.hue)
        pixels = np.array(image) if pil else image  # the head's array is this sample's own
        jitter_pixels(pixels, order.tolist(), factors)
        return Image.fromarray(pixels) if pil else pixels
