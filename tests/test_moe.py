"""Mixtures of experts on the torch runtime, each family transformers has, against transformers' own `generate` on the
same tiny random-weight model (float32, greedy): 8 experts, 2 routed per token (DeepSeek-V3's group-limited routing
and shared expert, Qwen2-MoE's shared expert, gpt-oss's biased experts with its windows and sinks), weights spread
so that the routing varies from token to token. Each family alone, then four requests at once (two prompts twice:
the second of each reads the first's cached blocks, and the batch's tokens go to most of the experts) in a KV pool
where two requests fit, so that the newer ones are preempted and compute their keys again."""

from pathlib import Path

import pytest
import torch
from conftest import engine_config, greedy, make_tiny_model
from test_architectures import NEW_TOKENS, OTHER_PROMPT, PROMPT, pool_bytes, reference, twice_together

from rbee_worker.devices import resolve_placement
from rbee_worker.engine.engine import Engine
from rbee_worker.models.loader import load_model

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
    mixture-of-experts layer (an experts module's second argument: each token's routed experts)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    seen: set[int] = set()

    def record(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        index = args[1] if len(args) > 1 else next(iter(v for k, v in kwargs.items() if "ind" in k))
        seen.update(index.flatten().tolist())

    for module in model.modules():
        if type(module).__name__.endswith("Experts"):
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
    # /health's and the ready callback's active_weight_bytes: all but the 6 of 8 experts a token is not routed to
    assert info.weight_bytes - info.active_weight_bytes == experts * (EXPERTS - ROUTED) // EXPERTS > 0
