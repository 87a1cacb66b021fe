"""A script that ends while fastload's background threads are busy exits cleanly (``fastload._exit``).

Each case runs a real script in a new interpreter that leaves while a thread of fastload's is
inside torch (a pass's iterator kept in a variable, a ring still being page-locked): without the
exit handler the interpreter ends that thread inside torch's C++ code and the process aborts
("terminate called without an active exception", exit status 134).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

#: A device transform that keeps its thread inside torch for about a second per batch.
BUSY_TRANSFORM = """
import time
import torch

def busy(images, **_):
    end = time.monotonic() + 0.6
    x = torch.zeros(64)
    while time.monotonic() < end:
        x.add_(1)
    return images
"""


def _run(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=TESTS,  # the tests' helpers import from here
    )


def _assert_clean(run: subprocess.CompletedProcess[str]) -> None:
    assert run.returncode == 0, run.stderr[-2000:]
    assert "terminate called" not in run.stderr
    assert run.stdout.strip().endswith("left")


@pytest.mark.parametrize("decode", ["device", "hybrid"])
def test_a_script_that_leaves_a_device_pass_open_exits_cleanly(imagenet_root: Path, decode: str) -> None:
    # The feeder is preparing the next batches when the script ends (the hybrid's split pinned at
    # nothing for the CPU workers, so that its device side runs too).
    run = _run(
        BUSY_TRANSFORM
        + f"""
import fastload
from fastload import gpu

loader = fastload.DataLoader(
    fastload.InMemoryImageFolder({str(imagenet_root / "train")!r}),
    batch_size=4, num_workers=1, decode={decode!r}, device="cpu",
    gpu_transforms=gpu.Compose([gpu.RandomResizedCrop(8), busy]),
)
if loader.hybrid is not None:
    loader.hybrid.cpu_share = 0.0
it = iter(loader)
images, labels = next(it)
assert images.shape == (4, 3, 8, 8) and loader.path == {decode if decode == "hybrid" else "device-decode"!r}
print("left")
"""
    )
    _assert_clean(run)


def test_a_script_that_leaves_a_fed_fast_pass_open_exits_cleanly(imagenet_root: Path) -> None:
    # The fast path on a (stand-in) CUDA device copies and transforms in its feeder thread.
    run = _run(
        BUSY_TRANSFORM
        + f"""
import threading
from _fakecuda import fake_cuda
import fastload
from fastload import transforms as T

cuda = fake_cuda()
cuda.__enter__()
loader = fastload.DataLoader(
    fastload.ImageFolder({str(imagenet_root / "train")!r}, transform=T.Compose([T.RandomResizedCrop(16)])),
    batch_size=4, num_workers=1, device="cpu", pin_memory=True, gpu_transforms=busy,
)
it = iter(loader)
next(it)
assert loader.fast_path and any(t.name == "fastload-feeder" for t in threading.enumerate())
print("left")
"""
    )
    _assert_clean(run)


def test_a_script_that_ends_while_a_ring_is_page_locked_exits_cleanly() -> None:
    # Each lock keeps the locking thread inside torch for a while; the script ends after the first.
    run = _run(
        """
import time
import torch
from _fakecuda import FakeHost
from fastload.gpu.memory import PageLock

class SlowHost(FakeHost):
    def register(self, t):
        end = time.monotonic() + 0.5
        x = torch.zeros(64)
        while time.monotonic() < end:
            x.add_(1)
        return super().register(t)

host = SlowHost()
ring = [torch.zeros(1 << 20, dtype=torch.uint8) for _ in range(20)]  # a page each
lock = PageLock(ring, host)
assert lock.wait(0)
print("left")
"""
    )
    _assert_clean(run)


def test_feeders_blocked_for_good_delay_the_exit_once_not_each() -> None:
    # Three feeders whose batch waits on something that never comes: every thread is told to stop
    # first, then all are waited for together (at most EXIT_WAIT_SECONDS in all, not each).
    run = _run(
        """
import atexit, threading, time
import torch
from fastload import _exit
from fastload.gpu.feeder import DeviceFeeder

_exit.EXIT_WAIT_SECONDS = 2.0
marks = {}
atexit.register(lambda: print(f"waited {time.monotonic() - marks['exit']:.2f}", flush=True))  # runs last
never = threading.Event()

def prepare(k):
    never.wait()
    return torch.zeros(1)

feeders = [DeviceFeeder(prepare, 10, 0, torch.device("cpu")) for _ in range(3)]
atexit.register(lambda: marks.update(exit=time.monotonic()))  # runs first
print("left")
"""
    )
    assert run.returncode == 0 and "terminate called" not in run.stderr, run.stderr[-2000:]
    left, waited = run.stdout.split("\n")[:2]
    assert left == "left" and 1.5 < float(waited.split()[1]) < 4.0, run.stdout  # each: 6 s or more


def test_a_forked_child_does_not_stop_its_parents_threads_at_its_exit() -> None:
    # The child forgets the parent's feeders: its exit neither waits for them nor touches their
    # locks (here one held by another thread of the parent when it forked: in the child, held for
    # good).
    run = _run(
        """
import os, sys, threading, time
import torch
from fastload import _exit
from fastload.gpu.feeder import DeviceFeeder

feeder = DeviceFeeder(lambda k: torch.zeros(1), None, 0, torch.device("cpu"))
held = threading.Event()

def hold():
    with feeder._queue.mutex:
        held.set()
        time.sleep(3)

threading.Thread(target=hold, daemon=True).start()
held.wait()
pid = os.fork()
if pid == 0:
    assert len(_exit._live) == 0
    sys.exit(0)  # a normal exit: the atexit handlers run
deadline = time.monotonic() + 30  # a child stuck on the lock (held there for good) never exits
while True:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done or time.monotonic() > deadline:
        break
    time.sleep(0.05)
if not done:
    os.kill(pid, 9)
    os.waitpid(pid, 0)
assert done and status == 0, "the forked child did not exit"
feeder.close()
print("left")
"""
    )
    _assert_clean(run)
