"""The shard-aware order: on several ranks each rank reads its own shards (``TarShards`` with
``shuffle_window``), in a real gloo group of 4 ranks, then 2 of them continuing its epoch; a state
from an epoch's start on other ranks; the converter's random order (shards that mix the classes);
the shuffle-quality bench.

12 shards of 10 samples, ``shuffle_window=2``: 6 windows on 4 ranks, so ranks 0 and 1 have two
windows and ranks 2 and 3 one. Each rank's first 20 samples (windows 0-3) come from its own two
shards; the last 40 (windows 4 and 5) are split over every rank.
"""

from __future__ import annotations

import io
import json
import multiprocessing
import pickle
import subprocess
import sys
import tarfile
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch.distributed as dist

import fastload
from fastload import transforms as T
from fastload.__main__ import main
from fastload.folder import scan_folder
from fastload.sampler import blockwise_permutation
from fastload.synthetic import render_image

SHARDS, PER_SHARD, WINDOW, WORLD, BATCH, SEED, EPOCH = 12, 10, 2, 4, 5, 3, 1
N = SHARDS * PER_SHARD
JOIN_TIMEOUT_S = 120


def _dataset(root: str, window: int | None = WINDOW) -> fastload.TarShards:
    return fastload.TarShards(root, transform=T.RandomResizedCrop(8), shuffle_window=window)


def _loader(data: Any, shuffle: bool = True) -> fastload.DataLoader:
    return fastload.DataLoader(
        data, batch_size=BATCH, shuffle=shuffle, seed=SEED, distributed=True, num_workers=0
    )


def _seen(batches: Any) -> list[int]:
    return [int(i) for b in batches for i in b.indices]


def _group(store: str, rank: int, world: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )


def _checks(rank: int, tmp: Path) -> dict[str, Any]:
    """On 4 ranks: evaluation, a training epoch, a state after 2 steps; then on ranks 0 and 1 only
    (a job of 2): that state's rest, and the rest of a state the 2-rank job saved itself."""
    out: dict[str, Any] = {}
    _group(str(tmp / "store4"), rank, WORLD)
    data = _dataset(str(tmp / "shards"))
    out["eval"] = _seen(_loader(_dataset(str(tmp / "shards"), None), shuffle=False))
    train = _loader(data)
    train.set_epoch(EPOCH)
    out["train"] = _seen(train)
    four = _loader(data)
    four.set_epoch(EPOCH)
    it = iter(four)
    out["before"] = _seen([next(it), next(it)])
    out["state"] = four.state_dict()
    del it, four
    dist.barrier()
    dist.destroy_process_group()
    if rank >= 2:
        return out
    _group(str(tmp / "store2"), rank, 2)
    rest = _loader(data)
    rest.load_state_dict(out["state"])
    rest.set_epoch(EPOCH)  # the usual loop: keeps the resume
    out["after"] = _seen(rest)
    out["next_epoch"] = _seen(rest)  # epoch EPOCH + 1, built for 2 ranks
    part = _loader(data)
    part.load_state_dict(out["state"])
    it = iter(part)
    out["middle"] = _seen([next(it)])
    out["middle_state"] = part.state_dict()
    del it
    last = _loader(data)
    last.load_state_dict(out["middle_state"])
    out["last"] = _seen(last)
    dist.destroy_process_group()
    return out


def _rank(rank: int, tmp: str) -> None:
    try:
        result = _checks(rank, Path(tmp))
    except BaseException:  # noqa: BLE001 - every failure is written for the parent to report
        result = {"traceback": traceback.format_exc()}
    with open(Path(tmp) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(result, f)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[fastload.TarShards, list[dict[str, Any]]]:
    """The shards (written here: sample ``k`` of shard ``s`` is sample ``10 * s + k``), and each
    rank's results."""
    tmp = tmp_path_factory.mktemp("ranks")
    (tmp / "shards").mkdir()
    jpegs = []
    for c in range(3):
        buf = io.BytesIO()
        render_image([SEED, c], c, (12, 12)).save(buf, format="JPEG")
        jpegs.append(buf.getvalue())
    for s in range(SHARDS):
        with tarfile.open(tmp / "shards" / f"train-{s:02d}.tar", "w") as tar:
            for k in range(PER_SHARD):
                i = s * PER_SHARD + k
                for name, body in ((f"{i:04d}.jpg", jpegs[i % 3]), (f"{i:04d}.cls", str(i % 3).encode())):
                    info = tarfile.TarInfo(name)
                    info.size = len(body)
                    tar.addfile(info, io.BytesIO(body))
    data = _dataset(str(tmp / "shards"))  # writes the index sidecars before the ranks read them
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "fastload"])
    procs = [ctx.Process(target=_rank, args=(r, str(tmp)), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(JOIN_TIMEOUT_S)
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.terminate()
    assert not hung, f"{len(hung)} of {WORLD} ranks did not finish within {JOIN_TIMEOUT_S} s"
    results = [pickle.loads((tmp / f"rank{r}.pkl").read_bytes()) for r in range(WORLD)]
    for r, result in enumerate(results):
        assert "traceback" not in result, f"rank {r} failed:\n{result['traceback']}"
    return data, results


def test_evaluation_hands_out_every_sample_once(ranks) -> None:
    _, results = ranks
    assert sorted(i for r in results for i in r["eval"]) == list(range(N))


def test_training_takes_equal_steps_and_each_rank_reads_its_own_shards(ranks) -> None:
    data, results = ranks
    assert data.shard_of.tolist() == [i // PER_SHARD for i in range(N)]
    seen = [r["train"] for r in results]
    assert [len(s) for s in seen] == [N // WORLD] * WORLD  # equal steps (no padding needed here)
    assert sorted(i for s in seen for i in s) == list(range(N))
    own = []
    for r, samples in enumerate(seen):
        head = {i // PER_SHARD for i in samples[: N // WORLD - 10]}  # before the tail of 40 samples
        others = {i // PER_SHARD for q, s in enumerate(seen) if q != r for i in s}
        assert len(head) == WINDOW and not head & others, (r, head, others)
        own += head
    assert len(own) == 8  # 8 of the 12 shards are read by one rank only


def test_four_ranks_to_two_continue_the_epoch_exactly(ranks) -> None:
    _, results = ranks
    before = [i for r in results for i in r["before"]]  # 2 steps of 5 on 4 ranks: positions 0..39
    state = results[0]["state"]
    assert (state["position"], state["num_replicas"], state["order_replicas"]) == (40, 4, 4)
    after = [r["after"] for r in results[:2]]
    assert len(after[0]) == len(after[1]) == 40  # 80 left on 2 ranks: equal steps, no padding
    assert sorted(before + after[0] + after[1]) == list(range(N))  # every sample once
    # a state saved on 2 ranks inside that epoch still names the order of 4, and continues it
    middle = results[0]["middle_state"]
    assert (middle["position"], middle["num_replicas"], middle["order_replicas"]) == (50, 2, 4)
    rest = [i for r in results[:2] for i in r["middle"] + r["last"]]
    assert sorted(before + rest) == list(range(N))
    # the next epoch is built for 2 ranks
    data, _ = ranks
    order = blockwise_permutation(data.shuffle_blocks, WINDOW, SEED, EPOCH + 1, num_replicas=2)
    assert [r["next_epoch"] for r in results[:2]] == [order[0::2].tolist(), order[1::2].tolist()]
    assert not np.array_equal(order, blockwise_permutation(data.shuffle_blocks, WINDOW, SEED, EPOCH + 1))


def test_the_converter_writes_a_seeded_random_order_by_default(imagenet_root: Path, tmp_path: Path) -> None:
    folder = scan_folder(imagenet_root / "train")
    files = [folder.read_bytes(i) for i in range(len(folder))]

    def write(name: str, *args: str) -> fastload.TarShards:
        out = tmp_path / name
        assert main(["shards", str(imagenet_root / "train"), str(out), "--shard-size", "1MB", *args]) == 0
        return fastload.TarShards(out, classes=out / "train-classes.json")

    def keys_of(d: fastload.TarShards) -> list[int]:  # each key: the folder's sample number
        return [int(d.member(i)[1].split(".")[0]) for i in range(len(d))]

    ds, other, ordered = write("a"), write("c", "--seed", "1"), write("d", "--no-shuffle")
    write("b", "--seed", "0")
    keys = keys_of(ds)
    assert sorted(keys) == list(range(32)) and keys != sorted(keys)
    assert [bytes(ds.get_bytes(i)) for i in range(32)] == [files[k] for k in keys]
    assert ds.targets.tolist() == [int(folder.targets[k]) for k in keys]
    assert ds.classes == folder.classes.classes
    for t in sorted((tmp_path / "a").glob("*.tar")):  # the same seed gives the same bytes
        assert t.read_bytes() == (tmp_path / "b" / t.name).read_bytes()
    assert keys_of(other) != keys and keys_of(ordered) == list(range(32))

    def classes_per_shard(d: fastload.TarShards) -> float:
        return float(
            np.mean([len(set(d.targets[d.shard_of == s].tolist())) for s in set(d.shard_of.tolist())])
        )

    assert classes_per_shard(ds) > classes_per_shard(ordered)


def test_the_shuffle_quality_bench(tmp_path: Path) -> None:
    bench = Path(__file__).resolve().parent.parent / "bench" / "shuffle_quality.py"
    args = ["--samples", "20000", "--classes", "40", "--shard-samples", "250", "--batch-size", "64"]
    run = subprocess.run(
        [sys.executable, str(bench), *args, "--epochs", "1", "--json", str(tmp_path / "q.json")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.splitlines()[-1].startswith("verdict: shards in a random order keep at least 9")
    rows = {(r["layout"], r["window"]): r for r in json.loads((tmp_path / "q.json").read_text())["rows"]}
    assert rows[("class order", 1)]["classes"] < 4 < 30 < rows[("class order", None)]["classes"]
    assert rows[("random order", 1)]["classes_vs_full"] > 0.95
    assert (
        rows[("class order", 1)]["tv"] > rows[("class order", 16)]["tv"] > rows[("class order", None)]["tv"]
    )


def test_a_state_from_before_any_step_takes_the_new_ranks_order() -> None:
    """Nothing of the saved epoch was handed out: the job on 2 ranks runs its own order of it."""

    class Blocks(list):
        shuffle_blocks = np.arange(0, 61, 5)  # 12 blocks of 5
        shuffle_window = 2

    def loader(world: int, rank: int) -> fastload.DataLoader:
        sampler = fastload.DistributedSampler(Blocks(range(60)), num_replicas=world, rank=rank, seed=1)
        return fastload.DataLoader(Blocks(range(60)), batch_size=5, sampler=sampler)

    state = loader(4, 0).state_dict()
    assert (state["position"], state["order_replicas"]) == (0, 4)
    for rank in range(2):
        resumed = loader(2, rank)
        resumed.load_state_dict(state)
        assert [i for b in resumed for i in b.tolist()] == resumed.sampler.indices(0)
