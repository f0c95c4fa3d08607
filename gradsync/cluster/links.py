"""``--net``'s value: the rate of every emulated host's link, and the ranks whose host has another.

``--net 1gbit`` gives every host a 1 Gbit/s link. ``--net 1gbit,rank3=250mbit`` gives the host that
holds rank 3 a 250 Mbit/s link instead (a straggler's network: a congested or slower NIC), both
directions, as every link is shaped. With several ranks to a host (``--ranks-per-host``) the named
rank's whole host has that link; two ranks of one host named at different rates are an error.
``gradsync bench`` also takes several default rates, one run each (``--net 1gbit,10gbit,rank3=250mbit``:
rank 3's host at 250 Mbit/s in both runs).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from gradsync.cluster.netns import format_rate, parse_rate
from gradsync.errors import ConfigError


@dataclass(frozen=True)
class LinkRates:
    """Every host's link at ``default`` bits/s, except the hosts holding the ranks in ``ranks``."""

    default: float
    """Bits per second of a host's link (each direction)."""
    ranks: dict[int, float] = field(default_factory=dict)
    """Global rank -> bits per second of the link of the host that holds it."""

    @classmethod
    def parse(cls, text: str) -> "LinkRates":
        """``"1gbit"`` or ``"1gbit,rank3=250mbit"``: exactly one default rate (see :func:`parse_net`)."""
        runs = parse_net(text)
        if len(runs) != 1:
            raise ConfigError(f"one link rate for every host, then rankN=RATE for the exceptions; got {len(runs)} "
                              "rates")
        return runs[0]

    def dilated(self, k: float) -> "LinkRates":
        """Every rate divided by ``k`` (``--dilation``: the rates the links really run at)."""
        return LinkRates(self.default / k, {rank: bps / k for rank, bps in self.ranks.items()})

    def per_host(self, placement: list[int]) -> dict[int, float]:
        """``{host: bits/s}`` for the hosts whose link differs from ``default``, given each rank's host
        (``placement[rank]``). A rank outside the job, or two ranks of one host at different rates,
        is a ConfigError saying which."""
        hosts: dict[int, tuple[int, float]] = {}
        for rank, bps in sorted(self.ranks.items()):
            if rank >= len(placement):
                raise ConfigError(f"rank {rank} is out of range: the job has ranks 0-{len(placement) - 1}")
            host = placement[rank]
            other = hosts.get(host)
            if other is not None and other[1] != bps:
                raise ConfigError(f"ranks {other[0]} and {rank} share emulated host {host} (one link), but --net gives "
                                  f"them {format_rate(other[1])} and {format_rate(bps)}: name one rate for the host")
            hosts.setdefault(host, (rank, bps))
        return {host: bps for host, (_, bps) in hosts.items()}

    def describe(self) -> str:
        """For people: ``1 Gbit/s, rank 3 at 250 Mbit/s``."""
        return ", ".join([format_rate(self.default)] + [f"rank {rank} at {format_rate(bps)}"
                                                         for rank, bps in sorted(self.ranks.items())])

    def __str__(self) -> str:
        """The form :meth:`parse` reads: ``1gbit,rank3=250mbit``."""
        return ",".join([_short(self.default)] + [f"rank{rank}={_short(bps)}" for rank, bps in sorted(self.ranks.items())])


def parse_net(text: str) -> list[LinkRates]:
    """``gradsync bench --net``: one :class:`LinkRates` per default rate, each with every
    ``rankN=RATE`` of the list (``"1gbit,10gbit,rank3=250mbit"`` -> two). ConfigError for a bad
    rate, a bad ``rankN``, a rank named twice, or no default rate."""
    defaults, ranks = [], {}
    for item in (part.strip() for part in text.split(",")):
        name, eq, rate = item.partition("=")
        if not eq:
            defaults.append(parse_rate(item))
            continue
        number = name.strip().lower().removeprefix("rank")
        if not (name.strip().lower().startswith("rank") and number.isdigit()):
            raise ConfigError(f"{item!r}: expected rankN=RATE, e.g. rank3=250mbit (the link of the host holding rank 3)")
        if int(number) in ranks:
            raise ConfigError(f"rank {int(number)} is named twice")
        ranks[int(number)] = parse_rate(rate)
    if not defaults:
        raise ConfigError(f"give the rate of every other host's link first, e.g. 1gbit,{text}")
    return [LinkRates(rate, dict(ranks)) for rate in defaults]


def _short(bps: float) -> str:
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g}{unit}"
    return f"{bps:g}bit"
