"""The sampled draw of engine/sampling/sampler.py on CUDA, as a few Triton kernels: the same tokens as its tensor path
(`_draw(_kept_weights(...))`, selection.py's radix select), without its [rows, vocab] int64 intermediates.

Why: the tensor path writes and reads keys, digits, weights and masks as int64 tensors of the logits' shape, some
twenty passes over memory (64 rows of a 128k vocabulary: 64 MB each), and its step time grows with them. Here every
kernel reads the logits and recomputes a token's key and weight in registers; what crosses between kernels is a few
numbers per row (the state columns below) and per-chunk sums.

Each row is cut into chunks of CHUNK tokens, a program each (a row of 128k tokens: 32 programs), and the kernels run in
turn, each a launch inside the decode step's CUDA graph:

1. Top-k (if asked), then top-p: the radix select of selection.py, digit by digit (15 then 16 bits of the 31-bit
   key): `_histogram` adds each token that shares the digits found so far into its next digit's bin (atomic adds;
   tokens of weight 0 skipped), `_block_sums` sums the bins in blocks, and `_pick` (a program per row) finds the
   block, then the digit, where the cumulative weight reaches what is still needed.
2. The tie at the cut: `_chunk_sums` of the tied tokens' weights, `_find` the last tied token kept (id order).
3. The draw: `_chunk_sums` of the kept weights (min-p applied), `_find` the first token in id order whose cumulative
   kept weight exceeds floor(u * total).

Arithmetic as in the tensor path: s = (x - max) / T rounded to nearest (div_rn), exp from libdevice (CUDA's expf),
weights floor(exp(max(s, -64)) * 2**40) as int64, top_p and u as 53-bit fractions (`_scale_by` = selection.scale_by).
"""

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

CHUNK = 4096  # tokens per program
BLOCK = 1024  # tokens per step of a program's loop
HISTOGRAM_BLOCK = 2048  # bins per block of _block_sums (a program each) and of _pick
# The select's digits (shift, bits), most significant first: selection._RADIX_LARGE.
_RADIX = ((16, 15), (0, 16))
_WEIGHT_ONE = tl.constexpr(2.0**40)  # the top token's weight (sampler._WEIGHT_ONE)
_EXP_FLOOR = tl.constexpr(-64.0)  # s is clamped here before exp (sampler._EXP_FLOOR)
_NO_CUT = 2**31
# Triton's interpreter (tests on a machine without a GPU) has no libdevice: numpy's exp stands in there.
_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")

# Columns of the per-row state (int64): the select's progress (prefix of digits found, weight below it, weight
# needed), top-k's k-th key, the top-p cut and the weight of the keys below it, top-p's mass (the kept tokens weigh
# at most this before them), and the last tied token kept.
_PREFIX, _BEFORE, _NEED, _KTH, _CUT, _CUT_BEFORE, _MASS, _LAST = (tl.constexpr(i) for i in range(8))
_COLUMNS = tl.constexpr(8)


@triton.jit
def _scale_by(fraction, n, offset: tl.constexpr):
    """selection.scale_by: floor((fraction * n + offset) / 2**53), exactly, in int64 partial products."""
    a = fraction >> 27
    b = fraction & (2**27 - 1)
    c = n >> 30
    d = n & (2**30 - 1)
    low = a * d + b * c * 8 + ((b * d + offset) >> 27)
    return (low >> 26) + a * c * 16


@triton.jit
def _tokens(x_ptr, row, stride, ids, inside, top, temperature):
    """The temperature-scaled logits s = (x - max) / T of tokens `ids` and their keys (the bits of |s|)."""
    x = tl.load(x_ptr + row * stride + ids, mask=inside, other=0.0).to(tl.float32)
    s = tl.math.div_rn(x - top, temperature)
    return s, s.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _weights(s):
    """The tokens' weights floor(2**40 * exp(s)) and relative probabilities exp(s) (s clamped at -64)."""
    s = tl.maximum(s, _EXP_FLOOR)
    e = tl.exp(s) if _INTERPRETED else libdevice.exp(s)
    return (e * _WEIGHT_ONE).to(tl.int64), e


@triton.jit
def _taken(x_ptr, row, stride, vocab, ids, top, temperature, min_p, cut, last, KEPT: tl.constexpr):
    """The weights of tokens `ids` that count toward the tie at the cut (keys equal to it) or, KEPT, that are kept
    (keys below the cut, or tied up to the last tied token kept, and min-p's threshold met); 0 for the others."""
    inside = ids < vocab
    s, key = _tokens(x_ptr, row, stride, ids, inside, top, temperature)
    weight, e = _weights(s)
    take = ((key < cut) | ((key == cut) & (ids <= last))) & (e >= min_p) if KEPT else key == cut
    return tl.where(take & inside, weight, 0)


@triton.jit
def _histogram(
    x_ptr, stride, vocab, top_ptr, temperature_ptr, state_ptr, histogram_ptr,
    SHIFT: tl.constexpr, BITS: tl.constexpr, FIRST: tl.constexpr, WEIGHTED: tl.constexpr, BELOW_KTH: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Adds each token of the chunk that shares the digits found so far (all of them in the FIRST pass) into the bin
    of its digit (key >> SHIFT, BITS bits): a count (top-k) or its weight (WEIGHTED, top-p; only keys <= the k-th
    with BELOW_KTH)."""
    row = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * CHUNK
    top = tl.load(top_ptr + row)
    temperature = tl.load(temperature_ptr + row)
    state = state_ptr + row * _COLUMNS
    prefix = tl.load(state + _PREFIX)
    kth = tl.load(state + _KTH)
    bins = histogram_ptr + row * (1 << BITS)
    for offset in range(0, CHUNK, BLOCK):
        ids = start + offset + tl.arange(0, BLOCK)
        inside = ids < vocab
        s, key = _tokens(x_ptr, row, stride, ids, inside, top, temperature)
        play = inside
        if not FIRST:
            play &= (key >> (SHIFT + BITS)) == prefix
        if BELOW_KTH:
            play &= key <= kth
        digit = (key >> SHIFT) & ((1 << BITS) - 1)
        if WEIGHTED:
            weight, _ = _weights(s)
            tl.atomic_add(bins + digit, weight, mask=play & (weight > 0), sem="relaxed")
        else:
            tl.atomic_add(bins + digit, tl.full([BLOCK], 1, tl.int64), mask=play, sem="relaxed")


@triton.jit
def _block_sums(histogram_ptr, sums_ptr, BITS: tl.constexpr, BLOCK: tl.constexpr):
    """Each block of BLOCK bins of a row's histogram summed (a program per block), for _pick."""
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    counts = tl.load(histogram_ptr + row * (1 << BITS) + block * BLOCK + tl.arange(0, BLOCK))
    tl.store(sums_ptr + row * ((1 << BITS) // BLOCK) + block, tl.sum(counts))


@triton.jit
def _pick(
    histogram_ptr, sums_ptr, state_ptr, top_p_ptr,
    BITS: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr, TOP_P: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """A program per row: the digit whose bin holds the weight still needed (the first whose cumulative weight
    reaches need - before), appended to the prefix; found in two steps, the block of bins from _block_sums, then the
    bin within it. The FIRST top-p pass also sets what is needed from the row's total: top_p's mass + 1, at most
    the total (kept in registers: a load of what this program stored need not see it). The LAST pass stores the cut
    (top-k: the k-th key; top-p: the cut and the weight of the keys below it)."""
    row = tl.program_id(0).to(tl.int64)
    state = state_ptr + row * _COLUMNS
    blocks = tl.arange(0, (1 << BITS) // BLOCK)
    sums = tl.load(sums_ptr + row * ((1 << BITS) // BLOCK) + blocks)
    need = tl.load(state + _NEED)
    if FIRST:
        prefix = tl.zeros([], tl.int64)
        before = tl.zeros([], tl.int64)
        if TOP_P:
            total = tl.sum(sums)
            mass = tl.maximum(_scale_by(tl.load(top_p_ptr + row), total, -1), 0)
            need = tl.minimum(mass + 1, total)
            tl.store(state + _MASS, mass)
            tl.store(state + _NEED, need)
    else:
        prefix = tl.load(state + _PREFIX)
        before = tl.load(state + _BEFORE)
    target = need - before - 1
    # The first block, then the first bin in it, whose cumulative weight exceeds the target (the last if none does).
    block = tl.min(tl.where(tl.cumsum(sums, 0) > target, blocks, (1 << BITS) // BLOCK - 1))
    carry = tl.sum(tl.where(blocks < block, sums, 0))
    columns = tl.arange(0, BLOCK)
    counts = tl.load(histogram_ptr + row * (1 << BITS) + block * BLOCK + columns)
    column = tl.min(tl.where(carry + tl.cumsum(counts, 0) > target, columns, BLOCK - 1))
    prefix = (prefix << BITS) | (block * BLOCK + column)
    before += carry + tl.sum(tl.where(columns < column, counts, 0))
    tl.store(state + _PREFIX, prefix)
    tl.store(state + _BEFORE, before)
    if LAST:
        if TOP_P:
            tl.store(state + _CUT, prefix)
            tl.store(state + _CUT_BEFORE, before)
        else:
            tl.store(state + _KTH, prefix)


@triton.jit
def _chunk_sums(
    x_ptr, stride, vocab, top_ptr, temperature_ptr, min_p_ptr, state_ptr, sums_ptr, out_ptr,
    KEPT: tl.constexpr, CHUNKS: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Each chunk's weight of the tokens tied at the cut (or, KEPT, of the kept tokens: below the cut, or tied up to
    the last kept, with min-p), into sums[row, chunk]; the chunk-0 program sets out[row] to the last token, the
    answer where no cumulative weight exceeds the target (selection.search)."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    top = tl.load(top_ptr + row)
    temperature = tl.load(temperature_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    cut = tl.load(state_ptr + row * _COLUMNS + _CUT)
    last = tl.load(state_ptr + row * _COLUMNS + _LAST)
    total = tl.zeros([], tl.int64)
    for offset in range(0, CHUNK, BLOCK):
        ids = chunk * CHUNK + offset + tl.arange(0, BLOCK)
        total += tl.sum(_taken(x_ptr, row, stride, vocab, ids, top, temperature, min_p, cut, last, KEPT))
    tl.store(sums_ptr + row * CHUNKS + chunk, total)
    if chunk == 0:
        tl.store(out_ptr + row, vocab - 1)


@triton.jit
def _find(
    x_ptr, stride, vocab, top_ptr, temperature_ptr, min_p_ptr, state_ptr, sums_ptr, bits_ptr, out_ptr,
    KEPT: tl.constexpr, CHUNKS: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """The first token in id order whose cumulative weight (as _chunk_sums counts it) exceeds the target, into
    out[row], by the program whose chunk holds it: tied tokens against mass - before the cut (the last tied token
    kept), or kept ones against floor(u * their total) (the drawn token)."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    chunks = tl.arange(0, CHUNKS)
    sums = tl.load(sums_ptr + row * CHUNKS + chunks)
    carry = tl.sum(tl.where(chunks < chunk, sums, 0))
    mine = tl.sum(tl.where(chunks == chunk, sums, 0))
    state = state_ptr + row * _COLUMNS
    if KEPT:
        target = _scale_by(tl.load(bits_ptr + row), tl.sum(sums), 0)
    else:
        target = tl.load(state + _MASS) - tl.load(state + _CUT_BEFORE)
    if (carry <= target) & (target < carry + mine):
        top = tl.load(top_ptr + row)
        temperature = tl.load(temperature_ptr + row)
        min_p = tl.load(min_p_ptr + row)
        cut = tl.load(state + _CUT)
        last = tl.load(state + _LAST)
        chosen = tl.full([], vocab - 1, tl.int64)
        for offset in range(0, CHUNK, BLOCK):
            ids = chunk * CHUNK + offset + tl.arange(0, BLOCK)
            weights = _taken(x_ptr, row, stride, vocab, ids, top, temperature, min_p, cut, last, KEPT)
            cumulative = carry + tl.cumsum(weights, 0)
            chosen = tl.minimum(chosen, tl.min(tl.where(cumulative > target, ids.to(tl.int64), vocab - 1)))
            carry = tl.max(cumulative)
        tl.store(out_ptr + row, chosen)


@triton.jit
def _penalize(
    x_ptr, stride, out_ptr, counts_ptr, slots_ptr, repetition_ptr, presence_ptr, frequency_ptr, vocab,
    IN_PROMPT: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """sampler._penalized for a chunk of a row: the repetition penalty where the token is in the prompt or generated
    (x / r above 0, x * r below), then x - (frequency * generated + presence * (generated > 0)), at most the largest
    float32; launched without fp fusion, so that each product rounds as torch's separate kernels round it."""
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row)
    repetition = tl.load(repetition_ptr + slot)
    presence = tl.load(presence_ptr + slot)
    frequency = tl.load(frequency_ptr + slot)
    for offset in range(0, CHUNK, BLOCK):
        ids = tl.program_id(1) * CHUNK + offset + tl.arange(0, BLOCK)
        inside = ids < vocab
        x = tl.load(x_ptr + row * stride + ids, mask=inside, other=0.0).to(tl.float32)
        counts = tl.load(counts_ptr + slot * vocab + ids, mask=inside, other=0)
        generated = (counts & (IN_PROMPT - 1)).to(tl.float32)
        x = tl.where(counts != 0, tl.where(x < 0, x * repetition, tl.math.div_rn(x, repetition)), x)
        x = x - (frequency * generated + presence * (generated > 0).to(tl.float32))
        x = tl.minimum(x, 3.4028234663852886e38, propagate_nan=tl.PropagateNan.ALL)
        tl.store(out_ptr + row * vocab + ids, x, mask=inside)


def penalize(
    x: torch.Tensor,
    counts: torch.Tensor,
    slots: torch.Tensor,
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    in_prompt: int,
) -> torch.Tensor:
    """sampler._penalized in one pass: the penalized logits [rows, vocab] float32 of `x` (any float dtype), from the
    slots' token `counts` [slots, vocab] int32 (`in_prompt`: the bit marking a prompt token) and their penalties
    (float32 [slots]); `slots`: [rows] int64."""
    rows, vocab = x.shape
    x = x.contiguous()
    out = torch.empty(rows, vocab, dtype=torch.float32, device=x.device)
    _penalize[(rows, triton.cdiv(vocab, CHUNK))](
        x, x.stride(0), out, counts, slots, repetition, presence, frequency, vocab,
        IN_PROMPT=in_prompt, CHUNK=CHUNK, BLOCK=BLOCK, enable_fp_fusion=False,
    )  # fmt: skip
    return out


def draw(
    x: torch.Tensor,
    top: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor,
    bits: torch.Tensor,
) -> torch.Tensor:
    """Each row's drawn token, [rows] int64: the token sampler.py's tensor path draws from the (masked, penalized)
    logits `x` [rows, vocab] with row maxima `top` (float32), `temperature` and `min_p` (float32), `top_k` (int64,
    the vocabulary size when off; None: no top-k stage), `top_p` (int64 over 2**53; None: no top-k / top-p stage)
    and the draw's uniform `bits` (int64 over 2**53), all [rows] on the logits' CUDA device."""
    rows, vocab = x.shape
    x = x.contiguous()
    chunks = triton.cdiv(vocab, CHUNK)
    sums_width = triton.next_power_of_2(chunks)
    device = x.device
    state = torch.zeros(rows, _COLUMNS.value, dtype=torch.long, device=device)
    sums = torch.zeros(rows, sums_width, dtype=torch.long, device=device)
    last = torch.empty(rows, dtype=torch.long, device=device)
    out = torch.empty(rows, dtype=torch.long, device=device)
    top, temperature, min_p = top.float().contiguous(), temperature.contiguous(), min_p.contiguous()
    grid = (rows, chunks)
    common = dict(CHUNK=CHUNK, BLOCK=BLOCK)
    sizes = dict(CHUNKS=sums_width, **common)
    if top_p is None:
        state[:, _CUT.value] = _NO_CUT
    else:
        if top_k is not None:
            state[:, _NEED.value] = top_k
        for weighted in ([False] if top_k is not None else []) + [True]:
            for i, (shift, bits_) in enumerate(_RADIX):
                histogram = torch.zeros(rows, 1 << bits_, dtype=torch.long, device=device)
                _histogram[grid](
                    x, x.stride(0), vocab, top, temperature, state, histogram,
                    SHIFT=shift, BITS=bits_, FIRST=i == 0, WEIGHTED=weighted,
                    BELOW_KTH=weighted and top_k is not None, **common,
                )  # fmt: skip
                blocks = (1 << bits_) // HISTOGRAM_BLOCK
                block_sums = torch.empty(rows, blocks, dtype=torch.long, device=device)
                _block_sums[(rows, blocks)](histogram, block_sums, BITS=bits_, BLOCK=HISTOGRAM_BLOCK)
                _pick[(rows,)](
                    histogram, block_sums, state, top_p, BITS=bits_, FIRST=i == 0, LAST=i == len(_RADIX) - 1,
                    TOP_P=weighted, BLOCK=HISTOGRAM_BLOCK,
                )  # fmt: skip
        _chunk_sums[grid](x, x.stride(0), vocab, top, temperature, min_p, state, sums, last, KEPT=False, **sizes)
        _find[grid](x, x.stride(0), vocab, top, temperature, min_p, state, sums, bits, last, KEPT=False, **sizes)
        state[:, _LAST.value] = last
    _chunk_sums[grid](x, x.stride(0), vocab, top, temperature, min_p, state, sums, out, KEPT=True, **sizes)
    _find[grid](x, x.stride(0), vocab, top, temperature, min_p, state, sums, bits, out, KEPT=True, **sizes)
    return out
