"""DDP training + exact validation with fastload, end to end. Runs unchanged on CPUs (gloo) and GPUs (nccl).

One machine, 2 processes (on CPUs, ``--image-size 32`` keeps it under a minute; 224, the default,
took 4.4 minutes on 2 shared cores)::

    torchrun --nproc_per_node=2 examples/train_ddp.py --data ~/.cache/fastload/synthetic-imagenet --epochs 1 \
        --image-size 32

Two machines (run on each, with its own --node_rank)::

    torchrun --nnodes=2 --nproc_per_node=8 --node_rank=0 --master_addr=10.0.0.1 --master_port=29500 \\
        examples/train_ddp.py --data /data/imagenet --epochs 90

What it shows:

* one class list for train and val (``ClassIndex``), scanned on rank 0 and broadcast;
* ``fastload.DataLoader(..., distributed=True)``: the training sampler pads like torch's (every rank
  takes the same number of steps: no DDP hang; every sample at least once per epoch); the
  validation sampler gives every sample to exactly one rank (no padding, no duplicates);
* uint8 batches normalized once per batch on the device (``gpu_transforms``);
* validation top-1 reduced with one ``all_reduce`` of (correct, total): exactly the single-process
  accuracy, and ``total`` equals the size of the val set.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel

from fastload import ClassIndex, DataLoader, ImageFolder, gpu, scan_folder
from fastload import transforms as T
from fastload.distributed import Accumulator, get_local_rank, is_main_process

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--data", required=True, help="folder with train/ and val/ (python -m fastload synth ROOT)"
    )
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32, help="per process")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--workers", default="auto", help="loader workers per process, or 'auto'")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arch", default="resnet18", help="a torchvision.models name")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    if use_cuda:
        device = torch.device("cuda", get_local_rank())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    torch.manual_seed(args.seed)  # same initial weights on every rank

    train_root, val_root = os.path.join(args.data, "train"), os.path.join(args.data, "val")
    classes = ClassIndex.from_folder(train_root)
    size = args.image_size
    train_set = ImageFolder(
        None,
        index=scan_folder(train_root, classes, broadcast=True),
        transform=T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip()]),
    )
    val_set = ImageFolder(
        None,
        index=scan_folder(val_root, classes, broadcast=True),
        transform=T.Compose([T.Resize(size * 256 // 224), T.CenterCrop(size)]),
    )
    workers: int | str = args.workers if args.workers == "auto" else int(args.workers)
    normalize = gpu.Normalize(MEAN, STD)
    train_loader = DataLoader(
        train_set,
        batch_size=args.batch_size,
        shuffle=True,
        drop_last=True,
        distributed=True,
        seed=args.seed,
        num_workers=workers,
        device=device,
        gpu_transforms=normalize,
    )
    val_loader = DataLoader(
        val_set,
        batch_size=args.batch_size,
        shuffle=False,
        distributed=True,
        num_workers=workers,
        device=device,
        gpu_transforms=normalize,
    )

    model = getattr(torchvision.models, args.arch)(num_classes=len(classes)).to(device)
    model = model.to(memory_format=torch.channels_last)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if use_cuda else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)

    for epoch in range(args.epochs):
        train_loader.set_epoch(epoch)
        ddp.train()
        t0, seen = time.perf_counter(), 0
        for images, labels in train_loader:
            loss = F.cross_entropy(ddp(images), labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            seen += len(labels)
        if is_main_process():
            print(
                f"epoch {epoch}: train loss {loss.item():.3f}, {seen} samples/rank, "
                f"{seen / (time.perf_counter() - t0):.1f} img/s/rank, {train_loader.stats.summary()}",
                flush=True,
            )

        # Exact validation: every val sample is on exactly one rank; one all_reduce of the sums.
        ddp.eval()
        acc = Accumulator("correct", "total")
        with torch.no_grad():
            for images, labels in val_loader:
                acc.update(correct=(model(images).argmax(1) == labels).sum(), total=len(labels))
        totals = acc.reduce()
        if is_main_process():
            top1 = totals["correct"] / max(1, totals["total"])
            print(
                f"epoch {epoch}: val top-1 {top1:.4f} over {totals['total']} samples "
                f"(val set: {len(val_set)} samples, world size {dist.get_world_size()})",
                flush=True,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
