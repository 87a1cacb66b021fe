"""The node-local shard cache: whole shards downloaded once per node, kept under a size limit.

A shard on an object store is read from a local copy: :class:`ShardCache` keeps the copies in one
folder (default ``$XDG_CACHE_HOME/fastload/shards``, else ``~/.cache/fastload/shards``), shared by
every rank and worker of the machine:

- **Once per node.** A process that wants a shard not in the cache takes the shard's lock file
  (``fcntl.flock`` on ``<copy>.lock``) and downloads it; another process (or thread) that wants
  it meanwhile waits on the lock, then finds the copy there. Example: 8 ranks x 4 workers opening
  ``train-0007.tar`` at once download it once.
- **Never half a shard.** A download goes to ``<copy>.<pid>.part``, sized to the shard before the
  first byte, and is renamed to ``<copy>`` when every byte is there: a killed job leaves a
  ``.part``, never a copy that looks whole. A process that exits while downloading (its prefetch
  thread, say) removes its ``.part``; one killed leaves it, and the next :class:`ShardCache` made
  on the folder removes every ``.part`` nobody is writing (whose copy's lock is free).
- **A size limit.** Before a download the shard's size is reserved under the cache's own lock
  (``.cache.lock``): the least recently used copies are removed until the copies, the downloads
  under way and the new shard fit ``limit`` bytes. Each read of a copy (at most once a second per
  process) sets its modification time, which is its last use. Removing a copy that a process is
  reading does not disturb it: the process keeps its open file (Linux frees the blocks after).
- **Named by content.** A copy is named after the URL (with the endpoint), ETag (or, from an
  http(s) server without one, ``Last-Modified``) and size of its object, so an object written
  again is a new copy (the old one ages out).

Data flow: object store --download (the store's own client)--> cache folder --pread--> TarShards.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import hashlib
import os
import queue
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import BinaryIO

import numpy as np

from ._checks import parse_size

__all__ = [
    "DEFAULT_LIMIT_FRACTION",
    "OrderedPrefetch",
    "ShardCache",
    "cache_limit_bytes",
    "default_cache_dir",
]

#: The default size limit: this fraction of the free space of the cache's file system.
DEFAULT_LIMIT_FRACTION = 0.1
#: Copies one process keeps open (the least recently used closed first).
MAX_OPEN_COPIES = 64
_TOUCH_EVERY_S = 1.0
_PART, _LOCK, _INDEX = ".part", ".lock", ".idx"


def default_cache_dir() -> str:
    """``$XDG_CACHE_HOME/fastload/shards`` (default ``~/.cache/fastload/shards``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "fastload", "shards")


def cache_limit_bytes(cache_limit: int | str | None, cache_dir: str) -> int:
    """``cache_limit`` as bytes: an int, a size such as ``"50GB"``, or ``None`` for
    :data:`DEFAULT_LIMIT_FRACTION` of the free space where ``cache_dir`` is (at least 1 GB)."""
    if cache_limit is None:
        os.makedirs(cache_dir, exist_ok=True)
        return max(10**9, int(shutil.disk_usage(cache_dir).free * DEFAULT_LIMIT_FRACTION))
    if isinstance(cache_limit, str):
        try:
            value = parse_size(cache_limit)
        except ValueError:
            raise ValueError(
                f"cache_limit should be a size such as '50GB' or a number of bytes, but got "
                f"cache_limit={cache_limit!r}"
            ) from None
    elif isinstance(cache_limit, int) and not isinstance(cache_limit, bool):
        value = cache_limit
    else:
        raise TypeError(f"cache_limit should be a size such as '50GB' or an int, but got {cache_limit!r}")
    if value <= 0:
        raise ValueError(f"cache_limit should be a positive size, but got cache_limit={cache_limit!r}")
    return value


# The lock files this process has open. A flock belongs to the open file, which a forked child
# shares: a worker forked while the prefetch thread downloads would hold that shard's lock for ever,
# so a child closes its copies of these at once (the parent's lock is unchanged).
_lock_fds: set[int] = set()
_lock_fds_lock = threading.Lock()  # (held around fork: no lock file half-registered in a child)
# The downloads under way in this process: removed at exit (a daemon thread's never ends its own).
_parts: set[str] = set()


def _close_inherited_locks() -> None:
    for fd in _lock_fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    _lock_fds.clear()
    _parts.clear()  # (the parent's)
    _lock_fds_lock.release()


@atexit.register
def _remove_parts() -> None:
    with _lock_fds_lock:
        for part in _parts:
            with contextlib.suppress(OSError):
                os.unlink(part)


os.register_at_fork(
    before=_lock_fds_lock.acquire,
    after_in_parent=_lock_fds_lock.release,
    after_in_child=_close_inherited_locks,
)


@contextlib.contextmanager
def _locked(path: str, blocking: bool = True) -> Iterator[bool]:
    """Holds ``flock(LOCK_EX)`` on ``path`` (created if need be); yields whether it got it."""
    with _lock_fds_lock:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        _lock_fds.add(fd)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        with _lock_fds_lock:
            _lock_fds.discard(fd)
            os.close(fd)  # (closing releases the lock)


class OpenCopy:
    """An open copy, closed when the last reference goes (a reader still using it keeps it)."""

    __slots__ = ("fd", "touched")

    def __init__(self, fd: int) -> None:
        self.fd, self.touched = fd, time.monotonic()

    def __del__(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


#: Writes the whole object into an open file; raises on failure (the caller retries or reports).
Downloader = Callable[[BinaryIO], None]


class ShardCache:
    """A cache folder with a size limit (see the module's description). Pickled as its folder,
    limit and prefetch depth; each process keeps its own open copies and prefetch thread.

    Args:
        folder: The cache folder (made if need be).
        limit: The most bytes its copies and downloads under way take together.
        prefetch: How many shards after one opened are downloaded ahead, in a background thread.
    """

    def __init__(self, folder: str, limit: int, prefetch: int = 2) -> None:
        self.folder, self.limit, self.prefetch = os.path.abspath(folder), int(limit), int(prefetch)
        os.makedirs(self.folder, exist_ok=True)
        self._state()
        for _, _, path in self.entries():
            if path.endswith(_PART):
                self._remove_part(path)

    def _state(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._open: OrderedDict[str, OpenCopy] = OrderedDict()
        self._jobs: queue.Queue[tuple[Callable[[], object], str]] | None = None
        self._queued: set[str] = set()

    def __getstate__(self) -> dict[str, object]:
        return {"folder": self.folder, "limit": self.limit, "prefetch": self.prefetch}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._state()

    def _here(self) -> None:
        if self._pid != os.getpid():  # forked: the parent's files and thread are not ours
            self._state()

    def path(self, identity: str, basename: str) -> str:
        """Where the copy of an object goes: ``identity`` (bucket, key, ETag, size) names it."""
        digest = hashlib.sha256(identity.encode("utf-8", "surrogateescape")).hexdigest()[:24]
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in basename)[-64:]
        return os.path.join(self.folder, f"{digest}-{safe}")

    def close(self) -> None:
        """Closes this process's open copies (those still being read stay open until read)."""
        with self._lock:
            self._open.clear()

    def index_path(self, copy: str) -> str:
        """Where the index of a copy is kept (beside it; not counted in the limit)."""
        return copy + _INDEX

    def open(self, copy: str, size: int, name: str, download: Downloader) -> OpenCopy:
        """The open copy ``copy`` (``size`` bytes; its ``fd`` stays open while the caller holds
        it), downloaded first if it is not in the cache; ``name`` is how errors name the shard."""
        self._here()
        with self._lock:
            handle = self._open.get(copy)
            if handle is not None:
                self._open.move_to_end(copy)
        if handle is None:
            handle = OpenCopy(self.ensure(copy, size, name, download))
            with self._lock:
                self._open[copy] = handle
                while len(self._open) > MAX_OPEN_COPIES:
                    self._open.popitem(last=False)
        elif time.monotonic() - handle.touched > _TOUCH_EVERY_S:
            handle.touched = time.monotonic()
            with contextlib.suppress(OSError):  # (removed meanwhile: this process keeps reading its file)
                os.utime(copy)
        return handle

    def ensure(self, copy: str, size: int, name: str, download: Downloader) -> int:
        """Opens the copy, downloading it (once per node, under its lock) where it is missing."""
        fd = self._try_open(copy)
        if fd is not None:
            return fd
        with _locked(copy + _LOCK):
            fd = self._try_open(copy)  # another process downloaded it while this one waited
            if fd is not None:
                return fd
            part = f"{copy}.{os.getpid()}.{threading.get_ident()}{_PART}"
            with _lock_fds_lock:
                _parts.add(part)
            try:
                self._reserve(part, size, name)
                with open(part, "r+b") as f:
                    download(f)
                    f.truncate()
                    got = f.tell()
                if got != size:
                    raise OSError(
                        errno.EIO, f"the download gave {got} bytes, but the object has {size}", name
                    )
                fd = os.open(part, os.O_RDONLY | os.O_CLOEXEC)  # (open before another process may
                try:  # remove the copy to make room: this one reads it all the same)
                    os.replace(part, copy)
                except BaseException:
                    os.close(fd)
                    raise
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(part)
                raise
            finally:
                with _lock_fds_lock:
                    _parts.discard(part)
            return fd

    def _try_open(self, copy: str) -> int | None:
        try:
            fd = os.open(copy, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        with contextlib.suppress(OSError):
            os.utime(copy)  # its last use
        return fd

    def entries(self) -> list[tuple[float, int, str]]:
        """``(last use, size, path)`` of every copy and download under way, oldest first."""
        out = []
        with os.scandir(self.folder) as it:
            for e in it:
                if e.name.endswith((_LOCK, _INDEX)) or e.name.startswith(".") or e.name.endswith(".tmp"):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    st = e.stat()
                    out.append((st.st_mtime, st.st_size, e.path))
        out.sort()
        return out

    def used(self) -> int:
        """Bytes the copies and downloads under way take now."""
        return sum(size for _, size, _ in self.entries())

    def _reserve(self, part: str, size: int, name: str) -> None:
        """Makes room for ``size`` bytes (least recently used copies first) and creates ``part``
        with that size, under the cache's lock, so that concurrent downloads count each other (one
        that does not fit beside the downloads under way waits for them)."""
        self.check_fits(size, name)
        while True:
            with _locked(os.path.join(self.folder, ".cache.lock")):
                if self._make_room(size):
                    with open(part, "wb") as f:
                        f.truncate(size)
                    return
            time.sleep(0.05)  # downloads under way take the room: one ends within its retry time

    def check_fits(self, size: int, name: str) -> None:
        """``OSError`` (``ENOSPC``) naming the shard ``name`` where its ``size`` exceeds the limit."""
        if size > self.limit:
            raise OSError(
                errno.ENOSPC,
                f"the shard ({size} bytes) is larger than the shard cache's limit ({self.limit} bytes): "
                f"pass a larger cache_limit (e.g. cache_limit='{max(1, -(-4 * size // 10**9))}GB')",
                name,
            )

    def _make_room(self, size: int) -> bool:
        """Removes the least recently used copies (and ``.part`` files nobody writes) until ``size``
        more bytes fit; ``False`` where downloads under way take too much for that now."""
        entries = self.entries()
        used = sum(s for _, s, _ in entries)
        for _, s, path in entries:
            if used + size <= self.limit:
                break
            if path.endswith(_PART):
                if not self._remove_part(path):
                    continue  # a download under way: its room is taken
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)  # (its index stays: a few kB, valid for the same object)
            used -= s
        return used + size <= self.limit

    def _remove_part(self, path: str) -> bool:
        """Removes the download ``path`` where nobody writes it (its copy's lock is free: a job
        killed while downloading left it); whether it did."""
        copy = path[: path.rindex(".", 0, path.rindex(".", 0, len(path) - len(_PART)))]
        with _locked(copy + _LOCK, blocking=False) as free:
            if free:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            return free

    def prefetch_after(self, jobs: list[Callable[[], object]], keys: list[str]) -> None:
        """Runs ``jobs`` (downloads of the next shards) in this process's background thread (a
        daemon: it never holds a process at exit), each shard queued once; failures are left for
        the reader of the shard to meet (it retries, and reports)."""
        self._here()
        with self._lock:
            if self._jobs is None:
                self._jobs = queue.Queue()
                threading.Thread(
                    target=self._work, args=(self._jobs,), name="fastload-prefetch", daemon=True
                ).start()
            for job, key in zip(jobs, keys, strict=True):
                if key not in self._queued:
                    self._queued.add(key)
                    self._jobs.put((job, key))

    def _work(self, jobs: queue.Queue[tuple[Callable[[], object], str]]) -> None:
        while True:
            job, key = jobs.get()
            try:
                job()
            except Exception:  # noqa: BLE001 - the shard's reader retries and reports it
                pass
            finally:
                with self._lock:
                    self._queued.discard(key)


class OrderedPrefetch:
    """A pass's downloads ahead, in the order the pass reads the shards: ``advance(done)`` (the
    position in the pass the workers read at) queues, in this process's prefetch thread, the shard
    read there and the next ones of the pass, as many as fit in half the cache; each shard once.

    Example: a pass reads shards 3, 0, 4, 1, 2 (their first samples at positions 0, 6, 12, 19, 25)
    with room in half the cache for one shard: ``advance(0)`` queues 3 and 0, ``advance(8)`` 4.

    Args:
        cache: The cache the shards are downloaded into.
        jobs: Each shard's download (``fetch``), in the order of its first sample in the pass.
        keys: Each shard's copy (:meth:`ShardCache.path`), in the same order.
        sizes: Each shard's size in bytes, in the same order.
        firsts: ``int64``: the position in the pass of each shard's first sample (ascending).
    """

    def __init__(
        self,
        cache: ShardCache,
        jobs: list[Callable[[], object]],
        keys: list[str],
        sizes: np.ndarray,
        firsts: np.ndarray,
    ) -> None:
        self.cache, self.jobs, self.keys, self.firsts = cache, jobs, keys, firsts
        self.ends = np.cumsum(sizes)  # bytes of the shards up to each one, for the budget
        self.current = -1  # the shard read at the last advance
        self.queued = 0  # the shards queued so far (the first ones of the pass)

    def advance(self, done: int) -> None:
        """The workers read sample ``done`` of the pass: queues what the next ones need."""
        current = int(np.searchsorted(self.firsts, done, side="right")) - 1
        if current == self.current:
            return  # (one comparison per batch while a shard is read)
        self.current = current = max(current, 0)
        room = self.cache.limit // 2 + int(self.ends[current])
        last = int(np.searchsorted(self.ends, room, side="right"))  # the shards after current that fit
        start = max(self.queued, current)
        if last > start:
            self.cache.prefetch_after(self.jobs[start:last], self.keys[start:last])
            self.queued = last
