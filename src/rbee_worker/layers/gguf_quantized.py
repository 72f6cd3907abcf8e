"""A GGUF file's quantized matrices kept quantized (`--quantize auto` / `int4` / `int8` on a GGUF file): linear layers
and the token embedding built from the stored codes and scales as Int4Linear / Int8Linear / Int8Embedding instead of
dequantized weights; and llama.cpp's rotary permutation of the Q / K rows undone, which dequantized and kept
matrices both need (loading/gguf/gguf_model.py builds the model around them).
"""

import math
import re

import gguf
import torch
from transformers import PretrainedConfig

from rbee_worker.layers.int4_linear import INT4_BYTES_PER_WEIGHT, Int4Linear
from rbee_worker.layers.int8_linear import INT8_BYTES_PER_WEIGHT, Int8Embedding, Int8Linear
from rbee_worker.loading.gguf.dequant import (
    INT4_GROUP_TYPES,
    INT8_TYPES,
    KERNEL_DTYPE,
    int4_groups,
    int8_groups,
    int8_rows,
)
from rbee_worker.loading.gguf.gguf_format import GGUFFile
from rbee_worker.loading.progress import LoadProgress

# llama.cpp's converter interleaves the rotary halves of Q and K for these architectures; undo it.
PERMUTED_QK = {"llama"}

QUANTIZED_TYPES = INT4_GROUP_TYPES | INT8_TYPES


def kept_bytes_per_weight(ggml_type: int) -> float:
    """About what a weight kept quantized takes (an int4 type kept as an embedding takes about twice that)."""
    return INT4_BYTES_PER_WEIGHT if ggml_type in INT4_GROUP_TYPES else INT8_BYTES_PER_WEIGHT


def weight_bytes(file: GGUFFile, dtype: torch.dtype, kept: set[str]) -> int:
    """About the bytes the file's tensors take loaded: the `kept` tensors (GGUF names) quantized, the rest in
    `dtype`."""
    return int(
        sum(
            math.prod(info.shape) * (kept_bytes_per_weight(info.ggml_type) if name in kept else dtype.itemsize)
            for name, info in file.tensors.items()
        )
    )


def quantized_weights(file: GGUFFile, sources: dict[str, str], skeleton: torch.nn.Module) -> dict[str, str]:
    """The weights (parameter name -> GGUF tensor) of linear layers and embeddings that the file stores in a type
    that stays quantized; a tied LM head is not among them (it has no tensor of its own) and follows its embedding."""
    kept_modules = (torch.nn.Linear, torch.nn.Embedding)
    weights = {f"{name}.weight" for name, module in skeleton.named_modules() if type(module) in kept_modules}
    return {
        hf_name: name
        for hf_name, name in sources.items()
        if hf_name in weights and file.tensors[name].ggml_type in QUANTIZED_TYPES
    }


def keep_quantized(
    model: torch.nn.Module,
    file: GGUFFile,
    arch: str,
    config: PretrainedConfig,
    weights: dict[str, str],
    device: torch.device,
    dtype: torch.dtype,
    progress: LoadProgress,
) -> None:
    """Replace the module of each of `weights` (parameter name -> GGUF tensor, whose placeholders hold no data) by
    one built from the stored codes and scales: a linear layer by an Int4Linear or Int8Linear per its type, an
    embedding by an Int8Embedding, and the LM head tied to it by the linear layer of its type.

    A tied Q8_0 / Q5_K / Q6_K embedding and head share one int8 matrix with per-row scales: the head needs that
    layout for its kernel, and a second, exact copy for the embedding (Q8_0's per-32 scales) would cost the whole
    matrix again to spare its rows an error of at most 1/254 of their largest weight, which changes the model's
    output little next to the head's requantization that both carry (bench/results/README.md). A tied int4 head has
    no such choice: the int4 kernel's packed layout cannot be gathered from, so its embedding keeps the codes a second
    time.
    """
    modules = dict(model.named_modules())
    head = model.get_output_embeddings()
    head_name = next((name for name, module in modules.items() if module is head), None)
    for hf_name, name in weights.items():
        # Built where the model will live: Int4Linear packs its codes for the device they are on.
        info, raw = file.tensors[name], file.raw(name).to(device)
        module_name = hf_name.removesuffix(".weight")
        module = modules[module_name]
        if isinstance(module, torch.nn.Embedding):
            tied = head_name is not None and head.weight is module.weight
            replacement, tied_head = quantized_embedding(raw, info.ggml_type, info.shape, dtype, tied)
            if tied_head is not None:
                replace_module(model, head_name, tied_head)
                progress.add(buffer_bytes(tied_head, exclude=replacement))
        else:
            heads = permuted_heads(arch, name, config)
            replacement = quantized_linear(raw, info.ggml_type, info.shape, module.bias, heads)
        replace_module(model, module_name, replacement)
        progress.add(buffer_bytes(replacement))


# An experts module's projections and the GGUF tensors (llama.cpp's names, one per layer stacking every expert) that
# hold them: transformers' gate_up_proj is the gate's rows, then the up's.
EXPERT_TENSORS = {"gate_up_proj": ("ffn_gate_exps", "ffn_up_exps"), "down_proj": ("ffn_down_exps",)}


def keep_quantized_experts(model: torch.nn.Module, file: GGUFFile, device: torch.device, dtype: torch.dtype) -> int:
    """On CUDA, a mixture of experts' 4-bit expert tensors (Q4_0 / Q4_1 / Q4_K) kept as the file stores them, for the
    fused experts kernels (kernels/cuda_experts.py, which this installs): each projection whose tensors all have such
    a type and which transformers loaded exactly as their dequantized values (as kept_as_stored asks of a linear
    layer). How many experts modules keep their codes; the rest stay as loaded."""
    from rbee_worker.kernels.cuda_experts import experts_modules, hold, pack_int4_experts, use_fused_experts

    if not use_fused_experts(model):
        return 0
    names = {module: name for name, module in model.named_modules()}
    kept = 0
    for module in experts_modules(model):
        layer = re.search(r"layers\.(\d+)\.", names[module])
        if layer is None or module.is_transposed:
            continue
        stored = {
            projection: [f"blk.{layer[1]}.{tensor}.weight" for tensor in tensors]
            for projection, tensors in EXPERT_TENSORS.items()
        }
        if not all(_stored_as_loaded(file, module, *item, dtype) for item in stored.items()):
            continue
        for projection, tensors in stored.items():
            parts = zip(*(_int4_expert_groups(file, tensor, device) for tensor in tensors), strict=True)
            hold(module, projection, "int4", *pack_int4_experts(*(torch.cat(p, dim=1) for p in parts)))
        kept += 1
    return kept


def _stored_as_loaded(
    file: GGUFFile, experts: torch.nn.Module, projection: str, tensors: list[str], dtype: torch.dtype
) -> bool:
    """Whether the tensors exist in a 4-bit group type and their dequantized values, stacked, are the projection's
    weights as transformers loaded them."""
    if any(name not in file.tensors or file.tensors[name].ggml_type not in INT4_GROUP_TYPES for name in tensors):
        return False
    loaded = getattr(experts, projection).detach()
    stacked = torch.cat([file.load(name, dtype) for name in tensors], dim=1)
    return stacked.shape == loaded.shape and torch.equal(stacked, loaded.cpu())


def _int4_expert_groups(file: GGUFFile, name: str, device: torch.device) -> tuple[torch.Tensor, ...]:
    """A stacked experts tensor [E, out, in] as int4_groups' codes, scales and zeros, each [E, out, ...]."""
    info = file.tensors[name]
    experts, rows, cols = info.shape
    parts = int4_groups(file.raw(name).to(device), info.ggml_type, (experts * rows, cols))
    return tuple(part.view(experts, rows, -1) for part in parts)


def quantized_linear(
    raw: torch.Tensor,
    ggml_type: int,
    shape: tuple[int, int],
    bias: torch.Tensor | None,
    heads: int | None = None,
) -> Int4Linear | Int8Linear:
    """The linear layer of a stored matrix: its int4 codes as stored, or int8 codes requantized per row with the
    kernels' scales; `heads` undoes llama.cpp's rotary permutation of its rows."""
    if ggml_type in INT4_GROUP_TYPES:
        layer_class, parts = Int4Linear, int4_groups(raw, ggml_type, shape)
    else:
        layer_class, parts = Int8Linear, int8_rows(raw, ggml_type, shape, KERNEL_DTYPE)
    if heads:
        parts = tuple(unpermute_rotary(part, heads) for part in parts)
    return layer_class(*parts, bias)


def quantized_embedding(
    raw: torch.Tensor, ggml_type: int, shape: tuple[int, int], dtype: torch.dtype, tied: bool
) -> tuple[Int8Embedding, Int4Linear | Int8Linear | None]:
    """The embedding of a stored matrix, and with `tied` the LM head that shares it (see keep_quantized).

    Q8_0 keeps its codes and per-32 scales: exactly the dequantized rows. Q5_K / Q6_K rows are requantized to int8
    per row (dequant.int8_rows). Q4_0 / Q4_1 / Q4_K keep their codes (as int8 q - 8) and per-32 scales and zeros in
    float32: exactly the dequantized rows (Q4_K within float32's rounding of its zeros)."""
    head = quantized_linear(raw, ggml_type, shape, None) if tied else None
    if isinstance(head, Int8Linear):
        return Int8Embedding(head.codes, head.scales.unsqueeze(1), None, dtype), head
    if ggml_type == gguf.GGMLQuantizationType.Q8_0:
        return Int8Embedding(*int8_groups(raw, ggml_type, shape), None, dtype), head
    if ggml_type in INT8_TYPES:
        codes, scales = int8_rows(raw, ggml_type, shape, KERNEL_DTYPE)
        return Int8Embedding(codes, scales.unsqueeze(1), None, dtype), head
    codes, scales, zeros = int4_groups(raw, ggml_type, shape)
    offset = None if ggml_type == gguf.GGMLQuantizationType.Q4_0 else zeros  # Q4_0's zeros are all 0
    return Int8Embedding(codes.view(torch.int8).sub_(8), scales, offset, dtype), head


def replace_module(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, module)


def buffer_bytes(module: torch.nn.Module, exclude: torch.nn.Module | None = None) -> int:
    """Bytes of the module's buffers, less the storages it shares with `exclude`'s."""
    shared = {b.untyped_storage().data_ptr() for b in exclude.buffers()} if exclude is not None else set()
    return sum(b.nbytes for b in module.buffers() if b.untyped_storage().data_ptr() not in shared)


def permuted_heads(arch: str, name: str, config: PretrainedConfig) -> int | None:
    """The head count to undo llama.cpp's rotary permutation of tensor `name` with, or None when it has none."""
    if arch not in PERMUTED_QK or not name.rpartition(".")[0].endswith(("attn_q", "attn_k")):
        return None
    return config.num_attention_heads if ".attn_q." in name else config.num_key_value_heads


def unpermute_rotary(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of llama.cpp convert_hf_to_gguf's `permute` for Q/K projection rows."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
