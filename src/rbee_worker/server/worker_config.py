"""`rbee-worker serve`'s settings: one object, resolved once from the command line (cli/serve.py resolve) and read as
it is by the server, the loader, the tensor-parallel ranks and the HTTP routes."""

from dataclasses import dataclass

from rbee_worker.engine.engine_config import EngineConfig
from rbee_worker.engine.parallel.tp_messages import Topology
from rbee_worker.loading.spec import ModelSpec


@dataclass(frozen=True)
class WorkerConfig:
    """The engine's settings as they are handed to it, the model as probed, and the rest: how to serve, whom to tell,
    where the ranks run."""

    engine: EngineConfig
    model: ModelSpec  # what to load and how: its path, format, runtime, quantization, placement, context, template
    # The HTTP server.
    host: str  # for the URL reported to the pool manager; the socket is bound by the caller
    api_token: str | None  # LLORCH_API_TOKEN: when set, every route but GET /health needs it
    model_ref: str | None  # the model name reported to clients; None: the loaded model's own name
    served_model_names: tuple[str, ...]  # --served-model-name: more names the OpenAI API answers to
    access_log: bool  # a log line for each HTTP request
    max_request_bytes: int | None  # a larger request body gets 413; None: from the model (loading/prompt_bound.py)
    drain_timeout_s: float  # on a stop request, how long running jobs may finish before they are cancelled
    stall_timeout_s: float  # an engine with work and no finished step for this long is unhealthy
    unclaimed_job_timeout_s: float  # a job API job whose stream nobody opens is cancelled after this
    # The pool manager.
    worker_id: str | None  # None: <host name>-<port>
    callback_url: str | None
    callback_timeout_s: float
    heartbeat_url: str | None
    heartbeat_interval_s: float
    # Tensor parallelism (engine/parallel/ranks.py): the model split over topology.world processes, spread over its
    # nodes (this one's node_rank 0 serves HTTP, the others only run their ranks). Their logs as rank 0's.
    topology: Topology
    log_level: str = "info"
    log_format: str | None = None
