"""What a loader hands to the engine: the model, its tokenizer, and measured facts about it."""

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from rbee_worker.devices import tensor_bytes

if TYPE_CHECKING:  # imports llama-cpp-python, an optional dependency
    from rbee_worker.models.llama_cpp_model import LlamaCppModel


@dataclass(frozen=True)
class ModelInfo:
    name: str  # the model's own name: default model_ref, shown in /health and events
    path: Path
    format: str  # "hf" or "gguf"
    architecture: str  # transformers model_type, e.g. "llama"
    context_length: int
    eos_token_ids: frozenset[int]
    device: torch.device
    dtype: torch.dtype
    weight_bytes: int  # measured from the loaded tensors (llama.cpp: its own figure), not the file size
    load_seconds: float = 0.0
    runtime: str = "torch"  # what runs the forward: "torch" (model: a transformers model) or "llama.cpp"


@dataclass(frozen=True)
class LoadedModel:
    model: "PreTrainedModel | LlamaCppModel"  # which one: info.runtime
    tokenizer: PreTrainedTokenizerFast
    info: ModelInfo


def context_length_of(config) -> int:
    """The longest sequence the model was built for, under the names different architectures use."""
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx"):
        if isinstance(value := getattr(config, key, None), int) and value > 0:
            return value
    return 2048


def eos_ids(*sources: int | list[int] | None) -> frozenset[int]:
    """Union of every EOS id that config, generation_config and tokenizer declare."""
    ids: set[int] = set()
    for source in sources:
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(i) for i in source)
    return frozenset(ids)


def finish(model: PreTrainedModel, tokenizer, info: dict, device: torch.device) -> LoadedModel:
    """Common last step of both loaders: eval mode, measured size, ModelInfo."""
    model.eval()
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return LoadedModel(model, tokenizer, ModelInfo(**info, device=device, weight_bytes=tensor_bytes(model)))
