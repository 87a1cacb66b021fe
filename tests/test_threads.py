"""torch's thread count with several loaders alive at once (``limit_threads``, ``fastload._threads``).

Each case runs in a new interpreter, so that no loader of another test (kept by a fixture, or
waiting for the garbage collector) holds a cap meanwhile. The CPU count the caps are taken from
is set to 8 there, so that loaders with 1 and 3 real workers cap at 7 and 5 on any machine.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PRELUDE = """
import gc, sys, torch
import fastload._engine
from fastload import DataLoader, ImageFolder, transforms as T
from fastload._threads import held_caps

fastload._engine.available_cpus = lambda: 8
ds = ImageFolder(sys.argv[1], transform=T.Compose([T.RandomResizedCrop(32), T.RandomHorizontalFlip()]))

def loader(workers, **kw):
    return DataLoader(ds, batch_size=8, num_workers=workers, **kw)

def run(a_loader):
    assert sum(len(y) for _, y in a_loader) == len(ds)

def threads(expected, where):
    got = torch.get_num_threads()
    assert got == expected, f"{where}: torch has {got} threads, expected {expected} (caps {held_caps()})"

torch.set_num_threads(16)
"""


def _run(root: Path, script: str) -> None:
    code = textwrap.dedent(PRELUDE) + textwrap.dedent(script) + "\nprint('ok')\n"
    run = subprocess.run(
        [sys.executable, "-c", code, str(root)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


@pytest.fixture(scope="module")
def train_root(imagenet_root: Path) -> Path:
    return imagenet_root / "train"


def test_the_smallest_cap_holds_until_the_last_loader_stops_in_either_order(train_root: Path) -> None:
    _run(
        train_root,
        """
        for first_closed in ("small", "large"):
            train, val = loader(1), loader(3)  # caps 7 and 5
            run(train)
            threads(7, "one loader")
            run(val)
            threads(5, "both alive")
            if first_closed == "small":  # the loader with the smaller cap stops first
                val.close()
                threads(7, "the training loader's workers still run")
                train.close()
            else:
                train.close()
                threads(5, "the validation loader's workers still run")
                val.close()
            threads(16, f"both closed ({first_closed} first)")
            assert held_caps() == []
        """,
    )


def test_a_collected_loader_and_a_pass_without_persistent_workers_end_their_hold(train_root: Path) -> None:
    _run(
        train_root,
        """
        train = loader(1)
        run(train)
        run(loader(3, persistent_workers=False))  # its workers stop with its pass
        threads(7, "after a pass without persistent workers")
        run(loader(3))  # dropped at once: collected
        gc.collect()
        threads(7, "after a collected loader")
        del train
        gc.collect()
        threads(16, "every loader collected")
        assert held_caps() == []
        """,
    )


def test_a_count_the_user_sets_while_caps_are_held_is_kept(train_root: Path) -> None:
    _run(
        train_root,
        """
        train, val = loader(1), loader(3)
        run(train)
        torch.set_num_threads(3)  # the user's count, under every cap
        run(val)
        threads(3, "a cap never raises the user's count")
        val.close()
        train.close()
        threads(3, "the user's count stays after the last close")
        torch.set_num_threads(12)
        run(train)  # a new pass holds again, from the user's new count
        threads(7, "a new hold")
        torch.set_num_threads(10)  # above the cap, set while it is held
        run(val)
        threads(5, "a new hold lowers it to its cap")
        val.close()
        threads(7, "the other loader's cap")
        train.close()
        threads(10, "given back: the count the user set last")
        """,
    )


def test_a_forked_child_holds_nothing(train_root: Path) -> None:
    _run(
        train_root,
        """
        import os
        train = loader(1)
        run(train)
        pid = os.fork()
        if pid == 0:
            os._exit(0 if held_caps() == [] else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the child still held its parent's caps"
        train.close()
        threads(16, "closed")
        """,
    )
