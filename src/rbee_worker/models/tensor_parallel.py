"""Megatron-style tensor parallelism for transformers' Llama-family model classes (llama, mistral, qwen2, qwen3): a
loaded model is cut in place into one rank's shard of `world`, the layout of Megatron-LM, vLLM and nano-vllm.

In each decoder layer the attention keeps its rank's heads: q_proj's rows of its query heads and k_proj's / v_proj's
rows of its key/value heads (column parallel: no communication), and o_proj's matching input columns (row parallel),
whose partial outputs one all-reduce sums over the ranks. The MLP keeps its slice of the intermediate size the same
way: gate_proj / up_proj column parallel, down_proj row parallel with one all-reduce. Two all-reduces per layer.

transformers' attention finds its head count from the projection's width (`view(*shape, -1, head_dim)`) and keeps
`num_key_value_groups` (query heads per key/value head) from construction, which the cut leaves unchanged; a rank's
H/N query heads are exactly the groups of its KV/N key/value heads (query head h reads key/value head h // groups),
so the model classes run unchanged on the shard. The config is set to the rank's counts (heads, key/value heads,
intermediate size; head_dim written out), so that what is sized from it follows the shard: the paged KV cache
(engine/kv_cache.kv_shape) holds only this rank's key/value heads.

What this first slice does not do yet: the token embedding, the norms and the LM head are replicated (each rank holds
them whole and computes the same logits; splitting the vocabulary is the next step); each rank loads the whole model
before cutting it (loading only its shard is the next step too); only float weights (nn.Linear) are cut, so a
quantized model is refused; and key/value heads are never replicated, so their count must divide by the ranks.
"""

import dataclasses
import math
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import PretrainedConfig

from rbee_worker.devices import tensor_bytes
from rbee_worker.errors import ModelLoadError
from rbee_worker.models.loaded import LoadedModel

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


class RowParallelLinear(torch.nn.Module):
    """A row-parallel linear layer: this rank's input columns of the weight (`linear`, without its bias) applied to
    this rank's slice of the input, the partial outputs summed over the ranks by one all-reduce, the bias added once
    after it. `linear` stays a plain nn.Linear child, so that what the runner does to linear layers (oneDNN packing on
    a CPU) applies to it as to any other."""

    def __init__(
        self, linear: torch.nn.Linear, bias: torch.nn.Parameter | None, group: dist.ProcessGroup | None
    ) -> None:
        super().__init__()
        self.linear, self.bias, self.group = linear, bias, group
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = self.linear(x)
        dist.all_reduce(partial, group=self.group)
        return partial if self.bias is None else partial + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features} (this rank's), out_features={self.out_features}"


def split_sizes(config: PretrainedConfig) -> tuple[int, int, int]:
    """What tensor parallelism splits: (attention heads, key/value heads, intermediate size)."""
    text = config.get_text_config()
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    return heads, kv_heads, text.intermediate_size


def check_divisible(config: PretrainedConfig, world: int, name: str) -> None:
    """Raise ModelLoadError, naming the numbers, when the model's attention heads, key/value heads or intermediate size
    do not divide into `world` equal parts; it suggests the rank counts that do."""
    heads, kv_heads, intermediate = split_sizes(config)
    sizes = {"attention heads": heads, "key/value heads": kv_heads, "intermediate size": intermediate}
    failing = [what for what, value in sizes.items() if value % world]
    if not failing:
        return
    common = math.gcd(heads, kv_heads, intermediate)
    fits = [n for n in range(2, min(common, 64) + 1) if common % n == 0]
    advice = f"use --tensor-parallel {' or '.join(map(str, fits[:4]))}" if fits else "it cannot be split"
    raise ModelLoadError(
        f"--tensor-parallel {world} cannot split {name}: its {heads} attention heads, {kv_heads} key/value heads and "
        f"intermediate size of {intermediate} must each divide by {world}, and its {' and '.join(failing)} do not; "
        f"{advice}"
    )


def read_model_config(spec: str) -> tuple[PretrainedConfig, str]:
    """MODEL's config and name, read without its weights (a GGUF file's header, or config.json), so that a model that
    cannot be split is refused before any rank starts."""
    from rbee_worker.models.gguf_format import read_gguf
    from rbee_worker.models.gguf_model import ARCHITECTURES, gguf_config
    from rbee_worker.models.hf import read_config
    from rbee_worker.models.loader import is_gguf, resolve_model_path

    path = resolve_model_path(spec)
    if path.is_file() and is_gguf(path):
        file = read_gguf(path)
        arch = file.metadata.get("general.architecture")
        if arch not in ARCHITECTURES:
            raise ModelLoadError(f"GGUF architecture {arch!r} of {path.name} is not supported")
        return gguf_config(file, arch), Path(path).stem
    return read_config(path), path.name


def shard_loaded(loaded: LoadedModel, rank: int, world: int, group: dist.ProcessGroup | None = None) -> LoadedModel:
    """The loaded model cut to rank `rank`'s shard (see shard_model), its weight bytes measured again."""
    if loaded.info.runtime != "torch":
        raise ModelLoadError("tensor parallelism runs on the torch runtime; use --runtime torch (or auto)")
    shard_model(loaded.model, rank, world, loaded.info.name, group)
    info = dataclasses.replace(loaded.info, weight_bytes=tensor_bytes(loaded.model))
    return dataclasses.replace(loaded, info=info)


def shard_model(
    model: torch.nn.Module, rank: int, world: int, name: str = "the model", group: dist.ProcessGroup | None = None
) -> None:
    """Cut `model` (a transformers Llama-family causal LM of float weights) in place to rank `rank`'s shard of `world`;
    its row-parallel layers all-reduce over `group` (None: the default process group). Raises ModelLoadError for a
    model that cannot be cut: sizes that do not divide (check_divisible), another architecture, quantized layers."""
    check_divisible(model.config, world, name)
    layers = model.get_decoder().layers
    for layer in layers:
        attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        modules = [getattr(attention, n, None) for n in ATTENTION] + [getattr(mlp, n, None) for n in MLP]
        if any(type(module) is not torch.nn.Linear for module in modules):
            kinds = sorted({type(m).__name__ for m in modules if type(m) is not torch.nn.Linear})
            raise ModelLoadError(
                f"tensor parallelism cuts float Llama-family models (llama, mistral, qwen2, qwen3) in this version; "
                f"{name} has {', '.join(kinds)} layers in place of nn.Linear (a quantized model, or another "
                "architecture): load it with --quantize none, or without --tensor-parallel"
            )
    heads, kv_heads, intermediate = split_sizes(model.config)
    text = model.config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    local_heads, local_kv, local_inter = heads // world, kv_heads // world, intermediate // world
    q_width, kv_width = local_heads * head_dim, local_kv * head_dim  # this rank's rows of q_proj, of k_proj and v_proj
    with torch.no_grad():
        for layer in layers:
            attention, mlp = layer.self_attn, layer.mlp
            _keep_rows(attention.q_proj, rank * q_width, q_width)
            _keep_rows(attention.k_proj, rank * kv_width, kv_width)
            _keep_rows(attention.v_proj, rank * kv_width, kv_width)
            attention.o_proj = _row_parallel(attention.o_proj, rank * q_width, q_width, group)
            _keep_rows(mlp.gate_proj, rank * local_inter, local_inter)
            _keep_rows(mlp.up_proj, rank * local_inter, local_inter)
            mlp.down_proj = _row_parallel(mlp.down_proj, rank * local_inter, local_inter, group)
            if hasattr(mlp, "intermediate_size"):
                mlp.intermediate_size = local_inter
    text.head_dim = head_dim  # written out: hidden_size // num_attention_heads no longer gives it
    text.num_attention_heads, text.num_key_value_heads, text.intermediate_size = local_heads, local_kv, local_inter


def _keep_rows(linear: torch.nn.Linear, start: int, count: int) -> None:
    """Column parallel: the layer keeps output rows start..start+count (and their bias), copied so that the whole
    matrix's storage is freed."""
    linear.weight = torch.nn.Parameter(linear.weight[start : start + count].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = torch.nn.Parameter(linear.bias[start : start + count].clone(), requires_grad=False)
    linear.out_features = count


def _row_parallel(
    linear: torch.nn.Linear, start: int, count: int, group: dist.ProcessGroup | None
) -> RowParallelLinear:
    """Row parallel: the layer's input columns start..start+count, its bias kept apart (added once, after the sum)."""
    bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
    weight = linear.weight[:, start : start + count].clone()
    kept = torch.nn.Linear(count, linear.out_features, bias=False, device="meta")
    kept.weight = torch.nn.Parameter(weight, requires_grad=False)
    return RowParallelLinear(kept, bias, group)
