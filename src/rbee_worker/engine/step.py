"""One round of the step loop carried out: the scheduler's forwards through the runner (engine/runner.py's protocol),
the chosen tokens through the output processor, each sequence's progress back to the scheduler.

A forward with prompt chunks is computed at once (`Runner.step`). A decode-only forward is launched
(`Runner.launch`): a runner with asynchronous steps (CUDA graphs) computes it while the host takes the step before,
and the next step may chain onto it (see `Steps._decode`); any other runner's step is finished when launch returns,
and its tokens are taken at once.

Structured output: a constrained sequence's next token must be drawn under the mask its grammar gives after its
previous token, which the host fills (`Runner.masks`) once it has taken that token. Only the sampler needs the mask,
not the forward: a step whose constrained rows chain onto an uncollected step is launched with its sampling held
(`Runner.launch(hold_sampling=True)`), the host takes the previous step's tokens and fills the masks while the device
runs the forward, and then the sampler starts (`Runner.sample_held`), as SGLang's overlap scheduler does it. Taking
a step's tokens begins with the constrained rows (their grammars, then their masks together), so the sampler waits
only for that; the rest of the host's work on the tokens runs beside it. The grammar ends the sequence (EOS) when it
has ended or allows nothing more.

Faults: a forward that raises ends the requests in it with an error event. When the runner says the failure leaves
the device unusable (`Runner.fault`), `DeviceFault` propagates and the engine stops. A failure in output processing
(a bug on the host, not an inference failure) ends its request with INTERNAL_ERROR and its traceback in the log.
"""

import contextlib
import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from rbee_worker.engine.output import OutputProcessor
from rbee_worker.engine.runner import DecodeRow, DeviceFault, Launched, PromptRow, Runner, Sampled
from rbee_worker.engine.scheduler import Chunk, Forward, Plan, Scheduler, Sequence
from rbee_worker.engine.types import ErrorCode, StopReason

log = logging.getLogger(__name__)


@dataclass
class _Launched:
    """A decode step launched for these sequences, whose tokens the host has not taken yet."""

    sequences: list[Sequence]
    step: Launched


class Steps:
    """Runs the plans of one engine thread; holds the decode step launched and not yet collected."""

    def __init__(self, scheduler: Scheduler, runner: Runner, output: OutputProcessor) -> None:
        self.scheduler, self.runner, self.output = scheduler, runner, output
        self._pending: _Launched | None = None

    @functools.cached_property
    def pooling(self) -> str:
        """What an embedding request's chunks give (PromptRow.pool): the model's pooling, read at the first one."""
        return self.runner.loaded.pooling.mode

    def run(self, plan: Plan) -> None:
        for forward in plan.forwards:
            if forward.chunks:
                self._step(forward)
            else:
                self._decode(forward.decode)

    def _step(self, forward: Forward) -> None:
        """One forward computed at once: prompt chunks (and, for a runner with mixed batches, the decode rows); a
        chunk that completes its prompt samples the sequence's first token."""
        if forward.decode and self._pending:
            self._collect(self._pending)
            self._pending = None
        sequences = [c.sequence for c in forward.chunks] + forward.decode
        stepped = None
        with self._failing(sequences):
            pooling = self.pooling if any(c.sequence.request.embed for c in forward.chunks) else None
            stepped = self.runner.step(_prompt_rows(forward.chunks, pooling), _decode_rows(forward.decode))
        if stepped is None:
            return
        for chunk, scored in zip(forward.chunks, stepped.scored, strict=True):
            if scored or chunk.ends_prompt:
                self.output.prompt_scored(chunk.sequence, chunk.start, scored, chunk.ends_prompt)
        for chunk, pooled in zip(forward.chunks, stepped.pooled, strict=False):
            if pooling is not None and chunk.sequence.request.embed:
                self.output.pooled(chunk.sequence, pooling, chunk.start, chunk.count, pooled, chunk.ends_prompt)
        self.scheduler.computed(forward.chunks, forward.decode)
        self._take([c.sequence for c in forward.chunks if c.samples] + forward.decode, stepped.sampled)
        for chunk in forward.chunks:  # a request for its prompt only (max_tokens 0) ends with it
            if chunk.ends_prompt and not chunk.samples and not chunk.sequence.finished:
                self.output.end(chunk.sequence, StopReason.MAX_TOKENS)

    def _decode(self, sequences: list[Sequence]) -> None:
        """One decode step, launched before the host takes the previous step's tokens where the runner allows it.

        The host launches this step, then takes the previous step's tokens while the device runs it: each continuing
        row is `chained`, its token the one the previous step chose, on the device. The host's work per token
        (reading the result, detokenizing, handing out events, filling the next step's inputs) then overlaps the
        device's instead of adding to it. A sequence that the previous step ends (EOS, a stop string) has its row of
        this step computed and thrown away: its KV write lands past its last token, in a block of its own that no
        prefix cache entry holds (a sequence never writes a shared block), and every position is written before it is
        read; its sampling state is written afresh when its row is taken again. Where the runner cannot chain this
        step, the previous one is collected first. A constrained row that chains holds the step's sampling until
        the previous step's constrained tokens are taken and their masks filled (see the module docstring)."""
        pending, self._pending = self._pending, None
        live = [s for s in sequences if self.scheduler.wants_token(s)]
        rows = _decode_rows(live)
        if pending and not (rows and self.runner.chains(rows)):
            self._collect(pending)
            pending = None
            live = [s for s in sequences if self.scheduler.wants_token(s)]
            rows = _decode_rows(live)
        hold = any(s.output.grammar is not None and s.launched for s in live)
        launched = None
        if live:
            with self._failing(live):
                launched = _Launched(live, self.runner.launch(rows, hold_sampling=hold))
                for sequence in live:
                    sequence.launched += 1
        if pending:
            self._collect(pending, launched if hold else None)
        if launched and launched.step.ready:
            self._collect(launched)
        else:
            self._pending = launched

    def _collect(self, launched: _Launched, held: _Launched | None = None) -> None:
        """Take a launched step's tokens, for the sequences that still run; `held`: the step launched after it with
        its sampling held, which starts once the masks are filled (see `_take`)."""
        for sequence in launched.sequences:
            sequence.launched -= 1
        sampled = None
        with self._failing(launched.sequences):
            sampled = self.runner.collect(launched.step)
        if sampled is None:
            self._sample(held)
            return
        alive = [(s, out) for s, out in zip(launched.sequences, sampled, strict=True) if not s.finished]
        self.scheduler.computed([], [s for s, _ in alive])
        self._take([s for s, _ in alive], [out for _, out in alive], held)

    def collect_pending(self) -> None:
        """Take the tokens of a step still in flight (before the engine stops)."""
        if self._pending:
            pending, self._pending = self._pending, None
            self._collect(pending)

    def _take(self, sequences: list[Sequence], sampled: list[Sampled], held: _Launched | None = None) -> None:
        """Each sequence's sampled token through the output processor; the sequences that it ends, ended.

        Constrained sequences go first through their grammars, and their next masks are filled, the rows together
        (grammar's accept_tokens and fill_masks take many rows on several threads); then a `held` step's sampler
        starts, so that the rest of the host's work on these tokens (detokenizing, events, stop strings) runs while
        the device samples and goes on."""
        taken = [(s, out) for s, out in zip(sequences, sampled, strict=True) if not s.finished]
        grammars = [(s, g, out.token) for s, out in taken if out.valid and (g := s.output.grammar) is not None]
        outcomes = self.output.advance((grammar, token) for _, grammar, token in grammars)
        constrained = []
        for (sequence, grammar, _), advanced in zip(grammars, outcomes, strict=True):
            if isinstance(advanced, Exception):
                self._internal_error(sequence, advanced)
            elif advanced:
                constrained.append((sequence, grammar))
        if constrained:
            try:
                self.runner.masks([(sequence.row, grammar) for sequence, grammar in constrained])
            except Exception as exc:
                for sequence, _ in constrained:
                    self._internal_error(sequence, exc)
        self._sample(held)
        for sequence, out in taken:
            if sequence.finished:
                continue
            if not out.valid:
                message = "inference failed: the model's logits give no valid choice"
                self.output.fail(sequence, ErrorCode.INFERENCE_FAILED, message)
                continue
            try:
                reason = self.output.token(sequence, out.token, out.logprob)
                if reason is not StopReason.EOS and self.scheduler.append(sequence, out.token):
                    reason = reason or StopReason.MAX_TOKENS
                if reason is None and (grammar := sequence.output.grammar) is not None and grammar.terminated:
                    reason = StopReason.EOS  # the grammar has ended, or allows nothing more
                if reason is not None:
                    self.output.end(sequence, reason)
            except Exception as exc:
                self._internal_error(sequence, exc)

    def _sample(self, held: _Launched | None) -> None:
        """Start the sampler of a step launched with its sampling held."""
        if held is not None:
            with self._failing(held.sequences):
                self.runner.sample_held(held.step)

    def _internal_error(self, sequence: Sequence, exc: Exception) -> None:
        """A failure of the host's output processing (a bug, not an inference failure): the request ends with
        INTERNAL_ERROR and the traceback goes to the log."""
        log.exception("internal error while processing the output of request %s", sequence.request_id, exc_info=exc)
        if not sequence.finished:
            self.output.fail(sequence, ErrorCode.INTERNAL_ERROR, f"internal error: {exc}")

    @contextlib.contextmanager
    def _failing(self, sequences: list[Sequence]) -> Iterator[None]:
        """A failure of the runner inside ends these requests with an error event; one that leaves the device
        unusable raises DeviceFault (the engine then fails every request and stops)."""
        try:
            yield
        except torch.OutOfMemoryError:
            self._fail(sequences, ErrorCode.VRAM_OOM, "out of device memory during generation; retry shorter")
        except Exception as exc:
            if reason := self.runner.fault(exc):
                raise DeviceFault(reason) from exc
            log.exception("inference failed for request(s) %s", ", ".join(s.request_id for s in sequences))
            self._fail(sequences, ErrorCode.INFERENCE_FAILED, f"inference failed: {exc}")

    def _fail(self, sequences: list[Sequence], code: ErrorCode, message: str) -> None:
        for sequence in sequences:
            if not sequence.finished:
                self.output.fail(sequence, code, message)


def _prompt_rows(chunks: list[Chunk], pooling: str | None) -> list[PromptRow]:
    rows = []
    for chunk in chunks:
        sequence = chunk.sequence
        blocks, window = sequence.table.blocks, sequence.window_table.blocks
        top = sequence.request.prompt_logprobs or 0
        pool = pooling if sequence.request.embed else None
        rows.append(
            PromptRow(
                sequence.row, blocks, chunk.token_ids, chunk.start, chunk.samples, window, chunk.targets, top, pool
            )
        )
    return rows


def _decode_rows(sequences: list[Sequence]) -> list[DecodeRow]:
    """Each sequence's last token fed at its next position; a row whose previous token is still on its way (a step
    launched and not collected) chains onto it, at the position after it."""
    return [
        DecodeRow(s.row, s.table.blocks, s.output_ids[-1], s.cached + s.launched, s.launched > 0, s.window_table.blocks)
        for s in sequences
    ]
