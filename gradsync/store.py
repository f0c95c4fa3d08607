"""The job's key-value store, listening only where it was asked to.

``torch.distributed.TCPStore`` as a server listens on every interface of the host. gradsync's
stores (rank 0's rendezvous store, the elastic launcher's) are unauthenticated, so they listen on
one address instead: a one-machine job's on loopback, a multi-host job's on the address the other
hosts reach it by (``MASTER_ADDR``, or ``GRADSYNC_BIND_ADDR`` / ``gradsync run --bind`` to
choose). Like torchrun's, a multi-host store belongs on a trusted network.

Every job ``gradsync run`` starts also gets a random *secret* (``GRADSYNC_JOB_SECRET`` in its ranks'
environment; an elastic job keeps it in a 0600 file for ``gradsync resize``). Its ranks see the store
through :class:`SignedStore`: every value is written with an HMAC-SHA256 of key and value under the
secret (as Horovod's driver signs its messages), and a value read back without a valid one is
refused, naming the key. That covers the process group's own rendezvous keys and gradsync's
control keys (elastic generations, resize requests and answers). Counters (``add``) cannot carry a
signature; gradsync uses them only for heartbeats and request numbers, never for a decision.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import hmac
import os
import queue
import secrets
import socket
import threading
from datetime import timedelta

from gradsync.errors import ConfigError, GradsyncError

BIND_ENV = "GRADSYNC_BIND_ADDR"
SECRET_ENV = "GRADSYNC_JOB_SECRET"
STATE_DIR_ENV = "GRADSYNC_STATE_DIR"
_MAC_BYTES = 32


class UnsignedValueError(GradsyncError):
    """A value in the job's store that was not written with the job's secret: someone outside the
    job wrote it (or the writer was started without ``GRADSYNC_JOB_SECRET``)."""


def new_secret() -> str:
    return secrets.token_hex(32)


def job_secret() -> str | None:
    """This process's job secret (``GRADSYNC_JOB_SECRET``), or None outside a gradsync-launched job."""
    return os.environ.get(SECRET_ENV) or None


@functools.cache
def _signed_store_class():
    import torch.distributed as dist  # here, so the launcher imports no torch

    class SignedStore(dist.Store):
        """See :func:`signed`."""

        def __init__(self, inner, secret: str, prefix: str):
            super().__init__()
            self.inner, self.prefix = inner, prefix
            self._key = secret.encode()

        def _mac(self, key: str, value: bytes) -> bytes:
            return hmac.new(self._key, key.encode() + b"\0" + value, hashlib.sha256).digest()

        def set(self, key: str, value) -> None:
            key, value = self.prefix + key, value.encode() if isinstance(value, str) else bytes(value)
            self.inner.set(key, self._mac(key, value) + value)

        def get(self, key: str) -> bytes:
            key = self.prefix + key
            raw = bytes(self.inner.get(key))
            mac, value = raw[:_MAC_BYTES], raw[_MAC_BYTES:]
            if len(raw) < _MAC_BYTES or not hmac.compare_digest(mac, self._mac(key, value)):
                raise UnsignedValueError(f"the job's store holds a value for {key!r} that is not signed with the job's "
                                         "secret: a process outside the job wrote it. It is ignored; if every rank "
                                         f"reports this, check that all were started by one launcher ({SECRET_ENV})")
            return value

        def add(self, key: str, amount: int) -> int:
            return self.inner.add(self.prefix + key, amount)

        def check(self, keys) -> bool:
            return self.inner.check([self.prefix + k for k in keys])

        def wait(self, keys, timeout=None) -> None:
            keys = [self.prefix + k for k in keys]
            if timeout is None:
                self.inner.wait(keys)
            else:
                self.inner.wait(keys, timeout)

        def delete_key(self, key: str) -> bool:
            return self.inner.delete_key(self.prefix + key)

        def num_keys(self) -> int:
            return self.inner.num_keys()

        def set_timeout(self, timeout) -> None:
            self.inner.set_timeout(timeout)

        def compare_set(self, key, expected, desired):
            raise NotImplementedError("gradsync's signed store does not offer compare_set")

    return SignedStore


def signed(store, secret: str | None, prefix: str = ""):
    """``store`` seen through a ``SignedStore`` when there is a secret; else ``store`` itself. A
    ``SignedStore`` writes every value with an HMAC of (key, value) under the job's secret; ``get``
    verifies it and raises :class:`UnsignedValueError` naming the key when it is missing or wrong;
    ``wait``, ``check`` and ``add`` pass through (they return no value to trust). It serves as a
    process group's store, and puts ``prefix`` before every key (as ``PrefixStore`` does; the
    signature covers the whole key). The caller keeps the returned object alive as long as a
    process group uses it: torch holds only a reference to its C++ half."""
    if secret:
        return _signed_store_class()(store, secret, prefix)
    if prefix:
        import torch.distributed as dist

        return dist.PrefixStore(prefix, store)
    return store


class Answered:
    """A store client each of whose calls must be answered within ``seconds``, else it raises
    :class:`TimeoutError` (and so does every later call). TCPStore's own timeout covers waits for
    keys, not a server that goes silent: over a cut link, an ``add`` or ``check`` waits for ever.
    The calls run one at a time on a daemon thread; one left waiting on a silent server stays
    there, and the caller, told, goes on without this client."""

    def __init__(self, store, seconds: float, what: str):
        self.store, self.seconds, self.what, self.silent = store, seconds, what, False
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, daemon=True, name="gradsync-store-client").start()

    def _serve(self) -> None:
        while True:
            method, args, box, done = self._calls.get()
            try:
                box.append((True, method(*args)))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                box.append((False, exc))
            done.set()

    def __getattr__(self, name: str):
        method = getattr(self.store, name)
        if not callable(method):
            return method

        def call(*args):
            if self.silent:
                raise TimeoutError(f"{self.what} stopped answering")
            box: list = []
            done = threading.Event()
            self._calls.put((method, args, box, done))
            if not done.wait(self.seconds):
                self.silent = True
                raise TimeoutError(f"{self.what} did not answer a call ({name}) within {self.seconds:g} s")
            ok, value = box[0]
            if ok:
                return value
            raise value

        return call


def secret_file(port: int) -> str:
    """Where an elastic job on ``port`` keeps its secret for ``gradsync resize`` (``GRADSYNC_STATE_DIR``,
    else ``~/.gradsync``)."""
    root = os.environ.get(STATE_DIR_ENV) or os.path.join(os.path.expanduser("~"), ".gradsync")
    return os.path.join(root, "jobs", f"elastic-{port}.key")


def write_secret(path: str, secret: str) -> None:
    """Write ``secret`` to a new file only its owner can read (0600, created that way, never widened)."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # a stale file of a job that died on this port
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret)


def read_secret(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read the job's secret from {path}: {exc.strerror}. It is written by gradsync run "
                          "--elastic on this machine for the job's port; pass --secret-file, or set "
                          f"{SECRET_ENV}") from None


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


def serve(addr: str, port: int, world_size: int | None, timeout_s: float, sock: socket.socket | None = None):
    """A ``TCPStore`` server listening on ``addr:port`` only (or on ``sock``, already listening
    there). Its ``.port`` is the port chosen."""
    import torch.distributed as dist

    sock = listen(addr, port) if sock is None else sock
    chosen = sock.getsockname()[1]
    return dist.TCPStore(addr, chosen, world_size, is_master=True, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False, master_listen_fd=sock.detach())
