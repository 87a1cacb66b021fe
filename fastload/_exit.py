"""fastload's background threads stopped before the interpreter finalises.

At interpreter exit, CPython ends a daemon thread the moment it next takes the interpreter's lock.
A thread that is inside torch's C++ code then (a tensor freed, an operation returning) is unwound
through frames that do not allow it, and the whole process aborts -- "terminate called without
an active exception", exit status 134 -- after the user's script ended well. A script that keeps
a pass's iterator in a variable (``it = iter(loader)``) and leaves while the device feeder is
preparing the next batch did exactly that. So the threads fastload runs beside the user's loop
register here, and one ``atexit`` handler stops them first (``atexit`` handlers run before the
interpreter starts ending daemon threads; the thread pools' own exit handler has run by then, so a
thread that submits work to one gets an error, which it keeps for a ``next()`` that never comes).

Every thread is told to stop first, then all are waited for together, at most
:data:`EXIT_WAIT_SECONDS` in all: each finishes what it is doing (a batch being prepared, a lock
under way). One blocked for good (its batch waits on something that never comes) is left to the
interpreter after that, as before. A forked child forgets the parent's threads (they do not exist
there).

Nothing here imports torch.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
import weakref
from typing import Protocol

__all__ = ["EXIT_WAIT_SECONDS", "StoppedAtExit", "stop_at_exit"]

#: The longest the interpreter's exit waits for all of fastload's threads together.
EXIT_WAIT_SECONDS = 10.0


class StoppedAtExit(Protocol):
    """An object whose background thread :func:`stop_at_exit` stops at interpreter exit."""

    def stop_for_exit(self) -> threading.Thread | None:
        """Tells the thread to stop, without waiting; returns it (to be joined), or ``None``."""
        ...


_live: weakref.WeakSet[StoppedAtExit] = weakref.WeakSet()
_lock = threading.Lock()
_registered = False


def stop_at_exit(owner: StoppedAtExit) -> None:
    """Has ``owner``'s thread stopped and joined at interpreter exit while ``owner`` is alive (it
    is held weakly: a garbage-collected owner stopped its thread itself). Call it once the thread
    has started."""
    global _registered
    with _lock:
        if not _registered:
            atexit.register(_stop_all)
            if hasattr(os, "register_at_fork"):
                os.register_at_fork(after_in_child=_forget_in_child)
            _registered = True
        _live.add(owner)


def _forget_in_child() -> None:
    """In a forked child: the parent's threads are not there (and their locks may be held)."""
    global _lock
    _lock = threading.Lock()
    _live.clear()


def _stop_all() -> None:
    with _lock:
        owners = list(_live)
    threads = []
    for owner in owners:
        with contextlib.suppress(Exception):  # one owner's failure must not keep the others running
            thread = owner.stop_for_exit()
            if thread is not None and thread is not threading.current_thread():
                threads.append(thread)
    deadline = time.monotonic() + EXIT_WAIT_SECONDS
    for thread in threads:
        with contextlib.suppress(Exception):
            thread.join(max(0.0, deadline - time.monotonic()))
