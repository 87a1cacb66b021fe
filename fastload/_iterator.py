"""``iter(fastload.DataLoader)``: one pass (:class:`DataLoaderIterator`), whatever the path.

The pass takes its order (:mod:`fastload._passorder`), follows the dataset
(:func:`fastload._path.refresh_path`) and runs its path's source: :class:`fastload._engine.FastPass`,
torch's iterator (:mod:`fastload._torchpath`) or a device pass (:mod:`fastload._devicepass`), then
the prefetcher or a feeder thread for a ``device`` (:func:`feeds_beside`). torch's iterator
contract: an error in batch k is raised from ``next()``, the following ``next()`` gives batch k+1.
"""

from __future__ import annotations

import functools
import logging
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset

from ._devicepass import FEEDER_DEPTH, EncodedPass, FedPass, HybridPass, reuses_device_memory
from ._engine import SUPERSEDED, Engine, FastPass
from ._passorder import (
    ENDLESS_SAMPLER,
    endless,
    follow_pass,
    pass_batches,
    pass_length,
    pass_order,
    resume_pass,
    sample_keys,
    set_sampler_epoch,
    take_sampler_epoch,
)
from ._path import refresh_path, refuse_reused_device_memory
from ._pool import CLOSED_MIDPASS
from ._torchpath import SamplerDraws, TorchPass, draw_as_torch, torch_iter, warn_as_torch_of_pin_memory
from .device import cpu_share
from .gpu import BatchTransform, apply_transform
from .gpu.decode import BatchDecoder, Headers
from .gpu.prefetch import CUDAPrefetcher

_log = logging.getLogger("fastload")


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


def workers_live(loader: Any, engine: Any) -> bool:
    """Whether ``loader`` has workers running: torch's iterator's or fastload's engine's."""
    if loader.__dict__.get("_iterator") is not None:
        return True
    pool = engine.pool
    return pool is not None and not pool.closed and pool.num_workers > 0


class DataLoaderIterator:
    """What ``iter(fastload.DataLoader)`` returns: one pass over the loader (torch's iterator contract).

    ``next()`` returns the next batch, or raises the error of loading it with the worker's
    traceback, and the following ``next()`` goes on with the batch after it. The pass ends (the
    next pass is the next epoch) when it is exhausted, closed or dropped. It has the attributes of
    torch's iterator that tools read: ``_workers``, ``_pin_memory_thread``, ``_shutdown_workers()``.

    Attributes:
        epoch: The epoch of this pass.
        seed: The seed of its order and augmentations.
    """

    def __init__(self, loader: Any, engine: Engine, own_engine: bool = False) -> None:
        self._loader = loader
        self._engine = engine
        self._own_engine = own_engine  # workers of its own (a pass beside a live one), stopped with it
        self._closed_by_loader = False
        self._epochs = loader._epochs
        take_sampler_epoch(loader)
        self.seed = self._epochs.pass_seed()  # before the pass draws torch's base seed
        self.epoch, resume = self._epochs.begin_pass()
        self._pass_id = self._epochs.live_pass
        self._ended = False
        self._generation: int | None = None
        self._hold: int | None = None  # this pass's hold on torch's thread count (limit_threads)
        self._own_torch_workers = False  # torch's iterator with workers of its own, beside the loop's
        if loader._own_sampler or self._epochs.epoch_set:
            set_sampler_epoch(loader.sampler, self.epoch)
        start, rest = resume_pass(loader, self.epoch, resume)
        self._done = start
        self._rest: np.ndarray | None = None
        self._length: int | None = pass_length(loader)
        if rest is not None:
            batch_size = loader.batch_size or 1
            self._length = len(rest) // batch_size if loader.drop_last else -(-len(rest) // batch_size)
        elif self._length is not None:
            self._length = max(0, self._length - start)  # len(): the batches this pass yields
        loader._rest = self._rest = rest  # until the pass ends
        self._follow = follow_pass(loader, rest)  # (before any worker starts)
        self._start = start
        self._reading_ahead = 0  # batches the workers may read ahead of the loop, for _follow
        if loader.num_workers > 0:
            self._reading_ahead = max(2, loader.num_workers * (loader.prefetch_factor or 2)) + 1
        self._tell_position()
        self._draws = SamplerDraws(loader, self._length)  # torch's RandomSampler's, by index fetch
        self.stats = loader.stats
        self.stats.start()
        refresh_path(loader)
        try:
            source: Any
            if loader.decode != "cpu" or loader.fast_path:
                warn_as_torch_of_pin_memory(loader)
                draw_as_torch(loader, "iterator")  # torch's iterator would draw its base seed
            if loader.decode != "cpu" and endless(loader.sampler):
                raise ValueError(
                    f"decode={loader.decode!r} needs a sampler with a len(): {ENDLESS_SAMPLER}. Pass "
                    "a sampler with __len__ (one epoch's order), or decode='cpu'"
                )
            if loader.decode != "cpu":  # (gpu_transforms may have been set since __init__)
                refuse_reused_device_memory(loader.decode, loader.gpu_transforms)
                device_args = (
                    pass_order(loader),
                    decode_headers(loader),
                    functools.partial(batch_decoder, loader),
                )
            if loader.decode != "device" and loader.limit_threads:
                self._hold = engine.limit_threads(loader.num_workers)
            if loader.decode == "device":
                source = EncodedPass(loader, self.epoch, self.seed, start, *device_args)
            elif loader.decode == "hybrid":
                source = HybridPass(
                    loader, engine, self.epoch, self.seed, start, *device_args, loader._hybrid
                )
                self._generation = source.generation
            elif loader.fast_path:
                to_device = loader.device is not None or loader.gpu_transforms is not None
                cuda_feed = (
                    bool(to_device or loader._device_conversion) and get_prefetcher(loader)._backend.is_cuda
                )
                batches = pass_batches(loader, self.epoch, cuda_feed)
                dataset = loader._fast_dataset
                keys = sample_keys(loader)
                source = FastPass(loader, engine, self.epoch, start, self.seed, batches, dataset, keys)
                self._generation = source.generation
                if not own_engine:
                    loader._fast_pass = weakref.ref(self)
            else:
                # a pass beside the loop's on default persistent workers: workers and an engine of its own
                self._own_torch_workers = own = own_engine
                torch_it = torch_iter(loader, own_workers=own)  # (re)makes loader._torch_ring
                if own:
                    source = TorchPass(torch_it, start, None, False, own_workers=True)
                else:
                    source = TorchPass(torch_it, start, loader._torch_ring, loader.persistent_workers)
                    loader._torch_pass = weakref.ref(self)
            self._source = source
            if loader.decode != "cpu":  # loader.close() ends it (its threads), as it stops the workers
                loader._device_pass = weakref.ref(self)
            it: Iterator[Any] = _HostIterator(source)
            if loader.decode != "cpu":
                pass  # the feeder hands out finished device batches
            elif loader.device is not None or loader.gpu_transforms is not None or loader._device_conversion:
                prefetcher = get_prefetcher(loader)
                if feeds_beside(loader, prefetcher):
                    it = self._fed = FedPass(it, prefetcher, self.seed, self.epoch, loader.timeout)
                else:
                    prefetcher.loader = _OnePass(it, self.seed, self.epoch, self._length)
                    it = iter(prefetcher)
            if loader.progress:
                from tqdm import tqdm  # only when asked for a progress bar

                it = iter(tqdm(it, total=self._length, desc=f"epoch {self.epoch}", unit="batch"))
            self._it = it
            if loader.num_workers > 0:  # torch's workers fetch this many batches as they start
                self._draws.fetch_to((loader.prefetch_factor or 2) * loader.num_workers)
        except BaseException:
            if self._hold is not None and "_source" not in self.__dict__ and not workers_live(loader, engine):
                engine.end_hold(self._hold)  # its workers never started (an unpicklable dataset)
            self._end()
            raise

    def __iter__(self) -> DataLoaderIterator:
        return self

    def __len__(self) -> int:
        if isinstance(self._loader.dataset, IterableDataset):
            # torch's iterator answers its index sampler's len(): for an IterableDataset an endless
            # one, which raises torch's TypeError (also where the dataset has a __len__)
            len(self._loader.sampler)
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

    def _torch_iterator(self) -> Any:
        source = getattr(self, "_source", None)
        return source.it if isinstance(source, TorchPass) else None

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

    def _tell_position(self) -> None:
        """Tells the dataset following the pass where the workers read (:func:`follow_pass`)."""
        if self._follow is not None:
            self._follow((self._done + self._reading_ahead) * self._loader.batch_size)

    def _count_handed_out(self) -> None:
        self._done += 1
        self._tell_position()
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


class ConvertThen(BatchTransform):
    """A recognised pipeline's conversion from uint8 on the device, then the ``gpu_transforms``."""

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


def batch_decoder(loader: Any, device: torch.device) -> BatchDecoder:
    """The device paths' decoder, made once per loader and device (its threads and buffers kept
    across passes); its CPU threads are this process's share less ``decode="hybrid"``'s workers."""
    decoder = loader.__dict__.get("_decoder")
    if decoder is None or decoder.device != device:
        threads = cpu_share() if loader.decode == "device" else max(1, cpu_share() - loader.num_workers)
        decoder = loader._decoder = BatchDecoder(device, cpu_threads=threads)
    return decoder


def decode_headers(loader: Any) -> Headers:
    """The device paths' header columns (:class:`fastload.gpu.decode.Headers`), kept for the loader's
    life: each sample's header is parsed once."""
    n = len(loader.dataset)
    headers = loader.__dict__.get("_headers")
    if headers is None or len(headers) != n or loader.__dict__.get("_headers_source") is not loader.dataset:
        headers = loader._headers = Headers(n)
        loader._headers_source = loader.dataset
    return headers


def feeds_beside(loader: Any, prefetcher: CUDAPrefetcher) -> bool:
    """Whether a pass's batches go to a CUDA device through a feeder thread (:class:`FedPass`)
    rather than the in-thread prefetcher; logged once per loader."""
    if not prefetcher._backend.is_cuda:
        return False
    reason = None
    if reuses_device_memory(prefetcher.transforms):
        reason = "gpu_transforms reuse device memory (Normalize(buffers=k)), safe one batch ahead only"
    elif not (loader.fast_path or loader.num_workers > 0):
        reason = (
            "torch's path loads in this process (num_workers=0), drawing from torch's global random "
            "state, which a thread would interleave with the loop's draws; num_workers > 0 moves it"
        )
    if not loader.__dict__.get("_delivery_said"):
        loader._delivery_said = True
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


def get_prefetcher(loader: Any) -> CUDAPrefetcher:
    """One prefetcher (one side stream) for the loader's lifetime."""
    if loader._prefetcher is None:
        device = loader.device if loader.device is not None else torch.device("cpu")
        loader._prefetcher = CUDAPrefetcher([], device=device, transforms=None, dtype=None)
    transforms: Any = loader.gpu_transforms
    if loader._device_conversion is not None:
        transforms = ConvertThen(loader._device_conversion, loader.gpu_transforms)
    loader._prefetcher.transforms = transforms
    return loader._prefetcher
