"""What both HTTP APIs share about the running worker: its engine, its settings, its condition and its open jobs."""

import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from rbee_worker.engine.engine import Engine
from rbee_worker.engine.request_types import Event
from rbee_worker.loading.progress import LoadProgress
from rbee_worker.loading.prompt_bound import request_bytes_limit
from rbee_worker.server.worker_config import WorkerConfig

# Threads that prepare requests (parse, render the chat template, tokenize) off the event loop. The tokenizer releases
# the GIL while it encodes, so preparations run beside the streams and beside each other.
PREPARE_THREADS = 4


@dataclass
class Job:
    """An admitted job (already submitted to the engine); its events wait in `events` until its one reader comes."""

    job_id: str
    events: AsyncIterator[Event]
    reader_attached: bool = False


@dataclass
class WorkerState:
    """The worker as the routes see it; the server owns it and flips `draining` when a stop is requested."""

    engine: Engine
    worker_id: str
    config: WorkerConfig
    progress: LoadProgress = field(default_factory=LoadProgress)
    request_shutdown: Callable[[], None] = lambda: None  # POST /shutdown; the server sets it
    devices: Callable[[], list[str]] | None = None  # every rank's device (tensor parallelism); the server sets it
    draining: bool = False
    started_at: int = field(default_factory=lambda: int(time.time()))  # Unix time: /v1/models' `created`
    jobs: dict[str, Job] = field(default_factory=dict)  # job API jobs whose stream is not yet read to the end
    open_streams: int = 0  # SSE job streams being written
    preparing: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="rbee-prepare")
    )

    def max_request_bytes(self) -> int | None:
        """The largest request body taken: --max-request-bytes, else, once the model is loaded, the largest body of a
        request whose prompt fits the context (loading/prompt_bound.py); None (no limit) while it loads."""
        if self.config.max_request_bytes is not None:
            return self.config.max_request_bytes
        if not self.engine.is_loaded:
            return None
        return request_bytes_limit(self.engine.loaded.prompt_bound, self.engine.model.context_length)

    @property
    def model_ref(self) -> str:
        """--model-ref, else the model's own name, known from the moment the engine reports it loaded (so /health,
        /v1/models and request checks never see MODEL in its place); MODEL as given before that."""
        if self.config.model_ref is not None:
            return self.config.model_ref
        return self.engine.loaded.info.name if self.engine.is_loaded else self.config.model.name

    @property
    def model_name(self) -> str:
        """The name the OpenAI API reports (responses' `model`, the first of /v1/models) and the metrics' `model_name`
        label: --model-ref, else the first --served-model-name, else what `model_ref` says."""
        if self.config.model_ref is None and self.config.served_model_names:
            return self.config.served_model_names[0]
        return self.model_ref

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name the OpenAI API answers to, `model_name` first, each once: the --served-model-name names, MODEL
        as given (`demo`, a path, a hub id), --model-ref and the loaded model's own name, as vLLM and llama-server
        users expect."""
        own = (self.engine.loaded.info.name,) if self.engine.is_loaded else ()
        model_ref = (self.config.model_ref,) if self.config.model_ref is not None else ()
        names = (self.model_name, *self.config.served_model_names, self.config.model.name, *model_ref, *own)
        return tuple(dict.fromkeys(names))

    def condition(self) -> str:
        """loading, draining, unhealthy or healthy: what /health, /v1/ready and the heartbeat report."""
        if self.engine.fault is not None:
            return "unhealthy"
        if not self.engine.is_loaded:
            return "draining" if self.draining else "loading"
        if self.draining:
            return "draining"
        if self.engine.seconds_without_progress() > self.config.stall_timeout_s:
            return "unhealthy"
        return "healthy"

    def unhealthy_reason(self) -> str:
        """Why the worker is unhealthy: its device failed, or the engine makes no progress."""
        if self.engine.fault is not None:
            return self.engine.fault_message()
        return (
            f"the engine has finished no step for {self.engine.seconds_without_progress():.1f} s with "
            f"{self.engine.in_flight} job(s) in flight"
        )

    def activity(self) -> str:
        """busy while the engine has a job in flight, idle otherwise."""
        return "busy" if self.engine.in_flight else "idle"

    def busy(self) -> bool:
        """Work that a drain waits for: jobs in the engine, streams being written, job API jobs not yet read."""
        return bool(self.engine.in_flight or self.open_streams or self.jobs)
