"""``bench/scale.py`` in its small mode: it runs, and its table and JSON hold sane numbers. Two of
its four pipelines (each a fresh process of about 9 s here): fastload's own (the fast path) and the
one-line swap (torch's iterator inside fastload.DataLoader); torch's own and fl+tv differ from
them only in the dataset object built."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench" / "scale.py"


def test_scale_bench_small(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    run = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            *("--files", "400", "--batches", "3", "--batch-size", "16", "--size", "32"),
            *("--no-spawn", "--pipelines", "fastload,swap"),
            *("--tree-parent", str(tmp_path), "--json", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["files"] == 400 and result["tree_build_s"] > 0
    assert list(result["fork"]) == ["fastload", "swap"]
    paths = {name: rec["path"] for name, rec in result["fork"].items()}
    assert paths == {"fastload": "fast", "swap": "torch"}
    for name, rec in result["fork"].items():
        assert rec["samples"] == 400
        assert 0 < rec["first_batch_s"] < 120
        assert list(rec["snapshots"]) == ["1", "3"]
        for snap in rec["snapshots"].values():
            assert len(snap["workers"]) == 2, (name, snap)  # the two workers, nothing else
            for worker in snap["workers"]:
                assert 0 < worker["private_mb"] <= worker["pss_mb"] < 4096
            assert snap["main_rss_mb"] > 100  # torch alone maps more
        assert len(rec["idle"]["workers"]) == 2, (name, rec["idle"])
        assert 0 <= rec["start_s"] <= rec["first_batch_s"]
    assert set(result["scan"]) == {"torchvision", "fastload"}
    for scan in result["scan"].values():
        assert scan["runs"] == 1 and 0 < scan["wall_s"] < 60 and scan["peak_mb"] >= 0
    words = ("private MB", "idle MB", "PSS MB", "main RSS", "1st fork", "scan torchvision", "scan fastload")
    for word in words:
        assert word in run.stdout
    assert not list(tmp_path.glob("fastload-scale-*"))  # the tree is deleted


def test_scale_bench_names_an_unknown_pipeline() -> None:
    run = subprocess.run(
        [sys.executable, str(BENCH), "--pipelines", "fastload,dali"], capture_output=True, text=True
    )
    assert run.returncode == 2
    assert "--pipelines: dali; choose from torch, fastload, fl+tv, swap" in run.stderr
