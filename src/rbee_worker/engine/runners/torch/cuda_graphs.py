"""Forwards replayed as CUDA graphs: one launch for the whole forward instead of a thousand kernel launches driven
from Python, which is what bounds a decode step of a model that fits a GPU, and even a long prompt's forward of a
large model, whose kernels finish sooner than Python can launch them (bench/results/README.md).

A graph has fixed shapes, so inputs are padded up to buckets. Decode steps: the live requests' rows, compacted in the
step's order, padded to the next of ROW_BUCKETS (padding rows have length 0: they write the scratch block and read
nothing). Attention reads the paged cache through the block tables, with lengths read on the device, so one graph
per row bucket (and sampler kind) serves every context length. First prompt chunks of one request (from position 0):
the chunk length to the next power of two, padded on the right. Graphs are captured on first use, or ahead of time by
`warm_up`; all share one memory pool. The inputs live in static tensors that each call overwrites.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from rbee_worker.engine.runners.protocol import DecodeRow
from rbee_worker.engine.runners.torch.kv_cache import PagedCache, prefill_mask
from rbee_worker.engine.sampling.sampler import PACKED_WIDTH, pack, sample
from rbee_worker.engine.sampling.sampler_state import MAX_TOP_LOGPROBS, SamplerFeatures, SamplerState

ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
MIN_CHUNK = 16  # the shortest prompt-chunk bucket
# The rows of a decode graph's input tensor: each step's rows' token, position, length (0: padding), chained flag,
# batch row, and the block table entries of its position (its index, its block, its block in the sliding layers' pool
# of windows: kv_cache.PagedCache), copied to the device at once.
TOKEN, POSITION, LENGTH, CHAINED, ROW, TABLE_INDEX, BLOCK, WINDOW_BLOCK = range(8)


def bucket(value: int, buckets: list[int]) -> int:
    return next(b for b in buckets if b >= value)


def graph_features(features: SamplerFeatures) -> SamplerFeatures:
    """The sampler stages of the graph that runs a decode step needing `features`. A step of greedy rows without
    penalties runs the greedy graph; any other runs top-k, top-p and the penalties whatever its rows ask (each a
    no-op for a row without it: top_k = the vocabulary, penalties 1 and 0; a greedy row takes the argmax after its
    penalties), and a step with logprobs computes MAX_TOP_LOGPROBS alternatives (a row reads the ones it asked for).
    So the GRAPH_KINDS per row bucket, captured before ready, serve every mix of settings, instead of a graph
    per combination captured when a request first brings it, which stalls every running stream for the capture.
    A step with a grammar's mask (structured output) runs either graph with the mask stage: greedy steps of JSON
    output keep the argmax, not the sampled path over every row."""
    logprobs = -1 if features.top_logprobs < 0 else MAX_TOP_LOGPROBS
    if not (features.sampling or features.penalties):
        return SamplerFeatures(masks=features.masks, top_logprobs=logprobs)
    return SamplerFeatures(top_k=True, penalties=True, masks=features.masks, top_logprobs=logprobs)


# Every graph_features value a request can bring: greedy and sampled, each with and without a mask stage and with and
# without logprobs.
GRAPH_KINDS = [
    SamplerFeatures(top_k=top_k, penalties=top_k, masks=masks, top_logprobs=logprobs)
    for top_k in (False, True)
    for masks in (False, True)
    for logprobs in (-1, MAX_TOP_LOGPROBS)
]


class LaunchedStep:
    """A decode step on its way through the GPU: `result` waits for it. A step launched with its sampler held has
    `sample` start the sampler (after the host has set the rows' masks)."""

    def __init__(self, packed: torch.Tensor, done: torch.cuda.Event, held: Callable[[], None] | None = None) -> None:
        self._packed, self._done, self._held = packed, done, held

    def __len__(self) -> int:
        return self._packed.shape[0]

    def sample(self) -> None:
        assert self._held is not None, "the step's sampler was not held"
        held, self._held = self._held, None
        held()

    def result(self) -> list[list[float]]:
        """Each row's sampled outcome (sampler.pack's layout), copied to the host once the step has run."""
        assert self._held is None, "the step's sampler is held: sample() first"
        self._done.synchronize()
        return self._packed.tolist()


@dataclass(frozen=True)
class StepGraphs:
    """A decode step's graphs: the forward with the sampler after it, or (steps with the mask stage) the forward
    alone and the sampler as a graph of its own, so that the host can set masks while the forward runs. `packed`:
    the sampler's output (sampler.pack's layout), which each replay overwrites."""

    forward: torch.cuda.CUDAGraph
    sampler: torch.cuda.CUDAGraph | None
    packed: torch.Tensor


class DecodeGraphs:
    """Decode steps, each with the sampler after the forward, as graphs per (rows bucket, graph_features of the step's
    sampler features): StepGraphs."""

    def __init__(
        self,
        model: torch.nn.Module,
        cache: PagedCache,
        cache_kwarg: str,
        dtype: torch.dtype,
        state: SamplerState,
        max_rows: int,
    ) -> None:
        self.model, self.cache, self.cache_kwarg, self.dtype, self.state = model, cache, cache_kwarg, dtype, state
        device = cache.device
        self.max_rows = max_rows
        self.row_buckets = sorted({b for b in ROW_BUCKETS if b < max_rows} | {max_rows})
        # The graphs' inputs, written by one copy from pinned host memory (several pageable copies would cost more than
        # the rest of the host's work on a step). Two host buffers, used in turn: the copy out of one may still be
        # queued behind a step that runs while the host fills the other.
        self.inputs = torch.zeros(len(_PADDING), max_rows, dtype=torch.long, device=device)
        self.host_inputs = [torch.zeros(len(_PADDING), max_rows, dtype=torch.long, pin_memory=True) for _ in range(2)]
        self.host_out = [torch.zeros(max_rows, PACKED_WIDTH, dtype=torch.float32, pin_memory=True) for _ in range(2)]
        self.done = [torch.cuda.Event() for _ in range(2)]
        self.launches = 0
        # Each batch row's token chosen by the latest step (entry max_rows: padding's), written by the graph itself: a
        # chained row reads its input token here, so the step after can be launched before the host has seen this
        # one's result, whatever rows that step holds.
        self.chosen = torch.zeros(max_rows + 1, dtype=torch.long, device=device)
        # Attention of a paged decode step reads no mask; the model classes want one: a constant of the right rank.
        self.mask = torch.zeros(max_rows, 1, 1, 1, dtype=dtype, device=device)
        self.graphs: dict[tuple[int, SamplerFeatures], StepGraphs] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def warm_up(self) -> None:
        """Capture the graph of every row bucket and kind (GRAPH_KINDS), so that no request pays for a capture."""
        for rows in self.row_buckets:
            for kind in GRAPH_KINDS:
                self._graph(rows, kind)

    def captured(self, count: int, features: SamplerFeatures) -> bool:
        return (bucket(count, self.row_buckets), graph_features(features)) in self.graphs

    def launch(self, rows: Sequence[DecodeRow], features: SamplerFeatures, hold: bool = False) -> LaunchedStep:
        """Start one decode step over these rows (graph row i: rows[i]) without waiting for it. A chained row takes as
        its token the one the previous step chose for its batch row, not its `token`. The sampler runs on the device
        after the forward, so a step's result is each row's chosen token (and the logprobs asked for), one small copy
        to the host; padding rows leave the sampler's state untouched. With `hold` (a step with the mask stage), the
        sampler starts at the returned step's `sample()`: masks set in between (SamplerState.set_mask, queued on the
        same stream) are the ones it applies.

        A step whose graph is not captured yet is captured first, which runs the forward once and so overwrites the
        chosen tokens: chain only onto a step of a captured graph."""
        count = len(rows)
        width = bucket(count, self.row_buckets)
        graphs = self._graph(width, graph_features(features))
        assert not hold or graphs.sampler is not None, "only a step with the mask stage holds its sampler"
        turn = self.launches % 2
        self.launches += 1
        size = self.cache.block_size
        # This buffer's copy ran before the step before the previous one, which the host has waited for.
        host = self.host_inputs[turn].numpy()
        host[:, count:width] = _PADDING[:, None]
        host[ROW, count:width] = self.max_rows
        for i, r in enumerate(rows):
            index = r.position // size
            window = r.window_blocks[index] if r.window_blocks else 0
            host[:, i] = (r.tokens[0], r.position, r.position + 1, r.chained, r.row, index, r.blocks[index], window)
        # The graph sets the new table entries itself: their blocks are zeroed here first (PagedCache.ensure_zeroed).
        self.cache.ensure_zeroed(int(host[BLOCK, :count].max()), int(host[WINDOW_BLOCK, :count].max()))
        self.inputs[:, :width].copy_(self.host_inputs[turn][:, :width], non_blocking=True)
        graphs.forward.replay()

        def sample() -> None:
            if graphs.sampler is not None:
                graphs.sampler.replay()
            self.host_out[turn][:count].copy_(graphs.packed[:count], non_blocking=True)
            self.done[turn].record()

        if hold:
            return LaunchedStep(self.host_out[turn][:count], self.done[turn], sample)
        sample()
        return LaunchedStep(self.host_out[turn][:count], self.done[turn])

    def _graph(self, rows: int, features: SamplerFeatures) -> StepGraphs:
        key = (rows, features)
        if key in self.graphs:
            return self.graphs[key]
        inputs = self.inputs[:, :rows]
        inputs.copy_(torch.as_tensor(_PADDING, device=inputs.device)[:, None].expand(-1, rows))
        inputs[ROW].fill_(self.max_rows)  # while capturing every row is padding
        cache = self.cache

        def forward() -> torch.Tensor:
            batch_rows, positions, lengths = inputs[ROW], inputs[POSITION, :, None], inputs[LENGTH]
            cache.set_entries(batch_rows, inputs[TABLE_INDEX], inputs[BLOCK], inputs[WINDOW_BLOCK])
            tokens = torch.where(inputs[CHAINED] != 0, self.chosen[batch_rows], inputs[TOKEN])
            cache.prepare(batch_rows, positions, 0, "paged")
            output = self.model(
                input_ids=tokens[:, None],
                position_ids=positions.clamp(min=0),
                attention_mask=self.mask[:rows],
                use_cache=True,
                logits_to_keep=1,
                kv_lengths=lengths.to(torch.int32),
                **cache.paged_tables(batch_rows),
                **{self.cache_kwarg: cache},
            )
            return output.logits[:, -1]

        def sampler(logits: torch.Tensor) -> torch.Tensor:
            batch_rows, lengths = inputs[ROW], inputs[LENGTH]
            # Padding rows read the sampler state of the last batch row and change nothing (they are not live).
            sampler_rows = batch_rows.clamp(max=self.max_rows - 1)
            out = sample(logits, self.state, sampler_rows, lengths > 0, features)
            self.chosen[batch_rows] = out.tokens
            return pack(out)

        if features.masks:
            forward_graph, logits = capture(forward, self.pool)
            sampler_graph, packed = capture(lambda: sampler(logits), self.pool)
            self.graphs[key] = StepGraphs(forward_graph, sampler_graph, packed)
        else:
            graph, packed = capture(lambda: sampler(forward()), self.pool)
            self.graphs[key] = StepGraphs(graph, None, packed)
        return self.graphs[key]


# A padding row of a decode graph's inputs: token 0 at position -1 (the scratch block), length 0, not chained; its
# batch row is the scratch row (the caller's max_rows), its table entry the scratch row's first.
_PADDING = torch.tensor([0, -1, 0, 0, 0, 0, 0, 0]).numpy()


class PrefillGraphs:
    """The first chunk of one request's prompt (positions 0..count-1) as a graph per chunk bucket.

    The chunk is padded on the right: its tokens keep their positions, so the causal mask over the bucket is exact for
    them (the engine's attention then takes SDPA's causal flash kernel over the chunk's own keys and values), and the
    padding after them writes the scratch block and is never read. The logits are those of the last real token
    (`logits_to_keep` as an index).
    """

    def __init__(
        self, model: torch.nn.Module, cache: PagedCache, cache_kwarg: str, dtype: torch.dtype, max_chunk: int,
        pool: object,
    ) -> None:  # fmt: skip
        self.model, self.cache, self.cache_kwarg, self.dtype, self.pool = model, cache, cache_kwarg, dtype, pool
        device = cache.device
        # Powers of two that neither a prompt chunk nor one request's context can outgrow; longer chunks run eagerly.
        limit = min(max_chunk, cache.max_blocks * cache.block_size)
        self.buckets = [2**i for i in range(MIN_CHUNK.bit_length() - 1, limit.bit_length()) if 2**i <= limit]
        widest = max(self.buckets, default=0)
        self.tokens = torch.zeros(1, widest, dtype=torch.long, device=device)
        self.positions = torch.full((1, widest), -1, dtype=torch.long, device=device)
        self.row = torch.zeros(1, dtype=torch.long, device=device)  # the request's batch row
        self.last = torch.zeros(1, dtype=torch.long, device=device)  # the column of the last real token
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def fits(self, count: int) -> bool:
        return bool(self.buckets) and count <= self.buckets[-1]

    def warm_up(self) -> None:
        for width in self.buckets:
            self._graph(width)

    def run(self, row: int, token_ids: Sequence[int]) -> torch.Tensor:
        """Logits (1, vocab) after token_ids, the first len(token_ids) tokens of the prompt of batch row `row`, whose
        block table is set (as the eager forward)."""
        count = len(token_ids)
        width = bucket(count, self.buckets)
        graph, logits = self._graph(width)
        self.tokens[0, :width].copy_(torch.tensor([*token_ids, *[0] * (width - count)]))
        self.positions[0, :width].copy_(torch.tensor([*range(count), *[-1] * (width - count)]))
        self.row.fill_(row)
        self.last.fill_(count - 1)
        graph.replay()
        return logits

    def _graph(self, width: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        if width in self.graphs:
            return self.graphs[width]
        tokens, positions = self.tokens[:, :width], self.positions[:, :width]
        tokens.zero_()
        positions.fill_(-1)  # while capturing, every column writes the scratch block
        self.row.fill_(self.cache.tables.shape[0] - 1)  # the scratch row
        mask = prefill_mask([0], [width], width, self.dtype, tokens.device)  # causal over the whole bucket

        def step() -> torch.Tensor:
            self.cache.prepare(self.row, positions, width, "new")
            output = self.model(
                input_ids=tokens,
                position_ids=positions.clamp(min=0),
                attention_mask=mask,
                use_cache=True,
                logits_to_keep=self.last,
                **{self.cache_kwarg: self.cache},
            )
            return output.logits[:, -1]

        self.graphs[width] = capture(step, self.pool)
        return self.graphs[width]


Output = TypeVar("Output")


def capture(step: Callable[[], Output], pool: object) -> tuple[torch.cuda.CUDAGraph, Output]:
    """`step` recorded as a graph in `pool`, and its output (static tensors that each replay overwrites)."""
    # Warm-up on a side stream before capture, as CUDA graphs require; the scratch position absorbs its writes.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = step()
    graph.replay()  # a graph's first launch uploads it: done here, not in a request's time
    return graph, output
