"""GGUF files of the architectures that gguf_model.py's own loader does not map, through transformers' GGUF loading
(`from_pretrained(..., gguf_file=...)`, transformers.integrations.ggml): its config keys, tensor names and
per-architecture rewrites (Gemma's norm offsets, Qwen-MoE's stacked experts, ...), for Gemma 2 / 3, Phi-3, Falcon,
Qwen2-MoE, Qwen3-MoE, StarCoder2, StableLM, GPT-2, Nemotron, gpt-oss and whatever else the installed transformers
reads. transformers dequantizes every tensor (in host memory); where the file's quantized matrices are to stay
quantized (`quantized`), each linear layer or embedding whose weight transformers loaded exactly as the file stores
it (no rewrite changed it) is then rebuilt from the file's codes and scales as gguf_model does (Int4Linear /
Int8Linear), the rest staying as loaded. The file's tokenizer is rebuilt as llama.cpp tokenizes (gguf_tokenizer). An
architecture that transformers cannot read exits 2 naming the llama.cpp runtime, which runs every architecture
llama.cpp has.
"""

import logging

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel
from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

from rbee_worker.errors import ModelLoadError
from rbee_worker.hardware.devices import check_fits
from rbee_worker.layers.gguf_quantized import (
    QUANTIZED_TYPES,
    keep_quantized,
    keep_quantized_experts,
    quantized_weights,
    weight_bytes,
)
from rbee_worker.loading.gguf.gguf_format import GGUFFile
from rbee_worker.loading.gguf.gguf_tokenizer import build_tokenizer
from rbee_worker.loading.hf import check_attention, check_layer_types, check_loading_info, first_line
from rbee_worker.loading.loaded import LoadedModel, context_length_of, eos_ids, finish
from rbee_worker.loading.progress import LoadProgress

log = logging.getLogger(__name__)


def load_through_transformers(
    file: GGUFFile, arch: str, end_ids: list[int], device: torch.device, dtype: torch.dtype, progress: LoadProgress,
    quantized: bool,
) -> LoadedModel:  # fmt: skip
    """The model of a GGUF `file` of architecture `arch` on `device` in `dtype`, loaded by transformers; `end_ids`:
    the file's end-of-generation ids besides its config's EOS; with `quantized`, the file's quantized matrices kept
    where transformers loaded them unchanged (see the module docstring)."""
    path = file.path
    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except (ValueError, KeyError, TypeError, OSError, RuntimeError) as exc:
        raise ModelLoadError(
            f"GGUF architecture {arch!r} of {path.name} is not served by the torch runtime ({first_line(exc)}); "
            "try --runtime llama.cpp, which runs the architectures llama.cpp has"
        ) from exc
    check_layer_types(getattr(config.get_text_config(), "layer_types", None), path)
    check_attention(config, path)
    # Before the load, the least the device will hold (every quantized tensor kept); after it, what it will.
    quantized_tensors = (
        {n for n, info in file.tensors.items() if info.ggml_type in QUANTIZED_TYPES} if quantized else set()
    )
    check_fits(weight_bytes(file, dtype, quantized_tensors), device, f"the weights of {path.name}")
    progress.expect(getattr(config.get_text_config(), "num_hidden_layers", 0) or 0, weight_bytes(file, dtype, set()))
    tokenizer = build_tokenizer(file.metadata)
    try:
        with progress.counting_parameters():
            model, loading_info = AutoModelForCausalLM.from_pretrained(
                path.parent, gguf_file=path.name, config=config, dtype=dtype, output_loading_info=True
            )
    except (ValueError, KeyError, TypeError, OSError, RuntimeError, NotImplementedError) as exc:
        raise ModelLoadError(
            f"GGUF architecture {arch!r} of {path.name}: transformers cannot load its tensors ({first_line(exc)}); try "
            "--runtime llama.cpp, which runs the architectures llama.cpp has"
        ) from exc
    check_loading_info(loading_info, path, config.model_type)
    kept = kept_as_stored(file, arch, model, dtype) if quantized else {}
    if quantized and not kept:
        log.warning("%s (%s) loads dequantized to %s: none of its quantized matrices loads as the file stores it",
                    path.name, arch, str(dtype).removeprefix("torch."))  # fmt: skip
    check_fits(weight_bytes(file, dtype, set(kept.values())), device, f"the weights of {path.name}")
    if kept:
        keep_quantized(model, file, arch, config, kept, device, dtype, progress)
    if quantized and device.type == "cuda":
        keep_quantized_experts(model, file, device, dtype)
    info = {
        "name": path.stem,
        "path": path,
        "format": "gguf",
        "architecture": config.model_type,
        "context_length": context_length_of(config.get_text_config()),
        "eos_token_ids": eos_ids(config.eos_token_id, tokenizer.eos_token_id, end_ids),
        "dtype": dtype,
    }
    return finish(model.to(device), tokenizer, info, device)


def kept_as_stored(file: GGUFFile, arch: str, model: PreTrainedModel, dtype: torch.dtype) -> dict[str, str]:
    """Parameter name -> GGUF tensor, of the linear layers' and embeddings' weights that the file stores in a type
    kept quantized (gguf_quantized.quantized_weights) and that transformers loaded exactly as the file's own
    dequantized values: a weight that one of its per-architecture rewrites changed (a permutation, an offset) is left
    as loaded, so what stays quantized is what the file stores."""
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=model.config.to_dict())
    sources = {hf: name for name, hf in get_gguf_hf_weights_map(model, processor).items() if name in file.tensors}
    parameters = dict(model.named_parameters())
    kept = {}
    for hf_name, name in quantized_weights(file, sources, model).items():
        loaded = parameters.get(hf_name)
        stored = file.load(name, dtype)
        if loaded is not None and stored.shape == loaded.shape and torch.equal(stored, loaded.detach()):
            kept[hf_name] = name
    return kept
