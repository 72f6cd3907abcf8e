"""Tests for the batched sampler on the logits' device (engine/sampling/sampler.py): its distributions against
transformers' warpers and against definitions written with numpy, goodness of fit of its draws, tie rules, batch
invariance, seeding, invalid rows, penalty counts kept on the device, the logits mask, and that it never waits for the
host.

Every test runs on the CPU; those parametrized by device run on CUDA too where there is a GPU.
"""

import functools

import numpy as np
import pytest
import torch
from conftest import penalty_state
from scipy.stats import chisquare
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from rbee_worker.engine.sampling import sampler, sampler_state, seeded_draws
from rbee_worker.engine.sampling.sampler import PACKED_WIDTH, SampleOutput, pack, sample, unpack
from rbee_worker.engine.sampling.sampler_state import MAX_TOP_LOGPROBS, SamplerFeatures, SamplerState
from rbee_worker.engine.sampling.sampling_params import SamplingParams
from rbee_worker.engine.sampling.seeded_draws import check_seed

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
DRAWS_ROWS, DRAWS_STEPS = 1000, 20  # 20,000 draws per goodness-of-fit case: 1000 seeds x 20 counters
ALPHA = 1e-3  # reject the sampler when the chi-square p-value is below this
# 24 distinct logits (no ties, so no cut lands on a tie), spread like a small LM output.
LOGITS = np.random.default_rng(7).normal(0.0, 1.5, size=24)
CHAT = SamplingParams(temperature=0.7, top_p=0.9)


# -- references, written from the definitions (as in test_sampling.py) ---------------------------------------------


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


def penalized_reference(
    logits: np.ndarray, params: SamplingParams, prompt_ids: list[int], output_ids: list[int]
) -> np.ndarray:
    z = logits.astype(np.float64).copy()
    for token in set(prompt_ids) | set(output_ids):
        z[token] = z[token] * params.repetition_penalty if z[token] < 0 else z[token] / params.repetition_penalty
    for token in set(output_ids):
        z[token] -= params.presence_penalty + params.frequency_penalty * output_ids.count(token)
    return z


def reference_keep(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Top-k then top-p with the tie rules spelled out: tokens ordered by scaled logit, then by id; top-k keeps every
    token tied with the k-th; top-p keeps a token iff the mass before it in that order is < top_p * total. The scaled
    logits are computed in float32 as the sampler does (ties are ties of those), the probabilities in float64. Tokens
    below 2**-40 of the most likely one are dropped, as the sampler's integer weights do."""
    z = ((logits - logits.max()) / temperature).double().numpy()
    keep = np.ones(z.size, dtype=bool)
    if top_k:
        keep &= z >= np.sort(z)[-top_k]
    p = np.where(keep, np.exp(z), 0.0)
    keep &= p >= 2**-40  # the sampler's integer weights: see test_tokens_far_below_the_top_have_no_weight
    order = np.lexsort((np.arange(z.size), -z))
    mass_before = np.cumsum(p[order]) - p[order]
    keep[order[mass_before >= top_p * p.sum()]] = False
    keep[order[0]] = True
    return keep


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


def uniform(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """The uniform numbers the sampler draws with, from the seeds themselves (int64 tensors, seeds as two's
    complement): seeded_draws.draw_bits of the seeds' streams."""
    return seeded_draws.draw_bits(seeded_draws.stream_of(seeds), counters)


def splitmix64_uniform(seed: int, counter: int) -> int:
    """uniform()'s definition in Python integers: SplitMix64's output number counter + 1 from the state mix(seed)."""
    mask = 2**64 - 1

    def mix(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    return mix((mix(seed) + (counter + 1) * 0x9E3779B97F4A7C15) & mask) >> 11


# -- helpers -----------------------------------------------------------------------------------------------------


def make_state(
    params: list[SamplingParams], vocab: int, device: str, seeds: list[int] | None = None, prompt_ids: list[int] = ()
) -> SamplerState:
    state = SamplerState(len(params), vocab, device)
    for slot, p in enumerate(params):
        state.assign(slot, p, seeds[slot] if seeds else slot, prompt_ids)
    return state


def step(
    logits: torch.Tensor,
    state: SamplerState,
    features: SamplerFeatures,
    slots: list[int] | None = None,
    live: list[bool] | None = None,
) -> SampleOutput:
    """`sample` over these rows (slots 0.. unless given), all live unless given."""
    rows = logits.shape[0]
    slots_t = torch.tensor(slots if slots is not None else range(rows), device=state.device)
    live_t = torch.tensor(live if live is not None else [True] * rows, device=state.device)
    return sample(logits.to(state.device), state, slots_t, live_t, features)


def generate(state: SamplerState, slot: int, ids: list[int]) -> None:
    """Record `ids` as the slot's generated tokens, through `sample` (one-hot logits leave each one no choice)."""
    for token in ids:
        logits = torch.full((1, state.vocab_size), -torch.inf)
        logits[0, token] = 0.0
        out = step(logits, state, SamplerFeatures(sampling=True, penalties=True), slots=[slot])
        assert out.tokens.tolist() == [token]


def probabilities(
    logits: torch.Tensor, state: SamplerState, slots: torch.Tensor, features: SamplerFeatures
) -> torch.Tensor:
    """The distributions `sample` draws from, [rows, vocab] float32, by the sampler's own code: the kept weights over
    their total; one-hot on the argmax for greedy rows; zeros for invalid rows. Reads the state only."""
    x, top, best, valid = sampler._scores(logits, state, slots, features)
    probs = torch.zeros(x.shape, device=x.device).scatter_(1, best[:, None], 1.0)
    if features.sampling:
        weights = sampler._kept_weights(x, top, state, slots, features).float()
        probs = torch.where(state.greedy[slots][:, None], probs, weights / weights.sum(1, keepdim=True))
    return torch.where(valid[:, None], probs, 0.0)


def probs_of(logits: torch.Tensor, state: SamplerState, features: SamplerFeatures) -> torch.Tensor:
    slots = torch.arange(logits.shape[0], device=state.device)
    return probabilities(logits.to(state.device), state, slots, features).cpu()


def kept(logits: torch.Tensor, params: SamplingParams, device: str = "cpu") -> list[int]:
    """The ids that keep a probability, in order, for one row of logits."""
    state = make_state([params], logits.numel(), device)
    probs = probs_of(logits[None], state, SamplerFeatures.of([(params, None)]))[0]
    return torch.nonzero(probs).flatten().tolist()


def assert_same_distribution(ours: torch.Tensor, theirs: torch.Tensor, msg: str) -> None:
    # Weights are floor(2**40 * probability relative to the top token): a token below 2**-40 of it is never drawn
    # here, which transformers keeps (test_tokens_far_below_the_top_have_no_weight). Above 2**-39 supports agree.
    if torch.isclose(ours[theirs == 0], theirs[theirs > 0].min(), rtol=1e-5, atol=0).any():
        # A tie straddles a cut, whose kept members transformers leaves to torch.sort's order (here: the lowest ids,
        # see test_ties_on_a_bfloat16_grid_follow_the_tie_rules): the same values, not on the same ids.
        ours, theirs = ours.sort().values, theirs.sort().values
    assert not (ours > 0)[theirs == 0].any(), f"{msg}: a token transformers drops is kept"
    clear = theirs >= theirs.max() * 2**-39
    assert torch.equal((ours > 0)[clear], (theirs > 0)[clear]), f"{msg}: supports differ"
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5, msg=msg)


# -- (a) the distribution drawn from --------------------------------------------------------------------------------


def _hf_cases() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    masked = torch.randn(40, generator=gen) * 2
    masked[[3, 17, 30]] = -torch.inf  # e.g. tokens a grammar forbids
    peaked = torch.randn(5000, generator=gen) * 4
    peaked[::7] = -torch.inf
    ties = (torch.randn(5000, generator=gen) * 2).bfloat16().float()  # bfloat16 logits: many exact ties
    return [
        ("normal-50", torch.randn(50, generator=gen) * 1.5),
        ("masked-40", masked),
        ("peaked-masked-5000", peaked),
        ("flat-5000", torch.randn(5000, generator=gen)),
        ("bfloat16-ties-5000", ties),
    ]


HF_CASES = _hf_cases()
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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("name", "logits"), HF_CASES, ids=[name for name, _ in HF_CASES])
def test_matches_transformers_warpers(device: str, name: str, logits: torch.Tensor) -> None:
    # Every parameter set is a row of one batch, so the rows' different stages run side by side.
    prompt_ids, output_ids = [0, 1, 2, 5, 5, 8], [8, 13, 1, 13]
    state = make_state(HF_PARAMS, logits.numel(), device, prompt_ids=prompt_ids)
    for slot in range(len(HF_PARAMS)):
        generate(state, slot, output_ids)
    features = SamplerFeatures.of((params, None) for params in HF_PARAMS)
    ours = probs_of(logits.expand(len(HF_PARAMS), -1), state, features)
    for row, params in enumerate(HF_PARAMS):
        assert_same_distribution(
            ours[row], hf_probabilities(logits, params, prompt_ids, output_ids), f"{name} {params}"
        )


@pytest.mark.parametrize("device", DEVICES)
def test_top_p_cut_is_exact_on_a_full_size_vocabulary(device: str) -> None:
    # At 151936 tokens a float32 sum of the probabilities is off from 1 by about one token's probability; the cut
    # must count the nucleus exactly.
    logits = torch.randn(151936, generator=torch.Generator().manual_seed(0)) * 3
    p = softmax(logits.double().numpy())
    descending = np.sort(p)[::-1]
    for top_p in (0.9, 0.95):
        needed = int((np.cumsum(descending) - descending < top_p).sum())  # float64: the exact nucleus size
        ours = kept(logits, SamplingParams(top_p=top_p), device)
        assert len(ours) == needed
        assert ours == torch.nonzero(hf_probabilities(logits, SamplingParams(top_p=top_p), [], [])).flatten().tolist()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature", [0.6, 1.0])
def test_ties_on_a_bfloat16_grid_follow_the_tie_rules(device: str, temperature: float) -> None:
    # bfloat16 logits tie often, also across a top-k or top-p cut: against a reference that sorts by (logit, id).
    logits = (torch.randn(4000, generator=torch.Generator().manual_seed(5)) * 2.5).bfloat16().float()
    split = 0
    for top_k in (0, 40, 333):
        for top_p in (0.3, 0.5, 0.6, 0.8, 0.9, 0.95, 1.0):
            params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
            want = reference_keep(logits, temperature, top_k, top_p)
            assert kept(logits, params, device) == np.flatnonzero(want).tolist(), params
            edge = logits[want].min()
            split += bool((logits[~torch.from_numpy(want)] == edge).any())  # a tie straddles the cut
    assert split >= 3, "the cases should split ties at the cut, or they test nothing"


def test_tokens_far_below_the_top_have_no_weight() -> None:
    # Documented inexactness: integer weights are floor(2**40 * relative probability), so e^-27 (1.9e-12) gets one
    # and e^-28 (6.9e-13 < 2**-40) none, where transformers and sampling_params.py keep a probability of ~1e-12.
    probs = probs_of(
        torch.tensor([[0.0, -27.0, -28.0]]), make_state([SamplingParams()], 3, "cpu"), SamplerFeatures(sampling=True)
    )
    assert probs[0, 1] > 0 and probs[0, 2] == 0


# -- (b) goodness of fit of the draws -------------------------------------------------------------------------------


@functools.cache
def draw_counts(params: SamplingParams, device: str) -> np.ndarray:
    """How often each token came up in DRAWS_ROWS x DRAWS_STEPS draws over LOGITS (1000 seeds, 20 draws each).
    Cached (read-only result) so the power test reuses the fit test's draws."""
    state = make_state([params] * DRAWS_ROWS, LOGITS.size, device, seeds=[1234 + 7919 * i for i in range(DRAWS_ROWS)])
    logits = torch.tensor(LOGITS, dtype=torch.float32).expand(DRAWS_ROWS, -1)
    features = SamplerFeatures.of([(params, None)])
    tokens = torch.cat([step(logits, state, features).tokens.cpu() for _ in range(DRAWS_STEPS)])
    counts = np.bincount(tokens.numpy(), minlength=LOGITS.size)
    counts.flags.writeable = False
    return counts


GOF_PARAMS = [
    SamplingParams(temperature=0.5),
    SamplingParams(temperature=1.7),
    SamplingParams(top_k=5),
    SamplingParams(top_p=0.8),
    SamplingParams(min_p=0.1),
    SamplingParams(temperature=0.8, top_k=12, top_p=0.9, min_p=0.1),
]
GOF_IDS = ["temperature-0.5", "temperature-1.7", "top-k", "top-p", "min-p", "combined"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("params", GOF_PARAMS, ids=GOF_IDS)
def test_draws_follow_the_target_distribution(device: str, params: SamplingParams) -> None:
    probs = expected_probs(
        LOGITS, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, min_p=params.min_p
    )
    filtering = params.top_k or params.top_p < 1.0 or params.min_p
    assert not filtering or (probs == 0).any(), "the case should cut some tokens, or it tests nothing"
    ours = probs_of(
        torch.tensor(LOGITS, dtype=torch.float32)[None],
        make_state([params], LOGITS.size, device),
        SamplerFeatures.of([(params, None)]),
    )
    np.testing.assert_allclose(ours[0].numpy(), probs, atol=1e-6)
    counts = draw_counts(params, device)
    assert counts[probs == 0].sum() == 0, f"filtered-out tokens were drawn: {np.flatnonzero(counts * (probs == 0))}"
    assert gof_pvalue(counts, probs) > ALPHA


@pytest.mark.parametrize(
    ("params", "wrong"),
    [
        (SamplingParams(temperature=1.7), expected_probs(LOGITS, temperature=1.5)),
        (SamplingParams(top_k=5), expected_probs(LOGITS, top_k=6)),  # an off-by-one in k
    ],
    ids=["temperature-1.5-for-1.7", "top-k-6-for-5"],
)
def test_goodness_of_fit_rejects_a_wrong_expectation(params: SamplingParams, wrong: np.ndarray) -> None:
    assert gof_pvalue(draw_counts(params, "cpu"), wrong) < ALPHA


# -- (c) batch invariance ----------------------------------------------------------------------------------------

OTHERS = [
    SamplingParams(temperature=0.0),
    SamplingParams(top_k=5),
    SamplingParams(temperature=1.3, top_p=0.5, min_p=0.05),
    SamplingParams(temperature=0.9, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2),
    SamplingParams(temperature=0.6, top_k=40, top_p=0.8),
    SamplingParams(temperature=2.0),
    SamplingParams(min_p=0.2),
    SamplingParams(temperature=0.0, repetition_penalty=1.5),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "params", [CHAT, SamplingParams(temperature=0.9, top_k=50, top_p=0.95, repetition_penalty=1.2)], ids=["chat", "all"]
)
def test_a_rows_tokens_do_not_depend_on_the_batch(device: str, params: SamplingParams) -> None:
    vocab, steps, seed, prompt = 3000, 20, 2**63 + 12345, [3, 14, 15, 92]
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(steps, 16, vocab, generator=gen) * 3

    alone = make_state([params], vocab, device, seeds=[seed], prompt_ids=prompt)
    features = SamplerFeatures.of([(params, None)])
    by_itself = [step(logits[t, 5:6], alone, features).tokens.item() for t in range(steps)]

    # The same row as row 5 of 16 (slot 11 of 20), among other parameters, logprobs, and a padding row.
    others = [OTHERS[i % len(OTHERS)] for i in range(20)]
    others[11] = params
    batch = make_state(others, vocab, device, seeds=[seed if i == 11 else i for i in range(20)], prompt_ids=prompt)
    slots = [0, 1, 2, 3, 4, 11, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16]
    live = [True] * 15 + [False]
    features = SamplerFeatures.of([(others[s], 3) for s in slots], masks=True)
    among = [step(logits[t], batch, features, slots, live).tokens[5].item() for t in range(steps)]
    assert by_itself == among
    assert len(set(by_itself)) > 5, "the row should draw various tokens, or the test is weak"


# -- (d) seeds ---------------------------------------------------------------------------------------------------


def test_uniform_is_splitmix64_of_every_seed_bit() -> None:
    seeds = [0, 1, 2**32 + 1, 2**63, 2**64 - 1, 0x0123456789ABCDEF]
    for counter in (0, 1, 2**40):
        signed = torch.tensor([s - 2**64 if s >= 2**63 else s for s in seeds])
        got = uniform(signed, torch.full((len(seeds),), counter)).tolist()
        assert got == [splitmix64_uniform(s, counter) for s in seeds]
    assert splitmix64_uniform(1, 0) != splitmix64_uniform(2**32 + 1, 0)


def test_uniform_numbers_are_uniform() -> None:
    draws = uniform(torch.arange(200).repeat_interleave(500), torch.arange(500).repeat(200))
    counts = np.bincount((draws >> 47).numpy(), minlength=64)  # the top 6 of the 53 bits
    assert chisquare(counts).pvalue > ALPHA
    assert int(draws.min()) >= 0 and int(draws.max()) < 2**53


@pytest.mark.parametrize("device", DEVICES)
def test_same_seed_same_tokens_different_seeds_different_tokens(device: str) -> None:
    logits = torch.tensor(np.random.default_rng(5).normal(0.0, 1.0, size=50), dtype=torch.float32)
    params = SamplingParams(top_p=0.95)
    seeds = [42, 42, 43, 1, 1 + 2**32, 0, 2**63, 2**64 - 1]
    state = make_state([params] * len(seeds), 50, device, seeds=seeds)
    features = SamplerFeatures.of([(params, None)])
    draws = torch.stack([step(logits.expand(len(seeds), -1), state, features).tokens for _ in range(100)], 1)
    streams = [tuple(row) for row in draws.tolist()]
    assert streams[0] == streams[1]
    assert len(set(streams)) == len(seeds) - 1  # every other seed gives other tokens, 1 and 2**32 + 1 included


def test_out_of_range_seeds_are_rejected() -> None:
    assert check_seed(2**64 - 1) == 2**64 - 1
    state = SamplerState(1, 8, "cpu")
    for bad in (-1, 2**64):
        with pytest.raises(ValueError, match="seed"):
            state.assign(0, SamplingParams(), bad, [])


# -- (e) tie rules and greedy -------------------------------------------------------------------------------------


def test_top_k_keeps_every_token_tied_with_the_kth() -> None:
    assert kept(torch.tensor([3.0, 2.0, 0.5, 2.0, 2.0, 1.0]), SamplingParams(top_k=2)) == [0, 1, 3, 4]


def test_top_p_splits_a_tie_at_the_cut_keeping_the_lowest_ids() -> None:
    # Probabilities 0.4, 0.2, 0.2, 0.2: top_p=0.7 needs the 0.4 and two of the three tied 0.2s (0.4 + 0.2 < 0.7).
    assert kept(torch.tensor([0.2, 0.2, 0.4, 0.2]).log(), SamplingParams(top_p=0.7)) == [0, 1, 2]


def test_top_p_reached_exactly_needs_no_further_token() -> None:
    # Four tokens of exactly 0.25: three reach 0.75 exactly, which satisfies top_p=0.75 ("cumulative >= top_p").
    assert kept(torch.zeros(4), SamplingParams(top_p=0.75)) == [0, 1, 2]


def test_top_p_zero_keeps_only_the_most_likely_token() -> None:
    assert kept(torch.tensor([1.0, 4.0, 2.0, 4.0]), SamplingParams(top_p=0.0)) == [1]  # a tie for first: lowest id


def test_min_p_keeps_tokens_exactly_at_the_threshold() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    params = SamplingParams(min_p=1.0)
    probs = probs_of(logits, make_state([params], 4, "cpu"), SamplerFeatures.of([(params, None)]))
    assert probs[0].tolist() == [0.0, 0.5, 0.5, 0.0]


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax_with_ties_to_the_lowest_id_and_ignores_filters(device: str) -> None:
    logits = torch.tensor([[0.5, 2.0, -1.0, 2.0, 1.9], [1.0, 2.5, 2.4, 0.0, 2.45]])
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.5)]
    state = make_state(params, 5, device)
    for features in (SamplerFeatures(), SamplerFeatures(top_k=True)):  # also inside a batch that samples
        assert {tuple(step(logits, state, features).tokens.tolist()) for _ in range(10)} == {(1, 1)}
        assert probs_of(logits, state, features).tolist() == [[0, 1, 0, 0, 0], [0, 1, 0, 0, 0]]


def test_greedy_applies_penalties_first() -> None:
    # Token 0 has the highest raw logit, but it is in the prompt: 2.0 / 1.2 = 1.67 < 1.9.
    params = SamplingParams(temperature=0.0, repetition_penalty=1.2)
    state = make_state([params], 3, "cpu", prompt_ids=[0])
    assert step(torch.tensor([[2.0, 1.9, 0.0]]), state, SamplerFeatures.of([(params, None)])).tokens.tolist() == [1]


@pytest.mark.parametrize("device", DEVICES)
def test_logit_bias_goes_before_the_penalties_and_bans_or_forces(device: str) -> None:
    """Three rows in one step: one sampled with a bias (a ban, a boost, a small malus) under a repetition penalty and
    top-p draws from the definitions' distribution over the biased, then penalized logits; a greedy row with +100 on
    its least likely token takes it; a row without bias beside them is untouched."""
    bias = ((3, -100.0), (5, 2.5), (0, -1.0))
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.3, logit_bias=bias),
        SamplingParams(temperature=0.0, logit_bias=((int(LOGITS.argmin()), 100.0),)),
        SamplingParams(temperature=0.8),
    ]
    state = make_state(params, LOGITS.size, device, prompt_ids=[5, 7])
    logits = torch.tensor(np.stack([LOGITS] * 3), dtype=torch.float32)
    probs = probs_of(logits, state, SamplerFeatures.of([(p, None) for p in params]))
    biased = LOGITS.astype(np.float64).copy()
    for token, value in bias:
        biased[token] += value
    penalized = penalized_reference(biased, params[0], [5, 7], [])
    assert_same_distribution(probs[0], torch.tensor(expected_probs(penalized, 0.8, top_p=0.9), dtype=torch.float32),
                             "biased")  # fmt: skip
    assert probs[0, 3] == 0 and probs[1].argmax() == LOGITS.argmin() and probs[1].max() == 1
    assert_same_distribution(probs[2], torch.tensor(expected_probs(LOGITS, 0.8), dtype=torch.float32), "unbiased")


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
    state = make_state([params], 5, "cpu", prompt_ids=[1])
    out = step(torch.tensor([[1.0, 3.0, -2.0, 0.0, 2.5]]), state, SamplerFeatures.of([(params, None)]))
    assert out.tokens.tolist() == [1] and out.valid.tolist() == [True]


# -- (f) invalid rows -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0), CHAT, SamplingParams(top_k=9, top_p=0.8)])
def test_invalid_rows_are_flagged_and_leave_the_others_alone(device: str, params: SamplingParams) -> None:
    logits = torch.randn(6, 64, generator=torch.Generator().manual_seed(1))
    logits[1, 7] = torch.nan
    logits[2, 9] = torch.inf
    logits[3] = -torch.inf
    logits[4, ::2] = torch.nan
    features = SamplerFeatures.of([(params, 2)])
    state = make_state([params] * 6, 64, device)
    out = step(logits, state, features)
    assert out.valid.tolist() == [True, False, False, False, False, True]
    assert all(0 <= t < 64 for t in out.tokens.tolist())
    assert state.counter.tolist() == [1, 0, 0, 0, 0, 1]  # invalid rows do not advance
    alone = make_state([params] * 6, 64, device)
    assert step(logits[[0, 5]], alone, features, slots=[0, 5]).tokens.tolist() == out.tokens[[0, 5]].tolist()


# -- (g) penalty counts on the device --------------------------------------------------------------------------


def test_penalties_match_a_hand_computation() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -0.5, 1.0]])
    params = SamplingParams(repetition_penalty=1.5, presence_penalty=0.3, frequency_penalty=0.2)
    state = make_state([params], 6, "cpu", prompt_ids=[0, 1, 1, 99])  # 99: past the vocab, ignored
    generate(state, 0, [3, 3, 4])
    # Repetition over distinct prompt + output ids {0, 1, 3, 4}, once each: positives / 1.5, negatives * 1.5.
    # Then presence + frequency over output ids only: 3 occurs twice (-0.3 - 2 * 0.2), 4 once (-0.3 - 0.2).
    hand = np.array([2.0 / 1.5, -1.0 * 1.5, 0.5, 3.0 / 1.5 - 0.3 - 0.4, -0.5 * 1.5 - 0.3 - 0.2, 1.0])
    probs = probs_of(logits, state, SamplerFeatures.of([(params, None)]))
    np.testing.assert_allclose(probs[0].numpy(), softmax(hand), rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_penalty_counts_grow_step_by_step_on_the_device(device: str) -> None:
    rng = np.random.default_rng(11)
    logits = rng.normal(0.0, 2.0, size=30)
    params = SamplingParams(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.25)
    prompt_ids = [2, 2, 7, 29]
    state = make_state([params], 30, device, prompt_ids=prompt_ids)
    tensor = torch.tensor(logits, dtype=torch.float32)[None]
    output_ids: list[int] = []
    for token in [5, 7, 5, 5, 0, 7, 29, 5]:
        generate(state, 0, [token])
        output_ids.append(token)
        probs = probs_of(tensor, state, SamplerFeatures.of([(params, None)]))
        want = softmax(penalized_reference(logits, params, prompt_ids, output_ids))
        np.testing.assert_allclose(probs[0].numpy(), want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
def test_only_live_rows_advance_their_state(device: str) -> None:
    params = SamplingParams(temperature=1.5, frequency_penalty=0.5)
    state = make_state([params] * 3, 20, device)
    features = SamplerFeatures.of([(params, None)])
    gen = torch.Generator().manual_seed(2)
    tokens = [
        step(torch.randn(3, 20, generator=gen), state, features, live=[True, False, True]).tokens for _ in range(12)
    ]
    drawn = torch.stack(tokens).cpu()
    for slot in (0, 2):
        assert state.counts[slot].tolist() == np.bincount(drawn[:, slot].numpy(), minlength=20).tolist()
    assert state.counts[1].tolist() == [0] * 20
    assert state.counter.tolist() == [12, 0, 12]
    state.assign(2, params, 5, [])  # a new request in the slot starts afresh
    assert state.counts[2].tolist() == [0] * 20 and state.counter.tolist() == [12, 0, 0]


# -- (h) the logits mask -----------------------------------------------------------------------------------------


def pack_bits(allowed: list[int], vocab: int) -> torch.Tensor:
    bits = np.zeros(32 * ((vocab + 31) // 32), dtype=np.uint8)
    bits[allowed] = 1
    return torch.from_numpy(np.packbits(bits.reshape(-1, 32), axis=1, bitorder="little").view(np.int32).ravel())


@pytest.mark.parametrize("device", DEVICES)
def test_mask_limits_the_draw(device: str) -> None:
    vocab, allowed = 70, [3, 33, 69]  # three words, the last one partial
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0), SamplingParams(top_k=2, top_p=0.5)]
    state = make_state(params, vocab, device)
    logits = torch.zeros(3, vocab)
    logits[:, 10] = 50.0  # far the most likely, but not allowed
    logits[:, 69] = 1.0
    for slot in range(3):
        state.set_mask(slot, pack_bits(allowed, vocab))
    features = SamplerFeatures.of([(p, None) for p in params], masks=True)
    draws = torch.stack([step(logits, state, features).tokens for _ in range(50)]).cpu()
    assert set(draws[:, 0].tolist()) == set(allowed)
    assert set(draws[:, 1].tolist()) == {69} and set(draws[:, 2].tolist()) == {69}
    assert set(step(logits, state, SamplerFeatures.of([(p, None) for p in params])).tokens.tolist()) == {10}
    state.set_mask(1, None)
    state.assign(2, params[2], 0, [])  # a new request starts without a mask
    assert step(logits, state, features).tokens[1:].tolist() == [10, 10]
    state.set_mask(0, pack_bits([], vocab))
    assert step(logits, state, features).valid.tolist() == [False, True, True]  # nothing allowed
    with pytest.raises(ValueError, match="mask"):
        state.set_mask(0, torch.zeros(2, dtype=torch.int32))


@pytest.mark.parametrize("slots", [[0, 1, 2, 3], [5, 1, 2, 7], [6]])
def test_masks_of_several_slots_go_to_theirs_alone(slots: list[int]) -> None:
    """SamplerState.set_masks: each slot takes its own row of the host bitmask (copied run by run), and the other
    slots keep what they had."""
    vocab = 70
    state = make_state([SamplingParams(temperature=0.0)] * 8, vocab, "cpu")
    bitmask = torch.stack([pack_bits([slot, 40 + slot], vocab) for slot in range(8)])
    state.set_mask(4, pack_bits([9], vocab))
    state.set_masks(slots, bitmask)
    for slot in range(8):
        expected = (
            bitmask[slot] if slot in slots else pack_bits([9], vocab) if slot == 4 else torch.full_like(bitmask[0], -1)
        )
        assert torch.equal(state.allowed[slot], expected), slot


# -- (i) no host synchronization ----------------------------------------------------------------------------------

ALL_FEATURES = SamplerFeatures(sampling=True, penalties=True, top_k=True, masks=True, top_logprobs=5)


def mixed_state(device: str, vocab: int) -> tuple[SamplerState, list[SamplingParams]]:
    params = [CHAT, SamplingParams(temperature=0.0, repetition_penalty=1.2), *OTHERS[1:4]]
    return make_state(params, vocab, device, prompt_ids=[1, 2, 3]), params


def test_sample_traces_into_one_graph() -> None:
    # dynamo with fullgraph=True fails on anything that needs the host: .item(), .tolist(), nonzero, a boolean mask
    # index, a data-dependent shape, a Python branch on a tensor's value.
    state, params = mixed_state("cpu", 300)
    slots, live = torch.arange(len(params)), torch.ones(len(params), dtype=torch.bool)
    logits = torch.randn(len(params), 300)
    compiled = torch.compile(sample, backend="eager", fullgraph=True)
    out = compiled(logits, state, slots, live, ALL_FEATURES)
    assert out.tokens.shape == (len(params),) and out.top_ids.shape == (len(params), 5)
    assert pack(out).shape == (len(params), PACKED_WIDTH)


@CUDA
def test_sample_replays_in_a_cuda_graph_as_it_runs_eagerly() -> None:
    vocab, steps = 32000, 6
    eager, params = mixed_state("cuda", vocab)
    graphed, _ = mixed_state("cuda", vocab)
    rows = len(params)
    slots = torch.arange(rows, device="cuda")
    live = torch.ones(rows, dtype=torch.bool, device="cuda")
    logits = torch.randn(steps, rows, vocab, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    static = logits[0].clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the graph, on a state the comparison does not use
        sample(static, mixed_state("cuda", vocab)[0], slots, live, ALL_FEATURES)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # records the kernels, runs none: `graphed` is still as assigned
        packed = pack(sample(static, graphed, slots, live, ALL_FEATURES))
    replayed, eagerly = [], []
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing call raises from here on
    try:
        for t in range(steps):
            static.copy_(logits[t])
            graph.replay()
            replayed.append(packed.clone())
            eagerly.append(pack(sample(logits[t], eager, slots, live, ALL_FEATURES)))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for t in range(steps):
        torch.testing.assert_close(replayed[t], eagerly[t], rtol=0, atol=0, msg=f"step {t}")
    assert torch.equal(graphed.counts, eager.counts) and torch.equal(graphed.counter, eager.counter)


# -- logprobs, packing, features ------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_come_from_the_raw_logits(device: str) -> None:
    logits = torch.randn(2, 100, generator=torch.Generator().manual_seed(4)).bfloat16()
    params = [SamplingParams(temperature=0.5, repetition_penalty=1.4), SamplingParams(temperature=0.0)]
    state = make_state(params, 100, device, prompt_ids=list(range(50)))
    out = step(logits, state, SamplerFeatures.of([(p, 4) for p in params]))
    reference = torch.log_softmax(logits.float(), -1)
    tokens = out.tokens.cpu()
    torch.testing.assert_close(out.logprob.cpu(), reference.gather(1, tokens[:, None])[:, 0])
    values, ids = reference.topk(4, -1)
    assert torch.equal(out.top_ids.cpu(), ids)
    torch.testing.assert_close(out.top_logprobs.cpu(), values)
    rows = pack(out).tolist()
    token, valid, logprob, top = unpack(rows[0], 4)
    assert (token, valid) == (tokens[0].item(), True)
    assert logprob == pytest.approx(out.logprob[0].item())
    assert [i for i, _ in top] == ids[0].tolist()
    assert unpack(rows[1], None) == (tokens[1].item(), True, None, ())


def test_features_of_a_batch() -> None:
    greedy = SamplingParams(temperature=0.0, top_k=5, top_p=0.5)
    assert SamplerFeatures.of([(greedy, None)]) == SamplerFeatures()  # greedy rows skip the filters
    assert SamplerFeatures.of([(CHAT, None), (greedy, None)]) == SamplerFeatures(filters=True)
    chat_k = SamplingParams(temperature=0.7, top_k=40)
    assert SamplerFeatures.of([(chat_k, 3), (greedy, None)]) == SamplerFeatures(top_k=True, top_logprobs=3)
    assert SamplerFeatures(top_k=True) == SamplerFeatures(sampling=True, filters=True, top_k=True)
    assert SamplerFeatures.of([(SamplingParams(temperature=0.0, frequency_penalty=1.0), 0)]) == SamplerFeatures(
        penalties=True, top_logprobs=0
    )
    with pytest.raises(ValueError):
        SamplerFeatures(top_logprobs=MAX_TOP_LOGPROBS + 1)


def test_bfloat16_logits_sample_as_their_float32_values() -> None:
    logits16 = torch.tensor(np.random.default_rng(2).normal(0.0, 2.0, size=(1, 64))).bfloat16()
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, repetition_penalty=1.1)
    features = SamplerFeatures.of([(params, None)])
    a, b = (make_state([params], 64, "cpu", seeds=[8], prompt_ids=[1]) for _ in range(2))
    assert [step(logits16, a, features).tokens.item() for _ in range(50)] == [
        step(logits16.float(), b, features).tokens.item() for _ in range(50)
    ]


def test_callers_logits_are_not_modified() -> None:
    logits = torch.tensor([[1.0, -2.0, 3.0, 0.5]])
    before = logits.clone()
    params = SamplingParams(temperature=0.5, top_k=3, repetition_penalty=1.5, presence_penalty=1.0)
    state = make_state([params], 4, "cpu", prompt_ids=[0, 1])
    step(logits, state, SamplerFeatures.of([(params, 2)]))
    probs_of(logits, state, SamplerFeatures.of([(params, 2)]))
    assert torch.equal(logits, before)


# -- the draw on the host (on_host) ------------------------------------------------------------------------------------


def test_the_draw_on_the_host_gives_the_tokens_of_the_radix_select(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the host (a CPU), rows with top-k / top-p draw from the tokens above a floor where the cut provably falls
    among them, a lower floor or the radix select otherwise, other rows by the inverse CDF in numpy: the tokens equal
    the graph-safe path's for every mix of settings, flat rows and peaked ones, with ties (rounded logits); each way
    runs (a top_p a hair below 1 needs tokens under every floor: the radix select)."""
    outcomes: set[str] = set()
    candidate_draw, radix = sampler.candidate_draw, sampler._draw

    def counted_candidates(*args: object) -> int | None:
        token = candidate_draw(*args)
        outcomes.add("covered" if token is not None else "not covered")
        return token

    def counted_radix(*args: torch.Tensor) -> torch.Tensor:
        outcomes.add("radix")
        return radix(*args)

    rows, vocab = 16, 4096
    settings = [
        SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)
        for t, k, p, m in [
            (0.3, 0, 0.9, 0.0), (0.7, 0, 0.9, 0.0), (1.0, 50, 1.0, 0.0), (1.5, 5, 0.5, 0.05), (0.7, 0, 1.0, 0.05),
            (1.0, 2000, 0.99, 0.0), (0.7, 64, 1.0, 0.0), (2.0, 0, 0.999, 0.0), (0.0, 0, 1.0, 0.0), (1.0, 0, 0.2, 0.0),
            (1.0, 0, 1 - 1e-9, 0.0),
        ]
    ]  # fmt: skip
    state = SamplerState(rows, vocab, "cpu")
    slots, live = torch.arange(rows), torch.zeros(rows, dtype=torch.bool)
    for spread in (1.0, 3.0, 8.0):
        generator = torch.Generator().manual_seed(int(spread))
        for trial in range(6):
            params = [settings[(trial + i) % len(settings)] for i in range(rows)]
            for slot, p in enumerate(params):
                state.assign(slot, p, 2**63 + 977 * trial + slot, [])
            logits = torch.randn(rows, vocab, generator=generator) * spread
            if trial % 2:
                logits = logits.round()  # ties, at the cuts too
            features = SamplerFeatures.of((p, None) for p in params)
            graph_safe = sample(logits, state, slots, live, features).tokens
            with monkeypatch.context() as patch:
                patch.setattr(sampler, "candidate_draw", counted_candidates)
                patch.setattr(sampler, "_draw", counted_radix)
                on_host = sample(logits, state, slots, live, features, on_host=True).tokens
            assert torch.equal(on_host, graph_safe)
    assert outcomes == {"covered", "not covered", "radix"}


@pytest.mark.parametrize(
    "params",
    [
        [SamplingParams(temperature=0.0)] * 6,
        [SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=1.0)] * 2
        + [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_p=0.9, min_p=0.05)],
    ],
    ids=["greedy", "sampled"],
)
def test_a_plain_step_on_the_host_gives_the_tensor_paths_output(params: list[SamplingParams]) -> None:
    """A step with no mask, penalty or logprobs on the host (numpy argmaxes, the host draw) gives the tensor path's
    tokens of the valid rows, validity and draw counters, greedy rows alone and sampled ones among greedy: ties to the
    lowest id, a NaN, +inf, a row all -inf, bfloat16 logits, padding rows left untouched."""
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(6, 300, generator=torch.Generator().manual_seed(3)) * 4).round().to(dtype)
        logits[1, 40] = torch.nan
        logits[2, [9, 200]] = torch.inf
        logits[3] = -torch.inf
        slots, live = torch.tensor([0, 1, 2, 3, 4, 4]), torch.tensor([True, True, True, True, True, False])
        outputs, counters = [], []
        for on_host in (False, True):
            state = make_state(params, 300, "cpu")
            features = SamplerFeatures.of((p, None) for p in params)
            outputs.append(sample(logits, state, slots, live, features, on_host=on_host))
            counters.append(state.counter.clone())
        tensor_path, host = outputs
        assert torch.equal(host.valid, tensor_path.valid)
        assert host.valid.tolist() == [True, False, False, False, True, True]
        # An invalid row's token means nothing (the engine ends its request); a greedy one's is still the argmax.
        assert torch.equal(host.tokens[host.valid], tensor_path.tokens[host.valid])
        assert torch.equal(counters[1], counters[0]) and counters[1][:5].tolist() == [1, 0, 0, 0, 1]


def test_cpu_maxima_equal_torch_max() -> None:
    """The CPU's row maxima (amax and numpy's argmax) give torch.max's values and first indices: ties, NaN, all -inf,
    +inf, bfloat16."""
    x = torch.randn(6, 300, generator=torch.Generator().manual_seed(5)).round()  # ties
    x[1, [7, 40]] = torch.nan
    x[2] = -torch.inf
    x[3, [9, 99]] = torch.inf
    for logits in (x, x.bfloat16()):
        values, ids = sampler._maxima(logits)
        expected = logits.max(1)
        assert torch.equal(ids, expected.indices)
        torch.testing.assert_close(values, expected.values, rtol=0, atol=0, equal_nan=True)


def test_cpu_penalties_touch_only_seen_tokens_and_equal_the_full_float32_computation() -> None:
    """The CPU path computes the penalties for the tokens a row has seen only; every logit must come out as the
    computation over the whole [rows, vocab] gives it, bit for bit (bfloat16 and float32 logits, overflow clamped)."""
    vocab = 5000
    generator = torch.Generator().manual_seed(3)
    state, slots = penalty_state(vocab, generator)
    counts = state.counts[slots]
    generated = (counts & (sampler_state.IN_PROMPT - 1)).float()
    for dtype in (torch.bfloat16, torch.float32):
        x = (torch.randn(len(slots), vocab, generator=generator) * 4).to(dtype)
        x[:, :6] = torch.tensor([3.0e38, -3.0e38, 0.0, -0.0, 1e-30, -torch.inf]).to(dtype)
        first_seen = counts.ne(0).int().argmax(1)
        x[torch.arange(len(slots)), first_seen] = 3.0e38  # slot 1's repetition penalty 0.8 pushes it past float32
        rep = state.repetition[slots][:, None]
        full = torch.where(counts != 0, torch.where(x < 0, x * rep, x / rep), x)
        full = full - (state.frequency[slots][:, None] * generated + state.presence[slots][:, None] * (generated > 0))
        full = full.clamp_(max=torch.finfo(torch.float32).max)
        got = sampler._penalized(x, state, slots)
        assert got.dtype == torch.float32
        assert torch.equal(got.view(torch.int32), full.view(torch.int32))


def test_one_rows_uniform_number_in_python_integers_is_the_tensors() -> None:
    """draw_bits_of (the host draw's, one row in Python integers) gives draw_bits. number for any stream and
    counter, the wrap-around of int64 arithmetic included."""
    generator = np.random.default_rng(3)
    streams = generator.integers(-(2**63), 2**63 - 1, size=500, dtype=np.int64)
    counters = generator.integers(0, 2**40, size=500, dtype=np.int64)
    expected = seeded_draws.draw_bits(streams, counters).tolist()
    assert [seeded_draws.draw_bits_of(int(s), int(c)) for s, c in zip(streams, counters, strict=True)] == expected
