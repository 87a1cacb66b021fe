"""Which path a ``fastload.DataLoader`` runs, and the defaults that follow from it.

:func:`choose_path` picks the fast path, head acceleration or torch's iterator and says why not a
faster one; :func:`apply_defaults` sets the defaults: torch's wherever the loader runs code of the
user's (:func:`user_code`). At each pass start :func:`refresh_path` follows the dataset.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import numpy as np
import torch
from torch.utils.data import (
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
    default_collate,
)
from torch.utils.data.distributed import DistributedSampler as TorchDistributedSampler

from ._checks import optional_attribute
from ._devicepass import FEEDER_DEPTH, reuses_device_memory
from ._passorder import ENDLESS_SAMPLER, endless
from ._source import changed_attributes, source_key, source_state
from ._torchpath import stop_workers
from ._torchworkers import reporting_context
from .device import auto_num_workers, cuda_available
from .gpu.hybrid import split_head
from .gpu.nvimgcodec import hw_decoder_load
from .head import head_view
from .recognize import recognize
from .sampler import DistributedSampler, EpochRandomSampler
from .transforms import import_decode_modules
from .tvfolder import is_image_folder, worker_view

_log = logging.getLogger("fastload")


def fast_collate(collate_fn: Any) -> bool:
    """Whether ``collate_fn`` is timm's ``fast_collate``: uint8 images stacked, int64 labels, which
    the fast path's batches are for a uint8 pipeline."""
    module = sys.modules.get("timm.data.loader")
    return module is not None and collate_fn is getattr(module, "fast_collate", None)


def is_fast_dataset(dataset: Any) -> bool:
    transform = optional_attribute(dataset, "transform")
    return (
        callable(optional_attribute(dataset, "get_bytes"))
        and transform is not None
        and callable(getattr(transform, "decode_into", None))
        and getattr(transform, "output_size", None) is not None
    )


def same_source(a: tuple[Any, ...] | None, b: tuple[Any, ...]) -> bool:
    return a is not None and all(x is y for x, y in zip(a, b, strict=True))


def structural_reason(loader: Any) -> str | None:
    """Why the loader's arguments (not its dataset) rule out the fast path, or ``None``."""
    if isinstance(loader.dataset, IterableDataset):
        return "the dataset is an IterableDataset"
    if loader._given_batch_sampler:
        return "a batch_sampler is given"
    if loader.batch_size is None:
        return "batch_size=None (no batching)"
    if loader._given_collate and not fast_collate(loader.collate_fn):
        return "a collate_fn is given (the fast path builds its batches itself; default_collate is fine)"
    if endless(loader.sampler):
        return ENDLESS_SAMPLER
    return None


# torch's samplers and fastload's, and plain sequences of indices: they run no code of the user's.
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


def user_code(loader: Any) -> str | None:
    """What code of the user's the loader runs (a dataset, transform, ``target_transform``,
    ``collate_fn``, sampler or ``worker_init_fn``), or ``None`` where fastload runs every op itself.
    Decided from classes only: nothing of the user's code is read."""
    if loader.worker_init_fn is not None:
        return "a worker_init_fn"
    if loader._given_collate and not fast_collate(loader.collate_fn):
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


def refuse_reused_device_memory(decode: str, gpu_transforms: Any) -> None:
    """Refuses device transforms with reused buffers where batches are prepared ahead of the loop."""
    if reuses_device_memory(gpu_transforms):
        raise ValueError(
            f"decode={decode!r} prepares batches {FEEDER_DEPTH} ahead of the loop in a feeder thread: "
            "gpu_transforms that reuse device memory (gpu.Normalize(buffers=k)) would overwrite a batch "
            "the loop still holds; leave buffers at 0 (the default)"
        )


def check_device_decode(
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
    refuse_reused_device_memory(decode, gpu_transforms)
    if on_error != "raise":
        raise ValueError(
            f"on_error={on_error!r} is not supported with decode={decode!r}: a corrupt image raises a "
            "DecodeError naming it from the next() of its batch (the pass goes on after it); use "
            "decode='cpu' to skip unreadable samples"
        )
    if decode == "hybrid":
        split_head(gpu_transforms)  # its workers run the head of gpu_transforms


def choose_path(loader: Any, log: bool = False, unless: str | None = None) -> None:
    """Sets the path for the dataset as it is now (``path``, ``fast_path_reason``) and the defaults
    that follow it. ``log``: one line on the ``fastload`` logger (INFO for the fast path, else
    WARNING with the reason; where torch's default loads in the main process, how to load in
    workers); with ``unless`` (the path before), only if the path changed."""
    dataset = loader.dataset
    loader._source_key = source_key(dataset)
    loader._source_made = source_state(dataset)  # what the plans are made from, by value
    loader._device_conversion = None
    loader._fast_dataset, loader._fast_reason = None, None
    loader._worker_dataset = loader._head_dataset = None
    loader._path = "torch"
    level, line = decide_path(loader, dataset)
    apply_defaults(loader, first=not loader.__dict__.get("_defaults_set"))
    if loader._path == "torch" and loader.num_workers > 0:
        # torch's workers serve a torchvision DatasetFolder from fastload's index (torch_iter)
        loader._worker_dataset = worker_view(dataset)[0]
    advice = (
        loader._path in ("torch", "head-accelerated")
        and "num_workers" in loader._defaulted
        and not loader.num_workers
    )
    if not (log and (unless is None or loader._path != unless)):
        return
    if loader.decode != "cpu":
        line = line.format(decoder=loader.decoder)
    if advice:
        line += (
            f"; it loads in the main process, as torch's default num_workers=0 ({loader._runs_user_code} "
            f"runs): pass num_workers='auto' to load in {auto_num_workers()} workers"
        )
    _log.log(level, "%s", line.replace("%s", type(dataset).__name__, 1))


def decide_path(loader: Any, dataset: Any) -> tuple[int, str]:
    """Sets the path for ``dataset``; returns the level and line that say it (``%s``: the dataset's class)."""
    if loader.decode != "cpu":
        loader._fast_reason = f"decode={loader.decode!r} decodes on the device"
        loader._path = "device-decode" if loader.decode == "device" else "hybrid"
        return logging.INFO, (  # (the decoder is named once the workers are known)
            f"fastload.DataLoader decodes this %s on {loader.device if loader.device is not None else 'cpu'} "
            f"with {{decoder}}, in a feeder thread {FEEDER_DEPTH} batches ahead of the loop"
        )
    structural = structural_reason(loader)
    if structural is None and is_fast_dataset(dataset) and take_fast(loader, dataset):
        return logging.INFO, "fastload.DataLoader runs the fast path for this %s"
    if not loader._allow_fast:
        loader._fast_reason = "fast_path=False"
        return logging.INFO, "fastload.DataLoader runs torch's iterator for this %s, as fast_path=False asks"
    found = recognize(dataset) if structural is None else None
    if found is not None and found.dataset is not None:
        view: Any = found.dataset
        if loader.exact_pixels and view.transform.reduce:
            loader._fast_reason = (
                "exact_pixels=True: the pipeline draws random parameters, which torch's draws (head "
                "acceleration) reproduce"
            )
        elif loader.exact_pixels:
            view.transform.exact = True
        if loader._fast_reason is None and take_fast(loader, view):
            return logging.INFO, (
                "fastload.DataLoader runs the fast path for this %s: its whole pipeline is fused "
                "with decoding"
            )
    else:
        loader._fast_reason = structural if found is None else found.reason
    line = f"fastload.DataLoader runs torch's iterator for this %s (no acceleration): {loader._fast_reason}"
    if not is_image_folder(dataset) or isinstance(dataset, IterableDataset):
        return logging.WARNING, line
    head: Any
    head, head_reason = head_view(dataset, exact=loader.exact_pixels)
    if head is None:
        return logging.WARNING, f"{line}; no head acceleration: {head_reason}"
    loader._head_dataset = loader._worker_dataset = head
    loader._path = "head-accelerated"
    return logging.WARNING, (
        "fastload.DataLoader accelerates the head of this %s's pipeline on torch's iterator "
        f"({head.transform.describe()}); not the fast path: {loader._fast_reason}"
    )


def apply_defaults(loader: Any, first: bool) -> None:
    """The arguments left to their default, for the path chosen: fastload's where it runs every op
    itself, torch's where it runs code of the user's. ``first``: at construction (torch's checks
    against a defaulted ``num_workers`` run then)."""
    loader._runs_user_code = user_code(loader)
    own = loader._runs_user_code is None
    defaulted = loader._defaulted
    if "num_workers" in defaulted:
        loader.num_workers = auto_num_workers() if own else 0
        asked = loader._asked
        if first:  # torch's checks of the arguments that depend on num_workers, in its words
            torch.utils.data.DataLoader(
                [],  # type: ignore[arg-type]
                num_workers=loader.num_workers,
                multiprocessing_context=asked["multiprocessing_context"],
                prefetch_factor=asked["prefetch_factor"],
                persistent_workers=bool(asked["persistent_workers"]),
            )
        loader.prefetch_factor = None if loader.num_workers == 0 else asked["prefetch_factor"] or 2
        context = asked["multiprocessing_context"]
        loader.__dict__["_persistent_workers"] = bool(asked["persistent_workers"]) and loader.num_workers > 0
        if loader.num_workers > 0:
            loader.multiprocessing_context = reporting_context(context)
        else:
            loader.multiprocessing_context = None
    if "persistent_workers" in defaulted:
        loader.__dict__["_persistent_workers"] = own and loader.num_workers > 0
    if "pin_memory" in defaulted:
        to_cuda = loader.device is not None and loader.device.type == "cuda"
        loader.pin_memory = (own and cuda_available()) or to_cuda
    if "limit_threads" in defaulted:
        loader.limit_threads = own
    loader._defaults_set = True


def take_fast(loader: Any, view: Any) -> bool:
    """The fast path, serving ``view``; ``False`` (and the reason set) where timm's ``fast_collate``
    would get float images, which it casts to uint8 (run as written instead)."""
    dtype = getattr(view.transform, "sample_dtype", torch.uint8)
    if loader._given_collate and dtype != torch.uint8:
        loader._fast_reason = f"timm's fast_collate is given {dtype} images (it stacks uint8 ones)"
        return False
    if loader.device is not None and loader.device.type == "cuda" and view is not loader.dataset:
        # a recognised pipeline: uint8 batches cross to the GPU (4x less traffic), converted there
        view.transform = view.transform.geometry_only()
        loader._device_conversion = view.transform.convert_batch
    loader._fast_dataset = view
    loader._path = "fast"
    import_decode_modules()  # now, not inside the first batch (see torch_iter for torch's path)
    return True


def refresh_path(loader: Any) -> None:
    """At a pass start: a dataset changed (:mod:`fastload._source`) or a ``collate_fn`` /
    ``worker_init_fn`` set since the last pass decides the path and defaults again, as torch's
    loader sees them; workers asked to persist keep what they started with, as torch's do."""
    callables_set = loader.__dict__.pop("_sampler_set", False) or (
        loader.__dict__.pop("_callables_set", False)
        and (loader._persistent_by_default or not loader.persistent_workers or not loader.num_workers)
    )
    if callables_set:
        loader._given_collate = loader.collate_fn is not None and loader.collate_fn is not default_collate
        loader._user_collate = loader.collate_fn
    if loader.decode != "cpu":
        return
    state = source_state(loader.dataset)
    before = loader._source_made
    if not callables_set and same_source(loader._source_key, source_key(loader.dataset)) and before == state:
        return
    pool = loader._engine.pool
    live = (pool is not None and not pool.closed and pool.num_workers > 0) or loader.__dict__.get(
        "_iterator"
    ) is not None
    if live and not loader._persistent_by_default and not callables_set:
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
    stop_workers(loader)
    choose_path(loader, log=True, unless=None if callables_set else loader._path)
