"""torch's intra-op thread count, shared by every loader that caps it (``limit_threads``).

Each loader whose workers are alive holds a cap (:class:`ThreadCap`) in the thread that iterates
it; that thread runs with the smallest cap held there and gets the user's count back when the
last hold there ends, in any order. Counts are set only from the iterating thread: a hold ended
on another thread (the garbage collector, ``close()``) takes effect at that thread's next call.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import threading
import weakref
from collections.abc import Iterator

import torch

_lock = threading.Lock()
_inside = threading.local()  # .active: this thread is in the registry (a release then waits for it)
_holds: dict[int, tuple[weakref.ref[threading.Thread], int]] = {}  # hold -> (its thread, its cap)
_before: weakref.WeakKeyDictionary[threading.Thread, int] = weakref.WeakKeyDictionary()  # user's count
_left: weakref.WeakKeyDictionary[threading.Thread, int] = weakref.WeakKeyDictionary()  # count set last
_dropped: collections.deque[int] = collections.deque()  # releases made inside the registry
_keys = itertools.count()


def held_caps(thread: threading.Thread | None = None) -> list[int]:
    """The caps held in ``thread`` (default: this one), smallest first (empty: its count is the user's)."""
    thread = threading.current_thread() if thread is None else thread
    with _locked():
        return sorted(cap for ref, cap in _holds.values() if ref() is thread)


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """The registry's lock; releases queued meanwhile in this thread are done before it is let go."""
    _lock.acquire()
    _inside.active = True
    try:
        yield
        _drain()
    finally:
        _inside.active = False
        _lock.release()


def _drain() -> None:
    while _dropped:
        _release_locked(_dropped.popleft())


def _settle() -> None:
    """This thread's count: its smallest cap, never above the user's count, given back when none."""
    me = threading.current_thread()
    caps = [cap for ref, cap in _holds.values() if ref() is me]
    current = torch.get_num_threads()
    before = _before.get(me)
    if before is None or _left.get(me) != current:  # a first hold, or the user set a count since
        if before is None and not caps:
            return
        before = current
    if caps:
        _before[me] = before
        target = _left[me] = min(before, *caps)
    else:
        target = before
        _before.pop(me, None)
        _left.pop(me, None)
    if target != current:
        torch.set_num_threads(target)


def _release_locked(key: int) -> None:
    held = _holds.pop(key, None)
    if held is not None and held[0]() is threading.current_thread():
        _settle()  # else its thread's next pass start or release does it


def _release(key: int) -> None:
    if getattr(_inside, "active", False):  # a loader collected inside the registry's own calls
        _dropped.append(key)
        return
    with _locked():
        _release_locked(key)
        _settle()  # this thread's count also where that hold was another's (one left earlier here)


def _quiet_release(key: int) -> None:
    """A collected loader's release (its finalizer)."""
    with contextlib.suppress(Exception):  # interpreter shutdown
        _release(key)


class ThreadCap:
    """One loader's hold on torch's thread count (released also when this object is collected)."""

    def __init__(self) -> None:
        self._key = next(_keys)
        self._finalizer = weakref.finalize(self, _quiet_release, self._key)

    def hold(self, cap: int) -> None:
        """Holds (or changes this hold to) ``cap`` threads at most, in the calling thread."""
        me = threading.current_thread()
        with _locked():
            held = _holds.get(self._key)
            if held is not None and held[0]() is not me:
                _release_locked(self._key)  # the loader is iterated from another thread now
            _holds[self._key] = (weakref.ref(me), max(1, int(cap)))
            _settle()

    def release(self) -> None:
        """Ends this hold, if any."""
        _release(self._key)


def _forget_in_child() -> None:
    """A forked child has none of its parent's loaders' workers: it holds nothing."""
    global _lock, _inside
    _lock = threading.Lock()
    _inside = threading.local()
    _holds.clear()
    _before.clear()
    _left.clear()
    _dropped.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
