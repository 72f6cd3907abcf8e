"""The worker's HTTP middleware, pure ASGI so that streaming responses pass through untouched: the access log and
the count of refused requests, bearer-token auth and X-Correlation-ID (CONTRACT.md §2, "Auth and tracing"), the
request body's size limit, and JSON bodies whatever their Content-Type."""

import hmac
import json
import logging
import time
import uuid
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rbee_worker.api.metrics import Metrics, refusal_reason

CORRELATION_HEADER = b"x-correlation-id"
CONTENT_TYPE_HEADER = b"content-type"
CONTENT_LENGTH_HEADER = b"content-length"
JSON_CONTENT_TYPE = b"application/json"

access_log = logging.getLogger("rbee_worker.access")


class AccessLog:
    """Sees every response (the outermost middleware): counts a refusal, a status of 400 or more answered before any
    job ran, in rbee:request_failure_total (a job's own failure the engine counts) and, when `log` is set, writes one
    info line per request once its response has ended (for a stream: its last event), with its method, path, status,
    duration, correlation id and job id.

    Routes tell it what they know in the request's state: `job_id` (api/admission.py `admit`, the job API's stream)
    and `refusal`, an admission refusal's reason (api/admission.py `rendering_route`); AuthAndCorrelation sets
    `correlation_id`. /health is never a refusal: its 503 reports the worker's condition."""

    def __init__(self, app: ASGIApp, metrics: Metrics, log: bool) -> None:
        self.app = app
        self.metrics = metrics
        self.log = log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        notes = scope.setdefault("state", {})
        status: int | None = None

        def count(answer: int) -> None:
            if answer >= 400 and "job_id" not in notes and scope["path"] != "/health":
                self.metrics.refused(answer, refusal_reason(answer, notes.get("refusal")))

        async def send_watched(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":  # counted before the client can see it
                status = message["status"]
                count(status)
            await send(message)

        try:
            await self.app(scope, receive, send_watched)
        finally:
            if status is None:  # the app raised or ended without an answer: the server answers 500 (if it still can)
                status = 500
                count(status)
            if self.log:
                self.write(scope, notes, status, time.perf_counter() - started)

    @staticmethod
    def write(scope: Scope, notes: dict, status: int, seconds: float) -> None:
        fields = {
            "method": scope["method"],
            "path": scope["path"],
            "status": status,
            "duration_ms": round(seconds * 1000, 3),
            "correlation_id": notes.get("correlation_id"),
        }
        if "job_id" in notes:
            fields["job_id"] = notes["job_id"]
        access_log.info(
            "%s %s %d %.1f ms", scope["method"], scope["path"], status, seconds * 1000, extra={"fields": fields}
        )


class BodyLimit:
    """A request whose body is over `limit()` bytes (None: no limit) gets 413 before any of it is parsed: at once by its
    Content-Length, or once that many bytes of a body sent without one have arrived (such a body is read here, then
    handed on whole). A refused body is drained before the 413 goes out: a client still sending it then reads the
    answer, not a reset connection."""

    def __init__(self, app: ASGIApp, limit: Callable[[], int | None]) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = self.limit() if scope["type"] == "http" else None
        if limit is None:
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(CONTENT_LENGTH_HEADER)
        if declared is not None and declared.strip().isdigit():  # the server reads exactly that many bytes
            if int(declared) > limit:
                await drain(receive)
                await refuse_large(send, limit, int(declared))
                return
            await self.app(scope, receive, send)
            return
        chunks, size, more = [], 0, True
        while more and size <= limit:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
        if size > limit:
            if more:
                await drain(receive)
            await refuse_large(send, limit, None)
            return
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay() -> Message:
            nonlocal whole
            if whole is None:
                return await receive()  # after the body: a disconnect
            message, whole = whole, None
            return message

        await self.app(scope, replay, send)


async def drain(receive: Receive) -> None:
    """Read the rest of a request's body, dropping it."""
    while True:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return


async def refuse_large(send: Send, limit: int, size: int | None) -> None:
    """413 in the error shape both APIs share (server/worker.py's http_error); `size`: the body's, when it was
    declared."""
    has = "more" if size is None else f"{size} bytes, more"
    message = f"the request body has {has} than the {limit} bytes this worker takes (--max-request-bytes)"
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": "REQUEST_TOO_LARGE"}
    await send({"type": "http.response.start", "status": 413, "headers": [(b"content-type", JSON_CONTENT_TYPE)]})
    await send({"type": "http.response.body", "body": json.dumps({"error": error}).encode()})


class JsonBodies:
    """Every request body is read as JSON, whatever its Content-Type says (none, or curl -d's
    application/x-www-form-urlencoded), as llama-server and Ollama read it: the worker takes no other kind of body,
    and FastAPI parses a body for a pydantic model only under a JSON media type."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not is_json(dict(scope["headers"]).get(CONTENT_TYPE_HEADER)):
            headers = [(name, value) for name, value in scope["headers"] if name != CONTENT_TYPE_HEADER]
            scope["headers"] = [*headers, (CONTENT_TYPE_HEADER, JSON_CONTENT_TYPE)]
        await self.app(scope, receive, send)


def is_json(content_type: bytes | None) -> bool:
    """application/json or a +json type, with or without parameters."""
    media_type = (content_type or b"").partition(b";")[0].strip().lower()
    return media_type == JSON_CONTENT_TYPE or (media_type.startswith(b"application/") and media_type.endswith(b"+json"))


class AuthAndCorrelation:
    """Every route but GET /health needs `Authorization: Bearer <token>` when a token is set; every response carries
    X-Correlation-ID: the caller's when it is a UUID, otherwise a new one (also in `scope["state"]` for the logs)."""

    def __init__(self, app: ASGIApp, token: str | None) -> None:
        self.app = app
        self.token = token.encode() if token else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        correlation_id = valid_uuid(headers.get(CORRELATION_HEADER)) or str(uuid.uuid4())
        scope.setdefault("state", {})["correlation_id"] = correlation_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (CORRELATION_HEADER, correlation_id.encode())]
            await send(message)

        refusal = self.refusal(scope, headers.get(b"authorization"))
        if refusal is None:
            await self.app(scope, receive, send_with_id)
            return
        code, message = refusal
        body = json.dumps({"error": {"code": code, "message": message}}).encode()
        await send_with_id(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")],
            }
        )
        await send_with_id({"type": "http.response.body", "body": body})

    def refusal(self, scope: Scope, authorization: bytes | None) -> tuple[str, str] | None:
        if self.token is None or (scope["method"] == "GET" and scope["path"] == "/health"):
            return None
        scheme, _, presented = (authorization or b"").partition(b" ")
        if not authorization or scheme.lower() != b"bearer" or not presented:
            return "MISSING_API_KEY", "this worker needs `Authorization: Bearer <LLORCH_API_TOKEN>`"
        if not hmac.compare_digest(presented.strip(), self.token):  # constant time: no timing oracle on the token
            return "INVALID_API_KEY", "the bearer token is not this worker's LLORCH_API_TOKEN"
        return None


def valid_uuid(raw: bytes | None) -> str | None:
    if raw is None:
        return None
    try:
        text = raw.decode("ascii")
        uuid.UUID(text)
    except (ValueError, UnicodeDecodeError):
        return None
    return text  # echoed as the caller wrote it
