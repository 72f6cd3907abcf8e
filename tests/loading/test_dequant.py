"""Torch dequantization against gguf-py's numpy reference, bit for bit."""

import numpy as np
import pytest
import torch
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from rbee_worker.errors import ModelLoadError
from rbee_worker.loading.gguf.dequant import SUPPORTED_TYPES, dequantize

T = GGMLQuantizationType

# Types gguf-py can quantize: real quantized data from random floats.
QUANTIZABLE = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]
# K-quants (dequantize-only in gguf-py): random bytes, with the float16 scale fields at these byte offsets made finite.
K_QUANT_F16_FIELDS = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def reference(data: np.ndarray, ggml_type: GGMLQuantizationType) -> torch.Tensor:
    """gguf-py's dequantization of `data` (rows of bytes or of floats) as a float32 tensor."""
    return torch.from_numpy(np.ascontiguousarray(quants.dequantize(data, ggml_type), dtype=np.float32))


def as_raw(data: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(data).view(np.uint8).reshape(-1))


def random_k_quant(ggml_type: GGMLQuantizationType, rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    """(rows, bytes per row) of random blocks whose float16 fields hold finite values of either sign."""
    rng = np.random.default_rng(seed)
    _, type_size = GGML_QUANT_SIZES[ggml_type]
    blocks = rng.integers(0, 256, size=(rows * blocks_per_row, type_size), dtype=np.uint8)
    for start in K_QUANT_F16_FIELDS[ggml_type]:
        scale = rng.standard_normal(len(blocks)).astype(np.float16)
        blocks[:, start : start + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def test_supported_types_cover_the_common_quantizations() -> None:
    required = {T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_K, T.Q6_K}
    assert required <= SUPPORTED_TYPES
    assert set(SUPPORTED_TYPES) == set(QUANTIZABLE) | set(K_QUANT_F16_FIELDS)


@pytest.mark.parametrize("ggml_type", QUANTIZABLE, ids=lambda t: t.name)
def test_quantized_random_floats_match_gguf_reference(ggml_type: GGMLQuantizationType) -> None:
    rng = np.random.default_rng(int(ggml_type))
    floats = (rng.standard_normal((24, 256)) * rng.uniform(0.01, 10, size=(24, 1))).astype(np.float32)
    floats[3] = 0.0  # an all-zero row: zero scales
    floats[5, :32] = -floats[5, :32]
    packed = quants.quantize(floats, ggml_type)

    out = dequantize(as_raw(packed), ggml_type, (24, 256))

    expected = reference(packed, ggml_type)
    assert out.dtype == torch.float32
    assert out.shape == (24, 256)
    assert torch.equal(out, expected)
    # The quantized types really quantize: the values moved but stayed close.
    if ggml_type not in (T.F32, T.F16, T.BF16):
        assert not torch.equal(out, torch.from_numpy(floats))
    assert torch.allclose(out, torch.from_numpy(floats), rtol=0.02, atol=0.2 * float(np.abs(floats).max()))


@pytest.mark.parametrize("ggml_type", list(K_QUANT_F16_FIELDS), ids=lambda t: t.name)
def test_k_quant_blocks_match_gguf_reference(ggml_type: GGMLQuantizationType) -> None:
    packed = random_k_quant(ggml_type, rows=12, blocks_per_row=3, seed=int(ggml_type))

    out = dequantize(as_raw(packed), ggml_type, (12, 3 * 256))

    expected = reference(packed, ggml_type)
    assert torch.isfinite(expected).all()
    assert expected.abs().max() > 0
    assert torch.equal(out, expected)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("ggml_type", [T.F32, T.F16, T.BF16, T.Q4_1, T.Q6_K], ids=lambda t: t.name)
def test_other_dtypes_are_the_float32_result_cast_once(ggml_type: GGMLQuantizationType, dtype: torch.dtype) -> None:
    if ggml_type in K_QUANT_F16_FIELDS:
        packed = random_k_quant(ggml_type, rows=4, blocks_per_row=2, seed=7)
    else:
        packed = quants.quantize(np.random.default_rng(7).standard_normal((4, 512)).astype(np.float32), ggml_type)

    out = dequantize(as_raw(packed), ggml_type, (4, 512), dtype)

    assert out.dtype == dtype
    assert torch.equal(out, reference(packed, ggml_type).to(dtype))


def test_shape_is_applied_to_element_order() -> None:
    floats = np.arange(2 * 3 * 64, dtype=np.float32).reshape(2, 3, 64) / 100
    packed = quants.quantize(floats, T.Q8_0)

    out = dequantize(as_raw(packed), T.Q8_0, (2, 3, 64))

    assert out.shape == (2, 3, 64)
    assert torch.equal(out, reference(packed, T.Q8_0))


def test_result_is_a_new_tensor_not_the_input_bytes() -> None:
    floats = np.linspace(-1, 1, 64, dtype=np.float32)
    raw = as_raw(floats)

    out = dequantize(raw, T.F32, (64,))
    out.fill_(5.0)

    assert torch.equal(raw.view(torch.float32), torch.from_numpy(floats))


def test_misaligned_input_bytes_are_handled() -> None:
    floats = np.random.default_rng(3).standard_normal((2, 64)).astype(np.float32)
    for ggml_type in (T.F32, T.Q4_1):
        packed = quants.quantize(floats, ggml_type)
        # Starting at byte 1 of a buffer: torch cannot reinterpret those bytes as float16/float32 in place.
        shifted = torch.cat((torch.zeros(1, dtype=torch.uint8), as_raw(packed)))[1:]
        assert shifted.storage_offset() == 1

        assert torch.equal(dequantize(shifted, ggml_type, (2, 64)), reference(packed, ggml_type))


@pytest.mark.parametrize("ggml_type", [T.F32, T.Q4_1, T.Q6_K], ids=lambda t: t.name)
def test_empty_tensor(ggml_type: GGMLQuantizationType) -> None:
    out = dequantize(torch.zeros(0, dtype=torch.uint8), ggml_type, (0, 256), torch.float16)

    assert out.shape == (0, 256)
    assert out.dtype == torch.float16


@pytest.mark.parametrize(
    ("ggml_type", "shown_as"), [(T.IQ2_XXS, "IQ2_XXS"), (T.Q8_K, "Q8_K"), (T.I32, "I32"), (99, "#99")]
)
def test_unsupported_type_names_the_type(ggml_type: int, shown_as: str) -> None:
    with pytest.raises(ModelLoadError, match=f"GGML type {shown_as} is not supported by rbee-worker"):
        dequantize(torch.zeros(4096, dtype=torch.uint8), ggml_type, (256,))


@pytest.mark.parametrize(
    ("nbytes", "shape"),
    [(34 * 4 - 1, (4, 32)), (34 * 4 + 34, (4, 32)), (34 * 2, (4, 16))],
    ids=["short", "long", "row-not-a-block-multiple"],
)
def test_byte_count_must_match_shape(nbytes: int, shape: tuple[int, ...]) -> None:
    with pytest.raises(ModelLoadError, match=r"Q8_0 data of \d+ bytes does not match shape"):
        dequantize(torch.zeros(nbytes, dtype=torch.uint8), T.Q8_0, shape)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("ggml_type", sorted(SUPPORTED_TYPES), ids=lambda t: T(t).name)
def test_cuda_matches_the_cpu_result(ggml_type: int) -> None:
    if ggml_type in K_QUANT_F16_FIELDS:
        packed = random_k_quant(T(ggml_type), rows=64, blocks_per_row=4, seed=11)
    else:
        packed = quants.quantize(np.random.default_rng(11).standard_normal((64, 1024)).astype(np.float32), ggml_type)
    raw = as_raw(packed)

    out = dequantize(raw.cuda(), ggml_type, (64, 1024))

    assert out.device.type == "cuda"
    assert torch.equal(out.cpu(), dequantize(raw, ggml_type, (64, 1024)))
    assert torch.equal(out.cpu(), reference(packed, T(ggml_type)))
