"""Architectures off the dense Llama path on the torch runtime, each against transformers' own `generate` on the same
tiny random-weight model (float32, greedy): sliding windows (every layer's, Qwen2's upper layers', Gemma 3's five
sliding layers to one full, and under transformers' eager attention Gemma 2's soft-capped and gpt-oss's sink-weighted
alternate layers), multi-query attention in Falcon-7B's layout, DeepSeek-V3's latent attention, Doge's mask of each
head's own, Hunyuan-MoE's and ERGO's reads of a (CPU-packed) linear layer's weight dtype; and what the engine cannot
compute yet refused at load, naming it (the model types that bench/architectures.py found crashing or giving other
tokens).

The weights have a wide spread (initializer_range 0.5, Gemma's less) so that what a layer attends to changes the
tokens: each windowed case checks that the same weights without the window give other tokens within the generated
ones."""

from importlib import import_module
from pathlib import Path

import pytest
import torch
from conftest import cli, engine_config, greedy, make_tiny_model, submit_together
from serving import running
from test_engine import cpu_graphs  # noqa: F401 -- the fixture

from rbee_worker.engine.engine import Engine
from rbee_worker.engine.request_types import Request
from rbee_worker.engine.runners.rows import window_blocks_for
from rbee_worker.engine.runners.torch.attention import EAGER_NAME, use_engine_attention
from rbee_worker.engine.runners.torch.kv_cache import kv_bytes_per_token, sliding_layers
from rbee_worker.engine.sampling.sampling_params import SamplingParams
from rbee_worker.errors import ModelLoadError
from rbee_worker.hardware.devices import resolve_placement
from rbee_worker.loading.hf import UNSERVED
from rbee_worker.loading.loader import load_model

WINDOW = 8
NEW_TOKENS = 40  # prompt + output pass the window by far
PROMPT = "Once upon a time, in a small village by the sea, there lived"
OTHER_PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"
GREEDY = SamplingParams(temperature=0.0)
SPREAD = {"initializer_range": 0.5}
CASES = {
    "mistral": ("mistral", {"sliding_window": WINDOW}),
    "qwen2": ("qwen2", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
    # Its layers set the window on the module and pass none to attention; its first layer slides.
    "qwen2_moe": (
        "qwen2_moe",
        {
            "use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 2, "num_experts": 4,
            "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
        },
    ),
    # Gemma's scaled embeddings and extra norms saturate at the others' spread: one token over and over.
    "gemma3_text": (
        "gemma3_text",
        {"num_hidden_layers": 6, "sliding_window": WINDOW, "head_dim": 16, "initializer_range": 0.05},
    ),
    # Eager attention only (transformers has no sdpa for them), each window on alternate layers, the first sliding:
    # Gemma 2's soft-capped logits (a cap and a query_pre_attn_scalar that make the cap change the tokens) and gpt-oss's
    # attention sinks and experts.
    "gemma2": (
        "gemma2",
        {
            "sliding_window": WINDOW, "head_dim": 16, "initializer_range": 0.05, "query_pre_attn_scalar": 1,
            "attn_logit_softcapping": 2.0,
        },
    ),
    "gpt_oss": (
        "gpt_oss", {"sliding_window": WINDOW, "head_dim": 16, "num_local_experts": 8, "num_experts_per_tok": 2}
    ),
    "falcon-7b": ("falcon", {"multi_query": True, "new_decoder_architecture": False, "num_kv_heads": None}),
    # Its layers make the engine's mask one of each head's own (an additive bias): neither folded into the key/value
    # heads nor dropped for a causal first chunk.
    "doge": ("doge", {}),
    # Their layers read a linear layer's weight dtype (the router's, the attention output's), which a CPU's packed
    # linear layers keep on the meta device.
    "hunyuan_v1_moe": ("hunyuan_v1_moe", {"head_dim": 16, "num_experts": 4, "moe_topk": 2, "num_experts_per_tok": 2}),
    "ergo": (
        "ergo",
        {
            "sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"], "head_dim": 16,
            "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "mlp_layer_types": ["dense", "sparse"],
        },
    ),
    "deepseek_v3": (
        "deepseek_v3",
        {
            "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12,
            "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
            "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "num_key_value_heads": 4,
        },
    ),
}  # fmt: skip


def reference(directory: Path, prompt_ids: list[int], sinks: bool = True, **config: object) -> list[int]:
    """transformers' greedy tokens for the model in `directory` (its config changed by `config`; without `sinks`,
    gpt-oss's attention sinks set to a logit that takes no weight)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if getattr(AutoConfig.from_pretrained(directory), "attn_logit_softcapping", None) is not None:
        # Only transformers' eager attention computes Gemma 2's soft-capping, which some versions (5.17) leave out
        # under their default, SDPA.
        config.setdefault("attn_implementation", "eager")
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **config)
    if not sinks:
        for layer in model.model.layers:
            layer.self_attn.sinks.data.fill_(-1e4)
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(prompt_ids) :].tolist()


def twice_together(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of each prompt twice, the four requests submitted at once (the second of each prompt reads the
    first's blocks from the prefix cache)."""
    requests = [Request(tuple(ids), max_tokens=NEW_TOKENS, sampling=GREEDY) for ids in (*prompts, *prompts)]
    return submit_together(engine, requests)


def pool_bytes(directory: Path, full_blocks: int) -> int:
    """A KV budget (float32, 4 rows, blocks and prompt chunks of 4) whose full layers' pool holds `full_blocks` blocks
    beside the sliding layers' windows (rows.window_blocks_for) where the model has them."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(directory)
    window, sliding = sliding_layers(config)
    layers = config.get_text_config().num_hidden_layers
    full = (full_blocks + 1) * 4 * kv_bytes_per_token(config, torch.float32, layers - len(sliding))
    if window is None:
        return full
    return full + window_blocks_for(window, 4, 4, 4) * 4 * kv_bytes_per_token(config, torch.float32, len(sliding))


@pytest.fixture(scope="module")
def prompts(demo_tokenizer_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_tokenizer_dir)
    return [tokenizer(text)["input_ids"] for text in (PROMPT, OTHER_PROMPT)]


def transformers_version() -> str:
    from transformers import __version__

    return __version__


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, demo_tokenizer_dir: Path):
    made: dict[str, Path] = {}

    def get(case: str) -> Path:
        from transformers import CONFIG_MAPPING

        if case not in made:
            model_type, overrides = CASES[case]
            if model_type not in CONFIG_MAPPING:  # newer than this transformers (5.17 lacks ergo)
                pytest.skip(f"transformers {transformers_version()} has no {model_type}")
            made[case] = make_tiny_model(
                tmp_path_factory.mktemp(case), model_type, demo_tokenizer_dir, **{**SPREAD, **overrides}
            )
        return made[case]

    return get


@pytest.mark.parametrize("case", list(CASES))
def test_the_engine_gives_transformers_tokens(case: str, tiny, prompts: list[list[int]]) -> None:
    """Alone, then four requests at once (two prompts twice: the second of each reads the first's cached blocks),
    with prompt chunks of 4 tokens (less than the window) in blocks of 4."""
    directory = tiny(case)
    if case == "doge" and not hasattr(import_module("transformers.models.doge.modeling_doge").DogeForCausalLM,
                                      "create_masks_for_generate"):  # fmt: skip
        # Before it, DogeModel's forward drops the causal mask of a prompt (SDPA's is_causal shortcut) and then adds
        # its dynamic mask to none: transformers' own prompt forward sees later tokens (5.17 does).
        pytest.skip(f"transformers {transformers_version()}'s Doge attends to later tokens of a prompt")
    expected = [reference(directory, ids) for ids in prompts]
    if "sliding_window" in CASES[case][1]:  # the window changes the tokens: the comparisons below can fail
        assert reference(directory, prompts[0], sliding_window=512) != expected[0]  # a window as long as the context
    if case == "gemma2":  # so do the soft-capping and the sinks
        assert reference(directory, prompts[0], attn_logit_softcapping=None) != expected[0]
    if case == "gpt_oss":
        assert reference(directory, prompts[0], sinks=False) != expected[0]
    config = engine_config(max_batch=4, prefill_chunk=4, block_size=4)
    engine = Engine(lambda: load_model(str(directory), resolve_placement("cpu", "float32")), config)
    try:
        alone, _ = greedy(engine, prompts[0], NEW_TOKENS)
        together = twice_together(engine, prompts)
        _, cached = engine.prefix_cache_tokens()
        kv = engine._runner.kv
    finally:
        engine.close()
    sliding = "sliding_window" in CASES[case][1]  # its sliding layers keep their windows only, in a pool of their own
    assert (kv.window, kv.window_blocks > 0) == ((WINDOW, True) if sliding else (None, False))
    assert alone == expected[0]
    assert together == [*expected, *expected]
    assert cached > 0


@pytest.mark.parametrize("case", ["gemma3_text", "gpt_oss"])
def test_requests_preempted_under_windows_give_transformers_tokens(case: str, tiny, prompts: list[list[int]]) -> None:
    """Four requests at once (two prompts twice) where the full layers' pool holds 30 blocks of 4 positions, two
    requests' worth, beside the sliding layers' windows: the newer ones are preempted and compute their windows' keys
    again on resuming, and all give transformers' tokens."""
    directory = tiny(case)
    expected = [reference(directory, ids) for ids in prompts]
    config = engine_config(max_batch=4, prefill_chunk=4, block_size=4, kv_cache_bytes=pool_bytes(directory, 30))
    engine = Engine(lambda: load_model(str(directory), resolve_placement("cpu", "float32")), config)
    try:
        together = twice_together(engine, prompts)
        preempted = engine.preemptions
    finally:
        engine.close()
    assert preempted > 0
    assert together == [*expected, *expected]


@pytest.mark.usefixtures("cpu_graphs")
@pytest.mark.parametrize("case", ["gemma2", "gpt_oss"])
def test_decode_graphs_read_windows_from_the_paged_pool(case: str, tiny, prompts: list[list[int]]) -> None:
    """Decode steps through DecodeGraphs on the CPU (test_engine.cpu_graphs), whose attention reads the paged pool
    through the block tables (CUDA's decode path), give transformers' tokens under eager attention's windows, alone
    and four requests at once."""
    directory = tiny(case)
    expected = [reference(directory, ids) for ids in prompts]
    config = engine_config(max_batch=4, block_size=4, cuda_graphs=True)
    engine = Engine(lambda: load_model(str(directory), resolve_placement("cpu", "float32")), config)
    try:
        assert engine.loaded and engine._runner.graphs is not None
        alone, _ = greedy(engine, prompts[0], NEW_TOKENS)
        together = twice_together(engine, prompts)
    finally:
        engine.close()
    assert alone == expected[0]
    assert together == [*expected, *expected]


def test_sliding_windows_over_http_give_transformers_tokens(
    tmp_path: Path, tiny, prompts: list[list[int]], demo_tokenizer_dir: Path
) -> None:
    """Gemma 3's five sliding layers to one full through `serve`: four concurrent completions (two prompts twice)
    give the text of transformers' tokens."""
    import asyncio

    import httpx
    from transformers import AutoTokenizer

    directory = tiny("gemma3_text")
    tokenizer = AutoTokenizer.from_pretrained(demo_tokenizer_dir)
    expected = [tokenizer.decode(reference(directory, ids), skip_special_tokens=True) for ids in prompts]

    async def complete(client: httpx.AsyncClient, ids: list[int]) -> str:
        body = {"prompt": ids, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    async def together(url: str) -> list[str]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            return list(await asyncio.gather(*(complete(client, ids) for ids in (*prompts, *prompts))))

    with running(tmp_path, "--model", str(directory), "--dtype", "float32", "--max-batch", "4", fork=True) as worker:
        got = asyncio.run(together(worker.url))
    assert got == [*expected, *expected]


def test_a_soft_capped_model_under_sdpa_gets_eager_attention(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma 2 where transformers defaults it to sdpa (5.17 does), which leaves its soft-capping out: the engine
    gives it transformers' eager attention, through its own eager path."""
    from transformers import AutoModelForCausalLM
    from transformers.models.gemma2 import modeling_gemma2

    monkeypatch.setattr(modeling_gemma2.Gemma2PreTrainedModel, "_supports_sdpa", True)
    model = AutoModelForCausalLM.from_pretrained(tiny("gemma2"), dtype=torch.float32, attn_implementation="sdpa")
    assert model.config._attn_implementation == "sdpa"
    assert use_engine_attention(model, 512)
    assert model.config._attn_implementation == EAGER_NAME


def test_a_mask_of_each_heads_own_on_cuda_is_refused_naming_it(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """Doge's dynamic mask, which the paged decode kernel on CUDA would not apply, is refused at load there
    (ModelLoadError: exit 2) naming the model type and CUDA; the model is taken for one on CUDA here."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny("doge"), dtype=torch.float32)
    monkeypatch.setattr(type(model), "device", property(lambda _: torch.device("cuda")))
    with pytest.raises(ModelLoadError, match=r"^doge: an attention mask of each head's own .* on CUDA"):
        use_engine_attention(model, 512)


def test_another_attention_than_the_engines_on_cuda_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model whose transformers class computes attention eagerly and has no window (MPT) keeps transformers' own
    attention on a CPU; on CUDA, where decode steps hand the paged pool to the engine's attention, it is refused at
    load (ModelLoadError: exit 2) naming the model type, the attention and CUDA; the model is taken for one on CUDA
    here."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("mpt", d_model=32, n_heads=2, n_layers=1, vocab_size=64, max_seq_len=64)
    model = AutoModelForCausalLM.from_config(config)
    assert model.config._attn_implementation == "eager"
    assert use_engine_attention(model, 64) is False
    monkeypatch.setattr(type(model), "device", property(lambda _: torch.device("cuda")))
    with pytest.raises(ModelLoadError, match=r"^mpt: transformers' eager attention on CUDA is not served yet"):
        use_engine_attention(model, 64)


@pytest.mark.parametrize("layer_type", ["teleported_attention", "chunked_attention"])
def test_a_layer_type_the_engine_cannot_compute_exits_2_naming_it(
    layer_type: str, tmp_path: Path, demo_tokenizer_dir: Path
) -> None:
    """A made-up layer type (which transformers' config refuses) and one that transformers knows but the engine has
    no path for: `generate` exits 2 with one error line that names it, before any token."""
    directory = make_tiny_model(tmp_path / "odd", "qwen3", demo_tokenizer_dir)
    config = (directory / "config.json").read_text()
    (directory / "config.json").write_text(config.replace('"full_attention"', f'"{layer_type}"', 1))
    result = cli("generate", "--model", str(directory), "--prompt", "hi", "--max-tokens", "2", fork=True)
    assert result.returncode == 2 and f"layer type {layer_type} in" in result.stderr, result.stderr
    assert "not served by the torch runtime" in result.stderr
    assert len([line for line in result.stderr.splitlines() if line.startswith("error:")]) == 1


# Configs of what the engine computes otherwise than transformers or not at all (loading/hf.py check_attention), each
# with what its refusal names (bench/architectures.py found each crashing or giving other tokens).
REFUSED = {
    **{model_type: ({}, feature.split(",")[0]) for model_type, feature in UNSERVED.items()},
    "falcon": ({"alibi": True}, "ALiBi"),
    "doge": ({"keep_window_size": 8}, "dynamic mask"),
    "gemma4_text": ({}, "vary per layer (head_dim)"),
    "rwkv": ({}, "without attention heads"),
    "xlstm": ({}, "without attention heads"),
}


@pytest.mark.parametrize("model_type", list(REFUSED))
def test_an_attention_the_engine_cannot_compute_exits_2_naming_it(model_type: str, tmp_path: Path) -> None:
    """`generate` on a directory of the model type's config alone exits 2 at load with one error line naming the model
    type and what the torch runtime does not serve, before any weight is read."""
    from transformers import AutoConfig

    overrides, feature = REFUSED[model_type]
    AutoConfig.for_model(model_type, **overrides).save_pretrained(tmp_path)
    result = cli("generate", "--model", str(tmp_path), "--prompt", "hi", "--max-tokens", "2", fork=True)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"{model_type} in " in errors[0] and feature in errors[0], result.stderr
    assert "is not served by the torch runtime" in errors[0]
