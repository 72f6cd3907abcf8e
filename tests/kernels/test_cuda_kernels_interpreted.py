"""The CUDA Triton kernels run by Triton's interpreter on the CPU, so that CI, which has no GPU, checks their logic.
The int4 kernels (kernels/cuda_weight_only.py): the packing, the masks of partial tiles, the split-K sums and their
order, and each of the three paths of `int4_matmul`. The paged decode attention (kernels/decode_attention.py): the
gather through block tables, each program's chunk of its row's length, empty chunks and padding rows, and the merge
(or, with one split, the output written by the split kernel itself). The KV write (kernels/kv_write.py): each new
token's keys and values at its position in the pools, from transformers' strided layout. The fused experts
(kernels/cuda_experts.py): the sort of (token, expert) pairs into blocks of one expert (every pair once, in order,
sentinels in the padding, no block past the used ones), and the experts' output against transformers' own loop for
Qwen3-MoE (SiLU, [E, out, in] weights) and gpt-oss (biases, clamped SwiGLU over interleaved columns, transposed
weights). tests/engine/test_cuda.py checks
the same kernels compiled, on a GPU.

The interpreter is chosen when Triton is imported, so the checks run in a child process. Its `tl.dot` on bfloat16
multiplies the raw bits, so the rows that take a `tl.dot` kernel use float32 (or float16) inputs here."""

import os
import subprocess
import sys
import textwrap

import pytest

CHECKS = textwrap.dedent(
    """
    import torch
    import triton
    from rbee_worker.kernels import cuda_weight_only
    from rbee_worker.kernels.cuda_weight_only import INT4_DOT_ROWS, int4_dequantize, int4_matmul, pack_int4

    # The interpreter cannot time configs: one tile per row class (split-K in 4 for the few-row one).
    cuda_weight_only._int4_dot.configs = [
        triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 4}),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 1}),
    ]
    torch.manual_seed(0)
    inputs = 576  # 18 groups: not whole GEMV programs (16 groups) or tl.dot k-blocks (64 or 128 inputs)
    for outputs in (200, 384):  # 200: not a whole number of output tiles
        codes = torch.randint(0, 16, (outputs, inputs), dtype=torch.int32)
        scales = torch.rand(inputs // 32, outputs) * 0.01 + 1e-3
        zeros = torch.randn(inputs // 32, outputs) * 0.01
        pairs = torch.stack([scales, zeros], dim=-1).to(torch.bfloat16).contiguous()
        weight = (codes - 8) * pairs[..., 0].T.float().repeat_interleave(32, 1) + pairs[
            ..., 1
        ].T.float().repeat_interleave(32, 1)
        words = pack_int4(codes)
        assert words.shape == (inputs // 8, outputs) and words.dtype == torch.int32
        # code j of word w is input 8w + j, 4 bits each from the low end
        assert ((words[3, 7] >> 8) & 15).item() == codes[7, 26].item()
        halves = torch.cat([pack_int4(codes[:96]), pack_int4(codes[96:])], dim=1)
        assert torch.equal(halves, words), "stacking layers concatenates their words along the outputs"
        torch.testing.assert_close(int4_dequantize(words, pairs, torch.float32), weight, rtol=1e-6, atol=1e-7)
        cases = ((1, torch.bfloat16, 2**-6), (5, torch.float32, 1e-5), (INT4_DOT_ROWS, torch.float32, 1e-5),
                 (INT4_DOT_ROWS + 3, torch.float32, 1e-5))
        for rows, dtype, tolerance in cases:
            x = torch.randn(rows, inputs).to(dtype)
            expected = x.float() @ weight.T
            got = int4_matmul(x, words, pairs)
            assert got.dtype == dtype and got.shape == (rows, outputs)
            error = (got.float() - expected).abs().max() / expected.abs().max()
            assert error <= tolerance, (outputs, rows, error.item())
            assert torch.equal(int4_matmul(x, words, pairs), got), "split-K sums in a fixed order"
    print("ok")
    """
)


DECODE_CHECKS = textwrap.dedent(
    """
    import torch
    from rbee_worker.kernels import decode_attention
    from rbee_worker.kernels.decode_attention import MAX_SPLITS, paged_decode_attention, splits_for

    # splits_for: about two programs per multiprocessor (132 here), from the rows and key/value heads alone.
    decode_attention._multiprocessors = lambda device: 132
    cuda = torch.device("cuda", 0)
    shapes = ((1, 8), (3, 8), (33, 8), (64, 8), (1, 1), (512, 32))
    assert [splits_for(rows, kv_heads, cuda) for rows, kv_heads in shapes] == [33, 11, 1, 1, MAX_SPLITS, 1]


    def reference(query, key_cache, value_cache, tables, lengths, scale, window=None, softcap=None, sinks=None):
        # float32 softmax attention over each row's positions (its last `window` of them), gathered through its block
        # table; soft-capped scores and each head's sink logit in the softmax, as transformers' eager functions do
        rows, heads, _, head_dim = query.shape
        block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
        out = torch.zeros(rows, 1, heads, head_dim)
        for r, length in enumerate(lengths.tolist()):
            if length == 0:
                continue
            p = torch.arange(max(length - window, 0) if window else 0, length)
            blocks = tables[r, p // block_size].long()
            key = key_cache[blocks, p % block_size].float().repeat_interleave(heads // kv_heads, 1)
            value = value_cache[blocks, p % block_size].float().repeat_interleave(heads // kv_heads, 1)
            scores = torch.einsum("hd,phd->hp", query[r, :, 0].float(), key) * scale
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            if sinks is not None:
                scores = torch.cat([scores, sinks.float()[:, None]], 1)
            out[r, 0] = torch.einsum("hp,phd->hd", scores.softmax(-1)[:, : len(p)], value)
        return out


    torch.manual_seed(0)
    # 1, 17: fewer steps than splits; 64, 65: one step whole, then one position more; 0: a padding row
    lengths = torch.tensor([1, 17, 64, 65, 300, 0], dtype=torch.int32)
    rows, head_dim, scale = len(lengths), 64, 64**-0.5
    cases = ((8, 2, 16, torch.float32), (4, 4, 32, torch.float32), (8, 2, 1, torch.float32),
             (8, 2, 16, torch.float16))
    for heads, kv_heads, block_size, dtype in cases:
        max_blocks = -(-300 // block_size) + 2
        num_blocks = rows * max_blocks + 5
        # key and value interleaved in one pool: each cache is a view whose block stride is not its own block's size
        pool = torch.randn(num_blocks, 2, block_size, kv_heads, head_dim).to(dtype)
        key_cache, value_cache = pool[:, 0], pool[:, 1]
        # each row's blocks scattered through the pool; the entries past a row's length point far outside it, so a
        # read through one crashes the child
        tables = torch.full((rows, max_blocks), 10**6, dtype=torch.int32)
        order = torch.randperm(num_blocks).to(torch.int32)
        for r, length in enumerate(lengths.tolist()):
            used = -(-length // block_size)
            tables[r, :used], order = order[:used], order[used:]
        query = torch.randn(rows, 1, heads, head_dim).to(dtype).transpose(1, 2)  # as transformers passes it
        tolerance = 1e-5 if dtype == torch.float32 else 2e-3
        # plain; a window shorter than most rows (17 of 65 and 300: their first blocks are never read); soft-capped
        # scores with a sink logit per head (of both signs), the sinks in the merge (splits > 1) and in one split
        sinks = torch.linspace(-2.0, 3.0, heads).to(dtype)
        for extras in ({}, {"window": 17}, {"softcap": 0.5, "sinks": sinks}, {"window": 64, "sinks": sinks}):
            expected = reference(query, key_cache, value_cache, tables, lengths, scale, **extras)
            for splits in (1, 3, 8):
                got = paged_decode_attention(query, key_cache, value_cache, tables, lengths, scale, splits, **extras)
                assert got.shape == (rows, 1, heads, head_dim) and got.dtype == dtype
                assert torch.equal(got[-1], torch.zeros_like(got[-1])), "a padding row gives zeros"
                case = (heads, kv_heads, block_size, dtype, splits, sorted(extras))
                torch.testing.assert_close(
                    got.float(), expected, rtol=tolerance, atol=tolerance, msg=lambda m, case=case: f"{case}: {m}"
                )
    print("ok")
    """
)

KV_WRITE_CHECKS = textwrap.dedent(
    """
    import torch
    from rbee_worker.kernels.kv_write import write_kv

    torch.manual_seed(0)
    for rows, q_len, heads, head_dim in ((3, 1, 8, 64), (2, 5, 3, 16)):  # decode rows; prompt chunks, 3 heads (padded)
        pool_k = torch.zeros(40, heads, head_dim, dtype=torch.bfloat16)
        pool_v = torch.zeros(40, heads, head_dim, dtype=torch.bfloat16)
        # transformers' layout: the projection's [rows, q_len, heads, head_dim] transposed, not contiguous
        keys = torch.randn(rows, q_len, heads, head_dim).to(torch.bfloat16).transpose(1, 2)
        values = torch.randn(rows, q_len, heads, head_dim).to(torch.bfloat16).transpose(1, 2)
        slots = torch.randperm(40)[: rows * q_len]
        write_kv(keys, values, pool_k, pool_v, slots)
        expected_k, expected_v = torch.zeros_like(pool_k), torch.zeros_like(pool_v)
        expected_k[slots] = keys.transpose(1, 2).reshape(-1, heads, head_dim)
        expected_v[slots] = values.transpose(1, 2).reshape(-1, heads, head_dim)
        assert torch.equal(pool_k, expected_k) and torch.equal(pool_v, expected_v), (rows, q_len, heads)
    print("ok")
    """
)

EXPERTS_CHECKS = textwrap.dedent(
    """
    import copy as copy_module

    import torch
    import triton
    from transformers import AutoConfig, AutoModelForCausalLM
    from rbee_worker.kernels import cuda_experts
    from rbee_worker.kernels.cuda_experts import align, quantize_experts, use_fused_experts

    tile = triton.Config({"BLOCK_N": 32, "BLOCK_K": 32})  # the interpreter cannot time configs: one
    cuda_experts._experts_up.configs = cuda_experts._experts_down.configs = [tile]
    torch.manual_seed(0)
    for pairs, experts, rows in ((8, 128, 16), (6, 8, 16), (300, 8, 32), (1000, 64, 16)):
        ids = torch.randint(0, experts, (pairs,), dtype=torch.int32)
        sorted_pairs, block_expert = align(ids, experts, rows)
        assert sorted(sorted_pairs[sorted_pairs < pairs].tolist()) == list(range(pairs)), "every pair once"
        assert ((sorted_pairs == pairs) | (sorted_pairs < pairs)).all()
        used = (block_expert >= 0).sum().item()
        assert (block_expert[used:] == -1).all() and (sorted_pairs[used * rows :] == pairs).all()
        assert block_expert[:used].diff().ge(0).all(), "blocks in expert order"
        for block in range(used):
            members = sorted_pairs[block * rows : (block + 1) * rows]
            members = members[members < pairs]
            assert len(members) and (ids[members.long()] == block_expert[block]).all(), "one expert a block"
            assert torch.equal(members, members.sort().values), "each expert's pairs in order"
        assert used == sum(-(-c // rows) for c in torch.bincount(ids, minlength=experts).tolist() if c)
    def dequantized(module, name, mode):
        # The weights the codes stand for, [E, out, in], decoded here independently of the kernels.
        codes, scales = getattr(module, name + "_codes"), getattr(module, name + "_scales")
        if mode == "int8":
            return codes.float() * scales.float()[..., None]
        experts, words, outputs = codes.shape  # code j of word w: input 8w + j, bits 4j .. 4j + 3
        q = (codes[:, :, None, :] >> (4 * torch.arange(8))[None, None, :, None]) & 15
        pairs = scales.view(torch.bfloat16).float().reshape(experts, words // 4, outputs, 2)
        scale, zero = (pairs[..., i].repeat_interleave(32, dim=1) for i in (0, 1))
        return ((q.reshape(experts, words * 8, outputs) - 8) * scale + zero).transpose(1, 2)

    def transformers_layout(module, weight, gate_up):
        # [E, out, in] with all gates then all ups -> the module's own layout (gpt-oss: interleaved, transposed).
        if gate_up and not module.is_concatenated:
            weight = torch.stack(weight.chunk(2, dim=1), dim=2).flatten(1, 2)
        return weight.transpose(1, 2) if module.is_transposed and weight.dim() == 3 else weight

    def eager_over_codes(module, mode, case):
        # transformers' own experts loop over the weights that the module's codes stand for.
        copy = copy_module.deepcopy(module)
        for name in ("gate_up_proj", "down_proj"):
            weight = transformers_layout(module, dequantized(module, name, mode), name == "gate_up_proj")
            setattr(copy, name, torch.nn.Parameter(weight))
        if module.has_bias:
            copy.gate_up_proj_bias = torch.nn.Parameter(transformers_layout(module, module.gate_up_proj_bias, True))
        return type(module).forward.__wrapped__(copy, *case)

    shapes = {
        "qwen3_moe": {"num_experts": 8, "moe_intermediate_size": 64},
        "gpt_oss": {"num_local_experts": 8, "intermediate_size": 64},
    }
    # float: transformers' arithmetic (to float32 rounding) over the weights; int8 / int4: the same over what the
    # codes stand for, and within the codes' rounding of the float weights' result
    for mode, rounding in (("float", 1e-5), ("int8", 0.03), ("int4", 0.3)):
        for model_type, shape in shapes.items():
            config = AutoConfig.for_model(
                model_type, hidden_size=64, num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=16, **shape
            )
            model = AutoModelForCausalLM.from_config(config)
            module = next(m for m in model.modules() if hasattr(m, "gate_up_proj"))
            for parameter in module.parameters():
                torch.nn.init.normal_(parameter, std=0.3)
            model.set_experts_implementation("eager")
            torch.manual_seed(1)
            cases = []
            for tokens in (1, 3, 40):
                index = torch.stack([torch.randperm(8)[:2] for _ in range(tokens)])
                cases.append((torch.randn(tokens, 64), index, torch.rand(tokens, 2)))
            with torch.no_grad():
                expected = [module(*case) for case in cases]
                installed = use_fused_experts(model) if mode == "float" else quantize_experts(model, mode)
                assert installed == 1 and module.fused_activation == (1 if model_type == "gpt_oss" else 0)
                assert mode == "float" or not hasattr(module, "gate_up_proj")
                got = [module(*case) for case in cases]
                exact = expected if mode == "float" else [eager_over_codes(module, mode, case) for case in cases]
            for (x, _, _), want, codes_want, have in zip(cases, expected, exact, got):
                error = ((have - codes_want).abs().max() / codes_want.abs().max()).item()
                rounded = ((have - want).abs().max() / want.abs().max()).item()
                print(mode, model_type, len(x), f"{error:.2e} {rounded:.2e}")
                assert error < 1e-5 and rounded < rounding, (mode, model_type, len(x), error, rounded)
    print("ok")
    """
)


def run_interpreted(checks: str) -> None:
    """Run `checks` in a child process with Triton's interpreter; it must print "ok"."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", checks], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), (done.returncode, done.stderr[-3000:])


def test_int4_kernels_in_the_triton_interpreter() -> None:
    run_interpreted(CHECKS)


def test_paged_decode_attention_in_the_triton_interpreter() -> None:
    run_interpreted(DECODE_CHECKS)


def test_kv_write_in_the_triton_interpreter() -> None:
    run_interpreted(KV_WRITE_CHECKS)


def test_fused_experts_in_the_triton_interpreter() -> None:
    run_interpreted(EXPERTS_CHECKS)
