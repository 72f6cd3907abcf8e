"""The scheduler alone: no model, no tensors; the "runner" is the test, which feeds it chosen tokens."""

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from rbee_worker.engine.config import EngineConfig
from rbee_worker.engine.detokenizer import Detokenizer
from rbee_worker.engine.scheduler import Chunk, Plan, Scheduler, Sequence
from rbee_worker.engine.types import End, Error, ErrorCode, Event, Request, StopReason, Token

WORDS = ["<eos>", "a", "b", "c", "stop", "x"]
EOS = 0
BYTES_PER_TOKEN = 10


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="x"))
    tokenizer.pre_tokenizer = Whitespace()
    return tokenizer


class Harness:
    """A scheduler with its retired hook recorded, and sequences whose events are recorded."""

    def __init__(self, tokenizer: Tokenizer, **config: object) -> None:
        self.tokenizer = tokenizer
        self.ended: list[tuple[str, End | Error]] = []
        self.scheduler = Scheduler(
            EngineConfig(**config), frozenset({EOS}), BYTES_PER_TOKEN, lambda s, t: self.ended.append((s.request_id, t))
        )
        self.events: dict[str, list[Event]] = {}

    def add(self, request_id: str, prompt_len: int, max_tokens: int = 8, stop: tuple[str, ...] = ()) -> Sequence:
        request = Request(tuple([1] * prompt_len), max_tokens=max_tokens, stop=stop, request_id=request_id)
        events = self.events.setdefault(request_id, [])
        sequence = Sequence(request, events.append, 7, Detokenizer(self.tokenizer, stop))
        self.scheduler.add(sequence)
        return sequence

    def run_prefill(self, plan: Plan) -> None:
        """What the runner and engine do with a plan's prompt chunks: cache them; a completed prompt samples token 1."""
        for group in plan.prefill:
            for chunk in group:
                self.scheduler.prefilled(chunk)
                if chunk.completes_prompt:
                    self.scheduler.accept(chunk.sequence, 1, None)


def shape(plan: Plan) -> list[list[tuple[str, int, int]]]:
    return [[(c.sequence.request_id, c.start, c.count) for c in group] for group in plan.prefill]


def test_slots_go_lowest_first_and_waiting_requests_take_freed_ones(tokenizer: Tokenizer) -> None:
    h = Harness(tokenizer, max_batch=2)
    a, b, c = h.add("a", 3), h.add("b", 3), h.add("c", 3)
    plan = h.scheduler.schedule()
    assert [s.request_id for s in plan.started] == ["a", "b"] and (a.slot, b.slot, c.slot) == (0, 1, None)
    h.scheduler.finish(a, StopReason.CANCELLED)
    assert a.slot is None and h.ended[0][0] == "a"
    plan = h.scheduler.schedule()
    assert plan.started == [c] and c.slot == 0


def test_prefill_budget_oldest_first_and_grouping(tokenizer: Tokenizer) -> None:
    h = Harness(tokenizer, max_batch=4, prefill_chunk=8)
    h.add("long", 20)
    h.add("s1", 3)
    plan = h.scheduler.schedule()
    assert shape(plan) == [[("long", 0, 8)]]  # the oldest takes the whole budget
    h.run_prefill(plan)
    h.run_prefill(plan := h.scheduler.schedule())
    assert shape(plan) == [[("long", 8, 8)]]
    plan = h.scheduler.schedule()
    # 4 tokens of "long" and 3 of s1 (padded to 4): 2 rows x 4 <= 8 share one forward.
    assert shape(plan) == [[("long", 16, 4), ("s1", 0, 3)]]
    h.run_prefill(plan)
    plan = h.scheduler.schedule()
    assert not plan.prefill and [s.request_id for s in plan.decode] == ["long", "s1"]


def test_rows_padded_beyond_the_chunk_get_a_forward_each(tokenizer: Tokenizer) -> None:
    h = Harness(tokenizer, max_batch=4, prefill_chunk=8)
    h.add("a", 5)
    h.add("b", 3)
    assert shape(h.scheduler.schedule()) == [[("a", 0, 5)], [("b", 0, 3)]]  # 2 x 5 > 8


def test_deterministic_chunks_split_at_multiples_of_the_chunk(tokenizer: Tokenizer) -> None:
    h = Harness(tokenizer, max_batch=4, prefill_chunk=8, deterministic=True)
    h.add("a", 3)
    h.add("b", 12)
    plan = h.scheduler.schedule()
    # b's first chunk does not fit in the 5 tokens left, so it waits rather than split at another offset.
    assert shape(plan) == [[("a", 0, 3)]]
    h.run_prefill(plan)
    assert shape(h.scheduler.schedule()) == [[("b", 0, 8)]]


def test_eos_ends_without_counting_the_token(tokenizer: Tokenizer) -> None:
    h = Harness(tokenizer)
    a = h.add("a", 2)
    h.run_prefill(h.scheduler.schedule())
    h.scheduler.accept(a, 2, None)
    h.scheduler.accept(a, EOS, None)
    end = h.ended[0][1]
    assert isinstance(end, End) and end.stop_reason is StopReason.EOS and end.tokens_out == 2
    assert end.kv_cache_bytes == 2 * BYTES_PER_TOKEN  # the prompt's positions (the test ran no decode step)
    assert "".join(e.text for e in h.events["a"] if isinstance(e, Token)) == "a b"


def test_max_tokens_and_kv_bytes(tokenizer: Tokenizer) -> None:
    h = Harness(tokenizer)
    a = h.add("a", 4, max_tokens=3)
    h.run_prefill(h.scheduler.schedule())
    for token in (2, 3):
        assert h.scheduler.has_tokens_to_launch(a)
        a.cached += 1  # the engine caches the previous token with each decode step
        h.scheduler.accept(a, token, None)
    end = h.ended[0][1]
    assert isinstance(end, End) and end.stop_reason is StopReason.MAX_TOKENS and end.tokens_out == 3
    assert end.kv_cache_bytes == (4 + 2) * BYTES_PER_TOKEN  # prompt and every output token but the last
    assert not h.scheduler.has_tokens_to_launch(a)


def test_stop_string_ends_and_is_not_released(tokenizer: Tokenizer) -> None:
    h = Harness(tokenizer)
    a = h.add("a", 2, stop=("stop",))
    h.run_prefill(h.scheduler.schedule())
    h.scheduler.accept(a, 4, None)  # "stop"
    end = h.ended[0][1]
    assert isinstance(end, End) and end.stop_reason is StopReason.STOP_SEQUENCE and end.stop_sequence == "stop"
    assert "stop" not in "".join(e.text for e in h.events["a"] if isinstance(e, Token))


def test_launch_accounting_counts_tokens_in_flight(tokenizer: Tokenizer) -> None:
    h = Harness(tokenizer)
    a = h.add("a", 2, max_tokens=3)
    h.run_prefill(h.scheduler.schedule())  # 1 token out
    a.launched = 2  # two steps in flight: 3 tokens in all
    assert not h.scheduler.has_tokens_to_launch(a)
    a.launched = 1
    assert h.scheduler.has_tokens_to_launch(a)


def test_cancelled_flag_ends_at_the_next_round_and_fail_reports_the_error(tokenizer: Tokenizer) -> None:
    h = Harness(tokenizer)
    a, b = h.add("a", 2), h.add("b", 2)
    a.cancelled = True
    plan = h.scheduler.schedule()
    assert plan.started == [b] and h.ended[0][0] == "a" and h.ended[0][1].stop_reason is StopReason.CANCELLED
    h.scheduler.fail(b, ErrorCode.INFERENCE_FAILED, "boom")
    assert h.ended[1] == ("b", Error("b", ErrorCode.INFERENCE_FAILED, "boom"))
    assert not h.scheduler.active and h.scheduler.kv_positions() == 0


def test_a_reused_id_is_a_different_sequence(tokenizer: Tokenizer) -> None:
    h = Harness(tokenizer)
    first = h.add("a", 2)
    h.scheduler.schedule()
    h.scheduler.finish(first, StopReason.CANCELLED)
    second = h.add("a", 2)
    assert not h.scheduler.is_running(first) and h.scheduler.is_running(second)


def test_chunk_views(tokenizer: Tokenizer) -> None:
    h = Harness(tokenizer)
    a = h.add("a", 5)
    chunk = Chunk(a, 3, 2)
    assert chunk.token_ids == (1, 1) and chunk.completes_prompt
