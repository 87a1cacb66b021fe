"""RAM used by an in-memory dataset with DataLoader workers, and worker start-up time under spawn.

Usage::

    python bench/memory.py [--data-mb 600] [--workers 4] [--start-methods fork,forkserver]
                           [--startup-gb 1] [--cache DIR] [--json PATH] [--decode]

1. Memory. For each start method, one full epoch of a ``torch.utils.data.DataLoader`` with
   ``--workers`` workers over the same images held in RAM three ways:

   * ``list of bytes``: the naive dataset, a Python list of ``bytes`` (one object per file);
   * ``InMemoryImageFolder``: fastload's shared segment;
   * ``from_pack(in_memory=False)``: fastload serving a pack file from its memory map;

   plus an "empty" run (the same loader over 8 samples) for the fixed cost of the processes. The
   number reported is the total proportional set size (PSS: shared pages split between the processes
   that map them, so the sum over processes counts each physical page once) of the main process and
   all its descendants (workers, forkserver, resource tracker), read with
   ``psutil.Process.memory_full_info().pss`` after the epoch while the (persistent) workers are alive,
   and its peak sampled every 0.2 s during the epoch. The target: fastload's total stays within
   1.15x of (data bytes + the empty run's total, i.e. 5 x the mean PSS of an empty run's main
   process and 4 workers, plus its helper processes), while the list of bytes grows with the workers.

   The same total without shared-library code ("w/o libs", from ``/proc/<pid>/smaps``) is printed
   next to it, and the target is checked on it: a library page's PSS share depends on how many
   processes *of the whole machine* map it (torch's libraries are about 1 GB), so on a shared machine
   the plain total moves by a few hundred MB from run to run while the data's share does not.

   Each sample is read in full (CRC-32 of its bytes), which touches every page of the data as decoding
   would; ``--decode`` decodes it too (slower, same memory picture).

2. Start-up. Time from ``iter(loader)`` to the first batch with ``--workers`` spawn workers, for
   the list of bytes and ``InMemoryImageFolder`` of ``--startup-gb`` GB and the empty dataset, and the
   part of it that depends on the data: pickling the dataset in the parent and unpickling it in the
   worker (paid once per worker). The list's grows with the data; fastload's handle does not.

Data: a synthetic ImageNet-like tree (``fastload.synthetic``, 400 real JPEGs) generated once into the
cache folder, replicated by hard links under new names up to the requested size (so a 2 GB tree costs
no disk space and takes a second to make; the dataset still holds one copy per file name). The pack
of the memory runs is a real file (``--data-mb`` of disk in the cache folder).

Every measurement runs in a fresh interpreter, so no run inherits another's memory. For the same
reason the imports of fastload, torch and psutil stay inside the functions that need them: a
measured interpreter loads only what its variant uses (the list-of-bytes run never imports
``fastload.memory``), so the PSS it reports is that variant's own. The default run
takes about 3 minutes on 2 idle cores (most of it spawned workers importing torch); ``--start-methods
fork --startup-gb 0`` takes under a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import Any

from fastload.folder import FolderIndex, scan_folder

_SEED_CLASSES, _SEED_PER_CLASS = 10, 40


# ----------------------------------------------------------------------------------------- the data


def _seed_tree(cache: Path) -> Path:
    from fastload.synthetic import make_imagenet_like

    root = cache / "seed"
    if not (root / ".complete").exists():
        make_imagenet_like(root, classes=_SEED_CLASSES, per_class=_SEED_PER_CLASS, val_per_class=0, seed=0)
        (root / ".complete").touch()
    return root / "train"


def _tree(cache: Path, megabytes: float) -> Path:
    """A class tree of at least ``megabytes`` MB: the seed files hard-linked under new names."""
    seed = _seed_tree(cache)
    out = cache / f"tree-{megabytes:g}MB"
    if (out / ".complete").exists():
        return out
    files = [p for p in sorted(seed.rglob("*.JPEG"))]
    sizes = [p.stat().st_size for p in files]
    total, copy = 0, 0
    while total < megabytes * 1e6:
        for p, size in zip(files, sizes, strict=False):
            dst = out / p.parent.name / f"{p.stem}_r{copy}{p.suffix}"
            dst.parent.mkdir(parents=True, exist_ok=True)
            if not dst.exists():
                try:
                    os.link(p, dst)
                except OSError:
                    dst.write_bytes(p.read_bytes())
            total += size
            if total >= megabytes * 1e6:
                break
        copy += 1
    (out / ".complete").touch()
    return out


def _pack(cache: Path, tree: Path) -> Path:
    from fastload.pack import write_pack

    out = cache / f"{tree.name}.fastpack"
    if not out.exists():
        write_pack(scan_folder(tree), out)
    return out


# ------------------------------------------------------------------------------ the datasets measured


def _work(data: Any, decode: bool) -> int:
    """What a worker does with a sample: read all of it (and decode it, with --decode)."""
    crc = zlib.crc32(data)
    if decode:
        from fastload.decode import decode_pil

        decode_pil(data).reduce(8)
    return crc


class Touch:
    """A fastload-style transform: gets the encoded bytes (fused-decoding protocol), returns a CRC."""

    def __init__(self, decode: bool) -> None:
        self.decode = decode

    def decode_and_apply(self, data: memoryview, name: str) -> int:
        return _work(data, self.decode)

    def __call__(self, image: Any) -> Any:  # not used: decode_and_apply is
        return image


class ListOfBytes:
    """The naive in-memory dataset: one ``bytes`` object per file in a Python list."""

    def __init__(self, index: FolderIndex, decode: bool) -> None:
        self.data = []
        for path in index.paths:
            with open(path, "rb") as f:
                self.data.append(f.read())
        self.targets = [int(t) for t in index.targets]
        self.decode = decode

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[int, int]:
        return _work(self.data[i], self.decode), self.targets[i]


def _dataset(variant: str, tree: Path, pack: Path, decode: bool) -> Any:
    from fastload.memory import InMemoryImageFolder

    index = scan_folder(tree)
    if variant == "empty":
        return InMemoryImageFolder(index.subset(range(8)), transform=Touch(decode))
    if variant == "list":
        return ListOfBytes(index, decode)
    if variant == "ram":
        return InMemoryImageFolder(index, transform=Touch(decode))
    if variant == "map":
        return InMemoryImageFolder.from_pack(pack, in_memory=False, transform=Touch(decode))
    raise ValueError(f"unknown variant {variant!r}")


# --------------------------------------------------------------------------------- child processes


_LIB = re.compile(r"\.so(\.[0-9.]+)?$|/python[0-9.]*$")


def _smaps_pss(pid: int) -> tuple[int, int]:
    """(PSS, PSS of shared-library code) of one process, in bytes, from /proc/<pid>/smaps.

    The share of a library page depends on how many processes *on the whole machine* map it (every
    Python process that imports torch maps the same 1 GB of libraries), so the total PSS of one
    program moves when other programs start or stop. Without the libraries it does not.
    """
    total = lib = 0
    in_lib = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            first = line.split(None, 1)[0]
            if not first.endswith(":"):
                parts = line.split(None, 5)
                in_lib = len(parts) > 5 and bool(_LIB.search(parts[5].strip()))
            elif first == "Pss:":
                kb = int(line.split()[1]) * 1024
                total += kb
                if in_lib:
                    lib += kb
    return total, lib


def _tree_pss(detail: bool = False) -> tuple[int, int, dict[str, int]]:
    """(total PSS, PSS without shared-library code, per-process PSS) of this process and its descendants."""
    import psutil

    me = psutil.Process()
    procs = [me, *me.children(recursive=True)]
    total = no_lib = 0
    parts = {}
    for p in procs:
        try:
            if detail:
                pss, lib = _smaps_pss(p.pid)
            else:
                pss, lib = p.memory_full_info().pss, 0
            name = "main" if p is me else " ".join(p.cmdline()[1:3])[:60]
        except (psutil.NoSuchProcess, psutil.AccessDenied, FileNotFoundError, ProcessLookupError):
            continue
        total += pss
        no_lib += pss - lib
        parts[f"{p.pid} {name}"] = pss
    return total, no_lib, parts


def _measure_memory(args: argparse.Namespace) -> dict[str, Any]:
    import torch  # noqa: F401 - imported before the dataset, as in a training script
    from torch.utils.data import DataLoader

    ds = _dataset(args.variant, Path(args.tree), Path(args.pack), args.decode)
    data_bytes = ds.nbytes if hasattr(ds, "nbytes") else sum(len(b) for b in ds.data)
    loader = DataLoader(
        ds,
        batch_size=64,
        shuffle=True,
        num_workers=args.workers,
        multiprocessing_context=args.start_method,
        persistent_workers=True,
    )
    peak = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _tree_pss()[0])
            stop.wait(0.2)

    t0 = time.perf_counter()
    it = iter(loader)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    n = 0
    for images, _ in it:
        n += len(images)
    epoch_s = time.perf_counter() - t0
    stop.set()
    sampler.join()
    total, no_lib, parts = _tree_pss(detail=True)
    del it, loader
    return {
        "variant": args.variant,
        "start_method": args.start_method,
        "workers": args.workers,
        "samples": n,
        "data_bytes": int(data_bytes),
        "total_pss": total,
        "total_pss_without_libs": no_lib,
        "peak_pss": max(peak[0], total),
        "processes": parts,
        "epoch_s": epoch_s,
    }


def _measure_startup(args: argparse.Namespace) -> dict[str, Any]:
    import torch  # noqa: F401
    from torch.utils.data import DataLoader

    ds = _dataset(args.variant, Path(args.tree), Path(args.pack), False)
    data_bytes = ds.nbytes if hasattr(ds, "nbytes") else sum(len(b) for b in ds.data)
    # What sending the dataset to one worker costs: pickling in the parent, unpickling in the child.
    t0 = time.perf_counter()
    blob = pickle.dumps(ds, protocol=pickle.HIGHEST_PROTOCOL)
    t1 = time.perf_counter()
    copy = pickle.loads(blob)
    t2 = time.perf_counter()
    del copy
    loader = DataLoader(ds, batch_size=8, num_workers=args.workers, multiprocessing_context="spawn")
    t0_loader = time.perf_counter()
    it = iter(loader)
    next(it)
    first_batch_s = time.perf_counter() - t0_loader
    del it
    return {
        "variant": args.variant,
        "data_bytes": int(data_bytes),
        "pickle_bytes": len(blob),
        "pickle_s": t1 - t0,
        "unpickle_s": t2 - t1,
        "first_batch_s": first_batch_s,
    }


def _child(
    mode: str, variant: str, tree: Path, pack: Path, args: argparse.Namespace, start_method: str = "spawn"
) -> dict[str, Any]:
    cmd = [
        sys.executable, os.path.abspath(__file__), f"--_{mode}", variant,
        "--tree", str(tree), "--pack", str(pack),
        "--workers", str(args.workers), "--start-method", start_method,
    ] + (["--decode"] if args.decode else [])  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------- main

_NAMES = {
    "empty": "empty (8 samples)",
    "list": "list of bytes",
    "ram": "InMemoryImageFolder",
    "map": "from_pack(in_memory=False)",
}


def _mb(n: float) -> str:
    return f"{n / 1e6:,.0f} MB"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--data-mb", type=float, default=600, help="size of the dataset for the memory runs (default: 600)"
    )
    p.add_argument("--workers", type=int, default=4)
    p.add_argument(
        "--start-methods", default="fork,forkserver", help="comma-separated (default: fork,forkserver)"
    )
    p.add_argument(
        "--startup-gb",
        type=float,
        default=1.0,
        help="dataset size for the spawn start-up runs (default: 1; 0 skips them)",
    )
    p.add_argument(
        "--cache",
        default=os.path.join(
            os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "fastload", "bench-memory"
        ),
    )
    p.add_argument("--decode", action="store_true", help="decode every image too (slower)")
    p.add_argument("--json", metavar="PATH")
    for hidden in ("--_memory", "--_startup"):
        p.add_argument(hidden, metavar="VARIANT", help=argparse.SUPPRESS)
    p.add_argument("--tree", help=argparse.SUPPRESS)
    p.add_argument("--pack", help=argparse.SUPPRESS)
    p.add_argument("--start-method", default="spawn", help=argparse.SUPPRESS)
    args = p.parse_args()

    if args._memory or args._startup:  # a measurement in a fresh interpreter
        args.variant = args._memory or args._startup
        record = _measure_memory(args) if args._memory else _measure_startup(args)
        print(json.dumps(record))
        return

    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    tree = _tree(cache, args.data_mb)
    pack = _pack(cache, tree)
    from fastload.pack import open_pack

    t0 = time.perf_counter()
    with open_pack(pack) as pk:
        open_s = time.perf_counter() - t0
        n_files = len(pk)
    results: dict[str, Any] = {
        "data_mb": args.data_mb,
        "workers": args.workers,
        "files": n_files,
        "pack_open_s": open_s,
        "memory": [],
        "startup": [],
    }

    print(f"Memory: one epoch, {args.workers} workers, {n_files} files (pack opens in {open_s * 1e3:.1f} ms)")
    header = (
        f"{'start method':<12} {'dataset':<27} {'data':>9} {'total PSS':>10} {'peak PSS':>10} {'ratio':>6}"
        f"  {'w/o libs':>10} {'ratio':>6}  target (w/o libs)"
    )
    print(header)
    print("-" * len(header))
    for method in [m.strip() for m in args.start_methods.split(",") if m.strip()]:
        rows = {v: _child("memory", v, tree, pack, args, method) for v in ("empty", "list", "ram", "map")}
        empty, empty_no_lib = rows["empty"]["total_pss"], rows["empty"]["total_pss_without_libs"]
        for v, r in rows.items():
            r["ratio"] = r["total_pss"] / (r["data_bytes"] + empty)
            r["ratio_without_libs"] = r["total_pss_without_libs"] / (r["data_bytes"] + empty_no_lib)
            target = (
                ""
                if v in ("empty", "list")
                else ("<= 1.15 ok" if r["ratio_without_libs"] <= 1.15 else "<= 1.15 MISSED")
            )
            ratio, ratio2 = (
                ("", "") if v == "empty" else (f"{r['ratio']:.2f}", f"{r['ratio_without_libs']:.2f}")
            )
            print(
                f"{method:<12} {_NAMES[v]:<27} {_mb(r['data_bytes']):>9} {_mb(r['total_pss']):>10} "
                f"{_mb(r['peak_pss']):>10} {ratio:>6}"
                f"  {_mb(r['total_pss_without_libs']):>10} {ratio2:>6}  {target}"
            )
            results["memory"].append(r)
        procs = rows["empty"]["processes"]
        main_pss = next(v for k, v in procs.items() if k.endswith(" main"))
        print(
            f"{'':<12} (empty run: main {_mb(main_pss)}, {len(procs) - 1} other processes "
            f"{_mb(sum(procs.values()) - main_pss)})"
        )
    print(
        "ratio = total / (data + the empty run's total); 'w/o libs' leaves out shared-library code, whose "
        "PSS share"
    )
    print("depends on the other processes of the machine that map the same libraries (torch's are ~1 GB).")

    if args.startup_gb > 0:
        print(f"\nStart-up: iter(loader) to first batch, {args.workers} spawn workers")
        header = f"{'dataset':<22} {'data':>9} {'pickled':>10} {'pickle+unpickle':>16} {'first batch':>12}"
        print(header)
        print("-" * len(header))
        big = _tree(cache, args.startup_gb * 1000)
        for v in ("empty", "list", "ram"):
            r = _child("startup", v, big, pack, args)
            r["startup_gb"] = args.startup_gb
            pickled = f"{r['pickle_bytes']} B" if r["pickle_bytes"] < 1e6 else _mb(r["pickle_bytes"])
            data = "" if v == "empty" else _mb(r["data_bytes"])
            transfer = f"{(r['pickle_s'] + r['unpickle_s']) * 1e3:.2f} ms"
            print(f"{_NAMES[v]:<22} {data:>9} {pickled:>10} {transfer:>16} {r['first_batch_s']:>10.2f} s")
            results["startup"].append(r)
        print(
            f"{'':<22} (pickle+unpickle: the cost of sending the dataset to one worker; it is paid once per "
            "worker)"
        )
    print(f"\n(total {time.perf_counter() - t_start:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
