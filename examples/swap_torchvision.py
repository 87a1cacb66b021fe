"""The one-line swap: a standard torchvision ImageNet training loop, only the import line changed.

Replace ``from torch.utils.data import DataLoader`` by ``from fastload import DataLoader`` and
nothing else: fastload recognises the torchvision ``ImageFolder`` and its ``Compose`` of
``RandomResizedCrop``/``RandomHorizontalFlip``/``ToTensor``/``Normalize`` and decodes each image
straight into the batch, fused with the crop. The batches are the ones the unchanged pipeline
makes (float32, normalized, NCHW). Run it both ways on the set ``make bench`` writes::

    python examples/swap_torchvision.py                   # fastload.DataLoader
    python examples/swap_torchvision.py --torch           # torch's DataLoader, for comparison

On a CPU each takes well under a minute: the crops default to 32 pixels there (ResNet-18 on 224
pixel crops took 5.5 minutes per epoch of the 1,000 images on 2 shared cores); with CUDA the model
trains on the GPU and the crops default to ImageNet's 224.
"""

import argparse
import os
import sys
import time

import torch
import torchvision
from torchvision import transforms
from tqdm import tqdm

if "--torch" in sys.argv:
    from torch.utils.data import DataLoader
else:
    from fastload import DataLoader  # the only line that differs from a torchvision script

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--data", default=os.path.expanduser("~/.cache/fastload/synthetic-imagenet"))
parser.add_argument("--epochs", type=int, default=1)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--workers", type=int, default=2)
parser.add_argument(
    "--image-size", type=int, default=224 if torch.cuda.is_available() else 32, help="crop size (CPU: 32)"
)
parser.add_argument("--torch", action="store_true", help="use torch's DataLoader")
args = parser.parse_args()

normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
train_set = torchvision.datasets.ImageFolder(
    os.path.join(args.data, "train"),
    transforms.Compose(
        [
            transforms.RandomResizedCrop(args.image_size),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            normalize,
        ]
    ),
)
loader = DataLoader(
    train_set, batch_size=args.batch_size, shuffle=True, num_workers=args.workers, drop_last=True
)
print(f"{type(loader).__module__}.DataLoader, fast path: {getattr(loader, 'fast_path', False)}")

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
model = torchvision.models.resnet18(num_classes=len(train_set.classes)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
for epoch in range(args.epochs):
    model.train()
    start, seen = time.perf_counter(), 0
    for images, labels in tqdm(loader, desc=f"epoch {epoch}", leave=False):
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        loss = torch.nn.functional.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        seen += len(labels)
    print(f"epoch {epoch}: {seen} images, {seen / (time.perf_counter() - start):.1f} img/s with the model")
    if hasattr(loader, "stats"):
        print(f"epoch {epoch}: {loader.stats.summary()}")
