"""Writing tar shards: an image split (a folder, a split list or a pack) as WebDataset-layout shards.

:func:`write_shards` writes the samples of a :class:`~fastload.folder.FolderIndex` or a
:class:`~fastload.pack.PackFile`, in a random order, as ``<prefix>-000000.tar``, ``<prefix>-000001.tar``,
... of about ``shard_size`` bytes each: per sample ``<key>.jpg`` (or ``.png``, by content) and
``<key>.cls`` (the label as text), ``key`` the sample's number zero-padded, in plain GNU tar with
fixed owners, modes and times (the same input gives the same bytes). Each shard is written under a
temporary name and renamed when complete, then indexed (its ``<shard>.idx`` sidecar, see
:mod:`fastload.tarindex`); the class list goes to ``<prefix>-classes.json``, so that
``TarShards(out, classes=out + "/train-classes.json")`` labels and names the samples as the split did.

Command line: ``python -m fastload shards SRC OUT [--shard-size 512MB] [--prefix train] [--classes PATH]
[--seed 0 | --no-shuffle]``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import tarfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ._checks import check_int, check_optional_int, read_error
from .device import available_cpus
from .folder import ClassIndex, FolderIndex, scan_folder, scan_list
from .pack import MAGIC, PackFile, bounded_map, open_pack, progress_bar
from .shardsource import LocalShard
from .tarindex import BLOCK, index_tar

__all__ = ["ShardsSummary", "add_shards_parser", "parse_size", "shards_command", "write_shards"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
}


def parse_size(text: str) -> int:
    """A byte count written as ``512MB`` (10**6), ``1GiB`` (2**30), ``2.5GB`` or ``1000000``."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([A-Za-z]*)\s*", text)
    if m is None or m[2].lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a size such as 512MB, 1GB or 100MiB")
    return int(float(m[1]) * _UNITS[m[2].lower()])


@dataclass(frozen=True)
class ShardsSummary:
    """What :func:`write_shards` wrote."""

    shards: list[Path]
    num_samples: int
    shard_bytes: int
    classes_path: Path


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
        OSError: Naming a sample that cannot be read, or the shard that cannot be written (what
            this call wrote is then removed).

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
    folder = os.path.abspath(os.fspath(out))
    os.makedirs(folder, exist_ok=True)
    earlier = sorted(n for n in os.listdir(folder) if n.startswith(f"{prefix}-") and n.endswith(".tar"))
    if earlier:
        raise ValueError(
            f"{folder!r} already holds {len(earlier)} shard(s) named {prefix}-*.tar (e.g. {earlier[0]!r}): "
            "new shards would mix with them. Write to an empty folder, choose another prefix, or remove them"
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
    written: list[Path] = []
    current: tuple[Any, tarfile.TarFile, str, str] | None = None  # (file, tar, temporary, final)
    filled = total = 0

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
        written.append(Path(final))
        shard = LocalShard(final)
        shard_index = index_tar(shard)
        shard_index.save(final + ".idx", shard.key)
        total += shard_index.stamp[0]

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
        classes_path = Path(folder) / f"{prefix}-classes.json"
        index.classes.save(classes_path)
    except BaseException:
        if current is not None:
            current[0].close()
            with contextlib.suppress(OSError):
                os.unlink(current[2])
        for path in written:
            for p in (path, Path(f"{path}.idx")):
                with contextlib.suppress(OSError):
                    p.unlink()
        raise
    finally:
        bar.close()
    return ShardsSummary(written, n, total, classes_path)


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
    p.add_argument("out", help="the folder to write the shards into")
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
        if pack is not None:
            pack.close()
    first, last = summary.shards[0].name, summary.shards[-1].name
    names = first if first == last else f"{first} .. {last}"
    print(
        f"wrote {summary.num_samples} samples in {len(summary.shards)} shard(s) "
        f"({summary.shard_bytes / 1e6:.1f} MB) to {summary.shards[0].parent}: {names}, each with its "
        f".idx index; class list: {summary.classes_path}"
    )
    return 0
