"""Issue 29's metrics, read from a running worker with prometheus-client's own parser: the series vLLM's Grafana
dashboards query (rbee: for vllm:), with their labels: request successes by `finished_reason` and `model_name`,
time-to-first-token and inter-token histograms by `model_name`, the prefix cache's and preemptions' counters; and
every refused request (a 503 when busy, a 400, a 404) in rbee:request_failure_total by reason."""

import time
import uuid
from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from serving import EOS_PROMPT, LONG, PROMPT, running, sse_events, take_tokens

pytestmark = pytest.mark.slow

NAME = "dashboard-name"  # --served-model-name: the reported name, the metrics' model_name


@pytest.fixture(scope="module")
def http(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    """One slot and no queue: a second job while one runs is refused with 503 ALL_SLOTS_BUSY."""
    flags = ("--max-batch", "1", "--max-queue", "0", "--served-model-name", NAME)
    with (
        running(tmp_path_factory.mktemp("metrics"), *flags, fork=True) as worker,
        httpx.Client(base_url=worker.url, timeout=120) as http,
    ):
        yield http


def families(http: httpx.Client) -> dict[str, tuple[str, list[Sample]]]:
    """/metrics parsed: each family's type and samples, by family name."""
    text = http.get("/metrics").text
    return {family.name: (family.type, family.samples) for family in text_string_to_metric_families(text)}


def value(samples: list[Sample], name: str, **labels: str) -> float:
    """The one sample of `name` with exactly these labels."""
    [found] = [s.value for s in samples if s.name == name and s.labels == labels]
    return found


def wait_idle(http: httpx.Client) -> None:
    deadline = time.monotonic() + 30
    while http.get("/health").json()["state"] != "idle":
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_refusals_and_results_by_vllms_labels(http: httpx.Client) -> None:
    client = openai.OpenAI(base_url=str(http.base_url.join("/v1")), api_key="unused", max_retries=0, timeout=120)
    long_job = {"job_id": uuid.uuid4().hex, "prompt": PROMPT, "max_tokens": LONG, "temperature": 0}
    with http.stream("POST", "/execute", json=long_job) as running_job:
        # Held until the block ends: a reader of the stream that is dropped closes its connection, which cancels the
        # job at the worker's next write.
        events = sse_events(running_job)
        take_tokens(events, 2)  # the one slot is taken
        busy = [
            http.post("/execute", json={"job_id": uuid.uuid4().hex, "prompt": PROMPT}),
            http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}),
        ]
        take_tokens(events, 1)  # the job still ran after the refusals
        refusals = [(r.status_code, r.headers.get("retry-after")) for r in busy]
        assert refusals == [(503, "1"), (503, "1")], ([r.text for r in busy], http.get("/health").text)
    wait_idle(http)  # the client left: its job is cancelled (finished_reason abort)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=NAME, prompt=PROMPT, max_tokens=2, temperature=3)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=2)
    assert http.get("/no-such-route").status_code == 404
    assert http.post("/execute", content=b"{").status_code == 400
    length = client.completions.create(model="demo", prompt=PROMPT, max_tokens=3, temperature=0)
    stop = client.completions.create(model=NAME, prompt=EOS_PROMPT, max_tokens=64, temperature=0)
    assert (length.choices[0].finish_reason, stop.choices[0].finish_reason) == ("length", "stop")

    metrics = families(http)
    kind, failures = metrics["rbee:request_failure"]
    assert kind == "counter"
    refused = {(s.labels["reason"], s.labels["code"]): s.value for s in failures if s.name.endswith("_total")}
    assert refused == {("busy", "503"): 2, ("invalid_request", "400"): 2, ("not_found", "404"): 2}
    assert {s.labels["model_name"] for s in failures} == {NAME}

    kind, successes = metrics["rbee:request_success"]
    assert kind == "counter"
    total = "rbee:request_success_total"
    assert value(successes, total, model_name=NAME, finished_reason="length", stop_reason="MAX_TOKENS") == 1
    assert value(successes, total, model_name=NAME, finished_reason="stop", stop_reason="EOS") == 1
    assert value(successes, total, model_name=NAME, finished_reason="abort", stop_reason="CANCELLED") == 1

    # Three jobs ran (the cancelled one had its first tokens too), each with more than one token.
    for histogram in ("rbee:time_to_first_token_seconds", "rbee:inter_token_latency_seconds"):
        kind, samples = metrics[histogram]
        assert kind == "histogram"
        assert {s.labels["model_name"] for s in samples} == {NAME}
        observed = value(samples, f"{histogram}_count", model_name=NAME)
        assert observed == 3 if histogram.startswith("rbee:time_to_first") else observed >= 3
        assert value(samples, f"{histogram}_bucket", model_name=NAME, le="+Inf") == observed
    for gauge in ("rbee:num_requests_running", "rbee:num_requests_waiting", "rbee:kv_cache_usage_perc"):
        kind, samples = metrics[gauge]
        assert kind == "gauge" and value(samples, gauge, model_name=NAME) == 0
    # The engine's own counters (vLLM v1's names), by model_name too: the prompts above were looked up in the prefix
    # cache; one slot and short jobs preempt nothing.
    for counter in ("rbee:prefix_cache_queries", "rbee:prefix_cache_hits", "rbee:num_preemptions"):
        kind, samples = metrics[counter]
        assert kind == "counter" and [s.labels for s in samples if s.name.endswith("_total")] == [{"model_name": NAME}]
    assert value(metrics["rbee:prefix_cache_queries"][1], "rbee:prefix_cache_queries_total", model_name=NAME) > 0
    assert value(metrics["rbee:num_preemptions"][1], "rbee:num_preemptions_total", model_name=NAME) == 0
