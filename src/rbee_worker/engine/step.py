"""One round of the step loop carried out: the scheduler's plan through the model runner, the chosen tokens back.

Prompt chunks run a forward each group, and a chunk that completes its prompt samples the request's first token.
Decode steps run one batched forward (one per sequence in deterministic mode) or, on a GPU, as CUDA graphs launched
ahead of the host (see `Steps._decode_ahead`). A runner with `mixed_batches` (llama.cpp's) takes a round's prompt
chunks and decode rows in one forward instead. A failure in a forward ends the requests in it with an error event,
never the engine thread.
"""

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rbee_worker.engine.cuda_graphs import LaunchedStep
from rbee_worker.engine.runner import DecodeRow, ModelRunner, PromptRow, Sampled
from rbee_worker.engine.scheduler import Chunk, Plan, Scheduler, Sequence
from rbee_worker.engine.types import ErrorCode

if TYPE_CHECKING:  # imports llama-cpp-python, an optional dependency
    from rbee_worker.engine.llama_cpp_runner import LlamaCppRunner

log = logging.getLogger(__name__)


@dataclass
class _Launched:
    """A decode step launched on the GPU for these rows, whose tokens the host has not taken yet."""

    sequences: list[Sequence]
    rows: list[DecodeRow]
    step: LaunchedStep


class Steps:
    """Runs the plans of one engine thread; holds the decode step launched and not yet collected."""

    def __init__(self, scheduler: Scheduler, runner: "ModelRunner | LlamaCppRunner", deterministic: bool) -> None:
        self.scheduler, self.runner, self.deterministic = scheduler, runner, deterministic
        self._pending: _Launched | None = None  # a graph decode step whose tokens the host has not taken yet

    def run(self, plan: Plan) -> None:
        """The round's prompt chunks and decode step: in one forward where the runner batches them together (not in
        deterministic mode, where each chunk and each sequence has a forward of its own), else a forward per group of
        chunks, then the decode step."""
        if self.runner.mixed_batches and not self.deterministic:
            self._mixed([chunk for group in plan.prefill for chunk in group], plan.decode)
            return
        for group in plan.prefill:
            self.prefill(group)
        self.decode(plan.decode)

    def _mixed(self, chunks: list[Chunk], decoding: list[Sequence]) -> None:
        """One forward over every prompt chunk and decode row of the round (the scheduler's budget keeps the chunks
        within prefill_chunk tokens, so a long prompt holds the decoding sequences back by one chunk at most)."""
        sequences = [c.sequence for c in chunks] + decoding
        if not sequences:
            return
        with self._failing(sequences):
            sampled = self.runner.step(_prompt_rows(chunks), _decode_rows(decoding))
            for chunk in chunks:
                self.scheduler.prefilled(chunk)
            for sequence in decoding:
                sequence.cached += 1
            self._take([c.sequence for c in chunks if c.completes_prompt] + decoding, sampled)

    def prefill(self, chunks: list[Chunk]) -> None:
        """One forward over prompt chunks; a sequence whose prompt is complete gets its first token."""
        sequences = [c.sequence for c in chunks]
        with self._failing(sequences):
            sampled = self.runner.prefill(_prompt_rows(chunks))
            for chunk in chunks:
                self.scheduler.prefilled(chunk)
            self._take([c.sequence for c in chunks if c.completes_prompt], sampled)

    def decode(self, sequences: list[Sequence]) -> None:
        """One token for each sequence: one batched forward (a forward each in deterministic mode), or on a GPU a step
        launched ahead (see _decode_ahead)."""
        if self.runner.graphs:
            self._decode_ahead(sequences)
        elif self.deterministic:
            for sequence in sequences:
                self._decode_eager([sequence])
        elif sequences:
            self._decode_eager(sequences)

    def _decode_eager(self, sequences: list[Sequence]) -> None:
        with self._failing(sequences):
            sampled = self.runner.decode(_decode_rows(sequences))
            for sequence in sequences:
                sequence.cached += 1
            self._take(sequences, sampled)

    def _decode_ahead(self, sequences: list[Sequence]) -> None:
        """One decode step as a CUDA graph, sampler included, launched before the host takes the previous step's tokens.

        The host launches this step, then reads the previous step's tokens while it runs, and the graph takes each
        continuing row's token from the previous step's choice on the GPU. The host's work per token (reading the
        result, detokenizing, handing out events, filling the next step's inputs) then overlaps the GPU's instead of
        adding to it. A sequence that the previous step ends (EOS, a stop string) has its row of this step computed
        and thrown away; its KV write lands in its freed slot beyond what the next holder has written, and every
        position is written before it is read; its sampling state is written afresh when the slot is taken again."""
        runner, pending, self._pending = self.runner, self._pending, None
        launch = self._launchable(sequences)
        if pending and not (launch and runner.graphs.captured(*self._shape(launch), runner.features(_slots(launch)))):
            self._collect(pending)
            pending = None
            launch = self._launchable(sequences)
        step = None
        if launch:
            with self._failing(launch):
                rows = [DecodeRow(s.slot, s.output_ids[-1], s.cached + s.launched, s.launched > 0) for s in launch]
                for sequence in launch:
                    sequence.launched += 1
                step = _Launched(launch, rows, runner.launch(rows))
        if pending:
            self._collect(pending)
        self._pending = step

    def _launchable(self, sequences: list[Sequence]) -> list[Sequence]:
        return [s for s in sequences if self.scheduler.has_tokens_to_launch(s)]

    @staticmethod
    def _shape(sequences: list[Sequence]) -> tuple[int, int]:
        """(rows, longest attention span) of a graph decode step over `sequences`: rows start at slot 0."""
        return max(s.slot for s in sequences) + 1, max(s.cached + s.launched for s in sequences) + 1

    def _collect(self, launched: _Launched) -> None:
        """Wait for a launched step and take its tokens, for the sequences that still run."""
        for sequence in launched.sequences:
            sequence.launched -= 1
        with self._failing(launched.sequences):
            sampled = self.runner.collect(launched.step, launched.rows)
            pairs = zip(launched.sequences, sampled, strict=True)
            alive = [(s, out) for s, out in pairs if self.scheduler.is_running(s)]
            for sequence, _ in alive:
                sequence.cached += 1
            self._take([s for s, _ in alive], [out for _, out in alive])

    def _take(self, sequences: list[Sequence], sampled: list[Sampled]) -> None:
        for sequence, out in zip(sequences, sampled, strict=True):
            if not self.scheduler.is_running(sequence):
                continue
            if out.valid:
                self.scheduler.accept(sequence, out.token, out.logprob)
            else:
                self.scheduler.fail(
                    sequence, ErrorCode.INFERENCE_FAILED, "inference failed: the model's logits give no valid choice"
                )

    @contextlib.contextmanager
    def _failing(self, sequences: list[Sequence]) -> Iterator[None]:
        """A failure inside ends these requests with an error event, never the engine thread."""
        try:
            yield
        except torch.OutOfMemoryError:
            self._fail_all(sequences, ErrorCode.VRAM_OOM, "out of device memory during generation; retry shorter")
        except Exception as exc:
            log.exception("inference failed for request(s) %s", ", ".join(s.request_id for s in sequences))
            self._fail_all(sequences, ErrorCode.INFERENCE_FAILED, f"inference failed: {exc}")

    def _fail_all(self, sequences: list[Sequence], code: ErrorCode, message: str) -> None:
        for sequence in sequences:
            if self.scheduler.is_running(sequence):
                self.scheduler.fail(sequence, code, message)


def _slots(sequences: list[Sequence]) -> list[int]:
    return [s.slot for s in sequences]


def _prompt_rows(chunks: list[Chunk]) -> list[PromptRow]:
    return [PromptRow(c.sequence.slot, c.token_ids, c.start, c.completes_prompt) for c in chunks]


def _decode_rows(sequences: list[Sequence]) -> list[DecodeRow]:
    """Each sequence's last token fed at its next position (rows of an eager step: nothing chained)."""
    return [DecodeRow(s.slot, s.output_ids[-1], s.cached) for s in sequences]
