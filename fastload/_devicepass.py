"""The passes that end on the device, each driven by a feeder thread with its own CUDA stream
(:class:`~fastload.gpu.feeder.DeviceFeeder`): ``decode="device"`` (:class:`EncodedPass`),
``decode="hybrid"`` (:class:`HybridPass`) and a host pass's copy and device transforms
(:class:`FedPass`). :mod:`fastload.loader` chooses which runs.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ._engine import Engine, FastPass, SampleNames, split_batches
from .batch import IndexedBatch
from .decode import DecodeError, without_skip_hint
from .gpu import Compose, apply_transform
from .gpu.decode import BatchDecoder, Headers, RegionBatch
from .gpu.feeder import DeviceFeeder
from .gpu.hybrid import HybridSplit, apply_head, region_crop, split_head
from .gpu.memory import host_memory
from .gpu.prefetch import CUDAPrefetcher
from .gpu.streams import pinned_device, stream_backend, use_device
from .memory import InMemoryImageFolder

FEEDER_DEPTH = 2  # finished batches the device feeder keeps ready
READ_TASKS_PER_READER = 4  # per batch: a slow file holds up only its own run of samples


def reads_in_memory(dataset: Any) -> bool:
    """Whether ``dataset.get_bytes`` is fastload's in-memory one (not a subclass's or instance's)."""
    own = InMemoryImageFolder.get_bytes
    return (
        isinstance(dataset, InMemoryImageFolder)
        and type(dataset).get_bytes is own
        and "get_bytes" not in vars(dataset)
    )


def _labels(dataset: Any, indices: np.ndarray) -> torch.Tensor:
    """The samples' ``targets`` (through ``target_transform``, if any) as int64."""
    targets = dataset.targets
    target_transform = getattr(dataset, "target_transform", None)
    if target_transform is None and isinstance(targets, np.ndarray) and targets.dtype.kind in "iu":
        return torch.from_numpy(targets[indices].astype(np.int64))
    picked = [int(targets[int(i)]) for i in indices]
    if target_transform is not None:
        picked = [int(target_transform(t)) for t in picked]
    return torch.tensor(picked, dtype=torch.int64)


def _read_chunk(get_bytes: Any, indices: list[int]) -> list[Any]:
    return [get_bytes(i) for i in indices]


class EncodedPass:
    """decode='device': reader threads (``num_workers``) fetch batch ``k + 2``'s bytes, a decoder
    thread (a stream of its own) decodes batch ``k + 1``, the feeder thread transforms batch ``k``
    after the decode's event. Batch ``k``'s error is raised by its ``next()``; the pass goes on.
    """

    def __init__(
        self,
        loader: Any,
        epoch: int,
        seed: int,
        start: int,
        order: np.ndarray,
        headers: Headers,
        make_decoder: Callable[[torch.device], BatchDecoder],
    ) -> None:
        self.loader = loader
        self.epoch, self.seed = epoch, seed
        # with its index: the threads decode where this thread's "cuda" is (its rank's GPU)
        self.device = pinned_device(loader.device if loader.device is not None else torch.device("cpu"))
        self.batches = split_batches(order, loader.batch_size or 1, loader.drop_last)
        self.make_decoder = make_decoder
        self.readers = ThreadPoolExecutor(
            max_workers=max(1, loader.num_workers), thread_name_prefix="fastload-read"
        )
        self.reads: dict[int, Any] = {}
        self.reads_in_memory = reads_in_memory(loader.dataset)
        self.decoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fastload-device-decode")
        self.decodes: dict[int, Future[tuple[Any, Any]]] = {}  # images (or what _decoded makes), event
        self.backend = stream_backend(self.device)
        self._decode_stream: Any = None
        self.headers = headers
        self.host = host_memory()
        self.pin = bool(loader.pin_memory) and self.host.can_pin()
        self.head_rest: tuple[list[Any], list[Any]] | None = None  # gpu_transforms' head and rest
        with contextlib.suppress(ValueError):
            self.head_rest = split_head(loader.gpu_transforms)
        self.region_crop = None if self.head_rest is None else region_crop(self.head_rest[0])
        self.batch_decoder: BatchDecoder | None = None  # made in the decoder thread
        self._setup(start)
        self.feeder = DeviceFeeder(  # starts its thread: everything _prepare reads is set up
            self._prepare,
            len(self.batches),
            start,
            self.device,
            depth=FEEDER_DEPTH,
            backend=self.backend,
            timeout=loader.timeout,
        )

    def __len__(self) -> int:
        return len(self.batches)

    def _setup(self, start: int) -> None:
        """What a subclass's ``_prepare`` needs, made before the feeder thread starts."""

    def _device_indices(self, k: int) -> np.ndarray:
        return self.batches[k]

    def _read(self, k: int) -> None:
        """Batch ``k``'s bytes asked for: in-memory slices with nothing to check are taken by the
        decoder thread itself, else the readers read runs of samples (a few tasks: hundreds per
        batch would take the training thread's GIL)."""
        if k < len(self.batches) and k not in self.reads:
            dataset: Any = self.loader.dataset  # serves get_bytes (checked in DataLoader.__init__)
            indices = self._device_indices(k)
            if self.reads_in_memory and dataset.slices_only(indices):
                self.reads[k] = indices.tolist()
                return
            tasks = max(1, self.loader.num_workers) * READ_TASKS_PER_READER
            size = max(1, -(-len(indices) // tasks))  # no sample: no task
            wanted = indices.tolist()
            self.reads[k] = [
                self.readers.submit(_read_chunk, dataset.get_bytes, wanted[a : a + size])
                for a in range(0, len(wanted), size)
            ]

    def _encoded(self, k: int) -> Sequence[Any]:
        """Batch ``k``'s bytes in order (or the first read's error); in-memory ones as ``ByteSlices``."""
        read = self.reads.pop(k)
        if read and isinstance(read[0], Future):
            return [data for chunk in read for data in chunk.result()]
        dataset: Any = self.loader.dataset
        return dataset.byte_slices(np.asarray(read, dtype=np.int64))

    def _submit(self, k: int) -> None:
        """Batch ``k``'s bytes asked for, and its decode queued behind the one before."""
        if k < len(self.batches) and k not in self.decodes:
            self._read(k)
            self.decodes[k] = self.decoder.submit(self._decode, k)

    def _decode(self, k: int) -> tuple[Any, Any]:
        """In the decoder thread: batch ``k`` decoded on its stream, and the event after it."""
        backend = self.backend
        if self._decode_stream is None:
            if self.device.type == "cuda":  # a new thread starts on device 0
                use_device(self.device.index or 0)
            self._decode_stream = backend.new_stream(self.device)
        if self.batch_decoder is None:
            self.batch_decoder = self.make_decoder(self.device)
        with backend.stream_context(self._decode_stream):
            indices = self._device_indices(k)
            encoded = self._encoded(k)
            self.headers.see(encoded, indices)
            on_device = self.headers.on_device(indices)
            regions = self._regions(indices, on_device)
            names = SampleNames(self.loader.dataset, indices)
            decoder, stream = self.batch_decoder, self._decode_stream
            images: list[torch.Tensor] | RegionBatch
            if regions is None:
                images = decoder.decode(encoded, names, on_device, None, stream)
            else:  # the boxes, into one buffer where the decoder can (no tensor per image)
                sizes = (self.headers.height[indices], self.headers.width[indices])
                images = decoder.decode_regions(encoded, names, on_device, regions, stream, sizes)
            return self._decoded(images, indices), backend.record_event(self._decode_stream)

    def _regions(
        self, indices: np.ndarray, on_device: list[bool]
    ) -> list[tuple[int, int, int, int] | None] | None:
        """Each device-decoded sample's crop box, drawn from its header's size before decoding, with
        a region decoder and a ``gpu.RandomResizedCrop`` head; else ``None``."""
        crop, decoder = self.region_crop, self.batch_decoder
        if crop is None or decoder is None or not decoder.regions:
            return None
        heights, widths = self.headers.height[indices], self.headers.width[indices]
        sized = np.flatnonzero(np.asarray(on_device, dtype=bool) & (heights > 0))
        boxes = crop.boxes(
            heights[sized], widths[sized], indices=indices[sized], epoch=self.epoch, seed=self.seed
        )
        regions: list[tuple[int, int, int, int] | None] = [None] * len(indices)
        tops, lefts, box_heights, box_widths = (np.asarray(b).tolist() for b in boxes)
        for r, k in enumerate(sized.tolist()):
            regions[k] = (tops[r], lefts[r], box_heights[r], box_widths[r])
        return regions

    def _decoded(self, images: list[torch.Tensor] | RegionBatch, indices: np.ndarray) -> Any:
        """What the decoder thread hands over for a batch's decoded images (here: the images)."""
        return images

    def _transform(self, images: list[torch.Tensor] | RegionBatch, indices: np.ndarray) -> Any:
        """``gpu_transforms`` on a batch's decoded images (on crop regions: the head is a resize)."""
        transforms = self.loader.gpu_transforms
        assert transforms is not None  # decode="device" needs them (checked in DataLoader.__init__)
        if not isinstance(images, RegionBatch):
            return apply_transform(transforms, images, indices, self.epoch, self.seed)
        assert self.head_rest is not None  # regions are decoded only for such a head (see _regions)
        head, rest = self.head_rest
        out = apply_head(head, images, indices, self.epoch, self.seed)
        return apply_transform(Compose(rest), out, indices, self.epoch, self.seed) if rest else out

    def _prepare(self, k: int) -> IndexedBatch:
        """Batch ``k`` on the device: in the feeder thread, on its stream."""
        self._submit(k)
        self._submit(k + 1)  # decoded while this one is transformed
        self._read(k + 2)  # its bytes arrive meanwhile
        images, decoded = self.decodes.pop(k).result()  # batch k's decode error, if any
        backend = self.backend
        stream = backend.current_stream(self.device)
        backend.wait_event(stream, decoded)
        for image in images.tensors() if isinstance(images, RegionBatch) else images:
            backend.record_stream(image, stream)  # made on the decoder's stream, used on this one
        indices = self.batches[k]
        labels, order = _labels(self.loader.dataset, indices), torch.from_numpy(indices)
        if self.pin:
            labels, order = self.host.pin(labels), self.host.pin(order)
        labels, order = (t.to(self.device, non_blocking=self.pin) for t in (labels, order))
        images = self._transform(images, indices)
        return IndexedBatch(images, labels, order)

    def __next__(self) -> IndexedBatch:
        try:
            return next(self.feeder)
        except DecodeError as error:  # its advice without on_error='skip', which these paths refuse
            if error.args and isinstance(error.args[0], str):
                error.args = (without_skip_hint(error.args[0]), *error.args[1:])
            raise

    def close(self) -> None:
        self.feeder.close()
        self.decoder.shutdown(wait=False, cancel_futures=True)
        self.readers.shutdown(wait=False, cancel_futures=True)
        self.decodes.clear()  # a batch decoded ahead: its device memory goes now, not with the pass
        self.reads.clear()


class Shares(Sequence[np.ndarray]):
    """``decode="hybrid"``: the CPU workers' share (last positions) of each batch, decided when first
    asked for; indexed like the batches, for the CPU side's fast pass."""

    def __init__(self, batches: list[np.ndarray], split: HybridSplit, workers: int) -> None:
        self.batches, self.split, self.workers = batches, split, workers
        self.device_counts: dict[int, int] = {}

    def device_count(self, k: int) -> int:
        """How many of batch ``k``'s first samples the device decodes."""
        d = self.device_counts.get(k)
        if d is None:
            n = len(self.batches[k])
            d = self.device_counts[k] = n - self.split.cpu_images(n, self.workers)
        return d

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, k: Any) -> Any:  # int: np.ndarray; slice: a list
        if isinstance(k, slice):
            return [self[j] for j in range(*k.indices(len(self)))]
        return self.batches[k][self.device_count(k) :]


@dataclass
class HybridParts:
    """``decode="hybrid"``'s parts, made once per loader (``dataset``: the CPU workers')."""

    split: HybridSplit
    head: list[Any]
    rest: list[Any]
    dataset: Any


class HybridPass(EncodedPass):
    """decode='hybrid': the decoder thread decodes and crops the first ``d`` samples of a batch, the
    fast path's workers the rest (:class:`Shares`) into pinned slots; the feeder thread joins them
    on the device and runs the rest of ``gpu_transforms``. Each side's rate updates the split. An
    error of either share (the device's first) is raised by its batch's ``next()``.
    """

    def __init__(
        self,
        loader: Any,
        engine: Engine,
        epoch: int,
        seed: int,
        start: int,
        order: np.ndarray,
        headers: Headers,
        make_decoder: Callable[[torch.device], BatchDecoder],
        hybrid: HybridParts,
    ) -> None:
        self.engine = engine
        self.parts = hybrid
        super().__init__(loader, epoch, seed, start, order, headers, make_decoder)

    def _setup(self, start: int) -> None:
        loader, parts = self.loader, self.parts
        self.split = parts.split
        self.rest = Compose(parts.rest) if parts.rest else None
        self.shares = Shares(self.batches, parts.split, loader.num_workers)
        self.cpu: FastPass | None = None
        self.generation: int | None = None
        if loader.num_workers > 0:
            self.cpu = FastPass(
                loader, self.engine, self.epoch, start, self.seed, self.shares, parts.dataset, lookahead=False
            )
            self.generation = self.cpu.generation
        self._held: tuple[Any, Any] | None = None  # (copy event, the CPU share it reads)
        self._handed: tuple[int, float] | None = None  # (images, when) of the last batch handed out

    def _device_indices(self, k: int) -> np.ndarray:
        return self.batches[k][: self.shares.device_count(k)]

    def _submit(self, k: int) -> None:
        if k < len(self.batches) and k not in self.decodes:
            self.shares.device_count(k)  # decided in this (the feeder) thread, before the decoder reads it
            super()._submit(k)

    def _decode(self, k: int) -> tuple[Any, Any]:
        """The device's share of batch ``k`` decoded and cropped, its time recorded (the device's rate)."""
        if len(self._device_indices(k)) == 0:
            self.reads.pop(k, None)
            return None, None
        t0 = time.perf_counter()
        images, event = super()._decode(k)
        self.backend.synchronize_event(event)  # only this thread waits: the rate includes the device's time
        self.split.record_device(len(images), time.perf_counter() - t0)
        return images, event

    def _decoded(self, images: list[torch.Tensor] | RegionBatch, indices: np.ndarray) -> Any:
        out = apply_head(self.parts.head, images, indices, self.epoch, self.seed)
        return out.contiguous(memory_format=torch.channels_last)

    def _prepare(self, k: int) -> IndexedBatch:
        backend = self.backend
        if self._held is not None:
            backend.synchronize_event(self._held[0])  # the last CPU share is copied: its slot goes back
            self._held = None
        self._submit(k)
        self._submit(k + 1)
        self._read(k + 2)
        cpu: IndexedBatch | None = None
        cpu_error: BaseException | None = None
        if self.cpu is not None:
            try:
                cpu = next(self.cpu)  # the workers' share of batch k (possibly no sample)
            except BaseException as e:  # noqa: BLE001 - raised below, after the device's share of k is taken
                cpu_error = e
                self.cpu.skip(k)  # an error not of batch k's own (a timeout): its share is given up too
        device_images, decoded = self.decodes.pop(k).result()  # the device share's error first
        if cpu_error is not None:
            raise cpu_error
        dataset: Any = self.loader.dataset
        indices = self.batches[k]
        d = self.shares.device_count(k)
        stream = backend.current_stream(self.device)
        parts: list[torch.Tensor] = []
        labels = _labels(dataset, indices[:d])
        if device_images is not None:
            backend.wait_event(stream, decoded)
            backend.record_stream(device_images, stream)  # made on the decoder's stream, used on this one
            parts.append(device_images)
        if cpu is not None and len(cpu[1]):
            if self.cpu is not None and self.cpu.last_seconds > 0:
                self.split.record_cpu(len(cpu[1]), self.cpu.last_seconds, self.loader.num_workers)
            parts.append(backend.to_device(cpu[0], self.device))  # from its pinned slot
            self._held = (backend.record_event(stream), cpu)
            labels = torch.cat([labels, cpu[1]])
        order = torch.from_numpy(indices)
        if self.pin:
            labels, order = self.host.pin(labels), self.host.pin(order)
        labels, order = backend.to_device(labels, self.device), backend.to_device(order, self.device)
        if len(parts) == 1:
            images = parts[0]
        else:
            images = torch.empty(
                (len(indices), *parts[0].shape[1:]),
                dtype=torch.uint8,
                device=parts[0].device,
                memory_format=torch.channels_last,
            )
            images[:d].copy_(parts[0])
            images[d:].copy_(parts[1])
        if self.rest is not None:
            images = apply_transform(self.rest, images, indices, self.epoch, self.seed)
        return IndexedBatch(images, labels, order)

    def __next__(self) -> IndexedBatch:
        """The next batch; the loop's time since the last one is its demand, which the split follows."""
        called = time.perf_counter()
        last, self._handed = self._handed, None  # a batch that raises is no sample of the loop's time
        if last is not None:
            self.split.record_demand(last[0], called - last[1])
        batch = super().__next__()
        self._handed = (len(batch[1]), time.perf_counter())
        return batch

    def close(self) -> None:
        super().close()
        held, self._held = self._held, None
        if held is not None:
            self.backend.synchronize_event(held[0])  # no worker writes into a slot a copy still reads


class FedPass:
    """A host pass's batches copied and transformed on the device (the prefetcher's
    ``copy_and_transform``) by a feeder thread: the training thread's ``next()`` costs an event
    wait. A batch's host memory goes back to the loader once its copy is made.
    """

    def __init__(
        self, host: Iterator[Any], prefetcher: CUDAPrefetcher, seed: int, epoch: int, timeout: float
    ) -> None:
        self.host = host
        self.prefetcher = prefetcher
        self.seed, self.epoch = seed, epoch
        self._copied: Any = None
        self.feeder = DeviceFeeder(
            self._prepare,
            None,
            0,
            prefetcher.device,
            depth=FEEDER_DEPTH,
            backend=prefetcher._backend,
            timeout=timeout,
        )

    def _prepare(self, k: int) -> Any:
        prefetcher = self.prefetcher
        backend = prefetcher._backend
        if self._copied is not None:
            backend.synchronize_event(self._copied)  # the loader may now reuse that batch's memory
            self._copied = None
        raw = next(self.host)  # StopIteration ends the feeder
        stream = backend.current_stream(prefetcher.device)
        batch, self._copied = prefetcher.copy_and_transform(raw, stream, self.seed, self.epoch)
        return batch

    def __iter__(self) -> FedPass:
        return self

    def __next__(self) -> Any:
        batch = next(self.feeder)
        self.prefetcher._flush_warnings(stacklevel=2)
        return batch

    def close(self) -> None:
        self.feeder.close()
        copied, self._copied = self._copied, None
        if copied is not None:  # the last copy out of host memory, which the loader may free next
            self.prefetcher._backend.synchronize_event(copied)


def reuses_device_memory(transforms: Any) -> bool:
    """Whether ``transforms`` reuse device memory (``gpu.Normalize(buffers=k)``): unsafe far ahead."""
    if transforms is None:
        return False
    if getattr(transforms, "buffers", 0):
        return True
    inner = [getattr(transforms, "then", None), *(getattr(transforms, "transforms", None) or [])]
    return any(reuses_device_memory(t) for t in inner if t is not None and t is not transforms)
