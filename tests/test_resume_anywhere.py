"""Resume on another number of ranks or another batch size, under torchrun with real gloo groups.

A job of 4 ranks (``torch.distributed.run --nproc-per-node 4``) runs ``k`` steps of epoch 1 and
saves rank 0's ``state_dict()``; a fresh job of 2 and one of 3 ranks (and a job of 2 saving for
one of 4) load it, call ``set_epoch(1)`` as a loop does, and finish the epoch. Over the whole
epoch every sample comes exactly once (evaluation, ``shuffle=False``) or at least once with the
same number of steps on every rank (training). Cases: fastload's fast path (an ``ImageFolder``,
whose resumed samples must have the very pixels a single-process run gives them) and torch's path
(a list), shuffle on and off, ``k`` = 0, 1, the last step but one and the last step, the batch size
kept or changed. Every case of a job runs inside one launch, so the file takes a few launches.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import fastload

TIMEOUT_S = 240
LIST_SIZE = 67  # no number of ranks here divides it

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import fastload
    from fastload import transforms as T

    out_dir, mode, root, list_size = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    tf = T.Compose([T.RandomResizedCrop(16), T.RandomHorizontalFlip()])
    images = fastload.ImageFolder(root, transform=tf)
    data = {"images": images, "list": list(range(list_size))}
    BATCH = {"images": 2, "list": 4}

    def loader(kind, shuffle, batch_size):
        return fastload.DataLoader(
            data[kind], batch_size=batch_size, shuffle=shuffle, distributed=True, seed=7, num_workers=0
        )

    def indices(kind, batch):
        return (batch.indices if kind == "images" else batch).tolist()

    def cases():
        for kind in ("images", "list"):
            for shuffle in (False, True):
                steps = torch.tensor(len(loader(kind, shuffle, BATCH[kind])))
                dist.all_reduce(steps, op=dist.ReduceOp.MAX)  # exact shards: rank 0 may have one more
                steps = int(steps)
                for k in sorted({0, 1, steps - 1, steps}):
                    yield kind, shuffle, k

    results = {}
    if mode == "save":
        for kind, shuffle, k in cases():
            lo = loader(kind, shuffle, BATCH[kind])
            lo.set_epoch(1)
            it, seen = iter(lo), []
            for _ in range(min(k, len(lo))):  # exact shards: a rank may have one batch fewer
                seen += indices(kind, next(it))
            results[f"{kind} {shuffle} {k}"] = {"seen": seen, "state": lo.state_dict()}
    else:
        saved = json.load(open(os.path.join(out_dir, "save-rank0.json")))  # rank 0's checkpoint
        reference = {}  # one process, no resume: the pixels of every sample of epoch 1
        for shuffle in (False, True):
            ref = fastload.DataLoader(images, batch_size=4, shuffle=shuffle, seed=7, num_workers=0)
            ref.set_epoch(1)
            for batch in ref:
                for i, img in zip(batch.indices.tolist(), batch[0]):
                    reference[(shuffle, i)] = img
        for name, case in saved.items():
            kind, shuffle = name.split()[0], name.split()[1] == "True"
            for batch_size in (BATCH[kind], BATCH[kind] + 1):
                lo = loader(kind, shuffle, batch_size)
                lo.load_state_dict(case["state"])
                lo.set_epoch(1)  # the usual loop: keeps the resume
                seen, steps, same_pixels = [], 0, True
                for batch in lo:
                    seen += indices(kind, batch)
                    steps += 1
                    if kind == "images":
                        for i, img in zip(batch.indices.tolist(), batch[0]):
                            same_pixels &= torch.equal(img, reference[(shuffle, i)])
                after = lo.state_dict()
                results[f"{name} {batch_size}"] = {
                    "seen": seen, "steps": steps, "same_pixels": same_pixels, "next_epoch": after["epoch"],
                }
    with open(os.path.join(out_dir, f"{mode}-rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()
    """
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torchrun(script: Path, ranks: int, args: list[str], cwd: Path) -> None:
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")
    }
    repo = str(Path(fastload.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = "1"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
        "--master-addr=127.0.0.1", f"--master-port={free_port()}", str(script), *args,
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out = proc.communicate(timeout=TIMEOUT_S)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"torchrun with {ranks} ranks did not finish within {TIMEOUT_S} s")
    assert proc.returncode == 0, out


def _job(
    tmp_path: Path, name: str, mode: str, ranks: int, root: Path, saved: Path | None = None
) -> list[Any]:
    out = tmp_path / name
    out.mkdir()
    if saved is not None:
        (out / "save-rank0.json").write_text((saved / "save-rank0.json").read_text())
    script = tmp_path / "resume_job.py"
    script.write_text(SCRIPT)
    _torchrun(script, ranks, [str(out), mode, str(root), str(LIST_SIZE)], tmp_path)
    return [json.loads((out / f"{mode}-rank{r}.json").read_text()) for r in range(ranks)]


@pytest.mark.slow
@pytest.mark.parametrize(("before", "afters"), [(4, (2, 3)), (2, (4,))])
def test_resume_on_another_number_of_ranks_and_batch_size(
    imagenet_root: Path, tmp_path: Path, before: int, afters: tuple[int, ...]
) -> None:
    saves = _job(tmp_path, "save", "save", before, imagenet_root / "train")
    sizes = {"images": 32, "list": LIST_SIZE}
    checked = 0
    for after in afters:
        loads = _job(tmp_path, f"load{after}", "load", after, imagenet_root / "train", tmp_path / "save")
        for name in saves[0]:
            kind, shuffle, k = name.split()[0], name.split()[1] == "True", int(name.split()[2])
            before_seen = [i for rank in saves for i in rank[name]["seen"]]
            for resumed in (key for key in loads[0] if key.startswith(name + " ")):
                where = f"{before} -> {after} ranks, {resumed}"
                runs = [rank[resumed] for rank in loads]
                seen = Counter(before_seen + [i for run in runs for i in run["seen"]])
                assert set(seen) == set(range(sizes[kind])), where  # nothing left out
                if shuffle:  # training: the same number of steps on every rank, repeats only to pad
                    assert len({run["steps"] for run in runs}) == 1, where
                    assert sum(seen.values()) - sizes[kind] < before + after, where
                else:  # evaluation: every sample exactly once over the whole epoch
                    assert max(seen.values()) == 1, where
                assert all(run["same_pixels"] for run in runs), where  # each sample's own augmentation
                assert all(run["next_epoch"] == 2 for run in runs), where
                if k == 0:  # nothing done yet: the new job runs the whole epoch
                    assert not before_seen
                checked += 1
    assert checked == sum(2 * len(saves[0]) for _ in afters)


# ------------------------------------------------------------- one process, ranks by sampler


def _ranks(n: int, world: int, batch_size: int, **kw: Any) -> list[fastload.DataLoader]:
    """The loaders of ``world`` ranks over ``range(n)``, each with torch's own DistributedSampler
    (as torchvision's reference script builds it), in one process."""
    from torch.utils.data.distributed import DistributedSampler as TorchSampler

    return [
        fastload.DataLoader(
            list(range(n)),
            batch_size=batch_size,
            sampler=TorchSampler(list(range(n)), num_replicas=world, rank=r, **kw),
            num_workers=0,
        )
        for r in range(world)
    ]


def _take(loader: fastload.DataLoader, k: int) -> tuple[list[int], dict[str, Any]]:
    it, seen = iter(loader), []
    for _ in range(k):
        seen += next(it).tolist()
    return seen, loader.state_dict()


@pytest.mark.parametrize("shuffle", [True, False])
def test_torch_distributed_sampler_reshards(shuffle: bool) -> None:
    """The reference script's sampler (torch's DistributedSampler, which pads): 3 ranks -> 2."""
    old = _ranks(50, 3, 4, shuffle=shuffle, seed=9)
    for lo in old:
        lo.sampler.set_epoch(2)  # the script sets the sampler's epoch, not the loader's
    taken = [_take(lo, 2) for lo in old]
    state = taken[0][1]
    assert (state["order"], state["position"], state["pad"]) == (
        "shuffle" if shuffle else "sequence",
        24,
        True,
    )
    new = _ranks(50, 2, 5, shuffle=shuffle, seed=9)
    rest = []
    for lo in new:
        lo.load_state_dict(state)
        lo.sampler.set_epoch(2)
        rest.append([i for b in lo for i in b.tolist()])
    assert len({len(r) for r in rest}) == 1  # torch's rule pads: equal steps
    seen = Counter([i for s, _ in taken for i in s] + [i for r in rest for i in r])
    assert set(seen) == set(range(50)) and sum(seen.values()) - 50 < 3 + 2
    if shuffle:
        with pytest.raises(
            fastload.ResumeError, match="shuffled with seed 9, but this loader's sampler has seed 1"
        ):
            _ranks(50, 2, 5, shuffle=True, seed=1)[0].load_state_dict(state)


def test_states_of_every_rank_and_ranks_that_stopped_apart() -> None:
    """Exact shards of 10 on 4 ranks (3, 3, 2, 2 samples), batches of 1: after 2 steps ranks 2 and 3
    have finished; a list of all four states resumes exactly; states 1 step apart are refused."""
    import os

    def rank_loaders(world: int) -> list[fastload.DataLoader]:
        out = []
        for r in range(world):
            os.environ.update(WORLD_SIZE=str(world), RANK=str(r))
            out.append(fastload.DataLoader(list(range(10)), batch_size=1, distributed=True, num_workers=0))
        return out

    env = {k: os.environ.get(k) for k in ("WORLD_SIZE", "RANK")}
    try:
        old = rank_loaders(4)
        taken = [_take(lo, min(2, len(lo))) for lo in old]
        states = [s for _, s in taken]
        new = rank_loaders(3)
        new[0].load_state_dict(states)
        assert [b.tolist() for b in new[0]] == [[8]]
        new[1].load_state_dict(states[::-1])  # any order
        assert [b.tolist() for b in new[1]] == [[9]]
        apart = rank_loaders(4)
        ahead = list(states)
        ahead[0] = _take(apart[0], 3)[1]  # rank 0 one step further: {0, 4, 8} ... {3, 7}: still a prefix
        new[2].load_state_dict(ahead)
        assert [b.tolist() for b in new[2]] == []  # the rest is [9]: rank 0's of 3
        ahead[0], ahead[1] = states[0], _take(apart[1], 3)[1]  # rank 1 took 9 before 8 was handed out
        with pytest.raises(fastload.ResumeError, match=r"rank 0: 2 batches, rank 1: 3 batches.*same step"):
            new[2].load_state_dict(ahead)
        with pytest.raises(fastload.ResumeError, match="differ in 'epoch'"):
            new[2].load_state_dict([states[0] | {"epoch": 5}, *states[1:]])
    finally:
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_a_custom_sampler_resumes_only_with_the_same_sizes() -> None:
    data = list(range(20))
    make = lambda b: fastload.DataLoader(data, batch_size=b, sampler=list(reversed(data)), num_workers=0)  # noqa: E731
    seen, state = _take(make(4), 2)
    assert state["position"] is None and state["order"] is None
    same = make(4)
    same.load_state_dict(state)
    it = iter(same)
    assert len(it) == 3 and len(same) == 5  # the pass's own batches; the loader's whole epoch
    assert seen + [i for b in it for i in b.tolist()] == list(reversed(data))
    with pytest.raises(
        fastload.ResumeError, match="batches of 4.*but this loader has.*batches of 5.*same sampler"
    ):
        make(5).load_state_dict(state)
    shuffled = fastload.DataLoader(data, batch_size=4, shuffle=True, num_workers=0)
    with pytest.raises(fastload.ResumeError, match="order None"):
        shuffled.load_state_dict(state)


def test_set_epoch_of_the_resumed_epoch_keeps_the_resume() -> None:
    """The usual loop calls set_epoch(epoch) at the top of every epoch, the resumed one too; a state
    saved at the last batch of an epoch leaves nothing of it (set_epoch of it: an empty pass)."""
    make = lambda: fastload.DataLoader(list(range(12)), batch_size=4, shuffle=True, seed=3, num_workers=0)  # noqa: E731
    full = make()
    full.set_epoch(5)
    order = [b.tolist() for b in full]
    seen, state = _take(make(), 0)
    lo = make()
    lo.set_epoch(5)
    seen, state = _take(lo, 1)
    resumed = make()
    resumed.load_state_dict(state)
    resumed.set_epoch(5)
    assert [b.tolist() for b in resumed] == order[1:]
    resumed.load_state_dict(state)
    resumed.set_epoch(6)  # another epoch: from its start
    assert len(list(resumed)) == 3
    lo.set_epoch(5)
    _, last = _take(lo, 3)  # saved inside the pass, after its last batch
    assert last["epoch"] == 5 and last["position"] == 12
    ended = make()
    ended.load_state_dict(last)
    assert ended.epoch == 6  # a loop without set_epoch goes on with the next epoch
    ended.set_epoch(5)
    assert list(ended) == []  # ... and one that resumes at epoch 5 gets nothing more of it
    assert len(list(ended)) == 3 and ended.epoch == 7


def _env(world: int, rank: int) -> None:
    import os

    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank))


@pytest.fixture
def clean_env() -> Any:
    import os

    saved = {k: os.environ.get(k) for k in ("WORLD_SIZE", "RANK")}
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_loader_without_distributed_in_a_multi_rank_job_resumes_its_whole_rest(
    clean_env: Any, shuffle: bool
) -> None:
    """Each rank of a torchrun job may run a plain loader over the whole dataset (no sharding)."""
    _env(2, 1)

    def make(b: int) -> fastload.DataLoader:
        return fastload.DataLoader(list(range(20)), batch_size=b, shuffle=shuffle, seed=4, num_workers=0)

    seen, state = _take(make(4), 2)
    assert (state["position"], state["num_replicas"]) == (8, 1)
    resumed = make(3)
    resumed.load_state_dict(state)
    assert sorted(seen + [i for b in resumed for i in b.tolist()]) == list(range(20))


def test_a_state_of_a_users_sampler_on_a_loader_with_its_own() -> None:
    """Saved with torch's DistributedSampler passed by the user, resumed with shuffle=False (one rank):
    the same order, so the rest; shuffled by a sampler whose seed is not the loader's: refused."""
    from torch.utils.data.distributed import DistributedSampler as TorchSampler

    data = list(range(10))
    ranks = [
        fastload.DataLoader(
            data, batch_size=2, sampler=TorchSampler(data, 2, r, shuffle=False), num_workers=0
        )
        for r in range(2)
    ]
    taken = [_take(lo, 2) for lo in ranks]
    seen, state = [i for t in taken for i in t[0]], taken[0][1]
    assert state["sampler_epoch"] == 0
    one = fastload.DataLoader(data, batch_size=2, shuffle=False, num_workers=0)
    one.load_state_dict(state)
    assert sorted(seen + [i for b in one for i in b.tolist()]) == data
    shuffled = fastload.DataLoader(
        data, batch_size=2, seed=42, sampler=TorchSampler(data, 2, 0, seed=5), num_workers=0
    )
    _, state = _take(shuffled, 1)
    own = fastload.DataLoader(data, batch_size=2, seed=42, shuffle=True, num_workers=0)
    with pytest.raises(fastload.ResumeError, match="seed 5, epoch 0.*seed 42.*Pass that sampler again"):
        own.load_state_dict(state)
    from fastload.sampler import EpochRandomSampler

    _, state = _take(
        fastload.DataLoader(data, batch_size=2, sampler=EpochRandomSampler(data, seed=5), num_workers=0), 2
    )
    other = fastload.DataLoader(data, batch_size=3, sampler=EpochRandomSampler(data, seed=6), num_workers=0)
    with pytest.raises(
        fastload.ResumeError, match="shuffled with seed 5, but this loader's sampler has seed 6"
    ):
        other.load_state_dict(state)


def test_sampler_state_twice_in_one_epoch_and_with_the_loaders() -> None:
    from fastload import DistributedSampler

    data = list(range(12))
    two = [DistributedSampler(data, 2, r, shuffle=False) for r in range(2)]
    state = two[0].state_dict(taken=2)  # each of 2 ranks took 2: position 4
    three = [DistributedSampler(data, 3, r, shuffle=False) for r in range(3)]
    for sm in three:
        sm.load_state_dict(state)
    taken = [list(sm)[:2] for sm in three]  # each takes 2 of the rest: positions 4..9
    again = three[0].state_dict(taken=2)
    assert again["position"] == 10
    one = DistributedSampler(data, 1, 0, shuffle=False)
    one.load_state_dict(again)
    assert list(one) == [10, 11] and sorted(sum(taken, [])) == list(range(4, 10))

    # the loader's state and its sampler's, both restored: the loader's says where the epoch is
    def make() -> tuple[fastload.DataLoader, DistributedSampler]:
        sm = DistributedSampler(data, 1, 0, shuffle=False)
        return fastload.DataLoader(data, batch_size=2, sampler=sm, num_workers=0), sm

    lo, sm = make()
    _, loader_state = _take(lo, 2)
    sampler_state = sm.state_dict(taken=4)
    lo, sm = make()
    lo.load_state_dict(loader_state)
    sm.load_state_dict(sampler_state)
    assert [b.tolist() for b in lo] == [[4, 5], [6, 7], [8, 9], [10, 11]]


def test_states_of_every_rank_when_the_epoch_is_over(clean_env: Any) -> None:
    """drop_last on 5 samples, 2 ranks, batches of 3: rank 1 has no batch, rank 0 took its one; and
    exact shards where ranks 2 and 3 ran out and moved on to the next epoch: both lists load as the
    epoch's end."""

    def ranks(world: int, n: int, batch: int, drop_last: bool) -> list[fastload.DataLoader]:
        out = []
        for r in range(world):
            _env(world, r)
            out.append(
                fastload.DataLoader(
                    list(range(n)),
                    batch_size=batch,
                    drop_last=drop_last,
                    distributed=True,
                    seed=0,
                    num_workers=0,
                )
            )
        return out

    los = ranks(2, 5, 3, True)
    its = [iter(lo) for lo in los]
    next(its[0])
    states = [lo.state_dict() for lo in los]
    fresh = fastload.DataLoader(list(range(5)), batch_size=3, shuffle=False, num_workers=0)
    fresh.load_state_dict(states)
    assert fresh.epoch == 1
    los = ranks(4, 10, 1, False)
    its = [iter(lo) for lo in los]
    for r, it in enumerate(its):
        for _ in range(3 if r < 2 else 2):
            next(it)
        if r >= 2:
            with pytest.raises(StopIteration):
                next(it)
    states = [lo.state_dict() for lo in los]
    assert [s["epoch"] for s in states] == [0, 0, 1, 1]
    fresh = fastload.DataLoader(list(range(10)), batch_size=1, shuffle=False, num_workers=0)
    fresh.load_state_dict(states)
    assert fresh.epoch == 1 and len(list(fresh)) == 10


def test_resharded_resume_through_torchs_persistent_workers(clean_env: Any) -> None:
    """torch's iterator with persistent process workers: a state from 3 ranks continues on 2 with
    another batch size (the rest once, len() of the pass), and the next epoch is whole again
    through the same workers (the loader's index sampler serves the rest once only)."""
    data = list(range(23))
    old = []
    for r in range(3):
        _env(3, r)
        old.append(_take(fastload.DataLoader(data, batch_size=2, distributed=True, num_workers=0), 2))
    seen = [i for s, _ in old for i in s]
    state = old[0][1]
    rest, steps = [], []
    for r in range(2):
        _env(2, r)
        lo = fastload.DataLoader(data, batch_size=3, distributed=True, num_workers=2, persistent_workers=True)
        lo.load_state_dict(state)
        it = iter(lo)
        steps.append(len(it))
        got = [b.tolist() for b in it]
        assert len(got) == steps[-1]
        rest += [i for b in got for i in b]
        assert sorted(i for b in lo for i in b.tolist()) == sorted(lo.sampler.indices(1))  # epoch 1: whole
        lo.close()
    assert sorted(seen + rest) == data  # shuffle=False: evaluation shards, each sample once
