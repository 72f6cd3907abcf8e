"""`--quantize int8|int4` for a model loaded in floating point (a safetensors directory): the decoder layers' linear
layers become Int8Linear / Int4Linear, one matrix at a time, each float matrix freed as its quantized layer replaces
it (the float model is loaded whole first).

int8: one scale per output row, absmax / 127 (symmetric, round to nearest): what torchao's Int8WeightOnlyConfig does,
and the only layout of PyTorch's int8 CPU kernel. On the demo model it is the less accurate of the two (last logits 2.6
to 3.7% of the largest off float32, int4 1.6 to 1.8%: tests/test_quantize.py): a row's one scale is set by its largest
weight. int4: per group of 32 inputs, the range [min, max] in 16 steps (asymmetric: scale (max - min) / 15, code
round((w - min) / scale)), the layout of GGUF's Q4_1 and the group size of Q4_0 / Q4_1. The token embedding and the LM
head stay in the model's dtype, as GPTQ and AWQ checkpoints keep them: they are 5% of an 8B model's weights and the LM
head decides every token.
"""

import importlib.util
from collections.abc import Callable

import torch

from rbee_worker.models.dequant import INT4_GROUP, int8_per_row
from rbee_worker.models.int4_linear import Int4Linear
from rbee_worker.models.int8_linear import Int8Linear


def int4_affine(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes (int32, 0..15), scales and zeros (float32, [out, in // 32]) with W ~ (codes - 8) * scale + zero."""
    rows, cols = weight.shape
    groups = weight.float().reshape(rows, cols // INT4_GROUP, INT4_GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = (high - low) / 15
    scale = torch.where(scale > 0, scale, 1.0)  # a constant group: every code 0, the value in `low`
    codes = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
    return codes.reshape(rows, cols), scale, low + 8 * scale


def quantized_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether Int4Linear and Int8Linear run here: bfloat16 activations, on the CPU or on a CUDA GPU of compute
    capability 8.0+ (bfloat16 tensor-core instructions) with Triton (the int8 and int4 kernels)."""
    if dtype != torch.bfloat16:
        return False
    if device.type == "cuda":
        return importlib.util.find_spec("triton") is not None and torch.cuda.get_device_capability(device) >= (8, 0)
    return device.type == "cpu"


def quantize_linears(model: torch.nn.Module, mode: str) -> None:
    """Swap each nn.Linear of the model's decoder layers for its int8 / int4 version, on the layer's own device (a
    matrix whose inputs do not split into groups of 32 stays as it is under int4)."""

    def quantized(linear: torch.nn.Linear) -> torch.nn.Module | None:
        weight = linear.weight.detach()
        if mode == "int8":
            return Int8Linear(*int8_per_row(weight, weight.dtype), linear.bias)
        return Int4Linear(*int4_affine(weight), linear.bias) if linear.in_features % INT4_GROUP == 0 else None

    replace_linears(model.get_decoder().layers, quantized)


def replace_linears(root: torch.nn.Module, make: Callable[[torch.nn.Linear], torch.nn.Module | None]) -> None:
    """Replace each plain nn.Linear under `root` by `make(linear)`, where that returns a module."""
    for parent in list(root.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and (replacement := make(child)) is not None:
                setattr(parent, name, replacement)
