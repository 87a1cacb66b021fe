"""A null ``nvidia.nvimgcodec`` for bench/device_overhead.py: the calls fastload makes, answered at
once (headers by fastload's C parser, no pixel decoded, images handed back where they were asked
to be), so that what is timed is fastload's own work around the decoder."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

from fastload.decode import jpeg_info

# the API's enums and settings classes: the tests' stand-in's (its decoding is PIL's, not null)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from _fakenvimgcodec import Backend, BackendKind, ColorSpec, DecodeParams, SampleFormat  # noqa: E402

__all__ = ["Backend", "BackendKind", "CodeStream", "ColorSpec", "DecodeParams", "Decoder", "Image"]
__all__ += ["Region", "SampleFormat", "as_images"]

__version__ = "0.9.0-null"


class Region:
    __slots__ = ("y0", "x0", "y1", "x1")

    def __init__(self, y0: int, x0: int, y1: int, x1: int) -> None:
        self.y0, self.x0, self.y1, self.x1 = y0, x0, y1, x1


class CodeStream:
    __slots__ = ("array", "height", "width", "region")

    def __init__(self, array: np.ndarray, region: Region | None = None) -> None:
        info = jpeg_info(array)  # as nvImageCodec parses the header
        self.array, self.region = array, region
        self.height, self.width = (0, 0) if info is None else (info.height, info.width)

    def get_sub_code_stream(self, image_idx: int = 0, region: Region | None = None) -> CodeStream:
        sub = CodeStream.__new__(CodeStream)
        sub.array, sub.height, sub.width, sub.region = self.array, self.height, self.width, region
        return sub


class Image:
    __slots__ = ("source",)

    def __init__(self, source: Any) -> None:
        self.source = source

    @property
    def __array_interface__(self) -> dict[str, Any]:
        interface: dict[str, Any] = self.source.__array_interface__
        return interface

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.__array_interface__["shape"])


def as_images(sources: list[Any], cuda_stream: int = 0, *, sample_format: Any = None) -> list[Image]:
    return [Image(s) for s in sources]


_PIXELS = np.zeros((4096, 4096, 3), dtype=np.uint8)


class Decoder:
    def __init__(self, **kwargs: Any) -> None:
        pass

    def decode(
        self,
        srcs: list[CodeStream],
        *,
        images: list[Image] | None = None,
        params: Any = None,
        cuda_stream: int = 0,
    ) -> list[Any]:
        if images is not None:  # "decoded" where asked: nothing written
            return list(images)
        out = []
        for s in srcs:
            r = s.region
            h, w = (s.height, s.width) if r is None else (r.y1 - r.y0, r.x1 - r.x0)
            out.append(_PIXELS[:h, :w])  # a view of a wider buffer, as a pitched decoder output
        return out
