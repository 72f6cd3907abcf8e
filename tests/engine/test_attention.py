"""The engine's attention function (engine/runners/torch/attention.py) against attention written out, and its use on the
real model."""

from pathlib import Path

import pytest
import torch
from conftest import engine_config

from rbee_worker.engine.engine import Engine
from rbee_worker.engine.runners.torch.attention import NAME, attention
from rbee_worker.engine.runners.torch.kv_cache import decode_mask, prefill_mask
from rbee_worker.hardware.devices import resolve_placement
from rbee_worker.loading.loader import load_model


class _Layer(torch.nn.Module):
    num_key_value_groups = 3  # 9 query heads on 3 key/value heads, as the demo model


def reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + mask) v, each query head on a copy of its key/value head: (rows, q, heads, d)."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = query @ key.transpose(-1, -2) / query.shape[-1] ** 0.5 + mask
    return (scores.softmax(-1) @ value).transpose(1, 2)


def qkv(rows: int, q_len: int, kv_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(rows * 1000 + q_len)
    return tuple(torch.randn(rows, h, n, 64, generator=generator) for h, n in ((9, q_len), (3, kv_len), (3, kv_len)))


@pytest.mark.parametrize(
    ("case", "rows", "q_len", "kv_len", "mask"),
    [
        # a decode step: rows of different lengths, a dummy row (length 0) among them
        ("decode", 4, 1, 37, lambda: decode_mask(torch.tensor([37, 5, 1, 0]), 37, torch.float32)),
        # a first prompt chunk on one row: the mask is causal and replaced by is_causal
        ("first chunk", 1, 20, 20, lambda: prefill_mask([0], [20], 20, torch.float32, torch.device("cpu"))),
        # chunks of three prompts, left-padded, one with cached positions before it: transformers' sdpa
        (
            "batched chunks",
            3,
            5,
            40,
            lambda: prefill_mask([35, 0, 10], [5, 3, 5], 40, torch.float32, torch.device("cpu")),
        ),
    ],
)
def test_attention_equals_attention_written_out(case: str, rows: int, q_len: int, kv_len: int, mask) -> None:
    query, key, value = qkv(rows, q_len, kv_len)
    mask = mask()
    output, _ = attention(_Layer(), query, key, value, mask, scaling=64**-0.5)
    expected = reference(query, key, value, mask)
    real = mask[:, 0, :, :].amax(-1) == 0  # padding queries (they see position 0 only) are thrown away anyway
    assert output.shape == expected.shape
    torch.testing.assert_close(output[real], expected[real], atol=1e-5, rtol=1e-5)


def test_attention_compiles_whole_with_dynamic_shapes() -> None:
    """Under torch.compile(dynamic=True) the head counts are symbolic; SDPA's enable_gqa flag takes a plain bool, so
    deriving it from them broke the graph at every layer (and the model's layer loop with it: the engine's
    --compile then ran the layers one by one). fullgraph=True fails on any graph break."""
    compiled = torch.compile(attention, fullgraph=True, dynamic=True)
    # Dynamo's defaults: a CUDA test that compiled the engine's layers before this one (in the same process) leaves
    # module ints dynamic (compiled.py), under which this call is left out of the graph instead.
    torch._dynamo.reset()
    patch = torch._dynamo.config.patch(allow_unspec_int_on_nn_module=False)
    for rows, q_len, kv_len in ((1, 20, 20), (1, 33, 33), (4, 1, 37)):
        query, key, value = qkv(rows, q_len, kv_len)
        mask = decode_mask(torch.full((rows,), kv_len), kv_len, torch.float32) if q_len == 1 else None
        with patch:
            got, _ = compiled(_Layer(), query, key, value, mask)
        expected, _ = attention(_Layer(), query, key, value, mask)
        torch.testing.assert_close(got, expected)


def test_the_engine_runs_the_real_model_through_it(demo_gguf: Path) -> None:
    engine = Engine(lambda: load_model(str(demo_gguf), resolve_placement("cpu", "auto")), engine_config())
    try:
        assert engine.loaded.model.config._attn_implementation == NAME
    finally:
        engine.close()
