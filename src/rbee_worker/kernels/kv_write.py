"""A forward's new keys and values written into the paged cache's pools on CUDA by one Triton kernel, as vLLM's
reshape_and_cache does: one program per new token copies its key heads and its value heads to the token's position in
the pools. Two index writes (keys, then values) are two launches in every layer of every step, each a few
microseconds of a decode step whose work is small.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kernel(
    k_ptr, v_ptr, slots_ptr, kc_ptr, vc_ptr, q_len,
    stride_kr, stride_kh, stride_kt, stride_kd, stride_vr, stride_vh, stride_vt, stride_vd,
    stride_cs, stride_ch, stride_vs, stride_vch,
    HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, D: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0)
    row, t = n // q_len, n % q_len
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, D)[None, :]
    mask = h < HEADS
    slot = tl.load(slots_ptr + n).to(tl.int64)
    k = tl.load(k_ptr + row * stride_kr + t * stride_kt + h * stride_kh + d * stride_kd, mask=mask)
    tl.store(kc_ptr + slot * stride_cs + h * stride_ch + d, k.to(kc_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + row * stride_vr + t * stride_vt + h * stride_vh + d * stride_vd, mask=mask)
    tl.store(vc_ptr + slot * stride_vs + h * stride_vch + d, v.to(vc_ptr.dtype.element_ty), mask=mask)


def supported(head_dim: int) -> bool:
    """Whether write_kv takes this head size (a power of two: one tile per head)."""
    return head_dim & (head_dim - 1) == 0


def write_kv(
    key_states: torch.Tensor,
    value_states: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """keys and values [rows, kv_heads, q_len, head_dim] (transformers' layout; any strides) written to positions
    `slots` ([rows * q_len], row after row) of pools [positions, kv_heads, head_dim] whose last dimension is
    contiguous."""
    rows, heads, q_len, head_dim = key_states.shape
    _write_kernel[(rows * q_len,)](
        key_states, value_states, slots, key_pool, value_pool, q_len,
        *key_states.stride(), *value_states.stride(),
        key_pool.stride(0), key_pool.stride(1), value_pool.stride(0), value_pool.stride(1),
        HEADS=heads, HEADS_PAD=triton.next_power_of_2(heads), D=head_dim,
    )  # fmt: skip
