"""Decode + per-sample transform speed and accuracy: fastload's fused path vs torchvision's.

Usage: ``python bench/decode.py [--data ROOT] [--images 300] [--repeats 5] [--json PATH]``

Every rate is images/s in one process on one core (``torch.set_num_threads(1)``), files already in
memory (no I/O), the median of ``--repeats`` passes over the same images (passes of all rows
interleaved, so load changes hit every row alike), as wall-clock and as CPU time of the process
(the latter is steadier on a shared machine). Rows:

* full decode: PIL (``decode_pil``) and ``torchvision.io.decode_image`` — the decoder floor;
* train: torchvision's per-sample pipeline (PIL decode, ``RandomResizedCrop(224)``,
  ``RandomHorizontalFlip``, uint8 tensor), as v1 transforms on PIL and as v2 on tensors, vs
  fastload's fused ``decode_into`` (and the same with region-of-interest decoding turned off, i.e.
  torchvision.io full-size decoding, and with both off, i.e. PIL only, to show what each decoder
  choice is worth);
* val: ``Resize(256)`` + ``CenterCrop(224)``, the same comparisons;
* the fused pipelines with DCT-scaled decoding turned off (what reduced-size decoding buys);
* threads: the fused train path, the torchvision v1 one and PIL's decode with 2 threads vs 1, with
  the cores the process used (CPU time / wall): above 1 only if the GIL is released, so thread
  workers scale when there are cores for them;
* a GIL check that needs no free core: how many calls kept a second Python thread from running
  at all (a C call holding the GIL: every call; a decoder releasing it: far fewer).

Accuracy: the mean absolute difference (uint8 levels) between fastload's output and torchvision's
reference at the *same* crop parameters (full PIL decode, ``resized_crop(..., antialias=True)`` on
the uint8 tensor), over all images, and over the images decoded at a reduced DCT scale.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torchvision
import torchvision.transforms as T1
import torchvision.transforms.v2 as T2
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms.v2 import functional as F

import fastload.decode
import fastload.transforms as fT
from fastload import rng
from fastload.decode import dct_scale, decode_pil, open_image
from fastload.synthetic import make_imagenet_like


def _files(root: Path, n: int) -> list[Path]:
    files = sorted(p for p in root.rglob("*") if p.suffix.lower() in (".jpeg", ".jpg", ".png"))
    if not files:
        raise SystemExit(f"no images under {root}")
    step = max(1, len(files) // n)
    return files[::step][:n]


def _one_pass(fn: Callable[[int], object], n: int, threads: int) -> tuple[float, float]:
    """One pass over the ``n`` images: (wall seconds, process CPU seconds)."""
    w0, c0 = time.perf_counter(), time.process_time()
    if threads == 0:
        for i in range(n):
            fn(i)
    else:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda c: [fn(i) for i in range(c, n, threads)], range(threads)))
    return time.perf_counter() - w0, time.process_time() - c0


def _gil_blocked(fn: Callable[[int], object], n: int) -> tuple[int, int]:
    """How many calls of ``fn`` (of those over 1 ms) kept another Python thread from running at all.

    A second thread appends timestamps in a tight Python loop; a call during which it has a gap
    of at least 80% of the call's duration held the GIL (or the OS did not schedule the thread:
    on one free core that happens for about half the calls even when the GIL is released). Code
    holding the GIL scores all of its calls, whatever the machine's load.
    """
    stop = False
    stamps: list[float] = []

    def spin() -> None:
        append, clock = stamps.append, time.perf_counter
        while not stop:
            append(clock())

    old = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)  # Python code hands the GIL over every 0.5 ms
    th = threading.Thread(target=spin)
    th.start()
    spans = []
    try:
        time.sleep(0.01)
        for i in range(n):
            t0 = time.perf_counter()
            fn(i)
            spans.append((t0, time.perf_counter()))
    finally:
        stop = True
        th.join()
        sys.setswitchinterval(old)
    blocked = long = 0
    for t0, t1 in spans:
        if t1 - t0 < 1e-3:
            continue
        long += 1
        inside = [t0] + stamps[bisect.bisect_left(stamps, t0) : bisect.bisect_right(stamps, t1)] + [t1]
        blocked += max(b - a for a, b in zip(inside, inside[1:], strict=False)) >= 0.8 * (t1 - t0)
    return blocked, long


@contextmanager
def _patched(module: Any, **attrs: Any) -> Iterator[None]:
    """Sets ``module.name = value`` for the pass; a name ``"decode.X"`` patches ``fastload.decode.X``."""
    targets = [
        (fastload.decode, k[len("decode.") :]) if k.startswith("decode.") else (module, k) for k in attrs
    ]
    saved = [getattr(m, k) for m, k in targets]
    for (m, k), v in zip(targets, attrs.values(), strict=False):
        setattr(m, k, v)
    try:
        yield
    finally:
        for (m, k), v in zip(targets, saved, strict=False):
            setattr(m, k, v)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--data", type=Path, default=None, help="an image tree (default: a fresh synthetic ImageNet-like set)"
    )
    parser.add_argument("--images", type=int, default=300, help="images to use (spread over the tree)")
    parser.add_argument(
        "--repeats", type=int, default=5, help="passes per measurement (the median is reported)"
    )
    parser.add_argument("--size", type=int, default=224, help="output size")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    tmp = None
    root = args.data
    if root is None:
        tmp = tempfile.TemporaryDirectory(prefix="fastload-bench-decode-")
        root = make_imagenet_like(
            tmp.name, classes=10, per_class=max(1, args.images // 10), val_per_class=0, seed=0
        )
    paths = _files(root, args.images)
    datas = [p.read_bytes() for p in paths]
    tensors = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in datas]
    n = len(datas)
    s = args.size
    print(
        f"{n} images from {root}; torch {torch.__version__}, torchvision {torchvision.__version__}, Pillow "
        f"{__import__('PIL').__version__}, 1 thread",
        file=sys.stderr,
    )

    train = fT.Compose([fT.RandomResizedCrop(s), fT.RandomHorizontalFlip()])
    val = fT.Compose([fT.Resize(round(s * 256 / 224)), fT.CenterCrop(s)])
    tv1_train = T1.Compose([T1.RandomResizedCrop(s), T1.RandomHorizontalFlip(), T1.PILToTensor()])
    tv1_val = T1.Compose([T1.Resize(round(s * 256 / 224)), T1.CenterCrop(s), T1.PILToTensor()])
    tv2_train = T2.Compose(
        [T2.PILToTensor(), T2.RandomResizedCrop(s, antialias=True), T2.RandomHorizontalFlip()]
    )
    tv2_val = T2.Compose(
        [T2.PILToTensor(), T2.Resize(round(s * 256 / 224), antialias=True), T2.CenterCrop(s)]
    )
    buf = np.empty((n, s, s, 3), dtype=np.uint8)

    def fused(t: fT.Transform) -> Callable[[int], object]:
        def run(i: int) -> None:
            with rng.sample_scope(0, 0, i):
                t.decode_into(datas[i], buf[i], str(paths[i]))

        return run

    # (label, per-image function, threads (0: in this thread), module patch for the pass)
    cases: list[tuple[str, Callable[[int], object], int, dict[str, Any]]] = [
        ("full decode, PIL (decode_pil)", lambda i: decode_pil(datas[i]), 0, {}),
        (
            "full decode, torchvision.io.decode_image",
            lambda i: decode_image(tensors[i], mode=ImageReadMode.RGB),
            0,
            {},
        ),
        (
            "train, torchvision v1 (PIL decode+RRC+flip+PILToTensor)",
            lambda i: tv1_train(decode_pil(datas[i])),
            0,
            {},
        ),
        (
            "train, torchvision v2 (PIL decode, tensor RRC+flip)",
            lambda i: tv2_train(decode_pil(datas[i])),
            0,
            {},
        ),
        ("train, fastload fused decode_into", fused(train), 0, {}),
        # What each choice is worth: PIL decoding everything (what happens once torchvision.io's
        # deprecated decoder is gone), and DCT-scaled decoding turned off.
        (
            "train, fastload fused, region decoding off (torchvision.io)",
            fused(train),
            0,
            {"decode.USE_ROI_DECODE": False},
        ),
        (
            "train, fastload fused, PIL only (no C extension, no torchvision.io)",
            fused(train),
            0,
            {"_TORCH_JPEG_MODES": (), "decode.USE_ROI_DECODE": False},
        ),
        ("train, fastload fused, DCT scaling off", fused(train), 0, {"dct_scale": lambda *a: 1}),
        (
            "val, torchvision v1 (PIL decode+Resize+CenterCrop)",
            lambda i: tv1_val(decode_pil(datas[i])),
            0,
            {},
        ),
        ("val, torchvision v2 (PIL decode, tensor ops)", lambda i: tv2_val(decode_pil(datas[i])), 0, {}),
        ("val, fastload fused decode_into", fused(val), 0, {}),
        (
            "val, fastload fused, region decoding off (torchvision.io)",
            fused(val),
            0,
            {"decode.USE_ROI_DECODE": False},
        ),
        (
            "val, fastload fused, PIL only (no C extension, no torchvision.io)",
            fused(val),
            0,
            {"_TORCH_JPEG_MODES": (), "decode.USE_ROI_DECODE": False},
        ),
        ("val, fastload fused, DCT scaling off", fused(val), 0, {"dct_scale": lambda *a: 1}),
    ]
    for label, fn in (
        ("train, fastload fused", fused(train)),
        ("train, torchvision v1", lambda i: tv1_train(decode_pil(datas[i]))),
        ("full decode, PIL", lambda i: decode_pil(datas[i])),
    ):
        cases += [(label, fn, 1, {}), (label, fn, 2, {})]

    # Interleaved: every pass of every case once per round, so a machine whose load changes
    # during the run affects all cases alike; the median over rounds is reported.
    times: list[list[tuple[float, float]]] = [[] for _ in cases]
    for _label, fn, _threads, patch in cases:
        with _patched(fT, **patch):
            for i in range(min(n, 20)):  # warm up (lazy imports, allocator)
                fn(i)
    for r in range(args.repeats):
        for k, (_label, fn, threads, patch) in enumerate(cases):
            with _patched(fT, **patch):
                times[k].append(_one_pass(fn, n, threads))
        print(f"round {r + 1}/{args.repeats} done", file=sys.stderr)
    rows: list[tuple[str, float, float]] = []
    thread_rows: list[tuple[str, int, float, float]] = []
    for (label, _fn, threads, _patch), ts in zip(cases, times, strict=False):
        wall = n / statistics.median(w for w, c in ts)
        if threads == 0:
            rows.append((label, wall, n / statistics.median(c for w, c in ts)))
        else:
            thread_rows.append((label, threads, wall, statistics.median(c / w for w, c in ts)))

    # GIL check, independent of free cores: a sort of a shuffled list is a C call holding the GIL.
    shuffled = list(np.random.default_rng(0).permutation(200_000).tolist())
    gil_rows = [
        (label, *_gil_blocked(fn, n))
        for label, fn in (
            ("control: sorted() of 200k ints (holds the GIL)", lambda i: sorted(shuffled)),
            ("full decode, PIL", lambda i: decode_pil(datas[i])),
            ("full decode, torchvision.io", lambda i: decode_image(tensors[i], mode=ImageReadMode.RGB)),
            ("train, fastload fused decode_into", fused(train)),
        )
    ]

    # Accuracy at the same crop parameters.
    def reference(t: fT.Transform, i: int) -> torch.Tensor:
        img = torch.from_numpy(np.array(decode_pil(datas[i]))).permute(2, 0, 1)
        with rng.sample_scope(0, 0, i):
            plan = t.plan(img.shape[1], img.shape[2])
        for op in plan.ops:
            if op[0] == "crop":
                img = F.crop(img, *op[1:])
            elif op[0] == "resize":
                img = F.resize(img, [op[1], op[2]], antialias=True)
            elif op[0] == "center_crop":
                img = F.center_crop(img, [op[1], op[2]])
            else:
                img = F.horizontal_flip(img)
        return img

    accuracy = {}
    for label, t in (("train", train), ("val", val)):
        diffs, reduced = [], []
        for i in range(n):
            with rng.sample_scope(0, 0, i):
                got = t.decode_and_apply(datas[i])
            ref = reference(t, i)
            d = float((got.int() - ref.int()).abs().float().mean())
            diffs.append(d)
            img = open_image(datas[i])
            with rng.sample_scope(0, 0, i):
                plan = t.plan(img.height, img.width)
            x0, y0, x1, y1 = plan.box
            if (
                img.format == "JPEG"
                and plan.fusable
                and dct_scale(x1 - x0, y1 - y0, plan.width, plan.height) > 1
            ):
                reduced.append(d)
        accuracy[label] = {
            "mean_abs_diff": statistics.fmean(diffs),
            "max_image_mean_abs_diff": max(diffs),
            "dct_scaled_images": len(reduced),
            "mean_abs_diff_dct_scaled": statistics.fmean(reduced) if reduced else None,
        }
        print(
            f"{label}: mean abs diff vs torchvision {accuracy[label]['mean_abs_diff']:.3f} levels (worst "
            f"image {max(diffs):.3f}); "
            f"{len(reduced)}/{n} DCT-scaled, their mean {accuracy[label]['mean_abs_diff_dct_scaled']}",
            file=sys.stderr,
        )

    print(f"{n} images, output {s}x{s}, load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs\n")
    print("| pipeline | images/s (wall) | images/s (CPU time) |\n|---|---:|---:|")
    for label, wall, cpu in rows:
        print(f"| {label} | {wall:.0f} | {cpu:.0f} |")
    print("\n| threads | pipeline | images/s (wall) | cores used (CPU time / wall) |\n|---|---|---:|---:|")
    for label, threads, wall, cores in thread_rows:
        print(f"| {threads} | {label} | {wall:.0f} | {cores:.2f} |")
    print("\n| GIL check | calls > 1 ms during which another Python thread could not run |\n|---|---:|")
    for label, blocked, long in gil_rows:
        print(f"| {label} | {blocked}/{long} |")
    print(
        "\n| pipeline | mean abs diff (uint8 levels) | worst image | DCT-scaled images | their mean abs "
        "diff |\n|---|---:|---:|---:|---:|"
    )
    for label, a in accuracy.items():
        dd = a["mean_abs_diff_dct_scaled"]
        print(
            f"| {label} | {a['mean_abs_diff']:.3f} | {a['max_image_mean_abs_diff']:.3f} | "
            f"{a['dct_scaled_images']}/{n} | {'-' if dd is None else f'{dd:.3f}'} |"
        )
    if args.json is not None:
        rates = {label: {"wall": wall, "cpu": cpu} for label, wall, cpu in rows}
        threaded = [
            {"pipeline": label, "threads": t, "wall": wall, "cores_used": cores}
            for label, t, wall, cores in thread_rows
        ]
        gil = {label: {"blocked_calls": b, "calls_over_1ms": c} for label, b, c in gil_rows}
        out = {
            "images": n,
            "size": s,
            "data": str(root),
            "load_average": os.getloadavg()[0],
            "rates": rates,
            "threads": threaded,
            "gil": gil,
            "accuracy": accuracy,
        }
        args.json.write_text(json.dumps(out, indent=2))
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
