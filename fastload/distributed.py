"""Rank helpers and exact metrics across ranks (docs/distributed.md has the worked examples).

:func:`get_rank`, :func:`get_world_size`, :func:`get_local_rank`, :func:`get_local_world_size`
and :func:`is_main_process` read the process group once it is initialized, else the ``torchrun``
environment, else answer for a single process. With :class:`fastload.DistributedSampler` (no
padding) every validation sample is on exactly one rank: :class:`Accumulator` and
:func:`reduce_sum` add per-rank sums up in one ``all_reduce``, and :func:`gather_by_index` puts
per-sample outputs back in dataset order. The collectives work with ``gloo`` (CPU tensors) and
``nccl`` (the current CUDA device: call ``torch.cuda.set_device(get_local_rank())`` first).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .device import local_world_size

__all__ = [
    "Accumulator",
    "broadcast_object",
    "gather_by_index",
    "get_local_rank",
    "get_local_world_size",
    "get_rank",
    "ranks_known",
    "get_world_size",
    "is_main_process",
    "reduce_sum",
]

Number = int | float

_EXACT_INT_LIMIT = 2**53  # sums travel as float64, exact for integers up to here


def _group_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def ranks_known() -> bool:
    """Whether this process's rank and the job's size are known now: a process group, or both
    ``WORLD_SIZE`` and ``RANK`` (not yet under ``torch.multiprocessing.spawn`` before
    ``init_process_group``, nor in Lightning's ``ddp`` processes)."""
    return _group_ready() or (_env_int("WORLD_SIZE") is not None and _env_int("RANK") is not None)


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{name} should be a non-negative integer, but got {name}={raw!r}")
    return value


def get_world_size() -> int:
    """Number of processes: the process group's size, else ``WORLD_SIZE``, else 1."""
    if _group_ready():
        return dist.get_world_size()
    value = _env_int("WORLD_SIZE")
    if value == 0:
        raise ValueError("WORLD_SIZE should be a positive integer, but got WORLD_SIZE='0'")
    return 1 if value is None else value


def get_rank() -> int:
    """This process's global rank: from the process group, else ``RANK``, else 0."""
    if _group_ready():
        return dist.get_rank()
    value = _env_int("RANK")
    return 0 if value is None else value


def get_local_rank() -> int:
    """This process's rank on its machine (the CUDA device to use): ``LOCAL_RANK``, else the global
    rank (right when all processes run on one machine, as with ``torch.multiprocessing.spawn``)."""
    value = _env_int("LOCAL_RANK")
    return get_rank() if value is None else value


def get_local_world_size() -> int:
    """Number of processes on this machine: :func:`fastload.device.local_world_size`."""
    return local_world_size()


def is_main_process() -> bool:
    """``True`` on global rank 0 (and in a single process)."""
    return get_rank() == 0


def _require_group(what: str) -> bool:
    """``True`` if a process group is initialized, ``False`` for a single process; raises for
    ``WORLD_SIZE`` > 1 without a group (this rank's share alone would be a wrong metric)."""
    if _group_ready():
        return True
    world = get_world_size()
    if world > 1:
        raise RuntimeError(
            f"{what} needs the process group: WORLD_SIZE={world} but torch.distributed is not "
            "initialized; call torch.distributed.init_process_group() first"
        )
    return False


def _comm_device(group: Any) -> torch.device:
    """Device for collective tensors: the current CUDA device for nccl, else the CPU."""
    backend = str(dist.get_backend(group))
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def reduce_sum(*values: Number | torch.Tensor, group: Any = None) -> Any:
    """Sums numbers and tensors over all ranks with a single ``all_reduce``, in float64 (integer
    counts exact up to ``2**53``). Every rank passes the same number of values and shapes, ranks
    with an empty shard too (zeros).

    Returns:
        One result per value (a tuple for several): an ``int`` or ``float`` for numbers, a tensor
        of the same shape and device (``int64`` if integral or bool, else ``float64``) for a tensor;
        a float wherever any rank passed a float.

    Raises:
        RuntimeError: ``WORLD_SIZE`` > 1 but no process group is initialized.

    Example:
        On 3 ranks holding 17, 17 and 16 of 50 samples, with 12, 15 and 9 correct::

            correct, total = reduce_sum(correct, total)    # (36, 50) on every rank
    """
    if not values:
        raise TypeError("reduce_sum() needs at least one value")
    flats: list[torch.Tensor] = []
    floats: list[bool] = []
    kinds: list[tuple[str, torch.Size, torch.device]] = []
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            if v.is_complex():
                raise TypeError(f"reduce_sum values should be real, but got values[{i}] of dtype {v.dtype}")
            is_float = v.is_floating_point()
            flats.append(v.detach().reshape(-1).to(torch.float64))
            kinds.append(("tensor", v.shape, v.device))
        elif isinstance(v, (bool, int, np.integer, np.bool_, float, np.floating)):
            is_float = isinstance(v, (float, np.floating))
            if not is_float and abs(int(v)) > _EXACT_INT_LIMIT:
                raise ValueError(
                    f"reduce_sum sums integers exactly up to 2**53, but got values[{i}]={int(v)}"
                )
            flats.append(torch.tensor([float(v)], dtype=torch.float64))
            kinds.append(("number", torch.Size(), torch.device("cpu")))
        else:
            raise TypeError(
                f"reduce_sum values should be numbers or tensors, but got values[{i}] of type "
                f"{type(v).__name__}"
            )
        floats.append(is_float)

    flags = torch.tensor([1.0 if f else 0.0 for f in floats], dtype=torch.float64)
    if _require_group("reduce_sum"):
        device = _comm_device(group)
        buffer = torch.cat([f.to(device) for f in flats] + [flags.to(device)])
        dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group)
        buffer = buffer.cpu()
    else:
        buffer = torch.cat([f.cpu() for f in flats] + [flags])

    results: list[Any] = []
    offset = 0
    any_float = buffer[-len(values) :] > 0
    for i, (kind, shape, device) in enumerate(kinds):
        size = flats[i].numel()
        part = buffer[offset : offset + size]
        offset += size
        is_float = bool(any_float[i])
        if kind == "tensor":
            out = part.reshape(shape)
            results.append((out if is_float else out.round().to(torch.int64)).to(device))
        else:
            x = float(part[0])
            results.append(x if is_float else int(round(x)))
    return results[0] if len(results) == 1 else tuple(results)


def _scalar_tensor(x: Number | torch.Tensor, device: torch.device) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.to(device)
    return torch.tensor(x, dtype=torch.float64 if isinstance(x, float) else torch.int64, device=device)


class Accumulator:
    """Named per-rank sums (e.g. ``correct`` and ``total``) reduced over ranks in one ``all_reduce``.

    Names are declared up front so that a rank with an empty shard still takes part in
    :meth:`reduce` with zeros. Tensors are summed on their device without synchronising.

    Example:
        >>> acc = Accumulator("correct", "total")
        >>> acc.update(correct=3, total=4)
        >>> acc.update(correct=torch.tensor(2), total=4)
        >>> acc.reduce()        # one process: the local sums
        {'correct': 5, 'total': 8}
    """

    def __init__(self, *names: str, group: Any = None) -> None:
        if not names:
            raise ValueError("Accumulator needs at least one name, e.g. Accumulator('correct', 'total')")
        for name in names:
            if not isinstance(name, str):
                raise TypeError(f"Accumulator names should be strings, but got {name!r}")
        if len(set(names)) != len(names):
            raise ValueError(f"Accumulator names should be unique, but got names={list(names)}")
        self.names: tuple[str, ...] = tuple(names)
        self.group = group
        self._sums: dict[str, Number | torch.Tensor] = {}
        self.reset()

    def __repr__(self) -> str:
        return f"Accumulator({', '.join(repr(n) for n in self.names)})"

    def reset(self) -> None:
        """Sets every sum back to 0."""
        self._sums = {name: 0 for name in self.names}

    def update(self, **values: Number | torch.Tensor) -> None:
        """Adds this rank's values, e.g. ``update(correct=(pred == y).sum(), total=len(y))``."""
        for name, value in values.items():
            if name not in self._sums:
                raise ValueError(f"unknown name {name!r}: this Accumulator sums {list(self.names)}")
            if isinstance(value, np.generic):
                value = value.item()
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    raise ValueError(
                        f"Accumulator values should be scalars, but got {name} with shape "
                        f"{tuple(value.shape)}"
                    )
                if value.is_complex():
                    raise TypeError(
                        f"Accumulator values should be real, but got {name} of dtype {value.dtype}"
                    )
                value = value.detach().reshape(())
            elif not isinstance(value, (int, float)):
                raise TypeError(
                    f"Accumulator values should be numbers or tensors, but got {name} of type "
                    f"{type(value).__name__}"
                )
            current = self._sums[name]
            if isinstance(value, torch.Tensor) or isinstance(current, torch.Tensor):
                device = value.device if isinstance(value, torch.Tensor) else current.device  # type: ignore[union-attr]
                a, b = _scalar_tensor(current, device), _scalar_tensor(value, device)
                dtype = torch.float64 if a.is_floating_point() or b.is_floating_point() else torch.int64
                self._sums[name] = a.to(dtype) + b.to(dtype)
            else:
                self._sums[name] = current + value

    def local(self) -> dict[str, Number]:
        """This rank's sums, without communication."""
        return {name: v.item() if isinstance(v, torch.Tensor) else v for name, v in self._sums.items()}

    def reduce(self) -> dict[str, Number]:
        """The sums over all ranks (``int`` or ``float``), on every rank: every rank must call it."""
        totals = reduce_sum(*(self._sums[name] for name in self.names), group=self.group)
        if len(self.names) == 1:
            totals = (totals,)
        return {
            n: v.item() if isinstance(v, torch.Tensor) else v
            for n, v in zip(self.names, totals, strict=False)
        }


def _check_coverage(all_indices: np.ndarray, dataset_size: int) -> str | None:
    """An error message if ``all_indices`` is not exactly ``range(dataset_size)``, each once."""
    if all_indices.size:
        low, high = int(all_indices.min()), int(all_indices.max())
        if low < 0 or high >= dataset_size:
            bad = low if low < 0 else high
            return f"index {bad} is out of range for dataset_size={dataset_size}"
    counts = np.bincount(all_indices, minlength=dataset_size) if dataset_size else np.zeros(0, np.int64)
    repeated = np.flatnonzero(counts > 1)
    if repeated.size:
        return (
            f"{repeated.size} indices were given more than once across ranks, e.g. {repeated[:5].tolist()}; "
            "each sample must be gathered exactly once (a padding sampler such as "
            "torch.utils.data.DistributedSampler repeats samples: use fastload.DistributedSampler)"
        )
    missing = np.flatnonzero(counts == 0)
    if missing.size:
        return (
            f"{missing.size} of {dataset_size} indices are missing across ranks, e.g. {missing[:5].tolist()} "
            "(was the sampler created with drop_last=True?)"
        )
    return None


def _assemble(
    parts: Sequence[torch.Tensor],
    part_indices: Sequence[np.ndarray],
    size: int,
    trailing: tuple,
    dtype,
    device,
) -> torch.Tensor:
    out = torch.empty((size, *trailing), dtype=dtype, device=device)
    for values, idx in zip(parts, part_indices, strict=False):
        if idx.size:
            out[torch.from_numpy(idx).to(device)] = values[: idx.size].to(device)
    return out


def gather_by_index(
    values: torch.Tensor | np.ndarray | Sequence[Any],
    indices: torch.Tensor | np.ndarray | Sequence[int],
    dataset_size: int | None = None,
    dst: int | None = None,
    group: Any = None,
) -> torch.Tensor | None:
    """Collects per-sample outputs from all ranks into one tensor in dataset order.

    Row ``i`` of the result is sample ``i``'s. The indices are checked on every rank before any
    data moves, so a duplicate or missing index raises ``ValueError`` on every rank alike.

    Args:
        values: Outputs of this rank's samples, shape ``(len(indices), ...)``, or a list of
            per-batch output tensors (empty on a rank with no samples).
        indices: Dataset index of each row of ``values`` (e.g. ``sampler.indices()``).
        dataset_size: Every index in ``range(dataset_size)`` must be present. Default: the total
            number of rows over ranks.
        dst: If given, only this (global) rank receives the result; the others return ``None``.

    Example:
        Dataset ``[0..6]`` on 3 ranks with ``shuffle=False``: rank 0 passes rows for indices
        ``[0, 3, 6]``, rank 1 for ``[1, 4]``, rank 2 for ``[2, 5]``; every rank gets 7 rows, row
        ``i`` from the rank that holds sample ``i``. With torch's padded sampler rank 1 would
        pass ``[1, 4, 0]`` and every rank raises ``ValueError`` (index 0 given twice).
    """
    if isinstance(values, torch.Tensor):
        values_t = values
    elif isinstance(values, (list, tuple)) and all(isinstance(v, torch.Tensor) for v in values):
        # per-batch outputs; an empty list (a rank with no samples) takes its shape from the others
        values_t = torch.cat(list(values)) if values else torch.zeros(0)
    else:
        values_t = torch.as_tensor(np.asarray(values))
    error: str | None = None
    idx = np.zeros(0, dtype=np.int64)
    try:
        if isinstance(indices, torch.Tensor):
            indices = indices.detach().cpu().numpy()
        idx_arr = np.asarray(indices)
        if idx_arr.size == 0:
            idx_arr = idx_arr.astype(np.int64)
        if idx_arr.ndim != 1 or idx_arr.dtype.kind not in "iu":
            raise ValueError(
                f"indices should be a 1-D sequence of integers, but got shape {idx_arr.shape} and dtype "
                f"{idx_arr.dtype}"
            )
        idx = idx_arr.astype(np.int64)
        if values_t.dim() == 0 or values_t.shape[0] != idx.size:
            raise ValueError(
                "values and indices should have the same length, but got "
                f"values of shape {tuple(values_t.shape)} and {idx.size} indices"
            )
        if dataset_size is not None and (
            isinstance(dataset_size, bool)
            or not isinstance(dataset_size, (int, np.integer))
            or dataset_size < 0
        ):
            raise ValueError(
                f"dataset_size should be a non-negative integer, but got dataset_size={dataset_size!r}"
            )
    except ValueError as exc:
        error = str(exc)
    trailing = tuple(values_t.shape[1:])
    dtype = values_t.dtype

    if not _require_group("gather_by_index"):
        if error is not None:
            raise ValueError(error)
        if dst not in (None, 0):
            raise ValueError(f"Invalid dst {dst}, dst should be in the interval [0, 0]")
        size = idx.size if dataset_size is None else int(dataset_size)
        problem = _check_coverage(idx, size)
        if problem:
            raise ValueError(f"gather_by_index: {problem}")
        return _assemble([values_t], [idx], size, trailing, dtype, values_t.device)

    world = dist.get_world_size(group)
    rank = dist.get_rank()
    if error is None and dst is not None and not (0 <= dst < dist.get_world_size()):
        error = f"Invalid dst {dst}, dst should be in the interval [0, {dist.get_world_size() - 1}]"
    meta = (error, idx, trailing, str(dtype).replace("torch.", ""), dataset_size)
    metas: list[Any] = [None] * world
    dist.all_gather_object(metas, meta, group=group)

    errors = [(r, m[0]) for r, m in enumerate(metas) if m[0] is not None]
    if errors:
        r, message = errors[0]
        raise ValueError(f"gather_by_index: on rank {r}: {message}")
    nonempty = {(m[2], m[3]) for m in metas if m[1].size}
    if len(nonempty) > 1:
        raise ValueError(
            "gather_by_index: ranks passed values with different per-sample shapes or dtypes: "
            + ", ".join(f"rank {r}: {m[2]} {m[3]}" for r, m in enumerate(metas) if m[1].size)
        )
    # every rank uses the same per-sample shape and dtype: the non-empty ranks', else rank 0's
    trailing, dtype_name = next(iter(nonempty)) if nonempty else (metas[0][2], metas[0][3])
    dtype = getattr(torch, dtype_name)
    all_idx = np.concatenate([m[1] for m in metas])
    size = all_idx.size if dataset_size is None else int(dataset_size)
    problem = _check_coverage(all_idx, size)
    if problem:
        raise ValueError(f"gather_by_index: {problem}")

    receives = dst is None or rank == dst
    counts = [m[1].size for m in metas]
    if max(counts) == 0:  # nothing to send (an empty dataset)
        return torch.empty((0, *trailing), dtype=dtype, device=values_t.device) if receives else None
    device = _comm_device(group)
    # gloo has no bool collectives: bools travel as uint8.
    wire_dtype = torch.uint8 if dtype == torch.bool else dtype
    buffer = torch.zeros((max(counts), *trailing), dtype=wire_dtype, device=device)
    if idx.size:
        buffer[: idx.size] = values_t.to(device=device, dtype=wire_dtype)
    received = [torch.empty_like(buffer) for _ in range(world)] if receives else None
    if dst is None:
        assert received is not None  # receives is True when dst is None (every rank receives)
        dist.all_gather(received, buffer, group=group)
    else:
        dist.gather(buffer, gather_list=received, dst=dst, group=group)
    if received is None:
        return None
    out = _assemble(received, [m[1] for m in metas], size, trailing, wire_dtype, values_t.device)
    return out.to(dtype)


def broadcast_object(obj: Any, src: int = 0, group: Any = None) -> Any:
    """Sends a picklable object from (global) rank ``src`` to every rank and returns it
    (without a process group: ``obj``), e.g.
    ``index = broadcast_object(scan_folder(root) if is_main_process() else None)``."""
    if not _require_group("broadcast_object"):
        if src != 0:
            raise ValueError(f"Invalid src {src}, src should be in the interval [0, 0]")
        return obj
    world = dist.get_world_size()
    if not (0 <= src < world):
        raise ValueError(f"Invalid src {src}, src should be in the interval [0, {world - 1}]")
    holder = [obj if dist.get_rank() == src else None]
    dist.broadcast_object_list(holder, src=src, group=group)
    return holder[0]
