"""Command line: ``python -m fastload {synth,scan,pack,bench} ...`` (also installed as ``fastload``)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import numpy as np

from .folder import ClassIndex, scan_folder
from .pack import add_pack_parser
from .synthetic import make_imagenet_like


def _synth(args: argparse.Namespace) -> int:
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
    parser = argparse.ArgumentParser(prog="python -m fastload", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("synth", help="write an ImageNet-like synthetic JPEG tree (train/ and val/)")
    p.add_argument("root", help="output folder")
    p.add_argument("--classes", type=int, default=10, help="number of classes (default 10)")
    p.add_argument("--per-class", type=int, default=50, help="train images per class (default 50)")
    p.add_argument("--val-per-class", type=int, default=10, help="val images per class (default 10)")
    p.add_argument("--seed", type=int, default=0, help="every byte written depends only on it (default 0)")
    p.add_argument("--no-quirks", action="store_true", help="no grayscale/CMYK/PNG-named-.JPEG files")
    p.add_argument("--workers", type=int, default=None, help="encoding processes (default: all CPUs)")
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

    p = sub.add_parser(
        "bench", help="throughput benchmark (same options as bench/throughput.py)", add_help=False
    )
    p.set_defaults(func=None)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        # Imported only for `bench`: it loads torchvision and every backend it measures, which
        # `python -m fastload --help` and the other commands do not need.
        from .benchmark import main as bench_main

        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, OSError, MemoryError, RuntimeError) as e:  # DecodeError is a RuntimeError
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
