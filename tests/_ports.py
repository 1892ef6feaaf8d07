"""A free localhost port for the tests that start process groups or torchrun rendezvous: other
suites on the same machine start them too, so a fixed port would collide."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port that was free a moment ago on localhost."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
