"""Bearer-token auth and X-Correlation-ID (CONTRACT.md §2, "Auth and tracing"), as pure ASGI middleware so that
streaming responses pass through untouched."""

import hmac
import json
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

CORRELATION_HEADER = b"x-correlation-id"


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
