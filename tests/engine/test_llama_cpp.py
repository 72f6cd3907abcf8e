"""The demo model in rbee-worker against llama.cpp (llama-cpp-python) on the same GGUF file, from the same token ids.

llama.cpp's CPU kernels for Q4_1 matrices quantize the activations to 8 bits (its Q8_1 dot products), so on the
quantized file its logits sit as far from the file's exact weights (the float32 dequantized model) as our int4
model's do, in another direction: neither is the other's reference. The checks are therefore: llama.cpp on an F32
copy of the file computes what our float32 model computes (the model code agrees), and against the exact model our
int4 logits and perplexity are no further off than llama.cpp's on the quantized file.
"""

from pathlib import Path

import numpy as np
import pytest
import torch

from rbee_worker.benchmark.accuracy import (
    GREEDY_TOKENS,
    PROMPTS,
    TEXT,
    first_divergence,
    greedy,
    llama_cpp_logits,
    perplexity,
    torch_logits,
    write_float32_copy,
)
from rbee_worker.hardware.devices import Placement
from rbee_worker.layers.cpu_linear import pack_linears
from rbee_worker.loading.loader import load_model

pytest.importorskip("llama_cpp")

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def systems(demo_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    reference = load_model(str(demo_gguf), Placement(CPU, torch.float32))
    int4 = load_model(str(demo_gguf), Placement(CPU, torch.bfloat16), quantize="int4").model
    pack_linears(int4)  # as the engine serves it
    float32_file = write_float32_copy(demo_gguf, tmp_path_factory.mktemp("f32") / "demo-f32.gguf")
    return {
        "tokenizer": reference.tokenizer,
        "fp32": torch_logits(reference.model),
        "int4": torch_logits(int4),
        "llama.cpp": llama_cpp_logits(demo_gguf, 2),
        "llama.cpp f32": llama_cpp_logits(float32_file, 2, float32_cache=True),
    }


def prompt_ids(systems: dict) -> list[list[int]]:
    return [systems["tokenizer"](p)["input_ids"] for p in PROMPTS]


def test_llama_cpp_on_the_dequantized_file_computes_our_float32_model(systems: dict) -> None:
    """Same weights in float32 on both sides, llama.cpp's KV cache in float32 too: logits at every position agree to
    float32 summation-order noise, and greedy text of 64 tokens is identical on all three prompts.

    The bound: both sides round only in float32 (2^-24 relative per operation); what differs between instruction
    sets is the order of the sums (ggml's and oneDNN's 8-float AVX2 lanes against 16-float AVX-512 ones), which moves
    each dot product by a few float32 steps of its magnitude. Measured 1.4e-6 to 3.3e-6 of the largest logit on
    AVX-512, and the same with our side forced to AVX2; 1e-4 leaves 30x. With llama.cpp's default float16 cache the
    error is 3e-4 to 9e-4 on AVX-512 and was 1.2e-3 on an AVX2-only CPU: float16's 11-bit rounding of every cached key
    and value, not the kernels, so that comparison says nothing about the model code."""
    for ids in prompt_ids(systems):
        ours, theirs = systems["fp32"](ids), systems["llama.cpp f32"](ids)
        assert np.abs(ours - theirs).max() <= 1e-4 * np.abs(ours).max()
        ours_text, _ = greedy(systems["fp32"], ids, GREEDY_TOKENS)
        theirs_text, _ = greedy(systems["llama.cpp f32"], ids, GREEDY_TOKENS)
        assert first_divergence(ours_text, theirs_text) is None


def test_int4_stays_near_llama_cpps_distance_from_the_exact_weights(systems: dict) -> None:
    """Last-position logits: our int4 model's largest error against the exact model stays within 1.7x llama.cpp's on the
    Q4_1 file. Measured 0.68 / 1.00 / 0.77 against 0.62 / 0.63 / 0.61 since the tied Q8_0 embedding and LM head load as
    one int8 matrix with a scale per row (0.96x the file's bytes instead of 1.25x); with a bfloat16 head it was
    0.43 / 0.62 / 0.34. The two quantized models stay within 7% of each prompt's largest logit of each other (measured
    5.5% / 2.9% / 3.6%, 4.4% / 2.8% / 2.5% with the bfloat16 head): each is off the exact logits in its own
    direction."""
    ours_errors, their_errors, between = [], [], []
    for ids in prompt_ids(systems):
        exact = systems["fp32"](ids)[-1]
        ours, theirs = systems["int4"](ids)[-1], systems["llama.cpp"](ids)[-1]
        ours_errors.append(np.abs(ours - exact).max())
        their_errors.append(np.abs(theirs - exact).max())
        between.append(np.abs(ours - theirs).max() / np.abs(exact).max())
    assert max(ours_errors) <= 1.7 * max(their_errors), (ours_errors, their_errors)
    assert max(between) <= 0.07, between


def test_int4_perplexity_stays_within_one_percent_of_the_exact_model(systems: dict) -> None:
    """Over a fixed text of ~150 tokens: int4 within 1% of the exact model (measured 0.3%), llama.cpp on the quantized
    file within 2.5% of ours (measured 1.5%: its 8-bit activations cost more than our bfloat16 scales)."""
    ids = systems["tokenizer"](TEXT)["input_ids"]
    exact, ours, theirs = (perplexity(systems[name], ids) for name in ("fp32", "int4", "llama.cpp"))
    assert abs(ours / exact - 1) < 0.01, (ours, exact)
    assert abs(theirs / ours - 1) < 0.025, (theirs, ours)
