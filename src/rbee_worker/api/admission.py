"""Admission, one path for both HTTP APIs: refuse while draining or loading, compile the request's grammar (structured
output), build the engine request off the event loop (`off_loop`: rendering a chat template and tokenizing take
milliseconds to seconds, which would hold every stream), submit it.

`admit` raises an `AdmissionError` subclass for every refusal; each API turns those into its own error shape in one
place, a route class made by `rendering_route` (FastAPI's exception handlers are app-wide, and the two APIs answer
the same refusal differently). That route class also notes the refusal's `reason` in the HTTP request's state, and
`admit` the admitted job's id, for the access log and the failure counter (api/middleware.py).
"""

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, ClassVar, TypeVar

from fastapi import Request
from fastapi.responses import Response
from fastapi.routing import APIRoute

from rbee_worker.api.state import Job, WorkerState
from rbee_worker.engine.engine import DuplicateRequest, EngineBusy
from rbee_worker.engine.request_types import Request as EngineRequest
from rbee_worker.engine.structured.grammar import CompiledGrammar, GrammarSpec

E = TypeVar("E", bound=Exception)
T = TypeVar("T")


class AdmissionError(Exception):
    """A request the worker does not take; the subclass says why, in words and as `reason` (a value of
    rbee:request_failure_total's `reason` label)."""

    reason: ClassVar[str]


class Draining(AdmissionError):
    """The worker is shutting down and takes no new work."""

    reason = "draining"


class Loading(AdmissionError):
    """The model is still loading; the client should retry shortly."""

    reason = "loading"


class Unhealthy(AdmissionError):
    """The worker's device failed: the worker stops and takes no new work."""

    reason = "unhealthy"


class DuplicateJob(AdmissionError):
    """A job with this id is running, or waits for its stream to be read."""

    reason = "conflict"

    def __init__(self, job_id: str) -> None:
        super().__init__(f"job {job_id} is already running")
        self.job_id = job_id


class AllSlotsBusy(AdmissionError):
    """Every running slot and every queue place is taken (the engine's EngineBusy, with its numbers as the contract
    reports them); the client should retry shortly."""

    reason = "busy"

    def __init__(self, busy: EngineBusy) -> None:
        super().__init__(str(busy))
        self.slots_total, self.queue_total = busy.max_batch, busy.max_queue
        self.slots_busy = min(busy.in_flight, busy.max_batch)
        self.queue_busy = busy.in_flight - self.slots_busy


def ensure_open(state: WorkerState) -> None:
    """Raise Unhealthy, Draining or Loading unless the worker takes requests (the engine is loaded: it can
    tokenize)."""
    if state.engine.fault is not None:
        raise Unhealthy(state.engine.fault_message())
    if state.draining:
        raise Draining()
    if not state.engine.is_loaded:
        raise Loading()


async def compile_grammar(state: WorkerState, spec: GrammarSpec) -> CompiledGrammar:
    """The grammar compiled for the model, awaited: the compilation runs on the engine's grammar threads, so neither
    the event loop nor the step loop waits. Raises GrammarError for a spec that does not compile, or what
    `ensure_open` raises (a loading engine cannot compile yet)."""
    ensure_open(state)
    # Shielded: a client that leaves must not cancel a compilation that the cache hands to later requests too.
    return await asyncio.shield(asyncio.wrap_future(state.engine.model.grammars.compile(spec)))


async def off_loop(state: WorkerState, work: Callable[[], T]) -> T:
    """`work()` on the worker's preparing threads, awaited: the event loop streams meanwhile. What it raises passes
    through."""
    return await asyncio.get_running_loop().run_in_executor(state.preparing, work)


async def admit(state: WorkerState, build: Callable[[], EngineRequest], http_request: Request) -> Job:
    """Submit the request that `build` makes off the event loop, once the worker takes requests; its events wait in
    the returned job, whose id goes into `http_request.state.job_id`.

    `build` runs only on a loaded engine and may raise its API's own errors (an invalid body, say), which pass
    through. Raises Unhealthy, Draining, Loading, DuplicateJob or AllSlotsBusy; a refused request leaves nothing behind.
    """
    [job] = await admit_all(state, lambda: [build()], http_request)
    return job


async def admit_all(state: WorkerState, build: Callable[[], list[EngineRequest]], http_request: Request) -> list[Job]:
    """`admit` for a response of several requests (OpenAI's `n`, `best_of`, batched prompts): all of them or none,
    the first one's id in `http_request.state.job_id`."""
    ensure_open(state)
    requests = await off_loop(state, build)
    ensure_open(state)  # a drain may have begun meanwhile
    jobs: list[Job] = []
    try:
        for request in requests:
            if request.request_id in state.jobs:  # a job API job stays until its stream is read, even once generated
                raise DuplicateJob(request.request_id)
            try:
                jobs.append(Job(request.request_id, state.engine.astream(request)))
            except DuplicateRequest:
                raise DuplicateJob(request.request_id) from None
            except EngineBusy as busy:
                raise AllSlotsBusy(busy) from None
    except AdmissionError:
        for job in jobs:  # submitted already: taken back
            state.engine.cancel(job.job_id)
        raise
    http_request.state.job_id = jobs[0].job_id
    return jobs


def rendering_route(errors: type[E] | tuple[type[E], ...], render: Callable[[E], Response]) -> type[APIRoute]:
    """An APIRoute class whose handlers answer the `errors` they raise with `render(error)`: one error renderer per
    API, for `APIRouter(route_class=...)`. A refusal's reason goes into `request.state.refusal`."""

    class RenderingRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()

            async def handle(request: Request) -> Response:
                try:
                    return await handler(request)
                except errors as exc:
                    if isinstance(exc, AdmissionError):
                        request.state.refusal = exc.reason
                    return render(exc)

            return handle

    return RenderingRoute
