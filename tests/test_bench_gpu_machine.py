"""``bench/gpu_machine.sh``: the GPU machine's run, checked here for what a CPU can check (its steps
in order, the time budget, the log and records files), with a budget that skips the long steps."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "gpu_machine.sh"
STEPS = [
    "fastload info",
    "nvImageCodec interfaces",
    "nvImageCodec tests",
    "decoding alone: experimental",
    "decoding alone: default",
    "hand-overs per batch",
    "resnet50: fastload,device-decode,hybrid (experimental)",
    "resnet18: device-decode,hybrid,fastload (experimental)",
    "resnet50: device-decode (default)",
    "resnet18: hybrid (default)",
    "resnet50: device-decode (hardware-decoder-only)",
    "decoding alone: torchvision",
    "GPU tests",
]


def test_the_gpu_machine_script_keeps_to_its_budget_and_says_what_it_skipped(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / ".complete").touch()  # no synthetic set is made
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "BUILD": "0", "BUDGET": "1", "DATA": str(data)}
    command = ["bash", str(SCRIPT), str(out)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr
    log = (out / "gpu.log").read_text()
    assert (out / "records.jsonl").read_text() == ""  # nothing measured, the file is there
    positions = []
    for step in STEPS:
        line = f"== {step}: skipped"
        assert line in log, f"{step!r} neither ran nor was skipped:\n{log}"
        positions.append(log.index(line))
    assert positions == sorted(positions) and log.rstrip().endswith("done")
    assert "budget left" in log and "== C extensions" not in log  # BUILD=0
