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


def options_error(kind: str, name: str, constructor, options: dict, exc: TypeError) -> ConfigError:
    """The error for ``constructor(**options)`` of a ``kind`` (strategy, compressor) that raised
    ``exc``: the options it does not take, with those it does, or the values of the wrong type."""
    import inspect

    try:
        params = inspect.signature(constructor).parameters
    except (TypeError, ValueError):
        params = None
    if params is not None and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        known = [p for p in params if p != "self"]
        unknown = [key for key in options if key not in known]
        if unknown:
            return ConfigError(f"{kind} {name!r} has no option {', '.join(map(repr, unknown))}; its options: "
                               f"{', '.join(known) or 'none'}")
    given = ", ".join(f"{key}={value!r} (a {type(value).__name__})" for key, value in options.items())
    return ConfigError(f"invalid options for {kind} {name!r}: {given}: {exc}")
