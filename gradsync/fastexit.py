"""How processes that load torch end quickly: gradsync's own programs (the ``gradsync`` commands,
the bench's ranks, a remote node's agent) as Python's exit does, less the interpreter's teardown of
every module (:func:`exit_now`); a training script, less the interpreter's last collections of
garbage (:func:`freeze_at_exit`)."""
from __future__ import annotations

import atexit
import gc
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


KEEP_GC_ENV = "GRADSYNC_EXIT_GC"
"""``1``: a training script ends with the interpreter's last collections of garbage (see :func:`freeze_at_exit`)."""
_FROZEN = False


def freeze_at_exit() -> None:
    """At the script's exit (after the ``atexit`` functions registered later, before those registered
    earlier), move every object into the garbage collector's permanent generation. The interpreter
    ends with collections over every object alive, torch's thousands of modules and functions among
    them: a second per process on a two-core machine, several while a job's processes end together,
    the cores a regrouped elastic job trains on. After the freeze those collections skip what was
    alive at exit. What changes: an object reachable only through a reference cycle at exit is not
    finalized (its ``__del__`` does not run), which Python never promised; close files and end
    threads explicitly. ``GRADSYNC_EXIT_GC=1`` keeps the collections. Called by ``gradsync.init()``."""
    global _FROZEN
    if _FROZEN or os.environ.get(KEEP_GC_ENV) == "1":
        return
    _FROZEN = True
    atexit.register(gc.freeze)
