"""fastload inside PyTorch Lightning and Hugging Face Accelerate (CPU, gloo), for real.

- The batches survive the frameworks' device-transfer utilities.
- ``examples/train_lightning.py`` (1 device and DDP on 2) and ``examples/train_accelerate.py``
  (torchrun, 2 ranks) run to the end and exit: fast path kept, equal steps, every val sample once.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastload import transforms as T
from fastload.batch import IndexedBatch
from fastload.imagefolder import ImageFolder
from fastload.loader import DataLoader

pl_apply = pytest.importorskip("lightning_utilities.core.apply_func")
pl_move = pytest.importorskip("pytorch_lightning.utilities").move_data_to_device
accelerate_ops = pytest.importorskip("accelerate.utils.operations")
# accelerate 1.15 sets the process's device through torch.cpu.set_device, which torch 2.1 lacks
ACCELERATE_RUNS = pytest.mark.skipif(
    not hasattr(torch.cpu, "set_device"),
    reason=f"accelerate 1.15 needs torch 2.2 or later (torch.cpu.set_device), not {torch.__version__}",
)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
VAL_SIZE = 12  # the test tree: 4 classes x 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("device", [None, "cpu"])
def test_batches_survive_framework_transfer_utilities(imagenet_root: Path, device: str | None) -> None:
    ds = ImageFolder(imagenet_root / "train", transform=T.Compose([T.RandomResizedCrop(16)]))
    loader = DataLoader(ds, batch_size=4, num_workers=0, seed=0, device=device)
    batch = next(iter(loader))
    assert isinstance(batch, IndexedBatch)
    moved = [
        pl_move(batch, torch.device("cpu")),  # every LightningModule step
        pl_apply.apply_to_collection(batch, torch.Tensor, lambda t: t.clone()),
        accelerate_ops.send_to_device(batch, "cpu"),
        accelerate_ops.recursively_apply(lambda t: t.clone(), batch),
    ]
    for out in moved:
        images, labels = out
        assert torch.equal(images, batch[0]) and torch.equal(labels, batch[1])
        assert isinstance(out, IndexedBatch)
        assert out.indices is None or torch.equal(out.indices, batch.indices)


@pytest.mark.parametrize("shuffle", [True, False, None])
def test_lightning_tells_a_fastload_loader_as_torchs(imagenet_root: Path, shuffle: bool | None) -> None:
    """Lightning's own checks of a loader passed to ``fit()`` (not made in its hooks): whether it
    shuffles (a validation loader's warning; the shuffle of the ``DistributedSampler`` it injects
    in older versions) and which sampler it injects for DDP, the same as for torch's loader."""
    pl_data = pytest.importorskip("pytorch_lightning.utilities.data")
    pl_connector = pytest.importorskip("pytorch_lightning.trainer.connectors.data_connector")
    ds = ImageFolder(imagenet_root / "val", transform=T.Compose([T.Resize(16), T.CenterCrop(16)]))
    kwargs = {} if shuffle is None else {"shuffle": shuffle}
    loaders = [
        DataLoader(ds, batch_size=4, num_workers=0, **kwargs),
        torch.utils.data.DataLoader(ds, 4, **kwargs),
    ]
    shuffled = [pl_data._is_dataloader_shuffled(loader) for loader in loaders]
    assert shuffled == [bool(shuffle)] * 2
    injected = [
        pl_connector._get_distributed_sampler(loader, shuffled[0], overfit_batches=0, num_replicas=2, rank=0)
        for loader in loaders
    ]
    assert type(injected[0]) is type(injected[1]) is torch.utils.data.DistributedSampler
    assert [list(sampler) for sampler in injected] == [list(injected[1])] * 2


@pytest.mark.parametrize("persistent", [None, True, False])
def test_a_loader_lightning_makes_again_keeps_what_was_asked(
    imagenet_root: Path, persistent: bool | None
) -> None:
    """Lightning makes a loader passed to ``fit()`` again from its attributes to inject its
    ``DistributedSampler``: ``persistent_workers`` is passed again only where it was asked for, so
    fastload's default stays a default (workers reseeded each pass as torch's new ones, not kept
    with the ``worker_init_fn`` Lightning's ``seed_everything(workers=True)`` adds)."""
    pl_data = pytest.importorskip("pytorch_lightning.utilities.data")
    ds = ImageFolder(imagenet_root / "val", transform=T.Compose([T.Resize(16), T.CenterCrop(16)]))
    kwargs = {} if persistent is None else {"persistent_workers": persistent}
    loader = DataLoader(ds, batch_size=4, num_workers=2, **kwargs)
    again = pl_data._update_dataloader(
        loader, torch.utils.data.DistributedSampler(ds, num_replicas=2, rank=0)
    )
    assert type(again) is DataLoader and again.persistent_workers is (persistent is not False)
    assert again._persistent_by_default is (persistent is None)
    with pytest.raises(ValueError, match="persistent_workers attribute should not be set"):
        again.persistent_workers = False  # torch's refusal after construction


def _run(cmd: list[str], cwd: Path) -> str:
    # CPU ranks (gloo), on a GPU machine too: one GPU cannot serve two ranks of their own
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


@pytest.mark.parametrize("devices", [1, 2])
def test_lightning_example(imagenet_root: Path, tmp_path: Path, devices: int) -> None:
    out = _run(
        [
            sys.executable,
            str(EXAMPLES / "train_lightning.py"),
            "--data",
            str(imagenet_root),
            "--devices",
            str(devices),
            "--epochs",
            "2",
            "--batch-size",
            "4",
            "--image-size",
            "32",
        ],
        tmp_path,
    )
    # ranks print at once: a line may run into the next one's text ("... fast path Truerank 0: ...")
    loaders = re.findall(r"rank (\d): train loader (\S+), fast path (True|False|None)", out)
    assert sorted(rank for rank, _, _ in loaders) == [str(r) for r in range(devices)], out
    assert all(cls == "fastload.loader.DataLoader" and fast == "True" for _, cls, fast in loaders), out
    steps = re.findall(r"rank (\d): (\d+) train steps", out)
    # 32 train images: 8 steps of 4 per epoch on one device; 16 per rank (Lightning's padding sampler) on two
    per_epoch = 32 // 4 // devices
    for rank in range(devices):
        assert [int(s) for r, s in steps if int(r) == rank] == [per_epoch, 2 * per_epoch], out
    assert re.findall(r"val top-1 [0-9.]+ over (\d+) samples", out) == [str(VAL_SIZE)] * 2, out
    # the DistributedSampler Lightning injects for fastload's shuffle: one order on every rank, all 32 covered
    assert re.findall(r"epoch \d: train samples covered (\d+) of (\d+)", out) == [("32", "32")] * 2, out


@ACCELERATE_RUNS
def test_accelerate_example(imagenet_root: Path, tmp_path: Path) -> None:
    out = _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            f"--master-port={_free_port()}",
            str(EXAMPLES / "train_accelerate.py"),
            "--data",
            str(imagenet_root),
            "--epochs",
            "2",
            "--batch-size",
            "4",
            "--image-size",
            "32",
            "--compare-prepared",
        ],
        tmp_path,
    )
    steps = re.findall(r"rank (\d): epoch (\d): (\d+) train steps, [0-9.]+ images/s \(fast path True\)", out)
    assert sorted(steps) == [("0", "0", "4"), ("0", "1", "4"), ("1", "0", "4"), ("1", "1", "4")], out
    assert re.findall(r"val top-1 [0-9.]+ over (\d+) samples \(val set: (\d+)", out) == [("12", "12")] * 2, (
        out
    )
    assert len(re.findall(r"prepare\(\)d loader \(DataLoaderShard\)", out)) == 2, out
