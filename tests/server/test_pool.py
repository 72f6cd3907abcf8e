"""The pool-manager client against a real HTTP server on 127.0.0.1 that records every request and answers from a script.

No mocking of httpx: the requests go through real sockets, so connection refusals, timeouts and slow answers are the
real thing. Timings use generous tolerances (the server runs in threads), but each is tight enough that the behaviour
it checks (backoff, deadline, start-to-start schedule) would fail it if broken.
"""

import asyncio
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from rbee_worker import errors
from rbee_worker.server import pool_client
from rbee_worker.server.pool_client import (
    HeartbeatStatus,
    ReadyPayload,
    RegistrationError,
    heartbeat_loop,
    send_heartbeat,
    send_ready_callback,
)

READY_PATH = "/v2/workers/ready"
BEAT_PATH = "/v2/workers/heartbeat"
PAYLOAD = ReadyPayload(
    worker_id="worker-7",
    model_ref="hf:HuggingFaceTB/SmolLM2-135M-Instruct",
    url="http://127.0.0.1:8080",
    vram_bytes=0,
    memory_bytes=123_456_789,
    weight_bytes=100_000_000,
    active_weight_bytes=100_000_000,
    backend="cpu",
    device="cpu",
    runtime="llama.cpp",
    cpu={"arch": "x86_64", "isa": "avx2", "flags": ["avx", "avx2", "f16c", "fma"], "bf16": "emulated", "forced": None},
)
CONTRACT_KEYS = {
    "worker_id", "model_ref", "uri", "url", "vram_bytes", "memory_bytes", "backend", "device", "devices", "runtime",
    "cpu", "weight_bytes", "active_weight_bytes",
}  # fmt: skip


@dataclass(frozen=True)
class Reply:
    status: int = 200
    body: str = "{}"
    headers: dict[str, str] = field(default_factory=dict)
    hang_s: float = 0.0  # wait this long before answering (no answer at all if the server stops meanwhile)


@dataclass(frozen=True)
class Received:
    at: float  # time.monotonic(), the clock asyncio's loop uses too
    wall: datetime
    path: str
    body: Any
    headers: dict[str, str]


class FakePoolManager:
    """A threaded HTTP server: records each POST, answers from `script` (the last reply repeats once it runs out)."""

    def __init__(self, script: list[Reply]) -> None:
        self.requests: list[Received] = []
        self._script = list(script)
        self._lock = threading.Lock()
        self._release = threading.Event()
        self._server: ThreadingHTTPServer | None = None
        self.port = 0

    def set_script(self, script: list[Reply]) -> None:
        with self._lock:
            self._script = list(script)

    def _next_reply(self) -> Reply:
        with self._lock:
            return self._script.pop(0) if len(self._script) > 1 else self._script[0]

    def start(self) -> None:
        manager = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with manager._lock:
                    manager.requests.append(
                        Received(
                            time.monotonic(),
                            datetime.now(UTC),
                            self.path,
                            json.loads(raw or b"null"),
                            dict(self.headers),
                        )
                    )
                reply = manager._next_reply()
                if reply.hang_s and manager._release.wait(reply.hang_s):
                    return  # the server is stopping: drop the connection unanswered, as a dying server would
                try:
                    self.send_response(reply.status)
                    for name, value in {"Content-Type": "application/json", **reply.headers}.items():
                        self.send_header(name, value)
                    self.end_headers()
                    self.wfile.write(reply.body.encode())
                except OSError:
                    pass  # the client gave up waiting (that is what a hang tests)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # keep pytest's output clean

        # Same port on a restart (allow_reuse_address is on for HTTPServer), so an outage can end.
        self._release.clear()
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, args=(0.02,), daemon=True).start()

    def stop(self) -> None:
        if self._server is not None:
            self._release.set()  # let hanging handlers finish
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def gaps(self) -> list[float]:
        return [b.at - a.at for a, b in zip(self.requests, self.requests[1:], strict=False)]


@pytest.fixture
def pool_manager() -> Iterator[Callable[[list[Reply]], FakePoolManager]]:
    started: list[FakePoolManager] = []

    def start(script: list[Reply]) -> FakePoolManager:
        manager = FakePoolManager(script)
        manager.start()
        started.append(manager)
        return manager

    yield start
    for manager in started:
        manager.stop()


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound once to get a free number, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def timed_callback(url: str, **kwargs: Any) -> tuple[float, RegistrationError | None]:
    """Run send_ready_callback; return how long it took and the RegistrationError it raised, if any."""
    start = time.monotonic()
    try:
        asyncio.run(send_ready_callback(url, PAYLOAD, **kwargs))
    except RegistrationError as exc:
        return time.monotonic() - start, exc
    return time.monotonic() - start, None


def pool_records(caplog: pytest.LogCaptureFixture, level: int, text: str) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name == "rbee_worker.server.pool_client" and r.levelno == level and text in r.message
    ]


# --- ready callback -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("accepted", [200, 204])
def test_ready_retries_5xx_then_registers(pool_manager, caplog, accepted: int) -> None:
    caplog.set_level(logging.DEBUG, logger="rbee_worker.server.pool_client")
    server = pool_manager([Reply(503, '{"error":"starting"}'), Reply(503), Reply(accepted, "")])

    _, error = timed_callback(server.url(READY_PATH), first_delay_s=0.05, max_delay_s=1.0, timeout_s=5.0)

    assert error is None
    assert len(server.requests) == 3
    for request in server.requests:
        assert request.path == READY_PATH
        assert request.body == PAYLOAD.to_json()
    body = server.requests[0].body
    assert set(body) == CONTRACT_KEYS
    assert body["uri"] == body["url"] == PAYLOAD.url
    assert body["memory_bytes"] == PAYLOAD.memory_bytes
    # Backoff doubles: ~0.05 s then ~0.1 s (minus up to 10 % jitter), not immediate retries.
    first, second = server.gaps()
    assert 0.045 <= first < 0.045 + 0.15
    assert 0.09 <= second < 0.09 + 0.15
    warnings = pool_records(caplog, logging.WARNING, "ready callback attempt")
    assert [("attempt 1 " in w.message, "attempt 2 " in w.message) for w in warnings] == [(True, False), (False, True)]
    assert all("HTTP 503" in w.message for w in warnings)
    assert "starting" in warnings[0].message  # the pool manager's reason reaches the log


@pytest.mark.parametrize(("status", "hint"), [(400, "--model-ref"), (404, "--callback-url")])
def test_ready_4xx_is_final(pool_manager, status: int, hint: str) -> None:
    server = pool_manager([Reply(status, '{"error": "no such\nthing"}'), Reply(200)])

    elapsed, error = timed_callback(server.url(READY_PATH), first_delay_s=0.05, timeout_s=5.0)

    assert error is not None
    assert len(server.requests) == 1
    assert elapsed < 1.0
    message = str(error)
    assert isinstance(error, errors.RegistrationError)  # the class the CLI turns into exit code 3
    assert f"HTTP {status}" in message
    assert "no such thing" in message  # the pool manager's reason, flattened to one line
    assert server.url(READY_PATH) in message
    assert hint in message  # what to do about it
    assert "\n" not in message


def test_ready_5xx_retries_until_deadline(pool_manager) -> None:
    server = pool_manager([Reply(500, "boom")])
    timeout_s = 1.5
    last_start = timeout_s - timeout_s / 10  # the final attempt's slot (LAST_ATTEMPT_WINDOW_S is capped at 1/10)

    start = time.monotonic()
    elapsed, error = timed_callback(server.url(READY_PATH), timeout_s=timeout_s, first_delay_s=0.1, max_delay_s=0.4)

    assert error is not None
    assert last_start <= elapsed < timeout_s + 0.5
    # 0, ~0.1, ~0.3, ~0.7, ~1.1, then (the next step, ~1.5, would overshoot) one last at 1.35: none after the deadline.
    assert len(server.requests) >= 6
    assert last_start <= server.requests[-1].at - start < last_start + 0.1
    gaps = server.gaps()
    for gap, expected in zip(gaps, [0.1, 0.2, 0.4], strict=False):
        assert expected * 0.9 - 0.01 <= gap < expected + 0.1, gaps
    assert max(gaps) < 0.4 + 0.1, gaps  # max_delay_s caps the backoff
    message = str(error)
    assert "1.5 s" in message
    assert "HTTP 500 boom" in message
    assert f"{len(server.requests)} attempts" in message


def test_ready_connection_refused_retries_then_fails(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="rbee_worker.server.pool_client")
    url = f"http://127.0.0.1:{closed_port()}{READY_PATH}"
    timeout_s = 0.6

    elapsed, error = timed_callback(url, timeout_s=timeout_s, first_delay_s=0.05, max_delay_s=0.2)

    assert error is not None
    assert "connection refused" in str(error)
    assert timeout_s * 0.9 <= elapsed < timeout_s + 0.5  # the last attempt is at 0.9 * timeout_s
    warnings = pool_records(caplog, logging.WARNING, "ready callback attempt")
    assert len(warnings) >= 3  # 0, ~0.05, ~0.15, ~0.35: retried, not given up after the first refusal
    assert all("connection refused" in w.message for w in warnings)
    assert [w.message.split()[3] for w in warnings] == [str(n) for n in range(1, len(warnings) + 1)]


def test_ready_retry_after_is_honoured(pool_manager) -> None:
    server = pool_manager([Reply(503, headers={"Retry-After": "1"}), Reply(200)])

    _, error = timed_callback(server.url(READY_PATH), timeout_s=5.0, first_delay_s=0.05, max_delay_s=5.0)

    assert error is None
    assert len(server.requests) == 2
    # The backoff alone would have waited ~0.05 s.
    assert 1.0 - 0.02 <= server.gaps()[0] < 1.0 + 0.4


def test_ready_retry_after_is_bounded_by_max_delay(pool_manager) -> None:
    server = pool_manager([Reply(503, headers={"Retry-After": "30"}), Reply(200)])

    _, error = timed_callback(server.url(READY_PATH), timeout_s=5.0, first_delay_s=0.05, max_delay_s=0.3)

    assert error is None
    assert 0.3 - 0.02 <= server.gaps()[0] < 0.3 + 0.3


def test_ready_retry_after_is_bounded_by_deadline(pool_manager) -> None:
    server = pool_manager([Reply(503, headers={"Retry-After": "30"}), Reply(200)])

    start = time.monotonic()
    _, error = timed_callback(server.url(READY_PATH), timeout_s=0.5, first_delay_s=0.05, max_delay_s=5.0)

    # Instead of waiting past the deadline (or giving up at once), one last attempt at 0.45 s, which gets in.
    assert error is None
    assert len(server.requests) == 2
    assert 0.45 <= server.requests[1].at - start < 0.5


def test_parse_retry_after_forms() -> None:
    in_5_s = format_datetime(datetime.now(UTC) + timedelta(seconds=5), usegmt=True)
    assert pool_client._parse_retry_after(" 2 ") == 2.0
    assert 3.5 <= pool_client._parse_retry_after(in_5_s) <= 5.0  # HTTP dates have whole seconds
    assert pool_client._parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # in the past: retry now
    assert pool_client._parse_retry_after("soon") is None
    assert pool_client._parse_retry_after(None) is None


def test_ready_attempt_timeout_is_clipped_to_deadline(pool_manager) -> None:
    # The server never answers in time; a single attempt would be allowed 10 s, but the deadline is 0.5 s away.
    server = pool_manager([Reply(200, hang_s=5.0)])

    elapsed, error = timed_callback(server.url(READY_PATH), timeout_s=0.5, first_delay_s=0.05)

    assert error is not None
    assert 0.5 <= elapsed < 0.5 + 0.5
    assert len(server.requests) == 1
    assert "timed out" in str(error)


def test_ready_no_attempt_after_deadline_even_if_the_loop_was_blocked(pool_manager) -> None:
    # Another task blocks the event loop through the backoff sleep and past the deadline (a long synchronous call on
    # uvicorn's loop would): waking up late must not start an attempt.
    server = pool_manager([Reply(500)])

    async def main() -> RegistrationError:
        async def hog() -> None:
            await asyncio.sleep(0.1)
            time.sleep(0.6)  # deliberately blocking

        hogging = asyncio.create_task(hog())
        with pytest.raises(RegistrationError) as caught:
            await send_ready_callback(server.url(READY_PATH), PAYLOAD, timeout_s=0.5, first_delay_s=0.3)
        await hogging
        return caught.value

    error = asyncio.run(main())

    assert len(server.requests) == 1
    assert "1 attempt," in str(error)


def test_ready_uses_the_callers_client_and_leaves_it_open(pool_manager) -> None:
    server = pool_manager([Reply(200)])

    async def main() -> bool:
        async with httpx.AsyncClient(headers={"X-Caller": "server"}) as client:
            await send_ready_callback(server.url(READY_PATH), PAYLOAD, client=client)
            return client.is_closed

    closed = asyncio.run(main())

    assert not closed
    assert server.requests[0].headers["X-Caller"] == "server"


def test_ready_malformed_url_is_final() -> None:
    elapsed, error = timed_callback("127.0.0.1:9999/ready", timeout_s=5.0)

    assert error is not None
    assert elapsed < 1.0
    assert "http://" in str(error)


# --- heartbeat ------------------------------------------------------------------------------------------------------


def run_heartbeat(url: str, interval_s: float, status: Callable[[], HeartbeatStatus], phases: list[Callable[[], Any]]):
    """Run heartbeat_loop while calling each phase function in turn (a phase sleeps by returning a delay in seconds).

    Returns whether the heartbeat task was still running at the end (it must never stop on its own).
    """

    async def main() -> bool:
        task = asyncio.create_task(heartbeat_loop(url, interval_s, status))
        for phase in phases:
            await asyncio.sleep(phase() or 0)
        alive = not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return alive

    return asyncio.run(main())


def test_heartbeat_at_interval_with_fields(pool_manager) -> None:
    # Each answer takes 0.08 s: measured end-to-start, the beats would be 0.28 s apart instead of 0.2.
    server = pool_manager([Reply(200, hang_s=0.08)])
    interval = 0.2
    calls: list[HeartbeatStatus] = []

    def status() -> HeartbeatStatus:
        # Changes on every call, so the test sees that each beat asks for the current status.
        n = len(calls)
        calls.append(HeartbeatStatus("worker-7", "healthy" if n % 2 == 0 else "degraded", ("idle", "busy")[n % 2]))
        return calls[-1]

    started = time.monotonic()
    alive = run_heartbeat(server.url(BEAT_PATH), interval, status, [lambda: 1.1])

    assert alive
    beats = server.requests
    assert 5 <= len(beats) <= 6
    assert beats[0].at - started < 0.1  # the first beat goes out at once, not after an interval
    for k, beat in enumerate(beats):
        # No drift: the k-th beat is k intervals after the first, not k * (interval + request time).
        assert abs(beat.at - beats[0].at - k * interval) < 0.05, [b.at - beats[0].at for b in beats]
    for beat, sent in zip(beats, calls, strict=False):
        assert beat.path == BEAT_PATH
        assert set(beat.body) == {"worker_id", "timestamp", "health_status", "state"}
        assert beat.body["worker_id"] == "worker-7"
        assert (beat.body["health_status"], beat.body["state"]) == (sent.health_status, sent.state)
        stamp = datetime.fromisoformat(beat.body["timestamp"])
        assert beat.body["timestamp"].endswith("Z")
        assert stamp.utcoffset() == timedelta(0)
        assert abs((stamp - beat.wall).total_seconds()) < 0.5
    assert {b.body["state"] for b in beats} == {"idle", "busy"}


def test_heartbeat_survives_errors_hangs_and_outage(pool_manager, caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="rbee_worker.server.pool_client")
    interval = 0.1
    server = pool_manager([Reply(500, "internal error")])
    marks: dict[str, int] = {}

    def mark(name: str, then: Callable[[], Any] = lambda: None) -> Callable[[], float]:
        def phase() -> float:
            marks[name] = len(server.requests)
            then()
            return 0.6  # about 6 intervals, so a slow CI machine still fits the 3 beats each phase asserts

        return phase

    alive = run_heartbeat(
        server.url(BEAT_PATH),
        interval,
        lambda: HeartbeatStatus("worker-7", "healthy", "idle"),
        [
            mark("errors"),  # answers 500
            mark("hangs", lambda: server.set_script([Reply(200, hang_s=5.0)])),  # never answers in time
            mark("down", server.stop),  # connection refused
            mark("back", lambda: (server.set_script([Reply(200)]), server.start())),
            mark("end"),
        ],
    )

    assert alive
    errors, hangs, down, back, end = (marks[k] for k in ("errors", "hangs", "down", "back", "end"))
    assert hangs - errors >= 3  # beats during the 500s
    assert down - hangs >= 3  # each hanging request timed out within the interval, so beats kept their pace
    hang_gaps = server.gaps()[hangs : down - 1]
    assert max(hang_gaps) < interval + 0.05, hang_gaps
    assert back == down  # nothing listening: nothing received
    assert end - back >= 2  # and the beats resumed when it came back
    # One failure streak (500s, timeouts, refusals): one WARNING, the rest at DEBUG, one INFO when it recovered.
    warnings = pool_records(caplog, logging.WARNING, "heartbeat")
    assert len(warnings) == 1
    assert "HTTP 500 internal error" in warnings[0].message
    debug = [r.message for r in pool_records(caplog, logging.DEBUG, "heartbeat")]
    assert any("timed out" in m for m in debug)
    assert any("connection refused" in m for m in debug)
    assert len(pool_records(caplog, logging.INFO, "works again")) == 1


def test_heartbeat_status_must_be_known() -> None:
    with pytest.raises(ValueError, match="health_status"):
        HeartbeatStatus("worker-7", "ok", "idle")


def test_a_beat_off_the_schedule_says_why_the_worker_is_unhealthy(pool_manager) -> None:
    server = pool_manager([Reply(200), Reply(500)])
    status = HeartbeatStatus("worker-7", "unhealthy", "error", "the device failed")
    assert asyncio.run(send_heartbeat(server.url(BEAT_PATH), status)) is None
    assert asyncio.run(send_heartbeat(server.url(BEAT_PATH), status)).startswith("HTTP 500")
    body = server.requests[0].body
    assert (body["health_status"], body["state"], body["message"]) == ("unhealthy", "error", "the device failed")


def test_heartbeat_survives_a_failing_status_callback(pool_manager, caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="rbee_worker.server.pool_client")
    server = pool_manager([Reply(200)])
    calls = 0

    def status() -> HeartbeatStatus:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("engine not wired yet")
        return HeartbeatStatus("worker-7", "healthy", "idle")

    alive = run_heartbeat(server.url(BEAT_PATH), 0.1, status, [lambda: 0.6])

    assert alive
    assert len(server.requests) >= 3  # the beats after the failed one still went out (~5 of them)
    warnings = pool_records(caplog, logging.WARNING, "heartbeat")
    assert len(warnings) == 1
    assert "RuntimeError: engine not wired yet" in warnings[0].message
