"""Helpers of the fault suite: the bad images, the torchvision reference, draining a loader, and the
slope of a measured series (the leak probe, ``_leak_probe.py``, snapshots what a process holds)."""

from __future__ import annotations

import io
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from PIL import Image
from torchvision.transforms.v2 import functional as F

from fastload import transforms as T
from fastload.synthetic import render_image

#: The per-sample pipelines of the suite (small outputs keep it fast).
SIZE = 32


def train_tf() -> T.Compose:
    return T.Compose([T.RandomResizedCrop(SIZE), T.RandomHorizontalFlip()])


def val_tf() -> T.Compose:
    return T.Compose([T.Resize(SIZE + 4), T.CenterCrop(SIZE)])


def _jpeg(img: Image.Image, **kwargs: Any) -> bytes:
    out = io.BytesIO()
    img.save(out, format="JPEG", quality=90, **kwargs)
    return out.getvalue()


def _save(img: Image.Image, fmt: str, **kwargs: Any) -> bytes:
    out = io.BytesIO()
    img.save(out, format=fmt, **kwargs)
    return out.getvalue()


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def bad_images() -> dict[str, bytes]:
    """The issue's bad-image matrix, as encoded files (all saved under a ``.jpg`` name)."""
    rgb = render_image((5, 1), 0, size=(96, 64))
    good = _jpeg(rgb)
    middle = bytearray(good)
    middle[len(good) // 2 : len(good) // 2 + 64] = bytes(range(64))
    gray16 = Image.fromarray(np.asarray(rgb.convert("L"), dtype=np.uint16) * 257)
    rgba = rgb.copy()
    rgba.putalpha(Image.new("L", rgb.size, 128))
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to display
    bomb_jpeg = bytearray(good)
    sof = bomb_jpeg.index(b"\xff\xc0")
    bomb_jpeg[sof + 5 : sof + 9] = struct.pack(">HH", 60000, 60000)  # the header claims 60000x60000
    bomb_png = (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", struct.pack(">IIBBBBB", 20000, 20000, 8, 2, 0, 0, 0))
        + _png_chunk(b"IDAT", zlib.compress(b"\x00" * 100))
        + _png_chunk(b"IEND", b"")
    )
    return {
        "zero": b"",
        "truncated": good[: len(good) // 2],
        "garbage-middle": bytes(middle),
        "cmyk": _jpeg(rgb.convert("CMYK")),
        "gray": _jpeg(rgb.convert("L")),
        "progressive": _jpeg(rgb, progressive=True),
        "png16": _save(gray16, "PNG"),
        "rgba": _save(rgba, "PNG"),
        "png-as-jpg": _save(rgb, "PNG"),
        "gif-as-jpg": _save(rgb, "GIF"),
        "webp-as-jpg": _save(rgb, "WEBP", quality=90),
        "exif-rotated": _jpeg(rgb, exif=exif.tobytes()),
        "bomb-jpeg": bytes(bomb_jpeg),
        "bomb-png": bomb_png,
        "1x1": _jpeg(Image.new("RGB", (1, 1), (10, 200, 30))),
        "10000x10": _jpeg(render_image((5, 2), 0, size=(10000, 10))),
        "html": b"<html><body>404 Not Found</body></html>\n" * 3,
    }


def reference_rgb(data: bytes) -> torch.Tensor | None:
    """What torchvision's ``ImageFolder`` loader makes of a file (PIL open + ``convert("RGB")``),
    as a uint8 ``(3, H, W)`` tensor; ``None`` when it raises."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            rgb = img.convert("RGB")
    except Exception:  # noqa: BLE001 - any failure of the reference loader is "it raises"
        return None
    return torch.from_numpy(np.array(rgb)).permute(2, 0, 1)


def reference_val(data: bytes) -> torch.Tensor | None:
    """torchvision's ``Resize(SIZE + 4)`` + ``CenterCrop(SIZE)`` on the reference decode."""
    rgb = reference_rgb(data)
    if rgb is None:
        return None
    return F.center_crop(F.resize(rgb, [SIZE + 4], antialias=True), [SIZE])


@dataclass
class Pass:
    """What one pass of a loader gave: each batch's indices, the errors, and the warnings."""

    batches: list[list[int]] = field(default_factory=list)
    images: list[torch.Tensor] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)


def drain(loader: Any, limit: int = 1000) -> Pass:
    """Every ``next()`` of one pass (an error in batch k does not end it: torch's contract)."""
    out = Pass()
    it = iter(loader)
    for _ in range(limit):
        try:
            batch = next(it)
        except StopIteration:
            return out
        except Exception as e:  # noqa: BLE001 - the test inspects what was raised
            out.errors.append(e)
            continue
        out.batches.append(batch.indices.tolist())
        out.images.append(batch[0].clone())
    raise AssertionError("the iterator never ended")


def slope(values: list[float]) -> float:
    """Least-squares slope of ``values`` against their index (units per step)."""
    x = np.arange(len(values), dtype=np.float64)
    return float(np.polyfit(x, np.asarray(values, dtype=np.float64), 1)[0])
