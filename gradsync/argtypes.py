"""What the ``gradsync`` commands share in their arguments: types that refuse a bad value when the
command starts, with the flag named by argparse, not after a run; help text from docstrings."""
from __future__ import annotations

import argparse
import os
import re
from typing import Callable, TypeVar

T = TypeVar("T")


def output_file(path: str) -> str:
    """A file a command writes (``--json``, ``--trace``): refused if it names a folder."""
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{path!r} is a folder; name a file in it, e.g. {os.path.join(path, 'out.json')!r}")
    return path


def output_dir(path: str) -> str:
    """A folder a command writes into (``--out``, ``--logdir``; made if missing): refused if a file
    is there."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{path!r} is a file; name a folder (it is made if missing)")
    return path


def checked(parse: Callable[[str], T]) -> Callable[[str], T]:
    """An argparse type from a parser that raises ``ValueError`` (``ConfigError``) with a message for
    people: argparse shows that message after the flag's name, not its generic "invalid value"."""
    def convert(text: str) -> T:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def available_bytes() -> int | None:
    """This machine's available memory (Linux's MemAvailable), or None where it cannot be read:
    what a command checks a run's size against before it starts."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def plain(text: str | None) -> str | None:
    """A docstring as a terminal shows it: ``code`` and :role:`name` without their markup."""
    if text is None:
        return None
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", text)
    return re.sub(r"``([^`]+)``", r"\1", text)
