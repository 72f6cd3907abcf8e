"""The model runner on llama.cpp's runtime (llama-cpp-python's low-level API), for GGUF files on a CPU or a Mac.

llama.cpp holds the weights, the KV cache and the forward; the engine keeps everything else (scheduler, sampler,
detokenizer, events). One `llama_context` serves every batch row; sequence id = batch row. Its KV cache is a stream of
cells per sequence, each as long as the context offered, where the scheduler's block pool holds every row's whole
context (the default, and always in deterministic mode, where the context shrinks to a row's share instead): in one
unified pool, llama.cpp runs each sequence's attention over every sequence's cells (masked), a cost that grows with
the other sequences' lengths (bench/results/README.md, issue 49). A smaller pool is one unified pool of
cells that every sequence draws on (`kv_unified`), so one request may hold the whole context while others are short.
The scheduler's block tables account for the cells (a request holds at most its blocks' positions), and llama.cpp
places them itself. A step is one `llama_batch` with every row of the round, prompt chunks (their tokens, logits on
the last one only when the chunk ends the prompt) and decode rows (one token each), and one `llama_decode`. The rows'
logits are read where llama.cpp wrote them, as one [rows, vocab] tensor without a copy, and sampled by the worker's
own batched sampler (engine/sampling/sampler.py, on the CPU), so sampling behaves exactly as on the torch runtime.

Prefix reuse: llama.cpp places the cells, so the block pool cannot be the prefix cache here. When a request ends, its
sequence's state (keys and values of the tokens it holds) is saved to a host-memory cache
(engine/runners/llama_cpp/prompt_cache.py, as llama-server's `--cache-ram`) and its cells go back; at a prompt's first
chunk the scheduler looks up the saved state sharing the longest prefix with the prompt (`prefixes`,
prompt_cache.SavedPrefixes), and the plan restores it into the row's sequence cut to that prefix (`restore`), or a
running request's sequence gives its cells for the prefix (in a unified pool `llama_memory_seq_cp` shares them; across
streams its state is copied, as a saved one is restored). Saved states hold no cells: cells left to ended sequences
would take room that the block pool does not account for, and in a unified pool llama.cpp's attention sums depend on the
cells every other sequence holds.

A reused prefix gives a fresh run's logits (the same greedy text with the cache on and off) when two things hold.
The rest of the prompt runs in batches of UNIFORM_ROWS tokens or more, as a fresh run's chunks over those positions
do (Capabilities.uniform_rows, which the scheduler's chunks and the limit of its lookups keep to): fewer rows take
other kernels, which round differently. And the prefix's positions were computed, or restored from positions
computed, with no other sequence in the pool (exact): each sequence's exact first positions are tracked and saved
with its state, and of the sources sharing the longest prefix the lookup takes the one exact the furthest, so a prompt
computed alone serves the requests after it exactly even when those that ran beside it were saved too.

In deterministic mode only a prompt's whole `prefill_chunk` chunks are saved (the positions a fresh run computes in
the same forwards), and running sequences give nothing (a stream per sequence: llama.cpp copies between streams only
whole).

Every step is computed before it returns: `launch` hands back a finished step and `chains` is always False.
"""

import ctypes
import dataclasses
import logging
from collections.abc import Sequence

import llama_cpp.llama_cpp as native
import numpy as np
import torch

from rbee_worker.engine.engine_config import EngineConfig, default_threads
from rbee_worker.engine.runners.llama_cpp.prompt_cache import PromptCache, SavedPrefixes
from rbee_worker.engine.runners.llama_cpp.sequences import Sequences
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
from rbee_worker.engine.runners.rows import RowSampling, kv_budget, kv_pool, score
from rbee_worker.engine.sampling.sampling_params import SamplingParams
from rbee_worker.engine.structured.grammar import Matcher
from rbee_worker.errors import ModelLoadError
from rbee_worker.loading.gguf.llama_cpp_model import LlamaCppModel
from rbee_worker.loading.loaded import LoadedModel

log = logging.getLogger(__name__)

CPU = torch.device("cpu")
# llama_decode's return codes other than 0 (llama.h); a code below -1 is a fatal error of the context.
DECODE_ERRORS = {
    1: "no room in the KV cache for the batch",
    2: "aborted",
    -1: "invalid input batch (a token id outside the vocabulary, or a position out of order)",
}
PROMPT_CACHE_BYTES = 8 << 30  # the most host memory saved states take by default (llama-server's --cache-ram)
UNIFORM_ROWS = 64  # the fewest tokens of a batch whose rows llama.cpp's CPU kernels round alike (see LlamaCppRunner)
# llama_get_logits returning the buffer's address as an int (llama-cpp-python's binding returns a float pointer object).
_logits_address = native._lib["llama_get_logits"]
_logits_address.argtypes, _logits_address.restype = [ctypes.c_void_p], ctypes.c_void_p


class DecodeFailed(RuntimeError):
    """llama_decode returned an error code."""

    def __init__(self, code: int) -> None:
        super().__init__(f"llama_decode failed with {code}: {DECODE_ERRORS.get(code, 'a fatal error')}")
        self.code = code


class LlamaCppRunner:
    """Runs a LoadedModel of the llama.cpp runtime: the context, the batch, and each batch row's sampling state. Lives
    on the engine thread; `close` frees what llama.cpp holds."""

    # A round's prompt chunks and decode rows go in one llama_batch. uniform_rows: on an x86 CPU with AVX2 (measured:
    # bench/results/README.md, llama_cpp_numerics) llama.cpp's kernels give each row the same logits in any batch of
    # UNIFORM_ROWS tokens or more and others below, so the scheduler keeps prompt chunks and cache hits to it.
    capabilities = Capabilities(mixed_batches=True, uniform_rows=UNIFORM_ROWS)

    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        model: LlamaCppModel = loaded.model  # type: ignore[assignment]
        self.config, self.loaded, self.model = config, loaded, model
        rows = config.max_batch
        if rows > native.llama_max_parallel_sequences():
            raise ModelLoadError(
                f"llama.cpp runs at most {native.llama_max_parallel_sequences()} sequences at once: lower --max-batch"
            )
        budget = config.kv_cache_bytes if config.kv_cache_bytes is not None else kv_budget(CPU)
        context, per_token = loaded.info.context_length, model.kv_bytes_per_token
        self.kv: KvGeometry = kv_pool(context, per_token, config.block_size, budget, rows, shared_blocks=False)
        # A stream of cells per sequence where each row's whole context fits (see the module docstring), and always in
        # deterministic mode, with the context cut to a row's share: in a unified pool, attention runs over cells that
        # other sequences hold too (masked), and its sums then depend on what else runs.
        per_row = min(self.kv.context, self.kv.tokens // rows // config.block_size * config.block_size)
        unified = not config.deterministic and per_row < self.kv.context
        if not unified:
            self.kv = dataclasses.replace(self.kv, context=per_row)
        self.threads = config.threads or default_threads()
        self.capacity = config.prefill_chunk + rows  # the most tokens one step feeds: a round's chunks and decodes
        params = native.llama_context_default_params()
        params.n_ctx = self.kv.tokens if unified else rows * self.kv.context
        params.n_seq_max = rows
        params.kv_unified = unified
        params.n_batch = params.n_ubatch = self.capacity
        params.n_threads = params.n_threads_batch = self.threads
        params.no_perf = True
        # Embeddings (PromptRow.pool) are each output position's hidden state, pooled here as the engine asks.
        params.pooling_type = native.LLAMA_POOLING_TYPE_NONE
        self._context = native.llama_init_from_model(model.handle, params)
        if not self._context or native.llama_n_ctx_seq(self._context) < self.kv.context:
            raise ModelLoadError(
                f"llama.cpp could not create a context of {self.kv.tokens} tokens: lower --kv-cache-gb or "
                "--max-context, or see the llama.cpp messages with --log-level debug"
            )
        self._cells = native.llama_n_ctx(self._context)  # what it allocated: each sequence's cells rounded up
        self._batch = native.llama_batch_init(self.capacity, 0, 1)
        self.vocab_size = model.vocab_size
        self.sampling = RowSampling(rows, model.vocab_size, CPU)
        self._views: dict[int, np.ndarray] = {}  # _logits's views of llama.cpp's logits buffer, by row count
        self._views_at: int | None = None  # that buffer's address
        # A recurrent or hybrid model's state cannot be cut at a position, and a sliding-window model keeps no early
        # positions to give: they reuse nothing.
        self.reusing = (
            config.prefix_caching
            and not native.llama_model_is_recurrent(model.handle)
            and not native.llama_model_is_hybrid(model.handle)
            and native.llama_model_n_swa(model.handle) == 0
        )
        budget = config.prompt_cache_bytes
        if budget is None:
            budget = min(self.kv_bytes(), PROMPT_CACHE_BYTES)
        self.prompts = PromptCache(budget if self.reusing else 0)
        self.sequences = Sequences(self._context, rows, unified, self.prompts)
        least = self.kv.block_size
        self.prefixes = (
            SavedPrefixes(self.prompts, self.sequences.held, self.sequences.exact, least, config.deterministic)
            if self.reusing
            else None
        )
        self._prompt_lengths = [0] * rows
        self._broken = False  # a fatal llama_decode error: nothing more is asked of the context
        log.info(
            "llama.cpp runtime: %d threads, %d sequences sharing %d cells, prompt cache of %.2f GiB",
            self.threads,
            rows,
            self._cells,
            self.prompts.budget_bytes / 2**30,
            extra={"fields": {"threads": self.threads, "system": native.llama_print_system_info().decode().strip()}},
        )

    # -- sampling state ------------------------------------------------------------------------------------------

    def assign(
        self, row: int, params: SamplingParams, seed: int, prompt_ids: Sequence[int], logprobs: int | None
    ) -> None:
        """A request takes the batch row, whose sequence is empty or holds the prefix `restore` gives it: its
        sampling state comes."""
        self._prompt_lengths[row] = len(prompt_ids)
        self.sampling.assign(row, params, seed, prompt_ids, logprobs)

    def masks(self, rows: Sequence[tuple[int, Matcher]]) -> None:
        self.sampling.masks(rows)

    def restore(self, row: int, hit: PrefixHit) -> bool:
        """The prefix that `prefixes` found, given to the row's sequence (Sequences.restore)."""
        return self.sequences.restore(row, hit)

    def evict(self, row: int) -> None:
        """The request in this batch row was preempted: its sequence's cells go back to the pool."""
        self.sequences.clear(row)

    def release(self, row: int) -> None:
        """The request in this batch row has ended: its sequence's state is saved to the prompt cache (in deterministic
        mode its prompt's whole chunks only) unless a saved one holds it already, then its cells go back."""
        keep = len(self.sequences.held[row])
        if self.config.deterministic:
            prompt = self._prompt_lengths[row]
            keep = min(keep, prompt - prompt % self.config.prefill_chunk)
        if self.reusing and not self._broken and keep >= self.kv.block_size:
            self.sequences.save(row, keep)
        self.sequences.clear(row)

    # -- steps -------------------------------------------------------------------------------------------------------

    def chains(self, decodes: list[DecodeRow]) -> bool:
        return False

    def launch(self, decodes: list[DecodeRow], hold_sampling: bool = False) -> Launched:
        """The step computed at once (`chains` is False, so no sampling is ever held)."""
        return Finished(self.step([], decodes).sampled)

    def sample_held(self, launched: Launched) -> None:
        """Nothing: no step is launched with its sampling held."""

    def collect(self, launched: Launched) -> list[Sampled]:
        assert isinstance(launched, Finished)
        return launched.sampled

    def fault(self, error: BaseException) -> str | None:
        """A fatal llama_decode error (a code below -1) leaves the context unusable."""
        if isinstance(error, DecodeFailed) and error.code < -1:
            self._broken = True
            return f"llama.cpp's context cannot decode: {error}"
        return None

    def kv_bytes(self) -> int:
        """All of it: llama.cpp allocates and clears the whole cache, its cells rounded up, when the context is
        created."""
        return self._cells * self.kv.bytes_per_token

    def memory_bytes(self) -> int:
        return self.loaded.info.weight_bytes + self.kv_bytes()

    def prompt_cache_bytes(self) -> int:
        return self.prompts.bytes

    def step(self, prompts: list[PromptRow], decodes: list[DecodeRow]) -> Stepped:
        """One llama_decode over prompt chunks and decode rows together: the chosen tokens of the prompt rows that
        sample, then of the decode rows, in order, and the prompt rows' targets scored. llama.cpp outputs the logits
        of the positions flagged, in batch order: a prompt row's scored positions, then its last where it samples."""
        batch, n, outputs = self._batch, 0, 0
        sampled_rows: list[int] = []
        sampled_at: list[int] = []  # each sampling row's output index
        first_output: list[int] = []  # each prompt row's first output index (its scored and pooled positions')
        if sum(len(r.token_ids) for r in prompts) + len(decodes) > self.capacity:
            raise ValueError(f"a step of more than {self.capacity} tokens")
        # With embeddings on llama.cpp outputs every position of the step: every position is flagged then.
        pools = any(row.pool for row in prompts)
        for row in prompts:
            self.sequences.cut(row.row, row.start)
            last = len(row.token_ids) - 1
            first_output.append(outputs)
            for i, token in enumerate(row.token_ids):
                flagged = pools or i < len(row.targets) or (row.sample and i == last)
                self._put(n, token, row.start + i, row.row, flagged)
                n += 1
                outputs += flagged
            if row.sample:
                sampled_rows.append(row.row)
                sampled_at.append(outputs - 1)
        for row in decodes:
            (token,) = row.tokens  # rows of one token (Capabilities.row_tokens)
            self._put(n, token, row.position, row.row, True)
            n += 1
            sampled_rows.append(row.row)
            sampled_at.append(outputs)
            outputs += 1
        batch.n_tokens = n
        if n == 0:
            return Stepped([], [])
        alone = self.sequences.alone([r.row for r in prompts] + [r.row for r in decodes])
        if pools:
            native.llama_set_embeddings(self._context, True)
        try:
            if (code := native.llama_decode(self._context, batch)) != 0:
                raise DecodeFailed(code)
        finally:
            if pools:
                native.llama_set_embeddings(self._context, False)
        pooled = [self._pooled(row, at) for row, at in zip(prompts, first_output, strict=True)] if pools else []
        for row in prompts:
            self.sequences.computed(row.row, row.start, row.token_ids, alone)
        for row in decodes:
            self.sequences.computed(row.row, row.position, row.tokens, alone)
        logits = self._logits(outputs)
        scored = [
            score(logits[at : at + len(row.targets)], row.targets, row.target_top) if row.targets else ()
            for row, at in zip(prompts, first_output, strict=True)
        ]
        if not sampled_rows:
            return Stepped([], scored, pooled)
        if outputs > len(sampled_rows):  # scored or pooled positions among them: the sampling rows' logits gathered
            logits = logits[sampled_at]
        packed = self.sampling.sample(logits, sampled_rows, [True] * len(sampled_rows))
        sampled = [self.sampling.sampled(out, row) for out, row in zip(packed, sampled_rows, strict=True)]
        return Stepped(sampled, scored, pooled)

    def _pooled(self, row: PromptRow, at: int) -> np.ndarray | None:
        """What a pooling row gives (PromptRow.pool) of the last llama_decode's embeddings (every position's hidden
        state after the output norm, in batch order), its first position at output `at`; a copy."""
        if row.pool is None:
            return None
        mine = [at + i for i in range(len(row.token_ids)) if _pools(row, i)]  # every position is an output
        if not mine:
            return None
        width = native.llama_model_n_embd(self.model.handle)
        address = ctypes.cast(native.llama_get_embeddings(self._context), ctypes.c_void_p).value
        rows = np.ctypeslib.as_array((ctypes.c_float * ((mine[-1] + 1) * width)).from_address(address))
        hidden = rows.reshape(-1, width)[mine]
        return hidden.sum(0) if row.pool == "mean" else hidden[0].copy()

    def _put(self, index: int, token: int, position: int, row: int, logits: bool) -> None:
        batch = self._batch
        batch.token[index] = token
        batch.pos[index] = position
        batch.n_seq_id[index] = 1
        batch.seq_id[index][0] = row
        batch.logits[index] = logits

    def _logits(self, rows: int) -> np.ndarray:
        """The last llama_decode's output rows, in batch order, as a [rows, vocab] float32 view of llama.cpp's buffer
        (valid until the next llama_decode). llama.cpp keeps that buffer until a step outputs more rows than it holds,
        so the views are kept by row count for as long as its address stays: a new view costs more right after a
        forward than the step's greedy sampling."""
        address = _logits_address(self._context)
        if address != self._views_at:
            self._views, self._views_at = {}, address
        view = self._views.get(rows)
        if view is None:
            vocab = self.model.vocab_size
            buffer = (ctypes.c_float * (rows * vocab)).from_address(address)
            view = self._views[rows] = np.ctypeslib.as_array(buffer).reshape(rows, vocab)
        return view

    def close(self) -> None:
        """Free the batch, the context and the model (the engine thread is done with them)."""
        if self._context:
            native.llama_batch_free(self._batch)
            native.llama_free(self._context)
            self._context = None
        self.model.close()


def _pools(row: PromptRow, i: int) -> bool:
    """Whether the row's i-th position's hidden state makes its embedding (PromptRow.pool)."""
    if row.pool == "mean":
        return True
    if row.pool == "last":
        return i == len(row.token_ids) - 1
    return row.pool == "cls" and row.start + i == 0
