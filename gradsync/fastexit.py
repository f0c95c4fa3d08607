"""How gradsync's own programs end (the ``gradsync`` commands, the bench's ranks, a remote node's
agent): as Python's exit does, less the interpreter's teardown of every module."""
from __future__ import annotations

import atexit
import os
import sys
import threading


def exit_now(code: int) -> None:
    """End this process as Python's exit does (its other threads joined, the ``atexit`` functions
    run, the output flushed) without the interpreter's teardown of every module, which takes half a
    second once torch is loaded: the time every ``gradsync`` command would add to its own end."""
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader gone (a pipe closed early) or a stream closed: nothing to keep
            pass
    os._exit(code)
