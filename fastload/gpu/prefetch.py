""":class:`CUDAPrefetcher`: while the model trains on batch ``k``, batch ``k + 1`` is copied to the
device (from pinned memory) and transformed on a side stream (without CUDA: no-op streams).

Stream protocol (``S`` the side stream, made once; ``C`` the consumer's current stream):

1. Preparing batch ``k + 1`` (before batch ``k`` is handed out, inside ``with S``): copy every
   tensor to the device, record an event ("host memory read"), ``S.wait_stream(C)`` (so
   transforms that write reused device memory, e.g. ``Normalize(buffers=2)``, wait for the
   consumer's earlier steps), then run the transforms.
2. Handing out batch ``k``: ``C.wait_stream(S)``, then ``t.record_stream(C)`` for its tensors.
3. Before asking the loader for another batch, the host waits for the event of step 1 of the
   batch just handed out: the loader may then reuse its host memory, as with a synchronous consumer.
"""

from __future__ import annotations

import copy
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from .._checks import check_int
from ..batch import IndexedBatch, iter_tensors
from ..device import default_device, device_is_cuda
from ..stats import LoaderStats
from .base import apply_transform
from .streams import StreamBackend, stream_backend

__all__ = ["CUDAPrefetcher"]


def _map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Applies ``fn`` to every tensor of a nested batch, keeping its structure."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, IndexedBatch):
        return IndexedBatch(
            _map_tensors(batch[0], fn), _map_tensors(batch[1], fn), _map_tensors(batch.indices, fn)
        )
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_map_tensors(x, fn) for x in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(_map_tensors(x, fn) for x in batch)
    if isinstance(batch, Mapping):
        moved = {k: _map_tensors(v, fn) for k, v in batch.items()}
        mapping_type: Any = type(batch)  # a dict subclass, OrderedDict, ...: rebuilt from a dict
        try:
            return mapping_type(moved)
        except TypeError:
            return moved
    return batch


def _image_key(batch: Any) -> Any:
    """Where the images sit in a batch: 0 for sequences, "images"/"image" for dicts, None for a tensor."""
    if isinstance(batch, torch.Tensor):
        return None
    if isinstance(batch, (tuple, list)) and len(batch) > 0:
        return 0
    if isinstance(batch, Mapping):
        for key in ("images", "image"):
            if key in batch:
                return key
    raise TypeError(
        "cannot find the images in a batch of type "
        f"{type(batch).__name__}: expected a tensor, a non-empty tuple/list (images first) "
        "or a dict with an 'images' entry"
    )


def _get_images(batch: Any) -> Any:
    key = _image_key(batch)
    return batch if key is None else batch[key]


def _replace_images(batch: Any, images: Any) -> Any:
    key = _image_key(batch)
    if key is None:
        return images
    if isinstance(batch, IndexedBatch):
        return IndexedBatch(images, batch[1], batch.indices)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        named: Any = batch  # a namedtuple (the hasattr check above)
        return named._replace(**{named._fields[0]: images})
    if isinstance(batch, tuple):
        return type(batch)((images, *batch[1:]))
    if isinstance(batch, list):
        return [images, *batch[1:]]
    out = copy.copy(batch)
    out[key] = images
    return out


def _get_indices(batch: Any) -> Any:
    if isinstance(batch, IndexedBatch):
        return batch.indices
    if isinstance(batch, Mapping) and "indices" in batch:
        return batch["indices"]
    return None


def _count(images: Any) -> int:
    if isinstance(images, torch.Tensor):
        return images.shape[0] if images.ndim > 0 else 1
    return len(images) if hasattr(images, "__len__") else 0


def _int_attr(*owners_and_names: tuple[Any, str]) -> int | None:
    for owner, name in owners_and_names:
        value = getattr(owner, name, None) if owner is not None else None
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


class CUDAPrefetcher:
    """Wraps a loader: copies and transforms batch ``k + 1`` on a side stream while ``k`` is used.

    Every tensor of a batch (tuples, lists, dicts, namedtuples, :class:`~fastload.IndexedBatch`) is
    moved; ``transforms`` apply to the images (element 0, the ``"images"``/``"image"`` entry, or
    the tensor). A :class:`~fastload.gpu.BatchTransform` gets the batch's ``indices`` (``None``:
    torch's global RNG), ``seed`` (``loader.seed``, ``loader.sampler.seed``, else 0) and ``epoch``
    (``loader.epoch``, ``loader.sampler.epoch``, else :meth:`set_epoch`'s), read at each ``iter()``.

    Args:
        loader: Any iterable of batches; CPU tensors in pageable memory are copied synchronously,
            with a one-time warning (``pin_memory=True`` makes the copies asynchronous).
        device: Default: the current CUDA device if available, else the CPU.
        dtype: Of the handed-out images: integer ones scaled to [0, 1] (torchvision's
            ``ToDtype(dtype, scale=True)``), floating ones cast; ``None``: as the transforms return.

    ``len()``, ``dataset``, ``sampler``, ``batch_size``, ``set_epoch`` and ``state_dict`` (as of
    the last batch handed out) pass through to the loader; ``stats`` are measured at the consumer.
    An error for batch ``k`` is raised by its ``next()``; the next goes on if the loader does.

    Example (CPU, ``indices`` from :class:`~fastload.IndexedBatch`):
        >>> import torch
        >>> from fastload import IndexedBatch, gpu
        >>> batches = [IndexedBatch(torch.zeros(2, 3, 8, 8, dtype=torch.uint8), torch.tensor([0, 1]),
        ...                         torch.tensor([4, 5]))]
        >>> p = CUDAPrefetcher(batches, device="cpu", transforms=gpu.Normalize([0.5], [0.5]))
        >>> [(tuple(x.shape), x.dtype, float(x.min())) for x, y in p]
        [((2, 3, 8, 8), torch.float32, -1.0)]
        >>> list(CUDAPrefetcher([], device="cpu"))
        []
    """

    def __init__(
        self,
        loader: Iterable[Any],
        device: torch.device | str | int | None = None,
        transforms: Callable[..., Any] | None = None,
        channels_last: bool = False,
        dtype: torch.dtype | None = torch.float32,
        *,
        backend: StreamBackend | None = None,
    ) -> None:
        if not isinstance(loader, Iterable):
            raise TypeError(
                f"loader should be an iterable of batches, but got loader={type(loader).__name__}"
            )
        if transforms is not None and not callable(transforms):
            raise TypeError(f"transforms should be callable or None, but got transforms={transforms!r}")
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
            raise TypeError(f"dtype should be a floating torch.dtype or None, but got dtype={dtype!r}")
        if device is None:
            device = default_device()
        elif isinstance(device, int):
            device = torch.device("cuda", device)
        else:
            device = torch.device(device)
        if backend is None:
            if device_is_cuda(device) and not torch.cuda.is_available():
                raise ValueError(
                    f"device should be available, but got device={str(device)!r} and CUDA is not available"
                )
            backend = stream_backend(device)
        self.loader = loader
        self.device = device
        self.transforms = transforms
        self.channels_last = bool(channels_last)
        self.dtype = dtype
        self.stats = LoaderStats()  # the stall, measured at the consumer
        self._backend = backend
        self._side: Any = None
        self._side_created = False
        self._epoch = 0
        self._state: Any = None
        self._warned_pageable = False
        self._warned_dtype = False
        self._warnings: list[str] = []  # raised from next()/iter() so that they point at user code

    def _flush_warnings(self, stacklevel: int) -> None:
        while self._warnings:
            warnings.warn(self._warnings.pop(0), stacklevel=stacklevel + 1)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    @property
    def dataset(self) -> Any:
        """The loader's dataset."""
        return self.loader.dataset  # type: ignore[attr-defined]

    @property
    def sampler(self) -> Any:
        """The loader's sampler."""
        return self.loader.sampler  # type: ignore[attr-defined]

    @property
    def batch_size(self) -> Any:
        """The loader's batch size."""
        return self.loader.batch_size  # type: ignore[attr-defined]

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch on the loader (or its sampler) and for the transforms' random streams."""
        epoch = check_int(epoch, "epoch", low=0)
        if hasattr(self.loader, "set_epoch"):
            self.loader.set_epoch(epoch)
        elif hasattr(getattr(self.loader, "sampler", None), "set_epoch"):
            self.loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        self._epoch = epoch

    def state_dict(self) -> Any:
        """The loader's state as of the last batch handed out (see the class docs)."""
        if not hasattr(self.loader, "state_dict"):
            raise AttributeError(f"the wrapped {type(self.loader).__name__} has no state_dict()")
        if self._state is not None:
            return copy.deepcopy(self._state)
        return self.loader.state_dict()

    def load_state_dict(self, state_dict: Any) -> None:
        """Restores the loader's state; the next iteration resumes from it."""
        if not hasattr(self.loader, "load_state_dict"):
            raise AttributeError(f"the wrapped {type(self.loader).__name__} has no load_state_dict()")
        self._state = None
        self.loader.load_state_dict(state_dict)

    def __iter__(self) -> Iterator[Any]:
        iterator = _PrefetchIterator(self)
        self._flush_warnings(stacklevel=2)
        return iterator

    def _keys(self) -> tuple[int, int]:
        sampler = getattr(self.loader, "sampler", None)
        seed = _int_attr((self.loader, "seed"), (sampler, "seed"))
        epoch = _int_attr((self.loader, "epoch"), (sampler, "epoch"))
        return (0 if seed is None else seed), (self._epoch if epoch is None else epoch)

    def _side_stream(self) -> Any:
        if not self._side_created:
            self._side = self._backend.new_stream(self.device)
            self._side_created = True
        return self._side

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        backend = self._backend
        pageable = backend.is_cuda and tensor.device.type == "cpu" and not backend.is_pinned(tensor)
        if pageable and not self._warned_pageable:
            self._warned_pageable = True
            self._warnings.append(
                "CUDAPrefetcher got tensors in pageable memory: the host-to-device copy is synchronous. "
                "Use pin_memory=True in the DataLoader for asynchronous copies."
            )
        return backend.to_device(tensor, self.device)

    def _finish_images(self, images: Any, indices: Any, seed: int, epoch: int) -> Any:
        if self.transforms is not None:
            images = apply_transform(self.transforms, images, indices, epoch, seed)
        if not isinstance(images, torch.Tensor):
            return images
        if self.dtype is not None and images.dtype != self.dtype:
            if images.is_floating_point():
                if self.transforms is not None and not self._warned_dtype:
                    self._warned_dtype = True
                    self._warnings.append(
                        f"transforms returned {images.dtype} images but dtype={self.dtype}; casting them "
                        f"(pass dtype={images.dtype} or dtype=None to keep them)"
                    )
                images = images.to(self.dtype)
            else:
                from torchvision.transforms.v2 import functional as tvf  # on first use

                images = tvf.to_dtype(images, self.dtype, scale=True)
        if self.channels_last and images.ndim == 4:
            images = images.contiguous(memory_format=torch.channels_last)
        return images

    def copy_and_transform(
        self, raw: Any, stream: Any, seed: int, epoch: int, after: Any = None
    ) -> tuple[Any, Any]:
        """Step 1 of the stream protocol, queued on ``stream`` (the current one), the transforms after
        ``after``'s queued work. Returns the batch and the event after which its host memory is read."""
        backend = self._backend
        indices = _get_indices(raw)
        batch = _map_tensors(raw, self._to_device)
        copied = backend.record_event(stream)
        if after is not None:
            backend.wait_stream(stream, after)
        batch = _replace_images(batch, self._finish_images(_get_images(batch), indices, seed, epoch))
        return batch, copied


class _PrefetchIterator:
    """One pass over the loader (the stream protocol: see the module docs)."""

    def __init__(self, owner: CUDAPrefetcher) -> None:
        self._owner = owner
        self._side = owner._side_stream()
        self._seed, self._epoch = owner._keys()
        self._pending: tuple[Any, Any] | None = None
        self._error: BaseException | None = None
        self._snapshots = hasattr(owner.loader, "state_dict")
        owner.stats.start()
        self._it: Iterator[Any] | None = iter(owner.loader)
        self._fetch(owner._backend.current_stream(owner.device))

    def __iter__(self) -> _PrefetchIterator:
        return self

    def _fetch(self, consumer: Any) -> None:
        """Takes the next batch from the loader and issues step 1 for it."""
        owner = self._owner
        if self._it is None:
            return
        try:
            if self._snapshots:
                owner._state = copy.deepcopy(owner.loader.state_dict())  # type: ignore[attr-defined]
            raw = next(self._it)
            with owner._backend.stream_context(self._side):
                self._pending = owner.copy_and_transform(raw, self._side, self._seed, self._epoch, consumer)
        except StopIteration:
            self._it = None
        except Exception as error:  # noqa: BLE001 - re-raised where the batch would have been handed out
            self._error = error  # the loader goes on after it (torch's iterator contract): so do we

    def __next__(self) -> Any:
        owner = self._owner
        backend = owner._backend
        start = time.perf_counter()
        if self._pending is None and self._error is None and self._it is not None:
            self._fetch(backend.current_stream(owner.device))  # the batch after a failed one
        if self._pending is None:
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            owner.stats.stop()
            if self._snapshots and self._it is None:
                owner._state = None  # epoch finished: the live loader state is the right one
            raise StopIteration
        batch, copied = self._pending
        self._pending = None
        consumer = backend.current_stream(owner.device)
        backend.wait_stream(consumer, self._side)
        for tensor in iter_tensors(batch):
            backend.record_stream(tensor, consumer)
        backend.synchronize_event(copied)  # the loader may now reuse this batch's host memory
        self._fetch(consumer)
        owner.stats.record_batch(_count(_get_images(batch)), time.perf_counter() - start)
        owner._flush_warnings(stacklevel=2)
        return batch
