"""Helpers shared by the loader tests: collect a pass's batches, compare two collections bitwise."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def collect(
    loader: Iterable[tuple[torch.Tensor, torch.Tensor]], limit: int | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One pass (or its first ``limit`` batches) as copies: the loader reuses its buffers."""
    out = []
    for k, (x, y) in enumerate(loader):
        out.append((x.clone(), y.clone()))
        if limit is not None and k + 1 == limit:
            break
    return out


def same(a: list[tuple[torch.Tensor, torch.Tensor]], b: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Whether two collections hold the same batches, bit for bit, in the same order."""
    return len(a) == len(b) and all(
        torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(a, b, strict=True)
    )
