"""The views fastload serves over a torchvision ``DatasetFolder`` (``ImageFolder``) or a timm
``ImageDataset`` over a folder, and the checks that it reads the images as the dataset does.

:func:`sample_index`: ``dataset.samples`` as a :class:`~fastload.folder.FolderIndex` of numpy
arrays; :func:`folder_source`: the dataset the fast path and head acceleration read encoded bytes
from; :func:`worker_view`: what torch's workers serve instead, running ``DatasetFolder.__getitem__``
as written. :class:`NotReproducible`: why a dataset or pipeline cannot be accelerated.
"""

from __future__ import annotations

import copy
import os
import sys
from typing import Any

import numpy as np

from .folder import ClassIndex, FolderIndex
from .imagefolder import EncodedImageDataset, ImageFolder

__all__ = ["NotReproducible", "folder_source", "is_image_folder", "sample_index", "worker_view"]


class NotReproducible(Exception):
    """Why a pipeline (or dataset) cannot be accelerated (the message is the reason)."""


def _torchvision_folder(dataset: Any) -> bool:
    module = sys.modules.get("torchvision.datasets.folder")
    return module is not None and isinstance(dataset, module.DatasetFolder)


def _exact_folder_class(dataset: Any) -> None:
    """Raises unless ``type(dataset)`` keeps ``DatasetFolder.__getitem__`` and ``__len__``."""
    module = sys.modules["torchvision.datasets.folder"]
    cls, folder = type(dataset), module.DatasetFolder
    if cls.__getitem__ is not folder.__getitem__ or cls.__len__ is not folder.__len__:
        raise NotReproducible(f"{cls.__name__} overrides __getitem__ or __len__")


def _timm_folder(dataset: Any) -> bool:
    """Whether ``dataset`` is a timm ``ImageDataset`` (a subclass keeping its ``__getitem__``/``__len__``)."""
    module = sys.modules.get("timm.data.dataset")
    cls = type(dataset)
    base = getattr(module, "ImageDataset", None)
    return (
        base is not None
        and isinstance(dataset, base)
        and cls.__getitem__ is base.__getitem__
        and cls.__len__ is base.__len__
    )


def _timm_samples(dataset: Any) -> tuple[Any, Any, list[str]]:
    """A timm ``ImageDataset``'s ``(samples, root, classes)`` as its folder reader assigned them.

    Raises:
        NotReproducible: Unless it reads RGB images from a ``ReaderImageFolder`` with no extra
            features, and its ``class_to_idx`` numbers its classes 0 to n-1.
    """
    reader = dataset.reader
    reader_module = sys.modules.get("timm.data.readers.reader_image_folder")
    if type(reader) is not getattr(reader_module, "ReaderImageFolder", None):
        raise NotReproducible(f"its reader is {type(reader).__name__}, not timm's ReaderImageFolder")
    if dataset.load_bytes or dataset.input_img_mode != "RGB" or dataset.additional_features:
        raise NotReproducible("it loads bytes, a mode other than RGB or additional features")
    names = {index: name for name, index in reader.class_to_idx.items()}
    if sorted(names) != list(range(len(reader.class_to_idx))):
        raise NotReproducible("its class_to_idx does not number its classes 0 to n-1")
    return reader.samples, reader.root, [str(names[i]) for i in range(len(names))]


def _torchvision_loader(dataset: Any) -> Any:
    """The dataset's ``loader`` if it is torchvision's own (``default_loader``/``pil_loader``)."""
    module = sys.modules["torchvision.datasets.folder"]
    loader = getattr(dataset, "loader", None)
    if loader is not module.default_loader and loader is not module.pil_loader:
        raise NotReproducible(
            "the dataset has a custom loader (fastload decodes with torchvision's PIL loader)"
        )
    return loader


_CHUNK = 1 << 16  # samples encoded at a time: the peak stays a few MB above the result


def sample_index(dataset: Any) -> FolderIndex:
    """The samples of a torchvision ``DatasetFolder`` (timm ``ImageDataset``: its reader's) as a
    :class:`FolderIndex` (numpy arrays), with ``index.paths[i] == samples[i][0]`` (stored relative to
    the root where every path is under it); ``NotReproducible`` unless each sample is a ``(str,
    int)`` pair whose target indexes the classes (distinct names)."""
    if _timm_folder(dataset):
        samples, root, classes = _timm_samples(dataset)
    else:
        samples, root = dataset.samples, getattr(dataset, "root", None)
        classes = list(getattr(dataset, "classes", []))
    n = len(samples)
    prefix = ""
    if isinstance(root, (str, os.PathLike)) and os.fspath(root):
        prefix = os.path.join(os.path.expanduser(os.fspath(root)), "")
    index = _encode_samples(samples, n, prefix)
    if index is None:  # a path outside root: store whole paths
        prefix = ""
        index = _encode_samples(samples, n, prefix)
    assert index is not None  # an empty prefix always fits
    buf, offsets, targets = index
    if n and (targets.min() < 0 or targets.max() >= len(classes)):
        raise NotReproducible("its targets are not indices into dataset.classes")
    try:
        class_index = ClassIndex(classes)
    except ValueError as e:
        raise NotReproducible(f"its classes are not a list of distinct names ({e})") from None
    return FolderIndex.from_buffers(prefix, buf, offsets, targets, class_index)  # join(prefix, rel) == path


def _encode_samples(samples: Any, n: int, prefix: str) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """UTF-8 relative paths back to back, their offsets and the targets; ``None`` if a path is not
    under ``prefix``."""
    cut = len(prefix)
    offsets = np.zeros(n + 1, dtype=np.int64)
    targets = np.empty(n, dtype=np.int64)
    parts: list[bytes] = []
    total = 0
    for start in range(0, n, _CHUNK):
        rels: list[str] = []
        for i in range(start, min(n, start + _CHUNK)):
            entry = samples[i]
            if not (isinstance(entry, tuple) and len(entry) == 2):
                raise NotReproducible(f"dataset.samples[{i}] is not a (path, target) pair")
            path, target = entry
            if type(path) is not str or type(target) is not int:
                raise NotReproducible(
                    f"dataset.samples[{i}] is not a (str, int) pair: "
                    f"({type(path).__name__}, {type(target).__name__})"
                )
            if cut:
                if not path.startswith(prefix) or path.startswith(os.sep, cut):
                    return None
                path = path[cut:]
            rels.append(path)
            targets[i] = target
        joined = "".join(rels)  # encoded by code point: the whole is the pieces back to back
        blob = joined.encode("utf-8", "surrogateescape")
        pieces = rels if joined.isascii() else [r.encode("utf-8", "surrogateescape") for r in rels]
        np.cumsum([len(p) for p in pieces], out=offsets[start + 1 : start + 1 + len(rels)])
        offsets[start + 1 : start + 1 + len(rels)] += total
        total += len(blob)
        parts.append(blob)
    return np.frombuffer(b"".join(parts), dtype=np.uint8), offsets, targets


def is_image_folder(dataset: Any) -> bool:
    """Whether ``dataset`` is one fastload reads: a fastload ``ImageFolder``/``InMemoryImageFolder``,
    a torchvision ``DatasetFolder`` (``ImageFolder``), subclasses included, or a timm ``ImageDataset``."""
    return isinstance(dataset, EncodedImageDataset) or _torchvision_folder(dataset) or _timm_folder(dataset)


def folder_source(dataset: Any) -> EncodedImageDataset:
    """A fastload dataset with ``dataset``'s samples that serves their encoded bytes: a shallow
    copy of a fastload dataset, or an ``ImageFolder`` over a ``DatasetFolder``'s :func:`sample_index`;
    ``NotReproducible`` where fastload cannot read the images as ``dataset`` does (a custom
    ``loader``, joint ``transforms``, an own ``__getitem__``/``__len__``, a backend other than PIL)."""
    if isinstance(dataset, EncodedImageDataset):
        if getattr(dataset, "loader", None) is not None:
            raise NotReproducible("the dataset has a custom loader")
        return copy.copy(dataset)
    if _timm_folder(dataset):
        index = sample_index(dataset)
        view = ImageFolder(
            None, transform=dataset.transform, target_transform=dataset.target_transform, index=index
        )
        view.root = dataset.reader.root
        return view
    if getattr(dataset, "transforms", None) is not None:
        standard = getattr(sys.modules.get("torchvision.datasets.vision"), "StandardTransform", None)
        if standard is None or not isinstance(dataset.transforms, standard):
            raise NotReproducible("the dataset has a joint transforms callable")
    _exact_folder_class(dataset)
    loader = _torchvision_loader(dataset)
    if loader is sys.modules["torchvision.datasets.folder"].default_loader:
        from torchvision import get_image_backend

        if get_image_backend() != "PIL":
            raise NotReproducible("torchvision's image backend is not PIL")
    view = ImageFolder(
        None,
        transform=getattr(dataset, "transform", None),
        target_transform=getattr(dataset, "target_transform", None),
        index=sample_index(dataset),
    )
    view.root = getattr(dataset, "root", None)
    return view


def worker_view(dataset: Any) -> tuple[ImageFolder | None, str | None]:
    """What torch's workers serve instead of a torchvision ``DatasetFolder`` they would copy page by
    page: ``(view, None)`` (a :class:`fastload.ImageFolder` over :func:`sample_index` with the
    dataset's own ``loader`` and transforms, so ``view[i]`` runs ``DatasetFolder.__getitem__``
    exactly), or ``(None, reason)`` to keep the user's dataset."""
    if not _torchvision_folder(dataset):
        return None, f"{type(dataset).__name__} is not a torchvision DatasetFolder"
    try:
        _exact_folder_class(dataset)
        loader = _torchvision_loader(dataset)
        transform = getattr(dataset, "transform", None)
        target_transform = getattr(dataset, "target_transform", None)
        for name, fn in (("transform", transform), ("target_transform", target_transform)):
            if getattr(fn, "__self__", None) is dataset:
                raise NotReproducible(f"its {name} is a method of the dataset")
        index = sample_index(dataset)
    except NotReproducible as e:
        return None, str(e)
    view = ImageFolder(
        None, transform=transform, target_transform=target_transform, index=index, loader=loader
    )
    view.root = getattr(dataset, "root", None)
    return view, None
