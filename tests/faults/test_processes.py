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

import os
import signal
import subprocess
import sys
import textwrap
import time
import traceback
from pathlib import Path

import psutil
import pytest
import torch

from fastload.folder import ImageFolder
from fastload.loader import DataLoader

from ._faults import Held, slope, train_tf, tree_rss


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
    import sys, time
    import psutil, torch
    from fastload import transforms as T
    from fastload.folder import ImageFolder
    from fastload.loader import DataLoader

    if __name__ == "__main__":
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


def _resources_are_flat(samples: list[Held], rss: list[float]) -> None:
    first, last = samples[0], samples[-1]
    assert last.fds <= first.fds, f"file descriptors: {first.fds} -> {last.fds}"
    assert last.threads <= first.threads, f"threads: {first.threads} -> {last.threads}"
    assert len(last.children) <= len(first.children), f"children: {first.children} -> {last.children}"
    assert last.shm <= first.shm, f"/dev/shm entries: {sorted(last.shm - first.shm)}"
    # the slope of the second half: a leak grows steadily; allocator warm-up happens early
    growth = slope(rss[len(rss) // 2 :]) * len(rss)
    assert growth < 16e6, f"RSS grows by {growth / 1e6:.1f} MB over {len(rss)} steps"


@pytest.mark.parametrize(
    ("worker_type", "persistent", "breaks"),
    [
        pytest.param(
            "process",
            True,
            100,
            marks=pytest.mark.xfail(
                reason="open (#15): in a full-suite run RSS grew 18-96 MB over 90 breaks (passes alone); "
                "not yet known whether it is a leak",
                strict=False,
            ),
        ),
        ("thread", False, 100),
    ],
)
def test_100_breaks_mid_epoch_leak_nothing(
    train_set: ImageFolder, worker_type: str, persistent: bool, breaks: int
) -> None:
    loader = DataLoader(
        train_set, batch_size=4, num_workers=2, worker_type=worker_type, persistent_workers=persistent
    )
    samples: list[Held] = []
    rss: list[float] = []
    for k in range(breaks):
        for j, _ in enumerate(loader):
            if j == 1:
                break
        if k >= 10:  # after the buffers, workers and caches of the first passes exist
            samples.append(Held.now())
            rss.append(tree_rss())
    _resources_are_flat(samples, rss)
    loader.close()


@pytest.mark.slow
def test_100_breaks_with_new_process_workers_each_pass(train_set: ImageFolder) -> None:
    before = Held.now()
    loader = DataLoader(train_set, batch_size=4, num_workers=2, persistent_workers=False)
    samples: list[Held] = []
    rss: list[float] = []
    for k in range(100):
        for j, _ in enumerate(loader):
            if j == 1:
                break
        if k >= 10:
            samples.append(Held.now())
            rss.append(tree_rss())
    _resources_are_flat(samples, rss)
    loader.close()
    deadline = time.monotonic() + 10
    while Held.now().children - before.children and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Held.now().children - before.children


def test_30_epochs_with_persistent_workers_keep_rss_flat(train_set: ImageFolder) -> None:
    loader = DataLoader(train_set, batch_size=4, num_workers=2, shuffle=True, seed=0)
    rss: list[float] = []
    for epoch in range(30):
        assert sum(len(y) for _, y in loader) == len(train_set)
        if epoch >= 5:
            rss.append(tree_rss())
    growth = slope(rss[len(rss) // 2 :]) * len(rss)  # past the warm-up, as above
    assert growth < 16e6, f"RSS grows by {growth / 1e6:.1f} MB over 25 epochs"
    loader.close()


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
