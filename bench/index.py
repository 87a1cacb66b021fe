"""Save/load/pickle time of a FolderIndex with ImageNet's 1,281,167 training entries.

Usage: ``python bench/index.py [--samples N] [--json PATH]``. No files are scanned: the index is
built from generated ImageNet-style relative paths, so the script measures the index itself.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import tempfile
import time

import numpy as np

from fastload import ClassIndex, FolderIndex


def _median_seconds(fn, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--samples", type=int, default=1_281_167)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    classes = ClassIndex([f"n{i:08d}" for i in range(1000)])
    rel = [f"{classes[i % 1000]}/{classes[i % 1000]}_{i}.JPEG" for i in range(args.samples)]
    index = FolderIndex("/data/imagenet/train", rel, np.arange(args.samples) % 1000, classes)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "train.idx.npz")
        save = _median_seconds(lambda: index.save(path), 3)
        load = _median_seconds(lambda: FolderIndex.load(path))
        size = os.path.getsize(path)
    blob = pickle.dumps(index)
    pick = _median_seconds(lambda: pickle.loads(pickle.dumps(index)))
    record = {
        "samples": args.samples,
        "save_s": save,
        "load_s": load,
        "file_bytes": size,
        "pickle_bytes": len(blob),
        "pickle_roundtrip_s": pick,
    }
    print(
        f"{args.samples} entries: save {save:.3f} s, load {load:.3f} s ({size / 2**20:.0f} MiB), pickle "
        f"round trip {pick:.3f} s ({len(blob) / 2**20:.0f} MiB)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
