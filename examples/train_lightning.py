"""PyTorch Lightning with fastload: an unchanged LightningModule, fastload loaders in the DataModule.

One process, or DDP on CPUs (gloo) / GPUs::

    python examples/train_lightning.py --data ~/.cache/fastload/synthetic-imagenet --devices 1
    python examples/train_lightning.py --data ~/.cache/fastload/synthetic-imagenet --devices 2

What it shows:

* ``train_dataloader()``/``val_dataloader()`` return ``fastload.DataLoader``; Lightning re-creates
  the training loader with its distributed sampler (``use_distributed_sampler=True``, the
  default) and it stays a ``fastload.DataLoader`` on the fast path, with equal steps per rank;
* the validation loader passes ``distributed=True``: fastload's exact sampler is a
  ``DistributedSampler``, so Lightning leaves it alone and every val sample is counted once
  (Lightning's own sampler would pad the last batch with repeated samples);
* no batch-transfer hook and no ``close()``: the batches survive Lightning's device transfer and
  the process exits when ``fit`` returns.
"""

from __future__ import annotations

import argparse
import time

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn

import fastload
from fastload import transforms as T

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1) * 255
STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255


class ImageNetData(pl.LightningDataModule):
    def __init__(self, root: str, batch_size: int, image_size: int, workers: int) -> None:
        super().__init__()
        self.root, self.batch_size, self.workers = root, batch_size, workers
        self.train_tf = T.Compose([T.RandomResizedCrop(image_size), T.RandomHorizontalFlip()])
        self.val_tf = T.Compose([T.Resize(image_size * 8 // 7), T.CenterCrop(image_size)])

    def train_dataloader(self) -> fastload.DataLoader:
        train = fastload.ImageFolder(f"{self.root}/train", transform=self.train_tf)
        return fastload.DataLoader(train, batch_size=self.batch_size, shuffle=True, num_workers=self.workers)

    def val_dataloader(self) -> fastload.DataLoader:
        classes = fastload.ImageFolder(f"{self.root}/train").classes  # one class list for both splits
        val = fastload.ImageFolder(f"{self.root}/val", transform=self.val_tf, classes=classes)
        return fastload.DataLoader(
            val, batch_size=self.batch_size, distributed=True, num_workers=self.workers
        )


class Classifier(pl.LightningModule):
    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 16, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(16, num_classes),
        )
        self.steps = 0
        self.images = 0
        self.t0 = 0.0
        self.val_counts = torch.zeros(2)  # correct, seen

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = (images.float() - MEAN.to(images.device)) / STD.to(images.device)
        return self.net(x)

    def on_train_epoch_start(self) -> None:
        # The DistributedSampler Lightning injects (it sees a shuffled loader, as with torch's)
        # partitions one order: together the ranks cover the whole train set.
        loader = self.trainer.train_dataloader
        shard = torch.tensor(list(loader.sampler))
        covered = len(set(self.all_gather(shard).flatten().tolist()))
        if self.global_rank == 0:
            print(
                f"epoch {self.current_epoch}: train samples covered {covered} of {len(loader.dataset)}",
                flush=True,
            )
        self.t0 = time.perf_counter()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        self.steps += 1
        self.images += len(labels)
        return F.cross_entropy(self(images), labels)

    def on_train_epoch_end(self) -> None:
        rate = self.images / max(1e-9, time.perf_counter() - self.t0)
        print(f"rank {self.global_rank}: {self.steps} train steps, {rate:.1f} images/s", flush=True)
        self.images = 0

    def on_validation_epoch_start(self) -> None:
        self.val_counts = torch.zeros(2)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        images, labels = batch
        correct = (self(images).argmax(1) == labels).sum().item()
        self.val_counts += torch.tensor([float(correct), float(len(labels))])

    def on_validation_epoch_end(self) -> None:
        total = self.trainer.strategy.reduce(self.val_counts.clone(), reduce_op="sum")
        if self.global_rank == 0 and not self.trainer.sanity_checking:
            print(f"val top-1 {total[0] / total[1]:.4f} over {int(total[1])} samples", flush=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--data", required=True, help="folder with train/ and val/ (python -m fastload synth ROOT)"
    )
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=1)
    args = p.parse_args()
    pl.seed_everything(0, verbose=False)
    data = ImageNetData(args.data, args.batch_size, args.image_size, args.workers)
    model = Classifier(num_classes=len(fastload.ImageFolder(f"{args.data}/train").classes))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=data)
    loader = trainer.train_dataloader
    print(
        f"rank {trainer.global_rank}: train loader {type(loader).__module__}.{type(loader).__name__}, "
        f"fast path {getattr(loader, 'fast_path', None)}",
        flush=True,
    )


if __name__ == "__main__":
    main()
