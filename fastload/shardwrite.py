"""Writing tar shards: an image split (a folder, a split list or a pack) as WebDataset-layout shards.

:func:`write_shards` writes the samples of a :class:`~fastload.folder.FolderIndex` or a
:class:`~fastload.pack.PackFile`, in a random order, as ``<prefix>-000000.tar``, ``<prefix>-000001.tar``,
... of about ``shard_size`` bytes each: per sample ``<key>.jpg`` (or ``.png``, by content) and
``<key>.cls`` (the label as text), ``key`` the sample's number zero-padded, in plain GNU tar with
fixed owners, modes and times (the same input gives the same bytes). Each shard is written under a
temporary name and renamed when complete, then indexed (its ``<shard>.idx`` sidecar, see
:mod:`fastload.tarindex`); the class list goes to ``<prefix>-classes.json``, so that
``TarShards(out, classes=out + "/train-classes.json")`` labels and names the samples as the split did.

``out`` may be ``s3://bucket/prefix/``: each shard is then written to a temporary local file (one
at a time), uploaded (one PUT, retried as reads are, :func:`fastload.s3shards.retrying`), then its
sidecar, stamped with the size and ETag of the uploaded object so that ``TarShards`` uses it instead
of downloading the shard to index it, and last the class list.

Command line: ``python -m fastload shards SRC OUT [--shard-size 512MB] [--prefix train] [--classes PATH]
[--seed 0 | --no-shuffle]``; stopped (Ctrl-C, or SIGTERM, a scheduler's preemption), it removes
what it wrote or uploaded.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import signal
import tarfile
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ._checks import check_int, check_optional_int, parse_size, read_error
from .device import available_cpus
from .folder import ClassIndex, FolderIndex, scan_folder, scan_list
from .pack import MAGIC, PackFile, bounded_map, open_pack, progress_bar
from .s3shards import RETRY_TIMEOUT, S3, client, retrying, tag_number, upload
from .shardsource import LocalShard
from .tarindex import BLOCK, index_tar

__all__ = ["ShardsSummary", "add_shards_parser", "parse_size", "shards_command", "write_shards"]


@dataclass(frozen=True)
class ShardsSummary:
    """What :func:`write_shards` wrote."""

    shards: list[Path] | list[str]  # (``s3://`` URLs where written to a bucket)
    num_samples: int
    shard_bytes: int
    classes_path: Path | str


def _kind(data: bytes | memoryview) -> str | None:
    head = bytes(data[:8])
    if head.startswith(b"\xff\xd8\xff"):
        return "jpg"
    if head == b"\x89PNG\r\n\x1a\n":
        return "png"
    return None


def _read_files(paths: list[str]) -> list[bytes | OSError]:
    out: list[bytes | OSError] = []
    for path in paths:
        try:
            with open(path, "rb") as f:
                out.append(f.read())
        except OSError as e:
            out.append(e)
    return out


def _samples(
    source: FolderIndex | PackFile, order: list[int], num_workers: int
) -> Iterator[bytes | memoryview]:
    """The encoded bytes of samples ``order`` (a folder's files read by ``num_workers`` threads)."""
    if isinstance(source, PackFile):
        for i in order:
            yield source.get_bytes(i)
        return
    paths = [source.paths[i] for i in order]
    n, chunk = len(paths), 64
    chunks = (paths[a : min(a + chunk, n)] for a in range(0, n, chunk))
    executor = ThreadPoolExecutor(num_workers) if num_workers > 0 and n > chunk else None
    try:
        i = 0
        for results in bounded_map(executor, _read_files, chunks, max_in_flight=4 * max(1, num_workers)):
            for data in results:
                if isinstance(data, OSError):
                    raise read_error(data, i, paths[i])
                yield data
                i += 1
    finally:
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)


def _member(tar: tarfile.TarFile, name: str, data: bytes | memoryview) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 0
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    tar.addfile(info, io.BytesIO(data))


def write_shards(
    source: FolderIndex | PackFile,
    out: str | os.PathLike[str],
    *,
    shard_size: int = 512 * 10**6,
    prefix: str = "train",
    num_workers: int | None = None,
    progress: bool | None = None,
    shuffle: bool = True,
    seed: int = 0,
) -> ShardsSummary:
    """Writes the samples of ``source`` as WebDataset-layout tar shards in the folder ``out``.

    Args:
        source: A :class:`~fastload.folder.FolderIndex` (from ``scan_folder`` or ``scan_list``) or an
            open :class:`~fastload.pack.PackFile`.
        out: A folder, or ``s3://bucket/prefix/`` (uploaded one shard at a time, with its sidecar;
            ``pip install 'fastload[s3]'``, the endpoint and credentials from the AWS environment).
        shard_size: About how many bytes each shard holds (a shard closes before the sample that
            would take it past this; a sample larger than it gets a shard of its own).
        prefix: The shards' names: ``<prefix>-000000.tar``, ...
        num_workers: Threads reading a folder's files (default: the available CPUs).
        progress: Show a tqdm bar (default: for more than 500 samples when stderr is a terminal).
        shuffle: Write the samples in a random order (the keys stay their numbers in ``source``),
            so that each shard holds a mix of the classes; ``False``: in ``source``'s order (a
            folder's is class by class, whose shards give batches of a few classes with
            ``TarShards(shuffle_window=N)``: docs/shards.md, "Shuffle quality").
        seed: The random order's seed (the same seed, the same shards).

    Raises:
        ValueError: Where ``out`` already holds ``<prefix>-*.tar`` shards (shards of two runs would
            mix), or a sample is neither JPEG nor PNG (``TarShards`` reads those).
        OSError: Naming a sample that cannot be read, or the shard that cannot be written or
            uploaded (what this call wrote is then removed, as on ``KeyboardInterrupt``), e.g.
            :class:`~fastload.s3shards.ObjectStoreError`.

    Example: 32 samples of about 3 kB with ``shard_size=50_000`` give ``train-000000.tar`` (14
    samples, 14 x (512 + 3072 + 512 + 512) bytes < 50 kB) to ``train-000002.tar``.
    """
    if not isinstance(source, (FolderIndex, PackFile)):
        raise TypeError(
            "source should be a FolderIndex (e.g. scan_folder(root)) or a PackFile, "
            f"but got {type(source).__name__}"
        )
    check_int(shard_size, "shard_size", low=1)
    check_optional_int(num_workers, "num_workers", low=0)
    if not isinstance(prefix, str) or not prefix or "/" in prefix or os.sep in prefix:
        raise ValueError(f"prefix should be a file name prefix such as 'train', but got prefix={prefix!r}")
    bucket = os.fspath(out) if os.fspath(out).startswith("s3://") else None
    if bucket is None and "://" in os.fspath(out):
        raise ValueError(
            f"out={os.fspath(out)!r} is a URL the converter does not write to: write to a folder or to "
            "s3://bucket/prefix/ (then copy the folder to a web server)"
        )
    if bucket is not None:
        bucket = bucket.rstrip("/") + "/"
        objects = retrying(lambda: S3.listing(f"{bucket}{prefix}-"), "list the bucket", bucket, RETRY_TIMEOUT)
        earlier = sorted(u.rsplit("/", 1)[-1] for u, _, _ in objects if u.endswith(".tar"))
        temporary = tempfile.TemporaryDirectory(prefix="fastload-shards-")
        folder = temporary.name
    else:
        folder = os.path.abspath(os.fspath(out))
        os.makedirs(folder, exist_ok=True)
        earlier = sorted(n for n in os.listdir(folder) if n.startswith(f"{prefix}-") and n.endswith(".tar"))
    if earlier:
        raise ValueError(
            f"{bucket or folder!r} already holds {len(earlier)} shard(s) named {prefix}-*.tar (e.g. "
            f"{earlier[0]!r}): new shards would mix with them. Write to an empty folder, choose another "
            "prefix, or remove them"
        )
    index = source if isinstance(source, FolderIndex) else source.index
    n = len(index)
    if n == 0:
        raise ValueError("source holds no sample: there is nothing to write as shards")
    width = max(6, len(str(max(n - 1, 0))))
    workers = available_cpus() if num_workers is None else num_workers
    order = (
        np.random.default_rng(check_int(seed, "seed", low=0)).permutation(n).tolist()
        if shuffle
        else list(range(n))
    )
    written: list[str] = []  # (paths, or the URLs uploaded)
    current: tuple[Any, tarfile.TarFile, str, str] | None = None  # (file, tar, temporary, final)
    filled = total = 0
    saving = False  # (the class list: removed too where a signal stops its writing)

    def finish() -> None:
        nonlocal current, total
        if current is None:
            return
        f, tar, tmp, final = current
        current = None
        tar.close()
        f.flush()
        os.fsync(f.fileno())
        f.close()
        os.replace(tmp, final)
        url = final if bucket is None else bucket + os.path.basename(final)
        written.append(url)
        shard = LocalShard(final)
        shard_index = index_tar(shard)
        total += shard_index.stamp[0]
        if bucket is None:
            shard_index.save(final + ".idx", shard.key)
            return
        shard_index.stamp = (shard_index.stamp[0], tag_number(upload(final, url)))  # as TarShards sees it
        shard_index.save(final + ".idx", url)
        upload(final + ".idx", url + ".idx")
        for p in (final, final + ".idx"):
            os.unlink(p)

    bar = progress_bar(n, f"shards {prefix}", "img", progress)
    try:
        for i, data in zip(order, _samples(source, order, workers), strict=True):
            kind = _kind(data)
            if kind is None:
                raise ValueError(
                    f"sample {i} ({index.relpath(i)!r}) is neither JPEG nor PNG: TarShards reads .jpg, .jpeg "
                    "and .png members. Convert it (or leave it out of the split) and write the shards again"
                )
            label = str(int(index.targets[i])).encode()
            need = 3 * BLOCK + -(-len(data) // BLOCK) * BLOCK
            if current is not None and filled + need > shard_size:
                finish()
            if current is None:
                final = os.path.join(folder, f"{prefix}-{len(written):06d}.tar")
                tmp = os.path.join(folder, f".{prefix}-{len(written):06d}.tar.tmp")
                f = open(tmp, "wb")  # noqa: SIM115 - closed by finish() or below
                current = (f, tarfile.open(fileobj=f, mode="w", format=tarfile.GNU_FORMAT), tmp, final)
                filled = 0
            key = f"{i:0{width}d}"
            _member(current[1], f"{key}.{kind}", data)
            _member(current[1], f"{key}.cls", label)
            filled += need
            bar.update(1)
        finish()
        classes_path = os.path.join(folder, f"{prefix}-classes.json")
        saving = True
        index.classes.save(classes_path)
        if bucket is not None:
            classes_path = bucket + os.path.basename(classes_path)
            upload(os.path.join(folder, os.path.basename(classes_path)), classes_path)
    except BaseException:
        if current is not None:
            current[0].close()
        # what this call wrote, the shard under way included (a signal may come between its steps)
        for k in range(len(written) + 1):
            name = f"{prefix}-{k:06d}.tar"
            for p in (f".{name}.tmp", name, f"{name}.idx"):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(folder, p))
        if saving:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(folder, f"{prefix}-classes.json"))
        if bucket is not None:
            uploaded = [u for w in written for u in (w, f"{w}.idx")]
            for url in uploaded + [f"{bucket}{prefix}-classes.json"] * saving:
                with contextlib.suppress(Exception):
                    _delete(url)
        raise
    finally:
        bar.close()
        if bucket is not None:
            temporary.cleanup()
    if bucket is not None:
        return ShardsSummary(written, n, total, classes_path)
    return ShardsSummary([Path(p) for p in written], n, total, Path(classes_path))


def _delete(url: str) -> None:
    """Removes the object ``url`` (what a failed conversion uploaded)."""
    b, _, key = url[len("s3://") :].partition("/")
    client().delete_object(Bucket=b, Key=key)


# ------------------------------------------------------------------------------------ command line


def _size_argument(text: str) -> int:
    try:
        size = parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if size < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive size")
    return size


def add_shards_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Adds the ``shards`` command (``func=shards_command``) to an ``argparse`` sub-parser set."""
    p = subparsers.add_parser(
        "shards",
        help="write an image folder, split list or pack as WebDataset tar shards (for fastload.TarShards)",
        description=(
            "Writes the samples of SRC as OUT/<prefix>-000000.tar, ... (key.jpg + key.cls per sample) with "
            "their .idx indexes and the class list OUT/<prefix>-classes.json."
        ),
    )
    p.add_argument(
        "src",
        help="an image folder (SRC/<class>/...), a split list ('relative/path label' lines) or a pack file",
    )
    p.add_argument("out", help="the folder to write the shards into, or s3://bucket/prefix/ to upload them")
    p.add_argument(
        "--shard-size",
        type=_size_argument,
        default=512 * 10**6,
        metavar="SIZE",
        help="about how large each shard is, e.g. 512MB (the default), 1GB, 100MiB",
    )
    p.add_argument(
        "--prefix", default="train", help="the shards' names: PREFIX-000000.tar, ... (default: train)"
    )
    p.add_argument(
        "--classes",
        metavar="JSON",
        help="class list (JSON from ClassIndex.save, or a JSON list of names); default: the subfolders of a "
        "folder SRC (a split list needs it)",
    )
    p.add_argument(
        "--root",
        metavar="DIR",
        help="for a split list: the folder its paths are relative to (default: its folder)",
    )
    p.add_argument(
        "--workers", type=int, metavar="N", help="threads reading files (default: the available CPUs)"
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the random order the samples are written in (default: 0)"
    )
    p.add_argument(
        "--shuffle",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="write the samples in a random order, so that each shard holds a mix of the classes (default); "
        "--no-shuffle: in SRC's order (a folder's is class by class)",
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        help="show a progress bar (default: on a terminal)",
    )
    p.set_defaults(func=shards_command)
    return p


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # (through write_shards's cleanup, as KeyboardInterrupt is)


def _is_pack(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(len(MAGIC)) == MAGIC


def shards_command(args: argparse.Namespace) -> int:
    """Runs ``python -m fastload shards`` with parsed arguments; returns the exit status."""
    src = args.src
    pack: PackFile | None = None
    if os.path.isdir(src):
        source: FolderIndex | PackFile = scan_folder(src, classes=args.classes)
    elif os.path.isfile(src) and _is_pack(src):
        if args.classes:
            raise ValueError("--classes is not used with a pack: it holds its class list")
        source = pack = open_pack(src)
    elif os.path.isfile(src):
        if not args.classes:
            raise ValueError(f"{src!r} is a split list: pass its class list with --classes PATH")
        root = args.root if args.root is not None else os.path.dirname(os.path.abspath(src))
        source = scan_list(src, root, ClassIndex.load(args.classes))
    else:
        raise FileNotFoundError(f"SRC {src!r} is not an image folder, a split list or a pack file")
    # SIGTERM (a scheduler's preemption) removes what was written, as Ctrl-C does
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminated) if main_thread else None
    try:
        summary = write_shards(
            source,
            args.out,
            shard_size=args.shard_size,
            prefix=args.prefix,
            num_workers=args.workers,
            progress=args.progress,
            shuffle=args.shuffle,
            seed=args.seed,
        )
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if pack is not None:
            pack.close()
    where, _, first = str(summary.shards[0]).rpartition("/")
    last = str(summary.shards[-1]).rpartition("/")[2]
    names = first if first == last else f"{first} .. {last}"
    print(
        f"wrote {summary.num_samples} samples in {len(summary.shards)} shard(s) "
        f"({summary.shard_bytes / 1e6:.1f} MB) to {where}: {names}, each with its "
        f".idx index; class list: {summary.classes_path}"
    )
    return 0
