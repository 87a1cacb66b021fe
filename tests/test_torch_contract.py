"""torch's DataLoader contract, with fastload.DataLoader in its place.

Every check runs the same case through ``torch.utils.data.DataLoader`` (the reference) and
``fastload.DataLoader`` and compares what a training loop sees: batches, errors (type and
message), iterator semantics.
"""

from __future__ import annotations

import collections
import inspect
import itertools
import logging
import multiprocessing
import random
import time
import warnings
from typing import Any

import numpy as np
import PIL
import pytest
import torch
from torch.utils.data import IterableDataset

import fastload
from fastload._epoch import DefaultSeed
from fastload._passorder import ENDLESS_SAMPLER
from fastload.loader import DataLoaderIterator

LOADERS = [torch.utils.data.DataLoader, fastload.DataLoader]
Pair = collections.namedtuple("Pair", ["x", "y"])
#: pickle's words for a class or function defined inside a function ("get": Python 3.13)
LOCAL_OBJECT = r"Can't (pickle|get) local object"


class _Range(torch.utils.data.Dataset[Any]):
    def __init__(self, n: int = 10, kind: str = "tuple", bad: frozenset[int] = frozenset()) -> None:
        self.n, self.kind, self.bad = n, kind, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        if i in self.bad:
            raise KeyError(f"sample {i} is broken")
        x = torch.full((3,), float(i))
        if self.kind == "dict":
            return {"x": x, "y": i, "name": f"s{i}"}
        if self.kind == "namedtuple":
            return Pair(x, i)
        if self.kind == "numpy":
            return np.full((2,), i, dtype=np.int32), i
        if self.kind == "str":
            return f"sample-{i}"
        if self.kind == "nested":
            return torch.nested.nested_tensor([torch.ones(i % 3 + 1)]).unbind()[0]
        if self.kind == "all":  # every structure above but the nested tensor, in one sample
            kinds = ("tuple", "dict", "namedtuple", "numpy", "str")
            return {kind: _Range(self.n, kind)[i] for kind in kinds}
        return x, i


class _Stream(IterableDataset[int]):
    def __iter__(self) -> Any:
        return iter(range(20))


def _outcome(make: Any) -> tuple[str, str]:
    try:
        make()
    except Exception as e:  # noqa: BLE001 - the test compares what was raised
        return type(e).__name__, str(e)
    return "ok", ""


def _drain(loader: Any) -> tuple[list[Any], list[str]]:
    it = iter(loader)
    out: list[Any] = []
    errors: list[str] = []
    for _ in range(200):
        try:
            batch = next(it)
        except StopIteration:
            return out, errors
        except Exception as e:  # noqa: BLE001
            errors.append(f"{type(e).__name__}: {e.args[0] if e.args else ''}")
            continue
        out.append(batch)
    raise AssertionError("the iterator never ended")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        if a.is_nested:
            return all(torch.equal(x, y) for x, y in zip(a.unbind(), b.unbind(), strict=True))
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _nested_collate(batch: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.nested_tensor(batch)


def _torch_sends(kind: str = "nested") -> bool:
    """Whether this torch pickles a nested (or sparse) tensor for another process (torch 2.1 does not)."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 - registers torch's reductions

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's prototype notice
        if kind == "nested":
            tensor = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
        else:
            tensor = torch.eye(2).to_sparse()
    try:
        ForkingPickler.dumps(tensor)
    except (RuntimeError, NotImplementedError):
        return False
    return True


# ------------------------------------------------------------------------------ constructor errors

BAD_ARGS: list[dict[str, Any]] = [
    {"batch_size": 0},
    {"batch_size": -3},
    {"timeout": -1},
    {"num_workers": 2, "prefetch_factor": -1},
    {"num_workers": 0, "prefetch_factor": 2},
    {"num_workers": 0, "persistent_workers": True},
    {"shuffle": True, "sampler": [0, 1]},
    {"batch_sampler": [[0, 1]], "batch_size": 4},
    {"batch_sampler": [[0, 1]], "batch_size": None, "drop_last": True},
    {"batch_sampler": [[0, 1]], "batch_size": None, "shuffle": True},
    {"batch_sampler": [[0, 1]], "batch_size": None, "sampler": [0, 1]},
    {"batch_size": None, "drop_last": True},
    {"num_workers": 2, "multiprocessing_context": "no-such-context"},
]


@pytest.mark.parametrize("kwargs", BAD_ARGS, ids=lambda kw: ",".join(kw))
def test_constructor_errors_are_torchs(kwargs: dict[str, Any]) -> None:
    kwargs = {"num_workers": 0, **kwargs}
    theirs = _outcome(lambda: torch.utils.data.DataLoader(_Range(), **kwargs))
    ours = _outcome(lambda: fastload.DataLoader(_Range(), **kwargs))
    assert theirs[0] != "ok"
    assert ours == theirs


@pytest.mark.parametrize("generator", [None, torch.Generator()], ids=["global", "generator"])
def test_shuffling_an_empty_dataset_is_torchs_error(generator: Any) -> None:
    """torch's ``RandomSampler`` refuses an empty dataset (a wrong path, usually) at construction;
    fastload's own sampler stands in for it and used to yield nothing instead."""
    theirs = _outcome(lambda: torch.utils.data.DataLoader(_Range(0), shuffle=True, generator=generator))
    ours = _outcome(lambda: fastload.DataLoader(_Range(0), shuffle=True, generator=generator))
    assert theirs[0] == "ValueError" and ours == theirs
    assert list(fastload.DataLoader(_Range(0))) == []  # not shuffled: no error, as torch


def test_a_negative_num_workers_is_torchs_error_naming_auto_after_it() -> None:
    theirs = _outcome(lambda: torch.utils.data.DataLoader(_Range(), num_workers=-1))
    ours = _outcome(lambda: fastload.DataLoader(_Range(), num_workers=-1))
    assert theirs[0] == ours[0] == "ValueError"
    assert ours[1].startswith(theirs[1])  # torch's words first (its own tests match them) ...
    assert "'auto'" in ours[1][len(theirs[1]) :]  # ... then fastload's hint
    with pytest.raises(ValueError, match="num_workers option should be non-negative"):  # torch's test
        fastload.DataLoader(_Range(), num_workers=-1)


def test_a_non_integer_num_workers_is_a_type_error_like_torchs() -> None:
    theirs = _outcome(lambda: torch.utils.data.DataLoader(_Range(), num_workers="many"))
    ours = _outcome(lambda: fastload.DataLoader(_Range(), num_workers="many"))
    assert theirs[0] == ours[0] == "TypeError"
    assert "num_workers" in ours[1]  # torch's message is about comparing a str with an int


@pytest.mark.parametrize("kwargs", [{"shuffle": True}, {"sampler": [0, 1]}, {"batch_sampler": [[0]]}])
def test_iterable_dataset_option_errors_are_torchs(kwargs: dict[str, Any]) -> None:
    theirs = _outcome(lambda: torch.utils.data.DataLoader(_Stream(), num_workers=0, **kwargs))
    ours = _outcome(lambda: fastload.DataLoader(_Stream(), num_workers=0, **kwargs))
    assert theirs[0] == "ValueError" and ours == theirs


@pytest.mark.parametrize("name", ["batch_size", "sampler", "batch_sampler", "drop_last", "dataset"])
def test_assigning_after_construction_is_torchs_error(name: str) -> None:
    outcomes = []
    for cls in LOADERS:
        loader = cls(_Range(), batch_size=2, num_workers=0)
        outcomes.append(_outcome(lambda loader=loader: setattr(loader, name, None)))
    assert outcomes[0][0] == "ValueError" and outcomes[0] == outcomes[1]


# ------------------------------------------------------------------------------ iteration


@pytest.mark.parametrize("workers", [0, 2])
def test_errors_inside_a_pass_like_torch(workers: int) -> None:
    ds = _Range(20, bad=frozenset({3, 9, 10}))
    ours = _drain(fastload.DataLoader(ds, batch_size=4, num_workers=workers, seed=0))
    theirs = _drain(torch.utils.data.DataLoader(ds, batch_size=4, num_workers=workers))
    assert ours[1] == theirs[1] and len(ours[1]) == 2
    assert len(ours[0]) == len(theirs[0]) == 3
    assert all(_same(a, b) for a, b in zip(ours[0], theirs[0], strict=True))


_KINDS = ["tuple", "dict", "namedtuple", "numpy", "str", "nested"]


@pytest.mark.parametrize(
    ("kind", "ctx"),
    # each structure with forked workers; the start method is another question (the dataset and
    # the batches cross a fresh interpreter), asked with every structure in one sample
    [(kind, "fork") for kind in _KINDS]
    + [(kind, ctx) for ctx in ("spawn", "forkserver") for kind in ("all", "nested")],
)
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")  # torch's prototype notice
def test_batches_of_every_structure(kind: str, ctx: str) -> None:
    if kind == "nested" and not _torch_sends():
        pytest.skip(
            f"torch {torch.__version__} cannot send a nested tensor between processes (its loader waits)"
        )
    collate = _nested_collate if kind == "nested" else None
    ours, theirs = (
        _drain(
            cls(
                _Range(7, kind),
                batch_size=3,
                num_workers=2,
                multiprocessing_context=multiprocessing.get_context(ctx),
                collate_fn=collate,
            )
        )
        for cls in (fastload.DataLoader, torch.utils.data.DataLoader)
    )
    assert ours[1] == theirs[1] == []
    assert len(ours[0]) == 3 and all(_same(a, b) for a, b in zip(ours[0], theirs[0], strict=True))


def test_iterable_dataset_defaults_yield_each_item_once() -> None:
    ours = [int(v) for b in fastload.DataLoader(_Stream(), batch_size=4) for v in b]
    theirs = [int(v) for b in torch.utils.data.DataLoader(_Stream(), batch_size=4) for v in b]
    assert ours == theirs == list(range(20))


def test_num_workers_true_is_one_worker_as_in_torch() -> None:
    got = []
    for cls in LOADERS:
        loader = cls(_Range(6), batch_size=2, num_workers=True)
        assert loader.num_workers == 1
        got.append([b[1].tolist() for b in loader])
    assert got[0] == got[1] == [[0, 1], [2, 3], [4, 5]]


class _SizedStream(_Stream):
    def __len__(self) -> int:
        return 20


@pytest.mark.parametrize("dataset", [_Stream, _SizedStream])
@pytest.mark.parametrize("batch_size", [4, None])
def test_an_iterable_datasets_pass_has_no_len_as_torchs(dataset: type, batch_size: int | None) -> None:
    """torch's iterator answers ``len()`` with its index sampler's, an endless one for any
    ``IterableDataset`` (a ``__len__`` too: only the loader's ``len()`` reads it)."""
    outcomes = []
    for cls in LOADERS:
        loader = cls(dataset(), batch_size=batch_size, num_workers=0)
        outcomes.append(
            (_outcome(lambda loader=loader: len(iter(loader))), _outcome(lambda loader=loader: len(loader)))
        )
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][0] == ("TypeError", "object of type '_InfiniteConstantSampler' has no len()")


def test_len_subscript_iter_twice_and_iterator_object() -> None:
    alias = fastload.DataLoader[tuple[torch.Tensor, int]]  # generic like torch's
    assert alias is not None
    for cls in LOADERS:
        loader = cls(_Range(10), batch_size=4, num_workers=0)
        assert len(loader) == 3
        first, second = list(loader), list(loader)
        assert len(first) == len(second) == 3
    it = iter(fastload.DataLoader(_Range(10), batch_size=4, num_workers=0))
    assert isinstance(it, DataLoaderIterator) and len(it) == 3


def test_timeout_message_is_torchs() -> None:
    class Slow(_Range):
        def __getitem__(self, i: int) -> Any:
            import time

            time.sleep(5)
            return super().__getitem__(i)

    messages = []
    for cls in LOADERS:
        loader = cls(Slow(4), batch_size=2, num_workers=1, timeout=1)
        with pytest.raises(RuntimeError) as info:
            next(iter(loader))
        messages.append(str(info.value))
    assert messages[0].startswith("DataLoader timed out after 1 seconds")
    assert messages[1] == messages[0]


class _SlowFirstRead(fastload.ImageFolder):
    """Sample 0's first read in a process takes 1.6 s (a slow disk), every later read is immediate."""

    slow = True

    def get_bytes(self, i: int) -> Any:
        import time

        if i == 0 and _SlowFirstRead.slow:
            _SlowFirstRead.slow = False
            time.sleep(1.6)  # past one timeout of 1 s, within two
        return super().get_bytes(i)


def test_after_a_timeout_the_next_call_gives_the_batch_that_timed_out_like_torch(imagenet_root: Any) -> None:
    """torch's iterator raises the timeout, then its next ``next()`` waits for the same batch: so
    does fastload's fast path (its own workers; it used to raise a KeyError there)."""
    from fastload import transforms as T

    got = []
    for cls, worker_type in ((torch.utils.data.DataLoader, None), (fastload.DataLoader, "thread")):
        _SlowFirstRead.slow = True
        ds = _SlowFirstRead(imagenet_root / "train", transform=T.Compose([T.Resize((8, 8))]))
        kwargs: dict[str, Any] = {} if worker_type is None else {"worker_type": worker_type}
        loader = cls(ds, batch_size=4, num_workers=1, timeout=1, **kwargs)
        if cls is fastload.DataLoader:
            assert loader.fast_path  # type: ignore[attr-defined]
        it = iter(loader)
        with pytest.raises(RuntimeError, match="DataLoader timed out after 1 seconds"):
            next(it)
        labels = [next(it)[1].tolist(), next(it)[1].tolist()]  # batch 0 (late), then batch 1
        got.append(labels)
        del it
    assert got[0] == got[1] == [[int(t) for t in ds.targets[0:4]], [int(t) for t in ds.targets[4:8]]]


def test_worker_init_fn_and_worker_info_on_torchs_path() -> None:
    class Info(_Range):
        def __getitem__(self, i: int) -> Any:
            info = torch.utils.data.get_worker_info()
            return torch.tensor([i, -1 if info is None else info.id])

    seen = []
    for cls in LOADERS:
        batches = list(cls(Info(6), batch_size=2, num_workers=2, worker_init_fn=lambda wid: None))
        seen.append([b.tolist() for b in batches])
    assert seen[0] == seen[1]
    assert {w for batch in seen[0] for _, w in batch} == {0, 1}  # batch k from worker k % 2


class _Sharded(torch.utils.data.IterableDataset[Any]):
    def __init__(self) -> None:
        self.start, self.end = 0, 8

    def __iter__(self) -> Any:
        return ((i, int(np.random.randint(1000))) for i in range(self.start, self.end))


def _shard(worker_id: int) -> None:
    """torch's documented worker_init_fn: shards the worker's copy of the dataset (once per copy),
    and seeds numpy from the worker's seed."""
    info = torch.utils.data.get_worker_info()
    assert info is not None
    per_worker = (info.dataset.end - info.dataset.start) // info.num_workers
    info.dataset.start += worker_id * per_worker
    info.dataset.end = info.dataset.start + per_worker
    np.random.seed(info.seed % 2**32)


def test_a_worker_init_fn_runs_in_each_pass_new_workers_by_default() -> None:
    """torch's default starts new workers every pass, each running ``worker_init_fn`` on a fresh
    copy of the dataset: fastload's default keeps workers only without one (here running it
    twice on the same copy would shard a shard, and numpy would not be seeded again)."""

    seen = []
    for cls in LOADERS:
        loader = cls(_Sharded(), batch_size=2, num_workers=2, worker_init_fn=_shard)
        torch.manual_seed(0)  # the workers' seeds
        seen.append([[[t.tolist() for t in b] for b in loader] for _ in range(3)])
        assert loader.persistent_workers is False
    assert seen[0] == seen[1]
    assert [[i for batch in p for i in batch[0]] for p in seen[1]] == [[0, 1, 4, 5, 2, 3, 6, 7]] * 3
    assert seen[1][0] != seen[1][1]  # numpy seeded anew each pass
    assert fastload.DataLoader(
        _Sharded(), num_workers=2, worker_init_fn=_shard, persistent_workers=True
    ).persistent_workers


class _Draws(torch.utils.data.Dataset[Any]):
    """A dataset drawing from torch's RNG in ``__getitem__`` (in the main process, or a worker's)."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> Any:
        return torch.tensor([i, int(torch.randint(0, 1000, ()).item())])


class _InnerLoader:
    """A transform that iterates a loader of its own (in the worker), then draws."""

    def __call__(self, image: Any) -> Any:
        time.sleep(0.02)  # still at work on a left pass's tasks when the next pass starts
        inner = sum(int(b.sum()) for b in torch.utils.data.DataLoader(list(range(3)), batch_size=2))
        return torch.tensor([inner, int(torch.randint(0, 1000, ()).item())])


def _passes_with_a_break(loader: Any) -> list[Any]:
    """Four passes, the second left after one batch."""
    passes = []
    for stop in (None, 1, None, None):
        got = []
        for images, labels in loader:
            got.append((images.tolist(), labels.tolist()))
            if len(got) == stop:
                break
        passes.append(got)
    return passes


def test_default_workers_are_reseeded_at_the_pass_not_by_a_loader_inside_the_dataset(
    imagenet_root: Any,
) -> None:
    """A transform of the user's (here one that iterates a loader of its own inside the worker):
    torch's defaults, new workers each pass, and torch's draws, pass after pass."""
    import torchvision

    dataset = torchvision.datasets.ImageFolder(imagenet_root / "val", transform=_InnerLoader())
    seen = []
    for cls in LOADERS:
        torch.manual_seed(0)
        loader = cls(dataset, batch_size=2, num_workers=2, prefetch_factor=3)
        assert loader.persistent_workers is False
        seen.append(_passes_with_a_break(loader))
    assert seen[0] == seen[1]


def test_kept_workers_of_an_accelerated_head_draw_torchs_numbers_pass_after_pass(imagenet_root: Any) -> None:
    """Head acceleration whose every later op is torchvision's keeps its workers by fastload's
    default, and seeds them at each pass as torch's new workers of that pass would be seeded: the
    same batches as torch's loader (``exact_pixels``), also after a pass left with ``break``."""
    import torchvision
    from torchvision import transforms as T

    pipeline = T.Compose([T.RandomResizedCrop(16), T.TrivialAugmentWide(), T.PILToTensor()])
    dataset = torchvision.datasets.ImageFolder(imagenet_root / "val", transform=pipeline)
    seen = []
    for cls in LOADERS:
        torch.manual_seed(0)
        extra = {"exact_pixels": True} if cls is fastload.DataLoader else {}
        loader = cls(dataset, batch_size=2, num_workers=2, prefetch_factor=3, **extra)
        if cls is fastload.DataLoader:
            assert loader.path == "head-accelerated" and loader.persistent_workers is True
        seen.append(_passes_with_a_break(loader))
    assert seen[0] == seen[1]


class _EagerBatches:
    """A batch_sampler whose ``__iter__`` draws at once (not a generator): torch's new iterator
    calls it twice per pass, around its base seed."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        order = torch.randperm(self.n).tolist()
        return iter([order[i : i + 4] for i in range(0, self.n, 4)])

    def __len__(self) -> int:
        return (self.n + 3) // 4


class _Counting:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, image: Any) -> Any:
        self.calls += 1  # state in the worker's copy of the transform
        return torch.tensor([self.calls, int(torch.randint(0, 1000, ()).item())])


@pytest.mark.parametrize("case", ["eager batch_sampler", "stateful transform"])
def test_a_torchvision_folder_over_passes_is_torchs(imagenet_root: Any, case: str) -> None:
    """On torch's iterator, code of the user's (a ``batch_sampler`` drawing in ``__iter__``, a
    transform that keeps state) gets torch's defaults: new workers each pass, torch's draws."""
    import torchvision

    transform: Any = (
        _Counting() if case == "stateful transform" else torchvision.transforms.Lambda(_draw_image)
    )
    dataset = torchvision.datasets.ImageFolder(imagenet_root / "val", transform=transform)
    seen = []
    for cls in LOADERS:
        torch.manual_seed(0)
        kwargs: dict[str, Any] = (
            {"batch_sampler": _EagerBatches(len(dataset))} if case.startswith("eager") else {}
        )
        loader = cls(dataset, num_workers=2, **({"batch_size": 4} if not kwargs else kwargs))
        assert loader.persistent_workers is False
        seen.append(
            [[[b[0].tolist(), b[1].tolist()] for b in loader] + [torch.rand(1).item()] for _ in range(3)]
        )
    assert seen[0] == seen[1]


def _draw_image(image: Any) -> Any:
    return torch.tensor([image.size[0], int(torch.randint(0, 1000, ()).item())])


class _ShuffledShards(torch.utils.data.IterableDataset[Any]):
    def __init__(self) -> None:
        self.shards = list(range(8))

    def __iter__(self) -> Any:
        random.shuffle(self.shards)  # in place, in the worker's copy of the dataset
        info = torch.utils.data.get_worker_info()
        assert info is not None
        return iter(self.shards[info.id :: info.num_workers])


class _Counted(torch.utils.data.Dataset[Any]):
    def __init__(self) -> None:
        self.calls = 0

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> Any:
        self.calls += 1  # state in the worker's copy
        return torch.tensor([i, self.calls])


@pytest.mark.parametrize("dataset", [_ShuffledShards, _Counted])
def test_a_datasets_own_code_gets_new_workers_each_pass_by_default(dataset: type) -> None:
    """A dataset's own ``__getitem__``/``__iter__`` may change the worker's copy of it; torch's
    default gives each pass new workers with a fresh copy, and so does fastload's default (it
    keeps workers only where it runs every op itself)."""
    seen = []
    for cls in LOADERS:
        torch.manual_seed(0)
        loader = cls(dataset(), batch_size=2, num_workers=2)
        assert loader.persistent_workers is False
        seen.append([[b.tolist() for b in loader] for _ in range(3)])
    assert seen[0] == seen[1]
    assert fastload.DataLoader(dataset(), num_workers=2, persistent_workers=True).persistent_workers


def _rng_trace(make: Any, generator: bool, batches: bool) -> list[Any]:
    """What a training loop sees of torch's RNG (and of ``generator``) around a loader: its random
    numbers after construction, after ``iter()``, after each batch and after each pass, over two
    whole passes and a pass left after 2 batches (and the batches, where they are a function of
    those numbers)."""

    def after(step: str) -> tuple[Any, ...]:
        return step, torch.rand(1).item(), None if g is None else torch.rand(1, generator=g).item()

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(5) if generator else None
    loader = make(g)
    trace: list[Any] = [after("built")]
    for p, stop in enumerate((None, None, 2)):
        it = iter(loader)
        trace.append(after(f"pass {p} iter()"))
        for k, batch in enumerate(it):
            trace += [batch[0].tolist() if batches else len(batch[1]), after(f"pass {p} batch {k}")]
            if k + 1 == stop:
                break
        del it
        trace.append(after(f"pass {p}"))
    return trace


@pytest.mark.parametrize("generator", [False, True], ids=["global", "generator"])
@pytest.mark.parametrize(("workers", "persistent"), [(0, False), (2, False), (2, True), (2, None)])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("batch_size", [4, 5], ids=["short-last", "whole-batches"])
def test_the_loader_leaves_torchs_random_numbers_as_torchs_loader_does(
    batch_size: int, shuffle: bool, workers: int, persistent: bool, generator: bool
) -> None:
    """``seed=None`` draws nothing at construction (torch draws nothing there: a model built after
    the loader gets its usual weights), and a pass draws what torch's pass draws: the iterator's
    base seed and, for ``shuffle=True``, what torch's ``RandomSampler`` draws (a seed, or two
    ``randperm`` of ``generator``). A dataset drawing in the main process or in workers (seeded
    from the base seed) gets torch's numbers; the loop's own draws after each pass are torch's.
    ``persistent=None``: each loader's default (fastload's keeps its workers, reseeded at each
    pass as torch's new workers of that pass are seeded)."""

    def make(cls: Any) -> Any:
        return lambda g: cls(
            _Draws(),
            batch_size=batch_size,
            shuffle=shuffle,
            num_workers=workers,
            generator=g,
            **({} if persistent is None else {"persistent_workers": persistent}),
        )

    want = _rng_trace(make(torch.utils.data.DataLoader), generator, batches=not shuffle)
    got = _rng_trace(make(fastload.DataLoader), generator, batches=not shuffle)
    assert got == want


@pytest.mark.parametrize(
    ("shuffle", "generator", "persistent"),
    [(False, False, True), (True, False, True), (True, True, True), (True, True, False), (True, False, None)],
)
@pytest.mark.parametrize("path", ["fast", "device", "hybrid"])
def test_fastloads_own_paths_draw_what_torchs_iterator_draws(
    path: str, shuffle: bool, generator: bool, persistent: bool, imagenet_root: Any
) -> None:
    """The paths that do not run torch's iterator (the fast path of a torchvision pipeline,
    ``decode="device"`` and ``"hybrid"``, here on the CPU) make its draws all the same: the
    training loop's random numbers are those it gets with torch's loader (2 workers). (Without
    workers torch's random transforms draw in the main process; fastload's own paths draw them
    from ``(seed, epoch, index)``: see docs/differences.md.)"""
    import torchvision
    import torchvision.transforms as T

    from fastload import gpu

    root = imagenet_root / "train"
    kwargs: dict[str, Any] = dict(batch_size=8, shuffle=shuffle, num_workers=2)
    if persistent is not None:  # None: each loader's default (fastload's persistent, torch's not)
        kwargs["persistent_workers"] = persistent
    pipeline = T.Compose([T.RandomResizedCrop(16), T.RandomHorizontalFlip(), T.PILToTensor()])
    want = _rng_trace(
        lambda g: torch.utils.data.DataLoader(
            torchvision.datasets.ImageFolder(root, pipeline), generator=g, **kwargs
        ),
        generator,
        batches=False,
    )

    def make(g: Any) -> Any:
        if path == "fast":
            loader = fastload.DataLoader(
                torchvision.datasets.ImageFolder(root, pipeline), generator=g, **kwargs
            )
            assert loader.fast_path
            return loader
        return fastload.DataLoader(
            fastload.InMemoryImageFolder(root),
            decode=path,
            device="cpu",
            gpu_transforms=gpu.Compose([gpu.RandomResizedCrop(16)]),
            generator=g,
            **kwargs,
        )

    got = _rng_trace(make, generator, batches=False)
    assert got == want


@pytest.mark.parametrize("generator", [False, True], ids=["global", "generator"])
def test_distributed_and_resumed_loaders_draw_nothing_either(
    generator: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``distributed=True`` in one process (its sampler's seed is fixed at the first pass too) and
    ``load_state_dict`` into a new loader (the state's seed replaces the default one) leave torch's
    RNG and the generator alone; the resumed loader goes on with the saved seed's order."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)

    def untouched(build: Any) -> Any:
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1) if generator else None
        states = torch.get_rng_state(), None if g is None else g.get_state()
        made = build(g)
        assert torch.equal(torch.get_rng_state(), states[0])
        assert g is None or torch.equal(g.get_state(), states[1])
        return made

    for shuffle in (False, True):
        loader = untouched(
            lambda g, shuffle=shuffle: fastload.DataLoader(
                _Range(6), batch_size=2, shuffle=shuffle, generator=g, num_workers=0, distributed=True
            )
        )
        assert sorted(int(i) for b in loader for i in b[1]) == list(range(6))
    saved = fastload.DataLoader(_Range(10), batch_size=2, shuffle=True, num_workers=0)
    it = iter(saved)
    first = [next(it)[1].tolist(), next(it)[1].tolist()]
    state = saved.state_dict()
    rest = [b[1].tolist() for b in it]

    def resumed(g: Any) -> Any:
        loader = fastload.DataLoader(_Range(10), batch_size=2, shuffle=True, num_workers=0, generator=g)
        loader.load_state_dict(state)
        return loader

    loader = untouched(resumed)
    assert loader.seed == saved.seed and [b[1].tolist() for b in loader] == rest and len(first) == 2


def _record_numpy_draw(worker_id: int) -> None:
    """A ``worker_init_fn`` that draws from numpy's global RNG (into a file per worker)."""
    import os

    with open(os.path.join(os.environ["FL_TEST_DRAWS"], f"{worker_id}"), "w") as f:
        f.write(str(np.random.randint(1 << 30)))


@pytest.mark.parametrize("cls", LOADERS, ids=["torch", "fastload"])
def test_process_workers_give_numpy_a_seed_of_their_own(
    cls: Any, imagenet_root: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch seeds numpy's global RNG in each worker; forked fast-path workers used to keep the
    parent's state, so every worker drew the same numbers (a worker_init_fn's, a get_bytes
    override's)."""
    import torchvision
    import torchvision.transforms as T

    monkeypatch.setenv("FL_TEST_DRAWS", str(tmp_path))
    dataset = torchvision.datasets.ImageFolder(
        imagenet_root / "train", T.Compose([T.RandomResizedCrop(16), T.PILToTensor()])
    )
    loader = cls(dataset, batch_size=8, num_workers=2, worker_init_fn=_record_numpy_draw)
    assert getattr(loader, "fast_path", True)  # fastload's own workers
    list(loader)
    draws = [(tmp_path / str(w)).read_text() for w in (0, 1)]
    assert draws[0] != draws[1]


def _after_draws(seed: int, k: int) -> float:
    """``torch.rand(1)`` after ``torch.manual_seed(seed)`` and ``k - 1`` int64 draws (a base seed's)."""
    torch.manual_seed(seed)
    for _ in range(k - 1):
        torch.empty((), dtype=torch.int64).random_()
    return torch.rand(1).item()


def test_the_default_seed_is_fixed_at_the_first_pass_from_torchs_base_seed() -> None:
    """Built with ``seed=None``, the seed is unknown until the first pass, which reads it from the
    base seed it draws (one draw, as torch's); asked for earlier, it takes a draw of its own, so
    two loaders asked in a row get two seeds. ``torch.manual_seed`` makes both repeatable."""
    torch.manual_seed(0)
    state = torch.get_rng_state()
    loader = fastload.DataLoader(_Range(6), batch_size=2, shuffle=True, num_workers=0)
    assert torch.equal(torch.get_rng_state(), state)  # nothing drawn
    assert isinstance(loader._epochs.seed_source, DefaultSeed)  # nothing fixed
    first = [b[1].tolist() for b in loader]
    assert torch.rand(1).item() == _after_draws(0, 3)  # the pass's base seed and sampler seed only
    seed = loader.seed
    torch.manual_seed(0)
    again = fastload.DataLoader(_Range(6), batch_size=2, shuffle=True, num_workers=0)
    assert [b[1].tolist() for b in again] == first and again.seed == seed
    torch.manual_seed(0)
    a = fastload.DataLoader(_Range(6), batch_size=2, shuffle=True, num_workers=0)
    b = fastload.DataLoader(_Range(6), batch_size=2, shuffle=True, num_workers=0)
    # asked before a pass: each its own draw (a's is the draw the first loader's pass read)
    assert a.seed == seed and b.seed != seed
    assert torch.rand(1).item() == _after_draws(0, 3)  # 2 draws of the seeds, then this one


def test_generator_makes_the_shuffle_repeatable() -> None:
    def order(cls: Any) -> list[int]:
        g = torch.Generator().manual_seed(7)
        return [
            int(v)
            for b in cls(_Range(10), batch_size=5, shuffle=True, generator=g, num_workers=0)
            for v in b[1]
        ]

    assert order(fastload.DataLoader) == order(fastload.DataLoader)
    assert sorted(order(fastload.DataLoader)) == list(range(10))


class _Unpicklable(torch.utils.data.Dataset[Any]):
    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> Any:
        if i == 3:
            return torch.zeros(2), lambda: i  # a sample a worker cannot send
        return torch.zeros(2), None


@pytest.mark.parametrize("ctx", ["fork", "spawn", "forkserver"])
def test_a_batch_a_worker_cannot_send_is_a_named_error_not_a_hang(ctx: str) -> None:
    """torch hangs here (the worker's queue drops the batch); fastload raises for that batch."""
    loader = fastload.DataLoader(
        _Unpicklable(), batch_size=2, num_workers=2, multiprocessing_context=ctx, timeout=60, collate_fn=list
    )
    delivered, errors = _drain(loader)
    assert len(delivered) == 2  # batches 0 and 2
    assert len(errors) == 1 and "could not send batch 1 to the main process" in errors[0]
    assert "picklable" in errors[0]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_workers": 2, "persistent_workers": True},
        {"num_workers": 2, "prefetch_factor": 3},
        {"num_workers": 2, "in_order": False},
        {"num_workers": 2, "multiprocessing_context": "spawn"},
        {"num_workers": 0, "pin_memory_device": ""},
        {"num_workers": 2, "drop_last": True},
    ],
    ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()),
)
def test_torch_arguments_give_torchs_batches(kwargs: dict[str, Any]) -> None:
    if "in_order" in kwargs and "in_order" not in inspect.signature(torch.utils.data.DataLoader).parameters:
        pytest.skip(f"torch {torch.__version__} takes no in_order (torch 2.6 and later do)")
    ours_loader = fastload.DataLoader(_Range(11), batch_size=3, **kwargs)
    theirs_loader = torch.utils.data.DataLoader(_Range(11), batch_size=3, **kwargs)
    for _ in range(2):  # two epochs: persistent workers are reused
        ours, theirs = _drain(ours_loader), _drain(theirs_loader)
        assert ours[1] == theirs[1] == []
        if kwargs.get("in_order") is False:  # torch allows any order then: compare the samples
            flat = sorted(int(v) for batch in ours[0] for v in batch[1])
            assert flat == sorted(int(v) for batch in theirs[0] for v in batch[1])
        else:
            assert len(ours[0]) == len(theirs[0])
            assert all(_same(a, b) for a, b in zip(ours[0], theirs[0], strict=True))
    for name in kwargs:  # what the user passed, the loader holds (defaults may differ: see README)
        assert getattr(ours_loader, name) == getattr(theirs_loader, name) or name == "multiprocessing_context"


class _LongStream(IterableDataset[int]):
    def __len__(self) -> int:
        return 10

    def __iter__(self) -> Any:
        return iter(range(20))


def test_iterable_dataset_length_warning_is_torchs() -> None:
    messages = []
    stream = _LongStream()  # one object: torch's message quotes its repr
    for cls in LOADERS:
        loader = cls(stream, batch_size=None, num_workers=0)
        len(loader)
        with pytest.warns(UserWarning) as record:
            list(loader)
        messages.append([str(w.message) for w in record if "IterableDataset" in str(w.message)])
    assert messages[0] and messages[0] == messages[1]


@pytest.mark.parametrize("batch_size", [None, 3])
def test_iterable_dataset_length_warning_only_after_the_users_len(batch_size: int | None) -> None:
    """torch warns that the stream yields more than its __len__ said only when the user called
    len(loader); fastload's own pass must not arm that check (torch's test_iterable_style_dataset)."""
    stream = _LongStream()
    for cls in LOADERS:
        loader = cls(stream, batch_size=batch_size, num_workers=0)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no warning at all without len(loader)
            got = [item for item in loader]  # noqa: C416 - list() would call len(loader) itself
        assert len(got) == (20 if batch_size is None else 7)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert len([item for item in loader]) == len(got)  # noqa: C416 - a second pass: still nothing armed


def test_a_namedtuple_class_that_cannot_be_pickled() -> None:
    Local = collections.namedtuple("Local", ["x", "y"])  # defined in a function: not picklable

    class Samples(_Range):
        def __getitem__(self, i: int) -> Any:
            return Local(torch.full((2,), float(i)), i)

    # In the main process both loaders collate it alike.
    ours = _drain(fastload.DataLoader(Samples(4), batch_size=2, num_workers=0))
    theirs = _drain(torch.utils.data.DataLoader(Samples(4), batch_size=2, num_workers=0))
    assert ours[1] == theirs[1] == [] and all(_same(a, b) for a, b in zip(ours[0], theirs[0], strict=True))
    # From a worker, the batch cannot travel: torch waits forever, fastload names the problem.
    loader = fastload.DataLoader(
        Samples(4), batch_size=2, num_workers=1, multiprocessing_context="fork", timeout=60
    )
    delivered, errors = _drain(loader)
    assert delivered == [] and len(errors) == 2
    assert all("could not send batch" in e and "picklable" in e for e in errors)


class _NamedTupleDataset(torch.utils.data.Dataset[Any]):
    """torch's own test (test_dataloader_with_namedtuple): namedtuple classes defined inside the
    dataset class, which pickle cannot find, so a worker cannot send its batches."""

    Batch = collections.namedtuple("Batch", ["data", "label"])
    Data = collections.namedtuple("Data", ["positive", "negative"])

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> Any:
        return self.Batch(data=self.Data(positive=i, negative=-i), label=str(i))


# ------------------------------------------------------------------------------ tensors torch's collate
# handles specially: nested and sparse tensors go to torch's own code, with or without a collate_fn


class _Tensors(torch.utils.data.Dataset[Any]):
    """Samples that are nested (``"nested"``) or sparse COO (``"sparse"``) tensors."""

    def __init__(self, kind: str, n: int = 6) -> None:
        self.kind, self.n = kind, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.kind == "nested":
            return torch.nested.nested_tensor([torch.full((i % 3 + 1,), float(i)), torch.ones(2)])
        return torch.sparse_coo_tensor(torch.tensor([[i % 4]]), torch.tensor([float(i)]), (4,))


def _clone_collate(batch: list[torch.Tensor]) -> list[torch.Tensor]:
    return [x.clone() for x in batch]


def _last_line(errors: list[str]) -> list[str]:
    """An error's type and its message's last line (a worker's message holds its traceback, whose
    frames differ between the loaders)."""
    return [e.split(":", 1)[0] + ": " + e.strip().splitlines()[-1] for e in errors]


_TENSOR_CASES = [
    ("nested", 0, None),
    ("nested", 2, "fork"),
    ("nested", 2, "forkserver"),
    ("nested", 2, "spawn"),
    ("sparse", 0, None),
    ("sparse", 2, "fork"),
]


@pytest.mark.parametrize("kind,workers,ctx", _TENSOR_CASES, ids=[f"{k}-{w}-{c}" for k, w, c in _TENSOR_CASES])
@pytest.mark.parametrize("collate", [None, _clone_collate], ids=["default_collate", "collate_fn"])
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")  # torch's prototype notice
@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
def test_nested_and_sparse_tensors_like_torch(kind: str, workers: int, ctx: str | None, collate: Any) -> None:
    """torch's default collate refuses batches of nested and of sparse tensors with its own error;
    a collate_fn that handles them gets them, through worker processes too."""
    if workers and not _torch_sends(kind):
        pytest.skip(
            f"torch {torch.__version__} cannot send a {kind} tensor between processes (its loader waits)"
        )
    outcomes = []
    for cls in (torch.utils.data.DataLoader, fastload.DataLoader):
        loader = cls(
            _Tensors(kind),
            batch_size=2,
            num_workers=workers,
            multiprocessing_context=ctx,
            collate_fn=collate,
            **({"timeout": 60} if workers else {}),
        )
        outcomes.append(_drain(loader))
    (theirs, their_errors), (ours, our_errors) = outcomes
    assert _last_line(our_errors) == _last_line(their_errors)
    assert len(ours) == len(theirs)
    if collate is None and not theirs:
        assert len(their_errors) == 3
        assert torch.__version__.startswith("2.1.") or (
            f"Batches of {kind} tensors are not currently supported by the default collate_fn"
            in (their_errors[0])
        )
    else:
        assert not their_errors and len(ours) == len(theirs) == 3
        for a, b in zip(ours, theirs, strict=True):
            assert len(a) == len(b) == 2
            for x, y in zip(a, b, strict=True):
                assert x.is_nested == y.is_nested and x.layout == y.layout
                if kind == "nested":
                    assert all(torch.equal(u, v) for u, v in zip(x.unbind(), y.unbind(), strict=True))
                else:
                    assert torch.equal(x.to_dense(), y.to_dense())


# ------------------------------------------------------------------------------ torch's iterator attributes


class _PerWorker(IterableDataset[int]):
    """Worker ``k`` yields ``range(sizes[k])`` (torch's iterable-dataset test's shape)."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        return iter(range(self.sizes[0 if info is None else info.id]))


def _images(root: Any) -> fastload.ImageFolder:
    from torchvision import transforms as T

    return fastload.ImageFolder(root / "val", transform=T.Compose([T.RandomResizedCrop(8), T.PILToTensor()]))


@pytest.mark.parametrize("path", ["torch", "fast", "iterable"])
@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
def test_workers_attribute_lists_processes_that_exit_with_the_loader(path: str, imagenet_root: Any) -> None:
    """``iter(loader)._workers``, read after a pass or part of one, lists worker processes that
    exit once the iterator and the loader are gone (torch's own tests rely on it)."""
    import gc

    outcomes = []
    for cls in LOADERS:
        if path == "fast":
            ds: Any = _images(imagenet_root)
            loader: Any = cls(ds, batch_size=2, num_workers=2)
        elif path == "iterable":
            loader = cls(_PerWorker([0, 4, 9]), batch_size=None, num_workers=3)
        else:
            loader = cls(_Range(40), batch_size=2, num_workers=2)
        it = iter(loader)
        if path == "iterable":
            got = sorted(int(v) for v in it)  # exhausted first, as torch's test does
            assert got == sorted([*range(4), *range(9)])
        else:
            for k, _ in enumerate(it):
                if k == 3:
                    break
        workers = it._workers
        assert len(workers) == loader.num_workers
        assert path == "iterable" or all(w.is_alive() for w in workers)  # torch's stop at a pass's end
        if cls is fastload.DataLoader:
            assert (path == "fast") == loader.fast_path
        del it, loader
        gc.collect()
        for w in workers:
            w.join(30)
        outcomes.append([(w.is_alive(), w.exitcode) for w in workers])
    assert outcomes[1] == [(False, 0)] * len(outcomes[1])
    if path != "fast":
        assert outcomes[1] == outcomes[0]


def test_iterator_attributes_without_workers_are_torchs() -> None:
    ours, theirs = (iter(cls(_Range(4), batch_size=2, num_workers=0)) for cls in LOADERS)
    for name in ("_workers", "_pin_memory_thread"):
        assert not hasattr(theirs, name) and not hasattr(ours, name)


@pytest.mark.parametrize("fast", [False, True])
def test_shutdown_workers_stops_persistent_workers(fast: bool, imagenet_root: Any) -> None:

    ds: Any = _images(imagenet_root) if fast else _Range(12)
    loader = fastload.DataLoader(ds, batch_size=2, num_workers=2, persistent_workers=True)
    it = iter(loader)
    next(it)
    workers = list(it._workers)
    it._shutdown_workers()
    for w in workers:
        w.join(30)
    assert not any(w.is_alive() for w in workers)
    assert len(list(loader)) == len(loader)  # the next pass starts new workers
    loader.close()


# torch's multiprocessing iterator, refused in its __init__, fails again in its __del__ (torch's own)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize(
    "kwargs", [{"num_workers": 0, "timeout": 5}, {"num_workers": 2, "prefetch_factor": 0}]
)
@pytest.mark.parametrize("fast", [False, True])
def test_what_torchs_iterator_refuses_as_a_pass_starts_is_refused_alike(
    kwargs: dict[str, Any], fast: bool, imagenet_root: Any
) -> None:
    """Both loaders accept these arguments; torch's iterator refuses them as a pass starts (its
    error type and words), and so does fastload's on its own path too."""
    ds: Any = _images(imagenet_root) if fast else _Range(12)
    outcomes = []
    for cls in LOADERS:
        loader = cls(ds, batch_size=2, **kwargs)
        if cls is fastload.DataLoader:
            assert loader.fast_path == fast
        outcomes.append(_outcome(lambda loader=loader: iter(loader)))
    assert outcomes[0][0] == "AssertionError"
    if outcomes[0][1]:
        assert outcomes[1] == outcomes[0]
    else:  # older torch asserted without words: fastload says what it checks
        assert outcomes[1][0] == "AssertionError"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the warning is for a machine without an accelerator")
@pytest.mark.parametrize("fast", [False, True])
def test_pin_memory_without_an_accelerator_warns_in_torchs_words(fast: bool, imagenet_root: Any) -> None:
    """(torch 2.14 warns; older torch said nothing, and then neither does fastload.)"""
    ds: Any = _images(imagenet_root) if fast else _Range(12)
    said = []
    for cls in LOADERS:
        loader = cls(ds, batch_size=2, num_workers=0, pin_memory=True)
        if cls is fastload.DataLoader:
            assert loader.fast_path == fast
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in loader:
                pass
        said.append([str(w.message) for w in caught if "pin_memory" in str(w.message)])
        if cls is fastload.DataLoader and fast:  # fastload's own: at the loop's line
            assert all(w.filename == __file__ for w in caught if "pin_memory" in str(w.message))
    assert said[1] == said[0] and len(said[0]) == (1 if hasattr(torch, "accelerator") else 0)


class _Endless(torch.utils.data.Sampler[int]):
    """An endless sampler without ``__len__`` (as detectron2's training sampler)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        return itertools.cycle(range(self.n))


class _EndlessBatches(torch.utils.data.Sampler[list[int]]):
    def __iter__(self) -> Any:
        return ([i % 10, (i + 1) % 10] for i in itertools.count(0, 2))


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kwargs", [{"sampler": "endless", "batch_size": 4}, {"batch_sampler": "endless"}])
def test_an_endless_sampler_without_len_is_iterated_as_torch_does(
    workers: int, kwargs: dict[str, Any]
) -> None:
    endless = _Endless(10) if "sampler" in kwargs else _EndlessBatches()
    given = {k: endless if v == "endless" else v for k, v in kwargs.items()}
    batches = {}
    for cls in LOADERS:
        it = iter(cls(_Range(10), num_workers=workers, **given))
        batches[cls] = [next(it)[0][:, 0].tolist() for _ in range(7)]  # past the dataset's end
        no_len = f"object of type '{type(endless).__name__}' has no len()"
        assert _outcome(lambda it=it: len(it)) == ("TypeError", no_len)
        del it
    assert batches[fastload.DataLoader] == batches[torch.utils.data.DataLoader]


def test_an_endless_sampler_on_an_image_folder_runs_torchs_iterator_and_says_why(imagenet_root: Any) -> None:
    ds = _images(imagenet_root)
    loader = fastload.DataLoader(ds, sampler=_Endless(len(ds)), batch_size=4, num_workers=0)
    assert loader.path == "head-accelerated" and loader.fast_path_reason == ENDLESS_SAMPLER
    it = iter(loader)
    labels = [next(it)[1] for _ in range(len(ds) // 4 + 2)]  # past one epoch's worth
    expected = [ds.targets[i % len(ds)] for i in range(len(labels) * 4)]
    assert torch.cat(labels).tolist() == expected
    device = fastload.DataLoader(
        fastload.InMemoryImageFolder(imagenet_root / "val"),
        sampler=_Endless(4),
        batch_size=2,
        num_workers=0,
        decode="device",
        gpu_transforms=fastload.gpu.Compose([fastload.gpu.Resize((8, 8))]),
    )
    with pytest.raises(
        ValueError, match="decode='device' needs a sampler with a len\\(\\): the sampler has no len"
    ):
        iter(device)


def _failing_init(worker_id: int) -> None:
    raise FileNotFoundError(f"/shards/{worker_id}.txt")


def test_an_error_in_worker_init_fn_fails_that_workers_batches_with_it(imagenet_root: Any) -> None:
    ds = _images(imagenet_root)
    outcomes = {}
    for cls in LOADERS:
        batches, errors = _drain(cls(ds, batch_size=2, num_workers=2, worker_init_fn=_failing_init))
        outcomes[cls] = (len(batches), len(errors), sorted(e.split(":")[0] for e in errors[:2]))
        assert all("/shards/" in e for e in errors[:2]), errors
        if cls is fastload.DataLoader:  # every batch says why (torch's: an error of its own after the first)
            assert all(e.startswith("FileNotFoundError") and "/shards/" in e for e in errors), errors
    assert fastload.DataLoader(ds).fast_path
    # no batch comes from a worker that was not set up; each worker's first says why
    assert (
        outcomes[fastload.DataLoader]
        == outcomes[torch.utils.data.DataLoader]
        == (
            0,
            -(-len(ds) // 2),
            ["FileNotFoundError", "FileNotFoundError"],
        )
    )


class _Curriculum(torch.utils.data.Dataset[Any]):
    """A dataset the loop changes between epochs (a curriculum's difficulty)."""

    def __init__(self) -> None:
        self.difficulty = 0

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return self.difficulty


@pytest.mark.parametrize("persistent", [None, True])
def test_a_dataset_changed_between_epochs_reaches_the_workers_as_with_torchs_loader(
    persistent: bool | None, caplog: pytest.LogCaptureFixture
) -> None:
    # a dataset of the user's: torch's default, new workers each pass, which see it as it is now
    caplog.set_level(logging.INFO, logger="fastload")
    given = {} if persistent is None else {"persistent_workers": persistent}
    seen = {}
    for cls in LOADERS:
        ds = _Curriculum()
        loader = cls(ds, batch_size=2, num_workers=2, **given)
        seen[cls] = []
        for epoch in range(3):
            ds.difficulty = epoch
            seen[cls].append(sorted({int(v) for batch in loader for v in batch}))
    assert seen[fastload.DataLoader] == seen[torch.utils.data.DataLoader]
    assert seen[fastload.DataLoader] == ([[0], [1], [2]] if persistent is None else [[0], [0], [0]])
    assert "restarts its workers" not in caplog.text


def test_a_transform_replaced_between_epochs_reaches_the_fast_paths_default_workers(
    imagenet_root: Any,
) -> None:
    from torchvision import transforms as T

    ds = fastload.ImageFolder(imagenet_root / "val", transform=T.Compose([T.CenterCrop(16), T.PILToTensor()]))
    loader = fastload.DataLoader(ds, batch_size=4, num_workers=2)
    sizes = []
    for size in (16, 12, 8):  # progressive resizing
        ds.transform = T.Compose([T.CenterCrop(size), T.PILToTensor()])
        sizes.append({tuple(images.shape[-2:]) for images, _ in loader})
        assert loader.fast_path
    assert sizes == [{(16, 16)}, {(12, 12)}, {(8, 8)}]
    loader.close()


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("persistent", [None, False])
@pytest.mark.parametrize("path", ["fast", "torch"])
def test_a_peek_inside_the_epoch_loop_leaves_the_epoch_whole_like_torchs(
    workers: int, persistent: bool | None, path: str, imagenet_root: Any
) -> None:
    # next(iter(loader)) inside the loop: torch gives that iterator workers of its own (without
    # persistent workers, its default); so does fastload (its default workers included), on the
    # fast path and on torch's own iterator (a dataset it does not read itself)
    ds = _images(imagenet_root) if path == "fast" else _Range(12)
    given = {} if persistent is None or not workers else {"persistent_workers": persistent}
    outcomes = {}
    for cls in LOADERS:
        loader = cls(ds, batch_size=2, num_workers=workers, **given)
        labels, peeked = [], []
        for epoch in range(2):  # the loop's persistent workers serve the next epoch too
            for step, (_, y) in enumerate(loader):
                labels.append((epoch, y.tolist()))
                if step == 1:
                    peeked.append(next(iter(loader))[1].tolist())
        outcomes[cls] = (labels, peeked)
        if cls is fastload.DataLoader:
            assert loader.fast_path is (path == "fast")
            loader.close()
    assert outcomes[fastload.DataLoader] == outcomes[torch.utils.data.DataLoader]
    assert len(outcomes[fastload.DataLoader][0]) == 2 * -(-len(ds) // 2)


def test_asked_for_persistent_workers_are_taken_over_by_a_newer_pass(imagenet_root: Any) -> None:
    # one set of workers, as torch's (whose newer iterator resets the shared one): the older pass
    # says so rather than mixing batches of two passes
    loader = fastload.DataLoader(_images(imagenet_root), batch_size=2, num_workers=2, persistent_workers=True)
    it = iter(loader)
    next(it)
    next(iter(loader))
    with pytest.raises(RuntimeError, match="a newer pass of the same loader"):
        next(it)
    loader.close()


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("path", ["fast", "head-accelerated"])
def test_an_undecodable_image_raises_an_oserror_as_pils(
    workers: int, path: str, imagenet_root: Any, tmp_path: Any
) -> None:
    # a loop (or a wrapper) that catches OSError to skip bad files, as PIL's errors for them are
    import shutil

    import torchvision
    from torchvision import transforms as T

    root = tmp_path / "val"
    shutil.copytree(imagenet_root / "val", root)
    victim = sorted(p for p in root.rglob("*") if p.is_file())[0]
    victim.write_bytes(b"<html>404 Not Found</html>")
    ops: list[Any] = [T.Resize(16), T.CenterCrop(16)]
    if path == "head-accelerated":
        ops.append(T.ColorJitter(0.2, hue=0.1))  # not on the fast path: torch's iterator, fastload's decoding
    caught = {}
    for cls in LOADERS:
        ds = torchvision.datasets.ImageFolder(str(root), transform=T.Compose([*ops, T.PILToTensor()]))
        loader = cls(ds, batch_size=4, num_workers=workers)
        with pytest.raises(OSError) as info:
            list(loader)
        caught[cls] = info.value
        if cls is fastload.DataLoader:
            assert loader.path == path
            loader.close()
    assert isinstance(caught[torch.utils.data.DataLoader], PIL.UnidentifiedImageError)
    error = caught[fastload.DataLoader]
    if path == "fast":  # fastload's own error (a RuntimeError too, as before)
        assert isinstance(error, fastload.decode.DecodeError) and isinstance(error, RuntimeError)
    else:  # the head decodes where torchvision's loader would: PIL's error, with the sample named
        assert type(error) is PIL.UnidentifiedImageError
    assert str(victim) in str(error)


def _labels_in_a_spawned_process(rank: int, loader: Any, out: str) -> None:
    torch.save([y.tolist() for _, y in loader], out)
    loader.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loader_pickles_as_torchs_also_after_iterating(
    workers: int, imagenet_root: Any, tmp_path: Any
) -> None:
    # torch.multiprocessing.spawn arguments, Lightning's ddp_spawn: the loader is pickled
    import pickle

    for ds in (_images(imagenet_root), _Range(12)):
        for cls in LOADERS:
            loader = cls(ds, batch_size=4, num_workers=workers)
            pickle.dumps(loader)
            list(loader)
            pickle.dumps(loader)  # after a pass too (torch's default workers are gone by then)
            if cls is fastload.DataLoader:
                loader.close()
    # what it compares of the dataset each pass (copies of its lists) stays in this process
    import torchvision

    folder = torchvision.datasets.ImageFolder(str(imagenet_root / "train"))
    folder.samples = folder.samples * 2000  # 64,000 samples
    with_list = fastload.DataLoader(folder, batch_size=4, num_workers=0, fast_path=False)
    assert len(pickle.dumps(with_list)) < 1.5 * len(pickle.dumps(folder))
    # the copy is the loader: the same next epoch, on its own workers, here and in a new process
    loader = fastload.DataLoader(
        _images(imagenet_root), batch_size=4, num_workers=workers, shuffle=True, seed=3
    )
    list(loader)
    copy = pickle.loads(pickle.dumps(loader))
    assert copy.fast_path and copy.epoch == loader.epoch == 1
    out = str(tmp_path / "labels.pt")
    torch.multiprocessing.spawn(_labels_in_a_spawned_process, args=(loader, out), nprocs=1)
    expected = [y.tolist() for _, y in loader]
    assert [y.tolist() for _, y in copy] == expected == torch.load(out)
    copy.close()
    loader.close()


class _Steered(torch.utils.data.Sampler[int]):
    """Yields ``pick`` for every sample: the loop changes it during the epoch (a curriculum)."""

    def __init__(self, n: int) -> None:
        self.n, self.pick = n, 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Any:
        for _ in range(self.n):
            yield self.pick


@pytest.mark.parametrize("workers", [0, 2])
def test_a_sampler_the_loop_steers_is_read_as_the_epoch_goes(workers: int, imagenet_root: Any) -> None:
    # torch reads the sampler a few batches ahead of the loop (as it issues them), so a change the
    # loop makes reaches the rest of the epoch; the fast path read it all at iter()
    ds = fastload.ImageFolder(imagenet_root / "train", transform=_images(imagenet_root).transform)
    last = len(ds) - 1
    seen = {}
    for cls in LOADERS:
        sampler = _Steered(len(ds))
        loader = cls(ds, batch_size=2, num_workers=workers, sampler=sampler)
        labels = []
        for step, (_, y) in enumerate(loader):
            labels.append(y.tolist())
            if step == 1:
                sampler.pick = last
        seen[cls] = labels
        if cls is fastload.DataLoader:
            assert loader.fast_path
            loader.close()
    steered = [ds.targets[last]] * 2
    for labels in seen.values():
        assert labels[:2] == [[ds.targets[0]] * 2] * 2 and labels[-8:] == [steered] * 8
        assert len(labels) == len(ds) // 2
    if not workers:  # read exactly when torch reads it: at each next()
        assert seen[fastload.DataLoader] == seen[torch.utils.data.DataLoader]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("path", ["fast", "torch"])
def test_samples_and_ops_changed_in_place_reach_the_next_pass_as_with_torchs_loader(
    workers: int, path: str, imagenet_root: Any
) -> None:
    # label cleaning / pseudo-labels relabel ds.samples in place; progressive resizing changes an
    # op's size in place: torch's main process and its default new workers read them each pass
    import torchvision
    from torchvision import transforms as T

    outcomes = {}
    for cls in LOADERS:
        ops: list[Any] = [T.Resize(40), T.CenterCrop(32)]
        if path == "torch":
            ops.insert(0, T.Lambda(lambda image: image))  # an op fastload does not plan: torch's path
        ds = torchvision.datasets.ImageFolder(
            str(imagenet_root / "val"), transform=T.Compose([*ops, T.PILToTensor()])
        )
        ds.samples[0] = (ds.samples[0][0], 3)  # before the first pass
        loader = cls(ds, batch_size=4, num_workers=workers)
        seen = []
        for epoch in range(3):
            seen.append([(tuple(x.shape), y.tolist()) for x, y in loader])
            ds.samples[1] = (ds.samples[1][0], epoch)  # between passes
            ops[-1].size = (32 - 8 * (epoch + 1),) * 2
        outcomes[cls] = seen
        if cls is fastload.DataLoader:
            assert loader.path == ("fast" if path == "fast" else "torch")
            loader.close()
    assert outcomes[fastload.DataLoader] == outcomes[torch.utils.data.DataLoader]
    assert [{shape[-1] for shape, _ in epoch} for epoch in outcomes[fastload.DataLoader]] == [
        {32},
        {24},
        {16},
    ]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_file_gone_since_the_scan_raises_torchs_file_not_found_error(
    workers: int, imagenet_root: Any, tmp_path: Any
) -> None:
    # an `except FileNotFoundError` (skip and log, re-sync storage) and e.errno / e.filename work alike
    import os
    import shutil

    import torchvision
    from torchvision import transforms as T

    root = tmp_path / "val"
    shutil.copytree(imagenet_root / "val", root)
    ds = torchvision.datasets.ImageFolder(
        str(root), transform=T.Compose([T.Resize(16), T.CenterCrop(16), T.PILToTensor()])
    )
    gone = ds.samples[1][0]
    os.remove(gone)
    caught = {}
    for cls in LOADERS:
        loader = cls(ds, batch_size=4, num_workers=workers)
        with pytest.raises(FileNotFoundError) as info:
            next(iter(loader))
        caught[cls] = info.value
        if cls is fastload.DataLoader:
            assert loader.fast_path
            loader.close()
    error = caught[fastload.DataLoader]
    assert (error.errno, error.filename) == (2, gone)
    if not workers:  # torch's main process raises the open()'s own error (its workers' a rebuilt one)
        torch_error = caught[torch.utils.data.DataLoader]
        assert (torch_error.errno, torch_error.filename) == (error.errno, error.filename)
    assert str(error).startswith("[Errno 2] cannot read sample 1: No such file or directory")


class _Halves(torch.utils.data.Sampler[float]):
    """A sampler with a bug: "/" where "//" was meant (float indices)."""

    def __len__(self) -> int:
        return 8

    def __iter__(self) -> Any:
        return iter([i / 2 for i in range(0, 16, 2)])


@pytest.mark.parametrize("workers", [0, 2])
def test_float_indices_from_a_sampler_are_refused_as_by_torch(workers: int, imagenet_root: Any) -> None:
    # torchvision's ImageFolder indexes a list: torch raises; the fast path must not truncate them
    import torchvision
    from torchvision import transforms as T

    ds = torchvision.datasets.ImageFolder(
        str(imagenet_root / "val"), transform=T.Compose([T.Resize(16), T.CenterCrop(16), T.PILToTensor()])
    )
    for cls in LOADERS:
        loader = cls(ds, batch_size=4, num_workers=workers, sampler=_Halves())
        with pytest.raises(TypeError, match="list indices must be integers or slices, not float"):
            list(loader)
        if cls is fastload.DataLoader:
            assert loader.fast_path
            loader.close()


def test_a_generator_that_is_not_one_is_a_type_error_at_iter_as_in_torch() -> None:
    ds = _Range(8)
    for cls in LOADERS:
        loader = cls(ds, batch_size=2, shuffle=True, generator=3, num_workers=0)  # accepted, as torch's
        with pytest.raises(TypeError, match="generator"):
            next(iter(loader))
    g = torch.Generator()
    assert fastload.DataLoader(ds, shuffle=True, generator=g).sampler.generator is g
    assert torch.utils.data.DataLoader(ds, shuffle=True, generator=g).sampler.generator is g


@pytest.mark.parametrize("distributed", [False, True])
def test_the_epoch_given_to_the_loaders_own_sampler_is_the_passs_epoch(distributed: bool) -> None:
    # torchvision's reference script: train_sampler = loader.sampler; train_sampler.set_epoch(epoch)
    # at the top of each epoch, from start_epoch after a resume: the loader must not count its own
    ds = _Range(16)

    def passes(call: Any, epochs: list[int]) -> list[tuple[int, list[int]]]:
        loader = fastload.DataLoader(
            ds, batch_size=4, shuffle=True, seed=7, distributed=distributed, num_workers=0
        )
        out = []
        for epoch in epochs:
            call(loader, epoch)
            it = iter(loader)
            out.append((it.epoch, [int(v) for _, y in it for v in y]))
        return out

    via_sampler = passes(lambda loader, e: loader.sampler.set_epoch(e), [5, 6, 6])
    via_loader = passes(lambda loader, e: loader.set_epoch(e), [5, 6, 6])
    assert via_sampler == via_loader and [e for e, _ in via_sampler] == [5, 6, 6]
    assert (
        via_sampler[1][1] == via_sampler[2][1] != via_sampler[0][1]
    )  # an epoch given twice: its order twice
    untold = passes(lambda loader, e: None, [0, 1])
    assert [e for e, _ in untold] == [0, 1] and untold[0][1] != via_sampler[0][1]


def _tag_batch(batch: Any) -> Any:
    return [*torch.utils.data.default_collate(batch), torch.tensor(-1)]


def _seed_worker(worker_id: int) -> None:
    torch.manual_seed(1000 + worker_id)


@pytest.mark.parametrize("name", ["collate_fn", "worker_init_fn"])
def test_collate_fn_or_worker_init_fn_set_after_init_reach_the_next_pass_as_torchs(
    imagenet_root: Any, name: str
) -> None:
    """torch lets a loop set both after ``__init__`` (Lightning's ``seed_everything(workers=True)``
    sets ``worker_init_fn``); its default's new workers use them from the next pass. fastload's
    default workers (kept for this accelerated head of torchvision's ops) are restarted, and no
    longer kept: the loader now runs code of the user's."""
    import torchvision
    from torchvision import transforms as T

    value = {"collate_fn": _tag_batch, "worker_init_fn": _seed_worker}[name]
    pipeline = T.Compose([T.RandomResizedCrop(8), T.RandAugment(), T.PILToTensor()])
    seen = []
    for cls in LOADERS:
        dataset = torchvision.datasets.ImageFolder(imagenet_root / "val", transform=pipeline)
        torch.manual_seed(0)
        extra = {"exact_pixels": True} if cls is fastload.DataLoader else {}
        loader = cls(dataset, batch_size=4, num_workers=2, **extra)
        passes = []
        for epoch in range(3):
            if epoch == 1:
                if cls is fastload.DataLoader:
                    assert loader.persistent_workers
                setattr(loader, name, value)
            passes.append([[t.tolist() for t in batch] for batch in loader])
        seen.append(passes)
        assert not loader.persistent_workers
    assert seen[0] == seen[1]
    assert seen[1][0] != seen[1][1]


def test_a_collate_fn_set_after_init_takes_the_fast_path_off(imagenet_root: Any) -> None:
    """The fast path makes its batches itself: a ``collate_fn`` set later runs, as torch's would."""
    from torchvision import transforms as T

    dataset = fastload.ImageFolder(
        imagenet_root / "val", transform=T.Compose([T.Resize(16), T.CenterCrop(16), T.PILToTensor()])
    )
    loader = fastload.DataLoader(dataset, batch_size=4, num_workers=0)
    assert loader.path == "fast" and len(next(iter(loader))) == 2
    loader.collate_fn = _tag_batch
    batch = next(iter(loader))
    assert loader.path != "fast" and batch[-1].item() == -1


def _needs_worker_info(worker_id: int) -> None:
    info = torch.utils.data.get_worker_info()
    if info is None or info.id != worker_id or info.num_workers != 2 or info.dataset is None:
        raise RuntimeError(f"worker {worker_id}: get_worker_info() gave {info}")


def test_a_worker_init_fn_reads_torchs_worker_info_on_the_fast_path(imagenet_root: Any) -> None:
    """A ``worker_init_fn`` that shards or seeds by ``get_worker_info()`` (as with torch's
    workers) runs in the fast path's worker processes too."""
    from torchvision import transforms as T

    dataset = fastload.ImageFolder(
        imagenet_root / "val", transform=T.Compose([T.Resize(16), T.CenterCrop(16), T.PILToTensor()])
    )
    loader = fastload.DataLoader(dataset, batch_size=4, num_workers=2, worker_init_fn=_needs_worker_info)
    assert loader.path == "fast"
    assert sum(len(labels) for _, labels in loader) == len(dataset)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_torchs_warnings_are_shown_as_often_as_with_torch(num_workers: int) -> None:
    """A warning torch shows once (the "default" action: once per place) stays once over passes
    and loaders: fastload's iterator must not make Python forget what it showed (entering
    ``warnings.catch_warnings`` does), which repeated torch's pin_memory warning every pass."""
    counts = []
    for loader_class in LOADERS:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("default")
            loader = loader_class(_Range(8), batch_size=4, num_workers=num_workers, pin_memory=True)
            for _ in range(3):
                list(loader)
            list(loader_class(_Range(8), batch_size=4, num_workers=num_workers, pin_memory=True))
        counts.append(collections.Counter(str(w.message)[:40] for w in record))
    assert counts[1] == counts[0]


# What a dataset reads that a loop may change between epochs, outside its public attributes: the
# workers fastload keeps by default must see it as torch's new workers (or main process) do.
SCALE = 1


class _ReadsAGlobal(torch.utils.data.Dataset[int]):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return i * SCALE


class _ReadsAClassAttribute(torch.utils.data.Dataset[int]):
    scale = 1

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return i * self.scale


class _ReadsAPrivateAttribute(torch.utils.data.Dataset[int]):
    def __init__(self) -> None:
        self._scale = 1

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return i * self._scale


class _ReadsArraysInADict(torch.utils.data.Dataset[int]):
    def __init__(self) -> None:
        self.meta = {"label": np.zeros(4, dtype=np.int64)}

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return int(self.meta["label"][i])


def _change(ds: Any, epoch: int) -> None:
    global SCALE
    if isinstance(ds, _ReadsAGlobal):
        SCALE = epoch + 1  # progressive resizing / a curriculum set as a module setting
    elif isinstance(ds, _ReadsAClassAttribute):
        _ReadsAClassAttribute.scale = epoch + 1
    elif isinstance(ds, _ReadsAPrivateAttribute):
        ds._scale = epoch + 1
    else:
        ds.meta["label"][:] = epoch + 1  # pseudo-labels updated in place


@pytest.mark.parametrize("kwargs", [{}, {"num_workers": 2}], ids=["defaults", "two-workers"])
@pytest.mark.parametrize(
    "cls", [_ReadsAGlobal, _ReadsAClassAttribute, _ReadsAPrivateAttribute, _ReadsArraysInADict]
)
def test_what_a_dataset_reads_changed_between_epochs_reaches_kept_workers(
    cls: Any, kwargs: dict[str, Any]
) -> None:
    global SCALE
    outcomes = {}
    for loader_cls in LOADERS:
        SCALE = _ReadsAClassAttribute.scale = 1
        ds = cls()
        loader = loader_cls(ds, batch_size=4, **kwargs)
        seen = []
        for epoch in range(3):
            _change(ds, epoch)
            seen.append([batch.tolist() for batch in loader])
        outcomes[loader_cls] = seen
        if loader_cls is fastload.DataLoader:
            loader.close()
    SCALE = _ReadsAClassAttribute.scale = 1
    assert outcomes[fastload.DataLoader] == outcomes[torch.utils.data.DataLoader]
    assert outcomes[fastload.DataLoader][2] != outcomes[fastload.DataLoader][0]


def test_a_pass_start_copies_none_of_a_user_datasets_arrays(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pass start compares only what fastload reads of the dataset itself (its transform,
    samples, loader): never a copy of the arrays and lists a dataset of the user's holds."""
    from fastload import _source

    copies: list[str] = []
    made = _source._Content.__init__

    def counted(self: Any, value: Any) -> None:
        copies.append(type(value).__name__)
        made(self, value)

    monkeypatch.setattr(_source._Content, "__init__", counted)
    ds = _ReadsArraysInADict()
    ds.big = np.zeros(1 << 20, dtype=np.float32)  # type: ignore[attr-defined]
    for workers in (0, 1):
        loader = fastload.DataLoader(ds, batch_size=4, num_workers=workers)
        for _ in range(3):
            assert len(list(loader)) == 1
        loader.close()
    assert copies == []
