"""Resume states: corrupted, mismatched and out-of-range ones are named errors that change nothing;
a training process SIGKILLed after saving its state mid-epoch resumes with exactly the rest.

Also: ``tests/test_iterator.py::test_resume_state_out_of_range_is_an_error`` (``batches``),
``tests/test_loader.py::test_state_dict_errors`` and ``test_resume_in_a_new_process``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from fastload import ResumeError
from fastload import transforms as T
from fastload.imagefolder import ImageFolder
from fastload.loader import DataLoader

from ._faults import train_tf


@pytest.fixture(scope="module")
def train_set(imagenet_root: Path) -> ImageFolder:
    return ImageFolder(imagenet_root / "train", transform=train_tf())


def _labels_and_pixels(loader: DataLoader[Any]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x.clone(), y.clone()) for x, y in loader]


BAD_STATES = [
    (
        lambda s: None,
        ValueError,
        r"should come from fastload.DataLoader.state_dict\(\), but got NoneType",
    ),
    (lambda s: list(s.items()), ValueError, "but got tuple"),
    (lambda s: [], ValueError, "but got an empty list"),
    (lambda s: s | {"format": "torchdata"}, ValueError, "but got a dict with format='torchdata'"),
    (lambda s: s | {"version": 99}, ValueError, "unsupported fastload.DataLoader state version 99"),
    (lambda s: s | {"version": 1}, ResumeError, r"version 1.*did not record the number of ranks"),
    (lambda s: {k: v for k, v in s.items() if k != "seed"}, ValueError, "no 'seed' field"),
    (lambda s: {k: v for k, v in s.items() if k != "batches"}, ValueError, "no 'batches' field"),
    (lambda s: s | {"seed": "zero"}, ValueError, r"state\['seed'\] should be an integer, but got .*'zero'"),
    (lambda s: s | {"seed": 1.5}, ValueError, r"state\['seed'\] should be an integer"),
    (
        lambda s: s | {"epoch": -1},
        ValueError,
        r"state\['epoch'\] should be a non-negative integer, but got .*=-1",
    ),
    (lambda s: s | {"epoch": None}, ValueError, r"state\['epoch'\]"),
    (lambda s: s | {"position": 99}, ResumeError, r"state\['position'\] should be an integer in \[0, 32\]"),
    (lambda s: s | {"position": 8}, ResumeError, "position 8 does not follow from its batches"),
    (lambda s: s | {"batches": -3}, ResumeError, r"state\['batches'\] should be a non-negative integer"),
    (lambda s: s | {"batches": True}, ResumeError, r"state\['batches'\] should be a non-negative.*True"),
    (
        lambda s: s | {"num_samples": 1000},
        ResumeError,
        "saved for 1000 samples, but this loader has 32 samples: it is another dataset",
    ),
    (
        lambda s: s | {"order": "shuffle"},
        ResumeError,
        "with order 'shuffle', but this loader has order 'sequence'.*another set of samples",
    ),
    (
        lambda s: [s, s | {"rank": 1}],
        ResumeError,
        r"a list of states should hold the state of each of the 1 ranks once, but holds ranks \[0, 1\]",
    ),
]


@pytest.mark.parametrize(("corrupt", "error", "message"), BAD_STATES)
def test_bad_state_is_a_named_error_that_changes_nothing(
    train_set: ImageFolder, corrupt: Any, error: type[Exception], message: str
) -> None:
    loader = DataLoader(train_set, batch_size=4, num_workers=0, seed=3)
    next(iter(loader))  # epoch 0 left after one batch: the next pass is epoch 1
    state = loader.state_dict()
    assert (state["epoch"], state["batches"]) == (1, 0)
    expected = DataLoader(train_set, batch_size=4, num_workers=0, seed=3)
    expected.set_epoch(1)
    with pytest.raises(error, match=message):
        loader.load_state_dict(corrupt(dict(state)))
    assert loader.state_dict() == state
    got, want = _labels_and_pixels(loader), _labels_and_pixels(expected)
    assert len(got) == len(want) == 8
    assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(got, want, strict=True))


TRAIN = textwrap.dedent(
    """
    import os, sys, time
    import torch
    from fastload import transforms as T
    from fastload.imagefolder import ImageFolder
    from fastload.loader import DataLoader

    if __name__ == "__main__":
        root, checkpoint, mode = sys.argv[1:4]
        ds = ImageFolder(root, transform=T.Compose([T.RandomResizedCrop(16), T.RandomHorizontalFlip()]))
        loader = DataLoader(ds, batch_size=2, shuffle=True, num_workers=2, seed=11)
        if mode == "train":
            consumed = []
            for k, (images, labels) in enumerate(loader):
                consumed.append((images.clone(), labels.clone()))
                # A checkpoint holds the loader state with what the model has seen, written atomically.
                torch.save({"loader": loader.state_dict(), "consumed": consumed}, checkpoint + ".tmp")
                os.replace(checkpoint + ".tmp", checkpoint)
                print(k, flush=True)
                time.sleep(0.2)  # a training step: the SIGKILL lands here, mid-epoch
        else:
            saved = torch.load(checkpoint)
            loader.load_state_dict(saved["loader"])
            rest = [(x.clone(), y.clone()) for x, y in loader]
            torch.save({"before": saved["consumed"], "after": rest}, mode)
    """
)


def test_resume_after_sigkill_of_the_training_process(imagenet_root: Path, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    root, checkpoint = str(imagenet_root / "train"), str(tmp_path / "ckpt.pt")
    proc = subprocess.Popen(
        [sys.executable, str(script), root, checkpoint, "train"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # let it save a few states, then kill it without warning
            if int(line) == 4:
                break
        time.sleep(0.1)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    out = str(tmp_path / "resumed.pt")
    subprocess.run([sys.executable, str(script), root, checkpoint, out], check=True, timeout=300)
    result = torch.load(out)
    before, after = result["before"], result["after"]
    assert 5 <= len(before) < 16, len(before)  # killed mid-epoch, after the 5th checkpoint or later
    # The whole epoch, uninterrupted, in this process.
    tf = T.Compose([T.RandomResizedCrop(16), T.RandomHorizontalFlip()])  # the script's
    full = DataLoader(ImageFolder(root, transform=tf), batch_size=2, shuffle=True, num_workers=0, seed=11)
    expected = _labels_and_pixels(full)
    got = before + after
    assert len(got) == len(expected) == 16
    assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(got, expected, strict=True))
