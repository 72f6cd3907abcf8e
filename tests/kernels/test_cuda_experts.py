"""Mixtures of experts on CUDA through the fused experts kernels (kernels/cuda_experts.py). Skipped without a CUDA GPU;
tests/kernels/test_cuda_kernels_interpreted.py checks the same kernels' logic on a CPU.

- float32 (the kernels multiply in IEEE float32): each family's tiny model of tests/engine/test_moe.py decodes in CUDA
graphs
  to the CPU float32 engine's tokens, which test_moe holds to transformers' `generate`, alone and four at once.
- bfloat16: logits as close to float32 as transformers' own grouped-matmul experts give them (at most twice its
  error), and the kernels at Qwen3-30B-A3B's and gpt-oss-20b's widths against a float32 product of the same weights.
"""

from pathlib import Path

import pytest
import torch
from conftest import greedy, make_tiny_model, submit_together
from test_architectures import GREEDY
from test_cuda import agree_but_near_ties
from test_moe import FAMILIES

from rbee_worker.engine.engine import Engine
from rbee_worker.engine.engine_config import EngineConfig
from rbee_worker.engine.request_types import Request
from rbee_worker.hardware.devices import Placement
from rbee_worker.loading.loader import load_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)
PROMPTS = ["def fibonacci(n):\n", "Once upon a time, in a small village by the sea,"]
# DeepSeek-V3's latent attention is refused on CUDA (engine/runners/torch/device_paths.py): its experts run in the CPU
# tests alone; so do Llama 4's, which take every token outside transformers' experts interface (no fused kernels serve
# them).
ON_CUDA = [family for family in FAMILIES if family not in ("deepseek_v3", "llama4_text")]


def tiny(family: str, directory: Path, tokenizer_dir: Path) -> Path:
    model_type, overrides = FAMILIES[family]
    return make_tiny_model(directory, model_type, tokenizer_dir, initializer_range=0.5, **overrides)


@pytest.mark.parametrize("family", ON_CUDA)
def test_experts_on_cuda_graphs_give_the_cpu_float32_tokens(
    family: str, tmp_path: Path, demo_tokenizer_dir: Path
) -> None:
    directory = tiny(family, tmp_path / family, demo_tokenizer_dir)
    config = EngineConfig(max_batch=4, kv_cache_bytes=64 << 20)
    engines = [Engine(lambda d=d: load_model(str(directory), Placement(d, torch.float32)), config) for d in (CPU, CUDA)]
    try:
        assert engines[1].loaded.model.config._experts_implementation == "rbee_fused"
        prompts = [engines[0].model.tokenize(p) for p in PROMPTS]
        expected = [greedy(engines[0], ids, 40)[0] for ids in prompts]
        assert [greedy(engines[1], ids, 40)[0] for ids in prompts] == expected
        requests = [Request(ids, max_tokens=40, sampling=GREEDY) for ids in prompts * 2]
        assert submit_together(engines[1], requests) == expected * 2
    finally:
        for engine in engines:
            engine.close()


@pytest.mark.parametrize("family", ON_CUDA)
def test_experts_in_bfloat16_are_as_close_to_float32_as_transformers_own(
    family: str, tmp_path: Path, demo_tokenizer_dir: Path
) -> None:
    from rbee_worker.kernels.cuda_experts import use_fused_experts

    directory = tiny(family, tmp_path / family, demo_tokenizer_dir)
    reference = load_model(str(directory), Placement(CPU, torch.float32)).model
    loaded = load_model(str(directory), Placement(CUDA, torch.bfloat16))
    ids = torch.tensor([loaded.tokenizer(PROMPTS[1])["input_ids"]])
    with torch.inference_mode():
        expected = reference(ids).logits[0].float()
        own = loaded.model(ids.to(CUDA)).logits[0].float().cpu()  # transformers' default experts (grouped_mm)
        assert use_fused_experts(loaded.model) > 0
        fused = loaded.model(ids.to(CUDA)).logits[0].float().cpu()
    own_error, fused_error = ((x - expected).abs().max().item() for x in (own, fused))
    print(f"{family}: bf16 max |logit error| vs fp32: fused {fused_error:.4g}, transformers {own_error:.4g}")
    assert fused_error <= 2 * own_error + 1e-3 * expected.abs().max().item()


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_experts_decode_with_graphs_as_eagerly(mode: str, tmp_path: Path, demo_tokenizer_dir: Path) -> None:
    """--quantize int8 / int4 of a mixture of experts keeps its experts quantized on CUDA (a module's codes replace its
    float weights; the weights shrink) and decodes in CUDA graphs to the tokens of the engine without graphs, or part
    at a near-tie (test_cuda.agree_but_near_ties)."""
    directory = tiny("qwen3_moe", tmp_path / "qwen3_moe", demo_tokenizer_dir)
    plain = load_model(str(directory), Placement(CUDA, torch.bfloat16)).info
    results: list[list[list[int]]] = []
    for graphs in (True, False):
        config = EngineConfig(max_batch=4, kv_cache_bytes=64 << 20, cuda_graphs=graphs)
        engine = Engine(lambda: load_model(str(directory), Placement(CUDA, torch.bfloat16), quantize=mode), config)
        try:
            info, model = engine.loaded.info, engine.loaded.model
            experts = [m for m in model.modules() if getattr(m, "quantized_experts", None) == mode]
            assert len(experts) == 2 and not any(hasattr(m, "gate_up_proj") for m in experts)
            assert info.weight_bytes < plain.weight_bytes and info.active_weight_bytes < plain.active_weight_bytes
            prompts = [engine.model.tokenize(p) for p in PROMPTS]
            results.append([greedy(engine, ids, 40)[0] for ids in prompts])
            if not graphs:
                agree_but_near_ties(engine, prompts, *results, mode)
        finally:
            engine.close()


def test_a_gguf_file_keeps_its_4_bit_experts_on_cuda(tmp_path: Path, demo_gguf: Path, demo_tokenizer_dir: Path) -> None:
    """A Q4_0 Qwen3-MoE GGUF file on CUDA (`--quantize auto`): every experts module holds the file's codes (its
    projections' float weights gone; the codes decode to the file's weights exactly), and the last logits stay within
    2% of the largest of transformers' over the file's dequantized weights, as for the file's other matrices
    (test_gguf_architectures.test_a_quantized_file_keeps_its_matrices_quantized)."""
    import gguf
    from test_gguf_architectures import CASES, write_gguf
    from transformers import AutoModelForCausalLM

    from rbee_worker.loading.gguf.gguf_format import read_gguf

    model_type, overrides = CASES["qwen3moe"]
    directory = make_tiny_model(tmp_path / "hf", model_type, demo_tokenizer_dir, **overrides)
    metadata = {k: v for k, v in read_gguf(demo_gguf).metadata.items() if k.startswith("tokenizer.")}
    path = tmp_path / "tiny-qwen3moe.gguf"
    original = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    write_gguf(path, original, "qwen3moe", metadata, gguf.GGMLQuantizationType.Q4_0)
    loaded = load_model(str(path), Placement(CUDA, torch.bfloat16), runtime="torch")
    experts = [m for m in loaded.model.modules() if getattr(m, "quantized_experts", None) == "int4"]
    assert len(experts) == original.config.num_hidden_layers
    assert not any(hasattr(m, "gate_up_proj") or hasattr(m, "down_proj") for m in experts)
    from_file = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    ids = torch.tensor([loaded.tokenizer(PROMPTS[1])["input_ids"]])
    with torch.inference_mode():
        ours, theirs = loaded.model(ids.to(CUDA)).logits[0, -1].float().cpu(), from_file(ids).logits[0, -1]
    print(f"Q4_0 experts: max |logit error| {(ours - theirs).abs().max():.4g}, max |logit| {theirs.abs().max():.4g}")
    assert (ours - theirs).abs().max() <= 0.02 * theirs.abs().max()


@pytest.mark.parametrize("tokens", [1, 7, 64, 600])
@pytest.mark.parametrize(("mode", "bound"), [("float", 2e-2), ("int8", 5e-2), ("int4", 0.3)])
@pytest.mark.parametrize(
    ("model_type", "shape"),
    [
        (
            "qwen3_moe",
            {"hidden_size": 2048, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768},
        ),
        (
            "gpt_oss",
            {"hidden_size": 2880, "num_local_experts": 32, "num_experts_per_tok": 4, "intermediate_size": 2880},
        ),
    ],
    ids=["qwen3-30b-a3b", "gpt-oss-20b"],
)
def test_fused_experts_at_real_widths(model_type: str, shape: dict, mode: str, bound: float, tokens: int) -> None:
    """One experts module at the real model's widths in bfloat16 (its weights, or int8 / int4 codes of them) against
    transformers' eager experts loop in float32 over the float weights: 1 token (a decode step), 7, 64 and 600 (a
    prompt chunk: blocks of more rows). tests/kernels/test_cuda_kernels_interpreted.py holds the codes' products
    exact."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rbee_worker.kernels.cuda_experts import quantize_experts, use_fused_experts

    config = AutoConfig.for_model(model_type, num_hidden_layers=1, vocab_size=16, **shape)
    torch.manual_seed(0)
    with torch.device(CUDA):
        model = AutoModelForCausalLM.from_config(config)
    model.set_experts_implementation("eager")
    experts = next(m for m in model.modules() if hasattr(m, "gate_up_proj"))
    for parameter in experts.parameters():
        torch.nn.init.normal_(parameter, std=0.02)
    count, routed = experts.gate_up_proj.shape[0], config.num_experts_per_tok
    x = torch.randn(tokens, config.hidden_size, device=CUDA)
    index = torch.stack([torch.randperm(count, device=CUDA)[:routed] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, routed, device=CUDA), dim=-1)
    with torch.inference_mode():
        expected = experts(x, index, weights)
        model.to(torch.bfloat16)
        assert (use_fused_experts(model) if mode == "float" else quantize_experts(model, mode)) == 1
        got = experts(x.to(torch.bfloat16), index, weights.to(torch.bfloat16)).float()
    error = ((got - expected).abs().max() / expected.abs().max()).item()
    print(f"{model_type} {mode} {tokens} tokens: max error / max |output| {error:.3g}")
    assert error < bound
