"""The pipelines under test: each backend builds a loader of ``(images, labels)`` batches.

A batch is what a model consumes: a normalized float tensor on the target device. Registered
here (:data:`BACKENDS`, in this order; those whose dependencies are missing are skipped with a
note):

* ``torchvision``: the baseline, ``torchvision.datasets.ImageFolder`` + ``RandomResizedCrop(224)``,
  ``RandomHorizontalFlip``, ``ToTensor``, ``Normalize`` (val: ``Resize(256)``, ``CenterCrop(224)``)
  and ``torch.utils.data.DataLoader``, batches moved to the device;
* ``swap``: the baseline's code unchanged except ``fastload.DataLoader`` in place of torch's
  (the one-line swap: fastload recognises the torchvision pipeline and runs its fast path);
  ``swap-torch-path``: the same with an op fastload does not reproduce, so torch's iterator runs;
* ``fastload``, ``fastload-threads``, ``memory``, ``device-decode``, ``hybrid``:
  ``fastload.DataLoader`` over files (process or thread workers), over ``InMemoryImageFolder``, with
  decoding on the device, and with each batch split between the device and the CPU workers;
* ``dali``: :class:`fastload.dali.DALILoader` (:func:`dali_backend`); it reports itself
  unavailable, with the install command, where NVIDIA DALI cannot be imported;
* further backends register themselves with :func:`register_backend`.

DALI itself is imported only when the ``dali`` backend builds its loader (``fastload.dali`` never
imports it at import time).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torchvision

from fastload import gpu
from fastload import transforms as T
from fastload.dali import DALILoader, dali_unavailable_reason
from fastload.device import device_is_cuda
from fastload.folder import ClassIndex, scan_folder
from fastload.imagefolder import ImageFolder
from fastload.loader import DataLoader
from fastload.memory import InMemoryImageFolder
from fastload.transforms import IMAGENET_MEAN, IMAGENET_STD

from .config import PIPELINES, REFERENCE, BenchConfig, pipeline_split


@dataclass
class Backend:
    """A pipeline under test.

    Attributes:
        name: Column value in the table and JSON.
        build: ``build(config, pipeline, num_workers)`` returns an iterable of ``(images, labels)``
            batches (images normalized float on ``config.device``); iterated again for each epoch.
        unavailable: ``unavailable()`` returns why the backend cannot run here, or ``None``.
        description: One line for ``--help`` and the legend.
        gpu_only: Measures a GPU pipeline (``--all`` leaves it out without CUDA).
    """

    name: str
    build: Callable[[BenchConfig, str, int], Iterable[Any]]
    unavailable: Callable[[], str | None] = lambda: None
    description: str = ""
    gpu_only: bool = False  # a GPU pipeline: --all leaves it out on a machine without CUDA


BACKENDS: dict[str, Backend] = {}


def register_backend(backend: Backend) -> None:
    """Adds a backend (by name) to the benchmark."""
    BACKENDS[backend.name] = backend


def check_names(backends: Sequence[str], pipelines: Sequence[str]) -> None:
    """Raises ``ValueError`` naming the unknown backends or pipelines, and the known ones."""
    unknown = [b for b in backends if b not in BACKENDS and b != REFERENCE]
    if unknown:
        raise ValueError(f"unknown backend(s) {unknown}; available: {[*BACKENDS, REFERENCE]}")
    bad = [p for p in pipelines if p not in PIPELINES]
    if bad:
        raise ValueError(f"unknown pipeline(s) {bad}; available: {list(PIPELINES)}")


# --------------------------------------------------------------------------- torchvision baseline


class Unrecognised:
    """An op that returns its input and that fastload does not reproduce: a pipeline ending with
    it runs on torch's iterator (backend ``swap-torch-path``)."""

    def __call__(self, x: Any) -> Any:
        return x


def _torchvision_transform(pipeline: str, unrecognised: bool = False) -> Any:
    tv = torchvision.transforms
    normalize = tv.Normalize(IMAGENET_MEAN, IMAGENET_STD)
    if pipeline == "train":
        ops = [tv.RandomResizedCrop(224), tv.RandomHorizontalFlip(), tv.ToTensor(), normalize]
    else:
        ops = [tv.Resize(256), tv.CenterCrop(224), tv.ToTensor(), normalize]
    return tv.Compose(ops + [Unrecognised()] if unrecognised else ops)


class _ToDevice:
    """Iterates a loader and moves each batch to the device (part of the measured work)."""

    def __init__(self, loader: Iterable[Any], device: str) -> None:
        self.loader = loader
        self.device = torch.device(device)

    def __iter__(self) -> Iterator[Any]:
        non_blocking = device_is_cuda(self.device)
        for images, labels in self.loader:
            yield (
                images.to(self.device, non_blocking=non_blocking),
                labels.to(self.device, non_blocking=non_blocking),
            )


def _build_torchvision(
    config: BenchConfig,
    pipeline: str,
    num_workers: int,
    loader_class: Any = torch.utils.data.DataLoader,
    unrecognised: bool = False,
) -> Iterable[Any]:
    dataset = torchvision.datasets.ImageFolder(
        str(config.data / pipeline_split(pipeline)), transform=_torchvision_transform(pipeline, unrecognised)
    )
    loader = loader_class(
        dataset,
        batch_size=config.batch_size,
        shuffle=pipeline == "train",
        num_workers=num_workers,
        pin_memory=device_is_cuda(config.device),
        persistent_workers=num_workers > 0,
        drop_last=pipeline == "train",
    )
    return _ToDevice(loader, config.device)


register_backend(
    Backend(
        "torchvision",
        _build_torchvision,
        description="the baseline: torchvision ImageFolder + transforms + torch DataLoader",
    )
)


def _build_swapped(config: BenchConfig, pipeline: str, num_workers: int) -> Iterable[Any]:
    """The baseline's code with only the DataLoader class swapped (one-line acceleration)."""
    return _build_torchvision(config, pipeline, num_workers, loader_class=DataLoader)


register_backend(
    Backend(
        "swap",
        _build_swapped,
        description="the baseline with only torch's DataLoader class replaced by fastload.DataLoader",
    )
)


def _build_swapped_torch_path(config: BenchConfig, pipeline: str, num_workers: int) -> Iterable[Any]:
    """``swap`` with an op fastload does not reproduce at the end of the pipeline: torch's iterator."""
    return _build_torchvision(config, pipeline, num_workers, loader_class=DataLoader, unrecognised=True)


register_backend(
    Backend(
        "swap-torch-path",
        _build_swapped_torch_path,
        description="swap, with an op fastload does not reproduce (returns its input): torch's iterator",
    )
)


# --------------------------------------------------------------------------- fastload backends


def _fastload_transform(pipeline: str, config: BenchConfig) -> Any:
    if pipeline == "train":
        if config.gpu_transforms:  # the flip runs on the device, with the normalization
            return T.RandomResizedCrop(224)
        return T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip()])
    return T.Compose([T.Resize(256), T.CenterCrop(224)])


def _device_transforms(pipeline: str, config: BenchConfig, decode_on_device: bool = False) -> Any:
    normalize = gpu.Normalize(IMAGENET_MEAN, IMAGENET_STD)
    if decode_on_device:
        if pipeline == "train":
            return gpu.Compose([gpu.RandomResizedCrop(224), gpu.RandomHorizontalFlip(), normalize])
        return gpu.Compose([gpu.Resize(256), gpu.CenterCrop(224), normalize])
    if config.gpu_transforms and pipeline == "train":
        return gpu.Compose([gpu.RandomHorizontalFlip(), normalize])
    return normalize


def _fastload_loader(
    dataset: Any, config: BenchConfig, pipeline: str, num_workers: int, **kwargs: Any
) -> Any:
    kwargs.setdefault("gpu_transforms", _device_transforms(pipeline, config))
    return DataLoader(
        dataset,
        batch_size=config.batch_size,
        shuffle=pipeline == "train",
        drop_last=pipeline == "train",
        num_workers=num_workers,
        seed=config.seed,
        device=config.device,
        **kwargs,
    )


def _build_fastload(config: BenchConfig, pipeline: str, num_workers: int) -> Iterable[Any]:
    dataset = ImageFolder(
        config.data / pipeline_split(pipeline), transform=_fastload_transform(pipeline, config)
    )
    return _fastload_loader(dataset, config, pipeline, num_workers)


def _build_fastload_threads(config: BenchConfig, pipeline: str, num_workers: int) -> Iterable[Any]:
    dataset = ImageFolder(
        config.data / pipeline_split(pipeline), transform=_fastload_transform(pipeline, config)
    )
    return _fastload_loader(dataset, config, pipeline, num_workers, worker_type="thread")


_MEMORY_CACHE: dict[tuple[str, str], Any] = {}


def _memory_dataset(config: BenchConfig, pipeline: str) -> Any:
    key = (str(config.data), pipeline)
    if key not in _MEMORY_CACHE:  # load the bytes once per run, outside the timed part
        _MEMORY_CACHE[key] = InMemoryImageFolder(config.data / pipeline_split(pipeline))
    return _MEMORY_CACHE[key]


def _build_memory(config: BenchConfig, pipeline: str, num_workers: int) -> Iterable[Any]:
    dataset = _memory_dataset(config, pipeline)
    dataset.transform = _fastload_transform(pipeline, config)
    return _fastload_loader(dataset, config, pipeline, num_workers)


def _build_device_decode(
    config: BenchConfig, pipeline: str, num_workers: int, decode: str = "device"
) -> Iterable[Any]:
    """``decode="device"`` (or ``"hybrid"``) over ``InMemoryImageFolder``, the crop on the device."""
    dataset = _memory_dataset(config, pipeline)
    dataset.transform = None
    return _fastload_loader(
        dataset,
        config,
        pipeline,
        num_workers,
        decode=decode,
        gpu_transforms=_device_transforms(pipeline, config, True),
    )


def _build_hybrid(config: BenchConfig, pipeline: str, num_workers: int) -> Iterable[Any]:
    return _build_device_decode(config, pipeline, num_workers, decode="hybrid")


register_backend(Backend("fastload", _build_fastload, description="fastload.DataLoader over the files"))
register_backend(
    Backend("fastload-threads", _build_fastload_threads, description="the same with thread workers")
)
register_backend(Backend("memory", _build_memory, description="fastload.DataLoader over InMemoryImageFolder"))
register_backend(
    Backend(
        "device-decode",
        _build_device_decode,
        description="decode='device' (nvJPEG on CUDA; on a CPU device: in the main process)",
        gpu_only=True,
    )
)
register_backend(
    Backend(
        "hybrid",
        _build_hybrid,
        description="decode='hybrid': each batch split between the device's decoder and the CPU workers",
        gpu_only=True,
    )
)


# --------------------------------------------------------------------------- DALI backend


def _build_dali(config: BenchConfig, pipeline: str, num_workers: int) -> DALILoader:
    classes = ClassIndex.from_folder(config.data / "train")
    index = scan_folder(config.data / pipeline_split(pipeline), classes)
    return DALILoader(  # imports DALI (ImportError naming the install command without it)
        index,
        config.batch_size,
        train=pipeline == "train",
        seed=config.seed,
        device=config.device,
        num_threads=max(1, num_workers),
        num_replicas=1,
        rank=0,
        mean=IMAGENET_MEAN,
        std=IMAGENET_STD,
    )


def dali_backend() -> Backend:
    """The ``dali`` backend (``num_workers`` maps to DALI's ``num_threads``, 0 -> 1).

    Registered by default; where DALI cannot be imported, ``unavailable()`` says why and names
    ``pip install 'fastload[dali]'``, and :func:`run` skips the backend.
    """
    return Backend(
        "dali",
        _build_dali,
        dali_unavailable_reason,
        description="fastload.dali.DALILoader (NVIDIA DALI; its CPU pipeline without CUDA)",
        gpu_only=True,
    )


register_backend(dali_backend())
