"""What one benchmark run measures: the settings, the pipelines, and how many batches to time.

A measurement must time the loader's steady state, not the batches its workers decoded ahead
before the clock started: :func:`steady_counts` (and :func:`model_counts` for ``--model``) raise
the warm-up and the timed runs past that ring, and :func:`split_too_small` names a split whose
epoch is shorter than the ring (its every epoch boundary would be timed instead).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from fastload.folder import scan_folder

#: The pipelines every backend implements (``pipeline_split`` gives the folder each reads).
PIPELINES = ("train", "val")
#: The name of the reference row (see ``timing``); accepted in ``--backends``.
REFERENCE = "full-decode"
#: What ``make bench`` measures by default: torch's loader, the one-line swap, fastload's own.
STORY = ("torchvision", "swap", "fastload")


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


def model_counts(config: BenchConfig, num_workers: int) -> tuple[int, int]:
    """``(warm-up steps, timed steps per run)`` of the model mode: a warm-up that drains the
    prefetched ring (:func:`ring_batches`) and runs of at least one ring. Example: 14 workers,
    ``--warmup 30 --batches 25`` floors -> 30 and 28."""
    ring = ring_batches(num_workers)
    warmup = max(config.warmup, ring + 1) if config.steady_warmup else config.warmup
    return warmup, max(config.batches, ring) if config.steady else config.batches


def pipeline_split(pipeline: str) -> str:
    """The folder a pipeline reads: ``train`` -> ``train``, ``val`` -> ``val``."""
    return "train" if pipeline == "train" else "val"


def default_data() -> Path:
    """The default dataset folder (``make bench`` creates it): ``~/.cache/fastload/synthetic-imagenet``."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "fastload" / "synthetic-imagenet"
