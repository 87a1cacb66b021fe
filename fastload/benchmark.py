"""Throughput benchmark: images/s of each input pipeline across ``num_workers``.

Run as ``python bench/throughput.py`` or ``python -m fastload bench`` (same options). A
measurement ends when the batch is what a model consumes: a normalized float tensor on the target
device. For every (backend, pipeline, num_workers) the loader is built once, warmed up, then
timed ``--repeat`` times over ``--batches`` batches; the median is reported. Each backend's rate
is divided by the ``torchvision`` baseline's at the same ``num_workers`` *in the same run*, since
the absolute numbers of a shared machine drift.

Backends (those whose dependencies are missing are skipped with a note):

* ``torchvision``: the baseline, ``torchvision.datasets.ImageFolder`` + ``RandomResizedCrop(224)``,
  ``RandomHorizontalFlip``, ``ToTensor``, ``Normalize`` (val: ``Resize(256)``, ``CenterCrop(224)``)
  and ``torch.utils.data.DataLoader``, batches moved to the device;
* ``decode-ceiling``: not a pipeline, the physical limit: the single-process full-size decode rate
  of the same files (PIL) times the number of worker processes;
* ``fastload``, ``fastload-threads``, ``memory``, ``device-decode``: ``fastload.DataLoader`` over
  files (process or thread workers), over ``InMemoryImageFolder``, and with decoding on the device;
* ``dali``: :class:`fastload.dali.DALILoader` (:func:`dali_backend`); it reports itself
  unavailable, with the install command, where NVIDIA DALI cannot be imported;
* further backends register themselves with :func:`register_backend`.

Dependencies: this module imports the modules it measures; DALI itself is imported only when the
``dali`` backend builds its loader (``fastload.dali`` never imports it at import time), matplotlib
only for ``--plot``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import psutil
import torch
import torchvision
from PIL import Image

from . import gpu
from . import transforms as T
from .dali import DALILoader, dali_unavailable_reason
from .device import cuda_available, device_is_cuda
from .folder import ClassIndex, ImageFolder, scan_folder
from .loader import DataLoader
from .memory import InMemoryImageFolder
from .transforms import IMAGENET_MEAN, IMAGENET_STD

__all__ = ["BenchConfig", "Backend", "dali_backend", "pipeline_split", "register_backend", "run", "main"]


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


@dataclass
class Backend:
    """A pipeline under test.

    Attributes:
        name: Column value in the table and JSON.
        build: ``build(config, pipeline, num_workers)`` returns an iterable of ``(images, labels)``
            batches (images normalized float on ``config.device``); iterated again for each epoch.
        unavailable: ``unavailable()`` returns why the backend cannot run here, or ``None``.
    """

    name: str
    build: Callable[[BenchConfig, str, int], Iterable[Any]]
    unavailable: Callable[[], str | None] = lambda: None


BACKENDS: dict[str, Backend] = {}


def register_backend(backend: Backend) -> None:
    """Adds a backend (by name) to the benchmark."""
    BACKENDS[backend.name] = backend


# --------------------------------------------------------------------------- torchvision baseline


def pipeline_split(pipeline: str) -> str:
    """The folder a pipeline reads: ``train`` -> ``train``, ``val`` -> ``val``."""
    return "train" if pipeline == "train" else "val"


def _torchvision_transform(pipeline: str) -> Any:
    tv = torchvision.transforms
    normalize = tv.Normalize(IMAGENET_MEAN, IMAGENET_STD)
    if pipeline == "train":
        return tv.Compose([tv.RandomResizedCrop(224), tv.RandomHorizontalFlip(), tv.ToTensor(), normalize])
    return tv.Compose([tv.Resize(256), tv.CenterCrop(224), tv.ToTensor(), normalize])


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


def _build_torchvision(config: BenchConfig, pipeline: str, num_workers: int) -> Iterable[Any]:
    dataset = torchvision.datasets.ImageFolder(
        str(config.data / pipeline_split(pipeline)), transform=_torchvision_transform(pipeline)
    )
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=config.batch_size,
        shuffle=pipeline == "train",
        num_workers=num_workers,
        pin_memory=device_is_cuda(config.device),
        persistent_workers=num_workers > 0,
        drop_last=pipeline == "train",
    )
    return _ToDevice(loader, config.device)


register_backend(Backend("torchvision", _build_torchvision))


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


def _build_device_decode(config: BenchConfig, pipeline: str, num_workers: int) -> Iterable[Any]:
    dataset = _memory_dataset(config, pipeline)
    dataset.transform = None
    return _fastload_loader(
        dataset,
        config,
        pipeline,
        num_workers,
        decode="device",
        gpu_transforms=_device_transforms(pipeline, config, True),
    )


register_backend(Backend("fastload", _build_fastload))
register_backend(Backend("fastload-threads", _build_fastload_threads))
register_backend(Backend("memory", _build_memory))
register_backend(Backend("device-decode", _build_device_decode))


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
    return Backend("dali", _build_dali, dali_unavailable_reason)


register_backend(dali_backend())


# --------------------------------------------------------------------------- measuring


class _ResourceSampler:
    """Samples the RSS of this process and its children (workers) in a background thread."""

    def __init__(self, interval: float = 0.05) -> None:
        self._proc = psutil.Process()
        self.interval = interval
        self.peak_rss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

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
            except psutil.Error:
                pass
        return total

    def _sample(self) -> None:
        rss = 0
        for p in self._procs():
            try:
                rss += p.memory_info().rss
            except psutil.Error:
                pass
        self.peak_rss = max(self.peak_rss, rss)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> _ResourceSampler:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def _endless(loader: Iterable[Any]) -> Iterator[Any]:
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


def measure(loader: Iterable[Any], config: BenchConfig) -> dict[str, Any]:
    """Times ``config.repeat`` runs of ``config.batches`` batches; medians of the rates."""
    it = _endless(loader)
    for batch in islice(it, config.warmup):
        del batch
    _sync(config.device)
    rates, stalls, cpus, rss = [], [], [], 0
    for _ in range(config.repeat):
        with _ResourceSampler() as res:
            cpu0 = res.cpu_seconds()
            samples, wait = 0, 0.0
            t0 = time.perf_counter()
            for _ in range(config.batches):
                w0 = time.perf_counter()
                batch = next(it)
                _sync(config.device)
                wait += time.perf_counter() - w0
                samples += _batch_size_of(batch)
                del batch
            wall = time.perf_counter() - t0
            cpu = res.cpu_seconds() - cpu0
        rates.append(samples / wall)
        stalls.append(wait / wall)
        cpus.append(100.0 * cpu / wall)
        rss = max(rss, res.peak_rss)
    return {
        "images_per_s": statistics.median(rates),
        "images_per_s_runs": rates,
        "stall_fraction": statistics.median(stalls),
        "cpu_percent": statistics.median(cpus),
        "rss_bytes": rss,
    }


def decode_ceiling(config: BenchConfig, pipeline: str, limit: int = 200) -> float:
    """Single-process full-size decode rate (images/s, PIL to RGB) over the split's first files."""
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
    return statistics.median(rates)


def _shutdown(loader: Any) -> None:
    inner = getattr(loader, "loader", loader)
    close = getattr(inner, "close", None)
    if callable(close):
        close()


def run(
    config: BenchConfig,
    backends: Sequence[str],
    pipelines: Sequence[str],
    workers: Sequence[int],
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Measures every combination and returns one record per measurement (see the module docs)."""
    unknown = [b for b in backends if b not in BACKENDS and b != "decode-ceiling"]
    if unknown:
        raise ValueError(f"unknown backend(s) {unknown}; available: {['decode-ceiling', *BACKENDS]}")
    records: list[dict[str, Any]] = []
    for pipeline in pipelines:
        ceiling = decode_ceiling(config, pipeline) if "decode-ceiling" in backends else None
        for w in workers:
            base_rate = None
            for name in backends:
                if name == "decode-ceiling":
                    continue
                backend = BACKENDS[name]
                reason = backend.unavailable()
                if reason:
                    log(f"skipping {name}: {reason}")
                    continue
                loader = backend.build(config, pipeline, w)
                try:
                    result = measure(loader, config)
                finally:
                    _shutdown(loader)
                    del loader
                if name == "torchvision":
                    base_rate = result["images_per_s"]
                records.append(_record(name, pipeline, w, config, result, base_rate))
                log(_row(records[-1]))
            if ceiling is not None:
                rec = _record(
                    "decode-ceiling",
                    pipeline,
                    w,
                    config,
                    {
                        "images_per_s": ceiling * max(1, w),
                        "stall_fraction": None,
                        "cpu_percent": None,
                        "rss_bytes": None,
                    },
                    base_rate,
                )
                records.append(rec)
                log(_row(rec))
    return records


def _record(
    name: str, pipeline: str, w: int, config: BenchConfig, result: dict[str, Any], base_rate: float | None
) -> dict[str, Any]:
    rate = result["images_per_s"]
    return {
        "backend": name,
        "pipeline": pipeline,
        "num_workers": w,
        "batch_size": config.batch_size,
        "images_per_s": rate,
        "ratio_vs_torchvision": (rate / base_rate) if base_rate else None,
        "stall_fraction": result.get("stall_fraction"),
        "cpu_percent": result.get("cpu_percent"),
        "rss_bytes": result.get("rss_bytes"),
        "device": config.device,
        "images_per_s_runs": result.get("images_per_s_runs"),
    }


HEADER = (
    f"{'backend':<16} {'pipeline':<8} {'workers':>7} {'images/s':>9} "
    f"{'vs tv':>6} {'stall':>6} {'CPU %':>6} {'RSS MB':>7}"
)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _row(r: dict[str, Any]) -> str:
    rss = None if r["rss_bytes"] is None else r["rss_bytes"] / 2**20
    return (
        f"{r['backend']:<16} {r['pipeline']:<8} {r['num_workers']:>7} {r['images_per_s']:>9.1f} "
        f"{_fmt(r['ratio_vs_torchvision'], '.2f'):>6} {_fmt(r['stall_fraction'], '.2f'):>6} "
        f"{_fmt(r['cpu_percent'], '.0f'):>6} {_fmt(rss, '.0f'):>7}"
    )


def format_table(records: Sequence[dict[str, Any]]) -> str:
    """The records as the printed table."""
    return "\n".join([HEADER, "-" * len(HEADER), *(_row(r) for r in records)])


def plot(records: Sequence[dict[str, Any]], path: str) -> None:
    """images/s vs num_workers, one line per backend, one panel per pipeline."""
    try:  # optional dependency (the bench extra), only for --plot
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("--plot needs matplotlib: pip install 'fastload[bench]'") from None
    pipelines = sorted({r["pipeline"] for r in records})
    fig, axes = plt.subplots(1, len(pipelines), figsize=(5 * len(pipelines), 4), squeeze=False)
    for ax, pipeline in zip(axes[0], pipelines, strict=False):
        for name in dict.fromkeys(r["backend"] for r in records):
            pts = sorted(
                (r["num_workers"], r["images_per_s"])
                for r in records
                if r["backend"] == name and r["pipeline"] == pipeline
            )
            if pts:
                ax.plot(
                    *zip(*pts, strict=False),
                    marker="o",
                    label=name,
                    linestyle="--" if name == "decode-ceiling" else "-",
                )
        ax.set_title(f"{pipeline} pipeline")
        ax.set_xlabel("num_workers")
        ax.set_ylabel("images/s")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench/throughput.py", description="fastload throughput benchmark")
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
        help="num_workers values, e.g. 0,1,2 (default 0,1,2; --quick: 0,2)",
    )
    p.add_argument("--backends", type=_names, default=None, help="comma-separated backends (default: all)")
    p.add_argument("--pipelines", type=_names, default=["train", "val"], help="train,val")
    p.add_argument("--batch-size", type=int, default=None, help="default 64 (--quick: 32)")
    p.add_argument(
        "--batches", type=int, default=None, help="batches per measurement (default 20; --quick: 8)"
    )
    p.add_argument("--warmup", type=int, default=None, help="batches before timing (default 3; --quick: 2)")
    p.add_argument("--repeat", type=int, default=3, help="measurements per setting; the median is reported")
    p.add_argument("--device", default=None, help="cuda if available, else cpu")
    p.add_argument("--quick", action="store_true", help="a short configuration for make bench")
    p.add_argument(
        "--gpu-transforms",
        action="store_true",
        help="fastload backends: flip + normalize on the device (gpu transforms) instead of in the workers",
    )
    p.add_argument("--json", metavar="PATH", help="write one record per measurement here")
    p.add_argument("--plot", metavar="PATH.png", help="plot images/s vs num_workers (needs matplotlib)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    q = args.quick
    data = args.data or default_data()
    if not (data / "train").is_dir():
        print(
            f"error: {data}/train not found. Make a dataset first: python -m fastload synth {data}",
            file=sys.stderr,
        )
        return 2
    device = args.device or ("cuda" if cuda_available() else "cpu")
    config = BenchConfig(
        data=data,
        batch_size=args.batch_size or (32 if q else 64),
        batches=args.batches or (8 if q else 20),
        warmup=args.warmup if args.warmup is not None else (2 if q else 3),
        repeat=args.repeat,
        device=device,
        gpu_transforms=args.gpu_transforms,
    )
    for name, value in (
        ("batch-size", config.batch_size),
        ("batches", config.batches),
        ("repeat", config.repeat),
    ):
        if value < 1:
            print(f"error: --{name} should be a positive integer, but got {value}", file=sys.stderr)
            return 2
    workers = args.workers or ([0, 2] if q else [0, 1, 2])
    backends = args.backends or [
        "torchvision",
        *[b for b in BACKENDS if b != "torchvision"],
        "decode-ceiling",
    ]
    print(
        f"data {data}, device {device}, batch size {config.batch_size}, {config.batches} batches x "
        f"{config.repeat} repeats (median), workers {workers}"
    )
    print(HEADER)
    print("-" * len(HEADER))
    try:
        records = run(config, backends, args.pipelines, workers)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        plot(records, args.plot)
        print(f"wrote {args.plot}")
    return 0
