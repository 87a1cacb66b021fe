from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fastload import benchmark


def test_throughput_bench_writes_records_and_table(
    imagenet_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.json"
    code = benchmark.main(
        [
            "--data",
            str(imagenet_root),
            "--workers",
            "0",
            "--backends",
            "torchvision,decode-ceiling",
            "--pipelines",
            "train,val",
            "--batch-size",
            "4",
            "--batches",
            "2",
            "--warmup",
            "1",
            "--repeat",
            "1",
            "--json",
            str(out),
            "--plot",
            str(tmp_path / "p.png"),
        ]
    )
    assert code == 0
    records = json.loads(out.read_text())
    keys = {
        "backend",
        "pipeline",
        "num_workers",
        "batch_size",
        "images_per_s",
        "ratio_vs_torchvision",
        "stall_fraction",
        "cpu_percent",
        "rss_bytes",
        "device",
    }
    assert all(keys <= set(r) for r in records)
    assert [(r["backend"], r["pipeline"]) for r in records] == [
        ("torchvision", "train"),
        ("decode-ceiling", "train"),
        ("torchvision", "val"),
        ("decode-ceiling", "val"),
    ]
    tv = records[0]
    assert (
        tv["ratio_vs_torchvision"] == 1.0
        and tv["images_per_s"] > 0
        and tv["rss_bytes"] > 0
        and tv["device"] == "cpu"
    )
    assert 0 <= tv["stall_fraction"] <= 1
    assert records[1]["ratio_vs_torchvision"] == pytest.approx(
        records[1]["images_per_s"] / tv["images_per_s"]
    )
    printed = capsys.readouterr().out
    assert "torchvision" in printed and "decode-ceiling" in printed and "images/s" in printed
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_bench_errors_are_clear(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert benchmark.main(["--data", str(tmp_path)]) == 2
    assert "python -m fastload synth" in capsys.readouterr().err
    (tmp_path / "train").mkdir()
    assert benchmark.main(["--data", str(tmp_path), "--backends", "nope", "--workers", "0"]) == 2
    assert "unknown backend" in capsys.readouterr().err


def test_script_runs_from_any_directory(imagenet_root: Path, tmp_path: Path) -> None:
    script = Path(__file__).resolve().parents[1] / "bench" / "throughput.py"
    res = subprocess.run(
        [
            sys.executable,
            str(script),
            "--data",
            str(imagenet_root),
            "--workers",
            "0",
            "--backends",
            "torchvision",
            "--pipelines",
            "val",
            "--batch-size",
            "4",
            "--batches",
            "1",
            "--warmup",
            "0",
            "--repeat",
            "1",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert "torchvision      val" in res.stdout


def test_cli_scan(imagenet_root: Path, tmp_path: Path) -> None:
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "fastload",
            "scan",
            str(imagenet_root / "train"),
            "--save-classes",
            str(tmp_path / "c.json"),
            "--out",
            str(tmp_path / "i.npz"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert "32 images in 4 classes" in res.stdout
    from fastload import ClassIndex, FolderIndex

    assert len(ClassIndex.load(tmp_path / "c.json")) == 4 and len(FolderIndex.load(tmp_path / "i.npz")) == 32
    res = subprocess.run(
        [sys.executable, "-m", "fastload", "scan", str(tmp_path / "missing")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2 and "does not exist" in res.stderr


def test_importing_the_benchmark_imports_no_optional_dependency() -> None:
    code = (
        "import sys, fastload.dali; assert 'fastload.benchmark' not in sys.modules; "
        "import fastload.benchmark; "
        "print(sorted(m for m in sys.modules if m.startswith(('nvidia', 'matplotlib'))))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"
    assert "dali" in benchmark.BACKENDS and benchmark.BACKENDS["dali"].name == "dali"
