"""The OpenAI-compatible API through the official `openai` client, against a real worker process with the demo model
(the session's shared worker of each runtime, conftest.SharedWorkers, with LLORCH_API_TOKEN set: the client's api_key
is the bearer token); /tokenize, /detokenize and /metrics over HTTP."""

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from conftest import AUTH, RUNTIMES, SHARED_TOKEN, SharedWorkers, cli
from prometheus_client.parser import text_string_to_metric_families
from serving import DEMO_NAME, EOS_PROMPT, PROMPT, Worker, running

pytestmark = pytest.mark.slow

TOKEN = SHARED_TOKEN
QUESTION = [{"role": "user", "content": "Name three colors."}]
BLOCK_SIZE = 16  # --block-size's default: the prefix cache finds whole blocks


@pytest.fixture(scope="module", params=RUNTIMES)
def runtime(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def worker(shared_workers: SharedWorkers, runtime: str) -> Worker:
    return shared_workers.get(runtime)


@pytest.fixture(scope="module")
def client(worker: Worker) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{worker.url}/v1", api_key=TOKEN, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(worker: Worker) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=worker.url, timeout=120, headers=AUTH) as client:
        yield client


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    """The name reported first (the model's own), then MODEL as given on the command line."""
    models = client.models.list().data
    assert [model.id for model in models] == [DEMO_NAME, "demo"]
    assert all(model.object == "model" and model.model_extra["max_model_len"] == 8192 for model in models)


def test_chat_streamed_equals_non_streamed_with_usage(client: openai.OpenAI, http: httpx.Client) -> None:
    full = client.chat.completions.create(model=DEMO_NAME, messages=QUESTION, temperature=0, max_tokens=40)
    [choice] = full.choices
    assert choice.message.role == "assistant" and choice.message.content
    prompt_tokens = http.post("/tokenize", json={"messages": QUESTION}).json()["count"]
    assert full.usage.prompt_tokens == prompt_tokens
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    assert choice.finish_reason == ("length" if full.usage.completion_tokens == 40 else "stop")

    chunks = list(
        client.chat.completions.create(
            model=DEMO_NAME,
            messages=QUESTION,
            temperature=0,
            max_tokens=40,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    *content_chunks, usage_chunk = chunks
    # The same prompt again: its leading whole blocks may come from the prefix cache this time (on llama.cpp, whose
    # own cache is not made of blocks, all of it but the last token).
    assert usage_chunk.choices == [] and usage_chunk.usage.model_dump(exclude={"prompt_tokens_details"}) == (
        full.usage.model_dump(exclude={"prompt_tokens_details"})
    )
    cached = usage_chunk.usage.prompt_tokens_details.cached_tokens
    assert 0 <= cached < prompt_tokens and (cached % BLOCK_SIZE == 0 or cached == prompt_tokens - 1)
    assert full.usage.prompt_tokens_details.cached_tokens <= cached
    assert all(c.usage is None for c in content_chunks)
    assert "".join(c.choices[0].delta.content or "" for c in content_chunks) == choice.message.content
    assert [c.choices[0].finish_reason for c in content_chunks][-1] == choice.finish_reason
    assert all(c.choices[0].finish_reason is None for c in content_chunks[:-1])
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")


def test_completions_streamed_equals_non_streamed_and_finish_reasons(client: openai.OpenAI) -> None:
    full = client.completions.create(model=DEMO_NAME, prompt=PROMPT, temperature=0, max_tokens=24)
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 24
    streamed = list(
        client.completions.create(model=DEMO_NAME, prompt=PROMPT, temperature=0, max_tokens=24, stream=True)
    )
    assert "".join(c.choices[0].text for c in streamed) == full.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "length"
    # The demo model ends this chat turn by itself: EOS is "stop", and it is not counted.
    ended = client.completions.create(model=DEMO_NAME, prompt=EOS_PROMPT, temperature=0, max_tokens=64)
    assert ended.choices[0].finish_reason == "stop" and ended.usage.completion_tokens < 64
    assert "<|im_end|>" not in ended.choices[0].text


def test_stop_strings(client: openai.OpenAI) -> None:
    full = client.completions.create(model=DEMO_NAME, prompt=PROMPT, temperature=0, max_tokens=48).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 6]
    for stream in (False, True):
        response = client.completions.create(
            model=DEMO_NAME, prompt=PROMPT, temperature=0, max_tokens=48, stop=[stop], stream=stream
        )
        chunks = list(response) if stream else [response]
        text = "".join(c.choices[0].text for c in chunks)
        assert text == full[: full.index(stop)] and chunks[-1].choices[0].finish_reason == "stop"


def test_seed_replays_a_sample(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        return (
            client.chat.completions.create(
                model=DEMO_NAME, messages=QUESTION, temperature=1.0, top_p=0.95, seed=seed, max_tokens=24
            )
            .choices[0]
            .message.content
        )

    assert sample(7) == sample(7)
    assert len({sample(7), sample(8), sample(9)}) > 1  # the seed really picks the sample


def test_seed_gives_the_same_sample_in_another_worker_process(
    client: openai.OpenAI, tmp_path: Path, runtime: str
) -> None:
    """A request's draws depend on its seed (all 64 bits) and its token's index alone: a second worker process, with
    nothing else in common, samples the same text for the same seeded request."""

    def sample(other: openai.OpenAI) -> str:
        completion = other.chat.completions.create(
            model=DEMO_NAME, messages=QUESTION, temperature=0.7, top_p=0.9, seed=2**63 + 11, max_tokens=24
        )
        return completion.choices[0].message.content

    first = sample(client)
    with running(tmp_path, "--runtime", runtime, env={"LLORCH_API_TOKEN": TOKEN}, fork=True) as second:
        other = openai.OpenAI(base_url=f"{second.url}/v1", api_key=TOKEN, max_retries=0, timeout=120)
        assert sample(other) == first


def test_logprobs_shapes(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model=DEMO_NAME, messages=QUESTION, temperature=0, max_tokens=12, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert "".join(entry.token for entry in content) == chat.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        values = [top.logprob for top in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        # Greedy: the chosen token is a most likely one (bf16 logits tie often; ties may list another token first).
        assert entry.logprob == entry.top_logprobs[0].logprob
        assert entry.bytes == list(entry.token.encode())

    completion = client.completions.create(model=DEMO_NAME, prompt=PROMPT, temperature=0, max_tokens=8, logprobs=2)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 8
    assert all(len(top) == 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(8)]
    assert chat.choices[0].logprobs is not None
    plain = client.chat.completions.create(model=DEMO_NAME, messages=QUESTION, temperature=0, max_tokens=4)
    assert plain.choices[0].logprobs is None


def test_echo_scores_the_prompts_as_lm_eval_asks(client: openai.OpenAI, http: httpx.Client) -> None:
    """lm-eval's loglikelihood request: token-id prompts in a batch, echo, logprobs 1, max_tokens 0 or 1. Each choice
    is its prompt's text (then the token generated), the prompt's tokens, the first token's logprob null and the
    others' given the tokens before them; max_tokens 1 adds the greedy token a plain completion gives. vLLM's
    prompt_logprobs gives the same numbers; a streamed echo sends the prompt as its first chunk."""
    other = "Bees make honey from the nectar of flowers"
    ids = [http.post("/tokenize", json={"prompt": p}).json()["tokens"] for p in (PROMPT, other)]
    echo = {"model": DEMO_NAME, "prompt": ids, "echo": True, "logprobs": 1, "temperature": 0}
    scored = client.completions.create(**echo, max_tokens=0, extra_body={"prompt_logprobs": 0})
    assert [c.text for c in scored.choices] == [PROMPT, other] and scored.usage.completion_tokens == 0
    plain = client.completions.create(model=DEMO_NAME, prompt=ids, temperature=0, max_tokens=1, logprobs=1)
    continued = client.completions.create(**echo, max_tokens=1)
    for prompt, choice, one, longer in zip(ids, scored.choices, plain.choices, continued.choices, strict=True):
        logprobs = choice.logprobs
        assert choice.finish_reason == "length" and len(logprobs.tokens) == len(prompt)
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        assert all(lp < 0 for lp in logprobs.token_logprobs[1:]) and all(len(t) == 1 for t in logprobs.top_logprobs[1:])
        assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(len(prompt))]
        positions = choice.model_extra["prompt_logprobs"]
        assert positions[0] is None
        assert [p[str(t)]["logprob"] for p, t in zip(positions[1:], prompt[1:], strict=True)] == pytest.approx(
            logprobs.token_logprobs[1:], abs=1e-6
        )
        assert longer.text == choice.text + one.text
        # Across requests the numbers are the same only where the forwards are: the CPU's 4-bit products take another
        # kernel for fewer rows (dequant.CPU_DEQUANTIZE_ROWS), and a request's prompts share forwards with whatever
        # runs then (0.2 apart seen in CI). tests/engine/test_preemption.py holds float32 prompt logprobs to
        # transformers' within 1e-4, tests/engine/test_llama_cpp_runner.py llama.cpp's to llama-cpp-python's.
        assert longer.logprobs.tokens == [*logprobs.tokens, *one.logprobs.tokens]
        assert longer.logprobs.token_logprobs[0] is None and all(lp < 0 for lp in longer.logprobs.token_logprobs[1:])

    chunks = list(client.completions.create(model=DEMO_NAME, prompt=PROMPT, echo=True, logprobs=1, temperature=0,
                                            max_tokens=4, stream=True))  # fmt: skip
    assert chunks[0].choices[0].text == PROMPT and chunks[0].choices[0].logprobs.token_logprobs[0] is None
    whole = client.completions.create(model=DEMO_NAME, prompt=PROMPT, temperature=0, max_tokens=4)
    assert "".join(c.choices[0].text for c in chunks) == PROMPT + whole.choices[0].text


def test_logit_bias_bans_the_greedy_token_and_forces_another(client: openai.OpenAI, http: httpx.Client) -> None:
    """-100 on the greedy first token gives another first token (with a grammar-free sampled chat too); +100 on a
    token the model would not pick makes every token that one; a bad key is a 400 naming logit_bias."""
    greedy = {"model": DEMO_NAME, "prompt": PROMPT, "temperature": 0, "max_tokens": 3}
    first = http.post("/tokenize", json={"prompt": client.completions.create(**greedy).choices[0].text}).json()
    banned = client.completions.create(**greedy, logit_bias={str(first["tokens"][0]): -100}).choices[0].text
    assert http.post("/tokenize", json={"prompt": banned}).json()["tokens"][0] != first["tokens"][0]
    [forced] = http.post("/tokenize", json={"prompt": " banana"}).json()["tokens"]
    for kind in ("greedy", "sampled"):
        sampling = {"temperature": 0} if kind == "greedy" else {"temperature": 0.7, "top_p": 0.9, "seed": 3}
        chat = client.chat.completions.create(model=DEMO_NAME, messages=QUESTION, max_tokens=3,
                                              logit_bias={str(forced): 100}, **sampling)  # fmt: skip
        assert chat.choices[0].message.content == " banana" * 3, kind
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(**greedy, logit_bias={"bee": 1})
    assert caught.value.body["param"] == "logit_bias"


@pytest.mark.parametrize(
    ("params", "fragment"),
    [
        ({"temperature": 3}, "temperature"),
        ({"n": 0}, "n"),
        ({"max_tokens": 100_000}, "maximum context length"),
        ({"top_logprobs": 2}, "top_logprobs needs logprobs"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"tool_choice": "required"}, "tool_choice needs tools"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
    ],
)
def test_bad_parameters_raise_bad_request(client: openai.OpenAI, params: dict, fragment: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**{"model": DEMO_NAME, "messages": QUESTION, "max_tokens": 4, **params})
    error = caught.value.body
    assert fragment in error["message"], error
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "field",
    [
        {"prompt_logprobs": 1, "stream": True},
        {"suffix": "x"},
        {"best_of": 0},
        {"n": 200},
        {"logit_bias": {"1": 101}},
        {"best_of": 2, "n": 3},
    ],
    ids=str,
)
def test_a_refused_field_is_named_in_param(http: httpx.Client, field: dict) -> None:
    response = http.post("/v1/completions", json={"model": DEMO_NAME, "prompt": PROMPT, "max_tokens": 2, **field})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == next(iter(field))


def test_n_choices_each_drawn_on_its_own_seed(client: openai.OpenAI) -> None:
    """n=3, completions and chat, streamed and not: three choices indexed 0..2, each drawn with its own seed (seed +
    i), so they differ and a seeded request replays; the prompt counted once in the usage. (A choice's draws equal a
    one-choice request's with seed + i in --deterministic mode only: otherwise a batch's other rows change the logits'
    rounding, as for any concurrent requests.)"""
    sampled = {"temperature": 1.0, "max_tokens": 6, "seed": 11, "extra_body": {"ignore_eos": True}}
    many = client.completions.create(model=DEMO_NAME, prompt=PROMPT, n=3, **sampled)
    alone = client.completions.create(model=DEMO_NAME, prompt=PROMPT, **sampled)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert len({c.text for c in many.choices}) > 1  # the seeds draw differently
    assert [c.text for c in client.completions.create(model=DEMO_NAME, prompt=PROMPT, n=3, **sampled).choices] == [
        c.text for c in many.choices
    ]
    assert many.usage.prompt_tokens == alone.usage.prompt_tokens and many.usage.completion_tokens == 3 * 6
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(model=DEMO_NAME, prompt=PROMPT, n=3, stream=True, **sampled):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[i] for i in range(3)] == [c.text for c in many.choices]

    chat = client.chat.completions.create(model=DEMO_NAME, messages=QUESTION, n=3, **sampled)
    assert [c.index for c in chat.choices] == [0, 1, 2] and all(c.message.content for c in chat.choices)
    pieces: dict[int, str] = {}
    finished = set()
    chunks = list(
        client.chat.completions.create(
            model=DEMO_NAME, messages=QUESTION, n=3, stream=True, stream_options={"include_usage": True}, **sampled
        )
    )
    for chunk in chunks:
        for choice in chunk.choices:
            pieces[choice.index] = pieces.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1, 2} and [pieces[i] for i in range(3)] == [c.message.content for c in chat.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage == chat.usage


def test_batched_prompts_and_best_of(client: openai.OpenAI, http: httpx.Client) -> None:
    """A batch of prompts (texts, or token-id lists as lm-eval sends them): one choice per prompt, in order, the
    usage summed; best_of returns the n of its sequences with the highest sum of token logprobs."""
    other = "Once upon a time"
    one = [client.completions.create(model=DEMO_NAME, prompt=p, temperature=0, max_tokens=5) for p in (PROMPT, other)]
    batch = client.completions.create(model=DEMO_NAME, prompt=[PROMPT, other], temperature=0, max_tokens=5)
    assert [c.text for c in batch.choices] == [r.choices[0].text for r in one]
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.usage.prompt_tokens == sum(r.usage.prompt_tokens for r in one)
    ids = [http.post("/tokenize", json={"prompt": p}).json()["tokens"] for p in (PROMPT, other)]
    by_ids = client.completions.create(model=DEMO_NAME, prompt=ids, temperature=0, max_tokens=5)
    assert [c.text for c in by_ids.choices] == [c.text for c in batch.choices]

    sampled = {"temperature": 1.0, "max_tokens": 6, "seed": 5, "logprobs": 0}
    drawn = client.completions.create(model=DEMO_NAME, prompt=PROMPT, n=4, **sampled)
    best = client.completions.create(model=DEMO_NAME, prompt=PROMPT, n=2, best_of=4, **sampled)
    ranked = sorted(drawn.choices, key=lambda c: sum(c.logprobs.token_logprobs), reverse=True)
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert [c.index for c in best.choices] == [0, 1]
    assert best.usage.completion_tokens == drawn.usage.completion_tokens  # every sequence drawn is counted
    plain = client.completions.create(model=DEMO_NAME, prompt=PROMPT, n=1, best_of=4, **{**sampled, "logprobs": None})
    assert plain.choices[0].text == ranked[0].text and plain.choices[0].logprobs is None


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=2)


def test_wrong_token_is_401(worker: Worker) -> None:
    wrong = openai.OpenAI(base_url=f"{worker.url}/v1", api_key="not-the-token", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def test_tokenize_detokenize_round_trip(http: httpx.Client) -> None:
    for text in ("Hello world", "naïve café, Grüße", "日本語のテキスト", "emoji 🎉👩‍👩‍👧 mixed ünïcödé"):
        tokens = http.post("/tokenize", json={"prompt": text}).json()
        assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] == 8192
        assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": text}
    bad = http.post("/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and "vocabulary" in bad.json()["error"]["message"]


@pytest.mark.parametrize("n", [1, 3])
def test_streaming_client_that_leaves_cancels_its_job(client: openai.OpenAI, http: httpx.Client, n: int) -> None:
    """Every choice's job (n of them) ends within a second of the client leaving mid-stream (after its choices'
    openings and two more chunks)."""
    stream = client.chat.completions.create(
        model=DEMO_NAME,
        messages=[{"role": "user", "content": "Tell a very long story."}],
        max_tokens=2000,
        stream=True,
        n=n,
    )
    for _, _ in zip(range(n + 2), stream, strict=False):
        pass
    stream.close()
    left = time.monotonic()
    while http.get("/health").json()["state"] != "idle":
        assert time.monotonic() - left < 1.0
        time.sleep(0.02)


def scrape(http: httpx.Client) -> dict[str, float]:
    """Every sample of /metrics by name and labels."""
    text = http.get("/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "le")
            if "le" in sample.labels:
                labels += f",le={sample.labels['le']}"
            samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples


def test_metrics_move_by_exactly_the_requests_made(client: openai.OpenAI, http: httpx.Client) -> None:
    while http.get("/health").json()["state"] != "idle":  # jobs of earlier tests still winding down
        time.sleep(0.05)
    before = scrape(http)
    lengths = [3, 5, 7]
    responses = [
        client.completions.create(model=DEMO_NAME, prompt=PROMPT, temperature=0, max_tokens=n) for n in lengths
    ]
    ended = client.completions.create(model=DEMO_NAME, prompt=EOS_PROMPT, temperature=0, max_tokens=64)
    after = scrape(http)

    def moved(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    prompt_tokens = sum(r.usage.prompt_tokens for r in [*responses, ended])
    generated = sum(lengths) + ended.usage.completion_tokens
    model = f"model_name={DEMO_NAME}"
    assert moved(f"rbee:prompt_tokens_total{{{model}}}") == prompt_tokens
    assert moved(f"rbee:generation_tokens_total{{{model}}}") == generated
    assert moved(f"rbee:request_success_total{{finished_reason=length,{model},stop_reason=MAX_TOKENS}}") == 3
    assert moved(f"rbee:request_success_total{{finished_reason=stop,{model},stop_reason=EOS}}") == 1
    assert moved(f"rbee:time_to_first_token_seconds_count{{{model}}}") == 4
    assert moved(f"rbee:e2e_request_latency_seconds_count{{{model}}}") == 4
    # One interval per sampled token after the first; the EOS token is sampled too.
    intervals = sum(n - 1 for n in lengths) + ended.usage.completion_tokens
    assert moved(f"rbee:inter_token_latency_seconds_count{{{model}}}") == intervals
    assert after[f"rbee:num_requests_running{{{model}}}"] == 0 and after[f"rbee:num_requests_waiting{{{model}}}"] == 0
    assert after[f"rbee:kv_cache_usage_perc{{{model}}}"] == 0
    # Every prompt is looked up in the prefix cache once.
    assert moved(f"rbee:prefix_cache_queries_total{{{model}}}") == prompt_tokens
    assert 0 <= moved(f"rbee:prefix_cache_hits_total{{{model}}}") <= prompt_tokens
    assert moved(f"rbee:num_preemptions_total{{{model}}}") == 0
    ttft_count = after[f"rbee:time_to_first_token_seconds_count{{{model}}}"]
    assert after[f"rbee:time_to_first_token_seconds_bucket{{{model},le=+Inf}}"] == ttft_count


@pytest.fixture(scope="module")
def gguf_reference(demo_gguf: Path):
    """transformers' own GGUF tokenizer of the demo file (seconds to build: once for the module)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_gguf.parent, gguf_file=demo_gguf.name)


def test_chat_template_matches_transformers(demo_gguf: Path, demo_hf_dir: Path, gguf_reference) -> None:
    """The prompt our loaders' tokenizers render equals transformers' apply_chat_template on the same model: from
    the HF directory, and from the GGUF file against transformers' own GGUF tokenizer."""
    from transformers import AutoTokenizer

    from rbee_worker.loading.gguf.gguf_format import read_gguf
    from rbee_worker.loading.gguf.gguf_tokenizer import build_tokenizer
    from rbee_worker.loading.hf import load_tokenizer

    conversations = [
        QUESTION,
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Again, with ünïcödé 🎉"},
        ],
    ]
    pairs = [
        (load_tokenizer(demo_hf_dir), AutoTokenizer.from_pretrained(demo_hf_dir)),
        (build_tokenizer(read_gguf(demo_gguf).metadata), gguf_reference),
    ]
    for ours, theirs in pairs:
        for messages in conversations:
            for generation_prompt in (True, False):
                assert ours.apply_chat_template(
                    messages, add_generation_prompt=generation_prompt, tokenize=False
                ) == theirs.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)


def test_max_completion_tokens_and_unknown_fields(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model=DEMO_NAME,
        messages=[{"role": "user", "content": "Tell a long story about the sea."}],
        temperature=0,
        max_completion_tokens=5,
        extra_body={"some_future_field": 1},  # ignored, as OpenAI-compatible servers do
    )
    assert chat.usage.completion_tokens == 5 and chat.choices[0].finish_reason == "length"


def test_non_streaming_client_that_leaves_cancels_its_job(worker: Worker, http: httpx.Client) -> None:
    body = {"model": DEMO_NAME, "prompt": PROMPT, "max_tokens": 2000, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json=body, timeout=1.5)
    left = time.monotonic()
    while http.get("/health").json()["state"] != "idle":
        assert time.monotonic() - left < 1.5  # noticed within the 0.25 s poll, then cancelled between two steps
        time.sleep(0.02)


def test_tokenized_chat_equals_transformers_on_the_gguf(http: httpx.Client, gguf_reference) -> None:
    """What the worker feeds the model for a chat equals transformers' own GGUF tokenizer + apply_chat_template."""
    reference = gguf_reference
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"}]
    rendered = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = reference(rendered, add_special_tokens=False)["input_ids"]
    assert http.post("/tokenize", json={"messages": messages}).json()["tokens"] == expected


def test_chat_template_override(tmp_path: Path) -> None:
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    template += "{% if add_generation_prompt %}[assistant] {% endif %}"
    with running(tmp_path, "--chat-template", template, fork=True) as worker, httpx.Client(base_url=worker.url) as http:
        tokens = http.post("/tokenize", json={"messages": QUESTION}).json()["tokens"]
        text = http.post("/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert text == "[user] Name three colors.\n[assistant] "


def test_invalid_chat_template_is_refused_at_start(tmp_path: Path) -> None:
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    result = cli("serve", "--chat-template", str(broken), "--port", "0", timeout=60, fork=True)
    assert result.returncode == 2
    [line] = result.stderr.splitlines()
    assert line.startswith("error: --chat-template is not a valid Jinja template"), line
