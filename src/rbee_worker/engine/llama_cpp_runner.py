"""The model runner on llama.cpp's runtime (llama-cpp-python's low-level API), for GGUF files on a CPU or a Mac.

llama.cpp holds the weights, the KV cache and the forward; the engine keeps everything else (scheduler, sampler,
detokenizer, events). One `llama_context` serves every batch row: its KV cache is one unified pool of cells that
every sequence draws on (`kv_unified`; in deterministic mode a stream per sequence), as large as the scheduler's
block pool, so one request may hold the whole context while others are short; sequence id = batch row. The
scheduler's block tables account for the cells (a request holds at most its blocks' positions), and llama.cpp
places them itself. A step is one `llama_batch` with every row of the round, prompt chunks (their tokens, logits on
the last one only when the chunk ends the prompt) and decode rows (one token each), and one `llama_decode`. The rows'
logits are read where llama.cpp wrote them, as one [rows, vocab] tensor without a copy, and sampled by the worker's
own batched sampler (engine/sampler.py, on the CPU), so sampling behaves exactly as on the torch runtime.

Prefix reuse: the block pool cannot serve as the prefix cache here (llama.cpp places the cells), so the runner keeps
one of its own, as llama-server does per slot, across sequences. It records, for every sequence it holds, the tokens
whose keys and values that sequence holds (positions 0..n-1). A finished request's sequence stays in its batch row
until a new request takes the row, and then moves to the row's "keeper" sequence (id row + max_batch), so that the
last request of each row stays cached. At a prompt's first chunk (`reuse`), the held sequence with the longest common
prefix with the prompt (a batch row's, running or finished, or a keeper's) gives that prefix to the row's sequence
with `llama_memory_seq_cp`, which in a unified cache only tags the source's cells with the row's id: the cells are
shared, nothing is copied, and each sequence's later tokens go to cells of its own. The prompt is then computed from
there on. Where the keeper itself gives the prefix, it stays and what the row held goes; where the row's own sequence
gives it (a conversation's next turn), the row keeps the prefix and the keeper takes the whole. The cells of keepers
and of ended requests' rows lie outside the block pool's accounting, so llama.cpp may find no room for a batch; these
cache entries then go, the least recently used first, one at a time, and the batch is decoded again (llama.cpp leaves
its memory as it was when it finds no room) until it fits. In deterministic mode (a stream per sequence, where a copy
between sequences copies data) and without the prefix cache, nothing is reused.

Every step is computed before it returns: `launch` hands back a finished step and `chains` is always False.
"""

import ctypes
import dataclasses
import logging
from collections.abc import Sequence

import llama_cpp.llama_cpp as native
import psutil
import torch

from rbee_worker.engine.config import EngineConfig
from rbee_worker.engine.rows import RowSampling, kv_budget, kv_pool
from rbee_worker.engine.runner import Capabilities, DecodeRow, Finished, KvGeometry, Launched, PromptRow, Sampled
from rbee_worker.engine.sampling import SamplingParams
from rbee_worker.errors import ModelLoadError
from rbee_worker.models.llama_cpp_model import LlamaCppModel
from rbee_worker.models.loaded import LoadedModel

log = logging.getLogger(__name__)

CPU = torch.device("cpu")
# llama_decode's return codes other than 0 (llama.h); a code below -1 is a fatal error of the context.
DECODE_ERRORS = {
    1: "no room in the KV cache for the batch",
    2: "aborted",
    -1: "invalid input batch (a token id outside the vocabulary, or a position out of order)",
}
MATCH_STRIDE = 64  # tokens compared at once (as list slices) while finding a common prefix


class DecodeFailed(RuntimeError):
    """llama_decode returned an error code."""

    def __init__(self, code: int) -> None:
        super().__init__(f"llama_decode failed with {code}: {DECODE_ERRORS.get(code, 'a fatal error')}")
        self.code = code


class LlamaCppRunner:
    """Runs a LoadedModel of the llama.cpp runtime: the context, the batch, and each batch row's sampling state. Lives
    on the engine thread; `close` frees what llama.cpp holds."""

    capabilities = Capabilities(mixed_batches=True)  # a round's prompt chunks and decode rows go in one llama_batch

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
        # In deterministic mode each sequence has a stream of cells of its own, as long as the context offered: in a
        # unified pool, attention runs over cells that other sequences hold too (masked), and its sums then depend on
        # what else runs.
        unified = not config.deterministic
        if not unified:
            per_row = min(self.kv.context, self.kv.tokens // rows // config.block_size * config.block_size)
            self.kv = dataclasses.replace(self.kv, context=per_row)
        self.threads = config.threads or psutil.cpu_count(logical=False) or 1
        self.capacity = config.prefill_chunk + rows  # the most tokens one step feeds: a round's chunks and decodes
        # Prefix reuse shares cells between sequences of the unified pool (see the module docstring); a recurrent
        # model's state cannot be cut at a position, so it reuses nothing.
        self.reusing = (
            unified
            and config.prefix_caching
            and not native.llama_model_is_recurrent(model.handle)
            and not native.llama_model_is_hybrid(model.handle)
        )
        # A keeper sequence (id row + rows) for as many rows as llama.cpp's sequence ids allow.
        self.keepers = min(rows, native.llama_max_parallel_sequences() - rows) if self.reusing else 0
        params = native.llama_context_default_params()
        params.n_ctx = self.kv.tokens if unified else rows * self.kv.context
        params.n_seq_max = rows + self.keepers
        params.kv_unified = unified
        params.n_batch = params.n_ubatch = self.capacity
        params.n_threads = params.n_threads_batch = self.threads
        params.no_perf = True
        self._context = native.llama_init_from_model(model.handle, params)
        if not self._context or native.llama_n_ctx_seq(self._context) < self.kv.context:
            raise ModelLoadError(
                f"llama.cpp could not create a context of {self.kv.tokens} tokens: lower --kv-cache-gb or "
                "--max-context, or see the llama.cpp messages with --log-level debug"
            )
        self._cells = native.llama_n_ctx(self._context)  # what it allocated: each sequence's cells rounded up
        self._memory = native.llama_get_memory(self._context)
        self._batch = native.llama_batch_init(self.capacity, 0, 1)
        self.sampling = RowSampling(rows, model.vocab_size, CPU)
        self._rows, self._unified = rows, unified
        # Each sequence's tokens at positions 0..n-1 of what llama.cpp holds for it (batch rows and keepers).
        self._held: dict[int, list[int]] = {}
        # The sequences that hold tokens only as a cache, whose cells may go when llama.cpp finds no room for a batch:
        # the keepers, and the rows whose request has ended; the least recently filled or used first.
        self._spare: dict[int, None] = {}
        # The rows that the last step chose a token for. A running request that decodes is in every round's one
        # llama_decode (unified: the scheduler mixes each round's chunks and decode rows in one forward), so a row
        # chosen a token and not fed one in the next step has ended, unless a preemption or a new request took the row
        # in between (`evict`, `reuse`, `assign`).
        self._sampled: set[int] = set()
        # Rows that `reuse` gave a prefix to, for the request about to compute its prompt there: the scheduler asks
        # for it while it plans a round, before the round's `assign` (a new request) or `evict` (a request preempted
        # earlier in the same planning) of that row, which then leave the row's sequence as it is.
        self._given: set[int] = set()
        log.info(
            "llama.cpp runtime: %d threads, %d sequences (and %d keepers) sharing %d cells",
            self.threads,
            rows,
            self.keepers,
            self._cells,
            extra={"fields": {"threads": self.threads, "system": native.llama_print_system_info().decode().strip()}},
        )

    # -- sampling state ------------------------------------------------------------------------------------------

    def assign(
        self, row: int, params: SamplingParams, seed: int, prompt_ids: Sequence[int], logprobs: int | None
    ) -> None:
        """A request takes the batch row: what an earlier holder left in the row's sequence moves to the row's keeper
        (unless `reuse` has given the row this request's prefix already), its sampling state comes."""
        self._take(row)
        if row in self._given:
            self._given.discard(row)
        else:
            self._vacate(row)
        self.sampling.assign(row, params, seed, prompt_ids, logprobs)

    def reuse(self, row: int, token_ids: Sequence[int], limit: int) -> int:
        """The longest prefix of `token_ids[:limit]` that a held sequence (a batch row's, a keeper's) holds, given to
        the row's sequence; what the row held before moves to its keeper, unless the keeper is the one that gives.
        0 when none holds a block's worth, and always in deterministic mode or without the prefix cache."""
        if not self.reusing:
            return 0
        self._take(row)
        if row in self._given:  # a copy that an earlier reuse gave it, which its source holds too
            self._clear(row)
        self._given.add(row)
        found, source = self._longest(row, token_ids[:limit])
        if found < self.kv.block_size:
            self._vacate(row)
            return 0
        if source == row:  # the row holds it already: the rest of it goes to the keeper
            self._vacate(row, keep=found)
            return found
        if source == row + self._rows:  # the keeper gives: what the row held goes
            self._clear(row)
        else:
            self._vacate(row)
        native.llama_memory_seq_cp(self._memory, source, row, 0, found)
        self._held[row] = list(token_ids[:found])
        if source in self._spare:  # a cache entry that gives stays longer
            self._spare[source] = self._spare.pop(source)
        return found

    def evict(self, row: int) -> None:
        """The request in this batch row was preempted: its sequence's cells go back to the pool (unless `reuse`
        has just given it its prefix again); the keepers stay."""
        self._take(row)
        if row in self._given:
            self._given.discard(row)
        else:
            self._clear(row)

    def release(self, row: int) -> None:
        """The request in this batch row has ended: the row's sequence stays, as a cache entry whose cells may go when
        llama.cpp finds no room for a batch."""
        self._sampled.discard(row)
        if self._unified and self._held.get(row):
            self._spare[row] = None

    def _take(self, row: int) -> None:
        """A request holds the row: its sequence is no cache entry."""
        self._sampled.discard(row)
        self._spare.pop(row, None)

    def _longest(self, row: int, wanted: Sequence[int]) -> tuple[int, int]:
        """The held sequence that shares the longest prefix with `wanted`, and how long: (0, -1) when none does. Only a
        sequence that holds every position from 0 counts; on a tie another sequence wins over the row's own (whose
        contents then stay whole in the keeper)."""
        wanted = list(wanted)
        best, source = 0, -1
        for seq, held in sorted(self._held.items(), key=lambda item: item[0] == row):
            found = common_prefix(held, wanted)
            if found > best and native.llama_memory_seq_pos_min(self._memory, seq) == 0:
                best, source = found, seq
        return best, source

    def _vacate(self, row: int, keep: int = 0) -> None:
        """The row's sequence keeps its first `keep` positions; all it holds moves to the row's keeper (replacing the
        keeper's), where the row has one."""
        held = self._held.get(row)
        keeper = row + self._rows
        if held and row < self.keepers:
            self._clear(keeper)
            native.llama_memory_seq_cp(self._memory, row, keeper, -1, -1)
            self._held[keeper] = list(held)
            self._spare[keeper] = None
        if keep:
            native.llama_memory_seq_rm(self._memory, row, keep, -1)
            del self._held[row][keep:]
        else:
            self._clear(row)

    def _clear(self, seq: int) -> None:
        native.llama_memory_seq_rm(self._memory, seq, -1, -1)
        self._held.pop(seq, None)
        self._spare.pop(seq, None)

    # -- steps -------------------------------------------------------------------------------------------------------

    def chains(self, decodes: list[DecodeRow]) -> bool:
        return False

    def launch(self, decodes: list[DecodeRow]) -> Launched:
        return Finished(self.step([], decodes))

    def collect(self, launched: Launched) -> list[Sampled]:
        assert isinstance(launched, Finished)
        return launched.sampled

    def fault(self, error: BaseException) -> str | None:
        """A fatal llama_decode error (a code below -1) leaves the context unusable."""
        if isinstance(error, DecodeFailed) and error.code < -1:
            return f"llama.cpp's context cannot decode: {error}"
        return None

    def kv_bytes(self) -> int:
        """All of it: llama.cpp allocates and clears the whole cache, its cells rounded up, when the context is
        created."""
        return self._cells * self.kv.bytes_per_token

    def memory_bytes(self) -> int:
        return self.loaded.info.weight_bytes + self.kv_bytes()

    def step(self, prompts: list[PromptRow], decodes: list[DecodeRow]) -> list[Sampled]:
        """One llama_decode over prompt chunks and decode rows together; the chosen tokens of the prompt rows that
        sample, then of the decode rows, in order."""
        if sum(len(r.token_ids) for r in prompts) + len(decodes) > self.capacity:
            raise ValueError(f"a step of more than {self.capacity} tokens")
        if not prompts and not decodes:
            return []
        fed = {r.row for r in prompts} | {r.row for r in decodes}
        for row in self._sampled - fed:  # its request has ended (see __init__)
            self.release(row)
        self._sampled = set()
        try:
            sampled_rows = self._feed(prompts, decodes)
        except Exception:  # every request of a failed step ends
            for row in fed:
                self.release(row)
            raise
        self._sampled = set(sampled_rows)
        if not sampled_rows:
            return []
        packed = self.sampling.sample(self._logits(len(sampled_rows)), sampled_rows, [True] * len(sampled_rows))
        return [self.sampling.sampled(out, row) for out, row in zip(packed, sampled_rows, strict=True)]

    def _feed(self, prompts: list[PromptRow], decodes: list[DecodeRow]) -> list[int]:
        """The rows in one llama_decode, each sequence's record of its tokens brought along; the rows that sample."""
        batch, n, sampled_rows = self._batch, 0, []
        for row in prompts:
            self._given.discard(row.row)
            self._cut(row.row, row.start)
            last = len(row.token_ids) - 1
            for i, token in enumerate(row.token_ids):
                self._put(n, token, row.start + i, row.row, row.sample and i == last)
                n += 1
            if row.sample:
                sampled_rows.append(row.row)
        for row in decodes:
            self._put(n, row.token, row.position, row.row, True)
            n += 1
            sampled_rows.append(row.row)
        batch.n_tokens = n
        if n == 0:
            return []
        self._decode()
        for row in prompts:
            self._held.setdefault(row.row, []).extend(row.token_ids)
        for row in decodes:
            held = self._held.setdefault(row.row, [])
            del held[row.position :]
            held.append(row.token)
        return sampled_rows

    def _cut(self, row: int, start: int) -> None:
        """The row's sequence before a prompt chunk at `start`: whatever it holds from `start` on goes (a reuse that
        the scheduler could not back with blocks, a preempted request reading its tokens again from 0)."""
        cut = native.llama_memory_seq_pos_max(self._memory, row) >= start
        if cut and not native.llama_memory_seq_rm(self._memory, row, start, -1):
            raise RuntimeError(f"llama.cpp cannot drop positions {start}.. of sequence {row}")
        held = self._held.get(row)
        if held is not None:
            del held[start:]

    def _decode(self) -> None:
        """llama_decode over the batch. Where it finds no room for the batch (cache entries hold cells that the block
        pool does not account for), llama.cpp leaves its memory as it was: the least recently used cache entry goes
        and the batch is decoded again, until it fits or none is left."""
        while (code := native.llama_decode(self._context, self._batch)) == 1 and self._spare:
            spare = next(iter(self._spare))
            log.debug("no room in llama.cpp's KV cache: dropping the cached sequence %d", spare)
            self._clear(spare)
        if code != 0:
            raise DecodeFailed(code)

    def _put(self, index: int, token: int, position: int, row: int, logits: bool) -> None:
        batch = self._batch
        batch.token[index] = token
        batch.pos[index] = position
        batch.n_seq_id[index] = 1
        batch.seq_id[index][0] = row
        batch.logits[index] = logits

    def _logits(self, rows: int) -> torch.Tensor:
        """The last llama_decode's output rows, in batch order, as a [rows, vocab] float32 view of llama.cpp's buffer
        (valid until the next llama_decode)."""
        vocab = self.model.vocab_size
        address = ctypes.cast(native.llama_get_logits(self._context), ctypes.c_void_p).value
        buffer = (ctypes.c_float * (rows * vocab)).from_address(address)
        return torch.frombuffer(buffer, dtype=torch.float32).view(rows, vocab)

    def close(self) -> None:
        """Free the batch, the context and the model (the engine thread is done with them)."""
        if self._context:
            native.llama_batch_free(self._batch)
            native.llama_free(self._context)
            self._context = None
        self.model.close()


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many first tokens `a` and `b` share: whole MATCH_STRIDE-long slices first, then token by token."""
    end, n = min(len(a), len(b)), 0
    while n + MATCH_STRIDE <= end and a[n : n + MATCH_STRIDE] == b[n : n + MATCH_STRIDE]:
        n += MATCH_STRIDE
    while n < end and a[n] == b[n]:
        n += 1
    return n
