"""Attention of a decode step on CUDA (one query token per row) over a paged KV cache, as a split-KV Triton kernel
("flash decoding") that reads keys and values through block tables.

The cache is a pool of blocks per layer ([num_blocks, block_size, kv_heads, head_dim], vLLM's layout): position p of
row r lives in block `block_tables[r, p // block_size]` at offset `p % block_size`, and row r attends to its positions
0 .. lengths[r] - 1 (a row of length 0 is padding: its output is zeros and nothing of the cache is read), or in a
sliding layer to its last `window` of them only.

What transformers' attention layers add to plain softmax attention, as their eager functions compute it: a sliding
window (Mistral, Gemma 2 / 3, gpt-oss: the chunks split only the window's positions, so a step reads the window and
no more), logit soft-capping (Gemma 2: scores -> softcap * tanh(scores / softcap)), and attention sinks (gpt-oss: a
logit per head that takes part in the softmax's denominator and adds no value), the last in the merge, or in the one
split's own output.

Why this shape: one decode step of one sequence is little work, rows x key/value heads wide (8 for a Llama-3.1-8B
shape), on a GPU with many multiprocessors (132 on an H200). So each row's positions are also split into chunks, one
program each, and a second small kernel merges the chunks' partial results by their log-sum-exp. Where the rows alone
fill the GPU (one split: 64 rows of an 8B shape), the split kernel writes the output itself and the merge is left out,
one launch and a float32 round trip less per layer. The query heads that share a key/value head are one program's
rows (GQA), so each key and value is read once.

Why a fixed grid: the launch is (rows, kv_heads, splits), where `splits_for` depends on the rows and key/value heads
alone, and each program finds its chunk from its row's length, read inside the kernel. Nothing on the host depends on
the lengths (no sync, no allocation that follows them), so one CUDA graph captured per row count replays for any
lengths, and the work still follows each row's own length: a chunk beyond it reads nothing.
"""

import functools

import torch
import triton
import triton.language as tl

BLOCK_S = 64  # key positions per inner step of a program
WARPS = 4  # warps per program of the split kernel
STAGES = 3  # software-pipelining stages of the split kernel's loop (Triton's num_stages)
MAX_SPLITS = 64  # most programs per row and key/value head


@triton.jit
def _split_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, lengths_ptr, sinks_ptr, part_ptr, lse_ptr, o_ptr,
    stride_qr, stride_qh, stride_or, stride_oh,
    stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh,
    stride_tr, stride_tb,
    scale, window, softcap,
    HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, SPLITS: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
):  # fmt: skip
    row, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D)
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + row * stride_qr + heads[:, None] * stride_qh + d[None, :], mask=(g < GROUP)[:, None], other=0.0)
    m_i = tl.full((GROUP_PAD,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((GROUP_PAD,), dtype=tl.float32)
    acc = tl.zeros((GROUP_PAD, D), dtype=tl.float32)
    length = tl.load(lengths_ptr + row)
    first = tl.maximum(length - window, 0) if WINDOW else 0
    chunk = tl.cdiv(tl.cdiv(length - first, BLOCK), SPLITS) * BLOCK  # whole steps: every split but the last is full
    start = first + split * chunk
    end = tl.minimum(start + chunk, length)
    k_head = k_ptr + kv_head * stride_kh
    v_head = v_ptr + kv_head * stride_vh
    for s0 in range(start, end, BLOCK):
        s = s0 + tl.arange(0, BLOCK)
        s_ok = s < end
        block = tl.load(table_ptr + row * stride_tr + (s // BLOCK_SIZE) * stride_tb, mask=s_ok, other=0).to(tl.int64)
        offset = (s % BLOCK_SIZE).to(tl.int64)
        k = tl.load(k_head + block[:, None] * stride_kb + offset[:, None] * stride_kp + d[None, :],
                    mask=s_ok[:, None], other=0.0)  # fmt: skip
        scores = tl.dot(q, tl.trans(k)) * scale
        if SOFTCAP:  # softcap * tanh(scores / softcap), tanh(x) = 1 - 2 / (exp(2x) + 1)
            scores = softcap - 2.0 * softcap / (tl.exp(2.0 * scores / softcap) + 1.0)
        scores = tl.where(s_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))  # finite: every step holds at least one position below end
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_head + block[:, None] * stride_vb + offset[:, None] * stride_vp + d[None, :],
                    mask=s_ok[:, None], other=0.0)  # fmt: skip
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    seen = l_i > 0  # false for an empty chunk (beyond the row's length): zeros and lse = -inf, which the merge skips
    if SPLITS == 1 and SINKS:  # the sink's share of the denominator, where the row has positions
        sink = tl.load(sinks_ptr + heads, mask=g < GROUP, other=0.0).to(tl.float32)
        l_i = tl.where(seen, l_i + tl.exp(sink - m_i), l_i)
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    if SPLITS == 1:  # the row's only chunk: the output itself (a padding row's: zeros)
        o = o_ptr + row * stride_or + heads[:, None] * stride_oh + d[None, :]
        tl.store(o, out.to(o_ptr.dtype.element_ty), mask=(g < GROUP)[:, None])
    else:
        lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
        where = (row * HEADS + heads) * SPLITS + split
        tl.store(part_ptr + where[:, None] * D + d[None, :], out, mask=(g < GROUP)[:, None])
        tl.store(lse_ptr + where, lse, mask=g < GROUP)


@triton.jit
def _merge_kernel(
    part_ptr, lse_ptr, sinks_ptr, o_ptr, stride_or, stride_oh,
    HEADS: tl.constexpr, SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, D: tl.constexpr, SINKS: tl.constexpr,
):  # fmt: skip
    row, head = tl.program_id(0), tl.program_id(1)
    sp = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D)
    where = (row * HEADS + head) * SPLITS + sp
    lse = tl.load(lse_ptr + where, mask=sp < SPLITS, other=float("-inf"))
    full = lse > float("-inf")  # an empty chunk's part is not read
    top = tl.max(lse, 0)
    weight = tl.where(full, tl.exp(lse - tl.where(top > float("-inf"), top, 0.0)), 0.0)
    parts = tl.load(part_ptr + where[:, None] * D + d[None, :], mask=full[:, None], other=0.0)
    total = tl.sum(weight, 0)
    if SINKS:  # the sink's share of the denominator
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        total = tl.where(total > 0, total + tl.exp(sink - top), total)
    out = tl.sum(parts * weight[:, None], 0) / tl.where(total > 0, total, 1.0)  # a padding row: no part, zeros
    tl.store(o_ptr + row * stride_or + head * stride_oh + d, out.to(o_ptr.dtype.element_ty))


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def splits_for(rows: int, kv_heads: int, device: torch.device) -> int:
    """How many programs split each row's positions: enough that rows x kv_heads x splits programs fill the GPU
    about twice over (two per multiprocessor), at least 1 and at most MAX_SPLITS. It depends on the rows and
    key/value heads alone, so one CUDA graph per row count serves every sequence length."""
    return min(MAX_SPLITS, max(1, triton.cdiv(2 * _multiprocessors(device), rows * kv_heads)))


def supported(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether paged_decode_attention takes these: CUDA, one query token in bfloat16 or float16 (in float32 the tensor
    cores' products round to TF32), keys and values of one power-of-two head size of 16 to 256, whole groups of query
    heads per key/value head, query and cache contiguous in their last dimension."""
    _, heads, q_len, head_dim = query.shape
    kv_heads = key_cache.shape[2]
    return (
        query.is_cuda and key_cache.is_cuda and q_len == 1 and query.dtype in (torch.bfloat16, torch.float16)
        and key_cache.dtype == query.dtype and key_cache.shape[3] == value_cache.shape[3] == head_dim
        and 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0 and heads % kv_heads == 0
        and query.stride(-1) == key_cache.stride(-1) == 1
    )  # fmt: skip


@torch.compiler.disable  # a Triton launch of its own; compiled graphs call it as it is, and CUDA graphs capture it
def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    splits: int,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    block: int = BLOCK_S,
    warps: int = WARPS,
    stages: int = STAGES,
) -> torch.Tensor:
    """softmax(q k^T * scale) v over each row's positions 0 .. lengths[r] - 1, for query [rows, heads, 1, D], key and
    value caches [num_blocks, block_size, kv_heads, D] (views are fine: strides are followed), block_tables
    [rows, max_blocks] int32 and lengths [rows] int32 (0: a padding row, whose output is zeros). With a `window`, only
    each row's last `window` positions; with `softcap`, the scores soft-capped; with `sinks` ([heads], one logit per
    query head), those logits in each head's softmax (see the module docstring). Each row's positions are split among
    `splits` programs (`splits_for`); `block`, `warps` and `stages` are the split kernel's launch parameters
    (bench/decode_attention.py measures them). Returns [rows, 1, heads, D] in the query's dtype, as
    transformers' attention functions do. The launch and its buffers depend on the shapes and `splits` alone, never on
    the lengths' values, so a CUDA graph of it replays for any lengths."""
    rows, heads, _, head_dim = query.shape
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = heads // kv_heads
    output = torch.empty(rows, 1, heads, head_dim, device=query.device, dtype=query.dtype)
    # One split writes `output` directly (the kernel then reads neither buffer); more write their parts and
    # log-sum-exps for the merge.
    part = lse = output
    if splits > 1:
        part = torch.empty(rows, heads, splits, head_dim, device=query.device, dtype=torch.float32)
        lse = torch.empty(rows, heads, splits, device=query.device, dtype=torch.float32)
    sinks = output if sinks is None else sinks.contiguous()  # read only with SINKS
    _split_kernel[(rows, kv_heads, splits)](
        query, key_cache, value_cache, block_tables, lengths, sinks, part, lse, output,
        query.stride(0), query.stride(1), output.stride(0), output.stride(2),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0), block_tables.stride(1),
        scale, window or 0, softcap or 0.0,
        HEADS=heads, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), D=head_dim, BLOCK=block,
        BLOCK_SIZE=block_size, SPLITS=splits, WINDOW=window is not None, SOFTCAP=softcap is not None,
        SINKS=sinks is not output, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    if splits > 1:
        _merge_kernel[(rows, heads)](
            part, lse, sinks, output, output.stride(0), output.stride(2),
            HEADS=heads, SPLITS=splits, SPLITS_PAD=max(2, triton.next_power_of_2(splits)), D=head_dim,
            SINKS=sinks is not output,
        )  # fmt: skip
    return output
