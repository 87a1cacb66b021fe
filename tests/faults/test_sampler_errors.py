"""Sampler arguments that cannot work: torch's errors, or better named ones; edge cases as torch.

The messages themselves are in ``tests/test_sampler.py::test_bad_arguments``; here every case is
run through torch's ``DistributedSampler`` and fastload's side by side.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
from torch.utils.data import DistributedSampler as TorchSampler

from fastload.loader import DataLoader
from fastload.sampler import DistributedSampler


def _outcome(cls: Any, n: int, **kwargs: Any) -> list[list[int]] | BaseException:
    try:
        return [list(cls(range(n), rank=r, **kwargs)) for r in range(kwargs["num_replicas"])]
    except Exception as e:  # noqa: BLE001 - the test compares what was raised
        return e


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"num_replicas": 3, "rank": 3}, r"Invalid rank 3, rank should be in the interval \[0, 2\]"),
        ({"num_replicas": 3, "rank": -1}, r"Invalid rank -1, rank should be in the interval \[0, 2\]"),
        ({"num_replicas": 0, "rank": 0}, "num_replicas should be a positive integer, but got num_replicas=0"),
        (
            {"num_replicas": -2, "rank": 0},
            "num_replicas should be a positive integer, but got num_replicas=-2",
        ),
    ],
)
def test_impossible_ranks_raise_like_torch_and_name_the_argument(kwargs: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError) as theirs:
        TorchSampler(range(10), **kwargs)
    with pytest.raises(type(theirs.value), match=named):
        DistributedSampler(range(10), **kwargs)


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize(("n", "drop_last"), [(0, False), (0, True), (2, True)])
def test_empty_dataset_and_fewer_samples_than_ranks_give_torchs_empty_shards(
    n: int, drop_last: bool, shuffle: bool
) -> None:
    kwargs = {"num_replicas": 3, "shuffle": shuffle, "drop_last": drop_last}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = _outcome(DistributedSampler, n, **kwargs)
    assert ours == _outcome(TorchSampler, n, **kwargs) == [[], [], []]
    # Every rank would run a training loop of no step: fastload says so when samples are dropped.
    assert bool([w for w in caught if "every rank gets no sample" in str(w.message)]) == (n > 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sampler = DistributedSampler(range(n), rank=1, **kwargs)
    loader = DataLoader(range(n), batch_size=2, sampler=sampler, num_workers=0)
    assert len(loader) == 0 and list(loader) == []  # a loop over this rank's loader runs no step
