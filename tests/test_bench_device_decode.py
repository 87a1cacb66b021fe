"""``bench/device_decode.py`` on the test tree, on the CPU (a functional check: the rows, the ratio)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench" / "device_decode.py"


def test_device_decode_bench_reports_its_four_rows(imagenet_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "dd.json"
    args = ["--data", str(imagenet_root), "--batch-size", "4", "--batches", "2", "--repeat", "1"]
    run = subprocess.run(
        [sys.executable, str(BENCH), *args, "--workers", "1", "--hybrid-workers", "1", "--device", "cpu"]
        + ["--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [r["row"] for r in rows] == ["torchvision", "decode_batch", "loader", "hybrid"]
    assert all(r["images_per_s"] > 0 for r in rows) and rows[0]["vs_torchvision"] == 1.0
    assert "device cpu (libjpeg-turbo on the CPU" in run.stdout
    assert "hybrid: HybridSplit(adaptive: CPU share" in run.stdout
    too_big = subprocess.run(
        [sys.executable, str(BENCH), "--data", str(imagenet_root), "--batch-size", "1000", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert too_big.returncode == 2 and "fewer than one batch of 1000" in too_big.stderr
