"""Epoch lookahead: workers start on the next epoch while the current one drains.

What must hold: the batches are bit-identical to a loader without lookahead for every epoch
sequence (plain, set_epoch jumps, resume, partial passes); the next epoch's batches really are
handed to the workers before its pass starts (and not decoded twice); and nothing is decoded
ahead for an order that is not a function of the epoch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _batches import collect as _epoch
from _batches import same as _equal

from fastload import ImageFolder
from fastload import transforms as T
from fastload._pool import WorkerPool
from fastload.loader import DataLoader


def _dataset(root: Path) -> ImageFolder:
    return ImageFolder(
        root / "train", transform=T.Compose([T.RandomResizedCrop(24), T.RandomHorizontalFlip()])
    )


@pytest.fixture()
def puts(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    """Every task handed to the workers, as (generation, epoch, batch)."""
    seen: list[tuple[int, int, int]] = []
    real = WorkerPool.put

    def put(self: WorkerPool, task: object) -> None:
        seen.append((task.generation, task.epoch, task.batch))  # type: ignore[attr-defined]
        real(self, task)  # type: ignore[arg-type]

    monkeypatch.setattr(WorkerPool, "put", put)
    return seen


@pytest.mark.parametrize("worker_type", ["process", "thread"])
@pytest.mark.parametrize("shuffle", [True, False])
def test_same_batches_as_without_lookahead_and_next_epoch_started_early(
    imagenet_root: Path, puts: list[tuple[int, int, int]], worker_type: str, shuffle: bool
) -> None:
    ds = _dataset(imagenet_root)
    kwargs = dict(batch_size=4, shuffle=shuffle, num_workers=2, seed=3, worker_type=worker_type)
    plain = DataLoader(ds, epoch_lookahead=False, **kwargs)
    expected = [_epoch(plain) for _ in range(3)]
    plain.close()
    assert not _equal(expected[0], expected[1]) or not shuffle
    puts.clear()
    ahead = DataLoader(ds, **kwargs)
    got = []
    for epoch in range(3):
        got.append(_epoch(ahead))
        # When a pass ends, the next epoch's first batches are already with the workers.
        assert any(e == epoch + 1 for _, e, _ in puts), f"nothing of epoch {epoch + 1} was started ahead"
    ahead.close()
    assert all(_equal(g, e) for g, e in zip(got, expected, strict=True))
    # Each (epoch, batch) was handed out once: the adopting pass did not decode it again.
    handed = [(e, b) for _, e, b in puts if e < 3]
    assert sorted(handed) == sorted(set(handed)) and len(handed) == 3 * 8


def test_set_epoch_jump_discards_the_lookahead(imagenet_root: Path, puts: list[tuple[int, int, int]]) -> None:
    ds = _dataset(imagenet_root)
    loader = DataLoader(ds, batch_size=4, shuffle=True, num_workers=2, seed=5)
    _epoch(loader)  # epoch 0; epoch 1 is started ahead
    loader.set_epoch(7)
    jumped = _epoch(loader)
    _epoch(loader)  # epoch 8 (the lookahead of 7's pass)
    again = _epoch(loader)  # epoch 9
    loader.close()
    reference = DataLoader(ds, batch_size=4, shuffle=True, num_workers=0, seed=5)
    reference.set_epoch(7)
    assert _equal(jumped, _epoch(reference))
    reference.set_epoch(9)
    assert _equal(again, _epoch(reference))
    assert any(e == 1 for _, e, _ in puts)  # epoch 1 was started ahead, then thrown away


def test_partial_pass_and_resume_with_a_lookahead_pending(imagenet_root: Path) -> None:
    ds = _dataset(imagenet_root)
    loader = DataLoader(ds, batch_size=4, shuffle=True, num_workers=2, seed=11)
    it = iter(loader)
    for _ in range(7):  # 7 of 8 batches: everything issued, epoch 1 started ahead
        next(it)
    state = loader.state_dict()
    assert (state["epoch"], state["batches"]) == (0, 7)
    del it  # a partial pass ends the epoch
    after_break = _epoch(loader)  # so this is epoch 1, adopted from the lookahead
    loader.load_state_dict(state)  # back to batch 7 of epoch 0: must not take epoch 1's batches
    resumed = _epoch(loader)
    loader.close()
    reference = DataLoader(ds, batch_size=4, shuffle=True, num_workers=0, seed=11)
    epoch0 = _epoch(reference)
    epoch1 = _epoch(reference)
    assert _equal(after_break, epoch1)
    assert _equal(resumed, epoch0[7:])


def test_distributed_sampler_orders_are_looked_ahead(
    imagenet_root: Path, puts: list[tuple[int, int, int]]
) -> None:
    from fastload.sampler import DistributedSampler

    ds = _dataset(imagenet_root)
    sampler = DistributedSampler(ds, num_replicas=2, rank=1, seed=2)
    loader = DataLoader(ds, batch_size=4, sampler=sampler, num_workers=2, seed=2)
    got = []
    for epoch in range(2):
        sampler.set_epoch(epoch)  # the usual DDP loop
        got.append(_epoch(loader))
    loader.close()
    assert any(e == 1 for _, e, _ in puts[: len(puts) // 2 + 1])
    reference = DataLoader(
        ds,
        batch_size=4,
        sampler=DistributedSampler(ds, num_replicas=2, rank=1, seed=2),
        num_workers=0,
        seed=2,
    )
    for epoch in range(2):
        reference.sampler.set_epoch(epoch)
        assert _equal(got[epoch], _epoch(reference))


def test_no_lookahead_for_orders_that_are_not_a_function_of_the_epoch(
    imagenet_root: Path, puts: list[tuple[int, int, int]]
) -> None:
    ds = _dataset(imagenet_root)
    sampler = torch.utils.data.RandomSampler(ds, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(ds, batch_size=4, sampler=sampler, num_workers=2, seed=0)
    _epoch(loader)
    _epoch(loader)
    loader.close()
    assert {e for _, e, _ in puts} == {0, 1} and len(puts) == 16
    assert len({g for g, _, _ in puts}) == 2  # one generation per pass, none ahead
    # Non-persistent workers: nothing survives the pass, so nothing is started ahead either.
    puts.clear()
    short = DataLoader(ds, batch_size=4, shuffle=True, num_workers=2, seed=0, persistent_workers=False)
    _epoch(short)
    assert {e for _, e, _ in puts} == {0}


def test_a_dead_worker_voids_the_lookahead(imagenet_root: Path) -> None:
    import os
    import signal
    import time

    ds = _dataset(imagenet_root)
    loader = DataLoader(ds, batch_size=4, shuffle=True, num_workers=2, seed=7, timeout=60)
    _epoch(loader)  # epoch 0; epoch 1 is queued ahead on this pool
    assert loader._engine.lookahead is not None and loader._engine.lookahead.issued > 0
    os.kill(loader._engine.pool.workers[0].pid, signal.SIGKILL)
    loader._engine.pool.workers[0].join(10)
    time.sleep(0.2)
    with pytest.raises(RuntimeError, match="killed by signal"):
        loader._engine.pool.check_alive()  # how any pass finds out: it closes the pool and raises
    # The next pass gets new workers and must not adopt batches queued on (or slots of) the dead pool.
    got = _epoch(loader)
    loader.close()
    reference = DataLoader(ds, batch_size=4, shuffle=True, num_workers=0, seed=7)
    reference.set_epoch(1)
    assert _equal(got, _epoch(reference))


def test_a_replaced_transform_voids_the_lookahead(imagenet_root: Path) -> None:
    ds = _dataset(imagenet_root)
    loader = DataLoader(ds, batch_size=4, shuffle=True, num_workers=2, seed=9, worker_type="thread")
    _epoch(loader)  # epoch 1 started ahead with the train transform
    ds.transform = T.Compose([T.Resize(24), T.CenterCrop(24)])  # e.g. a schedule that changes it per epoch
    got = _epoch(loader)
    loader.close()
    reference = DataLoader(ds, batch_size=4, shuffle=True, num_workers=0, seed=9)
    reference.set_epoch(1)
    assert _equal(got, _epoch(reference))


@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_last_batches_of_an_epoch_stay_valid_into_the_next(imagenet_root: Path, worker_type: str) -> None:
    import time

    ds = _dataset(imagenet_root)
    loader = DataLoader(ds, batch_size=4, shuffle=True, num_workers=2, seed=1, worker_type=worker_type)
    views = [(x, x.clone()) for x, _ in loader][-2:]  # reused buffers, not copies
    it = iter(loader)
    next(it)
    time.sleep(0.5)  # let the workers fill every free slot
    assert all(torch.equal(view, copy) for view, copy in views)  # last batch: still valid one batch later
    next(it)
    time.sleep(0.5)
    assert torch.equal(*views[-1])  # and two batches later
    del it
    loader.close()
