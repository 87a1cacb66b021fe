"""fastload.sampler: sharding checked by looping over every rank in one process."""

from __future__ import annotations

import doctest
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from torch.utils.data import DistributedSampler as TorchDistributedSampler

import fastload.sampler
from fastload.rng import epoch_permutation
from fastload.sampler import DistributedSampler, EpochRandomSampler, blockwise_permutation, shard_indices

SIZES = range(0, 51)
WORLDS = range(1, 9)


def shards(n: int, world: int, **kwargs) -> list[list[int]]:
    """Every rank's indices, checking on the way that len() equals the number yielded."""
    out = []
    for rank in range(world):
        sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, **kwargs)
        got = list(sampler)
        assert len(sampler) == len(got), (n, world, rank, kwargs)
        assert all(type(i) is int for i in got)
        out.append(got)
    return out


def torch_shards(n: int, world: int, epoch: int = 0, **kwargs) -> list[list[int]]:
    out = []
    for rank in range(world):
        sampler = TorchDistributedSampler(range(n), num_replicas=world, rank=rank, **kwargs)
        sampler.set_epoch(epoch)
        out.append(list(sampler))
    return out


def test_shuffling_default_is_torchs_padding_index_for_index() -> None:
    """Training (shuffle=True): equal shard lengths on every rank, as torch (no DDP hang)."""
    for n in SIZES:
        for world in WORLDS:
            for epoch in (0, 3):
                ours = []
                for rank in range(world):
                    sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, seed=2)
                    sampler.set_epoch(epoch)
                    ours.append(list(sampler))
                assert ours == torch_shards(n, world, epoch=epoch, seed=2), (n, world)
                assert len({len(p) for p in ours}) <= 1


@pytest.mark.parametrize("shuffle", [False, True])
def test_exact_mode_is_disjoint_complete_and_balanced(shuffle: bool) -> None:
    """The default without shuffling (evaluation), and pad=False with it."""
    for n in SIZES:
        for world in WORLDS:
            parts = shards(n, world, shuffle=shuffle, pad=False)
            flat = [i for part in parts for i in part]
            assert len(flat) == len(set(flat)), (n, world)  # disjoint
            assert sorted(flat) == list(range(n)), (n, world)  # complete
            lengths = [len(p) for p in parts]
            assert max(lengths) - min(lengths) <= 1, (n, world, lengths)
            # the first n % world ranks hold the extra sample
            assert lengths == [n // world + (r < n % world) for r in range(world)]


@pytest.mark.parametrize("shuffle", [False, True])
def test_default_is_a_prefix_of_torch_per_rank(shuffle: bool) -> None:
    for n in SIZES:
        for world in WORLDS:
            ours = shards(n, world, shuffle=shuffle, pad=False)
            theirs = torch_shards(n, world, shuffle=shuffle)
            for mine, torchs in zip(ours, theirs, strict=False):
                assert torchs[: len(mine)] == mine
                assert len(torchs) - len(mine) in (0, 1)


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.filterwarnings("ignore:drop_last=True with")  # the grid's worlds larger than the dataset
def test_pad_is_identical_to_torch(shuffle: bool, drop_last: bool) -> None:
    for n in SIZES:
        for world in WORLDS:
            for epoch in (0, 3):
                for rank in range(world):
                    kwargs = dict(num_replicas=world, rank=rank, shuffle=shuffle, seed=7, drop_last=drop_last)
                    ours = DistributedSampler(range(n), pad=True, **kwargs)
                    theirs = TorchDistributedSampler(range(n), **kwargs)
                    ours.set_epoch(epoch)
                    theirs.set_epoch(epoch)
                    assert list(ours) == list(theirs), (n, world, rank, epoch)
                    assert len(ours) == len(theirs)
                    assert ours.num_samples == theirs.num_samples
                    assert ours.total_size == theirs.total_size


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.filterwarnings("ignore:drop_last=True with")  # the grid's worlds larger than the dataset
def test_drop_last_drops_the_tail_and_equals_torch(shuffle: bool) -> None:
    for n in SIZES:
        for world in WORLDS:
            parts = shards(n, world, shuffle=shuffle, drop_last=True)
            assert parts == torch_shards(n, world, shuffle=shuffle, drop_last=True)
            assert all(len(p) == n // world for p in parts)
            flat = [i for part in parts for i in part]
            assert len(flat) == len(set(flat))
            order = epoch_permutation(n, 0, 0).tolist() if shuffle else list(range(n))
            kept = order[: n - n % world]
            assert sorted(flat) == sorted(kept)  # exactly the last n % world positions are dropped


def test_dropped_samples_change_with_the_epoch() -> None:
    n, world = 50, 8  # 2 dropped per epoch
    dropped = []
    for epoch in range(5):
        seen = set()
        for rank in range(world):
            sampler = DistributedSampler(range(n), world, rank, drop_last=True)
            sampler.set_epoch(epoch)
            seen.update(sampler)
        dropped.append(frozenset(range(n)) - seen)
    assert all(len(d) == 2 for d in dropped)
    assert len(set(dropped)) > 1


def test_order_depends_only_on_seed_and_epoch() -> None:
    def order(seed: int, epoch: int) -> list[int]:
        sampler = DistributedSampler(range(50), num_replicas=3, rank=1, seed=seed)
        sampler.set_epoch(epoch)
        return list(sampler)

    torch.manual_seed(1)
    a = order(5, 2)
    torch.manual_seed(2)
    torch.rand(100)  # global RNG state must not matter
    assert order(5, 2) == a
    assert order(5, 3) != a  # another epoch, another order
    assert order(6, 2) != a  # another seed, another order
    # the same shard, only reordered: the epoch changes the whole permutation, not just this rank's order
    assert sorted(order(5, 3)) != sorted(a)


def test_shuffle_false_ignores_epoch() -> None:
    sampler = DistributedSampler(range(10), num_replicas=3, rank=2, shuffle=False)
    first = list(sampler)
    sampler.set_epoch(9)
    assert list(sampler) == first == [2, 5, 8]


def test_docstring_worked_example() -> None:
    data = list(range(7))
    assert shards(7, 3, shuffle=False) == [[0, 3, 6], [1, 4], [2, 5]]
    assert shards(7, 3, shuffle=False, pad=True) == [[0, 3, 6], [1, 4, 0], [2, 5, 1]]
    assert shards(7, 3, shuffle=False, drop_last=True) == [[0, 3], [1, 4], [2, 5]]
    assert epoch_permutation(len(data), 0, 0).tolist() == [4, 0, 5, 3, 2, 6, 1]
    assert shards(7, 3) == [[4, 3, 1], [0, 2, 4], [5, 6, 0]]  # shuffling: padded like torch
    assert shards(7, 3, pad=False) == [[4, 3, 1], [0, 2], [5, 6]]
    assert shards(7, 3, pad=True) == [[4, 3, 1], [0, 2, 4], [5, 6, 0]]
    assert shards(7, 3, drop_last=True) == [[4, 3], [0, 2], [5, 6]]
    assert epoch_permutation(7, 0, 1).tolist() == [0, 6, 1, 3, 5, 2, 4]
    assert shards(2, 3, shuffle=False) == [[0], [1], []]
    assert shards(2, 3, pad=True) == [[0], [1], [0]]
    with pytest.warns(UserWarning, match="drop_last=True with 2 samples for num_replicas=3"):
        assert shards(2, 3, drop_last=True) == [[], [], []]
    results = doctest.testmod(fastload.sampler)
    assert results.attempted >= 4 and results.failed == 0


def test_tiny_datasets_and_empty_ranks() -> None:
    assert shards(0, 4) == [[], [], [], []]
    assert shards(1, 4, shuffle=False) == [[0], [], [], []]
    assert shards(1, 4) == [[0], [0], [0], [0]]  # shuffling pads, like torch
    assert shards(1, 1) == [[0]]
    assert shards(0, 3, pad=True) == [[], [], []]
    assert shards(1, 3, pad=True) == [[0], [0], [0]]  # torch repeats the single sample


def test_works_in_a_torch_dataloader_with_uneven_shards() -> None:
    data = torch.arange(23) * 10
    seen = []
    for rank in range(4):
        sampler = DistributedSampler(data, num_replicas=4, rank=rank, seed=3, pad=False)
        sampler.set_epoch(1)
        loader = DataLoader(data, batch_size=4, sampler=sampler)
        assert len(loader) == -(-len(sampler) // 4)
        batches = list(loader)
        assert len(batches) == len(loader)
        seen.extend(torch.cat(batches).tolist() if batches else [])
    assert sorted(seen) == [10 * i for i in range(23)]


def test_indices_matches_iteration_without_consuming_the_epoch() -> None:
    sampler = DistributedSampler(range(30), num_replicas=4, rank=3, seed=1)
    sampler.set_epoch(2)
    assert sampler.indices() == list(sampler)
    assert sampler.indices(epoch=5) != sampler.indices()
    other = DistributedSampler(range(30), num_replicas=4, rank=3, seed=1)
    other.set_epoch(5)
    assert sampler.indices(epoch=5) == list(other)


def test_is_a_torch_distributed_sampler() -> None:
    sampler = DistributedSampler(range(5), num_replicas=2, rank=0)
    assert isinstance(sampler, TorchDistributedSampler)
    assert "pad=True" in repr(sampler)  # shuffling: padded like torch
    assert "pad=False" in repr(DistributedSampler(range(5), num_replicas=2, rank=0, shuffle=False))


def test_warns_when_reused_without_set_epoch() -> None:
    sampler = DistributedSampler(range(10), num_replicas=2, rank=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(sampler)  # first epoch: fine
    with pytest.warns(UserWarning, match=r"set_epoch\(epoch\)") as record:
        list(sampler)
    assert record[0].filename == __file__  # points at the caller
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(sampler)  # warned once only


@pytest.mark.parametrize(
    "setup",
    [
        lambda s: s.set_epoch(0),  # set_epoch called (even with the same value): the user knows
        lambda s: s.load_state_dict({"epoch": 0, "seed": 0}),
        lambda s: setattr(s, "shuffle", False),  # nothing to shuffle
    ],
)
def test_no_warning_when_set_epoch_is_used_or_no_shuffle(setup) -> None:
    sampler = DistributedSampler(range(10), num_replicas=2, rank=0)
    setup(sampler)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(sampler)
        list(sampler)


def test_no_warning_when_epoch_changes_between_iterations() -> None:
    sampler = DistributedSampler(range(10), num_replicas=2, rank=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for epoch in range(3):
            sampler.set_epoch(epoch)
            list(sampler)


def test_state_dict_round_trip() -> None:
    sampler = DistributedSampler(range(40), num_replicas=3, rank=2, seed=11)
    sampler.set_epoch(4)
    state = sampler.state_dict()
    assert state == {
        "epoch": 4,
        "seed": 11,
        "position": 0,
        "num_samples": 40,
        "shuffle": True,
        "order_replicas": 3,
        "shuffle_window": None,  # no blockwise order (a dataset without shuffle_blocks)
        "shuffle_blocks": None,
    }
    fresh = DistributedSampler(range(40), num_replicas=3, rank=2)
    fresh.load_state_dict(state)
    assert list(fresh) == list(sampler)
    with pytest.raises(ValueError, match="'epoch' and 'seed'"):
        fresh.load_state_dict({"epoch": 1})
    with pytest.raises(TypeError, match="epoch should be an integer, but got epoch=1.5"):
        fresh.load_state_dict({"epoch": 1.5, "seed": 0})
    with pytest.raises(ValueError, match="num_samples=41, but this one has num_samples=40"):
        fresh.load_state_dict(state | {"num_samples": 41})


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize(("before", "after"), [(4, 2), (4, 3), (2, 4)])
@pytest.mark.parametrize("taken", [0, 1, 5, 9])
def test_sampler_state_resumes_on_another_number_of_ranks(
    shuffle: bool, before: int, after: int, taken: int
) -> None:
    """4 ranks take ``taken`` indices each; the state of one continues on 2, 3 or 4 ranks: every
    index of the epoch exactly once (evaluation) / at least once with equal lengths (training)."""
    n = 38
    old = [DistributedSampler(range(n), before, r, shuffle=shuffle, seed=3) for r in range(before)]
    for s in old:
        s.set_epoch(2)
    shards = [s.indices()[:taken] for s in old]
    state = old[0].state_dict(taken=len(shards[0]))
    new = [DistributedSampler(range(n), after, r, shuffle=shuffle, seed=0) for r in range(after)]
    for s in new:
        s.load_state_dict(state)
    lengths = [len(s) for s in new]  # what the next iteration yields: the rest
    rest = [list(s) for s in new]
    assert lengths == [len(r) for r in rest]
    seen = [i for shard in shards + rest for i in shard]
    if shuffle:  # padded: equal lengths, every index at least once, repeats only to pad
        assert len({len(r) for r in rest}) == 1 and set(seen) == set(range(n))
        assert len(seen) - n < before + after
    else:
        assert sorted(seen) == list(range(n))
    assert [list(s) for s in new] == [s.indices(2) for s in new]  # the epoch after the rest: whole


@pytest.mark.parametrize(
    "kwargs, exc, message",
    [
        (
            dict(num_replicas=3, rank=3),
            ValueError,
            r"Invalid rank 3, rank should be in the interval \[0, 2\]",
        ),
        (
            dict(num_replicas=3, rank=-1),
            ValueError,
            r"Invalid rank -1, rank should be in the interval \[0, 2\]",
        ),
        (
            dict(num_replicas=0, rank=0),
            ValueError,
            "num_replicas should be a positive integer, but got num_replicas=0",
        ),
        (
            dict(num_replicas=2.0, rank=0),
            TypeError,
            "num_replicas should be an integer, but got num_replicas=2.0",
        ),
        (dict(num_replicas=2, rank="0"), TypeError, "rank should be an integer, but got rank='0'"),
        (dict(num_replicas=2, rank=0, seed=None), TypeError, "seed should be an integer, but got seed=None"),
    ],
)
def test_bad_arguments(kwargs, exc, message) -> None:
    with pytest.raises(exc, match=message):
        DistributedSampler(range(10), **kwargs)


def test_dataset_without_len() -> None:
    with pytest.raises(TypeError, match="map-style dataset with __len__"):
        DistributedSampler(iter(range(3)), num_replicas=1, rank=0)


def test_dataset_size_change_is_reported() -> None:
    data = list(range(10))
    sampler = DistributedSampler(data, num_replicas=2, rank=0)
    data.append(10)
    with pytest.raises(RuntimeError, match="changed from 10 to 11"):
        list(sampler)


def test_needs_a_process_group_when_rank_is_not_given() -> None:
    assert not dist.is_initialized()  # torch's error: ValueError in recent torch, RuntimeError before
    with pytest.raises((RuntimeError, ValueError), match="init_process_group"):
        DistributedSampler(range(10))
    with pytest.raises((RuntimeError, ValueError), match="init_process_group"):
        DistributedSampler(range(10), num_replicas=2)
    with pytest.raises((RuntimeError, ValueError), match="init_process_group"):
        shard_indices(10)


def test_rank_and_world_from_an_initialized_group(tmp_path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        sampler = DistributedSampler(range(5), shuffle=False)
        assert (sampler.num_replicas, sampler.rank) == (1, 0)
        assert list(sampler) == [0, 1, 2, 3, 4]
        assert shard_indices(5) == range(0, 5, 1)
        # explicit values still win over the group's
        assert list(DistributedSampler(range(5), num_replicas=2, rank=1, shuffle=False)) == [1, 3]
    finally:
        dist.destroy_process_group()


def test_shard_indices_is_the_unshuffled_sampler() -> None:
    for n in SIZES:
        for world in WORLDS:
            for rank in range(world):
                expected = list(DistributedSampler(range(n), world, rank, shuffle=False))
                assert list(shard_indices(n, world, rank)) == expected
    with pytest.raises(ValueError, match="n should be a non-negative integer, but got n=-1"):
        shard_indices(-1, 2, 0)
    with pytest.raises(ValueError, match="Invalid rank 2"):
        shard_indices(5, 2, 2)


def test_epoch_random_sampler_is_the_one_replica_order_of_each_epoch() -> None:
    sampler = EpochRandomSampler(range(7), seed=3)
    assert len(sampler) == 7
    assert (
        list(sampler)
        == epoch_permutation(7, 3, 0).tolist()
        == list(DistributedSampler(range(7), 1, 0, seed=3))
    )
    sampler.set_epoch(1)
    assert list(sampler) == epoch_permutation(7, 3, 1).tolist() != epoch_permutation(7, 3, 0).tolist()
    assert sorted(sampler) == list(range(7))


def test_without_a_process_group_the_error_is_torchs_with_a_hint_after_it() -> None:
    """No process group and no num_replicas/rank: torch's DistributedSampler raises what
    torch.distributed raises (ValueError in recent torch, RuntimeError in older); fastload's
    raises an error of both types (code that catches either catches it), torch's words first."""
    assert not dist.is_initialized()
    with pytest.raises(Exception) as theirs:
        TorchDistributedSampler(list(range(10)))
    with pytest.raises(type(theirs.value)) as ours:
        DistributedSampler(list(range(10)))
    assert isinstance(ours.value, ValueError) and isinstance(ours.value, RuntimeError)  # either except
    assert str(ours.value).startswith(str(theirs.value))
    assert "pass num_replicas and rank explicitly" in str(ours.value)
    with pytest.raises(type(theirs.value)):
        DistributedSampler(list(range(10)), num_replicas=2)  # the rank still comes from the group


def test_the_blockwise_order_gives_each_rank_its_own_windows() -> None:
    """Position ``q * W + r`` is sample ``q`` of rank ``r``'s windows (``r, r + W, ...`` of the
    one-rank order) up to the shortest; the rest follows as in the one-rank order."""
    sizes = [7, 9, 8, 10, 6, 9, 8, 7, 10, 9, 8, 9, 7]  # 13 blocks, uneven
    starts = np.cumsum([0, *sizes])
    n = int(starts[-1])
    for window, world in ((1, 4), (2, 4), (3, 2), (2, 3), (4, 5)):
        one = blockwise_permutation(starts, window, 5, 2)
        assert np.array_equal(one, blockwise_permutation(starts, window, 5, 2, num_replicas=1))
        block = np.searchsorted(starts, np.arange(n), side="right") - 1  # of each sample
        firsts = list(dict.fromkeys(block[one].tolist()))  # the blocks in the order's order
        windows = [
            [i for i in one.tolist() if block[i] in firsts[k : k + window]] for k in range(0, 13, window)
        ]
        streams = [sum(windows[r::world], []) for r in range(world)]
        shortest = min(map(len, streams))
        head = [streams[r][q] for q in range(shortest) for r in range(world)]
        expected = head + [i for i in one.tolist() if i not in set(head)]
        order = blockwise_permutation(starts, window, 5, 2, num_replicas=world)
        assert order.tolist() == expected and sorted(expected) == list(range(n))
        mine = [set(block[order[: shortest * world][r::world]].tolist()) for r in range(world)]
        assert sum(map(len, mine)) == len(set().union(*mine))  # no block on two ranks before the tail
        if len(windows) < world:  # fewer windows than ranks: all of it is the tail
            assert order.tolist() == one.tolist()


def test_sampler_state_of_the_blockwise_order_continues_on_other_ranks() -> None:
    class Blocks(list):
        shuffle_blocks = np.arange(0, 61, 5)  # 12 blocks of 5
        shuffle_window = 2

    data = Blocks(range(60))
    four = [DistributedSampler(data, num_replicas=4, rank=r, seed=1) for r in range(4)]
    before = [i for s in four for i in s.indices()[:4]]
    state = four[0].state_dict(taken=4)
    assert (state["position"], state["order_replicas"]) == (16, 4)
    two = [DistributedSampler(data, num_replicas=2, rank=r, seed=1) for r in range(2)]
    for s in two:
        s.load_state_dict(state)
    assert len(two[0]) == 22
    after = [i for s in two for i in s]
    assert sorted(before + after) == list(range(60))
    # 44 left on 3 ranks: padded as torch pads, with the saved order's first sample
    three = [DistributedSampler(data, num_replicas=3, rank=r, seed=1) for r in range(3)]
    for s in three:
        s.load_state_dict(state)
    assert [len(s) for s in three] == [15] * 3
    after = [i for s in three for i in s]
    first = int(blockwise_permutation(data.shuffle_blocks, 2, 1, 0, num_replicas=4)[0])
    assert sorted(before + after) == sorted([*range(60), first])
