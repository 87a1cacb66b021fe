"""The fast path over local tar shards against the same images as a folder: the ratio of their rates.

Usage: ``python bench/shards.py [--data ROOT] [--epochs 9] [--cpu-epochs 5] [--workers 2] [--batch-size 64]
[--shard-size 16MB] [--json PATH]``

``ROOT/train`` (default: the benchmark's synthetic dataset where ``make bench`` wrote it, else a
synthetic tree of 10 classes x 50 images written into a temporary folder) is written as tar shards
(``fastload.shardwrite.write_shards``, as ``python -m fastload shards`` does) into a temporary
folder. Then ``fastload.DataLoader`` runs the same train pipeline (``RandomResizedCrop(224)`` +
flip, batch ``--batch-size``, ``--workers`` process workers, seed 0) over ``fastload.ImageFolder``
and over ``fastload.TarShards``, one warm-up epoch each, then ``--epochs`` epochs each, the two
alternating (which goes first alternates too), so load changes on a shared machine hit both alike.
Both read from the page cache (the files were just written). The numbers reported: images/s of
each, the median over the epochs, and the ratio shards/folder (the issue's target: 0.95 or more);
then the same with no workers (``--cpu-epochs`` epochs, decoding in this process), as images per
CPU-second of this process, which a shared machine's load moves much less than wall time. The
last line is the verdict.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import fastload
import fastload.transforms as fT
from fastload.folder import scan_folder
from fastload.shardwrite import parse_size, write_shards
from fastload.synthetic import make_imagenet_like

from _harness.config import default_data

TARGET = 0.95


def _epoch(loader: fastload.DataLoader[object], epoch: int, clock: Callable[[], float]) -> float:
    """One epoch: images per second of ``clock`` (wall time, or this process's CPU time)."""
    loader.set_epoch(epoch)
    n = 0
    t0 = clock()
    for images, _ in loader:
        n += len(images)
    return n / (clock() - t0)


def _alternating(
    loaders: dict[str, fastload.DataLoader[object]], epochs: int, clock: Callable[[], float]
) -> dict[str, list[float]]:
    """A warm-up epoch each, then ``epochs`` each, alternating (and alternating which goes first)."""
    for loader in loaders.values():
        _epoch(loader, 0, clock)  # warm-up: workers, page cache, imports
    rates: dict[str, list[float]] = {name: [] for name in loaders}
    for k in range(epochs):
        for name in list(loaders) if k % 2 == 0 else list(loaders)[::-1]:
            rates[name].append(_epoch(loaders[name], 1 + k, clock))
    for loader in loaders.values():
        loader.close()
    return rates


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=None, help="dataset root holding train/ (default: see above)")
    p.add_argument("--epochs", type=int, default=9, help="measured epochs per dataset (alternating)")
    p.add_argument("--cpu-epochs", type=int, default=5, help="measured epochs per dataset in this process")
    p.add_argument("--workers", type=int, default=2, help="process workers (default 2)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--shard-size", default="16MB", help="shard size for the conversion (default 16MB)")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.data or default_data()
        if not (root / "train").is_dir():
            root = make_imagenet_like(Path(tmp) / "data", classes=10, per_class=50, val_per_class=1, seed=0)
        index = scan_folder(root / "train")
        t0 = time.perf_counter()
        summary = write_shards(index, Path(tmp) / "shards", shard_size=parse_size(args.shard_size))
        wrote = time.perf_counter() - t0
        print(
            f"{len(index)} images of {root / 'train'} written as {len(summary.shards)} shard(s) "
            f"({summary.shard_bytes / 1e6:.1f} MB) in {wrote:.1f} s"
        )
        t0 = time.perf_counter()
        shards = fastload.TarShards(summary.shards, classes=summary.classes_path)
        opened = time.perf_counter() - t0

        def pipeline() -> fT.Compose:
            return fT.Compose([fT.RandomResizedCrop(224), fT.RandomHorizontalFlip()])

        shards.transform = pipeline()
        datasets = {"folder": fastload.ImageFolder(root / "train", transform=pipeline()), "shards": shards}
        rates: dict[str, dict[str, list[float]]] = {}
        for what, workers, clock in (
            ("wall", args.workers, time.perf_counter),
            ("cpu", 0, time.process_time),
        ):
            loaders = {
                name: fastload.DataLoader(
                    ds, batch_size=args.batch_size, shuffle=True, seed=0, num_workers=workers
                )
                for name, ds in datasets.items()
            }
            assert all(loader.path == "fast" for loader in loaders.values())
            rates[what] = _alternating(loaders, args.epochs if what == "wall" else args.cpu_epochs, clock)
    print(f"TarShards opened (index sidecars read) in {opened * 1e3:.0f} ms")
    median = {what: {name: statistics.median(r) for name, r in runs.items()} for what, runs in rates.items()}
    ratio = {what: m["shards"] / m["folder"] for what, m in median.items()}
    for what, runs in rates.items():
        unit = "img/s" if what == "wall" else "img/CPU-s"
        how = f"{args.workers} workers, wall time" if what == "wall" else "in this process, its CPU time"
        print(f"{how}: shards/folder {ratio[what]:.3f}")
        for name, r in runs.items():
            each = ", ".join(f"{x:.0f}" for x in r)
            print(f"  {name:7s} {median[what][name]:7.0f} {unit} (median of {len(r)} epochs: {each})")
    if args.json:
        record = {
            "images": len(index),
            "workers": args.workers,
            "rates": rates,
            "median": median,
            "ratio": ratio,
        }
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    verdict = "meets" if ratio["wall"] >= TARGET else "misses"
    print(
        f"verdict: the fast path over local tar shards runs at {ratio['wall']:.3f}x its rate over the same "
        f"images as a folder ({args.workers} workers; {ratio['cpu']:.3f}x per CPU-second in one process); "
        f"{verdict} the {TARGET}x target"
    )


if __name__ == "__main__":
    main()
