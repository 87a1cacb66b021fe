"""Head acceleration: the decode-and-crop head of a torchvision pipeline fused with decoding, the
rest of the user's pipeline run as written.

For a pipeline the fast path (:mod:`fastload.recognize`) does not reproduce whole,
``fastload.DataLoader`` keeps torch's iterator and workers and serves them a view of the dataset
(:func:`head_view`) whose ``__getitem__`` runs a :class:`HeadPipeline`::

    user's pipeline:  [PILToTensor]  RandomResizedCrop  RandomHorizontalFlip  TrivialAugmentWide
                       PILToTensor  ConvertImageDtype  Normalize  RandomErasing
    HeadPipeline:     |------------- head: fused with decoding ---------------| as written
                      |------------ conversion: one pass ------------------|  as written

The head's parameters are drawn by torchvision's own code from torch's global RNG before any pixel
is decoded; only the crop's region is decoded, returned as the type the head would return.
Conversions in a row run as one pass with torchvision's arithmetic
(:class:`fastload.tvpipeline.Conversion`); everything else is the user's own object. What
qualifies, ``exact_pixels`` and undecodable files: docs/swap.md, "Head acceleration".
"""

from __future__ import annotations

import ast
import importlib
import io
import random
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from ._jitter import Jitter, is_jitter
from .decode import DecodeError, decode_jpeg_region, decode_pil, jpeg_header, open_image
from .fused import Plan, decode_plan, reduced_scale
from .imagefolder import EncodedImageDataset
from .recognize import (
    CONVERSIONS,
    conversion_step,
    is_v2,
    op_kind,
    pipeline_ops,
    resize_mode,
    tensor_antialias,
)
from .transforms import resized_output_size
from .tvfolder import NotReproducible, folder_source, is_image_folder
from .tvpipeline import Conversion

__all__ = ["HeadPipeline", "head_view", "split_pipeline", "library_op"]

_CROPS = ("RandomResizedCrop", "Resize", "CenterCrop", "ResizeKeepRatio")


#: How fastload's datasets name a sample in errors (``fastload.ImageFolder.describe``).
_SAMPLE_NAME = re.compile(r"sample \d+ \((.+)\)\Z", re.S)


def _opened_file(name: str) -> str:
    """The file's name as PIL's "cannot identify image file" error shows it for torchvision's loader."""
    match = _SAMPLE_NAME.match(name)
    try:
        path = ast.literal_eval(match.group(1)) if match else None
    except (ValueError, SyntaxError):
        path = None
    return f"<_io.BufferedReader name={path!r}>" if isinstance(path, str) else name


@dataclass
class _HeadOp:
    """One op of the head: the user's object and how fastload plans it."""

    kind: str  # "RandomResizedCrop" | "Resize" | "CenterCrop" | "RandomHorizontalFlip"
    op: Any
    v2: bool
    interpolation: str | tuple[str, ...] = "bilinear"
    antialias: bool = True


@dataclass
class _Chosen:
    """One interpolation mode of a timm op's random choice, as :func:`resize_mode` reads an op."""

    interpolation: Any


@dataclass
class _Convert:
    """A run of conversion ops done in one pass (see the module docs)."""

    ops: list[Any]  # the user's objects (run instead when the input is not what was planned)
    source: str  # "pil" or "uint8": what the run expects
    wrapped_in: bool  # a tv_tensors.Image expected (else a plain tensor), for "uint8"
    wrapped_out: bool  # the result is a tv_tensors.Image
    conversion: Conversion


def _head_op(op: Any, kind: str, on_pil: bool) -> _HeadOp:
    interpolation: str | tuple[str, ...] = "bilinear"
    antialias = True
    if kind in ("RandomResizedCrop", "Resize", "ResizeKeepRatio"):
        interpolation = resize_mode(op)  # raises for modes fastload does not resample
        antialias = tensor_antialias(op, on_pil)
    if kind == "Resize" and getattr(op, "size", None) is None and getattr(op, "max_size", None) is None:
        raise NotReproducible(f"{type(op).__name__} without a size")
    return _HeadOp(kind, op, is_v2(op), interpolation, antialias)


def _conversion_run(
    ops: list[Any], start: int, state: str, wrapped: bool
) -> tuple[_Convert | None, int, str, bool]:
    """The longest fusable run of conversions from ``ops[start]``: ``(run or None, next, state, wrapped)``."""
    steps: list[tuple[Any, ...]] = []
    i, now, wrap = start, state, wrapped
    while i < len(ops):
        op = ops[i]
        kind = op_kind(op)
        if kind not in CONVERSIONS:
            break
        if wrap and not is_v2(op):
            break  # a v1 op on a tv_tensors.Image returns a plain tensor at some point: run it as written
        try:
            now, more = conversion_step(op, kind, now)
        except NotReproducible:
            break
        steps += more
        if kind == "ToImage":
            wrap = True
        elif kind in ("ToPureTensor", "ToTensor", "PILToTensor"):
            wrap = False
        i += 1
    if i == start or now == "pil":
        return None, start, state, wrapped
    run = _Convert(list(ops[start:i]), state, wrapped, wrap, Conversion(tuple(steps)))
    return run, i, now, wrap


def split_pipeline(transform: Any, *, reduce: bool | None = None, exact: bool = False) -> HeadPipeline:
    """The :class:`HeadPipeline` of a torchvision pipeline: ``transform`` a torchvision ``Compose``
    (v1 or v2), one op, or a wrapper :func:`fastload.recognize.see_through` sees through.

    ``reduce``: allow reduced-size JPEG decoding (``None``: when the head has a random op);
    ``exact``: decode at full size and resize exactly as torchvision does. ``NotReproducible``
    (naming the first op and why) unless the pipeline begins with a crop or resize fastload fuses.
    """
    ops = pipeline_ops(transform)
    i, state, wrapped = 0, "pil", False
    while i < len(ops) and op_kind(ops[i]) in ("PILToTensor", "ToImage"):  # the tensor backend
        if op_kind(ops[i]) == "PILToTensor" and state != "pil":
            break
        wrapped = op_kind(ops[i]) == "ToImage" or (wrapped and op_kind(ops[i]) != "PILToTensor")
        state = "uint8"
        i += 1
    leading = list(ops[:i])
    head_state, head_wrapped = state, wrapped
    head: list[_HeadOp] = []
    blocker: str | None = None
    while i < len(ops):
        kind = op_kind(ops[i])
        if kind not in (*_CROPS, "RandomHorizontalFlip"):
            break
        if wrapped and not is_v2(ops[i]):
            blocker = f"a v1 {type(ops[i]).__name__} on a tv_tensors.Image"
            break
        try:
            head.append(_head_op(ops[i], kind, state == "pil"))
        except NotReproducible as e:
            blocker = str(e)
            break
        i += 1
    if not any(h.kind in _CROPS for h in head):
        first = ops[len(leading)] if len(leading) < len(ops) else None
        if blocker is not None and not head:
            raise NotReproducible(f"the pipeline's first crop or resize is not one fastload fuses: {blocker}")
        what = "nothing" if first is None else type(first).__name__
        raise NotReproducible(
            f"the pipeline does not begin with a crop or resize fastload fuses with decoding "
            f"(RandomResizedCrop, Resize, CenterCrop; it begins with {what})"
        )
    stages: list[Any] = []
    while i < len(ops):
        run = None
        if state in ("pil", "uint8"):
            run, nxt, new_state, new_wrap = _conversion_run(ops, i, state, wrapped)
            if run is not None:
                stages.append(run)
                i, state, wrapped = nxt, new_state, new_wrap
                continue
        # the user's op (planned to keep the image's kind, checked at run time); a ColorJitter on PIL
        # images: its own draws and Pillow's blends on the array (fastload._jitter)
        stages.append(Jitter(ops[i]) if state == "pil" and is_jitter(ops[i]) else ops[i])
        i += 1
    random = any(h.kind in ("RandomResizedCrop", "RandomHorizontalFlip") for h in head)
    return HeadPipeline(
        leading,
        head_state,
        head_wrapped,
        head,
        stages,
        reduce=(random if reduce is None else bool(reduce)) and not exact,
        exact=exact,
        transform=transform,
    )


def library_op(op: Any) -> bool:
    """Whether ``op`` is one of torchvision's or timm's own transform classes (not ``Lambda``, not
    a subclass defined elsewhere); a container (``RandomApply``, ``Compose``, ...) when every op it
    holds is."""
    cls = type(op)
    if not cls.__module__.startswith(("torchvision.transforms", "timm.data.")) or cls.__name__ == "Lambda":
        return False
    inner = getattr(op, "transforms", None)
    if isinstance(inner, (list, tuple, torch.nn.ModuleList)):
        return all(library_op(t) for t in inner)
    return True


_STAND_IN = torch.zeros(())  # .expand(3, H, W): no memory, what torchvision's parameter code measures


def _draw_crop(h: _HeadOp, height: int, width: int) -> tuple[int, int, int, int]:
    """``(top, left, height, width)`` drawn by the user's RandomResizedCrop's own code."""
    image = _STAND_IN.expand(3, height, width)
    op = h.op
    if h.v2:
        make = getattr(op, "make_params", None) or op._get_params  # torchvision < 0.21 names it so
        params = make([image])
        return int(params["top"]), int(params["left"]), int(params["height"]), int(params["width"])
    top, left, crop_h, crop_w = type(op).get_params(image, op.scale, op.ratio)
    return int(top), int(left), int(crop_h), int(crop_w)


def _draw_flip(h: _HeadOp) -> bool:
    """The user's flip's own draw (v1: flip if ``rand < p``; v2: keep if ``rand >= p``, the same
    for its ``0 <= p <= 1``)."""
    return bool(torch.rand(1) < h.op.p)


def _size_list(size: Any) -> list[int]:
    return [int(size), int(size)] if isinstance(size, int) else [int(v) for v in size]


class HeadPipeline:
    """A torchvision pipeline with its head fused with decoding (see the module docs), built by
    :func:`split_pipeline`; a dataset whose ``transform`` it is calls :meth:`decode_and_apply`.

    Attributes:
        transform: The user's pipeline (run whole on the reference decode of a file fastload's
            decoder cannot read).
        errors: ``"pil"``: a file no decoder reads raises PIL's error, as torchvision's loader
            does; ``"fastload"``: :class:`fastload.decode.DecodeError`, as fastload's datasets do.
    """

    def __init__(
        self,
        leading: list[Any],
        head_state: str,
        head_wrapped: bool,
        head: list[_HeadOp],
        stages: list[Any],
        *,
        reduce: bool,
        exact: bool,
        transform: Any,
        errors: str = "pil",
    ) -> None:
        self.leading = leading
        self.head_state = head_state
        self.head_wrapped = head_wrapped
        self.head = head
        self.stages = stages
        self.reduce = reduce
        self.exact = exact
        self.transform = transform
        self.errors = errors

    # ---------------------------------------------------------------- description

    @property
    def fused_ops(self) -> list[str]:
        """The names of the ops fastload runs itself (the rest are the user's objects)."""
        names = [type(op).__name__ for op in self.leading] + [type(h.op).__name__ for h in self.head]
        for stage in self.stages:
            if isinstance(stage, _Convert):
                names += [type(op).__name__ for op in stage.ops]
            elif isinstance(stage, Jitter):
                names.append(type(stage.op).__name__)
        return names

    @property
    def user_ops(self) -> list[str]:
        """The names of the ops that run as the user's objects."""
        return [type(stage).__name__ for stage in self.stages if not isinstance(stage, (_Convert, Jitter))]

    @property
    def foreign_ops(self) -> list[str]:
        """The names of the ops run as written that are code of the user's (not :func:`library_op`)."""
        return [
            type(stage).__name__
            for stage in self.stages
            if not isinstance(stage, (_Convert, Jitter)) and not library_op(stage)
        ]

    def describe(self) -> str:
        """One line: what is fused and what runs as written, in pipeline order."""
        head = [type(op).__name__ for op in self.leading] + [type(h.op).__name__ for h in self.head]
        parts = [" -> ".join(head) + " fused with decoding"]
        for stage in self.stages:
            if isinstance(stage, _Convert):
                parts.append(" -> ".join(type(op).__name__ for op in stage.ops) + " in one pass")
            elif isinstance(stage, Jitter):
                parts.append("ColorJitter on the decoded pixels")
            else:
                parts.append(f"{type(stage).__name__} as written")
        return "; ".join(parts)

    def __repr__(self) -> str:
        return f"HeadPipeline({self.describe()})"

    # ---------------------------------------------------------------- running

    def decode_and_apply(self, data: bytes | memoryview | np.ndarray, name: str = "image") -> Any:
        """One sample: decode fused with the head, then the rest of the pipeline (see the module docs)."""
        rng_state = torch.get_rng_state()
        try:
            image = self._head(data, name)
        except DecodeError:
            torch.set_rng_state(rng_state)  # the reference decode then draws what torchvision draws
            return self.transform(self._reference(data, name))
        raw = isinstance(image, np.ndarray)  # the head's HWC array: fused stages take it as it is
        if not raw:
            image = self._materialize(image)
        for stage in self.stages:
            if isinstance(stage, Jitter):
                image = stage(image)  # an array stays an array, a PIL image a PIL image
                continue
            if isinstance(stage, _Convert):
                image = self._convert(stage, image)
            else:
                image = stage(self._materialize(image) if raw else image)
            raw = False
        return self._materialize(image) if raw else image

    def _reference(self, data: bytes | memoryview | np.ndarray, name: str) -> Image.Image:
        """The image as the user's loader reads it (PIL, RGB)."""
        if self.errors == "fastload":
            return decode_pil(bytes(data) if isinstance(data, np.ndarray) else data, name)
        raw = data.tobytes() if isinstance(data, np.ndarray) else data
        try:
            img = Image.open(io.BytesIO(raw))
        except UnidentifiedImageError:
            raise UnidentifiedImageError(f"cannot identify image file {_opened_file(name)}") from None
        return img.convert("RGB")

    def _plan(self, height: int, width: int) -> tuple[Plan, list[tuple[_HeadOp, Any]]]:
        """Draws the head's parameters (torchvision's draws, in order) and plans its geometry; also
        returns each head op with its draw (crop box, flip, or ``None``) for the tensor path."""
        plan = Plan(height, width)
        drawn: list[tuple[_HeadOp, Any]] = []
        for h in self.head:
            if h.kind == "RandomResizedCrop":
                box = _draw_crop(h, plan.height, plan.width)
                mode = h.interpolation
                if isinstance(mode, tuple):  # timm's random interpolation: its own draw, after the crop's
                    mode = str(resize_mode(_Chosen(random.choice(h.op.interpolation))))
                out_h, out_w = _size_list(h.op.size)
                plan.crop(*box)
                plan.resize(out_h, out_w, mode, h.antialias)
                drawn.append((h, (box, mode)))
            elif h.kind == "RandomHorizontalFlip":
                flip = _draw_flip(h)
                if flip:
                    plan.hflip()
                drawn.append((h, flip))
            elif h.kind == "Resize":
                target: Any = h.op.size
                if isinstance(target, (list, tuple)):
                    target = int(target[0]) if len(target) == 1 else (int(target[0]), int(target[1]))
                rh, rw = resized_output_size(plan.height, plan.width, target, h.op.max_size)
                plan.resize(rh, rw, str(h.interpolation), h.antialias)
                drawn.append((h, None))
            elif h.kind == "ResizeKeepRatio":  # timm's: its own size (and draws) for this image
                op = h.op
                image = _STAND_IN.expand(3, plan.height, plan.width)
                randoms = (op.random_scale_prob, op.random_scale_range, op.random_scale_area)
                aspects = (op.random_aspect_prob, op.random_aspect_range)
                size = [int(v) for v in type(op).get_params(image, op.size, op.longest, *randoms, *aspects)]
                mode = h.interpolation
                if isinstance(mode, tuple):
                    mode = str(resize_mode(_Chosen(random.choice(op.interpolation))))
                plan.resize(size[0], size[1], mode, h.antialias)
                drawn.append((h, (size, mode)))
            else:  # CenterCrop
                ch, cw = _size_list(h.op.size)
                if ch > plan.height or cw > plan.width:
                    plan.center_crop_padded(ch, cw)
                else:
                    top, left = int(round((plan.height - ch) / 2.0)), int(round((plan.width - cw) / 2.0))
                    plan.crop(top, left, ch, cw)
                drawn.append((h, None))
        return plan, drawn

    def _head(self, data: bytes | memoryview | np.ndarray, name: str) -> np.ndarray | torch.Tensor:
        """The head's output: an HWC uint8 array, or a ``(3, H, W)`` uint8 tensor (a tensor head)."""
        header = jpeg_header(data)
        img = None if header is not None else open_image(data, name)
        height, width = (header[1], header[0]) if header is not None else (img.height, img.width)  # type: ignore[union-attr]
        plan, drawn = self._plan(height, width)
        if self.head_state == "uint8" and reduced_scale(plan, img, self.reduce and plan.fusable) == 1:
            return self._tensor_head(data, img, drawn, name)
        out = np.empty((plan.height, plan.width, 3), dtype=np.uint8)
        decode_plan(data, img, plan, out, name, pil=True, reduce=self.reduce, exact=self.exact)
        return out

    def _tensor_head(
        self,
        data: bytes | memoryview | np.ndarray,
        img: Image.Image | None,
        drawn: list[tuple[_HeadOp, Any]],
        name: str,
    ) -> torch.Tensor:
        """A head on tensors, op by op with torchvision's functional ops, on a leading crop's region."""
        region = None
        start = 0
        if drawn and drawn[0][0].kind == "RandomResizedCrop" and img is None:
            top, left, crop_h, crop_w = drawn[0][1][0]
            region = decode_jpeg_region(data, left, top, crop_w, crop_h)
            if region is not None:
                start = 1
        if region is None and img is None:
            region = decode_jpeg_region(data, 0, 0, *(jpeg_header(data) or (0, 0))[:2])
            if region is None:
                open_image(data, name)  # libjpeg reported corrupt data: PIL's open names the error
        if region is None:
            region = np.asarray(decode_pil(data.tobytes() if isinstance(data, np.ndarray) else data, name))
        if not (region.flags.writeable and region.flags.c_contiguous):
            region = np.array(region)  # the tail may write to what the head returns
        t = torch.from_numpy(region).permute(2, 0, 1)  # pil_to_tensor's layout
        for k, (h, params) in enumerate(drawn):
            F = _functional(h.v2)
            op = h.op
            if h.kind == "RandomResizedCrop":
                box, mode = params
                if k >= start:
                    t = F.crop(t, *box)
                t = F.resize(t, _size_list(op.size), interpolation=_mode(mode), antialias=h.antialias)
            elif h.kind == "Resize":
                t = F.resize(
                    t, op.size, interpolation=op.interpolation, max_size=op.max_size, antialias=op.antialias
                )
            elif h.kind == "ResizeKeepRatio":
                t = F.resize(t, params[0], interpolation=_mode(params[1]), antialias=h.antialias)
            elif h.kind == "CenterCrop":
                t = F.center_crop(t, op.size)
            elif params:
                t = F.horizontal_flip(t) if h.v2 else F.hflip(t)
        return t

    def _materialize(self, image: np.ndarray | torch.Tensor) -> Any:
        """The head's output as the type the head returns."""
        if isinstance(image, np.ndarray):
            if self.head_state == "pil":
                return Image.fromarray(image)
            image = torch.from_numpy(image).permute(2, 0, 1)
        return _wrap(image) if self.head_wrapped else image

    def _convert(self, stage: _Convert, image: Any) -> Any:
        """A fused conversion run, or the user's ops where the input is not what was planned."""
        hwc: np.ndarray | None = None
        chw: torch.Tensor | None = None
        if isinstance(image, np.ndarray):  # straight from the head, planned for this run
            hwc = image
        elif stage.source == "pil":
            if isinstance(image, Image.Image) and image.mode == "RGB":
                hwc = np.asarray(image)
        elif (
            isinstance(image, torch.Tensor)
            and _is_image_type(image) == stage.wrapped_in
            and image.dtype == torch.uint8
            and image.ndim == 3
            and image.shape[0] == 3
            and image.device.type == "cpu"
        ):
            chw = image.as_subclass(torch.Tensor)
            if chw.permute(1, 2, 0).is_contiguous():
                hwc = chw.permute(1, 2, 0).numpy()
        if hwc is None and chw is None:
            for op in stage.ops:
                image = op(image)
            return image
        conversion = stage.conversion
        if hwc is not None:
            if conversion.dtype == torch.uint8:  # a copy, as pil_to_tensor makes (hwc may be PIL's)
                out_t = torch.from_numpy(np.array(hwc)).permute(2, 0, 1)
            else:
                out = np.empty((3, hwc.shape[0], hwc.shape[1]), dtype=np.float32)
                conversion.hwc(np.ascontiguousarray(hwc), out)
                out_t = torch.from_numpy(out)
        else:
            assert chw is not None
            out_t = chw if conversion.dtype == torch.uint8 and not conversion.steps else conversion.batch(chw)
        return _wrap(out_t) if stage.wrapped_out else out_t


def _functional(v2: bool) -> Any:
    return importlib.import_module(
        "torchvision.transforms.v2.functional" if v2 else "torchvision.transforms.functional"
    )


def _mode(name: str) -> Any:
    from torchvision.transforms import InterpolationMode

    return InterpolationMode(name)


def _is_image_type(t: torch.Tensor) -> bool:
    if type(t) is torch.Tensor:
        return False
    from torchvision import tv_tensors

    return isinstance(t, tv_tensors.Image)


def _wrap(t: torch.Tensor) -> torch.Tensor:
    from torchvision import tv_tensors

    return tv_tensors.Image(t)


def head_view(dataset: Any, *, exact: bool = False) -> tuple[EncodedImageDataset | None, str | None]:
    """The dataset torch's iterator serves for a head-accelerated ``dataset`` (its samples, labels,
    classes and ``target_transform``; as ``transform`` the :class:`HeadPipeline` of
    ``dataset.transform``): ``(view, None)``, or ``(None, reason)`` naming what rules it out."""
    if not is_image_folder(dataset):
        return None, (
            f"{type(dataset).__name__} is not an image folder dataset fastload reads (fastload.ImageFolder, "
            "InMemoryImageFolder, torchvision's ImageFolder/DatasetFolder or timm's ImageDataset)"
        )
    transform = getattr(dataset, "transform", None)
    if transform is None:
        return None, "the dataset has no transform: its samples are PIL images"
    try:
        view = folder_source(dataset)
        pipeline = split_pipeline(transform, exact=exact)
    except NotReproducible as e:
        return None, str(e)
    pipeline.errors = "fastload" if isinstance(dataset, EncodedImageDataset) else "pil"
    view.transform = pipeline  # type: ignore[assignment]  # a callable with decode_and_apply
    return view, None
