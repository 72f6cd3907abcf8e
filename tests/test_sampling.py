"""Tests for the token sampler: statistical goodness of fit, agreement with transformers' warpers, penalties,
greedy decoding, seeding, and input dtypes.

The expected distributions here are written from the definitions with numpy (float64), independently of the
sampler's torch code; the comparison with transformers checks that both read the definitions the same way.
"""

import functools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from rbee_worker.engine.sampling import Sampler, SamplingParams, random_seed

DRAWS = 20_000
ALPHA = 1e-3  # reject the sampler when the chi-square p-value is below this
# 24 distinct logits (no ties, so no cut lands on a tie), spread like a small LM output.
LOGITS = np.random.default_rng(7).normal(0.0, 1.5, size=24)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def expected_probs(
    logits: np.ndarray, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> np.ndarray:
    """The target distribution from the definitions: temperature -> top-k -> top-p -> min-p -> renormalize."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    keep = np.ones(z.size, dtype=bool)

    def renormalized() -> np.ndarray:
        p = np.where(keep, np.exp(z - z[keep].max()), 0.0)
        return p / p.sum()

    if top_k:
        keep &= z >= np.sort(z)[-top_k]
    if top_p < 1.0:
        p = renormalized()
        order = np.argsort(-p, kind="stable")  # most likely first
        mass_before = np.cumsum(p[order]) - p[order]
        keep[order[mass_before >= top_p]] = False  # a token is needed while the ones before it hold < top_p
    if min_p:
        p = renormalized()
        keep &= p >= min_p * p.max()
    return renormalized()


@functools.cache
def draw_counts(params: SamplingParams) -> np.ndarray:
    """How often each token came up in DRAWS draws over LOGITS from one seeded sampler. Cached (read-only result)
    so the power test reuses the fit test's draws instead of paying for them twice."""
    sampler = Sampler(params, 1234, prompt_ids=[])
    tensor = torch.tensor(LOGITS, dtype=torch.float32)
    counts = np.zeros(LOGITS.size, dtype=np.int64)
    for _ in range(DRAWS):
        counts[sampler(tensor, [])] += 1
    counts.flags.writeable = False
    return counts


def gof_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square p-value of the counts against `probs` over its support; bins expecting fewer than 5 draws are
    pooled into one so the chi-square approximation holds."""
    support = probs > 0
    observed, expected = counts[support], probs[support] * counts.sum()
    small = expected < 5
    if small.any():
        observed = np.append(observed[~small], observed[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    return float(chisquare(observed, expected).pvalue)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=1.7),
        SamplingParams(top_k=5),
        SamplingParams(top_p=0.8),
        SamplingParams(min_p=0.1),
        SamplingParams(temperature=0.8, top_k=12, top_p=0.9, min_p=0.1),
    ],
    ids=["temperature-0.5", "temperature-1.7", "top-k", "top-p", "min-p", "combined"],
)
def test_draws_follow_the_target_distribution(params: SamplingParams) -> None:
    probs = expected_probs(
        LOGITS, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, min_p=params.min_p
    )
    filtering = params.top_k or params.top_p < 1.0 or params.min_p
    assert not filtering or (probs == 0).any(), "the case should cut some tokens, or it tests nothing"
    counts = draw_counts(params)
    assert counts[probs == 0].sum() == 0, f"filtered-out tokens were drawn: {np.flatnonzero(counts * (probs == 0))}"
    assert gof_pvalue(counts, probs) > ALPHA


def test_combined_case_uses_every_filter() -> None:
    # Each stage of the combined case above must cut something, or one of its filters goes untested.
    z = dict(temperature=0.8)
    sizes = [
        (expected_probs(LOGITS, **z) > 0).sum(),
        (expected_probs(LOGITS, **z, top_k=12) > 0).sum(),
        (expected_probs(LOGITS, **z, top_k=12, top_p=0.9) > 0).sum(),
        (expected_probs(LOGITS, **z, top_k=12, top_p=0.9, min_p=0.1) > 0).sum(),
    ]
    assert sizes[0] > sizes[1] > sizes[2] > sizes[3] > 0, sizes


@pytest.mark.parametrize(
    ("params", "wrong"),
    [
        (SamplingParams(temperature=1.7), expected_probs(LOGITS, temperature=1.5)),
        (SamplingParams(top_k=5), expected_probs(LOGITS, top_k=6)),  # an off-by-one in k
    ],
    ids=["temperature-1.5-for-1.7", "top-k-6-for-5"],
)
def test_goodness_of_fit_rejects_a_wrong_expectation(params: SamplingParams, wrong: np.ndarray) -> None:
    assert gof_pvalue(draw_counts(params), wrong) < ALPHA


def hf_probabilities(
    logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int]
) -> torch.Tensor:
    """transformers' processors in `generate`'s order, with its defaults (min_tokens_to_keep=1)."""
    processors = LogitsProcessorList()
    if params.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.temperature != 1.0:
        processors.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k:
        processors.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        processors.append(TopPLogitsWarper(params.top_p))
    if params.min_p:
        processors.append(MinPLogitsWarper(params.min_p))
    scores = processors(torch.tensor([prompt_ids + output_ids]), logits[None].clone())
    return torch.softmax(scores, dim=-1)[0]


def _hf_cases() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    masked = torch.randn(40, generator=gen) * 2
    masked[[3, 17, 30]] = -torch.inf  # e.g. tokens a grammar forbids
    # Above 4096 candidates top-p locates its cut with a histogram first: a peaked and a flat distribution.
    peaked = torch.randn(5000, generator=gen) * 4
    peaked[::7] = -torch.inf
    return [
        ("normal-50", torch.randn(50, generator=gen) * 1.5),
        ("masked-40", masked),
        ("peaked-masked-5000", peaked),
        ("flat-5000", torch.randn(5000, generator=gen)),
    ]


HF_PARAMS = [
    SamplingParams(temperature=0.7),
    SamplingParams(top_k=7),
    SamplingParams(top_p=0.9),
    SamplingParams(top_p=0.5, temperature=1.3),
    SamplingParams(min_p=0.1),
    SamplingParams(temperature=0.8, top_k=30, top_p=0.9, min_p=0.05),
    SamplingParams(repetition_penalty=1.3, top_p=0.95),
    SamplingParams(repetition_penalty=0.8, temperature=1.2, min_p=0.02),
]


@pytest.mark.parametrize(("name", "logits"), _hf_cases(), ids=[name for name, _ in _hf_cases()])
def test_matches_transformers_warpers(name: str, logits: torch.Tensor) -> None:
    prompt_ids, output_ids = [0, 1, 2, 5, 5, 8], [8, 13, 1, 13]
    for params in HF_PARAMS:
        ours = Sampler(params, 0, prompt_ids).probabilities(logits, output_ids)
        theirs = hf_probabilities(logits, params, prompt_ids, output_ids)
        assert torch.equal(ours > 0, theirs > 0), f"{name} {params}: supports differ"
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5, msg=f"{name} {params}")


@pytest.mark.parametrize("top_p", [0.9, 0.95])
def test_top_p_cut_is_exact_on_a_full_size_vocabulary(top_p: float) -> None:
    # At 151936 tokens the float32 probabilities' sum is off from 1 by about one token's probability; a cut
    # computed against 1 instead of the actual sum kept one token too few here.
    logits = torch.randn(151936, generator=torch.Generator().manual_seed(0)) * 3
    ours = Sampler(SamplingParams(top_p=top_p), 0, []).probabilities(logits, [])
    p = softmax(logits.double().numpy())
    descending = np.sort(p)[::-1]
    needed = int((np.cumsum(descending) - descending < top_p).sum())  # float64: the exact nucleus size
    assert int((ours > 0).sum()) == needed
    assert torch.equal(ours > 0, hf_probabilities(logits, SamplingParams(top_p=top_p), [], []) > 0)


def test_top_p_counts_mass_far_below_the_top_logit() -> None:
    # 4999 tokens 40 nats below the top one (beyond the span of top-p's histogram) hold ~2e-14 of the mass: with
    # top_p = 1 - 1e-15 only the 235 of them holding the last 1e-15 are cut (the highest ids of the tie).
    logits = torch.full((5000,), -40.0)
    logits[0] = 0.0
    params = SamplingParams(top_p=1 - 1e-15)
    ours = Sampler(params, 0, []).probabilities(logits, [])
    assert torch.nonzero(ours).flatten().tolist() == list(range(4765))
    assert int((hf_probabilities(logits, params, [], []) > 0).sum()) == 4765


def test_top_k_keeps_every_token_tied_with_the_kth() -> None:
    logits = torch.tensor([3.0, 2.0, 0.5, 2.0, 2.0, 1.0])
    params = SamplingParams(top_k=2)
    ours = Sampler(params, 0, []).probabilities(logits, [])
    assert torch.nonzero(ours).flatten().tolist() == [0, 1, 3, 4]  # 4 tokens survive top_k=2
    assert torch.equal(ours > 0, hf_probabilities(logits, params, [], []) > 0)


def test_top_p_splits_a_tie_at_the_cut_keeping_the_lowest_ids() -> None:
    # Probabilities 0.4, 0.2, 0.2, 0.2: top_p=0.7 needs the 0.4 and two of the three tied 0.2s (0.4 + 0.2 < 0.7).
    logits = torch.tensor([0.4, 0.2, 0.2, 0.2]).log()
    params = SamplingParams(top_p=0.7)
    ours = Sampler(params, 0, []).probabilities(logits, [])
    assert torch.nonzero(ours).flatten().tolist() == [0, 1, 2]
    # transformers keeps as many; which of the tied ones is up to torch.sort's order of equal elements.
    assert int((hf_probabilities(logits, params, [], []) > 0).sum()) == 3


def test_top_p_reached_exactly_needs_no_further_token() -> None:
    # Four tokens of exactly 0.25: three reach 0.75 exactly, which satisfies top_p=0.75 ("cumulative >= top_p").
    logits = torch.zeros(4)
    params = SamplingParams(top_p=0.75)
    ours = Sampler(params, 0, []).probabilities(logits, [])
    assert torch.nonzero(ours).flatten().tolist() == [0, 1, 2]
    assert int((hf_probabilities(logits, params, [], []) > 0).sum()) == 3


def test_min_p_keeps_tokens_exactly_at_the_threshold() -> None:
    # min_p=1 keeps exactly the tokens tied for the highest probability ("drop if prob < min_p * max").
    logits = torch.tensor([1.0, 3.0, 3.0, 0.0])
    params = SamplingParams(min_p=1.0)
    ours = Sampler(params, 0, []).probabilities(logits, [])
    assert ours.tolist() == [0.0, 0.5, 0.5, 0.0]
    assert torch.equal(ours, hf_probabilities(logits, params, [], []))


def test_top_p_zero_keeps_only_the_most_likely_token() -> None:
    logits = torch.tensor([1.0, 4.0, 2.0, 4.0])
    probs = Sampler(SamplingParams(top_p=0.0), 0, []).probabilities(logits, [])
    assert probs.tolist() == [0.0, 1.0, 0.0, 0.0]  # min_tokens_to_keep=1; a tie for first goes to the lowest id


def test_greedy_is_argmax_with_ties_to_the_lowest_id() -> None:
    sampler = Sampler(SamplingParams(temperature=0.0), 0, [])
    assert sampler(torch.tensor([0.5, 2.0, -1.0, 1.9]), []) == 1
    assert sampler(torch.tensor([1.0, 5.0, 5.0, 2.0]), []) == 1


def test_greedy_ignores_top_k_top_p_and_min_p() -> None:
    logits = torch.tensor([1.0, 2.5, 2.4, 0.0, 2.45])
    params = SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.5)
    sampler = Sampler(params, 5, [])
    assert sampler.probabilities(logits, []).tolist() == [0.0, 1.0, 0.0, 0.0, 0.0]
    assert {sampler(logits, []) for _ in range(20)} == {1}


def test_greedy_applies_penalties_first() -> None:
    # Token 0 has the highest raw logit, but it is in the prompt: 2.0 / 1.2 = 1.67 < 1.9.
    sampler = Sampler(SamplingParams(temperature=0.0, repetition_penalty=1.2), 0, prompt_ids=[0])
    assert sampler(torch.tensor([2.0, 1.9, 0.0]), []) == 1


def test_penalties_match_a_hand_computation() -> None:
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -0.5, 1.0])
    params = SamplingParams(repetition_penalty=1.5, presence_penalty=0.3, frequency_penalty=0.2)
    prompt_ids, output_ids = [0, 1, 1, 99], [3, 3, 4]  # 99: past the vocab, ignored like transformers does
    # Repetition over distinct prompt + output ids {0, 1, 3, 4}, once each: positives / 1.5, negatives * 1.5.
    # Then presence + frequency over output ids only: 3 occurs twice (-0.3 - 2 * 0.2), 4 once (-0.3 - 0.2).
    hand = np.array([2.0 / 1.5, -1.0 * 1.5, 0.5, 3.0 / 1.5 - 0.3 - 0.4, -0.5 * 1.5 - 0.3 - 0.2, 1.0])
    probs = Sampler(params, 0, prompt_ids).probabilities(logits, output_ids)
    np.testing.assert_allclose(probs.numpy(), softmax(hand), rtol=1e-5)


def penalized_reference(
    logits: np.ndarray, params: SamplingParams, prompt_ids: list[int], output_ids: list[int]
) -> np.ndarray:
    z = logits.astype(np.float64).copy()
    for token in set(prompt_ids) | set(output_ids):
        z[token] = z[token] * params.repetition_penalty if z[token] < 0 else z[token] / params.repetition_penalty
    for token in set(output_ids):
        z[token] -= params.presence_penalty + params.frequency_penalty * output_ids.count(token)
    return z


def test_penalty_counts_grow_incrementally() -> None:
    # One sampler over a growing output (as the engine calls it), also asked twice per step (logprobs + draw):
    # it must match a from-scratch computation at every step and never count an id twice.
    rng = np.random.default_rng(11)
    logits = rng.normal(0.0, 2.0, size=30)
    params = SamplingParams(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.25)
    prompt_ids = [2, 2, 7, 29]
    sampler = Sampler(params, 9, prompt_ids)
    tensor = torch.tensor(logits, dtype=torch.float32)
    output_ids: list[int] = []
    for token in [5, 7, 5, 5, 0, 7, 29, 5]:
        output_ids.append(token)
        for _ in range(2):
            probs = sampler.probabilities(tensor, output_ids)
            want = softmax(penalized_reference(logits, params, prompt_ids, output_ids))
            np.testing.assert_allclose(probs.numpy(), want, rtol=1e-5, atol=1e-7)


def test_output_ids_must_only_grow() -> None:
    sampler = Sampler(SamplingParams(frequency_penalty=0.5), 0, [])
    logits = torch.zeros(8)
    sampler(logits, [1, 2, 3])
    with pytest.raises(ValueError, match="shrank"):
        sampler(logits, [1, 2])


def test_same_seed_same_tokens_different_seed_different_tokens() -> None:
    logits = torch.tensor(np.random.default_rng(5).normal(0.0, 1.0, size=50), dtype=torch.float32)
    params = SamplingParams(temperature=1.0, top_p=0.95)

    def tokens(seed: int) -> list[int]:
        sampler = Sampler(params, seed, [])
        return [sampler(logits, []) for _ in range(200)]

    assert tokens(42) == tokens(42)
    assert tokens(42) != tokens(43)
    # torch.Generator.manual_seed uses only the low 32 bits of a seed; these pairs would collide there.
    assert tokens(1) != tokens(1 + 2**32)
    assert tokens(0) != tokens(2**63)


def test_largest_api_seed_works_and_out_of_range_seeds_are_rejected() -> None:
    logits = torch.zeros(100)
    first = [Sampler(SamplingParams(), 2**64 - 1, [])(logits, []) for _ in range(2)]
    assert first[0] == first[1]
    for bad in (-1, 2**64):
        with pytest.raises(ValueError, match="seed"):
            Sampler(SamplingParams(), bad, [])


def test_random_seed_is_fresh_and_in_range() -> None:
    seeds = [random_seed() for _ in range(100)]
    assert len(set(seeds)) == len(seeds)
    assert all(0 <= seed < 2**63 for seed in seeds)


def test_bfloat16_logits() -> None:
    logits32 = torch.tensor(np.random.default_rng(2).normal(0.0, 2.0, size=64), dtype=torch.float32)
    logits16 = logits32.to(torch.bfloat16)
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, repetition_penalty=1.1)
    # bfloat16 -> float32 is exact, so the result must equal that of the upcast logits, draws included.
    upcast = logits16.float()
    torch.testing.assert_close(
        Sampler(params, 0, [1]).probabilities(logits16, [2]), Sampler(params, 0, [1]).probabilities(upcast, [2])
    )
    a, b = Sampler(params, 8, [1]), Sampler(params, 8, [1])
    assert [a(logits16, [2]) for _ in range(50)] == [b(upcast, [2]) for _ in range(50)]


def test_callers_logits_are_not_modified() -> None:
    logits = torch.tensor([1.0, -2.0, 3.0, 0.5])
    before = logits.clone()
    params = SamplingParams(temperature=0.5, top_k=3, repetition_penalty=1.5, presence_penalty=1.0)
    sampler = Sampler(params, 0, [0, 1])
    sampler(logits, [2])
    sampler.probabilities(logits, [2])
    assert torch.equal(logits, before)


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


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.0)], ids=["sampled", "greedy"])
@pytest.mark.parametrize(
    "logits",
    [torch.tensor([0.0, float("nan")]), torch.full((4,), -float("inf")), torch.zeros(2, 3)],
    ids=["nan", "all-masked", "2-d"],
)
def test_unusable_logits_are_rejected(logits: torch.Tensor, params: SamplingParams) -> None:
    sampler = Sampler(params, 0, [])
    with pytest.raises(ValueError):
        sampler(logits, [])
    with pytest.raises(ValueError):
        sampler.probabilities(logits, [])


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=5e-324),  # 0 in float32: greedy below 1e-5, as vLLM
        SamplingParams(temperature=1e-5, top_p=0.5),  # the smallest sampled temperature: no overflow
        SamplingParams(repetition_penalty=1e-300),  # 0 in float32; positive logits / it overflow
        SamplingParams(temperature=0.01, repetition_penalty=1e-30, frequency_penalty=-2.0),
    ],
)
def test_extreme_valid_parameters_still_sample_the_top_token(params: SamplingParams) -> None:
    """Values the API accepts must never make the distribution invalid; at these extremes it collapses onto the
    largest (penalized) logit."""
    logits = torch.tensor([1.0, 3.0, -2.0, 0.0, 2.5])
    sampler = Sampler(params, seed=3, prompt_ids=[1])
    assert sampler(logits, []) == 1
