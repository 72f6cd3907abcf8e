"""GGUF Q4_0 / Q4_1 / Q4_K matrices kept 4-bit (--quantize int4): the stored codes and scales, the CPU int4 kernel,
and the demo model loaded that way."""

import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import cli
from gguf import quants
from gguf.constants import GGMLQuantizationType

from rbee_worker.errors import ModelLoadError
from rbee_worker.hardware.cpu_features import cpu_features
from rbee_worker.hardware.devices import Placement
from rbee_worker.layers.int4_linear import Int4Linear
from rbee_worker.loading.gguf.dequant import CPU_DEQUANTIZE_ROWS, INT4_GROUP, dequantize, int4_groups
from rbee_worker.loading.loader import load_model

T = GGMLQuantizationType
CPU = torch.device("cpu")
PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village by the sea,"]


def quantized(ggml_type: GGMLQuantizationType, rows: int = 48, cols: int = 256) -> tuple[torch.Tensor, tuple]:
    if ggml_type == T.Q4_K:
        return constructed_q4_k(rows, cols)
    rng = np.random.default_rng(int(ggml_type))
    floats = (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 10, size=(rows, 1))).astype(np.float32)
    floats[1, :64] += 5.0  # groups whose minimum is far from zero (Q4_1's offset)
    packed = quants.quantize(floats, ggml_type)
    return torch.from_numpy(np.ascontiguousarray(packed).view(np.uint8).reshape(-1)), (rows, cols)


def constructed_q4_k(rows: int, cols: int) -> tuple[torch.Tensor, tuple]:
    """Q4_K blocks built byte by byte (the gguf package cannot quantize to K-quants): random codes and 6-bit scales
    and mins, float16 d and dmin spanning four orders of magnitude so that the two terms of a zero can be far apart."""
    rng = np.random.default_rng(4)
    count = rows * cols // 256
    blocks = rng.integers(0, 256, size=(count, 144), dtype=np.uint8)  # d, dmin, 12 bytes of scales, 128 of codes
    d = (rng.uniform(1e-4, 0.05, count) * rng.choice([1, 100], count)).astype(np.float16)
    dmin = rng.uniform(1e-4, 0.05, count).astype(np.float16)
    blocks[:, 0:2], blocks[:, 2:4] = d.view(np.uint8).reshape(count, 2), dmin.view(np.uint8).reshape(count, 2)
    return torch.from_numpy(blocks.reshape(-1)), (rows, cols)


def weight_of(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """w = (q - 8) * scale + zero, per group of 32 along each row, in float32."""
    expand = lambda t: t.repeat_interleave(INT4_GROUP, dim=1)  # noqa: E731
    return (codes.float() - 8) * expand(scales) + expand(zeros)


@pytest.mark.parametrize("ggml_type", [T.Q4_0, T.Q4_1, T.Q4_K], ids=lambda t: t.name)
def test_stored_codes_and_scales_give_the_dequantized_matrix(ggml_type: GGMLQuantizationType) -> None:
    """Q4_0 and Q4_1 exactly; Q4_K within float32's rounding of its zeros (measured: 96% of the weights equal, the
    largest difference 6e-8 of the largest weight)."""
    raw, shape = quantized(ggml_type, cols=512)
    codes, scales, zeros = int4_groups(raw, ggml_type, shape)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15 and codes.shape == shape
    assert scales.shape == zeros.shape == (shape[0], shape[1] // INT4_GROUP)
    weights, dequantized = weight_of(codes, scales, zeros), dequantize(raw, ggml_type, shape)
    if ggml_type == T.Q4_K:
        assert (weights - dequantized).abs().max() <= 2**-22 * dequantized.abs().max()
        assert (weights == dequantized).float().mean() > 0.9
    else:
        assert torch.equal(weights, dequantized)
    if ggml_type == T.Q4_0:
        assert not zeros.any()


@pytest.mark.parametrize("ggml_type", [T.Q4_0, T.Q4_1, T.Q4_K], ids=lambda t: t.name)
def test_int4_linear_computes_with_the_stored_codes(ggml_type: GGMLQuantizationType) -> None:
    """The kernel's product equals x W^T for W built from the codes and the bfloat16-rounded scales and zeros (the
    kernel's one rounding of the file's data), up to bfloat16 output rounding; against the file's exact W the
    difference stays within the scales' rounding (2^-9 relative)."""
    raw, shape = quantized(ggml_type)
    codes, scales, zeros = int4_groups(raw, ggml_type, shape)
    bias = torch.randn(shape[0], dtype=torch.bfloat16)
    layer = Int4Linear(codes, scales, zeros, bias)
    x = torch.randn(3, 5, shape[1], dtype=torch.bfloat16)
    y = layer(x).float()
    assert y.shape == (3, 5, shape[0])
    rounded = weight_of(codes, scales.bfloat16().float(), zeros.bfloat16().float())
    expected = x.float() @ rounded.T + bias.float()
    assert (y - expected).abs().max() <= 2**-7 * expected.abs().max()
    exact = x.float() @ dequantize(raw, ggml_type, shape).T + bias.float()
    assert (y - exact).abs().max() <= 2**-6 * exact.abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("ggml_type", [T.Q4_1, T.Q4_K], ids=lambda t: t.name)
def test_many_rows_multiply_the_dequantized_matrix(ggml_type: GGMLQuantizationType, dtype: torch.dtype) -> None:
    """From CPU_DEQUANTIZE_ROWS rows of activations in a dtype that oneDNN computes on this CPU, the layer multiplies
    its matrix dequantized to that dtype, unpacked from PyTorch's CPU layout: each weight is exactly the rounding of
    (q - 8) * scale + zero (so every output is where it belongs), and the product stays within bfloat16 rounding of
    the int4 kernel's. Below that count, or in bfloat16 where oneDNN does not compute it (AVX2 without AVX-NE-CONVERT),
    the kernel runs, on the activations rounded to bfloat16."""
    raw, shape = quantized(ggml_type, rows=192, cols=512)  # 3 of PyTorch's blocks of 64 outputs
    codes, scales, zeros = int4_groups(raw, ggml_type, shape)
    layer = Int4Linear(codes, scales, zeros, None)
    assert torch.equal(
        layer.dequantized(), weight_of(codes, scales.bfloat16().float(), zeros.bfloat16().float()).bfloat16()
    )
    x = torch.randn(CPU_DEQUANTIZE_ROWS, shape[1], dtype=dtype)
    kernel = torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), layer.packed, INT4_GROUP, layer.scales_and_zeros)
    kernel = kernel.to(dtype)
    assert torch.equal(layer(x[:-1]), kernel[:-1])
    many = layer(x)
    if cpu_features().onednn_runs(dtype):
        assert torch.equal(many, torch.nn.functional.linear(x, layer.dequantized(dtype)))
    else:
        assert torch.equal(many, kernel)
    assert (many.float() - kernel.float()).abs().max() <= 2**-7 * kernel.float().abs().max()


@pytest.fixture(scope="module")
def int4_demo(demo_gguf: Path):
    return load_model(str(demo_gguf), Placement(CPU, torch.bfloat16), quantize="int4")


def test_demo_matrices_stay_4_bit_within_1_3x_the_file(int4_demo, demo_gguf: Path) -> None:
    """All 210 Q4_1 matrices of the demo file are Int4Linear; the loaded weights (int4 codes, bfloat16 scales and
    zeros, the Q8_0 embedding and tied head as one int8 matrix: test_int8.py) take at most 1.3x the file's bytes."""
    layers = [m for m in int4_demo.model.modules() if isinstance(m, Int4Linear)]
    assert len(layers) == 30 * 7
    assert not any(type(m) is torch.nn.Linear and m is not int4_demo.model.lm_head for m in int4_demo.model.modules())
    assert int4_demo.info.weight_bytes <= 1.3 * os.path.getsize(demo_gguf)
    # The 4-bit matrices were never dequantized: their placeholders (one zero expanded to the weight's shape) are
    # all gone, every parameter left has memory of its own.
    for name, parameter in int4_demo.model.named_parameters():
        assert parameter.untyped_storage().nbytes() >= parameter.nbytes, name


def test_demo_logits_stay_close_to_float32(int4_demo, demo_gguf: Path) -> None:
    """Last-position logits against the float32 dequantized model: within 4% of the largest logit (measured: 3.1 to
    3.4%, of which the tied Q8_0 LM head's requantization to per-row int8 adds about 1.3 points: 1.4 to 2.2% with a
    bfloat16 head; the plain bfloat16 model's own error was 1.0 to 2.0% on the same prompts)."""
    reference = load_model(str(demo_gguf), Placement(CPU, torch.float32)).model
    for prompt in PROMPTS:
        ids = torch.tensor([int4_demo.tokenizer(prompt)["input_ids"]])
        with torch.inference_mode():
            expected = reference(ids).logits[0, -1]
            got = int4_demo.model(ids).logits[0, -1].float()
        assert (got - expected).abs().max() <= 0.04 * expected.abs().max(), prompt


def test_a_long_prompt_gives_the_logits_of_its_chunks(int4_demo) -> None:
    """A prompt of CPU_DEQUANTIZE_ROWS tokens or more runs its products on the dequantized matrices; its last logits
    match those of the same prompt fed in chunks below that count (the int4 kernel), within 2% of the largest logit."""
    ids = torch.tensor([(int4_demo.tokenizer(" ".join(PROMPTS))["input_ids"] * 40)[:300]])
    model = int4_demo.model
    with torch.inference_mode():
        whole = model(ids).logits[0, -1].float()
        cache = None
        for start in range(0, 300, 100):
            output = model(ids[:, start : start + 100], past_key_values=cache, use_cache=True)
            cache = output.past_key_values
        chunked = output.logits[0, -1].float()
    assert (whole - chunked).abs().max() <= 0.02 * chunked.abs().max()
    assert int(whole.argmax()) == int(chunked.argmax())


def test_generate_with_int4_through_the_cli() -> None:
    result = cli("generate", "--quantize", "int4", "--dtype", "bfloat16", "--prompt", PROMPTS[0], "--max-tokens", "8",
                 "--temperature", "0", fork=True)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_int4_is_refused_where_it_does_not_run(demo_gguf: Path) -> None:
    """(A model directory is quantized at load now: test_quantize.py.)"""
    with pytest.raises(ModelLoadError, match="--quantize int4 runs on the CPU, or in bfloat16"):
        load_model(str(demo_gguf), Placement(torch.device("mps"), torch.float16), quantize="int4")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=str)
def test_auto_keeps_a_gguf_quantized_on_the_cpu_in_any_dtype(demo_gguf: Path, demo_hf_dir: Path, dtype) -> None:
    """`--quantize auto`, the CLI's default: on the CPU the GGUF file's own types in a model of any dtype (the
    kernels compute in bfloat16), and a model directory as it is."""

    def int4_layers(model: torch.nn.Module) -> int:
        return sum(isinstance(m, Int4Linear) for m in model.modules())

    kept = load_model(str(demo_gguf), Placement(CPU, dtype), quantize="auto")
    assert int4_layers(kept.model) == 7 * kept.model.config.num_hidden_layers
    assert kept.info.weight_bytes < os.path.getsize(demo_gguf) * (1.2 if dtype == torch.float32 else 1)
    assert int4_layers(load_model(str(demo_hf_dir), Placement(CPU, dtype), quantize="auto").model) == 0


def test_the_cli_keeps_a_gguf_quantized_by_default(demo_gguf: Path) -> None:
    result = cli("generate", "--prompt", PROMPTS[0], "--max-tokens", "8", "--temperature", "0", fork=True)
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    weights_mib = int(re.search(r"memory: (\d+) MiB weights", result.stderr).group(1))
    assert weights_mib < os.path.getsize(demo_gguf) / 2**20  # dequantized to bfloat16 it would take 2.6x the file
