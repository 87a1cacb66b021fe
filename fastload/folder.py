"""Class-index-consistent folder scanning: a split's files -> :class:`FolderIndex`.

torchvision's ``ImageFolder`` numbers the classes of *each split* by sorting that split's
directory names, so a validation folder that lacks one class shifts every later label, silently.
Here :class:`ClassIndex` is the one ordered list of class names (from the training folder or the
union of all splits, saved next to the checkpoints) and :func:`scan_folder` labels every split
from it. ``train/`` has classes ``a, b, c``; ``val/`` lacks ``b``::

    torchvision ImageFolder("val").class_to_idx     {'a': 0, 'c': 1}   <- c mislabelled
    classes = ClassIndex.from_folder("train")       ['a', 'b', 'c']
    scan_folder("val", classes).targets for c        2                  <- same as in train

Per-sample data lives in numpy arrays (relative paths in one byte buffer with offsets, int64
targets), so an index is cheap to pickle and shares pages after ``fork``. The first step of the
data flow: the datasets (:mod:`fastload.imagefolder`, :mod:`fastload.memory`) read samples through
a :class:`FolderIndex` and :mod:`fastload.pack` writes one.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload

import numpy as np

from ._checks import caller_stacklevel, read_error

__all__ = ["IMG_EXTENSIONS", "ClassIndex", "FolderIndex", "scan_folder", "scan_list"]

IMG_EXTENSIONS: tuple[str, ...] = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")

_INDEX_FORMAT = "fastload.FolderIndex"
_log = logging.getLogger(__name__)
_CLASSES_FORMAT = "fastload.ClassIndex"


class ClassIndex:
    """The ordered list of class names (unique non-empty strings) and their indices, shared by every
    split.

    Example:
        >>> ci = ClassIndex(["cat", "dog"])
        >>> ci.class_to_idx
        {'cat': 0, 'dog': 1}
        >>> ci.index("dog"), ci[0], len(ci)
        (1, 'cat', 2)
    """

    __slots__ = ("_classes", "_class_to_idx")

    def __init__(self, classes: Iterable[str]) -> None:
        names = tuple(classes)
        for name in names:
            if not isinstance(name, str) or not name:
                raise ValueError(f"class names should be non-empty strings, but got {name!r}")
        mapping = {name: i for i, name in enumerate(names)}
        if len(mapping) != len(names):
            seen: set[str] = set()
            dups = sorted({n for n in names if n in seen or seen.add(n)})  # type: ignore[func-returns-value]
            raise ValueError(f"class names should be unique, but these repeat: {dups}")
        self._classes = names
        self._class_to_idx = mapping

    @classmethod
    def from_folder(cls, root: str | os.PathLike[str]) -> ClassIndex:
        """The sorted names of the (non-hidden) subdirectories of ``root``, empty ones included."""
        return cls(_class_dirs(root))

    @classmethod
    def from_splits(cls, *roots: str | os.PathLike[str]) -> ClassIndex:
        """The sorted union of the class directories of several splits (e.g. train and val)."""
        if not roots:
            raise ValueError("from_splits needs at least one root folder")
        names: set[str] = set()
        for root in roots:
            names.update(_class_dirs(root))
        return cls(sorted(names))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ClassIndex:
        """Reads a class list written by :meth:`save` (or a plain JSON list of names)."""
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{os.fspath(path)!r} is not a JSON class list: {e}") from None
        if isinstance(data, dict):
            if data.get("format") != _CLASSES_FORMAT or "classes" not in data:
                raise ValueError(f"{os.fspath(path)!r} is not a fastload class list (no 'classes' key)")
            data = data["classes"]
        if not isinstance(data, list):
            raise ValueError(f"{os.fspath(path)!r} should hold a list of class names")
        return cls(data)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes the class list as human-readable JSON (one name per line)."""
        classes = list(self._classes)
        payload = {"format": _CLASSES_FORMAT, "version": 1, "num_classes": len(classes), "classes": classes}
        tmp = f"{os.fspath(path)}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)

    @property
    def classes(self) -> list[str]:
        """Class names in label order (a new list)."""
        return list(self._classes)

    @property
    def class_to_idx(self) -> dict[str, int]:
        """Name -> label (a new dict)."""
        return dict(self._class_to_idx)

    def index(self, name: str) -> int:
        """The label of ``name``; ``KeyError`` naming it when it is not a known class."""
        try:
            return self._class_to_idx[name]
        except KeyError:
            raise KeyError(
                f"unknown class {name!r}: it is not one of the {len(self)} classes of this ClassIndex"
            ) from None

    def __contains__(self, name: object) -> bool:
        return name in self._class_to_idx

    def __getitem__(self, i: int) -> str:
        return self._classes[i]

    def __iter__(self) -> Iterator[str]:
        return iter(self._classes)

    def __len__(self) -> int:
        return len(self._classes)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ClassIndex):
            return self._classes == other._classes
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._classes)

    def __repr__(self) -> str:
        shown = ", ".join(repr(c) for c in self._classes[:4])
        more = f", ... ({len(self)} classes)" if len(self) > 4 else ""
        return f"ClassIndex([{shown}{more}])"

    def __reduce__(self) -> tuple[Any, ...]:
        return (ClassIndex, (self._classes,))


def _class_dirs(root: str | os.PathLike[str]) -> list[str]:
    root = os.fspath(root)
    if not os.path.isdir(root):
        raise FileNotFoundError(f"dataset folder {root!r} does not exist or is not a directory")
    with os.scandir(root) as it:
        return sorted(e.name for e in it if not e.name.startswith(".") and e.is_dir(follow_symlinks=True))


#: Folder names taken for evaluation splits of the ``train`` split beside them.
EVAL_SPLITS = ("val", "valid", "validation", "test", "eval", "dev")


def _check_train_beside(root: str, found: list[str]) -> None:
    """Warns when an evaluation split (named as in :data:`EVAL_SPLITS`) labelled by its own class
    folders gives some classes other labels than the ``train`` split beside it."""
    parent, name = os.path.split(os.path.abspath(root))
    train = os.path.join(parent, "train")
    if name.lower() not in EVAL_SPLITS or not os.path.isdir(train):
        return
    try:
        train_classes = _class_dirs(train)
    except OSError:
        return
    label = {c: k for k, c in enumerate(train_classes)}
    moved = [c for k, c in enumerate(found) if c in label and label[c] != k]
    unknown = [c for c in found if c not in label]
    if len(unknown) == len(found) or not (moved or unknown):
        return  # no class in common (not train's split), or the same labels

    def names(classes: list[str]) -> str:
        return _listed([repr(c) for c in classes], 5)

    present = set(found)
    missing = [c for c in train_classes if c not in present]
    what = []
    if moved:
        what.append(f"{len(moved)} of its classes get another label than there ({names(moved)})")
    if unknown:
        what.append(f"{len(unknown)} are not classes of train ({names(unknown)})")
    if missing:
        what.append(f"{len(missing)} of train's classes have no folder here ({names(missing)})")
    warnings.warn(
        f"{root!r} is labelled by its own {len(found)} class folders, unlike {train!r} beside it: "
        + "; ".join(what)
        + f". Pass the training split's class list to every split, e.g. classes=ClassIndex.from_folder("
        f"{train!r}), to label them alike.",
        stacklevel=caller_stacklevel(),
    )


class _PathList(Sequence[str]):
    """A read-only sequence of full paths backed by one UTF-8 buffer and an offsets array."""

    __slots__ = ("_root", "_buf", "_offsets")

    def __init__(self, root: str, buf: np.ndarray, offsets: np.ndarray) -> None:
        self._root = root
        self._buf = buf
        self._offsets = offsets

    def relative(self, i: int) -> str:
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sample index {i} is out of range for a dataset of {n} samples")
        return self._buf[self._offsets[i] : self._offsets[i + 1]].tobytes().decode("utf-8", "surrogateescape")

    @overload
    def __getitem__(self, i: int) -> str: ...

    @overload
    def __getitem__(self, i: slice) -> list[str]: ...

    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return os.path.join(self._root, self.relative(int(i)))

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __repr__(self) -> str:
        return f"<{len(self)} paths under {self._root!r}>"


class FolderIndex:
    """The samples of one split: paths, int64 targets and the shared :class:`ClassIndex`.

    Built by :func:`scan_folder` or :func:`scan_list`; ``relpaths`` are relative to ``root``,
    ``targets`` index ``classes``.

    Attributes:
        skipped: What :func:`scan_folder` left out, counted by reason: ``hidden_files`` (image-named
            files starting with ``.``, e.g. macOS ``._x.JPEG``), ``hidden_dirs`` (folders starting
            with ``.``, not walked), ``repeated_dirs`` (links to a directory scanned already, e.g.
            a loop) and ``other_files`` (no image extension). Empty when not scanned.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        relpaths: Sequence[str] | None,
        targets: Sequence[int] | np.ndarray,
        classes: ClassIndex,
    ) -> None:
        encoded = [p.encode("utf-8", "surrogateescape") for p in (relpaths or ())]
        offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        if encoded:
            np.cumsum([len(e) for e in encoded], out=offsets[1:])
        self._assign(root, np.frombuffer(b"".join(encoded), dtype=np.uint8), offsets, targets, classes)

    @classmethod
    def from_buffers(
        cls,
        root: str | os.PathLike[str],
        path_bytes: np.ndarray,
        path_offsets: np.ndarray,
        targets: Sequence[int] | np.ndarray,
        classes: ClassIndex,
    ) -> FolderIndex:
        """An index over ready buffers (no copy), as a pack file or a shared segment exposes it:
        relative path ``i`` is ``path_bytes[path_offsets[i]:path_offsets[i + 1]]`` in UTF-8, e.g.
        ``b"a/1.jpgb/22.jpg"`` with ``[0, 7, 15]`` holds ``a/1.jpg`` and ``b/22.jpg``."""
        self = cls.__new__(cls)
        self._assign(root, path_bytes, path_offsets, targets, classes)
        return self

    def _assign(
        self,
        root: str | os.PathLike[str],
        buf: np.ndarray,
        offsets: np.ndarray,
        targets: Sequence[int] | np.ndarray,
        classes: ClassIndex,
    ) -> None:
        if not isinstance(classes, ClassIndex):
            raise TypeError(f"classes should be a ClassIndex, but got {type(classes).__name__}")
        self.root = os.fspath(root)
        self._buf = buf
        self._offsets = offsets
        self.targets: np.ndarray = np.ascontiguousarray(np.asarray(targets, dtype=np.int64))
        if len(self.targets) != len(offsets) - 1:
            raise ValueError(f"got {len(offsets) - 1} paths but {len(self.targets)} targets")
        if len(self.targets) and (self.targets.min() < 0 or self.targets.max() >= len(classes)):
            bad = int(self.targets[(self.targets < 0) | (self.targets >= len(classes))][0])
            raise ValueError(f"target {bad} is out of range for {len(classes)} classes")
        self.classes = classes
        self.skipped: dict[str, int] = {}

    @property
    def path_bytes(self) -> np.ndarray:
        """The relative paths as one ``uint8`` buffer of UTF-8, back to back (see :meth:`from_buffers`)."""
        return self._buf

    @property
    def path_offsets(self) -> np.ndarray:
        """``int64[n + 1]``: relative path ``i`` is ``path_bytes[path_offsets[i]:path_offsets[i + 1]]``."""
        return self._offsets

    @property
    def paths(self) -> _PathList:
        """Full paths (``root/relative``), as a lazy sequence of ``str``."""
        return _PathList(self.root, self._buf, self._offsets)

    def relpath(self, i: int) -> str:
        """The relative path of sample ``i`` (as stored in pack files and index files)."""
        return self.paths.relative(i)

    def read_bytes(self, i: int) -> bytes:
        """The encoded file of sample ``i``; an ``OSError`` names the sample and its path."""
        path = self.paths[i]
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as e:
            raise read_error(e, i, path) from e

    def __len__(self) -> int:
        return len(self.targets)

    def __repr__(self) -> str:
        return f"FolderIndex(root={self.root!r}, samples={len(self)}, classes={len(self.classes)})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, FolderIndex):
            return NotImplemented
        return (
            self.root == other.root
            and self.classes == other.classes
            and np.array_equal(self.targets, other.targets)
            and np.array_equal(self._offsets, other._offsets)
            and np.array_equal(self._buf, other._buf)
        )

    def subset(self, indices: Sequence[int] | np.ndarray) -> FolderIndex:
        """A new index of the given samples (same root and classes), in the given order."""
        idx = np.asarray(indices, dtype=np.int64)
        return FolderIndex(self.root, [self.relpath(int(i)) for i in idx], self.targets[idx], self.classes)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes the index to ``path`` (a ``.npz`` file; reloading 1.28M entries takes < 1 s)."""
        meta = dict(
            format=_INDEX_FORMAT, version=1, root=self.root, classes=list(self.classes), skipped=self.skipped
        )
        meta_bytes = np.frombuffer(json.dumps(meta).encode("utf-8"), dtype=np.uint8)
        tmp = f"{os.fspath(path)}.tmp"
        with open(tmp, "wb") as f:
            np.savez(f, meta=meta_bytes, buf=self._buf, offsets=self._offsets, targets=self.targets)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike[str], root: str | os.PathLike[str] | None = None) -> FolderIndex:
        """Reads an index written by :meth:`save`; ``root``: where the images are now, if they moved."""
        try:
            with np.load(path, allow_pickle=False) as z:
                meta = json.loads(z["meta"].tobytes().decode("utf-8"))
                buf, offsets, targets = z["buf"], z["offsets"], z["targets"]
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"{os.fspath(path)!r} is not a readable fastload index file: {e}") from None
        if meta.get("format") != _INDEX_FORMAT:
            raise ValueError(
                f"{os.fspath(path)!r} is not a fastload index file (format {meta.get('format')!r})"
            )
        if meta.get("version") != 1:
            raise ValueError(
                f"{os.fspath(path)!r} has index format version {meta.get('version')}, "
                "this fastload reads version 1"
            )
        index = cls.from_buffers(
            root if root is not None else meta["root"], buf, offsets, targets, ClassIndex(meta["classes"])
        )
        index.skipped = dict(meta.get("skipped", {}))
        return index

    def __getstate__(self) -> dict[str, Any]:
        # compact for spawned workers: path lengths and targets in the smallest unsigned type
        lengths = np.diff(self._offsets)
        return {
            "root": self.root,
            "buf": self._buf,
            "lengths": lengths.astype(_smallest_uint(lengths)),
            "targets": self.targets.astype(_smallest_uint(self.targets)),
            "classes": self.classes,
            "skipped": self.skipped,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.root = state["root"]
        self._buf = state["buf"]
        self._offsets = np.zeros(len(state["lengths"]) + 1, dtype=np.int64)
        np.cumsum(state["lengths"], out=self._offsets[1:])
        self.targets = np.ascontiguousarray(state["targets"], dtype=np.int64)
        self.classes = state["classes"]
        self.skipped = state.get("skipped", {})


def _smallest_uint(values: np.ndarray) -> type[np.unsignedinteger[Any]]:
    """The smallest unsigned dtype holding ``values`` (all >= 0), e.g. ``uint16`` for ImageNet's targets."""
    top = int(values.max()) if len(values) else 0
    for dtype in (np.uint8, np.uint16, np.uint32):
        if top <= np.iinfo(dtype).max:
            return dtype
    return np.uint64


def _is_dir(entry: os.DirEntry[bytes]) -> bool:
    """``entry.is_dir()`` following links; an entry whose link cannot be resolved (a link to itself)
    is a file, as ``os.walk`` treats it."""
    try:
        return entry.is_dir()
    except OSError:
        return False


class _Scan:
    """The state of one :func:`scan_folder` walk: relative paths appended to one byte buffer as
    directories are read (no per-file Python objects outlive their directory), their lengths,
    the directories seen (by device and inode) and what was skipped."""

    def __init__(self, extensions: tuple[str, ...]) -> None:
        self.extensions = tuple(os.fsencode(e) for e in extensions)
        self.buf = bytearray()
        self.lengths: list[np.ndarray] = []
        self.seen: dict[tuple[int, int], bytes] = {}
        self.repeated: list[tuple[str, str]] = []  # (link or folder, the path it was first scanned at)
        self.skipped = dict.fromkeys(("hidden_files", "hidden_dirs", "repeated_dirs", "other_files"), 0)
        self.hidden_example: str | None = None
        self.other_example: str | None = None  # a file without an image extension, for the log

    def mark_seen(self, path: bytes) -> bool:
        """Records a directory; ``False`` if the same directory (device, inode) was seen before."""
        st = os.stat(path)
        key = (st.st_dev, st.st_ino)
        first = self.seen.get(key)
        if first is not None:
            self.skipped["repeated_dirs"] += 1
            self.repeated.append((os.fsdecode(path), os.fsdecode(first)))
            return False
        self.seen[key] = path
        return True

    def walk_class(self, top: bytes, rel: bytes) -> int:
        """Appends the image files below ``top`` (relative paths starting with ``rel``); returns
        how many. Directories are listed in torchvision's order (``sorted(os.walk(top))``: by
        path string), files sorted by name within each directory."""
        groups: list[tuple[bytes, list[bytes]]] = []
        stack = [(top, rel)]
        skipped = self.skipped
        while stack:
            folder, folder_rel = stack.pop()
            with os.scandir(folder) as it:
                entries = list(it)
            try:
                names = [e.name for e in entries if not e.is_dir()]  # follows links
            except OSError:  # a link that cannot be resolved: see _is_dir
                names = [e.name for e in entries if not _is_dir(e)]
            if len(names) < len(entries):
                # sorted, so which of two links to one directory counts as "first" is deterministic
                for e in sorted((e for e in entries if _is_dir(e)), key=lambda e: os.fsdecode(e.name)):
                    if e.name.startswith(b"."):
                        skipped["hidden_dirs"] += 1
                    elif self.mark_seen(e.path):
                        stack.append((e.path, folder_rel + b"/" + e.name))
            files = [n for n in names if n.lower().endswith(self.extensions)]
            if len(files) < len(names):
                skipped["other_files"] += len(names) - len(files)
                if self.other_example is None:
                    other = min(n for n in names if not n.lower().endswith(self.extensions))
                    self.other_example = os.fsdecode(folder_rel + b"/" + other)
            joined = b"/" + b"/".join(files)
            if b"/." in joined:  # hidden image-named files: torchvision would list (and fail on) them
                hidden = [n for n in files if n.startswith(b".")]
                skipped["hidden_files"] += len(hidden)
                if self.hidden_example is None:
                    self.hidden_example = os.fsdecode(folder_rel + b"/" + min(hidden))
                files = [n for n in files if not n.startswith(b".")]
            # torchvision sorts str names; UTF-8 bytes sort alike, so only non-ASCII names need decoding
            files.sort(key=None if joined.isascii() else os.fsdecode)
            groups.append((folder_rel, files))
        if len(groups) > 1:
            groups.sort(key=lambda g: os.fsdecode(g[0]))
        total = 0
        for folder_rel, files in groups:
            if not files:
                continue
            prefix = folder_rel + b"/"
            self.buf += prefix
            self.buf += prefix.join(files)  # prefix + join = "d/f1" "d/f2" ... back to back
            self.lengths.append(np.fromiter(map(len, files), dtype=np.int64, count=len(files)) + len(prefix))
            total += len(files)
        return total

    def offsets(self) -> np.ndarray:
        offsets = np.zeros(1 + sum(len(a) for a in self.lengths), dtype=np.int64)
        if self.lengths:
            np.concatenate(self.lengths, out=offsets[1:])
        self.lengths = []
        np.cumsum(offsets, out=offsets)
        return offsets


def _normalize_extensions(extensions: str | Iterable[str]) -> tuple[str, ...]:
    exts = (extensions,) if isinstance(extensions, str) else tuple(extensions)
    if not exts:
        raise ValueError("extensions should name at least one file extension, e.g. ('.jpeg', '.png')")
    return tuple(e.lower() if e.startswith(".") else f".{e.lower()}" for e in exts)


def _coerce_classes(classes: ClassIndex | Sequence[str] | str | os.PathLike[str] | None) -> ClassIndex | None:
    if classes is None or isinstance(classes, ClassIndex):
        return classes
    if isinstance(classes, (str, os.PathLike)):
        return ClassIndex.load(classes)
    return ClassIndex(classes)


def scan_folder(
    root: str | os.PathLike[str],
    classes: ClassIndex | Sequence[str] | str | os.PathLike[str] | None = None,
    extensions: str | Iterable[str] = IMG_EXTENSIONS,
    strict: bool = True,
    broadcast: bool = False,
    allow_empty: bool = False,
) -> FolderIndex:
    """Scans ``root/<class>/**/<file>`` into a :class:`FolderIndex` labelled by ``classes``: classes
    in label order, within a class torchvision's order (directories by path, files by name).

    Args:
        classes: The canonical class list (a :class:`ClassIndex`, a list of names or the path of a
            saved class list). ``None``: the sorted subdirectories of ``root`` (torchvision's rule).
        extensions: File name endings (case-insensitive) that count as images. Other files and
            hidden entries (``._x.JPEG``, ``.git``) are skipped, counted in
            :attr:`FolderIndex.skipped` and logged at INFO level.
        strict: A subdirectory that is not in ``classes`` raises ``ValueError``; with
            ``strict=False`` a warning names it and its files are left out.
        broadcast: With ``torch.distributed`` initialized, scan on rank 0 and broadcast the index.
        allow_empty: Return an empty index when no file is found (torchvision's ``allow_empty``).

    Symbolic links are followed; a directory reached twice (a loop, a second link) is walked once
    (a warning names the links). ``FileNotFoundError`` if ``root`` is not a directory, or (unless
    ``allow_empty``) no class folder holds an image file, in torchvision's words.
    """
    if broadcast:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            box: list[Any] = [None]
            if dist.get_rank() == 0:
                try:
                    box[0] = scan_folder(root, classes, extensions, strict, False, allow_empty)
                except Exception as e:  # noqa: BLE001 - re-raised on every rank below, so no rank hangs
                    box[0] = e
            dist.broadcast_object_list(box, src=0)
            if isinstance(box[0], Exception):
                raise box[0]
            return box[0]
    root = os.fspath(root)
    exts = _normalize_extensions(extensions)
    class_index = _coerce_classes(classes)
    found = _class_dirs(root)
    if class_index is None:
        class_index = ClassIndex(found)
        _check_train_beside(root, found)
    unknown = [d for d in found if d not in class_index]
    if unknown:
        shown = _listed([repr(d) for d in unknown], 10)
        msg = (
            f"{root!r} has {len(unknown)} class director{'y' if len(unknown) == 1 else 'ies'} that "
            f"{'is' if len(unknown) == 1 else 'are'} not in the class list: {shown}. "
        )
        if strict:
            raise ValueError(
                msg + "Pass the class list that includes them (e.g. ClassIndex.from_splits(train, val)), "
                "or strict=False to leave their files out."
            )
        warnings.warn(msg + "Their files are left out (strict=False).", stacklevel=2)
    scan = _Scan(exts)
    loose: list[str] = []
    with os.scandir(root) as it:
        for entry in it:
            if entry.name.startswith("."):
                if entry.is_dir():
                    scan.skipped["hidden_dirs"] += 1
            elif entry.name.lower().endswith(exts) and entry.is_file():
                loose.append(entry.name)
    if loose:
        loose.sort()
        warnings.warn(
            f"{root!r} holds {len(loose)} image file(s) outside any class directory (e.g. {loose[0]!r}); "
            "they are not samples of this split. For a flat folder with a label file use scan_list().",
            stacklevel=2,
        )
    present = set(found)
    broot = os.fsencode(root)
    scan.mark_seen(broot)
    # registered before the walk: a link inside one class to another class's folder is not walked twice
    class_dirs = {name: os.path.join(broot, os.fsencode(name)) for name in class_index if name in present}
    walkable = {name for name, path in class_dirs.items() if scan.mark_seen(path)}
    counts = np.zeros(len(class_index), dtype=np.int64)
    for label, name in enumerate(class_index):
        if name in walkable:
            counts[label] = scan.walk_class(class_dirs[name], os.fsencode(name))
    total = int(counts.sum())
    if scan.repeated:
        links = [f"{link!r} (already scanned as {first!r})" for link, first in scan.repeated]
        shown = _listed(links, 5, "; ")
        warnings.warn(
            f"{len(scan.repeated)} director{'y' if len(scan.repeated) == 1 else 'ies'} under {root!r} "
            f"lead to a directory scanned before (a symbolic link loop or a second link to it), "
            f"so their files are not scanned again: {shown}. Remove the link(s) to silence this.",
            stacklevel=2,
        )
    if scan.skipped["hidden_files"]:
        _log.info(
            "scan_folder(%r): skipped %d hidden image-named file(s) such as %r (macOS '._' files are "
            "not images; torchvision's ImageFolder would list them)",
            root,
            scan.skipped["hidden_files"],
            scan.hidden_example,
        )
    if scan.skipped["other_files"]:
        _log.info(
            "scan_folder(%r): skipped %d file(s) without an image extension such as %r (extensions: %s)",
            root,
            scan.skipped["other_files"],
            scan.other_example,
            ", ".join(exts),
        )
    if not total and not allow_empty:
        looked_in = [name for name in class_index if name in present] or list(class_index)
        raise FileNotFoundError(_no_files_message(root, looked_in, exts))
    missing = [class_index[int(i)] for i in np.flatnonzero(counts == 0)]
    if missing and total > 0:
        shown = _listed([repr(m) for m in missing], 10)
        warnings.warn(
            f"{len(missing)} of {len(class_index)} classes have no samples in {root!r}: {shown}. "
            "The labels of the other classes are unchanged.",
            stacklevel=caller_stacklevel(),
        )
    offsets = scan.offsets()
    path_bytes = np.frombuffer(scan.buf, dtype=np.uint8) if scan.buf else np.zeros(0, dtype=np.uint8)
    targets = np.repeat(np.arange(len(class_index), dtype=np.int64), counts)
    index = FolderIndex.from_buffers(root, path_bytes, offsets, targets, class_index)
    index.skipped = scan.skipped
    return index


def _no_files_message(root: str, classes: Sequence[str], extensions: tuple[str, ...]) -> str:
    """torchvision's wording, plus the folder: ``Found no valid file for the classes a, b in 'val'. ...``."""
    if classes:
        what = f"Found no valid file for the classes {_listed(classes, 10)} in {root!r}."
    else:
        what = f"Found no valid file for the classes of {root!r}: it has no class folders."
    return f"{what} Supported extensions are: {', '.join(extensions)}"


def _listed(items: Sequence[str], limit: int, sep: str = ", ") -> str:
    """The first ``limit`` of ``items`` joined by ``sep``, then `` and N more``."""
    return sep.join(items[:limit]) + (f" and {len(items) - limit} more" if len(items) > limit else "")


def scan_list(
    list_file: str | os.PathLike[str],
    root: str | os.PathLike[str],
    classes: ClassIndex | Sequence[str] | str | os.PathLike[str],
    check_files: bool = True,
) -> FolderIndex:
    """Builds an index from a label file, for flat layouts such as the official ImageNet val folder.

    Each non-empty line is ``relative/path label`` (``label``: a class name or an index into
    ``classes``; the last whitespace-separated field, so paths may hold spaces); ``#`` starts a
    comment line. ``check_files``: check that every listed file exists (one ``stat`` each).
    """
    class_index = _coerce_classes(classes)
    if class_index is None:
        raise ValueError(
            "scan_list needs the class list: classes=ClassIndex.from_folder(train_root) or a saved one"
        )
    root = os.fspath(root)
    relpaths: list[str] = []
    targets: list[int] = []
    with open(list_file, encoding="utf-8") as f:
        for lineno, raw in enumerate(f, 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.rsplit(None, 1)
            if len(parts) != 2:
                raise ValueError(
                    f"{os.fspath(list_file)}:{lineno}: expected 'relative/path label', got {line!r}"
                )
            rel, label = parts
            if label in class_index:
                target = class_index.index(label)
            elif label.lstrip("-").isdigit():
                target = int(label)
                if not 0 <= target < len(class_index):
                    raise ValueError(
                        f"{os.fspath(list_file)}:{lineno}: label {target} is out of range "
                        f"for {len(class_index)} classes"
                    )
            else:
                raise ValueError(
                    f"{os.fspath(list_file)}:{lineno}: unknown class {label!r} "
                    f"(not in the {len(class_index)} classes)"
                )
            if check_files and not os.path.isfile(os.path.join(root, rel)):
                raise FileNotFoundError(
                    f"{os.fspath(list_file)}:{lineno}: {os.path.join(root, rel)!r} does not exist"
                )
            relpaths.append(rel)
            targets.append(target)
    return FolderIndex(root, relpaths, targets, class_index)
