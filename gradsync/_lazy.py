"""Public names of a package that load their module on first use (PEP 562), so that importing the
package imports no torch (``gradsync`` and ``gradsync.adapt``: ``gradsync run`` reads both), and old
spellings of public names that still work but warn."""
from __future__ import annotations

import sys
import warnings
from importlib import import_module


def lazy_names(package: str, names: dict[str, str], *, modules: tuple[str, ...] = (),
               renamed: dict[str, str] | None = None) -> None:
    """Give ``package`` its public ``names`` (name -> the module that defines it) and its submodules
    ``modules`` (``gradsync.strategies`` after a bare ``import gradsync``), each imported the first
    time it is read, and its ``renamed`` names (old name -> the new spelling, a dotted
    path such as ``"gradsync.strategies.TorchDDP"``): reading an old name returns what the new
    spelling names, with a :class:`DeprecationWarning` that names it."""
    module = sys.modules[package]
    renamed = renamed or {}

    def __getattr__(name: str):
        if name in names:
            value = getattr(import_module(names[name]), name)
            vars(module)[name] = value
            return value
        if name in modules:
            return import_module(f"{package}.{name}")  # which sets it as the package's attribute
        if name in renamed:
            warnings.warn(f"{package}.{name} is deprecated; use {renamed[name]}", DeprecationWarning, stacklevel=2)
            return resolve(renamed[name])
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(vars(module)) | set(names) | set(modules))

    module.__getattr__, module.__dir__ = __getattr__, __dir__


def resolve(dotted: str):
    """The object a dotted path names: ``"gradsync.strategies.names"`` -> that function."""
    owner, _, name = dotted.rpartition(".")
    return getattr(import_module(owner), name)
