"""How often each of a device path's threads lets go of the interpreter per batch (CPU, Linux).

Usage: ``python bench/handovers.py [--data DIR] [--decode device|hybrid] [--batch-size 256]
[--batches 5] [--size 224] [--device cpu|cuda] [--json PATH]``

A loader thread beside the training thread takes it a hand-over each time it lets go of Python's
interpreter and takes it back (a torch call does twice: the call and the freeing of what it
returns; a numpy operation on a large array once or twice; nvImageCodec's C interface once per
batch): measured on this project's machine, 200 tiny torch calls per batch cost a training
thread's stand-in about 24 µs each, a pure-Python loop as long nothing measurable
(``bench/device_overhead.py --beside`` measures that cost; this bench counts its cause). The
count is a property of the code, not of the machine's load: the same batches give the same
numbers, so it compares two versions exactly where timings are noisy.

Counted by standing in for CPython's ``PyEval_SaveThread`` (``bench/_handover_counter.c``,
compiled here with the system's C compiler and loaded with ``LD_PRELOAD``: the bench runs itself
again in a process that has it), per thread over ``--batches`` batches after one (the pass
holds four more, so that every thread works through the whole window; a thread that ends in it
keeps its count), of
``DataLoader(decode=...)`` with ``gpu.RandomResizedCrop(size)`` and ``gpu.RandomHorizontalFlip()``
on a CPU device (nvImageCodec's own CPU decoder where it is installed: its C interface, as on a
GPU; else torchvision's) or, with ``--device cuda``, on the GPU (its decoders, its streams and
pinned copies: the counts a training loop there pays for), ``seed=0``, an
``InMemoryImageFolder`` whose first epoch's CRC-32 checks are left out (they run once, in the
reader threads). ``--data``: a folder of class folders (default: the synthetic set, written to a
temporary folder). ``--decode hybrid`` fixes the split at half of each batch for the CPU
workers.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
#: Set in the process that has the counter loaded.
CHILD = "FASTLOAD_HANDOVER_CHILD"


def build_counter(out_dir: Path) -> Path | None:
    """Compiles ``_handover_counter.c`` into ``out_dir``; ``None`` without a C compiler."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    lib = out_dir / "handover_counter.so"
    subprocess.run(
        [cc, "-O2", "-shared", "-fPIC", "-o", str(lib), str(HERE / "_handover_counter.c"), "-ldl"],
        check=True,
        capture_output=True,
    )
    return lib


#: Batches the pass holds past the counted ones: the feeder (two batches ahead) and the decoder
#: work through the whole window, and none of their work for later batches is left out of it.
BEYOND = 4


def count(args: argparse.Namespace) -> dict[str, Any]:
    """In the process with the counter: each thread's hand-overs per batch."""
    library = ctypes.PyDLL(None)  # the interpreter kept: reading the count lets go of nothing
    counter = library.handover_count
    counter.restype, counter.argtypes = ctypes.c_longlong, [ctypes.c_int]
    import torch

    import fastload
    from fastload import gpu
    from fastload.gpu import nvimgcodec
    from fastload.synthetic import make_imagenet_like

    warnings.simplefilter("ignore")  # the loader's notes about a CPU device
    try:
        module: Any = importlib.import_module("nvidia.nvimgcodec")
    except ImportError:
        module = None
    if args.device != "cpu":
        module = None  # on a GPU: nvImageCodec's own choice, as the loader makes it
    with tempfile.TemporaryDirectory(prefix="fastload-handovers-") as tmp, nvimgcodec.use_module(module):
        root = Path(args.data) if args.data else None
        if root is None:
            per_class = -(-(args.batches + 1 + BEYOND) * args.batch_size // 10)
            synth = make_imagenet_like(tmp, classes=10, per_class=per_class, val_per_class=0)
            root = synth / "train"
        loader = fastload.DataLoader(
            fastload.InMemoryImageFolder(root, check_crc=False),  # as from the second epoch on
            batch_size=args.batch_size,
            shuffle=True,
            seed=0,
            drop_last=True,
            num_workers=2,
            decode=args.decode,
            device=args.device,
            gpu_transforms=gpu.Compose([gpu.RandomResizedCrop(args.size), gpu.RandomHorizontalFlip()]),
        )
        if loader.hybrid is not None:
            loader.hybrid.cpu_share = 0.5
        needed = args.batches + 1 + BEYOND
        if len(loader) < needed:
            raise SystemExit(
                f"error: {root} holds {len(loader)} batches of {args.batch_size}; {needed} needed"
            )
        it = iter(loader)
        next(it)
        seen = {t.name: t.native_id or 0 for t in threading.enumerate()}
        before = {name: counter(tid) for name, tid in seen.items()}
        for _ in range(args.batches):
            next(it)
            seen.update({t.name: t.native_id or 0 for t in threading.enumerate()})
        after = {name: counter(tid) for name, tid in seen.items()}  # a thread that ended keeps its count
        decoder = loader.decoder
        loader.close()
    threads = {
        name: round((after[name] - before.get(name, 0)) / args.batches, 1)
        for name in sorted(after)
        if after[name] > before.get(name, 0)
    }
    return {
        "decode": args.decode,
        "batch_size": args.batch_size,
        "batches": args.batches,
        "size": args.size,
        "device": args.device,
        "decoder": decoder,
        "torch": torch.__version__,
        "per_batch": threads,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", metavar="DIR", help="a folder of class folders (default: the synthetic set)")
    p.add_argument("--decode", choices=["device", "hybrid"], default="device")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--batches", type=int, default=5, help="batches counted, after one (default 5)")
    p.add_argument("--size", type=int, default=224, help="the crop's output size (default 224)")
    p.add_argument("--device", default="cpu", help="the loader's device (default cpu; cuda on a GPU machine)")
    p.add_argument("--json", metavar="PATH", help="write the counts here (a list of one record)")
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    for name in ("batch_size", "batches", "size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} should be at least 1, but got {getattr(args, name)}")
    if args.data and not Path(args.data).is_dir():
        p.error(f"--data {args.data}: no such folder (give a folder of class folders)")
    if os.environ.get(CHILD) != "1":
        if not sys.platform.startswith("linux"):
            print("error: this bench needs Linux (LD_PRELOAD, gettid)", file=sys.stderr)
            return 2
        with tempfile.TemporaryDirectory(prefix="fastload-counter-") as tmp:
            lib = build_counter(Path(tmp))
            if lib is None:
                print(
                    "error: this bench compiles a small C library: install a C compiler (cc)", file=sys.stderr
                )
                return 2
            env = {**os.environ, CHILD: "1", "LD_PRELOAD": str(lib)}
            return subprocess.run([sys.executable, str(Path(__file__).resolve()), *argv], env=env).returncode
    result = count(args)
    print(
        f"decode={result['decode']!r} on {result['device']}, batch {result['batch_size']}, "
        f"RandomResizedCrop({result['size']}) + flip, {result['batches']} batches; {result['decoder']}"
    )
    print(f"{'thread':32s} {'hand-overs per batch':>21s}")
    for name, per_batch in result["per_batch"].items():
        print(f"{name:32s} {per_batch:21.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps([result], indent=2))  # a list of records, as the other benches
    return 0


if __name__ == "__main__":
    sys.exit(main())
