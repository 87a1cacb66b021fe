"""fastload.distributed: rank helpers, and exact metrics over real gloo process groups.

One group of processes per world size (1 to 4) runs every distributed check and writes its
results to a file; the tests below compare them with a single-process computation.
"""

from __future__ import annotations

import doctest
import math
import multiprocessing
import pickle
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from fastload import distributed as fd
from fastload.sampler import DistributedSampler

# Validation-set sizes: empty, fewer samples than ranks, and sizes no world size 2..4 divides.
VAL_SIZES = (0, 1, 2, 7, 13, 50, 101)
JOIN_SIZE = 7  # 7 samples: shards of 4/3 on 2 ranks, 3/2/2 on 3, 2/2/2/1 on 4
GROUP_TIMEOUT_S = 30  # a collective that waits longer fails instead of hanging
JOIN_TIMEOUT_S = 120  # the parent gives up on a process group after this


# ---------------------------------------------------------------- a deterministic "model"
def labels_of(idx: torch.Tensor) -> torch.Tensor:
    return (idx * 7 + 3) % 5


def predictions_of(idx: torch.Tensor) -> torch.Tensor:
    return (idx * idx) % 5


def outputs_of(idx: torch.Tensor) -> torch.Tensor:
    """Per-sample model outputs (like logits): float32 rows that differ for every sample."""
    i = idx.to(torch.float32)
    return torch.stack([i, i * 0.5 + 1, torch.sin(i)], dim=1)


def single_process_accuracy(n: int) -> tuple[int, int]:
    idx = torch.arange(n)
    return int((predictions_of(idx) == labels_of(idx)).sum()), n


# ---------------------------------------------------------------- inside each spawned rank
def _evaluate(sampler: Any) -> tuple[int, int]:
    acc = fd.Accumulator("correct", "total")
    loader = torch.utils.data.DataLoader(range(len(sampler.dataset)), batch_size=4, sampler=sampler)
    for batch in loader:
        acc.update(correct=(predictions_of(batch) == labels_of(batch)).sum(), total=batch.numel())
    totals = acc.reduce()
    return totals["correct"], totals["total"]


def _expect_error(fn) -> str:
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return "no error"


def _run_checks(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "rank": fd.get_rank(),
        "world_size": fd.get_world_size(),
        "local_rank": fd.get_local_rank(),
        "local_world_size": fd.get_local_world_size(),
        "is_main": fd.is_main_process(),
    }

    # Exact accuracy: fastload's sampler (shuffled or not), and torch's padded one for contrast.
    out["accuracy"] = {}
    out["torch_accuracy"] = {}
    for n in VAL_SIZES:
        for shuffle in (False, True):
            out["accuracy"][n, shuffle] = _evaluate(
                DistributedSampler(range(n), shuffle=shuffle, seed=3, pad=False)
            )
        torch_sampler = torch.utils.data.DistributedSampler(range(n), shuffle=False)
        out["torch_accuracy"][n] = _evaluate(torch_sampler)

    # reduce_sum: numbers, float sums and a per-class count tensor in one call.
    shard = torch.tensor(DistributedSampler(range(50), shuffle=True, pad=False).indices(), dtype=torch.int64)
    out["reduce_sum"] = fd.reduce_sum(
        len(shard),
        float((1.0 / (shard + 1).double()).sum()) if len(shard) else 0.0,
        torch.bincount(labels_of(shard), minlength=5),
    )

    # gather_by_index: outputs back in dataset order, to all ranks and to one rank.
    out["gathered"] = {}
    for n in VAL_SIZES:
        sampler = DistributedSampler(range(n), shuffle=True, seed=n, pad=False)
        idx = torch.tensor(sampler.indices(), dtype=torch.int64)
        out["gathered"][n] = (
            fd.gather_by_index(outputs_of(idx), idx),
            fd.gather_by_index(predictions_of(idx), idx.tolist(), dataset_size=n, dst=world - 1),
            fd.gather_by_index(predictions_of(idx) == labels_of(idx), idx.numpy(), dataset_size=n),
            # a list of per-batch outputs, empty on ranks without samples
            fd.gather_by_index([outputs_of(idx[i : i + 2]) for i in range(0, len(idx), 2)], idx),
        )

    # Errors are raised on every rank and leave the group usable.
    idx = DistributedSampler(range(7), shuffle=False, pad=True).indices()
    out["error_duplicate"] = _expect_error(lambda: fd.gather_by_index(torch.tensor(idx), idx))
    idx = DistributedSampler(range(7), shuffle=False, drop_last=True).indices()
    out["error_missing"] = _expect_error(lambda: fd.gather_by_index(torch.tensor(idx), idx, dataset_size=7))
    idx = DistributedSampler(range(7), shuffle=False).indices()
    bad = idx[:-1] if rank == world - 1 and idx else idx  # only the last rank gets it wrong
    out["error_one_rank"] = _expect_error(lambda: fd.gather_by_index(torch.tensor(idx), bad))

    # broadcast_object, from the first and from the last rank.
    out["broadcast"] = (
        fd.broadcast_object({"classes": ["cat", "dog"], "from": rank} if rank == 0 else None),
        fd.broadcast_object(("last", rank), src=world - 1),
    )

    out["join"] = _train_with_join(world)
    out["default_ddp"] = _train_with_defaults(world)
    return out


def _train_ddp(world: int, sampler: DistributedSampler, batch_size: int, join: bool) -> dict[str, Any]:
    """Two epochs of a plain DDP loop over ``sampler``; steps taken and every rank's weights."""
    import contextlib

    from torch.distributed.algorithms import Join
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(3, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(range(JOIN_SIZE), batch_size=batch_size, sampler=sampler)
    steps = 0
    with Join([model]) if join else contextlib.nullcontext():
        for epoch in range(2):
            sampler.set_epoch(epoch)
            for batch in loader:
                loss = (model(outputs_of(batch)) - labels_of(batch).float()).pow(2).mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                steps += 1
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    all_weights = [torch.empty_like(weights) for _ in range(world)]
    dist.all_gather(all_weights, weights)
    return {"steps": steps, "weights": all_weights}


def _train_with_defaults(world: int) -> dict[str, Any]:
    """An unchanged DDP loop, torch's sampler swapped for fastload's with default arguments."""
    return _train_ddp(world, DistributedSampler(range(JOIN_SIZE)), batch_size=2, join=False)


def _train_with_join(world: int) -> dict[str, Any]:
    """DDP on uneven shards (no padding) inside Join: must finish, with identical weights."""
    return _train_ddp(world, DistributedSampler(range(JOIN_SIZE), seed=1, pad=False), batch_size=1, join=True)


def _worker(rank: int, world: int, store: str, out_dir: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=GROUP_TIMEOUT_S),
    )
    try:
        result = _run_checks(rank, world)
    except BaseException:  # noqa: BLE001 - every failure is written for the parent to report
        result = {"traceback": traceback.format_exc()}
    finally:
        with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as f:
            pickle.dump(result, f)
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda w: f"world{w}")
def group(request, tmp_path_factory) -> tuple[int, list[dict[str, Any]]]:
    """Runs every check in one gloo group of ``world`` processes; returns each rank's results."""
    world = request.param
    tmp = tmp_path_factory.mktemp(f"world{world}")
    ctx = multiprocessing.get_context("forkserver")
    # Processes start from a server that has imported these once (about 10 s of imports per
    # process otherwise, DDP's included). Fork-safe: the server itself never runs torch ops.
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "fastload.distributed"])
    procs = [
        ctx.Process(target=_worker, args=(rank, world, str(tmp / "store"), str(tmp)), daemon=True)
        for rank in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(JOIN_TIMEOUT_S)
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.terminate()
        p.join(5)
    assert not hung, f"{len(hung)} of {world} ranks did not finish within {JOIN_TIMEOUT_S} s"
    results = []
    for rank in range(world):
        with open(tmp / f"rank{rank}.pkl", "rb") as f:
            result = pickle.load(f)
        assert "traceback" not in result, f"rank {rank} failed:\n{result['traceback']}"
        results.append(result)
    assert [p.exitcode for p in procs] == [0] * world
    return world, results


# ---------------------------------------------------------------- tests on the group results
def test_rank_helpers_in_a_group(group) -> None:
    world, results = group
    for rank, r in enumerate(results):
        assert (r["rank"], r["world_size"], r["is_main"]) == (rank, world, rank == 0)
        # spawned without LOCAL_RANK: one machine, so the local rank is the global rank
        assert (r["local_rank"], r["local_world_size"]) == (rank, world)


def test_reduced_accuracy_equals_single_process(group) -> None:
    world, results = group
    for n in VAL_SIZES:
        expected = single_process_accuracy(n)
        for shuffle in (False, True):
            for r in results:
                assert r["accuracy"][n, shuffle] == expected, (world, n, shuffle)
                assert all(type(v) is int for v in r["accuracy"][n, shuffle])
        # torch's padded sampler counts samples twice whenever world does not divide n
        torch_total = results[0]["torch_accuracy"][n][1]
        assert torch_total == (math.ceil(n / world) * world)
        if n % world:
            assert torch_total > n


def test_reduce_sum_over_ranks(group) -> None:
    _, results = group
    idx = torch.arange(50)
    expected_float = float((1.0 / (idx + 1).double()).sum())
    expected_counts = torch.bincount(labels_of(idx), minlength=5)
    for r in results:
        count, float_sum, per_class = r["reduce_sum"]
        assert count == 50 and type(count) is int
        assert math.isclose(float_sum, expected_float, rel_tol=1e-12)
        assert per_class.dtype == torch.int64
        assert torch.equal(per_class, expected_counts)


def test_gather_by_index_restores_dataset_order(group) -> None:
    world, results = group
    for n in VAL_SIZES:
        idx = torch.arange(n)
        for rank, r in enumerate(results):
            outputs, preds, correct, from_batches = r["gathered"][n]
            assert outputs.dtype == torch.float32 and torch.equal(outputs, outputs_of(idx))
            if n:  # (with no sample anywhere, the per-sample shape is unknown: any empty tensor)
                assert torch.equal(from_batches, outputs_of(idx))
            else:
                assert from_batches.numel() == 0
            assert correct.dtype == torch.bool and torch.equal(correct, predictions_of(idx) == labels_of(idx))
            if rank == world - 1:  # dst
                assert preds.dtype == torch.int64 and torch.equal(preds, predictions_of(idx))
            else:
                assert preds is None


def test_gather_by_index_errors_reach_every_rank(group) -> None:
    world, results = group
    for r in results:
        if world in (2, 3, 4):  # 7 samples do not divide: torch-style padding repeats some
            assert "more than once" in r["error_duplicate"]
            assert "missing" in r["error_missing"]
        else:
            assert r["error_duplicate"] == r["error_missing"] == "no error"
        assert f"on rank {world - 1}: values and indices should have the same length" in r["error_one_rank"]


def test_broadcast_object(group) -> None:
    world, results = group
    for r in results:
        assert r["broadcast"] == ({"classes": ["cat", "dog"], "from": 0}, ("last", world - 1))


def test_ddp_with_join_on_uneven_shards(group) -> None:
    world, results = group
    steps = [r["join"]["steps"] for r in results]
    assert steps == [2 * len(range(rank, JOIN_SIZE, world)) for rank in range(world)]
    if world > 1:
        assert len(set(steps)) > 1  # really uneven
    for r in results:
        weights = r["join"]["weights"]
        for w in weights[1:]:
            assert torch.equal(w, weights[0])  # DDP kept the replicas identical


def test_ddp_training_with_default_sampler_arguments_takes_equal_steps(group) -> None:
    """torch's DistributedSampler swapped for fastload's in a DDP loop: no hang, equal steps."""
    world, results = group
    per_epoch = math.ceil(math.ceil(JOIN_SIZE / world) / 2)  # padded shards, batches of 2
    assert [r["default_ddp"]["steps"] for r in results] == [2 * per_epoch] * world
    for r in results:
        weights = r["default_ddp"]["weights"]
        assert all(torch.equal(w, weights[0]) for w in weights[1:])


# ---------------------------------------------------------------- without a process group
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@pytest.fixture
def clean_env(monkeypatch):
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    assert not dist.is_initialized()
    return monkeypatch


def test_rank_helpers_single_process(clean_env) -> None:
    assert (fd.get_rank(), fd.get_world_size(), fd.get_local_rank(), fd.get_local_world_size()) == (
        0,
        1,
        0,
        1,
    )
    assert fd.is_main_process()


def test_rank_helpers_from_torchrun_env(clean_env) -> None:
    clean_env.setenv("RANK", "5")
    clean_env.setenv("WORLD_SIZE", "8")
    clean_env.setenv("LOCAL_RANK", "1")
    clean_env.setenv("LOCAL_WORLD_SIZE", "4")
    assert (fd.get_rank(), fd.get_world_size(), fd.get_local_rank(), fd.get_local_world_size()) == (
        5,
        8,
        1,
        4,
    )
    assert not fd.is_main_process()
    clean_env.delenv("LOCAL_RANK")
    clean_env.delenv("LOCAL_WORLD_SIZE")
    assert (fd.get_local_rank(), fd.get_local_world_size()) == (5, 8)


@pytest.mark.parametrize(
    "name, value, getter",
    [
        ("RANK", "one", fd.get_rank),
        ("RANK", "-1", fd.get_rank),
        ("WORLD_SIZE", "0", fd.get_world_size),
        ("LOCAL_RANK", "1.5", fd.get_local_rank),
        ("LOCAL_WORLD_SIZE", "0", fd.get_local_world_size),
    ],
)
def test_bad_env_values(clean_env, name, value, getter) -> None:
    clean_env.setenv(name, value)
    with pytest.raises(
        ValueError, match=f"{name} should be a (non-negative|positive) integer, but got {name}="
    ):
        getter()


def test_collectives_in_a_single_process(clean_env) -> None:
    assert fd.reduce_sum(3) == 3
    assert fd.reduce_sum(2, 0.5, True) == (2, 0.5, 1)
    counts = fd.reduce_sum(torch.tensor([1, 2], dtype=torch.int32))
    assert counts.dtype == torch.int64 and counts.tolist() == [1, 2]
    assert torch.equal(fd.gather_by_index(torch.tensor([10, 11, 12]), [2, 0, 1]), torch.tensor([11, 12, 10]))
    assert fd.gather_by_index(torch.zeros(0, 4), [], dataset_size=0).shape == (0, 4)
    assert fd.broadcast_object({"a": 1}) == {"a": 1}


def test_accumulator_single_process(clean_env) -> None:
    acc = fd.Accumulator("correct", "total", "loss")
    acc.update(correct=torch.tensor(3), total=4, loss=torch.tensor(0.5))
    acc.update(correct=2, total=torch.tensor(4, dtype=torch.int32), loss=0.25)
    assert acc.local() == {"correct": 5, "total": 8, "loss": 0.75}
    totals = acc.reduce()
    assert totals == {"correct": 5, "total": 8, "loss": 0.75}
    assert type(totals["correct"]) is int and type(totals["loss"]) is float
    acc.reset()
    assert acc.reduce() == {"correct": 0, "total": 0, "loss": 0}
    with pytest.raises(ValueError, match="unknown name 'top5'"):
        acc.update(top5=1)
    with pytest.raises(ValueError, match=r"should be scalars, but got correct with shape \(2,\)"):
        acc.update(correct=torch.tensor([1, 2]))
    with pytest.raises(TypeError, match="numbers or tensors, but got total of type str"):
        acc.update(total="4")
    with pytest.raises(ValueError, match="unique"):
        fd.Accumulator("a", "a")
    with pytest.raises(ValueError, match="at least one name"):
        fd.Accumulator()


def test_single_process_argument_errors(clean_env) -> None:
    with pytest.raises(
        TypeError, match="values should be numbers or tensors, but got values\\[1\\] of type str"
    ):
        fd.reduce_sum(1, "2")
    with pytest.raises(ValueError, match="exactly up to 2\\*\\*53"):
        fd.reduce_sum(2**60)
    with pytest.raises(ValueError, match="more than once"):
        fd.gather_by_index(torch.zeros(3), [0, 1, 1])
    with pytest.raises(ValueError, match="2 of 5 indices are missing"):
        fd.gather_by_index(torch.zeros(3), [0, 1, 2], dataset_size=5)
    with pytest.raises(ValueError, match="index 7 is out of range for dataset_size=3"):
        fd.gather_by_index(torch.zeros(3), [0, 1, 7])
    with pytest.raises(ValueError, match="same length"):
        fd.gather_by_index(torch.zeros(3), [0, 1])
    with pytest.raises(ValueError, match="dataset_size should be a non-negative integer"):
        fd.gather_by_index(torch.zeros(1), [0], dataset_size=-1)
    with pytest.raises(ValueError, match=r"Invalid dst 1"):
        fd.gather_by_index(torch.zeros(1), [0], dst=1)
    with pytest.raises(ValueError, match=r"Invalid src 2"):
        fd.broadcast_object(1, src=2)


def test_multi_process_env_without_a_group_is_an_error(clean_env) -> None:
    """Under torchrun before init_process_group, a local sum would silently be a wrong metric."""
    clean_env.setenv("WORLD_SIZE", "2")
    clean_env.setenv("RANK", "0")
    with pytest.raises(RuntimeError, match="WORLD_SIZE=2 but torch.distributed is not initialized"):
        fd.reduce_sum(1)
    with pytest.raises(RuntimeError, match="init_process_group"):
        fd.Accumulator("n").reduce()
    with pytest.raises(RuntimeError, match="init_process_group"):
        fd.gather_by_index(torch.zeros(1), [0])
    with pytest.raises(RuntimeError, match="init_process_group"):
        fd.broadcast_object(1)


def test_docstring_examples(clean_env) -> None:
    results = doctest.testmod(fd)
    assert results.attempted >= 4 and results.failed == 0


def _loader_made_before_the_group(rank: int, world: int, store: str, out_dir: str) -> None:
    import fastload

    # made before init_process_group (torch.multiprocessing.spawn; Lightning's ddp processes know
    # WORLD_SIZE but not their rank then): distributed=True must shard by the group it iterates in
    loader = fastload.DataLoader(list(range(11)), batch_size=4, distributed=True, num_workers=0)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        result: dict[str, Any] = {"len": len(loader), "seen": [int(v) for batch in loader for v in batch]}
    except BaseException:  # noqa: BLE001 - written for the parent to report
        result = {"traceback": traceback.format_exc()}
    finally:
        with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as f:
            pickle.dump(result, f)
        dist.destroy_process_group()


def test_a_distributed_loader_made_before_the_process_group_shards_by_it(tmp_path: Path) -> None:
    torch.multiprocessing.spawn(
        _loader_made_before_the_group, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2
    )
    results = []
    for rank in range(2):
        with open(tmp_path / f"rank{rank}.pkl", "rb") as f:
            results.append(pickle.load(f))
        assert "traceback" not in results[-1], results[-1]["traceback"]
    assert sorted(v for r in results for v in r["seen"]) == list(range(11))  # every sample once
    assert [r["len"] for r in results] == [2, 2]  # 6 and 5 samples in batches of 4
