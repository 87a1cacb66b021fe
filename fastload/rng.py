"""Counter-based random streams keyed by ``(seed, epoch, index)``.

Every random decision fastload makes for a sample (crop box, flip, jitter, ...) is drawn from a
stream that depends only on the loader's ``seed``, the current ``epoch`` and the sample's dataset
``index``. No global RNG state, no worker seed: the same sample gets the same augmentation whatever
``num_workers``, the worker kind, the batch composition or a mid-epoch resume.

The generator is a SplitMix64 hash of the key and a counter (a "counter-based" generator in the
sense of Salmon et al., *Parallel random numbers: as easy as 1, 2, 3*): draw ``j`` of a stream is
``hash(key, j)``, so any draw can be computed directly, for one sample or vectorised over a batch.

Example:
    >>> from fastload import rng
    >>> r = rng.SampleRNG(seed=0, epoch=3, index=17)
    >>> a = r.random(); b = r.random()
    >>> rng.SampleRNG(0, 3, 17).random() == a    # a pure function of the key
    True
    >>> float(rng.batch_uniform(0, 3, [17], stream=0, n=2)[0, 1]) == b
    True

Inside the loader, :func:`sample_scope` makes the sample's stream the *current* one, and the
per-sample transforms of :mod:`fastload.transforms` draw from :func:`current`. Outside any scope
(a dataset indexed by hand), :func:`current` returns a stream seeded from torch's global RNG, so
the transforms then behave like torchvision's (random, reproducible with ``torch.manual_seed``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch

__all__ = [
    "SampleRNG",
    "batch_uniform",
    "current",
    "current_key",
    "epoch_permutation",
    "hash_key",
    "sample_scope",
]

_MASK = (1 << 64) - 1
_G, _C1, _C2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # SplitMix64's constants
_GOLDEN, _M1, _M2 = np.uint64(_G), np.uint64(_C1), np.uint64(_C2)


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser on a uint64 array (wrapping arithmetic)."""
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def _u64(value: int | Sequence[int] | np.ndarray) -> np.ndarray:
    if isinstance(value, (int, np.integer)):
        return np.asarray(int(value) & _MASK, dtype=np.uint64)
    arr = np.asarray(value)
    if arr.dtype.kind == "u":
        return arr.astype(np.uint64)
    if arr.dtype.kind != "i":
        raise TypeError(f"random-stream keys must be integers, but got dtype {arr.dtype}")
    return arr.astype(np.int64).view(np.uint64)


def hash_key(seed: int, epoch: int, index: int | Sequence[int] | np.ndarray, stream: int = 0) -> np.ndarray:
    """Hash ``(seed, epoch, index, stream)`` to the 64-bit key of a stream (vectorised over index)."""
    with np.errstate(over="ignore"):
        h = _mix(_u64(seed))
        h = _mix(h ^ _u64(epoch))
        h = _mix(h ^ _u64(index))
        return _mix(h ^ _u64(stream))


def _uniform_from(keys: np.ndarray, counters: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        bits = _mix(keys + counters * _GOLDEN)
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def batch_uniform(
    seed: int, epoch: int, indices: Sequence[int] | np.ndarray | torch.Tensor, stream: int, n: int
) -> np.ndarray:
    """Draws ``n`` uniforms in ``[0, 1)`` for each of a batch's samples (dataset ``indices``), as
    one vectorised call: row ``r`` of the float64 ``(len(indices), n)`` result equals the first
    ``n`` draws of ``SampleRNG(seed, epoch, indices[r], stream)``. Independent transforms draw
    from different ``stream`` ids."""
    if isinstance(indices, torch.Tensor):
        indices = indices.cpu().numpy()
    keys = hash_key(seed, epoch, np.asarray(indices, dtype=np.int64).reshape(-1), stream)
    counters = np.arange(n, dtype=np.uint64)
    return _uniform_from(keys[:, None], counters[None, :])


def mix_int(x: int) -> int:
    """:func:`_mix` on one Python int (the per-sample path: cheaper than numpy scalars)."""
    x = (x + _G) & _MASK
    x = ((x ^ (x >> 30)) * _C1) & _MASK
    x = ((x ^ (x >> 27)) * _C2) & _MASK
    return x ^ (x >> 31)


class SampleRNG:
    """The random stream of one sample (dataset ``index``; ``stream`` 0: the per-sample CPU
    transforms): sequential draws from a counter-based hash."""

    __slots__ = ("_key", "_counter")

    def __init__(self, seed: int, epoch: int, index: int, stream: int = 0) -> None:
        h = mix_int(int(seed) & _MASK)
        h = mix_int(h ^ (int(epoch) & _MASK))
        h = mix_int(h ^ (int(index) & _MASK))
        self._key = mix_int(h ^ (int(stream) & _MASK))
        self._counter = 0

    @classmethod
    def _from_key(cls, key: int) -> SampleRNG:
        obj = cls.__new__(cls)
        obj._key = key & _MASK
        obj._counter = 0
        return obj

    def random(self) -> float:
        """Returns the next uniform float in ``[0, 1)``."""
        c = self._counter
        self._counter = c + 1
        return (mix_int((self._key + c * _G) & _MASK) >> 11) * (1.0 / (1 << 53))

    def draw(self, j: int) -> float:
        """Draw ``j`` of this stream (what the ``j + 1``-th :meth:`random` call returns), without
        advancing it: a transform that uses some of a fixed set of draws computes only those."""
        return (mix_int((self._key + j * _G) & _MASK) >> 11) * (1.0 / (1 << 53))

    def uniform(self, low: float, high: float) -> float:
        """Returns the next uniform float in ``[low, high)``."""
        return low + (high - low) * self.random()

    def randint(self, low: int, high: int) -> int:
        """Returns the next integer in ``[low, high)`` (``high > low``)."""
        if high <= low:
            raise ValueError(f"randint needs high > low, but got low={low}, high={high}")
        return low + min(int(self.random() * (high - low)), high - low - 1)


_local = threading.local()


def current() -> SampleRNG:
    """The current sample's stream; outside :func:`sample_scope`, one seeded from torch's global RNG."""
    rng = getattr(_local, "rng", None)
    if rng is None:
        return SampleRNG._from_key(int(torch.randint(0, 2**62, (1,)).item()))
    return rng


def current_key() -> tuple[int, int, int] | None:
    """The ``(seed, epoch, index)`` of the current sample (inside :func:`sample_scope`), else ``None``:
    for a transform that draws from another stream of the sample (``decode="hybrid"``)."""
    return getattr(_local, "key", None)


@contextmanager
def sample_scope(seed: int, epoch: int, index: int) -> Iterator[SampleRNG]:
    """Makes ``SampleRNG(seed, epoch, index)`` the current stream of this thread while open."""
    previous, previous_key = getattr(_local, "rng", None), getattr(_local, "key", None)
    _local.rng = SampleRNG(seed, epoch, index)
    _local.key = (int(seed), int(epoch), int(index))
    try:
        yield _local.rng
    finally:
        _local.rng, _local.key = previous, previous_key


def epoch_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The shuffled order of ``range(n)`` for an epoch: ``torch.randperm`` seeded by ``seed + epoch``,
    exactly the permutation ``torch.utils.data.DistributedSampler`` uses."""
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n, generator=g)
