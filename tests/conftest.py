"""Shared fixtures: a tiny synthetic ImageNet tree, made once per test session."""

from __future__ import annotations

import gc
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from fastload.synthetic import make_imagenet_like


def _import_bench_harness() -> None:
    """Makes ``bench/_harness`` (the benchmark harness behind ``bench/throughput.py``, not a part of
    the package) importable as ``_harness`` in the tests, as running a script in ``bench/`` does."""
    init = Path(__file__).resolve().parents[1] / "bench" / "_harness" / "__init__.py"
    spec = importlib.util.spec_from_file_location(
        "_harness", init, submodule_search_locations=[str(init.parent)]
    )
    assert spec is not None and spec.loader is not None
    sys.modules["_harness"] = harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)


_import_bench_harness()


@pytest.fixture(scope="session")
def imagenet_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``train/`` (4 classes x 8) and ``val/`` (4 classes x 3), real JPEGs incl. the ImageNet quirks."""
    root = tmp_path_factory.mktemp("imagenet")
    return make_imagenet_like(root, classes=4, per_class=8, val_per_class=3, seed=0, num_workers=1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda = torch.cuda.is_available()
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "dali" in getattr(item, "fixturenames", ()):  # needs DALI: `make test-dali` runs `-m dali`
            item.add_marker(pytest.mark.dali)
        if not cuda and "cuda" in item.keywords:
            item.add_marker(skip)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Collects what the tests left (e.g. a torch DataLoader iterator with worker processes) while
    this test process still runs: under pytest-xdist, a worker still busy 5 s after the run asks it
    to stop is sent SIGINT, and a torch iterator then finalised mid-shutdown reports the interrupt."""
    gc.collect()
