"""torch's intra-op thread count, shared by every loader that caps it (``limit_threads``).

torch has one count per process, and a training script often has several loaders alive at once
(training and validation, a second dataset). Each loader whose workers are alive holds a cap (the
CPUs less its workers, :class:`ThreadCap`); torch runs with the smallest cap held, and gets back
the count it had before the first hold when the last hold ends, in whatever order the loaders
stop. A hold ends when the loader's workers stop (``close()``, the end of a pass without
persistent workers) or when the loader is garbage-collected.

A count the user sets while caps are held is theirs: a hold or a release never raises torch above
it, and it is what the last release leaves (a new hold still lowers it to its cap, as the first
one did).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import weakref

import torch

__all__ = ["ThreadCap", "held_caps"]

_lock = threading.RLock()  # re-entrant: a collected loader's finalizer may run inside a hold
_caps: dict[int, int] = {}  # hold -> its cap
_before: int | None = None  # torch's count before the holds (or as the user last set it)
_ours: int | None = None  # the count this module last left torch at while holds are alive
_keys = itertools.count()


def held_caps() -> list[int]:
    """The caps held now, smallest first (empty: torch's count is the user's)."""
    with _lock:
        return sorted(_caps.values())


def _settle() -> None:
    """Sets torch's count to the smallest cap held (never above the user's), or gives it back."""
    global _before, _ours
    current = torch.get_num_threads()
    if _ours is None or current != _ours:  # the first hold, or the user set a count since
        _before = current
    assert _before is not None
    target = min(_before, *_caps.values()) if _caps else _before
    if target != current:
        torch.set_num_threads(target)
    _ours = target if _caps else None


def _hold(key: int, cap: int) -> None:
    with _lock:
        _caps[key] = max(1, int(cap))
        _settle()


def _release(key: int) -> None:
    with _lock:
        if _caps.pop(key, None) is not None:
            _settle()


class ThreadCap:
    """One loader's hold on torch's thread count: :meth:`hold` while its workers are alive,
    :meth:`release` when they stop (also done when this object is collected)."""

    def __init__(self) -> None:
        self._key = next(_keys)
        self._finalizer = weakref.finalize(self, _quiet_release, self._key)

    def hold(self, cap: int) -> None:
        """Holds (or changes this hold to) ``cap`` threads at most."""
        _hold(self._key, cap)

    def release(self) -> None:
        """Ends this hold (nothing if none): torch gets the smallest cap still held, or its count back."""
        _release(self._key)

    @property
    def held(self) -> bool:
        with _lock:
            return self._key in _caps


def _quiet_release(key: int) -> None:
    with contextlib.suppress(Exception):  # interpreter shutdown
        _release(key)


def _forget_in_child() -> None:
    """A forked child has none of its parent's loaders' workers: it holds nothing."""
    global _lock, _before, _ours
    _lock = threading.RLock()
    _caps.clear()
    _before = _ours = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
