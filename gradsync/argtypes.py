"""Argument types the ``gradsync`` commands share: a bad value is refused when the command starts,
with the flag named by argparse, not after a run."""
from __future__ import annotations

import argparse
import os


def output_file(path: str) -> str:
    """A file a command writes (``--json``, ``--trace``): refused if it names a folder."""
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{path!r} is a folder; name a file in it, e.g. {os.path.join(path, 'out.json')!r}")
    return path
