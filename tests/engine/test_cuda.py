"""CUDA parity on a random-weight Llama (fixed seed, demo tokenizer). Skipped where there is no CUDA GPU (CI)."""

import functools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import assert_launched_ahead_as_waiting, greedy, is_compiled, make_tiny_model, submit_together
from test_architectures import CASES, SPREAD

from rbee_worker.engine.engine import Engine
from rbee_worker.engine.engine_config import EngineConfig
from rbee_worker.engine.request_types import Request, Token
from rbee_worker.engine.runners.protocol import PromptRow
from rbee_worker.engine.sampling.sampling_params import SamplingParams
from rbee_worker.hardware.devices import Placement
from rbee_worker.layers.int4_linear import Int4Linear
from rbee_worker.layers.int8_linear import Int8Linear
from rbee_worker.layers.merged_linear import stack
from rbee_worker.loading.loaded import LoadedModel
from rbee_worker.loading.loader import load_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
if torch.cuda.is_available():
    from rbee_worker.kernels.decode_attention import paged_decode_attention, splits_for

PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village by the sea,"]
# Two logits closer than this may swap places between two summation orders: 2 bfloat16 steps of a logit below 8.
NEAR_TIE = 2**-3
CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


@pytest.fixture(scope="module")
def random_llama(tmp_path_factory: pytest.TempPathFactory, demo_tokenizer_dir: Path) -> Path:
    # Larger init than the default 0.02 so logits are peaked: greedy then depends on the weights, not on ties.
    return make_tiny_model(
        tmp_path_factory.mktemp("llama") / "model",
        "llama",
        demo_tokenizer_dir,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        initializer_range=0.1,
    )


def one_after_another(load: Callable[[], LoadedModel], configs: list[EngineConfig]) -> list[Engine]:
    """Engines started in turn, each loaded before the next starts: a CUDA graph capture (while an engine loads)
    fails on another thread's CUDA work."""
    engines = []
    for config in configs:
        engines.append(Engine(load, config))
        engines[-1].loaded  # noqa: B018 -- waits for the load
    return engines


def last_logits(loaded, prompt: str) -> torch.Tensor:
    ids = torch.tensor([loaded.tokenizer(prompt)["input_ids"]], device=loaded.info.device)
    with torch.inference_mode():
        return loaded.model(ids).logits[0, -1].float().cpu()


def test_cuda_fp32_greedy_equals_cpu_fp32(random_llama: Path) -> None:
    engines = [
        Engine(functools.partial(load_model, str(random_llama), Placement(d, torch.float32))) for d in (CPU, CUDA)
    ]
    try:
        for prompt in PROMPTS:
            ids = engines[0].model.tokenize(prompt)
            assert greedy(engines[1], ids, 64)[0] == greedy(engines[0], ids, 64)[0]
    finally:
        for engine in engines:
            engine.close()


def test_cuda_bf16_logits_are_as_close_to_fp32_as_cpu_bf16(random_llama: Path) -> None:
    """bf16 keeps 8 significant bits, so both devices' bf16 logits differ from fp32; CUDA must not be worse than
    the CPU's own bf16 rounding error by more than a factor of 2 (different kernels round in different places)."""
    reference = load_model(str(random_llama), Placement(CPU, torch.float32))
    cpu_bf16 = load_model(str(random_llama), Placement(CPU, torch.bfloat16))
    cuda_bf16 = load_model(str(random_llama), Placement(CUDA, torch.bfloat16))
    for prompt in PROMPTS:
        expected = last_logits(reference, prompt)
        cpu_error = (last_logits(cpu_bf16, prompt) - expected).abs().max().item()
        cuda_error = (last_logits(cuda_bf16, prompt) - expected).abs().max().item()
        scale = expected.abs().max().item()
        print(f"bf16 max |logit error| vs fp32: cuda {cuda_error:.4g}, cpu {cpu_error:.4g}, max |logit| {scale:.4g}")
        assert cuda_error <= 2 * cpu_error + 1e-3 * scale, (prompt, cuda_error, cpu_error, scale)


def test_model_lands_on_the_gpu_and_memory_is_measured(random_llama: Path) -> None:
    loaded = load_model(str(random_llama), Placement(CUDA, torch.bfloat16))
    assert all(p.device.type == "cuda" for p in loaded.model.parameters())
    engine = Engine(lambda: loaded)
    try:
        assert engine.memory_bytes() >= loaded.info.weight_bytes > 0
    finally:
        engine.close()


@pytest.mark.parametrize("compile_model", [True, False], ids=["compiled", "eager"])
def test_cuda_graphs_decode_as_the_eager_forward(random_llama: Path, compile_model: bool) -> None:
    """Concurrent greedy requests (one batched decode step for all) give the same tokens whether each step replays a
    captured CUDA graph (of the torch.compile'd forward, or of the plain one) or runs the forward eagerly; fp32 with
    peaked logits, so rounding cannot flip a choice."""
    results = []
    for graphs in (True, False):
        engine = Engine(
            functools.partial(load_model, str(random_llama), Placement(CUDA, torch.float32)),
            EngineConfig(cuda_graphs=graphs, compile_model=compile_model),
        )
        try:
            greedy_requests = [
                Request(engine.model.tokenize(p), max_tokens=48, sampling=SamplingParams(temperature=0))
                for p in PROMPTS
            ]
            results.append(submit_together(engine, greedy_requests, timeout=300))
            # The path under test really ran.
            assert (engine._runner.graphs is not None) is graphs
            assert is_compiled(engine._runner.model) is compile_model
        finally:
            engine.close()
    assert results[0] == results[1]


def test_compiled_engine_compiles_nothing_after_ready(random_llama: Path) -> None:
    """The compiled forward is compiled for every class of shapes before ready: prompts whose lengths are not
    multiples of 8, several at once (one eager forward) and one past its first chunk (eager, after the chunk's
    graph), then decoding, run without a compilation (inductor guards on sizes being multiples of 8: batched
    17-token prompts recompiled for seconds in an 8B bench)."""
    engine = Engine(
        functools.partial(load_model, str(random_llama), Placement(CUDA, torch.bfloat16)),
        EngineConfig(max_batch=4, prefill_chunk=32, compile_model=True),
    )
    try:
        assert is_compiled(engine.loaded.model)
        torch.compiler.set_stance("fail_on_recompile")
        greedy_params = SamplingParams(temperature=0)
        together = [Request(tuple(range(100, 100 + n)), max_tokens=8, sampling=greedy_params) for n in (17, 9, 13)]
        alone = [Request(tuple(range(200, 245)), max_tokens=8, sampling=greedy_params)]
        for requests in (together, alone):
            assert all(len(ids) == 8 for ids in submit_together(engine, requests, timeout=300))
    finally:
        torch.compiler.set_stance("default")
        engine.close()


def test_every_sampling_mode_runs_on_graphs_and_kernels_made_before_ready(
    random_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After ready, the first request of every sampling mode (greedy, sampled, top-k, penalties greedy and sampled,
    logprobs greedy and sampled, seeded), alone and eight at once, captures no CUDA graph and compiles no Triton
    kernel: start-up made them all."""
    from triton.runtime.jit import JITFunction

    engine = Engine(
        functools.partial(load_model, str(random_llama), Placement(CUDA, torch.bfloat16)),
        EngineConfig(max_batch=8, kv_cache_bytes=8 << 20),
    )
    try:
        graphs = engine.loaded and engine._runner.graphs
        captured = set(graphs.graphs)
        compiled: list[str] = []
        do_compile = JITFunction._do_compile

        def counting(self: JITFunction, *args: object, **kwargs: object) -> object:
            compiled.append(self.fn.__name__)
            return do_compile(self, *args, **kwargs)

        monkeypatch.setattr(JITFunction, "_do_compile", counting)
        modes = [
            (SamplingParams(temperature=0), None),
            (SamplingParams(temperature=0.7, top_p=0.9), None),
            (SamplingParams(temperature=0.7, top_p=0.9, top_k=50), None),
            (SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.1), None),
            (SamplingParams(temperature=0, repetition_penalty=1.1), None),
            (SamplingParams(temperature=0.7, top_p=0.9), 5),
            (SamplingParams(temperature=0), 5),
            (SamplingParams(temperature=0.7, min_p=0.1, presence_penalty=0.5), 2),
        ]
        for sampling, logprobs in modes:
            ids = tuple(range(100, 117))
            request = functools.partial(Request, max_tokens=40, sampling=sampling, logprobs=logprobs, ignore_eos=True)
            alone = [request(ids, seed=1)]
            together = [request(ids[: 9 + i]) for i in range(8)]
            for requests in (alone, together):
                assert all(len(tokens) == 40 for tokens in submit_together(engine, requests, timeout=300))
        assert set(graphs.graphs) == captured and compiled == []
    finally:
        engine.close()


def test_decode_steps_launched_ahead_give_the_tokens_of_waiting_for_each(random_llama: Path) -> None:
    """With CUDA graphs, a greedy step is launched before the host reads the previous one, its tokens chained on the
    GPU: every kind of request gets the tokens of an engine that waits for every step (no graphs); fp32 with peaked
    logits, so rounding cannot flip a choice."""
    load = functools.partial(load_model, str(random_llama), Placement(CUDA, torch.float32))
    engines = one_after_another(load, [EngineConfig(cuda_graphs=False), EngineConfig(cuda_graphs=True)])
    try:
        assert_launched_ahead_as_waiting(waiting=engines[0], ahead=engines[1], prompts=PROMPTS)
    finally:
        for engine in engines:
            engine.close()


def test_first_prompt_chunks_replay_as_graphs_with_the_eager_logits(random_llama: Path) -> None:
    """A request's first prompt chunk runs as a prefill graph (right-padded to its bucket) and gives the logits of the
    eager forward over the same tokens (fp32), for lengths at, below and above a bucket's edge; a prompt longer than
    a chunk (its second chunk eager, after the graph's) decodes the same tokens as an engine without graphs."""
    load = functools.partial(load_model, str(random_llama), Placement(CUDA, torch.float32))
    # The model's context is 512: room for two chunks.
    engines = one_after_another(load, [EngineConfig(cuda_graphs=g, prefill_chunk=256) for g in (True, False)])
    try:
        graphs = engines[0]._runner.prefill_graphs
        assert graphs is not None and engines[1]._runner.prefill_graphs is None
        with torch.inference_mode():
            for count in (1, 15, 16, 17, 100, 256):
                ids = [(7 * i + 3) % 1000 + 10 for i in range(count)]
                blocks = list(range(1, 2 + count // 16))  # batch row 2's blocks
                replayed = engines[0]._runner._prompt_forward([PromptRow(2, blocks, ids, 0, False)]).clone()
                eager = engines[1]._runner._prompt_forward([PromptRow(2, blocks, ids, 0, False)])
                torch.testing.assert_close(replayed, eager, atol=1e-4, rtol=1e-4)
        assert sorted(graphs.graphs) == graphs.buckets  # warmed up before ready: no capture while serving
        long_prompt = [(5 * i + 1) % 1000 + 10 for i in range(400)]
        assert greedy(engines[0], long_prompt, 24)[0] == greedy(engines[1], long_prompt, 24)[0]
    finally:
        for engine in engines:
            engine.close()


def test_prefill_graph_buckets_fit_a_short_context(random_llama: Path) -> None:
    """With a KV pool of 13 blocks of 16 (a context of 208 tokens) the chunk buckets stop at 128 (a 256 bucket could
    not be read back): a 150-token prompt runs eagerly, a 100-token one as a graph, and both decode as an engine
    without graphs."""
    per_token = 2 * 4 * 2 * 32 * 4  # keys and values, 4 layers, 2 key/value heads of 32, float32
    load = functools.partial(load_model, str(random_llama), Placement(CUDA, torch.float32))
    pool = (13 + 1) * 16 * per_token  # + 1: the scratch block
    engines = one_after_another(
        load, [EngineConfig(cuda_graphs=g, max_batch=1, kv_cache_bytes=pool) for g in (True, False)]
    )
    try:
        assert engines[0].model.context_length == 208
        assert engines[0]._runner.prefill_graphs.buckets == [16, 32, 64, 128]
        for count in (150, 100):
            ids = [(3 * i + 2) % 1000 + 10 for i in range(count)]
            assert greedy(engines[0], ids, 16)[0] == greedy(engines[1], ids, 16)[0]
    finally:
        for engine in engines:
            engine.close()


@pytest.mark.parametrize("out", [384, 200])  # 200: not a whole number of any kernel's output tiles
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
def test_quantized_layers_on_cuda_compute_their_weights(rows: int, out: int) -> None:
    """Int4Linear and Int8Linear (our Triton kernels: one row takes the GEMV kernel, more the tensor-core one, and
    int4 beyond INT4_DOT_ROWS the dequantized weights with cuBLAS) on CUDA against float32 products with the
    weights they stand for, alone and stacked as merge_projections does; bfloat16 activations and output, so within
    a few bfloat16 steps of the largest output."""
    torch.manual_seed(0)
    inputs = 576  # the demo model's input width: 18 groups, not a whole number of the int4 kernels' k-blocks
    codes = torch.randint(0, 16, (out, inputs), dtype=torch.int32)
    scales, zeros = torch.rand(out, inputs // 32) * 0.01 + 1e-3, torch.randn(out, inputs // 32) * 0.01
    int4 = Int4Linear(codes.to(CUDA), scales.to(CUDA), zeros.to(CUDA), None)
    int4_weight = (codes - 8) * scales.repeat_interleave(32, 1) + zeros.repeat_interleave(32, 1)
    codes8 = torch.randint(-127, 128, (out, inputs), dtype=torch.int8)
    scales8 = torch.rand(out) * 1e-3
    int8 = Int8Linear(codes8.to(CUDA), scales8.to(CUDA), None)
    x = torch.randn(rows, inputs, dtype=torch.bfloat16)
    for layer, weight in ((int4, int4_weight), (int8, codes8.float() * scales8[:, None])):
        expected = x.float() @ weight.T
        got = layer(x.to(CUDA)).float().cpu()
        assert (got - expected).abs().max() <= 2**-6 * expected.abs().max(), type(layer).__name__
        both = stack([layer, layer])(x.to(CUDA)).float().cpu()
        assert (both - torch.cat([expected, expected], dim=-1)).abs().max() <= 2**-6 * expected.abs().max()


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_model_decodes_with_graphs_as_eagerly(random_llama: Path, mode: str) -> None:
    """A model directory quantized at load on CUDA: its layers and LM head really are quantized, and greedy requests
    give the same tokens with CUDA graphs as with the eager forward (one at a time), or part at a near-tie: bfloat16
    products of a different row count (a prompt padded to its graph's bucket) may round differently, so where the two
    first differ the eager forward's two most likely tokens must be those two, within NEAR_TIE of each other."""
    results: list[list[list[int]]] = []
    for graphs in (True, False):
        engine = Engine(
            functools.partial(load_model, str(random_llama), Placement(CUDA, torch.bfloat16), quantize=mode),
            EngineConfig(cuda_graphs=graphs),
        )
        try:
            model = engine.loaded.model
            layers = [m for m in model.modules() if isinstance(m, (Int4Linear, Int8Linear))]
            # 4 layers of q/k/v merged, o, gate/up merged, down (merged_linear.py), and the untied LM head in int8
            assert len(layers) == 4 * 4 + 1 and all(b.is_cuda for m in layers for b in m.buffers())
            assert type(model.lm_head) is Int8Linear
            prompts = [engine.model.tokenize(p) for p in PROMPTS]
            results.append([greedy(engine, ids, 32)[0] for ids in prompts])
            if graphs:
                continue
            agree_but_near_ties(engine, prompts, *results, mode)
        finally:
            engine.close()


def agree_but_near_ties(
    engine: Engine, prompts: list, with_graphs: list[list[int]], eager: list[list[int]], label: str
) -> None:
    """Each prompt's tokens with graphs equal the eager `engine`'s, or where they first differ, the eager engine's two
    most likely tokens are those two, within NEAR_TIE of each other."""
    for ids, graphed, plain in zip(prompts, with_graphs, eager, strict=True):
        if graphed != plain:
            at = next(i for i, (a, b) in enumerate(zip(graphed, plain, strict=True)) if a != b)
            (first, best), (second, runner_up) = top_two(engine, (*ids, *plain[:at]))
            print(f"{label}: first difference at token {at}, logprobs {best:.4f} / {runner_up:.4f}")
            assert {first, second} == {graphed[at], plain[at]} and best - runner_up <= NEAR_TIE


def top_two(engine: Engine, prompt_ids: tuple[int, ...]) -> tuple[tuple[int, float], ...]:
    """The two most likely next tokens after prompt_ids and their logprobs, by one greedy request."""
    request = Request(prompt_ids, max_tokens=1, sampling=SamplingParams(temperature=0), logprobs=2)
    token = next(e for e in engine.stream(request) if isinstance(e, Token))
    return token.logprobs[0].top


@pytest.mark.parametrize(
    ("rows", "heads", "kv_heads", "head_dim", "span", "block_size"),
    [(1, 32, 8, 128, 1024, 16), (3, 4, 2, 64, 200, 16), (64, 8, 8, 128, 128, 16), (5, 9, 3, 64, 2048, 32),
     (4, 32, 8, 128, 4000, 16), (2, 8, 2, 256, 300, 1)],
)  # fmt: skip
def test_decode_attention_kernel_matches_sdpa(
    rows: int, heads: int, kv_heads: int, head_dim: int, span: int, block_size: int
) -> None:
    """The paged decode kernel, reading a pool of blocks through shuffled block tables (the key and value caches
    views into one pool), against float32 SDPA over each row's positions gathered through its table, with rows of
    every length from 1 to the span and a padding row of length 0 (zeros). Then one CUDA graph of it, replayed after
    new lengths are written into its inputs, gives what a direct call gives for them."""
    torch.manual_seed(0)
    max_blocks = -(-span // block_size)
    num_blocks = rows * max_blocks + 3
    pool = torch.randn(num_blocks, 2, block_size, kv_heads, head_dim, device=CUDA, dtype=torch.bfloat16)
    key_cache, value_cache = pool[:, 0], pool[:, 1]
    tables = torch.randperm(num_blocks, device=CUDA)[: rows * max_blocks].view(rows, max_blocks).to(torch.int32)
    query = torch.randn(rows, 1, heads, head_dim, device=CUDA, dtype=torch.bfloat16).transpose(1, 2)
    lengths = torch.randint(1, span + 1, (rows,), device=CUDA, dtype=torch.int32)
    lengths[0] = span
    lengths[-1] = 0 if rows > 1 else lengths[-1]
    scale, splits = head_dim**-0.5, splits_for(rows, kv_heads, CUDA)
    got = paged_decode_attention(query, key_cache, value_cache, tables, lengths, scale, splits)
    positions = torch.arange(span, device=CUDA)
    slots = tables[:, positions // block_size].long(), positions % block_size  # each row's span: [rows, span] each
    key, value = (
        cache[slots].transpose(1, 2).float().repeat_interleave(heads // kv_heads, 1) for cache in pool.unbind(1)
    )
    mask = torch.where(positions < lengths[:, None], 0.0, float("-inf"))[:, None, None, :]
    expected = torch.nn.functional.scaled_dot_product_attention(
        query.float(), key, value, attn_mask=mask, scale=scale
    ).transpose(1, 2)  # fmt: skip
    padding = lengths == 0
    expected[padding] = 0.0  # SDPA gives NaN where every position is masked
    assert got.shape == (rows, 1, heads, head_dim) and got.dtype == torch.bfloat16
    assert torch.equal(got[padding], torch.zeros_like(got[padding]))
    assert (got.float() - expected).abs().max() <= 2e-2 * expected.abs().max()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = paged_decode_attention(query, key_cache, value_cache, tables, lengths, scale, splits)
    lengths.copy_(torch.randint(0, span + 1, (rows,), device=CUDA, dtype=torch.int32))
    graph.replay()
    assert torch.equal(replayed, paged_decode_attention(query, key_cache, value_cache, tables, lengths, scale, splits))


@pytest.mark.parametrize("case", ["gemma3_text", "gemma2", "gpt_oss"])
def test_windows_in_bfloat16_decode_with_the_kernel_as_eagerly(
    case: str, tmp_path: Path, demo_tokenizer_dir: Path
) -> None:
    """In bfloat16 the decode graphs' sliding layers run the paged kernel (its window, Gemma 2's soft-capping,
    gpt-oss's sinks): greedy requests give the tokens of the engine without graphs (transformers' attention functions
    over gathered keys), or part at a near-tie, as in test_quantized_model_decodes_with_graphs_as_eagerly."""
    model_type, overrides = CASES[case]
    directory = make_tiny_model(tmp_path / case, model_type, demo_tokenizer_dir, **{**SPREAD, **overrides})
    results: list[list[list[int]]] = []
    for graphs in (True, False):
        config = EngineConfig(max_batch=4, kv_cache_bytes=64 << 20, cuda_graphs=graphs)
        engine = Engine(lambda: load_model(str(directory), Placement(CUDA, torch.bfloat16)), config)
        try:
            prompts = [engine.model.tokenize(p) for p in PROMPTS[1:]]
            results.append([greedy(engine, ids, 40)[0] for ids in prompts])
            if graphs:
                continue
            agree_but_near_ties(engine, prompts, *results, case)
        finally:
            engine.close()


@pytest.mark.parametrize(("window", "softcap", "sinks"), [(100, None, False), (1000, 30.0, False), (128, None, True)])
def test_decode_attention_kernel_window_softcap_and_sinks(window: int, softcap: float | None, sinks: bool) -> None:
    """The paged decode kernel's window, soft-capping and sinks against float32 attention computed as transformers'
    eager functions do (Gemma 2's tanh cap, gpt-oss's sink logit in the softmax), over rows of every length up to
    several windows, one split and many."""
    torch.manual_seed(0)
    rows, heads, kv_heads, head_dim, span, block_size = 6, 16, 4, 64, 2000, 16
    max_blocks = -(-span // block_size)
    num_blocks = rows * max_blocks + 3
    pool = torch.randn(num_blocks, 2, block_size, kv_heads, head_dim, device=CUDA, dtype=torch.bfloat16) * 2
    key_cache, value_cache = pool[:, 0], pool[:, 1]
    tables = torch.randperm(num_blocks, device=CUDA)[: rows * max_blocks].view(rows, max_blocks).to(torch.int32)
    query = torch.randn(rows, 1, heads, head_dim, device=CUDA, dtype=torch.bfloat16).transpose(1, 2)
    lengths = torch.tensor(
        [span, 1, window, window + 1, min(3 * window + 7, span - 1), 0], device=CUDA, dtype=torch.int32
    )
    sink_logits = torch.linspace(-3.0, 6.0, heads, device=CUDA).to(torch.bfloat16) if sinks else None
    scale = head_dim**-0.5
    positions = torch.arange(span, device=CUDA)
    slots = tables[:, positions // block_size].long(), positions % block_size
    key, value = (
        cache[slots].transpose(1, 2).float().repeat_interleave(heads // kv_heads, 1) for cache in pool.unbind(1)
    )
    scores = query.float() @ key.transpose(2, 3) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    visible = (positions < lengths[:, None]) & (positions >= lengths[:, None] - window)
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    if sinks:
        scores = torch.cat([scores, sink_logits.float()[None, :, None, None].expand(rows, -1, 1, 1)], -1)
    expected = (scores.softmax(-1)[..., :span] @ value).transpose(1, 2)
    expected[lengths == 0] = 0.0
    for splits in (1, splits_for(rows, kv_heads, CUDA)):
        got = paged_decode_attention(
            query, key_cache, value_cache, tables, lengths, scale, splits, window, softcap, sink_logits
        )
        assert torch.equal(got[-1], torch.zeros_like(got[-1])), "a padding row gives zeros"
        assert (got.float() - expected).abs().max() <= 2e-2 * expected.abs().max(), splits


def test_constrained_rows_on_cuda_graphs_give_the_tokens_of_an_engine_without_graphs(random_llama: Path) -> None:
    """Rows under a JSON schema's grammar beside free rows, greedy and sampled at temperature 1.0: the decode graphs
    (captured before ready, the grammar's token mask applied inside them) give the tokens of an engine without graphs,
    the constrained texts parse as JSON with the schema's keys, no graph is captured while serving, and steps still run
    ahead (chained rows) beside the constrained ones. fp32, peaked logits."""
    import json

    from rbee_worker.engine.structured.grammar import GrammarSpec

    person = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "pets": {"type": "array", "items": {"enum": ["cat", "dog", "bee"]}, "minItems": 1, "maxItems": 3},
        },
        "required": ["name", "age", "pets"],
    }
    load = functools.partial(load_model, str(random_llama), Placement(CUDA, torch.float32))
    engines = one_after_another(load, [EngineConfig(cuda_graphs=False), EngineConfig(cuda_graphs=True)])
    graphs = engines[1]._runner.graphs
    captured = set(graphs.graphs)
    chained: list[list[bool]] = []
    launch = graphs.launch
    graphs.launch = lambda rows, *rest: chained.append([r.chained for r in rows]) or launch(rows, *rest)
    outputs = []
    try:
        for engine in engines:
            grammar = engine.model.grammars.compile(GrammarSpec.json_schema(person)).result()
            prompt = engine.model.tokenize("Describe a person as JSON:")
            hot, cold = SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)
            requests = [
                Request(prompt, max_tokens=120, sampling=hot, seed=11, grammar=grammar),
                Request(prompt, max_tokens=60, sampling=cold),
                Request(prompt, max_tokens=60, sampling=hot, seed=12),
                Request(prompt, max_tokens=120, sampling=cold, grammar=grammar),
            ]
            outputs.append(submit_together(engine, requests, timeout=300))
        texts = [engines[1].model.detokenize(tuple(outputs[1][i])) for i in (0, 3)]
    finally:
        for engine in engines:
            engine.close()
    assert outputs[1] == outputs[0]
    for text in texts:  # complete JSON well before max_tokens: the grammar ended the request
        assert sorted(json.loads(text)) == ["age", "name", "pets"]
    assert set(graphs.graphs) == captured
    assert any(any(step) for step in chained)


@pytest.mark.parametrize("case", ["mistral", "qwen2", "gemma3_text", "gemma2"])
def test_sliding_windows_on_cuda_graphs_give_the_cpu_float32_tokens(
    case: str, tmp_path: Path, demo_tokenizer_dir: Path
) -> None:
    """Sliding layers on CUDA (decode steps in CUDA graphs, each window read through the paged reference, or gathered
    for the model's own eager function: Gemma 2's soft-capping) give the tokens of the CPU's float32 engine, which
    tests/engine/test_architectures.py holds to transformers' `generate`: alone, and four requests at once. (gpt-oss,
    whose experts run the fused kernels on CUDA, is in tests/kernels/test_cuda_experts.py's same comparison.)"""
    model_type, overrides = CASES[case]
    directory = make_tiny_model(tmp_path / case, model_type, demo_tokenizer_dir, **{**SPREAD, **overrides})
    config = EngineConfig(max_batch=4, kv_cache_bytes=64 << 20)
    engines = [Engine(lambda d=d: load_model(str(directory), Placement(d, torch.float32)), config) for d in (CPU, CUDA)]
    try:
        prompts = [engines[0].model.tokenize(p) for p in PROMPTS[1:]]
        expected = [greedy(engines[0], ids, 40)[0] for ids in prompts]
        assert [greedy(engines[1], ids, 40)[0] for ids in prompts] == expected
        requests = [Request(ids, max_tokens=40, sampling=SamplingParams(temperature=0)) for ids in prompts * 2]
        assert submit_together(engines[1], requests) == expected * 2
    finally:
        for engine in engines:
            engine.close()
