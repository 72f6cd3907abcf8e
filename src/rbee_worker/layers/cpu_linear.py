"""Linear layers on the CPU with their weights reordered once into oneDNN's blocked layout.

A CPU decode step is mostly one-row matrix products (aten::mm). aten's F.linear hands oneDNN the plain row-major
weight on every call, and oneDNN reorders it each time; reordered once at load, the same products run faster
(bench/cpu_linear.py; bench/results/README.md). This is what inductor's weight freezing and IPEX do, without
compiling: each nn.Linear of the model is swapped for a PackedLinear after loading, so transformers' own model
classes run unchanged around it.

Only the dtypes that oneDNN computes on this CPU are packed (cpu_features.onednn_runs): float32 everywhere, bfloat16
where the CPU has AVX-512 BW/VL/DQ or AVX-NE-CONVERT (torch refuses to reorder bfloat16 weights elsewhere). fp16 is
left alone: on CPUs without FP16 matrix instructions oneDNN has no fast path for it either.
"""

import torch

from rbee_worker.hardware.cpu_features import cpu_features
from rbee_worker.layers.quantize import replace_linears

# Smaller layers stay plain: a packed product costs about 14-17 us a call whatever its size, more than aten's whole
# one-row product of a small matrix (bench/cpu_linear.py --small, 2 threads, AVX-512: float32 64 x 64 3 against 17 us,
# 256 x 256 6 against 20, 512 x 512 24 against 26; bfloat16, which aten computes slowly, 64 x 64 5 against 14 us and
# 128 x 128 21 against 18). So a router's or a tiny model's layers are not packed.
MIN_PACKED_WEIGHTS = {torch.float32: 1 << 18, torch.bfloat16: 1 << 14}


class PackedLinear(torch.nn.Module):
    """y = x W^T + b with W held reordered for oneDNN (an opaque tensor: it has no storage to share or count)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        # Batch-size hint 1: the decode step's products have one row per sequence; prefill runs on the same layout.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        self.packed_bytes = weight.numel() * weight.element_size()
        self.bias = linear.bias

    @property
    def weight(self) -> torch.Tensor:
        """The plain weight's shape and dtype, on the meta device, for modeling code that reads them (Hunyuan-MoE's
        router, ERGO's layers read its dtype); it has no values, so a computation with it raises."""
        return torch.empty(self.out_features, self.in_features, dtype=self.packed.dtype, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def can_pack(model: torch.nn.Module) -> bool:
    """Whether the model's plain linear layers can be packed: on the CPU, in a dtype oneDNN computes there."""
    parameter = next(model.parameters())
    return (
        parameter.device.type == "cpu"
        and cpu_features().onednn_runs(parameter.dtype)
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def pack_linears(model: torch.nn.Module) -> None:
    """Swap every nn.Linear of a CPU model of at least MIN_PACKED_WEIGHTS weights (of its dtype) for a PackedLinear.
    The plain weights are then freed, except one that is tied to another module (a tied LM head keeps the embedding it
    shares, beside its packed copy)."""

    def packed(linear: torch.nn.Linear) -> PackedLinear | None:
        weight = linear.weight
        return PackedLinear(linear) if weight.numel() >= MIN_PACKED_WEIGHTS.get(weight.dtype, 0) else None

    replace_linears(model, packed)


def packed_bytes(model: torch.nn.Module) -> int:
    """Bytes of the packed weights (not seen by parameters() or buffers())."""
    return sum(m.packed_bytes for m in model.modules() if isinstance(m, PackedLinear))
