"""IndexedBatch survives the generic collection utilities frameworks run on every batch."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
import torch.utils._pytree as pytree

from fastload.batch import IndexedBatch


def _batch() -> IndexedBatch:
    return IndexedBatch(
        torch.zeros(2, 3, 4, 4, dtype=torch.uint8), torch.tensor([1, 2]), torch.tensor([7, 3])
    )


def test_unpacks_as_a_pair_and_pickles() -> None:
    b = _batch()
    images, labels = b
    assert len(b) == 2 and labels.tolist() == [1, 2] and b.indices.tolist() == [7, 3]
    back = pickle.loads(pickle.dumps(b))
    assert isinstance(back, IndexedBatch) and back.indices.tolist() == [7, 3]


def test_rebuilt_from_its_items_like_lightning_and_accelerate_do() -> None:
    b = _batch()
    # Lightning's apply_to_collection / Accelerate's honor_type: type(batch)(generator of items)
    rebuilt = type(b)(x.float() for x in b)
    assert isinstance(rebuilt, IndexedBatch) and rebuilt[0].dtype == torch.float32
    assert rebuilt.indices is None
    with_indices = IndexedBatch([b[0], b[1], b.indices])
    assert with_indices.indices.tolist() == [7, 3]
    with pytest.raises(TypeError, match="iterable of 2 or 3 items"):
        IndexedBatch([b[0]])


def test_torch_pytree_maps_images_labels_and_indices() -> None:
    b = _batch()
    mapped = pytree.tree_map(lambda t: t + 1, b)
    assert isinstance(mapped, IndexedBatch)
    assert mapped[1].tolist() == [2, 3] and mapped.indices.tolist() == [8, 4]
    leaves, spec = pytree.tree_flatten({"batch": b})
    assert len(leaves) == 3
    assert isinstance(pytree.tree_unflatten(leaves, spec)["batch"], IndexedBatch)


def test_takes_what_loops_do_to_torchs_list_batches(imagenet_root: Path) -> None:
    """torch's default_collate makes a list of (image, label) samples: loops move its items in
    place (``batch[0] = batch[0].to(device)``) or add to it; a fast-path batch takes the same."""
    from torchvision import transforms as T

    import fastload

    ds = fastload.ImageFolder(imagenet_root / "val", transform=T.Compose([T.CenterCrop(8), T.PILToTensor()]))
    loader = fastload.DataLoader(ds, batch_size=4, num_workers=0)
    assert loader.fast_path
    theirs = next(iter(torch.utils.data.DataLoader(ds, batch_size=4)))
    batch = next(iter(loader))
    assert isinstance(batch, IndexedBatch) and isinstance(batch, list) and isinstance(theirs, list)
    batch[0] = batch[0].float()
    batch.append("extra")
    assert batch[0].dtype == torch.float32 and len(batch) == 3 and batch.indices.tolist() == [0, 1, 2, 3]
    assert torch.equal(batch[0], theirs[0].float()) and torch.equal(batch[1], theirs[1])
    loader.close()
