"""Issue 29's access log: one info line per HTTP request (JSON by default) with its method, path, status, duration,
correlation id and job id, written when the response has ended (for a stream: after its last event); none with
--no-access-log."""

import json
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import AUTH, SharedWorkers, default_runtime
from serving import PROMPT, Worker, read_rest, running

pytestmark = pytest.mark.slow


def requests_made(worker: Worker, headers: dict[str, str] | None = None) -> tuple[str, str, float]:
    """A JSON request, a stream of 24 tokens, a 404: the job id and correlation id of the stream, and how long the
    client saw it stream (from its first event to its last)."""
    correlation_id = str(uuid.uuid4())
    job_id = uuid.uuid4().hex
    with httpx.Client(base_url=worker.url, timeout=120, headers=headers) as http:
        assert http.post("/tokenize", json={"prompt": "Hi"}).status_code == 200
        body = {"job_id": job_id, "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
        headers = {"X-Correlation-ID": correlation_id}
        with http.stream("POST", "/execute", json=body, headers=headers) as response:
            stream = read_rest(response)
        assert stream.terminal["type"] == "end"
        assert http.get("/no-such-route").status_code == 404
    return job_id, correlation_id, stream.times[-1] - stream.times[0]


def access_lines(worker: Worker) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in worker.stderr().splitlines() if line.startswith("{")]
    return [line for line in lines if line["logger"] == "rbee_worker.access"]


def test_every_request_is_logged_when_its_response_ends(shared_workers: SharedWorkers) -> None:
    """On the session's shared worker of the default runtime (default flags): its log from its start, and the lines
    of this test's own requests, written after those of the requests before them."""
    worker = shared_workers.get(default_runtime())
    earlier = len(access_lines(worker))
    job_id, correlation_id, streamed_s = requests_made(worker, AUTH)
    time.sleep(0.2)  # the last line is written after the response
    lines = access_lines(worker)
    # The route tables' request at start-up is the worker's own: in neither the access log nor httpx's lines.
    loggers = {json.loads(line)["logger"] for line in worker.stderr().splitlines() if line.startswith("{")}
    assert "httpx" not in loggers and not [line for line in lines if line["path"] == "/.route-tables"]
    assert all(line["level"] == "info" and line["correlation_id"] for line in lines), lines
    assert {line["status"] for line in lines if line["path"] == "/health"} <= {200, 503}  # the launch's own polls
    assert lines[0]["path"] == "/health"  # the first line: the launch polling it
    by_path = {(line["method"], line["path"]): line for line in lines[earlier:]}
    tokenize, execute, missing = (
        by_path["POST", "/tokenize"],
        by_path["POST", "/execute"],
        by_path["GET", "/no-such-route"],
    )
    assert (tokenize["status"], execute["status"], missing["status"]) == (200, 200, 404)
    assert "job_id" not in tokenize and "job_id" not in missing
    assert (execute["job_id"], execute["correlation_id"]) == (job_id, correlation_id)
    assert execute["msg"] == f"POST /execute 200 {execute['duration_ms']:.1f} ms"
    # To the end of the stream: at least as long as the client saw it streaming.
    assert execute["duration_ms"] >= streamed_s * 1000 > 0
    assert 0 < tokenize["duration_ms"] < execute["duration_ms"]


def test_no_access_log_writes_none(tmp_path: Path) -> None:
    with running(tmp_path, "--no-access-log", fork=True) as worker:
        requests_made(worker)
        time.sleep(0.2)
        assert access_lines(worker) == []
        assert "ready:" in worker.stderr()  # the other lines are still written
