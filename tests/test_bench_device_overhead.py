"""``bench/device_overhead.py``: decode="device" with its null decoder on small JPEGs (CPU)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
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
    assert all("busy_ms_per_batch" not in r for r in rows)
    too_few = subprocess.run(
        [sys.executable, str(BENCH), "--images", "10", "--batch-size", "32"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert too_few.returncode == 2 and "fewer than one batch of 32" in too_few.stderr


def test_device_overhead_bench_measures_a_busy_thread_beside_each_pass(tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    args = ["--images", "130", "--batch-size", "32", "--batches", "3", "--repeat", "1", "--beside"]
    run = subprocess.run(
        [sys.executable, str(BENCH), *args, "--json", str(out)], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [r["row"] for r in rows] == ["in place", "copies"]
    for r in rows:  # a number of milliseconds (it can be a little below 0 where nothing is taken)
        assert math.isfinite(r["busy_ms_per_batch"]) and -1000 < r["busy_ms_per_batch"] < 10_000
    assert "a training thread's stand-in beside each pass" in run.stdout
    assert "busy ms/batch" in run.stdout


def test_the_busy_thread_counts_while_it_runs_and_stops() -> None:
    sys.path.insert(0, str(BENCH.parent))
    try:
        import device_overhead
    finally:
        sys.path.remove(str(BENCH.parent))
    busy = device_overhead.BusyThread(None)
    try:
        assert busy.rate(0.2) > 0
    finally:
        busy.stop()
    count = busy.count
    time.sleep(0.05)
    assert busy.count == count and not busy._thread.is_alive()


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
