from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from fastload import rng


@pytest.mark.parametrize("key", [(0, 0, 0), (5, 3, 17), (2**40, 7, 123456789), (1, 2, -1), (2**63 - 1, 0, 3)])
def test_scalar_stream_equals_vectorised_draws(key: tuple[int, int, int]) -> None:
    r = rng.SampleRNG(*key, stream=4)
    scalar = [r.random() for _ in range(6)]
    assert [r.draw(j) for j in (5, 0, 3)] == [scalar[5], scalar[0], scalar[3]]  # any draw, not advancing
    assert r.random() == rng.SampleRNG(*key, stream=4).draw(6)
    assert rng.batch_uniform(key[0], key[1], [key[2]], stream=4, n=6)[0].tolist() == scalar
    assert (
        rng.batch_uniform(key[0], key[1], torch.tensor([key[2], key[2]]), stream=4, n=6)[1].tolist() == scalar
    )


def test_pure_function_of_the_key_and_independent_across_keys() -> None:
    first = rng.SampleRNG(1, 2, 3).random()
    torch.manual_seed(0)
    np.random.seed(0)
    assert rng.SampleRNG(1, 2, 3).random() == first  # no global state involved
    others = {rng.SampleRNG(*k).random() for k in [(2, 2, 3), (1, 3, 3), (1, 2, 4)]} | {
        rng.SampleRNG(1, 2, 3, stream=1).random()
    }
    assert first not in others and len(others) == 4


def test_draws_look_uniform() -> None:
    u = rng.batch_uniform(0, 0, np.arange(20000), stream=0, n=4)
    assert u.min() >= 0 and u.max() < 1
    hist, _ = np.histogram(u, bins=10, range=(0, 1))
    assert np.all(np.abs(hist / u.size - 0.1) < 0.01)
    # Neighbouring indices and successive draws are uncorrelated.
    assert abs(np.corrcoef(u[:-1, 0], u[1:, 0])[0, 1]) < 0.03
    assert abs(np.corrcoef(u[:, 0], u[:, 1])[0, 1]) < 0.03


def test_uniform_and_randint_ranges() -> None:
    r = rng.SampleRNG(0, 0, 0)
    values = [r.randint(3, 7) for _ in range(2000)]
    assert set(values) == {3, 4, 5, 6}
    assert all(2.0 <= r.uniform(2.0, 5.0) < 5.0 for _ in range(100))
    with pytest.raises(ValueError, match="high > low"):
        r.randint(3, 3)


def test_sample_scope_is_thread_local_and_nests() -> None:
    seen: dict[str, float] = {}

    def worker() -> None:
        with rng.sample_scope(9, 9, 9):
            seen["thread"] = rng.current().random()

    with rng.sample_scope(1, 0, 5) as outer:
        assert rng.current() is outer
        t = threading.Thread(target=worker)
        t.start()
        t.join()
        with rng.sample_scope(1, 0, 6):
            inner_draw = rng.current().random()
            assert rng.current_key() == (1, 0, 6)
        assert rng.current() is outer and rng.current_key() == (1, 0, 5)
    assert rng.current_key() is None
    assert seen["thread"] == rng.SampleRNG(9, 9, 9).random()
    assert inner_draw == rng.SampleRNG(1, 0, 6).random()


def test_current_outside_a_scope_follows_torch_manual_seed() -> None:
    torch.manual_seed(5)
    a = rng.current().random()
    torch.manual_seed(5)
    assert rng.current().random() == a
    assert rng.current().random() != rng.current().random()


def test_epoch_permutation_is_torchs_distributed_order() -> None:
    for seed, epoch in [(0, 0), (3, 4)]:
        sampler = torch.utils.data.DistributedSampler(range(50), num_replicas=1, rank=0, seed=seed)
        sampler.set_epoch(epoch)
        assert rng.epoch_permutation(50, seed, epoch).tolist() == list(sampler)
    assert rng.epoch_permutation(50, 0, 0).tolist() != rng.epoch_permutation(50, 0, 1).tolist()
