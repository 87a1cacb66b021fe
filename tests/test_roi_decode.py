"""Region-of-interest JPEG decoding (the ``fastload._jpeg`` C extension) on real files.

The contract: the region decoder's pixels are the pixels of a full decode (torchvision.io / PIL,
``draft`` for DCT-scaled sizes) cropped to the region, bit for bit; the fused transforms give the
same uint8 output with and without it; anything it does not take (PNG, CMYK, truncated or corrupt
files) goes to the reference decoders, which decide exactly as before.
"""

from __future__ import annotations

import io
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import fastload.decode
import fastload.fused
import fastload.transforms as fT
from fastload import rng
from fastload.decode import (
    DecodeError,
    decode_jpeg_region,
    decode_jpeg_tensor,
    decode_pil,
    jpeg_header,
    roi_decoder_available,
)
from fastload.synthetic import render_image
from fastload.transforms import CenterCrop, Compose, RandomHorizontalFlip, RandomResizedCrop, Resize

pytestmark = [
    pytest.mark.filterwarnings(
        "ignore:The image decoding and encoding capabilities of TorchVision:DeprecationWarning"
    ),
    pytest.mark.skipif(
        fastload.decode._jpeg is None, reason="fastload._jpeg was not built (no compiler or libjpeg headers)"
    ),
]

TRAIN = Compose([RandomResizedCrop(224), RandomHorizontalFlip()])
VAL = Compose([Resize(256), CenterCrop(224)])


def _encode(img: Image.Image, **save: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", **save)
    return buf.getvalue()


@pytest.fixture(scope="module")
def jpegs(imagenet_root: Path) -> dict[str, bytes]:
    """The synthetic tree's files plus JPEG variants libjpeg decodes differently."""
    files = {str(p.relative_to(imagenet_root)): p.read_bytes() for p in sorted(imagenet_root.rglob("*.JPEG"))}
    base = render_image((7, 1), 3, size=(333, 251))  # odd sizes: partial MCUs at the right and bottom
    files["444.JPEG"] = _encode(base, quality=92, subsampling="4:4:4")
    files["422.JPEG"] = _encode(base, quality=85, subsampling="4:2:2")
    files["420.JPEG"] = _encode(base, quality=75, subsampling="4:2:0")
    files["progressive.JPEG"] = _encode(base, quality=90, progressive=True)
    files["gray.JPEG"] = _encode(base.convert("L"), quality=90)
    files["big.JPEG"] = _encode(render_image((7, 2), 1, size=(1400, 1100)), quality=90)
    files["tiny.JPEG"] = _encode(render_image((7, 3), 1, size=(9, 7)), quality=90)
    return files


def _full_decode(data: bytes, scale: int) -> np.ndarray:
    img = Image.open(io.BytesIO(data))
    if scale > 1:
        img.draft("RGB", (max(1, img.width // scale), max(1, img.height // scale)))
    return np.asarray(img.convert("RGB"))


def test_header_matches_pil_and_declines_what_it_does_not_decode(jpegs: dict[str, bytes]) -> None:
    kinds = set()
    for name, data in jpegs.items():
        img = Image.open(io.BytesIO(data))
        header = jpeg_header(data)
        kinds.add((img.format, img.mode, header is None))
        if img.format == "JPEG" and img.mode in ("RGB", "L"):
            assert header is not None and header[:2] == img.size, name
        else:  # PNG named .JPEG, CMYK JPEG: PIL's business
            assert header is None, name
    assert {
        ("JPEG", "RGB", False),
        ("JPEG", "L", False),
        ("JPEG", "CMYK", True),
        ("PNG", "RGB", True),
    } <= kinds
    good = jpegs["420.JPEG"]
    assert jpeg_header(good[: len(good) // 2]) is None  # truncated: no end-of-image marker
    assert jpeg_header(b"not a jpeg at all") is None
    assert jpeg_header(b"") is None
    assert jpeg_header(np.frombuffer(good, dtype=np.uint8)) == (
        333,
        251,
        "YCbCr",
    )  # the in-memory dataset's arrays
    assert jpeg_header(memoryview(good)) == (333, 251, "YCbCr")


def test_regions_are_bit_identical_to_a_cropped_full_decode(jpegs: dict[str, bytes]) -> None:
    pick = random.Random(0)
    checked = 0
    for name, data in jpegs.items():
        if jpeg_header(data) is None:
            continue
        for scale in (1, 2, 4, 8):
            full = _full_decode(data, scale)
            H, W = full.shape[:2]
            width, height, _ = jpeg_header(data)
            if (W, H) != (-(-width // scale), -(-height // scale)):
                continue  # PIL's draft picked another scale (a 9x7 image at 1/8 is 1x1 < its minimum)
            regions = [(0, 0, W, H), (0, 0, 1, 1), (W - 1, H - 1, 1, 1), (W // 2, 0, W - W // 2, H)]
            for _ in range(6):
                w, h = pick.randint(1, W), pick.randint(1, H)
                regions.append((pick.randint(0, W - w), pick.randint(0, H - h), w, h))
            for left, top, w, h in regions:
                got = decode_jpeg_region(data, left, top, w, h, scale)
                assert got is not None and got.shape == (h, w, 3) and got.flags.writeable, (name, scale)
                np.testing.assert_array_equal(
                    got, full[top : top + h, left : left + w], err_msg=f"{name} 1/{scale} {(left, top, w, h)}"
                )
                checked += 1
    assert checked > 1000


def test_bad_regions_and_bytes_raise(jpegs: dict[str, bytes]) -> None:
    data = jpegs["420.JPEG"]
    with pytest.raises(ValueError, match="not inside the 333x251 image"):
        decode_jpeg_region(data, 300, 0, 34, 10)
    with pytest.raises(ValueError, match="not inside the 167x126 image decoded at 1/2"):
        decode_jpeg_region(data, 0, 0, 168, 10, scale=2)
    with pytest.raises(ValueError, match="scale should be 1, 2, 4 or 8"):
        decode_jpeg_region(data, 0, 0, 10, 10, scale=3)
    with pytest.raises(ValueError, match="empty"):
        decode_jpeg_region(data, 0, 0, 0, 10)
    with pytest.raises(ValueError, match="non-negative"):
        decode_jpeg_region(data, -1, 0, 10, 10)
    with pytest.raises(ValueError, match="not inside"):  # no unsigned wrap-around in C
        fastload.decode._jpeg.decode(data, 2**32 - 5, 0, 10, 10)
    with pytest.raises(fastload.decode._jpeg.Error):
        fastload.decode._jpeg.header(b"\xff\xd8garbage\xff\xd9")
    # Corrupt entropy data: libjpeg's warning makes the region decoder decline (None), never guess.
    corrupt = bytearray(data)
    sos = corrupt.index(b"\xff\xda")
    corrupt[sos + 200 : sos + 260] = b"\xff\x00\x12" * 20
    corrupt[-200:-2] = b"\xff\xd0" * 99  # stray restart markers
    assert decode_jpeg_region(bytes(corrupt), 0, 200, 333, 51) is None


@pytest.mark.parametrize(
    "pipe",
    [
        TRAIN,
        VAL,
        Compose([Resize(64), CenterCrop(64)]),
        Compose([Resize(80, interpolation="nearest"), CenterCrop(64)]),
    ],
    ids=["train", "val", "scaled", "nearest"],
)
def test_fused_transforms_give_the_same_bytes_with_and_without_it(
    jpegs: dict[str, bytes], pipe: fT.Transform, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's resampler (and reduced decoding) gives the same bytes from the decoded region as from
    the full decode; PIL's (the default for evaluation pipelines) is within 1 level: its resample of
    a region starts from a box offset by the region's origin, in float32."""
    for epoch in range(3):
        for index, (name, data) in enumerate(jpegs.items()):
            for kwargs in ({"resampler": "torch", "reduce": True}, {}):
                with rng.sample_scope(0, epoch, index):
                    fast = pipe.decode_and_apply(data, name, **kwargs)
                monkeypatch.setattr(fastload.decode, "USE_ROI_DECODE", False)
                with rng.sample_scope(0, epoch, index):
                    reference = pipe.decode_and_apply(data, name, **kwargs)
                monkeypatch.setattr(fastload.decode, "USE_ROI_DECODE", True)
                if kwargs or pipe.random:
                    assert torch.equal(fast, reference), (name, epoch, kwargs)
                else:
                    assert (fast.int() - reference.int()).abs().max() <= 1, (name, epoch)


def test_only_the_crop_is_decoded(jpegs: dict[str, bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, ...]] = []
    real = fastload.fused.decode_jpeg_region

    def spy(data: bytes, left: int, top: int, width: int, height: int, scale: int = 1) -> np.ndarray | None:
        calls.append((left, top, width, height, scale))
        return real(data, left, top, width, height, scale)

    monkeypatch.setattr(fastload.fused, "decode_jpeg_region", spy)
    data = jpegs["444.JPEG"]
    with rng.sample_scope(5, 0, 1):
        TRAIN.decode_and_apply(data, "444")
    top, left, h, w = TRAIN.plan(251, 333, rng.SampleRNG(5, 0, 1)).ops[0][1:]
    assert calls == [(left, top, w, h, 1)] and w * h < 333 * 251
    # A large crop of a large image: decoded whole at the DCT scale (Resize(64) of an 1100 px box: 1/8).
    calls.clear()
    Compose([Resize(64), CenterCrop(64)]).decode_and_apply(
        jpegs["big.JPEG"], "big", resampler="torch", reduce=True
    )
    assert calls == [(0, 0, 175, 138, 8)]
    # An evaluation pipeline decodes at full size by default: the box plus the filter's reach.
    calls.clear()
    Compose([Resize(64), CenterCrop(64)]).decode_and_apply(jpegs["big.JPEG"], "big")
    assert [c[-1] for c in calls] == [1] and calls[0][2] < 1400


def test_truncated_and_corrupt_files_behave_as_with_the_reference_decoders(
    jpegs: dict[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    good = jpegs["big.JPEG"]
    truncated = good[: len(good) * 3 // 4]
    # Even a crop in the intact top part fails: the file is broken, whatever the crop.
    top_only = Compose([CenterCrop((64, 64))])
    with pytest.raises(DecodeError, match="big-truncated"):
        Compose([RandomResizedCrop(32, scale=(0.001, 0.002))]).decode_and_apply(truncated, "big-truncated")
    for pipe in (TRAIN, VAL, top_only):
        results = []
        for roi in (True, False):
            monkeypatch.setattr(fastload.decode, "USE_ROI_DECODE", roi)
            with rng.sample_scope(0, 0, 0):
                try:
                    results.append(pipe.decode_and_apply(truncated, "big-truncated"))
                except DecodeError as e:
                    results.append(str(e))
        assert isinstance(results[0], str) and results[0] == results[1]
    # Corrupt entropy data with an intact end: whatever the reference decoders make of it.
    corrupt = bytearray(jpegs["420.JPEG"])
    sos = corrupt.index(b"\xff\xda")
    corrupt[sos + 300 : sos + 330] = bytes(range(30))
    for pipe in (TRAIN, VAL):
        outcomes = []
        for roi in (True, False):
            monkeypatch.setattr(fastload.decode, "USE_ROI_DECODE", roi)
            with rng.sample_scope(0, 0, 4):
                try:
                    outcomes.append(pipe.decode_and_apply(bytes(corrupt), "corrupt"))
                except DecodeError as e:
                    outcomes.append(str(e))
        if isinstance(outcomes[0], str):
            assert outcomes[0] == outcomes[1]
        else:
            assert torch.equal(outcomes[0], outcomes[1])


def test_decode_into_a_batch_slot_and_from_numpy_bytes(jpegs: dict[str, bytes]) -> None:
    data = jpegs["422.JPEG"]
    slot = np.zeros((224, 224, 3), dtype=np.uint8)
    with rng.sample_scope(1, 2, 3):
        TRAIN.decode_into(np.frombuffer(data, dtype=np.uint8).copy(), slot, "422")
    with rng.sample_scope(1, 2, 3):
        expected = TRAIN.decode_and_apply(data, "422")
    np.testing.assert_array_equal(slot, expected.permute(1, 2, 0).numpy())
    assert np.asarray(decode_pil(data)).shape == (251, 333, 3)


def test_environment_switch_turns_it_off() -> None:
    code = "import fastload.decode as d; print(d.roi_decoder_available())"
    env = dict(os.environ, FASTLOAD_ROI_DECODE="0")
    off = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()
    env["FASTLOAD_ROI_DECODE"] = "1"
    on = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert (off, on) == ("False", "True")
    assert roi_decoder_available()


def test_pils_decompression_bomb_check_still_applies(
    jpegs: dict[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    data = jpegs["420.JPEG"]  # 333x251 = 83,583 pixels
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 30_000)  # so this file is "a bomb" (> 2x the limit)
    assert jpeg_header(data) is None  # PIL decides
    errors = []
    for roi in (True, False):
        monkeypatch.setattr(fastload.decode, "USE_ROI_DECODE", roi)
        with pytest.raises(DecodeError, match="decompression bomb") as e:
            TRAIN.decode_and_apply(data, "bomb")
        errors.append(str(e.value))
    assert errors[0] == errors[1]


def test_mpo_files_take_the_jpeg_paths(jpegs: dict[str, bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    # MPO: the multi-picture JPEG phones and cameras write; PIL calls it "MPO", libjpeg a JPEG.
    first = render_image((7, 4), 2, size=(500, 375))
    buf = io.BytesIO()
    first.save(
        buf, format="MPO", save_all=True, append_images=[render_image((7, 5), 2, size=(500, 375))], quality=90
    )
    data = buf.getvalue()
    assert Image.open(io.BytesIO(data)).format == "MPO" and jpeg_header(data) is not None
    for pipe in (TRAIN, VAL):
        outs = []
        for roi in (True, False):
            monkeypatch.setattr(fastload.decode, "USE_ROI_DECODE", roi)
            with rng.sample_scope(0, 0, 2):
                outs.append(pipe.decode_and_apply(data, "mpo"))
        # PIL's resampler (evaluation) of the region is within 1 level of the full decode's
        assert (outs[0].int() - outs[1].int()).abs().max() <= (0 if pipe.random else 1)


def test_non_contiguous_arrays_decode(jpegs: dict[str, bytes]) -> None:
    data = jpegs["420.JPEG"]
    spread = np.zeros(2 * len(data), dtype=np.uint8)
    spread[::2] = np.frombuffer(data, dtype=np.uint8)
    strided = spread[::2]  # writable, not contiguous
    assert not strided.flags.c_contiguous
    expected = decode_jpeg_tensor(data)
    assert torch.equal(decode_jpeg_tensor(strided), expected)
    with rng.sample_scope(0, 0, 0):
        a = TRAIN.decode_and_apply(strided, "strided")
    with rng.sample_scope(0, 0, 0):
        b = TRAIN.decode_and_apply(data, "bytes")
    assert torch.equal(a, b)
