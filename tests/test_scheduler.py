"""The scheduler alone: no model, no tensors, no text; the test is the runner and records progress as a step would."""

from rbee_worker.engine.config import EngineConfig
from rbee_worker.engine.output import Output
from rbee_worker.engine.scheduler import Chunk, Plan, Scheduler, Sequence
from rbee_worker.engine.types import Request


class Harness:
    def __init__(self, mixed_batches: bool = False, **config: object) -> None:
        self.scheduler = Scheduler(EngineConfig(**config), mixed_batches)

    def add(self, request_id: str, prompt_len: int, max_tokens: int = 8) -> Sequence:
        request = Request(tuple([1] * prompt_len), max_tokens=max_tokens, request_id=request_id)
        sequence = Sequence(request, 7, Output(lambda _: None, None))  # type: ignore[arg-type] -- no text here
        self.scheduler.add(sequence)
        return sequence

    def run(self, plan: Plan) -> None:
        """What a step does with a plan: every forward's keys and values cached; a completed prompt and every decode
        row give a token."""
        for forward in plan.forwards:
            self.scheduler.computed(forward.chunks, forward.decode)
            for sequence in [c.sequence for c in forward.chunks if c.completes_prompt] + forward.decode:
                self.scheduler.append(sequence, 1)


def shape(plan: Plan) -> list[list[tuple[str, int, int]]]:
    return [[(c.sequence.request_id, c.start, c.count) for c in f.chunks] for f in plan.forwards if f.chunks]


def decoding(plan: Plan) -> list[list[str]]:
    return [[s.request_id for s in f.decode] for f in plan.forwards if f.decode]


def test_slots_go_lowest_first_and_waiting_requests_take_freed_ones() -> None:
    h = Harness(max_batch=2)
    a, b, c = h.add("a", 3), h.add("b", 3), h.add("c", 3)
    plan = h.scheduler.schedule()
    assert plan.started == [a, b] and (a.slot, b.slot, c.slot) == (0, 1, None)
    assert h.scheduler.running == [a, b] and list(h.scheduler.waiting) == [c] and len(h.scheduler) == 3
    h.scheduler.free(a)
    assert a.slot is None and a.finished and h.scheduler.get("a") is None
    plan = h.scheduler.schedule()
    assert plan.started == [c] and c.slot == 0 and h.scheduler.running == [b, c]


def test_a_waiting_request_that_ends_leaves_the_queue() -> None:
    h = Harness(max_batch=1)
    a, b = h.add("a", 3), h.add("b", 3)
    h.scheduler.schedule()
    h.scheduler.free(b)
    assert b.finished and not h.scheduler.waiting and h.scheduler.running == [a] and len(h.scheduler) == 1


def test_prefill_budget_oldest_first_and_grouping() -> None:
    h = Harness(max_batch=4, prefill_chunk=8)
    h.add("long", 20)
    h.add("s1", 3)
    plan = h.scheduler.schedule()
    assert shape(plan) == [[("long", 0, 8)]]  # the oldest takes the whole budget
    h.run(plan)
    h.run(plan := h.scheduler.schedule())
    assert shape(plan) == [[("long", 8, 8)]]
    plan = h.scheduler.schedule()
    # 4 tokens of "long" and 3 of s1 (padded to 4): 2 rows x 4 <= 8 share one forward.
    assert shape(plan) == [[("long", 16, 4), ("s1", 0, 3)]]
    h.run(plan)
    plan = h.scheduler.schedule()
    assert not shape(plan) and decoding(plan) == [["long", "s1"]]


def test_rows_padded_beyond_the_chunk_get_a_forward_each() -> None:
    h = Harness(max_batch=4, prefill_chunk=8)
    h.add("a", 5)
    h.add("b", 3)
    assert shape(h.scheduler.schedule()) == [[("a", 0, 5)], [("b", 0, 3)]]  # 2 x 5 > 8


def test_mixed_batches_put_the_rounds_chunks_and_decode_rows_in_one_forward() -> None:
    h = Harness(mixed_batches=True, max_batch=4, prefill_chunk=8)
    h.add("a", 2)
    h.run(h.scheduler.schedule())
    h.add("b", 5)
    h.add("c", 3)
    plan = h.scheduler.schedule()
    assert len(plan.forwards) == 1 and shape(plan) == [[("b", 0, 5), ("c", 0, 3)]] and decoding(plan) == [["a"]]


def test_deterministic_chunks_split_at_multiples_of_the_chunk_and_decode_rows_run_alone() -> None:
    h = Harness(mixed_batches=True, max_batch=4, prefill_chunk=8, deterministic=True)
    h.add("a", 3)
    h.add("b", 12)
    plan = h.scheduler.schedule()
    # b's first chunk does not fit in the 5 tokens left, so it waits rather than split at another offset.
    assert shape(plan) == [[("a", 0, 3)]]
    h.run(plan)
    plan = h.scheduler.schedule()
    assert shape(plan) == [[("b", 0, 8)]] and decoding(plan) == [["a"]]  # mixed batches off, deterministic
    h.run(plan)
    h.run(h.scheduler.schedule())
    assert decoding(h.scheduler.schedule()) == [["a"], ["b"]]


def test_progress_is_counted_in_one_place_and_max_tokens_reported() -> None:
    h = Harness()
    a = h.add("a", 4, max_tokens=3)
    h.run(h.scheduler.schedule())
    assert a.cached == 4 and a.output_ids == [1]
    h.scheduler.computed([], [a])
    assert not h.scheduler.append(a, 2) and a.cached == 5
    assert h.scheduler.wants_token(a)
    a.launched = 1  # a step in flight will give the third token
    assert not h.scheduler.wants_token(a)
    a.launched = 0
    assert h.scheduler.append(a, 3)  # the last one max_tokens allows
    assert h.scheduler.kv_positions() == 5
    h.scheduler.free(a)
    assert not h.scheduler.wants_token(a) and h.scheduler.kv_positions() == 0


def test_a_request_whose_caller_is_gone_is_abandoned_at_the_next_round() -> None:
    h = Harness()
    a, b = h.add("a", 2), h.add("b", 2)
    a.output.undeliverable = True
    plan = h.scheduler.schedule()
    assert plan.abandoned == [a] and [c.sequence for c in plan.forwards[0].chunks] == [b]


def test_a_reused_id_is_a_different_sequence() -> None:
    h = Harness()
    first = h.add("a", 2)
    h.scheduler.schedule()
    h.scheduler.free(first)
    second = h.add("a", 2)
    assert first.finished and not second.finished and h.scheduler.get("a") is second


def test_chunk_views() -> None:
    h = Harness()
    a = h.add("a", 5)
    chunk = Chunk(a, 3, 2)
    assert chunk.token_ids == (1, 1) and chunk.completes_prompt
