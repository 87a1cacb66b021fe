"""Fused decode + transform (fastload.decode, Transform.decode_and_apply / decode_into) on real files."""

from __future__ import annotations

import io
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _nosimd import run_without_simd
from PIL import Image
from torchvision.transforms import functional as F1
from torchvision.transforms.v2 import functional as F

import fastload.decode
import fastload.fused
import fastload.transforms as fT
from fastload import rng
from fastload.decode import DecodeError, dct_scale, decode_jpeg_tensor, decode_pil, load_sample, open_image
from fastload.imagefolder import ImageFolder
from fastload.synthetic import render_image
from fastload.transforms import CenterCrop, Compose, RandomHorizontalFlip, RandomResizedCrop, Resize

# torchvision 0.29 deprecates torchvision.io's decoders (fastload uses decode_jpeg while it exists).
pytestmark = pytest.mark.filterwarnings(
    "ignore:The image decoding and encoding capabilities of TorchVision:DeprecationWarning"
)

TRAIN = Compose([RandomResizedCrop(224), RandomHorizontalFlip()])
VAL = Compose([Resize(256), CenterCrop(224)])


def _jpeg(img: Image.Image, quality: int = 90, mode: str | None = None) -> bytes:
    buf = io.BytesIO()
    (img.convert(mode) if mode else img).save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


@pytest.fixture(scope="module")
def samples(imagenet_root: Path) -> dict[str, bytes]:
    """Every file of the session's synthetic tree plus tiny, huge, gray-huge and CMYK-huge JPEGs."""
    files = {str(p.relative_to(imagenet_root)): p.read_bytes() for p in sorted(imagenet_root.rglob("*.JPEG"))}
    kinds = {f"{Image.open(io.BytesIO(d)).format}/{Image.open(io.BytesIO(d)).mode}" for d in files.values()}
    assert {"JPEG/RGB", "JPEG/L", "JPEG/CMYK", "PNG/RGB"} <= kinds  # the ImageNet quirks are there
    big = render_image((5, 1), 2, size=(1400, 1100))
    files["tiny.JPEG"] = _jpeg(render_image((5, 2), 1, size=(60, 45)))
    files["tiny_tall.JPEG"] = _jpeg(render_image((5, 3), 1, size=(20, 90)))
    files["big.JPEG"] = _jpeg(big)
    files["big_gray.JPEG"] = _jpeg(big, mode="L")
    files["big_cmyk.JPEG"] = _jpeg(big, mode="CMYK")
    png = io.BytesIO()
    render_image((5, 4), 3, size=(1100, 900)).save(png, format="PNG", compress_level=1)
    files["big_png.JPEG"] = png.getvalue()
    return files


def _reference(pipe: fT.Transform, data: bytes, index: int) -> torch.Tensor:
    """torchvision at the same parameters: full PIL decode to RGB, then torchvision's functional ops,
    on the PIL image where fastload resizes as PIL does (``resampler="auto"`` with the C extension),
    else on the uint8 tensor."""
    if fastload.decode.pil_resample_available():
        pil = decode_pil(data)
        plan = pipe.plan(pil.height, pil.width, rng.SampleRNG(0, 0, index))
        for op in plan.ops:
            if op[0] == "crop":
                pil = F1.crop(pil, *op[1:])
            elif op[0] == "resize":
                pil = F1.resize(pil, [op[1], op[2]], interpolation=F1.InterpolationMode.BILINEAR)
            elif op[0] == "center_crop":
                pil = F1.center_crop(pil, [op[1], op[2]])
            else:
                pil = F1.hflip(pil)
        return F1.pil_to_tensor(pil)
    img = torch.from_numpy(np.array(decode_pil(data))).permute(2, 0, 1)
    plan = pipe.plan(img.shape[1], img.shape[2], rng.SampleRNG(0, 0, index))
    for op in plan.ops:
        if op[0] == "crop":
            img = F.crop(img, *op[1:])
        elif op[0] == "resize":
            img = F.resize(img, [op[1], op[2]], antialias=True)
        elif op[0] == "center_crop":
            img = F.center_crop(img, [op[1], op[2]])
        else:
            img = F.horizontal_flip(img)
    return img


def _dct_scaled(pipe: fT.Transform, data: bytes, index: int) -> bool:
    img = open_image(data)
    plan = pipe.plan(img.height, img.width, rng.SampleRNG(0, 0, index))
    x0, y0, x1, y1 = plan.box
    return img.format == "JPEG" and plan.fusable and dct_scale(x1 - x0, y1 - y0, plan.width, plan.height) > 1


@pytest.mark.parametrize("pipe", [TRAIN, VAL], ids=["train", "val"])
def test_fused_path_is_close_to_torchvision(samples: dict[str, bytes], pipe: fT.Transform) -> None:
    diffs, scaled = [], 0
    for index, (name, data) in enumerate(samples.items()):
        with rng.sample_scope(0, 0, index):
            got = pipe.decode_and_apply(data, name)
        ref = _reference(pipe, data, index)
        assert got.dtype == torch.uint8 and got.shape == (3, 224, 224), name
        d = float((got.int() - ref.int()).abs().float().mean())
        diffs.append(d)
        if _dct_scaled(pipe, data, index):
            scaled += 1
            # Reduced-size decoding filters differently from a full-size antialiased resize: on this
            # grain-heavy synthetic content, 1.5 to 8 levels per image (bench/decode.py reports it).
            assert d < 12, (name, d)
        else:
            assert d < 1.0, (name, d)  # same decoder, same resampling maths: rounding only
    assert scaled >= 3  # the large files really take the reduced path
    assert np.mean(diffs) < 3, diffs


def test_dct_scaling_is_applied_for_large_crops_only(
    samples: dict[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[int, int, tuple[int, int]]] = []
    real = fastload.fused.load_reduced

    def spy(img: Image.Image, scale: int, name: str = "image", data: Any = None) -> tuple[Image.Image, int]:
        loaded, applied = real(img, scale, name, data)
        calls.append((scale, applied, loaded.size))
        return loaded, applied

    monkeypatch.setattr(fastload.fused, "load_reduced", spy)
    monkeypatch.setattr(
        fastload.decode, "USE_ROI_DECODE", False
    )  # the PIL path (test_roi_decode covers the other)
    big = samples["big.JPEG"]  # 1400x1100 (reduce=True: evaluation pipelines decode at full size by default)
    # Resize(224)+CenterCrop(224): the 1100x1100 box -> 224 allows 1/4 (275 >= 224), not 1/8.
    Compose([Resize(224), CenterCrop(224)]).decode_and_apply(big, "big", reduce=True)
    assert calls[-1] == (4, 4, (350, 275))
    # A 64 px output from the same box: 1/8 (137 >= 64).
    Compose([Resize(64), CenterCrop(64)]).decode_and_apply(big, "big", reduce=True)
    assert calls[-1] == (8, 8, (175, 138))
    # Gray and CMYK JPEGs are scaled too.
    Compose([Resize(224), CenterCrop(224)]).decode_and_apply(samples["big_gray.JPEG"], "gray", reduce=True)
    assert calls[-1] == (4, 4, (350, 275))
    Compose([Resize(224), CenterCrop(224)]).decode_and_apply(samples["big_cmyk.JPEG"], "cmyk", reduce=True)
    assert calls[-1] == (4, 4, (350, 275))
    # A PNG has no DCT scaling: decoded at full size.
    Compose([Resize(224), CenterCrop(224)]).decode_and_apply(samples["big_png.JPEG"], "png", reduce=True)
    assert calls[-1][1:] == (1, (1100, 900))
    # Not when it would make the crop smaller than the output: a 943 px box for a 600 px output.
    n = len(calls)
    out = Compose([Resize(700), CenterCrop(600)]).decode_and_apply(big, "big", reduce=True)
    assert out.shape == (3, 600, 600)
    assert all(c[1] == 1 for c in calls[n:])  # full-size decode (or the torchvision.io path: no call)
    # Nor for non-antialiased / nearest resizing, where the DCT's averaging would change the result.
    n = len(calls)
    Compose([Resize(64, antialias=False), CenterCrop(64)]).decode_and_apply(
        samples["big_cmyk.JPEG"], "cmyk", reduce=True
    )
    Compose([Resize(64, interpolation="nearest"), CenterCrop(64)]).decode_and_apply(
        samples["big_cmyk.JPEG"], "cmyk", reduce=True
    )
    assert [c[1] for c in calls[n:]] == [1, 1]


def test_dct_scaled_result_is_geometrically_exact() -> None:
    """On smooth content (little energy the DCT drops), the 1/4 decode matches the full-size reference."""
    y, x = np.mgrid[0:1200, 0:1600].astype(np.float32)
    arr = np.stack([x / 1600 * 255, y / 1200 * 255, (np.sin(x / 90) * np.cos(y / 70) + 1) * 127], axis=-1)
    img = Image.fromarray(arr.clip(0, 255).astype(np.uint8))
    data = _jpeg(img, quality=95)
    for pipe in (
        Compose([Resize(224), CenterCrop(224)]),
        Compose([RandomResizedCrop(128, scale=(0.5, 1.0)), RandomHorizontalFlip()]),
    ):
        for index in range(4):
            with rng.sample_scope(0, 0, index):
                got = pipe.decode_and_apply(data, "smooth")
            assert _dct_scaled(pipe, data, index)
            ref = _reference(pipe, data, index)
            # A box misplaced by one reduced pixel (4 source pixels) would give about 2 levels here.
            assert float((got.int() - ref.int()).abs().float().mean()) < 0.6


@pytest.mark.parametrize(
    "pipe",
    [TRAIN, VAL, Compose([RandomHorizontalFlip(1.0), CenterCrop(100)]), Compose([CenterCrop(300)])],
    ids=["train", "val", "flip-crop", "pad"],
)
def test_decode_into_writes_what_decode_and_apply_returns(
    samples: dict[str, bytes], pipe: fT.Transform
) -> None:
    size = pipe.output_size
    assert size is not None
    buf = np.full((len(samples),) + size + (3,), 7, dtype=np.uint8)
    for index, (name, data) in enumerate(samples.items()):
        with rng.sample_scope(2, 1, index):
            pipe.decode_into(data, buf[index], name)
        with rng.sample_scope(2, 1, index):
            chw = pipe.decode_and_apply(data, name)
        assert torch.equal(torch.from_numpy(buf[index]).permute(2, 0, 1), chw), name
        assert np.array_equal(buf[index], chw.permute(1, 2, 0).numpy())


def test_grayscale_cmyk_and_png_come_out_rgb(samples: dict[str, bytes]) -> None:
    for name in ("big_gray.JPEG", "big_cmyk.JPEG", "big_png.JPEG", "tiny.JPEG"):
        with rng.sample_scope(0, 0, 1):
            out = VAL.decode_and_apply(samples[name], name)
        assert out.shape == (3, 224, 224) and out.dtype == torch.uint8
    gray = VAL.decode_and_apply(samples["big_gray.JPEG"], "gray")
    assert torch.equal(gray[0], gray[1]) and torch.equal(gray[1], gray[2])


def test_same_scope_is_bitwise_identical_and_thread_independent(samples: dict[str, bytes]) -> None:
    items = list(samples.items())[:12] + [("big.JPEG", samples["big.JPEG"])]

    def run(results: list[torch.Tensor], indices: range) -> None:
        for i in indices:
            with rng.sample_scope(9, 3, i):
                results.append(TRAIN.decode_and_apply(items[i][1], items[i][0]))

    first: list[torch.Tensor] = []
    run(first, range(len(items)))
    again: list[torch.Tensor] = []
    run(again, range(len(items)))
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=False))
    halves: list[list[torch.Tensor]] = [[], []]
    threads = [threading.Thread(target=run, args=(halves[k], range(k, len(items), 2))) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    threaded = [None] * len(items)
    for k in range(2):
        for j, i in enumerate(range(k, len(items), 2)):
            threaded[i] = halves[k][j]  # type: ignore[call-overload]
    assert all(torch.equal(a, b) for a, b in zip(first, threaded, strict=False))  # type: ignore[arg-type]
    data = samples["big.JPEG"]
    with rng.sample_scope(9, 3, 0):
        a = TRAIN.decode_and_apply(data)
    with rng.sample_scope(9, 3, 1):
        b = TRAIN.decode_and_apply(data)
    assert not torch.equal(a, b)


def test_bytes_memoryview_and_array_inputs_agree(samples: dict[str, bytes]) -> None:
    for name in ("big.JPEG", "tiny.JPEG", "big_png.JPEG"):
        data = samples[name]
        outs = []
        for d in (
            data,
            memoryview(data),
            np.frombuffer(data, dtype=np.uint8),
            np.frombuffer(data, dtype=np.uint8).copy(),
        ):
            with rng.sample_scope(0, 0, 5):
                outs.append(TRAIN.decode_and_apply(d, name))
        assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_torchvision_io_decode_is_bit_identical_to_pil(samples: dict[str, bytes]) -> None:
    for name in ("big.JPEG", "big_gray.JPEG", "tiny.JPEG"):
        t = decode_jpeg_tensor(samples[name], name)
        assert np.array_equal(t.permute(1, 2, 0).numpy(), np.asarray(decode_pil(samples[name])))


@pytest.mark.parametrize(
    "make_bad",
    [
        lambda good: good[: len(good) // 2],  # truncated JPEG (torchvision.io path)
        lambda good: b"this is not an image at all",
        lambda good: b"",
        lambda good: good[:300],  # header only
        lambda good: good[:2] + bytes(range(256)) * 20,  # JPEG magic, garbage after
    ],
    ids=["truncated", "text", "empty", "header-only", "garbage"],
)
@pytest.mark.parametrize("which", ["big.JPEG", "tiny.JPEG"])
def test_corrupt_files_raise_decode_error_naming_the_sample(
    samples: dict[str, bytes], make_bad, which: str
) -> None:  # type: ignore[no-untyped-def]
    bad = make_bad(samples[which])
    name = "sample 17 ('/data/train/n01/x.JPEG')"
    for pipe in (TRAIN, VAL, Compose([Resize(64), CenterCrop(64)])):  # the last one takes the 1/8 path
        with pytest.raises(
            DecodeError, match=r"sample 17 \('/data/train/n01/x\.JPEG'\).*Remove or replace the file"
        ):
            with rng.sample_scope(0, 0, 0):
                pipe.decode_and_apply(bad, name)
        with pytest.raises(DecodeError, match="sample 17"):
            size = pipe.output_size
            assert size is not None
            pipe.decode_into(bad, np.empty(size + (3,), np.uint8), name)


def test_truncated_large_jpeg_on_the_reduced_path(samples: dict[str, bytes]) -> None:
    bad = samples["big.JPEG"][: len(samples["big.JPEG"]) * 2 // 3]
    with pytest.raises(DecodeError, match="big-truncated"):
        Compose([Resize(64), CenterCrop(64)]).decode_and_apply(bad, "big-truncated")


def test_decode_into_checks_out() -> None:
    data = _jpeg(render_image((1, 1), 0, size=(300, 200)))
    with pytest.raises(ValueError, match=r"out should have shape \(224, 224, 3\).*out.shape=\(224, 224\)"):
        TRAIN.decode_into(data, np.empty((224, 224), np.uint8), "x")
    with pytest.raises(TypeError, match="uint8"):
        TRAIN.decode_into(data, np.empty((224, 224, 3), np.float32), "x")
    with pytest.raises(ValueError, match="fixed output_size"):
        Resize(256).decode_into(data, np.empty((224, 224, 3), np.uint8), "x")
    out = np.empty((256, 384, 3), np.uint8)  # a pipeline without fixed size still works when out fits
    Resize(256).decode_into(data, out, "x")
    batch = torch.zeros(2, 224, 224, 3, dtype=torch.uint8)  # a CPU tensor slot is written in place
    with rng.sample_scope(0, 0, 1):
        TRAIN.decode_into(data, batch[1], "x")
    with rng.sample_scope(0, 0, 1):
        assert torch.equal(batch[1].permute(2, 0, 1), TRAIN.decode_and_apply(data, "x"))
    assert not batch[0].any()
    with pytest.raises(TypeError, match="float32"):
        TRAIN.decode_into(data, torch.zeros(224, 224, 3), "x")


def test_dct_scale() -> None:
    assert dct_scale(1200, 900, 224, 224) == 4
    assert dct_scale(400, 300, 224, 224) == 1
    assert dct_scale(448, 448, 224, 224) == 2
    assert dct_scale(447, 448, 224, 224) == 1
    assert dct_scale(5000, 5000, 224, 224) == 8


def test_load_sample_and_image_folder_use_the_fused_path(imagenet_root: Path) -> None:
    data = next((imagenet_root / "val").rglob("*.JPEG")).read_bytes()
    with rng.sample_scope(0, 0, 0):
        a = load_sample(data, TRAIN, "s")
    with rng.sample_scope(0, 0, 0):
        b = TRAIN.decode_and_apply(data, "s")
    assert torch.equal(a, b)
    ds = ImageFolder(imagenet_root / "val", transform=VAL)
    img, target = ds[0]
    assert isinstance(img, torch.Tensor) and img.shape == (3, 224, 224) and img.dtype == torch.uint8
    assert isinstance(load_sample(data, None, "s"), Image.Image)


def test_without_torchvision_io_pil_decodes_the_same_crops(
    samples: dict[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """torchvision.io's decoders are deprecated: without them every file takes the PIL path, same result."""
    items = [(n, d) for n, d in samples.items() if Image.open(io.BytesIO(d)).format == "JPEG"][:10]
    with_tv = []
    for index, (name, data) in enumerate(items):
        with rng.sample_scope(0, 0, index):
            with_tv.append(TRAIN.decode_and_apply(data, name))
    monkeypatch.setattr(fastload.fused, "torchvision_jpeg_available", lambda: False)
    for index, (name, data) in enumerate(items):
        with rng.sample_scope(0, 0, index):
            pil = TRAIN.decode_and_apply(data, name)
        assert pil.shape == with_tv[index].shape
        assert float((pil.int() - with_tv[index].int()).abs().float().mean()) < 1.0, name


# ------------------------------------------------------------------------- PIL's resample, in C

needs_c = pytest.mark.skipif(
    not fastload.decode.roi_decoder_available(), reason="the C extension (fastload._jpeg) is not built"
)


@needs_c
def test_c_resample_gives_pils_bytes() -> None:
    """Random images, boxes and sizes, up and down, both filters, mirrored or not: Pillow's bytes
    (both orders of its two passes occur: Pillow 13 runs the vertical pass first when the height
    shrinks much more than the width). The last cases are ImageNet-sized: rows in several blocks,
    lanes in the vector kernel and in its tail."""
    _check_c_resample(cases=400)


def _check_c_resample(cases: int) -> None:
    assert fastload.decode._pil_pass_order() is not None, "the installed Pillow's resample is not reproduced"
    rng = np.random.default_rng(0)
    for case in range(cases):
        h, w = (int(v) for v in rng.integers(1, 120 if case < cases - 40 else 600, 2))
        pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        if case % 2:  # smooth content as well as noise
            pixels = np.asarray(Image.fromarray(pixels).resize((w, h), box=(0, 0, w / 3, h / 3)))
        x0, y0 = float(rng.uniform(0, w / 2)), float(rng.uniform(0, h / 2))
        box = (x0, y0, float(rng.uniform(x0, w)), float(rng.uniform(y0, h)))
        if case % 5 == 0:
            box = (0.0, 0.0, float(w), float(h))
        size = (int(rng.integers(1, 160)), int(rng.integers(1, 160)))
        name = ("bilinear", "bicubic")[case % 3 % 2]
        flip = bool(case % 4 < 2)
        ref = Image.fromarray(pixels).resize(size, fastload.fused._PIL_FILTERS[name], box=box)
        if flip:
            ref = ref.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        out = np.empty((size[1], size[0], 3), dtype=np.uint8)
        assert fastload.decode.pil_resample(np.ascontiguousarray(pixels), box, name, flip, out)
        assert np.array_equal(out, np.asarray(ref)), f"case {case}: {(w, h)} {box} -> {size} {name} {flip}"


@needs_c
def test_c_resample_without_simd_gives_pils_bytes() -> None:
    """The portable loop (machines without AVX2; forced here by FASTLOAD_NO_SIMD) gives the same
    bytes. In a fresh process: the extension reads the variable once."""
    code = (
        "import fastload.decode as d, tests.test_decode as t\n"
        "assert not d._jpeg.simd(), 'FASTLOAD_NO_SIMD did not turn the AVX2 kernel off'\n"
        "t._check_c_resample(cases=120)"
    )
    run_without_simd(code, timeout=300)


@needs_c
def test_c_resample_declines_what_it_does_not_reproduce(
    samples: dict[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Other filters, non-contiguous arrays and an unknown Pillow fall back to PIL (same pixels)."""
    pixels = np.zeros((10, 12, 3), dtype=np.uint8)
    out = np.empty((5, 6, 3), dtype=np.uint8)
    assert not fastload.decode.pil_resample(pixels, (0, 0, 12, 10), "nearest", False, out)
    assert not fastload.decode.pil_resample(pixels[:, ::2], (0, 0, 6, 10), "bilinear", False, out)
    tf = Compose([Resize(40), CenterCrop(32)])
    data = next(iter(samples.values()))
    used: list[bool] = []

    def spy(*args: Any) -> bool:  # the resize + crop: the C extension's window of the whole resize
        used.append(fastload.decode.pil_resample_window(*args))
        return used[-1]

    monkeypatch.setattr(fastload.fused, "pil_resample_window", spy)
    fast = tf.decode_and_apply(data, resampler="pil", reduce=False)
    assert used == [True]  # the C resampler ran
    monkeypatch.setattr(fastload.decode, "_PIL_ORDER", [None])  # as with a Pillow it does not reproduce
    assert not fastload.decode.pil_resample(pixels, (0, 0, 12, 10), "bilinear", False, out)
    assert not fastload.decode.pil_resample_window(
        pixels, (0, 0), (12, 10), (6, 5), (0, 0), "bilinear", False, out
    )
    assert torch.equal(tf.decode_and_apply(data, resampler="pil", reduce=False), fast)
    assert used == [True, False]  # it declined; PIL ran (op by op), with the same pixels


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic"])
def test_evaluation_pipelines_give_torchvisions_pil_pixels_by_default(
    samples: dict[str, bytes], interpolation: str
) -> None:
    """A deterministic pipeline (Resize + CenterCrop) decodes at full size and resizes as PIL does:
    torchvision's pipeline on the PIL image (``ImageFolder``'s) bit for bit, large, gray, CMYK and
    PNG files included."""
    import torchvision.transforms as v1

    assert not Compose([Resize(64), CenterCrop(56)]).random and Compose([RandomResizedCrop(8)]).random
    pipe = Compose([Resize(64, interpolation=interpolation), CenterCrop(56)])
    mode = {"bilinear": v1.InterpolationMode.BILINEAR, "bicubic": v1.InterpolationMode.BICUBIC}[interpolation]
    torchvision_val = v1.Compose([v1.Resize(64, interpolation=mode), v1.CenterCrop(56), v1.PILToTensor()])
    worst = 0
    for name, data in samples.items():
        reference = torchvision_val(decode_pil(data))
        got = pipe.decode_and_apply(data, name)
        worst = max(worst, int((got.int() - reference.int()).abs().max()))
    assert worst == 0


@needs_c
@pytest.mark.parametrize("filter", ["bilinear", "bicubic"])
def test_resample_window_is_pils_resize_then_crop(filter: str) -> None:
    """The whole resize's window, from the whole image or a region holding its taps; both passes, the
    width or the height kept (one pass), flipped; a region missing taps is declined."""
    rng = np.random.default_rng(0)
    resample = {"bilinear": Image.Resampling.BILINEAR, "bicubic": Image.Resampling.BICUBIC}[filter]
    cases = [
        ((500, 375), (341, 256)),
        ((375, 500), (224, 298)),
        ((343, 256), (343, 232)),
        ((300, 400), (120, 400)),
    ]
    cases += [((60, 40), (150, 100))]  # an enlargement
    for (w, h), (fw, fh) in cases:
        pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        full = np.asarray(Image.fromarray(pixels).resize((fw, fh), resample))
        for cw, ch, flip in ((min(fw, 224), min(fh, 224), False), (min(fw, 50), min(fh, 30), True)):
            left, top = (fw - cw) // 3, (fh - ch) // 2
            want = full[top : top + ch, left : left + cw]
            want = want[:, ::-1] if flip else want
            out = np.empty((ch, cw, 3), dtype=np.uint8)
            assert fastload.decode.pil_resample_window(
                pixels, (0, 0), (w, h), (fw, fh), (left, top), filter, flip, out
            )
            assert np.array_equal(out, want), ((w, h), (fw, fh), (cw, ch))
            x0, y0 = int(left * w / fw) - 8, int(top * h / fh) - 8
            x0, y0 = max(0, x0), max(0, y0)
            x1, y1 = min(w, int((left + cw) * w / fw) + 9), min(h, int((top + ch) * h / fh) + 9)
            region = np.ascontiguousarray(pixels[y0:y1, x0:x1])
            out[:] = 0
            if fastload.decode.pil_resample_window(
                region, (x0, y0), (w, h), (fw, fh), (left, top), filter, flip, out
            ):
                assert np.array_equal(out, want)
            else:  # only where the region misses a tap (a filter wider than the margin)
                assert w / fw > 3 or h / fh > 3
    tight = np.ascontiguousarray(pixels[10:20, 10:20])
    assert not fastload.decode.pil_resample_window(
        tight, (10, 10), (60, 40), (150, 100), (0, 0), filter, False, out
    )


@needs_c
@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic"])
def test_training_pipelines_give_torchvisions_pil_pixels_at_full_size(
    samples: dict[str, bytes], interpolation: str
) -> None:
    """RandomResizedCrop + flip at full-size decoding resize as PIL does after torchvision's crop
    (the filter stops at the crop's edges, not at the image's): the same bytes as torchvision's
    chain on the PIL image, for every file (large, gray, CMYK, PNG); without reduce=False, images
    with a large crop decode at a reduced DCT scale (another test bounds that)."""
    pipe = Compose([RandomResizedCrop(48, interpolation=interpolation), RandomHorizontalFlip()])
    mode = {"bilinear": F1.InterpolationMode.BILINEAR, "bicubic": F1.InterpolationMode.BICUBIC}[interpolation]
    for index, (name, data) in enumerate(samples.items()):
        with rng.sample_scope(0, 0, index):
            got = pipe.decode_and_apply(data, name, reduce=False)
        pil = decode_pil(data)
        plan = pipe.plan(pil.height, pil.width, rng.SampleRNG(0, 0, index))
        assert plan.ops[0][0] == "crop" or plan.ops[0][0] == "resize", plan.ops
        for op in plan.ops:
            if op[0] == "crop":
                pil = F1.crop(pil, *op[1:])
            elif op[0] == "resize":
                pil = F1.resize(pil, [op[1], op[2]], interpolation=mode)
            else:
                pil = F1.hflip(pil)
        assert torch.equal(got, F1.pil_to_tensor(pil)), name
