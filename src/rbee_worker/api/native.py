"""The worker's native API (CONTRACT.md §2): /health, /v1/ready, POST /execute, the job API and /cancel.

Routes are thin: validate (api/validation.py), submit to the engine, and turn its events into SSE lines. Nothing here
runs model code: the engine's thread does, and this module only talks to it through `Engine.astream` and
`Engine.cancel`.
"""

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from rbee_worker.api.validation import FieldError, JobRequest, errors_body, parse_job_request
from rbee_worker.engine.engine import Engine
from rbee_worker.engine.sampling import SamplingParams
from rbee_worker.engine.types import End, Error, ErrorCode, Event, Started, StopReason, Token
from rbee_worker.engine.types import Request as EngineRequest

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class Job:
    """A job of the job API: its events wait in `events` until the one reader attaches."""

    job_id: str
    events: AsyncIterator[Event]
    reader_attached: bool = False


@dataclass
class WorkerState:
    engine: Engine
    worker_id: str
    model_ref: str
    running: set[str] = field(default_factory=set)  # job ids admitted and not yet finished or read to the end
    jobs: dict[str, Job] = field(default_factory=dict)  # job API jobs not yet fully read


def native_router(state: WorkerState) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> JSONResponse:
        engine = state.engine
        if not engine.is_loaded:
            return JSONResponse({"status": "loading", "worker_id": state.worker_id}, status_code=503)
        info = engine.loaded.info
        memory = engine.memory_bytes()
        return JSONResponse(
            {
                "status": "healthy",
                "state": "busy" if engine.active_requests else "idle",
                "worker_id": state.worker_id,
                "model": state.model_ref,
                "vram_bytes": memory if info.device.type == "cuda" else 0,
                "memory_bytes": memory,
            }
        )

    @router.get("/v1/ready")
    async def ready() -> JSONResponse:
        engine = state.engine
        if not engine.is_loaded:
            return JSONResponse({"ready": False, "state": "loading", "model_loaded": False})
        return JSONResponse(
            {"ready": True, "state": "busy" if engine.active_requests else "idle", "model_loaded": True}
        )

    @router.post("/execute")
    async def execute(request: Request) -> Response:
        job = await admit(state, await request.body(), require_job_id=True)
        if isinstance(job, Response):
            return job
        return StreamingResponse(
            sse(state, job, done_marker=False), media_type="text/event-stream", headers=SSE_HEADERS
        )

    @router.post("/v1/inference")
    async def create_job(request: Request) -> Response:
        job = await admit(state, await request.body(), require_job_id=False)
        if isinstance(job, Response):
            return job
        state.jobs[job.job_id] = job
        return JSONResponse({"job_id": job.job_id, "sse_url": f"/v1/inference/{job.job_id}/stream"})

    @router.get("/v1/inference/{job_id}/stream")
    async def job_stream(job_id: str) -> Response:
        job = state.jobs.get(job_id)
        if job is None:
            return error_response(404, "JOB_NOT_FOUND", f"no job {job_id}")
        if job.reader_attached:
            return error_response(409, "STREAM_TAKEN", f"job {job_id} already has a reader")
        job.reader_attached = True
        return StreamingResponse(sse(state, job, done_marker=True), media_type="text/event-stream", headers=SSE_HEADERS)

    @router.delete("/v1/inference/{job_id}")
    async def delete_job(job_id: str) -> Response:
        state.engine.cancel(job_id)  # idempotent: unknown or finished ids are ignored
        return Response(status_code=204)

    @router.post("/cancel")
    async def cancel(request: Request) -> Response:
        try:
            job_id = json.loads(await request.body()).get("job_id")
        except (ValueError, AttributeError):
            return field_error(400, FieldError("body", "json", "body must be a JSON object with job_id", None))
        if not isinstance(job_id, str) or not job_id:
            return field_error(400, FieldError("job_id", "required", "job_id (a non-empty string) is required", None))
        state.engine.cancel(job_id)
        return Response(status_code=202)

    return router


async def admit(state: WorkerState, body: bytes, *, require_job_id: bool) -> Job | Response:
    """Validate a job request and start it in the engine; or the error response."""
    engine = state.engine
    if not engine.is_loaded:
        return error_response(503, "LOADING", "the model is still loading; retry shortly", retry_after=1)
    prompt_ids: tuple[int, ...] = ()

    def count_tokens(prompt: str) -> int:
        nonlocal prompt_ids
        prompt_ids = engine.tokenize(prompt)
        return len(prompt_ids)

    parsed = parse_job_request(
        body, require_job_id=require_job_id, count_tokens=count_tokens, context_length=engine.loaded.info.context_length
    )
    if not isinstance(parsed, JobRequest):
        return JSONResponse(errors_body(parsed), status_code=400)
    job_id = parsed.job_id or uuid.uuid4().hex
    if job_id in state.running:  # job API jobs are in it too until fully read
        return field_error(409, FieldError("job_id", "unique", f"job {job_id} is already running", job_id))
    request = EngineRequest(
        prompt_ids=prompt_ids,
        max_tokens=parsed.max_tokens,
        sampling=SamplingParams(
            temperature=parsed.temperature,
            top_k=parsed.top_k,
            top_p=parsed.top_p,
            min_p=parsed.min_p,
            repetition_penalty=parsed.repetition_penalty,
        ),
        seed=parsed.seed,
        stop=parsed.stop,
        request_id=job_id,
    )
    state.running.add(job_id)
    events = engine.astream(request)
    # Submit now (the first event is awaited here) so a job API job runs before its reader attaches.
    first = await anext(events)
    return Job(job_id, _prepend(first, events))


async def _prepend(first: Event, rest: AsyncIterator[Event]) -> AsyncIterator[Event]:
    try:
        yield first
        async for event in rest:
            yield event
    finally:
        await rest.aclose()  # cancels the request in the engine if it is still running


async def sse(state: WorkerState, job: Job, *, done_marker: bool) -> AsyncIterator[str]:
    """The job's events as SSE lines; closing this generator (the client left) cancels the job."""
    model, pieces = state.model_ref, 0
    try:
        async for event in job.events:
            if isinstance(event, Token):
                if not event.text:  # ids whose text is held back (partial character, possible stop string)
                    continue
                event = replace(event, index=pieces)  # `i` counts the pieces sent
                pieces += 1
            yield f"data: {json.dumps(event_json(event, job.job_id, model), ensure_ascii=False)}\n\n"
        if done_marker:
            yield "data: [DONE]\n\n"
    finally:
        await job.events.aclose()
        state.running.discard(job.job_id)
        state.jobs.pop(job.job_id, None)


def event_json(event: Event, job_id: str, model: str) -> dict:
    """The contract's JSON for an engine event."""
    if isinstance(event, Started):
        return {
            "type": "started",
            "job_id": job_id,
            "model": model,
            "started_at": datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        }
    if isinstance(event, Token):
        return {"type": "token", "t": event.text, "i": event.index}
    if isinstance(event, End) and event.stop_reason is StopReason.CANCELLED:
        return {"type": "error", "code": ErrorCode.CANCELLED.value, "message": "the job was cancelled"}
    if isinstance(event, End):
        end = {
            "type": "end",
            "tokens_out": event.tokens_out,
            "prompt_tokens": event.prompt_tokens,
            "decode_time_ms": round(event.decode_time_s * 1000, 3),
            "stop_reason": event.stop_reason.value,
            "seed": event.seed,
        }
        if event.stop_sequence is not None:
            end["stop_sequence_matched"] = event.stop_sequence
        return end
    assert isinstance(event, Error)
    return {"type": "error", "code": event.code.value, "message": event.message}


def field_error(status: int, error: FieldError) -> JSONResponse:
    return JSONResponse(errors_body([error]), status_code=status)


def error_response(status: int, code: str, message: str, *, retry_after: int | None = None) -> JSONResponse:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status, headers=headers)
