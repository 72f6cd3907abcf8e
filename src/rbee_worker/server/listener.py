"""The listening socket, bound before torch and the model load so that a taken port fails at once (exit 3)."""

import ipaddress
import socket
from urllib.parse import urlsplit

from rbee_worker.errors import BindError


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    """Bind before loading anything, so a taken port fails at once rather than after a long model load."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not the default 0: accepted connections inherit it, and asyncio sets TCP_NODELAY only on sockets
    # whose proto says TCP. Without it Nagle's algorithm holds each SSE chunk that follows another small write until
    # the client's delayed ACK comes back, which delays the streamed tokens (bench/results/README.md).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise BindError(f"cannot listen on {host}:{port} ({exc.strerror}); pick another --port or free it") from exc
    sock.listen(2048)
    return sock


WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def advertised_url(host: str, port: int, toward: str | None = None) -> str:
    """The base URL at which others reach this worker: the bound host, or for a wildcard host (0.0.0.0, ::), the
    address of this machine's interface that routes toward `toward` (the pool manager), else its host name."""
    if host in WILDCARD_HOSTS:
        host = (toward and outward_address(toward)) or socket.gethostname()
    if ":" in host:  # an IPv6 literal
        host = f"[{host}]"
    return f"http://{host}:{port}"


def outward_address(url: str) -> str | None:
    """The local address the kernel picks to reach the URL's host; a UDP connect sends no packet."""
    parts = urlsplit(url)
    if not parts.hostname:
        return None
    try:
        family, _, _, _, address = socket.getaddrinfo(parts.hostname, parts.port or 80, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address)
            return probe.getsockname()[0]
    except (OSError, ValueError):
        return None
