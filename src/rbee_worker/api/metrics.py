"""GET /metrics (CONTRACT.md §5): Prometheus text from prometheus-client, in a registry of the worker's own.

Names and labels are vLLM's (v1, vllm/v1/metrics/loggers.py) with the prefix `rbee:` in place of `vllm:`, so that
vLLM's Grafana dashboards work unchanged on a worker:

- every series has the label `model_name`: the name the OpenAI API reports (--model-ref, else the first
  --served-model-name, else the model's own name; MODEL as given while the model loads);
- `rbee:request_success_total` (jobs that ended without an error) has `finished_reason`, vLLM's values for our stop
  reasons: EOS and STOP_SEQUENCE -> `stop`, MAX_TOKENS -> `length`, CANCELLED (a client that left, DELETE /cancel, a
  drain) -> `abort`. Deprecated, kept for one release: its former label `stop_reason` (EOS, MAX_TOKENS,
  STOP_SEQUENCE, CANCELLED) on the same samples; dashboards should move to `finished_reason`.

`rbee:request_failure_total{reason, code, model_name}` (not vLLM's) counts requests that did not succeed:

- a job that ended in an error: `reason` `job_error`, `code` its error code (INFERENCE_FAILED, VRAM_OOM, ...);
- a request refused before any job ran (counted by the access-log middleware, api/middleware.py, for every route):
  `code` its HTTP status, `reason` one of `invalid_request` (400), `unauthorized` (401), `not_found` (404: an unknown
  model, route or job), `method_not_allowed` (405), `conflict` (409: a job id already running, a stream already
  read), `too_large` (413), `busy`, `loading`, `draining`, `unhealthy` (the 503s of admission), `unavailable`
  (another 503), `client_error` (another 4xx) or `server_error` (another 5xx). /health's 503 reports the worker's
  condition and refuses nothing: it is not counted.

The KV block pool and the prefix cache, as vLLM v1 names them: `rbee:kv_cache_usage_perc` (the share of the pool's
blocks that running jobs hold), `rbee:prefix_cache_queries_total` and `rbee:prefix_cache_hits_total` (prompt tokens
looked up in the prefix cache, and of them found there: hits / queries is the hit rate) and
`rbee:num_preemptions_total` (running jobs preempted for want of free blocks).

Structured output (not vLLM's): `rbee:grammar_compilations_total` and `rbee:grammar_compile_seconds_total` (grammars
compiled, and the seconds that took), `rbee:grammar_cache_hits_total` (requests whose grammar the cache held, compiled
or compiling), `rbee:grammar_masks_total` and `rbee:grammar_mask_seconds_total` (allowed-token masks filled, one per
constrained token, and the host seconds they took: seconds / masks is what a mask adds to a constrained row's step).

Counters and histograms are fed by the engine thread through the EngineObserver methods below (prometheus-client
is thread-safe); the gauges and the engine's own counters (prefix cache, preemptions) are read from the engine when
scraped.
"""

from collections.abc import Callable, Iterator
from functools import cached_property

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from rbee_worker.api.native_schema import UNAUTHORIZED
from rbee_worker.engine.engine import Engine
from rbee_worker.engine.request_types import End, Error, Request, StopReason
from rbee_worker.engine.structured.grammar import GrammarStats

# Buckets in seconds: from a small model's decode step to long generations on big models.
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.4, 0.8, 2.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 240.0, 480.0)

FINISHED_REASONS = {
    StopReason.EOS: "stop",
    StopReason.STOP_SEQUENCE: "stop",
    StopReason.MAX_TOKENS: "length",
    StopReason.CANCELLED: "abort",
}
REFUSAL_REASONS = {
    400: "invalid_request",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "too_large",
    503: "unavailable",
}
JOB_ERROR = "job_error"


def refusal_reason(status: int, said: str | None) -> str:
    """The `reason` label of a refused request: what the route said (an admission refusal's reason), else its
    status's."""
    return said or REFUSAL_REASONS.get(status) or ("server_error" if status >= 500 else "client_error")


class Metrics:
    """The worker's metrics; an EngineObserver (first_token, next_token, finished). `watch` binds it to the engine
    and to the reported model name before the engine's first job."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        self.model_name: Callable[[], str] = lambda: ""
        self.prompt_tokens = Counter(
            "rbee:prompt_tokens", "Prompt tokens of finished jobs", ["model_name"], registry=registry
        )
        self.generation_tokens = Counter(
            "rbee:generation_tokens",
            "Tokens generated by finished jobs (end-of-sequence excluded)",
            ["model_name"],
            registry=registry,
        )
        self.success = Counter(
            "rbee:request_success",
            "Jobs that ended, by finished_reason (stop, length, abort); stop_reason is deprecated",
            ["model_name", "finished_reason", "stop_reason"],
            registry=registry,
        )
        self.failure = Counter(
            "rbee:request_failure",
            "Jobs that ended in an error (reason job_error, code: its error code) and requests refused before a job "
            "ran (code: the HTTP status)",
            ["model_name", "reason", "code"],
            registry=registry,
        )
        self.ttft = Histogram(
            "rbee:time_to_first_token_seconds",
            "From submission to the first sampled token",
            ["model_name"],
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.itl = Histogram(
            "rbee:inter_token_latency_seconds",
            "Between two sampled tokens of one job",
            ["model_name"],
            buckets=ITL_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            "rbee:e2e_request_latency_seconds",
            "From submission to the job's end",
            ["model_name"],
            buckets=E2E_BUCKETS,
            registry=registry,
        )

    def watch(
        self, engine: Engine, model_name: Callable[[], str], ranks: Callable[[], list[tuple[str, int]]] | None = None
    ) -> None:
        """Read the gauges and the engine's counters at each scrape; label every series with `model_name()`.
        `ranks`: each rank's device and memory bytes, in rank order (tensor parallelism: every process's)."""
        self.model_name = model_name
        self.registry.register(EngineGauges(engine, model_name, ranks))

    def refused(self, status: int, reason: str) -> None:
        """A request answered `status` before any job ran (called on the HTTP thread)."""
        self.failure.labels(model_name=self.model_name(), reason=reason, code=str(status)).inc()

    # -- EngineObserver, called on the engine thread ---------------------------------------------------------------

    @cached_property
    def _ttft(self) -> Histogram:
        """The labelled series, looked up once: tokens only come once the model, and so its name, is loaded."""
        return self.ttft.labels(model_name=self.model_name())

    @cached_property
    def _itl(self) -> Histogram:
        return self.itl.labels(model_name=self.model_name())

    def first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def next_token(self, seconds: float) -> None:
        self._itl.observe(seconds)

    def finished(self, request: Request, terminal: End | Error, seconds: float) -> None:
        name = self.model_name()
        self.prompt_tokens.labels(model_name=name).inc(len(request.prompt_ids))
        self.e2e.labels(model_name=name).observe(seconds)
        if isinstance(terminal, End):
            self.generation_tokens.labels(model_name=name).inc(terminal.tokens_out)
            finished = FINISHED_REASONS[terminal.stop_reason]
            self.success.labels(model_name=name, finished_reason=finished, stop_reason=terminal.stop_reason.value).inc()
        else:
            self.failure.labels(model_name=name, reason=JOB_ERROR, code=terminal.code.value).inc()


class EngineGauges(Collector):
    """The gauges and the counters the engine keeps itself (prefix cache, preemptions), read from the engine at each
    scrape and labelled with the model name of that moment."""

    def __init__(
        self, engine: Engine, model_name: Callable[[], str], ranks: Callable[[], list[tuple[str, int]]] | None = None
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.ranks = ranks

    def collect(self) -> Iterator[Metric]:
        engine, name = self.engine, self.model_name()
        running = engine.running_requests
        yield gauge("rbee:num_requests_running", "Jobs running in the engine", name, running)
        waiting = max(0, engine.in_flight - running)
        yield gauge("rbee:num_requests_waiting", "Jobs waiting for a running slot", name, waiting)
        usage = engine.kv_cache_usage()
        yield gauge(
            "rbee:kv_cache_usage_perc", "Share of the KV cache's blocks that running jobs hold (0..1)", name, usage
        )
        queries, hits = engine.prefix_cache_tokens()
        yield counter("rbee:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", name, queries)
        yield counter(
            "rbee:prefix_cache_hits", "Prompt tokens found in the prefix cache, of those looked up", name, hits
        )
        yield counter(
            "rbee:num_preemptions",
            "Running jobs preempted for want of free KV blocks (their blocks freed, their tokens computed again later)",
            name,
            engine.preemptions,
        )
        grammars = engine.model.grammars.stats if engine.is_loaded else GrammarStats()
        yield counter("rbee:grammar_compilations", "Grammars compiled (structured output)", name, grammars.compilations)
        yield counter(
            "rbee:grammar_compile_seconds", "Seconds spent compiling grammars", name, grammars.compile_seconds
        )
        yield counter("rbee:grammar_cache_hits", "Requests whose grammar the cache held", name, grammars.cache_hits)
        yield counter("rbee:grammar_masks", "Allowed-token masks filled for constrained tokens", name, grammars.masks)
        yield counter(
            "rbee:grammar_mask_seconds", "Host seconds spent filling allowed-token masks", name, grammars.mask_seconds
        )
        memory = GaugeMetricFamily(
            "rbee:memory_bytes",
            "Memory the model holds, by part: the weights, the KV cache, and the host prompt cache of llama.cpp's "
            "saved prompt states (as /health reports them)",
            labels=["model_name", "part"],
        )
        memory.add_metric([name, "weights"], engine.loaded.info.weight_bytes if engine.is_loaded else 0)
        memory.add_metric([name, "kv_cache"], engine.kv_cache_bytes())
        memory.add_metric([name, "prompt_cache"], engine.prompt_cache_bytes())
        yield memory
        by_rank = GaugeMetricFamily(
            "rbee:rank_memory_bytes",
            "Memory each process holds (weights and KV cache; under tensor parallelism one series per rank), by rank "
            "and device; their sum is rbee:memory_bytes' parts",
            labels=["model_name", "rank", "device"],
        )
        for rank, (device, held) in enumerate(self.ranks() if self.ranks is not None else []):
            by_rank.add_metric([name, str(rank), device], held)
        yield by_rank


def gauge(metric: str, documentation: str, model_name: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(metric, documentation, labels=["model_name"])
    family.add_metric([model_name], value)
    return family


def counter(metric: str, documentation: str, model_name: str, value: float) -> CounterMetricFamily:
    """A counter the engine keeps, exposed as `<metric>_total`."""
    family = CounterMetricFamily(metric, documentation, labels=["model_name"])
    family.add_metric([model_name], value)
    return family


def metrics_router(metrics: Metrics) -> APIRouter:
    router = APIRouter()

    @router.get(
        "/metrics",
        response_class=Response,
        responses={
            **UNAUTHORIZED,
            200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}}},
        },
        summary="Prometheus metrics",
    )
    async def scrape() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return router
