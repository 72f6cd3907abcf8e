"""The demo model against the reference: transformers' own loading and `generate`, fp32 on CPU."""

from pathlib import Path

import pytest
import torch
from conftest import engine_config, greedy
from transformers import AutoModelForCausalLM

from rbee_worker.engine.engine import Engine
from rbee_worker.engine.request_types import End, StopReason
from rbee_worker.hardware.devices import Placement
from rbee_worker.loading.loader import load_model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village by the sea,",
]
NEW_TOKENS = 64
FP32_CPU = Placement(torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def reference(demo_hf_dir: Path):
    return AutoModelForCausalLM.from_pretrained(demo_hf_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def gguf_engine(demo_gguf: Path):
    engine = Engine(lambda: load_model(str(demo_gguf), FP32_CPU), engine_config())
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def hf_engine(demo_hf_dir: Path):
    engine = Engine(lambda: load_model(str(demo_hf_dir), FP32_CPU), engine_config())
    yield engine
    engine.close()


def greedy_ids(engine: Engine, prompt: str) -> tuple[list[int], End]:
    return greedy(engine, engine.model.tokenize(prompt), NEW_TOKENS)


def reference_ids(reference, engine: Engine, prompt: str) -> list[int]:
    prompt_ids = torch.tensor([engine.model.tokenize(prompt)])
    with torch.inference_mode():
        output = reference.generate(prompt_ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[2])
    generated = output[0, prompt_ids.shape[1] :].tolist()
    return generated[: generated.index(2)] if 2 in generated else generated


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_matches_transformers_generate(reference, gguf_engine: Engine, hf_engine: Engine, prompt: str) -> None:
    expected = reference_ids(reference, gguf_engine, prompt)
    from_gguf, end = greedy_ids(gguf_engine, prompt)
    from_hf, _ = greedy_ids(hf_engine, prompt)
    assert from_gguf == expected
    assert from_hf == expected
    assert end.tokens_out == len(expected)
    assert end.stop_reason is (StopReason.MAX_TOKENS if len(expected) == NEW_TOKENS else StopReason.EOS)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_last_position_logits_match(reference, gguf_engine: Engine, prompt: str) -> None:
    """Our GGUF loader's model gives the reference's logits (weights dequantized by transformers' own path)."""
    ids = torch.tensor([gguf_engine.model.tokenize(prompt) + tuple(greedy_ids(gguf_engine, prompt)[0])])
    with torch.inference_mode():
        expected = reference(ids).logits[0, -1]
        ours = gguf_engine.loaded.model(ids).logits[0, -1]
    assert (ours - expected).abs().max().item() <= 1e-4


def test_gguf_and_safetensors_weights_identical(reference, demo_gguf: Path) -> None:
    """Our torch dequantization equals transformers' numpy one, tensor by tensor (as loaded: the engine then
    reorders its linear weights for oneDNN)."""
    ours = load_model(str(demo_gguf), FP32_CPU).model.state_dict()
    theirs = reference.state_dict()
    assert ours.keys() == theirs.keys()
    mismatched = [name for name in ours if not torch.equal(ours[name], theirs[name])]
    assert mismatched == []
