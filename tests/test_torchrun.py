"""Two torchrun "nodes" on localhost: the sampler and rank helpers under a real multi-node launch.

``python -m torch.distributed.run --nnodes=2 --nproc_per_node=1 --node_rank=K`` is started twice
as two subprocesses; node 1's process has ``RANK=1`` but ``LOCAL_RANK=0``. The script each node
runs is written to ``tmp_path`` and reports back through a JSON file. ``run_two_nodes`` is
self-contained so that other torchrun tests can copy it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import fastload

TIMEOUT_S = 120
N = 11  # not divisible by the 2 ranks

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    from datetime import timedelta

    import torch.distributed as dist

    from fastload import distributed as fd
    from fastload.sampler import DistributedSampler

    out_dir, n = sys.argv[1], int(sys.argv[2])
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
    env = {k: os.environ.get(k) for k in names}
    before_init = [fd.get_rank(), fd.get_world_size(), fd.get_local_rank(), fd.get_local_world_size()]

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    # num_replicas and rank from the process group; exact shards (no padding)
    sampler = DistributedSampler(range(n), seed=5, pad=False)
    sampler.set_epoch(1)
    shard = list(sampler)
    shards = [None] * dist.get_world_size()
    dist.all_gather_object(shards, shard)
    result = {
        "env": env,
        "before_init": before_init,
        "after_init": [fd.get_rank(), fd.get_world_size(), fd.get_local_rank(), fd.get_local_world_size()],
        "sampler": [sampler.num_replicas, sampler.rank, len(sampler)],
        "shards": shards,
    }
    dist.destroy_process_group()
    with open(os.path.join(out_dir, f"node{env['GROUP_RANK']}.json"), "w") as f:
        json.dump(result, f)
    """
)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_nodes(script: Path, args: list[str], cwd: Path, timeout: float = TIMEOUT_S) -> list[str]:
    """Runs ``script`` under torchrun as 2 nodes x 1 process on localhost; returns each node's output.

    Fails the test (after killing both launchers and their workers) if they do not finish in time.
    """
    port = free_port()
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")
    }
    repo = str(Path(fastload.__file__).resolve().parent.parent)  # until fastload is pip-installed
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = "1"
    procs = []
    for node in range(2):
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes=2", "--nproc_per_node=1", f"--node_rank={node}",
            "--master_addr=127.0.0.1", f"--master_port={port}",
            str(script), *args,
        ]  # fmt: skip
        procs.append(
            subprocess.Popen(
                cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                start_new_session=True,  # its own process group, so a hang can be cleaned up whole
            )
        )  # fmt: skip
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
        pytest.fail(f"torchrun with 2 nodes did not finish within {timeout} s")
    for node, (p, out) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"node {node} exited with {p.returncode}:\n{out}"
    return outputs


@pytest.mark.slow
def test_sampler_from_a_two_node_torchrun(tmp_path: Path) -> None:
    script = tmp_path / "check_sampler.py"
    script.write_text(SCRIPT)
    run_two_nodes(script, [str(tmp_path), str(N)], cwd=tmp_path)

    results = [json.loads((tmp_path / f"node{node}.json").read_text()) for node in range(2)]
    for node, r in enumerate(results):
        assert r["env"]["RANK"] == str(node) and r["env"]["LOCAL_RANK"] == "0"
        # the helpers read the torchrun environment before the group exists, and agree after
        assert r["before_init"] == r["after_init"] == [node, 2, 0, 1]
        assert r["sampler"] == [2, node, len(range(node, N, 2))]
    assert results[1]["env"]["RANK"] != results[1]["env"]["LOCAL_RANK"]

    shards = results[0]["shards"]
    assert results[1]["shards"] == shards
    flat = [i for shard in shards for i in shard]
    assert len(flat) == len(set(flat)) == N  # disjoint, nothing padded
    assert sorted(flat) == list(range(N))  # complete
    assert [len(s) for s in shards] == [6, 5]
