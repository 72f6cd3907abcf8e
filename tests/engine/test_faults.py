"""Faults injected into a real worker process on the demo model (tests/fault_worker.py): a forward that fails once, a
runtime context that cannot decode any more, a bug in output processing. The pool manager is a real HTTP server."""

import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from serving import LONG, PROMPT, Manager, Stream, execute, launch

STREAMS = 3


def execute_together(url: str, count: int, max_tokens: int) -> list[Stream]:
    """`count` /execute streams started together, each read to its end."""
    streams: list[Stream | None] = [None] * count

    def one(i: int) -> None:
        with httpx.Client(base_url=url, timeout=60) as http:
            streams[i] = execute(http, prompt=f"{PROMPT} {i}", max_tokens=max_tokens, temperature=0)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [s for s in streams if s is not None]


def test_a_context_that_cannot_decode_makes_the_worker_unhealthy_and_exit(tmp_path: Path) -> None:
    """From its 20th step on llama_decode fails with a fatal code: every request in flight ends with an error event,
    /health answers 503 unhealthy with the reason within 2 s, the pool manager gets an unhealthy heartbeat at once,
    and the worker exits non-zero within 10 s."""
    manager = Manager([200])
    worker = launch(
        tmp_path,
        "--callback-url", f"{manager.url}/ready",
        "--heartbeat-url", f"{manager.url}/beat",
        "--heartbeat-interval", "30",
        fault="poison:20",
        fork=True,
    )  # fmt: skip
    try:
        worker.wait_healthy()
        health: list[tuple[float, int, dict]] = []
        polling = threading.Event()

        def poll() -> None:
            with httpx.Client(base_url=worker.url, timeout=5) as http:
                while not polling.is_set():
                    try:
                        response = http.get("/health")
                    except httpx.TransportError:  # the worker has exited
                        return
                    health.append((time.monotonic(), response.status_code, response.json()))
                    time.sleep(0.05)

        poller = threading.Thread(target=poll)
        poller.start()
        streams = execute_together(worker.url, STREAMS, LONG)
        failed_at = time.monotonic()
        for stream in streams:
            assert stream.terminal["type"] == "error" and stream.terminal["code"] == "INFERENCE_FAILED", stream.events
            assert "llama.cpp's context cannot decode" in stream.terminal["message"]
        worker.process.wait(timeout=10)
        exited_at = time.monotonic()
        polling.set()
        poller.join()
    finally:
        if worker.process.poll() is None:
            worker.process.kill()
        manager.close()
    assert worker.process.returncode not in (0, None), worker.stderr()
    assert exited_at - failed_at < 10
    unhealthy = [(at, body) for at, status, body in health if status == 503 and body["status"] == "unhealthy"]
    assert unhealthy and unhealthy[0][0] - failed_at < 2, health[-5:]
    assert "context cannot decode" in unhealthy[0][1]["message"]
    beats = [beat.body for beat in manager.recorded("/beat")]
    assert beats[-1]["health_status"] == "unhealthy" and beats[-1]["state"] == "error", beats
    assert "context cannot decode" in beats[-1]["message"]
    assert [line for line in worker.stderr().splitlines() if line.startswith("error:")] != []


def test_a_forward_that_fails_once_fails_its_requests_and_the_worker_stays_healthy(tmp_path: Path) -> None:
    worker = launch(tmp_path, fault="once:12", fork=True)
    try:
        worker.wait_healthy()
        streams = execute_together(worker.url, STREAMS, 24)
        terminals = [s.terminal for s in streams]
        assert any(t["type"] == "error" for t in terminals), terminals
        for terminal in terminals:
            assert terminal["type"] == "end" or (
                terminal["code"] == "INFERENCE_FAILED" and "injected failure" in terminal["message"]
            ), terminal
        with httpx.Client(base_url=worker.url, timeout=60) as http:
            assert http.get("/health").status_code == 200
            again = execute(http, prompt=PROMPT, max_tokens=8, temperature=0)
            assert again.terminal["type"] == "end" and again.terminal["tokens_out"] == 8
    finally:
        code = worker.stop()
    assert code == 0, worker.stderr()


def test_a_bug_in_output_processing_is_an_internal_error_of_its_request(tmp_path: Path) -> None:
    worker = launch(tmp_path, fault="output:3", fork=True)
    try:
        worker.wait_healthy()
        with httpx.Client(base_url=worker.url, timeout=60) as http:
            broken = execute(http, prompt=PROMPT, max_tokens=8, temperature=0)
            assert broken.terminal["type"] == "error" and broken.terminal["code"] == "INTERNAL_ERROR"
            assert "injected bug" in broken.terminal["message"]
            assert http.get("/health").status_code == 200
            again = execute(http, prompt=PROMPT, max_tokens=8, temperature=0)
            assert again.terminal["type"] == "end" and again.terminal["tokens_out"] == 8
    finally:
        code = worker.stop()
    assert code == 0
    log = worker.stderr()
    assert "internal error while processing the output" in log and "Traceback" in log and "KeyError" in log


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cuda_error_that_persists_makes_the_worker_unhealthy_and_exit(tmp_path: Path) -> None:
    """A device-side assert in the 30th decode step leaves the CUDA context unusable: every request in flight ends
    with an error event, /health says unhealthy within 2 s, and the worker exits non-zero within 10 s."""
    worker = launch(tmp_path, "--device", "cuda", "--no-compile", fault="cuda:30")
    try:
        worker.wait_healthy(timeout=300)
        streams = execute_together(worker.url, STREAMS, LONG)
        failed_at = time.monotonic()
        for stream in streams:
            assert stream.terminal["type"] == "error" and stream.terminal["code"] == "INFERENCE_FAILED", stream.events
            assert "CUDA" in stream.terminal["message"]
        try:
            health = httpx.get(f"{worker.url}/health", timeout=2)
            assert health.status_code == 503 and health.json()["status"] == "unhealthy"
        except httpx.TransportError:  # already exited
            pass
        assert time.monotonic() - failed_at < 2
        worker.process.wait(timeout=10)
    finally:
        if worker.process.poll() is None:
            worker.process.kill()
    assert worker.process.returncode not in (0, None), worker.stderr()
