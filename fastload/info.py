"""What this installation is (versions, the C extensions, DALI, CPUs, load), for ``python -m
fastload info`` and the benchmark's JSON records (:func:`environment`). Never imports DALI.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
from typing import Any

import PIL
import torch
import torchvision

from . import __version__
from .device import available_cpus, cuda_available
from .gpu.decode import device_decoder
from .gpu.resample import plan_extension_built

__all__ = ["C_EXTENSION_HINT", "C_RESAMPLE_HINT", "dali_version", "environment", "summary_line"]

C_EXTENSION_HINT = (
    "the train pipeline is about 20% slower per core without it; to build it, install a C compiler "
    "and the libjpeg-turbo headers (Debian/Ubuntu: apt install gcc libjpeg-dev; Fedora: dnf install "
    "gcc libjpeg-turbo-devel; macOS: brew install jpeg-turbo), then reinstall fastload"
)


def dali_version() -> str | None:
    """The installed NVIDIA DALI version (any ``nvidia-dali-*`` build), or ``None``, without importing it."""
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name.startswith("nvidia-dali"):
            return f"{dist.version} ({name})"
    return None


def _c_extension() -> str:
    """``"built"``, ``"built, turned off by FASTLOAD_ROI_DECODE=0"`` or ``"not built"``."""
    if importlib.util.find_spec("fastload._jpeg") is None:
        return "not built"
    if os.environ.get("FASTLOAD_ROI_DECODE", "1") == "0":
        return "built, turned off by FASTLOAD_ROI_DECODE=0"
    return "built"


C_RESAMPLE_HINT = (
    "the device paths' crop taps are made by numpy instead (more of the training thread's "
    "interpreter per batch); install a C compiler, then reinstall fastload"
)


def _load_average() -> list[float] | None:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (AttributeError, OSError):  # pragma: no cover - Windows
        return None


def environment() -> dict[str, Any]:
    """Versions, C extensions, DALI, CPUs (the machine's and this process's), CUDA, the device
    paths' JPEG decoder and the load average now, as a JSON-ready dict."""
    cuda = None
    if cuda_available():
        cuda = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda})"
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "fastload": __version__,
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "pillow": PIL.__version__,
        "dali": dali_version(),
        "c_extension": _c_extension(),
        "c_resample": "built" if plan_extension_built() else "not built",
        "cpu_count": os.cpu_count(),
        "available_cpus": available_cpus(),
        "cuda": cuda,
        "device_decoder": device_decoder("cuda" if cuda else "cpu"),
        "load_average": _load_average(),
    }


def summary_line(env: dict[str, Any] | None = None) -> str:
    """One line: versions | C extensions (if missing, their cost and fix) | DALI | device decoder."""
    env = environment() if env is None else env
    device = f"CUDA: {env['cuda']}" if env["cuda"] else "CPU only"
    c_ext = env["c_extension"]
    if c_ext == "not built":
        c_ext = f"not built: {C_EXTENSION_HINT}"
    dali = (
        f"DALI {env['dali']}"
        if env["dali"]
        else "DALI: not installed (optional: GPU JPEG decoding, the benchmark's dali row; "
        "pip install 'fastload[dali]'; in a source checkout: make ... WITH_DALI=1)"
    )
    decoder = env.get("device_decoder")
    taps = (
        f" | C extension (resize taps): not built: {C_RESAMPLE_HINT}"
        if env.get("c_resample") == "not built"
        else ""
    )
    return (
        f"fastload {env['fastload']}, torch {env['torch']} ({device}), torchvision {env['torchvision']}, "
        f"Pillow {env['pillow']}, Python {env['python']} | C extension (region JPEG decoding): {c_ext} | "
        f"{dali}" + (f' | decode="device": {decoder}' if decoder else "") + taps
    )
