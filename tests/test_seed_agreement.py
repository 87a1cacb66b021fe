"""Every rank shuffles alike without ``seed=``: real gloo process groups of 2 and 3 ranks.

Each rank seeds torch's global RNG differently (``torch.seed()``, as a run without
``torch.manual_seed`` does), builds its loaders without ``seed=`` and reports the indices of
two epochs. Over the ranks, an epoch must hold every sample exactly once (``drop_last``
training shards: every sample but the remainder, none twice).
"""

from __future__ import annotations

import multiprocessing
import pickle
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

N = 23  # not a multiple of 2 or 3
EPOCHS = 2


class _Range(torch.utils.data.Dataset[int]):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> int:
        return i


def _rank_main(rank: int, world: int, store: str, out: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        from fastload import DataLoader, DistributedSampler

        torch.seed()  # a different global RNG state on every rank
        result: dict[str, Any] = {}
        loader = DataLoader(_Range(), batch_size=4, shuffle=True, distributed=True, num_workers=0)
        result["distributed"] = [[i for b in loader for i in b.tolist()] for _ in range(EPOCHS)]
        sampler = DistributedSampler(_Range())
        epochs = []
        for epoch in range(EPOCHS):
            sampler.set_epoch(epoch)
            epochs.append(list(sampler))
        result["sampler"] = epochs
        # shuffle=True without distributed=True, its sampler sharded by a framework's wrapper
        # (Lightning's DistributedSamplerWrapper, Accelerate's shards: each takes its rank's share).
        plain = DataLoader(_Range(), batch_size=4, shuffle=True, num_workers=0)
        epochs = []
        for epoch in range(EPOCHS):
            plain.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
            epochs.append(list(plain.sampler)[rank::world])
        result["wrapped"] = epochs
        result["seeds"] = (loader.seed, plain.seed)
    except BaseException:  # noqa: BLE001 - reported to the test
        result = {"traceback": traceback.format_exc()}
    with open(Path(out) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(result, f)
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_agree_on_the_shuffle_without_a_seed(tmp_path: Path, world: int) -> None:
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, str(tmp_path / "store"), str(tmp_path)))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * world
    results = []
    for r in range(world):
        with open(tmp_path / f"rank{r}.pkl", "rb") as f:
            results.append(pickle.load(f))
        assert "traceback" not in results[-1], results[-1]["traceback"]
    assert len({res["seeds"] for res in results}) == 1, [res["seeds"] for res in results]
    for epoch in range(EPOCHS):
        # distributed=True with shuffle: the sampler's training rule, torch's padding (equal steps
        # on every rank, every sample seen), as DistributedSampler(shuffle=True) below
        union = [i for res in results for i in res["distributed"][epoch]]
        assert set(union) == set(range(N)) and len(union) == -(-N // world) * world
        assert all(res["distributed"][epoch] == res["sampler"][epoch] for res in results)
        # fastload's DistributedSampler, shuffling: torch's padding (equal steps), every sample seen
        union = [i for res in results for i in res["sampler"][epoch]]
        assert set(union) == set(range(N)) and len(union) == -(-N // world) * world
        union = [i for res in results for i in res["wrapped"][epoch]]
        assert sorted(union) == list(range(N))
    # the epochs differ (set_epoch / the next pass reshuffles)
    assert results[0]["wrapped"][0] != results[0]["wrapped"][1]
