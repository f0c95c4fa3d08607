"""Errors gradsync raises. Each message says which rank, which tensor, and what to do."""
from __future__ import annotations


class GradsyncError(RuntimeError):
    """Base class: a misuse or a fault that gradsync detected and explained."""


class ModelMismatchError(GradsyncError):
    """Ranks built different models (a parameter's shape or dtype, or the parameter count, differs)."""


class PeerFailureError(GradsyncError):
    """A communication operation failed because another rank died, hung or disconnected."""


class PeerProtocolError(GradsyncError):
    """A peer sent a message outside what it may send (a length, an index, an operation out of
    range): refused before anything is allocated or indexed for it, naming the peer."""


class GradientEditedError(GradsyncError):
    """A gradient was changed between ``backward()`` and ``optimizer.step()`` under a strategy that had
    already sent it (the change would not reach the update)."""


class ConfigError(GradsyncError, ValueError):
    """An option has an invalid value (unknown name, out-of-range number)."""
