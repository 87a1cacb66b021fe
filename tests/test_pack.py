"""The pack file: round trip, re-encoding, atomic writes, validation on open, pickling, CLI."""

from __future__ import annotations

import argparse
import io
import os
import pickle
import shutil
import struct

import numpy as np
import pytest
from PIL import Image

from fastload._packformat import HeadPlan
from fastload.decode import DecodeError
from fastload.folder import ClassIndex, FolderIndex, scan_folder
from fastload.pack import (
    ALIGNMENT,
    MAGIC,
    CorruptSampleError,
    PackError,
    PackFile,
    add_pack_parser,
    open_pack,
    write_pack,
)
from fastload.synthetic import make_imagenet_like


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory):
    return make_imagenet_like(
        tmp_path_factory.mktemp("inet"), classes=4, per_class=6, val_per_class=2, seed=0
    )


@pytest.fixture(scope="module")
def train(tree) -> FolderIndex:
    return scan_folder(tree / "train")


def _file(index: FolderIndex, i: int) -> bytes:
    with open(index.paths[i], "rb") as f:
        return f.read()


def test_round_trip_is_bit_exact(train, tmp_path):
    out = tmp_path / "train.fastpack"
    summary = write_pack(train, out, num_workers=2)
    sizes = [len(_file(train, i)) for i in range(len(train))]
    assert summary.num_samples == len(train) == 24
    assert summary.data_bytes == summary.source_bytes == sum(sizes)
    assert summary.reencoded == 0
    with open_pack(out) as pack:
        assert len(pack) == len(train)
        assert pack.classes == train.classes
        assert pack.index.classes.classes == train.classes.classes
        np.testing.assert_array_equal(pack.labels, train.targets)
        assert pack.labels.dtype == np.int64
        assert [pack.index.relpath(i) for i in range(len(pack))] == [
            train.relpath(i) for i in range(len(train))
        ]
        assert pack.index.root == train.root
        for i in range(len(train)):
            assert bytes(pack.get_bytes(i)) == _file(train, i), i
        np.testing.assert_array_equal(np.diff(pack.offsets), sizes)
        assert pack.data_offset % ALIGNMENT == 0
        assert os.path.getsize(out) == pack.data_offset + pack.data.nbytes == summary.file_bytes
        assert pack.meta["max_side"] is None
        pack.verify()  # every CRC matches
    # the quirky files (CMYK JPEG, PNG named .JPEG) are stored as they are too
    assert any(_file(train, i)[:4] == b"\x89PNG" for i in range(len(train)))


def test_get_bytes_is_a_view_of_the_map(train, tmp_path):
    out = tmp_path / "p.fastpack"
    write_pack(train, out, num_workers=0)
    with open_pack(out) as pack:
        mv = pack.get_bytes(5)
        assert isinstance(mv, memoryview) and mv.readonly
        arr = np.frombuffer(mv, dtype=np.uint8)
        assert np.shares_memory(arr, pack.data)
        assert arr.ctypes.data == pack.data.ctypes.data + int(pack.offsets[5])
        assert bytes(pack.get_bytes(-1)) == _file(train, len(train) - 1)
        assert bytes(pack.get_bytes(np.int64(2))) == _file(train, 2)
        with pytest.raises(IndexError, match="sample index 24 is out of range for a dataset of 24 samples"):
            pack.get_bytes(24)
        with pytest.raises(IndexError, match="sample index -25"):
            pack.get_bytes(-25)
        with pytest.raises(TypeError, match="sample index should be an integer"):
            pack.get_bytes(1.0)  # type: ignore[arg-type]


def test_labels_follow_the_shared_class_index(tree, tmp_path):
    # One class more than the folder has, sorting first: every label of the folder shifts by one,
    # exactly as scan_folder labels it, and the pack keeps the whole class list.
    names = ["n00000001", *ClassIndex.from_folder(tree / "val")]
    classes = ClassIndex(names)
    with pytest.warns(UserWarning, match="have no samples"):
        val = scan_folder(tree / "val", classes)
    write_pack(val, tmp_path / "val.fastpack")
    with open_pack(tmp_path / "val.fastpack") as pack:
        assert pack.classes == classes
        np.testing.assert_array_equal(pack.labels, val.targets)
        assert int(pack.labels.min()) == 1


def test_max_side_reencodes_only_larger_images(train, tmp_path):
    sides = [max(Image.open(io.BytesIO(_file(train, i))).size) for i in range(len(train))]
    max_side = int(np.median(sides))
    large = [s > max_side for s in sides]
    assert 0 < sum(large) < len(large)
    summary = write_pack(train, tmp_path / "small.fastpack", max_side=max_side, quality=85, num_workers=0)
    assert summary.reencoded == sum(large)
    assert summary.data_bytes < summary.source_bytes
    with open_pack(tmp_path / "small.fastpack") as pack:
        assert pack.meta["max_side"] == max_side and pack.meta["quality"] == 85
        for i in range(len(train)):
            data = bytes(pack.get_bytes(i))
            if not large[i]:
                assert data == _file(train, i), i
                continue
            original = Image.open(io.BytesIO(_file(train, i)))
            img = Image.open(io.BytesIO(data))
            assert img.format == "JPEG" and img.mode == "RGB", i
            assert max(img.size) == max_side, (i, img.size)
            (w0, h0), (w, h) = original.size, img.size
            assert abs(w / h - w0 / h0) < 0.02, (i, original.size, img.size)
        pack.verify()
    # The process pool gives the same file as the single-process path.
    write_pack(train, tmp_path / "small2.fastpack", max_side=max_side, quality=85, num_workers=2)
    assert (tmp_path / "small.fastpack").read_bytes() == (tmp_path / "small2.fastpack").read_bytes()


def _copy_tree(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_failed_write_leaves_no_pack_and_no_temp_file(tree, train, tmp_path):
    root = _copy_tree(tree / "train", tmp_path / "train")
    index = scan_folder(root)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "train.fastpack"
    write_pack(train, out)  # an older, good pack under the final name
    before = out.read_bytes()
    victim = index.paths[9]
    os.unlink(victim)
    with pytest.raises(OSError, match=rf"cannot read sample 9 \({victim!r}\)".replace("/", r"\/")):
        write_pack(index, out, num_workers=2)
    assert os.listdir(out_dir) == ["train.fastpack"]  # no temp file left
    assert out.read_bytes() == before  # the old pack is untouched
    with pytest.raises(OSError, match="cannot read sample 9"):
        write_pack(index, out_dir / "new.fastpack", num_workers=0)
    assert os.listdir(out_dir) == ["train.fastpack"]


def test_undecodable_file_with_max_side_names_the_sample(tree, tmp_path):
    root = _copy_tree(tree / "train", tmp_path / "train")
    index = scan_folder(root)
    bad = index.paths[4]
    with open(bad, "wb") as f:
        f.write(b"\xff\xd8\xff\xe0 this is not really a JPEG")
    with pytest.raises(DecodeError, match=rf"sample 4 .*{os.path.basename(bad)}.*max_side=64"):
        write_pack(index, tmp_path / "x.fastpack", max_side=64, num_workers=0)
    assert not (tmp_path / "x.fastpack").exists()
    # Without max_side nothing is decoded: the bytes are stored as they are.
    write_pack(index, tmp_path / "y.fastpack")
    with open_pack(tmp_path / "y.fastpack") as pack:
        with open(bad, "rb") as f:
            assert bytes(pack.get_bytes(4)) == f.read()


@pytest.fixture
def good_pack(train, tmp_path):
    out = tmp_path / "good.fastpack"
    write_pack(train, out, num_workers=0)
    return out


def _mutate(path, fn):
    data = bytearray(path.read_bytes())
    data = fn(data)
    path.write_bytes(bytes(data))


def _set(data: bytearray, at: int, value: bytes) -> bytearray:
    data[at : at + len(value)] = value
    return data


def _flip(data: bytearray, at: int) -> bytearray:
    data[at] ^= 0xFF
    return data


def _data_offset(path) -> int:
    with open_pack(path) as p:
        return p.data_offset


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (
            lambda d, off: bytearray(b"\xff\xd8\xff\xe0" + bytes(200)),
            "is not a fastload pack file: it starts with",
        ),
        (lambda d, off: bytearray(), "is empty"),
        (lambda d, off: d[:50], "is truncated: it has 50 bytes"),
        (
            lambda d, off: _set(d, 8, struct.pack("<I", 2)),
            "has pack format version 2, but this fastload reads version 1",
        ),
        (lambda d, off: d[: off - 10], "is truncated .*the header and index need"),
        (lambda d, off: d[:-100], "is truncated: the header says"),
        (lambda d, off: d + b"junk", "has unexpected bytes after its data section"),
        (lambda d, off: _flip(d, 140), "checksum of its header and index does not match"),  # meta
        (lambda d, off: _flip(d, off - 200), "checksum of its header and index does not match"),  # padding
        (lambda d, off: _set(d, 16, struct.pack("<Q", 25)), "checksum|corrupt|truncated"),  # sample count
    ],
    ids=["jpeg", "empty", "tiny", "version", "cut-index", "cut-data", "appended", "meta", "padding", "count"],
)
def test_open_rejects_bad_files_with_a_useful_error(good_pack, corrupt, message):
    off = _data_offset(good_pack)
    _mutate(good_pack, lambda d: corrupt(d, off))
    with pytest.raises(PackError, match=message) as info:
        open_pack(good_pack)
    assert isinstance(info.value, ValueError)
    text = str(info.value)
    assert repr(str(good_pack)) in text
    assert "python -m fastload pack" in text or "Install the fastload" in text


def test_index_checksum_covers_labels(good_pack):
    # A flipped label byte (inside the index, far from the header) is caught on open.
    with open_pack(good_pack) as p:
        at = p.labels.ctypes.data - p.data.ctypes.data + p.data_offset + 8 * 7
    _mutate(good_pack, lambda d: _flip(d, at))
    with pytest.raises(PackError, match="checksum"):
        open_pack(good_pack)


def test_open_does_not_check_the_data_but_reading_and_verify_do(train, good_pack):
    with open_pack(good_pack) as p:
        at = p.data_offset + int(p.offsets[7]) + 100
    _mutate(good_pack, lambda d: _flip(d, at))
    corrupt = rf"sample 7 \('{train.relpath(7)}'\) of '{good_pack}' is corrupt: its CRC-32"
    with open_pack(good_pack) as pack:  # opens: the data is not part of the checksum
        assert bytes(pack.get_bytes(6)) == _file(train, 6)
        with pytest.raises(CorruptSampleError, match=corrupt) as info:
            pack.get_bytes(7)
        assert isinstance(info.value, PackError) and isinstance(info.value, DecodeError)
        with pytest.raises(PackError, match=corrupt):
            pack.verify()
        pack.check_crc = False  # the caller's choice: the damaged bytes, unchecked
        assert bytes(pack.get_bytes(7)) != _file(train, 7)
        with pytest.raises(PackError, match=corrupt):
            pack.verify()  # verify() checks whatever check_crc says
    with open_pack(good_pack, check_crc=False) as pack:
        assert not pickle.loads(pickle.dumps(pack)).check_crc
        assert len(bytes(pack.get_bytes(7))) == len(_file(train, 7))


def test_open_is_proportional_to_the_index_not_the_data(tmp_path):
    # A pack whose data section is a 64 GB hole: opening it must not touch the data (it would take
    # minutes and read 64 GB of zeros); the two samples are views of the hole.
    index = FolderIndex("/nowhere", ["a/x.JPEG", "a/y.JPEG"], [0, 0], ClassIndex(["a"]))
    plan = HeadPlan(index, {"classes": ["a"], "root": "/nowhere", "max_side": None, "quality": None})
    gb = 1 << 30
    offsets = np.array([0, 32 * gb, 64 * gb], dtype=np.int64)
    head = plan.render(offsets, np.zeros(2, dtype=np.uint32))
    path = tmp_path / "huge.fastpack"
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(plan.data_offset + 64 * gb)
    if os.stat(path).st_blocks * 512 > 1 << 20:
        pytest.skip("this file system does not support sparse files")
    with open_pack(path, check_crc=False) as pack:  # a CRC check would read 32 GB of zeros
        assert pack.data.nbytes == 64 * gb
        assert len(pack.get_bytes(1)) == 32 * gb
        assert pack.index.relpath(1) == "a/y.JPEG"


def test_pickle_reopens_by_path(train, good_pack):
    with open_pack(good_pack) as pack:
        blob = pickle.dumps(pack)
        assert len(blob) < 1000 and bytes(pack.get_bytes(0)[:64]) not in blob
        with pickle.loads(blob) as again:
            assert isinstance(again, PackFile)
            assert bytes(again.get_bytes(3)) == _file(train, 3)
            assert again.classes == pack.classes
    # The file was rebuilt since (a different index): the stale handle is refused.
    write_pack(train.subset([0, 1, 2]), good_pack)
    with pytest.raises(PackError, match="has changed since it was opened"):
        pickle.loads(blob)


def test_close_keeps_handed_out_views_valid(train, good_pack):
    pack = open_pack(good_pack)
    mv = pack.get_bytes(2)
    labels = pack.labels
    pack.close()
    pack.close()  # twice is fine
    assert pack.closed
    with pytest.raises(ValueError, match="closed pack"):
        pack.get_bytes(0)
    with pytest.raises(ValueError, match="closed pack"):
        len(pack)
    assert bytes(mv) == _file(train, 2)  # still mapped: the map lives as long as its views
    np.testing.assert_array_equal(labels, train.targets)
    assert "closed" in repr(pack)


def test_empty_index(tmp_path):
    index = FolderIndex(str(tmp_path), [], [], ClassIndex(["a", "b"]))
    write_pack(index, tmp_path / "empty.fastpack")
    with open_pack(tmp_path / "empty.fastpack") as pack:
        assert len(pack) == 0 and pack.data.nbytes == 0
        assert pack.classes.classes == ["a", "b"]
        with pytest.raises(IndexError):
            pack.get_bytes(0)


def test_missing_file_or_folder(tmp_path):
    with pytest.raises(FileNotFoundError):
        open_pack(tmp_path / "nope.fastpack")
    with pytest.raises(PackError, match="is not a regular file"):
        open_pack(tmp_path)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"max_side": 0}, ValueError, "max_side should be a positive integer or None, but got max_side=0"),
        (
            {"max_side": 2.5},
            ValueError,
            "max_side should be a positive integer or None, but got max_side=2.5",
        ),
        ({"quality": 0}, ValueError, r"quality should be an integer in \[1, 100\], but got quality=0"),
        ({"quality": 101}, ValueError, r"quality should be an integer in \[1, 100\], but got quality=101"),
        (
            {"num_workers": -1},
            ValueError,
            "num_workers should be a non-negative integer or None, but got num_workers=-1",
        ),
        (
            {"num_workers": True},
            ValueError,
            "num_workers should be a non-negative integer or None, but got num_workers=True",
        ),
    ],
)
def test_write_pack_argument_errors(train, tmp_path, kwargs, error, message):
    with pytest.raises(error, match=message):
        write_pack(train, tmp_path / "x.fastpack", **kwargs)
    assert not (tmp_path / "x.fastpack").exists()


def test_write_pack_type_errors(train, tmp_path):
    with pytest.raises(TypeError, match="index should be a FolderIndex"):
        write_pack(str(tmp_path), tmp_path / "x.fastpack")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="is a directory"):
        write_pack(train, tmp_path)


def test_command_line(tree, tmp_path, capsys):
    classes_file = tmp_path / "classes.json"
    ClassIndex.from_folder(tree / "train").save(classes_file)
    parser = argparse.ArgumentParser(prog="fastload")
    add_pack_parser(parser.add_subparsers(dest="command", required=True))
    out = tmp_path / "val.fastpack"
    args = parser.parse_args(
        [
            "pack",
            str(tree / "val"),
            str(out),
            "--classes",
            str(classes_file),
            "--max-side",
            "200",
            "--quality",
            "80",
            "--workers",
            "0",
            "--no-progress",
        ]
    )
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}: 8 samples, 4 classes" in printed and "re-encoded to max side 200" in printed
    with open_pack(out) as pack:
        assert pack.meta["max_side"] == 200 and pack.meta["quality"] == 80
        assert (
            max(max(Image.open(io.BytesIO(bytes(pack.get_bytes(i)))).size) for i in range(len(pack))) <= 200
        )
        assert bytes(pack.get_bytes(0)[:0]) == b""
    with open(out, "rb") as f:
        assert f.read(8) == MAGIC


def test_non_utf8_names_round_trip(tmp_path):  # type: ignore[no-untyped-def]
    """A class folder whose name is not valid UTF-8 (possible on Linux) packs and loads unchanged."""
    import os

    from PIL import Image

    from fastload import InMemoryImageFolder, scan_folder
    from fastload.pack import open_pack, write_pack

    root = tmp_path / "split"
    raw = os.fsencode(str(root)) + b"/cl\xe9"
    os.makedirs(raw)
    Image.new("RGB", (8, 8), (1, 2, 3)).save(os.fsdecode(raw + b"/x.jpg"), format="JPEG")
    index = scan_folder(root)
    assert index.classes.classes == [os.fsdecode(b"cl\xe9")]
    write_pack(index, tmp_path / "p.fastpack")
    with open_pack(tmp_path / "p.fastpack") as pack:
        assert (
            pack.index.classes == index.classes
            and bytes(pack.get_bytes(0)) == open(index.paths[0], "rb").read()
        )
    ds = InMemoryImageFolder(root)
    assert ds.classes == index.classes.classes and len(ds) == 1
    ds.close()


def test_cli_errors_are_one_line(tmp_path):  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "bad.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "fastload",
            "pack",
            str(tmp_path),
            str(tmp_path / "o.fastpack"),
            "--max-side",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr and "bad.jpg" in res.stderr
    res = subprocess.run(
        [sys.executable, "-m", "fastload", "pack", str(tmp_path), str(tmp_path / "nodir" / "o.fastpack")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2 and "o.fastpack" in res.stderr and ".tmp" not in res.stderr
    res = subprocess.run(
        [sys.executable, "-m", "fastload", "scan", str(tmp_path), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2 and "is a directory" in res.stderr


def test_available_memory_respects_a_cgroup_limit(monkeypatch):  # type: ignore[no-untyped-def]
    import psutil

    from fastload import memory

    assert memory.available_memory() <= psutil.virtual_memory().available
    monkeypatch.setattr(memory, "_cgroup_headroom", lambda: 123)
    assert memory.available_memory() == 123
