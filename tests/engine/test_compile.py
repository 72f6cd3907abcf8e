"""--compile on the CPU: the engine runs its forward through torch.compile, compiled for every class of shapes before
it reports ready, and decodes what the plain forward decodes (a random-weight Llama in float32 with peaked logits,
so that rounding cannot flip a choice)."""

import functools
from pathlib import Path

import pytest
import torch
from conftest import engine_config, is_compiled, make_tiny_model, submit_together

from rbee_worker.engine.engine import Engine
from rbee_worker.engine.request_types import Request
from rbee_worker.engine.sampling.sampling_params import SamplingParams
from rbee_worker.hardware.devices import Placement
from rbee_worker.loading.loader import load_model

PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village by the sea,"]


@pytest.fixture(scope="module")
def random_llama(tmp_path_factory: pytest.TempPathFactory, demo_tokenizer_dir: Path) -> Path:
    return make_tiny_model(
        tmp_path_factory.mktemp("llama") / "model",
        "llama",
        demo_tokenizer_dir,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.1,
    )


def test_compiled_cpu_forward_decodes_as_the_plain_one(random_llama: Path) -> None:
    load = functools.partial(load_model, str(random_llama), Placement(torch.device("cpu"), torch.float32))
    results = []
    for compile_model in (False, True):
        engine = Engine(load, engine_config(max_batch=4, compile_model=compile_model))
        try:
            model = engine.loaded.model  # waits for the load (and the compilation)
            assert is_compiled(model) is compile_model
            # Compiled before ready: the first requests (one alone, then several together, prompts of 1 token and up)
            # find every shape compiled; a compilation now would fail them.
            torch.compiler.set_stance("fail_on_recompile")
            alone = submit_together(engine, [Request(engine.model.tokenize(PROMPTS[0]), max_tokens=24,
                                                     sampling=SamplingParams(temperature=0))])  # fmt: skip
            prompts = [engine.model.tokenize(p) for p in PROMPTS] + [engine.model.tokenize(PROMPTS[1])[:1]]
            together = submit_together(
                engine, [Request(p, max_tokens=24, sampling=SamplingParams(temperature=0)) for p in prompts]
            )
            one_token = submit_together(engine, [Request(prompts[-1], max_tokens=4,
                                                         sampling=SamplingParams(temperature=0))])  # fmt: skip
            results.append((alone, together, one_token))
        finally:
            torch.compiler.set_stance("default")
            engine.close()
    assert results[0] == results[1]
