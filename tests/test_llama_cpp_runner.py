"""The engine on llama.cpp's runtime (engine/llama_cpp_runner.py), against llama-cpp-python itself on the demo file:
the same greedy tokens, the same token ids for the same text, llama.cpp's own memory figures, and every running
request decoding in one llama_decode with the prompts that arrive meanwhile. Prefix reuse across llama.cpp's
sequences: a shared system prompt found again (in a finished request's row, its keeper, a running request's row), with
the tokens of an engine without the prefix cache; preempted requests on a small pool; and cache entries (keepers, the
rows of ended requests) dropped when llama.cpp finds no room for a batch."""

import queue
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import greedy, submit_together

from rbee_worker.benchmark.accuracy import GREEDY_TOKENS, PROMPTS
from rbee_worker.devices import resolve_placement
from rbee_worker.engine.config import EngineConfig
from rbee_worker.engine.engine import Engine
from rbee_worker.engine.llama_cpp_runner import common_prefix
from rbee_worker.engine.sampling import SamplingParams
from rbee_worker.engine.types import End, Error, Request, Token
from rbee_worker.models.gguf_format import read_gguf
from rbee_worker.models.loader import load_model

llama_cpp = pytest.importorskip("llama_cpp")
native = pytest.importorskip("llama_cpp.llama_cpp")

GREEDY = SamplingParams(temperature=0.0)
CHAT = [{"role": "user", "content": "Name three bees, then say <|im_end|> and 42 € ünïcode."}]
# Where a sequence's cells lie in llama.cpp's unified pool (which cells other sequences hold, a prefix shared with
# another request) changes how its sums round, and the quantized model carries that on to its logits, with or without
# the prefix cache; a greedy choice whose logit is closer than this to the runner-up's may go either way, so tokens are
# compared with a run without the cache up to the first such choice.
MARGIN = 1.0
# A system prompt of about 300 tokens on the demo's tokenizer.
SYSTEM = " ".join(
    [
        "You answer questions for a beekeepers' cooperative in the hills above a river town.",
        "The cooperative keeps two hundred hives on six sites and sells honey, wax and pollen at the Friday market.",
        "Members pay forty euros a year, may borrow the extractor for two days at a time, and help at one harvest.",
        "Swarm calls go to the duty phone from April to July; the volunteer on duty answers within two hours.",
        "Varroa checks are due every month from March to October, and treatments are recorded in the shared book.",
        "New members take the six-evening course in spring before they keep a hive of their own on a shared site.",
        "Answer in one or two short sentences, and say plainly when the answer is not in these notes.",
    ]
    * 2
)
# Questions whose answers, run without the cache, have no near tie (MARGIN) in their first tokens; ALIKE share their
# first words too.
QUESTIONS = [
    "When are varroa checks due?",
    "What must new members do?",
    "When is the market?",
    "Who runs the duty phone?",
    "How long may members keep the extractor?",
    "Which day is the market held?",
]
ALIKE = ["Tell me about the varroa checks.", "Tell me about the new members' course."]
# Prompts that share nothing with the others: about 480 tokens, then about 300 and 240.
LEDGER = " ".join(
    f"Jar {i} holds {i * 37 % 500} grams of {['clover', 'heather', 'lime', 'acacia'][i % 4]} honey from hive {i % 11}."
    for i in range(27)
)
ENDED = [
    " ".join(f"Hive {i} gave {i * 13 % 40} kilograms of honey on site {i % 6}." for i in range(19)),
    " ".join(f"Site {i} has {i * 7 % 30} hives and a {['gravel', 'grass', 'dirt'][i % 3]} track." for i in range(18)),
]
BYTES_PER_TOKEN = 30 * 3 * 64 * 2 * 2  # the demo's K and V in F16: layers x KV heads x head size x 2 x 2 bytes


@pytest.fixture(scope="module")
def engine(demo_gguf: Path):
    engine = Engine(
        lambda: load_model(str(demo_gguf), resolve_placement("cpu", "auto"), runtime="llama.cpp"),
        EngineConfig(max_batch=4, threads=2),
    )
    yield engine
    engine.close()


def demo_engine(demo_gguf: Path, **config: object) -> Engine:
    return Engine(
        lambda: load_model(str(demo_gguf), resolve_placement("cpu", "auto"), runtime="llama.cpp"),
        EngineConfig(threads=2, **config),  # type: ignore[arg-type]
    )


@dataclass(frozen=True)
class Solo:
    """A prompt's greedy tokens run alone on an engine without the prefix cache, and at each choice how far the
    chosen token's logit lies above the runner-up's."""

    tokens: list[int]
    margins: list[float]

    def agrees(self, tokens: list[int], least: int = 4) -> bool:
        """Whether `tokens` are these up to the first choice closer than MARGIN, which comes after `least` tokens."""
        sure = next((i for i, margin in enumerate(self.margins) if margin < MARGIN), len(self.margins))
        assert sure >= least, f"a near tie at token {sure} of the run without the cache: choose another prompt"
        return tokens[:sure] == self.tokens[:sure]


@pytest.fixture(scope="module")
def solo(demo_gguf: Path):
    """Solo(prompt ids, max_tokens), each prompt run once."""
    engine = demo_engine(demo_gguf, max_batch=1, prefix_caching=False)
    greedy(engine, (1,), 1)  # loaded
    runner, margins = engine._runner, []
    logits = runner._logits

    def keep_margin(rows: int) -> torch.Tensor:  # on the engine thread, one row each step
        out = logits(rows)
        top = out[0].topk(2).values
        margins.append(float(top[0] - top[1]))
        return out

    runner._logits = keep_margin
    runs: dict[tuple[tuple[int, ...], int], Solo] = {}

    def run(ids: tuple[int, ...], max_tokens: int) -> Solo:
        if (ids, max_tokens) not in runs:
            margins.clear()
            runs[ids, max_tokens] = Solo(greedy(engine, ids, max_tokens)[0], list(margins))
        return runs[ids, max_tokens]

    yield run
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
        ids = list(engine.tokenize(prompt))
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
        assert list(engine.tokenize(text)) == llm.tokenize(text.encode(), add_bos=True, special=False), text
    chat = engine.chat_prompt(CHAT)
    assert list(engine.tokenize_chat(CHAT)) == llm.tokenize(chat.encode(), add_bos=False, special=True)


def test_memory_is_llama_cpps_own_figures(engine: Engine, demo_gguf: Path) -> None:
    """Weights: llama_model_size. KV cache: the unified pool of the block pool's size (or llama.cpp's rounding up of
    it) allocated at start, at the bytes per token that llama_state_seq_get_size reports for a finished request's
    sequence (less its per-cell bookkeeping)."""
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
    _, end = greedy(engine, engine.tokenize(PROMPTS[0]), 20)  # sequence 0 (batch row 0), kept until the row is taken
    cells = end.prompt_tokens + end.tokens_out - 1
    assert end.kv_cache_bytes == cells * kv.bytes_per_token
    state = native.llama_state_seq_get_size(runner._context, 0)
    assert end.kv_cache_bytes < state < end.kv_cache_bytes + 8 * cells + 4096


def test_one_llama_decode_per_step_with_prompts_joining_running_decodes(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests that arrive while others decode have their prompts fed in the same llama_decode as the running
    requests' next tokens (no step of prompts alone in between), one llama_decode per step; each still gets its
    solo tokens."""
    prompts = [engine.tokenize(p) for p in PROMPTS]
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
    tokens, end = greedy(engine, engine.tokenize(PROMPTS[0]), 4)
    assert len(tokens) == end.tokens_out == 4


def ask(engine: Engine, question: str) -> tuple[int, ...]:
    return tuple(engine.tokenize_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]))


def copies(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int, int]]:
    """Every llama_memory_seq_cp from now on: (source, destination, p0, p1)."""
    calls: list[tuple[int, int, int, int]] = []
    copy = native.llama_memory_seq_cp

    def record(memory: object, source: int, destination: int, p0: int, p1: int) -> None:
        calls.append((source, destination, p0, p1))
        copy(memory, source, destination, p0, p1)

    monkeypatch.setattr(native, "llama_memory_seq_cp", record)
    return calls


def test_a_shared_system_prompt_is_computed_once(engine: Engine, solo) -> None:
    """A second question after the same system prompt reuses the first request's keys and values for their common
    prefix (End.cached_tokens), and the same prompt again all of it but its last token; the answers agree with those
    of an engine without the prefix cache (Solo.agrees)."""
    first_ids, second_ids = ask(engine, QUESTIONS[0]), ask(engine, QUESTIONS[1])
    shared = common_prefix(list(first_ids), list(second_ids))
    assert shared > 300
    first, _ = greedy(engine, first_ids, 16)
    second, end = greedy(engine, second_ids, 16)
    assert end.cached_tokens == shared
    assert solo(first_ids, 16).agrees(first) and solo(second_ids, 16).agrees(second)
    again, end = greedy(engine, second_ids, 16)
    assert end.cached_tokens == len(second_ids) - 1
    assert solo(second_ids, 16).agrees(again)


def test_a_finished_requests_prefix_outlives_the_next_request_in_its_row(
    demo_gguf: Path, solo, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When a new request takes a finished request's row, the finished one's sequence moves to the row's keeper; a
    later request that shares its prefix gets it from there."""
    engine = demo_engine(demo_gguf, max_batch=2)
    try:
        first_ids, other_ids, third_ids = (
            ask(engine, QUESTIONS[2]),
            engine.tokenize(PROMPTS[0]),
            ask(engine, QUESTIONS[3]),
        )
        greedy(engine, first_ids, 8)
        _, end = greedy(engine, other_ids, 8)  # row 0 again
        assert end.cached_tokens == 0
        keeper = 0 + 2  # row 0's keeper: row + max_batch
        assert engine._runner._held[keeper][: len(first_ids)] == list(first_ids)
        copied = copies(monkeypatch)
        third, end = greedy(engine, third_ids, 16)
        shared = common_prefix(list(first_ids), list(third_ids))
        assert end.cached_tokens == shared > 300
        assert copied == [(keeper, 0, 0, shared)]
        assert solo(third_ids, 16).agrees(third)
    finally:
        engine.close()


def test_requests_running_together_share_a_prefix(engine: Engine, solo, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt that arrives while a request with the same system prompt decodes takes the running request's cells
    for their common prefix; two prompts that arrive together both take a held prefix; each gets its solo tokens."""
    copied = copies(monkeypatch)
    running_ids, joining_ids = ask(engine, ALIKE[0]), ask(engine, ALIKE[1])
    events: queue.SimpleQueue = queue.SimpleQueue()
    engine.submit(Request(running_ids, max_tokens=48, sampling=GREEDY, request_id="long"), events.put)
    while not isinstance(event := events.get(timeout=120), Token):  # it decodes
        assert not isinstance(event, End | Error), event
    joining, end = greedy(engine, joining_ids, 12)
    running = [*event.token_ids]
    while not isinstance(event := events.get(timeout=120), End | Error):
        running.extend(event.token_ids)
    assert isinstance(event, End) and event.tokens_out == 48
    shared = common_prefix(list(running_ids), list(joining_ids))
    assert end.cached_tokens == shared > common_prefix(list(running_ids), list(ask(engine, QUESTIONS[0])))
    assert (0, 1, 0, shared) in copied  # from the running request's row
    assert solo(running_ids, 48).agrees(running) and solo(joining_ids, 12).agrees(joining)

    together, before = [ask(engine, question) for question in QUESTIONS[4:6]], len(copied)
    tokens = submit_together(engine, [Request(ids, max_tokens=12, sampling=GREEDY) for ids in together])
    assert {destination for _, destination, _, p1 in copied[before:] if p1 > 300} == {0, 1}  # rows 0 and 1
    assert all(solo(ids, 12).agrees(out) for ids, out in zip(together, tokens, strict=True))


def test_keepers_go_when_llama_cpp_finds_no_room(demo_gguf: Path, solo, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a pool of 768 cells, a finished request's cells in its row's keeper leave too little room for the next
    request's long prompt: llama_decode finds no room (1), the keeper goes, and the same batch is decoded again; every
    request gets its solo tokens, and nothing is reused from the dropped keeper."""
    engine = demo_engine(demo_gguf, max_batch=2, kv_cache_bytes=(768 // 16 + 1) * 16 * BYTES_PER_TOKEN)
    codes: list[int] = []
    decode = native.llama_decode

    def counted(*args: object) -> int:
        codes.append(code := decode(*args))
        return code

    monkeypatch.setattr(native, "llama_decode", counted)
    try:
        first_ids, ledger_ids = ask(engine, QUESTIONS[0]), engine.tokenize(LEDGER)
        first, _ = greedy(engine, first_ids, 8)
        runner = engine._runner
        assert runner.kv.bytes_per_token == BYTES_PER_TOKEN and native.llama_n_ctx(runner._context) == 768
        assert len(first_ids) + 8 + len(ledger_ids) > 768 > len(ledger_ids) + 8
        assert 1 not in codes
        ledger, end = greedy(engine, ledger_ids, 8)  # row 0: the first request's cells move to its keeper
        assert end.cached_tokens == 0
        assert 1 in codes and 0 + 2 not in runner._held  # row 0's keeper went
        again, end = greedy(engine, first_ids, 8)
        assert end.cached_tokens == 0  # its keeper went
        assert solo(first_ids, 8).agrees(first) and solo(first_ids, 8).agrees(again)
        assert solo(ledger_ids, 8).agrees(ledger)
    finally:
        engine.close()


def test_requests_preempted_on_a_small_pool_find_their_prefix_again(demo_gguf: Path, solo) -> None:
    """Four requests with the same system prompt on a pool of 768 cells, which accounts for each one's reused prefix
    as its own blocks: the newest are preempted and read their tokens again (with what prefix llama.cpp holds and the
    pool has blocks for), and when llama.cpp finds no room for a batch the cells of ended requests and keepers go;
    each request gets its solo tokens."""
    engine = demo_engine(demo_gguf, max_batch=4, kv_cache_bytes=(768 // 16 + 1) * 16 * BYTES_PER_TOKEN)
    try:
        prompts = [ask(engine, question) for question in QUESTIONS[:4]]
        tokens = submit_together(engine, [Request(ids, max_tokens=16, sampling=GREEDY) for ids in prompts])
        assert engine.preemptions > 0
        assert all(solo(ids, 16).agrees(out) for ids, out in zip(prompts, tokens, strict=True))
    finally:
        engine.close()


def test_an_ended_requests_row_goes_when_llama_cpp_finds_no_room(
    demo_gguf: Path, solo, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows 1 and 2 hold ended requests (cache entries outside the block pool's accounting) while row 0 decodes on; a
    long prompt that takes row 1 (its old contents moving to the keeper) finds no room in llama.cpp until row 2's
    sequence and then the keeper go, the least recently used first."""
    engine = demo_engine(demo_gguf, max_batch=3, kv_cache_bytes=(768 // 16 + 1) * 16 * BYTES_PER_TOKEN)
    codes: list[int] = []
    decode = native.llama_decode

    def counted(*args: object) -> int:
        codes.append(code := decode(*args))
        return code

    monkeypatch.setattr(native, "llama_decode", counted)
    try:
        running: queue.SimpleQueue = queue.SimpleQueue()
        first = Request(engine.tokenize(PROMPTS[0]), max_tokens=200, sampling=GREEDY, request_id="running")
        engine.submit(first, running.put)  # row 0
        ended = [engine.tokenize(text) for text in ENDED]
        submit_together(engine, [Request(ids, max_tokens=4, sampling=GREEDY) for ids in ended])  # rows 1 and 2
        runner = engine._runner
        assert [runner._held[row][: len(ids)] for row, ids in ((1, ended[0]), (2, ended[1]))] == [*map(list, ended)]
        ledger_ids = engine.tokenize(LEDGER)
        ledger, end = greedy(engine, ledger_ids, 8)  # row 1
        so_far = [running.get_nowait() for _ in range(running.qsize())]
        assert so_far and not any(isinstance(event, End | Error) for event in so_far)  # row 0 decodes on
        assert 1 in codes and 2 not in runner._held and 1 + 3 not in runner._held
        assert end.cached_tokens == 0 and solo(ledger_ids, 8).agrees(ledger)
        engine.cancel("running")
    finally:
        engine.close()


def test_common_prefix_counts_whole_strides_then_tokens() -> None:
    tokens = list(range(300))
    for n in (0, 1, 63, 64, 65, 128, 299):
        assert common_prefix(tokens, [*tokens[:n], -1, *tokens[n + 1 :]]) == n
    assert common_prefix(tokens[:130], tokens) == 130 and common_prefix([], tokens) == 0
