"""InMemoryImageFolder: ImageFolder parity, pickling by handle, real DataLoader workers, lifecycle."""

from __future__ import annotations

import gc
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import zlib

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import fastload.memory as memory
from fastload.decode import DecodeError
from fastload.folder import ClassIndex, FolderIndex, scan_folder
from fastload.imagefolder import ImageFolder
from fastload.memory import InMemoryImageFolder
from fastload.pack import PackError, write_pack
from fastload.synthetic import make_imagenet_like

SHM = "/dev/shm"


# ------------------------------------------------------------------------------------------ helpers


def _random_tree(root, classes=2, per_class=8, size=64 * 1024, seed=0):
    """Files of random bytes named like images: enough for everything that does not decode."""
    rng = np.random.default_rng(seed)
    for c in range(classes):
        d = root / f"class{c}"
        d.mkdir(parents=True)
        for i in range(per_class):
            (d / f"img{i:04d}.JPEG").write_bytes(rng.integers(0, 256, size + 7 * i, dtype=np.uint8).tobytes())
    return root


def _address(mv: memoryview) -> int:
    return int(np.frombuffer(mv, dtype=np.uint8).ctypes.data)


def _mapping_of(address: int) -> tuple[int, str, int]:
    """(inode, path, Private_Dirty in kB) of this process's mapping that contains ``address``."""
    found: list | None = None
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split(None, 1)[0]
            if not first.endswith(":"):  # a mapping's header line: start-end perms offset dev inode path
                if found is not None:
                    break
                start, end = (int(x, 16) for x in first.split("-"))
                if start <= address < end:
                    parts = line.split(None, 5)
                    found = [int(parts[4]), parts[5].strip() if len(parts) > 5 else "", 0]
            elif found is not None and first == "Private_Dirty:":
                found[2] = int(line.split()[1])
    if found is None:
        raise LookupError(f"no mapping contains {address:#x}")
    return found[0], found[1], found[2]


def _inode_is_mapped_or_open(inode: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) >= 5 and int(parts[4]) == inode:
                return True
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.stat(f"/proc/self/fd/{fd}").st_ino == inode:
                return True
        except OSError:
            pass
    return False


def _shm_entries() -> set[str]:
    return {n for n in os.listdir(SHM) if n.startswith("fastload")} if os.path.isdir(SHM) else set()


class ProbeTransform:
    """A fastload-style transform that reports what the worker sees instead of decoding:
    the CRC of the bytes, the worker's pid, and the inode and private dirty size of the mapping the
    bytes live in."""

    def decode_and_apply(self, data: memoryview, name: str) -> torch.Tensor:
        inode, _, dirty = _mapping_of(_address(data))
        return torch.tensor([zlib.crc32(data), os.getpid(), inode, dirty], dtype=torch.int64)

    def __call__(self, image):  # pragma: no cover - decode_and_apply is used instead
        raise AssertionError("ProbeTransform.decode_and_apply should be used")


# ----------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    return make_imagenet_like(
        tmp_path_factory.mktemp("inet"), classes=4, per_class=6, val_per_class=2, seed=1
    )


@pytest.fixture(scope="module")
def rand_root(tmp_path_factory):
    return _random_tree(tmp_path_factory.mktemp("rand") / "train")


@pytest.fixture(scope="module")
def rand_pack(rand_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("packs") / "rand.fastpack"
    write_pack(scan_folder(rand_root), out)
    return out


@pytest.fixture
def file_backend(monkeypatch):
    monkeypatch.setattr(memory, "SEGMENT_BACKEND", "file")


def _open(kind, root, pack, **kw):
    if kind == "ram":
        return InMemoryImageFolder(root, **kw)
    if kind == "pack-ram":
        return InMemoryImageFolder.from_pack(pack, in_memory=True, **kw)
    return InMemoryImageFolder.from_pack(pack, in_memory=False, **kw)


# ------------------------------------------------------------------------------------ ImageFolder parity


@pytest.mark.parametrize("kind", ["ram", "pack-ram", "pack-map"])
def test_same_samples_and_attributes_as_image_folder(tree, tmp_path, kind):
    root = tree / "train"
    pack = tmp_path / "train.fastpack"
    write_pack(scan_folder(root), pack)
    ref = ImageFolder(root, target_transform=lambda t: t + 100)
    with _open(kind, root, pack, target_transform=lambda t: t + 100) as ds:
        assert ds.in_memory == (kind != "pack-map")
        assert len(ds) == len(ref) == 24
        assert ds.classes == ref.classes and ds.class_to_idx == ref.class_to_idx
        assert ds.class_index == ref.class_index
        assert ds.targets.dtype == np.int64
        np.testing.assert_array_equal(ds.targets, ref.targets)
        assert list(ds.samples) == list(ref.samples) and ds.imgs[3] == ref.imgs[3]
        assert ds.root == ref.root
        assert ds.nbytes == sum(os.path.getsize(p) for p in ref.index.paths)
        for i in range(len(ds)):
            assert bytes(ds.get_bytes(i)) == ref.get_bytes(i)
            image, target = ds[i]
            ref_image, ref_target = ref[i]
            assert target == ref_target == int(ref.targets[i]) + 100
            assert image.mode == "RGB"
            np.testing.assert_array_equal(np.asarray(image), np.asarray(ref_image))
        assert ds.describe(2) == f"sample 2 ({ref.index.relpath(2)!r})"
        assert "Number of datapoints: 24" in repr(ds)


def test_folder_index_and_shared_classes(tree):
    classes = ClassIndex(["n00000001", *ClassIndex.from_folder(tree / "val")])
    with pytest.warns(UserWarning, match="have no samples"):
        ds = InMemoryImageFolder(tree / "val", classes=classes)
    with ds:
        assert ds.classes == classes.classes
        assert int(ds.targets.min()) == 1
    with pytest.warns(UserWarning, match="have no samples"):
        index = scan_folder(tree / "val", classes)
    with InMemoryImageFolder(index) as ds:
        np.testing.assert_array_equal(ds.targets, index.targets)
    with pytest.raises(ValueError, match="classes is only used to scan a folder"):
        InMemoryImageFolder(index, classes=classes)
    with pytest.raises(
        TypeError, match="root_or_index should be a folder path or a FolderIndex, but got int"
    ):
        InMemoryImageFolder(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="transform should be callable, but got int"):
        InMemoryImageFolder(index, transform=3)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match="num_threads should be a non-negative integer or None, but got num_threads=-1"
    ):
        InMemoryImageFolder(index, num_threads=-1)


def test_get_bytes_is_a_zero_copy_view_of_the_segment(rand_root):
    with InMemoryImageFolder(rand_root, num_threads=0) as ds:
        mv = ds.get_bytes(3)
        assert isinstance(mv, memoryview) and mv.readonly
        inode, path, _ = _mapping_of(_address(mv))
        assert "fastload" in path  # memfd:fastload-train (deleted), or /dev/shm/fastload-...
        assert _mapping_of(_address(ds.get_bytes(11)))[0] == inode  # every sample: one buffer
        assert _address(ds.get_bytes(4)) == _address(mv) + len(mv)  # back to back
        assert not ds.targets.flags.writeable
        with pytest.raises(IndexError, match="out of range"):
            ds.get_bytes(len(ds))


def test_segment_is_sealed_read_only(rand_root, monkeypatch):
    monkeypatch.setattr(memory, "SEGMENT_BACKEND", "memfd")
    with InMemoryImageFolder(rand_root) as ds:
        kind, pid, fd = ds._storage.handle[:3]
        assert (kind, pid) == ("memfd", os.getpid())
        writable = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
        try:
            with pytest.raises(PermissionError):  # F_SEAL_WRITE: no process can change the data
                os.pwrite(writable, b"x", 5000)
            with pytest.raises(PermissionError):  # F_SEAL_SHRINK: nor make a mapping fault (SIGBUS)
                os.ftruncate(writable, 10)
        finally:
            os.close(writable)
        assert bytes(ds.get_bytes(0)) == (rand_root / "class0" / "img0000.JPEG").read_bytes()


def test_decode_error_names_index_and_original_path(tree, tmp_path):
    root = shutil.copytree(tree / "train", tmp_path / "train")
    index = scan_folder(root)
    bad = 5
    with open(index.paths[bad], "wb") as f:
        f.write(b"\xff\xd8\xff\xe0 not a JPEG after all")
    write_pack(index, tmp_path / "t.fastpack")
    for ds in (
        InMemoryImageFolder(root),
        InMemoryImageFolder.from_pack(tmp_path / "t.fastpack", in_memory=False),
    ):
        with ds:
            with pytest.raises(DecodeError, match=rf"cannot decode sample {bad} \('{index.relpath(bad)}'\)"):
                ds[bad]
            ds[bad - 1]  # the others still decode


def test_unreadable_file_names_the_sample_and_leaves_nothing(tree, tmp_path, monkeypatch):
    root = shutil.copytree(tree / "train", tmp_path / "train")
    index = scan_folder(root)
    os.unlink(index.paths[7])
    fds = len(os.listdir("/proc/self/fd"))
    # torch's loader raises FileNotFoundError (errno, filename): the same, naming the sample too
    with pytest.raises(FileNotFoundError, match=r"\[Errno 2\] cannot read sample 7: No such file") as info:
        InMemoryImageFolder(index)
    assert info.value.filename == index.paths[7]
    assert len(os.listdir("/proc/self/fd")) == fds


# ----------------------------------------------------------------------------------- memory check


def test_refuses_to_load_what_does_not_fit(rand_root, rand_pack, monkeypatch):
    data = sum(os.path.getsize(p) for p in scan_folder(rand_root).paths)
    monkeypatch.setattr(memory, "available_memory", lambda: data)  # no room for the margin
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(MemoryError) as info:
        InMemoryImageFolder(rand_root)
    text = str(info.value)
    assert re.search(
        r"needs 1\.\d MB of RAM \(plus a margin of 268\.4 MB\), but only 1\.\d MB is available", text
    ), text
    assert "--max-side" in text and "in_memory=False" in text
    with pytest.raises(MemoryError, match="in_memory=False"):
        InMemoryImageFolder.from_pack(rand_pack)
    assert len(os.listdir("/proc/self/fd")) == fds  # nothing was created
    with InMemoryImageFolder.from_pack(rand_pack, in_memory=False) as ds:  # a map needs no RAM up front
        assert len(ds) == 16
    monkeypatch.setattr(memory, "available_memory", lambda: data + (300 << 20))
    with InMemoryImageFolder(rand_root) as ds:
        assert len(ds) == 16


def test_available_memory_reads_psutil():
    import psutil

    assert abs(memory.available_memory() - psutil.virtual_memory().available) < 1 << 30


# ------------------------------------------------------------------------------------------ pickling


@pytest.mark.parametrize("kind", ["ram", "pack-map"])
def test_pickle_is_a_handle_independent_of_the_data_size(tmp_path, kind):
    sizes = []
    for name, per_class, size in (("small", 4, 1_000), ("large", 40, 200_000)):
        root = _random_tree(tmp_path / name / "train", per_class=per_class, size=size)
        pack = tmp_path / name / "p.fastpack"
        write_pack(scan_folder(root), pack)
        with _open(kind, root, pack) as ds:
            blob = pickle.dumps(ds)
            assert bytes(ds.get_bytes(len(ds) - 1)[:32]) not in blob
            sizes.append((len(blob), ds.nbytes))
    (small, small_data), (large, large_data) = sizes
    assert large_data > 100 * small_data
    assert small < 1000 and abs(large - small) <= 16, sizes


@pytest.mark.parametrize("kind", ["ram", "pack-ram", "pack-map"])
def test_unpickled_copy_maps_the_same_memory(rand_root, rand_pack, kind):
    with _open(kind, rand_root, rand_pack, transform=ProbeTransform()) as ds:
        again = pickle.loads(pickle.dumps(ds))
        with again:
            assert isinstance(again.transform, ProbeTransform)
            a, b = ds.get_bytes(5), again.get_bytes(5)
            assert bytes(a) == bytes(b)
            assert _address(a) != _address(b)  # a second mapping ...
            assert _mapping_of(_address(a))[0] == _mapping_of(_address(b))[0]  # ... of the same file
            np.testing.assert_array_equal(again.targets, ds.targets)
            assert again.classes == ds.classes


def test_attaching_after_the_owner_closed_is_a_clear_error(rand_root):
    ds = InMemoryImageFolder(rand_root)
    blob = pickle.dumps(ds)
    ds.close()
    with open(__file__, "rb"):  # likely reuses the segment's descriptor number: must not be mistaken for it
        with pytest.raises(RuntimeError, match="has closed the dataset or exited"):
            pickle.loads(blob)
    with pytest.raises(ValueError, match="cannot pickle a closed InMemoryImageFolder"):
        pickle.dumps(ds)


@pytest.mark.parametrize("kind", ["ram", "pack-map"])
def test_stale_handles_are_refused(rand_root, tmp_path, file_backend, kind):
    pack = tmp_path / "p.fastpack"
    write_pack(scan_folder(rand_root), pack)
    ds = _open(kind, rand_root, pack)
    blob = pickle.dumps(ds)
    ds.close()
    write_pack(scan_folder(rand_root).subset([1, 2]), pack)  # pack: rebuilt in the meantime
    with pytest.raises(
        (RuntimeError, PackError), match="has closed the dataset or exited|has changed since it was opened"
    ):
        pickle.loads(blob)


# --------------------------------------------------------------------------------- DataLoader workers


def _run_loader(ds, context):
    loader = DataLoader(
        ds, batch_size=4, num_workers=2, multiprocessing_context=context, persistent_workers=False
    )
    rows = [image for image, _ in loader]
    return torch.cat(rows).numpy()


def _check_rows(rows, parts):
    """Row i of a loader run over ConcatDataset(parts) against what the main process sees."""
    crc, pids, inodes, dirty = rows.T
    expected_crc, expected_inode = [], []
    for ds in parts:
        inode = _mapping_of(_address(ds.get_bytes(0)))[0]
        expected_crc += [zlib.crc32(ds.get_bytes(i)) for i in range(len(ds))]
        expected_inode += [inode] * len(ds)
    # the workers read exactly the main process's bytes ...
    np.testing.assert_array_equal(crc, expected_crc)
    assert len(set(pids.tolist())) == 2 and os.getpid() not in pids
    # ... from a mapping of the same segment (or pack file), with no private copy of its pages
    np.testing.assert_array_equal(inodes, expected_inode)
    assert dirty.max() == 0


@pytest.mark.parametrize("context", ["fork", "forkserver"])
def test_dataloader_workers_share_the_segment(rand_root, context):
    with InMemoryImageFolder(rand_root, transform=ProbeTransform()) as ds:
        _check_rows(_run_loader(ds, context), [ds])


def test_spawn_workers_attach_to_every_kind_of_storage(rand_root, rand_pack, monkeypatch):
    # One spawn run (each spawn worker imports torch afresh: slow) over the three storages:
    # a memfd segment, a /dev/shm file segment (the fallback) and a pack's memory map.
    ram = InMemoryImageFolder(rand_root, transform=ProbeTransform())
    monkeypatch.setattr(memory, "SEGMENT_BACKEND", "file")
    shm_file = InMemoryImageFolder.from_pack(rand_pack, transform=ProbeTransform())
    monkeypatch.setattr(memory, "SEGMENT_BACKEND", None)
    mapped = InMemoryImageFolder.from_pack(rand_pack, in_memory=False, transform=ProbeTransform())
    parts = [ram, shm_file, mapped]
    try:
        assert [p._storage.kind for p in parts] == ["memfd", "file", "pack"]
        _check_rows(_run_loader(torch.utils.data.ConcatDataset(parts), "spawn"), parts)
    finally:
        for p in parts:
            p.close()


def test_killed_worker_leaves_nothing_behind(rand_root, monkeypatch):
    for backend in ("memfd", "file"):
        monkeypatch.setattr(memory, "SEGMENT_BACKEND", backend)
        before = _shm_entries()
        ds = InMemoryImageFolder(rand_root, transform=ProbeTransform())
        inode = _mapping_of(_address(ds.get_bytes(0)))[0]
        if backend == "file":
            assert len(_shm_entries() - before) == 1  # the check below can see a leftover
        loader = DataLoader(ds, batch_size=2, num_workers=2, multiprocessing_context="fork")
        it = iter(loader)
        images, _ = next(it)
        os.kill(int(images[0, 1]), signal.SIGKILL)
        # torch reports the dead worker (or, when the kill lands while the worker was handing over
        # a batch's shared memory, the broken connection to it)
        with pytest.raises((RuntimeError, ConnectionError)):
            for _ in it:
                pass
        del it, loader, images
        ds.close()
        gc.collect()
        assert _shm_entries() == before, backend
        assert not _inode_is_mapped_or_open(inode), backend


# ---------------------------------------------------------------------------------------- lifecycle


def test_close_and_collection_release_the_segment(rand_root):
    ds = InMemoryImageFolder(rand_root)
    view = ds.get_bytes(1)
    expected = bytes(view)
    inode = _mapping_of(_address(view))[0]
    ds.close()
    ds.close()
    assert ds.closed and len(ds) == 16
    with pytest.raises(ValueError, match="closed InMemoryImageFolder"):
        ds.get_bytes(0)
    with pytest.raises(ValueError, match="closed InMemoryImageFolder"):
        ds[0]
    assert "closed" in repr(ds)
    assert bytes(view) == expected  # a view handed out earlier keeps the map alive ...
    del view
    gc.collect()
    assert not _inode_is_mapped_or_open(inode)  # ... and the last one releases it

    ds = InMemoryImageFolder(rand_root)
    inode = _mapping_of(_address(ds.get_bytes(0)))[0]
    del ds
    gc.collect()
    assert not _inode_is_mapped_or_open(inode)


def test_interrupted_load_releases_the_segment(rand_root, monkeypatch, file_backend):
    calls = []
    real = memory._pwrite_all

    def interrupt(fd, data, offset):
        calls.append(offset)
        if len(calls) == 3:
            raise KeyboardInterrupt
        real(fd, data, offset)

    monkeypatch.setattr(memory, "_pwrite_all", interrupt)
    before = _shm_entries()
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(KeyboardInterrupt):
        InMemoryImageFolder(rand_root, num_threads=0)
    assert len(calls) == 3
    assert _shm_entries() == before
    assert len(os.listdir("/proc/self/fd")) == fds


_EXIT_SCRIPT = """
import sys, time
import fastload.memory as memory
memory.SEGMENT_BACKEND = sys.argv[2]
ds = memory.InMemoryImageFolder(sys.argv[1])
print(ds._storage.handle[1] if sys.argv[2] == "file" else "memfd", flush=True)
how = sys.argv[3]
if how == "exception":
    raise RuntimeError("boom")
if how == "interrupt":
    raise KeyboardInterrupt
if how == "wait":
    time.sleep(60)
"""


@pytest.mark.parametrize("how", ["normal", "exception", "interrupt"])
def test_file_backend_segment_is_deleted_when_the_process_exits(rand_root, tmp_path, how):
    proc = subprocess.run(
        [sys.executable, "-c", _EXIT_SCRIPT, str(rand_root), "file", how],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=os.getcwd(),
    )
    path = proc.stdout.strip()
    assert path.startswith((SHM, tempfile.gettempdir())), proc.stderr
    assert (proc.returncode != 0) == (how != "normal"), proc.stderr
    assert not os.path.exists(path)


def test_sigkilled_owner_leaves_nothing_in_dev_shm(rand_root):
    before = _shm_entries()
    proc = subprocess.Popen(
        [sys.executable, "-c", _EXIT_SCRIPT, str(rand_root), "memfd", "wait"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.getcwd(),
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "memfd"
        fds = os.listdir(f"/proc/{proc.pid}/fd")
        assert any(
            "memfd:fastload" in os.readlink(f"/proc/{proc.pid}/fd/{fd}")
            for fd in fds
            if os.path.exists(f"/proc/{proc.pid}/fd/{fd}")
        )
        with open(f"/proc/{proc.pid}/maps") as maps:  # nothing of it in /dev/shm to leave behind
            assert not [line for line in maps if f"{SHM}/fastload" in line]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()
    # no entry appeared (tests running beside this one may remove theirs meanwhile)
    assert not _shm_entries() - before


def test_from_pack_argument_errors(rand_pack, tmp_path):
    with pytest.raises(TypeError, match="in_memory should be a bool, but got in_memory='yes'"):
        InMemoryImageFolder.from_pack(rand_pack, in_memory="yes")  # type: ignore[arg-type]
    (tmp_path / "bad.fastpack").write_bytes(b"hello" * 100)
    with pytest.raises(PackError, match="is not a fastload pack file"):
        InMemoryImageFolder.from_pack(tmp_path / "bad.fastpack")


def test_empty_dataset(tmp_path):
    (tmp_path / "a").mkdir()
    with pytest.raises(FileNotFoundError, match="Found no valid file for the classes a in"):
        InMemoryImageFolder(tmp_path)  # a scan that finds nothing is an error, as in torchvision
    empty = FolderIndex(str(tmp_path), [], [], ClassIndex(["a"]))
    with InMemoryImageFolder(empty) as ds:
        assert len(ds) == 0 and ds.classes == ["a"] and ds.nbytes == 0
        assert len(pickle.loads(pickle.dumps(ds))) == 0


def test_segment_backend_setting_is_checked(rand_root, monkeypatch):
    monkeypatch.setattr(memory, "SEGMENT_BACKEND", "shm")
    with pytest.raises(ValueError, match="SEGMENT_BACKEND should be None, 'memfd' or 'file', but got 'shm'"):
        InMemoryImageFolder(rand_root)
