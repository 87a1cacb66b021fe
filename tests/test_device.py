"""fastload.device: the one CPU count, the one local world size, auto workers, CUDA detection."""

from __future__ import annotations

import os

import pytest
import torch

from fastload import device, distributed
from fastload.gpu.streams import stream_backend

_VARS = ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "WORLD_SIZE", "RANK", "LOCAL_RANK")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in _VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_available_cpus_is_the_affinity_mask() -> None:
    assert device.available_cpus() == len(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, 1),  # a single process
        ({"WORLD_SIZE": "8", "RANK": "3"}, 8),  # only the world size: taken as one machine
        ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "RANK": "9", "LOCAL_RANK": "1"}, 8),  # torchrun
        ({"WORLD_SIZE": "16", "SLURM_NTASKS_PER_NODE": "4"}, 4),  # Slurm
    ],
)
def test_local_world_size_one_answer(
    clean_env: pytest.MonkeyPatch, env: dict[str, str], expected: int
) -> None:
    for name, value in env.items():
        clean_env.setenv(name, value)
    assert device.local_world_size() == expected
    # the distributed helpers and auto_num_workers ask the same function
    assert distributed.get_local_world_size() == expected
    clean_env.setattr(device, "available_cpus", lambda: 32)
    assert device.auto_num_workers() == max(1, min(16, 32 // expected))


@pytest.mark.parametrize("value", ["0", "-2", "eight"])
def test_local_world_size_rejects_bad_values(clean_env: pytest.MonkeyPatch, value: str) -> None:
    clean_env.setenv("LOCAL_WORLD_SIZE", value)
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE should be a positive integer"):
        device.local_world_size()


def test_cuda_detection_does_not_need_cuda() -> None:
    assert device.device_is_cuda("cuda:1") and device.device_is_cuda(0)
    assert not device.device_is_cuda("cpu") and not device.device_is_cuda(None)
    assert device.cuda_available() == torch.cuda.is_available()
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert device.default_device().type == expected
    assert stream_backend("cpu").is_cuda is False
    assert stream_backend("cuda").is_cuda is True  # constructing it does not touch CUDA


@pytest.mark.parametrize(
    ("value", "on"), [(None, False), ("", False), ("0", False), ("1", True), (" 1 ", True)]
)
def test_the_experimental_gpu_code_is_off_unless_the_switch_says_1(
    monkeypatch: pytest.MonkeyPatch, value: str | None, on: bool
) -> None:
    if value is None:
        monkeypatch.delenv("FASTLOAD_GPU_EXPERIMENTAL", raising=False)
    else:
        monkeypatch.setenv("FASTLOAD_GPU_EXPERIMENTAL", value)
    assert device.gpu_experimental() is on


def test_a_misspelt_experimental_switch_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FASTLOAD_GPU_EXPERIMENTAL", "yes")
    with pytest.raises(
        ValueError, match="FASTLOAD_GPU_EXPERIMENTAL should be 1 .* got FASTLOAD_GPU_EXPERIMENTAL='yes'"
    ):
        device.gpu_experimental()
