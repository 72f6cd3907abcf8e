"""The torch runtime's runner (the Runner protocol of engine/runners/protocol.py): a transformers model, its KV cache,
its CUDA graphs, and the sampler's state; forwards in, chosen tokens out.

It knows nothing of requests: the engine hands it rows (a batch row, its block table, the tokens to feed and their
positions) and gets back,
for each row that samples, the chosen token, whether the logits were valid, and the log-probabilities asked for.
Sampling runs on the device right after the forward (engine/sampling/sampler.py), inside the decode step's CUDA graph on
a GPU, so only the chosen ids (and requested logprobs) cross to the host, once per step. On a GPU a decode step is
launched without waiting for it (`launch`), and the next one may chain onto it (`chains`) when its graph is captured.
"""

import contextlib
import dataclasses
import inspect
import logging
import time
from collections.abc import Iterator, Sequence

import torch

from rbee_worker.engine.engine_config import EngineConfig
from rbee_worker.engine.runners.protocol import (
    Capabilities,
    DecodeRow,
    Finished,
    KvGeometry,
    Launched,
    PrefixHit,
    PromptRow,
    Sampled,
    Stepped,
)
from rbee_worker.engine.runners.rows import (
    RowSampling,
    WindowLayers,
    device_fault,
    kv_budget,
    kv_pool,
    pooled_rows,
    score,
)
from rbee_worker.engine.runners.torch.attention import config_window, use_engine_attention
from rbee_worker.engine.runners.torch.compiled import compile_model, uncompile_model
from rbee_worker.engine.runners.torch.cuda_graphs import DecodeGraphs, LaunchedStep, PrefillGraphs
from rbee_worker.engine.runners.torch.device_paths import device_path
from rbee_worker.engine.runners.torch.kv_cache import PagedCache, kv_bytes_per_token, prefill_mask, sliding_layers
from rbee_worker.engine.sampling.sampler_state import SamplerFeatures
from rbee_worker.engine.sampling.sampling_params import SamplingParams
from rbee_worker.engine.scheduling.kv_blocks import SCRATCH_BLOCK
from rbee_worker.engine.structured.grammar import Matcher
from rbee_worker.layers.merged_linear import merge_projections
from rbee_worker.loading.loaded import LoadedModel

log = logging.getLogger(__name__)


class _GraphStep:
    """A decode step launched as a CUDA graph, not waited for."""

    ready = False

    def __init__(self, step: LaunchedStep, rows: list[DecodeRow]) -> None:
        self.step, self.rows = step, rows


class TorchRunner:
    """Prepares a loaded model for serving (merged projections, the engine's attention, the device's own preparation
    of device_paths.py, the KV cache, compiled layers and CUDA graphs) and runs its forwards. Lives on the engine
    thread."""

    prefixes = None  # the block pool is the prefix cache
    capabilities: Capabilities

    def __init__(self, loaded: LoadedModel, config: EngineConfig, kv: KvGeometry | None = None) -> None:
        """`kv`: the KV block pool's geometry where it is decided elsewhere (tensor parallelism: rank 0's, so that every
        rank holds the same blocks); None: sized here (size_pool)."""
        self.config = config
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        self.path = device_path(loaded.info.device, loaded.info.dtype)
        merge_projections(loaded.model)
        loaded = self.path.prepare(loaded, config)
        use_engine_attention(loaded.model, loaded.info.context_length)
        # Sliding layers read the forwards' query positions (engine/runners/torch/attention.py); other models get none.
        self._sliding = config_window(loaded.model.config) is not None
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.info.device
        self.dtype = loaded.info.dtype
        self.capabilities = self.path.capabilities(self.model)
        self.cache_kwarg = cache_kwarg(loaded.model)
        self.kv = kv or size_pool(loaded, config)
        self.cache = PagedCache(loaded.model.config, self.kv, config.max_batch, self.dtype, self.device)
        self.vocab_size = loaded.model.get_output_embeddings().out_features  # the logits' width
        self.sampling = RowSampling(config.max_batch, self.vocab_size, self.device)
        self.state = self.sampling.state
        self._compile = config.compile_model
        # Batched decode steps on a GPU as CUDA graphs (not in deterministic mode, which decodes row by row).
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        self._prepare_forward()

    # -- sampling state ------------------------------------------------------------------------------------------

    def assign(
        self, row: int, params: SamplingParams, seed: int, prompt_ids: Sequence[int], logprobs: int | None
    ) -> None:
        """A request takes the batch row: its sampling parameters, seed and penalty counts go to the device."""
        self.sampling.assign(row, params, seed, prompt_ids, logprobs)

    def masks(self, rows: Sequence[tuple[int, Matcher]]) -> None:
        self.sampling.masks(rows)

    def features(self, rows: Sequence[int]) -> SamplerFeatures:
        return self.sampling.features(rows)

    def restore(self, row: int, hit: PrefixHit) -> bool:
        raise NotImplementedError("the block pool is the prefix cache (prefixes is None)")

    def evict(self, row: int) -> None:
        """Nothing to do: the request's keys and values are in its blocks, which the scheduler took back."""

    def release(self, row: int) -> None:
        """Nothing to do: the request's keys and values are in its blocks (the prefix cache keeps the full ones)."""

    # -- steps -----------------------------------------------------------------------------------------------------

    def step(self, prompts: list[PromptRow], decodes: list[DecodeRow]) -> Stepped:
        """An eager forward over prompt chunks, or one over decode rows (never both: see `capabilities`)."""
        if prompts and decodes:
            raise ValueError("the torch runner runs prompt chunks and decode rows in separate forwards")
        if prompts:
            return self._prefill(prompts)
        return Stepped(self._decode(decodes) if decodes else [], [])

    def chains(self, decodes: list[DecodeRow]) -> bool:
        """On a GPU, when the step's graphs are captured, those of a held sampler too (see `launch`): capturing one
        runs the forward, which overwrites the tokens that the step before chose on the device."""
        if self.graphs is None:
            return False
        features = self.features([r.row for r in decodes])
        held = dataclasses.replace(features, masks=True)
        return self.graphs.captured(len(decodes), features) and self.graphs.captured(len(decodes), held)

    def launch(self, decodes: list[DecodeRow], hold_sampling: bool = False) -> Launched:
        """On a GPU CUDA graphs over the rows, not waited for (see DecodeGraphs); elsewhere an eager decode step. A held
        sampler runs the graphs with the mask stage whatever the rows' masks are now: the host sets them after the
        launch (a reasoning row's grammar may wake up)."""
        if self.graphs is None:
            return Finished(self._decode(decodes))
        features = self.features([r.row for r in decodes])
        if hold_sampling:
            features = dataclasses.replace(features, masks=True)
        return _GraphStep(self.graphs.launch(decodes, features, hold_sampling), decodes)

    def sample_held(self, launched: Launched) -> None:
        assert isinstance(launched, _GraphStep)
        launched.step.sample()

    def collect(self, launched: Launched) -> list[Sampled]:
        """The launched step's rows' tokens, in order (a graph step: once it has run)."""
        if isinstance(launched, Finished):
            return launched.sampled
        assert isinstance(launched, _GraphStep)
        packed = launched.step.result()
        return [self.sampling.sampled(row, r.row) for row, r in zip(packed, launched.rows, strict=True)]

    def fault(self, error: BaseException) -> str | None:
        return device_fault(self.device, error)

    def prompt_cache_bytes(self) -> int:
        """None: the block pool is the prefix cache."""
        return 0

    def kv_bytes(self) -> int:
        return self.path.kv_bytes(self.kv, self.cache)

    def memory_bytes(self) -> int:
        return self.path.memory_bytes(self.loaded.info.weight_bytes, self.kv_bytes())

    # -- forwards --------------------------------------------------------------------------------------------------

    def _prefill(self, rows: list[PromptRow]) -> Stepped:
        """One forward over prompt chunks, a batch row each: the chosen tokens of the rows that sample, in order, and
        the rows' targets scored. Only a forward with targets keeps every position's logits."""
        hidden: list[torch.Tensor] = []
        with self._hidden_states(hidden) if any(row.pool for row in rows) else contextlib.nullcontext():
            logits = self._prompt_forward(rows)
        pooled = [pooled_rows(hidden[0][i, hidden[0].shape[1] - len(row.token_ids) :], row) if row.pool else None
                  for i, row in enumerate(rows)] if hidden else []  # fmt: skip
        scored = [
            score(logits[i, logits.shape[1] - len(row.token_ids) :], row.targets, row.target_top) if row.targets else ()
            for i, row in enumerate(rows)
        ]
        picked = [i for i, row in enumerate(rows) if row.sample]
        if not picked:
            return Stepped([], scored, pooled)
        batch_rows = [rows[i].row for i in picked]
        packed = self.sampling.sample(logits[picked, -1], batch_rows, [True] * len(batch_rows))
        sampled = [self.sampling.sampled(out, row) for out, row in zip(packed, batch_rows, strict=True)]
        return Stepped(sampled, scored, pooled)

    @contextlib.contextmanager
    def _hidden_states(self, into: list[torch.Tensor]) -> Iterator[None]:
        """The decoder's output (its last hidden states, after its final norm: what an embedding pools) of the forwards
        inside, appended to `into`."""

        def keep(module: torch.nn.Module, args: object, output: object) -> None:
            into.append(output[0] if isinstance(output, tuple) else output.last_hidden_state)  # type: ignore[attr-defined]

        handle = self.model.get_decoder().register_forward_hook(keep)
        try:
            yield
        finally:
            handle.remove()

    def _decode(self, rows: list[DecodeRow]) -> list[Sampled]:
        """One eager decode step over these rows; their tokens in order."""
        logits = self._decode_step(rows)
        batch_rows = [r.row for r in rows]
        packed = self.sampling.sample(logits, batch_rows, [True] * len(rows))
        return [self.sampling.sampled(out, row) for out, row in zip(packed, batch_rows, strict=True)]

    def _prompt_forward(self, rows: list[PromptRow]) -> torch.Tensor:
        """Row b feeds rows[b].token_ids at positions rows[b].start.. of its request; rows are left-padded to the
        longest (padding writes the scratch block), so the logits returned, [rows, positions, vocab], end with each
        row's last token: that position only, or all of them where a row has targets (PromptRow.targets). A single
        chunk from position 0 attends to its own keys and values; any other forward to the rows' cached ones,
        gathered through their block tables."""
        every = any(r.targets for r in rows)
        pools = any(r.pool for r in rows)
        for r in rows:
            self.cache.set_table(r.row, r.blocks, r.window_blocks)
        width = max(len(r.token_ids) for r in rows)
        first_chunk = len(rows) == 1 and rows[0].start == 0
        if self.prefill_graphs and first_chunk and not (every or pools) and self.prefill_graphs.fits(width):
            return self.prefill_graphs.run(rows[0].row, rows[0].token_ids)[:, None]
        tokens, positions = [], []
        for r in rows:
            pad = width - len(r.token_ids)
            tokens.append([0] * pad + list(r.token_ids))
            positions.append([-1] * pad + list(range(r.start, r.start + len(r.token_ids))))
        kv_len = self.path.key_span(max(r.start + len(r.token_ids) for r in rows), first_chunk, self.cache)
        position_ids = torch.tensor(positions, device=self.device)
        batch_rows = torch.tensor([r.row for r in rows], device=self.device)
        self.cache.prepare(batch_rows, position_ids, kv_len, "new" if first_chunk else "gather")
        mask = prefill_mask([r.start for r in rows], [len(r.token_ids) for r in rows], kv_len, self.dtype, self.device)
        with torch.compiler.set_stance("force_eager") if self._eager_prompts else contextlib.nullcontext():
            return self._forward(torch.tensor(tokens, device=self.device), position_ids, mask, keep=0 if every else 1)

    @property
    def _eager_prompts(self) -> bool:
        """Whether prompt forwards skip the compiled forward (see DevicePath.eager_prompts)."""
        return self.path.eager_prompts(self._compile)

    def _decode_step(self, rows: Sequence[DecodeRow]) -> torch.Tensor:
        """The eager forward of one decode step over these rows, its attention as the device path reads the cache."""
        size = self.cache.block_size
        batch_rows = torch.tensor([r.row for r in rows], device=self.device)
        index = [r.position // size for r in rows]
        blocks = [r.blocks[i] for r, i in zip(rows, index, strict=True)]
        window = [r.window_blocks[i] if r.window_blocks else SCRATCH_BLOCK for r, i in zip(rows, index, strict=True)]
        self.cache.ensure_zeroed(max(blocks), max(window))
        self.cache.set_entries(
            batch_rows, *(torch.tensor(values, device=self.device) for values in (index, blocks, window))
        )
        position_ids = torch.tensor([r.position for r in rows], device=self.device)[:, None]
        lengths = torch.tensor([r.position + 1 for r in rows], device=self.device)
        tokens = torch.tensor([r.tokens[0] for r in rows], device=self.device)[:, None]
        kv_len = max(r.position + 1 for r in rows)
        mask, paged = self.path.decode_attention(self.cache, batch_rows, position_ids, lengths, kv_len)
        return self._forward(tokens, position_ids, mask, **paged)[:, -1]

    def _forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor,
        keep: int = 1,
        **paged: torch.Tensor,
    ) -> torch.Tensor:
        """The model's logits for each batch row's last `keep` positions (0: all of them): (rows, positions, vocab).
        Padding positions (-1) are fed as 0; the cache writes them to the scratch block."""
        output = self.model(
            input_ids=input_ids,
            position_ids=position_ids.clamp(min=0),
            attention_mask=mask,
            use_cache=True,
            logits_to_keep=keep,
            **{self.cache_kwarg: self.cache},
            **({"query_positions": position_ids} if self._sliding else {}),
            **paged,
        )
        return output.logits

    def close(self) -> None:
        """Nothing to free by hand: torch frees the model and the cache with their last reference."""

    # -- preparation -----------------------------------------------------------------------------------------------

    def _prepare_forward(self) -> None:
        """Before the worker reports ready: with --compile, the forward through torch.compile (see compiled.py), run
        once for each class of shapes so that no request waits for a compilation; on a GPU, every decode graph and
        first-chunk graph captured (of the compiled or the plain layers), and the kernels of the eager paths made."""
        graphs = self.path.captures_graphs(self.config)
        if not (self._compile or self.path.warms):
            return
        started = time.perf_counter()
        with torch.inference_mode():
            if self._compile:
                try:
                    compile_model(self.model, self.cache)
                    self.warm_up(graphs)
                except Exception as exc:  # e.g. no Triton for this GPU, no C++ compiler: slower, but it runs
                    log.warning("torch.compile failed, running the model uncompiled: %s", str(exc).splitlines()[0])
                    self._compile = False
                    uncompile_model(self.model, self.cache)
                    self.graphs = self.prefill_graphs = None
            if not self._compile:
                self.warm_up(graphs)
        log.info(
            "prepared the %s forward in %.1f s (%d CUDA graphs)",
            "compiled" if self._compile else "plain",
            time.perf_counter() - started,
            len(self.graphs.graphs if self.graphs else ())
            + len(self.prefill_graphs.graphs if self.prefill_graphs else ()),
        )

    def warm_up(self, graphs: bool) -> None:
        """With `graphs`, capture every decode graph (each row bucket and sampler kind) and every
        first-chunk prefill graph. Compiled layers also run the forwards that stay eager once (on a GPU prompt chunks
        of one and two rows, of different lengths; without graphs decode steps of one and two rows), so that they are
        compiled for any shape before the first request (tests/engine/test_compile.py fails any compilation after
        ready). Then what the device path warms (on a GPU the eager paths' kernels)."""
        if graphs:
            self.graphs = DecodeGraphs(
                self.model, self.cache, self.cache_kwarg, self.dtype, self.state, self.config.max_batch
            )
            self.graphs.warm_up()
            # Not for a model with sliding layers: its first chunks replayed as graphs give other logits than eagerly
            # (bench/results/README.md, issue 42), so they run eagerly.
            if not self._sliding:
                self.prefill_graphs = PrefillGraphs(
                    self.model, self.cache, self.cache_kwarg, self.dtype, self.config.prefill_chunk, self.graphs.pool
                )
                self.prefill_graphs.warm_up()
        scratch = [SCRATCH_BLOCK] * self.cache.max_blocks  # warm-up forwards write and read the scratch block only
        rows = min(self.config.max_batch, 2)
        if self._compile and not self._eager_prompts:
            # Batch rows 0 and 1, which no request holds yet. First chunks of one token (dynamo specializes sizes of 1)
            # and of two lengths (with one, it takes the first length it meets for a constant); on a GPU, where first
            # chunks run as graphs, eager chunks attending to a multiple of 8 positions and to others (inductor's
            # kernels guard on that alignment, so a batch of unaligned prompts would otherwise recompile after ready).
            for count in (1, 16, 24):
                self._prompt_forward([PromptRow(0, scratch, [0] * count, 0, False)])
            for count in (48, 17):
                self._prompt_forward([PromptRow(0, scratch, [0] * count, 16, False)])
            if rows > 1:
                for long, short in ((16, 8), (17, 9)):
                    self._prompt_forward(
                        [PromptRow(0, scratch, [0] * long, 0, False), PromptRow(1, scratch, [0] * short, 0, False)]
                    )
        if self._compile and not graphs:
            for count in range(1, rows + 1):
                self._decode_step([DecodeRow(row, scratch, (0,), 32) for row in range(count)])
        self.path.warm(self._prompt_forward, self.config.max_batch, scratch, self.state)


def size_pool(loaded: LoadedModel, config: EngineConfig) -> KvGeometry:
    """The KV block pool within the memory budget: --kv-cache-gb, or what the device has left (rows.kv_budget;
    on a CPU touched only as it fills: see PagedCache). Sized from the model's config, whose key/value heads are a
    tensor-parallel rank's own (loading/sharding/tp_layers.py)."""
    info, model_config = loaded.info, loaded.model.config
    budget = config.kv_cache_bytes if config.kv_cache_bytes is not None else kv_budget(info.device)
    window, sliding = sliding_layers(model_config)
    layers = model_config.get_text_config().num_hidden_layers
    per_token = kv_bytes_per_token(model_config, info.dtype, layers - len(sliding))
    windows = None
    if window is not None and sliding:
        sliding_bytes = kv_bytes_per_token(model_config, info.dtype, len(sliding))
        windows = WindowLayers(window, sliding_bytes, config.prefill_chunk)
    return kv_pool(info.context_length, per_token, config.block_size, budget, config.max_batch, window=windows)


def cache_kwarg(model: torch.nn.Module) -> str:
    """The name of forward's cache argument: transformers 5.2x names it `cache`, earlier versions `past_key_values`;
    both are supported."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
