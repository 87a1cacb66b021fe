"""Epochs, resume and the default seed: :class:`EpochState`, shared by ``DataLoader`` and
``DALILoader``.

A pass uses the epoch given to ``set_epoch``, else the previous pass's + 1 (also after a pass
left early). A state taken inside a pass is that pass's epoch and the batches the consumer got
(a batch whose loading raised counts); taken between passes, what the next pass will do. A
loader whose sampler fastload knows also records ``position`` with its sharding rule
(:class:`Plan`) and resumes on any ranks and batch size (:mod:`fastload._position`;
docs/how-it-works.md, "Determinism and resume"); any other resumes only with the same sizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from ._checks import check_int
from ._position import consumed, shard_lengths
from .distributed import get_world_size
from .rng import mix_int

STATE_VERSION = 2


class ResumeError(ValueError):
    """A resume state this loader cannot continue exactly; the message names the field and both
    values. Nothing about the loader changed."""


class DefaultSeed:
    """The seed of a loader or sampler built with ``seed=None``: 0 in a distributed job (every
    rank shuffles alike), else fixed at the first pass from the base seed torch's iterator draws
    then (read without drawing, and mixed), or by a draw of its own when asked for earlier."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator
        self._value: int | None = None

    @property
    def value(self) -> int:
        """The seed, fixed at the first call (by a draw of its own)."""
        return self.fix(at_pass=False)

    def fix(self, at_pass: bool) -> int:
        """The seed; the first call fixes it. ``at_pass``: as a pass starts, before it draws its base
        seed (read here without drawing)."""
        if self._value is None:
            if get_world_size() > 1:
                self._value = 0
            else:
                self._value = mix_int(base_seed(self.generator, consume=not at_pass)) >> 2  # 62 bits
        return self._value


def base_seed(generator: torch.Generator | None = None, consume: bool = True) -> int:
    """The base seed torch's DataLoader iterator draws as it starts: the next int64 of ``generator``
    (torch's global RNG when ``None``); ``consume=False`` leaves the generator's state as it was."""
    if consume:
        return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator should be a torch.Generator, but got generator={generator!r}")
    state = torch.get_rng_state() if generator is None else generator.get_state()
    try:
        return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())
    finally:
        if generator is None:
            torch.set_rng_state(state)
        else:
            generator.set_state(state)


def resolve_seed(seed: int | DefaultSeed) -> int:
    """``seed`` itself, or the value of a :class:`DefaultSeed`."""
    return seed.value if isinstance(seed, DefaultSeed) else seed


@dataclass(frozen=True)
class Plan:
    """How a loader hands out an epoch: what its state records, and what a resume must agree with.

    Attributes:
        order: ``"shuffle"``, ``"blocks"``, ``"sequence"``, or ``None``: one fastload cannot derive.
        order_seed: The seed of a sampler the user built (``None``: the loader's own).
        pad, drop_tail: The sampler's sharding rule (:func:`fastload._position.rest_of_epoch`).
        shuffle_window, shuffle_blocks: What a blockwise order depends on
            (:func:`fastload.sampler.block_layout`).
    """

    num_samples: int | None
    batch_size: int | None
    drop_last: bool = False
    num_replicas: int = 1
    rank: int = 0
    order: str | None = None
    order_seed: int | None = None
    pad: bool = False
    drop_tail: bool = False
    shuffle_window: int | None = None
    shuffle_blocks: str | None = None

    @property
    def global_order(self) -> bool:
        """The loader's batches are a sharding of a global order fastload can derive."""
        return self.order is not None and self.num_samples is not None and self.batch_size is not None

    def position(self, start: int, batches: Any) -> tuple[int, bool, bool]:
        """``(position, finished, prefix)`` after ``batches`` of a pass that began at ``start``."""
        assert self.num_samples is not None and self.batch_size is not None  # global_order
        taken, finished, prefix = consumed(
            self.num_samples - start,
            self.num_replicas,
            self.batch_size,
            batches,
            self.pad,
            self.drop_tail,
            self.drop_last,
        )
        return start + taken, finished, prefix


@dataclass(frozen=True)
class Resume:
    """Where the next pass of a loaded state begins: a global ``position``, and the batches before
    it where this loader made them itself (for torch's path, which loads them again), else ``None``."""

    position: int
    batches: int | None
    sampler_epoch: int | None = None  # a user's DistributedSampler: the epoch its order was made for
    order_replicas: int | None = None  # the ranks the saved order was built for (None: this loader's)


_PLAN_FIELDS = tuple(Plan.__dataclass_fields__)
_LAYOUT = ("shuffle_window", "shuffle_blocks")  # absent from states saved before they were recorded
_WORDS = {
    "num_samples": "{} samples",
    "batch_size": "batches of {}",
    "num_replicas": "{} ranks",
    "drop_last": "drop_last={}",
    "order": "order {!r}",
    "order_seed": "sampler seed {}",
    "pad": "pad={}",
    "drop_tail": "sampler drop_last={}",
}


class EpochState:
    """Where a loader is in its epochs; ``kind`` names the loader class in the state."""

    def __init__(self, kind: str, seed: int | DefaultSeed) -> None:
        self.kind = kind
        self._seed = seed
        self.epoch = 0  # of the next (or current) pass
        self.epoch_set = False  # set_epoch() was called for the next pass
        self.resume: Resume | None = None  # where the next pass of `epoch` begins (load_state_dict)
        # a loaded state that ended its epoch: (that epoch, the resume that yields nothing of it)
        self.completed: tuple[int, Resume] | None = None
        self.pass_epoch: int | None = None  # epoch of the pass in progress
        # the number of the pass in progress: an older pass, still held, cannot speak for it
        self.live_pass: int | None = None
        self._passes = 0
        self.pass_start = 0  # global position the pass in progress began at
        self.done = 0  # batches of the pass in progress handed to the consumer
        self.order_replicas: int | None = None  # the ranks its order was built for (None: the plan's)

    @property
    def seed(self) -> int:
        """The seed of the order and of every random augmentation."""
        self._seed = resolve_seed(self._seed)
        return self._seed

    @seed.setter
    def seed(self, value: int) -> None:
        self._seed = int(value)

    def pass_seed(self) -> int:
        """The seed, as a pass starts (before it draws torch's base seed, see :class:`DefaultSeed`)."""
        if isinstance(self._seed, DefaultSeed):
            self._seed = self._seed.fix(at_pass=True)
        return self._seed

    @property
    def seed_source(self) -> int | DefaultSeed:
        """The seed, or the :class:`DefaultSeed` it will be taken from (to share with a sampler)."""
        return self._seed

    def set_epoch(self, epoch: int) -> None:
        """The next pass is ``epoch``, from its first batch -- unless a loaded state resumes that
        very epoch: a loop that calls ``set_epoch(epoch)`` at the top of every epoch, the resumed
        one included, gets the rest of it."""
        epoch = check_int(epoch, "epoch", low=0)
        if self.resume is not None and epoch != self.epoch:
            self.resume = None
        if self.completed is not None and epoch == self.completed[0]:
            self.resume = self.completed[1]  # the loaded state's epoch was over: nothing of it is left
        self.epoch = epoch
        self.epoch_set = True
        self.pass_epoch = None
        self.live_pass = None  # the pass in progress, if any, no longer decides the epoch

    def begin_pass(self) -> tuple[int, Resume | None]:
        """Starts a pass (an earlier one still unfinished ends here, as after a ``break``); returns
        its epoch and where a loaded state resumes it (``None``: its start)."""
        if self.pass_epoch is not None:
            self.end_pass(self.pass_epoch, self.live_pass)
        epoch, resume = self.epoch, self.resume
        self.resume = self.completed = None
        self.pass_epoch = epoch
        self.pass_start = self.done = 0
        self.order_replicas = None
        self._passes += 1
        self.live_pass = self._passes
        return epoch, resume

    def start_at(self, position: int, batches: int, order_replicas: int | None = None) -> None:
        """The pass in progress begins at global ``position`` and counts ``batches`` as handed out;
        ``order_replicas``: the ranks its global order was built for (``None``: the plan's)."""
        self.pass_start, self.done, self.order_replicas = position, batches, order_replicas

    def handed_out(self, epoch: int, done: int, pass_id: int | None = None) -> None:
        """The consumer has received ``done`` batches of the pass ``pass_id`` of ``epoch``."""
        if pass_id is not None and pass_id != self.live_pass:
            return
        if self.pass_epoch == epoch:
            self.done = done

    def end_pass(self, epoch: int, pass_id: int | None = None) -> None:
        """The pass ``pass_id`` of ``epoch`` ended; one no longer in progress changes nothing."""
        if pass_id is not None:
            if pass_id != self.live_pass:
                return
            self.live_pass = None
        if self.pass_epoch == epoch:
            self.pass_epoch = None
        if self.epoch == epoch:
            self.epoch = epoch + 1
            self.epoch_set = False
            self.resume = None

    def state_dict(self, plan: Plan, sampler_epoch: int | None = None) -> dict[str, Any]:
        """The state: seed, epoch, how far the consumer got, and ``plan``. ``sampler_epoch``: the epoch
        of a user's sampler (a resume applies only while it is at that epoch again)."""
        replicas = None
        if self.pass_epoch is not None:
            epoch, start, done, replicas = self.pass_epoch, self.pass_start, self.done, self.order_replicas
        elif self.resume is not None:
            epoch, start, done, replicas = self.epoch, self.resume.position, 0, self.resume.order_replicas
            if self.resume.batches is not None:
                start, done = 0, self.resume.batches
        else:
            epoch, start, done = self.epoch, 0, 0
        position = plan.position(start, done)[0] if plan.global_order else None
        return {
            "format": self.kind,
            "version": STATE_VERSION,
            "seed": self.seed,
            "epoch": epoch,
            "position": position,
            "batches": done,
            "pass_start": start,
            "sampler_epoch": sampler_epoch,
            **asdict(plan),
            "order_replicas": plan.num_replicas if replicas is None else replicas,
        }

    def load_state_dict(
        self, state: Any, plan: Plan, num_batches: int | None, sampler_epoch: int | None = None
    ) -> None:
        """Resumes from :meth:`state_dict` (one rank's, or a list of every rank's). ``num_batches``:
        this loader's batches per epoch (for a state without a position)."""
        states = list(state) if isinstance(state, (list, tuple)) else [state]
        if not states:
            raise ResumeError(f"state should come from {self.kind}.state_dict(), but got an empty list")
        checked = [self._checked(s, plan) for s in states]
        first = checked[0]
        if len(checked) > 1:
            first = _merge(checked)
        epoch, seed = first["epoch"], first["seed"]
        if plan.global_order and first["position"] is not None:
            resume = self._global_resume(first, plan, sampler_epoch)
        else:
            resume = self._batch_resume(first, plan, num_batches)
        self.seed = seed
        self.completed = None
        if resume is None:  # the saved epoch was over: the next pass is the next epoch, and
            # set_epoch(epoch) -- a loop that resumes at the saved epoch -- yields nothing of it
            if plan.global_order and first["position"] is not None:
                end = Resume(plan.num_samples or 0, None)
            else:
                end = Resume(0, num_batches)
            self.set_epoch(epoch + 1)
            self.completed = (epoch, end)
        else:
            self.set_epoch(epoch)
            self.resume = resume
        self.epoch_set = False  # the loader sets a user's sampler's epoch itself, once, on loading

    def _checked(self, state: Any, plan: Plan) -> dict[str, Any]:
        """The fields of one state, type-checked, with the sizes this loader must share."""
        if not isinstance(state, dict) or state.get("format") != self.kind:
            raise ResumeError(f"state should come from {self.kind}.state_dict(), but got {_brief(state)}")
        version = state.get("version")
        if version == 1:
            raise ResumeError(
                f"this {self.kind} state (version 1) was saved by an earlier fastload, which did not "
                "record the number of ranks: it cannot be continued exactly. Start its epoch over with "
                "loader.set_epoch(state['epoch'])"
            )
        if version != STATE_VERSION:
            raise ResumeError(
                f"unsupported {self.kind} state version {version!r} "
                f"(this fastload reads version {STATE_VERSION})"
            )
        for key in ("seed", "epoch", "batches", "position", "pass_start", *_PLAN_FIELDS):
            if key not in state and key not in _LAYOUT:
                raise ResumeError(f"the state has no {key!r} field: it is not a complete {self.kind} state")
        fields = {**dict.fromkeys(_LAYOUT), **state}
        for key, low in (("seed", None), ("epoch", 0), ("batches", 0), ("pass_start", 0)):
            fields[key] = _state_int(state, key, low)
        if state["num_samples"] != plan.num_samples:
            raise ResumeError(
                f"the state was saved for {_sizes(state, ('num_samples',))}, but this loader has "
                f"{_sizes(asdict(plan), ('num_samples',))}: it is another dataset"
            )
        if state.get("sampler_epoch") is not None:
            fields["sampler_epoch"] = _state_int(state, "sampler_epoch", 0)
        # the ranks the epoch's order was built for (earlier states: 1, the order they all used)
        fields["order_replicas"] = _state_int({"order_replicas": 1, **state}, "order_replicas", 1)
        if state["position"] is not None:
            fields["position"] = _state_int(state, "position", 0, state["num_samples"])
            for key, low in (("batch_size", 1), ("num_replicas", 1), ("rank", 0)):
                fields[key] = _state_int(state, key, low)
            taken, fields["finished"], _ = Plan(**{k: fields[k] for k in _PLAN_FIELDS}).position(
                fields["pass_start"], fields["batches"]
            )
            if fields["pass_start"] > fields["position"] or taken != fields["position"]:
                raise ResumeError(
                    f"the state's position {fields['position']} does not follow from its batches "
                    f"({fields['batches']} from position {fields['pass_start']}): it was changed by hand"
                )
        return fields

    def _global_resume(self, state: dict[str, Any], plan: Plan, sampler_epoch: int | None) -> Resume | None:
        if state["order"] != plan.order:
            raise ResumeError(
                f"the state was saved by a loader with {_sizes(state, ('order',))}, but this loader has "
                f"{_sizes(asdict(plan), ('order',))} (shuffle, or the sampler, changed): the rest of "
                "the epoch would be another set of samples"
            )
        shuffled = state["order"] != "sequence"
        saved_seed = state["seed"] if state["order_seed"] is None else state["order_seed"]
        if shuffled and plan.order_seed is not None and saved_seed != plan.order_seed:
            raise ResumeError(
                f"the state's order was shuffled with seed {saved_seed}, but this loader's "
                f"sampler has seed {plan.order_seed}: build the sampler with seed={saved_seed}"
            )
        saved_epoch = state.get("sampler_epoch")
        order_epoch = state["epoch"] if saved_epoch is None else saved_epoch
        if (
            shuffled
            and plan.order_seed is None
            and (saved_seed, order_epoch) != (state["seed"], state["epoch"])
        ):
            raise ResumeError(
                f"the state's order was shuffled by a sampler the user built (seed {saved_seed}, epoch "
                f"{order_epoch}) while its loader's augmentations used seed {state['seed']}, epoch "
                f"{state['epoch']}: this loader's own sampler cannot continue both. Pass that sampler "
                f"again: sampler=DistributedSampler(dataset, seed={saved_seed}) at epoch {order_epoch}"
            )
        if state["finished"]:
            return None
        if state["position"]:
            check_layout(state, asdict(plan), "loader.set_epoch(state['epoch'])")
        same = all(state[k] == getattr(plan, k) for k in _PLAN_FIELDS if k not in ("rank", *_LAYOUT))
        own = same and state["pass_start"] == 0 and state["batches"] is not None
        batches = state["batches"] if own else None
        epoch_of = order_epoch if sampler_epoch is not None else None
        replicas = state["order_replicas"] if state["position"] else None  # nothing taken: this job's order
        return Resume(state["position"], batches, epoch_of, replicas)

    def _batch_resume(self, state: dict[str, Any], plan: Plan, num_batches: int | None) -> Resume | None:
        """The resume of a loader (or a state) without a global order: the same sizes, batches skipped."""
        keys = ("order", "batch_size", "num_replicas", "drop_last")
        if any(state[k] != getattr(plan, k) for k in keys):
            raise ResumeError(
                f"the state was saved for {_sizes(state, keys)}, but this loader has "
                f"{_sizes(asdict(plan), keys)}: where fastload cannot derive the epoch's order (a custom "
                "sampler or batch_sampler, a framework's sampler wrapper, or an IterableDataset), a state "
                "resumes only with the same sampler, batch size and ranks. To resume on another number "
                "of ranks, build the loader with distributed=True (with Lightning: and "
                "Trainer(use_distributed_sampler=False))"
            )
        done = _state_int(state, "batches", 0, num_batches)
        if num_batches is not None and done == num_batches:
            return None
        return Resume(0, done, state.get("sampler_epoch"))


def check_layout(saved: dict[str, Any], mine: dict[str, Any], anew: str) -> None:
    """Refuses to continue a blockwise order with another ``shuffle_window`` or other blocks (a state
    without them, saved before they were recorded, is accepted). ``anew``: how to start the epoch over.

    Raises:
        ResumeError: Naming the field that changed and both values.
    """
    window, blocks = saved.get("shuffle_window"), saved.get("shuffle_blocks")
    if window is not None and window != mine["shuffle_window"]:
        changed = f"with shuffle_window={window}, but this dataset has {mine['shuffle_window']}"
    elif blocks is not None and blocks != mine["shuffle_blocks"]:
        changed = (
            f"over {blocks}, but this dataset has {mine['shuffle_blocks']}: the shards' layout changed "
            "(other shards, another order or shard size)"
        )
    else:
        return
    raise ResumeError(
        f"the state's blockwise order was built {changed}; the rest of the epoch would repeat some "
        f"samples and skip others. Resume with the same shuffle_window and shards, or start the "
        f"epoch anew with {anew}"
    )


def _merge(states: list[dict[str, Any]]) -> dict[str, Any]:
    """One state from the states of every rank of a job (refused unless they describe one position)."""
    epochs = {s["epoch"] for s in states}
    if len(epochs) == 2 and all(s["position"] is not None for s in states):
        # Ranks whose (uneven, exact) shard ran out are at the next epoch's start: they took all theirs.
        epoch = min(epochs)
        inside = [s for s in states if s["epoch"] == epoch]
        moved_on = [
            s for s in states if s["epoch"] == epoch + 1 and s["batches"] == 0 and s["pass_start"] == 0
        ]
        if inside and len(inside) + len(moved_on) == len(states):
            ref = inside[0]
            saved = Plan(**{k: ref[k] for k in _PLAN_FIELDS})
            lengths = shard_lengths(
                saved.num_samples - ref["pass_start"], saved.num_replicas, saved.pad, saved.drop_tail
            )
            batch = saved.batch_size
            per_rank = lengths // batch if saved.drop_last else -(-lengths // batch)
            states = inside + [
                {**s, "epoch": epoch, "pass_start": ref["pass_start"], "batches": int(per_rank[s["rank"]]),
                 "sampler_epoch": ref.get("sampler_epoch"), "order_replicas": ref["order_replicas"]}
                for s in moved_on
            ]  # fmt: skip
    first = states[0]
    keys = ("epoch", "seed", "pass_start", "sampler_epoch", "order_replicas")
    for key in (*keys, *(k for k in _PLAN_FIELDS if k != "rank")):
        values = {s["rank"]: s[key] for s in states}
        if len(set(map(repr, values.values()))) > 1:
            raise ResumeError(
                f"the ranks' states differ in {key!r} ("
                + ", ".join(f"rank {r}: {v!r}" for r, v in sorted(values.items()))
                + "): they are not from one job at one time"
            )
    ranks = sorted(s["rank"] for s in states)
    if ranks != list(range(first["num_replicas"])):
        raise ResumeError(
            f"a list of states should hold the state of each of the {first['num_replicas']} ranks once, "
            f"but holds ranks {ranks}"
        )
    if first["position"] is None:
        raise ResumeError(
            "a list of states needs states with a position (a loader whose order fastload derives); "
            "these record batches only: load one rank's state"
        )
    saved = Plan(**{k: first[k] for k in _PLAN_FIELDS})
    by_rank = np.array([s["batches"] for s in sorted(states, key=lambda s: s["rank"])], dtype=np.int64)
    position, finished, prefix = saved.position(first["pass_start"], by_rank)
    if not prefix and not finished:
        raise ResumeError(
            "the ranks stopped at different points ("
            + ", ".join(f"rank {r}: {int(b)} batches" for r, b in enumerate(by_rank))
            + "), so the samples they handed out are not the start of the epoch's order: no single "
            "resume continues them exactly. Save every rank's state at the same step"
        )
    uniform = bool(np.all(by_rank == by_rank[0]))
    batches = first["batches"] if uniform else None
    return {**first, "position": position, "finished": finished, "batches": batches}


def _state_int(state: dict[str, Any], key: str, low: int | None, high: int | None = None) -> int:
    try:
        return check_int(state[key], f"state[{key!r}]", low=low, high=high)
    except ValueError as e:
        raise ResumeError(str(e)) from None


def _sizes(values: dict[str, Any], keys: Sequence[str]) -> str:
    """``({"num_samples": 12, "batch_size": 5}, keys)`` -> ``"12 samples, batches of 5"``."""
    return ", ".join(_WORDS.get(key, key + "={}").format(values.get(key)) for key in keys)


def _brief(state: Any) -> str:
    if isinstance(state, dict):
        return f"a dict with format={state.get('format')!r}"
    return type(state).__name__
