"""fastload's background threads stopped before the interpreter finalises.

At interpreter exit, CPython ends a daemon thread the moment it next takes the interpreter's lock.
A thread that is inside torch's C++ code then (a tensor freed, an operation returning) is unwound
through frames that do not allow it, and the whole process aborts -- "terminate called without
an active exception", exit status 134 -- after the user's script ended well. A script that keeps
a pass's iterator in a variable (``it = iter(loader)``) and leaves while the device feeder is
preparing the next batch did exactly that. So the threads fastload runs beside the user's loop
register here, and one ``atexit`` handler stops and joins them first (``atexit`` handlers run
before the interpreter starts ending daemon threads; the thread pools' own exit handler has run
by then, so a thread that submits work to one gets an error, which it keeps for a ``next()``
that never comes).

Nothing here imports torch.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from typing import Protocol

__all__ = ["StoppedAtExit", "stop_at_exit"]


class StoppedAtExit(Protocol):
    """An object whose background thread :func:`stop_at_exit` stops at interpreter exit."""

    def stop_for_exit(self) -> None:
        """Stops the thread and waits for it (the interpreter is about to end)."""
        ...


_live: weakref.WeakSet[StoppedAtExit] = weakref.WeakSet()
_lock = threading.Lock()
_registered = False


def stop_at_exit(owner: StoppedAtExit) -> None:
    """Has ``owner.stop_for_exit()`` called at interpreter exit while ``owner`` is alive (it is held
    weakly: a garbage-collected owner stopped its thread itself)."""
    global _registered
    with _lock:
        if not _registered:
            atexit.register(_stop_all)
            _registered = True
        _live.add(owner)


def _stop_all() -> None:
    with _lock:
        owners = list(_live)
    for owner in owners:
        owner.stop_for_exit()
