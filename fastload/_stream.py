"""Batches built in place for torch's worker loop, in shared-memory segments each worker reuses.

In the process workers ``fastload.DataLoader`` starts on torch's path (:func:`enable`), a fastload
dataset's ``__getitems__`` (:func:`fetch`) copies each sample's top-level plain tensors into their
rows of one batch tensor as the sample is made, and :func:`collate` returns that tensor where
``default_collate`` would stack the rows: the same batch, one batch held instead of two. Anything
else (other types, a shape or dtype that differs from the first sample's) goes to torch's collate.
Outside such a worker :func:`fetch` is ``[dataset[i] for i in indices]`` and :func:`collate` is
``default_collate``.

A worker with a ring table (:func:`ring_table`) builds a streamed batch of at least
:data:`RING_MIN_BYTES` in one of its own segments (:class:`WorkerRing`), which the main process
frees once nothing refers to it (:class:`MainRing`); :class:`RingedCollate` does the same for a
user's ``collate_fn``. The rules: docs/how-it-works.md, "Worker memory and start-up at ImageNet scale".
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.multiprocessing.reductions import shared_cache as _shared_cache  # by (inode, device)
from torch.utils.data._utils.collate import collate as _torch_collate  # extends default_collate
from torch.utils.data._utils.collate import collate_tensor_fn, default_collate_fn_map

from ._shm import contiguous_strides, shared_empty, shared_storage

# A weak reference to a storage may be kept from torch 2.2 on: torch 2.1 leaves one set past the
# storage's last reference, which crashes the garbage collector at interpreter exit.
_STORAGE_WEAKREFS = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 2)

_ENABLED = False

RING_MIN_BYTES = 1 << 20  # a smaller streamed batch is not put into a ring segment

# A ring table's columns, one row per segment; the last worker row's first cell is the pass number.
_INODE, _SENT, _PASS, _FREED = range(4)
_ABANDONED = -1  # the free count of a segment the main process sent on: its worker drops it


def ring_table(num_workers: int, capacity: int) -> torch.Tensor:
    """The shared, empty table of ``num_workers`` rings of ``capacity`` segments: per segment its
    file's inode, sends, the pass of the last send and sends freed (free when freed == sent)."""
    return shared_empty((num_workers + 1, capacity, 4), torch.int64).zero_()


class WorkerRing:
    """A worker's side of a ring table: the segments it made, which are free, which are sent."""

    def __init__(self, table: torch.Tensor, worker_id: int) -> None:
        self.table = table  # keeps the mapping
        self.rows = table[worker_id].numpy()
        self.pass_cell = table[-1, 0].numpy()
        self.storages: list[torch.UntypedStorage | None] = [None] * self.rows.shape[0]
        self.claimed: dict[int, int] = {}  # data_ptr -> segment, for the batch being built
        self.lock = threading.Lock()  # take() against drop_free() from the idle thread

    def begin(self) -> None:
        """A new batch: segments claimed for the previous one and not sent are free again."""
        with self.lock:
            self.claimed.clear()

    def drop_free(self) -> None:
        """The worker is idle: its free segments go back to the system (made again when needed)."""
        with self.lock:
            self._drop_abandoned()
            claimed = set(self.claimed.values())
            for k in range(len(self.storages)):
                if self._free(k, claimed):
                    self.rows[k, _INODE] = 0
                    self.storages[k] = None

    def _free(self, k: int, claimed: set[int]) -> bool:
        """Segment ``k`` is made, not claimed for this batch, and freed by the main process."""
        return (
            self.storages[k] is not None and k not in claimed and self.rows[k, _FREED] == self.rows[k, _SENT]
        )

    def take(self, nbytes: int) -> torch.UntypedStorage | None:
        """A free segment of exactly ``nbytes`` (made if there is room), or ``None``."""
        if nbytes < RING_MIN_BYTES:
            return None
        with self.lock:
            return self._take(nbytes)

    def _drop_abandoned(self) -> None:
        """Lets go of the segments the main process sent on to another process (never reused)."""
        rows = self.rows
        for k, storage in enumerate(self.storages):
            if storage is not None and rows[k, _FREED] == _ABANDONED:
                self.storages[k] = None
                rows[k, _INODE] = 0
                rows[k, _FREED] = rows[k, _SENT]

    def _take(self, nbytes: int) -> torch.UntypedStorage | None:
        self._drop_abandoned()
        claimed = set(self.claimed.values())
        empty = None
        for k, storage in enumerate(self.storages):
            if storage is None:
                empty = k if empty is None else empty
            elif storage.nbytes() == nbytes and self._free(k, claimed):
                self.claimed[storage.data_ptr()] = k
                return storage
        if empty is None:  # no room: a free segment of another size makes way (the batch size changed)
            empty = next((k for k in range(len(self.storages)) if self._free(k, claimed)), None)
            if empty is None:
                return None
        storage = shared_storage(nbytes)  # memfd where it can: /dev/shm's size does not limit it
        self.rows[empty, _INODE] = os.fstat(storage._get_shared_fd()).st_ino  # type: ignore[attr-defined]
        self.storages[empty] = storage
        self.claimed[storage.data_ptr()] = empty
        return storage

    def sent(self, batch: torch.Tensor) -> None:
        """``batch`` goes to the main process: if it is in a segment, that segment is busy until freed."""
        with self.lock:
            k = self.claimed.pop(batch.untyped_storage().data_ptr(), None)
            if k is not None:
                self.rows[k, _PASS] = self.pass_cell[0]
                self.rows[k, _SENT] += 1


def drop_idle_ring() -> None:
    """This worker is idle: its free ring segments go back to the system (see :class:`WorkerRing`)."""
    if _RING is not None:
        _RING.drop_free()


def _sent_on(key: Any, cached: Any) -> bool:
    """Whether this process sent the storage on since it arrived: torch puts a new entry into its
    shared-storage cache each time it pickles a shared storage."""
    return _shared_cache.get(key) is not cached


class MainRing:
    """The main process's side of a ring table (used from the thread that iterates torch's iterator)."""

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table
        self.rows = table[:-1].numpy()
        self.pass_cell = table[-1, 0].numpy()
        # (worker, k) -> [storage kept mapped, send count to free or 0, inode, shared_cache key and entry]
        self.held: dict[tuple[int, int], list[Any]] = {}
        self.by_storage: dict[int, tuple[int, int]] = {}  # storage _cdata -> segment
        self.finalizing: set[tuple[int, int]] = set()

    def _segment(self, storage: torch.UntypedStorage) -> tuple[int, int] | None:
        seg = self.by_storage.get(storage._cdata)
        if seg is not None:
            return seg
        try:
            stat = os.fstat(storage._get_shared_fd())  # type: ignore[attr-defined]
        except (RuntimeError, OSError):  # not a segment shared by descriptor
            return None
        inode = stat.st_ino
        found = (self.rows[:, :, _INODE] == inode).nonzero()
        if len(found[0]) == 0:
            return None
        seg = (int(found[0][0]), int(found[1][0]))
        self._drop(seg)  # a mapping of it kept from before (or of the segment it replaced)
        key = (stat.st_ino, stat.st_dev)  # torch's key (reductions.fd_id)
        cached = _shared_cache.get(key)
        self.held[seg] = [storage, 0, inode, key, cached]
        self.by_storage[storage._cdata] = seg
        return seg

    def _drop(self, seg: tuple[int, int]) -> None:
        old = self.held.pop(seg, None)
        if old is not None:
            self.by_storage.pop(old[0]._cdata, None)

    def received(self, batch: Any) -> None:
        """Notes the segments ``batch`` (as torch's iterator returned it) arrived in."""
        items = [batch] if type(batch) is torch.Tensor else batch if type(batch) in (tuple, list) else ()
        for value in items:
            if not _plain(value):  # a ring segment holds a dense tensor: nothing else has a storage
                continue
            storage = value.untyped_storage()
            if storage.nbytes() < RING_MIN_BYTES:
                continue
            seg = self._segment(storage)
            if seg is not None:
                self.held[seg][1] = int(self.rows[seg[0], seg[1], _SENT])

    def poll(self) -> None:
        """Frees the received segments nothing here refers to; forgets those their worker dropped."""
        gone = []
        for (w, k), entry in list(self.held.items()):
            if entry[1] and torch._C._storage_Use_Count(entry[0]._cdata) == 1:
                if _sent_on(entry[3], entry[4]):
                    self.rows[w, k, _FREED] = _ABANDONED
                    gone.append((w, k))
                    continue
                self.rows[w, k, _FREED] = entry[1]
                entry[1] = 0
            if not entry[1] and self.rows[w, k, _INODE] != entry[2]:
                gone.append((w, k))
        for seg in gone:
            self._drop(seg)

    def release(self) -> None:
        """The end of a pass: lets go of every mapping, so idle workers can drop their segments. A
        segment still in use is freed by a finalizer when that use ends (torch 2.1: at the next
        pass's :meth:`poll`)."""
        self.poll()
        for seg, entry in list(self.held.items()):
            if entry[1]:
                if not _STORAGE_WEAKREFS:
                    continue
                self.finalizing.add(seg)
                weakref.finalize(entry[0], self._finalized, seg, entry[1], entry[3], entry[4])
            self._drop(seg)

    def _finalized(self, seg: tuple[int, int], count: int, key: Any, cached: Any) -> None:
        """The last tensor of a segment let go of in use is gone (any thread): it is free."""
        self.rows[seg[0], seg[1], _FREED] = _ABANDONED if _sent_on(key, cached) else count
        self.finalizing.discard(seg)

    def pass_number(self) -> int:
        return int(self.pass_cell[0])

    def new_pass(self) -> None:
        """Before torch's iterator starts a pass on persistent workers: later sends carry its number."""
        self.pass_cell[0] += 1

    def recover(self) -> None:
        """Once torch's iterator has started the pass: the earlier passes' sends never received here
        (torch dropped them) are free once unused."""
        rows, now = self.rows, self.pass_cell[0]
        freed = rows[:, :, _FREED]
        lost = (rows[:, :, _PASS] < now) & (freed < rows[:, :, _SENT]) & (freed != _ABANDONED)
        for w, k in zip(*lost.nonzero(), strict=True):
            seg = (int(w), int(k))
            if seg in self.finalizing:
                continue  # received, and still in use here: its finalizer frees it
            entry = self.held.get(seg)
            if entry is None:
                rows[seg[0], seg[1], _FREED] = rows[seg[0], seg[1], _SENT]  # never mapped here
            else:
                entry[1] = int(rows[seg[0], seg[1], _SENT])

    def clear(self) -> None:
        """Lets the segments go (their workers are stopping)."""
        self.held.clear()
        self.by_storage.clear()


_ROW = "_fastload_row"  # a streamed row's attribute: (batch tensor, row number)


_RING: WorkerRing | None = None
_IN_WORKER = False  # a torch worker fastload started (enable / enable_ring ran)


def enable(ring: torch.Tensor | None = None, worker_id: int = 0) -> None:
    """Streams the batches of fastload datasets in this process (a worker's start calls it),
    into the segments of row ``worker_id`` of the ring table ``ring``, if given."""
    global _ENABLED
    _ENABLED = True
    enable_ring(ring, worker_id)


def enable_ring(ring: torch.Tensor | None, worker_id: int = 0) -> None:
    """A worker's start with a user's ``collate_fn`` (:class:`RingedCollate`): its large outputs
    go into row ``worker_id`` of ``ring``, if given, without streaming."""
    global _RING, _IN_WORKER
    _IN_WORKER = True
    shared_fd = torch.multiprocessing.get_sharing_strategy() == "file_descriptor"
    _RING = WorkerRing(ring, worker_id) if ring is not None and shared_fd else None


def enabled() -> bool:
    """Whether :func:`fetch` streams in this process."""
    return _ENABLED


def _plain(value: Any) -> bool:
    """Exactly ``torch.Tensor``, strided, not nested, on the CPU; anything else goes to torch's code."""
    return (
        type(value) is torch.Tensor
        and value.layout == torch.strided
        and not value.is_nested
        and value.device.type == "cpu"
    )


def _streamable(value: Any) -> bool:
    return _plain(value) and not value.requires_grad


def _batch_tensor(first: torch.Tensor, n: int) -> torch.Tensor:
    """``(n, *first.shape)`` of ``first``'s dtype, in shared memory inside a worker (as default_collate)."""
    if torch.utils.data.get_worker_info() is not None:
        if _RING is not None:
            segment = _RING.take(n * first.numel() * first.element_size())
            if segment is not None:
                shape = (n, *first.shape)
                return torch.empty(0, dtype=first.dtype).set_(segment, 0, shape, contiguous_strides(shape))
        return shared_empty((n, *first.shape), first.dtype)  # as default_collate's, not in /dev/shm
    return torch.empty((n, *first.shape), dtype=first.dtype)


def fetch(dataset: Any, indices: Sequence[int]) -> list[Any]:
    """``[dataset[i] for i in indices]``, the tensors written into batch tensors where streaming is on."""
    if not _ENABLED:
        return [dataset[i] for i in indices]
    n = len(indices)
    if _RING is not None:
        _RING.begin()
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
    batch: Sequence[torch.Tensor],
    *,
    collate_fn_map: dict[Any, Callable[..., Any]] | None = None,
    wholes: list[torch.Tensor] | None = None,
) -> Any:
    whole = _stacked(batch)
    if whole is not None:
        if wholes is not None:
            wholes.append(whole)
        return whole
    elem = batch[0]
    if _ENABLED and _streamable(elem) and torch.utils.data.get_worker_info() is not None:
        # default_collate's stack into shared memory, in a memfd rather than /dev/shm
        return torch.stack(list(batch), 0, out=shared_empty((len(batch), *elem.shape), elem.dtype))
    return collate_tensor_fn(batch, collate_fn_map=collate_fn_map)


def collate(batch: list[Any]) -> Any:
    """``default_collate``, returning a streamed batch tensor itself instead of stacking its rows."""
    wholes: list[torch.Tensor] = []
    tensor_fn = functools.partial(_collate_tensor, wholes=wholes)
    out = _torch_collate(batch, collate_fn_map={**default_collate_fn_map, torch.Tensor: tensor_fn})
    if _RING is not None:  # only now: a batch whose collate raised is not sent, its segments stay free
        for whole in wholes:
            _RING.sent(whole)
    return out


def _stack_in_process(batch: Sequence[torch.Tensor], *, collate_fn_map: Any = None) -> Any:
    """``collate_tensor_fn`` into this process's memory instead of a new shared segment."""
    elem = batch[0]
    if not _plain(elem):
        return collate_tensor_fn(batch, collate_fn_map=collate_fn_map)
    out = torch.empty((len(batch), *elem.shape), dtype=elem.dtype)
    return torch.stack(list(batch), 0, out=out)


def _ringable(value: Any) -> bool:
    """A large tensor that is its whole, contiguous, unshared storage (torch would move it to send it)."""
    return bool(
        _plain(value)
        and not value.requires_grad
        and value.nbytes >= RING_MIN_BYTES
        and value.is_contiguous()
        and value.storage_offset() == 0
        and value.untyped_storage().nbytes() == value.nbytes
        and not value.is_shared()
    )


def _into_ring(out: Any, ring: WorkerRing) -> Any:
    """``out`` with each large top-level tensor copied into a free ring segment and marked sent."""
    bare = type(out) is torch.Tensor
    if not bare and type(out) not in (tuple, list):
        return out
    items = [out] if bare else list(out)
    changed = False
    for j, value in enumerate(items):
        if not _ringable(value):
            continue
        segment = ring.take(value.nbytes)
        if segment is None:
            continue
        moved = torch.empty(0, dtype=value.dtype).set_(segment, 0, value.shape, value.stride())
        moved.copy_(value)
        ring.sent(moved)
        items[j] = moved
        changed = True
    if not changed:
        return out
    return items[0] if bare else type(out)(items)


class RingedCollate:
    """A user's ``collate_fn`` in torch's workers: ``default_collate`` called inside it stacks into
    this process's memory, and each large top-level tensor it returns is copied into one of the
    worker's reused segments (:func:`enable_ring`)."""

    def __init__(self, fn: Callable[[list[Any]], Any]) -> None:
        self.fn = fn

    def __call__(self, batch: list[Any]) -> Any:
        ring = _RING
        if not _IN_WORKER:
            return self.fn(batch)
        if ring is not None:
            ring.begin()
        saved = default_collate_fn_map.get(torch.Tensor)
        default_collate_fn_map[torch.Tensor] = _stack_in_process
        try:
            out = self.fn(batch)
        finally:
            if saved is not None:
                default_collate_fn_map[torch.Tensor] = saved
        return out if ring is None else _into_ring(out, ring)

    def __repr__(self) -> str:
        return f"RingedCollate({self.fn!r})"
