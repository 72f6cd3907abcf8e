"""GGUF Q8_0 / Q5_K / Q6_K matrices kept 8-bit and quantized token embeddings (--quantize int4): the requantization
to per-row int8, the int8 kernel, the embedding gather, and the demo model (Q4_1 layers, a tied Q8_0 embedding)
loaded that way."""

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import engine_config, greedy
from gguf import quants
from gguf.constants import GGMLQuantizationType
from test_dequant import as_raw, random_k_quant
from test_int4 import PROMPTS, quantized

from rbee_worker.engine.engine import Engine
from rbee_worker.hardware.cpu_features import cpu_features
from rbee_worker.hardware.devices import Placement
from rbee_worker.layers.gguf_quantized import quantized_embedding
from rbee_worker.layers.int4_linear import Int4Linear
from rbee_worker.layers.int8_linear import Int8Embedding, Int8Linear
from rbee_worker.loading.gguf.dequant import CPU_DEQUANTIZE_ROWS, dequantize, int8_groups, int8_rows
from rbee_worker.loading.loader import load_model

T = GGMLQuantizationType
CPU = torch.device("cpu")
INT8_TYPES = [T.Q8_0, T.Q5_K, T.Q6_K]
# Requantizing to s = max|w| / 127 per row moves a weight by at most s / 2, relative to the row's largest weight
# 1/254 up to float32's rounding of s, w / s and the check's own product (measured: 1 + 2.5e-6); a bfloat16 s
# rounded up is at most 2^-7 larger.
BOUND = {torch.float32: 1 / 254 * (1 + 2**-16), torch.bfloat16: 1 / 254 * (1 + 2**-7)}
# English prose and code, 83 tokens, for the perplexity comparison.
TEXT = (
    "The Industrial Revolution began in Great Britain in the late eighteenth century and spread to Europe and North "
    "America. It replaced hand production with machines, new chemical and iron processes, and the increasing use of "
    "steam power. Textiles were the dominant industry in terms of employment, value of output and capital invested. "
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n"
)


def stored(ggml_type: GGMLQuantizationType, rows: int = 24, cols: int = 512) -> tuple[torch.Tensor, tuple]:
    """A matrix of `ggml_type`: Q8_0 quantized by gguf-py from random floats (an all-zero row among them), K-quants
    built byte by byte (random codes and scales, float16 fields of either sign)."""
    if ggml_type in (T.Q5_K, T.Q6_K):
        return as_raw(random_k_quant(ggml_type, rows, cols // 256, seed=int(ggml_type))), (rows, cols)
    rng = np.random.default_rng(8)
    floats = (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 10, size=(rows, 1))).astype(np.float32)
    floats[2] = 0.0
    floats[3, :32] *= 100  # one block far larger than the rest of its row
    return as_raw(quants.quantize(floats, ggml_type)), (rows, cols)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("ggml_type", INT8_TYPES, ids=lambda t: t.name)
def test_requantized_rows_stay_within_half_a_step(ggml_type: GGMLQuantizationType, dtype: torch.dtype) -> None:
    """Every weight within s / 2 of the file's (s = the row's scale), and the codes use the whole int8 range."""
    raw, shape = stored(ggml_type)
    codes, scales = int8_rows(raw, ggml_type, shape, dtype)
    assert codes.dtype == torch.int8 and codes.shape == shape and scales.dtype == dtype and scales.shape == shape[:1]
    assert int(codes.abs().max()) <= 127
    weights = dequantize(raw, ggml_type, shape)
    peak = weights.abs().amax(dim=1)
    error = (codes.float() * scales.float().unsqueeze(1) - weights).abs().amax(dim=1)
    assert (error <= BOUND[dtype] * peak).all()
    assert (error > 0).any()  # the codes really changed
    live = peak > 0
    assert (codes[live].abs().amax(dim=1) >= 126).all()  # 127, or 126 where the scale was rounded up
    assert not codes[~live].any() and not scales[~live].any()


def test_q8_0_groups_are_the_stored_blocks() -> None:
    """Codes and per-32 scales as stored, dequantizing bit for bit, in tensors of their own."""
    raw, shape = stored(T.Q8_0)
    codes, scales = int8_groups(raw, T.Q8_0, shape)
    assert codes.shape == shape and scales.shape == (shape[0], shape[1] // 32) and scales.dtype == torch.float16
    weights = (codes.float().unflatten(1, (-1, 32)) * scales.float().unsqueeze(2)).flatten(1)
    assert torch.equal(weights, dequantize(raw, T.Q8_0, shape))
    before = raw.clone()
    codes.fill_(1), scales.fill_(1)
    assert torch.equal(raw, before)


@pytest.mark.parametrize("ggml_type", INT8_TYPES, ids=lambda t: t.name)
def test_int8_linear_computes_with_the_requantized_matrix(ggml_type: GGMLQuantizationType) -> None:
    """The kernel's product equals x W^T for W = codes * scales up to the output's rounding (bfloat16, or float32,
    which runs too, slowly); against the file's exact W each output stays within that plus what the requantization
    can add, sum |x| * s / 2 (large on row 3, whose one big block makes s large for all its weights)."""
    raw, shape = stored(ggml_type)
    x = torch.randn(3, 5, shape[1])
    bias = torch.randn(shape[0])
    exact_w = dequantize(raw, ggml_type, shape)
    for dtype, tolerance in ((torch.bfloat16, 2**-7), (torch.float32, 1e-5)):
        codes, scales = int8_rows(raw, ggml_type, shape, dtype)
        xs, b = x.to(dtype).float(), bias.to(dtype).float()
        y = Int8Linear(codes, scales, bias.to(dtype))(x.to(dtype)).float()
        assert y.shape == (3, 5, shape[0])
        expected = xs @ (codes.float() * scales.float().unsqueeze(1)).T + b
        rounding = tolerance * expected.abs().max()
        assert (y - expected).abs().max() <= rounding
        requantization = xs.abs().sum(-1, keepdim=True) * scales.float() / 2
        assert ((y - (xs @ exact_w.T + b)).abs() <= requantization + rounding).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_many_rows_multiply_the_dequantized_matrix(dtype: torch.dtype) -> None:
    """From CPU_DEQUANTIZE_ROWS rows of activations in a dtype that oneDNN computes on this CPU, the layer multiplies
    its matrix dequantized to that dtype (each weight the rounding of codes * scale); below, or in bfloat16 where
    oneDNN does not compute it, the int8 kernel on the activations rounded to bfloat16; the two products agree within
    bfloat16 rounding."""
    raw, shape = stored(T.Q8_0)
    codes, scales = int8_rows(raw, T.Q8_0, shape, torch.bfloat16)
    layer = Int8Linear(codes, scales, None)
    assert torch.equal(layer.dequantized(), (codes.float() * scales.float().unsqueeze(1)).bfloat16())
    x = torch.randn(CPU_DEQUANTIZE_ROWS, shape[1], dtype=dtype)
    kernel = torch.ops.aten._weight_int8pack_mm(x.bfloat16(), codes, scales).to(dtype)
    assert torch.equal(layer(x[:-1]), kernel[:-1])
    many = layer(x)
    if cpu_features().onednn_runs(dtype):
        assert torch.equal(many, torch.nn.functional.linear(x, layer.dequantized(dtype)))
    else:
        assert torch.equal(many, kernel)
    assert (many.float() - kernel.float()).abs().max() <= 2**-7 * kernel.float().abs().max()


IDS = torch.tensor([[0, 5, 23, 5], [2, 3, 1, 0]])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("ggml_type", [T.Q8_0, T.Q4_0, T.Q4_1], ids=lambda t: t.name)
def test_embedding_gathers_exactly_the_dequantized_rows(ggml_type: GGMLQuantizationType, dtype: torch.dtype) -> None:
    """An untied Q8_0 / Q4_0 / Q4_1 embedding keeps the file's codes and scales: the dequantized rows bit for bit."""
    raw, shape = stored(T.Q8_0) if ggml_type == T.Q8_0 else quantized(ggml_type, rows=24, cols=512)
    embedding, head = quantized_embedding(raw, ggml_type, shape, dtype, tied=False)
    assert head is None and embedding.codes.dtype == torch.int8
    if ggml_type == T.Q8_0:
        assert embedding.groups == shape[1] // 32 and embedding.scales.dtype == torch.float16
    rows = embedding(IDS)
    assert rows.dtype == dtype and rows.shape == (*IDS.shape, shape[1])
    assert torch.equal(rows, dequantize(raw, ggml_type, shape, dtype)[IDS])


@pytest.mark.parametrize("ggml_type", [T.Q8_0, T.Q6_K, T.Q4_K], ids=lambda t: t.name)
def test_tied_head_and_embedding(ggml_type: GGMLQuantizationType) -> None:
    """An 8-bit tied pair is one int8 matrix: the embedding gathers the head's own codes and scales (the
    requantized rows). A 4-bit one has an Int4Linear head and an embedding of the stored codes (Q4_K: within
    float32's rounding of its zeros)."""
    raw, shape = quantized(ggml_type, cols=512) if ggml_type == T.Q4_K else stored(ggml_type)
    embedding, head = quantized_embedding(raw, ggml_type, shape, torch.bfloat16, tied=True)
    rows = embedding(IDS).float()
    if ggml_type == T.Q4_K:
        assert isinstance(head, Int4Linear)
        expected = dequantize(raw, ggml_type, shape)[IDS]
        assert (rows - expected).abs().max() <= 2**-8 * expected.abs().max()  # bfloat16 output rounding
        return
    assert isinstance(head, Int8Linear) and embedding.groups == 1
    assert embedding.codes.untyped_storage().data_ptr() == head.codes.untyped_storage().data_ptr()
    assert embedding.scales.untyped_storage().data_ptr() == head.scales.untyped_storage().data_ptr()
    requantized = head.codes.float() * head.scales.float().unsqueeze(1)
    assert torch.equal(rows, requantized.bfloat16().float()[IDS])


@pytest.fixture(scope="module")
def quantized_demo(demo_gguf: Path):
    return load_model(str(demo_gguf), Placement(CPU, torch.bfloat16), quantize="int4")


def test_demo_embedding_and_head_share_one_int8_matrix(quantized_demo, demo_gguf: Path) -> None:
    """The tied Q8_0 embedding and LM head are one int8 matrix (no bfloat16 copy left): the weights take less than
    the file (measured 94.8 MB for a 98.4 MB file; the int4 layers with a bfloat16 embedding took 123.0 MB)."""
    model = quantized_demo.model
    embedding, head = model.get_input_embeddings(), model.lm_head
    assert isinstance(embedding, Int8Embedding) and isinstance(head, Int8Linear)
    assert embedding.codes.untyped_storage().data_ptr() == head.codes.untyped_storage().data_ptr()
    assert not any(isinstance(m, torch.nn.Embedding | torch.nn.Linear) for m in model.modules())
    assert max(p.numel() for p in model.parameters()) < 576 * 576  # only norms and biases are left as parameters
    assert quantized_demo.info.weight_bytes <= 1.3 * os.path.getsize(demo_gguf)
    assert quantized_demo.info.weight_bytes < os.path.getsize(demo_gguf)


def test_demo_perplexity_stays_close_to_float32(quantized_demo, demo_gguf: Path) -> None:
    """On 83 tokens of prose and code: perplexity within 2% of the float32 model's and KL divergence of the next-token
    distributions below 0.005. Measured: perplexity 17.12 against 17.02 (bfloat16 17.08, the int4 layers with a
    bfloat16 head 17.25), KL 0.0026 (bfloat16 0.0011, int4 layers alone 0.0011): the head's per-row requantization
    adds noise of about Q8_0's own size. A wrong scale or code layout in any matrix drives both far past the bounds."""
    reference = load_model(str(demo_gguf), Placement(CPU, torch.float32)).model
    ids = torch.tensor([quantized_demo.tokenizer(TEXT)["input_ids"]])
    with torch.inference_mode():
        expected = reference(ids).logits[0, :-1].log_softmax(-1)
        got = quantized_demo.model(ids).logits[0, :-1].float().log_softmax(-1)
    targets = ids[0, 1:]
    nll = torch.nn.functional.nll_loss(got, targets)
    reference_nll = torch.nn.functional.nll_loss(expected, targets)
    assert torch.exp(nll - reference_nll) <= 1.02
    kl = torch.nn.functional.kl_div(got, expected, log_target=True, reduction="batchmean")
    assert kl < 0.005


def test_demo_engine_greedy_output(quantized_demo) -> None:
    """Through the engine (last in this module: it swaps in its own attention), greedy decoding still says Paris, as
    the int4 model with a bfloat16 head did."""
    engine = Engine(lambda: quantized_demo, engine_config())
    try:
        ids, _ = greedy(engine, quantized_demo.tokenizer(PROMPTS[0])["input_ids"], 8)
    finally:
        engine.close()
    assert "Paris" in quantized_demo.tokenizer.decode(ids)
