"""Runs test code in a fresh process with ``FASTLOAD_NO_SIMD=1`` (the C extension reads it once)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_without_simd(code: str, timeout: float) -> None:
    """Runs ``code`` with ``python -c`` from the project root, the AVX2 kernels off; fails the
    calling test with the child's error output if it does not exit cleanly."""
    here = Path(__file__).resolve().parent
    root = here.parent
    path = os.pathsep.join(p for p in (str(here), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "FASTLOAD_NO_SIMD": "1", "PYTHONPATH": path}  # the tests' helper modules too
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-3000:]
