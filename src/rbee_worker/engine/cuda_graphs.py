"""Forwards replayed as CUDA graphs: one launch for the whole forward instead of a thousand kernel launches driven
from Python, which is what bounds a decode step of a model that fits a GPU, and even a long prompt's forward of a
large model, whose kernels finish sooner than Python can launch them (bench/results/README.md).

A graph has fixed shapes, so inputs are padded up to buckets. Decode steps: the batch to the next of ROW_BUCKETS (rows
beyond the running sequences are the cache's scratch rows, as in any decode step) and the attention span to the next
power of two (positions beyond a row's length are masked, as always). First prompt chunks of one request (from
position 0): the chunk length to the next power of two, padded on the right. Graphs are captured on first use, or
ahead of time by `warm_up`; all share one memory pool. The inputs live in static tensors that each call overwrites.
"""

from collections.abc import Callable
from typing import TypeVar

import torch

from rbee_worker.engine.kv_cache import SlotCache, decode_mask, prefill_mask
from rbee_worker.engine.sampler import MAX_TOP_LOGPROBS, PACKED_WIDTH, SamplerFeatures, SamplerState, pack, sample

ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
MIN_SPAN = 128
MIN_CHUNK = 16  # the shortest prompt-chunk bucket


def bucket(value: int, buckets: list[int]) -> int:
    return next(b for b in buckets if b >= value)


def graph_features(features: SamplerFeatures) -> SamplerFeatures:
    """The sampler stages of the graph that runs a decode step needing `features`. A step of greedy rows without
    penalties runs the greedy graph; any other runs top-k, top-p and the penalties whatever its rows ask (each a
    no-op for a row without it: top_k = the vocabulary, penalties 1 and 0; a greedy row takes the argmax after its
    penalties), and a step with logprobs computes MAX_TOP_LOGPROBS alternatives (a row reads the ones it asked for).
    So the four GRAPH_KINDS per (rows, span), captured before ready, serve every mix of settings, instead of a graph
    per combination captured when a request first brings it, which stalls every running stream for the capture."""
    logprobs = -1 if features.top_logprobs < 0 else MAX_TOP_LOGPROBS
    if not (features.sampling or features.penalties):
        return SamplerFeatures(masks=features.masks, top_logprobs=logprobs)
    return SamplerFeatures(top_k=True, penalties=True, masks=features.masks, top_logprobs=logprobs)


# Every graph_features value a request can bring (logits masks have no caller yet): greedy and sampled, each with and
# without logprobs.
GRAPH_KINDS = [
    SamplerFeatures(),
    SamplerFeatures(top_logprobs=MAX_TOP_LOGPROBS),
    SamplerFeatures(top_k=True, penalties=True),
    SamplerFeatures(top_k=True, penalties=True, top_logprobs=MAX_TOP_LOGPROBS),
]


class LaunchedStep:
    """A decode step on its way through the GPU: `result` waits for it."""

    def __init__(self, packed: torch.Tensor, done: torch.cuda.Event) -> None:
        self._packed, self._done = packed, done

    def __len__(self) -> int:
        return self._packed.shape[0]

    def result(self) -> list[list[float]]:
        """Each row's sampled outcome (sampler.pack's layout), copied to the host once the step has run."""
        self._done.synchronize()
        return self._packed.tolist()


class DecodeGraphs:
    """Decode steps, each with the sampler after the forward, as graphs per (rows, span, graph_features of the
    step's sampler features)."""

    def __init__(
        self, model: torch.nn.Module, cache: SlotCache, cache_kwarg: str, dtype: torch.dtype, state: SamplerState
    ) -> None:
        self.model, self.cache, self.cache_kwarg, self.dtype, self.state = model, cache, cache_kwarg, dtype, state
        device = cache.keys[0].device
        self.row_buckets = sorted({b for b in ROW_BUCKETS if b < cache.slots} | {cache.slots})
        spans, span = [], MIN_SPAN
        while span < cache.slot_len:
            spans.append(span)
            span *= 2
        self.span_buckets = [*spans, cache.slot_len]
        rows = cache.slots
        # The graphs' inputs, token / position / length / chained flag of each row, written by one copy from pinned
        # host memory (three pageable copies would cost more than the rest of the host's work on a step). Two host
        # buffers, used in turn: the copy out of one may still be queued behind a step that runs while the host
        # fills the other.
        self.inputs = torch.zeros(4, rows, dtype=torch.long, device=device)
        self.inputs[1] = cache.slot_len
        self.host_inputs = [torch.zeros(4, rows, dtype=torch.long, pin_memory=True) for _ in range(2)]
        self.host_out = [torch.zeros(rows, PACKED_WIDTH, dtype=torch.float32, pin_memory=True) for _ in range(2)]
        self.done = [torch.cuda.Event() for _ in range(2)]
        self.launches = 0
        # Each row's token chosen by the latest step, written by the graph itself: a chained row reads its input token
        # here, so the step after can be launched before the host has seen this one's result.
        self.chosen = torch.zeros(rows, dtype=torch.long, device=device)
        self.slots = torch.arange(rows, device=device)  # a graph step's rows are slots 0..rows-1
        self.graphs: dict[
            tuple[int, int, SamplerFeatures], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]
        ] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def warm_up(self) -> None:
        """Capture the graph of every batch bucket, span bucket and kind (GRAPH_KINDS), so that no request pays for a
        capture."""
        for rows in self.row_buckets:
            for span in self.span_buckets:
                for kind in GRAPH_KINDS:
                    self._graph(rows, span, kind)

    def shape(self, count: int, longest: int) -> tuple[int, int]:
        """The (rows, span) bucket of a step over `count` rows whose longest attends to `longest` positions."""
        return bucket(count, self.row_buckets), bucket(longest, self.span_buckets)

    def captured(self, count: int, longest: int, features: SamplerFeatures) -> bool:
        return (*self.shape(count, longest), graph_features(features)) in self.graphs

    def launch(
        self,
        tokens: list[int],
        positions: list[int],
        lengths: list[int],
        chained: list[bool],
        features: SamplerFeatures,
    ) -> LaunchedStep:
        """Start one decode step over cache rows 0..len(tokens)-1 (as the eager forward) without waiting for it. A
        chained row takes as its token the one the previous step chose for it, not tokens[row]. The sampler runs inside
        the graph, so a step's result is each row's chosen token (and the logprobs asked for), one small copy to the
        host; rows of length 0 (no sequence) leave the sampler's state untouched.

        A step whose graph is not captured yet is captured first, which runs the forward once and so overwrites the
        chosen tokens: chain only onto a step of a captured graph."""
        count = len(tokens)
        rows, span = self.shape(count, max(lengths))
        graph, packed, _ = self._graph(rows, span, graph_features(features))
        turn = self.launches % 2
        self.launches += 1
        pad = rows - count
        # This buffer's copy ran before the step before the previous one, which the host has waited for.
        host = self.host_inputs[turn].numpy()
        host[0, :rows] = tokens + [0] * pad
        host[1, :rows] = positions + [self.cache.slot_len] * pad
        host[2, :rows] = lengths + [0] * pad
        host[3, :rows] = chained + [False] * pad
        self.inputs[:, :rows].copy_(self.host_inputs[turn][:, :rows], non_blocking=True)
        graph.replay()
        self.host_out[turn][:count].copy_(packed[:count], non_blocking=True)
        self.done[turn].record()
        return LaunchedStep(self.host_out[turn][:count], self.done[turn])

    def _graph(
        self, rows: int, span: int, features: SamplerFeatures
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
        """The graph, its packed sampler output (see launch), and the cache's row index it reads (kept alive: a graph
        reads fixed addresses)."""
        key = (rows, span, features)
        if key in self.graphs:
            return self.graphs[key]
        inputs = self.inputs[:, :rows]
        # Harmless inputs while capturing: every row writes the scratch position and reads position 0.
        inputs.zero_()
        inputs[1].fill_(self.cache.slot_len)
        positions = inputs[1, :, None]
        self.cache.prepare(0, positions, span)  # also zeroes the cache up to `span`

        def step() -> torch.Tensor:
            tokens = torch.where(inputs[3] != 0, self.chosen[:rows], inputs[0])
            output = self.model(
                input_ids=tokens[:, None],
                position_ids=positions,
                attention_mask=decode_mask(inputs[2], span, self.dtype),
                use_cache=True,
                logits_to_keep=1,
                **{self.cache_kwarg: self.cache},
            )
            out = sample(output.logits[:, -1], self.state, self.slots[:rows], inputs[2] > 0, features)
            self.chosen[:rows].copy_(out.tokens)
            return pack(out)

        graph, packed = capture(step, self.pool)
        self.graphs[key] = (graph, packed, self.cache.row_index)
        return self.graphs[key]


class PrefillGraphs:
    """The first chunk of one request's prompt (positions 0..count-1 of its slot) as a graph per chunk bucket.

    The chunk is padded on the right: its tokens keep their positions, so the causal mask over the bucket is exact for
    them (the engine's attention then takes SDPA's causal flash kernel), and the padding after them writes the
    scratch position and is never read. The logits are those of the last real token (`logits_to_keep` as an index).
    """

    def __init__(
        self, model: torch.nn.Module, cache: SlotCache, cache_kwarg: str, dtype: torch.dtype, max_chunk: int,
        pool: object,
    ) -> None:  # fmt: skip
        self.model, self.cache, self.cache_kwarg, self.dtype, self.pool = model, cache, cache_kwarg, dtype, pool
        device = cache.keys[0].device
        # Powers of two that neither a prompt chunk nor a KV slot can outgrow; longer chunks run eagerly.
        limit = min(max_chunk, cache.slot_len)
        self.buckets = [2**i for i in range(MIN_CHUNK.bit_length() - 1, limit.bit_length()) if 2**i <= limit]
        widest = max(self.buckets, default=0)
        self.tokens = torch.zeros(1, widest, dtype=torch.long, device=device)
        self.positions = torch.full((1, widest), cache.slot_len, dtype=torch.long, device=device)
        self.slot = torch.zeros(1, 1, dtype=torch.long, device=device)  # the request's slot, as a (1, 1) row index
        self.last = torch.zeros(1, dtype=torch.long, device=device)  # the column of the last real token
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def fits(self, count: int) -> bool:
        return bool(self.buckets) and count <= self.buckets[-1]

    def warm_up(self) -> None:
        for width in self.buckets:
            self._graph(width)

    def run(self, slot: int, token_ids: list[int]) -> torch.Tensor:
        """Logits (1, vocab) after token_ids, the first len(token_ids) tokens of the prompt in `slot` (as the eager
        forward)."""
        count = len(token_ids)
        width = bucket(count, self.buckets)
        graph, logits = self._graph(width)
        self.tokens[0, :width].copy_(torch.tensor(token_ids + [0] * (width - count)))
        self.positions[0, :width].copy_(torch.tensor([*range(count), *[self.cache.slot_len] * (width - count)]))
        self.slot.fill_(slot)
        self.last.fill_(count - 1)
        graph.replay()
        return logits

    def _graph(self, width: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        if width in self.graphs:
            return self.graphs[width]
        tokens, positions = self.tokens[:, :width], self.positions[:, :width]
        tokens.zero_()
        positions.fill_(self.cache.slot_len)  # while capturing, every column writes the scratch position
        self.cache.prepare_graph_rows(self.slot, positions, width)
        mask = prefill_mask([0], [width], width, self.dtype, tokens.device)  # causal over the whole bucket

        def step() -> torch.Tensor:
            output = self.model(
                input_ids=tokens,
                position_ids=positions,
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
