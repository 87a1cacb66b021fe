"""Where an epoch stands in its global order, for any number of ranks and any batch size.

Rank ``r`` of ``W`` takes positions ``r, r + W, ...`` of the epoch's global order, so when every
rank has taken ``c`` samples, the first ``c * W`` positions are handed out: the *position* a
resume state records. For ``M`` samples on ``W`` ranks the rules are **exact** (rank ``r`` takes
``range(r, M, W)``), **pad** (every rank ``ceil(M / W)``, repeating the order's start, as torch's
``DistributedSampler``) and **drop tail** (the last ``M mod W`` positions dropped). Example
(``M = 10``, ``W = 4``, exact, batches of 1): after 2 steps the position is 8; a restart on 3
ranks continues with positions 8 and 9 on ranks 0 and 1 (rank 2 gets none).
"""

from __future__ import annotations

import numpy as np


def shard_lengths(remaining: int, num_replicas: int, pad: bool, drop_tail: bool) -> np.ndarray:
    """Samples each rank takes from ``remaining`` positions: ``int64[num_replicas]``."""
    w = num_replicas
    if drop_tail:
        return np.full(w, remaining // w, dtype=np.int64)
    if pad:
        return np.full(w, -(-remaining // w), dtype=np.int64)
    return _below(remaining, np.arange(w, dtype=np.int64), w)


def rest_of_epoch(
    order: np.ndarray, start: int, num_replicas: int, rank: int, pad: bool, drop_tail: bool
) -> np.ndarray:
    """``rank``'s samples (``int64``, in order) of the rest of an epoch: the global ``order`` from
    position ``start`` (handed out on every rank already), sharded over ``num_replicas`` by the
    rules above (``pad``: repeat the epoch's start; ``drop_tail``: drop the last positions)."""
    rest = np.asarray(order, dtype=np.int64)[start:]
    m, w = len(rest), num_replicas
    if drop_tail:
        rest = rest[: m // w * w]
    elif pad and m % w and m:
        rest = np.concatenate([rest, np.resize(np.asarray(order, dtype=np.int64), w - m % w)])
    return rest[rank::w]


def consumed(
    remaining: int,
    num_replicas: int,
    batch_size: int,
    batches: np.ndarray | int,
    pad: bool,
    drop_tail: bool,
    drop_last: bool,
) -> tuple[int, bool, bool]:
    """``(position, finished, prefix)`` of a pass over ``remaining`` positions once each rank got
    ``batches`` (one count, or one per rank): the prefix every rank has handed out, whether every
    rank got all its batches, and whether exactly that prefix was handed out."""
    lengths = shard_lengths(remaining, num_replicas, pad, drop_tail)
    ranks = np.arange(num_replicas, dtype=np.int64)
    per_rank = lengths // batch_size if drop_last else -(-lengths // batch_size)
    counts = np.broadcast_to(np.asarray(batches, dtype=np.int64), lengths.shape)
    finished = bool(np.all(counts >= per_rank))
    taken = np.minimum(np.minimum(counts, per_rank) * batch_size, lengths)
    unique = remaining // num_replicas * num_replicas if drop_tail else remaining
    position = int(min(unique, int(np.min(ranks + taken * num_replicas))))
    # handed out exactly [0, position): each rank's unique samples are its positions below it
    unique_taken = np.minimum(taken, _below(unique, ranks, num_replicas))
    prefix = bool(np.all(unique_taken == _below(position, ranks, num_replicas)))
    return position, finished, prefix


def _below(position: int, ranks: np.ndarray, num_replicas: int) -> np.ndarray:
    """How many of each rank's positions (``r, r + W, ...``) are below ``position``."""
    return np.maximum(0, (position - ranks + num_replicas - 1) // num_replicas)
