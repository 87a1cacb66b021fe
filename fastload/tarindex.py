"""The index of a tar shard: where each member's bytes lie, read from the tar headers only.

A tar file is a run of 512-byte header blocks, each followed by its member's data padded to a
multiple of 512 bytes, and ends with a zero block. :func:`index_tar` reads each header (and the
block after it) through a :class:`~fastload.shardsource.ShardSource` and steps over the data, so
indexing a 512 MB shard of 110 kB images reads about 10 MB (two blocks per member). It follows GNU long names
(``././@LongLink``, type ``L``) and pax headers (type ``x``: ``path``, ``size``, ``linkpath``),
keeps regular files (a hard link is the member it names) and leaves out the rest (directories,
symbolic links, devices, sparse files). A :class:`TarIndex` is numpy arrays: member names as one
byte buffer with offsets, data offsets, sizes, and the content of small members (labels: read with
the headers, at no extra cost).

:func:`load_indexes` gives one per shard, kept between runs: in a sidecar ``<shard>.idx`` beside the
shard where that folder is writable, else under ``$XDG_CACHE_HOME/fastload/shard-index/`` (default
``~/.cache``) keyed by the shard's absolute path. Each holds the shard's size and modification time
when indexed: one that does not match the shard now, or cannot be read, is built again and replaced,
never trusted. Data flow: shard --headers--> :class:`TarIndex` --> :class:`fastload.shards.TarShards`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ._checks import caller_stacklevel
from .device import available_cpus
from .shardsource import ShardSource

__all__ = ["BLOCK", "INLINE_MAX", "TarFormatError", "TarIndex", "header_size", "index_tar", "load_indexes"]

#: The tar block size: headers are one block, data is padded to a multiple of it.
BLOCK = 512
#: Members up to this size (labels, captions) are kept in the index itself.
INLINE_MAX = 256

_FORMAT = "fastload.TarIndex"
_VERSION = 1
_ZERO = bytes(BLOCK)
_REGULAR = (b"0", b"\0", b"7")  # regular file, old-style regular file, contiguous file
_NO_DATA = (b"1", b"2", b"3", b"4", b"5", b"6")  # links, devices, directories, FIFOs: no data follows
_GZIP, _ZSTD = b"\x1f\x8b", b"\x28\xb5\x2f\xfd"


class TarFormatError(ValueError):
    """A shard that is not an uncompressed tar file, or whose headers are damaged."""


def _number(field: bytes) -> int:
    """A numeric header field: octal text (ending in NUL or space), or GNU's base-256 (high bit set)."""
    if field[0] & 0x80:
        if field[0] == 0xFF:
            raise ValueError("negative base-256 number")
        return int.from_bytes(bytes([field[0] & 0x7F]) + field[1:], "big")
    text = field.split(b"\0", 1)[0].strip()
    return int(text, 8) if text else 0


def _checksum_ok(header: bytes) -> bool:
    """Whether the header's checksum field matches its bytes (unsigned, or signed as old tars wrote)."""
    try:
        want = _number(header[148:156])
    except ValueError:
        return False
    unsigned = sum(header) - sum(header[148:156]) + 8 * 32  # the field itself counts as 8 spaces
    if want == unsigned:
        return True
    signed = (
        unsigned - 256 * sum(1 for b in header if b > 127) + 256 * sum(1 for b in header[148:156] if b > 127)
    )
    return want == signed


def header_size(header: bytes) -> int | None:
    """The data size a valid header block gives, or ``None`` (not a valid tar header)."""
    if len(header) != BLOCK or not _checksum_ok(header):
        return None
    try:
        return _number(header[124:136])
    except ValueError:
        return None


def _pax_records(data: bytes) -> dict[bytes, bytes]:
    """``"%d %s=%s\\n"`` records: each starts with its own length in bytes."""
    out: dict[bytes, bytes] = {}
    pos = 0
    while pos < len(data) and data[pos : pos + 1] != b"\0":
        space = data.index(b" ", pos)
        length = int(data[pos:space])
        if length <= 0:
            raise ValueError("bad pax record length")
        key, _, value = data[space + 1 : pos + length - 1].partition(b"=")
        out[key] = value
        pos += length
    return out


class TarIndex:
    """The regular-file members of one tar shard, in archive order.

    Attributes:
        stamp: The shard's ``(size, modification time in ns)`` when indexed.
        names: ``uint8``: the member names (UTF-8, as stored) back to back; member ``j`` is
            ``names[name_offsets[j]:name_offsets[j + 1]]``.
        offsets: ``int64``: where each member's data starts in the shard.
        sizes: ``int64``: each member's data size.
        inline: ``uint8``: the data of members of at most :data:`INLINE_MAX` bytes, back to back
            (``inline_offsets[j]:inline_offsets[j + 1]``; empty for larger members).
        end: Where the archive ended: its end-of-archive block, or where the shard stopped.
        complete: Whether the end-of-archive block was found (``False``: the shard is cut short).
    """

    def __init__(
        self,
        stamp: tuple[int, int],
        names: np.ndarray,
        name_offsets: np.ndarray,
        offsets: np.ndarray,
        sizes: np.ndarray,
        inline: np.ndarray,
        inline_offsets: np.ndarray,
        end: int,
        complete: bool,
    ) -> None:
        n = len(offsets)
        if not (len(name_offsets) == len(inline_offsets) == n + 1 and len(sizes) == n):
            raise ValueError("inconsistent tar index arrays")
        self.stamp = (int(stamp[0]), int(stamp[1]))
        self.names, self.name_offsets = names, name_offsets
        self.offsets, self.sizes = offsets, sizes
        self.inline, self.inline_offsets = inline, inline_offsets
        self.end, self.complete = int(end), bool(complete)

    def __len__(self) -> int:
        return len(self.offsets)

    def name_list(self) -> list[str]:
        """The member names as ``str`` (undecodable bytes kept as surrogate escapes)."""
        buf = self.names.tobytes()
        bounds = self.name_offsets.tolist()
        return [
            buf[a:b].decode("utf-8", "surrogateescape") for a, b in zip(bounds[:-1], bounds[1:], strict=True)
        ]

    def small(self, j: int) -> bytes | None:
        """The data of member ``j`` if it is kept inline (at most :data:`INLINE_MAX` bytes), else ``None``."""
        if int(self.sizes[j]) > INLINE_MAX:
            return None
        return self.inline[self.inline_offsets[j] : self.inline_offsets[j + 1]].tobytes()

    def save(self, path: str, key: str) -> None:
        """Writes the index to ``path`` (a ``.npz`` file written under a temporary name, then renamed)."""
        meta = {"format": _FORMAT, "version": _VERSION, "key": key, "stamp": list(self.stamp)}
        meta.update(end=self.end, complete=self.complete)
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "wb") as f:
                np.savez(
                    f,
                    meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
                    names=self.names,
                    name_offsets=self.name_offsets,
                    offsets=self.offsets,
                    sizes=self.sizes,
                    inline=self.inline,
                    inline_offsets=self.inline_offsets,
                )
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    @classmethod
    def load(cls, path: str, key: str | None, stamp: tuple[int, int]) -> TarIndex | None:
        """The index saved at ``path`` for the shard ``key`` as it is now (``stamp``); ``None`` if
        there is none, it is of another shard or version, stale, or unreadable. ``key=None`` for a
        sidecar: it names no shard but the one beside it (a folder of shards and sidecars copied
        with their times, ``cp -p``, keeps them)."""
        try:
            with np.load(path, allow_pickle=False) as z:
                meta = json.loads(z["meta"].tobytes())
                if (
                    meta.get("format") != _FORMAT
                    or meta.get("version") != _VERSION
                    or (key is not None and meta.get("key") != key)
                    or tuple(meta.get("stamp", ())) != tuple(stamp)
                ):
                    return None
                arrays = {
                    k: z[k] for k in ("names", "name_offsets", "offsets", "sizes", "inline", "inline_offsets")
                }
            index = cls(stamp, **arrays, end=int(meta["end"]), complete=bool(meta["complete"]))
        except Exception:  # noqa: BLE001 - a damaged sidecar is rebuilt, whatever the damage
            return None
        ok = (
            index.names.dtype == np.uint8
            and index.inline.dtype == np.uint8
            and all(
                a.dtype == np.int64
                for a in (index.name_offsets, index.offsets, index.sizes, index.inline_offsets)
            )
            and int(index.name_offsets[-1]) == len(index.names)
            and int(index.inline_offsets[-1]) == len(index.inline)
        )
        return index if ok else None


def index_tar(source: ShardSource, stamp: tuple[int, int] | None = None) -> TarIndex:
    """Walks the headers of the shard ``source`` (``stamp``: its ``(size, mtime_ns)``, read if not
    given); :class:`TarFormatError` names the shard and the byte where a header is damaged.

    A shard that stops early (no end-of-archive block) is indexed up to where it stops
    (``complete=False``): a member whose data runs past the end is kept, so that reading it raises
    :class:`~fastload.pack.CorruptSampleError` naming it.
    """
    if stamp is None:
        stamp = source.stamp()
    total = stamp[0]
    names: list[bytes] = []
    offsets: list[int] = []
    sizes: list[int] = []
    inline: list[bytes] = []
    long_name: bytes | None = None
    long_link: bytes | None = None
    pax: dict[bytes, bytes] = {}
    where: dict[bytes, int] | None = None  # name -> member, built at the first hard link
    pos, complete = 0, False

    def add(name: bytes, start: int, size: int, small: bytes) -> None:
        if where is not None:
            where[name] = len(names)
        names.append(name)
        offsets.append(start)
        sizes.append(size)
        inline.append(small)

    def fail(what: str) -> TarFormatError:
        return TarFormatError(
            f"shard {source.name!r} is not a readable tar file: {what} (at byte {pos}). "
            "Shards are uncompressed tar files (as webdataset and `tar -cf` write them); write it again "
            "(python -m fastload shards SRC OUT) or copy it again"
        )

    while pos + BLOCK <= total:
        buf = source.read(pos, 2 * BLOCK)
        header = buf[:BLOCK]
        if len(header) < BLOCK:
            break  # the shard shrank while indexed: as cut short
        if header == _ZERO:
            complete = True
            break
        if not _checksum_ok(header):
            if pos == 0 and header[:2] in (_GZIP, _ZSTD):
                raise fail("it is compressed; decompress it (shards are read by byte range)")
            raise fail("a header's checksum does not match")
        kind = header[156:157]
        try:
            size = int(pax[b"size"]) if b"size" in pax else _number(header[124:136])
        except ValueError:
            raise fail("a header's size field is not a number") from None
        start = pos + BLOCK
        following = start + -(-size // BLOCK) * BLOCK
        if kind in (b"L", b"K", b"x"):
            data = buf[BLOCK : BLOCK + size] if size <= BLOCK else source.read(start, size)
            if len(data) < size:
                break  # cut short inside a header's data
            if kind == b"L":
                long_name = data.split(b"\0", 1)[0]
            elif kind == b"K":
                long_link = data.split(b"\0", 1)[0]
            else:
                try:
                    pax = _pax_records(data)
                except ValueError:
                    raise fail("a pax header is damaged") from None
            pos = following
            continue
        name = pax.get(b"path") or long_name
        if name is None:
            name = header[:100].split(b"\0", 1)[0]
            if header[257:265] == b"ustar\x0000":  # POSIX ustar: a prefix field (GNU's differs)
                prefix = header[345:500].split(b"\0", 1)[0]
                if prefix:
                    name = prefix + b"/" + name
        if kind in _REGULAR and not name.endswith(b"/"):
            small = buf[BLOCK : BLOCK + size] if size <= INLINE_MAX else b""
            add(name, start, size, small if len(small) == size else b"")  # cut short: reading says so
        elif kind == b"1":  # a hard link: the data of an earlier member, none here
            target = pax.get(b"linkpath") or long_link or header[157:257].split(b"\0", 1)[0]
            if where is None:
                where = {m: j for j, m in enumerate(names)}
            j = where.get(target)
            if j is None:
                raise fail(
                    f"the hard link {name!r} names {target!r}, which is not an earlier file of the shard"
                )
            add(name, offsets[j], sizes[j], inline[j])
        long_name = long_link = None
        pax = {}
        pos = start if kind in _NO_DATA else following
    return TarIndex(
        stamp,
        *_buffer(names),
        np.asarray(offsets, dtype=np.int64),
        np.asarray(sizes, dtype=np.int64),
        *_buffer(inline),
        min(pos, total),
        complete,
    )


def _buffer(items: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """``items`` back to back as ``uint8``, and the ``int64`` offsets of each (then the end)."""
    offsets = np.zeros(len(items) + 1, dtype=np.int64)
    np.cumsum([len(x) for x in items], out=offsets[1:])
    return np.frombuffer(b"".join(items), dtype=np.uint8), offsets


def cache_folder() -> str:
    """Where indexes of shards in folders that cannot be written are kept."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "fastload", "shard-index")


def _cache_path(key: str) -> str:
    digest = hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()[:24]
    return os.path.join(cache_folder(), f"{digest}-{os.path.basename(key)[:64]}.idx")


def _load_or_build(source: ShardSource) -> tuple[TarIndex, str | None]:
    """The shard's index, and why it could not be saved (``None``: saved, or found)."""
    stamp = source.stamp()
    places = [p for p in (source.sidecar, _cache_path(source.key)) if p is not None]
    for place in places:
        found = TarIndex.load(place, None if place == source.sidecar else source.key, stamp)
        if found is not None:
            return found, None
    index = index_tar(source, stamp)
    errors = []
    for place in places:
        try:
            if place != source.sidecar:
                os.makedirs(os.path.dirname(place), exist_ok=True)
            index.save(place, source.key)
            return index, None
        except OSError as e:
            errors.append(f"{place!r}: {e.strerror or e}")
    return index, "; ".join(errors)


def load_indexes(sources: Sequence[ShardSource], num_threads: int | None = None) -> list[TarIndex]:
    """The index of each shard: its sidecar or cached index where it matches the shard, else built
    (several shards at once in ``num_threads`` threads; default: CPUs + 4, at most 32) and saved.

    Raises:
        FileNotFoundError: Naming a shard that does not exist.
        TarFormatError: Naming a shard that is not a readable tar file.
    """
    if num_threads is None:
        num_threads = min(32, available_cpus() + 4)
    if num_threads > 1 and len(sources) > 1:
        with ThreadPoolExecutor(min(num_threads, len(sources)), thread_name_prefix="fastload-index") as pool:
            results = list(pool.map(_load_or_build, sources))
    else:
        results = [_load_or_build(s) for s in sources]
    unsaved = [(s, why) for s, (_, why) in zip(sources, results, strict=True) if why is not None]
    if unsaved:
        source, why = unsaved[0]
        warnings.warn(
            f"the index of {len(unsaved)} shard(s) could not be saved, so they are indexed again next "
            f"time: e.g. {source.name!r} ({why}). Make the shards' folder or {cache_folder()!r} writable "
            "(or set XDG_CACHE_HOME to a writable folder)",
            stacklevel=caller_stacklevel(),
        )
    return [index for index, _ in results]
