"""Checkpoints written by the frameworks restore fastload's loader exactly (CPU, gloo).

- PyTorch Lightning stores the train loader's ``state_dict()`` in its checkpoint (fit loop,
  ``combined_loader``) and loads it on ``fit(ckpt_path=...)``: a run stopped after 3 steps and
  resumed trains on every sample of the epoch exactly once -- on one device, and from a DDP run on
  2 devices resumed on 1 (``distributed=True`` with ``use_distributed_sampler=False``, so the
  sampler is fastload's and the epoch is resharded).
- Hugging Face Accelerate saves a loader given to ``register_for_checkpointing`` with
  ``save_state`` and restores it with ``load_state``: 2 torchrun ranks stopped mid-epoch, resumed
  on 3, every sample of the epoch seen once.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest
import torch

pytest.importorskip("pytorch_lightning")
pytest.importorskip("accelerate")
# accelerate 1.15 sets the process's device through torch.cpu.set_device, which torch 2.1 lacks
ACCELERATE_RUNS = pytest.mark.skipif(
    not hasattr(torch.cpu, "set_device"),
    reason=f"accelerate 1.15 needs torch 2.2 or later (torch.cpu.set_device), not {torch.__version__}",
)

TIMEOUT_S = 300

LIGHTNING = textwrap.dedent(
    """
    import json, os, sys
    import pytorch_lightning as pl
    import torch
    from torch import nn

    import fastload
    from fastload import transforms as T

    root, out, ckpt, devices = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])

    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(3, 4)
            self.seen = []

        def on_before_batch_transfer(self, batch, dataloader_idx):
            self.seen += batch.indices.tolist()  # the batch this step trains on (before the transfer)
            return batch

        def training_step(self, batch, batch_idx):
            images, labels = batch
            return nn.functional.cross_entropy(self.head(images.float().mean((2, 3))), labels)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            tf = T.Compose([T.RandomResizedCrop(16), T.RandomHorizontalFlip()])
            ds = fastload.ImageFolder(root, transform=tf)
            return fastload.DataLoader(
                ds, batch_size=2, shuffle=True, distributed=True, seed=3, num_workers=0
            )

    model = Model()
    kwargs = dict(
        accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
        use_distributed_sampler=False, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
    )
    if ckpt == "-":  # the first run: 3 steps, then a checkpoint (as every_n_train_steps writes one)
        checkpoints = pl.callbacks.ModelCheckpoint(dirpath=out, every_n_train_steps=3, save_top_k=-1)
        trainer = pl.Trainer(max_steps=3, callbacks=[checkpoints], **kwargs)
        trainer.fit(model)
    else:
        trainer = pl.Trainer(max_epochs=1, enable_checkpointing=False, **kwargs)
        trainer.fit(model, ckpt_path=ckpt)
    run = "first" if ckpt == "-" else "resumed"
    with open(os.path.join(out, f"seen-{run}-{trainer.global_rank}.json"), "w") as f:
        json.dump(model.seen, f)
    """
)

ACCELERATE = textwrap.dedent(
    """
    import json, os, sys
    from accelerate import Accelerator

    import fastload
    from fastload import transforms as T

    root, out, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    accelerator = Accelerator(cpu=True)
    ds = fastload.ImageFolder(root, transform=T.Compose([T.RandomResizedCrop(16)]))
    loader = fastload.DataLoader(ds, batch_size=2, shuffle=False, distributed=True, num_workers=0)
    accelerator.register_for_checkpointing(loader)
    seen = []
    if mode == "first":
        for step, batch in enumerate(loader):
            seen += batch.indices.tolist()
            if step == 2:
                accelerator.save_state(os.path.join(out, "state"))
                break
    else:
        accelerator.load_state(os.path.join(out, "state"))
        for batch in loader:
            seen += batch.indices.tolist()
    with open(os.path.join(out, f"seen-{mode}-{accelerator.process_index}.json"), "w") as f:
        json.dump(seen, f)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    """
)


def _env() -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")
    }
    env["OMP_NUM_THREADS"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks (gloo), on a GPU machine too: one GPU per rank is not there
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        env["MASTER_PORT"] = str(s.getsockname()[1])  # Lightning's DDP reads it
    return env


def _run(cmd: list[str], cwd: Path) -> None:
    res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S, env=_env())
    assert res.returncode == 0, res.stdout + res.stderr


def _seen(out: Path, pattern: str) -> list[int]:
    return [i for f in sorted(out.glob(pattern)) for i in json.loads(f.read_text())]


@pytest.mark.slow
@pytest.mark.parametrize("devices", [1, 2])
def test_lightning_checkpoint_resumes_the_loader(imagenet_root: Path, tmp_path: Path, devices: int) -> None:
    script = tmp_path / "fit.py"
    script.write_text(LIGHTNING)
    root = str(imagenet_root / "train")
    _run([sys.executable, str(script), root, str(tmp_path), "-", str(devices)], tmp_path)
    (ckpt,) = tmp_path.glob("*.ckpt")
    _run([sys.executable, str(script), root, str(tmp_path), str(ckpt), "1"], tmp_path)
    first, resumed = _seen(tmp_path, "seen-first-*.json"), _seen(tmp_path, "seen-resumed-*.json")
    assert len(first) == 3 * 2 * devices  # 3 steps of 2 on each device
    assert Counter(first + resumed) == Counter(range(32))  # the whole epoch, each sample once


@ACCELERATE_RUNS
@pytest.mark.slow
def test_accelerate_save_state_resumes_the_loader_on_more_ranks(imagenet_root: Path, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(ACCELERATE)
    root = str(imagenet_root / "train")
    for ranks, mode in ((2, "first"), (3, "resumed")):
        _run(
            [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
             f"--master-port={_env()['MASTER_PORT']}", str(script), root, str(tmp_path), mode],
            tmp_path,
        )  # fmt: skip
    first, resumed = _seen(tmp_path, "seen-first-*.json"), _seen(tmp_path, "seen-resumed-*.json")
    assert len(first) == 3 * 2 * 2
    assert Counter(first + resumed) == Counter(range(32))
