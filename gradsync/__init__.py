"""gradsync: data-parallel PyTorch training with pluggable synchronization strategies.

    import gradsync
    gradsync.init()
    opt = gradsync.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy="allreduce")
    for x, y in loader:
        loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()

The top level is the training script's API: :func:`init`, :func:`shutdown`, :func:`distribute`,
:func:`topology`, :func:`device`, :func:`sampler`, :func:`register` (a strategy of your own, by
name) and the errors. The strategies, their registry and the base class of a strategy live in
:mod:`gradsync.strategies`. See README.md and docs/architecture.md.

Importing the package does not import torch: the public names below load their module on first
use (PEP 562), so ``gradsync run`` (``gradsync.launch``, no torch) starts in milliseconds.
"""
from importlib import import_module as _import_module

from gradsync._lazy import lazy_names as _lazy_names
from gradsync.errors import (ConfigError, GradientEditedError, GradsyncError, ModelMismatchError, PeerFailureError,
                             PeerProtocolError)

# Public name -> the module that defines it (each of these imports torch).
_LAZY = {
    "shutdown": "gradsync.runtime", "is_initialized": "gradsync.runtime",
    "distribute": "gradsync.attach", "sampler": "gradsync.data", "register": "gradsync.strategies",
}

# Old spellings -> the new ones; reading an old one warns (DeprecationWarning) and returns the new.
_RENAMED = {
    **{name: f"gradsync.strategies.{name}" for name in (
        "Strategy", "AllReduce", "PriorityAllReduce", "ParameterServer", "P3", "CaSyncRing", "CaSyncPS",
        "CompressedAllGather", "PairAveraging", "STRATEGIES")},
    "DDP": "gradsync.strategies.TorchDDP",
    "SMA": "gradsync.strategies.ModelAveraging",
    "Hybrid": "gradsync.strategies.SparseHybrid",
    "strategy_names": "gradsync.strategies.names",
}

# The submodule gradsync.topology (the Topology class; no torch) is loaded here, before the function
# of the same name below: Python sets a package's attribute to a submodule when it first loads it,
# so loading it first leaves ``gradsync.topology`` the function from here on.
_import_module("gradsync.topology")


def init(*, backend: str | None = None, timeout_s: float | None = None, servers: int | None = None):
    """Join the job the environment describes (:func:`gradsync.runtime.init`); in an elastic job
    (``gradsync run --elastic``) through :mod:`gradsync.adapt.elastic`, which joins its current
    generation. Returns the :class:`~gradsync.topology.Topology`."""
    import os

    if os.environ.get("GRADSYNC_ELASTIC") == "1":
        import gradsync.adapt.elastic  # noqa: F401 - registers the elastic join with the runtime
    from gradsync import runtime

    return runtime.init(backend=backend, timeout_s=timeout_s, servers=servers)


def topology():
    """The :class:`~gradsync.topology.Topology` of this job (initialising from the environment)."""
    from gradsync import runtime

    return runtime.current().topology


def device():
    """This rank's device: ``cuda:LOCAL_RANK`` under NCCL, else ``cpu``."""
    from gradsync import runtime

    return runtime.current().transport.device


_lazy_names(__name__, _LAZY, modules=("strategies",), renamed=_RENAMED)

__all__ = ["init", "shutdown", "is_initialized", "distribute", "topology", "device", "sampler", "register",
           "GradsyncError", "ConfigError", "GradientEditedError", "ModelMismatchError", "PeerFailureError",
           "PeerProtocolError"]
__version__ = "0.1.0"
