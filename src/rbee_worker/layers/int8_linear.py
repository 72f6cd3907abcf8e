"""Weights that stay 8-bit on the CPU: GGUF Q8_0 / Q5_K / Q6_K matrices of linear layers run by PyTorch's int8
weight-only kernel (`aten._weight_int8pack_mm`, per-output-channel scales), and quantized token embeddings gathered
row by row from their codes.

The kernel dequantizes w = q * scale[row] on the fly, so a decode step reads one byte per weight instead of two. Its
scales must have the activations' dtype, and only bfloat16 runs fast: at one row it beats the bfloat16 F.linear,
oneDNN-packed or not, and float32 and float16 activations run it several times slower (bench/results/README.md). The
kernel's time grows with the rows, like the int4 kernel's, faster than the packed bfloat16 product's, so it suits
decoding a few streams (the engine computes prompt logits at the last position only). From
dequant.CPU_DEQUANTIZE_ROWS rows (a long prompt) a layer therefore multiplies its matrix dequantized to bfloat16
(q * scale in float32, rounded once) with oneDNN, which is faster there.

An embedding needs no kernel: a lookup gathers the rows' codes and scales and multiplies them out, so it can keep the
file's own blocks (Q8_0's per-32 scales exactly) instead of a per-row requantization.
"""

import torch

from rbee_worker.loading.gguf.dequant import cpu_product_dequantizes

# One int8 code per weight (a per-row scale comes on top: a few bytes per row).
INT8_BYTES_PER_WEIGHT = 1


class Int8Linear(torch.nn.Module):
    """y = x W^T + b, W[n, k] = codes[n, k] * scales[n]; on the CPU the kernel computes in the scales' dtype
    (dequant.KERNEL_DTYPE, x is cast to it), on CUDA the product runs as cuda_weight_only's Triton kernels."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.register_buffer("codes", codes.contiguous())
        self.register_buffer("scales", scales.contiguous())
        self.bias = bias

    @classmethod
    def stacked(cls, layers: list["Int8Linear"], bias: torch.Tensor | None) -> "Int8Linear":
        """One layer with the layers' output rows one after the other (same inputs), and `bias`, theirs stacked."""
        return cls(torch.cat([layer.codes for layer in layers]), torch.cat([layer.scales for layer in layers]), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.codes.device.type == "cuda":
            from rbee_worker.kernels.cuda_weight_only import int8_matmul  # Triton: not on CPU-only machines

            y = int8_matmul(rows, self.codes, self.scales)
        elif cpu_product_dequantizes(rows.shape[0], rows.dtype):
            y = torch.nn.functional.linear(rows, self.dequantized(rows.dtype))
        else:
            y = torch.ops.aten._weight_int8pack_mm(rows.to(self.scales.dtype), self.codes, self.scales).to(rows.dtype)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def dequantized(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """W [out, in] in `dtype` (by default the scales'): each weight q * scale in float32, then rounded."""
        return (self.codes.float() * self.scales.float()[:, None]).to(dtype or self.scales.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int8Embedding(torch.nn.Module):
    """Row i of the table is codes[i] * scales[i, g] (+ zeros[i, g]) over equal groups g along the row, computed in
    float32 and cast to `dtype` once, as `dequantize` does: with a GGUF matrix's own codes and scales the rows are
    the dequantized ones bit for bit. One group per row is a per-row scale (that of an Int8Linear, whose buffers a
    tied LM head can share)."""

    def __init__(
        self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = codes.shape
        self.groups = scales.shape[1]
        self.dtype = dtype
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)
        self.register_buffer("zeros", zeros)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.codes[ids].float().unflatten(-1, (self.groups, -1))
        rows = rows.mul_(self.scales[ids].float().unsqueeze(-1))
        if self.zeros is not None:
            rows = rows.add_(self.zeros[ids].float().unsqueeze(-1))
        return rows.flatten(-2).to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, groups={self.groups}, dtype={self.dtype}"
