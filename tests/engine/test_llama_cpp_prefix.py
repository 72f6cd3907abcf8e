"""Prefix reuse on llama.cpp's runtime (engine/runners/llama_cpp/llama_cpp_runner.py with
engine/runners/llama_cpp/prompt_cache.py): ended requests' states saved in host memory and restored for a later prompt
sharing their prefix, running requests' cells shared, and what holds with it: `--deterministic` requests get a fresh
engine's tokens (seeded sampling included) whatever ran before and runs beside them, and preemption loses nothing. Unit
tests of the cache first, then the demo model."""

import queue
from pathlib import Path

import pytest
from conftest import engine_config, submit_together

from rbee_worker.engine.engine import Engine
from rbee_worker.engine.request_types import End, Error, Request, Token
from rbee_worker.engine.runners.llama_cpp.prompt_cache import PromptCache
from rbee_worker.engine.sampling.sampling_params import SamplingParams
from rbee_worker.engine.scheduling.kv_blocks import common_prefix
from rbee_worker.hardware.devices import resolve_placement
from rbee_worker.loading.loader import load_model

# --- the cache --------------------------------------------------------------------------------------------------------


def test_common_prefix_across_the_compare_stride() -> None:
    a = list(range(300))
    assert common_prefix(a, a) == 300
    assert common_prefix(a, a[:130]) == 130
    assert common_prefix(a, [*a[:200], -1, *a[201:]]) == 200
    assert common_prefix(a, [-1]) == 0 and common_prefix([], a) == 0


def test_longest_prefix_wins_and_is_refreshed() -> None:
    cache = PromptCache(budget_bytes=100)
    cache.insert([1, 2, 3, 4], bytearray(10))
    cache.insert([1, 2, 9], bytearray(10))
    cache.insert([7, 8], bytearray(10))
    assert cache.longest([1, 2, 3, 5]) == (3, (1, 2, 3, 4))
    assert cache.longest([1, 2, 9, 9]) == (3, (1, 2, 9))
    assert cache.longest([5]) == (0, None)
    cache.take((1, 2, 3, 4))  # now the most recently used: the others go first
    cache.insert([6], bytearray(85))
    assert cache.longest([1, 2, 9]) == (2, (1, 2, 3, 4)) and cache.longest([7, 8]) == (0, None)
    assert cache.longest([1, 2, 3, 4]) == (4, (1, 2, 3, 4)) and cache.bytes == 95


def test_extensions_replace_and_covered_tokens_are_not_saved_twice() -> None:
    cache = PromptCache(budget_bytes=1000)
    cache.insert([1, 2], bytearray(10))
    cache.insert([1, 2, 3, 4], bytearray(20))  # a next turn: the shorter entry is redundant
    assert len(cache) == 1 and cache.bytes == 20
    assert cache.covers([1, 2, 3]) and cache.covers([1, 2, 3, 4]) and not cache.covers([1, 2, 5])
    cache.insert([9], bytearray(2000))  # larger than the whole budget: not kept, nothing dropped
    assert len(cache) == 1 and cache.bytes == 20


# --- the demo model ---------------------------------------------------------------------------------------------------

SYSTEM = (
    "You are the reference desk of a small library by the sea. The library opens at nine on weekdays and at ten on "
    "Saturdays, and it is closed on Sundays. Members borrow up to six books for three weeks and may renew twice. "
    "Late books cost ten cents a day; children's books cost nothing. Answer briefly and exactly. "
) * 3
QUESTIONS = ["When does the library open on Saturday?", "How many books may I borrow?", "What does a late book cost?"]
SAMPLED = SamplingParams(temperature=0.8, top_p=0.95)


def make_engine(demo_gguf: Path, **config: object) -> Engine:
    settings = {"max_batch": 4, "threads": 2, **config}
    return Engine(
        lambda: load_model(str(demo_gguf), resolve_placement("cpu", "auto"), runtime="llama.cpp"),
        engine_config(**settings),
    )


def ask(engine: Engine, question: str, sampling: SamplingParams = SAMPLED, max_tokens: int = 16) -> Request:
    return Request(engine.model.tokenize(SYSTEM + question), max_tokens=max_tokens, sampling=sampling, seed=2**63 + 5)


def run(engine: Engine, request: Request) -> tuple[list[int], End]:
    events = list(engine.stream(request))
    assert isinstance(events[-1], End), events[-1]
    return [i for e in events if isinstance(e, Token) for i in e.token_ids], events[-1]


@pytest.mark.slow
def test_prompts_restored_from_ended_requests(demo_gguf: Path) -> None:
    """Requests sharing a system prompt, one after another: each later one restores the longest saved prefix (an
    ended request's state), computes only the rest and reports the prefix cached; a repeated request finds all of its
    prompt but the last UNIFORM_ROWS tokens."""
    from rbee_worker.engine.runners.llama_cpp.llama_cpp_runner import UNIFORM_ROWS

    engine = make_engine(demo_gguf)
    try:
        prompt = ask(engine, QUESTIONS[0]).prompt_ids
        shared = common_prefix(prompt, ask(engine, QUESTIONS[1]).prompt_ids)
        for i, question in enumerate(QUESTIONS):
            request = ask(engine, question)
            tokens, end = run(engine, request)  # at least UNIFORM_ROWS tokens are left to compute (scheduler.py)
            found = min(shared, len(request.prompt_ids) - UNIFORM_ROWS)
            assert tokens and end.cached_tokens == (0 if i == 0 else found)
        tokens, end = run(engine, ask(engine, QUESTIONS[0]))
        assert tokens and end.cached_tokens == len(prompt) - UNIFORM_ROWS
    finally:
        engine.close()


@pytest.mark.slow
def test_a_running_request_gives_its_prefix_cells(demo_gguf: Path) -> None:
    """A request arriving while another with the same system prompt decodes shares that one's cells for the prefix
    (a unified pool): the second reports the prefix cached though nothing has ended, and both complete."""
    from rbee_worker.engine.runners.llama_cpp.llama_cpp_runner import UNIFORM_ROWS

    engine = make_engine(demo_gguf)
    try:
        first, second = ask(engine, QUESTIONS[0], max_tokens=48), ask(engine, QUESTIONS[1], max_tokens=8)
        first = Request(first.prompt_ids, max_tokens=48, sampling=first.sampling, seed=first.seed, ignore_eos=True)
        events: queue.SimpleQueue = queue.SimpleQueue()
        engine.submit(first, events.put)
        while not isinstance(event := events.get(timeout=120), Token):  # the first decodes
            assert not isinstance(event, End | Error), event
        tokens, end = run(engine, second)
        shared = min(common_prefix(first.prompt_ids, second.prompt_ids), len(second.prompt_ids) - UNIFORM_ROWS)
        assert tokens and end.cached_tokens == shared > 0
        while not isinstance(event := events.get(timeout=120), End | Error):
            pass
        assert isinstance(event, End) and event.tokens_out == 48
    finally:
        engine.close()


@pytest.mark.slow
def test_deterministic_reuse_keeps_every_request_its_solo_tokens(demo_gguf: Path) -> None:
    """--deterministic with the cache on: requests sharing a system prompt, submitted together after one has run,
    restore whole prompt chunks only, and every one gets the tokens it gets alone in a fresh engine."""
    settings = {"deterministic": True, "prefill_chunk": 64}
    alone = make_engine(demo_gguf, prefix_caching=False, **settings)
    try:
        requests = [ask(alone, q, max_tokens=24) for q in QUESTIONS * 2]
        expected = [run(alone, r)[0] for r in requests]
    finally:
        alone.close()
    engine = make_engine(demo_gguf, **settings)
    try:
        tokens, end = run(engine, requests[0])
        assert tokens == expected[0] and end.cached_tokens == 0
        tokens, end = run(engine, requests[1])
        assert tokens == expected[1] and end.cached_tokens > 0 and end.cached_tokens % 64 == 0
        assert submit_together(engine, requests) == expected
        saved = [len(tokens) for tokens in engine._runner.prompts._entries]
        assert saved and all(n % 64 == 0 for n in saved)  # whole chunks of prompts only
    finally:
        engine.close()


@pytest.mark.slow
def test_preempted_requests_reusing_prefixes_all_complete(demo_gguf: Path) -> None:
    """A pool too small for the traffic (unified): requests sharing a system prompt are preempted, restore or share
    their prefixes again, and every one generates all of its tokens."""
    per_token = native_kv_bytes_per_token(demo_gguf)
    engine = make_engine(demo_gguf, kv_cache_bytes=36 * 16 * per_token)
    try:
        requests = [
            Request(r.prompt_ids, max_tokens=24, sampling=r.sampling, seed=r.seed, ignore_eos=True)
            for r in (ask(engine, q) for q in QUESTIONS * 2)
        ]
        streams = [queue.SimpleQueue() for _ in requests]
        for request, events in zip(requests, streams, strict=True):
            engine.submit(request, events.put)
        ends = []
        for events in streams:
            while not isinstance(event := events.get(timeout=300), End | Error):
                pass
            ends.append(event)
        assert all(isinstance(e, End) and e.tokens_out == 24 for e in ends), ends
        assert engine.preemptions > 0 and any(e.cached_tokens > 0 for e in ends)
    finally:
        engine.close()


def native_kv_bytes_per_token(demo_gguf: Path) -> int:
    from rbee_worker.loading.loaded import LoadedModel

    loaded: LoadedModel = load_model(str(demo_gguf), resolve_placement("cpu", "auto"), runtime="llama.cpp")
    try:
        return loaded.model.kv_bytes_per_token  # type: ignore[attr-defined]
    finally:
        loaded.model.close()  # type: ignore[attr-defined]
