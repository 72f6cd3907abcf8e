"""`rbee-worker serve`: bind the port, load the model in the engine thread while the port already answers, then
report ready to the pool manager and keep the heartbeat going."""

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI

from rbee_worker import __version__
from rbee_worker.api.middleware import AuthAndCorrelation
from rbee_worker.api.native import WorkerState, native_router
from rbee_worker.devices import Placement
from rbee_worker.engine.engine import Engine
from rbee_worker.errors import RegistrationError
from rbee_worker.models.loader import load_model
from rbee_worker.pool import HeartbeatStatus, ReadyPayload, heartbeat_loop, send_ready_callback

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeSettings:
    model: str
    model_ref: str | None
    worker_id: str | None
    host: str  # for the URL reported to the pool manager; the socket is bound by the caller
    placement: Placement
    deterministic: bool
    callback_url: str | None
    callback_timeout_s: float
    heartbeat_url: str | None
    heartbeat_interval_s: float
    api_token: str | None  # LLORCH_API_TOKEN: when set, every route but GET /health needs it


def serve(settings: ServeSettings, sock: socket.socket) -> None:
    """Run the worker until it is stopped.

    Raises BindError or RegistrationError (exit 3) or ModelLoadError (exit 2) once the server has shut down.
    """
    port = sock.getsockname()[1]
    worker_id = settings.worker_id or f"{socket.gethostname()}-{port}"
    engine = Engine(lambda: load_model(settings.model, settings.placement), deterministic=settings.deterministic)
    state = WorkerState(engine=engine, worker_id=worker_id, model_ref=settings.model_ref or settings.model)
    app = FastAPI(title="rbee-worker", version=__version__)
    app.include_router(native_router(state))
    app.add_middleware(AuthAndCorrelation, token=settings.api_token)
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False, lifespan="off"))
    failures: list[Exception] = []  # what stopped the worker, re-raised once the server is down

    async def lifecycle() -> None:
        """Wait for the model, name it, register with the pool manager, then beat until the server stops."""
        try:
            loaded = await asyncio.to_thread(lambda: engine.loaded)
        except Exception as exc:
            failures.append(exc)
            server.should_exit = True
            return
        if settings.model_ref is None:
            state.model_ref = loaded.info.name
        url = f"http://{settings.host}:{port}"
        log.info("ready: %s on %s at %s", state.model_ref, loaded.info.device, url)
        if settings.callback_url:
            memory = engine.memory_bytes()
            payload = ReadyPayload(
                worker_id=worker_id,
                model_ref=state.model_ref,
                url=url,
                vram_bytes=memory if loaded.info.device.type == "cuda" else 0,
                memory_bytes=memory,
                backend=loaded.info.device.type,
                device=str(loaded.info.device),
            )
            try:
                await send_ready_callback(settings.callback_url, payload, timeout_s=settings.callback_timeout_s)
            except RegistrationError as exc:  # the CLI turns it into exit 3 once the server is down
                failures.append(exc)
                server.should_exit = True
                return
        if settings.heartbeat_url:

            def status() -> HeartbeatStatus:
                return HeartbeatStatus(worker_id, "healthy", "busy" if engine.active_requests else "idle")

            await heartbeat_loop(settings.heartbeat_url, settings.heartbeat_interval_s, status)

    async def main() -> None:
        task = asyncio.create_task(lifecycle())
        try:
            await server.serve(sockets=[sock])
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    if threading.current_thread() is threading.main_thread():
        # uvicorn answers SIGTERM/SIGINT with a graceful shutdown and then re-raises the signal to the handlers that
        # were installed before it ran; with the defaults the process would die of it (exit 143 / KeyboardInterrupt)
        # instead of exiting 0 as the contract says. Ours only asks for the shutdown (again, when re-raised), which
        # also covers a signal that comes before uvicorn has installed its own.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: setattr(server, "should_exit", True))
    try:
        asyncio.run(main())
    finally:
        engine.close()
    if failures:
        raise failures[0]
