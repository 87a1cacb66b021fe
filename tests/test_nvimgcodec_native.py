"""nvImageCodec itself on the CPU (its own CPU decoder: no GPU needed), and fastload's C interface
to it (fastload/_nvimgcodec.c): the structure layouts it declares against nvImageCodec's installed
header, whole batches of regions decoded in one call without the interpreter, and the loader's
batches the same whichever interface decodes them (and as the tests' stand-in's, which is PIL's)."""

from __future__ import annotations

import importlib
import io
import shutil
import subprocess
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

import fastload
import fastload._iterator
from fastload import gpu
from fastload.gpu import nvimgcodec
from fastload.gpu.decode import BatchDecoder


def _real() -> Any:
    try:
        return importlib.import_module("nvidia.nvimgcodec")
    except ImportError:
        return None


def _native() -> Any:
    try:
        return importlib.import_module("fastload._nvimgcodec")
    except ImportError:
        return None


pytestmark = [
    pytest.mark.skipif(_real() is None, reason="nvImageCodec is not installed (make test installs it)"),
    pytest.mark.skipif(_native() is None, reason="fastload._nvimgcodec is not built (needs a C compiler)"),
]


@pytest.fixture(autouse=True)
def experimental(monkeypatch: pytest.MonkeyPatch) -> None:
    """The C interface and decoding in place are experimental (never measured on a GPU): on here."""
    monkeypatch.setenv("FASTLOAD_GPU_EXPERIMENTAL", "1")


@pytest.fixture
def real() -> Iterator[Any]:
    """nvImageCodec for the device paths on a CPU device (its CPU decoder), both interfaces on."""
    packed, native = nvimgcodec.PACKED, nvimgcodec.NATIVE
    nvimgcodec.PACKED = nvimgcodec.NATIVE = True
    with nvimgcodec.use_module(_real()):
        yield _real()
    nvimgcodec.PACKED, nvimgcodec.NATIVE = packed, native


def _files(root: Path) -> list[Path]:
    return sorted(p for p in (root / "train").rglob("*") if p.is_file())


def _pil(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def _session(real: Any) -> Any:
    return _native().Session(
        nvimgcodec._library_path(real), nvimgcodec.CPU_ONLY_DEVICE, [(1, 1.0)], nvimgcodec.OPTIONS
    )


def test_the_declared_layouts_are_nvimgcodecs(tmp_path: Path) -> None:
    """Every structure field and constant fastload/_nvimgcodec.c declares sits where nvImageCodec's
    own header puts it (compiled here against the installed header)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    header = Path(_real().__file__).parent / "include" / "nvimgcodec.h"
    if compiler is None or not header.is_file():
        pytest.skip("needs a C compiler and nvImageCodec's header (in its wheel)")
    (tmp_path / "cuda_runtime_api.h").write_text("typedef struct CUstream_st *cudaStream_t;\n")
    layouts, constants = _native().layouts(), _native().CONSTANTS
    lines = ["#include <stdio.h>", "#include <stddef.h>", '#include "nvimgcodec.h"', "int main(void) {"]
    for name, fields in layouts.items():
        for field in fields:
            expr = f"sizeof({name})" if field == "sizeof" else f"offsetof({name}, {field})"
            lines.append(f'printf("{name} {field} %zu\\n", (size_t)({expr}));')
    for name in constants:
        lines.append(f'printf("constant {name} %ld\\n", (long)({name}));')
    lines.append("return 0; }")
    (tmp_path / "abi.c").write_text("\n".join(lines))
    subprocess.run(
        [
            compiler,
            "-I",
            str(tmp_path),
            "-I",
            str(header.parent),
            "-o",
            str(tmp_path / "abi"),
            str(tmp_path / "abi.c"),
        ],
        check=True,
    )
    printed = subprocess.run(
        [str(tmp_path / "abi")], check=True, capture_output=True, text=True
    ).stdout.split("\n")
    seen = 0
    for line in filter(None, printed):
        name, field, value = line.split()
        declared = constants[field] if name == "constant" else layouts[name][field]
        assert declared == int(value), (
            f"{name}.{field}: fastload declares {declared}, nvImageCodec's header {value}"
        )
        seen += 1
    assert seen == sum(len(f) for f in layouts.values()) + len(constants) > 100


def test_a_batch_of_regions_is_decoded_in_one_call_as_libjpeg_turbo_does(
    imagenet_root: Path, real: Any
) -> None:
    files = [p.read_bytes() for p in _files(imagenet_root)]
    rng = np.random.default_rng(0)
    regions = []
    for data in files:
        try:
            height, width = _pil(data).shape[:2]
        except OSError:
            height = width = 64
        y0, x0 = int(rng.integers(0, height // 2)), int(rng.integers(0, width // 2))
        regions.append(
            (y0, x0, y0 + int(rng.integers(1, height // 2)), x0 + int(rng.integers(1, width // 2)))
        )
    files.append(b"\xff\xd8 not a JPEG after all")
    regions.append((0, 0, 8, 8))
    files.append(files[0])  # a region past the image's edge
    regions.append((0, 0, 100_000, 8))
    box = np.array(regions, dtype=np.int64)
    sizes = 3 * (box[:, 2] - box[:, 0]) * (box[:, 3] - box[:, 1])
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    out = np.full(int(sizes.sum()), 7, dtype=np.uint8)
    ok = np.frombuffer(
        _session(real).decode(files, box, (out.ctypes.data + offsets).astype(np.uint64), 0), bool
    )
    assert len(ok) == len(files) and not ok[-1] and not ok[-2]
    decoded = 0
    for k, data in enumerate(files[:-2]):
        is_baseline_ycc = data[:2] == b"\xff\xd8" and Image.open(io.BytesIO(data)).mode in ("RGB", "L")
        if not ok[k]:
            assert not is_baseline_ycc, f"{_files(imagenet_root)[k]}: an RGB JPEG was not decoded"
            continue
        y0, x0, y1, x1 = regions[k]
        got = out[offsets[k] : offsets[k] + sizes[k]].reshape(3, y1 - y0, x1 - x0).transpose(1, 2, 0)
        np.testing.assert_array_equal(got, _pil(data)[y0:y1, x0:x1], err_msg=str(_files(imagenet_root)[k]))
        decoded += 1
    assert decoded >= len(files) - 6  # the set's PNG-as-JPEG, CMYK and the like aside


def test_the_interpreter_is_released_for_the_whole_batch(imagenet_root: Path, real: Any) -> None:
    """The training thread runs Python while a batch decodes: the call holds the interpreter for
    none of it (through nvImageCodec's Python objects, each image's takes it)."""
    jpegs = [p.read_bytes() for p in _files(imagenet_root)]
    data = max(
        (
            d
            for d in jpegs
            if Image.open(io.BytesIO(d)).format == "JPEG" and Image.open(io.BytesIO(d)).mode == "RGB"
        ),
        key=len,
    )
    height, width = _pil(data).shape[:2]
    session = _session(real)

    def batch(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        # each image's bottom-right 16 x 16 corner: most of the file decoded, little memory
        box = np.tile(np.array([[height - 16, width - 16, height, width]], dtype=np.int64), (n, 1))
        out = np.empty(n * 768, dtype=np.uint8)
        return box, out, (out.ctypes.data + np.arange(n) * 768).astype(np.uint64)

    t0 = time.perf_counter()
    box, out, destinations = batch(8)  # (out: alive while decoded into)
    session.decode([data] * 8, box, destinations, 0)
    n = int(min(20_000, max(48, 8 * 0.4 / max(time.perf_counter() - t0, 1e-6))))  # a call of ~0.4 s
    box, out, destinations = batch(n)
    times: list[float] = []
    done = threading.Event()
    decoded: list[bytes] = []

    def decode() -> None:
        times.append(time.perf_counter())
        decoded.append(session.decode([data] * n, box, destinations, 0))
        times.append(time.perf_counter())
        done.set()

    def spin(until: threading.Event, seconds: float) -> list[float]:
        stamps, t0 = [], time.perf_counter()
        while not until.is_set() and time.perf_counter() - t0 < seconds:
            stamps.append(time.perf_counter())
        return stamps

    rate = len(spin(threading.Event(), 0.2)) / 0.2  # this thread's stamps per second, alone
    thread = threading.Thread(target=decode)
    thread.start()
    stamps = spin(done, 60.0)
    thread.join()
    assert decoded[0] == b"\x01" * n
    start, end = times
    assert end - start > 0.1, f"{n} images decoded in {end - start:.3f} s: too fast to tell"
    # A call that held the interpreter would leave this thread no time after its first few switch
    # intervals (before the call is entered): about 3 % of its rate here; released, it keeps most
    # of it (less what the decoding's own threads take of the CPUs).
    inside = [t for t in stamps if start + 0.05 < t < end]
    assert len(inside) > 0.25 * rate * (end - start - 0.05)


def _device_loader(root: Path, decode: str = "device", check_crc: bool = True) -> fastload.DataLoader[Any]:
    ds = fastload.InMemoryImageFolder(root / "train", check_crc=check_crc)
    pipeline = gpu.Compose(
        [gpu.RandomResizedCrop(24), gpu.RandomHorizontalFlip(), gpu.Normalize([0.0], [1 / 255])]
    )
    loader = fastload.DataLoader(
        ds,
        batch_size=4,
        shuffle=True,
        seed=3,
        num_workers=1,
        device="cpu",
        decode=decode,
        gpu_transforms=pipeline,
    )
    if loader.hybrid is not None:
        loader.hybrid.cpu_share = 0.5  # the same split every time (it otherwise follows measured rates)
    return loader


def _take(loader: fastload.DataLoader[Any]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = [(x.clone(), y.clone()) for x, y in loader]
    loader.close()
    return out


class _Recording:
    """nvImageCodec's C interface, each call's method name recorded."""

    calls: list[str] = []
    made = getattr(_native(), "Session", None)

    def __init__(self, *args: Any) -> None:
        assert self.made is not None
        self.session = self.made(*args)

    def __getattr__(self, name: str) -> Any:
        _Recording.calls.append(name)
        return getattr(self.session, name)


@pytest.mark.parametrize(("decode", "check_crc"), [("device", True), ("device", False), ("hybrid", False)])
def test_the_loaders_batches_are_the_same_through_either_interface(
    imagenet_root: Path, real: Any, decode: str, check_crc: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(``check_crc`` on: the first epoch's bytes come from the reader threads, one object per
    sample; off: as slices of the dataset's buffer, handed to the C interface as columns.)"""
    import _fakenvimgcodec as fake

    monkeypatch.setattr(_native(), "Session", _Recording)
    _Recording.calls.clear()
    loader = _device_loader(imagenet_root, decode, check_crc)
    before = loader.decoder  # (the C interface's session is made by the first batch)
    native = _take(loader)
    assert loader.decoder == before
    assert (
        "one buffer per batch, by one call into its C interface per batch, without the interpreter)"
        in loader.decoder
    )
    batch_decoder = fastload._iterator.batch_decoder(loader, torch.device("cpu"))
    assert batch_decoder.asked > 0 and batch_decoder.refused == 0  # nvImageCodec decoded its share
    assert set(_Recording.calls) == {"decode" if check_crc else "decode_slices"}
    nvimgcodec.NATIVE = False
    loader = _device_loader(imagenet_root, decode, check_crc)
    python = _take(loader)
    assert "through its Python interface: turned off (FASTLOAD_NVIMGCODEC_NATIVE=0" in loader.decoder
    nvimgcodec.PACKED = False
    copies = _take(_device_loader(imagenet_root, decode, check_crc))
    with nvimgcodec.use_module(fake):
        stand_in = _take(_device_loader(imagenet_root, decode, check_crc))
    assert len(native) == len(python) == len(copies) == len(stand_in) == 8
    for (x, y), (px, py), (cx, cy), (sx, sy) in zip(native, python, copies, stand_in, strict=True):
        assert torch.equal(x, px) and torch.equal(x, cx) and torch.equal(y, py) and torch.equal(y, cy)
        assert torch.equal(y, sy) and (x - sx).abs().max() <= 1.0  # nvImageCodec's libjpeg-turbo vs PIL's


def test_slices_of_one_buffer_decode_as_the_files_do(imagenet_root: Path, real: Any) -> None:
    files = [p.read_bytes() for p in _files(imagenet_root)][:8]
    buffer = np.frombuffer(b"".join(files), dtype=np.uint8)
    ends = np.cumsum([len(f) for f in files]).astype(np.int64)
    starts = ends - np.array([len(f) for f in files], dtype=np.int64)
    starts[-1], ends[-1] = len(buffer) - 10, len(buffer) + 5  # past the buffer's end: not decoded
    box = np.tile(np.array([[0, 0, 16, 16]], dtype=np.int64), (8, 1))
    by_slices, by_files = np.zeros(8 * 768, np.uint8), np.zeros(8 * 768, np.uint8)
    session = _session(real)
    ok = session.decode_slices(
        buffer, starts, ends, box, (by_slices.ctypes.data + np.arange(8) * 768).astype(np.uint64), 0
    )
    ok_files = session.decode(
        files[:7] + [b""], box, (by_files.ctypes.data + np.arange(8) * 768).astype(np.uint64), 0
    )
    assert ok == ok_files and ok[-1] == 0 and sum(ok) >= 5
    assert np.array_equal(by_slices, by_files)
    with pytest.raises(ValueError, match="ends should hold 8 int64 items"):
        session.decode_slices(buffer, starts, ends[:7], box, np.zeros(8, np.uint64), 0)
    with pytest.raises(
        ValueError, match="regions should hold 32 int64 items, but holds 256 bytes of format 'd'"
    ):
        session.decode_slices(buffer, starts, ends, box.astype(np.float64), np.zeros(8, np.uint64), 0)
    with pytest.raises(ValueError, match="destinations should hold 8 uint64 items"):
        session.decode(files, box, np.zeros(8, np.int64), 0)


def test_a_failing_c_interface_is_given_up_with_one_warning_and_the_batch_decoded(
    imagenet_root: Path, real: Any
) -> None:
    files = [p.read_bytes() for p in _files(imagenet_root) if p.read_bytes()[:2] == b"\xff\xd8"][:6]
    sizes = np.array([_pil(d).shape[:2] for d in files])
    regions = [(1, 2, int(h) // 2, int(w) // 2) for h, w in sizes]
    decoder = BatchDecoder(torch.device("cpu"))
    region_decoder = decoder.region_decoder
    assert region_decoder is not None and region_decoder.native is None  # made by the first batch
    reference = decoder.decode_regions(
        files, [str(k) for k in range(6)], [True] * 6, regions, None, (sizes[:, 0], sizes[:, 1])
    )

    assert region_decoder.native is not None and region_decoder._decoder is None  # no Python decoder

    class Broken:
        def decode(self, *args: Any) -> bytes:
            raise RuntimeError("nvImageCodec's decode call failed (status 8)")

    region_decoder.native = Broken()
    with pytest.warns(UserWarning, match="C interface failed .*Python interface from now on"):
        got = decoder.decode_regions(
            files, [str(k) for k in range(6)], [True] * 6, regions, None, (sizes[:, 0], sizes[:, 1])
        )
    assert region_decoder.native is None and "failed (RuntimeError" in decoder.name
    assert got.packed is not None and reference.packed is not None
    assert np.array_equal(got.positions, reference.positions) and np.array_equal(got.boxes, reference.boxes)
    assert len(got.positions) == 6 and not got.others
    for packed, boxes in ((got.packed, got.boxes), (reference.packed, reference.boxes)):
        crops = [
            packed.flat[o : o + 3 * h * w].view(3, h, w)[:, t : t + bh, left : left + bw]
            for o, h, w, (t, left, bh, bw) in zip(
                packed.offsets, packed.heights, packed.widths, boxes, strict=True
            )
        ]
        for k, crop in enumerate(crops):  # the crop boxes asked for, as PIL decodes them
            top, left, height, width = regions[k]
            expected = torch.from_numpy(
                _pil(files[k])[top : top + height, left : left + width].copy()
            ).permute(2, 0, 1)
            assert torch.equal(crop, expected)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        decoder.decode_regions(
            files, [str(k) for k in range(6)], [True] * 6, regions, None, (sizes[:, 0], sizes[:, 1])
        )


def test_nvimgcodecs_python_decoder_made_late_and_failing_gives_it_up(
    imagenet_root: Path, real: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Beside the C interface, nvImageCodec's Python decoder is made only when a batch needs it
    (here: whole images, no regions); if nvImageCodec cannot make it then, it is given up with one
    warning and torchvision decodes the batch."""
    files = [p.read_bytes() for p in _files(imagenet_root) if p.read_bytes()[:2] == b"\xff\xd8"][:4]
    decoder = BatchDecoder(torch.device("cpu"))
    assert decoder.region_decoder is not None and decoder.region_decoder._decoder is None

    def cannot(**kwargs: Any) -> Any:
        raise RuntimeError("out of memory")

    monkeypatch.setattr(real, "Decoder", cannot)
    names = [f"sample {k}" for k in range(4)]
    with pytest.warns(
        UserWarning, match=r"could not make a decoder \(RuntimeError: out of memory\); fastload decodes"
    ):
        images = decoder.decode(files, names, [True] * 4, None, None)
    assert decoder.region_decoder is None and "torchvision" in decoder.name
    for image, data in zip(images, files, strict=True):
        assert torch.equal(image, torch.from_numpy(_pil(data).copy()).permute(2, 0, 1))


def test_in_memory_slices_are_what_get_bytes_returns(imagenet_root: Path) -> None:
    ds = fastload.InMemoryImageFolder(imagenet_root / "train", check_crc=False)
    n = len(ds)
    slices = ds.byte_slices(np.array([0, 3, -1, -n], dtype=np.int64))
    for k, i in enumerate([0, 3, n - 1, 0]):
        assert bytes(slices[k]) == bytes(ds.get_bytes(i))
    assert [bytes(s) for s in slices] == [bytes(ds.get_bytes(i)) for i in (0, 3, n - 1, 0)]
    assert [bytes(s) for s in slices.take([2, 0])] == [bytes(ds.get_bytes(n - 1)), bytes(ds.get_bytes(0))]
    for bad in (n, -n - 1):
        with pytest.raises(
            IndexError, match=f"sample index {bad} is out of range for a dataset of {n} samples"
        ):
            ds.byte_slices(np.array([1, bad]))
        assert not ds.slices_only(np.array([1, bad]))  # the reader threads' get_bytes raises it
    assert ds.slices_only(np.array([1, -1]))


def test_the_c_interface_says_why_it_is_not_used(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import types

    with nvimgcodec.use_module(None):
        monkeypatch.setattr(nvimgcodec, "_imported", lambda: None)
        assert nvimgcodec.native_interface() == (False, "nvImageCodec is not installed")
    (tmp_path / "libnvimgcodec.so.0").write_bytes(b"")
    newer = types.SimpleNamespace(
        __file__=str(tmp_path / "__init__.py"),
        __version__="0.10.0",
        as_images=None,
        SampleFormat=types.SimpleNamespace(P_RGB=7),
    )
    with nvimgcodec.use_module(newer):
        assert nvimgcodec.native_interface() == (
            False,
            "nvImageCodec 0.10.0: fastload declares the C interface of 0.9 only",
        )
        monkeypatch.setenv("FASTLOAD_NVIMGCODEC_NATIVE", "0")
        assert nvimgcodec.native_interface()[1].startswith("turned off (FASTLOAD_NVIMGCODEC_NATIVE=0")
        monkeypatch.setenv("FASTLOAD_GPU_EXPERIMENTAL", "0")  # the default: the C interface is not used
        assert nvimgcodec.native_interface() == (
            False,
            "experimental, not measured on a GPU yet (FASTLOAD_GPU_EXPERIMENTAL=1 turns it on)",
        )
    with pytest.raises(OSError, match=r"could not open nvImageCodec's library /nowhere/libnvimgcodec.so.0"):
        _native().Session("/nowhere/libnvimgcodec.so.0", nvimgcodec.CPU_ONLY_DEVICE, [(1, 1.0)])
    with pytest.raises(TypeError):
        _native().Session(str(tmp_path / "libnvimgcodec.so.0"), nvimgcodec.CPU_ONLY_DEVICE, [(1,)])


def test_a_c_interface_that_cannot_be_made_is_said_once_and_the_python_interface_decodes(
    imagenet_root: Path, real: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = _take(_device_loader(imagenet_root))

    def cannot(*args: Any) -> Any:
        raise OSError("nvImageCodec's library is version 0.8, not 0.9")

    monkeypatch.setattr(_native(), "Session", cannot)
    loader = _device_loader(imagenet_root)
    with pytest.warns(
        UserWarning, match="C interface could not be used .*Python interface instead"
    ) as caught:
        got = _take(loader)
    assert len([w for w in caught if "C interface" in str(w.message)]) == 1
    assert "through its Python interface: its C interface could not be used (OSError: " in loader.decoder
    for (x, y), (rx, ry) in zip(got, reference, strict=True):
        assert torch.equal(x, rx) and torch.equal(y, ry)
