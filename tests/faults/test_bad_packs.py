"""Bad packs: damaged anywhere, crafted, written concurrently, or written where they cannot be.

A damaged pack never opens as a valid one and never yields wrong bytes: the header and index are
checked when it is opened (a digest), each sample's bytes when they are read (a CRC-32). Specific
messages for each header problem: ``tests/test_pack.py::test_open_rejects_bad_files_with_a_useful_error``.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import pwd
import resource
import shutil
import signal
import tempfile
import tracemalloc
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from fastload._packformat import HEADER, PackView, header_digest
from fastload.decode import DecodeError
from fastload.folder import FolderIndex, scan_folder
from fastload.loader import DataLoader
from fastload.memory import InMemoryImageFolder
from fastload.pack import CorruptSampleError, PackError, open_pack, write_pack

from ._faults import bad_images, drain, val_tf

KINDS = ("1x1", "gray", "progressive")  # three small valid images: a pack of a few kB


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> tuple[FolderIndex, bytes]:
    """A pack of three small images, as its index and its bytes."""
    root = tmp_path_factory.mktemp("small")
    images = bad_images()
    for k, kind in enumerate(KINDS):
        (root / "c").mkdir(exist_ok=True)
        (root / "c" / f"{k}-{kind}.jpg").write_bytes(images[kind])
    index = scan_folder(root)
    out = root.parent / "small.fastpack"
    write_pack(index, out, num_workers=0)
    return index, out.read_bytes()


def _data_offset(blob: bytes) -> int:
    return int(HEADER.unpack_from(blob, 0)[7])


def test_truncated_anywhere_never_opens(small: tuple[FolderIndex, bytes]) -> None:
    _, blob = small
    view = memoryview(blob)
    data_offset = _data_offset(blob)
    cuts = [*range(0, data_offset + 1), *range(data_offset, len(blob), 7), len(blob) - 1]
    for cut in cuts:
        with pytest.raises(PackError):
            PackView(view[:cut], f"cut at {cut}")
    PackView(view, "whole")  # the uncut pack opens


def test_every_header_and_index_byte_flipped_never_opens(small: tuple[FolderIndex, bytes]) -> None:
    _, blob = small
    buf = bytearray(blob)
    for at in range(_data_offset(blob)):  # fixed header, meta JSON, index arrays, padding
        for mask in (0xFF, 0x01):
            buf[at] ^= mask
            try:
                with pytest.raises(PackError):
                    PackView(buf, f"byte {at} ^ {mask:#x}")
            finally:
                buf[at] ^= mask
    with pytest.raises(PackError, match="is not a fastload pack file: it starts with b'XASTPACK'"):
        PackView(b"X" + blob[1:], "'x.fastpack'")


def test_every_payload_byte_flipped_raises_for_its_sample_only(small: tuple[FolderIndex, bytes]) -> None:
    index, blob = small
    buf = bytearray(blob)
    view = PackView(buf, "'small.fastpack'")
    start = view.data_offset
    ends = [start + int(o) for o in view.offsets[1:]]
    for at in range(start, len(buf)):
        hit = next(k for k, end in enumerate(ends) if at < end)
        buf[at] ^= 0x10
        view.check_crc = True  # forget what was checked: each sample is checked once per process
        try:
            for i in range(len(view)):
                if i == hit:
                    with pytest.raises(CorruptSampleError, match=rf"sample {i} \('{index.relpath(i)}'\)"):
                        view.get_bytes(i)
                else:
                    view.get_bytes(i)
        finally:
            buf[at] ^= 0x10
    view.release()


def test_each_sample_is_checked_once_per_process(small: tuple[FolderIndex, bytes]) -> None:
    _, blob = small
    buf = bytearray(blob)
    view = PackView(buf, "'small.fastpack'")
    view.get_bytes(1)  # checked: later reads of sample 1 cost nothing
    at = view.data_offset + int(view.offsets[1])
    buf[at] ^= 0x10  # (a pack on disk does not change under its map: write_pack replaces the file)
    assert bytes(view.get_bytes(1))[0] == buf[at]
    view.check_crc = True  # forgets what was checked
    with pytest.raises(CorruptSampleError, match="sample 1 "):
        view.get_bytes(1)
    view.check_crc = False
    assert bytes(view.get_bytes(1))[0] == buf[at]
    view.release()


@pytest.fixture
def flipped(bad_pack: Path, tmp_path: Path) -> tuple[Path, int]:
    """A copy of the bad folder's pack with one byte flipped in the middle of a good sample."""
    with open_pack(bad_pack) as pack:
        i = next(k for k in range(len(pack)) if pack.index.relpath(k).startswith("good/"))
        at = pack.data_offset + int(pack.offsets[i] + pack.offsets[i + 1]) // 2
    out = tmp_path / "flipped.fastpack"
    data = bytearray(bad_pack.read_bytes())
    data[at] ^= 0xFF
    out.write_bytes(bytes(data))
    return out, i


@pytest.mark.parametrize("where", ["file", "ram", "map"])
def test_flipped_payload_is_a_named_error_on_every_storage(flipped: tuple[Path, int], where: str) -> None:
    path, i = flipped
    if where == "file":
        ds: object = open_pack(path)
        name = repr(str(path))
    else:
        ds = InMemoryImageFolder.from_pack(path, transform=val_tf(), in_memory=where == "ram")
        name = f"the in-memory copy of {str(path)!r}" if where == "ram" else repr(str(path))
    relpath = ds.index.relpath(i)  # type: ignore[attr-defined]
    with pytest.raises(CorruptSampleError) as info:
        ds.get_bytes(i)  # type: ignore[attr-defined]
    text = str(info.value)
    assert text.startswith(f"sample {i} ({relpath!r}) of {name} is corrupt: its CRC-32 is"), text
    assert "Copy it again or rebuild it" in text
    assert isinstance(info.value, PackError) and isinstance(info.value, DecodeError)
    ds.get_bytes(i - 1)  # type: ignore[attr-defined]  # its neighbours are fine
    ds.close()  # type: ignore[attr-defined]


@pytest.mark.parametrize(("workers", "on_error"), [(0, "raise"), (2, "skip")])
def test_flipped_payload_through_the_loader(flipped: tuple[Path, int], workers: int, on_error: str) -> None:
    path, i = flipped
    ds = InMemoryImageFolder.from_pack(path, transform=val_tf(), in_memory=workers == 0)
    good = [k for k in range(len(ds)) if ds.index.relpath(k).startswith("good/")]
    loader = DataLoader(
        ds, batch_size=2, num_workers=workers, on_error=on_error, sampler=good, persistent_workers=False
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = drain(loader)
    if on_error == "raise":
        assert len(result.errors) == 1 and isinstance(result.errors[0], CorruptSampleError)
        assert f"sample {i} " in str(result.errors[0])
        assert len(result.batches) == len(loader) - 1
    else:
        assert not result.errors
        assert sorted(k for b in result.batches for k in b) == sorted(set(good) - {i})
        assert [str(w.message) for w in caught if f"skipped sample {i} " in str(w.message)]
    loader.close()
    ds.close()


# ------------------------------------------------------------------------------ crafted headers


def _craft(blob: bytes, **fields: int) -> bytearray:
    """``blob`` with header fields replaced and the digest recomputed (what an attacker can do)."""
    names = ["magic", "version", "header_size", "n", "meta_len", "index_offset", "path_bytes", "data_offset"]
    names += ["data_len", "digest"]
    values = dict(zip(names, HEADER.unpack_from(blob, 0), strict=True))
    values.update(fields)
    buf = bytearray(blob)
    HEADER.pack_into(buf, 0, *(values[k] for k in names))
    digest = header_digest(memoryview(buf), min(len(buf), _data_offset(blob)))
    HEADER.pack_into(buf, 0, *(values[k] for k in names[:-1]), digest)
    return buf


def _set_index_array(blob: bytes, which: int, values: np.ndarray) -> bytearray:
    """``blob`` with index array ``which`` (0 offsets, 1 labels) replaced and the digest recomputed."""
    buf = bytearray(blob)
    view = PackView(blob, "x")
    n, index_offset = len(view), int(HEADER.unpack_from(blob, 0)[5])
    at = index_offset + (0 if which == 0 else 8 * (n + 1))
    buf[at : at + values.nbytes] = values.astype("<i8").tobytes()
    return _craft(bytes(buf))


HUGE = 1 << 62


@pytest.mark.parametrize(
    "make",
    [
        lambda b: _craft(b, n=1 << 40),
        lambda b: _craft(b, meta_len=HUGE),
        lambda b: _craft(b, index_offset=HUGE),
        lambda b: _craft(b, path_bytes=HUGE),
        lambda b: _craft(b, data_offset=HUGE),
        lambda b: _craft(b, data_len=HUGE),
        lambda b: _set_index_array(b, 0, np.array([0, HUGE, 3, 4])),
        lambda b: _set_index_array(b, 1, np.array([1 << 40, 0, 0])),
    ],
    ids=["samples", "meta", "index", "paths", "data-offset", "data-length", "sample-offset", "label"],
)
def test_huge_claims_are_errors_without_huge_allocations(small: tuple[FolderIndex, bytes], make) -> None:  # type: ignore[no-untyped-def]
    crafted = make(small[1])
    tracemalloc.start()
    try:
        with pytest.raises(PackError):
            PackView(crafted, "'crafted.fastpack'")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"validating the header allocated {peak} bytes"


# ------------------------------------------------------------------------------ writing


def _writer(index: FolderIndex, out: str, barrier: multiprocessing.synchronize.Barrier) -> None:
    barrier.wait()
    write_pack(index, out, num_workers=0)


def test_concurrent_writers_leave_one_whole_pack(bad_root: Path, tmp_path: Path) -> None:
    everything = scan_folder(bad_root)
    a = everything.subset(np.arange(0, len(everything), 2))
    b = everything.subset(np.arange(1, len(everything), 2))
    out = tmp_path / "both.fastpack"
    ctx = multiprocessing.get_context("fork")
    for _ in range(3):
        barrier = ctx.Barrier(2)
        procs = [ctx.Process(target=_writer, args=(index, str(out), barrier)) for index in (a, b)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        assert [p.exitcode for p in procs] == [0, 0]
        with open_pack(out) as pack:
            pack.verify()
            assert pack.index in (a, b)
    assert [p.name for p in tmp_path.iterdir()] == ["both.fastpack"]  # no temporary file left


def _write_in(root: str, out: str, how: str, conn: multiprocessing.connection.Connection) -> None:
    """In a forked child: make the location read-only or full, then write; send what it raised."""
    if how == "full":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))
    elif os.geteuid() == 0:
        os.setgid(65534)
        os.setuid(65534)  # root writes anywhere: write as nobody
    try:
        write_pack(scan_folder(root), out, num_workers=0)
    except OSError as e:
        conn.send(f"{type(e).__name__}: {e}")
    else:
        conn.send("written")


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A folder everyone can read (the pytest temporary folders are private to this user)."""
    path = Path(tempfile.mkdtemp(prefix="fastload-faults-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("how", ["read-only", "full"])
def test_writing_where_it_cannot_is_a_clear_error_and_leaves_nothing(
    bad_root: Path, shared_dir: Path, how: str
) -> None:
    if how == "read-only" and os.geteuid() == 0:
        try:
            pwd.getpwuid(65534)
        except KeyError:
            pytest.skip("running as root without a 'nobody' user to drop to")
    src = shared_dir / "src"
    shutil.copytree(bad_root / "good", src / "good")
    for p in [src, *src.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    target = shared_dir / "out"
    target.mkdir()
    previous = b"an older pack that must survive"
    (target / "x.fastpack").write_bytes(previous)
    target.chmod(0o555 if how == "read-only" else 0o777)
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_write_in, args=(str(src), str(target / "x.fastpack"), how, send))
    child.start()
    assert receive.poll(60), "the writer did not answer"
    message = receive.recv()
    child.join(10)
    pack_path = repr(str(target / "x.fastpack"))
    if how == "read-only":
        assert message.startswith(f"PermissionError: [Errno 13] cannot create the pack file {pack_path}")
        assert "Write the pack to a folder you can write to" in message
    else:
        expected = f"OSError: [Errno 27] cannot write the pack file {pack_path}: File too large"
        assert message.startswith(expected), message
        assert "nothing was left under that name" in message and "ulimit -f" in message
    assert (target / "x.fastpack").read_bytes() == previous
    assert sorted(p.name for p in target.iterdir()) == ["x.fastpack"]
