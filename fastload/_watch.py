"""What a pass start compares of the dataset: what workers started earlier would not see.

torch's default loader starts new workers every epoch, and its main process reads the dataset as it
is, so a change the loop makes between epochs -- a new transform, an op's size changed in place
(progressive resizing), samples relabelled in place (label cleaning, pseudo-labels) -- reaches
the next epoch. fastload keeps workers and plans (the fast path's index and fused pipeline, the
workers' view of a torchvision folder) across passes, so each pass start compares
:func:`dataset_state` with the last one and starts again from the dataset as it is where it
differs (:meth:`fastload.DataLoader._refresh_path`).

The state holds each public attribute's value: numbers, strings and short tuples by value; lists,
dicts and arrays by a shallow copy of their content, one copy of a container two attributes share
(a torchvision folder of 1.28M samples, whose ``samples`` and ``imgs`` are one list: a 40 ms
copy, 20 MiB held, and a 3 ms comparison per pass); tensors by identity and in-place version;
transform objects (``Compose``, torchvision ops, anything with public attributes) by their public
attributes, four levels deep from the dataset (an op of a ``Compose`` of a ``Subset``'s dataset
included); wrapped datasets (``Subset``, ``ConcatDataset``) two levels deep; anything else
(functions, long tuples, files) by identity. Of a class of the user's, its private attributes
(unless a library class among its bases may keep caches there) and its classes' data attributes
too; arrays a dict holds by content; and the module globals its code reads as data
(:func:`globals_state`, from :func:`fastload._stateless.globals_read`). Not seen: a change inside
an object kept in a list (the copy is shallow) or deeper than these levels, an array over 64 MiB
changed in place, a tensor written through ``.numpy()`` or ``.data`` (its version unchanged).
"""

from __future__ import annotations

import enum
import types
from typing import Any, Generic

import numpy as np
import torch

__all__ = [
    "SOURCE_ATTRIBUTES",
    "changed_attributes",
    "changed_globals",
    "dataset_state",
    "globals_state",
    "source_key",
    "source_state",
]

#: What the loader's path decision and plans are made from (its own index for ``_index``).
SOURCE_ATTRIBUTES = ("transform", "target_transform", "samples", "loader", "_index")

#: Tuples longer than this (a sample list kept as a tuple) are compared by identity, not value.
_SHORT_TUPLE = 64
#: Lists (a ``Compose``'s ops) up to this length are walked item by item, longer ones copied.
_SHORT_LIST = 64
#: An array up to this size is copied to be compared; a larger one by identity and shape.
_ARRAY_BYTES = 64 * 2**20
_OPAQUE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType)


def _plain(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, complex, str, bytes, enum.Enum))


class _Content:
    """A mutable container's content when the state was taken (a shallow copy), equal to another
    snapshot of the same content."""

    __slots__ = ("data", "kind")

    def __init__(self, value: list[Any] | dict[Any, Any] | np.ndarray) -> None:
        self.kind = type(value).__name__
        data: Any
        if isinstance(value, np.ndarray):
            data = value.copy() if value.nbytes <= _ARRAY_BYTES else (id(value), value.shape)
        elif isinstance(value, dict):  # arrays it holds by content (labels updated in place)
            data = {k: _Content(v) if isinstance(v, np.ndarray) else v for k, v in value.items()}
        else:
            data = value.copy()
        self.data = data

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Content) or other.kind != self.kind:
            return False
        a, b = self.data, other.data
        if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
            return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and np.array_equal(a, b)
        try:
            return bool(a == b)
        except (ValueError, TypeError, RuntimeError):  # items that do not compare to a bool (arrays)
            if isinstance(a, dict):
                return a.keys() == b.keys() and all(a[k] is b[k] for k in a)
            return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"<{self.kind} content>"


def _value_state(value: Any, depth: int, memo: dict[int, Any]) -> Any:
    if _plain(value):
        return (type(value).__name__, repr(value))
    if isinstance(value, tuple):
        if len(value) > _SHORT_TUPLE:
            return ("tuple", id(value))
        return ("tuple", tuple(_value_state(v, depth + 1, memo) for v in value))
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value), value._version)
    if isinstance(value, list) and len(value) <= _SHORT_LIST and depth < 4:
        return ("list", tuple(_value_state(v, depth + 1, memo) for v in value))
    if isinstance(value, (list, dict, np.ndarray)):
        # one copy of a container two attributes share (a torchvision folder's samples and imgs)
        content = memo.get(id(value))
        if content is None:
            content = memo[id(value)] = _Content(value)
        return content
    if isinstance(value, torch.utils.data.Dataset) and depth < 2:
        return dataset_state(value, depth + 1, memo)
    if depth < 4 and not isinstance(value, _OPAQUE) and isinstance(getattr(value, "__dict__", None), dict):
        items = _watched_attributes(value)
        public = tuple((name, _value_state(v, depth + 1, memo)) for name, v in items)
        return (type(value).__name__, id(value), public)
    return ("object", id(value))


def _users(cls: type) -> bool:
    """Whether ``cls`` is the user's (not torch's, torchvision's, fastload's, PIL's, numpy's)."""
    return str(getattr(cls, "__module__", "")).split(".")[0] not in _LIBRARIES


_LIBRARIES = frozenset({"torch", "torchvision", "fastload", "PIL", "numpy", "builtins", "typing"})
_PLAIN_BASES = (object, torch.utils.data.Dataset, torch.utils.data.IterableDataset, Generic)


def _watched_attributes(obj: Any) -> list[tuple[str, Any]]:
    """An object's attributes a pass start compares: the public ones; of a class of the user's
    also its private ones (``self._scale``) and its classes' data attributes (``SIZE = 16`` in
    the class body, which a loop may assign between epochs), not its methods."""
    attributes = vars(obj)
    cls = type(obj)
    if not _users(cls):
        return [(name, v) for name, v in attributes.items() if name[:1] != "_"]
    # private ones only where no library class in its bases may keep a cache there
    private = all(_users(klass) or klass in _PLAIN_BASES for klass in cls.__mro__)
    out = [(name, v) for name, v in attributes.items() if not name.startswith("__" if private else "_")]
    for klass in cls.__mro__:
        if klass is object or not _users(klass):
            continue
        for name, v in vars(klass).items():
            if name.startswith("__") or name in attributes or callable(v) or hasattr(v, "__get__"):
                continue
            out.append((f"{klass.__name__}.{name}", v))
    return out


def globals_state(read: list[tuple[dict[str, Any], str]]) -> tuple[Any, ...]:
    """The values of the globals the dataset's code reads (see
    :func:`fastload._stateless.globals_read`), as :func:`dataset_state` compares attributes."""
    memo: dict[int, Any] = {}
    return tuple(
        (f"{namespace.get('__name__', '?')}.{name}", _value_state(namespace.get(name, _MISSING), 1, memo))
        for namespace, name in read
    )


_MISSING = ("missing",)


def dataset_state(
    dataset: Any, depth: int = 0, memo: dict[int, Any] | None = None, names: tuple[str, ...] | None = None
) -> tuple[Any, ...]:
    """The dataset's attributes as a pass start compares them (see the module docs); ``names``:
    only those (what the loader's plans are made from, where no workers are kept)."""
    if memo is None:
        memo = {}
    attributes = getattr(dataset, "__dict__", None)
    if attributes is None:
        return (id(dataset),)
    out: list[tuple[str, Any]] = []
    # private attributes of fastload's and torchvision's datasets: their own caches
    for name, value in _watched_attributes(dataset) if isinstance(attributes, dict) else ():
        if names is not None and name not in names:
            continue
        if depth < 2 and isinstance(value, list) and value and isinstance(value[0], torch.utils.data.Dataset):
            out.append((name, tuple(dataset_state(v, depth + 1, memo) for v in value)))
        else:
            out.append((name, _value_state(value, depth, memo)))
    return (id(dataset), tuple(out))


def changed_attributes(before: tuple[Any, ...], after: tuple[Any, ...]) -> list[str]:
    """The names of the attributes whose state differs (``"the dataset object"`` when replaced)."""
    if len(before) != 2 or len(after) != 2 or before[0] != after[0]:
        return ["the dataset object"]
    old, new = dict(before[1]), dict(after[1])
    return [f"'{name}'" for name in sorted(old.keys() | new.keys()) if old.get(name) != new.get(name)]


def changed_globals(before: tuple[Any, ...], after: tuple[Any, ...]) -> list[str]:
    """The globals (of :func:`globals_state`) whose value differs, as ``"global module.NAME"``."""
    old, new = dict(before), dict(after)
    return [f"global {name}" for name in sorted(old.keys() | new.keys()) if old.get(name) != new.get(name)]


def source_state(state: tuple[Any, ...]) -> tuple[Any, ...]:
    """The part of a :func:`dataset_state` the loader's plans are made from."""
    if len(state) != 2:
        return state
    return (state[0], tuple(item for item in state[1] if item[0] in SOURCE_ATTRIBUTES))


def source_key(dataset: Any) -> tuple[Any, ...]:
    """The dataset's own transform, sample list and loader objects (compared by identity)."""
    attributes = getattr(dataset, "__dict__", {})
    return tuple(attributes.get(name) for name in SOURCE_ATTRIBUTES)
