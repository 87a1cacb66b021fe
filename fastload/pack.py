"""The pack file: a whole image split in one memory-mappable file.

A pack holds the encoded images of a :class:`~fastload.folder.FolderIndex` back to back, behind a
small header and index (the layout of :mod:`fastload._packformat`, shared with the RAM segment of
:mod:`fastload.memory`): memory-mapped (``get_bytes(i)`` is a zero-copy slice; every process shares
the page cache), opened in time proportional to the index. Each sample is checked against its
CRC-32 the first time a process reads it (:class:`CorruptSampleError` instead of wrong pixels).

Example:
    >>> from fastload.folder import scan_folder
    >>> from fastload.pack import write_pack, open_pack
    >>> summary = write_pack(scan_folder("imagenet/train"), "train.fastpack")
    >>> with open_pack("train.fastpack") as pack:
    ...     pack.index.relpath(0), int(pack.labels[0])
    ('n01440764/n01440764_10026.JPEG', 0)

Command line: ``python -m fastload pack ROOT OUT [--classes classes.json] [--max-side N] [--quality Q]``.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import io
import mmap
import os
import stat
import sys
import tempfile
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from PIL import Image

from ._checks import check_bool, check_int, check_optional_int
from ._packformat import (
    ALIGNMENT,
    FORMAT_VERSION,
    MAGIC,
    REBUILD_HINT,
    CorruptSampleError,
    HeadPlan,
    PackError,
    PackView,
)
from .decode import DecodeError
from .device import available_cpus
from .folder import ClassIndex, FolderIndex, scan_folder

__all__ = [
    "ALIGNMENT",
    "FORMAT_VERSION",
    "MAGIC",
    "CorruptSampleError",
    "PackError",
    "PackFile",
    "PackIdentity",
    "PackSummary",
    "add_pack_parser",
    "bounded_map",
    "open_pack",
    "pack_command",
    "progress_bar",
    "write_pack",
]

T = TypeVar("T")
R = TypeVar("R")

#: What identifies one pack file across processes (see :attr:`PackFile.identity`).
PackIdentity = tuple[str, tuple[int, ...], bytes]


def progress_bar(total: int, desc: str, unit: str, progress: bool | None) -> Any:
    """A tqdm bar (``update``/``close``), disabled unless ``progress`` (``None``: for more than 500
    items when stderr is a terminal). ``unit="B"`` scales the counts (kB, MB, ...)."""
    if progress is None:
        progress = total > 500 and sys.stderr.isatty()
    from tqdm import tqdm  # type: ignore[import-untyped,unused-ignore]  # no stubs; reported once per run

    return tqdm(total=total, desc=desc, unit=unit, disable=not progress, unit_scale=unit == "B")


def bounded_map(
    executor: Executor | None, fn: Callable[[T], R], items: Iterable[T], max_in_flight: int
) -> Iterator[R]:
    """``map(fn, items)`` in order, with at most ``max_in_flight`` tasks submitted at a time
    (``Executor.map`` submits all at once); in the calling thread when ``executor`` is ``None``."""
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


class PackFile:
    """An open pack file, memory-mapped read-only. Use :func:`open_pack` to open one.

    Attributes:
        index: A :class:`~fastload.folder.FolderIndex` of the original relative paths, labels and
            class list (its ``root`` is where the images were when the pack was built).
        offsets: ``int64[n + 1]``; sample ``i`` is ``data[offsets[i]:offsets[i + 1]]``.
        labels: ``int64[n]`` (the same array as ``index.targets``).
        data: The data section as a read-only ``uint8`` array backed by the map (no copy).
        meta: The header's JSON (``classes``, ``root``, ``max_side``, ``quality``).

    Pickling a ``PackFile`` pickles its path: the receiving process maps the same file after a
    cheap check that it is still the same file.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        check_crc: bool = True,
        _expect: tuple[tuple[int, ...], bytes] | None = None,
    ) -> None:
        check_bool(check_crc, "check_crc")
        self.path = os.fspath(path)
        self._abspath = os.path.abspath(self.path)  # for pickling: the receiver may have another cwd
        name = repr(self.path)
        fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise PackError(
                    f"{name} is not a regular file, so it is not a fastload pack file. {REBUILD_HINT}"
                )
            if st.st_size == 0:
                raise PackError(f"{name} is empty: it is not a fastload pack file. {REBUILD_HINT}")
            mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        self._stat: tuple[int, int, int, int] = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        verify, digest = True, None
        if _expect is not None:  # re-opened from a pickle: the same file is not hashed again
            digest = _expect[1]
            verify = tuple(_expect[0]) != self._stat
        try:
            self._view: PackView | None = PackView(
                mm, name, verify=verify, expect_digest=digest, check_crc=check_crc
            )
        except BaseException:
            with contextlib.suppress(BufferError):  # the traceback still holds views: unmapped with them
                mm.close()
            raise
        self._mm: mmap.mmap | None = mm

    @classmethod
    def reopen(cls, identity: PackIdentity, check_crc: bool = True) -> PackFile:
        """Opens the file that :attr:`identity` (from this or another process) describes: cheap
        when it is unchanged, ``PackError`` when its header digest differs."""
        path, stat_key, digest = identity
        return cls(path, check_crc=check_crc, _expect=(tuple(stat_key), digest))

    def _require(self) -> PackView:
        if self._view is None:
            raise ValueError(f"I/O operation on closed pack {self.path!r}")
        return self._view

    @property
    def closed(self) -> bool:
        return self._view is None

    @property
    def check_crc(self) -> bool:
        """Whether :meth:`get_bytes` checks each sample's CRC-32 the first time this process reads it
        (default ``True``; setting it forgets which samples were checked)."""
        return self._require().check_crc

    @check_crc.setter
    def check_crc(self, value: bool) -> None:
        self._require().check_crc = check_bool(value, "check_crc")

    @property
    def view(self) -> PackView:
        """The validated :class:`~fastload._packformat.PackView` of the map (``ValueError`` once closed)."""
        return self._require()

    @property
    def abspath(self) -> str:
        """The absolute path (as opened: other processes may have another working directory)."""
        return self._abspath

    @property
    def identity(self) -> PackIdentity:
        """``(absolute path, (st_dev, st_ino, st_size, st_mtime_ns), header digest)``: enough for
        another process to re-open the same file with :meth:`reopen` and to notice if it changed."""
        return (self._abspath, self._stat, self._require().digest)

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
        """The encoded bytes of sample ``i`` (negative counts from the end): a read-only
        ``memoryview`` of the map (no copy); :class:`CorruptSampleError` if its CRC-32 fails."""
        return self._require().get_bytes(i)

    def will_need(self, starts: np.ndarray, stops: np.ndarray) -> None:
        """Asks the kernel to read data-section ranges ``[starts[k], stops[k])`` into the page
        cache now (``madvise(MADV_WILLNEED)``, overlapping ranges merged; returns at once)."""
        mm = self._mm
        advice = getattr(mmap, "MADV_WILLNEED", None)
        if mm is None or advice is None or len(starts) == 0:
            return
        base = self._require().data_offset
        a = np.asarray(starts, dtype=np.int64) + base
        b = np.asarray(stops, dtype=np.int64) + base
        order = np.argsort(a, kind="stable")
        a, b = (a[order] // mmap.PAGESIZE) * mmap.PAGESIZE, b[order]
        reach = np.maximum.accumulate(b)
        new_run = np.ones(len(a), dtype=bool)
        new_run[1:] = a[1:] > reach[:-1]  # a range that starts past everything before it
        firsts = np.flatnonzero(new_run)
        ends = np.append(firsts[1:], len(a)) - 1
        for lo, hi in zip(a[firsts].tolist(), reach[ends].tolist(), strict=True):
            if hi > lo:
                mm.madvise(advice, lo, hi - lo)

    def evict(self, starts: np.ndarray | None = None, stops: np.ndarray | None = None) -> None:
        """Drops data-section byte ranges (default: all of it) from the page cache, e.g. to measure
        cold-cache epochs (no root needed; pages another process maps stay cached)."""
        mm = self._mm
        view = self._require()
        if starts is None or stops is None:
            starts, stops = np.zeros(1, dtype=np.int64), np.array([len(view.data)], dtype=np.int64)
        base = view.data_offset
        fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            for a, b in zip(np.asarray(starts).tolist(), np.asarray(stops).tolist(), strict=True):
                lo = (base + a) // mmap.PAGESIZE * mmap.PAGESIZE
                hi = min(base + b, self.nbytes)
                if hi <= lo:
                    continue
                if mm is not None and hasattr(mmap, "MADV_DONTNEED"):
                    mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, lo, hi - lo, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    def verify(self, progress: bool | None = None) -> None:
        """Checks every sample's CRC-32 (reads the whole file); :class:`CorruptSampleError` names
        the first corrupt sample."""
        view = self._require()
        bar = progress_bar(len(view), "verify", "img", progress)
        try:
            view.verify(bar.update)
        finally:
            bar.close()

    def close(self) -> None:
        """Unmaps the file. Views handed out earlier (``get_bytes``, ``data``) stay valid: the map is
        released when the last of them is dropped."""
        if self._view is not None:
            self._view.release()
            self._view = None
        if self._mm is not None:
            with contextlib.suppress(BufferError):  # views still exported: the map goes with the last
                self._mm.close()
            self._mm = None

    def __enter__(self) -> PackFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> tuple[Any, ...]:
        return (PackFile.reopen, (self.identity, self.check_crc))

    def __repr__(self) -> str:
        if self._view is None:
            return f"PackFile({self.path!r}, closed)"
        view = self._view
        return (
            f"PackFile({self.path!r}, samples={len(view)}, classes={len(view.index.classes)}, "
            f"data={view.data.nbytes / 1e6:.1f} MB)"
        )


def open_pack(path: str | os.PathLike[str], *, check_crc: bool = True) -> PackFile:
    """Opens and validates a pack file (header, checksum of header and index, size), memory-mapped;
    :class:`PackError` (a ``ValueError``) says what is wrong and what to do.

    Example:
        >>> with open_pack("val.fastpack") as pack:
        ...     len(pack), pack.index.classes[0]
        (50000, 'n01440764')
    """
    return PackFile(path, check_crc=check_crc)


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


def _shrink(data: bytes, max_side: int, quality: int) -> bytes | None:
    """``data`` re-encoded as an RGB JPEG whose longer side is ``max_side``; ``None`` if it is already
    small enough."""
    src = Image.open(io.BytesIO(data))
    w, h = src.size
    if max(w, h) <= max_side:
        return None
    scale = max_side / max(w, h)
    size = (max(1, round(w * scale)), max(1, round(h * scale)))
    if src.format in ("JPEG", "MPO"):
        src.draft("RGB", size)  # DCT-domain downscale to >= size: much faster than a full decode
    img = src.convert("RGB").resize(size, Image.Resampling.LANCZOS)
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


_WRITE_HINTS = {
    errno.ENOSPC: "Free space on that file system, or write the pack somewhere else.",
    errno.EDQUOT: "Free space within your quota, or write the pack somewhere else.",
    errno.EFBIG: "The process may not write files this large (ulimit -f): raise the limit, "
    "or pack a smaller split.",
}


def write_pack(
    index: FolderIndex,
    out_path: str | os.PathLike[str],
    max_side: int | None = None,
    quality: int = 90,
    num_workers: int | None = None,
    progress: bool | None = None,
) -> PackSummary:
    """Writes the samples of ``index`` into one pack file, read (and re-encoded) in parallel and
    written in index order into a temporary file renamed to ``out_path`` (``*.fastpack`` by
    convention) when complete.

    Args:
        max_side: Re-encode images whose longer side exceeds this as RGB JPEG with that longer side
            (like FFCV's ``max_resolution``: 1600x1200 becomes 512x384 for 512); other images (all
            with ``None``) are stored as they are.
        num_workers: Parallel readers (processes when re-encoding); default: the available CPUs,
            ``0``: the calling process.
        progress: Show a tqdm bar (default: for more than 500 files when stderr is a terminal).

    Raises:
        OSError: Naming the sample that cannot be read, or the pack file that cannot be written
            (the file under ``out_path``, if any, is then unchanged).
        fastload.decode.DecodeError: With ``max_side``, naming a sample that cannot be decoded.
    """
    if not isinstance(index, FolderIndex):
        raise TypeError(
            f"index should be a FolderIndex (e.g. scan_folder(root)), but got {type(index).__name__}"
        )
    check_optional_int(max_side, "max_side", low=1)
    check_int(quality, "quality", low=1, high=100)
    check_optional_int(num_workers, "num_workers", low=0)
    out = os.path.abspath(os.fspath(out_path))
    if os.path.isdir(out):
        raise ValueError(f"out_path should be a file name, but {out!r} is a directory")
    meta = {"classes": list(index.classes), "root": index.root, "max_side": max_side}
    plan = HeadPlan(index, {**meta, "quality": quality if max_side is not None else None})
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
        raise OSError(
            e.errno,
            f"cannot create the pack file {out!r}: {e.strerror}. "
            + _WRITE_HINTS.get(e.errno or 0, "Write the pack to a folder you can write to."),
        ) from None
    bar = progress_bar(n, f"pack {os.path.basename(out)}", "img", progress)
    try:
        with os.fdopen(fd, "wb") as f:
            f.seek(plan.data_offset)  # room for the header and index, written last
            pos = 0
            i = 0
            for results in bounded_map(executor, _load_chunk, tasks, max_in_flight=4 * max(1, workers)):
                for data, crc, src, was_reencoded, err, msg in results:
                    if err == "read":
                        raise OSError(f"cannot read sample {i} ({paths[i]!r}): {msg}")
                    if err == "decode":
                        raise DecodeError(
                            f"cannot decode sample {i} ({paths[i]!r}) to re-encode it "
                            f"for max_side={max_side}: {msg}. Remove or replace the file, "
                            "or pack without max_side to store its bytes unchanged."
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
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(e, OSError) and e.errno is not None:  # (unreadable samples have no errno)
            raise OSError(
                e.errno,
                f"cannot write the pack file {out!r}: {e.strerror} (nothing was left under that name). "
                + _WRITE_HINTS.get(e.errno, "Write the pack somewhere else."),
            ) from e
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
    """Adds the ``pack`` command (``func=pack_command``) to an ``argparse`` sub-parser set."""
    p = subparsers.add_parser(
        "pack",
        help="pack an image folder into one memory-mappable file",
        description=(
            "Packs the images of ROOT/<class>/... into one file for fastload.InMemoryImageFolder.from_pack."
        ),
    )
    p.add_argument("root", help="the split's folder, e.g. imagenet/train")
    p.add_argument("out", help="the pack file to write, e.g. train.fastpack")
    p.add_argument(
        "--classes",
        metavar="JSON",
        help=(
            "class list (JSON from ClassIndex.save, or a JSON list of names); default: the subfolders of ROOT"
        ),
    )
    p.add_argument(
        "--max-side",
        type=int,
        metavar="N",
        help=(
            "re-encode images whose longer side exceeds N pixels (RGB JPEG at --quality); "
            "default: store the files unchanged"
        ),
    )
    p.add_argument(
        "--quality", type=int, default=90, metavar="Q", help="JPEG quality of re-encoded images (default: 90)"
    )
    p.add_argument(
        "--workers", type=int, metavar="N", help="parallel readers/encoders (default: the available CPUs)"
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        help="show a progress bar (default: on a terminal)",
    )
    p.set_defaults(func=pack_command)
    return p


def pack_command(args: argparse.Namespace) -> int:
    """Runs ``python -m fastload pack`` with parsed arguments; returns the exit status."""
    index = scan_folder(args.root, classes=args.classes)
    summary = write_pack(index, args.out, args.max_side, args.quality, args.workers, args.progress)
    shrunk = (
        f", {summary.reencoded} re-encoded to max side {args.max_side}" if args.max_side is not None else ""
    )
    print(
        f"wrote {summary.path}: {summary.num_samples} samples, {len(index.classes)} classes, "
        f"{summary.data_bytes / 1e6:.1f} MB of images (source {summary.source_bytes / 1e6:.1f} MB{shrunk})"
    )
    return 0
