"""Weight-only int8 matrix products on CUDA, as Triton kernels (the activations stay bfloat16 / float16).

Why our own: on an H200, the products of one Llama-3.1-8B decode step (32 layers and the LM head, as a CUDA graph)
took 4.65 / 4.68 / 4.91 ms at 1 / 8 / 64 rows in bfloat16 (cuBLAS) and 55 ms at one row with PyTorch's
`_weight_int8pack_mm`; these kernels take 3.24 / 4.45 / 6.23 ms (bench/results/weight_only_kernels_NVIDIA_H200.json).

Layout: `codes` int8 [out, in] and one float32 scale per output row, w = code * scale. One row (a decode step of one
sequence) runs a GEMV kernel that accumulates in float32 on CUDA cores; more rows convert a tile of codes to the
activations' dtype (exact: |code| <= 127) for the tensor cores (`tl.dot`).
"""

import torch
import triton
import triton.language as tl


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
