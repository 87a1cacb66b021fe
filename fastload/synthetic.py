"""An ImageNet-like tree of real JPEG files, made in seconds, for tests, benchmarks and demos.

``make_imagenet_like(root)`` writes ``root/train/<wnid>/<name>.JPEG`` and
``root/val/<wnid>/<name>.JPEG`` that look like ImageNet to a data loader: ImageNet's spread of
sizes and aspect ratios, natural-image structure (so files are about as large and decode about
as slowly), JPEG quality 75 to 95 with 4:2:0 chroma, and (``quirks=True``) a few grayscale JPEGs,
one CMYK JPEG and one PNG under a ``.JPEG`` name. Every byte is a function of ``seed``.

Example:
    >>> from fastload.synthetic import make_imagenet_like
    >>> root = make_imagenet_like("/tmp/inet", classes=10, per_class=20, val_per_class=5)
    >>> sorted(p.name for p in (root / "train").iterdir())[:2]
    ['n01440764', 'n01448683']

Command line: ``python -m fastload synth ROOT --classes 10 --per-class 50 --val-per-class 10``.
"""

from __future__ import annotations

import io
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter
from tqdm import tqdm

from ._checks import check_int
from .device import available_cpus

__all__ = ["make_imagenet_like", "make_linked_tree", "synthetic_classes", "render_image", "SyntheticSpec"]

_SPLITS = ("train", "val")


def synthetic_classes(n: int) -> list[str]:
    """``n`` WordNet-style class ids (``n01440764``, ...), sorted, the same for every seed."""
    n = check_int(n, "classes", low=1)
    return [f"n{1440764 + 7919 * c:08d}" for c in range(n)]


@dataclass(frozen=True)
class SyntheticSpec:
    """What one synthetic file is: where it goes and how it is drawn."""

    relpath: str
    class_index: int
    seed: tuple[int, ...]
    kind: str = "rgb"  # "rgb", "gray", "cmyk" or "png"


def _draw_size(rng: np.random.Generator) -> tuple[int, int]:
    u = rng.random()
    if u < 0.03:
        long_side = int(rng.integers(1001, 1600))
    elif u < 0.06:
        long_side = int(rng.integers(48, 100))
    else:
        long_side = int(np.clip(rng.lognormal(np.log(385.0), 0.2), 100, 1000))
    aspect = float(np.exp(rng.uniform(np.log(1.1), np.log(1.6))))  # long / short
    short_side = max(16, int(round(long_side / aspect)))
    if rng.random() < 0.8:  # landscape, as most photos are
        return long_side, short_side
    return short_side, long_side


def _smooth_field(rng: np.random.Generator, h: int, w: int, cells: int, channels: int) -> np.ndarray:
    ch = max(2, cells)
    cw = max(2, int(round(cells * w / max(h, 1))) + 1)
    small = (rng.random((ch, cw, channels)) * 255).astype(np.uint8)
    img = Image.fromarray(small[..., 0] if channels == 1 else small)
    out = np.asarray(img.resize((w, h), Image.Resampling.BICUBIC), dtype=np.float32)
    return out[..., None] if channels == 1 else out


def render_image(seed: Sequence[int], class_index: int, size: tuple[int, int] | None = None) -> Image.Image:
    """Draws one RGB image with natural-image structure, deterministic for ``seed``; ``class_index``
    tints it so that classes differ visibly (a model can learn them); ``size``: ``(width, height)``,
    drawn from the ImageNet-like distribution when ``None``."""
    rng = np.random.default_rng(list(seed))
    w, h = size if size is not None else _draw_size(rng)
    class_rng = np.random.default_rng([class_index, 7])
    tint = class_rng.integers(30, 226, 3).astype(np.float32)
    base = _smooth_field(rng, h, w, int(rng.integers(2, 6)), 3) * 0.55 + tint * 0.45
    img = Image.fromarray(base.clip(0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(img)
    short = min(w, h)
    for _ in range(int(rng.integers(4, 12))):
        x0, y0 = int(rng.integers(0, w)), int(rng.integers(0, h))
        s = int(rng.integers(max(2, short // 16), max(4, short // 2)))
        colour = tuple(int(c) for c in (rng.integers(0, 256, 3) * 0.6 + tint * 0.4))
        if rng.random() < 0.5:
            draw.ellipse([x0, y0, x0 + s, y0 + int(s * rng.uniform(0.5, 1.5))], fill=colour)
        else:
            pts = [
                (x0 + int(rng.integers(-s, s + 1)), y0 + int(rng.integers(-s, s + 1)))
                for _ in range(3 + int(rng.integers(0, 3)))
            ]
            draw.polygon(pts, fill=colour)
    arr = np.asarray(img, dtype=np.float32)
    # Texture whose strength varies over the image: fine luminance grain, blurred a little so it
    # reads as surface detail rather than sensor noise, plus half-resolution chroma texture.
    strength = _smooth_field(rng, h, w, 3, 1) / 255.0
    grain = rng.standard_normal((h, w)).astype(np.float32) * 40 + 128
    grain_img = Image.fromarray(grain.clip(0, 255).astype(np.uint8)).filter(ImageFilter.GaussianBlur(0.7))
    fine = np.asarray(grain_img, dtype=np.float32)[..., None] - 128
    arr += fine * strength * 7 + rng.standard_normal((h, w, 1)).astype(np.float32) * 22 * strength
    hh, hw = (h + 1) // 2, (w + 1) // 2
    chroma = rng.standard_normal((hh, hw, 3)).astype(np.float32) * 14
    arr += np.repeat(np.repeat(chroma, 2, axis=0), 2, axis=1)[:h, :w]
    return Image.fromarray(arr.clip(0, 255).astype(np.uint8))


def _encode(spec: SyntheticSpec) -> bytes:
    img = render_image(spec.seed, spec.class_index)
    rng = np.random.default_rng([*spec.seed, 99])
    quality = int(rng.integers(75, 96))
    buf = io.BytesIO()
    if spec.kind == "png":
        img.save(buf, format="PNG", compress_level=1)
    elif spec.kind == "gray":
        img.convert("L").save(buf, format="JPEG", quality=quality)
    elif spec.kind == "cmyk":
        img.convert("CMYK").save(buf, format="JPEG", quality=quality)
    else:
        img.save(buf, format="JPEG", quality=quality, subsampling="4:2:0")
    return buf.getvalue()


def _write(args: tuple[str, SyntheticSpec]) -> None:
    root, spec = args
    data = _encode(spec)
    path = os.path.join(root, spec.relpath)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _specs(classes: list[str], per_split: dict[str, int], seed: int, quirks: bool) -> Iterator[SyntheticSpec]:
    for split_id, split in enumerate(_SPLITS):
        n = per_split[split]
        total = n * len(classes)
        # Grayscale roughly 1 in 100 (ImageNet has ~1 in 60), at least one per non-empty split.
        gray_every = max(1, min(100, total))
        for c, wnid in enumerate(classes):
            for i in range(n):
                flat = c * n + i
                kind = "rgb"
                if quirks:
                    if flat % gray_every == gray_every // 2:
                        kind = "gray"
                    elif split == "train" and flat == 1 and total > 2:
                        kind = "cmyk"
                    elif split == "train" and flat == 2 and total > 2:
                        kind = "png"
                name = f"{wnid}_{i}.JPEG" if split == "train" else f"ILSVRC2012_val_{flat + 1:08d}.JPEG"
                yield SyntheticSpec(f"{split}/{wnid}/{name}", c, (seed, split_id, c, i), kind)


def make_imagenet_like(
    root: str | os.PathLike[str],
    classes: int = 10,
    per_class: int = 50,
    val_per_class: int = 10,
    seed: int = 0,
    quirks: bool = True,
    num_workers: int | None = None,
    progress: bool | None = None,
) -> Path:
    """Writes an ImageNet-like JPEG tree (see the module docstring) and returns ``Path(root)``;
    existing files are overwritten with identical content, so an interrupted run can be repeated.

    Args:
        per_class, val_per_class: Images per class in ``train`` and ``val`` (0: empty class folders).
        seed: Every byte written is a function of this seed.
        quirks: Include grayscale, CMYK and PNG-named-``.JPEG`` files, as real ImageNet does.
        num_workers: Processes to encode with (default: the CPUs available to this process).
        progress: Show a tqdm bar (default: when writing more than 500 files to a terminal).
    """
    for name, value in (("per_class", per_class), ("val_per_class", val_per_class), ("seed", seed)):
        check_int(value, name, low=0)
    wnids = synthetic_classes(classes)
    out = Path(root)
    for split in _SPLITS:
        for wnid in wnids:
            (out / split / wnid).mkdir(parents=True, exist_ok=True)
    specs = list(_specs(wnids, {"train": per_class, "val": val_per_class}, seed, quirks))
    if num_workers is None:
        num_workers = available_cpus()
    if progress is None:
        progress = len(specs) > 500 and sys.stderr.isatty()
    tasks = [(str(out), s) for s in specs]

    def bar(it: Iterator[None]) -> Iterable[None]:
        return tqdm(it, total=len(tasks), desc=f"synth {out}", unit="img") if progress else it

    if num_workers <= 1 or len(tasks) < 16:
        for _ in bar(map(_write, tasks)):
            pass
    else:
        with ProcessPoolExecutor(max_workers=num_workers) as pool:
            for _ in bar(pool.map(_write, tasks, chunksize=8)):
                pass
    return out


#: ImageNet's training split: 1,281,167 files in 1,000 class folders.
IMAGENET_TRAIN_FILES = 1_281_167
#: ext4 allows at most 65,000 hard links to one file; stay below it.
_MAX_LINKS = 60_000


def make_linked_tree(
    root: str | os.PathLike[str],
    num_files: int = IMAGENET_TRAIN_FILES,
    classes: int = 1000,
    base_images: int = 20,
    empty: bool = False,
    seed: int = 0,
) -> Path:
    """Writes a split shaped like ImageNet train that costs only directory entries.

    ``root/train/<wnid>/<wnid>_<i>.JPEG`` for ``num_files`` files spread as evenly as possible over
    ``classes`` folders. Every file is a hard link to one of ``base_images`` small real JPEGs kept
    in ``root/base/`` (raised as needed so that no file gets more than 60,000 links), or with
    ``empty=True`` to an empty file (enough for scanning). Returns the split folder ``root/train``;
    ``FileExistsError`` if it exists.

    Example:
        >>> split = make_linked_tree("/tmp/inet-shape", num_files=2_562, classes=2)  # doctest: +SKIP
        >>> sorted(os.listdir(split)), len(os.listdir(split / "n01440764"))          # doctest: +SKIP
        (['n01440764', 'n01448683'], 1281)
    """
    num_files = check_int(num_files, "num_files", low=0)
    classes = check_int(classes, "classes", low=1)
    base_images = max(check_int(base_images, "base_images", low=1), -(-num_files // _MAX_LINKS))
    out = Path(root)
    split = out / "train"
    split.mkdir(parents=True, exist_ok=False)
    bases: list[str] = []
    (out / "base").mkdir(exist_ok=True)
    for b in range(base_images):
        path = out / "base" / f"base_{b}.JPEG"
        if empty:
            path.write_bytes(b"")
        else:
            img = render_image((seed, 3, b), b % classes, size=(96 + 8 * (b % 5), 72 + 8 * (b % 3)))
            img.save(path, format="JPEG", quality=85)
        bases.append(str(path))
    wnids = synthetic_classes(classes)
    per, extra = divmod(num_files, classes)
    k = 0
    for c, wnid in enumerate(wnids):
        folder = split / wnid
        folder.mkdir()
        prefix = f"{folder}/{wnid}_"
        for i in range(per + (c < extra)):
            os.link(bases[k % base_images], f"{prefix}{i}.JPEG")
            k += 1
    return split
