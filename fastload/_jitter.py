"""torchvision's ``ColorJitter`` (v1, without hue) on the fused head's HWC RGB array, in Pillow's
arithmetic: the same bytes as on the PIL image, without making one.

Head acceleration (:mod:`fastload.head`) runs :class:`Jitter` for a ``ColorJitter`` that follows the
fused head on PIL images (timm's default train pipeline): the op's own ``get_params`` draws from
torch's RNG as its ``forward`` does, then brightness, contrast and saturation are blended in place by
the C extension's ``enhance`` (PIL's ``ImageEnhance``). :func:`reproduces_pillow` compares it with
the installed Pillow once; where it differs, or without the C extension, the op runs as written.
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
        for kind in order.tolist():
            if kind < 3 and factors[kind] is not None:
                _jpeg.enhance(pixels, float(factors[kind]), kind)
        return Image.fromarray(pixels) if pil else pixels
