"""The zero-edit swap, for scripts whose loaders are built inside a library (timm's ``create_loader``).

:func:`install` makes the name ``torch.utils.data.DataLoader`` fastload's and shows the
``fastload`` logger's INFO lines, so each loader says on one line which path it takes and why.
``python -m fastload run SCRIPT ARGS`` (or ``run -m MODULE ARGS``) installs it, then runs the script
unchanged as ``__main__``; under torchrun: ``torchrun --nproc_per_node 2 -m fastload run train.py
ARGS``. Code that looks the name up when it builds a loader gets fastload's, and so does a class
that subclasses it at import after the install (timm's ``MultiEpochsDataLoader``); a name imported
before it (``from torch.utils.data import DataLoader`` in a module already loaded) keeps torch's.
Workers need nothing: they unpickle the dataset, and a spawned worker imports the script as
``__mp_main__`` as it would without fastload.
"""

from __future__ import annotations

import logging
import os
import runpy
import sys

import torch.utils.data

__all__ = ["install", "run"]


def install() -> None:
    """Makes ``torch.utils.data.DataLoader`` fastload's, with one INFO line per loader on stderr.

    Example:
        >>> import fastload.swap, torch.utils.data
        >>> fastload.swap.install()
        >>> torch.utils.data.DataLoader.__module__
        'fastload.loader'
    """
    from .loader import DataLoader

    torch.utils.data.DataLoader = DataLoader  # type: ignore[misc]
    log = logging.getLogger("fastload")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
        # once the script configures logging, its own handlers show the line
        handler.addFilter(lambda record: not logging.getLogger().handlers)
        log.addHandler(handler)
    if log.level == logging.NOTSET or log.level > logging.INFO:
        log.setLevel(logging.INFO)


def run(argv: list[str]) -> None:
    """Runs ``[SCRIPT, ARGS...]`` or ``["-m", MODULE, ARGS...]`` as ``__main__`` after :func:`install`.

    Raises:
        SystemExit: With a usage line where ``argv`` names no script or module.
    """
    module = bool(argv) and argv[0] == "-m"
    target = argv[1:2] if module else argv[:1]
    if not target:
        raise SystemExit("usage: python -m fastload run SCRIPT [ARGS...] | run -m MODULE [ARGS...]")
    install()
    if module:
        sys.argv = [target[0], *argv[2:]]
        runpy.run_module(target[0], run_name="__main__", alter_sys=True)
        return
    script = target[0]
    sys.argv = [script, *argv[1:]]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
