"""One-line acceleration: a torchvision image pipeline that fastload reproduces runs on its fast path.

For an image-folder dataset (``torchvision.datasets.ImageFolder``, or ``DatasetFolder`` with
torchvision's default loader, ``fastload.ImageFolder``, ``InMemoryImageFolder``) whose
``transform`` is a torchvision ``Compose`` (v1 or v2) of ops fastload reproduces (the classes
themselves, not subclasses), :func:`recognize` returns the dataset the fast path serves from: the
same samples and a :class:`~fastload.tvpipeline.TorchvisionPipeline`; otherwise one sentence
saying why not. The ops recognised and how the pixels compare: docs/swap.md, "The fast path".

Where it sits: the loader asks :func:`recognize` which path a dataset takes. The op readers here
(kinds, the wrapper rule of :func:`see_through`, each conversion's steps) are shared with
:mod:`fastload.head`; the dataset view comes from :mod:`fastload.tvfolder`.
"""

from __future__ import annotations

import dis
import sys
from dataclasses import dataclass
from typing import Any

import torch

from . import transforms as T
from ._jitter import is_jitter
from .decode import pil_resample_available
from .imagefolder import EncodedImageDataset
from .tvfolder import NotReproducible, folder_source, is_image_folder
from .tvpipeline import TorchvisionPipeline

__all__ = [
    "CONVERSIONS",
    "Recognition",
    "conversion_step",
    "convert_pipeline",
    "is_v2",
    "op_kind",
    "pipeline_ops",
    "recognize",
    "resize_mode",
    "see_through",
    "tensor_antialias",
]

_V1 = "torchvision.transforms.transforms."
_V2_GEOMETRY = "torchvision.transforms.v2._geometry."
_V2_CONVERSION = "torchvision.transforms.v2._type_conversion."
_V2_MISC = "torchvision.transforms.v2._misc."

_GEOMETRY_KINDS = ("RandomResizedCrop", "Resize", "CenterCrop", "RandomHorizontalFlip")
_TIMM = "timm.data.transforms."


# --------------------------------------------------------------------------------------------
# Reading a torchvision pipeline
# --------------------------------------------------------------------------------------------


def _channel_values(values: Any, label: str) -> tuple[float, ...]:
    """``Normalize``'s mean or std (anything ``torch.as_tensor`` takes) as 1 or 3 floats."""
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


#: What fastload knows each op class (its qualified name) as.
_KINDS: dict[str, str] = {
    _V1 + "Compose": "Compose",
    "torchvision.transforms.v2._container.Compose": "Compose",
    **{prefix + name: name for prefix in (_V1, _V2_GEOMETRY) for name in _GEOMETRY_KINDS},
    _V1 + "ToTensor": "ToTensor",
    "torchvision.transforms.v2._deprecated.ToTensor": "ToTensor",
    _V1 + "PILToTensor": "PILToTensor",
    _V2_CONVERSION + "PILToTensor": "PILToTensor",
    _V2_CONVERSION + "ToImage": "ToImage",
    _V1 + "ConvertImageDtype": "ConvertImageDtype",
    _V2_MISC + "ConvertImageDtype": "ConvertImageDtypeV2",
    _V2_MISC + "ToDtype": "ToDtype",
    _V1 + "Normalize": "Normalize",
    _V2_MISC + "Normalize": "Normalize",
    _V2_CONVERSION + "ToPureTensor": "ToPureTensor",
    _TIMM + "RandomResizedCropAndInterpolation": "RandomResizedCrop",
    _TIMM + "ResizeKeepRatio": "ResizeKeepRatio",  # head acceleration only (its size per image)
    _TIMM + "MaybeToTensor": "MaybeToTensor",
    _TIMM + "MaybePILToTensor": "MaybePILToTensor",
}
#: The kinds :func:`conversion_step` runs (the rest of :data:`_KINDS` is geometry or ``Compose``).
CONVERSIONS = frozenset(
    ("ToTensor", "PILToTensor", "ToImage", "ConvertImageDtype", "ConvertImageDtypeV2", "ToDtype")
    + ("Normalize", "ToPureTensor", "MaybeToTensor", "MaybePILToTensor")
)


def op_kind(op: Any) -> str | None:
    """What fastload knows ``op`` as: a geometric op's name, ``"Compose"``, or a conversion
    (:data:`CONVERSIONS`); ``None`` for anything else, subclasses included (they may do more)."""
    cls = type(op)
    return _KINDS.get(f"{cls.__module__}.{cls.__qualname__}")


def is_v2(op: Any) -> bool:
    """Whether ``op`` is a ``torchvision.transforms.v2`` transform."""
    return type(op).__module__.startswith("torchvision.transforms.v2")


# ``return self.<attribute>(<argument>)``'s bytecode, less the call set-up ops that vary by Python version
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
    ops = [
        (_OP_ALIASES.get(ins.opname, ins.opname), ins.argval)
        for ins in dis.get_instructions(function)
        if ins.opname not in _SETUP_OPS
    ]
    if tuple(name for name, _ in ops) != _FORWARD_SHAPE:
        return None
    self_name, x_name = code.co_varnames[:2]
    (_, first), (_, attribute), (_, second), (_, argc), _ = ops
    if first != self_name or second != x_name or not isinstance(attribute, str):
        return None
    return attribute if argc in (1, None) else None  # 3.11 CALL's argval is the argument count


def see_through(transform: Any) -> Any:
    """The torchvision ``Compose`` a wrapper object only forwards to, or ``transform`` itself: a class
    whose ``__call__`` (a hook-free ``nn.Module``'s ``forward``) is exactly ``def __call__(self, img):
    return self.<name>(img)``, as torchvision's reference presets (docs/swap.md, "Wrappers")."""
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
    """The ops of a torchvision pipeline in order, wrappers seen through and ``Compose`` flattened."""
    transform = see_through(transform)
    if op_kind(transform) == "Compose":
        ops: list[Any] = []
        for t in transform.transforms:
            ops += pipeline_ops(t)
        return ops
    return [transform]


def resize_mode(op: Any) -> str | tuple[str, ...]:
    """The interpolation of a torchvision (or timm) resize op as fastload names it, a tuple for
    timm's random choice (``NotReproducible`` for a mode other than bilinear, bicubic or nearest)."""
    if isinstance(op.interpolation, (tuple, list)):
        return tuple(_mode_name(op, mode) for mode in op.interpolation)
    return _mode_name(op, op.interpolation)


def _mode_name(op: Any, mode: Any) -> str:
    mode = getattr(mode, "value", mode)
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
    ``antialias`` (``None`` and 0.15/0.16's ``"warn"`` default are ``False``)."""
    if on_pil:
        return True  # PIL's resample always antialiases; torchvision ignores the flag for PIL images
    value = getattr(op, "antialias", True)
    return value != "warn" and bool(value)


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
    """What a conversion op does to an image in ``state`` (``"pil"``: a PIL RGB image, ``"uint8"``:
    a ``(3, H, W)`` tensor, ``"float"``: float32): the new state and its steps (as in
    :class:`fastload.tvpipeline.Conversion`); ``NotReproducible`` where torchvision would raise, or
    the result is not uint8 or float32."""
    label = type(op).__name__
    if kind in ("MaybeToTensor", "MaybePILToTensor"):  # timm's: ToTensor / PILToTensor, tensors pass
        if state != "pil":
            return state, []
        kind = kind[5:]
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
    """The fast equivalent of a torchvision pipeline applied to PIL RGB images; ``ValueError`` saying
    which op (or property of the pipeline) fastload cannot reproduce."""
    try:
        return _convert(transform)
    except NotReproducible as e:
        raise ValueError(str(e)) from None


def _convert(transform: Any) -> TorchvisionPipeline:
    transform = see_through(transform)
    if op_kind(transform) not in ("Compose", *_GEOMETRY_KINDS):
        raise NotReproducible(
            f"the dataset's transform ({type(transform).__name__}) is not a torchvision Compose "
            "(nor an object whose __call__ only returns self.<name>(img) of one)"
        )
    state = "pil"  # what the image is at this point: "pil", "uint8" (tensor) or "float"
    geometry: list[T.Transform] = []
    on_pil: set[bool] = set()
    random = False
    jitter: tuple[Any, Any, Any] | None = None
    steps: list[tuple[Any, ...]] = []
    ops = pipeline_ops(transform)
    for op in ops:
        kind = op_kind(op)
        label = type(op).__name__
        if kind in _GEOMETRY_KINDS and jitter is not None:
            raise NotReproducible(
                f"{label} after ColorJitter: fastload reproduces crops, resizes and flips before it"
            )
        if is_jitter(op) and state == "pil" and jitter is None:
            jitter, random = (op.brightness, op.contrast, op.saturation), True
        elif kind in _GEOMETRY_KINDS:
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
        jitter=jitter,
    )


# --------------------------------------------------------------------------------------------
# Recognising a dataset
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Recognition:
    """What :func:`recognize` found: the dataset the fast path serves from, or why there is none."""

    dataset: EncodedImageDataset | None
    reason: str | None
    image_pipeline: bool  # the dataset is an image folder (a torchvision pipeline was not reproduced)


def recognize(dataset: Any) -> Recognition:
    """The fast path's dataset for ``dataset`` (see the module docs), or the reason there is none."""
    if not is_image_folder(dataset):
        return Recognition(
            None,
            f"{type(dataset).__name__} is not an image folder dataset fastload reads (fastload.ImageFolder, "
            "InMemoryImageFolder, torchvision's ImageFolder/DatasetFolder or timm's ImageDataset)",
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
