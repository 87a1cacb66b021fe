"""Argument checks shared by every module, in torch's message template.

``"batch_size should be a positive integer, but got batch_size=0"``: the argument's name, what it
should be, and what it got. Never ``assert`` on user input. Integers are Python ints and numpy
integers, never bools or floats.
"""

from __future__ import annotations

import inspect
import numbers
import operator
import os
import re
import sys
from collections.abc import Collection, Sequence
from typing import Any

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def sample_index(i: Any) -> int:
    """A sampler's index as an int (Python, numpy or 0-d tensor integers); anything else (a float
    from a "/" where "//" was meant) raises the ``TypeError`` a list-backed dataset raises."""
    try:
        return operator.index(i)
    except TypeError:
        raise TypeError(f"list indices must be integers or slices, not {type(i).__name__}") from None


def read_error(error: OSError, i: int, path: str) -> OSError:
    """``error`` (reading sample ``i``'s file at ``path``) as the same class with its ``errno`` and
    ``filename`` (a ``FileNotFoundError`` stays one, as torch's loader raises it), its message
    naming the sample: ``[Errno 2] cannot read sample 5: No such file or directory: '/data/x.jpg'``."""
    if error.errno is None:
        return OSError(f"cannot read sample {i} ({path!r}): {error}")
    return type(error)(error.errno, f"cannot read sample {i}: {error.strerror}", path)


def optional_attribute(obj: Any, name: str, default: Any = None) -> Any:
    """``getattr(obj, name, default)`` for an attribute fastload looks for on a user's object:
    also ``default`` where the object lacks it and its own ``__getattr__`` raises another error
    than ``AttributeError``. An error of the attribute itself (a failing property) is raised."""
    try:
        return getattr(obj, name, default)
    except Exception:
        if inspect.getattr_static(obj, name, _MISSING) is _MISSING:
            return default
        raise


_MISSING = object()


def caller_stacklevel() -> int:
    """The ``stacklevel`` for ``warnings.warn`` called where this is called that names the first
    caller outside fastload (the user's line, however deep inside fastload the warning is made)."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level


def _describe(low: int | None, high: int | None) -> str:
    if low is not None and high is not None:
        return f"an integer in [{low}, {high}]"
    if low == 1:
        return "a positive integer"
    if low == 0:
        return "a non-negative integer"
    if low is not None:
        return f"an integer >= {low}"
    if high is not None:
        return f"an integer <= {high}"
    return "an integer"


def check_int(
    value: Any,
    name: str,
    *,
    low: int | None = None,
    high: int | None = None,
    type_error: bool = False,
) -> int:
    """``value`` (argument ``name``) as a Python int in ``[low, high]`` (``None``: unbounded); else
    ``ValueError`` (``TypeError`` for a non-integer with ``type_error``)."""
    what = _describe(low, high)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise (TypeError if type_error else ValueError)(f"{name} should be {what}, but got {name}={value!r}")
    number = operator.index(value)
    if (low is not None and number < low) or (high is not None and number > high):
        raise ValueError(f"{name} should be {what}, but got {name}={value!r}")
    return number


def check_optional_int(
    value: Any, name: str, *, low: int | None = None, high: int | None = None, type_error: bool = False
) -> int | None:
    """:func:`check_int` that lets ``None`` through (the message then says "or None")."""
    if value is None:
        return None
    try:
        return check_int(value, name, low=low, high=high, type_error=type_error)
    except (TypeError, ValueError) as e:
        raise type(e)(str(e).replace(", but got", " or None, but got", 1)) from None


def check_bool(value: Any, name: str) -> bool:
    """``value`` if it is a bool, else ``TypeError``."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} should be a bool, but got {name}={value!r}")
    return value


def check_choice(value: Any, name: str, choices: Collection[Any]) -> Any:
    """``value`` if it is one of ``choices``, else ``ValueError`` listing them."""
    if value not in choices:
        listed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{name} should be one of {listed}, but got {name}={value!r}")
    return value


def check_probability(value: Any, name: str = "p") -> float:
    """A number in ``[0, 1]`` as a float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"{name} should be a probability between 0 and 1, but got {name}={value!r}")
    return float(value)


def check_size(size: Any, name: str = "size") -> tuple[int, int]:
    """An ``int`` or a sequence of one or two positive ints -> ``(h, w)`` (``TypeError`` for
    anything else, ``ValueError`` for a size that is not positive)."""
    if isinstance(size, numbers.Integral) and not isinstance(size, bool):
        h = w = int(size)
    elif (
        isinstance(size, Sequence)
        and not isinstance(size, str)
        and len(size) in (1, 2)
        and all(isinstance(s, numbers.Integral) and not isinstance(s, bool) for s in size)
    ):
        h, w = (int(size[0]), int(size[0])) if len(size) == 1 else (int(size[0]), int(size[1]))
    else:
        raise TypeError(f"{name} should be an int or a sequence of one or two ints, but got {name}={size!r}")
    if h <= 0 or w <= 0:
        raise ValueError(f"{name} should be positive, but got {name}={size!r}")
    return h, w


_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
}


def parse_size(text: str) -> int:
    """A byte count written as ``512MB`` (10**6), ``1GiB`` (2**30), ``2.5GB`` or ``1000000``."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([A-Za-z]*)\s*", text)
    if m is None or m[2].lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a size such as 512MB, 1GB or 100MiB")
    return int(float(m[1]) * _UNITS[m[2].lower()])
