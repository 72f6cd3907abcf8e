"""Output processing: what becomes of a request's tokens once the scheduler has taken them. Detokenizing, stop
strings, the end of a request's grammar, the tokens' log-probabilities, the prompt's, embeddings, the timings the
metrics observe, and every event the request's caller receives, its terminal event last.

The scheduler decides who runs and how far each sequence has got (EOS and max_tokens included); this module turns
tokens into events and says when a request's text ends it. It calls no other stage: the requests it ends are
returned. Everything here runs on the engine thread.
"""

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from rbee_worker.engine.plan import Computed, Ending, Failed, Generated, Progress, Sequence
from rbee_worker.engine.request_types import (
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

log = logging.getLogger(__name__)

# A request that has ended, and the one terminal event its caller gets.
Ended = tuple[Sequence, End | Error]


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


class OutputProcessor:
    """Turns what the scheduler took of each step (engine/plan.py's Progress) into the requests' events, says which
    requests that ends (stop strings, a grammar's end, and the ends the scheduler found), and builds the one terminal
    event of each: returned, for the engine to free what it holds and deliver it."""

    def __init__(
        self, kv_bytes: Callable[[int], int], pooling: Callable[[], str], observer: EngineObserver | None = None
    ) -> None:
        self._kv_bytes = kv_bytes  # a request's KV cache bytes for the positions it holds (KvGeometry.request_bytes)
        self._pooling = pooling  # the model's pooling (LoadedModel.pooling's mode), read at the first embedding
        self.observer = observer or NoObserver()

    def started(self, sequence: Sequence) -> None:
        send(sequence, Started(sequence.request_id, len(sequence.request.prompt_ids), sequence.seed))

    def process(self, progress: Progress) -> list[Ended]:
        """The events of a step's progress, in order; the requests it ends, each with its terminal event. A failure of
        the host's own code here (a bug, not an inference failure) ends its request with INTERNAL_ERROR and its
        traceback goes to the log."""
        ended: list[Ended] = []
        done: set[Sequence] = set()
        for item in progress:
            sequence = item.sequence
            if sequence in done:
                continue
            try:
                if isinstance(item, Computed):
                    self._computed(item)
                    continue
                if isinstance(item, Failed):
                    ended.append(self.fail(sequence, item.code, item.message))
                    done.add(sequence)
                    continue
                reason = item.reason if isinstance(item, Ending) else self._generated(item)
            except Exception as exc:
                log.exception("internal error while processing the output of request %s", sequence.request_id)
                reason = None
                ended.append(self.fail(sequence, ErrorCode.INTERNAL_ERROR, f"internal error: {exc}"))
                done.add(sequence)
            if reason is not None:
                ended.append(self.end(sequence, reason))
                done.add(sequence)
        return ended

    def _computed(self, computed: Computed) -> None:
        """A prompt chunk's log-probabilities and pooled hidden states."""
        chunk = computed.chunk
        if computed.scored or chunk.ends_prompt:
            self.prompt_scored(chunk.sequence, chunk.start, computed.scored, chunk.ends_prompt)
        if chunk.sequence.request.embed:
            self.pooled(chunk.sequence, chunk.start, chunk.count, computed.pooled, chunk.ends_prompt)

    def _generated(self, generated: Generated) -> StopReason | None:
        """A sequence's new tokens, each in turn (see `token`), up to the first that ends it: a stop string, the
        scheduler's stop (EOS, max_tokens) at its last token, or the grammar's end."""
        sequence, logprobs = generated.sequence, generated.logprobs
        for index, token in enumerate(generated.tokens):
            last = index == len(generated.tokens) - 1
            eos = last and generated.stop is StopReason.EOS
            logprob = logprobs[index] if index < len(logprobs) else None
            if self.token(sequence, token, logprob, eos):
                return StopReason.STOP_SEQUENCE
        if generated.stop is not None:
            return generated.stop
        if generated.grammar is not None and (grammar := sequence.output.grammar) is not None and grammar.terminated:
            return StopReason.EOS  # the grammar has ended, or allows nothing more
        return None

    def prompt_scored(self, sequence: Sequence, start: int, scored: tuple[TokenLogprob, ...], ends: bool) -> None:
        """The log-probabilities of the prompt's tokens after positions start.. (a chunk's; those of a chunk read
        again after a preemption are known already); `ends`: the chunk ends the prompt, whose PromptLogprobs go out
        (for a request that asked)."""
        known = sequence.output.prompt_logprobs
        known.extend(scored[len(known) - start :])
        if ends and sequence.request.prompt_logprobs is not None:
            send(sequence, PromptLogprobs(sequence.request_id, tuple(known)))

    def pooled(self, sequence: Sequence, start: int, count: int, pooled: "np.ndarray | None", ends: bool) -> None:
        """What a chunk of an embedding request's prompt gave (PromptRow.pool: the model's pooling); `ends`: the chunk
        ends the prompt, whose Embedding goes out (the mean over its positions, or the pooled position's vector). A
        chunk from position 0 starts afresh: after a preemption the prompt is computed again from there."""
        output = sequence.output
        mean = self._pooling() == "mean"
        if start == 0:
            output.pooled = None
        if pooled is not None:
            output.pooled = pooled if output.pooled is None or not mean else output.pooled + pooled
        if ends:
            assert output.pooled is not None, "a prompt's last chunk pools"
            values = output.pooled / (start + count) if mean else output.pooled
            send(sequence, Embedding(sequence.request_id, tuple(values.tolist())))

    def token(self, sequence: Sequence, token: int, logprob: TokenLogprob | None, eos: bool = False) -> bool:
        """A generated token of the sequence: its timing is observed; unless it is the EOS that ends the sequence (no
        part of its text), its text goes out. True where a stop string that its text completes ends the sequence."""
        output = sequence.output
        now = time.perf_counter()
        if output.last_token_at is None:
            output.first_token_at = now
            self.observer.first_token(now - output.submitted_at)
        else:
            self.observer.next_token(now - output.last_token_at)
        output.last_token_at = now
        if eos:
            return False
        output.tokens += 1
        text = output.detokenizer.add_token(token)
        self._piece(sequence, text, (token,), () if logprob is None else (logprob,))
        return output.detokenizer.stop_matched is not None

    def end(self, sequence: Sequence, reason: StopReason) -> Ended:
        """The sequence ends for `reason`: the text held back goes out (unless cancelled); its End event."""
        output = sequence.output
        if reason is not StopReason.CANCELLED and (rest := output.detokenizer.finish()):
            self._piece(sequence, rest, (), ())
        now = time.perf_counter()
        first = output.first_token_at or now
        return self._terminal(
            sequence,
            End(
                request_id=sequence.request_id,
                stop_reason=reason,
                prompt_tokens=len(sequence.request.prompt_ids),
                cached_tokens=sequence.cached_prompt_tokens,
                tokens_out=output.tokens,
                seed=sequence.seed,
                stop_sequence=output.detokenizer.stop_matched,
                time_to_first_token_s=first - output.submitted_at,
                decode_time_s=now - first,
                kv_cache_bytes=self._kv_bytes(sequence.cached),
            ),
        )

    def fail(self, sequence: Sequence, code: ErrorCode, message: str) -> Ended:
        return self._terminal(sequence, Error(sequence.request_id, code, message))

    def _terminal(self, sequence: Sequence, terminal: End | Error) -> Ended:
        # Counted before the caller hears of it: a client that reads /metrics right after its response sees its
        # request there.
        self.observer.finished(sequence.request, terminal, time.perf_counter() - sequence.output.submitted_at)
        return sequence, terminal

    def _piece(
        self, sequence: Sequence, text: str, token_ids: tuple[int, ...], logprobs: tuple[TokenLogprob, ...]
    ) -> None:
        send(sequence, Token(sequence.request_id, text, token_ids, sequence.output.pieces, logprobs))
        sequence.output.pieces += 1


def send(sequence: Sequence, event: Event) -> None:
    """Deliver an event; a consumer that is gone (its event loop closed, say) marks the request undeliverable, which
    the scheduler ends as cancelled, instead of taking the engine thread down."""
    try:
        sequence.output.sink(event)
    except Exception:
        log.warning("could not deliver an event of request %s; cancelling it", sequence.request_id)
        sequence.output.undeliverable = True


def log_finished(request: Request, terminal: End | Error) -> None:
    """The one log line per finished request (CONTRACT.md §5)."""
    fields: dict[str, object] = {"job_id": request.request_id, "correlation_id": request.correlation_id}
    if isinstance(terminal, Error):
        fields |= {"prompt_tokens": len(request.prompt_ids), "error": terminal.code.value, "message": terminal.message}
        log.log(
            logging.INFO if terminal.code is ErrorCode.CANCELLED else logging.WARNING,
            "job failed",
            extra={"fields": fields},
        )
        return
    decode_rate = (terminal.tokens_out - 1) / terminal.decode_time_s if terminal.decode_time_s > 0 else 0.0
    fields |= {
        "prompt_tokens": terminal.prompt_tokens,
        "tokens_out": terminal.tokens_out,
        "ttft_ms": round(terminal.time_to_first_token_s * 1000, 1),
        "tokens_per_s": round(max(decode_rate, 0.0), 1),
        "stop_reason": terminal.stop_reason.value,
    }
    log.info("job finished", extra={"fields": fields})
