"""Sampling parameters and the rules by which they choose each token: penalties, temperature, top-k, top-p, min-p.

Order of operations for each generated token (the order of Hugging Face transformers' `generate`):

0. Logit bias (OpenAI's `logit_bias`): each listed token's bias added to its raw logit (-100 all but bans it, +100
   all but forces it), as llama.cpp and vLLM apply it, before everything below.
1. Penalties on the (biased) logits: repetition penalty (CTRL / HF style, over the distinct prompt *and* generated ids;
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
   random stream (a function of its seed and the token's index: engine/sampling/seeded_draws.py's `draw_bits`).

Every filter keeps at least the most likely token (transformers' ``min_tokens_to_keep=1``).

engine/sampling/sampler.py implements these rules on the logits' device, for a whole batch at once.
"""

import math
import secrets
from dataclasses import dataclass

GREEDY_BELOW = 1e-5  # a temperature below this samples greedily
MAX_LOGIT_BIAS = 1024  # tokens one request may bias


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 => greedy (argmax); otherwise logits / temperature
    top_k: int = 0  # 0 => off
    top_p: float = 1.0  # 1.0 => off; smallest set of most likely tokens with cumulative prob >= top_p (at least one)
    min_p: float = 0.0  # 0 => off; drop tokens whose prob < min_p * max prob (after temperature)
    repetition_penalty: float = 1.0  # HF/CTRL style over prompt AND generated ids: positive / r, negative * r
    presence_penalty: float = 0.0  # OpenAI style over generated ids only: logit -= presence * (count > 0)
    frequency_penalty: float = 0.0  # OpenAI style over generated ids only: logit -= frequency * count
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs, each id once, at most MAX_LOGIT_BIAS

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
        ids = [token for token, _ in self.logit_bias]
        if len(ids) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias may list at most {MAX_LOGIT_BIAS} tokens, got {len(ids)}")
        if len(set(ids)) != len(ids) or any(token < 0 for token in ids):
            raise ValueError("logit_bias lists each token id (>= 0) once")
        if not all(math.isfinite(bias) for _, bias in self.logit_bias):
            raise ValueError("logit_bias values must be finite")

    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def random_seed() -> int:
    """A fresh seed for a request that brought none (0..2**63-1, from the OS's CSPRNG)."""
    return secrets.randbits(63)
