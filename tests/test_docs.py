"""The documentation's code runs: every ```python block of the README and of each page in docs/.

Each page's blocks run in order, in one fresh interpreter, in a folder where ``imagenet/`` is the
synthetic test tree (``train/``, ``val/``), after a short prelude that defines what a page takes
from its surroundings (``epochs``, a ``model``, a one-rank gloo group for the distributed page).
Without CUDA, ``"cuda"`` runs as ``"cpu"``. A line ``name  # 'value'`` (an expression, then a
Python literal as its comment) is checked: the expression must equal the literal. Fragments that
cannot run alone are fenced as ```py, and shell commands as ```bash. The site itself is built
with warnings as errors by ``make test`` (``make docs``).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
CHECKED = re.compile(r"^(?P<expr>[A-Za-z_][\w.\[\]\"']*)  # (?P<value>.+)$")

PRELUDE = {
    "common": """
        import torch
        epochs, start_epoch = 1, 0
    """,
    "distributed.md": """
        import os, tempfile
        import torch.distributed as dist
        import fastload
        from fastload import DataLoader, transforms as T
        dist.init_process_group(
            "gloo", init_method="file://" + tempfile.mktemp(), world_size=1, rank=0
        )
        tf = T.Compose([T.Resize(40), T.CenterCrop(32)])
        val_set = fastload.ImageFolder("imagenet/val", transform=tf)
        train_set = fastload.ImageFolder("imagenet/train", transform=tf)
        model = lambda images: torch.zeros(len(images), 4)
    """,
    "gpu.md": """
        import fastload
        from fastload import transforms as T
        train_loader = fastload.DataLoader(
            fastload.ImageFolder("imagenet/train", transform=T.Compose([T.Resize(40), T.CenterCrop(32)])),
            batch_size=8, num_workers=0,
        )
    """,
    "memory.md": """
        import fastload
        from fastload import transforms as T
        tf = T.Compose([T.RandomResizedCrop(32)])
        fastload.ClassIndex.from_folder("imagenet/train").save("classes.json")
        fastload.write_pack(fastload.scan_folder("imagenet/train"), "train.fastpack")
    """,
}


def _program(page: Path) -> str | None:
    blocks = BLOCK.findall(page.read_text())
    if not blocks:
        return None
    lines = []
    for block in blocks:
        for line in block.splitlines():
            m = CHECKED.match(line)
            if m:
                try:
                    value = ast.literal_eval(m["value"])
                except (ValueError, SyntaxError):
                    value = None
                if value is not None:
                    line = f"assert {m['expr']} == {value!r}, {m['expr']}"
            lines.append(line)
    code = "\n".join(lines)
    if not torch.cuda.is_available():
        code = code.replace('"cuda"', '"cpu"')
    code = code.replace("num_workers=8", "num_workers=0")
    prelude = textwrap.dedent(PRELUDE["common"]) + textwrap.dedent(PRELUDE.get(page.name, ""))
    return prelude + "\n" + code


#: Pages whose code needs an optional package: (module, why it is missing, the install command).
NEEDS = {"dali.md": ("nvidia.dali", "NVIDIA DALI is not installed", "pip install 'fastload[dali]'")}


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


def _page_param(page: Path) -> Any:
    return pytest.param(page, id=page.name, marks=[pytest.mark.dali] if page.name in NEEDS else [])


@pytest.mark.parametrize("page", [_page_param(p) for p in PAGES if _program(p) is not None])
def test_page_code_runs(page: Path, imagenet_root: Path, tmp_path: Path) -> None:
    need = NEEDS.get(page.name)
    if need is not None and not _importable(need[0]):
        if os.environ.get("FASTLOAD_REQUIRE_DALI") == "1":  # make test-dali (CI): never skip
            raise AssertionError(f"{need[1]}, but FASTLOAD_REQUIRE_DALI=1 asks for it")
        pytest.skip(f"{page.name}'s code needs {need[0]}: {need[1]} ({need[2]})")
    (tmp_path / "imagenet").symlink_to(imagenet_root)
    script = tmp_path / f"{page.stem}_code.py"
    program = _program(page)
    assert program is not None
    script.write_text(program)
    res = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert res.returncode == 0, f"{page.name}'s code failed:\n{res.stderr[-3000:]}"
