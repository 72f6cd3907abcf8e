"""The prefix cache and the KV block pool as the APIs report them: `usage.prompt_tokens_details.cached_tokens` in the
OpenAI API (non-streamed and in the streamed usage chunk), `cached_tokens` in the native `end` event, and the
counters `rbee:prefix_cache_queries_total`, `rbee:prefix_cache_hits_total` and `rbee:num_preemptions_total` on
/metrics. Unit tests on fakes, then a real worker on the demo model (the torch runtime, which shares KV blocks between
requests), with and without --no-prefix-cache, and on llama.cpp, whose own cache finds the prefix."""

import asyncio
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest
from conftest import needs_llama_cpp
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from serving import Worker, execute, running

from rbee_worker.api.choices import Generation, stream_chunks, usage
from rbee_worker.api.metrics import Metrics
from rbee_worker.api.native import event_json
from rbee_worker.api.openai_schema import Usage
from rbee_worker.engine.request_types import End, Event, StopReason, Token
from rbee_worker.engine.structured.grammar import GrammarStats

BLOCK_SIZE = 16  # --block-size's default

# A system prompt of about 300 tokens on the demo's tokenizer: many whole blocks for the prefix cache.
SYSTEM = " ".join(
    [
        "You are a careful assistant for a small library in a seaside village.",
        "You answer questions about opening hours, lending rules, late fees and the reading room.",
        "The library opens at nine in the morning and closes at six in the evening on weekdays.",
        "On Saturdays it opens at ten and closes at two; on Sundays and public holidays it is closed.",
        "Members may borrow up to six books at once for three weeks, and renew each book twice.",
        "A late book costs ten cents a day, up to the price of the book; children's books have no late fee.",
        "The reading room is quiet: no phone calls, no food, and drinks only in closed bottles.",
        "Visitors without a card may read in the library but not borrow; a card is free for residents.",
        "Keep every answer short, friendly and exact, and say so when you do not know.",
    ]
    * 2
)
QUESTION = "When does the library open on Saturday?"
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]


def end_event(cached_tokens: int, prompt_tokens: int = 40, tokens_out: int = 5) -> End:
    return End(
        request_id="r",
        stop_reason=StopReason.MAX_TOKENS,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        tokens_out=tokens_out,
        seed=7,
        stop_sequence=None,
        time_to_first_token_s=0.01,
        decode_time_s=0.02,
        kv_cache_bytes=1024,
    )


# --- unit tests -------------------------------------------------------------------------------------------------------


def test_usage_has_openais_prompt_tokens_details() -> None:
    body = usage([end_event(cached_tokens=32)])
    assert body == {
        "prompt_tokens": 40,
        "completion_tokens": 5,
        "total_tokens": 45,
        "prompt_tokens_details": {"cached_tokens": 32},
    }
    assert Usage.model_validate(body).prompt_tokens_details.cached_tokens == 32
    # The official client's own model of it reads the field.
    assert openai.types.CompletionUsage.model_validate(body).prompt_tokens_details.cached_tokens == 32
    assert usage([end_event(cached_tokens=0)])["prompt_tokens_details"] == {"cached_tokens": 0}


def test_usage_schema_documents_cached_tokens() -> None:
    schema = Usage.model_json_schema()
    assert "prompt_tokens_details" in schema["required"]
    details = schema["$defs"]["PromptTokensDetails"]
    assert details["properties"]["cached_tokens"]["type"] == "integer"


async def fake_events(*events: Event) -> AsyncIterator[Event]:
    for event in events:
        yield event


def streamed(include_usage: bool) -> list[str]:
    events = fake_events(Token("r", "Hi", (5,), 0), end_event(cached_tokens=16))

    def chunk(index: int, piece: Generation, end: End | None) -> dict:
        finish = None if end is None else "stop"
        return {"id": "x", "choices": [{"index": 0, "text": "".join(piece.text), "finish_reason": finish}]}

    async def read() -> list[str]:
        return [line async for line in stream_chunks([events], chunk, usage if include_usage else None, first=None)]

    return asyncio.run(read())


def test_streamed_usage_chunk_has_cached_tokens() -> None:
    import json

    lines = streamed(include_usage=True)
    assert lines[-1] == "data: [DONE]\n\n"
    last = json.loads(lines[-2].removeprefix("data: "))
    assert last["choices"] == [] and last["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}
    assert all(json.loads(line.removeprefix("data: "))["usage"] is None for line in lines[:-2])
    assert not any("prompt_tokens_details" in line for line in streamed(include_usage=False))


def test_native_end_event_has_cached_tokens() -> None:
    end = event_json(end_event(cached_tokens=48, prompt_tokens=60), "job", "model")
    assert end["type"] == "end" and end["cached_tokens"] == 48 and end["prompt_tokens"] == 60
    assert set(end) == {"type", "tokens_out", "prompt_tokens", "cached_tokens", "decode_time_ms", "stop_reason", "seed"}


def fake_engine(**overrides: Any) -> SimpleNamespace:
    """What the metrics collector reads of an Engine, loaded."""
    engine = SimpleNamespace(
        running_requests=1,
        in_flight=3,
        is_loaded=True,
        loaded=SimpleNamespace(info=SimpleNamespace(weight_bytes=100)),
        preemptions=0,
        kv_cache_usage=lambda: 0.25,
        kv_cache_bytes=lambda: 200,
        prompt_cache_bytes=lambda: 0,
        prefix_cache_tokens=lambda: (0, 0),
        model=SimpleNamespace(grammars=SimpleNamespace(stats=GrammarStats())),
    )
    for name, value in overrides.items():
        setattr(engine, name, value)
    return engine


def scrape(metrics: Metrics) -> dict[str, tuple[str, dict[tuple, float]]]:
    """Each family's type and its samples' values by (name, labels)."""
    text = generate_latest(metrics.registry).decode()
    return {
        family.name: (family.type, {(s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples})
        for family in text_string_to_metric_families(text)
    }


def test_prefix_cache_and_preemption_counters_are_read_at_each_scrape() -> None:
    engine = fake_engine()
    metrics = Metrics()
    metrics.watch(engine, lambda: "served-name")
    label = (("model_name", "served-name"),)
    names = ("rbee:prefix_cache_queries", "rbee:prefix_cache_hits", "rbee:num_preemptions")
    families = scrape(metrics)
    for name in names:
        assert families[name] == ("counter", {(f"{name}_total", label): 0.0}), name
    engine.prefix_cache_tokens = lambda: (640, 512)
    engine.preemptions = 3
    families = scrape(metrics)
    assert [families[name][1][(f"{name}_total", label)] for name in names] == [640, 512, 3]
    assert families["rbee:kv_cache_usage_perc"] == ("gauge", {("rbee:kv_cache_usage_perc", label): 0.25})


def test_kv_cache_usage_help_speaks_of_blocks() -> None:
    metrics = Metrics()
    metrics.watch(fake_engine(), lambda: "m")
    text = generate_latest(metrics.registry).decode()
    [help_line] = [line for line in text.splitlines() if line.startswith("# HELP rbee:kv_cache_usage_perc ")]
    assert "blocks" in help_line
    assert "# TYPE rbee:prefix_cache_hits_total counter" in text


# --- a real worker ----------------------------------------------------------------------------------------------------


# The torch runtime in float32 throughout: the demo's int4 kernels compute in bfloat16, and a long prompt chunk's
# products run on dequantized matrices, so there a prompt computed whole and its last tokens computed after a cached
# prefix round differently, and a greedy near-tie may go either way; in float32 both give the same logits.
FLAGS = ("--runtime", "torch", "--quantize", "none", "--dtype", "float32")


@pytest.fixture(scope="module")
def cached_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    with running(tmp_path_factory.mktemp("prefix-cache"), *FLAGS, fork=True) as worker:
        yield worker


def client_of(worker: Worker) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0, timeout=120)


def ask(client: openai.OpenAI) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(model="demo", messages=MESSAGES, temperature=0, max_tokens=16)


def counters(worker: Worker) -> dict[str, float]:
    text = httpx.get(f"{worker.url}/metrics", timeout=30).text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.mark.slow
def test_a_repeated_prompt_is_found_in_the_prefix_cache(cached_worker: Worker) -> None:
    client = client_of(cached_worker)
    prompt_tokens = httpx.post(f"{cached_worker.url}/tokenize", json={"messages": MESSAGES}, timeout=30).json()["count"]
    assert prompt_tokens > 250
    first, second = ask(client), ask(client)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens == prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # a fresh worker
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached <= prompt_tokens - 1 and cached % BLOCK_SIZE == 0, cached
    assert cached >= prompt_tokens - 2 * BLOCK_SIZE  # the prompts differ nowhere: all but the last blocks are found
    assert second.choices[0].message.content == first.choices[0].message.content

    # Streamed, the usage chunk reports it too.
    chunks = list(
        client.chat.completions.create(
            model="demo",
            messages=MESSAGES,
            temperature=0,
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == first.choices[0].message.content

    # The native API's end event, for a raw prompt sent twice.
    with httpx.Client(base_url=cached_worker.url, timeout=120) as http:
        native = [execute(http, prompt=SYSTEM, max_tokens=4, temperature=0).terminal for _ in range(2)]
    assert [end["type"] for end in native] == ["end", "end"]
    assert native[1]["cached_tokens"] % BLOCK_SIZE == 0
    assert 0 < native[1]["cached_tokens"] < native[1]["prompt_tokens"]

    found = counters(cached_worker)
    assert found["rbee:prefix_cache_hits_total"] >= 2 * cached + native[1]["cached_tokens"]
    assert found["rbee:prefix_cache_queries_total"] >= 3 * prompt_tokens + 2 * native[1]["prompt_tokens"]
    assert found["rbee:num_preemptions_total"] == 0


@pytest.mark.slow
def test_no_prefix_cache_computes_every_prompt(tmp_path_factory: pytest.TempPathFactory) -> None:
    log_dir = tmp_path_factory.mktemp("no-prefix-cache")
    with running(log_dir, *FLAGS, "--no-prefix-cache", fork=True) as worker:
        client = client_of(worker)
        first, second = ask(client), ask(client)
        assert [r.usage.prompt_tokens_details.cached_tokens for r in (first, second)] == [0, 0]
        assert second.choices[0].message.content == first.choices[0].message.content
        with httpx.Client(base_url=worker.url, timeout=120) as http:
            end = execute(http, prompt=SYSTEM, max_tokens=4, temperature=0).terminal
        assert end["type"] == "end" and end["cached_tokens"] == 0
        found = counters(worker)
    assert found["rbee:prefix_cache_hits_total"] == 0
    assert found["rbee:prefix_cache_queries_total"] >= 2 * first.usage.prompt_tokens


@pytest.mark.slow
@needs_llama_cpp
def test_llama_cpp_finds_a_repeated_prompt_in_its_own_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """On llama.cpp the runtime's own prefix cache serves (engine/runners/llama_cpp/llama_cpp_runner.py, not the block
    pool's): a chat sent again reports all of its prompt but the last tokens cached, in the OpenAI usage and the
    counters."""
    from rbee_worker.engine.runners.llama_cpp.llama_cpp_runner import UNIFORM_ROWS

    log_dir = tmp_path_factory.mktemp("llama-cpp-prefix-cache")
    with running(log_dir, "--runtime", "llama.cpp", "--max-batch", "2", "--threads", "2", fork=True) as worker:
        client = client_of(worker)
        prompt_tokens = httpx.post(f"{worker.url}/tokenize", json={"messages": MESSAGES}, timeout=30).json()["count"]
        first, second = ask(client), ask(client)
        assert first.usage.prompt_tokens == second.usage.prompt_tokens == prompt_tokens
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        # All but the last UNIFORM_ROWS tokens, which the scheduler leaves to compute.
        assert second.usage.prompt_tokens_details.cached_tokens == prompt_tokens - UNIFORM_ROWS
        assert second.choices[0].message.content
        found = counters(worker)
    assert found["rbee:prefix_cache_hits_total"] == prompt_tokens - UNIFORM_ROWS
    assert found["rbee:prefix_cache_queries_total"] == 2 * prompt_tokens
