"""What checking each pack sample's CRC-32 on read costs, against decoding the same bytes.

Usage: ``python bench/crc.py [--data ROOT] [--images 300] [--repeats 7] [--epochs 7] [--workers 0]
[--json PATH]``

Two measurements, each the median of interleaved runs (so load changes on a shared machine hit
both sides alike):

* per image, one core, bytes already in memory: ``zlib.crc32`` of the encoded file, timed right
  before the fused decode of the same file (as a loader does it) with the train
  (``RandomResizedCrop(224)`` + flip) and the val (``Resize(256)`` + ``CenterCrop(224)``) pipelines;
* end to end: ``fastload.DataLoader`` over a pack of ``ROOT/train`` (``InMemoryImageFolder.from_pack``,
  in RAM and from the memory map), batch 64, train pipeline, epochs with ``check_crc=True`` and
  ``False`` alternating (setting ``check_crc`` forgets what was checked, so every ``True`` epoch
  checks every sample: the cost of a first epoch, the only one that pays it in a real run);
  images/s of wall time and images per CPU-second of the process (steadier on a shared machine),
  and their ratios. ``--workers 0`` (the default) decodes in this process, so its CPU time is all
  the loading work; ``--workers N`` uses N thread workers (``check_crc`` changes between epochs
  of one loader).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np
import torch

import fastload.transforms as fT
from fastload import rng
from fastload.folder import scan_folder
from fastload.loader import DataLoader
from fastload.memory import InMemoryImageFolder
from fastload.pack import write_pack

from _harness.config import default_data


def _per_image(blobs: list[bytes], repeats: int) -> dict[str, float]:
    """Median microseconds per image: CRC-32, train decode, val decode.

    Each image's CRC-32 is timed right before its decode, as a loader does it (the CRC reads the
    bytes first, the decoder then finds them in the cache), so both see the same machine load.
    """
    pipes = {
        "train": fT.Compose([fT.RandomResizedCrop(224), fT.RandomHorizontalFlip()]),
        "val": fT.Compose([fT.Resize(256), fT.CenterCrop(224)]),
    }
    out = np.empty((224, 224, 3), np.uint8)
    views = [memoryview(b) for b in blobs]
    runs: dict[str, list[float]] = {"crc": [], "train": [], "val": []}
    clock = time.perf_counter
    for _ in range(repeats):
        for name, pipe in pipes.items():
            crc_s = decode_s = 0.0
            for i, v in enumerate(views):
                t0 = clock()
                zlib.crc32(v)
                t1 = clock()
                with rng.sample_scope(0, 0, i):
                    pipe.decode_into(v, out)
                t2 = clock()
                crc_s += t1 - t0
                decode_s += t2 - t1
            runs["crc"].append(crc_s)
            runs[name].append(decode_s)
    return {name: statistics.median(v) / len(blobs) * 1e6 for name, v in runs.items()}


def _epoch(
    loader: DataLoader[object], ds: InMemoryImageFolder, check: bool, epoch: int
) -> tuple[float, float]:
    """One epoch with ``check_crc=check``: (images/s of wall time, images per CPU second)."""
    ds.check_crc = check  # thread workers read the same dataset object: effective at once
    loader.set_epoch(epoch)
    n = 0
    w0, c0 = time.perf_counter(), time.process_time()
    for images, _ in loader:
        n += len(images)
    return n / (time.perf_counter() - w0), n / (time.process_time() - c0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=None, help=f"dataset root (default {default_data()})")
    p.add_argument("--images", type=int, default=300, help="images for the per-image rows")
    p.add_argument("--repeats", type=int, default=7, help="interleaved runs per per-image row")
    p.add_argument("--epochs", type=int, default=7, help="loader epochs per setting (alternating)")
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        help="thread workers (default 0: decoding in this process, whose CPU time is then exact)",
    )
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    root = (args.data or default_data()) / "train"
    torch.set_num_threads(1)
    index = scan_folder(root)
    step = max(1, len(index) // args.images)
    blobs = [index.read_bytes(i) for i in range(0, len(index), step)][: args.images]
    per = _per_image(blobs, args.repeats)
    size_kb = float(np.mean([len(b) for b in blobs])) / 1e3
    print(f"per image ({len(blobs)} images, mean {size_kb:.0f} kB, one core, median of {args.repeats}):")
    for pipe in ("train", "val"):
        print(
            f"  crc32 {per['crc']:.1f} us vs {pipe} decode {per[pipe]:.0f} us: "
            f"{100 * per['crc'] / per[pipe]:.2f} %"
        )
    record: dict[str, object] = {"images": len(blobs), "mean_kb": size_kb, "per_image_us": per}
    with tempfile.TemporaryDirectory() as tmp:
        pack = Path(tmp) / "train.fastpack"
        write_pack(index, pack)
        tf = fT.Compose([fT.RandomResizedCrop(224), fT.RandomHorizontalFlip()])
        for in_memory in (True, False):
            ds = InMemoryImageFolder.from_pack(pack, transform=tf, in_memory=in_memory)
            loader = DataLoader(
                ds, batch_size=64, shuffle=True, seed=0, num_workers=args.workers, worker_type="thread"
            )
            _epoch(loader, ds, True, 0)  # warm-up (page cache, imports, buffers)
            runs: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
            for k in range(args.epochs):
                for check in (True, False) if k % 2 == 0 else (False, True):
                    runs[check].append(_epoch(loader, ds, check, 1 + 2 * k + check))
            loader.close()
            ds.close()
            wall = {c: statistics.median(r[0] for r in runs[c]) for c in runs}
            cpu = {c: statistics.median(r[1] for r in runs[c]) for c in runs}
            where = "RAM" if in_memory else "map"
            print(
                f"loader ({where}, {len(ds)} images, {args.workers} thread workers, "
                f"median of {args.epochs} epochs each, alternating): "
                f"check_crc=True {wall[True]:.0f} img/s ({cpu[True]:.0f} per CPU-s), "
                f"False {wall[False]:.0f} img/s ({cpu[False]:.0f} per CPU-s); "
                f"ratio {wall[True] / wall[False]:.3f} wall, {cpu[True] / cpu[False]:.3f} CPU"
            )
            record[f"loader_{where}"] = {
                "check_crc": runs[True],
                "no_check": runs[False],
                "ratio_wall": wall[True] / wall[False],
                "ratio_cpu": cpu[True] / cpu[False],
            }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
