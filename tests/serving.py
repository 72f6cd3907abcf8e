"""Helpers for tests that run `rbee-worker serve` as a real process: launching it, reading its SSE streams, and a
real HTTP server that plays the pool manager and records what the worker sends."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import cli_forks
import httpx
import pytest

DEMO_NAME = "SmolLM2-135M-Instruct.Q4_1"
PROMPT = "Once upon a time, in a small village by the sea,"
# A chat-formatted question the demo model answers in a few tokens and then ends its turn (EOS), greedily.
EOS_PROMPT = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
# max_tokens of a job still running when the test cancels it: greedy (sampled, it may end early), about a minute here
LONG = 2048
# The KV pool (GiB) of every worker and engine the tests start unless a test sizes its own (--kv-cache-gb,
# kv_cache_bytes): never sized from the memory free at the time, which the other test process changes. On llama.cpp,
# which holds its pool whole from the start, 1 GiB is a KV stream per sequence up to --max-batch 5 (5 x the demo's
# 8192 x 23040 bytes) and one unified pool above (engine/runners/llama_cpp/llama_cpp_runner.py); the shared workers take
# the pool a machine with the memory gets by default (conftest.py SHARED_KV_GB).
TEST_KV_GB = 1


# --- the worker process -----------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Worker:
    """A `rbee-worker serve` process; its stderr goes to a file so that a full pipe can never stall it."""

    process: subprocess.Popen[bytes] | cli_forks.ForkedProcess
    port: int
    stderr_path: Path
    loading_bodies: list[dict[str, Any]] = field(default_factory=list)  # the 503 bodies seen while it loaded

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def wait_healthy(self, timeout: float = 120.0) -> None:
        """Poll /health until 200, keeping every 503 seen on the way; fail at once if the process exits."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"worker exited with {self.process.returncode} before it was healthy:\n{self.stderr()}")
            try:
                response = httpx.get(f"{self.url}/health", timeout=5)
            except httpx.TransportError:  # not listening yet (still importing)
                time.sleep(0.02)
                continue
            if response.status_code == 200:
                return
            assert response.status_code == 503, response.text
            self.loading_bodies.append(response.json())
            time.sleep(0.02)  # short, so the ~1 s load window is not missed
        pytest.fail(f"worker not healthy within {timeout} s:\n{self.stderr()}")

    def stop(self) -> int:
        """SIGTERM and wait; the exit code (SIGKILL and a failure if it hangs)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                pytest.fail(f"worker ignored SIGTERM for 30 s:\n{self.stderr()}")
        return self.process.returncode


def launch(
    log_dir: Path,
    *flags: str,
    port: int | None = None,
    env: dict[str, str] | None = None,
    fault: str | None = None,
    fork: bool = False,
) -> Worker:
    """`rbee-worker serve` on the demo, its KV pool TEST_KV_GB unless `flags` size it; `fault`: with that fault
    injected (see tests/fault_worker.py). `fork`: forked from the session's zygote (cli_forks.shared), which has
    imported torch and transformers, unless `env` changes a variable read at import: about 5 s less per start, for
    tests that do not watch the imports (their time, a signal during them); a fault is then injected in the forked
    child."""
    port = port or free_port()
    stderr_path = log_dir / f"worker-{port}-{uuid.uuid4().hex[:6]}.stderr"
    sized = () if "--kv-cache-gb" in flags else ("--kv-cache-gb", str(TEST_KV_GB))
    args = ("serve", "--model", "demo", "--port", str(port), *sized, *flags)
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    if fork and (zygote := cli_forks.shared()).can_run(full_env):
        stderr_path.touch()
        return Worker(zygote.spawn(full_env, args, stderr_path, fault), port, stderr_path)
    program = ["-m", "rbee_worker"] if fault is None else [str(Path(__file__).with_name("fault_worker.py")), fault]
    with stderr_path.open("wb") as stderr:
        process = subprocess.Popen(
            [sys.executable, *program, *args], stdout=subprocess.DEVNULL, stderr=stderr, env=full_env
        )
    return Worker(process, port, stderr_path)


@contextlib.contextmanager
def running(log_dir: Path, *flags: str, env: dict[str, str] | None = None, fork: bool = False) -> Iterator[Worker]:
    """A healthy worker for the block (`fork`: see launch); it must then exit 0 on SIGTERM."""
    worker = launch(log_dir, *flags, env=env, fork=fork)
    try:
        worker.wait_healthy()
        yield worker
    finally:
        code = worker.stop()
    assert code == 0, f"exit code {code} after SIGTERM:\n{worker.stderr()}"


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


# --- SSE --------------------------------------------------------------------------------------------------------------


@dataclass
class Stream:
    """A read SSE stream: each event's payload (a dict, or the string "[DONE]") and when it arrived."""

    events: list[dict[str, Any] | str]
    times: list[float]

    @property
    def tokens(self) -> list[dict[str, Any]]:
        return [e for e in self.events if isinstance(e, dict) and e["type"] == "token"]

    @property
    def text(self) -> str:
        return "".join(e["t"] for e in self.tokens)

    @property
    def terminal(self) -> dict[str, Any]:
        """The one `end`/`error` event (asserted to be unique)."""
        ends = [e for e in self.events if isinstance(e, dict) and e["type"] in ("end", "error")]
        assert len(ends) == 1, self.events
        return ends[0]


def sse_events(response: httpx.Response) -> Iterator[tuple[float, dict[str, Any] | str]]:
    """Each `data:` payload as it arrives; every other non-blank line is a protocol error."""
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        payload = line.removeprefix("data: ")
        yield time.perf_counter(), payload if payload == "[DONE]" else json.loads(payload)


def read_rest(response: httpx.Response, events: Iterator[tuple[float, dict[str, Any] | str]] | None = None) -> Stream:
    stream = Stream([], [])
    for at, event in events or sse_events(response):
        stream.times.append(at)
        stream.events.append(event)
    return stream


def execute(client: httpx.Client, **body: Any) -> Stream:
    """POST /execute and read the whole stream."""
    with client.stream("POST", "/execute", json={"job_id": uuid.uuid4().hex, **body}) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return read_rest(response)


def check_shape(stream: Stream, job_id: str, *, done_marker: bool) -> None:
    """started first, tokens numbered 0.., exactly one terminal event last (then [DONE] on the job API)."""
    events = list(stream.events)
    if done_marker:
        assert events.pop() == "[DONE]", stream.events
    assert "[DONE]" not in events
    started, *middle, terminal = events
    assert set(started) == {"type", "job_id", "model", "started_at"}, started
    assert started["type"] == "started" and started["job_id"] == job_id
    # RFC 3339 with a zone (Python's parser takes the Z), and now-ish: not a local time without an offset.
    started_at = datetime.fromisoformat(started["started_at"])
    assert started_at.tzinfo is not None and abs(datetime.now(UTC) - started_at) < timedelta(minutes=5)
    assert all(e["type"] == "token" and set(e) == {"type", "t", "i"} for e in middle), middle
    assert [e["i"] for e in middle] == list(range(len(middle)))
    assert all(e["t"] for e in middle)  # no empty pieces (held-back text is not sent as "")
    assert terminal["type"] in ("end", "error"), terminal


def take_tokens(events: Iterator[tuple[float, dict[str, Any] | str]], n: int) -> list[dict[str, Any] | str]:
    """Read events until n tokens have arrived: the job is then certainly generating."""
    seen: list[dict[str, Any] | str] = []
    while sum(isinstance(e, dict) and e["type"] == "token" for e in seen) < n:
        seen.append(next(events)[1])
    return seen


@dataclass
class Recorded:
    path: str
    body: dict[str, Any]
    at: float


class Manager:
    """A pool manager on 127.0.0.1: records every POST; /ready answers from `ready_statuses` (the last repeats)."""

    def __init__(self, ready_statuses: list[int]) -> None:
        self.ready_statuses = list(ready_statuses)
        self.requests: list[Recorded] = []
        self.lock = threading.Lock()
        manager = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with manager.lock:
                    manager.requests.append(Recorded(self.path, body, time.perf_counter()))
                    if self.path == "/ready":
                        status = (
                            manager.ready_statuses.pop(0)
                            if len(manager.ready_statuses) > 1
                            else manager.ready_statuses[0]
                        )
                    else:
                        status = 200
                payload = json.dumps({"status": status}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:  # keep the test output clean
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def recorded(self, path: str) -> list[Recorded]:
        with self.lock:
            return [r for r in self.requests if r.path == path]

    def wait_for(self, path: str, count: int, timeout: float) -> list[Recorded]:
        deadline = time.monotonic() + timeout
        while len(found := self.recorded(path)) < count and time.monotonic() < deadline:
            time.sleep(0.05)
        return found

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
