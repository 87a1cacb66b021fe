"""Starting worker processes cheaply, for :class:`fastload._pool.WorkerPool` and for torch's
workers (:func:`fastload._torchpath.torch_iter`) alike.

- **fork**: a forked worker's garbage collections write to every object it inherited, so the
  parent's heap is copied page by page into each worker; :func:`frozen_heap` freezes it first.
- **spawn and forkserver**: each worker is sent the dataset through a 64 KiB pipe, and each start
  waits for the previous worker's imports; :func:`ship_dataset` pickles the dataset once into an
  anonymous file every worker reads (:class:`ShippedDataset`), and :func:`preload_forkserver` has
  the forkserver import the libraries the workers need before it forks them.
"""

from __future__ import annotations

import contextlib
import copyreg
import functools
import gc
import io
import mmap
import multiprocessing
import multiprocessing.context
import multiprocessing.reduction
import os
import pickle
import sys
import tempfile
import types
import weakref
from collections.abc import Iterator
from typing import IO, Any

import torch


def start_method(context: Any) -> str:
    """The start method of a multiprocessing ``context`` (``None``: the default one)."""
    if context is None:
        return multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]
    if isinstance(context, str):
        return context
    return str(context.get_start_method())


#: Objects frozen (``gc.get_freeze_count()``) when fastload was imported.
FROZEN_AT_IMPORT = gc.get_freeze_count()

#: At most this many objects frozen at fastload's import are taken for the environment's doing (seen:
#: 375 in every process of one machine's Python), not the program's: a ``gc.freeze()`` freezes every
#: object the collector tracks, at least the interpreter's 4,000-8,000 from its start-up.
ENVIRONMENT_FROZEN_LIMIT = 2_000


def _frozen_by_environment() -> int:
    """How many frozen objects :func:`frozen_heap` does not take for the program's own freeze."""
    return FROZEN_AT_IMPORT if FROZEN_AT_IMPORT <= ENVIRONMENT_FROZEN_LIMIT else 0


@contextlib.contextmanager
def frozen_heap(context: Any, freeze: bool = True) -> Iterator[None]:
    """Process workers forked inside this block never run the garbage collector over the objects
    they inherit: ``gc.freeze()`` before the fork (their pages stay shared with the parent),
    ``gc.unfreeze()`` after it in the parent, whose young objects are then examined by full
    collections only. Not done without a fork, with ``freeze=False``, nor where the program froze
    objects itself (more than the environment's :data:`ENVIRONMENT_FROZEN_LIMIT`): it keeps
    managing its heap. Where CUDA is initialised, a full collection runs before any fork: a forked
    worker must never finalise the parent's CUDA objects."""
    if start_method(context) != "fork":
        yield
        return
    if torch.cuda.is_initialized():
        gc.collect()  # finalising a CUDA object in a forked worker aborts it
    if not freeze or gc.get_freeze_count() > _frozen_by_environment():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


#: A dataset whose pickle is at least this large is shipped (:func:`ship_dataset`); a smaller one
#: is pickled into each worker's start as usual (it fits the 64 KiB pipe with room to spare).
SHIP_MIN_BYTES = 32 * 1024

#: Types multiprocessing's pickler reduces with pure functions (methods, method descriptors,
#: ``functools.partial``): a pickle of them can be loaded by any number of processes. Its other
#: reductions (sockets, connections, torch's tensors and storages shared through file descriptors
#: or named segments) hand a resource to the one process being started.
_PURE_REDUCTIONS = (
    types.MethodType,
    types.MethodDescriptorType,
    types.WrapperDescriptorType,
    functools.partial,
)


class _ProcessBound(Exception):
    """Raised while pickling for :func:`ship_dataset`: the object needs the process being started."""


def _process_bound(obj: object) -> Any:
    raise _ProcessBound(type(obj).__qualname__)


class _NotingPickler(pickle.Pickler):
    """A pickler that notes the top-level package of every class and function it pickles."""

    def __init__(self, file: IO[bytes], packages: set[str]) -> None:
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self.packages = packages

    def reducer_override(self, obj: Any) -> Any:
        module = getattr(obj, "__module__", None) if isinstance(obj, type) or callable(obj) else None
        if not isinstance(module, str):
            module = type(obj).__module__
        self.packages.add(module.partition(".")[0])
        return NotImplemented  # pickled as usual


def _portable_pickle(obj: Any, packages: set[str] | None = None) -> bytes | None:
    """``obj`` pickled as multiprocessing's ``ForkingPickler`` would, if any number of processes can
    load that one pickle, else ``None`` (then sent as usual, where any real error is reported).
    Adds the top-level packages of its classes and functions to ``packages``, if given."""
    buf = io.BytesIO()
    table = dict(multiprocessing.reduction.ForkingPickler(io.BytesIO()).dispatch_table)
    for cls, reducer in table.items():
        if copyreg.dispatch_table.get(cls) is not reducer and not issubclass(cls, _PURE_REDUCTIONS):
            table[cls] = _process_bound
    pickler = (
        pickle.Pickler(buf, pickle.HIGHEST_PROTOCOL) if packages is None else _NotingPickler(buf, packages)
    )
    pickler.dispatch_table = table
    try:
        pickler.dump(obj)
    except Exception:  # noqa: BLE001 - any failure: the usual per-worker pickling decides
        return None
    return buf.getvalue()


#: Packages a forkserver imports before it forks workers (:func:`preload_forkserver`) when what
#: the workers are sent refers to them; only libraries whose import has no effect on the process
#: beyond loading them (never the user's own modules, whose import may do anything).
PRELOADABLE = ("torch", "torchvision", "numpy", "PIL", "fastload")


def main_module_packages() -> set[str]:
    """The top-level packages the main module's globals refer to (modules it imported, and the
    classes and functions it imported from them)."""
    main = sys.modules.get("__main__")
    found = set()
    for value in list(getattr(main, "__dict__", {}).values()):
        name = value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", None)
        if isinstance(name, str):
            found.add(name.partition(".")[0])
    return found


def preload_forkserver(context: Any, packages: set[str]) -> list[str] | None:
    """Before the first forkserver worker starts: has the forkserver import ``torch``, ``fastload``
    and those of :data:`PRELOADABLE` that ``packages`` or the main module (which each worker runs
    again) refer to and that are imported here, so that workers do not import them each.
    Returns the new preload list, or ``None`` when nothing changed."""
    if start_method(context) != "forkserver":
        return None
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    if server is None or getattr(server, "_forkserver_pid", None) is not None:
        return None
    current = list(getattr(server, "_preload_modules", ["__main__"]))
    wanted = {"torch", "fastload"} | ((packages | main_module_packages()) & set(PRELOADABLE))
    added = [name for name in PRELOADABLE if name in wanted and name in sys.modules and name not in current]
    if not added:
        return None
    forkserver.set_forkserver_preload(current + added)
    return current + added


def _anonymous_file(data: bytes) -> int:
    """A descriptor of a new nameless file holding ``data`` (memfd, else an unlinked temporary)."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("fastload-dataset", os.MFD_CLOEXEC)
    else:  # pragma: no cover - macOS and other POSIX systems
        with tempfile.TemporaryFile() as f:
            fd = os.dup(f.fileno())
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except BaseException:
        os.close(fd)
        raise
    return fd


def _same(obj: Any) -> Any:
    return obj


def _receive_dataset(inherited: Any, size: int) -> Any:
    """In a worker, while its process object is unpickled: the dataset from the shipped file."""
    fd = inherited.detach()
    try:
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as data:
            return pickle.loads(data)
    finally:
        os.close(fd)


class ShippedDataset:
    """A dataset pickled once, for the spawn/forkserver workers started while this object is open.

    A pipe holds 64 KiB, so ``Process.start()`` with a larger dataset waits until the new worker
    has imported torch and read it: workers start one after another (2 workers with a
    1.28M-sample index took 5 s each). Pickled as this object, the process object is a few hundred
    bytes and unpickles, in the worker, to the dataset read from an anonymous file whose
    descriptor it inherits. :meth:`close` it right after the workers started; outside a process
    start, or after :meth:`close`, it pickles as the dataset.
    """

    def __init__(self, dataset: Any, data: bytes) -> None:
        self.dataset = dataset
        self.nbytes = len(data)
        self._fd = _anonymous_file(data)
        self._finalizer = weakref.finalize(self, os.close, self._fd)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Closes this process's descriptor (workers started already keep theirs until they read it)."""
        self._finalizer()

    def __reduce__(self) -> tuple[Any, ...]:
        if self._finalizer.alive and multiprocessing.context.get_spawning_popen() is not None:
            # the descriptor is passed to the process being started (spawn: inherited; forkserver:
            # sent with the start request), like multiprocessing's own connections
            return _receive_dataset, (multiprocessing.reduction.DupFd(self._fd), self.nbytes)
        return _same, (self.dataset,)

    def __repr__(self) -> str:
        return f"ShippedDataset({self.dataset!r}, {self.nbytes} bytes)"


def ship_dataset(dataset: Any, context: Any, *also_sent: Any) -> ShippedDataset | None:
    """A :class:`ShippedDataset` for spawn/forkserver workers (on POSIX) where the dataset pickles
    portably to at least :data:`SHIP_MIN_BYTES`, else ``None`` (hand them ``dataset``); the caller
    closes it once they started. Forkserver: preloads what the dataset and ``also_sent`` (e.g. a
    ``worker_init_fn``) refer to (:func:`preload_forkserver`)."""
    method = start_method(context)
    if os.name != "posix" or method not in ("spawn", "forkserver"):
        return None  # forked workers inherit the dataset; Windows passes handles differently
    packages: set[str] | None = set() if method == "forkserver" else None
    data = _portable_pickle(dataset, packages)
    if packages is not None:
        for obj in also_sent:
            _portable_pickle(obj, packages)
        preload_forkserver(context, packages)
    if data is None or len(data) < SHIP_MIN_BYTES:
        return None
    return ShippedDataset(dataset, data)
