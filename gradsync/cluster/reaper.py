"""The reaper of one emulated cluster: ``python -m gradsync.cluster.reaper``.

Started by :class:`~gradsync.cluster.EmulatedCluster` in its own session, it reads the names of the
namespaces the cluster creates from a pipe. At end of file (the cluster closed normally, or its
process died, even by SIGKILL) it removes whatever of them still exists.
"""
import signal
import sys

from gradsync.cluster.netns import leftovers, remove

if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    names = [line.strip() for line in sys.stdin if line.strip()]
    existing = set(leftovers(include_live=True))
    remove([name for name in names if name in existing])
