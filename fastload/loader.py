"""``fastload.DataLoader``: torch's DataLoader, with uint8 batches decoded straight into reusable buffers.

A subclass of :class:`torch.utils.data.DataLoader` with the same arguments and semantics. Given a
dataset that serves encoded images (``fastload.ImageFolder``, ``fastload.InMemoryImageFolder``)
and a fastload transform with a fixed output size, it runs its own *fast path*::

    main process                                      worker (process or thread)
    sampler order = f(seed, epoch) ─ batch k ─task─>  for i in batch: bytes = dataset.get_bytes(i)
                                                        with rng.sample_scope(seed, epoch, i):
                                                          transform.decode_into(bytes, slot[k][j])
    yield slot[k] as uint8 NCHW  <────── done ─────   labels[k][j] = targets[i]

The batch buffers (``slots``) are allocated once, in memory shared with the workers, and reused:
no per-sample tensors, no collate, no pickling of pixels. Images come out as a uint8 tensor of
shape ``(N, 3, H, W)`` whose memory is channels-last (``images.is_contiguous(memory_format=
torch.channels_last)``), which is what convolution kernels prefer; labels as int64 ``(N,)``.
Float conversion and normalization happen once per batch on the device (``fastload.gpu``).

**Buffer reuse.** A yielded batch is a view of a slot of the ring. The slot goes back to the
workers only when nothing refers to the batch any more: no tensor, view, ``.numpy()`` array or
autograd reference (a finalizer on the storage of the handed-out tensors says so). The usual
loop (consume, drop) keeps reusing the same few slots; a batch you keep (a list of them, say)
stays intact, and the workers decode into extra buffers meanwhile, as torch's loader would.

**Epoch lookahead.** With persistent workers, once every batch of an epoch has been handed to
the workers, free slots go to the *next* epoch's first batches (when the order is a function of
the epoch), so the workers never idle at an epoch boundary. The next pass uses them only if it is
exactly that epoch from its start; otherwise they are discarded (``epoch_lookahead=False`` turns
this off).

**Workers.** fastload's own workers run the fast path; ``worker_init_fn`` is called in each of
them (process or thread) and each process worker seeds ``random`` and torch with
``seed + worker_id``. ``torch.utils.data.get_worker_info()`` is ``None`` inside them (it is
torch's private machinery); datasets that need it run through torch's iterator anyway (any
dataset without ``get_bytes`` or without a fastload transform).

**Determinism.** The order is a function of ``(seed, epoch)`` and every random augmentation of
sample ``i`` a function of ``(seed, epoch, i)`` (:mod:`fastload.rng`), so the batches are bitwise
the same for any ``num_workers``, for process and thread workers, and after a mid-epoch resume:

    >>> state = loader.state_dict()                 # doctest: +SKIP
    >>> loader2.load_state_dict(state)              # in a new process: the rest of the epoch,
    >>> rest = list(loader2)                        # then the next epochs, as if never stopped

The epoch is the one given to :meth:`DataLoader.set_epoch`; a pass without a ``set_epoch`` call
uses the previous epoch + 1 (starting at 0), so a plain ``for epoch ...: for batch in loader``
also changes the order every epoch, exactly like an explicit ``set_epoch(epoch)``. A pass that is
left early (``break``) also counts as an epoch. ``state_dict()`` taken inside a pass records the
epoch and the batches handed out; taken between passes, it records what the next pass will do.

Any other dataset / ``collate_fn`` / ``batch_sampler`` goes through torch's own iterator (with the
seeded sampler when ``shuffle=True``): a torchvision pipeline that begins with a crop or resize
gets that head fused with decoding (:mod:`fastload.head`, ``loader.path ==
"head-accelerated"``), anything else runs unchanged (``"torch"``).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import logging
import math
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Generic, TypeVar

import numpy as np
import torch
from PIL import Image
from torch.multiprocessing import get_sharing_strategy
from torch.utils.data import (
    IterableDataset,
    IterDataPipe,
    MapDataPipe,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
    default_collate,
)
from torch.utils.data.distributed import DistributedSampler as TorchDistributedSampler

from ._checks import caller_stacklevel, check_choice, check_int, optional_attribute, sample_index
from ._devicepass import FEEDER_DEPTH, EncodedPass, FedPass, HybridPass, reuses_device_memory
from ._engine import SUPERSEDED, Engine, FastPass, SampleKeys, SamplerBatches, predicted_order, split_batches
from ._epoch import DefaultSeed, EpochState, Plan, Resume, ResumeError, base_seed
from ._pool import CLOSED_MIDPASS
from ._position import rest_of_epoch
from ._shm import shm_error
from ._source import changed_attributes, source_key, source_state
from ._stream import MainRing, RingedCollate, ring_supported, ring_table
from ._stream import collate as stream_collate
from ._torchworkers import TorchWorkerInit, pass_seed_cell, reporting_context
from ._workerstart import frozen_heap, ship_dataset
from .device import auto_num_workers, cpu_share, cuda_available
from .distributed import get_rank, get_world_size, ranks_known
from .gpu import BatchTransform, apply_transform
from .gpu.decode import BatchDecoder, Headers, device_decoder
from .gpu.hybrid import DeviceHead, HybridSplit, split_head
from .gpu.memory import host_memory
from .gpu.nvimgcodec import hw_decoder_load
from .gpu.prefetch import CUDAPrefetcher
from .head import head_view
from .recognize import is_image_folder, recognize, worker_view
from .sampler import DistributedSampler, EpochRandomSampler, global_order, sampler_plan
from .stats import LoaderStats
from .transforms import import_decode_modules

__all__ = ["DataLoader", "DataLoaderIterator", "EpochRandomSampler", "auto_num_workers"]

T_co = TypeVar("T_co", covariant=True)

_log = logging.getLogger("fastload")

_STATE_KIND = "fastload.DataLoader"


def _is_fast_dataset(dataset: Any) -> bool:
    transform = optional_attribute(dataset, "transform")
    return (
        callable(optional_attribute(dataset, "get_bytes"))
        and transform is not None
        and callable(getattr(transform, "decode_into", None))
        and getattr(transform, "output_size", None) is not None
    )


def _same_source(a: tuple[Any, ...] | None, b: tuple[Any, ...]) -> bool:
    return a is not None and all(x is y for x, y in zip(a, b, strict=True))


def _structural_reason(loader: DataLoader[Any]) -> str | None:
    """Why the loader's arguments (not its dataset) rule out the fast path, or ``None``."""
    if isinstance(loader.dataset, IterableDataset):
        return "the dataset is an IterableDataset"
    if loader._given_batch_sampler:
        return "a batch_sampler is given"
    if loader.batch_size is None:
        return "batch_size=None (no batching)"
    if loader._given_collate:
        return "a collate_fn is given (the fast path builds its batches itself; default_collate is fine)"
    if _endless(loader.sampler):
        return ENDLESS_SAMPLER
    return None


#: torch's samplers and fastload's, and plain sequences of indices: they run no code of the user's.
_OWN_SAMPLERS = (
    list,
    tuple,
    range,
    np.ndarray,
    SequentialSampler,
    RandomSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
    TorchDistributedSampler,
    DistributedSampler,
    EpochRandomSampler,
)


def _user_code(loader: DataLoader[Any]) -> str | None:
    """What of the user's the loader runs -- a dataset, transform, ``target_transform``,
    ``collate_fn``, sampler or ``worker_init_fn`` of theirs -- or ``None`` where fastload runs every
    op itself: the fast path and ``decode="device"``/``"hybrid"`` over fastload's datasets and
    transforms (a recognised torchvision pipeline included), and head acceleration whose every op
    after the head is one of torchvision's transform classes. The defaults follow it
    (:meth:`DataLoader._apply_defaults`); nothing of the user's code is read to decide."""
    if loader.worker_init_fn is not None:
        return "a worker_init_fn"
    if loader._given_collate:
        return "a collate_fn"
    if loader._given_batch_sampler:
        return "a batch_sampler"
    if type(loader.sampler) not in _OWN_SAMPLERS:
        return f"a sampler of yours ({type(loader.sampler).__name__})"
    path = loader._path
    if path == "torch":
        return f"{type(loader.dataset).__name__}'s own code"
    dataset: Any = (
        loader._head_dataset if path == "head-accelerated" else loader._fast_dataset or loader.dataset
    )
    if optional_attribute(dataset, "target_transform") is not None:
        return "a target_transform"
    if path == "head-accelerated":
        foreign = dataset.transform.foreign_ops
        return f"ops of yours after the head ({', '.join(foreign)})" if foreign else None
    if not type(dataset).__module__.startswith("fastload."):
        return f"a dataset class of yours ({type(dataset).__name__})"
    transform = optional_attribute(dataset, "transform")
    if transform is not None and not type(transform).__module__.startswith("fastload."):
        return f"a transform of yours ({type(transform).__name__})"
    return None


def _torch_checks(
    num_workers: int,
    multiprocessing_context: Any,
    prefetch_factor: int | None,
    persistent_workers: bool | None,
) -> None:
    """torch's checks of the arguments that depend on ``num_workers`` (which fastload's default
    sets only once the path is known), by torch's own ``DataLoader``: its errors, in its words."""
    torch.utils.data.DataLoader(
        [],  # type: ignore[arg-type]
        num_workers=num_workers,
        multiprocessing_context=multiprocessing_context,
        prefetch_factor=prefetch_factor,
        persistent_workers=bool(persistent_workers),
    )


#: Why a sampler without ``__len__`` (an endless one) runs torch's iterator.
ENDLESS_SAMPLER = (
    "the sampler has no len() (an endless sampler): fastload's own paths need each epoch's length "
    "when it starts"
)


def _endless(sampler: Any) -> bool:
    """A sampler without ``__len__`` (torch iterates it as it goes; it may never end)."""
    try:
        len(sampler)
    except TypeError:
        return True
    return False


def _pass_length(loader: DataLoader[Any]) -> int | None:
    """``len(loader)`` as torch computes it (``None`` without one), without calling it for an
    ``IterableDataset``: torch's ``len(loader)`` arms its check that warns when the dataset yields
    more than its ``__len__`` said, which only the user's own call should do."""
    if not isinstance(loader.dataset, IterableDataset):
        try:
            return len(loader)
        except TypeError:  # a sampler or batch_sampler without __len__ (an endless one): torch iterates it
            return None
    try:
        n = len(loader.dataset)  # type: ignore[arg-type]
    except TypeError:  # an IterableDataset without __len__
        return None
    if loader.batch_size is None:
        return n
    return n // loader.batch_size if loader.drop_last else math.ceil(n / loader.batch_size)


def _batch_len(batch: Any) -> int:
    first = batch[0] if isinstance(batch, (tuple, list)) and batch else batch
    if isinstance(first, dict) and first:
        first = next(iter(first.values()))
    try:
        return len(first)
    except Exception:  # noqa: BLE001 - len() of a nested tensor raises RuntimeError: count it as one
        if isinstance(first, torch.Tensor) and first.dim() > 0:
            return int(first.size(0))
        return 1


class _TorchPass:
    """Any other dataset / collate_fn / batch_sampler: torch's own iterator, ``start`` batches in.

    torch's iterator goes on after a batch whose loading raised, and so does this one. With a
    ring (:class:`fastload._stream.MainRing`), each ``next()`` first frees the batch segments
    nothing refers to any more, then notes the segments the new batch came in; the end of the
    pass lets go of the ring's mappings (persistent workers) or of the ring (workers that stop).
    """

    def __init__(
        self,
        torch_iter: Iterator[Any],
        start: int,
        ring: MainRing | None,
        keep_ring: bool,
        own_workers: bool = False,
    ) -> None:
        self.it = torch_iter
        self.own_workers = own_workers  # a pass beside the loop's on persistent workers: its own stop with it
        self.ring = ring  # the reused batch segments of torch's workers (see fastload._stream)
        self.keep_ring = keep_ring  # persistent workers: the ring outlives the pass
        self.ring_pass = None if ring is None else ring.pass_number()
        for _ in range(start):  # resume on torch's path: the skipped batches are still loaded
            next(self)

    def __next__(self) -> Any:
        try:
            return self._next()
        except RuntimeError as e:  # (UnsendableBatchError too) torch's iterator goes on after it
            hint = shm_error(e)  # it did not fit in /dev/shm: say so, with the fix
            if hint is None:
                raise
            raise hint from e

    def _next(self) -> Any:
        if self.ring is None:
            return next(self.it)
        self.ring.poll()
        try:
            batch = next(self.it)
        except StopIteration:
            self.close()
            raise
        self.ring.received(batch)
        return batch

    def close(self) -> None:
        if self.own_workers:
            shutdown = getattr(self.it, "_shutdown_workers", None)
            if callable(shutdown):
                shutdown()
        ring = self.ring
        if ring is None:
            return
        if not self.keep_ring:
            ring.clear()
        elif ring.pass_number() == self.ring_pass:  # not when a later pass uses the ring already
            ring.release()  # the workers stay: they drop what is free when idle


class _OnePass:
    """One host pass as the iterable the prefetcher wraps, with its ``seed`` and ``epoch``."""

    def __init__(self, host: Iterator[Any], seed: int, epoch: int, length: int | None) -> None:
        self._host = host
        self.seed = seed
        self.epoch = epoch
        self._length = length

    def __iter__(self) -> Iterator[Any]:
        return self._host

    def __len__(self) -> int:
        if self._length is None:
            raise TypeError("this pass has no len()")
        return self._length


class _HostIterator:
    """Adapts a pass object (``__next__`` only) to the iterator protocol."""

    def __init__(self, source: Any) -> None:
        self.source = source

    def __iter__(self) -> _HostIterator:
        return self

    def __next__(self) -> Any:
        return next(self.source)


def _workers_live(loader: DataLoader[Any], engine: Any) -> bool:
    """Whether ``loader`` has workers running (kept from an earlier pass): torch's iterator's or
    fastload's engine's."""
    if loader.__dict__.get("_iterator") is not None:
        return True
    pool = engine.pool
    return pool is not None and not pool.closed and pool.num_workers > 0


class _SamplerDraws:
    """One pass's draws of the ``RandomSampler`` torch's loader makes for ``shuffle=True``, where
    :class:`EpochRandomSampler` stands in for it (else none): its seed before its first index
    (without ``generator``), or a ``torch.randperm`` of ``generator`` there and another once its
    indices run out. torch's iterator takes indices a batch at a time ("fetches"): the first one
    draws, and the one after the last batch (the last batch itself, when it is short and kept)
    runs out. Workers fetch ``prefetch_factor * num_workers`` batches as they start and one more
    per batch handed out; without workers, each ``next()`` fetches its own batch."""

    def __init__(self, loader: DataLoader[Any], length: int | None) -> None:
        self._loader = loader
        self._begin = loader._replaces_random_sampler
        self._end = self._begin and loader.generator is not None
        self._fetched = 0
        self._last: int | None = None  # the fetch that runs out of indices (None: unknown)
        if self._end and length is not None:
            size = len(loader.dataset)  # type: ignore[arg-type]
            short_last = bool(loader.batch_size and not loader.drop_last and size % loader.batch_size)
            self._last = length + (0 if short_last else 1)

    def fetch_to(self, fetches: int) -> None:
        """torch's iterator has fetched ``fetches`` batches of indices (or tried to) in this pass."""
        while self._fetched < fetches and (self._begin or self._end):
            self._fetched += 1
            if self._begin:
                self._begin = False
                self._loader._draw_as_torch("sampler")
            if self._end and self._fetched == self._last:
                self.exhausted()

    def exhausted(self) -> None:
        """The sampler ran out of indices (at the latest: the pass's end)."""
        if self._end:
            self._end = False
            self._loader._draw_as_torch("sampler end")


@functools.lru_cache(maxsize=1)
def _torch_pin_memory_warning() -> str | None:
    """What torch's iterator says of ``pin_memory=True`` where no accelerator is found (recent
    torch warns; older torch said nothing): asked of torch's own loader once, with a generator of
    its own (torch's global RNG is not drawn from)."""
    torch_loader = DataLoader.__bases__[0]  # torch's class, even where torch's name was replaced
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        iter(torch_loader([0], pin_memory=True, generator=torch.Generator()))
    said = [str(w.message) for w in caught if "pin_memory" in str(w.message)]
    return said[0] if said else None


def _warn_as_torch_of_pin_memory(loader: DataLoader[Any]) -> None:
    """torch's warning of ``pin_memory=True`` without an accelerator, on fastload's own paths
    (torch's iterator gives it on torch's path), naming the user's line."""
    if loader.pin_memory and not _accelerator_available():
        message = _torch_pin_memory_warning()
        if message is not None:
            warnings.warn(message, stacklevel=caller_stacklevel())


def _accelerator_available() -> bool:
    """Whether fastload can pin memory (CUDA, or a test's stand-in for it: see
    :func:`fastload.gpu.streams.simulate_cuda`), or torch finds another accelerator
    (``torch.accelerator``, torch >= 2.6)."""
    if host_memory().can_pin():
        return True
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "is_available"):
        return bool(accelerator.is_available())
    return False


class DataLoaderIterator:
    """What ``iter(fastload.DataLoader)`` returns: one pass over the loader (torch's iterator contract).

    - ``next()`` returns the next batch, or raises the error of loading it -- a corrupt image,
      an exception in the dataset -- with the worker and the original traceback; the following
      ``next()`` goes on with the batch after it, as torch's iterator does.
    - It counts the batches handed to the consumer (``loader.state_dict()`` inside the pass),
      records ``loader.stats`` at the consumer, and ends the pass (the next pass is the next
      epoch) when it is exhausted, when :meth:`close` is called, or when it is dropped.
    - Without persistent workers, the workers of the pass stop at its end.
    - The few attributes of torch's iterator that tools and tests read: ``_workers`` (the worker
      processes: torch's on its iterator, fastload's own on the fast path; thread workers are
      ``threading.Thread`` objects), ``_pin_memory_thread`` (torch's iterator only: fastload's
      engine pins its batch buffers in place, with no thread) and ``_shutdown_workers()`` (stops
      the workers, persistent ones too). Where torch's iterator has no such attribute
      (``num_workers=0``), neither has this one.

    Attributes:
        epoch: The epoch of this pass.
        seed: The seed of its order and augmentations.
    """

    def __init__(self, loader: DataLoader[Any], engine: Engine, own_engine: bool = False) -> None:
        self._loader = loader
        self._engine = engine
        self._own_engine = own_engine  # workers of its own (a pass beside a live one), stopped with it
        self._closed_by_loader = False
        self._epochs = loader._epochs
        loader._take_sampler_epoch()
        self.seed = self._epochs.pass_seed()  # before the pass draws torch's base seed
        self.epoch, resume = self._epochs.begin_pass()
        self._pass_id = self._epochs.live_pass
        self._ended = False
        self._generation: int | None = None
        self._hold: int | None = None  # this pass's hold on torch's thread count (limit_threads)
        self._own_torch_workers = False  # torch's iterator with workers of its own, beside the loop's
        if loader._own_sampler or self._epochs.epoch_set:
            _set_sampler_epoch(loader.sampler, self.epoch)
        start, rest = loader._resume_pass(self.epoch, resume)
        self._done = start
        self._rest: np.ndarray | None = None
        self._length: int | None = _pass_length(loader)
        if rest is not None:
            batch_size = loader.batch_size or 1
            self._length = len(rest) // batch_size if loader.drop_last else -(-len(rest) // batch_size)
        elif self._length is not None:
            self._length = max(0, self._length - start)  # len(): the batches this pass yields
        loader._rest = self._rest = rest  # until the pass ends
        self._start = start
        self._draws = _SamplerDraws(loader, self._length)  # torch's RandomSampler's, by index fetch
        self.stats = loader.stats
        self.stats.start()
        loader._refresh_path()
        try:
            source: Any
            if loader.decode != "cpu" or loader.fast_path:
                _warn_as_torch_of_pin_memory(loader)
                loader._draw_as_torch("iterator")  # torch's iterator would draw its base seed
            if loader.decode != "cpu" and _endless(loader.sampler):
                raise ValueError(
                    f"decode={loader.decode!r} needs a sampler with a len(): {ENDLESS_SAMPLER}. Pass "
                    "a sampler with __len__ (one epoch's order), or decode='cpu'"
                )
            if loader.decode != "cpu":  # (gpu_transforms may have been set since __init__)
                _refuse_reused_device_memory(loader.decode, loader.gpu_transforms)
            if loader.decode == "device":
                source = EncodedPass(loader, self.epoch, self.seed, start)
            elif loader.decode == "hybrid":
                if loader.limit_threads:
                    self._hold = engine.limit_threads(loader.num_workers)
                source = HybridPass(loader, engine, self.epoch, self.seed, start)
                self._generation = source.generation
            elif loader.fast_path:
                if loader.limit_threads:
                    self._hold = engine.limit_threads(loader.num_workers)
                source = FastPass(loader, engine, self.epoch, start, self.seed)
                self._generation = source.generation
                if not own_engine:
                    loader._fast_pass = weakref.ref(self)
            else:
                if loader.limit_threads:
                    self._hold = engine.limit_threads(loader.num_workers)
                # a pass started while the loop's iterates on the default persistent workers (a
                # peek inside the loop): workers of its own, as torch's default gives each iterator,
                # and an engine of its own (its cap on torch's threads ends with it)
                self._own_torch_workers = own = own_engine
                torch_iter = loader._torch_iter(own_workers=own)  # (re)makes loader._torch_ring
                if own:
                    source = _TorchPass(torch_iter, start, None, False, own_workers=True)
                else:
                    source = _TorchPass(torch_iter, start, loader._torch_ring, loader.persistent_workers)
                    loader._torch_pass = weakref.ref(self)
            self._source = source
            if loader.decode != "cpu":  # loader.close() ends it (its threads), as it stops the workers
                loader._device_pass = weakref.ref(self)
            it: Iterator[Any] = _HostIterator(source)
            if loader.decode != "cpu":
                pass  # the feeder hands out finished device batches (transformed, labels moved)
            elif loader.device is not None or loader.gpu_transforms is not None or loader._device_conversion:
                prefetcher = loader._get_prefetcher()
                if loader._feeds_beside(prefetcher):
                    it = self._fed = FedPass(it, prefetcher, self.seed, self.epoch, loader.timeout)
                else:
                    prefetcher.loader = _OnePass(it, self.seed, self.epoch, self._length)
                    it = iter(prefetcher)
            if loader.progress:
                from tqdm import tqdm  # only when asked for a progress bar

                it = iter(
                    tqdm(
                        it,
                        total=self._length,
                        desc=f"epoch {self.epoch}",
                        unit="batch",
                    )
                )
            self._it = it
            if loader.num_workers > 0:  # torch's workers fetch this many batches as they start
                self._draws.fetch_to((loader.prefetch_factor or 2) * loader.num_workers)
        except BaseException:
            if (
                self._hold is not None
                and "_source" not in self.__dict__
                and not _workers_live(loader, engine)
            ):
                # the workers this pass capped torch's threads for never started (a dataset that
                # cannot be pickled for spawn): the cap ends now, not when the loader is collected
                engine.end_hold(self._hold)
            self._end()
            raise

    def __iter__(self) -> DataLoaderIterator:
        return self

    def __len__(self) -> int:
        if isinstance(self._loader.dataset, IterableDataset):
            # torch's iterator answers its index sampler's len(): for an IterableDataset an endless
            # one, which raises torch's TypeError (also where the dataset has a __len__)
            len(self._loader.sampler)  # type: ignore[arg-type]
        if self._length is None:
            if not isinstance(self._loader.dataset, IterableDataset):
                len(self._loader)  # torch's words: a sampler without __len__
            raise TypeError(
                f"the dataset of this loader ({type(self._loader.dataset).__name__}) has no len()"
            )
        return self._length

    def __next__(self) -> Any:
        if self._closed_by_loader:
            raise RuntimeError(CLOSED_MIDPASS)
        if self._ended:
            raise StopIteration
        if self._generation is not None and self._engine.live_pass != self._generation:
            raise RuntimeError(SUPERSEDED)  # not even a batch prepared before the newer pass began
        t0 = time.perf_counter()
        if self._loader.num_workers == 0:  # torch's iterator fetches this call's batch now
            self._draws.fetch_to(self._done - self._start + 1)
        try:
            batch = next(self._it)
        except StopIteration:
            if not self._ended:
                self._draws.exhausted()
            self._end()
            raise
        except Exception:
            self._count_handed_out()  # this batch is over; the next next() goes on after it
            raise
        self.stats.record_batch(_batch_len(batch), time.perf_counter() - t0)
        self._count_handed_out()
        return batch

    # torch's iterator attributes (see the class docs) -------------------------------------------

    def _torch_iterator(self) -> Any:
        source = getattr(self, "_source", None)
        return source.it if isinstance(source, _TorchPass) else None

    @property
    def _workers(self) -> list[Any]:
        """The worker processes of this pass, as torch's iterator lists them."""
        torch_it = self._torch_iterator()
        if torch_it is not None:
            return torch_it._workers  # AttributeError without workers, as torch's
        source = getattr(self, "_source", None)
        if isinstance(source, HybridPass):
            source = source.cpu  # decode="hybrid": its CPU workers
        if isinstance(source, FastPass) and source.pool.num_workers > 0:
            return source.pool.workers
        raise AttributeError(
            f"'{type(self).__name__}' object has no attribute '_workers' "
            "(this pass loads in the main process)"
        )

    @property
    def _pin_memory_thread(self) -> Any:
        """torch's pin-memory thread, on torch's iterator (fastload's engine has none)."""
        torch_it = self._torch_iterator()
        if torch_it is not None:
            return torch_it._pin_memory_thread
        raise AttributeError(
            f"'{type(self).__name__}' object has no attribute '_pin_memory_thread' (fastload's engine "
            "page-locks its batch buffers in place, without a pin-memory thread)"
        )

    def _shutdown_workers(self) -> None:
        """Stops the workers of this pass now (persistent ones too) and ends the pass."""
        torch_it = self._torch_iterator()
        if torch_it is not None:
            torch_it._shutdown_workers()
        self._end()
        self._loader.close()  # persistent workers too: the next pass starts new ones

    def _count_handed_out(self) -> None:
        self._done += 1
        self._epochs.handed_out(self.epoch, self._done, self._pass_id)
        workers = self._loader.num_workers
        if workers > 0:  # torch's iterator fetches one batch ahead per batch it hands out
            self._draws.fetch_to((self._loader.prefetch_factor or 2) * workers + self._done - self._start)

    def close(self) -> None:
        """Ends the pass now (the next pass is the next epoch)."""
        self._end()

    def _close_from_loader(self) -> None:
        """``loader.close()`` during this pass: its threads stop, and its ``next()`` says why."""
        if not self._ended:
            self._closed_by_loader = True
        self._end()

    def _end(self) -> None:
        if self._ended:
            return
        self._ended = True
        self.stats.stop()
        fed = getattr(self, "_fed", None)
        if fed is not None:
            fed.close()  # first: its thread takes batches from the source
        close = getattr(getattr(self, "_source", None), "close", None)
        if callable(close):
            close()
        prefetcher = self._loader._prefetcher
        if (
            prefetcher is not None
            and isinstance(prefetcher.loader, _OnePass)
            and prefetcher.loader.epoch == self.epoch
        ):
            prefetcher.loader = []  # no cycle through the finished pass: the loader is freed at once
        self._epochs.end_pass(self.epoch, self._pass_id)
        loader = self._loader
        if loader._rest is self._rest:
            loader._rest = None
        if (
            self._generation is not None
            and not loader.persistent_workers
            and self._engine.generation == self._generation
        ):
            self._engine.close()  # only the newest pass: an older one must not stop a live pass
        elif self._hold is not None and (not loader.persistent_workers or self._own_torch_workers):
            self._engine.end_hold(self._hold)  # torch's workers stopped with its iterator
        if self._own_engine:
            self._engine.close()

    def __del__(self) -> None:
        try:
            self._end()
        except Exception:  # noqa: BLE001, S110 - interpreter shutdown
            pass


class _PassIndices:
    """torch's index sampler for a :class:`DataLoader` (its ``_index_sampler``): the rest of a
    resumed epoch once, in batches, else the loader's own ``batch_sampler`` (or ``sampler``)."""

    def __init__(self, loader: DataLoader[Any]) -> None:
        self._loader = weakref.ref(loader)  # no cycle: the loader is freed (and its workers stop) at once

    def _base(self, loader: DataLoader[Any]) -> Any:
        return loader.batch_sampler if loader.batch_sampler is not None else loader.sampler

    def __iter__(self) -> Iterator[Any]:
        loader = self._loader()
        assert loader is not None  # torch's iterator holds the loader while it draws indices
        rest = loader._rest  # torch's iterator may call iter() twice as it starts: no pop
        if rest is None:
            return iter(self._base(loader))
        if loader.batch_sampler is None:
            return iter(rest.tolist())
        return iter([b.tolist() for b in split_batches(rest, loader.batch_size or 1, loader.drop_last)])

    def __len__(self) -> int:
        loader = self._loader()
        assert loader is not None
        return len(self._base(loader))


@contextlib.contextmanager
def _served(loader: DataLoader[Any], view: Any) -> Iterator[None]:
    """``loader.dataset`` is ``view`` inside the block (while torch's iterator starts its workers).

    torch's iterator takes the dataset its workers serve from ``loader.dataset`` when it is made,
    and torch's ``DataLoader`` refuses to reassign that attribute after construction, so it is
    swapped directly in the instance and restored at once, also when starting a worker raises.
    """
    if view is None:
        yield
        return
    dataset = loader.dataset
    object.__setattr__(loader, "dataset", view)
    try:
        yield
    finally:
        object.__setattr__(loader, "dataset", dataset)


def _set_sampler_epoch(sampler: Any, epoch: int) -> None:
    """The loader sets its sampler's epoch (if it has ``set_epoch``); not an epoch the user gave it
    (see :meth:`DataLoader._take_sampler_epoch`)."""
    set_epoch = getattr(sampler, "set_epoch", None)
    if callable(set_epoch):
        set_epoch(epoch)
        if getattr(sampler, "_told_epoch", False):
            sampler._told_epoch = False


def _torch_pins(loader: DataLoader[Any]) -> bool:
    """Whether torch's iterator copies every batch into pinned memory (its pin_memory thread, as
    torch decides it): the main process then never gets the worker's segment back to reuse it."""
    if not loader.pin_memory:
        return False
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6 pins for any accelerator
    return bool(accelerator.is_available() if accelerator is not None else cuda_available())


def streams(loader: DataLoader[Any]) -> bool:
    """Whether torch's workers of ``loader`` stream the batches of fastload datasets: it batches
    and collates with ``default_collate`` (see :func:`_worker_init`)."""
    return loader.batch_sampler is not None and loader.collate_fn is default_collate


def rings_collate(loader: DataLoader[Any]) -> bool:
    """Whether torch's workers of ``loader`` run its ``collate_fn`` (the user's, given at
    construction) as :class:`fastload._stream.RingedCollate`: it batches with another collate
    than ``default_collate``."""
    return (
        loader.batch_sampler is not None
        and loader._given_collate
        and loader.collate_fn is loader._user_collate
        and loader.collate_fn is not default_collate
    )


@contextlib.contextmanager
def _worker_init(
    loader: DataLoader[Any], ring: torch.Tensor | None, pass_seeds: torch.Tensor | None = None
) -> Iterator[None]:
    """``loader.worker_init_fn`` is :class:`fastload._worker.TorchWorkerInit` around the user's inside
    the block (while torch's iterator starts its process workers), and the user's again after.

    When the loader collates batches with torch's ``default_collate`` (no ``collate_fn`` given, or
    that one; not one assigned later; not without batching: with ``batch_size=None`` torch converts
    each sample with ``default_convert``, which a collate must not replace),
    ``loader.collate_fn`` is :func:`fastload._stream.collate` inside the block too
    (``default_collate``'s batches, taking a streamed batch tensor as it is), and the workers stream
    the batches of fastload datasets (see :mod:`fastload._stream`), into the reused segments of
    the ring table ``ring``, if given. When it batches with the user's own ``collate_fn`` (given
    at construction) and ``ring`` is given, ``loader.collate_fn`` is
    :class:`fastload._stream.RingedCollate` around it inside the block: the same batches, sent in
    the workers' reused segments. ``pass_seeds``: the cell from which fastload's default persistent
    workers seed themselves at each pass (:func:`fastload._worker.reseed_each_pass`).
    """
    user_fn, user_collate = loader.worker_init_fn, loader.collate_fn
    stream = streams(loader)
    ringed = not stream and rings_collate(loader)
    # set in the instance's namespace: not the user's assignment (DataLoader.__setattr__)
    attributes = loader.__dict__
    attributes["worker_init_fn"] = TorchWorkerInit(
        user_fn,
        stream=stream,
        ring=ring if stream or ringed else None,
        pass_seeds=pass_seeds,
        trim=loader._runs_user_code is None,
    )
    if stream:
        attributes["collate_fn"] = stream_collate
    elif ringed:
        attributes["collate_fn"] = RingedCollate(user_collate)
    try:
        yield
    finally:
        attributes["worker_init_fn"] = user_fn
        attributes["collate_fn"] = user_collate


# ------------------------------------------------------------------------------------ DataLoader


#: torch's loader takes ``in_order`` from torch 2.6 on
_TORCH_TAKES_IN_ORDER = "in_order" in inspect.signature(torch.utils.data.DataLoader.__init__).parameters


def _in_order_argument(in_order: bool) -> dict[str, bool]:
    """``in_order`` for torch's ``DataLoader.__init__``: given where torch takes it; before torch
    2.6 only its default (an order it always keeps), and anything else is refused as that torch
    refuses an unknown argument."""
    if _TORCH_TAKES_IN_ORDER:
        return {"in_order": in_order}
    if in_order is not True:
        raise TypeError(
            "DataLoader.__init__() got an unexpected keyword argument 'in_order' "
            f"(torch {torch.__version__} has no in_order: it came with torch 2.6)"
        )
    return {}


class DataLoader(torch.utils.data.DataLoader, Generic[T_co]):
    """Drop-in for :class:`torch.utils.data.DataLoader` (see the module docs for what it adds).

    Every torch argument keeps its name and meaning, and its default wherever the loader runs code
    of the user's -- a dataset, transform, ``target_transform``, ``collate_fn``, sampler or
    ``worker_init_fn`` of theirs (torch's path, or ops of theirs after an accelerated head):
    ``num_workers=0``, no workers kept between passes, no pinning, no cap on torch's threads.
    Where fastload runs every op itself (the fast path, ``decode="device"``/``"hybrid"``, head
    acceleration whose later ops are all torchvision's transform classes, with torch's samplers
    and ``default_collate``), its own defaults apply: ``num_workers="auto"``
    (:func:`auto_num_workers`), workers kept between passes, ``pin_memory=True`` when CUDA is
    available, and the iterating thread's intra-op threads capped while the workers live
    (``limit_threads``). Nothing of the user's code is read to decide: which of the two applies
    depends only on the classes involved. Values passed explicitly are always honoured.

    Args:
        dataset: Any map-style or iterable dataset.
        batch_size: As in torch, and so are ``shuffle``, ``sampler``, ``batch_sampler``,
            ``collate_fn``, ``drop_last``, ``timeout``, ``worker_init_fn``,
            ``multiprocessing_context``, ``generator``, ``prefetch_factor``, ``pin_memory_device``
            and ``in_order``.
        num_workers: Worker count, or ``"auto"`` (a share of this machine's CPUs, on any path).
            Default: ``"auto"`` where fastload runs every op, else torch's ``0``. ``0`` decodes in
            this process, as torch does; on
            the fast path a batch's samples are split over ``torch.get_num_threads()`` threads, as
            torch splits its own ops (``torch.set_num_threads(1)``: one thread). User code (a
            ``get_bytes`` override, a ``target_transform``) still runs in the calling thread.
        pin_memory: Default: pins where fastload runs every op and CUDA is available, or where
            ``device`` is a CUDA device; else torch's ``False``.
        persistent_workers: Default: workers are kept between epochs where fastload runs every op
            (seeded at each pass as torch's new workers of that pass would be), else torch's
            ``False``.
        seed: Seeds the shuffle order and every random augmentation. ``None``: in a distributed
            job (a process group is initialized, or ``WORLD_SIZE`` > 1, when the seed is first
            needed) 0, like torch's ``DistributedSampler``, so that every rank shuffles alike
            before the order is sharded (also by Lightning's or Accelerate's wrappers of
            ``loader.sampler``); epochs then differ through the epoch. Otherwise a value taken
            at the first pass from the base seed torch's iterator draws from torch's global RNG
            (or ``generator``), so ``torch.manual_seed`` makes runs repeatable, as with torch.
            Building the loader draws nothing and each pass draws what torch's pass draws (its
            base seed; for ``shuffle=True`` its ``RandomSampler``'s draws), so the loop's own
            random numbers (weights initialised after the loader, dropout) are torch's -- except
            with ``num_workers=0`` on fastload's own paths (the fast path, ``decode="device"`` /
            ``"hybrid"``), whose augmentations draw from ``(seed, epoch, index)`` where torch's
            random transforms would draw from the main process's RNG.
        device: Move batches to this device (through :class:`fastload.CUDAPrefetcher`).
        gpu_transforms: Batched transforms (``fastload.gpu``) applied on ``device``.
        worker_type: ``"process"`` (default) or ``"thread"`` (decoding releases the GIL); both
            give identical batches.
        distributed: Build a :class:`fastload.DistributedSampler` for this rank (from the process
            group, else torchrun's ``WORLD_SIZE``/``RANK``, else one process: the whole dataset)
            with the sampler's own rule: ``shuffle=True``, a training sampler that pads as torch's
            does (every rank ``ceil(N / W)`` samples: equal step counts, every sample at least once
            per epoch); ``shuffle=False``, an evaluation sampler (every sample exactly once over all
            ranks). Example: 7 samples on 3 ranks, not shuffled: ``[0, 3, 6] / [1, 4] / [2, 5]``;
            shuffled (epoch order ``[4, 0, 5, 3, 2, 6, 1]``): ``[4, 3, 1] / [0, 2, 4] / [5, 6, 0]``
            (3 steps on every rank; 4 and 0 twice). The loader's ``drop_last`` drops short
            *batches*, as torch's; for shards without repeats pass your own
            ``DistributedSampler(..., drop_last=True)`` as ``sampler``.
        on_error: ``"raise"`` (default): a corrupt image raises an error naming it. ``"skip"``:
            the sample is left out of its batch (which is then shorter), counted in
            ``stats.skipped``, and a warning names it.
        reuse_buffers: Hand out views of the reusable batch buffers, recycled once nothing refers to
            a batch (see the module docs); ``False``: a copy of every batch.
        progress: Show a tqdm bar per epoch.
        limit_threads: Default: ``True`` where fastload runs every op, else ``False``.
            Cap ``torch.get_num_threads()`` in the iterating thread at this process's
            share of the CPUs (divided among the job's local ranks) less ``num_workers``, at least
            1, from the start of a pass while the workers are alive (until the pass ends without
            persistent workers; until ``close()`` or collection with them). A cap never raises
            the user's count (the count before the first cap, or one set since). With several
            loaders alive at once, torch runs with the smallest of their caps, and gets the user's
            count back when the last of them stops its workers, in either order.
        decode: ``"cpu"`` (default): workers decode. ``"device"``: workers only read the encoded
            bytes (free with ``InMemoryImageFolder``); :func:`fastload.decode.decode_batch`
            decodes each batch on ``device`` (nvJPEG on a GPU; the CPU decoder on the CPU) and
            ``gpu_transforms`` (required, starting with a resize-type transform) make one batch
            of the differently sized images. The dataset's ``transform`` must be ``None``.
            ``"hybrid"``: each batch is split between the device's decoder and ``num_workers`` CPU
            workers, which decode only the crop that ``gpu_transforms``' leading crop/resize draws
            for each of their samples (the same box as on the device), by the measured rates of
            both sides (``loader.hybrid``; see :mod:`fastload.gpu.hybrid`).
        fast_path: ``False``: torch's iterator on the dataset as it is (no fast path, no head
            acceleration).
        exact_pixels: Decode every image at full size and resize exactly as torchvision does, so that
            a torchvision pipeline gives bit-identical batches to ``torch.utils.data.DataLoader``'s
            for the same seed and order: a pipeline with random ops then takes head acceleration
            (torch's random draws) rather than the fast path (fastload's draws). Slower: no
            reduced-size JPEG decoding, and a ``Resize`` + ``CenterCrop`` resizes the whole image.
        epoch_lookahead: With persistent workers and an order that is a function of the epoch
            (``shuffle=True``/``False``, ``distributed=True`` or a fastload ``DistributedSampler``),
            workers that have no batch of the current epoch left start on the next epoch's first
            batches, so there is no pipeline drain and refill at each epoch boundary. The next
            pass uses them only if it is exactly that epoch (same seed, same batches); anything
            else (``set_epoch`` to another epoch, a resume, a changed sampler) discards them.
            At most the batch ring (``num_workers * prefetch_factor`` batches) is decoded ahead.

    Raises:
        ValueError / TypeError: Naming the argument, for invalid values.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Sampler[Any] | Iterable[Any] | None = None,
        batch_sampler: Sampler[list[Any]] | Iterable[list[Any]] | None = None,
        num_workers: int | str | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool | None = None,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool | None = None,
        pin_memory_device: str = "",
        in_order: bool = True,
        seed: int | None = None,
        device: str | torch.device | None = None,
        gpu_transforms: Callable[..., Any] | None = None,
        worker_type: str = "process",
        distributed: bool = False,
        on_error: str = "raise",
        reuse_buffers: bool = True,
        progress: bool = False,
        limit_threads: bool | None = None,
        decode: str = "cpu",
        epoch_lookahead: bool = True,
        fast_path: bool = True,
        exact_pixels: bool = False,
    ) -> None:
        if num_workers == "auto":  # asked for, on any path
            num_workers = auto_num_workers()
        elif isinstance(num_workers, bool):
            num_workers = int(num_workers)  # torch takes True as 1 worker (a bool is an int)
        elif num_workers is not None and not isinstance(num_workers, (int, np.integer)):
            # torch raises TypeError here too, from comparing a str with 0: same type, named argument
            raise TypeError(
                f"num_workers should be a non-negative integer or 'auto', but got num_workers={num_workers!r}"
            )
        elif num_workers is not None and num_workers < 0:  # torch's ValueError and words, then "auto"
            raise ValueError(
                "num_workers option should be non-negative; use num_workers=0 to disable multiprocessing. "
                f"fastload.DataLoader also takes num_workers='auto' (a share of this machine's CPUs), "
                f"but got num_workers={num_workers}"
            )
        #: the arguments left to their default, which depend on the path (see :meth:`_apply_defaults`)
        self._defaulted = frozenset(
            name
            for name, value in (
                ("num_workers", num_workers),
                ("pin_memory", pin_memory),
                ("persistent_workers", persistent_workers),
                ("limit_threads", limit_threads),
            )
            if value is None
        )
        #: what torch checks against num_workers, checked once the default is known (_apply_defaults)
        self._asked = {
            "multiprocessing_context": multiprocessing_context,
            "prefetch_factor": prefetch_factor,
            "persistent_workers": persistent_workers,
        }
        # Other values, batch_size and every torch argument: torch's own checks and messages
        # (in super().__init__ below).
        check_choice(worker_type, "worker_type", ("process", "thread"))
        check_choice(decode, "decode", ("cpu", "device", "hybrid"))
        check_choice(on_error, "on_error", ("raise", "skip"))
        if gpu_transforms is not None and not callable(gpu_transforms):
            raise TypeError(
                "gpu_transforms should be a callable taking a batch (e.g. fastload.gpu.Compose([...])) or "
                f"None, but got gpu_transforms={gpu_transforms!r}"
            )
        if device is not None and torch.device(device).type == "cuda" and not host_memory().can_pin():
            raise ValueError(
                f"device should be available, but got device={str(torch.device(device))!r} and CUDA is not "
                "available: pass device='cpu', or leave device out (the batches then stay in host memory)"
            )
        if decode != "cpu":
            _check_device_decode(decode, dataset, gpu_transforms, collate_fn, batch_sampler, on_error)
            if device is None and cuda_available():
                warnings.warn(
                    f"decode={decode!r} decodes on the loader's device, and device is not given: it decodes "
                    "on the CPU. Pass device='cuda' to decode on the GPU",
                    stacklevel=caller_stacklevel(),
                )
        if seed is not None:
            check_int(seed, "seed", type_error=True)
        #: persistent workers the user did not ask for (fastload's default where it runs every op)
        self._persistent_by_default = persistent_workers is None
        self._epochs = EpochState(_STATE_KIND, int(seed) if seed is not None else DefaultSeed(generator))
        is_iterable = isinstance(dataset, IterableDataset)
        own_sampler = replaces_random_sampler = False
        if distributed:
            if sampler is not None or batch_sampler is not None:
                raise ValueError(
                    "distributed=True builds the sampler itself: "
                    "pass either distributed=True or sampler/batch_sampler, not both"
                )
            sampler = DistributedSampler(
                dataset,
                num_replicas=get_world_size(),  # the process group's, else torchrun's variables, else 1
                rank=get_rank(),
                shuffle=bool(shuffle),
                seed=self._epochs.seed_source,  # the sampler's own rule: pads when shuffling (see the docs)
            )
            sampler._follows_job = not ranks_known()  # read again at each use: a process group may come later
            shuffle = False
            own_sampler = True
        elif shuffle and sampler is None and batch_sampler is None and not is_iterable:
            RandomSampler(dataset, generator=generator)  # torch's checks and words (an empty dataset)
            sampler = EpochRandomSampler(dataset, self._epochs.seed_source)
            sampler.generator = generator  # as torch's RandomSampler holds it (its order: the seed's)
            shuffle = False
            own_sampler = True
            replaces_random_sampler = True
        self._own_sampler = own_sampler
        #: the sampler stands in for the ``RandomSampler`` torch's loader would have made: a pass
        #: makes that sampler's draws from torch's RNG too (:meth:`_draw_as_torch`)
        self._replaces_random_sampler = replaces_random_sampler
        self._base_seed_drawn = False  # a persistent pass iterator's base seed (:meth:`_draw_as_torch`)
        # torch's own default_collate passed explicitly (torchvision's reference script does) is no collate_fn
        self._given_collate = collate_fn is not None and collate_fn is not default_collate
        self._user_collate = collate_fn
        self._given_batch_sampler = batch_sampler is not None
        given_workers = num_workers is not None
        if given_workers and num_workers > 0:  # type: ignore[operator]
            # torch's workers then report a batch that cannot be pickled instead of hanging
            multiprocessing_context = reporting_context(multiprocessing_context)
        # With num_workers left to its default (which depends on the path, known below), what torch
        # checks against it waits for it (_apply_defaults); else torch's checks and words, here.
        super().__init__(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            sampler=sampler,
            batch_sampler=batch_sampler,
            num_workers=int(num_workers) if given_workers else 0,  # type: ignore[arg-type]
            collate_fn=collate_fn,
            pin_memory=bool(pin_memory),
            drop_last=drop_last,
            timeout=timeout,
            worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context if given_workers else None,
            generator=generator,
            prefetch_factor=prefetch_factor if given_workers else None,
            persistent_workers=bool(persistent_workers) if given_workers else False,
            pin_memory_device=pin_memory_device,
            **_in_order_argument(in_order),
        )
        if not self._persistent_by_default:  # asked for: visible where frameworks read the arguments
            self.__dict__["persistent_workers"] = bool(persistent_workers)
        self.worker_type = worker_type
        self.on_error = on_error
        self.reuse_buffers = bool(reuse_buffers)
        self.progress = bool(progress)
        self.limit_threads = bool(limit_threads)  # (a default is set with the path: _apply_defaults)
        self.device = None if device is None else torch.device(device)
        self.gpu_transforms = gpu_transforms
        self.stats = LoaderStats()
        self.decode = decode
        #: ``decode="hybrid"``: how each batch is split between the CPU workers and the device's
        #: decoder (:class:`fastload.gpu.hybrid.HybridSplit`: its measured rates; ``cpu_share``
        #: fixes the split); ``None`` otherwise.
        self.hybrid: HybridSplit | None = None
        self._hybrid_head: list[Any] = []
        self._hybrid_rest: list[Any] = []
        self._hybrid_dataset: Any = None  # what the workers serve: the dataset, cropping as the device
        if decode == "hybrid":
            self.hybrid = HybridSplit()
            self._hybrid_head, self._hybrid_rest = split_head(gpu_transforms)  # type: ignore[arg-type]
            view = copy.copy(dataset)
            view.transform = DeviceHead(self._hybrid_head)
            self._hybrid_dataset = view
        self._allow_fast = bool(fast_path)
        self.exact_pixels = bool(exact_pixels)
        self._fast_dataset: Any = None
        self._fast_reason: str | None = None
        self._device_conversion: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._source_key: tuple[Any, ...] | None = None
        self._source_made: tuple[Any, ...] | None = None
        self._worker_dataset: Any = None  # what torch's workers serve instead of the dataset
        self._head_dataset: Any = None  # head acceleration: what torch's iterator serves (fastload.head)
        self._path = "torch"
        self._torch_workers_started = False  # torch's persistent workers are running
        self._torch_ring: MainRing | None = None  # the batch segments torch's workers reuse
        #: default persistent workers on torch's iterator: each pass's number and base seed, from
        #: which they seed themselves as its new workers would be (fastload._worker.reseed_each_pass)
        self._pass_seeds: torch.Tensor | None = None
        self._rest: np.ndarray | None = None  # a resumed pass's indices, until its iterator takes them
        self._choose_path(log=True)
        self.epoch_lookahead = bool(epoch_lookahead)
        self._engine = Engine()
        self._prefetcher: CUDAPrefetcher | None = None

    # ---------------------------------------------------------------- public extras

    @property
    def persistent_workers(self) -> bool:
        """Whether workers are kept between passes (torch's attribute). Left to its default: kept
        where fastload runs every op itself and there are workers, else torch's default (new
        workers each pass; see the class docs). A framework that makes the loader again from its
        instance attributes (``vars(loader)``: Lightning) finds the value there only where it was
        passed, so that fastload's default stays a default in the new loader."""
        return bool(self.__dict__.get("_persistent_workers", False))

    @persistent_workers.setter
    def persistent_workers(self, value: bool) -> None:  # torch's __init__ (and refusal after it)
        self._persistent_workers = value

    @property
    def seed(self) -> int:
        """The seed of the shuffle order and of every random augmentation (see ``seed``)."""
        return self._epochs.seed

    @property
    def epoch(self) -> int:
        """The epoch of the current (or next) pass."""
        return self._epochs.pass_epoch if self._epochs.pass_epoch is not None else self._epochs.epoch

    @property
    def fast_path(self) -> bool:
        """Whether batches are decoded straight into shared buffers (else torch's iterator runs)."""
        return self._fast_dataset is not None

    @property
    def fast_path_reason(self) -> str | None:
        """Why the fast path does not run, in one sentence (``None`` on the fast path)."""
        return self._fast_reason

    @property
    def decoder(self) -> str:
        """What decodes the images: for ``decode="device"`` the device's JPEG decoder (e.g.
        ``"nvJPEG through torchvision.io.decode_jpeg ..."``), else the workers' CPU decoding."""
        made: BatchDecoder | None = self.__dict__.get("_decoder")
        device = made.name if made is not None else device_decoder(self.device)
        if self.decode == "device":
            return device
        if self.decode == "hybrid":
            workers = f"{self.num_workers} CPU worker{'s' if self.num_workers != 1 else ''}"
            return (
                f"{device} for a share of each batch, libjpeg-turbo in {workers} "
                "for the rest (split by their measured rates)"
                if self.num_workers
                else f"{device} (decode='hybrid' without CPU workers: every image)"
            )
        return "libjpeg-turbo and PIL in the workers (CPU)"

    @property
    def path(self) -> str:
        """Which path runs: ``"fast"`` (fastload's engine runs the whole pipeline),
        ``"head-accelerated"`` (torch's iterator; decoding fused with the pipeline's crop/resize/flip
        head, the rest of it run as written, see :mod:`fastload.head`), ``"torch"`` (torch's
        iterator, the dataset as it is), ``"device-decode"`` (``decode="device"``) or ``"hybrid"``
        (``decode="hybrid"``)."""
        return self._path

    # ---------------------------------------------------------------- which path

    def _choose_path(self, log: bool = False, unless: str | None = None) -> None:
        """Decides between the fast path, head acceleration and torch's iterator for the dataset as
        it is now, says which it runs (``path``) and why not a faster one (``fast_path_reason``),
        and sets the arguments left to their default for it (:meth:`_apply_defaults`). When
        ``log``, for an image-folder dataset: one line on the ``fastload`` logger, INFO for the
        fast path, WARNING (shown by default) for the others -- with ``unless`` (the path before
        the dataset changed), only if the path is another now, so that the last line said is the
        path that runs."""
        dataset = self.dataset
        self._source_key = source_key(dataset)
        self._source_made = source_state(dataset)  # what the plans are made from, by value
        self._device_conversion = None
        self._fast_dataset, self._fast_reason = None, None
        self._worker_dataset = self._head_dataset = None
        self._path = "torch"
        level, line = self._decide_path(dataset)
        self._apply_defaults(first=not self.__dict__.get("_defaults_set"))
        if self._path == "torch" and self.num_workers > 0:
            # torch's workers serve a torchvision DatasetFolder from fastload's index (see _torch_iter)
            self._worker_dataset = worker_view(dataset)[0]
        if line is None or not (log and (unless is None or self._path != unless)):
            return
        if self.decode != "cpu":
            line = line.format(decoder=self.decoder)
        if self._path == "torch" and "num_workers" in self._defaulted:
            line += (
                f"; it loads in the main process, as torch's default num_workers=0 ({self._runs_user_code} "
                f"runs): pass num_workers='auto' to load in {auto_num_workers()} workers"
            )
        _log.log(level, "%s", line.replace("%s", type(dataset).__name__, 1))

    def _decide_path(self, dataset: Any) -> tuple[int, str | None]:
        """Sets the path for ``dataset``; returns the line that says it (``%s``: the dataset's
        class), or ``None`` where nothing is said (torch's path for a dataset fastload does not read)."""
        if self.decode != "cpu":
            self._fast_reason = f"decode={self.decode!r} decodes on the device"
            self._path = "device-decode" if self.decode == "device" else "hybrid"
            return logging.INFO, (  # (the decoder is named once the workers are known)
                f"fastload.DataLoader decodes this %s on {self.device if self.device is not None else 'cpu'} "
                f"with {{decoder}}, in a feeder thread {FEEDER_DEPTH} batches ahead of the loop"
            )
        structural = _structural_reason(self)
        if structural is None and _is_fast_dataset(dataset):
            self._take_fast(dataset)
            return logging.INFO, "fastload.DataLoader runs the fast path for this %s"
        if not self._allow_fast:
            self._fast_reason = "fast_path=False"
            return logging.INFO, None
        found = recognize(dataset) if structural is None else None
        if found is not None and found.dataset is not None:
            view: Any = found.dataset
            if not (self.exact_pixels and view.transform.reduce):
                if self.exact_pixels:
                    view.transform.exact = True
                self._take_fast(view)
                return logging.INFO, (
                    "fastload.DataLoader runs the fast path for this %s: its whole pipeline is fused "
                    "with decoding"
                )
            self._fast_reason = (
                "exact_pixels=True: the pipeline draws random parameters, which torch's draws (head "
                "acceleration) reproduce"
            )
        else:
            self._fast_reason = structural if found is None else found.reason
        if not is_image_folder(dataset) or isinstance(dataset, IterableDataset):
            return logging.WARNING, None
        head: Any
        head, head_reason = head_view(dataset, exact=self.exact_pixels)
        if head is None:
            return logging.WARNING, (
                "fastload.DataLoader runs torch's iterator for this %s (no acceleration): "
                f"{self._fast_reason}; no head acceleration: {head_reason}"
            )
        self._head_dataset = self._worker_dataset = head
        self._path = "head-accelerated"
        return logging.WARNING, (
            "fastload.DataLoader accelerates the head of this %s's pipeline on torch's iterator "
            f"({head.transform.describe()}); not the fast path: {self._fast_reason}"
        )

    def _apply_defaults(self, first: bool) -> None:
        """The arguments left to their default, for the path chosen: fastload's where it runs every
        op itself (``num_workers="auto"``, workers kept between passes, pinned memory with CUDA,
        ``limit_threads``), torch's where it runs code of the user's (``_runs_user_code``: no workers,
        none kept, no pinning, no cap). ``first``: at construction, where torch's checks against
        ``num_workers`` (made here when it was left to its default) raise torch's errors."""
        self._runs_user_code = _user_code(self)
        own = self._runs_user_code is None
        defaulted = self._defaulted
        if "num_workers" in defaulted:
            self.num_workers = auto_num_workers() if own else 0
            asked = self._asked
            if first:
                _torch_checks(self.num_workers, **asked)  # torch's errors, in its words
            self.prefetch_factor = None if self.num_workers == 0 else asked["prefetch_factor"] or 2
            context = asked["multiprocessing_context"]
            self.__dict__["_persistent_workers"] = bool(asked["persistent_workers"]) and self.num_workers > 0
            if self.num_workers > 0:
                self.multiprocessing_context = reporting_context(context)
            else:
                self.multiprocessing_context = None
        if "persistent_workers" in defaulted:
            self.__dict__["_persistent_workers"] = own and self.num_workers > 0
        if "pin_memory" in defaulted:
            to_cuda = self.device is not None and self.device.type == "cuda"
            self.pin_memory = (own and cuda_available()) or to_cuda
        if "limit_threads" in defaulted:
            self.limit_threads = own
        self._defaults_set = True

    def _take_fast(self, view: Any) -> None:
        """The fast path, serving ``view``."""
        if self.device is not None and self.device.type == "cuda" and view is not self.dataset:
            # a recognised pipeline: uint8 batches cross to the GPU (4x less traffic), converted there
            view.transform = view.transform.geometry_only()
            self._device_conversion = view.transform.convert_batch
        self._fast_dataset = view
        self._path = "fast"
        import_decode_modules()  # now, not inside the first batch (see _torch_iter for torch's path)

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name in ("collate_fn", "worker_init_fn") and self.__dict__.get("_DataLoader__initialized"):
            # torch lets both be set after __init__; its default's new workers take them up at
            # the next pass: so do fastload's path and default workers (see _refresh_path)
            self.__dict__["_callables_set"] = True

    def _refresh_path(self) -> None:
        """At the start of a pass: follow what fastload reads of the dataset itself (its transform,
        ``target_transform``, samples and loader, :mod:`fastload._source`), replaced or changed in
        place, and a ``collate_fn`` / ``worker_init_fn`` set since the last pass, as torch's loader
        does; workers asked for (``persistent_workers=True``) keep what they started with, as
        torch's do, while workers kept by fastload's default restart. The path and the defaults
        that follow it are decided again."""
        # persistent workers asked for keep what they started with, as torch's do
        callables_set = self.__dict__.pop("_callables_set", False) and (
            self._persistent_by_default or not self.persistent_workers or not self.num_workers
        )
        if callables_set:
            self._given_collate = self.collate_fn is not None and self.collate_fn is not default_collate
            self._user_collate = self.collate_fn
        if self.decode != "cpu":
            return
        state = source_state(self.dataset)
        before = self._source_made
        if not callables_set and _same_source(self._source_key, source_key(self.dataset)) and before == state:
            return
        pool = self._engine.pool
        live = (pool is not None and not pool.closed and pool.num_workers > 0) or self.__dict__.get(
            "_iterator"
        ) is not None
        if live and not self._persistent_by_default and not callables_set:
            return
        if live:
            what = (
                "collate_fn or worker_init_fn was set"
                if callables_set
                else f"the dataset's {', '.join(changed_attributes(before or (), state))} changed"
            )
            _log.info(
                "fastload.DataLoader restarts its workers: %s since the last epoch, and torch's loader "
                "would start new workers that see it (persistent_workers=True: they keep what they "
                "started with, as torch's do)",
                what,
            )
        self._stop_workers()
        self._choose_path(log=True, unless=None if callables_set else self._path)

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch of the next pass (order and augmentation), and the sampler's, if it has one."""
        self._epochs.set_epoch(epoch)
        _set_sampler_epoch(self.sampler, self._epochs.epoch)

    def state_dict(self) -> dict[str, Any]:
        """Where the loader is: seed, epoch, and how far the consumer got in that epoch.

        Taken inside a pass: that pass's epoch and the batches the consumer received (with
        ``device``/``gpu_transforms`` the prefetcher or the feeder thread is ahead; the batches
        it holds are not counted, so a resume neither skips nor repeats a batch). Taken between passes: what
        the next pass will do.

        With a sampler fastload knows (``shuffle``, ``distributed=True``, a fastload or torch
        ``DistributedSampler``) the state also holds ``position``: the prefix of the epoch's
        global order (the order every rank derives from ``(seed, epoch)`` before sharding) that
        every rank has handed out, assuming the ranks step together, as DDP does. Any loader --
        another number of ranks, another batch size -- continues from it exactly (see
        :meth:`load_state_dict`). The other fields record the sharding it was made with.

        Example: 64 samples, 4 ranks, batches of 4, each rank received 2 batches:
        ``{"epoch": 0, "position": 32, "batches": 2, "num_replicas": 4, "batch_size": 4, ...}``.
        """
        return self._epochs.state_dict(self._plan(), self._sampler_epoch())

    def _sampler_epoch(self) -> int | None:
        """The epoch of a ``DistributedSampler`` the user passed (and sets the epoch of): its order's."""
        if self._own_sampler or not isinstance(self.sampler, TorchDistributedSampler):
            return None
        return int(self.sampler.epoch)

    def _plan(self) -> Plan:
        """How this loader hands out an epoch (what its state records)."""
        n = None if isinstance(self.dataset, IterableDataset) else len(self.dataset)  # type: ignore[arg-type]
        fields: dict[str, Any] = {}
        if n is not None and self.batch_size is not None and not self._given_batch_sampler:
            fields = sampler_plan(self.sampler, self.dataset, self._own_sampler)
        if "order" not in fields:  # a custom sampler: its ranks must not change
            fields["num_replicas"] = get_world_size()
            fields["rank"] = get_rank()
        return Plan(num_samples=n, batch_size=self.batch_size, drop_last=bool(self.drop_last), **fields)

    def load_state_dict(self, state: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Resumes from :meth:`state_dict`: the next pass yields the rest of the saved epoch.

        A state with a ``position`` continues on a loader with any number of ranks and any batch
        size: the rest of the epoch's global order, sharded over this job's ranks by this
        loader's rule -- evaluation (``shuffle=False``): every remaining sample exactly once;
        training: every rank the same number of steps, padded only at the end. Each sample keeps
        the augmentation it would have had (a function of ``(seed, epoch, index)``). The usual
        loop's ``set_epoch(epoch)`` for the resumed epoch keeps the resume. A state saved at the
        end of an epoch resumes at the start of the next one.

        Args:
            state: The state of one rank (every rank steps together, as in DDP), or a list of the
                states of every rank of the saving job.

        Raises:
            fastload.ResumeError: (a ``ValueError``) The state is not a fastload loader state, is
                for another dataset size, another order (``shuffle``, the sampler or its seed), has
                a field out of range, was saved by ranks that stopped at different points, or --
                for a loader whose order fastload cannot derive (a custom sampler or
                ``batch_sampler``, an ``IterableDataset``) -- another batch size or number of ranks.
        """
        plan = self._plan()
        n = None if isinstance(self.dataset, IterableDataset) and _pass_length(self) is None else len(self)
        self._refuse_random_order(state, plan)
        self._epochs.load_state_dict(state, plan, n, self._sampler_epoch())
        seed = self._epochs.seed
        if self._own_sampler and isinstance(self.sampler, (EpochRandomSampler, DistributedSampler)):
            self.sampler.seed = seed  # (hasattr would read the property: a draw of its own)
        resume = self._epochs.resume
        sampler_epoch = None if resume is None else resume.sampler_epoch
        _set_sampler_epoch(self.sampler, self._epochs.epoch if sampler_epoch is None else sampler_epoch)

    def _refuse_random_order(self, state: Any, plan: Plan) -> None:
        """A state taken inside an epoch of torch's random samplers (``RandomSampler``,
        ``SubsetRandomSampler``, ``WeightedRandomSampler``): their order comes from the RNG's
        state at the pass's start, which a restarted job does not have, so skipping the batches
        already seen would skip others (some seen twice, some never)."""
        if plan.global_order:
            return
        sampler = getattr(self.batch_sampler, "sampler", None) if self._given_batch_sampler else self.sampler
        if not isinstance(sampler, (RandomSampler, SubsetRandomSampler, WeightedRandomSampler)):
            return
        if isinstance(sampler, EpochRandomSampler):
            return
        states = state if isinstance(state, list) else [state]
        if any(isinstance(one, dict) and one.get("batches") for one in states):
            raise ResumeError(
                f"this state was taken inside an epoch of torch's {type(sampler).__name__}, whose order "
                "a restarted job cannot draw again (it comes from the RNG's state at the pass's start): "
                "resuming would skip other samples than those seen. Pass shuffle=True instead of a "
                "RandomSampler (fastload's order, a function of seed and epoch), or distributed=True / "
                "fastload.DistributedSampler, to resume inside an epoch; a state taken at an epoch's end "
                "resumes with any sampler"
            )

    def _resume_pass(self, epoch: int, resume: Resume | None) -> tuple[int, np.ndarray | None]:
        """Where a pass of ``epoch`` begins: ``(batches to skip, this rank's indices or None)``.

        ``None`` indices: the sampler's own order. A resume this loader made itself (same ranks,
        batch size and sharding) skips batches on torch's path, loading them as an uninterrupted
        run did (its random draws go on from there); any other resume -- and every resume on
        fastload's own paths, whose draws are per sample -- runs this rank's share of the rest of
        the global order.
        """
        sampler = self.sampler
        if resume is None:
            start = sampler.resume_point() if isinstance(sampler, DistributedSampler) else None
            if start is not None:
                self._epochs.start_at(start, 0)  # the sampler's own state: it yields the rest
            return 0, None
        if isinstance(sampler, DistributedSampler):
            sampler.forget_resume()  # the loader's state says where the epoch stands
        sampler_epoch = self._sampler_epoch()
        if (
            sampler_epoch is not None
            and resume.sampler_epoch is not None
            and sampler_epoch != resume.sampler_epoch
        ):
            return 0, None  # the user's sampler went on to another epoch: it is whole
        torch_path = not self.fast_path and self.decode == "cpu"
        plan = self._plan()
        if resume.batches is not None and (torch_path or not plan.global_order):
            self._epochs.start_at(0, resume.batches)
            return resume.batches, None
        order = global_order(self.sampler, self.dataset, epoch if sampler_epoch is None else sampler_epoch)
        assert order is not None  # a resume with a position comes with a plan with a global order
        self._epochs.start_at(resume.position, 0)
        rest = rest_of_epoch(order, resume.position, plan.num_replicas, plan.rank, plan.pad, plan.drop_tail)
        return 0, rest

    def _pass_batches(self, epoch: int) -> Sequence[np.ndarray]:
        """This pass's batches for the fast path: a resumed epoch's rest, or an order known
        without reading the sampler (fastload's own samplers, a sequential one), cut at once;
        any other sampler read as the batches are issued (:class:`fastload._engine.SamplerBatches`),
        as torch's iterator reads it -- except with a CUDA ``device``, whose batches a feeder
        thread takes: the sampler is read whole here, at ``iter()``, in the iterating thread, so that
        a sampler drawing from torch's global RNG draws where torch's does, not interleaved with the
        training loop's draws from another thread."""
        batch_size = self.batch_size or 1
        to_device = self.device is not None or self.gpu_transforms is not None or self._device_conversion
        cuda_feed = bool(to_device) and self._get_prefetcher()._backend.is_cuda
        if self._rest is not None or cuda_feed or predicted_order(self.sampler, epoch) is not None:
            return split_batches(self._pass_order(), batch_size, self.drop_last)
        n = len(self.sampler)  # type: ignore[arg-type]
        expected = n // batch_size if self.drop_last else -(-n // batch_size)
        return SamplerBatches(self.sampler, batch_size, self.drop_last, expected)

    def _sample_keys(self) -> SampleKeys | None:
        """For a sampler of the user's (not fastload's, not sequential): each sample's random
        stream keyed by its copy and this rank too (:class:`fastload._engine.SampleKeys`), so
        that a sample given twice (``RASampler``'s repeats, sampling with replacement) or on two
        ranks gets its own augmentation, as torch's draws would."""
        sampler = self.sampler
        if self._own_sampler or type(sampler) in (SequentialSampler, EpochRandomSampler, DistributedSampler):
            return None  # fastload's orders: a sample's stream is its own on any rank (resharding)
        replicas, rank = getattr(sampler, "num_replicas", None), getattr(sampler, "rank", None)
        if not (isinstance(replicas, int) and isinstance(rank, int) and 0 <= rank < replicas):
            distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
            replicas = torch.distributed.get_world_size() if distributed else 1
            rank = torch.distributed.get_rank() if distributed else 0
        return SampleKeys(len(self.dataset), rank, replicas)  # type: ignore[arg-type]

    def _pass_order(self) -> np.ndarray:
        """This pass's indices: a resumed epoch's rest, or the sampler's order."""
        rest = self._rest
        if rest is not None:
            return rest
        return np.fromiter((sample_index(i) for i in self.sampler), dtype=np.int64)

    @property
    def _index_sampler(self) -> Any:
        """What torch's iterator draws batches of indices from: one object for the loader's life
        (persistent workers keep it), serving a resumed epoch's rest once, else torch's own."""
        indices = self.__dict__.get("_pass_indices")
        if indices is None:
            indices = self.__dict__["_pass_indices"] = _PassIndices(self)
        return indices

    def close(self) -> None:
        """Stops the workers now (fastload's, and torch's persistent ones on torch's path) and
        ends its cap on torch's thread count (also done when the loader is garbage-collected and at
        interpreter exit). A ``decode="device"`` / ``"hybrid"`` pass still iterating ends too (its
        threads stop): its ``next()`` then raises, as a fast pass's does. The next pass starts new
        workers."""
        live = self.__dict__.get("_device_pass")
        live = live() if live is not None else None
        if live is not None:
            live._close_from_loader()
        self._stop_workers()

    def _stop_workers(self) -> None:
        """Stops fastload's workers and torch's persistent ones; the next pass starts new ones."""
        self._engine.close()
        torch_iterator = self.__dict__.get("_iterator")  # torch's persistent workers' iterator
        if torch_iterator is not None:
            shutdown = getattr(torch_iterator, "_shutdown_workers", None)
            if callable(shutdown):
                shutdown()
            self._iterator = None
        self._torch_workers_started = False
        self._base_seed_drawn = False  # torch's next pass makes a new iterator
        ring = self.__dict__.get("_torch_ring")
        if ring is not None:
            ring.clear()
            self._torch_ring = None

    #: What lives only in this process (workers, their threads, passes in progress): not pickled.
    _PROCESS_STATE = (
        "_engine",
        "_iterator",
        "_torch_ring",
        "_pass_seeds",
        "_prefetcher",
        "_pass_indices",
        "_fast_pass",
        "_torch_pass",
        "_device_pass",
    )

    def __getstate__(self) -> dict[str, Any]:
        """The loader's settings and epoch state, without its workers: a loader pickles as torch's
        does (``torch.multiprocessing.spawn`` arguments, Lightning's ``ddp_spawn``), also after it
        iterated; the copy starts workers of its own at its first pass."""
        state = self.__dict__.copy()
        for name in self._PROCESS_STATE:
            state.pop(name, None)
        state["_torch_workers_started"] = False
        state["_base_seed_drawn"] = False
        # the dataset's compared state (copies of its lists: 1.28M samples) is this process's:
        # the copy's dataset is another object, compared anew (its plans made again at its first pass)
        state["_source_made"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__dict__.update(
            _engine=Engine(), _iterator=None, _torch_ring=None, _pass_seeds=None, _prefetcher=None
        )

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001, S110 - interpreter shutdown
            pass

    # ---------------------------------------------------------------- iteration

    def __iter__(self) -> DataLoaderIterator:  # type: ignore[override]
        self._check_as_torch_iterator()
        if self._needs_own_workers():
            # a pass while another one iterates (``next(iter(loader))`` inside the epoch's loop):
            # workers of its own, stopped with it, as torch gives each iterator of a loader without
            # persistent workers; the other pass goes on
            return DataLoaderIterator(self, Engine(), own_engine=True)
        return DataLoaderIterator(self, self._engine)

    def _needs_own_workers(self) -> bool:
        """Whether a new pass runs beside a live one, on workers of its own (and its own cap on
        torch's threads): without persistent workers, or with the default ones (not asked for);
        on torch's own iterator too (:meth:`_torch_pass_beside`)."""
        if self.decode != "cpu":
            return False
        if not self.fast_path:
            return self._torch_pass_beside()
        if self.persistent_workers and not self._persistent_by_default:
            return False  # asked for: one set of workers, as torch's (a newer pass takes them over)
        live = self.__dict__.get("_fast_pass")
        live = live() if live is not None else None
        return live is not None and not live._ended

    def _take_sampler_epoch(self) -> None:
        """A pass start: the epoch given to the sampler (``loader.sampler.set_epoch(e)``,
        torchvision's reference script's ``train_sampler.set_epoch(epoch)``) since the loader last
        set it is the pass's epoch, as ``loader.set_epoch(e)`` (torch's sampler would use it): the
        sampler fastload made, or a sampler of the user's with an ``epoch`` attribute that changed
        since the last pass (torch's ``DistributedSampler``)."""
        sampler: Any = self.sampler
        if self._own_sampler and getattr(sampler, "_told_epoch", False):
            sampler._told_epoch = False
            self._epochs.set_epoch(sampler.epoch)
            return
        if self._own_sampler:
            return
        # a sampler of the user's with an epoch (torch's DistributedSampler, RASampler): an epoch
        # it was given since the last pass (0 before the first) is the pass's too, so that a job
        # restarted at epoch e (set_epoch(e) on the sampler) does not draw epoch 0's augmentations
        if self._given_batch_sampler:
            sampler = getattr(self.batch_sampler, "sampler", None)
        epoch = getattr(sampler, "epoch", None)
        if type(epoch) is not int or epoch < 0:
            return
        last = self.__dict__.get("_user_sampler_epoch", 0)
        self._user_sampler_epoch = epoch
        if epoch != last and not self._epochs.epoch_set:
            self._epochs.set_epoch(epoch)

    def _check_as_torch_iterator(self) -> None:
        """What torch's iterator checks and says as a pass starts, in its words, on every path
        (torch's own path would say it a little later, inside torch's iterator). Its warning of
        ``pin_memory=True`` without an accelerator is given where the pass starts
        (:func:`_warn_as_torch_of_pin_memory`).

        Raises:
            AssertionError: ``timeout`` without workers, or ``prefetch_factor=0`` with workers, as
                torch's iterators raise (the loader itself accepts both, as torch's does).
        """
        if self.num_workers == 0 and self.timeout != 0:
            raise AssertionError("_SingleProcessDataLoaderIter requires timeout == 0")
        if self.num_workers > 0 and self.prefetch_factor is not None and self.prefetch_factor <= 0:
            raise AssertionError("prefetch_factor must be greater than 0 for MultiProcessingDataLoaderIter")

    def _torch_pass_beside(self) -> bool:
        """Whether a new pass of torch's iterator with process workers starts while the loop's
        iterates, so that it needs workers and a cap on torch's threads of its own: on the default
        persistent workers (not asked for) torch's persistent iterator would be reset under the
        loop; without persistent workers torch gives it new workers, and the loader's one cap
        would end with the first of the two passes to end."""
        if not self.num_workers or (self.persistent_workers and not self._persistent_by_default):
            return False  # asked for: one set of workers, as torch's (iter() resets its iterator)
        live = self.__dict__.get("_torch_pass")
        live = live() if live is not None else None
        return live is not None and not live._ended

    def _torch_iter(self, own_workers: bool = False) -> Iterator[Any]:
        """torch's own iterator for this loader (the path for everything the fast path does not serve).

        When it starts process workers (each pass, or the first one with persistent workers), two
        things keep their memory flat. The parent's heap is frozen for the garbage collector while
        they fork (:func:`fastload._worker.frozen_heap`). And a torchvision ``ImageFolder`` or
        ``DatasetFolder`` (not a subclass with its own ``__getitem__``, nor a custom loader) is
        served to them by :func:`fastload.recognize.worker_view`: the same ``__getitem__`` over
        fastload's numpy index, built from ``dataset.samples`` when the loader chose its path
        (at construction, and again at a pass after ``samples`` was replaced, or when workers
        start after its length changed), so the workers neither copy nor, with spawn, unpickle
        its Python list. Inside them,
        ``torch.utils.data.get_worker_info().dataset`` is that view (a ``fastload.ImageFolder``
        with the same ``classes``, ``class_to_idx``, ``loader``, ``transform`` and
        ``target_transform``; ``samples`` and ``targets`` read from the index).

        Spawn/forkserver workers get the dataset (the view, or the user's) through
        :func:`fastload._worker.ship_dataset` when it pickles large: pickled once here, so that
        each worker's start does not wait until the previous one imported torch. And each worker
        runs :class:`fastload._worker.TorchWorkerInit` before the user's ``worker_init_fn``: what
        its heap keeps of the last batch's per-sample tensors goes back to the system while it idles.

        ``own_workers``: an iterator with workers of its own, which stop with it (no ring of reused
        batch segments), for a pass beside the loop's on persistent workers.
        """
        if self.num_workers == 0:
            with _served(self, self._head_dataset):
                return super().__iter__()
        if self.persistent_workers and self._torch_workers_started and not own_workers:  # no worker starts
            if self._pass_seeds is not None:
                # torch's default (new workers every pass) makes a new iterator: it calls
                # iter(index sampler) (a sampler may draw there), draws the base seed its new
                # workers are seeded from, then calls iter() again as it primes the workers
                iter(self._index_sampler)
                cells = self._pass_seeds.numpy()
                cells[1] = seed = base_seed(self.generator)
                cells[0] += 1
                torch_iterator = self.__dict__.get("_iterator")
                if torch_iterator is not None:
                    torch_iterator._base_seed = seed  # as the new iterator would hold it
            ring = self._torch_ring
            if ring is not None:
                ring.new_pass()
            it = super().__iter__()
            if ring is not None:
                ring.recover()  # torch has dropped the sends of the last pass it did not hand out
            return it
        view = self._worker_dataset
        # samples grew or shrank in place since the view was made: make it again
        if view is not None and len(view) != len(self.dataset):  # type: ignore[arg-type]
            if self._head_dataset is not None:
                view = self._head_dataset = self._worker_dataset = head_view(
                    self.dataset, exact=self.exact_pixels
                )[0]
            else:
                view = self._worker_dataset = worker_view(self.dataset)[0]
        if view is not None:
            Image.preinit()  # the format plugins torchvision's PIL loader imports on first use
        served = view if view is not None else self.dataset
        shipped = None
        if not isinstance(served, (IterDataPipe, MapDataPipe)):  # torch's iterator inspects those
            shipped = ship_dataset(served, self.multiprocessing_context, self.worker_init_fn, self.collate_fn)
        table = None
        if (
            not own_workers
            and self.reuse_buffers
            and (streams(self) or rings_collate(self))
            and get_sharing_strategy() == "file_descriptor"
            and not _torch_pins(self)
            and ring_supported()
        ):
            table = ring_table(self.num_workers, (self.prefetch_factor or 2) + 2)
        if not own_workers:
            self._torch_ring = None if table is None else MainRing(table)
            reseeded = self.persistent_workers and self._persistent_by_default
            self._pass_seeds = pass_seed_cell() if reseeded else None
        try:
            with (
                # the parent's heap frozen for the fork only where the workers run no code of the user's
                frozen_heap(self.multiprocessing_context)
                if self._runs_user_code is None
                else contextlib.nullcontext(),
                _served(self, view if shipped is None else shipped),
                _worker_init(self, table, None if own_workers else self._pass_seeds),
            ):
                if own_workers:
                    it = self._get_iterator()  # not the loader's persistent one
                    it._persistent_workers = False  # they stop at its end
                else:
                    it = super().__iter__()
        finally:
            if shipped is not None:
                shipped.close()  # the workers have their copy of its descriptor
        if not own_workers:
            self._torch_workers_started = True
        return it

    def _draw_as_torch(self, what: str) -> None:
        """The draws from torch's global RNG (or ``generator``) that torch's loader makes where
        fastload's own code replaces torch's, so that a training loop's random numbers (dropout,
        a dataset drawing in the main process) are those it gets with torch's loader.

        ``"iterator"``: the base seed torch's iterator draws as it starts (every pass; with
        persistent workers asked for, at the first pass after the workers started), on the paths
        that do not run torch's iterator (on torch's, :meth:`_torch_iter` draws it for fastload's
        default persistent workers). ``"sampler"`` / ``"sampler end"``: the draws of the
        ``RandomSampler`` torch makes for ``shuffle=True`` (:class:`EpochRandomSampler` stands in
        for it): its seed before its first index (without ``generator``), or a
        ``torch.randperm`` of ``generator`` before its first index and another after its last.
        """
        if what == "iterator":
            # torch's default (not persistent) draws at every pass: so does fastload's default
            persistent = self.persistent_workers and self.num_workers > 0 and not self._persistent_by_default
            if not (persistent and self._base_seed_drawn):
                base_seed(self.generator)
                self._base_seed_drawn = True
        elif self._replaces_random_sampler:
            if self.generator is None:
                if what == "sampler":
                    base_seed()  # RandomSampler's seed: the same expression, torch's global RNG
            else:
                torch.randperm(len(self.dataset), generator=self.generator)  # type: ignore[arg-type]

    def _batch_decoder(self, device: torch.device) -> BatchDecoder:
        """The device paths' decoder (nvImageCodec's or torchvision's), made once per loader and
        device, in the first decoder thread that asks (nvImageCodec then keeps its threads and
        buffers across passes). With ``decode="hybrid"`` its CPU threads leave the workers theirs."""
        decoder = self.__dict__.get("_decoder")
        if decoder is None or decoder.device != device:
            # this process's share of the CPUs (one rank of several on a node), less the workers'
            threads = cpu_share() if self.decode == "device" else max(1, cpu_share() - self.num_workers)
            decoder = self._decoder = BatchDecoder(device, cpu_threads=threads)
        return decoder

    def _decode_headers(self) -> Headers:
        """``decode="device"`` / ``"hybrid"``: each sample's header facts (which decoder takes it,
        its size, subsampling, coding; :class:`fastload.gpu.decode.Headers`), filled in the first
        time a sample is read and kept for the loader's life: no image is opened or parsed to be
        routed in later epochs."""
        n = len(self.dataset)  # type: ignore[arg-type]
        headers = self.__dict__.get("_headers")
        if headers is None or len(headers) != n or self.__dict__.get("_headers_source") is not self.dataset:
            headers = self._headers = Headers(n)
            self._headers_source = self.dataset
        return headers

    def _feeds_beside(self, prefetcher: CUDAPrefetcher) -> bool:
        """Whether a pass's batches go to the device through a feeder thread (:class:`FedPass`)
        rather than the in-thread prefetcher: on a CUDA device, when the host pass draws nothing
        from torch's global random state in this process (the fast path; torch's path with worker
        processes) -- a thread would interleave its draws with the training loop's -- and when no
        transform reuses device memory (``gpu.Normalize(buffers=k)``, safe only one batch ahead).
        Says which, once per loader, on the ``fastload`` logger (a WARNING where a CUDA device
        gets the in-thread prefetcher, with why)."""
        if not prefetcher._backend.is_cuda:
            return False
        reason = None
        if reuses_device_memory(prefetcher.transforms):
            reason = "gpu_transforms reuse device memory (Normalize(buffers=k)), safe one batch ahead only"
        elif not (self.fast_path or self.num_workers > 0):
            reason = (
                "torch's path loads in this process (num_workers=0), drawing from torch's global random "
                "state, which a thread would interleave with the loop's draws; num_workers > 0 moves it"
            )
        if not self.__dict__.get("_delivery_said"):
            self._delivery_said = True
            if reason is None:
                _log.info(
                    "fastload.DataLoader copies and transforms batches on %s in a feeder thread %d batches "
                    "ahead of the loop",
                    prefetcher.device,
                    FEEDER_DEPTH,
                )
            else:
                _log.warning(
                    "fastload.DataLoader copies and transforms batches on %s in the loop's next() (one "
                    "batch ahead), not in a feeder thread: %s",
                    prefetcher.device,
                    reason,
                )
        return reason is None

    def _get_prefetcher(self) -> CUDAPrefetcher:
        """One prefetcher (one side stream) for the loader's lifetime."""
        if self._prefetcher is None:
            device = self.device if self.device is not None else torch.device("cpu")
            self._prefetcher = CUDAPrefetcher([], device=device, transforms=None, dtype=None)
        transforms: Any = self.gpu_transforms
        if self._device_conversion is not None:
            transforms = _ConvertThen(self._device_conversion, self.gpu_transforms)
        self._prefetcher.transforms = transforms
        return self._prefetcher


class _ConvertThen(BatchTransform):
    """A recognised pipeline's conversion (uint8 -> the user's dtype and normalization) on the
    device, then the loader's ``gpu_transforms``."""

    def __init__(
        self, convert: Callable[[torch.Tensor], torch.Tensor], then: Callable[..., Any] | None
    ) -> None:
        self.convert = convert
        self.then = then

    def __call__(self, images: Any, *, indices: Any = None, epoch: int = 0, seed: int = 0) -> torch.Tensor:
        images = self.convert(images)
        if self.then is None:
            return images
        return apply_transform(self.then, images, indices, epoch, seed)


def _refuse_reused_device_memory(decode: str, gpu_transforms: Any) -> None:
    """``decode="device"`` / ``"hybrid"`` transform batches ahead of the loop: a transform writing
    into a ring of device buffers would overwrite one the loop still holds."""
    if reuses_device_memory(gpu_transforms):
        raise ValueError(
            f"decode={decode!r} prepares batches {FEEDER_DEPTH} ahead of the loop in a feeder thread: "
            "gpu_transforms that reuse device memory (gpu.Normalize(buffers=k)) would overwrite a batch "
            "the loop still holds; leave buffers at 0 (the default)"
        )


def _check_device_decode(
    decode: str, dataset: Any, gpu_transforms: Any, collate_fn: Any, batch_sampler: Any, on_error: str
) -> None:
    """The arguments ``decode="device"`` / ``"hybrid"`` need, checked with a message naming the fix."""
    hw_decoder_load()  # FASTLOAD_HW_DECODER_LOAD, if set, is a share from 0 to 1
    if not callable(getattr(dataset, "get_bytes", None)):
        raise ValueError(
            f"decode={decode!r} needs a dataset that serves encoded images "
            "(fastload.ImageFolder or InMemoryImageFolder)"
        )
    if gpu_transforms is None:
        raise ValueError(
            f"decode={decode!r} needs gpu_transforms that bring the decoded images to one size, "
            "e.g. gpu.Compose([gpu.RandomResizedCrop(224), gpu.Normalize(...)])"
        )
    if getattr(dataset, "transform", None) is not None:
        raise ValueError(
            f"decode={decode!r} decodes and transforms on the device: leave the dataset's transform None "
            "and pass the augmentations as gpu_transforms"
        )
    if collate_fn is not None or batch_sampler is not None:
        raise ValueError(
            f"decode={decode!r} builds its own batches: collate_fn and batch_sampler are not supported "
            "with it"
        )
    _refuse_reused_device_memory(decode, gpu_transforms)
    if on_error != "raise":
        raise ValueError(
            f"on_error={on_error!r} is not supported with decode={decode!r}: a corrupt image raises a "
            "DecodeError naming it from the next() of its batch (the pass goes on after it); use "
            "decode='cpu' to skip unreadable samples"
        )
    if decode == "hybrid":
        split_head(gpu_transforms)  # its workers run the head of gpu_transforms
