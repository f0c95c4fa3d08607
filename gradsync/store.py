"""The job's key-value store, listening only where it was asked to.

``torch.distributed.TCPStore`` as a server listens on every interface of the host. gradsync's
stores (rank 0's rendezvous store, the elastic launcher's) are unauthenticated, so they listen on
one address instead: a one-machine job's on loopback, a multi-host job's on the address the other
hosts reach it by (``MASTER_ADDR``, or ``GRADSYNC_BIND_ADDR`` / ``gradsync run --bind`` to
choose). Like torchrun's, a multi-host store belongs on a trusted network.
"""
from __future__ import annotations

import errno
import os
import socket
from datetime import timedelta

from gradsync.errors import ConfigError

BIND_ENV = "GRADSYNC_BIND_ADDR"


def bind_address(addr: str) -> str:
    """Where a store for clients connecting to ``addr`` listens: ``GRADSYNC_BIND_ADDR`` when set,
    else ``addr`` itself (``localhost`` and other loopback names stay on loopback)."""
    return os.environ.get(BIND_ENV) or addr


def listen(addr: str, port: int) -> socket.socket:
    """A listening TCP socket on ``addr:port`` (``port`` 0: a free one). Errors name the address."""
    try:
        infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"cannot listen on {addr!r}: the name does not resolve ({exc}). Set "
                          f"{BIND_ENV} (or gradsync run --bind) to an address of this host") from None
    family, kind, proto, _, where = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(where)
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(f"cannot listen on {addr}:{port}: the port is in use. Choose another port "
                              "(gradsync run --port P, or MASTER_PORT) or stop the process that holds it") from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise ConfigError(f"cannot listen on {addr}:{port}: {addr} is not an address of this host. Set "
                              f"{BIND_ENV} (or gradsync run --bind) to one that is") from None
        raise
    return sock


def serve(addr: str, port: int, world_size: int | None, timeout_s: float):
    """A ``TCPStore`` server listening on ``addr:port`` only. Its ``.port`` is the port chosen."""
    import torch.distributed as dist

    sock = listen(addr, port)
    chosen = sock.getsockname()[1]
    return dist.TCPStore(addr, chosen, world_size, is_master=True, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False, master_listen_fd=sock.detach())
