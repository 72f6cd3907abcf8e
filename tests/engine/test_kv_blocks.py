"""The KV block pool (engine/scheduling/kv_blocks.py) alone, then the scheduler, the step loop and the output processor
driving it through random traffic.

The property test's fake model reads its KV cache: a row's next token is a function of the tokens stored at its
positions 0..p, read through its block table. So any block-table fault (a wrong block, a shared block overwritten, a
block handed out while still in use, a prefix found that does not hold the prompt's tokens, a preempted request not
read again) changes some request's tokens, and every request's tokens are compared with its solo run.
"""

import random
from collections import Counter, defaultdict
from collections.abc import Sequence as Tokens
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from rbee_worker.engine.core import EngineCore
from rbee_worker.engine.engine_config import EngineConfig
from rbee_worker.engine.output_processor import Ended
from rbee_worker.engine.plan import Output, Sequence
from rbee_worker.engine.request_types import End, Error, Event, Request, StopReason, Token
from rbee_worker.engine.runners import rows
from rbee_worker.engine.runners.protocol import (
    Capabilities,
    DecodeRow,
    Finished,
    KvGeometry,
    PromptRow,
    Sampled,
    Stepped,
)
from rbee_worker.engine.runners.rows import WindowLayers, kv_budget, kv_pool, window_blocks_for
from rbee_worker.engine.sampling.sampling_params import SamplingParams
from rbee_worker.engine.scheduling.kv_blocks import SCRATCH_BLOCK, BlockPool, BlockTable, block_key
from rbee_worker.errors import ModelLoadError

# -- the pool alone ---------------------------------------------------------------------------------------------


def computed(pool: BlockPool, tokens: Tokens[int]) -> BlockTable:
    """A table that computed these tokens (and registered its full blocks), as a sequence that read them does."""
    table = BlockTable()
    assert pool.grow(table, len(tokens))
    pool.register(table, tokens)
    pool.check()
    return table


def test_grow_hands_out_blocks_but_never_the_scratch_block_and_takes_all_or_nothing() -> None:
    pool = BlockPool(5, 4)
    assert (pool.capacity, pool.free_blocks, pool.used_blocks) == (4, 4, 0)
    table = BlockTable()
    assert pool.grow(table, 5) and table.blocks == [1, 2]
    assert pool.grow(table, 8) and table.blocks == [1, 2]  # positions 0..7 fit the blocks it holds
    other = BlockTable()
    assert not pool.grow(other, 9) and other.blocks == [] and pool.free_blocks == 2  # 3 blocks: too many
    assert pool.grow(other, 8) and other.blocks == [3, 4] and pool.free_blocks == 0
    assert SCRATCH_BLOCK not in table.blocks + other.blocks
    pool.check()
    pool.release(table)
    assert table.blocks == [] and table.keys == [] and (pool.free_blocks, pool.used_blocks) == (2, 2)
    pool.check()
    with pytest.raises(ValueError):
        BlockPool(1, 16)


def test_releasing_a_block_twice_is_caught() -> None:
    pool = BlockPool(4, 2)
    table = BlockTable()
    pool.grow(table, 4)
    copy = BlockTable(list(table.blocks))
    pool.release(table)
    with pytest.raises(AssertionError, match="released more often than taken"):
        pool.release(copy)


def test_match_takes_the_longest_registered_chain_in_whole_blocks_within_the_limit() -> None:
    """Only full blocks are registered; a lookup takes the chain of blocks whose keys its tokens give, at most `limit`
    tokens, and shares them with the table that computed them."""
    pool = BlockPool(16, 4)
    tokens = list(range(1, 12))  # 11 tokens: two full blocks and a partial one
    first = computed(pool, tokens)
    assert len(first.keys) == 2
    table = BlockTable()
    assert pool.match(table, [*tokens, 50], limit=11) == 8 and table.blocks == first.blocks[:2]
    assert table.keys == first.keys
    pool.release(table)
    assert pool.match(table, tokens, limit=7) == 4 and table.blocks == first.blocks[:1]  # the limit cuts a block
    pool.release(table)
    assert pool.match(table, [1, 2, 3, 9, *tokens[4:]], limit=11) == 0 and table.blocks == []  # the first differs
    # A key names the whole prefix: the second block's tokens after another first block are not found.
    computed(pool, [7, 7, 7, 7, *tokens[4:8]])
    assert pool.match(table, [1, 2, 3, 4, *tokens[4:8], 0], limit=8) == 8
    pool.release(table)
    assert pool.match(table, [9, 9, 9, 9, *tokens[4:8], 0], limit=8) == 0
    pool.check()


def test_a_lookup_counts_nothing_until_its_prompt_is_counted() -> None:
    """`match` finds blocks and counts nothing; the scheduler counts a prompt once, when its first chunk runs
    (`count_query`: its tokens and the hits it started with)."""
    pool = BlockPool(16, 4)
    computed(pool, range(1, 9))
    table = BlockTable()
    assert pool.match(table, [*range(1, 9), 0], limit=8) == 8 and len(table.blocks) == 2
    assert (pool.queried_tokens, pool.hit_tokens) == (0, 0)
    pool.count_query(9, 8)
    pool.count_query(5, 0)
    assert (pool.queried_tokens, pool.hit_tokens) == (14, 8)


def test_without_prefix_caching_nothing_is_registered_or_found() -> None:
    pool = BlockPool(16, 4, prefix_caching=False)
    first = computed(pool, range(1, 9))
    assert first.keys == []
    table = BlockTable()
    assert pool.match(table, range(1, 10), limit=8) == 0 and table.blocks == []


def test_a_shared_block_is_freed_only_when_every_table_holding_it_lets_go() -> None:
    pool = BlockPool(8, 4)
    owner = computed(pool, range(1, 9))
    reader = BlockTable()
    assert pool.match(reader, range(1, 10), limit=8) == 8
    shared = list(owner.blocks)
    assert pool.used_blocks == 2
    pool.release(owner)
    assert pool.used_blocks == 2 and pool.free_blocks == 5  # the reader still holds both
    pool.check()
    spare = BlockTable()
    assert pool.grow(spare, 5 * 4) and not set(spare.blocks) & set(shared)  # all the free ones, none of them
    pool.release(spare)
    pool.release(reader)
    assert pool.used_blocks == 0
    again = BlockTable()
    assert pool.match(again, range(1, 10), limit=8) == 8 and again.blocks == shared  # still cached
    pool.check()


def test_free_blocks_without_a_key_go_before_cached_ones_and_cached_ones_least_recently_freed_first() -> None:
    """Eviction order: blocks that hold nothing cached are handed out first; then cached blocks, the least recently
    freed first, and of one prefix its tail before its head, so that what stays cached is still a prefix."""
    pool = BlockPool(9, 4)  # 8 blocks
    old = computed(pool, range(1, 13))  # 3 registered blocks
    new = computed(pool, range(20, 30))  # 2 registered blocks and a partial one
    old_blocks, new_blocks = list(old.blocks), list(new.blocks)
    pool.release(old)
    pool.release(new)
    pool.check()
    taken = BlockTable()
    assert pool.grow(taken, 3 * 4)
    fresh = taken.blocks[1:]
    assert taken.blocks[0] == new_blocks[2]  # the partial block: nothing cached in it, though freed last
    assert not set(fresh) & set(old_blocks + new_blocks)  # then those never used
    assert pool.grow(taken, 4 * 4) and taken.blocks[3] == old_blocks[2]  # then the tail of the older prefix
    probe = BlockTable()
    assert pool.match(probe, range(1, 14), limit=12) == 8 and probe.blocks == old_blocks[:2]  # its head stays
    pool.release(probe)
    assert pool.grow(taken, 8 * 4)
    # The lookup used the older prefix's head again: it is freed after the newer prefix now.
    assert taken.blocks == [new_blocks[2], *fresh, old_blocks[2], *new_blocks[1::-1], *old_blocks[1::-1]]
    assert pool.match(probe, range(1, 14), limit=12) == 0 and pool.match(probe, range(20, 30), limit=9) == 0
    pool.check()


def test_a_matched_block_leaves_the_free_queue_and_is_not_handed_out_while_held() -> None:
    pool = BlockPool(4, 2)  # 3 blocks
    owner = computed(pool, [1, 2, 3, 4])
    pool.release(owner)
    reader = BlockTable()
    assert pool.match(reader, [1, 2, 3, 4, 5], limit=4) == 4
    other = BlockTable()
    assert pool.grow(other, 2) and other.blocks[0] not in reader.blocks
    assert not pool.grow(other, 4)  # no block is left
    pool.check()


def test_a_duplicate_registration_keeps_the_first_block_and_the_copy_is_reused_first() -> None:
    """Two tables that computed the same prefix: the first to register it is the cached one; the other keeps its own
    copy (and the keys, to chain on), which, once freed, is handed out before any cached block."""
    pool = BlockPool(8, 4)
    first = computed(pool, range(1, 9))
    second = computed(pool, range(1, 9))
    assert second.keys == first.keys and not set(second.blocks) & set(first.blocks)
    cached, copy = list(first.blocks), list(second.blocks)
    pool.release(first)
    pool.release(second)
    pool.check()
    probe = BlockTable()
    assert pool.match(probe, range(1, 10), limit=8) == 8 and probe.blocks == cached
    pool.release(probe)
    taken = BlockTable()
    assert pool.grow(taken, 8) and sorted(taken.blocks) == sorted(copy)
    assert pool.match(probe, range(1, 10), limit=8) == 8 and probe.blocks == cached
    pool.check()


def test_a_cached_block_handed_out_again_leaves_the_cache() -> None:
    pool = BlockPool(3, 4)  # 2 blocks
    pool.release(computed(pool, range(1, 9)))
    taken = BlockTable()
    assert pool.grow(taken, 4)  # the tail block goes
    probe = BlockTable()
    assert pool.match(probe, range(1, 10), limit=8) == 4
    pool.release(probe)
    assert pool.grow(taken, 8)  # and the head
    assert pool.match(probe, range(1, 10), limit=8) == 0
    pool.check()


# -- random traffic through the scheduler, the step loop and the output processor ------------------------------

EOS = 0
VOCAB = 48


def fake_model(tokens: Tokens[int | None]) -> int:
    """The next token after these, at positions 0..p: one of VOCAB (EOS among them), a function of all of them."""
    return hash(tuple(tokens)) % VOCAB


def solo(prompt: Tokens[int], max_tokens: int) -> tuple[list[int], StopReason]:
    """A request's tokens when its KV cache holds exactly its tokens, as alone in a pool of its own."""
    tokens, out = list(prompt), []
    while len(out) < max_tokens:
        token = fake_model(tokens)
        if token == EOS:
            return out, StopReason.EOS
        tokens.append(token)
        out.append(token)
    return out, StopReason.MAX_TOKENS


class NoText:
    """The detokenizer of a model without text: no stop string ever matches."""

    stop_matched = None

    def add_token(self, token_id: int) -> str:
        return ""

    def finish(self) -> str:
        return ""


@dataclass
class Pending:
    sampled: list[Sampled]
    ready: bool = False


class KvReadingRunner:
    """A runner whose model reads what it wrote in its blocks: a row's token is `fake_model` of the tokens stored at
    its positions 0..p, read through its block table. Of three kinds, as tests/engine/test_steps.py's: eager, mixed,
    async.

    It records, in `faults`, a write into the scratch block, a shared or registered block, or past the row's table,
    and a read of a position that holds nothing. With `failing`, a forward (or the collection of a launched one) fails
    now and then, before it writes anything. With `windows` (a pool of windows, as a model's sliding layers have), it
    writes every position into the row's window table too, and records as a fault a read of the last `window`
    positions through it that does not give the tokens of the main table."""

    def __init__(self, kind: str, kv: KvGeometry, failing: random.Random | None = None, row_tokens: int = 1) -> None:
        self.kind, self.kv, self.block_size, self.failing = kind, kv, kv.block_size, failing
        self.window = kv.window or 0
        self.pool: BlockPool  # the scheduler's pools, read to check each write (Harness)
        self.windows: BlockPool | None = None
        self.loaded = SimpleNamespace(info=SimpleNamespace(eos_token_ids=frozenset({EOS})))
        self.capabilities = Capabilities(mixed_batches=kind == "mixed", row_tokens=row_tokens)
        self.prefixes = None  # the block pool is the cache
        self.cells: dict[int, list[int | None]] = defaultdict(lambda: [None] * self.block_size)
        self.window_cells: dict[int, list[int | None]] = defaultdict(lambda: [None] * self.block_size)
        self.chosen: dict[int, int] = {}
        self.verified: Counter = Counter()  # rows of several tokens: (fed, accepted) -> how many
        self.faults: list[str] = []
        self.evicted = 0

    def assign(self, row: int, params: SamplingParams, seed: int, prompt_ids: Tokens[int], logprobs: object) -> None:
        self.chosen.pop(row, None)

    def evict(self, row: int) -> None:
        self.evicted += 1

    def release(self, row: int) -> None:
        pass

    def step(self, prompts: list[PromptRow], decodes: list[DecodeRow]) -> Stepped:
        assert not (prompts and decodes) or self.kind == "mixed"
        self._maybe_fail()
        out = []
        for row in prompts:
            for i, token in enumerate(row.token_ids):
                self._write_both(row, row.start + i, token)
            if row.sample:
                out.append(self._sample(row, row.start + len(row.token_ids) - 1))
        return Stepped(out + [self._decode(r, r.tokens[0]) for r in decodes], [() for _ in prompts])

    def chains(self, decodes: list[DecodeRow]) -> bool:
        return self.kind == "async"

    def launch(self, decodes: list[DecodeRow], hold_sampling: bool = False) -> Finished | Pending:
        if self.kind != "async":
            return Finished(self.step([], decodes).sampled)
        self._maybe_fail()
        fed = [self.chosen[r.row] if r.chained else r.tokens[0] for r in decodes]
        return Pending([self._decode(r, t) for r, t in zip(decodes, fed, strict=True)])

    def sample_held(self, launched: Finished | Pending) -> None:
        pass

    def collect(self, launched: Finished | Pending) -> list[Sampled]:
        if not launched.ready:
            self._maybe_fail()
        return launched.sampled

    def fault(self, error: BaseException) -> str | None:
        return None

    def _maybe_fail(self) -> None:
        if self.failing and self.failing.random() < 0.01:
            raise RuntimeError("a forward failed")

    def _decode(self, row: DecodeRow, token: int) -> Sampled:
        """A row of one token, or a verify step: every token fed is written at its position (a rejected tail's too),
        and the tokens accepted are each position's own sample while the token fed after it is that sample."""
        fed = (token, *row.tokens[1:])
        for i, fed_token in enumerate(fed):
            self._write_both(row, row.position + i, fed_token)
        accepted: list[int] = []
        for i in range(len(fed)):
            accepted.append(self._sample(row, row.position + i).tokens[0])
            if i + 1 == len(fed) or fed[i + 1] != accepted[-1]:
                break
        self.chosen[row.row] = accepted[-1]
        if len(fed) > 1:
            self.verified[len(fed), len(accepted)] += 1
            self.verified["EOS before the last"] += EOS in accepted[:-1]
        return Sampled(tuple(accepted), True)

    def _write_both(self, row: PromptRow | DecodeRow, position: int, token: int) -> None:
        self._write(self.pool, self.cells, row.blocks, position, token)
        if self.windows is not None:
            self._write(self.windows, self.window_cells, row.window_blocks, position, token)

    def _write(
        self, pool: BlockPool, cells: dict[int, list[int | None]], blocks: Tokens[int], position: int, token: int
    ) -> None:
        index, offset = divmod(position, self.block_size)
        if index >= len(blocks):
            self.faults.append(f"position {position} written past the table {list(blocks)}")
            return
        block = blocks[index]
        if block == SCRATCH_BLOCK:
            self.faults.append(f"position {position} written into the scratch block")
        if pool._refs[block] != 1:
            self.faults.append(f"position {position} written into block {block} that {pool._refs[block]} hold")
        if pool._key[block] is not None:
            self.faults.append(f"position {position} written into block {block}, registered in the prefix cache")
        cells[block][offset] = token

    def _sample(self, row: PromptRow | DecodeRow, position: int) -> Sampled:
        read = self._read(self.cells, row.blocks, range(position + 1))
        if None in read:
            self.faults.append(f"row {row.row} read position {read.index(None)}, which holds nothing")
        if self.windows is not None:
            first = max(position - self.window + 1, 0)
            if self._read(self.window_cells, row.window_blocks, range(first, position + 1)) != read[first:]:
                self.faults.append(f"row {row.row}'s window at position {position} holds other tokens")
        self.chosen[row.row] = token = fake_model(read)
        return Sampled((token,), True)

    def _read(self, cells: dict[int, list[int | None]], blocks: Tokens[int], positions: range) -> list[int | None]:
        size = self.block_size
        return [cells[blocks[p // size]][p % size] if p < len(blocks) * size else None for p in positions]


@dataclass
class Traffic:
    """One seed's run, its counters for the assertions across seeds."""

    preemptions: int = 0
    hit_tokens: int = 0
    verified: Counter = field(default_factory=Counter)  # rows of several tokens: (fed, accepted) -> how many
    rounds: int = 0
    ended: Counter = field(default_factory=Counter)


class Harness:
    """Engine._run's loop without the thread: the inbox (arrivals, cancellations) between rounds, then a round."""

    def __init__(
        self,
        config: EngineConfig,
        kind: str,
        blocks: int,
        failing: random.Random | None = None,
        window: int = 0,
        proposals: random.Random | None = None,
    ) -> None:
        """`proposals`: decode rows of up to 3 tokens, the last output and two proposed after it (`propose`)."""
        self.config = config
        size = config.block_size
        windows = window_blocks_for(window, size, config.max_batch, config.prefill_chunk) if window else 0
        self.kv = KvGeometry(blocks, size, (blocks - 1) * size, 1, True, window or None, windows, int(windows > 0))
        self.runner = KvReadingRunner(kind, self.kv, failing, 3 if proposals else 1)
        self.proposals = proposals
        proposer = self.propose if proposals else None
        self.core = EngineCore(self.runner, config, proposer=proposer)  # type: ignore[arg-type] -- a partial Runner
        self.scheduler = self.core.scheduler
        self.pool, self.windows = self.scheduler.kv.blocks, self.scheduler.kv.windows
        self.runner.pool, self.runner.windows = self.pool, self.windows
        self.events: dict[str, list[Event]] = defaultdict(list)
        self.sequences: list[Sequence] = []
        self.in_flight: list[Sequence] = []
        self.count = 0

    def propose(self, sequence: Sequence, limit: int) -> tuple[int, ...]:
        """The tokens that follow the sequence's last one in its solo run (EOS where that run ends, then any), each
        replaced by a random one now and then: rows whose proposals are all, partly or not accepted."""
        assert self.proposals is not None
        request = sequence.request
        expected, reason = solo(request.prompt_ids, request.max_tokens)
        following = [*expected, EOS] if reason is StopReason.EOS else expected
        guess = following[len(sequence.output_ids) : len(sequence.output_ids) + limit]
        guess += [self.proposals.randrange(VOCAB) for _ in range(limit - len(guess))]
        return tuple(t if self.proposals.random() < 0.7 else self.proposals.randrange(VOCAB) for t in guess)

    def deliver(self, ended: list[Ended]) -> None:
        """Engine._deliver."""
        for sequence, terminal in ended:
            if sequence in self.in_flight:
                self.in_flight.remove(sequence)
            self.events[sequence.request_id].append(terminal)

    def submit(self, prompt: tuple[int, ...], max_tokens: int) -> None:
        request = Request(prompt, max_tokens=max_tokens, request_id=f"r{self.count}")
        self.count += 1
        sequence = Sequence(request, 0, Output(self.events[request.request_id].append, NoText()))  # type: ignore[arg-type]
        self.sequences.append(sequence)
        self.in_flight.append(sequence)
        self.core.add(sequence)

    def round(self) -> None:
        """One step of the engine's loop."""
        self.deliver(self.core.step())

    def check(self) -> None:
        """The pool's and the tables' invariants, after a round."""
        pool, size = self.pool, self.pool.block_size
        pool.check()
        assert not self.runner.faults, self.runner.faults
        holders: dict[int, list[tuple[Sequence, int]]] = defaultdict(list)
        for sequence in self.scheduler.waiting:
            assert sequence.table.blocks == [] and sequence.row is None
        for sequence in self.scheduler.running:
            table = sequence.table
            assert not sequence.finished and sequence.row is not None
            assert len(set(table.blocks)) == len(table.blocks) and SCRATCH_BLOCK not in table.blocks
            # Its blocks cover every position computed or on its way, and no more than the next block's worth.
            assert len(table.blocks) * size >= sequence.cached + sequence.launched
            assert len(table.keys) <= len(table.blocks) and len(table.keys) * size <= sequence.cached
            # Each key names its block's tokens after its parent's: a block found under it holds those tokens.
            parent = b""
            for index, key in enumerate(table.keys):
                assert key == block_key(parent, sequence.token_ids(index * size, (index + 1) * size))
                parent = key
            # Every position computed holds the sequence's own token, read through its table.
            cells = [self.runner.cells[table.blocks[p // size]][p % size] for p in range(sequence.cached)]
            assert cells == list(sequence.token_ids(0, sequence.cached)), sequence.request_id
            for index, block in enumerate(table.blocks):
                holders[block].append((sequence, index))
        for block in range(pool.num_blocks):
            assert pool._refs[block] == len(holders.get(block, ())), block
        for block, held in holders.items():
            if len(held) > 1:  # shared: a registered block inside each holder's cached prefix
                key = pool._key[block]
                assert key is not None and pool._by_key[key] == block
                assert all(index < len(s.table.keys) and s.table.keys[index] == key for s, index in held)
        if self.windows is not None:
            self.check_windows(self.windows)

    def check_windows(self, windows: BlockPool) -> None:
        """The pool of windows: each running sequence holds the blocks of its last positions only (the scratch block
        before them), at most what window_blocks_for counts for a row (a prompt chunk's blocks on top), and its
        computed positions there hold its own tokens; reference counts are the tables holding each block."""
        windows.check()
        size, window = windows.block_size, self.runner.window
        most = -(-(window + 2) // size) + 2 + -(-self.config.prefill_chunk // size)
        holders: Counter = Counter()
        for sequence in self.scheduler.waiting:
            assert sequence.window_table.blocks == []
        for sequence in self.scheduler.running:
            table = sequence.window_table
            live = table.blocks[table.dropped :]
            assert table.blocks[: table.dropped] == [SCRATCH_BLOCK] * table.dropped
            assert SCRATCH_BLOCK not in live and len(set(live)) == len(live) and len(live) <= most, table
            assert len(table.blocks) * size >= sequence.cached + sequence.launched
            assert table.dropped * size <= max(sequence.cached - window + 1, 0)
            first = table.dropped * size
            cells = [self.runner.window_cells[table.blocks[p // size]][p % size] for p in range(first, sequence.cached)]
            assert cells == list(sequence.token_ids(first, sequence.cached)), sequence.request_id
            holders.update(live)
        for block in range(1, windows.num_blocks):
            assert windows._refs[block] == holders[block], block

    def check_ended(self) -> None:
        """Nothing held, and every request's tokens its solo run's (a cancelled one's, the start of them)."""
        for pool in (self.pool, self.windows):
            if pool is not None:
                assert pool.used_blocks == 0 and not any(pool._refs)
                pool.check()
        assert self.pool.queried_tokens == sum(len(s.request.prompt_ids) for s in self.sequences if s.looked_up)
        assert self.pool.hit_tokens == sum(s.cached_prompt_tokens for s in self.sequences)
        for sequence in self.sequences:
            request, events = sequence.request, self.events[sequence.request_id]
            end = events[-1]
            terminals = [e for e in events if isinstance(e, End | Error)]
            assert len(terminals) == 1, f"{sequence.request_id} ended {len(terminals)} times: {terminals}"
            tokens = [t for e in events if isinstance(e, Token) for t in e.token_ids]
            assert tokens == sequence.output_ids
            expected, reason = solo(request.prompt_ids, request.max_tokens)
            if isinstance(end, Error):
                assert end.message == "inference failed: a forward failed" and self.runner.failing
                assert tokens == expected[: len(tokens)], request.request_id
                continue
            assert end.tokens_out == len(tokens)
            if end.stop_reason is StopReason.CANCELLED:
                assert tokens == expected[: len(tokens)], request.request_id
            else:
                assert (tokens, end.stop_reason) == (expected, reason), request.request_id
            assert end.cached_tokens == sequence.cached_prompt_tokens
            assert end.cached_tokens % self.pool.block_size == 0 and end.cached_tokens < len(request.prompt_ids)
            if self.config.deterministic:  # whole chunks only
                assert end.cached_tokens % self.config.prefill_chunk == 0


def traffic(seed: int, ops: int = 200) -> Traffic:
    """Random arrivals (prompts from a few shared prefixes), cancellations, callers gone, max_tokens and pool size;
    the invariants after every round; every request's tokens at the end."""
    rng = random.Random(seed)
    kind = rng.choice(["eager", "mixed", "async"])
    block_size = rng.choice([1, 2, 4, 4, 8])
    config = EngineConfig(
        max_batch=rng.randint(1, 5),
        prefill_chunk=rng.choice([3, 8, 16, 64]),
        block_size=block_size,
        deterministic=rng.random() < 0.2,
        prefix_caching=rng.random() < 0.85,
    )
    longest_prompt, most_tokens = 3 * block_size + 6, 12
    need = -(-(longest_prompt + most_tokens) // block_size)  # the blocks of the longest request
    failing = random.Random(seed) if rng.random() < 0.2 else None
    window = rng.choice([0, 0, 2, 3, 5, 9])  # a pool of windows beside the main one, as sliding layers have
    proposals = random.Random(seed) if rng.random() < 0.3 else None  # rows of several tokens, verified
    harness = Harness(config, kind, 1 + rng.randint(need, 3 * need), failing, window, proposals)
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(longest_prompt)] for _ in range(3)]
    stats = Traffic()
    for _ in range(ops):  # an op: an arrival, a cancellation, or a round
        draw = rng.random()
        if draw < 0.3:
            length = rng.randint(1, longest_prompt)
            shared = rng.randint(0, length) if rng.random() < 0.8 else 0
            prompt = rng.choice(prefixes)[:shared] + [rng.randrange(1, VOCAB) for _ in range(length - shared)]
            harness.submit(tuple(prompt), rng.randint(1, most_tokens))
        elif draw < 0.34 and harness.in_flight:  # between two rounds, as the engine takes cancellations
            victim = rng.choice(harness.in_flight)
            if rng.random() < 0.5:
                harness.deliver(harness.core.cancel(victim.request_id))
            else:
                victim.output.undeliverable = True  # the caller is gone: ended at the next round
        elif len(harness.scheduler):
            harness.round()
            stats.rounds += 1
        harness.check()
    while harness.in_flight:
        harness.round()
        stats.rounds += 1
        assert stats.rounds < 20 * ops, "no progress"
        harness.check()
    harness.deliver(harness.core.stop())
    harness.check_ended()
    stats.preemptions, stats.hit_tokens = harness.scheduler.preemptions, harness.pool.hit_tokens
    stats.verified = harness.runner.verified
    stats.ended.update(getattr(e[-1], "stop_reason", "failed") for e in harness.events.values())
    assert harness.runner.evicted == stats.preemptions
    return stats


def test_solo_runs_through_a_large_pool_give_the_reference_tokens() -> None:
    """The reference (`solo`) is what the harness gives a request alone in a pool of its own, for each runner kind."""
    rng = random.Random(0)
    for kind in ("eager", "mixed", "async"):
        harness = Harness(EngineConfig(block_size=4, prefill_chunk=8), kind, 64)
        prompt = tuple(rng.randrange(1, VOCAB) for _ in range(13))
        while len(solo(prompt, 30)[0]) < 10:  # one that gives a few tokens before EOS, if not all 30
            prompt = tuple(rng.randrange(1, VOCAB) for _ in range(13))
        harness.submit(prompt, 30)
        while harness.in_flight:
            harness.round()
            harness.check()
        harness.check_ended()
        tokens = [t for e in harness.events["r0"] if isinstance(e, Token) for t in e.token_ids]
        assert (tokens, harness.events["r0"][-1].stop_reason) == solo(prompt, 30) and tokens


def test_a_gone_callers_request_with_a_token_in_flight_is_ended_once() -> None:
    """A request whose caller is gone is ended as cancelled by the round that finds it, while its last token is still
    in flight; a preemption in that round has the executor take that step first, so the token arrives in the same
    round. Every request has exactly one terminal event (and the metrics count it once)."""
    harness = Harness(EngineConfig(max_batch=3, block_size=4, prefix_caching=False), "async", 4)
    harness.submit((5, 6, 7), 10)
    harness.submit((8, 9, 10), 2)  # two tokens: the second comes from the step in flight
    harness.submit((11, 12, 13), 10)
    a, gone, b = harness.sequences
    harness.round()  # the three prompts, a block each (the pool holds three); their first tokens
    harness.round()  # a decode step at position 3 of each, launched and not collected
    assert (a.launched, gone.launched, b.launched) == (1, 1, 1) and harness.pool.free_blocks == 0
    gone.output.undeliverable = True  # an event could not be delivered: the caller is gone
    harness.round()  # a's position 4 needs a block: b is preempted, after the step in flight is taken
    assert harness.scheduler.preemptions == 1 and b.launched == 0 and len(b.output_ids) == 2 and b.prefilling
    assert gone.finished and gone.output_ids == [23]  # its second token, taken after it ended, is thrown away
    terminals = [e for e in harness.events[gone.request_id] if isinstance(e, End | Error)]
    assert len(terminals) == 1 and terminals[0].stop_reason is StopReason.CANCELLED, terminals
    harness.check()


SEEDS = 300


def test_random_traffic_keeps_the_pool_consistent_and_every_request_its_solo_tokens() -> None:
    """300 seeds of random traffic (runner kinds, block sizes, pool sizes, chunk sizes, deterministic mode, prefix
    caching on and off, forwards that fail now and then): after every round the pool's invariants hold, every running
    sequence's table holds its own tokens at every computed position, a block is in two tables only while registered
    and inside both tables' cached prefix, reference counts are the tables holding each block, and no shared or
    registered block is ever written; at the end every block is free, every request ended once, and got its solo
    tokens (the start of them where cancelled or failed). Preemptions, prefix hits and failures happened. A third of
    the seeds decode in rows of up to 3 tokens (the last output and two proposed after it, the proposals right, half
    right or wrong, EOS among them): a rejected tail's positions and blocks go back, and EOS or max_tokens inside a
    row end the request there."""
    runs = []
    for seed in range(SEEDS):
        try:
            runs.append(traffic(seed))
        except AssertionError as error:
            raise AssertionError(f"seed {seed}: {error}") from error
    assert sum(r.preemptions > 0 for r in runs) > SEEDS // 4
    assert sum(r.hit_tokens > 0 for r in runs) > SEEDS // 2
    ended = sum((r.ended for r in runs), Counter())
    assert all(ended[reason] > 0 for reason in StopReason if reason is not StopReason.STOP_SEQUENCE), ended
    assert ended["failed"] > 0
    verified = sum((r.verified for r in runs), Counter())
    assert all(verified[3, accepted] > 0 for accepted in (1, 2, 3)) and verified[2, 1] > 0, verified
    assert verified["EOS before the last"] > 0, verified


def test_the_pool_offers_the_models_context_whenever_one_request_fits() -> None:
    """kv_pool: the blocks that the budget holds (no more than --max-batch whole contexts use, plus the scratch block);
    the context offered is the model's whenever the pool holds it, else the whole pool; too small a pool refuses."""
    per_token = 23_040  # the demo in bfloat16
    one_gib = kv_pool(8192, per_token, 16, 2**30, rows=32)
    assert one_gib.context == 8192 and one_gib.blocks == 2**30 // (16 * per_token)
    small = kv_pool(8192, per_token, 16, 29 * 16 * per_token, rows=32)
    assert (small.blocks, small.context, small.tokens) == (29, 28 * 16, 28 * 16)
    capped = kv_pool(37, per_token, 16, 2**30, rows=1)
    assert (capped.blocks, capped.context) == (3 + 1, 37)
    with pytest.raises(ModelLoadError, match="KV cache"):
        kv_pool(8192, per_token, 16, 3 * 16 * per_token, rows=4)


def test_the_default_budget_off_a_gpu_is_half_the_memory_available(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --kv-cache-gb a CPU's pool may take half the memory available once the weights are in (the tests size
    theirs instead, since it depends on what else runs): with 7 GiB available the demo's default 16 rows get their
    whole contexts, with 2 GiB the pool is what 1 GiB holds."""
    per_token, context = 23_040, 8192
    for available, blocks in ((7 << 30, 16 * context // 16 + 1), (2 << 30, 2**30 // (16 * per_token))):
        monkeypatch.setattr(rows.psutil, "virtual_memory", lambda a=available: type("Memory", (), {"available": a}))
        assert kv_budget(torch.device("cpu")) == available // 2
        assert kv_pool(context, per_token, 16, kv_budget(torch.device("cpu")), rows=16).blocks == blocks


def test_sliding_layers_get_a_pool_of_windows_and_the_context_offered_grows() -> None:
    """kv_pool with a model's sliding layers (Gemma 3's five to one): their pool holds every row's window (and a
    round's prompt chunk), the rest of the budget goes to the full layers, and a request is offered a context several
    times longer than one pool of every layer gives from the same bytes, or where the whole context fits either way, the
    same context in less memory; a budget that the windows alone would take, or a window as long as the context, keeps
    one pool."""
    full, sliding, window = 1_000, 5_000, 1024
    windows = WindowLayers(window, sliding, prefill_chunk=512)
    budget = 2**27
    plain = kv_pool(131_072, full + sliding, 16, budget, rows=4)
    split = kv_pool(131_072, full, 16, budget, rows=4, window=windows)
    assert split.window_blocks == window_blocks_for(window, 16, 4, 512) == 4 * 67 + 32 + 1
    assert (split.window, split.bytes_per_token, split.window_bytes_per_token) == (window, full, sliding)
    assert split.bytes <= budget and split.context > 4 * plain.context
    assert split.request_bytes(50_000) == 50_000 * full + window * sliding
    small = kv_pool(131_072, full, 16, split.window_blocks * 16 * sliding, rows=4, window=windows)
    assert (small.window, small.window_blocks, small.bytes_per_token) == (None, 0, full + sliding)
    fits = kv_pool(4096, full, 16, budget, rows=4, window=windows)  # the whole context either way: less memory
    assert fits.window == window and fits.context == 4096
    assert fits.bytes < kv_pool(4096, full + sliding, 16, budget, rows=4).bytes
    short = kv_pool(512, full, 16, budget, rows=4, window=windows)  # a window as long as the context: nothing gained
    assert (short.window, short.context) == (None, 512)
