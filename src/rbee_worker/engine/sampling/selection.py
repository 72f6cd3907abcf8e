"""Exact top-k and top-p over integer token weights: which tokens they keep, and the inverse-CDF draw.

Keys order a row's tokens from the most likely (the bits of -s, s the temperature-scaled logit <= 0: non-negative
floats order like their bits), weights are floor(2**40 * probability relative to the top token) (sampler.py). Two ways
to the same kept set:

- `radix_top_k_top_p`: a batched radix select over the keys, tensor operations of static shape that never wait for
  the host (inside a CUDA graph): two passes over digits of 15 and 16 bits (three of 11, 10, 10 for a vocabulary
  under 2**14), each a per-row histogram (scatter_add) of the tokens that share the digits found so far, whose
  cumulative sum picks the next digit.
- `candidate_draw`: one row on the host (numpy), from the tokens whose scaled logit passes a floor, where the cut
  provably falls among them; for a CPU, where a few rows' passes over the whole vocabulary (the select's histograms,
  or a topk) cost more than the model's step.

Top-k keeps the keys <= the k-th smallest, ties included (TopKLogitsWarper). Top-p over the top-k survivors keeps a
token iff the mass before it (more likely tokens, then tied ones of lower id) is < top_p * the survivors' mass:
TopPLogitsWarper's rule, a tie that straddles the cut keeping its lowest ids. All in integers: top_p is a 53-bit
fixed-point fraction.
"""

import math

import numpy as np
import torch

FRACTION_BITS = 53  # top_p and the uniform numbers are integers over 2**53
# The radix select's digits of a key (a non-negative float32's bits, < 2**31), most significant first, as (shift,
# bits): two passes where the vocabulary outnumbers their histograms' 2**15 + 2**16 bins (each pass costs a scatter
# over the vocabulary), three with small histograms otherwise (short rows; many rows of a small vocabulary).
_RADIX_LARGE = ((16, 15), (0, 16))
_RADIX_SMALL = ((20, 11), (10, 10), (0, 10))
_BLOCK = 256  # the most columns of a block in search


def keys_of(scaled: torch.Tensor) -> torch.Tensor:
    """The keys of temperature-scaled logits s <= 0: the bits of -s as int64 (the sign bit cleared, so -0.0 is +0.0),
    smaller for more likely tokens."""
    return scaled.view(torch.int32).long().bitwise_and_(0x7FFFFFFF)


def scale_by(fraction: torch.Tensor, n: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """floor((fraction * n + offset) / 2**53), exactly, for 0 <= fraction <= 2**53, 0 <= n < 2**59, offset 0 or -1.
    The product needs up to 112 bits: with fraction = a * 2**27 + b and n = c * 2**30 + d, it is
    a*c * 2**57 + a*d * 2**27 + b*c * 2**30 + b*d, whose partial products fit in int64 and are shifted down in turn
    (floor((m + y) / q) = floor((m + floor(y)) / q) for an integer m; >> floors negative values too)."""
    a, b = fraction >> 27, fraction & (2**27 - 1)
    c, d = n >> 30, n & (2**30 - 1)
    low = torch.addcmul(a * d, b, c, value=8) + ((b * d + offset if offset else b * d) >> 27)
    return torch.addcmul(low >> 26, a, c, value=16)


def radix_top_k_top_p(
    keys: torch.Tensor, weights: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor
) -> torch.Tensor:
    """Which tokens top-k (if `top_k`) then top-p keep; `keys`: [rows, vocab] int64 in 0..2**31-1, smaller for more
    likely tokens. Zeroes the weights of the tokens top-k drops."""
    radix = _RADIX_LARGE if keys.shape[1] >= 2**14 else _RADIX_SMALL
    # Each digit with the key bits above it (the previous digit's shift; the first digit needs no mask).
    shifted = [keys >> shift if shift else keys for shift, _ in radix]
    digits = [
        (s if i == 0 else s & (2**bits - 1), shifted[i - 1] if i else s)
        for i, (s, (_, bits)) in enumerate(zip(shifted, radix, strict=True))
    ]
    if top_k is not None:
        ones = torch.ones((), dtype=torch.long, device=keys.device).expand_as(weights)
        kth, _ = _radix_select(radix, digits, ones, top_k)
        weights.mul_(keys <= kth)
    total = weights.sum(1, keepdim=True)
    # A token is kept iff the mass before it is < top_p * total, i.e. <= `mass` (integers): floor((q * total - 1)
    # / 2**53) for top_p = q / 2**53. At least 0: the most likely token (mass 0 before it) is always kept.
    mass = scale_by(top_p, total, -1).clamp_(min=0)
    cut, before_cut = _radix_select(radix, digits, weights, torch.minimum(mass + 1, total))
    # Tokens tied at the cut go by id, the lower ids first: one is kept iff the tied ones before it weigh at most
    # mass - before_cut, i.e. up to the first tied token whose cumulative weight passes that, `last`.
    tied = torch.where(keys == cut, weights, 0)
    last, _ = search(tied, block_sums(tied), mass - before_cut)
    ids = torch.arange(keys.shape[1], device=keys.device)
    return keys + (ids > last) <= cut  # keys < cut: kept; keys == cut: kept up to `last`; keys > cut: cut


def _radix_select(
    radix: tuple[tuple[int, int], ...],
    digits: list[tuple[torch.Tensor, torch.Tensor]],
    weights: torch.Tensor,
    need: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the smallest key `cut` such that the keys <= cut weigh >= need ([rows, 1], 1..the row's total
    weight), and the weight of the keys < cut. `digits`: the keys' `radix` digits with the key bits above each;
    `weights`: [rows, vocab] int64 >= 0.

    One pass per digit, most significant first: a histogram of the weights of the keys that share the digits found
    so far, by their next digit, whose cumulative sum picks the cut's digit. Outside weights are zeroed rather than
    sent to a spare bin, which on a GPU would make all their atomic adds hit one address."""
    cut = torch.zeros_like(need)
    before = torch.zeros_like(need)
    for i, ((shift, bits), (digit, above)) in enumerate(zip(radix, digits, strict=True)):
        part = weights if i == 0 else torch.where(above == cut >> (shift + bits), weights, 0)
        histogram = weights.new_zeros(weights.shape[0], 2**bits).scatter_add_(1, digit, part)
        # The first digit whose cumulative weight reaches what is still needed (exceeds it less one).
        chosen, below = search(histogram, block_sums(histogram), need - before - 1)
        before = before + below
        cut = torch.add(cut, chosen, alpha=1 << shift)
    return cut, before


def block_sums(weights: torch.Tensor) -> torch.Tensor:
    """The weights' sums over blocks of columns, [rows, blocks]: blocks of _BLOCK columns, or of the largest power of
    two that divides the row (1 for an odd vocabulary, which makes search a plain scan)."""
    return weights.view(weights.shape[0], -1, math.gcd(weights.shape[1], _BLOCK)).sum(2)


def search(weights: torch.Tensor, sums: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the first column whose cumulative weight exceeds `target` ([rows, 1] >= 0; the last column if none
    does, which is what the clamps give garbage rows), and the weight of the columns before it: searchsorted(
    cumsum(weights), target, right=True), without a scan of the whole row (one GPU block per row, slow): a
    cumulative sum of the block sums `sums` (block_sums) picks the block, one of the block's columns the column."""
    rows, columns = weights.shape
    block = columns // sums.shape[1]
    ends = sums.cumsum(1)
    chosen = torch.searchsorted(ends, target, right=True).clamp_(max=sums.shape[1] - 1)
    before = (ends - sums).gather(1, chosen)
    inside = weights.view(rows, -1, block).gather(1, chosen[:, :, None].expand(-1, -1, block)).squeeze(1)
    cumulative = inside.cumsum(1)
    offset = torch.searchsorted(cumulative, target - before, right=True).clamp_(max=block - 1)
    return torch.add(offset, chosen, alpha=block), before + (cumulative - inside).gather(1, offset)


def candidate_draw(
    scaled: np.ndarray,
    relative: np.ndarray,
    weights: np.ndarray,
    total: int,
    vocab_size: int,
    top_k: int,
    top_p: int,
    min_p: float,
    bits: int,
    floor: float,
) -> int | None:
    """One row's token as `radix_top_k_top_p` and the inverse CDF draw give it, from its candidates, the tokens of
    scaled logit >= `floor`; None where the cut may fall outside them. On the host, for a CPU: a few numpy operations
    over a few tokens instead of passes over the whole row.

    Row arrays, in token id order, over the row's tokens of nonzero weight or more (every token of scaled logit >=
    `floor` among them; the result is an index into them): `scaled` the temperature-scaled logits (float32 <= 0),
    `relative` = exp(scaled), `weights` the integer weights, `total` the whole row's sum of weights; `top_k`
    `vocab_size` when off, `top_p` and `bits` over 2**53. Every token outside has a smaller scaled logit than every
    candidate, so it comes after them all in the cut's order: top-k's survivors are candidates when k is at most their
    number, and top-p's cut falls among them when they weigh more than the mass it keeps (every token outside has at
    least their weight before it)."""
    ids = np.flatnonzero(scaled >= floor)
    if top_k < vocab_size:
        if top_k > ids.size:
            return None
        if top_k < ids.size:  # top-k's survivors: the scaled logits >= the k-th largest, ties included
            values = scaled[ids]
            ids = ids[values >= np.partition(values, ids.size - top_k)[ids.size - top_k]]
        w = weights[ids]
        total = int(w.sum())
    else:
        w = weights[ids]
    mass = max((top_p * total - 1) >> FRACTION_BITS, 0)
    if int(w.sum()) <= mass:
        return None
    keys = scaled[ids].view(np.int32) & 0x7FFFFFFF
    order = np.lexsort((ids, keys))  # by key, then by id: the order the cut rules count in
    ordered = w[order]
    kept = np.empty_like(w)
    kept[order] = np.where(np.cumsum(ordered) - ordered <= mass, ordered, 0)
    if min_p > 0:
        kept[relative[ids] < min_p] = 0
    return int(ids[inverse_cdf(kept, bits)])


def inverse_cdf(weights: np.ndarray, bits: int) -> int:
    """The first index whose cumulative weight (int64, total > 0) exceeds floor(bits * total / 2**53)."""
    cumulative = np.cumsum(weights)
    return int(np.searchsorted(cumulative, (bits * int(cumulative[-1])) >> FRACTION_BITS, side="right"))
