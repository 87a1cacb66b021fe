"""``bench/stages.py`` on the test tree: every stage and the M/8 measurements are reported."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

import fastload.decode

BENCH = Path(__file__).resolve().parent.parent / "bench" / "stages.py"
needs_c = pytest.mark.skipif(fastload.decode._jpeg is None, reason="needs the C extension")


@needs_c
def test_stages_bench_reports_every_stage_and_the_scaled_decodes(imagenet_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "stages.json"
    run = subprocess.run(
        [sys.executable, str(BENCH), "--data", str(imagenet_root), "--images", "12", "--repeats", "1"]
        + ["--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    stages = ["header", "decode", "resample + crop + write", "plan and the rest"]
    assert all(result[name] >= 0 for name in stages) and result["decode"] > 0
    assert result["total"] == pytest.approx(sum(result[name] for name in stages), rel=1e-6)
    scaled = result["scaled"]
    assert [f"whole decode at {m}/8" in scaled for m in range(1, 9)] == [True] * 8
    assert all(scaled[f"whole decode at {m}/8"] > 0 for m in range(1, 9))
    assert 0 <= scaled["images where a smaller scale applies (%)"] <= 100
    assert "fused pipeline vs full decode" in run.stdout


@needs_c
@pytest.mark.parametrize("eighths", range(1, 9))
def test_decode_at_eighths_gives_libjpegs_scaled_size(imagenet_root: Path, eighths: int) -> None:
    """``_jpeg.decode(..., eighths=M)``: libjpeg-turbo's M/8 DCT scaling (what bench/stages.py measures);
    the region must lie inside the scaled image."""
    jpeg = fastload.decode._jpeg
    data = next(
        p.read_bytes() for p in sorted(imagenet_root.rglob("*.JPEG")) if jpeg.header(p.read_bytes())[2] == 3
    )
    width, height = jpeg.header(data)[:2]
    w, h = math.ceil(width * eighths / 8), math.ceil(height * eighths / 8)
    assert len(jpeg.decode(data, 0, 0, w, h, eighths=eighths)) == w * h * 3
    with pytest.raises(ValueError, match="not inside"):
        jpeg.decode(data, 0, 0, w + 1, h, eighths=eighths)
    with pytest.raises(ValueError, match="eighths"):
        jpeg.decode(data, 0, 0, 1, 1, scale=2, eighths=eighths)
