"""Mixtures of experts on the torch runtime, each family transformers has, against transformers' own `generate` on the
same tiny random-weight model (float32, greedy): 8 experts, 2 routed per token (DeepSeek-V3's group-limited routing
and shared expert, Qwen2-MoE's shared expert, gpt-oss's biased experts with its windows and sinks, Llama 4's
sigmoid-scored experts before a shared one), weights spread
so that the routing varies from token to token. Each family alone, then four requests at once (two prompts twice:
the second of each reads the first's cached blocks, and the batch's tokens go to most of the experts) in a KV pool
where two requests fit, so that the newer ones are preempted and compute their keys again."""

from pathlib import Path

import pytest
import torch
from conftest import engine_config, greedy, make_tiny_model
from test_architectures import NEW_TOKENS, OTHER_PROMPT, PROMPT, pool_bytes, reference, twice_together

from rbee_worker.engine.engine import Engine
from rbee_worker.hardware.devices import resolve_placement
from rbee_worker.loading.loader import load_model

EXPERTS, ROUTED = 8, 2
FAMILIES = {
    "mixtral": ("mixtral", {"num_local_experts": EXPERTS, "num_experts_per_tok": ROUTED}),
    "qwen2_moe": (
        "qwen2_moe",
        {
            "num_experts": EXPERTS, "num_experts_per_tok": ROUTED, "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
        },
    ),
    "qwen3_moe": ("qwen3_moe", {"num_experts": EXPERTS, "num_experts_per_tok": ROUTED, "moe_intermediate_size": 32}),
    "gpt_oss": (
        "gpt_oss", {"num_local_experts": EXPERTS, "num_experts_per_tok": ROUTED, "head_dim": 16, "sliding_window": 8}
    ),
    # Llama 4's text model without its chunked attention (which the torch runtime refuses, naming it)
    "llama4_text": (
        "llama4_text",
        {
            "num_local_experts": EXPERTS, "num_experts_per_tok": ROUTED, "head_dim": 16, "intermediate_size": 32,
            "intermediate_size_mlp": 64, "attention_chunk_size": None, "interleave_moe_layer_step": 1,
        },
    ),
    "deepseek_v3": (
        "deepseek_v3",
        {
            "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12,
            "n_routed_experts": EXPERTS, "num_experts_per_tok": ROUTED, "moe_intermediate_size": 32,
            "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1,
            "num_key_value_heads": 4,
        },
    ),
}  # fmt: skip
FITTING = 30  # blocks of 4 positions of the full layers' pool: two requests' worth


@pytest.fixture(scope="module")
def prompts(demo_tokenizer_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_tokenizer_dir)
    return [tokenizer(text)["input_ids"] for text in (PROMPT, OTHER_PROMPT)]


def routed_experts(directory: Path, prompt_ids: list[list[int]]) -> set[int]:
    """The experts that transformers' forward of these prompts (one batch, right-padded) routes tokens to, in every
    mixture-of-experts layer (an experts module's second argument: each token's routed experts; Llama 4's experts
    take every token, weighted by its router's scores, 0 where it is not routed)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    seen: set[int] = set()

    def record(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        index = args[1] if len(args) > 1 else next(iter(v for k, v in kwargs.items() if "ind" in k))
        seen.update(index.flatten().tolist())

    def record_scores(module: torch.nn.Module, args: tuple, output: tuple) -> None:
        seen.update(output[0].nonzero()[:, 1].tolist())

    for module in model.modules():
        if type(module).__name__ == "Llama4Router":
            module.register_forward_hook(record_scores)
        elif type(module).__name__.endswith("Experts") and type(module).__name__ != "Llama4TextExperts":
            module.register_forward_pre_hook(record, with_kwargs=True)
    width = max(len(ids) for ids in prompt_ids)
    batch = torch.tensor([ids + [0] * (width - len(ids)) for ids in prompt_ids])
    mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids in prompt_ids])
    with torch.inference_mode():
        model(input_ids=batch, attention_mask=mask)
    return seen


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_mixture_of_experts_gives_transformers_tokens(
    family: str, tmp_path: Path, prompts: list[list[int]], demo_tokenizer_dir: Path
) -> None:
    model_type, overrides = FAMILIES[family]
    directory = make_tiny_model(tmp_path, model_type, demo_tokenizer_dir, initializer_range=0.5, **overrides)
    expected = [reference(directory, ids) for ids in prompts]
    assert len(routed_experts(directory, prompts)) >= EXPERTS - 1  # the prompts' tokens go to most experts
    assert reference(directory, prompts[0], num_experts_per_tok=1) != expected[0]  # and the routing makes the tokens
    config = engine_config(max_batch=4, prefill_chunk=4, block_size=4, kv_cache_bytes=pool_bytes(directory, FITTING))
    engine = Engine(lambda: load_model(str(directory), resolve_placement("cpu", "float32")), config)
    try:
        alone, _ = greedy(engine, prompts[0], NEW_TOKENS)
        together = twice_together(engine, prompts)
        _, cached = engine.prefix_cache_tokens()
        preempted = engine.preemptions
        info, modules = engine.loaded.info, engine.loaded.model.modules()
        experts = sum(p.nbytes for m in modules if type(m).__name__.endswith("Experts") for p in m.parameters())
    finally:
        engine.close()
    assert alone == expected[0]
    assert together == [*expected, *expected]
    assert cached > 0 and preempted > 0
    # /health's and the ready callback's active_weight_bytes: all but the 6 of 8 experts a token is not routed to (and
    # all of them where every expert computes every token)
    if family == "llama4_text":  # its experts take every token: all of their weights are read
        assert info.weight_bytes == info.active_weight_bytes
    else:
        assert info.weight_bytes - info.active_weight_bytes == experts * (EXPERTS - ROUTED) // EXPERTS > 0


FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's checkpoint form of an experts weight [E, in, out]: per output row, blocks of 32 inputs as 4-bit E2M1
    values (two a byte, the even input in the low nibble) [E, out, in / 32, 16] and a power-of-two scale each, as
    exponent + 127 [E, out, in / 32]: the scale puts a block's largest magnitude at or below E2M1's largest, 6."""
    rows = weight.transpose(1, 2).reshape(*weight.shape[:1], weight.shape[2], -1, 32).float()
    exponent = torch.ceil(torch.log2(rows.abs().amax(-1).clamp_min(1e-30) / 6.0)).clamp(-127, 127)
    scaled = rows / torch.exp2(exponent)[..., None]
    magnitude = (scaled.abs()[..., None] - FP4_VALUES).abs().argmin(-1)
    codes = (magnitude + 8 * (scaled < 0)).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exponent + 127).to(torch.uint8)


def test_gpt_oss_mxfp4_experts_load_dequantized(
    tmp_path: Path, prompts: list[list[int]], demo_tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tiny gpt-oss whose checkpoint holds its experts as MXFP4 (blocks and scales, quantization_config mxfp4, as the
    released gpt-oss models do) loads with its experts dequantized as transformers' `Mxfp4Config(dequantize=True)`
    dequantizes them, and gives that model's greedy tokens; so even where transformers would take the `kernels`
    package's MXFP4 kernels (fetched from the hub: here it is made to believe that package and Triton installed)."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers import Mxfp4Config

    model_type, overrides = FAMILIES["gpt_oss"]
    directory = make_tiny_model(tmp_path, model_type, demo_tokenizer_dir, initializer_range=0.5, **overrides)
    weights = load_file(directory / "model.safetensors")
    for name in [n for n in weights if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        weights[f"{name}_blocks"], weights[f"{name}_scales"] = mxfp4(weights.pop(name))
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    skipped = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": skipped}
    (directory / "config.json").write_text(json.dumps(config))
    expected = reference(directory, prompts[0], quantization_config=Mxfp4Config(dequantize=True))
    from transformers.quantizers import quantizer_mxfp4

    monkeypatch.setattr(quantizer_mxfp4, "is_kernels_available", lambda: True)
    monkeypatch.setattr(quantizer_mxfp4, "is_triton_available", lambda *version: True)
    engine = Engine(lambda: load_model(str(directory), resolve_placement("cpu", "float32")), engine_config(max_batch=2))
    try:
        tokens, _ = greedy(engine, prompts[0], NEW_TOKENS)
    finally:
        engine.close()
    assert tokens == expected
