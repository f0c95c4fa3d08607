"""Public names of a package that load their module on first use (PEP 562), so that importing the
package imports no torch: ``gradsync`` and ``gradsync.adapt`` (``gradsync run`` reads both)."""
from __future__ import annotations

import sys
import types
from importlib import import_module


def lazy_names(package: str, names: dict[str, str], functions: tuple[str, ...] = ()) -> None:
    """Give ``package`` its public ``names`` (name -> the module that defines it), each imported
    the first time it is read. ``functions``: public functions that share their name with a
    submodule. Importing the submodule makes Python set it as a package attribute, which would
    hide the function (``gradsync.topology()`` would fail with "module is not callable" once
    anything imported ``gradsync.topology``); the function is kept, and the module stays
    importable by its full name."""
    module = sys.modules[package]

    def __getattr__(name: str):
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(names[name]), name)
        vars(module)[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(module)) | set(names))

    module.__getattr__, module.__dir__ = __getattr__, __dir__
    if functions:
        class Package(types.ModuleType):
            def __setattr__(self, name: str, value) -> None:
                if name in functions and isinstance(value, types.ModuleType):
                    return
                super().__setattr__(name, value)

        module.__class__ = Package
