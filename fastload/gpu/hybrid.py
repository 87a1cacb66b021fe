"""``decode="hybrid"``: every batch split between the CPU workers and the device's JPEG decoder.

A hybrid batch of ``n`` images::

    positions 0 .. d-1   device side: read, decoded on the device (decoder thread, its stream),
                         cropped there by the head of gpu_transforms
    positions d .. n-1   CPU side: the fast path's workers decode only the crop (reduced-size JPEG
                         decoding fused with the resize) into a pinned uint8 slot
    -> one uint8 batch on the device (the slot copied beside the model), then the rest of
       gpu_transforms on the whole batch

The *head* (:func:`split_head`) brings every image to one size; the CPU workers run it as
:class:`DeviceHead`, drawing each crop box from the same ``(seed, epoch, index)`` as the device.
:class:`HybridSplit` gives the CPU ``cpu_rate / (cpu_rate + device_rate)`` of each batch (neither
side waits); a side too slow for one image gets one every :attr:`HybridSplit.probe_every` batches.
``loader.hybrid.cpu_share = 0.5`` fixes the split (batches then repeat bit for bit). Experimental
(``FASTLOAD_GPU_EXPERIMENTAL=1``): the CPU's share is at least ``cpu_rate / (demand * headroom)``,
``demand`` the images per second of the loop's own time over its last 32 batches, since device
decoding takes the model's GPU time.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from .. import rng as _rng
from ..device import gpu_experimental
from ..fused import Plan
from ..transforms import CenterCrop as _CpuCenterCrop
from ..transforms import Transform
from .base import apply_transform
from .decode import RegionBatch
from .geometry import CenterCrop, Compose, RandomResizedCrop, Resize, crop_resize
from .memory import host_memory

__all__ = ["DeviceHead", "HybridSplit", "apply_head", "region_crop", "split_head"]


def _fixed_size(op: Any) -> bool:
    """Whether ``op`` gives every image one size."""
    return isinstance(op, (RandomResizedCrop, CenterCrop)) or (isinstance(op, Resize) and not op.short)


def split_head(transforms: Callable[..., Any]) -> tuple[list[Any], list[Any]]:
    """``gpu_transforms`` cut into the head (its leading crops and resizes, up to the last one that
    gives every image one size) and the rest; ``ValueError`` if there is no such head.

    Example: ``Compose([RandomResizedCrop(224), RandomHorizontalFlip(), Normalize(...)])`` ->
    ``([RandomResizedCrop(224)], [RandomHorizontalFlip(), Normalize(...)])``.
    """
    ops = list(transforms.transforms) if type(transforms) is Compose else [transforms]
    end = 0
    for k, op in enumerate(ops):
        if type(op) not in (RandomResizedCrop, Resize, CenterCrop):
            break
        if _fixed_size(op):
            end = k + 1
    if end == 0:
        raise ValueError(
            "decode='hybrid' needs gpu_transforms that begin with a crop or resize to one size, which the "
            "CPU workers run for their share of each batch (gpu.RandomResizedCrop(224), gpu.Resize((h, w)) "
            f"or gpu.Resize(256) + gpu.CenterCrop(224)), but got gpu_transforms={transforms!r}"
        )
    return ops[:end], ops[end:]


def region_crop(head: Sequence[Any]) -> RandomResizedCrop | None:
    """The head's crop where it is one ``gpu.RandomResizedCrop`` (a region decoder decodes its boxes)."""
    return head[0] if len(head) == 1 and type(head[0]) is RandomResizedCrop else None


def apply_head(
    head: Sequence[Any],
    images: list[torch.Tensor] | RegionBatch,
    indices: np.ndarray,
    epoch: int,
    seed: int,
    cropped: Sequence[bool] | None = None,
) -> torch.Tensor:
    """``head`` on a batch's decoded images, as one ``(N, C, H, W)`` tensor. ``cropped[k]`` (and a
    :class:`~fastload.gpu.decode.RegionBatch`'s boxes): image ``k`` is its crop box, only resized."""
    if cropped is not None and any(cropped) and not isinstance(images, RegionBatch):
        if region_crop(head) is None:
            raise ValueError(
                f"cropped images need a head that is one gpu.RandomResizedCrop, but got {list(head)!r}"
            )
        others = [(k, image, bool(c)) for k, (image, c) in enumerate(zip(images, cropped, strict=False))]
        images = RegionBatch(len(images), None, np.zeros(0, np.int64), np.zeros((0, 4), np.int64), others)
    if isinstance(images, RegionBatch):
        return _head_on_regions(head, images, indices, epoch, seed)
    return apply_transform(Compose(list(head)), images, indices, epoch, seed)


def _head_on_regions(
    head: Sequence[Any], batch: RegionBatch, indices: np.ndarray, epoch: int, seed: int
) -> torch.Tensor:
    crop = region_crop(head)
    if crop is None:
        raise ValueError(
            f"a RegionBatch needs a head that is one gpu.RandomResizedCrop, but got {list(head)!r}"
        )
    parts: list[tuple[np.ndarray, torch.Tensor]] = []
    if batch.packed is not None:
        top, left, height, width = batch.boxes.T
        resized = crop_resize(batch.packed, top, left, height, width, crop.size, crop.antialias)
        parts.append((batch.positions, resized))
    boxes = [(k, image) for k, image, is_box in batch.others if is_box]
    if boxes:
        resize = Resize(crop.size, antialias=crop.antialias)
        parts.append((np.array([k for k, _ in boxes]), resize([image for _, image in boxes])))
    whole = [(k, image) for k, image, is_box in batch.others if not is_box]
    if whole:
        rows = np.array([k for k, _ in whole])
        made = apply_transform(Compose(list(head)), [image for _, image in whole], indices[rows], epoch, seed)
        parts.append((rows, made))
    if len(parts) == 1 and np.array_equal(parts[0][0], np.arange(batch.n)):
        return parts[0][1]
    first = parts[0][1]
    out = first.new_empty((batch.n, *first.shape[1:]))
    for rows, made in parts:
        index = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64))
        if out.device.type != "cpu":  # through pinned memory: no synchronous pageable copy
            host = host_memory()
            index = (host.pin(index) if host.can_pin() else index).to(out.device, non_blocking=True)
        out[index] = made
    return out


class DeviceHead(Transform):
    """The head (:func:`split_head`) as a CPU transform fused with decoding: the device's draws for
    the current sample's key (:func:`fastload.rng.current_key`), bilinear resizes as on the device."""

    def __init__(self, head: Sequence[Any]) -> None:
        self.head = list(head)
        self.random = any(isinstance(op, RandomResizedCrop) for op in self.head)
        size: tuple[int, int] | None = None
        for op in self.head:
            size = tuple(op.size) if _fixed_size(op) else None
        self.size = size
        self._steps = [
            (op, _CpuCenterCrop(op.size) if isinstance(op, CenterCrop) else None) for op in self.head
        ]

    def _plan(self, plan: Plan, rng: _rng.SampleRNG) -> None:
        key = _rng.current_key()
        for op, center in self._steps:
            if isinstance(op, RandomResizedCrop):
                if key is None:  # outside the loader: torch's global RNG, as the device op draws
                    top, left, h, w = (int(a[0]) for a in op.boxes([plan.height], [plan.width]))
                else:
                    top, left, h, w = op.box(plan.height, plan.width, index=key[2], epoch=key[1], seed=key[0])
                plan.crop(top, left, h, w)
                plan.resize(op.size[0], op.size[1], "bilinear", op.antialias)
            elif isinstance(op, Resize):
                heights, widths = op.output_sizes(np.array([plan.height]), np.array([plan.width]))
                plan.resize(int(heights[0]), int(widths[0]), "bilinear", op.antialias)
            elif center is not None:
                center._plan(plan, rng)

    def _output_size(self, input_size: tuple[int, int] | None) -> tuple[int, int] | None:
        return self.size

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.head!r})"


class HybridSplit:
    """How many images of each ``decode="hybrid"`` batch the CPU workers decode (see the module docs).

    Args:
        cpu_share: A fixed fraction of each batch for the CPU workers; ``None``: follow the rates.
        follow_demand: Follow the loop's demand too; ``None``: ``FASTLOAD_GPU_EXPERIMENTAL=1``.

    ``cpu_rate``, ``device_rate`` and ``demand`` are images per second (``None``: not measured).
    """

    smoothing = 0.3  # weight of a new measurement in the running rates
    probe_every = 16
    headroom = 1.1
    demand_window = 32

    def __init__(self, cpu_share: float | None = None, follow_demand: bool | None = None) -> None:
        self.cpu_share = cpu_share
        self.follow_demand = gpu_experimental() if follow_demand is None else bool(follow_demand)
        self.cpu_rate: float | None = None
        self.device_rate: float | None = None
        self.demand: float | None = None
        self._steps: collections.deque[tuple[int, float]] = collections.deque(maxlen=self.demand_window)
        self.decided = 0
        self._decisions: collections.deque[float] = collections.deque(maxlen=1000)
        self._carry = 0.0  # the adaptive split's rounding error, carried to the next batch
        self._lock = threading.Lock()  # decided in the feeder thread, read from anywhere

    @property
    def decisions(self) -> list[float]:
        """The CPU's fraction of each batch decided so far (the last 1,000), oldest first."""
        with self._lock:
            return list(self._decisions)

    @property
    def cpu_share(self) -> float | None:
        """The fixed CPU fraction, or ``None`` (adaptive)."""
        return self._cpu_share

    @cpu_share.setter
    def cpu_share(self, value: float | None) -> None:
        if value is not None and not (isinstance(value, (int, float)) and 0.0 <= float(value) <= 1.0):
            raise ValueError(f"cpu_share should be None or a number in [0, 1], but got cpu_share={value!r}")
        self._cpu_share = None if value is None else float(value)

    def share(self) -> float:
        """The CPU's fraction of the next batch."""
        if self._cpu_share is not None:
            return self._cpu_share
        cpu, device = self.cpu_rate, self.device_rate
        if cpu is None or device is None:
            return 0.5  # nothing measured yet: half each, then follow the rates
        balanced = cpu / (cpu + device) if cpu + device > 0 else 0.5
        if not self.follow_demand or not self.demand:
            return balanced
        return max(balanced, min(1.0, cpu / (self.demand * self.headroom)))

    def cpu_images(self, n: int, workers: int) -> int:
        """How many of a batch of ``n`` the CPU decodes (``workers``: CPU workers there are)."""
        if workers == 0 or n == 0:
            return 0
        with self._lock:
            self.decided += 1
            share = self.share()
            if self._cpu_share is not None:
                k = int(round(n * share))  # fixed: the same count for every batch of this size
            else:  # adaptive: the rounding error carried on, so small batches get the share on average
                exact = n * share + self._carry
                k = max(0, min(n, int(round(exact))))
                self._carry = exact - k
                if n > 1 and self.decided % self.probe_every == 0:  # each side measured now and then
                    k = min(max(k, 1), n - 1)
            self._decisions.append(k / n)
            return k

    def _update(self, old: float | None, images: int, seconds: float, scale: float = 1.0) -> float | None:
        if images <= 0 or seconds <= 0:
            return old
        rate = scale * images / seconds
        return rate if old is None else old + self.smoothing * (rate - old)

    def record_cpu(self, images: int, seconds: float, workers: int) -> None:
        """One worker decoded ``images`` in ``seconds``; the ``workers`` run side by side."""
        with self._lock:
            self.cpu_rate = self._update(self.cpu_rate, images, seconds, max(1, workers))

    def record_device(self, images: int, seconds: float) -> None:
        """The device side decoded and cropped ``images`` in ``seconds``."""
        with self._lock:
            self.device_rate = self._update(self.device_rate, images, seconds)

    def record_demand(self, images: int, seconds: float) -> None:
        """The loop spent ``seconds`` of its own on a batch of ``images`` between two ``next()`` calls;
        the demand is total images over total seconds of the last :attr:`demand_window` batches."""
        if images <= 0 or seconds < 0:
            return
        with self._lock:
            self._steps.append((images, seconds))
            total = sum(t for _, t in self._steps)
            if total > 0:
                self.demand = sum(n for n, _ in self._steps) / total

    def __repr__(self) -> str:
        def rate(r: float | None) -> str:
            return "not measured" if r is None else f"{r:,.0f} images/s"

        mode = "adaptive" if self._cpu_share is None else f"fixed at {self._cpu_share:g}"
        loop = f"; the loop takes {rate(self.demand)}" if self.follow_demand else ""
        return (
            f"HybridSplit({mode}: CPU share {self.share():.2f}; CPU {rate(self.cpu_rate)}, "
            f"device {rate(self.device_rate)}{loop})"
        )
