"""The paged KV cache on the real demo model (torch, float32, CPU): requests preempted when the block pool runs out
read their tokens again and go on exactly as alone, and a prompt's cached prefix gives the tokens that computing it
would. Greedy and float32, so that batching's different rounding cannot flip a near tie."""

import queue
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import engine_config

from rbee_worker.engine.engine import Engine
from rbee_worker.engine.request_types import End, Error, Event, PromptLogprobs, Request, Token
from rbee_worker.engine.sampling.sampling_params import SamplingParams
from rbee_worker.hardware.devices import resolve_placement
from rbee_worker.loading.loader import load_model

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0)
PER_TOKEN = 2 * 30 * 3 * 64 * 4  # the demo model's float32 keys and values of one token, all layers
BLOCK = 16
POOL_BLOCKS = 18  # 288 positions: two requests of 136 fit at once, four do not

OPENINGS = [
    "Lighthouses were once tended by keepers who lived beside the lamp",
    "Bread rises because yeast turns sugar into gas that the dough traps",
    "Rivers carve valleys over thousands of years, carrying sand and stones",
    "Chess began in India as a game of four armies called chaturanga",
]
SYSTEM = (
    "You are a patient tutor for a school in a small coastal town. Answer in plain words, give one example, and "
    "never use more than three sentences. If a question is unclear, say what you would need to know. "
)


def engine_of(path: Path, **config: object) -> Engine:
    """One CPU thread: on a machine shared with other work, more threads mostly wait for each other."""
    return Engine(
        lambda: load_model(str(path), resolve_placement("cpu", "float32")),
        engine_config(**{"max_batch": 4, "block_size": BLOCK, "threads": 1, **config}),
    )


@pytest.fixture(scope="module")
def small_pool(demo_gguf: Path) -> Iterator[Engine]:
    """Prefix caching on (the default), and a pool of POOL_BLOCKS blocks of BLOCK positions."""
    engine = engine_of(demo_gguf, kv_cache_bytes=(POOL_BLOCKS + 1) * BLOCK * PER_TOKEN)  # + 1: the scratch block
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def uncached(demo_gguf: Path) -> Iterator[Engine]:
    """Prefix caching off."""
    engine = engine_of(demo_gguf, prefix_caching=False)
    yield engine
    engine.close()


def run_together(engine: Engine, requests: list[Request]) -> list[tuple[list[int], End]]:
    """Submit every request at once; each one's token ids and its End (an Error fails the test)."""
    streams: list[queue.SimpleQueue[Event]] = [queue.SimpleQueue() for _ in requests]
    for request, events in zip(requests, streams, strict=True):
        engine.submit(request, events.put)
    results = []
    for events in streams:
        ids: list[int] = []
        while not isinstance(event := events.get(timeout=300), End | Error):
            if isinstance(event, Token):
                ids.extend(event.token_ids)
        assert isinstance(event, End), event
        results.append((ids, event))
    return results


def run(engine: Engine, request: Request) -> tuple[list[int], End]:
    return run_together(engine, [request])[0]


def test_requests_preempted_by_a_full_pool_read_their_tokens_again_and_match_their_solo_runs(
    small_pool: Engine,
) -> None:
    """Four greedy requests of 96 prompt tokens and 24 output tokens each (8 blocks of 16) at once in a pool of 18
    blocks: the newer ones are preempted and recompute their prompt and output later, and every request ends (no
    error) with exactly the tokens of its solo run: none lost, none repeated."""
    engine = small_pool
    prompts = [engine.model.tokenize(f"{text}. {text.lower()}, and so on. " * 5)[:96] for text in OPENINGS]
    assert all(len(p) == 96 for p in prompts) and len({p[:BLOCK] for p in prompts}) == len(prompts)
    requests = [Request(p, max_tokens=24, sampling=GREEDY, ignore_eos=True) for p in prompts]
    solo = [run(engine, r)[0] for r in requests]
    assert engine.preemptions == 0 and all(len(ids) == 24 for ids in solo)
    together = run_together(engine, requests)
    assert engine.preemptions > 0
    assert [ids for ids, _ in together] == solo
    assert all(end.tokens_out == 24 for _, end in together)
    assert engine.kv_cache_usage() == 0  # every block back in the pool


def test_a_cached_prefix_gives_the_tokens_that_computing_it_would(small_pool: Engine, uncached: Engine) -> None:
    """A request with a long system prompt run twice: the second run finds its prompt's first blocks in the prefix
    cache (End.cached_tokens: whole blocks, never the whole prompt) and gives the same greedy tokens; another question
    after the same system prompt finds the shared blocks and gives the tokens of an engine without prefix caching,
    which reports no cached tokens."""
    first = Request(
        small_pool.model.tokenize(SYSTEM + "Question: why is the sea salty?"), max_tokens=12, sampling=GREEDY
    )
    second = Request(small_pool.model.tokenize(SYSTEM + "Question: how do tides work?"), max_tokens=12, sampling=GREEDY)
    shared = next(i for i, (a, b) in enumerate(zip(first.prompt_ids, second.prompt_ids, strict=False)) if a != b)
    assert shared >= 2 * BLOCK
    reference = [run(uncached, r) for r in (first, second, first)]
    assert [end.cached_tokens for _, end in reference] == [0, 0, 0]
    assert reference[0][0] == reference[2][0]

    ids, end = run(small_pool, first)
    assert end.cached_tokens == 0 and ids == reference[0][0]
    ids, end = run(small_pool, first)
    assert ids == reference[0][0]
    assert 0 < end.cached_tokens < len(first.prompt_ids) and end.cached_tokens % BLOCK == 0
    assert end.cached_tokens == (len(first.prompt_ids) - 1) // BLOCK * BLOCK  # all its whole blocks but the last token
    ids, end = run(small_pool, second)
    assert ids == reference[1][0]
    assert end.cached_tokens == shared // BLOCK * BLOCK


def test_prompt_logprobs_are_transformers_own_among_preempted_requests_and_skip_the_prefix_cache(
    small_pool: Engine, demo_hf_dir: Path
) -> None:
    """Four requests of 96, 90, 84 and 78 prompt tokens asking for their prompts' logprobs (the last for nothing
    else: max_tokens 0) at once in the small pool, their prompts computed before in the same engine (so cached):
    each prompt's logprobs, ranks and top 2 are transformers' log-softmax over one forward of the prompt (float32,
    within 1e-4), though the prompts share forwards (padded to the longest), requests are preempted and read their
    tokens again, and the prefix cache holds their prompts (unused: cached_tokens 0); the generating ones give their
    solo tokens, the last none."""
    import torch
    from transformers import AutoModelForCausalLM

    engine = small_pool
    sizes = (96, 90, 84, 78)
    prompts = [engine.model.tokenize(f"{text}. {text.lower()}, and so on. " * 5)[:size] for text, size in
               zip(OPENINGS, sizes, strict=True)]  # fmt: skip
    solo = [run(engine, Request(p, max_tokens=24, sampling=GREEDY, ignore_eos=True))[0] for p in prompts]
    preempted = engine.preemptions
    requests = [
        Request(p, max_tokens=0 if i == 3 else 24, sampling=GREEDY, ignore_eos=True, prompt_logprobs=2)
        for i, p in enumerate(prompts)
    ]
    streams: list[queue.SimpleQueue[Event]] = [queue.SimpleQueue() for _ in requests]
    for request, events in zip(requests, streams, strict=True):
        engine.submit(request, events.put)
    outcomes = []
    for events in streams:
        received = [events.get(timeout=300)]
        while not isinstance(received[-1], End | Error):
            received.append(events.get(timeout=300))
        outcomes.append(received)
    assert engine.preemptions > preempted

    model = AutoModelForCausalLM.from_pretrained(demo_hf_dir, dtype=torch.float32)
    for i, (prompt, received) in enumerate(zip(prompts, outcomes, strict=True)):
        [scored] = [e for e in received if isinstance(e, PromptLogprobs)]
        assert received.index(scored) == 1  # after Started, before any token
        end = received[-1]
        assert isinstance(end, End) and end.cached_tokens == 0
        assert [t for e in received if isinstance(e, Token) for t in e.token_ids] == ([] if i == 3 else solo[i])
        with torch.no_grad():
            reference = torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)
        targets = torch.tensor(prompt[1:])
        expected = reference.gather(1, targets[:, None]).squeeze(1)
        assert [lp.token_id for lp in scored.logprobs] == list(prompt[1:])
        got = torch.tensor([lp.logprob for lp in scored.logprobs])
        assert (got - expected).abs().max() < 1e-4
        ranks = (reference > expected[:, None]).sum(1) + 1  # far down the list near ties swap: ranks within 1%
        assert all(abs(lp.rank - r) <= r // 100 for lp, r in zip(scored.logprobs, ranks.tolist(), strict=True))
        assert [lp.rank for lp in scored.logprobs if lp.rank <= 10] == [r for r in ranks.tolist() if r <= 10]
        top = reference.topk(2, dim=-1)
        assert [[t for t, _ in lp.top] for lp in scored.logprobs] == top.indices.tolist()
