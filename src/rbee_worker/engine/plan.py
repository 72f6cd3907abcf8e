"""What passes between the three stages of a step (engine/core.py): the scheduler's records and its plan
(`Sequence`, `Chunk`, `Decode`, `Forward`, `Plan`), what the executor computed (`Computed`, `Drawn`, `Failed`), and
what the scheduler made of it for the output processor (`Generated`, `Ending`). Plain data: no stage calls another
through these types."""

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from rbee_worker.engine.detokenizer import Detokenizer
from rbee_worker.engine.request_types import ErrorCode, Event, Request, StopReason, TokenLogprob
from rbee_worker.engine.runners.protocol import PrefixHit, Sampled
from rbee_worker.engine.scheduling.kv_blocks import BlockTable
from rbee_worker.engine.structured.grammar import Matcher

Sink = Callable[[Event], None]


@dataclass(eq=False)
class Output:
    """A request's output so far (the output processor's record): where its events go, its text, its timings."""

    sink: Sink
    detokenizer: Detokenizer
    submitted_at: float = field(default_factory=time.perf_counter)
    pieces: int = 0  # Token events sent
    tokens: int = 0  # generated tokens taken (EOS excluded)
    first_token_at: float | None = None
    last_token_at: float | None = None
    undeliverable: bool = False  # an event could not be delivered: the caller is gone
    grammar: Matcher | None = None  # structured output: where the request is in its grammar
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # its prompt's, computed so far
    pooled: np.ndarray | None = None  # an embedding request's pooled hidden states so far (PromptRow.pool)


@dataclass(eq=False)
class Sequence:
    """A request admitted to the engine, and how far it has got (the scheduler's record; the other stages read it)."""

    request: Request
    seed: int
    output: Output  # the output processor's record of it
    row: int | None = None  # its batch row (sampling state), while it runs
    table: BlockTable = field(default_factory=BlockTable)  # its KV blocks
    window_table: BlockTable = field(default_factory=BlockTable)  # its window's, in the sliding layers' own pool
    cached: int = 0  # tokens whose keys and values are in its blocks: the prompt first, then all but the last output
    cached_prompt_tokens: int = 0  # prompt tokens that its first chunk found in the prefix cache
    output_ids: list[int] = field(default_factory=list)  # generated tokens, EOS excluded
    launched: int = 0  # decode rows planned whose tokens the scheduler has not taken yet (in flight)
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
    forward. `ends_prompt`: the chunk computes the prompt's last token, for the first time (not again after a
    preemption), as planned (its sequence's first token, taken later, does not change it)."""

    sequence: Sequence
    start: int
    count: int
    ends_prompt: bool = field(init=False)

    def __post_init__(self) -> None:
        ends = not self.sequence.output_ids and self.start + self.count == self.sequence.prefill_end
        object.__setattr__(self, "ends_prompt", ends)

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.sequence.token_ids(self.start, self.start + self.count)

    @property
    def samples(self) -> bool:
        """Whether the chunk ends a prompt and a token follows (after a preemption the last output follows; with
        max_tokens 0 none does)."""
        return self.ends_prompt and self.sequence.request.max_tokens > 0

    @property
    def targets(self) -> tuple[int, ...]:
        """Where its sequence is scoring: the prompt's tokens after the chunk's positions (after its last one, but
        for the prompt's last token, which the first output follows)."""
        if not self.sequence.scoring:
            return ()
        prompt = self.sequence.request.prompt_ids
        return prompt[self.start + 1 : min(self.start + self.count + 1, len(prompt))]


@dataclass(frozen=True)
class Decode:
    """A decode row of the plan: the sequence's last token, then `draft` (tokens proposed to follow it), fed at
    `position` on; the step samples after each of them and gives back the tokens it accepts (1 .. 1 + len(draft)).
    `chained`: the last token is the one the row's step in flight chooses (not on the host yet); its position counts
    it."""

    sequence: Sequence
    position: int
    chained: bool = False
    draft: tuple[int, ...] = ()


@dataclass(frozen=True)
class Forward:
    """One forward of a round: prompt chunks, decode rows, or, for a runner with mixed batches, both."""

    chunks: list[Chunk]
    decode: list[Decode]


@dataclass(frozen=True)
class Plan:
    """One round, in the order the executor carries it out: the prefixes that the runtime's own memory holds for
    prompts about to start (`restores`, where it keeps them: Runner.prefixes), the sequences preempted (the executor
    first takes a token of theirs still in flight, then the runtime lets go of what it keeps for them), those that
    took a batch row (their sampling state goes there), then the forwards in order, decode rows last."""

    preempted: list[Sequence]
    started: list[Sequence]
    forwards: list[Forward]
    restores: list[tuple[Sequence, PrefixHit]] = field(default_factory=list)


# -- what the executor computed, in the order it computed it ------------------------------------------------------


@dataclass(frozen=True)
class Computed:
    """A prompt chunk's keys and values are in its blocks; the log-probabilities of its targets (Chunk.targets) and,
    for an embedding, what its hidden states pooled to (PromptRow.pool)."""

    chunk: Chunk
    scored: tuple[TokenLogprob, ...] = ()
    pooled: np.ndarray | None = None

    @property
    def sequence(self) -> Sequence:
        return self.chunk.sequence


@dataclass(frozen=True)
class Drawn:
    """Tokens sampled for a sequence: after its prompt's last chunk (`decode` None), or by a decode row (whose fed
    positions before the last accepted token are computed). `grammar`: a constrained sequence's matcher took the
    tokens (True), met EOS among them (False), or failed (the exception); None for an unconstrained one."""

    sequence: Sequence
    sampled: Sampled
    decode: Decode | None = None
    grammar: bool | Exception | None = None


@dataclass(frozen=True)
class Failed:
    """The runner failed a step of this sequence (or the host failed on it): it ends with this error."""

    sequence: Sequence
    code: ErrorCode
    message: str


@dataclass(frozen=True)
class Lost:
    """The runtime could not restore the prefix the plan gave this sequence (Plan.restores): its chunk did not run,
    and it reads its prompt from the start."""

    sequence: Sequence


Executed = list[Computed | Drawn | Failed | Lost]


# -- what the scheduler made of it, for the output processor -----------------------------------------------------


@dataclass(frozen=True)
class Generated:
    """A sequence's new tokens as the scheduler took them: up to its first EOS (included, where EOS ends it) and no
    further than max_tokens; `logprobs` one for each token where the request asked for them."""

    sequence: Sequence
    tokens: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...]
    grammar: bool | None  # as Drawn.grammar, failures aside
    stop: StopReason | None  # EOS or MAX_TOKENS where these tokens end it


@dataclass(frozen=True)
class Ending:
    """The sequence ends for `reason` with no new token (a request for its prompt only, or one whose caller is
    gone)."""

    sequence: Sequence
    reason: StopReason


Progress = list[Computed | Generated | Failed | Ending]
