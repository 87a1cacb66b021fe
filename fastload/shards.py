"""``TarShards``: a dataset over WebDataset-layout tar shards, read by byte range.

A shard holds samples as consecutive members sharing a key (WebDataset's layout): ``000017.jpg`` and
``000017.cls`` are one sample, its image and its label. The shards are named by a list, a brace
pattern (``train-{0000..0146}.tar``) or a folder (:func:`shard_paths`). Each shard's
:class:`~fastload.tarindex.TarIndex` (built from its headers once, then kept in a sidecar) gives
every member's byte range; grouping the members by key gives, per sample, numpy arrays of shard
number, offset, size and label, and the image member's name for messages (a
:class:`~fastload.folder.FolderIndex` of ``<shard>/<member>`` names). ``get_bytes(i)`` is one read of
that range through the shard's :class:`~fastload.shardsource.ShardSource`, so the order is fastload's
own and the fast path, head acceleration, resume and ``distributed=True`` work as on a folder.

Data flow: shards --:mod:`fastload.tarindex`--> byte ranges --``get_bytes``--> the loader's workers.

Example:
    >>> from fastload import TarShards, transforms as T
    >>> train = TarShards("shards/train-{000000..000146}.tar", classes="shards/train-classes.json",
    ...                   transform=T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip()]))
    ...                                                                  # doctest: +SKIP
    >>> image, target = train[0]    # a uint8 (3, 224, 224) tensor and an int   # doctest: +SKIP
"""

from __future__ import annotations

import errno
import os
import re
import tempfile
import warnings
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np

from ._checks import caller_stacklevel, check_optional_int, sample_index
from .device import local_world_size
from .folder import ClassIndex, FolderIndex
from .httpshards import HTTP
from .imagefolder import EncodedImageDataset
from .pack import CorruptSampleError
from .s3shards import (
    RETRY_TIMEOUT,
    S3,
    RemoteShard,
    Store,
    follow_order,
    is_remote_url,
    remote_sources,
    retrying,
    start_prefetch,
)
from .shardcache import OrderedPrefetch, ShardCache, cache_limit_bytes, default_cache_dir
from .shardsamples import IMAGE_EXTENSIONS, gather_samples
from .shardsource import LocalShard, ShardSource
from .tarindex import BLOCK, header_size, load_indexes

__all__ = ["IMAGE_EXTENSIONS", "TarShards", "expand_braces", "shard_paths"]

_USTAR_MAX_SIZE = 8**11 - 1  # the largest size a ustar header's size field holds
_RANGE = re.compile(r"(-?\d+)\.\.(-?\d+)")


def expand_braces(pattern: str) -> list[str]:
    """WebDataset's shard notation: ``{a..b}`` a range of integers (zero-padded to the wider bound
    when a bound has a leading zero), ``{x,y}`` a list, several braces and nesting allowed.

    Example:
        >>> expand_braces("train-{00..02}.tar")
        ['train-00.tar', 'train-01.tar', 'train-02.tar']
        >>> expand_braces("{a,b}-{1..2}")
        ['a-1', 'a-2', 'b-1', 'b-2']
    """
    depth, start = 0, -1
    for k, c in enumerate(pattern):
        if c == "{":
            if depth == 0:
                start = k
            depth += 1
        elif c == "}" and depth:
            depth -= 1
            if depth == 0:
                break
    else:
        if depth:
            raise ValueError(f"the shard pattern {pattern!r} has a '{{' without its '}}'")
        return [pattern]
    head, body, tail = pattern[:start], pattern[start + 1 : k], pattern[k + 1 :]
    m = _RANGE.fullmatch(body)
    if m:
        a, b = int(m[1]), int(m[2])
        padded = any(len(x.lstrip("-")) > 1 and x.lstrip("-").startswith("0") for x in (m[1], m[2]))
        width = max(len(m[1]), len(m[2])) if padded else 0
        step = 1 if b >= a else -1
        choices = [f"{v:0{width}d}" for v in range(a, b + step, step)]
    else:
        choices, depth, piece = [], 0, ""
        for c in body:
            if c == "," and depth == 0:
                choices.append(piece)
                piece = ""
                continue
            depth += (c == "{") - (c == "}")
            piece += c
        choices.append(piece)
        if len(choices) == 1:
            raise ValueError(
                f"{{{body}}} in the shard pattern {pattern!r} should be a range such as {{0000..0146}} "
                "or a list such as {a,b}"
            )
    rest = expand_braces(tail)
    return [head + c + r for choice in choices for c in expand_braces(choice) for r in rest]


def shard_paths(shards: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[str]:
    """The shard files that ``shards`` names: a list of paths, a brace pattern (see
    :func:`expand_braces`) or a folder (its ``*.tar`` files, sorted by name)."""
    if isinstance(shards, (str, os.PathLike)):
        text = os.fspath(shards)
        if "://" in text:
            raise ValueError(
                f"shards={text!r} is a URL that TarShards does not read: shards are local paths, "
                "s3:// or http(s):// URLs (copy the shards to a local folder, a bucket or a web server)"
            )
        if os.path.isdir(text):
            with os.scandir(text) as it:
                paths = sorted(
                    e.path
                    for e in it
                    if e.name.lower().endswith(".tar") and not e.name.startswith(".") and e.is_file()
                )
            if not paths:
                raise FileNotFoundError(
                    f"the folder {text!r} holds no .tar shard; write shards with: "
                    f"python -m fastload shards SRC {text}"
                )
            return paths
        return expand_braces(text) if "{" in text else [text]
    if isinstance(shards, (list, tuple)):
        paths = []
        for k, p in enumerate(shards):
            if not isinstance(p, (str, os.PathLike)):
                raise TypeError(f"shards[{k}] should be a path, but got {type(p).__name__}")
            if "://" in os.fspath(p):
                raise ValueError(
                    f"shards mixes local paths with URLs ({os.fspath(p)!r}): list shards of one place, "
                    "or copy them to one place"
                )
            paths.append(os.fspath(p))
        if not paths:
            raise ValueError("shards should name at least one shard, but got an empty list")
        seen: set[str] = set()
        for p in paths:
            key = os.path.abspath(p)
            if key in seen:
                raise ValueError(f"the shard {p!r} is listed twice in shards: list each shard once")
            seen.add(key)
        return paths
    raise TypeError(
        "shards should be a path, a brace pattern, a folder or a list of paths, "
        f"but got {type(shards).__name__}"
    )


_NUMBERED = re.compile(r"(?s)(.*?)([-_.]?)(\d+)\.tar", re.IGNORECASE)


def _one_set(names: list[str], where: str) -> None:
    """Refuses a folder or prefix holding numbered shards of several sets (``train-*.tar`` and
    ``val-*.tar``: a training set would take in the validation samples)."""
    sets: dict[tuple[str, str], list[int]] = {}
    for name in names:
        m = _NUMBERED.fullmatch(name.rsplit("/", 1)[-1])
        if m:
            sets.setdefault((m[1], m[2]), []).append(int(m[3]))
    if len(sets) < 2:
        return
    (stem, sep), numbers = next(iter(sets.items()))
    width = max(len(n.rsplit("/", 1)[-1]) for n in names) - len(stem) - len(sep) - len(".tar")
    example = f"{where.rstrip('/')}/{stem}{sep}{{{min(numbers):0{width}d}..{max(numbers):0{width}d}}}.tar"
    found = ", ".join(f"{a}{b}*.tar ({len(v)})" for (a, b), v in sets.items())
    raise ValueError(
        f"{where!r} holds shards of {len(sets)} sets ({found}), which would be read as one dataset "
        f"(the samples of a validation split in training, say): name one set, e.g. {example!r}, or "
        "keep each set in a folder of its own"
    )


def _same_classes(first: str, given: Any, classes: ClassIndex, retry_timeout: float) -> None:
    """Refuses ``classes`` other than the class list the converter wrote beside the shards (their
    ``.cls`` labels number that list's classes: another list would label them wrongly)."""
    m = _NUMBERED.fullmatch(first.rsplit("/", 1)[-1])
    if m is None:
        return
    written = f"{first.rsplit('/', 1)[0]}/{m[1]}-classes.json" if "/" in first else f"{m[1]}-classes.json"
    if isinstance(given, (str, os.PathLike)) and os.fspath(given) == written:
        return
    try:
        beside = _class_index(written, retry_timeout) if is_remote_url(written) else ClassIndex.load(written)
    except (FileNotFoundError, PermissionError, ValueError):
        return  # none there (or not a class list): nothing to compare with
    if beside is not None and beside.classes != classes.classes:
        raise ValueError(
            f"the shards were written with the class list {written!r} ({len(beside)} classes: "
            f"{', '.join(beside.classes[:3])}, ...), but classes= gives another ({len(classes)} classes: "
            f"{', '.join(classes.classes[:3])}, ...): their .cls labels number the classes of {written!r}, "
            "so they would be labelled wrongly. Pass classes=" + repr(written) + ", or write the "
            "shards again with the class list you want (python -m fastload shards SRC OUT --classes LIST)"
        )


def _store(url: str) -> Store:
    return HTTP if url.startswith(("http://", "https://")) else S3


def _class_index(classes: Any, retry_timeout: float) -> ClassIndex | None:
    if classes is None or isinstance(classes, ClassIndex):
        return classes
    if is_remote_url(classes):  # (the converter uploads it beside the shards)
        if classes.endswith("/"):
            raise ValueError(
                f"classes={classes!r} names a prefix: name the class list itself, such as "
                f"{classes + 'train-classes.json'!r} (what the converter uploads beside the shards)"
            )
        store = _store(classes)
        with tempfile.TemporaryDirectory(prefix="fastload-classes-") as folder:
            path = os.path.join(folder, classes.rsplit("/", 1)[-1])
            with open(path, "wb") as f:

                def get() -> None:
                    f.seek(0)
                    f.truncate()
                    store.get(classes, f, None)

                try:
                    retrying(get, "read the class list", classes, retry_timeout, store)
                except FileNotFoundError:
                    raise FileNotFoundError(
                        errno.ENOENT,
                        f"class list not found on {store.where(classes)}: check the URL (the converter "
                        "writes <prefix>-classes.json beside the shards)",
                        classes,
                    ) from None
            return ClassIndex.load(path)
    if isinstance(classes, (str, os.PathLike)):
        return ClassIndex.load(classes)
    if isinstance(classes, (list, tuple)):
        return ClassIndex(classes)
    raise TypeError(
        "classes should be a ClassIndex, a list of names or a class list's path, "
        f"but got {type(classes).__name__}"
    )


class TarShards(EncodedImageDataset):
    """A dataset over WebDataset-layout tar shards on the local file system, an S3-compatible
    object store or an http(s) server, read by byte range.

    ``dataset[i]`` is ``(transform(image), target_transform(target))`` as for
    :class:`fastload.ImageFolder` (same attributes: ``targets``, ``classes``, ``class_to_idx``,
    ``samples`` with ``<shard>/<member>`` names); samples in shard order, then member order. A
    ``fastload.DataLoader`` runs its fast path, head acceleration, resume and ``distributed=True``
    on it as on a folder, with every worker kind.

    Args:
        shards: A list of shard paths, a brace pattern (``"/data/train-{0000..0146}.tar"``; several
            braces and ``{a,b}`` lists too) or a folder (its ``*.tar`` files, sorted by name).
        classes: The class list (a :class:`~fastload.folder.ClassIndex`, a list of names or a saved
            class list's path or ``s3://`` / ``http(s)://`` URL, such as the
            ``<prefix>-classes.json`` the converter writes). With
            ``label="cls"`` it names the integer labels (``None``: the names ``"0"``, ``"1"``, ...
            up to the largest label); with a class-name member it maps the names to labels
            (``None``: the names found, sorted).
        label: The extension of each sample's label member: ``"cls"`` (an integer as text, as
            webdataset writes it) or another (e.g. ``"txt"``) holding the class *name*.
        num_threads: Threads indexing shards whose index is not kept yet (default: CPUs + 4, at most 32).
        cache_dir: For ``s3://`` and ``http(s)://`` shards: the node-local shard cache (default
            ``$XDG_CACHE_HOME/fastload/shards``, else ``~/.cache/fastload/shards``), shared by the
            ranks and workers of the machine; see :mod:`fastload.shardcache`.
        cache_limit: For remote shards: the most bytes the cache holds, as an int or a size such
            as ``"50GB"`` (default: a tenth of the free space where the cache is, at least 1 GB);
            the least recently used shards are removed to stay within it.
        retry_timeout: For remote shards: seconds of retries (exponential backoff) after
            transient failures of the store or server before :class:`~fastload.s3shards.ObjectStoreError`.
        shuffle_window: ``None`` (default): ``shuffle=True`` permutes all samples; ``N``: the
            shard-aware order: the shards in a random order, ``N`` at a time, the samples of those
            ``N`` shuffled together, so a pass reads ``N`` shards at a time (an object store's
            cache holds them), as a pack's blockwise order does (docs/shards.md).

    Shards on an object store are named by ``s3://bucket/prefix/train-{0000..0146}.tar``, a list
    of ``s3://`` URLs, or ``s3://bucket/prefix/`` (every ``*.tar`` object under it, sorted by key);
    each is looked up when the dataset is made and read from a whole copy in the cache, downloaded
    once per node (:mod:`fastload.s3shards`; ``pip install 'fastload[s3]'``). The endpoint and
    credentials come only from the standard AWS environment and files (``AWS_ENDPOINT_URL``,
    ``AWS_ACCESS_KEY_ID``, ``AWS_PROFILE``, ``~/.aws/config``, ...). Shards on an http(s) server
    are named by a brace pattern or a list of URLs and read the same way
    (:mod:`fastload.httpshards`). Making the dataset uses the ``<shard>.idx`` object beside each
    shard where it matches the shard's size and ETag (the converter uploads them), and indexes
    every other shard whose index is not in the cache yet, which downloads it.

    Every sample needs an image member (``.jpg``, ``.jpeg`` or ``.png``, the first found,
    case-insensitive) and its label member; the members of a sample are consecutive in its shard, as
    webdataset requires. Anything else is an error naming the shard and the sample (nothing is left
    out silently); members without an extension are not a part of any sample.

    Raises:
        FileNotFoundError: Naming a shard that does not exist (also when read later), or a bucket.
        PermissionError: Credentials an object store refused (the message holds no key or secret).
        fastload.s3shards.ObjectStoreError: An object store that kept failing for ``retry_timeout``.
        ValueError: A sample without image or label, a sample whose members are not consecutive, an
            unknown class name, a label that is not an integer or not below ``len(classes)``.
        fastload.pack.CorruptSampleError: From ``get_bytes``, naming shard and member, where a
            member's bytes are cut short (a truncated shard) or the shard changed since indexed.

    Each process opens the shard files it reads itself (a pickled dataset holds the index arrays
    and shard paths, no open file).

    Example:
        >>> ds = TarShards("shards/", classes="shards/train-classes.json")     # doctest: +SKIP
        >>> len(ds), ds.classes[:2]                                            # doctest: +SKIP
        (1281167, ['n01440764', 'n01443537'])
        >>> ds.describe(0)                                                     # doctest: +SKIP
        "sample 0 (member '000000.jpg' of shard 'shards/train-000000.tar')"
    """

    def __init__(
        self,
        shards: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        *,
        classes: ClassIndex | Sequence[str] | str | os.PathLike[str] | None = None,
        label: str = "cls",
        transform: Callable[..., Any] | None = None,
        target_transform: Callable[[int], Any] | None = None,
        num_threads: int | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | str | None = None,
        retry_timeout: float = RETRY_TIMEOUT,
        shuffle_window: int | None = None,
    ) -> None:
        self.check_transforms(transform, target_transform)
        self.shuffle_window = check_optional_int(shuffle_window, "shuffle_window", low=1)
        check_optional_int(num_threads, "num_threads", low=0)
        if not isinstance(label, str) or not label.strip("."):
            raise ValueError(
                f"label should be a member extension such as 'cls' or 'txt', but got label={label!r}"
            )
        label = label.lstrip(".").lower()
        if label in IMAGE_EXTENSIONS:
            raise ValueError(f"label={label!r} is an image extension: name the member that holds the label")
        class_index = _class_index(classes, retry_timeout)
        sources = _sources(shards, cache_dir, cache_limit, retry_timeout, num_threads)
        where = os.fspath(shards) if isinstance(shards, (str, os.PathLike)) else ""
        if where.endswith("/") or (where and os.path.isdir(where)):  # a folder or a prefix
            _one_set([s.name for s in sources], where)
        if label == "cls" and class_index is not None:
            _same_classes(sources[0].name, classes, class_index, retry_timeout)
        indexes = load_indexes(sources, num_threads)
        start_prefetch(sources)
        root, rels = _root([s.key for s in sources])
        found = gather_samples(sources, indexes, label, class_index, rels)
        self._sources: list[ShardSource] = list(sources)
        self._stamps = np.array([ix.stamp for ix in indexes], dtype=np.int64).reshape(-1, 2)
        self._shard, self._offset, self._size = found.shard, found.offset, found.size
        self._index = FolderIndex.from_buffers(
            root, found.names, found.name_offsets, found.targets, found.classes
        )
        self._rels = rels  # each sample's name is its shard's, then its member's
        self._warned_cache = False
        super().__init__(root, transform, target_transform)

    @property
    def index(self) -> FolderIndex:
        """The samples' ``<shard>/<member>`` names (relative to :attr:`root`), int64 targets and classes."""
        return self._index

    @property
    def shuffle_blocks(self) -> np.ndarray | None:
        """With ``shuffle_window``: ``int64[m + 1]``, the first sample of each shard then ``n``, for
        fastload's samplers' shard-aware order (:func:`fastload.sampler.blockwise_permutation`)."""
        if self.shuffle_window is None:
            return None
        return np.concatenate([[0], np.flatnonzero(np.diff(self._shard)) + 1, [len(self._shard)]])

    def follow_pass(self, order: np.ndarray) -> Callable[[int], None] | None:
        """Shards on an object store are downloaded ahead in the order a pass reads them: a
        ``fastload.DataLoader`` calls this at each pass start with the pass's indices (this rank's,
        where its order is a function of seed and epoch), then the returned function with the
        position in that order its workers read at (the samples handed out, plus the batches the
        workers read ahead) after each batch. This process's prefetch thread downloads the
        shard being read and the next ones of the pass, as many as fit in half ``cache_limit``
        (:class:`~fastload.shardcache.OrderedPrefetch`); the workers no longer prefetch the next
        shards of the listing (they do under torch's ``DataLoader``, which never calls this).
        ``None`` for local shards."""
        cache = follow_order(self._sources)
        if cache is None:
            return None
        sequence = self._shard[order[(order >= 0) & (order < len(self._shard))]]
        shards, firsts = np.unique(sequence, return_index=True)
        lasts = len(sequence) - 1 - np.unique(sequence[::-1], return_index=True)[1]
        by = np.argsort(firsts, kind="stable")
        shards, firsts, lasts = shards[by], firsts[by], lasts[by]
        pass_shards = [cast(RemoteShard, self._sources[s]) for s in shards.tolist()]
        sizes = np.array([s.size for s in pass_shards], dtype=np.int64)
        if not self._warned_cache:
            self._warned_cache = _warn_small_cache(firsts, lasts, sizes, cache.limit)
        prefetch = OrderedPrefetch(
            cache,
            [s.fetch for s in pass_shards],
            [s.copy for s in pass_shards],
            sizes,
            firsts,
        )
        prefetch.advance(0)
        return prefetch.advance

    @property
    def shards(self) -> list[str]:
        """The shard paths, in sample order (as listed or expanded)."""
        return [s.name for s in self._sources]

    @property
    def shard_of(self) -> np.ndarray:
        """``int32[n]``: the shard of each sample (an index into :attr:`shards`)."""
        return self._shard

    def member(self, i: int) -> tuple[str, str]:
        """``(shard path, image member name)`` of sample ``i``."""
        i = self._position(i)
        s = int(self._shard[i])
        return self._sources[s].name, self._index.relpath(i)[len(self._rels[s]) :]

    def describe(self, i: int) -> str:
        """How errors name sample ``i``: its index, image member and shard."""
        i = self._position(i)
        shard, member = self.member(i)
        return f"sample {i} (member {member!r} of shard {shard!r})"

    def _position(self, i: int) -> int:
        n = len(self._shard)
        j = sample_index(i)
        j = j + n if j < 0 else j
        if not 0 <= j < n:
            raise IndexError(f"sample index {i} is out of range for a dataset of {n} samples")
        return j

    def get_bytes(self, i: int) -> memoryview:
        """The encoded image of sample ``i``: one read of its member (with the tar header before it,
        checked to describe it); :class:`~fastload.pack.CorruptSampleError` naming shard and member
        where the shard ends before the member does or the header does not match (the shard changed
        since it was indexed)."""
        i = self._position(i)
        s = int(self._shard[i])
        offset, size = int(self._offset[i]), int(self._size[i])
        data = self._sources[s].read(offset - BLOCK, size + BLOCK)
        if len(data) < size + BLOCK:
            raise self._corrupt(i, short=True)
        found = header_size(data[:BLOCK])
        if found != size and (found is None or size <= _USTAR_MAX_SIZE):  # (a larger size is in a pax header)
            raise self._corrupt(i, short=False)
        return memoryview(data)[BLOCK:]

    def _corrupt(self, i: int, short: bool) -> CorruptSampleError:
        shard, member = self.member(i)
        offset, size = int(self._offset[i]), int(self._size[i])
        indexed = int(self._stamps[int(self._shard[i]), 0])
        if short:
            try:
                now = f"{self._sources[int(self._shard[i])].stamp()[0]} bytes"
            except OSError:
                now = "no bytes"
            return CorruptSampleError(
                f"member {member!r} of shard {shard!r} (sample {i}) is cut short: its {size} bytes start at "
                f"byte {offset}, but the shard now has {now} ({indexed} when indexed): it was truncated, "
                "or written again since it was indexed. Copy it again, or create the dataset again "
                "to index it anew"
            )
        return CorruptSampleError(
            f"member {member!r} of shard {shard!r} (sample {i}) is not where the index says: the tar header "
            f"before byte {offset} does not describe a {size}-byte member, so the shard changed since it was "
            "indexed. Create the dataset again (its index is rebuilt), or copy the shard again"
        )

    def extra_repr(self) -> str:
        first = self._sources[0].name
        return f"Classes: {len(self._index.classes)}\nShards: {len(self._sources)} ({first!r}, ...)"


def _size(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 10**9 else f"{n / 1e6:.1f} MB"


def _warn_small_cache(firsts: np.ndarray, lasts: np.ndarray, sizes: np.ndarray, limit: int) -> bool:
    """Warns where the shards a pass reads at once (from each one's first sample to its last), on
    every rank of this machine, take more than half the cache (the other half holds the shards
    downloaded ahead); whether it warned."""
    change = np.zeros((2, int(lasts.max()) + 2), dtype=np.int64)  # bytes and shards read at once
    for row, amount in enumerate((sizes, np.ones_like(sizes))):
        np.add.at(change[row], firsts, amount)
        np.add.at(change[row], lasts + 1, -amount)
    live = np.cumsum(change, axis=1)
    ranks = local_world_size()
    need = int(live[0].max()) * ranks
    if need <= limit // 2:
        return False
    at_once = int(live[1, int(live[0].argmax())])
    warnings.warn(
        f"this pass reads up to {at_once} shard(s) at once ({_size(need)} on the {ranks} rank(s) of "
        f"this machine), more than half the shard cache's limit ({_size(limit)}): shards are "
        "removed before they are read to the end and downloaded again and again. Pass shuffle_window=N "
        "(the shards N at a time, docs/shards.md) or a larger cache_limit",
        stacklevel=caller_stacklevel(),
    )
    return True


def _sources(
    shards: Any,
    cache_dir: str | os.PathLike[str] | None,
    cache_limit: int | str | None,
    retry_timeout: float,
    num_threads: int | None,
) -> list[ShardSource]:
    """The shards named: local files, or objects on an S3-compatible store or an http(s) server
    behind the shard cache."""
    first = (
        shards
        if isinstance(shards, str)
        else (shards[0] if isinstance(shards, (list, tuple)) and shards else None)
    )
    if not is_remote_url(first):
        if cache_dir is not None or cache_limit is not None:
            raise ValueError(
                "cache_dir and cache_limit are for shards on an object store or a server (s3:// or "
                "http(s):// URLs), but the "
                "shards named are local files: leave them out"
            )
        return [LocalShard(p) for p in shard_paths(shards)]
    if not isinstance(retry_timeout, (int, float)) or isinstance(retry_timeout, bool) or retry_timeout < 0:
        raise ValueError(
            "retry_timeout should be a non-negative number of seconds, but got "
            f"retry_timeout={retry_timeout!r}"
        )
    folder = os.fspath(cache_dir) if cache_dir is not None else default_cache_dir()
    cache = ShardCache(folder, cache_limit_bytes(cache_limit, folder))
    found = remote_sources(
        shards,
        _store(str(first)),
        cache,
        expand=expand_braces,
        retry_timeout=float(retry_timeout),
        num_threads=num_threads or 16,
    )
    largest = max(found, key=lambda s: s.size)
    cache.check_fits(largest.size, largest.name)  # (now, not at the first read of that shard)
    return list(found)


def _root(keys: list[str]) -> tuple[str, list[str]]:
    """The folder (or URL prefix) common to the shards, and each shard's name below it plus ``/``."""
    if not is_remote_url(keys[0]):
        root = os.path.commonpath([os.path.dirname(k) for k in keys])
        return root, [os.path.relpath(k, root) + "/" for k in keys]
    parts = [k.split("/") for k in keys]
    common = parts[0][:-1]
    for p in parts[1:]:
        n = 0
        while n < min(len(common), len(p) - 1) and common[n] == p[n]:
            n += 1
        common = common[:n]
    root = "/".join(common)
    return root, [k[len(root) + 1 :] + "/" for k in keys]
