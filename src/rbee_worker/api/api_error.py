"""The error of the OpenAI-compatible API (and of the framework's own errors, which share its shape)."""

from fastapi.responses import JSONResponse


class ApiError(Exception):
    """An error to answer in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self, status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None,
        code: str | None = None, retry_after: int | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.retry_after = retry_after

    def body(self) -> dict:
        """The JSON body, also sent as the last event of a stream that fails."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        """The body with its status, and Retry-After when the client should simply try again."""
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)
