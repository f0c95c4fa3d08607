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


def accepted_options(constructor) -> tuple[list, str | None]:
    """The keyword parameters (:class:`inspect.Parameter`) ``constructor`` takes, following
    ``**options`` up a class's bases to the ``__init__`` that names them; and the name of a
    ``**`` catch-all that none names (a compressed strategy's ``**compressor_options``), else None."""
    import functools
    import inspect

    cls = constructor.func if isinstance(constructor, functools.partial) else constructor
    try:
        params = list(inspect.signature(constructor).parameters.values())
    except (TypeError, ValueError):  # a callable Python cannot inspect: its options are unknown
        return [], "options"
    bases = iter(cls.__mro__[1:]) if isinstance(cls, type) else iter(())
    found: list = []
    while True:
        found += [p for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name != "self"
                  and all(p.name != q.name for q in found)]
        rest = next((p.name for p in params if p.kind is p.VAR_KEYWORD), None)
        if rest is None:
            return found, None
        base = next((b for b in bases if "__init__" in vars(b)), None)
        if base is None or base is object:
            return found, rest
        params = list(inspect.signature(base.__init__).parameters.values())


def options_error(kind: str, name: str, constructor, options: dict, exc: TypeError) -> ConfigError:
    """The error for ``constructor(**options)`` of a ``kind`` (strategy, compressor) that raised
    ``exc``: the options it does not take, with those it does, or the values of the wrong type."""
    known, rest = accepted_options(constructor)
    if rest is None:
        names = [p.name for p in known]
        unknown = [key for key in options if key not in names]
        if unknown:
            return ConfigError(f"{kind} {name!r} has no option {', '.join(map(repr, unknown))}; its options: "
                               f"{', '.join(names) or 'none'}")
    given = ", ".join(f"{key}={value!r} (a {type(value).__name__})" for key, value in options.items())
    return ConfigError(f"invalid options for {kind} {name!r}: {given}: {exc}")
