"""The CUDA int4 kernels (models/cuda_weight_only.py) run by Triton's interpreter on the CPU, so that CI, which has no
GPU, checks their logic: the packing, the masks of partial tiles, the split-K sums and their order, and each of the
three paths of `int4_matmul`. tests/test_cuda.py checks the same kernels compiled, on a GPU.

The interpreter is chosen when Triton is imported, so the checks run in a child process. Its `tl.dot` on bfloat16
multiplies the raw bits, so the rows that take the `tl.dot` kernel use float32 activations here."""

import os
import subprocess
import sys
import textwrap

import pytest

CHECKS = textwrap.dedent(
    """
    import torch
    import triton
    from rbee_worker.models import cuda_weight_only
    from rbee_worker.models.cuda_weight_only import INT4_DOT_ROWS, int4_dequantize, int4_matmul, pack_int4

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


def test_int4_kernels_in_the_triton_interpreter() -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", CHECKS], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
