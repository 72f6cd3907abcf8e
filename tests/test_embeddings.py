"""Embeddings (Request.embed, POST /v1/embeddings): tiny random decoders with sentence-transformers configs (last-token
and mean pooling, normalized) against sentence-transformers itself, through the engine in chunks beside other
requests; and the OpenAI client against the shared demo worker of each runtime (64 inputs at once, base64, refusals).
The llama.cpp runtime against llama-cpp-python's own embeddings: tests/test_llama_cpp_runner.py."""

import json
import queue
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from conftest import AUTH, RUNTIMES, SHARED_TOKEN, SharedWorkers, engine_config, make_tiny_model
from serving import DEMO_NAME

from rbee_worker.devices import resolve_placement
from rbee_worker.engine.engine import Engine
from rbee_worker.engine.types import Embedding, Request
from rbee_worker.models.loader import load_model
from rbee_worker.models.pooling import finished

TEXTS = [
    "Bees make honey from the nectar of flowers, and they store it in wax combs for the winter months ahead.",
    "Paris is the capital of France.",
    "Hi",
    "A longer text about lighthouses: keepers lived beside the lamp and kept it burning through every storm. " * 3,
]


def with_sentence_transformers_config(directory: Path, mode: str) -> Path:
    """The files sentence-transformers reads beside the weights: a Transformer, a Pooling (`mode`) and a Normalize
    module; the tokenizer pads with its EOS token (sentence-transformers pads batches)."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512, "do_lower_case": False}))
    (directory / "1_Pooling").mkdir()
    flags = {"pooling_mode_lasttoken": mode == "last", "pooling_mode_mean_tokens": mode == "mean"}
    hidden = json.loads((directory / "config.json").read_text())["hidden_size"]
    (directory / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": hidden, **flags}))
    (directory / "2_Normalize").mkdir()
    tokenizer_config = directory / "tokenizer_config.json"
    settings = json.loads(tokenizer_config.read_text())
    settings["pad_token"] = settings.get("eos_token") or "<|endoftext|>"
    tokenizer_config.write_text(json.dumps(settings))
    return directory


@pytest.mark.parametrize("mode", ["last", "mean"])
def test_embeddings_equal_sentence_transformers(mode: str, tmp_path: Path, demo_tokenizer_dir: Path) -> None:
    """A tiny random Llama with a sentence-transformers config: the engine's pooled embeddings (prompts in chunks of
    16 tokens, all submitted at once with a generating request beside them), normalized, are sentence-transformers'
    own (float32, cosine >= 0.9999 and within 1e-4)."""
    from sentence_transformers import SentenceTransformer

    directory = make_tiny_model(tmp_path / "tiny", "llama", demo_tokenizer_dir, initializer_range=0.2)
    with_sentence_transformers_config(directory, mode)
    engine = Engine(
        lambda: load_model(str(directory), resolve_placement("cpu", "float32")),
        engine_config(max_batch=8, prefill_chunk=16),
    )
    try:
        assert engine.loaded.pooling.mode == mode and engine.loaded.pooling.normalize
        requests = [Request(engine.tokenize(text), max_tokens=0, embed=True) for text in TEXTS]
        streams: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(len(TEXTS) + 1)]
        for request, events in zip([*requests, Request(engine.tokenize(TEXTS[0]), max_tokens=6)], streams, strict=True):
            engine.submit(request, events.put)  # all at once: their chunks share forwards
        vectors = []
        for events in streams[:-1]:
            while not isinstance(event := events.get(timeout=60), Embedding):
                pass
            vectors.append(event.values)
    finally:
        engine.close()
    ours = np.stack([finished(np.asarray(v, dtype=np.float32), True) for v in vectors])
    theirs = SentenceTransformer(str(directory), device="cpu").encode(TEXTS, batch_size=2)
    cosine = (ours * theirs).sum(1) / np.linalg.norm(theirs, axis=1)
    assert cosine.min() >= 0.9999 and np.abs(ours - theirs).max() < 1e-4, (cosine, np.abs(ours - theirs).max())


@pytest.mark.slow
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_the_openai_client_embeds_64_inputs_at_once(shared_workers: SharedWorkers, runtime: str) -> None:
    """The shared worker of each runtime on the demo: 64 inputs in one request give 64 unit vectors in order, each the
    one its text gets alone (base64, the client's default, decodes to the floats); usage counts every input's tokens;
    a `dimensions` a non-Matryoshka model does not have and a prompt past the context are 400s naming their field."""
    worker = shared_workers.get(runtime)
    client = openai.OpenAI(base_url=f"{worker.url}/v1", api_key=SHARED_TOKEN, max_retries=0, timeout=120)
    texts = [f"{TEXTS[i % len(TEXTS)]} ({i})" for i in range(64)]
    batch = client.embeddings.create(model=DEMO_NAME, input=texts, encoding_format="float")
    assert [d.index for d in batch.data] == list(range(64))
    vectors = np.array([d.embedding for d in batch.data])
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5) and len({v.tobytes() for v in vectors}) == 64
    for i in (0, 37):
        alone = np.array(client.embeddings.create(model=DEMO_NAME, input=texts[i]).data[0].embedding)
        # The demo's 4-bit CPU kernels round a forward of other rows otherwise (scheduler.py, uniform_rows); on
        # llama.cpp other sequences in its unified KV pool change the attention's sums.
        assert float(alone @ vectors[i]) > 0.999
    tokens = sum(
        httpx.post(f"{worker.url}/tokenize", json={"prompt": t}, headers=AUTH).json()["count"] for t in texts[:2]
    )
    assert client.embeddings.create(model=DEMO_NAME, input=texts[:2]).usage.prompt_tokens == tokens
    for bad, param in (({"dimensions": 8}, "dimensions"), ({"input": "bee " * 9000}, "input")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.embeddings.create(**{"model": DEMO_NAME, "input": "bees", **bad})
        assert refused.value.body["param"] == param
