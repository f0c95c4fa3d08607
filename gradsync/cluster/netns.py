"""Shaped links on one machine: network namespaces, veth pairs, a bridge and ``tc tbf``.

An :class:`EmulatedCluster` of ``N`` hosts is ``N + 1`` network namespaces created for it alone::

    gsync-<pid>-<k>-h0 ... -h<N-1>     one per emulated host: ``eth0`` with 10.213.0.<i+1>/24, ``lo``
    gsync-<pid>-<k>-sw                 the switch: bridge ``br0`` with ports ``p0`` ... ``p<N-1>``

plus ``/etc/netns/<host namespace>/hosts`` naming the hosts' addresses.

Host ``i``'s ``eth0`` and the switch's ``p<i>`` are the two ends of one veth pair, created inside the
switch namespace and moved, so nothing is ever added to the machine's own namespace. With a rate,
``tc tbf`` shapes the egress of *both* ends: ``eth0`` is the host's uplink, ``p<i>`` its downlink, so
every host has a full-duplex link of that rate (or of its own: ``host_rates``) and a many-to-one
pattern queues at the switch port as on a real switch. (``tbf`` on one end only would leave the other direction unshaped; ``tbf`` on a
loopback would shape both directions together.)

Ranks run inside their host's namespace through ``ip netns exec`` and must use ``eth0``
(``GLOO_SOCKET_IFNAME``; otherwise Gloo resolves the host name to 127.0.0.1). Everything is removed
by :meth:`EmulatedCluster.close`; if this process dies first, a small reaper process (started with
the cluster, blocked on a pipe from us) removes it; ``gradsync cluster cleanup`` removes what is
left after anything worse. Needs root or CAP_NET_ADMIN.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys

from gradsync.errors import ConfigError

PREFIX = "gsync-"
IFNAME = "eth0"
ETC_NETNS = "/etc/netns"
SUBNET = "10.213.0"
VETH_MTU = 9000
"""Jumbo frames, as in GPU clusters: with 1500-byte frames the TCP/IP headers that ``tbf`` counts
take 4.5 % of a link and a bidirectional 100 Mbit/s link measured 0.88x of its rate."""
_NAME = re.compile(rf"^{PREFIX}(\d+)-(\d+)-(sw|h\d+)$")
_counter = itertools.count()
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_rate(text: str) -> float:
    """``'100mbit'``, ``'1gbit'``, ``'2.5g'``, ``'10G'`` -> bits per second."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(?:bit|bps|b)?(?:/s)?\s*", text.lower())
    if not match or float(match.group(1)) <= 0:
        raise ConfigError(f"bad link rate {text!r}: expected a positive number with a unit, e.g. 100mbit, 1gbit, 10gbit")
    return float(match.group(1)) * _UNITS[match.group(2)]


def format_rate(bps: float) -> str:
    for unit, scale in (("Gbit", 1e9), ("Mbit", 1e6), ("kbit", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g} {unit}/s"
    return f"{bps:g} bit/s"


def require_privileges() -> None:
    """ConfigError unless this process may create namespaces and qdiscs: root or CAP_NET_ADMIN, and
    iproute2's ``ip`` and ``tc`` on the PATH."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise ConfigError(f"shaped links (--net) need iproute2's ip and tc; {' and '.join(missing)} not found on "
                          "PATH here: install iproute2 (apt install iproute2), or leave out --net to use loopback")
    if os.geteuid() == 0 or _has_net_admin():
        return
    raise ConfigError("shaped links (--net) need root or CAP_NET_ADMIN to create network namespaces "
                      "and tc qdiscs; run as root (e.g. sudo), or leave out --net to use loopback")


def _has_net_admin() -> bool:
    with contextlib.suppress(OSError, ValueError, StopIteration):
        with open("/proc/self/status") as f:
            caps = next(line for line in f if line.startswith("CapEff:"))
        return bool(int(caps.split()[1], 16) & (1 << 12))  # CAP_NET_ADMIN = 12
    return False


def _ip(*args: str) -> None:
    _run(["ip", *args])


def _run(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode:
        raise ConfigError(f"network setup failed: `{' '.join(argv)}` said: {done.stderr.strip() or done.returncode}")


def tbf_args(rate_bps: float) -> list[str]:
    """``tc`` arguments of a token bucket that really reaches ``rate_bps`` here.

    Burst must cover one timer tick (HZ=250: rate/250 bytes) and a whole 64 KB GSO packet with room
    to spare, else the link falls short of its rate (measured; shared/reference/emulation.md).
    """
    burst = max(int(rate_bps / 8 / 250), 256 * 1024)
    return ["tbf", "rate", f"{int(rate_bps)}bit", "burst", str(burst), "latency", "20ms"]


class EmulatedCluster:
    """``hosts`` namespaces joined by a switch; each host link shaped to ``rate_bps`` (None: unshaped),
    or to its own rate in ``host_rates`` (``{host: bits/s}``: a slow link), with ``delay_ms`` one
    way host to host and ``loss`` (0 to 1) of the frames dropped on each link."""

    def __init__(self, hosts: int, rate_bps: float | None = None, delay_ms: float = 0.0, loss: float = 0.0,
                 host_rates: dict[int, float] | None = None):
        if hosts < 1:
            raise ConfigError(f"an emulated cluster needs at least 1 host, got {hosts}")
        if delay_ms < 0:
            raise ConfigError(f"link delay must be >= 0 ms, got {delay_ms}")
        if not 0 <= loss < 1:
            raise ConfigError(f"link loss must be a fraction in [0, 1), got {loss}")
        outside = sorted(h for h in host_rates or {} if not 0 <= h < hosts)
        if outside:
            raise ConfigError(f"host {outside[0]} has a link rate but the cluster has hosts 0-{hosts - 1}")
        self.hosts, self.rate_bps, self.delay_ms, self.loss = hosts, rate_bps, delay_ms, loss
        self.host_rates = dict(host_rates or {})
        self._line: subprocess.Popen | None = None
        self.tag = f"{PREFIX}{os.getpid()}-{next(_counter)}"
        self.switch = f"{self.tag}-sw"
        self.namespaces: list[str] = []
        self._reaper: subprocess.Popen | None = None

    def link_down(self, host: int) -> None:
        """Take ``host``'s link down (its cable pulled out): frames to and from it are lost."""
        _ip("-n", self.host_ns(host), "link", "set", IFNAME, "down")

    def link_up(self, host: int) -> None:
        """Bring ``host``'s link back (its address and routes return with it)."""
        _ip("-n", self.host_ns(host), "link", "set", IFNAME, "up")

    def host_ns(self, host: int) -> str:
        return f"{self.tag}-h{host}"

    def address(self, host: int) -> str:
        return f"{SUBNET}.{host + 1}"

    def exec_prefix(self, host: int) -> list[str]:
        """Put in front of a command to run it on ``host``."""
        return ["ip", "netns", "exec", self.host_ns(host)]

    def env(self) -> dict[str, str]:
        """Variables every rank inside the cluster needs."""
        return {"GLOO_SOCKET_IFNAME": IFNAME}

    # --- lifecycle ---

    def __enter__(self) -> "EmulatedCluster":
        self.create()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def create(self) -> None:
        require_privileges()
        self._start_reaper()
        try:
            self._add_ns(self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for host in range(self.hosts):
                self._add_ns(self.host_ns(host))
                self._write_hosts_file(host)
            if self.delay_ms or self.loss:
                self._start_delay_line()
            else:
                for host in range(self.hosts):
                    _ip("-n", self.switch, "link", "add", f"p{host}", "mtu", str(VETH_MTU), "type", "veth",
                        "peer", "name", IFNAME, "mtu", str(VETH_MTU), "netns", self.host_ns(host))
            for host in range(self.hosts):
                self._configure_link(host)
        except BaseException:
            self.close()
            raise

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self.namespaces.append(name)
        self._reaper.stdin.write(name + "\n")
        self._reaper.stdin.flush()
        _ip("-n", name, "link", "set", "lo", "up")

    def _start_delay_line(self) -> None:
        """The TAP pairs of :mod:`gradsync.cluster.delayline` instead of veth pairs; large frames
        (MTU 65000) keep the frame rate within what one Python process can forward."""
        hosts = [self.host_ns(h) for h in range(self.hosts)]
        self._line = subprocess.Popen([sys.executable, "-m", "gradsync.cluster.delayline", str(self.delay_ms),
                                       str(self.loss), self.switch, *hosts], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if self._line.stdout.readline().strip() != "ready":
            raise ConfigError("the delay line could not create its TAP devices (see the error above)")
        for host in range(self.hosts):
            _ip("-n", self.host_ns(host), "link", "set", IFNAME, "mtu", "65000")
            _ip("-n", self.switch, "link", "set", f"p{host}", "mtu", "65000")

    def _configure_link(self, host: int) -> None:
        ns, port = self.host_ns(host), f"p{host}"
        _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
        _ip("-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", IFNAME)
        _ip("-n", ns, "link", "set", IFNAME, "up")
        for argv in self.shaping(host):
            _run(argv)

    def link_rate(self, host: int) -> float | None:
        """The rate of ``host``'s link in bits/s (None: unshaped)."""
        return self.host_rates.get(host, self.rate_bps)

    def shaping(self, host: int) -> list[list[str]]:
        """The ``tc`` commands that shape ``host``'s link at :meth:`link_rate`: its uplink (``eth0``
        in its namespace) and its downlink (its port ``p<host>`` on the switch); none if unshaped."""
        rate = self.link_rate(host)
        if not rate:
            return []
        return [["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *tbf_args(rate)]
                for ns, dev in ((self.host_ns(host), IFNAME), (self.switch, f"p{host}"))]

    def _write_hosts_file(self, host: int) -> None:
        ns = self.host_ns(host)
        # `ip netns exec` mounts /etc/netns/NS/hosts over /etc/hosts. Naming every address lets
        # Gloo's reverse lookups answer at once instead of asking a DNS server nobody can reach.
        os.makedirs(os.path.join(ETC_NETNS, ns), exist_ok=True)
        with open(os.path.join(ETC_NETNS, ns, "hosts"), "w") as f:
            f.write(f"127.0.0.1 localhost\n{self.address(host)} {socket.gethostname()}\n")
            for h in range(self.hosts):  # the store listens on IPv6, so peers appear IPv4-mapped
                f.write(f"{self.address(h)} {self.tag}-h{h}\n::ffff:{self.address(h)} {self.tag}-h{h}\n")

    def _start_reaper(self) -> None:
        # Own session: a Ctrl-C to our process group must not kill it before we clean up.
        self._reaper = subprocess.Popen([sys.executable, "-m", "gradsync.cluster.reaper"],
                                        stdin=subprocess.PIPE, text=True, start_new_session=True)

    def close(self) -> None:
        """Remove the namespaces (stopping anything still running in them); idempotent."""
        remove(self.namespaces)
        self.namespaces = []
        if self._line is not None:
            with contextlib.suppress(OSError):
                self._line.stdin.close()  # EOF: the delay line exits and its devices vanish
            try:
                self._line.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._line.kill()
                self._line.wait()
            self._line = None
        if self._reaper is not None:
            with contextlib.suppress(OSError):
                self._reaper.stdin.close()  # EOF: the reaper finds nothing left and exits
            self._reaper.wait()
            self._reaper = None


def remove(names: list[str]) -> None:
    """Stop the processes inside each namespace (all of them started by gradsync), then delete it."""
    for name in names:
        pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        shutil.rmtree(os.path.join(ETC_NETNS, name), ignore_errors=True)


def leftovers(include_live: bool = False) -> list[str]:
    """gradsync namespaces whose creating process is gone (all of them with ``include_live``)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n")
    names = [line.split()[0] for line in listed if line.strip()]
    found = []
    for name in names:
        match = _NAME.match(name)
        if match and (include_live or not _alive(int(match.group(1)))):
            found.append(name)
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
