"""A stand-in for ``nvidia.nvimgcodec`` on a machine without a GPU: the same classes and calls that
fastload makes (``Decoder``, ``Backend``, ``CodeStream.get_sub_code_stream(region=Region(...))``,
``Decoder.decode(..., params=, cuda_stream=)``), decoding with PIL on the CPU, and recording what
it was asked: the regions of every decode call. Installed with :func:`fastload.gpu.nvimgcodec.
use_module`.
"""

from __future__ import annotations

import enum
import io
from typing import Any

import numpy as np
from PIL import Image as PILImage

__version__ = "0.9.0-stand-in"


class BackendKind(enum.Enum):
    CPU_ONLY = 0
    GPU_ONLY = 1
    HYBRID_CPU_GPU = 2
    HW_GPU_ONLY = 3


class ColorSpec(enum.Enum):
    SRGB = 1


class SampleFormat(enum.Enum):
    I_RGB = 1
    P_RGB = 2


class Backend:
    def __init__(self, backend_kind: BackendKind = BackendKind.GPU_ONLY, load_hint: float = 1.0) -> None:
        self.backend_kind, self.load_hint = backend_kind, load_hint


class DecodeParams:
    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs


class Image:
    """An external buffer wrapped by :func:`as_images` (host memory: ``__array_interface__``)."""

    def __init__(self, source: Any, sample_format: SampleFormat | None) -> None:
        self.array = np.asarray(source)  # a view of the caller's memory
        self.sample_format = sample_format

    @property
    def __array_interface__(self) -> dict[str, Any]:
        return self.array.__array_interface__

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)


def as_images(sources: list[Any], cuda_stream: int = 0, *, sample_format: Any = None) -> list[Image]:
    as_images.calls += 1  # type: ignore[attr-defined]
    return [Image(s, sample_format) for s in sources]


as_images.calls = 0  # type: ignore[attr-defined]


class Region:
    def __init__(self, start_y: int, start_x: int, end_y: int, end_x: int) -> None:
        self.start = (start_y, start_x)
        self.end = (end_y, end_x)


class CodeStream:
    def __init__(self, array: Any, region: Region | None = None) -> None:
        self.data = bytes(np.asarray(array, dtype=np.uint8))
        self.region = region
        with PILImage.open(io.BytesIO(self.data)) as img:
            self.width, self.height = img.size
            self.progressive = bool(img.info.get("progressive"))

    def get_sub_code_stream(self, image_idx: int = 0, region: Region | None = None) -> CodeStream:
        return CodeStream(np.frombuffer(self.data, dtype=np.uint8), region)


class Decoder:
    """Decodes with PIL; ``refuse_progressive``: returns ``None`` for progressive JPEGs (as a
    decoder does for a file it does not take). Every instance and call is recorded on the class."""

    made: list[Decoder] = []
    refuse_progressive = False
    refuse_all = False  # as nvJPEG < 13.2 does for regions with fancy upsampling not enabled
    refuse_every = 0  # > 0: every this many-th image it is given (an odd file now and then)
    pitch = 0  # > 0: each image's rows padded by this many pixels (a decoder's pitched buffer)
    ignore_images = False  # True: images= ignored, new memory returned (as a decoder that cannot reuse)
    ignore_images_after: int | None = None  # ignored from the call after this many in-place calls
    in_place_calls = 0
    seen = 0

    def __init__(
        self, device_id: int = -1, max_num_cpu_threads: int = 0, backends: Any = None, options: str = ""
    ) -> None:
        self.device_id, self.backends, self.options = device_id, backends, options
        self.calls: list[list[tuple[tuple[int, int], tuple[int, int]] | None]] = []
        Decoder.made.append(self)

    def decode(
        self,
        srcs: list[CodeStream],
        *,
        images: list[Image] | None = None,
        params: Any = None,
        cuda_stream: int = 0,
    ) -> list[Any]:
        self.calls.append([None if s.region is None else (s.region.start, s.region.end) for s in srcs])
        planar = params is not None and params.kwargs.get("sample_format") == SampleFormat.P_RGB
        if images is not None and len(images) != len(srcs):
            raise ValueError(
                f"Size mismatch - images list has {len(images)} items, but code_streams list has {len(srcs)}"
            )
        ignore = self.ignore_images
        if images is not None:
            Decoder.in_place_calls += 1
            after = self.ignore_images_after
            ignore = ignore or (after is not None and Decoder.in_place_calls > after)
        out: list[Any] = []
        for k, s in enumerate(srcs):
            Decoder.seen += 1
            odd = self.refuse_every > 0 and Decoder.seen % self.refuse_every == 0
            if self.refuse_all or odd or (s.progressive and self.refuse_progressive):
                out.append(None)
                continue
            pixels = np.asarray(PILImage.open(io.BytesIO(s.data)).convert("RGB"))
            if s.region is not None:
                (y0, x0), (y1, x1) = s.region.start, s.region.end
                pixels = pixels[y0:y1, x0:x1]
            if images is not None and not ignore:  # into the caller's buffer
                target = images[k].array
                want = (3, *pixels.shape[:2]) if planar else pixels.shape
                if target.shape != want:
                    raise ValueError("Existing buffer is too small to fit new image")
                target[...] = pixels.transpose(2, 0, 1) if planar else pixels
                out.append(images[k])
                continue
            if planar:
                out.append(np.ascontiguousarray(pixels.transpose(2, 0, 1)))
                continue
            if self.pitch:  # the image as a view of a wider buffer: rows further apart than its width
                h, w, c = pixels.shape
                wide = np.full((h, w + self.pitch, c), 77, dtype=np.uint8)
                wide[:, :w] = pixels
                pixels = wide[:, :w]
            out.append(pixels if self.pitch else np.ascontiguousarray(pixels))  # HWC uint8, DLPack
        return out
