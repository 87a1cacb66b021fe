"""fastload.transforms: torchvision's parameters and semantics, randomness only from fastload.rng."""

from __future__ import annotations

import math
import pickle
import threading

import numpy as np
import pytest
import torch
import torchvision.transforms as T1
import torchvision.transforms.v2 as T2
from PIL import Image
from torchvision.transforms.v2 import functional as F

from fastload import rng
from fastload.transforms import (
    CenterCrop,
    Compose,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Resize,
    resized_output_size,
)


class ReplayRNG:
    """A fake stream: replays a fixed list of unit uniforms and records how they were used."""

    def __init__(self, uniforms: np.ndarray) -> None:
        self.u = list(map(float, uniforms))
        self.pos = 0
        self.calls: list[str] = []

    def random(self) -> float:
        v = self.u[self.pos]
        self.pos += 1
        self.calls.append("random")
        return v

    def uniform(self, low: float, high: float) -> float:
        self.calls.append("uniform")
        v = self.u[self.pos]
        self.pos += 1
        return low + (high - low) * v

    def randint(self, low: int, high: int) -> int:
        self.calls.append("randint")
        v = self.u[self.pos]
        self.pos += 1
        return low + min(int(v * (high - low)), high - low - 1)


def reference_get_params(
    height: int, width: int, scale: tuple[float, float], ratio: tuple[float, float], r: ReplayRNG
) -> tuple[int, int, int, int]:
    """torchvision.transforms.RandomResizedCrop.get_params, transcribed, torch's RNG replaced by ``r``."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * r.uniform(scale[0], scale[1])
        aspect_ratio = math.exp(r.uniform(log_ratio[0], log_ratio[1]))
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            i = r.randint(0, height - h + 1)
            j = r.randint(0, width - w + 1)
            return i, j, h, w
    in_ratio = float(width) / float(height)
    if in_ratio < min(ratio):
        w = width
        h = int(round(w / min(ratio)))
    elif in_ratio > max(ratio):
        h = height
        w = int(round(h * max(ratio)))
    else:
        w = width
        h = height
    i = (height - h) // 2
    j = (width - w) // 2
    return i, j, h, w


class TorchGlobalRNG:
    """Draws exactly what torchvision's get_params draws from torch's global RNG."""

    def uniform(self, low: float, high: float) -> float:
        return torch.empty(1).uniform_(low, high).item()

    def randint(self, low: int, high: int) -> int:
        return int(torch.randint(low, high, size=(1,)).item())

    def random(self) -> float:
        return torch.rand(1).item()


SHAPES = [(375, 500), (500, 375), (224, 224), (1000, 10), (10, 1000), (31, 400), (1, 1), (2, 7)]
SETTINGS = [
    ((0.08, 1.0), (3 / 4, 4 / 3)),
    ((0.5, 0.5), (1.0, 1.0)),
    ((0.9, 3.0), (0.2, 5.0)),
    ((0.25, 1.0), (2.0, 3.0)),
]


@pytest.mark.parametrize("height,width", SHAPES)
@pytest.mark.parametrize("scale,ratio", SETTINGS)
def test_get_params_is_torchvisions_algorithm_on_the_same_draws(
    height: int, width: int, scale: tuple[float, float], ratio: tuple[float, float]
) -> None:
    t = RandomResizedCrop(224, scale=scale, ratio=ratio)
    fallbacks = 0
    for seed in range(200):
        uniforms = np.random.default_rng(seed).random(30)
        mine, ref = ReplayRNG(uniforms), ReplayRNG(uniforms)
        got = t.get_params(height, width, mine)  # type: ignore[arg-type]
        expected = reference_get_params(height, width, scale, ratio, ref)
        if 0 in expected[2:]:  # torchvision's fallback rounded a side to 0 (its resize then fails): we keep 1
            expected = (
                (height - max(1, expected[2])) // 2,
                (width - max(1, expected[3])) // 2,
                max(1, expected[2]),
                max(1, expected[3]),
            )
        assert got == expected
        assert mine.calls == ref.calls  # same draws in the same order
        fallbacks += "randint" not in mine.calls
        top, left, h, w = got
        assert 0 <= top and top + h <= height and 0 <= left and left + w <= width and h > 0 and w > 0
    if (height, width) in ((1000, 10), (10, 1000)) and scale == (0.08, 1.0):
        assert fallbacks > 0  # the fallback branch is exercised


@pytest.mark.parametrize("height,width", [(375, 500), (1000, 10), (64, 48)])
def test_get_params_matches_torchvision_on_torchs_own_draws(height: int, width: int) -> None:
    """Driving our get_params with torch's global RNG reproduces torchvision's boxes.

    torchvision computes the bounds of the aspect-ratio draw in float32, we in float64, so a box
    may rarely differ by one pixel where a size lands on a rounding boundary.
    """
    ours = RandomResizedCrop(224)
    img = torch.zeros(3, height, width, dtype=torch.uint8)
    same = 0
    n = 500
    for seed in range(n):
        torch.manual_seed(seed)
        expected = T1.RandomResizedCrop.get_params(img, [0.08, 1.0], [3 / 4, 4 / 3])
        torch.manual_seed(seed)
        got = ours.get_params(height, width, TorchGlobalRNG())  # type: ignore[arg-type]
        same += got == expected
        assert max(abs(a - b) for a, b in zip(got, expected, strict=False)) <= 1
    assert same >= n - 2


def _ks(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sample Kolmogorov-Smirnov statistic."""
    grid = np.sort(np.concatenate([a, b]))
    ca = np.searchsorted(np.sort(a), grid, side="right") / len(a)
    cb = np.searchsorted(np.sort(b), grid, side="right") / len(b)
    return float(np.abs(ca - cb).max())


@pytest.mark.parametrize("height,width", [(375, 500), (120, 900)])
def test_crop_distribution_matches_torchvision(height: int, width: int) -> None:
    """Area fraction, aspect ratio and position of our boxes vs torchvision's (fixed seeds: deterministic)."""
    n = 3000
    ours = RandomResizedCrop(224)
    img = torch.zeros(1, height, width)
    torch.manual_seed(0)
    ref = np.array(
        [T1.RandomResizedCrop.get_params(img, [0.08, 1.0], [3 / 4, 4 / 3]) for _ in range(n)], dtype=float
    )
    got = np.array([ours.get_params(height, width, rng.SampleRNG(0, 0, i)) for i in range(n)], dtype=float)

    def features(b: np.ndarray) -> dict[str, np.ndarray]:
        top, left, h, w = b.T
        return {
            "area": h * w / (height * width),
            "log_aspect": np.log(w / h),
            "centre_y": (top + h / 2) / height,
            "centre_x": (left + w / 2) / width,
        }

    fo, fr = features(got), features(ref)
    crit = 1.95 * math.sqrt(2 / n)  # alpha = 0.001
    for key in fo:
        assert _ks(fo[key], fr[key]) < crit, key
    # The histograms agree bin by bin as well (10 bins, within 3 percentage points).
    for key in ("area", "log_aspect"):
        edges = np.histogram_bin_edges(np.concatenate([fo[key], fr[key]]), bins=10)
        ho = np.histogram(fo[key], edges)[0] / n
        hr = np.histogram(fr[key], edges)[0] / n
        assert np.abs(ho - hr).max() < 0.03, key


def test_flip_probability_and_one_draw_per_sample() -> None:
    flips = [RandomHorizontalFlip(0.3).get_params(10, 10, rng.SampleRNG(1, 2, i)) for i in range(4000)]
    assert abs(np.mean(flips) - 0.3) < 0.03
    for p in (0.0, 1.0):
        r = ReplayRNG(np.full(3, 0.5))
        RandomHorizontalFlip(p).get_params(10, 10, r)  # type: ignore[arg-type]
        assert r.calls == ["random"]  # drawn even when the outcome is certain
    assert not any(RandomHorizontalFlip(0.0).get_params(5, 5, rng.SampleRNG(0, 0, i)) for i in range(100))
    assert all(RandomHorizontalFlip(1.0).get_params(5, 5, rng.SampleRNG(0, 0, i)) for i in range(100))


def test_draws_happen_in_pipeline_order() -> None:
    pipe = Compose([RandomResizedCrop(224), RandomHorizontalFlip()])
    for index in range(50):
        plan = pipe.plan(375, 500, rng.SampleRNG(3, 1, index))
        r = rng.SampleRNG(3, 1, index)
        top, left, h, w = RandomResizedCrop(224).get_params(375, 500, r)
        flip = r.random() < 0.5
        expected = [("crop", top, left, h, w), ("resize", 224, 224, "bilinear", True)] + (
            [("hflip",)] if flip else []
        )
        if (h, w) == (224, 224):
            expected.remove(("resize", 224, 224, "bilinear", True))
        assert plan.ops == expected


def _image(h: int = 180, w: int = 240, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (3, h, w), generator=g, dtype=torch.uint8)


def test_tensor_call_equals_torchvision_functional_at_the_same_params() -> None:
    x = _image()
    pipe = Compose([RandomResizedCrop((96, 128)), RandomHorizontalFlip()])
    for index in range(20):
        with rng.sample_scope(7, 0, index):
            got = pipe(x)
        r = rng.SampleRNG(7, 0, index)
        top, left, h, w = RandomResizedCrop((96, 128)).get_params(180, 240, r)
        ref = F.resized_crop(x, top, left, h, w, [96, 128], antialias=True)
        if r.random() < 0.5:
            ref = F.horizontal_flip(ref)
        assert got.dtype == torch.uint8 and got.shape == (3, 96, 128)
        assert torch.equal(got, ref)


def test_val_pipeline_equals_torchvision_on_tensors() -> None:
    for h, w in [(180, 240), (300, 200), (100, 100), (50, 300)]:
        x = _image(h, w)
        ref = T2.Compose([T2.Resize(64, antialias=True), T2.CenterCrop(56)])(x)
        got = Compose([Resize(64), CenterCrop(56)])(x)
        assert torch.equal(got, ref)
    # Padding when the crop is larger than the image, as torchvision.
    x = _image(30, 40)
    assert torch.equal(CenterCrop((50, 45))(x), F.center_crop(x, [50, 45]))


def _torchvision_resizes_to_max_size() -> bool:
    try:
        T2.Resize(None, max_size=300)
    except (TypeError, ValueError):
        return False
    return True


@pytest.mark.parametrize(
    "size,max_size", [(256, None), ([256], None), ((100, 150), None), (256, 300), (None, 300), (7, None)]
)
@pytest.mark.parametrize("h,w", [(375, 500), (500, 375), (300, 300), (10, 1000)])
def test_resize_output_size_is_torchvisions(size, max_size, h: int, w: int) -> None:  # type: ignore[no-untyped-def]
    x = torch.zeros(1, h, w, dtype=torch.uint8)
    if size is None and not _torchvision_resizes_to_max_size():
        pytest.skip("this torchvision's Resize takes no size=None (torchvision 0.18 and later do)")
    expected = T2.Resize(size, max_size=max_size, antialias=True)(x).shape[-2:]
    got = Resize(size, max_size=max_size)(x).shape[-2:]
    assert got == expected
    norm = size[0] if isinstance(size, list) else size
    assert resized_output_size(h, w, norm, max_size) == tuple(expected)


def test_output_size() -> None:
    assert RandomResizedCrop(224).output_size == (224, 224)
    assert RandomResizedCrop((100, 120)).output_size == (100, 120)
    assert Resize(256).output_size is None
    assert Resize((256, 300)).output_size == (256, 300)
    assert CenterCrop(224).output_size == (224, 224)
    assert RandomHorizontalFlip().output_size is None
    assert Compose([Resize(256), CenterCrop(224)]).output_size == (224, 224)
    assert Compose([RandomResizedCrop(224), RandomHorizontalFlip()]).output_size == (224, 224)
    assert Compose([CenterCrop(224), Resize(256)]).output_size is None
    assert Compose(
        [Compose([Resize(256)]), Compose([CenterCrop(20), RandomHorizontalFlip()])]
    ).output_size == (20, 20)
    assert Compose([]).output_size is None


def test_determinism_same_scope_same_output_different_index_different_crop() -> None:
    x = _image(300, 400)
    pil = Image.fromarray(x.permute(1, 2, 0).numpy())
    pipe = Compose([RandomResizedCrop(64), RandomHorizontalFlip()])

    def run(index: int) -> tuple[torch.Tensor, torch.Tensor]:
        with rng.sample_scope(11, 4, index):
            a = pipe(x)
        with rng.sample_scope(11, 4, index):
            b = pipe(pil)
        return a, b

    a1, b1 = run(5)
    a2, b2 = run(5)
    assert torch.equal(a1, a2) and torch.equal(b1, b2)
    # The same sample in another thread (thread-local streams) gives the same result.
    result: dict[str, torch.Tensor] = {}
    th = threading.Thread(target=lambda: result.update(a=run(5)[0]))
    th.start()
    th.join()
    assert torch.equal(result["a"], a1)
    plans = {tuple(pipe.plan(300, 400, rng.SampleRNG(11, 4, i)).ops[0]) for i in range(20)}
    assert len(plans) == 20
    with rng.sample_scope(11, 4, 6):
        assert not torch.equal(pipe(x), a1)
    # Outside any scope: torch's global RNG seeds the stream.
    torch.manual_seed(3)
    c1 = pipe(x)
    torch.manual_seed(3)
    assert torch.equal(pipe(x), c1)


def test_pil_input_gives_uint8_chw_close_to_the_tensor_path() -> None:
    x = _image(200, 260)
    pil = Image.fromarray(x.permute(1, 2, 0).numpy())
    for pipe in (
        Compose([RandomResizedCrop(64), RandomHorizontalFlip()]),
        Compose([Resize(80), CenterCrop(64)]),
        CenterCrop(300),
    ):
        for index in range(5):
            with rng.sample_scope(0, 0, index):
                a = pipe(pil)
            with rng.sample_scope(0, 0, index):
                b = pipe(x)
            assert a.dtype == torch.uint8 and a.shape == b.shape
            assert (a.int() - b.int()).abs().float().mean() < 1.0
    gray = pil.convert("L")
    out = CenterCrop(100)(gray)
    assert out.shape == (3, 100, 100) and torch.equal(out[0], out[1]) and torch.equal(out[1], out[2])


def test_flip_before_crop_mirrors_the_crop() -> None:
    x = _image(120, 160)
    pil = Image.fromarray(x.permute(1, 2, 0).numpy())
    pipe = Compose([RandomHorizontalFlip(1.0), RandomResizedCrop(40), RandomHorizontalFlip(1.0)])
    for index in range(5):
        with rng.sample_scope(0, 0, index):
            a = pipe(x)
        with rng.sample_scope(0, 0, index):
            b = pipe(pil)
        assert (a.int() - b.int()).abs().float().mean() < 1.0


def test_other_interpolations_and_no_antialias_match_torchvision() -> None:
    x = _image(200, 260)
    for interp, tv in (("nearest", T2.InterpolationMode.NEAREST), ("bicubic", T2.InterpolationMode.BICUBIC)):
        assert torch.equal(
            Resize(50, interpolation=interp)(x), F.resize(x, 50, interpolation=tv, antialias=True)
        )
    assert torch.equal(Resize(50, antialias=False)(x), F.resize(x, 50, antialias=False))
    assert Resize(50, interpolation=T2.InterpolationMode.BICUBIC).interpolation == "bicubic"
    assert Resize(50, interpolation=Image.Resampling.NEAREST).interpolation == "nearest"


ALL = [
    RandomResizedCrop(224, scale=(0.2, 0.9), ratio=(0.5, 2.0), interpolation="bicubic"),
    Resize(256, max_size=400),
    Resize((32, 48)),
    CenterCrop((20, 30)),
    RandomHorizontalFlip(0.25),
    Compose([RandomResizedCrop(48), RandomHorizontalFlip()]),
    Compose([Resize(64), CenterCrop(56)]),
]


@pytest.mark.parametrize("t", ALL, ids=lambda t: type(t).__name__)
def test_pickle_round_trip(t) -> None:  # type: ignore[no-untyped-def]
    u = pickle.loads(pickle.dumps(t))
    assert type(u) is type(t) and repr(u) == repr(t) and u.output_size == t.output_size
    x = _image(100, 120)
    with rng.sample_scope(0, 1, 2):
        a = t(x)
    with rng.sample_scope(0, 1, 2):
        b = u(x)
    assert torch.equal(a, b)


@pytest.mark.parametrize(
    "make,exc,word",
    [
        (lambda: RandomResizedCrop(0), ValueError, "size"),
        (lambda: RandomResizedCrop(-3), ValueError, "size"),
        (lambda: RandomResizedCrop((1, 2, 3)), TypeError, "size"),
        (lambda: RandomResizedCrop("224"), TypeError, "size"),  # type: ignore[arg-type]
        (lambda: RandomResizedCrop(True), TypeError, "size"),
        (lambda: RandomResizedCrop(224, scale=(1, 0.5)), ValueError, "scale"),
        (lambda: RandomResizedCrop(224, scale=(0, 1)), ValueError, "scale"),
        (lambda: RandomResizedCrop(224, scale=0.5), TypeError, "scale"),  # type: ignore[arg-type]
        (lambda: RandomResizedCrop(224, ratio=(2, 1)), ValueError, "ratio"),
        (lambda: RandomResizedCrop(224, ratio=(1, float("nan"))), TypeError, "ratio"),
        (lambda: RandomResizedCrop(224, interpolation="lanczos"), ValueError, "interpolation"),
        (lambda: RandomResizedCrop(224, antialias="yes"), TypeError, "antialias"),  # type: ignore[arg-type]
        (lambda: Resize(0), ValueError, "size"),
        (lambda: Resize(None), ValueError, "size"),
        (lambda: Resize((10, 20), max_size=50), ValueError, "max_size"),
        (lambda: Resize(256, max_size=256), ValueError, "max_size"),
        (lambda: Resize(256, max_size=0), ValueError, "max_size"),
        (lambda: CenterCrop((0, 4)), ValueError, "size"),
        (lambda: RandomHorizontalFlip(p=2), ValueError, "p"),
        (lambda: RandomHorizontalFlip(p=-0.1), ValueError, "p"),
        (lambda: RandomHorizontalFlip(p="0.5"), ValueError, "p"),  # type: ignore[arg-type]
        (lambda: Compose([RandomResizedCrop(224), lambda im: im]), TypeError, "transforms"),  # type: ignore[list-item]
        (lambda: Compose(RandomResizedCrop(224)), TypeError, "transforms"),  # type: ignore[arg-type]
    ],
)
def test_bad_arguments_name_the_argument(make, exc, word) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(exc, match=rf"\b{word}\b"):
        make()


def test_bad_inputs() -> None:
    with pytest.raises(TypeError, match="img should be a torch.Tensor or a PIL Image"):
        RandomResizedCrop(8)(np.zeros((10, 10, 3), np.uint8))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="shape"):
        RandomResizedCrop(8)(torch.zeros(5))
    assert "size should be a positive integer, but got size=0" in str(
        pytest.raises(ValueError, RandomResizedCrop, 0).value
    )
    assert "p should be a probability between 0 and 1, but got p=2" in str(
        pytest.raises(ValueError, RandomHorizontalFlip, 2).value
    )
