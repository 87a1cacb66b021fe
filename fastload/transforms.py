"""Per-sample CPU transforms, fused with decoding: uint8 in, uint8 out, deterministic per sample.

The classes mirror torchvision's (names, arguments, crop-parameter distribution). Randomness comes
only from :func:`fastload.rng.current` (inside the loader, the stream of ``(seed, epoch, index)``).
:meth:`Transform.decode_and_apply` reads the header, draws the crop into a
:class:`~fastload.fused.Plan` and :mod:`fastload.fused` decodes by it (DCT-scaled where the crop
allows); :meth:`Transform.decode_into` writes into a slot of the loader's batch buffer. The output
is always a uint8 ``(3, H, W)`` tensor, also for a PIL input.

Example:
    >>> from fastload import rng, transforms as T
    >>> train = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip()])
    >>> train.output_size
    (224, 224)
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

from . import rng as _rng
from ._checks import check_bool, check_choice, check_int, check_probability
from .decode import pil_resample_available, roi_decoder_available, torchvision_jpeg_available
from .fused import Plan, apply_loaded, decode_plan, open_encoded, run_ops

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "CenterCrop",
    "Compose",
    "RandomHorizontalFlip",
    "RandomResizedCrop",
    "Resize",
    "Transform",
    "import_decode_modules",
]

#: ImageNet's per-channel mean and standard deviation on the 0..1 scale, as every recipe normalizes.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

_INTERPOLATIONS = ("nearest", "bilinear", "bicubic")
_RESAMPLERS = ("auto", "pil", "torch")
# PIL's integer constants, which torchvision also accepts.
_PIL_INT_MODES = {0: "nearest", 2: "bilinear", 3: "bicubic"}


def _parse_hw(size: Any, name: str = "size") -> tuple[int, int]:
    """``int`` or a sequence of one or two positive ints -> ``(h, w)``."""
    if isinstance(size, numbers.Integral) and not isinstance(size, bool):
        s = check_int(size, name, low=1)
        return s, s
    if isinstance(size, Sequence) and not isinstance(size, str) and len(size) in (1, 2):
        values = [check_int(v, name, low=1) for v in size]
        return (values[0], values[0]) if len(values) == 1 else (values[0], values[1])
    raise TypeError(f"{name} should be an int or a sequence of 1 or 2 ints (h, w), but got {name}={size!r}")


def _parse_range(value: Any, name: str) -> tuple[float, float]:
    if not isinstance(value, Sequence) or isinstance(value, str) or len(value) != 2:
        raise TypeError(f"{name} should be a sequence of two numbers (min, max), but got {name}={value!r}")
    lo, hi = value
    for v in (lo, hi):
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
            raise TypeError(
                f"{name} should be a sequence of two numbers (min, max), but got {name}={value!r}"
            )
    if not 0 < lo <= hi:
        raise ValueError(f"{name} should be (min, max) with 0 < min <= max, but got {name}={tuple(value)!r}")
    return float(lo), float(hi)


def _parse_interpolation(value: Any) -> str:
    mode = getattr(value, "value", value)  # torchvision.transforms.InterpolationMode
    if isinstance(mode, numbers.Integral) and not isinstance(mode, bool):
        mode = _PIL_INT_MODES.get(int(mode), mode)
    if isinstance(mode, str) and mode.lower() in _INTERPOLATIONS:
        return mode.lower()
    raise ValueError(
        f"interpolation should be one of {', '.join(map(repr, _INTERPOLATIONS))}, but got "
        f"interpolation={value!r}"
    )


def import_decode_modules() -> None:
    """Imports now what decoding a sample imports on first use and runs its one-time checks (PIL's
    plugins; the C resample's check, else torchvision's ops and decoder), so forked workers
    inherit them. The loader calls it before it starts workers."""
    Image.preinit()  # the JPEG, PNG, BMP, GIF and PPM plugins Image.open would import
    if roi_decoder_available() and pil_resample_available():
        return  # torchvision is only needed by an image that falls back: imported then, once
    import torchvision.transforms  # noqa: F401 - each on first use by fastload.fused
    import torchvision.transforms.functional  # noqa: F401
    import torchvision.transforms.v2.functional  # noqa: F401

    torchvision_jpeg_available()


def resized_output_size(
    height: int, width: int, size: int | tuple[int, int] | None, max_size: int | None = None
) -> tuple[int, int]:
    """The ``(h, w)`` torchvision's ``Resize(size, max_size=max_size)`` gives an ``height x width`` image.

    An int ``size`` is the shorter side (the longer one is scaled and truncated); ``max_size`` caps
    the longer side. Example: a 500x375 (w x h) image, ``size=256``: ``(256, 341)``; with
    ``max_size=300``: ``(225, 300)``; ``size=None, max_size=300``: ``(225, 300)``.
    """
    short, long = (width, height) if width <= height else (height, width)
    if size is None:
        assert max_size is not None  # checked in Resize.__init__
        new_short, new_long = int(max_size * short / long), max_size
    elif isinstance(size, int):
        new_short, new_long = size, int(size * long / short)
        if max_size is not None and new_long > max_size:
            new_short, new_long = int(max_size * new_short / new_long), max_size
    else:
        return size
    return (new_long, new_short) if width <= height else (new_short, new_long)


class Transform:
    """Base class of fastload's per-sample transforms (a pipeline of one; see :class:`Compose`):
    subclasses implement :meth:`_plan` (draw the parameters, record the geometry) and :meth:`_output_size`."""

    #: Whether the transform draws random parameters (a :class:`Compose`: whether any of its do);
    #: only random pipelines decode at a reduced size by default (see :meth:`decode_and_apply`).
    random: bool = False

    def _plan(self, plan: Plan, rng: _rng.SampleRNG) -> None:
        raise NotImplementedError

    def _output_size(self, input_size: tuple[int, int] | None) -> tuple[int, int] | None:
        raise NotImplementedError

    @property
    def output_size(self) -> tuple[int, int] | None:
        """``(H, W)`` when every image comes out that size (e.g. ``RandomResizedCrop(224)`` or
        ``Resize(256)`` + ``CenterCrop(224)``), ``None`` when it depends on the image (``Resize(256)``)."""
        return self._output_size(None)

    def plan(self, height: int, width: int, rng: _rng.SampleRNG | None = None) -> Plan:
        """Draws this pipeline's random parameters for an ``height x width`` image (in pipeline order)
        from ``rng`` (default: :func:`fastload.rng.current`)."""
        plan = Plan(int(height), int(width))
        self._plan(plan, _rng.current() if rng is None else rng)
        return plan

    def __call__(self, img: torch.Tensor | Image.Image) -> torch.Tensor:
        """Applies the transform to a ``(..., H, W)`` tensor (torchvision's functional ops, dtype
        kept) or a PIL image (one PIL resample, returned as a uint8 ``(3, H, W)`` tensor)."""
        if isinstance(img, torch.Tensor):
            if img.ndim < 2:
                raise ValueError(
                    f"img should be a tensor of shape (..., H, W), but got shape {tuple(img.shape)}"
                )
            plan = self.plan(img.shape[-2], img.shape[-1])
            return run_ops(img, plan.ops)
        if isinstance(img, Image.Image):
            plan = self.plan(img.height, img.width)
            out = np.empty((plan.height, plan.width, 3), dtype=np.uint8)
            apply_loaded(img, plan, 1, out)
            return torch.from_numpy(out).permute(2, 0, 1)
        raise TypeError(f"img should be a torch.Tensor or a PIL Image, but got {type(img).__name__}")

    def decode_and_apply(
        self,
        data: bytes | memoryview | np.ndarray,
        name: str = "image",
        *,
        resampler: str = "auto",
        reduce: bool | None = None,
    ) -> torch.Tensor:
        """Decodes an encoded image and applies the transform, fused (see the module docstring): a
        uint8 ``(3, H, W)`` tensor (a view of an HWC array, like ``pil_to_tensor``).

        Args:
            name: How to name the sample in an error, e.g. ``"sample 3 ('/data/train/x.JPEG')"``.
            resampler: ``"pil"``: bilinear/bicubic resizes as PIL runs them (the torchvision
                pipeline's pixels on the PIL image); ``"torch"``: torch's uint8 kernels (up to 2
                levels from PIL's on a few pixels); ``"auto"``: ``"pil"`` where the C extension's
                copy of PIL's resample is there.
            reduce: Allow DCT-scaled JPEG decoding where the crop is at least twice the output
                (``False``: the reference pixels); ``None``: only for a pipeline with a random op.
        """
        pil, reduce = self._choose(resampler, reduce)
        height, width, img = open_encoded(data, name)
        plan = self.plan(height, width)
        out = np.empty((plan.height, plan.width, 3), dtype=np.uint8)
        decode_plan(data, img, plan, out, name, pil, reduce)
        return torch.from_numpy(out).permute(2, 0, 1)

    def decode_into(
        self,
        data: bytes | memoryview | np.ndarray,
        out: np.ndarray | torch.Tensor,
        name: str = "image",
        *,
        resampler: str = "auto",
        reduce: bool | None = None,
        exact: bool = False,
    ) -> None:
        """Like :meth:`decode_and_apply`, writing the ``(H, W, 3)`` result into ``out``.

        Args:
            out: A writable uint8 array (or CPU uint8 tensor) of shape ``output_size + (3,)``, e.g.
                one slot of an NHWC batch buffer; the pipeline needs a fixed :attr:`output_size`.
            exact: With the PIL resampler, fold the ops into one resample only where torchvision's
                chain is one (see :func:`~fastload.fused.decode_plan`).
        """
        if isinstance(out, torch.Tensor) and out.device.type == "cpu" and out.dtype == torch.uint8:
            out = out.numpy()  # e.g. a slot of a pinned NHWC batch tensor: same memory
        if not isinstance(out, np.ndarray) or out.dtype != np.uint8:
            kind = (
                f"{type(out).__name__} of dtype {out.dtype}"
                if isinstance(out, (np.ndarray, torch.Tensor))
                else type(out).__name__
            )
            raise TypeError(f"out should be a uint8 numpy array (or CPU uint8 tensor), but got {kind}")
        height, width, img = open_encoded(data, name)
        plan = self.plan(height, width)
        if out.shape != (plan.height, plan.width, 3):
            raise ValueError(
                f"out should have shape {(plan.height, plan.width, 3)} (the transform's output for {name}), "
                "but got "
                f"out.shape={out.shape}; decode_into needs a pipeline with a fixed output_size (it is "
                f"{self.output_size})"
            )
        pil, reduce = self._choose(resampler, reduce)
        decode_plan(data, img, plan, out, name, pil, reduce, exact)

    def _choose(self, resampler: str, reduce: bool | None) -> tuple[bool, bool]:
        """``(pil, reduce)`` for the ``resampler`` and ``reduce`` arguments (see decode_and_apply)."""
        check_choice(resampler, "resampler", _RESAMPLERS)
        pil = pil_resample_available() if resampler == "auto" else resampler == "pil"
        return pil, self.random if reduce is None else bool(reduce)


class Compose(Transform):
    """Runs fastload transforms in order (``Compose`` can nest); the whole pipeline is fused with
    decoding. Other callables cannot be planned before decoding: put them in a torchvision
    ``Compose`` around this one, or apply them to the batch (:mod:`fastload.gpu`).

    Example:
        >>> val = Compose([Resize(256), CenterCrop(224)])
        >>> val.output_size
        (224, 224)
        >>> Compose([Resize(256)]).output_size is None      # depends on the aspect ratio
        True
    """

    def __init__(self, transforms: Sequence[Transform]) -> None:
        if not isinstance(transforms, Sequence) or isinstance(transforms, (str, bytes)):
            raise TypeError(
                f"transforms should be a sequence of fastload transforms, but got {type(transforms).__name__}"
            )
        for i, t in enumerate(transforms):
            if not isinstance(t, Transform):
                raise TypeError(
                    f"transforms[{i}] should be a fastload transform, but got {type(t).__name__}; wrap other "
                    "callables in a torchvision Compose around this one, or apply them to the batch "
                    "(fastload.gpu)"
                )
        self.transforms = list(transforms)

    def _plan(self, plan: Plan, rng: _rng.SampleRNG) -> None:
        for t in self.transforms:
            t._plan(plan, rng)

    def _output_size(self, input_size: tuple[int, int] | None) -> tuple[int, int] | None:
        for t in self.transforms:
            input_size = t._output_size(input_size)
        return input_size

    @property
    def random(self) -> bool:  # type: ignore[override]
        return any(t.random for t in self.transforms)

    def __repr__(self) -> str:
        body = "".join(f"\n    {t!r}" for t in self.transforms)
        return f"{type(self).__name__}({body}\n)"


class RandomResizedCrop(Transform):
    """Crops a random region (random area and aspect ratio) and resizes it to ``size``.

    The crop parameters follow ``torchvision.transforms.RandomResizedCrop.get_params`` exactly (see
    :meth:`get_params`); after 10 misses, the whole image with its aspect ratio clamped to
    ``ratio``, centred (at least 1 pixel, where torchvision's fallback rounds a side to 0). Example:
    a 100x20 image (w x h) whose 10 attempts all miss keeps the full height and clamps the width to
    ``int(round(20 * 4/3)) = 27``: ``top=0, left=(100 - 27) // 2 = 36, h=20, w=27``.

    ``interpolation`` also takes a torchvision ``InterpolationMode`` or PIL constant, or a sequence
    of modes, one drawn per image after the crop (timm's ``"random"``: bilinear or bicubic);
    ``antialias=False`` or ``"nearest"`` also turn off DCT-scaled decoding, which would antialias.
    """

    random = True

    def __init__(
        self,
        size: int | Sequence[int],
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3.0 / 4.0, 4.0 / 3.0),
        interpolation: Any = "bilinear",
        antialias: bool = True,
    ) -> None:
        self.size = _parse_hw(size)
        self.scale = _parse_range(scale, "scale")
        self.ratio = _parse_range(ratio, "ratio")
        self.interpolation: str | tuple[str, ...] = (
            tuple(_parse_interpolation(m) for m in interpolation)
            if isinstance(interpolation, (list, tuple)) and interpolation
            else _parse_interpolation(interpolation)
        )
        self.antialias = check_bool(antialias, "antialias")

    def get_params(
        self, height: int, width: int, rng: _rng.SampleRNG | None = None
    ) -> tuple[int, int, int, int]:
        """The crop ``(top, left, h, w)`` for an ``height x width`` image, drawn from ``rng``
        (default: :func:`fastload.rng.current`) as torchvision's ``get_params`` draws: per attempt
        ``U(scale)`` then ``U(log ratio)``; on success ``randint(0, height - h + 1)`` then
        ``randint(0, width - w + 1)``; nothing in the fallback.
        """
        r = _rng.current() if rng is None else rng
        area = height * width
        log_lo, log_hi = math.log(self.ratio[0]), math.log(self.ratio[1])
        for _ in range(10):
            target_area = area * r.uniform(self.scale[0], self.scale[1])
            aspect_ratio = math.exp(r.uniform(log_lo, log_hi))
            w = int(round(math.sqrt(target_area * aspect_ratio)))
            h = int(round(math.sqrt(target_area / aspect_ratio)))
            if 0 < w <= width and 0 < h <= height:
                top = r.randint(0, height - h + 1)
                left = r.randint(0, width - w + 1)
                return top, left, h, w
        in_ratio = float(width) / float(height)
        if in_ratio < self.ratio[0]:
            w = width
            h = max(1, int(round(w / self.ratio[0])))  # torchvision: 0 for a 1-pixel-wide image
        elif in_ratio > self.ratio[1]:
            h = height
            w = max(1, int(round(h * self.ratio[1])))
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w

    def _plan(self, plan: Plan, rng: _rng.SampleRNG) -> None:
        top, left, h, w = self.get_params(plan.height, plan.width, rng)
        plan.crop(top, left, h, w)
        mode = self.interpolation
        if isinstance(mode, tuple):
            mode = mode[rng.randint(0, len(mode))]
        plan.resize(self.size[0], self.size[1], mode, self.antialias)

    def _output_size(self, input_size: tuple[int, int] | None) -> tuple[int, int] | None:
        return self.size

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(size={self.size}, scale={tuple(round(s, 4) for s in self.scale)}, "
            f"ratio={tuple(round(r, 4) for r in self.ratio)}, interpolation={self.interpolation}, "
            f"antialias={self.antialias})"
        )


class Resize(Transform):
    """Resizes like torchvision's ``Resize``: an int ``size`` is the shorter side.

    Args:
        size: ``(h, w)``; or an int (or a 1-sequence): the shorter side becomes ``size`` and the
            longer one keeps the aspect ratio (truncated: 500x375 -> 341x256 for 256); or ``None``
            with ``max_size``: the longer side becomes ``max_size``.
        max_size: Upper bound of the longer side when ``size`` is an int (must be larger than it).
    """

    def __init__(
        self,
        size: int | Sequence[int] | None,
        interpolation: Any = "bilinear",
        max_size: int | None = None,
        antialias: bool = True,
    ) -> None:
        self.size: int | tuple[int, int] | None
        if size is None:
            if max_size is None:
                raise ValueError(
                    "size should be an int or a sequence of ints, but got size=None (None needs max_size)"
                )
            self.size = None
        elif isinstance(size, Sequence) and not isinstance(size, str) and len(size) == 2:
            self.size = _parse_hw(size)
        else:
            self.size = _parse_hw(size)[0]
        if max_size is not None:
            max_size = check_int(max_size, "max_size", low=1)
            if isinstance(self.size, tuple):
                raise ValueError(
                    "max_size should only be passed if size is an int (the shorter side) or None, but got "
                    f"size={size!r}"
                )
            if isinstance(self.size, int) and max_size <= self.size:
                raise ValueError(
                    f"max_size should be larger than size, but got max_size={max_size}, size={self.size}"
                )
        self.max_size = max_size
        self.interpolation = _parse_interpolation(interpolation)
        self.antialias = check_bool(antialias, "antialias")

    def _plan(self, plan: Plan, rng: _rng.SampleRNG) -> None:
        h, w = resized_output_size(plan.height, plan.width, self.size, self.max_size)
        plan.resize(h, w, self.interpolation, self.antialias)

    def _output_size(self, input_size: tuple[int, int] | None) -> tuple[int, int] | None:
        return self.size if isinstance(self.size, tuple) else None

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(size={self.size}, interpolation={self.interpolation}, "
            f"max_size={self.max_size}, antialias={self.antialias})"
        )


class CenterCrop(Transform):
    """Crops the centre ``size`` region (torchvision's rounding); pads with zeros if the image is smaller.

    Example: a 341x256 (w x h) image, ``CenterCrop(224)``: ``top = round(16.0) = 16``,
    ``left = round(58.5) = 58`` (Python rounds half to even, as torchvision does).
    """

    def __init__(self, size: int | Sequence[int]) -> None:
        self.size = _parse_hw(size)

    def _plan(self, plan: Plan, rng: _rng.SampleRNG) -> None:
        h, w = self.size
        if h > plan.height or w > plan.width:
            plan.center_crop_padded(h, w)
            return
        top = int(round((plan.height - h) / 2.0))
        left = int(round((plan.width - w) / 2.0))
        plan.crop(top, left, h, w)

    def _output_size(self, input_size: tuple[int, int] | None) -> tuple[int, int] | None:
        return self.size

    def __repr__(self) -> str:
        return f"{type(self).__name__}(size={self.size})"


class RandomHorizontalFlip(Transform):
    """Mirrors the image left-right with probability ``p`` (one draw per sample whatever ``p``)."""

    random = True

    def __init__(self, p: float = 0.5) -> None:
        self.p: float = check_probability(p)

    def get_params(self, height: int, width: int, rng: _rng.SampleRNG | None = None) -> bool:
        """Whether to flip (one uniform draw ``< p``); ``rng`` defaults to :func:`fastload.rng.current`."""
        r = _rng.current() if rng is None else rng
        return r.random() < self.p

    def _plan(self, plan: Plan, rng: _rng.SampleRNG) -> None:
        if self.get_params(plan.height, plan.width, rng):
            plan.hflip()

    def _output_size(self, input_size: tuple[int, int] | None) -> tuple[int, int] | None:
        return input_size

    def __repr__(self) -> str:
        return f"{type(self).__name__}(p={self.p})"
