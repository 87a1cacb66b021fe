"""Where one image's time goes: the val (or train) path of fastload's fused decode, stage by stage.

Usage: ``python bench/stages.py [--data ROOT] [--split val] [--images 300] [--repeats 5] [--json PATH]``

One process, one thread (``torch.set_num_threads(1)``), files in memory. Each stage is timed where
the pipeline calls it (the functions are wrapped, the pipeline is unchanged), in CPU time of the
process, the median over ``--repeats`` passes, per image:

* header: reading the JPEG header (libjpeg-turbo, C extension);
* decode: decoding the region the output needs (the crop box plus the resampling filter's reach;
  evaluation pipelines at full size);
* resample + crop + write: the resize of the box straight into the batch slot (the crop is the
  box; the C copy of PIL's resample for evaluation pipelines, torch's uint8 kernels for training);
* plan and the rest: the crop parameters, the checks and the Python around the stages;
* normalize: the main process's conversion of the uint8 batch to normalized float32
  (``fastload.gpu.Normalize`` on a batch of 32, per image), and a recognised torchvision pipeline's
  per-image conversion (``ToTensor`` + ``Normalize`` through the C extension's tables);
* full decode: a full-size PIL decode of the same files, the reference of ``bench/throughput.py``.

The hand-off of a batch between a worker and the main process is a few shared-memory slot indices
through a queue (no pixels are copied); ``bench/throughput.py`` measures the whole loop.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fastload import fused, gpu
from fastload import transforms as T
from fastload.decode import decode_pil
from fastload.recognize import convert_pipeline
from fastload.transforms import IMAGENET_MEAN, IMAGENET_STD

DEFAULT_DATA = Path.home() / ".cache" / "fastload" / "synthetic-imagenet"


class _Timer:
    """Wraps a module-level function of :mod:`fastload.fused` and adds up its CPU time."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.real: Callable[..., Any] = getattr(fused, name)
        self.seconds = 0.0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.process_time()
        try:
            return self.real(*args, **kwargs)
        finally:
            self.seconds += time.process_time() - t0


def _files(root: Path, n: int) -> list[bytes]:
    paths = sorted(p for p in root.rglob("*") if p.is_file())
    if not paths:
        raise SystemExit(
            f"error: no files under {root}; write a synthetic set with `python -m fastload synth`"
        )
    step = max(1, len(paths) // n)
    return [p.read_bytes() for p in paths[::step][:n]]


def measure(datas: list[bytes], split: str, repeats: int) -> dict[str, float]:
    """Milliseconds per image of each stage (medians over ``repeats`` passes)."""
    torch.set_num_threads(1)
    train = split == "train"
    pipe = (
        T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip()])
        if train
        else T.Compose([T.Resize(256), T.CenterCrop(224)])
    )
    stages = {
        "header": ["jpeg_header"],
        "decode": ["decode_jpeg_region"],
        "resample + crop + write": ["pil_resample", "run_ops", "_copy_tensor_out"],
    }
    timers = {name: _Timer(name) for names in stages.values() for name in names}
    out = np.empty((224, 224, 3), dtype=np.uint8)
    rows: dict[str, list[float]] = {k: [] for k in [*stages, "plan and the rest", "total", "full decode"]}
    n = len(datas)
    for _ in range(repeats):
        for t in timers.values():
            t.seconds = 0.0
            setattr(fused, t.name, t)
        try:
            t0 = time.process_time()
            for d in datas:
                pipe.decode_into(d, out)
            total = time.process_time() - t0
        finally:
            for t in timers.values():
                setattr(fused, t.name, t.real)
        staged = 0.0
        for stage, names in stages.items():
            seconds = sum(timers[name].seconds for name in names)
            staged += seconds
            rows[stage].append(seconds / n * 1e3)
        rows["plan and the rest"].append((total - staged) / n * 1e3)
        rows["total"].append(total / n * 1e3)
        t0 = time.process_time()
        for d in datas:
            decode_pil(d)
        rows["full decode"].append((time.process_time() - t0) / n * 1e3)
    result = {k: statistics.median(v) for k, v in rows.items()}
    # The main process's normalization of a uint8 batch (fastload's own transforms) ...
    batch = torch.randint(0, 256, (32, 3, 224, 224), dtype=torch.uint8).contiguous(
        memory_format=torch.channels_last
    )
    normalize = gpu.Normalize(IMAGENET_MEAN, IMAGENET_STD)
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        for _ in range(5):
            normalize(batch)
        times.append((time.process_time() - t0) / (5 * 32) * 1e3)
    result["normalize (batch, main process)"] = statistics.median(times)
    # ... and a recognised torchvision pipeline's per-image conversion (ToTensor + Normalize).
    import torchvision.transforms as tv

    tv_pipe = tv.Compose(
        [tv.Resize(256), tv.CenterCrop(224), tv.ToTensor(), tv.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    )
    recognised = convert_pipeline(tv_pipe)
    hwc = np.random.default_rng(0).integers(0, 256, (224, 224, 3), dtype=np.uint8)
    dst = np.empty((3, 224, 224), dtype=np.float32)
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        for _ in range(200):
            recognised.convert_sample(hwc, dst)
        times.append((time.process_time() - t0) / 200 * 1e3)
    result["normalize (per image, swap path)"] = statistics.median(times)
    return result


def scaled_decodes(datas: list[bytes], repeats: int) -> dict[str, float] | None:
    """libjpeg-turbo's DCT scaling at M/8 for the val pipeline (``Resize(256)`` + ``CenterCrop(224)``),
    measured rather than assumed: the CPU ms of a whole decode at each M/8 (relative to 8/8), and what
    decoding each image at the smallest M/8 that still leaves 256 pixels on the short side (then PIL's
    resample of the box) would save and cost in pixels against the exact path. ``None`` without the
    C extension."""
    try:
        from fastload import _jpeg
    except ImportError:
        return None
    from fastload.decode import pil_resample

    pipe = T.Compose([T.Resize(256), T.CenterCrop(224)])
    jpegs, sizes = [], []
    for d in datas:  # the JPEGs libjpeg-turbo decodes to RGB (not PNGs, not CMYK)
        try:
            header = _jpeg.header(d)
        except ValueError:
            continue
        if header[3] not in ("CMYK", "YCCK"):
            jpegs.append(d)
            sizes.append(header[:2])
    datas = jpegs
    result: dict[str, float] = {}

    def dims(w: int, h: int, m: int) -> tuple[int, int]:
        return -(-w * m // 8), -(-h * m // 8)

    for m in (8, 7, 6, 5, 4, 3, 2, 1):
        times = []
        for _ in range(repeats):
            t0 = time.process_time()
            for d, (w, h) in zip(datas, sizes, strict=True):
                _jpeg.decode(d, 0, 0, *dims(w, h, m), eighths=m)
            times.append((time.process_time() - t0) / len(datas) * 1e3)
        result[f"whole decode at {m}/8"] = statistics.median(times)
    exact = np.empty((224, 224, 3), dtype=np.uint8)
    scaled = np.empty((224, 224, 3), dtype=np.uint8)
    saved, diffs, worst, used = [], [], 0, 0
    for d, (w, h) in zip(datas, sizes, strict=True):
        m = next((m for m in range(1, 9) if min(dims(w, h, m)) >= 256), 8)
        if m == 8:
            continue  # no smaller DCT scale keeps 256 pixels: the exact path's decode anyway
        used += 1
        pipe.decode_into(d, exact)
        plan = pipe.plan(h, w)
        sw, sh = dims(w, h, m)
        pixels = np.frombuffer(_jpeg.decode(d, 0, 0, sw, sh, eighths=m), dtype=np.uint8).reshape(sh, sw, 3)
        x0, y0, x1, y1 = plan.box
        box = (x0 * sw / w, y0 * sh / h, x1 * sw / w, y1 * sh / h)
        assert pil_resample(pixels, box, "bilinear", False, scaled)
        diff = np.abs(exact.astype(np.int16) - scaled.astype(np.int16))
        diffs.append(float(diff.mean()))
        worst = max(worst, int(diff.max()))
        t0 = time.process_time()
        for _ in range(repeats):
            _jpeg.decode(d, 0, 0, w, h, eighths=8)
        t1 = time.process_time()
        for _ in range(repeats):
            _jpeg.decode(d, 0, 0, sw, sh, eighths=m)
        t2 = time.process_time()
        saved.append(1 - (t2 - t1) / max(t1 - t0, 1e-9))
    result["images where a smaller scale applies (%)"] = 100 * used / len(datas)
    if used:
        result["decode time saved on those images (%)"] = 100 * statistics.mean(saved)
        result["mean difference from the exact path (levels)"] = statistics.mean(diffs)
        result["largest difference (levels)"] = float(worst)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--data", type=Path, default=DEFAULT_DATA, help=f"dataset root (default {DEFAULT_DATA})"
    )
    parser.add_argument("--split", choices=("val", "train"), default="val", help="pipeline (default val)")
    parser.add_argument("--images", type=int, default=300, help="images to use (default 300)")
    parser.add_argument("--repeats", type=int, default=5, help="passes; medians are reported (default 5)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    if args.images < 1 or args.repeats < 1:
        parser.error("--images and --repeats must be at least 1")
    datas = _files(args.data / args.split, args.images)
    result = measure(datas, args.split, args.repeats)
    print(f"{args.split}: {len(datas)} images, one thread, CPU ms per image (median of {args.repeats})")
    total = result["total"]
    for name, ms in result.items():
        staged = name in ("header", "decode", "resample + crop + write", "plan and the rest")
        share = f"{100 * ms / total:5.1f}%" if staged else ""
        print(f"  {name:34s} {ms:7.3f}  {share}")
    print(f"  fused pipeline vs full decode: {result['full decode'] / total:.2f}x the full decode's rate")
    scaled = scaled_decodes(datas, args.repeats) if args.split == "val" else None
    if scaled is not None:
        print("libjpeg-turbo DCT scaling (M/8) for val, measured instead of used (see the docstring):")
        for name, value in scaled.items():
            print(f"  {name:46s} {value:7.3f}")
    if args.json is not None:
        record = {"split": args.split, "images": len(datas), **result, "scaled": scaled}
        args.json.write_text(json.dumps(record, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
