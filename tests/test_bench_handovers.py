"""``bench/handovers.py``: each device-path thread's hand-overs of the interpreter per batch (CPU)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench" / "handovers.py"

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or shutil.which("cc") is None and shutil.which("gcc") is None,
    reason="the bench compiles a small C library and loads it with LD_PRELOAD (Linux, a C compiler)",
)


@pytest.mark.parametrize("decode", ["device", "hybrid"])
def test_handovers_bench_counts_each_thread_per_batch(
    imagenet_root: Path, tmp_path: Path, decode: str
) -> None:
    out = tmp_path / "handovers.json"
    args = ["--data", str(imagenet_root / "train"), "--decode", decode, "--batch-size", "4", "--batches", "3"]
    run = subprocess.run(
        [sys.executable, str(BENCH), *args, "--size", "16", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    [result] = json.loads(out.read_text())
    assert result["decode"] == decode and result["batches"] == 3 and result["device"] == "cpu"
    per_batch = result["per_batch"]
    # the thread that crops on the device: a few dozen torch calls per batch at least, each counted
    crops = per_batch["fastload-feeder" if decode == "device" else "fastload-device-decode_0"]
    assert 20 < crops < 2000, per_batch
    assert "fastload-feeder" in run.stdout and "hand-overs per batch" in run.stdout


def test_handovers_bench_says_when_a_folder_is_too_small(imagenet_root: Path) -> None:
    run = subprocess.run(
        [sys.executable, str(BENCH), "--data", str(imagenet_root / "train"), "--batch-size", "32"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 1 and "holds 1 batches of 32; 10 needed" in run.stderr


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--batches", "0"], "--batches should be at least 1, but got 0"),
        (["--batch-size", "-4"], "--batch-size should be at least 1, but got -4"),
        (["--data", "/nonexistent/fastload"], "--data /nonexistent/fastload: no such folder"),
    ],
)
def test_handovers_bench_names_a_bad_argument(args: list[str], words: str) -> None:
    run = subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and words in run.stderr
