"""Load a GGUF file into a transformers model: config, dequantized weights, tokenizer and chat template.

transformers can load GGUF itself (`from_pretrained(..., gguf_file=...)`) but slowly (bench/results/README.md),
mostly in gguf-py's reader and numpy dequantization; here the header is parsed directly, weights are dequantized with
torch on the target device, and the model is assembled from a state dict without a second copy. A tensor-parallel
rank (ModelSpec.shard) builds only its shard, one whole layer at a time (`fill_shard`). This path
takes ARCHITECTURES; every other architecture goes through transformers' own GGUF loading (gguf_transformers.py).
"""

from pathlib import Path
from typing import Any

import gguf
import torch
from transformers import AutoConfig, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from rbee_worker.errors import ModelLoadError
from rbee_worker.hardware.devices import check_fits
from rbee_worker.layers.gguf_quantized import (
    keep_quantized,
    permuted_heads,
    quantized_weights,
    unpermute_rotary,
    weight_bytes,
)
from rbee_worker.loading.gguf.dequant import dequantize
from rbee_worker.loading.gguf.gguf_format import GGUFFile, read_gguf
from rbee_worker.loading.gguf.gguf_tokenizer import build_tokenizer
from rbee_worker.loading.gguf.gguf_transformers import load_through_transformers
from rbee_worker.loading.loaded import LoadedModel, eos_ids, finish
from rbee_worker.loading.progress import LoadProgress
from rbee_worker.loading.sharding.tp_layers import shard_model
from rbee_worker.loading.spec import Shard

# GGUF architecture -> transformers model_type, for the architectures whose GGUF metadata and tensors map onto the
# transformers model without architecture-specific rewrites beyond the Q/K permutation below. There is no "mistral":
# llama.cpp has no such GGUF architecture (gguf-py names no tensors for it) and converts Mistral models as "llama".
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

# Optional bias tensors (llama.cpp loads them when present) -> the transformers config flag that adds them. qwen2 is
# absent: its q/k/v biases are always part of the architecture.
BIAS_FLAGS = {
    "llama": {"attn_q.bias": "attention_bias", "ffn_up.bias": "mlp_bias"},
    "qwen3": {"attn_q.bias": "attention_bias"},
}

# Token ids besides EOS that end generation in llama.cpp (end of turn, end of message).
END_TOKEN_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")

# Llama 3.1-style RoPE scaling: llama.cpp's converter stores one divisor per rotary frequency instead of parameters.
ROPE_FACTORS = "rope_freqs.weight"

# GGUF metadata key (after "<arch>.") -> transformers config field.
CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "block_count": "num_hidden_layers",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim",
    "attention.sliding_window": "sliding_window",
    "vocab_size": "vocab_size",
}


def load_gguf(
    path: Path,
    device: torch.device,
    dtype: torch.dtype,
    progress: LoadProgress,
    quantized: bool = False,
    shard: Shard | None = None,
) -> LoadedModel:
    """The model of a GGUF file on `device`, its weights dequantized to `dtype`; with `quantized`, the file's quantized
    matrices of linear layers and token embedding stay quantized instead: Q4_0 / Q4_1 / Q4_K as int4, Q8_0 / Q5_K /
    Q6_K as int8 (see keep_quantized), F16 / BF16 / F32 as they are (the caller checks quantized_supported); with
    `shard`, a tensor-parallel rank's part alone (`fill_shard`)."""
    file = read_gguf(path)
    arch = file.metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        if shard is not None:
            raise ModelLoadError(
                f"--tensor-parallel splits GGUF files of the {', '.join(ARCHITECTURES)} architectures; {path.name} is "
                f"{arch}: use its Hugging Face directory"
            )
        return load_through_transformers(file, arch, end_token_ids(file), device, dtype, progress, quantized)
    config = gguf_config(file, arch)
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    with torch.device("meta"):
        skeleton = model_class(config)
    expected = skeleton.state_dict()
    sources = tensor_sources(file, arch, expected, config)
    kept = quantized_weights(file, sources, skeleton) if quantized else {}
    loaded_bytes = weight_bytes(file, dtype, set(kept.values()))
    check_fits(
        loaded_bytes // (shard.world if shard else 1), device, f"the weights of {path.name} (dequantized to {dtype})"
    )
    progress.expect(config.num_hidden_layers, loaded_bytes)  # a rank too reads every tensor whole
    tokenizer = build_tokenizer(file.metadata)
    placeholders = set(sources) if shard else set(kept)
    state_dict = gguf_state_dict(file, arch, sources, expected, config, device, dtype, progress, placeholders)
    try:
        model, loading_info = model_class.from_pretrained(
            None, config=config, state_dict=state_dict, dtype=dtype, output_loading_info=True
        )
    except (RuntimeError, ValueError) as exc:
        raise ModelLoadError(
            f"the tensors of {path.name} do not fit its metadata ({str(exc).splitlines()[0]}); "
            "download or convert the model again"
        ) from exc
    # transformers fills a missing tensor with random values and only logs it (the CLI silences that log).
    if missing := sorted(loading_info["missing_keys"]):
        raise ModelLoadError(
            f"{path.name} lacks {len(missing)} tensor(s) that its {arch} architecture needs (e.g. {missing[0]}); "
            "the file is incomplete: download or convert the model again"
        )
    if shard is not None:
        fill_shard(model, file, arch, config, sources, kept, expected, shard, device, dtype, progress)
    elif kept:
        keep_quantized(model, file, arch, config, kept, device, dtype, progress)
    if ROPE_FACTORS in file.tensors:
        apply_rope_factors(model, file.load(ROPE_FACTORS))
    model = model.to(device)
    info = {
        "name": path.stem,
        "path": path,
        "format": "gguf",
        "architecture": config.model_type,
        "context_length": config.max_position_embeddings,
        "eos_token_ids": eos_ids(config.eos_token_id, tokenizer.eos_token_id, end_token_ids(file)),
        "dtype": dtype,
    }
    return finish(model, tokenizer, info, device)


def gguf_config(file: GGUFFile, arch: str) -> PretrainedConfig:
    meta = file.metadata
    fields: dict[str, Any] = {
        field: meta[f"{arch}.{key}"] for key, field in CONFIG_KEYS.items() if f"{arch}.{key}" in meta
    }
    fields.setdefault("vocab_size", len(meta.get("tokenizer.ggml.tokens", ())))
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
    if missing := [f for f in required if f not in fields]:
        raise ModelLoadError(f"{file.path.name} lacks GGUF metadata for {', '.join(missing)}: the file is incomplete")
    if invalid := [f for f in required if type(fields[f]) is not int or fields[f] <= 0]:
        raise ModelLoadError(
            f"{file.path.name} has invalid GGUF metadata for {', '.join(invalid)}: the file is corrupt"
        )
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0))}
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling in ("linear", "yarn"):
        if f"{arch}.rope.scaling.factor" not in meta:
            raise ModelLoadError(f"{file.path.name} sets RoPE scaling {scaling} without a factor; the file is corrupt")
        rope.update(rope_type=scaling, factor=float(meta[f"{arch}.rope.scaling.factor"]))
        if original := meta.get(f"{arch}.rope.scaling.original_context_length"):
            rope["original_max_position_embeddings"] = int(original)
    fields["head_dim"] = (
        fields.get("head_dim")
        or meta.get(f"{arch}.rope.dimension_count")
        or (fields["hidden_size"] // fields["num_attention_heads"])
    )
    # A bias tensor the config does not ask for would be silently left out of the model.
    for tensor, flag in BIAS_FLAGS.get(arch, {}).items():
        if f"blk.0.{tensor}" in file.tensors:
            fields[flag] = True
    token_id = {k: meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "padding")}
    try:
        return AutoConfig.for_model(
            ARCHITECTURES[arch],
            **fields,
            rope_parameters=rope,
            tie_word_embeddings="output.weight" not in file.tensors,
            bos_token_id=token_id["bos"],
            eos_token_id=token_id["eos"],
            pad_token_id=token_id["padding"],
        )
    except (ValueError, TypeError) as exc:
        raise ModelLoadError(
            f"{file.path.name} has invalid {arch} metadata ({str(exc).splitlines()[0]}); the file is corrupt"
        ) from exc


def end_token_ids(file: GGUFFile) -> list[int]:
    """EOS, EOT and EOM ids of the file: llama.cpp stops on each (e.g. Llama 3's <|eot_id|> next to <|end_of_text|>)."""
    n_tokens = len(file.metadata.get("tokenizer.ggml.tokens", ()))
    ids = (file.metadata.get(key) for key in END_TOKEN_KEYS)
    # llama.cpp ignores an id outside the vocabulary too (gguf_tokenizer logs it).
    return [i for i in ids if type(i) is int and 0 <= i < n_tokens]


def tensor_sources(
    file: GGUFFile, arch: str, expected: dict[str, torch.Tensor], config: PretrainedConfig
) -> dict[str, str]:
    """Model parameter name -> GGUF tensor name, for every parameter the file holds; refuses a file with tensors
    the model has no place for."""
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    sources: dict[str, str] = {}  # model parameter -> GGUF tensor
    for hf_name in expected:
        base, _, suffix = hf_name.rpartition(".")
        gguf_base = names.get_name(base)
        if gguf_base is not None and f"{gguf_base}.{suffix}" in file.tensors:
            sources[hf_name] = f"{gguf_base}.{suffix}"
        # else absent here (a tied lm_head, say); load_gguf refuses what is really missing
    # transformers would ignore a tensor the model has no place for, and the model would silently run without it.
    # Checked before dequantizing anything, so a big file fails at once.
    if unused := sorted(set(file.tensors) - set(sources.values()) - {ROPE_FACTORS}):
        raise ModelLoadError(
            f"{file.path.name} has {len(unused)} tensor(s) that rbee-worker's {arch} model has no place for "
            f"(e.g. {unused[0]}), so it would not compute what llama.cpp computes; use the model's Hugging Face "
            "directory instead"
        )
    return sources


def gguf_state_dict(
    file: GGUFFile,
    arch: str,
    sources: dict[str, str],
    expected: dict[str, torch.Tensor],
    config: PretrainedConfig,
    device: torch.device,
    dtype: torch.dtype,
    progress: LoadProgress,
    placeholders: set[str],
) -> dict[str, torch.Tensor]:
    """Dequantize each source tensor onto `device`, under the model's parameter names; the `placeholders` (weights
    that keep_quantized replaces next) become one zero expanded to their shape, so that they take no memory."""
    state: dict[str, torch.Tensor] = {}
    for hf_name, name in sources.items():
        info, meta_tensor = file.tensors[name], expected[hf_name]
        if info.shape != tuple(meta_tensor.shape):
            raise ModelLoadError(
                f"{file.path.name}: tensor {name} has shape {info.shape}, the architecture expects "
                f"{tuple(meta_tensor.shape)}; the file's metadata and tensors disagree"
            )
        if hf_name in placeholders:
            state[hf_name] = torch.zeros((), dtype=dtype, device=device).expand(info.shape)
            continue
        # Dequantize where the model will live: on a GPU this is fast and the host never holds a float copy.
        try:
            tensor = dequantize(file.raw(name).to(device), info.ggml_type, info.shape, dtype)
        except ModelLoadError as exc:  # dequantize does not know which file and tensor it was given
            raise ModelLoadError(f"{file.path.name}: tensor {name}: {exc}") from exc
        # After the shape check: the permutation keeps the shape but needs rows divisible by 2 * heads.
        if heads := permuted_heads(arch, name, config):
            tensor = unpermute_rotary(tensor, heads)
        state[hf_name] = tensor
        progress.add(tensor.nbytes)
    return state


def fill_shard(
    model: torch.nn.Module,
    file: GGUFFile,
    arch: str,
    config: PretrainedConfig,
    sources: dict[str, str],
    kept: dict[str, str],
    expected: dict[str, torch.Tensor],
    shard: Shard,
    device: torch.device,
    dtype: torch.dtype,
    progress: LoadProgress,
) -> None:
    """A tensor-parallel rank's shard, from the model built of placeholders only: each decoder layer, then the token
    embedding and LM head, are loaded whole as one process loads them (dequantized, or `kept` quantized) and cut at
    once (tp_layers.shard_model), the rest (the final norm) last. So a rank holds its shard plus one whole layer
    at a time (at the end the vocabulary's matrices), and exactly one process's model cut."""
    names = {id(module): name for name, module in model.named_modules()}
    left = dict(sources)  # the parameters that are still placeholders

    def fill(prefixes: tuple[str, ...]) -> None:
        here = {hf_name: left.pop(hf_name) for hf_name in list(left) if hf_name.startswith(prefixes)}
        # The float tensors first: a quantized layer takes its module's bias.
        floats = {hf_name: name for hf_name, name in here.items() if hf_name not in kept}
        state = gguf_state_dict(file, arch, floats, expected, config, device, dtype, progress, set())
        for hf_name, tensor in state.items():
            model.get_parameter(hf_name).data = tensor  # a tied weight's one Parameter, in every module that holds it
        quantized = {hf_name: name for hf_name, name in here.items() if hf_name in kept}
        keep_quantized(model, file, arch, config, quantized, device, dtype, progress)

    def materialize(modules: list[torch.nn.Module]) -> None:
        fill(tuple(f"{names[id(module)]}." for module in modules))

    shard_model(model, shard.rank, shard.world, file.path.stem, materialize=materialize)
    fill(("",))


def apply_rope_factors(model: torch.nn.Module, factors: torch.Tensor) -> None:
    """Divide the rotary inverse frequencies by the file's factors, as llama.cpp does.

    The converter computes the factors from the llama3 `rope_scaling` so that the default frequencies divided by them
    are exactly transformers' llama3 frequencies; the parameters themselves are not in the file.
    """
    rotary = [m for m in model.modules() if isinstance(getattr(m, "original_inv_freq", None), torch.Tensor)]
    if not rotary or any(m.inv_freq.shape != factors.shape for m in rotary):
        raise ModelLoadError(
            f"{ROPE_FACTORS} has {factors.numel()} factors, which do not fit the model's rotary embedding; "
            "the file is corrupt"
        )
    for module in rotary:
        module.original_inv_freq = module.original_inv_freq / factors.to(module.original_inv_freq)
        module.inv_freq = module.original_inv_freq.clone()
