"""The worker's native API (CONTRACT.md §2): /health, /v1/ready, /v1/loading/progress, POST /execute, the job API,
/cancel and /shutdown.

Routes are thin: validate (api/native_validation.py), compile a `json_schema` (awaited: the engine compiles it off the
event loop), submit to the engine (api/admission.py), and turn its events into SSE lines; every refusal is answered by
`native_error`. Nothing here runs model code: the engine's thread does, and this
module only talks to it through `Engine.astream`, `Engine.cancel` and its counters.
"""

import asyncio
import json
import logging
import re
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from datetime import UTC, datetime

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from rbee_worker.api.admission import (
    AdmissionError,
    AllSlotsBusy,
    Draining,
    DuplicateJob,
    Loading,
    Unhealthy,
    admit,
    compile_grammar,
    ensure_open,
    off_loop,
    rendering_route,
)
from rbee_worker.api.native_schema import (
    CANCEL_BODY,
    EXECUTE_BODY,
    INFERENCE_BODY,
    JOB_ERRORS,
    UNAUTHORIZED,
    FieldErrors,
    Health,
    JobCreated,
    NativeError,
    Ready,
    ShutdownAccepted,
    sse_response_doc,
)
from rbee_worker.api.native_validation import (
    FieldError,
    JobRequest,
    errors_body,
    invalid_schema,
    load_body,
    parse_job_request,
)
from rbee_worker.api.request_settings import sampling_params
from rbee_worker.api.state import Job, WorkerState
from rbee_worker.engine.request_types import End, Error, ErrorCode, Event, Started, StopReason, Token
from rbee_worker.engine.request_types import Request as EngineRequest
from rbee_worker.engine.structured.grammar import CompiledGrammar, GrammarError, GrammarSpec
from rbee_worker.hardware.cpu_features import cpu_features

log = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# Characters that many line readers (Python's str.splitlines, httpx's iter_lines) take for line breaks although SSE
# does not: JSON-escaped, so that a generated NEL or line separator cannot cut a `data:` line in two for such clients.
_SSE_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})
_SSE_LINE_BREAK = re.compile("[\x85\u2028\u2029]")  # finds one before translating: most events have none


def sse_data(payload: object) -> str:
    """One SSE event carrying `payload` as compact JSON (UTF-8 text as it is, but for the characters above). orjson
    writes it: every streamed token is one event, written on the HTTP thread, which shares the GIL with the engine
    thread; the standard library's encoder costs several times as much per event (bench/results/README.md)."""
    text = orjson.dumps(payload).decode()
    if _SSE_LINE_BREAK.search(text):
        text = text.translate(_SSE_LINE_BREAKS)
    return f"data: {text}\n\n"


PROGRESS_URL = "/v1/loading/progress"
PROGRESS_POLL_S = 0.1


class InvalidJob(Exception):
    """A job request that fails validation, with every problem found (HTTP 400)."""

    def __init__(self, errors: Sequence[FieldError]) -> None:
        super().__init__("; ".join(e.message for e in errors))
        self.errors = errors


def native_router(state: WorkerState) -> APIRouter:
    router = APIRouter(route_class=rendering_route((AdmissionError, InvalidJob), native_error))

    @router.get(
        "/health",
        response_model=Health,
        responses={503: {"model": Health, "description": "loading, draining or unhealthy"}},
        summary="Health (never needs auth)",
    )
    async def health() -> JSONResponse:
        engine, condition = state.engine, state.condition()
        if not engine.is_loaded:
            return JSONResponse({"status": condition, "worker_id": state.worker_id}, status_code=503)
        info = engine.loaded.info
        memory = engine.memory_bytes()
        body = {
            "status": condition,
            "state": state.activity(),
            "worker_id": state.worker_id,
            "model": state.model_ref,
            "device": str(info.device),
            "devices": state.devices() if state.devices else [str(info.device)],
            "dtype": str(info.dtype).removeprefix("torch."),
            "vram_bytes": memory if info.device.type == "cuda" else 0,
            "memory_bytes": memory,
            "weight_bytes": info.weight_bytes,
            "active_weight_bytes": info.active_weight_bytes,
            "kv_cache_bytes": engine.kv_cache_bytes(),
            "prompt_cache_bytes": engine.prompt_cache_bytes(),
            "runtime": info.runtime,
            "slots_total": engine.max_batch,
            "slots_busy": engine.running_requests,
            "kv_cache_usage_perc": round(engine.kv_cache_usage(), 6),  # a share, 0..1, as the /metrics gauge
            "cpu": cpu_features().describe(),
        }
        if condition == "unhealthy":
            body["message"] = state.unhealthy_reason()
        return JSONResponse(body, status_code=200 if condition == "healthy" else 503)

    @router.get("/v1/ready", response_model=Ready, responses=UNAUTHORIZED)
    async def ready() -> JSONResponse:
        condition = state.condition()
        if condition == "loading":
            return JSONResponse(
                {"ready": False, "state": "loading", "model_loaded": False, "progress_url": PROGRESS_URL}
            )
        named = {"healthy": state.activity(), "draining": "draining", "unhealthy": "error"}[condition]
        return JSONResponse({"ready": condition == "healthy", "state": named, "model_loaded": state.engine.is_loaded})

    @router.get(
        PROGRESS_URL,
        response_class=StreamingResponse,
        responses={**UNAUTHORIZED, 200: sse_response_doc("loading events, then ready (or error), then [DONE]")},
    )
    async def loading_progress() -> StreamingResponse:
        return StreamingResponse(progress_events(state), media_type="text/event-stream", headers=SSE_HEADERS)

    @router.post("/shutdown", status_code=202, response_model=ShutdownAccepted, responses=UNAUTHORIZED)
    async def shutdown() -> JSONResponse:
        state.request_shutdown()
        return JSONResponse({"status": "draining"}, status_code=202)

    @router.post(
        "/execute",
        response_class=StreamingResponse,
        responses={**JOB_ERRORS, 200: sse_response_doc("started, token*, then one end or error event")},
        openapi_extra=EXECUTE_BODY,
    )
    async def execute(request: Request) -> Response:
        job = await admit_job(state, request, require_job_id=True)
        return StreamingResponse(
            sse(state, job, done_marker=False), media_type="text/event-stream", headers=SSE_HEADERS
        )

    @router.post("/v1/inference", response_model=JobCreated, responses=JOB_ERRORS, openapi_extra=INFERENCE_BODY)
    async def create_job(request: Request) -> Response:
        job = await admit_job(state, request, require_job_id=False)
        state.jobs[job.job_id] = job
        asyncio.get_running_loop().call_later(state.config.unclaimed_job_timeout_s, expire_unclaimed, state, job)
        return JSONResponse({"job_id": job.job_id, "sse_url": f"/v1/inference/{job.job_id}/stream"})

    @router.get(
        "/v1/inference/{job_id}/stream",
        response_class=StreamingResponse,
        responses={
            **UNAUTHORIZED,
            200: sse_response_doc("the job's events as on /execute, then [DONE]"),
            404: {"model": NativeError, "description": "no such job (or already read)"},
            409: {"model": NativeError, "description": "the job already has a reader"},
        },
    )
    async def job_stream(job_id: str, http_request: Request) -> Response:
        job = state.jobs.get(job_id)
        if job is None:
            return error_response(404, "JOB_NOT_FOUND", f"no job {job_id}")
        if job.reader_attached:
            return error_response(409, "STREAM_TAKEN", f"job {job_id} already has a reader")
        job.reader_attached = True
        http_request.state.job_id = job_id
        return StreamingResponse(sse(state, job, done_marker=True), media_type="text/event-stream", headers=SSE_HEADERS)

    @router.delete("/v1/inference/{job_id}", status_code=204, response_class=Response, responses=UNAUTHORIZED)
    async def delete_job(job_id: str) -> Response:
        state.engine.cancel(job_id)  # idempotent: unknown or finished ids are ignored
        return Response(status_code=204)

    @router.post(
        "/cancel",
        status_code=202,
        response_class=Response,
        responses={**UNAUTHORIZED, 400: {"model": FieldErrors, "description": "no job_id"}},
        openapi_extra=CANCEL_BODY,
    )
    async def cancel(request: Request) -> Response:
        try:
            data = load_body(await request.body())
        except ValueError as exc:
            return field_error(400, FieldError("body", "json", str(exc), None))
        job_id = data.get("job_id") if isinstance(data, dict) else None
        if not isinstance(job_id, str) or not job_id:
            return field_error(400, FieldError("job_id", "required", "job_id (a non-empty string) is required", None))
        state.engine.cancel(job_id)
        return Response(status_code=202)

    return router


async def admit_job(state: WorkerState, http_request: Request, *, require_job_id: bool) -> Job:
    """Validate a job request, compile its json_schema, and submit it to the engine; raises InvalidJob or what
    `admit` raises."""
    body = await http_request.body()
    prompt_ids: tuple[int, ...] = ()

    def count_tokens(prompt: str) -> int:
        nonlocal prompt_ids
        prompt_ids = state.engine.model.tokenize(prompt)
        return len(prompt_ids)

    ensure_open(state)  # validation tokenizes with the loaded model's tokenizer, off the event loop
    parsed = await off_loop(
        state,
        lambda: parse_job_request(
            body,
            require_job_id=require_job_id,
            count_tokens=count_tokens,
            context_length=state.engine.model.context_length,
        ),
    )
    if not isinstance(parsed, JobRequest):
        raise InvalidJob(parsed)
    grammar = await job_grammar(state, parsed.json_schema)

    def build() -> EngineRequest:
        return EngineRequest(
            prompt_ids=prompt_ids,
            max_tokens=parsed.max_tokens,
            sampling=sampling_params(parsed),
            seed=parsed.seed,
            stop=parsed.stop,
            request_id=parsed.job_id or uuid.uuid4().hex,
            correlation_id=getattr(http_request.state, "correlation_id", None),
            grammar=grammar,
        )

    return await admit(state, build, http_request)


async def job_grammar(state: WorkerState, schema: dict | None) -> CompiledGrammar | None:
    """A job's json_schema compiled for the model (None without one); one that does not compile is InvalidJob with
    constraint `valid_schema`."""
    if schema is None:
        return None
    try:
        return await compile_grammar(state, GrammarSpec.json_schema(schema))
    except GrammarError as exc:
        raise InvalidJob([invalid_schema(schema, str(exc))]) from None


def native_error(exc: AdmissionError | InvalidJob) -> JSONResponse:
    """The contract's answer (CONTRACT.md §2) to a job request the worker refuses."""
    if isinstance(exc, InvalidJob):
        return JSONResponse(errors_body(exc.errors), status_code=400)
    if isinstance(exc, DuplicateJob):
        return field_error(409, FieldError("job_id", "unique", str(exc), exc.job_id))
    if isinstance(exc, AllSlotsBusy):
        error = {
            "code": "ALL_SLOTS_BUSY",
            "message": str(exc),
            "slots_total": exc.slots_total,
            "slots_busy": exc.slots_busy,
            "queue_total": exc.queue_total,
            "queue_busy": exc.queue_busy,
        }
        return JSONResponse({"error": error}, status_code=503, headers={"Retry-After": "1"})
    if isinstance(exc, Loading):
        return error_response(503, "LOADING", "the model is still loading; retry shortly", retry_after=1)
    if isinstance(exc, Unhealthy):
        return error_response(503, "UNHEALTHY", str(exc))
    assert isinstance(exc, Draining), exc
    return error_response(503, "DRAINING", "the worker is shutting down and takes no new jobs")


def expire_unclaimed(state: WorkerState, job: Job) -> None:
    """A job API job whose stream nobody opened in time: cancel it and forget it, so it holds no slot and no memory."""
    if state.jobs.get(job.job_id) is job and not job.reader_attached:
        del state.jobs[job.job_id]
        state.engine.cancel(job.job_id)
        log.warning(
            "job %s cancelled: its stream was not opened within %.0f s",
            job.job_id,
            state.config.unclaimed_job_timeout_s,
            extra={"fields": {"job_id": job.job_id}},
        )


async def progress_events(state: WorkerState) -> AsyncIterator[str]:
    """GET /v1/loading/progress: a loading event whenever the count moves (once the loader knows the totals: a
    0-of-0 event would tell a client nothing and divide by zero), then ready (or error) and [DONE]."""
    engine, progress = state.engine, state.progress
    last: dict | None = None
    while True:
        finished = engine.load_finished  # read before the snapshot, so the final count is always sent
        snapshot = {
            "stage": "loading",
            "layers_loaded": progress.layers_loaded,
            "layers_total": progress.layers_total,
            "memory_mb": round(progress.bytes_loaded / 2**20, 1),
        }
        if progress.layers_total and snapshot != last and (not finished or last is not None):
            yield f"data: {json.dumps(snapshot)}\n\n"
            last = snapshot
        if finished:
            break
        await asyncio.sleep(PROGRESS_POLL_S)
    try:
        engine.loaded  # noqa: B018 -- raises what loading raised
        final = {"stage": "ready"}
    except Exception as exc:
        final = {"stage": "error", "message": str(exc)}
    yield f"data: {json.dumps(final)}\n\n"
    yield "data: [DONE]\n\n"


async def sse(state: WorkerState, job: Job, *, done_marker: bool) -> AsyncIterator[str]:
    """The job's events as SSE lines; closing this generator (the client left) cancels the job."""
    model, pieces = state.model_ref, 0
    state.open_streams += 1
    try:
        async for event in job.events:
            if isinstance(event, Token):
                if not event.text:  # ids whose text is held back (partial character, possible stop string)
                    continue
                event = replace(event, index=pieces)  # `i` counts the pieces sent
                pieces += 1
            yield sse_data(event_json(event, job.job_id, model))
        if done_marker:
            yield "data: [DONE]\n\n"
    finally:
        await job.events.aclose()  # cancels the job in the engine if it has not ended
        state.open_streams -= 1
        if state.jobs.get(job.job_id) is job:
            del state.jobs[job.job_id]


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
            "cached_tokens": event.cached_tokens,
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
