"""Shared fixtures: the real demo model, a safetensors directory built from it, and tiny random-weight models."""

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from rbee_worker.models.demo import cache_dir, demo_model_path

# Bump when the way the derived directory is built changes, so stale caches are not reused.
HF_DIR_VERSION = "1"


@pytest.fixture(scope="session")
def demo_gguf() -> Path:
    return demo_model_path()


@pytest.fixture(scope="session")
def demo_hf_dir(demo_gguf: Path) -> Path:
    """The demo model as a Hugging Face safetensors directory (float32).

    The weights come from transformers' own GGUF loader, independent of ours, so comparing the two paths checks our
    dequantization; the tokenizer comes from ours (transformers' GGUF tokenizer does not split digits the way
    SmolLM2's does). Built once and cached next to the demo file.
    """
    target = cache_dir() / f"test-smollm2-hf-v{HF_DIR_VERSION}"
    if not (target / "model.safetensors").is_file():
        staging = target.with_name(target.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        # A separate process: transformers' GGUF path holds ~1 GB it never gives back.
        script = f"""
import torch
from transformers import AutoModelForCausalLM
from rbee_worker.models.gguf_format import read_gguf
from rbee_worker.models.gguf_tokenizer import build_tokenizer
path = {str(demo_gguf)!r}
model = AutoModelForCausalLM.from_pretrained({str(demo_gguf.parent)!r}, gguf_file={demo_gguf.name!r},
                                             dtype=torch.float32)
model.generation_config.eos_token_id = [2]
# The weights are dequantized already; drop the GGUF quantizer marker so that save_pretrained writes them plainly.
model.hf_quantizer = None
del model.config.quantization_config
model.save_pretrained({str(staging)!r})
build_tokenizer(read_gguf(path).metadata).save_pretrained({str(staging)!r})
"""
        subprocess.run([sys.executable, "-c", script], check=True)
        staging.replace(target)
    return target


@pytest.fixture(scope="session")
def demo_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model's tokenizer alone (3.5 MB): `RBEE_TEST_TOKENIZER_DIR` where the GGUF is not at hand (GPU box)."""
    if explicit := os.environ.get("RBEE_TEST_TOKENIZER_DIR"):
        return Path(explicit)
    from rbee_worker.models.gguf_format import read_gguf
    from rbee_worker.models.gguf_tokenizer import build_tokenizer

    directory = tmp_path_factory.mktemp("demo-tokenizer")
    build_tokenizer(read_gguf(demo_model_path()).metadata).save_pretrained(directory)
    return directory


def make_tiny_model(directory: Path, model_type: str, tokenizer_dir: Path, **overrides) -> Path:
    """A random-weight model of the given architecture (fixed seed), with the demo tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    shape = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
    }
    config = AutoConfig.for_model(model_type, **{**shape, **overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory, demo_tokenizer_dir: Path) -> dict[str, Path]:
    """Tiny random mistral and qwen2 models (GQA, untied / tied embeddings)."""
    root = tmp_path_factory.mktemp("tiny")
    return {
        "mistral": make_tiny_model(root / "mistral", "mistral", demo_tokenizer_dir, sliding_window=None),
        "qwen2": make_tiny_model(root / "qwen2", "qwen2", demo_tokenizer_dir, tie_word_embeddings=True),
    }


def cli(*args: str, timeout: float = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run `rbee-worker` as a real process; `env` adds to (or overrides) this process's environment."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "rbee_worker", *args], capture_output=True, text=True, timeout=timeout, env=full_env
    )


def greedy(engine, prompt_ids: Sequence[int], max_tokens: int):
    """Greedy token ids generated through `engine` for `prompt_ids`, and the request's End event."""
    from rbee_worker.engine.sampling import SamplingParams
    from rbee_worker.engine.types import End, Request, Token

    request = Request(tuple(prompt_ids), max_tokens=max_tokens, sampling=SamplingParams(temperature=0.0))
    events = list(engine.stream(request))
    assert isinstance(events[-1], End), events[-1]
    return [i for e in events if isinstance(e, Token) for i in e.token_ids], events[-1]


def submit_together(engine, requests: Sequence, timeout: float = 120) -> list[list[int]]:
    """Submit all `requests` at once (engine.submit, no waiting in between), then each one's token ids, in order;
    every request must end with End."""
    import queue

    from rbee_worker.engine.types import End, Error, Token

    streams = [queue.SimpleQueue() for _ in requests]
    for request, events in zip(requests, streams, strict=True):
        engine.submit(request, events.put)
    results = []
    for events in streams:
        ids = []
        while not isinstance(event := events.get(timeout=timeout), End | Error):
            if isinstance(event, Token):
                ids.extend(event.token_ids)
        assert isinstance(event, End), event
        results.append(ids)
    return results
