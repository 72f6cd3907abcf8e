"""Events from the engine thread to an asyncio event loop, one wake-up per batch, and one request's events there.

Why: `loop.call_soon_threadsafe` per event writes to the loop's self-pipe each time, a system call that releases the
GIL; at 64 streams a decode step hands over 64 events, and each release lets the event loop thread (encoding and
sending SSE chunks) take the GIL for up to a switch interval while the engine thread waits to launch the next step.
Here the first event of a batch schedules one delivery and the events after it, until the loop runs it, are only
appended: a step's events cross in one wake-up, in order.
"""

import asyncio
import threading
from collections.abc import Callable
from typing import Any

from rbee_worker.engine.request_types import End, Error, Event


class LoopMailbox:
    """Calls handed from any thread to one event loop, run there in the order given."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[Callable[[Any], object], Any]] = []

    def post(self, deliver: Callable[[Any], object], item: Any) -> None:
        """Run deliver(item) on the loop soon; wakes the loop only if no delivery is scheduled yet."""
        with self._lock:
            self._pending.append((deliver, item))
            if len(self._pending) > 1:
                return
        self._loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for deliver, item in pending:
            deliver(item)


class EventStream:
    """One request's events on the event loop, read as an async iterator until its End or Error. Closing it
    (`aclose`), a read cancelled (the reader's task), or dropping it unread cancels the request unless it has ended,
    whether or not any event was ever read (an async generator closed before its first read would run no cleanup:
    a streamed response of several choices can close before it reads any choice)."""

    def __init__(self, events: "asyncio.Queue[Event]", cancel: Callable[[], None]) -> None:
        self._events, self._cancel, self._over = events, cancel, False

    def __aiter__(self) -> "EventStream":
        return self

    async def __anext__(self) -> Event:
        if self._over:
            raise StopAsyncIteration
        try:
            event = await self._events.get()
        except asyncio.CancelledError:
            self._stop()
            raise
        self._over = isinstance(event, End | Error)
        return event

    async def aclose(self) -> None:
        self._stop()

    def _stop(self) -> None:
        if not self._over:
            self._over = True
            self._cancel()

    def __del__(self) -> None:
        self._stop()
