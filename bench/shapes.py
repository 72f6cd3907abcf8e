"""Real-shape models (Llama, and Gemma 3 for sliding windows) with random weights (fixed seed), written as
safetensors directories for the GPU checks and benchmarks (speed does not depend on the weights' values).

    PYTHONPATH=src python bench/shapes.py --shape llama-3.1-8b --tokenizer DIR --out /tmp/llama-8b

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
}


def write_model(shape: str, tokenizer_dir: Path, target: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    fields = dict(SHAPES[shape])
    model_type = fields.pop("model_type")
    config = AutoConfig.for_model(
        model_type, **fields, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id
    )
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
    args = parser.parse_args()
    write_model(args.shape, args.tokenizer, args.out)


if __name__ == "__main__":
    main()
