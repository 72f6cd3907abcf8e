"""Model formats and architectures against transformers itself, on tiny random models (hidden 64, 2 layers).

Every case checks that what rbee-worker loads computes what transformers computes from the same weights: the
last-position logits over a prompt plus its continuation, and 16 greedy tokens from the Engine against `generate`.

- HF directories: llama, mistral, qwen2, qwen3; GQA and MHA; tied and untied embeddings; linear and llama3 RoPE
  scaling; sharded safetensors with an index; several EOS ids in generation_config.json.
- GGUF files, written here as llama.cpp's convert_hf_to_gguf.py writes them (its metadata keys, gguf-py's tensor
  names, llama's Q/K row permutation), as F32, F16 and Q8_0: this checks the loader's name mapping, config mapping
  and un-permutation for every GGUF architecture it claims. Quantized files are compared twice: exactly against
  transformers running the same quantized-then-dequantized weights (our dequantization and mapping), and within a
  quantization-error bound against the original weights.
- The CLI end to end on a mistral directory and a qwen2 GGUF.
"""

import copy
import functools
import json
import math
import shutil
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from conftest import cli, engine_config, greedy, make_tiny_model
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from rbee_worker.engine.engine import Engine
from rbee_worker.engine.request_types import End, StopReason
from rbee_worker.errors import ModelLoadError
from rbee_worker.hardware.devices import Placement
from rbee_worker.loading.gguf.gguf_format import read_gguf
from rbee_worker.loading.loaded import LoadedModel
from rbee_worker.loading.loader import load_model

FP32_CPU = Placement(torch.device("cpu"), torch.float32)
PROMPT = "The capital of France is"
NEW_TOKENS = 16
# Same weights through the same transformers modules: only the order of float32 operations may differ (prefill vs
# one token at a time, logits_to_keep), which moves logits of magnitude ~1 by ~1e-7.
EXACT = 1e-5

QType = gguf.GGMLQuantizationType
F32, F16, Q8_0 = QType.F32, QType.F16, QType.Q8_0
FILE_TYPES = {F32: gguf.LlamaFileType.ALL_F32, F16: gguf.LlamaFileType.MOSTLY_F16, Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0}
# Largest relative error one stored weight can have: F16 rounds to 11 significant bits (2^-11); Q8_0 rounds each value
# to a multiple of absmax/127 of its 32-value block, so it is off by at most absmax/254 — relative to the block's
# largest value, 1/254. Logits pass through ~16 quantized matrices (2 layers x 7, embedding, output); errors of
# random sign add in quadrature, but we add them linearly: |logit error| <= 16 * eps * max|logit|. That is not a
# strict bound (a layer can amplify relative errors) but a generous estimate for these weights; the seeds are fixed,
# so the outcome is deterministic. Observed: F16 about 10x and Q8_0 2-5x below it (printed by
# test_quantized_gguf_error_is_within_bound with -s), while a missing Q/K permutation is about 14x above the Q8_0 one.
QUANT_EPS = {F16: 2.0**-11, Q8_0: 1 / 254}
QUANTIZED_MATRICES = 16

# HF directories built here (mistral and qwen2 come from conftest's `tiny_models`). The RoPE cases keep llama's
# shapes, so make_tiny_model's fixed seed gives them exactly llama's weights: only the position encoding differs.
ROPE_LINEAR = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
ROPE_LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,  # short, so that the scaling changes the low frequencies of a prompt
    "rope_theta": 10000.0,
}
BUILT_HF_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),  # GQA (4 heads, 2 KV heads), untied
    "llama-mha-tied": ("llama", {"num_key_value_heads": 4, "tie_word_embeddings": True}),
    "llama-bias": ("llama", {"attention_bias": True}),  # q/k/v/o biases: llama.cpp permutes the q/k ones too
    "llama-rope-linear": ("llama", {"rope_parameters": ROPE_LINEAR}),
    "llama-rope-llama3": ("llama", {"rope_parameters": ROPE_LLAMA3}),
    "qwen3": ("qwen3", {"head_dim": 32}),  # head_dim != hidden / heads (16): needs GGUF's attention.key_length
}
HF_CASES = [*BUILT_HF_CASES, "mistral", "qwen2", "llama-sharded"]
TIED_CASES = {"llama-mha-tied", "qwen2"}


# -- helpers ---------------------------------------------------------------------------------------------------------


def logits(model: PreTrainedModel, ids: list[int]) -> torch.Tensor:
    """The last position's logits of one full forward pass."""
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0, -1]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def engine_greedy(loaded: LoadedModel, prompt_ids: list[int], max_tokens: int = NEW_TOKENS) -> tuple[list[int], End]:
    """Greedy token ids from our Engine, and its End event. The engine gets a copy: it owns the model it runs (on a
    CPU it swaps the linear layers for oneDNN-packed ones), and `loaded` is shared with other tests."""
    engine = Engine(lambda: copy.deepcopy(loaded), engine_config())
    try:
        return greedy(engine, prompt_ids, max_tokens)
    finally:
        engine.close()


def reference_greedy(model: PreTrainedModel, prompt_ids: list[int], eos: frozenset[int]) -> list[int]:
    """transformers' own greedy `generate`, cut before the first EOS (the Engine does not emit EOS tokens)."""
    with torch.inference_mode():
        output = model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=sorted(eos),
            pad_token_id=min(eos),
        )
    generated = output[0, len(prompt_ids) :].tolist()
    stops = [i for i, token in enumerate(generated) if token in eos]
    return generated[: stops[0]] if stops else generated


def expected_stop(tokens: list[int]) -> StopReason:
    return StopReason.MAX_TOKENS if len(tokens) == NEW_TOKENS else StopReason.EOS


def assert_matches_reference(loaded: LoadedModel, reference: PreTrainedModel, prompt_ids: list[int]) -> None:
    """Greedy tokens equal and logits within EXACT of `reference`."""
    expected = reference_greedy(reference, prompt_ids, loaded.info.eos_token_ids)
    ours, end = engine_greedy(loaded, prompt_ids)
    assert ours == expected
    assert end.stop_reason is expected_stop(expected)
    # Over the prompt and its continuation, so that more positions (and their rotary angles) take part.
    ids = prompt_ids + expected
    diff = max_diff(logits(loaded.model, ids), logits(reference, ids))
    assert diff <= EXACT, f"logits differ by {diff:.2e}"


def head_dim_of(config: PretrainedConfig) -> int:
    """Per-head width; qwen2's config has no head_dim field (it is always hidden / heads there)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def is_tied(model: PreTrainedModel) -> bool:
    return model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()


# -- fixtures ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(demo_tokenizer_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(demo_tokenizer_dir)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    return tokenizer(PROMPT)["input_ids"]


def perturb(directory: Path) -> None:
    """Give a saved model's tensors informative random values, in place.

    A freshly initialized transformers model has zero biases and all-ones norm weights, so a loader that dropped a
    bias or swapped two norms would still match it; with weights of std 0.02 its attention is nearly uniform, so a
    wrong rotary permutation would barely show; and its layers add so little to the token embedding that a model
    with tied embeddings greedily repeats one token, which makes comparing greedy tokens weak. Here norms and biases
    get random values, Q/K projections a std that gives attention scores of order 1, and the output projections of
    attention and MLP one that makes each layer's contribution compete with the embedding. The seed depends only on
    the model type, so models of equal shapes and type (llama and its RoPE variants) keep equal weights.
    """
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    generator = torch.Generator().manual_seed(zlib.crc32(model.config.model_type.encode()))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            if name.endswith("norm.weight"):
                parameter.copy_(1 + 0.2 * noise)
            elif name.endswith(".bias"):
                parameter.copy_(0.05 * noise)
            elif name.endswith(("q_proj.weight", "k_proj.weight", "o_proj.weight", "down_proj.weight")):
                parameter.copy_(0.3 * noise)
    model.save_pretrained(directory)


@pytest.fixture(scope="module")
def hf_dirs(
    tmp_path_factory: pytest.TempPathFactory, tiny_models: dict[str, Path], demo_tokenizer_dir: Path
) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    dirs = {
        name: make_tiny_model(root / name, kind, demo_tokenizer_dir, **o) for name, (kind, o) in BUILT_HF_CASES.items()
    }
    for name, source in tiny_models.items():  # copied: the session's tiny models are shared with other tests
        dirs[name] = Path(shutil.copytree(source, root / name))
    for directory in dirs.values():
        perturb(directory)
    # llama again, in shards of at most 200 KB: several files and a model.safetensors.index.json.
    sharded = root / "llama-sharded"
    AutoModelForCausalLM.from_pretrained(dirs["llama"]).save_pretrained(sharded, max_shard_size="200KB")
    AutoTokenizer.from_pretrained(demo_tokenizer_dir).save_pretrained(sharded)
    dirs["llama-sharded"] = sharded
    return dirs


@pytest.fixture(scope="module")
def reference(hf_dirs: dict[str, Path]) -> Callable[[str], PreTrainedModel]:
    """transformers' AutoModelForCausalLM for an HF case, loaded once."""

    @functools.cache
    def load(case: str) -> PreTrainedModel:
        return AutoModelForCausalLM.from_pretrained(hf_dirs[case], dtype=torch.float32).eval()

    return load


@pytest.fixture(scope="module")
def loaded_hf(hf_dirs: dict[str, Path]) -> Callable[[str], LoadedModel]:
    """Our loader's model for an HF case, loaded once."""
    return functools.cache(lambda case: load_model(str(hf_dirs[case]), FP32_CPU))


# -- HF directories --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", HF_CASES)
def test_hf_directory_matches_transformers(
    case: str,
    loaded_hf: Callable[[str], LoadedModel],
    reference: Callable[[str], PreTrainedModel],
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: list[int],
) -> None:
    loaded, expected = loaded_hf(case), reference(case)
    assert loaded.info.format == "hf"
    assert loaded.info.architecture == expected.config.model_type
    assert loaded.info.eos_token_ids == {tokenizer.eos_token_id}
    assert_matches_reference(loaded, expected, prompt_ids)


@pytest.mark.parametrize("case", HF_CASES)
def test_hf_cases_are_what_they_claim(case: str, loaded_hf: Callable[[str], LoadedModel]) -> None:
    """The shapes and options each case stands for really reach the loaded model (else a case covers nothing)."""
    config = loaded_hf(case).model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    assert (heads == kv_heads) if case == "llama-mha-tied" else (kv_heads < heads)
    assert is_tied(loaded_hf(case).model) == (case in TIED_CASES)
    rope_type = {"llama-rope-linear": "linear", "llama-rope-llama3": "llama3"}.get(case, "default")
    assert config.rope_parameters["rope_type"] == rope_type
    assert head_dim_of(config) == (32 if case == "qwen3" else config.hidden_size // heads)


def test_sharded_directory_has_an_index(hf_dirs: dict[str, Path]) -> None:
    directory = hf_dirs["llama-sharded"]
    weight_map = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    shards = set(weight_map.values())
    assert len(shards) > 1
    assert {p.name for p in directory.glob("*.safetensors")} == shards
    assert not (directory / "model.safetensors").exists()


def test_rope_scaling_changes_the_output(loaded_hf: Callable[[str], LoadedModel], prompt_ids: list[int]) -> None:
    """The RoPE cases have llama's weights; their logits must differ from llama's by far more than EXACT, or the
    comparisons above could not tell a dropped RoPE scaling from an applied one."""
    ids = prompt_ids * 3  # longer, so that the positions reach the low frequencies llama3 scaling changes
    plain = loaded_hf("llama").model
    for case in ("llama-rope-linear", "llama-rope-llama3"):
        scaled = loaded_hf(case).model
        for (name, a), (_, b) in zip(plain.state_dict().items(), scaled.state_dict().items(), strict=True):
            assert torch.equal(a, b), f"{case}: {name} differs from llama's"
        assert max_diff(logits(scaled, ids), logits(plain, ids)) > 1e-3, case


def test_concurrent_loads_leave_transformers_as_they_found_it(tiny_models: dict[str, Path]) -> None:
    """Two Engines load at once on their own threads. transformers' from_pretrained swaps process-wide state while it
    runs (PreTrainedModel.tie_weights, torch's default dtype): loads in parallel once left tying disabled, and the
    next tied model came without its LM head. Loads in pairs, in two dtypes, must leave both as they were."""
    tie_weights, dtype = PreTrainedModel.tie_weights, torch.get_default_dtype()
    placements = [FP32_CPU, Placement(torch.device("cpu"), torch.bfloat16)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        for _ in range(6):
            loads = [pool.submit(load_model, str(tiny_models["mistral"]), p) for p in placements]
            assert all(load.result().model is not None for load in loads)
            assert PreTrainedModel.tie_weights is tie_weights
            assert torch.get_default_dtype() is dtype
    tied = load_model(str(tiny_models["qwen2"]), FP32_CPU).model
    assert tied.get_output_embeddings().weight is tied.get_input_embeddings().weight


@pytest.mark.parametrize("trigger_position", [0, 2])
def test_generation_config_eos_ids(
    trigger_position: int,
    hf_dirs: dict[str, Path],
    reference: Callable[[str], PreTrainedModel],
    tmp_path: Path,
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: list[int],
) -> None:
    """Every EOS id of generation_config.json stops generation, wherever it stands in the list."""
    eos = tokenizer.eos_token_id
    greedy = reference_greedy(reference("llama"), prompt_ids, frozenset({eos}))
    # An id greedy decoding emits early (first seen at index >= 2, so some output precedes it), declared as EOS.
    stop_at = next(i for i in range(2, len(greedy)) if greedy[i] not in greedy[:i] and greedy[i] != eos)
    trigger = greedy[stop_at]
    never = next(t for t in range(3, 100) if t not in greedy)  # an EOS id this prompt never produces
    declared = [eos, never]
    declared.insert(trigger_position, trigger)

    directory = tmp_path / "llama-eos"
    shutil.copytree(hf_dirs["llama"], directory)
    GenerationConfig(eos_token_id=declared, bos_token_id=tokenizer.bos_token_id).save_pretrained(directory)
    loaded = load_model(str(directory), FP32_CPU)

    assert loaded.info.eos_token_ids == set(declared)
    tokens, end = engine_greedy(loaded, prompt_ids)
    assert end.stop_reason is StopReason.EOS
    assert tokens == greedy[:stop_at]
    assert trigger not in tokens
    assert end.tokens_out == stop_at


# -- GGUF --------------------------------------------------------------------------------------------------------------


def llama_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute, verbatim: interleave the rotary halves of each head."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def stored_type(gguf_name: str, data: np.ndarray, qtype: QType) -> QType:
    """convert_hf_to_gguf.py keeps 1-D tensors and norms in F32 and writes the rest in the output type."""
    return F32 if data.ndim <= 1 or gguf_name.endswith("_norm.weight") else qtype


def write_gguf(
    path: Path,
    model: PreTrainedModel,
    arch: str,
    qtype: QType,
    tokenizer_metadata: dict[str, Any],
    *,
    permute: bool = True,
    tensor_arch: str | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> dict[str, torch.Tensor]:
    """Write `model` as a GGUF the way llama.cpp's convert_hf_to_gguf.py does for `arch`.

    Returns the weights as the file stores them, dequantized and in HF order and names: transformers running those
    must give exactly what our loader gives. `permute=False` skips llama's Q/K permutation (a broken converter);
    `tensor_arch` names the tensors as another architecture does (for an architecture gguf-py does not know);
    `extra_tensors` are written as they are.
    """
    config = model.config
    hparams = config.to_dict()
    writer = gguf.GGUFWriter(path, arch)
    writer.add_architecture()
    writer.add_name(f"tiny-{arch}")
    # TextModel.set_gguf_parameters
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if (head_dim := hparams.get("head_dim")) is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if config.rope_parameters["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(config.rope_parameters["factor"])
    writer.add_file_type(FILE_TYPES[qtype])
    if arch == "llama":  # LlamaModel.set_gguf_parameters
        writer.add_vocab_size(config.vocab_size)
        writer.add_rope_dimension_count(head_dim or config.hidden_size // config.num_attention_heads)
    add_tokenizer_metadata(writer, tokenizer_metadata)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[(tensor_arch or arch).upper()], config.num_hidden_layers)
    stored: dict[str, torch.Tensor] = {}
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # not in a tied checkpoint's safetensors, so the converter never sees it
        base, _, suffix = hf_name.rpartition(".")
        gguf_name = f"{names.get_name(base)}.{suffix}"
        data = tensor.numpy()
        qtype_here = stored_type(gguf_name, data, qtype)
        quantized = gguf.quants.quantize(data, qtype_here)
        # Quantization runs along rows, which the permutation only reorders: round-tripping before permuting gives
        # the same values as the file holds, already in HF order.
        stored[hf_name] = torch.from_numpy(gguf.quants.dequantize(quantized, qtype_here).reshape(data.shape).copy())
        if permute and arch == "llama" and base.endswith(("q_proj", "k_proj")):
            n_head = config.num_attention_heads
            n_kv = n_head if base.endswith("q_proj") else config.num_key_value_heads
            quantized = gguf.quants.quantize(llama_permute(data, n_head, n_kv), qtype_here)
        writer.add_tensor(gguf_name, quantized, raw_dtype=qtype_here)
    for name, data in (extra_tensors or {}).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


def add_tokenizer_metadata(writer: gguf.GGUFWriter, metadata: dict[str, Any]) -> None:
    """The demo model's vocabulary (which the tiny models use), with the value types llama.cpp writes."""
    for key, value in metadata.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)


def with_weights(model: PreTrainedModel, weights: dict[str, torch.Tensor]) -> PreTrainedModel:
    """A copy of `model` running `weights` (a tied output layer follows its embedding)."""
    clone = copy.deepcopy(model)
    with torch.no_grad():
        for name, tensor in weights.items():
            clone.get_parameter(name).copy_(tensor)
    return clone


@dataclass(frozen=True)
class GGUFCase:
    source: str  # the HF case it is converted from
    arch: str  # general.architecture, as llama.cpp's converter picks it


GGUF_CASES = {
    "llama": GGUFCase("llama", "llama"),
    "llama-mha-tied": GGUFCase("llama-mha-tied", "llama"),
    "llama-bias": GGUFCase("llama-bias", "llama"),
    "llama-rope-linear": GGUFCase("llama-rope-linear", "llama"),
    # llama.cpp has no "mistral" GGUF architecture: it converts MistralForCausalLM as llama (Q/K permuted).
    "mistral": GGUFCase("mistral", "llama"),
    "qwen2": GGUFCase("qwen2", "qwen2"),  # q/k/v biases, tied
    "qwen3": GGUFCase("qwen3", "qwen3"),  # q_norm/k_norm, head_dim 32
}
QUANTIZED_CASES = ("llama", "mistral", "qwen2", "qwen3")  # one per distinct tensor layout
GGUF_PARAMS = [(case, F32) for case in GGUF_CASES] + [(c, q) for c in QUANTIZED_CASES for q in (F16, Q8_0)]


@dataclass(frozen=True)
class WrittenGGUF:
    path: Path
    stored: PreTrainedModel  # transformers with the weights as the file stores them


@pytest.fixture(scope="module")
def tokenizer_metadata(demo_gguf: Path) -> dict[str, Any]:
    return {k: v for k, v in read_gguf(demo_gguf).metadata.items() if k.startswith("tokenizer.")}


@pytest.fixture(scope="module")
def gguf_file(
    tmp_path_factory: pytest.TempPathFactory,
    reference: Callable[[str], PreTrainedModel],
    tokenizer_metadata: dict[str, Any],
) -> Callable[[str, QType], WrittenGGUF]:
    root = tmp_path_factory.mktemp("gguf")

    @functools.cache
    def write(case: str, qtype: QType) -> WrittenGGUF:
        spec = GGUF_CASES[case]
        path = root / f"{case}-{qtype.name}.gguf"
        original = reference(spec.source)
        stored = write_gguf(path, original, spec.arch, qtype, tokenizer_metadata)
        return WrittenGGUF(path, original if qtype is F32 else with_weights(original, stored))

    return write


@pytest.fixture(scope="module")
def loaded_gguf(gguf_file: Callable[[str, QType], WrittenGGUF]) -> Callable[[str, QType], LoadedModel]:
    """Our loader's model for a GGUF case, loaded once."""
    return functools.cache(lambda case, qtype: load_model(str(gguf_file(case, qtype).path), FP32_CPU))


@pytest.mark.parametrize(("case", "qtype"), GGUF_PARAMS, ids=[f"{c}-{q.name}" for c, q in GGUF_PARAMS])
def test_gguf_matches_transformers(
    case: str,
    qtype: QType,
    gguf_file: Callable[[str, QType], WrittenGGUF],
    loaded_gguf: Callable[[str, QType], LoadedModel],
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: list[int],
) -> None:
    """Exact against transformers on the weights the file stores: name mapping, config, permutation, dequantization."""
    written = gguf_file(case, qtype)
    loaded = loaded_gguf(case, qtype)
    arch = GGUF_CASES[case].arch
    assert loaded.info.format == "gguf"
    assert loaded.info.architecture == arch
    assert loaded.info.eos_token_ids == {tokenizer.eos_token_id}
    config, source = loaded.model.config, written.stored.config
    for field in ("num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
        assert getattr(config, field) == getattr(source, field), field
    assert config.rms_norm_eps == pytest.approx(source.rms_norm_eps, rel=1e-6)  # GGUF stores it as a float32
    assert head_dim_of(config) == head_dim_of(source)
    assert config.rope_parameters == source.rope_parameters
    assert is_tied(loaded.model) == (GGUF_CASES[case].source in TIED_CASES)
    assert_matches_reference(loaded, written.stored, prompt_ids)


@pytest.mark.parametrize("qtype", [F16, Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize("case", QUANTIZED_CASES)
def test_quantized_gguf_error_is_within_bound(
    case: str,
    qtype: QType,
    loaded_gguf: Callable[[str, QType], LoadedModel],
    reference: Callable[[str], PreTrainedModel],
    prompt_ids: list[int],
) -> None:
    """Against the original float32 weights, a quantized file is off by the quantization error (QUANT_EPS), and no
    more: a wrong mapping or permutation costs far more (test_gguf_without_permutation_is_caught)."""
    loaded = loaded_gguf(case, qtype)
    original = reference(GGUF_CASES[case].source)
    expected = logits(original, prompt_ids)
    diff = max_diff(logits(loaded.model, prompt_ids), expected)
    bound = QUANTIZED_MATRICES * QUANT_EPS[qtype] * expected.abs().max().item()
    print(
        f"{case} {qtype.name}: max |logit diff| {diff:.2e} (bound {bound:.2e}, max |logit| {expected.abs().max():.3f})"
    )
    assert 0 < diff <= bound  # 0 would mean nothing was quantized


def test_gguf_without_permutation_is_caught(
    tmp_path: Path,
    reference: Callable[[str], PreTrainedModel],
    tokenizer_metadata: dict[str, Any],
    prompt_ids: list[int],
) -> None:
    """A llama GGUF whose Q/K rows were not permuted loads into a model far from the original: the EXACT and the
    quantization bounds above are tight enough to catch a missing or wrong (un)permutation."""
    original = reference("llama")
    path = tmp_path / "unpermuted.gguf"
    write_gguf(path, original, "llama", F32, tokenizer_metadata, permute=False)
    loaded = load_model(str(path), FP32_CPU)
    expected = logits(original, prompt_ids)
    diff = max_diff(logits(loaded.model, prompt_ids), expected)
    print(f"llama GGUF without the Q/K permutation: max |logit diff| {diff:.2e}")
    assert diff > QUANTIZED_MATRICES * QUANT_EPS[Q8_0] * expected.abs().max().item()


def test_gguf_eot_and_eom_ids_stop_generation(
    tmp_path: Path,
    reference: Callable[[str], PreTrainedModel],
    tokenizer_metadata: dict[str, Any],
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: list[int],
) -> None:
    """llama.cpp ends generation on tokenizer.ggml.eot_token_id and eom_token_id too (e.g. Llama 3's <|eot_id|>
    where eos is <|end_of_text|>), so the loaded model stops on them."""
    original = reference("qwen2")
    eos = tokenizer.eos_token_id
    greedy = reference_greedy(original, prompt_ids, frozenset({eos}))
    stop_at = next(i for i in range(2, len(greedy)) if greedy[i] not in greedy[:i] and greedy[i] != eos)
    never = next(t for t in range(3, 100) if t not in greedy)
    metadata = {
        **tokenizer_metadata,
        "tokenizer.ggml.eot_token_id": greedy[stop_at],
        "tokenizer.ggml.eom_token_id": never,
    }
    path = tmp_path / "eot.gguf"
    write_gguf(path, original, "qwen2", F32, metadata)
    loaded = load_model(str(path), FP32_CPU)

    assert loaded.info.eos_token_ids == {eos, greedy[stop_at], never}
    tokens, end = engine_greedy(loaded, prompt_ids)
    assert end.stop_reason is StopReason.EOS
    assert tokens == greedy[:stop_at]


def test_gguf_mistral_architecture_is_refused(
    tmp_path: Path, reference: Callable[[str], PreTrainedModel], tokenizer_metadata: dict[str, Any]
) -> None:
    """general.architecture "mistral" does not exist in llama.cpp (gguf-py has no tensor names for it): a file that
    claims it is refused with a one-line error naming it and the llama.cpp runtime, not a KeyError."""
    path = tmp_path / "mistral-arch.gguf"
    write_gguf(path, reference("mistral"), "mistral", F32, tokenizer_metadata, tensor_arch="llama")
    with pytest.raises(ModelLoadError, match=r"GGUF architecture 'mistral' of mistral-arch.gguf.*--runtime llama.cpp"):
        load_model(str(path), FP32_CPU)


def test_gguf_tensor_without_a_place_is_refused(
    tmp_path: Path, reference: Callable[[str], PreTrainedModel], tokenizer_metadata: dict[str, Any]
) -> None:
    """qwen2 has no attention output bias; a file with one must not load as if it had none."""
    path = tmp_path / "extra.gguf"
    extra = {"blk.0.attn_output.bias": np.ones(64, dtype=np.float32)}
    write_gguf(path, reference("qwen2"), "qwen2", F32, tokenizer_metadata, extra_tensors=extra)
    with pytest.raises(ModelLoadError, match=r"1 tensor\(s\) .* no place for \(e\.g\. blk\.0\.attn_output\.bias\)"):
        load_model(str(path), FP32_CPU)


def llama3_rope_factors(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """What llama.cpp's LlamaModel.generate_extra_tensors writes as rope_freqs for a llama3 `rope_scaling`."""
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    old_context = rope["original_max_position_embeddings"]
    low_wavelen = old_context / rope["low_freq_factor"]
    high_wavelen = old_context / rope["high_freq_factor"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(rope["factor"])
        else:
            smooth = (old_context / wavelen - rope["low_freq_factor"]) / (
                rope["high_freq_factor"] - rope["low_freq_factor"]
            )
            factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def test_gguf_llama3_rope_factors_match_transformers_llama3_rope(
    tmp_path: Path,
    reference: Callable[[str], PreTrainedModel],
    tokenizer_metadata: dict[str, Any],
    prompt_ids: list[int],
) -> None:
    """llama.cpp stores llama3 RoPE scaling as a rope_freqs tensor (Llama 3.1 and later GGUFs)."""
    model = reference("llama-rope-llama3")
    path = tmp_path / "llama3-rope.gguf"
    factors = llama3_rope_factors(ROPE_LLAMA3, head_dim_of(model.config))
    assert len(set(factors.tolist())) > 2  # scaled, unscaled and smoothed frequencies are all exercised
    write_gguf(path, model, "llama", F32, tokenizer_metadata, extra_tensors={"rope_freqs.weight": factors})
    assert_matches_reference(load_model(str(path), FP32_CPU), model, prompt_ids)


# -- the CLI end to end ------------------------------------------------------------------------------------------------


def run_generate(model: Path) -> dict[str, Any]:
    result = cli(
        "generate",
        "--model",
        str(model),
        "--prompt",
        "hi",
        "--max-tokens",
        "5",
        "--temperature",
        "0",
        "--json",
        "--dtype",
        "float32",  # the default on CPU is bfloat16; float32 makes the tokens comparable to the reference
        fork=True,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 1, result.stdout
    return json.loads(lines[0])


@pytest.mark.parametrize("model", ["mistral-dir", "qwen2-gguf"])
def test_cli_generate_json(
    model: str,
    hf_dirs: dict[str, Path],
    gguf_file: Callable[[str, QType], WrittenGGUF],
    reference: Callable[[str], PreTrainedModel],
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    path = hf_dirs["mistral"] if model == "mistral-dir" else gguf_file("qwen2", Q8_0).path
    expected_model = reference("mistral") if model == "mistral-dir" else gguf_file("qwen2", Q8_0).stored
    summary = run_generate(path)
    prompt_ids = tokenizer("hi")["input_ids"]
    expected = reference_greedy(expected_model, prompt_ids, frozenset({tokenizer.eos_token_id}))[:5]

    assert set(summary) == {"text", "token_ids", "prompt_tokens", "tokens_out", "stop_reason", "seed"}
    assert summary["token_ids"] == expected
    assert summary["tokens_out"] == len(summary["token_ids"])
    assert summary["stop_reason"] == ("MAX_TOKENS" if len(expected) == 5 else "EOS")
    assert summary["prompt_tokens"] == len(prompt_ids)
    assert summary["text"] == tokenizer.decode(summary["token_ids"], skip_special_tokens=True)
    assert isinstance(summary["seed"], int)
