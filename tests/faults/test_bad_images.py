"""Bad images: every one gives torchvision's result or a DecodeError naming the file.

The matrix of the issue (images x files/RAM/pack x train/val x 0/2 workers x on_error raise/skip)
is covered as: every image through one combination (files, val, 0 workers, raise), compared with
torchvision's ``ImageFolder`` loader, plus a pairwise covering set of the other dimensions (6 runs,
every pair of values of any two dimensions appears) over the whole bad folder.
"""

from __future__ import annotations

import io
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps
from torchvision.transforms.v2 import functional as F

from fastload import rng
from fastload.decode import DecodeError
from fastload.imagefolder import ImageFolder
from fastload.loader import DataLoader

from ._faults import SIZE, bad_images, drain, reference_rgb, reference_val, train_tf, val_tf

#: Kinds the reference loader (PIL open + convert("RGB"), torchvision's ImageFolder) rejects.
FAILING = {"zero", "truncated", "bomb-jpeg", "bomb-png", "html"}


def _close(a: torch.Tensor, b: torch.Tensor, levels: int = 2) -> bool:
    return a.shape == b.shape and int((a.int() - b.int()).abs().max()) <= levels


def test_the_reference_fails_exactly_on_the_broken_kinds() -> None:
    """The suite's premise: which images torchvision's loader cannot read."""
    assert {kind for kind, data in bad_images().items() if reference_rgb(data) is None} == FAILING


def test_every_image_gives_torchvisions_pixels_or_a_named_error(bad_root: Path) -> None:
    ds = ImageFolder(bad_root, transform=val_tf())
    loader = DataLoader(ds, batch_size=1, num_workers=0)
    result = drain(loader)
    by_index = dict(zip((b[0] for b in result.batches), result.images, strict=True))
    errors = iter(result.errors)
    for i, path in enumerate(ds.index.paths):
        data = Path(path).read_bytes()
        expected = reference_val(data)
        if expected is None:
            error = next(errors)
            assert isinstance(error, DecodeError), repr(error)
            text = str(error)
            assert f"sample {i} " in text and Path(path).name in text, text
            assert not re.search(r"object at 0x|<_io\.", text), text  # says what it found instead
            assert f"{len(data)} bytes" in text, text
            assert "Remove or replace the file" in text
        elif "/bad/" in path:  # (the good synthetic JPEGs may be DCT-scaled: tests/test_decode.py)
            assert _close(by_index[i][0], expected), f"{path}: differs from torchvision's pixels"
    assert next(errors, None) is None
    failing = zip(_failing(ds), result.errors, strict=True)
    messages = {Path(p).stem.split("-", 1)[1]: str(e) for p, e in failing}
    assert "the file is empty (0 bytes)" in messages["zero"]
    assert "starts with" not in messages["truncated"] and "truncated" in messages["truncated"]
    assert "3c 68 74 6d 6c 3e" in messages["html"] and "'<html><body>404 '" in messages["html"]
    assert "MAX_IMAGE_PIXELS" in messages["bomb-jpeg"] and "3600000000 pixels" in messages["bomb-jpeg"]
    assert "400000000 pixels" in messages["bomb-png"]


def _failing(ds: ImageFolder) -> list[str]:
    return [p for p in ds.index.paths if Path(p).stem.split("-", 1)[-1] in FAILING]


# (storage, transform, workers, on_error): every pair of values of two dimensions appears.
PAIRWISE = [
    ("files", "train", 0, "raise"),
    ("files", "val", 2, "skip"),
    ("ram", "train", 2, "skip"),
    ("ram", "val", 0, "raise"),
    ("pack", "train", 0, "skip"),
    ("pack", "val", 2, "raise"),
]


@pytest.mark.parametrize(("storage", "pipeline", "workers", "on_error"), PAIRWISE)
def test_bad_folder_through_every_path(
    open_dataset: Any, storage: str, pipeline: str, workers: int, on_error: str
) -> None:
    tf = train_tf() if pipeline == "train" else val_tf()
    ds = open_dataset(storage, tf)
    bad = {i for i in range(len(ds)) if Path(ds.index.relpath(i)).stem.split("-", 1)[-1] in FAILING}
    assert len(bad) == len(FAILING)
    loader = DataLoader(
        ds, batch_size=4, shuffle=pipeline == "train", seed=5, num_workers=workers, on_error=on_error
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = drain(loader)
    delivered = [i for b in result.batches for i in b]
    assert not bad & set(delivered)
    if on_error == "raise":
        assert result.errors and len(result.errors) + len(result.batches) == len(loader)
        for error in result.errors:
            assert isinstance(error, DecodeError), repr(error)
            named = [i for i in bad if f"sample {i} " in str(error)]
            assert len(named) == 1 and Path(ds.index.relpath(named[0])).name in str(error), str(error)
    else:
        assert not result.errors
        assert sorted(delivered) == sorted(set(range(len(ds))) - bad)  # every good image, once
        assert loader.stats.skipped == len(bad)
        skipped = [str(w.message) for w in caught if "skipped sample" in str(w.message)]
        assert len(skipped) == len(bad)
        for i in bad:
            assert any(f"skipped sample {i} " in m and Path(ds.index.relpath(i)).name in m for m in skipped)
    # The pixels: the per-sample transform at (seed, epoch, index), whatever the path.
    for indices, images in zip(result.batches, result.images, strict=True):
        for k, i in enumerate(indices):
            with rng.sample_scope(5, 0, i):
                expected = tf.decode_and_apply(bytes(ds.get_bytes(i)))
            assert torch.equal(images[k], expected), f"sample {i}"
    loader.close()


def test_exif_orientation_is_not_applied_like_torchvision(bad_root: Path) -> None:
    """torchvision's ImageFolder does not apply EXIF orientation (PIL's open + convert does not);
    neither does fastload, so a drop-in gives the same pixels. ``ImageOps.exif_transpose`` would
    turn the 96x64 image into 64x96."""
    path = next(bad_root.glob("bad/*-exif-rotated.jpg"))
    data = path.read_bytes()
    with Image.open(io.BytesIO(data)) as img:
        assert img.getexif()[0x0112] == 6 and img.size == (96, 64)
        upright = ImageOps.exif_transpose(img)
        assert upright is not None and upright.size == (64, 96)
        upright_t = torch.from_numpy(np.array(upright.convert("RGB"))).permute(2, 0, 1)
    ds = ImageFolder(bad_root, transform=val_tf())
    i = list(ds.index.paths).index(str(path))
    ours = ds[i][0]
    assert _close(ours, reference_val(data))  # type: ignore[arg-type]
    turned = F.center_crop(F.resize(upright_t, [SIZE + 4], antialias=True), [SIZE])
    assert float((ours.float() - turned.float()).abs().mean()) > 10  # clearly not the turned image
    plain = ImageFolder(bad_root)  # no transform: a PIL image, as torchvision's, not turned
    assert plain[i][0].size == (96, 64)
