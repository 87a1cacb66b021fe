"""Loads two epochs through each path and prints a JSON line of what it got (run by
``tests/test_shm.py``, also inside a private mount namespace whose ``/dev/shm`` is a small tmpfs).

Usage: ``python tests/_shm_run.py ROOT METHOD BATCH SIZE [torch | file_system | CASE,CASE...]``:
the synthetic tree at ROOT, multiprocessing start METHOD, batches of BATCH float32 images of SIZE
px, 2 workers; ``torch``: torch's own DataLoader on the fast path's pipeline instead (the control,
which fails there); a list of case names: only those cases.

torchvision is imported in ``main()``: spawned workers re-import this script, and those of the
case without torchvision's classes then do not pay its import.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

import fastload


class _Tensors(torch.utils.data.Dataset[Any]):
    """Not an image folder: torch's iterator inside fastload.DataLoader."""

    def __init__(self, n: int, size: int) -> None:
        self.n, self.size = n, size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return torch.full((3, self.size, self.size), float(i)), i


class _Scale:
    """A user collate_fn around default_collate (new tensors out, like mixup)."""

    def __call__(self, batch: list[Any]) -> Any:
        images, labels = torch.utils.data.default_collate(batch)
        return images * 2, labels


def _digest(loader: Any) -> list[list[float]]:
    out = []
    for _ in range(2):
        for images, labels in loader:
            out.append([float(images.double().sum()), float(labels.sum()), float(images.shape[0])])
    return out


def main() -> None:
    root, method, batch, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    common: dict[str, Any] = {"batch_size": batch, "num_workers": 2, "multiprocessing_context": method}
    if sys.argv[5:] == ["file_system"]:  # torch's sharing by name: fastload cannot use memfds
        torch.multiprocessing.set_sharing_strategy("file_system")
        loader = fastload.DataLoader(_Tensors(2 * batch, size), **common)
        try:
            _digest(loader)
        except RuntimeError as e:
            print(json.dumps({"error": type(e).__name__, "message": str(e).splitlines()[0]}))
            return
        print(json.dumps({"error": None}))
        return
    import torchvision
    from torchvision import transforms as v1

    train = f"{root}/train"
    norm = v1.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    fast = v1.Compose([v1.Resize(size + size // 8), v1.CenterCrop(size), v1.ToTensor(), norm])
    head = v1.Compose(
        [v1.Resize(size + size // 8), v1.CenterCrop(size), v1.ColorJitter(0.3, hue=0.1), v1.ToTensor(), norm]
    )
    if sys.argv[5:] == ["torch"]:
        loader: Any = torch.utils.data.DataLoader(torchvision.datasets.ImageFolder(train, fast), **common)
        print(json.dumps({"torch": _digest(loader)}))
        return
    cases: dict[str, Any] = {
        "fast": fastload.DataLoader(torchvision.datasets.ImageFolder(train, fast), **common),
        "head": fastload.DataLoader(torchvision.datasets.ImageFolder(train, head), **common),
        "head+collate": fastload.DataLoader(
            torchvision.datasets.ImageFolder(train, head), collate_fn=_Scale(), **common
        ),
        "torch": fastload.DataLoader(_Tensors(2 * batch + 3, size), **common),
    }
    if sys.argv[5:]:
        chosen = sys.argv[5].split(",")
        for name in set(cases) - set(chosen):
            cases.pop(name).close()
    result: dict[str, Any] = {}
    for name, loader in cases.items():
        torch.manual_seed(0)  # the head path's jitter: torch's worker seeds
        result[name] = {"path": loader.path, "batches": _digest(loader)}
        loader.close()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
