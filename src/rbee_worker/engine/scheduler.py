"""The scheduler: which requests run, which batch row each holds, which KV blocks back each, what each round computes,
and how far each request has got.

It knows no tensors and no text: the runner turns its plan into forwards and sampled tokens (engine/step.py), the
output processor turns tokens into events (engine/output.py). Each round (`schedule`): waiting requests take free
batch rows (the lowest first) in arrival order, up to `max_batch` running at once. Then, oldest request first, each
running request gets its work and the KV blocks for it from the block pool (engine/kv_blocks.py): a request still
reading its prompt gets a prompt chunk, up to `prefill_chunk` tokens in all per round (its first chunk starts after
the longest prefix that the prefix cache holds); every other running request decodes one token. Chunks are grouped
into forwards; a runner with mixed batches takes the round's chunks and decode rows in one forward. A long prompt
therefore delays the others' next token by at most one chunk. A runner of `whole_prompts` (an encoder, whose
attention reads every position of its input) gets each prompt in one chunk: in what is left of the round's budget, or
first in a round of its own where it is longer than the budget.

When the pool has too few free blocks for a request's work, the newest running request that holds blocks is
preempted: its blocks go back to the pool, it keeps its batch row (its sampling state stays), and it reads its prompt
and the tokens it has generated again as a prompt when blocks are free, then decodes on. Its caller sees no
difference but time. A prompt chunk that still finds too few blocks waits for a later round.

A model's sliding layers may keep their keys and values in a pool of their own (KvGeometry.window_blocks), as vLLM's
hybrid KV cache manager does: there each sequence holds a second table (`window_table`) with the blocks of its last
positions only. Before each of its steps, the blocks wholly before the window of its first position whose step the
host has not taken (`cached`) go back to that pool (prefix-cache blocks staying registered until reused). The pool
holds every row's window and a round's prompt chunks (rows.window_blocks_for), so only the main pool limits what
runs. A cached prefix is taken only as far as the pool of windows still holds the blocks of its window
(BlockPool.match_window): the prefix's sliding layers need those and no earlier ones.

A cached prefix gives the same tokens as a fresh run (issue 30) where the runner's kernels round a row alike in any
forward of at least `uniform_rows` rows (Capabilities.uniform_rows): a CPU's kernels pick another product for fewer
rows (torch's int4 / int8 layers below dequant.CPU_DEQUANTIZE_ROWS, llama.cpp's below its own switch), which rounds
differently. So, with `uniform_rows` R: a cache hit leaves at least R prompt tokens to compute (the forward after a
cached prefix holds R rows, as the fresh run's chunk over those positions does, and a prompt shorter than R finds
nothing); a chunk never leaves fewer than R tokens for its prompt's last chunk (a fresh run's last chunk holds R rows
too); and a chunk that the round's budget would cut below R waits for the next round. Every prompt position of a
prompt of R tokens or more is then computed in forwards of R rows or more, whatever was cached, and for a request
computed alone (nothing else in its forwards) a cached prefix changes no logit (the runners keep the rest of the
forward's shape from mattering: torch_runner.py's CPU_KEY_BLOCK, llama_cpp_runner.py's exact prefixes). What it does
not cover: positions computed by decode steps (a conversation's earlier answers, cached and fed again as a prompt),
chunks cut short by a lack of free blocks, a prefix that only requests computed beside others hold (llama.cpp's
unified KV pool, where other sequences' cells change the attention sums), and torch's first chunk of a prompt (from
position 0, whose attention reads only its own keys) where a cache hit ends inside it.

`deterministic` (batch invariance): a request's tokens must not depend on what else runs, so every chunk and every
decode row has a forward of its own, chunks split a prompt at multiples of `prefill_chunk` whatever else runs, and
the prefix cache serves and keeps only prompt blocks inside whole chunks, which any request computes alike.
"""

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from rbee_worker.engine.config import EngineConfig
from rbee_worker.engine.kv_blocks import BlockPool, BlockTable
from rbee_worker.engine.output import Output
from rbee_worker.engine.prompt_cache import common_prefix
from rbee_worker.engine.runner import KvGeometry
from rbee_worker.engine.types import Request


@dataclass(eq=False)
class Sequence:
    """A request admitted to the engine, and how far it has got."""

    request: Request
    seed: int
    output: Output  # the output processor's record of it
    row: int | None = None  # its batch row (sampling state), while it runs
    table: BlockTable = field(default_factory=BlockTable)  # its KV blocks
    window_table: BlockTable = field(default_factory=BlockTable)  # its window's, in the sliding layers' own pool
    cached: int = 0  # tokens whose keys and values are in its blocks: the prompt first, then all but the last output
    cached_prompt_tokens: int = 0  # prompt tokens that its first chunk found in the prefix cache
    output_ids: list[int] = field(default_factory=list)  # generated tokens, EOS excluded
    launched: int = 0  # decode steps launched whose tokens the host has not taken yet (see Steps._decode)
    looked_up: bool = False  # its first chunk has run, and what it found in the prefix cache is counted
    finished: bool = False  # ended: its row and blocks are free and its id may come again

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prefill_end(self) -> int:
        """The tokens to cache before it decodes: its prompt; after a preemption, also all but the last output."""
        return len(self.request.prompt_ids) + max(len(self.output_ids) - 1, 0)

    @property
    def prefilling(self) -> bool:
        return self.cached < self.prefill_end

    @property
    def scoring(self) -> bool:
        """Whether its prompt's log-probabilities are asked for (Request.prompt_logprobs) and not all computed yet."""
        prompt = len(self.request.prompt_ids)
        return self.request.prompt_logprobs is not None and len(self.output.prompt_logprobs) < prompt - 1

    def token_ids(self, start: int, end: int) -> tuple[int, ...]:
        """Its tokens [start, end): the prompt's, then the generated ones."""
        prompt = self.request.prompt_ids
        if end <= len(prompt):
            return prompt[start:end]
        return (*prompt[start:], *self.output_ids[max(start - len(prompt), 0) : end - len(prompt)])


@dataclass(frozen=True)
class Chunk:
    """Tokens [start, start + count) of a sequence's prompt (after a preemption, of its prompt and output), fed in one
    forward."""

    sequence: Sequence
    start: int
    count: int

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.sequence.token_ids(self.start, self.start + self.count)

    @property
    def samples(self) -> bool:
        """Whether the chunk ends a prompt and a token follows (after a preemption the last output follows; with
        max_tokens 0 none does)."""
        return self.ends_prompt and self.sequence.request.max_tokens > 0

    @property
    def ends_prompt(self) -> bool:
        """Whether the chunk computes the prompt's last token, for the first time (not again after a preemption)."""
        return not self.sequence.output_ids and self.start + self.count == self.sequence.prefill_end

    @property
    def targets(self) -> tuple[int, ...]:
        """Where its sequence is scoring: the prompt's tokens after the chunk's positions (after its last one, but
        for the prompt's last token, which the first output follows)."""
        if not self.sequence.scoring:
            return ()
        prompt = self.sequence.request.prompt_ids
        return prompt[self.start + 1 : min(self.start + self.count + 1, len(prompt))]


@dataclass(frozen=True)
class Forward:
    """One forward of a round: prompt chunks, decode rows (one token for each sequence), or, for a runner with mixed
    batches, both."""

    chunks: list[Chunk]
    decode: list[Sequence]


@dataclass(frozen=True)
class Plan:
    """One round: the sequences that took a batch row (their sampling state goes there first), those whose caller is
    gone (to end as cancelled), the rows of those preempted (whatever the runtime keeps for them beyond their blocks
    goes), then the forwards in order, decode rows last."""

    started: list[Sequence]
    abandoned: list[Sequence]
    preempted: list[int]
    forwards: list[Forward]


class Scheduler:
    """Owns the admitted requests (`waiting` for a row, `running` in one), the rows, the block pool, and each
    sequence's progress."""

    def __init__(
        self,
        config: EngineConfig,
        mixed_batches: bool,
        kv: KvGeometry,
        reuse: Callable[[int, tuple[int, ...], int], int] | None = None,
        uniform_rows: int = 1,
        whole_prompts: bool = False,
    ) -> None:
        """`uniform_rows`, `whole_prompts`: the runner's Capabilities (see the module docstring)."""
        self.config = config
        self.whole_prompts = whole_prompts
        self.uniform_rows = 1 if config.deterministic else uniform_rows
        self.mixed_batches = mixed_batches and not config.deterministic
        self.blocks = BlockPool(kv.blocks, kv.block_size, config.prefix_caching and kv.shared_blocks)
        # The sliding layers' pool of windows (KvGeometry.window_blocks), where a sequence holds its last positions.
        self.window = kv.window or 0
        self.windows = (
            BlockPool(kv.window_blocks, kv.block_size, config.prefix_caching and kv.shared_blocks)
            if kv.window_blocks
            else None
        )
        # Where the runtime keeps a prefix cache of its own (Runner.reuse), it is asked instead of the block pool's.
        self._reuse = reuse if config.prefix_caching and not kv.shared_blocks else None
        self.waiting: deque[Sequence] = deque()  # arrival order
        self.running: list[Sequence] = []  # admission order, which is arrival order
        self._by_id: dict[str, Sequence] = {}
        self._free_rows = list(range(config.max_batch))
        self.preemptions = 0
        self._preempted: list[int] = []  # rows of the sequences preempted while planning this round

    def add(self, sequence: Sequence) -> None:
        self.waiting.append(sequence)
        self._by_id[sequence.request_id] = sequence

    def get(self, request_id: str) -> Sequence | None:
        return self._by_id.get(request_id)

    def __len__(self) -> int:
        """Sequences admitted and not finished: running and waiting."""
        return len(self._by_id)

    def schedule(self, settle: Callable[[], None] = lambda: None) -> Plan:
        """This round's work; waiting sequences take free rows. `settle` takes the tokens of the decode step still
        in flight: called before a preemption, since a preempted sequence must have no token on its way."""
        started = []
        while self.waiting and self._free_rows:
            sequence = self.waiting.popleft()
            sequence.row = self._free_rows.pop(self._free_rows.index(min(self._free_rows)))
            self.running.append(sequence)
            started.append(sequence)
        abandoned = [s for s in self._by_id.values() if s.output.undeliverable]
        chunks: list[Chunk] = []
        decoding: list[Sequence] = []
        budget = self.config.prefill_chunk
        for sequence in list(self.running):
            if sequence.finished or sequence.output.undeliverable or sequence.row is None:
                continue
            if sequence.prefilling:
                chunk = self._chunk(sequence, budget, settle)
                if chunk is None:
                    continue
                budget -= chunk.count
                chunks.append(chunk)
            elif self._room(sequence, sequence.cached + sequence.launched + 1, settle):
                decoding.append(sequence)
        # A settle (before a preemption) may have ended some.
        abandoned = [s for s in abandoned if not s.finished]
        decoding = [s for s in decoding if not s.finished and not s.prefilling]
        chunks = [c for c in chunks if not c.sequence.finished]
        if self.mixed_batches:
            forwards = [Forward(chunks, decoding)] if chunks or decoding else []
        else:
            forwards = [Forward(group, []) for group in self._group(chunks)]
            if self.config.deterministic:
                forwards += [Forward([], [sequence]) for sequence in decoding]
            elif decoding:
                forwards.append(Forward([], decoding))
        preempted, self._preempted = self._preempted, []
        return Plan(started, abandoned, preempted, forwards)

    def _chunk(self, sequence: Sequence, budget: int, settle: Callable[[], None]) -> Chunk | None:
        """The sequence's next prompt chunk within `budget` tokens, its blocks taken; None when it waits (no budget
        left, or too few blocks even after preempting newer requests)."""
        if budget <= 0:
            return None
        chunk_size = self.config.prefill_chunk
        rows = self.uniform_rows
        # A chunk that a full round's budget would hold waits for one rather than run short of uniform_rows (see the
        # module docstring); it looks up its prefix only when it runs (what is cached may have grown by then).
        if budget < min(rows, sequence.prefill_end - sequence.cached, chunk_size):
            return None
        if not sequence.table.blocks:  # its first chunk, or its first after a preemption
            if self._sibling_computes(sequence):
                return None
            self._look_up(sequence)
        left = sequence.prefill_end - sequence.cached
        if self.whole_prompts:  # whole: in what is left of the round's budget, or first in a round of its own
            if left > budget and budget < chunk_size:
                return None
            count = left
        else:
            # In deterministic mode chunks end at multiples of prefill_chunk whatever else ran in this round: a chunk
            # that does not fit in what is left of the round's budget waits for the next round.
            room = chunk_size - sequence.cached % chunk_size if self.config.deterministic else budget
            count = min(room, left)
            if count > budget:
                return None
        if 0 < left - count < rows <= left - rows:  # the prompt's last chunk is not left short of uniform_rows
            count = left - rows
        if not self._room(sequence, sequence.cached + count, settle, wait=True):
            if self.config.deterministic or self.whole_prompts:
                return None
            # As much of the chunk as its blocks and the free ones hold.
            held = (len(sequence.table.blocks) + self.blocks.free_blocks) * self.blocks.block_size
            count = min(count, held - sequence.cached)
            if count <= 0 or not self._grow(sequence, sequence.cached + count):
                return None
        if not sequence.looked_up:  # its first chunk runs: what it found is what it reports
            sequence.looked_up = True
            sequence.cached_prompt_tokens = sequence.cached
            self.blocks.count_query(len(sequence.request.prompt_ids), sequence.cached)
        return Chunk(sequence, sequence.cached, count)

    def _sibling_computes(self, sequence: Sequence) -> bool:
        """Whether an older running request is computing the same first block of prompt (`n` choices of one prompt, a
        batch of prompts sharing a system prompt): this one waits for its blocks to land in the prefix cache rather
        than computing them again beside it (vLLM registers blocks as they are allocated; here as they are
        computed)."""
        size = self.blocks.block_size
        prompt = sequence.request.prompt_ids
        takes = len(prompt) - max(self.uniform_rows, 1)  # the most a cache hit gives it (see _look_up)
        if not self.blocks.prefix_caching or takes < size or sequence.scoring or sequence.request.embed:
            return False
        for other in self.running:
            if other is sequence or other.finished or not other.prefilling or not other.table.blocks:
                continue
            shared = min(common_prefix(other.request.prompt_ids, prompt), takes) // size * size
            if other.cached < shared:  # it is still computing blocks this one would take
                return True
        return False

    def _look_up(self, sequence: Sequence) -> None:
        """A sequence about to read its prompt takes the longest cached prefix of it (never the whole prompt: its last
        token is computed for the logits that pick the first output; and at least uniform_rows tokens are left, see
        the module docstring): whole blocks of the pool's prefix cache, or what the runtime's own cache holds
        (Runner.reuse). A sequence scoring or embedding its prompt takes none: it needs every position's output."""
        if sequence.scoring or sequence.request.embed:
            return
        limit = max(sequence.prefill_end - max(self.uniform_rows, 1), 0)
        if self.config.deterministic:
            limit -= limit % self.config.prefill_chunk
        tokens = sequence.token_ids(0, sequence.prefill_end)
        if self._reuse is None:
            found = self.blocks.match(sequence.table, tokens, limit)
            # In deterministic mode whole chunks only (the pool evicts a chunk's last blocks before its first ones).
            multiple = math.lcm(self.config.prefill_chunk, self.blocks.block_size) if self.config.deterministic else 1
            if self.windows is not None and found:  # as long a prefix as the sliding layers' pool holds the window of
                found = self.windows.match_window(sequence.window_table, tokens, found, self.window, multiple)
            found -= found % multiple
            self.blocks.shorten(sequence.table, found)
            sequence.cached = found
            return
        assert sequence.row is not None
        if sequence.row in self._preempted:  # its runtime memory goes when this round starts (Runner.evict)
            return
        found = self._reuse(sequence.row, tokens, limit)
        # The runtime's cells are its own; the pool accounts for them as the sequence's blocks.
        sequence.cached = found if self.blocks.grow(sequence.table, found) else 0

    def _room(self, sequence: Sequence, tokens: int, settle: Callable[[], None], wait: bool = False) -> bool:
        """Blocks for the sequence's positions 0..tokens-1, preempting newer running requests while too few are free.
        A decode row that finds none preempts its own sequence; a prompt chunk (`wait`) then waits instead."""
        while not self._grow(sequence, tokens):
            victim = next(
                (s for s in reversed(self.running) if s is not sequence and s.table.blocks and not s.finished), None
            )
            if victim is None or self.running.index(victim) < self.running.index(sequence):
                if not wait:
                    self._preempt(sequence, settle)
                return False
            self._preempt(victim, settle)
            if sequence.finished:
                return False
        return True

    def _grow(self, sequence: Sequence, tokens: int) -> bool:
        """Blocks for the sequence's positions 0..tokens-1 (in the pool of windows, for its positions from the window
        of its first position whose step the host has not taken, `cached`, the blocks before going back); False
        when a pool has too few."""
        if not self.blocks.grow(sequence.table, tokens):
            return False
        if self.windows is not None:
            first = max(sequence.cached - self.window + 1, 0)
            self.windows.drop(sequence.window_table, first // self.windows.block_size)
            return self.windows.grow(sequence.window_table, tokens)
        return True

    def _release(self, sequence: Sequence) -> None:
        self.blocks.release(sequence.table)
        if self.windows is not None:
            self.windows.release(sequence.window_table)

    def _preempt(self, sequence: Sequence, settle: Callable[[], None]) -> None:
        """The sequence lets go of its blocks and reads its tokens again later; its row and sampling state stay."""
        if sequence.launched:
            settle()
        if sequence.finished:
            return
        self._release(sequence)
        sequence.cached = 0
        self.preemptions += 1
        self._preempted.append(sequence.row)

    def _group(self, chunks: list[Chunk]) -> list[list[Chunk]]:
        """Chunks of several requests share a forward while their rows, padded to the longest chunk, hold at most
        prefill_chunk tokens (many short prompts: one forward instead of one each); in deterministic mode each chunk
        has a forward of its own."""
        groups: list[list[Chunk]] = []
        group: list[Chunk] = []
        for chunk in chunks:
            width = max(c.count for c in (*group, chunk))
            if group and (self.config.deterministic or (len(group) + 1) * width > self.config.prefill_chunk):
                groups.append(group)
                group = []
            group.append(chunk)
        if group:
            groups.append(group)
        return groups

    def computed(self, chunks: list[Chunk], decoded: list[Sequence]) -> None:
        """A forward put these chunks' and these decode rows' keys and values in their sequences' blocks; the full
        blocks among them join the prefix cache."""
        for chunk in chunks:
            chunk.sequence.cached += chunk.count
            self._register(chunk.sequence)
        for sequence in decoded:
            sequence.cached += 1
            self._register(sequence)

    def _register(self, sequence: Sequence) -> None:
        if not self.blocks.prefix_caching:
            return
        computed = sequence.cached
        if self.config.deterministic:  # prompt blocks inside whole chunks only (see the module docstring)
            prompt = len(sequence.request.prompt_ids)
            computed = min(computed, prompt - prompt % self.config.prefill_chunk)
        for pool, table in ((self.blocks, sequence.table), (self.windows, sequence.window_table)):
            if pool is None:
                continue
            first = len(table.keys) * pool.block_size  # the first position of a block without a key
            if computed >= first + pool.block_size:
                pool.register(table, sequence.token_ids(first, computed))

    def append(self, sequence: Sequence, token: int) -> bool:
        """A generated token (not EOS) of the sequence; True when it is the last that max_tokens allows."""
        sequence.output_ids.append(token)
        return len(sequence.output_ids) >= sequence.request.max_tokens

    def wants_token(self, sequence: Sequence) -> bool:
        """Whether the sequence runs, holds its blocks, and needs a token beyond those already launched."""
        return (
            not sequence.finished
            and not sequence.prefilling
            and len(sequence.output_ids) + sequence.launched < sequence.request.max_tokens
        )

    def free(self, sequence: Sequence) -> None:
        """The sequence has ended: its row and blocks are free for the next, its id may come again."""
        if sequence.finished:
            return
        sequence.finished = True
        del self._by_id[sequence.request_id]
        if sequence.row is None:
            self.waiting.remove(sequence)
            return
        self.running.remove(sequence)
        self._free_rows.append(sequence.row)
        self._release(sequence)
        sequence.row = None
        sequence.cached = 0
