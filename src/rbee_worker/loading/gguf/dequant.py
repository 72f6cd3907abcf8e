"""Vectorized torch dequantization of GGML tensor data.

Each quantized type is a run of fixed-size blocks (`gguf.constants.GGML_QUANT_SIZES` gives values per block and
bytes per block). We view the bytes as a `(n_blocks, type_size)` uint8 tensor, slice the fields out as views and
unpack every block at once. The arithmetic mirrors `gguf.quants` (the numpy reference) operation by operation, in
float32 and without fused multiply-adds, so the results are bit-identical to it; other dtypes are one final cast.
"""

import math
from collections.abc import Callable

import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from rbee_worker.errors import ModelLoadError
from rbee_worker.hardware.cpu_features import cpu_features

_T = GGMLQuantizationType


def _unpack(packed: torch.Tensor, run: int, bits: int) -> torch.Tensor:
    """Split the bytes of `packed` (n_blocks, k) into `bits`-wide fields, in element order.

    ggml packs values in runs of `run` bytes: field j of byte i of a run is element j * run + i of that run.
    """
    n_blocks = packed.shape[0]
    # Made on the data's device (a CUDA tensor cannot be shifted by a CPU one) without a host-to-device copy.
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device).view(1, 1, -1, 1)
    fields = (packed.reshape(n_blocks, -1, 1, run) >> shifts) & ((1 << bits) - 1)
    return fields.reshape(n_blocks, -1)


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 field at byte `start` of every block, as a float32 (n_blocks, 1) column."""
    return blocks[:, start : start + 2].view(torch.float16).float()


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12-byte Q4_K/Q5_K field into eight 6-bit scales and eight 6-bit mins (ggml's get_scale_min_k4)."""
    d, m, m_d = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat((d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)), dim=1)
    mins = torch.cat((m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)), dim=1)
    return scales, mins


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    q = _unpack(blocks[:, 2:], 16, 4).view(torch.int8) - 8
    return q.float().mul_(_f16(blocks, 0))


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    q = _unpack(blocks[:, 4:], 16, 4)
    return q.float().mul_(_f16(blocks, 0)).add_(_f16(blocks, 2))


def _q5(blocks: torch.Tensor, qh_start: int) -> torch.Tensor:
    """The 5-bit values of Q5_0/Q5_1: low nibbles plus one high bit each from a little-endian uint32."""
    high = _unpack(blocks[:, qh_start : qh_start + 4], 1, 1)
    return _unpack(blocks[:, qh_start + 4 :], 16, 4) | (high << 4)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    q = _q5(blocks, 2).view(torch.int8) - 16
    return q.float().mul_(_f16(blocks, 0))


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    return _q5(blocks, 4).float().mul_(_f16(blocks, 0)).add_(_f16(blocks, 2))


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return blocks[:, 2:].view(torch.int8).float().mul_(_f16(blocks, 0))


def _q2_k(blocks: torch.Tensor) -> torch.Tensor:
    n_blocks = blocks.shape[0]
    scales = blocks[:, 0:16]
    dl = (_f16(blocks, 80) * (scales & 0x0F).float()).view(n_blocks, 16, 1)
    ml = (_f16(blocks, 82) * (scales >> 4).float()).view(n_blocks, 16, 1)
    q = _unpack(blocks[:, 16:80], 32, 2).float().view(n_blocks, 16, 16)
    return q.mul_(dl).sub_(ml).view(n_blocks, -1)


def _q3_k(blocks: torch.Tensor) -> torch.Tensor:
    n_blocks = blocks.shape[0]
    packed = blocks[:, 96:108]
    scales = _unpack(packed[:, 0:8], 8, 4) | (_unpack(packed[:, 8:12], 4, 2) << 4)
    dl = (_f16(blocks, 108) * (scales.view(torch.int8) - 32).float()).view(n_blocks, 16, 1)
    low = _unpack(blocks[:, 32:96], 32, 2)
    # A set hmask bit means "no offset"; a clear one subtracts 4.
    high = (_unpack(blocks[:, 0:32], 32, 1) ^ 1) << 2
    q = (low.view(torch.int8) - high.view(torch.int8)).float().view(n_blocks, 16, 16)
    return q.mul_(dl).view(n_blocks, -1)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n_blocks = blocks.shape[0]
    scales, mins = _k_scales(blocks[:, 4:16])
    d = (_f16(blocks, 0) * scales.float()).view(n_blocks, 8, 1)
    dm = (_f16(blocks, 2) * mins.float()).view(n_blocks, 8, 1)
    q = _unpack(blocks[:, 16:], 32, 4).float().view(n_blocks, 8, 32)
    return q.mul_(d).sub_(dm).view(n_blocks, -1)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    n_blocks = blocks.shape[0]
    scales, mins = _k_scales(blocks[:, 4:16])
    d = (_f16(blocks, 0) * scales.float()).view(n_blocks, 8, 1)
    dm = (_f16(blocks, 2) * mins.float()).view(n_blocks, 8, 1)
    q = _unpack(blocks[:, 48:], 32, 4) | (_unpack(blocks[:, 16:48], 32, 1) << 4)
    return q.float().view(n_blocks, 8, 32).mul_(d).sub_(dm).view(n_blocks, -1)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n_blocks = blocks.shape[0]
    d = (_f16(blocks, 208) * blocks[:, 192:208].view(torch.int8).float()).view(n_blocks, 16, 1)
    q = _unpack(blocks[:, 0:128], 64, 4) | (_unpack(blocks[:, 128:192], 32, 2) << 4)
    q = (q.view(torch.int8) - 32).float().view(n_blocks, 16, 16)
    return q.mul_(d).view(n_blocks, -1)


# Block dequantizers: (n_blocks, type_size) uint8 -> (n_blocks, block_size) float32.
_BLOCK_DEQUANTIZERS: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
    _T.Q4_0: _q4_0,
    _T.Q4_1: _q4_1,
    _T.Q5_0: _q5_0,
    _T.Q5_1: _q5_1,
    _T.Q8_0: _q8_0,
    _T.Q2_K: _q2_k,
    _T.Q3_K: _q3_k,
    _T.Q4_K: _q4_k,
    _T.Q5_K: _q5_k,
    _T.Q6_K: _q6_k,
}
# Plain floating-point types: a reinterpretation and a cast.
_FLOAT_TYPES = {_T.F32: torch.float32, _T.F16: torch.float16, _T.BF16: torch.bfloat16}

SUPPORTED_TYPES: frozenset[int] = frozenset(_FLOAT_TYPES.keys() | _BLOCK_DEQUANTIZERS.keys())


def type_name(ggml_type: int) -> str:
    """`Q4_K` for a known GGML type, `#99` for an unknown one."""
    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"#{ggml_type}"


def dequantize(
    raw: torch.Tensor, ggml_type: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Dequantize the bytes `raw` of one tensor of `ggml_type` into a new `dtype` tensor of `shape`.

    `raw` may be a view into a read-only mmap: it is only read, and the result never aliases it.
    """
    if ggml_type not in SUPPORTED_TYPES:
        supported = ", ".join(type_name(t) for t in sorted(SUPPORTED_TYPES))
        raise ModelLoadError(
            f"GGML type {type_name(ggml_type)} is not supported by rbee-worker (it reads {supported}); "
            "use a GGUF quantized to one of those"
        )
    if math.prod(shape) == 0:  # legal in GGUF; the block reshapes below cannot infer a size from nothing
        _check_size(raw, ggml_type, shape)
        return torch.empty(shape, dtype=dtype, device=raw.device)
    if (float_dtype := _FLOAT_TYPES.get(ggml_type)) is not None:
        return _blocks(raw, ggml_type, shape).reshape(-1).view(float_dtype).to(dtype, copy=True).view(shape)
    values = _BLOCK_DEQUANTIZERS[ggml_type](_blocks(raw, ggml_type, shape))
    return values.view(shape).to(dtype)


# The types whose blocks are groups of 32 four-bit codes with a scale (and offset) each: w = (q - 8) * scale + zero.
INT4_GROUP_TYPES = frozenset({_T.Q4_0, _T.Q4_1, _T.Q4_K})
INT4_GROUP = 32


def int4_groups(raw: torch.Tensor, ggml_type: int, shape: tuple[int, int]) -> tuple[torch.Tensor, ...]:
    """A Q4_0 / Q4_1 / Q4_K matrix as it is stored, without dequantizing: codes (rows, cols) uint8 in 0..15, and per
    group of 32 along a row a scale and a zero (rows, cols / 32) in float32, such that w = (q - 8) * scale + zero.

    Q4_0: scale d, zero 0. Q4_1: w = q * d + m, so zero = m + 8 d. Both equal `dequantize` exactly in float32.
    Q4_K: eight groups of 32 per block of 256, w = q * (d * sc) - dmin * m with 6-bit sc and m, so scale = d * sc
    (exact) and zero = 8 * scale - dmin * m, which float32 rounds when its two terms are far apart in magnitude (at
    most half a unit in the last place of the zero: 2^-24 of it)."""
    if ggml_type not in INT4_GROUP_TYPES:
        raise ValueError(f"{type_name(ggml_type)} is not a 4-bit group type")
    blocks = _blocks(raw, ggml_type, shape)
    rows, cols = shape
    groups = (rows, cols // INT4_GROUP)
    if ggml_type == _T.Q4_K:
        sub_scales, sub_mins = _k_scales(blocks[:, 4:16])
        scales = _f16(blocks, 0) * sub_scales.float()
        zeros = 8 * scales - _f16(blocks, 2) * sub_mins.float()
        codes = _unpack(blocks[:, 16:], 32, 4)
        return codes.reshape(rows, cols), scales.reshape(groups), zeros.reshape(groups)
    offset = 2 if ggml_type == _T.Q4_0 else 4
    codes = _unpack(blocks[:, offset:], 16, 4).reshape(rows, cols)
    scales = _f16(blocks, 0)
    zeros = torch.zeros_like(scales) if ggml_type == _T.Q4_0 else _f16(blocks, 2) + 8 * scales
    return codes, scales.reshape(groups), zeros.reshape(groups)


# The types whose matrices stay 8-bit: one int8 code per weight. Q8_0 is 8-bit already; Q5_K and Q6_K fit with room
# to spare (a row's int8 step is at most a quarter of their 5- or 6-bit step at the row's largest block).
INT8_TYPES = frozenset({_T.Q8_0, _T.Q5_K, _T.Q6_K})
INT8_GROUP = 32

# The dtype PyTorch's CPU int4 and int8 weight-only kernels compute in, whatever the model's: their scales have it, and
# the activations are cast to it for the call. It is the only fast one on x86 with AVX2 or AVX-512, with or without
# BF16: float32 and float16 activations take a scalar path, many times slower (bench/results/README.md).
KERNEL_DTYPE = torch.bfloat16

# From this many activation rows (a long prompt), PyTorch's CPU int4 and int8 weight-only kernels are slower than
# oneDNN's product (AMX where the CPU has it) on the matrix dequantized for the call: Int4Linear and Int8Linear
# then dequantize (bench/results/README.md).
CPU_DEQUANTIZE_ROWS = 256


def cpu_product_dequantizes(rows: int, dtype: torch.dtype) -> bool:
    """Whether a CPU int4 / int8 product over `rows` rows of `dtype` activations dequantizes its matrix to `dtype`:
    for long prompts, where oneDNN computes that dtype on this CPU (bfloat16 without oneDNN runs slower than the
    kernels). Never while torch.compile traces: the comparison would split the compiled forward into two classes of
    shapes."""
    return not torch.compiler.is_compiling() and rows >= CPU_DEQUANTIZE_ROWS and cpu_features().onednn_runs(dtype)


def int8_groups(raw: torch.Tensor, ggml_type: int, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 matrix as it is stored, without dequantizing: codes (rows, cols) int8 and per group of 32 along a row
    the float16 scale d (rows, cols / 32), w = q * d; codes.float() * d.float() is `dequantize` bit for bit. The
    tensors are new, never views of `raw`."""
    if ggml_type != _T.Q8_0:
        raise ValueError(f"{type_name(ggml_type)} is not Q8_0")
    blocks = _blocks(raw, ggml_type, shape)
    rows, groups = shape[0], shape[1] // INT8_GROUP
    # Copied out of the blocks (which may be a read-only mmap) into plain row-major tensors.
    codes = blocks[:, 2:].view(torch.int8).view(rows, groups, INT8_GROUP).clone(memory_format=torch.contiguous_format)
    scales = blocks[:, 0:2].view(torch.float16).view(rows, groups).clone(memory_format=torch.contiguous_format)
    return codes.view(rows, -1), scales


def int8_rows(
    raw: torch.Tensor, ggml_type: int, shape: tuple[int, int], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 / Q5_K / Q6_K matrix requantized to int8 codes with one `dtype` scale per row (int8_per_row), the
    layout of int8 weight-only kernels.

    The file's scales are per block (Q8_0: 32 weights, K-quants: 16 or 32 under one of 256), so the exactly dequantized
    row is quantized again: each weight moves by at most 1/254 of the row's largest (int8_per_row), about twice Q8_0's
    own error on the demo file's embedding and far below the step of a Q5_K or Q6_K code (bench/results/README.md).
    """
    if ggml_type not in INT8_TYPES:
        raise ValueError(f"{type_name(ggml_type)} is not an 8-bit type")
    return int8_per_row(dequantize(raw, ggml_type, shape), dtype)


def int4_affine(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes (int32, 0..15), scales and zeros (float32, [out, in // 32]) with W ~ (codes - 8) * scale + zero."""
    rows, cols = weight.shape
    groups = weight.float().reshape(rows, cols // INT4_GROUP, INT4_GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = (high - low) / 15
    scale = torch.where(scale > 0, scale, 1.0)  # a constant group: every code 0, the value in `low`
    codes = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
    return codes.reshape(rows, cols), scale, low + 8 * scale


def int8_per_row(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A matrix (rows, cols) as int8 codes (rows, cols) and one `dtype` scale per row (rows,), w ~= q * s.

    s = max|w| / 127, rounded up to `dtype` so that no code leaves -127..127 (the CPU kernel's scales have the
    activations' dtype), q = round(w / s): each weight moves by at most s / 2, 1/254 (0.394%) of the row's largest,
    times 1 + 2^-7 for a bfloat16 s rounded up (0.397%). An all-zero row gets scale 0 and codes 0.
    """
    weight = weight.float()
    exact = weight.abs().amax(dim=1) / 127
    scales = exact.to(dtype)
    scales = torch.where(scales.float() < exact, torch.nextafter(scales, torch.full_like(scales, math.inf)), scales)
    # Divided by the smallest normal float instead of 0, an all-zero row's zeros stay zeros.
    divisors = scales.float().clamp(min=torch.finfo(torch.float32).tiny).unsqueeze(1)
    return torch.round(weight / divisors).to(torch.int8), scales


def _check_size(raw: torch.Tensor, ggml_type: int, shape: tuple[int, ...]) -> None:
    if raw.dtype != torch.uint8:
        raise TypeError(f"raw must be a uint8 tensor, got {raw.dtype}")
    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    # Blocks never span rows: ggml requires each row (the last dim) to be whole blocks.
    if (shape[-1] if shape else 1) % block_size or raw.numel() != math.prod(shape) // block_size * type_size:
        raise ModelLoadError(
            f"{type_name(ggml_type)} data of {raw.numel()} bytes does not match shape {tuple(shape)}; "
            "the model is corrupt"
        )


def _blocks(raw: torch.Tensor, ggml_type: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The bytes of a non-empty tensor as (n_blocks, bytes per block), after checking their count."""
    _check_size(raw, ggml_type, shape)
    raw = raw.reshape(-1)
    # torch reinterprets bytes as wider dtypes only at offsets aligned to the item size (at most 4 bytes here).
    if raw.storage_offset() % 4:
        raw = raw.clone()
    return raw.view(-1, GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)][1])
