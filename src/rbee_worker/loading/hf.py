"""Load a Hugging Face model directory: config.json, safetensors (one file or sharded with an index), tokenizer."""

import json
import math
from pathlib import Path

import torch
import transformers
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError, safe_open
from transformers import CONFIG_MAPPING, AutoConfig, AutoTokenizer, GenerationConfig, PretrainedConfig
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    MODEL_MAPPING,
)

from rbee_worker.errors import ModelLoadError
from rbee_worker.hardware.devices import check_fits
from rbee_worker.layers.quantize import quantize_linears
from rbee_worker.loading.loaded import LoadedModel, context_length_of, eos_ids, finish
from rbee_worker.loading.progress import LoadProgress
from rbee_worker.loading.sharding.tp_loading import load_shard_weights
from rbee_worker.loading.spec import Shard

INDEX_FILE = "model.safetensors.index.json"
LAYER_TYPES = {"full_attention", "sliding_attention"}  # the `layer_types` that the torch runtime computes
# Model types whose transformers class computes something the engine's cache, masks or attention do not give it (each
# crashes or gives other tokens than transformers in bench/architectures.py's survey): refused at load, naming why.
UNSERVED = {
    "bloom": "ALiBi position biases, which its layers build from a 2-D attention mask (the engine's mask is 4-D)",
    "cpmant": "its own attention with position buckets over a cache of its own layout",
    "gpt_neox_japanese": "its own attention code, which fails on the keys and values that the engine's cache hands it",
    "openai-gpt": "no KV cache (its layers attend to the tokens of each forward alone)",
    "trocr": "learned positions that it counts from the cache's length, not the forward's positions",
    "xlnet": "two-stream relative attention over a memory of its own (not a causal cache)",
    "hrm_text": "recurrent reasoning cycles that run its layers several times over one cache",
    "mimo_v2_flash": "key/value heads that differ between layers (its sliding layers have twice the full layers')",
    "gpt_neo": "its own causal mask, which takes the keys a forward reads to end at its last query (the engine's "
    "reads run past it, masked)",
    "bert-generation": "attention over the whole sequence both ways (an encoder unless is_decoder)",
}


def load_hf_directory(
    path: Path,
    device: torch.device,
    dtype: torch.dtype,
    progress: LoadProgress,
    quantize: str = "none",
    shard: Shard | None = None,
) -> LoadedModel:
    """The model of a Hugging Face directory on `device` in `dtype`; with `quantize` "int8" / "int4", its decoder
    layers' linear layers quantized after loading (the caller checks quantized_supported); with `shard`, a
    tensor-parallel rank's part alone (loading/sharding/tp_loading.py). An encoder (BERT family) loads as
    transformers' base model, for embeddings only."""
    config = read_config(path)
    encoder = is_encoder(config)
    model_class = MODEL_MAPPING[type(config)] if encoder else causal_lm_class(config, path)
    shards = weight_files(path)
    if encoder and (quantize != "none" or shard is not None):
        raise ModelLoadError(
            f"{path.name} is an encoder model ({config.model_type}), which the worker serves for embeddings in its "
            f"own dtype on one device: drop {'--quantize' if quantize != 'none' else '--tensor-parallel'}"
        )
    weight_bytes = weight_elements(shards) * dtype.itemsize // (shard.world if shard else 1)
    check_fits(weight_bytes, device, f"the weights of {path.name}")
    progress.expect(getattr(config.get_text_config(), "num_hidden_layers", 0) or 0, weight_bytes)
    tokenizer = load_tokenizer(path)
    generation_eos = read_generation_eos(path)
    try:
        # Shape mismatches are reported by check_loading_info: transformers' own error points at a log report that
        # the CLI silences.
        if shard is not None:
            model, loading_info = load_shard_weights(
                path, model_class, config, shards, dtype, device, shard, quantize, progress
            )
        else:
            with progress.counting_parameters():
                model, loading_info = model_class.from_pretrained(
                    path,
                    config=config,
                    dtype=dtype,
                    device_map={"": device} if device.type != "cpu" else None,
                    ignore_mismatched_sizes=True,
                    output_loading_info=True,
                    **dequantized(config),
                )
    except torch.OutOfMemoryError as exc:
        raise ModelLoadError(f"not enough memory on {device} to load {path.name}; use a smaller model") from exc
    except (OSError, ValueError, RuntimeError, SafetensorError) as exc:
        raise ModelLoadError(
            f"cannot load the weights of {path} ({first_line(exc)}); re-download or re-convert the model"
        ) from exc
    check_loading_info(loading_info, path, config.model_type)
    if quantize != "none":
        quantize_linears(model, quantize)
    info = {
        "name": path.name,
        "path": path,
        "format": "hf",
        "architecture": config.model_type,
        "context_length": context_length_of(config),
        "eos_token_ids": eos_ids(generation_eos, config.eos_token_id, tokenizer.eos_token_id),
        "dtype": dtype,
        "encoder": encoder,
    }
    return finish(model.to(device), tokenizer, info, device)


def dequantized(config: PretrainedConfig) -> dict[str, object]:
    """from_pretrained's arguments for a checkpoint whose weights are stored quantized: gpt-oss's MXFP4 experts
    (4-bit values in blocks of 32 with a power-of-two scale each) dequantized to the load dtype as they are read, by
    transformers' own conversion, rather than run through the `kernels` package's MXFP4 kernels, which it fetches from
    the Hugging Face hub (never at run time here) and which the fused experts would not use. --quantize int4 / int8
    quantizes the dequantized experts again."""
    method = (getattr(config, "quantization_config", None) or {}).get("quant_method")
    if method != "mxfp4":
        return {}
    from transformers import Mxfp4Config

    return {"quantization_config": Mxfp4Config(dequantize=True)}


def read_generation_eos(path: Path) -> int | list[int] | None:
    """The EOS id(s) of generation_config.json, if the directory has one; read before the weights so a bad file
    fails fast."""
    if not (path / "generation_config.json").is_file():
        return None
    try:
        return GenerationConfig.from_pretrained(path).eos_token_id
    except (OSError, ValueError, TypeError) as exc:
        raise ModelLoadError(
            f"invalid generation_config.json in {path} ({first_line(exc)}); fix or delete that file"
        ) from exc


def read_config(path: Path) -> PretrainedConfig:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{path} has no config.json: not a Hugging Face model directory (or pass a .gguf file)")
    # model_type is checked here because transformers' error for an unknown one lists every architecture it knows
    # on a single line of several kilobytes.
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{config_file} is not valid JSON ({exc}); re-download the model") from exc
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if not isinstance(model_type, str) or not model_type:
        raise ModelLoadError(f"{config_file} has no model_type: not a transformers model config; re-download the model")
    if model_type not in CONFIG_MAPPING:
        raise ModelLoadError(
            f"unsupported architecture {model_type!r} in {config_file}: transformers {transformers.__version__} does "
            "not know it; use a model of a supported architecture (llama, mistral, qwen2, ...) or upgrade transformers"
        )
    check_layer_types(raw.get("layer_types"), config_file)
    check_layer_types((raw.get("text_config") or {}).get("layer_types"), config_file)
    try:
        config = AutoConfig.from_pretrained(path)
    # StrictDataclassError: a field that the config class's validators refuse (checked above: layer types), whose
    # reason is the error it wraps
    except (KeyError, ValueError, TypeError, OSError, StrictDataclassError) as exc:
        reason = exc.__cause__ if isinstance(exc, StrictDataclassError) and exc.__cause__ is not None else exc
        raise ModelLoadError(
            f"unsupported model in {path}: {first_line(reason)}; rbee-worker runs what transformers' "
            "AutoModelForCausalLM supports"
        ) from exc
    check_layer_types(getattr(config.get_text_config(), "layer_types", None), config_file)  # defaults included
    check_attention(config, config_file)
    return config


def per_layer_shape(text: PretrainedConfig) -> str | None:
    """The first of the attention's shape attributes that the config gives per layer (transformers raises for a global
    read of one: Gemma 4's head_dim), None where all are global."""
    for name in ("num_attention_heads", "num_key_value_heads", "head_dim"):
        try:
            getattr(text, name, None)
        except Exception:  # transformers' AmbiguousGlobalPerLayerAttributeError
            return name
    return None


def check_attention(config: PretrainedConfig, config_file: Path) -> None:
    """Raises ModelLoadError, naming the model type and the feature, for a model whose attention the engine would
    compute otherwise than transformers or not at all: UNSERVED's types (BERT-Generation unless `is_decoder`), Doge's
    dynamic mask where it chooses keys (a context longer than its keep_window_size), ALiBi built from the attention
    mask (Falcon's `alibi`), attention shapes that vary per layer (per_layer_shape), and a model without attention
    heads (a recurrent model such as RWKV or xLSTM)."""
    text = config.get_text_config()
    model_type = config.model_type
    if model_type == "bert-generation" and getattr(config, "is_decoder", False):
        feature = None
    elif model_type in UNSERVED:
        feature = UNSERVED[model_type]
    elif model_type == "doge" and text.keep_window_size < text.max_position_embeddings:
        feature = (
            f"a dynamic mask over more than keep_window_size ({text.keep_window_size}) keys, whose choice of keys "
            "depends on how the forwards split the context"
        )
    elif model_type == "falcon" and getattr(config, "alibi", False):
        feature = "ALiBi position biases (alibi), which its layers build from a 2-D attention mask"
    elif varying := per_layer_shape(text):
        feature = f"attention shapes that vary per layer ({varying})"
    elif getattr(text, "num_attention_heads", None) is None:
        feature = "a model without attention heads (a recurrent model), whose state the engine's KV cache cannot hold"
    else:
        feature = None
    if feature is not None:
        raise ModelLoadError(f"{model_type} in {config_file}: {feature} is not served by the torch runtime")


def check_layer_types(layer_types: object, config_file: Path) -> None:
    """Raises ModelLoadError naming any layer type but full and sliding attention (LAYER_TYPES), the kinds of layer
    the torch runtime computes: made-up ones, and those transformers knows (linear, chunked attention ...) that the
    engine has no path for."""
    if not isinstance(layer_types, list):
        return
    if unknown := sorted({str(kind) for kind in layer_types} - LAYER_TYPES):
        raise ModelLoadError(
            f"layer type {', '.join(unknown)} in {config_file} is not served by the torch runtime (its layers: "
            f"{', '.join(sorted(LAYER_TYPES))})"
        )


def is_encoder(config: PretrainedConfig) -> bool:
    """Whether the config is an encoder's (BERT, RoBERTa, ModernBERT, nomic-bert ...: a masked-LM family that is not
    set up as a decoder), which the worker serves for embeddings through transformers' base model."""
    return (
        config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES
        and not getattr(config, "is_encoder_decoder", False)
        and not getattr(config, "is_decoder", False)
        and type(config) in MODEL_MAPPING
    )


def causal_lm_class(config: PretrainedConfig, path: Path) -> type:
    # Encoder-decoders such as BART have a "causal LM" head in transformers for use as a decoder inside a larger
    # model; a checkpoint trained as an encoder-decoder only produces noise through it.
    if getattr(config, "is_encoder_decoder", False) and not getattr(config, "is_decoder", False):
        raise ModelLoadError(
            f"unsupported architecture {config.model_type!r} in {path}: it is an encoder-decoder model, not a causal "
            "(decoder-only) language model; use a text-generation model such as llama, mistral or qwen2"
        )
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ModelLoadError(
            f"unsupported architecture {config.model_type!r} in {path}: it is not a causal language model that "
            f"transformers supports (supported include {', '.join(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)[:8])}, ...)"
        )
    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]


def weight_files(path: Path) -> list[Path]:
    """The safetensors shards of a directory, each checked to open and to cover its declared tensors."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"{index} is corrupt ({first_line(exc)}); re-download the model") from exc
        shards = sorted({path / name for name in weight_map.values()})
        if missing := [s.name for s in shards if not s.is_file()]:
            raise ModelLoadError(f"{path} is missing weight shard(s) {', '.join(missing)} listed in {INDEX_FILE}")
    else:
        shards = sorted(path.glob("*.safetensors"))
    if not shards:
        found = "only PyTorch .bin weights" if any(path.glob("*.bin")) else "no weights"
        raise ModelLoadError(f"{path} has {found}: rbee-worker needs *.safetensors files (or pass a .gguf file)")
    return shards


def weight_elements(shards: list[Path]) -> int:
    """Number of weight elements, read from the shard headers; opening each header also validates it."""
    total = 0
    for shard in shards:
        try:
            # framework="numpy" only maps the file read-only; "pt" asks torch for a private writable mapping of the
            # whole file, which fails for a model larger than RAM before check_fits can say so.
            with safe_open(shard, framework="numpy") as f:
                total += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(
                f"{shard} is corrupt or truncated ({first_line(exc)}); re-download or re-convert the model"
            ) from exc
    return total


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: Path):
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelLoadError(f"{path} has no tokenizer (tokenizer.json); copy the model's tokenizer files into it")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # the Rust tokenizers library raises a bare Exception for a malformed tokenizer.json
        raise ModelLoadError(
            f"cannot load the tokenizer of {path} ({type(exc).__name__}: {first_line(exc)}); "
            "copy the model's original tokenizer files into it"
        ) from exc
    if not getattr(tokenizer, "is_fast", False):
        raise ModelLoadError(f"{path} has no tokenizer.json (a fast tokenizer is required); add it to the directory")
    return tokenizer


def check_loading_info(info: dict, path: Path, architecture: str) -> None:
    """Refuse weights that do not cover the architecture: transformers would fill the gaps with random values."""
    if mismatched := sorted(info.get("mismatched_keys") or ()):
        name, found, expected = mismatched[0]
        raise ModelLoadError(
            f"the weights in {path} do not match its config.json: tensor {name} has shape {tuple(found)}, "
            f"the config implies {tuple(expected)} ({len(mismatched)} such tensor(s)); re-download or re-convert it"
        )
    if missing := sorted(info.get("missing_keys") or ()):
        raise ModelLoadError(
            f"the weights in {path} lack {len(missing)} tensor(s) that the {architecture} architecture in config.json "
            f"needs (e.g. {missing[0]}); re-download or re-convert the model"
        )


def first_line(exc: BaseException, limit: int = 300) -> str:
    """The first line of an exception's message, cut to `limit` characters so the CLI's error stays readable."""
    text = (str(exc).strip() or type(exc).__name__).splitlines()[0]
    return text if len(text) <= limit else text[: limit - 1] + "…"
