"""Throughput benchmark: images/s of each input pipeline across ``num_workers``.

Run as ``python bench/throughput.py`` or ``python -m fastload bench`` (same options). A
measurement ends when the batch is what a model consumes: a normalized float tensor on the target
device. For every (backend, pipeline, num_workers) the loader is built once, warmed up, then
timed ``--repeat`` times over ``--batches`` batches; the median is reported with the slowest and
fastest run next to it. Each backend's rate is divided by the ``torchvision`` baseline's at the
same ``num_workers`` *in the same run*, since the absolute numbers of a shared machine drift, and
a ratio whose runs spread more than the difference it shows is flagged (``?``).

Backends (those whose dependencies are missing are skipped with a note):

* ``torchvision``: the baseline, ``torchvision.datasets.ImageFolder`` + ``RandomResizedCrop(224)``,
  ``RandomHorizontalFlip``, ``ToTensor``, ``Normalize`` (val: ``Resize(256)``, ``CenterCrop(224)``)
  and ``torch.utils.data.DataLoader``, batches moved to the device;
* ``swap``: the baseline's code unchanged except ``fastload.DataLoader`` in place of torch's
  (the one-line swap: fastload recognises the torchvision pipeline and runs its fast path);
* ``fastload``, ``fastload-threads``, ``memory``, ``device-decode``, ``hybrid``:
  ``fastload.DataLoader`` over files (process or thread workers), over ``InMemoryImageFolder``, with
  decoding on the device, and with each batch split between the device and the CPU workers;
* ``dali``: :class:`fastload.dali.DALILoader` (:func:`dali_backend`); it reports itself
  unavailable, with the install command, where NVIDIA DALI cannot be imported;
* further backends register themselves with :func:`register_backend`.

And one reference row, ``full-decode``: not a pipeline but a yardstick, the rate of a full-size
PIL decode to RGB of the same files (no crop, resize, normalization or batching), measured in one
process and multiplied by the cores the workers can use: ``min(max(1, num_workers), CPUs)``. A
pipeline above it (``vs decode`` > 1) decodes less than every full image, as fastload does when it
decodes only the crop or at a reduced DCT scale; it is not a ceiling.

The columns are explained by :data:`LEGEND` (printed under the table and in ``--help``). Memory is
the PSS (proportional set size) of the benchmark process and all its children: a page shared by k
processes counts 1/k in each, so the worker processes' shared memory is counted once.

Dependencies: this module imports the modules it measures; DALI itself is imported only when the
``dali`` backend builds its loader (``fastload.dali`` never imports it at import time), matplotlib
only for ``--plot``.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from itertools import islice
from pathlib import Path
from typing import Any

import psutil
import torch
import torchvision
from PIL import Image
from tqdm import tqdm

from . import gpu
from . import transforms as T
from .dali import DALILoader, dali_unavailable_reason
from .decode import roi_decoder_available
from .device import auto_num_workers, available_cpus, cuda_available, device_is_cuda
from .folder import ClassIndex, ImageFolder, scan_folder
from .info import environment
from .loader import DataLoader
from .memory import InMemoryImageFolder
from .modelbench import (
    TrainStep,
    build_model,
    format_model_table,
    host_batches,
    model_label,
    model_verdict,
    resident_batches,
    time_steps,
)
from .transforms import IMAGENET_MEAN, IMAGENET_STD

__all__ = [
    "BenchConfig",
    "Backend",
    "LEGEND",
    "PIPELINES",
    "REFERENCE",
    "dali_backend",
    "endless",
    "format_table",
    "legend",
    "full_decode_rates",
    "pipeline_split",
    "register_backend",
    "ring_batches",
    "run",
    "run_model",
    "main",
    "shutdown",
    "split_too_small",
    "steady_counts",
    "verdict",
    "STORY",
]

#: The pipelines every backend implements (``pipeline_split`` gives the folder each reads).
PIPELINES = ("train", "val")
#: The name of the reference row (see the module docstring); accepted in ``--backends``.
REFERENCE = "full-decode"
#: What ``make bench`` measures by default: torch's loader, the one-line swap, fastload's own.
STORY = ("torchvision", "swap", "fastload")
#: Where the records (and the plot, beside them) go unless ``--json`` says otherwise.
DEFAULT_JSON = Path("bench/results/throughput.json")


@dataclass
class BenchConfig:
    """What one benchmark run measures."""

    data: Path
    batch_size: int = 64
    batches: int = 20
    warmup: int = 3
    repeat: int = 3
    device: str = "cpu"
    seed: int = 0
    gpu_transforms: bool = False
    step_ms: float = 0.0  # a simulated model step after each batch (sleep: the CPU stays free)
    #: ``batches`` is a floor, raised per worker count so that the timed batches are never served
    #: from what the workers prefetched (see :func:`steady_counts`); ``False``: exactly ``batches``
    steady: bool = True
    #: the same for ``warmup``
    steady_warmup: bool = True


#: torch's (and fastload's) default ``prefetch_factor``: batches each worker decodes ahead.
PREFETCH_FACTOR = 2
#: Timed batches per run at least this many times the batches the workers hold decoded ahead.
STEADY_FACTOR = 3


def ring_batches(num_workers: int) -> int:
    """The batches a loader with ``num_workers`` workers holds decoded ahead of the consumer."""
    return max(1, num_workers) * PREFETCH_FACTOR


def steady_counts(config: BenchConfig, num_workers: int) -> tuple[int, int]:
    """``(warm-up batches, timed batches per run)`` that measure the steady state, not the ring.

    The workers start decoding as soon as the loader does, and hold up to
    :func:`ring_batches` batches ahead: a run of fewer batches than that is served from the ring
    (measured on 16 CPUs with 14 workers, 15 timed batches after 28 prefetched: 20,255 images/s,
    min-max 10,819-43,916, for a loader that sustains about 7,000). So the warm-up takes the
    ring and one more batch, and each timed run :data:`STEADY_FACTOR` times the ring (the
    config's values are floors). Example: 14 workers -> warm-up 29, runs of 84 batches; 2 workers
    with ``--quick`` (8 batches, 2 warm-up) -> 5 and 12.
    """
    ring = ring_batches(num_workers)
    warmup = max(config.warmup, ring + 1) if config.steady_warmup else config.warmup
    return warmup, max(config.batches, STEADY_FACTOR * ring) if config.steady else config.batches


def split_too_small(config: BenchConfig, pipeline: str, num_workers: int) -> str | None:
    """Why the split of ``pipeline`` cannot measure ``num_workers`` workers, or ``None``.

    An epoch of fewer batches than the workers hold decoded ahead (:func:`ring_batches`) measures
    the epoch boundary -- the workers' ring drained and refilled, for torch's loader its workers
    idle -- rather than the loader: the val split of 600 images at batch 128 (4.7 batches) gave
    torch's loader 715 images/s at 14 workers. Such a row is not measured, and this says why.
    """
    files = len(scan_folder(config.data / pipeline_split(pipeline)))
    per_epoch = files // config.batch_size if pipeline == "train" else -(-files // config.batch_size)
    ring = ring_batches(num_workers)
    if per_epoch >= ring:
        return None
    return (
        f"not measured: {pipeline} at {num_workers} workers: its split holds {per_epoch} batches of "
        f"{config.batch_size} ({files} images), fewer than the {ring} batches {num_workers} workers decode "
        "ahead, so every epoch boundary would be timed rather than the loader. Use a larger split "
        "(python -m fastload synth ROOT --per-class N), a smaller --batch-size or fewer --workers"
    )


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


# --------------------------------------------------------------------------- torchvision baseline


def pipeline_split(pipeline: str) -> str:
    """The folder a pipeline reads: ``train`` -> ``train``, ``val`` -> ``val``."""
    return "train" if pipeline == "train" else "val"


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


# --------------------------------------------------------------------------- measuring


class _ProcessTree:
    """CPU time and memory (PSS) of this process and its descendants (the loaders' workers)."""

    def __init__(self) -> None:
        self._proc = psutil.Process()

    def _procs(self) -> list[Any]:
        try:
            return [self._proc, *self._proc.children(recursive=True)]
        except psutil.Error:
            return [self._proc]

    def cpu_seconds(self) -> float:
        total = 0.0
        for p in self._procs():
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:  # a process that exited in between: its time is gone with it
                pass
        return total

    def pss_bytes(self) -> int | None:
        """Summed PSS of the tree, or ``None`` where the OS reports no PSS (only Linux does).

        Reading it costs the kernel about 10 ms per process (``/proc/<pid>/smaps_rollup``), so it
        is read between timed runs, never during one.
        """
        total = 0
        for p in self._procs():
            try:
                pss = getattr(p.memory_full_info(), "pss", None)
            except psutil.NoSuchProcess:
                continue
            except psutil.Error:  # e.g. AccessDenied: a PSS without this process would be wrong
                return None
            if pss is None:
                return None
            total += pss
        return total


def endless(loader: Iterable[Any]) -> Iterator[Any]:
    """Batches of ``loader`` across epoch boundaries (an epoch restart is part of the cost)."""
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise RuntimeError("the loader yielded no batch: the dataset is smaller than one batch")


def _batch_size_of(batch: Any) -> int:
    images = batch[0] if isinstance(batch, (tuple, list)) else batch
    return len(images)


def _sync(device: str) -> None:
    if device_is_cuda(device) and cuda_available():
        torch.cuda.synchronize()


def measure(
    loader: Iterable[Any], config: BenchConfig, on_batch: Callable[[], Any] | None = None
) -> dict[str, Any]:
    """Times ``config.repeat`` runs of ``config.batches`` batches after ``config.warmup`` batches.

    With ``config.step_ms`` the loop sleeps that long after each batch, like a training step on an
    accelerator (the CPU stays free for the workers), so ``stall_fraction`` (the share of the wall
    time spent waiting in ``next()``) says whether the loader keeps up with such a model.

    Returns:
        ``images_per_s`` (median) and ``images_per_s_runs`` (every run), the medians of
        ``stall_fraction`` and ``cpu_percent`` (CPU time of the process tree per wall second,
        100 = one core), and ``pss_bytes``: the largest PSS of the process tree read after a run.
    """
    it = endless(loader)
    step = config.step_ms / 1000
    tree = _ProcessTree()
    for batch in islice(it, config.warmup):
        del batch
        if step:
            time.sleep(step)
        if on_batch is not None:
            on_batch()
    _sync(config.device)
    rates, stalls, cpus, pss = [], [], [], []
    for _ in range(config.repeat):
        cpu0 = tree.cpu_seconds()
        samples, wait = 0, 0.0
        t0 = time.perf_counter()
        for _ in range(config.batches):
            w0 = time.perf_counter()
            batch = next(it)
            _sync(config.device)
            wait += time.perf_counter() - w0
            samples += _batch_size_of(batch)
            del batch
            if step:
                time.sleep(step)
            if on_batch is not None:
                on_batch()
        wall = time.perf_counter() - t0
        cpu = tree.cpu_seconds() - cpu0
        rates.append(samples / wall)
        stalls.append(wait / wall)
        cpus.append(100.0 * cpu / wall)
        pss.append(tree.pss_bytes())
    known = [p for p in pss if p is not None]
    return {
        "images_per_s": statistics.median(rates),
        "images_per_s_runs": rates,
        "stall_fraction": statistics.median(stalls),
        "cpu_percent": statistics.median(cpus),
        "pss_bytes": max(known) if len(known) == len(pss) else None,
    }


def full_decode_rates(
    config: BenchConfig, pipeline: str, limit: int = 200, on_run: Callable[[], Any] | None = None
) -> list[float]:
    """Single-process full-size decode rates (images/s, PIL to RGB) of the split's first files.

    One rate per ``config.repeat`` pass over up to ``limit`` files read into memory first. The
    ``full-decode`` reference row is this rate times the cores the workers can use, measured before
    and after the rows of each worker count.
    """
    root = config.data / pipeline_split(pipeline)
    files = sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))[:limit]
    if not files:
        raise ValueError(
            f"no files under {root}: pass --data with train/ and val/ folders (python -m fastload synth ROOT)"
        )
    blobs = [f.read_bytes() for f in files]
    rates = []
    for _ in range(max(1, config.repeat)):
        t0 = time.perf_counter()
        for b in blobs:
            Image.open(io.BytesIO(b)).convert("RGB")
        rates.append(len(blobs) / (time.perf_counter() - t0))
        if on_run is not None:
            on_run()
    return rates


def reference_cores(num_workers: int) -> int:
    """The cores the ``full-decode`` reference is scaled to: ``min(max(1, num_workers), CPUs)``.

    Example: 0 workers (decoding in the main process) -> 1; 2 workers -> 2; 8 workers on a
    machine (or affinity mask) with 2 CPUs -> 2, since 8 processes share those 2 cores.
    """
    return min(max(1, num_workers), available_cpus())


def shutdown(loader: Any) -> None:
    inner = getattr(loader, "loader", loader)
    close = getattr(inner, "close", None)
    if callable(close):
        close()


def _bar(progress: bool | None, total: int, desc: str) -> tqdm[Any]:
    """A progress bar on stderr that disappears when done (``progress=None``: only on a terminal)."""
    return tqdm(
        total=total,
        desc=desc,
        unit="batch",
        file=sys.stderr,
        leave=False,
        disable=None if progress is None else not progress,
    )


def _check_names(backends: Sequence[str], pipelines: Sequence[str]) -> None:
    unknown = [b for b in backends if b not in BACKENDS and b != REFERENCE]
    if unknown:
        raise ValueError(f"unknown backend(s) {unknown}; available: {[*BACKENDS, REFERENCE]}")
    bad = [p for p in pipelines if p not in PIPELINES]
    if bad:
        raise ValueError(f"unknown pipeline(s) {bad}; available: {list(PIPELINES)}")


def run(
    config: BenchConfig,
    backends: Sequence[str],
    pipelines: Sequence[str],
    workers: Sequence[int],
    log: Callable[[str], None] = print,
    progress: bool | None = None,
) -> list[dict[str, Any]]:
    """Measures every combination and returns one record per measurement (see the module docs).

    ``log`` receives the table: a note per backend that cannot run here, the header, then the rows
    of each worker count once they and their reference are measured. Every record carries the
    run's ``settings`` and ``environment`` (versions, C extension, DALI, CPUs, load average at the
    start: :func:`fastload.info.environment`).
    ``progress`` shows a bar per measurement on stderr (default: when stderr is a terminal).
    """
    _check_names(backends, pipelines)
    env = environment()
    env["c_extension_used"] = roi_decoder_available()
    settings = {
        "data": str(config.data),
        "batch_size": config.batch_size,
        "batches": config.batches,
        "warmup": config.warmup,
        "repeat": config.repeat,
        "device": config.device,
        "seed": config.seed,
        "gpu_transforms": config.gpu_transforms,
        "step_ms": config.step_ms,
        "torch_threads": torch.get_num_threads(),
        "backends": list(backends),
        "pipelines": list(pipelines),
        "workers": list(workers),
    }
    records: list[dict[str, Any]] = []
    # Backends that cannot run here are named once, before the table, not between its rows.
    skipped = set()
    for name in backends:
        reason = None if name == REFERENCE else BACKENDS[name].unavailable()
        if reason:
            log(f"skipping {name}: {reason}")
            skipped.add(name)
    decode = REFERENCE in backends
    header = _header(bool(config.step_ms), decode)
    log(header)
    log("-" * len(header))

    def add(record: dict[str, Any]) -> None:
        record["settings"] = settings
        record["environment"] = env
        records.append(record)
        log(_row(record, decode))

    def decode_passes(pipeline: str, w: int, when: str) -> list[float]:
        with _bar(progress, max(1, config.repeat), f"{pipeline} workers={w} {REFERENCE} ({when})") as bar:
            return full_decode_rates(config, pipeline, on_run=bar.update)

    for pipeline in pipelines:
        for w in workers:
            too_small = split_too_small(config, pipeline, w)
            if too_small is not None:
                log(too_small)
                continue
            warmup, batches = steady_counts(config, w)
            steady = replace(config, warmup=warmup, batches=batches)
            # The reference brackets the rows it is compared with (measured before and after them):
            # a machine whose speed drifts during a run moves it along with the rows.
            before = decode_passes(pipeline, w, "before") if REFERENCE in backends else None
            measured: list[tuple[str, dict[str, Any]]] = []
            for name in backends:
                if name == REFERENCE or name in skipped:
                    continue
                backend = BACKENDS[name]
                total = warmup + config.repeat * batches
                with _bar(progress, total, f"{pipeline} workers={w} {name}") as bar:
                    loader = backend.build(config, pipeline, w)
                    try:
                        result = measure(loader, steady, on_batch=bar.update)
                    finally:
                        shutdown(loader)
                        del loader
                measured.append((name, result))
            reference = None
            if before is not None:
                cores = reference_cores(w)
                runs = [r * cores for r in before + decode_passes(pipeline, w, "after")]
                reference = {"images_per_s": statistics.median(runs), "images_per_s_runs": runs}
            base = next((result for name, result in measured if name == "torchvision"), None)
            for name, result in measured:
                add(_record(name, pipeline, w, steady, result, base, reference))
            if reference is not None:
                rec = _record(REFERENCE, pipeline, w, config, reference, base, reference)
                rec["reference_cores"] = reference_cores(w)
                add(rec)
    return records


# --------------------------------------------------------------------------- --model: does the GPU wait?

#: The model mode's legend (printed under its table).
MODEL_LEGEND = """\
ceiling      the same training step on one batch already on the device: how fast this device
             trains the model when data costs nothing (measured before and after the loaders)
host ceiling (on a GPU) the same batch as float32 in pinned host memory, copied by the step
             itself (.to(device, non_blocking=True), on the training stream): the best any loader
             of float32 CPU batches gives a loop that copies its batches (the one-line swap's case)
images/s     median of --repeat timed runs of training steps (each run at least one ring of
             prefetched batches, after a warm-up that drains it)
of ceiling   images/s divided by the ceiling's: how busy the loader keeps the device
waiting      share of the wall time the loop waited in next() for a batch; each step ends
             synchronised (as a loop that logs its loss does), so the device was idle meanwhile
CPU cores    CPU time of this process and its workers over the wall time (1.0 = one core busy):
             the ceiling's is the training loop's own; the rest is what the loader costs
step ms      median time of a step outside next(): its launch and the wait for the device to
             finish it. Above the ceiling's without waiting: the loader slows the step itself
launch ms    of which the training thread's own work (the step's call, before the wait): above
             the ceiling's, the loader's threads take the loop's interpreter or cores; a longer
             rest, the loader's own device work shares the device with the model"""


def model_counts(config: BenchConfig, num_workers: int) -> tuple[int, int]:
    """``(warm-up steps, timed steps per run)`` of the model mode: a warm-up that drains the
    prefetched ring (:func:`ring_batches`) and runs of at least one ring. Example: 14 workers,
    ``--warmup 30 --batches 25`` floors -> 30 and 28."""
    ring = ring_batches(num_workers)
    warmup = max(config.warmup, ring + 1) if config.steady_warmup else config.warmup
    return warmup, max(config.batches, ring) if config.steady else config.batches


#: The model table's first column for the rows that no loader feeds.
_FEEDING = {
    "ceiling": "ceiling (data on the device)",
    "host-ceiling": "host ceiling (float32, pinned)",
}


def run_model(
    config: BenchConfig,
    model: str,
    backends: Sequence[str],
    workers: Sequence[int],
    log: Callable[[str], None] = print,
    progress: bool | None = None,
) -> list[dict[str, Any]]:
    """The ``--model`` mode: ``model``'s training step fed by each backend's train pipeline at
    each worker count, and on data already on the device (the ceiling, measured before and after
    the backends of each worker count). One record per row (see :mod:`fastload.modelbench`).
    """
    device = torch.device(config.device)
    classes = len(ClassIndex.from_folder(config.data / pipeline_split("train")))
    net = build_model(model, classes, device)
    step = TrainStep(net, device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # one input size: let cuDNN pick its kernels once
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    cpu = _ProcessTree().cpu_seconds
    env = environment()
    records: list[dict[str, Any]] = []
    usable = []
    for name in backends:
        reason = BACKENDS[name].unavailable()
        if reason:
            log(f"skipping {name}: {reason}")
        else:
            usable.append(name)

    def record(name: str, w: int | None, result: dict[str, Any], warmup: int, steps: int) -> dict[str, Any]:
        rec = {
            "mode": "model",
            "backend": name,
            "feeding": _FEEDING.get(name, name),
            "model": model,
            "num_workers": w,
            "batch_size": config.batch_size,
            "images_per_s": result["images_per_s"],
            "images_per_s_runs": result["images_per_s_runs"],
            "share_of_ceiling": None,
            "waiting": result["waiting"],
            "cpu_cores": result.get("cpu_cores"),
            "step_ms": result.get("step_ms"),
            "launch_ms": result.get("launch_ms"),
            "device": config.device,
            "device_name": device_name,
            "warmup_steps": warmup,
            "timed_steps": steps,
            "repeat": config.repeat,
            "environment": env,
        }
        return rec

    for w in workers:
        too_small = split_too_small(config, "train", w)
        if too_small is not None:
            log(too_small)
            continue
        warmup, steps = model_counts(config, w)
        total = warmup + config.repeat * steps
        with _bar(progress, total, f"{model} ceiling (before)") as bar:
            resident = resident_batches(config.batch_size, classes, device)
            before = time_steps(
                resident, step, warmup, steps, config.repeat, on_step=bar.update, cpu_seconds=cpu
            )
        rows = []
        if device.type == "cuda":  # what a loop that copies float32 host batches reaches at best
            with _bar(progress, total, f"{model} host ceiling") as bar:
                host = host_batches(config.batch_size, classes)
                rows.append(
                    record(
                        "host-ceiling",
                        None,
                        time_steps(
                            host, step, warmup, steps, config.repeat, on_step=bar.update, cpu_seconds=cpu
                        ),
                        warmup,
                        steps,
                    )
                )
        for name in usable:
            with _bar(progress, total, f"{model} workers={w} {name}") as bar:
                loader = BACKENDS[name].build(config, "train", w)
                try:
                    result = time_steps(
                        endless(loader),
                        step,
                        warmup,
                        steps,
                        config.repeat,
                        on_step=bar.update,
                        cpu_seconds=cpu,
                    )
                    decoder = getattr(loader, "decoder", None)  # after the run: a decoder given up shows
                    hybrid = getattr(loader, "hybrid", None)  # the split it settled on, and why
                    split = None if hybrid is None else repr(hybrid)
                finally:
                    shutdown(loader)
                    del loader
            rows.append({**record(name, w, result, warmup, steps), "decoder": decoder, "split": split})
        with _bar(progress, total, f"{model} ceiling (after)") as bar:
            resident = resident_batches(config.batch_size, classes, device)
            after = time_steps(
                resident, step, warmup, steps, config.repeat, on_step=bar.update, cpu_seconds=cpu
            )
        runs = before["images_per_s_runs"] + after["images_per_s_runs"]
        top = record(
            "ceiling",
            None,
            {
                "images_per_s": statistics.median(runs),
                "images_per_s_runs": runs,
                "waiting": statistics.median([before["waiting"], after["waiting"]]),
                "cpu_cores": statistics.median([before["cpu_cores"], after["cpu_cores"]]),
                "step_ms": statistics.median([before["step_ms"], after["step_ms"]]),
                "launch_ms": statistics.median([before["launch_ms"], after["launch_ms"]]),
            },
            warmup,
            steps,
        )
        top["share_of_ceiling"] = 1.0
        for rec in rows:
            rec["share_of_ceiling"] = rec["images_per_s"] / top["images_per_s"]
        records += [top, *rows]
    return records


def _main_model(
    args: argparse.Namespace, config: BenchConfig, backends: list[str], workers: list[int]
) -> int:
    """``--model``: the training-step table, its legend, the records, and the verdict last."""
    config.gpu_transforms = True  # fastload's own pipeline: flip + normalize on the device
    env = environment()
    print(_environment_line(env))
    runs = (
        f"{config.batches} steps"
        if not config.steady
        else f"one ring of prefetched batches or more (at least {config.batches} steps)"
    )
    warm = (
        f"{config.warmup}" if not config.steady_warmup else f"one that drains it (at least {config.warmup})"
    )
    counts = f"{config.repeat} runs of {runs}, after a warm-up of {warm}"
    on = (
        "bf16 autocast, channels_last, SGD"
        if device_is_cuda(config.device)
        else "float32, channels_last, SGD"
    )
    print(
        f"model {model_label(args.model)} ({on}) on {config.device}, data {config.data} (train), batch size "
        f"{config.batch_size}, {counts}, workers {workers}"
    )
    if not device_is_cuda(config.device):
        print(
            "note: no CUDA device in this run: the model trains on the CPU, beside the loader's workers "
            "on the same cores. These figures are not a GPU's"
        )
    try:
        records = run_model(
            config, args.model, backends, workers, progress=False if args.no_progress else None
        )
    except ValueError as e:
        return _error(str(e))
    print(format_model_table(records))
    for r in records:
        if r.get("decoder") and r["backend"] in ("device-decode", "hybrid"):
            print(f"{r['backend']} ({r['num_workers']} workers) decoded with {r['decoder']}")
        if r.get("split"):
            print(f"{r['backend']} ({r['num_workers']} workers) split each batch: {r['split']}")
    print()
    print("rows: ceiling, host ceiling (on a GPU), then each backend (--help lists them)")
    print("columns:")
    print("\n".join("  " + line for line in MODEL_LEGEND.splitlines()))
    out = Path(args.json) if args.json else DEFAULT_JSON.with_name("model.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        json.dump(records, f, indent=1)
    print(f"wrote {out}")
    line = model_verdict(records)
    if line:
        print(f"==> {line}")
    return 0


def _within_noise(runs: Sequence[float], other: Sequence[float]) -> bool | None:
    """Whether the larger min-max spread of two sets of runs exceeds the difference of their medians.

    ``None`` when neither has two runs (no spread known). Example: runs 100, 140, 120 against
    110, 112, 111: spread 40 > difference 9 -> ``True`` (the ratio 1.08 is within noise).
    """
    if len(runs) < 2 and len(other) < 2:
        return None
    spread = max(max(runs) - min(runs), max(other) - min(other))
    return spread > abs(statistics.median(runs) - statistics.median(other))


def _compare(
    result: dict[str, Any], against: dict[str, Any] | None, itself: bool
) -> tuple[float | None, bool | None]:
    """(ratio of the medians, within noise) of ``result`` against another row's result."""
    if against is None or not against["images_per_s"]:
        return None, None
    ratio = result["images_per_s"] / against["images_per_s"]
    if itself:
        return ratio, None
    return ratio, _within_noise(result["images_per_s_runs"], against["images_per_s_runs"])


def _record(
    name: str,
    pipeline: str,
    w: int,
    config: BenchConfig,
    result: dict[str, Any],
    base: dict[str, Any] | None,
    reference: dict[str, Any] | None,
) -> dict[str, Any]:
    rate = result["images_per_s"]
    runs = list(result.get("images_per_s_runs") or [rate])
    vs_tv, tv_noise = _compare(result, base, itself=name == "torchvision")
    vs_decode, decode_noise = _compare(result, reference, itself=name == REFERENCE)
    return {
        "backend": name,
        "pipeline": pipeline,
        "num_workers": w,
        "batch_size": config.batch_size,
        "images_per_s": rate,
        "images_per_s_min": min(runs),
        "images_per_s_max": max(runs),
        "images_per_s_runs": runs,
        "ratio_vs_torchvision": vs_tv,
        "within_noise_vs_torchvision": tv_noise,
        "ratio_vs_full_decode": vs_decode,
        "within_noise_vs_full_decode": decode_noise,
        # without a model step every loop waits all the time (~1.00): no number rather than a meaningless one
        "stall_fraction": result.get("stall_fraction") if config.step_ms else None,
        "cpu_percent": result.get("cpu_percent"),
        "pss_bytes": result.get("pss_bytes"),
        "device": config.device,
        "step_ms": config.step_ms,
        "warmup_batches": config.warmup,
        "timed_batches": config.batches,
    }


# --------------------------------------------------------------------------- the table

LEGEND = f"""\
images/s     median of --repeat timed runs of --batches batches each (by default 3x the batches
             the workers hold prefetched, after a warm-up that drains them: the steady state);
             the time ends when a batch is a normalized float tensor on the device
min-max      the slowest and the fastest of those runs (one run: -)
vs tv        images/s divided by the torchvision row's (same pipeline and workers, same run)
vs decode    images/s divided by the {REFERENCE} row's: above 1.00 the pipeline is faster than
             fully decoding every image, as fastload is when it decodes only the crop or at a
             reduced scale
?            after a ratio: one of the two rows' min-max spread is larger than the difference of
             their medians, so the ratio is within the noise (more --repeat/--batches, a quieter
             machine)
stall        (with --step-ms) share of the time the loop waited for data between model steps
CPU %        CPU time of the benchmark process and its workers per second (100 = one core busy)
PSS MB       memory of the benchmark process and its workers: proportional set size, a page
             shared by k processes counts 1/k in each, so shared memory counts once. It
             includes the benchmark process itself, whose share grows as rows run (e.g. the
             in-memory datasets the memory rows keep): later rows carry what earlier ones left
{REFERENCE:<12} reference, not a pipeline: a full-size PIL decode to RGB of the same files (no
             crop, resize or batching), one process's rate x min(max(1, workers), CPUs),
             measured just before and just after the rows of each worker count (both sets of
             runs), so that a machine whose speed drifts moves it along with those rows
-            no value: one run (min-max), no torchvision or {REFERENCE} row in this run (vs tv,
             vs decode), the reference row (CPU %, PSS MB)"""


def legend(stall: bool = True, records: Sequence[dict[str, Any]] | None = None) -> str:
    """:data:`LEGEND`, without the ``stall`` entry for a table that has no stall column.

    Given ``records``, the legend of that table only: what each printed row is, then the columns
    it has (no ``vs decode`` entry without a reference row).
    """
    lines = LEGEND.splitlines()
    if not stall:
        lines = _without_entry(lines, "stall ")
    if records is None:
        return "\n".join(lines)
    names = list(dict.fromkeys(r["backend"] for r in records))
    lines = _without_entry(lines, f"{REFERENCE:<12} ")
    if REFERENCE not in names:
        lines = _without_entry(_without_entry(lines, "vs decode "), "-            ")
        lines.append("-            no value: one run (min-max), no torchvision row in this run (vs tv)")
    rows = [
        f"  {name:<16} "
        + (
            BACKENDS[name].description
            if name in BACKENDS
            else "reference, not a pipeline: full-size PIL decode rate x cores (see --help)"
        )
        for name in names
    ]
    return "\n".join(["rows:", *rows, "columns:", *("  " + line for line in lines)])


def _without_entry(lines: list[str], key: str) -> list[str]:
    """``lines`` without the legend entry that starts with ``key`` (and its indented continuation)."""
    out, skipping = [], False
    for line in lines:
        if line.startswith(key):
            skipping = True
            continue
        if skipping and line.startswith(" "):
            continue
        skipping = False
        out.append(line)
    return out


def verdict(records: Sequence[dict[str, Any]]) -> str | None:
    """The one line ``make bench`` answers with: the one-line swap's (and fastload's own pipeline's)
    images/s over torch's, at the largest worker count measured, per pipeline.

    Example: ``the one-line swap: 3.0x torch's images/s on this machine (train, 2 workers); val
    3.1x. fastload's own pipeline: 3.4x (train), 3.3x (val)``.
    """
    by_key = {(r["backend"], r["pipeline"], r["num_workers"]): r for r in records}
    workers = max((r["num_workers"] for r in records), default=None)
    pipelines = list(dict.fromkeys(r["pipeline"] for r in records))

    noisy = False

    def ratios(backend: str) -> list[tuple[str, str]]:
        nonlocal noisy
        out = []
        for p in pipelines:
            r = by_key.get((backend, p, workers))
            if r is not None and r["ratio_vs_torchvision"] is not None:
                flag = "?" if r["within_noise_vs_torchvision"] else ""
                noisy |= bool(flag)
                out.append((p, f"{r['ratio_vs_torchvision']:.1f}x{flag}"))
        return out

    swap, own = ratios("swap"), ratios("fastload")
    if not swap and not own:
        return None
    parts = []
    if swap:
        (p0, r0), rest = swap[0], swap[1:]
        parts.append(
            f"the one-line swap: {r0} torch's images/s on this machine ({p0}, {workers} workers)"
            + "".join(f"; {p} {r}" for p, r in rest)
        )
    if own:
        parts.append("fastload's own pipeline: " + ", ".join(f"{r} ({p})" for p, r in own))
    line = ". ".join(parts)
    if noisy:
        line += " (?: within the run-to-run noise of this machine; more --repeat or a quieter machine)"
    return line


def _header(stall: bool, decode: bool = True) -> str:
    return (
        f"{'backend':<16} {'pipeline':<8} {'workers':>7} {'images/s':>9} {'min-max':>11} "
        f"{'vs tv':>6}"
        + (f" {'vs decode':>10}" if decode else "")
        + (f" {'stall':>6}" if stall else "")
        + f" {'CPU %':>6} {'PSS MB':>7}"
    )


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _ratio(value: float | None, noisy: bool | None) -> str:
    return "-" if value is None else f"{value:.2f}" + ("?" if noisy else " ")


def _row(r: dict[str, Any], decode: bool = True) -> str:
    pss = None if r["pss_bytes"] is None else r["pss_bytes"] / 2**20
    runs = r["images_per_s_runs"]
    spread = f"{r['images_per_s_min']:.0f}-{r['images_per_s_max']:.0f}" if len(runs) > 1 else "-"
    stall = f" {_fmt(r['stall_fraction'], '.2f'):>6}" if r["step_ms"] else ""
    return (
        f"{r['backend']:<16} {r['pipeline']:<8} {r['num_workers']:>7} {r['images_per_s']:>9.1f} "
        f"{spread:>11} {_ratio(r['ratio_vs_torchvision'], r['within_noise_vs_torchvision']):>7}"
        + (f"{_ratio(r['ratio_vs_full_decode'], r['within_noise_vs_full_decode']):>10}" if decode else "")
        + f"{stall} "
        f"{_fmt(r['cpu_percent'], '.0f'):>6} {_fmt(pss, '.0f'):>7}"
    )


def format_table(records: Sequence[dict[str, Any]]) -> str:
    """The records as the printed table (with a stall column when they were run with ``step_ms``)."""
    decode = any(r["backend"] == REFERENCE for r in records)
    header = _header(any(r["step_ms"] for r in records), decode)
    return "\n".join([header, "-" * len(header), *(_row(r, decode) for r in records)])


def plot(records: Sequence[dict[str, Any]], path: str) -> None:
    """images/s (median, min-max bars) vs num_workers, one line per backend, one panel per pipeline."""
    try:  # optional dependency (the bench extra), only for --plot
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("--plot needs matplotlib: pip install 'fastload[bench]'") from None
    pipelines = sorted({r["pipeline"] for r in records})
    fig, axes = plt.subplots(1, len(pipelines), figsize=(5 * len(pipelines), 4), squeeze=False)
    for ax, pipeline in zip(axes[0], pipelines, strict=False):
        rows = [r for r in records if r["pipeline"] == pipeline]
        for name in dict.fromkeys(r["backend"] for r in rows):
            pts = sorted(
                (r["num_workers"], r["images_per_s"], r["images_per_s_min"], r["images_per_s_max"])
                for r in rows
                if r["backend"] == name
            )
            x, y, low, high = zip(*pts, strict=True)
            ax.errorbar(
                x,
                y,
                yerr=[
                    [m - lo for m, lo in zip(y, low, strict=True)],
                    [hi - m for m, hi in zip(y, high, strict=True)],
                ],
                marker="o",
                capsize=3,
                label=name,
                linestyle="--" if name == REFERENCE else "-",
            )
        ax.set_xticks(sorted({r["num_workers"] for r in rows}))  # worker counts are integers
        ax.set_title(f"{pipeline} pipeline")
        ax.set_xlabel("num_workers (0 = main process)")
        ax.set_ylabel("throughput (images/s), bars: min-max of runs")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


# --------------------------------------------------------------------------- command line


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return values


def _names(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def default_data() -> Path:
    """The default dataset folder (``make bench`` creates it): ``~/.cache/fastload/synthetic-imagenet``."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "fastload" / "synthetic-imagenet"


def _help_text() -> str:
    lines = ["fastload throughput benchmark: images/s of each backend x pipeline x num_workers.", ""]
    lines.append("backends (--backends; default: all of them, the unavailable ones skipped with a note):")
    for b in BACKENDS.values():
        lines.append(f"  {b.name:<17} {b.description}".rstrip())
    lines.append(f"  {REFERENCE:<17} reference row: full-size PIL decode rate x cores (see below)")
    lines.append("")
    lines.append("pipelines (--pipelines; default: train,val):")
    lines.append(
        "  train             RandomResizedCrop(224) + RandomHorizontalFlip + normalize (train/ folder)"
    )
    lines.append("  val               Resize(256) + CenterCrop(224) + normalize (val/ folder)")
    return "\n".join(lines)


def build_parser(prog: str = "bench/throughput.py") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description=_help_text(),
        epilog="columns of the table:\n" + LEGEND,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--data",
        type=Path,
        default=None,
        help=f"dataset root with train/ and val/ (default {default_data()})",
    )
    p.add_argument(
        "--workers",
        type=_ints,
        default=None,
        help="num_workers values, e.g. 0,1,2 (default: 0 and this machine's CPUs, e.g. 0,2)",
    )
    p.add_argument(
        "--backends",
        type=_names,
        default=None,
        help="comma-separated backends (default: " + ",".join(STORY) + "; --all: every one, see above)",
    )
    p.add_argument(
        "--all",
        action="store_true",
        help="every backend and the full-decode reference row (GPU-only rows only where CUDA is)",
    )
    p.add_argument(
        "--pipelines", type=_names, default=list(PIPELINES), help="train, val or train,val (default)"
    )
    p.add_argument("--batch-size", type=int, default=None, help="default 64 (--quick: 32)")
    p.add_argument(
        "--batches",
        type=int,
        default=None,
        help=f"batches per timed run (default: {STEADY_FACTOR}x the batches the workers prefetch, "
        "num_workers x 2, and at least 20; --quick: at least 8). Given: exactly this many",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="batches before timing (default: the batches the workers prefetch and one more, at least 3; "
        "--quick: at least 2). Given: exactly this many",
    )
    p.add_argument(
        "--repeat", type=int, default=3, help="timed runs per setting; the median is reported (default 3)"
    )
    p.add_argument(
        "--step-ms",
        type=float,
        default=0.0,
        help="simulate a model step of this many ms after each batch (a sleep: the CPU stays free, as "
        "with a GPU model) and show the stall column (default 0: no model, no stall column)",
    )
    p.add_argument(
        "--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available, else cpu)"
    )
    p.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch.set_num_threads(N) in the benchmark process, where 0-worker rows do all their work "
        "(default: torch's, one per core). On a busy machine torch's threads wait for each other "
        "whenever another program holds a core, and 0-worker rows slow down several-fold and vary: "
        "1 gives steadier numbers there",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a short configuration (make bench): --batch-size 32 --batches 8 --warmup 2",
    )
    p.add_argument(
        "--gpu-transforms",
        action="store_true",
        help="fastload backends: flip + normalize on the device (gpu transforms) instead of in the workers",
    )
    p.add_argument(
        "--model",
        metavar="NAME",
        help="does the GPU wait for data? Train this torchvision classification model (resnet50, "
        "resnet18, ...; 'tiny': a one-convolution model for a CPU) on the train pipeline of each backend "
        "and on data already on the device (the ceiling): images/s, share of the ceiling, time waiting. "
        "Batch size default 256; workers default this machine's CPUs; fastload's own pipeline flips and "
        "normalizes on the device",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars (default: on a terminal)")
    p.add_argument(
        "--json",
        metavar="PATH",
        help=f"write one record per measurement, with settings and versions, here (default {DEFAULT_JSON})",
    )
    p.add_argument(
        "--plot",
        metavar="PATH.png",
        help="plot images/s vs num_workers here (default: beside the JSON, .png; needs matplotlib)",
    )
    return p


def _error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def _device(text: str | None) -> str:
    """The ``--device`` value checked: a ``ValueError`` with one clear sentence if unusable here."""
    if text is None:
        return "cuda" if cuda_available() else "cpu"
    try:
        device = torch.device(text)
    except RuntimeError:
        raise ValueError(f"--device should be cpu, cuda or cuda:N, but got --device={text!r}") from None
    if device_is_cuda(device) and not cuda_available():
        raise ValueError(
            f"--device={text}: CUDA is not available on this machine (torch.cuda.is_available() is False: "
            "no NVIDIA GPU or driver, or a CPU-only torch build); leave --device out to measure on the CPU"
        )
    return text


def _environment_line(env: dict[str, Any]) -> str:
    load = env["load_average"]
    dali = f"DALI {env['dali']}" if env["dali"] else "DALI not installed"
    return (
        f"fastload {env['fastload']}, torch {env['torch']}, torchvision {env['torchvision']}, "
        f"Pillow {env['pillow']}; C extension {env['c_extension']}; {dali}; "
        f"{env['available_cpus']} CPUs available ({env['cpu_count']} on the machine)"
        + (f", load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}" if load else "")
    )


def _busy_machine_note(env: dict[str, Any], threads: int, workers: Sequence[int]) -> str | None:
    """A warning when other programs' load leaves torch's threads fewer cores than it has threads.

    With 0 workers the loading runs in this process, and torch's intra-op threads (one per core by
    default) wait for each other at every op whenever one of them is descheduled. Measured on 2
    shared cores at a load average of 4.1-5.1 (val, 0 workers, 3 alternating runs each): 2 threads
    gave torchvision 18-30 images/s and fastload 78-161, a fastload/torchvision ratio anywhere
    from 2.6 to 7.1; ``--torch-threads 1`` gave 105-144 and 214-290, a ratio of 2.01-2.03.
    """
    load = env.get("load_average")
    if not load or threads < 2 or 0 not in workers:
        return None
    cpus = env["available_cpus"]
    if load[0] < 1.0 or load[0] + threads <= cpus + 0.5:  # no other program holds a core
        return None
    return (
        f"note: load average {load[0]:.1f} on {cpus} CPUs, and torch runs {threads} threads in this process: "
        "the 0-worker rows (loading in this process) may run several times slower and vary widely, as "
        "torch's threads wait for each other while other programs hold cores. A quieter machine, or "
        "--torch-threads 1, gives steadier numbers"
    )


def main(argv: Sequence[str] | None = None, prog: str = "bench/throughput.py") -> int:
    """The command line; returns the exit status (2 with one ``error:`` line on bad input)."""
    args = build_parser(prog).parse_args(argv)
    q = args.quick
    data = args.data or default_data()
    model = args.model is not None
    config = BenchConfig(
        data=data,
        batch_size=args.batch_size if args.batch_size is not None else (256 if model else 32 if q else 64),
        batches=args.batches if args.batches is not None else (25 if model else 8 if q else 20),
        warmup=args.warmup if args.warmup is not None else (30 if model else 2 if q else 3),
        repeat=args.repeat,
        gpu_transforms=args.gpu_transforms,
        step_ms=args.step_ms,
        steady=args.batches is None,  # given: exactly that many
        steady_warmup=args.warmup is None,
    )
    for name, value, low in (
        ("batch-size", config.batch_size, 1),
        ("batches", config.batches, 1),
        ("warmup", config.warmup, 0),
        ("repeat", config.repeat, 1),
    ):
        if value < low:
            kind = "a positive" if low else "a non-negative"
            return _error(f"--{name} should be {kind} integer, but got --{name}={value}")
    if not (config.step_ms >= 0 and math.isfinite(config.step_ms)):
        return _error(f"--step-ms should be a non-negative number, but got --step-ms={config.step_ms}")
    threads = args.torch_threads
    if threads is not None and threads < 1:
        return _error(f"--torch-threads should be a positive integer, but got --torch-threads={threads}")
    if args.backends:
        backends = list(args.backends)
    elif args.all:
        backends = ["torchvision", *[b for b in BACKENDS if b != "torchvision"], REFERENCE]
    else:
        backends = list(STORY)
    if "decode-ceiling" in backends:  # its earlier name: it is a reference, not a ceiling
        print(f"note: the decode-ceiling row is now called {REFERENCE}", file=sys.stderr)
        backends = [REFERENCE if b == "decode-ceiling" else b for b in backends]
    try:
        config.device = _device(args.device)
        _check_names(backends, args.pipelines)
    except ValueError as e:
        return _error(str(e))
    for pipeline in args.pipelines:
        if not (data / pipeline_split(pipeline)).is_dir():
            return _error(
                f"{data / pipeline_split(pipeline)} not found. Make a dataset first: "
                f"python -m fastload synth {data}"
            )
    if model:
        if REFERENCE in backends:
            return _error(f"--model measures loaders feeding a model: {REFERENCE} is no loader")
        return _main_model(args, config, backends, args.workers or [auto_num_workers()])
    workers = args.workers or sorted({0, auto_num_workers()})
    if args.all and not args.backends and not device_is_cuda(config.device):
        gpu_rows = [b for b in backends if b in BACKENDS and BACKENDS[b].gpu_only]
        backends = [b for b in backends if b not in gpu_rows]
        if gpu_rows:
            print(f"skipping {', '.join(gpu_rows)}: GPU pipelines, and this run has no CUDA device")
    if threads is not None:
        torch.set_num_threads(threads)
    env = environment()
    print(_environment_line(env))
    note = _busy_machine_note(env, torch.get_num_threads(), workers)
    if note:
        print(note)
    runs = (
        f"{config.batches} batches"
        if not config.steady
        else f"{STEADY_FACTOR}x the batches the workers prefetch (at least {config.batches})"
    )
    warm = (
        f"{config.warmup} batches"
        if not config.steady_warmup
        else f"those and one more (at least {config.warmup})"
    )
    counts = f"{config.repeat} runs (median, min-max) of {runs}, after a warm-up of {warm}"
    print(
        f"data {data}, device {config.device}, batch size {config.batch_size}, {counts}, workers {workers}"
        + (f", model step {config.step_ms:g} ms" if config.step_ms else "")
    )
    try:
        records = run(config, backends, args.pipelines, workers, progress=False if args.no_progress else None)
    except ValueError as e:
        return _error(str(e))
    print()
    print(legend(stall=bool(config.step_ms), records=records))
    out = Path(args.json) if args.json else DEFAULT_JSON
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        json.dump(records, f, indent=1)
    wrote = [str(out)]
    plot_path = args.plot or str(out.with_suffix(".png"))
    try:
        if records:
            plot(records, plot_path)
            wrote.append(plot_path)
    except ImportError as e:
        if args.plot:
            raise
        wrote.append(f"no plot ({e})")
    print("wrote " + ", ".join(wrote))
    line = verdict(records)
    if line:
        print(f"==> {line}")
    return 0
