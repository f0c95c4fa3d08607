"""Warm rank starts: a forkserver that has imported torch forks each Python rank.

A rank started as ``python train.py`` spends 2-3 s of CPU importing torch, and as much again
importing ``torch._dynamo`` when it builds its first optimizer (``torch.optim`` imports it). Every
rank of a job, and every worker an elastic job adds, pays it again; ranks sharing a machine pay it
at the same moment. ``gradsync run`` therefore starts, once per job and machine, one process that
imports both and then forks each rank whose command is this interpreter running a script
(``python train.py ...``) or a module (``python -m pkg.train ...``). The forked rank runs the script
as ``python`` would: ``__main__``, ``sys.argv``, ``sys.path[0]``, its own environment, process
group, pipes and exit code, its own random seeds, and no module of gradsync inherited (it imports its own).

A rank on an emulated host (``ip netns exec HOST python train.py``, :mod:`gradsync.cluster`) is
forked too and enters the host's network namespace itself. Any other command (another program,
interpreter options such as ``-c`` or ``-X``, other prefixes) starts with ``exec`` as before, and
so does every rank when ``GRADSYNC_FORKSERVER=0`` (``gradsync run --no-forkserver``) or when the
forkserver cannot be used (it failed to import torch, or importing it initialised CUDA, which a
forked child could not use).

Wire: one ``AF_UNIX``/``SOCK_SEQPACKET`` socket pair, JSON messages; a request carries the rank's
stdout and stderr pipes as ``SCM_RIGHTS`` file descriptors. The forkserver reaps its children and
reports each exit code; it dies with the launcher and its children die with it.

This module does not import torch (the launcher starts fast); only the forkserver process does.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading

ENV = "GRADSYNC_FORKSERVER"
"""``0``: start every rank with ``exec`` (no forkserver)."""
PRELOAD = ("torch", "torch._dynamo")
"""What the forkserver imports before it forks anyone."""
_VARYING_PREFIXES = ("GRADSYNC_",)
_VARYING = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"}
_MAX_MESSAGE = 1 << 20
_NETNS_DIR = "/var/run/netns"
_CLONE_NEWNET = 0x40000000  # from <sched.h>
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def python_target(command: list[str], env: dict[str, str] | None = None) -> dict | None:
    """What a forked rank runs for ``command``: ``{"script": path, "args": [...]}`` or
    ``{"module": name, "args": [...]}``; None when ``command`` is not this interpreter running a
    training script or module (one whose source names torch, gradsync or lightning), which then
    starts with ``exec``: a forkserver would make it wait for imports it does not need."""
    if not command or not sys.platform.startswith("linux"):
        return None
    program = shutil.which(command[0])
    if program is None or not _this_interpreter(program):
        return None
    args = list(command[1:])
    while args and args[0] == "-u":  # unbuffered: every rank is (PYTHONUNBUFFERED=1)
        args.pop(0)
    if len(args) >= 2 and args[0] == "-m":
        source = _module_source(args[1], (env or os.environ).get("PYTHONPATH", ""))
        return {"module": args[1], "args": args[2:]} if source is None or _trains(source) else None
    if not args or args[0].startswith("-") or not os.path.isfile(args[0]):
        return None  # interpreter options, a script from stdin, a missing file: python says what it does
    return {"script": args[0], "args": args[1:]} if _trains(args[0]) else None


_TRAINS = re.compile(rb"\b(torch|gradsync|lightning)\b")


def _trains(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return bool(_TRAINS.search(f.read(1 << 20)))
    except OSError:
        return False


def _module_source(name: str, pythonpath: str) -> str | None:
    """The file ``python -m name`` would run, looked for where the rank's Python looks (None: not found)."""
    relative = name.replace(".", os.sep)
    for folder in [os.getcwd(), *filter(None, pythonpath.split(os.pathsep)), *sys.path[1:]]:
        for candidate in (relative + ".py", os.path.join(relative, "__main__.py")):
            path = os.path.join(folder, candidate)
            if os.path.isfile(path):
                return path
    return None


def _netns_prefix(command: list[str]) -> tuple[str | None, list[str]]:
    """``ip netns exec NAME ...`` (a rank on an emulated host, :mod:`gradsync.cluster`): the forked
    rank enters network namespace NAME itself, which is all that prefix gives a rank."""
    if len(command) > 4 and command[:3] == ["ip", "netns", "exec"] and os.path.exists(f"{_NETNS_DIR}/{command[3]}"):
        return command[3], command[4:]
    return None, command


def _this_interpreter(program: str) -> bool:
    """The same binary in the same folder (a virtual environment's ``python`` is a link to the system one)."""
    mine = sys.executable
    return bool(mine) and (os.path.dirname(os.path.abspath(program)) == os.path.dirname(os.path.abspath(mine))
                           and os.path.realpath(program) == os.path.realpath(mine))


def _startup_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` without what differs between the ranks of a job (read after the fork, not at start)."""
    return {key: value for key, value in env.items()
            if key not in _VARYING and not key.startswith(_VARYING_PREFIXES)}


def enabled(env: dict[str, str]) -> bool:
    """Whether a rank with environment ``env`` may be forked (``GRADSYNC_FORKSERVER`` is not ``0``)."""
    return env.get(ENV, "1") != "0"


class ForkedProcess:
    """A rank the forkserver forks, with what :class:`subprocess.Popen` offers the launcher: ``pid``,
    ``returncode``, ``poll``, ``wait``, ``send_signal``/``terminate``/``kill`` and the ``stdout`` and
    ``stderr`` pipes (binary).

    Starting does not wait: the forkserver forks the rank once it has imported torch, and ``pid``
    waits for that (``poll`` says None meanwhile). Where the forkserver refuses (its imports failed),
    the rank starts with ``exec`` on the same pipes, as if it never had been asked."""

    def __init__(self, command: list[str], env: dict[str, str], hook):
        self.args, self._env, self._hook = command, env, hook
        out_r, self._out_w = os.pipe()
        err_r, self._err_w = os.pipe()
        self.stdout, self.stderr = open(out_r, "rb"), open(err_r, "rb")
        self._pid: int | None = None
        self._code: int | None = None
        self._popen: subprocess.Popen | None = None
        self._refused = ""
        self._replied, self._ended = threading.Event(), threading.Event()
        self._lock = threading.Lock()

    # --- what the forkserver's reader thread reports
    def _forked(self, pid: int) -> None:
        self._pid = pid
        self._close_write_ends()
        self._replied.set()

    def _refuse(self, why: str) -> None:
        self._refused = why
        self._replied.set()

    def _end(self, code: int) -> None:
        if self._code is None:
            self._code = code
            self._close_write_ends()
            self._replied.set()
            self._ended.set()

    def _close_write_ends(self) -> None:
        for fd in (self._out_w, self._err_w):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._out_w = self._err_w = -1

    def _resolve(self) -> None:
        """Wait for the forkserver's answer; on a refusal, start the rank with ``exec``."""
        self._replied.wait()
        with self._lock:
            if self._refused and self._popen is None and self._code is None:
                try:
                    self._popen = subprocess.Popen(
                        self.args, env=self._env, stdin=subprocess.DEVNULL, stdout=self._out_w,
                        stderr=self._err_w, start_new_session=True, preexec_fn=self._hook)
                    self._pid = self._popen.pid
                except OSError as exc:
                    os.write(self._err_w, f"gradsync run: cannot start {self.args[0]}: {exc}\n".encode())
                    self._end(127)
                self._close_write_ends()

    @property
    def pid(self) -> int | None:
        """The rank's process id, once it is forked; None for a rank that ended before it started."""
        self._resolve()
        return self._pid

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def poll(self) -> int | None:
        if not self._replied.is_set():
            return None  # not forked yet
        self._resolve()
        return self._popen.poll() if self._popen is not None and self._code is None else self._code

    def wait(self, timeout: float | None = None) -> int:
        self._resolve()
        if self._popen is not None and self._code is None:
            return self._popen.wait(timeout)
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None and self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Server:
    """One forkserver process and the thread that reads its replies."""

    def __init__(self, env: dict[str, str], hook, shown: list[str]):
        """``shown``: the ranks' command, appended to the forkserver's own so that ``ps`` and
        ``pgrep -f train.py`` find it and every rank it forks (they inherit its command line)."""
        self.refused = ""  # why the forkserver forks nothing (its imports failed, or it is gone)
        self._hook = hook
        self._lock = threading.Lock()
        self._next = 0
        self._pending: dict[int, ForkedProcess] = {}  # request id -> its rank, until forked
        self._children: dict[int, ForkedProcess] = {}  # pid -> rank, until it exits
        self._ready = False
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = mine
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", "from gradsync.launch.forkserver import _serve; _serve()", str(theirs.fileno()),
                 *shown],
                env=env, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                start_new_session=True, preexec_fn=hook)
        finally:
            theirs.close()
        self._reader = threading.Thread(target=self._read, name="gradsync-forkserver", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                data = self._sock.recv(_MAX_MESSAGE)
            except ConnectionResetError:
                # It exited with requests unread (a refusal, a crash): Linux reports that once, ahead
                # of what it sent before, which is still queued and read next.
                continue
            except OSError:
                data = b""
            if not data:
                break
            try:
                message = json.loads(data)
            except ValueError:  # not the forkserver's word: stop it, and its ranks end with it
                self.proc.kill()
                break
            with self._lock:
                if "ready" in message:
                    self._ready = True
                elif "refuse" in message:
                    self.refused = message["refuse"]
                    print(f"gradsync run: ranks start with exec, not forked: {self.refused} (in the forkserver)",
                          file=sys.stderr, flush=True)
                elif "exit" in message:  # always after the reply that named the child: one socket, in order
                    child = self._children.pop(message["exit"], None)
                    if child is not None:
                        child._end(message["code"])
                else:
                    child = self._pending.pop(message["id"])
                    self._children[message["pid"]] = child
                    child._forked(message["pid"])
        code = self.proc.wait()
        with self._lock:
            self.refused = self.refused or f"the forkserver exited with {code}"
            for child in self._pending.values():
                if self._ready:  # it had forked it, or was about to: it died with the forkserver
                    child._end(-signal.SIGKILL)
                else:
                    child._refuse(self.refused)
            for child in self._children.values():  # their parent-death signal killed them
                child._end(-signal.SIGKILL)
            self._pending.clear()
            self._children.clear()

    def spawn(self, target: dict, command: list[str], env: dict[str, str]) -> ForkedProcess | None:
        """Ask for a rank; None if this forkserver forks nothing."""
        child = ForkedProcess(command, env, self._hook)
        with self._lock:
            if not self.refused:
                self._next += 1
                request = {"id": self._next, **target, "env": env, "cwd": os.getcwd()}
                try:
                    socket.send_fds(self._sock, [json.dumps(request).encode()], [child._out_w, child._err_w])
                    self._pending[self._next] = child
                    return child
                except OSError as exc:
                    self.refused = f"cannot reach the forkserver: {exc}"
        child._close_write_ends()
        child.stdout.close()
        child.stderr.close()
        return None

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout=5)


class Forks:
    """A job's forkservers on this machine, closed with the job: one per start-up environment (the
    variables a rank's interpreter reads before its script runs; one for the ranks of a job).

    :meth:`start` asks for a rank and returns at once, or returns None when the rank has to
    start with ``exec`` (not a Python script or module, ``GRADSYNC_FORKSERVER=0``, a forkserver
    that failed)."""

    def __init__(self, die_with_parent_hook=None):
        self._hook = die_with_parent_hook
        self._servers: dict[frozenset, _Server] = {}

    def start(self, command: list[str], env: dict[str, str]) -> ForkedProcess | None:
        netns, python = _netns_prefix(command)
        target = python_target(python, env) if enabled(env) else None
        if target is None:
            return None
        if netns is not None:
            target["netns"] = netns
        startup = _startup_env(env)
        key = frozenset(startup.items())
        server = self._servers.get(key)
        if server is None:
            server = self._servers[key] = _Server(startup, self._hook, python[1:])
        return server.spawn(target, command, env)

    def close(self) -> None:
        for server in self._servers.values():
            server.close()
        self._servers.clear()


# --- the forkserver process ------------------------------------------------------------------


def _serve() -> None:
    """The forkserver's main: import torch, then fork a rank per request until the launcher hangs up.
    Returns only in a forked rank, which then runs its script."""
    sock = socket.socket(fileno=int(sys.argv[1]))
    problem = ""
    try:
        import importlib
        for name in PRELOAD:
            importlib.import_module(name)
        if sys.modules["torch"].cuda.is_initialized():
            problem = "importing torch initialised CUDA, which a forked rank cannot use"
    except BaseException as exc:  # noqa: BLE001 - reported to the launcher, which starts ranks with exec
        problem = f"importing torch failed: {type(exc).__name__}: {exc}"
    if problem:
        sock.send(json.dumps({"refuse": problem}).encode())
        os._exit(0)
    import gc
    gc.freeze()  # what the imports made is never collected: its pages stay shared with every rank
    sock.send(json.dumps({"ready": True}).encode())
    _run(_fork_per_request(sock))


def _fork_per_request(sock: socket.socket) -> dict:
    import ctypes
    import select
    libc = ctypes.CDLL(None, use_errno=True)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    me = os.getpid()
    while True:
        ready = select.select([sock, wake_r], [], [])[0]
        if wake_r in ready:
            os.read(wake_r, 4096)
            _reap(sock)
        if sock not in ready:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 2)
        except ConnectionResetError:  # the launcher closed with replies unread: it is done all the same
            data = b""
        if not data:  # the launcher is done; any child left gets SIGKILL as this process exits
            os._exit(0)  # now: unwinding the interpreter with torch loaded takes a second
        request = json.loads(data)
        started_r, started_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for fd in (wake_r, wake_w, started_r):
                os.close(fd)
            sock.close()
            _become_rank(libc, me, request, fds, started_w)
            return request
        for fd in (*fds, started_w):
            os.close(fd)
        os.read(started_r, 1)  # EOF once the rank leads its own process group: the launcher's killpg reaches it
        os.close(started_r)
        sock.send(json.dumps({"id": request["id"], "pid": pid}).encode())


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock.send(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode())


def _become_rank(libc, server_pid: int, request: dict, fds: list[int], started: int) -> None:
    """What ``subprocess.Popen`` and ``python`` would have given the rank, short of the interpreter."""
    os.setsid()  # its own process group: one killpg also reaches its children
    libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != server_pid:  # the forkserver died before prctl took effect
        os._exit(1)
    os.close(started)
    if "netns" in request:
        path = f"{_NETNS_DIR}/{request['netns']}"
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            os.write(fds[1], f"gradsync run: cannot enter {path}: {exc}\n".encode())
            os._exit(127)
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            import ctypes
            os.write(fds[1], f"gradsync run: cannot enter {path}: {os.strerror(ctypes.get_errno())}\n".encode())
            os._exit(127)
        os.close(fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((devnull, 0), (fds[0], 1), (fds[1], 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for name in [name for name in sys.modules if name == "gradsync" or name.startswith("gradsync.")]:
        del sys.modules[name]  # the rank imports its own, from its own sys.path
    if "numpy.random" in sys.modules:  # ``random`` reseeds itself after a fork; numpy does not
        sys.modules["numpy.random"].seed()


def _run(request: dict) -> None:
    """Run the rank's script or module as ``python`` does; an uncaught exception shows the script's
    frames only, and the interpreter's exit (atexit, threads, exit code) is Python's own."""
    import builtins
    import runpy
    import types
    from importlib.machinery import SourceFileLoader

    own = {__file__, "<string>"}
    shown = sys.excepthook

    def excepthook(kind, value, tb):
        while tb is not None and tb.tb_frame.f_code.co_filename in own:
            tb = tb.tb_next
        if isinstance(value, BaseException):
            value.__traceback__ = tb  # what the default hook prints
        shown(kind, value, tb)

    sys.excepthook = excepthook
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    if "module" in request:
        sys.argv = ["-m", *request["args"]]
        if not getattr(sys.flags, "safe_path", False):  # PYTHONSAFEPATH: no folder goes first
            sys.path[0] = os.getcwd()
        runpy._run_module_as_main(request["module"])  # what ``python -m`` runs
        return
    path = request["script"]
    sys.argv = [path, *request["args"]]
    if not getattr(sys.flags, "safe_path", False):
        sys.path[0] = os.path.dirname(os.path.realpath(path))
    where = os.path.abspath(path)  # Python gives __main__ the absolute path, argv[0] the one typed
    main.__dict__.update(__file__=where, __cached__=None, __loader__=SourceFileLoader("__main__", where))
    with open(where, "rb") as f:
        code = compile(f.read(), where, "exec")
    exec(code, main.__dict__)
