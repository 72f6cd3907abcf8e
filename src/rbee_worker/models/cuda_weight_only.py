"""Weight-only int8 matrix products on CUDA as Triton kernels, and int4 products with tinygemm's weights (the
activations stay bfloat16 / float16).

int8, why our own: on an H200, the products of one Llama-3.1-8B decode step (32 layers and the LM head, as a CUDA graph)
took 4.65 / 4.68 / 4.91 ms at 1 / 8 / 64 rows in bfloat16 (cuBLAS) and 55 ms at one row with PyTorch's
`_weight_int8pack_mm`; these kernels take 3.24 / 4.45 / 6.23 ms (bench/results/weight_only_kernels_NVIDIA_H200.json).

Layout: `codes` int8 [out, in] and one float32 scale per output row, w = code * scale. One row (a decode step of one
sequence) runs a GEMV kernel that accumulates in float32 on CUDA cores; more rows convert a tile of codes to the
activations' dtype (exact: |code| <= 127) for the tensor cores (`tl.dot`).

int4: tinygemm (`aten._weight_int4pack_mm`) for a few rows; beyond INT4_KERNEL_ROWS a kernel here dequantizes
tinygemm's packed weights (their layout read off the packing op itself, tinygemm_order) for cuBLAS: 8.4 ms for the 8B
step's weights on an H200, about 2.2 TB/s of reads and writes (13.6 ms when each weight loaded its own word).

Our own int4 kernels, written and measured in the 8B step's products at one row against tinygemm's 2.8 ms, and
dropped: GEMV kernels on three byte layouts, with and without a bit-trick int-to-float conversion, 3.5 to 5.2 ms; on
int32 words of 8 codes ([out, in / 8], a group's 32 codes in 4 words read by one thread, scales applied per group),
3.7 to 5.0 ms, 4.8 ms with a row's whole input width held in registers. A `tl.dot` kernel dequantizing its tiles in
registers took 9.3 ms at 8 rows against tinygemm's 5.5; one reading tinygemm's own blocks (each block's words loaded
once and ordered by a register gather, as the dequantizing kernel below does) took 66 to 96 ms from 1 to 64 rows. On
K-major words ([in / 8, out], columns read as vectors, split-K partials added up by the last program of a column
block, in order): 2.75 ms at one row, tinygemm's speed, but 6.6 / 16.0 ms at 2 / 8 rows with the weights held in
registers for a loop over the rows (tinygemm 3.0 / 5.5). A `tl.dot` kernel on the same words (a word's 8 codes are
consecutive inputs, so they unpack into a tile by a plain reshape), without split-K: 5.3 / 5.3 / 5.3 / 5.9 / 6.5 / 11.3
ms at 2 / 8 / 16 / 32 / 64 / 128 rows, against 2.9 / 5.5 / 8.7 / 12.4 / 12.5 / 12.9 for what runs here: faster from
8 rows on, slower below. With split-K for the few-row case it could replace tinygemm at every row count (not done).
"""

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# tinygemm up to this many rows, the dequantized weights with cuBLAS beyond. Products of an 8B decode step on an H200
# (q/k/v and gate/up merged): tinygemm 2.8 / 5.7 / 9.0 / 17.4 / 34 ms at 1 / 8 / 16 / 32 / 64 rows, dequantized with
# cuBLAS 12.9 to 13.1 ms from 1 to 64 rows (bench/results/weight_only_kernels_NVIDIA_H200_merged.json).
INT4_KERNEL_ROWS = 16
# tinygemm blocks of 8 rows per dequantizing program (with 2 warps). A one-off sweep on an H200, the 8B step's
# weights: 7.8 to 7.9 ms at 2 / 4 / 8 blocks, 8.3 at one; 4 warps 0.3 to 0.7 ms slower, 8 warps 1 to 2 ms.
DEQUANTIZE_ROW_BLOCKS = 4


def _gemv_configs() -> list[triton.Config]:
    """BLOCK_N rows per program, BLOCK_K inputs per row and step."""
    return [
        triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
        for n, k, w, s in (
            (4, 256, 4, 2), (8, 256, 4, 3), (8, 512, 4, 2), (16, 256, 4, 3), (16, 512, 8, 2), (32, 256, 8, 2),
            (4, 1024, 4, 2), (8, 1024, 8, 2),
        )
    ]  # fmt: skip


def _gemm_configs() -> list[triton.Config]:
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
        for m, n, k, w, s in ((16, 64, 256, 4, 3), (16, 128, 256, 4, 3), (32, 64, 256, 4, 3), (64, 128, 256, 8, 3))
    ]


@triton.autotune(configs=_gemv_configs(), key=["N", "K"])
@triton.jit
def _int8_gemv(x_ptr, w_ptr, s_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        codes = tl.load(w_ptr + rows[:, None] * K + ks[None, :], mask=row_ok[:, None] & (ks < K)[None, :], other=0)
        x = tl.load(x_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
        acc += codes.to(tl.float32) * x[None, :]
    scale = tl.load(s_ptr + rows, mask=row_ok, other=0.0)
    tl.store(y_ptr + rows, (tl.sum(acc, axis=1) * scale).to(y_ptr.dtype.element_ty), mask=row_ok)


@triton.autotune(configs=_gemm_configs(), key=["M", "N", "K"])
@triton.jit
def _int8_gemm(
    x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * K + ks[None, :], mask=(rm < M)[:, None] & (ks < K)[None, :], other=0.0)
        codes = tl.load(w_ptr + rn[:, None] * K + ks[None, :], mask=(rn < N)[:, None] & (ks < K)[None, :], other=0)
        acc += tl.dot(x, tl.trans(codes.to(x.dtype)))  # int8 codes are exact in bf16 / fp16
    scale = tl.load(s_ptr + rn, mask=rn < N, other=0.0)
    y = acc * scale[None, :]
    tl.store(
        y_ptr + rm[:, None] * N + rn[None, :], y.to(y_ptr.dtype.element_ty), mask=(rm < M)[:, None] & (rn < N)[None, :]
    )


def int8_matmul(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [rows, in] @ W^T for W = codes * scale (one float32 scale per output row)."""
    rows, inputs = x.shape
    outputs = codes.shape[0]
    x = x.contiguous()
    y = torch.empty(rows, outputs, device=x.device, dtype=x.dtype)
    if rows == 1:
        _int8_gemv[lambda meta: (triton.cdiv(outputs, meta["BLOCK_N"]),)](x, codes, scale, y, outputs, inputs)
    else:
        grid = lambda meta: (triton.cdiv(rows, meta["BLOCK_M"]), triton.cdiv(outputs, meta["BLOCK_N"]))  # noqa: E731
        _int8_gemm[grid](x, codes, scale, y, rows, outputs, inputs)
    return y


@functools.cache
def tinygemm_order(tiles: int, device: torch.device) -> torch.Tensor:
    """Where tinygemm's packing puts each weight of a block of 8 output rows x 16 * tiles inputs: for weight (r, c)
    at index r * 16 * tiles + c, the index of its nibble among the block's nibbles (its 16 * tiles int32 words in
    order, each from its low nibble up). Found by packing the weights' own indices 4 bits at a time, so it holds
    for whatever layout this PyTorch build's `_convert_weight_to_int4pack` produces."""
    width = 16 * tiles
    ids = torch.arange(8 * width, device=device).reshape(8, width)
    found = torch.zeros(8 * width, dtype=torch.int64, device=device)
    for shift in range(0, (8 * width - 1).bit_length(), 4):
        codes = (ids >> shift) & 15
        pairs = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)
        words = torch.ops.aten._convert_weight_to_int4pack(pairs, tiles).reshape(-1, 1)
        nibbles = (words >> torch.arange(0, 32, 4, device=device)) & 15
        found |= nibbles.reshape(-1).long() << shift
    order = torch.empty_like(found)
    order[found] = torch.arange(found.numel(), device=device)
    return order.to(torch.int32)


@triton.jit
def _tinygemm_dequantize(
    w_ptr, order_ptr, sz_ptr, out_ptr, N, K, WIDTH: tl.constexpr, ROW_BLOCKS: tl.constexpr
):  # fmt: skip
    """ROW_BLOCKS of tinygemm's blocks (8 output rows x WIDTH inputs, WIDTH contiguous int32 words each) down one
    k-block into W [out, in]. A block's words are loaded once, split into their nibbles, and put in (row, input)
    order by a gather in registers (tl.gather) instead of one load per weight."""
    k_block = tl.program_id(1)
    order = tl.load(order_ptr + tl.arange(0, 8 * WIDTH))
    columns = k_block * WIDTH + tl.arange(0, WIDTH)
    groups = k_block * (WIDTH // 32) + tl.arange(0, WIDTH // 32)
    for i in tl.static_range(ROW_BLOCKS):
        row_block = tl.program_id(0) * ROW_BLOCKS + i
        if row_block < N // 8:
            words = tl.load(w_ptr + (row_block * (K // WIDTH) + k_block) * WIDTH + tl.arange(0, WIDTH))
            nibbles = tl.reshape((words[:, None] >> (tl.arange(0, 8) * 4)[None, :]) & 15, (8 * WIDTH,))
            codes = tl.reshape(tl.gather(nibbles, order, axis=0), (8, WIDTH // 32, 32))
            rows = row_block * 8 + tl.arange(0, 8)
            where = (groups[None, :] * N + rows[:, None]) * 2
            scale = tl.load(sz_ptr + where).to(tl.float32)[:, :, None]
            zero = tl.load(sz_ptr + where + 1).to(tl.float32)[:, :, None]
            weight = tl.reshape((codes - 8).to(tl.float32) * scale + zero, (8, WIDTH))
            tl.store(out_ptr + rows[:, None] * K + columns[None, :], weight.to(out_ptr.dtype.element_ty))


def tinygemm_dequantize(packed: torch.Tensor, scales_and_zeros: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """W [out, in] in `dtype` for tinygemm's packed weights ([out / 8, in / (16 tiles), 32, tiles / 2] int32) and
    scales and zeros ([in / 32, out, 2]): w = (q - 8) * scale + zero."""
    groups, outputs, _ = scales_and_zeros.shape
    tiles = packed.shape[-1] * 2
    width, inputs = 16 * tiles, groups * 32
    weight = torch.empty(outputs, inputs, device=packed.device, dtype=dtype)
    order = tinygemm_order(tiles, packed.device)
    grid = (triton.cdiv(outputs // 8, DEQUANTIZE_ROW_BLOCKS), inputs // width)
    _tinygemm_dequantize[grid](
        packed, order, scales_and_zeros, weight, outputs, inputs, WIDTH=width, ROW_BLOCKS=DEQUANTIZE_ROW_BLOCKS,
        num_warps=2,
    )  # fmt: skip
    return weight


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """x [rows, in] @ W^T for tinygemm's int4 weights (group 32): tinygemm's own kernel for a few rows, the weights
    dequantized for cuBLAS for more (tinygemm's time grows with the rows: see INT4_KERNEL_ROWS)."""
    if x.shape[0] > INT4_KERNEL_ROWS:
        return F.linear(x, tinygemm_dequantize(packed, scales_and_zeros, x.dtype))
    return torch.ops.aten._weight_int4pack_mm(x.contiguous(), packed, 32, scales_and_zeros)
