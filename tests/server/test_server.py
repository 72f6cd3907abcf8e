"""`rbee-worker serve` end to end: a real server process on 127.0.0.1 with the demo model, driven over real sockets.

Most tests send requests to the session's shared worker of each runtime (conftest.SharedWorkers: default flags, a
bearer token): each start costs several seconds on a small CPU machine. The pool-manager tests start their own workers
against a real HTTP server in a thread that records what the worker sends. Request validation itself is unit-tested in
test_validation.py; here only its wiring into HTTP is checked.
"""

import json
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import AUTH, RUNTIMES, SHARED_TOKEN, SharedWorkers, cli, default_runtime
from serving import (
    DEMO_NAME,
    EOS_PROMPT,
    LONG,
    PROMPT,
    Manager,
    Stream,
    Worker,
    check_shape,
    error_lines,
    execute,
    free_port,
    launch,
    read_rest,
    sse_events,
    take_tokens,
)

from rbee_worker.hardware.cpu_features import cpu_features
from rbee_worker.loading.gguf.llama_cpp_model import llama_cpp_installed

pytestmark = pytest.mark.slow

HEALTH_KEYS = {
    "status",
    "state",
    "worker_id",
    "model",
    "device",
    "devices",
    "dtype",
    "vram_bytes",
    "memory_bytes",
    "slots_total",
    "slots_busy",
    "kv_cache_usage_perc",
    "cpu",
    "weight_bytes",
    "active_weight_bytes",
    "kv_cache_bytes",
    "prompt_cache_bytes",
    "runtime",
}
READY_KEYS = {
    "worker_id", "model_ref", "uri", "url", "vram_bytes", "memory_bytes", "backend", "device", "devices", "runtime",
    "cpu", "weight_bytes", "active_weight_bytes",
}  # fmt: skip
BEAT_KEYS = {"worker_id", "timestamp", "health_status", "state"}
CANCEL_LATENCY_S = 1.0  # the brief's bound for "the stream ends / the slot is free after a cancel"


@pytest.fixture(scope="module", params=RUNTIMES)
def runtime(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def server(shared_workers: SharedWorkers, runtime: str) -> Worker:
    """The session's shared worker of this runtime: default flags (--worker-id, --model-ref), LLORCH_API_TOKEN set."""
    return shared_workers.get(runtime)


@pytest.fixture(scope="module")
def client(server: Worker) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60, headers=AUTH) as http:
        yield http


@pytest.fixture(scope="module")
def reference(runtime: str) -> dict[str, Any]:
    """`rbee-worker generate --json`, greedy, 64 tokens of PROMPT on the server's runtime: what the server must stream
    for the same request."""
    result = cli(
        "generate", "--model", "demo", "--runtime", runtime, "--prompt", PROMPT, "--max-tokens", "64",
        "--temperature", "0", "--json", fork=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["stop_reason"] == "MAX_TOKENS"  # else PROMPT no longer gives 64 tokens and the tests below weaken
    return summary


def assert_idle_soon(client: httpx.Client, since: float) -> None:
    """/health reports idle within CANCEL_LATENCY_S of `since` (the cancel); else the slot was never freed."""
    while True:
        body = client.get("/health").json()
        if body["state"] == "idle":
            break
        assert time.perf_counter() - since < CANCEL_LATENCY_S, f"still {body['state']} after the cancel"
        time.sleep(0.02)


def assert_serves_normally(client: httpx.Client) -> None:
    stream = execute(client, prompt=PROMPT, max_tokens=4, temperature=0)
    assert stream.terminal["type"] == "end" and stream.terminal["tokens_out"] == 4, stream.events


def start_long_job(client: httpx.Client, stack: list[httpx.Response], job_id: str) -> httpx.Response:
    """Open /execute for a job that runs far longer than any test; the caller cancels it."""
    response = client.send(
        client.build_request(
            "POST", "/execute", json={"job_id": job_id, "prompt": PROMPT, "max_tokens": LONG, "temperature": 0}
        ),
        stream=True,
    )
    stack.append(response)
    assert response.status_code == 200, response.read()
    return response


@pytest.fixture
def open_responses() -> Iterator[list[httpx.Response]]:
    """Streamed responses a test opened; closed at the end even when it fails (closing cancels their jobs)."""
    responses: list[httpx.Response] = []
    yield responses
    for response in responses:
        response.close()


# --- health and readiness ---------------------------------------------------------------------------------------------


def test_health_reports_loading_then_healthy(
    server: Worker, client: httpx.Client, runtime: str, shared_workers: SharedWorkers
) -> None:
    # Loading the demo model takes about a second here and the poll runs every 20 ms: a 503 was always seen.
    assert server.loading_bodies, "never saw 503 while the model loaded: the port only answered once it was ready"
    for body in server.loading_bodies:
        assert body["status"] == "loading", body
    response = client.get("/health")
    assert response.status_code == 200
    assert set(response.json()) == HEALTH_KEYS, response.json()
    assert response.json()["status"] == "healthy" and response.json()["state"] == "idle"
    # The rest as the worker reported it right after it became healthy (the shared worker has served other tests
    # since): nothing busy, no KV cache used, and on torch only the scratch block touched.
    body = shared_workers.first_health[runtime]
    assert set(body) == HEALTH_KEYS, body
    assert body["status"] == "healthy" and body["state"] == "idle"
    assert (body["slots_busy"], body["kv_cache_usage_perc"]) == (0, 0) and body["slots_total"] == 16  # the default
    assert body["worker_id"] == f"{socket.gethostname()}-{server.port}"  # the default: <host name>-<port>
    assert body["cpu"] == cpu_features().describe()  # the worker's environment is this process's
    assert body["model"] == DEMO_NAME  # the default --model-ref: the model's own name, not "demo"
    assert (body["device"], body["vram_bytes"]) == ("cpu", 0)  # no VRAM off a GPU (the contract's field)
    # torch: the placement's dtype (float32 on a CPU without native bf16); llama.cpp computes in float32 on a CPU.
    assert body["dtype"] in {"torch": ("float32", "bfloat16"), "llama.cpp": ("float32",)}[runtime]
    assert body["runtime"] == runtime
    # Measured weights: the Q4_1 file's matrices held as they are (--quantize auto, or llama.cpp's own figure), about
    # 95 MB; dequantized to bfloat16 they would take about 270 MB. The KV cache: on torch the part touched so far (the
    # scratch block of 16 positions), on llama.cpp all of it, allocated at start: --max-batch 16 whole contexts of the
    # demo's 8192 tokens at 23040 bytes each (F16).
    assert 80_000_000 < body["weight_bytes"] < 150_000_000
    torch_block = 16 * 30 * 3 * 64 * 2 * (4 if body["dtype"] == "float32" else 2)
    assert body["kv_cache_bytes"] == {"torch": torch_block, "llama.cpp": 16 * 8192 * 23040}[runtime]
    assert body["memory_bytes"] == body["weight_bytes"] + body["kv_cache_bytes"]
    assert body["active_weight_bytes"] == body["weight_bytes"]  # a dense model: a token reads every weight


def test_ready(client: httpx.Client) -> None:
    response = client.get("/v1/ready")
    assert response.status_code == 200
    assert response.json() == {"ready": True, "state": "idle", "model_loaded": True}


# --- request validation over HTTP ------------------------------------------------------------------------------------


def test_invalid_execute_gets_400_with_every_error_in_table_order(client: httpx.Client) -> None:
    # No job_id (required on /execute), and four more fields wrong: all reported at once, in the table's order.
    body = {"prompt": "", "max_tokens": 0, "temperature": 3, "stop": ["", "ok"], "unknown_field": 1}
    response = client.post("/execute", json=body)
    assert response.status_code == 400
    assert response.headers["content-type"].startswith("application/json")
    errors = response.json()["errors"]
    assert [(e["field"], e["constraint"]) for e in errors] == [
        ("job_id", "required"),
        ("prompt", "length(1..=32768)"),
        ("max_tokens", "range(1..=2048)"),
        ("temperature", "range(0.0..=2.0)"),
        ("stop[0]", "non_empty"),
    ]
    assert errors[2]["value"] == "0" and errors[2]["message"]
    assert client.get("/health").json()["state"] == "idle"  # nothing was started


def test_invalid_job_api_request_gets_400(client: httpx.Client) -> None:
    # job_id is optional here, so only top_p is wrong.
    response = client.post("/v1/inference", json={"prompt": PROMPT, "top_p": 1.5})
    assert response.status_code == 400
    assert [(e["field"], e["constraint"]) for e in response.json()["errors"]] == [("top_p", "range(0.0..=1.0)")]


@pytest.mark.parametrize("path", ["/execute", "/v1/inference"])
def test_malformed_json_gets_400_body_json(client: httpx.Client, path: str) -> None:
    response = client.post(path, content=b'{"job_id": "x", "prompt": ', headers={"content-type": "application/json"})
    assert response.status_code == 400
    [error] = response.json()["errors"]
    assert (error["field"], error["constraint"]) == ("body", "json")


# --- generation over /execute -----------------------------------------------------------------------------------------


def test_greedy_stream_equals_generate_and_arrives_incrementally(
    client: httpx.Client, reference: dict[str, Any]
) -> None:
    job_id = "greedy-" + uuid.uuid4().hex
    with client.stream(
        "POST", "/execute", json={"job_id": job_id, "prompt": PROMPT, "max_tokens": 64, "temperature": 0}
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        stream = read_rest(response)
    check_shape(stream, job_id, done_marker=False)
    assert stream.events[0]["model"] == DEMO_NAME
    assert stream.text == reference["text"]
    end = stream.terminal
    keys = {"type", "tokens_out", "prompt_tokens", "cached_tokens", "decode_time_ms", "stop_reason", "seed"}
    assert set(end) == keys, end
    assert end["type"] == "end" and end["stop_reason"] == "MAX_TOKENS"
    assert end["tokens_out"] == reference["tokens_out"] == 64
    assert end["prompt_tokens"] == reference["prompt_tokens"]
    assert end["decode_time_ms"] > 0 and isinstance(end["seed"], int)
    # 64 tokens take seconds here: a server that buffered the whole answer would deliver every token at once.
    token_times = [
        at for at, e in zip(stream.times, stream.events, strict=True) if isinstance(e, dict) and e["type"] == "token"
    ]
    assert token_times[-1] - token_times[0] > 0.3


def test_eos_stop_reason(client: httpx.Client) -> None:
    stream = execute(client, prompt=EOS_PROMPT, max_tokens=64, temperature=0)
    end = stream.terminal
    assert end["stop_reason"] == "EOS", stream.events
    assert 0 < end["tokens_out"] < 64
    assert "<|im_end|>" not in stream.text  # the EOS token is neither counted nor sent as text


def test_stop_sequence_ends_text_right_before_it(client: httpx.Client, reference: dict[str, Any]) -> None:
    text = reference["text"]
    # A slice from the middle of the greedy text: it may start and end inside tokens, so the worker has to hold back
    # text that might be the beginning of the stop string.
    stop = text[len(text) // 2 : len(text) // 2 + 10]
    assert stop.strip(), text
    expected = text[: text.index(stop)]
    stream = execute(client, prompt=PROMPT, max_tokens=64, temperature=0, stop=["never appears", stop])
    end = stream.terminal
    assert end["stop_reason"] == "STOP_SEQUENCE", stream.events
    assert end["stop_sequence_matched"] == stop
    assert stream.text == expected
    assert end["tokens_out"] < reference["tokens_out"]


def test_seed_replays_the_same_sample(client: httpx.Client) -> None:
    def sample(seed: int | None) -> tuple[str, int]:
        stream = execute(client, prompt=PROMPT, max_tokens=24, temperature=0.8, seed=seed)
        return stream.text, stream.terminal["seed"]

    first, second, other = sample(1234), sample(1234), sample(4321)
    assert first == second and first[1] == 1234
    assert other[0] != first[0]  # the seed is really used (otherwise the replay above proves nothing)
    _, random_a = sample(None)
    _, random_b = sample(None)
    assert random_a != random_b  # no seed: a fresh random one each time, reported so it can be replayed


def test_running_job_id_gets_409(client: httpx.Client, open_responses: list[httpx.Response]) -> None:
    response = start_long_job(client, open_responses, "dup-job")
    events = sse_events(response)  # kept: a discarded generator would close the connection (and cancel the job)
    take_tokens(events, 1)
    for path in ("/execute", "/v1/inference"):
        duplicate = client.post(path, json={"job_id": "dup-job", "prompt": PROMPT, "max_tokens": 4})
        assert duplicate.status_code == 409, (path, duplicate.text)
        [error] = duplicate.json()["errors"]
        assert (error["field"], error["constraint"]) == ("job_id", "unique")
    assert next(events)[1]["type"] == "token"  # the first job was not disturbed by the refused duplicates
    response.close()
    assert_idle_soon(client, time.perf_counter())


# --- the job API ------------------------------------------------------------------------------------------------------


def test_job_api_streams_the_same_events_then_done(client: httpx.Client, reference: dict[str, Any]) -> None:
    created = client.post(
        "/v1/inference", json={"job_id": "given-id", "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    )
    assert created.status_code == 200
    assert created.json() == {"job_id": "given-id", "sse_url": "/v1/inference/given-id/stream"}
    with client.stream("GET", "/v1/inference/given-id/stream") as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        stream = read_rest(response)
    check_shape(stream, "given-id", done_marker=True)
    end = stream.terminal
    assert end["type"] == "end" and end["stop_reason"] == "MAX_TOKENS" and end["tokens_out"] == 16
    assert reference["text"].startswith(stream.text) and stream.text  # greedy: the first 16 of the 64 tokens
    # The job is gone once read.
    assert client.get("/v1/inference/given-id/stream").status_code == 404


def test_job_api_generates_a_job_id_when_absent(client: httpx.Client) -> None:
    created = client.post("/v1/inference", json={"prompt": PROMPT, "max_tokens": 2})
    assert created.status_code == 200
    job_id = created.json()["job_id"]
    assert isinstance(job_id, str) and job_id
    assert created.json()["sse_url"] == f"/v1/inference/{job_id}/stream"
    with client.stream("GET", created.json()["sse_url"]) as response:
        stream = read_rest(response)
    check_shape(stream, job_id, done_marker=True)
    # A second job gets another id.
    again = client.post("/v1/inference", json={"prompt": PROMPT, "max_tokens": 1}).json()
    assert again["job_id"] != job_id
    with client.stream("GET", again["sse_url"]) as response:
        assert read_rest(response).events[-1] == "[DONE]"


def test_job_api_unknown_job_is_404(client: httpx.Client) -> None:
    response = client.get(f"/v1/inference/{uuid.uuid4().hex}/stream")
    assert response.status_code == 404
    assert response.json()["error"]["code"]  # every error body is JSON


# --- cancellation -----------------------------------------------------------------------------------------------------


def test_second_reader_409_and_delete_cancels(client: httpx.Client, open_responses: list[httpx.Response]) -> None:
    job_id = "job-" + uuid.uuid4().hex
    created = client.post(
        "/v1/inference", json={"job_id": job_id, "prompt": PROMPT, "max_tokens": LONG, "temperature": 0}
    )
    assert created.status_code == 200
    reader = client.send(client.build_request("GET", created.json()["sse_url"]), stream=True)
    open_responses.append(reader)
    assert reader.status_code == 200
    events = sse_events(reader)
    before = take_tokens(events, 3)

    assert client.get(created.json()["sse_url"]).status_code == 409  # one reader per job

    cancelled_at = time.perf_counter()
    assert client.delete(f"/v1/inference/{job_id}").status_code == 204
    rest = read_rest(reader, events)
    stream = Stream(before + rest.events, [0.0] * len(before) + rest.times)
    check_shape(stream, job_id, done_marker=True)
    assert stream.terminal["type"] == "error" and stream.terminal["code"] == "CANCELLED", stream.terminal
    assert stream.terminal["message"]
    terminal_at = rest.times[rest.events.index(stream.terminal)]
    assert terminal_at - cancelled_at < CANCEL_LATENCY_S
    assert len(stream.tokens) < 200  # it stopped rather than running on
    assert_idle_soon(client, cancelled_at)
    assert_serves_normally(client)


def test_post_cancel_ends_execute_stream(client: httpx.Client, open_responses: list[httpx.Response]) -> None:
    job_id = "exec-" + uuid.uuid4().hex
    response = start_long_job(client, open_responses, job_id)
    events = sse_events(response)
    before = take_tokens(events, 3)
    cancelled_at = time.perf_counter()
    assert client.post("/cancel", json={"job_id": job_id}).status_code == 202
    rest = read_rest(response, events)
    stream = Stream(before + rest.events, [0.0] * len(before) + rest.times)
    check_shape(stream, job_id, done_marker=False)  # /execute: no [DONE]
    assert stream.terminal["type"] == "error" and stream.terminal["code"] == "CANCELLED", stream.terminal
    assert rest.times[-1] - cancelled_at < CANCEL_LATENCY_S
    assert_idle_soon(client, cancelled_at)
    assert_serves_normally(client)


def test_client_disconnect_cancels_its_job(client: httpx.Client, open_responses: list[httpx.Response]) -> None:
    response = start_long_job(client, open_responses, "leaver-" + uuid.uuid4().hex)
    events = sse_events(response)  # kept: a discarded generator would close the connection (and cancel the job)
    take_tokens(events, 3)
    assert client.get("/health").json()["state"] == "busy"
    assert client.get("/v1/ready").json()["state"] == "busy"
    left_at = time.perf_counter()
    response.close()  # mid-stream: the connection goes away
    assert_idle_soon(client, left_at)
    assert_serves_normally(client)


def test_cancel_of_unknown_or_finished_job_is_idempotent(client: httpx.Client) -> None:
    finished = execute(client, prompt=PROMPT, max_tokens=1, temperature=0).events[0]["job_id"]
    for job_id in (uuid.uuid4().hex, finished):
        assert client.delete(f"/v1/inference/{job_id}").status_code == 204
        assert client.post("/cancel", json={"job_id": job_id}).status_code == 202
    assert client.get("/health").json()["state"] == "idle"
    assert_serves_normally(client)


# --- startup failures -------------------------------------------------------------------------------------------------


def test_port_in_use_exits_3_before_loading(server: Worker) -> None:
    started = time.monotonic()
    result = cli("serve", "--model", "demo", "--port", str(server.port), timeout=60)
    elapsed = time.monotonic() - started
    assert result.returncode == 3, result.stderr
    [line] = error_lines(result.stderr)
    assert str(server.port) in line, line
    assert "Traceback" not in result.stderr
    # Imports take ~5 s on this machine; a worker that loaded the model (or waited on anything) first would take longer.
    assert elapsed < 30
    assert httpx.get(f"{server.url}/health").status_code == 200  # the worker on that port is untouched


# --- pool manager -----------------------------------------------------------------------------------------------------


ManagerFactory = Callable[[list[int]], Manager]


@pytest.fixture
def manager_factory() -> Iterator[ManagerFactory]:
    managers: list[Manager] = []

    def make(ready_statuses: list[int]) -> Manager:
        managers.append(Manager(ready_statuses))
        return managers[-1]

    yield make
    for manager in managers:
        manager.close()


def test_ready_callback_retried_then_heartbeats(tmp_path: Path, manager_factory: ManagerFactory) -> None:
    manager = manager_factory([503, 503, 200])
    worker = launch(
        tmp_path,
        "--worker-id", "worker-under-test",
        "--model-ref", "hf:HuggingFaceTB/SmolLM2-135M-Instruct",
        "--callback-url", f"{manager.url}/ready",
        "--heartbeat-url", f"{manager.url}/heartbeat",
        "--heartbeat-interval", "0.5",
        fork=True,
    )  # fmt: skip
    try:
        worker.wait_healthy()
        healthy_at = time.perf_counter()
        # Backoff 0.5 s then 1 s: the third attempt is accepted about 1.5 s after the first.
        ready = manager.wait_for("/ready", 3, timeout=30)
        assert len(ready) == 3, worker.stderr()
        assert healthy_at < ready[-1].at  # it served while the pool manager still said 503
        for attempt in ready:
            assert set(attempt.body) == READY_KEYS, attempt.body
        body = ready[-1].body
        assert body["worker_id"] == "worker-under-test"
        assert body["model_ref"] == "hf:HuggingFaceTB/SmolLM2-135M-Instruct"
        assert body["uri"] == body["url"] == worker.url
        assert body["cpu"] == cpu_features().describe()
        # The demo's quantized weights as held and its KV cache (see test_health_reports_loading_then_healthy).
        health = httpx.get(f"{worker.url}/health").json()
        assert body["memory_bytes"] == health["weight_bytes"] + health["kv_cache_bytes"] and body["vram_bytes"] == 0
        assert body["weight_bytes"] == body["active_weight_bytes"] == health["weight_bytes"]
        # --runtime auto: a GGUF file on the CPU runs on llama.cpp where llama-cpp-python is installed.
        assert body["runtime"] == health["runtime"] == ("llama.cpp" if llama_cpp_installed() else "torch")
        assert body["backend"] == "cpu" and body["device"] == "cpu"

        # Heartbeats start once registered; at 0.5 s a 2 s window holds 4 or 5 of them.
        [first] = manager.wait_for("/heartbeat", 1, timeout=10)[:1]
        time.sleep(max(0.0, first.at + 2.0 - time.perf_counter()) + 0.05)
        beats = [b for b in manager.recorded("/heartbeat") if b.at <= first.at + 2.0]
        assert len(beats) >= 3, [b.at - first.at for b in beats]
        assert first.at >= ready[-1].at  # not before the pool manager knows the worker
        for beat in beats:
            assert set(beat.body) == BEAT_KEYS, beat.body
            assert beat.body["worker_id"] == "worker-under-test"
            assert beat.body["health_status"] == "healthy" and beat.body["state"] == "idle"
            assert datetime.fromisoformat(beat.body["timestamp"]).tzinfo is not None

        # --worker-id and --model-ref are what /health and the stream report; the worker kept serving throughout.
        with httpx.Client(base_url=worker.url, timeout=60) as http:
            health = http.get("/health").json()
            assert (health["worker_id"], health["model"]) == (
                "worker-under-test",
                "hf:HuggingFaceTB/SmolLM2-135M-Instruct",
            )
            # A running job shows in the beats as busy.
            with http.stream(
                "POST", "/execute", json={"job_id": "hb", "prompt": PROMPT, "max_tokens": LONG, "temperature": 0}
            ) as response:
                events = sse_events(response)
                started = next(events)[1]
                assert started["model"] == "hf:HuggingFaceTB/SmolLM2-135M-Instruct"
                busy_since = time.perf_counter()
                while time.perf_counter() - busy_since < 1.2:
                    next(events)
            busy = [b for b in manager.recorded("/heartbeat") if busy_since + 0.1 < b.at < busy_since + 1.1]
            assert busy and all(b.body["state"] == "busy" for b in busy), [(b.at - busy_since, b.body) for b in busy]
        assert len(manager.recorded("/ready")) == 3  # registered once, never again
    finally:
        code = worker.stop()
    assert code == 0, worker.stderr()


def test_ready_callback_refused_exits_3(tmp_path: Path, manager_factory: ManagerFactory) -> None:
    manager = manager_factory([400])
    worker = launch(tmp_path, "--callback-url", f"{manager.url}/ready", fork=True)
    try:
        code = worker.process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        worker.stop()
    assert code == 3, f"exit code {code}:\n{worker.stderr()}"
    [line] = error_lines(worker.stderr())
    assert "400" in line, line
    assert "Traceback" not in worker.stderr()
    assert len(manager.recorded("/ready")) == 1  # a 4xx is final: no retry


def test_absent_pool_manager_is_retried_until_the_callback_timeout_then_exit_3() -> None:
    """Nothing listens at the callback URL: the worker loads, retries with backoff for --callback-timeout seconds,
    then exits 3 with one line naming the URL."""
    url = f"http://127.0.0.1:{free_port()}/ready"
    started = time.monotonic()
    result = cli("serve", "--port", "0", "--callback-url", url, "--callback-timeout", "3", timeout=120, fork=True)
    elapsed = time.monotonic() - started
    assert result.returncode == 3, result.stderr
    [line] = error_lines(result.stderr)
    assert url in line, line
    assert elapsed >= 3  # it kept trying for the whole timeout rather than giving up at the first refusal


# -- auth and tracing ------------------------------------------------------------------------------------------------


def test_bearer_auth_and_correlation_ids(shared_workers: SharedWorkers) -> None:
    """On the shared worker of the default runtime, which runs with LLORCH_API_TOKEN set."""
    token = SHARED_TOKEN
    worker = shared_workers.get(default_runtime())
    assert httpx.get(f"{worker.url}/health").status_code == 200  # /health needs no token
    with httpx.Client(base_url=worker.url, timeout=60) as http:
        missing = http.get("/v1/ready")
        wrong = http.get("/v1/ready", headers={"Authorization": "Bearer nope"})
        basic = http.post("/cancel", json={"job_id": "x"}, headers={"Authorization": f"Basic {token}"})
        right = http.get("/v1/ready", headers={"Authorization": f"Bearer {token}"})
        assert (missing.status_code, missing.json()["error"]["code"]) == (401, "MISSING_API_KEY")
        assert (wrong.status_code, wrong.json()["error"]["code"]) == (401, "INVALID_API_KEY")
        assert (basic.status_code, basic.json()["error"]["code"]) == (401, "MISSING_API_KEY")
        assert right.status_code == 200 and right.json()["ready"] is True
        streamed = http.post(
            "/execute",
            json={"job_id": uuid.uuid4().hex, "prompt": PROMPT, "max_tokens": 3, "temperature": 0},
            headers={"Authorization": f"Bearer {token}"},
        )
        events = [json.loads(line.removeprefix("data: ")) for line in streamed.text.splitlines() if line]
        assert streamed.status_code == 200 and events[-1]["type"] == "end"

        given = str(uuid.uuid4()).upper()
        echoed = http.get("/health", headers={"X-Correlation-ID": given})
        assert echoed.headers["X-Correlation-ID"] == given
        for bad in ("not-a-uuid", ""):
            fresh = http.get("/health", headers={"X-Correlation-ID": bad}).headers["X-Correlation-ID"]
            assert fresh != bad and uuid.UUID(fresh)
        assert uuid.UUID(missing.headers["X-Correlation-ID"])  # also on refusals


def test_non_loopback_host_needs_a_token() -> None:
    result = cli("serve", "--host", "0.0.0.0", "--port", str(free_port()), env={"LLORCH_API_TOKEN": ""})
    assert result.returncode == 2
    assert error_lines(result.stderr) == result.stderr.strip().splitlines()
    assert "LLORCH_API_TOKEN" in result.stderr
