"""Per-sample CPU transforms, fused with decoding: uint8 in, uint8 out, deterministic per sample.

The classes mirror torchvision's (same names, arguments and crop-parameter distribution):
:class:`RandomResizedCrop`, :class:`Resize`, :class:`CenterCrop`, :class:`RandomHorizontalFlip`
and :class:`Compose`. Three things differ:

* **Randomness** comes only from :func:`fastload.rng.current` — inside the loader, the stream of
  ``(seed, epoch, index)`` — so a sample gets the same crop whatever the worker count, worker kind
  or batch composition. Outside a :func:`fastload.rng.sample_scope` the stream is seeded from
  torch's global RNG, so ``torch.manual_seed`` makes a hand-run pipeline reproducible.
* **Fused decoding.** Given the encoded file, :meth:`Transform.decode_and_apply` reads only the
  header, draws the crop box for that image size, decodes the JPEG at the smallest DCT scale
  (1/2, 1/4, 1/8) that keeps the crop at least as large as the output, and crops + resizes in
  one resample. :meth:`Transform.decode_into` writes the result straight into a slot of the
  loader's batch buffer.
* **Output** is always a uint8 ``(3, H, W)`` tensor, also for a PIL input (like torchvision v2 on
  tensors), so the loader never sees PIL images.

How a sample is decoded (all draws happen first, in pipeline order, so the result is a pure
function of the random stream)::

    header (size)  ──plan──>  crop box in source pixels, output size, flip
      JPEG, crop >= 2x output    decoded at 1/s (fastload._jpeg or PIL draft), crop+resize in one
                                 PIL resample (box / s)
      JPEG, smaller crops        with fastload._jpeg: only the leading crop is decoded; else
                                 torchvision.io.decode_jpeg of the whole image; then torchvision's
                                 own ops for the rest (the same pixels either way)
      PNG, CMYK, other           PIL full decode, crop+resize in one resample (also JPEGs when
                                 torchvision.io's decoder is gone: it is deprecated since 0.29)
    flip while copying into the output (no extra image)

Worked example (``RandomResizedCrop(224)``, seed 0, epoch 0, index 3, a 1500x1000 (w x h) JPEG):
the stream gives the box ``top=47, left=438, h=910, w=1001``; ``dct_scale(1001, 910, 224, 224) == 4``,
so libjpeg decodes a 375x250 image and PIL resamples its box ``(109.5, 11.75, 359.75, 239.25)``
to 224x224. A 500x375 JPEG (most of ImageNet) gets crops smaller than 448 px, so it is decoded at
full size by ``torchvision.io`` and cropped/resized by torchvision's own ops: the same pixels as
torchvision's pipeline. Reduced-size decoding filters a little differently from a full-size
antialiased resize (``bench/decode.py`` measures the difference).

Example:
    >>> from fastload import rng, transforms as T
    >>> train = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip()])
    >>> train.output_size
    (224, 224)
    >>> with rng.sample_scope(seed=0, epoch=0, index=3):
    ...     img = train.decode_and_apply(open("x.JPEG", "rb").read(), "x.JPEG")   # doctest: +SKIP
    >>> img.shape, img.dtype                                                          # doctest: +SKIP
    (torch.Size([3, 224, 224]), torch.uint8)
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

from . import rng as _rng
from ._checks import check_choice, check_int, check_probability
from .decode import (
    JPEG_FORMATS,
    DecodeError,
    dct_scale,
    decode_error,
    decode_jpeg_region,
    decode_jpeg_tensor,
    jpeg_header,
    load_reduced,
    note_sample,
    open_image,
    pil_resample,
    pil_resample_available,
    pil_resample_window,
    roi_decoder_available,
    torchvision_jpeg_available,
)

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "CenterCrop",
    "Compose",
    "Plan",
    "RandomHorizontalFlip",
    "RandomResizedCrop",
    "Resize",
    "Transform",
    "decode_plan",
    "import_decode_modules",
]

#: The per-channel mean and standard deviation of ImageNet on the 0..1 scale, the values every
#: ImageNet recipe normalizes with (``torchvision.transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)``,
#: ``fastload.gpu.Normalize``, ``fastload.dali.DALILoader``'s defaults).
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

_INTERPOLATIONS = ("nearest", "bilinear", "bicubic")
_PIL_FILTERS = {"bilinear": Image.Resampling.BILINEAR, "bicubic": Image.Resampling.BICUBIC}
# Half-width of PIL's filters at scale 1 (Pillow's ``bilinear_filter``/``bicubic_filter`` support).
_PIL_SUPPORT = {"bilinear": 1.0, "bicubic": 2.0}
_RESAMPLERS = ("auto", "pil", "torch")
_PIL_ALL_FILTERS = {**_PIL_FILTERS, "nearest": Image.Resampling.NEAREST}
# PIL's integer constants, which torchvision also accepts.
_PIL_INT_MODES = {0: "nearest", 2: "bilinear", 3: "bicubic"}
# Image modes torchvision.io.decode_jpeg reads exactly like PIL (YCbCr JPEGs report "RGB").
_TORCH_JPEG_MODES: tuple[str, ...] = ("RGB", "L")


# --------------------------------------------------------------------------------------------
# argument checks


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


def _check_antialias(value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"antialias should be a bool, but got antialias={value!r}")
    return value


def import_decode_modules() -> None:
    """Imports now what decoding a sample imports on first use, and runs its one-time checks.

    That is PIL's format plugins and, with the C extension, the check of its copy of PIL's
    resample; without it, torchvision's functional ops (2-3 s for ``import torchvision``) and the
    check of ``torchvision.io.decode_jpeg``, which every sample then uses. The loader calls it
    before it starts workers, so forked workers inherit the modules instead of each importing them
    inside its first batch, and spawned workers import them while they start.
    """
    Image.preinit()  # the JPEG, PNG, BMP, GIF and PPM plugins Image.open would import
    if roi_decoder_available() and pil_resample_available():
        # JPEGs are decoded and resized by the C extension: torchvision (2-3 s to import, most of it
        # torch._dynamo through torchvision.ops) is only needed by an image that falls back (a plan
        # that is not one resample of a box, resampler="torch"); it is imported then, once.
        return
    import torchvision.transforms  # noqa: F401 - each module on first use, see _run_ops and _run_ops_pil
    import torchvision.transforms.functional  # noqa: F401
    import torchvision.transforms.v2.functional  # noqa: F401

    torchvision_jpeg_available()


def _tv_interpolation(mode: str) -> Any:
    from torchvision.transforms import InterpolationMode  # torchvision on first use: a cheap import

    return InterpolationMode(mode)


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


# --------------------------------------------------------------------------------------------
# the plan: what a pipeline does to an image of a given size, with its random draws made


class Plan:
    """The geometry of a pipeline run on one image, random draws made: ops in order, and one box.

    Made by :meth:`Transform.plan`. Attributes:

    * ``ops``: the pipeline literally, as ``("crop", top, left, h, w)``, ``("resize", h, w,
      interpolation, antialias)``, ``("center_crop", h, w)`` (a padding one) and ``("hflip",)``,
      in the coordinates of the image at that step; replayed with torchvision's functional ops;
    * ``height``, ``width``: the output size;
    * ``fusable``: every crop inside the image, one antialiased bilinear/bicubic filter. Then the
      ops also fold into ``box`` (``(x0, y0, x1, y1)`` in source pixels, possibly fractional) and
      a final ``flip``: one resample of ``box`` to the output size gives the same picture as the
      chain (resizing and then cropping samples the source on the same grid as resizing only the
      crop's source region).

    Example: ``Compose([Resize(256), CenterCrop(224)])`` on a 500x375 (w x h) image: ops
    ``[("resize", 256, 341, "bilinear", True), ("crop", 16, 58, 224, 224)]``; box
    ``(85.04, 23.44, 413.49, 351.56)`` (the crop's region scaled back by 375/256).
    """

    __slots__ = ("source", "height", "width", "box", "flip", "ops", "fusable", "resample")

    def __init__(self, height: int, width: int) -> None:
        self.source = (height, width)
        self.height = height
        self.width = width
        self.box = [0.0, 0.0, float(width), float(height)]
        self.flip = False
        self.ops: list[tuple[Any, ...]] = []
        self.fusable = True
        self.resample: tuple[str, bool] | None = None

    def crop(self, top: int, left: int, height: int, width: int) -> None:
        """A crop inside the current image (``0 <= top``, ``top + height <= self.height``, ...)."""
        if (top, left, height, width) == (0, 0, self.height, self.width):
            return
        self.ops.append(("crop", top, left, height, width))
        x0, y0, x1, y1 = self.box
        sx, sy = (x1 - x0) / self.width, (y1 - y0) / self.height
        if self.flip:  # the box is in the un-flipped source: mirror the crop
            left = self.width - (left + width)
        self.box = [x0 + left * sx, y0 + top * sy, x0 + (left + width) * sx, y0 + (top + height) * sy]
        self.height, self.width = height, width

    def resize(self, height: int, width: int, interpolation: str, antialias: bool) -> None:
        if (height, width) == (self.height, self.width):
            return  # torchvision returns the image unchanged
        self.ops.append(("resize", height, width, interpolation, antialias))
        mode = (interpolation, antialias)
        if (
            interpolation not in _PIL_FILTERS
            or not antialias
            or (self.resample is not None and self.resample != mode)
        ):
            self.fusable = False  # PIL's resample always antialiases and has no torch-like nearest
        self.resample = mode
        self.height, self.width = height, width

    def center_crop_padded(self, height: int, width: int) -> None:
        """torchvision's ``center_crop`` of a crop larger than the image (zero padding)."""
        self.ops.append(("center_crop", height, width))
        self.fusable = False
        self.height, self.width = height, width

    def hflip(self) -> None:
        self.ops.append(("hflip",))
        self.flip = not self.flip

    def pixel_box(self) -> tuple[float, float, float, float]:
        """``box`` clamped to the source (folding fractions can overshoot by an ulp)."""
        x0, y0, x1, y1 = self.box
        h, w = self.source
        return max(0.0, x0), max(0.0, y0), min(float(w), x1), min(float(h), y1)


def _clamped_box(
    box: tuple[float, float, float, float], width: int, height: int, scale: int
) -> tuple[float, float, float, float]:
    x0, y0, x1, y1 = (v / scale for v in box)
    return max(0.0, x0), max(0.0, y0), min(float(width), x1), min(float(height), y1)


def _run_ops(
    t: torch.Tensor,
    ops: Iterable[tuple[Any, ...]],
    skip_trailing_flip: bool = False,
    channels_last: bool = False,
) -> torch.Tensor:
    """Applies plan ops to a ``(..., H, W)`` tensor with torchvision's functional ops.

    ``channels_last`` (for a decoded ``(3, H, W)`` image held as HWC memory): a crop is made
    channels-last contiguous before it is resized, so torch's vectorised uint8 kernel runs and the
    result stays HWC in memory (about twice as fast as resizing the strided view, and the final
    copy into an HWC buffer is then a plain copy).
    """
    from torchvision.transforms.v2 import functional as F  # on first use: keeps the import cheap

    ops = list(ops)
    if skip_trailing_flip:
        while ops and ops[-1][0] == "hflip":
            ops.pop()
    for op in ops:
        kind = op[0]
        if kind == "crop":
            t = F.crop(t, op[1], op[2], op[3], op[4])
        elif kind == "resize":
            if channels_last and t.ndim == 3:
                t = t.unsqueeze(0).contiguous(memory_format=torch.channels_last)[0]
            t = F.resize(t, [op[1], op[2]], interpolation=_tv_interpolation(op[3]), antialias=op[4])
        elif kind == "center_crop":
            t = F.center_crop(t, [op[1], op[2]])
        else:  # "hflip"
            t = F.horizontal_flip(t)
    return t


def _trailing_flip(ops: Sequence[tuple[Any, ...]]) -> bool:
    flips = 0
    for op in reversed(ops):
        if op[0] != "hflip":
            break
        flips += 1
    return flips % 2 == 1


def _fused_box(
    width: int, height: int, plan: Plan, scale: int, origin: tuple[int, int]
) -> tuple[tuple[float, float, float, float], tuple[int, int, int, int] | None]:
    """The resample box of ``plan`` in an image of ``width x height`` (decoded at ``1/scale``, starting
    at ``origin``), and the integer box when the plan is a plain crop there (no resampling)."""
    x0, y0, x1, y1 = plan.pixel_box()
    box = (x0 - origin[0] * scale, y0 - origin[1] * scale, x1 - origin[0] * scale, y1 - origin[1] * scale)
    x0, y0, x1, y1 = _clamped_box(box, width, height, scale)
    int_box = (int(round(x0)), int(round(y0)), int(round(x1)), int(round(y1)))
    if plan.resample is None or (
        all(abs(a - b) < 1e-9 for a, b in zip(int_box, (x0, y0, x1, y1), strict=False))
        and (int_box[2] - int_box[0], int_box[3] - int_box[1]) == (plan.width, plan.height)
    ):
        return (x0, y0, x1, y1), int_box
    return (x0, y0, x1, y1), None


def _leading_crop(plan: Plan) -> tuple[int, int, int, int] | None:
    """``(top, left, height, width)`` of the plan's first op when it is a crop (RandomResizedCrop's),
    else ``None``. The resize after it sees only that crop: PIL's filter stops at its edges (it is
    the whole image then), where a resample of the box in the larger image would read beyond them."""
    if plan.ops and plan.ops[0][0] == "crop":
        _, top, left, height, width = plan.ops[0]
        return top, left, height, width
    return None


def _pil_fused(img: Image.Image, plan: Plan, scale: int, origin: tuple[int, int] = (0, 0)) -> Image.Image:
    """Crop + resize + flip of a loaded PIL image (decoded at ``1/scale``) in one resample -> RGB image.

    ``origin``: where ``img`` starts in the image decoded at ``1/scale`` (a decoded region).
    """
    if img.mode not in ("RGB", "L"):
        img = img.convert("RGB")  # CMYK, palette, RGBA, 16-bit, ...: as decode_pil does, first
    crop = _leading_crop(plan) if scale == 1 and origin == (0, 0) else None
    if crop is not None and plan.resample is not None and (img.height, img.width) == plan.source:
        top, left, height, width = crop  # the crop first, as torchvision's chain (see _leading_crop)
        img, origin = img.crop((left, top, left + width, top + height)), (left, top)
    box, int_box = _fused_box(img.width, img.height, plan, scale, origin)
    if int_box is not None:
        if int_box != (0, 0, img.width, img.height):
            img = img.crop(int_box)  # a plain crop: no resampling
    else:
        assert plan.resample is not None
        img = img.resize((plan.width, plan.height), _PIL_FILTERS[plan.resample[0]], box=box)
    if img.mode == "L":
        img = img.convert("RGB")  # on the small output: same as converting first (channels are equal)
    if plan.flip:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return img


def _fused_into(
    region: np.ndarray, plan: Plan, scale: int, out: np.ndarray, origin: tuple[int, int] = (0, 0)
) -> None:
    """:func:`_pil_fused` of a decoded RGB ``region``, written into ``out``: PIL's bytes, computed by
    the C resampler where it reproduces the installed Pillow (:func:`pil_resample`), else by PIL."""
    if plan.resample is not None:
        if scale == 1 and _resampled_window(region, plan, out, origin):
            return
        box, int_box = _fused_box(region.shape[1], region.shape[0], plan, scale, origin)
        if int_box is None and pil_resample(region, box, plan.resample[0], plan.flip, out):
            return
    _copy_pil_out(_pil_fused(Image.fromarray(region), plan, scale, origin), out)


def _window(plan: Plan) -> tuple[int, int, int, int] | None:
    """``(resized_h, resized_w, top, left)`` when the plan resizes the whole image and then crops
    (``Resize`` + ``CenterCrop``; flips only at the end), else ``None``."""
    ops = list(plan.ops)
    while ops and ops[-1][0] == "hflip":
        ops.pop()
    if len(ops) < 2 or ops[0][0] != "resize" or any(op[0] != "crop" for op in ops[1:]):
        return None
    return ops[0][1], ops[0][2], sum(op[1] for op in ops[1:]), sum(op[2] for op in ops[1:])


def _resampled_window(region: np.ndarray, plan: Plan, out: np.ndarray, origin: tuple[int, int]) -> bool:
    """A resize-then-crop plan run by :func:`fastload.decode.pil_resample_window` on ``region`` (a
    full-size decode starting at ``origin``): exactly PIL's resize and crop; ``False`` where it cannot."""
    window = _window(plan)
    if window is None or plan.resample is None:
        return False
    full_h, full_w, top, left = window
    height, width = plan.source
    return pil_resample_window(
        region, origin, (width, height), (full_w, full_h), (left, top), plan.resample[0], plan.flip, out
    )


def _open(data: bytes | memoryview | np.ndarray, name: str) -> tuple[int, int, Image.Image | None]:
    """``(height, width, image)``: the header read by the region decoder (``image`` ``None``), or
    PIL's lazy open."""
    header = jpeg_header(data)
    if header is not None:
        return header[1], header[0], None
    img = open_image(data, name)
    return img.height, img.width, img


def _decode_region_planned(
    data: bytes | memoryview | np.ndarray, plan: Plan, scale: int, out: np.ndarray
) -> bool:
    """Runs ``plan`` decoding with ``fastload._jpeg``; ``False`` when libjpeg reported corrupt data.

    ``scale == 1``: a leading crop (RandomResizedCrop's box) is the only region decoded, then the
    remaining ops run with torchvision's functional ops: the same pixels as a full decode followed
    by the whole chain. ``scale > 1``: the image is decoded at ``1/scale`` (the same pixels as PIL's
    ``draft``) and resampled by PIL, exactly as the PIL path does.
    """
    height, width = plan.source
    if scale == 1:
        ops = plan.ops
        if ops and ops[0][0] == "crop":
            _, top, left, h, w = ops[0]
            ops = ops[1:]
        else:
            top, left, h, w = 0, 0, height, width
        region = decode_jpeg_region(data, left, top, w, h)
        if region is None:
            return False
        res = _run_ops(
            torch.from_numpy(region).permute(2, 0, 1), ops, skip_trailing_flip=True, channels_last=True
        )
        _copy_tensor_out(res, out, _trailing_flip(ops))
        return True
    reduced = decode_jpeg_region(data, 0, 0, -(-width // scale), -(-height // scale), scale)
    if reduced is None:
        return False
    _fused_into(reduced, plan, scale, out)
    return True


def _decode_region_pil(
    data: bytes | memoryview | np.ndarray, plan: Plan, scale: int, out: np.ndarray
) -> bool:
    """A fusable plan the way PIL runs it on a full decode (``resampler="pil"``), decoding only the
    box plus the resampling filter's reach (a leading crop: only the crop, see :func:`_leading_crop`);
    ``False`` when libjpeg reported corrupt data.

    PIL's resample reads, for output pixel ``i``, the source pixels within ``support * max(1,
    box / out)`` of its centre, clamped to the image. A region that holds every such pixel (and
    stops only where the image does) gives the same filter taps, so the same pixels as resizing the
    whole decoded image and then cropping (``Resize(256)`` + ``CenterCrop(224)`` on a PIL image).
    """
    crop = _leading_crop(plan) if scale == 1 else None
    if crop is not None and plan.resample is not None:
        top, left, h, w = crop  # the resize sees the crop only (see _leading_crop): decode just that
        region = decode_jpeg_region(data, left, top, w, h)
        if region is None:
            return False
        _fused_into(region, plan, scale, out, (left, top))
        return True
    height, width = plan.source
    full_w, full_h = -(-width // scale), -(-height // scale)
    x0, y0, x1, y1 = (v / scale for v in plan.pixel_box())
    support = 0.0 if plan.resample is None else _PIL_SUPPORT[plan.resample[0]]
    reach_x = support * max(1.0, (x1 - x0) / plan.width) + 2
    reach_y = support * max(1.0, (y1 - y0) / plan.height) + 2
    left, top = max(0, math.floor(x0 - reach_x)), max(0, math.floor(y0 - reach_y))
    right, bottom = min(full_w, math.ceil(x1 + reach_x)), min(full_h, math.ceil(y1 + reach_y))
    region = decode_jpeg_region(data, left, top, right - left, bottom - top, scale)
    if region is None:
        return False
    _fused_into(region, plan, scale, out, (left, top))
    return True


def _pil_box_exact(plan: Plan) -> bool:
    """Whether one PIL resample of the plan's box gives the chain's pixels (within 1 level).

    True for crops and flips, and for one bilinear or bicubic resize when it only shrinks. PIL's
    bicubic resample of a box that it *enlarges* is not the crop of the enlarged image (measured:
    up to 20 levels apart), so that case, nearest-neighbour and mixed resizes run op by op.
    """
    if plan.resample is None:
        return plan.fusable
    if not plan.fusable:
        return False
    if _window(plan) is not None and not pil_resample_available():
        return False  # a resize then a crop: exactly only by the C extension's window (or op by op)
    if plan.resample[0] == "bilinear":
        return True
    x0, y0, x1, y1 = plan.pixel_box()
    return x1 - x0 >= plan.width and y1 - y0 >= plan.height


def _one_resample(plan: Plan) -> bool:
    """Whether the plan's chain is at most one crop, then at most one resize, then flips: one PIL
    resample of the box then runs exactly torchvision's ops (a crop after the resize, as
    ``Resize`` + ``CenterCrop``, folds into the box only within 1 level; see :meth:`Plan`)."""
    ops = [op[0] for op in plan.ops]
    while ops and ops[-1] == "hflip":
        ops.pop()
    if ops.count("crop") > 1 or ops.count("resize") > 1 or "hflip" in ops or "center_crop" in ops:
        return False
    return ops in ([], ["crop"], ["resize"], ["crop", "resize"])


def _run_ops_pil(img: Image.Image, ops: Iterable[tuple[Any, ...]]) -> Image.Image:
    """Plan ops on a PIL image with torchvision's PIL semantics (PIL resamples always antialias)."""
    from torchvision.transforms import functional as F  # on first use: keeps the import cheap

    if img.mode != "RGB":
        img = img.convert("RGB")  # as torchvision's pil_loader does before the transforms
    for op in ops:
        kind = op[0]
        if kind == "crop":
            img = F.crop(img, op[1], op[2], op[3], op[4])  # type: ignore[arg-type,assignment]
        elif kind == "resize":
            img = img.resize((op[2], op[1]), _PIL_ALL_FILTERS[op[3]])
        elif kind == "center_crop":
            img = F.center_crop(img, [op[1], op[2]])  # type: ignore[arg-type,assignment]
        else:  # "hflip"
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return img


def _copy_pil_out(img: Image.Image, out: np.ndarray) -> None:
    np.copyto(out, np.asarray(img))


def _copy_tensor_out(t: torch.Tensor, out: np.ndarray, flip: bool) -> None:
    """Copies a ``(3, H, W)`` tensor into the HWC array ``out``, mirrored when ``flip``."""
    src = t.permute(1, 2, 0)
    if flip:
        src = src.flip(1)  # torch's flip + copy beat numpy's negative-stride copy by ~10x here
    torch.from_numpy(out).copy_(src)


def decode_plan(
    data: bytes | memoryview | np.ndarray,
    img: Image.Image | None,
    plan: Plan,
    out: np.ndarray,
    name: str,
    pil: bool = False,
    reduce: bool = True,
    exact: bool = False,
) -> None:
    """Decodes an encoded image and runs ``plan`` (its random draws made), writing ``out``.

    What :meth:`Transform.decode_into` runs once it has drawn the plan; public for pipelines that
    draw their parameters elsewhere (:mod:`fastload.head` draws them with torchvision's own code).

    Args:
        data: The encoded file.
        img: PIL's lazy open of ``data``, or ``None`` when :func:`fastload.decode.jpeg_header`
            read its header (a JPEG the region decoder takes).
        plan: The geometry, made for the image's size (``plan.source``).
        out: A writable uint8 ``(plan.height, plan.width, 3)`` array.
        name: How to name the sample in an error.
        pil: Resize as PIL does (else torch's uint8 kernels; see :meth:`Transform.decode_and_apply`).
        reduce: Allow reduced-size (DCT-scaled) JPEG decoding.
        exact: With ``pil``: only fold the ops into one resample where that is what torchvision
            runs (at most one crop, then at most one resize, then flips: RandomResizedCrop and
            RandomHorizontalFlip, or a Resize alone); otherwise run them one by one as PIL
            does. With ``reduce=False`` the pixels are then bit-identical to torchvision's ops on
            the decoded PIL image (a ``Resize`` + ``CenterCrop`` folded into one resample differs
            by up to 1 level on some pixels). Without ``pil``: images PIL decodes (PNG, CMYK
            JPEG) run torch's ops too, not one PIL resample.

    Raises:
        DecodeError: Naming ``name`` when the file is not a decodable image.
    """
    if pil:
        _decode_pil(data, img, plan, out, name, reduce, exact)
        return
    scale = 1
    if reduce and plan.fusable and plan.resample is not None and (img is None or img.format in JPEG_FORMATS):
        x0, y0, x1, y1 = plan.pixel_box()
        scale = dct_scale(x1 - x0, y1 - y0, plan.width, plan.height)
    if img is None:  # a JPEG the region decoder takes (header read by fastload._jpeg)
        if _decode_region_planned(data, plan, scale, out):
            return
        img = open_image(data, name)  # libjpeg reported corrupt data: decode the reference way
    is_jpeg = img.format in JPEG_FORMATS
    try:
        if scale == 1 and is_jpeg and img.mode in _TORCH_JPEG_MODES and torchvision_jpeg_available():
            # Full-size decode: torchvision.io is faster than PIL (same libjpeg-turbo pixels), and
            # torch's uint8 resize kernels are faster than Pillow's; torchvision's own ops at the
            # drawn parameters are the reference result.
            t = decode_jpeg_tensor(data, name)
            res = _run_ops(t, plan.ops, skip_trailing_flip=True, channels_last=True)
            _copy_tensor_out(res, out, _trailing_flip(plan.ops))
            return
        loaded, applied = load_reduced(img, scale, name, data)
        _apply_loaded(loaded, plan, applied, out, exact)
    except DecodeError:
        raise
    except ValueError as e:  # an op's geometry (a Resize to 0 px): torchvision raises it as it is
        note_sample(e, name)
        raise
    except (OSError, SyntaxError, EOFError) as e:  # PIL errors surfacing after load
        raise decode_error(name, e, data) from None


def _decode_pil(
    data: bytes | memoryview | np.ndarray,
    img: Image.Image | None,
    plan: Plan,
    out: np.ndarray,
    name: str,
    reduce: bool,
    exact: bool = False,
) -> None:
    """``resampler="pil"``: the plan as torchvision runs it on a PIL RGB image.

    One PIL resample of the box where that gives the same pixels as the chain (see
    :func:`_pil_box_exact`; with ``exact``, only where the chain is itself one resample, see
    :func:`_one_resample`), decoding only the region it reads (at ``1/scale`` if ``reduce``);
    otherwise the ops one by one on the full decode, exactly as torchvision's PIL path.
    """
    box_exact = _pil_box_exact(plan) and (not exact or _one_resample(plan))
    scale = 1
    if reduce and box_exact and plan.resample is not None and (img is None or img.format in JPEG_FORMATS):
        x0, y0, x1, y1 = plan.pixel_box()
        scale = dct_scale(x1 - x0, y1 - y0, plan.width, plan.height)
    try:
        loaded: Image.Image | None = None
        if img is None:
            if box_exact:
                if _decode_region_pil(data, plan, scale, out):
                    return
            else:
                height, width = plan.source
                full = decode_jpeg_region(data, 0, 0, width, height)
                loaded = None if full is None else Image.fromarray(full)
            if loaded is None:
                img = open_image(data, name)  # libjpeg reported corrupt data: the reference way
        if loaded is None:
            assert img is not None
            loaded, scale = load_reduced(img, scale, name, data)
        if box_exact:
            if not (
                scale == 1
                and _window(plan) is not None
                and _resampled_window(_rgb_array(loaded), plan, out, (0, 0))
            ):
                _copy_pil_out(_pil_fused(loaded, plan, scale), out)
        elif not (scale == 1 and _resampled_window(_rgb_array(loaded), plan, out, (0, 0))):
            _copy_pil_out(_run_ops_pil(loaded, plan.ops), out)
    except DecodeError:
        raise
    except ValueError as e:  # an op's geometry (a Resize to 0 px): torchvision raises it as it is
        note_sample(e, name)
        raise
    except (OSError, SyntaxError, EOFError) as e:  # PIL errors surfacing after load
        raise decode_error(name, e, data) from None


def _rgb_array(img: Image.Image) -> np.ndarray:
    """The pixels of a loaded image as RGB (as torchvision's loader converts them), C-contiguous."""
    return np.ascontiguousarray(np.asarray(img if img.mode == "RGB" else img.convert("RGB")))


def _apply_loaded(img: Image.Image, plan: Plan, scale: int, out: np.ndarray, exact: bool = False) -> None:
    """Runs a plan on a decoded PIL image (at ``1/scale``), writing HWC RGB into ``out``: a fusable
    plan as one PIL resample (within 1 level of torch's kernels), unless ``exact``: then torch's
    ops one by one on the image as a tensor, as torchvision runs them after ``ToImage``."""
    if plan.fusable and not (exact and scale == 1):
        _copy_pil_out(_pil_fused(img, plan, scale), out)
        return
    rgb = img if img.mode == "RGB" else img.convert("RGB")
    t = torch.from_numpy(np.array(rgb)).permute(2, 0, 1)
    res = _run_ops(t, plan.ops, skip_trailing_flip=True, channels_last=True)
    _copy_tensor_out(res, out, _trailing_flip(plan.ops))


# --------------------------------------------------------------------------------------------
# transforms


class Transform:
    """Base class of fastload's per-sample transforms (a pipeline of one; see :class:`Compose`).

    Subclasses implement :meth:`_plan` (draw the random parameters for an image size and record
    the geometry) and :meth:`_output_size`. Everything else — running on a tensor or PIL image,
    fused decoding — is shared.
    """

    #: Whether the transform draws random parameters (a :class:`Compose`: whether any of its do).
    #: Deterministic (evaluation) pipelines resize as PIL does by default (see :meth:`decode_into`).
    random: bool = False

    # -- what subclasses implement -------------------------------------------------------------

    def _plan(self, plan: Plan, rng: _rng.SampleRNG) -> None:
        raise NotImplementedError

    def _output_size(self, input_size: tuple[int, int] | None) -> tuple[int, int] | None:
        raise NotImplementedError

    # -- public API -------------------------------------------------------------------------------

    @property
    def output_size(self) -> tuple[int, int] | None:
        """``(H, W)`` when every image comes out that size (e.g. ``RandomResizedCrop(224)`` or
        ``Resize(256)`` + ``CenterCrop(224)``), ``None`` when it depends on the image (``Resize(256)``)."""
        return self._output_size(None)

    def plan(self, height: int, width: int, rng: _rng.SampleRNG | None = None) -> Plan:
        """Draws this pipeline's random parameters for an ``height x width`` image (in pipeline order).

        ``rng`` defaults to :func:`fastload.rng.current`. Mostly for tests and debugging: the
        returned plan's ``ops`` list the crops, resizes and flips that will be applied.
        """
        plan = Plan(int(height), int(width))
        self._plan(plan, _rng.current() if rng is None else rng)
        return plan

    def __call__(self, img: torch.Tensor | Image.Image) -> torch.Tensor:
        """Applies the transform to a ``(..., H, W)`` tensor or a PIL image.

        A tensor goes through torchvision's functional ops at the drawn parameters (dtype kept;
        uint8 is the intended one). A PIL image is cropped and resized in one PIL resample and
        returned as a uint8 ``(3, H, W)`` tensor.
        """
        if isinstance(img, torch.Tensor):
            if img.ndim < 2:
                raise ValueError(
                    f"img should be a tensor of shape (..., H, W), but got shape {tuple(img.shape)}"
                )
            plan = self.plan(img.shape[-2], img.shape[-1])
            return _run_ops(img, plan.ops)
        if isinstance(img, Image.Image):
            plan = self.plan(img.height, img.width)
            out = np.empty((plan.height, plan.width, 3), dtype=np.uint8)
            _apply_loaded(img, plan, 1, out)
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
        """Decodes an encoded image and applies the transform, fused (see the module docstring).

        Args:
            data: The encoded file (JPEG, PNG or anything PIL reads).
            name: How to name the sample in an error, e.g. ``"sample 3 ('/data/train/x.JPEG')"``.
            resampler: ``"pil"``: bilinear/bicubic resizes the way PIL runs them, the same pixels
                (bit for bit: a resize then a crop is the C extension's window of the whole resize,
                or op by op without it) as the torchvision pipeline run on the PIL image
                (``torchvision.datasets.ImageFolder``'s images); ``"torch"``: torch's uint8 kernels,
                which differ from PIL's resample by up to 2 levels on a few pixels; ``"auto"``:
                ``"pil"`` when the C extension's copy of PIL's resample is there (about as fast as
                torch's kernels, and no torchvision import), else ``"torch"`` (Pillow's own
                resample is 3-4x slower).
            reduce: Allow reduced-size (DCT-scaled) JPEG decoding when the crop is at least twice
                the output (4-6 levels from the full-size result); ``False``: always decode at full
                size (the reference pixels). ``None``: only for a pipeline with a random op
                (training); evaluation pipelines decode at full size.

        Returns:
            A uint8 ``(3, H, W)`` tensor (a view of an HWC array, like ``pil_to_tensor``).

        Raises:
            DecodeError: Naming ``name`` when the file is not a decodable image.
        """
        pil, reduce = self._choose(resampler, reduce)
        height, width, img = _open(data, name)
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
            data: The encoded file.
            out: A writable uint8 array of shape ``output_size + (3,)``, e.g. one slot of an NHWC
                batch buffer in shared memory (a CPU uint8 tensor works too: written in place).
            name: How to name the sample in an error.
            resampler, reduce: As in :meth:`decode_and_apply`.
            exact: With the PIL resampler, fold the ops into one resample only where torchvision's
                chain is one (see :func:`decode_plan`).

        Raises:
            DecodeError: Naming ``name`` when the file is not a decodable image.
            ValueError: If ``out`` has the wrong shape (the pipeline must have a fixed
                :attr:`output_size`).
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
        height, width, img = _open(data, name)
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
        random = self.random
        if resampler == "auto":
            pil = pil_resample_available()
        else:
            pil = resampler == "pil"
        return pil, random if reduce is None else bool(reduce)


class Compose(Transform):
    """Runs fastload transforms in order; the whole pipeline is fused with decoding.

    Args:
        transforms: fastload transforms (``Compose`` can nest). Other callables (torchvision
            transforms) cannot be planned before decoding: put them in a torchvision ``Compose``
            around this one, or apply them on the batch after the loader (:mod:`fastload.gpu`).

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
    random = True

    """Crops a random region (random area and aspect ratio) and resizes it to ``size``.

    The crop parameters follow ``torchvision.transforms.RandomResizedCrop.get_params`` exactly: up
    to 10 attempts of ``area * U(scale)`` with aspect ratio ``exp(U(log ratio))``, the first that
    fits is placed uniformly; after 10 misses, the whole image with its aspect ratio clamped to
    ``ratio``, centred (at least 1 pixel: where torchvision's fallback rounds a side to 0 and
    fails, e.g. a 1x1 image with ``ratio=(2, 3)``, this keeps 1). Example: for a 100x20 image
    (w x h) whose 10 attempts all miss (likely for such an elongated image), the fallback keeps the
    full height and clamps the width to ``int(round(20 * 4/3)) = 27``:
    ``top=0, left=(100 - 27) // 2 = 36, h=20, w=27``.

    Args:
        size: Output ``(h, w)``, or an int for a square.
        scale: Range of the crop's area as a fraction of the image's, ``0 < min <= max``.
        ratio: Range of the crop's aspect ratio (w / h), ``0 < min <= max``.
        interpolation: ``"bilinear"`` (default), ``"bicubic"`` or ``"nearest"`` (or a torchvision
            ``InterpolationMode`` / PIL constant).
        antialias: Antialias when shrinking (torchvision's default ``True``). ``False`` or
            ``"nearest"`` turn off DCT-scaled decoding, which would antialias.
    """

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
        self.interpolation = _parse_interpolation(interpolation)
        self.antialias = _check_antialias(antialias)

    def get_params(
        self, height: int, width: int, rng: _rng.SampleRNG | None = None
    ) -> tuple[int, int, int, int]:
        """The crop ``(top, left, h, w)`` for an ``height x width`` image, drawn from ``rng``.

        Same algorithm as torchvision's ``RandomResizedCrop.get_params`` (which draws from torch's
        global RNG); ``rng`` defaults to :func:`fastload.rng.current`. Draws, in order: per attempt
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
        plan.resize(self.size[0], self.size[1], self.interpolation, self.antialias)

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
        interpolation: ``"bilinear"`` (default), ``"bicubic"`` or ``"nearest"``.
        max_size: Upper bound of the longer side when ``size`` is an int (must be larger than it).
        antialias: Antialias when shrinking (default ``True``).
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
        self.antialias = _check_antialias(antialias)

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

    Args:
        size: ``(h, w)``, or an int for a square.

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
    random = True

    """Mirrors the image left-right with probability ``p``.

    One draw per sample whatever ``p`` is, so the draws of later transforms do not depend on it.

    Args:
        p: Probability of flipping, in ``[0, 1]``.
    """

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
