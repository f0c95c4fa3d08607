"""Parameter servers: workers push gradients, servers aggregate and update, workers pull parameters.

The TensorFlow-PS / MXNet KVStore design (Li et al., OSDI 2014), with the update on the server, in
two strategies that share one wire protocol and one worker side:

- ``ps`` (:class:`ParameterServer`, :mod:`.sync`): synchronous; equal to the single-process
  reference. Servers are dedicated ranks or, with none, the workers themselves (co-located).
- ``ps-async`` (:class:`AsyncParameterServer`, :mod:`.asynchronous`): each push applied as it
  arrives, no barrier; dedicated servers only.

:mod:`.wire` is the protocol (control headers, fused groups of tensors, the partition of the
parameters over the servers); :mod:`.base` the worker's pushes and pulls and a server's aggregate
and answer, which both use.
"""
from gradsync.strategies.ps.asynchronous import AsyncParameterServer
from gradsync.strategies.ps.base import ParameterServerBase
from gradsync.strategies.ps.sync import ParameterServer
from gradsync.strategies.ps.wire import OP_LOAD, OP_SAVE, OP_STEP, OP_STOP, TAG_CONTROL, Fused, check_header, partition

_check_header = check_header  # its earlier, private name

__all__ = ["AsyncParameterServer", "ParameterServer", "ParameterServerBase", "partition", "check_header", "Fused",
           "OP_STEP", "OP_STOP", "OP_SAVE", "OP_LOAD", "TAG_CONTROL"]
