"""torch's path: torch's own iterator and workers for what the fast path does not serve, with the
additions fastload makes to it (each measured, ``docs/how-it-works.md``): a torchvision folder
served from fastload's numpy index, batches sent through memfd and reused segments, a dataset
pickled once for spawn/forkserver workers, a resumed epoch's rest, an unsendable batch named
instead of a hang, kept workers reseeded at each pass (:class:`PassSeeded`), and the global RNG
draws torch's loader makes, made where fastload's code replaces torch's (:func:`draw_as_torch`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.utils.data.dataloader as torch_dataloader_module
from PIL import Image
from torch.multiprocessing import get_sharing_strategy
from torch.utils.data import (
    IterDataPipe,
    MapDataPipe,
    default_collate,
)

from ._checks import caller_stacklevel
from ._epoch import base_seed
from ._shm import shm_error
from ._stream import MainRing, RingedCollate, ring_table
from ._stream import collate as stream_collate
from ._torchworkers import TorchWorkerInit, seed_as_torch
from ._workerstart import frozen_heap, ship_dataset
from .device import cuda_available
from .gpu.memory import host_memory
from .head import head_view
from .tvfolder import worker_view

_log = logging.getLogger("fastload")

#: torch's own class, taken where it is defined when fastload is imported: also where a script
#: replaced the name ``torch.utils.data.DataLoader`` by fastload's since
TORCH_DATALOADER = torch_dataloader_module.DataLoader


class TorchPass:
    """torch's own iterator, ``start`` batches in; with a ring (:class:`fastload._stream.MainRing`)
    each ``next()`` frees the batch segments nothing refers to and notes the new batch's."""

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


class SamplerDraws:
    """One pass's draws of the ``RandomSampler`` that :class:`EpochRandomSampler` stands in for
    (:func:`draw_as_torch`), at the index fetches torch's iterator would make them: the first
    fetch draws, the one after the last batch (or a short kept last batch) runs out. Workers
    fetch ``prefetch_factor * num_workers`` batches as they start, then one per batch handed out."""

    def __init__(self, loader: Any, length: int | None) -> None:
        self._loader = loader
        self._begin = loader._replaces_random_sampler
        self._end = self._begin and loader.generator is not None
        self._fetched = 0
        self._last: int | None = None  # the fetch that runs out of indices (None: unknown)
        if self._end and length is not None:
            size = len(loader.dataset)
            short_last = bool(loader.batch_size and not loader.drop_last and size % loader.batch_size)
            self._last = length + (0 if short_last else 1)

    def fetch_to(self, fetches: int) -> None:
        """torch's iterator has fetched ``fetches`` batches of indices (or tried to) in this pass."""
        while self._fetched < fetches and (self._begin or self._end):
            self._fetched += 1
            if self._begin:
                self._begin = False
                draw_as_torch(self._loader, "sampler")
            if self._end and self._fetched == self._last:
                self.exhausted()

    def exhausted(self) -> None:
        """The sampler ran out of indices (at the latest: the pass's end)."""
        if self._end:
            self._end = False
            draw_as_torch(self._loader, "sampler end")


@functools.lru_cache(maxsize=1)
def _torch_pin_memory_warning() -> str | None:
    """What torch's iterator says of ``pin_memory=True`` without an accelerator (older torch:
    nothing), asked of torch's own loader once with a generator of its own."""
    torch_loader = TORCH_DATALOADER
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        iter(torch_loader([0], pin_memory=True, generator=torch.Generator()))  # type: ignore[arg-type]
    said = [str(w.message) for w in caught if "pin_memory" in str(w.message)]
    return said[0] if said else None


def warn_as_torch_of_pin_memory(loader: Any) -> None:
    """torch's warning of ``pin_memory=True`` without an accelerator, on fastload's own paths
    (torch's iterator gives it on torch's path), naming the user's line."""
    if loader.pin_memory and not _accelerator_available():
        message = _torch_pin_memory_warning()
        if message is not None:
            warnings.warn(message, stacklevel=caller_stacklevel())


def _accelerator_available() -> bool:
    """Whether fastload can pin memory, or torch finds another accelerator (torch >= 2.6)."""
    if host_memory().can_pin():
        return True
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "is_available"):
        return bool(accelerator.is_available())
    return False


@contextlib.contextmanager
def served(loader: Any, view: Any) -> Iterator[None]:
    """``loader.dataset`` is ``view`` inside the block (while torch's iterator starts its workers),
    set past torch's refusal to reassign it."""
    if view is None:
        yield
        return
    dataset = loader.dataset
    object.__setattr__(loader, "dataset", view)
    try:
        yield
    finally:
        object.__setattr__(loader, "dataset", dataset)


def torch_pins(loader: Any) -> bool:
    """Whether torch's iterator copies every batch into pinned memory (its pin_memory thread, as
    torch decides it): the main process then never gets the worker's segment back to reuse it."""
    if not loader.pin_memory:
        return False
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6 pins for any accelerator
    return bool(accelerator.is_available() if accelerator is not None else cuda_available())


def streams(loader: Any) -> bool:
    """Whether torch's workers stream the batches of fastload datasets (``default_collate``)."""
    return loader.batch_sampler is not None and loader.collate_fn is default_collate


def rings_collate(loader: Any) -> bool:
    """Whether torch's workers run the user's ``collate_fn`` (given at construction) as
    :class:`fastload._stream.RingedCollate`."""
    return (
        loader.batch_sampler is not None
        and loader._given_collate
        and loader.collate_fn is loader._user_collate
        and loader.collate_fn is not default_collate
    )


@contextlib.contextmanager
def worker_init(loader: Any, ring: torch.Tensor | None) -> Iterator[None]:
    """Inside the block (while torch's iterator starts its workers), ``loader.worker_init_fn`` is
    :class:`fastload._torchworkers.TorchWorkerInit` around the user's, and ``collate_fn`` is
    :func:`fastload._stream.collate` (:func:`streams`) or :class:`fastload._stream.RingedCollate`
    around the user's (:func:`rings_collate`, with a ``ring``)."""
    user_fn, user_collate = loader.worker_init_fn, loader.collate_fn
    stream = streams(loader)
    ringed = not stream and rings_collate(loader)
    # set in the instance's namespace: not the user's assignment (DataLoader.__setattr__)
    attributes = loader.__dict__
    attributes["worker_init_fn"] = TorchWorkerInit(
        user_fn,
        stream=stream,
        ring=ring if stream or ringed else None,
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


#: torch's loader takes ``in_order`` from torch 2.6 on
_TORCH_TAKES_IN_ORDER = "in_order" in inspect.signature(torch.utils.data.DataLoader.__init__).parameters


def in_order_argument(in_order: bool) -> dict[str, bool]:
    """``in_order`` for torch's ``DataLoader.__init__``; before torch 2.6 only its default."""
    if _TORCH_TAKES_IN_ORDER:
        return {"in_order": in_order}
    if in_order is not True:
        raise TypeError(
            "DataLoader.__init__() got an unexpected keyword argument 'in_order' "
            f"(torch {torch.__version__} has no in_order: it came with torch 2.6)"
        )
    return {}


class PassSeeded(torch.utils.data.Dataset[Any]):
    """What workers kept by fastload's default on torch's iterator serve: ``dataset``, seeding the
    worker's global RNGs at the first index of each later pass (a
    :class:`fastload._passorder.PassIndex`) as torch's new worker of that pass would be seeded."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.seeded: tuple[int, int] | None = None

    def __len__(self) -> int:
        return len(self.dataset)

    def _seed(self, index: Any) -> int:
        pass_seed = getattr(index, "pass_seed", None)
        if pass_seed is not None and pass_seed != self.seeded:
            self.seeded = pass_seed
            info = torch.utils.data.get_worker_info()
            if info is not None:
                seed_as_torch(pass_seed[1], info.id)
        return int(index)

    def __getitem__(self, index: Any) -> Any:
        return self.dataset[self._seed(index)]

    def __getitems__(self, indices: Sequence[Any]) -> list[Any]:
        plain = [self._seed(i) for i in indices]
        getitems = getattr(self.dataset, "__getitems__", None)
        return getitems(plain) if callable(getitems) else [self.dataset[i] for i in plain]


def torch_iter(loader: Any, own_workers: bool = False) -> Iterator[Any]:
    """torch's own iterator for this loader. Process workers start with the parent's heap frozen
    (:func:`fastload._workerstart.frozen_heap`), a torchvision folder served from fastload's index
    (:func:`fastload.tvfolder.worker_view`), a large dataset shipped once
    (:func:`fastload._workerstart.ship_dataset`) and :class:`fastload._torchworkers.TorchWorkerInit`.
    ``own_workers``: workers that stop with the iterator, for a pass beside the loop's."""
    if loader.num_workers == 0:
        with served(loader, loader._head_dataset):
            return TORCH_DATALOADER.__iter__(loader)
    if loader.persistent_workers and loader._torch_workers_started and not own_workers:  # no worker starts
        if loader._pass_seed is not None:
            # as torch's new iterator: iter(index sampler), then the base seed its new workers
            # would be seeded from, which the pass's indices carry to the kept workers
            iter(loader._index_sampler)
            loader._pass_seed = (loader._pass_seed[0] + 1, base_seed(loader.generator))
        ring = loader._torch_ring
        if ring is not None:
            ring.new_pass()
        it = TORCH_DATALOADER.__iter__(loader)
        if ring is not None:
            ring.recover()  # torch has dropped the sends of the last pass it did not hand out
        return it
    view = loader._worker_dataset
    # samples grew or shrank in place since the view was made: make it again
    if view is not None and len(view) != len(loader.dataset):
        if loader._head_dataset is not None:
            view = loader._head_dataset = loader._worker_dataset = head_view(
                loader.dataset, exact=loader.exact_pixels
            )[0]
        else:
            view = loader._worker_dataset = worker_view(loader.dataset)[0]
    if view is not None:
        Image.preinit()  # the format plugins torchvision's PIL loader imports on first use
    given = view if view is not None else loader.dataset
    reseeded = not own_workers and loader.persistent_workers and loader._persistent_by_default
    if reseeded:
        given = PassSeeded(given)
    shipped = None
    if not isinstance(given, (IterDataPipe, MapDataPipe)):  # torch's iterator inspects those
        shipped = ship_dataset(
            given, loader.multiprocessing_context, loader.worker_init_fn, loader.collate_fn
        )
    table = None
    if (
        not own_workers
        and loader.reuse_buffers
        and (streams(loader) or rings_collate(loader))
        and get_sharing_strategy() == "file_descriptor"
        and not torch_pins(loader)
    ):
        table = ring_table(loader.num_workers, (loader.prefetch_factor or 2) + 2)
    if not own_workers:
        loader._torch_ring = None if table is None else MainRing(table)
        loader._pass_seed = (0, None) if reseeded else None
    try:
        with (
            # the parent's heap frozen for the fork only where the workers run no code of the user's
            frozen_heap(loader.multiprocessing_context, freeze=loader._runs_user_code is None),
            served(loader, given if shipped is None else shipped),
            worker_init(loader, table),
        ):
            if own_workers:
                it = loader._get_iterator()  # not the loader's persistent one
                it._persistent_workers = False  # they stop at its end
            else:
                it = TORCH_DATALOADER.__iter__(loader)
    finally:
        if shipped is not None:
            shipped.close()  # the workers have their copy of its descriptor
    if not own_workers:
        loader._torch_workers_started = True
    return it


def draw_as_torch(loader: Any, what: str) -> None:
    """The draws from torch's global RNG (or ``generator``) that torch's loader makes where
    fastload's code replaces torch's, so that a loop's random numbers are those it gets with
    torch's loader. ``"iterator"``: the base seed torch's iterator draws as it starts.
    ``"sampler"`` / ``"sampler end"``: the ``RandomSampler``'s (:class:`EpochRandomSampler` stands
    in for it): its seed (without ``generator``), or a ``torch.randperm`` of ``generator`` before
    its first index and another after its last."""
    if what == "iterator":
        # torch's default (not persistent) draws at every pass: so does fastload's default
        persistent = (
            loader.persistent_workers and loader.num_workers > 0 and not loader._persistent_by_default
        )
        if not (persistent and loader._base_seed_drawn):
            base_seed(loader.generator)
            loader._base_seed_drawn = True
    elif loader._replaces_random_sampler:
        if loader.generator is None:
            if what == "sampler":
                base_seed()  # RandomSampler's seed: the same expression, torch's global RNG
        else:
            torch.randperm(len(loader.dataset), generator=loader.generator)


def stop_workers(loader: Any) -> None:
    """Stops fastload's workers and torch's persistent ones; the next pass starts new ones."""
    loader._engine.close()
    torch_iterator = loader.__dict__.get("_iterator")  # torch's persistent workers' iterator
    if torch_iterator is not None:
        shutdown = getattr(torch_iterator, "_shutdown_workers", None)
        if callable(shutdown):
            shutdown()
        loader._iterator = None
    loader._torch_workers_started = False
    loader._base_seed_drawn = False  # torch's next pass makes a new iterator
    ring = loader.__dict__.get("_torch_ring")
    if ring is not None:
        ring.clear()
        loader._torch_ring = None
