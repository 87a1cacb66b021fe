"""Runs one long loader scenario in a fresh process and prints what the process tree holds.

The leak checks of the fault suite run here, not in the pytest process: there, other tests' worker
pools may still be alive among the children, and what hundreds of earlier tests left on the heap
makes the process's memory move for reasons that are not the loader's. A fresh process measures
what a training script would see.

Usage: ``python _leak_probe.py ROOT SCENARIO`` where ``SCENARIO`` is ``breaks-process-persistent``,
``breaks-process-new``, ``breaks-thread`` or ``epochs``. Prints one JSON object per measured step.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).parent))

from _faults import train_tf  # noqa: E402

from fastload.imagefolder import ImageFolder  # noqa: E402
from fastload.loader import DataLoader  # noqa: E402

#: Steps before measuring starts: the buffers, workers and caches of the first passes exist by then.
WARMUP = 10


def _private_dirty(pid: int) -> int:
    """Bytes only this process has written (``Private_Dirty`` of ``/proc/<pid>/smaps_rollup``).

    Unlike RSS, this is what a leak grows: RSS also counts the pages of shared libraries a process
    first executes (a worker running a new code path maps megabytes of libtorch) and pages it shares
    with others, which it costs nothing to map again.
    """
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Private_Dirty:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no Private_Dirty in /proc/{pid}/smaps_rollup")


def snapshot() -> dict[str, object]:
    me = psutil.Process()
    kids = [p for p in me.children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]
    pids = {str(me.pid), *(str(p.pid) for p in kids)}
    names = os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []
    private = rss = 0
    for p in [me, *kids]:
        try:
            private += _private_dirty(p.pid)
            rss += p.memory_info().rss
        except (OSError, psutil.Error):  # a worker that exited in between
            pass
    return {
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": threading.active_count(),
        "children": sorted(p.pid for p in kids),
        "shm": sorted(n for n in names if pids & set(n.replace("-", "_").split("_"))),
        "private_dirty": private,
        "rss": rss,
    }


def main(root: str, scenario: str) -> None:
    dataset = ImageFolder(root, transform=train_tf())
    if scenario == "epochs":  # whole shuffled epochs, persistent workers
        loader = DataLoader(dataset, batch_size=4, num_workers=2, shuffle=True, seed=0)
        steps, stop_after = 30, None
    else:  # passes left after two batches
        worker_type, _, kind = scenario.removeprefix("breaks-").partition("-")
        loader = DataLoader(
            dataset,
            batch_size=4,
            num_workers=2,
            worker_type=worker_type,
            persistent_workers=kind == "persistent",
        )
        steps, stop_after = 100, 1
    for k in range(steps):
        n = 0
        for j, (_, y) in enumerate(loader):
            n += len(y)
            if j == stop_after:
                break
        if stop_after is None and n != len(dataset):
            raise AssertionError(f"epoch {k} gave {n} samples, not {len(dataset)}")
        if k >= WARMUP:
            print(json.dumps(snapshot()), flush=True)
    loader.close()
    deadline = time.monotonic() + 10  # closed: every worker is gone soon after
    while psutil.Process().children(recursive=True) and time.monotonic() < deadline:
        time.sleep(0.1)
    print(json.dumps({"children_after_close": [p.pid for p in psutil.Process().children(recursive=True)]}))


if __name__ == "__main__":
    main(*sys.argv[1:])
