"""Whether code run in worker processes keeps state between passes: read from its bytecode.

torch's default ``DataLoader`` starts new workers at every pass, each with a fresh copy of the
dataset, its transforms and the ``collate_fn``; fastload keeps its default workers between passes
only where that cannot change what a loop gets, that is where the code the workers run changes
nothing it keeps. :func:`stateless_callable` answers that for a callable (and, through
:func:`fastload.recognize.stateless_in_workers`, for a dataset) by reading what it reaches and
the code that may change it. The answer is conservative: "unknown" is "not stateless", which only
costs speed (torch's default: new workers each pass), never other batches.
"""

from __future__ import annotations

import collections
import datetime
import decimal
import dis
import enum
import fractions
import functools
import inspect
import io
import itertools
import logging
import pathlib
import random
import re
import sys
import threading
import types
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

__all__ = ["GlobalRead", "globals_read", "stateless_callable"]

#: The libraries whose transform objects keep no state between calls (their ops' attributes are
#: their settings); what they hold (a ``Compose``'s ops, a ``Lambda``'s function) is looked at too.
_STATELESS_LIBRARIES = ("torchvision.", "fastload.", "torch.", "PIL.")
#: Objects that draw random numbers from a state of their own.
_RANDOM_STATES = (
    random.Random,
    np.random.Generator,
    np.random.RandomState,
    np.random.BitGenerator,
    torch.Generator,
    torch.quasirandom.SobolEngine,
)
#: The items of a library object's list that are looked at (a longer list is data, not ops), and
#: the longest list of ops a user's object may hold (a longer one is data: judged by its items'
#: types, objects looked at one by one up to ``_HELD_ITEMS``).
_HELD_ITEMS, _SHORT_OPS = 4096, 64
#: Values looked at in one question before the answer is "unknown" (a huge nested table).
_VISITS = 20_000

#: Top-level modules whose functions keep no state of their own between calls (their randomness
#: is the global ``random``/numpy/torch generators, which each worker seeds as torch's do).
_KNOWN_MODULES = frozenset(
    "torch torchvision numpy PIL fastload math cmath random functools itertools operator collections "
    "typing enum numbers builtins io re string struct warnings copy dataclasses abc types statistics "
    "bisect heapq time os sys logging pathlib json reprlib contextlib".split()
)
#: Values that are settings: they cannot be changed (or their changes are not data).
_IMMUTABLE = (
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    enum.Enum,
    range,
    slice,
    type(None),
    type(Ellipsis),
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
    np.dtype,
    np.generic,
    pathlib.PurePath,
    re.Pattern,
    datetime.date,
    datetime.time,
    datetime.timedelta,
    decimal.Decimal,
    fractions.Fraction,
    uuid.UUID,
    logging.Logger,
)
#: Settings of Python's own types (a long list of them needs no look at each).
_PLAIN = frozenset(
    {bool, int, float, complex, str, bytes, type(None), pathlib.PosixPath, pathlib.WindowsPath}
)
#: Opcodes that change what a function does not own (a global, an enclosing variable), and those
#: that change an object it reaches (an attribute, an item).
_REBINDS = frozenset({"STORE_GLOBAL", "DELETE_GLOBAL"})
_MUTATES = frozenset(
    {"STORE_ATTR", "DELETE_ATTR", "STORE_SUBSCR", "DELETE_SUBSCR", "STORE_SLICE", "DELETE_SLICE"}
)
#: Names of functions and methods that change their object or an argument in place (torch's
#: in-place methods, ``add_``, are those ending in one underscore).
_MUTATING_METHODS = frozenset(
    "append extend insert pop popitem remove clear update setdefault add discard appendleft "
    "extendleft popleft sort reverse send throw seed manual_seed set_state setstate "
    "__setitem__ __delitem__ __setattr__ __delattr__ setattr delattr setitem delitem methodcaller "
    "__iadd__ __isub__ __imul__ __imatmul__ __itruediv__ __ifloordiv__ __imod__ __ipow__ "
    "__ilshift__ __irshift__ __iand__ __ixor__ __ior__ move_to_end subtract "
    "difference_update intersection_update symmetric_difference_update "
    "fill put putmask place copyto itemset shuffle heappush heappop heapify heapreplace "
    "heappushpop insort insort_left insort_right paste putpixel putdata putalpha putpalette thumbnail "
    "train eval requires_grad_ register_buffer load_state_dict draw fast_forward reset "
    "iadd iand iconcat ifloordiv ilshift imod imul imatmul ior ipow irshift isub itruediv ixor "
    "at partition fill_diagonal put_along_axis Draw pack_into step vector_to_parameters "
    "alpha_composite floodfill ImageDraw frombytes seek reset_parameters add_module register_parameter "
    "register_module zero_grad".split()
)
#: Keyword arguments that make a call write into an array it is given (``np.add(a, 1, out=a)``).
_WRITES_INTO = frozenset({"out", "inplace", "in_place"})
#: Names through which code changes what it cannot be seen to (a module's namespace, the
#: environment, code made from text): what they reach is unknown.
_OPAQUE_GLOBALS = frozenset("exec eval compile globals __import__ import_module get_worker_info".split())
_OPAQUE_ATTRIBUTES = frozenset(
    "modules environ putenv unsetenv import_module __globals__ get_worker_info "
    # PIL's own random draws (C's rand()), which the worker's seeding of random, numpy and torch
    # does not reset
    "effect_spread effect_noise".split()
)
#: Methods run when an object is made or pickled, not as it is called (``__copy__`` and
#: ``__deepcopy__`` run on the object kept: read as its other methods).
_NOT_CALLED = frozenset(
    "__init__ __new__ __post_init__ __init_subclass__ __setstate__ __getstate__ __reduce__ "
    "__reduce_ex__ __class_getitem__".split()
)
_MADE = frozenset({"__init__", "__new__", "__post_init__"})
_DATACLASS_MADE = frozenset({"__init__", "__setattr__", "__delattr__"})
#: Opcodes whose result is a new container (a local assigned one may be filled freely).
_NEW_CONTAINER = frozenset(
    "BUILD_LIST BUILD_MAP BUILD_SET BUILD_CONST_KEY_MAP LIST_EXTEND SET_UPDATE DICT_UPDATE DICT_MERGE".split()
)
#: Opcodes whose result is a new value (a constant, an operator's result, a string): an
#: in-place operator on a local only ever assigned one changes nothing else.
_NEW_VALUE = frozenset(
    "LOAD_CONST LOAD_SMALL_INT BINARY_OP BUILD_STRING FORMAT_VALUE FORMAT_SIMPLE FORMAT_WITH_SPEC "
    "COMPARE_OP UNARY_NEGATIVE UNARY_NOT UNARY_INVERT BUILD_TUPLE BINARY_ADD BINARY_SUBTRACT "
    "BINARY_MULTIPLY BINARY_TRUE_DIVIDE BINARY_FLOOR_DIVIDE BINARY_MODULO BINARY_POWER "
    "BINARY_MATRIX_MULTIPLY".split()
)
#: Functions of a module that change what they are given (``np.add`` makes a new array; these
#: do not).
_MODULE_IN_PLACE = frozenset(
    "shuffle copyto put putmask place fill_diagonal put_along_axis heappush heappop heapify "
    "heapreplace heappushpop insort insort_left insort_right setitem delitem methodcaller seed "
    "manual_seed set_state setstate Draw pack_into vector_to_parameters setattr delattr "
    "iadd iand iconcat ifloordiv ilshift imod imul imatmul ior "
    "ipow irshift isub itruediv ixor".split()
)
#: Instructions that push one value and pop none (a key, an index).
_PLAIN_LOADS = frozenset({"LOAD_CONST", "LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_DEREF", "LOAD_SMALL_INT"})
_LOADS_GLOBAL = frozenset({"LOAD_GLOBAL", "LOAD_DEREF", "LOAD_CLASSDEREF", "LOAD_NAME"})
_LOCAL_NAMES = frozenset({"LOAD_FAST", "STORE_FAST", "DELETE_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_AND_CLEAR"})


#: a namedtuple field's descriptor (``_collections._tuplegetter``; ``collections`` from Python 3.12)
_TUPLE_FIELD = type(vars(collections.namedtuple("_Fields", ["field"]))["field"])
#: Caches kept in an object: what they hold was computed in an earlier pass.
_CACHES = tuple(c for c in (getattr(functools, "_lru_cache_wrapper", None),) if isinstance(c, type))


class _Unknown(Exception):
    """What a callable reaches is too much to look at: unknown."""


def stateless_callable(fn: Any, depth: int = 0, *, given_held: bool = False) -> bool:
    """Whether ``fn`` (a transform, a ``target_transform``, a ``collate_fn``) is known to keep no
    state between calls, so that workers kept between passes call it as new ones would.

    ``given_held``: what it is given may hold objects kept elsewhere (a ``collate_fn``'s samples,
    which a dataset may return as it holds them): changing any of them is state too. The list it
    is given itself (a batch, which torch's fetcher makes anew) may be reordered or filled.

    Known: ``None``; torchvision's, fastload's, torch's and PIL's objects (a module with buffers
    aside: ``BatchNorm``'s running statistics; an iterator; an op told to work in place where it
    reaches data), with what they hold known too (a ``Compose``'s ops, a ``Lambda``'s function, a
    dataset a wrapper holds); a function, ``functools.partial``, bound method or class whose code
    changes nothing outside its call: it assigns no global or enclosing variable, and what it
    reaches (globals it reads, its closure, its defaults, a method's object and class) is
    settings (numbers, strings, tuples, dtypes, paths), modules of known libraries, known
    callables, or containers and arrays its code (and its class's methods) never changes (no
    attribute or item assignment, no ``append``/``update``/``add_``/``out=``/``+=``... but on a
    container it made itself). A random generator of its own (``np.random.default_rng``,
    ``random.Random``, a ``torch.Generator``) is state: new workers would start each pass from
    the main process's copy of it (the global ``random``, numpy and torch generators are seeded
    in each worker, as torch seeds them). Code that reaches a module's namespace, the
    environment or ``exec``, a file or another installed library's class, is unknown; anything
    unknown is not known to keep no state (and an analysis that fails answers so too). Not seen:
    numpy's ``out`` given by position (``np.multiply(a, 2, a)``), ``copy=False`` (``np.nan_to_num``
    writing into a held array) and ``ndarray.resize`` of an array it holds (PIL's ``resize``, far
    more common, makes a new image): pass ``persistent_workers=False`` for such code."""
    try:
        reach = _Reach()
        if not given_held:
            return reach.stateless(fn, depth)
        reach.mutable = True  # its arguments' items: another's objects
        code = getattr(fn, "__code__", None) if isinstance(fn, types.FunctionType) else None
        own = code.co_varnames[0] if code is not None and code.co_argcount else None
        ok = reach.function_ok(fn, depth, own=own) if own is not None else reach.callable_ok(fn, depth)
        return ok and not reach.mutates
    except (_Unknown, RecursionError):
        return False
    except Exception:  # noqa: BLE001 -- a user's object that fails to be looked at is unknown
        return False


def _global_generators() -> tuple[Any, ...]:
    """The generators each worker seeds as torch's do (``random``'s, numpy's, torch's own)."""
    return (getattr(random, "_inst", None), getattr(np.random.mtrand, "_rand", None), torch.default_generator)


def _users_callable(fn: Any) -> bool:
    """Whether ``fn`` is a callable of the user's code (a function, a method, an object)."""
    fn = getattr(fn, "__func__", fn)
    if isinstance(fn, types.FunctionType):
        home = fn.__globals__.get("__name__")  # (not __module__: functools.wraps copies that)
        return not (
            isinstance(home, str)
            and ((home + ".").startswith(_STATELESS_LIBRARIES) or home.split(".")[0] in _KNOWN_MODULES)
        )
    return callable(fn) and not isinstance(fn, type) and not _library(fn)


def _filled_attributes(instructions: list[dis.Instruction], own: str, joins: set[int]) -> set[str]:
    """The attributes a constructor sets on its new object (``own``) to new containers only
    (``self.samples = []``), each before it is read: filling them is filling the new object."""
    stored: dict[str, bool] = {}
    for k, ins in enumerate(instructions):
        target = _changed(instructions, k) if ins.opname == "STORE_ATTR" else None
        if target is not None and target.opname.startswith("LOAD_FAST") and target.argval == own:
            value = instructions[k - 2] if k > 1 else None
            fresh = value is not None and value.opname in _NEW_CONTAINER and ins.offset not in joins
            stored[ins.argval] = stored.get(ins.argval, True) and fresh
        elif ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and ins.argval not in stored:
            stored[ins.argval] = False  # read (a class attribute) before it is set
    return {name for name, fresh in stored.items() if fresh}


def _generated(member: Any) -> bool:
    """Whether a method was made from text (a dataclass's ``__init__``), not written in a file."""
    return isinstance(member, types.FunctionType) and member.__code__.co_filename.startswith("<")


def _jump_targets(instructions: list[dis.Instruction]) -> set[int]:
    """The offsets jumps go to (a value there may come from either way)."""
    jumps = set(dis.hasjrel) | set(dis.hasjabs)
    return {ins.argval for ins in instructions if ins.opcode in jumps and isinstance(ins.argval, int)}


def _module(cls: Any) -> str:
    name = getattr(cls, "__module__", None)
    return name if isinstance(name, str) else ""


def _library(obj: Any) -> bool:
    return _module(type(obj)).startswith(_STATELESS_LIBRARIES)


def _installed(cls: type) -> bool:
    """Whether ``cls`` comes from an installed package (not the user's own code)."""
    path = getattr(sys.modules.get(_module(cls)), "__file__", None) or ""
    return "site-packages" in path or "dist-packages" in path


def _in_place(name: Any) -> bool:
    return isinstance(name, str) and (
        name in _MUTATING_METHODS
        or (name.endswith("_") and not name.startswith("_") and not name.endswith("__"))
    )


def _filled(cell: Any) -> bool:
    try:
        _ = cell.cell_contents
    except ValueError:  # an empty cell (a name not yet bound)
        return False
    return True


def _attributes(obj: Any) -> dict[str, Any] | None:
    """An object's attributes: its ``__dict__`` and its slots (``None``: it has neither)."""
    attributes = getattr(obj, "__dict__", None)
    found = dict(attributes) if isinstance(attributes, dict) else None
    for klass in type(obj).__mro__:
        slots = vars(klass).get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name.startswith("__") and not name.endswith("__"):  # stored under its mangled name
                name = f"_{klass.__name__.lstrip('_')}{name}"
            if name not in ("__dict__", "__weakref__") and hasattr(obj, name):
                found = found if found is not None else {}
                found[name] = getattr(obj, name)
    return found


def _names(ins: dis.Instruction) -> tuple[Any, ...]:
    """The names an instruction loads or stores (two for Python 3.13's paired loads)."""
    return ins.argval if isinstance(ins.argval, tuple) else (ins.argval,)


def _changed(instructions: list[dis.Instruction], k: int) -> dis.Instruction | None:
    """The instruction that loads the object the store at ``k`` changes, where it is a plain
    load: just before an attribute's store, two before an item's (three before a slice's)."""
    ins, before = instructions[k], instructions[k - 1] if k else None
    if before is not None and before.opname == "LOAD_FAST_LOAD_FAST":  # Python 3.13: two loads in one
        first, second = before.argval
        name = second if ins.opname.endswith("ATTR") else first if ins.opname.endswith("SUBSCR") else None
        return None if name is None else before._replace(opname="LOAD_FAST", argval=name)
    back = 1 if ins.opname.endswith("ATTR") else 2 if ins.opname.endswith("SUBSCR") else 3
    if back == 2 and k > 1 and instructions[k - 2].opname == "LOAD_FAST_LOAD_FAST" and before is not None:
        if before.opname in _PLAIN_LOADS:  # ``v, d`` loaded as one, then the key
            return before._replace(opname="LOAD_FAST", argval=instructions[k - 2].argval[1])
        return None
    if k < back or not all(
        instructions[k - j].opname in _PLAIN_LOADS and not instructions[k - j].argrepr.startswith("NULL")
        for j in range(1, back)
    ):
        return None  # a key or a bound computed: which object changes is not known
    return instructions[k - back]


def _writes_by_position(fn: Any) -> bool:
    """Whether ``fn`` (a library's function) takes ``inplace`` (or ``out``) as a positional argument:
    ``torch.nn.functional.leaky_relu(x, 0.5, True)`` writes into ``x``."""
    return isinstance(fn, types.FunctionType) and _takes_inplace(fn)


@functools.lru_cache(maxsize=4096)
def _takes_inplace(fn: types.FunctionType) -> bool:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name in _WRITES_INTO and p.kind is p.POSITIONAL_OR_KEYWORD for p in parameters)


def _exact_setting(kind: type) -> bool:
    """A settings type of Python's or a library's own (a user's subclass of one may hold state)."""
    return _module(kind).split(".")[0] in _KNOWN_MODULES


def _in_place_op(ins: dis.Instruction) -> bool:
    return ins.opname.startswith("INPLACE_") or (ins.opname == "BINARY_OP" and ins.argrepr.endswith("="))


#: A global read as data: the module namespace and the name (``SIZE`` in ``Resize(SIZE)``).
GlobalRead = tuple[dict[str, Any], str]
_recording = threading.local()
#: Globals that are code or modules, not data a loop may assign between epochs.
_CODE = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType)


@contextmanager
def globals_read() -> Iterator[list[GlobalRead]]:
    """Inside the block, every global that the code looked at by :func:`stateless_callable` reads
    as data (a number, a list, an object: not a module, class or function) is added to the list
    given: stateless code can still read a global the loop assigns between epochs (``SIZE =
    epoch_size(epoch)``), which workers kept from an earlier pass would not see."""
    read: list[GlobalRead] = []
    previous = getattr(_recording, "read", None)
    _recording.read = read
    try:
        yield read
    finally:
        _recording.read = previous


class _Reach:
    """One question of :func:`stateless_callable`: what a callable reaches, and whether its code
    may change any of it. Objects already looked at are not looked at again (cycles)."""

    def __init__(self) -> None:
        self.read: list[GlobalRead] | None = getattr(_recording, "read", None)
        self.seen: set[Any] = set()
        self.mutable = False  # it reaches something its code could change
        self.mutates = False  # some code looked at changes an attribute or an item
        self.visits = 0

    def stateless(self, fn: Any, depth: int = 0) -> bool:
        if not self.callable_ok(fn, depth):
            return False
        return not (self.mutable and self.mutates)

    def first(self, obj: Any, kind: str = "") -> bool:
        """Whether ``obj`` is looked at for the first time."""
        key = (id(obj), kind)
        if key in self.seen:
            return False
        self.seen.add(key)
        return True

    # what a value reached is ---------------------------------------------------------------

    def value_ok(self, value: Any, depth: int) -> bool:
        """A value a callable reaches: a setting, a module, a callable (looked into), or a
        container (``mutable``: fine only if no code changes one)."""
        self.visits += 1
        if self.visits > _VISITS:
            raise _Unknown
        if isinstance(value, _IMMUTABLE):
            if _exact_setting(type(value)):
                return True
            own = _attributes(value) or {}  # a subclass's (an enum member's) attributes
            return self.class_ok(type(value), depth + 1) and all(
                self.value_ok(v, depth + 1) for v in own.values() if v is not value
            )
        if depth > 8:
            return False
        if isinstance(value, _RANDOM_STATES):
            return any(value is g for g in _global_generators())
        if isinstance(value, types.ModuleType):
            return value.__name__.split(".")[0] in _KNOWN_MODULES
        if isinstance(value, collections.defaultdict):
            return False  # reading an item adds it
        if isinstance(value, (tuple, frozenset, list, dict, set, np.ndarray)) and not self.first(value):
            return True
        if isinstance(value, (tuple, frozenset, list, dict, set)) and not _exact_setting(type(value)):
            if not self.class_ok(type(value), depth + 1):  # a NamedTuple's, a dict subclass's methods
                return False
            own = _attributes(value) or {}  # what its constructor set on it
            if own:
                self.mutable = True
            if not all(self.value_ok(v, depth + 1) for v in own.values()):
                return False
        if isinstance(value, (tuple, frozenset)):
            if len(value) > _SHORT_OPS:
                return self.data_ok(value, depth)
            return all(self.value_ok(v, depth + 1) for v in value)
        if isinstance(value, (list, dict, set, bytearray, np.ndarray, torch.Tensor)):
            self.mutable = True
            if isinstance(value, dict) and any(isinstance(k, str) and k in _WRITES_INTO for k in value):
                self.mutates = True  # ``np.add(a, x, **self.kw)`` with ``kw = {"out": a}``
            if isinstance(value, np.ndarray) and value.dtype == object:
                value = value.ravel().tolist()
            elif isinstance(value, (np.ndarray, torch.Tensor, bytearray)):
                return True
            if len(value) > _SHORT_OPS:  # data (a table, samples)
                if isinstance(value, dict):
                    return self.data_ok(value.keys(), depth) and self.data_ok(value.values(), depth)
                return self.data_ok(value, depth)
            items: Any = itertools.chain(value.keys(), value.values()) if isinstance(value, dict) else value
            return all(self.value_ok(v, depth + 1) for v in items)
        if callable(value) or _attributes(value) is not None:
            return self.callable_ok(value, depth)
        return False

    def data_ok(self, items: Any, depth: int) -> bool:
        """A long container's items: settings, or tuples of settings (a table of samples), by
        their types; else up to ``_HELD_ITEMS`` objects, each looked at (more: unknown)."""
        kinds = set(map(type, items))
        if kinds == {tuple}:
            kinds = set(map(type, itertools.chain.from_iterable(items)))
        if all(map(self.plain_or_data, kinds)):
            return True
        if len(items) > _HELD_ITEMS:
            return False  # objects each of which may hold state: too many to look at
        return all(self.value_ok(v, depth + 1) for v in items)

    def plain_or_data(self, kind: type) -> bool:
        """Whether a long container's items of this type are settings (numbers, strings, paths,
        numpy scalars) or data (arrays, tensors, images: ``mutable``, so the code that reads them
        must not change them)."""
        if kind in _PLAIN or (issubclass(kind, np.generic) and _module(kind).startswith("numpy")):
            return True
        if issubclass(kind, (np.ndarray, torch.Tensor)) or _module(kind).startswith("PIL."):
            self.mutable = True
            return True
        return False

    # callables -----------------------------------------------------------------------------

    def callable_ok(self, fn: Any, depth: int) -> bool:
        if fn is None:
            return True
        if depth > 8:
            return False
        if isinstance(fn, types.FunctionType):
            return self.function_ok(fn, depth)
        if isinstance(fn, functools.partial):
            return (
                self.callable_ok(fn.func, depth + 1)
                and all(self.value_ok(v, depth + 1) for v in fn.args)
                and all(self.value_ok(v, depth + 1) for v in fn.keywords.values())
            )
        if isinstance(fn, types.MethodType):
            owner = fn.__self__
            if any(owner is g for g in _global_generators()):
                if _in_place(fn.__name__):
                    self.mutates = True  # random.shuffle kept and called on what it is given
                return True  # numpy.random.rand: a method of the generator each worker seeds
            if isinstance(owner, type):  # a classmethod
                return self.class_ok(owner, depth + 1) and self.callable_ok(fn.__func__, depth + 1)
            return self.object_ok(owner, depth + 1) and self.callable_ok(fn.__func__, depth + 1)
        if isinstance(fn, (types.BuiltinFunctionType, types.MethodWrapperType)):  # also a bound builtin
            owner = getattr(fn, "__self__", None)
            if owner is None or isinstance(owner, types.ModuleType):
                return owner is None or owner.__name__.split(".")[0] in _KNOWN_MODULES
            if isinstance(owner, _RANDOM_STATES):
                if _in_place(fn.__name__):
                    self.mutates = True  # np.random.shuffle kept and called on what it is given
                return any(owner is g for g in _global_generators())
            if isinstance(owner, type):
                return self.class_ok(owner, depth + 1, made=True)
            if _in_place(fn.__name__):
                self.mutates = True  # a list's bound append kept and called
            return self.value_ok(owner, depth + 1)
        if isinstance(fn, type):
            return self.class_ok(fn, depth, made=True)
        return self.object_ok(fn, depth)

    def function_ok(self, fn: types.FunctionType, depth: int, own: str | None = None) -> bool:
        if not self.first(fn, own or ""):
            return True
        if not _users_callable(fn):
            # torch's default_collate, torchvision's functionals; a wrapper of the user's function
            # (torch.compile, torch.no_grad) runs that function
            cells = [cell.cell_contents for cell in fn.__closure__ or () if _filled(cell)]
            for held in [c for c in cells if isinstance(c, (dict, list, tuple))]:  # singledispatch's registry
                cells.extend(itertools.islice(held.values() if isinstance(held, dict) else held, _HELD_ITEMS))
            registered = fn.__globals__.get("default_collate_fn_map")  # torch's collate, extended
            if isinstance(registered, dict):
                cells.extend(registered.values())
            wrapped = [*cells, getattr(fn, "__wrapped__", None)]
            return all(  # (a library's function it closes over: its own closure, singledispatch's)
                self.callable_ok(f, depth + 1)
                for f in wrapped
                if _users_callable(f) or isinstance(f, types.FunctionType)
            )
        if fn.__dict__:
            self.mutable = True  # attributes of its own (the code may set them)
        if not self.code_ok(fn.__code__, fn.__globals__, depth, own):
            return False
        cells = [cell.cell_contents for cell in fn.__closure__ or () if _filled(cell)]
        defaults = [*(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values()]
        return all(self.value_ok(v, depth + 1) for v in [*cells, *defaults])

    def code_ok(
        self, code: types.CodeType, namespace: dict[str, Any], depth: int, own: str | None = None
    ) -> bool:
        """A function's code (and the code of functions, lambdas and comprehensions inside it):
        the globals it reads are looked at; assigning a global, an enclosing variable or an
        attribute or item of one is state; changing anything else it reaches (an attribute, an
        item, an in-place method or operator, ``out=``) is ``mutates``, except a container the
        code made itself (``own``: the object a constructor fills)."""
        builtins = namespace.get("__builtins__", {})
        instructions = list(dis.get_instructions(code))
        joins = _jump_targets(instructions)
        new, numbers = self.locals_made(code, instructions, joins)
        if own is not None and any(
            ins.opname.startswith("STORE_FAST") and own in _names(ins) for ins in instructions
        ):
            own = None  # ``self`` rebound: not (only) the new object
        filled = _filled_attributes(instructions, own, joins) if own is not None else set()
        if own is not None:
            new.add(own)
        writes_by_position = False  # it calls a function that takes ``inplace`` by position
        chain: Any = None  # the module the instruction before loaded (``torch.nn.functional``)
        for k, ins in enumerate(instructions):
            reached, chain = chain, None
            before = instructions[k - 1] if k else None
            if ins.offset in joins:
                before = None  # a value that may come from another way
            if ins.opname in _REBINDS or (ins.opname == "STORE_DEREF" and ins.argval in code.co_freevars):
                return False
            if ins.opname in _MUTATES:
                target = _changed(instructions, k)
                if target is not None and any(instructions[j].offset in joins for j in range(k - 2, k + 1)):
                    target = None
                if target is not None and target.opname in _LOADS_GLOBAL:
                    return False  # a global's or an enclosing variable's object changed
                if not (
                    target is not None and target.opname.startswith("LOAD_FAST") and target.argval in new
                ):
                    self.mutates = True
            elif _in_place_op(ins):
                after = instructions[k + 1] if k + 1 < len(instructions) else None
                if not (
                    after is not None
                    and after.opname.startswith("STORE_FAST")
                    and _names(after)[0] in numbers
                ):
                    self.mutates = True  # ``a = self.array; a += 1``: what ``a`` is changes
            elif ins.opname in _LOADS_GLOBAL and ins.argval in _OPAQUE_GLOBALS:
                return False
            elif ins.opname == "IMPORT_NAME" and str(ins.argval).split(".")[0] not in _KNOWN_MODULES:
                return False  # ``from mymodule import SEEN`` inside it: what SEEN is, is not looked at
            elif ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
                name = ins.argval
                if name in namespace:
                    if not self.value_ok(namespace[name], depth + 1):
                        return False
                    if self.read is not None and not isinstance(namespace[name], _CODE):
                        self.read.append((namespace, name))
                    writes_by_position = writes_by_position or _writes_by_position(namespace[name])
                    chain = namespace[name] if isinstance(namespace[name], types.ModuleType) else None
                elif not (name in builtins if isinstance(builtins, dict) else hasattr(builtins, name)):
                    return False  # not defined yet: unknown
                if _in_place(name) or _in_place(getattr(namespace.get(name), "__name__", None)):
                    self.mutates = True  # ``from heapq import heappush`` (also under another name)
            elif ins.opname in ("LOAD_ATTR", "LOAD_METHOD", "LOAD_SUPER_ATTR", "IMPORT_FROM"):
                if ins.argval == "__init__" and own is None and ins.opname != "LOAD_SUPER_ATTR":
                    self.mutates = True  # ``self.__init__()`` again: its stores change what is kept
                if ins.argval in _OPAQUE_ATTRIBUTES:
                    return False  # ``sys.modules``, ``os.environ``, ``importlib.import_module``
                module = namespace.get(before.argval) if before is not None else None
                if reached is not None and ins.offset not in joins:  # ``F.relu``, ``torch.nn.functional.elu``
                    attribute = getattr(reached, ins.argval, None)
                    writes_by_position = writes_by_position or _writes_by_position(attribute)
                    chain = attribute if isinstance(attribute, types.ModuleType) else None
                of_module = (
                    before is not None
                    and before.opname == "LOAD_GLOBAL"
                    and isinstance(module, types.ModuleType)
                    and ins.argval in _MUTATING_METHODS
                    and not ins.argval.startswith("__")
                    and ins.argval not in _MODULE_IN_PLACE
                    and getattr(getattr(module, ins.argval, None), "__name__", ins.argval) == ins.argval
                )  # ``np.sort(a)``, ``TF.rotate(img, 10)``: a function of a module, not a method
                if (
                    _in_place(ins.argval)
                    and not of_module
                    and not (
                        before is not None
                        and (
                            before.opname.startswith("LOAD_FAST")
                            and _names(before)[-1] in new
                            or before.opname == "LOAD_ATTR"
                            and before.argval in filled
                            and k > 1
                            and instructions[k - 2].opname.startswith("LOAD_FAST")
                            and instructions[k - 2].argval == own
                            and before.offset not in joins
                        )
                    )
                ):  # ``out.append(x)`` on a list it made (or the constructor's own) is not state
                    self.mutates = True
        consts = code.co_consts
        if any(isinstance(c, str) and (_in_place(c) or own is None and c in _MADE) for c in consts):
            self.mutates = True  # ``getattr(x, "append")``, ``getattr(self, "__init__")()``
        if writes_by_position and any(c is True for c in consts):
            self.mutates = True  # ``F.leaky_relu(x, 0.5, True)``: ``inplace`` given by position
        if any(isinstance(c, tuple) and _WRITES_INTO.intersection(c) for c in consts):
            self.mutates = True  # ``np.add(a, 1, out=a)``, ``inplace=True``
        return all(
            self.code_ok(const, namespace, depth + 1) for const in consts if isinstance(const, types.CodeType)
        )

    @staticmethod
    def locals_made(
        code: types.CodeType, instructions: list[dis.Instruction], joins: set[int]
    ) -> tuple[set[str], set[str]]:
        """The locals the code only ever assigns new containers (``d = {}``: it may fill them),
        and those it only ever assigns constants (``n = 0``: an in-place operator on one is
        arithmetic; on anything else, ``a += 1`` may change what ``a`` is, an array it holds)."""
        stores: dict[str, set[str]] = collections.defaultdict(set)
        for k, ins in enumerate(instructions):
            if not ins.opname.startswith("STORE_FAST"):
                continue
            source = instructions[k - 1] if k else None
            kind = (
                "joined"
                if source is None or ins.offset in joins
                else "result"
                if _in_place_op(source)
                else "BINARY_SUBSCR"
                if source.opname == "BINARY_OP" and "[" in source.argrepr  # (Python 3.14)
                else source.opname
            )
            for name in _names(ins):
                stores[name].add(kind)
        arguments = code.co_argcount + code.co_kwonlyargcount
        arguments += bool(code.co_flags & inspect.CO_VARARGS) + bool(code.co_flags & inspect.CO_VARKEYWORDS)
        given = set(code.co_varnames[:arguments])
        new, numbers = set(), set()
        for name, kinds in stores.items():
            if name in given:
                continue
            made = kinds - {"result"}
            if made and made <= _NEW_CONTAINER and "result" not in kinds:
                new.add(name)
            if made and made <= _NEW_VALUE:
                numbers.add(name)
        return new, numbers

    def class_ok(self, cls: type, depth: int, made: bool = False) -> bool:
        """A class reached: a library's, or a class of the user's whose methods and class
        attributes are known (a class attribute may be changed). ``made``: the code makes
        objects of it, so what runs as one is made (``__init__``, ``__new__``, a metaclass's
        ``__call__``) counts, except filling the new object itself."""
        module = _module(cls)
        if module.startswith(_STATELESS_LIBRARIES) or module.split(".")[0] in _KNOWN_MODULES:
            return True
        if not self.first(cls, "made" if made else "class"):
            return True
        if _installed(cls):
            return False  # another library's class: its code is not read (unknown, not stateless)
        self.mutable = True  # its class attributes
        if made and type(cls) is not type and not self.class_ok(type(cls), depth + 1):
            return False  # a metaclass's __call__ runs as one is made
        for klass in cls.__mro__:
            if klass is object or _module(klass).startswith(_STATELESS_LIBRARIES):
                continue
            dataclass = "__dataclass_fields__" in vars(klass)
            fresh = not any(  # a __new__ of the user's may hand back an object made before
                "__new__" in vars(base) and not _module(base).startswith(_STATELESS_LIBRARIES)
                for base in cls.__mro__
                if base is not object and _module(base).split(".")[0] not in _KNOWN_MODULES
            )
            for name, member in vars(klass).items():
                if dataclass and name in _DATACLASS_MADE and _generated(member):
                    # a dataclass's own: it sets the fields (a frozen one's raise); the defaults
                    # and default factories it calls count
                    for field in vars(klass)["__dataclass_fields__"].values():
                        factory = getattr(field, "default_factory", None)
                        if callable(factory) and not self.callable_ok(factory, depth + 1):
                            return False
                        if not self.value_ok(getattr(field, "default", None), depth + 1):
                            return False
                    continue
                if not self.member_ok(name, member, depth, fresh):
                    return False
        return True

    def member_ok(self, name: str, member: Any, depth: int, fresh: bool = True) -> bool:
        if (
            name.startswith("__")
            and name.endswith("__")
            and not isinstance(member, (types.FunctionType, staticmethod, classmethod))
        ):
            if (
                member is None
                or isinstance(member, (str, int, tuple, frozenset, set))
                or name in ("__annotations__", "__dataclass_fields__")  # (a dataclass's: read above)
                or _module(type(member)) == "dataclasses"
                or (_module(type(member)) == "builtins" and not isinstance(member, (list, dict, bytearray)))
            ):
                return True  # __module__, __doc__, __dict__, __weakref__, __slots__, tuple's __repr__ ...
            # a cache or a decorator's object standing for ``__getitem__``/``__call__``, or a
            # value kept under such a name: read as any other member
            return self.value_ok(member, depth + 1)
        member = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
        if isinstance(member, property):  # its getter runs as it is read
            return self.callable_ok(member.fget, depth + 1)
        if isinstance(member, functools.cached_property):
            self.mutates = True  # the first read stores its value in the object
            return self.callable_ok(member.func, depth + 1)
        if type(member) is _TUPLE_FIELD or (
            not isinstance(member, types.FunctionType)
            and _module(type(member)) == "builtins"
            and hasattr(member, "__get__")
        ):
            return True  # a slot's or a namedtuple field's descriptor: the object's, not state
        if isinstance(member, types.FunctionType):
            if name in _MADE:  # it runs on a new object (the code may make one): filling it is not state
                own = member.__code__.co_varnames[0] if member.__code__.co_argcount else None
                return self.function_ok(member, depth + 1, own=own if name != "__new__" and fresh else None)
            if name in _NOT_CALLED:  # it runs on a new object, not on what is kept
                return True
            return self.function_ok(member, depth + 1)
        return self.value_ok(member, depth + 1)

    def object_ok(self, obj: Any, depth: int) -> bool:
        """An object: a library's (its settings; what it holds of someone else's looked into;
        a module's buffers are state), or the user's (its attributes and its class's methods)."""
        if obj is None or isinstance(obj, types.ModuleType):
            return True
        if isinstance(obj, _IMMUTABLE):
            return _exact_setting(type(obj)) or self.class_ok(type(obj), depth + 1)
        if isinstance(obj, _RANDOM_STATES):
            return any(obj is g for g in _global_generators())
        if isinstance(obj, (io.IOBase, types.GeneratorType)) or hasattr(type(obj), "__next__"):
            return False  # a file, an iterator: reading it moves it on
        if isinstance(obj, _CACHES):
            return False  # a cache kept between passes answers what new workers would compute
        attributes = _attributes(obj)
        if attributes is None:
            return _library(obj) and not isinstance(obj, (list, dict, set))
        if not self.first(obj):
            return True
        if isinstance(obj, torch.nn.Module) and (
            next(obj.buffers(), None) is not None or next(obj.parameters(), None) is not None
        ):
            # running statistics (BatchNorm) change as it is called in training mode; weights are
            # reset (a random convolution), cast (``.to``/``.half()``) or trained in place
            return False
        if _library(obj):
            return self.library_ok(obj, attributes, depth)
        self.mutable = True  # its attributes may be set by its methods
        if not all(self.value_ok(value, depth + 1) for value in attributes.values()):
            return False
        return self.class_ok(type(obj), depth + 1)

    def library_ok(self, obj: Any, attributes: dict[str, Any], depth: int) -> bool:
        """A library's object: its own settings and bookkeeping (a Module's hook dicts) are not
        state; what it holds of someone else's is looked at (a ``Compose``'s ops, a ``Lambda``'s
        function, a dataset a ``Subset`` holds), and so are the library's objects it holds."""
        if attributes.get("inplace") is True:
            self.mutates = True  # it writes into what it is given (data the caller may keep)
        if "PIL." in _module(type(obj)) and hasattr(obj, "im"):
            self.mutable = True  # an image: its pixels may be changed in place
        if any(isinstance(v, (list, dict, set, np.ndarray, torch.Tensor)) for v in attributes.values()):
            self.mutable = True  # a Compose's list of ops, a module's parameters
        for value in attributes.values():
            held = (
                itertools.chain(value.keys(), value.values())
                if isinstance(value, dict)
                else value
                if isinstance(value, (list, tuple))
                else [value]
            )
            for item in itertools.islice(held, _HELD_ITEMS):  # a longer list is data, not ops
                if isinstance(item, (np.ndarray, torch.Tensor)):
                    continue
                if isinstance(item, _IMMUTABLE):
                    if _exact_setting(type(item)) or self.class_ok(type(item), depth + 1):
                        continue
                    return False
                if isinstance(item, type):  # a class it makes objects of (``Lambda(MyOp)``)
                    if not self.class_ok(item, depth + 1, made=True):
                        return False
                elif isinstance(item, _RANDOM_STATES):
                    if not any(item is g for g in _global_generators()):
                        return False
                elif (callable(item) or _attributes(item) is not None) and not self.callable_ok(
                    item, depth + 1
                ):
                    return False
        return True
