"""fastload.gpu.decode.decode_batch: batched decoding on the device (CPU tensors here, CUDA where present)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fastload import ImageFolder
from fastload.decode import DecodeError, decode_jpeg_region, jpeg_header, roi_decoder_available
from fastload.gpu.decode import decode_batch

needs_c_extension = pytest.mark.skipif(not roi_decoder_available(), reason="the C extension is not built")


def _reference(data: bytes) -> np.ndarray:
    import io

    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def test_mixed_batch_matches_pil(imagenet_root: Path) -> None:
    """RGB and grayscale JPEGs, the CMYK JPEG and the PNG named .JPEG, in one batch."""
    ds = ImageFolder(imagenet_root / "train")
    encoded = [ds.get_bytes(i) for i in range(len(ds))]
    kinds = {Image.open(p).mode + Image.open(p).format for p, _ in ds.samples}
    assert {"RGBJPEG", "LJPEG", "CMYKJPEG", "RGBPNG"} <= kinds
    out = decode_batch(encoded, "cpu")
    assert len(out) == len(encoded)
    for data, image in zip(encoded, out, strict=True):
        assert image.dtype == torch.uint8 and image.shape[0] == 3
        assert np.array_equal(image.permute(1, 2, 0).numpy(), _reference(data))


@pytest.mark.parametrize("lists", [True, False])
def test_mixed_batch_with_and_without_torchvisions_batched_call(
    imagenet_root: Path, lists: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torchvision before 0.19 decodes one JPEG per call: the same images, and the same error."""
    import fastload.decode

    monkeypatch.setattr(fastload.decode, "_decode_jpeg_takes_lists", lambda: lists)
    ds = ImageFolder(imagenet_root / "train")
    encoded = [ds.get_bytes(i) for i in range(len(ds))]
    out = decode_batch(encoded, "cpu")
    for data, image in zip(encoded, out, strict=True):
        assert np.array_equal(image.permute(1, 2, 0).numpy(), _reference(data))
    with pytest.raises(DecodeError, match="sample 1 of the batch"):
        decode_batch([encoded[0], b"\xff\xd8\xff\xe0 broken"], "cpu", on_device=[True, True])


def test_error_names_the_sample(imagenet_root: Path) -> None:
    ds = ImageFolder(imagenet_root / "val")
    encoded = [ds.get_bytes(0), b"\xff\xd8\xff\xe0 broken", ds.get_bytes(1)]
    with pytest.raises(DecodeError, match="broken.JPEG"):
        decode_batch(encoded, names=["a.JPEG", "broken.JPEG", "c.JPEG"])
    with pytest.raises(DecodeError, match="sample 1 of the batch"):
        decode_batch(encoded)
    with pytest.raises(ValueError, match="names should have one entry per image"):
        decode_batch(encoded, names=["a"])


def _replicated_chroma(data: bytes) -> torch.Tensor | None:
    """libjpeg-turbo's decode with chroma samples replicated (no "fancy" upsampling): (3, H, W)."""
    header = jpeg_header(data)
    if header is None:
        return None
    width, height, _ = header
    pixels = decode_jpeg_region(data, 0, 0, width, height, fancy=False)
    return None if pixels is None else torch.from_numpy(pixels.copy()).permute(2, 0, 1)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The GPU decoder's bound: measured bit-identical on an H200 (nvJPEG against libjpeg-turbo
    with replicated chroma); a little room for another GPU's or libjpeg-turbo's IDCT rounding."""
    diff = (a.float() - b.float()).abs()
    return a.shape == b.shape and float(diff.mean()) <= 0.05 and float(diff.max()) <= 2


@needs_c_extension
def test_replicated_chroma_differs_from_fancy_upsampling_only_where_chroma_is_subsampled() -> None:
    from PIL import Image

    image = Image.effect_mandelbrot((96, 64), (-2.0, -1.0, 1.0, 1.0), 80).convert("RGB")
    image = Image.merge("RGB", (image.getchannel(0), image.getchannel(0).rotate(90), image.getchannel(0)))
    for subsampling, differs in ((2, True), (0, False)):  # 4:2:0, 4:4:4
        buf = io.BytesIO()
        image.save(buf, "JPEG", quality=90, subsampling=subsampling)
        fancy = decode_jpeg_region(buf.getvalue(), 0, 0, 96, 64)
        plain = decode_jpeg_region(buf.getvalue(), 0, 0, 96, 64, fancy=False)
        assert fancy is not None and plain is not None
        assert (not np.array_equal(fancy, plain)) == differs
        assert np.abs(fancy.astype(int) - plain.astype(int)).mean() < 8  # the same image


@pytest.mark.cuda
@needs_c_extension
def test_gpu_decode_matches_cpu(imagenet_root: Path) -> None:  # pragma: no cover - needs CUDA
    """nvJPEG's pixels are libjpeg-turbo's with replicated chroma (its upsampling; libjpeg-turbo's
    default, like PIL's and torchvision's CPU decode, is smooth "fancy" upsampling, which DALI can
    imitate with ``jpeg_fancy_upsampling``, torchvision's GPU decode cannot)."""
    ds = ImageFolder(imagenet_root / "train")
    encoded = [ds.get_bytes(i) for i in range(len(ds))]
    cpu = decode_batch(encoded, "cpu")
    gpu = [t.cpu() for t in decode_batch(encoded, "cuda")]
    compared = 0
    for data, a, b in zip(encoded, cpu, gpu, strict=True):
        assert a.shape == b.shape
        reference = _replicated_chroma(bytes(data))
        if reference is None:  # PNG, CMYK: decoded on the CPU for both
            assert torch.equal(a, b)
            continue
        compared += 1
        assert _close(reference, b)
        # the controls: the same decode shifted by a pixel, or mirrored, fails the bound
        assert not _close(reference[:, :, 1:], b[:, :, :-1]) and not _close(reference, b.flip(-1))
    assert compared >= len(encoded) // 2


@pytest.mark.parametrize("parser", ["c-extension", "pil"])
def test_header_columns_read_each_file_once_and_say_what_it_is(
    parser: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The size, coding and subsampling of each JPEG the device takes, from its header (the C
    extension's parser, or PIL's lazy open without it); the CPU's route for PNG and CMYK files."""
    import fastload.decode
    from fastload.gpu.decode import ROUTE_CPU, ROUTE_DEVICE, Headers

    if parser == "pil":
        monkeypatch.setattr(fastload.decode, "USE_ROI_DECODE", False)
    elif not roi_decoder_available():
        pytest.skip("the C extension is not built")

    def encoded(mode: str, fmt: str, size: tuple[int, int], **kwargs: object) -> bytes:
        buf = io.BytesIO()
        Image.new(mode, size, 128 if mode == "L" else None).save(buf, fmt, **kwargs)
        return buf.getvalue()

    files = [
        encoded("RGB", "JPEG", (64, 48), subsampling=2),
        encoded("RGB", "JPEG", (30, 20), subsampling=0, progressive=True),
        encoded("RGB", "JPEG", (17, 33), subsampling=1),
        encoded("L", "JPEG", (8, 9)),
        encoded("RGB", "PNG", (5, 5)),
        encoded("CMYK", "JPEG", (6, 6)),
    ]
    headers = Headers(10)
    indices = np.array([9, 2, 4, 0, 7, 5])
    headers.see(files, indices)
    assert headers.route[indices].tolist() == [ROUTE_DEVICE] * 4 + [ROUTE_CPU] * 2
    assert headers.on_device(indices) == [True] * 4 + [False] * 2
    assert headers.width[indices].tolist() == [64, 30, 17, 8, 0, 0]
    assert headers.height[indices].tolist() == [48, 20, 33, 9, 0, 0]
    assert headers.progressive[indices].tolist() == [1, 2, 1, 1, 0, 0]
    names = [Headers.SUBSAMPLING[s] for s in headers.subsampling[indices]]
    assert names == ["4:2:0", "4:4:4", "4:2:2", "gray", "unknown", "unknown"]
    assert (headers.route[[1, 3, 6, 8]] == 0).all()  # not seen: not read
    headers.see([b"not read again"] * 6, indices)  # seen samples are not parsed again
    assert headers.width[indices].tolist() == [64, 30, 17, 8, 0, 0]
