"""gradsync: data-parallel PyTorch training with pluggable synchronization strategies.

    import gradsync
    gradsync.init()
    opt = gradsync.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy="allreduce")
    for x, y in loader:
        loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()

See README.md and docs/architecture.md.
"""
from gradsync.distribute import distribute
from gradsync.errors import ConfigError, GradsyncError, ModelMismatchError, PeerFailureError
from gradsync.runtime import init, is_initialized, shutdown
from gradsync.strategies import (DDP, STRATEGIES, AllReduce, ParameterServer, Strategy, register,
                                 strategy_names)


def topology():
    """The :class:`~gradsync.topology.Topology` of this job (initialising from the environment)."""
    from gradsync import runtime

    return runtime.current().topology


__all__ = ["init", "shutdown", "is_initialized", "distribute", "topology", "Strategy", "AllReduce",
           "ParameterServer", "DDP", "STRATEGIES", "register", "strategy_names", "GradsyncError",
           "ConfigError", "ModelMismatchError", "PeerFailureError"]
__version__ = "0.1.0"
