"""`rbee-worker serve`'s settings: one object, built once from the command line and read where each one applies."""

from dataclasses import dataclass

from rbee_worker.devices import Placement
from rbee_worker.engine.config import EngineConfig


@dataclass(frozen=True)
class WorkerConfig:
    """The engine's settings as they are handed to it, and the rest: what to load, how to serve, whom to tell."""

    engine: EngineConfig
    # The model.
    model: str  # MODEL as given: a directory, a .gguf file, a hub id or `demo`
    placement: Placement
    quantize: str  # auto | none | int8 | int4
    runtime: str  # auto | torch | llama.cpp (models/loader.py resolve_runtime)
    max_context: int | None  # None: the model's own context
    chat_template: str | None  # None: the model's own
    # The HTTP server.
    host: str  # for the URL reported to the pool manager; the socket is bound by the caller
    api_token: str | None  # LLORCH_API_TOKEN: when set, every route but GET /health needs it
    model_ref: str | None  # the model name reported to clients; None: the loaded model's own name
    served_model_names: tuple[str, ...]  # --served-model-name: more names the OpenAI API answers to
    access_log: bool  # a log line for each HTTP request
    max_request_bytes: int | None  # a larger request body gets 413; None: from the model (models/prompt_bound.py)
    drain_timeout_s: float  # on a stop request, how long running jobs may finish before they are cancelled
    stall_timeout_s: float  # an engine with work and no finished step for this long is unhealthy
    unclaimed_job_timeout_s: float  # a job API job whose stream nobody opens is cancelled after this
    # The pool manager.
    worker_id: str | None  # None: <host name>-<port>
    callback_url: str | None
    callback_timeout_s: float
    heartbeat_url: str | None
    heartbeat_interval_s: float
    # Tensor parallelism (engine/tp_ranks.py): the model split over this many processes in all, spread evenly
    # over `nnodes` nodes (this one is `node_rank`: 0 serves HTTP, the others only run their ranks), joined at
    # master_addr:master_port (None: a free port, on one node); `devices`: each local rank's CUDA device index (None:
    # from placement's index upward). Their logs as rank 0's.
    tensor_parallel: int = 1
    devices: tuple[int, ...] | None = None
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    log_level: str = "info"
    log_format: str | None = None
