"""The DDP example, run for real with torchrun on CPU (gloo)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_ddp.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_train_ddp_example_counts_every_val_sample_once(imagenet_root: Path, tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={_free_port()}",
        str(EXAMPLE),
        "--data",
        str(imagenet_root),
        "--epochs",
        "2",
        "--batch-size",
        "5",
        "--image-size",
        "32",
        "--workers",
        "1",
        "--arch",
        "resnet18",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = re.findall(
        r"val top-1 ([0-9.]+) over (\d+) samples \(val set: (\d+) samples, world size (\d+)\)", res.stdout
    )
    assert len(lines) == 2, res.stdout
    for top1, counted, size, world in lines:
        assert int(counted) == int(size) == 12 and int(world) == 2  # 12 = 4 classes x 3, odd per rank
        assert 0.0 <= float(top1) <= 1.0
    # Equal steps on both ranks: 32 samples / 2 ranks = 16 each, 3 full batches of 5 (drop_last).
    assert re.search(r"epoch 0: train loss [0-9.]+, 15 samples/rank", res.stdout), res.stdout
