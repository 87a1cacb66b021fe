"""The byte layout shared by pack files (:mod:`fastload.pack`) and the RAM segment (:mod:`fastload.memory`).

One pack image (a file, or a shared memory segment) is a header, an index and the encoded images
back to back. :class:`HeadPlan` sizes the header and index up front (a writer streams the images
first) and renders them; :class:`PackView` validates an image in any buffer and views it.

Layout (version 1, all integers little-endian)::

    0              fixed header (HEADER_SIZE = 128 bytes):
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
                   crc32         uint32[n]     of each sample's bytes (checked on every read)
                   paths         UTF-8 bytes   the original relative paths, back to back
    data offset    (a multiple of ALIGNMENT = 4096, so the data section is page-aligned in a map)
                   the encoded images, back to back, in index order

Worked example: 3 samples of 100, 50 and 70 bytes with relative paths of 40 bytes in total and a
meta JSON of 90 bytes. The index starts at ``align(128 + 90, 8) = 224`` and takes
``8*4 + 8*3 + 8*4 + 4*3 + 40 = 140`` bytes (up to 364), so the data starts at 4096 and the image
is ``4096 + 220`` bytes long; sample 1 is bytes ``[4196, 4246)``.

Opening checks the digest of header and index; each sample is checked against its CRC-32 the first
time a process reads it (:meth:`PackView.get_bytes`), raising :class:`CorruptSampleError`.
"""

from __future__ import annotations

import hashlib
import json
import operator
import struct
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from ._slices import ByteSlices
from .decode import DecodeError
from .folder import ClassIndex, FolderIndex

MAGIC = b"FASTPACK"
FORMAT_VERSION = 1
#: The data section starts at a multiple of this (a page), so it is page-aligned in a map.
ALIGNMENT = 4096
FORMAT_NAME = "fastload.pack"
HEADER = struct.Struct("<8sIIQQQQQQ32s")
HEADER_SIZE = 128
_DIGEST_AT = HEADER.size - 32

#: What to do about a file that is not a (readable) pack.
REBUILD_HINT = "Rebuild it with: python -m fastload pack ROOT OUT"
#: What to do about a pack whose bytes were damaged (by a copy, a full disk, ...).
RECOPY_HINT = "Copy it again or rebuild it (python -m fastload pack ROOT OUT)."


class PackError(ValueError):
    """A file is not a valid pack: the message names the file, what is wrong and what to do."""


class CorruptSampleError(PackError, DecodeError):
    """A sample's bytes differ from those packed (its CRC-32 does not match the index); also a
    :class:`~fastload.decode.DecodeError`, so ``on_error="skip"`` leaves it out like any bad image."""


def align(n: int, to: int) -> int:
    """``n`` rounded up to a multiple of ``to`` (``align(218, 8) == 224``)."""
    return (n + to - 1) // to * to


def index_layout(n: int, index_offset: int, path_bytes: int) -> tuple[dict[str, int], int]:
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


def header_digest(buf: memoryview, data_offset: int) -> bytes:
    """blake2b-256 of ``buf[:data_offset]`` with the digest field read as zeros (no copies)."""
    h = hashlib.blake2b(digest_size=32)
    h.update(buf[:_DIGEST_AT])
    h.update(bytes(32))
    h.update(buf[_DIGEST_AT + 32 : data_offset])
    return h.digest()


class HeadPlan:
    """Everything before the data section for ``index`` and ``meta`` (the meta JSON without
    ``"format"``): sized up front (``data_offset`` bytes, so a writer can stream the images
    first), rendered once the offsets and checksums are known."""

    def __init__(self, index: FolderIndex, meta: dict[str, Any]) -> None:
        self.n = len(index)
        po = np.asarray(index.path_offsets, dtype=np.int64)
        buf = np.asarray(index.path_bytes, dtype=np.uint8)
        self.path_offsets = po - po[0]
        self.paths = buf[int(po[0]) : int(po[-1])]
        self.labels = index.targets
        # Names that are not valid UTF-8 on disk come from os.scandir as surrogate escapes: keep their bytes.
        self.meta = json.dumps({"format": FORMAT_NAME, **meta}, ensure_ascii=False, sort_keys=True).encode(
            "utf-8", "surrogateescape"
        )
        self.index_offset = align(HEADER_SIZE + len(self.meta), 8)
        self.pos, end = index_layout(self.n, self.index_offset, len(self.paths))
        self.data_offset = align(end, ALIGNMENT)

    def render(self, offsets: np.ndarray, crc32: np.ndarray) -> bytearray:
        """The bytes ``[0, data_offset)`` of the pack, digest included."""
        head = bytearray(self.data_offset)
        head[HEADER_SIZE : HEADER_SIZE + len(self.meta)] = self.meta
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
        sizes = (self.n, len(self.meta), self.index_offset, len(self.paths), self.data_offset, data_len)
        fields = (MAGIC, FORMAT_VERSION, HEADER_SIZE, *sizes)
        HEADER.pack_into(head, 0, *fields, bytes(32))
        HEADER.pack_into(head, 0, *fields, header_digest(memoryview(head), self.data_offset))
        return head


class PackView:
    """Validated, zero-copy views of a pack image in ``buf`` (a file map or a shared segment),
    named ``name`` in errors; ``verify`` checks the digest of header and index, ``expect_digest``
    is the one it must have (re-attaching). ``PackError`` says what is wrong and what to do.

    Attributes:
        index: The original relative paths, labels and class list (a FolderIndex over the buffer).
        offsets, labels, crc32: The index arrays (views of the buffer).
        data: The data section as a ``uint8`` array (not checked: read samples with :meth:`get_bytes`).
        meta, digest, nbytes, data_offset, name: From the header.
    """

    def __init__(
        self,
        buf: Any,
        name: str,
        verify: bool = True,
        expect_digest: bytes | None = None,
        check_crc: bool = True,
    ) -> None:
        mv = memoryview(buf)
        size = mv.nbytes
        if size < HEADER.size:
            if bytes(mv[: min(8, size)]) != MAGIC[: min(8, size)] or size == 0:
                raise PackError(
                    f"{name} is not a fastload pack file ({size} bytes, no pack header). {REBUILD_HINT}"
                )
            raise PackError(
                f"{name} is truncated: it has {size} bytes, "
                f"less than the {HEADER.size}-byte pack header. {RECOPY_HINT}"
            )
        magic, version, header_size, n, meta_len, index_offset, path_bytes, data_offset, data_len, digest = (
            HEADER.unpack_from(mv, 0)
        )
        if magic != MAGIC:
            raise PackError(
                f"{name} is not a fastload pack file: it starts with {bytes(magic)!r}, "
                f"a pack starts with {MAGIC!r}. {REBUILD_HINT}"
            )
        if version != FORMAT_VERSION:
            raise PackError(
                f"{name} has pack format version {version}, "
                f"but this fastload reads version {FORMAT_VERSION}. "
                "Install the fastload that wrote it, "
                "or rebuild the pack with this one (python -m fastload pack ROOT OUT)."
            )
        pos, index_end = index_layout(n, index_offset, path_bytes)
        if (
            header_size != HEADER_SIZE
            or index_offset < HEADER_SIZE + meta_len
            or index_offset % 8
            or data_offset % ALIGNMENT
            or data_offset < index_end
        ):
            raise PackError(f"{name} has a corrupt pack header (inconsistent section offsets). {RECOPY_HINT}")
        if size < data_offset:
            raise PackError(
                f"{name} is truncated (or its header is damaged): "
                f"the header and index need {data_offset} bytes but it has {size}. " + RECOPY_HINT
            )
        if expect_digest is not None and digest != expect_digest:
            raise PackError(
                f"{name} has changed since it was opened (its header digest differs). "
                "Recreate the dataset from the new file."
            )
        if verify and header_digest(mv, data_offset) != digest:
            raise PackError(
                f"{name} is corrupt: the checksum of its header and index does not match. " + RECOPY_HINT
            )
        if size != data_offset + data_len:
            what = (
                "is truncated"
                if size < data_offset + data_len
                else "has unexpected bytes after its data section"
            )
            raise PackError(
                f"{name} {what}: the header says {data_offset + data_len} bytes but it has {size}. "
                f"The copy or the write was interrupted. {RECOPY_HINT}"
            )
        try:
            meta = json.loads(
                bytes(mv[HEADER_SIZE : HEADER_SIZE + meta_len]).decode("utf-8", "surrogateescape")
            )
            if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
                raise ValueError(f"format is {meta.get('format') if isinstance(meta, dict) else None!r}")
            classes = ClassIndex(meta["classes"])
        except (ValueError, KeyError, TypeError) as e:
            raise PackError(f"{name} has an unreadable meta section ({e}). {REBUILD_HINT}") from None

        def arr(key: str, dtype: str, count: int) -> np.ndarray:
            return np.frombuffer(buf, dtype=dtype, count=count, offset=pos[key])

        offsets = arr("offsets", "<i8", n + 1)
        path_offsets = arr("path_offsets", "<i8", n + 1)
        for what, o, end in (
            ("sample offsets", offsets, data_len),
            ("path offsets", path_offsets, path_bytes),
        ):
            if o[0] != 0 or o[-1] != end or not bool((o[1:] >= o[:-1]).all()):
                raise PackError(f"{name} has corrupt {what} in its index. {RECOPY_HINT}")
        labels = arr("labels", "<i8", n)
        try:
            self.index = FolderIndex.from_buffers(
                str(meta.get("root", "")), arr("paths", "u1", path_bytes), path_offsets, labels, classes
            )
        except ValueError as e:
            raise PackError(f"{name} has a corrupt index ({e}). {REBUILD_HINT}") from None
        self.name = name
        self._checked: np.ndarray | None = None
        self.meta = meta
        self.digest = bytes(digest)
        self.nbytes = size
        self.data_offset = data_offset
        self.offsets = offsets
        self.check_crc = check_crc
        self.labels = self.index.targets
        self.crc32 = arr("crc32", "<u4", n)
        self.data = np.frombuffer(buf, dtype=np.uint8, count=data_len, offset=data_offset)
        self._data_mv: memoryview | None = mv[data_offset : data_offset + data_len]
        mv.release()

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def get_bytes(self, i: int) -> memoryview:
        """Sample ``i`` (negative counts from the end) as a read-only view of the buffer; with
        ``check_crc``, :class:`CorruptSampleError` if it does not match the sample's CRC-32."""
        j, data = self._sample(i)
        checked = self._checked
        if checked is not None and not checked[j]:
            crc = zlib.crc32(data)
            if crc != int(self.crc32[j]):
                raise self.corrupt_sample(j, crc)
            checked[j] = True  # (a race between threads only checks a sample twice)
        return data

    def slices(self, indices: np.ndarray) -> ByteSlices:
        """Samples ``indices`` (non-negative, in range) as :class:`ByteSlices`, not checked."""
        j = np.asarray(indices, dtype=np.int64)
        return ByteSlices(self.data, self.offsets[j].astype(np.int64), self.offsets[j + 1].astype(np.int64))

    def all_checked(self, indices: np.ndarray) -> bool:
        """Whether :meth:`get_bytes` of every sample in ``indices`` (non-negative) checks nothing
        more: ``check_crc`` is off, or each was checked already (each read is then a slice)."""
        checked = self._checked
        return checked is None or bool(checked[indices].all())

    @property
    def check_crc(self) -> bool:
        """Whether :meth:`get_bytes` checks a sample's CRC-32 the first time this process reads it
        (setting it, even to its current value, forgets which samples were checked)."""
        return self._checked is not None

    @check_crc.setter
    def check_crc(self, value: bool) -> None:
        self._checked = np.zeros(len(self.offsets) - 1, dtype=np.bool_) if value else None

    def _sample(self, i: int) -> tuple[int, memoryview]:
        """``(index, bytes)`` of sample ``i`` (negative counts from the end), not checked."""
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
        return j, mv[self.offsets[j] : self.offsets[j + 1]]

    def corrupt_sample(self, i: int, crc: int) -> CorruptSampleError:
        """The error for sample ``i`` whose bytes have the CRC-32 ``crc`` (not the recorded one)."""
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        return CorruptSampleError(
            f"sample {i} ({self.index.relpath(i)!r}) of {self.name} is corrupt: "
            f"its CRC-32 is {crc:08x}, the index says {int(self.crc32[i]):08x} "
            f"({end - start} bytes at offset {self.data_offset + start}). {RECOPY_HINT}"
        )

    def verify(self, advance: Callable[[int], object] | None = None) -> None:
        """Checks every sample's CRC-32 against the index (:class:`CorruptSampleError` names the
        first corrupt one), calling ``advance(1)`` after each."""
        for i in range(len(self)):
            _, data = self._sample(i)
            crc = zlib.crc32(data)
            if crc != int(self.crc32[i]):
                raise self.corrupt_sample(i, crc)
            if advance is not None:
                advance(1)

    def release(self) -> None:
        """Drops every view of the buffer held here (so that its owner can unmap it)."""
        if self._data_mv is not None:
            self._data_mv.release()
        self._data_mv = None
        self._checked = None
        for attr in ("index", "offsets", "labels", "crc32", "data"):
            self.__dict__.pop(attr, None)
