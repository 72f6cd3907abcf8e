"""GGUF files of architectures beyond gguf_model.py's own (llama, qwen2, qwen3) on the torch runtime, loaded through
transformers' GGUF loading (loading/gguf/gguf_transformers.py). A tiny random model is written as llama.cpp's
convert_hf_to_gguf.py writes its architecture (metadata keys, gguf-py's tensor names, Gemma's norms stored as 1 + w);
then the engine's greedy tokens must be transformers' `generate` tokens, both on the model loaded from the file and on
the model it was written from (so the file holds that model), alone and four requests at once with prompt chunks
shorter than the window.
"""

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from conftest import engine_config, greedy, make_tiny_model, submit_together
from test_models import add_tokenizer_metadata
from transformers import AutoModelForCausalLM, PreTrainedModel

from rbee_worker.engine.engine import Engine
from rbee_worker.engine.request_types import Request
from rbee_worker.engine.sampling.sampling_params import SamplingParams
from rbee_worker.errors import ModelLoadError
from rbee_worker.hardware.devices import resolve_placement
from rbee_worker.layers.int4_linear import Int4Linear
from rbee_worker.layers.int8_linear import Int8Linear
from rbee_worker.loading.gguf.gguf_format import read_gguf
from rbee_worker.loading.loader import load_model

NEW_TOKENS = 32
WINDOW = 8
# GGUF architecture -> (transformers model type, its tiny config): fields that transformers' GGUF loading reads from
# the file, the rest left at their defaults (what it assumes for a GGUF file).
CASES = {
    "gemma3": ("gemma3_text", {"sliding_window": WINDOW, "head_dim": 16, "initializer_range": 0.05}),
    "gemma2": ("gemma2", {"sliding_window": WINDOW, "head_dim": 16, "initializer_range": 0.05}),
    "phi3": ("phi3", {"num_key_value_heads": 4, "initializer_range": 0.5}),
    "stablelm": ("stablelm", {"num_key_value_heads": 4, "initializer_range": 0.5}),
    # Its GGUF keys carry no window (transformers keeps its default, 4096, that of StarCoder2-3B / 7B / 15B).
    "starcoder2": ("starcoder2", {"initializer_range": 0.5}),
    # transformers reads no expert width from the file: its default, 768 (Qwen3-30B-A3B's), stands.
    "qwen3moe": (
        "qwen3_moe",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 768,
            "norm_topk_prob": True,
            "initializer_range": 0.5,
        },
    ),
}
NORM_PLUS_ONE = {"gemma2", "gemma3"}  # Gemma's RMSNorm scales by 1 + w, llama.cpp's by w: the converter adds 1


def write_gguf(
    path: Path,
    model: PreTrainedModel,
    arch: str,
    tokenizer_metadata: dict[str, Any],
    qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
) -> None:
    """`model` as a GGUF file of `arch`, written as convert_hf_to_gguf.py does for it: its matrices (and stacked
    experts) in `qtype`, the rest (norms, biases) in float32."""
    config = model.config
    writer = gguf.GGUFWriter(path, arch)
    writer.add_architecture()
    writer.add_name(f"tiny-{arch}")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    if (eps := getattr(config, "rms_norm_eps", None)) is not None:
        writer.add_layer_norm_rms_eps(eps)
    else:
        writer.add_layer_norm_eps(getattr(config, "layer_norm_eps", None) or config.norm_epsilon)
    if (head_dim := getattr(config, "head_dim", None)) is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch in ("phi3", "stablelm"):  # the rotary part of a head (StableLM: a quarter of it)
        head = config.hidden_size // config.num_attention_heads
        writer.add_rope_dimension_count(int(getattr(config, "partial_rotary_factor", 1.0) * head))
    rope = config.rope_parameters
    writer.add_rope_freq_base(rope["full_attention"]["rope_theta"] if "full_attention" in rope else rope["rope_theta"])
    if (window := getattr(config, "sliding_window", None)) is not None:
        writer.add_sliding_window(window)
    if (experts := getattr(config, "num_experts", None)) is not None:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    add_tokenizer_metadata(writer, tokenizer_metadata)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # tied to the embedding: not in the checkpoint
        if hf_name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            # transformers' fused experts ([experts, 2 x width, hidden]: gate, then up): stacked per projection
            block = f"blk.{hf_name.split('.')[2]}"
            gate, up = tensor.chunk(2, dim=1)
            parts = {"down": tensor} if hf_name.endswith("down_proj") else {"gate": gate, "up": up}
            for part, data in parts.items():
                data = data.contiguous().numpy().astype(np.float32)
                writer.add_tensor(f"{block}.ffn_{part}_exps.weight", gguf.quants.quantize(data, qtype), raw_dtype=qtype)
            continue
        base, _, suffix = hf_name.rpartition(".")
        gguf_name = f"{names.get_name(base)}.{suffix}"
        data = tensor.numpy().astype(np.float32)
        if arch in NORM_PLUS_ONE and gguf_name.endswith("norm.weight"):
            data = data + 1
        stored = qtype if data.ndim == 2 else gguf.GGMLQuantizationType.F32
        writer.add_tensor(gguf_name, gguf.quants.quantize(data, stored), raw_dtype=stored)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def reference(model: PreTrainedModel, prompt_ids: list[int]) -> list[int]:
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(prompt_ids) :].tolist()


@pytest.mark.parametrize("arch", list(CASES))
def test_a_gguf_file_transformers_reads_gives_its_tokens(
    arch: str, tmp_path: Path, demo_gguf: Path, demo_tokenizer_dir: Path
) -> None:
    model_type, overrides = CASES[arch]
    directory = make_tiny_model(tmp_path / "hf", model_type, demo_tokenizer_dir, **overrides)
    original = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    metadata = {k: v for k, v in read_gguf(demo_gguf).metadata.items() if k.startswith("tokenizer.")}
    path = tmp_path / f"tiny-{arch}.gguf"
    write_gguf(path, original, arch, metadata)
    from_file = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)

    engine = Engine(
        lambda: load_model(str(path), resolve_placement("cpu", "float32"), runtime="torch"),
        engine_config(max_batch=4, prefill_chunk=4, block_size=4),
    )
    try:
        assert engine.loaded.info.architecture == model_type and engine.loaded.info.format == "gguf"
        prompts = [
            engine.model.tokenize(text) for text in ("Once upon a time, in a small village by the sea,", "def f(n):")
        ]
        expected = [reference(from_file, list(ids)) for ids in prompts]
        assert expected == [reference(original, list(ids)) for ids in prompts]
        if "sliding_window" in overrides:
            assert reference(original, list(prompts[0])) != reference_without_window(directory, list(prompts[0]))
        alone, _ = greedy(engine, prompts[0], NEW_TOKENS)
        requests = [Request(ids, max_tokens=NEW_TOKENS, sampling=SamplingParams(temperature=0)) for ids in prompts * 2]
        together = submit_together(engine, requests)
    finally:
        engine.close()
    assert alone == expected[0]
    assert together == expected * 2


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q8_0], ids=str)
def test_a_quantized_file_keeps_its_matrices_quantized(
    qtype: gguf.GGMLQuantizationType, tmp_path: Path, demo_gguf: Path, demo_tokenizer_dir: Path
) -> None:
    """`--quantize int4` (or int8: the file's types either way) of a Q4_0 / Q8_0 Gemma 3: every projection of its
    layers is rebuilt from the file's codes (Int4Linear, Int8Linear as gguf_model keeps them), and its last logits
    stay within 2% of the largest of transformers' over the file's dequantized weights (the kernels compute in
    bfloat16)."""
    model_type, overrides = CASES["gemma3"]
    directory = make_tiny_model(tmp_path / "hf", model_type, demo_tokenizer_dir, **overrides)
    metadata = {k: v for k, v in read_gguf(demo_gguf).metadata.items() if k.startswith("tokenizer.")}
    path = tmp_path / "tiny-gemma3.gguf"
    write_gguf(path, AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32), "gemma3", metadata, qtype)
    loaded = load_model(str(path), resolve_placement("cpu", "float32"), runtime="torch", quantize="int4")
    from_file = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    kind = Int4Linear if qtype == gguf.GGMLQuantizationType.Q4_0 else Int8Linear
    assert sum(isinstance(m, kind) for m in loaded.model.modules()) == 7 * from_file.config.num_hidden_layers
    ids = torch.tensor([loaded.tokenizer("Once upon a time, in a small village by the sea,")["input_ids"]])
    with torch.inference_mode():
        ours, theirs = loaded.model(ids).logits[0, -1].float(), from_file(ids).logits[0, -1]
    assert (ours - theirs).abs().max() <= 0.02 * theirs.abs().max()


def reference_without_window(directory: Path, prompt_ids: list[int]) -> list[int]:
    """transformers' tokens with a window as long as the context: the window changes the tokens, so the comparisons
    above can fail."""
    return reference(
        AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, sliding_window=512), prompt_ids
    )


def test_a_gguf_architecture_transformers_cannot_read_exits_naming_the_llama_cpp_runtime(
    tmp_path: Path, demo_gguf: Path
) -> None:
    """A GGUF file whose architecture neither loader maps (its name made up here) is refused at load (exit 2), naming
    the file and the llama.cpp runtime."""
    path = tmp_path / "made-up.gguf"
    writer = gguf.GGUFWriter(path, "made_up_arch")
    writer.add_architecture()
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"made_up_arch.*made-up\.gguf.*--runtime llama\.cpp"):
        load_model(str(path), resolve_placement("cpu", "float32"), runtime="torch")


# llama.cpp looks up Phi-3's own <|end|> token in the vocabulary, which the demo model's has not.
@pytest.mark.parametrize("arch", [arch for arch in CASES if arch != "phi3"])
def test_on_the_llama_cpp_runtime_a_file_gives_llama_cpp_pythons_tokens(
    arch: str, tmp_path: Path, demo_gguf: Path, demo_tokenizer_dir: Path
) -> None:
    """The same files on the llama.cpp runtime: the worker's greedy tokens are llama-cpp-python's own greedy
    generation's, fed the same ids."""
    llama_cpp = pytest.importorskip("llama_cpp")
    model_type, overrides = CASES[arch]
    directory = make_tiny_model(tmp_path / "hf", model_type, demo_tokenizer_dir, **overrides)
    metadata = {k: v for k, v in read_gguf(demo_gguf).metadata.items() if k.startswith("tokenizer.")}
    path = tmp_path / f"tiny-{arch}.gguf"
    write_gguf(path, AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32), arch, metadata)
    engine = Engine(
        lambda: load_model(str(path), resolve_placement("cpu", "auto"), runtime="llama.cpp"),
        engine_config(max_batch=4, threads=2),
    )
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_threads=2, verbose=False, flash_attn=True)
    try:
        ids = list(engine.model.tokenize("Once upon a time, in a small village by the sea,"))
        ours, _ = greedy(engine, ids, NEW_TOKENS)
        theirs: list[int] = []
        for token in llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            if token in engine.loaded.info.eos_token_ids or len(theirs) == NEW_TOKENS:
                break
            theirs.append(token)
    finally:
        engine.close()
        llm.close()
    assert ours == theirs


def test_a_q4_0_files_experts_keep_their_codes(tmp_path: Path, demo_gguf: Path, demo_tokenizer_dir: Path) -> None:
    """gguf_quantized.keep_quantized_experts (what a Q4_0 mixture of experts gets on CUDA; called here on the CPU,
    where nothing runs the kernels): each projection of each experts module holds the file's own codes (gate's rows,
    then up's) and its scales rounded to bfloat16, and its float weights are gone. tests/kernels/test_cuda_experts.py
    runs such a file on a GPU."""
    from rbee_worker.layers.gguf_quantized import EXPERT_TENSORS, keep_quantized_experts
    from rbee_worker.loading.gguf.dequant import int4_groups

    model_type, overrides = CASES["qwen3moe"]
    directory = make_tiny_model(tmp_path / "hf", model_type, demo_tokenizer_dir, **overrides)
    metadata = {k: v for k, v in read_gguf(demo_gguf).metadata.items() if k.startswith("tokenizer.")}
    path = tmp_path / "tiny-qwen3moe.gguf"
    write_gguf(path, AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32), "qwen3moe", metadata,
               gguf.GGMLQuantizationType.Q4_0)  # fmt: skip
    file = read_gguf(path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    assert keep_quantized_experts(model, file, torch.device("cpu"), torch.float32) == 2
    for layer in range(2):
        experts = model.model.layers[layer].mlp.experts
        assert experts.quantized_experts == "int4" and not hasattr(experts, "gate_up_proj")
        for projection, tensors in EXPERT_TENSORS.items():
            words, pairs = getattr(experts, f"{projection}_codes"), getattr(experts, f"{projection}_scales")
            count, word_rows, outputs = words.shape  # code j of word w: input 8w + j
            codes = (words[:, :, None, :] >> (4 * torch.arange(8))[None, None, :, None]) & 15
            codes = codes.reshape(count, word_rows * 8, outputs).transpose(1, 2)
            scales = pairs.view(torch.bfloat16).reshape(count, word_rows // 4, outputs, 2)[..., 0].transpose(1, 2)
            stored = []
            for name in (f"blk.{layer}.{tensor}.weight" for tensor in tensors):
                info = file.tensors[name]
                parts = int4_groups(file.raw(name), info.ggml_type, (info.shape[0] * info.shape[1], info.shape[2]))
                stored.append([part.view(info.shape[0], info.shape[1], -1) for part in parts])
            file_codes, file_scales, _ = (torch.cat(p, dim=1) for p in zip(*stored, strict=True))
            assert torch.equal(codes, file_codes.to(codes.dtype))
            assert torch.equal(scales, file_scales.to(torch.bfloat16))
