"""Choosing TCP ports for the local servers labrl starts (mock lab, mock judge, fake SGLang, tests).

``free_port`` lets the kernel choose, from its ephemeral range: right for a
server that lives as long as its caller. A server that is killed and
restarted on the same port (``labrl serve``'s supervisor) wants one below
that range (``free_restart_port``): while it is down, the kernel can hand an
ephemeral port to any process's ``bind(0)`` or outgoing connection, and the
restart then fails with "address already in use".
"""

from __future__ import annotations

import random
import socket

LINUX_DEFAULT_EPHEMERAL = (32768, 60999)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, chosen by the kernel (ephemeral)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def ephemeral_port_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The ports the kernel hands to ``bind(0)`` and to outgoing connections.

    Read from ``path`` (Linux); Linux's default where it cannot be read.
    """
    try:
        with open(path) as f:
            low, high = (int(x) for x in f.read().split())
    except (OSError, ValueError):
        return LINUX_DEFAULT_EPHEMERAL
    return low, high


def restart_port_warning(port: int, ephemeral: tuple[int, int]) -> str | None:
    """Why a server restarted on ``port`` may find it taken, or None when it cannot be."""
    low, high = ephemeral
    if not low <= port <= high:
        return None
    return (
        f"port {port} is in the kernel's ephemeral range {low}-{high}: while a crashed server restarts, "
        f"another process's connection can take it; a port below {low} (SGLang's default is 30000) cannot be"
    )


def free_restart_port(host: str = "127.0.0.1", lowest: int = 20000, tries: int = 200) -> int:
    """A bindable port in ``[lowest, ephemeral low)``, at random so parallel callers spread out."""
    low, _high = ephemeral_port_range()
    candidates = range(lowest, low)
    for port in random.sample(candidates, min(tries, len(candidates))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port in {lowest}-{low - 1} after {tries} tries")
