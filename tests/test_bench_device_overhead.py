"""``bench/device_overhead.py``: decode="device" with its null decoder on small JPEGs (CPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench" / "device_overhead.py"


def test_device_overhead_bench_reports_both_rows(tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    args = ["--images", "130", "--batch-size", "32", "--batches", "3", "--repeat", "1", "--json", str(out)]
    run = subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [r["row"] for r in rows] == ["in place", "copies"]
    assert all(r["images_per_s"] > 0 and r["cpu_us_per_image"] > 0 for r in rows)
    assert "in place / copies:" in run.stdout
    too_few = subprocess.run(
        [sys.executable, str(BENCH), "--images", "10", "--batch-size", "32"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert too_few.returncode == 2 and "fewer than one batch of 32" in too_few.stderr


def test_device_overhead_bench_with_nvimgcodec_itself(tmp_path: Path) -> None:
    pytest.importorskip("nvidia.nvimgcodec", reason="nvImageCodec is not installed (make test installs it)")
    pytest.importorskip("fastload._nvimgcodec", reason="fastload._nvimgcodec is not built")
    out = tmp_path / "overhead.json"
    args = [
        "--images",
        "130",
        "--batch-size",
        "32",
        "--batches",
        "3",
        "--repeat",
        "1",
        "--decoder",
        "nvimgcodec",
    ]
    run = subprocess.run(
        [sys.executable, str(BENCH), *args, "--json", str(out)], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert [r["row"] for r in json.loads(out.read_text())] == ["C interface", "in place", "copies"]
    assert "nvImageCodec 0.9" in run.stdout and "C interface / in place:" in run.stdout


def test_nvimgcodec_interpreter_bench_reports_both_interfaces(tmp_path: Path) -> None:
    pytest.importorskip("nvidia.nvimgcodec", reason="nvImageCodec is not installed (make test installs it)")
    pytest.importorskip("fastload._nvimgcodec", reason="fastload._nvimgcodec is not built")
    bench = BENCH.parent / "nvimgcodec_interpreter.py"
    out = tmp_path / "interpreter.json"
    args = ["--images", "16", "--seconds", "0.2", "--repeat", "1", "--json", str(out)]
    run = subprocess.run([sys.executable, str(bench), *args], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [r["interface"] for r in rows] == ["Python interface", "C interface"]
    assert all(
        r["images_per_s"] > 0 and r["images_per_s_beside"] > 0 and r["counting_thread_share"] > 0
        for r in rows
    )
