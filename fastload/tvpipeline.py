"""What the fast path runs in place of a recognised torchvision pipeline.

:class:`TorchvisionPipeline` decodes one sample straight into its batch slot with the pipeline's
crops, resizes and flips, then applies its conversion steps; :class:`Conversion` runs those steps
(``ToTensor``, ``ToDtype``, ``Normalize``, ...) as one, with torchvision's arithmetic
(:func:`convert`), per sample through a per-channel table or on whole uint8 batches on the device.

Where it sits: :mod:`fastload.recognize` builds a :class:`TorchvisionPipeline`; the fast path's
workers call :meth:`TorchvisionPipeline.decode_into` (or write uint8 ``(H, W, 3)`` and leave
:meth:`TorchvisionPipeline.convert_batch` to the device); :mod:`fastload.head` runs a
:class:`Conversion` after its fused head. The steps are plain tuples: nothing here reads torchvision.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import numpy as np
import torch

from . import rng as _rng
from . import transforms as T
from ._jitter import draw_jitter, jitter_pixels
from .decode import affine_for_table, to_chw_by_table
from .device import small_to_device

__all__ = ["Conversion", "TorchvisionPipeline", "convert"]


class Conversion:
    """Conversion steps of a torchvision pipeline run as one step, with torchvision's arithmetic.

    ``steps`` on a ``(3, H, W)`` uint8 image, in order: ``("to", dtype)``, ``("div", 255.0)``,
    ``("mul", 1 / 255)``, ``("normalize", mean, std)`` (see :func:`fastload.recognize.conversion_step`);
    :attr:`dtype` is the output's (uint8 without a ``"to"`` step).
    """

    def __init__(self, steps: tuple[tuple[Any, ...], ...]) -> None:
        self.steps = steps
        self.dtype: torch.dtype = torch.uint8
        for step in steps:
            if step[0] == "to":
                self.dtype = step[1]
        self._local = threading.local()
        #: :meth:`batch`'s normalization constants per device: copied there once, without blocking
        self._on_device: dict[torch.device, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}

    def hwc(self, hwc: np.ndarray, out: np.ndarray) -> None:
        """Converts one uint8 ``(H, W, 3)`` image into ``out`` ``(3, H, W)`` of :attr:`dtype`: the
        same floats as :func:`convert`, in one pass through :meth:`table`."""
        lut = self.table()
        affine = getattr(self._local, "affine", None)
        if (
            lut is None
            or not hwc.flags.c_contiguous
            or not out.flags.c_contiguous
            or not to_chw_by_table(hwc, out, lut, affine)
        ):
            convert(torch.from_numpy(hwc).permute(2, 0, 1), torch.from_numpy(out), self.steps)

    def table(self) -> np.ndarray | None:
        """The conversion of every uint8 value per channel, ``(3, 256)`` float32 (``None`` for another
        output dtype): the steps are elementwise, so its lookups equal converting the image."""
        if self.dtype != torch.float32:
            return None
        lut = getattr(self._local, "lut", None)
        if lut is None:
            values = torch.arange(256, dtype=torch.uint8).view(1, 1, 256).expand(3, 1, 256)
            lut = convert(values, torch.empty(3, 1, 256), self.steps).view(3, 256).numpy()
            self._local.lut = lut
            self._local.affine = _affine(lut, self.steps)
        return lut

    def batch(self, images: torch.Tensor) -> torch.Tensor:
        """The steps on uint8 images ``(..., 3, H, W)`` (on any device): a new contiguous tensor."""
        device = images.device
        out = torch.empty(images.shape, dtype=self.dtype, device=device)
        constants = self._on_device.get(device)
        if constants is None:  # once: on CUDA a pageable copy per batch would stall the stream
            constants = self._on_device[device] = {
                k: (
                    small_to_device(np.array(step[1]), device, self.dtype).view(-1, 1, 1),
                    small_to_device(np.array(step[2]), device, self.dtype).view(-1, 1, 1),
                )
                for k, step in enumerate(self.steps)
                if step[0] == "normalize"
            }
        return convert(images, out, self.steps, constants)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_local"]  # per-thread tables
        state["_on_device"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._local = threading.local()

    def __repr__(self) -> str:
        return f"Conversion({self.steps!r})"


class TorchvisionPipeline:
    """A recognised torchvision pipeline: fused decode + geometry, then the user's conversion steps.

    ``geometry``: fastload transforms of the crops, resizes and flips; ``jitter``: a ``ColorJitter``
    after them (brightness, contrast, saturation ranges; its order and factors drawn from the
    sample's ``(seed, epoch, index)`` stream, :func:`fastload._jitter.draw_jitter`); ``steps``: as in
    :class:`Conversion`; ``resampler``: ``"pil"`` or ``"torch"``; ``description``: how ``repr``
    names the user's pipeline. :meth:`decode_into` writes one sample's slot: ``(3, H, W)`` of
    :attr:`dtype`, or ``(H, W, 3)`` uint8 with ``channels_first=False`` (converted on the device).
    """

    def __init__(
        self,
        geometry: T.Compose,
        steps: tuple[tuple[Any, ...], ...],
        resampler: str,
        reduce: bool,
        description: str = "",
        jitter: tuple[Any, Any, Any] | None = None,
    ) -> None:
        self.geometry = geometry
        self.jitter = jitter  # a ColorJitter's (brightness, contrast, saturation) ranges, after the geometry
        self.conversion = Conversion(steps)
        self.resampler = resampler
        self.reduce = reduce
        self.description = description
        self.channels_first = True  # the loader sets False to convert whole batches on the device
        self.exact = False  # the loader's exact_pixels: resizes exactly as torchvision chains them
        self._local = threading.local()

    @property
    def steps(self) -> tuple[tuple[Any, ...], ...]:
        """The conversion steps (see :class:`Conversion`)."""
        return self.conversion.steps

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the user's output."""
        return self.conversion.dtype

    @property
    def output_size(self) -> tuple[int, int] | None:
        """``(H, W)`` of every image."""
        return self.geometry.output_size

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """The shape of one sample's slot: ``(3, H, W)``, or ``(H, W, 3)`` without ``channels_first``."""
        size = self.output_size
        assert size is not None  # recognised pipelines have a fixed size
        return (3, *size) if self.channels_first else (*size, 3)

    @property
    def sample_dtype(self) -> torch.dtype:
        """The dtype of the slot: :attr:`dtype`, or uint8 without ``channels_first``."""
        return self.dtype if self.channels_first else torch.uint8

    def geometry_only(self) -> TorchvisionPipeline:
        """A copy that writes uint8 ``(H, W, 3)`` (the conversion then runs on whole batches)."""
        other = copy.copy(self)
        other.channels_first = False
        other._local = threading.local()
        return other

    def decode_into(
        self, data: bytes | memoryview | np.ndarray, out: np.ndarray, name: str = "image"
    ) -> None:
        """Decodes one sample into its slot ``out`` (see the class docs)."""
        slot = out
        if self.channels_first:  # decoded into a per-thread scratch, then converted into out
            scratch = getattr(self._local, "scratch", None)
            if scratch is None:
                scratch = self._local.scratch = np.empty((*self.sample_shape[1:], 3), dtype=np.uint8)
            slot = scratch
        self.geometry.decode_into(
            data, slot, name, resampler=self.resampler, reduce=self.reduce, exact=self.exact
        )
        if self.jitter is not None:
            jitter_pixels(slot, *draw_jitter(self.jitter, _rng.current()))
        if self.channels_first:
            self.convert_sample(slot, out)

    def convert_sample(self, hwc: np.ndarray, out: np.ndarray) -> None:
        """The conversion steps of one decoded sample: uint8 ``(H, W, 3)`` -> ``out`` ``(3, H, W)``."""
        self.conversion.hwc(hwc, out)

    def convert_batch(self, images: torch.Tensor) -> torch.Tensor:
        """The conversion steps on a uint8 ``(N, 3, H, W)`` batch (on any device): contiguous NCHW."""
        return self.conversion.batch(images)

    def decode_and_apply(self, data: bytes | memoryview | np.ndarray, name: str = "image") -> torch.Tensor:
        """One sample as a ``(3, H, W)`` tensor of :attr:`dtype` (what the user's pipeline returns)."""
        size = self.output_size
        assert size is not None
        out = np.empty((3, *size), dtype=torch.empty(0, dtype=self.dtype).numpy().dtype)
        pipeline = self if self.channels_first else copy.copy(self)
        pipeline.channels_first = True
        pipeline.decode_into(data, out, name)
        return torch.from_numpy(out)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_local"]  # per-thread scratch buffers
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._local = threading.local()

    def __repr__(self) -> str:
        return f"TorchvisionPipeline({self.description or self.geometry!r})"


def _affine(lut: np.ndarray, steps: tuple[tuple[Any, ...], ...]) -> np.ndarray | None:
    """The C extension's constants for ``lut`` (:func:`fastload.decode.affine_for_table`) when
    ``steps`` are a scaling and a normalization, each at most once and in that order."""
    steps = tuple(step for step in steps if step[0] != "to")  # the cast: the copy convert starts with
    kinds = [step[0] for step in steps]
    if kinds not in ([], ["div"], ["mul"], ["normalize"], ["div", "normalize"], ["mul", "normalize"]):
        return None
    scale, divide, mean, std = 1.0, False, [0.0], [1.0]
    for step in steps:
        if step[0] == "normalize":
            mean, std = list(step[1]), list(step[2])
        else:
            scale, divide = float(step[1]), step[0] == "div"
    return affine_for_table(lut, scale, divide, mean, std)


def convert(
    src: torch.Tensor,
    out: torch.Tensor,
    steps: tuple[tuple[Any, ...], ...],
    constants: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> torch.Tensor:
    """Runs the conversion ``steps`` on uint8 images ``src`` (``(..., 3, H, W)``) into ``out``, op
    for op as torchvision; ``constants``: step k's ``(mean, std)`` as ``(C, 1, 1)`` tensors on
    ``out``'s device."""
    out.copy_(src)  # the cast of a "to" step (or a plain copy for uint8 output)
    for k, step in enumerate(steps):
        kind = step[0]
        if kind == "div":
            out.div_(step[1])
        elif kind == "mul":
            out.mul_(step[1])
        elif kind == "normalize":
            if constants is not None and k in constants:
                mean, std = constants[k]
            else:
                mean = torch.as_tensor(step[1], dtype=out.dtype, device=out.device).view(-1, 1, 1)
                std = torch.as_tensor(step[2], dtype=out.dtype, device=out.device).view(-1, 1, 1)
            out.sub_(mean).div_(std)
    return out
