"""The device feeder (decode="device"): batches prepared by a thread of their own, beside the
training loop, handed over by event; on CPU with the recording stand-in for CUDA streams."""

from __future__ import annotations

import io
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _fakecuda import fake_cuda
from PIL import Image
from PIL.JpegImagePlugin import get_sampling

import fastload
import fastload._devicepass
import fastload._iterator
import fastload.decode
import fastload.gpu.decode
import fastload.loader
from fastload import gpu
from fastload.gpu.feeder import DeviceFeeder


def _feeder(
    prepare: Any, n: int, start: int = 0, depth: int = 2, timeout: float = 0
) -> tuple[DeviceFeeder, Any]:
    with fake_cuda() as (streams, _):
        feeder = DeviceFeeder(
            prepare, n, start, torch.device("cpu"), depth=depth, backend=streams, timeout=timeout
        )
    return feeder, streams


def test_batches_are_made_in_their_own_thread_and_handed_over_by_event_in_order() -> None:
    threads = []

    def prepare(k: int) -> tuple[torch.Tensor, torch.Tensor]:
        threads.append(threading.current_thread().name)
        return torch.full((2, 3), k), torch.tensor([k, k])

    feeder, streams = _feeder(prepare, 5)
    got = [int(x[0, 0]) for x, _ in feeder]
    assert got == [0, 1, 2, 3, 4] and set(threads) == {"fastload-feeder"}
    # the consumer stream waits on each batch's own event (not on the whole side stream)
    assert [event for _, event in streams.waited_events] == [1, 2, 3, 4, 5]
    assert len(feeder) == 5
    feeder.close()


def test_the_feeder_runs_at_most_depth_batches_ahead() -> None:
    made: list[int] = []

    def prepare(k: int) -> torch.Tensor:
        made.append(k)
        return torch.zeros(1)

    feeder, _ = _feeder(prepare, 20, depth=3)
    for taken in range(1, 6):
        next(feeder)
        time.sleep(0.3)  # a slow model step: the feeder fills its queue meanwhile
        assert taken + 3 <= len(made) <= taken + 4  # depth ready, and at most one being made
    feeder.close()
    assert len(made) <= 10


def test_close_keeps_no_batch_it_made() -> None:
    """A batch made while the queue was full, waiting for room, is not left queued after close():
    device memory goes with the pass."""
    import gc
    import weakref

    for _ in range(5):
        made: list[weakref.ref[torch.Tensor]] = []

        def prepare(k: int, made: list[weakref.ref[torch.Tensor]] = made) -> torch.Tensor:
            batch = torch.zeros(4)
            made.append(weakref.ref(batch))
            return batch

        feeder, _ = _feeder(prepare, 20, depth=2)
        deadline = time.monotonic() + 10
        while len(made) < 3 and time.monotonic() < deadline:  # two queued, a third waiting for room
            time.sleep(0.01)
        time.sleep(0.05)
        feeder.close()
        gc.collect()
        assert len(made) == 3 and [r for r in made if r() is not None] == []


def test_an_error_surfaces_from_its_batch_and_the_next_batch_follows() -> None:
    def prepare(k: int) -> torch.Tensor:
        if k == 2:
            raise fastload.DecodeError("sample 7 (x.JPEG): not a JPEG")
        return torch.full((1,), k)

    feeder, _ = _feeder(prepare, 5)
    assert [int(next(feeder)) for _ in range(2)] == [0, 1]
    with pytest.raises(fastload.DecodeError, match=r"sample 7 \(x.JPEG\)"):
        next(feeder)
    assert [int(x) for x in feeder] == [3, 4]


def test_a_resumed_pass_starts_at_its_first_batch_not_handed_out() -> None:
    feeder, _ = _feeder(lambda k: torch.full((1,), k), 6, start=4)
    assert [int(x) for x in feeder] == [4, 5]


def test_close_from_the_feeder_thread_itself_does_not_raise() -> None:
    """A garbage collection can end a pass (and close its feeder) on the feeder's own thread."""
    holder: dict[str, Any] = {}
    errors: list[BaseException] = []

    def prepare(k: int) -> torch.Tensor:
        if k == 1:
            try:
                holder["feeder"].close()
            except BaseException as e:  # noqa: BLE001 - the test reports it
                errors.append(e)
        return torch.zeros(1)

    feeder, _ = _feeder(lambda k: (time.sleep(0.2), prepare(k))[1], 5)
    holder["feeder"] = feeder
    next(feeder)
    time.sleep(1)
    assert errors == []
    feeder.close()


def test_close_stops_the_thread_and_a_stuck_batch_times_out() -> None:
    feeder, _ = _feeder(lambda k: torch.zeros(1), 1000, depth=1)
    next(feeder)
    feeder.close()
    assert not feeder._thread.is_alive()
    release = threading.Event()
    slow, _ = _feeder(lambda k: release.wait(10), 3, timeout=0.5)
    with pytest.raises(RuntimeError, match="DataLoader timed out after 0.5 seconds"):
        next(slow)
    release.set()
    slow.close()


# ------------------------------------------------------------------------------ decode="device"


def _device_loader(root: Path, **kwargs: Any) -> fastload.DataLoader[Any]:
    pipeline = gpu.Compose(
        [gpu.RandomResizedCrop(16), gpu.RandomHorizontalFlip(), gpu.Normalize([0.5], [0.25])]
    )
    ds = fastload.InMemoryImageFolder(root / "train")
    return fastload.DataLoader(
        ds,
        batch_size=5,
        shuffle=True,
        seed=3,
        decode="device",
        gpu_transforms=pipeline,
        device="cpu",
        **kwargs,
    )


def test_device_decode_runs_beside_the_training_thread(
    imagenet_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop's next() does no decoding, header parsing or transform: decoding runs in the
    decoder thread, the transforms in the feeder thread (the two overlap: batch k + 1 decodes
    while batch k is transformed); the batches are those of decoding each sample and transforming
    it with its own keys."""
    where: list[str] = []
    transformed: list[str] = []
    real_decode, real_transform = fastload.gpu.decode.decode_batch, fastload._devicepass.apply_transform

    def recording_decode(*args: Any, **kwargs: Any) -> Any:
        where.append(threading.current_thread().name)
        return real_decode(*args, **kwargs)

    def recording_transform(*args: Any, **kwargs: Any) -> Any:
        transformed.append(threading.current_thread().name)
        return real_transform(*args, **kwargs)

    monkeypatch.setattr(fastload.gpu.decode, "decode_batch", recording_decode)
    monkeypatch.setattr(fastload._devicepass, "apply_transform", recording_transform)
    with fake_cuda() as (streams, _):
        loader = _device_loader(imagenet_root, num_workers=2, pin_memory=True)
        assert loader.path == "device-decode"
        batches = [(x.clone(), y.clone(), b.indices.clone()) for x, y, b in ((*b, b) for b in loader)]
        loader.close()
    assert set(where) == {"fastload-device-decode_0"} and len(where) == len(batches) == 7
    assert set(transformed) == {"fastload-feeder"} and len(transformed) == 7
    # the feeder's stream waits for each decode's event, the loop's for each finished batch's
    assert len(streams.waited_events) == 14 and streams.pageable() == []  # labels and indices: pinned
    ds = fastload.InMemoryImageFolder(imagenet_root / "train")
    order = fastload.rng.epoch_permutation(len(ds), 3, 0)
    tf = gpu.Compose([gpu.RandomResizedCrop(16), gpu.RandomHorizontalFlip(), gpu.Normalize([0.5], [0.25])])
    for k, (images, labels, indices) in enumerate(batches):
        idx = order[5 * k : 5 * k + 5]
        assert indices.tolist() == idx.tolist() and labels.tolist() == [int(ds.targets[i]) for i in idx]
        decoded = fastload.gpu.decode.decode_batch([ds.get_bytes(int(i)) for i in idx])
        assert torch.equal(images, tf(decoded, indices=idx, epoch=0, seed=3))


def test_headers_are_read_once_per_sample_not_every_epoch(
    imagenet_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    headers: list[int] = []
    real_header = fastload.decode.jpeg_info

    def counting_header(data: Any) -> Any:
        headers.append(1)
        return real_header(data)

    def no_pil_open(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("an image was opened with PIL to route it")

    monkeypatch.setattr(fastload.gpu.decode, "jpeg_info", counting_header)
    monkeypatch.setattr(fastload.gpu.decode, "open_image", no_pil_open)
    loader = _device_loader(imagenet_root, num_workers=1, drop_last=False)
    for _ in range(3):
        assert sum(len(y) for _, y in loader) == 32
    table = fastload._iterator.decode_headers(loader)
    assert len(headers) == 32 if fastload.decode.roi_decoder_available() else len(headers) == 0
    routes = table.route
    assert set(np.unique(routes)) <= {1, 2} and (routes > 0).all()  # every sample routed, once
    # and what the header says of each JPEG the device takes: its size, coding and subsampling
    ds = fastload.InMemoryImageFolder(imagenet_root / "train")
    for i in np.flatnonzero(routes == 1).tolist():
        with Image.open(io.BytesIO(bytes(ds.get_bytes(i)))) as img:
            assert (int(table.width[i]), int(table.height[i])) == img.size
            assert table.progressive[i] == (2 if img.info.get("progressive") else 1)
            sampling = "gray" if img.mode == "L" else {0: "4:4:4", 1: "4:2:2", 2: "4:2:0"}[get_sampling(img)]
            assert table.SUBSAMPLING[table.subsampling[i]] == sampling
    loader.close()


def test_a_corrupt_image_is_named_by_its_batch_and_the_next_batch_follows(tmp_path: Path) -> None:
    from fastload.synthetic import make_imagenet_like

    make_imagenet_like(tmp_path, classes=2, per_class=5, val_per_class=0, seed=1, num_workers=1)
    bad = sorted((tmp_path / "train").rglob("*.JPEG"))[3]
    bad.write_bytes(b"\xff\xd8\xff\xe0 definitely not a jpeg")
    ds = fastload.ImageFolder(tmp_path / "train")
    loader = fastload.DataLoader(
        ds, batch_size=2, decode="device", gpu_transforms=gpu.Resize((8, 8)), device="cpu"
    )
    it = iter(loader)
    outcomes = []
    for _ in range(len(loader)):
        try:
            outcomes.append(len(next(it)[1]))
        except fastload.DecodeError as e:
            outcomes.append(str(e))
    assert outcomes[0] == 2 and outcomes[2:] == [2, 2, 2]
    assert isinstance(outcomes[1], str) and bad.name in outcomes[1]  # batch 1: samples 2 and 3
    # the advice, without on_error='skip' (which decode='device' refuses)
    assert outcomes[1].endswith("Remove or replace the file.") and "on_error" not in outcomes[1]
    with pytest.raises(StopIteration):
        next(it)


def test_a_pass_resumed_from_a_state_yields_exactly_the_rest(imagenet_root: Path) -> None:
    whole = [(x.clone(), y.clone()) for x, y in _device_loader(imagenet_root, num_workers=1)]
    first = _device_loader(imagenet_root, num_workers=1)
    it = iter(first)
    next(it), next(it)
    state = first.state_dict()
    first.close()
    again = _device_loader(imagenet_root, num_workers=1)
    again.load_state_dict(state)
    rest = [(x.clone(), y.clone()) for x, y in again]
    assert len(rest) == len(whole) - 2
    assert all(
        torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(rest, whole[2:], strict=True)
    )


def test_the_loader_names_its_decoder(imagenet_root: Path, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    with caplog.at_level(logging.INFO, logger="fastload"):
        loader = _device_loader(imagenet_root, num_workers=0)
    assert loader.path == "device-decode"
    assert loader.decoder == fastload.gpu.decode.device_decoder("cpu") and "on the CPU" in loader.decoder
    lines = [r.getMessage() for r in caplog.records if r.name == "fastload"]
    assert lines == [
        f"fastload.DataLoader decodes this InMemoryImageFolder on cpu with {loader.decoder}, in a feeder "
        "thread 2 batches ahead of the loop"
    ]
    assert (
        "nvJPEG" in fastload.gpu.decode.device_decoder("cuda")
        or not fastload.decode.torchvision_jpeg_available()
    )


# -- the host paths on a device: copies and device transforms in the feeder thread -------------


class _Where(gpu.BatchTransform):
    """A device transform that records the thread it runs in (then leaves the images as they are)."""

    def __init__(self) -> None:
        self.threads: list[str] = []

    def __call__(self, images: Any, *, indices: Any = None, epoch: int = 0, seed: int = 0) -> Any:
        self.threads.append(threading.current_thread().name)
        return images


def _fast_loader(root: Path, transforms: Any, **kwargs: Any) -> fastload.DataLoader[Any]:
    from fastload import transforms as T

    ds = fastload.ImageFolder(root / "train", transform=T.Compose([T.RandomResizedCrop(16)]))
    common: dict[str, Any] = dict(batch_size=5, shuffle=True, seed=1, device="cpu", pin_memory=True)
    return fastload.DataLoader(ds, gpu_transforms=transforms, **{**common, **kwargs})


def _take(loader: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x.clone(), y.clone()) for x, y in loader]


def test_the_fast_path_on_a_cuda_device_copies_and_transforms_beside_the_loop(
    imagenet_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """On a CUDA device the loop's next() only takes a finished batch and queues a wait for its
    event: the copy and the device transforms ran in the feeder thread, and the batches are those
    of the in-thread prefetcher (the same loader where the device is not CUDA)."""
    import logging

    caplog.set_level(logging.INFO, logger="fastload")
    normalize = gpu.Normalize([0.5], [0.25])
    reference = _take(
        _fast_loader(imagenet_root, gpu.Compose([_Where(), normalize]), num_workers=2, pin_memory=False)
    )
    where = _Where()
    with fake_cuda() as (streams, _):
        loader = _fast_loader(imagenet_root, gpu.Compose([where, normalize]), num_workers=2)
        assert loader.fast_path
        got = _take(loader)
        loader.close()
    assert set(where.threads) == {"fastload-feeder"} and len(where.threads) == len(got) == 7
    assert [e for _, e in streams.waited_events] and streams.pageable() == []
    said = [r for r in caplog.records if "copies and transforms batches" in r.getMessage()]
    assert len(said) == 1 and said[0].levelname == "INFO" and "in a feeder thread" in said[0].getMessage()
    assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(got, reference, strict=True))


@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true:UserWarning")
@pytest.mark.filterwarnings("ignore:CUDAPrefetcher got tensors in pageable memory:UserWarning")
def test_torch_path_with_workers_is_fed_beside_the_loop_and_errors_keep_their_batch(tmp_path: Path) -> None:
    """torch's path with worker processes: a sample that raises fails the next() of its batch, as
    with torch's iterator, and the next() after it returns the following batch."""

    class Flaky(torch.utils.data.Dataset[Any]):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
            if i == 3:
                raise ValueError("sample 3 is broken")
            return torch.full((3, 4, 4), i, dtype=torch.uint8), i

    where = _Where()
    with fake_cuda():
        loader = fastload.DataLoader(
            Flaky(), batch_size=2, num_workers=2, device="cpu", pin_memory=True, gpu_transforms=where
        )
        assert not loader.fast_path
        it = iter(loader)
        first = next(it)
        with pytest.raises(ValueError, match="sample 3 is broken"):
            next(it)
        rest = list(it)
        loader.close()
    assert first[1].tolist() == [0, 1] and [y.tolist() for _, y in rest] == [[4, 5], [6, 7]]
    assert set(where.threads) == {"fastload-feeder"}


def test_a_users_sampler_is_read_in_the_loops_thread_when_a_feeder_runs(imagenet_root: Path) -> None:
    """A sampler that draws from torch's global RNG as it yields (hard-example mining): the feeder
    thread must not read it (its draws would interleave with the loop's by timing), so with a CUDA
    device it is read at iter(), in the iterating thread, and the run is reproducible."""
    readers: list[str] = []

    class Drawing(torch.utils.data.Sampler[int]):
        def __init__(self, n: int) -> None:
            self.n = n

        def __len__(self) -> int:
            return self.n

        def __iter__(self) -> Any:
            for _ in range(self.n):
                readers.append(threading.current_thread().name)
                yield int(torch.randint(self.n, ()))

    def run(pause: float) -> tuple[list[int], list[float]]:
        torch.manual_seed(0)
        loader = _fast_loader(
            imagenet_root, None, num_workers=2, shuffle=False, sampler=Drawing(20), batch_size=1
        )
        it = iter(loader)
        assert isinstance(getattr(it, "_fed", None), fastload._devicepass.FedPass)
        order, draws = [], []
        for batch in it:
            order += batch.indices.tolist()
            draws.append(float(torch.rand(())))  # the training loop's own draw (dropout, ...)
            time.sleep(pause)
        loader.close()
        return order, draws

    with fake_cuda():
        runs = [run(pause) for pause in (0.0, 0.05, 0.0)]
    assert set(readers) == {threading.current_thread().name}
    assert runs[0] == runs[1] == runs[2]


def test_a_fed_pass_resumes_exactly_where_the_loop_stopped(imagenet_root: Path) -> None:
    """The feeder thread runs batches ahead of the loop: the state counts the batches handed out."""
    with fake_cuda():
        whole = _take(_fast_loader(imagenet_root, gpu.Normalize([0.5], [0.25]), num_workers=2))
        first = _fast_loader(imagenet_root, gpu.Normalize([0.5], [0.25]), num_workers=2)
        it = iter(first)
        next(it), next(it)
        time.sleep(0.2)  # the feeder has prepared the batches after them meanwhile
        state = first.state_dict()
        first.close()
        again = _fast_loader(imagenet_root, gpu.Normalize([0.5], [0.25]), num_workers=2)
        again.load_state_dict(state)
        rest = _take(again)
        again.close()
    assert len(rest) == len(whole) - 2
    assert all(
        torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(rest, whole[2:], strict=True)
    )


@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true:UserWarning")
@pytest.mark.filterwarnings("ignore:CUDAPrefetcher got tensors in pageable memory:UserWarning")
@pytest.mark.parametrize("case", ["reused output buffers", "no workers on torch's path", "not a CUDA device"])
def test_where_a_thread_could_change_the_batches_the_prefetcher_stays_in_the_loop(
    imagenet_root: Path, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Normalize(buffers=2) is safe only one batch ahead; torch's path without workers draws from
    torch's global random state, which a thread would interleave with the loop's draws. On a CUDA
    device the loader says so, once."""
    import logging

    caplog.set_level(logging.INFO, logger="fastload")
    where = _Where()
    if case == "reused output buffers":
        with fake_cuda():
            loader = _fast_loader(
                imagenet_root, gpu.Compose([where, gpu.Normalize([0.5], [0.25], buffers=2)])
            )
            _take(loader)
    elif case == "no workers on torch's path":
        data = [(torch.zeros(3, 4, 4, dtype=torch.uint8), 0)] * 6
        with fake_cuda():
            loader = fastload.DataLoader(
                data, batch_size=2, device="cpu", pin_memory=True, gpu_transforms=where
            )
            assert not loader.fast_path
            _take(loader)
    else:
        loader = _fast_loader(imagenet_root, where, num_workers=1)
        _take(loader)
    loader.close()
    assert set(where.threads) == {threading.current_thread().name}
    said = [r for r in caplog.records if "copies and transforms batches" in r.getMessage()]
    if case == "not a CUDA device":
        assert said == []
    else:
        assert len(said) == 1 and said[0].levelname == "WARNING"
        assert ("Normalize(buffers=k)" if case == "reused output buffers" else "num_workers=0") in said[
            0
        ].getMessage()


def test_leaving_a_fed_pass_early_stops_its_thread(imagenet_root: Path) -> None:
    with fake_cuda():
        loader = _fast_loader(imagenet_root, gpu.Normalize([0.5], [0.25]), num_workers=1)
        it = iter(loader)
        next(it)
        assert any(t.name == "fastload-feeder" for t in threading.enumerate())
        del it
        loader.close()
    deadline = time.monotonic() + 10
    while any(t.name == "fastload-feeder" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(t.name == "fastload-feeder" for t in threading.enumerate())


def test_closing_a_fed_pass_waits_for_its_last_copy_out_of_host_memory(imagenet_root: Path) -> None:
    """The loader frees (or unlocks) its batch memory after a pass closes: the feeder's last copy
    out of it must be done first (its event waited on), as every earlier one was."""
    with fake_cuda() as (streams, _):
        waited: list[Any] = []
        streams.synchronize_event = waited.append  # type: ignore[method-assign]
        loader = _fast_loader(imagenet_root, gpu.Normalize([0.5], [0.25]), num_workers=1)
        it = iter(loader)
        next(it)
        fed = it._fed  # type: ignore[attr-defined]
        fed.feeder.close()  # (the thread stopped: its last copy is the one left)
        last = fed._copied
        assert last is not None and last not in waited
        fed.close()
        assert waited[-1] == last and fed._copied is None
        del it
        loader.close()


@pytest.mark.parametrize("path", ["device", "hybrid", "fast"])
def test_close_during_a_pass_ends_it_on_every_path(imagenet_root: Path, path: str) -> None:
    """loader.close() while a pass iterates: the pass's threads stop, and its next() says the loader
    was closed (the same error on every path; before: decode="device" went on with its threads,
    the fast path failed inside a closed queue)."""
    from fastload import transforms as T

    if path == "fast":
        dataset: Any = fastload.ImageFolder(
            imagenet_root / "train", transform=T.Compose([T.RandomResizedCrop(16)])
        )
        kwargs: dict[str, Any] = {}
    else:
        dataset = fastload.ImageFolder(imagenet_root / "train")
        kwargs = dict(decode=path, device="cpu", gpu_transforms=gpu.Compose([gpu.RandomResizedCrop(16)]))
    loader = fastload.DataLoader(dataset, batch_size=4, shuffle=True, num_workers=1, **kwargs)
    it = iter(loader)
    next(it)
    loader.close()
    with pytest.raises(
        RuntimeError, match=r"the DataLoader was closed \(close\(\), or its workers shut down\)"
    ):
        next(it)
    if path != "fast":  # nothing decoded or read ahead is kept: device memory goes with the pass
        source = it._source  # type: ignore[attr-defined]
        assert not source.decodes and not source.reads
    deadline = time.monotonic() + 10
    while any(t.name.startswith("fastload-") for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("fastload-")]
    assert len(list(loader)) == len(loader)  # the next pass starts afresh
