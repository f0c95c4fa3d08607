"""Sliced parameter servers: ``p3`` (P3, Jayarajan et al., SysML 2019) and its ablation ``ps-sliced``.

- :mod:`.strategy`: the two strategies and their options (:class:`P3`, :class:`SlicedParameterServer`);
- :mod:`.base`: what they share on a worker (set-up, hook points, pushes, checkpoints);
- :mod:`.serving`: a server's aggregate, update and answer, and the threads that receive every stream;
- :mod:`.wire`: the message layout.
"""
from gradsync.strategies.p3.base import SlicedServer
from gradsync.strategies.p3.strategy import P3, SlicedParameterServer
from gradsync.strategies.p3.wire import ANSWER, KEEPALIVE, POSTED, PUSH, STOP, TAG, Wire

__all__ = ["P3", "SlicedParameterServer", "SlicedServer", "Wire", "PUSH", "ANSWER", "STOP", "KEEPALIVE", "TAG", "POSTED"]
