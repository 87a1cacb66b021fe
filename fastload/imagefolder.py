"""The ``ImageFolder`` datasets: torchvision's ``ImageFolder`` over a :class:`~fastload.folder.FolderIndex`.

A dataset over a :class:`~fastload.folder.FolderIndex` hands the loader each sample's encoded bytes
(:meth:`EncodedImageDataset.get_bytes`), which its workers decode, fused with a
:mod:`fastload.transforms` pipeline, straight into the batch buffer. Both datasets share
:class:`EncodedImageDataset`: :class:`ImageFolder` reads each file from disk when it is needed,
:class:`~fastload.memory.InMemoryImageFolder` holds every file in one RAM buffer.

Example:
    >>> from fastload import ClassIndex, ImageFolder, transforms as T
    >>> classes = ClassIndex.from_folder("imagenet/train")                      # doctest: +SKIP
    >>> val_tf = T.Compose([T.Resize(256), T.CenterCrop(224)])
    >>> val = ImageFolder("imagenet/val", val_tf, classes=classes)                # doctest: +SKIP
    >>> image, target = val[0]      # a uint8 (3, 224, 224) tensor and an int   # doctest: +SKIP
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any, overload

import numpy as np

from ._checks import sample_index
from ._stream import fetch
from .decode import load_sample
from .folder import IMG_EXTENSIONS, ClassIndex, FolderIndex, scan_folder

__all__ = ["EncodedImageDataset", "ImageFolder"]


class _SampleList(Sequence[tuple[str, int]]):
    """``dataset.samples`` as a lazy sequence of ``(path, target)`` tuples (no per-sample objects kept)."""

    def __init__(self, index: FolderIndex) -> None:
        self._index = index

    @overload
    def __getitem__(self, i: int) -> tuple[str, int]: ...

    @overload
    def __getitem__(self, i: slice) -> list[tuple[str, int]]: ...

    def __getitem__(self, i: int | slice) -> tuple[str, int] | list[tuple[str, int]]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self._index.paths[i], int(self._index.targets[i])

    def __len__(self) -> int:
        return len(self._index)


def _check_callable(value: Any, name: str) -> None:
    if value is not None and not callable(value):
        raise TypeError(f"{name} should be callable, but got {type(value).__name__}")


class EncodedImageDataset:
    """What :class:`ImageFolder` and :class:`~fastload.memory.InMemoryImageFolder` share: torchvision's
    ``ImageFolder`` attributes (``targets`` an int64 array, ``samples`` lazy) over a
    :class:`~fastload.folder.FolderIndex`, plus ``index`` and ``class_index``.

    ``dataset[i]`` is ``(transform(image), target_transform(target))``: a PIL RGB image, or a uint8
    tensor where ``transform`` is a fastload transform (decoding fused with it). A subclass provides
    :attr:`index` and :meth:`get_bytes`.
    """

    def __init__(
        self,
        root: str | None,
        transform: Callable[..., Any] | None = None,
        target_transform: Callable[[int], Any] | None = None,
    ) -> None:
        self.check_transforms(transform, target_transform)
        self.root = root
        self.transform = transform
        self.target_transform = target_transform

    @staticmethod
    def check_transforms(transform: Any, target_transform: Any) -> None:
        """``TypeError`` unless both are callable or ``None`` (for checks before any costly work)."""
        _check_callable(transform, "transform")
        _check_callable(target_transform, "target_transform")

    @property
    def index(self) -> FolderIndex:
        """The samples: paths, int64 targets and the shared :class:`~fastload.folder.ClassIndex`."""
        raise NotImplementedError

    def get_bytes(self, i: int) -> bytes | memoryview:
        """The encoded file of sample ``i``."""
        raise NotImplementedError

    def describe(self, i: int) -> str:
        """How errors name sample ``i``: its index and path."""
        return f"sample {i} ({self.index.paths[i]!r})"

    @property
    def class_index(self) -> ClassIndex:
        return self.index.classes

    @property
    def classes(self) -> list[str]:
        return self.index.classes.classes

    @property
    def class_to_idx(self) -> dict[str, int]:
        return self.index.classes.class_to_idx

    @property
    def targets(self) -> np.ndarray:
        """The labels, int64."""
        return self.index.targets

    @property
    def samples(self) -> Sequence[tuple[str, int]]:
        """``(path, target)`` pairs, as ``ImageFolder.samples`` (a lazy sequence)."""
        return _SampleList(self.index)

    @property
    def imgs(self) -> Sequence[tuple[str, int]]:
        """The same as :attr:`samples` (torchvision's alias)."""
        return self.samples

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> tuple[Any, Any]:
        i = sample_index(i)  # a float is an error, as a list's (torchvision's ImageFolder.samples)
        target: Any = int(self.targets[i])
        image = load_sample(self.get_bytes(i), self.transform, self.describe(i))
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """``[self[i] for i in indices]`` (what torch's fetcher calls for a batch); in the workers
        ``fastload.DataLoader`` starts, each image goes into its row of one batch tensor as it is
        made (:mod:`fastload._stream`)."""
        return fetch(self, indices)

    def extra_repr(self) -> str:
        """Lines added to ``repr`` after the root (torchvision's ``VisionDataset.extra_repr``)."""
        return f"Classes: {len(self.index.classes)}"

    def __repr__(self) -> str:
        lines = [
            f"{type(self).__name__}",
            f"    Number of datapoints: {len(self)}",
            f"    Root location: {getattr(self, 'root', None)}",
        ]
        lines += [f"    {line}" for line in self.extra_repr().splitlines()]
        if self.transform is not None:
            lines.append(f"    Transform: {self.transform!r}")
        return "\n".join(lines)


class ImageFolder(EncodedImageDataset):
    """Drop-in for ``torchvision.datasets.ImageFolder`` whose labels follow a shared class list
    (attributes and items: :class:`EncodedImageDataset`; a file that cannot be decoded raises
    :class:`fastload.decode.DecodeError` naming it).

    Args:
        classes: The canonical class list (see :func:`~fastload.folder.scan_folder`); ``None`` uses
            ``root``'s folders.
        loader: ``loader(path) -> image`` replacing the built-in decoder (must be picklable for
            spawn workers: a module-level function, not a lambda).
        strict, allow_empty: See :func:`~fastload.folder.scan_folder`.
        index: A ready :class:`~fastload.folder.FolderIndex` (then ``root``, ``classes``,
            ``extensions`` are not used for scanning; ``root`` may be ``None``).
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None,
        transform: Callable[..., Any] | None = None,
        target_transform: Callable[[int], Any] | None = None,
        classes: ClassIndex | Sequence[str] | str | os.PathLike[str] | None = None,
        loader: Callable[[str], Any] | None = None,
        extensions: str | Iterable[str] = IMG_EXTENSIONS,
        strict: bool = True,
        index: FolderIndex | None = None,
        allow_empty: bool = False,
    ) -> None:
        self.check_transforms(transform, target_transform)
        _check_callable(loader, "loader")
        if index is None:
            if root is None:
                raise ValueError("ImageFolder needs root (a folder to scan) or index (a FolderIndex)")
            index = scan_folder(
                root, classes=classes, extensions=extensions, strict=strict, allow_empty=allow_empty
            )
        elif not isinstance(index, FolderIndex):
            raise TypeError(f"index should be a FolderIndex, but got {type(index).__name__}")
        super().__init__(index.root, transform, target_transform)
        self._index = index
        self.loader = loader

    @property
    def index(self) -> FolderIndex:
        """The :class:`~fastload.folder.FolderIndex` scanned (or passed)."""
        return self._index

    @property
    def skipped(self) -> dict[str, int]:
        """What the scan left out, by reason (see :attr:`fastload.folder.FolderIndex.skipped`), e.g.
        ``{"hidden_files": 2, "hidden_dirs": 0, "repeated_dirs": 0, "other_files": 1}``."""
        return self._index.skipped

    def get_bytes(self, i: int) -> bytes:
        """The encoded file of sample ``i``."""
        return self.index.read_bytes(i)

    def __getitem__(self, i: int) -> tuple[Any, Any]:
        if self.loader is None:
            return super().__getitem__(i)
        target: Any = int(self.index.targets[i])
        image = self.loader(self.index.paths[i])
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target
