"""Decoding on the device for the device paths' decoder thread (:class:`BatchDecoder`):
nvImageCodec where usable, else :func:`decode_batch` (nvJPEG through ``torchvision.io.decode_jpeg``);
the CPU's decoders for the rest, copied over through pinned memory. :class:`Headers` says which
decoder takes each sample; :func:`device_decoder` names the decoder in words.
"""

from __future__ import annotations

import io
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image, JpegImagePlugin

from .._slices import ByteSlices
from ..decode import (
    DECODE_ERRORS,
    JPEG_FORMATS,
    decode_jpeg_tensor,
    decode_jpegs,
    decode_pil,
    encoded_tensor,
    jpeg_extension_built,
    jpeg_header,
    jpeg_info,
    open_image,
    roi_decoder_available,
    torchvision_jpeg_available,
)
from ..device import GPU_EXPERIMENTAL, gpu_experimental
from . import nvimgcodec
from .base import PackedImages
from .memory import host_memory

__all__ = [
    "ROUTE_CPU",
    "ROUTE_DEVICE",
    "ROUTE_UNKNOWN",
    "BatchDecoder",
    "Headers",
    "RegionBatch",
    "decode_batch",
    "device_decoder",
    "device_routes",
]


def _to_device(image: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU-decoded image on ``device``: through pinned memory (an asynchronous copy) to a GPU."""
    if device.type == "cpu":
        return image
    host = host_memory()
    if host.can_pin():
        return host.pin(image).to(device, non_blocking=True)
    return image.to(device)


def device_decoder(
    device: torch.device | str | None,
    nvimgcodec_usable: bool = True,
    in_place: bool | None = None,
    native: tuple[bool, str] | None = None,
) -> str:
    """Which decoder the device paths run on ``device`` for baseline JPEGs, in words (the loader's
    log line, ``python -m fastload info``). ``nvimgcodec_usable=False``: nvImageCodec given up;
    ``in_place``, ``native``: how it decodes the crops (``None``: as :mod:`~fastload.gpu.nvimgcodec` says)."""
    device = torch.device("cpu") if device is None else torch.device(device)
    if nvimgcodec_usable and nvimgcodec.available(device):
        if in_place is None:
            in_place = nvimgcodec.decodes_in_place()
        if in_place:
            through_c, why = nvimgcodec.native_interface() if native is None else native
            how = "the crops decoded into one buffer per batch, " + (
                why if through_c else f"through its Python interface: {why}"
            )
        elif not gpu_experimental():
            how = (
                "each image copied out of nvImageCodec's memory; decoding the crops in place is "
                f"experimental, not measured on a GPU yet: {GPU_EXPERIMENTAL}=1 turns it on"
            )
        elif not nvimgcodec.PACKED:
            how = "each image copied out of nvImageCodec's memory: fastload.gpu.nvimgcodec.PACKED is off"
        elif nvimgcodec.decodes_in_place():
            how = "each image copied out of nvImageCodec's memory: decoding in place failed, see its warning"
        else:
            how = (
                "each image copied out of nvImageCodec's memory; nvImageCodec 0.9 decodes the crops in "
                "place: pip install -U 'fastload[nvimgcodec-cu12]' or -cu13"
            )
        return (
            f"nvImageCodec {nvimgcodec.nvimgcodec_version()} (the hardware JPEG decoder where the GPU has "
            f"one, nvJPEG on CUDA otherwise; decoding only the crop of a RandomResizedCrop; {how})"
        )
    if not torchvision_jpeg_available():
        return "PIL on the CPU (torchvision.io.decode_jpeg is not available)"
    if device.type == "cuda":
        why = (
            f"nvImageCodec {nvimgcodec.nvimgcodec_version()} is installed, but fastload needs 0.9 or "
            "later: pip install -U 'fastload[nvimgcodec-cu12]' or -cu13"
            if nvimgcodec_usable and nvimgcodec.too_old()
            else "nvImageCodec adds the hardware decoder and region decoding: pip install "
            "'fastload[nvimgcodec-cu12]' or -cu13"
        )
        return f"nvJPEG through torchvision.io.decode_jpeg (batched; deprecated from torchvision 0.29; {why})"
    return "libjpeg-turbo on the CPU through torchvision.io.decode_jpeg (no GPU decoder on a CPU device)"


ROUTE_UNKNOWN, ROUTE_DEVICE, ROUTE_CPU = 0, 1, 2  # not known yet, the device's decoder, the CPU's


def _route(data: bytes | memoryview | np.ndarray) -> int:
    """Where an image is decoded: a JPEG in YCbCr, RGB or grayscale by the device, else the CPU."""
    if not torchvision_jpeg_available():
        return ROUTE_CPU
    header = jpeg_header(data) if jpeg_extension_built() else _pil_header(data)
    return ROUTE_DEVICE if header is not None else ROUTE_CPU


def _pil_header(data: bytes | memoryview | np.ndarray) -> tuple[int, int, bool, str] | None:
    """Without the C extension: PIL reads the header (it does not decode) of a JPEG in YCbCr, RGB or
    grayscale, ``(width, height, progressive, subsampling)``; anything else: ``None``."""
    try:
        img = Image.open(io.BytesIO(data.tobytes() if isinstance(data, np.ndarray) else bytes(data)))
    except (OSError, ValueError, Image.DecompressionBombError):
        return None
    if img.format not in JPEG_FORMATS or img.mode not in ("RGB", "L"):
        return None
    sampling = {0: "4:4:4", 1: "4:2:2", 2: "4:2:0"}.get(JpegImagePlugin.get_sampling(img), "other")
    return *img.size, bool(img.info.get("progressive")), "gray" if img.mode == "L" else sampling


class Headers:
    """Each sample's header, read when first seen and kept for the loader's life, as numpy columns:
    ``route`` (:data:`ROUTE_UNKNOWN`, :data:`ROUTE_DEVICE` or :data:`ROUTE_CPU`, as :func:`_route`),
    ``width``, ``height`` (0 on the CPU's route), ``progressive`` (1 baseline, 2 progressive) and
    ``subsampling`` (an index into :attr:`SUBSAMPLING`); 0: not known.
    """

    SUBSAMPLING = ("unknown", "4:4:4", "4:2:2", "4:2:0", "4:4:0", "4:1:1", "gray", "other")

    def __init__(self, n: int) -> None:
        self.route = np.zeros(n, dtype=np.int8)
        self.width = np.zeros(n, dtype=np.int32)
        self.height = np.zeros(n, dtype=np.int32)
        self.progressive = np.zeros(n, dtype=np.int8)
        self.subsampling = np.zeros(n, dtype=np.int8)

    def __len__(self) -> int:
        return len(self.route)

    def see(
        self, encoded: Sequence[bytes | memoryview | np.ndarray | torch.Tensor], indices: np.ndarray
    ) -> None:
        """Fills in the samples ``indices`` not seen yet from their files ``encoded``."""
        indices = np.asarray(indices)
        for k in np.flatnonzero(self.route[indices] == ROUTE_UNKNOWN).tolist():  # (all seen: no step)
            data = encoded[k]
            self._read(int(indices[k]), data.numpy() if isinstance(data, torch.Tensor) else data)

    def _read(self, i: int, data: bytes | memoryview | np.ndarray) -> None:
        if roi_decoder_available():
            info = jpeg_info(data)
            header = None if info is None else (info.width, info.height, info.progressive, info.subsampling)
        else:
            header = _pil_header(data)
        if header is None:
            self.route[i] = ROUTE_CPU
            return
        width, height, progressive, subsampling = header
        self.width[i], self.height[i] = width, height
        self.progressive[i] = 2 if progressive else 1
        self.subsampling[i] = self.SUBSAMPLING.index(subsampling)
        self.route[i] = ROUTE_DEVICE

    def on_device(self, indices: np.ndarray) -> list[bool]:
        """For :func:`decode_batch`'s ``on_device``: whether the device decodes each sample (seen)."""
        return (self.route[indices] == ROUTE_DEVICE).tolist()


@dataclass(eq=False)
class RegionBatch:
    """A batch of ``n`` decoded by :meth:`BatchDecoder.decode_regions`: the images ``packed`` in
    place (each its crop box with a margin; at ``positions`` of the batch, their ``boxes`` in them)
    and ``others``: ``(position, image, is_box)``, ``is_box``: cut to its crop box, else whole.
    """

    n: int
    packed: PackedImages | None
    positions: np.ndarray
    boxes: np.ndarray
    others: list[tuple[int, torch.Tensor, bool]]

    def __len__(self) -> int:
        return self.n

    def tensors(self) -> list[torch.Tensor]:
        """The device memory the batch's images are in (what streams that use them record)."""
        out = [] if self.packed is None else [self.packed.flat]
        return out + [image for _, image, _ in self.others]


GIVE_UP_AFTER = 16  # nvImageCodec is given up once it refused most of this many JPEGs or more


class BatchDecoder:
    """What a device path's decoder thread decodes each batch with: nvImageCodec where it is
    usable, else :func:`decode_batch`. Made in the thread that uses it; ``cpu_threads``:
    nvImageCodec's (0: one per CPU)."""

    def __init__(self, device: torch.device, cpu_threads: int = 0) -> None:
        self.device = device
        self.region_decoder: nvimgcodec.RegionDecoder | None = None
        self.refused = self.asked = 0  # valid JPEGs nvImageCodec returned nothing for, of those given
        self._count_lock = threading.Lock()
        if nvimgcodec.available(device):
            hw_load = nvimgcodec.hw_decoder_load()  # a bad FASTLOAD_HW_DECODER_LOAD is the user's to fix
            try:
                self.region_decoder = nvimgcodec.RegionDecoder(device, hw_load, cpu_threads=cpu_threads)
            except Exception as e:  # noqa: BLE001 - e.g. a driver or nvJPEG library it cannot use
                warnings.warn(
                    f"nvImageCodec could not make a decoder on {device} ({e}); decoding with "
                    "torchvision.io.decode_jpeg instead (FASTLOAD_NVIMGCODEC=0 skips nvImageCodec)",
                    stacklevel=2,
                )

    @property
    def name(self) -> str:
        """What this decoder runs, in words (:func:`device_decoder`)."""
        region_decoder = self.region_decoder
        if region_decoder is None:
            return device_decoder(self.device, False)
        native = (region_decoder.through_c, region_decoder.native_reason)
        return device_decoder(self.device, True, region_decoder.packs, native)

    @property
    def regions(self) -> bool:
        """Whether :meth:`decode` decodes only a region of each JPEG when given one."""
        return self.region_decoder is not None

    def decode(
        self,
        encoded: Sequence[bytes | memoryview | np.ndarray | torch.Tensor],
        names: Sequence[str],
        on_device: Sequence[bool],
        regions: Sequence[tuple[int, int, int, int] | None] | None = None,
        stream: Any = None,
    ) -> list[torch.Tensor]:
        """The batch decoded, image ``k`` only in ``regions[k]`` where given; the device decodes the
        images ``on_device``, the CPU the others and any the device could not decode."""
        region_decoder = self.region_decoder
        if region_decoder is None:
            images = decode_batch(encoded, self.device, names, on_device=on_device)
            if regions is None:
                return images
            # regions asked of a decoder given up meanwhile (by another pass's thread): cut them
            return [
                image if r is None else image[:, r[0] : r[0] + r[2], r[1] : r[1] + r[3]]
                for image, r in zip(images, regions, strict=True)
            ]
        wanted = regions if regions is not None else [None] * len(encoded)
        raws = [data.numpy() if isinstance(data, torch.Tensor) else data for data in encoded]
        out: list[torch.Tensor | None] = [None] * len(encoded)
        slots = [k for k in range(len(encoded)) if on_device[k]]
        if slots:
            try:
                decoded = region_decoder.decode([raws[k] for k in slots], [wanted[k] for k in slots], stream)
            except nvimgcodec.DecoderUnavailable as e:  # made only now (beside its C interface): given up
                self._give_up_nvimgcodec(
                    region_decoder,
                    f"{e}; fastload decodes with torchvision.io.decode_jpeg from now on "
                    "(FASTLOAD_NVIMGCODEC=0 skips nvImageCodec)",
                )
                return self.decode(encoded, names, on_device, regions, stream)
            for k, image in zip(slots, decoded, strict=True):
                out[k] = image
        refused = [k for k in slots if out[k] is None]
        for k, image in enumerate(out):
            if image is None:
                out[k] = self._on_cpu(raws[k], names[k], wanted[k])
        self._count_refused(len(refused), len(slots))
        return [t for t in out if t is not None]

    def _on_cpu(
        self, raw: bytes | memoryview | np.ndarray, name: str, region: tuple[int, int, int, int] | None
    ) -> torch.Tensor:
        """An image decoded by the CPU (cut to ``region`` where given) and copied to the device."""
        blob = raw.tobytes() if isinstance(raw, np.ndarray) else raw
        full = torch.from_numpy(np.array(decode_pil(blob, name))).permute(2, 0, 1)
        if region is not None:
            top, left, height, width = region
            full = full[:, top : top + height, left : left + width]
        return _to_device(full.contiguous(), self.device)

    def decode_regions(
        self,
        encoded: Sequence[bytes | memoryview | np.ndarray | torch.Tensor],
        names: Sequence[str],
        on_device: Sequence[bool],
        regions: Sequence[tuple[int, int, int, int] | None],
        stream: Any = None,
        sizes: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> RegionBatch:
        """:meth:`decode` with every crop box known: the device writes its images' boxes into one
        buffer where it can, the CPU decodes the rest. ``sizes``: heights and widths, where known."""
        n = len(encoded)
        region_decoder = self.region_decoder
        slots = [k for k in range(n) if on_device[k] and regions[k] is not None]
        result = None
        if region_decoder is not None and region_decoder.packs and slots:
            # slices of one buffer stay that (nvImageCodec's C interface takes them as columns)
            raws: Sequence[Any] = (
                encoded
                if isinstance(encoded, ByteSlices)
                else [data.numpy() if isinstance(data, torch.Tensor) else data for data in encoded]
            )
            wanted = [r for r in (regions[k] for k in slots) if r is not None]  # all of them (slots)
            known = None if sizes is None else np.stack([sizes[0][slots], sizes[1][slots]], axis=1)
            chosen = raws.take(slots) if isinstance(raws, ByteSlices) else [raws[k] for k in slots]
            result = region_decoder.decode_packed(chosen, wanted, stream, known)
        if result is None:  # no in-place decoding here: each image its own tensor
            images = self.decode(encoded, names, on_device, regions, stream)
            others = [(k, image, regions[k] is not None) for k, image in enumerate(images)]
            return RegionBatch(n, None, np.zeros(0, np.int64), np.zeros((0, 4), np.int64), others)
        packed, boxes, ok = result
        done = np.flatnonzero(ok)
        positions = np.asarray(slots, dtype=np.int64)[done]
        decoded = set(positions.tolist())
        others = [
            (k, self._on_cpu(raws[k], names[k], regions[k]), regions[k] is not None)
            for k in range(n)
            if k not in decoded
        ]
        self._count_refused(len(slots) - len(done), len(slots))
        return RegionBatch(n, packed.select(done) if len(done) else None, positions, boxes[done], others)

    def _count_refused(self, refused: int, asked: int) -> None:
        """Counts refused JPEGs; nvImageCodec is given up, with one warning, once it refused most of
        :data:`GIVE_UP_AFTER` or more."""
        with self._count_lock:  # a pass left behind may still decode in its own thread
            self.refused += refused
            self.asked += asked
            region_decoder = self.region_decoder
            if region_decoder is None or self.asked < GIVE_UP_AFTER or self.refused * 2 <= self.asked:
                return
        self._give_up_nvimgcodec(
            region_decoder,
            f"nvImageCodec decoded only {self.asked - self.refused} of the {self.asked} JPEGs it was "
            "given that the CPU could decode (its log above says why); fastload decodes with "
            "torchvision.io.decode_jpeg from the next batch on, as with FASTLOAD_NVIMGCODEC=0",
        )

    def _give_up_nvimgcodec(self, region_decoder: nvimgcodec.RegionDecoder, message: str) -> None:
        """nvImageCodec given up (torchvision's decoder from now on), with one warning: ``message``."""
        with self._count_lock:
            if self.region_decoder is not region_decoder:
                return  # (given up already, by another pass's thread)
            self.region_decoder = None
        region_decoder.release()  # its last images are let go of once the copies out of them are done
        warnings.warn(message, stacklevel=4)


def device_routes(
    encoded: Sequence[bytes | memoryview | np.ndarray | torch.Tensor], indices: np.ndarray, routes: np.ndarray
) -> list[bool]:
    """For :func:`decode_batch`'s ``on_device``, from the column ``routes`` (filled in where unseen)."""
    out = []
    for k, i in enumerate(indices):
        route = routes[i]
        if route == ROUTE_UNKNOWN:
            data = encoded[k]
            route = routes[i] = _route(data.numpy() if isinstance(data, torch.Tensor) else data)
        out.append(route == ROUTE_DEVICE)
    return out


def decode_batch(
    encoded: Sequence[bytes | memoryview | np.ndarray | torch.Tensor],
    device: torch.device | str | None = None,
    names: Sequence[str] | None = None,
    on_device: Sequence[bool] | None = None,
) -> list[torch.Tensor]:
    """Decodes a batch to one uint8 RGB ``(3, H, W)`` tensor per image on ``device``: baseline JPEGs
    by one batched ``torchvision.io.decode_jpeg`` call, the rest on the CPU, copied over.

    Args:
        names: How a :class:`DecodeError` names each sample (default ``"sample k of the batch"``).
        on_device: Whether each image goes to the batched JPEG decoder (default: from its header).

    Raises:
        DecodeError: Naming the first sample that cannot be decoded.
    """
    device = torch.device("cpu") if device is None else torch.device(device)
    if names is not None and len(names) != len(encoded):
        raise ValueError(
            f"names should have one entry per image, but got {len(names)} names for {len(encoded)} images"
        )
    label = (lambda k: names[k]) if names is not None else (lambda k: f"sample {k} of the batch")
    out: list[torch.Tensor | None] = [None] * len(encoded)
    jpeg_slots: list[int] = []
    raws = [data.numpy() if isinstance(data, torch.Tensor) else data for data in encoded]
    for k, raw in enumerate(raws):
        if on_device is not None:
            batched = on_device[k] and torchvision_jpeg_available()
        else:
            img = open_image(raw, label(k))
            batched = img.format in JPEG_FORMATS and img.mode in ("RGB", "L") and torchvision_jpeg_available()
        if batched:
            jpeg_slots.append(k)
        else:
            blob = raw.tobytes() if isinstance(raw, np.ndarray) else raw
            out[k] = _to_device(
                torch.from_numpy(np.array(decode_pil(blob, label(k)))).permute(2, 0, 1), device
            )
    if jpeg_slots:
        tensors = [encoded_tensor(encoded[k]) for k in jpeg_slots]
        try:
            decoded = decode_jpegs(tensors, device)
        except DECODE_ERRORS:  # one by one: the error names the culprit
            decoded = [_to_device(decode_jpeg_tensor(raws[k], label(k)), device) for k in jpeg_slots]
        for k, image in zip(jpeg_slots, decoded, strict=False):
            out[k] = image
    return [t for t in out if t is not None]
