"""Head acceleration: the decode-and-crop head of a torchvision pipeline fused with decoding, the
rest of the user's pipeline, ``target_transform`` and ``collate_fn`` run as written (torch's
iterator, torch's random draws)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import PIL
import pytest
import torch
import torchvision
from PIL import Image, ImageFile
from torch.utils.data import default_collate
from torchvision import transforms as v1
from torchvision.transforms import v2

import fastload
from fastload.head import split_pipeline
from fastload.recognize import see_through
from fastload.tvfolder import NotReproducible

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


class Preset:
    """The shape of torchvision's reference presets (``ClassificationPresetTrain``/``Eval``)."""

    def __init__(self, transforms: Any) -> None:
        self.transforms = transforms

    def __call__(self, img: Any) -> Any:
        return self.transforms(img)


class MixupCutmix:
    """The reference script's collate with mixup/cutmix: ``mixup_cutmix(*default_collate(batch))``
    (a class, so that spawn workers can unpickle it)."""

    def __init__(self, num_classes: int) -> None:
        self.choice = v2.RandomChoice(
            [v2.MixUp(alpha=0.2, num_classes=num_classes), v2.CutMix(alpha=1.0, num_classes=num_classes)]
        )

    def __call__(self, batch: list[Any]) -> Any:
        return self.choice(*default_collate(batch))


def _new_v1(size: int = 40) -> Any:
    return v1.Compose(
        [
            v1.RandomResizedCrop(size),
            v1.RandomHorizontalFlip(),
            v1.TrivialAugmentWide(),
            v1.PILToTensor(),
            v1.ConvertImageDtype(torch.float),
            v1.Normalize(MEAN, STD),
            v1.RandomErasing(0.5),
        ]
    )


def _new_v2(size: int = 40) -> Any:
    return v2.Compose(
        [
            v2.RandomResizedCrop(size),
            v2.RandomHorizontalFlip(),
            v2.TrivialAugmentWide(),
            v2.PILToTensor(),
            v2.ToDtype(torch.float, scale=True),
            v2.Normalize(MEAN, STD),
            v2.RandomErasing(0.5),
            v2.ToPureTensor(),
        ]
    )


def _tensor_v2(size: int = 40) -> Any:
    return v2.Compose(
        [
            v2.PILToTensor(),
            v2.RandomResizedCrop(size, antialias=True),
            v2.RandomHorizontalFlip(),
            v2.RandAugment(),
            v2.ToDtype(torch.float, scale=True),
            v2.Normalize(MEAN, STD),
            v2.RandomErasing(0.5),
            v2.ToPureTensor(),
        ]
    )


def _image_v2(size: int = 40) -> Any:  # tv_tensors.Image through the tail, no ToPureTensor
    return v2.Compose(
        [
            v2.ToImage(),
            v2.RandomResizedCrop(size),
            v2.RandomHorizontalFlip(),
            v2.AugMix(),
            v2.ToDtype(torch.float, scale=True),
            v2.Normalize(MEAN, STD),
        ]
    )


def _val_jitter_v1() -> Any:
    return v1.Compose([v1.Resize(44), v1.CenterCrop(40), v1.ColorJitter(0.4, 0.4, 0.4, 0.1), v1.ToTensor()])


RECIPES = {"new v1": _new_v1, "new v2": _new_v2, "tensor v2": _tensor_v2, "image v2": _image_v2}


def _equal_batches(want: list[Any], got: list[Any]) -> None:
    assert len(want) == len(got)
    for a, b in zip(want, got, strict=True):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert type(x) is type(y) and x.dtype == y.dtype and x.shape == y.shape
            assert torch.equal(x, y)


# ------------------------------------------------------------------ bit-identity with torch's loader


@pytest.mark.parametrize(
    "recipe, workers, context, mixup",
    [
        ("new v1", 0, None, False),
        ("new v2", 2, "fork", True),
        ("tensor v2", 2, "fork", False),
        ("image v2", 0, None, True),
        ("new v1", 2, "spawn", True),
    ],
)
def test_full_scale_batches_are_torchs_bit_for_bit(
    imagenet_root: Path, recipe: str, workers: int, context: str | None, mixup: bool
) -> None:
    """exact_pixels=True: the same batches as torch's DataLoader, any tail, the user's collate_fn."""
    dataset = torchvision.datasets.ImageFolder(imagenet_root / "train", transform=Preset(RECIPES[recipe]()))
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(7)).tolist()
    kwargs: dict[str, Any] = {
        "batch_size": 6,
        "sampler": order,
        "num_workers": workers,
        "collate_fn": MixupCutmix(len(dataset.classes)) if mixup else default_collate,
    }
    if workers:
        kwargs["multiprocessing_context"] = context
    loader = fastload.DataLoader(dataset, **kwargs, exact_pixels=True)
    assert loader.path == "head-accelerated" and not loader.fast_path, loader.fast_path_reason
    torch.manual_seed(0)  # torch's workers' seeds, or the main process's draws, come from it
    got = [type(batch)(t.clone() for t in batch) for batch in loader]
    loader.close()
    torch.manual_seed(0)
    want = list(torch.utils.data.DataLoader(dataset, **kwargs))
    _equal_batches(want, got)
    if mixup:
        assert got[0][1].dtype == torch.float32 and got[0][1].shape == (6, 4)  # the user's collate ran


def test_every_epoch_is_torchs_with_the_default_workers(imagenet_root: Path) -> None:
    """fastload's default keeps the workers between epochs where torch's default starts new ones,
    seeded from each pass's base seed: each pass reseeds them so, and the random ops (crop, flip,
    jitter) draw what torch's draw, epoch after epoch; the loop's own numbers too."""
    dataset = torchvision.datasets.ImageFolder(imagenet_root / "train", transform=_new_v2(24))
    order = list(range(0, len(dataset), 3))

    def epochs(cls: Any, **extra: Any) -> list[Any]:
        torch.manual_seed(5)
        loader = cls(dataset, batch_size=4, sampler=order, num_workers=2, **extra)
        out = [[*(type(b)(t.clone() for t in b) for b in loader), torch.rand(2)] for _ in range(3)]
        if cls is fastload.DataLoader:
            assert loader.path == "head-accelerated" and loader.persistent_workers
            loader.close()
        return out

    want = epochs(torch.utils.data.DataLoader)
    got = epochs(fastload.DataLoader, exact_pixels=True)
    for w, g in zip(want, got, strict=True):
        _equal_batches(w[:-1], g[:-1])
        assert torch.equal(w[-1], g[-1])
    assert not torch.equal(got[0][0][0], got[1][0][0])  # new draws each epoch


def test_target_transform_and_shuffle_with_workers(imagenet_root: Path) -> None:
    dataset = torchvision.datasets.ImageFolder(
        imagenet_root / "train", transform=_new_v2(), target_transform=lambda t: 10 * t + 1
    )
    loader = fastload.DataLoader(
        dataset, batch_size=8, shuffle=True, seed=3, num_workers=2, exact_pixels=True
    )
    assert loader.path == "head-accelerated" and "target_transform" in (loader.fast_path_reason or "")
    order = list(loader.sampler)  # epoch 0's order
    torch.manual_seed(1)
    got = [type(batch)(t.clone() for t in batch) for batch in loader]
    loader.close()
    torch.manual_seed(1)
    want = list(torch.utils.data.DataLoader(dataset, batch_size=8, sampler=order, num_workers=2))
    _equal_batches(want, got)
    assert sorted(int(y) for _, ys in got for y in ys) == sorted(10 * t + 1 for t in dataset.targets)


# ------------------------------------------------------------------ reduced-size decoding (the default)


def test_reduced_decode_keeps_torchs_draws_and_labels_with_close_pixels(imagenet_root: Path) -> None:
    """Crops at least twice the output are decoded at 1/2..1/8 scale: the same crop, flip and
    every later draw as torch, labels identical, pixels within a few levels on average.

    The bound: libjpeg's DCT scaling averages 2x2..8x8 blocks where the full-size path resamples
    with an antialiasing filter; the two low-pass filters differ by 4-6 levels at edges
    (``bench/decode.py``), a few levels on average. A wrong crop or flip is tens of levels off
    (the control below), so the bound tells them apart."""
    transform = v1.Compose(
        [v1.RandomResizedCrop(32, scale=(0.6, 1.0)), v1.RandomHorizontalFlip(), v1.PILToTensor()]
    )
    dataset = torchvision.datasets.ImageFolder(imagenet_root / "train", transform=Preset(transform))
    loader = fastload.DataLoader(dataset, batch_size=32, num_workers=0)
    assert loader.path == "head-accelerated" or loader.fast_path
    head = split_pipeline(Preset(transform))
    assert head.reduce and not head.exact
    reduced = 0
    for i in range(len(dataset)):
        data = Path(dataset.samples[i][0]).read_bytes()
        torch.manual_seed(i)
        want = dataset[i][0]
        after_torch = torch.rand(1)
        torch.manual_seed(i)
        got = head.decode_and_apply(data, dataset.samples[i][0])
        assert torch.equal(torch.rand(1), after_torch)  # the same number of draws, so the same params
        assert got.shape == want.shape and got.dtype == torch.uint8
        diff = (got.float() - want.float()).abs().mean().item()
        assert diff <= 6.0, (i, diff)
        torch.manual_seed(i + 1000)  # control: another crop of the same image is far off
        other = dataset[i][0]
        if not torch.equal(other, want):
            reduced += (other.float() - want.float()).abs().mean().item() > 3 * max(diff, 1.0)
    assert reduced >= len(dataset) // 2  # the bound is tight enough to see a different crop


# ------------------------------------------------------------------ which path, and saying why


class _OwnGetItem(torchvision.datasets.ImageFolder):
    def __getitem__(self, i: int) -> Any:
        return super().__getitem__(i)


def _custom_loader(path: str) -> Any:
    return torchvision.datasets.folder.pil_loader(path)


def test_paths_and_the_info_line_for_each_blocker(
    imagenet_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    val = imagenet_root / "val"
    sampler = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(range(12)), 4, False)
    cases: list[tuple[Any, dict[str, Any], str, str]] = [
        (
            torchvision.datasets.ImageFolder(val, transform=Preset(_new_v1())),
            {},
            "head-accelerated",
            "Trivial",
        ),
        (
            torchvision.datasets.ImageFolder(val, transform=_new_v2()),
            {"collate_fn": MixupCutmix(4)},
            "head-accelerated",
            "collate_fn",
        ),
        (
            torchvision.datasets.ImageFolder(val, transform=_val_jitter_v1()),
            {"batch_sampler": sampler, "batch_size": 1},
            "head-accelerated",
            "batch_sampler",
        ),
        (_OwnGetItem(val, transform=_new_v1()), {}, "torch", "__getitem__"),
        (
            torchvision.datasets.ImageFolder(val, transform=_new_v1(), loader=_custom_loader),
            {},
            "torch",
            "loader",
        ),
        (
            torchvision.datasets.ImageFolder(
                val, transform=v1.Compose([v1.ColorJitter(0.1, hue=0.1), v1.ToTensor()])
            ),
            {},
            "torch",
            "begin with a crop",
        ),
    ]
    for dataset, kwargs, path, word in cases:
        caplog.clear()
        args = {"batch_size": 4, **kwargs}
        if "batch_sampler" in args:
            args.pop("batch_size")
        with caplog.at_level(logging.INFO, logger="fastload"):
            loader = fastload.DataLoader(dataset, num_workers=0, **args)
        records = [r for r in caplog.records if r.name == "fastload"]
        assert loader.path == path, (word, loader.fast_path_reason)
        assert len(records) == 1 and records[0].levelno == logging.WARNING, word
        message = records[0].getMessage()
        assert word in message, message
        assert (loader.fast_path_reason or "") in message
        assert ("accelerates the head" in message) == (path == "head-accelerated")


def test_default_collate_passed_explicitly_is_no_collate_fn(imagenet_root: Path) -> None:
    transform = Preset(
        v1.Compose([v1.Resize(44), v1.CenterCrop(40), v1.PILToTensor(), v1.ConvertImageDtype(torch.float)])
    )
    dataset = torchvision.datasets.ImageFolder(imagenet_root / "val", transform=transform)
    loader = fastload.DataLoader(dataset, batch_size=4, num_workers=0, collate_fn=default_collate)
    assert loader.fast_path and loader.path == "fast", loader.fast_path_reason
    other = fastload.DataLoader(dataset, batch_size=4, num_workers=0, collate_fn=lambda b: default_collate(b))
    assert other.path == "head-accelerated" and "collate_fn" in (other.fast_path_reason or "")
    for (a, ya), (b, yb) in zip(loader, other, strict=True):  # a deterministic pipeline: the same images
        assert torch.equal(ya, yb) and (a - b).abs().max() <= 1 / 255 + 1e-6


# ------------------------------------------------------------------ the wrapper rule


class _Module(torch.nn.Module):
    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: Any) -> Any:
        return self.inner(x)


class _DoesMore(Preset):
    def __call__(self, img: Any) -> Any:
        img = self.transforms(img)
        return img


class _Defaulted(Preset):
    def __call__(self, img: Any, extra: int = 0) -> Any:
        return self.transforms(img)


class _OtherArgument(Preset):
    def __call__(self, img: Any) -> Any:
        return self.transforms(self)


def test_the_wrapper_rule() -> None:
    compose = v2.Compose([v2.RandomResizedCrop(8), v2.PILToTensor()])
    assert see_through(Preset(compose)) is compose
    assert see_through(Preset(Preset(compose))) is compose  # a wrapper of a wrapper
    assert see_through(_Module(compose)) is compose  # an nn.Module forwarding in forward()
    hooked = _Module(compose)
    hooked.register_forward_hook(lambda *a: None)
    assert see_through(hooked) is hooked  # a hook may change what it returns
    for wrapper in (_DoesMore(compose), _Defaulted(compose), _OtherArgument(compose)):
        assert see_through(wrapper) is wrapper
    assert see_through(compose) is compose
    with pytest.raises(NotReproducible, match="begin with a crop"):
        split_pipeline(_DoesMore(compose))


# ------------------------------------------------------------------ faults: torch's errors and samples


def _tree_with_a_truncated_file(root: Path, tmp_path: Path) -> tuple[Path, str]:
    copy = tmp_path / "train"
    shutil.copytree(root / "train", copy)
    victim = sorted(p for p in copy.rglob("*") if p.suffix.lower() in (".jpeg", ".jpg") and p.is_file())[5]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    return copy, str(victim)


def test_a_corrupt_file_raises_torchs_error_and_loading_goes_on(
    imagenet_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, victim = _tree_with_a_truncated_file(imagenet_root, tmp_path)
    dataset = torchvision.datasets.ImageFolder(root, transform=Preset(_new_v1()))
    bad = [s[0] for s in dataset.samples].index(victim) // 4

    def batches(loader: Any) -> list[Any]:
        out: list[Any] = []
        it = iter(loader)
        while True:
            try:
                out.append(next(it))
            except StopIteration:
                return out
            except Exception as e:  # noqa: BLE001 - the error of one batch, recorded
                out.append(type(e))

    torch.manual_seed(0)
    want = batches(torch.utils.data.DataLoader(dataset, batch_size=4))
    loader = fastload.DataLoader(dataset, batch_size=4, num_workers=0, exact_pixels=True)
    assert loader.path == "head-accelerated"
    torch.manual_seed(0)
    got = batches(loader)
    assert want[bad] is got[bad] and isinstance(got[bad], type) and issubclass(got[bad], OSError)
    good_w = [b for b in want if not isinstance(b, type)]
    good_g = [b for b in got if not isinstance(b, type)]
    assert len(good_g) == len(want) - 1
    for (a, ya), (b, yb) in zip(good_w, good_g, strict=True):  # before and after the error: in step
        assert torch.equal(ya, yb) and torch.equal(a, b)
    # PIL set to load truncated files: the sample torch makes, with the same draws
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    loader = fastload.DataLoader(dataset, batch_size=4, num_workers=0, exact_pixels=True)
    torch.manual_seed(0)
    want = list(torch.utils.data.DataLoader(dataset, batch_size=4))
    torch.manual_seed(0)
    _equal_batches(want, list(loader))


def test_a_file_that_is_no_image_raises_pils_error_in_torchs_words(
    imagenet_root: Path, tmp_path: Path
) -> None:
    """PIL names the file object torchvision's loader opened: the same words as with torch's loader."""
    root = tmp_path / "train"
    shutil.copytree(imagenet_root / "train", root)
    victim = sorted(root.rglob("*.JPEG"))[3]
    victim.write_bytes(b"not an image at all, just text\n" * 4)
    dataset = torchvision.datasets.ImageFolder(root, transform=Preset(_new_v1()))
    at = [s[0] for s in dataset.samples].index(str(victim))
    outcomes = []
    for cls in (torch.utils.data.DataLoader, fastload.DataLoader):
        loader = cls(dataset, batch_size=1, sampler=[at], num_workers=0)
        with pytest.raises(PIL.UnidentifiedImageError) as info:
            next(iter(loader))
        outcomes.append(str(info.value))
    assert loader.path == "head-accelerated"
    assert (
        outcomes[0] == outcomes[1] == f"cannot identify image file <_io.BufferedReader name={str(victim)!r}>"
    )


def test_a_conversion_that_gets_something_else_runs_as_written(imagenet_root: Path) -> None:
    """A Lambda turns the image grayscale: the PILToTensor after it gets an 'L' image, not the RGB
    image the fused conversion was planned for, so the user's ops run."""
    transform = v1.Compose(
        [
            v1.RandomResizedCrop(24),
            v1.Lambda(lambda img: img.convert("L")),
            v1.PILToTensor(),
            v1.ConvertImageDtype(torch.float),
        ]
    )
    dataset = torchvision.datasets.ImageFolder(imagenet_root / "val", transform=transform)
    loader = fastload.DataLoader(dataset, batch_size=4, num_workers=0, exact_pixels=True)
    assert loader.path == "head-accelerated"
    torch.manual_seed(0)
    want = list(torch.utils.data.DataLoader(dataset, batch_size=4))
    torch.manual_seed(0)
    got = list(loader)
    _equal_batches(want, got)
    assert got[0][0].shape == (4, 1, 24, 24)


def test_head_pipeline_pickles_and_describes_itself() -> None:
    import pickle

    head = split_pipeline(Preset(_new_v2()))
    again = pickle.loads(pickle.dumps(head))
    assert again.describe() == head.describe()
    assert head.fused_ops == [
        "RandomResizedCrop",
        "RandomHorizontalFlip",
        "PILToTensor",
        "ToDtype",
        "Normalize",
    ]
    assert head.user_ops == ["TrivialAugmentWide", "RandomErasing", "ToPureTensor"]


class _RecordWorker:
    """A worker_init_fn that writes what torch's worker sees into a file."""

    def __init__(self, folder: Path) -> None:
        self.folder = str(folder)

    def __call__(self, worker_id: int) -> None:
        info = torch.utils.data.get_worker_info()
        line = f"{info.id} {info.num_workers} {info.seed} {type(info.dataset).__name__} "
        line += type(info.dataset.transform).__name__
        (Path(self.folder) / f"w{worker_id}").write_text(line)


def test_torchs_worker_contract_holds(imagenet_root: Path, tmp_path: Path) -> None:
    """worker_init_fn runs in each worker, get_worker_info() is torch's (the view with the head
    pipeline as its dataset), and the per-worker seeds are torch's (seed + worker id)."""
    dataset = torchvision.datasets.ImageFolder(imagenet_root / "val", transform=Preset(_new_v1()))
    loader = fastload.DataLoader(
        dataset, batch_size=4, num_workers=2, worker_init_fn=_RecordWorker(tmp_path), exact_pixels=True
    )
    torch.manual_seed(5)
    got = [tuple(t.clone() for t in batch) for batch in loader]
    loader.close()
    lines = sorted(p.read_text().split() for p in tmp_path.iterdir())
    assert [line[0] for line in lines] == ["0", "1"] and all(line[1] == "2" for line in lines)
    assert all(line[3:] == ["ImageFolder", "HeadPipeline"] for line in lines)
    assert int(lines[1][2]) == int(lines[0][2]) + 1  # torch's base seed + worker id
    torch.manual_seed(5)
    want = list(torch.utils.data.DataLoader(dataset, batch_size=4, num_workers=2))
    for (a, ya), (b, yb) in zip(want, got, strict=True):
        assert torch.equal(a, b) and torch.equal(ya, yb)


@pytest.mark.parametrize(
    "ops",
    [
        [
            v2.ToImage(),
            v2.RandomResizedCrop(24),
            v2.RandomHorizontalFlip(),
            v2.ToDtype(torch.float32, scale=True),
        ],
        [v2.PILToTensor(), v2.Resize(30), v2.CenterCrop(24), v2.ToDtype(torch.float32, scale=True)],
        [v1.Resize(30), v1.CenterCrop(24), v1.PILToTensor()],
        [
            v2.RandomResizedCrop(24),
            v2.ToImage(),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(MEAN, STD),
        ],
    ],
    ids=["ToImage head", "tensor eval", "uint8 out", "ToImage after"],
)
def test_the_types_torchvision_returns(imagenet_root: Path, ops: list[Any]) -> None:
    """Head and conversions give what torchvision's ops give: tv_tensors.Image after a v2 ToImage,
    plain tensors otherwise, the same dtype and values (a target_transform keeps the fast path off)."""
    transform = (v2 if "v2" in type(ops[0]).__module__ else v1).Compose(ops)
    dataset = torchvision.datasets.ImageFolder(
        imagenet_root / "val", transform=transform, target_transform=int
    )
    loader = fastload.DataLoader(dataset, batch_size=None, num_workers=0, exact_pixels=True)
    assert loader.path == "head-accelerated"
    torch.manual_seed(0)
    want = [image for image, _ in torch.utils.data.DataLoader(dataset, batch_size=None)]
    torch.manual_seed(0)
    got = [image for image, _ in loader]
    for a, b in zip(want, got, strict=True):
        assert type(a) is type(b) and a.dtype == b.dtype and torch.equal(a, b)


def test_color_jitter_after_the_head_gives_pillows_bytes() -> None:
    """A ColorJitter after a fused head runs on the decoded array (fastload._jitter): its own draws
    from torch's RNG, Pillow's blends, the same bytes as torchvision's on the PIL image."""
    from fastload._jitter import Jitter, is_jitter, reproduces_pillow

    assert reproduces_pillow()  # the C extension matches the installed Pillow
    jitter = v1.ColorJitter(0.4, 0.4, 0.4)
    assert is_jitter(jitter) and not is_jitter(v1.ColorJitter(0.4, hue=0.1))
    rng = np.random.default_rng(3)
    for seed in range(20):
        pixels = rng.integers(0, 256, (23 + seed, 31, 3), dtype=np.uint8)
        torch.manual_seed(seed)
        expected = np.asarray(jitter(Image.fromarray(pixels)))
        torch.manual_seed(seed)
        assert np.array_equal(Jitter(jitter)(pixels.copy()), expected)
        torch.manual_seed(seed)
        as_pil = Jitter(jitter)(Image.fromarray(pixels))
        assert isinstance(as_pil, Image.Image) and np.array_equal(np.asarray(as_pil), expected)
    grey = Image.fromarray(rng.integers(0, 256, (8, 8), dtype=np.uint8))  # not RGB: the op as written
    torch.manual_seed(0)
    expected_grey = np.asarray(jitter(grey))
    torch.manual_seed(0)
    assert np.array_equal(np.asarray(Jitter(jitter)(grey)), expected_grey)
    head = split_pipeline(v1.Compose([v1.RandomResizedCrop(16), jitter, v1.ToTensor()]))
    assert "ColorJitter on the decoded pixels" in head.describe() and head.foreign_ops == []
