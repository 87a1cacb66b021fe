"""fastload.decode.decode_batch: batched decoding on the device (CPU tensors here, CUDA where present)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fastload import ImageFolder
from fastload.decode import DecodeError, decode_batch


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


def test_error_names_the_sample(imagenet_root: Path) -> None:
    ds = ImageFolder(imagenet_root / "val")
    encoded = [ds.get_bytes(0), b"\xff\xd8\xff\xe0 broken", ds.get_bytes(1)]
    with pytest.raises(DecodeError, match="broken.JPEG"):
        decode_batch(encoded, names=["a.JPEG", "broken.JPEG", "c.JPEG"])
    with pytest.raises(DecodeError, match="sample 1 of the batch"):
        decode_batch(encoded)
    with pytest.raises(ValueError, match="names should have one entry per image"):
        decode_batch(encoded, names=["a"])


@pytest.mark.cuda
def test_gpu_decode_matches_cpu(imagenet_root: Path) -> None:  # pragma: no cover - needs CUDA
    ds = ImageFolder(imagenet_root / "train")
    encoded = [ds.get_bytes(i) for i in range(len(ds))]
    cpu = decode_batch(encoded, "cpu")
    gpu = decode_batch(encoded, "cuda")
    for a, b in zip(cpu, gpu, strict=True):
        assert b.device.type == "cuda" and a.shape == b.shape
        # nvJPEG's IDCT/upsampling differs slightly from libjpeg-turbo's.
        assert (a.float() - b.cpu().float()).abs().mean() < 2.0
