"""The command line of ``bench/throughput.py`` (``make bench``): options, checks, and the order of
what it prints.

A throughput run prints the set-up line, a note per backend that cannot run here, the table
(``timing.run``), the legend of the rows it printed (``report.legend``), where it wrote the
records (JSON, one per measurement) and the plot, and last the verdict line
(``report.verdict``). ``--model NAME`` runs ``model.run_model`` instead and prints its table,
legend and verdict. Bad input ends with one ``error:`` line and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from fastload.device import auto_num_workers, cuda_available, device_is_cuda
from fastload.info import environment

from .backends import BACKENDS, check_names
from .config import PIPELINES, REFERENCE, STEADY_FACTOR, STORY, BenchConfig, default_data, pipeline_split
from .model import MODEL_LEGEND, format_model_table, model_label, model_verdict, run_model
from .report import LEGEND, legend, plot, verdict
from .timing import run

#: Where the records (and the plot, beside them) go unless ``--json`` says otherwise.
DEFAULT_JSON = Path("bench/results/throughput.json")


def _main_model(
    args: argparse.Namespace, config: BenchConfig, backends: list[str], workers: list[int]
) -> int:
    """``--model``: the training-step table, its legend, the records, and the verdict last."""
    config.gpu_transforms = True  # fastload's own pipeline: flip + normalize on the device
    env = environment()
    print(_environment_line(env))
    runs = (
        f"{config.batches} steps"
        if not config.steady
        else f"one ring of prefetched batches or more (at least {config.batches} steps)"
    )
    warm = (
        f"{config.warmup}" if not config.steady_warmup else f"one that drains it (at least {config.warmup})"
    )
    counts = f"{config.repeat} runs of {runs}, after a warm-up of {warm}"
    on = (
        "bf16 autocast, channels_last, SGD"
        if device_is_cuda(config.device)
        else "float32, channels_last, SGD"
    )
    print(
        f"model {model_label(args.model)} ({on}) on {config.device}, data {config.data} (train), batch size "
        f"{config.batch_size}, {counts}, workers {workers}"
    )
    if not device_is_cuda(config.device):
        print(
            "note: no CUDA device in this run: the model trains on the CPU, beside the loader's workers "
            "on the same cores. These figures are not a GPU's"
        )
    try:
        records = run_model(
            config, args.model, backends, workers, progress=False if args.no_progress else None
        )
    except ValueError as e:
        return _error(str(e))
    print(format_model_table(records))
    for r in records:
        if r.get("decoder") and r["backend"] in ("device-decode", "hybrid"):
            print(f"{r['backend']} ({r['num_workers']} workers) decoded with {r['decoder']}")
        if r.get("split"):
            print(f"{r['backend']} ({r['num_workers']} workers) split each batch: {r['split']}")
    print()
    print("rows: ceiling, host ceiling (on a GPU), then each backend (--help lists them)")
    print("columns:")
    print("\n".join("  " + line for line in MODEL_LEGEND.splitlines()))
    out = Path(args.json) if args.json else DEFAULT_JSON.with_name("model.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        json.dump(records, f, indent=1)
    print(f"wrote {out}")
    line = model_verdict(records)
    if line:
        print(f"==> {line}")
    return 0


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return values


def _names(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def _help_text() -> str:
    lines = ["fastload throughput benchmark: images/s of each backend x pipeline x num_workers.", ""]
    lines.append("backends (--backends; default: all of them, the unavailable ones skipped with a note):")
    for b in BACKENDS.values():
        lines.append(f"  {b.name:<17} {b.description}".rstrip())
    lines.append(f"  {REFERENCE:<17} reference row: full-size PIL decode rate x cores (see below)")
    lines.append("")
    lines.append("pipelines (--pipelines; default: train,val):")
    lines.append(
        "  train             RandomResizedCrop(224) + RandomHorizontalFlip + normalize (train/ folder)"
    )
    lines.append("  val               Resize(256) + CenterCrop(224) + normalize (val/ folder)")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench/throughput.py",
        description=_help_text(),
        epilog="columns of the table:\n" + LEGEND,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--data",
        type=Path,
        default=None,
        help=f"dataset root with train/ and val/ (default {default_data()})",
    )
    p.add_argument(
        "--workers",
        type=_ints,
        default=None,
        help="num_workers values, e.g. 0,1,2 (default: 0 and this machine's CPUs, e.g. 0,2)",
    )
    p.add_argument(
        "--backends",
        type=_names,
        default=None,
        help="comma-separated backends (default: " + ",".join(STORY) + "; --all: every one, see above)",
    )
    p.add_argument(
        "--all",
        action="store_true",
        help="every backend and the full-decode reference row (GPU-only rows only where CUDA is)",
    )
    p.add_argument(
        "--pipelines", type=_names, default=list(PIPELINES), help="train, val or train,val (default)"
    )
    p.add_argument("--batch-size", type=int, default=None, help="default 64 (--quick: 32)")
    p.add_argument(
        "--batches",
        type=int,
        default=None,
        help=f"batches per timed run (default: {STEADY_FACTOR}x the batches the workers prefetch, "
        "num_workers x 2, and at least 20; --quick: at least 8). Given: exactly this many",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="batches before timing (default: the batches the workers prefetch and one more, at least 3; "
        "--quick: at least 2). Given: exactly this many",
    )
    p.add_argument(
        "--repeat", type=int, default=3, help="timed runs per setting; the median is reported (default 3)"
    )
    p.add_argument(
        "--step-ms",
        type=float,
        default=0.0,
        help="simulate a model step of this many ms after each batch (a sleep: the CPU stays free, as "
        "with a GPU model) and show the stall column (default 0: no model, no stall column)",
    )
    p.add_argument(
        "--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available, else cpu)"
    )
    p.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch.set_num_threads(N) in the benchmark process, where 0-worker rows do all their work "
        "(default: torch's, one per core). On a busy machine torch's threads wait for each other "
        "whenever another program holds a core, and 0-worker rows slow down several-fold and vary: "
        "1 gives steadier numbers there",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a short configuration (make bench): --batch-size 32 --batches 8 --warmup 2",
    )
    p.add_argument(
        "--gpu-transforms",
        action="store_true",
        help="fastload backends: flip + normalize on the device (gpu transforms) instead of in the workers",
    )
    p.add_argument(
        "--model",
        metavar="NAME",
        help="does the GPU wait for data? Train this torchvision classification model (resnet50, "
        "resnet18, ...; 'tiny': a one-convolution model for a CPU) on the train pipeline of each backend "
        "and on data already on the device (the ceiling): images/s, share of the ceiling, time waiting. "
        "Batch size default 256; workers default this machine's CPUs; fastload's own pipeline flips and "
        "normalizes on the device",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars (default: on a terminal)")
    p.add_argument(
        "--json",
        metavar="PATH",
        help=f"write one record per measurement, with settings and versions, here (default {DEFAULT_JSON})",
    )
    p.add_argument(
        "--plot",
        metavar="PATH.png",
        help="plot images/s vs num_workers here (default: beside the JSON, .png; needs matplotlib)",
    )
    return p


def _error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def _device(text: str | None) -> str:
    """The ``--device`` value checked: a ``ValueError`` with one clear sentence if unusable here."""
    if text is None:
        return "cuda" if cuda_available() else "cpu"
    try:
        device = torch.device(text)
    except RuntimeError:
        raise ValueError(f"--device should be cpu, cuda or cuda:N, but got --device={text!r}") from None
    if device_is_cuda(device) and not cuda_available():
        raise ValueError(
            f"--device={text}: CUDA is not available on this machine (torch.cuda.is_available() is False: "
            "no NVIDIA GPU or driver, or a CPU-only torch build); leave --device out to measure on the CPU"
        )
    return text


def _environment_line(env: dict[str, Any]) -> str:
    load = env["load_average"]
    dali = f"DALI {env['dali']}" if env["dali"] else "DALI not installed"
    return (
        f"fastload {env['fastload']}, torch {env['torch']}, torchvision {env['torchvision']}, "
        f"Pillow {env['pillow']}; C extension {env['c_extension']}; {dali}; "
        f"{env['available_cpus']} CPUs available ({env['cpu_count']} on the machine)"
        + (f", load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}" if load else "")
    )


def _busy_machine_note(env: dict[str, Any], threads: int, workers: Sequence[int]) -> str | None:
    """A warning when other programs' load leaves torch's threads fewer cores than it has threads.

    With 0 workers the loading runs in this process, and torch's intra-op threads (one per core by
    default) wait for each other at every op whenever one of them is descheduled. Measured on 2
    shared cores at a load average of 4.1-5.1 (val, 0 workers, 3 alternating runs each): 2 threads
    gave torchvision 18-30 images/s and fastload 78-161, a fastload/torchvision ratio anywhere
    from 2.6 to 7.1; ``--torch-threads 1`` gave 105-144 and 214-290, a ratio of 2.01-2.03.
    """
    load = env.get("load_average")
    if not load or threads < 2 or 0 not in workers:
        return None
    cpus = env["available_cpus"]
    if load[0] < 1.0 or load[0] + threads <= cpus + 0.5:  # no other program holds a core
        return None
    return (
        f"note: load average {load[0]:.1f} on {cpus} CPUs, and torch runs {threads} threads in this process: "
        "the 0-worker rows (loading in this process) may run several times slower and vary widely, as "
        "torch's threads wait for each other while other programs hold cores. A quieter machine, or "
        "--torch-threads 1, gives steadier numbers"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; returns the exit status (2 with one ``error:`` line on bad input)."""
    args = build_parser().parse_args(argv)
    q = args.quick
    data = args.data or default_data()
    model = args.model is not None
    config = BenchConfig(
        data=data,
        batch_size=args.batch_size if args.batch_size is not None else (256 if model else 32 if q else 64),
        batches=args.batches if args.batches is not None else (25 if model else 8 if q else 20),
        warmup=args.warmup if args.warmup is not None else (30 if model else 2 if q else 3),
        repeat=args.repeat,
        gpu_transforms=args.gpu_transforms,
        step_ms=args.step_ms,
        steady=args.batches is None,  # given: exactly that many
        steady_warmup=args.warmup is None,
    )
    for name, value, low in (
        ("batch-size", config.batch_size, 1),
        ("batches", config.batches, 1),
        ("warmup", config.warmup, 0),
        ("repeat", config.repeat, 1),
    ):
        if value < low:
            kind = "a positive" if low else "a non-negative"
            return _error(f"--{name} should be {kind} integer, but got --{name}={value}")
    if not (config.step_ms >= 0 and math.isfinite(config.step_ms)):
        return _error(f"--step-ms should be a non-negative number, but got --step-ms={config.step_ms}")
    threads = args.torch_threads
    if threads is not None and threads < 1:
        return _error(f"--torch-threads should be a positive integer, but got --torch-threads={threads}")
    if args.backends:
        backends = list(args.backends)
    elif args.all:
        backends = ["torchvision", *[b for b in BACKENDS if b != "torchvision"], REFERENCE]
    else:
        backends = list(STORY)
    if "decode-ceiling" in backends:  # its earlier name: it is a reference, not a ceiling
        print(f"note: the decode-ceiling row is now called {REFERENCE}", file=sys.stderr)
        backends = [REFERENCE if b == "decode-ceiling" else b for b in backends]
    try:
        config.device = _device(args.device)
        check_names(backends, args.pipelines)
    except ValueError as e:
        return _error(str(e))
    for pipeline in args.pipelines:
        if not (data / pipeline_split(pipeline)).is_dir():
            return _error(
                f"{data / pipeline_split(pipeline)} not found. Make a dataset first: "
                f"python -m fastload synth {data}"
            )
    if model:
        if REFERENCE in backends:
            return _error(f"--model measures loaders feeding a model: {REFERENCE} is no loader")
        return _main_model(args, config, backends, args.workers or [auto_num_workers()])
    workers = args.workers or sorted({0, auto_num_workers()})
    if args.all and not args.backends and not device_is_cuda(config.device):
        gpu_rows = [b for b in backends if b in BACKENDS and BACKENDS[b].gpu_only]
        backends = [b for b in backends if b not in gpu_rows]
        if gpu_rows:
            print(f"skipping {', '.join(gpu_rows)}: GPU pipelines, and this run has no CUDA device")
    if threads is not None:
        torch.set_num_threads(threads)
    env = environment()
    print(_environment_line(env))
    note = _busy_machine_note(env, torch.get_num_threads(), workers)
    if note:
        print(note)
    runs = (
        f"{config.batches} batches"
        if not config.steady
        else f"{STEADY_FACTOR}x the batches the workers prefetch (at least {config.batches})"
    )
    warm = (
        f"{config.warmup} batches"
        if not config.steady_warmup
        else f"those and one more (at least {config.warmup})"
    )
    counts = f"{config.repeat} runs (median, min-max) of {runs}, after a warm-up of {warm}"
    print(
        f"data {data}, device {config.device}, batch size {config.batch_size}, {counts}, workers {workers}"
        + (f", model step {config.step_ms:g} ms" if config.step_ms else "")
    )
    try:
        records = run(config, backends, args.pipelines, workers, progress=False if args.no_progress else None)
    except ValueError as e:
        return _error(str(e))
    print()
    print(legend(stall=bool(config.step_ms), records=records))
    out = Path(args.json) if args.json else DEFAULT_JSON
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        json.dump(records, f, indent=1)
    wrote = [str(out)]
    plot_path = args.plot or str(out.with_suffix(".png"))
    try:
        if records:
            plot(records, plot_path)
            wrote.append(plot_path)
    except ImportError as e:
        if args.plot:
            raise
        wrote.append(f"no plot ({e})")
    print("wrote " + ", ".join(wrote))
    line = verdict(records)
    if line:
        print(f"==> {line}")
    return 0
