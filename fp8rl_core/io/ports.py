"""A free TCP port: for a cell's rendezvous (torch.distributed) and for a local MLflow server.

Stdlib only, so that the sweep driver can import it without torch.
"""
from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now, the kernel's pick (another process could take it before the
    caller binds: callers bind at once, and a rendezvous that loses the race fails with its error)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
