"""Batched fastload.gpu transforms vs a per-sample torchvision v2 loop, and their agreement.

Times ``RandomResizedCrop(224) + RandomHorizontalFlip + Normalize`` on a uint8 batch
(default 64 x 3 x 400 x 350), done two ways:

- fastload: ``fastload.gpu.Compose`` on the whole batch, per-sample parameters from the indices;
  both for an NCHW tensor and for a list of differently sized images (device-decode output);
- torchvision: ``torchvision.transforms.v2`` applied image by image, then ``torch.stack``.

On a machine without CUDA these are CPU numbers and are labelled so; with CUDA (or
``--device cuda``) the same script times the device, with ``torch.cuda.synchronize()`` around
each timed run. Reports the median of ``--repeat`` runs after ``--warmup`` runs.

``--accuracy`` also measures how far the batched bilinear (antialiased) resampling is from
torchvision's per-sample ``resized_crop``, in uint8 levels, for mild down-, strong down- and
upscales.

Usage::

    python bench/gpu_transforms.py --repeat 7 --accuracy --json bench/results/gpu_transforms.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torchvision
import torchvision.transforms.v2 as v2
import torchvision.transforms.v2.functional as tvf

from fastload import gpu
from fastload.device import default_device
from fastload.gpu.streams import stream_backend

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def natural(h: int, w: int, seed: int) -> torch.Tensor:
    """A photo-like uint8 CHW image: smooth structure plus mild noise."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.randint(0, 256, (3, h // 8 + 2, w // 8 + 2), generator=g, dtype=torch.uint8)
    smooth = tvf.resize(coarse, [h, w], antialias=True).to(torch.int16)
    noise = torch.randint(-10, 11, (3, h, w), generator=g, dtype=torch.int16)
    return (smooth + noise).clamp(0, 255).to(torch.uint8)


def timed(fn: Callable[[], Any], repeat: int, warmup: int, sync: Callable[[], None]) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return times


def accuracy(device: torch.device) -> list[dict[str, Any]]:
    """Batched crop+resize vs torchvision per sample (CPU uint8 and float paths), in uint8 levels."""
    cases = [
        ("mild downscale 400x350 -> 224, scale (0.5, 1)", 224, (0.5, 1.0)),
        ("typical RRC 400x350 -> 224, scale (0.08, 1)", 224, (0.08, 1.0)),
        ("strong downscale 400x350 -> 64, scale (0.5, 1)", 64, (0.5, 1.0)),
        ("upscale 400x350 -> 224, scale (0.01, 0.05)", 224, (0.01, 0.05)),
    ]
    images = torch.stack([natural(400, 350, 1000 + k) for k in range(16)])
    indices = list(range(16))
    rows = []
    for name, size, scale in cases:
        t = gpu.RandomResizedCrop(size, scale=scale)
        out = t(images.to(device), indices=indices).cpu().to(torch.int32)
        top, left, h, w = t.get_params(images, indices=indices)
        boxes = [(int(top[r]), int(left[r]), int(h[r]), int(w[r])) for r in range(len(images))]
        ref_u8 = torch.stack([tvf.resized_crop(images[r], *boxes[r], [size, size]) for r in indices]).to(
            torch.int32
        )
        ref_f = torch.stack([tvf.resized_crop(images[r].float(), *boxes[r], [size, size]) for r in indices])
        ref_f = ref_f.round().clamp(0, 255).to(torch.int32)
        d8, df = (out - ref_u8).abs().float(), (out - ref_f).abs().float()

        def summary(d: torch.Tensor) -> dict[str, float]:
            return {
                "mean": d.mean().item(),
                "max": d.max().item(),
                "frac_differ": (d > 0).float().mean().item(),
            }

        rows.append({"case": name, "vs_torchvision_uint8": summary(d8), "vs_torchvision_float": summary(df)})
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--height", type=int, default=400)
    parser.add_argument("--width", type=int, default=350)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--accuracy", action="store_true", help="also measure agreement with torchvision")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = parser.parse_args(argv)
    for name in ("batch", "height", "width", "size", "repeat"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name} should be a positive integer, but got {getattr(args, name)}")

    device = torch.device(args.device) if args.device else default_device()
    backend = stream_backend(device)

    def sync() -> None:
        backend.synchronize(device)

    n, h, w = args.batch, args.height, args.width
    tensor_batch = torch.stack([natural(h, w, k) for k in range(n)]).to(device)
    rs = np.random.RandomState(0)
    scales = rs.uniform(0.75, 1.25, (n, 2))  # device decode yields images of different sizes
    list_batch = [natural(int(h * f), int(w * g), k).to(device) for k, (f, g) in enumerate(scales)]
    indices = torch.arange(n)

    fused = gpu.Compose(
        [gpu.RandomResizedCrop(args.size), gpu.RandomHorizontalFlip(), gpu.Normalize(MEAN, STD)]
    )
    per_sample = v2.Compose(
        [
            v2.RandomResizedCrop(args.size, antialias=True),
            v2.RandomHorizontalFlip(),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(MEAN, STD),
        ]
    )
    runs = {
        "fastload batched (NCHW tensor)": lambda: fused(tensor_batch, indices=indices, epoch=0, seed=0),
        "fastload batched (list of sizes)": lambda: fused(list_batch, indices=indices, epoch=0, seed=0),
        "torchvision v2 per-sample loop": lambda: torch.stack([per_sample(img) for img in tensor_batch]),
    }
    results: dict[str, Any] = {
        "device": str(device),
        "device_kind": "CUDA" if backend.is_cuda else "CPU",
        "cuda_name": torch.cuda.get_device_name(device) if backend.is_cuda else None,
        "cpu": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "batch": [n, 3, h, w],
        "output": args.size,
        "repeat": args.repeat,
        "timings": {},
    }
    kind = results["device_kind"]
    print(
        f"{kind} numbers ({device}, {torch.get_num_threads()} torch threads): batch {n}x3x{h}x{w} -> "
        f"{args.size}, "
        f"median of {args.repeat}"
    )
    print(f"{'pipeline':36s} {'median s':>10s} {'images/s':>10s}")
    for name, fn in runs.items():
        times = timed(fn, args.repeat, args.warmup, sync)
        med = statistics.median(times)
        results["timings"][name] = {"median_s": med, "images_per_s": n / med, "runs_s": times}
        print(f"{name:36s} {med:10.4f} {n / med:10.1f}")
    base = results["timings"]["torchvision v2 per-sample loop"]["images_per_s"]
    for name in ("fastload batched (NCHW tensor)", "fastload batched (list of sizes)"):
        ratio = results["timings"][name]["images_per_s"] / base
        results["timings"][name]["ratio_vs_torchvision"] = ratio
        print(f"ratio {name} / torchvision loop: {ratio:.2f}x ({kind})")

    if args.accuracy:
        results["accuracy"] = accuracy(device)
        print("\nagreement with torchvision resized_crop(antialias=True), |diff| in uint8 levels")
        print(f"{'case':50s} {'vs uint8 mean/max/frac':>26s} {'vs float mean/max/frac':>26s}")
        for row in results["accuracy"]:
            a, b = row["vs_torchvision_uint8"], row["vs_torchvision_float"]
            print(
                f"{row['case']:50s} {a['mean']:8.4f} {a['max']:4.0f} {a['frac_differ']:8.4f}"
                f"   {b['mean']:8.4f} {b['max']:4.0f} {b['frac_differ']:8.4f}"
            )

    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {args.json}")
    return results


if __name__ == "__main__":
    main()
