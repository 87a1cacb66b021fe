"""torch's thread count with several loaders alive at once (``limit_threads``, ``fastload._threads``).

Each case runs in a new interpreter, so that no loader of another test (kept by a fixture, or
waiting for the garbage collector) holds a cap meanwhile. The process's share of the CPUs the caps
are taken from is set to 8 there, so that loaders with 1 and 3 real workers cap at 7 and 5 on any
machine.
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

fastload._engine.cpu_share = lambda: 8
ds = ImageFolder(sys.argv[1], transform=T.Compose([T.RandomResizedCrop(32), T.RandomHorizontalFlip()]))

class Plain(torch.utils.data.Dataset):  # not a dataset fastload reads itself: torch's iterator
    def __len__(self):
        return 32

    def __getitem__(self, i):
        return torch.full((3,), float(i)), i

class Counted(Plain):  # a dataset's own state (a counter): torch's default new workers each pass
    calls = 0

    def __getitem__(self, i):
        self.calls += 1
        return super().__getitem__(i)

def loader(workers, dataset=ds, **kw):
    return DataLoader(dataset, batch_size=8, num_workers=workers, **kw)

def run(a_loader):
    assert sum(len(y) for _, y in a_loader) == len(a_loader.dataset)

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
        # torch's own iterator (a dataset fastload does not read itself): torch's default, no cap
        it = iter(loader(3, Plain()))
        next(it)
        threads(7, "torch's workers running without a cap asked for")
        del it
        # the same with a cap asked for
        plain = loader(3, Plain(), persistent_workers=False, limit_threads=True)
        it = iter(plain)
        next(it)
        threads(5, "torch's workers running")
        del it
        threads(7, "torch's workers stopped with the pass dropped")
        run(plain)
        threads(7, "torch's workers stopped with the pass's end")
        run(loader(0, Plain()))
        threads(7, "no workers, the pass ended")
        persistent = loader(3, Plain(), persistent_workers=True, limit_threads=True)
        run(persistent)
        threads(5, "torch's persistent workers alive")
        persistent.close()
        del train
        gc.collect()
        threads(16, "every loader closed or collected")
        assert held_caps() == []
        """,
    )


def test_a_count_the_user_sets_meanwhile_is_kept_and_given_back(train_root: Path) -> None:
    _run(
        train_root,
        """
        train, val = loader(1), loader(3)
        run(train)
        torch.set_num_threads(3)  # the user's count, under every cap
        run(val)
        threads(3, "a hold never raises the user's count")
        val.close()
        threads(3, "a hold ended: still the user's count, under the cap still held")
        train.close()
        threads(3, "the user's latest count, not the one before the first hold")
        torch.set_num_threads(12)
        run(train)
        threads(7, "a new first hold")
        torch.set_num_threads(64)  # above the cap: lowered at the next pass start ...
        run(train)
        threads(7, "capped again")
        train.close()
        threads(64, "... and given back")
        """,
    )


def test_a_hold_ended_on_another_thread_does_not_undo_a_later_count(train_root: Path) -> None:
    # A loader closed (or collected) on another thread ends its hold there; this thread's count
    # is set at its next hold or release, from the count the user set meanwhile
    _run(
        train_root,
        """
        import threading

        train = loader(1)
        run(train)
        threads(7, "held")
        closing = threading.Thread(target=train.close)
        closing.start()
        closing.join()
        assert held_caps() == []
        torch.set_num_threads(64)
        val = loader(3)
        run(val)
        threads(5, "a new hold")
        val.close()
        threads(64, "the count the user set after the other thread's release")
        """,
    )


@pytest.mark.parametrize("kept", [True, False], ids=["persistent", "new-workers-each-pass"])
def test_a_peek_on_torchs_iterator_has_a_cap_of_its_own(train_root: Path, kept: bool) -> None:
    # next(iter(loader)) inside the loop (torch's iterator, a cap asked for): the peek runs on
    # workers of its own where the workers are not kept; its end must not end the cap of the
    # loop's workers
    _run(
        train_root,
        f"""
        train = loader(1, dataset=Counted(), limit_threads=True, persistent_workers={kept})
        assert train.persistent_workers is {kept} and not train.fast_path
        it = iter(train)
        next(it)
        threads(7, "the loop's pass")
        if not {kept}:
            next(iter(train))
            gc.collect()
            threads(7, "the peek ended; the loop's workers still run")
        for _ in it:
            pass
        threads({7 if kept else 16}, "the loop's pass ended (its workers stay only if kept)")
        train.close()
        threads(16, "closed")
        """,
    )


def test_loaders_iterated_on_two_threads_each_cap_their_own(train_root: Path) -> None:
    # torch's OpenMP count can be a thread's own: each thread's holds set its own count only
    _run(
        train_root,
        """
        import threading

        def on_thread(work):
            thread = threading.Thread(target=work)
            thread.start()
            thread.join()

        train, val = loader(1), loader(3)
        run(train)
        seen = []
        on_thread(lambda: (run(val), seen.append(held_caps())))
        assert seen == [[5]] and held_caps() == [7], (seen, held_caps())
        threads(7, "the training thread keeps its own cap")
        train.close()
        threads(16, "the training thread's last hold ended")
        on_thread(val.close)
        threads(16, "the other thread's loader closed there")
        assert held_caps() == []
        """,
    )


def test_a_loader_collected_inside_a_hold_ends_its_hold(train_root: Path) -> None:
    # The garbage collector may run at any allocation, also inside the registry's own calls: a
    # loader it collects there (its close() and finalizer) releases once that call is done.
    _run(
        train_root,
        """
        import fastload._threads as registry

        train = loader(1)
        run(train)
        val = loader(3)
        val.itself = val  # a cycle: collected by the collector only
        run(val)
        del val
        threads(5, "both held")
        real = torch.get_num_threads
        armed = [True]

        def collecting():
            if armed[0]:
                armed[0] = False
                gc.collect()  # the validation loader is collected here, inside the hold
            return real()

        registry.torch = type("T", (), {"get_num_threads": staticmethod(collecting),
                                        "set_num_threads": staticmethod(torch.set_num_threads)})
        run(train)  # its next pass: a hold
        registry.torch = torch
        assert not armed[0]
        threads(7, "the collected loader's hold ended")
        train.close()
        threads(16, "nothing held")
        """,
    )


def test_the_cap_is_of_this_process_share_of_the_cpus(train_root: Path) -> None:
    # 8 CPUs and 2 processes of the job on this machine: 4 each, less the loader's worker
    _run(
        train_root,
        """
        import os
        from fastload import device

        os.environ["LOCAL_WORLD_SIZE"] = "2"
        device.available_cpus = lambda: 8
        fastload._engine.cpu_share = device.cpu_share
        train = loader(1)
        run(train)
        threads(3, "a half of 8 CPUs less one worker")
        train.close()
        threads(16, "closed")
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
