"""Does the GPU wait for data? A real training step, fed by a loader and by data already on the device.

The question a GPU user asks of a data loader is not its images/s but how much of the time the
model waits for it. This module is the ``--model NAME`` mode of ``bench/throughput.py`` (its
command line is in ``cli``):

- :func:`run_model`: the step fed by each backend's train pipeline at each worker count, and by
  data already on the device (the ceiling, measured before and after the backends);
- :func:`build_model` and :class:`TrainStep`: a torchvision classification model (any name
  ``torchvision.models.get_model`` knows, or :data:`TINY`), trained by SGD in ``channels_last``
  memory, under bf16 autocast on CUDA -- the usual fast recipe;
- :func:`time_steps`: warm-up steps, then timed runs of steps; each step ends with a
  synchronisation (as a loop that logs its loss every step does), so while the loop waits in
  ``next()`` the device has nothing to do: the share of the wall time spent there is the
  device's idle time due to data (``waiting``);
- :func:`resident_batches`: the same batch, already on the device, forever: fed with it, the step
  runs at the *ceiling*, the rate at which this device trains the model when data costs nothing;
- :func:`host_batches`: that batch in pinned host memory, float32, copied by the step itself:
  the *host ceiling*, the best any loader of float32 CPU batches can do for a loop that copies
  its batches to the GPU (the copy runs on the training stream, between the steps).

A loader's ``share of the ceiling`` (its images/s over the ceiling's, same run) says how busy it
keeps the device. Measured on one H200 with 16 CPUs (ResNet-50, batch 256, 14 workers): torch's
loader 25 %, the one-line swap 95 %, fastload's own pipeline 98 % (see docs/performance.md).

On a machine without CUDA the model runs on the CPU, where it competes with the loader's workers
for the same cores: the figures are then not a GPU's, and :func:`model_verdict` says so.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torchvision
from torch import nn

from fastload.folder import ClassIndex
from fastload.info import environment

from .backends import BACKENDS
from .config import BenchConfig, model_counts, pipeline_split, split_too_small
from .timing import ProcessTree, endless, progress_bar, shutdown

#: A one-convolution model (``--model tiny``): the mode runs in seconds on a CPU (tests, a first try).
TINY = "tiny"

_LABELS = {
    "resnet18": "ResNet-18",
    "resnet34": "ResNet-34",
    "resnet50": "ResNet-50",
    "resnet101": "ResNet-101",
    "resnet152": "ResNet-152",
    "vit_b_16": "ViT-B/16",
    "efficientnet_b0": "EfficientNet-B0",
    "mobilenet_v3_large": "MobileNetV3-Large",
    "convnext_tiny": "ConvNeXt-T",
}


def model_label(name: str) -> str:
    """How the verdict names a model: ``resnet50`` -> ``ResNet-50``; unknown names as given."""
    return _LABELS.get(name, name)


def _classification_models() -> list[str]:
    list_models = getattr(torchvision.models, "list_models", None)  # torchvision >= 0.14
    if list_models is None:  # pragma: no cover - older torchvision
        return sorted(_LABELS)
    return sorted(list_models(module=torchvision.models))


def build_model(name: str, num_classes: int, device: torch.device) -> nn.Module:
    """A freshly initialised classification model with ``num_classes`` outputs, on ``device``, in
    ``channels_last`` memory.

    Raises:
        ValueError: ``name`` is neither :data:`TINY` nor a torchvision classification model.
    """
    model: nn.Module
    if name == TINY:
        model = nn.Sequential(
            nn.Conv2d(3, 8, kernel_size=7, stride=4),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(8, num_classes),
        )
    else:
        known = _classification_models()
        if name not in known:
            raise ValueError(
                f"--model should be a torchvision classification model (e.g. resnet50, resnet18, "
                f"vit_b_16; {len(known)} in torchvision.models.list_models()) or {TINY!r}, but got "
                f"--model={name!r}"
            )
        model = torchvision.models.get_model(name, weights=None, num_classes=num_classes)
    return model.to(device=device).to(memory_format=torch.channels_last)


class TrainStep:
    """One training step of ``model``: forward (bf16 autocast on CUDA), cross-entropy, backward, SGD.

    Args:
        model: From :func:`build_model`.
        device: Where it runs.
    """

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model = model.train()
        self.device = device
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        images = images.to(self.device, non_blocking=True).contiguous(memory_format=torch.channels_last)
        labels = labels.to(self.device, non_blocking=True)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            loss = nn.functional.cross_entropy(self.model(images), labels)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


def resident_batches(
    batch_size: int, num_classes: int, device: torch.device, size: int = 224
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """One normalized-looking float batch and its labels, already on ``device``, forever."""
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(batch_size, 3, size, size, generator=generator).to(device)
    labels = torch.randint(0, num_classes, (batch_size,), generator=generator).to(device)
    return itertools.repeat((images.contiguous(memory_format=torch.channels_last), labels))


def host_batches(
    batch_size: int, num_classes: int, size: int = 224, pin: bool = True
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`resident_batches`' batch as a loader on the host hands it out: float32 in (pinned)
    host memory, forever. The step copies it to the device itself (``.to(device,
    non_blocking=True)``, on the training stream, as a training loop does), so fed with it the step
    runs at the best rate any loader of float32 CPU batches can give this loop: the *host ceiling*.
    """
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(batch_size, 3, size, size, generator=generator)
    labels = torch.randint(0, num_classes, (batch_size,), generator=generator)
    if pin:
        images, labels = images.pin_memory(), labels.pin_memory()
    return itertools.repeat((images, labels))


def _synchronize(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def time_steps(
    batches: Iterator[Any],
    step: TrainStep,
    warmup: int,
    steps: int,
    repeat: int,
    on_step: Callable[[], Any] | None = None,
    cpu_seconds: Callable[[], float] | None = None,
) -> dict[str, Any]:
    """Runs ``warmup`` steps, then ``repeat`` timed runs of ``steps`` steps on ``batches``.

    Args:
        cpu_seconds: reads the CPU time (user + system) of the process tree so far; given, the
            result has ``cpu_cores``.

    Returns:
        ``images_per_s`` (median of the runs) and ``images_per_s_runs``; ``waiting``: the median
        share of a run's wall time spent in ``next(batches)`` (each step ends synchronised, so the
        device is idle meanwhile); ``cpu_cores``: the median of a run's CPU time over its wall time
        (1.0 = one core busy all the run: the training loop, the loader's threads and workers), or
        ``None`` without ``cpu_seconds``; ``step_ms``: the median step outside ``next()`` in
        milliseconds (its launch and the wait for the device to finish it), and ``launch_ms``: the
        median of its launch alone (the training thread's own work: the step's call, before the
        synchronisation). Beside a loader these say why a loop that does not wait for data still
        trains slower than at the ceiling: a longer launch is the training thread slowed (the
        loader's threads take its interpreter or its cores), a longer rest is the device's time
        shared with the loader's own device work.
    """
    sync = _synchronize(step.device)
    for _ in range(warmup):
        images, labels = next(batches)
        step(images, labels)
        sync()
        if on_step is not None:
            on_step()
    rates, waits, cores = [], [], []
    launches: list[float] = []
    spans: list[float] = []
    for _ in range(repeat):
        samples, waited = 0, 0.0
        cpu0 = cpu_seconds() if cpu_seconds is not None else 0.0
        start = time.perf_counter()
        for _ in range(steps):
            t0 = time.perf_counter()
            images, labels = next(batches)
            t1 = time.perf_counter()
            waited += t1 - t0
            step(images, labels)
            t2 = time.perf_counter()
            sync()
            t3 = time.perf_counter()
            launches.append(t2 - t1)
            spans.append(t3 - t1)
            samples += len(images)
            del images, labels
            if on_step is not None:
                on_step()
        wall = time.perf_counter() - start
        if cpu_seconds is not None:
            cores.append((cpu_seconds() - cpu0) / wall)
        rates.append(samples / wall)
        waits.append(waited / wall)
    return {
        "images_per_s": statistics.median(rates),
        "images_per_s_runs": rates,
        "waiting": statistics.median(waits),
        "cpu_cores": statistics.median(cores) if cores else None,
        "step_ms": 1e3 * statistics.median(spans) if spans else None,
        "launch_ms": 1e3 * statistics.median(launches) if launches else None,
    }


_HEADER = (
    f"{'feeding the step':<34} {'workers':>7} {'images/s':>9} {'min-max':>13} "
    f"{'of ceiling':>10} {'waiting':>8} {'CPU cores':>9} {'step ms':>8} {'launch ms':>9}"
)


def _ms(value: float | None, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.1f}"


def _row(r: dict[str, Any]) -> str:
    runs = r["images_per_s_runs"]
    spread = f"{min(runs):.0f}-{max(runs):.0f}" if len(runs) > 1 else "-"
    share = "-" if r["share_of_ceiling"] is None else f"{100 * r['share_of_ceiling']:.0f} %"
    workers = "-" if r["num_workers"] is None else str(r["num_workers"])
    cores = "-" if r.get("cpu_cores") is None else f"{r['cpu_cores']:.1f}"
    return (
        f"{r['feeding']:<34} {workers:>7} {r['images_per_s']:>9.0f} {spread:>13} {share:>10} "
        f"{100 * r['waiting']:>6.0f} % {cores:>9} {_ms(r.get('step_ms'), 8)} {_ms(r.get('launch_ms'), 9)}"
    )


def format_model_table(records: Sequence[dict[str, Any]]) -> str:
    """The model mode's table: one row per way of feeding the step, the ceiling first."""
    return "\n".join([_HEADER, "-" * len(_HEADER), *(_row(r) for r in records)])


#: How the verdict names each backend.
_VERDICT_NAMES = {
    "torchvision": "torch's loader",
    "swap": "the one-line swap",
    "fastload": "fastload's own pipeline",
    "device-decode": "decode='device'",
    "hybrid": "decode='hybrid'",
    "dali": "DALI",
}


def model_verdict(records: Sequence[dict[str, Any]]) -> str | None:
    """One line: how busy each loader keeps the device, as a share of the ceiling.

    Example: ``ResNet-50 on this GPU (NVIDIA H200): torch's loader keeps it busy 25 % of the time,
    the one-line swap 95 %, fastload's own pipeline 98 % (14 workers, batch 256)``.
    """
    fed = [
        r
        for r in records
        if r["backend"] not in ("ceiling", "host-ceiling") and r["share_of_ceiling"] is not None
    ]
    if not fed:
        return None
    workers = max(r["num_workers"] for r in fed)  # the largest worker count measured
    fed = [r for r in fed if r["num_workers"] == workers]
    first = fed[0]
    on_gpu = first["device"].startswith("cuda")
    where = f"on this GPU ({first['device_name']})" if on_gpu else "on this machine's CPU"
    shares = [
        (_VERDICT_NAMES.get(r["backend"], r["backend"]), f"{100 * r['share_of_ceiling']:.0f} %") for r in fed
    ]
    (name0, share0), rest = shares[0], shares[1:]
    line = (
        f"{model_label(first['model'])} {where}: {name0} keeps it busy {share0} of the time"
        + "".join(f", {name} {share}" for name, share in rest)
        + f" ({first['num_workers']} workers, batch {first['batch_size']})"
    )
    host = [r for r in records if r["backend"] == "host-ceiling" and r["share_of_ceiling"] is not None]
    if host:
        line += (
            f"; a loop that copies float32 batches from the host itself reaches at most "
            f"{100 * host[-1]['share_of_ceiling']:.0f} % (the host ceiling: the copy runs on its stream)"
        )
    if not on_gpu:
        line += ". Not a GPU's figures: without CUDA the model shares the CPUs with the loader's workers"
    return line


#: The model mode's legend (printed under its table).
MODEL_LEGEND = """\
ceiling      the same training step on one batch already on the device: how fast this device
             trains the model when data costs nothing (measured before and after the loaders)
host ceiling (on a GPU) the same batch as float32 in pinned host memory, copied by the step
             itself (.to(device, non_blocking=True), on the training stream): the best any loader
             of float32 CPU batches gives a loop that copies its batches (the one-line swap's case)
images/s     median of --repeat timed runs of training steps (each run at least one ring of
             prefetched batches, after a warm-up that drains it)
of ceiling   images/s divided by the ceiling's: how busy the loader keeps the device
waiting      share of the wall time the loop waited in next() for a batch; each step ends
             synchronised (as a loop that logs its loss does), so the device was idle meanwhile
CPU cores    CPU time of this process and its workers over the wall time (1.0 = one core busy):
             the ceiling's is the training loop's own; the rest is what the loader costs
step ms      median time of a step outside next(): its launch and the wait for the device to
             finish it. Above the ceiling's without waiting: the loader slows the step itself
launch ms    of which the training thread's own work (the step's call, before the wait): above
             the ceiling's, the loader's threads take the loop's interpreter or cores; a longer
             rest, the loader's own device work shares the device with the model"""

#: The model table's first column for the rows that no loader feeds.
_FEEDING = {
    "ceiling": "ceiling (data on the device)",
    "host-ceiling": "host ceiling (float32, pinned)",
}


def run_model(
    config: BenchConfig,
    model: str,
    backends: Sequence[str],
    workers: Sequence[int],
    log: Callable[[str], None] = print,
    progress: bool | None = None,
) -> list[dict[str, Any]]:
    """The ``--model`` mode: ``model``'s training step fed by each backend's train pipeline at
    each worker count, and on data already on the device (the ceiling, measured before and after
    the backends of each worker count). One record per row (see the module docstring).
    """
    device = torch.device(config.device)
    classes = len(ClassIndex.from_folder(config.data / pipeline_split("train")))
    net = build_model(model, classes, device)
    step = TrainStep(net, device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # one input size: let cuDNN pick its kernels once
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    cpu = ProcessTree().cpu_seconds
    env = environment()
    records: list[dict[str, Any]] = []
    usable = []
    for name in backends:
        reason = BACKENDS[name].unavailable()
        if reason:
            log(f"skipping {name}: {reason}")
        else:
            usable.append(name)

    def record(name: str, w: int | None, result: dict[str, Any], warmup: int, steps: int) -> dict[str, Any]:
        rec = {
            "mode": "model",
            "backend": name,
            "feeding": _FEEDING.get(name, name),
            "model": model,
            "num_workers": w,
            "batch_size": config.batch_size,
            "images_per_s": result["images_per_s"],
            "images_per_s_runs": result["images_per_s_runs"],
            "share_of_ceiling": None,
            "waiting": result["waiting"],
            "cpu_cores": result.get("cpu_cores"),
            "step_ms": result.get("step_ms"),
            "launch_ms": result.get("launch_ms"),
            "device": config.device,
            "device_name": device_name,
            "warmup_steps": warmup,
            "timed_steps": steps,
            "repeat": config.repeat,
            "environment": env,
        }
        return rec

    for w in workers:
        too_small = split_too_small(config, "train", w)
        if too_small is not None:
            log(too_small)
            continue
        warmup, steps = model_counts(config, w)
        total = warmup + config.repeat * steps
        with progress_bar(progress, total, f"{model} ceiling (before)") as bar:
            resident = resident_batches(config.batch_size, classes, device)
            before = time_steps(
                resident, step, warmup, steps, config.repeat, on_step=bar.update, cpu_seconds=cpu
            )
        rows = []
        if device.type == "cuda":  # what a loop that copies float32 host batches reaches at best
            with progress_bar(progress, total, f"{model} host ceiling") as bar:
                host = host_batches(config.batch_size, classes)
                rows.append(
                    record(
                        "host-ceiling",
                        None,
                        time_steps(
                            host, step, warmup, steps, config.repeat, on_step=bar.update, cpu_seconds=cpu
                        ),
                        warmup,
                        steps,
                    )
                )
        for name in usable:
            with progress_bar(progress, total, f"{model} workers={w} {name}") as bar:
                loader = BACKENDS[name].build(config, "train", w)
                try:
                    result = time_steps(
                        endless(loader),
                        step,
                        warmup,
                        steps,
                        config.repeat,
                        on_step=bar.update,
                        cpu_seconds=cpu,
                    )
                    decoder = getattr(loader, "decoder", None)  # after the run: a decoder given up shows
                    hybrid = getattr(loader, "hybrid", None)  # the split it settled on, and why
                    split = None if hybrid is None else repr(hybrid)
                finally:
                    shutdown(loader)
                    del loader
            rows.append({**record(name, w, result, warmup, steps), "decoder": decoder, "split": split})
        with progress_bar(progress, total, f"{model} ceiling (after)") as bar:
            resident = resident_batches(config.batch_size, classes, device)
            after = time_steps(
                resident, step, warmup, steps, config.repeat, on_step=bar.update, cpu_seconds=cpu
            )
        runs = before["images_per_s_runs"] + after["images_per_s_runs"]
        top = record(
            "ceiling",
            None,
            {
                "images_per_s": statistics.median(runs),
                "images_per_s_runs": runs,
                "waiting": statistics.median([before["waiting"], after["waiting"]]),
                "cpu_cores": statistics.median([before["cpu_cores"], after["cpu_cores"]]),
                "step_ms": statistics.median([before["step_ms"], after["step_ms"]]),
                "launch_ms": statistics.median([before["launch_ms"], after["launch_ms"]]),
            },
            warmup,
            steps,
        )
        top["share_of_ceiling"] = 1.0
        for rec in rows:
            rec["share_of_ceiling"] = rec["images_per_s"] / top["images_per_s"]
        records += [top, *rows]
    return records
