"""Image decoding: PIL/libjpeg-turbo, reduced-size (DCT-scaled) and region JPEG decoding.

:func:`load_sample` is the entry point datasets call; the fastload transforms
(:mod:`fastload.transforms`, through :mod:`fastload.fused`) use the pieces: :func:`open_image`
reads the header, :func:`dct_scale` and :func:`load_reduced` decode at 1/2, 1/4 or 1/8 (PIL's
``Image.draft``), :func:`decode_jpeg_region` decodes only a region with the optional C extension
``fastload._jpeg`` (the same pixels as a full decode and a crop), :func:`decode_jpeg_tensor`
decodes with ``torchvision.io.decode_jpeg``; anything else goes through PIL. All of them release
the GIL and raise :class:`DecodeError` naming the sample.
"""

from __future__ import annotations

import functools
import importlib
import io
import os
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

__all__ = [
    "DecodeError",
    "affine_for_table",
    "SKIP_HINT",
    "decode_error",
    "describe_unknown",
    "DECODE_ERRORS",
    "decode_jpeg_tensor",
    "decode_jpegs",
    "decode_pil",
    "dct_scale",
    "decode_jpeg_region",
    "JpegInfo",
    "encoded_tensor",
    "jpeg_extension_built",
    "jpeg_header",
    "jpeg_info",
    "load_reduced",
    "without_skip_hint",
    "load_sample",
    "open_image",
    "pil_resample",
    "pil_resample_available",
    "pil_resample_window",
    "roi_decoder_available",
    "to_chw_by_table",
    "torchvision_jpeg_available",
]

try:  # the optional C extension (see setup.py): guarded, since a build may lack it
    _jpeg: Any = importlib.import_module("fastload._jpeg")
except ImportError:  # pragma: no cover - built without a compiler or libjpeg headers
    _jpeg = None

#: Whether :func:`jpeg_header` / :func:`decode_jpeg_region` use the C extension (not with
#: ``FASTLOAD_ROI_DECODE=0`` in the environment).
USE_ROI_DECODE: bool = _jpeg is not None and os.environ.get("FASTLOAD_ROI_DECODE", "1") != "0"

#: Scales libjpeg can decode at straight from the DCT coefficients, largest first.
DCT_SCALES = (8, 4, 2, 1)

#: PIL formats that are a JPEG stream (MPO: a camera's multi-picture JPEG; its first picture is decoded).
JPEG_FORMATS = ("JPEG", "MPO")

_PIL_ERRORS: tuple[type[BaseException], ...] = (
    UnidentifiedImageError,
    OSError,
    SyntaxError,
    ValueError,
    EOFError,
    Image.DecompressionBombError,
)
#: What PIL (its plugins too) and torchvision.io (``RuntimeError``) raise on a bad file.
DECODE_ERRORS: tuple[type[BaseException], ...] = (*_PIL_ERRORS, RuntimeError)


class DecodeError(RuntimeError, OSError):
    """An image file could not be decoded; the message names the sample. An ``OSError`` as PIL's
    errors are, so code that catches ``OSError`` to skip bad files catches it too."""


# "<_io.BytesIO object at 0x7f...>" in PIL's "cannot identify image file <...>": names nothing useful.
_OBJECT_REPR = re.compile(r"\s*<[\w.]+ object at 0x[0-9a-fA-F]+>")

#: ``(offset, magic, what it is)`` of files often found where images should be.
_KNOWN_HEADS = (
    (0, b"<", "text (HTML or XML?)"),
    (0, b"%PDF", "a PDF document"),
    (0, b"PK\x03\x04", "a ZIP archive"),
    (0, b"\x1f\x8b", "a gzip file"),
    (4, b"ftyp", "an ISO media file (HEIC, AVIF or a video?)"),
)


def describe_unknown(data: bytes | memoryview | np.ndarray) -> str:
    """What a file that no image decoder recognises looks like: its size and first bytes, e.g.
    ``not a JPEG, PNG or other image format PIL reads: 120 bytes starting with 3c 68 74 6d ...
    ('<html><body>404 ', text (HTML or XML?))``."""
    size = len(data)
    if size == 0:
        return "the file is empty (0 bytes)"
    head = data[:16].tobytes() if isinstance(data, np.ndarray) else bytes(memoryview(data).cast("B")[:16])
    hints = []
    if all(32 <= b < 127 or b in (9, 10, 13) for b in head):
        hints.append(repr(head.decode("ascii")))
    hints += [what for at, magic, what in _KNOWN_HEADS if head[at : at + len(magic)] == magic]
    shown = " ".join(f"{b:02x}" for b in head)
    return f"not a JPEG, PNG or other image format PIL reads: {size} bytes starting with {shown}" + (
        f" ({', '.join(hints)})" if hints else ""
    )


def decode_error(
    name: str, error: BaseException | str, data: bytes | memoryview | np.ndarray | None = None
) -> DecodeError:
    """The :class:`DecodeError` for sample ``name`` failing with ``error`` (with ``data``: the file
    size, or :func:`describe_unknown` for a file no decoder recognises)."""
    if isinstance(error, UnidentifiedImageError) and data is not None:
        reason = describe_unknown(data)
    else:
        reason = _OBJECT_REPR.sub("", str(error)).strip().rstrip(".")
        if isinstance(error, Image.DecompressionBombError):
            reason += " (PIL.Image.MAX_IMAGE_PIXELS sets the limit)"
        if data is not None:
            reason += f"; the file has {len(data)} bytes"
    return DecodeError(f"cannot decode {name}: {reason}. Remove or replace the file{SKIP_HINT}.")


def note_sample(error: BaseException, name: str) -> None:
    """Names the sample in the traceback of an error raised as it is (``str(error)`` unchanged;
    an exception note, so Python 3.11+)."""
    add_note = getattr(error, "add_note", None)
    if add_note is not None:
        add_note(f"(fastload: while transforming {name})")


#: The end of a :class:`DecodeError`'s advice where a loader can skip the file; left out where it
#: cannot (``decode="device"``/``"hybrid"``) or already does (the warning of a skipped sample).
SKIP_HINT = " (or use on_error='skip' in fastload.DataLoader)"


def without_skip_hint(message: str) -> str:
    """A :class:`DecodeError` message without :data:`SKIP_HINT`."""
    return message.replace(SKIP_HINT, "")


def decode_pil(data: bytes | memoryview, name: str = "image") -> Image.Image:
    """Decodes encoded bytes to an RGB PIL image; :class:`DecodeError` naming ``name`` if it cannot."""
    try:
        img = Image.open(io.BytesIO(data))
        img.load()
        return img if img.mode == "RGB" else img.convert("RGB")
    except _PIL_ERRORS as e:
        raise decode_error(name, e, data) from None


def load_sample(data: bytes | memoryview, transform: Callable[..., Any] | None, name: str = "image") -> Any:
    """Decodes one sample and applies ``transform`` (``None``, any callable taking a PIL image, or
    a fastload transform, which decodes the bytes itself: the two fused)."""
    fused = getattr(transform, "decode_and_apply", None)
    if fused is not None:
        return fused(data, name)
    image = decode_pil(data, name)
    return image if transform is None else transform(image)


def open_image(data: bytes | memoryview | np.ndarray, name: str = "image") -> Image.Image:
    """Opens encoded bytes (or a 1-D uint8 array) lazily: PIL reads the header, no pixels yet."""
    try:
        return Image.open(io.BytesIO(data.tobytes() if isinstance(data, np.ndarray) else data))
    except DECODE_ERRORS as e:
        raise decode_error(name, e, data) from None


def dct_scale(box_width: float, box_height: float, out_width: int, out_height: int) -> int:
    """The largest DCT scale-down (8, 4, 2 or 1) that keeps the crop at least the output size.

    A 1200x900 crop resized to 224x224 decodes at 1/4 (300x225), not 1/8 (150x112):

        >>> dct_scale(1200, 900, 224, 224), dct_scale(400, 300, 224, 224)
        (4, 1)
    """
    for s in DCT_SCALES:
        if box_width >= s * out_width and box_height >= s * out_height:
            return s
    return 1


def load_reduced(
    img: Image.Image, scale: int, name: str = "image", data: bytes | memoryview | np.ndarray | None = None
) -> tuple[Image.Image, int]:
    """Decodes an opened JPEG (from :func:`open_image`) at ``1/scale`` of its size (``Image.draft``;
    other formats at full size): ``(image in its own mode, applied_scale)``, source pixel ``x`` at
    ``x / applied_scale`` in it (sizes rounded up)."""
    applied = 1
    try:
        if scale > 1 and img.format in JPEG_FORMATS:
            width, height = img.size
            result = img.draft("RGB", (max(1, width // scale), max(1, height // scale)))
            if result is not None:
                applied = max(1, int(round(width / result[1][2])))
        img.load()
    except DECODE_ERRORS as e:
        raise decode_error(name, e, data) from None
    return img, applied


def roi_decoder_available() -> bool:
    """Whether region-of-interest decoding (the ``fastload._jpeg`` C extension) is built and enabled."""
    return USE_ROI_DECODE and _jpeg is not None


def jpeg_extension_built() -> bool:
    """Whether the ``fastload._jpeg`` C extension is built (enabled or not: :func:`roi_decoder_available`)."""
    return _jpeg is not None


def to_chw_by_table(
    src: np.ndarray, dst: np.ndarray, table: np.ndarray, affine: np.ndarray | None = None
) -> bool:
    """``dst[c, y, x] = table[c, src[y, x, c]]`` (``src`` HWC uint8, ``dst`` CHW float32, ``table``
    ``(3, 256)`` float32) with the C extension; ``False`` (nothing written) without it. ``affine``
    (:func:`affine_for_table`) computes most pixels with AVX2 instead, with the same bits."""
    if _jpeg is None:
        return False
    if affine is None:
        _jpeg.hwc_lut(src, dst, table)
    else:
        _jpeg.hwc_lut(src, dst, table, affine)
    return True


def affine_for_table(
    table: np.ndarray, scale: float, divide: bool, mean: Sequence[float], std: Sequence[float]
) -> np.ndarray | None:
    """The constants with which :func:`to_chw_by_table` computes ``table`` instead of looking it up:
    ``(v * scale - mean[c]) / std[c]`` in float32 (``v / scale`` when ``divide``), as torchvision's
    ``ToTensor``/``ToDtype`` and ``Normalize`` run it, checked on every uint8 value; ``None`` where
    that does not give the table's bits or the AVX2 kernel does not run. ``mean``/``std``: 3 values
    or 1."""
    means, stds = list(mean), list(std)
    if len(means) == 1:
        means *= 3
    if len(stds) == 1:
        stds *= 3
    if len(means) != 3 or len(stds) != 3 or _jpeg is None or not _jpeg.simd():
        return None
    affine = np.array([scale, 1.0 if divide else 0.0, *means, *stds], dtype=np.float32)
    ramp = np.ascontiguousarray(np.repeat(np.arange(256, dtype=np.uint8)[:, None], 3, axis=1))
    got = np.empty((3, 256), dtype=np.float32)
    _jpeg.hwc_lut(ramp, got, np.ascontiguousarray(table, dtype=np.float32), affine)
    return affine if np.array_equal(got.view(np.int32), table.view(np.int32)) else None


_PIL_ORDER: list[bool | None] = []  # [order], found on first use by _pil_pass_order


def _pil_pass_order() -> bool | None:
    """Which order of its two passes the installed Pillow runs (found by comparing the C resampler
    with ``Image.resize``): ``True`` for Pillow 13's (vertical first when the height shrinks more),
    ``False`` for horizontal first (earlier Pillows), ``None`` when neither gives Pillow's bytes."""
    if _PIL_ORDER:
        return _PIL_ORDER[0]
    rng = np.random.default_rng(0)
    cases = [  # (height, width, box, (out_w, out_h), filter): both orders, both filters, up and down
        (90, 40, (1.5, 3.25, 38.0, 88.5), (30, 20), Image.Resampling.BILINEAR),
        (90, 40, (0.0, 0.0, 40.0, 90.0), (33, 17), Image.Resampling.BICUBIC),
        (31, 57, (2.75, 1.5, 50.25, 30.0), (23, 19), Image.Resampling.BICUBIC),
        (20, 24, (3.5, 2.0, 15.0, 11.5), (61, 47), Image.Resampling.BILINEAR),
    ]
    found: bool | None = None
    if _jpeg is not None:
        for order in (True, False):
            ok = True
            for h, w, box, size, resample in cases:
                img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
                ref = np.asarray(Image.fromarray(img).resize(size, resample, box=box))
                out = np.empty((size[1], size[0], 3), dtype=np.uint8)
                bicubic = resample == Image.Resampling.BICUBIC
                _jpeg.resample(img, w, h, box, out, size[0], size[1], bicubic, False, order)
                ok = ok and np.array_equal(out, ref)
            if ok:
                found = order
                break
    _PIL_ORDER.append(found)
    return found


def pil_resample_available() -> bool:
    """Whether :func:`pil_resample` reproduces the installed Pillow (the C extension is built)."""
    return _jpeg is not None and _pil_pass_order() is not None


def _resample_order(src: np.ndarray, filter: str, out: np.ndarray) -> bool | None:
    """The C resampler's pass order for the installed Pillow, or ``None`` where it cannot promise
    Pillow's bytes: no C extension, a filter other than bilinear/bicubic, arrays that are not
    contiguous uint8 RGB, a Pillow whose resample it does not reproduce."""
    if (
        _jpeg is None
        or filter not in ("bilinear", "bicubic")
        or any(
            a.ndim != 3 or a.shape[2] != 3 or a.dtype != np.uint8 or not a.flags.c_contiguous
            for a in (src, out)
        )
    ):
        return None
    return _pil_pass_order()


def pil_resample(
    src: np.ndarray,
    box: tuple[float, float, float, float],
    filter: str,
    flip: bool,
    out: np.ndarray,
) -> bool:
    """PIL's ``Image.fromarray(src).resize(out size, filter, box)`` (mirrored when ``flip``) into
    ``out`` (``(h, w, 3)`` uint8), bit for bit, by the C extension; ``False`` (nothing written)
    where it cannot promise Pillow's bytes. ``filter``: ``"bilinear"`` or ``"bicubic"``."""
    order = _resample_order(src, filter, out)
    if order is None or _jpeg is None:
        return False
    height, width = src.shape[:2]
    box = (float(box[0]), float(box[1]), float(box[2]), float(box[3]))
    _jpeg.resample(src, width, height, box, out, out.shape[1], out.shape[0], filter == "bicubic", flip, order)
    return True


def pil_resample_window(
    region: np.ndarray,
    origin: tuple[int, int],
    source: tuple[int, int],
    size: tuple[int, int],
    window: tuple[int, int],
    filter: str,
    flip: bool,
    out: np.ndarray,
) -> bool:
    """PIL's resize of a whole image to ``size``, then the crop ``out`` takes at ``window``, bit for
    bit, computing the crop's pixels only (``Resize(256)`` + ``CenterCrop(224)``, where one resample
    of the crop's box is only within 1 level); ``False`` (nothing written) where it cannot.
    ``region``, at ``origin`` ``(x, y)`` of the image (``source``: its ``(width, height)``), holds
    every pixel the window's filter taps read; ``window``: ``(x, y)`` of the crop in the resized image.
    """
    order = _resample_order(region, filter, out)
    if order is None or _jpeg is None or not hasattr(_jpeg, "resample_window"):
        return False
    rh, rw = region.shape[:2]
    coords = [int(v) for v in (*origin, *source, *size, *window)]
    bicubic = filter == "bicubic"
    return bool(
        _jpeg.resample_window(region, rw, rh, *coords, out, out.shape[1], out.shape[0], bicubic, flip, order)
    )


def jpeg_header(data: bytes | memoryview | np.ndarray) -> tuple[int, int, str] | None:
    """``(width, height, colorspace)`` of a JPEG the region decoder takes, else ``None`` (decode it
    otherwise): no extension, not a JPEG, CMYK/YCCK, unreadable header, no end-of-image marker (a
    truncated file must fail as a full decode does), over ``Image.MAX_IMAGE_PIXELS``."""
    info = jpeg_info(data)
    return None if info is None else (info.width, info.height, info.colorspace)


class JpegInfo(NamedTuple):
    """What a JPEG's header says (:func:`jpeg_info`)."""

    width: int
    height: int
    colorspace: str  # "YCbCr", "RGB" or "L"
    progressive: bool
    subsampling: str  # "4:4:4", "4:2:2", "4:2:0", "4:4:0", "4:1:1", "gray" or "other"


def jpeg_info(data: bytes | memoryview | np.ndarray) -> JpegInfo | None:
    """:func:`jpeg_header` with the rest of the header: progressive or baseline, chroma subsampling
    (``None`` exactly where :func:`jpeg_header` returns ``None``).

    Example:
        >>> import io
        >>> from PIL import Image
        >>> buf = io.BytesIO()
        >>> Image.new("RGB", (64, 48)).save(buf, "JPEG", subsampling=2, progressive=True)
        >>> jpeg_info(buf.getvalue())  # with the C extension built (else None)
        JpegInfo(width=64, height=48, colorspace='YCbCr', progressive=True, subsampling='4:2:0')
    """
    if (
        not USE_ROI_DECODE
        or _jpeg is None
        or len(data) < 4
        or bytes(data[:2]) != b"\xff\xd8"
        or bytes(data[-2:]) != b"\xff\xd9"  # a truncated file must fail as with a full decode
    ):
        return None
    try:
        width, height, _, colorspace, progressive, subsampling = _jpeg.header_info(data)
    except (_jpeg.Error, ValueError, BufferError):
        return None
    if colorspace not in ("YCbCr", "RGB", "L"):
        return None
    limit = Image.MAX_IMAGE_PIXELS
    if limit is not None and width * height > limit:
        return None  # PIL's decompression-bomb check (a warning, or an error past twice the limit) decides
    return JpegInfo(width, height, colorspace, bool(progressive), subsampling)


def decode_jpeg_region(
    data: bytes | memoryview | np.ndarray,
    left: int,
    top: int,
    width: int,
    height: int,
    scale: int = 1,
    fancy: bool = True,
) -> np.ndarray | None:
    """Decodes only the region ``(left, top, width, height)`` of a JPEG at ``1/scale`` (1, 2, 4, 8).

    The region is in the scaled image's coordinates; the pixels equal PIL's full decode (``draft``
    for ``scale > 1``) or ``torchvision.io.decode_jpeg`` cropped, bit for bit. ``fancy=False``
    replicates chroma samples, as nvJPEG does, instead of libjpeg-turbo's smooth upsampling.
    Returns a writable ``(height, width, 3)`` uint8 RGB array, or ``None`` when libjpeg reported
    corrupt data (or the extension is off): the caller then decodes the reference way.
    """
    if min(left, top, width, height) < 0:
        raise ValueError(
            f"the region should have non-negative coordinates, but got left={left}, top={top}, "
            f"width={width}, height={height}"
        )
    if _jpeg is None or not USE_ROI_DECODE:
        return None
    try:
        pixels = _jpeg.decode(data, int(left), int(top), int(width), int(height), int(scale), fancy=fancy)
    except _jpeg.Error:
        return None
    return np.frombuffer(pixels, dtype=np.uint8).reshape(int(height), int(width), 3)


@functools.cache
def _torchvision_jpeg() -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``torchvision.io.decode_jpeg`` (RGB mode) if it is there and works, else ``None`` (checked once)."""
    try:
        from torchvision.io import ImageReadMode, decode_jpeg  # checked on first use, see below
    except (ImportError, AttributeError):  # removed in a future torchvision (deprecated in 0.29)
        return None

    def decode(encoded: torch.Tensor) -> torch.Tensor:
        image = decode_jpeg(encoded, mode=ImageReadMode.RGB)
        if not isinstance(image, torch.Tensor):  # only a list input gives a list
            raise TypeError(f"decode_jpeg returned {type(image).__name__} for one image")
        return image

    probe = io.BytesIO()
    Image.new("RGB", (16, 8), (200, 30, 90)).save(probe, format="JPEG")
    try:  # a torchvision built without its image extension raises here
        decode(torch.frombuffer(bytearray(probe.getvalue()), dtype=torch.uint8))
    except Exception:  # noqa: BLE001 - any failure means: use PIL
        return None
    return decode


def torchvision_jpeg_available() -> bool:
    """Whether :func:`decode_jpeg_tensor` can use ``torchvision.io.decode_jpeg`` here."""
    return _torchvision_jpeg() is not None


@functools.cache
def _decode_jpeg_takes_lists() -> bool:
    """Whether ``torchvision.io.decode_jpeg`` takes a list of images (torchvision 0.19 on)."""
    import torchvision

    major, minor = (int(part) for part in torchvision.__version__.split("+")[0].split(".")[:2])
    return (major, minor) >= (0, 19)


def decode_jpegs(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """``torchvision.io.decode_jpeg`` of encoded JPEG tensors, to RGB, on ``device``: one batched
    call where torchvision takes a list (0.19 on), else one call per image."""
    from torchvision.io import ImageReadMode, decode_jpeg  # on first use: keeps the import cheap

    on: dict[str, Any] = {"device": device} if device.type == "cuda" else {}
    if _decode_jpeg_takes_lists():
        return list(decode_jpeg(tensors, mode=ImageReadMode.RGB, **on))
    return [cast(torch.Tensor, decode_jpeg(t, mode=ImageReadMode.RGB, **on)) for t in tensors]


def decode_jpeg_tensor(data: bytes | memoryview | np.ndarray, name: str = "image") -> torch.Tensor:
    """Decodes a JPEG to a uint8 RGB ``(3, H, W)`` tensor: with ``torchvision.io.decode_jpeg``
    where it works (channels-last in memory), else with PIL."""
    decode = _torchvision_jpeg()
    if decode is None:
        return torch.from_numpy(
            np.array(decode_pil(data if not isinstance(data, np.ndarray) else data.tobytes(), name))
        ).permute(2, 0, 1)
    encoded = encoded_tensor(data)
    try:
        return decode(encoded)
    except DECODE_ERRORS as e:
        # torchvision prefixes its messages with "decode_jpeg, /path/to/decode_jpeg.cpp:171, ".
        message = str(e)
        if ".cpp:" in message:
            message = message.rsplit(".cpp:", 1)[-1].split(", ", 1)[-1]
        raise decode_error(name, message, data) from None


def encoded_tensor(data: bytes | memoryview | np.ndarray | torch.Tensor) -> torch.Tensor:
    """An encoded file as the 1-D uint8 tensor torchvision's decoders take: a tensor as it is, a
    writable contiguous uint8 array without a copy."""
    if isinstance(data, torch.Tensor):
        return data
    if (
        isinstance(data, np.ndarray)
        and data.dtype == np.uint8
        and data.ndim == 1
        and data.flags.writeable
        and data.flags.c_contiguous
    ):
        return torch.from_numpy(data)
    # torch.frombuffer warns on read-only buffers: hand it a private writable copy
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)
