"""Linear layers whose weights stay 4-bit: GGUF Q4_0 / Q4_1 / Q4_K matrices as stored (or a model quantized at load,
layers/quantize.py), run by int4 weight-only kernels: PyTorch's `aten._weight_int4pack_mm_for_cpu` on the CPU (the one
torchao's Int4 CPU layout uses) and our Triton kernels on CUDA (kernels/cuda_weight_only.py).

Both dequantize w = (q - 8) * scale + zero per group of 32 inputs on the fly, so a decode step reads half a byte per
weight instead of two. The CPU kernel's scales and zeros must have the activations' dtype, and only bfloat16 runs fast
there (float32 and float16 many times slower: bench/results/README.md); the CUDA kernels keep them in bfloat16 too.
The GGUF scales and zeros (float16, or Q4_K's float32 products of its two levels of scales) are therefore rounded to
bfloat16 once, a relative change of at most 2^-9 each. The codes themselves are the file's.

Many rows at once (a long prompt) run faster another way on the CPU: PyTorch's int4 kernel multiplies without AMX or
any blocking over the rows, so from dequant.CPU_DEQUANTIZE_ROWS rows the matrix is dequantized to bfloat16 (in
float32, then rounded once per weight, as the CUDA path does above its own threshold) for oneDNN's product, which uses
AMX where the CPU has it; dequantizing writes the nibbles straight to their places (bench/results/README.md).
"""

import functools

import torch

from rbee_worker.loading.gguf.dequant import INT4_GROUP, KERNEL_DTYPE, cpu_product_dequantizes

# Half a byte of code plus a bfloat16 scale and zero per group of 32.
INT4_BYTES_PER_WEIGHT = 0.5 + 2 * 2 / INT4_GROUP


class Int4Linear(torch.nn.Module):
    """y = x W^T + b, W[n, k] = (codes[n, k] - 8) * scales[n, k // 32] + zeros[n, k // 32].

    The weights are packed for the device that `codes` is on (the kernels' layouts differ): build the layer where it
    will run."""

    def __init__(
        self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bias: torch.Tensor | None
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.bias = bias
        if codes.device.type == "cuda":
            from rbee_worker.kernels.cuda_weight_only import pack_int4  # Triton: not on CPU-only machines

            packed = pack_int4(codes)  # [in // 8, out]
        else:
            # innerKTiles 1: the CPU kernel's only layout.
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        self.register_buffer("packed", packed)
        self.register_buffer(
            "scales_and_zeros", torch.stack([scales.T, zeros.T], dim=-1).to(torch.bfloat16).contiguous()
        )  # [in // 32, out, 2]

    @classmethod
    def stacked(cls, layers: list["Int4Linear"], bias: torch.Tensor | None) -> "Int4Linear | None":
        """One layer with the layers' output rows one after the other (same inputs), and `bias`, theirs stacked; from
        their packed weights as they are. The CPU kernel packs output rows in blocks of 64 with AVX-512 (32 without):
        None there where a layer's rows are not whole blocks. On CUDA the outputs are the words' columns."""
        on_cuda = layers[0].packed.device.type == "cuda"
        if not on_cuda and any(layer.out_features % 64 for layer in layers):
            return None
        merged = cls.__new__(cls)
        torch.nn.Module.__init__(merged)
        merged.out_features = sum(layer.out_features for layer in layers)
        merged.in_features = layers[0].in_features
        merged.bias = bias
        merged.register_buffer("packed", torch.cat([layer.packed for layer in layers], dim=1 if on_cuda else 0))
        merged.register_buffer("scales_and_zeros", torch.cat([layer.scales_and_zeros for layer in layers], dim=1))
        return merged

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.packed.device.type == "cuda":
            from rbee_worker.kernels.cuda_weight_only import int4_matmul  # Triton: not on CPU-only machines

            y = int4_matmul(rows, self.packed, self.scales_and_zeros)
        elif cpu_product_dequantizes(rows.shape[0], rows.dtype) and cpu_pack_block() is not None:
            y = torch.nn.functional.linear(rows, self.dequantized(rows.dtype))
        else:
            kernel_rows = rows.to(KERNEL_DTYPE)
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(kernel_rows, self.packed, INT4_GROUP, self.scales_and_zeros)
            y = y.to(rows.dtype)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"

    def dequantized(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """W [out, in] in `dtype` from PyTorch's CPU layout: each weight (q - 8) * scale + zero in float32, then
        rounded."""
        codes = unpack_cpu_int4(self.packed, self.out_features, self.in_features, cpu_pack_block())
        groups = codes.view(torch.int8).sub_(8).reshape(self.out_features, self.in_features // INT4_GROUP, INT4_GROUP)
        scales, zeros = (part.T.float().unsqueeze(-1) for part in self.scales_and_zeros.unbind(-1))  # [out, groups, 1]
        # addcmul computes in float32 (the type its operands promote to) and rounds into the output's dtype.
        weights = torch.empty(groups.shape, dtype=dtype)
        return torch.addcmul(zeros, groups, scales, out=weights).reshape(self.out_features, self.in_features)


def unpack_cpu_int4(packed: torch.Tensor, out_features: int, in_features: int, block: int) -> torch.Tensor:
    """Codes [out, in] uint8 from `_convert_weight_to_int4pack_for_cpu`'s bytes: per block of `block` outputs and per
    input, block / 2 bytes whose low nibbles are the block's first half of outputs and whose high ones the second.
    Each nibble is written straight to its place (one pass per half)."""
    nibbles = packed.reshape(out_features // block, in_features, block // 2)
    codes = torch.empty(out_features // block, 2, block // 2, in_features, dtype=torch.uint8)
    torch.bitwise_and(nibbles, 15, out=codes[:, 0].transpose(1, 2))
    torch.bitwise_right_shift(nibbles, 4, out=codes[:, 1].transpose(1, 2))
    return codes.reshape(out_features, in_features)


@functools.cache
def cpu_pack_block() -> int | None:
    """The output block of PyTorch's CPU int4 layout on this CPU (64 with AVX-512, 32 with AVX2), found by packing a
    known matrix; None if neither unpacks it (then the int4 kernel runs for any number of rows)."""
    codes = torch.arange(128 * 64, dtype=torch.int32).reshape(128, 64).remainder_(16)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    for block in (64, 32):
        if torch.equal(unpack_cpu_int4(packed, 128, 64, block), codes.to(torch.uint8)):
            return block
    return None
