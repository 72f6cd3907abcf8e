"""The scheduler alone: no model, no tensors, no text; the test is the runner and records progress as a step would."""

from collections.abc import Sequence as Tokens

import numpy as np
from conftest import executed

from rbee_worker.engine.engine_config import EngineConfig
from rbee_worker.engine.plan import Chunk, Ending, Lost, Output, Plan, Sequence
from rbee_worker.engine.request_types import Request, StopReason
from rbee_worker.engine.runners.llama_cpp.prompt_cache import PromptCache, SavedPrefixes
from rbee_worker.engine.runners.protocol import Capabilities, KvGeometry
from rbee_worker.engine.scheduling.scheduler import Scheduler


class Harness:
    def __init__(self, mixed_batches: bool = False, blocks: int = 64, **config: object) -> None:
        engine_config = EngineConfig(**config)
        kv = KvGeometry(blocks, engine_config.block_size, 1024, 1)
        self.scheduler = Scheduler(engine_config, Capabilities(mixed_batches), kv)
        self.pool = self.scheduler.kv.blocks

    def add(self, request_id: str, prompt_len: int = 0, max_tokens: int = 8, prompt: Tokens[int] = ()) -> Sequence:
        """A request of `prompt` (default: `prompt_len` ones)."""
        request = Request(tuple(prompt) or tuple([1] * prompt_len), max_tokens=max_tokens, request_id=request_id)
        sequence = Sequence(request, 7, Output(lambda _: None, None))  # type: ignore[arg-type] -- no text here
        self.scheduler.add(sequence)
        return sequence

    def run(self, plan: Plan, token: int = 1) -> None:
        """What the executor gives back for a plan: every chunk computed; a chunk that samples and every decode row
        give a token."""
        self.scheduler.update(executed(plan, token))
        self.pool.check()

    def round(self, token: int = 1) -> Plan:
        plan = self.scheduler.schedule()
        self.run(plan, token)
        return plan


def shape(plan: Plan) -> list[list[tuple[str, int, int]]]:
    return [[(c.sequence.request_id, c.start, c.count) for c in f.chunks] for f in plan.forwards if f.chunks]


def decoding(plan: Plan) -> list[list[str]]:
    return [[d.sequence.request_id for d in f.decode] for f in plan.forwards if f.decode]


def test_rows_go_lowest_first_and_waiting_requests_take_freed_ones() -> None:
    """Rows go lowest first; a freed request gives back its row and its blocks, and a waiting one takes the row."""
    h = Harness(max_batch=2)
    a, b, c = h.add("a", 3), h.add("b", 3), h.add("c", 3)
    plan = h.scheduler.schedule()
    assert plan.started == [a, b] and (a.row, b.row, c.row) == (0, 1, None)
    assert h.scheduler.running == [a, b] and list(h.scheduler.waiting) == [c] and len(h.scheduler) == 3
    assert len(a.table.blocks) == 1 and h.pool.used_blocks == 2  # each prompt chunk took its block
    h.scheduler.free(a)
    assert a.row is None and a.finished and h.scheduler.get("a") is None
    assert a.table.blocks == [] and h.pool.used_blocks == 1
    plan = h.scheduler.schedule()
    assert plan.started == [c] and c.row == 0 and h.scheduler.running == [b, c]
    h.pool.check()


def test_a_waiting_request_that_ends_leaves_the_queue() -> None:
    h = Harness(max_batch=1)
    a, b = h.add("a", 3), h.add("b", 3)
    h.scheduler.schedule()
    h.scheduler.free(b)
    assert b.finished and not h.scheduler.waiting and h.scheduler.running == [a] and len(h.scheduler) == 1
    assert b.table.blocks == [] and h.pool.used_blocks == 1  # a waiting request never held blocks


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
    """`cached` counts the positions computed, the table grows a block at a time to cover the next one, and a freed
    sequence holds no block."""
    h = Harness(block_size=4)
    a = h.add("a", 4, max_tokens=3)
    h.run(h.scheduler.schedule())
    assert a.cached == 4 and a.output_ids == [1] and len(a.table.blocks) == 1
    plan = h.scheduler.schedule()  # the decode row at position 4 needs a second block
    assert decoding(plan) == [["a"]] and len(a.table.blocks) == 2 and a.launched == 1
    a.output_ids.append(2)  # as if the token in flight were its second: the third would be its last
    assert not h.scheduler.wants_token(a)
    a.output_ids.pop()
    (generated,) = h.scheduler.update(executed(plan, 2))
    assert generated.stop is None and a.cached == 5 and a.launched == 0 and a.output_ids == [1, 2]
    assert h.scheduler.wants_token(a)
    (generated,) = h.scheduler.update(executed(h.scheduler.schedule(), 3))
    assert generated.stop is StopReason.MAX_TOKENS  # the last one max_tokens allows
    assert h.pool.used_blocks == 2
    h.scheduler.free(a)
    assert not h.scheduler.wants_token(a) and h.pool.used_blocks == 0 and a.table.blocks == []
    h.pool.check()


def test_a_request_whose_caller_is_gone_is_abandoned_at_the_next_round() -> None:
    h = Harness()
    a, b = h.add("a", 2), h.add("b", 2)
    a.output.undeliverable = True
    plan = h.scheduler.schedule()
    assert [c.sequence for c in plan.forwards[0].chunks] == [b]
    assert a.table.blocks == []  # it is planned nothing, so it takes no block
    assert h.scheduler.update([])[0] == Ending(a, StopReason.CANCELLED)


def test_a_reused_id_is_a_different_sequence() -> None:
    h = Harness()
    first = h.add("a", 2)
    h.scheduler.schedule()
    h.scheduler.free(first)
    second = h.add("a", 2)
    assert first.finished and not second.finished and h.scheduler.get("a") is second


def test_chunk_views() -> None:
    """A chunk's tokens come from the prompt, then (after a preemption) the output; only the chunk that ends a prompt
    of a sequence with no output yet samples."""
    h = Harness()
    a = h.add("a", prompt=(5, 6, 7, 8, 9))
    chunk = Chunk(a, 3, 2)
    assert chunk.token_ids == (8, 9) and chunk.samples and not Chunk(a, 0, 3).samples
    a.output_ids = [10, 11, 12]  # as if preempted after three tokens: it reads its prompt and two of them again
    assert a.prefill_end == 7
    assert Chunk(a, 3, 4).token_ids == (8, 9, 10, 11) and not Chunk(a, 3, 4).samples
    assert a.token_ids(0, 7) == (5, 6, 7, 8, 9, 10, 11)


# -- the prefix cache -------------------------------------------------------------------------------------------


def test_a_prompt_takes_the_cached_prefix_at_its_first_chunk_in_whole_blocks_never_all_of_it() -> None:
    """A prompt whose first blocks another request computed starts after them, sharing those blocks; a prompt that is
    wholly cached still computes its last block (its last token gives the logits of the first output); the lookups
    are counted in the pool's query and hit counters."""
    h = Harness(block_size=4, prefill_chunk=64)
    a = h.add("a", prompt=range(1, 11))  # 10 tokens: blocks [1..4], [5..8] registered once computed
    h.round()
    assert a.cached == 10 and len(a.table.keys) == 2 and a.cached_prompt_tokens == 0
    b = h.add("b", prompt=(*range(1, 9), 20, 21, 22))  # shares a's two full blocks
    c = h.add("c", prompt=range(1, 9))  # exactly a's two blocks: only the first is taken
    d = h.add("d", prompt=(1, 2, 3, 99, 5, 6, 7, 8, 9))  # differs inside the first block: nothing
    plan = h.scheduler.schedule()
    assert sorted(c for f in shape(plan) for c in f) == [("b", 8, 3), ("c", 4, 4), ("d", 0, 9)]
    assert b.table.blocks[:2] == a.table.blocks[:2] and c.table.blocks[:1] == a.table.blocks[:1]
    assert not set(d.table.blocks) & set(a.table.blocks)
    assert (b.cached_prompt_tokens, c.cached_prompt_tokens, d.cached_prompt_tokens) == (8, 4, 0)
    assert h.pool.queried_tokens == 10 + 11 + 8 + 9 and h.pool.hit_tokens == 12
    h.run(plan)
    assert b.output_ids == c.output_ids == d.output_ids == [1]


def test_without_prefix_caching_nothing_is_found_but_the_queries_are_counted() -> None:
    h = Harness(block_size=4, prefix_caching=False)
    h.add("a", prompt=range(1, 11))
    h.round()
    b = h.add("b", prompt=range(1, 11))
    assert shape(h.scheduler.schedule()) == [[("b", 0, 10)]]
    assert b.cached_prompt_tokens == 0 and h.pool.queried_tokens == 20 and h.pool.hit_tokens == 0


def test_a_freed_request_leaves_its_blocks_cached_for_the_next() -> None:
    """The blocks of an ended request stay in the prefix cache while no one needs them: the same prompt again finds
    them, in the very blocks where they were computed."""
    h = Harness(block_size=4)
    a = h.add("a", prompt=range(1, 10), max_tokens=1)
    h.round()
    blocks = list(a.table.blocks)
    h.scheduler.free(a)
    assert h.pool.used_blocks == 0
    again = h.add("again", prompt=range(1, 10))
    assert shape(h.scheduler.schedule()) == [[("again", 8, 1)]] and again.table.blocks[:2] == blocks[:2]


def test_deterministic_mode_caches_only_prompt_blocks_inside_whole_chunks() -> None:
    """In deterministic mode only blocks inside whole prefill chunks are served and kept: what any request computes
    alike whatever else runs."""
    prompt = tuple(range(1, 14))  # 13 tokens: chunks of 8 make one whole chunk, blocks [1..4] and [5..8]
    for deterministic, found in ((False, 12), (True, 8)):
        h = Harness(block_size=4, prefill_chunk=8, deterministic=deterministic)
        a = h.add("a", prompt=prompt, max_tokens=20)
        for _ in range(8):  # the prompt, then decode rows well past it
            h.round()
        assert a.cached == 19
        b = h.add("b", prompt=(*prompt, 40, 41, 42, 43, 44, 45, 46))
        h.scheduler.schedule()
        assert b.cached == b.cached_prompt_tokens == found, deterministic


# -- preemption -------------------------------------------------------------------------------------------------


def test_a_full_pool_preempts_the_newest_request_which_reads_its_tokens_again() -> None:
    """Two requests in a pool of four blocks of 4: when the older one's decode row needs a block, the newer is
    preempted (its row kept, its blocks freed, its row reported in the plan); it reads its prompt and all but its last
    output again as a prompt as blocks come free, without sampling, then decodes on from where it was."""
    h = Harness(block_size=4, blocks=5, max_batch=2, prefix_caching=False)
    a = h.add("a", prompt=(1, 2, 3, 4, 5, 6), max_tokens=5)
    b = h.add("b", prompt=(7, 8, 9, 10, 11, 12), max_tokens=20)
    h.round(token=30)  # both prompts: two blocks each
    h.round(token=31)  # position 6
    h.round(token=32)  # position 7
    assert (a.cached, b.cached, h.pool.free_blocks) == (8, 8, 0)
    plan = h.scheduler.schedule()  # a's position 8 needs a third block: b goes
    assert plan.preempted == [b] and b.row == 1 and h.scheduler.preemptions == 1
    assert b.row == 1 and b.output_ids == [30, 31, 32] and b.prefilling and b.prefill_end == 8
    assert h.scheduler.running == [a, b]
    # The block left over takes the first 4 of the 8 tokens b reads again.
    assert decoding(plan) == [["a"]] and shape(plan) == [[("b", 0, 4)]] and len(b.table.blocks) == 1
    assert not plan.forwards[0].chunks[0].samples
    h.run(plan, token=33)
    assert b.output_ids == [30, 31, 32] and b.cached == 4
    plan = h.round(token=34)  # a: position 9; b waits for a block
    assert decoding(plan) == [["a"]] and not shape(plan) and b.cached == 4 and h.scheduler.preemptions == 1
    assert a.output_ids == [30, 31, 32, 33, 34] and not h.scheduler.wants_token(a)
    h.scheduler.free(a)  # max_tokens
    plan = h.scheduler.schedule()
    assert shape(plan) == [[("b", 4, 4)]] and plan.forwards[0].chunks[0].token_ids == (11, 12, 30, 31)
    assert not plan.forwards[0].chunks[0].samples
    h.run(plan, token=99)  # no token comes of it
    assert b.output_ids == [30, 31, 32] and b.cached == 8 and not b.prefilling
    plan = h.scheduler.schedule()
    assert decoding(plan) == [["b"]] and h.scheduler.wants_token(b)


def test_a_decode_row_with_nothing_newer_to_preempt_preempts_itself() -> None:
    """The newest request holding blocks gives them up when its own decode row finds no free block, and waits to
    read its tokens again while the older request goes on."""
    h = Harness(block_size=4, blocks=5, max_batch=2, prefix_caching=False)
    a = h.add("a", prompt=tuple(range(1, 12)), max_tokens=20)  # 11 tokens: 3 blocks
    b = h.add("b", prompt=(20, 21, 22, 23), max_tokens=20)  # 4 tokens: the last block
    h.round()
    assert h.pool.free_blocks == 0
    plan = h.scheduler.schedule()  # a's position 11 fits its blocks; b's position 4 needs a second block
    assert plan.preempted == [b] and b.row == 1 and decoding(plan) == [["a"]] and not shape(plan)
    assert (b.cached, b.table.blocks, b.prefill_end) == (0, [], 4)
    h.run(plan)
    plan = h.round()  # a's position 12 takes the block b gave back; b waits
    assert decoding(plan) == [["a"]] and not shape(plan) and not plan.preempted and b.table.blocks == []
    assert a.cached == 13 and len(a.table.blocks) == 4
    assert h.scheduler.preemptions == 1


def test_a_prompt_chunk_waits_for_blocks_rather_than_preempting_older_requests() -> None:
    """A newer request's prompt takes what the pool has left and then waits; it never preempts an older request."""
    h = Harness(block_size=4, blocks=5, max_batch=2, prefix_caching=False)
    a = h.add("a", prompt=tuple(range(1, 12)), max_tokens=2)  # 11 tokens: 3 blocks
    b = h.add("b", prompt=tuple(range(20, 32)), max_tokens=2)  # 12 tokens: 3 blocks, one left for it
    plan = h.round()
    assert shape(plan) == [[("a", 0, 11), ("b", 0, 4)]] and not plan.preempted
    plan = h.round()
    assert decoding(plan) == [["a"]] and not shape(plan) and not plan.preempted
    assert (a.cached, b.cached, len(a.table.blocks), len(b.table.blocks)) == (12, 4, 3, 1)
    h.scheduler.free(a)
    assert shape(h.scheduler.schedule()) == [[("b", 4, 8)]]
    assert h.scheduler.preemptions == 0


def test_a_prompt_that_waited_for_blocks_reports_the_prefix_it_then_found() -> None:
    """A prompt whose first lookup found nothing and which then waited for blocks looks up again when it gets to run;
    the prefix found then is what it did not compute, so it is what End.cached_tokens and the pool's hit counter
    report (its prompt is still queried once)."""
    h = Harness(block_size=4, blocks=4, max_batch=2)  # 3 blocks
    a = h.add("a", prompt=tuple(range(1, 12)), max_tokens=1)  # 11 tokens: all 3 blocks; its first 2 registered
    b = h.add("b", prompt=tuple(range(1, 10)), max_tokens=1)  # a's first 8 tokens and one more
    plan = h.round()
    assert shape(plan) == [[("a", 0, 11)]] and b.table.blocks == []  # b found nothing yet, and no block was free
    h.scheduler.free(a)
    plan = h.round()
    assert shape(plan) == [[("b", 8, 1)]]  # its first 8 tokens came from the cache
    assert b.cached_prompt_tokens == 8
    assert (h.pool.queried_tokens, h.pool.hit_tokens) == (11 + 9, 8)


def test_requests_of_the_same_prompt_wait_for_the_first_ones_blocks() -> None:
    """Three requests of one 20-token prompt admitted together (`n` 3) in chunks of 8: the first computes it; the
    others wait while it computes the whole blocks they could take (16 of 20 tokens: the last token is always
    computed), then find them in the prefix cache and compute only their last block; waiting, they leave the round's
    budget to another prompt."""
    h = Harness(block_size=4, prefill_chunk=8)
    first, second, third = (h.add(name, prompt=range(1, 21)) for name in ("a", "b", "c"))
    other = h.add("d", prompt=range(50, 58))
    assert shape(h.round()) == [[("a", 0, 8)]]
    assert shape(h.round()) == [[("a", 8, 8)]]
    assert shape(h.round()) == [[("a", 16, 4), ("b", 16, 4)]]
    assert shape(h.round()) == [[("c", 16, 4), ("d", 0, 4)]]
    assert (second.cached_prompt_tokens, third.cached_prompt_tokens, first.cached_prompt_tokens) == (16, 16, 0)
    assert second.table.blocks[:4] == third.table.blocks[:4] == first.table.blocks[:4] and other.cached == 4


def test_a_prefix_the_runtime_holds_is_restored_by_the_plan_and_a_lost_one_read_again() -> None:
    """Where the runtime keeps prompts itself (llama.cpp's saved states: Runner.prefixes), the scheduler looks them
    up while planning, without calling the runtime: the plan restores the prefix found and the chunk starts after it.
    A restore that fails (Lost) leaves the prompt to be read from the start, looked up no more."""
    config = EngineConfig(block_size=4, prefill_chunk=64)
    prompts = PromptCache(1 << 20)
    prompts.insert(tuple(range(1, 13)), np.zeros(8, dtype=np.uint8))  # a saved state of 12 tokens
    prefixes = SavedPrefixes(prompts, [[] for _ in range(config.max_batch)], [0] * config.max_batch, 4, False)
    scheduler = Scheduler(
        config, Capabilities(False), KvGeometry(64, 4, 1024, 1, shared_blocks=False), prefixes=prefixes
    )
    sequence = Sequence(Request(tuple(range(1, 21)), max_tokens=2, request_id="a"), 7, Output(lambda _: None, None))  # type: ignore[arg-type]
    scheduler.add(sequence)
    plan = scheduler.schedule()
    [(restored, hit)] = plan.restores
    assert restored is sequence and hit.token_ids == tuple(range(1, 13)) and hit.key == tuple(range(1, 13))
    assert shape(plan) == [[("a", 12, 8)]] and sequence.cached_prompt_tokens == 12
    scheduler.update([Lost(sequence)])
    assert (sequence.cached, sequence.table.blocks, sequence.cached_prompt_tokens) == (0, [], 0)
    assert scheduler.kv.blocks.hit_tokens == 0
    plan = scheduler.schedule()
    assert not plan.restores and shape(plan) == [[("a", 0, 20)]]
