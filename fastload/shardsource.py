"""Where a tar shard's bytes come from: :class:`ShardSource`, and :class:`LocalShard` for a file.

Everything that reads a shard (:mod:`fastload.tarindex` walking its headers,
:class:`fastload.shards.TarShards` reading a sample) goes through the few methods of
:class:`ShardSource`: ``stamp()`` (size and modification time: what an index is valid for) and
``read(offset, length)`` (a byte range). A source over an object store implements the same methods.

:class:`LocalShard` opens its file lazily, in the process that reads it: a pickled ``LocalShard`` is
its path, and a forked process opens the file again (the table of open files is per process, at
most :data:`MAX_OPEN_FILES` of them, least recently used closed first). Reads are ``os.pread``:
safe from several threads at once.
"""

from __future__ import annotations

import errno
import os
import threading
from collections import OrderedDict
from typing import Protocol, runtime_checkable

__all__ = ["MAX_OPEN_FILES", "LocalShard", "ShardSource", "read_fully"]

#: Shard files one process keeps open (with 1,000 shards a worker does not reach the file limit).
MAX_OPEN_FILES = 64


def read_fully(fd: int, offset: int, length: int) -> bytes:
    """``length`` bytes at ``offset`` (fewer only at the end of the file): a network file system
    may return less than asked before the end."""
    data = os.pread(fd, length, offset)
    if 0 < len(data) < length:
        parts = [data]
        got = len(data)
        while got < length:
            more = os.pread(fd, length - got, offset + got)
            if not more:
                break
            parts.append(more)
            got += len(more)
        data = b"".join(parts)
    return data


@runtime_checkable
class ShardSource(Protocol):
    """The bytes of one tar shard.

    Attributes:
        name: How messages name the shard (its path or URL).
        sidecar: Where an index of this shard may be kept beside it (``None`` where nothing can be
            written beside it, e.g. an object store: then only in the local index cache).
        key: What identifies the shard in the local index cache (an absolute path or a URL).
    """

    name: str
    sidecar: str | None
    key: str

    def stamp(self) -> tuple[int, int]:
        """``(size in bytes, modification time in ns)`` as the shard is now; ``FileNotFoundError``
        naming it where it does not exist."""
        ...

    def read(self, offset: int, length: int) -> bytes:
        """``length`` bytes from ``offset``; fewer only where the shard ends before."""
        ...


class _Handle:
    """An open file descriptor, closed when the last reference to it goes (a thread still reading
    keeps it open after the table dropped it)."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __del__(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


class _OpenFiles:
    """This process's open shard files, least recently used first."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.files: OrderedDict[str, _Handle] = OrderedDict()

    def get(self, path: str) -> _Handle:
        with self.lock:
            handle = self.files.get(path)
            if handle is not None:
                self.files.move_to_end(path)
                return handle
        try:
            handle = _Handle(os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)))
        except OSError as e:
            raise _open_error(e, path) from None
        with self.lock:
            self.files[path] = handle  # (a second thread's open of the same file replaces this one)
            while len(self.files) > MAX_OPEN_FILES:
                self.files.popitem(last=False)
        return handle


_open_files: _OpenFiles | None = None


def _files() -> _OpenFiles:
    """The table of this process (a new one after ``fork``: the parent's descriptors are closed)."""
    global _open_files
    table = _open_files
    if table is None or table.pid != os.getpid():
        table = _open_files = _OpenFiles()  # the inherited table goes, closing its descriptors here
    return table


def _open_error(error: OSError, path: str) -> OSError:
    if error.errno == errno.ENOENT:
        return FileNotFoundError(
            errno.ENOENT, "shard not found (moved or deleted? list the shards that exist)", path
        )
    return type(error)(error.errno, f"cannot open shard: {error.strerror}", path)


class LocalShard:
    """A shard in a local (or mounted) file system.

    Example:
        >>> shard = LocalShard("shards/train-000000.tar")                     # doctest: +SKIP
        >>> shard.read(0, 512)[:10]                                            # doctest: +SKIP
        b'000000.jpg'
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.name = os.fspath(path)
        self.key = os.path.abspath(self.name)  # other processes may have another working directory
        self.sidecar: str | None = self.key + ".idx"

    def stamp(self) -> tuple[int, int]:
        try:
            st = os.stat(self.key)
        except OSError as e:
            raise _open_error(e, self.name) from None
        if not os.path.isfile(self.key):
            raise IsADirectoryError(
                errno.EISDIR, "a shard should be a tar file, but this is not a file", self.name
            )
        return st.st_size, st.st_mtime_ns

    def read(self, offset: int, length: int) -> bytes:
        handle = _files().get(self.key)
        return read_fully(handle.fd, offset, length)

    def __repr__(self) -> str:
        return f"LocalShard({self.name!r})"
