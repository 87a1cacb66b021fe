"""Which code fastload's default workers are kept for: ``stateless_callable`` / ``stateless_in_workers``.

A callable or dataset judged stateless that keeps state would give other batches than torch's
new workers from the second pass on (silently); one that keeps none but is judged unknown only
gets torch's default (new workers each pass). Each stateful case here is checked to change as
it is called, so that the test cannot pass on a case that keeps no state.
"""

from __future__ import annotations

import bisect
import collections
import functools
import heapq
import io
import itertools
import logging
import operator
import os
import pathlib
import random
import re
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from numpy.random import shuffle as npshuffle
from PIL import Image, ImageDraw
from torch.utils.data import Dataset, Subset
from torchvision import transforms as T
from torchvision.transforms import functional as TF

import fastload
from fastload.recognize import stateless_callable, stateless_collate, stateless_in_workers

COUNT = 0
# a module of the user's that a function imports inside itself (its list is state)
_REGISTRY = types.ModuleType("fastload_test_registry")
_REGISTRY.SEEN = []  # type: ignore[attr-defined]
sys.modules.setdefault(_REGISTRY.__name__, _REGISTRY)


class Alias:  # an in-place operator on a local that is the held array
    def __init__(self) -> None:
        self.arr = np.zeros(1)

    def __call__(self, x: Any) -> Any:
        a = self.arr
        a += 1
        return float(a[0])


class TorchInPlace:
    def __init__(self) -> None:
        self.t = torch.zeros(1)

    def __call__(self, x: Any) -> Any:
        self.t.add_(1)
        return float(self.t[0])


class NumpyOut:
    def __init__(self) -> None:
        self.a = np.zeros(1)

    def __call__(self, x: Any) -> Any:
        np.subtract(self.a, -1, out=self.a)
        return float(self.a[0])


class Fill:
    def __init__(self) -> None:
        self.a = np.zeros(1)

    def __call__(self, x: Any) -> Any:
        self.a.fill(self.a[0] + 1)
        return float(self.a[0])


class Shuffles:
    def __init__(self) -> None:
        self.order = list(range(10))

    def __call__(self, x: Any) -> Any:
        random.shuffle(self.order)
        return tuple(self.order)


class Heap:
    def __init__(self) -> None:
        self.h: list[int] = []

    def __call__(self, x: Any) -> Any:
        heapq.heappush(self.h, x)
        return len(self.h)


class Insort:
    def __init__(self) -> None:
        self.seen: list[int] = []

    def __call__(self, x: Any) -> Any:
        bisect.insort(self.seen, x)
        return len(self.seen)


class SetItem:
    def __init__(self) -> None:
        self.d: dict[int, int] = {}

    def __call__(self, x: Any) -> Any:
        operator.setitem(self.d, len(self.d), x)
        return len(self.d)


class ByName:
    def __init__(self) -> None:
        self.seen: list[int] = []

    def __call__(self, x: Any) -> Any:
        getattr(self.seen, "append")(x)  # noqa: B009 -- the case: a method called by its name
        return len(self.seen)


class HeldAppend:  # a bound builtin method kept and called
    def __init__(self) -> None:
        self.seen: list[int] = []
        self.push = self.seen.append

    def __call__(self, x: Any) -> Any:
        self.push(x)
        return len(self.seen)


class OrderedMove:
    def __init__(self) -> None:
        self.d = collections.OrderedDict((i, i) for i in range(3))

    def __call__(self, x: Any) -> Any:
        self.d.move_to_end(next(iter(self.d)))
        return next(iter(self.d))


class Counts(collections.Counter):  # a dict subclass: a user class whose methods change itself
    pass


class Reads:  # a held iterator moves on as it is read
    def __init__(self) -> None:
        self.it = iter(range(100))

    def __call__(self, x: Any) -> Any:
        return next(self.it)


class Writes:
    def __init__(self) -> None:
        self.buffer = io.BytesIO()

    def __call__(self, x: Any) -> Any:
        self.buffer.write(b"x")
        return self.buffer.tell()


class ByKey:  # ops kept as a dict's keys
    def __init__(self) -> None:
        self.ops = {Heap(): 0.5}

    def __call__(self, x: Any) -> Any:
        for op in self.ops:
            x = op(x)
        return x


class Records:  # a long list of objects whose method changes them
    class Record:
        def __init__(self) -> None:
            self.views = 0

        def view(self) -> int:
            self.views += 1
            return self.views

    def __init__(self) -> None:
        self.records = [self.Record() for _ in range(100)]

    def __call__(self, x: Any) -> Any:
        return self.records[0].view()


class MadeCounts:  # a class used as the callable: its constructor counts
    made = 0

    def __init__(self, x: Any) -> None:
        type(self).made += 1
        self.v = type(self).made

    def __repr__(self) -> str:
        return f"MadeCounts({self.v})"


class Meta(type):
    calls = 0

    def __call__(cls, *args: Any) -> Any:
        Meta.calls += 1
        return Meta.calls


class ByMeta(metaclass=Meta):
    pass


class OrAlias:  # ``a = self.seen or []``: the held list, not a new one
    def __init__(self) -> None:
        self.seen = [0]

    def __call__(self, x: Any) -> Any:
        a = self.seen or []
        a.append(x)
        return len(self.seen)


class GotInPlace:  # an in-place operator on what a method returned: the held array
    def __init__(self) -> None:
        self.d = {"a": np.zeros(1)}

    def __call__(self, x: Any) -> Any:
        a = self.d.get("a")
        a += 1
        return float(self.d["a"][0])


class UFuncAt:
    def __init__(self) -> None:
        self.a = np.zeros(2)

    def __call__(self, x: Any) -> Any:
        np.add.at(self.a, [0], 1)
        return float(self.a[0])


class Partition:
    def __init__(self) -> None:
        self.a = np.array([3.0, 1.0, 2.0])

    def __call__(self, x: Any) -> Any:
        first = float(self.a[0])
        self.a.partition(1)
        return first


REGISTRY: dict[int, int] = {}


class Registers:  # a constructor writing into a global table under a computed key
    def __init__(self, x: Any) -> None:
        self.key = x
        REGISTRY[self.key] = REGISTRY.get(self.key, 0) + 1
        self.n = REGISTRY[self.key]

    def __repr__(self) -> str:
        return f"Registers({self.n})"


class Hooked:  # an attribute's assignment runs a method that keeps what it was given
    log: list[Any] = []

    def __setattr__(self, name: str, value: Any) -> None:
        Hooked.log.append(value)
        object.__setattr__(self, name, value)

    def __init__(self, x: Any) -> None:
        self.x = x
        self.n = len(Hooked.log)

    def __repr__(self) -> str:
        return f"Hooked({self.n})"


class MakesItsOwn:  # makes an object of its own class: that constructor counts
    made: list[Any] = []

    def __init__(self, x: Any = 0) -> None:
        self.made.append(x)

    def __call__(self, x: Any) -> Any:
        type(self)(x)
        return len(self.made)


@functools.cache
def _cached_draw(i: int) -> float:
    return random.random()


class Tally(int):  # a subclass of a settings type, with state
    def bump(self) -> int:
        self.hits = getattr(self, "hits", 0) + 1
        return self.hits


class UsesTally:
    def __init__(self) -> None:
        self.t = Tally(3)

    def __call__(self, x: Any) -> Any:
        return self.t.bump()


class Draws:  # draws on an image it holds
    def __init__(self) -> None:
        self.image = Image.new("L", (4, 4))

    def __call__(self, x: Any) -> Any:
        value = self.image.getpixel((0, 0))
        ImageDraw.Draw(self.image).point((0, 0), fill=value + 1)  # type: ignore[operator]
        return value


class _Config(NamedTuple):
    p: float

    def draw(self) -> float:
        return float(_RNG.random())


_RNG = np.random.default_rng(0)


class Op:
    def __init__(self, rng: Any = None) -> None:
        self.rng = rng

    def __call__(self, x: Any) -> Any:
        return x if self.rng is None else float(self.rng.random())


class ManyOps:  # a long list of ops, the last one with a generator of its own
    def __init__(self) -> None:
        self.ops = [Op() for _ in range(70)] + [Op(np.random.default_rng(0))]

    def __call__(self, x: Any) -> Any:
        return self.ops[-1](x)


_WEIGHT = torch.nn.Linear(1, 1, bias=False)


def _moving_weight(x: Any) -> Any:
    with torch.no_grad():
        _WEIGHT.weight.add_(1)
    return float(_WEIGHT.weight.detach()[0, 0])


def _grows(x: Any, pipe: Any) -> Any:
    pipe.transforms.append(T.Lambda(lambda v: v + 1))
    return pipe(x)


_CALLS = [0]


@functools.wraps(TF.hflip)
def _my_hflip(x: Any) -> Any:  # its __module__ is torchvision's: its code is the user's
    _CALLS[0] += 1
    return _CALLS[0]


def _counted(x: Any) -> Any:
    _CALLS[0] += 1
    return _CALLS[0]


SHARED_LOG: list[Any] = []


class Logs:  # a constructor's attribute bound to a shared list, then filled
    def __init__(self, x: Any) -> None:
        self.log = SHARED_LOG
        self.log.append(x)
        self.n = len(self.log)

    def __repr__(self) -> str:
        return f"Logs({self.n})"


_IDS = itertools.count()


@dataclass
class Identified:  # a dataclass whose default factory draws from a global counter
    uid: int = field(default_factory=lambda: next(_IDS))


class Tagged:  # its __str__ runs in an f-string and counts
    def __init__(self) -> None:
        self.shown = 0

    def __str__(self) -> str:
        self.shown += 1
        return str(self.shown)


class UsesTag:
    def __init__(self) -> None:
        self.tag = Tagged()

    def __call__(self, x: Any) -> Any:
        return f"{x}-{self.tag}"


class CountsCalls:
    def __init__(self) -> None:
        self.n = 0

    def __call__(self, x: Any) -> Any:
        self.n += 1
        return self.n


class Rotates:  # functions of modules whose names are also methods that change their object
    def __init__(self) -> None:
        self.angle = 10.0

    def __call__(self, image: Any) -> Any:
        order = np.sort(np.array([3, 1, 2]))
        return TF.rotate(image, self.angle + float(np.add(order[0], 1)))


class DunderSet:  # operator's dunder functions change what they are given
    def __init__(self) -> None:
        self.d = {"n": 0}

    def __call__(self, x: Any) -> Any:
        operator.__setitem__(self.d, "n", self.d["n"] + 1)
        return self.d["n"]


class AliasedShuffle:  # an in-place function imported under another name
    def __init__(self) -> None:
        self.order = np.arange(10)

    def __call__(self, x: Any) -> Any:
        npshuffle(self.order)
        return tuple(self.order.tolist())


class Steps(list):  # a list subclass whose constructor gives it a generator
    def __init__(self) -> None:
        super().__init__([1])
        self.rng = random.Random(0)


@functools.singledispatch
def _dispatched(x: Any) -> Any:
    return x


@_dispatched.register(int)
def _(x: int) -> Any:
    _CALLS[0] += 1
    return _CALLS[0]


class Reinitialised:  # runs its constructor again on what is kept
    def __init__(self) -> None:
        self.epoch = getattr(self, "epoch", -1) + 1

    def __call__(self, x: Any) -> Any:
        self.__init__()  # type: ignore[misc]
        return self.epoch


def globals_counter(x: Any) -> Any:
    globals()["COUNT"] += 1
    return COUNT


def module_counter(x: Any) -> Any:
    sys.modules[__name__].COUNT += 1  # type: ignore[attr-defined]
    return COUNT


def environment(x: Any) -> Any:
    os.environ["FASTLOAD_TEST_STATE"] = str(int(os.environ.get("FASTLOAD_TEST_STATE", "0")) + 1)
    return os.environ["FASTLOAD_TEST_STATE"]


def own_attribute(x: Any) -> Any:
    own_attribute.calls = getattr(own_attribute, "calls", 0) + 1  # type: ignore[attr-defined]
    return own_attribute.calls  # type: ignore[attr-defined]


def _closure_over_a_library_op() -> Callable[[Any], Any]:
    op = T.RandomErasing(p=0.0)

    def grow(x: Any) -> Any:
        op.p = op.p + 1
        return op.p

    return grow


def _object_array_of_generators() -> Callable[[Any], Any]:
    rngs = np.array([np.random.default_rng(0)], dtype=object)
    return lambda x: float(rngs[0].random())


# -- the fourth review's cases ---------------------------------------------------------------
class Composites:  # alpha_composite onto a held background (a .copy() forgotten)
    def __init__(self) -> None:
        self.background = Image.new("RGBA", (2, 2), (0, 0, 0, 255))

    def __call__(self, x: Any) -> Any:
        self.background.alpha_composite(Image.new("RGBA", (2, 2), (255, 0, 0, 100)))
        return self.background.getpixel((0, 0))


class Floods:  # ImageDraw.floodfill on a held mask
    def __init__(self) -> None:
        self.mask = Image.new("L", (2, 2), 0)

    def __call__(self, x: Any) -> Any:
        ImageDraw.floodfill(self.mask, (0, 0), self.mask.getpixel((0, 0)) + 1)  # type: ignore[arg-type, operator]
        return self.mask.getpixel((0, 0))


class Transposes:  # exif_transpose told to work in place, on a held image
    def __init__(self) -> None:
        self.image = Image.new("L", (4, 2))
        exif = self.image.getexif()
        exif[0x0112] = 6  # rotated 90 degrees
        self.image.info["exif"] = exif.tobytes()

    def __call__(self, x: Any) -> Any:
        from PIL import ImageOps

        size = self.image.size
        ImageOps.exif_transpose(self.image, in_place=True)
        return size


class RandomConvolution:  # a module's weights reset in place after each use
    def __init__(self) -> None:
        self.conv = torch.nn.Conv2d(1, 1, 1)

    def __call__(self, x: Any) -> Any:
        with torch.no_grad():
            out = float(self.conv(torch.ones(1, 1, 1, 1)))
        self.conv.reset_parameters()
        return out


def _shuffles_by_partial(order: list[int]) -> Callable[[Any], Any]:
    shuffle = functools.partial(random.shuffle, order)
    return lambda x: shuffle() or tuple(order)


def _imports_a_registry(x: Any) -> Any:
    from fastload_test_registry import SEEN  # type: ignore[import-not-found]

    SEEN.append(x)
    return len(SEEN)


class LeakyInPlace:  # torch's inplace given by position, on a held tensor
    def __init__(self) -> None:
        self.data = -torch.ones(2)

    def __call__(self, x: Any) -> Any:
        return float(torch.nn.functional.leaky_relu(self.data, 0.5, True)[0])


class OutByKeywords:  # out= through a held dict of keyword arguments
    def __init__(self) -> None:
        self.buffer = np.zeros(1)
        self.keywords = {"out": self.buffer}

    def __call__(self, x: Any) -> Any:
        np.add(self.buffer, 1, **self.keywords)
        return float(self.buffer[0])


class PrivateSlot:  # a generator under a private (name-mangled) slot
    __slots__ = ("size", "__rng")

    def __init__(self) -> None:
        self.size = 1
        self.__rng = np.random.default_rng(0)

    def __call__(self, x: Any) -> Any:
        return float(self.__rng.random()) * self.size


class CountsCopies:
    copies = 0

    def __deepcopy__(self, memo: Any) -> Any:
        CountsCopies.copies += 1
        return CountsCopies()


class CopiesATemplate:  # copy.deepcopy runs the held object's __deepcopy__
    def __init__(self) -> None:
        self.template = CountsCopies()

    def __call__(self, x: Any) -> Any:
        import copy

        copy.deepcopy(self.template)
        return CountsCopies.copies


class InitByName:  # the constructor run again through getattr
    def __init__(self) -> None:
        self.calls = getattr(self, "calls", 0) + 1

    def __call__(self, x: Any) -> Any:
        getattr(self, "__init__")()  # noqa: B009
        return self.calls


class DunderGenerator:  # a generator kept under a dunder-style class attribute
    __rng__ = np.random.default_rng(0)

    def __call__(self, x: Any) -> Any:
        return float(self.__rng__.random())


STATEFUL: dict[str, Callable[[], Any]] = {
    "an in-place operator on an alias": Alias,
    "a torch in-place method": TorchInPlace,
    "numpy's out=": NumpyOut,
    "ndarray.fill": Fill,
    "random.shuffle of a held list": Shuffles,
    "heapq.heappush": Heap,
    "bisect.insort": Insort,
    "operator.setitem": SetItem,
    "a method called by name": ByName,
    "a bound append kept": HeldAppend,
    "OrderedDict.move_to_end": OrderedMove,
    "a Counter subclass": lambda: (lambda c: lambda x: c.update([x]) or sum(c.values()))(Counts()),
    "a held iterator": Reads,
    "a held BytesIO": Writes,
    "a dict's keys": ByKey,
    "a long list of records": Records,
    "a class as the callable": lambda: MadeCounts,
    "a metaclass's __call__": lambda: ByMeta,
    "a Lambda of a class": lambda: T.Lambda(MadeCounts),
    "globals()": lambda: globals_counter,
    "sys.modules": lambda: module_counter,
    "os.environ": lambda: environment,
    "a function's own attribute": lambda: own_attribute,
    "a library op changed through a closure": _closure_over_a_library_op,
    "a SobolEngine": lambda: torch.quasirandom.SobolEngine(1).draw,
    "an object array of generators": _object_array_of_generators,
    "a defaultdict read": lambda: (lambda d: lambda x: len(d[x + len(d)]) or len(d))(
        collections.defaultdict(list)
    ),
    "self.seen or []": OrAlias,
    "an in-place operator on a method's result": GotInPlace,
    "numpy's ufunc.at": UFuncAt,
    "ndarray.partition": Partition,
    "a constructor writing under a computed key": lambda: Registers,
    "a __setattr__ keeping what it is given": lambda: Hooked,
    "type(self)(x)": MakesItsOwn,
    "an lru_cache of random draws": lambda: (
        lambda x: _cached_draw(_cached_draw.cache_info().currsize) and _cached_draw.cache_info().currsize
    ),
    "a subclass of int with state": UsesTally,
    "ImageDraw on a held image": Draws,
    "a NamedTuple's method": lambda: (lambda c: lambda x: c.draw())(_Config(0.5)),
    "a long list of ops of one type": ManyOps,
    "a library module's parameter changed": lambda: _moving_weight,
    "a library Compose appended to": lambda: functools.partial(_grows, pipe=T.Compose([])),
    "functools.wraps of a torchvision function": lambda: _my_hflip,
    "a torch.no_grad wrapper": lambda: torch.no_grad()(_counted),
    "a constructor's attribute bound to shared state": lambda: Logs,
    "a dataclass's default factory": lambda: lambda x: Identified(),
    "a __str__ that counts": UsesTag,
    "a torch.no_grad wrapper of an object": lambda: torch.no_grad()(CountsCalls()),
    "a long dict of tuples holding generators": lambda: (lambda d: lambda x: float(d["k69"][1].random()))(
        {f"k{i}": (i, np.random.default_rng(i)) for i in range(70)}
    ),
    "operator.__setitem__": DunderSet,
    "numpy's shuffle imported under another name": AliasedShuffle,
    "a list subclass holding a generator": lambda: (lambda steps: lambda x: steps.rng.random())(Steps()),
    "a singledispatch function's registered implementation": lambda: _dispatched,
    "a long tuple with an object at its end": lambda: (lambda ops: lambda x: ops[-1](x))(
        tuple([0] * 5000 + [CountsCalls()])
    ),
    "a constructor run again": Reinitialised,
    "alpha_composite onto a held image": Composites,
    "ImageDraw.floodfill of a held mask": Floods,
    "exif_transpose(in_place=True) of a held image": Transposes,
    "a held module's parameters reset": RandomConvolution,
    "a list imported inside the function": lambda: _imports_a_registry,
    "random.shuffle kept as a partial of a held list": lambda: (
        lambda order: (lambda shuffle: lambda x: shuffle() or tuple(order))(
            functools.partial(random.shuffle, order)
        )
    )(list(range(6))),
    "torch's inplace given by position": LeakyInPlace,
    "out= in a held dict of keywords": OutByKeywords,
    "a generator in a private slot": PrivateSlot,
    "copy.deepcopy of an object with its own __deepcopy__": CopiesATemplate,
    "getattr(self, '__init__')()": InitByName,
    "a generator as a dunder-named class attribute": DunderGenerator,
    "an iterator of a DataLoader": lambda: (lambda it: lambda x: int(next(it)))(
        iter(torch.utils.data.DataLoader(list(range(10))))  # type: ignore[arg-type]
    ),
}


@pytest.mark.parametrize("name", list(STATEFUL))
def test_code_that_keeps_state_is_not_taken_as_stateless(name: str) -> None:
    fn = STATEFUL[name]()
    outputs = [fn(1) for _ in range(3)]
    assert len({repr(o) for o in outputs}) > 1, f"{name}: the case keeps no state ({outputs})"
    assert not stateless_callable(STATEFUL[name]())


class Preset:  # torchvision's reference presets
    def __init__(self, size: int) -> None:
        self.transforms = T.Compose([T.RandomResizedCrop(size), T.PILToTensor()])

    def __call__(self, image: Any) -> Any:
        return self.transforms(image)


class Settings:  # settings of the kinds datasets and transforms hold
    def __init__(self) -> None:
        self.root = pathlib.Path("/data")
        self.dtype, self.device = torch.float32, torch.device("cpu")
        self.scale, self.pattern = np.float32(0.5), re.compile(r"(\d+)\.jpg")
        self.log = logging.getLogger("fastload.tests")

    def __call__(self, x: Any) -> Any:
        self.log.debug("called")
        return torch.as_tensor(x, dtype=self.dtype, device=self.device) * float(self.scale)


class Slots:
    __slots__ = ("size",)

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, x: Any) -> Any:
        return x * self.size


def collate_dicts(batch: list[Any]) -> Any:  # a collate building its own containers
    out: dict[str, list[Any]] = {}
    images = []
    for image, label in batch:
        images.append(image)
        out.setdefault("labels", []).append(label)
    out["images"] = images
    return out


@dataclass(frozen=True)
class Scale:
    factor: float

    @classmethod
    def default(cls, x: Any) -> Any:
        return cls(2.0)(x)

    def __call__(self, x: Any) -> Any:
        return x * self.factor


class Samples(Dataset[Any]):  # a dataset of the user's: a table, a path, a dict per sample
    def __init__(self) -> None:
        self.root = pathlib.Path("/data")
        self.samples = self._scan()
        self.transform = Preset(8)

    def _scan(self) -> list[tuple[str, int]]:
        found = []
        for i in range(200):
            found.append((f"{i}.jpg", i % 10))
        return found

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> Any:
        path, label = self.samples[i]
        sample: dict[str, Any] = {"path": str(self.root / path)}
        sample["label"] = label
        return sample


class Appends(Dataset[Any]):
    def __init__(self) -> None:
        self.seen: list[int] = []

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> Any:
        self.seen.append(i)
        return len(self.seen)


class InMemory(Dataset[Any]):  # images held as one tensor; the transform given a view of it
    def __init__(self, transform: Any) -> None:
        self.data = torch.full((4, 3, 2, 2), 3.0)
        self.transform = transform

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> Any:
        return self.transform(self.data[i])


class Scanned(Dataset[Any]):  # a constructor filling its own list
    def __init__(self) -> None:
        self.samples: list[tuple[str, int]] = []
        for i in range(10):
            self.samples.append((f"{i}.jpg", i))

    def __len__(self) -> int:
        return len(self.samples)

    @torch.no_grad()
    def __getitem__(self, i: int) -> Any:
        total = 0
        for _, label in self.samples[: i + 1]:
            total += label
        return total


def test_code_that_keeps_no_state_is_known() -> None:
    known = [Preset(8), Settings(), Slots(2), collate_dicts, Scale(2.0), Scale.default, Scale, Rotates()]
    assert [stateless_callable(fn) for fn in known] == [True] * len(known)
    assert stateless_in_workers(Samples())
    assert stateless_in_workers(Scanned())
    table = Scanned()  # a long table: numpy labels, arrays held per sample
    table.samples = [(f"{i}.jpg", np.int64(i % 1000)) for i in range(200_000)]
    table.images = [np.zeros(2, np.uint8) for _ in range(5000)]  # type: ignore[attr-defined]
    assert stateless_in_workers(table)
    table.images[-1] = Op()  # type: ignore[attr-defined]  # (an object among them: unknown)
    assert not stateless_in_workers(table)


def test_datasets_that_change_what_they_hold_are_not_taken_as_stateless() -> None:
    nested = Subset(Subset(Subset(Subset(Appends(), range(10)), range(10)), range(10)), range(10))
    stack = getattr(torch.utils.data, "StackDataset", None)  # (torch 2.2+)
    cases = [
        *([stack(Appends()), stack(a=Appends())] if stack is not None else []),
        nested,
        InMemory(T.Normalize([0.5] * 3, [0.5] * 3, inplace=True)),
        InMemory(lambda x: x.mul_(0.5)),
    ]
    for dataset in cases:
        first = repr(dataset[0])
        assert repr(dataset[0]) != first  # it keeps state
        assert not stateless_in_workers(dataset)
    assert stateless_in_workers(InMemory(T.Normalize([0.5] * 3, [0.5] * 3)))


class Odd:
    __module__ = None  # type: ignore[assignment]

    def __call__(self, x: Any) -> Any:
        return x


class NoSuper(torch.nn.Module):
    def __init__(self) -> None:  # never calls Module.__init__
        pass


class Refuses:
    def __getattribute__(self, name: str) -> Any:
        if name == "__dict__":
            raise RuntimeError("no attributes here")
        return object.__getattribute__(self, name)


def test_objects_that_cannot_be_looked_at_are_unknown_not_an_error() -> None:
    assert stateless_callable(Odd())  # a class without a module name is read like any other
    assert not stateless_callable(NoSuper())
    assert not stateless_callable(Refuses())


def test_a_huge_table_is_judged_by_its_types_and_too_many_objects_are_unknown() -> None:
    """What is looked at is bounded: a table of a million settings is judged by their types, and
    thousands of objects (each of which may keep state) are not looked at one by one."""
    table = tuple(tuple(range(1000)) for _ in range(1000))
    objects = tuple(Op() for _ in range(5000))
    assert stateless_callable(lambda x: table[x][x])
    assert not stateless_callable(lambda x: objects[x](x))


class CachedDraws(Dataset[Any]):  # a sample cache on __getitem__: the first pass's draws for ever
    def __len__(self) -> int:
        return 4

    @functools.cache  # noqa: B019
    def __getitem__(self, i: int) -> Any:
        return random.random()


class Memo:  # a memoising decorator of the user's
    def __init__(self, method: Any) -> None:
        self.method, self.seen = method, {}

    def __get__(self, obj: Any, kind: Any) -> Any:
        return functools.partial(self, obj)

    def __call__(self, obj: Any, x: Any) -> Any:
        if x not in self.seen:
            self.seen[x] = self.method(obj, x)
        return self.seen[x]


class Memoised:
    @Memo
    def __call__(self, x: Any) -> Any:
        return random.random()


def test_caches_and_pils_own_random_draws_are_state() -> None:
    """A kept cache answers the first pass's draws where new workers draw again; PIL's effects
    draw from C's rand(), which reseeding random, numpy and torch (as each worker is) does not reset."""
    cached, memoised = CachedDraws(), Memoised()
    for call in (lambda: cached[0], lambda: memoised(0)):
        random.seed(0)
        first = call()
        random.seed(1)
        assert call() == first  # another seed, the same draw: the cache answered
        random.seed(1)
        assert random.random() != first  # (what a new worker seeded so draws)
    assert not stateless_in_workers(cached) and not stateless_callable(memoised)
    image = Image.new("L", (16, 16))
    image.paste(255, (0, 0, 8, 16))
    spread = T.Lambda(lambda im: np.asarray(im.effect_spread(3)).tobytes())
    draws = []
    for _ in range(2):
        random.seed(0)
        np.random.seed(0)
        torch.manual_seed(0)
        draws.append(spread(image))
    assert draws[0] != draws[1]  # the same seeds, other pixels: C's rand() moved on
    assert not stateless_callable(spread)


class Records(Dataset[Any]):  # annotation records held, returned as they are held
    def __init__(self) -> None:
        self.records = [{"x": torch.full((2,), float(i + 1)), "name": f"{i}.jpg"} for i in range(8)]

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> Any:
        return self.records[i]


def pops_names(batch: list[Any]) -> Any:  # changes the dataset's own dicts
    names = [sample.pop("name", None) for sample in batch]
    return torch.stack([sample["x"] for sample in batch]), names


def scales(batch: list[Any]) -> Any:  # changes the dataset's own tensors
    for sample in batch:
        sample["x"].mul_(2)
    return torch.stack([sample["x"] for sample in batch])


def sorts(batch: list[Any]) -> Any:  # reorders the batch list itself (made anew per batch)
    batch.sort(key=lambda sample: sample["name"], reverse=True)
    return torch.stack([sample["x"] for sample in batch])


def test_a_collate_fn_changing_the_samples_a_dataset_holds_is_state() -> None:
    """A collate_fn is given the dataset's own objects where the dataset returns what it holds:
    changing them changes the worker's copy of the dataset (torch's new workers start from the
    main process's copy each pass). Reordering the batch list is not state; with a folder
    dataset (each sample decoded anew) changing the samples is not either."""
    for collate in (pops_names, scales):
        dataset = Records()
        first = repr(collate([dataset[0]]))
        assert repr(collate([dataset[0]])) != first  # it changes what the dataset holds
        assert stateless_in_workers(Records()) and stateless_callable(collate)  # each alone: nothing kept
        assert not stateless_collate(collate, Records())
        loader = fastload.DataLoader(Records(), batch_size=2, num_workers=2, collate_fn=collate)
        assert not loader.persistent_workers
    assert stateless_collate(sorts, Records())
    assert fastload.DataLoader(Records(), batch_size=2, num_workers=2, collate_fn=sorts).persistent_workers
    folder = torchvision_folder()
    assert stateless_collate(scales_images, folder)


def scales_images(batch: list[Any]) -> Any:
    for image, _ in batch:
        image.mul_(2)
    return batch


def torchvision_folder() -> Any:
    import torchvision

    class Empty(torchvision.datasets.DatasetFolder):  # type: ignore[misc]
        def __init__(self) -> None:  # a folder's class and attributes, without files
            self.samples, self.targets, self.classes = [], [], []
            self.loader, self.transform, self.target_transform = (
                torchvision.datasets.folder.default_loader,
                None,
                None,
            )

    return Empty()


def reads_worker_info(batch: list[Any]) -> Any:  # changes the worker's dataset through torch's info
    info = torch.utils.data.get_worker_info()
    if info is not None:
        info.dataset.served += len(batch)
    return batch


def test_a_collate_fn_reaching_the_worker_info_is_unknown() -> None:
    assert not stateless_callable(reads_worker_info)


class Fields(Dataset[Any]):  # attributes read from a table of fields (KeyError for others)
    def __init__(self) -> None:
        self.__dict__["fields"] = {"n": 6}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return self.fields[name]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return i


@pytest.mark.parametrize("num_workers", [0, 2, "auto"])
def test_a_dataset_whose_getattr_raises_another_error_loads_as_with_torch(num_workers: Any) -> None:
    """torch's loader never asks a dataset for ``transform``: a ``__getattr__`` raising KeyError for
    a name it lacks must not stop fastload's loader from being made or iterated."""
    want = [b.tolist() for b in torch.utils.data.DataLoader(Fields(), batch_size=4)]
    loader = fastload.DataLoader(Fields(), batch_size=4, num_workers=num_workers)
    assert [b.tolist() for b in loader] == want
    shuffled = fastload.DataLoader(Fields(), batch_size=4, num_workers=num_workers, shuffle=True)
    assert sorted(x for b in shuffled for x in b.tolist()) == list(range(6))
