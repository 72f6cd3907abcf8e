"""The executor: the scheduler's plan carried out on the runner (engine/runners/protocol.py's protocol). It makes every
call into the runner and gives back what the forwards computed and sampled (engine/plan.py's `Executed`), in order.

A forward with prompt chunks is computed at once (`Runner.step`). A decode-only forward is launched
(`Runner.launch`): a runner with asynchronous steps (CUDA graphs) computes it while the host takes the step before,
and the next step may chain onto it (see `Executor._decode`); any other runner's step is finished when launch returns,
and its tokens are taken at once. A step with rows of several tokens is taken at once too: the next step's positions
depend on how many of its tokens are accepted.

Structured output: a constrained sequence's next token must be drawn under the mask its grammar gives after its
previous token, which the host fills (`Runner.masks`) once it has taken that token. Only the sampler needs the mask,
not the forward: a step whose constrained rows chain onto an uncollected step is launched with its sampling held
(`Runner.launch(hold_sampling=True)`), the host takes the previous step's tokens through their grammars and fills the
masks while the device runs the forward, and then the sampler starts (`Runner.sample_held`), as SGLang's overlap
scheduler does it. The rest of the host's work on those tokens (the scheduler's, the output processor's) runs after
`execute` returns, while the device samples and goes on.

Faults: a runner call that raises fails the requests in it (`Failed`). When the runner says the failure leaves the
device unusable (`Runner.fault`), `DeviceFault` propagates and the engine stops. A failure of the host's own code
while carrying out a plan fails the plan's requests with INTERNAL_ERROR and its traceback goes to the log.
"""

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from rbee_worker.engine.plan import Chunk, Computed, Decode, Drawn, Executed, Failed, Forward, Lost, Plan, Sequence
from rbee_worker.engine.request_types import ErrorCode
from rbee_worker.engine.runners.protocol import DecodeRow, DeviceFault, Launched, PromptRow, Runner, Sampled
from rbee_worker.engine.structured.grammar import GrammarRejected, accept_tokens

log = logging.getLogger(__name__)


@dataclass
class _Launched:
    """A decode step launched for these rows, whose tokens the host has not taken yet."""

    decodes: list[Decode]
    step: Launched


class Executor:
    """Carries out the plans of one engine thread; holds the decode step launched and not yet collected."""

    def __init__(self, runner: Runner, eos_ids: frozenset[int], pooling: Callable[[], str]) -> None:
        self.runner = runner
        self._eos = eos_ids
        self._pooling = pooling  # the model's pooling, for an embedding request's chunks (PromptRow.pool)
        self._pending: _Launched | None = None
        self._out: Executed = []
        self._taken: dict[Sequence, int] = {}  # the last token taken this round of each sequence whose row chains

    def execute(self, plan: Plan) -> Executed:
        """The plan's runner calls, in its order; what they computed and sampled, in order."""
        try:
            if self._pending and any(d.sequence in plan.preempted for d in self._pending.decodes):
                self._settle()  # a preempted sequence has no token in flight when its blocks go to another
            lost = set()
            for sequence, hit in plan.restores:  # before the evictions: a prefix may come from a preempted row
                assert sequence.row is not None
                if not self.runner.restore(sequence.row, hit):
                    lost.add(sequence)
                    self._out.append(Lost(sequence))
            for sequence in plan.preempted:
                assert sequence.row is not None
                self.runner.evict(sequence.row)
            for sequence in plan.started:
                request = sequence.request
                assert sequence.row is not None
                self.runner.assign(sequence.row, request.sampling, sequence.seed, request.prompt_ids, request.logprobs)
            # Their first tokens are constrained too (compiling a grammar proved that it allows one).
            if constrained := [(s.row, s.output.grammar) for s in plan.started if s.output.grammar is not None]:
                self.runner.masks(constrained)  # type: ignore[arg-type] -- started sequences hold rows
            before = self._pending
            for forward in plan.forwards:
                if lost:  # their chunks do not run: they read their prompts from the start
                    forward = Forward([c for c in forward.chunks if c.sequence not in lost], forward.decode)
                if forward.chunks:
                    self._step(forward)
                elif forward.decode:
                    self._decode(forward.decode)
            if self._pending is not None and self._pending is before:  # no step launched after it: nothing to overlap
                self._settle()
        except DeviceFault:
            raise
        except Exception as exc:
            if reason := self.runner.fault(exc):
                raise DeviceFault(reason) from exc
            log.exception("internal error while carrying out an engine round")
            for forward in plan.forwards:
                for sequence in [c.sequence for c in forward.chunks] + [d.sequence for d in forward.decode]:
                    self._out.append(Failed(sequence, ErrorCode.INTERNAL_ERROR, f"internal error: {exc}"))
        return self._results()

    def release(self, row: int) -> None:
        """The request in this batch row has ended: whatever the runtime keeps for it beyond its blocks goes, or into
        the runtime's own prompt cache."""
        self.runner.release(row)

    def drain(self) -> Executed:
        """The tokens of a step still in flight (before the engine stops)."""
        self._settle()
        return self._results()

    def _results(self) -> Executed:
        """What this round computed, handed over; the next round starts afresh."""
        out, self._out = self._out, []
        self._taken.clear()
        return out

    def _settle(self) -> None:
        """Take the tokens of the step in flight, if any."""
        if self._pending:
            pending, self._pending = self._pending, None
            self._collect(pending)

    def _step(self, forward: Forward) -> None:
        """One forward computed at once: prompt chunks (and, for a runner with mixed batches, the decode rows); a
        chunk that completes its prompt samples the sequence's first token."""
        if forward.decode and self._pending:
            self._settle()
        sequences = [c.sequence for c in forward.chunks] + [d.sequence for d in forward.decode]
        stepped = None
        with self._failing(sequences):
            pooling = self._pooling() if any(c.sequence.request.embed for c in forward.chunks) else None
            prompts = _prompt_rows(forward.chunks, pooling)
            stepped = self.runner.step(prompts, [self._decode_row(d, chain=False) for d in forward.decode])
        if stepped is None:
            return
        pooled = stepped.pooled or [None] * len(forward.chunks)
        for chunk, scored, vector in zip(forward.chunks, stepped.scored, pooled, strict=True):
            self._out.append(Computed(chunk, scored, vector))
        samplers: list[tuple[Sequence, Decode | None]] = [(c.sequence, None) for c in forward.chunks if c.samples]
        samplers += [(d.sequence, d) for d in forward.decode]
        self._take(samplers, stepped.sampled)

    def _decode(self, decodes: list[Decode]) -> None:
        """One decode step, launched before the host takes the previous step's tokens where the runner allows it.

        The host launches this step, then takes the previous step's tokens while the device runs it: each `chained`
        row's token is the one the previous step chose, on the device. The host's work per token (reading the
        result, the grammars, then the scheduler's and the output processor's) then overlaps the device's instead of
        adding to it. A sequence that the previous step ends (EOS, a stop string) has its row of this step computed
        and thrown away: its KV write lands past its last token, in a block of its own that no prefix cache entry
        holds (a sequence never writes a shared block), and every position is written before it is read; its
        sampling state is written afresh when its row is taken again. Where the runner cannot chain this step, the
        previous one is collected first and the rows feed its tokens from the host. A constrained row that chains
        holds the step's sampling until the previous step's constrained tokens are taken and their masks filled (see
        the module docstring)."""
        pending, self._pending = self._pending, None
        rows = [self._decode_row(d, chain=pending is not None) for d in decodes]
        if pending and not (rows and self.runner.chains(rows)):
            self._collect(pending)
            pending = None
            rows = [self._decode_row(d, chain=False) for d in decodes]
        hold = pending is not None and any(d.sequence.output.grammar is not None and d.chained for d in decodes)
        launched = None
        if decodes:
            with self._failing([d.sequence for d in decodes]):
                launched = _Launched(decodes, self.runner.launch(rows, hold_sampling=hold))
        if pending:
            self._collect(pending, launched if hold else None)
        if launched and (launched.step.ready or any(d.draft for d in decodes)):
            self._collect(launched)
        else:
            self._pending = launched

    def _decode_row(self, decode: Decode, chain: bool) -> DecodeRow:
        """The row a decode feeds: its last token, then its draft. A `chained` decode's last token is the one its
        step in flight chooses: read on the device where `chain` (that step is still in flight), else the one taken
        from it this round (none where that step failed: the row is computed and thrown away)."""
        sequence = decode.sequence
        assert sequence.row is not None
        chained = decode.chained and chain
        if not decode.chained:
            last = sequence.output_ids[-1]
        elif chained:
            last = 0  # read on the device
        else:
            last = self._taken.get(sequence, 0)
        return DecodeRow(
            sequence.row,
            sequence.table.blocks,
            (last, *decode.draft),
            decode.position,
            chained,
            sequence.window_table.blocks,
        )

    def _collect(self, launched: _Launched, held: _Launched | None = None) -> None:
        """Take a launched step's tokens; `held`: the step launched after it with its sampling held, which starts
        once the masks are filled (see `_take`)."""
        sampled = None
        with self._failing([d.sequence for d in launched.decodes]):
            sampled = self.runner.collect(launched.step)
        if sampled is None:
            self._sample(held)
            return
        self._take([(d.sequence, d) for d in launched.decodes], sampled, held)

    def _take(
        self, rows: list[tuple[Sequence, Decode | None]], sampled: list[Sampled], held: _Launched | None = None
    ) -> None:
        """The rows' tokens, for the sequences still running: constrained ones through their grammars first, and
        their next masks filled, the rows together (grammar's accept_tokens and fill_masks take many rows on several
        threads); then a `held` step's sampler starts."""
        taken = [(s, d, out) for (s, d), out in zip(rows, sampled, strict=True) if not s.finished]
        verdicts = self._advance([(s, out) for s, _, out in taken])
        if constrained := [(s.row, s.output.grammar) for s, _, _ in taken if verdicts.get(s) is True]:
            try:
                self.runner.masks(constrained)  # type: ignore[arg-type] -- running sequences hold rows
            except Exception as exc:
                log.exception("internal error while filling grammar masks")
                for sequence, _, _ in taken:
                    if verdicts.get(sequence) is True:
                        verdicts[sequence] = exc
        self._sample(held)
        for sequence, decode, out in taken:
            self._out.append(Drawn(sequence, out, decode, verdicts.get(sequence)))
            if out.tokens:
                self._taken[sequence] = out.tokens[-1]

    def _advance(self, taken: list[tuple[Sequence, Sampled]]) -> dict[Sequence, bool | Exception]:
        """Constrained sequences' valid tokens through their grammars, position by position across the rows (many
        rows at once on several threads): each sequence's verdict (Drawn.grammar)."""
        verdicts: dict[Sequence, bool | Exception] = {}
        going = [(s, out.tokens) for s, out in taken if out.valid and s.output.grammar is not None]
        for position in range(max((len(tokens) for _, tokens in going), default=0)):
            now = [(s, tokens[position]) for s, tokens in going if position < len(tokens) and s not in verdicts]
            for sequence, token in now:
                if token in self._eos:  # EOS: never ignored here, it ends a constrained request
                    verdicts[sequence] = False
            now = [(s, token) for s, token in now if s not in verdicts]
            matchers = [s.output.grammar for s, _ in now]
            results = accept_tokens(matchers, [token for _, token in now])  # type: ignore[arg-type]
            for (sequence, token), result in zip(now, results, strict=True):
                if result is False:
                    verdicts[sequence] = GrammarRejected(
                        f"the request's grammar does not allow the token chosen ({token})"
                    )
                elif isinstance(result, Exception):
                    verdicts[sequence] = result
        return {s: verdicts.get(s, True) for s, _ in going}

    def _sample(self, held: _Launched | None) -> None:
        """Start the sampler of a step launched with its sampling held."""
        if held is not None:
            with self._failing([d.sequence for d in held.decodes]):
                self.runner.sample_held(held.step)

    @contextlib.contextmanager
    def _failing(self, sequences: list[Sequence]) -> Iterator[None]:
        """A failure of the runner inside fails these requests; one that leaves the device unusable raises
        DeviceFault (the engine then fails every request and stops)."""
        try:
            yield
        except torch.OutOfMemoryError:
            message = "out of device memory during generation; retry shorter"
            self._out += [Failed(s, ErrorCode.VRAM_OOM, message) for s in sequences]
        except Exception as exc:
            if reason := self.runner.fault(exc):
                raise DeviceFault(reason) from exc
            log.exception("inference failed for request(s) %s", ", ".join(s.request_id for s in sequences))
            self._out += [Failed(s, ErrorCode.INFERENCE_FAILED, f"inference failed: {exc}") for s in sequences]


def _prompt_rows(chunks: list[Chunk], pooling: str | None) -> list[PromptRow]:
    rows = []
    for chunk in chunks:
        sequence = chunk.sequence
        assert sequence.row is not None
        blocks, window = sequence.table.blocks, sequence.window_table.blocks
        top = sequence.request.prompt_logprobs or 0
        pool = pooling if sequence.request.embed else None
        rows.append(
            PromptRow(
                sequence.row, blocks, chunk.token_ids, chunk.start, chunk.samples, window, chunk.targets, top, pool
            )
        )
    return rows
