"""The server's listening address, bound before the model loads: a port some server listens on
already stops ``serve`` at once, naming the flags, instead of after a model load that took seconds
(or minutes). The socket is bound, not listening, so connections are refused until uvicorn serves
it (once the model is loaded: /health answers 200 then)."""

from __future__ import annotations

import socket
import sys

REUSE_PORT = sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT")


def bind_socket(host: str, port: int, reuse_port: bool = REUSE_PORT, check_free: bool = True) -> socket.socket:
    """A socket bound to the server's address, not listening: connections are refused until a
    front end's uvicorn listens (once the model is loaded), as with one front end. This
    process's socket holds the port (port 0: the one it got) while the front ends bind theirs.
    A port some server listens on already is refused (ValueError naming it), as one front end's
    uvicorn refuses it: ``SO_REUSEPORT`` alone would let this server join that one's sockets."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if check_free and reuse_port and port:
        _bind(family, host, port, reuse_port=False, listen=True).close()  # the port is free
    return _bind(family, host, port, reuse_port=reuse_port, listen=False)


def _bind(family, host: str, port: int, reuse_port: bool, listen: bool) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
        if listen:
            sock.listen(1)
    except OSError as e:
        sock.close()
        raise ValueError(f"--host {host} --port {port}: cannot bind: {e.strerror}") from None
    return sock
