"""The scheduler: which requests run, which slot each holds, what each round computes, and when a request ends.

It knows no tensors: the runner turns its plan into forwards and sampled tokens, and hands the tokens back through
`accept`. Each round (`schedule`): requests cancelled since the last round end; waiting requests take free slots (the
lowest first) in arrival order, up to one slot each of the `max_batch`; requests still reading their prompt get prompt
chunks, up to `prefill_chunk` tokens in all, oldest first, grouped into forwards; every request with its prompt cached
decodes one token. A long prompt therefore delays the others' next token by at most one chunk.

`deterministic` (batch invariance): a request's tokens must not depend on what else runs, so every chunk has a forward
of its own and chunks split a prompt at multiples of `prefill_chunk` whatever else runs (the runner also decodes each
sequence alone).
"""

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from rbee_worker.engine.config import EngineConfig
from rbee_worker.engine.detokenizer import Detokenizer
from rbee_worker.engine.types import End, Error, ErrorCode, Event, Request, StopReason, Token, TokenLogprob

log = logging.getLogger(__name__)

Sink = Callable[[Event], None]


class EngineObserver(Protocol):
    """Told about every request's timing on the engine thread (the worker's metrics); must be quick."""

    def first_token(self, seconds: float) -> None:
        """From submission to the first sampled token."""

    def next_token(self, seconds: float) -> None:
        """Between two sampled tokens of one request (the end-of-sequence token included)."""

    def finished(self, request: Request, terminal: End | Error, seconds: float) -> None:
        """The request ended, `seconds` after its submission."""


class NoObserver:
    def first_token(self, seconds: float) -> None:
        pass

    def next_token(self, seconds: float) -> None:
        pass

    def finished(self, request: Request, terminal: End | Error, seconds: float) -> None:
        pass


@dataclass(eq=False)
class Sequence:
    """A request admitted to the engine, and how far it has got."""

    request: Request
    sink: Sink
    seed: int
    detokenizer: Detokenizer
    submitted_at: float = field(default_factory=time.perf_counter)
    slot: int | None = None  # its row in the KV cache, once it runs
    cached: int = 0  # tokens whose keys and values are in its slot: the prompt first, then all but the last output
    output_ids: list[int] = field(default_factory=list)
    pieces: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    cancelled: bool = False
    launched: int = 0  # decode steps launched whose tokens the host has not taken yet (see Steps._decode_ahead)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prefilling(self) -> bool:
        return self.cached < len(self.request.prompt_ids)

    def send(self, event: Event) -> None:
        """Deliver an event; a consumer that is gone (its event loop closed, say) cancels the request instead of
        taking the engine thread down."""
        try:
            self.sink(event)
        except Exception:
            log.warning("could not deliver an event of request %s; cancelling it", self.request_id)
            self.cancelled = True


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
class Plan:
    """One round: sequences that took a slot (their sampling state goes there first), prompt chunks in groups (a forward
    each), then one decode step over `decode`."""

    started: list[Sequence]
    prefill: list[list[Chunk]]
    decode: list[Sequence]


class Scheduler:
    """Owns the admitted requests (arrival order), the slots, and the rules that end a request. Terminal events go
    through `retired`, which frees what the engine holds for the request before the caller hears of it."""

    def __init__(
        self,
        config: EngineConfig,
        eos_ids: frozenset[int],
        bytes_per_token: int,
        retired: Callable[[Sequence, End | Error], None],
        observer: EngineObserver | None = None,
    ) -> None:
        self.config = config
        self._eos = eos_ids
        self._bytes_per_token = bytes_per_token
        self._retired = retired
        self._observer = observer or NoObserver()
        self.active: dict[str, Sequence] = {}  # arrival order: the first max_batch run, the others wait for a slot
        self._free_slots = list(range(config.max_batch))

    def add(self, sequence: Sequence) -> None:
        self.active[sequence.request_id] = sequence

    def get(self, request_id: str) -> Sequence | None:
        return self.active.get(request_id)

    def is_running(self, sequence: Sequence) -> bool:
        """Whether the sequence has not ended (a sequence object, not an id: an id can be reused at once)."""
        return self.active.get(sequence.request_id) is sequence

    @property
    def running(self) -> list[Sequence]:
        """The sequences that hold (or are next to take) a slot."""
        return list(self.active.values())[: self.config.max_batch]

    def schedule(self) -> Plan:
        """This round's work; takes slots for the sequences that start running and ends the cancelled ones."""
        running, started = [], []
        for sequence in self.running:
            if sequence.cancelled:
                self.finish(sequence, StopReason.CANCELLED)
                continue
            if sequence.slot is None:
                sequence.slot = self._free_slots.pop(self._free_slots.index(min(self._free_slots)))
                started.append(sequence)
            running.append(sequence)
        prefilling = [s for s in running if s.prefilling]
        decoding = [s for s in running if not s.prefilling]
        return Plan(started, self._group(self._chunks(prefilling)), decoding)

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

    def prefilled(self, chunk: Chunk) -> None:
        """The chunk's keys and values are in the sequence's slot."""
        chunk.sequence.cached += chunk.count

    def accept(self, sequence: Sequence, token: int, logprob: TokenLogprob | None) -> None:
        """A sampled token for the sequence: EOS, a stop string or max_tokens end it; otherwise its text goes out."""
        now = time.perf_counter()
        if sequence.last_token_at is None:
            sequence.first_token_at = now
            self._observer.first_token(now - sequence.submitted_at)
        else:
            self._observer.next_token(now - sequence.last_token_at)
        sequence.last_token_at = now
        if token in self._eos and not sequence.request.ignore_eos:
            self.finish(sequence, StopReason.EOS)
            return
        sequence.output_ids.append(token)
        text = sequence.detokenizer.add_token(token)
        self._emit_piece(sequence, text, (token,), () if logprob is None else (logprob,))
        if sequence.detokenizer.stop_matched is not None:
            self.finish(sequence, StopReason.STOP_SEQUENCE)
        elif len(sequence.output_ids) >= sequence.request.max_tokens:
            self.finish(sequence, StopReason.MAX_TOKENS)

    def has_tokens_to_launch(self, sequence: Sequence) -> bool:
        """Whether the sequence still runs and needs a token beyond those already launched."""
        return self.is_running(sequence) and len(sequence.output_ids) + sequence.launched < sequence.request.max_tokens

    def _emit_piece(
        self, sequence: Sequence, text: str, token_ids: tuple[int, ...], logprobs: tuple[TokenLogprob, ...] = ()
    ) -> None:
        sequence.send(Token(sequence.request_id, text, token_ids, sequence.pieces, logprobs))
        sequence.pieces += 1

    def finish(self, sequence: Sequence, reason: StopReason) -> None:
        if reason is not StopReason.CANCELLED and (rest := sequence.detokenizer.finish()):
            self._emit_piece(sequence, rest, ())
        now = time.perf_counter()
        first = sequence.first_token_at or now
        self.retire(
            sequence,
            End(
                request_id=sequence.request_id,
                stop_reason=reason,
                prompt_tokens=len(sequence.request.prompt_ids),
                tokens_out=len(sequence.output_ids),
                seed=sequence.seed,
                stop_sequence=sequence.detokenizer.stop_matched,
                time_to_first_token_s=first - sequence.submitted_at,
                decode_time_s=now - first,
                kv_cache_bytes=sequence.cached * self._bytes_per_token,
            ),
        )

    def fail(self, sequence: Sequence, code: ErrorCode, message: str) -> None:
        self.retire(sequence, Error(sequence.request_id, code, message))

    def retire(self, sequence: Sequence, terminal: End | Error) -> None:
        """Free the request's slot, then hand its one terminal event to `retired`."""
        if self.is_running(sequence):
            del self.active[sequence.request_id]
        if sequence.slot is not None:
            self._free_slots.append(sequence.slot)
            sequence.slot = None
            sequence.cached = 0
        # Counted before the caller hears of it: a client that reads /metrics right after its response sees its
        # request there.
        self._observer.finished(sequence.request, terminal, time.perf_counter() - sequence.submitted_at)
        self._retired(sequence, terminal)

    def cancel_all(self) -> None:
        for sequence in list(self.active.values()):
            self.finish(sequence, StopReason.CANCELLED)

    def kv_positions(self) -> int:
        """Token positions that running requests hold in the KV cache."""
        return sum(s.cached for s in list(self.active.values()))
