"""What a peer may send, checked by every receiver before it uses a header field.

A length, an index or an operation that a peer supplies sizes an allocation or indexes a table, so
it is refused (:class:`~gradsync.errors.PeerProtocolError`, naming the peer) unless it is one that
peer may send. Strategies check their own headers with :func:`check_peer`; compressed messages'
lengths are bounded by :func:`payload_limit`.
"""
from __future__ import annotations

from gradsync.errors import PeerProtocolError


def check_peer(ok: bool, peer: int, what: str, detail: str) -> None:
    """Refuse a message from ``peer`` unless ``ok``: every header field a peer supplies (a length,
    an index, an operation) is checked against what that peer may send before it sizes an
    allocation or indexes a table. ``detail`` says what was received and what was allowed."""
    if not ok:
        raise PeerProtocolError(
            f"rank {peer} sent {what} with {detail}. Nothing was allocated for it and the job stops here: "
            "every rank must run the same gradsync version, strategy and model (or the message was corrupted)")


def payload_limit(numel: int) -> int:
    """The most bytes a compressed message for ``numel`` gradient elements may hold: 16 per element
    (a value and an int64 index, the largest any codec sends) plus 4 KiB of codec metadata."""
    return 16 * numel + 4096
