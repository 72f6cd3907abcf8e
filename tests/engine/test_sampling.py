"""Sampling parameters (engine/sampling/sampling_params.py): the ranges they accept and the fresh seeds;
tests/engine/test_sampler.py tests the rules they drive."""

import pytest

from rbee_worker.engine.sampling.sampling_params import SamplingParams, random_seed


def test_random_seed_is_fresh_and_in_range() -> None:
    seeds = [random_seed() for _ in range(100)]
    assert len(set(seeds)) == len(seeds)
    assert all(0 <= seed < 2**63 for seed in seeds)


@pytest.mark.parametrize(
    "bad",
    [
        dict(temperature=-0.1),
        dict(temperature=float("nan")),
        dict(top_k=-1),
        dict(top_p=1.5),
        dict(min_p=-0.1),
        dict(repetition_penalty=0.0),
        dict(presence_penalty=float("inf")),
    ],
)
def test_invalid_params_are_rejected(bad: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_greedy_below_the_threshold() -> None:
    assert SamplingParams(temperature=0.0).is_greedy() and SamplingParams(temperature=5e-6).is_greedy()
    assert not SamplingParams(temperature=1e-5).is_greedy()
