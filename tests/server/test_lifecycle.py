"""`rbee-worker serve` beyond single jobs, against real worker processes: loading progress, slot and queue limits,
drain on SIGTERM / SIGINT / POST /shutdown, stall detection, unclaimed jobs, --max-context, the advertised URL and the
per-job log line."""

import json
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import RUNTIMES, cli
from serving import (
    LONG,
    PROMPT,
    Manager,
    Stream,
    Worker,
    error_lines,
    execute,
    launch,
    read_rest,
    running,
    sse_events,
    take_tokens,
)

pytestmark = pytest.mark.slow

STALL_TIMEOUT_S = 0.2
UNCLAIMED_S = 1.0
MAX_CONTEXT = 512
# About 400 tokens: one prefill forward over it takes well over STALL_TIMEOUT_S on a CPU.
LONG_PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman. " * 23


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    """One worker with small limits, shared by the tests below that leave it idle. Not forked (serving.launch): its
    ready line's time counts the imports (test_ready_line_reports_the_time_from_the_process_start)."""
    with running(
        tmp_path_factory.mktemp("tuned"),
        "--max-batch", "2",
        "--max-queue", "1",
        "--stall-timeout", str(STALL_TIMEOUT_S),
        "--unclaimed-job-timeout", str(UNCLAIMED_S),
        "--max-context", str(MAX_CONTEXT),
        "--log-format", "json",
    ) as worker:  # fmt: skip
        yield worker


@pytest.fixture(scope="module")
def client(tuned: Worker) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=tuned.url, timeout=120) as http:
        yield http


def data_lines(response: httpx.Response) -> list[dict[str, Any] | str]:
    return [e for _, e in sse_events(response)]


# --- loading ----------------------------------------------------------------------------------------------------------


def test_loading_progress_counts_layers_then_ready(tmp_path: Path) -> None:
    worker = launch(tmp_path, fork=True)
    try:
        while True:  # until the port answers (imports done) while the model still loads
            assert worker.process.poll() is None, worker.stderr()
            try:
                ready = httpx.get(f"{worker.url}/v1/ready", timeout=5).json()
                break
            except httpx.TransportError:
                time.sleep(0.01)
        assert ready == {
            "ready": False,
            "state": "loading",
            "model_loaded": False,
            "progress_url": "/v1/loading/progress",
        }
        with httpx.stream("GET", f"{worker.url}{ready['progress_url']}", timeout=60) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            events = data_lines(response)
        *loading, last, done = events
        assert (last, done) == ({"stage": "ready"}, "[DONE]"), events
        assert loading, "no loading event although the stream was opened during the load"
        assert all(e["stage"] == "loading" and e["layers_total"] == 30 for e in loading), loading
        layers = [e["layers_loaded"] for e in loading]
        assert layers == sorted(layers) and layers[-1] == 30
        memory = [e["memory_mb"] for e in loading]
        # The file's own quantized weights (--quantize auto): ~90 MiB, dequantized to bf16 they would take ~257 MiB.
        assert memory == sorted(memory) and 60 < memory[-1] < 100, memory
        # Once loaded, the stream says ready at once.
        with httpx.stream("GET", f"{worker.url}/v1/loading/progress", timeout=10) as response:
            assert data_lines(response) == [{"stage": "ready"}, "[DONE]"]
    finally:
        assert worker.stop() == 0, worker.stderr()


def test_ready_line_reports_the_time_from_the_process_start(tuned: Worker) -> None:
    """The `ready` log line's time is what a user waits for, from the process's start to healthy (imports, binding,
    loading, the runner's preparation), with the weights' own load time beside it."""
    deadline = time.monotonic() + 10  # the line follows /health's first 200 by up to a poll of the load
    while not (lines := [r for r in map(json.loads, tuned.stderr().splitlines()) if r["msg"].startswith("ready:")]):
        assert time.monotonic() < deadline, tuned.stderr()
        time.sleep(0.05)
    [ready] = lines
    assert 0 < ready["weights_load_s"] < ready["startup_s"], ready
    assert f"{ready['startup_s']:.1f} s after the process started" in ready["msg"], ready


# --- slots and the queue ----------------------------------------------------------------------------------------------


@pytest.fixture
def deterministic_client(tmp_path: Path) -> Iterator[httpx.Client]:
    """A worker with the tuned one's slots and queue, in --deterministic mode."""
    flags = ("--max-batch", "2", "--max-queue", "1", "--max-context", str(MAX_CONTEXT), "--deterministic")
    with running(tmp_path, *flags, fork=True) as worker, httpx.Client(base_url=worker.url, timeout=120) as http:
        yield http


def test_jobs_beyond_slots_and_queue_get_503_and_nothing_else_is_lost(deterministic_client: httpx.Client) -> None:
    """--max-batch 2 --max-queue 1: of 6 simultaneous jobs, 3 are admitted and finish completely, with the same text
    (--deterministic, the contract's batch invariance: without it a job that waited for a slot and ran alone can part
    from the two that ran together at a near tie, as it did on a CPU with AMX); 3 get ALL_SLOTS_BUSY with Retry-After;
    a refused job succeeds when retried; a request of more sequences than slots and queue places is a 400."""
    client = deterministic_client
    outcomes: dict[int, httpx.Response | Stream] = {}
    barrier = threading.Barrier(6)

    def submit(i: int) -> None:
        body = {"job_id": f"slot-{i}-{uuid.uuid4().hex}", "prompt": PROMPT, "max_tokens": 48, "temperature": 0}
        barrier.wait()
        with client.stream("POST", "/execute", json=body) as response:
            outcomes[i] = read_rest(response) if response.status_code == 200 else response.read() and response

    health: list[dict[str, Any]] = []
    done = threading.Event()

    def poll_health() -> None:
        with httpx.Client(base_url=client.base_url, timeout=30) as http:
            while not done.is_set():
                health.append(http.get("/health").json())
                time.sleep(0.02)

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(6)]
    poller = threading.Thread(target=poll_health)
    poller.start()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    done.set()
    poller.join()
    finished = [o for o in outcomes.values() if isinstance(o, Stream)]
    refused = [o for o in outcomes.values() if isinstance(o, httpx.Response)]
    assert len(finished) == 3 and len(refused) == 3, outcomes
    for stream in finished:
        assert stream.terminal == {**stream.terminal, "type": "end", "stop_reason": "MAX_TOKENS", "tokens_out": 48}
    texts = {stream.text for stream in finished}
    assert len(texts) == 1  # the same greedy request: the same text whether it ran at once or waited
    for response in refused:
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
        error = response.json()["error"]
        assert error["code"] == "ALL_SLOTS_BUSY" and error["message"]
        assert (error["slots_total"], error["slots_busy"], error["queue_total"], error["queue_busy"]) == (2, 2, 1, 1)
    assert execute(client, prompt=PROMPT, max_tokens=48, temperature=0).text in texts
    # /health's slots and KV cache use: both slots held at some point; at most the blocks of 2 x (prompt + 48 tokens)
    # of the pool's blocks (2 x MAX_CONTEXT positions: --max-batch whole contexts); nothing once idle.
    prompt_tokens, block = finished[0].terminal["prompt_tokens"], 16
    assert max(body["slots_busy"] for body in health) == 2 and {body["slots_total"] for body in health} == {2}
    usage = [body["kv_cache_usage_perc"] for body in health]
    assert 0 < max(usage) <= 2 * -(-(prompt_tokens + 48) // block) / (2 * MAX_CONTEXT // block), usage
    idle = client.get("/health").json()
    assert (idle["state"], idle["slots_busy"], idle["kv_cache_usage_perc"]) == ("idle", 0, 0)
    # One request of more sequences than slots and queue places together: a 400 naming its field, not a 503 that no
    # retry would get past.
    for path, body, param in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 4, "max_tokens": 1}, "n"),
        ("/v1/completions", {"prompt": ["a", "b", "c", "d"], "max_tokens": 1}, "prompt"),
        ("/v1/embeddings", {"input": ["a", "b", "c", "d"]}, "input"),
    ):
        response = client.post(path, json=body)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
        assert "at most 3 at once" in response.json()["error"]["message"], response.text


# --- health -----------------------------------------------------------------------------------------------------------


def test_health_is_unhealthy_while_the_engine_makes_no_progress(tuned: Worker, client: httpx.Client) -> None:
    """One prefill forward over ~400 tokens takes longer than --stall-timeout 0.2 s here: meanwhile /health says 503
    unhealthy and /v1/ready state error; once steps complete again, healthy."""
    seen: list[tuple[int, dict[str, Any]]] = []
    ready_states: set[str] = set()
    done = threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=tuned.url, timeout=30) as http:
            while not done.is_set():
                response = http.get("/health")
                seen.append((response.status_code, response.json()))
                ready_states.add(http.get("/v1/ready").json()["state"])
                time.sleep(0.02)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        stream = execute(client, prompt=LONG_PROMPT, max_tokens=2)
    finally:
        done.set()
        poller.join()
    assert stream.terminal["type"] == "end" and 300 < stream.terminal["prompt_tokens"] < MAX_CONTEXT - 2
    unhealthy = [body for status, body in seen if status == 503]
    assert unhealthy, "never unhealthy during the long prefill"
    assert all(body["status"] == "unhealthy" and "no step" in body["message"] for body in unhealthy), unhealthy
    assert "error" in ready_states
    assert client.get("/health").status_code == 200 and client.get("/v1/ready").json()["ready"] is True


def test_heartbeat_says_degraded_while_the_engine_makes_no_progress(tmp_path: Path) -> None:
    """The stall that makes /health unhealthy (a prefill longer than --stall-timeout) turns the heartbeat's
    health_status to degraded, and back to healthy once steps complete."""
    manager = Manager([200])
    try:
        with running(
            tmp_path,
            "--stall-timeout", str(STALL_TIMEOUT_S),
            "--heartbeat-url", f"{manager.url}/beat",
            "--heartbeat-interval", "0.1",
            fork=True,
        ) as worker, httpx.Client(base_url=worker.url, timeout=120) as http:  # fmt: skip
            stream = execute(http, prompt=LONG_PROMPT, max_tokens=2)
            assert stream.terminal["type"] == "end"
            time.sleep(0.3)
            statuses = [beat.body["health_status"] for beat in manager.recorded("/beat")]
    finally:
        manager.close()
    assert "degraded" in statuses, statuses
    assert statuses[-1] == "healthy" and statuses.index("degraded") > 0  # healthy, degraded, healthy again


def test_unclaimed_job_is_cancelled_and_forgotten(client: httpx.Client) -> None:
    # Longer than the wait (about 40 tokens/s here) and within --max-context.
    created = client.post("/v1/inference", json={"prompt": PROMPT, "max_tokens": MAX_CONTEXT - 32}).json()
    time.sleep(UNCLAIMED_S + 1.0)
    assert client.get(created["sse_url"]).status_code == 404
    assert client.get("/health").json()["state"] == "idle"  # it holds no slot any more


def test_max_context_caps_prompt_plus_max_tokens(client: httpx.Client) -> None:
    response = client.post("/execute", json={"job_id": "ctx", "prompt": PROMPT, "max_tokens": MAX_CONTEXT})
    assert response.status_code == 400
    [error] = response.json()["errors"]
    assert error["constraint"] == "context_length" and str(MAX_CONTEXT) in error["message"], error


def test_kv_cache_memory_sets_the_context_or_refuses_to_start(tmp_path: Path) -> None:
    """--kv-cache-gb sizes one pool of KV blocks that every request draws on: with 1 GiB and --max-batch 32 the worker
    offers the demo's whole context (max_model_len 8192: one request fits), whatever --max-batch; a pool too small for
    a useful context is exit 2 (bf16 named, since `auto` depends on the CPU: 23,040 bytes per token)."""
    with running(tmp_path, "--dtype", "bfloat16", "--max-batch", "32", "--kv-cache-gb", "1", fork=True) as worker:
        models = httpx.get(f"{worker.url}/v1/models", timeout=10).json()["data"]
    assert {model["max_model_len"] for model in models} == {8192}
    refused = cli("serve", "--dtype", "bfloat16", "--max-batch", "4", "--kv-cache-gb", "0.001", "--port", "0",
                  timeout=120, fork=True)  # fmt: skip
    assert refused.returncode == 2 and "KV cache" in refused.stderr, refused.stderr
    assert len(error_lines(refused.stderr)) == 1


# --- logs -------------------------------------------------------------------------------------------------------------


def test_one_json_log_line_per_finished_job(tuned: Worker, client: httpx.Client) -> None:
    correlation_id = str(uuid.uuid4())
    job_id = "logged-" + uuid.uuid4().hex
    with client.stream(
        "POST",
        "/execute",
        json={"job_id": job_id, "prompt": PROMPT, "max_tokens": 7, "temperature": 0},
        headers={"X-Correlation-ID": correlation_id},
    ) as response:
        end = read_rest(response).terminal
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        lines = [json.loads(line) for line in tuned.stderr().splitlines()]  # every line is JSON
        mine = [line for line in lines if line.get("job_id") == job_id and line["logger"] != "rbee_worker.access"]
        if mine:
            break
        time.sleep(0.05)
    [line] = mine  # the access log's line for the request is apart
    assert line["msg"] == "job finished" and line["level"] == "info" and line["ts"].endswith("Z")
    assert line["correlation_id"] == correlation_id
    assert (line["prompt_tokens"], line["tokens_out"], line["stop_reason"]) == (
        end["prompt_tokens"],
        7,
        "MAX_TOKENS",
    )
    assert line["ttft_ms"] > 0 and line["tokens_per_s"] > 0


# --- drain ------------------------------------------------------------------------------------------------------------


def open_execute(http: httpx.Client, max_tokens: int) -> httpx.Response:
    body = {"job_id": uuid.uuid4().hex, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    response = http.send(http.build_request("POST", "/execute", json=body), stream=True)
    assert response.status_code == 200, response.read()
    return response


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_sigterm_lets_running_jobs_finish_then_sigint_cancels_the_rest(tmp_path: Path, runtime: str) -> None:
    """SIGTERM: new jobs get 503 DRAINING, /health 503 draining, two running jobs finish normally; a second signal
    (SIGINT) cancels the long job at once instead of waiting out --drain-timeout 60; exit code 0."""
    worker = launch(tmp_path, "--drain-timeout", "60", "--runtime", runtime, fork=True)
    worker.wait_healthy()
    with httpx.Client(base_url=worker.url, timeout=60) as http:
        short = [open_execute(http, 40) for _ in range(2)]
        long = open_execute(http, LONG)
        events = [sse_events(r) for r in (*short, long)]
        heads = [take_tokens(e, 1) for e in events]
        worker.process.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        refused = http.post("/execute", json={"job_id": "late", "prompt": PROMPT, "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "DRAINING", refused.text
        health = http.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "draining"
        assert http.get("/v1/ready").json()["state"] == "draining"
        finished = [read_rest(r, e) for r, e in zip(short, events[:2], strict=True)]
        for head, stream in zip(heads[:2], finished, strict=True):
            assert stream.terminal["type"] == "end" and stream.terminal["tokens_out"] == 40, head + stream.events
        assert worker.process.poll() is None  # the long job still runs: the drain waits for it
        interrupted_at = time.monotonic()
        worker.process.send_signal(signal.SIGINT)
        rest = read_rest(long, events[2])
        assert rest.terminal["type"] == "error" and rest.terminal["code"] == "CANCELLED"
        assert time.monotonic() - interrupted_at < 5
    assert worker.process.wait(timeout=30) == 0, worker.stderr()


def test_post_shutdown_cancels_what_outlives_the_drain_timeout(tmp_path: Path) -> None:
    worker = launch(tmp_path, "--drain-timeout", "1", fork=True)
    worker.wait_healthy()
    with httpx.Client(base_url=worker.url, timeout=60) as http:
        running = open_execute(http, LONG)
        events = sse_events(running)
        take_tokens(events, 2)
        unread = http.post("/v1/inference", json={"prompt": PROMPT, "max_tokens": LONG})
        assert unread.status_code == 200
        asked_at = time.monotonic()
        response = http.post("/shutdown")
        assert response.status_code == 202 and response.json() == {"status": "draining"}
        rest = read_rest(running, events)
        assert rest.terminal["type"] == "error" and rest.terminal["code"] == "CANCELLED", rest.events
        assert 1.0 <= time.monotonic() - asked_at < 5
    assert worker.process.wait(timeout=30) == 0, worker.stderr()


def wait_bound(worker: Worker) -> None:
    """Until the worker's port takes connections: `serve` binds it first and installs its stop handler right after,
    before the heavy imports (before that, Python itself is still starting, and SIGTERM ends any program)."""
    while True:
        assert worker.process.poll() is None, worker.stderr()
        try:
            socket.create_connection(("127.0.0.1", worker.port), timeout=0.05).close()
            return
        except OSError:
            time.sleep(0.005)


def test_stop_signal_while_importing_exits_0_at_once(tmp_path: Path) -> None:
    """SIGTERM while importing (the port is bound, nothing answers yet). The imports take about a second: signals at 15
    moments across them, since one raised inside a transformers import once turned into an import error and exit 1 (3
    of 24 such launches failed that way)."""
    for delay in [0.01 + 0.05 * i for i in range(15)]:
        early = launch(tmp_path)
        wait_bound(early)
        time.sleep(delay)
        early.process.send_signal(signal.SIGTERM)
        assert early.process.wait(timeout=30) == 0, (delay, early.stderr())
        assert "error" not in early.stderr(), (delay, early.stderr())


STOPPED_AT_ONCE = "stopping at once: asked again while the model loads"


# The second signal's delay: two sent at the same instant may reach the process as one (signals do not queue).
def test_a_python_warning_goes_out_as_a_json_log_line() -> None:
    """A library's Python warning (pydantic warns of a schema's field, say) in a JSON log is a JSON line like every
    other, not a raw line that a log reader cannot parse."""
    import subprocess
    import sys

    code = (
        "import warnings; from rbee_worker.logs import configure_logging; configure_logging('info', 'json'); "
        "warnings.warn('a field attribute has no effect', UserWarning)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    lines = [json.loads(line) for line in result.stderr.splitlines()]
    assert len(lines) == 1 and "a field attribute has no effect" in lines[0]["msg"], result.stderr


@pytest.mark.parametrize("second_after", [None, 0.05, 0.2, 0.5, 1.0], ids=["one", "0.05s", "0.2s", "0.5s", "1s"])
def test_stop_signals_while_loading_end_the_process_promptly(tmp_path: Path, second_after: float | None) -> None:
    """SIGINT while the model loads (as Ctrl-C): the load is cancelled and the process exits 0 within seconds, the
    server's end its last log line (nothing of the load after it); a second SIGINT, whenever it comes (during the
    load, the server's shutdown, or after it), ends it at once, exit 0, without an error or a traceback."""
    worker = launch(tmp_path, "--log-format", "json", fork=True)
    while True:
        assert worker.process.poll() is None, worker.stderr()
        try:
            if httpx.get(f"{worker.url}/health", timeout=5).json()["status"] == "loading":
                break
        except httpx.TransportError:
            time.sleep(0.01)
    sent_at = time.monotonic()
    worker.process.send_signal(signal.SIGINT)
    if second_after is not None:
        time.sleep(second_after)
        if worker.process.poll() is None:
            worker.process.send_signal(signal.SIGINT)
    code = worker.process.wait(timeout=30)
    took = time.monotonic() - sent_at
    stderr = worker.stderr()
    assert code == 0, stderr
    assert took < (5 if second_after is None else second_after + 2), (took, stderr)
    assert "Traceback" not in stderr and not error_lines(stderr), stderr
    messages = [json.loads(line)["msg"] for line in stderr.splitlines()]
    assert not any(m.startswith("ready") for m in messages), messages
    last = messages[-1]
    if second_after is None:
        assert "stopping: the model load is cancelled" in messages, messages
        assert last.startswith("Finished server process"), messages
    else:
        assert last.startswith("Finished server process") or last == STOPPED_AT_ONCE, messages


# --- the pool manager sees a reachable URL ----------------------------------------------------------------------------


def test_wildcard_host_advertises_the_address_facing_the_pool_manager(tmp_path: Path) -> None:
    manager = Manager([200])
    flags = ("--host", "0.0.0.0", "--allow-unauthenticated", "--callback-url", f"{manager.url}/ready")
    worker = launch(tmp_path, *flags, fork=True)
    try:
        [ready] = manager.wait_for("/ready", 1, timeout=120)
        assert ready.body["url"] == ready.body["uri"] == f"http://127.0.0.1:{worker.port}"  # not 0.0.0.0
        assert httpx.get(f"{ready.body['url']}/health", timeout=5).status_code == 200
    finally:
        manager.close()
        assert worker.stop() == 0, worker.stderr()
