"""The pack file: a whole image split in one memory-mappable file.

A pack holds the encoded images of a :class:`~fastload.folder.FolderIndex` back to back, behind a
small header and index, so that a dataset of a million files becomes one file that is

* copied, synced and cached as one object (no per-file open or ``stat`` on a network file system);
* memory-mapped: ``get_bytes(i)`` is a zero-copy slice of the map, and every process that maps the
  file shares the same physical pages (the page cache), whatever the number of loader workers;
* opened in time proportional to the *index*, not the data: the checksum covers the header and the
  index only, so a 150 GB pack of ImageNet opens in a fraction of a second. ``verify()`` checks the
  images themselves (a CRC-32 per sample) when you want to.

Layout (version 1, all integers little-endian)::

    0              fixed header (128 bytes):
                   magic b"FASTPACK", format version u32, header size u32 (128),
                   samples u64, meta length u64, index offset u64, path bytes u64,
                   data offset u64, data length u64,
                   blake2b-256 digest of bytes [0, data offset) with this field zeroed
    128            meta: UTF-8 JSON {"format": "fastload.pack", "classes": [...], "root": ...,
                   "max_side": ..., "quality": ...}
    index offset   (8-byte aligned)
                   offsets       int64[n + 1]  sample i is data[offsets[i]:offsets[i + 1]]
                   labels        int64[n]      indices into meta["classes"]
                   path offsets  int64[n + 1]  relative path i is paths[po[i]:po[i + 1]]
                   crc32         uint32[n]     of each sample's bytes (checked by verify())
                   paths         UTF-8 bytes   the original relative paths, back to back
    data offset    (a multiple of 4096, so the data section is page-aligned in a map)
                   the encoded images, back to back, in index order

Labels are those of the index the pack was built from, so a pack of ``val`` built with the class list
of ``train`` keeps ``train``'s labels (see :mod:`fastload.folder`).

Example:
    >>> from fastload.folder import scan_folder
    >>> from fastload.pack import write_pack, open_pack
    >>> summary = write_pack(scan_folder("imagenet/train"), "train.fastpack")
    >>> with open_pack("train.fastpack") as pack:
    ...     first = bytes(pack.get_bytes(0))           # the original file, bit for bit
    ...     pack.index.relpath(0), int(pack.labels[0])
    ('n01440764/n01440764_10026.JPEG', 0)

Command line: ``python -m fastload pack ROOT OUT [--classes classes.json] [--max-side N] [--quality Q]``.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import mmap
import operator
import os
import stat
import struct
import sys
import tempfile
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from .device import available_cpus
from .folder import ClassIndex, FolderIndex, scan_folder

__all__ = [
    "ALIGNMENT",
    "FORMAT_VERSION",
    "MAGIC",
    "PackError",
    "PackFile",
    "PackSummary",
    "add_pack_parser",
    "open_pack",
    "pack_command",
    "write_pack",
]

MAGIC = b"FASTPACK"
FORMAT_VERSION = 1
ALIGNMENT = 4096
_FORMAT = "fastload.pack"
_HEADER = struct.Struct("<8sIIQQQQQQ32s")
_HEADER_SIZE = 128
_DIGEST_AT = _HEADER.size - 32
_REBUILD = "Rebuild it with: python -m fastload pack ROOT OUT"
_RECOPY = "Copy it again or rebuild it (python -m fastload pack ROOT OUT)."

T = TypeVar("T")
R = TypeVar("R")


class PackError(ValueError):
    """A file is not a valid pack: the message names the file, what is wrong and what to do."""


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _index_layout(n: int, index_offset: int, path_bytes: int) -> tuple[dict[str, int], int]:
    """Positions of the index arrays (a pure function of the header fields) and where they end."""
    pos: dict[str, int] = {}
    at = index_offset
    for name, nbytes in (
        ("offsets", 8 * (n + 1)),
        ("labels", 8 * n),
        ("path_offsets", 8 * (n + 1)),
        ("crc32", 4 * n),
        ("paths", path_bytes),
    ):
        pos[name] = at
        at += nbytes
    return pos, at


def _digest(buf: memoryview, data_offset: int) -> bytes:
    """blake2b-256 of ``buf[:data_offset]`` with the digest field read as zeros (no copies)."""
    h = hashlib.blake2b(digest_size=32)
    h.update(buf[:_DIGEST_AT])
    h.update(bytes(32))
    h.update(buf[_DIGEST_AT + 32 : data_offset])
    return h.digest()


class _HeadPlan:
    """Everything before the data section, for one index: sized up front, rendered at the end.

    The size of the header and index depends only on the number of samples, the meta JSON and the
    total length of the relative paths, so a writer can leave room for it, stream the images, and
    fill it in once the offsets and checksums are known.
    """

    def __init__(self, index: FolderIndex, meta: dict[str, Any]) -> None:
        self.n = len(index)
        # FolderIndex keeps its relative paths as one UTF-8 buffer plus offsets: reuse them as is.
        po = np.asarray(index._offsets, dtype=np.int64)
        buf = np.asarray(index._buf, dtype=np.uint8)
        self.path_offsets = po - po[0]
        self.paths = buf[int(po[0]) : int(po[-1])]
        self.labels = index.targets
        # Names that are not valid UTF-8 on disk come from os.scandir as surrogate escapes: keep their bytes.
        self.meta = json.dumps({"format": _FORMAT, **meta}, ensure_ascii=False, sort_keys=True).encode(
            "utf-8", "surrogateescape"
        )
        self.index_offset = _align(_HEADER_SIZE + len(self.meta), 8)
        self.pos, end = _index_layout(self.n, self.index_offset, len(self.paths))
        self.data_offset = _align(end, ALIGNMENT)

    def render(self, offsets: np.ndarray, crc32: np.ndarray) -> bytearray:
        """The bytes ``[0, data_offset)`` of the pack, digest included."""
        head = bytearray(self.data_offset)
        head[_HEADER_SIZE : _HEADER_SIZE + len(self.meta)] = self.meta
        for name, dtype, values in (
            ("offsets", "<i8", offsets),
            ("labels", "<i8", self.labels),
            ("path_offsets", "<i8", self.path_offsets),
            ("crc32", "<u4", crc32),
            ("paths", "u1", self.paths),
        ):
            arr = np.asarray(values)
            np.ndarray(arr.shape, dtype=dtype, buffer=head, offset=self.pos[name])[...] = arr
        data_len = int(offsets[-1])
        fields = (
            MAGIC,
            FORMAT_VERSION,
            _HEADER_SIZE,
            self.n,
            len(self.meta),
            self.index_offset,
            len(self.paths),
            self.data_offset,
            data_len,
        )
        _HEADER.pack_into(head, 0, *fields, bytes(32))
        _HEADER.pack_into(head, 0, *fields, _digest(memoryview(head), self.data_offset))
        return head


class _PackView:
    """Validated, zero-copy views of a pack image held in any buffer (a file map or a shared segment).

    Args:
        buf: The whole pack image (an ``mmap``).
        name: How to name it in errors (e.g. ``"'train.fastpack'"``).
        verify: Check the digest of the header and index (O(index)).
        expect_digest: The digest it must have (a cheap identity check when re-attaching).
    """

    def __init__(self, buf: Any, name: str, verify: bool = True, expect_digest: bytes | None = None) -> None:
        mv = memoryview(buf)
        size = mv.nbytes
        if size < _HEADER.size:
            if bytes(mv[: min(8, size)]) != MAGIC[: min(8, size)] or size == 0:
                raise PackError(
                    f"{name} is not a fastload pack file ({size} bytes, no pack header). {_REBUILD}"
                )
            raise PackError(
                f"{name} is truncated: it has {size} bytes, less than the {_HEADER.size}-byte pack header. {_RECOPY}"
            )
        magic, version, header_size, n, meta_len, index_offset, path_bytes, data_offset, data_len, digest = (
            _HEADER.unpack_from(mv, 0)
        )
        if magic != MAGIC:
            raise PackError(
                f"{name} is not a fastload pack file: it starts with {bytes(magic)!r}, a pack starts with {MAGIC!r}. {_REBUILD}"
            )
        if version != FORMAT_VERSION:
            raise PackError(
                f"{name} has pack format version {version}, but this fastload reads version {FORMAT_VERSION}. "
                f"Install the fastload that wrote it, or rebuild the pack with this one (python -m fastload pack ROOT OUT)."
            )
        pos, index_end = _index_layout(n, index_offset, path_bytes)
        if (
            header_size != _HEADER_SIZE
            or index_offset < _HEADER_SIZE + meta_len
            or index_offset % 8
            or data_offset % ALIGNMENT
            or data_offset < index_end
        ):
            raise PackError(f"{name} has a corrupt pack header (inconsistent section offsets). {_RECOPY}")
        if size < data_offset:
            raise PackError(
                f"{name} is truncated (or its header is damaged): the header and index need {data_offset} bytes but it has {size}. "
                + _RECOPY
            )
        if expect_digest is not None and digest != expect_digest:
            raise PackError(
                f"{name} has changed since it was opened (its header digest differs). Recreate the dataset from the new file."
            )
        if verify and _digest(mv, data_offset) != digest:
            raise PackError(
                f"{name} is corrupt: the checksum of its header and index does not match. " + _RECOPY
            )
        if size != data_offset + data_len:
            what = (
                "is truncated"
                if size < data_offset + data_len
                else "has unexpected bytes after its data section"
            )
            raise PackError(
                f"{name} {what}: the header says {data_offset + data_len} bytes but it has {size}. "
                f"The copy or the write was interrupted. {_RECOPY}"
            )
        try:
            meta = json.loads(
                bytes(mv[_HEADER_SIZE : _HEADER_SIZE + meta_len]).decode("utf-8", "surrogateescape")
            )
            if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
                raise ValueError(f"format is {meta.get('format') if isinstance(meta, dict) else None!r}")
            classes = ClassIndex(meta["classes"])
        except (ValueError, KeyError, TypeError) as e:
            raise PackError(f"{name} has an unreadable meta section ({e}). {_REBUILD}") from None

        def arr(key: str, dtype: str, count: int) -> np.ndarray:
            return np.frombuffer(buf, dtype=dtype, count=count, offset=pos[key])

        offsets = arr("offsets", "<i8", n + 1)
        path_offsets = arr("path_offsets", "<i8", n + 1)
        for what, o, end in (
            ("sample offsets", offsets, data_len),
            ("path offsets", path_offsets, path_bytes),
        ):
            if o[0] != 0 or o[-1] != end or not bool((o[1:] >= o[:-1]).all()):
                raise PackError(f"{name} has corrupt {what} in its index. {_RECOPY}")
        labels = arr("labels", "<i8", n)
        try:
            self.index = FolderIndex(
                str(meta.get("root", "")),
                None,
                labels,
                classes,
                _packed=(arr("paths", "u1", path_bytes), path_offsets),
            )
        except ValueError as e:
            raise PackError(f"{name} has a corrupt index ({e}). {_REBUILD}") from None
        self.name = name
        self.meta = meta
        self.digest = bytes(digest)
        self.nbytes = size
        self.data_offset = data_offset
        self.offsets = offsets
        self.labels = self.index.targets
        self.crc32 = arr("crc32", "<u4", n)
        self.data = np.frombuffer(buf, dtype=np.uint8, count=data_len, offset=data_offset)
        self._data_mv: memoryview | None = mv[data_offset : data_offset + data_len]
        mv.release()

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def get_bytes(self, i: int) -> memoryview:
        mv = self._data_mv
        if mv is None:
            raise ValueError(f"I/O operation on closed pack {self.name}")
        try:
            j = operator.index(i)
        except TypeError:
            raise TypeError(f"sample index should be an integer, but got {type(i).__name__}") from None
        n = len(self.offsets) - 1
        if j < 0:
            j += n
        if not 0 <= j < n:
            raise IndexError(f"sample index {i} is out of range for a dataset of {n} samples")
        return mv[self.offsets[j] : self.offsets[j + 1]]

    def verify(self, progress: bool | None = None) -> None:
        n = len(self)
        bar = _progress_bar(n, "verify", "img", progress)
        try:
            for i in range(n):
                crc = zlib.crc32(self.get_bytes(i))
                if crc != int(self.crc32[i]):
                    raise PackError(
                        f"sample {i} ({self.index.relpath(i)!r}) of {self.name} is corrupt: its CRC-32 is {crc:08x}, "
                        f"the index says {int(self.crc32[i]):08x}. {_RECOPY}"
                    )
                bar.update(1)
        finally:
            bar.close()

    def release(self) -> None:
        """Drops every view of the buffer held here (so that its owner can unmap it)."""
        if self._data_mv is not None:
            self._data_mv.release()
        self._data_mv = None
        for attr in ("index", "offsets", "labels", "crc32", "data"):
            self.__dict__.pop(attr, None)


class PackFile:
    """An open pack file, memory-mapped read-only. Use :func:`open_pack` to open one.

    Attributes:
        path: The file.
        index: A :class:`~fastload.folder.FolderIndex` of the original relative paths, labels and
            class list (its ``root`` is where the images were when the pack was built).
        offsets: ``int64[n + 1]``; sample ``i`` is ``data[offsets[i]:offsets[i + 1]]``.
        labels: ``int64[n]`` (the same array as ``index.targets``).
        data: The data section as a read-only ``uint8`` array backed by the map (no copy).
        meta: The header's JSON (``classes``, ``root``, ``max_side``, ``quality``).

    Opening validates the header, the checksum of the header and index, and the file size; it does
    not read the images. Pickling a ``PackFile`` pickles its path: the receiving process maps the same
    file (sharing the page cache) after a cheap check that it is still the same file.
    """

    def __init__(
        self, path: str | os.PathLike[str], *, _expect: tuple[tuple[int, ...], bytes] | None = None
    ) -> None:
        self.path = os.fspath(path)
        self._abspath = os.path.abspath(self.path)  # for pickling: the receiver may have another cwd
        name = repr(self.path)
        fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise PackError(
                    f"{name} is not a regular file, so it is not a fastload pack file. {_REBUILD}"
                )
            if st.st_size == 0:
                raise PackError(f"{name} is empty: it is not a fastload pack file. {_REBUILD}")
            mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        self._stat: tuple[int, int, int, int] = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        verify, digest = True, None
        if _expect is not None:
            # Re-opened from a pickle: same inode, size and mtime as in the process that validated
            # it, and the same header digest -> skip hashing the index again.
            digest = _expect[1]
            verify = tuple(_expect[0]) != self._stat
        try:
            self._view: _PackView | None = _PackView(mm, name, verify=verify, expect_digest=digest)
        except BaseException:
            try:
                mm.close()
            except BufferError:
                pass  # the traceback still holds views: unmapped when it is dropped
            raise
        self._mm: mmap.mmap | None = mm

    def _require(self) -> _PackView:
        if self._view is None:
            raise ValueError(f"I/O operation on closed pack {self.path!r}")
        return self._view

    @property
    def closed(self) -> bool:
        return self._view is None

    @property
    def index(self) -> FolderIndex:
        return self._require().index

    @property
    def classes(self) -> ClassIndex:
        return self._require().index.classes

    @property
    def offsets(self) -> np.ndarray:
        return self._require().offsets

    @property
    def labels(self) -> np.ndarray:
        return self._require().labels

    @property
    def data(self) -> np.ndarray:
        return self._require().data

    @property
    def meta(self) -> dict[str, Any]:
        return dict(self._require().meta)

    @property
    def digest(self) -> bytes:
        """The header's blake2b-256 digest (identifies the pack's index)."""
        return self._require().digest

    @property
    def data_offset(self) -> int:
        """Where the data section starts in the file (a multiple of :data:`ALIGNMENT`)."""
        return self._require().data_offset

    @property
    def nbytes(self) -> int:
        """Size of the whole file."""
        return self._stat[2]

    def __len__(self) -> int:
        return len(self._require())

    def get_bytes(self, i: int) -> memoryview:
        """The encoded bytes of sample ``i``: a read-only ``memoryview`` of the map (no copy).

        Negative indices count from the end; out-of-range ones raise ``IndexError``.
        """
        return self._require().get_bytes(i)

    def verify(self, progress: bool | None = None) -> None:
        """Checks every sample's CRC-32 (reads the whole file).

        Raises:
            PackError: Naming the first corrupt sample and its original path.
        """
        self._require().verify(progress)

    def close(self) -> None:
        """Unmaps the file. Views handed out earlier (``get_bytes``, ``data``) stay valid: the map is
        released when the last of them is dropped."""
        if self._view is not None:
            self._view.release()
            self._view = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # views still exported: the map goes with the last of them
            self._mm = None

    def __enter__(self) -> PackFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> tuple[Any, ...]:
        view = self._require()
        return (_reopen, (self._abspath, self._stat, view.digest))

    def __repr__(self) -> str:
        if self._view is None:
            return f"PackFile({self.path!r}, closed)"
        return f"PackFile({self.path!r}, samples={len(self._view)}, classes={len(self._view.index.classes)}, data={self._view.data.nbytes / 1e6:.1f} MB)"


def _reopen(path: str, stat: tuple[int, ...], digest: bytes) -> PackFile:
    return PackFile(path, _expect=(stat, digest))


def open_pack(path: str | os.PathLike[str]) -> PackFile:
    """Opens and validates a pack file (header, checksum of header and index, size), memory-mapped.

    Args:
        path: The pack file.

    Raises:
        FileNotFoundError: If it does not exist.
        PackError: (a ``ValueError``) If it is not a pack, has an unknown format version, is truncated
            or its header and index fail the checksum. The message says what to do.

    Example:
        >>> with open_pack("val.fastpack") as pack:
        ...     len(pack), pack.index.classes[0]
        (50000, 'n01440764')
    """
    return PackFile(path)


# ----------------------------------------------------------------------------------------- writing


@dataclass(frozen=True)
class PackSummary:
    """What :func:`write_pack` wrote."""

    path: Path
    num_samples: int
    data_bytes: int
    file_bytes: int
    source_bytes: int
    reencoded: int


def _progress_bar(total: int, desc: str, unit: str, progress: bool | None) -> Any:
    if progress is None:
        progress = total > 500 and sys.stderr.isatty()
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, disable=not progress, unit_scale=unit == "B")


def _bounded_map(
    executor: Executor | None, fn: Callable[[T], R], items: Iterable[T], max_in_flight: int
) -> Iterator[R]:
    """``map(fn, items)`` in order, with at most ``max_in_flight`` tasks submitted at a time.

    ``Executor.map`` submits everything at once (a million futures for ImageNet, and results
    pile up in memory when the consumer is slower); this keeps a bounded window instead. With
    ``executor=None`` it runs in the calling thread.
    """
    if executor is None:
        yield from map(fn, items)
        return
    pending: deque[Future[R]] = deque()
    try:
        for item in items:
            pending.append(executor.submit(fn, item))
            if len(pending) >= max_in_flight:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for f in pending:
            f.cancel()


def _shrink(data: bytes, max_side: int, quality: int) -> bytes | None:
    """``data`` re-encoded as an RGB JPEG whose longer side is ``max_side``; ``None`` if already small enough."""
    from PIL import Image

    img = Image.open(io.BytesIO(data))
    w, h = img.size
    if max(w, h) <= max_side:
        return None
    scale = max_side / max(w, h)
    size = (max(1, round(w * scale)), max(1, round(h * scale)))
    if img.format in ("JPEG", "MPO"):
        img.draft("RGB", size)  # DCT-domain downscale to >= size: much faster than a full decode
    img = img.convert("RGB").resize(size, Image.Resampling.LANCZOS)
    out = io.BytesIO()
    img.save(out, format="JPEG", quality=quality)
    return out.getvalue()


# One result per sample: (bytes or None, crc32, source size, re-encoded?, error kind, error message)
_Result = tuple[bytes | None, int, int, bool, str | None, str | None]


def _load_chunk(task: tuple[list[str], int | None, int]) -> list[_Result]:
    """Reads (and with ``max_side`` re-encodes) the files of one chunk; runs in a pool worker."""
    paths, max_side, quality = task
    out: list[_Result] = []
    for path in paths:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            out.append((None, 0, 0, False, "read", e.strerror or str(e)))
            continue
        size = len(data)
        shrunk = None
        if max_side is not None:
            try:
                shrunk = _shrink(data, max_side, quality)
            except Exception as e:  # noqa: BLE001 - any decoder failure is reported with the sample's name
                out.append((None, 0, size, False, "decode", f"{type(e).__name__}: {e}"))
                continue
        if shrunk is not None:
            data = shrunk
        out.append((data, zlib.crc32(data), size, shrunk is not None, None, None))
    return out


def _check_int(value: Any, name: str, low: int, high: int | None = None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    ok = (
        isinstance(value, (int, np.integer))
        and not isinstance(value, bool)
        and value >= low
        and (high is None or value <= high)
    )
    if not ok:
        what = (
            f"an integer in [{low}, {high}]"
            if high is not None
            else ("a positive integer" if low == 1 else "a non-negative integer")
        )
        raise ValueError(
            f"{name} should be {what}{' or None' if allow_none else ''}, but got {name}={value!r}"
        )


def write_pack(
    index: FolderIndex,
    out_path: str | os.PathLike[str],
    max_side: int | None = None,
    quality: int = 90,
    num_workers: int | None = None,
    progress: bool | None = None,
) -> PackSummary:
    """Writes the samples of ``index`` into one pack file (see the module docstring for the layout).

    The files are read (and re-encoded, with ``max_side``) in parallel; the calling process writes
    them sequentially, in index order, into a temporary file next to ``out_path`` that is renamed to
    ``out_path`` only when complete: an interrupted run never leaves a half-written pack under the
    final name.

    Args:
        index: The samples (e.g. ``scan_folder("imagenet/val", classes)``); the pack keeps its labels,
            class list and relative paths.
        out_path: The pack to write (by convention ``*.fastpack``). Replaced if it exists.
        max_side: Re-encode images whose longer side exceeds this as RGB JPEG with that longer side
            (like FFCV's ``max_resolution``), to save RAM and decoding time. Smaller images, and all
            images when ``None`` (the default), are stored bit for bit as in the file.
        quality: JPEG quality of re-encoded images (1-100).
        num_workers: Parallel readers: threads when only copying, processes when re-encoding (the
            CPU-bound case). Default: the CPUs available to this process; ``0`` works in the calling
            process.
        progress: Show a tqdm bar (default: for more than 500 files when stderr is a terminal).

    Returns:
        A :class:`PackSummary` (path, sample count, data and file size, source size, number of
        re-encoded images).

    Raises:
        OSError: Naming the sample and file that cannot be read.
        fastload.decode.DecodeError: With ``max_side``, naming a sample that cannot be decoded.

    Example:
        An image of 1600x1200 with ``max_side=512`` is stored as a 512x384 JPEG; one of 500x375 is
        stored unchanged (even if it is a PNG or a CMYK JPEG).
    """
    if not isinstance(index, FolderIndex):
        raise TypeError(
            f"index should be a FolderIndex (e.g. scan_folder(root)), but got {type(index).__name__}"
        )
    _check_int(max_side, "max_side", 1, allow_none=True)
    _check_int(quality, "quality", 1, 100)
    _check_int(num_workers, "num_workers", 0, allow_none=True)
    out = os.path.abspath(os.fspath(out_path))
    if os.path.isdir(out):
        raise ValueError(f"out_path should be a file name, but {out!r} is a directory")
    plan = _HeadPlan(
        index,
        {
            "classes": list(index.classes),
            "root": index.root,
            "max_side": max_side,
            "quality": quality if max_side is not None else None,
        },
    )
    n = len(index)
    workers = available_cpus() if num_workers is None else num_workers
    chunk = 16 if max_side is not None else 64
    paths = index.paths
    tasks = ((paths[a : min(a + chunk, n)], max_side, quality) for a in range(0, n, chunk))
    executor: Executor | None = None
    if workers > 0 and n > chunk:
        executor = ProcessPoolExecutor(workers) if max_side is not None else ThreadPoolExecutor(workers)

    offsets = np.zeros(n + 1, dtype=np.int64)
    crcs = np.zeros(n, dtype=np.uint32)
    source_bytes = reencoded = 0
    try:
        fd, tmp = tempfile.mkstemp(
            dir=os.path.dirname(out), prefix=f".{os.path.basename(out)}.", suffix=".tmp"
        )
    except OSError as e:
        if executor is not None:
            executor.shutdown(wait=False)
        raise OSError(e.errno, f"cannot create the pack file {out!r}: {e.strerror}") from None
    bar = _progress_bar(n, f"pack {os.path.basename(out)}", "img", progress)
    try:
        with os.fdopen(fd, "wb") as f:
            f.seek(plan.data_offset)  # room for the header and index, written last
            pos = 0
            i = 0
            for results in _bounded_map(executor, _load_chunk, tasks, max_in_flight=4 * max(1, workers)):
                for data, crc, src, was_reencoded, err, msg in results:
                    if err == "read":
                        raise OSError(f"cannot read sample {i} ({paths[i]!r}): {msg}")
                    if err == "decode":
                        from .decode import DecodeError

                        raise DecodeError(
                            f"cannot decode sample {i} ({paths[i]!r}) to re-encode it for max_side={max_side}: {msg}. "
                            "Remove or replace the file, or pack without max_side to store its bytes unchanged."
                        )
                    assert data is not None
                    f.write(data)
                    pos += len(data)
                    offsets[i + 1] = pos
                    crcs[i] = crc
                    source_bytes += src
                    reencoded += was_reencoded
                    i += 1
                bar.update(len(results))
            f.seek(0)
            f.write(plan.render(offsets, crcs))
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; a pack is an ordinary data file
        os.replace(tmp, out)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    finally:
        bar.close()
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)
    return PackSummary(
        Path(out), n, int(offsets[-1]), plan.data_offset + int(offsets[-1]), source_bytes, reencoded
    )


# ------------------------------------------------------------------------------------ command line


def add_pack_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Adds the ``pack`` command to an ``argparse`` sub-parser set (``func=pack_command``).

    Example:
        >>> parser = argparse.ArgumentParser(prog="fastload")
        >>> add_pack_parser(parser.add_subparsers(dest="command", required=True))
        >>> args = parser.parse_args(["pack", "imagenet/val", "val.fastpack", "--classes", "classes.json"])
        >>> args.func(args)
    """
    p = subparsers.add_parser(
        "pack",
        help="pack an image folder into one memory-mappable file",
        description="Packs the images of ROOT/<class>/... into one file for fastload.InMemoryImageFolder.from_pack.",
    )
    p.add_argument("root", help="the split's folder, e.g. imagenet/train")
    p.add_argument("out", help="the pack file to write, e.g. train.fastpack")
    p.add_argument(
        "--classes",
        default=None,
        metavar="JSON",
        help="class list (JSON from ClassIndex.save, or a JSON list of names); default: the subfolders of ROOT",
    )
    p.add_argument(
        "--max-side",
        type=int,
        default=None,
        metavar="N",
        help="re-encode images whose longer side exceeds N pixels (RGB JPEG at --quality); default: store the files unchanged",
    )
    p.add_argument(
        "--quality", type=int, default=90, metavar="Q", help="JPEG quality of re-encoded images (default: 90)"
    )
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help="parallel readers/encoders (default: the available CPUs)",
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="show a progress bar (default: on a terminal)",
    )
    p.set_defaults(func=pack_command)
    return p


def pack_command(args: argparse.Namespace) -> int:
    """Runs ``python -m fastload pack`` with parsed arguments; returns the exit status."""
    index = scan_folder(args.root, classes=args.classes)
    summary = write_pack(
        index,
        args.out,
        max_side=args.max_side,
        quality=args.quality,
        num_workers=args.workers,
        progress=args.progress,
    )
    shrunk = (
        f", {summary.reencoded} re-encoded to max side {args.max_side}" if args.max_side is not None else ""
    )
    print(
        f"wrote {summary.path}: {summary.num_samples} samples, {len(index.classes)} classes, "
        f"{summary.data_bytes / 1e6:.1f} MB of images (source {summary.source_bytes / 1e6:.1f} MB{shrunk})"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fastload.pack ROOT OUT ...`` (the same as ``python -m fastload pack``)."""
    parser = argparse.ArgumentParser(prog="fastload")
    add_pack_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["pack", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
