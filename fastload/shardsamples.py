"""Gathering a tar shard's members into samples, as webdataset does: :func:`gather_samples`.

A sample is a run of consecutive members sharing a key (the name up to the first dot of its file
name, with its folder): its image (the first ``.jpg``, ``.jpeg`` or ``.png``, case-insensitive)
and its label member (``.cls``: an integer as text; another extension: a class name mapped
through the class list). Members without an extension are no part of a sample. The grouping runs
in bulk with numpy over the indexes' name buffers (:func:`_group`, 2**18 members at a time); where
that cannot tell (a sample incomplete or in pieces, two labels, a cut-short shard, a very long
key), the shard is gone through member by member (:class:`_Shard`), which says what is wrong,
naming the shard and the sample. Data flow: :class:`~fastload.tarindex.TarIndex` per shard
--:func:`gather_samples`--> per-sample numpy arrays --> :class:`fastload.shards.TarShards`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .folder import ClassIndex
from .pack import CorruptSampleError
from .shardsource import ShardSource
from .tarindex import TarIndex

__all__ = ["IMAGE_EXTENSIONS", "Samples", "gather_samples"]

#: Member extensions read as the sample's image (case-insensitive; the first such member counts).
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png")

_CHUNK = 1 << 18  # members grouped at once, at most (unless one shard holds more)
_MAX_KEY = 256  # bytes: shards with a longer key are grouped member by member


def _spans(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The positions ``starts[k]``, ..., ``starts[k] + lengths[k] - 1`` of every span ``k``, back to back."""
    ends = np.cumsum(lengths)
    return np.arange(ends[-1] if len(ends) else 0) + np.repeat(starts - (ends - lengths), lengths)


def _join(parts: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Buffers with their offsets (item ``k`` is ``buf[offsets[k]:offsets[k + 1]]``), back to back."""
    shift = np.cumsum([0] + [len(buf) for buf, _ in parts])
    offsets = [o[:-1] + s for (_, o), s in zip(parts, shift.tolist(), strict=False)]
    return np.concatenate([buf for buf, _ in parts]), np.concatenate([*offsets, shift[-1:]]).astype(np.int64)


def _group(index: TarIndex, first: np.ndarray, label: str) -> tuple[np.ndarray, np.ndarray] | None:
    """Each sample's image and label member (as :meth:`_Shard.group` finds them) in ``index``, the
    members of consecutive shards (shard ``k``'s from ``first[k]``), in bulk over its name buffer;
    ``None`` where that cannot tell (a sample incomplete or in pieces, a key over :data:`_MAX_KEY`
    bytes, an extension in non-ASCII capitals): then :meth:`_Shard.group` says what is wrong."""
    buf, bounds = index.names, index.name_offsets
    n = len(index)
    slash = np.flatnonzero(buf == ord("/"))
    of = np.searchsorted(bounds, slash, side="right") - 1
    last = np.diff(of, append=n) != 0  # the last slash of each name
    base = bounds[:-1].copy()  # where each file name starts, after its last slash
    base[of[last]] = slash[last] + 1
    dot = np.flatnonzero(buf == ord("."))
    of = np.searchsorted(bounds, dot, side="right") - 1
    dot, of = dot[dot >= base[of]], of[dot >= base[of]]
    firsts = np.diff(of, prepend=-1) != 0  # the first dot of each file name
    dots = np.full(n, -1, dtype=np.int64)
    dots[of[firsts]] = dot[firsts]
    j = np.flatnonzero(dots > base)  # the members with an extension: the samples' members
    if not len(j):
        return j, j
    shard = np.searchsorted(first, j, side="right") - 1
    size = dots[j] - bounds[j]  # of each key
    width = int(size.max())
    if width > _MAX_KEY:
        return None
    keys = np.zeros((len(j), -(-width // 8) * 8), dtype=np.uint8)  # each key, padded with zeros
    padded = np.concatenate([buf, np.zeros(width, dtype=np.uint8)])
    for k in range(width):
        keys[:, k] = padded[bounds[j] + k] * (k < size)
    words = keys.view(np.uint64)
    same = (words[1:] == words[:-1]).all(axis=1) & (size[1:] == size[:-1]) & (shard[1:] == shard[:-1])
    new = np.r_[True, ~same]  # where a sample starts
    weights = np.random.default_rng(56).integers(2**64, size=words.shape[1] + 2, dtype=np.uint64)
    hashed = (words[new] * weights[:-2]).sum(axis=1, dtype=np.uint64)
    hashed += shard[new].astype(np.uint64) * weights[-2] + size[new].astype(np.uint64) * weights[-1]
    hashed.sort()
    if (hashed[1:] == hashed[:-1]).any():
        return None  # a key's members in pieces (or two keys' hashes alike: also told apart one by one)
    samples = len(hashed)
    sample = np.cumsum(new) - 1  # of each member in j
    start, length = dots[j] + 1, bounds[j + 1] - dots[j] - 1

    def extension(ext: bytes) -> np.ndarray:
        ok = length == len(ext)
        for k, c in enumerate(ext):
            found = buf[start[ok] + k]
            ok[ok] = (found | ((found >= ord("A")) & (found <= ord("Z"))).astype(np.uint8) * 32) == c
        return ok

    image = extension(b"jpg") | extension(b"jpeg") | extension(b"png")
    lab = extension(label.encode("utf-8", "surrogateescape"))
    firsts = np.diff(sample[image], prepend=-1) != 0  # the first image member of each sample
    if (np.bincount(sample[lab], minlength=samples) != 1).any() or np.count_nonzero(firsts) < samples:
        return None
    return j[image][firsts], j[lab]


class _Shard:
    """One shard while its samples are gathered: member by member where the bulk grouping cannot
    tell (:meth:`group`: it says what is wrong), and its members' names and data for messages."""

    def __init__(self, number: int, source: ShardSource, index: TarIndex) -> None:
        self.number, self.source, self.index = number, source, index
        self._names: list[str] | None = None

    @property
    def names(self) -> list[str]:
        if self._names is None:  # decoded only where the bulk grouping cannot tell, or for a message
            self._names = self.index.name_list()
        return self._names

    def where(self, j: int) -> str:
        return f"member {self.names[j]!r} of shard {self.source.name!r}"

    def group(self, label: str) -> tuple[np.ndarray, np.ndarray]:
        """Each sample's image and label member, grouping the members by key (WebDataset's rule: the
        name up to the first dot of its file name, with its folder), checking each key's members
        are consecutive and complete."""
        names = self.names
        images: list[int] = []
        labels: list[int] = []
        done: set[str] = set()
        key: str | None = None
        image = lab = -1
        exts: list[str] = []
        for j in range(len(names) + 1):
            if j < len(names):
                name = names[j]
                slash = name.rfind("/") + 1
                dot = name.find(".", slash)
                if dot <= slash:
                    continue  # no extension (or a hidden name): not a part of a sample, as for webdataset
                k, ext = name[:dot], name[dot + 1 :]
            else:
                k, ext = None, ""
            if k != key:
                if key is not None:
                    self._close(key, image, lab, exts, label, j)
                    images.append(image)
                    labels.append(lab)
                    done.add(key)
                if k is not None and k in done:
                    raise self._pieces(k, j)
                key, image, lab, exts = k, -1, -1, []
            exts.append(ext)
            low = ext.lower()
            if low in IMAGE_EXTENSIONS:
                if image < 0:
                    image = j
            elif low == label:
                if lab >= 0:
                    raise ValueError(f"sample {key!r} of shard {self.source.name!r} has two .{label} members")
                lab = j
        return np.array(images, dtype=np.int64), np.array(labels, dtype=np.int64)

    def _pieces(self, key: str, j: int) -> ValueError:
        return ValueError(
            f"the members of sample {key!r} of shard {self.source.name!r} are not consecutive "
            f"({self.where(j)} comes after other samples' members): webdataset reads a sample's "
            "members as one run. Write the shard with each sample's files next to each other "
            "(e.g. tar --sort=name, or python -m fastload shards)"
        )

    def _close(self, key: str, image: int, lab: int, exts: list[str], label: str, j: int) -> None:
        """Checks the sample ``key`` (whose members end before member ``j``), or says what it lacks."""
        if image >= 0 and lab >= 0:
            return
        for later in range(j, len(self.names)):  # its missing member further on: a split sample
            if self.names[later].startswith(key + ".") and "/" not in self.names[later][len(key) :]:
                raise self._pieces(key, later)
        what = "image (.jpg, .jpeg or .png)" if image < 0 else f"label (.{label})"
        index = self.index
        last = self.names[-1] if self.names else ""
        if not index.complete and last.startswith(key + "."):
            raise CorruptSampleError(
                f"shard {self.source.name!r} is cut short: it stops at byte {index.end} with no "
                f"end-of-archive block, inside sample {key!r} (no {what} member; the last member is "
                f"{last!r}). "
                "Copy the shard again, or write it again (python -m fastload shards SRC OUT)"
            )
        raise ValueError(
            f"sample {key!r} of shard {self.source.name!r} has no {what} member (its members: "
            f"{', '.join('.' + e for e in exts)}): a sample needs an image (.jpg, .jpeg or .png) and a "
            f"label (.{label}). Write the shard with both, or pass label='<ext>' naming the member that "
            "holds the label"
        )

    def content(self, j: int) -> bytes:
        """The data of a (small) member: kept in the index, else read."""
        data = self.index.small(j)
        if data is None:
            size = int(self.index.sizes[j])
            data = self.source.read(int(self.index.offsets[j]), size)
            if len(data) < size:
                raise CorruptSampleError(f"{self.where(j)} is cut short: the shard ends inside it")
        return data


class _Group:
    """Consecutive shards whose samples are gathered at once: ``images`` and ``labels`` number
    each sample's members in :attr:`index`, the shards' members back to back (shard ``k``'s from
    ``first[k]``)."""

    def __init__(self, shards: list[_Shard], label: str) -> None:
        self.shards = shards
        indexes = [p.index for p in shards]
        self.first = np.cumsum([0] + [len(ix) for ix in indexes])
        names, name_offsets = _join([(ix.names, ix.name_offsets) for ix in indexes])
        inline, inline_offsets = _join([(ix.inline, ix.inline_offsets) for ix in indexes])
        offsets, sizes = (np.concatenate([getattr(ix, a) for ix in indexes]) for a in ("offsets", "sizes"))
        self.index = TarIndex((0, 0), names, name_offsets, offsets, sizes, inline, inline_offsets, 0, True)
        found = _group(self.index, self.first, label)
        if found is None:  # member by member, shard by shard: says what is wrong
            pairs = [p.group(label) for p in shards]
            found = (
                np.concatenate([i + f for (i, _), f in zip(pairs, self.first.tolist(), strict=False)]),
                np.concatenate([la + f for (_, la), f in zip(pairs, self.first.tolist(), strict=False)]),
            )
        self.images, self.labels = found
        self.shard = np.searchsorted(self.first, self.images, side="right") - 1  # (in shards)

    def label_member(self, k: int) -> tuple[_Shard, int]:
        """The shard of sample ``k`` and its label member there."""
        s = int(self.shard[k])
        return self.shards[s], int(self.labels[k] - self.first[s])

    def cls_labels(self, limit: int | None) -> np.ndarray:
        """The samples' ``.cls`` labels: in bulk where each is 1 to 18 ASCII digits kept in the index
        (as the converter and webdataset write them), else one by one (naming a bad one)."""
        index = self.index
        start = index.inline_offsets[self.labels]
        size = index.inline_offsets[self.labels + 1] - start
        digits = index.inline[_spans(start, size)].astype(np.int64) - ord("0")
        if ((size == index.sizes[self.labels]) & (size >= 1) & (size <= 18)).all() and (
            (digits >= 0) & (digits <= 9)
        ).all():
            end = np.cumsum(size)
            place = np.repeat(end, size) - 1 - np.arange(len(digits))  # the digits after each in its label
            values = np.add.reduceat(digits * 10**place, end - size) if len(digits) else digits
            if limit is None or values.max(initial=0) < limit:
                return values
        return np.array(
            [_cls_label(*self.label_member(k), limit) for k in range(len(self.labels))], dtype=np.int64
        )

    def sample_names(self, rels: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Each sample's name (its shard's ``rels`` entry, then its image member's name) in UTF-8,
        back to back, and the ``int64[n + 1]`` offsets of each."""
        encoded = [rels[p.number].encode("utf-8", "surrogateescape") for p in self.shards]
        rel_size = np.array([len(e) for e in encoded], dtype=np.int64)
        rel_start = np.cumsum(rel_size) - rel_size
        bounds = self.index.name_offsets
        size = bounds[self.images + 1] - bounds[self.images]
        starts = np.stack([rel_start[self.shard], bounds[self.images] + rel_size.sum()], axis=1).ravel()
        sizes = np.stack([rel_size[self.shard], size], axis=1).ravel()
        source = np.concatenate([np.frombuffer(b"".join(encoded), dtype=np.uint8), self.index.names])
        offsets = np.zeros(len(size) + 1, dtype=np.int64)
        np.cumsum(rel_size[self.shard] + size, out=offsets[1:])
        return source[_spans(starts, sizes)], offsets


def _chunks(sizes: list[int]) -> list[tuple[int, int]]:
    """Runs ``(a, b)`` of consecutive shards of at most :data:`_CHUNK` members (or one shard), given
    the members of each."""
    bounds, total = [0], 0
    for k, size in enumerate(sizes):
        if total and total + size > _CHUNK:
            bounds.append(k)
            total = 0
        total += size
    return list(zip(bounds, [*bounds[1:], len(sizes)], strict=True))


def _targets(groups: list[_Group], label: str, classes: ClassIndex | None) -> tuple[np.ndarray, ClassIndex]:
    """The samples' int64 labels and the class list, from their label members."""
    if label == "cls":
        limit = len(classes) if classes is not None else None
        targets = np.concatenate([g.cls_labels(limit) for g in groups])
        if classes is None:
            classes = ClassIndex(str(k) for k in range(int(targets.max()) + 1))
        return targets, classes
    members = [g.label_member(k) for g in groups for k in range(len(g.labels))]
    names: list[str] = []
    for p, j in members:
        try:
            names.append(p.content(j).decode("utf-8").strip())
        except UnicodeDecodeError:
            raise ValueError(f"{p.where(j)} should hold a class name in UTF-8") from None
    if classes is None:
        classes = ClassIndex(sorted(set(names)))
    mapping = classes.class_to_idx
    targets = np.empty(len(names), dtype=np.int64)
    for k, (p, j) in enumerate(members):
        label_of = mapping.get(names[k])
        if label_of is None:
            raise ValueError(
                f"{p.where(j)} names the class {names[k]!r}, which is not one of the {len(classes)} "
                "classes given: pass the class list that includes it (e.g. the training split's "
                "classes, or classes=None for the names found, sorted)"
            )
        targets[k] = label_of
    return targets, classes


def _cls_label(p: _Shard, j: int, limit: int | None) -> int:
    """The label in ``.cls`` member ``j`` of shard ``p``, or an error naming it."""
    text = p.content(j)
    try:
        value = int(text)
    except ValueError:
        raise ValueError(
            f"{p.where(j)} should hold a class index as text (such as b'3'), but holds "
            f"{text[:40]!r}: pass label='<ext>' if the label members hold class names"
        ) from None
    if value < 0 or (limit is not None and value >= limit):
        bound = f"below the {limit} classes given" if limit is not None else "non-negative"
        raise ValueError(
            f"{p.where(j)} holds the label {value}, which should be {bound}: pass the class "
            "list these shards were written with (classes=...)"
        )
    return value


@dataclass(frozen=True)
class Samples:
    """What :func:`gather_samples` found: per sample (in shard order, then member order) its
    shard (``int32``), its image member's data offset and size (``int64``), its label; its name
    (the shard's ``rels`` entry, then the member's name, UTF-8) in one buffer with offsets."""

    shard: np.ndarray
    offset: np.ndarray
    size: np.ndarray
    targets: np.ndarray
    classes: ClassIndex
    names: np.ndarray
    name_offsets: np.ndarray


def gather_samples(
    sources: Sequence[ShardSource],
    indexes: Sequence[TarIndex],
    label: str,
    classes: ClassIndex | None,
    rels: list[str],
) -> Samples:
    """The samples of the shards ``sources`` (their ``indexes``), with labels from the ``label``
    members (``classes``: ``None`` for the integers' names or the names found, sorted); ``rels``:
    each shard's name in the samples' names.

    Raises:
        ValueError: A sample without image or label, in pieces, with two labels; an unknown class
            name; a label that is not an integer or not below ``len(classes)``; no sample at all.
        fastload.pack.CorruptSampleError: A shard cut short inside a sample.
    """
    parts = [_Shard(s, source, index) for s, (source, index) in enumerate(zip(sources, indexes, strict=True))]
    groups = [_Group(parts[a:b], label) for a, b in _chunks([len(ix) for ix in indexes])]
    if sum(len(g.images) for g in groups) == 0:
        raise ValueError(
            f"the {len(sources)} shard(s) ({sources[0].name!r}, ...) hold no sample (no image member "
            f"with a .{label} member): write shards with python -m fastload shards SRC OUT"
        )
    targets, classes = _targets(groups, label, classes)
    names, name_offsets = _join([g.sample_names(rels) for g in groups])
    return Samples(
        np.concatenate([g.shard + g.shards[0].number for g in groups]).astype(np.int32),
        np.concatenate([g.index.offsets[g.images] for g in groups]).astype(np.int64),
        np.concatenate([g.index.sizes[g.images] for g in groups]).astype(np.int64),
        targets,
        classes,
        names,
        name_offsets,
    )
