"""Batches built in place on torch's path (fastload._stream): default_collate's batches, one batch held.

Real worker processes over the synthetic JPEG tree; the unit tests call fetch/collate directly with
streaming on, as a worker has it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torchvision
from torch.utils.data import default_collate
from torchvision import transforms as tv

import fastload
from fastload import _stream


class _Identity:
    """An op fastload does not reproduce: the pipeline stays on torch's path."""

    def __call__(self, x: Any) -> Any:
        return x


def _tv_pipeline() -> tv.Compose:
    return tv.Compose([tv.RandomResizedCrop(32), tv.RandomHorizontalFlip(), tv.PILToTensor(), _Identity()])


def _plain_collate(batch: list[Any]) -> Any:
    """torch's default_collate behind another function: the loader does not stream for it."""
    return default_collate(batch)


class _Recorded:
    """A worker_init_fn that writes whether streaming is on in that worker."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __call__(self, worker_id: int) -> None:
        (self.path / f"w{worker_id}").write_text(str(_stream.enabled()))


@pytest.mark.parametrize("kind", ["torchvision", "fastload"])
def test_streamed_batches_are_default_collates(imagenet_root: Path, tmp_path: Path, kind: str) -> None:
    """Same batches as with a collate_fn of the user's (which turns streaming off; here it calls
    default_collate), including the short last batch; one shared-memory tensor, as default_collate
    makes it."""
    root = imagenet_root / "train"
    make = torchvision.datasets.ImageFolder if kind == "torchvision" else fastload.ImageFolder
    dataset = make(root, transform=_tv_pipeline())
    runs = []
    for given in (None, _plain_collate):
        torch.manual_seed(3)
        loader = fastload.DataLoader(
            dataset,
            batch_size=5,  # 32 samples: 6 batches of 5 and one of 2
            shuffle=True,
            num_workers=2,
            collate_fn=given,
            worker_init_fn=_Recorded(tmp_path),
            multiprocessing_context="fork",
        )
        assert not loader.fast_path
        runs.append(list(loader))
        loader.close()
        flags = {p.read_text() for p in tmp_path.iterdir()}
        assert flags == {"True" if given is None else "False"}, flags  # streamed only without a collate_fn
    streamed, collated = runs
    assert len(streamed) == len(collated) == 7 and len(streamed[-1][1]) == 2
    for (images, labels), (ref_images, ref_labels) in zip(streamed, collated, strict=True):
        assert type(images) is torch.Tensor and images.dtype == torch.uint8
        assert images.shape[1:] == (3, 32, 32)
        assert torch.equal(images, ref_images) and torch.equal(labels, ref_labels)
        assert labels.dtype == torch.int64 and images.is_shared() == ref_images.is_shared()


@pytest.mark.parametrize("kind", ["torchvision", "fastload"])
def test_streamed_batches_are_torchs_own(imagenet_root: Path, kind: str) -> None:
    """The same case through torch.utils.data.DataLoader (a pipeline without random ops, in order):
    the same batches, types and sharing."""
    make = torchvision.datasets.ImageFolder if kind == "torchvision" else fastload.ImageFolder
    transform = tv.Compose([tv.Resize(20), tv.CenterCrop(16), tv.PILToTensor(), _Identity()])
    dataset = make(imagenet_root / "train", transform=transform)
    want = list(torch.utils.data.DataLoader(dataset, batch_size=5, num_workers=2))
    loader = fastload.DataLoader(dataset, batch_size=5, num_workers=2, multiprocessing_context="fork")
    got = list(loader)
    loader.close()
    assert len(got) == len(want) == 7
    for ours, theirs in zip(got, want, strict=True):
        assert type(ours) is type(theirs) and len(ours) == len(theirs) == 2
        for a, b in zip(ours, theirs, strict=True):
            assert type(a) is type(b) and a.dtype == b.dtype and a.stride() == b.stride()
            assert torch.equal(a, b) and a.is_shared() == b.is_shared()


class _Samples(torch.utils.data.Dataset):
    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Any:
        return self.items[i]


@pytest.fixture
def streaming(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_stream, "_ENABLED", True)


def test_fetch_writes_rows_of_one_batch_and_collate_returns_it(streaming: None) -> None:
    items = [(torch.full((2, 3), i, dtype=torch.float32), i, f"s{i}") for i in range(4)]
    samples = _stream.fetch(_Samples(items), [2, 0, 3])
    images = [s[0] for s in samples]
    assert len({t.untyped_storage().data_ptr() for t in images}) == 1  # rows of one tensor
    batch = _stream.collate(samples)
    ref = default_collate([items[2], items[0], items[3]])
    assert batch[0].data_ptr() == images[0].data_ptr()  # that tensor itself, not a new stack
    assert torch.equal(batch[0], ref[0]) and torch.equal(batch[1], ref[1]) and batch[2] == ref[2]
    assert type(batch) is type(ref)  # a list, as default_collate returns for tuples


def test_unequal_shapes_give_torchs_error(streaming: None) -> None:
    items = [(torch.zeros(3, 4, 4, dtype=torch.uint8), 0), (torch.zeros(3, 5, 4, dtype=torch.uint8), 1)]
    with pytest.raises(RuntimeError) as ours:
        _stream.collate(_stream.fetch(_Samples(items), [0, 1]))
    with pytest.raises(RuntimeError) as torchs:
        default_collate(items)
    assert str(ours.value) == str(torchs.value)


@pytest.mark.parametrize(
    "make",
    [
        lambda i: {"image": torch.full((2,), i)},  # a dict: not streamed
        lambda i: torch.full((2,), i, dtype=torch.float32, requires_grad=True),  # needs grad
        lambda i: (torch.full((2,), i).as_subclass(_Sub), i),  # a tensor subclass
        lambda i: (torch.full((2,), i) if i % 2 else torch.full((2,), i, dtype=torch.float64), i),  # dtype
        lambda i: (torch.full((2,), i), [i, i]),  # a list inside: collated as torch does
        lambda i: i,  # no tensor at all
    ],
    ids=["dict", "requires-grad", "subclass", "dtype-changes", "nested-list", "int"],
)
def test_anything_else_is_collated_as_torch_does(streaming: None, make: Any) -> None:
    items = [make(i) for i in range(4)]
    got = _stream.collate(_stream.fetch(_Samples(items), [0, 1, 2, 3]))
    ref = default_collate(items)
    assert type(got) is type(ref)
    flat_got, spec = torch.utils._pytree.tree_flatten(got)
    flat_ref, ref_spec = torch.utils._pytree.tree_flatten(ref)
    assert spec == ref_spec
    for a, b in zip(flat_got, flat_ref, strict=True):
        assert type(a) is type(b)
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


class _Sub(torch.Tensor):
    pass


def test_a_collate_fn_assigned_later_is_used(imagenet_root: Path, tmp_path: Path) -> None:
    """torch lets a loader's collate_fn be replaced after construction: it is the one that runs."""
    dataset = fastload.ImageFolder(imagenet_root / "val", transform=_tv_pipeline())
    loader = fastload.DataLoader(dataset, batch_size=4, num_workers=1, worker_init_fn=_Recorded(tmp_path))
    loader.collate_fn = _Tagged()
    batches = list(loader)
    loader.close()
    assert batches and all(b[0] == "tagged" for b in batches)
    assert (tmp_path / "w0").read_text() == "False"


class _Tagged:
    def __call__(self, batch: list[Any]) -> Any:
        return ("tagged", default_collate(batch))


def test_off_it_is_a_plain_list(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside fastload's torch-path workers (e.g. torch's own DataLoader): torch's fetch exactly."""
    monkeypatch.setattr(_stream, "_ENABLED", False)
    items = [(torch.full((2,), i), i) for i in range(3)]
    samples = _stream.fetch(_Samples(items), [1, 2])
    assert samples[0] is items[1] and samples[1] is items[2]


class _Big:
    """A transform whose output is an 8 MB tensor; records the worker's peak memory (VmHWM) each call."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __call__(self, image: Any) -> torch.Tensor:
        status = Path("/proc/self/status").read_text()
        peak = next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM"))
        with open(self.path, "a") as f:
            f.write(peak + "\n")
        return torch.ones(8 * 2**20, dtype=torch.uint8)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_a_worker_holds_one_batch_not_two(imagenet_root: Path, tmp_path: Path) -> None:
    """The point of it: 32 samples of 8 MB make a 256 MB batch. Collated from a list, the worker holds
    the samples and their stack at once; streamed, the batch and one sample."""
    peaks = []
    for given in (_plain_collate, None):
        log = tmp_path / f"{given is None}.txt"
        dataset = fastload.ImageFolder(imagenet_root / "train", transform=_Big(log))
        loader = fastload.DataLoader(
            dataset,
            batch_size=32,
            num_workers=1,
            collate_fn=given,
            # spawn: a forked worker starts with its parent's heap, whose free resident blocks it
            # reuses without a new peak (after other tests: 72 MB growth both ways, nothing measured)
            multiprocessing_context="spawn",
        )
        for _ in range(2):  # two passes: the second one's first sample sees the first pass's peak
            for batch in loader:
                del batch
        loader.close()
        kb = [int(v) for v in log.read_text().split()]
        peaks.append(max(kb) - kb[0])  # growth of the peak since the first sample
    collated, streamed = peaks
    # the samples' 256 MB no longer held next to their stack (measured: 200-228 MB less; the rest of a
    # worker's memory moves by some 20 MB from run to run)
    assert collated > 384 * 1024 and collated - streamed > 128 * 1024, (collated, streamed)


@pytest.mark.parametrize("kind", ["torchvision", "fastload"])
def test_without_batching_samples_are_converted_as_torch_does(imagenet_root: Path, kind: str) -> None:
    """batch_size=None: torch hands each sample to default_convert, not to a collate (a sample of an
    image and an int is no batch): the same samples as torch's DataLoader, in workers too."""
    make = torchvision.datasets.ImageFolder if kind == "torchvision" else fastload.ImageFolder
    dataset = make(imagenet_root / "val", transform=tv.Compose([tv.CenterCrop(16), tv.PILToTensor()]))
    want = list(torch.utils.data.DataLoader(dataset, batch_size=None))
    loader = fastload.DataLoader(dataset, batch_size=None, num_workers=1, multiprocessing_context="fork")
    got = list(loader)
    loader.close()
    assert len(got) == len(want)
    for (image, label), (ref_image, ref_label) in zip(got, want, strict=True):
        assert type(image) is torch.Tensor and torch.equal(image, ref_image)
        assert type(label) is type(ref_label) and label == ref_label
