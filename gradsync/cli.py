"""The ``gradsync`` command: a thin layer of argument parsing over the library.

Each subcommand lives next to the code it drives and contributes two functions,
``add_parser(subparsers)`` and ``main(args) -> int``; this file only wires them together. Only the
module of the subcommand being run is imported (most import torch, which takes seconds), so
``gradsync --help`` and ``gradsync --version`` answer at once.
"""
from __future__ import annotations

import argparse
import sys
from importlib import import_module

from gradsync.argtypes import plain
from gradsync.fastexit import exit_now

# name -> (module that adds its parser, one line for `gradsync --help`)
COMMANDS = {
    "run": ("gradsync.launch.cli", "start the workers and servers of a job"),
    "resize": ("gradsync.launch.cli", "ask a running elastic job (gradsync run --elastic) for N workers"),
    "demo": ("gradsync.demo", "why the strategies differ: an emulated and a simulated comparison"),
    "bench": ("gradsync.bench.cli", "measure strategies side by side and check them against a reference"),
    "simulate": ("gradsync.simulate.cli", "predict strategies' throughput at any scale (event simulator)"),
    "advise": ("gradsync.advise", "rank strategies and compressors for a model on a cluster (simulated)"),
    "strategies": ("gradsync.strategies.cli", "list the strategies: what each does, exact or not, backends"),
    "codecs": ("gradsync.compress.cli", "measure compressors' encode/decode speed, ratio and error"),
    "profile": ("gradsync.emulate.cli", "measure or derive a model's per-layer compute profile"),
    "trace": ("gradsync.trace", "join the per-rank timelines a job wrote (GRADSYNC_TRACE) into one"),
    "netcheck": ("gradsync.bench.netcheck", "measure the links of an emulated cluster"),
    "cluster": ("gradsync.cluster.cli", "manage emulated clusters (cleanup)"),
    "experiment": ("gradsync.experiment.cli", "run, keep, report and check the published experiments"),
    "machine": ("gradsync.experiment.cli", "register clusters as targets for gradsync experiment"),
}


def _version() -> str:
    from gradsync import __version__

    return f"gradsync {__version__}"


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser with ``command``'s arguments; every other subcommand is only named (and loads
    when it is the one asked for)."""
    parser = argparse.ArgumentParser(
        prog="gradsync",
        description="Data-parallel training with pluggable synchronization strategies.",
    )
    parser.add_argument("--version", action="version", version=_version())
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    if command in COMMANDS:
        import_module(COMMANDS[command][0]).add_parser(subparsers)
        for sub in subparsers.choices.values():
            sub.description = plain(sub.description)
    for name, (_, line) in COMMANDS.items():
        if name not in subparsers.choices:
            subparsers.add_parser(name, help=line, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command)
    args = parser.parse_args(argv)
    return int(args.handler(args) or 0)


def run() -> None:
    """The ``gradsync`` executable: :func:`main`, then :func:`exit_now` with its status."""
    exit_now(main())


if __name__ == "__main__":
    run()
