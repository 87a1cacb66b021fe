"""``bench/recipes.py`` on the test tree: each recipe's row, the path the swap took, the profile."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench" / "recipes.py"


def test_recipes_bench_reports_rows_paths_and_the_profile(imagenet_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "recipes.json"
    recipes = "classic val v1,new recipe train v2,tensor new recipe train"
    run = subprocess.run(
        [sys.executable, str(BENCH), "--data", str(imagenet_root), "--recipes", recipes, "--workers", "0"]
        + ["--batch-size", "4", "--batches", "2", "--warmup", "1", "--repeat", "1", "--profile"]
        + ["--profile-images", "8", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    paths = {r["recipe"]: r["path"] for r in result["records"]}
    assert paths == {
        "classic val v1": "fast",
        "new recipe train v2": "head-accelerated",
        "tensor new recipe train": "head-accelerated",
    }
    assert all(r["torch"] > 0 and r["swap"] > 0 and r["ratio"] > 0 for r in result["records"])
    stages = {row["stage"]: row for row in result["profile"]}
    assert stages["total"]["torch_ms"] > 0 and stages["total"]["swap_ms"] > 0
    assert "swap/torch" in run.stdout and "stage (new recipe train, v1)" in run.stdout


def test_recipes_bench_names_an_unknown_recipe(imagenet_root: Path) -> None:
    run = subprocess.run(
        [sys.executable, str(BENCH), "--data", str(imagenet_root), "--recipes", "nope"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "unknown recipe(s): nope" in run.stderr
