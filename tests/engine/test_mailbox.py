"""engine/mailbox.py: calls posted from another thread run on the event loop, all of them, in order, with fewer
wake-ups of the loop than calls when they come in a burst."""

import asyncio
import threading

from rbee_worker.engine.mailbox import LoopMailbox


def test_a_burst_from_a_thread_arrives_in_order_with_few_wake_ups() -> None:
    async def main() -> tuple[list[int], int]:
        loop = asyncio.get_running_loop()
        wake_ups = 0
        schedule = loop.call_soon_threadsafe

        def counting(callback, *args):  # type: ignore[no-untyped-def]
            nonlocal wake_ups
            wake_ups += 1
            return schedule(callback, *args)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        mailbox = LoopMailbox(loop)
        received: list[int] = []
        done = asyncio.Event()

        def deliver(item: int) -> None:
            received.append(item)
            if item == 999:
                done.set()

        def burst() -> None:
            for item in range(1000):
                mailbox.post(deliver, item)

        thread = threading.Thread(target=burst)
        thread.start()
        await asyncio.wait_for(done.wait(), timeout=10)
        thread.join()
        return received, wake_ups

    received, wake_ups = asyncio.run(main())
    assert received == list(range(1000))
    assert 1 <= wake_ups < 1000
