"""Processes: killed workers, Ctrl-C, many interrupted passes, long runs, errors in user code.

Covered elsewhere (not repeated here):

* SIGKILL of the parent: no worker alive after 10 s, for fork, spawn and forkserver:
  ``tests/test_iterator.py::test_no_worker_outlives_a_killed_parent``; thread workers and
  process workers stop at interpreter exit even when SIGTERM is ignored:
  ``tests/test_iterator.py::test_process_exits_although_sigterm_is_ignored``; thread workers stop
  when loader and iterator are dropped:
  ``tests/test_iterator.py::test_thread_workers_stop_when_loader_and_iterator_are_dropped``.
* An unpicklable sample is a named error for its batch, no hang (fork, spawn, forkserver):
  ``tests/test_torch_contract.py::test_a_batch_a_worker_cannot_send_is_a_named_error_not_a_hang``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import traceback
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from fastload.imagefolder import ImageFolder
from fastload.loader import DataLoader

from ._faults import slope, train_tf


@pytest.fixture(scope="module")
def train_set(imagenet_root: Path) -> ImageFolder:
    return ImageFolder(imagenet_root / "train", transform=train_tf())


def _pass(loader: DataLoader[object]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x.clone(), y.clone()) for x, y in loader]


def _same(a: list[tuple[torch.Tensor, torch.Tensor]], b: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    if len(a) != len(b):
        return False
    return all(torch.equal(x, u) and torch.equal(y, v) for (x, y), (u, v) in zip(a, b, strict=True))


class _SlowFolder(ImageFolder):
    """Reads take 20 ms: a killed worker surely dies with a batch in hand."""

    def get_bytes(self, i: int) -> bytes:
        time.sleep(0.02)
        return super().get_bytes(i)


def test_sigkill_of_a_worker_is_an_error_and_the_next_epoch_runs(train_set: ImageFolder) -> None:
    slow = _SlowFolder(train_set.root, transform=train_tf())
    loader = DataLoader(slow, batch_size=2, num_workers=2, seed=0)
    reference = DataLoader(train_set, batch_size=2, num_workers=0, seed=0)
    reference.set_epoch(1)
    expected = _pass(reference)
    before = {p.pid for p in psutil.Process().children()}  # other tests' pools may still be alive
    it = iter(loader)
    next(it)
    workers = [p for p in psutil.Process().children() if p.pid not in before]
    assert len(workers) == 2
    os.kill(workers[0].pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"worker .*killed by signal 9") as info:
        for _ in it:
            pass
    assert time.monotonic() - t0 < 30, "the dead worker was noticed too late"
    assert "DataLoader worker" in str(info.value) and "use fewer workers" in str(info.value)
    del it, info  # the failed pass ends (as when a training loop's `for` is left by the error)
    assert loader.epoch == 1
    assert _same(_pass(loader), expected)  # epoch 1, with new workers, complete and exact
    loader.close()
    reference.close()


CTRL_C = textwrap.dedent(
    """
    import signal, sys, time
    import psutil, torch
    from fastload import transforms as T
    from fastload.imagefolder import ImageFolder
    from fastload.loader import DataLoader

    if __name__ == "__main__":
        # as in a terminal, whatever the test runner inherited (a shell's background job ignores SIGINT)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        ds = ImageFolder(sys.argv[1], transform=T.Compose([T.RandomResizedCrop(16)]))
        loader = DataLoader(ds, batch_size=4, num_workers=2, seed=0)
        try:
            for k, batch in enumerate(loader):
                if k == 2:
                    print("mid-pass", flush=True)
                    time.sleep(60)  # Ctrl-C arrives here
            print("not interrupted", flush=True)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        new = [(x.clone(), y.clone()) for x, y in loader]  # the next pass: epoch 1
        reference = DataLoader(ds, batch_size=4, num_workers=0, seed=0)
        reference.set_epoch(1)
        expected = [(x.clone(), y.clone()) for x, y in reference]
        same = len(new) == len(expected) == 8 and all(
            torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(new, expected)
        )
        print("new pass", "exact" if same else "DIFFERS", len(psutil.Process().children()), flush=True)
    """
)


def test_ctrl_c_during_a_pass_then_a_new_pass(imagenet_root: Path, tmp_path: Path) -> None:
    """SIGINT to the whole process group (what a terminal's Ctrl-C does: workers get it too)."""
    script = tmp_path / "ctrl_c.py"
    script.write_text(CTRL_C)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(imagenet_root / "train")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "mid-pass", line + proc.stderr.read()  # type: ignore[union-attr]
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err
    lines = out.split("\n")
    assert lines[0] == "interrupted", out + err
    assert lines[1] == "new pass exact 2", out + err  # the two workers serve the new pass


def _probe(root: Path, scenario: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Runs ``scenario`` of ``_leak_probe.py`` in a fresh process: its per-step snapshots and the
    state after ``loader.close()``."""
    out = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("_leak_probe.py")), str(root), scenario],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    return lines[:-1], lines[-1]


def _resources_are_flat(steps: list[dict[str, Any]]) -> None:
    first, last = steps[0], steps[-1]
    for key in ("fds", "threads"):
        assert last[key] <= first[key], f"{key}: {first[key]} -> {last[key]}"
    kids = (first["children"], last["children"])
    assert len(kids[1]) <= len(kids[0]), f"children: {kids[0]} -> {kids[1]}"
    new_shm = sorted(set(last["shm"]) - set(first["shm"]))
    assert not new_shm, f"/dev/shm entries: {new_shm}"
    # Private (written) memory of the process tree, over the second half: a leak grows steadily,
    # allocator warm-up happens early. RSS is reported, not bounded: it also counts shared-library
    # pages a worker maps the first time it runs a code path (about 9 MB at once, measured).
    private = [s["private_dirty"] for s in steps]
    growth = slope(private[len(private) // 2 :]) * len(private)
    rss = [s["rss"] for s in steps]
    assert growth < 16e6, (
        f"private memory grows by {growth / 1e6:.1f} MB over {len(steps)} steps "
        f"({private[0] / 1e6:.0f} -> {private[-1] / 1e6:.0f} MB; "
        f"RSS {rss[0] / 1e6:.0f} -> {rss[-1] / 1e6:.0f} MB)"
    )


@pytest.mark.parametrize(
    "scenario",
    [
        "breaks-process-persistent",
        "breaks-thread",
        pytest.param("breaks-process-new", marks=pytest.mark.slow),
    ],
)
def test_100_breaks_mid_epoch_leak_nothing(imagenet_root: Path, scenario: str) -> None:
    """100 passes left after two batches (persistent process workers, thread workers, new process
    workers each pass): no fd, thread, child, /dev/shm entry or private memory accumulates, and
    ``close()`` ends every worker."""
    steps, closed = _probe(imagenet_root / "train", scenario)
    assert len(steps) == 90
    _resources_are_flat(steps)
    assert closed == {"children_after_close": []}


def test_30_epochs_with_persistent_workers_keep_memory_flat(imagenet_root: Path) -> None:
    steps, closed = _probe(imagenet_root / "train", "epochs")  # the probe checks every epoch's size
    assert len(steps) == 20
    _resources_are_flat(steps)
    assert closed == {"children_after_close": []}


# ------------------------------------------------------------------------------ errors in user code


class _Store(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """A user dataset whose ``__getitem__`` fails for one index."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if i == 5:
            raise ConnectionError(f"object store unreachable for item {i}")
        return torch.zeros(2), i


class _RemoteFolder(ImageFolder):
    """A fast-path dataset whose ``get_bytes`` (user code) fails for one sample."""

    def get_bytes(self, i: int) -> bytes:
        if i == 5:
            raise ConnectionError(f"object store unreachable for sample {i}")
        return super().get_bytes(i)


def _failure(loader: object) -> BaseException:
    try:
        for _ in loader:  # type: ignore[attr-defined]
            pass
    except Exception as e:  # noqa: BLE001 - the error is what the test inspects
        return e
    raise AssertionError("no error")


@pytest.mark.parametrize("path", ["torch", "fast"])
def test_exception_in_user_code_keeps_type_message_and_traceback(imagenet_root: Path, path: str) -> None:
    if path == "torch":
        ds: object = _Store()
        torch_error = _failure(torch.utils.data.DataLoader(ds, batch_size=2, num_workers=2))
    else:
        ds = _RemoteFolder(imagenet_root / "train", transform=train_tf())
    error = _failure(DataLoader(ds, batch_size=2, num_workers=2, persistent_workers=False))
    assert type(error) is ConnectionError
    text = "".join(traceback.format_exception(error))
    assert "object store unreachable" in str(error)
    # The worker's traceback: the user's function and the line that raised.
    where = "__getitem__" if path == "torch" else "get_bytes"
    assert f"in {where}" in text and 'raise ConnectionError(f"object store unreachable' in text, text
    assert "worker" in text
    if path == "torch":  # the same as torch's own loader
        assert type(torch_error) is type(error) and str(torch_error) == str(error)
