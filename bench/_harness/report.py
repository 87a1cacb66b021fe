"""What a run prints and draws: the table, its legend, the verdict line and the plot.

The columns are explained by :data:`LEGEND` (printed under the table and in ``--help``);
:func:`verdict` is the one line ``make bench`` ends with. matplotlib is imported only by
:func:`plot` (the ``bench`` extra).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .backends import BACKENDS
from .config import REFERENCE

LEGEND = f"""\
images/s     median of --repeat timed runs of --batches batches each (by default 3x the batches
             the workers hold prefetched, after a warm-up that drains them: the steady state);
             the time ends when a batch is a normalized float tensor on the device
min-max      the slowest and the fastest of those runs (one run: -)
vs tv        images/s divided by the torchvision row's (same pipeline and workers, same run)
vs decode    images/s divided by the {REFERENCE} row's: above 1.00 the pipeline is faster than
             fully decoding every image, as fastload is when it decodes only the crop or at a
             reduced scale
?            after a ratio: one of the two rows' min-max spread is larger than the difference of
             their medians, so the ratio is within the noise (more --repeat/--batches, a quieter
             machine)
stall        (with --step-ms) share of the time the loop waited for data between model steps
CPU %        CPU time of the benchmark process and its workers per second (100 = one core busy)
PSS MB       memory of the benchmark process and its workers: proportional set size, a page
             shared by k processes counts 1/k in each, so shared memory counts once. It
             includes the benchmark process itself, whose share grows as rows run (e.g. the
             in-memory datasets the memory rows keep): later rows carry what earlier ones left
{REFERENCE:<12} reference, not a pipeline: a full-size PIL decode to RGB of the same files (no
             crop, resize or batching), one process's rate x min(max(1, workers), CPUs),
             measured just before and just after the rows of each worker count (both sets of
             runs), so that a machine whose speed drifts moves it along with those rows
-            no value: one run (min-max), no torchvision or {REFERENCE} row in this run (vs tv,
             vs decode), the reference row (CPU %, PSS MB)"""


def legend(stall: bool = True, records: Sequence[dict[str, Any]] | None = None) -> str:
    """:data:`LEGEND`, without the ``stall`` entry for a table that has no stall column.

    Given ``records``, the legend of that table only: what each printed row is, then the columns
    it has (no ``vs decode`` entry without a reference row).
    """
    lines = LEGEND.splitlines()
    if not stall:
        lines = _without_entry(lines, "stall ")
    if records is None:
        return "\n".join(lines)
    names = list(dict.fromkeys(r["backend"] for r in records))
    lines = _without_entry(lines, f"{REFERENCE:<12} ")
    if REFERENCE not in names:
        lines = _without_entry(_without_entry(lines, "vs decode "), "-            ")
        lines.append("-            no value: one run (min-max), no torchvision row in this run (vs tv)")
    rows = [
        f"  {name:<16} "
        + (
            BACKENDS[name].description
            if name in BACKENDS
            else "reference, not a pipeline: full-size PIL decode rate x cores (see --help)"
        )
        for name in names
    ]
    return "\n".join(["rows:", *rows, "columns:", *("  " + line for line in lines)])


def _without_entry(lines: list[str], key: str) -> list[str]:
    """``lines`` without the legend entry that starts with ``key`` (and its indented continuation)."""
    out, skipping = [], False
    for line in lines:
        if line.startswith(key):
            skipping = True
            continue
        if skipping and line.startswith(" "):
            continue
        skipping = False
        out.append(line)
    return out


def verdict(records: Sequence[dict[str, Any]]) -> str | None:
    """The one line ``make bench`` answers with: the one-line swap's (and fastload's own pipeline's)
    images/s over torch's, at the largest worker count measured, per pipeline.

    Example: ``the one-line swap: 3.0x torch's images/s on this machine (train, 2 workers); val
    3.1x. fastload's own pipeline: 3.4x (train), 3.3x (val)``.
    """
    by_key = {(r["backend"], r["pipeline"], r["num_workers"]): r for r in records}
    workers = max((r["num_workers"] for r in records), default=None)
    pipelines = list(dict.fromkeys(r["pipeline"] for r in records))

    noisy = False

    def ratios(backend: str) -> list[tuple[str, str]]:
        nonlocal noisy
        out = []
        for p in pipelines:
            r = by_key.get((backend, p, workers))
            if r is not None and r["ratio_vs_torchvision"] is not None:
                flag = "?" if r["within_noise_vs_torchvision"] else ""
                noisy |= bool(flag)
                out.append((p, f"{r['ratio_vs_torchvision']:.1f}x{flag}"))
        return out

    swap, own = ratios("swap"), ratios("fastload")
    if not swap and not own:
        return None
    parts = []
    if swap:
        (p0, r0), rest = swap[0], swap[1:]
        parts.append(
            f"the one-line swap: {r0} torch's images/s on this machine ({p0}, {workers} workers)"
            + "".join(f"; {p} {r}" for p, r in rest)
        )
    if own:
        parts.append("fastload's own pipeline: " + ", ".join(f"{r} ({p})" for p, r in own))
    line = ". ".join(parts)
    if noisy:
        line += " (?: within the run-to-run noise of this machine; more --repeat or a quieter machine)"
    return line


def table_header(stall: bool, decode: bool = True) -> str:
    return (
        f"{'backend':<16} {'pipeline':<8} {'workers':>7} {'images/s':>9} {'min-max':>11} "
        f"{'vs tv':>6}"
        + (f" {'vs decode':>10}" if decode else "")
        + (f" {'stall':>6}" if stall else "")
        + f" {'CPU %':>6} {'PSS MB':>7}"
    )


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _ratio(value: float | None, noisy: bool | None) -> str:
    return "-" if value is None else f"{value:.2f}" + ("?" if noisy else " ")


def table_row(r: dict[str, Any], decode: bool = True) -> str:
    pss = None if r["pss_bytes"] is None else r["pss_bytes"] / 2**20
    runs = r["images_per_s_runs"]
    spread = f"{r['images_per_s_min']:.0f}-{r['images_per_s_max']:.0f}" if len(runs) > 1 else "-"
    stall = f" {_fmt(r['stall_fraction'], '.2f'):>6}" if r["step_ms"] else ""
    return (
        f"{r['backend']:<16} {r['pipeline']:<8} {r['num_workers']:>7} {r['images_per_s']:>9.1f} "
        f"{spread:>11} {_ratio(r['ratio_vs_torchvision'], r['within_noise_vs_torchvision']):>7}"
        + (f"{_ratio(r['ratio_vs_full_decode'], r['within_noise_vs_full_decode']):>10}" if decode else "")
        + f"{stall} "
        f"{_fmt(r['cpu_percent'], '.0f'):>6} {_fmt(pss, '.0f'):>7}"
    )


def format_table(records: Sequence[dict[str, Any]]) -> str:
    """The records as the printed table (with a stall column when they were run with ``step_ms``)."""
    decode = any(r["backend"] == REFERENCE for r in records)
    header = table_header(any(r["step_ms"] for r in records), decode)
    return "\n".join([header, "-" * len(header), *(table_row(r, decode) for r in records)])


def plot(records: Sequence[dict[str, Any]], path: str) -> None:
    """images/s (median, min-max bars) vs num_workers, one line per backend, one panel per pipeline."""
    try:  # optional dependency (the bench extra), only for --plot
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("--plot needs matplotlib: pip install 'fastload[bench]'") from None
    pipelines = sorted({r["pipeline"] for r in records})
    fig, axes = plt.subplots(1, len(pipelines), figsize=(5 * len(pipelines), 4), squeeze=False)
    for ax, pipeline in zip(axes[0], pipelines, strict=False):
        rows = [r for r in records if r["pipeline"] == pipeline]
        for name in dict.fromkeys(r["backend"] for r in rows):
            pts = sorted(
                (r["num_workers"], r["images_per_s"], r["images_per_s_min"], r["images_per_s_max"])
                for r in rows
                if r["backend"] == name
            )
            x, y, low, high = zip(*pts, strict=True)
            ax.errorbar(
                x,
                y,
                yerr=[
                    [m - lo for m, lo in zip(y, low, strict=True)],
                    [hi - m for m, hi in zip(y, high, strict=True)],
                ],
                marker="o",
                capsize=3,
                label=name,
                linestyle="--" if name == REFERENCE else "-",
            )
        ax.set_xticks(sorted({r["num_workers"] for r in rows}))  # worker counts are integers
        ax.set_title(f"{pipeline} pipeline")
        ax.set_xlabel("num_workers (0 = main process)")
        ax.set_ylabel("throughput (images/s), bars: min-max of runs")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
