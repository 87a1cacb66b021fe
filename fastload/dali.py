"""Optional NVIDIA DALI backend: DALI decodes, fastload decides what and in which order
(docs/dali.md; DALI's own reader rotates its shards and pads the last batch, DALI issues 1774,
2849, 4319, 5827).

:class:`DALILoader` feeds ``fn.external_source`` one batch at a time from the loop's thread: each
rank's order from :class:`~fastload.sampler.DistributedSampler`, the encoded bytes (a file, or a
dataset's ``get_bytes``, e.g. a tar shard's byte range), and each sample's crop and flip from
``fastload.rng.SampleRNG(seed, epoch, i)`` as ``fastload.transforms`` draws them (never DALI's
seed); the labels are the :class:`~fastload.folder.FolderIndex`'s targets.
Pipelines (``S = size``; ``R = size * 256 // 224``)::

    train: bytes ── decoders.image_slice(box of RandomResizedCrop(S, (0.08, 1), (3/4, 4/3)))
                 ── resize to S x S (antialiased bilinear)
                 ── crop_mirror_normalize(mirror = flip, mean, std) -> float CHW
    val:   bytes ── decoders.image ── resize(ROI = the source region of Resize(R) + CenterCrop(S))
                 ── crop_mirror_normalize(mean, std) -> float CHW

The decoders give RGB, ignore EXIF and upsample chroma as PIL does. Last batch, worked example: 10
validation images on 4 ranks, ``batch_size=2``; for contrast, DALI 2.4's
``fn.readers.file(num_shards=4, pad_last_batch=True)`` with ``DALIGenericIterator(reader_name=...)``::

    rank   DALILoader shard   DALILoader batches   reader, FILL         reader, PARTIAL
    0      [0, 4, 8]          [0, 4], [8]          [0, 1], [1, 1]       [0, 1], []
    1      [1, 5, 9]          [1, 5], [9]          [2, 3], [4, 4]       [2, 3], [4]
    2      [2, 6]             [2, 6]               [5, 6], [6, 6]       [5, 6], []
    3      [3, 7]             [3, 7]               [7, 8], [9, 9]       [7, 8], [9]
    total                     10 samples, once     16 (6 duplicates)    10, with empty batches

In training (``drop_last=True``) every rank gets ``floor(N / W)`` samples and drops its incomplete
last batch. ``import fastload.dali`` never imports DALI.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from . import transforms as T
from ._checks import check_int
from ._epoch import EpochState, Plan
from .decode import DecodeError, open_image
from .device import auto_num_workers, cuda_available, default_device
from .distributed import get_rank, get_world_size
from .folder import FolderIndex
from .rng import SampleRNG, batch_uniform
from .sampler import DistributedSampler, sampler_plan
from .stats import LoaderStats
from .transforms import IMAGENET_MEAN, IMAGENET_STD

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "DALILoader",
    "INSTALL_HINT",
    "dali_unavailable_reason",
    "image_size",
]

INSTALL_HINT = "pip install 'fastload[dali]'"

_STATE_FORMAT = "fastload.DALILoader"


def dali_unavailable_reason() -> str | None:
    """Why DALI cannot be used here (a sentence naming the install command), or ``None``."""
    try:
        import nvidia.dali  # noqa: F401  # optional dependency: imported only when asked about
    except ImportError as e:
        return f"NVIDIA DALI cannot be imported ({e}); install it with {INSTALL_HINT}"
    return None


def _import_dali() -> tuple[Any, Any, Any, Any]:
    """``(fn, types, Pipeline, feed_ndarray)`` from DALI, or ``ImportError`` with the install hint."""
    try:  # optional dependency: imported when a DALILoader is built, never by `import fastload.dali`
        from nvidia.dali import fn, types
        from nvidia.dali.pipeline import Pipeline
        from nvidia.dali.plugin.pytorch import feed_ndarray
    except ImportError as e:
        raise ImportError(
            f"fastload.dali.DALILoader needs NVIDIA DALI, which cannot be imported ({e}). "
            f"Install it with: {INSTALL_HINT}  (that is the CUDA 12 build, nvidia-dali-cuda120; "
            "for CUDA 13 use pip install nvidia-dali-cuda130). The CPU-only pipeline works with either."
        ) from e
    return fn, types, Pipeline, feed_ndarray


def _channel_values(value: Any, name: str, positive: bool) -> tuple[float, float, float]:
    try:
        values = [float(v) for v in value]
    except (TypeError, ValueError):
        raise TypeError(
            f"{name} should be a sequence of 3 numbers (one per RGB channel), but got {name}={value!r}"
        ) from None
    if len(values) == 1:
        values = values * 3
    if len(values) != 3 or not all(math.isfinite(v) for v in values):
        raise ValueError(f"{name} should be 3 finite numbers (one per RGB channel), but got {name}={value!r}")
    if positive and min(values) <= 0:
        raise ValueError(f"{name} should be positive, but got {name}={value!r}")
    return values[0], values[1], values[2]


def _resolve_device(device: Any) -> tuple[torch.device, int | None]:
    """The output device and DALI's ``device_id`` (``None``: CPU-only pipeline)."""
    if device is None:
        device = default_device()
    try:
        dev = torch.device(device)
    except (TypeError, RuntimeError):
        raise ValueError(f"device should be 'cpu', 'cuda' or 'cuda:N', but got device={device!r}") from None
    if dev.type == "cpu":
        return dev, None
    if dev.type != "cuda":
        raise ValueError(f"device should be 'cpu', 'cuda' or 'cuda:N', but got device={device!r}")
    if not cuda_available():
        raise ValueError(
            f"device={device!r} needs CUDA, but torch.cuda.is_available() is False; pass device='cpu'"
        )
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return torch.device("cuda", index), index


def _val_box(height: int, width: int, resize: int, size: int) -> tuple[float, float, float, float]:
    """``(y0, x0, y1, x1)``: the source region ``Resize(resize)`` + ``CenterCrop(size)`` keeps."""
    if width <= height:
        rw, rh = resize, int(resize * height / width)
    else:
        rh, rw = resize, int(resize * width / height)
    top = int(round((rh - size) / 2.0))
    left = int(round((rw - size) / 2.0))
    sy, sx = height / rh, width / rw
    return top * sy, left * sx, (top + size) * sy, (left + size) * sx


_SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # DHT, JPG and DAC are not frames
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def image_size(data: bytes | memoryview) -> tuple[int, int] | None:
    """``(height, width)`` of a JPEG or PNG from its header; ``None`` (ask PIL) for other formats, a
    truncated or malformed header, or a JPEG whose height comes later in a DNL marker.

    Example:
        >>> import io; from PIL import Image
        >>> buf = io.BytesIO(); Image.new("L", (5, 3)).save(buf, "JPEG")
        >>> image_size(buf.getvalue())
        (3, 5)
    """
    n = len(data)
    if data[:8] == _PNG_SIGNATURE:
        if n < 24 or data[12:16] != b"IHDR":
            return None
        w, h = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
        return (h, w) if h and w else None
    if data[:2] != b"\xff\xd8":
        return None
    i = 2
    while i + 4 <= n:
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # markers without a length
            i += 2
            continue
        if marker in _SOF_MARKERS:
            if i + 9 > n:
                return None
            h = (data[i + 5] << 8) | data[i + 6]
            w = (data[i + 7] << 8) | data[i + 8]
            return (h, w) if h and w else None
        if marker == 0xD9 or marker == 0xDA:  # end of image, or scan data before any frame
            return None
        i += 2 + ((data[i + 2] << 8) | data[i + 3])
    return None


# RandomResizedCrop draws 2 numbers per attempt (10 attempts) and 2 for the position, then the flip 1.
_MAX_TRAIN_DRAWS = 10 * 2 + 2 + 1


class _Draws(SampleRNG):
    """A :class:`~fastload.rng.SampleRNG` replaying draws computed in advance (a row of ``batch_uniform``)."""

    __slots__ = ("_row", "_pos")

    def __init__(self, row: np.ndarray) -> None:  # no key: the draws are given
        self._row = row
        self._pos = 0

    def random(self) -> float:
        pos = self._pos
        self._pos = pos + 1
        return float(self._row[pos])


def _samples(data: Any) -> tuple[FolderIndex, Callable[[int], bytes | memoryview], Callable[[int], str]]:
    """``(index, read, describe)``: the samples of a :class:`~fastload.folder.FolderIndex` (each file
    read by path) or of a dataset with ``index`` and ``get_bytes(i)`` (:class:`~fastload.TarShards`,
    :class:`~fastload.ImageFolder`, :class:`~fastload.InMemoryImageFolder`), a reader of sample
    ``i``'s encoded bytes, and how messages name it."""
    if isinstance(data, FolderIndex):
        return data, data.read_bytes, lambda i: f"sample {i} ({data.paths[i]!r})"
    index = getattr(data, "index", None)
    if isinstance(index, FolderIndex) and callable(getattr(data, "get_bytes", None)):
        return index, data.get_bytes, getattr(data, "describe", lambda i: f"sample {i} ({index.paths[i]!r})")
    raise TypeError(
        "index should be a fastload.FolderIndex (from scan_folder or scan_list) or a dataset with "
        f"index and get_bytes(i) (such as fastload.TarShards), but got {type(data).__name__}"
    )


class _Feed:
    """The pipeline's external source: each call returns the pass's next batch (from ``pending``);
    ``in_flight``: the batches DALI took, in call order (the order it returns them)."""

    def __init__(self, data: Any, train: bool, size: int, resize: int, seed: int) -> None:
        self.index, self.read, self.describe = _samples(data)
        self.train = train
        self.size = size
        self.resize = resize
        self.seed = seed
        self.crop = T.RandomResizedCrop(size)  # scale (0.08, 1), ratio (3/4, 4/3)
        self.flip = T.RandomHorizontalFlip(0.5)
        self.epoch = 0
        self.pending: deque[np.ndarray] = deque()
        self.in_flight: deque[np.ndarray] = deque()

    def start(self, epoch: int, batches: Sequence[np.ndarray]) -> None:
        self.epoch = epoch
        self.pending = deque(batches)
        self.in_flight.clear()

    def stop(self) -> None:
        """The next call ends the pass (DALI then only returns what it already took)."""
        self.pending.clear()

    def __call__(self) -> tuple[Any, ...]:
        if not self.pending:
            raise StopIteration
        batch = self.pending.popleft()
        out = self._train_inputs(batch) if self.train else self._val_inputs(batch)
        self.in_flight.append(batch)
        return out

    def _header(self, i: int, raw: bytes | memoryview) -> tuple[int, int]:
        size = image_size(raw)
        if size is not None:
            return size
        # other formats, or a header the fast path does not follow: PIL reads it
        width, height = open_image(raw, self.describe(i)).size
        return height, width

    def _train_inputs(self, batch: np.ndarray) -> tuple[Any, ...]:
        n = len(batch)
        data = []
        anchor = np.empty((n, 2), dtype=np.int32)  # (x, y): DALI's "WH" axis order
        shape = np.empty((n, 2), dtype=np.int32)
        mirror = np.empty(n, dtype=np.int32)
        # row j: SampleRNG(seed, epoch, batch[j])'s first draws, for the whole batch at once
        draws = batch_uniform(self.seed, self.epoch, batch, 0, _MAX_TRAIN_DRAWS)
        for j, i in enumerate(batch.tolist()):
            raw = self.read(i)
            h, w = self._header(i, raw)
            r = _Draws(draws[j])
            top, left, ch, cw = self.crop.get_params(h, w, r)
            anchor[j] = (left, top)
            shape[j] = (cw, ch)
            mirror[j] = self.flip.get_params(h, w, r)
            data.append(np.frombuffer(raw, dtype=np.uint8))
        return data, anchor, shape, mirror

    def _val_inputs(self, batch: np.ndarray) -> tuple[Any, ...]:
        n = len(batch)
        data = []
        start = np.empty((n, 2), dtype=np.float32)  # (y, x): the resize ROI follows the HW order
        end = np.empty((n, 2), dtype=np.float32)
        for j, i in enumerate(batch.tolist()):
            raw = self.read(i)
            h, w = self._header(i, raw)
            y0, x0, y1, x1 = _val_box(h, w, self.resize, self.size)
            start[j] = (y0, x0)
            end[j] = (y1, x1)
            data.append(np.frombuffer(raw, dtype=np.uint8))
        return data, start, end


class DALILoader:
    """Batches of ``(images, labels)`` decoded by NVIDIA DALI, in fastload's order and shards:
    float32 ``(N, 3, size, size)`` images normalized with ``mean``/``std`` (0..1 scale) and int64
    labels (``index``'s targets), both fresh tensors on ``device``.

    Args:
        index: A :class:`~fastload.folder.FolderIndex` (each file read by path), or a dataset with
            ``index`` and ``get_bytes(i)`` (:class:`~fastload.TarShards`, :class:`~fastload.ImageFolder`,
            :class:`~fastload.InMemoryImageFolder`): DALI decodes what ``get_bytes`` gives, the
            labels are its ``index``'s targets, the order its own (``shuffle_window``); its
            transforms are not used.
        train: ``True``: random-resized crop (scale ``(0.08, 1)``, ratio ``(3/4, 4/3)``) to
            ``size``, random horizontal flip. ``False``: resize the shorter side to
            ``size * 256 // 224`` and center-crop ``size``.
        seed: Of the order, crops and flips; the same on all ranks.
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``; ``None``: the current CUDA device if there
            is one (DALI's ``"mixed"`` decoder), else a CPU-only pipeline.
        num_threads: DALI's CPU threads; ``None``: as ``fastload.DataLoader(num_workers="auto")``.
        num_replicas, rank: ``None``: from :mod:`fastload.distributed`.
        shuffle: ``None``: the same as ``train``.
        drop_last: ``True``: every rank takes ``floor(N / num_replicas)`` samples and drops its
            incomplete last batch; ``False``: every sample once over all ranks. ``None``: ``train``.

    Without DALI it raises ``ImportError`` naming the install command. One pass runs at a time: a
    new ``for`` loop ends the previous one, whose iterator then raises ``RuntimeError``.
    """

    def __init__(
        self,
        index: FolderIndex | Any,
        batch_size: int,
        train: bool = True,
        size: int = 224,
        seed: int = 0,
        device: str | torch.device | None = None,
        num_threads: int | None = None,
        num_replicas: int | None = None,
        rank: int | None = None,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
        *,
        shuffle: bool | None = None,
        drop_last: bool | None = None,
        prefetch_queue_depth: int = 2,
    ) -> None:
        self.index = _samples(index)[0]
        self._data = index
        self.batch_size = check_int(batch_size, "batch_size", low=1, type_error=True)
        self.train = bool(train)
        self.size = check_int(size, "size", low=1, type_error=True)
        self._epochs = EpochState(_STATE_FORMAT, check_int(seed, "seed", type_error=True))
        self.shuffle = self.train if shuffle is None else bool(shuffle)
        self.drop_last = self.train if drop_last is None else bool(drop_last)
        self.prefetch_queue_depth = check_int(
            prefetch_queue_depth, "prefetch_queue_depth", low=1, type_error=True
        )
        self.mean = _channel_values(mean, "mean", positive=False)
        self.std = _channel_values(std, "std", positive=True)
        if num_threads is None:
            num_threads = auto_num_workers()
        self.num_threads = check_int(num_threads, "num_threads", low=1, type_error=True)
        num_replicas = get_world_size() if num_replicas is None else num_replicas
        rank = get_rank() if rank is None else rank
        self.sampler = DistributedSampler(
            index,  # (a dataset's shard-aware order too, as fastload.DataLoader's)
            num_replicas=num_replicas,
            rank=rank,
            shuffle=self.shuffle,
            seed=self._epochs.seed,
            drop_last=self.drop_last,
        )
        self.num_replicas = self.sampler.num_replicas
        self.rank = self.sampler.rank
        self.device, self._device_id = _resolve_device(device)
        self._dali = _import_dali()  # after the argument checks: fail on the environment last
        self.resize_size = self.size * 256 // 224
        self.stats = LoaderStats()
        self._feed = _Feed(index, self.train, self.size, self.resize_size, self._epochs.seed)
        self._pipe: Any = None
        self._active = False  # a pass holds the pipeline (its batches may be in flight)
        self._generation = 0  # bumped when a pass is ended from outside (new pass, close)
        self._active_epoch = 0
        self._active_pass: int | None = None  # the EpochState number of the active pass

    @property
    def seed(self) -> int:
        """The seed of the order and of every crop and flip."""
        return self._epochs.seed

    @property
    def epoch(self) -> int:
        """The epoch of the current (or next) pass."""
        epochs = self._epochs
        return epochs.pass_epoch if epochs.pass_epoch is not None else epochs.epoch

    def __len__(self) -> int:
        """Batches per epoch on this rank."""
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(samples={len(self.index)}, batch_size={self.batch_size}, "
            f"train={self.train}, "
            f"size={self.size}, device={str(self.device)!r}, num_threads={self.num_threads}, "
            f"rank={self.rank}/{self.num_replicas}, shuffle={self.shuffle}, drop_last={self.drop_last}, "
            f"epoch={self.epoch})"
        )

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch of the next pass (else the previous pass's + 1, from 0), as ``DataLoader``."""
        self._epochs.set_epoch(check_int(epoch, "epoch", low=0, type_error=True))

    def indices(self, epoch: int | None = None) -> list[int]:
        """This rank's dataset indices for ``epoch`` (default: the next or current pass's), in batch order."""
        epoch = self.epoch if epoch is None else check_int(epoch, "epoch", low=0, type_error=True)
        order = self.sampler.indices(epoch)
        return order[: len(self) * self.batch_size] if self.drop_last else order

    def state_dict(self) -> dict[str, Any]:
        """Where the loader is: seed, epoch, and how far the consumer got (as ``DataLoader.state_dict``)."""
        return self._epochs.state_dict(self._plan())

    def _plan(self) -> Plan:
        return Plan(
            num_samples=len(self.index),
            batch_size=self.batch_size,
            drop_last=self.drop_last,
            **sampler_plan(self.sampler, self._data, own=True),
        )

    def load_state_dict(self, state: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Resumes from :meth:`state_dict` (of a ``DALILoader`` with any ranks and batch size): the
        next pass yields the rest of the saved epoch's global order, sharded over this loader's ranks.

        Raises:
            fastload.ResumeError: The state is not a ``DALILoader`` state, is for another dataset
                size or order, or has a field out of range.
        """
        self._epochs.load_state_dict(state, self._plan(), len(self))
        self.sampler.seed = self._epochs.seed
        self._feed.seed = self._epochs.seed

    def close(self) -> None:
        """Releases the DALI pipeline and its threads (a later pass builds a new one)."""
        if self._active:
            self._generation += 1
            self._epochs.end_pass(self._active_epoch, self._active_pass)
        self._active = False
        self._pipe = None

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self._run_pass()

    def _epoch_batches(self, epoch: int, start: int = 0) -> list[np.ndarray]:
        """This rank's batches of ``epoch`` from global position ``start`` (a resume)."""
        order = np.asarray(self.sampler.indices(epoch, start), dtype=np.int64)
        b = self.batch_size
        n = len(order) // b * b if self.drop_last else len(order)
        return [order[k : k + b] for k in range(0, n, b)]

    def _build(self) -> Any:
        fn, types, Pipeline, _ = self._dali
        gpu = self._device_id is not None
        pipe = Pipeline(
            batch_size=self.batch_size,
            num_threads=self.num_threads,
            device_id=self._device_id,
            seed=self._epochs.seed & 0x7FFFFFFF,  # no random operator reads it; set for reproducible builds
            prefetch_queue_depth=self.prefetch_queue_depth,
        )
        op_device = "gpu" if gpu else "cpu"
        decode_args = dict(
            device="mixed" if gpu else "cpu",
            output_type=types.RGB,
            adjust_orientation=False,
            jpeg_fancy_upsampling=True,
        )
        resize_args = dict(
            device=op_device, size=[self.size, self.size], interp_type=types.INTERP_LINEAR, antialias=True
        )
        with pipe:
            if self.train:
                data, anchor, shape, mirror = fn.external_source(
                    source=self._feed,
                    num_outputs=4,
                    batch=True,
                    dtype=[types.UINT8, types.INT32, types.INT32, types.INT32],
                    ndim=[1, 1, 1, 0],
                )
                images = fn.decoders.image_slice(
                    data,
                    anchor,
                    shape,
                    axis_names="WH",
                    normalized_anchor=False,
                    normalized_shape=False,
                    **decode_args,
                )
                images = fn.resize(images, **resize_args)
            else:
                data, roi_start, roi_end = fn.external_source(
                    source=self._feed,
                    num_outputs=3,
                    batch=True,
                    dtype=[types.UINT8, types.FLOAT, types.FLOAT],
                    ndim=[1, 1, 1],
                )
                images = fn.decoders.image(data, **decode_args)
                images = fn.resize(images, roi_start=roi_start, roi_end=roi_end, **resize_args)
                mirror = 0
            images = fn.crop_mirror_normalize(
                images,
                device=op_device,
                mirror=mirror,
                dtype=types.FLOAT,
                output_layout="CHW",
                mean=[255.0 * m for m in self.mean],
                std=[255.0 * s for s in self.std],
            )
            pipe.set_outputs(images)
        pipe.build()
        return pipe

    def _end_pass(self, complete: bool) -> None:
        """Returns the pipeline to the start of an epoch (draining what an unfinished pass left)."""
        pipe = self._pipe
        self._active = False
        if pipe is None:
            return
        try:
            if not complete:
                self._feed.stop()
                while True:  # at most prefetch_queue_depth batches were already taken
                    try:
                        pipe.run()
                    except StopIteration:
                        break
            self._feed.in_flight.clear()
            pipe.reset()
        except Exception:  # noqa: BLE001 - a pipeline that fails here is rebuilt by the next pass
            self._pipe = None

    def _to_torch(self, output: Any) -> torch.Tensor:
        feed_ndarray = self._dali[3]
        tensor = output.as_tensor()
        out = torch.empty(tensor.shape(), dtype=torch.float32, device=self.device)
        if self.device.type == "cuda":
            feed_ndarray(tensor, out, cuda_stream=torch.cuda.current_stream(self.device))
        else:
            feed_ndarray(tensor, out)
        return out

    def _failure(self, epoch: int, error: BaseException) -> RuntimeError:
        samples = [self._feed.describe(int(i)) for batch in self._feed.in_flight for i in batch]
        shown = ", ".join(samples[:4]) + (f" and {len(samples) - 4} more" if len(samples) > 4 else "")
        return RuntimeError(
            f"DALI failed in epoch {epoch} on one of the {len(samples)} samples in flight ({shown}): {error}"
        )

    def _run_pass(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self._active:  # an earlier pass is unfinished: end it as if it had been closed
            self._generation += 1
            self._end_pass(complete=False)
            self._epochs.end_pass(self._active_epoch, self._active_pass)
        epoch, resume = self._epochs.begin_pass()
        self._active_pass = pass_id = self._epochs.live_pass
        position = 0 if resume is None else resume.position
        self._epochs.start_at(position, 0)
        done = 0
        if self._pipe is None:
            self._pipe = self._build()
        pipe = self._pipe
        generation = self._generation
        self._feed.start(epoch, self._epoch_batches(epoch, position))
        self._active, self._active_epoch = True, epoch
        self.stats.start()
        complete = False
        try:
            while True:
                t0 = time.perf_counter()
                try:
                    (output,) = pipe.run()
                except StopIteration:
                    complete = True
                    return
                except Exception as e:
                    self._pipe, self._active = None, False  # rebuilt by the next pass
                    if isinstance(e, (OSError, DecodeError)):
                        raise  # fastload's own messages (from reading a file or its header) name the file
                    raise self._failure(epoch, e) from e
                batch = self._feed.in_flight.popleft()
                images = self._to_torch(output)
                if images.shape[0] != len(batch):  # pragma: no cover - would be a DALI ordering bug
                    raise RuntimeError(
                        f"DALI returned {images.shape[0]} images for a batch of {len(batch)} samples"
                    )
                labels = torch.from_numpy(self.index.targets[batch])
                if self.device.type != "cpu":
                    labels = labels.to(self.device, non_blocking=True)
                self.stats.record_batch(len(batch), time.perf_counter() - t0)
                done += 1
                self._epochs.handed_out(epoch, done, pass_id)
                yield images, labels
                if generation != self._generation:
                    raise RuntimeError(
                        "this DALILoader iterator was ended because a new pass over the loader started "
                        "(or close() was called); one DALI pipeline serves one pass at a time"
                    )
        finally:
            self.stats.stop()
            if generation == self._generation:
                if self._active:
                    self._end_pass(complete)
                self._epochs.end_pass(epoch, self._active_pass)
