"""How many validation samples a padding sampler counts twice, and what that does to accuracy.

torch's ``DistributedSampler`` pads every rank to ``ceil(N / W)`` samples by repeating the first
``ceil(N / W) * W - N`` samples of the order, so a metric summed over ranks is computed over
more than ``N`` samples. fastload's ``DistributedSampler`` does not pad. For each world size this
script runs both samplers over all ranks (one process, explicit ``num_replicas``/``rank``) and
counts what they actually yield: duplicates, missing samples, per-rank lengths.

The error bound: with ``d`` duplicates the reported accuracy is ``(c + c_d) / (N + d)`` where
``c`` is the number of correct samples and ``c_d`` (between 0 and ``d``) the number of correct
duplicates, so it differs from the true accuracy ``c / N`` by at most ``d / (N + d)`` (the
worst case: all duplicates right while the model is almost always wrong, or the reverse).

Usage: ``python bench/distributed_eval.py [--n 50000] [--world-sizes 3,6,7,12,64] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from torch.utils.data import DistributedSampler as TorchDistributedSampler

from fastload.sampler import DistributedSampler

IMAGENET_VAL = 50_000


def _count(n: int, world: int, make: Callable[[int], Any]) -> dict[str, Any]:
    """Runs the sampler of every rank and counts what they yield together."""
    counts: Counter[int] = Counter()
    lengths = []
    for rank in range(world):
        indices = list(make(rank))
        lengths.append(len(indices))
        counts.update(indices)
    yielded = sum(lengths)
    duplicates = yielded - len(counts)
    return {
        "yielded": yielded,
        "duplicates": duplicates,
        "missing": n - len(counts),
        "min_per_rank": min(lengths),
        "max_per_rank": max(lengths),
        "max_error_bound": duplicates / (n + duplicates) if n + duplicates else 0.0,
    }


def measure(n: int, world_sizes: Sequence[int], shuffle: bool = False, seed: int = 0) -> list[dict[str, Any]]:
    """One record per (world size, sampler)."""
    records = []
    for world in world_sizes:
        kwargs = dict(num_replicas=world, shuffle=shuffle, seed=seed)
        samplers: dict[str, Callable[[int], Any]] = {
            "torch": lambda r, kw=kwargs: TorchDistributedSampler(range(n), rank=r, **kw),
            "fastload": lambda r, kw=kwargs: DistributedSampler(range(n), rank=r, **kw),
        }
        for name, make in samplers.items():
            record = {"n": n, "world_size": world, "sampler": name, "shuffle": shuffle}
            records.append({**record, **_count(n, world, make)})
    return records


def _table(records: list[dict[str, Any]]) -> str:
    header = (
        f"{'world':>5}  {'sampler':<8}  {'per rank':>11}  {'counted':>7}  {'dupl.':>5}  {'missing':>7}  "
        f"{'max acc. error':>14}"
    )
    lines = [header, "-" * len(header)]
    for r in records:
        low, high = r["min_per_rank"], r["max_per_rank"]
        per_rank = f"{low}" if low == high else f"{low}-{high}"
        lines.append(
            f"{r['world_size']:>5}  {r['sampler']:<8}  {per_rank:>11}  {r['yielded']:>7}  "
            f"{r['duplicates']:>5}  "
            f"{r['missing']:>7}  {100 * r['max_error_bound']:>13.4f}%"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--n", type=int, default=IMAGENET_VAL, help="dataset size (default: ImageNet val, 50000)"
    )
    parser.add_argument(
        "--world-sizes",
        default="3,6,7,12,64",
        help="comma-separated numbers of ranks (default: 3,6,7,12,64)",
    )
    parser.add_argument("--shuffle", action="store_true", help="shuffle (the counts do not change)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the records to this JSON file")
    args = parser.parse_args(argv)
    try:
        world_sizes = [int(w) for w in args.world_sizes.split(",") if w.strip()]
    except ValueError:
        parser.error(f"--world-sizes should be comma-separated integers, but got {args.world_sizes!r}")
    if args.n < 0 or not world_sizes or min(world_sizes) < 1:
        parser.error("--n should be >= 0 and every world size >= 1")

    records = measure(args.n, world_sizes, shuffle=args.shuffle)
    print(f"Evaluating N={args.n} samples on W ranks; every rank's sampler run and its indices counted.")
    print(_table(records))
    print(
        "\ncounted = samples evaluated over all ranks; dupl. = extra evaluations of samples already "
        "counted;\n"
        "max acc. error = dupl. / (N + dupl.): how far the accuracy summed over ranks can be from the\n"
        "single-process accuracy at worst (0 means it is exactly the single-process accuracy)."
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(records, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
