"""Hugging Face Accelerate with fastload: keep fastload's fast path, get exact metrics.

Launch with torchrun (or ``accelerate launch``); on CPUs Accelerate uses gloo::

    torchrun --nproc-per-node 2 examples/train_accelerate.py --data ~/.cache/fastload/synthetic-imagenet

``accelerator.prepare(model, optimizer, loader)`` rebuilds every DataLoader, a subclass too, as a
plain ``torch.utils.data.DataLoader`` from its attributes: fastload's fast path, ``stats`` and
``state_dict`` are gone and images/s falls to torch's per-sample path. The supported recipe:

* prepare the model and the optimizer only; build the loaders with ``distributed=True`` (after
  ``Accelerator()``, which starts the process group): the training sampler gives every rank the
  same number of steps, the validation sampler gives every sample to exactly one rank;
* reduce validation counts with :class:`fastload.distributed.Accumulator` (one ``all_reduce`` of
  sums: exact with shards of unequal length), not ``accelerator.gather_for_metrics``, which
  expects equal shards;
* ``loader.state_dict()`` / ``load_state_dict()`` for a mid-epoch resume, next to
  ``accelerator.save_state``.

``--compare-prepared`` also runs one epoch through ``accelerator.prepare(loader)`` and prints
both rates.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn

import fastload
from fastload import transforms as T
from fastload.distributed import Accumulator

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1) * 255
STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255


def make_model(num_classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, num_classes),
    )


def run_epoch(
    accelerator: Accelerator, model: nn.Module, opt: torch.optim.Optimizer, loader: object
) -> tuple[int, float]:
    """One training epoch; returns (steps, images/s)."""
    model.train()
    steps = images = 0
    t0 = time.perf_counter()
    for x, y in loader:  # type: ignore[attr-defined]
        x = (x.float() - MEAN.to(x.device)) / STD.to(x.device)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        accelerator.backward(loss)
        opt.step()
        steps += 1
        images += len(y)
    return steps, images / max(1e-9, time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--data", required=True, help="folder with train/ and val/ (python -m fastload synth ROOT)"
    )
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--compare-prepared", action="store_true", help="also time accelerator.prepare(loader)")
    args = p.parse_args()

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    size = args.image_size
    train_set = fastload.ImageFolder(
        f"{args.data}/train", transform=T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip()])
    )
    val_set = fastload.ImageFolder(
        f"{args.data}/val",
        transform=T.Compose([T.Resize(size * 8 // 7), T.CenterCrop(size)]),
        classes=train_set.classes,
    )
    kwargs = dict(batch_size=args.batch_size, num_workers=args.workers, device=accelerator.device)
    train = fastload.DataLoader(train_set, shuffle=True, distributed=True, **kwargs)
    val = fastload.DataLoader(val_set, distributed=True, **kwargs)

    model = make_model(len(train_set.classes))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = accelerator.prepare(model, opt)
    rank = accelerator.process_index
    for epoch in range(args.epochs):
        steps, rate = run_epoch(accelerator, model, opt, train)
        print(
            f"rank {rank}: epoch {epoch}: {steps} train steps, {rate:.1f} images/s "
            f"(fast path {train.fast_path})",
            flush=True,
        )
        model.eval()
        acc = Accumulator("correct", "total")
        with torch.no_grad():
            for x, y in val:
                x = (x.float() - MEAN.to(x.device)) / STD.to(x.device)
                acc.update(correct=(model(x).argmax(1) == y).sum().item(), total=len(y))
        totals = acc.reduce()
        if accelerator.is_main_process:
            print(
                f"epoch {epoch}: val top-1 {totals['correct'] / totals['total']:.4f} over {totals['total']} "
                f"samples (val set: {len(val_set)} samples)",
                flush=True,
            )
    if args.compare_prepared:
        plain = fastload.DataLoader(
            train_set, batch_size=args.batch_size, shuffle=True, num_workers=args.workers
        )
        prepared = accelerator.prepare(plain)
        steps, rate = run_epoch(accelerator, model, opt, prepared)
        print(
            f"rank {rank}: prepare()d loader ({type(prepared).__name__}): {steps} steps, {rate:.1f} images/s",
            flush=True,
        )
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
