"""fastload: fast, deterministic, distributed-exact data loading for PyTorch image training.

Importing fastload never touches CUDA or optional dependencies (DALI, matplotlib).
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__version__ = "0.1.0.dev0"

from .folder import ClassIndex, FolderIndex, scan_folder, scan_list
from .imagefolder import ImageFolder
from .stats import LoaderStats

_LAZY = {
    "transforms": ("fastload.transforms", None),
    "gpu": ("fastload.gpu", None),
    "rng": ("fastload.rng", None),
    "synthetic": ("fastload.synthetic", None),
    "distributed": ("fastload.distributed", None),
    "device": ("fastload.device", None),
    "DataLoader": ("fastload.loader", "DataLoader"),
    "DistributedSampler": ("fastload.sampler", "DistributedSampler"),
    "shard_indices": ("fastload.sampler", "shard_indices"),
    "DecodeError": ("fastload.decode", "DecodeError"),
    "ResumeError": ("fastload._epoch", "ResumeError"),
    "InMemoryImageFolder": ("fastload.memory", "InMemoryImageFolder"),
    "write_pack": ("fastload.pack", "write_pack"),
    "open_pack": ("fastload.pack", "open_pack"),
    "PackFile": ("fastload.pack", "PackFile"),
    "PackError": ("fastload.pack", "PackError"),
    "CorruptSampleError": ("fastload.pack", "CorruptSampleError"),
    "TarShards": ("fastload.shards", "TarShards"),
    "write_shards": ("fastload.shardwrite", "write_shards"),
    "CUDAPrefetcher": ("fastload.gpu.prefetch", "CUDAPrefetcher"),
    "DALILoader": ("fastload.dali", "DALILoader"),
    "IndexedBatch": ("fastload.batch", "IndexedBatch"),
    "default_device": ("fastload.device", "default_device"),
    "device_is_cuda": ("fastload.device", "device_is_cuda"),
}

__all__ = [
    "ClassIndex",
    "FolderIndex",
    "ImageFolder",
    "LoaderStats",
    "scan_folder",
    "scan_list",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    try:
        module_name, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'fastload' has no attribute {name!r}") from None
    module = import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
