"""`rbee-worker serve`: bind the port, load the model in the engine thread while the port already answers, then
report ready to the pool manager and keep the heartbeat going."""

import asyncio
import contextlib
import json
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from http import HTTPStatus
from types import FrameType
from typing import TYPE_CHECKING

import httpx
import psutil
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rbee_worker import __version__
from rbee_worker.api.api_error import ApiError
from rbee_worker.api.embeddings import embeddings_router
from rbee_worker.api.metrics import Metrics, metrics_router
from rbee_worker.api.middleware import AccessLog, AuthAndCorrelation, BodyLimit, JsonBodies
from rbee_worker.api.native import native_router
from rbee_worker.api.native_validation import json_error_message
from rbee_worker.api.openai import openai_router
from rbee_worker.api.responses import responses_router
from rbee_worker.api.state import WorkerState
from rbee_worker.cli.exits import EXIT_FAILURE, exit_at_once
from rbee_worker.engine.engine import Engine
from rbee_worker.engine.runners.protocol import DeviceFault
from rbee_worker.errors import RegistrationError
from rbee_worker.hardware.cpu_features import cpu_features
from rbee_worker.loading.loaded import LoadedModel
from rbee_worker.loading.loader import load_spec
from rbee_worker.loading.progress import LoadProgress
from rbee_worker.loading.spec import ModelSpec
from rbee_worker.server.listener import advertised_url
from rbee_worker.server.pool_client import (
    HeartbeatStatus,
    ReadyPayload,
    heartbeat_loop,
    send_heartbeat,
    send_ready_callback,
)
from rbee_worker.server.worker_config import WorkerConfig

if TYPE_CHECKING:  # torch.distributed, only under --tensor-parallel
    from rbee_worker.engine.parallel.ranks import Ranks

log = logging.getLogger(__name__)

POLL_S = 0.05
CANCELLED_STREAMS_GRACE_S = 5.0  # after a drain cancels what is left, how long its streams get to send the end
SHUTDOWN_GRACE_S = 5.0  # then how long uvicorn waits for connections to close
FAULT_STREAMS_GRACE_S = 3.0  # after a device fault, how long the failed requests' streams get to send their error
FAULT_HEALTH_S = 1.0  # and the least time /health then answers 503 `unhealthy` (with the reason) before the exit
RANK_FAULT_GRACE_S = 10.0  # after a tensor-parallel rank's exit, how long the engine gets to stop before the process


def build_app(state: WorkerState, metrics: Metrics) -> FastAPI:
    app = FastAPI(
        title="rbee-worker",
        version=__version__,
        description="LLM inference worker: the rbee native API and an OpenAI-compatible API on one engine.",
    )
    app.include_router(native_router(state))
    app.include_router(openai_router(state))
    app.include_router(responses_router(state))
    app.include_router(embeddings_router(state))
    app.include_router(metrics_router(metrics))
    app.add_middleware(JsonBodies)
    app.add_middleware(BodyLimit, limit=state.max_request_bytes)
    app.add_middleware(AuthAndCorrelation, token=state.config.api_token)
    app.add_middleware(AccessLog, metrics=metrics, log=state.config.access_log)  # the last added is the outermost

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        """The pydantic-validated routes (the OpenAI API) answer 400 in OpenAI's error shape, not FastAPI's 422."""
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Errors of the framework itself (no such route, wrong method, a body it cannot read) as JSON in the shape
        both APIs share: `error.code` and `error.message` (native), plus `type` and `param` (OpenAI)."""
        try:
            code = HTTPStatus(exc.status_code).name
        except ValueError:
            code = str(exc.status_code)
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        error = {"message": str(exc.detail), "type": kind, "param": None, "code": code}
        return JSONResponse({"error": error}, status_code=exc.status_code, headers=exc.headers)

    def openapi() -> dict:
        """FastAPI's document without the 422 responses it adds by default: this app answers those with 400."""
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            for operation in (op for path in document["paths"].values() for op in path.values()):
                operation["responses"].pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                document.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi
    return app


def validation_error(exc: RequestValidationError) -> ApiError:
    """Every problem of the body in one message, the first one's field as `param`; a body that is not JSON in the
    native API's words (FastAPI reports the character offset as the field)."""
    problems, params = [], []
    for error in exc.errors():
        if error["type"] == "json_invalid":
            position = error["loc"][-1]
            return ApiError(400, json_error_message(json.JSONDecodeError(error["ctx"]["error"], exc.body, position)))
        location = ".".join(str(part) for part in error["loc"] if part != "body")
        params.append(location or None)
        message = str(error["msg"]).removeprefix("Value error, ")
        problems.append(f"{location}: {message}" if location else message)
    return ApiError(400, "; ".join(problems) or "invalid request body", param=params[0] if params else None)


class _Server(uvicorn.Server):
    """uvicorn's server, except that SIGTERM / SIGINT start the worker's drain instead of uvicorn's own shutdown
    (which would also re-raise the signal afterwards and kill the process with it instead of exiting 0)."""

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[], None]) -> None:
        super().__init__(config)
        self.on_signal = on_signal

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.on_signal()


def serve(config: WorkerConfig, sock: socket.socket) -> None:
    """Run the worker until it is stopped: a drain (signal or POST /shutdown) ends in a normal return.

    Raises RegistrationError (exit 3) or ModelLoadError (exit 2) once the server has shut down.
    """
    port = sock.getsockname()[1]
    worker_id = config.worker_id or f"{socket.gethostname()}-{port}"
    progress = LoadProgress()
    metrics = Metrics()

    def load(spec: ModelSpec) -> LoadedModel:
        return load_spec(spec, progress)

    if config.topology.world > 1:
        from rbee_worker.engine.parallel.ranks import start_ranks  # torch.distributed: imported where it is used

        ranks = start_ranks(config)
    else:
        ranks = None
    if ranks is None:
        engine = Engine(lambda: load(config.model), config.engine, observer=metrics)
    else:
        from rbee_worker.engine.parallel.tp_runners import runner_factory

        engine = Engine(lambda: ranks.load(load), config.engine, observer=metrics, runner=runner_factory(ranks))
        ranks.watch(lambda reason: rank_failed(engine, ranks, reason))
    state = WorkerState(engine=engine, worker_id=worker_id, config=config, progress=progress)
    if ranks is not None:
        state.devices = lambda: ranks.devices
    metrics.watch(engine, lambda: state.model_name, rank_memory(engine, ranks))
    app = build_app(state, metrics)
    server_config = uvicorn.Config(
        app, log_config=None, access_log=False, lifespan="off", timeout_graceful_shutdown=SHUTDOWN_GRACE_S
    )
    failures: list[Exception] = []  # what stopped the worker, re-raised once the server is down
    hurry = asyncio.Event()  # a second shutdown request: cancel what runs now instead of waiting
    drain_task: asyncio.Task | None = None

    def request_shutdown() -> None:
        """Start the drain (on the event loop's thread); asked again, stop waiting for running jobs, or, while the
        model still loads (no job can run yet), end the process at once."""
        nonlocal drain_task
        if drain_task is None:
            drain_task = asyncio.create_task(drain())
        elif not engine.load_finished:
            log.info("stopping at once: asked again while the model loads")
            exit_at_once(0)
        else:
            hurry.set()

    state.request_shutdown = request_shutdown

    async def drain() -> None:
        """Stop admitting, let running jobs finish for up to --drain-timeout, cancel the rest, then stop. While the
        model loads: cancel the load and wait for the engine thread to leave it (a stage that cannot be interrupted,
        such as llama.cpp creating its context, finishes first), so that nothing it logs follows the server's end."""
        state.draining = True
        if not engine.load_finished:
            log.info("stopping: the model load is cancelled")
            progress.cancel()
            await until(lambda: engine.load_finished, float("inf"), None)
        log.info("draining: %d job(s) in flight, waiting up to %.0f s", engine.in_flight, config.drain_timeout_s)
        await until(lambda: not state.busy(), config.drain_timeout_s, hurry)
        if state.busy():
            log.warning("drain: cancelling %d job(s) still running", engine.in_flight)
            engine.cancel_all()
            for job_id in [j for j, job in state.jobs.items() if not job.reader_attached]:
                del state.jobs[job_id]  # nobody will read these
            await until(lambda: not (engine.in_flight or state.open_streams), CANCELLED_STREAMS_GRACE_S, None)
        server.should_exit = True

    async def lifecycle() -> None:
        """Wait for the model, register with the pool manager, then beat until the server stops."""
        while not engine.load_finished:  # polled, not awaited in a thread that a shutdown would have to join
            await asyncio.sleep(POLL_S)
        if state.draining:  # stopped while loading: there is nothing to report, and the drain ends the server
            return
        try:
            loaded = engine.loaded
        except Exception as exc:
            failures.append(exc)
            server.should_exit = True
            return
        url = advertised_url(config.host, port, config.callback_url)
        fields = {"worker_id": worker_id, "url": url, "runtime": loaded.info.runtime}
        fields |= {"weight_bytes": loaded.info.weight_bytes, "active_weight_bytes": loaded.info.active_weight_bytes}
        fields |= {"kv_cache_bytes": engine.kv_cache_bytes()}
        # What a user waits for: from the process's start (imports included) to healthy, beside the weights' load.
        fields |= {"startup_s": round(time.time() - psutil.Process().create_time(), 2)}
        fields |= {"weights_load_s": round(loaded.info.load_seconds, 2)}
        log.info(
            "ready: %s on %s (%s runtime) at %s, %.1f s after the process started (weights loaded in %.2f s; %.0f MiB "
            "of weights, %.0f MiB of KV cache)",
            state.model_ref,
            loaded.info.device,
            loaded.info.runtime,
            url,
            fields["startup_s"],
            loaded.info.load_seconds,
            loaded.info.weight_bytes / 2**20,
            fields["kv_cache_bytes"] / 2**20,
            extra={"fields": fields},
        )
        if config.callback_url:
            memory = engine.memory_bytes()
            payload = ReadyPayload(
                worker_id=worker_id,
                model_ref=state.model_ref,
                url=url,
                vram_bytes=memory if loaded.info.device.type == "cuda" else 0,
                memory_bytes=memory,
                weight_bytes=loaded.info.weight_bytes,
                active_weight_bytes=loaded.info.active_weight_bytes,
                backend=loaded.info.device.type,
                device=str(loaded.info.device),
                devices=state.devices() if state.devices else [str(loaded.info.device)],
                runtime=loaded.info.runtime,
                cpu=cpu_features().describe(),
            )
            try:
                await send_ready_callback(config.callback_url, payload, timeout_s=config.callback_timeout_s)
            except RegistrationError as exc:  # the CLI turns it into exit 3 once the server is down
                failures.append(exc)
                server.should_exit = True
                return
        if config.heartbeat_url:
            await heartbeat_loop(config.heartbeat_url, config.heartbeat_interval_s, heartbeat_status)

    def heartbeat_status() -> HeartbeatStatus:
        """unhealthy (the device failed: the worker stops), degraded (no progress for a while) or healthy; draining
        shows in `state`."""
        if engine.fault is not None:
            return HeartbeatStatus(worker_id, "unhealthy", "error", state.unhealthy_reason())
        if state.condition() == "unhealthy":
            return HeartbeatStatus(worker_id, "degraded", state.activity(), state.unhealthy_reason())
        return HeartbeatStatus(worker_id, "healthy", "draining" if state.draining else state.activity())

    async def watch_for_fault() -> None:
        """Once the device has failed (the engine has failed every request and stopped): report it to the pool
        manager at once, give the failed requests' streams a moment to send their error (and whoever polls /health
        FAULT_HEALTH_S to read why), then stop the worker with an error, so that the pool manager starts another."""
        while engine.fault is None:
            await asyncio.sleep(POLL_S)
        failed_at = time.monotonic()
        if config.heartbeat_url and (error := await send_heartbeat(config.heartbeat_url, heartbeat_status())):
            log.warning("the unhealthy heartbeat to %s failed: %s", config.heartbeat_url, error)
        await until(lambda: not state.open_streams, FAULT_STREAMS_GRACE_S, None)
        await asyncio.sleep(max(0.0, FAULT_HEALTH_S - (time.monotonic() - failed_at)))
        failures.insert(0, DeviceFault(engine.fault_message()))
        server.should_exit = True

    async def main() -> None:
        loop = asyncio.get_running_loop()
        if threading.current_thread() is threading.main_thread():
            # Also before uvicorn installs its handlers (and after it restores the previous ones).
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: on_stop_signal(loop))
        tasks = [asyncio.create_task(lifecycle()), asyncio.create_task(watch_for_fault())]
        try:
            await build_route_tables(app)
            await server.serve(sockets=[sock])
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    def on_stop_signal(loop: asyncio.AbstractEventLoop) -> None:
        """A stop signal outside uvicorn's own handlers: the drain while the event loop runs; once it is closed (the
        server is down and the engine thread is being joined), the end of the process at once."""
        try:
            loop.call_soon_threadsafe(request_shutdown)
        except RuntimeError:  # the event loop is closed
            exit_at_once(0)

    server = _Server(server_config, on_signal=lambda: asyncio.get_running_loop().call_soon_threadsafe(request_shutdown))
    try:
        with asyncio.Runner(loop_factory=_event_loop_factory()) as runner:
            runner.run(main())
    finally:
        progress.cancel()  # a load still running stops at its next tensor, so the engine thread can be joined
        if ranks is not None:  # first: an engine step waiting on a rank that is gone then fails rather than hangs
            ranks.close()
        state.preparing.shutdown(wait=False, cancel_futures=True)
        engine.close()
    if failures:
        raise failures[0]


def rank_memory(engine: Engine, ranks: "Ranks | None") -> Callable[[], list[tuple[str, int]]]:
    """Each rank's device and memory bytes, in rank order, for /metrics (one rank without tensor parallelism)."""

    def read() -> list[tuple[str, int]]:
        if not engine.is_loaded:
            return []
        if ranks is None:
            return [(str(engine.loaded.info.device), engine.memory_bytes())]
        memory = ranks.memory_bytes()
        return list(zip(ranks.devices, memory, strict=True)) if memory else []

    return read


def rank_failed(engine: Engine, ranks: "Ranks", reason: str) -> None:
    """A tensor-parallel rank has exited (called from Ranks' watcher thread): once the model is loaded, the engine
    fails like a device (every request ends with an error, /health 503 `unhealthy`, the worker exits 1 within
    seconds); while it loads, or if the engine does not stop in RANK_FAULT_GRACE_S, the worker exits 1 at once,
    since rank 0 may be waiting on the lost rank in a collective."""
    if engine.load_finished:
        engine.fail(reason)
        deadline = time.monotonic() + RANK_FAULT_GRACE_S
        while engine.fault is None and time.monotonic() < deadline:
            time.sleep(POLL_S)
        if engine.fault is not None:
            return
    log.error("the worker stops: %s", reason)
    print(f"error: the worker stops: {reason}", file=sys.stderr, flush=True)
    ranks.close(0)
    exit_at_once(EXIT_FAILURE)


async def build_route_tables(app: FastAPI) -> None:
    """One request, in-process, to a path that no route serves, while the model loads: FastAPI builds a router's table
    (its routes' request validators among it) at the first request that walks past it, which would otherwise be the
    first real request of each API, after the worker reported ready. Sent to the router, past the middleware: no
    token needed, and no access log line or refusal counted for it."""
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app.router), base_url="http://rbee-worker") as client:
        await client.get("/.route-tables")


async def until(done: Callable[[], bool], timeout_s: float, interrupt: asyncio.Event | None) -> None:
    """Poll `done` until it holds, `timeout_s` passes or `interrupt` is set."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not done() and loop.time() < deadline and not (interrupt and interrupt.is_set()):
        await asyncio.sleep(POLL_S)


def _event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop where it is installed (not on Windows), asyncio's otherwise: the HTTP thread encodes and
    writes one SSE event per token per stream, CPU time taken from the model's threads on a small CPU."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop
