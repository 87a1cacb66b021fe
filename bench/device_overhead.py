"""The device paths' own CPU work per image, without a GPU: decode="device" with a null decoder.

Usage: ``python bench/device_overhead.py [--images 3000] [--batches 60] [--repeat 5] [--json PATH]``

On a GPU, ``decode="device"`` runs two Python threads beside the training loop (the decoder
thread: read, header columns, crop boxes, nvImageCodec's calls, the images into tensors; the
feeder thread: the crop's resize, flip, normalisation, labels), and what they spend per image in
Python and in torch's per-call overhead (a kernel launch on a GPU) is taken from the training
thread's interpreter. Here the same code runs on the CPU with a null stand-in for nvImageCodec
(bench/_null_nvimgcodec.py: headers parsed, nothing decoded) on small JPEGs (24-48 pixels, written
once to a temporary folder) and an 8-pixel crop, so that the pixels' own work is small and the
rest is that overhead. Rows, each the median of ``--repeat`` runs of ``--batches`` batches of 256,
both rows alternated in every repeat:

* ``in place``: nvImageCodec 0.9's path: the crops decoded into one buffer per batch;
* ``copies``: each image copied out of nvImageCodec's memory (``nvimgcodec.PACKED = False``: older
  versions, or a decoder that cannot decode in place).

images/s and the process's CPU time per image (both threads; the CPU's own normalisation and
resize are a part of it that a GPU does not have). A CPU measure of the overhead, not a GPU's
figures: bench/throughput.py ``--model`` on a GPU machine is the real one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _null_nvimgcodec as null  # noqa: E402

import fastload  # noqa: E402
from fastload import gpu  # noqa: E402
from fastload.gpu import nvimgcodec  # noqa: E402


def write_small_jpegs(root: Path, images: int, classes: int = 10, seed: int = 0) -> Path:
    """``images`` small random JPEGs (24-48 pixels a side) in ``classes`` class folders under
    ``root/train``; returns that folder."""
    rng = np.random.default_rng(seed)
    train = root / "train"
    for k in range(images):
        folder = train / f"n{k % classes:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        h, w = (int(v) for v in rng.integers(24, 49, 2))
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(
            folder / f"{k:06d}.JPEG", quality=90
        )
    return train


def _run(dataset: Any, batches: int, batch_size: int, packed: bool, epoch: int) -> tuple[float, float]:
    """One timed run: (images/s, CPU microseconds per image)."""
    nvimgcodec.PACKED = packed
    loader = fastload.DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=2,
        decode="device",
        device="cpu",
        gpu_transforms=gpu.Compose(
            [gpu.RandomResizedCrop(8), gpu.RandomHorizontalFlip(), gpu.Normalize([0.5] * 3, [0.25] * 3)]
        ),
    )
    n = 0
    t0, c0 = time.perf_counter(), time.process_time()
    while n < batches * batch_size:
        loader.set_epoch(epoch)
        epoch += 1
        for _, labels in loader:
            n += len(labels)
            if n >= batches * batch_size:
                break
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    region_decoder = loader._batch_decoder(torch.device("cpu")).region_decoder
    loader.close()
    if region_decoder is None or region_decoder.packs != packed:
        raise RuntimeError(f"the {'in place' if packed else 'copies'} row did not run its path")
    return n / wall, cpu / n * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=3000, help="small JPEGs written (default 3000)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--batches", type=int, default=60, help="batches per timed run (default 60)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", metavar="PATH", help="write the rows here")
    args = p.parse_args(argv)
    if args.images < args.batch_size:
        print(f"error: --images {args.images} is fewer than one batch of {args.batch_size}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # the loader's note on a CPU device with device transforms
    rows: dict[str, list[tuple[float, float]]] = {"in place": [], "copies": []}
    previous = nvimgcodec.PACKED
    with tempfile.TemporaryDirectory(prefix="fastload-overhead-") as tmp, nvimgcodec.use_module(null):
        dataset = fastload.InMemoryImageFolder(write_small_jpegs(Path(tmp), args.images))
        try:
            _run(dataset, 2, args.batch_size, True, 0)  # warm-up: imports, first-use set-up
            for r in range(args.repeat):
                for name, packed in (("in place", True), ("copies", False)):
                    rows[name].append(_run(dataset, args.batches, args.batch_size, packed, 1000 * r))
        finally:
            nvimgcodec.PACKED = previous
    out = []
    print(f"decode='device', null decoder, {args.images} small JPEGs, batch {args.batch_size}, CPU")
    print(f"{'row':10s} {'images/s':>9s} {'min-max':>13s} {'CPU us/image':>13s}")
    for name, runs in rows.items():
        rates, cpu = [r for r, _ in runs], [c for _, c in runs]
        row = {
            "row": name,
            "images_per_s": round(statistics.median(rates), 1),
            "min": round(min(rates), 1),
            "max": round(max(rates), 1),
            "cpu_us_per_image": round(statistics.median(cpu), 1),
        }
        out.append(row)
        print(
            f"{name:10s} {row['images_per_s']:9.0f} {row['min']:6.0f}-{row['max']:<6.0f} "
            f"{row['cpu_us_per_image']:13.1f}"
        )
    print(f"in place / copies: {out[0]['images_per_s'] / out[1]['images_per_s']:.2f}x images/s")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
