"""Exact evaluation with fastload: the same metrics from 1 process or N, every val sample counted once.

Evaluate a checkpoint of ``examples/train_single.py`` (or, without one, a randomly initialised
model: the numbers are then those of an untrained model, and still exact)::

    python examples/train_single.py --save model.pt
    python examples/evaluate.py --checkpoint model.pt                           # one process
    torchrun --nproc_per_node=2 examples/evaluate.py --checkpoint model.pt      # 2 processes (CPU: gloo)

Both print the same counts: ``counted`` equals the size of the val set, and top-1/top-5 are the
single-process numbers. With torch's ``DistributedSampler`` the val set is padded to a multiple of
the world size, so some images are evaluated twice (a 300-image set on 7 ranks counts 301), and
``gather_for_metrics``-style helpers that assume equal shards do not apply to exact shards.

What it shows:

* ``fastload.DataLoader(..., distributed=True, shuffle=False)``: fastload's ``DistributedSampler``
  gives every sample to exactly one rank (shards of unequal length, no padding);
* ``fastload.distributed.Accumulator``: named per-rank sums (correct, total, loss) reduced with one
  ``all_reduce``; a rank with an empty shard still takes part with zeros;
* ``fastload.distributed.gather_by_index``: per-sample predictions from every rank collected in
  dataset order (row ``i`` is sample ``i``), e.g. for a confusion matrix or a predictions file
  (``--predictions PATH``: one ``index,label,prediction`` line per val image, identical for any
  number of processes).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision

from fastload import ClassIndex, DataLoader, ImageFolder, gpu
from fastload import transforms as T
from fastload.distributed import Accumulator, gather_by_index, get_local_rank, get_world_size, is_main_process

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
    p.add_argument("--checkpoint", help="a checkpoint written by examples/train_single.py --save")
    p.add_argument("--arch", default="resnet18", help="without --checkpoint (default: %(default)s)")
    p.add_argument("--image-size", type=int, default=32, help="without --checkpoint (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=50, help="per process (default: %(default)s)")
    p.add_argument("--workers", default="auto", help="loader workers per process, or 'auto' (default)")
    p.add_argument("--seed", type=int, default=0, help="initial weights without --checkpoint (default: 0)")
    p.add_argument("--predictions", metavar="PATH", help="write index,label,prediction per val image")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    distributed = "WORLD_SIZE" in os.environ  # started by torchrun
    use_cuda = torch.cuda.is_available()
    if distributed:
        dist.init_process_group("nccl" if use_cuda else "gloo")
    device = torch.device("cuda", get_local_rank()) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)

    root = Path(args.data)
    classes = ClassIndex.from_folder(root / "train")  # labels from the train split's class list
    arch, size, state = args.arch, args.image_size, None
    if args.checkpoint:
        ckpt = torch.load(args.checkpoint, map_location="cpu")
        arch, size, state = ckpt["arch"], ckpt["image_size"], ckpt["model"]
        classes = ClassIndex(ckpt["classes"])
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = getattr(torchvision.models, arch)(num_classes=len(classes))
    if state is not None:
        model.load_state_dict(state)
    model = model.to(device, memory_format=torch.channels_last).eval()

    val_set = ImageFolder(
        root / "val", classes=classes, transform=T.Compose([T.Resize(size * 256 // 224), T.CenterCrop(size)])
    )
    loader = DataLoader(
        val_set,
        batch_size=args.batch_size,
        shuffle=False,
        distributed=True,  # fastload's exact sampler: this rank's shard, no padding
        num_workers=args.workers if args.workers == "auto" else int(args.workers),
        device=device,
        gpu_transforms=gpu.Normalize(MEAN, STD),
    )

    acc = Accumulator("correct1", "correct5", "loss", "total")
    predictions = []
    with torch.no_grad():
        for images, labels in loader:
            logits = model(images)
            top5 = logits.topk(min(5, logits.shape[1]), dim=1).indices
            acc.update(
                correct1=(top5[:, 0] == labels).sum(),
                correct5=(top5 == labels[:, None]).any(dim=1).sum(),
                loss=F.cross_entropy(logits, labels, reduction="sum"),
                total=len(labels),
            )
            predictions.append(top5[:, 0])
    totals = acc.reduce()  # one all_reduce of the four sums: exact over ranks
    # Row i = the prediction for val sample i, whichever rank evaluated it (every rank gets it).
    ordered = gather_by_index(predictions, loader.sampler.indices(), dataset_size=len(val_set))
    shard = len(loader.sampler)
    shards = [shard]
    if distributed:
        gathered: list[int] = [0] * get_world_size()
        dist.all_gather_object(gathered, shard)
        shards = gathered

    if is_main_process():
        n = int(totals["total"])
        print(
            f"top-1 {int(totals['correct1'])}/{n} = {int(totals['correct1']) / max(1, n):.4f}, "
            f"top-5 {int(totals['correct5'])}/{n} = {int(totals['correct5']) / max(1, n):.4f}, "
            f"mean loss {float(totals['loss']) / max(1, n):.4f}"
        )
        print(
            f"counted {n} samples (val set: {len(val_set)} samples), world size {get_world_size()}, "
            f"samples per rank {shards}"
        )
        if args.predictions:
            labels = torch.as_tensor(val_set.targets)
            with open(args.predictions, "w") as f:
                for i, (label, pred) in enumerate(zip(labels.tolist(), ordered.tolist(), strict=True)):
                    f.write(f"{i},{label},{pred}\n")
            print(f"predictions written to {args.predictions}")
    loader.close()
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
