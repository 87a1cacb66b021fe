"""The timing loop: images/s of each (backend, pipeline, num_workers), and the records of a run.

For every combination the loader is built once, warmed up, then timed ``--repeat`` times over
``--batches`` batches (:func:`measure`); the median is reported with the slowest and fastest run
next to it. Each backend's rate is divided by the ``torchvision`` baseline's at the same
``num_workers`` *in the same run*, since the absolute numbers of a shared machine drift, and a
ratio whose runs spread more than the difference it shows is flagged (``within_noise_*``).

One reference row, ``full-decode``: not a pipeline but a yardstick, the rate of a full-size PIL
decode to RGB of the same files (no crop, resize, normalization or batching), measured in one
process (:func:`full_decode_rates`) and multiplied by the cores the workers can use
(:func:`reference_cores`). A pipeline above it (``vs decode`` > 1) decodes less than every full
image, as fastload does when it decodes only the crop or at a reduced DCT scale; it is not a
ceiling.

Memory is the PSS (proportional set size) of the benchmark process and all its children
(:class:`ProcessTree`): a page shared by k processes counts 1/k in each, so the worker
processes' shared memory is counted once.
"""

from __future__ import annotations

import io
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace
from itertools import islice
from typing import Any

import psutil
import torch
from PIL import Image
from tqdm import tqdm

from fastload.decode import roi_decoder_available
from fastload.device import available_cpus, cuda_available, device_is_cuda
from fastload.info import environment

from .backends import BACKENDS, check_names
from .config import REFERENCE, BenchConfig, pipeline_split, split_too_small, steady_counts
from .report import table_header, table_row


class ProcessTree:
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
    tree = ProcessTree()
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


def progress_bar(progress: bool | None, total: int, desc: str) -> tqdm[Any]:
    """A progress bar on stderr that disappears when done (``progress=None``: only on a terminal)."""
    return tqdm(
        total=total,
        desc=desc,
        unit="batch",
        file=sys.stderr,
        leave=False,
        disable=None if progress is None else not progress,
    )


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
    check_names(backends, pipelines)
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
    header = table_header(bool(config.step_ms), decode)
    log(header)
    log("-" * len(header))

    def add(record: dict[str, Any]) -> None:
        record["settings"] = settings
        record["environment"] = env
        records.append(record)
        log(table_row(record, decode))

    def decode_passes(pipeline: str, w: int, when: str) -> list[float]:
        with progress_bar(
            progress, max(1, config.repeat), f"{pipeline} workers={w} {REFERENCE} ({when})"
        ) as bar:
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
                with progress_bar(progress, total, f"{pipeline} workers={w} {name}") as bar:
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
