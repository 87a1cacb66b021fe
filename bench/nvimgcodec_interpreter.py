"""What a batch decode through nvImageCodec takes from the interpreter, on the CPU.

Usage: ``python bench/nvimgcodec_interpreter.py [--images 256] [--seconds 2] [--repeat 3] [--json PATH]``

On a GPU machine the device paths' decoder thread shares the interpreter with the training
thread, whose kernel launches are Python: every microsecond the decoder thread holds it is one
the training thread may wait for, and while the training thread holds it the decoder thread waits.
This measures both sides without a GPU, with nvImageCodec's own CPU decoder on small JPEGs (16
pixels a side, regions of 8: the decoding itself costs little, so what is left is the calls around
it), each way of calling it:

* ``Python interface``: a code stream, a sub-code stream, a region and an output image object per
  image (``nvimgcodec.as_images`` of planar buffers), then ``Decoder.decode`` (fastload's path where
  its C extension is not built);
* ``C interface``: ``fastload._nvimgcodec``: one call per batch, the interpreter released inside.

Columns (medians of ``--repeat`` alternated runs): images/s alone, images/s beside a Python thread
that counts in a loop (the training thread's stand-in), and that thread's count meanwhile as a
share of its count alone (measured just before).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image


def _jpegs(n: int) -> list[bytes]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def _rate(step: Callable[[], None], seconds: float, images: int) -> float:
    step()
    t0, done = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        step()
        done += images
    return done / (time.perf_counter() - t0)


def _beside(step: Callable[[], None] | None, seconds: float, images: int) -> tuple[float, float]:
    """(images/s, the counting thread's count per second) with both running (``step`` ``None``: the
    counting thread alone, this one asleep)."""
    stop, counted = threading.Event(), [0]

    def count() -> None:
        n = 0
        while not stop.is_set():
            n += 1
        counted[0] = n

    thread = threading.Thread(target=count)
    t0 = time.perf_counter()
    thread.start()
    if step is None:
        time.sleep(seconds)
        rate = 0.0
    else:
        rate = _rate(step, seconds, images)
    stop.set()
    thread.join()
    return rate, counted[0] / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=256, help="images per batch (default 256)")
    p.add_argument("--seconds", type=float, default=2.0, help="seconds per measurement (default 2)")
    p.add_argument("--repeat", type=int, default=3, help="measurements per row, medians reported (default 3)")
    p.add_argument("--json", metavar="PATH", help="write the rows here")
    args = p.parse_args(argv)
    try:
        from nvidia import nvimgcodec as nv
    except ImportError:
        print("error: needs nvImageCodec: pip install 'nvidia-nvimgcodec-cu13[all]'", file=sys.stderr)
        return 2
    try:
        import fastload._nvimgcodec as native
    except ImportError:
        print(
            "error: fastload's C extension for nvImageCodec is not built (a C compiler builds it)",
            file=sys.stderr,
        )
        return 2
    n = args.images
    data = [np.frombuffer(d, dtype=np.uint8) for d in _jpegs(n)]
    out = np.zeros(n * 192, dtype=np.uint8)
    pointers = (out.ctypes.data + np.arange(n) * 192).astype(np.uint64)
    regions = np.tile(np.array([[4, 4, 12, 12]], dtype=np.int64), (n, 1))
    cpu_only = nv.NVIMGCODEC_DEVICE_CPU_ONLY
    decoder = nv.Decoder(
        device_id=cpu_only, max_num_cpu_threads=1, backends=[nv.Backend(nv.BackendKind.CPU_ONLY)]
    )
    params = nv.DecodeParams(
        apply_exif_orientation=False,
        color_spec=nv.ColorSpec.SRGB,
        allow_any_depth=False,
        sample_format=nv.SampleFormat.P_RGB,
    )

    class Plane:
        __slots__ = ("__array_interface__",)

        def __init__(self, ptr: int) -> None:
            self.__array_interface__ = {
                "shape": (3, 8, 8),
                "typestr": "|u1",
                "data": (ptr, False),
                "version": 3,
            }

    def python_interface() -> None:
        sources = [nv.CodeStream(d).get_sub_code_stream(region=nv.Region(4, 4, 12, 12)) for d in data]
        images = nv.as_images([Plane(int(q)) for q in pointers], sample_format=nv.SampleFormat.P_RGB)
        decoder.decode(sources, images=images, params=params)

    library = os.path.join(os.path.dirname(nv.__file__), "libnvimgcodec.so.0")
    session: Any = native.Session(library, cpu_only, [(1, 1.0)], "", 1, False)

    def c_interface() -> None:
        session.decode(data, regions, pointers, 0)

    ways = (("Python interface", python_interface), ("C interface", c_interface))
    runs: dict[str, list[tuple[float, float, float]]] = {name: [] for name, _ in ways}
    for _ in range(args.repeat):  # alternated, each against the counting thread's own count alone
        for name, step in ways:
            alone = _beside(None, args.seconds, n)[1]
            rate = _rate(step, args.seconds, n)
            beside, count = _beside(step, args.seconds, n)
            runs[name].append((rate, beside, count / alone))
    rows = []
    print(f"nvImageCodec {nv.__version__}'s CPU decoder, batches of {n} JPEGs of 16 pixels, regions of 8")
    print(f"(medians of {args.repeat})")
    print(f"{'interface':18s} {'images/s alone':>15s} {'images/s beside':>16s} {'counting thread':>16s}")
    for name, _ in ways:
        rate, beside, share = (statistics.median(v) for v in zip(*runs[name], strict=True))
        row = {
            "interface": name,
            "images_per_s": round(rate),
            "images_per_s_beside": round(beside),
            "counting_thread_share": round(share, 3),
        }
        rows.append(row)
        print(f"{name:18s} {rate:15.0f} {beside:16.0f} {100 * share:15.0f}%")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
