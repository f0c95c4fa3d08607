"""gradsync: data-parallel PyTorch training with pluggable synchronization strategies.

    import gradsync
    gradsync.init()
    opt = gradsync.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy="allreduce")
    for x, y in loader:
        loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()

See README.md and docs/architecture.md.

Importing the package does not import torch: the public names below load their module on first
use (PEP 562), so ``gradsync run`` (``gradsync.launch``, no torch) starts in milliseconds.
"""
from gradsync._lazy import lazy_names
from gradsync.errors import (ConfigError, GradientEditedError, GradsyncError, ModelMismatchError, PeerFailureError,
                             PeerProtocolError)

# Public name -> the module that defines it (each of these imports torch).
_LAZY = {
    "shutdown": "gradsync.runtime", "is_initialized": "gradsync.runtime",
    "distribute": "gradsync.attach", "sampler": "gradsync.data",
    **{name: "gradsync.strategies" for name in ("Strategy", "AllReduce", "ParameterServer", "DDP", "P3",
                                                 "PriorityAllReduce", "CaSyncRing", "CaSyncPS", "CompressedAllGather", "SMA", "PairAveraging",
                                                 "Hybrid", "STRATEGIES", "register", "strategy_names")},
}


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


lazy_names(__name__, _LAZY, functions=("topology",))

__all__ = ["init", "shutdown", "is_initialized", "distribute", "sampler", "topology", "device", "Strategy", "AllReduce",
           "ParameterServer", "DDP", "P3", "PriorityAllReduce", "CaSyncRing", "CaSyncPS", "CompressedAllGather", "SMA", "PairAveraging",
           "Hybrid", "STRATEGIES", "register", "strategy_names", "GradsyncError",
           "ConfigError", "GradientEditedError", "ModelMismatchError", "PeerFailureError", "PeerProtocolError"]
__version__ = "0.1.0"
