"""Tar shards on an http(s) server, against a real one: the standard library's
``ThreadingHTTPServer`` serving a folder of shards on a loopback port. The same batches as from the
folder, each shard downloaded once into the node cache; a missing shard named; a folder URL refused;
the server stopped, then started again within ``retry_timeout``: the read goes on; a shard written
again since the dataset was made is not read."""

from __future__ import annotations

import collections
import functools
import http.server
import os
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _batches import collect, same

import fastload
from fastload import transforms as T
from fastload.__main__ import main
from fastload.s3shards import ObjectStoreError
from fastload.shards import TarShards

SHARD_SIZE = 1_200_000  # the 32 training images in 5 shards


class Web:
    """A ``ThreadingHTTPServer`` over ``folder`` on a loopback port, counting the GETs of each path;
    ``stop()`` then ``start()`` keeps the port."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.port = folder, 0
        self.gets: collections.Counter[str] = collections.Counter()
        self.server: http.server.ThreadingHTTPServer | None = None

    def start(self) -> None:
        web = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def do_GET(self) -> None:
                web.gets[self.path] += 1
                super().do_GET()

            def log_message(self, *args: Any) -> None:
                pass

        class Server(http.server.ThreadingHTTPServer):
            def handle_error(self, request: Any, client_address: Any) -> None:
                pass  # (a client that stopped reading: the connection reset)

        handler = functools.partial(Handler, directory=str(self.folder))
        self.server = Server(("127.0.0.1", self.port), handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        assert self.server is not None
        self.server.shutdown()
        self.server.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def shards(imagenet_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("shards")
    assert main(["shards", str(imagenet_root / "train"), str(out), "--shard-size", str(SHARD_SIZE)]) == 0
    return out


@pytest.fixture(scope="module")
def web(shards: Path) -> Iterator[Web]:
    server = Web(shards)
    server.start()
    yield server
    server.stop()


def _tf() -> T.Compose:
    return T.Compose([T.RandomResizedCrop(32), T.RandomHorizontalFlip()])


def _copies(cache: Path) -> list[Path]:
    return [p for p in cache.iterdir() if p.suffix not in (".idx", ".lock") and not p.name.startswith(".")]


def test_the_same_batches_as_the_shards_on_disk_each_downloaded_once(web, shards, tmp_path):
    classes = shards / "train-classes.json"
    local = TarShards(shards, classes=classes, transform=_tf())
    n = len(local.shards)
    pattern = f"{web.url}/train-{{000000..{n - 1:06d}}}.tar"
    remote = TarShards(pattern, classes=classes, transform=_tf(), cache_dir=tmp_path)
    assert remote.shards == [f"{web.url}/train-{k:06d}.tar" for k in range(n)]
    listed = TarShards(remote.shards, classes=f"{web.url}/train-classes.json", cache_dir=tmp_path)
    assert listed.shards == remote.shards and listed.classes == local.classes
    kwargs = dict(batch_size=8, shuffle=True, seed=3)
    want = collect(fastload.DataLoader(local, num_workers=0, **kwargs))
    for workers in (0, 2):
        assert same(want, collect(fastload.DataLoader(remote, num_workers=workers, **kwargs)))
    assert len(_copies(tmp_path)) == n
    assert [web.gets[f"/train-{k:06d}.tar"] for k in range(n)] == [1] * n  # indexed, then read: once


def test_a_missing_shard_is_named_and_a_folder_url_refused(web, shards, tmp_path):
    with pytest.raises(
        FileNotFoundError, match=r"shard not found on the server at http://127\.0\.0\.1:\d+ \(HTTP 404\)"
    ):
        TarShards(f"{web.url}/train-{{000003..000005}}.tar", cache_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match=r"2 of the 3 shards named are not .*train-000005\.tar'"):
        TarShards(
            [f"{web.url}/train-000000.tar", f"{web.url}/train-000005.tar", f"{web.url}/x.tar"],
            cache_dir=tmp_path,
        )
    with pytest.raises(ValueError, match="cannot be listed: name the shards"):
        TarShards(f"{web.url}/", cache_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match=r"class list not found on the server at .*/classes\.json'"):
        TarShards(f"{web.url}/train-000000.tar", classes=f"{web.url}/classes.json", cache_dir=tmp_path)


def test_the_server_stopped_then_started_again_within_retry_timeout(web, shards, tmp_path):
    ds = TarShards(f"{web.url}/train-000001.tar", cache_dir=tmp_path, retry_timeout=20)
    want = TarShards(shards / "train-000001.tar")
    for copy in _copies(tmp_path):
        copy.unlink()  # (its index stays)
    web.stop()
    restart = threading.Timer(1.0, web.start)
    restart.start()
    try:
        start = time.monotonic()
        assert bytes(ds.get_bytes(2)) == bytes(want.get_bytes(2))
        assert time.monotonic() - start >= 0.9
    finally:
        restart.join()


def test_a_shard_written_again_since_the_dataset_was_made_is_not_read(web, shards, tmp_path):
    (shards / "again").mkdir()
    shard = shards / "again" / "a.tar"
    shutil.copyfile(shards / "train-000001.tar", shard)
    ds = TarShards(f"{web.url}/again/a.tar", cache_dir=tmp_path)
    for copy in _copies(tmp_path):
        copy.unlink()
    later = shard.stat().st_mtime + 10
    os.utime(shard, (later, later))  # a new Last-Modified, the same size
    with pytest.raises(OSError, match=r"written again since the dataset was made.*again/a\.tar'"):
        ds.get_bytes(0)


def test_a_server_that_accepts_but_never_answers_fails_within_retry_timeout(tmp_path):
    silent = socket.socket()  # (listening, never accepting: the kernel takes the connections)
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/a.tar"
        start = time.monotonic()
        with pytest.raises(ObjectStoreError, match=r"after 1 attempt\(s\) in [23]\.\d s.*timed out"):
            TarShards(url, cache_dir=tmp_path, retry_timeout=2)
        assert time.monotonic() - start < 15
    finally:
        silent.close()
