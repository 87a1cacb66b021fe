"""Decoding with NVIDIA nvImageCodec (optional; docs/gpu.md, "Decoding on the GPU"): where it
imports and the device is CUDA, the device paths decode their JPEGs with it instead of
``torchvision.io.decode_jpeg`` (``FASTLOAD_NVIMGCODEC=0``: off).

:class:`RegionDecoder`: the hardware decoder takes :func:`hw_decoder_load` of each batch, nvJPEG
the rest; libjpeg-turbo's chroma upsampling, RGB uint8, no EXIF rotation; with a leading
``gpu.RandomResizedCrop`` only each crop box plus :data:`MARGIN` (nvJPEG before 13.2 may get a
region's outermost pixels wrong) is decoded, on the calling thread's stream, and copied into
torch's memory. Experimental (``FASTLOAD_GPU_EXPERIMENTAL=1``): the crops decoded in place into one
buffer per batch (:meth:`RegionDecoder.decode_packed`), through the C interface where
``fastload._nvimgcodec`` is built (``FASTLOAD_NVIMGCODEC_NATIVE=0``: off). An image it cannot
decode (``None``) is decoded by the CPU.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import itertools
import math
import os
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar, cast

import numpy as np
import torch

from .._slices import ByteSlices
from ..device import GPU_EXPERIMENTAL, gpu_experimental
from .base import PackedImages
from .streams import pinned_device

__all__ = [
    "DecoderUnavailable",
    "MARGIN",
    "NATIVE",
    "PACKED",
    "NotInPlace",
    "dlpack_tensor",
    "OPTIONS",
    "RegionDecoder",
    "available",
    "decodes_in_place",
    "hw_decoder_load",
    "native_interface",
    "nvimgcodec_version",
    "use_module",
]

OPTIONS = ":fancy_upsampling=1 :enable_roi_fancy_upsampling=1"  # libjpeg-turbo's upsampling, in regions too
MARGIN = 1  # pixels decoded around each region (where the image has them), then cut off
PACKED = True  # region decoding writes into one buffer per batch where nvImageCodec can
NATIVE = True  # an in-place batch by one call into nvImageCodec's C interface where it can be
CPU_ONLY_DEVICE = -99999  # nvImageCodec's NVIMGCODEC_DEVICE_CPU_ONLY
ALIGN = 256  # the byte boundary each image of an in-place batch buffer starts on

_injected: Any = None  # what _module() returns instead of nvidia.nvimgcodec (use_module)


@functools.lru_cache(maxsize=1)
def _imported() -> Any:
    if os.environ.get("FASTLOAD_NVIMGCODEC", "1") == "0":
        return None
    try:  # optional: pip install 'fastload[nvimgcodec-cu12]'
        return importlib.import_module("nvidia.nvimgcodec")
    except ImportError:
        return None


def _module() -> Any:
    return _injected if _injected is not None else _imported()


@contextlib.contextmanager
def use_module(module: Any) -> Iterator[None]:
    """Inside the block, ``module`` stands in for ``nvidia.nvimgcodec`` on any device (tests)."""
    global _injected
    previous, _injected = _injected, module
    try:
        yield
    finally:
        _injected = previous


def available(device: torch.device | str | None) -> bool:
    """Whether the device paths decode with nvImageCodec on ``device``: it imports, is 0.9 or later
    and the device is CUDA (any device under :func:`use_module`)."""
    if _injected is not None:
        return True
    device = torch.device("cpu") if device is None else torch.device(device)
    module = _imported() if device.type == "cuda" else None
    return module is not None and _version_at_least(module, (0, 9))


def too_old() -> bool:
    """Whether the nvImageCodec that imports is older than 0.9 (fastload uses its ``sample_format``)."""
    module = _imported()
    return module is not None and not _version_at_least(module, (0, 9))


def nvimgcodec_version() -> str | None:
    """nvImageCodec's version where it imports, else ``None``."""
    module = _module()
    return None if module is None else str(getattr(module, "__version__", "unknown"))


def _version_at_least(module: Any, wanted: tuple[int, int]) -> bool:
    """Whether ``module.__version__`` (``"0.9.0"``, ``"0.9.0-stand-in"``) is ``wanted`` or later."""
    parts = str(getattr(module, "__version__", "0")).split(".")
    numbers = []
    for part in parts[:2]:
        digits = "".join(itertools.takewhile(str.isdigit, part))
        numbers.append(int(digits) if digits else 0)
    return hasattr(module, "as_images") and tuple(numbers + [0] * (2 - len(numbers))) >= wanted


def decodes_in_place() -> bool:
    """Whether region decoding writes each batch's crops into one buffer (experimental)."""
    nv = _module()
    return (
        PACKED
        and gpu_experimental()
        and nv is not None
        and _version_at_least(nv, (0, 9))
        and hasattr(getattr(nv, "SampleFormat", None), "P_RGB")
    )


def _library_path(module: Any) -> str | None:
    """The nvImageCodec library ``module`` (``nvidia.nvimgcodec``) loads, where it is a file."""
    folder = os.path.dirname(getattr(module, "__file__", None) or "")
    path = os.path.join(folder, "libnvimgcodec.so.0")
    return path if folder and os.path.isfile(path) else None


def native_interface() -> tuple[bool, str]:
    """Whether in-place batches go through nvImageCodec's C interface, and if not, why (in words)."""
    nv = _module()
    if nv is None:
        return False, "nvImageCodec is not installed"
    if not gpu_experimental():
        return False, f"experimental, not measured on a GPU yet ({GPU_EXPERIMENTAL}=1 turns it on)"
    if not decodes_in_place():
        return False, "the crops are not decoded in place"
    if not NATIVE or os.environ.get("FASTLOAD_NVIMGCODEC_NATIVE", "1") == "0":
        return False, "turned off (FASTLOAD_NVIMGCODEC_NATIVE=0 or fastload.gpu.nvimgcodec.NATIVE)"
    try:
        importlib.import_module("fastload._nvimgcodec")
    except ImportError:
        return False, "fastload's C extension for it is not built (a C compiler at install time builds it)"
    if _library_path(nv) is None:
        return False, f"nvImageCodec {nvimgcodec_version()} has no libnvimgcodec.so.0 beside its module"
    if not _version_at_least(nv, (0, 9)) or _version_at_least(nv, (0, 10)):
        return False, f"nvImageCodec {nvimgcodec_version()}: fastload declares the C interface of 0.9 only"
    return True, "by one call into its C interface per batch, without the interpreter"


def hw_decoder_load() -> float:
    """The share of each batch for the hardware JPEG decoder: ``FASTLOAD_HW_DECODER_LOAD`` where
    set (0 to 1), else 0.9 (DALI's default)."""
    text = os.environ.get("FASTLOAD_HW_DECODER_LOAD", "").strip()
    if not text:
        return 0.9
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= 1.0:
        raise ValueError(
            f"FASTLOAD_HW_DECODER_LOAD={text!r}: give the share of each batch for the GPU's hardware JPEG "
            "decoder, a number from 0 to 1 (e.g. 1.0: all of it), or unset it for 0.9"
        )
    return value


def dlpack_tensor(image: Any, stream: int | None) -> torch.Tensor:
    """``torch.from_dlpack(image)``, ready on CUDA stream ``stream`` (``None``: a CPU image), without
    its per-call stream lookup and protocol-version retry."""
    if stream is None:  # on the CPU: torch's own negotiation (e.g. a read-only numpy array)
        try:
            return torch.from_dlpack(image)
        except (RuntimeError, BufferError):  # nvImageCodec's host images (its export asks CUDA);
            array = np.asarray(image)  # or a read-only array torch 2.1 will not take
            return torch.from_numpy(array if array.flags.writeable else array.copy())
    return torch.from_dlpack(image.__dlpack__(stream=stream))


class _Plane:
    """A ``(3, H, W)`` uint8 image in fastload's buffer, as the array interface nvImageCodec decodes into."""

    __slots__ = ("ptr", "_interface", "_cuda")

    def __init__(self, ptr: int, height: int, width: int, cuda: bool, stream: int | None) -> None:
        self.ptr, self._cuda = ptr, cuda
        self._interface = {
            "shape": (3, height, width),
            "typestr": "|u1",
            "data": (ptr, False),
            "strides": None,
            "version": 3,
        }
        if cuda:
            self._interface["stream"] = stream  # the decode's own stream: no synchronisation

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        if not self._cuda:
            raise AttributeError("__cuda_array_interface__")
        return self._interface

    @property
    def __array_interface__(self) -> dict[str, Any]:
        if self._cuda:
            raise AttributeError("__array_interface__")
        return self._interface


class DecoderUnavailable(RuntimeError):
    """nvImageCodec could not make its decoder when first needed (:attr:`RegionDecoder.decoder`)."""


class NotInPlace(RuntimeError):
    """nvImageCodec did not decode into the buffer it was given (see :meth:`RegionDecoder.decode_packed`)."""


_Method = TypeVar("_Method", bound=Callable[..., Any])


def _one_at_a_time(method: _Method) -> _Method:
    @functools.wraps(method)
    def locked(self: RegionDecoder, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return cast(_Method, locked)


class RegionDecoder:
    """nvImageCodec's decoder for one device (see the module docs), made in the thread that uses it;
    ``hw_load``: ``None``: :func:`hw_decoder_load`; ``cpu_threads``: 0: one per CPU."""

    def __init__(self, device: torch.device, hw_load: float | None = None, cpu_threads: int = 0) -> None:
        hw_load = hw_decoder_load() if hw_load is None else hw_load
        nv = _module()
        if nv is None:  # pragma: no cover - callers check available() first
            raise ImportError(
                "nvImageCodec is not installed: pip install 'fastload[nvimgcodec-cu12]' (or -cu13, matching "
                "torch's CUDA)"
            )
        device = pinned_device(device)  # "cuda": this thread's device, not device 0 on every rank
        self.nv = nv
        self.device = device
        kinds = nv.BackendKind
        # on a CPU device, nvImageCodec's own CPU decoder where it has one (the tests without a GPU)
        cpu_only = device.type != "cuda" and hasattr(nv, "NVIMGCODEC_DEVICE_CPU_ONLY")
        device_id = (device.index or 0) if device.type == "cuda" else CPU_ONLY_DEVICE if cpu_only else 0
        backends = (
            [(kinds.CPU_ONLY, 1.0)]
            if cpu_only
            else [(kinds.HW_GPU_ONLY, hw_load), (kinds.GPU_ONLY, 1.0), (kinds.HYBRID_CPU_GPU, 1.0)]
        )
        self._decoder_args: dict[str, Any] = dict(
            device_id=device_id,
            max_num_cpu_threads=cpu_threads,
            backends=[nv.Backend(kind, load_hint=load) for kind, load in backends],
            options=OPTIONS,
        )
        self._decoder: Any = None
        self._held: tuple[Any, Any] | None = None  # (event, the last decode's images)
        # one call at a time: a pass left behind may still be decoding when the next one starts
        self._lock = threading.RLock()
        params = dict(apply_exif_orientation=False, color_spec=nv.ColorSpec.SRGB, allow_any_depth=False)
        self.params = nv.DecodeParams(**params, sample_format=nv.SampleFormat.I_RGB)
        self.packs = decodes_in_place()
        self._checked = False  # the first packed decode is checked to have landed in place
        self.planar_params = (
            nv.DecodeParams(**params, sample_format=nv.SampleFormat.P_RGB) if self.packs else None
        )
        # the C interface's session, made by the first in-place batch; native_reason: why not
        self.native: Any = None
        usable, self.native_reason = native_interface()
        self._native_args: tuple[Any, ...] | None = (
            (
                _library_path(nv),
                device_id,
                [(int(kind.value), float(load)) for kind, load in backends],
                OPTIONS,
                cpu_threads,
                device.type == "cuda",
            )
            if usable
            else None
        )
        if not usable:  # made now: a decoder nvImageCodec cannot make is said at once
            self._decoder = nv.Decoder(**self._decoder_args)

    @property
    def through_c(self) -> bool:
        """Whether in-place batches go through the C interface (made, or to be made by the first)."""
        return self.native is not None or self._native_args is not None

    def _native_session(self) -> Any:
        """The C interface's session, made by the first in-place batch; ``None`` where it cannot
        be made (said once, and by :attr:`native_reason`)."""
        args, self._native_args = self._native_args, None
        if args is not None:
            try:
                self.native = importlib.import_module("fastload._nvimgcodec").Session(*args)
            except Exception as e:  # noqa: BLE001 - its Python interface decodes instead
                self.native_reason = f"its C interface could not be used ({type(e).__name__}: {e})"
                warnings.warn(
                    f"nvImageCodec's C interface could not be used ({type(e).__name__}: {e}); fastload calls "
                    "its Python interface instead (more interpreter time per image)",
                    stacklevel=4,
                )
        return self.native

    @property
    def decoder(self) -> Any:
        """nvImageCodec's Python decoder, made when first needed where the C interface decodes
        (each has its own GPU state and threads); :class:`DecoderUnavailable` if it cannot be made."""
        if self._decoder is None:
            try:
                self._decoder = self.nv.Decoder(**self._decoder_args)
            except Exception as e:  # noqa: BLE001 - said by the caller, which decodes otherwise
                raise DecoderUnavailable(
                    f"nvImageCodec could not make a decoder ({type(e).__name__}: {e})"
                ) from e
        return self._decoder

    def _sources(
        self,
        encoded: Sequence[bytes | memoryview | np.ndarray],
        regions: Sequence[tuple[int, int, int, int] | None],
    ) -> tuple[list[Any], list[tuple[int, int, int, int] | None]]:
        """The code streams, each limited to its region and margin, and the regions asked for."""
        nv = self.nv
        sources = []
        asked: list[tuple[int, int, int, int] | None] = []
        for data, region in zip(encoded, regions, strict=True):
            array = data if isinstance(data, np.ndarray) else np.frombuffer(data, dtype=np.uint8)
            source = nv.CodeStream(array)
            if region is not None:
                top, left, height, width = region
                full_h, full_w = int(source.height), int(source.width)
                y0, x0 = max(0, top - MARGIN), max(0, left - MARGIN)
                y1 = min(full_h, top + height + MARGIN)
                x1 = min(full_w, left + width + MARGIN)
                source = source.get_sub_code_stream(region=nv.Region(y0, x0, y1, x1))
                asked.append((y0, x0, y1 - y0, x1 - x0))
            else:
                asked.append(None)
            sources.append(source)
        return sources, asked

    @_one_at_a_time
    def decode(
        self,
        encoded: Sequence[bytes | memoryview | np.ndarray],
        regions: Sequence[tuple[int, int, int, int] | None],
        stream: Any = None,
    ) -> list[torch.Tensor | None]:
        """Decodes ``encoded`` (JPEGs), each only in its region ``(top, left, height, width)`` or whole,
        on the current stream (``stream``: its object): one ``(3, H, W)`` uint8 tensor per image,
        ``None`` where nvImageCodec could not decode it."""
        sources, asked = self._sources(encoded, regions)
        self.release()
        handle = getattr(stream, "cuda_stream", 0) if stream is not None else 0
        decoded = self.decoder.decode(sources, params=self.params, cuda_stream=handle)
        cuda = self.device.type == "cuda"
        # the capsules made ready on the current stream (1: DLPack's name for CUDA's legacy default)
        ready_on = (torch.cuda.current_stream(self.device).cuda_stream or 1) if cuda else None
        out: list[torch.Tensor | None] = []
        for image, region, outer in zip(decoded, regions, asked, strict=True):
            if image is None:
                out.append(None)
                continue
            hwc = dlpack_tensor(image, ready_on)  # nvImageCodec's memory, (H, W, C)
            got_h, got_w, channels = hwc.shape
            dy = dx = 0
            height, width = got_h, got_w
            if region is not None and outer is not None:
                top, left, height, width = region
                if got_h == outer[2] and got_w == outer[3]:  # the region asked for: cut the margin
                    dy, dx = top - outer[0], left - outer[1]
                else:  # a backend that ignored the region (the whole image): cut the box here
                    dy, dx = top, left
                if dy + height > got_h or dx + width > got_w:
                    out.append(None)  # not what was asked: the CPU decodes it
                    continue
            # the box, channels first, as one view (one call, cheaper than slicing and permuting)
            row, column, channel = hwc.stride()
            view = hwc.as_strided(
                (channels, height, width),
                (channel, row, column),
                hwc.storage_offset() + dy * row + dx * column,
            )
            # on a GPU, a contiguous copy in torch's allocator (record_stream works on it only)
            if cuda:
                view = view.clone() if view.is_contiguous() else view.contiguous()
            out.append(view)
        if cuda:  # pragma: no cover - needs CUDA
            event = torch.cuda.Event(blocking=True)  # waited on by this thread: sleeping, not spinning
            event.record(torch.cuda.current_stream(self.device))
            self._held = (event, decoded)  # nvImageCodec's images live until the copies are done
        return out

    @_one_at_a_time
    def decode_packed(
        self,
        encoded: Sequence[bytes | memoryview | np.ndarray],
        regions: Sequence[tuple[int, int, int, int]],
        stream: Any = None,
        sizes: np.ndarray | Sequence[tuple[int, int]] | None = None,
    ) -> tuple[PackedImages, np.ndarray, list[bool] | np.ndarray] | None:
        """:meth:`decode` with margins, channels first into one buffer made here on the current
        stream. ``sizes``: each image's ``(height, width)`` where known.

        Returns:
            The regions (:class:`~fastload.gpu.base.PackedImages`), each box within its region
            (``(n, 4)``) and whether each image was decoded; ``None``: not in place here (then
            :attr:`packs` is off and :meth:`decode` takes over).
        """
        nv = self.nv
        wanted = np.array(regions, dtype=np.int64).reshape(-1, 4)
        native = sources = None
        if sizes is not None:  # the margins in array steps (per image: only nvImageCodec's calls)
            full = np.array(sizes, dtype=np.int64).reshape(-1, 2)
            y0 = np.maximum(wanted[:, 0] - MARGIN, 0)
            x0 = np.maximum(wanted[:, 1] - MARGIN, 0)
            y1 = np.minimum(full[:, 0], wanted[:, 0] + wanted[:, 2] + MARGIN)
            x1 = np.minimum(full[:, 1], wanted[:, 1] + wanted[:, 3] + MARGIN)
            outer = np.stack([y0, x0, y1 - y0, x1 - x0], axis=1)  # y0, x0, height, width (with margin)
            native = self._native_session()  # (read once: another pass's thread may drop it)
            if native is None:  # (else the C interface makes the sources, without the interpreter)
                code_stream, region = nv.CodeStream, nv.Region
                with contextlib.suppress(Exception):  # e.g. a size nvImageCodec reads otherwise: its own
                    sources = [
                        code_stream(
                            data if isinstance(data, np.ndarray) else np.frombuffer(data, dtype=np.uint8)
                        ).get_sub_code_stream(region=region(*r))
                        for data, r in zip(encoded, np.stack([y0, x0, y1, x1], axis=1).tolist(), strict=True)
                    ]
        if native is None and sources is None:
            sources, asked = self._sources(encoded, regions)
            outer = np.array(asked, dtype=np.int64).reshape(-1, 4)
        boxes = np.stack(
            [wanted[:, 0] - outer[:, 0], wanted[:, 1] - outer[:, 1], wanted[:, 2], wanted[:, 3]], axis=1
        )
        heights, widths = outer[:, 2], outer[:, 3]
        numels = 3 * heights * widths
        # each image on a 256-byte boundary (as CUDA's own allocations are)
        spans = (numels + ALIGN - 1) // ALIGN * ALIGN
        offsets = np.zeros(len(numels), dtype=np.int64)
        np.cumsum(spans[:-1], out=offsets[1:])
        # room past the last image for the resampler's row windows (see gpu.resample)
        total = int(spans.sum()) + (int(widths.max()) if len(widths) else 0)
        flat = torch.empty(total, dtype=torch.uint8, device=self.device)
        cuda = self.device.type == "cuda"
        handle = 0
        if cuda:  # the stream the buffer is allocated on: the decode is queued there
            handle = int(
                getattr(stream, "cuda_stream", 0) or torch.cuda.current_stream(self.device).cuda_stream
            )
        base = flat.data_ptr()
        self.release()
        if native is not None:
            boxes_with_margin = np.stack(
                [outer[:, 0], outer[:, 1], outer[:, 0] + heights, outer[:, 1] + widths], axis=1
            )
            destinations = (offsets + base).astype(np.uint64)
            try:
                if isinstance(encoded, ByteSlices):  # one buffer: no object per file either
                    starts, ends = np.ascontiguousarray(encoded.starts), np.ascontiguousarray(encoded.ends)
                    done = native.decode_slices(
                        encoded.data, starts, ends, boxes_with_margin, destinations, handle
                    )
                else:
                    done = native.decode(encoded, boxes_with_margin, destinations, handle)
            except (RuntimeError, OSError) as e:  # nvImageCodec's: its Python interface takes over
                self.native, self.native_reason = None, f"its C interface failed ({type(e).__name__}: {e})"
                warnings.warn(
                    f"nvImageCodec's C interface failed ({type(e).__name__}: {e}); fastload calls its Python "
                    "interface from now on (more interpreter time per image)",
                    stacklevel=4,
                )
                return self.decode_packed(encoded, regions, stream, sizes)
            done = np.frombuffer(done, dtype=np.bool_)  # (a column: no object per image)
            return PackedImages(flat, offsets, heights, widths, 3), boxes, done
        planes = [
            _Plane(base + o, h, w, cuda, handle or None)
            for o, h, w in zip(offsets.tolist(), heights.tolist(), widths.tolist(), strict=True)
        ]
        try:
            images = nv.as_images(planes, cuda_stream=handle, sample_format=nv.SampleFormat.P_RGB)
            decoded = self.decoder.decode(
                sources, images=images, params=self.planar_params, cuda_stream=handle
            )
        except DecoderUnavailable:  # the caller gives nvImageCodec up
            return None
        except Exception as e:  # noqa: BLE001 - the copies decode the batch (and raise what is the files')
            if not self._checked:
                self._give_up(e)
            return None
        # every batch: each image is the one given, or lies in its plane; the first one's shape too
        for image, wrapper, plane in zip(decoded, images, planes, strict=True):
            if image is None or image is wrapper:
                continue
            interface = image.__cuda_array_interface__ if cuda else image.__array_interface__
            if int(interface["data"][0]) != plane.ptr:
                self._give_up(NotInPlace("an image came back outside the buffer given"))
                return None
        if not self._checked:
            for image, h, w in zip(decoded, heights.tolist(), widths.tolist(), strict=True):
                if image is None:
                    continue
                if tuple(image.shape) != (3, h, w):
                    self._give_up(
                        NotInPlace(f"an image came back {tuple(image.shape)}, not planar (3, {h}, {w})")
                    )
                    return None
                self._checked = True
                break
        ok = [image is not None for image in decoded]
        return PackedImages(flat, offsets, heights, widths, 3), boxes, ok

    def _give_up(self, error: BaseException) -> None:
        """Decoding in place turned off for this decoder, with one warning saying why."""
        self.packs = False
        warnings.warn(
            f"nvImageCodec {nvimgcodec_version()} could not decode into fastload's batch buffer "
            f"({type(error).__name__}: {error}); each image is copied out of nvImageCodec's own memory "
            "from now on (a few microseconds more per image)",
            stacklevel=4,
        )

    @_one_at_a_time
    def release(self) -> None:
        """Lets go of the last call's nvImageCodec images once the copies out of them are done."""
        held, self._held = self._held, None
        if held is not None:  # pragma: no cover - needs CUDA
            held[0].synchronize()  # only the decoder thread waits, a batch later
