"""What a pass start compares of the dataset: what fastload reads of it itself.

fastload's plans are made from :data:`SOURCE_ATTRIBUTES`; torch's loader reads the dataset anew
each pass, so each pass start compares :func:`source_state` with the one the plans were made from
and makes them again where it differs (:func:`fastload._path.refresh_path`). The state holds
numbers, strings and short tuples by value; lists, dicts and arrays by a shallow copy; tensors by
identity and in-place version; transform objects by their public attributes, four levels deep;
anything else by identity.
"""

from __future__ import annotations

import enum
import types
from typing import Any

import numpy as np
import torch

# What the path decision and plans are made from (a fastload dataset's index: ``_index``; timm's: ``reader``).
SOURCE_ATTRIBUTES = ("transform", "target_transform", "samples", "loader", "_index", "reader")

_SHORT_TUPLE = 64  # a longer tuple (a sample list) is compared by identity
_SHORT_LIST = 64  # a list up to this length (a Compose's ops) is walked item by item, a longer one copied
_ARRAY_BYTES = 64 * 2**20  # a larger array is compared by identity and shape
_OPAQUE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType)


def _plain(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, complex, str, bytes, enum.Enum))


class _Content:
    """A shallow copy of a container's content, equal to another copy of the same content."""

    __slots__ = ("data", "kind")

    def __init__(self, value: list[Any] | dict[Any, Any] | np.ndarray) -> None:
        self.kind = type(value).__name__
        data: Any
        if isinstance(value, np.ndarray):
            data = value.copy() if value.nbytes <= _ARRAY_BYTES else (id(value), value.shape)
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
        content = memo.get(id(value))  # one copy of a container two attributes share
        if content is None:
            content = memo[id(value)] = _Content(value)
        return content
    if depth < 4 and not isinstance(value, _OPAQUE) and isinstance(getattr(value, "__dict__", None), dict):
        public = tuple(
            (name, _value_state(v, depth + 1, memo)) for name, v in vars(value).items() if name[:1] != "_"
        )
        return (type(value).__name__, id(value), public)
    return ("object", id(value))


def source_state(dataset: Any) -> tuple[Any, ...]:
    """The state of ``dataset``'s :data:`SOURCE_ATTRIBUTES`, equal to another taken while none changed."""
    attributes = getattr(dataset, "__dict__", None)
    if not isinstance(attributes, dict):
        return (id(dataset),)
    memo: dict[int, Any] = {}
    return (
        id(dataset),
        tuple(
            (name, _value_state(attributes[name], 0, memo))
            for name in SOURCE_ATTRIBUTES
            if name in attributes
        ),
    )


def changed_attributes(before: tuple[Any, ...], after: tuple[Any, ...]) -> list[str]:
    """The names of the attributes whose state differs (``"the dataset object"`` when replaced)."""
    if len(before) != 2 or len(after) != 2 or before[0] != after[0]:
        return ["the dataset object"]
    old, new = dict(before[1]), dict(after[1])
    return [f"'{name}'" for name in sorted(old.keys() | new.keys()) if old.get(name) != new.get(name)]


def source_key(dataset: Any) -> tuple[Any, ...]:
    """The dataset's own transform, sample list and loader objects (compared by identity)."""
    attributes = getattr(dataset, "__dict__", {})
    return tuple(attributes.get(name) for name in SOURCE_ATTRIBUTES)
