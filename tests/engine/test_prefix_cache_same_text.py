"""A cached prefix gives a request the tokens of a fresh run (issue 30). First the rules that make it so, without a
model: the scheduler keeps prompt chunks and cache hits to the runner's uniform_rows (scheduler.py), and llama.cpp's
prompt cache prefers a prefix computed alone (prompt_cache.py). Then the demo model: chat requests sharing a system
prompt of about 1,500 tokens, run one at a time, generate the same greedy tokens with the same log-probabilities with
the prefix cache on and off, on both runtimes, in the default configuration (the demo's int4 weights kept on torch).
Their length leaves a fresh run's last 512-token chunk short (20 tokens), so both of the scheduler's rules count: the
last chunk is not left short, and a cache hit leaves enough of the prompt to compute."""

from pathlib import Path

import pytest
from conftest import RUNTIMES, executed

from rbee_worker.benchmark.run import TEXT
from rbee_worker.engine.engine import Engine
from rbee_worker.engine.engine_config import EngineConfig
from rbee_worker.engine.plan import Output, Plan, Sequence
from rbee_worker.engine.request_types import End, Request, Token
from rbee_worker.engine.runners.llama_cpp.prompt_cache import PromptCache
from rbee_worker.engine.runners.protocol import Capabilities, KvGeometry
from rbee_worker.engine.sampling.sampling_params import SamplingParams
from rbee_worker.engine.scheduling.scheduler import Scheduler
from rbee_worker.hardware.devices import resolve_placement
from rbee_worker.loading.loader import load_model

# --- the rules ------------------------------------------------------------------------------------------------------


def scheduler(uniform_rows: int, **config: object) -> Scheduler:
    settings = EngineConfig(**{"prefill_chunk": 64, "block_size": 4, **config})  # type: ignore[arg-type]
    return Scheduler(settings, Capabilities(False, uniform_rows), KvGeometry(256, 4, 1024, 1))


def add(s: Scheduler, name: str, prompt: list[int]) -> Sequence:
    request = Request(tuple(prompt), max_tokens=4, request_id=name)
    sequence = Sequence(request, 7, Output(lambda _: None, None))  # type: ignore[arg-type] -- no text here
    s.add(sequence)
    return sequence


def chunks(s: Scheduler) -> list[tuple[str, int, int]]:
    """One round, carried out as a step would: its chunks (request, start, count)."""
    plan: Plan = s.schedule()
    s.update(executed(plan))
    return [(c.sequence.request_id, c.start, c.count) for f in plan.forwards for c in f.chunks]


def test_the_last_chunk_is_not_left_short_of_uniform_rows() -> None:
    s = scheduler(uniform_rows=16)
    add(s, "a", list(range(70)))  # 64 + 6 would leave 6: 54 + 16
    assert chunks(s) == [("a", 0, 54)] and chunks(s) == [("a", 54, 16)]
    plain = scheduler(uniform_rows=1)
    add(plain, "a", list(range(70)))
    assert chunks(plain) == [("a", 0, 64)] and chunks(plain) == [("a", 64, 6)]


def test_a_chunk_that_the_budget_cuts_short_waits_and_looks_up_when_it_runs() -> None:
    """b would get what a leaves of the round's budget (4 tokens): it waits for the next round, and only then looks
    up its prefix, which a has cached by then."""
    s = scheduler(uniform_rows=16)
    add(s, "a", list(range(60)))
    add(s, "b", [*range(56), 99, 98, 97, 96])
    assert chunks(s) == [("a", 0, 60)]
    assert chunks(s) == [("b", 44, 16)]  # a's 56 shared tokens, cut back to leave 16 (and to whole blocks)
    assert s.get("b").cached_prompt_tokens == 44


def test_a_cache_hit_leaves_uniform_rows_to_compute() -> None:
    s = scheduler(uniform_rows=16)
    add(s, "a", list(range(40)))
    chunks(s)
    add(s, "b", list(range(40)))  # all of it cached but the last token, without the rule
    assert chunks(s) == [("b", 24, 16)]
    add(s, "c", list(range(12)))  # shorter than uniform_rows: nothing reused
    assert chunks(s) == [("c", 0, 12)]


def test_deterministic_mode_keeps_its_own_rules() -> None:
    s = scheduler(uniform_rows=16, deterministic=True)
    add(s, "a", list(range(70)))
    assert chunks(s) == [("a", 0, 64)] and chunks(s) == [("a", 64, 6)]


def test_the_prompt_cache_prefers_an_exact_prefix_among_equally_long_ones() -> None:
    cache = PromptCache(budget_bytes=100)
    cache.insert([1, 2, 3, 4, 5], bytearray(10), exact=2)  # computed beside other sequences from position 2
    cache.insert([1, 2, 3, 4, 6], bytearray(10))  # computed alone
    cache.insert([1, 2, 3, 4, 7], bytearray(10), exact=3)
    assert cache.longest([1, 2, 3, 4, 9]) == (4, (1, 2, 3, 4, 6)) and cache.exact((1, 2, 3, 4, 6)) == 5
    assert cache.longest([1, 2, 3, 4, 5]) == (5, (1, 2, 3, 4, 5))  # a longer prefix first, exact or not


# --- the demo model ---------------------------------------------------------------------------------------------------

QUESTIONS = [f"Question {i}: in one sentence, what is item {i} of the story about?" for i in range(3)]
PROMPT_TOKENS = 1556  # 3 whole chunks of 512 and 20 tokens


def make_engine(demo_gguf: Path, runtime: str, prefix_caching: bool) -> Engine:
    return Engine(
        lambda: load_model(str(demo_gguf), resolve_placement("cpu", "auto"), quantize="auto", runtime=runtime),
        EngineConfig(max_batch=4, threads=2, kv_cache_bytes=256 << 20, prefix_caching=prefix_caching),
    )


def chat_requests(engine: Engine) -> list[Request]:
    """The questions after one system prompt, whose length makes every prompt PROMPT_TOKENS tokens long."""

    def prompt(system_tokens: int, question: str) -> tuple[int, ...]:
        system = engine.loaded.tokenizer.decode(engine.model.tokenize(" ".join([TEXT] * 30), False)[:system_tokens])
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        return engine.model.tokenize_chat(messages)

    overhead = len(prompt(100, QUESTIONS[0])) - 100
    prompts = [prompt(PROMPT_TOKENS - overhead, q) for q in QUESTIONS]
    assert [len(p) for p in prompts] == [PROMPT_TOKENS] * 3
    greedy = SamplingParams(temperature=0.0)
    return [Request(p, max_tokens=16, sampling=greedy, seed=7, logprobs=0, ignore_eos=True) for p in prompts]


def run(engine: Engine, request: Request) -> tuple[list[tuple[int, float]], End]:
    """The request alone: each generated token with its log-probability, and its End."""
    events = list(engine.stream(request))
    assert isinstance(events[-1], End), events[-1]
    tokens = [(p.token_id, p.logprob) for e in events if isinstance(e, Token) for p in e.logprobs]
    return tokens, events[-1]


@pytest.mark.slow
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_cached_system_prompt_gives_the_fresh_tokens(demo_gguf: Path, runtime: str) -> None:
    engine = make_engine(demo_gguf, runtime, prefix_caching=True)
    try:
        requests = chat_requests(engine)
        rows = engine._runner.capabilities.uniform_rows
        run(engine, requests[0])  # its state (llama.cpp) or blocks (torch) serve the others' system prompt
        cached = [run(engine, r) for r in requests[1:]]
    finally:
        engine.close()
    for _, end in cached:
        assert 1000 < end.cached_tokens <= PROMPT_TOKENS - rows
    fresh_engine = make_engine(demo_gguf, runtime, prefix_caching=False)
    try:
        fresh = [run(fresh_engine, r) for r in requests[1:]]
    finally:
        fresh_engine.close()
    # The same greedy tokens with the same log-probabilities: every step's logits are the same.
    assert [tokens for tokens, _ in cached] == [tokens for tokens, _ in fresh]
