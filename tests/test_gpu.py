"""Batched device transforms (fastload.gpu) against torchvision.transforms.v2.functional per sample."""

from __future__ import annotations

import itertools
import math
import pickle
import re
from typing import Any

import numpy as np
import pytest
import torch
import torchvision.transforms.v2.functional as tvf
from _nosimd import run_without_simd

import fastload.decode
from fastload import gpu, rng
from fastload.batch import IndexedBatch
from fastload.gpu import PackedImages, Resize, crop_resize
from fastload.gpu import normalize as gpu_normalize

cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _tv_resize(image: torch.Tensor, size: Any, **kwargs: Any) -> torch.Tensor:
    """torchvision's resize, antialiased as from torchvision 0.17 on (0.16 did not on tensors)."""
    kwargs.setdefault("antialias", True)
    return tvf.resize(image, size, **kwargs)


def _tv_resized_crop(image: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    kwargs.setdefault("antialias", True)
    return tvf.resized_crop(image, *args, **kwargs)


def natural(h: int, w: int, seed: int, channels: int = 3) -> torch.Tensor:
    """A uint8 CHW image with smooth structure plus noise (closer to photos than pure noise)."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.randint(0, 256, (channels, h // 8 + 2, w // 8 + 2), generator=g, dtype=torch.uint8)
    smooth = _tv_resize(coarse, [h, w], antialias=True).to(torch.int16)
    noise = torch.randint(-12, 13, (channels, h, w), generator=g, dtype=torch.int16)
    return (smooth + noise).clamp(0, 255).to(torch.uint8)


def batch(n: int, h: int, w: int, seed: int = 0) -> torch.Tensor:
    return torch.stack([natural(h, w, seed + k) for k in range(n)])


def level_diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.to(torch.int32) - b.to(torch.int32)).abs()


# ---------------------------------------------------------------------------------------------
# IndexedBatch
# ---------------------------------------------------------------------------------------------


def test_indexed_batch_unpacks_as_pair_and_pickles_with_indices():
    images = torch.zeros(2, 3, 4, 4, dtype=torch.uint8)
    b = IndexedBatch(images, torch.tensor([1, 2]), torch.tensor([10, 11]))
    x, y = b
    assert x is images and y.tolist() == [1, 2] and len(b) == 2
    assert b.images is images and b.labels.tolist() == [1, 2]
    back = pickle.loads(pickle.dumps(b))
    assert isinstance(back, IndexedBatch)
    assert back.indices.tolist() == [10, 11] and torch.equal(back[0], images)


@cuda
@needs_cuda
def test_indexed_batch_survives_torch_pin_memory():
    from torch.utils.data._utils.pin_memory import pin_memory

    b = IndexedBatch(torch.zeros(2, 3, 4, 4, dtype=torch.uint8), torch.tensor([1, 2]), torch.tensor([5, 6]))
    pinned = pin_memory(b)
    assert isinstance(pinned, IndexedBatch) and pinned[0].is_pinned() and pinned.indices.tolist() == [5, 6]


# ---------------------------------------------------------------------------------------------
# RandomResizedCrop
# ---------------------------------------------------------------------------------------------


def reference_rrc_params(height, width, u, scale, ratio):
    """torchvision's RandomResizedCrop.get_params, one image, fed uniforms instead of torch's RNG."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for attempt in range(10):
        target_area = area * (scale[0] + (scale[1] - scale[0]) * u[attempt])
        aspect_ratio = math.exp(log_ratio[0] + (log_ratio[1] - log_ratio[0]) * u[10 + attempt])
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            i = min(int(u[20 + attempt] * (height - h + 1)), height - h)
            j = min(int(u[30 + attempt] * (width - w + 1)), width - w)
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
    return (height - h) // 2, (width - w) // 2, h, w


@pytest.mark.parametrize(
    "sizes, scale, ratio",
    [
        ([(300, 400), (500, 375), (224, 224), (64, 900)], (0.08, 1.0), (3 / 4, 4 / 3)),
        ([(40, 600), (600, 40), (100, 100)], (0.5, 1.0), (0.9, 1.1)),  # mostly the fallback
        ([(50, 80)], (1.0, 1.0), (1.0, 1.0)),
    ],
)
def test_rrc_params_follow_torchvision_algorithm(sizes, scale, ratio):
    t = gpu.RandomResizedCrop(32, scale=scale, ratio=ratio)
    images = [torch.zeros(3, h, w, dtype=torch.uint8) for h, w in sizes] * 25
    indices = np.arange(len(images)) * 7 + 3
    top, left, h, w = t.get_params(images, indices=indices, epoch=2, seed=5)
    u = rng.batch_uniform(5, 2, indices, gpu.RandomResizedCrop.stream, 40)
    fallbacks = 0
    for r, img in enumerate(images):
        expected = reference_rrc_params(img.shape[1], img.shape[2], u[r], scale, ratio)
        assert (top[r], left[r], h[r], w[r]) == expected
        central = (expected[0], expected[1]) == (
            (img.shape[1] - expected[2]) // 2,
            (img.shape[2] - expected[3]) // 2,
        )
        fallbacks += central
        assert (
            0 <= top[r] and top[r] + h[r] <= img.shape[1] and 0 <= left[r] and left[r] + w[r] <= img.shape[2]
        )
    assert fallbacks > 0 or scale == (0.08, 1.0)


@pytest.mark.parametrize(
    "shape, size, scale",
    [
        ((8, 3, 300, 260), 224, (0.08, 1.0)),  # typical: mild down- and upscales
        ((6, 3, 480, 400), 64, (0.5, 1.0)),  # strong downscale: antialiasing matters
        ((6, 3, 120, 100), (160, 200), (0.02, 0.1)),  # strong upscale, non-square output
    ],
)
def test_rrc_matches_torchvision_resized_crop_per_sample(shape, size, scale):
    images = batch(*shape)
    t = gpu.RandomResizedCrop(size, scale=scale)
    indices = np.arange(shape[0]) + 100
    out = t(images, indices=indices, epoch=1, seed=3)
    out_size = list(t.size)
    assert out.shape == (shape[0], 3, *out_size) and out.dtype == torch.uint8
    top, left, h, w = t.get_params(images, indices=indices, epoch=1, seed=3)
    boxes = [(int(top[r]), int(left[r]), int(h[r]), int(w[r])) for r in range(shape[0])]
    # torchvision on CPU uint8 (16-bit fixed-point weights, rounds between passes)
    ref = torch.stack(
        [_tv_resized_crop(images[r], *boxes[r], out_size, antialias=True) for r in range(shape[0])]
    )
    d = level_diff(out, ref)
    assert d.max() <= 1 and d.float().mean() < 0.3
    # torchvision in float (what it does on GPU), rounded: agrees except for ties
    ref_f = torch.stack(
        [_tv_resized_crop(images[r].float(), *boxes[r], out_size, antialias=True) for r in range(shape[0])]
    )
    d_f = level_diff(out, ref_f.round().clamp(0, 255))
    assert d_f.max() <= 1 and d_f.float().mean() < 1e-2


def test_rrc_without_antialias_matches_plain_bilinear():
    images = batch(4, 400, 300)
    t = gpu.RandomResizedCrop(48, scale=(0.6, 1.0), antialias=False)
    out = t(images, indices=[0, 1, 2, 3])
    top, left, h, w = t.get_params(images, indices=[0, 1, 2, 3])
    ref = torch.stack(
        [
            _tv_resized_crop(
                images[r].float(), int(top[r]), int(left[r]), int(h[r]), int(w[r]), [48, 48], antialias=False
            )
            for r in range(4)
        ]
    )
    d = level_diff(out, ref.round())
    assert d.max() <= 1 and d.float().mean() < 1e-2


def test_rrc_float_input_stays_float_and_matches():
    images = batch(3, 200, 150).float() / 255
    t = gpu.RandomResizedCrop(40)
    out = t(images, indices=[5, 6, 7])
    top, left, h, w = t.get_params(images, indices=[5, 6, 7])
    ref = torch.stack(
        [
            _tv_resized_crop(images[r], int(top[r]), int(left[r]), int(h[r]), int(w[r]), [40, 40])
            for r in range(3)
        ]
    )
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_same_sample_same_output_whatever_the_batch():
    # Sample 7 alongside very different neighbours (changes the batch's padded region and tap count).
    pool = {
        k: natural(*hw, seed=k) for k, hw in enumerate([(300, 260)] * 6 + [(333, 250), (900, 880), (60, 70)])
    }
    t = gpu.Compose([gpu.RandomResizedCrop(96), gpu.RandomHorizontalFlip()])

    def run(keys):
        return t([pool[k] for k in keys], indices=keys, epoch=4, seed=11)

    alone = run([7])[0]
    for keys in ([7, 0, 1], [2, 7], [8, 7, 6, 5], [0, 1, 2, 3, 4, 5, 6, 7, 8]):
        assert torch.equal(run(keys)[keys.index(7)], alone)
    # and in a tensor batch of equal-size images
    tensor = torch.stack([pool[k] for k in range(6)])
    full = t(tensor, indices=list(range(6)), epoch=4, seed=11)
    part = t(tensor[[4, 1]], indices=[4, 1], epoch=4, seed=11)
    assert torch.equal(full[4], part[0]) and torch.equal(full[1], part[1])


def test_one_huge_image_does_not_pad_the_whole_batch():
    from fastload.gpu.resample import _group_by_extent

    span_y = np.array([300] * 63 + [3000])
    span_x = np.array([300] * 63 + [4000])
    groups = _group_by_extent(span_y, span_x, rows_out=224)
    assert sorted(np.concatenate(groups).tolist()) == list(range(64))
    area = (span_y + 224) * span_x
    # padding each group's regions and vertical pass to its widest: at most half more in all
    assert sum((span_y[g] + 224).sum() * span_x[g].max() for g in groups) <= 1.5 * area.sum()
    assert len(groups) == 2  # not 64 regions 4000 wide
    assert 63 in groups[0] and len(groups[0]) < 8  # the huge one takes a few small ones
    # small crops (16x16, resized to 224 rows) do not join a huge one's group by the hundred
    tiny_y, tiny_x = np.array([3000] + [16] * 255), np.array([4000] + [16] * 255)
    assert len(_group_by_extent(tiny_y, tiny_x, rows_out=224)[0]) < 8
    # RandomResizedCrop-like spread of crop sizes on equal images: a single group
    rs = np.random.RandomState(0)
    sizes = (np.sqrt(rs.uniform(0.08, 1.0, 64)) * 300).astype(int)
    assert len(_group_by_extent(sizes, sizes)) == 1
    # any heights, and widths within a factor of 1.5 of each other: a single group
    assert len(_group_by_extent(rs.randint(1, 4000, 64), rs.randint(200, 301, 64))) == 1


def _fewest_groups_by_search(
    span_y: np.ndarray, span_x: np.ndarray, waste: float, rows_out: int
) -> tuple[int, float]:
    """The grouping rule by trying every split (the reference for the dynamic programming): the
    fewest runs of the images sorted widest first whose padded cost is at most ``waste`` times
    their own, and the least cost of such a split."""
    rows = (span_y + rows_out).astype(np.float64)
    order = np.argsort(-span_x, kind="stable")
    ys, xs = rows[order], span_x[order].astype(np.float64)
    n, own = len(ys), float((ys * xs).sum())
    best: dict[int, float] = {}
    for cuts in itertools.product([False, True], repeat=n - 1):
        starts = [0] + [k + 1 for k, cut in enumerate(cuts) if cut]
        ends = starts[1:] + [n]
        cost = sum(xs[a] * ys[a:b].sum() for a, b in zip(starts, ends, strict=True))
        best[len(starts)] = min(best.get(len(starts), math.inf), cost)
    count = min(k for k, cost in best.items() if cost <= waste * own)
    return count, best[count]


def test_grouping_by_extent_is_the_fewest_groups_of_bounded_padding(monkeypatch: pytest.MonkeyPatch) -> None:
    """The groups are the fewest runs of the regions sorted widest first whose padding to each
    run's widest costs at most 1.5 times their own in all, the cheapest such split (every split
    tried, on small batches); the C extension and numpy give the same groups on any batch."""
    from fastload.gpu import resample as gt

    rs = np.random.RandomState(1)
    seen = set()
    for trial in range(300):
        n = int(rs.randint(1, 11)) if trial < 150 else int(rs.randint(1, 300))
        high = [20, 500, 4000][trial % 3]
        span_y, span_x = rs.randint(1, high, n), rs.randint(1, high, n)
        if trial % 2:  # widths spread over orders of magnitude: several groups
            span_x = np.exp(rs.uniform(0, np.log(high), n)).astype(np.int64) + 1
        rows_out = [0, 8, 224][trial % 3]
        made = []
        for c in (True, False) if gt._c_resample is not None else (False,):
            monkeypatch.setattr(gt, "USE_C_TAPS", c)
            made.append([g.tolist() for g in gt._group_by_extent(span_y, span_x, rows_out=rows_out)])
        assert all(m == made[0] for m in made), trial
        groups = made[0]
        assert sorted(i for g in groups for i in g) == list(range(n))
        rows = span_y + rows_out
        cost = sum(float(rows[g].sum() * span_x[g].max()) for g in groups)
        if n <= 10:
            assert (len(groups), cost) == _fewest_groups_by_search(span_y, span_x, 1.5, rows_out), trial
        assert cost <= 1.5 * float((rows * span_x).sum())
        seen.add(len(groups))
    assert len(seen) > 3  # one group, and several


def test_epoch_and_seed_change_the_draws():
    images = batch(16, 100, 100)
    t = gpu.RandomResizedCrop(32)
    base = t.get_params(images, indices=range(16), epoch=0, seed=0)
    for kwargs in ({"epoch": 1, "seed": 0}, {"epoch": 0, "seed": 1}):
        other = t.get_params(images, indices=range(16), **kwargs)
        assert not all(np.array_equal(a, b) for a, b in zip(base, other, strict=False))


def test_without_indices_draws_from_torch_global_rng():
    images = batch(6, 120, 100)
    t = gpu.Compose([gpu.RandomResizedCrop(32), gpu.RandomHorizontalFlip()])
    torch.manual_seed(123)
    a = t(images)
    torch.manual_seed(123)
    b = t(images)
    c = t(images)
    assert torch.equal(a, b) and not torch.equal(b, c)


def test_rrc_on_a_list_of_different_sizes():
    images = [natural(300, 400, 1), natural(500, 260, 2), natural(90, 120, 3), natural(1000, 700, 4)]
    t = gpu.RandomResizedCrop(112)
    out = t(images, indices=[0, 1, 2, 3])
    top, left, h, w = t.get_params(images, indices=[0, 1, 2, 3])
    ref = torch.stack(
        [
            _tv_resized_crop(images[r], int(top[r]), int(left[r]), int(h[r]), int(w[r]), [112, 112])
            for r in range(4)
        ]
    )
    d = level_diff(out, ref)
    assert out.shape == (4, 3, 112, 112) and d.max() <= 1 and d.float().mean() < 0.3


# ---------------------------------------------------------------------------------------------
# Resize, CenterCrop, flips, fusion
# ---------------------------------------------------------------------------------------------


def test_resize_of_a_tensor_batch_equals_torchvision():
    images = batch(3, 120, 90)
    for size in (64, (50, 70), 200):
        assert torch.equal(
            gpu.Resize(size)(images), _tv_resize(images, size if isinstance(size, int) else list(size))
        )
    assert torch.equal(gpu.Resize(64, max_size=70)(images), _tv_resize(images, 64, max_size=70))


def test_eval_pipeline_on_a_tensor_batch_equals_torchvision_exactly():
    images = batch(3, 300, 260)
    pipelines = [
        (
            gpu.Compose([gpu.Resize(256), gpu.CenterCrop(224)]),
            lambda x: tvf.center_crop(_tv_resize(x, 256), 224),
        ),
        (
            gpu.Compose([gpu.CenterCrop(200), gpu.Resize(100)]),
            lambda x: _tv_resize(tvf.center_crop(x, 200), 100),
        ),
    ]
    for ours, theirs in pipelines:
        assert torch.equal(ours(images), theirs(images))


@pytest.mark.parametrize("hw", [(100, 100), (99, 160), (160, 99), (37, 301), (300, 12)])
def test_resize_output_sizes_follow_torchvision(hw):
    t = gpu.Resize(64)
    h, w = t.output_sizes(np.array([hw[0]]), np.array([hw[1]]))
    expected = _tv_resize(torch.zeros(1, *hw), 64).shape[-2:]
    assert (int(h[0]), int(w[0])) == tuple(expected)
    t = gpu.Resize(64, max_size=100)
    h, w = t.output_sizes(np.array([hw[0]]), np.array([hw[1]]))
    assert (int(h[0]), int(w[0])) == tuple(_tv_resize(torch.zeros(1, *hw), 64, max_size=100).shape[-2:])


def test_resize_then_center_crop_is_fused_for_lists_of_different_aspect_ratios():
    images = [natural(300, 400, 1), natural(500, 260, 2), natural(130, 120, 3), natural(700, 1000, 4)]
    with pytest.raises(ValueError, match="one output size"):
        gpu.Resize(256)(images)
    out = gpu.Compose([gpu.Resize(256), gpu.CenterCrop(224)])(images)
    ref = torch.stack([tvf.center_crop(_tv_resize(img, 256), 224) for img in images])
    d = level_diff(out, ref)
    assert out.shape == (4, 3, 224, 224) and d.max() <= 1 and d.float().mean() < 0.3


def test_center_crop_is_exact_including_zero_padding():
    images = batch(3, 100, 120)
    for size in (50, (51, 80), (130, 101), (140, 150)):
        ref = torch.stack(
            [tvf.center_crop(img, list(size) if isinstance(size, tuple) else size) for img in images]
        )
        assert torch.equal(gpu.CenterCrop(size)(images), ref)
        assert torch.equal(gpu.CenterCrop(size)(list(images)), ref)


def test_padding_crop_then_resize_resamples_the_zeros_like_torchvision():
    images = batch(2, 100, 120)
    t = gpu.Compose([gpu.CenterCrop((130, 101)), gpu.Resize((64, 50))])
    ref = torch.stack([_tv_resize(tvf.center_crop(img, [130, 101]), [64, 50]) for img in images])
    for inp in (images, list(images)):
        d = level_diff(t(inp), ref)
        assert d.max() <= 1 and d.float().mean() < 0.3


def test_horizontal_flip_per_sample_is_exact():
    images = batch(32, 20, 30)
    t = gpu.RandomHorizontalFlip(p=0.5)
    flips = t.get_params(images, indices=range(32), epoch=3)
    assert 0 < flips.sum() < 32
    ref = torch.stack([tvf.horizontal_flip(img) if f else img for img, f in zip(images, flips, strict=False)])
    assert torch.equal(t(images, indices=range(32), epoch=3), ref)
    assert torch.equal(gpu.RandomHorizontalFlip(p=0.0)(images), images)
    assert torch.equal(gpu.RandomHorizontalFlip(p=1.0)(images), images.flip(-1))


def test_fused_compose_equals_transforms_applied_one_by_one():
    images = [natural(300, 400, 1), natural(500, 260, 2), natural(130, 120, 3)]
    kw = {"indices": [3, 4, 5], "epoch": 1, "seed": 2}
    steps = [
        gpu.RandomHorizontalFlip(),
        gpu.RandomResizedCrop(100),
        gpu.RandomHorizontalFlip(),
        gpu.CenterCrop(80),
    ]
    fused = gpu.Compose(steps)(images, **kw)
    flips = steps[0].get_params(images, **kw)  # a lone flip cannot batch a list of different sizes
    one_by_one = [tvf.horizontal_flip(img) if f else img for img, f in zip(images, flips, strict=False)]
    for s in steps[1:]:
        one_by_one = s(one_by_one, **kw)
    # the first flip acts before the resample, on different pixels: allow the same 1-level slack
    assert level_diff(fused, one_by_one).max() <= 1
    # flip and crop after the resample are exact
    rrc = gpu.RandomResizedCrop(100)
    after = gpu.CenterCrop(80)(gpu.RandomHorizontalFlip()(rrc(images, **kw), **kw))
    assert torch.equal(
        gpu.Compose([rrc, gpu.RandomHorizontalFlip(), gpu.CenterCrop(80)])(images, **kw), after
    )


def test_compose_runs_other_callables_with_images_only():
    images = batch(2, 40, 40)
    seen = []
    out = gpu.Compose([gpu.CenterCrop(20), lambda x: seen.append(x.shape) or x + 1])(images, indices=[0, 1])
    assert seen == [torch.Size([2, 3, 20, 20])] and torch.equal(out, tvf.center_crop(images, 20) + 1)


def test_empty_batches_keep_their_output_shape():
    empty = torch.zeros(0, 3, 50, 60, dtype=torch.uint8)
    pipeline = gpu.Compose([gpu.Resize(30), gpu.CenterCrop(20), gpu.Normalize([0.5], [0.5])])
    assert pipeline(empty, indices=[]).shape == (0, 3, 20, 20)
    assert gpu.RandomResizedCrop(24)(empty, indices=[]).shape == (0, 3, 24, 24)


# ---------------------------------------------------------------------------------------------
# ColorJitter, RandomErasing, Normalize
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
def test_color_jitter_is_bit_identical_to_torchvision_per_sample(dtype):
    images = batch(24, 30, 40)
    if dtype.is_floating_point:
        images = images.to(dtype) / 255
    t = gpu.ColorJitter(brightness=0.4, contrast=0.4, saturation=(0.5, 1.5))
    p = t.get_params(images, indices=range(24), seed=9)
    assert len({tuple(o) for o in p["order"]}) > 1  # several orders in one batch
    ops = {0: tvf.adjust_brightness, 1: tvf.adjust_contrast, 2: tvf.adjust_saturation}
    names = ("brightness", "contrast", "saturation")
    refs = []
    for r, img in enumerate(images):
        for op in p["order"][r]:
            img = ops[op](img, float(p[names[op]][r]))
        refs.append(img)
    assert torch.equal(t(images, indices=range(24), seed=9), torch.stack(refs))


def test_color_jitter_disabled_factors_are_none():
    t = gpu.ColorJitter(brightness=0.2)
    p = t.get_params(batch(2, 8, 8), indices=[0, 1])
    assert p["contrast"] is None and p["saturation"] is None
    assert np.all((p["brightness"] >= 0.8) & (p["brightness"] <= 1.2))


def test_random_erasing_is_exact():
    images = batch(32, 40, 50)
    t = gpu.RandomErasing(p=0.6, value=(10, 20, 30))
    erase, top, left, h, w = t.get_params(images, indices=range(32))
    assert 0 < erase.sum() < 32
    fill = torch.tensor([10.0, 20.0, 30.0])[:, None, None]
    ref = torch.stack(
        [
            tvf.erase(img, int(top[r]), int(left[r]), int(h[r]), int(w[r]), fill) if erase[r] else img
            for r, img in enumerate(images)
        ]
    )
    assert torch.equal(t(images, indices=range(32)), ref)
    assert np.all((h[erase] < 40) & (w[erase] < 50) & (h[erase] > 0))


MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def test_normalize_is_bit_identical_to_torchvision():
    images = batch(4, 16, 16)
    ref = tvf.normalize(tvf.to_dtype(images, torch.float32, scale=True), MEAN, STD)
    assert torch.equal(gpu.Normalize(MEAN, STD)(images), ref)
    floats = images.float() / 255
    assert torch.equal(gpu.Normalize(MEAN, STD)(floats), tvf.normalize(floats, MEAN, STD))
    # large images (32K values or more) are normalised one at a time on the CPU: the same bits
    large = batch(3, 112, 112)
    assert large[0].numel() >= 1 << 15
    ref = tvf.normalize(tvf.to_dtype(large, torch.float32, scale=True), MEAN, STD)
    assert torch.equal(gpu.Normalize(MEAN, STD)(large), ref)


@pytest.mark.parametrize("mean, std", [(MEAN, STD), ([0.5], [0.25])], ids=["per-channel", "one value"])
def test_normalize_of_fast_path_batches_is_bit_identical_with_and_without_the_table(
    mean: list[float], std: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fast path's batches (uint8, channels-last, on the CPU) are converted by a table lookup in
    the C extension when it is built, else by torch's passes: torchvision's bits either way."""
    images = batch(5, 19, 23).contiguous(memory_format=torch.channels_last)
    ref = tvf.normalize(tvf.to_dtype(images, torch.float32, scale=True), mean, std)
    calls: list[bool] = []
    real = gpu_normalize.to_chw_by_table

    def counted(*args: object) -> bool:
        calls.append(real(*args))  # type: ignore[arg-type]
        return calls[-1]

    monkeypatch.setattr(gpu_normalize, "to_chw_by_table", counted)
    out = gpu.Normalize(mean, std)(images)
    assert torch.equal(out, ref) and out.is_contiguous()
    assert calls == ([True] * 5 if fastload.decode._jpeg is not None else [False])  # one per image
    monkeypatch.setattr(gpu_normalize, "to_chw_by_table", lambda *args: False)  # as without the C extension
    assert torch.equal(gpu.Normalize(mean, std)(images), ref)
    calls.clear()
    monkeypatch.setattr(gpu_normalize, "to_chw_by_table", counted)
    assert torch.equal(gpu.Normalize(mean, std)(images.contiguous()), ref)  # NCHW input: torch's passes
    assert calls == []


@pytest.mark.skipif(fastload.decode._jpeg is None, reason="needs the C extension")
def test_normalize_computes_with_simd_only_where_that_gives_the_tables_bits() -> None:
    """With AVX2 the C extension computes most pixels as (x * k - mean) / std instead of looking them
    up: used only when that arithmetic reproduces the table on all 256 values of each channel."""
    norm = gpu.Normalize(MEAN, STD)
    lut = norm._table()
    simd = fastload.decode._jpeg.simd()  # False: no constants, only the lookups run
    assert (norm._affine is not None) == simd  # the arithmetic gives torchvision's bits for these constants
    images = batch(3, 37, 41).contiguous(memory_format=torch.channels_last)  # 1517 px: blocks + a tail
    ref = tvf.normalize(tvf.to_dtype(images, torch.float32, scale=True), MEAN, STD)
    assert torch.equal(norm(images), ref)
    if simd:  # a table the arithmetic does not give (one value one ulp off): the lookups only
        other = lut.copy()
        other[1, 77] = np.nextafter(other[1, 77], np.float32(np.inf))
        assert fastload.decode.affine_for_table(other, 1 / 255, False, MEAN, STD) is None
        assert fastload.decode.affine_for_table(lut, 255.0, True, MEAN, STD) is None  # x / 255 differs
        assert fastload.decode.affine_for_table(lut, 1 / 255, False, MEAN, STD) is not None
        wrong = norm._affine.copy()
        wrong[0] = np.float32(1 / 256)  # wrong constants: the arithmetic's values, not the table's
        src = images[0].permute(1, 2, 0).numpy()
        got = np.empty((3, 37, 41), dtype=np.float32)
        fastload.decode.to_chw_by_table(np.ascontiguousarray(src), got, lut, wrong)
        assert not np.array_equal(got, ref[0].numpy())  # the arithmetic really ran


@pytest.mark.skipif(fastload.decode._jpeg is None, reason="needs the C extension")
def test_affine_constants_are_only_given_where_the_simd_kernel_checked_them() -> None:
    """Without the AVX2 kernel (FASTLOAD_NO_SIMD, read once per process) the check would compare the
    table's lookups with themselves: no constants then, for any table (a process that runs the
    kernel must never get constants checked by one that does not, e.g. a pickled Normalize)."""
    code = (
        "import numpy as np, fastload.decode as d\n"
        "from fastload import gpu\n"
        "assert not d._jpeg.simd()\n"
        "mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]\n"
        "norm = gpu.Normalize(mean, std)\n"
        "lut = norm._table()\n"
        "assert norm._affine is None, 'constants without the kernel'\n"
        "other = lut.copy()\n"
        "other[1, 77] = np.nextafter(other[1, 77], np.float32(np.inf))\n"
        "assert d.affine_for_table(other, 1 / 255, False, mean, std) is None, 'unchecked constants'\n"
    )
    run_without_simd(code, timeout=120)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_normalize_half_outputs_are_the_float32_result_cast_once(dtype):
    images = batch(2, 16, 16)
    out = gpu.Normalize(MEAN, STD, dtype=dtype, channels_last=True)(images)
    ref = tvf.normalize(tvf.to_dtype(images, torch.float32, scale=True), MEAN, STD).to(dtype)
    assert out.dtype == dtype and out.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(out, ref)


def test_normalize_buffers_are_reused_round_robin():
    images = batch(2, 16, 16)
    fresh = gpu.Normalize(MEAN, STD)
    first, second = fresh(images), fresh(images)  # both alive: default outputs never share memory
    assert first.data_ptr() != second.data_ptr()
    t = gpu.Normalize(MEAN, STD, buffers=2)
    a, b, c = t(images), t(images[[1, 0]]), t(images)
    assert a.data_ptr() == c.data_ptr() != b.data_ptr()
    assert torch.equal(b, gpu.Normalize(MEAN, STD)(images[[1, 0]]))
    d = t(batch(3, 16, 16))  # new shape: new ring
    assert d.shape[0] == 3 and d.data_ptr() not in (a.data_ptr(), b.data_ptr())


# ---------------------------------------------------------------------------------------------
# Argument checking
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: gpu.RandomResizedCrop(0), ValueError, "size should be positive, but got size=0"),
        (lambda: gpu.RandomResizedCrop("a"), TypeError, "size should be an int"),
        (lambda: gpu.RandomResizedCrop(8, scale=(0.9, 0.1)), ValueError, "scale should be"),
        (lambda: gpu.RandomResizedCrop(8, interpolation="nearest"), ValueError, "bilinear"),
        (lambda: gpu.RandomHorizontalFlip(p=1.5), ValueError, "p=1.5"),
        (lambda: gpu.ColorJitter(brightness=-1), ValueError, "brightness=-1"),
        (lambda: gpu.RandomErasing(value="random"), TypeError, "value="),
        (lambda: gpu.RandomErasing(scale=(0.1, 2.0)), ValueError, "scale"),
        (lambda: gpu.Normalize([0.5], [0.0]), ValueError, "std should be non-zero"),
        (lambda: gpu.Normalize([0.5], [0.5], dtype=torch.int32), TypeError, "dtype"),
        (lambda: gpu.Normalize([0.5], [0.5], buffers=-1), ValueError, "buffers=-1"),
        (lambda: gpu.Resize((4, 5), max_size=10), ValueError, "max_size"),
    ],
)
def test_bad_arguments_are_rejected(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_bad_inputs_are_rejected():
    images = batch(2, 16, 16)
    with pytest.raises(ValueError, match="one dataset index per image"):
        gpu.RandomResizedCrop(8)(images, indices=[1, 2, 3])
    with pytest.raises(TypeError, match="Normalize needs an"):
        gpu.Normalize([0.5], [0.5])([images[0], images[1]])
    with pytest.raises(ValueError, match=r"\(N, C, H, W\)"):
        gpu.CenterCrop(4)(images[0])
    with pytest.raises(ValueError, match="share channels"):
        gpu.CenterCrop(4)([images[0], images[1][:1]])
    with pytest.raises(ValueError, match="mean should have 1 or 3"):
        gpu.Normalize([0.5, 0.5], [0.5])(images)


# ---------------------------------------------------------------------------------------------
# CUDA: same results as on the CPU
# ---------------------------------------------------------------------------------------------


@cuda
@needs_cuda
def test_cuda_results_match_cpu():
    images = [natural(300, 400, 1), natural(500, 260, 2), natural(130, 120, 3)]
    t = gpu.Compose([gpu.RandomResizedCrop(96), gpu.RandomHorizontalFlip()])
    kw = {"indices": [0, 1, 2], "epoch": 1, "seed": 4}
    cpu = t(images, **kw)
    dev = t([img.cuda() for img in images], **kw)
    assert dev.device.type == "cuda" and level_diff(dev.cpu(), cpu).max() <= 1
    jitter = gpu.ColorJitter(0.3, 0.3, 0.3)
    assert level_diff(jitter(cpu.cuda(), **kw).cpu(), jitter(cpu, **kw)).max() <= 1
    erase = gpu.RandomErasing(p=1.0, value=3)
    assert torch.equal(erase(cpu.cuda(), **kw).cpu(), erase(cpu, **kw))
    n = gpu.Normalize(MEAN, STD)
    torch.testing.assert_close(n(cpu.cuda()).cpu(), n(cpu))


# --------------------------------------------------------------------------------------------
# HostBufferPool: recycled CPU outputs that are never aliased


@pytest.mark.parametrize("keep", ["view", "detach", "numpy", "reshape", "storage", "saved-for-backward"])
def test_host_pool_never_hands_out_memory_that_is_still_referenced(keep: str) -> None:
    pool = gpu.HostBufferPool(max_idle=2)
    a = pool.empty((4, 3, 8, 8), torch.float32)
    ptr = a.data_ptr()
    a.fill_(1.0)
    if keep == "view":
        held = a[1:]
    elif keep == "detach":
        held = a.detach()
    elif keep == "numpy":
        held = a.numpy()
    elif keep == "reshape":
        held = a.reshape(-1)
    elif keep == "storage":
        held = a.untyped_storage()
    else:  # autograd keeps the input of a multiplication for the backward pass
        w = torch.ones(1, requires_grad=True)
        held = (a * w).sum()
    del a
    b = pool.empty((4, 3, 8, 8), torch.float32)
    assert b.data_ptr() != ptr  # still referenced through `held`: a new buffer
    b.fill_(7.0)
    if keep == "saved-for-backward":
        held.backward()
        assert float(w.grad) == 4 * 3 * 8 * 8  # computed from the kept ones, not the 7s
    elif keep == "storage":
        assert torch.empty(0).set_(held).view(-1)[:10].eq(1.0).all()
    else:
        assert np.all(np.asarray(held) == 1.0)
    del held
    if keep == "saved-for-backward":
        del w
    c = pool.empty((4, 3, 8, 8), torch.float32)  # now nothing references it: recycled
    assert c.data_ptr() == ptr


def test_host_pool_keeps_at_most_max_idle_buffers() -> None:
    pool = gpu.HostBufferPool(max_idle=2)
    batches = [pool.empty((2, 3, 4, 4), torch.float32) for _ in range(5)]
    assert pool.idle() == 0
    del batches
    assert pool.idle() == 2


def test_host_pool_memory_is_bounded_when_shapes_change() -> None:
    # Multi-scale training: every step a new size, each batch dropped after use.
    pool = gpu.HostBufferPool(max_idle=4, max_idle_bytes=3 * 4 * 3 * 64 * 64 * 4)
    for step in range(40):
        size = 32 + step
        out = pool.empty((4, 3, size, size), torch.float32)
        out.fill_(1.0)
        del out
        assert pool.idle() <= 4 and pool.idle_bytes() <= pool.max_idle_bytes
    # The two newest shapes fit under the byte cap (71 and 70 px: 477,168 bytes); older ones went.
    assert pool.idle() == 2 and pool.idle_bytes() == 4 * 3 * (71 * 71 + 70 * 70) * 4
    again = pool.empty((4, 3, 71, 71), torch.float32)  # the last step's shape: recycled
    assert pool.idle() == 1 and pool.idle_bytes() == 4 * 3 * 70 * 70 * 4
    del again


def test_host_pool_layouts_and_dtypes() -> None:
    pool = gpu.HostBufferPool()
    cl = pool.empty((2, 3, 5, 7), torch.float32, channels_last=True)
    assert cl.shape == (2, 3, 5, 7) and cl.is_contiguous(memory_format=torch.channels_last)
    for dtype in (torch.float16, torch.bfloat16, torch.float64, torch.int32):
        t = pool.empty((2, 3, 4, 4), dtype)
        assert t.dtype == dtype and t.shape == (2, 3, 4, 4)
        t.fill_(2)
        assert float(t.sum()) == 2 * 96


def test_normalize_outputs_are_recycled_but_kept_batches_stay_intact() -> None:
    torch.manual_seed(0)
    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    norm = gpu.Normalize(mean, std)
    images = [torch.randint(0, 256, (6, 3, 32, 32), dtype=torch.uint8) for _ in range(4)]
    reference = [tvf.normalize(tvf.to_dtype(x, torch.float32, scale=True), mean, std) for x in images]
    kept = [norm(x) for x in images]  # a user keeping every batch
    assert len({t.data_ptr() for t in kept}) == 4
    for got, ref in zip(kept, reference, strict=False):
        assert torch.equal(got, ref)  # nothing overwritten by later batches, bit-exact
    ptrs = {t.data_ptr() for t in kept}
    del kept, got
    again = norm(images[0])  # the memory of dropped batches comes back
    assert again.data_ptr() in ptrs
    assert torch.equal(again, reference[0])


def test_normalize_takes_0_255_units_with_a_warning() -> None:
    images = torch.randint(0, 256, (2, 3, 5, 5), dtype=torch.uint8)
    reference = gpu.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])(images)
    with pytest.warns(UserWarning, match="0-255 units"):
        scaled = gpu.Normalize([123.675, 116.28, 103.53], [58.395, 57.12, 57.375])
    assert torch.allclose(scaled(images), reference, atol=1e-5)


@pytest.mark.parametrize("c", [True, False], ids=["C extension", "numpy"])
def test_antialias_taps_are_torchs_weights_in_torchs_order(c: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The crop's planning makes the (n, L, K) taps on the host (in the C extension, or numpy without
    it): each weight is torch's triangle filter normalised by its sum in order of k (torch's kernel
    setup, written out here per pixel in plain Python floats); taps past a pixel's own filter
    weigh 0 and read inside the region; positions come with each image's shift."""
    from fastload.gpu import resample as gt

    if c and gt._c_resample is None:
        pytest.skip("the C extension fastload._resample is not built")
    monkeypatch.setattr(gt, "USE_C_TAPS", c)
    images = [natural(h, w, seed=h) for h, w in [(300, 260), (900, 880), (60, 70), (333, 250)]]
    plan = gt.GeometryPlan(images)
    gpu.RandomResizedCrop(48)._update(plan, np.arange(4), 0, 3)
    taps = plan.x.taps(None, True)
    lo, hi = taps.bounds()
    rows = np.array([2, 0, 3, 1])
    width = taps.width(rows) + 2
    local = np.empty((4, 48, width), dtype=np.int64)
    weights = np.empty((4, 48, width), dtype=np.float64)
    taps.fill(rows, 1000 * np.arange(4) - lo[rows], local, weights)
    axis = plan.x
    for r, i in enumerate(rows):
        scale = float(axis.srclen[i]) / float(axis.reslen[i])
        support, inv = (scale, 1.0 / scale) if scale >= 1.0 else (1.0, 1.0)
        for o in (0, 17, 47):
            center = scale * (o + 0.5)
            xmin = max(int(math.trunc(center - support + 0.5)), 0)
            xmax = min(int(math.trunc(center + support + 0.5)), int(axis.srclen[i]))
            ws = [max(0.0, 1.0 - abs((xmin + k - center + 0.5) * inv)) for k in range(xmax - xmin)]
            total = 0.0
            for w in ws:
                total += w
            want = [w / total for w in ws]
            got = weights[r, o].tolist()
            assert got[: len(want)] == want and all(w == 0 for w in got[len(want) :])
            positions = local[r, o] - 1000 * r + int(lo[i])
            assert positions[: len(want)].tolist() == [int(axis.src0[i]) + xmin + k for k in range(len(want))]
            assert bool((positions >= lo[i]).all() and (positions <= hi[i]).all())


def test_antialias_taps_from_the_c_extension_are_numpys_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The C extension and its numpy stand-in make the same taps, bit for bit, in float32 and
    float64 (and the same per-pixel filter numbers first): random crops, flips, down- and
    upscales, zero padding around a resize (taps outside the region and outputs outside the window
    weigh 0), and any subset of images in any order."""
    from fastload.gpu import resample as gt

    if gt._c_resample is None:
        pytest.skip("the C extension fastload._resample is not built")
    rng = np.random.default_rng(7)
    for case in range(40):
        sizes = rng.integers(3, 400, (int(rng.integers(1, 12)), 2))
        images = [torch.zeros(3, int(h), int(w), dtype=torch.uint8) for h, w in sizes]
        plan = gt.GeometryPlan(images)
        out = int(rng.integers(1, 300))
        indices = np.arange(len(images))
        if case % 3 == 0:  # padding: a crop larger than the resized image
            gpu.Resize(out)._update(plan, indices, case, 0)
            gpu.CenterCrop(out + int(rng.integers(1, 40)))._update(plan, indices, case, 0)
        else:
            gpu.RandomResizedCrop(out)._update(plan, indices, case, 0)
            gpu.RandomHorizontalFlip()._update(plan, indices, case, 0)
        for axis, flip in ((plan.y, None), (plan.x, plan.flip)):
            both = []
            for c in (True, False):  # the per-pixel numbers too
                monkeypatch.setattr(gt, "USE_C_TAPS", c)
                both.append(axis.taps(flip, True))
            taps, numpy_taps = both
            if not isinstance(taps, gt._AntialiasTaps):
                continue
            assert isinstance(numpy_taps, gt._AntialiasTaps)
            for name in ("xmin", "xsize", "center", "invscale", "valid"):
                assert getattr(taps, name).tobytes() == getattr(numpy_taps, name).tobytes(), (case, name)
            rows = rng.permutation(len(images))[: int(rng.integers(1, len(images) + 1))]
            shift = rng.integers(-500, 500, len(rows))
            shape = (len(rows), int(axis.winlen[0]), taps.width(rows) + int(rng.integers(0, 3)))
            for dtype in (np.float32, np.float64):
                made = []
                for c in (True, False):
                    monkeypatch.setattr(gt, "USE_C_TAPS", c)
                    pos, w = np.full(shape, -7, dtype=np.int64), np.full(shape, np.nan, dtype=dtype)
                    taps.fill(rows, shift, pos, w)
                    made.append((pos, w))
                (pc, wc), (pn, wn) = made
                assert np.array_equal(pc, pn) and wc.tobytes() == wn.tobytes(), case


def test_an_image_without_pixels_is_named_by_the_resizing_transforms() -> None:
    images = [torch.zeros(3, 10, 10, dtype=torch.uint8), torch.zeros(3, 0, 5, dtype=torch.uint8)]
    for transform, words in [
        (gpu.Resize((4, 4)), "image 1 of the batch has no pixels (0x5), so it cannot be resized"),
        (gpu.Compose([gpu.Resize(8), gpu.CenterCrop(4)]), "image 1 of the batch has no pixels (0x5)"),
        (gpu.RandomResizedCrop(4), "image 1 of the batch has no pixels (0x5), so no crop can be drawn"),
    ]:
        with pytest.raises(ValueError, match=re.escape(words)):
            transform(images)


def test_the_c_extension_refuses_wrong_arrays_by_name() -> None:
    """A wrong dtype (even of the right item size) or a wrong length is a clear error naming the
    argument, never numbers read or written as another type."""
    from fastload.gpu import resample as gt

    if gt._c_resample is None:
        pytest.skip("the C extension fastload._resample is not built")
    n_img, length, k = 2, 3, 2
    ints = {name: np.zeros(n_img, dtype=np.int64) for name in ("src0", "m0", "m1", "size")}
    args = dict(
        xmin=np.zeros((n_img, length), dtype=np.int64),
        xsize=np.full((n_img, length), 2, dtype=np.int64),
        center=np.ones((n_img, length)),
        invscale=np.ones(n_img),
        valid=np.ones((n_img, length), dtype=bool),
        **ints,
        rows=np.array([1], dtype=np.int64),
        shift=np.zeros(1, dtype=np.int64),
        pos=np.zeros((1, length, k), dtype=np.int64),
        weights=np.zeros((1, length, k), dtype=np.float32),
    )
    gt._c_resample.antialias_taps(*args.values())
    for name, bad, error, words in [
        (
            "weights",
            np.zeros((1, length, k), dtype=np.int32),
            TypeError,
            "weights should be float32 or float64",
        ),
        ("pos", np.zeros((1, length, k)), TypeError, "pos should be int64"),
        ("rows", np.zeros(1), TypeError, "rows should be int64"),
        ("pos", np.zeros((1, length, k + 1), dtype=np.int64), ValueError, "weights should hold 9 items"),
        ("pos", np.zeros(5, dtype=np.int64), ValueError, "pos should hold n x L x K items"),
        ("m1", np.zeros(3, dtype=np.int64), ValueError, "m1 should hold 2 items (N, from src0)"),
    ]:
        with pytest.raises(error, match=re.escape(words)):
            gt._c_resample.antialias_taps(*{**args, name: bad}.values())
    out = np.zeros(3, dtype=np.int64)
    with pytest.raises(ValueError, match=re.escape("out should hold sum(ry) x C items")):
        gt._c_resample.region_rows(
            *(np.zeros(1, dtype=np.int64),) * 3, np.array([2]), *(np.zeros(1, dtype=np.int64),) * 2, out
        )


def test_region_rows_from_the_c_extension_are_numpys(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where each row of a group's resampling table starts: the same from the C extension and its
    numpy stand-in, for any images, regions and channel counts (an image with no rows too)."""
    from fastload.gpu import resample as gt

    if gt._c_resample is None:
        pytest.skip("the C extension fastload._resample is not built")
    rng = np.random.default_rng(3)
    for channels in (1, 3, 4):
        n = int(rng.integers(1, 20))
        heights, widths = rng.integers(1, 300, n), rng.integers(1, 300, n)
        offsets = np.concatenate([[0], np.cumsum(channels * heights * widths)[:-1]])
        ry = rng.integers(0, heights + 1)
        oy, ox = rng.integers(0, heights - ry + 1), rng.integers(0, widths)
        made = []
        for c in (True, False):
            monkeypatch.setattr(gt, "USE_C_TAPS", c)
            out = np.full(int(ry.sum()) * channels, -1, dtype=np.int64)
            gt._region_rows(offsets, heights, widths, channels, ry, oy, ox, out)
            made.append(out)
        assert np.array_equal(made[0], made[1])
        if not ry.any():
            continue
        r = int(np.flatnonzero(ry)[0])  # the first image with rows: its first row's channels
        first = offsets[r] + oy[r] * widths[r] + ox[r] + np.arange(channels) * heights[r] * widths[r]
        assert made[0][:channels].tolist() == first.tolist()


def test_packed_images_are_cropped_and_resized_as_tensors_are() -> None:
    """gpu.PackedImages (images back to back in one buffer, as a region decoder writes them):
    crop_resize gives the pixels Resize gives on each box cut out as its own tensor; a buffer the
    images do not fit in, or not 1-D, an empty box or one outside its image, and box arguments of
    the wrong length are clear errors."""
    g = torch.Generator().manual_seed(0)
    sizes = np.random.default_rng(0).integers(5, 120, (30, 2))
    images = [torch.randint(0, 256, (3, int(h), int(w)), dtype=torch.uint8, generator=g) for h, w in sizes]
    rng = np.random.default_rng(1)
    boxes = []
    for t in images:
        h, w = t.shape[1:]
        bh, bw = int(rng.integers(1, h + 1)), int(rng.integers(1, w + 1))
        boxes.append((int(rng.integers(0, h - bh + 1)), int(rng.integers(0, w - bw + 1)), bh, bw))
    top, left, height, width = np.array(boxes).T
    flat = torch.cat([t.reshape(-1) for t in images])  # no room past the end: padded when read
    offsets = np.concatenate([[0], np.cumsum([t.numel() for t in images])[:-1]])
    packed = PackedImages(flat, offsets, sizes[:, 0], sizes[:, 1], channels=3)
    assert len(packed) == 30 and torch.equal(packed.image(7), images[7])
    reference = Resize((17, 23))(
        [t[:, a : a + c, b : b + d] for t, (a, b, c, d) in zip(images, boxes, strict=True)]
    )
    assert torch.equal(crop_resize(packed, top, left, height, width, (17, 23)), reference)
    assert torch.equal(crop_resize(images, top, left, height, width, (17, 23)), reference)
    rows = np.array([4, 2, 9])
    assert torch.equal(
        crop_resize(packed.select(rows), top[rows], left[rows], height[rows], width[rows], (17, 23)),
        reference[rows],
    )
    with pytest.raises(
        ValueError, match=r"box 0 \(top 0, left 0, height 0, width 3\) should be non-empty and inside"
    ):
        crop_resize(images[:1], [0], [0], [0], [3], (4, 4))
    with pytest.raises(ValueError, match=r"box 1 .* inside image 1 \(\d+x\d+\)"):
        crop_resize(images[:2], [0, 0], [0, int(sizes[1, 1])], [1, 1], [1, 1], (4, 4))
    with pytest.raises(ValueError, match=r"top should have one entry per image \(2\), but got 1"):
        crop_resize(images[:2], [0], [0, 0], [1, 1], [1, 1], (4, 4))
    with pytest.raises(ValueError, match="run past the end of flat"):
        PackedImages(flat[:-1], offsets, sizes[:, 0], sizes[:, 1], channels=3)
    with pytest.raises(ValueError, match="1-D"):
        PackedImages(flat.view(1, -1), offsets, sizes[:, 0], sizes[:, 1], channels=3)
    empty = crop_resize(torch.zeros(0, 3, 10, 10, dtype=torch.uint8), [], [], [], [], (4, 5))
    assert empty.shape == (0, 3, 4, 5) and empty.dtype == torch.uint8


def test_a_flip_and_normalize_do_not_import_torchvision() -> None:
    """Only a resize needs torchvision's kernels: a flip (the device paths' rest after the crop)
    runs without importing it (seconds of imports in the feeder thread's first batch otherwise)."""
    import subprocess
    import sys

    code = (
        "import sys, numpy as np, torch\n"
        "from fastload import gpu\n"
        "x = torch.zeros(4, 3, 8, 8, dtype=torch.uint8)\n"
        "rest = gpu.Compose([gpu.RandomHorizontalFlip(), gpu.Normalize([0.5] * 3, [0.2] * 3)])\n"
        "rest(x, indices=np.arange(4))\n"
        "assert 'torchvision' not in sys.modules, 'torchvision imported'\n"
        "gpu.Resize((4, 4))(x)\n"
        "assert 'torchvision' in sys.modules\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
