"""Output processing: what becomes of a request's sampled tokens. The end-of-sequence token, the request's grammar
(`advance`: each token advances its matcher), detokenizing, stop strings, the tokens' log-probabilities, the timings
the metrics observe, and every event the request's caller receives.

The scheduler decides who runs and how far each sequence has got; this module turns tokens into events and says when
a request's text or EOS ends it. Everything here runs on the engine thread.
"""

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from rbee_worker.engine.detokenizer import Detokenizer
from rbee_worker.engine.grammar import Matcher, accept_tokens
from rbee_worker.engine.types import (
    Embedding,
    End,
    Error,
    ErrorCode,
    Event,
    PromptLogprobs,
    Request,
    Started,
    StopReason,
    Token,
    TokenLogprob,
)

if TYPE_CHECKING:
    import numpy as np

    from rbee_worker.engine.scheduler import Sequence

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
class Output:
    """A request's output so far: where its events go, its text, its timings."""

    sink: Sink
    detokenizer: Detokenizer
    submitted_at: float = field(default_factory=time.perf_counter)
    pieces: int = 0  # Token events sent
    first_token_at: float | None = None
    last_token_at: float | None = None
    undeliverable: bool = False  # an event could not be delivered: the caller is gone
    grammar: Matcher | None = None  # structured output: where the request is in its grammar
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # its prompt's, computed so far
    pooled: "np.ndarray | None" = None  # an embedding request's pooled hidden states so far (PromptRow.pool)


class GrammarRejected(RuntimeError):
    """A constrained request's token that its grammar does not allow: a bug, since the row's mask rules it out."""


class OutputProcessor:
    """Turns each sampled token of a sequence into events and tells the caller whether it ends the sequence; builds
    the one terminal event of every request and hands it to `retire`, which frees what the engine holds for the
    request and delivers the event."""

    def __init__(
        self,
        eos_ids: frozenset[int],
        kv_bytes: "Callable[[int], int]",
        retire: "Callable[[Sequence, End | Error], None]",
        observer: EngineObserver | None = None,
    ) -> None:
        self._eos = eos_ids
        self._kv_bytes = kv_bytes  # a request's KV cache bytes for the positions it holds (KvGeometry.request_bytes)
        self._retire = retire
        self.observer = observer or NoObserver()

    def started(self, sequence: "Sequence") -> None:
        send(sequence, Started(sequence.request_id, len(sequence.request.prompt_ids), sequence.seed))

    def advance(self, taken: "Iterable[tuple[Matcher, int]]") -> "list[bool | Exception]":
        """Constrained sequences' sampled tokens through their grammars (each sequence's matcher with its token), before
        `token` (the grammars' next masks can then be filled first), the rows together (grammar.accept_tokens: many
        on several threads). For each: False for EOS, which ends the request and is no part of its text; True for a
        token its grammar took; an exception for one that failed, GrammarRejected for a token the grammar does not
        allow (its mask rules that out)."""
        pairs = list(taken)
        results: list[bool | Exception] = [False] * len(pairs)
        accepting = [i for i, (_, token) in enumerate(pairs) if token not in self._eos]  # EOS: never ignored here
        accepted = accept_tokens([pairs[i][0] for i in accepting], [pairs[i][1] for i in accepting])
        for i, result in zip(accepting, accepted, strict=True):
            if result is False:
                result = GrammarRejected(f"the request's grammar does not allow the token chosen ({pairs[i][1]})")
            results[i] = result
        return results

    def prompt_scored(self, sequence: "Sequence", start: int, scored: tuple[TokenLogprob, ...], ends: bool) -> None:
        """The log-probabilities of the prompt's tokens after positions start.. (a chunk's; those of a chunk read
        again after a preemption are known already); `ends`: the chunk ends the prompt, whose PromptLogprobs go out
        (for a request that asked)."""
        known = sequence.output.prompt_logprobs
        known.extend(scored[len(known) - start :])
        if ends and sequence.request.prompt_logprobs is not None:
            send(sequence, PromptLogprobs(sequence.request_id, tuple(known)))

    def pooled(
        self, sequence: "Sequence", mode: str, start: int, count: int, pooled: "np.ndarray | None", ends: bool
    ) -> None:
        """What a chunk of an embedding request's prompt gave (PromptRow.pool); `ends`: the chunk ends the prompt,
        whose Embedding goes out (the mean over its positions, or the pooled position's vector). A chunk from position
        0 starts afresh: after a preemption the prompt is computed again from there."""
        output = sequence.output
        if start == 0:
            output.pooled = None
        if pooled is not None:
            output.pooled = pooled if output.pooled is None or mode != "mean" else output.pooled + pooled
        if ends:
            assert output.pooled is not None, "a prompt's last chunk pools"
            values = output.pooled / (start + count) if mode == "mean" else output.pooled
            send(sequence, Embedding(sequence.request_id, tuple(values.tolist())))

    def token(self, sequence: "Sequence", token: int, logprob: TokenLogprob | None) -> StopReason | None:
        """A sampled token of the sequence (of a constrained one: after `advance`): EOS ends it (and is not output);
        otherwise its text goes out, and a stop string that its text completes ends it."""
        output = sequence.output
        now = time.perf_counter()
        if output.last_token_at is None:
            output.first_token_at = now
            self.observer.first_token(now - output.submitted_at)
        else:
            self.observer.next_token(now - output.last_token_at)
        output.last_token_at = now
        if token in self._eos and not sequence.request.ignore_eos:
            return StopReason.EOS
        text = output.detokenizer.add_token(token)
        self._piece(sequence, text, (token,), () if logprob is None else (logprob,))
        return StopReason.STOP_SEQUENCE if output.detokenizer.stop_matched is not None else None

    def end(self, sequence: "Sequence", reason: StopReason) -> None:
        """The sequence ends for `reason`: the text held back goes out (unless cancelled), then its End event."""
        output = sequence.output
        if reason is not StopReason.CANCELLED and (rest := output.detokenizer.finish()):
            self._piece(sequence, rest, (), ())
        now = time.perf_counter()
        first = output.first_token_at or now
        self._terminal(
            sequence,
            End(
                request_id=sequence.request_id,
                stop_reason=reason,
                prompt_tokens=len(sequence.request.prompt_ids),
                cached_tokens=sequence.cached_prompt_tokens,
                tokens_out=len(sequence.output_ids),
                seed=sequence.seed,
                stop_sequence=output.detokenizer.stop_matched,
                time_to_first_token_s=first - output.submitted_at,
                decode_time_s=now - first,
                kv_cache_bytes=self._kv_bytes(sequence.cached),
            ),
        )

    def fail(self, sequence: "Sequence", code: ErrorCode, message: str) -> None:
        self._terminal(sequence, Error(sequence.request_id, code, message))

    def _terminal(self, sequence: "Sequence", terminal: End | Error) -> None:
        # Counted before the caller hears of it: a client that reads /metrics right after its response sees its
        # request there.
        self.observer.finished(sequence.request, terminal, time.perf_counter() - sequence.output.submitted_at)
        self._retire(sequence, terminal)

    def _piece(
        self, sequence: "Sequence", text: str, token_ids: tuple[int, ...], logprobs: tuple[TokenLogprob, ...]
    ) -> None:
        send(sequence, Token(sequence.request_id, text, token_ids, sequence.output.pieces, logprobs))
        sequence.output.pieces += 1


def send(sequence: "Sequence", event: Event) -> None:
    """Deliver an event; a consumer that is gone (its event loop closed, say) marks the request undeliverable, which
    the scheduler ends as cancelled, instead of taking the engine thread down."""
    try:
        sequence.output.sink(event)
    except Exception:
        log.warning("could not deliver an event of request %s; cancelling it", sequence.request_id)
        sequence.output.undeliverable = True
