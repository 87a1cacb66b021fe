"""CUDAPrefetcher: stream ordering through an injected fake backend, pass-through, CPU end to end."""

from __future__ import annotations

import collections
import contextlib
import warnings

import pytest
import torch
import torchvision.transforms.v2.functional as tvf
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

from fastload import gpu
from fastload.batch import IndexedBatch
from fastload.device import default_device, device_is_cuda
from fastload.gpu.prefetch import CUDAPrefetcher
from fastload.gpu.streams import stream_backend

cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


# ---------------------------------------------------------------------------------------------
# A fake stream backend that records every call in order
# ---------------------------------------------------------------------------------------------


class FakeStream:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


class FakeStreams:
    """Implements the StreamBackend protocol on CPU tensors and logs the calls."""

    is_cuda = False

    def __init__(self, pinned: bool = True) -> None:
        self.log: list[tuple] = []
        self.consumer = FakeStream("consumer")
        self.active = [self.consumer]
        self.created: list[FakeStream] = []
        self.events = 0
        self.pinned = pinned

    def new_stream(self, device):
        s = FakeStream(f"side{len(self.created)}")
        self.created.append(s)
        self.log.append(("new_stream", s.name))
        return s

    def current_stream(self, device):
        return self.active[-1]

    @contextlib.contextmanager
    def stream_context(self, stream):
        self.active.append(stream)
        self.log.append(("enter", stream.name))
        try:
            yield
        finally:
            self.active.pop()
            self.log.append(("exit", stream.name))

    def wait_stream(self, waiter, waitee):
        self.log.append(("wait", waiter.name, waitee.name))

    def record_stream(self, tensor, stream):
        self.log.append(("record_stream", stream.name, id(tensor)))

    def record_event(self, stream):
        self.events += 1
        self.log.append(("record_event", stream.name, self.events))
        return self.events

    def synchronize_event(self, event):
        self.log.append(("sync_event", event))

    def to_device(self, tensor, device):
        out = tensor.clone()
        self.log.append(("copy", self.active[-1].name, int(tensor.flatten()[0]) if tensor.numel() else None))
        return out

    def is_pinned(self, tensor):
        return self.pinned

    def synchronize(self, device):
        pass


def tagged_batches(n, batch=2):
    """Batches whose first image pixel is the batch number, so copies can be traced."""
    out = []
    for k in range(n):
        images = torch.full((batch, 3, 4, 4), k, dtype=torch.uint8)
        out.append((images, torch.full((batch,), k, dtype=torch.int64)))
    return out


class RecordingTransform:
    def __init__(self, backend: FakeStreams) -> None:
        self.backend = backend

    def __call__(self, images):
        self.backend.log.append(("transform", self.backend.active[-1].name, int(images.flatten()[0])))
        return images.float()


def run_epoch(prefetcher, backend):
    got = []
    for images, labels in prefetcher:
        k = int(labels[0])
        backend.log.append(("consumed", k, id(images), id(labels)))
        got.append(k)
    return got


def position(log, entry):
    return log.index(entry)


def assert_protocol(log, n_batches, side="side0", consumer="consumer"):
    """The ordering rules of the module docs, for batches 0..n-1 of one epoch."""
    for k in range(n_batches):
        copy = position(log, ("copy", side, k))  # copies run inside the side stream context
        transform = position(log, ("transform", side, k))
        # the side stream waits on the consumer before the transforms (which may reuse memory)
        side_waits = [i for i, e in enumerate(log) if e == ("wait", side, consumer) and copy < i < transform]
        assert side_waits, f"batch {k}: no side.wait_stream(consumer) between copy and transform"
        consumed_at = position(log, next(e for e in log if e[:2] == ("consumed", k)))
        _, _, images_id, labels_id = log[consumed_at]
        # before batch k is handed out, the consumer waits on the side stream, after its transform ...
        hand_out_waits = [
            i for i, e in enumerate(log) if e == ("wait", consumer, side) and transform < i < consumed_at
        ]
        assert len(hand_out_waits) == 1, f"batch {k}: expected one consumer.wait_stream(side)"
        wait = hand_out_waits[0]
        # ... and no later batch's transform is queued before that wait (it would delay batch k)
        if k + 1 < n_batches:
            assert wait < position(log, ("transform", side, k + 1))
            # batch k+1 was already copied and transformed before k was handed out: overlap
            assert position(log, ("copy", side, k + 1)) < consumed_at
        # the handed-out tensors are record_stream'ed on the consumer stream, after the wait
        # (ids of freed tensors get reused, so look only between the wait and the hand-out)
        recorded = {e[2] for e in log[wait:consumed_at] if e[:2] == ("record_stream", consumer)}
        assert {images_id, labels_id} <= recorded


# ---------------------------------------------------------------------------------------------
# Stream protocol
# ---------------------------------------------------------------------------------------------


def test_stream_protocol_over_a_multi_batch_epoch():
    backend = FakeStreams()
    p = CUDAPrefetcher(
        tagged_batches(5), device="cpu", transforms=RecordingTransform(backend), backend=backend
    )
    assert run_epoch(p, backend) == [0, 1, 2, 3, 4]
    log = backend.log
    assert [e for e in log if e[0] == "new_stream"] == [("new_stream", "side0")]
    assert_protocol(log, 5)
    # each batch's copy is followed by an event that the host waits on (once the batch is handed
    # out) before it asks the loader for the next batch, whose host memory may be recycled
    for k in range(4):
        copy = position(log, ("copy", "side0", k))
        event = next(e for e in log[copy:] if e[0] == "record_event")[2]
        sync = position(log, ("sync_event", event))
        assert copy < sync < position(log, ("copy", "side0", k + 1))


def test_second_epoch_reuses_the_same_side_stream():
    backend = FakeStreams()
    p = CUDAPrefetcher(
        tagged_batches(3), device="cpu", transforms=RecordingTransform(backend), backend=backend
    )
    assert run_epoch(p, backend) == [0, 1, 2]
    first = list(backend.log)
    backend.log.clear()
    assert run_epoch(p, backend) == [0, 1, 2]
    assert len(backend.created) == 1 and not any(e[0] == "new_stream" for e in backend.log)
    assert ("new_stream", "side0") in first
    assert_protocol(backend.log, 3)


def test_empty_loader_yields_nothing():
    backend = FakeStreams()
    p = CUDAPrefetcher([], device="cpu", backend=backend)
    assert list(p) == [] and list(p) == []
    assert not any(e[0] in ("copy", "record_stream", "wait") for e in backend.log)
    assert p.stats.batches == 0
    assert (
        list(CUDAPrefetcher(DataLoader(TensorDataset(torch.zeros(0, 3)), batch_size=2), device="cpu")) == []
    )


def test_loader_exception_mid_epoch_propagates_after_earlier_batches():
    backend = FakeStreams()
    boom = RuntimeError("decode failed at batch 2")

    def loader():
        yield from tagged_batches(2)
        raise boom

    class Loader:
        def __iter__(self):
            return loader()

    p = CUDAPrefetcher(Loader(), device="cpu", transforms=RecordingTransform(backend), backend=backend)
    it = iter(p)
    assert int(next(it)[1][0]) == 0
    assert int(next(it)[1][0]) == 1
    with pytest.raises(RuntimeError, match="decode failed at batch 2") as info:
        next(it)
    assert info.value is boom
    with pytest.raises(StopIteration):
        next(it)
    # the two batches handed out were each waited for by the consumer stream, and nothing else was
    assert backend.log.count(("wait", "consumer", "side0")) == 2
    assert [e[2] for e in backend.log if e[0] == "transform"] == [0, 1]


def test_transform_exception_is_raised_where_its_batch_would_be():
    def transform(images):
        if int(images.flatten()[0]) == 1:
            raise ValueError("bad batch 1")
        return images

    p = CUDAPrefetcher(tagged_batches(3), device="cpu", transforms=transform, dtype=None)
    it = iter(p)
    assert int(next(it)[1][0]) == 0
    with pytest.raises(ValueError, match="bad batch 1"):
        next(it)


def test_pageable_memory_warns_once_at_the_callers_line():
    backend = FakeStreams(pinned=False)
    backend.is_cuda = True
    p = CUDAPrefetcher(tagged_batches(3), device="cpu", backend=backend)
    with pytest.warns(UserWarning, match="pin_memory=True") as record:
        list(p)
    assert len([w for w in record if "pin_memory" in str(w.message)]) == 1
    assert record[0].filename == __file__


# ---------------------------------------------------------------------------------------------
# Device helpers and backend choice
# ---------------------------------------------------------------------------------------------


def test_device_helpers_and_backend_choice_do_not_touch_cuda():
    assert device_is_cuda("cuda") and device_is_cuda(torch.device("cuda", 1)) and device_is_cuda(0)
    assert not device_is_cuda("cpu") and not device_is_cuda(None) and not device_is_cuda("meta")
    assert stream_backend("cuda:0").is_cuda and not stream_backend("cpu").is_cuda
    assert default_device().type == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_cuda_device_without_cuda_is_a_value_error():
    with pytest.raises(ValueError, match="device should be available, but got device='cuda'"):
        CUDAPrefetcher([], device="cuda")


def test_bad_arguments():
    with pytest.raises(TypeError, match="loader should be an iterable"):
        CUDAPrefetcher(3, device="cpu")
    with pytest.raises(TypeError, match="dtype should be a floating"):
        CUDAPrefetcher([], device="cpu", dtype=torch.int64)
    with pytest.raises(TypeError, match="transforms should be callable"):
        CUDAPrefetcher([], device="cpu", transforms=5)
    with pytest.raises(ValueError, match="epoch should be a non-negative integer, but got epoch=-1"):
        CUDAPrefetcher([], device="cpu").set_epoch(-1)


# ---------------------------------------------------------------------------------------------
# Pass-through, epochs, seeds, indices, resume
# ---------------------------------------------------------------------------------------------


def test_pass_through_attributes_and_set_epoch():
    dataset = TensorDataset(torch.zeros(10, 3, 4, 4, dtype=torch.uint8), torch.arange(10))
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=17)
    loader = DataLoader(dataset, batch_size=4, sampler=sampler)
    keys = []

    class Spy(gpu.BatchTransform):
        def __call__(self, images, *, indices=None, epoch=0, seed=0):
            keys.append((epoch, seed))
            return images

    p = CUDAPrefetcher(loader, device="cpu", transforms=Spy())
    assert len(p) == 3 and p.dataset is dataset and p.sampler is sampler and p.batch_size == 4
    p.set_epoch(3)
    assert sampler.epoch == 3
    # same order as the sampler for that epoch
    labels = torch.cat([y for _, y in p]).tolist()
    assert labels == list(iter(sampler))
    assert keys == [(3, 17)] * 3  # epoch and seed come from the sampler
    # a plain iterable has no epoch of its own: the one given to set_epoch is used
    keys.clear()
    plain = CUDAPrefetcher(tagged_batches(1), device="cpu", transforms=Spy())
    plain.set_epoch(5)
    list(plain)
    assert keys == [(5, 0)]
    with pytest.raises(AttributeError, match="state_dict"):
        p.state_dict()
    with pytest.raises(AttributeError):
        _ = CUDAPrefetcher([1], device="cpu").dataset


class IndexedDataset(Dataset):
    def __init__(self, images: torch.Tensor) -> None:
        self.images = images

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int):
        return self.images[i], i % 10, i


def collate_indexed(samples):
    images, labels, indices = zip(*samples, strict=False)
    return IndexedBatch(torch.stack(images), torch.tensor(labels), torch.tensor(indices))


class SeededLoader(DataLoader):
    """A torch DataLoader exposing the seed and epoch attributes the prefetcher looks for."""

    seed = 21
    epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


def natural_images(n: int, h: int, w: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    coarse = torch.randint(0, 256, (n, 3, h // 8 + 2, w // 8 + 2), generator=g, dtype=torch.uint8)
    return tvf.resize(coarse, [h, w], antialias=True)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_indexed_batches_give_per_sample_augmentation_independent_of_batching(num_workers):
    images = natural_images(12, 60, 50)
    pipeline = gpu.Compose(
        [gpu.RandomResizedCrop(32), gpu.RandomHorizontalFlip(), gpu.Normalize([0.5], [0.25])]
    )
    outputs = {}
    for batch_size in (4, 5):
        loader = SeededLoader(
            IndexedDataset(images),
            batch_size=batch_size,
            shuffle=True,
            collate_fn=collate_indexed,
            num_workers=num_workers,
        )
        p = CUDAPrefetcher(loader, device="cpu", transforms=pipeline)
        p.set_epoch(2)
        got = {}
        for batch in p:
            x, y = batch
            assert isinstance(batch, IndexedBatch) and x.dtype == torch.float32
            for row, index in enumerate(batch.indices.tolist()):
                got[index] = x[row]
        outputs[batch_size] = got
    assert sorted(outputs[4]) == list(range(12))
    expected = pipeline(images, indices=list(range(12)), epoch=2, seed=21)
    for bs in (4, 5):
        for index in range(12):
            assert torch.equal(outputs[bs][index], expected[index])


class CountingLoader:
    """A stateful loader: state is the number of batches yielded so far."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.position = 0

    def __iter__(self):
        while self.position < self.n:
            k = self.position
            self.position += 1
            yield tagged_batches(k + 1)[k]
        self.position = 0

    def __len__(self) -> int:
        return self.n

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def test_state_dict_describes_what_the_consumer_has_received():
    loader = CountingLoader(6)
    p = CUDAPrefetcher(loader, device="cpu", dtype=None)
    it = iter(p)
    seen = [int(next(it)[1][0]) for _ in range(3)]
    assert loader.position == 4  # the prefetcher is one batch ahead ...
    state = p.state_dict()
    assert state == {"position": 3}  # ... but the state is where the consumer is
    resumed_loader = CountingLoader(6)
    resumed = CUDAPrefetcher(resumed_loader, device="cpu", dtype=None)
    resumed.load_state_dict(state)
    seen += [int(y[0]) for _, y in resumed]
    assert seen == [0, 1, 2, 3, 4, 5]  # nothing skipped, nothing repeated
    assert resumed.state_dict() == {"position": 0}  # epoch over: live state


# ---------------------------------------------------------------------------------------------
# Batch structures, dtypes, stats
# ---------------------------------------------------------------------------------------------


def test_end_to_end_torch_dataloader_of_uint8_batches_gives_normalized_floats():
    images = natural_images(10, 24, 20)
    labels = torch.arange(10)
    loader = DataLoader(TensorDataset(images, labels), batch_size=4)
    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    p = CUDAPrefetcher(loader, device="cpu", transforms=gpu.Normalize(mean, std))
    out = list(p)
    assert [len(y) for _, y in out] == [4, 4, 2]
    got = torch.cat([x for x, _ in out])
    assert torch.equal(got, tvf.normalize(tvf.to_dtype(images, torch.float32, scale=True), mean, std))
    assert torch.equal(torch.cat([y for _, y in out]), labels)
    assert p.stats.batches == 3 and p.stats.samples == 10
    assert 0.0 <= p.stats.wait_seconds <= p.stats.wall_seconds and 0.0 <= p.stats.stall_fraction <= 1.0
    assert p.stats.summary().startswith("3 batches, 10 samples")


def test_dtype_and_channels_last_of_handed_out_images():
    batches = tagged_batches(2)
    assert [x.dtype for x, _ in CUDAPrefetcher(batches, device="cpu", dtype=None)] == [torch.uint8] * 2
    x, _ = next(iter(CUDAPrefetcher(batches, device="cpu")))
    assert torch.equal(x, tvf.to_dtype(batches[0][0], torch.float32, scale=True))
    x, _ = next(iter(CUDAPrefetcher(batches, device="cpu", dtype=torch.float16, channels_last=True)))
    assert x.dtype == torch.float16 and x.is_contiguous(memory_format=torch.channels_last)
    p = CUDAPrefetcher(batches, device="cpu", transforms=gpu.Normalize([0.5], [0.5], dtype=torch.bfloat16))
    with pytest.warns(UserWarning, match="bfloat16 images but dtype=torch.float32") as record:
        out = list(p)
    assert len(record) == 1 and all(x.dtype == torch.float32 for x, _ in out)


def test_dict_namedtuple_and_list_batches():
    Pair = collections.namedtuple("Pair", ["img", "target"])
    images = torch.full((2, 3, 4, 4), 255, dtype=torch.uint8)
    batches = [
        {"images": images, "labels": torch.tensor([1, 2]), "indices": torch.tensor([7, 8]), "name": "a"},
        Pair(images, torch.tensor([1, 2])),
        [images, torch.tensor([1, 2])],
        images,
    ]
    seen = []

    class Spy(gpu.BatchTransform):
        def __call__(self, images, *, indices=None, epoch=0, seed=0):
            seen.append(None if indices is None else indices.tolist())
            return images

    out = list(CUDAPrefetcher(batches, device="cpu", transforms=Spy()))
    assert seen == [[7, 8], None, None, None]
    assert (
        out[0]["name"] == "a"
        and out[0]["images"].dtype == torch.float32
        and float(out[0]["images"].max()) == 1.0
    )
    assert isinstance(out[1], Pair) and out[1].img.dtype == torch.float32
    assert isinstance(out[2], list) and out[2][0].dtype == torch.float32
    assert out[3].dtype == torch.float32


def test_list_of_variable_size_images_is_batched_by_the_transforms():
    images = [torch.zeros(3, 40, 50, dtype=torch.uint8), torch.zeros(3, 60, 30, dtype=torch.uint8)]
    lists = [(images, torch.tensor([0, 1]))]
    p = CUDAPrefetcher(lists, device="cpu", transforms=gpu.Compose([gpu.Resize(32), gpu.CenterCrop(24)]))
    ((x, y),) = list(p)
    assert x.shape == (2, 3, 24, 24) and x.dtype == torch.float32 and p.stats.samples == 2


# ---------------------------------------------------------------------------------------------
# The real thing, where a GPU exists
# ---------------------------------------------------------------------------------------------


@cuda
@needs_cuda
def test_cuda_prefetcher_matches_cpu_reference_over_pinned_loader():
    images = natural_images(20, 64, 48)
    loader = DataLoader(
        IndexedDataset(images), batch_size=6, collate_fn=collate_indexed, pin_memory=True, num_workers=0
    )
    pipeline = gpu.Compose(
        [gpu.RandomResizedCrop(32), gpu.RandomHorizontalFlip(), gpu.Normalize([0.5], [0.25])]
    )
    p = CUDAPrefetcher(loader, device="cuda", transforms=pipeline, channels_last=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # pinned: no pageable-memory warning
        batches = list(p)
    side = p._side
    assert isinstance(side, torch.cuda.Stream) and side != torch.cuda.current_stream()
    list(p)
    assert p._side is side
    got = torch.cat([x for x, _ in batches])
    assert got.device.type == "cuda" and got.is_contiguous(memory_format=torch.channels_last)
    expected = pipeline(images, indices=list(range(20)))
    # same parameters; resampling on device may differ from the CPU by one uint8 level (x 1/255/0.25)
    assert (got.cpu() - expected).abs().max() <= 1 / 255 / 0.25 + 1e-6
