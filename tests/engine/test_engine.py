"""The engine on the real demo model: stop reasons, stop strings, seeds, cancellation, concurrency, streaming text."""

import asyncio
import queue
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import RUNTIMES, assert_launched_ahead_as_waiting, engine_config, submit_together

from rbee_worker.engine.engine import DuplicateRequest, Engine, EngineBusy
from rbee_worker.engine.engine_config import EngineConfig
from rbee_worker.engine.request_types import End, Error, ErrorCode, Event, Request, Started, StopReason, Token
from rbee_worker.engine.runners.torch import cuda_graphs
from rbee_worker.engine.runners.torch.kv_cache import PagedCache
from rbee_worker.engine.runners.torch.torch_runner import TorchRunner
from rbee_worker.engine.sampling.sampling_params import SamplingParams
from rbee_worker.hardware.devices import resolve_placement
from rbee_worker.loading.gguf.gguf_format import read_gguf
from rbee_worker.loading.loader import load_model

GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=0.9, top_p=0.95)
STORY = "Once upon a time, in a small village by the sea,"


@pytest.fixture(scope="module", params=RUNTIMES)
def engine(demo_gguf: Path, request: pytest.FixtureRequest):
    engine = Engine(
        lambda: load_model(str(demo_gguf), resolve_placement("cpu", "auto"), runtime=request.param), engine_config()
    )
    yield engine
    engine.close()


def kv_bytes_per_position(engine: Engine) -> int:
    """K and V of one position over every layer: torch's cache in the model's dtype and shape, llama.cpp's in F16
    with the geometry the GGUF file gives."""
    if engine.loaded.info.runtime == "torch":
        config, dtype = engine.loaded.model.config, engine.loaded.info.dtype
        return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * dtype.itemsize
    meta = read_gguf(engine.loaded.info.path).metadata
    head_dim = meta["llama.embedding_length"] // meta["llama.attention.head_count"]
    return 2 * meta["llama.block_count"] * meta["llama.attention.head_count_kv"] * head_dim * 2


def run(engine: Engine, request: Request) -> tuple[list[Event], str, list[int], End | Error]:
    events = list(engine.stream(request))
    pieces = [e for e in events if isinstance(e, Token)]
    return events, "".join(p.text for p in pieces), [i for p in pieces for i in p.token_ids], events[-1]


def test_event_order_and_counts(engine: Engine) -> None:
    events, text, ids, end = run(engine, Request(engine.model.tokenize(STORY), max_tokens=20, sampling=GREEDY))
    assert isinstance(events[0], Started) and events[0].prompt_tokens == len(engine.model.tokenize(STORY))
    assert all(isinstance(e, Token) for e in events[1:-1])
    assert [e.index for e in events[1:-1]] == list(range(len(events) - 2))
    assert isinstance(end, End) and end.stop_reason is StopReason.MAX_TOKENS
    assert end.tokens_out == len(ids) == 20
    assert text == engine.loaded.tokenizer.decode(ids, skip_special_tokens=True)
    # Measured KV cache: K and V for every layer over every position fed to the model (the last token is not).
    assert end.kv_cache_bytes == kv_bytes_per_position(engine) * (end.prompt_tokens + end.tokens_out - 1)


def test_eos_ends_generation_and_is_not_counted(engine: Engine) -> None:
    prompt = engine.model.tokenize_chat([{"role": "user", "content": "Say hello."}])
    _, text, ids, end = run(engine, Request(prompt, max_tokens=200, sampling=GREEDY))
    assert end.stop_reason is StopReason.EOS
    assert end.tokens_out == len(ids) < 200
    assert not engine.loaded.info.eos_token_ids & set(ids)
    assert text.strip()


def test_stop_string_across_token_boundary(engine: Engine) -> None:
    _, full_text, full_ids, _ = run(engine, Request(engine.model.tokenize(STORY), max_tokens=40, sampling=GREEDY))
    tokenizer = engine.loaded.tokenizer
    # A stop string that starts inside token k-1 and ends inside token k (both long enough), seen nowhere earlier.
    k = next(
        k
        for k in range(5, 30)
        if len(tokenizer.decode(full_ids[k - 1 : k])) >= 2 and len(tokenizer.decode(full_ids[k : k + 1])) >= 3
    )
    boundary = len(tokenizer.decode(full_ids[:k]))
    stop = full_text[boundary - 2 : boundary + 3]
    assert full_text.index(stop) == boundary - 2
    events, text, ids, end = run(
        engine, Request(engine.model.tokenize(STORY), max_tokens=40, sampling=GREEDY, stop=(stop,))
    )
    assert end.stop_reason is StopReason.STOP_SEQUENCE and end.stop_sequence == stop
    assert text == full_text[: full_text.index(stop)]
    assert all(stop not in e.text for e in events if isinstance(e, Token))
    assert ids == full_ids[: end.tokens_out]  # generation stopped at the token completing the match
    assert end.tokens_out == k + 1


def test_earliest_of_several_stop_strings_wins(engine: Engine) -> None:
    _, full_text, _, _ = run(engine, Request(engine.model.tokenize(STORY), max_tokens=40, sampling=GREEDY))
    late, early = full_text[30:36], full_text[12:15]
    _, text, _, end = run(
        engine, Request(engine.model.tokenize(STORY), max_tokens=40, sampling=GREEDY, stop=(late, early))
    )
    assert end.stop_sequence == early and text == full_text[: full_text.index(early)]


def test_same_seed_same_tokens_and_absent_seed_is_reported(engine: Engine) -> None:
    prompt = engine.model.tokenize(STORY)
    _, _, first, end1 = run(engine, Request(prompt, max_tokens=24, sampling=SAMPLED, seed=1234))
    _, _, second, end2 = run(engine, Request(prompt, max_tokens=24, sampling=SAMPLED, seed=1234))
    _, _, other, _ = run(engine, Request(prompt, max_tokens=24, sampling=SAMPLED, seed=99))
    assert first == second and end1.seed == end2.seed == 1234
    assert other != first
    _, _, unseeded, end = run(engine, Request(prompt, max_tokens=24, sampling=SAMPLED))
    _, _, replayed, _ = run(engine, Request(prompt, max_tokens=24, sampling=SAMPLED, seed=end.seed))
    assert replayed == unseeded


def test_prompt_beyond_context_is_refused_before_generating(engine: Engine) -> None:
    context = engine.loaded.info.context_length
    events = list(engine.stream(Request(engine.model.tokenize(STORY), max_tokens=context)))
    assert len(events) == 1 and isinstance(events[0], Error)
    assert events[0].code is ErrorCode.INVALID_REQUEST and "context" in events[0].message


def test_cancel_mid_stream_then_serve_the_next(engine: Engine) -> None:
    events: queue.SimpleQueue[Event] = queue.SimpleQueue()
    request = Request(
        engine.model.tokenize(STORY), max_tokens=2000 if engine.loaded.info.context_length > 2100 else 500
    )
    engine.submit(request, events.put)
    tokens = 0
    while tokens < 3:
        tokens += isinstance(events.get(timeout=30), Token)
    cancelled_at = time.perf_counter()
    engine.cancel(request.request_id)
    while not isinstance(event := events.get(timeout=5), End | Error):
        pass
    assert isinstance(event, End) and event.stop_reason is StopReason.CANCELLED
    assert time.perf_counter() - cancelled_at < 1.0
    _, _, _, end = run(engine, Request(engine.model.tokenize(STORY), max_tokens=5, sampling=GREEDY))
    assert end.stop_reason is StopReason.MAX_TOKENS and engine.in_flight == 0


def test_leaving_the_stream_cancels(engine: Engine) -> None:
    stream = engine.stream(Request(engine.model.tokenize(STORY), max_tokens=500))
    for event in stream:
        if isinstance(event, Token):
            break
    stream.close()
    deadline = time.perf_counter() + 2
    while engine.in_flight and time.perf_counter() < deadline:
        time.sleep(0.01)
    assert engine.in_flight == 0


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_seeded_sampled_request_is_the_same_alone_and_among_15_others_when_deterministic(
    demo_gguf: Path, runtime: str
) -> None:
    """With --deterministic, a seeded sampled request gets the tokens of its solo run while 15 other sampled requests
    (other seeds and settings, submitted with it) run: its draws depend on (seed, step) alone and its logits on its
    own rows alone (on llama.cpp: one sequence per llama_decode)."""
    engine = Engine(
        lambda: load_model(str(demo_gguf), resolve_placement("cpu", "auto"), runtime=runtime),
        engine_config(deterministic=True, max_batch=16),
    )
    try:
        chat = SamplingParams(temperature=0.7, top_p=0.9)
        request = Request(engine.model.tokenize(STORY), max_tokens=12, sampling=chat, seed=2**40 + 3)
        others = [
            Request(engine.model.tokenize(f"{i} {STORY}"), max_tokens=12, seed=i,
                    sampling=SamplingParams(temperature=0.5 + i / 10, top_k=i, repetition_penalty=1 + i / 100))
            for i in range(15)
        ]  # fmt: skip
        alone = run(engine, request)[2]
        together = submit_together(engine, [*others[:7], request, *others[7:]])[7]
        assert together == alone and len(alone) == 12
    finally:
        engine.close()


def test_concurrent_requests_interleave_and_match_their_solo_runs(demo_gguf: Path) -> None:
    """Batched decoding (one forward for all rows, free rows in between) gives each request its solo tokens; float32,
    so that the batch's different rounding cannot flip a near tie."""
    engine = Engine(lambda: load_model(str(demo_gguf), resolve_placement("cpu", "float32")), engine_config())
    try:
        check_interleaving(engine)
    finally:
        engine.close()


def check_interleaving(engine: Engine) -> None:
    prompts = [STORY, "The three primary colors are", "def add(a, b):\n"]
    requests = [Request(engine.model.tokenize(p), max_tokens=16, sampling=GREEDY) for p in prompts]
    solo = [run(engine, r)[2] for r in requests]
    results: dict[int, list[int]] = {}
    order: list[int] = []  # which request each streamed token belonged to, in arrival order

    def consume(i: int) -> None:
        ids = []
        for event in engine.stream(requests[i]):
            if isinstance(event, Token):
                ids.extend(event.token_ids)
                order.append(i)
        results[i] = ids

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [results[i] for i in range(3)] == solo
    # Interleaved, not one after the other: the first request is not finished before the others start.
    assert set(order[: len(order) // 2]) == {0, 1, 2}


def test_prompts_admitted_together_share_one_prefill_forward(demo_gguf: Path) -> None:
    """Three prompts of different lengths that arrive while a long prefill runs are prefilled in one forward at the
    next round (rows left-padded to the longest) and still give their solo tokens; float32, as above."""
    engine = Engine(lambda: load_model(str(demo_gguf), resolve_placement("cpu", "float32")), engine_config())
    try:
        prompts = [STORY, "The three primary colors are", "def add(a, b):\n"]
        requests = [Request(engine.model.tokenize(p), max_tokens=16, sampling=GREEDY) for p in prompts]
        solo = [run(engine, r)[2] for r in requests]
        rows: list[int] = []
        prefilling = threading.Event()
        runner = engine._runner
        forward = runner._prompt_forward

        def spy(prompt_rows: list) -> object:
            rows.append(len(prompt_rows))
            prefilling.set()
            return forward(prompt_rows)

        runner._prompt_forward = spy  # type: ignore[method-assign]
        long_prompt = engine.model.tokenize(STORY * 40)[:500]  # one forward of about a second here
        blocker = queue.SimpleQueue()
        engine.submit(Request(long_prompt, max_tokens=1, sampling=GREEDY), blocker.put)
        assert prefilling.wait(timeout=60)
        batched = submit_together(engine, requests)
        assert rows == [1, 3]  # the long prompt alone, then the three together
        assert batched == solo
    finally:
        engine.close()


def test_same_request_id_twice_is_refused(engine: Engine) -> None:
    first: queue.SimpleQueue[Event] = queue.SimpleQueue()
    request = Request(engine.model.tokenize(STORY), max_tokens=200, request_id="job-1")
    engine.submit(request, first.put)
    assert isinstance(first.get(timeout=30), Started)
    with pytest.raises(DuplicateRequest, match="already running"):
        engine.submit(Request(engine.model.tokenize(STORY), max_tokens=5, request_id="job-1"), first.put)
    engine.cancel("job-1")
    while not isinstance(first.get(timeout=5), End | Error):
        pass


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_slots_then_queue_then_busy(demo_gguf: Path, runtime: str) -> None:
    """max_batch requests run, max_queue wait (Started at once, first token only after a slot frees), the next is
    refused with EngineBusy; all admitted ones finish."""
    engine = Engine(
        lambda: load_model(str(demo_gguf), resolve_placement("cpu", "auto"), runtime=runtime),
        engine_config(max_batch=2, max_queue=1),
    )
    try:
        prompt = engine.model.tokenize(STORY)
        streams = [queue.SimpleQueue() for _ in range(3)]
        for i, events in enumerate(streams):
            engine.submit(
                Request(prompt, max_tokens=40 if i < 2 else 5, sampling=GREEDY, request_id=f"r{i}"), events.put
            )
        with pytest.raises(EngineBusy) as busy:
            engine.submit(Request(prompt, max_tokens=5), queue.SimpleQueue().put)
        assert (busy.value.max_batch, busy.value.max_queue, busy.value.in_flight) == (2, 1, 3)
        assert all(isinstance(events.get(timeout=30), Started) for events in streams)
        assert engine.running_requests == 2 and engine.in_flight == 3
        arrival: list[tuple[float, int, Event]] = []
        for i, events in enumerate(streams):
            while True:
                event = events.get(timeout=60)
                arrival.append((time.perf_counter(), i, event))
                if isinstance(event, End | Error):
                    break
        ends = {i: e for _, i, e in arrival if isinstance(e, End)}
        assert sorted(ends) == [0, 1, 2] and engine.in_flight == 0
        # r2 waited: every token of r2 came after one of r0/r1 had ended.
        first_end = min(t for t, i, e in arrival if i < 2 and isinstance(e, End))
        assert all(t >= first_end for t, i, e in arrival if i == 2 and isinstance(e, Token))
    finally:
        engine.close()


def test_progress_clock_counts_a_long_step_and_stops_when_idle(engine: Engine) -> None:
    """The stall clock (behind /health's "unhealthy") grows during one long forward and is 0 without work."""
    assert engine.seconds_without_progress() == 0.0
    events: queue.SimpleQueue[Event] = queue.SimpleQueue()
    engine.submit(Request(engine.model.tokenize(STORY * 30), max_tokens=3), events.put)  # a prefill of ~400 tokens
    longest = 0.0
    while events.empty() or not isinstance(events.get(), End | Error):
        longest = max(longest, engine.seconds_without_progress())
        time.sleep(0.005)
    assert longest > 0.1
    assert engine.seconds_without_progress() == 0.0


def test_seed_out_of_range_is_an_invalid_request(engine: Engine) -> None:
    events = list(engine.stream(Request(engine.model.tokenize(STORY), max_tokens=5, seed=2**64)))
    assert len(events) == 1 and isinstance(events[0], Error) and events[0].code is ErrorCode.INVALID_REQUEST


def test_closed_engine_refuses_new_requests(demo_gguf: Path) -> None:
    engine = Engine(lambda: load_model(str(demo_gguf), resolve_placement("cpu", "auto")), engine_config())
    prompt = engine.model.tokenize(STORY)
    engine.close()
    events = list(engine.stream(Request(prompt, max_tokens=5)))
    assert len(events) == 1 and isinstance(events[0], Error) and "shut down" in events[0].message


def test_async_stream_matches_the_blocking_one_and_leaving_cancels(engine: Engine) -> None:
    request = Request(engine.model.tokenize(STORY), max_tokens=12, sampling=GREEDY)
    _, expected_text, expected_ids, _ = run(engine, request)

    async def consume() -> tuple[str, list[int], Event]:
        events = [event async for event in engine.astream(request)]
        tokens = [e for e in events if isinstance(e, Token)]
        return "".join(t.text for t in tokens), [i for t in tokens for i in t.token_ids], events[-1]

    text, ids, end = asyncio.run(consume())
    assert (text, ids) == (expected_text, expected_ids) and isinstance(end, End)

    async def leave_after_first_token() -> None:
        stream = engine.astream(Request(engine.model.tokenize(STORY), max_tokens=500))
        async for event in stream:
            if isinstance(event, Token):
                break
        await stream.aclose()

    asyncio.run(leave_after_first_token())
    deadline = time.perf_counter() + 2
    while engine.in_flight and time.perf_counter() < deadline:
        time.sleep(0.01)
    assert engine.in_flight == 0


class ReplayedStep:
    """A stand-in for a captured CUDA graph on the CPU: replay runs the step again into the outputs of its capture,
    with the KV cache's batch rows as they were at capture (what a CUDA graph keeps: the addresses it read)."""

    def __init__(self, step, outputs, cache) -> None:
        self.step, self.outputs, self.cache = step, outputs, cache
        self.rows = {k: v for k, v in vars(cache).items() if k != "_zeroed"}  # not the lazily zeroed extent

    def replay(self) -> None:
        vars(self.cache).update(self.rows)
        outputs = self.step()
        if isinstance(outputs, tuple):
            for static, new in zip(self.outputs, outputs, strict=True):
                static.copy_(new)
        else:
            self.outputs.copy_(outputs)


@pytest.fixture
def cpu_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engines made in the test run their decode steps through DecodeGraphs on the CPU (see ReplayedStep)."""
    caches = []

    def prepare(runner: TorchRunner) -> None:
        if runner.config.cuda_graphs:
            caches.append(runner.cache)
            with torch.inference_mode():
                runner.warm_up(graphs=True)

    def capture(step, pool):
        outputs = step()
        return ReplayedStep(step, outputs, caches[-1]), outputs

    def poisoned(cache: PagedCache, *args: object) -> None:
        # Memory not yet zeroed holds NaN, as uninitialized memory may: no step may read it into the logits.
        init(cache, *args)
        for pool in cache.pools:
            for layer in (*pool.keys.values(), *pool.values.values()):
                layer[pool.zeroed :] = torch.nan

    zeros, init = torch.zeros, PagedCache.__init__
    monkeypatch.setattr(PagedCache, "__init__", poisoned)
    monkeypatch.setattr(TorchRunner, "_prepare_forward", prepare)
    monkeypatch.setattr(cuda_graphs, "capture", capture)
    monkeypatch.setattr(torch, "zeros", lambda *args, pin_memory=False, **kwargs: zeros(*args, **kwargs))
    monkeypatch.setattr(
        torch.cuda, "Event", lambda: type("Done", (), {"record": lambda _: None, "synchronize": lambda _: None})()
    )
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)


def test_decode_steps_launched_ahead_chain_tokens_as_waiting_for_each(demo_gguf: Path, cpu_graphs: None) -> None:
    """The bookkeeping of decode steps launched before the host reads the previous one (Executor._decode), run on
    the CPU through DecodeGraphs (tests/engine/test_cuda.py runs it on real CUDA graphs): every kind of request gets the
    tokens of an engine that waits for every step."""
    per_token = 2 * 30 * 3 * 64 * 4  # the demo model's float32 keys and values of one token, all layers
    engines = [
        Engine(
            lambda: load_model(str(demo_gguf), resolve_placement("cpu", "float32")),
            # A pool of 1,024 tokens holds every request here; the context it offers (so the width of the block
            # tables, which the CPU's stand-in for the decode kernel reads whole each step) stays that small, and the
            # prefill graphs captured before ready are those of 16 to 128 tokens (test_structured_output's reasons).
            EngineConfig(max_batch=8, kv_cache_bytes=1024 * per_token, cuda_graphs=graphs, prefill_chunk=128),
        )
        for graphs in (False, True)
    ]
    try:
        assert engines[0].loaded and engines[1].loaded
        assert engines[0]._runner.graphs is None and engines[1]._runner.graphs is not None
        assert_launched_ahead_as_waiting(
            waiting=engines[0], ahead=engines[1], prompts=[STORY, "def add(a, b):", "Paris is"]
        )
    finally:
        for engine in engines:
            engine.close()
