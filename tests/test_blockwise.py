"""The blockwise ("quasi-random") order for packs larger than RAM, and read-ahead hints.

A real pack of the session's synthetic JPEGs is cut into small blocks (16 KiB) so that the few
dozen samples make many blocks and windows.
"""

from __future__ import annotations

import logging
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

import fastload.memory as memory
from fastload import DataLoader, DistributedSampler, ResumeError
from fastload import transforms as T
from fastload.folder import scan_folder
from fastload.memory import InMemoryImageFolder
from fastload.pack import PackFile, write_pack
from fastload.sampler import EpochRandomSampler, blockwise_permutation, epoch_order

BLOCK = 16 * 1024
WINDOW = 3


@pytest.fixture(scope="module")
def pack_path(imagenet_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("blockwise") / "train.fastpack"
    write_pack(scan_folder(imagenet_root / "train"), out, num_workers=0)
    return out


def _open(pack_path: Path, order: str = "blockwise", **kw: object) -> InMemoryImageFolder:
    return InMemoryImageFolder.from_pack(
        pack_path,
        transform=T.Compose([T.RandomResizedCrop(24), T.RandomHorizontalFlip()]),
        in_memory=False,
        shuffle_order=order,
        shuffle_block_bytes=BLOCK,
        shuffle_window=WINDOW,
        **kw,
    )


def test_blockwise_permutation_is_exact_once_blockwise_and_a_pure_function() -> None:
    starts = np.array([0, 3, 4, 9, 10, 16, 20, 21, 30], dtype=np.int64)  # 8 blocks of unequal size
    n = int(starts[-1])
    orders = {(s, e): blockwise_permutation(starts, 3, s, e) for s in (0, 7) for e in (0, 1)}
    for order in orders.values():
        assert sorted(order.tolist()) == list(range(n))  # every sample exactly once
        block_of = np.searchsorted(starts, order, side="right") - 1
        # Windows of 3 shuffled blocks: the positions of a window hold exactly its blocks' samples.
        first_seen = list(dict.fromkeys(block_of.tolist()))
        pos = 0
        for w in range(0, len(first_seen), 3):
            blocks = first_seen[w : w + 3]
            size = int(sum(starts[b + 1] - starts[b] for b in blocks))
            assert set(block_of[pos : pos + size].tolist()) == set(blocks)
            pos += size
    assert np.array_equal(blockwise_permutation(starts, 3, 7, 1), orders[(7, 1)])  # deterministic
    assert len({o.tobytes() for o in orders.values()}) == 4  # seed and epoch both change it
    # window=1: each block's samples stay together; a window of all blocks is a full shuffle.
    one = blockwise_permutation(starts, 1, 0, 0)
    runs = np.searchsorted(starts, one, side="right") - 1
    assert (np.diff(runs) != 0).sum() == len(starts) - 2  # 8 runs: one per block
    assert sorted(blockwise_permutation(starts, 100, 0, 0).tolist()) == list(range(n))
    assert len(blockwise_permutation(np.array([0]), 4, 0, 0)) == 0
    with pytest.raises(ValueError, match="block_starts should be increasing from 0"):
        blockwise_permutation(np.array([1, 3]), 2, 0, 0)
    with pytest.raises(ValueError, match="window should be"):
        blockwise_permutation(starts, 0, 0, 0)


def test_pack_blocks_follow_storage_and_the_samplers_use_them(pack_path: Path) -> None:
    ds = _open(pack_path)
    n = len(ds)
    blocks = ds.shuffle_blocks
    assert blocks is not None and ds.shuffle_order == "blockwise" and ds.shuffle_window == WINDOW
    offsets = ds.pack.offsets
    # A block ends at the first sample that starts past a multiple of the block size.
    assert blocks[0] == 0 and blocks[-1] == n and len(blocks) > 2 * WINDOW + 1
    for b in range(len(blocks) - 1):
        ids = offsets[blocks[b] : blocks[b + 1]] // BLOCK
        assert len(set(ids.tolist())) == 1
    expected = blockwise_permutation(blocks, WINDOW, 5, 2)
    assert np.array_equal(epoch_order(ds, n, 5, 2), expected)
    sampler = EpochRandomSampler(ds, seed=5)
    sampler.set_epoch(2)
    assert list(sampler) == expected.tolist()
    # A uniform dataset keeps torch's order.
    uniform = _open(pack_path, "uniform")
    assert uniform.shuffle_blocks is None
    assert (
        EpochRandomSampler(uniform, seed=5).indices(2).tolist()
        == torch.randperm(n, generator=torch.Generator().manual_seed(7)).tolist()
    )
    # The choice travels with the dataset to worker processes.
    copy = pickle.loads(pickle.dumps(ds))
    assert copy.shuffle_order == "blockwise" and np.array_equal(copy.shuffle_blocks, blocks)
    for d in (ds, uniform, copy):
        d.close()


def test_distributed_shards_of_the_blockwise_order(pack_path: Path) -> None:
    ds = _open(pack_path)
    n = len(ds)
    order = blockwise_permutation(ds.shuffle_blocks, WINDOW, 0, 3, num_replicas=3).tolist()
    shards = []
    for rank in range(3):
        s = DistributedSampler(ds, num_replicas=3, rank=rank, shuffle=True, seed=0, pad=False)
        s.set_epoch(3)
        shards.append(list(s))
        assert shards[-1] == order[rank::3]  # torch's strided split of the order built for 3 ranks
    flat = [i for shard in shards for i in shard]
    assert sorted(flat) == list(range(n))  # exactly once over the ranks
    padded = [list(DistributedSampler(ds, num_replicas=5, rank=r, seed=0)) for r in range(5)]
    epoch0 = blockwise_permutation(ds.shuffle_blocks, WINDOW, 0, 0, num_replicas=5).tolist()
    padded_order = (epoch0 + epoch0)[: 5 * -(-n // 5)]
    assert [padded_order[r::5] for r in range(5)] == padded  # padding like torch, of the same order
    ds.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_epoch_is_the_blockwise_order_and_resumes_mid_epoch(pack_path: Path, workers: int) -> None:
    ds = _open(pack_path)
    kwargs = {"batch_size": 5, "shuffle": True, "seed": 11, "num_workers": workers}
    loader = DataLoader(ds, **kwargs)
    epochs = []
    for epoch in range(2):
        batches = list(loader)
        idx = torch.cat([b.indices for b in batches]).tolist()
        assert idx == blockwise_permutation(ds.shuffle_blocks, WINDOW, 11, epoch).tolist()
        for b in batches:
            assert b.labels.tolist() == ds.targets[b.indices.numpy()].tolist()
        epochs.append(batches)
    # Stop after 3 batches of epoch 0, save, resume in a new loader: the rest of the epoch, bit for bit.
    first = DataLoader(ds, **kwargs)
    it = iter(first)
    for _ in range(3):
        next(it)
    state = pickle.loads(pickle.dumps(first.state_dict()))
    del it
    second = DataLoader(ds, **{**kwargs, "seed": 999})
    second.load_state_dict(state)
    rest = list(second)
    assert len(rest) == len(epochs[0]) - 3
    for a, b in zip(rest, epochs[0][3:], strict=True):
        assert torch.equal(a.indices, b.indices) and torch.equal(a.images, b.images)
    # Blocks of another size: the rest of the epoch would repeat and skip samples.
    other = InMemoryImageFolder.from_pack(
        pack_path,
        in_memory=False,
        shuffle_order="blockwise",
        shuffle_block_bytes=64 * BLOCK,
        shuffle_window=WINDOW,
    )
    with pytest.raises(ResumeError, match="blocks, crc32 .* layout changed"):
        DataLoader(other, **kwargs).load_state_dict(state)
    other.close()
    for lo in (loader, first, second):
        lo.close()
    ds.close()


def test_auto_picks_blockwise_only_for_a_map_larger_than_ram(
    pack_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with PackFile(pack_path) as pack:
        size = pack.nbytes
    monkeypatch.setattr(memory, "available_memory", lambda: size - 1)
    with caplog.at_level(logging.WARNING, logger="fastload.memory"):
        ds = InMemoryImageFolder.from_pack(pack_path, in_memory=False)
    assert ds.shuffle_order == "blockwise" and ds.shuffle_window == 64
    assert len(caplog.records) == 1
    message = caplog.records[0].getMessage()
    assert str(pack_path) in message and "larger than the available RAM" in message
    assert "shuffle_order='uniform'" in message
    ds.close()
    monkeypatch.setattr(memory, "available_memory", lambda: 1 << 40)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fastload.memory"):
        ds = InMemoryImageFolder.from_pack(pack_path, in_memory=False)
        ram = InMemoryImageFolder.from_pack(pack_path, in_memory=True, shuffle_order="auto")
    assert ds.shuffle_order == "uniform" == ram.shuffle_order and not caplog.records
    with pytest.raises(ValueError, match="shuffle_order should be one of 'auto', 'uniform', 'blockwise'"):
        InMemoryImageFolder.from_pack(pack_path, in_memory=False, shuffle_order="quasi")
    with pytest.raises(ValueError, match="shuffle_window"):
        InMemoryImageFolder.from_pack(pack_path, in_memory=False, shuffle_window=0)
    ds.close()
    ram.close()


def test_read_ahead_hints_cover_each_batch_before_it_is_decoded(
    pack_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pool hints every batch when it hands it to the workers (from the main process, whose map
    shares the page cache with the workers): blockwise, every block of the epoch once; uniform,
    exactly the bytes of each batch's samples."""
    hinted: list[tuple[np.ndarray, np.ndarray]] = []
    real = PackFile.will_need

    def record(self: PackFile, starts: np.ndarray, stops: np.ndarray) -> None:
        hinted.append((np.asarray(starts).copy(), np.asarray(stops).copy()))
        real(self, starts, stops)  # the real madvise call must work too

    monkeypatch.setattr(PackFile, "will_need", record)
    ds = _open(pack_path)
    offsets = ds.pack.offsets
    loader = DataLoader(
        ds, batch_size=4, shuffle=True, seed=2, num_workers=2, worker_type="thread", epoch_lookahead=False
    )
    got = torch.cat([b.indices for b in loader]).numpy()
    covered = np.zeros(int(offsets[-1]), dtype=bool)
    for starts, stops in hinted:
        for a, b in zip(starts.tolist(), stops.tolist(), strict=True):
            covered[a:b] = True
    assert all(covered[offsets[i] : offsets[i + 1]].all() for i in got)
    blocks = ds.shuffle_blocks
    first_bytes = offsets[blocks]
    hinted_blocks = [int(np.searchsorted(first_bytes, a, side="right") - 1) for s, _ in hinted for a in s]
    assert sorted(hinted_blocks) == list(range(len(blocks) - 1))  # each block once (2 windows remembered)
    loader.close()
    ds.close()

    hinted.clear()
    ds = _open(pack_path, "uniform")
    loader = DataLoader(
        ds, batch_size=4, shuffle=True, seed=2, num_workers=2, worker_type="thread", epoch_lookahead=False
    )
    batches = [b.indices.numpy() for b in loader]
    assert len(hinted) == len(batches)
    for (starts, stops), idx in zip(hinted, batches, strict=True):
        assert np.array_equal(starts, offsets[idx]) and np.array_equal(stops, offsets[idx + 1])
    loader.close()
    ds.close()
