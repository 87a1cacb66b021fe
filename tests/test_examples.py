"""The examples, run for real on CPU: DDP with torchrun (gloo), single-process training, evaluation."""

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


#: The examples run as two torchrun ranks with gloo on the CPU, on a GPU machine too: their checks
#: are the counting (every val sample once, equal steps), and a machine with one GPU cannot give
#: each of two ranks its own (``torch.cuda.set_device(1)``: "invalid device ordinal").
CPU_ONLY = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


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
    env = {**os.environ, **CPU_ONLY}
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


# --------------------------------------------------------------------------- single-process examples

TRAIN_SINGLE = EXAMPLE.parent / "train_single.py"
EVALUATE = EXAMPLE.parent / "evaluate.py"


@pytest.fixture(scope="module")
def odd_val_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 classes: 18 train images, 9 val images (2 ranks: shards of 5 and 4, torch would pad to 10)."""
    from fastload.synthetic import make_imagenet_like

    root = tmp_path_factory.mktemp("odd-val")
    return make_imagenet_like(root, classes=3, per_class=6, val_per_class=3, seed=1, num_workers=1)


def _run(cmd: list[str], cwd: Path) -> str:
    env = {**os.environ, **CPU_ONLY}
    res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


@pytest.mark.slow
def test_train_single_then_evaluate_gives_the_same_metrics_on_one_and_two_ranks(
    odd_val_root: Path, tmp_path: Path
) -> None:
    ckpt = tmp_path / "model.pt"
    out = _run(
        [
            sys.executable,
            str(TRAIN_SINGLE),
            "--data",
            str(odd_val_root),
            "--epochs",
            "2",
            "--batch-size",
            "4",
            "--workers",
            "1",
            "--save",
            str(ckpt),
        ],
        tmp_path,
    )
    # Per epoch: the train loss, the loader's own summary line, the val top-1 over every val image.
    for epoch in (0, 1):
        assert re.search(rf"epoch {epoch}: train loss [0-9.]+ over 16 samples", out), out  # 18 // 4 * 4
        summary = re.search(
            rf"epoch {epoch}: loader: (\d+) batches, (\d+) samples, [0-9.]+ img/s, waited", out
        )
        assert summary and summary.groups() == ("4", "16"), out
        assert re.search(rf"epoch {epoch}: val top-1 [0-9.]+ \(\d+/9\)", out), out
    assert ckpt.stat().st_size > 1_000_000  # a resnet18's weights

    args = ["--data", str(odd_val_root), "--checkpoint", str(ckpt), "--batch-size", "2", "--workers", "1"]
    one = _run([sys.executable, str(EVALUATE), *args, "--predictions", str(tmp_path / "p1.csv")], tmp_path)
    two = _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            f"--master_port={_free_port()}",
            str(EVALUATE),
            *args,
            "--predictions",
            str(tmp_path / "p2.csv"),
        ],
        tmp_path,
    )
    metrics = r"top-1 (\d+)/(\d+) = [0-9.]+, top-5 (\d+)/(\d+) = [0-9.]+, mean loss ([0-9.]+)"
    m1, m2 = re.search(metrics, one), re.search(metrics, two)
    assert m1 and m2, one + two
    # exact: every val image once, the same counts; the mean loss is a float sum whose per-sample
    # terms come from batches of other sizes on two ranks (convolution kernels differ in the last bits)
    assert m1.groups()[:4] == m2.groups()[:4] and m1.group(2) == "9"
    assert float(m1.group(5)) == pytest.approx(float(m2.group(5)), rel=1e-6)
    assert "counted 9 samples (val set: 9 samples), world size 1, samples per rank [9]" in one
    assert "counted 9 samples (val set: 9 samples), world size 2, samples per rank [5, 4]" in two
    rows = (tmp_path / "p1.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in rows] == [str(i) for i in range(9)]
    assert (tmp_path / "p2.csv").read_text() == (tmp_path / "p1.csv").read_text()
    # The last epoch's val top-1 of the training script is the evaluation's top-1.
    last = re.findall(r"epoch 1: val top-1 [0-9.]+ \((\d+)/9\)", out)
    assert last == [m1.group(1)], out


SWAP = EXAMPLE.parent / "swap_torchvision.py"


@pytest.mark.parametrize("torch_loader", [False, True])
def test_swap_example_runs_the_fast_path_with_only_the_import_changed(
    imagenet_root: Path, tmp_path: Path, torch_loader: bool
) -> None:
    # the default crop size, as a user runs it (32 pixels on a CPU, 224 with CUDA)
    cmd = [sys.executable, str(SWAP), "--data", str(imagenet_root), "--batch-size", "8"]
    out = _run([*cmd, "--workers", "2", *(["--torch"] if torch_loader else [])], tmp_path)
    if torch_loader:
        assert "torch.utils.data.dataloader.DataLoader, fast path: False" in out, out
        return
    assert "fastload.loader.DataLoader, fast path: True" in out, out
    assert re.search(r"epoch 0: 32 images, [0-9.]+ img/s", out), out
    assert re.search(r"epoch 0: 4 batches, 32 samples, [0-9.]+ img/s", out), out
