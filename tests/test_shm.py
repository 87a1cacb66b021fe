"""A container's small /dev/shm: fastload's batch memory is memfd-backed (fastload._shm).

Measured for real: the loaders run in a subprocess inside a private mount namespace whose
/dev/shm is a 16 MB tmpfs (smaller than one batch: 32 float32 images of 224 px are 19 MB), as a
container's 64 MB one is smaller than a batch of 256. Skipped where this process may not mount.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from fastload import _shm

SCRIPT = str(Path(__file__).with_name("_shm_run.py"))
SMALL = "16m"


def _run(root: Path, method: str, small: bool, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, SCRIPT, str(root), method, "32", "224", *extra]
    if small:
        mount = f'mount -t tmpfs -o size={SMALL} tmpfs /dev/shm && exec "$@"'
        cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c", mount, "sh", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)


@pytest.fixture(scope="module")
def small_shm() -> None:
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) to mount a small /dev/shm in a private mount namespace")
    probe = subprocess.run(
        [
            "unshare",
            "-m",
            "--propagation",
            "private",
            "sh",
            "-c",
            f"mount -t tmpfs -o size={SMALL} tmpfs /dev/shm",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if probe.returncode != 0:
        pytest.skip(f"this process may not mount a tmpfs in a new mount namespace: {probe.stderr.strip()}")


@pytest.fixture(scope="module")
def reference(imagenet_root: Path) -> dict[str, Any]:
    """The batches with this machine's large /dev/shm."""
    done = _run(imagenet_root, "fork", small=False)
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


PATHS = {"fast": "fast", "head": "head-accelerated", "head+collate": "head-accelerated", "torch": "torch"}


@pytest.mark.parametrize(
    ("method", "cases"), [("fork", tuple(PATHS)), ("spawn", ("fast", "head+collate", "torch"))]
)
def test_every_path_runs_two_epochs_in_a_small_dev_shm(
    imagenet_root: Path, small_shm: None, reference: dict[str, Any], method: str, cases: tuple[str, ...]
) -> None:
    """The fast path, head acceleration (default_collate and a user collate_fn) and torch's
    iterator inside fastload.DataLoader: the same batches as with a large /dev/shm. With spawn
    (new workers each of the two epochs, each importing torch and torchvision: about 7 s a case
    here) the head path with default_collate is left out: it reaches the ring as the one with a
    collate_fn does; what spawn changes is how workers attach to the memory, the same on every path."""
    done = _run(imagenet_root, method, True, ",".join(cases))
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert {name: r["path"] for name, r in got.items()} == {name: PATHS[name] for name in cases}
    assert got == {name: reference[name] for name in cases}


def test_torchs_own_loader_fails_there(imagenet_root: Path, small_shm: None) -> None:
    """The control: the same batches through torch.utils.data.DataLoader do not fit."""
    done = _run(imagenet_root, "fork", True, "torch")
    assert done.returncode != 0
    assert "shared memory" in done.stderr or "No space left" in done.stderr or "Bus error" in done.stderr


def test_where_dev_shm_is_still_used_the_error_says_so(imagenet_root: Path, small_shm: None) -> None:
    """torch's file_system sharing strategy shares by name, in /dev/shm: a batch that does not fit
    is an error naming /dev/shm, its size and the fix, not torch's raw allocator error."""
    done = _run(imagenet_root, "fork", True, "file_system")
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["error"] == "RuntimeError", got
    assert got["message"].startswith("shared memory ran out: /dev/shm is 16 MB"), got
    assert "--shm-size" in got["message"]


def test_shm_error_names_dev_shm_and_the_fix() -> None:
    error = RuntimeError(
        "Caught RuntimeError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
        "RuntimeError: unable to allocate shared memory(shm) for file </torch_1_2_3>: "
        "No space left on device (28)"
    )
    hint = _shm.shm_error(error, needed=154 * 2**20)
    assert hint is not None
    text = str(hint)
    assert "/dev/shm is" in text and "--shm-size" in text and "154 MB" in text and "No space left" in text
    assert _shm.shm_error(RuntimeError("something else")) is None
    # torch 2.1: the worker dies of a bus error; the loop gets "exited unexpectedly" raised from it
    try:
        try:
            raise RuntimeError(
                "DataLoader worker (pid 909) is killed by signal: Bus error. It is possible that "
                "dataloader's workers are out of shared memory. Please try to raise your shared memory limit."
            )
        except RuntimeError as e:
            raise RuntimeError("DataLoader worker (pid(s) 909) exited unexpectedly") from e
    except RuntimeError as e:
        chained = _shm.shm_error(e)
    assert (
        chained is not None
        and "/dev/shm is" in str(chained)
        and "killed by signal: Bus error" in str(chained)
    )


def test_memfd_tensors_are_shared_by_descriptor() -> None:
    t = _shm.shared_empty((4, 5), torch.float32)
    assert t.is_shared() and t.is_contiguous() and t.shape == (4, 5)
    if _shm.memfd_available():
        assert _shm.describe(t.untyped_storage()) == "memfd"
