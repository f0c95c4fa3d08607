"""The ``gradsync`` command: a thin layer of argument parsing over the library.

Each subcommand lives next to the code it drives and contributes two functions,
``add_parser(subparsers)`` and ``main(args) -> int``; this file only wires them together.
"""
from __future__ import annotations

import argparse
import sys


def _subcommands():
    # Imported lazily so `gradsync --help` does not pay for importing torch.
    from gradsync import launch
    from gradsync.bench import cli as bench_cli
    from gradsync.cluster import cli as cluster_cli
    from gradsync.compress import cli as codecs_cli
    from gradsync.emulate import cli as profile_cli

    return {"run": launch, "bench": bench_cli, "netcheck+cluster": cluster_cli, "profile": profile_cli, "codecs": codecs_cli}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gradsync",
        description="Data-parallel training with pluggable synchronization strategies.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in _subcommands().values():
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
