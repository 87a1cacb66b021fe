"""The resampling plan of the geometric transforms (per axis a window, a resize, a flip), run once
per batch by :meth:`GeometryPlan.execute`. Bilinear resizing (``antialias=True``: torch's triangle
filter) runs as two separable :func:`torch.nn.functional.embedding_bag` passes, the per-image taps
made on the host (the C extension ``fastload._resample``, else numpy) and sent in two copies; uint8
outputs within one level of torchvision's. One geometry for every image: torchvision's batched
resize. A ragged batch runs in the fewest groups of similar width whose padding costs at most 1.5
times its own work.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as nnf

from ..device import small_to_device
from .base import Images, Indices, PackedImages, image_sizes, refuse_empty, uniforms

try:
    from .. import _resample as _c_resample
except ImportError:  # built without a C compiler: the same numbers from numpy
    _c_resample = None
if _c_resample is not None and not all(
    hasattr(_c_resample, name) for name in ("antialias_taps", "axis_taps", "region_rows", "fewest_groups")
):
    _c_resample = None  # built from an older source (an in-place build not redone): numpy's, not an error

__all__ = ["USE_C_TAPS", "GeometryPlan", "plan_extension_built"]


class _Axis:
    """The geometry of one axis of every image of a batch: the current image is ``V[k] = R[win0 + k]``
    for ``k < winlen``, zero outside ``[lo, hi)``; ``R`` is the source ``S`` until a resize, then
    ``S[src0 : src0 + srclen]`` (zero outside ``[m0, m1)``) resampled to ``reslen`` pixels.
    """

    __slots__ = ("size", "src0", "srclen", "reslen", "win0", "winlen", "lo", "hi", "m0", "m1", "resampled")

    def __init__(self, size: np.ndarray) -> None:
        zeros = np.zeros_like(size)
        self.size = size
        self.src0, self.srclen, self.reslen = zeros, size, size
        self.win0, self.winlen = zeros, size
        self.lo, self.hi = zeros, size
        self.m0, self.m1 = zeros, size
        self.resampled = False

    def crop(self, start: np.ndarray, length: np.ndarray) -> None:
        self.lo = np.maximum(self.lo, self.win0)
        self.hi = np.minimum(self.hi, self.win0 + self.winlen)
        self.win0 = self.win0 + start
        self.winlen = np.asarray(length, dtype=np.int64)

    def resize(self, length: np.ndarray) -> None:
        # Not yet resampled, so R == S: the window (with its zero padding) becomes the region.
        self.src0, self.srclen = self.win0, self.winlen
        self.m0, self.m1 = self.lo, self.hi
        self.reslen = length
        self.win0, self.winlen = np.zeros_like(length), length
        self.lo, self.hi = np.zeros_like(length), length
        self.resampled = True

    def uniform(self) -> bool:
        return all(
            bool((getattr(self, name) == getattr(self, name)[0]).all()) for name in self.__slots__[:-1]
        )

    def taps(self, flip: np.ndarray | None, antialias: bool) -> _Taps:
        """This axis's filter taps: ``V[o] = sum_k w[o, k] * S[pos[o, k]]`` for every image."""
        length = int(self.winlen[0])
        if self.resampled and antialias and _c_resample is not None and USE_C_TAPS:
            # the same numbers as below, for every output pixel in one call without the interpreter
            count = len(self.size)
            xmin, xsize = np.empty((count, length), dtype=np.int64), np.empty((count, length), dtype=np.int64)
            center, valid = np.empty((count, length)), np.empty((count, length), dtype=bool)
            invscale = np.empty(count)
            per_image = [np.ascontiguousarray(a, dtype=np.int64) for a in (self.win0, self.lo, self.hi)]
            per_image += [np.ascontiguousarray(a, dtype=np.int64) for a in (self.srclen, self.reslen)]
            flips = None if flip is None else np.ascontiguousarray(flip, dtype=bool)
            _c_resample.axis_taps(*per_image, flips, xmin, xsize, center, valid, invscale)
            return _AntialiasTaps(self, xmin, xsize, center, invscale, valid)
        o = np.arange(length, dtype=np.int64)[None, :]
        if flip is not None:
            o = np.where(flip[:, None], length - 1 - o, o)
        r = self.win0[:, None] + o  # (N, L) position in R
        valid = (r >= self.lo[:, None]) & (r < self.hi[:, None])
        if not self.resampled:
            pos = np.clip(r[:, :, None], 0, self.size[:, None, None] - 1)
            return _HostTaps(pos, valid[:, :, None].astype(np.float64))
        n = self.srclen[:, None].astype(np.float64)
        m = self.reslen[:, None]
        scale = n / m
        rr = np.clip(r, 0, m - 1).astype(np.float64)
        if not antialias:
            # Plain bilinear (align_corners=False), two taps.
            src = np.maximum(scale * (rr + 0.5) - 0.5, 0.0)
            i0 = np.minimum(np.floor(src).astype(np.int64), self.srclen[:, None] - 1)
            i1 = i0 + (i0 < self.srclen[:, None] - 1)
            lam = np.clip(src - i0, 0.0, 1.0)
            pos = self.src0[:, None, None] + np.stack([i0, i1], -1)
            inside = (pos >= self.m0[:, None, None]) & (pos < self.m1[:, None, None])
            weights = np.stack([1.0 - lam, lam], -1) * inside * valid[:, :, None]
            return _HostTaps(np.clip(pos, 0, self.size[:, None, None] - 1), weights)
        # torch's antialiased filter: per output pixel, taps xmin .. xmin + xsize - 1 of a triangle
        # of width 2 * support; the per-group (n, L, K) arrays come later (_AntialiasTaps.fill)
        support = np.where(scale >= 1.0, scale, 1.0)
        invscale = np.where(scale >= 1.0, 1.0 / scale, 1.0)[:, 0]
        center = scale * (rr + 0.5)
        xmin = np.maximum(np.trunc(center - support + 0.5), 0).astype(np.int64)
        xmax = np.minimum(np.trunc(center + support + 0.5).astype(np.int64), self.srclen[:, None])
        return _AntialiasTaps(self, xmin, xmax - xmin, center, invscale, valid)


class _Taps:
    """An axis's filter taps for a batch: for image ``i``, output ``o`` and tap ``k``, a position in
    the image (clipped into it) and a weight."""

    def bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """Per image, the lowest and highest position any tap reads."""
        raise NotImplementedError

    def width(self, rows: np.ndarray) -> int:
        """How many taps the images ``rows`` need."""
        raise NotImplementedError

    def fill(self, rows: np.ndarray, shift: np.ndarray, pos: np.ndarray, weights: np.ndarray) -> None:
        """The taps of images ``rows`` into ``pos`` (plus each image's ``shift``) and ``weights``,
        each ``(n, L, K)`` with ``K >= width(rows)``."""
        raise NotImplementedError


class _HostTaps(_Taps):
    """Taps computed on the host (a crop, a flip, plain bilinear: one or two taps per pixel)."""

    def __init__(self, pos: np.ndarray, weights: np.ndarray) -> None:
        self.pos, self.weights = pos, weights

    def bounds(self) -> tuple[np.ndarray, np.ndarray]:
        n = len(self.pos)
        return self.pos.reshape(n, -1).min(1), self.pos.reshape(n, -1).max(1)

    def width(self, rows: np.ndarray) -> int:
        used = np.nonzero((self.weights[rows] != 0).any(axis=(0, 1)))[0]
        return int(used[-1]) + 1 if len(used) else 1

    def fill(self, rows: np.ndarray, shift: np.ndarray, pos: np.ndarray, weights: np.ndarray) -> None:
        k = min(pos.shape[2], self.pos.shape[2])
        np.add(self.pos[rows, :, :k], shift[:, None, None], out=pos[:, :, :k])
        weights[:, :, :k] = self.weights[rows, :, :k]
        if k < pos.shape[2]:  # wider than these taps: the rest weigh 0 and read the first
            pos[:, :, k:] = pos[:, :, :1]
            weights[:, :, k:] = 0


class _AntialiasTaps(_Taps):
    """torch's antialiased bilinear taps (its kernel setup's float64 operations): output ``o`` of
    image ``i`` reads taps ``k < xsize[i, o]`` at ``xmin[i, o] + k`` with weight
    ``max(0, 1 - |(xmin + k - center + 0.5) * invscale|)`` normalised by their in-order sum."""

    def __init__(
        self,
        axis: _Axis,
        xmin: np.ndarray,
        xsize: np.ndarray,
        center: np.ndarray,
        invscale: np.ndarray,
        valid: np.ndarray,
    ) -> None:
        def int64(a: np.ndarray) -> np.ndarray:
            return np.ascontiguousarray(a, dtype=np.int64)

        self.src0, self.m0, self.m1, self.size = (int64(a) for a in (axis.src0, axis.m0, axis.m1, axis.size))
        self.xmin, self.xsize = int64(xmin), int64(xsize)
        self.center = np.ascontiguousarray(center, dtype=np.float64)
        self.invscale = np.ascontiguousarray(invscale, dtype=np.float64)
        self.valid = np.ascontiguousarray(valid, dtype=bool)

    def bounds(self) -> tuple[np.ndarray, np.ndarray]:
        first = self.src0 + self.xmin.min(1)
        last = self.src0 + (self.xmin + np.maximum(self.xsize, 1) - 1).max(1)
        return np.clip(first, 0, self.size - 1), np.clip(last, 0, self.size - 1)

    def width(self, rows: np.ndarray) -> int:
        return max(int(self.xsize[rows].max()), 1)

    def fill(self, rows: np.ndarray, shift: np.ndarray, pos: np.ndarray, weights: np.ndarray) -> None:
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        shift = np.ascontiguousarray(shift, dtype=np.int64)
        if _c_resample is not None and USE_C_TAPS:
            _c_resample.antialias_taps(
                self.xmin, self.xsize, self.center, self.invscale, self.valid,
                self.src0, self.m0, self.m1, self.size, rows, shift, pos, weights,
            )  # fmt: skip
        else:
            self._fill_numpy(rows, shift, pos, weights)

    def _fill_numpy(self, rows: np.ndarray, shift: np.ndarray, pos: np.ndarray, weights: np.ndarray) -> None:
        """:meth:`fill` in numpy, the C extension's arithmetic op for op."""
        k = np.arange(pos.shape[2], dtype=np.int64)
        used = k < self.xsize[rows][:, :, None]
        j = self.xmin[rows][:, :, None] + k
        w = 1.0 - np.abs((j - self.center[rows][:, :, None] + 0.5) * self.invscale[rows][:, None, None])
        w = np.where(used, np.maximum(w, 0.0), 0.0)
        total = w[:, :, 0].copy()
        for tap in range(1, w.shape[2]):  # in order, as torch sums them
            total += w[:, :, tap]
        w = w / np.where(total > 0.0, total, 1.0)[:, :, None]
        at = self.src0[rows][:, None, None] + j
        inside = (at >= self.m0[rows][:, None, None]) & (at < self.m1[rows][:, None, None])
        weights[...] = w * inside * self.valid[rows][:, :, None]
        clipped = np.minimum(np.maximum(at, 0), (self.size[rows] - 1)[:, None, None])
        np.add(np.where(used, clipped, clipped[:, :, :1]), shift[:, None, None], out=pos)


USE_C_TAPS = True  # the resize's plan from the C extension where it is built (tests compare both ways)


def plan_extension_built() -> bool:
    """Whether the C extension ``fastload._resample`` (built from this source) plans the resizes."""
    return _c_resample is not None


class GeometryPlan:
    """Pending geometry for a batch: ``execute()`` produces the NCHW result in one pass."""

    def __init__(self, images: Images) -> None:
        heights, widths = image_sizes(images)
        if isinstance(images, PackedImages):
            if len(images) == 0:
                raise ValueError("images should hold at least one image, but got an empty PackedImages")
        elif not isinstance(images, torch.Tensor):
            if len(images) == 0:
                raise ValueError(
                    "images should be a non-empty list of (C, H, W) tensors, but got an empty list"
                )
            first = images[0]
            for k, t in enumerate(images):
                if t.shape[0] != first.shape[0] or t.dtype != first.dtype or t.device != first.device:
                    raise ValueError(
                        "images should share channels, dtype and device, but images[0] is "
                        f"{tuple(first.shape)} {first.dtype} on {first.device} and images[{k}] is "
                        f"{tuple(t.shape)} {t.dtype} on {t.device}"
                    )
        self.images = images
        # An empty batch is planned as one virtual image, so that the output shape is known.
        self.empty = len(heights) == 0
        if self.empty:
            heights, widths = np.array([images.shape[2]]), np.array([images.shape[3]])  # type: ignore[union-attr]
        self.n = len(heights)
        self.y = _Axis(heights)
        self.x = _Axis(widths)
        self.flip = np.zeros(self.n, dtype=bool)
        self.random_geometry = False
        self.antialias = True

    def draw(self, indices: Indices, epoch: int, seed: int, stream: int, draws: int) -> np.ndarray:
        """``(n, draws)`` uniforms for the images of this plan."""
        if self.empty:
            uniforms(0, indices, epoch, seed, stream, draws)  # validates indices
            return np.zeros((1, draws))
        return uniforms(self.n, indices, epoch, seed, stream, draws)

    @property
    def resampled(self) -> bool:
        return self.y.resampled or self.x.resampled

    def sizes(self) -> tuple[np.ndarray, np.ndarray]:
        """Current per-image ``(heights, widths)``."""
        return self.y.winlen, self.x.winlen

    def crop(self, top: np.ndarray, left: np.ndarray, height: np.ndarray, width: np.ndarray) -> None:
        # A crop of a flipped image is the mirrored crop of the unflipped one, then flipped.
        left = np.where(self.flip, self.x.winlen - left - width, left)
        self.y.crop(
            np.asarray(top, dtype=np.int64), np.broadcast_to(np.asarray(height, dtype=np.int64), (self.n,))
        )
        self.x.crop(
            np.asarray(left, dtype=np.int64), np.broadcast_to(np.asarray(width, dtype=np.int64), (self.n,))
        )

    def resize(self, height: np.ndarray, width: np.ndarray, antialias: bool) -> None:
        """Resamples the current image (only valid while ``not self.resampled``)."""
        if not self.empty:
            refuse_empty(self.y.winlen, self.x.winlen, "it cannot be resized")
        for axis, new in ((self.y, height), (self.x, width)):
            new = np.broadcast_to(np.asarray(new, dtype=np.int64), (self.n,)).copy()
            if not (new == axis.winlen).all():  # resizing to the same size is the identity
                axis.resize(new)
                self.antialias = antialias

    def execute(self) -> torch.Tensor:
        images = self.images
        heights, widths = self.sizes()
        if not ((heights == heights[0]).all() and (widths == widths[0]).all()):
            pairs = sorted({(int(h), int(w)) for h, w in zip(heights, widths, strict=False)})
            raise ValueError(
                f"a batch needs one output size, but these transforms give per-image sizes {pairs[:4]}"
                f"{' ...' if len(pairs) > 4 else ''}; resize to a fixed (h, w), or follow Resize(int) "
                "with CenterCrop inside one Compose"
            )
        if isinstance(images, torch.Tensor):
            if self.empty:
                return images.new_empty((0, images.shape[1], int(heights[0]), int(widths[0])))
            if not self.random_geometry and self.y.uniform() and self.x.uniform():
                fast = self._execute_uniform(images)
                if fast is not None:
                    return fast
        return self._execute_general()

    def _execute_uniform(self, images: torch.Tensor) -> torch.Tensor | None:
        """Same geometry for every image and no padding: slices plus torchvision's batched resize."""
        for axis in (self.y, self.x):
            if axis.resampled:
                if axis.src0[0] < axis.m0[0] or axis.src0[0] + axis.srclen[0] > axis.m1[0]:
                    return None
            if axis.win0[0] < axis.lo[0] or axis.win0[0] + axis.winlen[0] > axis.hi[0]:
                return None
        out = images
        for dim, axis in ((2, self.y), (3, self.x)):
            start, length = (
                (axis.src0[0], axis.srclen[0]) if axis.resampled else (axis.win0[0], axis.winlen[0])
            )
            if start != 0 or length != out.shape[dim]:
                out = out.narrow(dim, int(start), int(length))
        if self.resampled:
            # on first use (a flip or a crop alone does not need torchvision: seconds of imports)
            from torchvision.transforms.v2 import functional as tvf

            size = [
                int(self.y.reslen[0]) if self.y.resampled else out.shape[2],
                int(self.x.reslen[0]) if self.x.resampled else out.shape[3],
            ]
            out = tvf.resize(out, size, antialias=self.antialias)
            for dim, axis in ((2, self.y), (3, self.x)):
                if axis.resampled and (axis.win0[0] != 0 or axis.winlen[0] != out.shape[dim]):
                    out = out.narrow(dim, int(axis.win0[0]), int(axis.winlen[0]))
        if self.flip.any():
            mask = small_to_device(self.flip, out.device).view(-1, 1, 1, 1)
            out = torch.where(mask, out.flip(-1), out)
        return out

    def _execute_general(self) -> torch.Tensor:
        images = self.images
        n = self.n
        if isinstance(images, PackedImages):
            first, channels = images.flat, images.channels
        elif isinstance(images, torch.Tensor):
            first, channels = images, images.shape[1]
        else:
            first, channels = images[0], images[0].shape[0]
        device, dtype = first.device, first.dtype
        compute = torch.float64 if dtype == torch.float64 else torch.float32
        taps_y = self.y.taps(None, self.antialias)
        taps_x = self.x.taps(self.flip, self.antialias)
        out_h, out_w = int(self.y.winlen[0]), int(self.x.winlen[0])
        out = torch.empty((n, channels, out_h, out_w), dtype=dtype, device=device)
        if out_h == 0 or out_w == 0:
            return out

        # the source rectangle each image needs
        lo_y, hi_y = taps_y.bounds()
        lo_x, hi_x = taps_x.bounds()
        span_y, span_x = hi_y - lo_y + 1, hi_x - lo_x + 1
        heights, widths = self.y.size, self.x.size

        # One flat buffer holds every image; row windows of it are views (unfold).
        if isinstance(images, torch.Tensor):
            flat = images.contiguous().view(-1)
            offsets = np.arange(n, dtype=np.int64) * (channels * heights * widths)
        elif isinstance(images, PackedImages):
            flat, offsets = images.flat, images.offsets
            # padding: a window that starts in a narrow image may run past the buffer's end (a
            # region decoder leaves room for it: no copy then)
            reach = int((offsets + channels * heights * widths).max()) + int(span_x.max())
            if flat.numel() < reach:
                flat = torch.cat([flat, flat.new_zeros(reach - flat.numel())])
        else:
            numels = np.array([t.numel() for t in images], dtype=np.int64)
            offsets = np.concatenate([[0], np.cumsum(numels)[:-1]]).astype(np.int64)
            # padding: a window that starts in a narrow image may run past its end
            flat = torch.cat([t.reshape(-1) for t in images] + [first.new_zeros(int(span_x.max()))])

        # Every group's plan (table rows, taps, weights, places) goes into one int64 and one float
        # array, two copies to the device: a few torch calls per group, no Python per image.
        groups = _group_by_extent(span_y, span_x, rows_out=out_h)
        np_compute = np.float64 if compute == torch.float64 else np.float32
        many = len(groups) > 1
        plans = []
        int_sizes: list[int] = []  # per group: table rows, bags and offsets of each pass[, images]
        float_sizes: list[int] = []  # per group: the weights of each pass
        for rows in groups:
            n_g, rx = len(rows), int(span_x[rows].max())
            ky, kx = taps_y.width(rows), taps_x.width(rows)
            plans.append((rows, rx, ky, kx))
            int_sizes += [int(span_y[rows].sum()) * channels, n_g * out_h * ky, n_g * out_h]
            int_sizes += [n_g * out_w * kx, n_g * out_w] + ([n_g] if many else [])
            float_sizes += [n_g * out_h * ky, n_g * out_w * kx]
        ints = np.empty(sum(int_sizes), dtype=np.int64)
        floats = np.empty(sum(float_sizes), dtype=np_compute)
        int_parts = np.split(ints, np.cumsum(int_sizes)[:-1])
        float_parts = np.split(floats, np.cumsum(float_sizes)[:-1])
        per_group = 6 if many else 5
        for g, (rows, rx, ky, kx) in enumerate(plans):
            n_g, ry = len(rows), span_y[rows]
            oy = lo_y[rows]  # each image's own rows (its taps' bounds are inside it)
            ox = np.clip(lo_x[rows], 0, np.maximum(widths[rows] - rx, 0))
            picks, bags_y, offsets_y, bags_x, offsets_x = int_parts[per_group * g : per_group * g + 5]
            _region_rows(offsets[rows], heights[rows], widths[rows], channels, ry, oy, ox, picks)
            first_row = np.zeros(n_g, dtype=np.int64)  # each image's first row of the group's table
            np.cumsum(ry[:-1], out=first_row[1:])
            w_y, w_x = float_parts[2 * g], float_parts[2 * g + 1]
            taps_y.fill(rows, first_row - oy, bags_y.reshape(n_g, out_h, ky), w_y.reshape(n_g, out_h, ky))
            columns = np.arange(n_g, dtype=np.int64) * rx  # each image's first column after the transpose
            taps_x.fill(rows, columns - ox, bags_x.reshape(n_g, out_w, kx), w_x.reshape(n_g, out_w, kx))
            np.multiply(np.arange(len(offsets_y), dtype=np.int64), ky, out=offsets_y)  # where each bag starts
            np.multiply(np.arange(len(offsets_x), dtype=np.int64), kx, out=offsets_x)
            if many:
                int_parts[per_group * g + 5][:] = rows
        ints_there = small_to_device(ints, device).split(int_sizes)
        floats_there = small_to_device(floats, device).split(float_sizes)
        for g, (_, rx, _, _) in enumerate(plans):
            picks, bags_y, offsets_y, bags_x, offsets_x = ints_there[per_group * g : per_group * g + 5]
            result = _resample(
                flat,
                channels,
                rx,
                picks,
                (bags_y, offsets_y, floats_there[2 * g]),
                (bags_x, offsets_x, floats_there[2 * g + 1]),
                out_h,
                out_w,
            )
            if not dtype.is_floating_point:
                info = torch.iinfo(dtype)
                result = result.round_().clamp_(info.min, info.max)
            if not many:
                out.copy_(result)
            else:
                out.index_copy_(0, ints_there[per_group * g + 5], result.to(dtype))
        return out


def _group_by_extent(
    span_y: np.ndarray, span_x: np.ndarray, waste: float = 1.5, rows_out: int = 0
) -> list[np.ndarray]:
    """The fewest groups whose resampling buffers (source rows plus ``rows_out``, as wide as the
    group's widest) cost at most ``waste`` times the batch's own; of those, the cheapest split.
    E.g. spans 300x300 (x63) and 3000x4000 (x1): two groups."""
    rows = (span_y + rows_out).astype(np.float64)
    order = np.argsort(-span_x, kind="stable")
    ys, xs = np.ascontiguousarray(rows[order]), np.ascontiguousarray(span_x[order], dtype=np.float64)
    starts = np.empty(len(order), dtype=np.int64)
    if _c_resample is not None and USE_C_TAPS:
        count = _c_resample.fewest_groups(ys, xs, float(waste), starts)
    else:
        count = _fewest_groups(ys, xs, waste, starts)
    bounds = [*starts[:count].tolist(), len(order)]
    return [np.sort(order[a:b]).astype(np.int64) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def _fewest_groups(ys: np.ndarray, xs: np.ndarray, waste: float, starts: np.ndarray) -> int:
    """:func:`_group_by_extent`'s split (images widest first): each run's first image into
    ``starts``; returns the number of runs. Exact in float64, as the C extension's ``fewest_groups``."""
    n = len(ys)
    if n == 0:
        return 0
    total = np.zeros(n + 1)
    np.cumsum(ys, out=total[1:])
    bound = waste * float(np.cumsum(ys * xs)[-1])
    cost = xs[0] * total[1:]  # cost[j]: images 0..j in one run
    picks: list[np.ndarray] = []
    first = np.arange(1, n)[:, None]  # the last run's first image
    last = np.arange(n)[None, :]
    while cost[-1] > bound and len(picks) < n - 1:
        # one run more: images 0..j as the best split of 0..i-1 (one run fewer) plus the run i..j
        runs = cost[:-1, None] + xs[1:, None] * (total[None, 1:] - total[1:-1, None])
        runs = np.where(first <= last, runs, np.inf)
        pick = np.argmin(runs, axis=0)
        cost = runs[pick, np.arange(n)]
        picks.append(pick + 1)
    count, end = len(picks) + 1, n - 1
    for k, pick in enumerate(reversed(picks)):
        starts[count - 1 - k] = int(pick[end])
        end = int(pick[end]) - 1
    starts[0] = 0
    return count


def _region_rows(
    offsets: np.ndarray,
    heights: np.ndarray,
    widths: np.ndarray,
    channels: int,
    ry: np.ndarray,
    oy: np.ndarray,
    ox: np.ndarray,
    out: np.ndarray,
) -> None:
    """Where each row of a group's resampling table starts in the flat buffer, into ``out``: image
    ``r``'s ``ry[r]`` rows from ``(oy[r], ox[r])``, each row's channels one after the other."""
    args = [np.ascontiguousarray(a, dtype=np.int64) for a in (offsets, heights, widths, ry, oy, ox)]
    if _c_resample is not None and USE_C_TAPS:
        _c_resample.region_rows(*args, out)
        return
    offsets, heights, widths, ry, oy, ox = args
    rows = int(ry.sum())
    image = np.repeat(np.arange(len(ry), dtype=np.int64), ry)
    first = np.zeros(len(ry), dtype=np.int64)
    np.cumsum(ry[:-1], out=first[1:])
    row = np.arange(rows, dtype=np.int64) - first[image]  # each table row's row in its region
    start = offsets[image] + (oy[image] + row) * widths[image] + ox[image]
    plane = (heights * widths)[image]
    np.add(
        start[:, None],
        np.arange(channels, dtype=np.int64)[None, :] * plane[:, None],
        out=out.reshape(rows, channels),
    )


def _resample(
    flat: torch.Tensor,
    channels: int,
    rx: int,
    picks: torch.Tensor,
    taps_y: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    taps_x: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    out_h: int,
    out_w: int,
) -> torch.Tensor:
    """Separable resampling of one group to ``(n, C, out_h, out_w)`` floats: ``picks`` make a table
    of ``C * rx`` values per region row, ``taps_y`` sum its rows, ``taps_x`` the transposed columns."""
    bags_y, starts_y, w_y = taps_y
    bags_x, starts_x, w_x = taps_x
    n = starts_y.shape[0] // out_h
    table = flat.unfold(0, rx, 1).index_select(0, picks).to(w_y.dtype).view(-1, channels * rx)
    t1 = nnf.embedding_bag(bags_y, table, starts_y, mode="sum", per_sample_weights=w_y)
    # Horizontal pass on the transposed intermediate, whose rows are now (image, column).
    t1 = t1.view(n, out_h, channels, rx).permute(0, 3, 2, 1).reshape(n * rx, channels * out_h)
    t2 = nnf.embedding_bag(bags_x, t1, starts_x, mode="sum", per_sample_weights=w_x)
    return t2.view(n, out_w, channels, out_h).permute(0, 2, 3, 1)
