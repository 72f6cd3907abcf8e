"""merged_linear.py: q/k/v and gate/up computed as one product each, inside transformers' own model classes."""

from pathlib import Path

import pytest
import torch

from rbee_worker.hardware.devices import Placement
from rbee_worker.layers.int4_linear import Int4Linear
from rbee_worker.layers.int8_linear import Int8Linear
from rbee_worker.layers.merged_linear import ProjectionSlice, SharedProduct, merge_projections, stack
from rbee_worker.loading.gguf.dequant import int4_affine, int8_per_row
from rbee_worker.loading.loader import load_model

CPU = Placement(torch.device("cpu"), torch.float32)


def test_the_real_model_gives_the_same_logits_merged(demo_hf_dir: Path) -> None:
    model = load_model(str(demo_hf_dir), CPU).model
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314]])
    with torch.inference_mode():
        before = model(input_ids=ids).logits
        assert merge_projections(model) == 2 * model.config.num_hidden_layers
        after = model(input_ids=ids).logits
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert isinstance(attention.k_proj, ProjectionSlice) and attention.k_proj.product is attention.v_proj.product
    assert isinstance(mlp.up_proj, ProjectionSlice) and mlp.up_proj.product.layer.out_features == 2 * 1536
    torch.testing.assert_close(after, before, atol=1e-4, rtol=1e-4)


def test_a_slice_called_with_another_input_computes_its_own_product() -> None:
    """The saving relies on the callers' order (the first slice computes, the others reuse); the result does not."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, n, bias=True) for n in (4, 2, 2)]
    product = SharedProduct(stack(layers), len(layers))
    slices = [ProjectionSlice(product, 0, 4), ProjectionSlice(product, 4, 6), ProjectionSlice(product, 6, 8)]
    x, y = torch.randn(3, 8), torch.randn(3, 8)
    with torch.no_grad():
        got = [slices[0](x), slices[1](y), slices[2](x), slices[0](y)]
        expected = [layers[0](x), layers[1](y), layers[2](x), layers[0](y)]
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b)
    with torch.no_grad():
        for piece in slices:
            piece(x)
    # No activations kept once every reader had its rows.
    assert product._latest.input is None and product._latest.output is None


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_layers_stack_into_one_with_the_same_outputs(kind: str) -> None:
    torch.manual_seed(0)
    weights = [torch.randn(n, 256) for n in (128, 64, 64)]
    if kind == "int8":
        layers = [Int8Linear(*int8_per_row(w, torch.bfloat16), None) for w in weights]
    else:
        layers = [Int4Linear(*int4_affine(w), None) for w in weights]
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    merged = stack(layers)
    assert type(merged) is type(layers[0]) and merged.out_features == 256
    assert torch.equal(merged(x), torch.cat([layer(x) for layer in layers], dim=-1))


def test_int4_rows_that_split_a_cpu_block_are_left_apart() -> None:
    layers = [Int4Linear(*int4_affine(torch.randn(n, 64)), None) for n in (80, 48)]  # the CPU kernel packs 64 rows
    assert stack(layers) is None
