"""decode="hybrid": each batch split between the device's decoder and the CPU workers, assembled on
the device; on CPU with the recording stand-in for CUDA streams and the CPU decoder standing in
for the GPU's."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _fakecuda import fake_cuda

import fastload
import fastload.gpu.decode
import fastload.gpu.hybrid
import fastload.loader
from fastload import gpu, rng
from fastload.gpu.hybrid import DeviceHead, HybridSplit, split_head

# Mean |all-CPU - all-device| per image, in uint8 levels, on the synthetic JPEGs: the CPU workers
# decode at reduced size and resample as PIL does, the device side decodes at full size and
# resizes with torch's antialiased filter. Measured: at most 9.1 levels per image (mean 3.0) over
# 4 epochs of the fixture's 32 images; with another seed's boxes and flips the median image is 34
# levels off (10 to 48: the control below).
PIXEL_BOUND = 12.0


def _pipeline(size: int = 24) -> gpu.Compose:
    return gpu.Compose(
        [gpu.RandomResizedCrop(size), gpu.RandomHorizontalFlip(), gpu.Normalize([0.0], [1 / 255])]
    )


def _hybrid(
    root: Path, share: float | None = None, files: bool = False, **kwargs: Any
) -> fastload.DataLoader[Any]:
    """A hybrid loader over the train split: in memory, or (``files``) an ImageFolder."""
    ds: Any = fastload.ImageFolder(root / "train") if files else fastload.InMemoryImageFolder(root / "train")
    options: dict[str, Any] = dict(batch_size=4, shuffle=True, seed=3, num_workers=2, device="cpu")
    loader = fastload.DataLoader(ds, decode="hybrid", gpu_transforms=_pipeline(), **{**options, **kwargs})
    assert loader.hybrid is not None
    loader.hybrid.cpu_share = share
    return loader


def _take(loader: Any) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    return [(b[0].clone(), b[1].clone(), b.indices.clone()) for b in loader]


# ------------------------------------------------------------------------------ the crop boxes


def _crop_of(plan: Any) -> tuple[int, int, int, int]:
    crops = [op[1:] for op in plan.ops if op[0] == "crop"]
    return crops[0] if crops else (0, 0, *plan.source)


def test_the_cpu_head_crops_each_sample_with_the_box_the_device_draws_for_it() -> None:
    """A sample's box is a function of its size and (seed, epoch, index) on both sides: the CPU
    workers (one sample at a time, inside its sample scope) get the device's batch draw."""
    crop = gpu.RandomResizedCrop(32, scale=(0.05, 1.0))
    head = DeviceHead([crop])
    g = np.random.default_rng(0)
    heights, widths = g.integers(1, 900, 300), g.integers(1, 900, 300)
    indices = g.permutation(10_000)[:300]
    top, left, h, w = crop.boxes(heights, widths, indices=indices, epoch=4, seed=11)
    for r, i in enumerate(indices.tolist()):
        with rng.sample_scope(11, 4, i):
            plan = head.plan(int(heights[r]), int(widths[r]))
        assert _crop_of(plan) == (top[r], left[r], h[r], w[r]) and (plan.height, plan.width) == (32, 32)
    # the control: another epoch's boxes differ for most samples
    with rng.sample_scope(11, 5, int(indices[0])):
        other = [_crop_of(head.plan(int(heights[0]), int(widths[0])))]
    assert other != [(top[0], left[0], h[0], w[0])] or heights[0] * widths[0] < 4


@pytest.mark.parametrize(
    ("scale", "ratio"), [((0.08, 1.0), (3 / 4, 4 / 3)), ((0.5, 3.0), (0.2, 5.0)), ((0.01, 0.02), (0.1, 10.0))]
)
def test_one_sample_box_is_the_batch_box(scale: tuple[float, float], ratio: tuple[float, float]) -> None:
    """``box`` (one image, plain Python: what the workers use) equals ``boxes`` (numpy, the
    device's batch draw) for every sample, fallbacks included (areas above the image, extreme
    aspect ratios, 1-pixel images)."""
    crop = gpu.RandomResizedCrop(8, scale=scale, ratio=ratio)
    g = np.random.default_rng(1)
    heights, widths, indices = (
        g.integers(1, 2000, 3000),
        g.integers(1, 2000, 3000),
        g.integers(0, 2**40, 3000),
    )
    heights[:50] = 1
    boxes = np.stack(crop.boxes(heights, widths, indices=indices, epoch=7, seed=5), 1)
    one = [
        crop.box(int(h), int(w), index=int(i), epoch=7, seed=5)
        for h, w, i in zip(heights, widths, indices, strict=True)
    ]
    assert np.array_equal(np.array(one), boxes)


def test_a_head_on_images_some_already_cropped_resizes_those_and_crops_the_rest() -> None:
    """``apply_head(..., cropped=...)``: images decoded as their crop box are only resized; the
    others go through the whole head; each lands at its place in the batch."""
    from fastload.gpu.hybrid import apply_head

    head = [gpu.RandomResizedCrop(8)]
    g = torch.Generator().manual_seed(0)
    images = [
        torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g)
        for h, w in [(20, 30), (16, 16), (9, 12)]
    ]
    indices = np.array([4, 5, 6])
    out = apply_head(head, images, indices, 2, 1, cropped=[True, False, True])
    assert out.shape == (3, 3, 8, 8)
    resized = gpu.Resize((8, 8))([images[0], images[2]])
    assert torch.equal(out[0], resized[0]) and torch.equal(out[2], resized[1])
    whole = gpu.apply_transform(gpu.Compose(head), [images[1]], indices[[1]], 2, 1)
    assert torch.equal(out[1], whole[0])


def test_an_evaluation_head_resizes_and_centre_crops_like_the_device() -> None:
    head = DeviceHead([gpu.Resize(256), gpu.CenterCrop(224)])
    plan = head.plan(375, 500)  # torchvision: 341 x 256, then a 224 window at (16, 58)
    assert plan.ops == [("resize", 256, 341, "bilinear", True), ("crop", 16, 58, 224, 224)]
    assert head.output_size == (224, 224) and not head.random


def test_split_head_keeps_the_leading_crop_and_resize_for_the_workers() -> None:
    crop, flip, norm = gpu.RandomResizedCrop(8), gpu.RandomHorizontalFlip(), gpu.Normalize([0.5], [0.5])
    assert split_head(gpu.Compose([crop, flip, norm])) == ([crop], [flip, norm])
    resize, centre = gpu.Resize(10), gpu.CenterCrop(8)
    assert split_head(gpu.Compose([resize, centre, norm])) == ([resize, centre], [norm])
    assert split_head(crop) == ([crop], [])
    for bad in (norm, gpu.Resize(10), gpu.Compose([flip, crop])):
        with pytest.raises(ValueError, match="decode='hybrid' needs gpu_transforms that begin with a crop"):
            split_head(bad)


def test_the_loader_checks_what_hybrid_decoding_needs(imagenet_root: Path) -> None:
    ds = fastload.InMemoryImageFolder(imagenet_root / "train")
    with pytest.raises(ValueError, match="decode='hybrid' needs gpu_transforms that begin with a crop"):
        fastload.DataLoader(ds, decode="hybrid", gpu_transforms=gpu.Normalize([0.5], [0.5]))
    with pytest.raises(ValueError, match="on_error='skip' is not supported with decode='hybrid'"):
        fastload.DataLoader(ds, decode="hybrid", gpu_transforms=_pipeline(), on_error="skip")
    with pytest.raises(ValueError, match="decode='hybrid' needs gpu_transforms that bring"):
        fastload.DataLoader(ds, decode="hybrid")
    with pytest.raises(ValueError, match="cpu_share should be None or a number in"):
        HybridSplit(cpu_share=1.5)


# ------------------------------------------------------------------------------ the batches


def test_batches_do_not_depend_on_the_split_beyond_the_decoders_pixels(
    imagenet_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """All on the device, half and half, all on the CPU: the same samples, labels, crop boxes and
    flips; the pixels differ by the decoders' difference only (a different box is far off). The
    device share is decoded in the decoder thread, the CPU share by the workers, the assembly in
    the feeder thread; every copy to the device comes from pinned memory."""
    decoded_in: list[str] = []
    real_decode = fastload.gpu.decode.decode_batch

    def recording_decode(*args: Any, **kwargs: Any) -> Any:
        decoded_in.append(threading.current_thread().name)
        return real_decode(*args, **kwargs)

    monkeypatch.setattr(fastload.gpu.decode, "decode_batch", recording_decode)
    runs = {}
    for share in (0.0, 0.5, 1.0):
        with fake_cuda() as (streams, _):
            loader = _hybrid(imagenet_root, share, pin_memory=True)
            assert loader.path == "hybrid"
            runs[share] = _take(loader)
            loader.close()
        assert streams.pageable() == []
        cpu_copies = [shape for shape, dtype, _ in streams.copies if dtype == torch.uint8]
        assert len(cpu_copies) == (0 if share == 0.0 else 8)  # the CPU share of each batch, from its slot
        assert all(shape[1:] == (3, 24, 24) and shape[0] == 4 * share for shape in cpu_copies)
    assert set(decoded_in) == {"fastload-device-decode_0"} and len(decoded_in) == 16  # shares 0 and 0.5
    reference = runs[0.0]
    for share in (0.5, 1.0):
        for (x, y, i), (rx, ry, ri) in zip(runs[share], reference, strict=True):
            assert torch.equal(y, ry) and torch.equal(i, ri)
            assert x.shape == rx.shape == (4, 3, 24, 24)
            per_image = (x - rx).abs().flatten(1).mean(1)
            assert per_image.max() < PIXEL_BOUND, per_image
    # the control: the same images with another seed's boxes and flips are far off
    shifted = _take(_hybrid(imagenet_root, 0.0, seed=4, shuffle=False))
    same_order = _take(_hybrid(imagenet_root, 1.0, shuffle=False))
    off = [(a[0] - b[0]).abs().flatten(1).mean(1) for a, b in zip(shifted, same_order, strict=True)]
    assert torch.cat(off).median() > 2 * PIXEL_BOUND


def test_a_fixed_split_gives_the_same_batches_every_run_and_after_a_resume(imagenet_root: Path) -> None:
    whole = _take(_hybrid(imagenet_root, 0.5))
    again = _take(_hybrid(imagenet_root, 0.5))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(whole, again, strict=True))
    first = _hybrid(imagenet_root, 0.5)
    it = iter(first)
    next(it), next(it), next(it)
    state = first.state_dict()
    first.close()
    resumed = _hybrid(imagenet_root, 0.5)
    resumed.load_state_dict(state)
    rest = _take(resumed)
    assert len(rest) == len(whole) - 3
    for a, b in zip(rest, whole[3:], strict=True):
        assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))


def test_leaving_a_pass_early_stops_its_threads_and_the_next_pass_is_whole(imagenet_root: Path) -> None:
    loader = _hybrid(imagenet_root, 0.5, persistent_workers=True)
    whole = _take(loader)
    loader.set_epoch(0)
    it = iter(loader)
    next(it), next(it)
    del it
    alive = [
        t.name for t in threading.enumerate() if t.name.startswith(("fastload-feeder", "fastload-device"))
    ]
    deadline = time.monotonic() + 10
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [
            t.name for t in threading.enumerate() if t.name.startswith(("fastload-feeder", "fastload-device"))
        ]
    assert alive == []
    loader.set_epoch(0)
    again = _take(loader)  # the same workers, every slot back
    assert len(again) == len(whole) and all(
        torch.equal(a[0], b[0]) for a, b in zip(again, whole, strict=True)
    )
    loader.close()


def test_a_newer_pass_takes_over_the_workers_from_one_left_alive(imagenet_root: Path) -> None:
    """An iterator kept after one batch does not take the new pass's batches (its feeder thread
    would otherwise go on receiving them): the new pass is whole, the old one says why it stopped."""
    loader = _hybrid(imagenet_root, 0.5, timeout=20)
    first = iter(loader)
    next(first)
    loader.set_epoch(0)
    again = _take(loader)
    assert len(again) == 8 and torch.equal(torch.cat([b[2] for b in again]).sort().values, torch.arange(32))
    with pytest.raises(RuntimeError, match="a newer pass of the same loader"):
        for _ in range(8):
            next(first)
    first.close()  # its feeder thread stops
    loader.close()


def test_an_error_not_of_a_batch_ends_that_batch_on_both_sides(
    imagenet_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A timeout while waiting for a CPU share is raised by that batch's next(); the next batch has
    its own CPU share (labels and indices agree), and the pass ends after its last batch."""
    import fastload._pool

    real_get = fastload._pool.WorkerPool.get
    calls = []

    def get(self: Any, timeout: float) -> Any:
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("DataLoader timed out after 1 seconds (injected)")
        return real_get(self, timeout)

    monkeypatch.setattr(fastload._pool.WorkerPool, "get", get)
    loader = _hybrid(imagenet_root, 0.5, shuffle=False)
    targets = np.asarray(fastload.InMemoryImageFolder(imagenet_root / "train").targets)
    it = iter(loader)
    outcomes: list[Any] = []
    for _ in range(len(loader)):
        try:
            batch = next(it)
            outcomes.append(batch.indices.tolist())
            assert np.array_equal(targets[batch.indices.numpy()], batch[1].numpy())
        except RuntimeError as e:
            outcomes.append(str(e))
    with pytest.raises(StopIteration):
        next(it)
    errors = [k for k, o in enumerate(outcomes) if isinstance(o, str)]
    assert len(errors) == 1 and "injected" in outcomes[errors[0]]
    assert [o for o in outcomes if not isinstance(o, str)] == [
        list(range(4 * k, 4 * k + 4)) for k in range(8) if k != errors[0]
    ]
    loader.close()


def test_without_workers_every_image_goes_to_the_device(imagenet_root: Path) -> None:
    loader = _hybrid(imagenet_root, None, num_workers=0)
    batches = _take(loader)
    assert len(batches) == 8 and loader._engine.pool is None  # no worker pool was made
    assert loader.hybrid is not None and loader.hybrid.cpu_rate is None and loader.hybrid.device_rate
    assert "without CPU workers" in loader.decoder


def test_a_corrupt_image_is_named_by_its_batch_on_either_side(tmp_path: Path) -> None:
    """Batch size 2 split 1 + 1: sample 3 is the CPU share of batch 1, sample 4 the device share of
    batch 2. Each error comes from its batch's next(), naming the file; the pass goes on."""
    from fastload.synthetic import make_imagenet_like

    make_imagenet_like(tmp_path, classes=2, per_class=5, val_per_class=0, seed=1, num_workers=1)
    files = sorted((tmp_path / "train").rglob("*.JPEG"))
    for bad in (files[3], files[4]):
        bad.write_bytes(b"\xff\xd8\xff\xe0 definitely not a jpeg")
    loader = fastload.DataLoader(
        fastload.ImageFolder(tmp_path / "train"),
        batch_size=2,
        decode="hybrid",
        gpu_transforms=gpu.Resize((8, 8)),
        device="cpu",
        num_workers=1,
    )
    assert loader.hybrid is not None
    loader.hybrid.cpu_share = 0.5
    it = iter(loader)
    outcomes: list[Any] = []
    for _ in range(len(loader)):
        try:
            outcomes.append(len(next(it)[1]))
        except fastload.DecodeError as e:
            outcomes.append(str(e))
    assert outcomes[0] == 2 and outcomes[3:] == [2, 2]
    assert files[3].name in outcomes[1] and files[4].name in outcomes[2]
    assert all("on_error" not in outcome for outcome in outcomes[1:3])  # hybrid refuses it: not advised
    with pytest.raises(StopIteration):
        next(it)
    # The loop's demand is sampled only between two batches it got: not across a batch that raised
    samples = [n for n, _ in loader.hybrid._steps]
    assert samples == [2, 2, 2], samples  # after batches 0, 3 and 4 (the last: the StopIteration call)
    loader.close()


# ------------------------------------------------------------------------------ the split adapts


def _shares_over_epochs(loader: fastload.DataLoader[Any], epochs: int) -> list[float]:
    """The CPU share of each batch, as the split decided them."""
    for _ in range(epochs):
        for _batch in loader:
            pass
    assert loader.hybrid is not None
    return list(loader.hybrid.decisions)


def test_the_split_moves_to_the_cpu_when_the_device_decoder_is_slow(
    imagenet_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_decode = fastload.gpu.decode.decode_batch

    def slow_decode(encoded: Any, *args: Any, **kwargs: Any) -> Any:
        time.sleep(0.03 * len(encoded))  # an injected slow device decoder: about 33 images/s
        return real_decode(encoded, *args, **kwargs)

    monkeypatch.setattr(fastload.gpu.decode, "decode_batch", slow_decode)
    loader = _hybrid(imagenet_root, None, worker_type="thread")
    shares = _shares_over_epochs(loader, 3)
    loader.close()
    assert loader.hybrid is not None and loader.hybrid.share() > 0.8, loader.hybrid
    assert shares[0] == 0.5 and np.mean(shares[-6:]) > 0.8, shares


def test_the_split_moves_to_the_device_when_the_cpu_workers_are_slow(
    imagenet_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_plan = DeviceHead._plan

    def slow_plan(self: Any, plan: Any, sample_rng: Any) -> None:
        time.sleep(0.25)  # injected slow CPU workers (thread workers share this module): ~8 images/s
        real_plan(self, plan, sample_rng)

    monkeypatch.setattr(fastload.gpu.hybrid.DeviceHead, "_plan", slow_plan)
    loader = _hybrid(imagenet_root, None, worker_type="thread")
    shares = _shares_over_epochs(loader, 3)
    loader.close()
    assert loader.hybrid is not None and loader.hybrid.share() < 0.2, loader.hybrid
    assert shares[0] == 0.5 and np.mean(shares[-6:]) < 0.2, shares


def test_a_loop_the_cpu_workers_keep_fed_gets_its_batches_from_them(
    imagenet_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The device decodes only what the CPU cannot (its decoding takes the model's GPU time): with
    workers slower than the device's decoder, a fast loop gets most of each batch from the device,
    a slow loop (a long model step) that the workers keep fed gets them from the workers."""
    real_plan = DeviceHead._plan

    def slow_plan(self: Any, plan: Any, sample_rng: Any) -> None:
        time.sleep(0.02)  # slowed CPU workers (two threads): about 100 images/s together
        real_plan(self, plan, sample_rng)

    monkeypatch.setattr(fastload.gpu.hybrid.DeviceHead, "_plan", slow_plan)
    monkeypatch.setenv("FASTLOAD_GPU_EXPERIMENTAL", "1")  # following the demand is experimental

    def shares(step_seconds: float) -> tuple[list[float], HybridSplit]:
        loader = _hybrid(imagenet_root, None, worker_type="thread")
        for _ in range(3):
            for _batch in loader:
                time.sleep(step_seconds)  # the model's step
        loader.close()
        assert loader.hybrid is not None
        return loader.hybrid.decisions, loader.hybrid

    fast, fast_split = shares(0.0)
    slow, slow_split = shares(0.12)  # 4 images per 0.12 s: the loop takes about 33 images/s
    assert slow_split.demand is not None and 20 < slow_split.demand < 40, slow_split
    assert fast_split.demand is not None and fast_split.demand > 10 * slow_split.demand
    assert np.mean(fast[-8:]) < 0.5, (fast, fast_split)  # the rates' balance: mostly the device
    assert np.mean(slow[-8:]) > 0.8, (slow, slow_split)  # the workers keep up: the CPU, a probe aside
    assert "the loop takes" in repr(slow_split)


def test_the_split_follows_the_measured_rates_and_probes_an_idle_side(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    split = HybridSplit()
    assert split.cpu_images(256, workers=4) == 128  # nothing measured: half each
    split.record_cpu(64, 0.1, workers=4)  # 640 images/s per worker, 2,560 together
    split.record_device(256, 0.0333)  # about 7,690 images/s
    assert split.cpu_images(256, workers=4) == round(256 * 2560 / (2560 + 256 / 0.0333))
    assert split.cpu_images(256, workers=0) == 0  # no CPU side
    split.record_device(256, 1e-6)  # the device is by far faster: the CPU gets nothing ...
    for _ in range(40):
        split.record_device(256, 1e-6)
    counts = [split.cpu_images(256, workers=4) for _ in range(32)]
    assert counts.count(0) == 30 and counts.count(1) == 2  # ... but one image every probe_every batches
    even = HybridSplit()
    even.record_cpu(100, 1.0, workers=1)
    even.record_device(100, 1.0)
    ones = [even.cpu_images(1, workers=1) for _ in range(40)]  # batch_size=1: the share on average
    assert sum(ones) == 20 and even.decisions[-40:] == [float(k) for k in ones]
    fixed = HybridSplit(cpu_share=0.3)
    assert [fixed.cpu_images(10, workers=2) for _ in range(3)] == [3, 3, 3]  # fixed: every batch alike
    # By default the split follows the two sides' rates only (as measured on a GPU): the loop's
    # demand is recorded, not followed.
    rates = HybridSplit()
    rates.record_cpu(64, 0.1, workers=4)
    rates.record_device(256, 256 / 7680)
    rates.record_demand(256, 256 / 2000)
    assert not rates.follow_demand and rates.share() == pytest.approx(0.25)
    assert "the loop takes" not in repr(rates)
    # Experimental (FASTLOAD_GPU_EXPERIMENTAL=1), the loop's demand: the CPU takes what it supplies of
    # it (with 10 % headroom), never less than the balanced split; all of it where it supplies enough.
    monkeypatch.setenv("FASTLOAD_GPU_EXPERIMENTAL", "1")
    loop = HybridSplit()
    assert loop.follow_demand
    loop.record_cpu(64, 0.1, workers=4)  # 2,560 images/s
    loop.record_device(256, 256 / 7680)  # 7,680 images/s: balanced, the CPU's share is 0.25
    assert loop.share() == pytest.approx(0.25)
    loop.record_demand(256, 256 / 2000)  # the loop takes 2,000 images/s: the CPU supplies them
    assert loop.share() == 1.0
    loop.demand = 5000.0
    assert loop.share() == pytest.approx(2560 / 5500)  # the device makes up the rest
    loop.demand = 20000.0  # more than both supply: the fastest split, the balanced one
    assert loop.share() == pytest.approx(0.25)
    # A loop that synchronises every 4th step (loss.item() every 4 steps): three quick returns, one
    # long wait. Its demand is the images over the seconds, not an average of per-step rates.
    uneven = HybridSplit()
    for _ in range(10):
        for seconds in (0.0001, 0.0001, 0.0001, 0.4797):
            uneven.record_demand(4, seconds)
    assert uneven.demand == pytest.approx(16 / 0.48)


def test_the_loader_names_the_hybrid_decoder(imagenet_root: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="fastload"):
        loader = _hybrid(imagenet_root, None)
    assert loader.path == "hybrid" and loader.fast_path_reason == "decode='hybrid' decodes on the device"
    assert "libjpeg-turbo in 2 CPU workers" in loader.decoder
    assert [r.getMessage() for r in caplog.records if r.name == "fastload"] == [
        f"fastload.DataLoader decodes this InMemoryImageFolder on cpu with {loader.decoder}, in a feeder "
        "thread 2 batches ahead of the loop"
    ]


@pytest.mark.parametrize("share", [1.0, 0.0])
def test_a_file_dataset_split_all_to_one_side_reads_what_the_device_decodes(
    imagenet_root: Path, share: float
) -> None:
    """An ImageFolder (its bytes read by the reader threads) with the whole batch on the CPU (the
    device reads nothing) or on the device: the same batches as the in-memory set's."""
    files = _hybrid(imagenet_root, share, files=True)
    got, expected = _take(files), _take(_hybrid(imagenet_root, share))
    files.close()
    assert len(got) == len(expected) > 0
    for (a, y, i), (b, z, j) in zip(got, expected, strict=True):
        assert torch.equal(i, j) and torch.equal(y, z) and torch.equal(a, b)
