"""`--quantize int8|int4` for a model loaded in floating point (a safetensors directory): the decoder layers' linear
layers become Int8Linear / Int4Linear, one matrix at a time, each float matrix freed as its quantized layer replaces
it (the float model is loaded whole first).

int8: one scale per output row, absmax / 127 (symmetric, round to nearest): what torchao's Int8WeightOnlyConfig does,
and the only layout of PyTorch's int8 CPU kernel. On the demo model it is the less accurate of the two
(tests/layers/test_quantize.py): a row's one scale is set by its largest weight. int4: per group of 32 inputs, the range
[min, max] in 16 steps (asymmetric: scale (max - min) / 15, code round((w - min) / scale)), the layout of GGUF's Q4_1
and the group size of Q4_0 / Q4_1.

The token embedding stays in the model's dtype (a lookup reads one row a token). On CUDA an LM head of its own
becomes int8 per row in both modes, as llama.cpp's 4-bit files keep it wider than their layers (Q6_K): it is read
whole every step, and in bfloat16 it is a large share of an int4 decode step, which int8 about halves
(bench/results/README.md); each weight moves by at most 1/254 of its row's largest. On the CPU it stays, as
PyTorch's int8 kernel is compute-bound there: about as fast as the oneDNN-packed bfloat16 head at one row, slower at
a few rows (int8_linear.py). A head tied to the embedding stays too: quantizing it would store the matrix a second time.
"""

import importlib.util
from collections.abc import Callable

import torch

from rbee_worker.layers.int4_linear import Int4Linear
from rbee_worker.layers.int8_linear import Int8Linear
from rbee_worker.loading.gguf.dequant import INT4_GROUP, KERNEL_DTYPE, int4_affine, int8_per_row
from rbee_worker.loading.sharding.tp_layers import VocabParallelHead


def quantized_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether Int4Linear and Int8Linear run here: on the CPU in a model of any dtype (the kernels compute in
    bfloat16, dequant.KERNEL_DTYPE), or in a bfloat16 model on a CUDA GPU of compute capability 8.0+ (bfloat16
    tensor-core instructions) with Triton (the int8 and int4 kernels)."""
    if device.type == "cuda":
        return (
            dtype == torch.bfloat16
            and importlib.util.find_spec("triton") is not None
            and torch.cuda.get_device_capability(device) >= (8, 0)
        )
    return device.type == "cpu"


def quantize_linears(model: torch.nn.Module, mode: str) -> None:
    """Swap each nn.Linear of the model's decoder layers for its int8 / int4 version, on the layer's own device (a
    matrix whose inputs do not split into groups of 32 stays as it is under int4), and on CUDA an untied LM head for
    its int8 version and a mixture of experts' experts for theirs (kernels/cuda_experts.py; on the CPU they stay)."""

    def quantized(linear: torch.nn.Linear) -> torch.nn.Module | None:
        if mode == "int8":
            return int8_linear(linear.weight.detach(), linear.bias)
        return (
            Int4Linear(*int4_affine(linear.weight.detach()), linear.bias)
            if linear.in_features % INT4_GROUP == 0
            else None
        )

    replace_linears(model.get_decoder().layers, quantized)
    if model.get_output_embeddings().weight.device.type == "cuda":
        from rbee_worker.kernels.cuda_experts import quantize_experts  # Triton: not on CPU-only machines

        quantize_head(model)
        quantize_experts(model, mode)


def quantize_head(model: torch.nn.Module) -> None:
    """The LM head as int8 per row, unless it is tied to the token embedding; a tensor-parallel rank's vocabulary
    shard of it too (its rows' quantization is the whole head's cut: the zero rows that pad it get scale 0)."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    sharded = isinstance(head, VocabParallelHead)  # a shard loaded alone (loading/sharding/tp_loading.py)
    linear, table = (head.linear, embedding.embedding) if sharded else (head, embedding)
    if type(linear) is not torch.nn.Linear or linear.weight is table.weight:
        return
    quantized = int8_linear(linear.weight.detach(), linear.bias)
    if sharded:
        head.linear = quantized
    else:
        model.set_output_embeddings(quantized)


def int8_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Int8Linear:
    """A matrix as an Int8Linear: int8 codes with one scale per row in the kernels' dtype."""
    return Int8Linear(*int8_per_row(weight, KERNEL_DTYPE), bias)


def replace_linears(root: torch.nn.Module, make: Callable[[torch.nn.Linear], torch.nn.Module | None]) -> None:
    """Replace each plain nn.Linear under `root` by `make(linear)`, where that returns a module."""
    for parent in list(root.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and (replacement := make(child)) is not None:
                setattr(parent, name, replacement)
