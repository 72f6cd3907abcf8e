"""Linear layers whose weights stay 4-bit on the CPU: GGUF Q4_0 / Q4_1 / Q4_K matrices as stored, run by PyTorch's int4
weight-only kernel (`aten._weight_int4pack_mm_for_cpu`, the one torchao's Int4 CPU layout uses).

The kernel dequantizes w = (q - 8) * scale + zero per group of 32 inputs on the fly, so a decode step reads half a
byte per weight instead of two. Its scales and zeros must have the activations' dtype, and only bfloat16 runs fast
(measured here: an MLP matrix of the demo model takes 72 us in bfloat16, 3 ms in float32, 7.8 ms in float16): the
GGUF scales and zeros (float16, or Q4_K's float32 products of its two levels of scales) are therefore rounded to
bfloat16 once, a relative change of at most 2^-9 each. The codes themselves are the file's.
"""

import torch

from rbee_worker.models.dequant import INT4_GROUP

# Half a byte of code plus a bfloat16 scale and zero per group of 32.
INT4_BYTES_PER_WEIGHT = 0.5 + 2 * 2 / INT4_GROUP


class Int4Linear(torch.nn.Module):
    """y = x W^T + b, W[n, k] = (codes[n, k] - 8) * scales[n, k // 32] + zeros[n, k // 32], in bfloat16."""

    def __init__(
        self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bias: torch.Tensor | None
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        # innerKTiles 1: the CPU kernel's only layout.
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1))
        self.register_buffer(
            "scales_and_zeros", torch.stack([scales.T, zeros.T], dim=-1).to(torch.bfloat16).contiguous()
        )
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, INT4_GROUP, self.scales_and_zeros)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def int4_supported(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.bfloat16 and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
