"""fastload's background threads stopped before the interpreter finalises.

A daemon thread ended at exit inside torch's C++ code aborts the process ("terminate called
without an active exception"), so the threads fastload runs beside the loop register here, and
one ``atexit`` handler stops them all and waits at most :data:`EXIT_WAIT_SECONDS` in all.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
import weakref
from typing import Protocol

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
    """Has ``owner``'s thread stopped and joined at interpreter exit while ``owner`` (held weakly)
    is alive. Call it once the thread has started."""
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
