"""The step loop without a model: the engine driving a fake runner (a few lines) through the Runner protocol.

The fake's token for a row is a function of the token fed and its position, so every request's tokens are known
whatever else runs. It keeps what it writes in its KV blocks (position p of a row in `blocks[p // block_size]`) and
each batch row's token stream (the prompt its request brought, then the tokens the row chose): a step that feeds a
position out of order, a token that is not the row's own at that position, or whose row's blocks do not hold the row's
own tokens at every earlier position (the bookkeeping of launched-ahead steps, of mixed batches, of cancelled and
preempted requests, of prefixes found in the cache) shows up in `wrong`.
"""

import dataclasses
import queue
import random
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from rbee_worker.engine.engine import Engine
from rbee_worker.engine.engine_config import EngineConfig
from rbee_worker.engine.output_processor import OutputProcessor
from rbee_worker.engine.plan import Sequence as Admitted
from rbee_worker.engine.request_types import End, Error, ErrorCode, Event, Request, StopReason, Token
from rbee_worker.engine.runners.protocol import (
    Capabilities,
    DecodeRow,
    Finished,
    KvGeometry,
    PromptRow,
    Sampled,
    Stepped,
)
from rbee_worker.engine.sampling.sampling_params import SamplingParams
from rbee_worker.engine.scheduling.scheduler import Proposer
from rbee_worker.loading.loaded import LoadedModel, ModelInfo

WORDS = ["<eos>", *(f"w{i}" for i in range(1, 10))]
EOS = 0
CONTEXT = 256


def next_token(token: int, position: int) -> int:
    """The fake model: never EOS."""
    return (token * 7 + position) % 9 + 1


def expected_tokens(prompt: Sequence[int], count: int) -> list[int]:
    tokens, token, position = [], prompt[-1], len(prompt) - 1
    for _ in range(count):
        token = next_token(token, position)
        tokens.append(token)
        position += 1
    return tokens


class Poison(RuntimeError):
    pass


@dataclass
class Pending:
    sampled: list[Sampled]
    ready: bool = False


class FakeRunner:
    """A runner of one of three kinds: eager (a forward per kind of row), mixed (prompt chunks and decode rows in one
    forward) or asynchronous (decode steps launched ahead, chained rows reading the previous step's tokens)."""

    def __init__(
        self, loaded: LoadedModel, config: EngineConfig, kind: str, kv_blocks: int | None, row_tokens: int = 1
    ) -> None:
        self.loaded, self.kind = loaded, kind
        self.vocab_size = len(WORDS)
        self.capabilities = Capabilities(mixed_batches=kind == "mixed", row_tokens=row_tokens)
        self.prefixes = None  # the block pool is the cache
        self.accepted: list[int] = []  # rows of several tokens: how many of each row's tokens were accepted
        self.block_size = config.block_size
        blocks = kv_blocks or 1 + config.max_batch * -(-CONTEXT // self.block_size)
        self.kv = KvGeometry(blocks, self.block_size, min(CONTEXT, (blocks - 1) * self.block_size), 1)
        self.cells: dict[int, list[int | None]] = defaultdict(lambda: [None] * self.block_size)  # block -> tokens
        self.stream: dict[int, list[int]] = {}  # row -> the prompt, then the tokens the row chose
        self.next: dict[int, int | None] = {}  # row -> the position it must be fed next (None: from a cached prefix)
        self.chosen: dict[int, int] = {}  # row -> the token its latest row chose ("on the device")
        self.wrong: list[tuple[int, int, str]] = []  # (row, position fed, what was wrong)
        self.evicted: list[int] = []
        self.calls = self.chained = self.held_steps = 0
        self.matchers: dict[int, FakeMatcher] = {}  # row -> its request's matcher (constrained rows)
        self.prompt_length: dict[int, int] = {}
        self.held: list[tuple[Pending, dict[int, int]]] = []  # steps launched with their sampling held
        self.fail_at: dict[int, Exception] = {}  # call number -> what it raises
        self.before_failing: Callable[[], None] = lambda: None  # runs in a failing call, just before it raises
        self.poisoned = False

    def assign(self, row: int, params: SamplingParams, seed: int, prompt_ids: Sequence[int], logprobs: object) -> None:
        self.stream[row], self.next[row] = list(prompt_ids), None
        self.prompt_length[row] = len(prompt_ids)
        self.matchers.pop(row, None)

    def evict(self, row: int) -> None:
        self.evicted.append(row)
        self.next[row] = None

    def release(self, row: int) -> None:
        pass

    def step(self, prompts: list[PromptRow], decodes: list[DecodeRow]) -> Stepped:
        self._call()
        assert not (prompts and decodes) or self.kind == "mixed"
        out = []
        for row in prompts:
            for i, token in enumerate(row.token_ids):
                chosen = self._feed(row.row, row.blocks, token, row.start + i)
            if row.sample:
                out.append(Sampled((self._chose(row.row, chosen),), True))
        return Stepped(out + [self._verify(r, r.tokens[0]) for r in decodes], [() for _ in prompts])

    def chains(self, decodes: list[DecodeRow]) -> bool:
        return self.kind == "async"

    def launch(self, decodes: list[DecodeRow], hold_sampling: bool = False) -> Finished | Pending:
        if self.kind != "async":
            return Finished(self.step([], decodes).sampled)
        self._call()
        self.chained += sum(r.chained for r in decodes)
        fed = [self.chosen[r.row] if r.chained else r.tokens[0] for r in decodes]
        # The tokens each constrained row has chosen before this step: its mask must follow all of them when it draws.
        drawn = {r.row: len(self.stream[r.row]) - self.prompt_length[r.row] for r in decodes if r.row in self.matchers}
        step = Pending([self._verify(r, t) for r, t in zip(decodes, fed, strict=True)])
        if hold_sampling:
            self.held.append((step, drawn))
        else:
            self._check_masks(drawn)
        return step

    def masks(self, rows: Sequence[tuple[int, "FakeMatcher"]]) -> None:
        for row, matcher in rows:
            self.matchers[row] = matcher
            matcher.masked = len(matcher.accepted)

    def sample_held(self, launched: Pending) -> None:
        step, drawn = self.held.pop()
        assert step is launched
        self.held_steps += 1
        self._check_masks(drawn)

    def _check_masks(self, drawn: dict[int, int]) -> None:
        for row, count in drawn.items():
            if self.matchers[row].masked != count:
                self.wrong.append((row, count, f"drawn under a mask after {self.matchers[row].masked} tokens"))

    def collect(self, launched: Finished | Pending) -> list[Sampled]:
        if not launched.ready:
            self._call()
        return launched.sampled

    def fault(self, error: BaseException) -> str | None:
        return "the fake device is poisoned" if self.poisoned else None

    def kv_bytes(self) -> int:
        return 0

    def memory_bytes(self) -> int:
        return 0

    def prompt_cache_bytes(self) -> int:
        return 0

    def close(self) -> None:
        pass

    def _call(self) -> None:
        self.calls += 1
        if self.poisoned:
            raise Poison("poisoned")
        if error := self.fail_at.pop(self.calls, None):
            self.poisoned = isinstance(error, Poison)
            self.before_failing()
            raise error

    def _decode(self, row: DecodeRow, token: int) -> int:
        return self._chose(row.row, self._feed(row.row, row.blocks, token, row.position))

    def _verify(self, row: DecodeRow, token: int) -> Sampled:
        """A row's tokens: its first token's next one, then, while each proposal after it is the model's own next
        token, the token after that (a proposal that is not ends the row; it is never fed)."""
        accepted = [self._decode(row, token)]
        for offset, proposed in enumerate(row.tokens[1:], 1):
            if proposed != accepted[-1]:
                break
            accepted.append(self._decode(dataclasses.replace(row, position=row.position + offset), proposed))
        if len(row.tokens) > 1:
            self.accepted.append(len(accepted))
        return Sampled(tuple(accepted), True)

    def _chose(self, row: int, token: int) -> int:
        self.chosen[row] = token
        self.stream[row].append(token)
        return token

    def _feed(self, row: int, blocks: Sequence[int], token: int, position: int) -> int:
        """Write the token at the row's position in its block; the token the fake model chooses after it."""
        stream, size = self.stream[row], self.block_size
        expected = self.next[row]
        if expected is None and position % size == 0:  # a first chunk may start after a cached prefix
            expected = position
        if position != expected:
            self.wrong.append((row, position, f"fed out of order: expected {expected}"))
        if position >= len(stream) or stream[position] != token:
            self.wrong.append((row, position, "not the row's token at that position"))
        if position // size >= len(blocks) or blocks[position // size] == 0:
            self.wrong.append((row, position, "no block of its own for that position"))
            return next_token(token, position)
        self.cells[blocks[position // size]][position % size] = token
        self.next[row] = position + 1
        read = [self.cells[blocks[p // size]][p % size] for p in range(position + 1)]
        if read != stream[: position + 1]:
            self.wrong.append((row, position, "its blocks do not hold its tokens"))
        return next_token(token, position)


class FakeMatcher:
    """A grammar that allows every token: what matters is when it is asked for a mask (`masked`: how many tokens it
    had accepted then)."""

    def __init__(self) -> None:
        self.accepted: list[int] = []
        self.masked = -1
        self.terminated = False

    def accept_outside_grammar(self, token: int) -> bool:
        """Every token taken (grammar.accept_tokens asks this first; True: its grammar has no say)."""
        self.accepted.append(token)
        return True


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({w: i for i, w in enumerate(WORDS)})))
    info = ModelInfo("fake", Path("fake"), "hf", "llama", 256, frozenset({EOS}), torch.device("cpu"), torch.float32, 0)
    return LoadedModel(None, tokenizer, info)  # type: ignore[arg-type] -- the fake runner needs no model


def start(
    loaded: LoadedModel, kind: str, kv_blocks: int | None = None, proposer: Proposer | None = None, **config: object
) -> tuple[Engine, FakeRunner]:
    """An engine over a fake runner of this kind; with a `proposer`, its decode rows carry up to 3 tokens."""
    runners: list[FakeRunner] = []

    def make(loaded: LoadedModel, config: EngineConfig) -> FakeRunner:
        runners.append(FakeRunner(loaded, config, kind, kv_blocks, 3 if proposer else 1))
        return runners[0]

    settings = EngineConfig(**{"max_batch": 3, "prefill_chunk": 8, **config})  # type: ignore[arg-type]
    engine = Engine(lambda: loaded, settings, runner=make, proposer=proposer)
    engine.loaded  # noqa: B018 -- waits for the runner
    return engine, runners[0]


def requests(count: int, stop: tuple[str, ...] = ()) -> list[Request]:
    return [
        Request(tuple(range(1, 2 + i * 3 % 17)), max_tokens=1 + i * 5 % 12, request_id=f"r{i}", stop=stop)
        for i in range(count)
    ]


def run_together(engine: Engine, batch: list[Request]) -> dict[str, list[Event]]:
    events: queue.SimpleQueue[Event] = queue.SimpleQueue()
    for request in batch:
        engine.submit(request, events.put)
    received: dict[str, list[Event]] = defaultdict(list)
    ended = 0
    while ended < len(batch):
        event = events.get(timeout=10)
        received[event.request_id].append(event)
        ended += isinstance(event, End | Error)
    return received


def token_ids(events: list[Event]) -> list[int]:
    return [i for e in events if isinstance(e, Token) for i in e.token_ids]


def assert_own_tokens(received: dict[str, list[Event]], batch: list[Request]) -> None:
    """Each request got the tokens its prompt alone gives, as many as it asked for."""
    for request in batch:
        assert token_ids(received[request.request_id]) == expected_tokens(request.prompt_ids, request.max_tokens)


KINDS = ["eager", "mixed", "async"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("deterministic", [False, True])
def test_each_request_gets_its_own_tokens_at_the_right_positions(
    loaded: LoadedModel, kind: str, deterministic: bool
) -> None:
    """Eight requests of prompts up to 17 tokens (chunks of 8) and 1 to 12 tokens through three rows: each gets the
    tokens its prompt alone gives, every row is fed its own tokens at its positions in order, into its own blocks, and
    steps really ran ahead."""
    engine, runner = start(loaded, kind, deterministic=deterministic)
    try:
        batch = requests(8)
        received = run_together(engine, batch)
        for request in batch:
            end = received[request.request_id][-1]
            assert token_ids(received[request.request_id]) == expected_tokens(request.prompt_ids, request.max_tokens)
            assert isinstance(end, End) and end.stop_reason is StopReason.MAX_TOKENS
        assert runner.wrong == []
        assert (runner.chained > 0) is (kind == "async")
    finally:
        engine.close()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("deterministic", [False, True])
def test_a_pool_too_small_for_every_request_preempts_and_each_still_gets_its_own_tokens(
    loaded: LoadedModel, kind: str, deterministic: bool
) -> None:
    """Twelve requests whose prompts share prefixes, through three rows and a pool of 8 blocks of 4 positions (three
    requests may want up to 29 each): newer requests are preempted and read their tokens again, prompts find their
    prefixes in the cache, and still each request gets the tokens its prompt alone gives, every row is fed its own
    tokens in order into blocks that hold its earlier ones, and every block is free at the end."""
    engine, runner = start(loaded, kind, kv_blocks=9, block_size=4, deterministic=deterministic)
    try:
        batch = requests(12)
        received = run_together(engine, batch)
        assert_own_tokens(received, batch)
        for request in batch:
            end = received[request.request_id][-1]
            assert isinstance(end, End) and end.cached_tokens % 4 == 0
            assert end.cached_tokens < len(request.prompt_ids)
        assert runner.wrong == []
        assert engine.preemptions > 0 and runner.evicted
        queried, hit = engine.prefix_cache_tokens()
        assert queried == sum(len(r.prompt_ids) for r in batch) and hit > 0
        assert hit == sum(e[-1].cached_tokens for e in received.values())
        assert engine.kv_cache_usage() == 0
    finally:
        engine.close()


@pytest.mark.parametrize("kind", KINDS)
def test_rows_of_several_tokens_keep_the_accepted_ones_and_end_inside_a_row(loaded: LoadedModel, kind: str) -> None:
    """Decode rows of 3 tokens (the last output and two proposed after it: right, half right or wrong): each request
    gets its own tokens at the right positions, a rejected tail is never output, a stop string ends the request at
    its token whatever follows it in the row, and max_tokens at a row's last token (proposals never run past it)."""
    rng = random.Random(0)

    def propose(sequence: Admitted, limit: int) -> tuple[int, ...]:
        request = sequence.request
        following = expected_tokens(request.prompt_ids, request.max_tokens + 2)[len(sequence.output_ids) :][:limit]
        return tuple(t if rng.random() < 0.7 else rng.randrange(1, len(WORDS)) for t in following)

    engine, runner = start(loaded, kind, proposer=propose)
    try:
        batch = requests(6)
        long = Request((3, 1, 4, 1, 5), max_tokens=12, request_id="long")
        tokens = expected_tokens(long.prompt_ids, 12)
        stop_at = tokens.index(tokens[7])
        stopped = Request(long.prompt_ids, max_tokens=12, request_id="stopped", stop=(WORDS[tokens[7]],))
        received = run_together(engine, [long, stopped, *batch])
    finally:
        engine.close()
    assert token_ids(received["long"]) == tokens and received["long"][-1].tokens_out == 12
    end = received["stopped"][-1]
    assert isinstance(end, End) and end.stop_reason is StopReason.STOP_SEQUENCE
    assert token_ids(received["stopped"]) == tokens[: stop_at + 1] and end.tokens_out == stop_at + 1
    assert_own_tokens(received, batch)
    assert runner.wrong == []
    assert {1, 2, 3} <= set(runner.accepted)  # rows accepting none, one and both proposals


@pytest.mark.parametrize("kind", KINDS)
def test_a_stop_string_ends_a_request_while_its_next_step_runs(loaded: LoadedModel, kind: str) -> None:
    """A stop string matched by a token whose next step is already launched ends the request there; the others
    keep their tokens and positions."""
    engine, runner = start(loaded, kind)
    try:
        batch = requests(6)
        long = Request((3, 1, 4, 1, 5), max_tokens=12, request_id="long")
        tokens = expected_tokens(long.prompt_ids, 12)
        stop_at = tokens.index(tokens[5])  # the first time that word comes
        stopped = Request(long.prompt_ids, max_tokens=12, request_id="stopped", stop=(WORDS[tokens[5]],))
        received = run_together(engine, [long, stopped, *batch])
        assert token_ids(received["long"]) == tokens
        end = received["stopped"][-1]
        assert isinstance(end, End) and end.stop_reason is StopReason.STOP_SEQUENCE
        assert token_ids(received["stopped"]) == tokens[: stop_at + 1] and end.tokens_out == stop_at + 1
        assert_own_tokens(received, batch)
        assert runner.wrong == []
    finally:
        engine.close()


@pytest.mark.parametrize("kind", KINDS)
def test_text_held_back_for_a_stop_string_comes_out_when_the_request_ends(loaded: LoadedModel, kind: str) -> None:
    """Text that could begin a stop string is held back while it might; when the request ends at max_tokens without
    the stop string, the rest comes out before End: the pieces add up to the whole text."""
    engine, _ = start(loaded, kind)
    try:
        request = Request((3, 1, 4), max_tokens=9, request_id="held", stop=("w1 w2 w3 w4 w5 w6 w7 w8 w9 w1",))
        events = run_together(engine, [request])["held"]
        tokens = expected_tokens(request.prompt_ids, request.max_tokens)
        assert isinstance(events[-1], End) and events[-1].stop_reason is StopReason.MAX_TOKENS
        assert token_ids(events) == tokens
        pieces = [e for e in events if isinstance(e, Token)]
        assert "".join(e.text for e in pieces) == engine.model.detokenize(tuple(tokens))
        assert pieces[-1].token_ids == () and pieces[-1].text  # the held text, released at the end
    finally:
        engine.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_cancelled_request_frees_its_row_and_blocks_for_the_next(loaded: LoadedModel, kind: str) -> None:
    """A request cancelled at its fourth token (between two steps, as a client that goes away) ends CANCELLED while
    the others run; a waiting request takes its row, its blocks go back to the pool, and every request gets its own
    tokens."""
    engine, runner = start(loaded, kind, max_batch=2)
    try:
        events: queue.SimpleQueue[Event] = queue.SimpleQueue()

        def sink(event: Event) -> None:
            events.put(event)
            if isinstance(event, Token) and event.index == 3:
                engine.cancel("long")

        engine.submit(Request((1, 2), max_tokens=200, request_id="long"), sink)
        batch = requests(4)
        received = run_together(engine, batch)
        long = [events.get(timeout=10)]
        while not isinstance(long[-1], End | Error):
            long.append(events.get(timeout=10))
        end = long[-1]
        assert isinstance(end, End) and end.stop_reason is StopReason.CANCELLED and 4 <= end.tokens_out < 10
        assert token_ids(long) == expected_tokens((1, 2), end.tokens_out)
        assert_own_tokens(received, batch)
        assert runner.wrong == [] and engine.kv_cache_usage() == 0
    finally:
        engine.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_forward_that_fails_once_ends_the_requests_in_it_and_the_engine_goes_on(
    loaded: LoadedModel, kind: str
) -> None:
    engine, runner = start(loaded, kind)
    try:
        runner.fail_at[4] = RuntimeError("boom")
        batch = requests(6)
        received = run_together(engine, batch)
        failed = [r for r in batch if isinstance(received[r.request_id][-1], Error)]
        assert failed and all(
            received[r.request_id][-1] == Error(r.request_id, ErrorCode.INFERENCE_FAILED, "inference failed: boom")
            for r in failed
        )
        assert engine.fault is None
        again = requests(3)
        received = run_together(engine, again)
        assert_own_tokens(received, again)
    finally:
        engine.close()


def test_a_request_that_arrives_during_the_poisoning_step_fails_too(loaded: LoadedModel) -> None:
    """A request still in the inbox when the device fails (never admitted: no row, no blocks) ends with the fault's
    error like the admitted ones, and the engine thread stops cleanly."""
    engine, runner = start(loaded, "eager", max_batch=2)
    events: queue.SimpleQueue[Event] = queue.SimpleQueue()
    try:
        runner.fail_at[3] = Poison("an illegal memory access")
        runner.before_failing = lambda: engine.submit(Request((1, 2), max_tokens=4, request_id="late"), events.put)
        received = run_together(engine, [Request((1, 2, 3), max_tokens=10, request_id=f"r{i}") for i in range(2)])
        assert all(isinstance(received[f"r{i}"][-1], Error) for i in range(2))
        late = events.get(timeout=10)
        assert isinstance(late, Error) and late.request_id == "late" and "poisoned" in late.message
        engine._thread.join(timeout=5)
        assert not engine._thread.is_alive()
    finally:
        engine.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_poisoning_fault_fails_every_request_and_stops_the_engine(loaded: LoadedModel, kind: str) -> None:
    engine, runner = start(loaded, kind, max_batch=2)
    try:
        runner.fail_at[3] = Poison("an illegal memory access")
        batch = [Request((1, 2, 3), max_tokens=10, request_id=f"r{i}") for i in range(5)]
        received = run_together(engine, batch)  # the two running and the three waiting
        for request in batch:
            error = received[request.request_id][-1]
            assert isinstance(error, Error) and error.code is ErrorCode.INFERENCE_FAILED
            assert "the fake device is poisoned" in error.message
        assert engine.fault == "the fake device is poisoned"
        later = run_together(engine, requests(1))["r0"]
        assert isinstance(later[-1], Error) and "poisoned" in later[-1].message
        engine._thread.join(timeout=5)
        assert not engine._thread.is_alive()
    finally:
        engine.close()


def test_an_exception_in_output_processing_is_an_internal_error_of_that_request(
    loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    token = OutputProcessor.token

    def broken(self: OutputProcessor, sequence, *args: object) -> bool:
        if sequence.request_id == "r1" and sequence.output.tokens:
            raise KeyError("a bug")
        return token(self, sequence, *args)

    monkeypatch.setattr(OutputProcessor, "token", broken)
    engine, runner = start(loaded, "async")
    try:
        batch = requests(4)
        received = run_together(engine, batch)
        error = received["r1"][-1]
        assert isinstance(error, Error) and error.code is ErrorCode.INTERNAL_ERROR and "a bug" in error.message
        assert_own_tokens(received, [batch[0], *batch[2:]])
        assert engine.fault is None and runner.wrong == []
    finally:
        engine.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_constrained_row_draws_under_the_mask_of_all_its_tokens_while_steps_run_ahead(
    loaded: LoadedModel, kind: str
) -> None:
    """Constrained requests beside free ones: each constrained draw happens under a mask filled after every earlier
    token of its request; on the asynchronous runner their steps are still launched before the previous one is
    collected (chained rows), with the sampling held until the masks are filled, and every request gets its own
    tokens."""
    engine, runner = start(loaded, kind)
    engine.model.grammars.matcher = lambda *args: FakeMatcher()  # type: ignore[method-assign]
    try:
        batch = requests(3)
        batch = [
            Request(r.prompt_ids, max_tokens=12, request_id=r.request_id, grammar=object() if i != 1 else None)  # type: ignore[arg-type]
            for i, r in enumerate(batch)
        ]
        received = run_together(engine, batch)
    finally:
        engine.close()
    assert_own_tokens(received, batch)
    assert runner.wrong == []
    if kind == "async":
        assert runner.held_steps > 0 and runner.chained > 0
    else:
        assert runner.held_steps == 0
