"""``IndexedBatch``: the ``(images, labels)`` pair every stage passes along, with the sample indices
the batched device transforms key their randomness by (the loader yields it, the prefetcher moves it).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = ["IndexedBatch", "iter_tensors"]

_MISSING = object()


class IndexedBatch(list[Any]):
    """An ``[images, labels]`` batch that also carries the dataset index of each sample.

    A list, as torch's ``default_collate`` makes; it survives pickling and torch's pytree. A utility
    that rebuilds it as ``type(batch)(items)`` (Lightning, Accelerate; torch 2.1's ``pin_memory``)
    gets indices ``None``.

    Example:
        >>> import torch
        >>> images = torch.zeros(2, 3, 4, 4, dtype=torch.uint8)
        >>> b = IndexedBatch(images, torch.tensor([0, 1]), torch.tensor([7, 3]))
        >>> images, labels = b
        >>> b.indices.tolist(), len(b)
        ([7, 3], 2)
        >>> type(b)(list(b)).indices is None  # rebuilt from its items, as frameworks do
        True
    """

    indices: Any

    def __init__(self, images: Any, labels: Any = _MISSING, indices: Any = None) -> None:
        if labels is _MISSING:  # IndexedBatch(iterable): [images, labels] or [images, labels, indices]
            items = list(images) if isinstance(images, Iterable) else None
            if items is None or len(items) not in (2, 3):
                raise TypeError(
                    "IndexedBatch takes (images, labels, indices) or one iterable of 2 or 3 items, "
                    f"but got {type(images).__name__}"
                )
            images, labels = items[0], items[1]
            indices = items[2] if len(items) == 3 else None
        super().__init__((images, labels))
        self.indices = indices

    @property
    def images(self) -> Any:
        """The images (first element)."""
        return self[0]

    @property
    def labels(self) -> Any:
        """The labels (second element)."""
        return self[1]

    def __reduce__(self) -> tuple[Any, ...]:
        return (IndexedBatch, (self[0], self[1], self.indices))

    def pin_memory(self) -> IndexedBatch:
        """A copy whose CPU tensors, the indices too, are in pinned memory (torch's pin thread calls it)."""

        def pin(x: Any) -> Any:
            return x.pin_memory() if isinstance(x, torch.Tensor) and x.device.type == "cpu" else x

        return IndexedBatch(pin(self[0]), pin(self[1]), pin(self.indices))

    def __repr__(self) -> str:
        return f"IndexedBatch(images={self[0]!r}, labels={self[1]!r}, indices={self.indices!r})"


def _flatten(batch: IndexedBatch) -> tuple[list[Any], None]:
    return [batch[0], batch[1], batch.indices], None


def _unflatten(children: Iterable[Any], context: None) -> IndexedBatch:
    return IndexedBatch(*children)


if hasattr(pytree, "register_pytree_node"):
    pytree.register_pytree_node(
        IndexedBatch,
        _flatten,
        _unflatten,
        serialized_type_name="fastload.batch.IndexedBatch",
    )
else:  # torch 2.1: the private name, without serialization
    pytree._register_pytree_node(IndexedBatch, _flatten, _unflatten)


def iter_tensors(batch: Any) -> Iterator[torch.Tensor]:
    """Every tensor of a batch (in tuples, lists, mappings; an :class:`IndexedBatch`'s indices too)."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, IndexedBatch):
        yield from iter_tensors(batch[0])
        yield from iter_tensors(batch[1])
        yield from iter_tensors(batch.indices)
    elif isinstance(batch, (tuple, list)):
        for x in batch:
            yield from iter_tensors(x)
    elif isinstance(batch, Mapping):
        for x in batch.values():
            yield from iter_tensors(x)
