"""One request never stalls the others: oversized requests are refused before they are parsed or tokenized, prompts
are prepared off the event loop, and a grammar past its compile time limit is refused and stopped."""

import itertools
import threading
import time
from collections.abc import Iterator

import httpx
import psutil
import pytest
from serving import PROMPT, Worker, running, sse_events

# Seconds past the compile limit below on any machine: an enum of 40,000 distinct strings, whose trie xgrammar builds
# and checks against every token (a pattern's bounded repetition, `[a-z]{1,60000}`, compiles in 0.4 s whatever its
# bound on xgrammar 0.2.9, too close to the limit).
SLOW_SCHEMA = {"enum": [f"w{i}x{i * 7919 % 100003}" for i in range(40_000)]}
COMPILE_LIMIT_S = 0.5
BIG = 20 * 2**20


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    log_dir = tmp_path_factory.mktemp("isolation")
    with running(log_dir, "--grammar-compile-timeout", str(COMPILE_LIMIT_S), fork=True) as worker:
        yield worker


class Traffic:
    """A streamed completion whose token arrival times are kept, and a small completion sent every quarter second
    whose answer times are kept, both in threads, until `stop`."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.arrivals: list[float] = []
        self.small: list[tuple[int, float]] = []  # status, seconds
        self.streaming = threading.Event()
        self.done = threading.Event()
        self.threads = [threading.Thread(target=self.stream), threading.Thread(target=self.smalls)]

    def __enter__(self) -> "Traffic":
        for thread in self.threads:
            thread.start()
        assert self.streaming.wait(60), "the stream did not start"
        return self

    def __exit__(self, *_: object) -> None:
        self.done.set()
        for thread in self.threads:
            thread.join(120)

    def stream(self) -> None:
        body = {"prompt": PROMPT, "max_tokens": 2000, "temperature": 0, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=120) as response:
            for arrived, event in sse_events(response):
                self.arrivals.append(arrived)
                self.streaming.set()
                if self.done.is_set() or event == "[DONE]":
                    return

    def smalls(self) -> None:
        body = {"prompt": "Bees", "max_tokens": 2, "temperature": 0}
        with httpx.Client(timeout=30) as client:
            while not self.done.wait(0.25):
                started = time.monotonic()
                status = client.post(f"{self.url}/v1/completions", json=body).status_code
                self.small.append((status, time.monotonic() - started))

    def longest_gap(self, since: float) -> float:
        times = [t for t in self.arrivals if t >= since]
        return max(b - a for a, b in itertools.pairwise(times))


def timed_post(url: str, body: dict) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    response = httpx.post(url, json=body, timeout=60)
    return response, time.monotonic() - started


def test_oversized_requests_are_refused_at_once_while_others_flow(worker: Worker) -> None:
    context = httpx.get(f"{worker.url}/v1/models", timeout=10).json()["data"][0]["max_model_len"]
    huge, large = "bee " * (BIG // 4), "bee " * (2**20 // 4)  # over the body limit; under it, over the context
    with Traffic(worker.url) as traffic:
        started = time.monotonic()
        refusals = [
            timed_post(f"{worker.url}/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]}),
            timed_post(f"{worker.url}/v1/completions", {"prompt": huge, "max_tokens": 4}),
            timed_post(f"{worker.url}/v1/chat/completions", {"messages": [{"role": "user", "content": large}]}),
            timed_post(f"{worker.url}/v1/completions", {"prompt": large, "max_tokens": 4}),
        ]
        time.sleep(1.0)  # the traffic after them, too
    statuses = [response.status_code for response, _ in refusals]
    assert statuses == [413, 413, 400, 400], [r.text[:300] for r, _ in refusals]
    assert all(seconds < 2.0 for _, seconds in refusals), [seconds for _, seconds in refusals]
    first, second = refusals[0][0].json()["error"], refusals[2][0].json()["error"]
    assert first["code"] == "REQUEST_TOO_LARGE" and "--max-request-bytes" in first["message"]
    assert "maximum context length is" in second["message"] and second["param"] == "messages"
    assert refusals[3][0].json()["error"]["param"] == "prompt"
    assert str(context) in second["message"]
    assert traffic.longest_gap(started) < 0.5, traffic.longest_gap(started)
    assert len(traffic.small) >= 4 and all(status == 200 and s < 1.0 for status, s in traffic.small), traffic.small


def test_a_grammar_past_its_compile_limit_is_refused_and_stopped(worker: Worker) -> None:
    body = {
        "messages": [{"role": "user", "content": "A word?"}],
        "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SLOW_SCHEMA}},
    }
    response, seconds = timed_post(f"{worker.url}/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "response_format" and "took longer than 0.5 s to compile" in error["message"]
    assert seconds < 10  # the fork server's first start included
    process = psutil.Process(worker.process.pid)
    tree = [process, *process.children(recursive=True)]
    before = sum(sum(p.cpu_times()[:2]) for p in tree)
    time.sleep(1.0)
    after = sum(sum(p.cpu_times()[:2]) for p in tree if p.is_running())
    assert after - before < 0.3, f"the worker's processes used {after - before:.2f} s of CPU in 1 s while idle"
    ok = {**body, "response_format": {"type": "json_object"}}
    assert httpx.post(f"{worker.url}/v1/chat/completions", json=ok, timeout=60).status_code == 200


def test_the_native_job_route_takes_the_body_limit_too(worker: Worker) -> None:
    response, seconds = timed_post(f"{worker.url}/execute", {"job_id": "big", "prompt": "bee " * (BIG // 4)})
    assert response.status_code == 413 and seconds < 2.0
