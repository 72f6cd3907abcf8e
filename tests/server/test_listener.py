"""The worker's listening socket (listener.bind), as asyncio serves it."""

import asyncio
import socket

from rbee_worker.server.listener import bind


def test_accepted_connections_send_without_nagle() -> None:
    """Every connection the worker accepts has TCP_NODELAY: with Nagle's algorithm a small SSE chunk that follows
    another one waited for the client's delayed ACK (a first token reached the client ~20 ms late)."""
    nodelay: list[int] = []

    async def run() -> None:
        def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            sock = writer.get_extra_info("socket")
            nodelay.append(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(accepted, sock=bind("127.0.0.1", 0))
        port = server.sockets[0].getsockname()[1]
        async with server:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            for _ in range(100):
                if nodelay:
                    break
                await asyncio.sleep(0.01)
            writer.close()

    asyncio.run(run())
    assert nodelay and nodelay[0] != 0
