"""--quantize int8 / int4 for a model directory: the decoder layers' linear layers quantized at load
(layers/quantize.py), on the real demo model built as a safetensors directory."""

from pathlib import Path

import pytest
import torch
from conftest import cli

from rbee_worker.errors import ModelLoadError
from rbee_worker.hardware.devices import Placement
from rbee_worker.layers.int4_linear import Int4Linear
from rbee_worker.layers.int8_linear import Int8Linear
from rbee_worker.layers.quantize import quantize_head, quantized_supported
from rbee_worker.loading.gguf.dequant import int4_affine
from rbee_worker.loading.loader import load_model

CPU = torch.device("cpu")
PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village by the sea,"]
LAYER_TYPES = {"int8": Int8Linear, "int4": Int4Linear}


def test_int4_affine_codes_reproduce_the_weights_within_half_a_step() -> None:
    weight = torch.randn(16, 128) * torch.logspace(-3, 0, 16)[:, None]
    weight[3, 32:64] = 0.25  # a constant group: scale 1, every code 0, the value carried by the zero
    codes, scales, zeros = int4_affine(weight)
    assert codes.dtype == torch.int32 and int(codes.min()) >= 0 and int(codes.max()) <= 15
    expand = lambda t: t.repeat_interleave(32, dim=1)  # noqa: E731
    rebuilt = (codes - 8) * expand(scales) + expand(zeros)
    assert torch.all((rebuilt - weight).abs() <= expand(scales) / 2 * (1 + 1e-5) + 1e-7)
    assert torch.equal(rebuilt[3, 32:64], weight[3, 32:64])
    # Each non-constant group spans its full 16 codes: min -> 0, max -> 15.
    assert torch.equal(codes.reshape(16, 4, 32).amax(-1)[:, 0], torch.full((16,), 15, dtype=torch.int32))


@pytest.fixture(scope="module")
def reference(demo_hf_dir: Path) -> torch.nn.Module:
    return load_model(str(demo_hf_dir), Placement(CPU, torch.float32)).model


@pytest.fixture(scope="module")
def plain_bytes(demo_hf_dir: Path) -> int:
    return load_model(str(demo_hf_dir), Placement(CPU, torch.bfloat16)).info.weight_bytes


@pytest.mark.parametrize(("mode", "tolerance"), [("int8", 0.05), ("int4", 0.03)])
def test_quantized_directory_runs_close_to_float32(
    demo_hf_dir: Path, reference: torch.nn.Module, plain_bytes: int, mode: str, tolerance: float
) -> None:
    """All 210 matrices of the 30 decoder layers are quantized, the embedding and the LM head tied to it stay
    bfloat16; the weights shrink, and last-position logits stay within `tolerance` of the largest float32 logit.
    Measured: int8 2.6 to 3.7%, int4 1.6 to 1.8% (the plain bfloat16 model's own error is 1.0 to 2.0%, test_int4.py):
    a row's one int8 scale is set by its largest weight, and this model's rows have outliers that a group of 32 with
    its own range avoids."""
    loaded = load_model(str(demo_hf_dir), Placement(CPU, torch.bfloat16), quantize=mode)
    model = loaded.model
    assert sum(isinstance(m, LAYER_TYPES[mode]) for m in model.modules()) == 30 * 7
    assert type(model.lm_head) is torch.nn.Linear and model.lm_head.weight.dtype == torch.bfloat16
    # bfloat16: 56.6 MB embedding (tied head) + 2 bytes per layer weight; int8 1 byte, int4 0.625.
    layer_weights = 30 * (576 * 576 * 2 + 576 * 192 * 2 + 576 * 1536 * 3)
    saved = {"int8": 1.0, "int4": 1.375}[mode] * layer_weights
    assert loaded.info.weight_bytes <= plain_bytes - 0.99 * saved
    for prompt in PROMPTS:
        ids = torch.tensor([loaded.tokenizer(prompt)["input_ids"]])
        with torch.inference_mode():
            expected = reference(ids).logits[0, -1]
            got = model(ids).logits[0, -1].float()
        error = (got - expected).abs().max() / expected.abs().max()
        print(f"{mode} {prompt!r}: {float(error):.4f}")
        assert error <= tolerance, prompt


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_an_untied_lm_head_is_quantized_to_int8_per_row_on_cuda_only(tiny_models: dict[str, Path], mode: str) -> None:
    """A model whose LM head is its own matrix (mistral here): loaded on the CPU, its head stays bfloat16 (PyTorch's
    int8 kernel is slower there at several rows); what quantize_linears does to it on CUDA (test_cuda.py checks that
    it does) gives an int8 head whose logits stay within the quantization's bound of the bfloat16 head's: each
    weight moves by at most 1/254 of its row's largest."""
    loaded = load_model(str(tiny_models["mistral"]), Placement(CPU, torch.bfloat16), quantize=mode)
    assert type(loaded.model.lm_head) is torch.nn.Linear
    plain = load_model(str(tiny_models["mistral"]), Placement(CPU, torch.bfloat16)).model
    head = plain.lm_head
    quantize_head(plain)
    quantized = plain.lm_head
    assert type(quantized) is Int8Linear and quantized.codes.dtype == torch.int8
    hidden = torch.randn(3, plain.config.hidden_size, dtype=torch.bfloat16)
    with torch.inference_mode():
        expected, got = head(hidden).float(), quantized(hidden).float()
    bound = (hidden.float().abs().sum(-1, keepdim=True) * head.weight.float().abs().amax(-1) / 254).max()
    assert 0 < (got - expected).abs().max() <= bound * 1.05 + 0.02 * expected.abs().max()


def test_quantized_directory_generates_through_the_cli(demo_hf_dir: Path) -> None:
    result = cli("generate", "--model", str(demo_hf_dir), "--quantize", "int8", "--dtype", "bfloat16",
                 "--prompt", PROMPTS[0], "--max-tokens", "8", "--temperature", "0", fork=True)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_quantize_is_refused_where_its_kernels_do_not_run(demo_hf_dir: Path) -> None:
    """The kernels run on the CPU in a model of any dtype (they compute in bfloat16), on CUDA in a bfloat16 model only,
    and not at all on MPS: refused before anything loads, in one line."""
    assert all(quantized_supported(CPU, dtype) for dtype in (torch.float32, torch.bfloat16, torch.float16))
    with pytest.raises(ModelLoadError, match="--quantize int4 runs on the CPU, or in bfloat16 on a CUDA GPU"):
        load_model(str(demo_hf_dir), Placement(torch.device("mps"), torch.float16), quantize="int4")
