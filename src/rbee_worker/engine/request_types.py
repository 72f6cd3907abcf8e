"""What crosses the engine boundary: a request in, a stream of events out. Plain frozen dataclasses only."""

import uuid
from dataclasses import dataclass, field
from enum import StrEnum

from rbee_worker.chat.reasoning import ReasoningFormat
from rbee_worker.engine.sampling.sampling_params import SamplingParams
from rbee_worker.engine.structured.grammar import CompiledGrammar


class StopReason(StrEnum):
    EOS = "EOS"
    MAX_TOKENS = "MAX_TOKENS"
    STOP_SEQUENCE = "STOP_SEQUENCE"
    CANCELLED = "CANCELLED"


class ErrorCode(StrEnum):
    INVALID_REQUEST = "INVALID_REQUEST"
    VRAM_OOM = "VRAM_OOM"
    CANCELLED = "CANCELLED"
    TIMEOUT = "TIMEOUT"
    INFERENCE_FAILED = "INFERENCE_FAILED"
    INTERNAL_ERROR = "INTERNAL_ERROR"  # a bug of the worker's host code, not of the model or the device


@dataclass(frozen=True)
class Request:
    """One generation. `prompt_ids` is the tokenized prompt (see ServedModel.tokenize); text never enters the core."""

    prompt_ids: tuple[int, ...]
    max_tokens: int = 2048  # 0: the prompt is computed (for its prompt_logprobs) and nothing is generated
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None  # None: a random seed, reported in End
    stop: tuple[str, ...] = ()
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    correlation_id: str | None = None  # the caller's trace id, carried into the request's log line
    logprobs: int | None = None  # None: none; k: each generated token's log-probability and the k most likely
    # None: none; k: the log-probability of each prompt token after the first (PromptLogprobs) and the k most likely
    prompt_logprobs: int | None = None
    # The prompt's embedding (Embedding, pooled as the model's config says) instead of generated text (max_tokens 0).
    embed: bool = False
    ignore_eos: bool = False  # generate max_tokens whatever the model says (benchmarks)
    grammar: CompiledGrammar | None = None  # structured output: the tokens follow it (engine/structured/grammar.py)
    # A reasoning model's chat request (ServedModel.reasoning): its grammar applies only after the reasoning.
    reasoning: ReasoningFormat | None = None


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probabilities from the model's distribution for one position (before temperature and penalties)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the most likely (token id, logprob) pairs, most likely first
    rank: int | None = None  # 1 + the tokens more likely than this one, where computed (a prompt token's)


@dataclass(frozen=True)
class Started:
    request_id: str
    prompt_tokens: int
    seed: int


@dataclass(frozen=True)
class PromptLogprobs:
    """The log-probability of each prompt token after the first, given the tokens before it (the first has none),
    sent once the prompt is computed, before the first Token."""

    request_id: str
    logprobs: tuple[TokenLogprob, ...]


@dataclass(frozen=True)
class Embedding:
    """The prompt's hidden states pooled into one vector (LoadedModel.pooling: mean, last or first token), not
    normalized; sent once the prompt is computed."""

    request_id: str
    values: tuple[float, ...]


@dataclass(frozen=True)
class Token:
    """A piece of generated text and the token ids generated since the previous piece.

    `text` can be empty while a multi-byte character or a possible stop string is incomplete; `token_ids` is empty
    for the text released when the request ends. Concatenating every `text` gives exactly the generated text.
    """

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    index: int
    logprobs: tuple[TokenLogprob, ...] = ()  # one per id of token_ids, when the request asked for them


@dataclass(frozen=True)
class End:
    request_id: str
    stop_reason: StopReason
    prompt_tokens: int
    cached_tokens: int  # prompt tokens found in the prefix cache, whose keys and values were not computed again
    tokens_out: int  # generated token ids, the EOS token excluded
    seed: int
    stop_sequence: str | None
    time_to_first_token_s: float
    decode_time_s: float
    kv_cache_bytes: int  # measured size of this request's KV cache when it ended


@dataclass(frozen=True)
class Error:
    request_id: str
    code: ErrorCode
    message: str


Event = Started | PromptLogprobs | Embedding | Token | End | Error
