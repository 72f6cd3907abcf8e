"""Attention of a decode step on CUDA (one query token per row) as a split-KV Triton kernel ("flash decoding").

Why: one decode step of one sequence is little work, rows x key/value heads wide (8 for a Llama-3.1-8B shape), on a
GPU with many multiprocessors (132 on an H200), and SDPA's kernel (cuDNN's there) takes several times as long for
it as this one (bench/results/README.md). Here the span is also split into chunks, each a thread block, and a second
small kernel merges the chunks' partial results by their log-sum-exp. The query heads that share a key/value head are
one block's rows (GQA), so each key and value is read once. A block of positions that the mask hides entirely (the
padding of the span bucket beyond every row's length) is skipped without reading its keys and values, so the work
follows the sequences' lengths rather than the bucket's: a step's time barely grows with the span bucket.

The mask is the engine's additive one ([rows, 1, 1, span]: 0 where visible, the dtype's minimum elsewhere).
"""

import functools

import torch
import triton
import triton.language as tl

BLOCK_S = 64  # key positions per step of a block


@triton.jit
def _split_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, part_ptr, lse_ptr,
    stride_qr, stride_qh, stride_kr, stride_kh, stride_ks, stride_vr, stride_vh, stride_vs, stride_mr,
    span, chunk, scale,
    HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
    SPLITS: tl.constexpr,
):  # fmt: skip
    row, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D)
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + row * stride_qr + heads[:, None] * stride_qh + d[None, :], mask=(g < GROUP)[:, None], other=0.0)
    m_i = tl.full((GROUP_PAD,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((GROUP_PAD,), dtype=tl.float32)
    acc = tl.zeros((GROUP_PAD, D), dtype=tl.float32)
    start = split * chunk
    end = tl.minimum(start + chunk, span)
    for s0 in range(start, end, BLOCK):
        s = s0 + tl.arange(0, BLOCK)
        s_ok = s < end
        bias = tl.load(mask_ptr + row * stride_mr + s, mask=s_ok, other=float("-inf")).to(tl.float32)
        if tl.max(bias, 0) > -1e30:  # some position of this block is visible (hidden ones hold the dtype's minimum)
            k = tl.load(k_ptr + row * stride_kr + kv_head * stride_kh + s[:, None] * stride_ks + d[None, :],
                        mask=s_ok[:, None], other=0.0)  # fmt: skip
            scores = tl.dot(q, tl.trans(k)) * scale + bias[None, :]
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            p = tl.exp(scores - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + row * stride_vr + kv_head * stride_vh + s[:, None] * stride_vs + d[None, :],
                        mask=s_ok[:, None], other=0.0)  # fmt: skip
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    where = (row * HEADS + heads) * SPLITS + split
    tl.store(part_ptr + where[:, None] * D + d[None, :], out, mask=(g < GROUP)[:, None])
    tl.store(lse_ptr + where, lse, mask=g < GROUP)


@triton.jit
def _merge_kernel(
    part_ptr, lse_ptr, o_ptr, stride_or, stride_oh,
    HEADS: tl.constexpr, SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, D: tl.constexpr,
):  # fmt: skip
    row, head = tl.program_id(0), tl.program_id(1)
    sp = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D)
    where = (row * HEADS + head) * SPLITS + sp
    lse = tl.load(lse_ptr + where, mask=sp < SPLITS, other=float("-inf"))
    weight = tl.exp(lse - tl.max(lse, 0))
    parts = tl.load(part_ptr + where[:, None] * D + d[None, :], mask=(sp < SPLITS)[:, None], other=0.0)
    out = tl.sum(parts * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(o_ptr + row * stride_or + head * stride_oh + d, out.to(o_ptr.dtype.element_ty))


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def supported(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether decode_attention takes these: CUDA, one query token in bfloat16 or float16 (in float32 the tensor
    cores' products round to TF32), a power-of-two head size of 16 to 256, whole groups of query heads per key/value
    head, rows contiguous in the last dimension, the engine's mask."""
    rows, heads, q_len, head_dim = query.shape
    return (
        query.is_cuda and q_len == 1 and query.dtype in (torch.bfloat16, torch.float16)
        and mask is not None and mask.shape == (rows, 1, 1, key.shape[2])
        and 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0 and heads % key.shape[1] == 0
        and query.stride(-1) == key.stride(-1) == mask.stride(-1) == 1
    )  # fmt: skip


@torch.compiler.disable  # its launch parameters follow the span: compiled, each span bucket would recompile
def decode_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v for query [rows, heads, 1, D], key and value [rows, kv_heads, span, D] (views
    into the cache are fine) and mask [rows, 1, 1, span]; returns [rows, 1, heads, D], as transformers' attention
    functions do."""
    rows, heads, _, head_dim = query.shape
    kv_heads, span = key.shape[1], key.shape[2]
    group = heads // kv_heads
    blocks = triton.cdiv(span, BLOCK_S)
    splits = min(blocks, max(1, triton.cdiv(2 * _multiprocessors(query.device), rows * kv_heads)))
    chunk = triton.cdiv(blocks, splits) * BLOCK_S
    splits = triton.cdiv(span, chunk)
    part = torch.empty(rows, heads, splits, head_dim, device=query.device, dtype=torch.float32)
    lse = torch.empty(rows, heads, splits, device=query.device, dtype=torch.float32)
    _split_kernel[(rows, kv_heads, splits)](
        query, key, value, mask, part, lse,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), mask.stride(0),
        span, chunk, scale,
        HEADS=heads, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), D=head_dim, BLOCK=BLOCK_S,
        SPLITS=splits, num_warps=4,
    )  # fmt: skip
    output = torch.empty(rows, 1, heads, head_dim, device=query.device, dtype=query.dtype)
    _merge_kernel[(rows, heads)](
        part, lse, output, output.stride(0), output.stride(2),
        HEADS=heads, SPLITS=splits, SPLITS_PAD=max(2, triton.next_power_of_2(splits)), D=head_dim,
    )  # fmt: skip
    return output
