"""Distributed sampling that hands out every sample exactly once (:class:`DistributedSampler`),
so that metrics summed over ranks (:mod:`fastload.distributed`) are the single-process metrics;
:func:`shard_indices` is the same split for a ``torch.utils.data.Subset``.

Example:
    >>> from fastload.sampler import DistributedSampler, shard_indices
    >>> [list(DistributedSampler(range(7), num_replicas=3, rank=r, shuffle=False)) for r in range(3)]
    [[0, 3, 6], [1, 4], [2, 5]]
    >>> shard_indices(7, num_replicas=3, rank=1)
    range(1, 7, 3)
"""

from __future__ import annotations

import math
import warnings
import zlib
from collections.abc import Iterator, Sized
from typing import Any, cast

import numpy as np
import torch.distributed as dist
from torch.utils.data import Dataset, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler as _TorchDistributedSampler

from ._checks import check_int, optional_attribute
from ._epoch import DefaultSeed, check_layout, resolve_seed
from ._position import consumed, rest_of_epoch
from .rng import epoch_permutation

__all__ = [
    "DistributedSampler",
    "EpochRandomSampler",
    "NoProcessGroupError",
    "block_layout",
    "blockwise_permutation",
    "epoch_order",
    "global_order",
    "sampler_plan",
    "shard_indices",
]

_MASK64 = (1 << 64) - 1
_BLOCKWISE_STREAM = 0x626C6F636B  # b"block": keeps this stream apart from any other use of the seed


def blockwise_permutation(
    block_starts: np.ndarray, window: int, seed: int, epoch: int, num_replicas: int = 1
) -> np.ndarray:
    """A permutation of ``range(n)`` that reads storage block by block: FFCV's "quasi-random" order.

    The blocks are shuffled and taken ``window`` at a time; the samples of each window are
    shuffled together, so an epoch reads a bounded working set at a time.

    For ``num_replicas=W > 1`` ranks that take positions ``r, r + W, ...`` (the interleaved
    split of :class:`DistributedSampler`), each rank reads only its own blocks for most of the
    epoch: rank ``r``'s *stream* is windows ``r, r + W, r + 2W, ...``, and position ``q * W + r``
    of the order is ``stream_r[q]`` up to the shortest stream's length. The samples left over
    follow in the same order as with ``W = 1`` (a window at a time, on every rank). ``W = 1`` is
    the order above; with fewer windows than ranks, the whole order is that tail.

    Args:
        block_starts: ``int64[m + 1]``, increasing, from 0 to ``n``.
        window: Blocks shuffled together (at least 1).
        num_replicas: The ranks the order is split over (the order depends on it).

    Example:
        8 samples in 4 blocks of 2 (``block_starts = [0, 2, 4, 6, 8]``) and ``window=2``: if the
        blocks are shuffled to ``[2, 0, 3, 1]``, the first window holds samples 4, 5, 0, 1 (in a
        random order), the second 6, 7, 2, 3; e.g. ``[5, 0, 4, 1, 7, 2, 3, 6]``.
    """
    starts = np.asarray(block_starts, dtype=np.int64)
    if starts.ndim != 1 or len(starts) < 1 or starts[0] != 0 or np.any(np.diff(starts) <= 0):
        raise ValueError(
            "block_starts should be increasing from 0 to the number of samples, "
            f"but got {starts[:5].tolist()}{'...' if len(starts) > 5 else ''}"
        )
    window = check_int(window, "window", low=1)
    num_replicas = check_int(num_replicas, "num_replicas", low=1)
    m, n = len(starts) - 1, int(starts[-1])
    rng = np.random.default_rng([int(seed) & _MASK64, int(epoch) & _MASK64, _BLOCKWISE_STREAM])
    perm = rng.permutation(m)
    lengths = np.diff(starts)[perm]
    placed = np.zeros(m + 1, dtype=np.int64)  # where each shuffled block starts in the order
    np.cumsum(lengths, out=placed[1:])
    order = np.arange(n, dtype=np.int64) + np.repeat(starts[:-1][perm] - placed[:-1], lengths)
    for w in range(0, m, window):
        rng.shuffle(order[placed[w] : placed[min(w + window, m)]])  # in place, on a view
    if num_replicas == 1:
        return order
    ends = placed[np.minimum(np.arange(window, m + window, window), m)]  # where each window ends
    rank_of = (np.searchsorted(ends, np.arange(n), side="right") % num_replicas).astype(np.int64)
    counts = np.bincount(rank_of, minlength=num_replicas)
    shortest = int(counts.min())
    by_rank = np.argsort(rank_of, kind="stable")  # positions of stream 0, then stream 1, ...
    starts_of = np.concatenate([[0], np.cumsum(counts)[:-1]])
    head = by_rank[starts_of[:, None] + np.arange(shortest)].T.ravel()  # position q * W + r: stream_r[q]
    tail = np.ones(n, dtype=bool)
    tail[head] = False
    return np.concatenate([order[head], order[tail]])


def _shuffle_blocks(dataset: Any, n: int) -> tuple[np.ndarray, int] | None:
    """``(block_starts, window)`` when ``dataset`` asks for blockwise shuffling, else ``None``."""
    blocks = optional_attribute(dataset, "shuffle_blocks")
    if blocks is None:
        return None
    starts = np.asarray(blocks, dtype=np.int64)
    if len(starts) == 0 or int(starts[-1]) != n:
        raise ValueError(
            f"{type(dataset).__name__}.shuffle_blocks should end at the dataset size {n}, "
            f"but ends at {int(starts[-1]) if len(starts) else None}"
        )
    return starts, int(getattr(dataset, "shuffle_window", 1))


def block_layout(dataset: Any, n: int) -> dict[str, Any]:
    """What a shuffled epoch's blockwise order depends on besides seed, epoch and ranks, as a state
    records it: ``shuffle_window`` and ``shuffle_blocks``, the number of blocks and the CRC-32 of
    their ``int64`` starts (``"5 blocks, crc32 1a2b3c4d"``); both ``None`` without blocks."""
    blocks = _shuffle_blocks(dataset, n)
    if blocks is None:
        return {"shuffle_window": None, "shuffle_blocks": None}
    crc = zlib.crc32(blocks[0].astype("<i8").tobytes())
    return {"shuffle_window": blocks[1], "shuffle_blocks": f"{len(blocks[0]) - 1} blocks, crc32 {crc:08x}"}


def epoch_order(dataset: Any, n: int, seed: int, epoch: int, num_replicas: int = 1) -> np.ndarray:
    """The shuffled order of ``range(n)`` for an epoch: :func:`fastload.rng.epoch_permutation`, or
    :func:`blockwise_permutation` (built for ``num_replicas`` ranks) where the dataset's
    ``shuffle_blocks`` is not ``None``."""
    blocks = _shuffle_blocks(dataset, n)
    if blocks is None:
        return epoch_permutation(n, seed, epoch).numpy()
    return blockwise_permutation(blocks[0], blocks[1], seed, epoch, num_replicas)


class NoProcessGroupError(ValueError, RuntimeError):
    """No process group and no ``num_replicas``/``rank`` (both types: torch raised either)."""


def _resolve_replicas_and_rank(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """Explicit values win; missing ones come from the default process group, as in torch."""
    if num_replicas is None or rank is None:
        if not dist.is_available():
            raise RuntimeError("Requires distributed package to be available")
        try:  # torch's own error where no process group is initialized (its type and words)
            if num_replicas is None:
                num_replicas = dist.get_world_size()
            if rank is None:
                rank = dist.get_rank()
        except (RuntimeError, ValueError) as e:
            if dist.is_initialized():
                raise
            raise NoProcessGroupError(f"{e} (or pass num_replicas and rank explicitly)") from None
    num_replicas = check_int(num_replicas, "num_replicas", type_error=True)
    num_replicas = check_int(num_replicas, "num_replicas", low=1)
    rank = check_int(rank, "rank", type_error=True)
    if rank >= num_replicas or rank < 0:
        raise ValueError(f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]")
    return num_replicas, rank


def shard_indices(n: int, num_replicas: int | None = None, rank: int | None = None) -> range:
    """The dataset indices of one rank's evaluation shard: ``range(rank, n, num_replicas)``.

    :class:`DistributedSampler`'s split with ``shuffle=False``; ``num_replicas`` and ``rank``
    default to the process group's.

    Raises:
        NoProcessGroupError: ``num_replicas`` or ``rank`` is missing and no process group is
            initialized.

    Example:
        ``n=7`` on 3 ranks, then ``n=2`` on 3 ranks (rank 2 gets nothing):

        >>> [list(shard_indices(7, 3, r)) for r in range(3)]
        [[0, 3, 6], [1, 4], [2, 5]]
        >>> [list(shard_indices(2, 3, r)) for r in range(3)]
        [[0], [1], []]
    """
    n = check_int(check_int(n, "n", type_error=True), "n", low=0)  # TypeError, then the range
    num_replicas, rank = _resolve_replicas_and_rank(num_replicas, rank)
    return range(rank, n, num_replicas)


class _Seeded:
    """``seed``: an int, or a :class:`fastload._epoch.DefaultSeed` (the loader's ``seed=None``)
    fixed at first use."""

    _seed: int | DefaultSeed

    @property
    def seed(self) -> int:
        """The shuffling seed."""
        self._seed = resolve_seed(self._seed)
        return self._seed

    @seed.setter
    def seed(self, value: int | DefaultSeed) -> None:
        self._seed = value if isinstance(value, DefaultSeed) else int(value)


class EpochRandomSampler(_Seeded, RandomSampler):
    """Random order of ``range(len(data_source))`` that is a function of ``(seed, epoch)`` only
    (:func:`epoch_order`). A ``RandomSampler`` for frameworks that tell a shuffled loader by its
    sampler's class (Lightning); its ``generator`` is not used."""

    def __init__(self, data_source: Any, seed: int | DefaultSeed = 0) -> None:
        # RandomSampler's attributes without its checks (an empty dataset is an empty order here)
        self.data_source = data_source
        self.replacement = False
        self._num_samples = None
        self.generator = None
        self._seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch the next iteration yields (a loader that made this sampler takes it too)."""
        self.epoch = int(epoch)
        self._told_epoch = True

    def indices(self, epoch: int) -> np.ndarray:
        """The order of ``epoch`` (without changing the sampler's epoch)."""
        return epoch_order(self.data_source, len(self.data_source), self.seed, epoch)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices(self.epoch).tolist())

    def __len__(self) -> int:
        return len(self.data_source)


class DistributedSampler(_Seeded, _TorchDistributedSampler[int]):
    """Sampler that gives each rank a shard of the dataset: torch's for training, exact for evaluation.

    torch's arguments, order (``randperm`` seeded by ``seed + epoch``) and strided assignment
    (rank ``r`` takes positions ``r, r + W, ...``). For ``N`` samples on ``W`` ranks:

    * **shuffling (training) pads like torch**: every rank gets ``ceil(N / W)`` samples (the
      order's first ``W - N mod W`` entries repeated), so DDP takes the same steps on every rank;
    * **not shuffling (evaluation) is exact**: every sample on exactly one rank, so metrics summed
      over ranks (:class:`fastload.distributed.Accumulator`) are exact.

    ``pad`` overrides the rule; ``drop_last=True`` drops the last ``N mod W`` positions, as torch's.
    A rank's indices are always a prefix of torch's for the same seed and epoch.

    Worked example, dataset ``[0, 1, 2, 3, 4, 5, 6]`` (``N = 7``) on ``W = 3`` ranks::

        shuffle=False (evaluation)   rank 0      rank 1      rank 2      samples seen
        default (exact)              [0, 3, 6]   [1, 4]      [2, 5]      7: each once
        pad=True                     [0, 3, 6]   [1, 4, 0]   [2, 5, 1]   9: 0 and 1 twice (= torch)
        drop_last=True               [0, 3]      [1, 4]      [2, 5]      6: 6 never seen

    With ``shuffle=True, seed=0`` (training) the epoch-0 order is ``[4, 0, 5, 3, 2, 6, 1]``: the
    default (padded, = torch) gives ``[4, 3, 1] / [0, 2, 4] / [5, 6, 0]`` (3 steps on every rank),
    ``pad=False`` gives ``[4, 3, 1] / [0, 2] / [5, 6]`` and ``drop_last=True`` gives
    ``[4, 3] / [0, 2] / [5, 6]`` (sample 1 is dropped in epoch 0; in epoch 1, order
    ``[0, 6, 1, 3, 5, 2, 4]``, sample 4 is).

    With fewer samples than ranks (``N = 2``, ``W = 3``, ``shuffle=False``) the default gives
    ``[0] / [1] / []`` (rank 2's loop body never runs), ``pad=True`` ``[0] / [1] / [0]``, and
    ``drop_last=True`` every rank ``[]``, like torch, with a warning.

    Args:
        dataset: Only ``len(dataset)`` is used, and it must not change.
        num_replicas, rank: Default: the default process group's.
        seed: Must be identical on all ranks.
        pad: Repeat samples as torch does (``ceil(N / W)`` each) or never. Default ``None``: pad
            when shuffling (training), not otherwise (evaluation).

    Raises:
        NoProcessGroupError: ``num_replicas`` or ``rank`` is not given and no process group is
            initialized.

    As with torch, call :meth:`set_epoch` at the start of every epoch, before iterating the
    loader; otherwise every epoch uses the same order (a warning says so).
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int | DefaultSeed = 0,
        drop_last: bool = False,
        pad: bool | None = None,
    ) -> None:
        num_replicas, rank = _resolve_replicas_and_rank(num_replicas, rank)
        if not isinstance(seed, DefaultSeed):  # the loader's seed=None: fixed at its first pass
            seed = check_int(seed, "seed", type_error=True)
        try:
            n = len(dataset)
        except TypeError:
            raise TypeError(
                "dataset should be a map-style dataset with __len__, "
                f"but got an object of type {type(dataset).__name__}"
            ) from None
        super().__init__(
            cast("Dataset[Any]", dataset),  # torch annotates Dataset but only takes len(dataset)
            num_replicas=num_replicas,
            rank=rank,
            shuffle=bool(shuffle),
            seed=0,
            drop_last=bool(drop_last),
        )
        self.seed = seed
        self.pad = bool(shuffle) if pad is None else bool(pad)
        self._len = n
        if self.drop_last and 0 < n < num_replicas:
            warnings.warn(
                f"drop_last=True with {n} samples for num_replicas={num_replicas}: every rank gets no "
                "sample (as with torch's DistributedSampler). Use drop_last=False or fewer ranks.",
                stacklevel=2,
            )
        self._size()
        self._set_epoch_called = False
        self._last_iter_epoch: int | None = None
        self._warned = False
        self._resume: tuple[int, int, int] | None = None  # (epoch, global position, order_replicas) loaded
        self._iter_start = (0, 0, 0)  # (epoch, global position, order_replicas) of the last iteration
        self._follows_job = False  # made by DataLoader(distributed=True) before the ranks were known

    def _size(self) -> None:
        """``num_samples`` and ``total_size``: torch's rule, or the exact shard without padding."""
        n, w = self._len, self.num_replicas
        if not self.drop_last and not self.pad:
            self.num_samples, self.total_size = len(range(self.rank, n, w)), n
            return
        self.num_samples = math.ceil((n - w) / w) if self.drop_last and n % w else math.ceil(n / w)
        self.total_size = self.num_samples * w

    def _follow(self) -> None:
        """A sampler made before the ranks were known (:func:`fastload.distributed.ranks_known`)
        takes the job's ``num_replicas`` and ``rank`` at each use."""
        if not self._follows_job:
            return
        from .distributed import get_rank, get_world_size  # the sampler module is imported first

        num_replicas, rank = get_world_size(), get_rank()
        if (num_replicas, rank) == (self.num_replicas, self.rank) or not 0 <= rank < num_replicas:
            return
        self.num_replicas, self.rank = num_replicas, rank
        self._size()

    def __repr__(self) -> str:
        seed = "fixed at the first pass" if isinstance(self._seed, DefaultSeed) else self._seed
        return (
            f"{type(self).__name__}(len(dataset)={self._len}, num_replicas={self.num_replicas}, "
            f"rank={self.rank}, shuffle={self.shuffle}, seed={seed}, drop_last={self.drop_last}, "
            f"pad={self.pad}, epoch={self.epoch})"
        )

    def indices(
        self, epoch: int | None = None, start: int = 0, order_replicas: int | None = None
    ) -> list[int]:
        """This rank's indices for ``epoch`` (default: the current one), as iterating yields them
        but without the :meth:`set_epoch` warning (to pair outputs with indices:
        :func:`fastload.distributed.gather_by_index`). ``start``: positions of the global order
        already handed out on every rank; this rank's share of the rest. ``order_replicas``: the
        ranks the global order was built for (:meth:`global_order`; default: ``num_replicas``)."""
        self._follow()
        epoch = self.epoch if epoch is None else check_int(epoch, "epoch", type_error=True)
        start = check_int(start, "start", low=0, high=self._len)
        return rest_of_epoch(
            self.global_order(epoch, order_replicas),
            start,
            self.num_replicas,
            self.rank,
            self.pad and not self.drop_last,
            self.drop_last,
        ).tolist()

    def global_order(self, epoch: int, num_replicas: int | None = None) -> np.ndarray:
        """The epoch's order before it is sharded, the same on every rank: ``int64[len(dataset)]``.
        With the dataset's ``shuffle_blocks`` it is built for ``num_replicas`` ranks (default: this
        sampler's), each reading its own shards (:func:`blockwise_permutation`)."""
        n = len(self.dataset)  # type: ignore[arg-type]
        if n != self._len:
            raise RuntimeError(
                f"the dataset size changed from {self._len} to {n} since the sampler was created; "
                "create a new DistributedSampler for the new dataset"
            )
        if self.shuffle:
            return epoch_order(self.dataset, n, self.seed, epoch, num_replicas or self.num_replicas)
        return np.arange(n, dtype=np.int64)

    def __iter__(self) -> Iterator[int]:
        start, replicas = 0, self.num_replicas
        if self._resume is not None:
            epoch, start, replicas = self._resume
            self._resume = None
            if epoch != self.epoch:
                start, replicas = 0, self.num_replicas
        self._iter_start = (self.epoch, start, replicas)  # where it began (state_dict counts from it)
        if (
            self.shuffle
            and not self._set_epoch_called
            and not self._warned
            and self._last_iter_epoch == self.epoch
        ):
            self._warned = True
            warnings.warn(
                f"DistributedSampler is iterated again in epoch {self.epoch} and set_epoch() was never "
                "called: every epoch will use the same order. Call sampler.set_epoch(epoch) at the start "
                "of each epoch, before iterating the DataLoader.",
                stacklevel=2,
            )
        self._last_iter_epoch = self.epoch
        return iter(self.indices(start=start, order_replicas=replicas))

    def __len__(self) -> int:
        """Indices the next iteration yields: ``num_samples``, or fewer for a resumed epoch."""
        self._follow()
        start = self.resume_point()
        if start is None:
            return self.num_samples
        assert self._resume is not None
        return len(self.indices(start=start, order_replicas=self._resume[2]))

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch, which (with ``seed``) selects the order when ``shuffle=True``."""
        self.epoch = check_int(epoch, "epoch", type_error=True)
        self._set_epoch_called = True
        self._told_epoch = True  # a loader that made this sampler takes it (as loader.set_epoch)

    def resume_point(self) -> int | None:
        """Where the next iteration of the current epoch starts after a :meth:`load_state_dict`
        part-way through it; ``None`` otherwise."""
        if self._resume is not None and self._resume[0] == self.epoch:
            return self._resume[1]
        return None

    def order_replicas(self) -> int:
        """The ranks the global order of the current (or resumed) iteration was built for."""
        if self._resume is not None and self._resume[0] == self.epoch:
            return self._resume[2]
        epoch, start, replicas = self._iter_start
        return replicas if (epoch, start > 0) == (self.epoch, True) else self.num_replicas

    def forget_resume(self) -> None:
        """The next iteration yields the whole epoch again (a loader's own state takes over)."""
        self._resume = None

    def state_dict(self, taken: int = 0) -> dict[str, Any]:
        """``{"epoch", "seed", "position", "num_samples", "shuffle", "order_replicas",
        "shuffle_window", "shuffle_blocks"}``: ``position`` is the global position after each rank
        took ``taken`` indices of this epoch (with a ``DataLoader``: ``batches * batch_size``), from
        which a sampler with any ``num_replicas`` continues the order built for ``order_replicas``
        ranks; the last two: what a blockwise order depends on (:func:`block_layout`)."""
        pending = self.resume_point()
        if pending is not None:
            start = pending  # not iterated yet
        else:
            start = self._iter_start[1] if self._iter_start[0] == self.epoch else 0
        remaining, replicas = self._len - start, self.order_replicas()
        taken = check_int(taken, "taken", low=0, high=len(self.indices(start=start, order_replicas=replicas)))
        position, _, _ = consumed(
            remaining, self.num_replicas, 1, taken, self.pad and not self.drop_last, self.drop_last, False
        )
        return {
            "epoch": self.epoch,
            "seed": self.seed,
            "position": start + position,
            "num_samples": self._len,
            "shuffle": self.shuffle,
            "order_replicas": replicas,
            **self._layout(),
        }

    def _layout(self) -> dict[str, Any]:
        """:func:`block_layout` of the shuffled order (``None`` values unshuffled)."""
        return block_layout(self.dataset if self.shuffle else None, self._len)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores :meth:`state_dict`: the next iteration of that epoch yields this rank's share
        of the global order after ``position``. Counts as calling :meth:`set_epoch`."""

        missing = [k for k in ("epoch", "seed") if k not in state_dict]
        if missing:
            raise ValueError(
                f"state_dict should have the keys 'epoch' and 'seed', but got keys {sorted(state_dict)}"
            )
        seed = check_int(state_dict["seed"], "seed", type_error=True)
        epoch = check_int(state_dict["epoch"], "epoch", type_error=True)
        position = check_int(state_dict.get("position", 0), "position", low=0, high=self._len)
        replicas = check_int(state_dict.get("order_replicas", 1), "order_replicas", low=1)
        for key, mine in (("num_samples", self._len), ("shuffle", self.shuffle)):
            if key in state_dict and state_dict[key] != mine:
                raise ValueError(
                    f"the state was saved by a sampler with {key}={state_dict[key]!r}, but this one has "
                    f"{key}={mine!r}: the rest of the epoch would be other samples"
                )
        if position:
            check_layout(state_dict, self._layout(), "sampler.set_epoch(state_dict['epoch'])")
        self.set_epoch(epoch)
        self.seed = seed
        self._resume = (epoch, position, replicas) if position else None


def global_order(
    sampler: Any, dataset: Any, epoch: int, num_replicas: int | None = None
) -> np.ndarray | None:
    """The global order of ``epoch`` behind a loader's sampler fastload knows (``None`` for any
    other); a :class:`DistributedSampler`'s built for ``num_replicas`` ranks (default: its own)."""
    if isinstance(sampler, DistributedSampler):
        return sampler.global_order(epoch, num_replicas)
    if type(sampler) is _TorchDistributedSampler:
        n = len(dataset)
        if sampler.shuffle:
            return epoch_permutation(n, sampler.seed, epoch).numpy()
        return np.arange(n, dtype=np.int64)
    if type(sampler) is EpochRandomSampler:
        return sampler.indices(epoch)
    if type(sampler) is SequentialSampler:
        return np.arange(len(sampler), dtype=np.int64)
    return None


def sampler_plan(sampler: Any, dataset: Any, own: bool) -> dict[str, Any]:
    """The sharding fields of a :class:`fastload._epoch.Plan` for a loader's sampler (``own``: the
    loader made it, and it takes a loaded state's seed)."""
    if isinstance(sampler, DistributedSampler):
        sampler._follow()
        layout = sampler._layout()
        blocks = layout["shuffle_window"] is not None
        order = ("blocks" if blocks else "shuffle") if sampler.shuffle else "sequence"
        return {
            **layout,
            "num_replicas": sampler.num_replicas,
            "rank": sampler.rank,
            "order": order,
            "order_seed": None if own or not sampler.shuffle else sampler.seed,
            "pad": sampler.pad and not sampler.drop_last,
            "drop_tail": sampler.drop_last,
        }
    if type(sampler) is _TorchDistributedSampler:
        return {  # its permutation is fastload's (epoch_permutation), whatever the dataset
            "num_replicas": sampler.num_replicas,
            "rank": sampler.rank,
            "order": "shuffle" if sampler.shuffle else "sequence",
            "order_seed": sampler.seed if sampler.shuffle else None,
            "pad": not sampler.drop_last,
            "drop_tail": sampler.drop_last,
        }
    if type(sampler) is EpochRandomSampler:
        layout = block_layout(dataset, len(sampler))
        order = "shuffle" if layout["shuffle_window"] is None else "blocks"
        return {"order": order, "order_seed": None if own else sampler.seed, **layout}
    if type(sampler) is SequentialSampler:
        return {"order": "sequence"}
    return {}
