"""Token sampling where the logits are (CPU, CUDA, MPS), for all rows of a step at once.

The semantics are those of `sampling_params.py` (Hugging Face's order: penalties, greedy shortcut, temperature, top-k,
top-p, min-p, draw; see its docstring). Everything here is tensor operations of static shape that never wait for the
host: no `.item()`, no data-dependent shape, no Python branch on a tensor's value. So `sample` can be captured in a CUDA
graph with the model's forward, and a step's chosen tokens can feed the next step on the device. Which stages run is
static (SamplerFeatures: a graph per value); each row's parameters and state live in device tensors (SamplerState).

A row, all on the device:

1. Logits mask (structured output): disallowed tokens -> -inf. Logit bias and penalties on the logits. Greedy rows
   take the argmax (torch.max: the first maximum, i.e. the lowest id).
2. s = (x - max) / T <= 0, as sampling_params.py computes it; e = exp(s), 1 for the top token; integer weights
   w = floor(e * 2**40) (int64). Integer sums are exact in any order, so a row's draw depends neither on the batch
   around it nor on the device's reduction order. A token with e < 2**-40 (a probability below 1e-12 of the top
   token's) has weight 0 and is never drawn.
3. Top-k, then top-p over its survivors (TopKLogitsWarper's and TopPLogitsWarper's rules, ties of the
   temperature-scaled logits): exactly, in integers, by selection.py's radix select; on CUDA, the same select and
   draw as Triton kernels that keep no [rows, vocab] intermediates (sampler_triton.py); on a CPU, row by row in
   numpy from candidate sets where the cut provably falls inside them (the same tokens, without passes over the
   whole row).
4. Min-p: keep e >= min_p (e is the probability relative to the top token's).
5. Draw: target = floor(u * total kept weight) for the row's uniform u = k / 2**53 (`_draw_bits`), and the first token
   in id order whose cumulative kept weight exceeds it: inverse CDF, found without a scan of the whole row
   (selection.search).
"""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import numpy as np
import torch

from rbee_worker.engine.sampling.sampling_params import MAX_LOGIT_BIAS, SamplingParams
from rbee_worker.engine.sampling.selection import (
    FRACTION_BITS,
    block_sums,
    candidate_draw,
    inverse_cdf,
    keys_of,
    radix_top_k_top_p,
    scale_by,
    search,
)

MAX_TOP_LOGPROBS = 20  # the most alternatives a request may ask for (OpenAI's limit)
# pack's row layout: token, valid, logprob, then (id, logprob) of the MAX_TOP_LOGPROBS most likely tokens.
PACKED_WIDTH = 3 + 2 * MAX_TOP_LOGPROBS
MAX_VOCAB = 2**19  # keeps sums of weights below 2**59 (scale_by) and token ids exact in pack's float32
_WEIGHT_ONE = 2.0**40  # the top token's weight
# exp's argument is clamped here: below, the weight is 0 anyway (exp(-64) * 2**40 < 1e-15), and denormal results
# would slow a CPU's exp and the products after it many times over.
_EXP_FLOOR = -64.0
# candidate_draw's floors on the scaled logits, tried in turn until one covers the row's cut: the first holds a chat's
# nucleus (top_p 0.9) in nearly every row, the second top_k 50 in most, the third nearly every token of nonzero weight;
# the rows no floor covers are drawn by the radix select.
_CANDIDATE_FLOORS = (-8.0, -16.0, -24.0)
_WEIGHTLESS = -28.0  # a scaled logit below this has weight 0: exp(-28) * 2**40 < 0.8 (_draw_on_host)
_IN_PROMPT = 1 << 30  # SamplerState.counts: this bit marks a prompt token, the bits below count generated ones
_FLOAT32 = torch.finfo(torch.float32)
# SplitMix64 (Steele, Lea, Flood 2014), as signed 64-bit constants: torch's int64 multiplication wraps.
_GAMMA = 0x9E3779B97F4A7C15 - 2**64
_MIX_1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX_2 = 0x94D049BB133111EB - 2**64
_MASK_64 = 2**64 - 1
Int64s = TypeVar("Int64s", torch.Tensor, np.ndarray)  # SplitMix64's operands: int64 tensors or numpy arrays


def check_seed(seed: int) -> int:
    """The seed, if the API accepts it (0..2**64-1; every bit counts)."""
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed must be in 0..2**64-1, got {seed}")
    return seed


@dataclass(frozen=True)
class SamplerFeatures:
    """Which stages a step runs: static and hashable, as a CUDA graph is captured per value. Temperature and min-p
    are cheap elementwise operations, part of every sampled step."""

    sampling: bool = False  # some row draws at random (temperature >= GREEDY_BELOW); off: every row is greedy
    penalties: bool = False  # some row has a logit bias or a repetition, presence or frequency penalty
    filters: bool = False  # some sampled row has top_p < 1 or top_k (implies `sampling`): the top-p stage
    top_k: bool = False  # some sampled row has top_k (implies `filters`): the top-k stage before top-p
    masks: bool = False  # some row has a logits mask (SamplerState.set_mask)
    top_logprobs: int = -1  # -1: no logprobs; n >= 0: the chosen token's logprob and the n most likely, every row

    def __post_init__(self) -> None:
        if not -1 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in -1..{MAX_TOP_LOGPROBS}, got {self.top_logprobs}")
        # One value per set of stages that run, so that equal steps share a graph.
        object.__setattr__(self, "filters", self.filters or self.top_k)
        object.__setattr__(self, "sampling", self.sampling or self.filters)

    @property
    def plain(self) -> bool:
        """No mask, penalty or logprobs: a CPU's step runs wholly in numpy (`plain_on_host`)."""
        return not (self.masks or self.penalties) and self.top_logprobs < 0

    @staticmethod
    def of(requests: Iterable[tuple[SamplingParams, int | None]], masks: bool = False) -> "SamplerFeatures":
        """What a step over these (params, top-logprobs request) needs; `masks`: whether any row has a mask."""
        sampling = penalties = filters = top_k = False
        top_logprobs = -1
        for params, logprobs in requests:
            sampled = not params.is_greedy()
            sampling |= sampled
            filters |= sampled and params.top_p < 1.0
            top_k |= sampled and params.top_k > 0
            penalties |= (
                params.repetition_penalty != 1.0
                or params.presence_penalty != 0.0
                or params.frequency_penalty != 0.0
                or bool(params.logit_bias)
            )
            if logprobs is not None:
                top_logprobs = max(top_logprobs, logprobs)
        return SamplerFeatures(sampling, penalties, filters, top_k, masks, top_logprobs)


class HostViews(NamedTuple):
    """numpy views of a CPU SamplerState's per-slot tensors that the host's draw reads and advances: a lookup each,
    where `Tensor.numpy` is a tensor call that costs microseconds right after a forward."""

    greedy: np.ndarray
    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    stream: np.ndarray
    counter: np.ndarray


class SamplerState:
    """Per-slot sampling state in device tensors: the parameters, the 64-bit seed and draw counter, the logit bias,
    the token counts for the penalties, and the logits mask. `sample` reads the rows of its slots and advances the
    live ones. All of it is allocated here, once (a CUDA graph reads fixed addresses): about 4.1 bytes per slot and
    vocabulary entry, and 12 KiB per slot for the bias."""

    def __init__(self, slots: int, vocab_size: int, device: torch.device | str) -> None:
        if not 0 < vocab_size <= MAX_VOCAB:
            raise ValueError(f"vocab_size must be in 1..{MAX_VOCAB}, got {vocab_size}")
        self.slots, self.vocab_size, self.device = slots, vocab_size, torch.device(device)

        def zeros(dtype: torch.dtype, *size: int) -> torch.Tensor:
            return torch.zeros(slots, *size, dtype=dtype, device=self.device)

        self.greedy = zeros(torch.bool)
        self.temperature = zeros(torch.float32)  # 1 for greedy rows, whose sampled path is computed and discarded
        self.top_k = zeros(torch.long)  # vocab_size when off
        self.top_p = zeros(torch.long)  # top_p * 2**53, rounded
        self.min_p = zeros(torch.float32)
        self.repetition = zeros(torch.float32)
        self.presence = zeros(torch.float32)
        self.frequency = zeros(torch.float32)
        self.stream = zeros(torch.long)  # from the 64-bit seed: _stream(seed), see `_draw_bits`
        self.counter = zeros(torch.long)  # the slot's draws so far
        # The logit bias, (id, bias) pairs padded with (0, 0.0), which adds nothing.
        self.bias_ids = zeros(torch.long, MAX_LOGIT_BIAS)
        self.bias = zeros(torch.float32, MAX_LOGIT_BIAS)
        # Generated-token counts per (slot, token), plus _IN_PROMPT for the prompt's tokens (repetition penalty).
        self.counts = zeros(torch.int32, vocab_size)
        # Allowed tokens, a bit each: word j's bit b is token 32 * j + b. All ones: no mask.
        self.allowed = torch.full((slots, (vocab_size + 31) // 32), -1, dtype=torch.int32, device=self.device)
        self._bits = torch.arange(32, dtype=torch.int32, device=self.device)
        self.host: HostViews | None = None
        if self.device.type == "cpu":
            tensors = self.greedy, self.temperature, self.top_k, self.top_p, self.min_p, self.stream, self.counter
            self.host = HostViews(*(t.numpy() for t in tensors))

    def assign(self, slot: int, params: SamplingParams, seed: int, prompt_ids: Sequence[int]) -> None:
        """A new request takes the slot: its parameters and seed, no draws or generated tokens yet, its prompt ids
        marked for the repetition penalty (prompt ids past the vocabulary are ignored, as transformers does), no
        mask."""
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot must be in 0..{self.slots - 1}, got {slot}")
        check_seed(seed)
        greedy = params.is_greedy()
        self.greedy[slot] = greedy
        self.temperature[slot] = 1.0 if greedy else params.temperature
        self.top_k[slot] = params.top_k if 0 < params.top_k < self.vocab_size else self.vocab_size
        self.top_p[slot] = round(params.top_p * 2**FRACTION_BITS)
        self.min_p[slot] = params.min_p
        # A penalty below float32's smallest normal number would be 0 there, and 0 / 0 is NaN.
        self.repetition[slot] = max(params.repetition_penalty, _FLOAT32.tiny)
        self.presence[slot] = params.presence_penalty
        self.frequency[slot] = params.frequency_penalty
        self.stream[slot] = _stream(torch.tensor(seed - 2**64 if seed >= 2**63 else seed))
        self.counter[slot] = 0
        self.bias_ids[slot] = 0
        self.bias[slot] = 0.0
        if params.logit_bias:
            ids, biases = zip(*params.logit_bias, strict=True)
            if max(ids) >= self.vocab_size:
                raise ValueError(f"logit_bias token ids must be below the vocabulary's {self.vocab_size}")
            self.bias_ids[slot, : len(ids)] = torch.tensor(ids)
            self.bias[slot, : len(ids)] = torch.tensor(biases)
        self.counts[slot] = 0
        if params.repetition_penalty != 1.0:
            ids = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(-1)
            if ids.numel() and int(ids.min()) < 0:
                raise ValueError("token ids must be >= 0")
            self.counts[slot, ids[ids < self.vocab_size].to(self.device)] = _IN_PROMPT
        self.allowed[slot] = -1

    def set_mask(self, slot: int, allowed: torch.Tensor | None) -> None:
        """The tokens the slot may draw from its next draw on, until replaced: a packed bitmask (int32 words,
        ceil(vocab / 32), bit b of word j for token 32 * j + b, the layout of xgrammar's token bitmask); None allows
        every token. Steps that should honour masks need `SamplerFeatures.masks`. A mask in pinned host memory goes to
        a GPU without the host waiting for the copy: it must stay unchanged until a step has read it."""
        if allowed is None:
            self.allowed[slot] = -1
        else:
            self._copy_masks(slot, allowed.unsqueeze(0))

    def set_masks(self, slots: Sequence[int], bitmask: torch.Tensor) -> None:
        """set_mask for several slots, each with its own row of `bitmask` (host, [slots, words]), in one copy for each
        run of consecutive slots: a step's constrained rows are mostly one run (the live rows are compacted), and a
        copy of many rows costs about what one of a row does."""
        ordered = sorted(slots)
        start = 0
        for i, slot in enumerate(ordered):
            if i + 1 == len(ordered) or ordered[i + 1] != slot + 1:
                first, end = ordered[start], slot + 1
                self._copy_masks(first, bitmask[first:end])
                start = i + 1

    def _copy_masks(self, first: int, masks: torch.Tensor) -> None:
        """Masks ([n, words]) into the n slots from `first` on (see set_mask)."""
        if masks.dtype != torch.int32 or masks.shape[1:] != self.allowed.shape[1:]:
            shape = tuple(self.allowed.shape[1:])
            raise ValueError(f"a mask is int32 of shape {shape}, got {masks.dtype} {tuple(masks.shape[1:])}")
        self.allowed[first : first + len(masks)].copy_(masks, non_blocking=self.device.type == "cuda")


@dataclass
class SampleOutput:
    """What `sample` gives, on the logits' device (`pack` makes it one tensor for the host)."""

    tokens: torch.Tensor  # [rows] int64, the chosen ids
    valid: torch.Tensor  # [rows] bool: False when the row's logits give no distribution (NaN, +inf, all -inf)
    logprob: torch.Tensor | None  # [rows] float32: the chosen token's log_softmax of the raw logits (vLLM's default)
    top_ids: torch.Tensor | None  # [rows, n] int64, most likely first
    top_logprobs: torch.Tensor | None  # [rows, n] float32


def sample(
    logits: torch.Tensor,
    state: SamplerState,
    slots: torch.Tensor,
    live: torch.Tensor,
    features: SamplerFeatures,
    on_host: bool = False,
) -> SampleOutput:
    """One token per row. `logits`: [rows, vocab], any float dtype; `slots`: [rows] int64, each row's slot in `state`;
    `live`: [rows] bool, the rows that really decode. Each live row with valid logits advances its slot: the draw
    counter, and with `features.penalties` the chosen token's count, so that a chained step sees them. Padding rows
    read their slot's state but leave it untouched. `on_host`: the tensors are in the host's memory (a CPU) and the
    caller allows the host to look at them, which draws row by row in numpy (_draw_on_host), and a plain step runs
    wholly in numpy (plain_on_host); the tokens are the same."""
    if on_host and features.plain:
        x = (logits if logits.dtype == torch.float32 else logits.float()).numpy()
        tokens, valid = plain_on_host(x, state, slots.tolist(), live.tolist(), features)
        return SampleOutput(torch.from_numpy(tokens), torch.from_numpy(valid), None, None, None)
    x, top, best, valid = _scores(logits, state, slots, features)
    tokens = best
    if features.sampling:
        if on_host:
            rows = (x if x.dtype == torch.float32 else x.float()).numpy()
            drawn = torch.from_numpy(_draw_on_host(rows, top.numpy(), valid.numpy(), state, slots.tolist(), features))
        else:
            bits = _draw_bits(state.stream[slots], state.counter[slots])[:, None]
            if x.is_cuda:
                from rbee_worker.kernels import sampler_triton  # Triton: not on CPU-only machines

                drawn = sampler_triton.draw(
                    x, top, state.temperature[slots], state.top_k[slots] if features.top_k else None,
                    state.top_p[slots] if features.filters else None, state.min_p[slots], bits.squeeze(1),
                )  # fmt: skip
            else:
                drawn = _draw(_kept_weights(x, top, state, slots, features), bits)
        tokens = torch.where(state.greedy[slots], best, drawn)
    advance = live & valid
    state.counter.scatter_add_(0, slots, advance.long())
    if features.penalties:
        state.counts.view(-1).scatter_add_(0, slots * state.vocab_size + tokens, advance.int())
    if features.top_logprobs < 0:
        return SampleOutput(tokens, valid, None, None, None)
    raw = logits.float()
    normalizer = torch.logsumexp(raw, 1, keepdim=True)
    top_values, top_ids = raw.topk(features.top_logprobs, 1)
    logprob = (raw.gather(1, tokens[:, None]) - normalizer).squeeze(1)
    return SampleOutput(tokens, valid, logprob, top_ids, top_values - normalizer)


def plain_on_host(
    x: np.ndarray, state: SamplerState, slots: list[int], live: list[bool], features: SamplerFeatures
) -> tuple[np.ndarray, np.ndarray]:
    """`sample` of a plain step (`features.plain`) over a CPU's float32 logits [rows, vocab], in numpy: the tokens and
    which rows are valid. Each row's maximum and its first index (a NaN counting as the maximum, as in _maxima), the
    row valid where that maximum is finite (as _scores decides it), the sampled rows drawn by _draw_on_host, the live
    valid rows' draw counters advanced. A handful of numpy operations on lists and cached views (state.host) instead of
    a dozen tensor operations, each of which costs microseconds right after a forward."""
    host = state.host
    assert host is not None, "plain_on_host needs a CPU's SamplerState"
    best = x.argmax(1)
    top = x[np.arange(len(x)), best]
    valid = np.isfinite(top)
    tokens = best
    if features.sampling:
        tokens = np.where(host.greedy[slots], best, _draw_on_host(x, top, valid, state, slots, features))
    np.add.at(host.counter, slots, np.logical_and(live, valid))
    return tokens, valid


def _draw(weights: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: the first token in id order whose cumulative weight exceeds floor(u * total), u = bits / 2**53."""
    sums = block_sums(weights)
    drawn, _ = search(weights, sums, scale_by(bits, sums.sum(1, keepdim=True)))
    return drawn.squeeze(1)


def _draw_on_host(
    rows: np.ndarray,
    top: np.ndarray,
    valid: np.ndarray,
    state: SamplerState,
    slots: list[int],
    features: SamplerFeatures,
) -> np.ndarray:
    """The tokens `_draw(_kept_weights(...))` gives, drawn row by row on the host over a CPU's float32 logits `rows`
    (their maxima `top`, which are `valid`) and the state's numpy views (state.host). Only a row's weighted tokens are
    computed: one pass over its logits finds the tokens whose scaled logit may reach _WEIGHTLESS (every other token's
    weight is 0), and their scaled logits, exp and weights are computed as `_kept_weights` computes them, element by
    element the same operations (torch's exp; IEEE float32 arithmetic for the rest) and so the same values. Rows with
    top-k or top-p draw from their candidates (selection.candidate_draw, each floor in turn), the radix select over the
    whole row for the rows no floor covers; other rows by the inverse CDF over their weighted tokens. Greedy and
    invalid rows get 0 (`sample` takes the argmax for greedy rows). A step's few rows are read as Python numbers and
    their uniform numbers computed in Python integers: right after a forward that swept the caches, each tensor or
    numpy operation costs several microseconds whatever its size."""
    host = state.host
    assert host is not None, "_draw_on_host needs a CPU's SamplerState"
    greedy, temperature, min_p, top_k, top_p, stream, counter = (
        host.greedy, host.temperature, host.min_p, host.top_k, host.top_p, host.stream, host.counter,
    )  # fmt: skip
    tops, valid_rows = top.tolist(), valid.tolist()
    tokens, left, left_bits = np.zeros(len(rows), dtype=np.int64), [], []
    for i, slot in enumerate(slots):
        if not valid_rows[i] or greedy[slot]:
            continue
        bits = _draw_bits_of(int(stream[slot]), int(counter[slot]))
        t, k, p, m = temperature[slot], int(top_k[slot]), int(top_p[slot]), float(min_p[slot])
        row = rows[i]
        # A loose bound: every token outside has a scaled logit below _WEIGHTLESS after float32 rounding.
        ids = np.flatnonzero(row >= tops[i] + (_WEIGHTLESS - 0.5) * float(t))
        scaled = row[ids]  # a copy: computed in place
        np.divide(np.subtract(scaled, np.float32(tops[i]), out=scaled), t, out=scaled)
        # No clamp to _EXP_FLOOR as in _kept_weights: every scaled logit here is above _WEIGHTLESS - 1.
        relative = torch.from_numpy(scaled).exp().numpy()
        weights = (relative * _WEIGHT_ONE).astype(np.int64)
        if k == state.vocab_size and p == 2**FRACTION_BITS:
            tokens[i] = ids[inverse_cdf(np.where(relative >= m, weights, 0) if m > 0 else weights, bits)]
            continue
        total = int(weights.sum())
        for floor in _CANDIDATE_FLOORS:
            token = candidate_draw(scaled, relative, weights, total, state.vocab_size, k, p, m, bits, floor)
            if token is not None:
                tokens[i] = ids[token]
                break
        else:
            left.append(i)
            left_bits.append(bits)
    if left:
        left_slots = torch.tensor([slots[i] for i in left])
        kept = _kept_weights(torch.from_numpy(rows[left]), torch.from_numpy(top[left]), state, left_slots, features)
        tokens[left] = _draw(kept, torch.tensor(left_bits)[:, None]).numpy()
    return tokens


def pack(out: SampleOutput) -> torch.Tensor:
    """The output as one float32 [rows, PACKED_WIDTH] tensor (token ids are exact in float32), for one copy to the
    host: token, valid, logprob, then (id, logprob) pairs, most likely first; zeros where not computed."""
    packed = torch.zeros(out.tokens.shape[0], PACKED_WIDTH, dtype=torch.float32, device=out.tokens.device)
    packed[:, 0] = out.tokens
    packed[:, 1] = out.valid
    if out.logprob is not None:
        n = out.top_ids.shape[1]
        packed[:, 2] = out.logprob
        packed[:, 3 : 3 + 2 * n : 2] = out.top_ids
        packed[:, 4 : 4 + 2 * n : 2] = out.top_logprobs
    return packed


def unpack(row: Sequence[float], logprobs: int | None) -> tuple[int, bool, float | None, tuple[tuple[int, float], ...]]:
    """A row of `pack` on the host: (token, valid, logprob, top pairs), the logprobs only if asked for (`logprobs`:
    the request's number of alternatives, or None)."""
    token, valid = int(row[0]), row[1] != 0.0
    if logprobs is None:
        return token, valid, None, ()
    return token, valid, row[2], tuple((int(row[3 + 2 * i]), row[4 + 2 * i]) for i in range(logprobs))


def _stream(seeds: torch.Tensor) -> torch.Tensor:
    """mix(seed) + GAMMA, what `_draw_bits` needs of a seed (int64 tensors, seeds as two's complement; SamplerState
    keeps this, not the seed)."""
    return _mix(seeds) + _GAMMA


def _draw_bits(streams: Int64s, counters: Int64s) -> Int64s:
    """The uniform number of each row's draw number `counter` (0, 1, ...) of its stream (`_stream` of its seed), as an
    int64 k in [0, 2**53): the number is k / 2**53, kept an integer for the draw's exact integer arithmetic (MPS has no
    float64). It is SplitMix64's output number counter + 1 from the state mix(seed): mix(mix(seed) + (counter + 1) *
    GAMMA), top 53 bits. A function of (seed, counter) alone, so a row's draws do not depend on the batch; every bit
    of the seed counts; mixing the seed first keeps the streams of nearby seeds apart (SplitMix64's streams from seeds
    s and s + GAMMA would be one stream shifted by one). int64 tensors or numpy arrays, whose arithmetic wraps
    alike."""
    return _shift_right(_mix(streams + counters * _GAMMA), 64 - FRACTION_BITS)


def _draw_bits_of(stream: int, counter: int) -> int:
    """`_draw_bits` of one row in Python integers (the same number): `stream` as SamplerState keeps it (int64)."""
    z = (stream + counter * _GAMMA) & _MASK_64
    z = ((z ^ (z >> 30)) * _MIX_1) & _MASK_64
    z = ((z ^ (z >> 27)) * _MIX_2) & _MASK_64
    return (z ^ (z >> 31)) >> (64 - FRACTION_BITS)


def _shift_right(z: Int64s, bits: int) -> Int64s:
    """Logical right shift of int64 values (torch's >> is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _mix(z: Int64s) -> Int64s:
    """SplitMix64's output function, a bijection of 64-bit values."""
    z = (z ^ _shift_right(z, 30)) * _MIX_1
    z = (z ^ _shift_right(z, 27)) * _MIX_2
    return z ^ _shift_right(z, 31)


def _scores(
    logits: torch.Tensor, state: SamplerState, slots: torch.Tensor, features: SamplerFeatures
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The masked and penalized logits, their row maxima (float32) and argmaxes (greedy tokens), and which rows are
    valid: no NaN or +inf among the (masked) logits, and not every token -inf (after the penalties too). bfloat16 and
    float16 logits stay so until an operation with a float32 operand turns them into float32, exactly: a copy less."""
    if logits.shape[1] != state.vocab_size:
        raise ValueError(f"logits have {logits.shape[1]} columns for a vocabulary of {state.vocab_size}")
    x = logits if logits.dtype in (torch.bfloat16, torch.float16, torch.float32) else logits.float()
    if features.masks:
        words = state.allowed[slots]
        bits = (words[:, :, None] >> state._bits) & 1
        x = x.masked_fill(bits.view(words.shape[0], -1)[:, : state.vocab_size] == 0, -torch.inf)
    top, best = _maxima(x)  # NaN propagates into the maximum
    valid = (top > -torch.inf) & (top < torch.inf)
    if features.penalties:
        x = _penalized(_biased(x, state, slots), state, slots)
        top, best = _maxima(x)
        valid &= top > -torch.inf
    return x, top.float(), best, valid


def _maxima(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x.max(1): each row's maximum and the first index holding it. On a CPU by amax and numpy's argmax (the same
    index, a NaN counting as the maximum in both): ATen's max with indices runs a scalar loop there, several times
    slower over a large vocabulary."""
    if x.device.type != "cpu":
        return x.max(1)
    values = x if x.dtype == torch.float32 else x.float()  # numpy has no bfloat16; the conversion is exact
    return x.amax(1), torch.from_numpy(values.numpy().argmax(1))


def _biased(x: torch.Tensor, state: SamplerState, slots: torch.Tensor) -> torch.Tensor:
    """The logits (float32) with each row's logit bias added (padding pairs add 0 to token 0)."""
    return x.float().scatter_add(1, state.bias_ids[slots], state.bias[slots])


def _penalized(x: torch.Tensor, state: SamplerState, slots: torch.Tensor) -> torch.Tensor:
    """sampling_params.py's penalties, in the same float32 operations (the result is float32): the repetition penalty
    over the prompt and generated tokens (positive logits / r, negative * r), then presence and frequency over generated
    ones; penalty overflow to +inf is clamped to the largest float, which keeps the order and a valid softmax.

    On CUDA in one Triton kernel (the same float32 operations), not a pass over [rows, vocab] per operation. Elsewhere
    only the tokens a row has seen (counts != 0) are computed: a few hundred of a vocabulary of 50k-150k; every other
    logit is only clamped, as the full computation leaves it (x - 0)."""
    if x.is_cuda:
        from rbee_worker.kernels import sampler_triton  # Triton: not on CPU-only machines

        penalties = state.repetition, state.presence, state.frequency
        return sampler_triton.penalize(x, state.counts, slots, *penalties, _IN_PROMPT)
    counts = state.counts[slots]
    rows, ids = counts.nonzero(as_tuple=True)
    seen, row_slots = x[rows, ids].float(), slots[rows]
    generated = (counts[rows, ids] & (_IN_PROMPT - 1)).float()
    rep = state.repetition[row_slots]
    seen = torch.where(seen < 0, seen * rep, seen / rep)
    penalty = state.frequency[row_slots] * generated + state.presence[row_slots] * (generated > 0)
    out = x.float().clamp(max=_FLOAT32.max)
    out[rows, ids] = (seen - penalty).clamp_(max=_FLOAT32.max)
    return out


def _scaled(x: torch.Tensor, top: torch.Tensor, state: SamplerState, slots: torch.Tensor) -> torch.Tensor:
    """s = (x - max) / T <= 0, as sampling_params.py computes it."""
    return (x - top[:, None]).div_(state.temperature[slots][:, None])


def _kept_weights(
    x: torch.Tensor,
    top: torch.Tensor,
    state: SamplerState,
    slots: torch.Tensor,
    features: SamplerFeatures,
) -> torch.Tensor:
    """Each token's integer weight, floor(2**40 * its probability relative to the top token's), where temperature,
    top-k, top-p and min-p keep it, else 0. An invalid row's garbage (NaN) never gets a weight, and every index
    computed from it stays in range. In-place operations where they can: on a CPU, fresh buffers of this size cost
    more in page faults than the arithmetic."""
    scaled = _scaled(x, top, state, slots)
    keys = keys_of(scaled) if features.filters else None  # before exp_ overwrites `scaled`
    relative = scaled.clamp_(min=_EXP_FLOOR).exp_()
    keep = relative >= state.min_p[slots][:, None]  # False for NaN
    weights = relative.mul_(_WEIGHT_ONE).long()
    if keys is not None:
        top_k = state.top_k[slots][:, None] if features.top_k else None
        keep &= radix_top_k_top_p(keys, weights, top_k, state.top_p[slots][:, None])
    return weights.mul_(keep)
