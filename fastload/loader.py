"""``fastload.DataLoader``: torch's DataLoader, with uint8 batches decoded straight into reusable buffers.

The fast path (any other dataset, ``collate_fn`` or ``batch_sampler`` goes through torch's
iterator, :mod:`fastload._torchpath`)::

    main process                                      worker (process or thread)
    sampler order = f(seed, epoch) ─ batch k ─task─>  for i in batch: bytes = dataset.get_bytes(i)
                                                        with rng.sample_scope(seed, epoch, i):
                                                          transform.decode_into(bytes, slot[k][j])
    yield slot[k] as uint8 NCHW  <────── done ─────   labels[k][j] = targets[i]

The loader holds the arguments, the path (:mod:`fastload._path`), the epoch state
(:mod:`fastload._epoch`) and one engine (:mod:`fastload._engine`, the slots reused across
passes); ``iter()`` makes a :class:`fastload._iterator.DataLoaderIterator`.
"""

from __future__ import annotations

import copy
import logging
import warnings
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar

import numpy as np
import torch
from torch.utils.data import (
    IterableDataset,
    RandomSampler,
    Sampler,
    default_collate,
)

from ._checks import caller_stacklevel, check_choice, check_int
from ._devicepass import HybridParts
from ._engine import Engine
from ._epoch import DefaultSeed, EpochState
from ._iterator import DataLoaderIterator
from ._passorder import PassIndices, pass_length, plan, refuse_random_order, sampler_epoch, set_sampler_epoch
from ._path import check_device_decode, choose_path
from ._stream import MainRing
from ._torchpath import in_order_argument, stop_workers
from ._torchworkers import reporting_context
from .device import auto_num_workers, cuda_available
from .distributed import get_rank, get_world_size, ranks_known
from .gpu.decode import BatchDecoder, device_decoder
from .gpu.hybrid import DeviceHead, HybridSplit, split_head
from .gpu.memory import host_memory
from .gpu.prefetch import CUDAPrefetcher
from .sampler import DistributedSampler, EpochRandomSampler
from .stats import LoaderStats

__all__ = ["DataLoader", "DataLoaderIterator", "EpochRandomSampler", "auto_num_workers"]

T_co = TypeVar("T_co", covariant=True)

_log = logging.getLogger("fastload")

_STATE_KIND = "fastload.DataLoader"


class DataLoader(torch.utils.data.DataLoader, Generic[T_co]):
    """Drop-in for :class:`torch.utils.data.DataLoader`; its fast path decodes into reused buffers.

    Every torch argument keeps its name and meaning, and its default wherever the loader runs code
    of the user's (a dataset, transform, ``target_transform``, ``collate_fn``, sampler or
    ``worker_init_fn`` of theirs): ``num_workers=0``, no workers kept, no pinning, no thread cap.
    Where fastload runs every op itself (the fast path, ``decode="device"``/``"hybrid"``, head
    acceleration whose later ops are all torchvision transform classes, with torch's samplers and
    ``default_collate``) its own defaults apply: ``num_workers="auto"``, workers kept between
    passes, ``pin_memory=True`` with CUDA, and ``limit_threads``. Which applies depends only on the
    classes involved; values passed explicitly are always honoured.

    Args:
        batch_size: As in torch, and so are ``dataset``, ``shuffle``, ``sampler``, ``batch_sampler``,
            ``collate_fn``, ``drop_last``, ``timeout``, ``worker_init_fn``,
            ``multiprocessing_context``, ``generator``, ``prefetch_factor``, ``pin_memory_device``
            and ``in_order``.
        num_workers: Worker count, or ``"auto"`` (a share of this machine's CPUs, on any path).
            Default: ``"auto"`` where fastload runs every op, else torch's ``0``. With ``0`` the
            fast path splits a batch over ``torch.get_num_threads()`` threads; user code (a
            ``get_bytes`` override, a ``target_transform``) still runs in the calling thread.
        pin_memory: Default: pins where fastload runs every op and CUDA is available, or where
            ``device`` is a CUDA device; else torch's ``False``.
        persistent_workers: Default: kept between epochs where fastload runs every op (seeded at
            each pass as torch's new workers would be), else torch's ``False``.
        seed: Seeds the shuffle order and every random augmentation. ``None``: 0 in a distributed
            job (a process group, or ``WORLD_SIZE`` > 1), like torch's ``DistributedSampler``, so
            that every rank shuffles alike; otherwise taken at the first pass from the base seed
            torch's iterator draws, so ``torch.manual_seed`` makes runs repeatable and torch's RNG
            is left as torch's loader leaves it (except with ``num_workers=0`` on fastload's own
            paths, whose augmentations draw from ``(seed, epoch, index)``).
        device: Move batches to this device (through :class:`fastload.CUDAPrefetcher`).
        gpu_transforms: Batched transforms (``fastload.gpu``) applied on ``device``.
        worker_type: ``"process"`` (default) or ``"thread"``; both give identical batches.
        distributed: Build a :class:`fastload.DistributedSampler` for this rank with its rule:
            training (``shuffle=True``) pads as torch's does, evaluation has every sample exactly
            once. The loader's ``drop_last`` drops short *batches*, as torch's.
        on_error: ``"raise"`` (default), or ``"skip"``: a corrupt image is left out of its
            (shorter) batch, counted in ``stats.skipped``, and named in a warning.
        reuse_buffers: Hand out views of the reusable batch buffers, recycled once nothing refers to
            a batch; ``False``: a copy of every batch.
        progress: Show a tqdm bar per epoch.
        limit_threads: Cap ``torch.get_num_threads()`` in the iterating thread at this process's
            share of the CPUs less ``num_workers`` (at least 1) while the workers are alive; never
            raises the user's count, and with several loaders the smallest cap holds.
        decode: ``"cpu"`` (default): workers decode. ``"device"``: workers only read the encoded
            bytes, each batch is decoded on ``device`` and ``gpu_transforms`` (required, starting
            with a resize-type transform) bring it to one size; the dataset's ``transform`` must
            be ``None``. ``"hybrid"``: each batch split between the device's decoder and
            ``num_workers`` CPU workers by their measured rates (:mod:`fastload.gpu.hybrid`).
        fast_path: ``False``: torch's iterator on the dataset as it is.
        exact_pixels: Decode at full size and resize exactly as torchvision does (batches
            bit-identical to torch's loader's; a pipeline with random ops then takes head
            acceleration). Slower: no reduced-size JPEG decoding.
        epoch_lookahead: With persistent workers and an order that is a function of the epoch,
            idle workers start on the next epoch's first batches, used only if the next pass is
            exactly that epoch from its start.
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
        # the arguments left to their default, which depend on the path (fastload._path.apply_defaults)
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
        # what torch checks against num_workers, checked once the default is known (apply_defaults)
        self._asked = {
            "multiprocessing_context": multiprocessing_context,
            "prefetch_factor": prefetch_factor,
            "persistent_workers": persistent_workers,
        }
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
            check_device_decode(decode, dataset, gpu_transforms, collate_fn, batch_sampler, on_error)
            if device is None and cuda_available():
                warnings.warn(
                    f"decode={decode!r} decodes on the loader's device, and device is not given: it decodes "
                    "on the CPU. Pass device='cuda' to decode on the GPU",
                    stacklevel=caller_stacklevel(),
                )
        if seed is not None:
            check_int(seed, "seed", type_error=True)
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
        # standing in for torch's RandomSampler, whose draws a pass makes too (_torchpath.draw_as_torch)
        self._replaces_random_sampler = replaces_random_sampler
        self._base_seed_drawn = False
        # torch's own default_collate passed explicitly (torchvision's reference script does) is no collate_fn
        self._given_collate = collate_fn is not None and collate_fn is not default_collate
        self._user_collate = collate_fn
        self._given_batch_sampler = batch_sampler is not None
        given_workers = num_workers is not None
        if given_workers and num_workers > 0:  # type: ignore[operator]
            # torch's workers then report a batch that cannot be pickled instead of hanging
            multiprocessing_context = reporting_context(multiprocessing_context)
        # with num_workers defaulted, torch's checks against it wait for the path (apply_defaults)
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
            **in_order_argument(in_order),
        )
        if not self._persistent_by_default:  # asked for: visible where frameworks read the arguments
            self.__dict__["persistent_workers"] = bool(persistent_workers)
        self.worker_type = worker_type
        self.on_error = on_error
        self.reuse_buffers = bool(reuse_buffers)
        self.progress = bool(progress)
        self.limit_threads = bool(limit_threads)  # (its default: apply_defaults)
        self.device = None if device is None else torch.device(device)
        self.gpu_transforms = gpu_transforms
        self.stats = LoaderStats()
        self.decode = decode
        # decode="hybrid": how each batch is split between CPU workers and the device (HybridSplit)
        self.hybrid: HybridSplit | None = None
        self._hybrid: HybridParts | None = None  # what the two sides run (fastload._devicepass)
        if decode == "hybrid":
            self.hybrid = HybridSplit()
            head, rest = split_head(gpu_transforms)  # type: ignore[arg-type]
            view = copy.copy(dataset)  # what the workers serve: the dataset, cropping as the device
            view.transform = DeviceHead(head)
            self._hybrid = HybridParts(self.hybrid, head, rest, view)
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
        #: default persistent workers on torch's iterator: (pass number, base seed) of the pass
        #: (seed None: the first), from which they seed themselves (fastload._torchpath.PassSeeded)
        self._pass_seed: tuple[int, int | None] | None = None
        self._rest: np.ndarray | None = None  # a resumed pass's indices, until its iterator takes them
        choose_path(self, log=True)
        self.epoch_lookahead = bool(epoch_lookahead)
        self._engine = Engine()
        self._prefetcher: CUDAPrefetcher | None = None

    @property
    def persistent_workers(self) -> bool:
        """Whether workers are kept between passes (torch's attribute). In ``vars(loader)``, where
        frameworks that rebuild a loader read it (Lightning), only where it was passed."""
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
        """What decodes the images: the device's JPEG decoder, the workers' CPU decoding, or both."""
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
        """Which path runs: ``"fast"``, ``"head-accelerated"`` (:mod:`fastload.head`), ``"torch"``,
        ``"device-decode"`` or ``"hybrid"`` (``decode=``)."""
        return self._path

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name in ("collate_fn", "worker_init_fn") and self.__dict__.get("_DataLoader__initialized"):
            # torch's new workers take them up at the next pass: so does fastload (_path.refresh_path)
            self.__dict__["_callables_set"] = True
        elif name in ("sampler", "batch_sampler") and self.__dict__.get("_defaults_set"):
            # set past torch's guard (timm's MultiEpochsDataLoader wraps them): torch's iterator runs them
            self.__dict__["_given_batch_sampler"] = self.__dict__["_sampler_set"] = True

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch of the next pass (order and augmentation), and the sampler's, if it has one."""
        self._epochs.set_epoch(epoch)
        set_sampler_epoch(self.sampler, self._epochs.epoch)

    def state_dict(self) -> dict[str, Any]:
        """Where the loader is: seed, epoch, and how far the consumer got in that epoch.

        Taken inside a pass: that pass's epoch and the batches the consumer received. Taken
        between passes: what the next pass will do. With a sampler fastload knows it also holds
        ``position``, the prefix of the epoch's global order every rank has handed out, from which
        a loader with any number of ranks and batch size continues exactly.

        Example: 64 samples, 4 ranks, batches of 4, each rank received 2 batches:
        ``{"epoch": 0, "position": 32, "batches": 2, "num_replicas": 4, "batch_size": 4, ...}``.
        """
        return self._epochs.state_dict(plan(self), sampler_epoch(self))

    def load_state_dict(self, state: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Resumes from :meth:`state_dict` (one rank's, or a list of every rank's): the next pass
        yields the rest of the saved epoch, also after the loop's ``set_epoch(epoch)``.

        Raises:
            fastload.ResumeError: (a ``ValueError``) The state cannot be continued exactly here;
                the message names the field and both values.
        """
        the_plan = plan(self)
        n = None if isinstance(self.dataset, IterableDataset) and pass_length(self) is None else len(self)
        refuse_random_order(self, state, the_plan)
        self._epochs.load_state_dict(state, the_plan, n, sampler_epoch(self))
        seed = self._epochs.seed
        if self._own_sampler and isinstance(self.sampler, (EpochRandomSampler, DistributedSampler)):
            self.sampler.seed = seed  # (hasattr would read the property: a draw of its own)
        resume = self._epochs.resume
        saved_epoch = None if resume is None else resume.sampler_epoch
        set_sampler_epoch(self.sampler, self._epochs.epoch if saved_epoch is None else saved_epoch)

    @property
    def _index_sampler(self) -> Any:
        """What torch's iterator draws indices from, for the loader's life (``PassIndices``)."""
        indices = self.__dict__.get("_pass_indices")
        if indices is None:
            indices = self.__dict__["_pass_indices"] = PassIndices(self)
        return indices

    def close(self) -> None:
        """Stops the workers now (also done when the loader is collected, and at exit) and ends the
        cap on torch's thread count and a device pass; the next pass starts new workers."""
        live = self.__dict__.get("_device_pass")
        live = live() if live is not None else None
        if live is not None:
            live._close_from_loader()
        stop_workers(self)

    # What lives only in this process (workers, their threads, passes in progress): not pickled.
    _PROCESS_STATE = (
        "_engine",
        "_iterator",
        "_torch_ring",
        "_pass_seed",
        "_prefetcher",
        "_pass_indices",
        "_fast_pass",
        "_torch_pass",
        "_device_pass",
    )

    def __getstate__(self) -> dict[str, Any]:
        """The settings and epoch state without the workers (``spawn`` arguments, ``ddp_spawn``)."""
        state = self.__dict__.copy()
        for name in self._PROCESS_STATE:
            state.pop(name, None)
        state["_torch_workers_started"] = False
        state["_base_seed_drawn"] = False
        state["_source_made"] = None  # the copy's dataset is another object: compared anew
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__dict__.update(
            _engine=Engine(), _iterator=None, _torch_ring=None, _pass_seed=None, _prefetcher=None
        )

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001, S110 - interpreter shutdown
            pass

    def __iter__(self) -> DataLoaderIterator:  # type: ignore[override]
        # what torch's iterators refuse as a pass starts, in their words, on every path
        if self.num_workers == 0 and self.timeout != 0:
            raise AssertionError("_SingleProcessDataLoaderIter requires timeout == 0")
        if self.num_workers > 0 and self.prefetch_factor is not None and self.prefetch_factor <= 0:
            raise AssertionError("prefetch_factor must be greater than 0 for MultiProcessingDataLoaderIter")
        if self._needs_own_workers():
            # a pass beside a live one (a peek inside the loop): workers of its own, as with torch
            return DataLoaderIterator(self, Engine(), own_engine=True)
        return DataLoaderIterator(self, self._engine)

    def _needs_own_workers(self) -> bool:
        """Whether a new pass runs beside a live one, on workers (and a thread cap) of its own."""
        if self.decode != "cpu" or (self.persistent_workers and not self._persistent_by_default):
            return False  # asked for: one set of workers, as torch's (a newer pass takes them over)
        if not self.fast_path and not self.num_workers:
            return False
        live = self.__dict__.get("_fast_pass" if self.fast_path else "_torch_pass")
        live = live() if live is not None else None
        return live is not None and not live._ended
