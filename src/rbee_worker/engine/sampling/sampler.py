"""Token sampling where the logits are (CPU, CUDA, MPS), for all rows of a step at once.

The semantics are those of `sampling_params.py` (Hugging Face's order: penalties, greedy shortcut, temperature, top-k,
top-p, min-p, draw; see its docstring). Everything here is tensor operations of static shape that never wait for the
host: no `.item()`, no data-dependent shape, no Python branch on a tensor's value. So `sample` can be captured in a CUDA
graph with the model's forward, and a step's chosen tokens can feed the next step on the device. Which stages run is
static (SamplerFeatures: a graph per value); each row's parameters and state live in device tensors (SamplerState;
both in sampler_state.py).

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
5. Draw: target = floor(u * total kept weight) for the row's uniform u = k / 2**53 (seeded_draws.draw_bits), and
   the first token in id order whose cumulative kept weight exceeds it: inverse CDF, found without a scan of the whole
   row (selection.search).
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from rbee_worker.engine.sampling.sampler_state import IN_PROMPT, MAX_TOP_LOGPROBS, SamplerFeatures, SamplerState
from rbee_worker.engine.sampling.seeded_draws import draw_bits, draw_bits_of
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

# pack's row layout: token, valid, logprob, then (id, logprob) of the MAX_TOP_LOGPROBS most likely tokens.
PACKED_WIDTH = 3 + 2 * MAX_TOP_LOGPROBS
_WEIGHT_ONE = 2.0**40  # the top token's weight
_FLOAT32_MAX = torch.finfo(torch.float32).max  # penalized logits are clamped here (see _penalized)
# exp's argument is clamped here: below, the weight is 0 anyway (exp(-64) * 2**40 < 1e-15), and denormal results
# would slow a CPU's exp and the products after it many times over.
_EXP_FLOOR = -64.0
# candidate_draw's floors on the scaled logits, tried in turn until one covers the row's cut: the first holds a chat's
# nucleus (top_p 0.9) in nearly every row, the second top_k 50 in most, the third nearly every token of nonzero weight;
# the rows no floor covers are drawn by the radix select.
_CANDIDATE_FLOORS = (-8.0, -16.0, -24.0)
_WEIGHTLESS = -28.0  # a scaled logit below this has weight 0: exp(-28) * 2**40 < 0.8 (_draw_on_host)


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
            bits = draw_bits(state.stream[slots], state.counter[slots])[:, None]
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
        bits = draw_bits_of(int(stream[slot]), int(counter[slot]))
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
        return sampler_triton.penalize(x, state.counts, slots, *penalties, IN_PROMPT)
    counts = state.counts[slots]
    rows, ids = counts.nonzero(as_tuple=True)
    seen, row_slots = x[rows, ids].float(), slots[rows]
    generated = (counts[rows, ids] & (IN_PROMPT - 1)).float()
    rep = state.repetition[row_slots]
    seen = torch.where(seen < 0, seen * rep, seen / rep)
    penalty = state.frequency[row_slots] * generated + state.presence[row_slots] * (generated > 0)
    out = x.float().clamp(max=_FLOAT32_MAX)
    out[rows, ids] = (seen - penalty).clamp_(max=_FLOAT32_MAX)
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
