"""nvImageCodec for the device paths (decode="device" / "hybrid"): region-of-interest decoding of
each sample's crop box, the decoder named, the CPU for what it does not decode; on CPU with a
stand-in module that decodes with PIL (tests/_fakenvimgcodec.py)."""

from __future__ import annotations

import io
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _fakenvimgcodec as fake
import numpy as np
import pytest
import torch
from PIL import Image

import fastload
import fastload._iterator
from fastload import gpu
from fastload.gpu import nvimgcodec
from fastload.gpu.decode import GIVE_UP_AFTER, BatchDecoder, device_decoder


@pytest.fixture
def stand_in() -> Iterator[Any]:
    fake.Decoder.made.clear()
    fake.Decoder.refuse_progressive = fake.Decoder.refuse_all = False
    fake.Decoder.refuse_every = fake.Decoder.pitch = 0
    fake.Decoder.ignore_images = False
    fake.Decoder.ignore_images_after = None
    with nvimgcodec.use_module(fake):
        yield fake
    fake.Decoder.refuse_progressive = fake.Decoder.refuse_all = False
    fake.Decoder.refuse_every = fake.Decoder.pitch = 0
    fake.Decoder.ignore_images = False
    fake.Decoder.ignore_images_after = None


@pytest.fixture
def experimental(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decoding the crops in place is experimental (never measured on a GPU): on for the test."""
    monkeypatch.setenv("FASTLOAD_GPU_EXPERIMENTAL", "1")


def _pipeline() -> gpu.Compose:
    return gpu.Compose(
        [gpu.RandomResizedCrop(24), gpu.RandomHorizontalFlip(), gpu.Normalize([0.0], [1 / 255])]
    )


def _loader(root: Path, decode: str = "device", **kwargs: Any) -> fastload.DataLoader[Any]:
    ds = fastload.InMemoryImageFolder(root / "train")
    options: dict[str, Any] = dict(batch_size=4, shuffle=True, seed=3, num_workers=1, device="cpu")
    return fastload.DataLoader(ds, decode=decode, gpu_transforms=_pipeline(), **{**options, **kwargs})


def _take(loader: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = [(b[0].clone(), b[1].clone()) for b in loader]
    loader.close()
    return out


def test_without_the_module_or_a_cuda_device_torchvision_decodes(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not nvimgcodec.available("cpu")  # nvImageCodec needs CUDA
    monkeypatch.setenv("FASTLOAD_NVIMGCODEC", "0")
    nvimgcodec._imported.cache_clear()
    try:
        assert not nvimgcodec.available("cuda")
        assert "torchvision.io.decode_jpeg" in device_decoder("cuda") or "PIL" in device_decoder("cuda")
    finally:
        nvimgcodec._imported.cache_clear()


def test_an_nvimgcodec_older_than_09_is_named_and_torchvision_decodes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """0.8's decode parameters have no sample_format, which fastload uses: such an install is
    not taken (its decoder could not be made), and ``loader.decoder`` says why and how to fix it."""
    import types

    old = types.SimpleNamespace(__version__="0.8.0", as_images=None)
    monkeypatch.setattr(nvimgcodec, "_imported", lambda: old)
    assert not nvimgcodec.available("cuda") and nvimgcodec.too_old()
    said = device_decoder("cuda")
    assert "nvImageCodec 0.8.0 is installed, but fastload needs 0.9 or later: pip install -U" in said
    monkeypatch.setattr(old, "__version__", "0.9.0")
    assert nvimgcodec.available("cuda") and not nvimgcodec.too_old() and not nvimgcodec.available("cpu")


def test_only_each_crop_box_is_decoded_and_the_batches_are_the_same(
    imagenet_root: Path, stand_in: Any
) -> None:
    """With a region decoder, each device-decoded sample's box is drawn from its size in the header
    columns before decoding, only that region (and a pixel around it, where the image has one) is
    decoded, and the crop is only resized: the batches equal those of decoding whole images and
    cropping them (torchvision's decoder)."""
    with nvimgcodec.use_module(None):
        reference = _take(_loader(imagenet_root))
    loader = _loader(imagenet_root)
    assert "nvImageCodec 0.9.0-stand-in" in loader.decoder
    got = _take(loader)
    (decoder,) = stand_in.Decoder.made  # one, made in the decoder thread
    assert decoder.options == ":fancy_upsampling=1 :enable_roi_fancy_upsampling=1" == nvimgcodec.OPTIONS
    assert [b.backend_kind.name for b in decoder.backends] == ["HW_GPU_ONLY", "GPU_ONLY", "HYBRID_CPU_GPU"]
    regions = [r for call in decoder.calls for r in call]
    headers = fastload._iterator.decode_headers(loader)
    assert len(regions) == int((headers.route == 1).sum()) and None not in regions  # every JPEG: its box
    crop = gpu.RandomResizedCrop(24)
    ds = fastload.InMemoryImageFolder(imagenet_root / "train")
    order = fastload.rng.epoch_permutation(len(ds), 3, 0).numpy()
    device_routed = [int(i) for i in order if headers.route[i] == 1]
    margins: set[int] = set()
    for (start, end), i in zip(regions, device_routed, strict=True):
        with Image.open(io.BytesIO(bytes(ds.get_bytes(i)))) as img:
            top, left, h, w = (
                int(a[0]) for a in crop.boxes([img.height], [img.width], indices=[i], epoch=0, seed=3)
            )
            bottom, right = min(img.height, top + h + 1), min(img.width, left + w + 1)
        assert (start, end) == ((max(0, top - 1), max(0, left - 1)), (bottom, right))
        margins.update((top - start[0], left - start[1], bottom - top - h, right - left - w))
    assert margins == {0, 1}  # a pixel around the box, none where it touches the image's edge
    for (x, y), (rx, ry) in zip(got, reference, strict=True):
        assert torch.equal(y, ry)
        assert (x - rx).abs().max() <= 1.0  # resizing the box alone: the same taps (float rounding at most)


def test_a_decoder_that_refuses_most_of_a_batch_is_given_up_with_one_warning(
    imagenet_root: Path, stand_in: Any
) -> None:
    """Never a silent slow path: where nvImageCodec returns nothing for valid JPEGs (as nvJPEG
    before 13.2 does for regions with fancy upsampling unless enabled), the CPU decodes them, and
    once it has refused most of 16 or more, one warning says so and torchvision's decoder takes the
    next batches: the same batches. One refused file among many is decoded on the CPU, no more."""
    with nvimgcodec.use_module(None):
        reference = _take(_loader(imagenet_root))
    stand_in.Decoder.refuse_all = True
    loader = _loader(imagenet_root)
    with pytest.warns(UserWarning, match=r"nvImageCodec decoded only 0 of the \d+ JPEGs") as caught:
        got = _take(loader)
    assert len([w for w in caught if "nvImageCodec decoded only" in str(w.message)]) == 1
    (decoder,) = stand_in.Decoder.made
    given = np.cumsum([len(call) for call in decoder.calls])  # batches of 4: given up after 16 JPEGs
    assert given[-1] >= GIVE_UP_AFTER > given[-2] and len(decoder.calls) < len(got)
    assert loader._decoder.refused == loader._decoder.asked == given[-1] and not loader._decoder.regions
    assert "torchvision.io.decode_jpeg" in loader.decoder and not loader.decoder.startswith("nvImageCodec")
    for (x, y), (rx, ry) in zip(got, reference, strict=True):
        assert torch.equal(y, ry) and (x - rx).abs().max() <= 1.0
    stand_in.Decoder.refuse_all = False
    stand_in.Decoder.refuse_every = 5  # an odd file now and then
    kept = _loader(imagenet_root)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no give-up warning
        again = _take(kept)
    assert 0 < kept._decoder.refused < kept._decoder.asked / 2 and kept._decoder.regions
    for (x, y), (rx, ry) in zip(again, reference, strict=True):
        assert torch.equal(y, ry) and (x - rx).abs().max() <= 1.0


def test_what_the_region_decoder_refuses_is_decoded_on_the_cpu_and_cropped(stand_in: Any) -> None:
    """An image nvImageCodec returns None for is decoded whole on the CPU and cut to its region;
    a file no decoder reads is named in a DecodeError."""

    def jpeg(progressive: bool) -> bytes:
        buf = io.BytesIO()
        rng = np.random.default_rng(0)
        Image.fromarray(rng.integers(0, 255, (40, 50, 3), dtype=np.uint8)).save(
            buf, "JPEG", progressive=progressive
        )
        return buf.getvalue()

    stand_in.Decoder.refuse_progressive = True
    decoder = BatchDecoder(torch.device("cpu"))
    assert decoder.regions
    files = [jpeg(False), jpeg(True)]
    out = decoder.decode(files, ["a", "b"], [True, True], [(3, 4, 20, 30), (5, 6, 10, 12)])
    whole = [
        torch.from_numpy(np.array(Image.open(io.BytesIO(f)).convert("RGB"))).permute(2, 0, 1) for f in files
    ]
    assert torch.equal(out[0], whole[0][:, 3:23, 4:34]) and torch.equal(out[1], whole[1][:, 5:15, 6:18])
    with pytest.raises(fastload.DecodeError, match="'broken'"):
        decoder.decode([files[0], b"\xff\xd8 not a jpeg"], ["fine", "'broken'"], [True, False], [None, None])
    # Regions asked of a decoder given up meanwhile (by a pass left behind, in its own thread):
    # torchvision's decoder decodes the images whole and they are cut to their regions.
    decoder.region_decoder = None
    out = decoder.decode(files, ["a", "b"], [True, True], [(3, 4, 20, 30), None])
    assert torch.equal(out[0], whole[0][:, 3:23, 4:34]) and torch.equal(out[1], whole[1])


def test_hybrid_decodes_the_device_share_by_region(imagenet_root: Path, stand_in: Any) -> None:
    def split(loader: fastload.DataLoader[Any]) -> fastload.DataLoader[Any]:
        assert loader.hybrid is not None
        loader.hybrid.cpu_share = 0.5
        return loader

    with nvimgcodec.use_module(None):
        reference = _take(split(_loader(imagenet_root, "hybrid")))
    got = _take(split(_loader(imagenet_root, "hybrid")))
    regions = [r for d in stand_in.Decoder.made for call in d.calls for r in call]
    headers_device = 16  # 2 of each batch of 4, over 8 batches: the JPEGs among them by region
    assert 0 < len(regions) <= headers_device and None not in regions
    for (x, y), (rx, ry) in zip(got, reference, strict=True):
        assert torch.equal(y, ry) and (x - rx).abs().max() <= 1.0


def test_the_loader_names_nvimgcodec(
    imagenet_root: Path, stand_in: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert not nvimgcodec.decodes_in_place()  # by default: each image copied, as measured on a GPU
    assert _loader(imagenet_root).decoder.endswith(
        "; each image copied out of nvImageCodec's memory; decoding the crops in place is experimental, "
        "not measured on a GPU yet: FASTLOAD_GPU_EXPERIMENTAL=1 turns it on)"
    )
    monkeypatch.setenv("FASTLOAD_GPU_EXPERIMENTAL", "1")
    with caplog.at_level(logging.INFO, logger="fastload"):
        loader = _loader(imagenet_root)
    assert loader.decoder.startswith("nvImageCodec 0.9.0-stand-in (the hardware JPEG decoder")
    assert loader.decoder.endswith(
        "; the crops decoded into one buffer per batch, through its Python interface: nvImageCodec "
        "0.9.0-stand-in has no libnvimgcodec.so.0 beside its module)"
    )
    assert any(loader.decoder in r.getMessage() for r in caplog.records)
    from fastload.info import environment, summary_line

    env = environment()
    assert env["device_decoder"].startswith("nvImageCodec") and "nvImageCodec 0.9.0-stand-in" in summary_line(
        env
    )


def test_a_decoder_that_cannot_be_made_falls_back_to_torchvision_with_one_warning(
    imagenet_root: Path, stand_in: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("Could not create decoder. Code: 8")

    monkeypatch.setattr(stand_in, "Decoder", broken)
    with pytest.warns(UserWarning, match="nvImageCodec could not make a decoder on cpu .*Code: 8"):
        decoder = BatchDecoder(torch.device("cpu"))
    assert not decoder.regions
    with nvimgcodec.use_module(None):
        reference = _take(_loader(imagenet_root))
    with pytest.warns(UserWarning, match="nvImageCodec could not make a decoder") as record:
        got = _take(_loader(imagenet_root))
    assert len([w for w in record if "nvImageCodec" in str(w.message)]) == 1  # once per loader
    assert all(
        torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, reference, strict=True)
    )


@pytest.mark.cuda
def test_nvimgcodec_regions_on_the_gpu_match_libjpeg_turbo(imagenet_root: Path) -> None:  # pragma: no cover
    """The real decoder (where nvImageCodec and a CUDA device are) decodes every region itself
    (nothing left to the CPU), with fancy chroma upsampling: libjpeg-turbo's decode of that region
    within IDCT rounding, its outermost pixels too; the same region one pixel off, or mirrored, is
    not."""
    from fastload.decode import decode_jpeg_region, jpeg_header

    if not nvimgcodec.available("cuda"):
        pytest.skip("nvImageCodec is not installed (pip install 'fastload[nvimgcodec-cu12]' or -cu13)")
    ds = fastload.ImageFolder(imagenet_root / "train")
    files, regions, references = [], [], []
    for i in range(len(ds)):
        data = bytes(ds.get_bytes(i))
        header = jpeg_header(data)
        if header is None:  # PNG, CMYK: the CPU's
            continue
        width, height, _ = header
        h, w = height // 2, width // 2
        # inside the image, or touching its top and left, bottom and right, top and right edges
        top, left = [(height // 5, width // 7), (0, 0), (height - h, width - w), (0, width - w)][i % 4]
        full = decode_jpeg_region(data, 0, 0, width, height)
        assert full is not None
        files.append(data)
        regions.append((top, left, h, w))
        references.append(torch.from_numpy(full.copy()).int())
    decoder = nvimgcodec.RegionDecoder(torch.device("cuda"))
    out = decoder.decode(files, regions)
    torch.cuda.synchronize()
    assert not [k for k, image in enumerate(out) if image is None]  # none refused
    for image, full, (top, left, h, w) in zip(out, references, regions, strict=True):
        assert image is not None and image.is_contiguous()  # channels first, in torch's memory
        got = image.cpu().permute(1, 2, 0).int()
        ref = full[top : top + h, left : left + w]
        assert got.shape == ref.shape
        diff = (got - ref).abs().float()
        mean = float(diff.mean())
        sides = [float(side.mean()) for side in (diff[0], diff[-1], diff[:, 0], diff[:, -1])]
        assert mean <= 1.0 and max(sides) <= 2.0, f"mean {mean:.2f}, outermost rows/columns {sides}"
        y, x = min(top + 1, full.shape[0] - h), min(left + 1, full.shape[1] - w)
        shifted = (
            full[y : y + h, x : x + w]
            if (y, x) != (top, left)
            else full[top : top + h, left - 1 : left - 1 + w]
        )
        assert float((got - shifted).abs().float().mean()) > 2 * mean + 0.5  # the controls
        assert float((got - ref.flip(1)).abs().float().mean()) > 2 * mean + 0.5
    assert len(out) >= len(ds) // 2


@pytest.mark.cuda
@pytest.mark.parametrize("through_c", [True, False])
def test_nvimgcodec_decodes_in_place_on_the_gpu(
    imagenet_root: Path, through_c: bool, monkeypatch: pytest.MonkeyPatch, experimental: None
) -> None:  # pragma: no cover
    """The real decoder (nvImageCodec 0.9 and a CUDA device) writes each region, planar, into the
    batch buffer it is given, on the decoder's stream: the pixels of copying each image out of its
    own memory (one backend, the hardware decoder, for both), and nothing refused; through its C
    interface (where fastload's extension for it is built) and through its Python interface."""
    from fastload.decode import jpeg_header

    if not nvimgcodec.available("cuda"):
        pytest.skip("nvImageCodec is not installed (pip install 'fastload[nvimgcodec-cu12]' or -cu13)")
    if through_c and not nvimgcodec.native_interface()[0]:
        pytest.skip(f"nvImageCodec's C interface: {nvimgcodec.native_interface()[1]}")
    monkeypatch.setattr(nvimgcodec, "NATIVE", through_c)
    ds = fastload.ImageFolder(imagenet_root / "train")
    files, regions, sizes = [], [], []
    for i in range(len(ds)):
        data = bytes(ds.get_bytes(i))
        header = jpeg_header(data)
        if header is None:
            continue
        width, height, _ = header
        files.append(data)
        regions.append((height // 5, width // 7, max(1, height // 2), max(1, width // 2)))
        sizes.append((height, width))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        decoder = nvimgcodec.RegionDecoder(
            torch.device("cuda"), hw_load=1.0
        )  # one backend: the same path twice
        assert decoder.packs, f"nvImageCodec {nvimgcodec.nvimgcodec_version()} does not decode in place"
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            result = decoder.decode_packed(files, regions, stream, sizes)
        assert result is not None and decoder.packs
        assert (decoder.native is not None) == through_c, decoder.native_reason
        packed, boxes, ok = result
        copied = decoder.decode(files, regions, stream)
    stream.synchronize()
    assert all(ok) and None not in copied
    for k, (image, (top, left, h, w)) in enumerate(zip(copied, boxes.tolist(), strict=True)):
        assert image is not None
        got = packed.image(k)[:, top : top + h, left : left + w]
        assert torch.equal(got, image), f"image {k}: {float((got.int() - image.int()).abs().float().mean())}"


@pytest.mark.parametrize(("setting", "expected"), [(None, 0.9), ("1.0", 1.0), ("0", 0.0), (" 0.5 ", 0.5)])
def test_the_hardware_decoders_share_is_set_by_the_environment(
    stand_in: Any, monkeypatch: pytest.MonkeyPatch, setting: str | None, expected: float
) -> None:
    if setting is None:
        monkeypatch.delenv("FASTLOAD_HW_DECODER_LOAD", raising=False)
    else:
        monkeypatch.setenv("FASTLOAD_HW_DECODER_LOAD", setting)
    nvimgcodec.RegionDecoder(torch.device("cpu"))
    backends = fake.Decoder.made[-1].backends
    assert backends[0].backend_kind is fake.BackendKind.HW_GPU_ONLY
    assert backends[0].load_hint == expected


@pytest.mark.parametrize("setting", ["1.5", "-0.1", "all", "nan"])
def test_a_hardware_decoder_share_out_of_range_is_a_clear_error(
    stand_in: Any, monkeypatch: pytest.MonkeyPatch, setting: str
) -> None:
    monkeypatch.setenv("FASTLOAD_HW_DECODER_LOAD", setting)
    with pytest.raises(ValueError, match="FASTLOAD_HW_DECODER_LOAD=.*from 0 to 1"):
        nvimgcodec.RegionDecoder(torch.device("cpu"))


class _Producer:
    """A DLPack producer that takes only ``stream`` (as nvImageCodec's images) and records each
    call."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.calls: list[dict[str, Any]] = []

    def __dlpack__(self, stream: Any = None) -> Any:
        self.calls.append({"stream": stream})
        return self.tensor.__dlpack__()

    def __dlpack_device__(self) -> Any:
        return self.tensor.__dlpack_device__()


@pytest.mark.parametrize("stream", [None, 7])
def test_a_decoded_image_becomes_a_tensor_with_one_call_and_no_copy(stream: int | None) -> None:
    """Each decoded image asks its producer once, for the decoder thread's stream (None on the
    CPU), and shares its memory."""
    source = torch.arange(24, dtype=torch.uint8).view(2, 4, 3)
    producer = _Producer(source)
    tensor = nvimgcodec.dlpack_tensor(producer, stream)
    assert producer.calls == [{"stream": stream}]
    assert tensor.data_ptr() == source.data_ptr() and torch.equal(tensor, source)


def test_images_in_a_pitched_buffer_give_the_same_crops(stand_in: Any) -> None:
    """A decoder whose images' rows lie further apart than their width (a pitched buffer): each
    box is cut from the right pixels, margin or none, whole images too."""
    files = []
    for k, (height, width) in enumerate([(40, 60), (33, 21), (64, 64)]):
        pixels = np.random.default_rng(k).integers(0, 255, (height, width, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, "JPEG", quality=95)
        files.append(buf.getvalue())
    regions = [(5, 7, 20, 30), (0, 0, 33, 21), None]  # inside; the whole image as a box; no box
    plain = nvimgcodec.RegionDecoder(torch.device("cpu")).decode(files, regions)
    fake.Decoder.pitch = 5
    pitched = nvimgcodec.RegionDecoder(torch.device("cpu")).decode(files, regions)
    assert [None if t is None else tuple(t.shape) for t in pitched] == [(3, 20, 30), (3, 33, 21), (3, 64, 64)]
    for a, b in zip(plain, pitched, strict=True):
        assert a is not None and b is not None and torch.equal(a, b)
    whole = np.asarray(Image.open(io.BytesIO(files[0])).convert("RGB"))
    assert torch.equal(pitched[0], torch.from_numpy(whole[5:25, 7:37].copy()).permute(2, 0, 1))


def test_the_decoders_cpu_threads_are_this_ranks_share(
    imagenet_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """nvImageCodec's CPU threads (header parsing, Huffman decoding of its hybrid backend): this
    process's share of the CPUs -- 8 ranks on a node would otherwise start one per CPU each --,
    less the CPU workers' with decode="hybrid"."""
    import fastload._iterator
    import fastload.device

    threads: list[int] = []

    class Recording:
        def __init__(self, device: torch.device, cpu_threads: int = 0) -> None:
            self.device = device
            threads.append(cpu_threads)

    monkeypatch.setattr(fastload._iterator, "BatchDecoder", Recording)
    monkeypatch.setattr(fastload._iterator, "cpu_share", lambda: 6)  # e.g. 48 CPUs, 8 ranks
    batch_decoder = fastload._iterator.batch_decoder
    batch_decoder(_loader(imagenet_root, "device"), torch.device("cpu"))
    batch_decoder(_loader(imagenet_root, "hybrid", num_workers=2), torch.device("cpu"))
    assert threads == [6, 4]
    monkeypatch.setattr(fastload._iterator, "cpu_share", fastload.device.cpu_share)  # the real share:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # half of this process's CPUs, at least 1
    batch_decoder(_loader(imagenet_root, "device"), torch.device("cpu"))
    assert threads[-1] == max(1, fastload.device.available_cpus() // 2)


def test_one_decoder_decodes_one_batch_at_a_time(stand_in: Any) -> None:
    """A loader's decoder is shared by its passes, and a pass left behind may still decode a
    batch ahead when the next starts: calls from two threads take turns (nvImageCodec's Python
    decoder, and the images it holds until their copies are done, are not for two at once)."""
    import threading
    import time

    decoder = nvimgcodec.RegionDecoder(torch.device("cpu"))
    inner = decoder.decoder
    decode, active, most = inner.decode, [0], [0]

    def slow_decode(*args: Any, **kwargs: Any) -> Any:
        active[0] += 1
        most[0] = max(most[0], active[0])
        time.sleep(0.02)
        active[0] -= 1
        return decode(*args, **kwargs)

    inner.decode = slow_decode
    files = _jpegs([(40, 60), (33, 21)])
    results: list[Any] = []

    def run() -> None:
        for _ in range(4):
            results.append(decoder.decode(files, [(5, 7, 20, 30), None]))

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most[0] == 1 and len(results) == 8
    assert all(torch.equal(r[0], results[0][0]) and torch.equal(r[1], results[0][1]) for r in results)


def _jpegs(sizes: list[tuple[int, int]], progressive: tuple[int, ...] = ()) -> list[bytes]:
    files = []
    for k, (height, width) in enumerate(sizes):
        pixels = np.random.default_rng(k).integers(0, 255, (height, width, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, "JPEG", quality=95, progressive=k in progressive)
        files.append(buf.getvalue())
    return files


def test_regions_are_decoded_into_one_buffer_and_resized_from_it(stand_in: Any, experimental: None) -> None:
    """decode_regions: the device-decoded boxes (and their margins) land in one buffer, channels
    first, with no tensor per image; what the decoder refuses and what it does not take (a PNG)
    are decoded by the CPU, each its own tensor; the head then gives the images that decoding
    each box into its own tensor gives, bit for bit."""
    stand_in.Decoder.refuse_progressive = True
    files = _jpegs([(40, 60), (33, 21), (64, 64), (50, 45)], progressive=(2,))
    png = io.BytesIO()
    Image.fromarray(np.full((30, 30, 3), 9, dtype=np.uint8)).save(png, "PNG")
    files.insert(1, png.getvalue())
    regions = [(5, 7, 20, 30), (2, 3, 10, 12), (0, 0, 33, 21), (10, 11, 30, 40), (1, 2, 48, 40)]
    on_device = [True, False, True, True, True]
    names = [f"sample {k}" for k in range(5)]
    calls = stand_in.as_images.calls
    decoder = BatchDecoder(torch.device("cpu"))
    batch = decoder.decode_regions(files, names, on_device, regions)
    assert stand_in.as_images.calls == calls + 1  # one call wraps the whole batch's buffer
    assert batch.positions.tolist() == [0, 2, 4] and batch.packed is not None and len(batch) == 5
    assert [(k, tuple(t.shape), box) for k, t, box in batch.others] == [
        (1, (3, 10, 12), True),
        (3, (3, 30, 40), True),
    ]
    assert decoder.refused == 1 and decoder.asked == 4
    flat = batch.packed.flat
    assert all(
        flat.data_ptr() <= batch.packed.image(r).data_ptr() < flat.data_ptr() + flat.numel() for r in range(3)
    )
    assert batch.tensors()[0] is flat and len(batch.tensors()) == 3
    assert (batch.packed.offsets % nvimgcodec.ALIGN == 0).all()  # each image on a 256-byte boundary
    # each packed image is its region with a one-pixel margin where the image has one
    assert batch.boxes.tolist() == [[1, 1, 20, 30], [0, 0, 33, 21], [1, 1, 48, 40]]
    whole = [np.asarray(Image.open(io.BytesIO(f)).convert("RGB")) for f in files]
    first = torch.from_numpy(whole[0][4:26, 6:38].copy()).permute(2, 0, 1)
    assert torch.equal(batch.packed.image(0), first)
    copied = BatchDecoder(torch.device("cpu")).decode(files, names, on_device, regions)
    head = [gpu.RandomResizedCrop(16)]
    indices = np.arange(5)
    from fastload.gpu.hybrid import apply_head

    assert torch.equal(
        apply_head(head, batch, indices, 0, 0), apply_head(head, copied, indices, 0, 0, [True] * 5)
    )


def test_the_loaders_batches_do_not_depend_on_decoding_in_place(
    imagenet_root: Path, stand_in: Any, monkeypatch: pytest.MonkeyPatch, experimental: None
) -> None:
    """decode="device" and "hybrid" with nvImageCodec decoding into one buffer per batch give the
    batches that copying each image out of its own memory gives, bit for bit, an odd refused
    image included."""

    def loaders() -> list[fastload.DataLoader[Any]]:
        device, hybrid = _loader(imagenet_root), _loader(imagenet_root, "hybrid")
        assert hybrid.hybrid is not None
        hybrid.hybrid.cpu_share = 0.5
        return [device, hybrid]

    stand_in.Decoder.refuse_every = 7
    monkeypatch.setattr(nvimgcodec, "PACKED", False)
    calls = stand_in.as_images.calls
    made = loaders()
    assert made[0].decoder.endswith(
        "copied out of nvImageCodec's memory: fastload.gpu.nvimgcodec.PACKED is off)"
    )
    copied = [_take(loader) for loader in made]
    assert stand_in.as_images.calls == calls
    monkeypatch.setattr(nvimgcodec, "PACKED", True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning
        made = loaders()
        packed = [_take(loader) for loader in made]
    assert stand_in.as_images.calls > calls
    decoders = [loader.__dict__["_decoder"] for loader in made]
    assert all(d.region_decoder.packs and d.refused > 0 for d in decoders)  # in place, odd refusals included
    for got, reference in zip(packed, copied, strict=True):
        assert len(got) == len(reference) == 8
        for (x, y), (rx, ry) in zip(got, reference, strict=True):
            assert torch.equal(x, rx) and torch.equal(y, ry)


def test_a_decoder_that_does_not_decode_in_place_is_caught_on_the_first_batch(
    imagenet_root: Path, stand_in: Any, experimental: None
) -> None:
    """Where nvImageCodec hands back images elsewhere than the buffer it was given (or cannot
    wrap it), on the first batch or any later one, one warning says so and each image is copied
    out of its own memory from then on: the same batches. Before nvImageCodec 0.9 (no
    ``as_images`` of planar buffers) the copies run with no warning."""
    reference = _take(_loader(imagenet_root))
    stand_in.Decoder.ignore_images = True
    with pytest.warns(UserWarning, match="could not decode into fastload's batch buffer") as caught:
        loader = _loader(imagenet_root)
        got = _take(loader)
    assert loader.decoder.endswith(
        "copied out of nvImageCodec's memory: decoding in place failed, see its warning)"
    )
    assert sum("batch buffer" in str(w.message) for w in caught) == 1
    for (x, y), (rx, ry) in zip(got, reference, strict=True):
        assert torch.equal(x, rx) and torch.equal(y, ry)
    stand_in.Decoder.ignore_images = False
    stand_in.Decoder.ignore_images_after = 2  # in place for two batches, then not: caught there
    stand_in.Decoder.in_place_calls = 0
    with pytest.warns(UserWarning, match="an image came back outside the buffer given"):
        got = _take(_loader(imagenet_root))
    for (x, y), (rx, ry) in zip(got, reference, strict=True):
        assert torch.equal(x, rx) and torch.equal(y, ry)
    stand_in.Decoder.ignore_images_after = None
    calls = stand_in.as_images.calls
    for version, without in (("0.9.0", "as_images"), ("0.8.1", "")):
        older = type(fake)("older_nvimgcodec")
        older.__dict__.update({k: v for k, v in vars(fake).items() if k != without})
        older.__version__ = version
        with nvimgcodec.use_module(older), warnings.catch_warnings():
            warnings.simplefilter("error")
            assert not nvimgcodec.RegionDecoder(torch.device("cpu")).packs
            loader = _loader(imagenet_root)
            got = _take(loader)
            assert "nvImageCodec 0.9 decodes the crops in place: pip install -U" in loader.decoder
        for (x, y), (rx, ry) in zip(got, reference, strict=True):
            assert torch.equal(x, rx) and torch.equal(y, ry)
    assert stand_in.as_images.calls == calls


class _ListedTargets(fastload.InMemoryImageFolder):
    """Targets as a list, as torchvision's datasets keep them."""

    @property
    def targets(self) -> list[int]:
        return [int(t) for t in super().targets]


@pytest.mark.parametrize("decode", ["device", "hybrid"])
def test_labels_come_from_the_targets_column_or_through_target_transform(
    imagenet_root: Path, stand_in: Any, decode: str
) -> None:
    """The device paths' labels: the dataset's targets in the batch's order, through its
    target_transform where it has one, from a numpy column or a list alike."""
    plain = fastload.InMemoryImageFolder(imagenet_root / "train")
    moved = fastload.InMemoryImageFolder(imagenet_root / "train", target_transform=lambda t: 10 * t + 1)
    listed = _ListedTargets(imagenet_root / "train")
    options: dict[str, Any] = dict(batch_size=4, shuffle=True, seed=3, num_workers=1, device="cpu")
    order = fastload.rng.epoch_permutation(len(plain), 3, 0).numpy()
    expected = np.asarray(plain.targets)[order]
    for ds, want in ((plain, expected), (moved, 10 * expected + 1), (listed, expected)):
        loader = fastload.DataLoader(ds, decode=decode, gpu_transforms=_pipeline(), **options)
        if loader.hybrid is not None:
            loader.hybrid.cpu_share = 0.5
        labels = torch.cat([y for _, y in _take(loader)])
        assert labels.dtype == torch.int64 and labels.tolist() == want.tolist()
