"""The scheduler: which requests run, which slot each holds, what each round computes, and how far each request has got.

It knows no tensors and no text: the runner turns its plan into forwards and sampled tokens (engine/step.py), the
output processor turns tokens into events (engine/output.py). Each round (`schedule`): waiting requests take free
slots (the lowest first) in arrival order, up to `max_batch` running at once; requests still reading their prompt get
prompt chunks, up to `prefill_chunk` tokens in all, oldest first, grouped into forwards; every running request with
its prompt cached decodes one token. A long prompt therefore delays the others' next token by at most one chunk. A
runner with mixed batches takes the round's chunks and decode rows in one forward.

`deterministic` (batch invariance): a request's tokens must not depend on what else runs, so every chunk and every
decode row has a forward of its own, and chunks split a prompt at multiples of `prefill_chunk` whatever else runs.
"""

from collections import deque
from dataclasses import dataclass, field

from rbee_worker.engine.config import EngineConfig
from rbee_worker.engine.output import Output
from rbee_worker.engine.types import Request


@dataclass(eq=False)
class Sequence:
    """A request admitted to the engine, and how far it has got."""

    request: Request
    seed: int
    output: Output  # the output processor's record of it
    slot: int | None = None  # its row in the KV cache and the sampler, while it runs
    cached: int = 0  # tokens whose keys and values are in its slot: the prompt first, then all but the last output
    output_ids: list[int] = field(default_factory=list)  # generated tokens, EOS excluded
    launched: int = 0  # decode steps launched whose tokens the host has not taken yet (see Steps._decode)
    finished: bool = False  # ended: its slot is free and its id may come again

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prefilling(self) -> bool:
        return self.cached < len(self.request.prompt_ids)


@dataclass(frozen=True)
class Chunk:
    """Prompt tokens [start, start + count) of a sequence, fed in one forward."""

    sequence: Sequence
    start: int
    count: int

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.sequence.request.prompt_ids[self.start : self.start + self.count]

    @property
    def completes_prompt(self) -> bool:
        return self.start + self.count == len(self.sequence.request.prompt_ids)


@dataclass(frozen=True)
class Forward:
    """One forward of a round: prompt chunks, decode rows (one token for each sequence), or, for a runner with mixed
    batches, both."""

    chunks: list[Chunk]
    decode: list[Sequence]


@dataclass(frozen=True)
class Plan:
    """One round: the sequences that took a slot (their sampling state goes there first), those whose caller is gone
    (to end as cancelled), then the forwards in order, decode rows last."""

    started: list[Sequence]
    abandoned: list[Sequence]
    forwards: list[Forward]


class Scheduler:
    """Owns the admitted requests (`waiting` for a slot, `running` in one), the slots, and each sequence's progress."""

    def __init__(self, config: EngineConfig, mixed_batches: bool) -> None:
        self.config = config
        self.mixed_batches = mixed_batches and not config.deterministic
        self.waiting: deque[Sequence] = deque()  # arrival order
        self.running: list[Sequence] = []  # admission order, which is arrival order
        self._by_id: dict[str, Sequence] = {}
        self._free_slots = list(range(config.max_batch))

    def add(self, sequence: Sequence) -> None:
        self.waiting.append(sequence)
        self._by_id[sequence.request_id] = sequence

    def get(self, request_id: str) -> Sequence | None:
        return self._by_id.get(request_id)

    def __len__(self) -> int:
        """Sequences admitted and not finished: running and waiting."""
        return len(self._by_id)

    def schedule(self) -> Plan:
        """This round's work; waiting sequences take free slots."""
        started = []
        while self.waiting and self._free_slots:
            sequence = self.waiting.popleft()
            sequence.slot = self._free_slots.pop(self._free_slots.index(min(self._free_slots)))
            self.running.append(sequence)
            started.append(sequence)
        abandoned = [s for s in self._by_id.values() if s.output.undeliverable]
        running = [s for s in self.running if not s.output.undeliverable]
        chunks = self._chunks([s for s in running if s.prefilling])
        decoding = [s for s in running if not s.prefilling]
        if self.mixed_batches:
            forwards = [Forward(chunks, decoding)] if chunks or decoding else []
        else:
            forwards = [Forward(group, []) for group in self._group(chunks)]
            if self.config.deterministic:
                forwards += [Forward([], [sequence]) for sequence in decoding]
            elif decoding:
                forwards.append(Forward([], decoding))
        return Plan(started, abandoned, forwards)

    def _chunks(self, sequences: list[Sequence]) -> list[Chunk]:
        """Up to prefill_chunk prompt tokens, oldest request first."""
        chunk_size = self.config.prefill_chunk
        budget = chunk_size
        chunks = []
        for sequence in sequences:
            prompt = sequence.request.prompt_ids
            # In deterministic mode chunks end at multiples of prefill_chunk whatever else ran in this round: a chunk
            # that does not fit in what is left of the round's budget waits for the next round.
            room = chunk_size - sequence.cached % chunk_size if self.config.deterministic else budget
            count = min(room, len(prompt) - sequence.cached)
            if count > budget or budget <= 0:
                break
            budget -= count
            chunks.append(Chunk(sequence, sequence.cached, count))
        return chunks

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
        """A forward put these chunks' and these decode rows' keys and values in their sequences' slots."""
        for chunk in chunks:
            chunk.sequence.cached += chunk.count
        for sequence in decoded:
            sequence.cached += 1

    def append(self, sequence: Sequence, token: int) -> bool:
        """A generated token (not EOS) of the sequence; True when it is the last that max_tokens allows."""
        sequence.output_ids.append(token)
        return len(sequence.output_ids) >= sequence.request.max_tokens

    def wants_token(self, sequence: Sequence) -> bool:
        """Whether the sequence runs and needs a token beyond those already launched."""
        return not sequence.finished and len(sequence.output_ids) + sequence.launched < sequence.request.max_tokens

    def free(self, sequence: Sequence) -> None:
        """The sequence has ended: its slot is free for the next, its id may come again."""
        if sequence.finished:
            return
        sequence.finished = True
        del self._by_id[sequence.request_id]
        if sequence.slot is None:
            self.waiting.remove(sequence)
            return
        self.running.remove(sequence)
        self._free_slots.append(sequence.slot)
        sequence.slot = None
        sequence.cached = 0

    def kv_positions(self) -> int:
        """Token positions that running requests hold in the KV cache."""
        return sum(s.cached for s in list(self.running))
