"""The engine on llama.cpp's runtime (engine/runners/llama_cpp/llama_cpp_runner.py), against llama-cpp-python itself on
the demo file: the same greedy tokens, the same token ids for the same text, llama.cpp's own memory figures, and every
running request decoding in one llama_decode with the prompts that arrive meanwhile."""

import queue
import threading
from pathlib import Path

import pytest
from conftest import engine_config, greedy, submit_together

from rbee_worker.benchmark.accuracy import GREEDY_TOKENS, PROMPTS
from rbee_worker.engine.engine import Engine
from rbee_worker.engine.request_types import End, PromptLogprobs, Request
from rbee_worker.engine.sampling.sampling_params import SamplingParams
from rbee_worker.hardware.devices import resolve_placement
from rbee_worker.loading.gguf.gguf_format import read_gguf
from rbee_worker.loading.loader import load_model

llama_cpp = pytest.importorskip("llama_cpp")
native = pytest.importorskip("llama_cpp.llama_cpp")

GREEDY = SamplingParams(temperature=0.0)
CHAT = [{"role": "user", "content": "Name three bees, then say <|im_end|> and 42 € ünïcode."}]


@pytest.fixture(scope="module")
def engine(demo_gguf: Path):
    engine = Engine(
        lambda: load_model(str(demo_gguf), resolve_placement("cpu", "auto"), runtime="llama.cpp"),
        engine_config(max_batch=4, threads=2),
    )
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def llm(demo_gguf: Path):
    # Flash attention on, as llama.cpp's own default (`auto`) and so the worker's context have it on a CPU;
    # llama-cpp-python's Llama() turns it off unless asked (its logits then differ in the last bits).
    model = llama_cpp.Llama(model_path=str(demo_gguf), n_ctx=1024, n_threads=2, verbose=False, flash_attn=True)
    yield model
    model.close()


def test_greedy_tokens_equal_llama_cpp_pythons_own_greedy_generation(engine: Engine, llm) -> None:
    """3 prompts x 64 tokens: the worker's greedy tokens (its sampler's argmax over llama.cpp's logits) are the
    tokens of llama-cpp-python's own generate at temperature 0, fed the same ids."""
    eos = engine.loaded.info.eos_token_ids
    for prompt in PROMPTS:
        ids = list(engine.model.tokenize(prompt))
        ours, _ = greedy(engine, ids, GREEDY_TOKENS)
        theirs: list[int] = []
        for token in llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            if token in eos or len(theirs) == GREEDY_TOKENS:
                break
            theirs.append(token)
        assert ours == theirs, prompt


def test_token_ids_fed_equal_llama_cpps_own_tokenizer(engine: Engine, llm) -> None:
    """The worker tokenizes (llama.cpp only gets ids): its ids equal llama_tokenize's for plain prompts, and for a
    chat rendered by the template, special tokens included."""
    texts = [*PROMPTS, "  leading spaces, digits 12345 and\nnewlines\t\ttabs", "日本語とemoji 🐝🍯"]
    for text in texts:
        assert list(engine.model.tokenize(text)) == llm.tokenize(text.encode(), add_bos=True, special=False), text
    chat = engine.model.chat_prompt(CHAT)
    assert list(engine.model.tokenize_chat(CHAT)) == llm.tokenize(chat.encode(), add_bos=False, special=True)


def test_memory_is_llama_cpps_own_figures(engine: Engine, demo_gguf: Path) -> None:
    """Weights: llama_model_size. KV cache: the block pool's size (here a stream per sequence; or llama.cpp's rounding
    up of it) allocated at start, at the bytes per token of a finished request's sequence state as llama.cpp saves it
    into the prompt cache (less its per-cell bookkeeping)."""
    runner = engine._runner
    assert engine.loaded.info.weight_bytes == native.llama_model_size(runner.model.handle)
    assert 80_000_000 < engine.loaded.info.weight_bytes < 120_000_000  # the Q4_1 file's matrices as they are
    kv = runner.kv
    assert engine.kv_cache_bytes() == native.llama_n_ctx(runner._context) * kv.bytes_per_token
    assert kv.tokens <= native.llama_n_ctx(runner._context) < kv.tokens + 1024
    assert engine.memory_bytes() == engine.loaded.info.weight_bytes + engine.kv_cache_bytes()
    meta = read_gguf(demo_gguf).metadata
    head_dim = meta["llama.embedding_length"] // meta["llama.attention.head_count"]
    assert kv.bytes_per_token == meta["llama.block_count"] * meta["llama.attention.head_count_kv"] * head_dim * 4
    saved = runner.prompts.bytes
    _, end = greedy(engine, engine.model.tokenize(" ".join(PROMPTS)), 20)  # its sequence's state is saved when it ends
    cells = end.prompt_tokens + end.tokens_out - 1
    assert end.kv_cache_bytes == cells * kv.bytes_per_token
    state = runner.prompts.bytes - saved
    assert end.kv_cache_bytes < state < end.kv_cache_bytes + 8 * cells + 4096


def test_one_llama_decode_per_step_with_prompts_joining_running_decodes(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests that arrive while others decode have their prompts fed in the same llama_decode as the running
    requests' next tokens (no step of prompts alone in between), one llama_decode per step; each still gets its
    solo tokens."""
    prompts = [engine.model.tokenize(p) for p in PROMPTS]
    solo = [greedy(engine, ids, 16)[0] for ids in prompts]
    steps: list[tuple[int, int]] = []  # (prompt rows, decode rows) of each step
    decodes = 0
    step, decode = engine._runner.step, native.llama_decode

    def count_step(prompt_rows: list, decode_rows: list) -> list:
        steps.append((len(prompt_rows), len(decode_rows)))
        return step(prompt_rows, decode_rows)

    def count_decode(*args: object) -> int:
        nonlocal decodes
        decodes += 1
        return decode(*args)

    monkeypatch.setattr(engine._runner, "step", count_step)
    monkeypatch.setattr(native, "llama_decode", count_decode)
    running: queue.SimpleQueue = queue.SimpleQueue()
    engine.submit(Request(prompts[0], max_tokens=200, sampling=GREEDY, request_id="running"), running.put)
    while not steps or steps[-1][1] == 0:  # until it decodes
        threading.Event().wait(0.01)
    joined = submit_together(engine, [Request(ids, max_tokens=16, sampling=GREEDY) for ids in prompts])
    engine.cancel("running")
    assert joined == solo
    assert any(p >= 1 and d >= 1 for p, d in steps), steps
    assert decodes == len(steps)


def test_invalid_token_ids_fail_the_request_not_the_engine(engine: Engine) -> None:
    """A token id outside the vocabulary (llama_decode refuses the batch) ends that request with an error event;
    the engine serves the next one."""
    events = list(engine.stream(Request((1, 10**7), max_tokens=4, sampling=GREEDY)))
    assert events[-1].code.value == "INFERENCE_FAILED" and "llama_decode" in events[-1].message
    tokens, end = greedy(engine, engine.model.tokenize(PROMPTS[0]), 4)
    assert len(tokens) == end.tokens_out == 4


def test_prompt_logprobs_are_llama_cpps_own_logits(engine: Engine, demo_gguf: Path) -> None:
    """A prompt's logprobs (Request.prompt_logprobs, with a request generating beside it in the same llama_decode)
    are the log-softmax of llama-cpp-python's own logits over the prompt (logits_all), within 1e-4."""
    import numpy as np

    prompt = engine.model.tokenize(" ".join(PROMPTS))
    beside = Request(engine.model.tokenize(PROMPTS[0]), max_tokens=8, sampling=GREEDY)
    events: queue.SimpleQueue = queue.SimpleQueue()
    engine.submit(beside, lambda event: None)
    engine.submit(Request(prompt, max_tokens=0, prompt_logprobs=0), events.put)
    while not isinstance(event := events.get(timeout=120), PromptLogprobs):
        pass
    llm = llama_cpp.Llama(model_path=str(demo_gguf), n_ctx=512, n_threads=2, verbose=False, flash_attn=True,
                          logits_all=True)  # fmt: skip
    try:
        llm.eval(list(prompt))
        logits = np.asarray(llm.scores[: len(prompt) - 1], dtype=np.float64)
    finally:
        llm.close()
    reference = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
    expected = reference[np.arange(len(prompt) - 1), list(prompt[1:])]
    assert [lp.token_id for lp in event.logprobs] == list(prompt[1:])
    assert np.abs(np.array([lp.logprob for lp in event.logprobs]) - expected).max() < 1e-4


def test_cache_ram_bounds_the_prompt_cache_and_0_turns_it_off(demo_gguf: Path) -> None:
    """--cache-ram (EngineConfig.prompt_cache_bytes): a finished request's saved state goes into the host prompt cache
    (Engine.prompt_cache_bytes reports it) and the same prompt again starts from it; with 0 nothing is kept and
    nothing is reused."""
    for budget in (None, 0):
        engine = Engine(
            lambda: load_model(str(demo_gguf), resolve_placement("cpu", "auto"), runtime="llama.cpp"),
            engine_config(max_batch=2, threads=2, prompt_cache_bytes=budget),
        )
        try:
            prompt = engine.model.tokenize(" ".join(PROMPTS) * 8)  # past the 64 tokens a cache hit leaves to compute
            _, first = greedy(engine, prompt, 4)
            _, again = greedy(engine, prompt, 4)
            if budget is None:
                assert engine.prompt_cache_bytes() > 0 and again.cached_tokens > 0
            else:
                assert engine.prompt_cache_bytes() == 0 and again.cached_tokens == 0
            assert first.cached_tokens == 0
        finally:
            engine.close()


def test_embeddings_are_llama_cpps_own_beside_a_generation(engine: Engine, demo_gguf: Path) -> None:
    """Embedding requests (last-token pooling, the demo's: a generative GGUF has no pooling type) in the same
    llama_decode as a greedy generation: each vector is llama-cpp-python's own embedding with LAST pooling (cosine
    >= 0.9999), and the generation gives its solo tokens (with embeddings on, llama.cpp outputs every position)."""
    import numpy as np

    from rbee_worker.engine.request_types import Embedding

    texts = [*PROMPTS, "Hi"]
    ask = Request(engine.model.tokenize(PROMPTS[1]), max_tokens=12, sampling=GREEDY)
    solo, _ = greedy(engine, ask.prompt_ids, 12)
    streams = [queue.SimpleQueue() for _ in range(len(texts) + 1)]
    requests = [*(Request(engine.model.tokenize(t), max_tokens=0, embed=True) for t in texts), ask]
    for request, events in zip(requests, streams, strict=True):
        engine.submit(request, events.put)
    vectors = []
    for events in streams[:-1]:
        while not isinstance(event := events.get(timeout=120), Embedding):
            pass
        vectors.append(np.asarray(event.values))
    tokens = []
    while not isinstance(event := streams[-1].get(timeout=120), End):
        tokens.extend(getattr(event, "token_ids", ()))
    assert tokens == solo
    llm = llama_cpp.Llama(model_path=str(demo_gguf), embedding=True, pooling_type=llama_cpp.LLAMA_POOLING_TYPE_LAST,
                          n_ctx=512, n_threads=2, verbose=False, flash_attn=True)  # fmt: skip
    try:
        for text, ours in zip(texts, vectors, strict=True):
            theirs = np.asarray(llm.embed(text, normalize=False))
            assert ours @ theirs / np.linalg.norm(ours) / np.linalg.norm(theirs) >= 0.9999, text
    finally:
        llm.close()
