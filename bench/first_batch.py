"""From script start to the first batch: torch + torchvision against fastload, each in a fresh process.

Usage::

    python bench/first_batch.py [--data ROOT/train] [--workers 2] [--batch-size 64] [--runs 5]
                                [--context fork] [--json PATH]

Three scripts, each started ``--runs`` times as a new Python process, interleaved (torch, fastload,
swap, torch, ...) so that a change of load hits all of them alike:

=========  ===========================================================================
torch      ``torch.utils.data.DataLoader`` + torchvision ``ImageFolder`` + torchvision transforms
fastload   ``fastload.DataLoader`` + ``fastload.ImageFolder`` + fastload transforms (imports only
           fastload)
swap       ``fastload.DataLoader`` + torchvision ``ImageFolder`` + torchvision transforms (only the
           DataLoader class swapped)
=========  ===========================================================================

The pipeline is ImageNet training's: ``RandomResizedCrop(224)``, ``RandomHorizontalFlip()``,
``ToTensor()``, ``Normalize`` (fastload: the crop and flip fused with decoding, the normalization on
the batch), shuffled, ``--workers`` process workers started with ``--context``. Each script reports
wall-clock times since its process was launched (the parent's clock before ``subprocess.Popen``):
when its imports were done, when the loader was built (dataset scanned), and when the first batch
was in hand; then ``iter()`` to the first batch on its own (``next(iter(loader))``: the workers
start, decode and hand over one batch). Medians over the runs, with min-max.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_DATA = Path.home() / ".cache" / "fastload" / "synthetic-imagenet" / "train"
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)

_HEAD = "import time\nt_start = time.time()\n"
_TAIL = """
t_built = time.time()
images, labels = next(iter(loader))
t_first = time.time()
assert images.shape == (BATCH, 3, 224, 224), images.shape
print("TIMES", t_start, t_imported, t_built, t_first, flush=True)
"""
SCRIPTS = {
    "torch": """
import torch
import torchvision
from torchvision import transforms as tv
t_imported = time.time()
dataset = torchvision.datasets.ImageFolder(ROOT, transform=tv.Compose([
    tv.RandomResizedCrop(224), tv.RandomHorizontalFlip(), tv.ToTensor(), tv.Normalize(MEAN, STD)]))
loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=WORKERS,
                                     multiprocessing_context=CONTEXT)
""",
    "fastload": """
import fastload
from fastload import gpu, transforms as T
t_imported = time.time()
dataset = fastload.ImageFolder(ROOT, transform=T.Compose([
    T.RandomResizedCrop(224), T.RandomHorizontalFlip()]))
loader = fastload.DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=WORKERS,
                             multiprocessing_context=CONTEXT, gpu_transforms=gpu.Normalize(MEAN, STD))
""",
    "swap": """
import fastload
import torchvision
from torchvision import transforms as tv
t_imported = time.time()
dataset = torchvision.datasets.ImageFolder(ROOT, transform=tv.Compose([
    tv.RandomResizedCrop(224), tv.RandomHorizontalFlip(), tv.ToTensor(), tv.Normalize(MEAN, STD)]))
loader = fastload.DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=WORKERS,
                             multiprocessing_context=CONTEXT)
""",
}
STAGES = ("imported", "built", "first batch", "iter -> first batch")


def script(name: str, root: Path, workers: int, batch: int, context: str) -> str:
    """The whole script of pipeline ``name``, its settings written in as constants."""
    settings = (
        f"ROOT, WORKERS, BATCH, CONTEXT = {str(root)!r}, {workers}, {batch}, {context!r}\n"
        f"MEAN, STD = {MEAN!r}, {STD!r}\n"
    )
    body = SCRIPTS[name]
    if name == "fastload":  # the loader must really take its fast path
        body += "assert loader.fast_path, loader.fast_path_reason\n"
    return _HEAD + settings + body + _TAIL


def run_once(code: str) -> dict[str, float]:
    """Seconds since launch of each stage of one fresh process running ``code``."""
    launched = time.time()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"error: a benchmark script failed:\n{done.stderr[-3000:]}")
    line = next(line for line in done.stdout.splitlines() if line.startswith("TIMES "))
    _, imported, built, first = (float(v) - launched for v in line.split()[1:])
    return {
        "imported": imported,
        "built": built,
        "first batch": first,
        "iter -> first batch": first - built,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--data", type=Path, default=DEFAULT_DATA, help=f"an image folder (default {DEFAULT_DATA})"
    )
    p.add_argument("--workers", type=int, default=2, help="process workers (default 2)")
    p.add_argument("--batch-size", type=int, default=64, help="images per batch (default 64)")
    p.add_argument("--runs", type=int, default=5, help="fresh processes per script (default 5)")
    p.add_argument("--context", choices=("fork", "spawn", "forkserver"), default="fork")
    p.add_argument("--pipelines", default=",".join(SCRIPTS), help="comma-separated (default: all three)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    names = [n for n in args.pipelines.split(",") if n]
    unknown = sorted(set(names) - set(SCRIPTS))
    if unknown or args.runs < 1 or args.workers < 1 or args.batch_size < 1:
        p.error(
            f"unknown pipelines {unknown}" if unknown else "--runs, --workers and --batch-size must be >= 1"
        )
    if not args.data.is_dir():
        p.error(f"--data {args.data} is not a folder (write a synthetic set with `python -m fastload synth`)")
    codes = {n: script(n, args.data, args.workers, args.batch_size, args.context) for n in names}
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for _ in range(args.runs):
        for n in names:
            runs[n].append(run_once(codes[n]))
    print(
        f"{args.data}: {args.workers} workers ({args.context}), batch {args.batch_size}, "
        f"{args.runs} runs each; seconds since the process was launched (median, min-max)"
    )
    print(f"{'pipeline':10s}" + "".join(f"{s:>24s}" for s in STAGES))
    result: dict[str, dict[str, dict[str, float]]] = {}
    for n in names:
        result[n] = {}
        cells = []
        for s in STAGES:
            values = [r[s] for r in runs[n]]
            stat = {"median": statistics.median(values), "min": min(values), "max": max(values)}
            result[n][s] = stat
            cells.append(f"{stat['median']:8.2f} ({stat['min']:.2f}-{stat['max']:.2f})")
        print(f"{n:10s}" + "".join(f"{c:>24s}" for c in cells))
    if args.json is not None:
        settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        args.json.write_text(json.dumps({"settings": settings, "results": result}, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
