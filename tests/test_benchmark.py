from __future__ import annotations

import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import PIL
import pytest
import torch
import torchvision

import fastload
from fastload import info
from fastload.__main__ import main as cli_main
from fastload.decode import roi_decoder_available
from fastload.device import auto_num_workers, available_cpus

from _harness import cli, timing
from _harness.backends import BACKENDS, Backend
from _harness.config import PIPELINES, STORY, BenchConfig, model_counts, split_too_small, steady_counts
from _harness.report import LEGEND


@pytest.fixture(autouse=True)
def _results_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --json the benchmark writes bench/results/throughput.json (and .png) in the working
    directory: here, in the test's own folder."""
    monkeypatch.setattr(cli, "DEFAULT_JSON", tmp_path / "results" / "throughput.json")


def _bench_args(root: Path, *extra: str) -> list[str]:
    return ["--data", str(root), "--batch-size", "2", "--batches", "2", "--warmup", "1", *extra]


def test_throughput_bench_writes_records_and_table(
    imagenet_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (the bench extra)")
    out = tmp_path / "r.json"
    code = cli.main(
        _bench_args(
            imagenet_root,
            "--workers",
            "0,1",
            "--backends",
            "torchvision,fastload,full-decode",
            "--pipelines",
            "train,val",
            "--repeat",
            "3",
            "--json",
            str(out),
            "--plot",
            str(tmp_path / "p.png"),
            "--device",
            "cpu",  # the settings below are a CPU run's, on a GPU machine too
        )
    )
    assert code == 0
    records = json.loads(out.read_text())
    assert [(r["backend"], r["pipeline"], r["num_workers"]) for r in records] == [
        (b, p, w)
        for p in ("train", "val")
        for w in (0, 1)
        for b in ("torchvision", "fastload", "full-decode")
    ]
    for r in records:
        runs = r["images_per_s_runs"]
        # the reference: 3 passes before the rows of its worker count and 3 after them
        assert len(runs) == (6 if r["backend"] == "full-decode" else 3)
        assert r["images_per_s"] == statistics.median(runs)
        assert (r["images_per_s_min"], r["images_per_s_max"]) == (min(runs), max(runs))
        # The run settings and the machine travel with every record.
        assert r["settings"] == {
            "data": str(imagenet_root),
            "batch_size": 2,
            "batches": 2,
            "warmup": 1,
            "repeat": 3,
            "device": "cpu",
            "seed": 0,
            "gpu_transforms": False,
            "step_ms": 0.0,
            "torch_threads": torch.get_num_threads(),
            "backends": ["torchvision", "fastload", "full-decode"],
            "pipelines": ["train", "val"],
            "workers": [0, 1],
        }
        env = r["environment"]
        assert env["python"] == platform.python_version() and env["fastload"] == fastload.__version__
        assert (env["torch"], env["torchvision"], env["pillow"]) == (
            torch.__version__,
            torchvision.__version__,
            PIL.__version__,
        )
        assert env["dali"] == info.dali_version() and env["cpu_count"] == os.cpu_count()
        assert env["c_extension_used"] == roi_decoder_available()
        assert env["c_extension"] in ("built", "not built", "built, turned off by FASTLOAD_ROI_DECODE=0")
        assert len(env["load_average"]) == 3 and all(v >= 0 for v in env["load_average"])
    by_key = {(r["backend"], r["pipeline"], r["num_workers"]): r for r in records}
    for (name, pipeline, w), r in by_key.items():
        tv, ref = by_key["torchvision", pipeline, w], by_key["full-decode", pipeline, w]
        assert r["ratio_vs_torchvision"] == pytest.approx(r["images_per_s"] / tv["images_per_s"])
        assert r["ratio_vs_full_decode"] == pytest.approx(r["images_per_s"] / ref["images_per_s"])
        for other, key in ((tv, "within_noise_vs_torchvision"), (ref, "within_noise_vs_full_decode")):
            if other is r:
                assert r[key] is None
                continue
            spread = max(
                r["images_per_s_max"] - r["images_per_s_min"],
                other["images_per_s_max"] - other["images_per_s_min"],
            )
            assert r[key] == (spread > abs(r["images_per_s"] - other["images_per_s"]))
        assert r["stall_fraction"] is None  # no model step: every loop waits all the time, no number
        if name == "full-decode":  # a reference: no loader, so no CPU or memory numbers
            assert r["reference_cores"] == min(max(1, w), available_cpus())
            assert r["cpu_percent"] is None and r["pss_bytes"] is None
        else:
            # CPU time is counted in clock ticks (10 ms): a run of 2 small batches may see none
            assert r["pss_bytes"] > 50 * 2**20 and r["cpu_percent"] >= 0 and r["device"] == "cpu"
    assert max(r["cpu_percent"] for r in records if r["backend"] != "full-decode") > 0
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("backend"))
    assert lines[header].split() == [
        "backend",
        "pipeline",
        "workers",
        "images/s",
        "min-max",
        "vs",
        "tv",
        "vs",
        "decode",
        "CPU",
        "%",
        "PSS",
        "MB",
    ]
    assert "stall" not in lines[header]  # no model step, no stall column
    rows = lines[header + 2 : header + 2 + len(records)]
    for r, row in zip(records, rows, strict=True):
        cells = row.split()
        assert cells[:3] == [r["backend"], r["pipeline"], str(r["num_workers"])]
        assert cells[4] == f"{r['images_per_s_min']:.0f}-{r['images_per_s_max']:.0f}"
        ratio = f"{r['ratio_vs_torchvision']:.2f}" + ("?" if r["within_noise_vs_torchvision"] else "")
        assert cells[5] == ratio
    # The legend under the table explains every column and the reference row.
    legend = "\n".join(lines[header + 2 + len(records) :])
    for word in ("images/s", "min-max", "vs tv", "vs decode", "?", "CPU %", "PSS MB", "-"):
        assert f"\n  {word} " in legend, word
    for row in ("torchvision", "fastload", "full-decode"):  # and names each row it printed
        assert f"\n  {row} " in legend, row
    assert "\n  stall " not in legend  # no stall column, so no entry for it
    assert "fastload " + fastload.__version__ in printed and "load average" in printed
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_step_ms_simulates_a_model_and_shows_the_stall(
    imagenet_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.json"
    args = ["--workers", "1", "--backends", "fastload", "--pipelines", "val", "--repeat", "1"]
    assert cli.main(_bench_args(imagenet_root, *args, "--step-ms", "200", "--json", str(out))) == 0
    (r,) = json.loads(out.read_text())
    assert r["step_ms"] == 200 and r["settings"]["step_ms"] == 200
    # 2 batches of 4 images, each followed by a 0.2 s step: at most 10 images/s.
    assert r["images_per_s"] <= 4 / 0.2 * 1.01
    assert 0 <= r["stall_fraction"] < 0.9
    printed = capsys.readouterr().out
    assert "stall" in next(line for line in printed.splitlines() if line.startswith("backend"))
    assert "model step 200 ms" in printed and "\n  stall        (with --step-ms)" in printed


def test_an_unavailable_backend_is_named_once_before_the_table(
    imagenet_root: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def build(config: BenchConfig, pipeline: str, num_workers: int) -> list[object]:
        raise AssertionError("an unavailable backend is never built")

    missing = Backend("missing", build, lambda: "needs a library this machine lacks")
    monkeypatch.setitem(BACKENDS, "missing", missing)
    args = [
        "--workers",
        "0,1",
        "--backends",
        "missing,torchvision",
        "--pipelines",
        "train,val",
        "--repeat",
        "1",
    ]
    assert cli.main(_bench_args(imagenet_root, *args)) == 0
    lines = capsys.readouterr().out.splitlines()
    notes = [i for i, line in enumerate(lines) if line.startswith("skipping missing:")]
    header = next(i for i, line in enumerate(lines) if line.startswith("backend"))
    assert len(notes) == 1 and notes[0] < header and "lacks" in lines[notes[0]]
    rows = [line for line in lines[header + 2 :] if line.startswith(("missing", "torchvision"))]
    assert [r.split()[0] for r in rows] == ["torchvision"] * 4


def _one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing measured, no table
    assert captured.err.count("\n") == 1 and captured.err.startswith("error: "), captured.err
    return captured.err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--batches", "0"], "--batches should be a positive integer, but got --batches=0"),
        (["--batch-size", "0"], "--batch-size should be a positive integer, but got --batch-size=0"),
        (["--repeat", "0"], "--repeat should be a positive integer, but got --repeat=0"),
        (["--warmup", "-1"], "--warmup should be a non-negative integer, but got --warmup=-1"),
        (["--step-ms", "-5"], "--step-ms should be a non-negative number"),
        (["--step-ms", "inf"], "--step-ms should be a non-negative number"),
        (["--torch-threads", "0"], "--torch-threads should be a positive integer, but got --torch-threads=0"),
        (["--backends", "nope"], "unknown backend(s) ['nope']; available: ['torchvision',"),
        (["--pipelines", "train,test"], "unknown pipeline(s) ['test']; available: ['train', 'val']"),
        (["--device", "gpu"], "--device should be cpu, cuda or cuda:N, but got --device='gpu'"),
    ],
)
def test_bench_errors_are_one_clear_line(
    imagenet_root: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert cli.main(["--data", str(imagenet_root), "--workers", "0", *args]) == 2
    assert message in _one_error_line(capsys)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_bench_device_cuda_without_cuda_is_one_line(
    imagenet_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["--data", str(imagenet_root), "--device", "cuda"]) == 2
    err = _one_error_line(capsys)
    assert "CUDA is not available on this machine" in err and "leave --device out" in err


@pytest.fixture
def torch_threads() -> Iterator[int]:
    """torch's thread count, given back after a test that changes it in this process."""
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


def test_torch_threads_is_set_recorded_and_a_busy_machine_is_named(
    imagenet_root: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    torch_threads: int,
) -> None:
    cpus = available_cpus()
    monkeypatch.setattr(info.os, "getloadavg", lambda: (cpus + 1.0, cpus + 1.0, cpus + 1.0))
    args = ["--workers", "0", "--backends", "torchvision", "--pipelines", "val", "--repeat", "1"]
    torch.set_num_threads(2)
    assert cli.main(_bench_args(imagenet_root, *args)) == 0
    note = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: load average")]
    assert len(note) == 1 and "torch runs 2 threads" in note[0] and "--torch-threads 1" in note[0], note
    out = tmp_path / "r.json"
    assert cli.main(_bench_args(imagenet_root, *args, "--torch-threads", "1", "--json", str(out))) == 0
    assert torch.get_num_threads() == 1
    (record,) = json.loads(out.read_text())
    assert record["settings"]["torch_threads"] == 1
    assert "note: load average" not in capsys.readouterr().out  # one thread: nothing to wait for
    # Workers only (no 0-worker row): the main process's threads do not load, so no note either.
    torch.set_num_threads(2)
    assert cli.main(_bench_args(imagenet_root, *args[2:], "--workers", "1")) == 0
    assert "note: load average" not in capsys.readouterr().out


def test_bench_errors_are_clear(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--data", str(tmp_path)]) == 2
    assert "python -m fastload synth" in _one_error_line(capsys)
    (tmp_path / "train").mkdir()
    assert cli.main(["--data", str(tmp_path), "--pipelines", "val"]) == 2
    assert f"{tmp_path / 'val'} not found" in _one_error_line(capsys)


def test_the_old_reference_name_still_works(imagenet_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--workers", "0", "--backends", "decode-ceiling", "--pipelines", "val", "--repeat", "1"]
    assert cli.main(_bench_args(imagenet_root, *args)) == 0
    captured = capsys.readouterr()
    assert "now called full-decode" in captured.err and "\nfull-decode " in captured.out


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """stdout of ``python -m fastload ARGS`` run in this process (what ``python -m`` calls)."""
    try:
        code = cli_main(list(args))
    except SystemExit as e:  # --help, --version
        code = e.code
    captured = capsys.readouterr()
    assert code in (0, None), captured.err
    return captured.out


def test_the_commands_help_is_plain_text(capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m fastload --help`` in a terminal: no reST markup (it showed raw double backticks)."""
    text = _cli(capsys, "--help")
    assert text.startswith("usage: python -m fastload ")
    assert "``" not in text and "python -m fastload {synth,scan,pack,shards,info,run}" in " ".join(
        text.split()
    )


def test_help_names_the_command_and_lists_backends_pipelines_defaults_and_columns(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as done:  # argparse's --help
        cli.main(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: bench/throughput.py ")
    for name in [*BACKENDS, "full-decode", *PIPELINES]:
        assert f"\n  {name} " in text, name
    for default in (
        "default: 0 and this machine's CPUs",
        "default 64",
        "at least 20",
        "at least 3",
        "default: cuda if available",
        "default: torchvision,swap,fastload; --all: every one",
    ):
        assert default in " ".join(text.split()), default
    assert LEGEND in text


def test_version_and_setup_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli(capsys, "--version") == f"fastload {fastload.__version__}\n"
    line = _cli(capsys, "info")
    assert line.count("\n") == 1
    assert f"torch {torch.__version__}" in line and f"torchvision {torchvision.__version__}" in line
    built = importlib.util.find_spec("fastload._jpeg") is not None
    assert ("C extension (region JPEG decoding): built" in line) == built
    if not built:  # what it costs and the system packages that build it
        assert "20% slower" in line and "libjpeg-dev" in line and "libjpeg-turbo-devel" in line
    dali = info.dali_version()
    assert (f"DALI {dali}" in line) if dali else ("DALI: not installed" in line)
    env = json.loads(_cli(capsys, "info", "--json"))
    assert env["fastload"] == fastload.__version__ and env["available_cpus"] == available_cpus()


def test_script_runs_from_any_directory(imagenet_root: Path, tmp_path: Path) -> None:
    script = Path(__file__).resolve().parents[1] / "bench" / "throughput.py"
    res = subprocess.run(
        [
            sys.executable,
            str(script),
            "--data",
            str(imagenet_root),
            "--workers",
            "0",
            "--backends",
            "torchvision",
            "--pipelines",
            "val",
            "--batch-size",
            "4",
            "--batches",
            "1",
            "--warmup",
            "0",
            "--repeat",
            "1",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert "torchvision      val" in res.stdout


def test_cli_scan(imagenet_root: Path, tmp_path: Path) -> None:
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "fastload",
            "scan",
            str(imagenet_root / "train"),
            "--save-classes",
            str(tmp_path / "c.json"),
            "--out",
            str(tmp_path / "i.npz"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert "32 images in 4 classes" in res.stdout
    from fastload import ClassIndex, FolderIndex

    assert len(ClassIndex.load(tmp_path / "c.json")) == 4 and len(FolderIndex.load(tmp_path / "i.npz")) == 32
    res = subprocess.run(
        [sys.executable, "-m", "fastload", "scan", str(tmp_path / "missing")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2 and "does not exist" in res.stderr


def test_importing_the_benchmark_imports_no_optional_dependency() -> None:
    """No module of fastload imports the benchmark harness (bench/_harness, not a part of the
    package), and the harness imports neither DALI nor matplotlib until a run needs them."""
    bench = Path(__file__).resolve().parents[1] / "bench"
    code = (
        "import sys, importlib, pkgutil, fastload; "
        "[importlib.import_module(m.name) for m in pkgutil.walk_packages(fastload.__path__, 'fastload.')]; "
        "assert not [m for m in sys.modules if m.startswith('_harness')]; "
        f"sys.path.insert(0, {str(bench)!r}); import _harness.cli; "
        "print(sorted(m for m in sys.modules if m.startswith(('nvidia', 'matplotlib'))))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"
    assert "dali" in BACKENDS and BACKENDS["dali"].name == "dali"


def test_setup_summary_without_the_c_extension_says_what_it_costs_and_how_to_build_it() -> None:
    # This machine has the extension built, so the line of one without it is made from its facts.
    line = info.summary_line({**info.environment(), "c_extension": "not built"})
    assert "\n" not in line and f"fastload {fastload.__version__}, torch {torch.__version__}" in line
    assert "C extension (region JPEG decoding): not built: the train pipeline is about 20% slower" in line
    for package_name in (
        "libjpeg-dev",
        "libjpeg-turbo-devel",
        "brew install jpeg-turbo",
        "reinstall fastload",
    ):
        assert package_name in line, package_name


def test_setup_summary_says_when_the_resize_taps_have_no_c_extension() -> None:
    env = info.environment()
    from fastload.gpu import resample

    assert env["c_resample"] == ("built" if resample._c_resample is not None else "not built")
    assert (env["c_resample"] == "built") == (importlib.util.find_spec("fastload._resample") is not None)
    assert "resize taps" not in info.summary_line({**env, "c_resample": "built"})
    line = info.summary_line({**env, "c_resample": "not built"})
    assert "C extension (resize taps): not built: the device paths' crop taps are made by numpy" in line
    assert line.endswith("install a C compiler, then reinstall fastload")


@pytest.mark.skipif(not roi_decoder_available(), reason="the C extension is not built here")
def test_setup_summary_names_a_c_extension_turned_off(tmp_path: Path) -> None:
    env = {**os.environ, "FASTLOAD_ROI_DECODE": "0"}
    res = subprocess.run(
        [sys.executable, "-m", "fastload", "info"], capture_output=True, text=True, timeout=120, env=env
    )
    assert res.returncode == 0, res.stderr
    assert "C extension (region JPEG decoding): built, turned off by FASTLOAD_ROI_DECODE=0 |" in res.stdout


def test_full_decode_reference_brackets_the_rows_it_is_compared_with(
    imagenet_root: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The reference is measured just before and just after the rows of each worker count, and
    its runs are both sets (so a machine whose speed drifts moves it along with those rows)."""
    calls: list[str] = []
    rates = iter(range(100, 10_000, 10))

    def fake_decode(config: object, pipeline: str, limit: int = 200, on_run: object = None) -> list[float]:
        calls.append("decode")
        return [float(next(rates)) for _ in range(2)]

    real_measure = timing.measure

    def counted_measure(*args: object, **kwargs: object) -> dict:
        calls.append("measure")
        return real_measure(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(timing, "full_decode_rates", fake_decode)
    monkeypatch.setattr(timing, "measure", counted_measure)
    config = BenchConfig(
        data=imagenet_root, batch_size=2, batches=1, warmup=0, repeat=2, steady=False, steady_warmup=False
    )
    records = timing.run(
        config,
        ["torchvision", "fastload", "full-decode"],
        ["val"],
        [0, 2],
        log=lambda line: None,
        progress=False,
    )
    assert calls == ["decode", "measure", "measure", "decode"] * 2
    refs = [r for r in records if r["backend"] == "full-decode"]
    assert [r["images_per_s_runs"] for r in refs] == [
        [100.0, 110.0, 120.0, 130.0],
        [v * min(2, available_cpus()) for v in (140.0, 150.0, 160.0, 170.0)],
    ]
    for r in records:
        if r["backend"] != "full-decode":
            assert r["ratio_vs_full_decode"] == pytest.approx(
                r["images_per_s"] / refs[r["num_workers"] // 2]["images_per_s"]
            )


def test_default_run_tells_its_story(
    imagenet_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No --backends: torch's loader, the one-line swap and fastload's own pipeline, on 0 workers and
    this machine's CPUs; a legend naming exactly those rows; the records and a plot beside them; and
    last, the verdict: the swap's images/s over torch's, with the number the table shows."""
    assert cli.main(_bench_args(imagenet_root, "--repeat", "1")) == 0
    lines = capsys.readouterr().out.splitlines()
    out = tmp_path / "results" / "throughput.json"
    records = json.loads(out.read_text())
    # every worker count the test tree's splits can measure (on many CPUs, not all: see below)
    config = BenchConfig(data=imagenet_root, batch_size=2)
    measurable = {
        p: [w for w in sorted({0, auto_num_workers()}) if not split_too_small(config, p, w)]
        for p in ("train", "val")
    }
    assert [(r["backend"], r["pipeline"], r["num_workers"]) for r in records] == [
        (b, p, w) for p in ("train", "val") for w in measurable[p] for b in STORY
    ]
    workers = measurable["train"]
    plotted = importlib.util.find_spec("matplotlib") is not None  # optional (the bench extra)
    if plotted:
        assert (tmp_path / "results" / "throughput.png").stat().st_size > 10_000
    header = next(line for line in lines if line.startswith("backend"))
    assert "vs decode" not in header  # no reference row, no column for it
    rows = lines[lines.index("rows:") + 1 : lines.index("columns:")]
    assert [r.split()[0] for r in rows] == list(STORY)
    if plotted:
        assert lines[-2] == f"wrote {out}, {out.with_suffix('.png')}"
    else:  # the run goes on without its plot, and says why
        assert lines[-2].startswith(f"wrote {out}, no plot (") and "pip install" in lines[-2]
    swap = next(
        r
        for r in records
        if (r["backend"], r["pipeline"], r["num_workers"]) == ("swap", "train", workers[-1])
    )
    flag = "?" if swap["within_noise_vs_torchvision"] else ""
    assert lines[-1].startswith(
        f"==> the one-line swap: {swap['ratio_vs_torchvision']:.1f}x{flag} torch's images/s on this machine "
        f"(train, {workers[-1]} workers); val "
    ), lines[-1]
    assert "fastload's own pipeline: " in lines[-1]


def test_all_leaves_gpu_rows_out_without_cuda(
    imagenet_root: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    measured: list[str] = []

    def fake_run(config: Any, backends: Any, *args: Any, **kwargs: Any) -> list[Any]:
        measured.extend(backends)
        return []

    monkeypatch.setattr(cli, "run", fake_run)
    assert cli.main(_bench_args(imagenet_root, "--all", "--device", "cpu")) == 0
    gpu_rows = [name for name, b in BACKENDS.items() if b.gpu_only]
    assert sorted(gpu_rows) == ["dali", "device-decode", "hybrid"]
    assert not set(gpu_rows) & set(measured)
    assert set(measured) == {*BACKENDS, "full-decode"} - set(gpu_rows)
    assert f"skipping {', '.join(gpu_rows)}: GPU pipelines" in capsys.readouterr().out


def test_the_load_note_needs_another_program_on_a_core() -> None:
    """Load below 1 (nothing else holds a core, e.g. 0.7 on 2 CPUs with torch's 2 threads): no note."""
    env = {"load_average": [0.7, 0.7, 0.7], "available_cpus": 2}
    assert cli._busy_machine_note(env, 2, [0, 2]) is None
    env["load_average"] = [1.2, 1.0, 1.0]
    assert (cli._busy_machine_note(env, 2, [0, 2]) or "").startswith("note: load average 1.2 on 2 CPUs")


def test_timed_runs_are_never_served_from_the_prefetched_batches(imagenet_root: Path) -> None:
    """By default the warm-up takes what the workers decoded ahead and each timed run is several
    times that; counts given on the command line are taken as they are."""
    config = BenchConfig(data=imagenet_root, batches=8, warmup=2)
    assert steady_counts(config, 0) == (3, 8)
    assert steady_counts(config, 2) == (5, 12)
    assert steady_counts(config, 14) == (29, 84)
    assert steady_counts(BenchConfig(data=imagenet_root, batches=200), 14) == (29, 200)
    exact = BenchConfig(data=imagenet_root, batches=8, warmup=2, steady=False, steady_warmup=False)
    assert steady_counts(exact, 14) == (2, 8)
    only_batches = BenchConfig(data=imagenet_root, batches=8, warmup=2, steady=False)
    assert steady_counts(only_batches, 14) == (29, 8)  # the warm-up still drains the ring


def test_a_split_too_small_for_the_workers_says_so_instead_of_a_number(
    imagenet_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The test tree's val split holds 12 images: 3 batches of 4, fewer than the 4 that 2 workers
    decode ahead. The row is not measured, and the output says why and what to do."""
    config = BenchConfig(data=imagenet_root, batch_size=4)
    assert split_too_small(config, "val", 1) is None  # 3 batches >= 2
    reason = split_too_small(config, "val", 2)
    assert reason is not None and "3 batches of 4 (12 images)" in reason and "fewer than the 4" in reason
    assert cli.main(
        ["--data", str(imagenet_root), "--batch-size", "4", "--workers", "2", "--pipelines", "val",
         "--backends", "fastload", "--repeat", "1", "--json", str(imagenet_root.parent / "small.json")]
    ) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "not measured: val at 2 workers" in out and "--per-class" in out
    assert json.loads((imagenet_root.parent / "small.json").read_text()) == []


# --------------------------------------------------------------------------- --model: does the GPU wait?


def test_model_mode_trains_a_model_fed_by_each_loader_and_on_resident_data(
    imagenet_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On a CPU the mode runs (a tiny model) and says its figures are not a GPU's; the ceiling row
    comes first, every loader's share of it is its images/s over the ceiling's, and the verdict,
    last, quotes those shares."""
    out = tmp_path / "model.json"
    args = ["--data", str(imagenet_root), "--model", "tiny", "--batch-size", "2", "--workers", "1"]
    args += ["--warmup", "2", "--batches", "3", "--repeat", "2", "--device", "cpu", "--json", str(out)]
    assert cli.main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    records = json.loads(out.read_text())
    assert [r["backend"] for r in records] == ["ceiling", *STORY]
    ceiling = records[0]
    assert ceiling["share_of_ceiling"] == 1.0 and len(ceiling["images_per_s_runs"]) == 4  # before + after
    for r in records[1:]:
        assert r["num_workers"] == 1 and r["batch_size"] == 2 and r["timed_steps"] == 3
        assert r["share_of_ceiling"] == pytest.approx(r["images_per_s"] / ceiling["images_per_s"])
        assert 0.0 <= r["waiting"] < 1.0 and len(r["images_per_s_runs"]) == 2
    # CPU cores: this process tree's CPU time over the wall time; the loop itself keeps one busy
    assert all(0.2 < r["cpu_cores"] < 64 for r in records)
    assert any("CPU cores" in line for line in lines)
    assert all(0 < r["launch_ms"] <= r["step_ms"] for r in records)  # the step apart from next()
    assert any("step ms" in line and "launch ms" in line for line in lines)
    assert any("These figures are not a GPU's" in line for line in lines)
    shares = [f"{100 * r['share_of_ceiling']:.0f} %" for r in records[1:]]
    assert lines[-1] == (
        f"==> tiny on this machine's CPU: torch's loader keeps it busy {shares[0]} of the time, the one-line "
        f"swap {shares[1]}, fastload's own pipeline {shares[2]} (1 workers, batch 2). Not a GPU's figures: "
        "without CUDA the model shares the CPUs with the loader's workers"
    )


def test_model_mode_says_how_the_hybrid_split_each_batch(
    imagenet_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """decode='hybrid' rows record the split the loader settled on and the rates it followed."""
    out = tmp_path / "model.json"
    args = ["--data", str(imagenet_root), "--model", "tiny", "--batch-size", "4", "--workers", "1"]
    args += ["--warmup", "2", "--batches", "3", "--repeat", "1", "--device", "cpu", "--json", str(out)]
    assert cli.main([*args, "--backends", "hybrid"]) == 0
    lines = capsys.readouterr().out.splitlines()
    hybrid = [r for r in json.loads(out.read_text()) if r["backend"] == "hybrid"]
    assert len(hybrid) == 1 and hybrid[0]["split"].startswith("HybridSplit(adaptive: CPU share ")
    assert f"hybrid (1 workers) split each batch: {hybrid[0]['split']}" in lines


def test_model_mode_splits_each_step_into_launch_and_the_device_finishing_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """time_steps times the step outside next(): its launch (the step's call) and the wait for the
    device (the synchronisation), apart from the time next() took. Stand-ins with known durations:
    a loader that takes 15 ms per batch, a step whose call takes 20 ms, a device that finishes 10 ms
    after it."""
    from _harness import model as modelbench

    def slow_batches() -> Any:
        while True:
            time.sleep(0.015)
            yield torch.zeros(2, 1), torch.zeros(2)

    class Step:
        device = torch.device("cpu")

        def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
            time.sleep(0.020)

    monkeypatch.setattr(modelbench, "_synchronize", lambda device: lambda: time.sleep(0.010))
    result = modelbench.time_steps(slow_batches(), Step(), warmup=1, steps=4, repeat=2)  # type: ignore[arg-type]
    assert 20.0 <= result["launch_ms"] < 1000.0
    assert result["step_ms"] - result["launch_ms"] >= 10.0 - 0.5  # (medians of different steps)
    assert result["step_ms"] >= 30.0
    assert 0.1 < result["waiting"] < 0.6  # 15 of about 45 ms: next() is not a part of the step


def test_model_verdict_on_a_gpu_names_the_model_and_the_card() -> None:
    from _harness.model import model_verdict

    def rec(backend: str, share: float) -> dict[str, Any]:
        return {
            "backend": backend,
            "model": "resnet50",
            "share_of_ceiling": share,
            "device": "cuda",
            "device_name": "NVIDIA H200",
            "num_workers": 14,
            "batch_size": 256,
        }

    records = [rec("ceiling", 1.0), rec("torchvision", 0.251), rec("swap", 0.946), rec("fastload", 0.976)]
    fewer = [{**r, "num_workers": 4, "share_of_ceiling": 0.5} for r in records]
    assert model_verdict(fewer + records) == model_verdict(records)  # the largest worker count speaks
    assert model_verdict(records) == (
        "ResNet-50 on this GPU (NVIDIA H200): torch's loader keeps it busy 25 % of the time, the one-line "
        "swap 95 %, fastload's own pipeline 98 % (14 workers, batch 256)"
    )
    host = {**rec("host-ceiling", 0.951), "num_workers": None}
    assert model_verdict([records[0], host, *records[1:]]) == (
        "ResNet-50 on this GPU (NVIDIA H200): torch's loader keeps it busy 25 % of the time, the one-line "
        "swap 95 %, fastload's own pipeline 98 % (14 workers, batch 256); a loop that copies float32 "
        "batches from the host itself reaches at most 95 % (the host ceiling: the copy runs on its stream)"
    )


def test_the_host_ceiling_is_float32_host_memory_the_step_copies_itself() -> None:
    """The host ceiling's batch is what the one-line swap hands out (float32 on the host, the
    ceiling's values), and the step moves it to its device itself, as a training loop does."""
    from _harness.model import TrainStep, build_model, host_batches, resident_batches

    images, labels = next(host_batches(4, 3, size=16, pin=False))
    resident, resident_labels = next(resident_batches(4, 3, torch.device("cpu"), size=16))
    assert images.device.type == "cpu" and images.dtype == torch.float32
    assert torch.equal(images, resident) and torch.equal(labels, resident_labels)
    seen: list[torch.device] = []
    model = build_model("tiny", 3, torch.device("cpu"))
    model.register_forward_pre_hook(lambda _, args: seen.append(args[0].device))
    loss = TrainStep(model, torch.device("cpu"))(images, labels)
    assert seen == [torch.device("cpu")] and loss.ndim == 0


def test_model_mode_counts_drain_the_ring_and_bad_models_are_named(
    imagenet_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = BenchConfig(data=imagenet_root, batches=25, warmup=30)
    assert model_counts(config, 14) == (30, 28) and model_counts(config, 20) == (41, 40)
    args = ["--data", str(imagenet_root), "--device", "cpu", "--batch-size", "2", "--workers", "1"]
    assert cli.main([*args, "--model", "resnet51"]) == 2
    assert "--model should be a torchvision classification model" in capsys.readouterr().err
    assert cli.main([*args, "--model", "tiny", "--backends", "full-decode"]) == 2
    assert "full-decode is no loader" in capsys.readouterr().err
