"""Data-stall statistics, measured at the consumer: the wall time of an epoch and how much of it
the loop spent blocked in ``next(loader)`` (``stall_fraction`` near 0: the model is the bottleneck).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

__all__ = ["LoaderStats"]


@dataclass
class LoaderStats:
    """Counters of one epoch, measured where the batches are consumed.

    Attributes:
        wait_seconds: Time the consumer was blocked waiting for a batch.
        skipped: Samples that failed to decode (``on_error="skip"``).
        decode_seconds: Per-worker time spent decoding and transforming (where measurable).
    """

    batches: int = 0
    samples: int = 0
    wait_seconds: float = 0.0
    skipped: int = 0
    decode_seconds: dict[int, float] = field(default_factory=dict)
    _start: float | None = field(default=None, repr=False)
    _end: float | None = field(default=None, repr=False)

    def start(self) -> None:
        """Resets the counters and starts the epoch's wall clock."""
        self.batches = 0
        self.samples = 0
        self.wait_seconds = 0.0
        self.skipped = 0
        self.decode_seconds = {}
        self._start = time.perf_counter()
        self._end = None

    def stop(self) -> None:
        """Freezes the wall clock (at the end of an epoch)."""
        if self._start is not None and self._end is None:
            self._end = time.perf_counter()

    def record_batch(self, samples: int, wait_seconds: float) -> None:
        """Counts one handed-out batch of ``samples`` that the consumer waited ``wait_seconds`` for."""
        if self._start is None:
            self.start()
        self.batches += 1
        self.samples += samples
        self.wait_seconds += wait_seconds

    def record_decode(self, worker: int, seconds: float) -> None:
        """Adds decode time measured inside worker ``worker``."""
        self.decode_seconds[worker] = self.decode_seconds.get(worker, 0.0) + seconds

    @property
    def wall_seconds(self) -> float:
        """Wall time since :meth:`start` (up to :meth:`stop`)."""
        if self._start is None:
            return 0.0
        end = self._end if self._end is not None else time.perf_counter()
        return end - self._start

    @property
    def images_per_s(self) -> float:
        """Samples handed out per second of wall time."""
        wall = self.wall_seconds
        return self.samples / wall if wall > 0 else 0.0

    @property
    def stall_fraction(self) -> float:
        """Fraction of the wall time the consumer spent blocked on data (0 = never waited)."""
        wall = self.wall_seconds
        return min(1.0, self.wait_seconds / wall) if wall > 0 else 0.0

    def summary(self) -> str:
        """One line: ``'1 batches, 256 samples, 12800.0 img/s, waited 0.010 s of 0.020 s (stall 50.0%)'``."""
        line = (
            f"{self.batches} batches, {self.samples} samples, {self.images_per_s:.1f} img/s, "
            f"waited {self.wait_seconds:.3f} s of {self.wall_seconds:.3f} s (stall "
            f"{100 * self.stall_fraction:.1f}%)"
        )
        if self.decode_seconds:
            decode, workers = sum(self.decode_seconds.values()), len(self.decode_seconds)
            line += f", decode {decode:.3f} s over {workers} worker(s)"
        if self.skipped:
            line += f", {self.skipped} skipped"
        return line
