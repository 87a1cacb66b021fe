"""Start-up: ``bench/first_batch.py`` runs, and fastload's own pipeline never imports torchvision."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import fastload.decode

BENCH = Path(__file__).resolve().parent.parent / "bench" / "first_batch.py"


def test_first_batch_bench_small(imagenet_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "first.json"
    run = subprocess.run(
        [sys.executable, str(BENCH), "--data", str(imagenet_root / "train"), "--runs", "1"]
        + ["--workers", "1", "--batch-size", "4", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert list(results) == ["torch", "fastload", "swap"]
    for name, stages in results.items():
        imported, built, first = (stages[s]["median"] for s in ("imported", "built", "first batch"))
        assert 0 < imported <= built < first < 300, (name, stages)
        assert 0 < stages["iter -> first batch"]["median"] <= first - built + 1e-6


@pytest.mark.skipif(
    not (fastload.decode.roi_decoder_available() and fastload.decode.pil_resample_available()),
    reason="without the C extension torchvision decodes and resizes",
)
def test_fastloads_own_pipeline_never_imports_torchvision(imagenet_root: Path) -> None:
    """With the C extension a whole epoch of fastload's dataset and transforms (quirky files
    included: gray, CMYK, PNG) runs without torchvision: the 2-3 s of ``import torchvision``
    (most of it torch._dynamo) stay out of the start-up."""
    code = f"""
import sys
import fastload
from fastload import gpu, transforms as T
dataset = fastload.ImageFolder({str(imagenet_root / "train")!r}, transform=T.Compose([
    T.RandomResizedCrop(64), T.RandomHorizontalFlip()]))
val = fastload.ImageFolder({str(imagenet_root / "val")!r}, transform=T.Compose([
    T.Resize(72), T.CenterCrop(64)]))
for ds in (dataset, val):
    loader = fastload.DataLoader(ds, batch_size=8, num_workers=0, gpu_transforms=gpu.Normalize(0.5, 0.5))
    assert loader.fast_path, loader.fast_path_reason
    assert sum(len(labels) for _, labels in loader) == len(ds)
assert "torchvision" not in sys.modules, sorted(m for m in sys.modules if m.startswith("torchvision"))[:5]
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
