"""Embeddings (Request.embed, POST /v1/embeddings): tiny random decoders with sentence-transformers configs (last-token
and mean pooling, normalized) against sentence-transformers itself, through the engine in chunks beside other
requests; and the OpenAI client against the shared demo worker of each runtime (64 inputs at once, base64, refusals).
A tiny BERT encoder served for embeddings only, against sentence-transformers' mean pooling. The llama.cpp runtime
against llama-cpp-python's own embeddings: tests/engine/test_llama_cpp_runner.py."""

import json
import queue
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from conftest import AUTH, RUNTIMES, SHARED_TOKEN, SharedWorkers, engine_config, make_tiny_bert, make_tiny_model
from serving import DEMO_NAME, running

from rbee_worker.engine.engine import Engine
from rbee_worker.engine.request_types import Embedding, Error, Request
from rbee_worker.hardware.devices import resolve_placement
from rbee_worker.loading.loader import load_model
from rbee_worker.loading.pooling import finished

TEXTS = [
    "Bees make honey from the nectar of flowers, and they store it in wax combs for the winter months ahead.",
    "Paris is the capital of France.",
    "Hi",
    "A longer text about lighthouses: keepers lived beside the lamp and kept it burning through every storm. " * 3,
]


def with_sentence_transformers_config(directory: Path, mode: str) -> Path:
    """The files sentence-transformers reads beside the weights: a Transformer, a Pooling (`mode`) and a Normalize
    module; the tokenizer pads with its EOS token where it has no padding token (sentence-transformers pads
    batches)."""
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
    settings["pad_token"] = settings.get("pad_token") or settings.get("eos_token") or "<|endoftext|>"
    tokenizer_config.write_text(json.dumps(settings))
    return directory


@pytest.mark.parametrize("mode", ["last", "mean"])
def test_embeddings_equal_sentence_transformers(mode: str, tmp_path: Path, demo_tokenizer_dir: Path) -> None:
    """A tiny random Llama with a sentence-transformers config: the engine's pooled embeddings (prompts in chunks of
    16 tokens, all submitted at once with a generating request beside them), normalized, are sentence-transformers'
    own (float32, cosine >= 0.9999 and within 1e-4)."""
    directory = make_tiny_model(tmp_path / "tiny", "llama", demo_tokenizer_dir, initializer_range=0.2)
    with_sentence_transformers_config(directory, mode)
    engine = Engine(
        lambda: load_model(str(directory), resolve_placement("cpu", "float32")),
        engine_config(max_batch=8, prefill_chunk=16),
    )
    try:
        assert engine.loaded.pooling.mode == mode and engine.loaded.pooling.normalize
        requests = [Request(engine.model.tokenize(text), max_tokens=0, embed=True) for text in TEXTS]
        streams: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(len(TEXTS) + 1)]
        for request, events in zip(
            [*requests, Request(engine.model.tokenize(TEXTS[0]), max_tokens=6)], streams, strict=True
        ):
            engine.submit(request, events.put)  # all at once: their chunks share forwards
        vectors = []
        for events in streams[:-1]:
            while not isinstance(event := events.get(timeout=60), Embedding):
                pass
            vectors.append(event.values)
    finally:
        engine.close()
    ours = np.stack([finished(np.asarray(v, dtype=np.float32), True) for v in vectors])
    assert_equal_embeddings(ours, sentence_transformers_embeddings(directory, TEXTS))


@pytest.fixture
def tiny_bert(tmp_path: Path) -> Path:
    """A tiny BERT with sentence-transformers' mean pooling and Normalize."""
    return with_sentence_transformers_config(make_tiny_bert(tmp_path / "bert"), "mean")


def sentence_transformers_embeddings(directory: Path, texts: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(directory), device="cpu").encode(texts, batch_size=2)


def assert_equal_embeddings(ours: np.ndarray, theirs: np.ndarray) -> None:
    cosine = (ours * theirs).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)
    assert cosine.min() >= 0.9999 and np.abs(ours - theirs).max() < 1e-4, (cosine, np.abs(ours - theirs).max())


def test_an_encoder_embeds_whole_inputs(tiny_bert: Path) -> None:
    """The engine on a tiny BERT (float32, CPU) with prompt chunks of 16 tokens: inputs of up to 90 tokens, submitted
    at once, each run whole in one forward (an encoder's attention reads all of it) and batched with others where
    they fit a round, give sentence-transformers' embeddings; a generating request is refused, naming the encoder."""
    engine = Engine(
        lambda: load_model(str(tiny_bert), resolve_placement("cpu", "float32")),
        engine_config(max_batch=8, prefill_chunk=16),
    )
    try:
        assert engine.loaded.info.encoder and engine.loaded.pooling.mode == "mean"
        streams: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(4)]
        for text, events in zip(TEXTS[:3], streams, strict=False):
            engine.submit(Request(engine.model.tokenize(text), max_tokens=0, embed=True), events.put)
        engine.submit(Request(engine.model.tokenize(TEXTS[1]), max_tokens=2), streams[3].put)
        vectors = []
        for events in streams[:3]:
            while not isinstance(event := events.get(timeout=60), Embedding):
                assert not isinstance(event, Error), event
            vectors.append(finished(np.asarray(event.values, dtype=np.float32), True))
        refusal = streams[3].get(timeout=60)
    finally:
        engine.close()
    assert isinstance(refusal, Error) and "encoder" in refusal.message, refusal
    assert_equal_embeddings(np.stack(vectors), sentence_transformers_embeddings(tiny_bert, TEXTS[:3]))


def test_a_served_encoder_embeds_and_refuses_to_generate(tmp_path: Path, tiny_bert: Path) -> None:
    """`serve` on the tiny BERT: the OpenAI client's embeddings are sentence-transformers'; a completion is a 400
    that says the model is an encoder."""
    flags = ("--model", str(tiny_bert), "--dtype", "float32", "--max-batch", "4")
    with running(tmp_path, *flags, fork=True) as worker:
        client = openai.OpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0, timeout=60)
        batch = client.embeddings.create(model="bert", input=TEXTS[:3], encoding_format="float")
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model="bert", prompt="bees", max_tokens=2)
    assert "encoder" in refused.value.body["message"], refused.value.body
    ours = np.array([d.embedding for d in batch.data], dtype=np.float32)
    assert_equal_embeddings(ours, sentence_transformers_embeddings(tiny_bert, TEXTS[:3]))


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
