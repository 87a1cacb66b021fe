"""Encoded files as slices of one buffer (:class:`ByteSlices`), for code that takes a batch's
files at once: fastload's in-memory datasets hand them out, nvImageCodec's C interface
(:mod:`fastload.gpu.nvimgcodec`) reads them as columns."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, overload

import numpy as np


class ByteSlices(Sequence[np.ndarray]):
    """A sequence of 1-D uint8 arrays (``slices[k]``: a view of ``data[starts[k]:ends[k]]``) whose
    columns code that takes a whole batch reads, with no Python object per file."""

    __slots__ = ("data", "starts", "ends")

    def __init__(self, data: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> None:
        self.data, self.starts, self.ends = data, starts, ends

    def __len__(self) -> int:
        return len(self.starts)

    @overload
    def __getitem__(self, k: int) -> np.ndarray: ...

    @overload
    def __getitem__(self, k: slice) -> ByteSlices: ...

    def __getitem__(self, k: int | slice) -> np.ndarray | ByteSlices:
        if isinstance(k, slice):
            return ByteSlices(self.data, self.starts[k], self.ends[k])
        return self.data[int(self.starts[k]) : int(self.ends[k])]

    def __iter__(self) -> Iterator[np.ndarray]:
        return (self.data[a:b] for a, b in zip(self.starts.tolist(), self.ends.tolist(), strict=True))

    def take(self, positions: Any) -> ByteSlices:
        """The files at ``positions`` (a sequence of positions in this one)."""
        positions = np.asarray(positions, dtype=np.int64)
        return ByteSlices(self.data, self.starts[positions], self.ends[positions])
