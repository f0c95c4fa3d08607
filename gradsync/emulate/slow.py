"""Emulated stragglers: workers whose emulated compute takes longer than the profile says.

``--slow RANK:FACTOR`` (``gradsync bench``, ``gradsync run``) makes worker ``RANK``'s emulated
layers take ``FACTOR`` times their profiled time (its :class:`~gradsync.emulate.model.AcceleratorClock`
runs at ``dilation * FACTOR``): a slower GPU, a throttled one, a noisy neighbour. The other workers
keep the profile's speed. The launcher hands the setting to every rank in :data:`ENV`
(``GRADSYNC_SLOW=3:2,1:1.25``); an :class:`~gradsync.emulate.model.EmulatedModel` built on a rank
reads it with the rank's ``RANK``, so an emulated model in a user's own script is slowed too.

Real compute cannot be slowed: the setting acts on emulated models only. This module imports no
torch (``gradsync run`` reads it).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from gradsync.errors import ConfigError

ENV = "GRADSYNC_SLOW"
"""The variable that carries :class:`SlowRanks` to the ranks, as ``RANK:FACTOR[,RANK:FACTOR...]``."""


@dataclass(frozen=True)
class SlowRanks:
    """Which workers compute slower, and how much: ``{rank: factor}``, every factor >= 1."""

    factors: dict[int, float] = field(default_factory=dict)
    """Global rank -> how many times as long its emulated compute takes (ranks not named: 1)."""

    @classmethod
    def parse(cls, text: str) -> "SlowRanks":
        """``"3:2,1:1.25"`` -> ranks 3 and 1 at 2x and 1.25x; ``""`` or ``"none"``: nobody slowed.
        A malformed item, a factor below 1 or a rank named twice is a ConfigError saying which."""
        factors: dict[int, float] = {}
        if text.strip().lower() in ("", "none"):
            return cls(factors)
        for item in text.split(","):
            rank_text, colon, factor_text = item.strip().partition(":")
            try:
                rank, factor = int(rank_text), float(factor_text)
            except ValueError:
                raise ConfigError(f"{item.strip()!r}: expected RANK:FACTOR, e.g. 3:2 (rank 3's compute takes "
                                  "twice as long)") from None
            if not colon or rank < 0:
                raise ConfigError(f"{item.strip()!r}: expected RANK:FACTOR with a rank >= 0, e.g. 3:2")
            if not (factor >= 1 and math.isfinite(factor)):  # NaN fails too
                raise ConfigError(f"{item.strip()!r}: the factor must be a number >= 1 (how many times as long "
                                  f"the rank's compute takes), got {factor_text}")
            if rank in factors:
                raise ConfigError(f"rank {rank} is named twice ({text})")
            factors[rank] = factor
        return cls(factors)

    @classmethod
    def union(cls, parts: list["SlowRanks"]) -> "SlowRanks":
        """Several ``--slow`` options as one; a rank named by two of them is a ConfigError."""
        factors: dict[int, float] = {}
        for part in parts:
            for rank, factor in part.factors.items():
                if rank in factors:
                    raise ConfigError(f"rank {rank} is named twice (--slow {rank}:{factors[rank]:g} and "
                                      f"--slow {rank}:{factor:g})")
                factors[rank] = factor
        return cls(factors)

    def factor(self, rank: int) -> float:
        """How many times as long ``rank``'s emulated compute takes (1 for a rank not named)."""
        return self.factors.get(rank, 1.0)

    def check(self, workers: int, servers: int = 0) -> None:
        """ConfigError unless every named rank is one of ``workers`` workers (ranks ``0..workers-1``;
        servers, after them, run no model to slow)."""
        for rank in sorted(self.factors):
            if rank < workers:
                continue
            if rank < workers + servers:
                raise ConfigError(f"rank {rank} is a parameter server (workers are ranks 0-{workers - 1}): "
                                  "only a worker's compute can be slowed")
            raise ConfigError(f"rank {rank} is out of range: the workers are ranks 0-{workers - 1}")

    def __bool__(self) -> bool:
        return bool(self.factors)

    def __str__(self) -> str:
        """The form :meth:`parse` reads, ranks in order (``""`` when nobody is slowed)."""
        return ",".join(f"{rank}:{factor:g}" for rank, factor in sorted(self.factors.items()))


def rank_factor(environ=os.environ) -> float:
    """This process's factor: :data:`ENV` at its ``RANK`` (1 when either is unset). A malformed
    :data:`ENV` is a ConfigError naming the variable."""
    text = environ.get(ENV, "")
    try:
        slow = SlowRanks.parse(text)
    except ConfigError as exc:
        raise ConfigError(f"{ENV}={text}: {exc}") from None
    rank = environ.get("RANK")
    return slow.factor(int(rank)) if rank is not None and rank.isdigit() else 1.0
