"""The device paths' own CPU work per image, without a GPU: decode="device" with a null decoder.

Usage: ``python bench/device_overhead.py [--images 3000] [--batches 60] [--repeat 5]
[--decoder null|nvimgcodec] [--beside] [--json PATH]``

On a GPU, ``decode="device"`` runs two Python threads beside the training loop (the decoder
thread: read, header columns, crop boxes, nvImageCodec's calls, the images into tensors; the
feeder thread: the crop's resize, flip, normalisation, labels), and what they spend per image in
Python and in torch's per-call overhead (a kernel launch on a GPU) is taken from the training
thread's interpreter. Here the same code runs on the CPU with a null stand-in for nvImageCodec
(bench/_null_nvimgcodec.py: headers parsed, nothing decoded) on small JPEGs (24-48 pixels, written
once to a temporary folder) and an 8-pixel crop, so that the pixels' own work is small and the
rest is that overhead. Rows, each the median of ``--repeat`` runs of ``--batches`` batches of 256,
both rows alternated in every repeat:

* ``in place``: nvImageCodec 0.9's path: the crops decoded into one buffer per batch;
* ``copies``: each image copied out of nvImageCodec's memory (``nvimgcodec.PACKED = False``: older
  versions, or a decoder that cannot decode in place).

``--decoder nvimgcodec``: nvImageCodec itself instead of the null stand-in, with its own CPU decoder
(the small crops really decoded), and a third row first:

* ``C interface``: in place, each batch in one call into nvImageCodec's C interface without the
  interpreter (``fastload._nvimgcodec``); ``in place`` is then the same through nvImageCodec's
  Python objects (``nvimgcodec.NATIVE = False``).

images/s and the process's CPU time per image (both threads; the CPU's own normalisation and
resize are a part of it that a GPU does not have). A CPU measure of the overhead, not a GPU's
figures: bench/throughput.py ``--model`` on a GPU machine is the real one.

``--beside``: a stand-in for the training thread runs beside each pass (:class:`BusyThread`: tiny
torch operations in a loop, each of which lets go of the interpreter as a kernel launch does, on a
CPU of its own where the machine has two or more; the loader's threads and workers on the
others), and a ``busy ms/batch`` column says how much of that thread's time each batch took: its
operations per second alone (measured just before and just after the pass) against beside the
pass. What the
loader's threads take from a training thread's interpreter (their Python, numpy and each torch
call's return to the interpreter), the cost that ``--model``'s ``launch ms`` shows on a GPU.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _null_nvimgcodec as null  # noqa: E402

import fastload  # noqa: E402
from fastload import gpu  # noqa: E402
from fastload._iterator import batch_decoder  # noqa: E402
from fastload.gpu import nvimgcodec  # noqa: E402


def write_small_jpegs(root: Path, images: int, classes: int = 10, seed: int = 0) -> Path:
    """``images`` small random JPEGs (24-48 pixels a side) in ``classes`` class folders under
    ``root/train``; returns that folder."""
    rng = np.random.default_rng(seed)
    train = root / "train"
    for k in range(images):
        folder = train / f"n{k % classes:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        h, w = (int(v) for v in rng.integers(24, 49, 2))
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(
            folder / f"{k:06d}.JPEG", quality=90
        )
    return train


class BusyThread:
    """A training thread's stand-in: tiny torch operations in a loop, counted.

    Each operation lets go of the interpreter and takes it back, as each kernel launch of a
    training step does, so the count falls by what other threads of the process hold the
    interpreter for (and by each hand-over). Runs on ``cpu`` alone where given. ``cpu_seconds``:
    its own CPU time so far (left out of the pass's CPU time per image).
    """

    def __init__(self, cpu: int | None) -> None:
        self.cpu, self.count, self.cpu_seconds = cpu, 0, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="busy", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self.cpu is not None:
            os.sched_setaffinity(0, {self.cpu})  # this thread only
        x = torch.zeros(16)
        start = time.thread_time()
        while not self._stop.is_set():
            for _ in range(200):
                x.add_(1)
            self.count += 200
            self.cpu_seconds = time.thread_time() - start

    def rate(self, seconds: float) -> float:
        """Operations per second over the next ``seconds``."""
        c0, t0 = self.count, time.perf_counter()
        time.sleep(seconds)
        return (self.count - c0) / (time.perf_counter() - t0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _split_cpus() -> tuple[int | None, set[int] | None]:
    """(the busy thread's CPU, the others) where the machine lets this process have two or
    more, else ``(None, None)``. ``main`` keeps the process on the others with ``--beside``."""
    if not hasattr(os, "sched_getaffinity"):
        return None, None
    cpus = sorted(os.sched_getaffinity(0))
    return (cpus[0], set(cpus[1:])) if len(cpus) >= 2 else (None, None)


#: Each row's settings: (nvimgcodec.PACKED, nvimgcodec.NATIVE).
ROWS = {"C interface": (True, True), "in place": (True, False), "copies": (False, False)}


def _run(
    dataset: Any,
    batches: int,
    batch_size: int,
    row: str,
    epoch: int,
    beside: bool = False,
    busy_cpu: int | None = None,
) -> tuple[float, float, float | None]:
    """One timed run: (images/s, CPU microseconds per image, the busy thread's milliseconds per
    batch lost beside it (``beside``, on ``busy_cpu`` where given; else ``None``))."""
    busy: BusyThread | None = None
    alone = 0.0
    if beside:
        busy = BusyThread(busy_cpu)
        alone = busy.rate(0.5)
    try:
        rate, cpu, ops, wall = _timed(dataset, batches, batch_size, row, epoch, busy)
        if busy is not None:  # alone: before and after the pass (the rate alone drifts)
            alone = (alone + busy.rate(0.5)) / 2
    finally:
        if busy is not None:
            busy.stop()
    lost = None if busy is None else (alone * wall - ops) / alone / batches * 1e3
    return rate, cpu, lost


def _timed(
    dataset: Any, batches: int, batch_size: int, row: str, epoch: int, busy: BusyThread | None
) -> tuple[float, float, int, float]:
    """(images/s, CPU microseconds per image, the busy thread's operations meanwhile, seconds)."""
    packed, native = ROWS[row]
    nvimgcodec.PACKED, nvimgcodec.NATIVE = packed, native
    os.environ["FASTLOAD_GPU_EXPERIMENTAL"] = "1"  # in place and the C interface are experimental
    loader = fastload.DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=2,
        decode="device",
        device="cpu",
        gpu_transforms=gpu.Compose(
            [gpu.RandomResizedCrop(8), gpu.RandomHorizontalFlip(), gpu.Normalize([0.5] * 3, [0.25] * 3)]
        ),
    )
    n = 0
    t0, c0 = time.perf_counter(), time.process_time()
    ops0, busy0 = (0, 0.0) if busy is None else (busy.count, busy.cpu_seconds)
    while n < batches * batch_size:
        loader.set_epoch(epoch)
        epoch += 1
        for _, labels in loader:
            n += len(labels)
            if n >= batches * batch_size:
                break
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    ops = 0 if busy is None else busy.count - ops0
    if busy is not None:
        cpu -= busy.cpu_seconds - busy0  # the pass's own CPU time
    region_decoder = batch_decoder(loader, torch.device("cpu")).region_decoder
    loader.close()
    if (
        region_decoder is None
        or region_decoder.packs != packed
        or (region_decoder.native is not None) != native
    ):
        raise RuntimeError(f"the {row} row did not run its path")
    return n / wall, cpu / n * 1e6, ops, wall


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=3000, help="small JPEGs written (default 3000)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--batches", type=int, default=60, help="batches per timed run (default 60)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument(
        "--decoder",
        choices=["null", "nvimgcodec"],
        default="null",
        help="null: the stand-in that decodes nothing (default); nvimgcodec: nvImageCodec's CPU decoder",
    )
    p.add_argument(
        "--beside",
        action="store_true",
        help="a training thread's stand-in beside each pass: how much of its time each batch takes",
    )
    p.add_argument("--json", metavar="PATH", help="write the rows here")
    args = p.parse_args(argv)
    module: Any = null
    if args.decoder == "nvimgcodec":
        try:
            module = importlib.import_module("nvidia.nvimgcodec")
        except ImportError:
            print(
                "error: --decoder nvimgcodec needs nvImageCodec: pip install nvidia-nvimgcodec-cu13",
                file=sys.stderr,
            )
            return 2
    if args.images < args.batch_size:
        print(f"error: --images {args.images} is fewer than one batch of {args.batch_size}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    cpu_busy, others = _split_cpus() if args.beside else (None, None)
    if others is not None:  # every thread made from here on (the loader's, nvImageCodec's) and every
        os.sched_setaffinity(0, others)  # worker keeps off the stand-in's CPU
    # the loader's note on a CPU device with device transforms
    names = ["C interface", "in place", "copies"] if args.decoder == "nvimgcodec" else ["in place", "copies"]
    rows: dict[str, list[tuple[float, float, float | None]]] = {name: [] for name in names}
    previous = nvimgcodec.PACKED, nvimgcodec.NATIVE
    with tempfile.TemporaryDirectory(prefix="fastload-overhead-") as tmp, nvimgcodec.use_module(module):
        dataset = fastload.InMemoryImageFolder(write_small_jpegs(Path(tmp), args.images))
        try:
            _run(dataset, 2, args.batch_size, names[0], 0)  # warm-up: imports, first-use set-up
            for r in range(args.repeat):
                for name in names:
                    rows[name].append(
                        _run(dataset, args.batches, args.batch_size, name, 1000 * r, args.beside, cpu_busy)
                    )
        finally:
            nvimgcodec.PACKED, nvimgcodec.NATIVE = previous
    out = []
    what = (
        "null decoder"
        if args.decoder == "null"
        else f"nvImageCodec {nvimgcodec.nvimgcodec_version()}'s CPU decoder"
    )
    print(f"decode='device', {what}, {args.images} small JPEGs, batch {args.batch_size}, CPU")
    if args.beside:
        where = f"CPU {cpu_busy}, the loader on the others" if cpu_busy is not None else "sharing the CPU"
        print(f"a training thread's stand-in beside each pass ({where})")
    head = f"{'row':11s} {'images/s':>9s} {'min-max':>13s} {'CPU us/image':>13s}"
    print(head + (f" {'busy ms/batch':>14s}" if args.beside else ""))
    for name, runs in rows.items():
        rates, cpu = [r for r, _, _ in runs], [c for _, c, _ in runs]
        row: dict[str, Any] = {
            "row": name,
            "images_per_s": round(statistics.median(rates), 1),
            "min": round(min(rates), 1),
            "max": round(max(rates), 1),
            "cpu_us_per_image": round(statistics.median(cpu), 1),
        }
        line = (
            f"{name:11s} {row['images_per_s']:9.0f} {row['min']:6.0f}-{row['max']:<6.0f} "
            f"{row['cpu_us_per_image']:13.1f}"
        )
        if args.beside:
            row["busy_ms_per_batch"] = round(statistics.median([b for _, _, b in runs if b is not None]), 2)
            line += f" {row['busy_ms_per_batch']:14.2f}"
        out.append(row)
        print(line)
    rate = {row["row"]: row["images_per_s"] for row in out}
    if "C interface" in rate:
        print(f"C interface / in place: {rate['C interface'] / rate['in place']:.2f}x images/s")
    print(f"in place / copies: {rate['in place'] / rate['copies']:.2f}x images/s")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
