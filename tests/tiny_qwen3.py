"""A tiny random-weight Qwen3 reasoning model: the demo tokenizer with `<think>` and `</think>` added, a Qwen3-like
chat template, and weights biased so that the model ends its reasoning by itself.

Random weights give a near-uniform distribution over the vocabulary, where `</think>` would come once in about 50,000
tokens. So one hidden dimension `BIAS_DIM` carries the same value in every token's embedding, and no layer writes to it
(that row of every o_proj and down_proj is zero): after the final norm it is about the same at every position, and the
lm_head reads only `</think>` and `<think>` from it: `</think>` with the weight that gives it the probability END_P at
temperature 1.0, `<think>` with the weight that makes it START_ODDS times as likely as an ordinary token (still rare
unconstrained, but a good chance where a grammar's mask allows a few tokens beside it). Every other token keeps its
near-uniform share.
"""

import math
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

START, END = "<think>", "</think>"
END_P = 1 / 7  # the chance of `</think>` at each unconstrained draw
START_ODDS = 2.0  # `<think>` against any other token but `</think>`
BIAS_DIM = 0
BIAS_VALUE = 1.0  # far above the random weights (std 0.02): this dimension dominates the final norm


def _chat_template(generation_prompt: str) -> str:
    """ChatML, with an assistant message's earlier reasoning dropped from the history (as Qwen3's template does), and
    this generation prompt."""
    return (
        "{%- for message in messages %}"
        "{%- set content = message['content'] %}"
        "{%- if message['role'] == 'assistant' and '</think>' in content %}"
        "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
        "{%- endif %}"
        "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}" + generation_prompt + "{%- endif %}"
    )


# Qwen3's: the model opens its reasoning itself; `enable_thinking=False` closes it in the prompt (an answer at once).
QWEN3_TEMPLATE = _chat_template(
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
)
# DeepSeek-R1's: the generation prompt opens the reasoning.
R1_TEMPLATE = _chat_template("{{- '<|im_start|>assistant\\n<think>\\n' }}")


def build_tiny_qwen3(directory: Path, tokenizer_dir: Path) -> Path:
    """The model directory (float32 safetensors, config.json, tokenizer files) in `directory`."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_tokens([START, END])  # not special: the detokenizer writes them into the text
    tokenizer.chat_template = QWEN3_TEMPLATE
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(torch.float32)
    start_id, end_id = tokenizer.convert_tokens_to_ids([START, END])
    with torch.no_grad():
        model.model.embed_tokens.weight[:, BIAS_DIM] = BIAS_VALUE
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[BIAS_DIM] = 0
            layer.mlp.down_proj.weight[BIAS_DIM] = 0
        normed = _normed_bias(model, tokenizer)
        model.lm_head.weight[:, BIAS_DIM] = 0
        # The logit that gives END_P against the other tokens' near-zero logits.
        model.lm_head.weight[end_id, BIAS_DIM] = math.log(END_P / (1 - END_P) * (len(tokenizer) - 1)) / normed
        model.lm_head.weight[start_id, BIAS_DIM] = math.log(START_ODDS) / normed
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def _normed_bias(model: Qwen3ForCausalLM, tokenizer) -> float:
    """BIAS_DIM's value after the final norm, at the last position of a prompt."""
    ids = tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    hidden = model.model(input_ids=ids).last_hidden_state
    return float(hidden[0, -1, BIAS_DIM])
