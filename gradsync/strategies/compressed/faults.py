"""Faults of the compressed strategies: a NaN/Inf gradient or a codec failure, and the error every worker raises.

Before its first message for a bucket a worker checks its gradients for NaN/Inf. A worker with a
fault (or a compressor error, e.g. fp16 overflow) keeps taking part in the bucket's message pattern
but sends headers only, carrying the fault (code, rank, parameter); every receiver passes it on.
When the pattern ends every worker knows, and each raises
:class:`~gradsync.compress.NonFiniteGradientError` (or ``CompressionError``) naming the rank and the
parameter: no rank raises while the others hang.

:class:`Faults` holds this state for one strategy: the fault known for the bucket the communication
thread is exchanging (first one wins), and the error every worker agreed on this step.
"""
from __future__ import annotations

from dataclasses import dataclass

from gradsync.compress import CompressionError, NonFiniteGradientError
from gradsync.compress.base import all_finite
from gradsync.errors import GradsyncError
from gradsync.strategies.allreduce import Bucket

FAULT_NONFINITE, FAULT_COMPRESSION = 1, 2
NO_FAULT = (0, -1, -1)
"""A message header's fault fields when its sender has none."""


@dataclass(frozen=True)
class Fault:
    code: int
    rank: int
    param: int
    """Index of the parameter, or -1 for a merged sum (a ring hop or an aggregator re-encoding)."""

    @property
    def info(self) -> tuple[int, int, int]:
        return (self.code, self.rank, self.param)


class Faults:
    """The fault state of one compressed strategy on one rank, and the errors it turns into.

    ``known`` is written only by the communication thread while it exchanges a bucket (and by the
    exchanges it runs); ``agreed`` is set by that thread and taken by the training thread at the
    end of backward."""

    def __init__(self, rank: int, names: list[str], codec_name: str):
        self.rank, self.names, self.codec_name = rank, names, codec_name
        self.known: Fault | None = None
        """The fault of the bucket being exchanged: this worker's own, or one a header carried."""
        self.agreed: GradsyncError | None = None
        """A fault every worker learned this step: the thread goes on, ``step()`` raises it."""

    def find(self, bucket: Bucket) -> Fault | None:
        """This worker's NaN/Inf fault in ``bucket``'s gradients (the first such parameter), if any."""
        if all_finite(bucket.buffer[:bucket.numel]):
            return None
        slot = next(s for s, v in enumerate(bucket.views) if not all_finite(v))
        return Fault(FAULT_NONFINITE, self.rank, bucket.indices[slot])

    def begin(self, bucket: Bucket) -> None:
        """The communication thread starts exchanging ``bucket``: what is known is this worker's own fault."""
        self.known = self.find(bucket)

    def note(self, fault: Fault) -> None:
        """A fault seen during the exchange (a header's, or a codec failure here); the first one stays."""
        if self.known is None:
            self.known = fault

    def note_header(self, info) -> None:
        """The fault fields of a received header; code 0 is none."""
        if info[0]:
            self.note(Fault(*info))

    def note_compression(self, param: int) -> None:
        """This worker's codec failed on parameter ``param`` (-1: a merged sum)."""
        self.note(Fault(FAULT_COMPRESSION, self.rank, param))

    @property
    def header(self) -> tuple[int, int, int]:
        """The fault fields of this worker's next message."""
        return self.known.info if self.known is not None else NO_FAULT

    def raise_known(self, k: int, bucket: Bucket) -> None:
        """End of bucket ``k``'s exchange: every worker knows the same fault, and raises it."""
        if self.known is not None:
            raise self.error(self.known, k, bucket)

    def error(self, fault: Fault, k: int, bucket: Bucket) -> GradsyncError:
        """The error naming ``fault``'s rank and parameter, alike on every worker."""
        what = (f"gradient of {self.names[fault.param]!r}" if fault.param >= 0 else
                f"the merged sum of bucket {k} ({self.names[bucket.indices[0]]!r}..)")
        if fault.code == FAULT_NONFINITE:
            return NonFiniteGradientError(
                f"{what} on rank {fault.rank} has NaN/Inf elements; nothing was applied (every worker raises "
                "this). Lower the learning rate or clip gradients; with torch.amp.GradScaler the step is "
                "skipped instead (every gradient is NaN).")
        return CompressionError(f"compressing {what} on rank {fault.rank} with {self.codec_name} failed (out of "
                                "its range, e.g. fp16 overflow); use bf16, or scale the loss down. Every worker "
                                "raises this.")
