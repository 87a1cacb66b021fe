"""Fused decoding: a sample's :class:`Plan` (its random draws made) run on the encoded file.

A :mod:`fastload.transforms` pipeline (or :mod:`fastload.head`, with torchvision's own code) draws
its parameters into a :class:`Plan` for the size the header gives, and :func:`decode_plan` turns
bytes + plan into the uint8 ``(H, W, 3)`` pixels of a batch slot with the decoders of
:mod:`fastload.decode`. All draws happen first, so the result is a pure function of the stream::

    header (size)  ──plan──>  crop box in source pixels, output size, flip
      JPEG, crop >= 2x output    decoded at 1/s (fastload._jpeg or PIL draft), crop+resize in one
                                 PIL resample (box / s)
      JPEG, smaller crops        with fastload._jpeg: only the leading crop is decoded; else
                                 torchvision.io.decode_jpeg of the whole image; then torchvision's
                                 own ops for the rest (the same pixels either way)
      PNG, CMYK, other           PIL full decode, crop+resize in one resample (also JPEGs when
                                 torchvision.io's decoder is gone: it is deprecated since 0.29)
    flip while copying into the output (no extra image)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from PIL import Image

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
    torchvision_jpeg_available,
)

__all__ = ["Plan", "apply_loaded", "decode_plan", "open_encoded", "run_ops"]

_PIL_FILTERS = {"bilinear": Image.Resampling.BILINEAR, "bicubic": Image.Resampling.BICUBIC}
# Half-width of PIL's filters at scale 1 (Pillow's ``bilinear_filter``/``bicubic_filter`` support).
_PIL_SUPPORT = {"bilinear": 1.0, "bicubic": 2.0}
_PIL_ALL_FILTERS = {**_PIL_FILTERS, "nearest": Image.Resampling.NEAREST}
# Image modes torchvision.io.decode_jpeg reads exactly like PIL (YCbCr JPEGs report "RGB").
_TORCH_JPEG_MODES: tuple[str, ...] = ("RGB", "L")


class Plan:
    """The geometry of a pipeline run on one image, random draws made: ops in order, and one box.

    Made by :meth:`fastload.transforms.Transform.plan`. Attributes:

    * ``ops``: the pipeline literally, as ``("crop", top, left, h, w)``, ``("resize", h, w,
      interpolation, antialias)``, ``("center_crop", h, w)`` (a padding one) and ``("hflip",)``,
      in the coordinates of the image at that step; replayed with torchvision's functional ops;
    * ``height``, ``width``: the output size;
    * ``fusable``: every crop inside the image, one antialiased bilinear/bicubic filter. Then the
      ops also fold into ``box`` (``(x0, y0, x1, y1)`` in source pixels, possibly fractional) and
      a final ``flip``: one resample of ``box`` to the output size gives the same picture.

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


def run_ops(
    t: torch.Tensor,
    ops: Iterable[tuple[Any, ...]],
    skip_trailing_flip: bool = False,
    channels_last: bool = False,
) -> torch.Tensor:
    """Applies plan ops to a ``(..., H, W)`` tensor with torchvision's functional ops; with
    ``channels_last`` (a ``(3, H, W)`` image in HWC memory) a crop is made channels-last before it
    is resized, so torch's vectorised uint8 kernel runs and the result stays HWC."""
    from torchvision.transforms import InterpolationMode  # on first use: keeps the import cheap
    from torchvision.transforms.v2 import functional as F

    ops = _without_trailing_flips(ops) if skip_trailing_flip else ops
    for op in ops:
        kind = op[0]
        if kind == "crop":
            t = F.crop(t, op[1], op[2], op[3], op[4])
        elif kind == "resize":
            if channels_last and t.ndim == 3:
                t = t.unsqueeze(0).contiguous(memory_format=torch.channels_last)[0]
            t = F.resize(t, [op[1], op[2]], interpolation=InterpolationMode(op[3]), antialias=op[4])
        elif kind == "center_crop":
            t = F.center_crop(t, [op[1], op[2]])
        else:  # "hflip"
            t = F.horizontal_flip(t)
    return t


def _without_trailing_flips(ops: Iterable[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    kept = list(ops)
    while kept and kept[-1][0] == "hflip":
        kept.pop()
    return kept


def _trailing_flip(ops: Sequence[tuple[Any, ...]]) -> bool:
    """Whether ``ops`` end in an odd number of flips."""
    return (len(ops) - len(_without_trailing_flips(ops))) % 2 == 1


def _fused_box(
    width: int, height: int, plan: Plan, scale: int, origin: tuple[int, int]
) -> tuple[tuple[float, float, float, float], tuple[int, int, int, int] | None]:
    """The resample box of ``plan`` in an image of ``width x height`` (decoded at ``1/scale``, starting
    at ``origin``), and the integer box when the plan is a plain crop there (no resampling)."""
    ox, oy = origin[0] * scale, origin[1] * scale
    x0, y0, x1, y1 = plan.pixel_box()
    x0, y0 = max(0.0, (x0 - ox) / scale), max(0.0, (y0 - oy) / scale)
    x1, y1 = min(float(width), (x1 - ox) / scale), min(float(height), (y1 - oy) / scale)
    int_box = (int(round(x0)), int(round(y0)), int(round(x1)), int(round(y1)))
    plain = plan.resample is None or (
        all(abs(a - b) < 1e-9 for a, b in zip(int_box, (x0, y0, x1, y1), strict=False))
        and (int_box[2] - int_box[0], int_box[3] - int_box[1]) == (plan.width, plan.height)
    )
    return (x0, y0, x1, y1), int_box if plain else None


def _leading_crop(plan: Plan) -> tuple[int, int, int, int] | None:
    """``(top, left, height, width)`` of the plan's first op when it is a crop, else ``None``. The
    resize after it sees only that crop: PIL's filter stops at its edges."""
    if plan.ops and plan.ops[0][0] == "crop":
        _, top, left, height, width = plan.ops[0]
        return top, left, height, width
    return None


def _pil_fused(img: Image.Image, plan: Plan, scale: int, origin: tuple[int, int] = (0, 0)) -> Image.Image:
    """Crop + resize + flip of a loaded PIL image (decoded at ``1/scale``, starting at ``origin``
    in it) in one resample -> RGB image."""
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
    np.copyto(out, np.asarray(_pil_fused(Image.fromarray(region), plan, scale, origin)))


def _window(plan: Plan) -> tuple[int, int, int, int] | None:
    """``(resized_h, resized_w, top, left)`` when the plan resizes the whole image and then crops
    (``Resize`` + ``CenterCrop``; flips only at the end), else ``None``."""
    ops = _without_trailing_flips(plan.ops)
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


def open_encoded(data: bytes | memoryview | np.ndarray, name: str) -> tuple[int, int, Image.Image | None]:
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
    ``scale == 1``: only a leading crop is decoded, then torchvision's ops run the rest;
    ``scale > 1``: decoded at ``1/scale`` and resampled as the PIL path does."""
    height, width = plan.source
    if scale == 1:
        crop = _leading_crop(plan)
        top, left, h, w = crop or (0, 0, height, width)
        ops = plan.ops[1:] if crop else plan.ops
        region = decode_jpeg_region(data, left, top, w, h)
        if region is None:
            return False
        res = run_ops(
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
    """A fusable plan the way PIL runs it on a full decode, decoding only the box plus the filter's
    reach (``support * max(1, box / out)`` source pixels: the same taps as on the whole image); a
    leading crop: only the crop. ``False`` when libjpeg reported corrupt data."""
    crop = _leading_crop(plan) if scale == 1 else None
    if crop is not None and plan.resample is not None:
        top, left, h, w = crop  # the resize sees the crop only (see _leading_crop): decode just that
        right, bottom = left + w, top + h
    else:
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
    """Whether one PIL resample of the plan's box gives the chain's pixels (within 1 level): crops,
    flips and one bilinear resize, a crop then any one resize (the crop is resampled whole), or one
    bicubic resize that only shrinks (an enlarging one is not the crop of the enlarged image)."""
    if plan.resample is None:
        return plan.fusable
    if not plan.fusable:
        return False
    if _window(plan) is not None and not pil_resample_available():
        return False  # a resize then a crop: exactly only by the C extension's window (or op by op)
    if plan.resample[0] == "bilinear" or (_one_resample(plan) and _leading_crop(plan) is not None):
        return True
    x0, y0, x1, y1 = plan.pixel_box()
    return x1 - x0 >= plan.width and y1 - y0 >= plan.height


def _one_resample(plan: Plan) -> bool:
    """Whether the plan's chain is at most one crop, then at most one resize, then flips: one PIL
    resample of the box then runs exactly torchvision's ops (a crop after the resize, as
    ``Resize`` + ``CenterCrop``, folds into the box only within 1 level; see :meth:`Plan`)."""
    ops = [op[0] for op in _without_trailing_flips(plan.ops)]
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


def _copy_tensor_out(t: torch.Tensor, out: np.ndarray, flip: bool) -> None:
    """Copies a ``(3, H, W)`` tensor into the HWC array ``out``, mirrored when ``flip``."""
    src = t.permute(1, 2, 0)
    if flip:
        src = src.flip(1)  # torch's flip + copy beat numpy's negative-stride copy by ~10x here
    torch.from_numpy(out).copy_(src)


@contextmanager
def _sample_errors(data: bytes | memoryview | np.ndarray, name: str) -> Iterator[None]:
    """PIL's errors surfacing after load as a :class:`DecodeError` naming the sample; an op's
    geometry error (a Resize to 0 px) raised as torchvision raises it, with a note naming it."""
    try:
        yield
    except DecodeError:
        raise
    except ValueError as e:
        note_sample(e, name)
        raise
    except (OSError, SyntaxError, EOFError) as e:
        raise decode_error(name, e, data) from None


def reduced_scale(plan: Plan, img: Image.Image | None, reduce: bool) -> int:
    """The DCT scale to decode a JPEG at for ``plan``: 1 unless ``reduce`` and a resize."""
    if not reduce or plan.resample is None or (img is not None and img.format not in JPEG_FORMATS):
        return 1
    x0, y0, x1, y1 = plan.pixel_box()
    return dct_scale(x1 - x0, y1 - y0, plan.width, plan.height)


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
    """Decodes an encoded image and runs ``plan`` (its random draws made) into ``out``, a writable
    uint8 ``(plan.height, plan.width, 3)`` array: what
    :meth:`fastload.transforms.Transform.decode_into` and :mod:`fastload.head` run.

    Args:
        img: PIL's lazy open of ``data``, or ``None`` where :func:`fastload.decode.jpeg_header`
            read its header (a JPEG the region decoder takes).
        pil: Resize as PIL does (else torch's uint8 kernels).
        reduce: Allow reduced-size (DCT-scaled) JPEG decoding.
        exact: With ``pil``: fold the ops into one resample only where torchvision runs one (at
            most one crop, then one resize, then flips), else run them one by one as PIL does
            (with ``reduce=False``, bit-identical to torchvision's ops on the PIL image). Without
            ``pil``: images PIL decodes run torch's ops too.
    """
    if pil:
        _decode_pil(data, img, plan, out, name, reduce, exact)
        return
    scale = reduced_scale(plan, img, reduce and plan.fusable)
    if img is None:  # a JPEG the region decoder takes (header read by fastload._jpeg)
        if _decode_region_planned(data, plan, scale, out):
            return
        img = open_image(data, name)  # libjpeg reported corrupt data: decode the reference way
    is_jpeg = img.format in JPEG_FORMATS
    with _sample_errors(data, name):
        if scale == 1 and is_jpeg and img.mode in _TORCH_JPEG_MODES and torchvision_jpeg_available():
            t = decode_jpeg_tensor(data, name)  # torchvision's own ops: the reference result
            res = run_ops(t, plan.ops, skip_trailing_flip=True, channels_last=True)
            _copy_tensor_out(res, out, _trailing_flip(plan.ops))
            return
        loaded, applied = load_reduced(img, scale, name, data)
        apply_loaded(loaded, plan, applied, out, exact)


def _decode_pil(
    data: bytes | memoryview | np.ndarray,
    img: Image.Image | None,
    plan: Plan,
    out: np.ndarray,
    name: str,
    reduce: bool,
    exact: bool = False,
) -> None:
    """``resampler="pil"``: the plan as torchvision runs it on a PIL RGB image: one PIL resample of
    the box where that gives the chain's pixels (:func:`_pil_box_exact`, with ``exact`` also
    :func:`_one_resample`), else the ops one by one on the full decode."""
    box_exact = _pil_box_exact(plan) and (not exact or _one_resample(plan))
    scale = reduced_scale(plan, img, reduce and box_exact)
    with _sample_errors(data, name):
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
        if not (
            scale == 1
            and _window(plan) is not None
            and _resampled_window(_rgb_array(loaded), plan, out, (0, 0))
        ):
            np.copyto(
                out,
                np.asarray(_pil_fused(loaded, plan, scale) if box_exact else _run_ops_pil(loaded, plan.ops)),
            )


def _rgb_array(img: Image.Image) -> np.ndarray:
    """The pixels of a loaded image as RGB (as torchvision's loader converts them), C-contiguous."""
    return np.ascontiguousarray(np.asarray(img if img.mode == "RGB" else img.convert("RGB")))


def apply_loaded(img: Image.Image, plan: Plan, scale: int, out: np.ndarray, exact: bool = False) -> None:
    """Runs a plan on a decoded PIL image (at ``1/scale``), writing HWC RGB into ``out``: a fusable
    plan as one PIL resample (within 1 level of torch's kernels), unless ``exact``: then torch's
    ops one by one on the image as a tensor, as torchvision runs them after ``ToImage``."""
    if plan.fusable and not (exact and scale == 1):
        np.copyto(out, np.asarray(_pil_fused(img, plan, scale)))
        return
    rgb = img if img.mode == "RGB" else img.convert("RGB")
    t = torch.from_numpy(np.array(rgb)).permute(2, 0, 1)
    res = run_ops(t, plan.ops, skip_trailing_flip=True, channels_last=True)
    _copy_tensor_out(res, out, _trailing_flip(plan.ops))
