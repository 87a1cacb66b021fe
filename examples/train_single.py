"""Single-process training with fastload: a progress bar per epoch and the loader's own statistics.

Runs on a CPU in under a minute on the set ``make bench`` writes (1,000 train and 300 val images)::

    python examples/train_single.py                      # --data ~/.cache/fastload/synthetic-imagenet
    python examples/train_single.py --epochs 3 --save model.pt
    python examples/evaluate.py --checkpoint model.pt     # then evaluate it (also with torchrun)

With a GPU the same script trains there (``--device cuda`` is the default when CUDA is available).

What it shows:

* the two lines that change from a torchvision training script: ``fastload.ImageFolder`` with
  ``fastload.transforms`` (decoding fused with the crop), and ``fastload.DataLoader`` with
  ``seed=`` (order and augmentations a function of seed and epoch) and ``device=`` +
  ``gpu_transforms=`` (uint8 batches normalized once per batch on the device);
* ``loader.set_epoch(epoch)`` at the start of each epoch, a tqdm bar over the loader;
* ``loader.stats.summary()`` after each epoch: images/s, the time the loop waited for data and the
  stall fraction (near 0: the model is the bottleneck; near 1: the loader is);
* a validation top-1 per epoch, and ``--save`` writes a checkpoint for ``examples/evaluate.py``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.nn.functional as F
import torchvision
from tqdm import tqdm

from fastload import ClassIndex, DataLoader, ImageFolder, gpu
from fastload import transforms as T

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def default_data() -> str:
    """Where ``make bench`` writes the synthetic set: ``~/.cache/fastload/synthetic-imagenet``."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "fastload", "synthetic-imagenet")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--data", default=default_data(), help="folder with train/ and val/ (default: %(default)s)"
    )
    p.add_argument("--epochs", type=int, default=2, help="default: %(default)s")
    p.add_argument("--batch-size", type=int, default=32, help="default: %(default)s")
    p.add_argument(
        "--image-size",
        type=int,
        default=32,
        help="crop size (default: %(default)s, small for CPUs; 224 on a GPU)",
    )
    p.add_argument("--lr", type=float, default=0.05, help="default: %(default)s")
    p.add_argument("--workers", default="auto", help="loader workers, or 'auto' (default)")
    p.add_argument("--seed", type=int, default=0, help="default: %(default)s")
    p.add_argument("--arch", default="resnet18", help="a torchvision.models name (default: %(default)s)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--save", metavar="PATH", help="write a checkpoint for examples/evaluate.py here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(args.seed)
    root = Path(args.data)
    if not (root / "train").is_dir():
        raise SystemExit(
            f"error: {root}/train not found; make a dataset with: python -m fastload synth {root}"
        )

    classes = ClassIndex.from_folder(root / "train")  # one class list for both splits
    size = args.image_size
    train_set = ImageFolder(
        root / "train",
        classes=classes,
        transform=T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip()]),
    )
    val_set = ImageFolder(
        root / "val", classes=classes, transform=T.Compose([T.Resize(size * 256 // 224), T.CenterCrop(size)])
    )
    workers: int | str = args.workers if args.workers == "auto" else int(args.workers)
    normalize = gpu.Normalize(MEAN, STD)
    train_loader = DataLoader(
        train_set,
        batch_size=args.batch_size,
        shuffle=True,
        drop_last=True,  # no short last batch (BatchNorm needs more than one sample)
        seed=args.seed,
        num_workers=workers,
        device=device,
        gpu_transforms=normalize,
    )
    val_loader = DataLoader(
        val_set, batch_size=args.batch_size, num_workers=workers, device=device, gpu_transforms=normalize
    )

    model = getattr(torchvision.models, args.arch)(num_classes=len(classes)).to(device)
    model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)

    for epoch in range(args.epochs):
        train_loader.set_epoch(epoch)
        model.train()
        total_loss, seen = 0.0, 0
        bar = tqdm(train_loader, desc=f"epoch {epoch}", unit="batch", disable=args.no_progress or None)
        for images, labels in bar:
            loss = F.cross_entropy(model(images), labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total_loss += loss.item() * len(labels)
            seen += len(labels)
            bar.set_postfix(loss=f"{loss.item():.3f}")
        print(f"epoch {epoch}: train loss {total_loss / max(1, seen):.3f} over {seen} samples")
        print(f"epoch {epoch}: loader: {train_loader.stats.summary()}")

        model.eval()
        correct = counted = 0
        with torch.no_grad():
            for images, labels in val_loader:
                correct += int((model(images).argmax(1) == labels).sum())
                counted += len(labels)
        print(f"epoch {epoch}: val top-1 {correct / max(1, counted):.4f} ({correct}/{counted})", flush=True)

    if args.save:
        torch.save(
            {
                "arch": args.arch,
                "image_size": size,
                "classes": classes.classes,
                "model": model.state_dict(),
            },
            args.save,
        )
        print(f"checkpoint written to {args.save}")
    train_loader.close()
    val_loader.close()


if __name__ == "__main__":
    main()
