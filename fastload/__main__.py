"""Command line: ``python -m fastload {synth,scan,pack,shards,info,run} ...`` (also ``fastload ...``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from . import __version__
from .folder import ClassIndex, scan_folder
from .pack import add_pack_parser
from .shardwrite import add_shards_parser
from .synthetic import make_imagenet_like

# written by synth first: a folder holding an earlier run of the same command is completed
_SYNTH_MARKER = ".fastload-synth.json"


def _files_under(root: Path) -> int:
    return sum(1 for p in root.rglob("*") if p.is_file() and p.name != _SYNTH_MARKER)


def _synth(args: argparse.Namespace) -> int:
    out = Path(args.root)
    if out.exists() and not out.is_dir():
        raise ValueError(f"synth writes a folder, but {str(out)!r} is a file: choose another ROOT")
    settings = {k: getattr(args, k) for k in ("classes", "per_class", "val_per_class", "seed", "no_quirks")}
    marker = out / _SYNTH_MARKER
    if out.is_dir() and any(out.iterdir()) and not args.force:
        try:
            earlier = json.loads(marker.read_text())
        except (OSError, ValueError):
            earlier = None
        if earlier != settings:
            what = "an earlier synth with other settings" if earlier else f"{_files_under(out)} file(s)"
            raise ValueError(
                f"{str(out)!r} is not empty (it holds {what}): new images would be mixed with what is "
                "there. Choose an empty or new folder, or pass --force to write into it anyway "
                "(files of the same name are overwritten, the others kept)"
            )
    out.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps(settings))
    root = make_imagenet_like(
        args.root,
        classes=args.classes,
        per_class=args.per_class,
        val_per_class=args.val_per_class,
        seed=args.seed,
        quirks=not args.no_quirks,
        num_workers=args.workers,
        progress=True if sys.stderr.isatty() else None,
    )
    n = args.classes * (args.per_class + args.val_per_class)
    print(f"wrote {n} images in {args.classes} classes to {root}/train and {root}/val")
    others = _files_under(root) - n
    if others > 0:
        print(f"note: {root} also holds {others} other file(s), which were left as they were")
    return 0


def _info(args: argparse.Namespace) -> int:
    from .info import environment, summary_line  # imports torchvision, which the other commands skip

    env = environment()
    print(json.dumps(env, indent=1) if args.json else summary_line(env))
    return 0


def _scan(args: argparse.Namespace) -> int:
    for flag, path in (("--out", args.out), ("--save-classes", args.save_classes)):
        if path and os.path.isdir(path):
            raise ValueError(f"{flag} should be a file path, but {path!r} is a directory")

    classes = ClassIndex.load(args.classes) if args.classes else None
    index = scan_folder(args.root, classes=classes, strict=not args.no_strict)
    counts = [int(c) for c in np.bincount(index.targets, minlength=len(index.classes))]
    low, high = min(counts, default=0), max(counts, default=0)
    print(
        f"{args.root}: {len(index)} images in {len(index.classes)} classes (per class: min {low}, max {high})"
    )
    if args.save_classes:
        index.classes.save(args.save_classes)
        print(f"class list written to {args.save_classes}")
    if args.out:
        index.save(args.out)
        print(f"index written to {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fastload", description=(__doc__ or "").replace("``", ""))
    parser.add_argument("--version", action="version", version=f"fastload {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("synth", help="write an ImageNet-like synthetic JPEG tree (train/ and val/)")
    p.add_argument("root", help="output folder")
    p.add_argument("--classes", type=int, default=10, help="number of classes (default 10)")
    p.add_argument("--per-class", type=int, default=50, help="train images per class (default 50)")
    p.add_argument("--val-per-class", type=int, default=10, help="val images per class (default 10)")
    p.add_argument("--seed", type=int, default=0, help="every byte written depends only on it (default 0)")
    p.add_argument("--no-quirks", action="store_true", help="no grayscale/CMYK/PNG-named-.JPEG files")
    p.add_argument("--workers", type=int, default=None, help="encoding processes (default: all CPUs)")
    p.add_argument(
        "--force",
        action="store_true",
        help="write into a non-empty ROOT (refused by default, unless it holds an earlier run of the "
        "same command, which is completed)",
    )
    p.set_defaults(func=_synth)

    p = sub.add_parser("scan", help="scan a split folder into an index and/or a class list")
    p.add_argument("root", help="a split folder: ROOT/<class>/<images>")
    p.add_argument(
        "--classes", help="the canonical class list (JSON from --save-classes); default: ROOT's folders"
    )
    p.add_argument("--save-classes", metavar="PATH", help="write the class list (JSON) here")
    p.add_argument("--out", metavar="PATH", help="write the index (.npz) here")
    p.add_argument(
        "--no-strict",
        action="store_true",
        help="leave out class folders missing from --classes instead of failing",
    )
    p.set_defaults(func=_scan)

    add_pack_parser(sub)
    add_shards_parser(sub)

    p = sub.add_parser(
        "info", help="one line: versions, whether the C extension is built, whether DALI is installed"
    )
    p.add_argument("--json", action="store_true", help="every field as JSON (what benchmark records carry)")
    p.set_defaults(func=_info)

    p = sub.add_parser(
        "run",
        help="run a script unchanged with torch.utils.data.DataLoader made fastload's: run SCRIPT ARGS, "
        "or run -m MODULE ARGS",
    )
    p.add_argument("script", nargs=argparse.REMAINDER, help="SCRIPT [ARGS...] or -m MODULE [ARGS...]")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:  # the script's own errors and exit status are its own
        from .swap import run

        run(argv[1:])
        return 0
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, OSError, MemoryError, RuntimeError) as e:  # DecodeError is a RuntimeError
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
