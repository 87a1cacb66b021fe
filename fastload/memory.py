"""``InMemoryImageFolder``: a whole split in RAM, once, shared by every loader worker.

A Python list of ``bytes`` is copied into ``fork``-ed workers page by page as reading it writes
reference counts (pytorch issue 13246), and pickled whole into every ``spawn`` worker. Here the
split is one pack image (the layout of :mod:`fastload._packformat`) in one shared memory segment,
mapped read-only; pickling sends a small handle that the receiving process maps again. The segment
is a sealed ``memfd`` (Linux: no ``/dev/shm`` entry, freed by the kernel even after a ``SIGKILL``;
attached through ``/proc/<owner pid>/fd/<fd>``), else a file in ``/dev/shm`` that the owner
deletes (``multiprocessing.shared_memory`` is not used: before Python 3.13 each attaching
process's resource tracker unlinks it, bpo-39959). ``from_pack(path, in_memory=False)`` serves a
pack's memory map instead. See docs/memory.md.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import mmap
import os
import re
import tempfile
import weakref
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ._checks import check_bool, check_choice, check_int, check_optional_int, read_error
from ._packformat import HeadPlan, PackView
from ._slices import ByteSlices
from .device import available_cpus
from .folder import ClassIndex, FolderIndex, scan_folder
from .imagefolder import EncodedImageDataset
from .pack import PackFile, bounded_map, progress_bar

__all__ = ["SHUFFLE_ORDERS", "InMemoryImageFolder", "available_memory"]

#: The values of ``InMemoryImageFolder.from_pack(shuffle_order=...)``.
SHUFFLE_ORDERS = ("auto", "uniform", "blockwise")

_log = logging.getLogger(__name__)

#: Where new segments are created: ``None`` picks ``"memfd"`` when it works, else ``"file"``.
SEGMENT_BACKEND: str | None = None

_MiB = 1 << 20


def _cgroup_headroom() -> int | None:
    """Bytes left under this process's cgroup memory limit (containers), or ``None`` when unlimited."""
    for limit_path, usage_path in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # cgroup v2
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),  # v1
    ):
        try:
            with open(limit_path) as f:
                limit = f.read().strip()
            with open(usage_path) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:
            return None
        return max(0, int(limit) - usage)
    return None


def available_memory() -> int:
    """Bytes of RAM available to new allocations: psutil's ``available``, capped by a container's
    cgroup memory limit (inside Docker/Kubernetes ``/proc/meminfo`` shows the host's memory)."""
    import psutil  # type: ignore[import-untyped,unused-ignore]  # no stubs; reported once per run

    avail = int(psutil.virtual_memory().available)
    headroom = _cgroup_headroom()
    return avail if headroom is None else min(avail, headroom)


def _fmt(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _check_fits(need: int, what: str) -> None:
    """Raises ``MemoryError`` unless ``need`` bytes plus a margin (10%, at least 256 MiB) are available."""
    margin = max(need // 10, 256 * _MiB)
    avail = available_memory()
    if need + margin > avail:
        raise MemoryError(
            f"{what} needs {_fmt(need)} of RAM (plus a margin of {_fmt(margin)}), "
            f"but only {_fmt(avail)} is available. "
            "Shrink the images when packing (python -m fastload pack ROOT OUT --max-side 512), "
            "serve a pack from its memory map (InMemoryImageFolder.from_pack(path, in_memory=False)), "
            "or read from disk (fastload.ImageFolder)."
        )


# --------------------------------------------------------------------------------- shared segments


@functools.cache
def _memfd_works() -> bool:
    """Whether a memfd can be created and re-opened through ``/proc`` here (checked once)."""
    if not hasattr(os, "memfd_create"):
        return False
    try:
        fd = os.memfd_create("fastload-probe", os.MFD_CLOEXEC)
    except OSError:
        return False
    try:
        os.close(os.open(f"/proc/{os.getpid()}/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC))
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _backend() -> str:
    if SEGMENT_BACKEND is None:
        return "memfd" if _memfd_works() else "file"
    if SEGMENT_BACKEND not in ("memfd", "file"):
        raise ValueError(
            f"fastload.memory.SEGMENT_BACKEND should be None, 'memfd' or 'file', but got {SEGMENT_BACKEND!r}"
        )
    return SEGMENT_BACKEND


class _Resources:
    """The OS resources behind one mapping; released by :func:`_release` (never references a dataset)."""

    __slots__ = ("mm", "fd", "path", "owner_pid", "pack")

    def __init__(self, fd: int | None = None, path: str | None = None, pack: PackFile | None = None) -> None:
        self.mm: mmap.mmap | None = None
        self.fd = fd
        self.path = path
        self.owner_pid = os.getpid()
        self.pack = pack


def _release(res: _Resources) -> None:
    """Deletes the segment's name (owner only), closes its descriptor and unmaps it (a map with
    views still handed out is released with the last of them)."""
    if res.path is not None and res.owner_pid == os.getpid():
        with contextlib.suppress(FileNotFoundError):
            os.unlink(res.path)
        res.path = None
    if res.fd is not None:
        with contextlib.suppress(OSError):
            os.close(res.fd)
        res.fd = None
    if res.pack is not None:
        res.pack.close()
        res.pack = None
    if res.mm is not None:
        with contextlib.suppress(BufferError):  # views still exist: unmapped when the last one goes
            res.mm.close()
        res.mm = None


def _label(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", os.path.basename(os.path.normpath(text)) or "data")[:48]


def _create_segment(size: int, label: str) -> _Resources:
    """A new writable segment of ``size`` bytes (not mapped yet)."""
    if _backend() == "memfd":
        flags = os.MFD_CLOEXEC | getattr(os, "MFD_ALLOW_SEALING", 0)
        res = _Resources(fd=os.memfd_create(f"fastload-{label}", flags))
    else:
        folder = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        fd, path = tempfile.mkstemp(prefix=f"fastload-{label}-", suffix=".seg", dir=folder)
        res = _Resources(fd=fd, path=path)
    try:
        os.ftruncate(res.fd, size)  # type: ignore[arg-type]
    except BaseException:
        _release(res)
        raise
    return res


def _pwrite_all(fd: int, data: bytes | bytearray | memoryview, offset: int) -> None:
    view = memoryview(data)
    try:
        while view:
            written = os.pwrite(fd, view, offset)
            view = view[written:]
            offset += written
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.ENOMEM):
            raise MemoryError(
                f"ran out of shared memory while loading the dataset ({e.strerror}). "
                "With the file backend the segment lives in /dev/shm: "
                "enlarge it (docker run --shm-size=...) or use in_memory=False."
            ) from e
        raise


def _finish_segment(res: _Resources, size: int) -> mmap.mmap:
    """Seals a filled segment read-only and maps it (pages pre-faulted, so its RSS is honest)."""
    assert res.fd is not None
    if res.path is None:
        try:
            import fcntl

            seals = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
            fcntl.fcntl(res.fd, fcntl.F_ADD_SEALS, seals)
        except (ImportError, AttributeError, OSError):
            pass  # sealing is a safety net (no process can then change or shrink it), not a requirement
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    res.mm = mmap.mmap(res.fd, size, flags=flags, prot=mmap.PROT_READ)
    return res.mm


def _handle_of(res: _Resources, size: int, digest: bytes) -> tuple[Any, ...]:
    assert res.fd is not None
    st = os.fstat(res.fd)
    if res.path is None:
        return ("memfd", os.getpid(), res.fd, st.st_dev, st.st_ino, size, digest)
    return ("file", res.path, st.st_dev, st.st_ino, size, digest)


class _Storage:
    """A validated pack image (``view``) plus what keeps it mapped, and how to find it again (``handle``)."""

    def __init__(self, view: PackView, handle: tuple[Any, ...], res: _Resources, in_memory: bool) -> None:
        self.view: PackView | None = view
        self.handle = handle
        self.in_memory = in_memory
        self.kind = handle[0]
        self.pack = res.pack  # the open pack file when served from its map (for read-ahead hints)
        self._finalizer = weakref.finalize(self, _release, res)

    def close(self) -> None:
        if self.view is not None:
            self.view.release()
            self.view = None
        self._finalizer()


def _attach(handle: tuple[Any, ...]) -> _Storage:
    """Maps the storage that ``handle`` (from another process, or this one) describes."""
    kind = handle[0]
    if kind == "pack":
        pack = PackFile.reopen(handle[1:])
        return _Storage(pack.view, handle, _Resources(pack=pack), in_memory=False)
    if kind == "memfd":
        _, pid, fd, dev, ino, size, digest = handle
        where = f"/proc/{pid}/fd/{fd}"
        owner = f"process {pid}"
    elif kind == "file":
        _, where, dev, ino, size, digest = handle
        owner = "the process that created it"
    else:
        raise ValueError(f"unknown InMemoryImageFolder handle kind {kind!r}")
    gone = (
        f"cannot attach to the shared memory of an InMemoryImageFolder ({where}): "
        f"{owner} has closed the dataset or exited. "
        "Keep the dataset open in the process that created it while workers start."
    )
    try:
        fd2 = os.open(where, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise RuntimeError(gone) from None
    except PermissionError as e:
        raise RuntimeError(
            f"cannot attach to the shared memory of an InMemoryImageFolder ({where}): {e.strerror}. "
            "Workers must run as the same user as the process that created the dataset "
            "(and /proc must not be mounted with hidepid)."
        ) from None
    res = _Resources()
    try:
        st = os.fstat(fd2)
        if (st.st_dev, st.st_ino, st.st_size) != (dev, ino, size):
            raise RuntimeError(gone)
        res.mm = mmap.mmap(fd2, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd2)
    try:
        view = PackView(res.mm, f"the shared memory of an InMemoryImageFolder ({where})", False, digest)
    except BaseException:
        _release(res)
        raise
    return _Storage(view, handle, res, in_memory=True)


def _load_folder(index: FolderIndex, num_threads: int | None, progress: bool | None) -> _Storage:
    """Reads every file of ``index`` into a new segment laid out as a pack image."""
    n = len(index)
    paths = index.paths
    threads = num_threads if num_threads is not None else min(32, available_cpus() + 4)
    chunk = 64
    executor: ThreadPoolExecutor | None = None
    if threads > 0 and n > chunk:
        executor = ThreadPoolExecutor(threads, thread_name_prefix="fastload-load")

    def stat_chunk(start: int) -> list[int]:
        sizes = []
        for i in range(start, min(start + chunk, n)):
            try:
                sizes.append(os.stat(paths[i]).st_size)
            except OSError as e:
                raise read_error(e, i, paths[i]) from e
        return sizes

    try:
        sizes = [
            s
            for part in bounded_map(executor, stat_chunk, range(0, n, chunk), 4 * max(1, threads))
            for s in part
        ]
        offsets = np.zeros(n + 1, dtype=np.int64)
        if n:
            np.cumsum(sizes, out=offsets[1:])
        plan = HeadPlan(
            index, {"classes": list(index.classes), "root": index.root, "max_side": None, "quality": None}
        )
        total = plan.data_offset + int(offsets[-1])
        _check_fits(total, f"InMemoryImageFolder({index.root!r}) ({n} samples)")
        res = _create_segment(total, _label(index.root))
        try:
            fd = res.fd
            assert fd is not None
            crcs = np.zeros(n, dtype=np.uint32)

            def fill_chunk(start: int) -> int:
                stop = min(start + chunk, n)
                for i in range(start, stop):
                    path = paths[i]
                    try:
                        with open(path, "rb") as f:
                            data = f.read()
                    except OSError as e:
                        raise read_error(e, i, path) from e
                    if len(data) != offsets[i + 1] - offsets[i]:
                        raise OSError(
                            f"sample {i} ({path!r}) changed size while the dataset was loading; load it again"
                        )
                    crcs[i] = zlib.crc32(data)
                    _pwrite_all(fd, data, plan.data_offset + int(offsets[i]))
                return stop - start

            bar = progress_bar(n, f"load {_label(index.root)}", "img", progress)
            try:
                for done in bounded_map(executor, fill_chunk, range(0, n, chunk), 4 * max(1, threads)):
                    bar.update(done)
            finally:
                bar.close()
            head = plan.render(offsets, crcs)
            _pwrite_all(fd, head, 0)
            mm = _finish_segment(res, total)
            view = PackView(mm, f"the in-memory copy of {index.root!r}", verify=False)
            handle = _handle_of(res, total, view.digest)
        except BaseException:
            # stop the writers first: none may write to the fd number once it is closed (and reused)
            if executor is not None:
                executor.shutdown(wait=True, cancel_futures=True)
                executor = None
            _release(res)
            raise
    finally:
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)
    return _Storage(view, handle, res, in_memory=True)


def _copy_file(path: str, fd: int, size: int, advance: Callable[[int], Any]) -> None:
    """Copies the first ``size`` bytes of ``path`` to ``fd`` (with ``sendfile`` where it works)."""
    use_sendfile = hasattr(os, "sendfile")
    with open(path, "rb") as src:
        done = 0
        while done < size:
            step = min(size - done, 64 * _MiB)
            if use_sendfile:
                try:
                    os.lseek(fd, done, os.SEEK_SET)
                    sent = os.sendfile(fd, src.fileno(), done, step)
                except OSError as e:
                    if e.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                        raise
                    use_sendfile = False
                    continue
            else:
                data = os.pread(src.fileno(), step, done)
                _pwrite_all(fd, data, done)
                sent = len(data)
            if sent == 0:
                raise OSError(f"{path!r} became shorter while it was loading; load it again")
            done += sent
            advance(sent)


def _copy_pack(pack: PackFile, progress: bool | None) -> _Storage:
    """Copies a validated pack file into a new segment (``sendfile``: no copy through user space)."""
    size = pack.nbytes
    _check_fits(size, f"InMemoryImageFolder.from_pack({pack.path!r})")
    res = _create_segment(size, _label(pack.path))
    try:
        fd = res.fd
        assert fd is not None
        bar = progress_bar(
            size,
            f"load {_label(pack.path)}",
            "B",
            progress if progress is not None else (None if size > 1 << 30 else False),
        )
        try:
            _copy_file(pack.path, fd, size, bar.update)
        finally:
            bar.close()
        mm = _finish_segment(res, size)
        view = PackView(mm, f"the in-memory copy of {pack.path!r}", verify=False, expect_digest=pack.digest)
        handle = _handle_of(res, size, view.digest)
    except OSError as e:
        _release(res)
        if e.errno in (errno.ENOSPC, errno.ENOMEM):
            raise MemoryError(
                f"ran out of shared memory while loading {pack.path!r} ({e.strerror}); use in_memory=False"
            ) from e
        raise
    except BaseException:
        _release(res)
        raise
    return _Storage(view, handle, res, in_memory=True)


# ----------------------------------------------------------------------------------------- dataset


class InMemoryImageFolder(EncodedImageDataset):
    """An image split held once in shared memory (or served from a pack's memory map).

    A drop-in for :class:`fastload.ImageFolder` (same attributes and items): every encoded file is
    read once into one buffer; ``get_bytes(i)`` is a zero-copy ``memoryview`` of it and
    ``pickle.dumps(dataset)`` a small handle that maps the same memory in any worker process. The
    memory is released when the dataset is closed or collected, and when the process exits.

    Args:
        root_or_index: The split's folder (scanned with :func:`~fastload.folder.scan_folder`) or a
            ready :class:`~fastload.folder.FolderIndex`.
        num_threads: Threads reading files (default: CPUs + 4, at most 32; 0 reads in this thread).
        progress: Show a tqdm bar while loading (default: for more than 500 files on a terminal).
        check_crc: Check each sample against the CRC-32 taken when it was loaded, the first time
            a process reads it (settable).

    Raises:
        MemoryError: Before reading anything, if the data (plus a 10% margin, at least 256 MiB) does
            not fit in the available RAM; the message says what to do instead.

    Example:
        >>> ds = InMemoryImageFolder("imagenet/val", classes=ClassIndex.load("classes.json"))
        >>> ds.classes[:2], ds.targets.dtype, bytes(ds.get_bytes(0)[:2])
        (['n01440764', 'n01443537'], dtype('int64'), b'\\xff\\xd8')
    """

    def __init__(
        self,
        root_or_index: str | os.PathLike[str] | FolderIndex,
        transform: Callable[..., Any] | None = None,
        target_transform: Callable[[int], Any] | None = None,
        classes: ClassIndex | Sequence[str] | str | os.PathLike[str] | None = None,
        *,
        num_threads: int | None = None,
        progress: bool | None = None,
        check_crc: bool = True,
    ) -> None:
        self.check_transforms(transform, target_transform)
        check_optional_int(num_threads, "num_threads", low=0)
        check_bool(check_crc, "check_crc")
        if isinstance(root_or_index, FolderIndex):
            if classes is not None:
                raise ValueError(
                    "classes is only used to scan a folder: "
                    "the FolderIndex passed as root_or_index already has its class list"
                )
            index = root_or_index
        elif isinstance(root_or_index, (str, os.PathLike)):
            index = scan_folder(root_or_index, classes=classes)
        else:
            raise TypeError(
                "root_or_index should be a folder path or a FolderIndex, "
                f"but got {type(root_or_index).__name__}"
            )
        self._setup(_load_folder(index, num_threads, progress), transform, target_transform, check_crc)

    @classmethod
    def from_pack(
        cls,
        path: str | os.PathLike[str],
        transform: Callable[..., Any] | None = None,
        target_transform: Callable[[int], Any] | None = None,
        in_memory: bool = True,
        *,
        progress: bool | None = None,
        shuffle_order: str = "auto",
        shuffle_block_bytes: int = 4 * _MiB,
        shuffle_window: int = 64,
        check_crc: bool = True,
    ) -> InMemoryImageFolder:
        """A dataset of a pack file written by :func:`fastload.pack.write_pack` (``python -m fastload pack``).

        Args:
            in_memory: ``True`` copies the file into a shared memory segment (checked against the
                available RAM first). ``False`` serves it from the file's memory map.
            progress: Show a tqdm bar while copying (default: for packs over 1 GiB on a terminal).
            shuffle_order: How fastload's samplers shuffle it: ``"uniform"`` (torch's ``randperm``);
                ``"blockwise"`` (FFCV's "quasi-random" order, :func:`fastload.sampler.blockwise_permutation`:
                an epoch reads a window of ``shuffle_window`` blocks of about ``shuffle_block_bytes``
                at a time; docs/memory.md); ``"auto"``: ``"blockwise"`` with ``in_memory=False``
                when the pack is larger than the available RAM (a warning says so), else ``"uniform"``.
            check_crc: Check each sample against the pack's CRC-32 the first time a process reads it.

        Raises:
            PackError: If the file is not a valid pack (the message says why and what to do).
            MemoryError: With ``in_memory=True``, if the pack does not fit in the available RAM.
        """
        cls.check_transforms(transform, target_transform)
        check_bool(in_memory, "in_memory")
        check_bool(check_crc, "check_crc")
        check_choice(shuffle_order, "shuffle_order", SHUFFLE_ORDERS)
        check_int(shuffle_block_bytes, "shuffle_block_bytes", low=1)
        check_int(shuffle_window, "shuffle_window", low=1)
        pack = PackFile(path)
        try:
            if in_memory:
                storage = _copy_pack(pack, progress)
                pack.close()
            else:
                handle = ("pack", *pack.identity)
                storage = _Storage(pack.view, handle, _Resources(pack=pack), in_memory=False)
        except BaseException:
            pack.close()
            raise
        self = cls.__new__(cls)
        self._setup(storage, transform, target_transform, check_crc)
        if shuffle_order == "auto":
            shuffle_order = "uniform"
            if not in_memory:
                avail = available_memory()
                if storage.pack is not None and storage.pack.nbytes > avail:
                    shuffle_order = "blockwise"
                    _log.warning(
                        "%s (%s) is larger than the available RAM (%s): shuffling it blockwise "
                        "(blocks of %s, %d blocks shuffled together) so that each epoch reads it "
                        "block by block; pass shuffle_order='uniform' for torch's uniform order",
                        os.fspath(path),
                        _fmt(storage.pack.nbytes),
                        _fmt(avail),
                        _fmt(shuffle_block_bytes),
                        shuffle_window,
                    )
        self._shuffle = (shuffle_order, int(shuffle_block_bytes), int(shuffle_window))
        return self

    def _setup(
        self,
        storage: _Storage,
        transform: Callable[..., Any] | None,
        target_transform: Callable[[int], Any] | None,
        check_crc: bool,
    ) -> None:
        assert storage.view is not None
        storage.view.check_crc = check_crc
        self._storage: _Storage | None = storage
        self._view: PackView | None = storage.view
        self._len = len(storage.view)
        self._nbytes = int(storage.view.data.nbytes)
        self._shuffle: tuple[str, int, int] = ("uniform", 4 * _MiB, 64)  # order, block bytes, window
        self._blocks: np.ndarray | None = None
        self._hinted: dict[int, None] = {}  # blocks hinted lately, oldest first
        super().__init__(storage.view.index.root, transform, target_transform)

    # -- ImageFolder's attributes (the rest come from EncodedImageDataset, through `index`)

    def _require(self) -> PackView:
        if self._view is None:
            raise ValueError("I/O operation on a closed InMemoryImageFolder")
        return self._view

    @property
    def index(self) -> FolderIndex:
        """The original relative paths, int64 targets and class list (views of the shared memory)."""
        return self._require().index

    @property
    def in_memory(self) -> bool:
        """``True`` when the data is in a shared memory segment, ``False`` when served from a pack's map."""
        return self._storage is not None and self._storage.in_memory

    @property
    def check_crc(self) -> bool:
        """Whether :meth:`get_bytes` checks each sample's CRC-32 the first time this process reads it
        (settable: forgets what was checked; pickled, so workers started afterwards follow)."""
        return self._require().check_crc

    @check_crc.setter
    def check_crc(self, value: bool) -> None:
        self._require().check_crc = check_bool(value, "check_crc")

    @property
    def nbytes(self) -> int:
        """Total size of the encoded images."""
        return self._nbytes

    @property
    def closed(self) -> bool:
        return self._view is None

    @property
    def pack(self) -> PackFile | None:
        """The open :class:`~fastload.pack.PackFile` when served from its map (``in_memory=False``),
        else ``None`` (e.g. for :meth:`~fastload.pack.PackFile.evict` in a cold-cache benchmark)."""
        storage = self._storage
        return None if storage is None or storage.in_memory else storage.pack

    @property
    def shuffle_order(self) -> str:
        """``"uniform"`` or ``"blockwise"``: how fastload's samplers shuffle it (see :meth:`from_pack`)."""
        return self._shuffle[0]

    @property
    def shuffle_window(self) -> int:
        """Blocks whose samples are shuffled together in the blockwise order."""
        return self._shuffle[2]

    @property
    def shuffle_blocks(self) -> np.ndarray | None:
        """With the blockwise order, ``int64[m + 1]``: the first sample of each block, then
        ``len(self)``; else ``None``.

        Example: samples of 3, 3, 3 and 5 MiB start at 0, 3, 6 and 9 MiB; with blocks of 4 MiB
        their block ids (start // 4 MiB) are ``0, 0, 1, 2``, so ``shuffle_blocks`` is ``[0, 2, 3, 4]``.
        """
        if self._shuffle[0] != "blockwise":
            return None
        if self._blocks is None:
            offsets = self._require().offsets
            block_of = offsets[:-1] // self._shuffle[1]
            changes = np.flatnonzero(np.diff(block_of)) + 1
            self._blocks = np.concatenate(([0], changes, [self._len])).astype(np.int64)
            if self._len == 0:
                self._blocks = np.zeros(1, dtype=np.int64)
        return self._blocks

    def will_need(self, indices: Sequence[int] | np.ndarray) -> None:
        """Hints the kernel to read these samples now (asynchronously), for a pack served from its
        map: with the blockwise order, their whole blocks, once each. A no-op for data in RAM."""
        storage = self._storage
        if storage is None or storage.pack is None or storage.in_memory or len(indices) == 0:
            return
        offsets = self._require().offsets
        idx = np.asarray(indices, dtype=np.int64)
        blocks = self.shuffle_blocks
        if blocks is None:
            starts, stops = offsets[idx], offsets[idx + 1]
        else:
            ids = np.unique(np.searchsorted(blocks, idx, side="right") - 1)
            fresh = [b for b in ids.tolist() if b not in self._hinted]
            if not fresh:
                return
            for b in fresh:
                self._hinted[b] = None
            while len(self._hinted) > 2 * self.shuffle_window:  # remember about two windows
                del self._hinted[next(iter(self._hinted))]
            ids = np.asarray(fresh, dtype=np.int64)
            starts, stops = offsets[blocks[ids]], offsets[blocks[ids + 1]]
        with contextlib.suppress(OSError, ValueError):  # a hint only: a failure must never fail loading
            storage.pack.will_need(starts, stops)

    def __len__(self) -> int:
        return self._len

    def get_bytes(self, i: int) -> memoryview:
        """The encoded file of sample ``i``: a read-only ``memoryview`` of the shared buffer (no copy);
        with ``check_crc``, :class:`~fastload.pack.CorruptSampleError` if it does not match its CRC-32."""
        return self._require().get_bytes(i)

    def slices_only(self, indices: np.ndarray) -> bool:
        """Whether :meth:`get_bytes` of each of ``indices`` (in range: a sampler's) is a slice of the
        buffer and nothing else: ``check_crc`` off, or each checked already in this process."""
        wanted, bad = self._positions(indices)
        return bad is None and self._require().all_checked(wanted)  # out of range: get_bytes says so

    def byte_slices(self, indices: np.ndarray) -> ByteSlices:
        """Samples ``indices`` (a sampler's) as slices of the buffer, for :meth:`slices_only`
        samples: what :meth:`get_bytes` returns for each, with no Python object per sample."""
        wanted, bad = self._positions(indices)
        if bad is not None:
            raise IndexError(f"sample index {bad} is out of range for a dataset of {self._len} samples")
        return self._require().slices(wanted)

    def _positions(self, indices: np.ndarray) -> tuple[np.ndarray, int | None]:
        """``indices`` as positions in the buffer (negative ones count from the end, as in
        :meth:`get_bytes`), and the first index out of range (``None``: none is)."""
        given = np.asarray(indices, dtype=np.int64)
        wanted = np.where(given < 0, given + self._len, given)
        outside = (wanted < 0) | (wanted >= self._len)
        return wanted, int(given[outside][0]) if outside.any() else None

    def describe(self, i: int) -> str:
        """How errors name sample ``i``: its index and original relative path."""
        return f"sample {i} ({self.index.relpath(i)!r})"

    # -- lifecycle

    def close(self) -> None:
        """Releases this process's mapping (and, in the creating process, the segment itself); other
        processes keep theirs, and views handed out stay valid until dropped. Twice is a no-op."""
        self._view = None
        if self._storage is not None:
            self._storage.close()

    def __enter__(self) -> InMemoryImageFolder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        if self._storage is None or self._view is None:
            raise ValueError("cannot pickle a closed InMemoryImageFolder")
        return {
            "handle": self._storage.handle,
            "check_crc": self._view.check_crc,
            "transform": self.transform,
            "target_transform": self.target_transform,
            "shuffle": self._shuffle,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        check_crc = state.get("check_crc", True)
        self._setup(_attach(state["handle"]), state["transform"], state["target_transform"], check_crc)
        self._shuffle = tuple(state.get("shuffle", self._shuffle))

    def extra_repr(self) -> str:
        if self._storage is None or self._view is None:
            return "Storage: closed"
        if self._storage.kind == "pack":
            storage = f"memory map of {self._storage.handle[1]!r} ({_fmt(self._nbytes)} of images)"
            if self.shuffle_order == "blockwise":
                storage += f", shuffled blockwise ({_fmt(self._shuffle[1])} x {self.shuffle_window})"
        else:
            storage = f"shared memory ({self._storage.kind}, {_fmt(self._nbytes)} of images)"
        return f"Classes: {len(self._view.index.classes)}\nStorage: {storage}"
