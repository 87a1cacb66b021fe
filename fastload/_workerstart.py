"""Starting worker processes cheaply, for fastload's pool and for torch's workers alike.

Two costs of a process start, and what this module does about each:

- **fork**: a forked worker's garbage collections write to every object it inherited, so the
  parent's heap is copied page by page into each worker; :func:`frozen_heap` freezes it first.
- **spawn and forkserver**: each worker is sent the dataset through a 64 KiB pipe, and each start
  waits for the previous worker's imports; :func:`ship_dataset` pickles the dataset once into an
  anonymous file every worker reads (:class:`ShippedDataset`), and :func:`preload_forkserver` has
  the forkserver import the libraries the workers need before it forks them.

Used by :class:`fastload._pool.WorkerPool` around its workers' start, and by the loader around
torch's iterator's (``fastload.DataLoader._torch_iter``).
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

__all__ = [
    "ENVIRONMENT_FROZEN_LIMIT",
    "FROZEN_AT_IMPORT",
    "PRELOADABLE",
    "SHIP_MIN_BYTES",
    "ShippedDataset",
    "frozen_heap",
    "main_module_packages",
    "preload_forkserver",
    "ship_dataset",
    "start_method",
]


# --------------------------------------------------------------------------------------------
# Forking without copying the parent's heap
# --------------------------------------------------------------------------------------------


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
    they inherit.

    ``gc.freeze()`` before the fork moves every object the collector tracks into its permanent
    generation, which it never examines: a forked worker's collections then leave the inherited
    objects' headers alone, and their memory pages stay shared with the parent instead of being
    copied one by one (CPython's own advice for fork-based servers). ``gc.unfreeze()`` afterwards,
    in the parent (also when starting a worker raises), puts them back in the collector's oldest
    generation; the workers keep them frozen.

    Nothing else changes in the parent, with one effect on timing: objects that were in a young
    generation when the workers started are examined from then on by full collections only
    (as objects that survived two collections are), so a reference cycle among them that becomes
    garbage later is freed by the next full collection rather than by the next young one.

    Not done when ``context`` does not fork (spawn and forkserver workers start from a fresh
    interpreter), and not when the program froze objects itself (``gc.get_freeze_count() > 0``,
    before or after fastload's import): a program that freezes its own heap keeps managing it,
    and ``gc.unfreeze()`` would undo that. A few objects frozen before fastload's import (at most
    :data:`ENVIRONMENT_FROZEN_LIMIT`; seen: 375 frozen at the start of every Python process of one
    GPU machine's environment) are the environment's and do not turn the freeze off; they are
    unfrozen with the rest after the fork, which changes nothing but when the collector looks at
    them.

    Where CUDA is initialised, a full collection runs before the fork (with or without the
    freeze, and with ``freeze=False``: workers that run code of the user's, which gets torch's
    heap as it is): a forked worker must never finalise the parent's CUDA objects.
    """
    if start_method(context) != "fork":
        yield
        return
    if torch.cuda.is_initialized():
        # Garbage the parent has not collected yet (reference cycles) would be collected in the
        # forked workers too, where finalising a CUDA object (an event, a stream, a tensor's
        # memory) aborts the worker ("CUDA error: initialization error"): collect it here first.
        gc.collect()
    if not freeze or gc.get_freeze_count() > _frozen_by_environment():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


# --------------------------------------------------------------------------------------------
# Spawn and forkserver: the dataset pickled once, read by every worker from an anonymous file
# --------------------------------------------------------------------------------------------

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
    load that one pickle; ``None`` otherwise (a tensor, queue, lock, socket, connection inside, or
    anything that does not pickle outside a process start: it is then sent as usual, where any
    real error is reported). The top-level packages of the classes and functions in it are added
    to ``packages``, if given."""
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
    and those of :data:`PRELOADABLE` that ``packages`` or the main module refer to and that are
    imported here, besides what it preloads already. Each worker then forks from a process that
    has them instead of importing them itself (``import torch`` and ``import torchvision`` take
    seconds each).

    Why the main module's: a forkserver worker runs the main module again as it starts, as a
    spawned one does (Python 3.11's forkserver does not preload ``__main__``, although its default
    preload list names it: the start data it reads lacks the main module's path), so a script
    that imports torch and torchvision at the top has each worker import them again, unless the
    forkserver has them already.

    Returns the new preload list, or ``None`` when nothing changed (another start method, or the
    forkserver runs already: it reads the list once, when it starts)."""
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
    """A file descriptor of a new file holding ``data`` that has no name (a memfd on Linux, else an
    unlinked temporary file): the kernel frees it when the last descriptor to it is closed."""
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

    A spawned worker receives its process object (target, arguments, the dataset among them)
    through a pipe. ``Process.start()`` writes it in one go, and a pipe holds 64 KiB: with a larger
    dataset the write returns only once the new interpreter has read nearly all of it, which it
    does after importing the main module and, while unpickling, torch (the worker function comes
    first). So each ``start()`` waits for that worker's imports and the workers start one after
    another: 2 workers with a 1.28M-sample index took 5 s each. Pickled as this object, a worker's
    process object is a few hundred bytes, ``start()`` returns at once, and the workers' imports
    run side by side. In each worker it unpickles to the dataset itself (the same as sending
    the dataset: every worker gets its own copy, ``get_worker_info().dataset`` is the dataset).

    The pickle lives in an anonymous file (:func:`_anonymous_file`) whose descriptor each worker
    inherits when it starts and closes once it has read it: :meth:`close` it right after the
    workers started. The kernel frees the file when the last of them has read it (or exited):
    nothing is left in ``/dev/shm`` or elsewhere, not even after a ``SIGKILL``. Pickled outside a
    process start, or after :meth:`close`, it pickles as the dataset.
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
    """The dataset to hand to the workers about to start with ``context``: a
    :class:`ShippedDataset` when they are spawned or forkserver-started (on POSIX) and the dataset
    pickles to at least :data:`SHIP_MIN_BYTES` in one pickle any number of workers can load, else
    ``None`` (hand them ``dataset`` itself). The caller closes it once the workers started.

    Forkserver workers: the libraries the dataset and ``also_sent`` (e.g. a ``worker_init_fn``)
    refer to are preloaded by the forkserver, if it has not started yet (:func:`preload_forkserver`).
    """
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
