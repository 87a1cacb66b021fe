from __future__ import annotations

import inspect
import multiprocessing as mp
import os
import pickle
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from PIL import Image

from fastload import ClassIndex, FolderIndex, ImageFolder, scan_folder, scan_list
from fastload.decode import DecodeError


def _tree(root: Path, layout: dict[str, int], size: tuple[int, int] = (40, 30)) -> Path:
    """A tiny split: ``layout`` maps class name -> number of JPEG files."""
    for cls, n in layout.items():
        (root / cls).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            Image.new("RGB", size, (10 * i, 100, 200)).save(root / cls / f"{cls}_{i}.jpg", quality=90)
    return root


def _torchvision_folder(root: Path) -> torchvision.datasets.ImageFolder:
    """torchvision's ``ImageFolder(root, allow_empty=True)``, for a comparison (skipped where
    torchvision is older than 0.17, whose ``ImageFolder`` refuses an empty class folder)."""
    if "allow_empty" not in inspect.signature(torchvision.datasets.ImageFolder).parameters:
        pytest.skip(f"torchvision {torchvision.__version__}'s ImageFolder has no allow_empty (0.17+)")
    return torchvision.datasets.ImageFolder(str(root), allow_empty=True)


# ------------------------------------------------------------------------------------ ClassIndex


def test_class_index_basics(tmp_path: Path) -> None:
    ci = ClassIndex(["cat", "dog", "emu"])
    assert len(ci) == 3 and ci.classes == ["cat", "dog", "emu"]
    assert ci.class_to_idx == {"cat": 0, "dog": 1, "emu": 2}
    assert ci.index("emu") == 2 and ci[1] == "dog" and "cat" in ci and "cow" not in ci
    assert ci == ClassIndex(["cat", "dog", "emu"]) and ci != ClassIndex(["dog", "cat", "emu"])
    assert pickle.loads(pickle.dumps(ci)) == ci
    with pytest.raises(KeyError, match="unknown class 'cow'"):
        ci.index("cow")
    with pytest.raises(ValueError, match="unique.*cat"):
        ClassIndex(["cat", "dog", "cat"])
    with pytest.raises(ValueError, match="non-empty strings"):
        ClassIndex(["cat", ""])


def test_class_index_from_folder_splits_and_json(tmp_path: Path) -> None:
    train = _tree(tmp_path / "train", {"a": 1, "b": 1, "c": 1})
    val = _tree(tmp_path / "val", {"a": 1, "c": 1, "d": 1})
    (train / "empty").mkdir()
    (train / ".hidden").mkdir()
    (train / "notes.txt").write_text("not a class")
    assert ClassIndex.from_folder(train).classes == ["a", "b", "c", "empty"]
    assert ClassIndex.from_splits(train, val).classes == ["a", "b", "c", "d", "empty"]
    ci = ClassIndex.from_splits(train, val)
    ci.save(tmp_path / "classes.json")
    text = (tmp_path / "classes.json").read_text()
    assert '"a"' in text and "\n" in text  # human-readable JSON
    assert ClassIndex.load(tmp_path / "classes.json") == ci
    (tmp_path / "plain.json").write_text('["x", "y"]')
    assert ClassIndex.load(tmp_path / "plain.json").classes == ["x", "y"]
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.json"):
        ClassIndex.load(tmp_path / "bad.json")
    with pytest.raises(FileNotFoundError, match="nope"):
        ClassIndex.from_folder(tmp_path / "nope")


# ------------------------------------------------------------------------------------ scanning


def test_missing_class_in_val_keeps_labels_unlike_torchvision(tmp_path: Path) -> None:
    """The mission's scenario: train has a, b, c; val lacks b."""
    train = _tree(tmp_path / "train", {"a": 2, "b": 2, "c": 2})
    val = _tree(tmp_path / "val", {"a": 1, "c": 1})
    tv = torchvision.datasets.ImageFolder(str(val))
    assert tv.class_to_idx["c"] == 1  # torchvision: c shifted to 1

    classes = ClassIndex.from_folder(train)
    with pytest.warns(UserWarning, match=r"1 of 3 classes have no samples.*'b'"):
        index = scan_folder(val, classes)
    c_label = {Path(p).parent.name: int(t) for p, t in zip(index.paths, index.targets, strict=True)}["c"]
    assert c_label == 2 == classes.index("c")
    with pytest.warns(UserWarning, match=r"1 of 3 classes have no samples.*'b'"):  # the dataset's scan too
        ds = ImageFolder(val, classes=classes)
    assert ds.class_to_idx == {"a": 0, "b": 1, "c": 2}
    assert [t for _, t in ds.samples] == [0, 2]
    assert ds[1][1] == 2


def test_a_split_labelled_by_its_own_folders_beside_train_is_warned_where_labels_differ(
    tmp_path: Path,
) -> None:
    """Without a class list a split is numbered by its own folders (torchvision's rule, kept): next
    to a train split, any class that then gets another label than in train is named, with the fix,
    at the user's line. Where every label agrees (only trailing classes missing), nothing is said."""
    _tree(tmp_path / "train", {"a": 1, "b": 1, "c": 1})
    _tree(tmp_path / "val", {"a": 1, "c": 1})
    with pytest.warns(UserWarning, match=r"1 of its classes get another label than there \('c'\)") as caught:
        ds = ImageFolder(tmp_path / "val")
    assert ds.class_to_idx == {"a": 0, "c": 1}  # torchvision's labels: a loop gets what it got
    message = str(caught[0].message)
    assert "1 of train's classes have no folder here ('b')" in message
    assert "classes=ClassIndex.from_folder(" in message
    assert caught[0].filename == __file__  # names the line that made the dataset
    _tree(tmp_path / "valid", {"a": 1, "b": 1})  # only the last class missing: the same labels
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ImageFolder(tmp_path / "train")
        ImageFolder(tmp_path / "valid")
        with pytest.warns(UserWarning, match="no samples"):  # a class list given: only its own warning
            ImageFolder(tmp_path / "val", classes=ClassIndex.from_folder(tmp_path / "train"))
    _tree(tmp_path / "test", {"a": 1, "b": 1, "c": 1, "z": 1})  # one train lacks, at the end
    with pytest.warns(UserWarning, match=r"1 are not classes of train \('z'\)"):
        scan_folder(tmp_path / "test")
    _tree(tmp_path / "eval", {"0": 1, "a": 1})  # one train lacks, sorted first: the others move
    with pytest.warns(UserWarning, match=r"1 of its classes get another label than there \('a'\); 1 are not"):
        scan_folder(str(tmp_path / "eval") + "/")  # (a trailing slash)
    # not evaluation splits of this train: another name, or no class in common
    _tree(tmp_path / "train100", {"b": 1, "c": 1})
    _tree(tmp_path / "pets", {"cat": 1, "dog": 1})
    _tree(tmp_path / "dev", {"cat": 1, "dog": 1})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for other in ("train100", "pets", "dev"):
            scan_folder(tmp_path / other)
    previous = os.getcwd()
    os.chdir(tmp_path / "val")
    try:  # "." from inside the split
        with pytest.warns(UserWarning, match="another label"):
            scan_folder(".")
    finally:
        os.chdir(previous)


def test_unknown_class_is_an_error_or_left_out(tmp_path: Path) -> None:
    train = _tree(tmp_path / "train", {"a": 1, "b": 1})
    val = _tree(tmp_path / "val", {"a": 1, "b": 1, "zebra": 2})
    classes = ClassIndex.from_folder(train)
    with pytest.raises(ValueError, match="not in the class list: 'zebra'.*strict=False"):
        scan_folder(val, classes)
    with pytest.warns(UserWarning, match="zebra.*left out"):
        index = scan_folder(val, classes, strict=False)
    assert len(index) == 2 and list(index.targets) == [0, 1]


@pytest.mark.filterwarnings("ignore:2 of 3 classes have no samples")  # the point is elsewhere
def test_hidden_non_image_nested_and_empty(tmp_path: Path) -> None:
    root = _tree(tmp_path / "split", {"a": 2, "b": 1})
    (root / "empty").mkdir()
    (root / "a" / ".hidden.jpg").write_bytes(b"junk")
    (root / "a" / "readme.txt").write_text("x")
    (root / "b" / "sub").mkdir()
    Image.new("RGB", (8, 8)).save(root / "b" / "sub" / "deep.PNG")
    (root / ".git").mkdir()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        index = scan_folder(root)
    assert [str(Path(p).relative_to(root)) for p in index.paths] == [
        "a/a_0.jpg",
        "a/a_1.jpg",
        "b/b_0.jpg",
        "b/sub/deep.PNG",
    ]
    assert index.classes.classes == ["a", "b", "empty"]  # empty class folder kept
    assert list(index.targets) == [0, 0, 1, 1] and index.targets.dtype == np.int64
    assert any("empty" in str(w.message) for w in caught)
    # Same files in the same order as torchvision (which also walks sub-folders), less the
    # hidden file that torchvision would try (and fail) to decode.
    tv = _torchvision_folder(root)
    assert [p for p, _ in tv.samples if "/." not in p] == list(index.paths)
    assert scan_folder(root, extensions=(".png",)).relpath(0) == "b/sub/deep.PNG"


def test_no_image_file_is_an_error_like_torchvision(tmp_path: Path) -> None:
    empty_root = tmp_path / "empty_root"
    empty_root.mkdir()
    with pytest.raises(FileNotFoundError, match="Found no valid file for the classes of .*empty_root"):
        ImageFolder(empty_root)
    with pytest.raises(FileNotFoundError, match="Couldn't find any class folder"):
        torchvision.datasets.ImageFolder(str(empty_root))
    root = tmp_path / "split"
    for name in ("a", "b"):
        (root / name).mkdir(parents=True)
        (root / name / "notes.txt").write_text("x")
    (root / "a" / ".hidden.jpg").write_bytes(b"junk")
    with pytest.raises(
        FileNotFoundError,
        match=r"Found no valid file for the classes a, b in .*split'\. Supported extensions are: \.jpg, ",
    ):
        scan_folder(root)
    # torchvision's wording (it counts the hidden a/.hidden.jpg as a valid file, fastload skips it).
    with pytest.raises(
        FileNotFoundError, match=r"Found no valid file for the classes b\. Supported extensions"
    ):
        torchvision.datasets.ImageFolder(str(root))
    with pytest.raises(FileNotFoundError, match=r"classes a, b in .*Supported extensions are: \.png$"):
        ImageFolder(root, extensions=".png")
    # A class list shared with train: the classes looked for are named.
    with pytest.raises(FileNotFoundError, match="classes a, b in"):
        ImageFolder(root, classes=ClassIndex(["a", "b", "c"]))
    # Opting in (torchvision's allow_empty) gives an empty dataset.
    assert len(ImageFolder(root, allow_empty=True)) == 0
    assert len(scan_folder(root, allow_empty=True)) == 0
    assert len(scan_folder(empty_root, allow_empty=True)) == 0
    # A ready empty index is not a scan: accepted as given.
    assert len(ImageFolder(None, index=FolderIndex(str(root), [], [], ClassIndex(["a"])))) == 0
    # One file is enough: the empty classes of a split only warn (their labels stay reserved).
    Image.new("RGB", (8, 8)).save(root / "b" / "one.png")
    with pytest.warns(UserWarning, match="1 of 2 classes have no samples"):
        ds = ImageFolder(root)
    assert len(ds) == 1 and list(ds.targets) == [1]


def test_loose_files_at_root_warn(tmp_path: Path) -> None:
    root = _tree(tmp_path / "split", {"a": 1})
    Image.new("RGB", (8, 8)).save(root / "stray.jpg")
    with pytest.warns(UserWarning, match="outside any class directory.*stray.jpg"):
        index = scan_folder(root)
    assert len(index) == 1


def test_scan_is_deterministic_and_matches_torchvision(imagenet_root: Path) -> None:
    a = scan_folder(imagenet_root / "train")
    b = scan_folder(imagenet_root / "train")
    assert a == b
    tv = torchvision.datasets.ImageFolder(str(imagenet_root / "train"))
    assert list(a.paths) == [p for p, _ in tv.samples]
    assert a.targets.tolist() == tv.targets
    assert a.classes.classes == tv.classes


def test_folder_index_storage_save_load_pickle(imagenet_root: Path, tmp_path: Path) -> None:
    index = scan_folder(imagenet_root / "train")
    # Per-sample data lives in numpy arrays, not per-sample Python objects.
    state = index.__getstate__()
    assert {type(v) for k, v in state.items() if k in ("buf", "offsets", "targets")} == {np.ndarray}
    index.save(tmp_path / "train.idx.npz")
    loaded = FolderIndex.load(tmp_path / "train.idx.npz")
    assert loaded == index and loaded.paths[5] == index.paths[5]
    moved = FolderIndex.load(tmp_path / "train.idx.npz", root="/elsewhere")
    assert moved.paths[0].startswith("/elsewhere/") and moved.relpath(0) == index.relpath(0)
    assert pickle.loads(pickle.dumps(index)) == index
    (tmp_path / "junk.npz").write_bytes(b"nope")
    with pytest.raises(ValueError, match="junk.npz"):
        FolderIndex.load(tmp_path / "junk.npz")
    with pytest.raises(IndexError, match="out of range"):
        index.paths[len(index)]
    sub = index.subset([3, 1])
    assert list(sub.paths) == [index.paths[3], index.paths[1]] and list(sub.targets) == [
        index.targets[3],
        index.targets[1],
    ]


def test_non_ascii_paths(tmp_path: Path) -> None:
    root = _tree(tmp_path / "split", {"café": 1, "日本": 1})
    index = scan_folder(root)
    assert index.classes.classes == ["café", "日本"]
    assert Path(index.paths[1]).exists()
    index.save(tmp_path / "i.npz")
    assert FolderIndex.load(tmp_path / "i.npz") == index


def test_nested_folders_in_torchvision_order(tmp_path: Path) -> None:
    """Files of a class folder come before its sub-folders', sub-folders by path string
    (``sorted(os.walk(...))``), as in torchvision: ``a/b-c`` comes between ``a/b`` and ``a/b/deeper``."""
    root = _tree(tmp_path / "split", {"a": 0, "b": 1})
    for rel in ("a/z.jpg", "a/b/x.jpg", "a/b-c/y.jpg", "a/b/deeper/w.jpg", "a/c.jpg", "a/b0/v.jpg"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8, 8)).save(root / rel)
    index = scan_folder(root)
    tv = torchvision.datasets.ImageFolder(str(root))
    assert list(index.paths) == [p for p, _ in tv.samples]
    assert index.targets.tolist() == tv.targets
    assert [index.relpath(i) for i in range(6)] == [
        "a/c.jpg",
        "a/z.jpg",
        "a/b/x.jpg",
        "a/b-c/y.jpg",
        "a/b/deeper/w.jpg",
        "a/b0/v.jpg",
    ]


@pytest.mark.filterwarnings("ignore:1 of 2 classes have no samples")  # split2's empty class: not the point
def test_symlink_loops_are_skipped_with_a_warning_naming_the_link(tmp_path: Path) -> None:
    """A link to a parent folder, to itself, into another class or a second link to one folder:
    each directory is walked once; one warning names the links and where each was scanned."""
    root = _tree(tmp_path / "split", {"a": 2, "b": 1, "c": 1})
    (root / "a" / "up").symlink_to("..")  # the split's root: every class again, forever
    (root / "a" / "sub").mkdir()
    Image.new("RGB", (8, 8)).save(root / "a" / "sub" / "s.jpg")
    (root / "a" / "sub" / "again").symlink_to("../sub")  # a loop inside the class
    (root / "a" / "sub2").symlink_to("sub")  # a second link to a folder of the same class
    (root / "b" / "to_c").symlink_to("../c")  # another class's folder
    (root / "b" / "self.jpg").symlink_to("self.jpg")  # a link to itself: a broken file
    with pytest.warns(UserWarning) as caught:
        index = scan_folder(root)
    messages = [str(w.message) for w in caught if "scanned before" in str(w.message)]
    assert len(messages) == 1
    message = messages[0]
    assert message.startswith(f"4 directories under {str(root)!r} lead to a directory scanned before")
    for link, first in (("a/up", ""), ("a/sub/again", "a/sub"), ("a/sub2", "a/sub"), ("b/to_c", "c")):
        target = str(root / first) if first else str(root)
        assert f"{str(root / link)!r} (already scanned as {target!r})" in message
    assert [index.relpath(i) for i in range(len(index))] == [
        "a/a_0.jpg",
        "a/a_1.jpg",
        "a/sub/s.jpg",
        "b/b_0.jpg",
        "b/self.jpg",
        "c/c_0.jpg",
    ]
    assert index.targets.tolist() == [0, 0, 0, 1, 1, 2]
    assert index.skipped["repeated_dirs"] == 4
    with pytest.raises(OSError, match=r"cannot read sample 4: .*self.jpg'") as info:
        index.read_bytes(4)  # the broken link is a sample that names itself when read
    assert info.value.errno is not None and str(info.value.filename).endswith("self.jpg")
    # A class folder that is a link to another class's folder is that class's; the second is empty.
    root2 = _tree(tmp_path / "split2", {"a": 1})
    (root2 / "b").symlink_to("a")
    with pytest.warns(UserWarning, match=r"1 directory .* scanned before.*split2/b'.*split2/a'"):
        assert scan_folder(root2).targets.tolist() == [0]


def test_hidden_entries_are_skipped_and_counted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """macOS resource forks (``._x.JPEG``) and hidden folders: torchvision lists them, fastload skips
    and counts them (``skipped``) and logs the hidden image-named files."""
    root = _tree(tmp_path / "split", {"a": 2, "b": 2})
    for rel in ("a/._a_0.jpg", "a/._a_1.jpg", "b/._b_0.jpg"):
        (root / rel).write_bytes(b"\x00\x05\x16\x07 AppleDouble")  # not an image
    (root / "b" / ".DS_Store").write_bytes(b"junk")
    (root / "b" / "notes.txt").write_text("x")
    (root / "a" / ".thumbs").mkdir()
    Image.new("RGB", (8, 8)).save(root / "a" / ".thumbs" / "t.jpg")
    (root / ".ipynb_checkpoints").mkdir()  # torchvision: a class; fastload: not one
    with caplog.at_level("INFO", logger="fastload.folder"):
        ds = ImageFolder(root)
    assert ds.skipped == {"hidden_files": 3, "hidden_dirs": 2, "repeated_dirs": 0, "other_files": 2}
    assert ds.index.skipped is ds.skipped
    assert len(ds) == 4 and ds.classes == ["a", "b"]
    logged = [r.getMessage() for r in caplog.records if r.name == "fastload.folder"]
    assert len(logged) == 2 and "skipped 3 hidden image-named file(s) such as 'a/._a_0.jpg'" in logged[0]
    # the non-image files: one line per scan, a count and an example (none disappears unsaid)
    assert "skipped 2 file(s) without an image extension such as 'b/.DS_Store'" in logged[1]
    tv = _torchvision_folder(root)
    # torchvision: 3 resource forks + the file in the hidden folder are samples, and a hidden class.
    assert len(tv) == len(ds) + 3 + 1 and ".ipynb_checkpoints" in tv.classes
    # The counts travel with the index: pickled to workers, saved and loaded.
    assert pickle.loads(pickle.dumps(ds.index)).skipped == ds.skipped
    ds.index.save(tmp_path / "i.npz")
    assert FolderIndex.load(tmp_path / "i.npz").skipped == ds.skipped
    assert FolderIndex(str(root), ["a/a_0.jpg"], [0], ds.class_index).skipped == {}


def test_scan_peak_memory_is_the_index_not_per_file_objects(tmp_path: Path) -> None:
    """A 200,000-file tree (hard links to an empty file, 100 classes): the scan's traced peak stays
    under ``1.25 * B + 24 * n + 4 MiB``, where ``B`` is the final path buffer and ``n`` the files.

    Why that bound: the finished index is ``B`` bytes of paths, ``8 (n + 1)`` of offsets and ``8 n``
    of targets; while scanning, the growing byte buffer can hold up to 1/8 of slack (CPython's
    ``bytearray`` over-allocation), the per-directory lengths (``8 n``) exist until the offsets are
    built, and one directory's names (2,000 here) are alive at a time (well under 4 MiB). Any
    per-file Python object kept to the end breaks it: a ``str`` path is 49 + 29 bytes and a
    ``bytes`` copy 33 + 29, so the former list-then-join scan peaked at about 35 MB here (and
    torchvision's list of tuples at 35 MB), against a bound of 16 MB.
    """
    import tracemalloc

    from fastload.synthetic import make_linked_tree

    split = make_linked_tree(tmp_path / "big", num_files=200_000, classes=100, empty=True)
    tracemalloc.start()
    try:
        index = scan_folder(split)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    n = len(index)
    assert n == 200_000 and np.bincount(index.targets).tolist() == [2000] * 100
    assert index.relpath(0) == "n01440764/n01440764_0.JPEG"
    assert index.relpath(1) == "n01440764/n01440764_1.JPEG"  # sorted as strings, as torchvision
    assert index.relpath(n - 1) == "n02224745/n02224745_999.JPEG"
    buffer_bytes = index.path_bytes.nbytes
    bound = 1.25 * buffer_bytes + 24 * n + 4 * 2**20
    assert peak <= bound, f"scan peaked at {peak / 1e6:.1f} MB, above the bound {bound / 1e6:.1f} MB"


# ------------------------------------------------------------------------------------ scan_list


def test_scan_list_flat_val_layout(tmp_path: Path) -> None:
    flat = tmp_path / "val_flat"
    flat.mkdir()
    for name in ("v1.JPEG", "v2.JPEG", "v 3.JPEG"):
        Image.new("RGB", (16, 16)).save(flat / name, format="JPEG")
    classes = ClassIndex(["n01", "n02", "n03"])
    (tmp_path / "labels.txt").write_text("# ground truth\nv1.JPEG n03\n\nv2.JPEG 0\nv 3.JPEG n02\n")
    index = scan_list(tmp_path / "labels.txt", flat, classes)
    assert [index.relpath(i) for i in range(3)] == ["v1.JPEG", "v2.JPEG", "v 3.JPEG"]
    assert index.targets.tolist() == [2, 0, 1]
    (tmp_path / "bad.txt").write_text("v1.JPEG n09\n")
    with pytest.raises(ValueError, match=r"bad.txt:1: unknown class 'n09'"):
        scan_list(tmp_path / "bad.txt", flat, classes)
    (tmp_path / "range.txt").write_text("v1.JPEG 7\n")
    with pytest.raises(ValueError, match=r"range.txt:1: label 7 is out of range"):
        scan_list(tmp_path / "range.txt", flat, classes)
    (tmp_path / "missing.txt").write_text("v1.JPEG n01\nnope.JPEG n01\n")
    with pytest.raises(FileNotFoundError, match=r"missing.txt:2: .*nope.JPEG"):
        scan_list(tmp_path / "missing.txt", flat, classes)


# ------------------------------------------------------------------------------------ ImageFolder


def test_image_folder_is_a_drop_in_for_torchvision(imagenet_root: Path) -> None:
    root = imagenet_root / "val"
    ours = ImageFolder(root)
    theirs = torchvision.datasets.ImageFolder(str(root))
    assert ours.classes == theirs.classes and ours.class_to_idx == theirs.class_to_idx
    assert list(ours.samples) == theirs.samples and list(ours.imgs) == theirs.imgs
    assert ours.targets.tolist() == theirs.targets and len(ours) == len(theirs)
    for i in range(len(ours)):
        a, ta = ours[i]
        b, tb = theirs[i]
        assert ta == tb and a.mode == "RGB" and np.array_equal(np.asarray(a), np.asarray(b))


def test_image_folder_transforms_and_loader(imagenet_root: Path) -> None:
    from torchvision import transforms as T

    ds = ImageFolder(
        imagenet_root / "val",
        transform=T.Compose([T.Resize(32), T.CenterCrop(32), T.PILToTensor()]),
        target_transform=str,
    )
    img, target = ds[0]
    assert img.shape == (3, 32, 32) and img.dtype == torch.uint8 and target == "0"
    ds = ImageFolder(imagenet_root / "val", loader=os.path.getsize)
    size, _ = ds[0]
    assert size == os.path.getsize(ds.samples[0][0])
    with pytest.raises(TypeError, match="transform should be callable"):
        ImageFolder(imagenet_root / "val", transform="flip")  # type: ignore[arg-type]


def test_corrupt_file_error_names_it(tmp_path: Path) -> None:
    root = _tree(tmp_path / "split", {"a": 2})
    (root / "a" / "a_1.jpg").write_bytes(b"\xff\xd8\xff\xe0 this is not really a jpeg")
    ds = ImageFolder(root)
    ds[0]
    with pytest.raises(DecodeError, match=r"sample 1 \('.*a_1.jpg'\)"):
        ds[1]


def _len_and_first_target(ds: ImageFolder) -> tuple[int, int, int]:
    img, t = ds[len(ds) - 1]
    return len(ds), t, img.size[0]


def _targets_only(batch: list[tuple[object, int]]) -> list[int]:
    return [t for _, t in batch]


def test_image_folder_pickles_for_spawn_workers(imagenet_root: Path) -> None:
    ds = ImageFolder(imagenet_root / "train")
    with mp.get_context("spawn").Pool(1) as pool:
        n, target, width = pool.apply(_len_and_first_target, (ds,))
    assert n == len(ds) and target == 3 and width == ds[len(ds) - 1][0].size[0]
    loader = torch.utils.data.DataLoader(
        ds, batch_size=4, num_workers=1, multiprocessing_context="spawn", collate_fn=_targets_only
    )
    assert sum(loader, []) == ds.targets.tolist()


# ------------------------------------------------------------------------------------ broadcast

_BROADCAST_SCRIPT = r"""
import os, sys, torch.distributed as dist
from fastload import scan_folder
dist.init_process_group("gloo", init_method=sys.argv[1], rank=int(sys.argv[2]), world_size=2)
if dist.get_rank() == 1:
    def no_walk(*a, **k):
        raise AssertionError("rank 1 walked the folder")
    os.scandir = no_walk  # prove that only rank 0 touches the file system
index = scan_folder(sys.argv[3], broadcast=True)
print(len(index), index.paths[0], int(index.targets[-1]))
try:
    scan_folder(sys.argv[3] + "/missing", broadcast=True)
except FileNotFoundError as e:
    print("error on rank", dist.get_rank(), "missing" in str(e))
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_scan_broadcast_from_rank_zero(imagenet_root: Path, tmp_path: Path) -> None:
    script = tmp_path / "bcast.py"
    script.write_text(_BROADCAST_SCRIPT)
    init = f"tcp://127.0.0.1:{_free_port()}"
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), init, str(r), str(imagenet_root / "train")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
    index = scan_folder(imagenet_root / "train")
    expected = f"{len(index)} {index.paths[0]} {int(index.targets[-1])}"
    assert outs[0][0].splitlines()[0] == expected == outs[1][0].splitlines()[0]
    assert outs[0][0].splitlines()[1] == "error on rank 0 True"
    assert outs[1][0].splitlines()[1] == "error on rank 1 True"
