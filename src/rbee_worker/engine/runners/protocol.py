"""The Runner protocol: what the executor (engine/executor.py) asks of whatever runs the model, and nothing more.

A runner owns the model, its KV cache and each batch row's sampling state. It takes rows (a request's batch row, its
block table, the tokens to feed and their positions) and gives back, for each row that samples, the chosen token:
on the torch runtime (engine/runners/torch/torch_runner.py, CUDA graphs and compiled layers), on llama.cpp's
(engine/runners/llama_cpp/llama_cpp_runner.py), and for an encoder's embeddings
(engine/runners/torch/encoder_runner.py); core.py's make_runner picks one. How a runner computes a step is its own
affair; what differs between runners that the step loop must know is data: `Capabilities`, `KvGeometry`, and whether a
launched step's tokens are ready (`Launched.ready`). This module imports none of them.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import numpy as np

from rbee_worker.engine.request_types import TokenLogprob
from rbee_worker.engine.sampling.sampling_params import SamplingParams
from rbee_worker.engine.structured.grammar import Matcher
from rbee_worker.loading.loaded import LoadedModel


@dataclass(frozen=True)
class PromptRow:
    """Prompt tokens fed at positions start.. of the request in batch row `row` (its sampling state; on llama.cpp its
    sequence), whose position p lives in KV block `blocks[p // block_size]`; `sample`: the chunk ends the prompt, so
    a token follows. `window_blocks`: the sliding layers' blocks, where their pool is a window's (KvGeometry.window;
    the scratch block for positions before the request's window). `targets`: the prompt's tokens after the chunk's
    first len(targets) positions, whose log-probabilities there (and the `target_top` most likely tokens) the step
    gives back (Stepped.scored). `pool`: what the step gives back of the chunk's hidden states (the decoder's last,
    normalized as the model normalizes them), for an embedding: "mean" their sum, "last" its last position's, "cls"
    its first position's (where the chunk starts the prompt)."""

    row: int
    blocks: Sequence[int]
    token_ids: Sequence[int]
    start: int
    sample: bool
    window_blocks: Sequence[int] = ()
    targets: Sequence[int] = ()
    target_top: int = 0
    pool: str | None = None


@dataclass(frozen=True)
class DecodeRow:
    """One decode row: `tokens` fed at positions `position`.. of the request in batch row `row`, with its block table;
    the step samples after each of them (a row of several tokens: its last output, then tokens proposed to follow it,
    verified at once; only where `Capabilities.row_tokens` allows). `chained`: take instead of the first token the one
    that the step launched before this one chose for this row, on the device (only where `Runner.chains` allows it);
    `window_blocks` as PromptRow's."""

    row: int
    blocks: Sequence[int]
    tokens: Sequence[int]
    position: int
    chained: bool = False
    window_blocks: Sequence[int] = ()


@dataclass(frozen=True)
class Sampled:
    """A row's outcome, on the host: the tokens accepted for it (one for a prompt's first token and a row of one
    token; of a row of several, those its proposals agree with, then the model's own next one), and the
    log-probability of each where the request asked for them."""

    tokens: tuple[int, ...]
    valid: bool  # False: the logits gave no valid distribution (NaN, +inf, or every token masked)
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Stepped:
    """A forward's outcome: the tokens of the prompt rows that sample, then of the decode rows, in order; for each
    prompt row, its targets' log-probabilities (PromptRow.targets; empty where it has none); where a prompt row
    pools, one float32 vector for each prompt row (PromptRow.pool; None where it does not pool)."""

    sampled: list[Sampled]
    scored: list[tuple[TokenLogprob, ...]]
    pooled: list[np.ndarray | None] = field(default_factory=list)


@dataclass(frozen=True)
class Capabilities:
    """What a runner can do beyond one eager forward at a time, as the scheduler and the step loop plan with it."""

    mixed_batches: bool  # prompt chunks and decode rows in one forward (else: a forward for each kind)
    # The fewest rows of a forward from which each row's results no longer depend on how many rows it holds (its
    # kernels pick another product below); prompt chunks and cache hits keep to it (scheduler.py).
    uniform_rows: int = 1
    # A prompt runs in one forward, whole (an encoder's attention reads every position of it): never in chunks.
    whole_prompts: bool = False
    # The most tokens a decode row may carry (DecodeRow.tokens): 1 + the proposals a step verifies.
    row_tokens: int = 1


@dataclass(frozen=True)
class KvGeometry:
    """The KV cache as the scheduler accounts for it: a pool of `blocks` blocks (block 0 the scratch block) of
    `block_size` positions, `bytes_per_token` each; one request holds up to `context` tokens (prompt and output).
    `shared_blocks`: whether a block may back several requests at once (the prefix cache); a runtime whose memory
    does not follow the block tables (llama.cpp) uses them for accounting only.

    Sliding layers (`window`: the positions a sliding layer's query sees, itself included) may keep their keys and
    values in a pool of their own, `window_blocks` blocks of `window_bytes_per_token` each (their layers' share of a
    token; `bytes_per_token` is then the other layers'), in which a request holds the blocks of its last `window`
    positions only (vLLM's hybrid KV cache manager): `window_blocks` 0 means every layer's keys and values are in the
    main pool."""

    blocks: int
    block_size: int
    context: int
    bytes_per_token: int
    shared_blocks: bool = True
    window: int | None = None
    window_blocks: int = 0
    window_bytes_per_token: int = 0

    @property
    def tokens(self) -> int:
        """Token positions in the pool, the scratch block excluded."""
        return (self.blocks - 1) * self.block_size

    @property
    def bytes(self) -> int:
        """The whole pool's size, the sliding layers' pool included."""
        return self.block_size * (self.blocks * self.bytes_per_token + self.window_blocks * self.window_bytes_per_token)

    def request_bytes(self, tokens: int) -> int:
        """The keys and values of a request holding `tokens` positions (its sliding layers' at most a window's)."""
        window = min(tokens, self.window or 0) if self.window_blocks else 0
        return tokens * self.bytes_per_token + window * self.window_bytes_per_token


class Launched(Protocol):
    """A decode step handed to the runner; `Runner.collect` gives its tokens."""

    @property
    def ready(self) -> bool:
        """Whether its tokens are on the host already (an eager step), so that collecting it does not wait."""


@dataclass(frozen=True)
class Finished:
    """A step computed before `launch` returned (every runner without asynchronous steps)."""

    sampled: list[Sampled]
    ready: ClassVar[bool] = True


class DeviceFault(RuntimeError):
    """The device (or the runtime's context) is unusable: every later step would fail too. The worker stops."""


@dataclass(frozen=True)
class PrefixHit:
    """The first `token_ids` of a prompt, which the runtime holds already: in a saved state (`key`, a PromptCache
    entry's) or in another batch row's sequence (`source`); the first `exact` of them exact."""

    token_ids: tuple[int, ...]
    exact: int
    key: tuple[int, ...] | None = None
    source: int | None = None


class RuntimePrefixes(Protocol):
    """What a runtime whose KV memory the block pool does not describe holds (Runner.prefixes), for the scheduler to
    plan prompts with; reading it changes nothing (the plan restores a hit: Runner.restore)."""

    def find(self, row: int, token_ids: Sequence[int], limit: int) -> PrefixHit | None:
        """The longest prefix of `token_ids[:limit]` that the runtime holds for batch row `row`; None if too short."""
        ...


class Runner(Protocol):
    """Runs one model for the engine thread (every call comes from that thread)."""

    loaded: LoadedModel
    capabilities: Capabilities
    kv: KvGeometry
    vocab_size: int  # the logits' width: the model's vocabulary, padding included
    # What the runtime holds of prompts, for the scheduler's lookups, where its memory does not follow the block
    # tables (llama.cpp's saved states and sequences; KvGeometry.shared_blocks False); None where the pool is the cache.
    prefixes: RuntimePrefixes | None

    def assign(
        self, row: int, params: SamplingParams, seed: int, prompt_ids: Sequence[int], logprobs: int | None
    ) -> None:
        """A request takes the batch row: its sampling state comes (what an earlier holder left goes)."""

    def masks(self, rows: Sequence[tuple[int, Matcher]]) -> None:
        """The request in each of these batch rows draws its next token among those its grammar allows now (each
        matcher fills its row's mask); until the row's next mask, or its next `assign`."""

    def restore(self, row: int, hit: PrefixHit) -> bool:
        """For a runtime whose memory does not follow the block tables (`prefixes` set): the prefix that `prefixes`
        found, now given to batch row `row`'s sequence, so that its prompt is computed from there on; False where the
        runtime could not (the sequence then holds nothing)."""

    def evict(self, row: int) -> None:
        """The request in this batch row was preempted: the scheduler took its blocks back, and whatever the runtime
        keeps for it beyond them goes (it reads its tokens again from position 0 later)."""

    def release(self, row: int) -> None:
        """The request in this batch row has ended: whatever the runtime keeps for it
        beyond its blocks goes, or into the runtime's own prefix cache."""

    def step(self, prompts: list[PromptRow], decodes: list[DecodeRow]) -> Stepped:
        """One forward, computed before it returns (prompt chunks and decode rows together only where
        `capabilities.mixed_batches`)."""

    def chains(self, decodes: list[DecodeRow]) -> bool:
        """Whether a decode step over these rows may be launched while the step launched before it is not collected
        yet, its `chained` rows reading that step's tokens on the device. False: collect the earlier step first."""

    def launch(self, decodes: list[DecodeRow], hold_sampling: bool = False) -> Launched:
        """Start a decode step over these rows (computed at once by a runner without asynchronous steps). With
        `hold_sampling` (only for rows that `chains` allowed), the forward starts now and the sampler waits for
        `sample_held`: in between the host takes the previous step's tokens and fills the masks that chained
        constrained rows draw under, while the device runs the forward."""

    def sample_held(self, launched: Launched) -> None:
        """Start the sampler of a step launched with `hold_sampling`, under the masks set since."""

    def collect(self, launched: Launched) -> list[Sampled]:
        """The launched step's tokens, in the order of its rows (waits for the device where needed)."""

    def fault(self, error: BaseException) -> str | None:
        """After a step raised `error`: why the device is unusable from now on, or None when only that step failed."""

    def kv_bytes(self) -> int:
        """Bytes of KV cache in memory now."""

    def memory_bytes(self) -> int:
        """Device memory the model holds now: the weights and the KV cache, measured."""

    def prompt_cache_bytes(self) -> int:
        """Host memory the runtime's own prompt cache holds now (saved sequence states; 0 where the block pool is the
        cache)."""

    def close(self) -> None:
        """Free what the runner holds that Python's collector does not."""
