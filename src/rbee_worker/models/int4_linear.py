"""Linear layers whose weights stay 4-bit: GGUF Q4_0 / Q4_1 / Q4_K matrices as stored (or a model quantized at load,
models/quantize.py), run by int4 weight-only kernels: PyTorch's `aten._weight_int4pack_mm_for_cpu` on the CPU (the one
torchao's Int4 CPU layout uses) and our Triton kernels on CUDA (models/cuda_weight_only.py).

Both dequantize w = (q - 8) * scale + zero per group of 32 inputs on the fly, so a decode step reads half a byte per
weight instead of two. The CPU kernel's scales and zeros must have the activations' dtype, and only bfloat16 runs fast
there (measured here: an MLP matrix of the demo model takes 72 us in bfloat16, 3 ms in float32, 7.8 ms in float16);
the CUDA kernels keep them in bfloat16 too. The GGUF scales and zeros (float16, or Q4_K's float32 products of its two
levels of scales) are therefore rounded to bfloat16 once, a relative change of at most 2^-9 each. The codes themselves
are the file's.
"""

import torch

from rbee_worker.models.dequant import INT4_GROUP

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
            from rbee_worker.models.cuda_weight_only import pack_int4  # Triton: not on CPU-only machines

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
            from rbee_worker.models.cuda_weight_only import int4_matmul  # Triton: not on CPU-only machines

            y = int4_matmul(rows, self.packed, self.scales_and_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, INT4_GROUP, self.scales_and_zeros)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
