"""The listening socket, bound before torch and the model load so that a taken port fails at once (exit 3)."""

import ipaddress
import socket

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
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise BindError(f"cannot listen on {host}:{port} ({exc.strerror}); pick another --port or free it") from exc
    sock.listen(2048)
    return sock
