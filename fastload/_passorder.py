"""The pass order: which samples a pass of a ``fastload.DataLoader`` hands out, in which batches.

The sampler's order, or a resumed epoch's rest resharded over this job's ranks (:func:`resume_pass`);
:func:`plan` is what a ``state_dict`` records of it. The fast path takes it as batches
(:func:`pass_batches`), torch's iterator through :class:`PassIndices`.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import (
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)
from torch.utils.data.distributed import DistributedSampler as TorchDistributedSampler

from ._checks import optional_attribute, sample_index
from ._engine import SampleKeys, SamplerBatches, predicted_order, split_batches
from ._epoch import Plan, Resume, ResumeError
from ._position import rest_of_epoch
from .distributed import get_rank, get_world_size
from .sampler import DistributedSampler, EpochRandomSampler, global_order, sampler_plan

_log = logging.getLogger("fastload")


ENDLESS_SAMPLER = (
    "the sampler has no len() (an endless sampler): fastload's own paths need each epoch's length "
    "when it starts"
)


def endless(sampler: Any) -> bool:
    """A sampler without ``__len__`` (torch iterates it as it goes; it may never end)."""
    try:
        len(sampler)
    except TypeError:
        return True
    return False


def pass_length(loader: Any) -> int | None:
    """``len(loader)`` as torch computes it (``None`` without one), not calling it for an
    ``IterableDataset``: that arms torch's warning for a dataset longer than its ``__len__``."""
    if not isinstance(loader.dataset, IterableDataset):
        try:
            return len(loader)
        except TypeError:  # a sampler or batch_sampler without __len__ (an endless one): torch iterates it
            return None
    try:
        n = len(loader.dataset)  # type: ignore[arg-type]
    except TypeError:  # an IterableDataset without __len__
        return None
    if loader.batch_size is None:
        return n
    return n // loader.batch_size if loader.drop_last else math.ceil(n / loader.batch_size)


def set_sampler_epoch(sampler: Any, epoch: int) -> None:
    """The loader sets its sampler's epoch (if it has ``set_epoch``): not one the user gave it."""
    set_epoch = getattr(sampler, "set_epoch", None)
    if callable(set_epoch):
        set_epoch(epoch)
        if getattr(sampler, "_told_epoch", False):
            sampler._told_epoch = False


class PassIndex(int):
    """A sample index tagged with its pass's ``(pass number, base seed)``, from which a kept worker
    seeds itself (:class:`fastload._torchpath.PassSeeded`)."""

    pass_seed: tuple[int, int]


def _tagged(index: Any, pass_seed: tuple[int, int]) -> PassIndex:
    tagged = PassIndex(index)
    tagged.pass_seed = pass_seed
    return tagged


class PassIndices:
    """torch's index sampler for a :class:`DataLoader` (its ``_index_sampler``): a resumed epoch's
    rest once, else the loader's own; :class:`PassIndex` es where fastload's default keeps workers."""

    def __init__(self, loader: Any) -> None:
        self._loader = weakref.ref(loader)  # no cycle: the loader is freed (and its workers stop) at once

    def _base(self, loader: Any) -> Any:
        return loader.batch_sampler if loader.batch_sampler is not None else loader.sampler

    def __iter__(self) -> Iterator[Any]:
        loader = self._loader()
        assert loader is not None  # torch's iterator holds the loader while it draws indices
        rest = loader._rest  # torch's iterator may call iter() twice as it starts: no pop
        batched = loader.batch_sampler is not None
        if rest is None:
            order: Iterator[Any] = iter(self._base(loader))
        elif not batched:
            order = iter(rest.tolist())
        else:
            order = iter([b.tolist() for b in split_batches(rest, loader.batch_size or 1, loader.drop_last)])
        pass_seed = loader.__dict__.get("_pass_seed")
        if pass_seed is None or pass_seed[1] is None:  # the first pass: torch seeded its workers
            return order
        if batched:
            return ([_tagged(i, pass_seed) for i in batch] for batch in order)
        return (_tagged(i, pass_seed) for i in order)

    def __len__(self) -> int:
        loader = self._loader()
        assert loader is not None
        return len(self._base(loader))


def take_sampler_epoch(loader: Any) -> None:
    """A pass start: an epoch given to the sampler since the loader last set it (as torchvision's
    reference script does) is the pass's epoch."""
    sampler: Any = loader.sampler
    if loader._own_sampler and getattr(sampler, "_told_epoch", False):
        sampler._told_epoch = False
        loader._epochs.set_epoch(sampler.epoch)
        return
    if loader._own_sampler:
        return
    # a job restarted at epoch e (set_epoch(e) on the sampler) must not draw epoch 0's augmentations
    if loader._given_batch_sampler:
        sampler = getattr(loader.batch_sampler, "sampler", None)
    epoch = getattr(sampler, "epoch", None)
    if type(epoch) is not int or epoch < 0:
        return
    last = loader.__dict__.get("_user_sampler_epoch", 0)
    loader._user_sampler_epoch = epoch
    if epoch != last and not loader._epochs.epoch_set:
        loader._epochs.set_epoch(epoch)


def sampler_epoch(loader: Any) -> int | None:
    """The epoch of a ``DistributedSampler`` the user passed (and sets the epoch of): its order's."""
    if loader._own_sampler or not isinstance(loader.sampler, TorchDistributedSampler):
        return None
    return int(loader.sampler.epoch)


def plan(loader: Any) -> Plan:
    """How this loader hands out an epoch (what its state records)."""
    n = None if isinstance(loader.dataset, IterableDataset) else len(loader.dataset)
    fields: dict[str, Any] = {}
    if n is not None and loader.batch_size is not None and not loader._given_batch_sampler:
        fields = sampler_plan(loader.sampler, loader.dataset, loader._own_sampler)
    if "order" not in fields:  # a custom sampler: its ranks must not change
        fields["num_replicas"] = get_world_size()
        fields["rank"] = get_rank()
    return Plan(num_samples=n, batch_size=loader.batch_size, drop_last=bool(loader.drop_last), **fields)


def refuse_random_order(loader: Any, state: Any, plan: Plan) -> None:
    """Refuses a state taken inside an epoch of torch's random samplers, whose order a restarted
    job cannot draw again."""
    if plan.global_order:
        return
    sampler = (
        getattr(loader.batch_sampler, "sampler", None) if loader._given_batch_sampler else loader.sampler
    )
    if not isinstance(sampler, (RandomSampler, SubsetRandomSampler, WeightedRandomSampler)):
        return
    if isinstance(sampler, EpochRandomSampler):
        return
    states = state if isinstance(state, list) else [state]
    if any(isinstance(one, dict) and one.get("batches") for one in states):
        raise ResumeError(
            f"this state was taken inside an epoch of torch's {type(sampler).__name__}, whose order "
            "a restarted job cannot draw again (it comes from the RNG's state at the pass's start): "
            "resuming would skip other samples than those seen. Pass shuffle=True instead of a "
            "RandomSampler (fastload's order, a function of seed and epoch), or distributed=True / "
            "fastload.DistributedSampler, to resume inside an epoch; a state taken at an epoch's end "
            "resumes with any sampler"
        )


def resume_pass(loader: Any, epoch: int, resume: Resume | None) -> tuple[int, np.ndarray | None]:
    """Where a pass of ``epoch`` begins: ``(batches to skip, this rank's indices or None)``. On
    torch's path a resume with the same sizes loads the skipped batches again (torch's draws go on
    as in an uninterrupted run); any other runs this rank's share of the global order's rest."""
    sampler = loader.sampler
    if resume is None:
        start = sampler.resume_point() if isinstance(sampler, DistributedSampler) else None
        if start is not None:
            # the sampler's own state: it yields the rest
            loader._epochs.start_at(start, 0, sampler.order_replicas())
        return 0, None
    if isinstance(sampler, DistributedSampler):
        sampler.forget_resume()  # the loader's state says where the epoch stands
    user_epoch = sampler_epoch(loader)
    if user_epoch is not None and resume.sampler_epoch is not None and user_epoch != resume.sampler_epoch:
        return 0, None  # the user's sampler went on to another epoch: it is whole
    torch_path = not loader.fast_path and loader.decode == "cpu"
    the_plan = plan(loader)
    if resume.batches is not None and (torch_path or not the_plan.global_order):
        loader._epochs.start_at(0, resume.batches)
        return resume.batches, None
    order_epoch = epoch if user_epoch is None else user_epoch
    order = global_order(loader.sampler, loader.dataset, order_epoch, resume.order_replicas)
    assert order is not None  # a resume with a position comes with a plan with a global order
    loader._epochs.start_at(resume.position, 0, resume.order_replicas)
    rest = rest_of_epoch(
        order, resume.position, the_plan.num_replicas, the_plan.rank, the_plan.pad, the_plan.drop_tail
    )
    return 0, rest


def pass_batches(loader: Any, epoch: int, cuda_feed: bool) -> Sequence[np.ndarray]:
    """This pass's batches for the fast path: cut at once for a resumed epoch, a known order or
    ``cuda_feed`` (a feeder thread must not interleave the sampler's draws with the loop's); any
    other sampler is read as batches are issued, as torch's iterator reads it."""
    batch_size = loader.batch_size or 1
    if loader._rest is not None or cuda_feed or predicted_order(loader.sampler, epoch) is not None:
        return split_batches(pass_order(loader), batch_size, loader.drop_last)
    n = len(loader.sampler)
    expected = n // batch_size if loader.drop_last else -(-n // batch_size)
    return SamplerBatches(loader.sampler, batch_size, loader.drop_last, expected)


def sample_keys(loader: Any) -> SampleKeys | None:
    """For a user's sampler: random streams keyed by each sample's copy and rank too, so that a
    sample given twice (repeats, replacement) or on two ranks gets its own augmentation."""
    sampler = loader.sampler
    if loader._own_sampler or type(sampler) in (SequentialSampler, EpochRandomSampler, DistributedSampler):
        return None  # fastload's orders: a sample's stream is its own on any rank (resharding)
    replicas, rank = getattr(sampler, "num_replicas", None), getattr(sampler, "rank", None)
    if not (isinstance(replicas, int) and isinstance(rank, int) and 0 <= rank < replicas):
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        replicas = torch.distributed.get_world_size() if distributed else 1
        rank = torch.distributed.get_rank() if distributed else 0
    return SampleKeys(len(loader.dataset), rank, replicas)


def pass_order(loader: Any) -> np.ndarray:
    """This pass's indices: a resumed epoch's rest, or the sampler's order."""
    rest = loader._rest
    if rest is not None:
        return rest
    return np.fromiter((sample_index(i) for i in loader.sampler), dtype=np.int64)


def follow_pass(loader: Any, rest: np.ndarray | None) -> Callable[[int], None] | None:
    """Tells a dataset with a ``follow_pass(order)`` method this pass's indices (this rank's: a
    resumed epoch's rest, or the order of fastload's own samplers, drawn without touching the
    sampler) at the pass's start, before any worker reads; returns what it gives back, a function
    the pass calls with the position in the order its workers read at (the samples handed out,
    plus the batches the workers read ahead) at its start and after each batch (``None``: nothing
    to tell, e.g. a user's sampler whose order is only known as it is drawn). A dataset reading from an
    object store uses it to download ahead in the pass's order (:meth:`fastload.TarShards.follow_pass`)."""
    follow = optional_attribute(loader.dataset, "follow_pass")
    if not callable(follow) or loader.batch_size is None:
        return None
    sampler = loader.sampler
    order: np.ndarray | None = rest
    if order is None and type(sampler) is DistributedSampler:  # (resumed: it yields its epoch's rest)
        order = np.asarray(sampler.indices(start=sampler.resume_point() or 0), dtype=np.int64)
    elif order is None:
        order = predicted_order(sampler, getattr(sampler, "epoch", 0))
    if order is None:
        return None
    progress: Callable[[int], None] | None = follow(order)
    return progress
