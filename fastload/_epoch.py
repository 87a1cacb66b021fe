"""Epochs, resume and the default seed: one implementation for every fastload loader.

:class:`EpochState` is what ``DataLoader`` and ``DALILoader`` share (backends differ only in how
a batch is produced): the epoch of the next pass, the batches handed out in the current one,
``set_epoch``, and ``state_dict``/``load_state_dict``.

Epoch rule: a pass uses the epoch given to ``set_epoch``; a pass without a ``set_epoch`` call
uses the previous pass's epoch + 1 (starting at 0), also after a pass left early, so a loop
that breaks after N steps does not see the same N batches every epoch.

State rule: taken inside a pass, the state is that pass's epoch and the batches the consumer
received (a batch whose loading raised counts as received: the pass went on past it); taken
between passes, it is what the next pass will do. Example: 10 batches per epoch, a process
saves after receiving 4 batches of epoch 2 -> ``{"epoch": 2, "batches": 4}``; a new loader that
loads it yields batches 4..9 of epoch 2, then epoch 3 from its start.
"""

from __future__ import annotations

from typing import Any

import torch

from ._checks import check_int
from .distributed import get_world_size

__all__ = ["DefaultSeed", "EpochState", "resolve_seed"]

STATE_VERSION = 1


class DefaultSeed:
    """The seed of a loader or sampler built with ``seed=None``.

    Outside a distributed job it is a number drawn at construction from torch's global RNG (or
    from ``generator``), so ``torch.manual_seed`` makes runs repeatable, as with torch. Inside one
    -- a process group is initialized, or ``WORLD_SIZE`` > 1, when the seed is first needed --
    it is 0, torch's ``DistributedSampler`` default: every rank must shuffle alike before the
    order is sharded, or some samples are never seen in an epoch and others twice. The value is
    fixed at first use (construction with ``distributed=True``, else the first pass).
    """

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.drawn = int(torch.randint(0, 2**62, (1,), generator=generator).item())
        self._value: int | None = None

    @property
    def value(self) -> int:
        """The seed, fixed at the first call."""
        if self._value is None:
            self._value = 0 if get_world_size() > 1 else self.drawn
        return self._value


def resolve_seed(seed: int | DefaultSeed) -> int:
    """``seed`` itself, or the value of a :class:`DefaultSeed`."""
    return seed.value if isinstance(seed, DefaultSeed) else seed


class EpochState:
    """Where a loader is in its epochs.

    Args:
        kind: Names the loader class in the state (``"fastload.DataLoader"``); a state of another
            kind is refused.
        seed: An explicit seed, or a :class:`DefaultSeed`.
    """

    def __init__(self, kind: str, seed: int | DefaultSeed) -> None:
        self.kind = kind
        self._seed = seed
        self.epoch = 0  # of the next (or current) pass
        self.epoch_set = False  # set_epoch() was called for the next pass
        self.resume_at = 0  # batches of `epoch` the next pass skips (load_state_dict)
        self.pass_epoch: int | None = None  # epoch of the pass in progress
        self.done = 0  # batches of the pass in progress handed to the consumer

    @property
    def seed(self) -> int:
        """The seed of the order and of every random augmentation."""
        self._seed = resolve_seed(self._seed)
        return self._seed

    @seed.setter
    def seed(self, value: int) -> None:
        self._seed = int(value)

    @property
    def seed_source(self) -> int | DefaultSeed:
        """The seed, or the :class:`DefaultSeed` it will be taken from (to share with a sampler)."""
        return self._seed

    def set_epoch(self, epoch: int) -> None:
        """The next pass is ``epoch``, from its first batch."""
        self.epoch = check_int(epoch, "epoch", low=0)
        self.epoch_set = True
        self.resume_at = 0
        self.pass_epoch = None

    def begin_pass(self) -> tuple[int, int]:
        """Starts a pass; returns ``(epoch, first batch)``."""
        epoch, start = self.epoch, self.resume_at
        self.resume_at = 0
        self.done = start
        self.pass_epoch = epoch
        return epoch, start

    def handed_out(self, epoch: int, done: int) -> None:
        """The consumer has received ``done`` batches of the pass of ``epoch``."""
        if self.pass_epoch == epoch:
            self.done = done

    def end_pass(self, epoch: int) -> None:
        """The pass of ``epoch`` ended (all batches, a ``break``, or its iterator was dropped)."""
        if self.pass_epoch == epoch:
            self.pass_epoch = None
        if self.epoch == epoch:
            self.epoch = epoch + 1
            self.epoch_set = False
            self.resume_at = 0

    def state_dict(self, **shape: Any) -> dict[str, Any]:
        """The state: seed, epoch, batches handed out, and ``shape`` (the sizes a resume must match)."""
        if self.pass_epoch is not None:
            epoch, done = self.pass_epoch, self.done
        else:
            epoch, done = self.epoch, self.resume_at
        return {
            "format": self.kind,
            "version": STATE_VERSION,
            "seed": self.seed,
            "epoch": epoch,
            "batches": done,
            **shape,
        }

    def load_state_dict(self, state: Any, num_batches: int, **shape: Any) -> None:
        """Resumes from :meth:`state_dict`: the next pass yields the rest of the saved epoch.

        Args:
            state: A state from a loader of the same kind.
            num_batches: Batches per epoch of this loader (a state at the end of an epoch
                resumes at the start of the next one).
            shape: The sizes the state must have been saved with (samples, batch size, ranks).

        Raises:
            ValueError: Not a state of this kind or version, saved with other sizes, or a field
                out of range (named, with the valid range).
        """
        if not isinstance(state, dict) or state.get("format") != self.kind:
            raise ValueError(f"state should come from {self.kind}.state_dict(), but got {_brief(state)}")
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"unsupported {self.kind} state version {state.get('version')!r} "
                f"(this fastload reads version {STATE_VERSION})"
            )
        saved = {key: state.get(key) for key in shape}
        if saved != shape:
            raise ValueError(
                f"the state was saved for {_sizes(saved)}, but this loader has {_sizes(shape)}: "
                "the remaining batches would differ"
            )
        for key in ("seed", "epoch", "batches"):
            if key not in state:
                raise ValueError(f"the state has no {key!r} field: it is not a complete {self.kind} state")
        seed = check_int(state["seed"], "state['seed']")
        epoch = check_int(state["epoch"], "state['epoch']", low=0)
        done = check_int(state["batches"], "state['batches']", low=0, high=num_batches)
        self.seed = seed
        if done == num_batches:
            epoch, done = epoch + 1, 0
        self.set_epoch(epoch)
        self.resume_at = done


_SIZE_WORDS = {"num_samples": "{} samples", "batch_size": "batches of {}", "num_replicas": "{} ranks"}


def _sizes(shape: dict[str, Any]) -> str:
    """``{"num_samples": 12, "batch_size": 5}`` -> ``"12 samples, batches of 5"``."""
    return ", ".join(_SIZE_WORDS.get(key, key + "={}").format(value) for key, value in shape.items())


def _brief(state: Any) -> str:
    if isinstance(state, dict):
        return f"a dict with format={state.get('format')!r}"
    return type(state).__name__
