"""GGUF files of the architectures that gguf_model.py's own loader does not map, through transformers' GGUF loading
(`from_pretrained(..., gguf_file=...)`, transformers.integrations.ggml): its config keys, tensor names and
per-architecture rewrites (Gemma's norm offsets, Qwen-MoE's stacked experts, ...), for Gemma 2 / 3, Phi-3, Falcon,
Qwen2-MoE, Qwen3-MoE, StarCoder2, StableLM, GPT-2, Nemotron, gpt-oss and whatever else the installed transformers
reads. The weights are dequantized to the dtype (transformers dequantizes them all; the int4 / int8 kernels take
gguf_model's architectures only) and the file's tokenizer is rebuilt as llama.cpp tokenizes (gguf_tokenizer). An
architecture that transformers cannot read exits 2 naming the llama.cpp runtime, which runs every architecture
llama.cpp has.
"""

import logging
import math

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rbee_worker.devices import check_fits
from rbee_worker.errors import ModelLoadError
from rbee_worker.models.gguf_format import GGUFFile
from rbee_worker.models.gguf_tokenizer import build_tokenizer
from rbee_worker.models.hf import check_attention, check_layer_types, check_loading_info, first_line
from rbee_worker.models.loaded import LoadedModel, context_length_of, eos_ids, finish
from rbee_worker.models.progress import LoadProgress
from rbee_worker.models.tp_loading import shard_to_load

log = logging.getLogger(__name__)


def load_through_transformers(
    file: GGUFFile, arch: str, end_ids: list[int], device: torch.device, dtype: torch.dtype, progress: LoadProgress,
    quantized: bool,
) -> LoadedModel:  # fmt: skip
    """The model of a GGUF `file` of architecture `arch` on `device` in `dtype`, loaded by transformers; `end_ids`:
    the file's end-of-generation ids besides its config's EOS. `quantized` (the file's types asked to stay): logged,
    as these weights load dequantized."""
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
    if shard_to_load() is not None:
        raise ModelLoadError(
            f"--tensor-parallel splits GGUF files of the llama, qwen2 and qwen3 architectures; {path.name} is {arch}: "
            "use its Hugging Face directory"
        )
    if quantized:
        log.warning("%s (%s) loads dequantized to %s: the quantized kernels take llama, qwen2 and qwen3 GGUF files",
                    path.name, arch, str(dtype).removeprefix("torch."))  # fmt: skip
    weight_bytes = sum(math.prod(info.shape) for info in file.tensors.values()) * dtype.itemsize
    check_fits(weight_bytes, device, f"the weights of {path.name} (dequantized to {dtype})")
    progress.expect(getattr(config.get_text_config(), "num_hidden_layers", 0) or 0, weight_bytes)
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
