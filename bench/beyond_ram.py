"""Cold-cache epochs of a pack served from its map: uniform vs blockwise ("quasi-random") order.

Usage: ``python bench/beyond_ram.py [--data DIR] [--copies 4] [--cache-fraction 0.25] [--json PATH]``.

A pack is written from the train split of ``--data`` (repeated ``--copies`` times, in the
folder's class order, as ``python -m fastload pack`` writes it) into a temporary folder. For each
order (``InMemoryImageFolder.from_pack(..., in_memory=False, shuffle_order=...)``) the script runs
epochs of ``fastload.DataLoader`` (train transforms, thread workers so that one process does all
the reading and ``/proc/self/io`` counts it) and reports images/s and the bytes read from disk
(``read_bytes``) per epoch, in two settings:

* ``cold``: the pack is evicted from the page cache before each epoch (``madvise(MADV_DONTNEED)``
  on the map, then ``posix_fadvise(POSIX_FADV_DONTNEED)``; no root needed). Within the epoch the
  whole pack fits in the cache, so both orders read it about once; what differs is the pattern
  (a random read per sample vs a few large sequential reads per block).
* ``budget``: as ``cold``, and during the epoch the script also keeps the pack's cached bytes
  under ``--cache-fraction`` of its size: it tracks the chunks (``--chunk`` bytes) of the samples
  each batch used, least recently used first, and evicts the oldest chunks the same way whenever
  they exceed the budget. This emulates a pack larger than RAM (a machine whose page cache holds
  a quarter of it) on a machine where it fits; the kernel's own reclaim is not used, because a
  pack larger than this machine's RAM cannot be written here.

Rows alternate between the orders (``--repeat`` times) and medians are reported with the ratio
blockwise / uniform of the same run.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from fastload import DataLoader
from fastload import transforms as T
from fastload.folder import scan_folder
from fastload.memory import InMemoryImageFolder
from fastload.pack import write_pack

_MiB = 1 << 20


def _read_bytes() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    raise RuntimeError("no read_bytes in /proc/self/io")


class _Cache:
    """Evicts the pack's pages: all of them, or the least recently used chunks beyond a budget."""

    def __init__(
        self, ds: InMemoryImageFolder, others: list[InMemoryImageFolder], chunk: int, budget: int | None
    ) -> None:
        pack = ds.pack  # the map the loader reads through (thread workers: this process's map)
        if pack is None:
            raise ValueError("the dataset should be served from its pack's map (in_memory=False)")
        self.pack = pack
        # Every map of the file in this process: a page still mapped by one of them is not dropped.
        self.maps = [pack] + [o.pack for o in others if o.pack is not None and o is not ds]
        self.offsets = pack.offsets
        self.chunk = chunk
        self.budget = budget
        self.lru: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.evictions = 0

    def evict_all(self) -> None:
        for pack in self.maps:
            pack.evict()
        self.lru.clear()

    def used(self, indices: np.ndarray) -> None:
        if self.budget is None:
            return
        first = self.offsets[indices] // self.chunk
        last = (self.offsets[indices + 1] - 1) // self.chunk
        for lo, hi in zip(first.tolist(), last.tolist(), strict=True):
            for c in range(lo, hi + 1):
                self.lru[c] = None
                self.lru.move_to_end(c)
        old = []
        while len(self.lru) > self.budget // self.chunk:
            old.append(self.lru.popitem(last=False)[0])
        if old:
            starts = np.asarray(old, dtype=np.int64) * self.chunk
            self.pack.evict(starts, starts + self.chunk)
            self.evictions += len(old)


def _epoch(loader: DataLoader, cache: _Cache) -> dict:
    cache.evict_all()
    r0, t0 = _read_bytes(), time.perf_counter()
    images = 0
    for batch in loader:
        cache.used(batch.indices.numpy())
        images += len(batch.indices)
    seconds = time.perf_counter() - t0
    return {"images": images, "seconds": seconds, "img_s": images / seconds, "read_bytes": _read_bytes() - r0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=os.path.expanduser("~/.cache/fastload/synthetic-imagenet"))
    p.add_argument("--copies", type=int, default=4, help="the train split repeated this often in the pack")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--size", type=int, default=224, help="RandomResizedCrop size")
    p.add_argument("--block-bytes", type=int, default=4 * _MiB)
    p.add_argument("--window", type=int, default=8, help="blocks shuffled together")
    p.add_argument("--cache-fraction", type=float, default=0.25, help="the emulated page-cache budget")
    p.add_argument("--chunk", type=int, default=_MiB, help="eviction granularity of the budget emulation")
    p.add_argument("--modes", default="cold,budget")
    p.add_argument("--orders", default="uniform,blockwise")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()

    index = scan_folder(Path(args.data) / "train")
    index = index.subset(np.tile(np.arange(len(index)), args.copies))
    transform = T.Compose([T.RandomResizedCrop(args.size), T.RandomHorizontalFlip()])
    modes, orders = args.modes.split(","), args.orders.split(",")
    results: dict[str, list[dict]] = collections.defaultdict(list)
    with tempfile.TemporaryDirectory(prefix="fastload-beyond-ram-") as tmp:
        path = os.path.join(tmp, "train.fastpack")
        summary = write_pack(index, path)
        size = summary.file_bytes
        print(
            f"pack: {summary.num_samples} samples, {size / 1e6:.0f} MB (class order); blocks of "
            f"{args.block_bytes / _MiB:g} MiB, windows of {args.window} blocks "
            f"({args.window * args.block_bytes / 1e6:.0f} MB); budget mode keeps "
            f"{args.cache_fraction:.0%} of it cached ({args.cache_fraction * size / 1e6:.0f} MB)"
        )
        datasets = {
            order: InMemoryImageFolder.from_pack(
                path,
                transform=transform,
                in_memory=False,
                shuffle_order=order,
                shuffle_block_bytes=args.block_bytes,
                shuffle_window=args.window,
            )
            for order in orders
        }
        loaders = {
            order: DataLoader(
                ds,
                batch_size=args.batch_size,
                shuffle=True,
                seed=0,
                num_workers=args.workers,
                worker_type="thread",
                epoch_lookahead=False,  # every epoch starts cold: nothing decoded ahead
            )
            for order, ds in datasets.items()
        }
        for rep in range(args.repeat):
            for mode in modes:
                for order in orders:
                    budget = int(args.cache_fraction * size) if mode == "budget" else None
                    cache = _Cache(datasets[order], list(datasets.values()), args.chunk, budget)
                    rec = _epoch(loaders[order], cache)
                    rec["evicted_chunks"] = cache.evictions
                    results[f"{mode} {order}"].append(rec)
                    print(
                        f"  run {rep + 1} {mode:<6} {order:<9} {rec['img_s']:7.0f} img/s, "
                        f"read {rec['read_bytes'] / 1e6:7.0f} MB ({rec['read_bytes'] / size:.2f}x the pack)"
                    )
        for lo in loaders.values():
            lo.close()
        for ds in datasets.values():
            ds.close()
    print(
        f"\n{'mode':<7} {'order':<10} {'img/s':>7} {'read MB':>8} {'x pack':>7}   (medians of {args.repeat})"
    )
    medians: dict[str, dict] = {}
    for key, recs in results.items():
        med = {k: statistics.median(r[k] for r in recs) for k in ("img_s", "read_bytes")}
        medians[key] = med
        mode, order = key.split()
        mb, ratio = med["read_bytes"] / 1e6, med["read_bytes"] / size
        print(f"{mode:<7} {order:<10} {med['img_s']:>7.0f} {mb:>8.0f} {ratio:>7.2f}")
    if "uniform" in orders and "blockwise" in orders:
        for mode in modes:
            u, b = medians[f"{mode} uniform"], medians[f"{mode} blockwise"]
            print(
                f"{mode}: blockwise / uniform: {b['img_s'] / u['img_s']:.2f}x img/s, "
                f"{b['read_bytes'] / max(1, u['read_bytes']):.2f}x bytes read"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"args": vars(args), "pack_bytes": size, "runs": results, "medians": medians}, f, indent=1
            )


if __name__ == "__main__":
    main()
