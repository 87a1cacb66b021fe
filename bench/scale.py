"""ImageNet scale on every path: worker memory, time to the first batch (fork and spawn), the scan.

Usage::

    python bench/scale.py [--files 1281167] [--batches 400] [--workers 2] [--batch-size 256]
                          [--size 224] [--recognised] [--no-spawn] [--pipelines torch,swap]
                          [--tree-parent DIR] [--json PATH]

1. A tree shaped like ImageNet train (``--files`` JPEGs over 1,000 class folders, all hard links to
   a few small real JPEGs: :func:`fastload.synthetic.make_linked_tree`) is built in a temporary
   folder (timed) and deleted at the end.
2. Four pipelines (or those ``--pipelines`` names), each in a fresh process, with ``--workers``
   process workers (fork), batches of ``--batch-size``, shuffled, for ``--batches`` batches:

   =========  ===========================================================================
   torch      ``torch.utils.data.DataLoader`` + torchvision ``ImageFolder`` + torchvision transforms
   fastload   ``fastload.DataLoader`` + ``fastload.ImageFolder`` + fastload transforms (fast path)
   fl+tv      ``fastload.DataLoader`` + ``fastload.ImageFolder`` + torchvision transforms
   swap       ``fastload.DataLoader`` + torchvision ``ImageFolder`` + torchvision transforms
              (only the DataLoader class swapped)
   =========  ===========================================================================

   The torchvision transforms are ``RandomResizedCrop(size)``, ``RandomHorizontalFlip()``,
   ``PILToTensor()`` and a ``Lambda`` that returns its input: an op fastload does not reproduce, so
   ``fl+tv`` and ``swap`` run torch's iterator (``--recognised`` leaves the ``Lambda`` out: they
   then run fastload's fast path). fastload's transforms are the same crop and flip.

   The consumer reads every batch as a training step does (a copy into a buffer of its own, as a
   copy to the GPU): what a worker writes into memory the consumer has read (fastload's batch
   slots, and on torch's path the reused batch segments) is then shared, not the worker's own.

   Reported per pipeline, after the first batch, after batch 100 and after the last one: each
   worker's private memory (``Private_Dirty`` of ``/proc/<pid>/smaps_rollup``: the pages it
   has written, copies of the parent's included) and its PSS, and the main process's RSS; the
   time from ``iter()`` to the first batch; and the scan (building the dataset object: wall
   time and the peak RSS growth while it runs, ``VmHWM`` after resetting it). Then, with the
   loop stopped and the workers done with the batches they were given (their CPU time stops
   growing, plus 2 s), each worker's private memory again ("idle": what a worker keeps, against
   what it uses while it builds a batch).
3. With spawn, then with forkserver (unless ``--no-spawn``): each pipeline again in a fresh
   process, time from ``iter()`` to the first batch (what each worker is sent is pickled and
   unpickled in it; a forkserver starts with the first worker, and fastload has it import the
   libraries the workers need first), in parentheses how long ``iter()`` itself took (starting
   the workers), then the time to the first batch of a second loader like it, started after
   that (e.g. a validation loader; with forkserver its workers fork from the running server).

The default run takes about 15 minutes on 2 shared cores; ``--files 20000 --batches 20`` about
two. Prints a table and writes ``--json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

PIPELINES = ("torch", "fastload", "fl+tv", "swap")
START_METHODS = ("spawn", "forkserver")  # the start-up runs (fork: the main runs)
CHECKPOINT = 100  # the middle snapshot: growth after it is growth that does not level off


def _unchanged(image: Any) -> Any:
    """The Lambda of the torchvision pipeline (module level, so spawned workers can unpickle it)."""
    return image


# ---------------------------------------------------------------------------- one pipeline (child)


def _rollup(pid: int) -> dict[str, int]:
    """``Private_Dirty`` and ``Pss`` of a process, in bytes."""
    found: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("Private_Dirty", "Pss"):
                found[key] = int(line.split()[1]) * 1024
    return found


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {key} in /proc/self/status")


def _snapshot() -> dict[str, Any]:
    import psutil

    me = psutil.Process()
    workers = []
    for child in me.children():
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
            mem = _rollup(child.pid)
        except (OSError, psutil.Error):  # exited in between
            continue
        workers.append(
            {"pid": child.pid, "private_mb": mem["Private_Dirty"] / 2**20, "pss_mb": mem["Pss"] / 2**20}
        )
    return {"workers": workers, "main_rss_mb": me.memory_info().rss / 2**20}


def _torchvision_transform(size: int, recognised: bool) -> Any:
    from torchvision import transforms as tv

    ops = [tv.RandomResizedCrop(size), tv.RandomHorizontalFlip(), tv.PILToTensor()]
    if not recognised:
        ops.append(tv.Lambda(_unchanged))
    return tv.Compose(ops)


def _dataset(pipeline: str, split: str, size: int, recognised: bool) -> Any:
    if pipeline in ("torch", "swap"):
        import torchvision

        return torchvision.datasets.ImageFolder(split, transform=_torchvision_transform(size, recognised))
    import fastload
    from fastload import transforms as T

    if pipeline == "fastload":
        transform: Any = T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip()])
    else:
        transform = _torchvision_transform(size, recognised)
    return fastload.ImageFolder(split, transform=transform)


def _endless(loader: Any, first_pass: Any) -> Any:
    yield from first_pass
    while True:
        yield from loader


def _idle_snapshot() -> dict[str, Any]:
    """A snapshot once the workers are idle: their CPU time stopped growing (they finished the
    batches they had been given), plus 2 s (what fastload's idle trim needs to notice)."""
    import psutil

    children = psutil.Process().children()
    last = -1.0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.5)
        try:
            now = sum(sum(c.cpu_times()[:2]) for c in children)
        except psutil.Error:
            break
        if now - last < 0.01:
            break
        last = now
    time.sleep(2.0)
    return _snapshot()


def run_pipeline(
    pipeline: str,
    method: str,
    split: str,
    batches: int,
    workers: int,
    batch_size: int,
    size: int,
    recognised: bool,
) -> dict[str, Any]:
    """One pipeline in this (fresh) process: the scan, the first batch, memory at the checkpoints."""
    import torch
    import torchvision  # noqa: F401 - every import before the scan is timed

    if pipeline != "torch":
        import fastload.transforms  # noqa: F401

    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM (the peak RSS) to the current RSS
    rss0 = _status_kib("VmRSS")
    t0 = time.perf_counter()
    dataset = _dataset(pipeline, split, size, recognised)
    scan = {"wall_s": time.perf_counter() - t0, "peak_mb": (_status_kib("VmHWM") - rss0) / 1024}
    kwargs: dict[str, Any] = {
        "batch_size": batch_size,
        "shuffle": True,
        "num_workers": workers,
        "multiprocessing_context": method,
    }

    def make_loader() -> Any:
        if pipeline == "torch":
            return torch.utils.data.DataLoader(dataset, **kwargs)
        import fastload

        return fastload.DataLoader(dataset, **kwargs)

    loader = make_loader()
    path = "fast" if getattr(loader, "fast_path", False) else "torch"
    t0 = time.perf_counter()
    first_pass = iter(loader)  # starts the workers
    started = time.perf_counter() - t0
    it = _endless(loader, first_pass)
    batch = next(it)
    first = time.perf_counter() - t0
    if len(batch[0]) != min(batch_size, len(dataset)):
        raise RuntimeError(f"{pipeline}: the first batch has {len(batch[0])} images")
    record: dict[str, Any] = {
        "pipeline": pipeline,
        "method": method,
        "path": path,
        "samples": len(dataset),
        "scan": scan,
        "start_s": started,
        "first_batch_s": first,
        "snapshots": {},
    }
    if method != "fork":  # a second loader, started while the first one's workers still run
        second = make_loader()
        t1 = time.perf_counter()
        next(iter(second))
        record["second_first_batch_s"] = time.perf_counter() - t1
        getattr(second, "close", lambda: None)()
        del second
    checkpoints = sorted({1, min(CHECKPOINT, batches), batches})
    sink = torch.empty_like(batch[0])
    for k in range(1, batches + 1):
        if k > 1:
            del batch  # nothing keeps a batch while the next one is loaded
            batch = next(it)
        sink[: len(batch[0])].copy_(batch[0])  # the consumer reads it, as a copy to the GPU does
        if k in checkpoints:
            record["snapshots"][str(k)] = _snapshot()
    del batch
    if batches > 1:
        record["idle"] = _idle_snapshot()
    return record


# ---------------------------------------------------------------------------- the run (parent)


def _run_child(
    args: argparse.Namespace, pipeline: str, method: str, split: str, batches: int
) -> dict[str, Any]:
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--_child",
        pipeline,
        method,
        split,
        "--batches",
        str(batches),
        "--workers",
        str(args.workers),
        "--batch-size",
        str(args.batch_size),
        "--size",
        str(args.size),
    ]
    if args.recognised:
        command.append("--recognised")
    out = subprocess.run(command, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{pipeline} ({method}) failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _worker_mb(record: dict[str, Any], k: str, key: str) -> float:
    """The largest value of ``key`` over the workers at snapshot ``k``."""
    return max((w[key] for w in record["snapshots"][k]["workers"]), default=float("nan"))


def _idle_mb(record: dict[str, Any]) -> float:
    """The largest private memory of a worker once the workers were idle (nan: not measured)."""
    workers = record.get("idle", {}).get("workers", [])
    return max((w["private_mb"] for w in workers), default=float("nan"))


def _print_table(result: dict[str, Any]) -> None:
    runs = result["fork"]
    starts = {method: result[method] for method in START_METHODS if method in result}
    ks = list(next(iter(runs.values()))["snapshots"])
    ks_label = " -> ".join(ks)
    print(
        f"\n{result['files']} files, {result['workers']} workers, batch {result['batch_size']}, "
        f"size {result['size']}; per worker the largest of the workers, after batches {ks_label}; "
        "idle: once the workers finished their batches"
    )
    head = (
        f"{'pipeline':<9} {'path':<6} {'private MB':>22} {'idle MB':>8} {'PSS MB':>22} {'main RSS':>9} "
        f"{'1st fork':>9}"
    )
    print(head + "".join(f" {method + ': 1st (start) 2nd':>27}" for method in starts))
    for name, rec in runs.items():
        private = " -> ".join(f"{_worker_mb(rec, k, 'private_mb'):.0f}" for k in ks)
        pss = " -> ".join(f"{_worker_mb(rec, k, 'pss_mb'):.0f}" for k in ks)
        idle = _idle_mb(rec)
        line = (
            f"{name:<9} {rec['path']:<6} {private:>22} {idle:>8.0f} {pss:>22} "
            f"{rec['snapshots'][ks[-1]]['main_rss_mb']:>9.0f} {rec['first_batch_s']:>8.2f}s"
        )
        for method_runs in starts.values():
            run = method_runs[name]
            second = run["second_first_batch_s"]
            line += f" {run['first_batch_s']:>6.2f}s ({run['start_s']:.2f}s) {second:.2f}s"
        print(line)
    for lib, scan in result["scan"].items():
        print(
            f"scan {lib:<12} wall {scan['wall_s']:.2f} s, peak +{scan['peak_mb']:.0f} MB "
            f"(median of {scan['runs']})"
        )


def _scan_summary(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    by_lib: dict[str, list[dict[str, float]]] = {}
    for rec in records:
        lib = "torchvision" if rec["pipeline"] in ("torch", "swap") else "fastload"
        by_lib.setdefault(lib, []).append(rec["scan"])
    return {
        lib: {
            "wall_s": statistics.median(s["wall_s"] for s in scans),
            "peak_mb": statistics.median(s["peak_mb"] for s in scans),
            "runs": len(scans),
        }
        for lib, scans in by_lib.items()
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from fastload.synthetic import make_linked_tree

    tmp = tempfile.mkdtemp(prefix="fastload-scale-", dir=args.tree_parent)
    try:
        t0 = time.perf_counter()
        split = str(make_linked_tree(tmp, num_files=args.files, classes=min(1000, max(1, args.files))))
        build = time.perf_counter() - t0
        print(f"tree of {args.files} files (hard links to real JPEGs) built in {build:.1f} s", flush=True)
        fork: dict[str, Any] = {}
        for name in args.pipelines:
            fork[name] = _run_child(args, name, "fork", split, args.batches)
            print(f"  {name}: fork run done", flush=True)
        starts: dict[str, dict[str, Any]] = {}
        if not args.no_spawn:
            for method in START_METHODS:
                starts[method] = {}
                for name in args.pipelines:
                    starts[method][name] = _run_child(args, name, method, split, 1)
                    print(f"  {name}: {method} run done", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result: dict[str, Any] = {
        "files": args.files,
        "tree_build_s": build,
        "workers": args.workers,
        "batch_size": args.batch_size,
        "batches": args.batches,
        "size": args.size,
        "recognised": args.recognised,
        "fork": fork,
        "scan": _scan_summary([*fork.values(), *(r for runs in starts.values() for r in runs.values())]),
    }
    result.update(starts)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--files", type=int, default=None, help="files in the tree (default: ImageNet's 1,281,167)"
    )
    p.add_argument("--batches", type=int, default=400, help="batches per pipeline (fork runs)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--size", type=int, default=224, help="output size of the crop")
    p.add_argument("--recognised", action="store_true", help="torchvision pipeline without the Lambda")
    p.add_argument("--no-spawn", action="store_true", help="skip the spawn and forkserver start-up runs")
    p.add_argument(
        "--pipelines",
        default=",".join(PIPELINES),
        help=f"comma-separated, of {', '.join(PIPELINES)} (default: all)",
    )
    p.add_argument("--tree-parent", default=None, help="folder to build the tree in (default: the temp dir)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--_child", nargs=3, metavar=("PIPELINE", "METHOD", "SPLIT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._child:
        pipeline, method, split = args._child
        record = run_pipeline(
            pipeline, method, split, args.batches, args.workers, args.batch_size, args.size, args.recognised
        )
        print(json.dumps(record))
        return
    args.pipelines = [name.strip() for name in args.pipelines.split(",") if name.strip()]
    unknown = sorted(set(args.pipelines) - set(PIPELINES))
    if unknown or not args.pipelines:
        p.error(f"--pipelines: {', '.join(unknown) or 'none given'}; choose from {', '.join(PIPELINES)}")
    if args.files is None:
        from fastload.synthetic import IMAGENET_TRAIN_FILES

        args.files = IMAGENET_TRAIN_FILES
    if args.batches < 1 or args.files < args.batch_size:
        p.error("--batches must be >= 1 and --files at least --batch-size")
    result = run(args)
    _print_table(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
