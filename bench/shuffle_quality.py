"""Shuffle quality of the shard-aware order (``TarShards(shuffle_window=N)``) against a full permutation.

Usage: ``python bench/shuffle_quality.py [--samples N] [--classes C] [--shard-samples S] [--batch-size B]
[--epochs E] [--json PATH]``.

Labels only (no images): an ImageNet-like split (1,281,167 samples, 1,000 classes of 1,301
samples, a seventh of them about 10 % smaller) cut into shards of 1,250 samples, written either in
class order (a folder's order) or in a random order (what ``python -m fastload shards`` writes by
default). For ``shuffle_window`` 1, 2, 4, 8, 16 and a full permutation, every batch of 256
consecutive samples of the epoch's order (fastload's :func:`~fastload.sampler.blockwise_permutation`,
what one rank reads; on ``W`` ranks each rank's batches come from its own windows alike) is
measured by

* ``classes``: the number of distinct classes in the batch (mean over the epoch's batches);
* ``tv``: the total-variation distance of the batch's class histogram from the dataset's
  (``0.5 * sum |h_c / B - p_c|``, mean over the epoch's batches; a batch of 256 of 1,000 classes
  is far from the dataset even when drawn uniformly, so compare with the full permutation's).

Each number is the median over ``--epochs`` epochs; ``vs full`` is the ratio to the full permutation.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from fastload.rng import epoch_permutation
from fastload.sampler import blockwise_permutation
from fastload.synthetic import IMAGENET_TRAIN_FILES

WINDOWS = (1, 2, 4, 8, 16)


def class_sizes(samples: int, classes: int, seed: int = 0) -> np.ndarray:
    """ImageNet-like class sizes: ``1.015 * samples / classes`` (1,301 for ImageNet), a seventh of
    the classes smaller, summing to ``samples``."""
    rng = np.random.default_rng(seed)
    top = -(-samples * 1015 // (1000 * classes))
    sizes = np.full(classes, top, dtype=np.int64)
    short = rng.choice(classes, max(1, classes // 7), replace=False)
    sizes[short] -= rng.multinomial(int(sizes.sum()) - samples, np.full(len(short), 1 / len(short)))
    return sizes


def batch_measures(labels: np.ndarray, p: np.ndarray, batch_size: int) -> tuple[float, float]:
    """``(mean distinct classes, mean total-variation distance)`` over the full batches of ``labels``."""
    nb = len(labels) // batch_size
    batches = np.sort(labels[: nb * batch_size].reshape(nb, batch_size), axis=1)
    distinct = 1 + np.count_nonzero(np.diff(batches, axis=1), axis=1)
    c = len(p)
    hist = np.bincount((batches + c * np.arange(nb)[:, None]).ravel(), minlength=nb * c).reshape(nb, c)
    tv = 0.5 * np.abs(hist / batch_size - p).sum(axis=1)
    return float(distinct.mean()), float(tv.mean())


def run(samples: int, classes: int, shard_samples: int, batch_size: int, epochs: int) -> dict:
    sizes = class_sizes(samples, classes)
    p = sizes / samples
    by_class = np.repeat(np.arange(classes), sizes)
    layouts = {"class order": by_class, "random order": np.random.default_rng(1).permutation(by_class)}
    starts = np.append(np.arange(0, samples, shard_samples), samples)
    rows = []
    for layout, labels in layouts.items():
        for window in (*WINDOWS, None):
            measured = []
            for epoch in range(epochs):
                if window is None:
                    order = epoch_permutation(samples, 0, epoch).numpy()
                else:
                    order = blockwise_permutation(starts, window, 0, epoch)
                measured.append(batch_measures(labels[order], p, batch_size))
            rows.append(
                {
                    "layout": layout,
                    "window": window,
                    "classes": statistics.median(m[0] for m in measured),
                    "tv": statistics.median(m[1] for m in measured),
                }
            )
    for row in rows:
        full = next(r for r in rows if r["layout"] == row["layout"] and r["window"] is None)
        row["classes_vs_full"] = row["classes"] / full["classes"]
        row["tv_vs_full"] = row["tv"] / full["tv"]
    return {
        "samples": samples,
        "classes": classes,
        "class_sizes": f"{int(sizes.min())}-{int(sizes.max())}",
        "shards": len(starts) - 1,
        "batch_size": batch_size,
        "epochs": epochs,
        "rows": rows,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=IMAGENET_TRAIN_FILES)
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--shard-samples", type=int, default=1250, help="samples per shard")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--epochs", type=int, default=3, help="epochs measured (medians)")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    t0 = time.perf_counter()
    record = run(args.samples, args.classes, args.shard_samples, args.batch_size, args.epochs)
    print(
        f"{record['samples']:,} samples, {record['classes']} classes ({record['class_sizes']} samples), "
        f"{record['shards']} shards, "
        f"batches of {record['batch_size']}, medians over {record['epochs']} epochs"
    )
    print("| shards written in | shuffle_window | classes per batch | vs full | TV distance | vs full |")
    print("|---|---|---|---|---|---|")
    for r in record["rows"]:
        window = "full permutation" if r["window"] is None else r["window"]
        print(
            f"| {r['layout']} | {window} | {r['classes']:.1f} | {r['classes_vs_full']:.2f} "
            f"| {r['tv']:.3f} | {r['tv_vs_full']:.2f} |"
        )
    worst = min(
        (r for r in record["rows"] if r["layout"] == "random order" and r["window"] is not None),
        key=lambda r: r["classes_vs_full"],
    )
    print(
        f"verdict: shards in a random order keep at least {worst['classes_vs_full']:.0%} of a full "
        f"permutation's classes per batch at any window ({time.perf_counter() - t0:.1f} s)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
