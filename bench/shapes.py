"""Real-shape models (Llama; Gemma 3 for sliding windows; Qwen3-30B-A3B and gpt-oss-20b for mixtures of experts)
with random weights (fixed seed), written as safetensors directories for the GPU checks and benchmarks (speed does
not depend on the weights' values).

    PYTHONPATH=src python bench/shapes.py --shape llama-3.1-8b --tokenizer DIR --out /tmp/llama-8b
    PYTHONPATH=src python bench/shapes.py --shape qwen3-30b-a3b --layers 24 --tokenizer DIR --out /tmp/q30b

The tokenizer is the demo model's, its vocabulary padded with placeholder tokens up to the shape's vocab size, so
every id the random model draws can be decoded.
"""

import argparse
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

SHAPES = {
    "llama-3.2-1b": dict(
        model_type="llama",
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    "llama-3.1-8b": dict(
        model_type="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    # google/gemma-3-12b-it's text model: five sliding layers (a 1,024-token window) to one full, 48 layers.
    "gemma-3-12b": dict(
        model_type="gemma3_text",
        vocab_size=262208,
        hidden_size=3840,
        intermediate_size=15360,
        num_hidden_layers=48,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=256,
        sliding_window=1024,
        query_pre_attn_scalar=256,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        },
    ),
    # Qwen/Qwen3-30B-A3B: 128 experts of width 768, 8 routed per token, in each of 48 layers.
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=False,
    ),
    # openai/gpt-oss-20b: 32 experts, 4 routed, a 128-token window with attention sinks on alternate layers.
    "gpt-oss-20b": dict(
        model_type="gpt_oss",
        vocab_size=201088,
        hidden_size=2880,
        intermediate_size=2880,
        num_local_experts=32,
        num_experts_per_tok=4,
        num_hidden_layers=24,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 12,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
    ),
}


def shape_config(shape: str, layers: int | None = None, **tokens: int) -> object:
    """The shape's config; `layers`: its first layers only (a model too large for a disk keeps its layers' shape)."""
    fields = dict(SHAPES[shape])
    model_type = fields.pop("model_type")
    if layers is not None:
        fields["num_hidden_layers"] = layers
        if "layer_types" in fields:
            fields["layer_types"] = fields["layer_types"][:layers]
    return AutoConfig.for_model(model_type, **fields, **tokens)


def write_model(shape: str, tokenizer_dir: Path, target: Path, layers: int | None = None) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = shape_config(shape, layers, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    tokenizer.add_tokens([f"<placeholder_{i}>" for i in range(config.vocab_size - len(tokenizer))])
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    del model
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, help="the shape's first layers only (default: all of them)")
    args = parser.parse_args()
    write_model(args.shape, args.tokenizer, args.out, args.layers)


if __name__ == "__main__":
    main()
