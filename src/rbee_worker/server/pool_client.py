"""Pool-manager client: the ready callback (with retries) and the heartbeat (contract §3).

Both run on the server's event loop (uvicorn's), so everything here is asyncio + httpx.AsyncClient. Neither function
ever blocks the loop: waits are `asyncio.sleep`, and every request has a timeout.
"""

import asyncio
import contextlib
import email.utils
import errno
import logging
import random
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime

import httpx

# One class for the whole worker: the CLI maps errors.RegistrationError to exit code 3.
from rbee_worker.errors import RegistrationError

__all__ = [
    "HeartbeatStatus",
    "ReadyPayload",
    "RegistrationError",
    "heartbeat_loop",
    "send_heartbeat",
    "send_ready_callback",
]

log = logging.getLogger(__name__)

# One attempt of the ready callback may take this long (clipped to the overall deadline). A pool manager that needs
# longer to answer a registration is stuck; trying again is more useful than waiting.
CALLBACK_ATTEMPT_TIMEOUT_S = 10.0
# When the backoff would step past the deadline, one last attempt starts this long before it instead (a tenth of the
# whole timeout if that is shorter): a pool manager that comes up in the final seconds is still caught, and no attempt
# starts with too little time left to finish (its failure would read "timed out" and hide the real cause).
LAST_ATTEMPT_WINDOW_S = 1.0
# A heartbeat request may take at most this long, and never longer than the interval: a beat that arrives later than
# the next one would have is worthless.
HEARTBEAT_TIMEOUT_S = 10.0
# Backoff delays are shortened by up to this fraction at random, so that many workers started together (or all
# retrying after the same pool-manager restart) spread out instead of calling in lockstep. Shortened rather than
# lengthened, so that max_delay_s stays a true maximum.
JITTER = 0.1
# How much of an error response body goes into a log line or error message.
BODY_SNIPPET_CHARS = 200

HEALTH_STATUSES = ("healthy", "degraded", "unhealthy")


@dataclass(frozen=True)
class ReadyPayload:
    worker_id: str
    model_ref: str
    url: str  # the worker's base URL, e.g. http://10.0.0.5:8080
    vram_bytes: int
    memory_bytes: int
    weight_bytes: int  # as /health's: every rank's weights, and what one token's forward reads of them
    active_weight_bytes: int
    backend: str
    device: str
    runtime: str  # what runs the model: torch or llama.cpp
    cpu: dict[str, object]  # cpu_features.CpuFeatures.describe(): what the worker's CPU paths are chosen by
    # Every process's device, in rank order: [device] in one process, one per rank under tensor parallelism (whose
    # vram_bytes and memory_bytes are the sums over the ranks).
    devices: list[str] | None = None

    def to_json(self) -> dict[str, object]:
        return {
            "worker_id": self.worker_id,
            "model_ref": self.model_ref,
            # The older pool manager reads `uri`, the newer `url`; sending both keeps one worker working with either.
            "uri": self.url,
            "url": self.url,
            "vram_bytes": self.vram_bytes,
            "memory_bytes": self.memory_bytes,
            "weight_bytes": self.weight_bytes,
            "active_weight_bytes": self.active_weight_bytes,
            "backend": self.backend,
            "device": self.device,
            "devices": self.devices if self.devices is not None else [self.device],
            "runtime": self.runtime,
            "cpu": self.cpu,
        }


@dataclass(frozen=True)
class HeartbeatStatus:
    worker_id: str
    health_status: str  # "healthy" | "degraded" (no progress for a while) | "unhealthy" (the device failed: it stops)
    state: str  # the worker state as in /v1/ready: loading | idle | busy | draining | error
    message: str | None = None  # why it is not healthy

    def __post_init__(self) -> None:
        # The pool manager only knows these; catching a typo here beats a pool manager silently ignoring beats.
        if self.health_status not in HEALTH_STATUSES:
            raise ValueError(f"health_status must be one of {HEALTH_STATUSES}, not {self.health_status!r}")


async def send_ready_callback(
    url: str,
    payload: ReadyPayload,
    *,
    timeout_s: float = 60.0,
    first_delay_s: float = 0.5,
    max_delay_s: float = 8.0,
    client: httpx.AsyncClient | None = None,
) -> None:
    """POST the ready callback until the pool manager accepts it (2xx).

    Connection errors, timeouts and 5xx are retried with exponential backoff (first_delay_s, doubling, at most
    max_delay_s, minus a little jitter; a 503's Retry-After lengthens a step to what it asks, up to max_delay_s) until
    timeout_s has passed: no attempt starts after that deadline, and an attempt's own timeout is clipped to it. Where
    the next backoff step would overshoot, a final attempt starts LAST_ATTEMPT_WINDOW_S (at most timeout_s / 10) before
    the deadline; if it fails, the error is raised then, up to that window before timeout_s.
    A 4xx (or any other non-2xx, non-5xx answer) is final. Raises RegistrationError when the callback was not accepted.
    `client`, when given, is used and left open (its base settings apply except the timeout, which is set here).
    """
    if min(timeout_s, first_delay_s, max_delay_s) <= 0:
        raise ValueError(
            f"timeout_s, first_delay_s and max_delay_s must be positive: {timeout_s, first_delay_s, max_delay_s}"
        )
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    latest_start = deadline - min(LAST_ATTEMPT_WINDOW_S, timeout_s / 10)
    body = payload.to_json()
    attempt = 0
    last_error = "no attempt made"
    async with _client_scope(client) as http:
        # Attempts start no later than latest_start (see below); this check only matters if the event loop was
        # blocked through a whole backoff sleep.
        while (remaining := deadline - loop.time()) > 0:
            attempt += 1
            attempt_timeout = min(CALLBACK_ATTEMPT_TIMEOUT_S, remaining)
            retry_after: float | None = None
            try:
                # httpx's timeout bounds each phase (connect, write, read) separately; asyncio.timeout bounds the whole
                # attempt, so that the last one really ends at the deadline.
                async with asyncio.timeout(attempt_timeout):
                    response = await http.post(url, json=body, timeout=attempt_timeout)
            except (httpx.UnsupportedProtocol, httpx.InvalidURL) as exc:
                # A malformed --callback-url will not get better by waiting a minute.
                raise RegistrationError(
                    f"callback URL {url!r} is not usable ({exc}); pass a full http:// or https:// URL"
                ) from exc
            except (httpx.TransportError, TimeoutError) as exc:
                last_error = _describe_error(exc)
            else:
                status = response.status_code
                if 200 <= status < 300:
                    log.info("registered with the pool manager at %s (attempt %d)", url, attempt)
                    return
                snippet = _snippet(response.text)
                if not 500 <= status < 600:
                    # No redirects are followed (a POST that turns into a GET would not register anything).
                    wrong_place = status in (404, 405) or 300 <= status < 400
                    hint = (
                        "check --callback-url: the pool manager has no ready endpoint there"
                        if wrong_place
                        else "check the worker's --worker-id/--model-ref and the pool manager's log"
                    )
                    raise RegistrationError(
                        f"pool manager at {url} refused the worker: HTTP {status} {snippet}".rstrip() + f"; {hint}"
                    )
                last_error = f"HTTP {status} {snippet}".rstrip()
                if status == 503:
                    retry_after = _parse_retry_after(response.headers.get("Retry-After"))

            delay = min(max_delay_s, first_delay_s * 2 ** (attempt - 1)) * (1 - JITTER * random.random())
            if retry_after is not None:
                # Not before the server asks us to (but a `Retry-After: 0` does not turn the backoff into a busy
                # loop), and never longer than our own bound.
                delay = min(max(delay, retry_after), max_delay_s)
            now = loop.time()
            next_start = min(now + delay, latest_start)
            if next_start <= now:  # that was the last attempt
                log.warning(
                    "ready callback attempt %d to %s failed: %s; no time left for another within %g s",
                    attempt,
                    url,
                    last_error,
                    timeout_s,
                )
                break
            log.warning(
                "ready callback attempt %d to %s failed: %s; retrying in %.2f s",
                attempt,
                url,
                last_error,
                next_start - now,
            )
            await asyncio.sleep(next_start - now)

    attempts = f"{attempt} attempt{'s' if attempt != 1 else ''}"
    raise RegistrationError(
        f"pool manager at {url} did not accept the ready callback within {timeout_s:g} s "
        f"({attempts}, last error: {last_error}); check that the pool manager is running and --callback-url is right, "
        "or raise --callback-timeout"
    )


async def heartbeat_loop(
    url: str,
    interval_s: float,
    status: Callable[[], HeartbeatStatus],
    *,
    client: httpx.AsyncClient | None = None,
) -> None:
    """POST a heartbeat every interval_s seconds (the first at once) until cancelled.

    Beats are scheduled start-to-start on a fixed grid, so slow requests do not make the schedule drift; slots missed
    entirely (the loop was blocked) collapse into one beat rather than a burst. Failures never raise:
    the first of a streak is logged at WARNING, the rest at DEBUG, and the recovery at INFO.
    """
    if interval_s <= 0:
        raise ValueError(f"interval_s must be positive, not {interval_s}")
    loop = asyncio.get_running_loop()
    request_timeout = min(interval_s, HEARTBEAT_TIMEOUT_S)
    failures = 0
    async with _client_scope(client) as http:
        # The grid starts once the client exists (creating one loads the TLS context, tens of ms).
        next_beat = loop.time()
        while True:
            error = await _send_heartbeat(http, url, status, request_timeout)
            if error is None:
                if failures:
                    log.info("heartbeat to %s works again after %d failed beats", url, failures)
                failures = 0
            else:
                failures += 1
                level = logging.WARNING if failures == 1 else logging.DEBUG
                log.log(
                    level,
                    "heartbeat to %s failed: %s (failure %d; further failures in a row are logged at DEBUG)",
                    url,
                    error,
                    failures,
                )
            next_beat += interval_s
            now = loop.time()
            if now - next_beat >= interval_s:
                # Whole slots went by (the event loop was blocked): one beat now stands for all of them, rather than a
                # burst of stale ones; the schedule stays on its original grid. A beat that is merely late (its request
                # used up the whole timeout) still goes out at once.
                next_beat += int((now - next_beat) / interval_s) * interval_s
            await asyncio.sleep(max(0.0, next_beat - now))


async def send_heartbeat(url: str, status: HeartbeatStatus, timeout_s: float = HEARTBEAT_TIMEOUT_S) -> str | None:
    """One beat now, off the schedule (the last one of a worker that stops unhealthy); None when the pool manager
    accepted it, else what went wrong."""
    async with _client_scope(None) as http:
        return await _send_heartbeat(http, url, lambda: status, timeout_s)


async def _send_heartbeat(
    http: httpx.AsyncClient, url: str, status: Callable[[], HeartbeatStatus], timeout_s: float
) -> str | None:
    """Send one beat; return None when the pool manager accepted it, else a description of what went wrong."""
    try:
        current = status()
        body = {
            "worker_id": current.worker_id,
            "timestamp": _rfc3339_now(),
            "health_status": current.health_status,
            "state": current.state,
        }
        if current.message is not None:
            body["message"] = current.message
        async with asyncio.timeout(timeout_s):
            response = await http.post(url, json=body, timeout=timeout_s)
    except (httpx.TransportError, TimeoutError) as exc:
        return _describe_error(exc)
    except Exception as exc:
        # A bug in status() or an odd URL must not kill the heartbeat task (it would stop silently); report it.
        log.debug("heartbeat to %s raised", url, exc_info=True)
        return f"{type(exc).__name__}: {exc}"
    if 200 <= response.status_code < 300:
        return None
    return f"HTTP {response.status_code} {_snippet(response.text)}".rstrip()


@contextlib.asynccontextmanager
async def _client_scope(client: httpx.AsyncClient | None) -> AsyncIterator[httpx.AsyncClient]:
    """The caller's client as is (the caller closes it), or a new one closed on exit."""
    if client is not None:
        yield client
        return
    async with httpx.AsyncClient() as own:
        yield own


def _rfc3339_now() -> str:
    """Current UTC time as RFC 3339 with milliseconds and a `Z`, e.g. 2025-01-31T12:00:00.123Z."""
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _parse_retry_after(value: str | None) -> float | None:
    """Seconds to wait from a Retry-After header (delta-seconds or an HTTP date); None when absent or unreadable."""
    if value is None:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:  # HTTP dates are GMT; a date without a zone is read as such
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - datetime.now(UTC)).total_seconds())


def _snippet(text: str) -> str:
    """An error body shortened to one line, for log lines and error messages."""
    flat = " ".join(text.split())
    return flat if len(flat) <= BODY_SNIPPET_CHARS else flat[: BODY_SNIPPET_CHARS - 1] + "…"


def _describe_error(exc: BaseException) -> str:
    """A short cause for a failed request: httpx's own messages ("All connection attempts failed") hide the reason."""
    if isinstance(exc, TimeoutError):  # from asyncio.timeout: the whole attempt ran out of time
        return "timed out"
    if isinstance(exc, httpx.ConnectTimeout):
        return "timed out connecting"
    if isinstance(exc, httpx.TimeoutException):
        return "timed out waiting for the answer"
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, ConnectionRefusedError):
            return "connection refused"
        if isinstance(cause, socket.gaierror):
            return f"cannot resolve the host name ({cause.strerror or cause})"
        if isinstance(cause, OSError) and cause.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
            return f"host unreachable ({cause.strerror})"
        cause = cause.__cause__ or cause.__context__
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
