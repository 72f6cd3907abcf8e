"""Weight-only int8 and int4 matrix products on CUDA as Triton kernels (the activations stay bfloat16 / float16).

int8, why our own: PyTorch's `_weight_int8pack_mm` is many times slower on CUDA than the bfloat16 product (cuBLAS),
while these kernels, reading half its bytes, are faster than it at one row and about as fast at a few
(bench/results/README.md).

Layout: `codes` int8 [out, in] and one float32 scale per output row, w = code * scale. One row (a decode step of one
sequence) runs a GEMV kernel that accumulates in float32 on CUDA cores; more rows convert a tile of codes to the
activations' dtype (exact: |code| <= 127) for the tensor cores (`tl.dot`).

int4 (group 32, w = (q - 8) * scale + zero): K-major int32 words, `words[w, n]` holding the codes of inputs 8w .. 8w + 7
of output n (code j in bits 4j .. 4j + 3), so a program reads whole rows of words as vectors along the outputs and a
word's 8 codes are consecutive inputs; scales and zeros [in / 32, out, 2] bfloat16, one int32 per (group, output).
- What limits these products is instruction issue, not memory: a GEMV that converts its codes with int-to-float
  instructions stays well below the memory's bandwidth (bench/results/README.md). So the kernels decode without
  int-to-float conversions: a code goes into a float32's mantissa under 1.0's exponent (f = 1 + q / 16, or
  1 + q / 256 one byte lower) by a shift and an and-or; 1.0 comes in as a kernel argument, because with both
  constants immediate ptxas needs two logic instructions.
- One row: a GEMV kernel with one shift per two codes, each program loading one word row of its groups at a time so
  that the FMAs accumulate straight into per-group sums, and the zero points folded into sums of x, which about
  halves the instructions per weight (bench/results/README.md). Up to INT4_DOT_ROWS rows: a `tl.dot` kernel decoding
  a tile the same way. Both split the inputs across programs (split-K); the partial sums go to a float32 workspace
  and the last program of an output tile to arrive (an atomic counter per tile, reset by that program) adds them up
  in a fixed order, so results do not depend on timing. Beyond INT4_DOT_ROWS: the weights dequantized for cuBLAS.
- How the products of an 8B decode step compare with PyTorch's tinygemm (`_weight_int4pack_mm`) and with bfloat16 at
  each row count, and the layouts and kernels that lost to these: bench/results/README.md.
"""

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# The int4 tl.dot kernel up to this many rows, the weights dequantized for cuBLAS beyond, where that is the faster of
# the two (bench/weight_only_kernels.py; bench/results/README.md).
INT4_DOT_ROWS = 128
# The int4 GEMV's tile, BLOCK_N outputs x GROUPS groups of 32 inputs with 2 warps: the fastest of those compared for
# the products of an 8B decode step (bench/results/README.md).
GEMV_BLOCK_N, GEMV_GROUPS = 32, 16
FLOAT_ONE = 0x3F800000  # the bits of float32 1.0


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


# Tuned per power of two of the rows (M_BUCKET), not per row count: a prompt's LM head runs at any count of rows.
@triton.autotune(configs=_gemm_configs(), key=["M_BUCKET", "N", "K"])
@triton.jit
def _int8_gemm(
    x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, M_BUCKET,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
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
        _int8_gemm[grid](x, codes, scale, y, rows, outputs, inputs, triton.next_power_of_2(rows))
    return y


@functools.cache
def _tile_counters(device: torch.device) -> torch.Tensor:
    """One arrival counter per output tile for the split-K kernels, zero between kernels (each last program resets
    its tile's). Shared by every int4 layer on the device: their kernels run one after another on one stream."""
    return torch.zeros(1 << 17, device=device, dtype=torch.int32)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """codes [out, in] (0..15, in a multiple of 32) -> words [in / 8, out] int32, code j of word w = input 8w + j."""
    outputs, inputs = codes.shape
    # split-K runs over one row tile (_int4_dot_prune), so at most one counter per 32 outputs
    if triton.cdiv(outputs, 32) > _tile_counters(codes.device).numel():
        raise ValueError(f"{outputs} outputs: more output tiles than the int4 kernels have counters")
    by_word = codes.T.reshape(inputs // 8, 8, outputs)
    words = torch.zeros(inputs // 8, outputs, device=codes.device, dtype=torch.int64)
    for j in range(8):
        words |= by_word[:, j].to(torch.int64) << (4 * j)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


@triton.jit
def _scale_and_zero(pairs):
    """float32 scale and zero from int32 words each holding a bfloat16 scale (low half) and zero (high half)."""
    scale = (pairs << 16).to(tl.float32, bitcast=True)
    zero = (pairs & -65536).to(tl.float32, bitcast=True)
    return scale, zero


@triton.jit
def _weight_tile(words, pairs, one, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The float32 weights [BLOCK_K, BLOCK_N] of words [BLOCK_K / 8, BLOCK_N] and their groups' scale and zero
    pairs [BLOCK_K / 32, BLOCK_N]. Code j goes to mantissa bits 19 .. 22, f = 1 + q / 16 (the shift amounts are
    constants per register once unrolled), and w = (q - 8) s + z = 16 s f + z - 24 s."""
    j = tl.arange(0, 8)[None, :, None]
    moved = (words[:, None, :] << tl.maximum(19 - 4 * j, 0)) >> tl.maximum(4 * j - 19, 0)
    f = tl.reshape(((moved & 0x780000) | one).to(tl.float32, bitcast=True), (BLOCK_K // 32, 32, BLOCK_N))
    scale, zero = _scale_and_zero(pairs)
    return tl.reshape(f * (16.0 * scale)[:, None, :] + (zero - 24.0 * scale)[:, None, :], (BLOCK_K, BLOCK_N))


@triton.jit
def _finish_split(acc, part_ptr, count_ptr, y_ptr, tile, offsets, mask, TILE: tl.constexpr, SPLITS: tl.constexpr):
    """Add this program's partial `acc` (float32, TILE elements at `offsets` of y) into y: the last of the output
    tile's SPLITS programs (tl.num_programs(2)) to arrive adds every partial up in order and stores y. The sum is
    unrolled so that all the partials' loads are in flight at once: as a loop over a runtime count, each load would
    wait for the one before, one L2 round trip per split on the kernel's critical path."""
    if SPLITS == 1:
        tl.store(y_ptr + offsets, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tiles = tl.num_programs(0) * tl.num_programs(1)
        element = tl.arange(0, TILE)
        tl.store(part_ptr + (tl.program_id(2) * tiles + tile) * TILE + element, tl.reshape(acc, (TILE,)))
        tl.debug_barrier()  # every thread's partial is written before the count goes up
        if tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
            total = tl.zeros((TILE,), dtype=tl.float32)
            for i in tl.static_range(SPLITS):
                total += tl.load(part_ptr + (i * tiles + tile) * TILE + element, cache_modifier=".cg")
            tl.store(y_ptr + offsets, tl.reshape(total, acc.shape).to(y_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")


@triton.jit
def _eight(t):
    """[..., 8] -> its 8 slices along the last dim, in order (splits in registers)."""
    a, b = tl.split(tl.reshape(t, t.shape[:-1] + (4, 2)))  # noqa: RUF005  j even, j odd: [..., 4] by j // 2
    a0, a1 = tl.split(tl.reshape(a, a.shape[:-1] + (2, 2)))  # noqa: RUF005  j = 0, 4 / j = 2, 6
    b0, b1 = tl.split(tl.reshape(b, b.shape[:-1] + (2, 2)))  # noqa: RUF005  j = 1, 5 / j = 3, 7
    x0, x4 = tl.split(a0)
    x2, x6 = tl.split(a1)
    x1, x5 = tl.split(b0)
    x3, x7 = tl.split(b1)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _int4_gemv(
    x_ptr, w_ptr, sz_ptr, y_ptr, part_ptr, count_ptr, N, K, one,
    BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    """One row: BLOCK_N outputs x GROUPS groups of 32 inputs per program, SPLITS programs along the inputs."""
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    groups = tl.program_id(2) * GROUPS + tl.arange(0, GROUPS)
    g_ok = groups < K // 32
    ok = g_ok[:, None] & n_ok[None, :]
    even = tl.zeros((GROUPS, BLOCK_N), dtype=tl.float32)
    odd = tl.zeros((GROUPS, BLOCK_N), dtype=tl.float32)
    x_even = tl.zeros((GROUPS,), dtype=tl.float32)
    x_all = tl.zeros((GROUPS,), dtype=tl.float32)
    for r in tl.static_range(4):
        rows = groups * 4 + r
        words = tl.load(w_ptr + rows[:, None] * N + rn[None, :], mask=ok, other=0)
        x = tl.load(x_ptr + rows[:, None] * 8 + tl.arange(0, 8)[None, :], mask=g_ok[:, None], other=0.0)
        x = x.to(tl.float32)
        xs = _eight(x)
        for m in tl.static_range(4):
            # codes 2m and 2m + 1 (bits 8m .. 8m + 7) to mantissa bits 15 .. 18 and 19 .. 22: one shift for two
            moved = words << (15 - 8 * m) if m < 2 else words >> (8 * m - 15)
            even += ((moved & 0x78000) | one).to(tl.float32, bitcast=True) * xs[2 * m][:, None]  # 1 + q / 256
            odd += ((moved & 0x780000) | one).to(tl.float32, bitcast=True) * xs[2 * m + 1][:, None]  # 1 + q / 16
        x_even += xs[0] + xs[2] + xs[4] + xs[6]
        x_all += tl.sum(x, axis=1)
    scale, zero = _scale_and_zero(tl.load(sz_ptr + groups[:, None] * N + rn[None, :], mask=ok, other=0))
    # the sum of q x is 256 (even - x_even) + 16 (odd - x_odd), and w = (q - 8) s + z
    offset = (256.0 * x_even + 16.0 * (x_all - x_even) + 8.0 * x_all)[:, None]
    acc = tl.sum(scale * (256.0 * even + 16.0 * odd - offset) + zero * x_all[:, None], axis=0)
    _finish_split(acc, part_ptr, count_ptr, y_ptr, tl.program_id(1), rn, n_ok, BLOCK_N, SPLITS)


def _int4_dot_configs() -> list[triton.Config]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K): the tiles that a wider autotuning chose for some shape of an 8B decode
    step at 1 to 512 rows, and their neighbours (bench/results/README.md)."""
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "SPLIT_K": s}, num_warps=4, num_stages=3)
        for m, n, k, s in (
            (16, 128, 64, 1), (16, 128, 64, 4), (16, 128, 64, 8), (16, 128, 128, 1), (16, 128, 128, 4),
            (16, 128, 128, 8), (16, 64, 128, 4),
            (32, 32, 128, 1), (32, 32, 128, 2), (32, 128, 64, 1), (32, 128, 128, 1),
            (64, 32, 128, 2), (64, 64, 128, 1), (64, 64, 128, 2),
        )
    ]  # fmt: skip


def _int4_dot_prune(configs: list[triton.Config], named_args: dict, **kwargs: object) -> list[triton.Config]:
    """Row tiles of 16 up to 16 rows, 32 up to 32, 64 beyond; split-K only up to 64 rows, so that the partial sums
    never need more than 128 rows of workspace (int4_dot's `part`)."""
    bucket = named_args["M_BUCKET"]
    height = min(max(16, bucket), 64)
    return [c for c in configs if c.kwargs["BLOCK_M"] == height and (bucket <= 64 or c.kwargs["SPLIT_K"] == 1)]


@triton.autotune(
    configs=_int4_dot_configs(), key=["M_BUCKET", "N", "K"], prune_configs_by={"early_config_prune": _int4_dot_prune}
)
@triton.jit
def _int4_dot(
    x_ptr, w_ptr, sz_ptr, y_ptr, part_ptr, count_ptr, M, N, K, one, M_BUCKET,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):  # fmt: skip
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = (rn < N)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    for k0 in range(tl.program_id(2) * per_split, tl.minimum(K, (tl.program_id(2) + 1) * per_split), BLOCK_K):
        word_rows = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        words = tl.load(
            w_ptr + word_rows[:, None] * N + rn[None, :], mask=(word_rows < K // 8)[:, None] & n_ok, other=0
        )
        groups = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        pairs = tl.load(sz_ptr + groups[:, None] * N + rn[None, :], mask=(groups < K // 32)[:, None] & n_ok, other=0)
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * K + ks[None, :], mask=(rm < M)[:, None] & (ks < K)[None, :], other=0.0)
        acc += tl.dot(x, _weight_tile(words, pairs, one, BLOCK_K, BLOCK_N).to(x.dtype))
    tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    mask = (rm < M)[:, None] & n_ok
    offsets = rm[:, None] * N + rn[None, :]
    _finish_split(acc, part_ptr, count_ptr, y_ptr, tile, offsets, mask, BLOCK_M * BLOCK_N, SPLIT_K)


@triton.jit
def _int4_dequantize(w_ptr, sz_ptr, out_ptr, N, K, one, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """W [out, in] from the int4 words, a tile of BLOCK_K inputs x BLOCK_N outputs per program."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = (rn < N)[None, :]
    word_rows = tl.program_id(1) * BLOCK_K // 8 + tl.arange(0, BLOCK_K // 8)
    words = tl.load(w_ptr + word_rows[:, None] * N + rn[None, :], mask=(word_rows < K // 8)[:, None] & n_ok, other=0)
    groups = tl.program_id(1) * BLOCK_K // 32 + tl.arange(0, BLOCK_K // 32)
    pairs = tl.load(sz_ptr + groups[:, None] * N + rn[None, :], mask=(groups < K // 32)[:, None] & n_ok, other=0)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    weight = _weight_tile(words, pairs, one, BLOCK_K, BLOCK_N)
    tl.store(
        out_ptr + rn[None, :] * K + ks[:, None], weight.to(out_ptr.dtype.element_ty), mask=(ks < K)[:, None] & n_ok
    )


def int4_dequantize(words: torch.Tensor, scales_and_zeros: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """W [out, in] in `dtype` from pack_int4's words and scales and zeros ([in / 32, out, 2])."""
    inputs, outputs = words.shape[0] * 8, words.shape[1]
    weight = torch.empty(outputs, inputs, device=words.device, dtype=dtype)
    grid = (triton.cdiv(outputs, 64), triton.cdiv(inputs, 64))
    _int4_dequantize[grid](words, scales_and_zeros.view(torch.int32), weight, outputs, inputs, FLOAT_ONE, 64, 64)
    return weight


# An opaque operator to torch.compile: traced into, the kernels' workspace and tile counters would be functionalized
# (copied at every call).
@torch.library.custom_op("rbee::int4_matmul", mutates_args=())
def int4_matmul(x: torch.Tensor, words: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """x [rows, in] @ W^T for pack_int4's words and scales and zeros ([in / 32, out, 2] bfloat16)."""
    rows = x.shape[0]
    if rows > INT4_DOT_ROWS:
        return F.linear(x, int4_dequantize(words, scales_and_zeros, x.dtype))
    if rows == 1:
        return int4_gemv(x, words, scales_and_zeros)
    return int4_dot(x, words, scales_and_zeros)


@int4_matmul.register_fake
def _(x: torch.Tensor, words: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], words.shape[1])


def int4_gemv(x: torch.Tensor, words: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """x [1, in] @ W^T by the GEMV kernel."""
    inputs, outputs = x.shape[1], words.shape[1]
    y = torch.empty(1, outputs, device=x.device, dtype=x.dtype)
    splits = triton.cdiv(inputs // 32, GEMV_GROUPS)
    part = torch.empty(splits * triton.cdiv(outputs, GEMV_BLOCK_N) * GEMV_BLOCK_N, device=x.device, dtype=torch.float32)
    grid = (1, triton.cdiv(outputs, GEMV_BLOCK_N), splits)
    _int4_gemv[grid](
        x.contiguous(), words, scales_and_zeros.view(torch.int32), y, part, _tile_counters(x.device), outputs, inputs,
        FLOAT_ONE, BLOCK_N=GEMV_BLOCK_N, GROUPS=GEMV_GROUPS, SPLITS=splits, num_warps=2, num_stages=1,
    )  # fmt: skip
    return y


def int4_dot(x: torch.Tensor, words: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """x @ W^T by the tl.dot kernel (int4_matmul runs it from 2 to INT4_DOT_ROWS rows)."""
    rows, inputs = x.shape
    outputs = words.shape[1]
    y = torch.empty(rows, outputs, device=x.device, dtype=x.dtype)
    # the largest workspace _int4_dot_prune allows: 8 splits of a tile 16 rows high, 2 of one 32 or 64 high
    part = torch.empty(128 * (outputs + 127), device=x.device, dtype=torch.float32)
    grid = lambda meta: (triton.cdiv(rows, meta["BLOCK_M"]), triton.cdiv(outputs, meta["BLOCK_N"]), meta["SPLIT_K"])  # noqa: E731
    _int4_dot[grid](
        x.contiguous(), words, scales_and_zeros.view(torch.int32), y, part, _tile_counters(x.device), rows, outputs,
        inputs, FLOAT_ONE, triton.next_power_of_2(rows),
    )  # fmt: skip
    return y
