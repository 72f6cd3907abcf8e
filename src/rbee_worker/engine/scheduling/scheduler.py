"""The scheduler: which requests run, which batch row each holds, which KV blocks back each, what each round computes,
and how far each request has got (their KV blocks through engine/scheduling/kv_manager.py).

It knows no tensors and no text, and calls no other stage: the executor turns its plan into forwards and sampled
tokens (engine/executor.py), `update` takes back what they computed, and the output processor turns the tokens into
events (engine/output_processor.py); engine/core.py runs the four in turn. Each round (`schedule`): waiting requests
take free batch rows (the lowest first) in arrival order, up to `max_batch` running at once. Then, oldest request first,
each running request gets its work and the KV blocks for it from the block pool (engine/scheduling/kv_blocks.py): a
request still reading its prompt gets a prompt chunk, up to `prefill_chunk` tokens in all per round (its first chunk
starts after the longest prefix that the prefix cache holds); every other running request decodes: a row of its last
token, and where a proposer is given and the runner's rows carry several tokens, of the tokens proposed to follow it,
whose accepted ones it keeps (`update` takes back the rejected tail's positions and blocks). Chunks are grouped
into forwards; a runner with mixed batches takes the round's chunks and decode rows in one forward. A long prompt
therefore delays the others' next token by at most one chunk. A runner of `whole_prompts` (an encoder, whose
attention reads every position of its input) gets each prompt in one chunk: in what is left of the round's budget, or
first in a round of its own where it is longer than the budget.

When the pool has too few free blocks for a request's work, the newest running request that holds blocks is
preempted: its blocks go back to the pool, it keeps its batch row (its sampling state stays), and it reads its prompt
and the tokens it has generated again as a prompt when blocks are free, then decodes on. Its caller sees no
difference but time. A prompt chunk that still finds too few blocks waits for a later round.

A cached prefix gives the same tokens as a fresh run (issue 30) where the runner's kernels round a row alike in any
forward of at least `uniform_rows` rows (Capabilities.uniform_rows): a CPU's kernels pick another product for fewer
rows (torch's int4 / int8 layers below dequant.CPU_DEQUANTIZE_ROWS, llama.cpp's below its own switch), which rounds
differently. So, with `uniform_rows` R: a cache hit leaves at least R prompt tokens to compute (the forward after a
cached prefix holds R rows, as the fresh run's chunk over those positions does, and a prompt shorter than R finds
nothing); a chunk never leaves fewer than R tokens for its prompt's last chunk (a fresh run's last chunk holds R rows
too); and a chunk that the round's budget would cut below R waits for the next round. Every prompt position of a
prompt of R tokens or more is then computed in forwards of R rows or more, whatever was cached, and for a request
computed alone (nothing else in its forwards) a cached prefix changes no logit (the runners keep the rest of the
forward's shape from mattering: device_paths.py's CPU_KEY_BLOCK, llama_cpp_runner.py's exact prefixes). What it does
not cover: positions computed by decode steps (a conversation's earlier answers, cached and fed again as a prompt),
chunks cut short by a lack of free blocks, a prefix that only requests computed beside others hold (llama.cpp's
unified KV pool, where other sequences' cells change the attention sums), and torch's first chunk of a prompt (from
position 0, whose attention reads only its own keys) where a cache hit ends inside it.

`deterministic` (batch invariance): a request's tokens must not depend on what else runs, so every chunk and every
decode row has a forward of its own, chunks split a prompt at multiples of `prefill_chunk` whatever else runs, and
the prefix cache serves and keeps only prompt blocks inside whole chunks, which any request computes alike.
"""

from collections import deque
from collections.abc import Callable

from rbee_worker.engine.engine_config import EngineConfig
from rbee_worker.engine.plan import (
    Chunk,
    Computed,
    Decode,
    Drawn,
    Ending,
    Executed,
    Failed,
    Forward,
    Generated,
    Lost,
    Plan,
    Progress,
    Sequence,
)
from rbee_worker.engine.request_types import ErrorCode, StopReason
from rbee_worker.engine.runners.protocol import Capabilities, KvGeometry, PrefixHit, RuntimePrefixes
from rbee_worker.engine.scheduling.kv_blocks import common_prefix
from rbee_worker.engine.scheduling.kv_manager import KvManager

# Tokens proposed to follow a sequence's last one (speculative decoding), as many as the proposer has up to `limit`.
Proposer = Callable[[Sequence, int], tuple[int, ...]]


class Scheduler:
    """Owns the admitted requests (`waiting` for a row, `running` in one), the rows, the KV manager that holds their
    blocks (`kv`), and each sequence's progress."""

    def __init__(
        self,
        config: EngineConfig,
        capabilities: Capabilities,
        kv: KvGeometry,
        eos_ids: frozenset[int] = frozenset(),
        prefixes: RuntimePrefixes | None = None,
        proposer: Proposer | None = None,
    ) -> None:
        """`capabilities`: the runner's (see the module docstring); `eos_ids`: the tokens that end a sequence;
        `prefixes`: what a runtime whose memory the block pool does not describe holds (Runner.prefixes);
        `proposer`: tokens proposed for a decode row to verify, where the runner's rows carry several."""
        self.config = config
        self.whole_prompts = capabilities.whole_prompts
        self.uniform_rows = 1 if config.deterministic else capabilities.uniform_rows
        self.mixed_batches = capabilities.mixed_batches and not config.deterministic
        self.eos_ids = eos_ids
        self.proposer = proposer if capabilities.row_tokens > 1 else None
        self.row_tokens = capabilities.row_tokens
        self.kv = KvManager(config, kv)
        # Where the runtime keeps a prefix cache of its own (Runner.prefixes), it is looked up instead of the pool's.
        self._prefixes = prefixes
        self._restores: list[tuple[Sequence, PrefixHit]] = []  # the prefixes this round's plan restores
        self._lost: set[Sequence] = set()  # sequences whose restore failed: they look up nothing more
        self.waiting: deque[Sequence] = deque()  # arrival order
        self.running: list[Sequence] = []  # admission order, which is arrival order
        self._by_id: dict[str, Sequence] = {}
        self._free_rows = list(range(config.max_batch))
        self.preemptions = 0
        self._preempted: list[Sequence] = []  # the sequences preempted while planning this round
        self._abandoned: list[Sequence] = []  # sequences whose caller is gone, to end as cancelled
        # Sequences preempted with a token in flight: its row's keys and values went with their blocks.
        self._settling: set[Sequence] = set()

    def add(self, sequence: Sequence) -> None:
        self.waiting.append(sequence)
        self._by_id[sequence.request_id] = sequence

    def get(self, request_id: str) -> Sequence | None:
        return self._by_id.get(request_id)

    def __len__(self) -> int:
        """Sequences admitted and not finished: running and waiting."""
        return len(self._by_id)

    def schedule(self) -> Plan:
        """This round's work; waiting sequences take free rows."""
        started = []
        while self.waiting and self._free_rows:
            sequence = self.waiting.popleft()
            sequence.row = self._free_rows.pop(self._free_rows.index(min(self._free_rows)))
            self.running.append(sequence)
            started.append(sequence)
        self._abandoned = [s for s in self._by_id.values() if s.output.undeliverable]
        chunks: list[Chunk] = []
        decoding: list[Decode] = []
        budget = self.config.prefill_chunk
        for sequence in list(self.running):
            if sequence.output.undeliverable:
                continue
            if sequence.prefilling:
                chunk = self._chunk(sequence, budget)
                if chunk is None:
                    continue
                budget -= chunk.count
                chunks.append(chunk)
            elif self.wants_token(sequence) and (decode := self._decode(sequence)):
                decoding.append(decode)
        if self.mixed_batches:
            forwards = [Forward(chunks, decoding)] if chunks or decoding else []
        else:
            forwards = [Forward(group, []) for group in self._group(chunks)]
            if self.config.deterministic:
                forwards += [Forward([], [decode]) for decode in decoding]
            elif decoding:
                forwards.append(Forward([], decoding))
        preempted, self._preempted = self._preempted, []
        restores, self._restores = self._restores, []
        return Plan(preempted, started, forwards, restores)

    def _decode(self, sequence: Sequence) -> Decode | None:
        """The sequence's decode row (its last token, after the one in flight where a row of it is, then what the
        proposer proposes), its blocks taken; None when it was preempted for want of them."""
        position = sequence.cached + sequence.launched
        draft: tuple[int, ...] = ()
        if self.proposer is not None and not sequence.launched:  # positions after a row in flight are not known
            limit = min(self.row_tokens - 1, sequence.request.max_tokens - len(sequence.output_ids) - 1)
            draft = self.proposer(sequence, limit)[:limit] if limit > 0 else ()
        if not self._room(sequence, position + 1 + len(draft)):
            return None
        decode = Decode(sequence, position, sequence.launched > 0, draft)
        sequence.launched += 1
        return decode

    def _chunk(self, sequence: Sequence, budget: int) -> Chunk | None:
        """The sequence's next prompt chunk within `budget` tokens, its blocks taken; None when it waits (no budget
        left, or too few blocks even after preempting newer requests, or a preempted sequence's token is still in
        flight: its tokens are not all known)."""
        if budget <= 0 or sequence.launched:
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
        if not self._room(sequence, sequence.cached + count, wait=True):
            if self.config.deterministic or self.whole_prompts:
                return None
            # As much of the chunk as its blocks and the free ones hold.
            count = min(count, self.kv.held_tokens(sequence) - sequence.cached)
            if count <= 0 or not self.kv.grow(sequence, sequence.cached + count):
                return None
        if not sequence.looked_up:  # its first chunk runs: what it found is what it reports
            sequence.looked_up = True
            sequence.cached_prompt_tokens = sequence.cached
            self.kv.blocks.count_query(len(sequence.request.prompt_ids), sequence.cached)
        return Chunk(sequence, sequence.cached, count)

    def _sibling_computes(self, sequence: Sequence) -> bool:
        """Whether an older running request is computing the same first block of prompt (`n` choices of one prompt, a
        batch of prompts sharing a system prompt): this one waits for its blocks to land in the prefix cache rather
        than computing them again beside it (vLLM registers blocks as they are allocated; here as they are
        computed)."""
        size = self.kv.blocks.block_size
        prompt = sequence.request.prompt_ids
        takes = len(prompt) - max(self.uniform_rows, 1)  # the most a cache hit gives it (see _look_up)
        if not self.kv.blocks.prefix_caching or takes < size or sequence.scoring or sequence.request.embed:
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
        the module docstring): whole blocks of the pool's prefix cache, or what the runtime's own memory holds
        (Runner.prefixes; the plan restores it). A sequence scoring or embedding its prompt takes none: it needs
        every position's output."""
        if sequence.scoring or sequence.request.embed:
            return
        limit = max(sequence.prefill_end - max(self.uniform_rows, 1), 0)
        if self.config.deterministic:
            limit -= limit % self.config.prefill_chunk
        if self._prefixes is None:
            sequence.cached = self.kv.match(sequence, limit)
            return
        assert sequence.row is not None
        if sequence in self._preempted or sequence in self._lost:  # its runtime memory goes when this round starts
            return
        tokens = sequence.token_ids(0, sequence.prefill_end)
        hit = self._prefixes.find(sequence.row, tokens, limit)  # restored before this round's evictions
        # The runtime's cells are its own; the pool accounts for them as the sequence's blocks.
        if hit is not None and self.kv.blocks.grow(sequence.table, len(hit.token_ids)):
            sequence.cached = len(hit.token_ids)
            self._restores.append((sequence, hit))

    def _room(self, sequence: Sequence, tokens: int, wait: bool = False) -> bool:
        """Blocks for the sequence's positions 0..tokens-1, preempting newer running requests while too few are free.
        A decode row that finds none preempts its own sequence; a prompt chunk (`wait`) then waits instead."""
        while not self.kv.grow(sequence, tokens):
            victim = next(
                (s for s in reversed(self.running) if s is not sequence and s.table.blocks and not s.finished), None
            )
            if victim is None or self.running.index(victim) < self.running.index(sequence):
                if not wait:
                    self._preempt(sequence)
                return False
            self._preempt(victim)
        return True

    def _preempt(self, sequence: Sequence) -> None:
        """The sequence lets go of its blocks and reads its tokens again later; its row and sampling state stay. A
        token of it in flight is taken first (the executor settles the step before the runtime lets go of it), and
        appended when it comes (`update`)."""
        if sequence.launched:
            self._settling.add(sequence)
        self.kv.release(sequence)
        sequence.cached = 0
        self.preemptions += 1
        self._preempted.append(sequence)

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

    def update(self, executed: Executed) -> Progress:
        """What the executor computed, taken in order: each chunk's and each decode row's positions are cached (the
        full blocks among them join the prefix cache, a row's rejected tail goes back), each sampled token is the
        sequence's, up to EOS or max_tokens; what the output processor is to make of it, in the same order, the
        sequences whose caller is gone first (to end as cancelled)."""
        progress: Progress = [Ending(s, StopReason.CANCELLED) for s in self._abandoned]
        # Sequences this update ends: their tokens that come after are thrown away (a later row of theirs in the same
        # step, a mixed forward's after the step in flight was taken, is computed and thrown away, as a chained row is).
        ended: set[Sequence] = set(self._abandoned)
        self._abandoned = []
        for item in executed:
            if isinstance(item, Computed):
                sequence = item.sequence
                if sequence.finished or sequence in ended:
                    continue
                sequence.cached += item.chunk.count
                self.kv.register(sequence)
                progress.append(item)
                if item.chunk.ends_prompt and not item.chunk.samples:  # a request for its prompt only ends with it
                    progress.append(Ending(sequence, StopReason.MAX_TOKENS))
                    ended.add(sequence)
            elif isinstance(item, Drawn):
                if item.decode is not None:
                    item.sequence.launched -= 1
                if item.sequence.finished or item.sequence in ended:
                    continue
                outcome = self._drawn(item)
                progress.append(outcome)
                if isinstance(outcome, Failed) or outcome.stop is not None:
                    ended.add(item.sequence)
            elif isinstance(item, Lost):
                self._restart(item.sequence)
            elif not item.sequence.finished and item.sequence not in ended:
                progress.append(item)
                ended.add(item.sequence)
        return progress

    def _restart(self, sequence: Sequence) -> None:
        """The runtime lost the prefix restored for the sequence: it reads its prompt from the start, looking up
        nothing (what it found is no longer counted as found)."""
        self._lost.add(sequence)
        self.kv.blocks.hit_tokens -= sequence.cached_prompt_tokens
        sequence.cached_prompt_tokens = 0
        self.kv.release(sequence)
        sequence.cached = 0

    def _drawn(self, drawn: Drawn) -> Generated | Failed:
        """A running sequence's sampled tokens (see `update`)."""
        sequence, sampled, decode = drawn.sequence, drawn.sampled, drawn.decode
        if decode is not None:
            if sequence in self._settling:  # preempted: its row's keys and values went with its blocks
                if not sequence.launched:
                    self._settling.discard(sequence)
            else:
                sequence.cached += len(sampled.tokens)  # its fed positions up to the last token accepted
                if decode.draft:  # the rejected tail's positions and blocks go back
                    self.kv.shorten(sequence, sequence.cached + sequence.launched)
                self.kv.register(sequence)
        if not sampled.valid:
            message = "inference failed: the model's logits give no valid choice"
            return Failed(sequence, ErrorCode.INFERENCE_FAILED, message)
        if isinstance(drawn.grammar, Exception):
            return Failed(sequence, ErrorCode.INTERNAL_ERROR, f"internal error: {drawn.grammar}")
        tokens: list[int] = []
        stop = None
        for token in sampled.tokens:
            tokens.append(token)
            if token in self.eos_ids and not sequence.request.ignore_eos:
                stop = StopReason.EOS
                break
            sequence.output_ids.append(token)
            if len(sequence.output_ids) >= sequence.request.max_tokens:
                stop = StopReason.MAX_TOKENS
                break
        logprobs = sampled.logprobs[: len(tokens)]
        return Generated(sequence, tuple(tokens), logprobs, drawn.grammar, stop)

    def wants_token(self, sequence: Sequence) -> bool:
        """Whether the sequence runs, has read its prompt, and needs a token beyond those in flight."""
        return (
            not sequence.finished
            and not sequence.prefilling
            and len(sequence.output_ids) + sequence.launched < sequence.request.max_tokens
        )

    def free(self, sequence: Sequence) -> int | None:
        """The sequence has ended: its row and blocks are free for the next, its id may come again. The row it held,
        if it ran."""
        if sequence.finished:
            return None
        sequence.finished = True
        del self._by_id[sequence.request_id]
        if sequence.row is None:
            self.waiting.remove(sequence)
            return None
        row, sequence.row = sequence.row, None
        self.running.remove(sequence)
        self._free_rows.append(row)
        self.kv.release(sequence)
        self._settling.discard(sequence)
        self._lost.discard(sequence)
        sequence.cached = 0
        return row
