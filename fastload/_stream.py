"""Batches built in place for torch's worker loop: one batch tensor, no list of per-sample tensors.

torch's worker loop fetches a batch as a list of samples and then collates it: at batch 256 of
224 px images the list holds 38.5 MB of per-sample tensors, and ``default_collate`` stacks them
into a new 38.5 MB shared-memory batch, so a worker holds both at once (and glibc keeps the
first 38.5 MB in its heap afterwards). In the process workers that ``fastload.DataLoader``
starts on torch's path (:func:`enable` runs in them), a fastload dataset's ``__getitems__``
(:func:`fetch`) copies each sample's image tensor into its row of one batch tensor, allocated
as ``default_collate`` allocates its output (shared memory in a worker), as soon as the sample
is made, and drops the sample's own tensor; :func:`collate` then returns that batch tensor
where ``default_collate`` would stack the rows into a new one. The values, dtype, shape and
sharing are ``default_collate``'s, the samples are made in the same order (the same random
draws), so the batch is the same; a worker holds one batch and one sample.

Only top-level tensors of a sample (a plain ``tuple`` or ``list``, or a tensor alone) of type
exactly ``torch.Tensor`` (strided, on the CPU, not requiring grad) are streamed, and a sample
whose tensor differs from the first sample's in shape or dtype ends the streaming of that
position: :func:`collate` then falls back to torch's ``collate`` of the rows and the rest (which
stacks, or raises torch's own error for unequal sizes). Outside such a worker :func:`fetch` is
``[dataset[i] for i in indices]`` and :func:`collate` is ``default_collate``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import default_collate

try:  # torch's documented way to extend default_collate (torch >= 1.13)
    from torch.utils.data._utils.collate import collate as _torch_collate
    from torch.utils.data._utils.collate import collate_tensor_fn, default_collate_fn_map

    _CAN_STREAM = True
except ImportError:  # pragma: no cover - an older or reorganised torch: no streaming
    _CAN_STREAM = False

__all__ = ["collate", "enable", "enabled", "fetch"]

_ENABLED = False

#: The attribute a row of a streamed batch carries: ``(batch tensor, row number)``.
_ROW = "_fastload_row"


def enable() -> None:
    """Streams the batches of fastload datasets in this process (a worker's start calls it)."""
    global _ENABLED
    _ENABLED = _CAN_STREAM


def enabled() -> bool:
    """Whether :func:`fetch` streams in this process."""
    return _ENABLED


def _streamable(value: Any) -> bool:
    return (
        type(value) is torch.Tensor
        and value.layout == torch.strided
        and value.device.type == "cpu"
        and not value.requires_grad
    )


def _batch_tensor(first: torch.Tensor, n: int) -> torch.Tensor:
    """``(n, *first.shape)`` of ``first``'s dtype, allocated as ``default_collate`` allocates its
    output: in shared memory inside a worker process (so sending it copies nothing)."""
    if torch.utils.data.get_worker_info() is not None:
        try:
            storage = first._typed_storage()._new_shared(n * first.numel(), device=first.device)
            return first.new(storage).resize_(n, *first.shape)
        except (AttributeError, RuntimeError):  # pragma: no cover - a torch without these helpers
            return torch.empty((n, *first.shape), dtype=first.dtype).share_memory_()
    return torch.empty((n, *first.shape), dtype=first.dtype)


def fetch(dataset: Any, indices: Sequence[int]) -> list[Any]:
    """``[dataset[i] for i in indices]``, with the samples' tensors written into batch tensors as
    they are made where streaming is on (see the module docs)."""
    if not _ENABLED:
        return [dataset[i] for i in indices]
    n = len(indices)
    samples: list[Any] = []
    batches: dict[int, torch.Tensor | None] | None = None  # position -> batch tensor (None: ended)
    for k, i in enumerate(indices):
        sample = dataset[i]
        bare = type(sample) is torch.Tensor
        if not bare and type(sample) not in (tuple, list):
            batches = {}  # nothing to stream in this batch
        items = [sample] if bare else list(sample) if type(sample) in (tuple, list) else []
        if batches is None:  # the first sample: which positions stream
            batches = {j: _batch_tensor(v, n) for j, v in enumerate(items) if _streamable(v)}
        replaced = False
        for j, batch in batches.items():
            if batch is None or j >= len(items):
                continue
            value = items[j]
            if not (_streamable(value) and value.shape == batch.shape[1:] and value.dtype == batch.dtype):
                batches[j] = None  # collate falls back to torch's for this position
                continue
            row = batch[k]
            row.copy_(value)
            setattr(row, _ROW, (batch, k))
            items[j] = row
            replaced = True
        if replaced:
            sample = items[0] if bare else type(sample)(items)
        samples.append(sample)
    return samples


def _stacked(batch: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The batch tensor whose rows ``batch`` is, in order and complete, or ``None``."""
    first = getattr(batch[0], _ROW, None)
    if first is None or first[0].shape[0] != len(batch):
        return None
    whole = first[0]
    for k, row in enumerate(batch):
        mark = getattr(row, _ROW, None)
        if mark is None or mark[0] is not whole or mark[1] != k:
            return None
    return whole


def _collate_tensor(
    batch: Sequence[torch.Tensor], *, collate_fn_map: dict[Any, Callable[..., Any]] | None = None
) -> Any:
    whole = _stacked(batch)
    if whole is not None:
        return whole
    return collate_tensor_fn(batch, collate_fn_map=collate_fn_map)


def collate(batch: list[Any]) -> Any:
    """``default_collate``, returning a streamed batch tensor itself instead of stacking its rows."""
    if not _CAN_STREAM:  # pragma: no cover - see the import
        return default_collate(batch)
    return _torch_collate(batch, collate_fn_map={**default_collate_fn_map, torch.Tensor: _collate_tensor})
