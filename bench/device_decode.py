"""Decoding alone on the device: fastload's decode="device" against torchvision's batched nvJPEG.

Usage: ``python bench/device_decode.py [--data ROOT] [--batch-size 256] [--batches 20] [--json PATH]``

On the same files (the train split, read into memory first: no I/O), images/s of

* ``torchvision``: ``torchvision.io.decode_jpeg(list_of_jpegs, device="cuda")``, the batched
  nvJPEG call on the JPEGs it takes (what fastload's device decoding builds on);
* ``decode_batch``: :func:`fastload.gpu.decode.decode_batch` on the same JPEGs, routed by their
  headers (the routes already known, as from the second epoch on): its overhead over the call;
* ``loader``: ``fastload.DataLoader(decode="device")`` with ``gpu.RandomResizedCrop(224)`` (the
  feeder thread: read, route, decode, crop, labels; no model), ``--workers`` reader threads, over
  every image (the synthetic set's PNG and CMYK files decoded on the CPU);
* ``hybrid``: the same with ``decode="hybrid"``: each batch split between the device's decoder and
  ``--hybrid-workers`` CPU worker processes by their measured rates (the split it settled on is
  printed under the table).

Each row: the median of ``--repeat`` runs of ``--batches`` batches after one warm-up run, with a
device synchronisation before the clock stops. The ``vs tv`` column divides by the torchvision
row. ``--device cpu`` runs the same code on the CPU decoders (a functional check, not a GPU's
figures). Issue target: ``decode_batch`` and ``loader`` >= 0.9x torchvision on a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import torch

import fastload
from fastload import gpu
from fastload.decode import decode_jpegs
from fastload.gpu.decode import decode_batch, device_decoder, device_routes

from _harness.config import default_data
from _harness.timing import endless


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rate(run: Any, batches: int, batch_size: int, repeat: int, device: torch.device) -> list[float]:
    run(1)  # warm-up: the decoder's state, the allocator, cuDNN
    _sync(device)
    rates = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        run(batches)
        _sync(device)
        rates.append(batches * batch_size / (time.perf_counter() - t0))
    return rates


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=None, help=f"dataset root (default {default_data()})")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--batches", type=int, default=20, help="batches per timed run (default 20)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--workers", type=int, default=4, help="the loader row's reader threads (default 4)")
    p.add_argument(
        "--hybrid-workers",
        type=int,
        default=None,
        help="the hybrid row's CPU worker processes (default: fastload's automatic count)",
    )
    p.add_argument("--device", default=None, help="cuda (default where available) or cpu")
    p.add_argument("--json", metavar="PATH", help="write the rows here")
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda: CUDA is not available on this machine", file=sys.stderr)
        return 2
    root = (args.data or default_data()) / "train"
    ds = fastload.InMemoryImageFolder(root)
    n = (len(ds) // args.batch_size) * args.batch_size
    if n < args.batch_size:
        print(
            f"error: {root} holds {len(ds)} images, fewer than one batch of {args.batch_size}",
            file=sys.stderr,
        )
        return 2
    encoded = [ds.get_bytes(i) for i in range(n)]
    routes = np.zeros(len(ds), dtype=np.int8)
    on_device = device_routes(encoded, np.arange(n), routes)
    batches = [range(k, k + args.batch_size) for k in range(0, n, args.batch_size)]
    tensors = [torch.frombuffer(bytearray(e), dtype=torch.uint8) for e in encoded]

    def torchvision_rows(count: int) -> None:  # one batched call (one per image before torchvision 0.19)
        for b in islice(_cycle(batches), count):
            decode_jpegs([tensors[i] for i in b if on_device[i]], device)

    def fastload_rows(count: int) -> None:  # the same JPEGs (the others would be the CPU's work)
        for b in islice(_cycle(batches), count):
            jpegs = [encoded[i] for i in b if on_device[i]]
            decode_batch(jpegs, device, on_device=[True] * len(jpegs))

    def device_loader(decode: str, workers: int | str) -> fastload.DataLoader[Any]:
        return fastload.DataLoader(
            ds,
            batch_size=args.batch_size,
            shuffle=True,
            seed=0,
            drop_last=True,
            num_workers=workers,
            decode=decode,
            gpu_transforms=gpu.RandomResizedCrop(224),
            device=device,
        )

    loader = device_loader("device", args.workers)
    stream = endless(loader)

    def loader_rows(count: int) -> None:
        for batch in islice(stream, count):
            del batch

    hybrid = device_loader("hybrid", "auto" if args.hybrid_workers is None else args.hybrid_workers)
    hybrid_stream = endless(hybrid)

    def hybrid_rows(count: int) -> None:
        for batch in islice(hybrid_stream, count):
            del batch

    rows = []
    for name, run in (
        ("torchvision", torchvision_rows),
        ("decode_batch", fastload_rows),
        ("loader", loader_rows),
        ("hybrid", hybrid_rows),
    ):
        rates = _rate(run, args.batches, args.batch_size, args.repeat, device)
        rows.append({"row": name, "images_per_s": statistics.median(rates), "runs": rates})
    loader.close()
    hybrid.close()
    base = rows[0]["images_per_s"]
    print(f"device {device} ({device_decoder(device)}), {n} images of {root}, batch {args.batch_size}")
    print(f"{'row':<14} {'images/s':>9} {'min-max':>13} {'vs tv':>6}")
    for r in rows:
        r["vs_torchvision"] = r["images_per_s"] / base
        spread = f"{min(r['runs']):.0f}-{max(r['runs']):.0f}"
        print(f"{r['row']:<14} {r['images_per_s']:>9.0f} {spread:>13} {r['vs_torchvision']:>6.2f}")
    print(f"hybrid: {hybrid.hybrid}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


def _cycle(batches: list[range]) -> Any:
    while True:
        yield from batches


if __name__ == "__main__":
    sys.exit(main())
