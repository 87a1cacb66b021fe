"""The index at ImageNet scale: save/load/pickle of 1,281,167 entries, and a real 1.28M-file scan.

Usage: ``python bench/index.py [--samples N] [--scan-files N] [--repeat R] [--drop-caches] [--json PATH]``.

1. Index: a :class:`~fastload.FolderIndex` built from generated ImageNet-style relative paths
   (no files), to time ``save``/``load``/pickling of the index itself.
2. Scan: a tree shaped like ImageNet train (``--scan-files`` files over 1,000 class folders, hard
   links to an empty file: :func:`fastload.synthetic.make_linked_tree`) is built in a temporary
   folder (``--tree-parent``), scanned by ``fastload.ImageFolder(root)`` and by torchvision's
   ``ImageFolder(root)``, each in a fresh process (alternating, ``--repeat`` times, medians), then
   deleted. Reported per scan: wall and CPU seconds, the peak RSS growth while scanning (``VmHWM``
   after resetting it through ``/proc/self/clear_refs``) and the RSS kept afterwards.
   "warm": the kernel's dentry/inode and directory-block caches hold the tree (as after building
   it). "cold" (only with ``--drop-caches``, root only): ``sync`` and ``echo 3 >
   /proc/sys/vm/drop_caches`` before each cold scan -- this empties the page cache of the whole
   machine, so it is off by default.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from fastload import ClassIndex, FolderIndex
from fastload.synthetic import IMAGENET_TRAIN_FILES, make_linked_tree


def _median_seconds(fn, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_index(samples: int) -> dict:
    classes = ClassIndex([f"n{i:08d}" for i in range(1000)])
    rel = [f"{classes[i % 1000]}/{classes[i % 1000]}_{i}.JPEG" for i in range(samples)]
    index = FolderIndex("/data/imagenet/train", rel, np.arange(samples) % 1000, classes)
    del rel
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "train.idx.npz")
        save = _median_seconds(lambda: index.save(path), 3)
        load = _median_seconds(lambda: FolderIndex.load(path))
        size = os.path.getsize(path)
    blob = pickle.dumps(index)
    pick = _median_seconds(lambda: pickle.loads(pickle.dumps(index)))
    print(
        f"index of {samples} entries: save {save:.3f} s, load {load:.3f} s ({size / 2**20:.0f} MiB), "
        f"pickle round trip {pick:.3f} s ({len(blob) / 2**20:.0f} MiB)"
    )
    return {
        "samples": samples,
        "save_s": save,
        "load_s": load,
        "file_bytes": size,
        "pickle_bytes": len(blob),
        "pickle_roundtrip_s": pick,
    }


# ------------------------------------------------------------------------------ one scan (child)


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {key} in /proc/self/status")


def _measure(which: str, root: str) -> None:
    """Runs in a fresh process: one scan, its time and memory, as JSON on stdout."""
    if which == "fastload":
        import fastload

        scan = fastload.ImageFolder
    else:
        import torchvision

        scan = torchvision.datasets.ImageFolder

    import gc

    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM (the peak RSS) to the current RSS
    rss0 = _status_kib("VmRSS")
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    dataset = scan(root)
    wall = time.perf_counter() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    peak, rss1 = _status_kib("VmHWM"), _status_kib("VmRSS")
    n = len(dataset)
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    record = {"files": n, "wall_s": wall, "cpu_s": cpu, "peak_mb": (peak - rss0) / 1024}
    record["kept_mb"] = (rss1 - rss0) / 1024  # the dataset object is still alive here
    print(json.dumps(record))


def _drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def _run(which: str, root: str, cold: bool) -> dict:
    if cold:
        _drop_caches()
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--_measure", which, root],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_scan(files: int, repeat: int, drop_caches: bool, parent: str | None) -> dict:
    tmp = tempfile.mkdtemp(prefix="fastload-scan-", dir=parent)
    try:
        t0 = time.perf_counter()
        split = str(make_linked_tree(tmp, num_files=files, classes=1000, empty=True))
        build = time.perf_counter() - t0
        print(f"tree of {files} files in 1,000 class folders (hard links) built in {build:.1f} s")
        runs: dict[str, list[dict]] = {}
        modes = (["cold"] if drop_caches else []) + ["warm"]
        for _ in range(repeat):
            for mode in modes:
                for which in ("fastload", "torchvision"):
                    rec = _run(which, split, cold=mode == "cold")
                    if rec["files"] != files:
                        raise RuntimeError(f"{which} found {rec['files']} files, expected {files}")
                    runs.setdefault(f"{which} {mode}", []).append(rec)
    finally:
        t0 = time.perf_counter()
        shutil.rmtree(tmp, ignore_errors=True)
        cleanup = time.perf_counter() - t0
    print(f"(tree deleted in {cleanup:.1f} s)")
    summary: dict[str, dict] = {}
    print(f"{'scan':<18} {'wall s':>7} {'cpu s':>7} {'peak MB':>8} {'kept MB':>8}   (median of {repeat})")
    for key, recs in runs.items():
        med = {k: statistics.median(r[k] for r in recs) for k in ("wall_s", "cpu_s", "peak_mb", "kept_mb")}
        summary[key] = {**med, "runs": recs}
        wall, cpu, peak, kept = med["wall_s"], med["cpu_s"], med["peak_mb"], med["kept_mb"]
        print(f"{key:<18} {wall:>7.2f} {cpu:>7.2f} {peak:>8.0f} {kept:>8.0f}")
    for mode in modes:
        fl, tv = summary[f"fastload {mode}"], summary[f"torchvision {mode}"]
        print(
            f"{mode}: fastload / torchvision wall {fl['wall_s'] / tv['wall_s']:.2f}x, "
            f"peak {fl['peak_mb'] / tv['peak_mb']:.2f}x"
        )
    return {"files": files, "build_s": build, "cleanup_s": cleanup, "repeat": repeat, "scans": summary}


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--_measure":
        _measure(sys.argv[2], sys.argv[3])
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=IMAGENET_TRAIN_FILES, help="entries of the generated index")
    p.add_argument("--scan-files", type=int, default=IMAGENET_TRAIN_FILES, help="files of the scanned tree")
    p.add_argument("--no-scan", action="store_true", help="only the index part")
    p.add_argument("--no-index", action="store_true", help="only the scan part")
    p.add_argument("--repeat", type=int, default=3, help="scans per pipeline and mode (medians)")
    p.add_argument(
        "--drop-caches",
        action="store_true",
        help="also measure cold scans (drops the whole machine's page cache before each; needs root)",
    )
    p.add_argument("--tree-parent", default=None, help="folder to build the tree in (default: the temp dir)")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    record: dict = {}
    if not args.no_index:
        record["index"] = bench_index(args.samples)
    if not args.no_scan:
        record["scan"] = bench_scan(args.scan_files, args.repeat, args.drop_caches, args.tree_parent)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
