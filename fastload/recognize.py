"""One-line acceleration: a torchvision image pipeline that fastload reproduces runs on its fast path.

A user who only swaps ``torch.utils.data.DataLoader`` for ``fastload.DataLoader`` hands it a
``torchvision.datasets.ImageFolder`` (or ``DatasetFolder`` with torchvision's default loader),
``fastload.ImageFolder`` or ``fastload.InMemoryImageFolder`` whose ``transform`` is a torchvision
``Compose`` (``transforms`` v1 or ``transforms.v2``). :func:`recognize` reads that pipeline and,
when every op is one fastload reproduces, returns the dataset the fast path serves from: the same
samples (paths, labels, order) and a :class:`TorchvisionPipeline`, which decodes each image
straight into the batch buffer with the user's geometry and then applies the user's conversion and
normalization, in the same arithmetic, per sample. Otherwise it says in one sentence why not.

Recognised ops (the classes themselves, not subclasses, which may change what they do):

=========================================  =====================================================
torchvision op                             reproduced as
=========================================  =====================================================
``RandomResizedCrop``                      :class:`fastload.transforms.RandomResizedCrop` (its size,
                                           scale, ratio, interpolation, antialias; the same
                                           crop-parameter distribution)
``Resize``                                 :class:`fastload.transforms.Resize` (size, interpolation, max_size,
                                           antialias)
``CenterCrop(size)``                       :class:`fastload.transforms.CenterCrop`
``RandomHorizontalFlip(p)``                :class:`fastload.transforms.RandomHorizontalFlip`
``ToTensor()``                             ``x.to(float32).div(255)`` (torchvision's arithmetic)
``PILToTensor()``, ``ToImage()``           uint8 ``(3, H, W)``
``ConvertImageDtype(float32)`` (v1)        ``x.to(float32) / 255``
``ConvertImageDtype``, ``ToDtype`` (v2)    ``x.to(float32).mul_(1 / 255)`` (v2, with ``scale``),
                                           or only the cast without it
``Normalize(mean, std)``                   ``x.sub_(mean).div_(std)``
=========================================  =====================================================

Pixels. The user's resizes run on PIL images (that is what the dataset yields), so fastload runs
them the way PIL does (``resampler="pil"``; a training pipeline without the C extension: torch's
uint8 kernels, faster than Pillow's own). A pipeline without random ops (evaluation:
``Resize`` + ``CenterCrop``) decodes at full size: on PIL images its pixels are torchvision's bit
for bit (the C extension computes the crop's window of the whole resize with Pillow's
coefficients; without it, op by op), on tensors within 1 level. A training pipeline (random ops)
also uses reduced-size JPEG decoding for crops at least twice the output, which filters slightly
differently (``bench/decode.py`` measures it); its crops
follow torchvision's parameter distribution, drawn from fastload's ``(seed, epoch, index)`` streams.

Not recognised (``loader.fast_path_reason`` names the first op or property that stopped it; a
pipeline that begins with a crop or resize then takes head acceleration, :mod:`fastload.head`,
else torch's path): any other op (``ColorJitter``, ``RandAugment``, ``Lambda``, ...), a geometric op
after the float conversion, ``target_transform``, a custom ``loader``, a subclass that overrides
``__getitem__``, a pipeline without a fixed output size, or an output that is not uint8 or float32.
"""

from __future__ import annotations

import copy
import dis
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from . import transforms as T
from .decode import affine_for_table, pil_resample_available, to_chw_by_table
from .device import small_to_device
from .folder import ClassIndex, FolderIndex
from .imagefolder import EncodedImageDataset, ImageFolder

__all__ = [
    "CONVERSIONS",
    "Conversion",
    "NotReproducible",
    "Recognition",
    "TorchvisionPipeline",
    "conversion_step",
    "convert",
    "convert_pipeline",
    "folder_source",
    "is_image_folder",
    "is_v2",
    "op_kind",
    "pipeline_ops",
    "recognize",
    "resize_mode",
    "sample_index",
    "see_through",
    "tensor_antialias",
    "worker_view",
]

_V1 = "torchvision.transforms.transforms."
_V2_GEOMETRY = "torchvision.transforms.v2._geometry."
_V2_CONVERSION = "torchvision.transforms.v2._type_conversion."
_V2_MISC = "torchvision.transforms.v2._misc."

_COMPOSE = {_V1 + "Compose", "torchvision.transforms.v2._container.Compose"}
_GEOMETRIC = {
    **{_V1 + name: name for name in ("RandomResizedCrop", "Resize", "CenterCrop", "RandomHorizontalFlip")},
    **{
        _V2_GEOMETRY + name: name
        for name in ("RandomResizedCrop", "Resize", "CenterCrop", "RandomHorizontalFlip")
    },
}
_TO_TENSOR = {_V1 + "ToTensor", "torchvision.transforms.v2._deprecated.ToTensor"}
_PIL_TO_TENSOR = {_V1 + "PILToTensor", _V2_CONVERSION + "PILToTensor"}
_TO_IMAGE = {_V2_CONVERSION + "ToImage"}
_CONVERT_V1 = {_V1 + "ConvertImageDtype"}
_CONVERT_V2 = {_V2_MISC + "ConvertImageDtype"}
_TO_DTYPE = {_V2_MISC + "ToDtype"}
_NORMALIZE = {_V1 + "Normalize", _V2_MISC + "Normalize"}
_TO_PURE = {_V2_CONVERSION + "ToPureTensor"}


def _qualname(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


# --------------------------------------------------------------------------------------------
# The per-sample pipeline the fast path runs
# --------------------------------------------------------------------------------------------


class Conversion:
    """Conversion steps of a torchvision pipeline (``ToTensor``, ``PILToTensor``, ``ToDtype``,
    ``Normalize``, ...) run as one step, with torchvision's arithmetic.

    Args:
        steps: On a ``(3, H, W)`` uint8 image, in order: ``("to", dtype)``, ``("div", 255.0)``,
            ``("mul", 1 / 255)``, ``("normalize", mean, std)`` (see :func:`conversion_step`).

    Attributes:
        dtype: The output dtype (uint8 without a ``"to"`` step).
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
        """Converts one uint8 ``(H, W, 3)`` image into ``out`` ``(3, H, W)`` of :attr:`dtype`.

        The same floats as :func:`convert`, in one pass through a table of the 256 values per
        channel (see :meth:`table`; computed with AVX2 where that gives the table's bits).
        """
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
        """The conversion of every uint8 value per channel, ``(3, 256)`` float32, or ``None``.

        The steps are elementwise, so a pixel's floats depend only on its value and channel: running
        :func:`convert` itself on the 256 values gives a table whose lookups are bit-identical to
        converting the image (the C extension then converts and moves the channels first in one pass).
        ``None`` for a non-float32 output (a plain copy then).
        """
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

    The fast path's workers call :meth:`decode_into` with one sample's slot of the batch buffer:
    ``(H, W, 3)`` uint8 (``channels_first=False``: only the geometry, the batch converted later on
    the device) or ``(3, H, W)`` of :attr:`dtype` (the user's output, converted per sample).

    Args:
        geometry: The fastload transforms of the pipeline's crops, resizes and flips.
        steps: Conversion steps after the geometry, on a ``(3, H, W)`` uint8 tensor (see
            :class:`Conversion`).
        resampler: ``"pil"`` (resizes as PIL runs them) or ``"torch"`` (on uint8 tensors).
        reduce: Allow reduced-size JPEG decoding (training pipelines only).
        description: How ``repr`` names the user's pipeline.
    """

    def __init__(
        self,
        geometry: T.Compose,
        steps: tuple[tuple[Any, ...], ...],
        resampler: str,
        reduce: bool,
        description: str = "",
    ) -> None:
        self.geometry = geometry
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
        if not self.channels_first:
            self.geometry.decode_into(
                data, out, name, resampler=self.resampler, reduce=self.reduce, exact=self.exact
            )
            return
        scratch = getattr(self._local, "scratch", None)
        size = self.output_size
        assert size is not None
        if scratch is None:
            scratch = self._local.scratch = np.empty((*size, 3), dtype=np.uint8)
        self.geometry.decode_into(
            data, scratch, name, resampler=self.resampler, reduce=self.reduce, exact=self.exact
        )
        self.convert_sample(scratch, out)

    def convert_sample(self, hwc: np.ndarray, out: np.ndarray) -> None:
        """The conversion steps of one decoded sample: uint8 ``(H, W, 3)`` -> ``out`` ``(3, H, W)``
        (:meth:`Conversion.hwc`)."""
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
    """The C extension's constants for computing ``lut`` (see :func:`fastload.decode.affine_for_table`)
    when ``steps`` are a scaling and a normalization, each at most once and in that order."""
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
    """Runs the conversion ``steps`` on uint8 images ``src`` (``(..., 3, H, W)``), writing ``out``.

    The arithmetic is torchvision's, op for op (``ToTensor``: ``to(float32).div(255)``,
    ``Normalize``: ``sub_(mean).div_(std)``), so equal uint8 pixels give equal floats.
    ``constants``: step k's ``(mean, std)`` as ``(C, 1, 1)`` tensors of ``out``'s dtype on its
    device, where they are there already.
    """
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


# --------------------------------------------------------------------------------------------
# Reading a torchvision pipeline
# --------------------------------------------------------------------------------------------


class NotReproducible(Exception):
    """Why a pipeline (or dataset) cannot be accelerated (the message is the reason)."""


def _channel_values(values: Any, label: str) -> tuple[float, ...]:
    """``Normalize``'s mean or std as 1 or 3 floats: what torchvision accepts (a number, a sequence,
    a tensor or array; it applies them with ``torch.as_tensor``) and applies to RGB images."""
    try:
        flat = torch.as_tensor(values, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError):
        raise NotReproducible(f"{label} has a mean or std that is not numbers") from None
    # per channel: a number, c values, or a (c, 1, 1) tensor (torchvision views 1-d ones so)
    per_channel = flat.ndim <= 1 or (flat.ndim == 3 and tuple(flat.shape[1:]) == (1, 1))
    if not per_channel:
        raise NotReproducible(
            f"{label} has a mean or std of shape {tuple(flat.shape)}, not one value per channel"
        )
    if flat.numel() not in (1, 3):
        raise NotReproducible(f"{label} has {flat.numel()} values of mean or std for 3 channels")
    return tuple(float(v) for v in flat.reshape(-1).tolist())


_KINDS: dict[str, str] = {
    **{name: "Compose" for name in _COMPOSE},
    **_GEOMETRIC,
    **{name: "ToTensor" for name in _TO_TENSOR},
    **{name: "PILToTensor" for name in _PIL_TO_TENSOR},
    **{name: "ToImage" for name in _TO_IMAGE},
    **{name: "ConvertImageDtype" for name in _CONVERT_V1},
    **{name: "ConvertImageDtypeV2" for name in _CONVERT_V2},
    **{name: "ToDtype" for name in _TO_DTYPE},
    **{name: "Normalize" for name in _NORMALIZE},
    **{name: "ToPureTensor" for name in _TO_PURE},
}
_GEOMETRY_KINDS = ("RandomResizedCrop", "Resize", "CenterCrop", "RandomHorizontalFlip")
#: The kinds :func:`conversion_step` runs (the rest of :data:`_KINDS` is geometry or ``Compose``).
CONVERSIONS = frozenset(
    ("ToTensor", "PILToTensor", "ToImage", "ConvertImageDtype", "ConvertImageDtypeV2", "ToDtype")
    + ("Normalize", "ToPureTensor")
)


def op_kind(op: Any) -> str | None:
    """What fastload knows ``op`` as: ``"RandomResizedCrop"``, ``"Resize"``, ``"CenterCrop"``,
    ``"RandomHorizontalFlip"``, ``"Compose"``, or a conversion (:data:`CONVERSIONS`); ``None`` for
    anything else. Only torchvision's own classes (v1 and v2), not subclasses, which may change
    what they do."""
    return _KINDS.get(_qualname(op))


def is_v2(op: Any) -> bool:
    """Whether ``op`` is a ``torchvision.transforms.v2`` transform."""
    return type(op).__module__.startswith("torchvision.transforms.v2")


# The bytecode of ``return self.<attribute>(<argument>)`` without the operations that only set up
# a call or mark a line, which differ between Python versions.
_FORWARD_SHAPE = ("LOAD_FAST", "LOAD_ATTR", "LOAD_FAST", "CALL", "RETURN_VALUE")
_SETUP_OPS = frozenset(("RESUME", "NOP", "PRECALL", "PUSH_NULL", "CACHE", "KW_NAMES", "EXTENDED_ARG"))
_OP_ALIASES = {
    "LOAD_METHOD": "LOAD_ATTR",
    "CALL_FUNCTION": "CALL",
    "CALL_METHOD": "CALL",
    "LOAD_FAST_BORROW": "LOAD_FAST",
    "LOAD_FAST_LOAD_FAST": "LOAD_FAST",
}


def _forwarded_attribute(function: Any) -> str | None:
    """``name`` when ``function`` is exactly ``def f(self, x): return self.name(x)``, else ``None``."""
    code = getattr(function, "__code__", None)
    if code is None or code.co_argcount != 2 or code.co_kwonlyargcount or code.co_flags & 0x0C:
        return None  # not two plain parameters (self, x), or *args / **kwargs
    if getattr(function, "__defaults__", None):
        return None
    ops: list[tuple[str, Any]] = []
    for ins in dis.get_instructions(function):
        if ins.opname in _SETUP_OPS:
            continue
        ops.append((_OP_ALIASES.get(ins.opname, ins.opname), ins.argval))
    names = tuple(name for name, _ in ops)
    if names != _FORWARD_SHAPE:
        return None
    self_name, x_name = code.co_varnames[:2]
    (_, first), (_, attribute), (_, second), (_, argc), _ = ops
    if first != self_name or second != x_name or not isinstance(attribute, str):
        return None
    if argc not in (1, None):  # 3.11 CALL's argval is the argument count
        return None
    return attribute


def see_through(transform: Any) -> Any:
    """The torchvision ``Compose`` a wrapper object only forwards to, or ``transform`` itself.

    The rule (torchvision's reference presets, ``ClassificationPresetTrain``/``Eval``, have this
    shape): ``transform`` is not a torchvision transform, and its class's ``__call__`` is exactly
    ``def __call__(self, img): return self.<name>(img)`` -- two plain parameters, no defaults, no
    other statement -- with ``self.<name>`` set on the instance. For a ``torch.nn.Module``, the
    same holds for ``forward``, and the module has no hooks. Applied again to what it finds (a
    wrapper of a wrapper). Anything else is not seen through: its ``__call__`` may do more than
    the ``Compose`` it holds.

    Example:
        >>> class Preset:
        ...     def __init__(self):
        ...         self.transforms = torchvision.transforms.Compose([...])
        ...     def __call__(self, img):
        ...         return self.transforms(img)
        >>> see_through(Preset()) is preset.transforms                    # doctest: +SKIP
        True
    """
    seen = 0
    while seen < 8 and transform is not None and not type(transform).__module__.startswith("torchvision."):
        cls = type(transform)
        module_base = sys.modules.get("torch.nn")
        function = cls.__dict__.get("__call__") or getattr(cls, "__call__", None)  # noqa: B004
        if module_base is not None and isinstance(transform, module_base.Module):
            if function is not module_base.Module.__call__ or _has_hooks(transform, module_base):
                return transform
            function = getattr(cls, "forward", None)
        attribute = _forwarded_attribute(function)
        inner = None if attribute is None else getattr(transform, "__dict__", {}).get(attribute)
        if inner is None and attribute is not None and module_base is not None:
            inner = getattr(transform, "_modules", {}).get(attribute)  # an nn.Module attribute
        if inner is None or not callable(inner):
            return transform
        transform = inner
        seen += 1
    return transform


def _has_hooks(module: Any, nn: Any) -> bool:
    hooks = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    if any(getattr(module, name, None) for name in hooks):
        return True
    hooks_module = getattr(getattr(nn, "modules", None), "module", None)
    return any(
        getattr(hooks_module, name, None) for name in ("_global_forward_hooks", "_global_forward_pre_hooks")
    )


def pipeline_ops(transform: Any) -> list[Any]:
    """The ops of a torchvision pipeline in order: wrappers seen through (:func:`see_through`) and
    ``Compose`` (v1 and v2, nested) flattened; anything else is one op."""
    transform = see_through(transform)
    if op_kind(transform) == "Compose":
        ops: list[Any] = []
        for t in transform.transforms:
            ops += pipeline_ops(t)
        return ops
    return [transform]


def resize_mode(op: Any) -> str:
    """The interpolation of a torchvision resize op as fastload names it.

    Raises:
        NotReproducible: For a mode other than bilinear, bicubic or nearest.
    """
    mode = getattr(op.interpolation, "value", op.interpolation)
    if isinstance(mode, int):
        mode = {0: "nearest", 2: "bilinear", 3: "bicubic"}.get(mode, str(mode))
    if mode not in ("bilinear", "bicubic", "nearest"):
        raise NotReproducible(
            f"{type(op).__name__}(interpolation={mode!r}): fastload resizes with "
            "bilinear, bicubic or nearest only"
        )
    return str(mode)


def tensor_antialias(op: Any, on_pil: bool) -> bool:
    """Whether a torchvision resize op antialiases: always on PIL images; on tensors its
    ``antialias`` (``None`` is ``False``, as torchvision >= 0.17 documents; so is 0.15/0.16's
    ``"warn"`` default, which warned and did not antialias tensors)."""
    if on_pil:
        return True  # PIL's resample always antialiases; torchvision ignores the flag for PIL images
    value = getattr(op, "antialias", True)
    if value == "warn":
        return False
    return bool(value)


def _geometric(op: Any, name: str, on_pil: bool) -> T.Transform:
    if name == "RandomResizedCrop":
        return T.RandomResizedCrop(
            list(op.size),
            scale=tuple(op.scale),
            ratio=tuple(op.ratio),
            interpolation=resize_mode(op),
            antialias=tensor_antialias(op, on_pil),
        )
    if name == "Resize":
        size = op.size
        if isinstance(size, (list, tuple)) and len(size) == 1:
            size = size[0]
        return T.Resize(
            size,
            interpolation=resize_mode(op),
            max_size=op.max_size,
            antialias=tensor_antialias(op, on_pil),
        )
    if name == "CenterCrop":
        return T.CenterCrop(list(op.size))
    return T.RandomHorizontalFlip(float(op.p))


def _float_dtype(dtype: Any, op: Any) -> None:
    if dtype != torch.float32:
        raise NotReproducible(
            f"{type(op).__name__} to {dtype}: fastload reproduces uint8 and float32 outputs only"
        )


def conversion_step(op: Any, kind: str, state: str) -> tuple[str, list[tuple[Any, ...]]]:
    """What a conversion op does to an image in ``state``: the new state and its steps.

    States: ``"pil"`` (a PIL RGB image), ``"uint8"`` (a uint8 ``(3, H, W)`` tensor), ``"float"``
    (float32). Steps as in :class:`Conversion`. ``ToPureTensor``, and ``ToImage`` on a tensor,
    change no value (only the tensor's type: see :mod:`fastload.head`).

    Raises:
        NotReproducible: Where torchvision would raise, or the result is not uint8 or float32.
    """
    label = type(op).__name__
    if kind == "ToTensor":
        if state != "pil":
            raise NotReproducible(f"{label} on a tensor: torchvision's ToTensor expects a PIL image")
        _float_dtype(torch.get_default_dtype(), op)
        return "float", [("to", torch.float32), ("div", 255.0)]
    if kind == "PILToTensor":
        if state != "pil":
            raise NotReproducible(f"{label} on a tensor: it expects a PIL image")
        return "uint8", []
    if kind == "ToImage":
        return ("uint8" if state == "pil" else state), []
    if kind == "ToPureTensor":
        if state == "pil":
            raise NotReproducible(f"{label} on a PIL image (it passes it through)")
        return state, []
    if kind in ("ConvertImageDtype", "ConvertImageDtypeV2", "ToDtype"):
        dtype = op.dtype
        scale = True if kind != "ToDtype" else bool(op.scale)
        if not isinstance(dtype, torch.dtype):
            raise NotReproducible(f"{label} with a per-type dtype mapping")
        if state == "pil":
            if kind == "ToDtype":
                return state, []  # v2 passes PIL images through ToDtype unchanged
            raise NotReproducible(f"{label} on a PIL image")
        if dtype == torch.uint8:
            if state == "float":
                raise NotReproducible(f"{label} from float back to uint8")
            return state, []
        _float_dtype(dtype, op)
        if state != "uint8":
            return state, []
        steps: list[tuple[Any, ...]] = [("to", torch.float32)]
        if scale:
            steps.append(("div", 255.0) if kind == "ConvertImageDtype" else ("mul", 1.0 / 255))
        return "float", steps
    if kind == "Normalize":
        if state != "float":
            raise NotReproducible(f"{label} on a {'PIL image' if state == 'pil' else 'uint8 tensor'}")
        std = _channel_values(op.std, label)
        if any(float(torch.tensor(v, dtype=torch.float32)) == 0 for v in std):
            # torchvision raises its ValueError ("std evaluated to zero ...") at the first image
            raise NotReproducible(f"{label} has a std of zero (torchvision's Normalize refuses it)")
        return state, [("normalize", _channel_values(op.mean, label), std)]
    raise NotReproducible(f"{label} is not a conversion fastload reproduces")


def convert_pipeline(transform: Any) -> TorchvisionPipeline:
    """The fast equivalent of a torchvision pipeline applied to PIL RGB images.

    Raises:
        ValueError: Saying which op (or property of the pipeline) fastload cannot reproduce.
    """
    try:
        return _convert(transform)
    except NotReproducible as e:
        raise ValueError(str(e)) from None


def _convert(transform: Any) -> TorchvisionPipeline:
    transform = see_through(transform)
    if op_kind(transform) not in (
        "Compose",
        "RandomResizedCrop",
        "Resize",
        "CenterCrop",
        "RandomHorizontalFlip",
    ):
        raise NotReproducible(
            f"the dataset's transform ({type(transform).__name__}) is not a torchvision Compose "
            "(nor an object whose __call__ only returns self.<name>(img) of one)"
        )
    state = "pil"  # what the image is at this point: "pil", "uint8" (tensor) or "float"
    geometry: list[T.Transform] = []
    on_pil: set[bool] = set()
    random = False
    steps: list[tuple[Any, ...]] = []
    ops = pipeline_ops(transform)
    for op in ops:
        kind = op_kind(op)
        label = type(op).__name__
        if kind in _GEOMETRY_KINDS:
            if state == "float":
                raise NotReproducible(
                    f"{label} runs on a float tensor (after the conversion to float): fastload reproduces "
                    "crops, resizes and flips before it"
                )
            on_pil.add(state == "pil")
            geometry.append(_geometric(op, kind, state == "pil"))
            random = random or kind in ("RandomResizedCrop", "RandomHorizontalFlip")
        elif kind in CONVERSIONS:
            state, more = conversion_step(op, kind, state)
            steps += more
        else:
            raise NotReproducible(f"{label} is not an op fastload reproduces on its fast path")
    if state == "pil":
        raise NotReproducible("the pipeline returns PIL images (no ToTensor, PILToTensor or ToImage)")
    if len(on_pil) > 1:
        raise NotReproducible("the pipeline resizes both PIL images and tensors")
    pipeline = T.Compose(geometry)
    if pipeline.output_size is None:
        raise NotReproducible(
            "its images have no single size (end the pipeline with CenterCrop or RandomResizedCrop): "
            "batches need one size"
        )
    pil = on_pil != {False}
    return TorchvisionPipeline(
        pipeline,
        tuple(steps),
        # Evaluation: always PIL's resample, for its pixels; training: PIL's where the C extension runs
        # it (faster than torch's kernels), else torch's (faster than Pillow's own).
        resampler="pil" if pil and (not random or pil_resample_available()) else "torch",
        reduce=random,
        description=" -> ".join(type(op).__name__ for op in ops),
    )


# --------------------------------------------------------------------------------------------
# Reading the dataset
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Recognition:
    """What :func:`recognize` found: the dataset the fast path serves from, or why there is none."""

    dataset: EncodedImageDataset | None
    reason: str | None
    image_pipeline: bool  # the dataset is an image folder (a torchvision pipeline was not reproduced)


def _torchvision_folder(dataset: Any) -> bool:
    module = sys.modules.get("torchvision.datasets.folder")
    return module is not None and isinstance(dataset, module.DatasetFolder)


def _exact_folder_class(dataset: Any) -> None:
    """Raises unless ``type(dataset)`` keeps ``DatasetFolder.__getitem__`` and ``__len__``."""
    module = sys.modules["torchvision.datasets.folder"]
    cls = type(dataset)
    if (
        cls.__getitem__ is not module.DatasetFolder.__getitem__
        or cls.__len__ is not module.DatasetFolder.__len__
    ):
        raise NotReproducible(f"{cls.__name__} overrides __getitem__ or __len__")


def _torchvision_loader(dataset: Any) -> Any:
    """The dataset's ``loader`` if it is torchvision's own (``default_loader``/``pil_loader``)."""
    module = sys.modules["torchvision.datasets.folder"]
    loader = getattr(dataset, "loader", None)
    if loader is not module.default_loader and loader is not module.pil_loader:
        raise NotReproducible(
            "the dataset has a custom loader (fastload decodes with torchvision's PIL loader)"
        )
    return loader


_CHUNK = 1 << 16  # samples encoded at a time: the peak stays a few MB above the result


def sample_index(dataset: Any) -> FolderIndex:
    """The samples of a torchvision ``DatasetFolder`` as a :class:`FolderIndex` (numpy arrays).

    ``dataset.samples[i]`` is read for every ``i`` (so a sequence that computes its entries gives
    what ``DatasetFolder.__getitem__`` would see). Paths are stored relative to ``dataset.root``
    when every one of them is ``os.path.join(root, relative)`` exactly (what torchvision's scan
    makes), else whole; either way ``index.paths[i] == dataset.samples[i][0]``. Example: root
    ``"/data/train"``, sample ``("/data/train/n01/a.JPEG", 0)``: relative path ``"n01/a.JPEG"``,
    30 bytes of path per ImageNet sample instead of a tuple, a ``str`` and an ``int`` object.

    Raises:
        NotReproducible: If a sample is not a ``(str path, int target)`` pair, or the targets are
            not indices into ``dataset.classes`` (distinct names).
    """
    samples = dataset.samples
    n = len(samples)
    root = getattr(dataset, "root", None)
    prefix = ""
    if isinstance(root, (str, os.PathLike)) and os.fspath(root):
        prefix = os.path.join(os.path.expanduser(os.fspath(root)), "")
    index = _encode_samples(samples, n, prefix)
    if index is None:  # a path outside root: store whole paths
        prefix = ""
        index = _encode_samples(samples, n, prefix)
    assert index is not None  # an empty prefix always fits
    buf, offsets, targets = index
    classes = list(getattr(dataset, "classes", []))
    if n and (targets.min() < 0 or targets.max() >= len(classes)):
        raise NotReproducible("its targets are not indices into dataset.classes")
    try:
        class_index = ClassIndex(classes)
    except ValueError as e:
        raise NotReproducible(f"its classes are not a list of distinct names ({e})") from None
    return FolderIndex.from_buffers(prefix, buf, offsets, targets, class_index)  # join(prefix, rel) == path


def _encode_samples(samples: Any, n: int, prefix: str) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """UTF-8 relative paths back to back, their offsets and the targets; ``None`` if a path is not
    under ``prefix`` (so that ``os.path.join(root, relative)`` would not give it back)."""
    cut = len(prefix)
    offsets = np.zeros(n + 1, dtype=np.int64)
    targets = np.empty(n, dtype=np.int64)
    parts: list[bytes] = []
    total = 0
    for start in range(0, n, _CHUNK):
        rels: list[str] = []
        for i in range(start, min(n, start + _CHUNK)):
            entry = samples[i]
            if not (isinstance(entry, tuple) and len(entry) == 2):
                raise NotReproducible(f"dataset.samples[{i}] is not a (path, target) pair")
            path, target = entry
            if type(path) is not str or type(target) is not int:
                raise NotReproducible(
                    f"dataset.samples[{i}] is not a (str, int) pair: "
                    f"({type(path).__name__}, {type(target).__name__})"
                )
            if cut:
                if not path.startswith(prefix) or path.startswith(os.sep, cut):
                    return None
                path = path[cut:]
            rels.append(path)
            targets[i] = target
        joined = "".join(rels)
        if joined.isascii():
            blob = joined.encode("ascii")
            np.cumsum([len(r) for r in rels], out=offsets[start + 1 : start + 1 + len(rels)])
        else:
            encoded = [r.encode("utf-8", "surrogateescape") for r in rels]
            blob = b"".join(encoded)
            np.cumsum([len(e) for e in encoded], out=offsets[start + 1 : start + 1 + len(rels)])
        offsets[start + 1 : start + 1 + len(rels)] += total
        total += len(blob)
        parts.append(blob)
    return np.frombuffer(b"".join(parts), dtype=np.uint8), offsets, targets


def is_image_folder(dataset: Any) -> bool:
    """Whether ``dataset`` is one fastload reads: a fastload ``ImageFolder``/``InMemoryImageFolder``
    or a torchvision ``DatasetFolder`` (``ImageFolder``), subclasses included."""
    return isinstance(dataset, EncodedImageDataset) or _torchvision_folder(dataset)


def folder_source(dataset: Any) -> EncodedImageDataset:
    """A fastload dataset with ``dataset``'s samples (same order, labels) that serves their encoded
    bytes: a shallow copy of a fastload dataset, or a fastload ``ImageFolder`` over a torchvision
    ``DatasetFolder``'s :func:`sample_index`. Its ``transform`` and ``target_transform`` are
    ``dataset``'s until the caller replaces them.

    Raises:
        NotReproducible: If fastload cannot read the images as ``dataset`` does: a custom
            ``loader``, a joint ``transforms`` callable, a ``DatasetFolder`` subclass with its own
            ``__getitem__``/``__len__``, or torchvision's image backend set to something else
            than PIL.
    """
    if isinstance(dataset, EncodedImageDataset):
        if getattr(dataset, "loader", None) is not None:
            raise NotReproducible("the dataset has a custom loader")
        return copy.copy(dataset)
    if getattr(dataset, "transforms", None) is not None:
        standard = getattr(sys.modules.get("torchvision.datasets.vision"), "StandardTransform", None)
        if standard is None or not isinstance(dataset.transforms, standard):
            raise NotReproducible("the dataset has a joint transforms callable")
    _exact_folder_class(dataset)
    loader = _torchvision_loader(dataset)
    if loader is sys.modules["torchvision.datasets.folder"].default_loader:
        from torchvision import get_image_backend

        if get_image_backend() != "PIL":
            raise NotReproducible("torchvision's image backend is not PIL")
    view = ImageFolder(
        None,
        transform=getattr(dataset, "transform", None),
        target_transform=getattr(dataset, "target_transform", None),
        index=sample_index(dataset),
    )
    view.root = getattr(dataset, "root", None)
    return view


def worker_view(dataset: Any) -> tuple[ImageFolder | None, str | None]:
    """What torch's worker processes serve instead of a torchvision ``DatasetFolder`` they would
    copy page by page: ``(view, None)``, or ``(None, reason)`` to keep the user's dataset.

    The view is a :class:`fastload.ImageFolder` over :func:`sample_index` with the dataset's own
    ``loader``, ``transform`` and ``target_transform``, so ``view[i]`` runs exactly
    ``DatasetFolder.__getitem__``: ``path, target = samples[i]; sample = loader(path)``, then
    ``transform(sample)`` and ``target_transform(target)`` if set. It holds no reference to the
    dataset: its ``samples`` list is neither pickled to spawned workers nor touched (reference
    counts, the garbage collector) in forked ones. Only for a dataset whose class keeps
    ``DatasetFolder.__getitem__``/``__len__``, with torchvision's loader, and whose transforms
    are not methods of the dataset itself (they would carry it along); anything else may read
    whatever it likes from the dataset, so the dataset is kept.
    """
    if not _torchvision_folder(dataset):
        return None, f"{type(dataset).__name__} is not a torchvision DatasetFolder"
    try:
        _exact_folder_class(dataset)
        loader = _torchvision_loader(dataset)
        transform = getattr(dataset, "transform", None)
        target_transform = getattr(dataset, "target_transform", None)
        for name, fn in (("transform", transform), ("target_transform", target_transform)):
            if getattr(fn, "__self__", None) is dataset:
                raise NotReproducible(f"its {name} is a method of the dataset")
        index = sample_index(dataset)
    except NotReproducible as e:
        return None, str(e)
    view = ImageFolder(
        None, transform=transform, target_transform=target_transform, index=index, loader=loader
    )
    view.root = getattr(dataset, "root", None)
    return view, None


def recognize(dataset: Any) -> Recognition:
    """The fast path's dataset for ``dataset`` (see the module docs), or the reason there is none."""
    if not is_image_folder(dataset):
        return Recognition(
            None,
            f"{type(dataset).__name__} is not an image folder dataset fastload reads (fastload.ImageFolder, "
            "InMemoryImageFolder or torchvision's ImageFolder/DatasetFolder)",
            False,
        )
    try:
        transform = getattr(dataset, "transform", None)
        if transform is None:
            raise NotReproducible("the dataset has no transform: its samples are PIL images")
        if getattr(dataset, "target_transform", None) is not None:
            raise NotReproducible("the dataset has a target_transform")
        view = folder_source(dataset)
        pipeline: Any = _convert(transform)  # a fastload transform, which the dataset's type allows
        view.transform = pipeline
        return Recognition(view, None, True)
    except NotReproducible as e:
        return Recognition(None, str(e), True)
