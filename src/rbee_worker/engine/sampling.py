"""Per-request token sampling: penalties, temperature, top-k, top-p, min-p, and a seeded draw.

Order of operations for each generated token (the order of Hugging Face transformers' `generate`):

1. Penalties on the raw logits: repetition penalty (CTRL / HF style, over the distinct prompt *and* generated ids;
   positive logits are divided by the penalty, negative ones multiplied), then presence / frequency penalties
   (OpenAI style, over generated ids only: ``logit -= presence * (count > 0) + frequency * count``).
2. Greedy shortcut when ``temperature < 1e-5`` (0 in the API; vLLM's threshold, below which the division overflows):
   argmax of the penalized logits, ties to the lowest id. The filters below are skipped (they always keep the argmax
   anyway) and no random number is consumed.
3. Temperature: ``logits / temperature``, after shifting the largest logit to 0 (softmax does not change, and a
   small temperature cannot overflow).
4. Top-k: keep the tokens whose logit is >= the k-th largest one, so ties with the k-th token are all kept (more than
   k tokens can survive), as in ``TopKLogitsWarper``.
5. Top-p: keep the smallest set of most likely tokens whose probability adds up to >= top_p, as in
   ``TopPLogitsWarper``: sorted ascending, a token is dropped when the cumulative probability up to and including it
   is <= 1 - top_p. Where tied tokens straddle the cut, that rule keeps only some of them; transformers leaves
   which ones to ``torch.sort`` (not stable on CPU for more than 16 elements), here the lowest ids are kept.
6. Min-p: drop tokens whose probability (after the steps above) is < min_p * the largest probability, as in
   ``MinPLogitsWarper``.
7. Renormalize over the survivors and draw one token by inverse CDF, with one uniform number from the request's
   random stream.

Every filter keeps at least the most likely token (transformers' ``min_tokens_to_keep=1``).

The filters work on a compact (token ids, logits) candidate set rather than the full vocabulary: after top-k only
about k entries remain. Top-p without top-k avoids sorting the whole vocabulary (~13 ms for 150k tokens on CPU, more
than a decode step of a small model): one weighted histogram of the logits locates the cut, and only the tokens above
it (checked to hold >= top_p of the mass exactly) are sorted.
"""

import math
import random
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

_SEED_LIMIT = 2**64  # the API accepts seeds in 0..2**64-1
GREEDY_BELOW = 1e-5  # a temperature below this samples greedily
_FLOAT32 = torch.finfo(torch.float32)
# Top-p sorts candidate sets up to this size outright; larger ones first locate the cut with a histogram.
_TOP_P_SORT_ALL = 4096
# That histogram spans this many nats below the top logit: a token further down has a probability < e^-32 (1e-14) of
# the top one's, so even 150k of them hold too little mass to move a cut unless top_p is within ~1e-9 of 1.
_TOP_P_HIST_SPAN = 32.0
_TOP_P_HIST_BINS = 1024


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 => greedy (argmax); otherwise logits / temperature
    top_k: int = 0  # 0 => off
    top_p: float = 1.0  # 1.0 => off; smallest set of most likely tokens with cumulative prob >= top_p (at least one)
    min_p: float = 0.0  # 0 => off; drop tokens whose prob < min_p * max prob (after temperature)
    repetition_penalty: float = 1.0  # HF/CTRL style over prompt AND generated ids: positive / r, negative * r
    presence_penalty: float = 0.0  # OpenAI style over generated ids only: logit -= presence * (count > 0)
    frequency_penalty: float = 0.0  # OpenAI style over generated ids only: logit -= frequency * count

    def __post_init__(self) -> None:
        # `not (x >= 0)` also rejects NaN; the ranges are those transformers' warpers accept.
        if not (0.0 <= self.temperature < math.inf):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not (0.0 <= self.top_p <= 1.0):
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not (0.0 < self.repetition_penalty < math.inf):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be finite, got {getattr(self, name)}")

    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def is_plain_greedy(self) -> bool:
        """Greedy with no penalty: the choice is the logits' argmax (lowest id on ties) and needs no state."""
        return (
            self.is_greedy()
            and self.repetition_penalty == 1.0
            and self.presence_penalty == 0.0
            and self.frequency_penalty == 0.0
        )


def random_seed() -> int:
    """A fresh seed for a request that brought none (0..2**63-1, from the OS's CSPRNG)."""
    return secrets.randbits(63)


def _token_ids(ids: Sequence[int]) -> torch.Tensor:
    tensor = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
    if tensor.numel() and int(tensor.min()) < 0:
        raise ValueError("token ids must be >= 0")
    return tensor


class _TokenCounts:
    """How often each token id occurred, plus the distinct ids seen, grown incrementally.

    Applying a penalty then costs O(distinct ids) per token instead of O(vocab) or O(sequence length).
    """

    def __init__(self, vocab_size: int) -> None:
        self.counts = torch.zeros(vocab_size, dtype=torch.float32)
        self._distinct = torch.empty(256, dtype=torch.long)  # the ids live in [:_n]; capacity doubles when full
        self._n = 0

    @property
    def distinct(self) -> torch.Tensor:
        return self._distinct[: self._n]

    def add(self, ids: torch.Tensor) -> None:
        # Ids past the logits' vocab (an embedding table larger than lm_head) can never be sampled; transformers'
        # RepetitionPenaltyLogitsProcessor ignores them too.
        ids = ids[ids < self.counts.numel()]
        fresh = ids[self.counts[ids] == 0].unique()
        self.counts.index_add_(0, ids, torch.ones(ids.numel(), dtype=torch.float32))
        end = self._n + fresh.numel()
        if end > self._distinct.numel():
            grown = torch.empty(max(2 * self._distinct.numel(), end), dtype=torch.long)
            grown[: self._n] = self.distinct
            self._distinct = grown
        self._distinct[self._n : end] = fresh
        self._n = end


class Sampler:
    """Per-request sampler: same seed + same logits => same tokens.

    The random stream is a ``random.Random(seed)`` (one 53-bit uniform per sampled token), not a ``torch.Generator``:
    the CPU ``torch.Generator.manual_seed`` accepts 0..2**64-1 but seeds its Mersenne Twister from the low 32 bits
    only, so seeds 1 and 2**32 + 1 would give identical tokens. ``random.Random`` uses every bit of the seed, and
    Python guarantees its ``random()`` sequence for a given seed across versions.
    """

    def __init__(self, params: SamplingParams, seed: int, prompt_ids: Sequence[int]) -> None:
        if not (0 <= seed < _SEED_LIMIT):
            raise ValueError(f"seed must be in 0..2**64-1, got {seed}")
        self.params = params
        self._rng = random.Random(seed)
        self._prompt_ids = _token_ids(prompt_ids) if params.repetition_penalty != 1.0 else None
        # Created on the first call, when the vocab size is known. `_repeated`: prompt + generated ids (repetition
        # penalty); `_generated`: generated ids only (presence / frequency penalties).
        self._vocab_size: int | None = None
        self._repeated: _TokenCounts | None = None
        self._generated: _TokenCounts | None = None
        self._recorded = 0  # how many of output_ids are already in the counts

    def __call__(self, logits: torch.Tensor, output_ids: Sequence[int]) -> int:
        """Choose the next token. `logits`: 1-D (vocab,), any device and float dtype; `output_ids`: the ids
        generated so far for this request (only ever appended to between calls)."""
        scores = self._penalized(logits, output_ids)
        if self.params.is_greedy():
            return _argmax(scores)
        ids, probs = self._filter(scores)
        cdf = torch.cumsum(probs, 0, dtype=torch.float64)
        # u < cdf[-1] always (random() < 1 and IEEE rounding cannot push r * t up to t), and with right=True a
        # zero-probability token (flat cdf step) can never be hit.
        u = self._rng.random() * float(cdf[-1])
        return int(ids[torch.searchsorted(cdf, u, right=True)])

    def probabilities(self, logits: torch.Tensor, output_ids: Sequence[int]) -> torch.Tensor:
        """The distribution `__call__` draws from for these inputs (float32, CPU, shape (vocab,)), for tests and
        logprobs. Greedy sampling gives a one-hot vector. Consumes no random numbers."""
        scores = self._penalized(logits, output_ids)
        full = torch.zeros_like(scores)
        if self.params.is_greedy():
            full[_argmax(scores)] = 1.0
        else:
            ids, probs = self._filter(scores)
            full[ids] = probs / float(probs.sum(dtype=torch.float64))
        return full

    def _penalized(self, logits: torch.Tensor, output_ids: Sequence[int]) -> torch.Tensor:
        """A CPU float32 copy of the logits with the penalties applied (the caller's tensor is left untouched)."""
        if logits.dim() != 1:
            raise ValueError(f"logits must be 1-D (vocab,), got shape {tuple(logits.shape)}")
        scores = logits.detach().to(device="cpu", dtype=torch.float32, copy=True)
        p = self.params
        if p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0:
            return scores
        self._record(output_ids, scores.numel())
        if self._repeated is not None:
            ids = self._repeated.distinct
            picked = scores[ids]
            # A penalty below float32's smallest normal number would be 0 in float32: 0 / 0 is NaN.
            penalty = max(p.repetition_penalty, _FLOAT32.tiny)
            scores[ids] = torch.where(picked < 0, picked * penalty, picked / penalty)
        if self._generated is not None:
            ids = self._generated.distinct
            scores[ids] -= p.frequency_penalty * self._generated.counts[ids] + p.presence_penalty
        # Extreme penalties can overflow to infinity: the largest float keeps the order and a valid softmax.
        return scores.clamp_(max=_FLOAT32.max)

    def _record(self, output_ids: Sequence[int], vocab_size: int) -> None:
        if self._vocab_size is None:
            self._vocab_size = vocab_size
            if self._prompt_ids is not None:
                self._repeated = _TokenCounts(vocab_size)
                self._repeated.add(self._prompt_ids)
            if self.params.presence_penalty != 0.0 or self.params.frequency_penalty != 0.0:
                self._generated = _TokenCounts(vocab_size)
        elif vocab_size != self._vocab_size:
            raise ValueError(f"vocab size changed from {self._vocab_size} to {vocab_size} within one request")
        if len(output_ids) < self._recorded:
            raise ValueError("output_ids shrank; the sampler counts generated ids incrementally and needs appends only")
        if len(output_ids) == self._recorded:
            return
        new_ids = _token_ids(output_ids[self._recorded :])
        self._recorded = len(output_ids)
        for counts in (self._repeated, self._generated):
            if counts is not None:
                counts.add(new_ids)

    def _filter(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Temperature, top-k, top-p, min-p on penalized logits (scaled in place). Returns the surviving token ids
        and their probabilities, in matching (not necessarily ascending) order and not renormalized: the draw
        scales to their sum anyway, and only `probabilities` needs them normalized."""
        p = self.params
        if p.temperature != 1.0:
            scores.sub_(scores.max()).div_(p.temperature)
        if 0 < p.top_k < scores.numel():
            ids = _at_least_kth(scores, p.top_k)
            logits = scores[ids]
        else:
            ids, logits = torch.arange(scores.numel()), scores
        # Top-p's cumulative sums are taken relative to the total, and min-p's ratio to the maximum does not depend
        # on the scale, so the probabilities need no renormalizing between the cuts.
        probs = torch.softmax(logits, 0)
        total = float(probs.sum(dtype=torch.float64))
        if not total > 0.0:  # NaN: the softmax of logits with a NaN or +inf, or all -inf, is NaN
            raise ValueError("logits give no valid distribution (NaN, +inf, or every token -inf)")
        if p.top_p < 1.0:
            keep = _top_p_keep(logits, probs, total, p.top_p)
            ids, probs = ids[keep], probs[keep]
        if p.min_p > 0.0:
            # min_p <= 1, so the most likely token always passes: min_tokens_to_keep=1 holds without extra code.
            keep = probs >= p.min_p * probs.max()
            ids, probs = ids[keep], probs[keep]
        return ids, probs


def greedy_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's (largest logit, its token id) as float32 [rows, 2] (ids are exact up to 2**24), computed where the
    logits are, so that greedy rows need one small copy to the host; ties: the lowest id, as `_argmax`."""
    values, ids = logits.max(-1)
    return torch.stack([values.float(), ids.float()], 1)


def _argmax(scores: torch.Tensor) -> int:
    best = scores.max(0)  # ties: the first maximum, i.e. the lowest id; a NaN anywhere comes out as the maximum
    if not float(best.values) > -math.inf:
        raise ValueError("logits give no valid choice (NaN, or every token -inf)")
    return int(best.indices)


def _at_least_kth(values: torch.Tensor, k: int) -> torch.Tensor:
    """Positions (ascending) of the values >= the k-th largest: the top k plus anything tied with the k-th."""
    kth = torch.topk(values, k, sorted=False).values.min()
    return (values >= kth).nonzero().squeeze(1)


def _top_p_keep(logits: torch.Tensor, probs: torch.Tensor, total: float, top_p: float) -> torch.Tensor:
    """Positions of the tokens top-p keeps; positions are in ascending token-id order. `probs` = softmax(logits)
    sums to `total`, which is 1 only to ~1e-7: over a 150k vocabulary that error is as large as one token's
    probability, so masses are taken relative to it, in float64."""
    cut_mass = (1.0 - top_p) * total
    head, tail_mass = _top_p_head(logits, probs, total, cut_mass)
    # Ascending order like TopPLogitsWarper's sort; the flip puts tied tokens in descending id order, so the stable
    # sort cuts the higher ids of a tie first and keeps the lower ones.
    flipped = head.flip(0)
    ascending = flipped[torch.sort(logits[flipped], stable=True).indices]
    cumulative = torch.cumsum(probs[ascending], 0, dtype=torch.float64)
    # transformers' rule: cut a token when the mass up to and including it, counted from the least likely token,
    # is <= 1 - top_p. The most likely token always survives (min_tokens_to_keep=1).
    cut = int(torch.searchsorted(cumulative, cut_mass - tail_mass, right=True))
    return ascending[min(cut, ascending.numel() - 1) :]


def _top_p_head(logits: torch.Tensor, probs: torch.Tensor, total: float, cut_mass: float) -> tuple[torch.Tensor, float]:
    """Positions (ascending) of a head of the distribution that holds every token top-p keeps, and the mass of the
    rest. The head is closed under ties and the rest holds <= cut_mass, so every token outside it is cut."""
    n = logits.numel()
    if n > _TOP_P_SORT_ALL:
        # mass[j]: probability of the tokens whose logit falls in bin j; the top i + 1 bins hold from_top[i].
        top = float(logits.max())
        span = (top - _TOP_P_HIST_SPAN, top)
        mass, edges = torch.histogram(logits, bins=_TOP_P_HIST_BINS, range=span, weight=probs)
        from_top = torch.cumsum(mass.flip(0), 0, dtype=torch.float64)
        bins_needed = int(torch.searchsorted(from_top, total - cut_mass)) + 1
        # One bin more than the histogram asks for, as a margin for its float32 sums; the exact check follows.
        lowest_bin = _TOP_P_HIST_BINS - 1 - bins_needed
        if lowest_bin >= 0:
            head = (logits >= edges[lowest_bin]).nonzero().squeeze(1)
            tail_mass = total - float(probs[head].sum(dtype=torch.float64))
            if tail_mass <= cut_mass:
                return head, tail_mass
    return torch.arange(n), 0.0
