from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fastload.synthetic import make_imagenet_like, render_image, synthetic_classes


def _digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha1(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*.JPEG"))
    }


def test_layout_names_and_counts(imagenet_root: Path) -> None:
    classes = synthetic_classes(4)
    assert sorted(p.name for p in (imagenet_root / "train").iterdir()) == classes
    assert sorted(p.name for p in (imagenet_root / "val").iterdir()) == classes
    for wnid in classes:
        assert len(list((imagenet_root / "train" / wnid).glob("*.JPEG"))) == 8
        assert len(list((imagenet_root / "val" / wnid).glob("*.JPEG"))) == 3
    assert all(c.startswith("n") and len(c) == 9 for c in classes)


def test_files_are_real_images_with_imagenet_quirks(imagenet_root: Path) -> None:
    kinds: dict[tuple[str, str], int] = {}
    for p in (imagenet_root / "train").rglob("*.JPEG"):
        with Image.open(p) as im:
            im.load()
            kinds[(im.format, im.mode)] = kinds.get((im.format, im.mode), 0) + 1
    assert kinds[("JPEG", "RGB")] >= 25
    assert kinds[("JPEG", "L")] >= 1  # grayscale JPEG
    assert kinds[("JPEG", "CMYK")] == 1
    assert kinds[("PNG", "RGB")] == 1  # a PNG saved under a .JPEG name
    with Image.open(next((imagenet_root / "val").rglob("*.JPEG"))) as im:
        assert im.format in ("JPEG", "PNG")


def test_deterministic_for_a_seed_and_different_across_seeds(tmp_path: Path) -> None:
    a = make_imagenet_like(tmp_path / "a", classes=2, per_class=3, val_per_class=1, seed=5, num_workers=1)
    b = make_imagenet_like(tmp_path / "b", classes=2, per_class=3, val_per_class=1, seed=5, num_workers=2)
    c = make_imagenet_like(tmp_path / "c", classes=2, per_class=3, val_per_class=1, seed=6, num_workers=1)
    assert _digest(a) == _digest(b)
    assert _digest(a).keys() == _digest(c).keys()
    assert _digest(a) != _digest(c)


def test_imagenet_like_statistics(tmp_path: Path) -> None:
    """Sizes and file sizes near ImageNet's (mean ~400x350, ~110 KB), natural-image structure."""
    root = make_imagenet_like(tmp_path, classes=10, per_class=30, val_per_class=0, seed=1, quirks=False)
    files = sorted((root / "train").rglob("*.JPEG"))
    sizes = np.array([Image.open(f).size for f in files])
    nbytes = np.array([f.stat().st_size for f in files])
    mean_w, mean_h = sizes.mean(axis=0)
    assert 330 < mean_w < 470 and 290 < mean_h < 410, (mean_w, mean_h)
    assert 70_000 < nbytes.mean() < 160_000, nbytes.mean()
    assert (sizes.max(axis=1) > 1000).any() and (sizes.max(axis=1) < 100).any()
    img = np.asarray(render_image((1, 2, 3), 0, size=(320, 240)).convert("L"), dtype=np.float32)
    # Not flat colour, not white noise: strong correlation between neighbouring pixels.
    assert img.std() > 20
    corr = np.corrcoef(img[:, :-1].ravel(), img[:, 1:].ravel())[0, 1]
    assert 0.3 < corr < 0.99, corr


def test_quality_range(tmp_path: Path) -> None:
    root = make_imagenet_like(tmp_path, classes=1, per_class=12, val_per_class=0, seed=3, quirks=False)
    qualities = set()
    for f in (root / "train").rglob("*.JPEG"):
        with Image.open(f) as im:
            q = im.quantization[0]
            qualities.add(int(q[0]))  # DC quantizer step: smaller at higher quality
    assert len(qualities) > 1


@pytest.mark.parametrize(
    "kwargs, match", [({"classes": 0}, "classes"), ({"per_class": -1}, "per_class"), ({"seed": 1.5}, "seed")]
)
def test_bad_arguments(tmp_path: Path, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_imagenet_like(tmp_path, **kwargs)


def test_cli_synth(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "fastload",
            "synth",
            str(tmp_path / "d"),
            "--classes",
            "2",
            "--per-class",
            "2",
            "--val-per-class",
            "1",
            "--seed",
            "4",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "wrote 6 images" in out.stdout
    assert len(list((tmp_path / "d").rglob("*.JPEG"))) == 6
    same = make_imagenet_like(tmp_path / "e", classes=2, per_class=2, val_per_class=1, seed=4)
    assert _digest(tmp_path / "d") == _digest(same)


def test_cli_synth_refuses_a_non_empty_folder_unless_forced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from fastload.__main__ import main

    small = ["--classes", "2", "--per-class", "2", "--val-per-class", "1", "--workers", "1"]
    root = tmp_path / "d"
    (root / "train" / "mine").mkdir(parents=True)
    (root / "train" / "mine" / "photo.JPEG").write_bytes(b"not ours")
    assert main(["synth", str(root), *small]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not empty (it holds 1 file(s))" in err and "--force" in err
    assert list(root.rglob("*.JPEG")) == [root / "train" / "mine" / "photo.JPEG"]  # nothing written

    assert main(["synth", str(root), *small, "--force"]) == 0
    out = capsys.readouterr().out
    assert "wrote 6 images" in out and "also holds 1 other file(s)" in out
    assert (root / "train" / "mine" / "photo.JPEG").read_bytes() == b"not ours"
    assert len(list(root.rglob("*.JPEG"))) == 7


def test_cli_synth_completes_its_own_earlier_run_but_not_one_with_other_settings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from fastload.__main__ import main

    small = ["--classes", "2", "--per-class", "2", "--val-per-class", "1", "--workers", "1"]
    root = tmp_path / "d"
    assert main(["synth", str(root), *small]) == 0
    first = _digest(root)
    victim = sorted(root.rglob("*.JPEG"))[0]
    victim.unlink()  # as if the first run had been interrupted
    assert main(["synth", str(root), *small]) == 0  # the same command again completes it
    assert _digest(root) == first
    capsys.readouterr()
    assert main(["synth", str(root), *small, "--seed", "1"]) == 2
    assert "earlier synth with other settings" in capsys.readouterr().err
    assert _digest(root) == first
    (tmp_path / "f").write_text("x")
    assert main(["synth", str(tmp_path / "f"), *small]) == 2
    assert "is a file" in capsys.readouterr().err


def test_make_linked_tree_spreads_hard_links_over_classes(tmp_path: Path) -> None:
    """ImageNet's shape in miniature: 2,563 files over 2 classes (1,282 + 1,281), every file a hard
    link to one of the base JPEGs (decodable), or to an empty file."""
    import os

    from fastload import ImageFolder
    from fastload.synthetic import make_linked_tree

    split = make_linked_tree(tmp_path / "links", num_files=2_563, classes=2, base_images=3)
    ds = ImageFolder(split)
    assert len(ds) == 2_563 and np.bincount(ds.targets).tolist() == [1282, 1281]
    bases = sorted((tmp_path / "links" / "base").iterdir())
    assert len(bases) == 3 and sum(os.stat(b).st_nlink - 1 for b in bases) == 2_563
    image, _ = ds[1000]
    assert image.mode == "RGB" and image.size[0] >= 96
    empty = make_linked_tree(tmp_path / "empty", num_files=10, classes=3, empty=True)
    assert sorted(len(os.listdir(empty / c)) for c in os.listdir(empty)) == [3, 3, 4]
    assert all(os.path.getsize(p) == 0 for p in (tmp_path / "empty" / "base").iterdir())
    with pytest.raises(FileExistsError):
        make_linked_tree(tmp_path / "empty", num_files=1, classes=1)
