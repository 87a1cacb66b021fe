"""torchvision's reference classification recipes: torch's DataLoader against the one-line swap.

Usage: ``python bench/recipes.py [--data ROOT] [--workers 2] [--batch-size 32] [--batches 30]
[--repeat 5] [--recipes NAME,...|timm] [--profile] [--json PATH]``

Each recipe is built the way ``references/classification/train.py`` builds it (written here, not
imported): the transform is a preset-shaped wrapper object holding a ``Compose``
(``Preset.__call__`` returns ``self.transforms(img)``), the train loader is given
``collate_fn=default_collate`` explicitly, or ``mixup_cutmix(*default_collate(batch))`` with
torchvision v2's ``MixUp``/``CutMix`` in a ``RandomChoice``; a ``RandomSampler`` for train, a
``SequentialSampler`` for val. Both loaders get the same arguments (``persistent_workers=True``
on both sides; ``--as-train-py``: left to each loader's default, as ``train.py`` leaves it), only
the class differs. The rows:

* ``classic train``/``classic val`` (v1 and v2): ``RandomResizedCrop(224)``, flip,
  ``PILToTensor``, ``ConvertImageDtype``/``ToDtype``, ``Normalize`` (v2: ``ToPureTensor``);
  val ``Resize(256)`` + ``CenterCrop(224)``;
* ``new recipe train`` (v1 and v2): ``RandomResizedCrop(176)``, flip, ``TrivialAugmentWide``, the
  conversions, ``RandomErasing(0.1)``, the mixup/cutmix collate;
* ``tensor classic train`` / ``tensor new recipe train`` (v2, ``--backend tensor``):
  ``PILToTensor`` first, the crop on a uint8 tensor.

With timm installed, ``--recipes timm`` runs timm's loaders as its ``train.py`` builds them
(``create_dataset`` and ``create_loader`` with train.py's loader settings and the
``resnet18.tv_in1k`` data config: 224 px, bilinear eval at ``crop_pct`` 0.875, ``random`` train
interpolation, colour jitter 0.4), the swap made where train.py's name is looked up
(``torch.utils.data.DataLoader``, as ``python -m fastload run`` does): ``timm train``/``timm
eval`` (``--no-prefetcher``), ``timm train prefetcher``/``timm eval prefetcher`` (train.py's
default: ``MaybePILToTensor``, ``fast_collate``, ``PrefetchLoader`` on the CPU, timed as the loop
sees it), ``timm train randaugment`` (``rand-m9-mstd0.5``, ``RandomErasing`` 0.25; the ``-inc1``
variant asks Pillow 13 for ``posterize(img, 0)``, which it refuses with either loader).

Each loader is measured alone (torch's, then the swap's): warmed up (its workers started, at least
``--warmup`` batches), then timed ``--repeat`` times over whole epochs of at least ``--batches``
batches (an epoch left early would discard the batches decoded ahead). The table shows the
median images/s of each side, the ratio of the medians, and the path the swapped loader took
(``loader.path``). ``--profile``
also prints where one image's time goes in the new recipe's train pipeline, stage by stage, in
one process, torch's pipeline against the head-accelerated one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torchvision
from torch.utils.data import default_collate
from torchvision import transforms as v1
from torchvision.transforms import v2

import fastload
from fastload.head import split_pipeline

DEFAULT_DATA = Path.home() / ".cache" / "fastload" / "synthetic-imagenet"
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


class Preset:
    """The reference presets' shape: a plain object holding a ``Compose``."""

    def __init__(self, transforms: Any) -> None:
        self.transforms = transforms

    def __call__(self, img: Any) -> Any:
        return self.transforms(img)


class MixupCutmixCollate:
    """``mixup_cutmix(*default_collate(batch))`` with v2's MixUp(0.2) / CutMix(1.0), as train.py."""

    def __init__(self, num_classes: int) -> None:
        self.mixup_cutmix = v2.RandomChoice(
            [v2.MixUp(alpha=0.2, num_classes=num_classes), v2.CutMix(alpha=1.0, num_classes=num_classes)]
        )

    def __call__(self, batch: list[Any]) -> Any:
        return self.mixup_cutmix(*default_collate(batch))


def _train(module: Any, size: int, augment: bool, tensor: bool = False) -> Preset:
    use_v2 = module is v2
    ops: list[Any] = [module.PILToTensor()] if tensor else []
    ops += [module.RandomResizedCrop(size), module.RandomHorizontalFlip(0.5)]
    if augment:
        ops.append(module.TrivialAugmentWide())
    if not tensor:
        ops.append(module.PILToTensor())
    ops += [
        module.ToDtype(torch.float, scale=True) if use_v2 else module.ConvertImageDtype(torch.float),
        module.Normalize(MEAN, STD),
    ]
    if augment:
        ops.append(module.RandomErasing(0.1))
    if use_v2:
        ops.append(module.ToPureTensor())
    return Preset(module.Compose(ops))


def _val(module: Any) -> Preset:
    use_v2 = module is v2
    ops = [
        module.Resize(256, antialias=True),
        module.CenterCrop(224),
        module.PILToTensor(),
        module.ToDtype(torch.float, scale=True) if use_v2 else module.ConvertImageDtype(torch.float),
        module.Normalize(MEAN, STD),
    ]
    if use_v2:
        ops.append(module.ToPureTensor())
    return Preset(module.Compose(ops))


#: name -> (split, transform factory, mixup/cutmix collate)
RECIPES: dict[str, tuple[str, Callable[[], Preset], bool]] = {
    "classic train v1": ("train", lambda: _train(v1, 224, False), False),
    "classic train v2": ("train", lambda: _train(v2, 224, False), False),
    "classic val v1": ("val", lambda: _val(v1), False),
    "classic val v2": ("val", lambda: _val(v2), False),
    "new recipe train v1": ("train", lambda: _train(v1, 176, True), True),
    "new recipe train v2": ("train", lambda: _train(v2, 176, True), True),
    "tensor classic train": ("train", lambda: _train(v2, 224, False, tensor=True), False),
    "tensor new recipe train": ("train", lambda: _train(v2, 176, True, tensor=True), True),
}


#: name -> (training, create_loader's use_prefetcher, further train.py options)
TIMM_RECIPES: dict[str, tuple[bool, bool, dict[str, Any]]] = {
    "timm train": (True, False, {}),
    "timm eval": (False, False, {}),
    "timm train prefetcher": (True, True, {}),
    "timm eval prefetcher": (False, True, {}),
    "timm train randaugment": (True, False, {"auto_augment": "rand-m9-mstd0.5", "re_prob": 0.25}),
}


def _timm_loader(cls: Any, recipe: str, data: Path, args: argparse.Namespace) -> Any:
    """A loader as timm's train.py builds it, with ``cls`` where it looks up torch's DataLoader."""
    from timm.data import create_dataset, create_loader

    training, prefetcher, options = TIMM_RECIPES[recipe]
    split = "train" if training else "val"
    dataset = create_dataset("", root=str(data / split), split=split, is_training=training)
    if training:
        options = {"interpolation": "random", "color_jitter": 0.4, "re_prob": 0.0, **options}
    else:
        options = {"interpolation": "bilinear", "crop_pct": 0.875}
    name = torch.utils.data.DataLoader
    torch.utils.data.DataLoader = cls
    try:
        return create_loader(
            dataset,
            input_size=(3, 224, 224),
            batch_size=args.batch_size,
            is_training=training,
            use_prefetcher=prefetcher,
            mean=MEAN,
            std=STD,
            pin_memory=False,
            device=torch.device("cpu"),
            num_workers=args.workers,
            persistent_workers=True,
            **options,
        )
    finally:
        torch.utils.data.DataLoader = name


def _loader(cls: Any, recipe: str, data: Path, args: argparse.Namespace) -> Any:
    if recipe in TIMM_RECIPES:
        return _timm_loader(cls, recipe, data, args)
    split, make, mixup = RECIPES[recipe]
    dataset = torchvision.datasets.ImageFolder(str(data / split), transform=make())
    sampler: Any = (
        torch.utils.data.RandomSampler(dataset)
        if split == "train"
        else torch.utils.data.SequentialSampler(dataset)
    )
    kwargs: dict[str, Any] = {
        "batch_size": args.batch_size,
        "sampler": sampler,
        "num_workers": args.workers,
        "pin_memory": False,
        "drop_last": split == "train",
    }
    if not args.as_train_py:
        kwargs["persistent_workers"] = args.workers > 0
    if split == "train":
        kwargs["collate_fn"] = MixupCutmixCollate(len(dataset.classes)) if mixup else default_collate
    return cls(dataset, **kwargs)


def _rate(loader: Any, batches: int) -> float:
    """Images per second over whole epochs, at least ``batches`` batches (an epoch left early
    would throw away the batches the workers decoded ahead)."""
    images, n = 0, 0
    t0 = time.perf_counter()
    while n < batches:
        for x, _ in loader:
            images += x.shape[0]
            n += 1
    return images / (time.perf_counter() - t0)


def measure(recipe: str, data: Path, args: argparse.Namespace) -> dict[str, Any]:
    """torch's DataLoader, then fastload's, on ``recipe`` (one loader alive at a time), medians."""
    runs: dict[str, list[float]] = {}
    path = ""
    for side, cls in (("torch", torch.utils.data.DataLoader), ("swap", fastload.DataLoader)):
        loader = _loader(cls, recipe, data, args)
        _rate(loader, args.warmup)  # the workers started, an epoch or more decoded
        runs[side] = [_rate(loader, args.batches) for _ in range(args.repeat)]
        if side == "swap":
            inner = getattr(loader, "loader", loader)  # timm's PrefetchLoader holds the loader
            path = inner.path
            inner.close()
        del loader
    torch_rate, swap_rate = statistics.median(runs["torch"]), statistics.median(runs["swap"])
    return {
        "recipe": recipe,
        "path": path,
        "torch": torch_rate,
        "swap": swap_rate,
        "ratio": swap_rate / torch_rate,
        "runs": runs,
    }


def _table(records: Sequence[dict[str, Any]]) -> str:
    lines = [f"{'recipe':<26} {'torch img/s':>11} {'swap img/s':>10} {'swap/torch':>10}  path (swap)"]
    for r in records:
        spread = f"{min(r['runs']['swap']):.0f}-{max(r['runs']['swap']):.0f}"
        lines.append(
            f"{r['recipe']:<26} {r['torch']:>11.0f} {r['swap']:>10.0f} {r['ratio']:>9.2f}x  {r['path']}"
            f"  (swap runs {spread})"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------ where the new recipe's time goes


def _time(fn: Callable[[], Any], n: int) -> float:
    t0 = time.process_time()
    for _ in range(n):
        fn()
    return (time.process_time() - t0) / n * 1000


def profile(data: Path, images: int) -> list[tuple[str, float, float]]:
    """Per-image CPU ms of each stage of the new recipe (v1) train pipeline, one process, one
    thread: ``(stage, torch's pipeline, head-accelerated)``."""
    from torchvision.datasets.folder import pil_loader

    torch.set_num_threads(1)
    files = sorted(p for p in (data / "train").rglob("*") if p.is_file())[:images]
    blobs = [p.read_bytes() for p in files]
    preset = _train(v1, 176, True)
    ops = preset.transforms.transforms
    rrc, flip, ta, to_tensor, to_float, norm, erase = ops
    head = split_pipeline(preset)
    rows: list[tuple[str, float, float]] = []

    def each(fn: Callable[[Any], Any], items: list[Any]) -> tuple[float, list[Any]]:
        out: list[Any] = []
        t0 = time.process_time()
        for item in items:
            out.append(fn(item))
        return (time.process_time() - t0) / len(items) * 1000, out

    torch.manual_seed(0)
    t_decode, pil = each(pil_loader, [str(p) for p in files])
    t_crop, cropped = each(lambda im: flip(rrc(im)), pil)
    torch.manual_seed(0)
    t_head, heads = each(lambda b: head._materialize(head._head(b, "x")), blobs)
    rows.append(("decode + crop/resize + flip", t_decode + t_crop, t_head))
    t_ta, augmented = each(ta, cropped)
    rows.append(("TrivialAugmentWide (as written)", t_ta, t_ta))
    t_conv_torch, tensors = each(lambda im: norm(to_float(to_tensor(im))), augmented)
    fused = head.stages[1]
    t_conv, _ = each(lambda im: head._convert(fused, im), augmented)
    rows.append(("PILToTensor + ConvertImageDtype + Normalize", t_conv_torch, t_conv))
    t_erase, _ = each(erase, tensors)
    rows.append(("RandomErasing(0.1) (as written)", t_erase, t_erase))
    collate = MixupCutmixCollate(10)
    batches = [[(t, 0) for t in tensors[i : i + 32]] for i in range(0, len(tensors) - 31, 32)] or [
        [(t, 0) for t in tensors]
    ]
    t_collate, _ = each(collate, batches)
    per_image = t_collate / len(batches[0])
    rows.append(("default_collate + MixUp/CutMix (per image)", per_image, per_image))
    total_torch, total_head = sum(r[1] for r in rows), sum(r[2] for r in rows)
    rows.append(("total", total_torch, total_head))
    return rows


def _profile_table(rows: Sequence[tuple[str, float, float]]) -> str:
    lines = [f"{'stage (new recipe train, v1)':<46} {'torch ms':>8} {'swap ms':>8}"]
    lines += [f"{name:<46} {a:>8.2f} {b:>8.2f}" for name, a, b in rows]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--data", type=Path, default=DEFAULT_DATA, help=f"ImageNet-style root (default {DEFAULT_DATA})"
    )
    parser.add_argument("--workers", type=int, default=2, help="num_workers of both loaders (default 2)")
    parser.add_argument("--batch-size", type=int, default=32, help="batch size (default 32)")
    parser.add_argument("--batches", type=int, default=30, help="batches per timed run (default 30)")
    parser.add_argument("--warmup", type=int, default=4, help="batches before timing (default 4)")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per loader; medians (default 5)")
    parser.add_argument(
        "--recipes", default=",".join(RECIPES), help="comma-separated recipe names; timm: timm's loaders"
    )
    parser.add_argument(
        "--as-train-py",
        action="store_true",
        help="leave persistent_workers to each loader's default, as torchvision's train.py does "
        "(default: persistent_workers=True on both sides)",
    )
    parser.add_argument("--profile", action="store_true", help="also profile the new recipe's stages")
    parser.add_argument("--profile-images", type=int, default=200, help="images for --profile (default 200)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.recipes.split(",") if n.strip()]
    if "timm" in names:
        names[names.index("timm") : names.index("timm") + 1] = list(TIMM_RECIPES)
    unknown = [n for n in names if n not in RECIPES and n not in TIMM_RECIPES]
    if unknown:
        known = ", ".join([*RECIPES, "timm", *TIMM_RECIPES])
        print(f"unknown recipe(s): {', '.join(unknown)}; choose from: {known}", file=sys.stderr)
        return 2
    if not (args.data / "train").is_dir():
        print(
            f"no train/ folder in {args.data}: make one with `python -m fastload synth {args.data}`",
            file=sys.stderr,
        )
        return 2
    records = []
    for name in names:
        records.append(measure(name, args.data, args))
        print(_table(records[-1:]).splitlines()[-1] if records[1:] else _table(records), flush=True)
    print()
    print(_table(records))
    result: dict[str, Any] = {"config": {k: str(v) for k, v in vars(args).items()}, "records": records}
    if args.profile:
        rows = profile(args.data, args.profile_images)
        print()
        print(_profile_table(rows))
        result["profile"] = [{"stage": n, "torch_ms": a, "swap_ms": b} for n, a, b in rows]
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
